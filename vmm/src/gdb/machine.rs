//! [`Machine`] over a QEMU gdbstub: the QEMU backend's control interface.

use std::time::Duration;

use super::client::{GdbClient, GdbError, Interrupter, StopReply, ThreadId};
use crate::control::{
    ControlError, Machine, RegisterFile, StopEvent, VcpuId, WatchKind, X86Registers, X86_GPR_NAMES,
};

const BACKEND: &str = "qemu gdbstub";
/// The segment registers of the target description, in [`X86Registers::segments`] order.
const SEGMENTS: [&str; 6] = ["cs", "ss", "ds", "es", "fs", "gs"];

fn backend(e: GdbError) -> ControlError {
    ControlError::Backend {
        backend: BACKEND,
        source: Box::new(e),
    }
}

fn memory(e: GdbError, addr: u64, len: usize, space: &'static str) -> ControlError {
    match e {
        GdbError::Refused { .. } | GdbError::Unexpected { .. } => {
            ControlError::Memory { addr, len, space }
        }
        other => backend(other),
    }
}

/// A QEMU guest controlled through its gdbstub (all-stop).
#[derive(Debug)]
pub struct GdbMachine {
    client: GdbClient,
    threads: Vec<ThreadId>,
    paused: bool,
    /// Byte offset and size of each register in the `g` packet, by name.
    layout: Vec<(String, usize, usize)>,
    /// The registers last read while stopped (several round trips each), until the vCPU
    /// runs or a register is written.
    regs_cache: Option<(VcpuId, X86Registers)>,
    /// Times the running guest stopped: at a [`Machine::pause`] or a stop event.
    stops: u64,
    /// The time the guest spent stopped (its clocks stand still then, under TCG).
    clock: std::sync::Arc<crate::control::PausedClock>,
    /// Whether QEMU runs the guest with TCG (asked once, by [`Machine::paused_clock`]).
    tcg: Option<bool>,
}

impl GdbMachine {
    /// Connects to a gdbstub (`tcp:HOST:PORT`, `HOST:PORT` or `unix:PATH`). QEMU stops the
    /// guest when a debugger connects, so the machine starts paused.
    ///
    /// # Errors
    /// When connecting or the handshake fails.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self, ControlError> {
        let mut client = GdbClient::connect(addr, timeout).map_err(backend)?;
        // QEMU answers `?` with the current stop state; this also flushes the stop reply it
        // sent on connect.
        client.stop_reason().map_err(backend)?;
        let threads = client.threads().map_err(backend)?;
        let mut offset = 0;
        let layout = client
            .registers()
            .iter()
            .map(|r| {
                let size = (r.bitsize as usize).div_ceil(8);
                let entry = (r.name.clone(), offset, size);
                offset += size;
                entry
            })
            .collect();
        Ok(Self {
            client,
            threads,
            paused: true,
            layout,
            regs_cache: None,
            stops: 0,
            clock: std::sync::Arc::new(crate::control::PausedClock::new(true)),
            tcg: None,
        })
    }

    /// A handle that stops the guest or cancels a wait for it from another thread (see
    /// [`Interrupter`]).
    ///
    /// # Errors
    /// When the socket cannot be shared.
    pub fn interrupter(&self) -> Result<Interrupter, ControlError> {
        self.client.interrupter().map_err(backend)
    }

    /// How many times the running guest was stopped since connecting: pauses asked for and
    /// stops it reported (breakpoints, steps). The stop on connect is not counted.
    pub fn stops(&self) -> u64 {
        self.stops
    }

    /// The underlying protocol client (monitor commands and other QEMU specifics).
    pub fn client(&mut self) -> &mut GdbClient {
        &mut self.client
    }

    fn thread(&self, vcpu: VcpuId) -> Result<ThreadId, ControlError> {
        self.threads
            .get(vcpu.0 as usize)
            .copied()
            .ok_or(ControlError::NoVcpu(vcpu))
    }

    fn vcpu_of(&self, thread: Option<ThreadId>) -> VcpuId {
        let index = thread
            .and_then(|t| self.threads.iter().position(|x| *x == t))
            .unwrap_or(0);
        VcpuId(u32::try_from(index).unwrap_or(0))
    }

    fn field(&self, all: &[u8], name: &str) -> Option<u64> {
        let (_, offset, size) = self.layout.iter().find(|(n, _, _)| n == name)?;
        let bytes = all.get(*offset..offset.checked_add(*size)?)?;
        let mut raw = [0u8; 8];
        for (dst, src) in raw.iter_mut().zip(bytes) {
            *dst = *src;
        }
        Some(u64::from_le_bytes(raw))
    }

    fn require_paused(&self) -> Result<(), ControlError> {
        if self.paused {
            Ok(())
        } else {
            Err(ControlError::Running)
        }
    }

    fn event_of(&mut self, reply: StopReply) -> Result<StopEvent, ControlError> {
        if !self.paused {
            self.stops += 1;
        }
        self.paused = true;
        self.clock.paused();
        self.regs_cache = None;
        match reply {
            StopReply::Signal {
                signal: 5,
                thread,
                info,
            } => {
                let vcpu = self.vcpu_of(thread);
                let pc = match self.registers(vcpu)? {
                    RegisterFile::X86_64(r) => r.rip,
                    RegisterFile::Sparc64(r) => r.pc,
                };
                Ok(match watched_address(&info) {
                    Some(addr) => StopEvent::Watchpoint { vcpu, pc, addr },
                    None => StopEvent::Breakpoint { vcpu, pc },
                })
            }
            StopReply::Signal { .. } => Ok(StopEvent::Paused),
            StopReply::Exited(_) | StopReply::Terminated(_) => Ok(StopEvent::Exited),
        }
    }

    /// The registers a kernel stack unwind needs, in fewer round trips than
    /// [`Machine::registers`]: `g` (general registers, rip, flags, segments) and the one GS
    /// base holding the kernel's per-CPU base (`gs_base` in kernel mode, `k_gs_base` in user
    /// mode, stored in both fields); fs_base, control registers and EFER are left at 0.
    /// A sampling profiler stops the guest for every read, so each round trip counts.
    ///
    /// # Errors
    /// When the vCPU runs, does not exist, or the stub's answer lacks a core register.
    pub fn unwind_registers(&mut self, vcpu: VcpuId) -> Result<X86Registers, ControlError> {
        self.require_paused()?;
        let thread = self.thread(vcpu)?;
        let all = self.client.read_all_registers(thread).map_err(backend)?;
        let get = |name: &str| {
            self.field(&all, name).ok_or_else(|| {
                backend(GdbError::Unexpected {
                    request: "g".into(),
                    reply: format!("{} bytes of registers, without {name}", all.len()),
                })
            })
        };
        let mut regs = X86Registers::default();
        for (slot, name) in regs.gpr.iter_mut().zip(X86_GPR_NAMES) {
            *slot = get(name)?;
        }
        regs.rip = get("rip")?;
        regs.rflags = get("eflags")?;
        for (slot, name) in regs.segments.iter_mut().zip(SEGMENTS) {
            *slot = u16::try_from(get(name)? & 0xffff).unwrap_or(0);
        }
        let base = if regs.in_kernel() {
            "gs_base"
        } else {
            "k_gs_base"
        };
        let value = match self.field(&all, base) {
            Some(v) => v,
            None => self
                .client
                .read_register_u64(thread, base)
                .map_err(backend)?,
        };
        regs.gs_base = value;
        regs.kernel_gs_base = value;
        Ok(regs)
    }

    /// Detaches: QEMU removes its breakpoints and the guest runs on.
    ///
    /// # Errors
    /// When the stub refuses.
    pub fn detach(mut self) -> Result<(), ControlError> {
        self.client.detach().map_err(backend)
    }

    /// Writes one 64-bit register of a stopped vCPU by its GDB name (`rsp`, `rcx`, ...); the
    /// host emulating a branch or call sets them this way.
    ///
    /// # Errors
    /// When the vCPU runs, does not exist, or the stub refuses.
    pub fn set_register(
        &mut self,
        vcpu: VcpuId,
        name: &str,
        value: u64,
    ) -> Result<(), ControlError> {
        self.require_paused()?;
        let thread = self.thread(vcpu)?;
        self.regs_cache = None;
        self.client
            .write_register(thread, name, &value.to_le_bytes())
            .map_err(backend)
    }
}

impl Machine for GdbMachine {
    fn stack_registers(&mut self, vcpu: VcpuId) -> Result<X86Registers, ControlError> {
        self.unwind_registers(vcpu)
    }
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        Ok((0..self.threads.len())
            .filter_map(|i| u32::try_from(i).ok())
            .map(VcpuId)
            .collect())
    }

    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.require_paused()?;
        self.client.set_physical_mode(true).map_err(backend)?;
        self.client
            .read_memory(addr, buf)
            .map_err(|e| memory(e, addr, buf.len(), "physical"))
    }

    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.require_paused()?;
        self.client.set_physical_mode(true).map_err(backend)?;
        self.client
            .write_memory(addr, data)
            .map_err(|e| memory(e, addr, data.len(), "physical"))
    }

    /// Pipelined ([`GdbClient::write_memory_batch`]): one round trip per 32 KiB of packets
    /// rather than per packet.
    fn write_phys_batch(&mut self, writes: &[(u64, &[u8])]) -> Result<(), ControlError> {
        self.require_paused()?;
        self.client.set_physical_mode(true).map_err(backend)?;
        self.client.write_memory_batch(writes).map_err(|(k, e)| {
            let (addr, data) = writes.get(k).copied().unwrap_or_default();
            memory(e, addr, data.len(), "physical")
        })
    }

    fn request_count(&self) -> Option<u64> {
        Some(self.client.packets())
    }

    fn read_virt(&mut self, vcpu: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.require_paused()?;
        let thread = self.thread(vcpu)?;
        self.client.set_physical_mode(false).map_err(backend)?;
        self.client.select_thread(thread).map_err(backend)?;
        self.client
            .read_memory(addr, buf)
            .map_err(|e| memory(e, addr, buf.len(), "virtual"))
    }

    fn write_virt(&mut self, vcpu: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.require_paused()?;
        let thread = self.thread(vcpu)?;
        self.client.set_physical_mode(false).map_err(backend)?;
        self.client.select_thread(thread).map_err(backend)?;
        self.client
            .write_memory(addr, data)
            .map_err(|e| memory(e, addr, data.len(), "virtual"))
    }

    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError> {
        self.require_paused()?;
        if let Some((cached, regs)) = self.regs_cache {
            if cached == vcpu {
                return Ok(RegisterFile::X86_64(regs));
            }
        }
        let thread = self.thread(vcpu)?;
        let all = self.client.read_all_registers(thread).map_err(backend)?;
        let mut regs = X86Registers::default();
        // The core registers must all be in `g`: a short answer is an error, never zeros.
        let missing: Vec<&str> = X86_GPR_NAMES
            .iter()
            .copied()
            .chain(["rip", "eflags"])
            .chain(SEGMENTS)
            .filter(|name| self.field(&all, name).is_none())
            .collect();
        if !missing.is_empty() {
            return Err(backend(GdbError::Unexpected {
                request: "g".into(),
                reply: format!(
                    "{} bytes of registers, without {}",
                    all.len(),
                    missing.join(" ")
                ),
            }));
        }
        let get = |name: &str| self.field(&all, name).unwrap_or_default();
        for (slot, name) in regs.gpr.iter_mut().zip(X86_GPR_NAMES) {
            *slot = get(name);
        }
        regs.rip = get("rip");
        regs.rflags = get("eflags");
        for (slot, name) in regs.segments.iter_mut().zip(SEGMENTS) {
            *slot = u16::try_from(get(name) & 0xffff).unwrap_or(0);
        }
        // QEMU leaves control registers and bases out of `g`; read those one by one.
        for (slot, name) in [
            (&mut regs.fs_base, "fs_base"),
            (&mut regs.gs_base, "gs_base"),
            (&mut regs.kernel_gs_base, "k_gs_base"),
            (&mut regs.cr0, "cr0"),
            (&mut regs.cr2, "cr2"),
            (&mut regs.cr3, "cr3"),
            (&mut regs.cr4, "cr4"),
            (&mut regs.efer, "efer"),
        ] {
            *slot = match self.field(&all, name) {
                Some(v) => v,
                None => self
                    .client
                    .read_register_u64(thread, name)
                    .map_err(backend)?,
            };
        }
        self.regs_cache = Some((vcpu, regs));
        Ok(RegisterFile::X86_64(regs))
    }

    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError> {
        self.require_paused()?;
        let thread = self.thread(vcpu)?;
        self.regs_cache = None;
        self.client
            .write_register(thread, "rip", &pc.to_le_bytes())
            .map_err(backend)
    }

    fn pause(&mut self) -> Result<(), ControlError> {
        if !self.paused {
            self.client.interrupt().map_err(backend)?;
            self.stops += 1;
            self.paused = true;
            self.clock.paused();
            self.regs_cache = None;
        }
        Ok(())
    }

    fn resume(&mut self) -> Result<(), ControlError> {
        if self.paused {
            self.regs_cache = None;
            self.client.resume().map_err(backend)?;
            self.paused = false;
            self.clock.resumed();
        }
        Ok(())
    }

    fn is_paused(&self) -> bool {
        self.paused
    }

    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError> {
        self.require_paused()?;
        self.client
            .set_sw_breakpoint(addr, insert)
            .map_err(|e| memory(e, addr, 1, "virtual"))
    }

    fn set_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        kind: WatchKind,
        insert: bool,
    ) -> Result<(), ControlError> {
        self.require_paused()?;
        self.client
            .set_watchpoint(addr, len, kind == WatchKind::Write, insert)
            .map_err(|e| memory(e, addr, len as usize, "virtual"))
    }

    fn wait_event(&mut self, timeout: Duration) -> Result<Option<StopEvent>, ControlError> {
        if self.paused {
            return Ok(Some(StopEvent::Paused));
        }
        match self.client.wait_stop(timeout) {
            Ok(Some(reply)) => self.event_of(reply).map(Some),
            Ok(None) => Ok(None),
            Err(GdbError::Closed) => {
                self.paused = true;
                Ok(Some(StopEvent::Exited))
            }
            Err(e) => Err(backend(e)),
        }
    }

    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError> {
        self.require_paused()?;
        let thread = self.thread(vcpu)?;
        self.regs_cache = None;
        self.client.step(thread).map_err(backend)?;
        Ok(StopEvent::Stepped { vcpu })
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// The stops counted by [`GdbMachine::stops`].
    fn pause_count(&self) -> Option<u64> {
        Some(self.stops)
    }

    /// QEMU stops the guest's ticks (TSC, timers) with its vCPUs: under TCG the guest's
    /// clocks stand still while the gdbstub holds it. Under KVM the TSC runs on: `None`
    /// there (asked once of the monitor, `info kvm`).
    fn paused_clock(&mut self) -> Option<std::sync::Arc<crate::control::PausedClock>> {
        if self.tcg.is_none() {
            let kvm = self
                .client
                .monitor("info kvm")
                .is_ok_and(|out| out.contains("enabled"));
            self.tcg = Some(!kvm);
        }
        let tcg = self.tcg.unwrap_or(true);
        tcg.then(|| std::sync::Arc::clone(&self.clock))
    }

    /// From QEMU's `info registers` (the gdbstub does not expose IDTR); vCPU 0's.
    fn idt_base(&mut self, _vcpu: VcpuId) -> Result<u64, ControlError> {
        let text = self.client.monitor("info registers").map_err(backend)?;
        text.lines()
            .find_map(|l| l.strip_prefix("IDT="))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|hex| u64::from_str_radix(hex, 16).ok())
            .ok_or(ControlError::Unsupported {
                backend: BACKEND,
                what: "read the IDT base (QEMU's monitor did not report it)",
            })
    }

    fn set_register(&mut self, vcpu: VcpuId, name: &str, value: u64) -> Result<(), ControlError> {
        GdbMachine::set_register(self, vcpu, name, value)
    }

    /// Through QEMU's `pmemsave` monitor command, which writes guest memory to a file: about
    /// a thousand times faster than the gdbstub's 2-KiB `m` packets, but only when QEMU runs
    /// on this host. The result is checked against pages read over the gdbstub; `None` when
    /// anything does not work.
    fn read_phys_bulk(&mut self, phys: u64, len: usize) -> Option<Vec<u8>> {
        const PAGE: usize = 4096;
        let dir = tempfile::Builder::new()
            .prefix("exotap-text-")
            .tempdir()
            .ok()?;
        let path = dir.path().join("text.bin");
        let path_text = path.to_str()?;
        if path_text.contains('"') {
            return None;
        }
        let command = format!("pmemsave {phys:#x} {len:#x} \"{path_text}\"");
        if let Err(e) = self.client.monitor(&command) {
            tracing::debug!("pmemsave refused ({e}); reading over the gdbstub");
            return None;
        }
        let bytes = std::fs::read(&path).ok()?;
        if bytes.len() != len {
            tracing::debug!("pmemsave wrote {} bytes, not {len}", bytes.len());
            return None;
        }
        // QEMU on another host would have written somewhere else: compare samples.
        for at in [0, len / 3, len / 2, len.saturating_sub(PAGE)] {
            let n = PAGE.min(len - at);
            let mut check = vec![0u8; n];
            self.read_phys(phys + at as u64, &mut check).ok()?;
            if check[..] != bytes[at..at + n] {
                tracing::debug!("pmemsave's file differs from the gdbstub at +{at:#x}");
                return None;
            }
        }
        Some(bytes)
    }

    fn release(&mut self) -> Result<(), ControlError> {
        self.client.detach().map_err(backend)
    }
}

/// The data address of a watchpoint stop (`T05watch:ADDR;...`: a write; `awatch:` an access,
/// `rwatch:` a read), from a stop reply's `key:value` pairs; `None` for any other stop.
fn watched_address(info: &[(String, String)]) -> Option<u64> {
    info.iter().find_map(|(k, v)| {
        matches!(k.as_str(), "watch" | "awatch" | "rwatch")
            .then(|| u64::from_str_radix(v, 16).ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::watched_address;
    use crate::gdb::client::parse_stop_reply;
    use crate::gdb::StopReply;

    fn info(reply: &str) -> Vec<(String, String)> {
        match parse_stop_reply(reply) {
            Some(StopReply::Signal { info, .. }) => info,
            other => panic!("{reply}: {other:?}"),
        }
    }

    #[test]
    fn a_watchpoint_stop_names_the_data_address_and_a_breakpoint_none() {
        for key in ["watch", "awatch", "rwatch"] {
            assert_eq!(
                watched_address(&info(&format!("T05thread:02;{key}:ffffffff82a4c6e0;"))),
                Some(0xffff_ffff_82a4_c6e0),
                "{key}"
            );
        }
        assert_eq!(watched_address(&info("T05thread:01;swbreak:;")), None);
        assert_eq!(watched_address(&info("T05thread:01;watch:zz;")), None);
    }
}
