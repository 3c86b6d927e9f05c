//! What a begin, end or timer probe of a live script sees on the host ([`HostContext`]): no
//! task and no stopped vCPU, as on any host-side probe, but the guest kernel's types, so that
//! layout questions are answered as SystemTap answers them when it compiles: `@defined` of a
//! `@cast` chain, and `&@cast(p, "T")->m...` where nothing is read on the way (the sizeof
//! idiom `&@cast(0, "T")[1]`, `offsetof` as `&@cast(0, "T")->m`). With the guest stopped
//! ([`HostContext::with_memory`]: a timer or procfs probe, which the host fires at a stop when
//! it reads guest memory) it also reads kernel memory, as a SystemTap timer does in the
//! kernel: `kernel_string()`, `@cast(p, "T")->m`; so do end probes, run before the detach
//! with the guest stopped. In begin probes a chain that would read guest memory is refused,
//! naming the address.

use std::cell::RefCell;
use std::sync::Arc;

use exotap_vmm::control::Machine;

use crate::compile::types::{cast_address_chain, cast_chain, cast_defined, KernelTypes, Step};
use crate::lang::ast::{CastExpr, TargetVar};
use crate::lang::context::{CapturedContext, Context, MemoryError};
use crate::lang::value::Value;

/// A host-side probe's context with the kernel's types ([`crate::lang::runtime::host_context`]
/// otherwise), and with guest memory where the guest is stopped.
pub(crate) struct HostContext<'m> {
    inner: CapturedContext,
    types: Option<Arc<dyn KernelTypes>>,
    memory: Option<RefCell<&'m mut dyn Machine>>,
}

impl HostContext<'static> {
    /// The host context, laying out `@cast` chains with `types`; no guest memory.
    pub(crate) fn new(types: Option<Arc<dyn KernelTypes>>) -> Self {
        Self {
            inner: crate::lang::runtime::host_context(),
            types,
            memory: None,
        }
    }
}

impl<'m> HostContext<'m> {
    /// [`HostContext::new`] reading kernel memory through `machine`, whose guest is stopped
    /// while the context lives.
    pub(crate) fn with_memory(
        types: Option<Arc<dyn KernelTypes>>,
        machine: &'m mut dyn Machine,
    ) -> Self {
        Self {
            inner: crate::lang::runtime::host_context(),
            types,
            memory: Some(RefCell::new(machine)),
        }
    }

    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let mut machine = self.memory.as_ref()?.borrow_mut();
        let mut buf = vec![0u8; len];
        crate::live::guest_memory::read_kernel(&mut **machine, addr, &mut buf).ok()?;
        Some(buf)
    }

    fn follow(
        &self,
        what: &str,
        pointer: u64,
        steps: &[Step],
        indexes: &[i64],
    ) -> Result<Value, String> {
        if self.memory.is_none() {
            return Step::follow(steps, pointer, indexes, |_, _| None)
                .map(Value::Long)
                .map_err(|addr| {
                    format!(
                        "{what}: the chain reads guest memory at {addr:#x}, which a begin \
                         probe does not read (only the layout is known there)"
                    )
                });
        }
        follow_steps(what, pointer, steps, indexes, |a, l| self.read(a, l))
    }
}

/// The value `steps` lead to from `pointer` through `read` (a `@cast` or member chain laid
/// out), or the read fault, named with `what`. Shared by the host-side and the stopped-vCPU
/// contexts.
pub(crate) fn follow_steps(
    what: &str,
    pointer: u64,
    steps: &[Step],
    indexes: &[i64],
    read: impl FnMut(u64, usize) -> Option<Vec<u8>>,
) -> Result<Value, String> {
    Step::follow(steps, pointer, indexes, read)
        .map(Value::Long)
        .map_err(|addr| {
            format!(
                "kernel read fault in {what}: {}",
                MemoryError::Unreadable { addr }
            )
        })
}

impl Context for HostContext<'_> {
    fn target(&self, path: &str) -> Option<Value> {
        self.inner.target(path)
    }
    fn pid(&self) -> i64 {
        self.inner.pid()
    }
    fn tid(&self) -> i64 {
        self.inner.tid()
    }
    fn ppid(&self) -> i64 {
        self.inner.ppid()
    }
    fn uid(&self) -> i64 {
        self.inner.uid()
    }
    fn execname(&self) -> String {
        self.inner.execname()
    }
    fn cpu(&self) -> i64 {
        self.inner.cpu()
    }
    fn probefunc(&self) -> String {
        self.inner.probefunc()
    }
    fn read_kernel(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        if self.memory.is_none() {
            return self.inner.read_kernel(addr, len);
        }
        self.read(addr, len).ok_or(MemoryError::Unreadable { addr })
    }
    fn target_defined(&self, var: &TargetVar) -> bool {
        self.inner.target_defined(var)
    }
    fn task_current(&self) -> Option<u64> {
        self.inner.task_current()
    }
    fn arg_register(&self, n: i64) -> Option<u64> {
        self.inner.arg_register(n)
    }

    fn cast_defined(&self, cast: &CastExpr) -> bool {
        cast_defined(self.types.as_deref(), cast)
    }

    fn member_address(
        &self,
        var: Option<&TargetVar>,
        cast: Option<(u64, &CastExpr, &[i64])>,
    ) -> Option<Result<Value, String>> {
        let Some((pointer, cast, indexes)) = cast else {
            return self.inner.member_address(var, None);
        };
        let types = self.types.as_deref()?;
        let what = format!("&@cast(..., \"{}\")", cast.type_name);
        let Some(ty) = types.named(&cast.type_name) else {
            return Some(Err(format!("{what}: BTF has no such type")));
        };
        Some(
            cast_address_chain(types, ty, &cast.members)
                .map_err(|e| format!("{what}: {e}"))
                .and_then(|steps| self.follow(&what, pointer, &steps, indexes)),
        )
    }

    fn cast(
        &self,
        pointer: u64,
        cast: &CastExpr,
        indexes: &[i64],
    ) -> Option<Result<Value, String>> {
        let types = self.types.as_deref()?;
        Some(cast_value(types, pointer, cast, |what, steps| {
            self.follow(what, pointer, steps, indexes)
        }))
    }
}

/// `@cast(pointer, "type")->members...` (the kernel's types only), laid out with `types`;
/// `follow` reads the laid-out steps from `pointer` (`what` names the cast in its errors).
/// Shared by the host-side and the stopped-vCPU contexts.
pub(crate) fn cast_value(
    types: &dyn KernelTypes,
    pointer: u64,
    cast: &CastExpr,
    follow: impl FnOnce(&str, &[Step]) -> Result<Value, String>,
) -> Result<Value, String> {
    let what = format!("@cast(..., \"{}\")", cast.type_name);
    if let Some(like) = &cast.like {
        return Err(format!(
            "a member of a local copied from {like} (SystemTap's autocast) is read in compiled \
             probes only; write @cast(local, \"struct TYPE\")->member"
        ));
    }
    if !cast.of_kernel() {
        return Err(format!("{what}: only the kernel's own types are known"));
    }
    if cast.members.is_empty() {
        return Ok(Value::Long(pointer as i64));
    }
    let ty = types
        .named(&cast.type_name)
        .ok_or_else(|| format!("{what}: BTF has no such type"))?;
    cast_chain(types, ty, &cast.members)
        .map_err(|e| format!("{what}: {e}"))
        .and_then(|steps| follow(&what, &steps))
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;
    use crate::compile::types::BtfTypes;
    use crate::lang::driver::{compile as check_script, ScriptSource};
    use crate::lang::output::{Format, Output};
    use crate::lang::runtime::Session;
    use crate::lang::Limits;
    use crate::live::check::Shared;

    /// `&@cast(0, "T")[1]` (SystemTap's sizeof idiom) and `&@cast(0, "T")->m` (offsetof) are
    /// the sizes and offsets BTF gives, in a begin probe; a chain through a pointer is an
    /// error naming the read.
    #[test]
    fn sizeof_and_offsetof_idioms_lay_out_from_btf_in_a_begin_probe() {
        let Some(image) = crate::live::kernel_image::cached_debian_image() else {
            eprintln!("SKIP: the Debian kernel is not cached (exotap image fetch)");
            return;
        };
        let btf = image.btf().unwrap();
        let task = btf.struct_by_name("task_struct").unwrap();
        let size = btf.size_of(task).unwrap();
        let pid = btf
            .struct_member("task_struct", "pid")
            .unwrap()
            .byte_offset()
            .unwrap();
        let source = ScriptSource {
            name: "t.stp".into(),
            text: r#"probe begin {
                printf("%d %d\n", & @cast(0, "task_struct")[1], & @cast(0, "task_struct")->pid)
                printf("%d\n", & @cast(0, "task_struct")->mm->mmap_base)
            }"#
            .into(),
        };
        let prog = check_script(&source, &Limits::default()).unwrap();
        let out = Shared(Rc::new(RefCell::new(Vec::new())));
        let err = Shared(Rc::new(RefCell::new(Vec::new())));
        let output = Output::new(Format::Text, Box::new(out.clone()), Box::new(err.clone()));
        let mut session = Session::new(&prog, Limits::default(), output, "t.stp", &source.text);
        let types: Arc<dyn KernelTypes> = Arc::new(BtfTypes(btf.clone()));
        session.set_host_context(Box::new(HostContext::new(Some(types))));
        session.begin();
        let _ = session.finish();
        let out = String::from_utf8(out.0.borrow().clone()).unwrap();
        let err = String::from_utf8(err.0.borrow().clone()).unwrap();
        assert_eq!(out, format!("{size} {pid}\n"), "stderr: {err}");
        assert!(err.contains("reads guest memory at 0x"), "{err}");
    }
}
