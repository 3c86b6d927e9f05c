//! What a host-evaluated probe sees at its stop ([`LiveContext`]): the stopped vCPU's
//! registers and arguments, the current task, guest memory, kernel stacks and symbols, read on
//! demand through the backend; and guru-mode writes put back before the vCPU resumes.

use super::*;

/// The guest side of a probe hit: read on demand from the stopped vCPU.
pub(super) struct LiveContext<'a> {
    pub(super) machine: RefCell<&'a mut dyn Machine>,
    pub(super) vcpu: VcpuId,
    pub(super) regs: X86Registers,
    pub(super) point: &'a ArmedPoint,
    pub(super) survey: &'a Survey,
    pub(super) tasks: Option<TaskOffsets>,
    pub(super) ids: Option<TaskIds>,
    pub(super) task: OnceCell<Option<(i64, String)>>,
    /// ORC tables for `backtrace()` and friends ([`crate::live::stacks`]).
    pub(super) stacks: Option<&'a crate::live::stacks::KernelStacks>,
    /// Where `task_struct` keeps a sleeping task's stack pointer, for `task_backtrace()`.
    pub(super) task_layout: Option<crate::live::stacks::TaskLayout>,
    /// At a return: the entry's argument registers and rax.
    pub(super) at_return: Option<(X86Registers, u64)>,
    /// At a return: the `@entry(...)` values the entry of this call evaluated.
    pub(super) entry_values: &'a [(usize, Result<Value, String>)],
    /// The kernel's types, for member chains and `@cast` (`None` without BTF).
    pub(super) types: Option<&'a BtfTypes>,
    /// The kernel globals the script reads (`@var`), at link-time addresses.
    pub(super) globals: &'a KernelGlobals,
    /// Link-time address of `jiffies_64`.
    pub(super) jiffies: Option<u64>,
    /// Guru-mode writes of this hit: register (index into [`X86Registers::gpr`]) and value,
    /// put into the vCPU before it resumes.
    pub(super) writes: RefCell<Vec<(usize, u64)>>,
}

impl LiveContext<'_> {
    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        let mut machine = self.machine.borrow_mut();
        if self.regs.in_kernel() {
            // The vCPU stopped in kernel code, so its CR3 is the kernel's: QEMU walks it.
            machine.read_virt(self.vcpu, addr, &mut buf).ok()?;
        } else {
            // A `timer.profile` sample in user mode: with page-table isolation the user CR3
            // maps no kernel data; its kernel twin does.
            let la57 = self.regs.cr4 & (1 << 12) != 0;
            let mut mem = BackendMemory(&mut **machine);
            AddressSpace::new(&mut mem, pti_kernel_cr3(self.regs.cr3), la57)
                .read(addr, &mut buf)
                .ok()?;
        }
        Some(buf)
    }

    fn read_u64(&self, addr: u64) -> Option<u64> {
        let b = self.read(addr, 8)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    }

    fn read_i32(&self, addr: u64) -> Option<i64> {
        let b = self.read(addr, 4)?;
        Some(i64::from(i32::from_le_bytes(b.try_into().ok()?)))
    }

    /// The current task's `task_struct`: the per-CPU `current_task` of the stopped vCPU.
    fn current_task(&self) -> Option<u64> {
        let base = self.regs.kernel_percpu_base();
        self.read_u64(base.wrapping_add(self.survey.layout.current_task_offset))
            .filter(|t| *t != 0)
    }

    /// pid and comm of the current task, read once per hit.
    fn task(&self) -> Option<&(i64, String)> {
        self.task
            .get_or_init(|| {
                let offsets = self.tasks?;
                let task = self.current_task()?;
                let pid = self.read(task.wrapping_add(offsets.pid), 4)?;
                let pid = i32::from_le_bytes(pid.try_into().ok()?);
                let comm = self.read(task.wrapping_add(offsets.comm), 16)?;
                let comm = comm.split(|b| *b == 0).next().unwrap_or(&comm);
                Some((i64::from(pid), String::from_utf8_lossy(comm).into_owned()))
            })
            .as_ref()
    }

    /// Follows `steps` from `base` through guest memory; `what` names the expression.
    fn follow(&self, what: &str, base: u64, steps: &[Step]) -> Result<Value, String> {
        self.follow_indexed(what, base, steps, &[])
    }

    /// As [`Self::follow`], with the values of the chain's computed subscripts.
    fn follow_indexed(
        &self,
        what: &str,
        base: u64,
        steps: &[Step],
        indexes: &[i64],
    ) -> Result<Value, String> {
        crate::live::host_context::follow_steps(what, base, steps, indexes, |at, len| {
            self.read(at, len)
        })
    }

    /// The target variable `name` by its DWARF location here: not at a return, and not a
    /// parameter BTF names at an entry (read from its ABI register, as compiled).
    fn local(&self, name: &str) -> Option<&Local> {
        let name = name.strip_prefix('$')?;
        if self.at_return.is_some() || self.point.params.iter().any(|p| p == name) {
            return None;
        }
        self.point.locals.as_ref()?.get(name)?.as_ref().ok()
    }

    /// A local's value in the stopped vCPU's registers and memory.
    fn local_value(&self, local: &Local) -> Result<i64, String> {
        // DWARF numbers rax rdx rcx rbx rsi rdi rbp rsp r8-r15; gdb's order differs.
        const GPR: [usize; 16] = [0, 3, 2, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
        let reg = |r: u16| GPR.get(usize::from(r)).map_or(0, |i| self.regs.gpr[*i]);
        local
            .value(reg, |at, len| self.read(at, len), self.survey.kaslr.slide)
            .map_err(|addr| {
                format!(
                    "kernel read fault in a target variable: {}",
                    MemoryError::Unreadable { addr }
                )
            })
    }

    /// An argument as it was at the entry (for a return probe too), or as this hit wrote it.
    fn argument(&self, index: usize) -> Option<u64> {
        let regs = self
            .at_return
            .as_ref()
            .map_or(&self.regs, |(entry, _)| entry);
        let r = *ARG_REGS.get(index)?;
        if self.at_return.is_none() {
            if let Some(v) = self.written(r) {
                return Some(v);
            }
        }
        Some(regs.gpr[r])
    }

    /// `$var$`, `$var$$`, `$$parms$[$]`, `$$return$[$]`, `$return$[$]`: the parameters and
    /// return value pretty-printed from BTF ([`crate::live::pretty`]); `None` for any other path.
    fn pretty_target(&self, path: &str) -> Option<String> {
        let deep = path.ends_with("$$") && path.len() > 3 && !path[..path.len() - 2].is_empty();
        let base = path.strip_suffix(if deep { "$$" } else { "$" })?;
        if base.is_empty() || base == "$" {
            return None;
        }
        let btf = &self.types?.0;
        let sig = btf.func_signature(&self.point.function).ok();
        let param_type = |name: &str| -> Option<u32> {
            sig.as_ref()?
                .params
                .iter()
                .find(|p| p.0 == name)
                .map(|p| p.1)
        };
        let read = |at: u64, len: usize| self.read(at, len);
        let ret = || -> Option<String> {
            let rax = self
                .at_return
                .map(|(_, rax)| self.written(0).unwrap_or(rax))?;
            let ty = sig.as_ref()?.ret;
            Some(crate::live::pretty::pretty(btf, ty, rax, deep, &read))
        };
        match base {
            "$$parms" => Some(
                self.point
                    .params
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| !p.is_empty())
                    .map(|(i, p)| {
                        let v = match (self.argument(i), param_type(p)) {
                            (Some(v), Some(ty)) => {
                                crate::live::pretty::pretty(btf, ty, v, deep, &read)
                            }
                            (Some(v), None) => format!("{v:#x}"),
                            (None, _) => "?".into(),
                        };
                        format!("{p}={v}")
                    })
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
            "$$return" => ret().map(|r| format!("return={r}")),
            "$return" => ret(),
            _ => {
                let name = base.strip_prefix('$')?;
                let index = self.point.params.iter().position(|p| p == name)?;
                let v = self.argument(index)?;
                Some(crate::live::pretty::pretty(
                    btf,
                    param_type(name)?,
                    v,
                    deep,
                    &read,
                ))
            }
        }
    }

    /// Argument `index` of the system call whose wrapper (`__x64_sys_NAME(const struct
    /// pt_regs *regs)`) was entered with `regs`: the user's register in that `pt_regs`, as
    /// SystemTap's `nd_syscall` probes make `int_arg()`/`pointer_arg()` read it on kernels
    /// with syscall wrappers (`__set_syscall_pt_regs`). The wrapper's own register argument is
    /// only the `pt_regs` pointer. Offsets: x86-64's `struct pt_regs`, the ptrace ABI
    /// (`user_regs_struct`'s first part), fixed since the architecture began.
    fn syscall_argument(&self, pt_regs: u64, index: usize) -> Option<u64> {
        // di, si, dx, r10, r8, r9.
        const OFFSETS: [u64; 6] = [112, 104, 96, 56, 72, 64];
        let off = *OFFSETS.get(index)?;
        self.read_u64(pt_regs.checked_add(off)?)
    }

    /// `var`'s member chain laid out from BTF and followed through guest memory: its value,
    /// or with `address` the last member's address (`&$p->m`). From a local's struct pointer
    /// (DWARF), a parameter (BTF's signature) or `$return`.
    fn walk_target(&self, var: &TargetVar, address: bool) -> Option<Result<Value, String>> {
        if spec_of(&var.name).is_some() {
            return self.walk_global(var, address);
        }
        let types = self.types?;
        let path = if address {
            format!("&{}", var.path())
        } else {
            var.path()
        };
        let base = chain_base(
            &var.name,
            &self.point.params,
            self.at_return.is_some(),
            self.point.locals.as_deref(),
        )?;
        let value = match base {
            ChainBase::Local(_) => self.local_value(self.local(&var.name)?),
            ChainBase::Param(None) => Ok(self.at_return?.1 as i64),
            ChainBase::Param(Some(name)) => {
                let index = self.point.params.iter().position(|p| p == name)?;
                Ok(self.argument(index)? as i64)
            }
        };
        Some(value.and_then(|base_value| {
            target_chain(
                types,
                &self.point.function,
                &var.name,
                base,
                &var.members,
                address,
            )
            .map_err(|e| format!("{path}: {e}"))
            .and_then(|steps| self.follow(&path, base_value as u64, &steps))
        }))
    }

    /// A kernel global `@var("name")` and its member chain, read from its slid address: its
    /// value, or with `address` the last member's address; `None` for any other variable.
    fn walk_global(&self, var: &TargetVar, address: bool) -> Option<Result<Value, String>> {
        let spec = spec_of(&var.name)?;
        let path = if address {
            format!("&{}", var.path())
        } else {
            var.path()
        };
        let global = match self.globals.get(&spec) {
            Some(Ok(g)) => g,
            Some(Err(why)) => return Some(Err(format!("{path}: {why}"))),
            None => return Some(Err(format!("{path}: the kernel global was not looked up"))),
        };
        let Some(types) = self.types else {
            return Some(Err(format!("{path}: the kernel image has no BTF")));
        };
        let layout = if address {
            crate::compile::globals::address_steps
        } else {
            crate::compile::globals::steps
        };
        let at = global.link.wrapping_add(self.survey.kaslr.slide);
        Some(
            layout(types, global.ty, &var.members)
                .map_err(|e| format!("{path} ({}): {e}", global.type_name))
                .and_then(|steps| self.follow(&path, at, &steps)),
        )
    }

    /// `$$locals` as SystemTap prints it: every local (not parameter) DWARF has in scope at
    /// the point, in declaration order, `name=0x...`, or `name=?` where it cannot be read
    /// here (optimized out, a struct value, a location exotap does not read). Empty at a
    /// return, as the locals are gone. With `params`, the parameters DWARF places there too
    /// (`$$vars` away from a function's entry).
    fn locals_text(&self, params: bool) -> String {
        let Some(locals) = self
            .point
            .locals
            .as_ref()
            .filter(|_| self.at_return.is_none())
        else {
            return String::new();
        };
        locals
            .order
            .iter()
            .filter(|(_, is_param)| params || !is_param)
            .filter_map(|(name, _)| {
                let value = match locals.vars.get(name)? {
                    Ok(l) => self
                        .local_value(l)
                        .map_or_else(|_| "?".to_owned(), |v| format!("{:#x}", v as u64)),
                    Err(_) => "?".to_owned(),
                };
                Some(format!("{name}={value}"))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The last value this hit wrote to register `r`.
    fn written(&self, r: usize) -> Option<u64> {
        self.writes
            .borrow()
            .iter()
            .rev()
            .find(|(w, _)| *w == r)
            .map(|w| w.1)
    }
}

impl Context for LiveContext<'_> {
    fn entry_value(&self, key: usize) -> Option<Result<Value, String>> {
        self.entry_values
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    }

    fn target(&self, path: &str) -> Option<Value> {
        if path.starts_with("@var(") {
            let mut parts = path.split("->");
            let var = TargetVar {
                name: parts.next()?.to_owned(),
                members: parts.map(str::to_owned).collect(),
            };
            return self.walk_global(&var, false)?.ok();
        }
        if let Some(text) = self.pretty_target(path) {
            return Some(Value::Str(text));
        }
        if path == "$$locals" {
            return Some(Value::Str(self.locals_text(false)));
        }
        if path == "$$vars" {
            // Away from an entry, the parameters are where DWARF says too.
            if self.point.params.is_empty() {
                return Some(Value::Str(self.locals_text(true)));
            }
            let parms = match self.target("$$parms") {
                Some(Value::Str(p)) => p,
                _ => String::new(),
            };
            let locals = self.locals_text(false);
            let both = [parms, locals].into_iter().filter(|s| !s.is_empty());
            return Some(Value::Str(both.collect::<Vec<_>>().join(" ")));
        }
        if path == "$$parms" {
            let text: Vec<String> = self
                .point
                .params
                .iter()
                .enumerate()
                .filter_map(|(i, p)| Some(format!("{p}={:#x}", self.argument(i)?)))
                .collect();
            return Some(Value::Str(text.join(" ")));
        }
        if path == "$$return" {
            let rax = self
                .at_return
                .map(|(_, rax)| self.written(0).unwrap_or(rax))?;
            return Some(Value::Str(format!("return={rax:#x}")));
        }
        if path == "$return" {
            return self
                .at_return
                .map(|(_, rax)| Value::Long(self.written(0).unwrap_or(rax) as i64));
        }
        if let Some(local) = self.local(path) {
            return self.local_value(local).ok().map(Value::Long);
        }
        let name = path.strip_prefix('$')?;
        let index = self.point.params.iter().position(|p| p == name)?;
        self.argument(index).map(|v| Value::Long(v as i64))
    }

    fn target_defined(&self, var: &TargetVar) -> bool {
        if var.members.is_empty() || var.name.starts_with("$$") || spec_of(&var.name).is_some() {
            return self.target(&var.path()).is_some();
        }
        let base = chain_base(
            &var.name,
            &self.point.params,
            self.at_return.is_some(),
            self.point.locals.as_deref(),
        );
        chain_defined(
            self.types.map(|t| t as &dyn KernelTypes),
            &self.point.function,
            &var.name,
            base,
            &var.members,
        )
    }

    fn cast_defined(&self, cast: &CastExpr) -> bool {
        cast_defined(self.types.map(|t| t as &dyn KernelTypes), cast)
    }

    fn member_chain(&self, var: &TargetVar) -> Option<Result<Value, String>> {
        if var.members.is_empty() && spec_of(&var.name).is_none() {
            return None;
        }
        self.walk_target(var, false)
    }

    fn member_address(
        &self,
        var: Option<&TargetVar>,
        cast: Option<(u64, &CastExpr, &[i64])>,
    ) -> Option<Result<Value, String>> {
        let types = self.types?;
        if let Some((pointer, cast, indexes)) = cast {
            let what = format!("&@cast(..., \"{}\")", cast.type_name);
            let Some(ty) = types.named(&cast.type_name) else {
                return Some(Err(format!("{what}: BTF has no such type")));
            };
            return Some(
                cast_address_chain(types, ty, &cast.members)
                    .map_err(|e| format!("{what}: {e}"))
                    .and_then(|steps| self.follow_indexed(&what, pointer, &steps, indexes)),
            );
        }
        self.walk_target(var?, true)
    }

    fn cast(
        &self,
        pointer: u64,
        cast: &CastExpr,
        indexes: &[i64],
    ) -> Option<Result<Value, String>> {
        let types = self.types?;
        Some(crate::live::host_context::cast_value(
            types,
            pointer,
            cast,
            |what, steps| self.follow_indexed(what, pointer, steps, indexes),
        ))
    }

    fn write_target(&self, path: &str, value: i64) -> Result<(), String> {
        let reg = match (path, self.at_return.is_some()) {
            ("$return", true) => 0,
            ("$return", false) => return Err("'$return' is only written in a .return probe".into()),
            (_, true) => {
                return Err(format!(
                    "writing '{path}' in a return probe: the function has run"
                ))
            }
            (name, false) => {
                let index = name
                    .strip_prefix('$')
                    .and_then(|n| self.point.params.iter().position(|p| p == n))
                    .ok_or_else(|| {
                        format!(
                            "writing '{path}': only a parameter at a function's entry is written"
                        )
                    })?;
                *ARG_REGS
                    .get(index)
                    .ok_or_else(|| format!("writing '{path}': it is passed on the stack"))?
            }
        };
        self.writes.borrow_mut().push((reg, value as u64));
        Ok(())
    }

    fn pid(&self) -> i64 {
        match (self.ids, self.current_task()) {
            (Some(ids), Some(task)) => self.read_i32(task.wrapping_add(ids.tgid)).unwrap_or(-1),
            _ => self.tid(),
        }
    }

    fn tid(&self) -> i64 {
        self.task().map_or(-1, |t| t.0)
    }

    fn ppid(&self) -> i64 {
        let (Some(ids), Some(task)) = (self.ids, self.current_task()) else {
            return -1;
        };
        self.read_u64(task.wrapping_add(ids.real_parent))
            .and_then(|parent| self.read_i32(parent.wrapping_add(ids.tgid)))
            .unwrap_or(-1)
    }

    fn uid(&self) -> i64 {
        let (Some(ids), Some(task)) = (self.ids, self.current_task()) else {
            return -1;
        };
        self.read_u64(task.wrapping_add(ids.cred))
            .and_then(|cred| self.read_i32(cred.wrapping_add(ids.uid)))
            .map_or(-1, |uid| i64::from(uid as u32))
    }

    fn execname(&self) -> String {
        self.task().map_or_else(String::new, |t| t.1.clone())
    }

    fn cpu(&self) -> i64 {
        i64::from(self.vcpu.0)
    }

    fn probefunc(&self) -> String {
        self.point.function.clone()
    }

    fn read_kernel(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        self.read(addr, len).ok_or(MemoryError::Unreadable { addr })
    }

    fn jiffies(&self) -> Option<Result<i64, String>> {
        let at = self.jiffies?.wrapping_add(self.survey.kaslr.slide);
        Some(
            self.read_u64(at)
                .map(|v| v as i64)
                .ok_or_else(|| format!("jiffies_64 at {at:#x} cannot be read")),
        )
    }

    fn task_current(&self) -> Option<u64> {
        self.current_task()
    }

    fn probe_pc(&self) -> Option<(u64, bool)> {
        // At a return the vCPU stands at the trampoline, not in the probed code.
        if self.at_return.is_some() {
            return None;
        }
        Some((self.regs.rip, !self.regs.in_kernel()))
    }

    fn kernel_symbol(
        &self,
        addr: u64,
    ) -> Result<Option<crate::lang::eval::NamedAddress>, MemoryError> {
        let stacks = self.stacks.ok_or(MemoryError::NoMemory)?;
        Ok(stacks.name_address(addr))
    }

    fn arg_register(&self, n: i64) -> Option<u64> {
        let index = usize::try_from(n.checked_sub(1)?).ok()?;
        // In a syscall wrapper the `*_arg()` functions read the syscall's arguments from the
        // wrapper's one parameter, `$regs` (`$regs` itself stays the pointer).
        if self.point.function.starts_with("__x64_sys_") {
            return self.syscall_argument(self.argument(0)?, index);
        }
        self.argument(index)
    }

    fn kernel_backtrace(&self) -> Result<Vec<(u64, String)>, MemoryError> {
        let stacks = self.stacks.ok_or(MemoryError::NoMemory)?;
        let mut machine = self.machine.borrow_mut();
        Ok(crate::live::stacks::probe_backtrace(
            stacks,
            &mut **machine,
            self.survey,
            &self.regs,
        ))
    }

    fn task_backtrace(&self, task: u64) -> Result<Vec<(u64, String)>, MemoryError> {
        let stacks = self.stacks.ok_or(MemoryError::NoMemory)?;
        let layout = self.task_layout.ok_or(MemoryError::NoMemory)?;
        let current = self.survey.layout.current_task_offset;
        let mut machine = self.machine.borrow_mut();
        // A task running on a vCPU (all of them are stopped at a hit): from its registers.
        let vcpus = machine.vcpus().map_err(|_| MemoryError::NoMemory)?;
        for vcpu in vcpus {
            let regs = if vcpu == self.vcpu {
                self.regs
            } else {
                match machine.registers(vcpu) {
                    Ok(exotap_vmm::control::RegisterFile::X86_64(regs)) => regs,
                    _ => continue,
                }
            };
            let mut on = [0u8; 8];
            let at = regs.kernel_percpu_base().wrapping_add(current);
            if machine.read_virt(self.vcpu, at, &mut on).is_ok() && u64::from_le_bytes(on) == task {
                return Ok(crate::live::stacks::probe_backtrace(
                    stacks,
                    &mut **machine,
                    self.survey,
                    &regs,
                ));
            }
        }
        // Not running: its saved stack, as the kernel's own saved traces show it.
        Ok(crate::live::stacks::saved_task_backtrace(
            stacks,
            &mut **machine,
            self.survey,
            &layout,
            task,
        ))
    }

    fn pc_name(&self, addr: u64) -> Option<String> {
        self.stacks?.name_pc(addr)
    }
}
