//! The hits in progress when the host reads: a compiled hit a vCPU is in the middle of at a
//! pause (stepped to its end, [`finish_hits`]), and, in check mode, the host-evaluated
//! twins of a hit the compiled code took from a breakpoint ([`twin_hit`]) or whose
//! compiled return already ran ([`settle_returns`]).

use anyhow::Context as _;

use crate::compile::Facts;

use super::super::traps::{HitSessions, Traps};
use super::{host_hit_stopped, Guest};

/// Check mode, at a breakpoint that enters compiled code (no splice fits there): the
/// host-evaluated twin's hit, the guest left stopped. Returns whether the vCPU then stands at
/// the twin's out-of-line copy of the instruction, where the compiled code may take over.
pub(super) fn twin_hit(
    guest: &mut Guest,
    traps: &mut Traps,
    sessions: &mut HitSessions<'_, '_>,
    (vcpu, pc): (exotap_vmm::control::VcpuId, u64),
) -> anyhow::Result<bool> {
    host_hit_stopped(guest, traps, sessions, (vcpu, pc))?;
    let rip = match guest.session.machine.registers(vcpu)? {
        exotap_vmm::control::RegisterFile::X86_64(r) => r.rip,
        _ => return Ok(false),
    };
    Ok(traps.out_of_line(pc) == Some(rip))
}

/// Check mode, after [`finish_hits`] at a pause before a read: a vCPU at the host-evaluated
/// probes' return trampoline has run the compiled return bodies of its call (the compiled
/// trampoline returns into the host's) but not yet the host-evaluated ones; they run now, so
/// that both sides have counted the same returns when the host reads. The guest stays paused.
pub(super) fn settle_returns(
    guest: &mut Guest,
    traps: &mut Traps,
    sessions: &mut HitSessions<'_, '_>,
) -> anyhow::Result<()> {
    for vcpu in guest.session.machine.vcpus()? {
        let rip = match guest.session.machine.registers(vcpu)? {
            exotap_vmm::control::RegisterFile::X86_64(r) => r.rip,
            _ => continue,
        };
        if rip == traps.trampoline() {
            tracing::debug!("{vcpu} stands at the return trampoline: its return probes run now");
            host_hit_stopped(guest, traps, sessions, (vcpu, rip))?;
        }
    }
    Ok(())
}

/// Most single steps [`finish_hits`] takes per vCPU.
const FINISH_STEPS: usize = 100_000;
/// Stack words [`finish_hits`] looks at for a return address into the heap.
const STACK_SCAN: usize = 32;

/// At the last pause (and, in check mode, before each timer's pull): a vCPU in the middle
/// of a compiled hit is stepped to its end, so that the host reads what that hit printed
/// and updated (after the removal nothing would), and, in check mode, so that the compiled
/// side ends with the hits the host side counted (a vCPU that a host hit let go resumes
/// through the trap's out-of-line copy in the patch heap, then the splice's patch). In the
/// middle of a hit: its instruction pointer in the heap (not at a breakpoint of the
/// host-evaluated probes: the return trampoline's, which their disarm sends on), or in a
/// kernel function the compiled code called (`copy_from_kernel_nofault`, ...): a return
/// address into the heap, just after a call, near the top of its stack. Steps are taken
/// with the breakpoints still in; a backend that cannot step leaves the hit where it is,
/// saying so. A vCPU at a probe site itself has not been counted on either side. A probed
/// `call` relocated as `push <original next>; jmp <callee>` (the ftrace call of a guest
/// kprobe on the same function) is followed into its callee until it returns to the
/// function: the kprobe's handler counts that hit inside the same window as the compiled
/// probe (without it `compiled_counts_equal_the_guests_own_kprobes_at_the_same_stops`
/// failed once in CI: one `rt_sigaction` counted compiled and not by the kprobe).
pub(super) fn finish_hits(
    guest: &mut Guest,
    traps: Option<&Traps>,
    facts: &Facts,
) -> anyhow::Result<()> {
    let callees: Vec<u64> = [
        facts.copy_nofault,
        facts.realtime_ns,
        facts.stack_save,
        facts.memory.strncpy_kernel,
        facts.memory.strncpy_user,
        facts.memory.copy_user,
        facts.memory.kallsyms.map(|k| k.lookup),
    ]
    .into_iter()
    .flatten()
    .collect();
    let splicer = guest
        .session
        .splicer()
        .context("the session has no splicer")?;
    let (va, _, size) = splicer.heap_range();
    // Where each splice's patch goes back to the function: a relocated call of the spliced
    // instruction returns there.
    let resumes: std::collections::HashSet<u64> = splicer
        .installed
        .iter()
        .map(|i| i.addr.wrapping_add(i.original.len() as u64))
        .collect();
    let heap = va..va.saturating_add(size);
    let machine = &mut *guest.session.machine;
    for vcpu in machine.vcpus()? {
        let regs = match machine.registers(vcpu)? {
            exotap_vmm::control::RegisterFile::X86_64(r) => r,
            _ => continue,
        };
        let in_heap = |rip: u64| heap.contains(&rip) && !traps.is_some_and(|t| t.owns(rip));
        // Where a call out of the heap returns to, while the vCPU is in the callee.
        let mut callee = if in_heap(regs.rip) {
            None
        } else {
            match heap_return(machine, vcpu, regs.gpr[7], &heap, &callees) {
                Some(ret) => Some(ret),
                None => continue,
            }
        };
        let mut steps = 0;
        let mut last = regs;
        // The stack pointer after the last push in the heap of a word from outside it, and
        // the step that saw it.
        let mut pushed: Option<(u64, usize)> = None;
        // A relocated call's original return address, once its callee runs.
        let mut tail: Option<u64> = None;
        loop {
            let regs = match machine.registers(vcpu)? {
                exotap_vmm::control::RegisterFile::X86_64(r) => r,
                _ => break,
            };
            if let Some(ret) = tail {
                // The relocated call returned into the function: the hit is over.
                if regs.rip == ret {
                    break;
                }
            } else {
                if callee == Some(regs.rip) {
                    callee = None;
                }
                if callee.is_none() && !in_heap(regs.rip) {
                    // Out of the heap: a call the compiled code made (its return address,
                    // just past the call, on top of the stack), a relocated call of the
                    // probed instruction (`push <original next>; jmp <callee>`: a guest
                    // kprobe's ftrace call, whose handler must run in the window too), or
                    // the end of the hit.
                    let top = read_word(machine, vcpu, regs.gpr[7]);
                    let called = steps > 0
                        && in_heap(last.rip)
                        && regs.gpr[7] == last.gpr[7].wrapping_sub(8)
                        && top.is_some_and(|t| t > last.rip && t - last.rip <= 15);
                    let relocated = steps > 0
                        && in_heap(last.rip)
                        && pushed == Some((regs.gpr[7], steps - 1))
                        && top.is_some_and(|t| resumes.contains(&t));
                    if called {
                        callee = top;
                    } else if relocated {
                        tail = top;
                    } else {
                        break;
                    }
                } else if callee.is_none()
                    && steps > 0
                    && regs.gpr[7] == last.gpr[7].wrapping_sub(8)
                    && read_word(machine, vcpu, regs.gpr[7]).is_some_and(|w| !heap.contains(&w))
                {
                    pushed = Some((regs.gpr[7], steps));
                }
            }
            if steps == FINISH_STEPS {
                tracing::warn!(
                    "{vcpu} is still in exotap's code after {FINISH_STEPS} steps: its last \
                     compiled hit may be missing from the output"
                );
                break;
            }
            if let Err(e) = machine.step(vcpu) {
                tracing::warn!(
                    "{vcpu} is in the middle of a compiled hit and cannot be stepped to its \
                     end ({e}): that hit may be missing from the output"
                );
                break;
            }
            last = regs;
            steps += 1;
        }
        if steps > 0 {
            tracing::info!("{vcpu} finished its last compiled hit in {steps} steps");
        }
    }
    Ok(())
}

/// The word at `addr` in the guest's kernel view.
fn read_word(
    machine: &mut dyn exotap_vmm::control::Machine,
    vcpu: exotap_vmm::control::VcpuId,
    addr: u64,
) -> Option<u64> {
    let mut b = [0u8; 8];
    machine.read_virt(vcpu, addr, &mut b).ok()?;
    Some(u64::from_le_bytes(b))
}

/// A return address into `heap` near the top of the stack at `rsp` that follows a call
/// (`call rel32` or `call [rip+disp32]`, as iced-x86 assembles a call to an absolute
/// address) of one of the kernel functions compiled code calls (`callees`): the vCPU is in
/// such a function, called from a compiled body. (A return address a `.return` probe
/// swapped is the trampoline's: no call of those precedes it.)
fn heap_return(
    machine: &mut dyn exotap_vmm::control::Machine,
    vcpu: exotap_vmm::control::VcpuId,
    rsp: u64,
    heap: &std::ops::Range<u64>,
    callees: &[u64],
) -> Option<u64> {
    let mut words = vec![0u8; 8 * STACK_SCAN];
    machine.read_virt(vcpu, rsp, &mut words).ok()?;
    words
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
        .filter(|w| *w >= heap.start.saturating_add(6) && heap.contains(w))
        .find(|w| {
            let mut b = [0u8; 6];
            if machine.read_virt(vcpu, w - 6, &mut b).is_err() {
                return false;
            }
            let rel =
                |at: usize| i64::from(i32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]));
            let target = if b[1] == 0xe8 {
                Some(w.wrapping_add_signed(rel(2)))
            } else if b[0] == 0xff && b[1] == 0x15 {
                read_word(machine, vcpu, w.wrapping_add_signed(rel(2)))
            } else {
                None
            };
            target.is_some_and(|t| callees.contains(&t))
        })
}
