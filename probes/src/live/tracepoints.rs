//! Tracepoint probes (`kernel.trace("NAME")`): whether the guest has a tracepoint on, and
//! where a probe on it goes.
//!
//! A tracepoint's probe point is its iterator `__traceiter_NAME(void *__data, ARGS)`, which
//! calls every callback registered on it, but only with two or more: since Linux 5.10 a
//! tracepoint with one callback calls it through a static call, past the iterator. Then the
//! probe goes into that callback, guarded by its `data` (`tracepoint_callback`).
//!
//! # A tracepoint the guest has off: its call sites
//! SystemTap turns a tracepoint on by registering its probe as a callback inside the
//! kernel. From outside, turning the static key on is not enough: `__DO_TRACE_CALL` calls
//! the iterator only when `tracepoint.funcs` is not NULL, and a `funcs` array of exotap's in
//! the patch heap would be the guest's to free (`release_probes`, `kfree` through RCU) the
//! moment anything in the guest registers on the same tracepoint: a heap page handed to the
//! page allocator, a crash later. So exotap leaves the guest's tracepoint state alone and
//! probes where the tracepoint is called: `trace_NAME()` (and `trace_NAME_rcuidle()`) is a
//! `static inline` wrapper, and each call is an inlined instance in the -dbg vmlinux's DWARF
//! (`DW_TAG_inlined_subroutine`), whose entry pc runs once per call whether the key is on
//! or off, with the tracepoint's arguments as the wrapper's parameters (named as in
//! `TP_PROTO`, located by DWARF there). A probe on a tracepoint whose iterator path cannot
//! serve (off, or on with a lone callback that cannot be told apart) becomes a probe on
//! those instances, like `kernel.function("trace_NAME").inline`.

use anyhow::{bail, Context as _};
use exotap_introspect::btf::Btf;

use crate::lang::check::Program;
use crate::lang::point::{FunctionSite, PointKind};

use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::traps::read_guest;

/// Rewrites, in `prog`, each `kernel.trace` point on a tracepoint that the iterator path
/// cannot serve in this guest (off, or with a lone callback that cannot be told apart:
/// [`tracepoint_callback`]) into a probe on its call sites, the inlined instances of
/// `trace_NAME` and `trace_NAME_rcuidle` (module note). A pattern (`sched_*`) is split into
/// its tracepoints. Returns how many tracepoints moved to their call sites; where the -dbg
/// vmlinux is not cached, or it records no call site, the point stays and the install says
/// why it cannot fire.
///
/// # Errors
/// The -dbg vmlinux cannot be read.
pub(super) fn call_sites_where_off(
    att: &mut GuestSession,
    image: &KernelImage,
    prog: &mut Program,
) -> anyhow::Result<usize> {
    let has_trace = prog.probes.iter().any(|p| {
        p.points
            .iter()
            .any(|(_, k)| matches!(k, PointKind::KernelTrace { .. }))
    });
    if !has_trace {
        return Ok(0);
    }
    let btf = image.btf().ok();
    let lines = super::target_vars::source_lines(image);
    let init = match (
        image.symbols.get("_sinittext"),
        image.symbols.get("_einittext"),
    ) {
        (Some(s), Some(e)) => s.addr..e.addr,
        _ => 0..0,
    };
    // Per tracepoint: the wrappers with call sites, when the iterator cannot serve.
    let mut decided: std::collections::HashMap<String, Vec<String>> =
        std::collections::HashMap::new();
    let mut moved = 0;
    for probe in &mut prog.probes {
        let mut points = Vec::with_capacity(probe.points.len());
        for (point, kind) in std::mem::take(&mut probe.points) {
            let PointKind::KernelTrace { name } = &kind else {
                points.push((point, kind));
                continue;
            };
            let mut names: Vec<String> = image
                .symbols
                .matching(&format!("{TRACEPOINT_ITERATOR}{name}"))
                .into_iter()
                .filter_map(|s| s.name.strip_prefix(TRACEPOINT_ITERATOR).map(str::to_owned))
                .collect();
            names.sort();
            names.dedup();
            let mut split = Vec::new();
            let mut changed = false;
            for t in names {
                let wrappers = match decided.get(&t) {
                    Some(w) => w.clone(),
                    None => {
                        let serves = tracepoint_enabled(att, image, btf, &t).unwrap_or(false)
                            && tracepoint_callback(att, image, btf, &t).is_ok();
                        let mut wrappers = Vec::new();
                        if !serves {
                            if let Some(lines) = &lines {
                                for w in [format!("trace_{t}"), format!("trace_{t}_rcuidle")] {
                                    let sites = lines.inlined(&w, "*")?;
                                    let live = sites.iter().filter(|c| !init.contains(&c.entry));
                                    let n = live.count();
                                    if n > 0 {
                                        tracing::info!(
                                            "kernel.trace(\"{t}\") cannot fire through its \
                                             iterator in this guest (off, or its one callback \
                                             cannot be told apart): probing its {n} call \
                                             sites (the inlined {w}) instead"
                                        );
                                        wrappers.push(w);
                                    }
                                }
                            }
                            if !wrappers.is_empty() {
                                moved += 1;
                            }
                        }
                        decided.insert(t.clone(), wrappers.clone());
                        wrappers
                    }
                };
                if wrappers.is_empty() {
                    split.push(PointKind::KernelTrace { name: t });
                } else {
                    changed = true;
                    split.extend(wrappers.into_iter().map(|w| PointKind::KernelFunction {
                        pattern: w,
                        file: None,
                        line: None,
                        site: FunctionSite::Inline,
                    }));
                }
            }
            if changed {
                points.extend(split.into_iter().map(|k| (point.clone(), k)));
            } else {
                points.push((point, kind));
            }
        }
        probe.points = points;
    }
    Ok(moved)
}

/// Fails, naming each one, unless the guest has every tracepoint in `names` on.
///
/// # Errors
/// A tracepoint that is off, or whose state cannot be read.
pub(super) fn tracepoints_on<'n>(
    att: &mut GuestSession,
    image: &KernelImage,
    btf: Option<&Btf>,
    names: impl Iterator<Item = &'n str>,
) -> anyhow::Result<()> {
    let off: Vec<String> = names
        .filter_map(|name| match tracepoint_enabled(att, image, btf, name) {
            Ok(true) => None,
            Ok(false) => Some(format!(
                "kernel.trace(\"{name}\"): its static key is off (enable it inside the guest, \
                 e.g. echo 1 > /sys/kernel/tracing/events/*/{name}/enable)"
            )),
            Err(e) => Some(format!("kernel.trace(\"{name}\"): {e:#}")),
        })
        .collect();
    if !off.is_empty() {
        bail!(
            "tracepoints call their probes only while something in the guest has them on, and \
             exotap does not turn a guest's tracepoint on by itself (that would run the guest's \
             tracing code): \n  {}\nor probe the function that fires the tracepoint with \
             kernel.function; with the kernel's -dbg vmlinux cached (exotap image fetch \
             --debuginfo) exotap probes a tracepoint's call sites instead",
            off.join("\n  ")
        );
    }
    Ok(())
}

/// The tracepoint a resolved point names (`kernel.trace("NAME")`).
pub(super) fn tracepoint_name(point: &str) -> Option<&str> {
    point.strip_prefix("kernel.trace(\"")?.strip_suffix("\")")
}

/// Whether the guest has tracepoint `name` on: its `__tracepoint_NAME.key.enabled` is
/// positive once a tracer, perf or BPF in the guest attached to it. While it is off the
/// kernel jumps over the call to `__traceiter_NAME`, so a probe there would never fire.
///
/// # Errors
/// When BTF or the symbol table lacks the tracepoint, or guest memory cannot be read.
fn tracepoint_enabled(
    att: &mut GuestSession,
    image: &KernelImage,
    btf: Option<&Btf>,
    name: &str,
) -> anyhow::Result<bool> {
    let btf = btf.context("the kernel image has no BTF to lay out struct tracepoint")?;
    let enabled = btf
        .struct_member("tracepoint", "key.enabled")
        .ok()
        .and_then(|l| l.byte_offset())
        .context("BTF has no tracepoint.key.enabled")?;
    let at = image
        .address(&format!("__tracepoint_{name}"))?
        .wrapping_add(att.survey.kaslr.slide)
        .wrapping_add(enabled);
    let mut count = [0u8; 4];
    read_guest(&mut *att.machine, at, &mut count)
        .with_context(|| format!("cannot read __tracepoint_{name} at {at:#x}"))?;
    Ok(i32::from_le_bytes(count) > 0)
}

/// The prefix of a tracepoint's iterator, `__traceiter_NAME(void *__data, ARGS)`.
pub(super) const TRACEPOINT_ITERATOR: &str = "__traceiter_";

/// Where a probe on tracepoint `name` goes when the guest registered exactly one callback on
/// it: that callback (link-time address), and the `data` the kernel passes it as its first
/// argument. `None` with two or more: the probe stays at the iterator.
///
/// Since Linux 5.10 a tracepoint with one callback calls it through a static call, past
/// `__traceiter_NAME`; only with two or more does the iterator run, calling each. A probe
/// at the iterator would miss every hit of a tracepoint that only its trace event is on
/// (kmem, block, timer...), so there it goes into the callback, which has the iterator's
/// arguments. A trace event's callback (`trace_event_raw_event_CLASS`) serves every event
/// of its class; its `data`, the event's own file, tells them apart (the probe is guarded
/// by it). The choice is made once, at the install: a callback the guest adds or removes
/// while the probe is in moves its hits (as turning the tracepoint off stops them).
///
/// # Errors
/// No callback (the tracepoint is off), a lone callback outside the kernel image's text (a
/// module's, BPF's) or without data (the kernel's own, which may serve other tracepoints),
/// or memory or BTF that cannot be read.
pub(super) fn tracepoint_callback(
    att: &mut GuestSession,
    image: &KernelImage,
    btf: Option<&Btf>,
    name: &str,
) -> anyhow::Result<Option<(u64, u64)>> {
    let btf = btf.context("the kernel image has no BTF to lay out struct tracepoint")?;
    let offset = |s: &str, m: &str| {
        btf.struct_member(s, m)
            .ok()
            .and_then(|l| l.byte_offset())
            .with_context(|| format!("BTF has no {s}.{m}"))
    };
    let (funcs, func, data) = (
        offset("tracepoint", "funcs")?,
        offset("tracepoint_func", "func")?,
        offset("tracepoint_func", "data")?,
    );
    let size = btf
        .struct_by_name("tracepoint_func")
        .ok()
        .and_then(|t| btf.size_of(t))
        .context("BTF has no size for struct tracepoint_func")?;
    let slide = att.survey.kaslr.slide;
    let mut read = |at: u64| -> anyhow::Result<u64> {
        let mut word = [0u8; 8];
        read_guest(&mut *att.machine, at, &mut word)
            .with_context(|| format!("cannot read tracepoint {name}'s callbacks at {at:#x}"))?;
        Ok(u64::from_le_bytes(word))
    };
    let tracepoint = image
        .address(&format!("__tracepoint_{name}"))?
        .wrapping_add(slide);
    let first = read(tracepoint.wrapping_add(funcs))?;
    if first == 0 {
        bail!("kernel.trace(\"{name}\"): no callback is registered (the tracepoint is off)");
    }
    // The array ends with a NULL func.
    if read(first.wrapping_add(size).wrapping_add(func))? != 0 {
        return Ok(None);
    }
    let callback = read(first.wrapping_add(func))?;
    let data = read(first.wrapping_add(data))?;
    let link = callback.wrapping_sub(slide);
    let is_function = image
        .symbols
        .lookup_addr(link)
        .is_some_and(|(sym, offset)| sym.is_text() && offset == 0);
    if !is_function {
        bail!(
            "kernel.trace(\"{name}\"): its one callback, at {callback:#x}, is not a function \
             of the kernel image (a module's or BPF's), where exotap cannot probe"
        );
    }
    // A callback registered without data (the kernel's own: the cmdline recorder's
    // probe_sched_wakeup serves sched_wakeup and sched_wakeup_new alike) cannot tell this
    // tracepoint's calls from another's.
    if data == 0 {
        let callback_name = image
            .symbols
            .lookup_addr(link)
            .map_or_else(|| format!("{callback:#x}"), |(sym, _)| sym.name.clone());
        bail!(
            "kernel.trace(\"{name}\"): its one callback, {callback_name}, is the kernel's own \
             and may serve other tracepoints too, so its calls cannot be told apart; turn the \
             tracepoint's event on in the guest (echo 1 > \
             /sys/kernel/tracing/events/*/{name}/enable) and probe again"
        );
    }
    let mut code = [0u8; 32];
    read_guest(&mut *att.machine, callback, &mut code)
        .with_context(|| format!("cannot read tracepoint {name}'s callback at {callback:#x}"))?;
    Ok(Some((link + past_prologue(&code), data)))
}

/// Where a probe at a function's entry whose first instruction is too short for a splice
/// (event callbacks are `notrace`: no 5-byte ftrace call opens them) can go instead: at the
/// first instruction of 5 bytes or more, when every instruction before it leaves the
/// argument registers as the entry had them (register pushes, copies of arguments into
/// callee-saved registers: no branch, no other write to memory or to `rsp`). A body there
/// reads the entry's arguments. 0 (the entry) when there is no such instruction in `code`.
fn past_prologue(code: &[u8]) -> u64 {
    use exotap_introspect::x86::regs::RegSet;
    use iced_x86::{
        Decoder, DecoderOptions, FlowControl, InstructionInfoFactory, Mnemonic, OpAccess, Register,
    };
    const KEPT: RegSet = RegSet::SYSV_ARGS.with(Register::RSP);
    let mut decoder = Decoder::new(64, code, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut offset = 0;
    while decoder.can_decode() {
        let i = decoder.decode();
        if i.is_invalid() || i.flow_control() != FlowControl::Next {
            return 0;
        }
        if i.len() >= 5 {
            return offset;
        }
        let push = i.mnemonic() == Mnemonic::Push;
        let used = info.info(&i);
        let writes = |a: OpAccess| !matches!(a, OpAccess::Read | OpAccess::NoMemAccess);
        let kept = used
            .used_registers()
            .iter()
            .all(|r| !writes(r.access()) || !KEPT.contains(r.register().full_register()) || push);
        let memory = used
            .used_memory()
            .iter()
            .all(|m| !writes(m.access()) || push);
        if !kept || !memory {
            return 0;
        }
        offset += i.len() as u64;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracepoint_points_name_their_tracepoint_and_others_none() {
        assert_eq!(
            tracepoint_name("kernel.trace(\"sched_switch\")"),
            Some("sched_switch")
        );
        assert_eq!(tracepoint_name("kernel.function(\"vfs_read\")"), None);
        assert_eq!(tracepoint_name("kernel.trace(\"sched_switch\").x"), None);
    }

    #[test]
    fn event_callbacks_are_probed_past_their_prologue_at_a_long_instruction() {
        // trace_event_raw_event_sched_process_template of the Debian 6.1 guest: push %r12;
        // mov $0x6,%ecx (5 bytes).
        let template = [0x41, 0x54, 0xb9, 0x06, 0, 0, 0, 0x55, 0x48, 0x89, 0xfd];
        assert_eq!(past_prologue(&template), 2);
        // trace_event_raw_event_sched_switch: push %r15; mov %r8d,%r15d; push %r14;
        // mov %esi,%r14d; push %r13; push %r12; mov %rdi,%r12; push %rbp; mov %rcx,%rbp;
        // mov $0x6,%ecx at +21.
        let switch = [
            0x41, 0x57, 0x45, 0x89, 0xc7, 0x41, 0x56, 0x41, 0x89, 0xf6, 0x41, 0x55, 0x41, 0x54,
            0x49, 0x89, 0xfc, 0x55, 0x48, 0x89, 0xcd, 0xb9, 0x06, 0, 0, 0,
        ];
        assert_eq!(past_prologue(&switch), 21);
        // A 5-byte first instruction (the ftrace call) needs no move.
        assert_eq!(past_prologue(&[0x0f, 0x1f, 0x44, 0, 0, 0x55]), 0);
        // Before the long instruction: a write to an argument register (mov %rdx,%rdi), to
        // memory (mov %rax,(%rsp)), to rsp (sub $8,%rsp), or a branch (je): the entry.
        assert_eq!(
            past_prologue(&[0x55, 0x48, 0x89, 0xd7, 0xb9, 6, 0, 0, 0]),
            0
        );
        assert_eq!(
            past_prologue(&[0x48, 0x89, 0x04, 0x24, 0xb9, 6, 0, 0, 0]),
            0
        );
        assert_eq!(
            past_prologue(&[0x48, 0x83, 0xec, 0x08, 0xb9, 6, 0, 0, 0]),
            0
        );
        assert_eq!(past_prologue(&[0x74, 0x02, 0xb9, 6, 0, 0, 0]), 0);
        // Code that ends before a long instruction.
        assert_eq!(past_prologue(&[0x55, 0x53]), 0);
    }
}
