//! vCPUs: one thread each, with an explicit run state machine (firecracker's
//! `VcpuRunState`), kicked out of `KVM_RUN` with a signal plus `immediate_exit`.
//!
//! ```text
//!            request Run                  request Pause + kick
//!  Created ──────────────► Running ◄───────────────────────────► Paused
//!                             │    (registers snapshot taken     │
//!                             │     on entry to Paused; edits    │
//!                             │     applied on leaving it)       │
//!                             └──────── request Stop ────────────┴──► Finished
//! ```
//!
//! The host never calls vCPU ioctls itself: it asks through [`VcpuShared`] and reads the
//! snapshot a paused vCPU left there. Exit handling is [`handle_exit`], a plain function over
//! the devices, so tests drive it without threads or `/dev/kvm`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};

use kvm_bindings::{
    kvm_guest_debug, Msrs, KVM_GUESTDBG_ENABLE, KVM_GUESTDBG_SINGLESTEP, KVM_GUESTDBG_USE_SW_BP,
};
use kvm_ioctls::{VcpuExit, VcpuFd};

use super::cpuid::MSR_KERNEL_GS_BASE;
use super::devices::{Devices, IoEffect};
use crate::control::X86Registers;

/// What the host asks of a vCPU thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RunRequest {
    /// Run the guest.
    Run = 0,
    /// Stop in [`VcpuState::Paused`] until asked to run again.
    Pause = 1,
    /// Leave the thread.
    Stop = 2,
}

impl RunRequest {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Run,
            1 => Self::Pause,
            _ => Self::Stop,
        }
    }
}

/// Where a vCPU thread is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VcpuState {
    /// Configured, thread not yet in its loop.
    Created,
    /// In or around `KVM_RUN`.
    Running,
    /// Parked: the snapshot is valid and edits may be queued.
    Paused,
    /// The thread has left its loop (stopped or failed).
    Finished,
}

/// What a vCPU reports to the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmEvent {
    /// The guest reset the machine (i8042 reset, triple fault): the run is over.
    Reset {
        /// The vCPU that did it.
        vcpu: u32,
    },
    /// The guest powered the machine off (ACPI S5 through PM1a control): the run is over.
    PowerOff {
        /// The vCPU that did it.
        vcpu: u32,
    },
    /// A software breakpoint (#BP with `KVM_GUESTDBG_USE_SW_BP`); the vCPU parked itself.
    Breakpoint {
        /// The vCPU.
        vcpu: u32,
        /// Address of the `int3`.
        pc: u64,
    },
    /// A single step finished; the vCPU parked itself.
    Stepped {
        /// The vCPU.
        vcpu: u32,
    },
    /// Every vCPU halted with interrupts off (the kernel's halt, and its `poweroff` without a
    /// power-off method): found by [`super::KvmMachine::check_halted`], not sent by a vCPU.
    Halted,
    /// `KVM_RUN` failed or the guest did something the VMM cannot handle.
    Failed {
        /// The vCPU.
        vcpu: u32,
        /// What happened.
        message: String,
    },
}

/// The registers a parked vCPU leaves for the host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The control interface's view.
    pub regs: X86Registers,
    /// IDTR base (the KASLR anchor).
    pub idt_base: u64,
    /// The vCPU was in `hlt` (`KVM_MP_STATE_HALTED`) when it was kicked.
    pub halted: bool,
    /// The vCPU is an AP that waits for INIT/SIPI (`KVM_MP_STATE_UNINITIALIZED` or
    /// `KVM_MP_STATE_INIT_RECEIVED`): the kernel never started it, or took it offline.
    pub waiting_for_sipi: bool,
}

/// RFLAGS.IF.
const RFLAGS_IF: u64 = 1 << 9;

impl Snapshot {
    /// Halted with interrupts off: the vCPU can never run again (no NMI source here). This is
    /// where a kernel without a power-off method ends `poweroff` (it turns it into halt).
    ///
    /// An AP waiting for INIT/SIPI counts as stopped too: only another vCPU can start it.
    /// [`super::KvmMachine::check_halted`] asks this of every vCPU at once, so a waiting AP
    /// next to a running or idle vCPU never ends the run.
    pub fn stopped_for_good(&self) -> bool {
        self.waiting_for_sipi || (self.halted && self.regs.rflags & RFLAGS_IF == 0)
    }
}

/// What the exit handler decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitAction {
    /// Run again.
    Continue,
    /// The machine reset.
    Reset,
    /// The guest powered the machine off (ACPI S5).
    PowerOff,
    /// A breakpoint at this address.
    Breakpoint(u64),
    /// A single step finished.
    Stepped,
    /// An exit the VMM cannot handle.
    Fail(String),
}

/// Handles one `KVM_RUN` exit.
pub fn handle_exit(exit: VcpuExit<'_>, devices: &Mutex<Devices>) -> ExitAction {
    let lock = || {
        devices
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    match exit {
        VcpuExit::IoIn(port, data) => {
            lock().access_in(port, data);
            ExitAction::Continue
        }
        VcpuExit::IoOut(port, data) => match lock().access_out(port, data) {
            IoEffect::None => ExitAction::Continue,
            IoEffect::Reset => ExitAction::Reset,
            IoEffect::PowerOff => ExitAction::PowerOff,
        },
        VcpuExit::MmioRead(_, data) => {
            data.fill(0xff);
            ExitAction::Continue
        }
        VcpuExit::MmioWrite(..) | VcpuExit::Hlt | VcpuExit::IrqWindowOpen | VcpuExit::Intr => {
            ExitAction::Continue
        }
        VcpuExit::Shutdown => ExitAction::Reset,
        VcpuExit::Debug(arch) => match arch.exception {
            3 => ExitAction::Breakpoint(arch.pc),
            1 => ExitAction::Stepped,
            other => ExitAction::Fail(format!(
                "debug exit with exception {other} at {:#x}",
                arch.pc
            )),
        },
        VcpuExit::SystemEvent(kind, _) => {
            // KVM_SYSTEM_EVENT_SHUTDOWN = 1, RESET = 2, CRASH = 3.
            if kind == 3 {
                ExitAction::Fail("the guest crashed (KVM_SYSTEM_EVENT_CRASH)".into())
            } else {
                ExitAction::Reset
            }
        }
        VcpuExit::FailEntry(reason, cpu) => {
            ExitAction::Fail(format!("VM entry failed (reason {reason:#x}, cpu {cpu})"))
        }
        VcpuExit::InternalError => {
            ExitAction::Fail("KVM internal error (emulation failure)".into())
        }
        other => ExitAction::Fail(format!("unhandled exit {other:?}")),
    }
}

/// `kvm_run.immediate_exit` of one vCPU, written by the host when it kicks.
#[derive(Debug, Clone, Copy)]
struct ImmediateExit(*mut u8);

// SAFETY: the pointer is only written (volatile, one byte) under `VcpuShared::inner`'s lock
// while the state is not `Finished`; the vCPU thread sets `Finished` under that lock before
// it drops the `VcpuFd` that owns the mapping.
unsafe impl Send for ImmediateExit {}

#[derive(Debug)]
struct Inner {
    state: VcpuState,
    snapshot: Option<Snapshot>,
    pending_pc: Option<u64>,
    pending_debug: Option<u32>,
    immediate_exit: Option<ImmediateExit>,
}

/// The state a vCPU thread shares with the host.
#[derive(Debug)]
pub struct VcpuShared {
    /// The vCPU's index (= APIC id).
    pub id: u32,
    request: AtomicU8,
    inner: Mutex<Inner>,
    changed: Condvar,
}

impl VcpuShared {
    /// A vCPU that has not started.
    pub fn new(id: u32) -> Self {
        Self {
            id,
            request: AtomicU8::new(RunRequest::Run as u8),
            inner: Mutex::new(Inner {
                state: VcpuState::Created,
                snapshot: None,
                pending_pc: None,
                pending_debug: None,
                immediate_exit: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The current request.
    pub fn request(&self) -> RunRequest {
        RunRequest::from_u8(self.request.load(Ordering::SeqCst))
    }

    /// The current state.
    pub fn state(&self) -> VcpuState {
        self.lock().state
    }

    /// Asks the thread to do `request`; for Pause and Stop it is also kicked out of `KVM_RUN`
    /// with `signal` to `thread`.
    pub fn ask(&self, request: RunRequest, thread: libc::pthread_t) {
        let inner = self.lock();
        self.request.store(request as u8, Ordering::SeqCst);
        if request != RunRequest::Run && inner.state != VcpuState::Finished {
            if let Some(ImmediateExit(ptr)) = inner.immediate_exit {
                // SAFETY: see `ImmediateExit`: the mapping lives while not Finished, and we
                // hold the lock that orders this write before `Finished`.
                unsafe { std::ptr::write_volatile(ptr, 1) };
            }
            // SAFETY: `thread` is the vCPU's live thread (not Finished, so not joined); the
            // signal has a no-op handler installed by `install_kick_handler`.
            unsafe { libc::pthread_kill(thread, kick_signal()) };
        }
        self.changed.notify_all();
    }

    /// Waits up to `timeout` for the thread to be in `Paused` or `Finished`; `None` when it
    /// is still running then.
    pub fn wait_stopped_for(&self, timeout: std::time::Duration) -> Option<VcpuState> {
        let deadline = std::time::Instant::now() + timeout;
        let mut inner = self.lock();
        while !matches!(inner.state, VcpuState::Paused | VcpuState::Finished) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return None;
            }
            inner = self
                .changed
                .wait_timeout(inner, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        Some(inner.state)
    }

    /// Waits until the thread is in `Paused` or `Finished`.
    pub fn wait_stopped(&self) -> VcpuState {
        let mut inner = self.lock();
        while !matches!(inner.state, VcpuState::Paused | VcpuState::Finished) {
            inner = self
                .changed
                .wait(inner)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        inner.state
    }

    /// The registers of a paused vCPU.
    pub fn snapshot(&self) -> Option<Snapshot> {
        let inner = self.lock();
        inner.snapshot.filter(|_| inner.state == VcpuState::Paused)
    }

    /// Queues a new instruction pointer, applied when the vCPU leaves `Paused`.
    pub fn set_pc(&self, pc: u64) -> bool {
        let mut inner = self.lock();
        if inner.state != VcpuState::Paused {
            return false;
        }
        inner.pending_pc = Some(pc);
        if let Some(s) = inner.snapshot.as_mut() {
            s.regs.rip = pc;
        }
        true
    }

    /// Queues `KVM_SET_GUEST_DEBUG` control flags, applied when the vCPU leaves `Paused`.
    pub fn set_debug(&self, control: u32) {
        self.lock().pending_debug = Some(control);
    }
}

/// The signal that kicks a vCPU out of `KVM_RUN`.
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the no-op handler of [`kick_signal`] (once per process).
///
/// # Errors
/// When the handler cannot be installed.
pub fn install_kick_handler() -> Result<(), String> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick)
            .map_err(|e| e.to_string());
    });
    result
}

/// Guest debug flags for software breakpoints.
pub const DEBUG_SW_BP: u32 = KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_SW_BP;
/// Guest debug flags for a single step (with breakpoints kept).
pub const DEBUG_STEP: u32 = KVM_GUESTDBG_ENABLE | KVM_GUESTDBG_USE_SW_BP | KVM_GUESTDBG_SINGLESTEP;

fn read_snapshot(fd: &VcpuFd) -> Result<Snapshot, String> {
    let r = fd.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
    let s = fd.get_sregs().map_err(|e| format!("KVM_GET_SREGS: {e}"))?;
    let mut msrs = Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
        index: MSR_KERNEL_GS_BASE,
        ..Default::default()
    }])
    .map_err(|e| format!("MSR list: {e:?}"))?;
    let kernel_gs_base = match fd.get_msrs(&mut msrs) {
        Ok(1) => msrs.as_slice()[0].data,
        _ => 0,
    };
    let mp_state = fd.get_mp_state().map(|m| m.mp_state).ok();
    let halted = mp_state == Some(kvm_bindings::KVM_MP_STATE_HALTED);
    let waiting_for_sipi = matches!(
        mp_state,
        Some(kvm_bindings::KVM_MP_STATE_UNINITIALIZED | kvm_bindings::KVM_MP_STATE_INIT_RECEIVED)
    );
    Ok(Snapshot {
        regs: X86Registers {
            gpr: [
                r.rax, r.rbx, r.rcx, r.rdx, r.rsi, r.rdi, r.rbp, r.rsp, r.r8, r.r9, r.r10, r.r11,
                r.r12, r.r13, r.r14, r.r15,
            ],
            rip: r.rip,
            rflags: r.rflags,
            segments: [
                s.cs.selector,
                s.ss.selector,
                s.ds.selector,
                s.es.selector,
                s.fs.selector,
                s.gs.selector,
            ],
            fs_base: s.fs.base,
            gs_base: s.gs.base,
            kernel_gs_base,
            cr0: s.cr0,
            cr2: s.cr2,
            cr3: s.cr3,
            cr4: s.cr4,
            efer: s.efer,
        },
        idt_base: s.idt.base,
        halted,
        waiting_for_sipi,
    })
}

/// Parks the vCPU until the host asks for Run or Stop; applies queued edits on the way out.
fn park(fd: &mut VcpuFd, shared: &VcpuShared) -> Result<(), String> {
    let snapshot = read_snapshot(fd)?;
    let (pc, debug) = {
        let mut inner = shared.lock();
        inner.state = VcpuState::Paused;
        inner.snapshot = Some(snapshot);
        shared.changed.notify_all();
        while shared.request() == RunRequest::Pause {
            inner = shared
                .changed
                .wait(inner)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        inner.state = VcpuState::Running;
        inner.snapshot = None;
        (inner.pending_pc.take(), inner.pending_debug.take())
    };
    fd.set_kvm_immediate_exit(0);
    if let Some(pc) = pc {
        let mut regs = fd.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
        regs.rip = pc;
        fd.set_regs(&regs)
            .map_err(|e| format!("KVM_SET_REGS: {e}"))?;
    }
    if let Some(control) = debug {
        let dbg = kvm_guest_debug {
            control,
            ..Default::default()
        };
        fd.set_guest_debug(&dbg)
            .map_err(|e| format!("KVM_SET_GUEST_DEBUG: {e}"))?;
    }
    Ok(())
}

/// The vCPU thread's body: runs until asked to stop or the guest resets or fails.
pub fn vcpu_loop(
    mut fd: VcpuFd,
    shared: Arc<VcpuShared>,
    devices: Arc<Mutex<Devices>>,
    events: Sender<VmEvent>,
) {
    let id = shared.id;
    {
        let mut inner = shared.lock();
        let ptr: *mut u8 = &mut fd.get_kvm_run().immediate_exit;
        inner.immediate_exit = Some(ImmediateExit(ptr));
        inner.state = VcpuState::Running;
        shared.changed.notify_all();
    }
    let fail = |message: String| {
        let _ = events.send(VmEvent::Failed { vcpu: id, message });
    };
    loop {
        match shared.request() {
            RunRequest::Stop => break,
            RunRequest::Pause => {
                if let Err(message) = park(&mut fd, &shared) {
                    fail(message);
                    break;
                }
                continue;
            }
            RunRequest::Run => {}
        }
        let action = match fd.run() {
            Ok(exit) => handle_exit(exit, &devices),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                fd.set_kvm_immediate_exit(0);
                ExitAction::Continue
            }
            Err(e) => ExitAction::Fail(format!("KVM_RUN failed: {e}")),
        };
        let event = match action {
            ExitAction::Continue => continue,
            ExitAction::Reset => VmEvent::Reset { vcpu: id },
            ExitAction::PowerOff => VmEvent::PowerOff { vcpu: id },
            ExitAction::Breakpoint(pc) => VmEvent::Breakpoint { vcpu: id, pc },
            ExitAction::Stepped => VmEvent::Stepped { vcpu: id },
            ExitAction::Fail(message) => {
                fail(message);
                break;
            }
        };
        // Park until the host decides; it pauses the other vCPUs or stops the machine.
        shared
            .request
            .store(RunRequest::Pause as u8, Ordering::SeqCst);
        let _ = events.send(event);
    }
    let mut inner = shared.lock();
    inner.state = VcpuState::Finished;
    inner.immediate_exit = None;
    inner.snapshot = None;
    shared.changed.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvm::devices::{COM1, I8042_COMMAND};
    use kvm_bindings::kvm_debug_exit_arch;
    use std::sync::mpsc;
    use vmm_sys_util::eventfd::EventFd;

    fn devices() -> (Mutex<Devices>, mpsc::Receiver<Vec<u8>>) {
        let (tx, rx) = mpsc::channel();
        let evt = || EventFd::new(libc::EFD_NONBLOCK).unwrap();
        (Mutex::new(Devices::new(evt(), evt(), tx)), rx)
    }

    #[test]
    fn a_bounded_wait_gives_up_on_a_running_vcpu_and_sees_one_that_parks() {
        let shared = Arc::new(VcpuShared::new(0));
        shared.lock().state = VcpuState::Running;

        let waited = std::time::Instant::now();
        assert_eq!(
            shared.wait_stopped_for(std::time::Duration::from_millis(30)),
            None
        );
        assert!(waited.elapsed() >= std::time::Duration::from_millis(30));

        let parker = Arc::clone(&shared);
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            parker.lock().state = VcpuState::Paused;
            parker.changed.notify_all();
        });
        assert_eq!(
            shared.wait_stopped_for(std::time::Duration::from_secs(10)),
            Some(VcpuState::Paused)
        );
        t.join().unwrap();
    }

    #[test]
    fn console_out_exit_continues_and_reaches_the_console() {
        let (d, rx) = devices();

        let action = handle_exit(VcpuExit::IoOut(COM1, b"A"), &d);

        assert_eq!(action, ExitAction::Continue);
        assert_eq!(rx.try_recv().unwrap(), b"A");
    }

    #[test]
    fn rep_in_fills_every_byte() {
        let (d, _rx) = devices();
        let mut data = [0u8; 4];

        handle_exit(VcpuExit::IoIn(0x3e8, &mut data), &d);

        assert_eq!(data, [0xff; 4]);
    }

    #[test]
    fn keyboard_reset_and_triple_fault_end_the_run() {
        let (d, _rx) = devices();

        assert_eq!(
            handle_exit(VcpuExit::IoOut(I8042_COMMAND, &[0xfe]), &d),
            ExitAction::Reset
        );
        assert_eq!(handle_exit(VcpuExit::Shutdown, &d), ExitAction::Reset);
    }

    #[test]
    fn int3_debug_exit_is_a_breakpoint_at_its_pc() {
        let (d, _rx) = devices();
        let arch = kvm_debug_exit_arch {
            exception: 3,
            pc: 0xffff_ffff_8100_0000,
            ..Default::default()
        };

        assert_eq!(
            handle_exit(VcpuExit::Debug(arch), &d),
            ExitAction::Breakpoint(0xffff_ffff_8100_0000)
        );
    }

    #[test]
    fn internal_error_fails_the_vcpu() {
        let (d, _rx) = devices();

        assert!(matches!(
            handle_exit(VcpuExit::InternalError, &d),
            ExitAction::Fail(_)
        ));
    }

    #[test]
    fn halted_with_interrupts_off_is_stopped_for_good() {
        let mut snap = Snapshot {
            halted: true,
            ..Default::default()
        };
        assert!(snap.stopped_for_good());
        snap.regs.rflags = 0x202;
        assert!(!snap.stopped_for_good(), "idle hlt with interrupts on");
        snap.halted = false;
        snap.regs.rflags = 0x2;
        assert!(!snap.stopped_for_good());
        snap.waiting_for_sipi = true;
        assert!(snap.stopped_for_good(), "an AP nobody started");
    }

    #[test]
    fn acpi_s5_write_powers_off() {
        let (d, _rx) = devices();

        assert_eq!(
            handle_exit(VcpuExit::IoOut(0x604, &0x2001u16.to_le_bytes()), &d),
            ExitAction::PowerOff
        );
        assert_eq!(
            handle_exit(VcpuExit::IoOut(0x604, &0x0001u16.to_le_bytes()), &d),
            ExitAction::Continue
        );
    }

    #[test]
    fn set_pc_is_refused_unless_paused() {
        let shared = VcpuShared::new(0);

        assert!(!shared.set_pc(0x1000));
        assert_eq!(shared.state(), VcpuState::Created);
        assert_eq!(shared.snapshot(), None);
    }
}
