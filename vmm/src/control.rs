//! The control interface every backend implements (QEMU gdbstub, KVM, Unicorn).
//!
//! Deliberately small, like cloud-hypervisor's `Vm`/`Vcpu` traits: guest memory by physical
//! and by virtual address, registers per vCPU, pause/resume of all vCPUs together, software
//! breakpoints with their stop events, and single-step where the backend can. Everything that
//! understands the guest (page tables, symbols, KASLR) lives in `introspect/` and sees only
//! this.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The time a guest has spent paused (see [`Machine::paused_clock`]), shared with whoever
/// turns host time into the guest's: the backend marks each pause and resume, readers on
/// any thread ask for the total so far, the pause in progress included.
#[derive(Debug)]
pub struct PausedClock {
    origin: std::time::Instant,
    /// Paused time of the pauses that ended, ns.
    total: AtomicU64,
    /// When the pause in progress began, ns after `origin`, plus one; 0 while running.
    since: AtomicU64,
}

impl PausedClock {
    /// A clock of a guest that is paused now (`paused`) or running.
    pub fn new(paused: bool) -> Self {
        let clock = Self {
            origin: std::time::Instant::now(),
            total: AtomicU64::new(0),
            since: AtomicU64::new(0),
        };
        if paused {
            clock.paused_at(0);
        }
        clock
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The guest stopped (again: no change while it is paused).
    pub fn paused(&self) {
        self.paused_at(self.now());
    }

    /// The guest runs again.
    pub fn resumed(&self) {
        self.resumed_at(self.now());
    }

    /// Nanoseconds paused so far, the pause in progress included.
    pub fn paused_ns(&self) -> u64 {
        self.paused_ns_at(self.now())
    }

    fn paused_at(&self, now: u64) {
        let _ = self.since.compare_exchange(
            0,
            now.saturating_add(1),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn resumed_at(&self, now: u64) {
        let since = self.since.swap(0, Ordering::AcqRel);
        if since > 0 {
            self.total
                .fetch_add(now.saturating_sub(since - 1), Ordering::AcqRel);
        }
    }

    fn paused_ns_at(&self, now: u64) -> u64 {
        // The pause's start first: a resume in between moves its time into the total.
        let since = self.since.load(Ordering::Acquire);
        let total = self.total.load(Ordering::Acquire);
        let ongoing = if since > 0 {
            now.saturating_sub(since - 1)
        } else {
            0
        };
        total.saturating_add(ongoing)
    }
}

/// A vCPU as the backend numbers it, from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VcpuId(pub u32);

impl std::fmt::Display for VcpuId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vcpu{}", self.0)
    }
}

/// The x86-64 state the instrumentation reads and writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct X86Registers {
    /// rax, rbx, rcx, rdx, rsi, rdi, rbp, rsp, r8..r15 (GDB's order).
    pub gpr: [u64; 16],
    /// Instruction pointer.
    pub rip: u64,
    /// Flags.
    pub rflags: u64,
    /// Segment selectors cs, ss, ds, es, fs, gs.
    pub segments: [u16; 6],
    /// FS base.
    pub fs_base: u64,
    /// GS base (the kernel's per-CPU base while in kernel mode).
    pub gs_base: u64,
    /// The other GS base (`MSR_KERNEL_GS_BASE`, swapped by `swapgs`).
    pub kernel_gs_base: u64,
    /// Control registers.
    pub cr0: u64,
    /// Page-fault address.
    pub cr2: u64,
    /// Page-table root.
    pub cr3: u64,
    /// CR4 (LA57, PGE, SMEP, ...).
    pub cr4: u64,
    /// EFER.
    pub efer: u64,
}

/// Names of [`X86Registers::gpr`] in order.
pub const X86_GPR_NAMES: [&str; 16] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15",
];

impl X86Registers {
    /// Whether the vCPU was running kernel code (CPL 0) when it stopped.
    pub fn in_kernel(&self) -> bool {
        self.segments[0] & 3 == 0
    }

    /// The kernel's per-CPU base: `gs_base` in kernel mode, the swapped one in user mode.
    pub fn kernel_percpu_base(&self) -> u64 {
        if self.in_kernel() {
            self.gs_base
        } else {
            self.kernel_gs_base
        }
    }
}

/// SPARC V9 state (for the Unicorn backend).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SparcRegisters {
    /// %g0..%g7, %o0..%o7, %l0..%l7, %i0..%i7 of the current window.
    pub r: [u64; 32],
    /// Program counter.
    pub pc: u64,
    /// Next program counter (delay slots).
    pub npc: u64,
    /// Processor state.
    pub pstate: u64,
    /// Condition codes.
    pub ccr: u64,
    /// Current window pointer.
    pub cwp: u64,
}

/// The registers of one vCPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegisterFile {
    /// x86-64.
    X86_64(X86Registers),
    /// SPARC V9.
    Sparc64(SparcRegisters),
}

/// Why the guest stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopEvent {
    /// A software breakpoint hit on a vCPU.
    Breakpoint {
        /// The vCPU.
        vcpu: VcpuId,
        /// Its instruction pointer (the breakpoint's address).
        pc: u64,
    },
    /// A single step finished.
    Stepped {
        /// The vCPU.
        vcpu: VcpuId,
    },
    /// A watchpoint ([`Machine::set_watchpoint`]) saw an access on a vCPU: it stopped after
    /// the accessing instruction.
    Watchpoint {
        /// The vCPU.
        vcpu: VcpuId,
        /// Its instruction pointer (past the accessing instruction).
        pc: u64,
        /// The data address the stub reported (inside the watched range).
        addr: u64,
    },
    /// Stopped on request ([`Machine::pause`]).
    Paused,
    /// The guest is gone (powered off, QEMU exited).
    Exited,
}

/// Which accesses a watchpoint stops on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchKind {
    /// Writes.
    Write,
    /// Reads and writes.
    Access,
}

/// Errors of any backend.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// Memory at this address cannot be accessed (unmapped, outside RAM).
    #[error("guest memory at {addr:#x} ({len} bytes, {space}) is not accessible")]
    Memory {
        /// The address.
        addr: u64,
        /// The length.
        len: usize,
        /// `physical` or `virtual`.
        space: &'static str,
    },
    /// No such vCPU.
    #[error("there is no {0}")]
    NoVcpu(VcpuId),
    /// The operation needs the guest paused.
    #[error("the guest must be paused for this")]
    Running,
    /// The backend refuses this here, for a reason found on this host.
    #[error("the {backend} backend refuses to {what}: {why}")]
    Refused {
        /// The backend.
        backend: &'static str,
        /// The operation.
        what: &'static str,
        /// Why, as measured or detected.
        why: String,
    },
    /// The backend cannot do this.
    #[error("the {backend} backend cannot {what}")]
    Unsupported {
        /// The backend.
        backend: &'static str,
        /// The operation.
        what: &'static str,
    },
    /// The backend failed.
    #[error("the {backend} backend failed")]
    Backend {
        /// The backend.
        backend: &'static str,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// A piece of guest RAM in a file another process can map: `size` bytes of guest-physical
/// memory from `gpa`, at byte `offset` of `file` (exotap's VMM: a memfd).
#[derive(Debug, Clone)]
pub struct SharedRegion {
    /// Guest-physical start.
    pub gpa: u64,
    /// Length in bytes.
    pub size: u64,
    /// The file holding it.
    pub file: std::sync::Arc<std::fs::File>,
    /// Where in the file it starts.
    pub offset: u64,
}

/// A running guest under exotap's control.
pub trait Machine {
    /// The vCPUs.
    ///
    /// # Errors
    /// Backend failure.
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError>;

    /// Reads guest-physical memory.
    ///
    /// # Errors
    /// [`ControlError::Memory`] when the range is not guest RAM.
    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError>;

    /// Writes guest-physical memory.
    ///
    /// # Errors
    /// [`ControlError::Memory`] when the range is not guest RAM.
    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError>;

    /// Reads guest-virtual memory through `vcpu`'s current page tables.
    ///
    /// # Errors
    /// [`ControlError::Memory`] when the range is unmapped.
    fn read_virt(&mut self, vcpu: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError>;

    /// Writes guest-virtual memory through `vcpu`'s current page tables (ignoring write
    /// protection, as a debugger does).
    ///
    /// # Errors
    /// [`ControlError::Memory`] when the range is unmapped.
    fn write_virt(&mut self, vcpu: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError>;

    /// The registers of a vCPU (the guest must be paused).
    ///
    /// # Errors
    /// Unknown vCPU, running guest, backend failure.
    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError>;

    /// The x86-64 registers a kernel stack unwind needs: the general registers, rip, flags,
    /// segments and the kernel's GS base (the guest must be paused). A backend may answer in
    /// fewer round trips than [`Machine::registers`], as QEMU's gdbstub does: a sampling
    /// profiler reads them at every stop.
    ///
    /// # Errors
    /// Unknown vCPU, running guest, backend failure, a vCPU that is not x86-64.
    fn stack_registers(&mut self, vcpu: VcpuId) -> Result<X86Registers, ControlError> {
        match self.registers(vcpu)? {
            RegisterFile::X86_64(r) => Ok(r),
            RegisterFile::Sparc64(_) => Err(ControlError::Unsupported {
                backend: self.backend(),
                what: "unwind an x86-64 kernel stack on a SPARC vCPU",
            }),
        }
    }

    /// Sets a vCPU's instruction pointer (the guest must be paused).
    ///
    /// # Errors
    /// Unknown vCPU, running guest, backend failure.
    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError>;

    /// Stops every vCPU; returns once they all are stopped.
    ///
    /// # Errors
    /// Backend failure.
    fn pause(&mut self) -> Result<(), ControlError>;

    /// Lets every vCPU run again.
    ///
    /// # Errors
    /// Backend failure.
    fn resume(&mut self) -> Result<(), ControlError>;

    /// Whether the vCPUs are paused.
    fn is_paused(&self) -> bool;

    /// Inserts or removes a software breakpoint at a guest-virtual address.
    ///
    /// # Errors
    /// Backend failure or an unmapped address.
    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError>;

    /// Inserts or removes a hardware watchpoint on `len` bytes (1, 2, 4 or 8, aligned) of
    /// guest-virtual data at `addr`: a vCPU that accesses them stops after the access with
    /// [`StopEvent::Watchpoint`].
    ///
    /// # Errors
    /// [`ControlError::Unsupported`] where the backend has no watchpoints (the default),
    /// else backend failure.
    fn set_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        kind: WatchKind,
        insert: bool,
    ) -> Result<(), ControlError> {
        let _ = (addr, len, kind, insert);
        Err(ControlError::Unsupported {
            backend: self.backend(),
            what: "watch kernel data (hardware watchpoints)",
        })
    }

    /// Waits up to `timeout` for the running guest to stop; `None` when it is still running.
    ///
    /// # Errors
    /// Backend failure.
    fn wait_event(&mut self, timeout: Duration) -> Result<Option<StopEvent>, ControlError>;

    /// Executes one instruction on `vcpu` while the others stay paused.
    ///
    /// # Errors
    /// [`ControlError::Unsupported`] where the backend cannot step.
    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError>;

    // What the live engine needs beyond the core above. The defaults are those of a backend
    // that cannot do the thing; QEMU's gdbstub and exotap's KVM VMM override what they can.

    /// The backend's name for messages (`qemu gdbstub`, `kvm`).
    fn backend(&self) -> &'static str {
        "unnamed"
    }

    /// The IDT base of a paused vCPU (KASLR's first anchor).
    ///
    /// # Errors
    /// [`ControlError::Unsupported`] where the backend cannot read IDTR.
    fn idt_base(&mut self, vcpu: VcpuId) -> Result<u64, ControlError> {
        let _ = vcpu;
        Err(ControlError::Unsupported {
            backend: self.backend(),
            what: "read the IDT base",
        })
    }

    /// Writes one 64-bit register of a paused vCPU by its GDB name (`rsp`, `rcx`, ...).
    ///
    /// # Errors
    /// [`ControlError::Unsupported`] where the backend cannot.
    fn set_register(&mut self, vcpu: VcpuId, name: &str, value: u64) -> Result<(), ControlError> {
        let _ = (vcpu, name, value);
        Err(ControlError::Unsupported {
            backend: self.backend(),
            what: "write registers by name",
        })
    }

    /// Writes each `(address, bytes)` of guest-physical memory in order: the same as
    /// [`Machine::write_phys`] for each, as one batch where the backend has a faster path
    /// (the gdbstub pipelines the packets instead of waiting for each answer).
    ///
    /// # Errors
    /// As [`Machine::write_phys`], for the first write that fails; the writes before it
    /// are done, and some after it may be.
    fn write_phys_batch(&mut self, writes: &[(u64, &[u8])]) -> Result<(), ControlError> {
        for &(addr, data) in writes {
            self.write_phys(addr, data)?;
        }
        Ok(())
    }

    /// Requests sent to the backend since it started (gdbstub packets), where it counts
    /// them.
    fn request_count(&self) -> Option<u64> {
        None
    }

    /// The time the guest has spent paused, where its clocks stand still while it is (QEMU
    /// TCG: a stop disables the guest's ticks, so its TSC and timers resume where they
    /// stopped): what keeps a clock computed on the host equal to the guest's. `None` where
    /// the guest's clock runs on through pauses (KVM: the TSC is the host's).
    fn paused_clock(&mut self) -> Option<std::sync::Arc<PausedClock>> {
        None
    }

    /// `len` bytes of guest-physical memory at `addr` in one bulk transfer, where the backend
    /// has a faster path than [`Machine::read_phys`] (QEMU's `pmemsave`); `None` otherwise.
    fn read_phys_bulk(&mut self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let _ = (addr, len);
        None
    }

    /// Whether guest memory can be read (and the patch heap's data written) while the vCPUs
    /// run: true where the host maps guest memory itself, so counters, rings and maps are
    /// read with no stop at all.
    fn reads_while_running(&self) -> bool {
        false
    }

    /// Whether the guest outlives this process with nothing else to undo what this process put
    /// in (a QEMU guest over its gdbstub): only then must a guardian process do it. exotap's
    /// own VMM's guest ends with it, and a VMM driven over its control socket undoes a dead
    /// client's probes itself ([`crate::control_socket`]).
    fn guest_outlives_process(&self) -> bool {
        true
    }

    /// How many times the vCPUs were paused since the machine started, where the backend
    /// counts them.
    fn pause_count(&self) -> Option<u64> {
        None
    }

    /// The guest-physical range (GPA, size) the backend keeps out of the guest's RAM for the
    /// patch heap, where it knows it (a running exotap VMM says so on its control socket).
    fn patch_heap(&self) -> Option<(u64, u64)> {
        None
    }

    /// Guest RAM that another process may map: the file descriptors behind the backend's
    /// own mapping (exotap's VMM keeps its RAM in a memfd), so that a control-socket client
    /// reads counters, rings and maps with no request at all. Empty where there is none.
    fn shared_regions(&self) -> Vec<SharedRegion> {
        Vec::new()
    }

    /// Lets the guest go: the debugger's detach (QEMU drops its breakpoints), or a resume.
    ///
    /// # Errors
    /// Backend failure.
    fn release(&mut self) -> Result<(), ControlError> {
        self.resume()
    }
}

/// A boxed machine is a machine (the live engine holds any backend as one).
impl<M: Machine + ?Sized> Machine for Box<M> {
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        (**self).vcpus()
    }
    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        (**self).read_phys(addr, buf)
    }
    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        (**self).write_phys(addr, data)
    }
    fn read_virt(&mut self, vcpu: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        (**self).read_virt(vcpu, addr, buf)
    }
    fn write_virt(&mut self, vcpu: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        (**self).write_virt(vcpu, addr, data)
    }
    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError> {
        (**self).registers(vcpu)
    }
    fn stack_registers(&mut self, vcpu: VcpuId) -> Result<X86Registers, ControlError> {
        (**self).stack_registers(vcpu)
    }
    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError> {
        (**self).set_pc(vcpu, pc)
    }
    fn pause(&mut self) -> Result<(), ControlError> {
        (**self).pause()
    }
    fn resume(&mut self) -> Result<(), ControlError> {
        (**self).resume()
    }
    fn is_paused(&self) -> bool {
        (**self).is_paused()
    }
    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError> {
        (**self).set_breakpoint(addr, insert)
    }
    fn set_watchpoint(
        &mut self,
        addr: u64,
        len: u64,
        kind: WatchKind,
        insert: bool,
    ) -> Result<(), ControlError> {
        (**self).set_watchpoint(addr, len, kind, insert)
    }
    fn wait_event(&mut self, timeout: Duration) -> Result<Option<StopEvent>, ControlError> {
        (**self).wait_event(timeout)
    }
    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError> {
        (**self).step(vcpu)
    }
    fn backend(&self) -> &'static str {
        (**self).backend()
    }
    fn idt_base(&mut self, vcpu: VcpuId) -> Result<u64, ControlError> {
        (**self).idt_base(vcpu)
    }
    fn set_register(&mut self, vcpu: VcpuId, name: &str, value: u64) -> Result<(), ControlError> {
        (**self).set_register(vcpu, name, value)
    }
    fn read_phys_bulk(&mut self, addr: u64, len: usize) -> Option<Vec<u8>> {
        (**self).read_phys_bulk(addr, len)
    }
    fn write_phys_batch(&mut self, writes: &[(u64, &[u8])]) -> Result<(), ControlError> {
        (**self).write_phys_batch(writes)
    }
    fn request_count(&self) -> Option<u64> {
        (**self).request_count()
    }
    fn paused_clock(&mut self) -> Option<std::sync::Arc<PausedClock>> {
        (**self).paused_clock()
    }
    fn reads_while_running(&self) -> bool {
        (**self).reads_while_running()
    }
    fn guest_outlives_process(&self) -> bool {
        (**self).guest_outlives_process()
    }
    fn pause_count(&self) -> Option<u64> {
        (**self).pause_count()
    }
    fn patch_heap(&self) -> Option<(u64, u64)> {
        (**self).patch_heap()
    }
    fn shared_regions(&self) -> Vec<SharedRegion> {
        (**self).shared_regions()
    }
    fn release(&mut self) -> Result<(), ControlError> {
        (**self).release()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percpu_base_follows_cpl() {
        let mut regs = X86Registers {
            gs_base: 0xaaaa,
            kernel_gs_base: 0xbbbb,
            ..Default::default()
        };
        regs.segments[0] = 0x10;
        assert_eq!(regs.kernel_percpu_base(), 0xaaaa);
        regs.segments[0] = 0x33;
        assert_eq!(regs.kernel_percpu_base(), 0xbbbb);
    }
}

#[cfg(test)]
mod paused_clock_tests {
    use super::PausedClock;

    #[test]
    fn a_paused_clock_counts_the_pauses_and_the_one_in_progress_but_not_the_running_time() {
        let clock = PausedClock::new(true);
        // Paused from 0 to 100, running to 250, paused from 250 on.
        assert_eq!(clock.paused_ns_at(40), 40);
        clock.resumed_at(100);
        assert_eq!(clock.paused_ns_at(200), 100);
        clock.paused_at(250);
        // A second stop while paused changes nothing.
        clock.paused_at(260);
        assert_eq!(clock.paused_ns_at(300), 150);
        clock.resumed_at(400);
        // A resume while running changes nothing either.
        clock.resumed_at(450);
        assert_eq!(clock.paused_ns_at(1000), 250);
    }

    #[test]
    fn a_clock_started_running_counts_nothing_until_a_pause() {
        let clock = PausedClock::new(false);
        assert_eq!(clock.paused_ns_at(500), 0);
        clock.paused_at(500);
        assert_eq!(clock.paused_ns_at(520), 20);
    }
}
