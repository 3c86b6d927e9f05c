//! The end of a session of host-evaluated probes: every vCPU sent past the return
//! trampoline and every swapped return address put back before the detach
//! ([`Traps::disarm`]), and, while the session runs, the vCPUs that reached the trampoline
//! with no stop reported ([`Traps::send_on_parked`]).

use exotap_vmm::control::{Machine, VcpuId};

use super::returns::{self, Return};
use super::{registers, HitSessions, Traps, LOUD, TRAMPOLINE_OFFSET};
use crate::live::guest_memory::{read_kernel, write_kernel};
use crate::live::session::GuestSession;

impl Traps {
    /// Puts back the return addresses still swapped and empties the journal's return list
    /// (the guest paused); detaching then removes the breakpoints.
    pub fn disarm(&mut self, machine: &mut dyn Machine) {
        if let Err(e) = machine.pause() {
            tracing::error!("cannot pause the guest to put the return addresses back: {e}");
        }
        self.unwatch(machine);
        // A vCPU that returned into the trampoline and stopped at its breakpoint, where the
        // loop ended before handling that stop, would run the trampoline's `ud2` once the
        // breakpoint is gone: send it to the return address its `ret` popped (its return
        // probe does not run).
        let mut moved = 0;
        for vcpu in machine.vcpus().unwrap_or_default() {
            let regs = match registers(machine, vcpu) {
                Ok(regs) => regs,
                Err(e) => {
                    tracing::error!("cannot read {vcpu}'s registers at the removal: {e:#}");
                    continue;
                }
            };
            tracing::debug!(
                "{vcpu} at the removal: rip {:#x} rsp {:#x}",
                regs.rip,
                regs.gpr[7]
            );
            if regs.rip != self.trampoline {
                continue;
            }
            let slot = regs.gpr[7].wrapping_sub(8);
            let to = match self.pending.leave(slot) {
                Return::Calls(chain) => Some(chain.original),
                Return::Unaccounted { fallback } => fallback,
            };
            match to {
                Some(original) if machine.set_pc(vcpu, original).is_ok() => moved += 1,
                _ => tracing::error!(
                    "{vcpu} stopped at the return trampoline with no swapped return address at \
                     {slot:#x}: it will fault once exotap detaches"
                ),
            }
        }
        if moved > 0 {
            tracing::info!("{moved} vCPUs at the return trampoline sent on to their callers");
        }
        if self.unreported_returns > 0 {
            // QEMU's round-robin TCG reports one of the breakpoint stops that happen
            // together: the others wait at their breakpoints, found at the next look.
            tracing::info!(
                "{} returns of vCPUs found at the return trampoline with no stop reported \
                 there were handled at another vCPU's stop",
                self.unreported_returns
            );
        }
        // The slots are on kernel stacks: read and written through the kernel's page tables,
        // since vCPU 0 may have stopped in user mode, where PTI's user half maps no kernel
        // stack. A slot left swapped returns into the trampoline's `ud2` after the detach.
        // A tail chain's slot gets its bottom call's address, the real one.
        let mut restored = 0;
        let mut failed = 0;
        let chains: Vec<(u64, u64)> = self
            .pending
            .drain()
            .map(|(slot, chain)| (slot, chain.original))
            .collect();
        for (slot, original) in chains {
            let mut now = [0u8; 8];
            let read = read_kernel(machine, slot, &mut now);
            tracing::debug!(
                "in flight at {slot:#x}: holds {:#x} ({read:?}), goes back to {original:#x}",
                u64::from_le_bytes(now)
            );
            let mut slot = slot;
            match read {
                Ok(()) if u64::from_le_bytes(now) == self.trampoline => {}
                // The `ret` popped the slot, and an interrupt came before the trampoline's
                // first instruction: its frame, pushed over the slot, holds the trampoline
                // as the interrupted RIP, and the handler's `iret` would run the `ud2` after
                // the detach. That RIP gets the return address instead.
                Ok(()) => match interrupted_at(machine, slot, self.trampoline) {
                    Some(rip) => {
                        tracing::info!(
                            "a task interrupted at the return trampoline (its frame at \
                             {rip:#x}) resumes at {original:#x} instead"
                        );
                        slot = rip;
                    }
                    // The call returned since, or its task and stack are gone.
                    None => continue,
                },
                // Its task exited inside the call and its stack is unmapped: nothing returns.
                Err(e) => {
                    tracing::warn!("cannot read the swapped return address at {slot:#x}: {e:#}");
                    continue;
                }
            }
            match write_kernel(machine, slot, &original.to_le_bytes()) {
                Ok(()) => restored += 1,
                Err(e) => {
                    tracing::error!(
                        "cannot put the return address {original:#x} back at {slot:#x}: {e:#}; \
                         that call will fault when it returns"
                    );
                    failed += 1;
                }
            }
        }
        if restored > 0 {
            tracing::info!("{restored} calls in flight got their return addresses back");
        }
        if self.pending.missed > 0 {
            tracing::warn!(
                "{} calls missed their return probe: more than {} calls were in flight at once, \
                 or more than {} tail calls chained on one",
                self.pending.missed,
                crate::live::recover::RETURN_SLOTS,
                returns::MAX_TAIL_CHAIN
            );
        }
        if self.pending.tail_calls > 0 {
            tracing::info!(
                "{} calls entered through a tail call from a probed function: their return \
                 probes ran at their caller's return, innermost first",
                self.pending.tail_calls
            );
        }
        if self.pending.unaccounted > 0 {
            tracing::error!(
                "{} returns or entries at a swapped return address that exotap had no record of \
                 (see the errors above)",
                self.pending.unaccounted
            );
        }
        // Every vCPU is past the trampoline and every swapped address is back: from now on
        // a return into it is a bug to be loud about (`ud2`), not to park.
        if let Err(e) = machine.write_phys(self.journal.heap_phys + TRAMPOLINE_OFFSET, &LOUD) {
            tracing::warn!("cannot put ud2 back into the return trampoline: {e}");
        }
        if failed > 0 {
            // The journal keeps them: the guardian or `exotap recover` can try again.
            tracing::error!(
                "{failed} swapped return addresses could not be put back; the recovery journal \
                 keeps them"
            );
            return;
        }
        if let Err(e) = self.journal.clear_returns(machine) {
            tracing::warn!("cannot clear the recovery journal: {e:#}");
        }
    }

    /// Sends on every vCPU but `reported` that is at the return trampoline: one whose
    /// breakpoint stop was not reported (QEMU reports one stop of all those that happen at
    /// once, and a vCPU that came there without stopping is parked by its `jmp .`). Its
    /// return is handled as a stop there would be.
    pub(super) fn send_on_parked(
        &mut self,
        guest: &mut GuestSession,
        sessions: &mut HitSessions<'_, '_>,
        reported: VcpuId,
    ) -> anyhow::Result<()> {
        for vcpu in guest.machine.vcpus().unwrap_or_default() {
            if vcpu == reported {
                continue;
            }
            let rip = registers(&mut *guest.machine, vcpu)?.rip;
            if rip == self.trampoline {
                tracing::debug!(
                    "{vcpu} was at the return trampoline with no stop reported there: its \
                     return is handled now"
                );
                self.unreported_returns += 1;
                self.returned(guest, sessions, vcpu)?;
            }
        }
        Ok(())
    }
}

/// Where the interrupted RIP of an interrupt frame lies that a vCPU pushed when an interrupt
/// came after a `ret` popped `slot` and before the instruction at `trampoline` (the frame
/// the x86-64 processor pushes on the current stack, aligned down to 16 bytes from the stack
/// pointer `slot + 8`: RIP, CS, RFLAGS, RSP, SS), or `None` when the words there are not such
/// a frame.
fn interrupted_at(machine: &mut dyn Machine, slot: u64, trampoline: u64) -> Option<u64> {
    let rsp = slot.wrapping_add(8);
    let top = rsp & !15;
    let rip_at = top.wrapping_sub(40);
    let mut frame = [0u8; 40];
    read_kernel(machine, rip_at, &mut frame).ok()?;
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&frame[i * 8..i * 8 + 8]);
        u64::from_le_bytes(w)
    };
    let (rip, cs, rsp_saved) = (word(0), word(1), word(3));
    // The kernel's code segment (ring 0), and the stack pointer the `ret` left.
    (rip == trampoline && cs & 3 == 0 && rsp_saved == rsp).then_some(rip_at)
}
