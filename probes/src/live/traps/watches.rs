//! `kernel.data` probes: hardware watchpoints on kernel data, set through the backend
//! ([`Machine::set_watchpoint`]: QEMU's gdbstub `Z2`/`Z4`), whose probes the host runs at
//! each stop, after the accessing instruction, in the context of the vCPU that made the access
//! (its registers, its task, its kernel stack), as SystemTap's `kernel.data` probes run from
//! the kernel's hw_breakpoint handler.

use anyhow::{bail, Context as _};
use exotap_vmm::control::{Machine, VcpuId, WatchKind};

use crate::lang::check::Program;
use crate::lang::point::{DataTarget, PointKind};

use super::{registers, ArmedPoint, HitSessions, SiteProbe, Traps};
use crate::live::kernel_image::KernelImage;
use crate::live::session::GuestSession;

/// One watchpoint and the probes on it.
pub(super) struct Watch {
    /// Its first byte (the running kernel's address).
    addr: u64,
    len: u64,
    kind: WatchKind,
    probes: Vec<SiteProbe>,
    /// What the probes' contexts name (`pp()`, errors).
    point: ArmedPoint,
}

/// The running-kernel address of a `kernel.data` point: a number is one already (what
/// `/proc/kallsyms` says, as SystemTap's takes it), a symbol is the image's slid.
fn data_address(target: &DataTarget, image: &KernelImage, slide: u64) -> anyhow::Result<u64> {
    match target {
        DataTarget::Address(a) => Ok(*a),
        DataTarget::Symbol(name) => {
            let sym = image
                .symbols
                .get(name)
                .with_context(|| format!("the kernel has no symbol {name}"))?;
            if sym.is_text() {
                bail!(
                    "{name} is code, not data: probe it with kernel.function or kernel.statement"
                );
            }
            // Per-CPU variables are offsets into each CPU's area, not addresses.
            if sym.addr < 0xffff_0000_0000_0000 {
                bail!("{name} is a per-CPU variable (each CPU has its own copy at {:#x} into its area): watch one copy by its address", sym.addr);
            }
            Ok(sym.addr.wrapping_add(slide))
        }
    }
}

/// Sets a watchpoint for every `kernel.data` point of the probes `host` picks, the guest
/// paused.
///
/// # Errors
/// A symbol that is not kernel data, or a backend that cannot watch (with its reason).
pub(super) fn arm(
    guest: &mut GuestSession,
    image: &KernelImage,
    prog: &Program,
    host: &dyn Fn(usize) -> bool,
) -> anyhow::Result<Vec<Watch>> {
    let slide = guest.survey.kaslr.slide;
    let mut watches: Vec<Watch> = Vec::new();
    for (i, probe) in prog.probes.iter().enumerate().filter(|(i, _)| host(*i)) {
        for (pt, kind) in &probe.points {
            let PointKind::KernelData {
                target,
                len,
                write_only,
            } = kind
            else {
                continue;
            };
            let addr = data_address(target, image, slide).with_context(|| format!("{pt}"))?;
            let kind = if *write_only {
                WatchKind::Write
            } else {
                WatchKind::Access
            };
            let site = SiteProbe {
                probe: i,
                name: pt.to_string(),
                guard: None,
            };
            if let Some(w) = watches
                .iter_mut()
                .find(|w| (w.addr, w.len, w.kind) == (addr, *len, kind))
            {
                w.probes.push(site);
                continue;
            }
            // A stop names one watchpoint, not the access: on bytes watched both ways, a
            // write could be reported by the access watchpoint, and its .write probes missed.
            if let Some(w) = watches
                .iter()
                .find(|w| addr < w.addr.saturating_add(w.len) && w.addr < addr.saturating_add(*len))
            {
                bail!(
                    "{pt} watches bytes that {} also watches another way: one script watches the \
                     same bytes either for writes (.write) or for every access (.rw), not both",
                    w.point.name
                );
            }
            guest
                .machine
                .set_watchpoint(addr, *len, kind, true)
                .with_context(|| format!("cannot watch {pt} at {addr:#x}"))?;
            let function = match target {
                DataTarget::Symbol(s) => s.clone(),
                DataTarget::Address(_) => String::new(),
            };
            watches.push(Watch {
                addr,
                len: *len,
                kind,
                probes: vec![site],
                point: ArmedPoint::stopless(pt.to_string(), function),
            });
        }
    }
    if !watches.is_empty() {
        tracing::info!("{} watchpoints on kernel data", watches.len());
    }
    Ok(watches)
}

impl Traps {
    /// Whether a watchpoint stop at data address `addr` is one of these probes'.
    pub fn watches(&self, addr: u64) -> bool {
        self.watch_at(addr).is_some()
    }

    fn watch_at(&self, addr: u64) -> Option<usize> {
        self.watches
            .iter()
            .position(|w| addr >= w.addr && addr < w.addr.saturating_add(w.len))
    }

    /// Runs the probes of the watchpoint that stopped `vcpu` on data address `addr`, in
    /// `sessions`; the guest stays paused (the caller resumes it).
    ///
    /// # Errors
    /// When the vCPU's registers cannot be read.
    pub fn watch_hit_in(
        &mut self,
        guest: &mut GuestSession,
        sessions: &mut HitSessions<'_, '_>,
        vcpu: VcpuId,
        addr: u64,
    ) -> anyhow::Result<()> {
        let Some(i) = self.watch_at(addr) else {
            return Ok(());
        };
        self.know_new_modules(guest);
        let machine = &mut guest.machine;
        let regs = registers(machine, vcpu)?;
        let watch = &self.watches[i];
        let ctx = self.context_at(&watch.point, machine, &guest.survey, vcpu, regs, None, &[]);
        for p in &watch.probes {
            sessions.fire_main(p.probe, &p.name, &ctx);
            sessions.fire_shadow(p.probe, &p.name, &ctx);
        }
        Ok(())
    }

    /// [`Traps::watch_hit_in`] with the script's session alone.
    ///
    /// # Errors
    /// As [`Traps::watch_hit_in`].
    pub fn watch_hit(
        &mut self,
        guest: &mut GuestSession,
        session: &mut crate::lang::runtime::Session<'_>,
        vcpu: VcpuId,
        addr: u64,
    ) -> anyhow::Result<()> {
        let mut sessions = HitSessions {
            main: session,
            shadow: None,
        };
        self.watch_hit_in(guest, &mut sessions, vcpu, addr)
    }

    /// Removes every watchpoint (the guest paused); says which could not be.
    pub(super) fn unwatch(&mut self, machine: &mut dyn Machine) {
        for w in self.watches.drain(..) {
            if let Err(e) = machine.set_watchpoint(w.addr, w.len, w.kind, false) {
                tracing::error!("cannot remove the watchpoint {}: {e}", w.point.name);
            }
        }
    }
}
