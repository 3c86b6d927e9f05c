//! The probed context a probe body runs on: target variables and task facts. Kernel backends
//! capture these into records; guest-free probes (`begin`, `end`, timers) run on an empty one.

use std::collections::HashMap;

use super::ast::{CastExpr, TargetVar};
use super::value::Value;

/// Why guest memory could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// This context has no guest memory (guest-free probes, records without a snapshot).
    #[error("no guest memory in this probe context")]
    NoMemory,
    /// The address is not mapped or not captured.
    #[error("cannot read guest memory at {addr:#x}")]
    Unreadable {
        /// The address.
        addr: u64,
    },
}

/// What a probe body may ask about the place and task it fired in.
pub trait Context {
    /// Value of a target variable by its path (`$fd`, `$file->f_pos`, `$return`, `$$parms`).
    fn target(&self, path: &str) -> Option<Value>;
    /// Process id.
    fn pid(&self) -> i64;
    /// Thread id.
    fn tid(&self) -> i64;
    /// Parent process id.
    fn ppid(&self) -> i64;
    /// User id.
    fn uid(&self) -> i64;
    /// Command name.
    fn execname(&self) -> String;
    /// CPU the probe fired on.
    fn cpu(&self) -> i64;
    /// Probed function (empty outside kernel probes).
    fn probefunc(&self) -> String;
    /// Reads guest kernel virtual memory.
    ///
    /// # Errors
    /// When the memory is not available.
    fn read_kernel(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError>;
    /// `@defined` of a target variable: for a member chain (`$timer->data`), whether it lays
    /// out from the kernel's types at this point, known before any value is read (as
    /// SystemTap decides it when compiling). The default: the variable has a value here.
    fn target_defined(&self, var: &TargetVar) -> bool {
        self.target(&var.path()).is_some()
    }
    /// `@defined(@cast(p, "T")->m...)`: whether the chain lays out from the kernel's types.
    /// The default: never (this context knows no types).
    fn cast_defined(&self, _cast: &crate::ast::CastExpr) -> bool {
        false
    }
    /// A member chain of a target variable (`$file->f_inode->i_ino`, `$return->m`), laid
    /// out from the kernel's types and read through guest memory. `None` where this context
    /// cannot follow chains (the default: only a context stopped in the guest can).
    ///
    /// # Errors
    /// Inside the `Some`: a sentence naming the member or the address that could not be read.
    fn member_chain(&self, _var: &TargetVar) -> Option<Result<Value, String>> {
        None
    }
    /// `&` of a member chain (`&$file->f_pos`; with `cast`, `&@cast(p, "T")->m` from the
    /// pointer `p` and the values of its computed subscripts): the member's address, laid out
    /// from the kernel's types. `None` where
    /// this context has no types (the default).
    ///
    /// # Errors
    /// Inside the `Some`: a sentence naming the step that could not be laid out or read.
    fn member_address(
        &self,
        _var: Option<&TargetVar>,
        _cast: Option<(u64, &crate::ast::CastExpr, &[i64])>,
    ) -> Option<Result<Value, String>> {
        None
    }
    /// Guru mode (`-g`): writes `value` to the target variable `path` (`$return` in a return
    /// probe, `$param` at an entry), where the probed code will see it. The default: this
    /// context cannot change guest state.
    ///
    /// # Errors
    /// A sentence saying why the write cannot be done here.
    fn write_target(&self, path: &str, _value: i64) -> Result<(), String> {
        Err(format!(
            "writing target variable '{path}' needs a probe stopped in the guest"
        ))
    }
    /// In a `.return` probe: the value `@entry(...)` expression `key` ([`entry_key`]) had
    /// when it was evaluated at the entry of this same call, or the error that evaluation
    /// raised. `None` where this context kept no entry values (the default: only a backend
    /// that stops at the function's entry for its return probes does).
    fn entry_value(&self, _key: usize) -> Option<Result<Value, String>> {
        None
    }
    /// The kernel's `jiffies` counter (its `jiffies_64`), read now. `None` where this
    /// context cannot read the guest's kernel variables (the default).
    ///
    /// # Errors
    /// Inside the `Some`: why it could not be read.
    fn jiffies(&self) -> Option<Result<i64, String>> {
        None
    }
    /// `@cast(pointer, "type")->member...`: `pointer` read as a pointer to the kernel type;
    /// `indexes` are the values of the chain's computed subscripts (`->fd[i]`), in order.
    /// `None` where this context has no kernel types (the default).
    ///
    /// # Errors
    /// Inside the `Some`: as [`Context::member_chain`].
    fn cast(
        &self,
        _pointer: u64,
        _cast: &CastExpr,
        _indexes: &[i64],
    ) -> Option<Result<Value, String>> {
        None
    }
    /// The kernel stack where the probe fired, innermost first: each frame's pc and its
    /// name as the kernel prints it (`func+0xoff/0xsize`). Only a context stopped in the
    /// guest has one; others answer [`MemoryError::NoMemory`] (the default).
    ///
    /// # Errors
    /// When there is no stack to unwind here.
    fn kernel_backtrace(&self) -> Result<Vec<(u64, String)>, MemoryError> {
        Err(MemoryError::NoMemory)
    }
    /// The kernel stack of the task whose `task_struct` is at `task`, innermost first, as
    /// [`Context::kernel_backtrace`] gives it: the stack where the probe fired for the
    /// current task, another vCPU's for a task running there, and the saved stack
    /// (`task->thread.sp`) of a task that is not running. Only a context stopped in the
    /// guest has one (the default answers [`MemoryError::NoMemory`]).
    ///
    /// # Errors
    /// When there is no stack to unwind here, or `task` cannot be read.
    fn task_backtrace(&self, _task: u64) -> Result<Vec<(u64, String)>, MemoryError> {
        Err(MemoryError::NoMemory)
    }
    /// The kernel address `addr` as `%pB` names it (`func+0xoff/0xsize`), for
    /// `sprint_stack()`: `None` where the context has no kernel symbols (the default).
    fn pc_name(&self, _addr: u64) -> Option<String> {
        None
    }
    /// The address of the current task's `task_struct` (`task_current()`). `None` where this
    /// context has no task (the default: only a context stopped in the guest has one).
    fn task_current(&self) -> Option<u64> {
        None
    }
    /// Where the probed context was stopped: its pc and whether it ran in user mode
    /// (`addr()`, `user_mode()`). `None` where this context has no registers (the default).
    fn probe_pc(&self) -> Option<(u64, bool)> {
        None
    }
    /// Argument `n` (1-based) of the probed function as its register held it at the entry
    /// (`int_arg(n)` and friends). `None` where this context has no registers (the default).
    fn arg_register(&self, _n: i64) -> Option<u64> {
        None
    }
    /// The kernel text symbol `addr` lies in: its name, the offset into it and its size;
    /// `Ok(None)` where no symbol covers it. Only a context stopped in the guest has the
    /// kernel's symbols; others answer [`MemoryError::NoMemory`] (the default).
    ///
    /// # Errors
    /// When this context has no kernel symbols.
    fn kernel_symbol(&self, _addr: u64) -> Result<Option<super::eval::NamedAddress>, MemoryError> {
        Err(MemoryError::NoMemory)
    }
}

/// The key an `@entry(...)` expression's entry-side value is kept under: the address of its
/// node in the checked program, which stays put while the program runs (two `@entry`s with
/// the same text in different places are different keys, as they are different evaluations).
pub fn entry_key(e: &super::ast::Expr) -> usize {
    std::ptr::from_ref(e) as usize
}

/// A context captured into a record (or made up for guest-free probes and tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapturedContext {
    /// Target variables by path.
    pub targets: HashMap<String, Value>,
    /// Process id.
    pub pid: i64,
    /// Thread id.
    pub tid: i64,
    /// Parent process id.
    pub ppid: i64,
    /// User id.
    pub uid: i64,
    /// Command name.
    pub execname: String,
    /// CPU.
    pub cpu: i64,
    /// Probed function.
    pub probefunc: String,
    /// Captured memory ranges: start address to bytes.
    pub memory: Vec<(u64, Vec<u8>)>,
    /// The argument registers at the entry, in calling-convention order (`int_arg(n)` and
    /// friends answer the n-th; empty: none, as outside a kernel probe).
    pub args: Vec<u64>,
    /// The current task's `task_struct` address (`task_current()`; `None`: no task).
    pub task: Option<u64>,
}

impl Context for CapturedContext {
    fn target(&self, path: &str) -> Option<Value> {
        self.targets.get(path).cloned()
    }

    /// A member chain is defined where the capture says so under `@defined(path)`, else
    /// where its value was captured.
    fn target_defined(&self, var: &TargetVar) -> bool {
        let path = var.path();
        match self.targets.get(&format!("@defined({path})")) {
            Some(v) => *v == Value::Long(1),
            None => self.targets.contains_key(&path),
        }
    }

    /// A cast's chain is defined where the capture says so under
    /// `@defined(@cast(T)->m...)`.
    fn cast_defined(&self, cast: &crate::ast::CastExpr) -> bool {
        let chain: String = cast.members.iter().map(|m| format!("->{m}")).collect();
        let key = format!("@defined(@cast({}){chain})", cast.type_name);
        self.targets.get(&key) == Some(&Value::Long(1))
    }

    /// `&$p->m`: the value captured under `&` and the chain's path (`&$p->m`), if any.
    fn member_address(
        &self,
        var: Option<&TargetVar>,
        _cast: Option<(u64, &crate::ast::CastExpr, &[i64])>,
    ) -> Option<Result<Value, String>> {
        let path = format!("&{}", var?.path());
        self.targets.get(&path).cloned().map(Ok)
    }

    fn arg_register(&self, n: i64) -> Option<u64> {
        let i = usize::try_from(n.checked_sub(1)?).ok()?;
        self.args.get(i).copied()
    }

    fn pid(&self) -> i64 {
        self.pid
    }

    fn tid(&self) -> i64 {
        self.tid
    }

    fn ppid(&self) -> i64 {
        self.ppid
    }

    fn uid(&self) -> i64 {
        self.uid
    }

    fn execname(&self) -> String {
        self.execname.clone()
    }

    fn cpu(&self) -> i64 {
        self.cpu
    }

    fn probefunc(&self) -> String {
        self.probefunc.clone()
    }

    fn task_current(&self) -> Option<u64> {
        self.task
    }

    fn read_kernel(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        if self.memory.is_empty() {
            return Err(MemoryError::NoMemory);
        }
        for (start, bytes) in &self.memory {
            let Some(off) = addr.checked_sub(*start) else {
                continue;
            };
            let Ok(off) = usize::try_from(off) else {
                continue;
            };
            let Some(end) = off.checked_add(len) else {
                continue;
            };
            if let Some(slice) = bytes.get(off..end) {
                return Ok(slice.to_vec());
            }
        }
        Err(MemoryError::Unreadable { addr })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captured_memory_is_readable_inside_its_range() {
        let ctx = CapturedContext {
            memory: vec![(0x1000, vec![1, 2, 3, 4])],
            ..Default::default()
        };
        assert_eq!(ctx.read_kernel(0x1001, 2), Ok(vec![2, 3]));
    }

    #[test]
    fn read_past_a_captured_range_fails() {
        let ctx = CapturedContext {
            memory: vec![(0x1000, vec![1, 2])],
            ..Default::default()
        };
        assert_eq!(
            ctx.read_kernel(0x1001, 2),
            Err(MemoryError::Unreadable { addr: 0x1001 })
        );
    }

    #[test]
    fn empty_context_has_no_memory() {
        assert_eq!(
            CapturedContext::default().read_kernel(0, 1),
            Err(MemoryError::NoMemory)
        );
    }
}
