//! A running KVM guest under the shared control interface ([`Machine`]).
//!
//! Memory is read and written directly in the VMM's mapping of guest RAM and the patch heap
//! (vm-memory), with no stop: the host sees what the guest wrote as soon as it is written, so
//! counters, rings and maps are read while the vCPUs run ([`Machine::reads_while_running`]).
//! Virtual addresses go through the paused vCPU's own page tables (4- or 5-level, large
//! pages). Registers come from the snapshot each vCPU leaves when it parks.
//!
//! The machine [`super::boot`] returns owns the vCPU threads and their events; [`KvmMachine::control`]
//! gives more handles on the same VM (for the live engine's session, which may run on its own
//! thread), which pause, resume, read and write as the owner does but take no vCPU events.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use super::devices::Devices;
use super::vcpu::{RunRequest, Snapshot, VcpuShared, VcpuState, VmEvent, DEBUG_STEP, DEBUG_SW_BP};
use crate::control::{ControlError, Machine, RegisterFile, SharedRegion, StopEvent, VcpuId};

const BACKEND: &str = "kvm";
/// How long a pause waits for a vCPU before kicking it again.
const PAUSE_REKICK: Duration = Duration::from_millis(50);
/// How long a pause waits for every vCPU in all before it fails.
const PAUSE_LIMIT: Duration = Duration::from_secs(30);

/// One vCPU as the host holds it.
#[derive(Debug)]
pub struct VcpuHandle {
    /// Shared with the thread.
    pub shared: Arc<VcpuShared>,
    /// The thread, to kick it with a signal (it may have finished: [`VcpuShared::ask`] only
    /// kicks a vCPU that is not `Finished`).
    pub pthread: libc::pthread_t,
}

impl VcpuHandle {
    fn ask(&self, request: RunRequest) {
        self.shared.ask(request, self.pthread);
    }
}

/// What the handles on one VM change together.
#[derive(Debug, Default)]
struct Control {
    /// Software breakpoints: address → (physical address, original byte).
    breakpoints: BTreeMap<u64, (u64, u8)>,
    paused: bool,
    /// Why the guest is gone, once it is.
    ended: Option<VmEvent>,
}

/// The VM every handle shares.
#[derive(Debug)]
struct Vm {
    memory: Arc<GuestMemoryMmap>,
    vcpus: Vec<VcpuHandle>,
    devices: Arc<Mutex<Devices>>,
    /// Keeps the VM (and so the vCPUs' VM) alive as long as any handle.
    _fd: kvm_ioctls::VmFd,
    control: Mutex<Control>,
    /// Times every vCPU was paused, from any handle.
    pauses: AtomicU64,
    /// Why software breakpoints are refused on this host, if they are.
    traps_refused: Option<String>,
}

/// What only the machine [`super::boot`] returned holds.
#[derive(Debug)]
struct Owner {
    threads: Vec<JoinHandle<()>>,
    events: Receiver<VmEvent>,
}

/// A KVM guest: its memory, its vCPUs and, for the owner, their threads and events.
#[derive(Debug)]
pub struct KvmMachine {
    vm: Arc<Vm>,
    owner: Option<Owner>,
}

/// Why software breakpoints (`KVM_GUESTDBG_USE_SW_BP`) are refused where this host is itself a
/// guest: measured under QEMU TCG's SVM, where `int3` did not exit to userspace.
pub const NESTED_TRAPS_REFUSED: &str = "this host is itself a guest (nested KVM), and under QEMU \
    TCG's SVM int3 with KVM_GUESTDBG_USE_SW_BP was measured not to exit to userspace (the guest \
    triple-faulted): trap probes are refused; compiled and splice probes need no exits";

/// CR0.PG.
const CR0_PG: u64 = 1 << 31;
/// CR4.LA57.
const CR4_LA57: u64 = 1 << 12;
/// Address bits of a page-table entry.
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

/// Translates `va` through page tables rooted at `cr3` (4 or 5 levels), reading entries with
/// `read`. Returns the physical address and the bytes left in its page.
pub fn translate(
    read: &mut dyn FnMut(u64) -> Option<u64>,
    cr3: u64,
    la57: bool,
    va: u64,
) -> Option<(u64, u64)> {
    let levels: u32 = if la57 { 5 } else { 4 };
    let mut table = cr3 & ADDR_MASK;
    for level in (1..=levels).rev() {
        let shift = 12 + 9 * (level - 1);
        let index = (va >> shift) & 0x1ff;
        let entry = read(table + index * 8)?;
        if entry & 1 == 0 {
            return None;
        }
        let large = entry & (1 << 7) != 0 && (level == 2 || level == 3);
        if level == 1 || large {
            let page = 1u64 << shift;
            let base = entry & ADDR_MASK & !(page - 1);
            let offset = va & (page - 1);
            return Some((base | offset, page - offset));
        }
        table = entry & ADDR_MASK;
    }
    None
}

impl KvmMachine {
    pub(crate) fn new(
        memory: Arc<GuestMemoryMmap>,
        vcpus: Vec<VcpuHandle>,
        threads: Vec<JoinHandle<()>>,
        events: Receiver<VmEvent>,
        devices: Arc<Mutex<Devices>>,
        fd: kvm_ioctls::VmFd,
    ) -> Self {
        let traps_refused = crate::host::nested().then(|| NESTED_TRAPS_REFUSED.to_owned());
        Self {
            vm: Arc::new(Vm {
                memory,
                vcpus,
                devices,
                _fd: fd,
                control: Mutex::new(Control::default()),
                pauses: AtomicU64::new(0),
                traps_refused,
            }),
            owner: Some(Owner { threads, events }),
        }
    }

    /// Another handle on this VM for the live engine: it pauses, resumes, reads and writes
    /// as this one does; it takes no vCPU events (breakpoints and single steps are the
    /// owner's), and dropping it leaves the VM running.
    pub fn control(&self) -> KvmMachine {
        KvmMachine {
            vm: Arc::clone(&self.vm),
            owner: None,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Control> {
        self.vm
            .control
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn handle(&self, vcpu: VcpuId) -> Result<&VcpuHandle, ControlError> {
        self.vm
            .vcpus
            .get(vcpu.0 as usize)
            .ok_or(ControlError::NoVcpu(vcpu))
    }

    /// The snapshot of a paused vCPU (registers and IDTR base).
    ///
    /// # Errors
    /// Unknown vCPU or a running guest.
    pub fn snapshot(&self, vcpu: VcpuId) -> Result<Snapshot, ControlError> {
        self.handle(vcpu)?
            .shared
            .snapshot()
            .ok_or(ControlError::Running)
    }

    /// Pauses the guest to see whether every vCPU is halted with interrupts off (see
    /// [`Snapshot::stopped_for_good`]); if so the guest is over ([`VmEvent::Halted`]),
    /// otherwise it resumes. Returns whether it is over.
    pub fn check_halted(&mut self) -> bool {
        if self.ended().is_some() {
            return true;
        }
        let was_paused = self.is_paused();
        if self.pause().is_err() {
            return false;
        }
        let dead = self.vm.vcpus.iter().all(|v| match v.shared.state() {
            VcpuState::Finished => true,
            _ => v.shared.snapshot().is_some_and(|s| s.stopped_for_good()),
        });
        for v in &self.vm.vcpus {
            let snap = v.shared.snapshot();
            tracing::debug!(
                vcpu = v.shared.id,
                state = ?v.shared.state(),
                halted = snap.map(|s| s.halted),
                waiting_for_sipi = snap.map(|s| s.waiting_for_sipi),
                rflags = snap.map(|s| format!("{:#x}", s.regs.rflags)),
                rip = snap.map(|s| format!("{:#x}", s.regs.rip)),
                "halt check"
            );
        }
        if dead {
            self.lock().ended = Some(VmEvent::Halted);
        } else if !was_paused {
            let _ = self.resume();
        }
        dead
    }

    /// The registers of vCPU `vcpu` as it parked after it reset the machine (a triple fault,
    /// `KVM_EXIT_SHUTDOWN`: the vCPU thread parks after reporting it), for the error that
    /// says the VM died; `None` when it has not parked within a second.
    pub fn reset_registers(&self, vcpu: u32) -> Option<String> {
        let v = self.vm.vcpus.iter().find(|v| v.shared.id == vcpu)?;
        v.shared.wait_stopped_for(Duration::from_secs(1))?;
        let s = v.shared.snapshot()?;
        Some(format!(
            "rip {:#x} rsp {:#x} rflags {:#x} (interrupts {}) cr3 {:#x}",
            s.regs.rip,
            s.regs.gpr[7],
            s.regs.rflags,
            if s.regs.rflags & (1 << 9) != 0 {
                "on"
            } else {
                "off"
            },
            s.regs.cr3
        ))
    }

    /// Each vCPU's thread state and the host's request of it, and whether the host holds the
    /// guest paused: what a run that is stuck says about itself.
    pub fn describe_vcpus(&self) -> String {
        let states: Vec<String> = self
            .vm
            .vcpus
            .iter()
            .map(|v| {
                format!(
                    "vCPU {} {:?} (asked {:?})",
                    v.shared.id,
                    v.shared.state(),
                    v.shared.request()
                )
            })
            .collect();
        format!(
            "{}; host pause {}",
            states.join(", "),
            if self.is_paused() { "held" } else { "not held" }
        )
    }

    /// What a guest that stopped making progress was doing, for the error that ends its run:
    /// each vCPU's thread state, then (the guest paused, at most `PAUSE_LIMIT`) each one's
    /// instruction and stack pointers, flags and whether it sat in `hlt`, and the UARTs'
    /// interrupt state (a transmitter waiting for an interrupt that never came is a silent
    /// guest too). The guest stays paused: the run is over.
    pub fn stuck_report(&mut self) -> String {
        let threads = self.describe_vcpus();
        if self.ended().is_some() {
            return threads;
        }
        let mut out = vec![threads];
        match self.pause() {
            Err(e) => out.push(format!("could not pause it to read registers: {e}")),
            Ok(()) => {
                for v in &self.vm.vcpus {
                    out.push(match v.shared.snapshot() {
                        Some(s) => format!(
                            "vCPU {}: rip {:#x} rsp {:#x} rflags {:#x} (interrupts {}){}{} cr3 {:#x}",
                            v.shared.id,
                            s.regs.rip,
                            s.regs.gpr[7],
                            s.regs.rflags,
                            if s.regs.rflags & (1 << 9) != 0 { "on" } else { "off" },
                            if s.halted { ", halted" } else { "" },
                            if s.waiting_for_sipi { ", waiting for SIPI" } else { "" },
                            s.regs.cr3
                        ),
                        None => format!("vCPU {}: no registers ({:?})", v.shared.id, v.shared.state()),
                    });
                }
            }
        }
        out.push(
            self.vm
                .devices
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .uart_state(),
        );
        out.join("\n")
    }

    /// Why the guest ended, once it has.
    pub fn ended(&self) -> Option<VmEvent> {
        self.lock().ended.clone()
    }

    /// Writes bytes to the guest's go channel (ttyS1).
    ///
    /// # Errors
    /// When the UART's FIFO is full.
    pub fn send_go(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.vm
            .devices
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send_go(bytes)
    }

    /// Takes one event from the vCPUs within `timeout`; remembers the end of the guest. A
    /// handle from [`KvmMachine::control`] takes none: it sleeps and reports the end.
    pub(crate) fn next_event(&mut self, timeout: Duration) -> Option<VmEvent> {
        let Some(owner) = &self.owner else {
            let deadline = Instant::now() + timeout;
            while self.ended().is_none() && Instant::now() < deadline {
                std::thread::sleep(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .min(Duration::from_millis(10)),
                );
            }
            return None;
        };
        match owner.events.recv_timeout(timeout) {
            Ok(event) => {
                if ends_the_run(&event) {
                    self.lock().ended.get_or_insert(event.clone());
                }
                Some(event)
            }
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                self.lock().ended.get_or_insert(VmEvent::Failed {
                    vcpu: 0,
                    message: "every vCPU thread is gone".into(),
                });
                None
            }
        }
    }

    /// Stops every vCPU thread and joins it (the owner; a handle does nothing).
    pub fn shutdown(&mut self) {
        let Some(owner) = self.owner.as_mut() else {
            return;
        };
        for v in &self.vm.vcpus {
            v.ask(RunRequest::Stop);
        }
        for t in owner.threads.drain(..) {
            let _ = t.join();
        }
    }

    fn translate_for(&self, vcpu: VcpuId, va: u64) -> Result<(u64, u64), ControlError> {
        let regs = self.snapshot(vcpu)?.regs;
        let unmapped = ControlError::Memory {
            addr: va,
            len: 1,
            space: "virtual",
        };
        if regs.cr0 & CR0_PG == 0 {
            return Ok((va, 0x1000 - (va & 0xfff)));
        }
        let mem = &self.vm.memory;
        let mut read = |pa: u64| mem.read_obj::<u64>(GuestAddress(pa)).ok();
        translate(
            &mut read,
            kernel_view(regs.cr3, va),
            regs.cr4 & CR4_LA57 != 0,
            va,
        )
        .ok_or(unmapped)
    }

    fn for_each_page(
        &mut self,
        vcpu: VcpuId,
        addr: u64,
        len: usize,
        mut f: impl FnMut(&mut Self, u64, std::ops::Range<usize>) -> Result<(), ControlError>,
    ) -> Result<(), ControlError> {
        let mut done = 0usize;
        while done < len {
            let va = addr.wrapping_add(done as u64);
            let (pa, left) = self
                .translate_for(vcpu, va)
                .map_err(|_| ControlError::Memory {
                    addr: va,
                    len: len - done,
                    space: "virtual",
                })?;
            let n = (len - done).min(usize::try_from(left).unwrap_or(usize::MAX));
            f(self, pa, done..done + n)?;
            done += n;
        }
        Ok(())
    }

    fn all_stopped(&self) -> bool {
        self.vm
            .vcpus
            .iter()
            .all(|v| matches!(v.shared.state(), VcpuState::Paused | VcpuState::Finished))
    }

    /// Why a breakpoint cannot be set through this handle, if it cannot.
    fn traps_refused(&self) -> Option<String> {
        if let Some(why) = &self.vm.traps_refused {
            return Some(why.clone());
        }
        self.owner.is_none().then(|| {
            "the VMM's run loop takes the vCPUs' debug exits, and this handle of the live \
             engine does not see them yet"
                .to_owned()
        })
    }
}

/// PTI's user page-table bit in CR3: the user half of the kernel's 8-KiB PGD pair.
const PTI_USER_PGTABLE: u64 = 1 << 12;

/// The page-table root that translates `va`: a kernel address goes through the kernel's half
/// of a PTI pair even when the vCPU stopped in user mode (the user half maps almost none of
/// the kernel), as a debugger's kernel view does.
fn kernel_view(cr3: u64, va: u64) -> u64 {
    if va >> 63 == 1 {
        cr3 & !PTI_USER_PGTABLE
    } else {
        cr3
    }
}

/// Whether a vCPU event ends the guest's run.
fn ends_the_run(event: &VmEvent) -> bool {
    matches!(
        event,
        VmEvent::Reset { .. } | VmEvent::PowerOff { .. } | VmEvent::Failed { .. }
    )
}

/// The control interface's view of a vCPU event.
fn stop_of(event: VmEvent) -> StopEvent {
    match event {
        VmEvent::Breakpoint { vcpu, pc } => StopEvent::Breakpoint {
            vcpu: VcpuId(vcpu),
            pc,
        },
        VmEvent::Stepped { vcpu } => StopEvent::Stepped { vcpu: VcpuId(vcpu) },
        VmEvent::Reset { .. }
        | VmEvent::PowerOff { .. }
        | VmEvent::Failed { .. }
        | VmEvent::Halted => StopEvent::Exited,
    }
}

impl Drop for KvmMachine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Machine for KvmMachine {
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        Ok((0..self.vm.vcpus.len() as u32).map(VcpuId).collect())
    }

    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.vm
            .memory
            .read_slice(buf, GuestAddress(addr))
            .map_err(|_| ControlError::Memory {
                addr,
                len: buf.len(),
                space: "physical",
            })
    }

    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.vm
            .memory
            .write_slice(data, GuestAddress(addr))
            .map_err(|_| ControlError::Memory {
                addr,
                len: data.len(),
                space: "physical",
            })
    }

    fn read_virt(&mut self, vcpu: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        let len = buf.len();
        self.for_each_page(vcpu, addr, len, |m, pa, range| {
            m.read_phys(pa, &mut buf[range])
        })
    }

    fn write_virt(&mut self, vcpu: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.for_each_page(vcpu, addr, data.len(), |m, pa, range| {
            m.write_phys(pa, &data[range])
        })
    }

    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError> {
        Ok(RegisterFile::X86_64(self.snapshot(vcpu)?.regs))
    }

    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError> {
        if self.handle(vcpu)?.shared.set_pc(pc) {
            Ok(())
        } else {
            Err(ControlError::Running)
        }
    }

    /// Asks every vCPU to park (each is kicked out of `KVM_RUN` with a signal and
    /// `immediate_exit`) and waits until all are `Paused` or `Finished`.
    fn pause(&mut self) -> Result<(), ControlError> {
        let mut control = self.lock();
        for v in &self.vm.vcpus {
            v.ask(RunRequest::Pause);
        }
        // A vCPU that has not parked after a while is kicked again (a signal and
        // `immediate_exit` once more): nested under TCG's SVM a kick has been seen to go
        // unanswered, and a pause that never returns blocks whoever asked, the run's own
        // timeout included. Past PAUSE_LIMIT the pause fails instead.
        let started = Instant::now();
        for v in &self.vm.vcpus {
            while v.shared.wait_stopped_for(PAUSE_REKICK).is_none() {
                if started.elapsed() > PAUSE_LIMIT {
                    return Err(ControlError::Backend {
                        backend: BACKEND,
                        source: format!(
                            "vCPU {} did not stop within {} s of being asked",
                            v.shared.id,
                            PAUSE_LIMIT.as_secs()
                        )
                        .into(),
                    });
                }
                tracing::debug!("vCPU {} has not stopped yet: kicked again", v.shared.id);
                v.ask(RunRequest::Pause);
            }
        }
        control.paused = true;
        self.vm.pauses.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn resume(&mut self) -> Result<(), ControlError> {
        let mut control = self.lock();
        if control.ended.is_some() {
            return Ok(());
        }
        for v in &self.vm.vcpus {
            v.ask(RunRequest::Run);
        }
        control.paused = false;
        Ok(())
    }

    fn is_paused(&self) -> bool {
        self.lock().paused
    }

    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError> {
        if insert {
            if let Some(why) = self.traps_refused() {
                return Err(ControlError::Refused {
                    backend: BACKEND,
                    what: "set a software breakpoint",
                    why,
                });
            }
        }
        if !self.all_stopped() {
            return Err(ControlError::Running);
        }
        let mut breakpoints = std::mem::take(&mut self.lock().breakpoints);
        let result = (|| {
            if insert {
                if breakpoints.contains_key(&addr) {
                    return Ok(());
                }
                let (pa, _) = self.translate_for(VcpuId(0), addr)?;
                let mut orig = [0u8];
                self.read_phys(pa, &mut orig)?;
                self.write_phys(pa, &[0xcc])?;
                breakpoints.insert(addr, (pa, orig[0]));
            } else if let Some((pa, orig)) = breakpoints.remove(&addr) {
                self.write_phys(pa, &[orig])?;
            }
            Ok(())
        })();
        let control = if breakpoints.is_empty() {
            0
        } else {
            DEBUG_SW_BP
        };
        self.lock().breakpoints = breakpoints;
        for v in &self.vm.vcpus {
            v.shared.set_debug(control);
        }
        result
    }

    fn wait_event(&mut self, timeout: Duration) -> Result<Option<StopEvent>, ControlError> {
        if self.ended().is_some() {
            return Ok(Some(StopEvent::Exited));
        }
        let Some(event) = self.next_event(timeout) else {
            return Ok(self.ended().map(|_| StopEvent::Exited));
        };
        let stop = stop_of(event);
        self.pause()?;
        Ok(Some(stop))
    }

    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError> {
        if self.owner.is_none() {
            return Err(ControlError::Unsupported {
                backend: BACKEND,
                what: "single-step through a handle that takes no vCPU events",
            });
        }
        let handle = self.handle(vcpu)?;
        if handle.shared.state() != VcpuState::Paused {
            return Err(ControlError::Running);
        }
        let restore = if self.lock().breakpoints.is_empty() {
            0
        } else {
            DEBUG_SW_BP
        };
        handle.shared.set_debug(DEBUG_STEP);
        handle.ask(RunRequest::Run);
        let deadline = Instant::now() + Duration::from_secs(10);
        let result = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_event(left) {
                Some(VmEvent::Stepped { vcpu: v }) if v == vcpu.0 => {
                    break Ok(StopEvent::Stepped { vcpu })
                }
                Some(VmEvent::Breakpoint { vcpu: v, pc }) if v == vcpu.0 => {
                    break Ok(StopEvent::Breakpoint { vcpu, pc })
                }
                Some(
                    VmEvent::Reset { .. }
                    | VmEvent::PowerOff { .. }
                    | VmEvent::Failed { .. }
                    | VmEvent::Halted,
                ) => break Ok(StopEvent::Exited),
                Some(_) => {}
                None if self.ended().is_some() => break Ok(StopEvent::Exited),
                None => {
                    break Err(ControlError::Backend {
                        backend: BACKEND,
                        source: "the single step did not finish within 10 s".into(),
                    })
                }
            }
        };
        let handle = self.handle(vcpu)?;
        handle.shared.wait_stopped();
        handle.shared.set_debug(restore);
        result
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    /// The vCPU's own IDTR, from the snapshot it left when it parked.
    fn idt_base(&mut self, vcpu: VcpuId) -> Result<u64, ControlError> {
        Ok(self.snapshot(vcpu)?.idt_base)
    }

    fn reads_while_running(&self) -> bool {
        true
    }

    fn guest_outlives_process(&self) -> bool {
        false
    }

    fn pause_count(&self) -> Option<u64> {
        Some(self.vm.pauses.load(Ordering::Relaxed))
    }

    /// The memfd slots of the guest's RAM (all of them, the patch heap's included).
    fn shared_regions(&self) -> Vec<SharedRegion> {
        self.vm
            .memory
            .iter()
            .filter_map(|r| {
                let at = r.file_offset()?;
                Some(SharedRegion {
                    gpa: r.start_addr().0,
                    size: r.len(),
                    file: Arc::clone(at.arc()),
                    offset: at.start(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A sparse physical memory of page-table entries.
    fn tables(entries: &[(u64, u64)]) -> HashMap<u64, u64> {
        entries.iter().copied().collect()
    }

    #[test]
    fn four_level_walk_finds_a_4k_page() {
        let va: u64 = 0xffff_ffff_8100_1234;
        let mem = tables(&[
            (0x1000 + ((va >> 39) & 0x1ff) * 8, 0x2003),
            (0x2000 + ((va >> 30) & 0x1ff) * 8, 0x3003),
            (0x3000 + ((va >> 21) & 0x1ff) * 8, 0x4003),
            (0x4000 + ((va >> 12) & 0x1ff) * 8, 0x0123_4000 | 0x63),
        ]);
        let mut read = |pa: u64| mem.get(&pa).copied();

        assert_eq!(
            translate(&mut read, 0x1000, false, va),
            Some((0x0123_4234, 0x1000 - 0x234))
        );
    }

    #[test]
    fn two_mib_page_stops_the_walk_at_the_pd() {
        let va: u64 = 0xffff_ffff_8123_4567;
        let mem = tables(&[
            (0x1000 + ((va >> 39) & 0x1ff) * 8, 0x2003),
            (0x2000 + ((va >> 30) & 0x1ff) * 8, 0x3003),
            (0x3000 + ((va >> 21) & 0x1ff) * 8, 0x0460_0000 | 0x83),
        ]);
        let mut read = |pa: u64| mem.get(&pa).copied();

        assert_eq!(
            translate(&mut read, 0x1000, false, va),
            Some((0x0463_4567, 0x20_0000 - 0x3_4567))
        );
    }

    #[test]
    fn kernel_addresses_go_through_the_kernel_half_of_a_pti_pair() {
        let user_cr3 = 0x0123_5000 | PTI_USER_PGTABLE | 0x7; // PCID 7, user half

        assert_eq!(
            kernel_view(user_cr3, 0xffff_ffff_8100_0000),
            0x0123_4000 | 0x7
        );
        assert_eq!(kernel_view(user_cr3, 0x7fff_0000_1000), user_cr3);
    }

    #[test]
    fn vcpu_events_map_to_stop_events_and_only_resets_and_failures_end_the_run() {
        let event = VmEvent::PowerOff { vcpu: 1 };

        assert!(ends_the_run(&event));
        assert!(!ends_the_run(&VmEvent::Breakpoint { vcpu: 0, pc: 1 }));
        assert_eq!(stop_of(event), StopEvent::Exited);
        assert_eq!(
            stop_of(VmEvent::Breakpoint { vcpu: 1, pc: 0x10 }),
            StopEvent::Breakpoint {
                vcpu: VcpuId(1),
                pc: 0x10
            }
        );
    }

    #[test]
    fn not_present_entry_is_unmapped() {
        let mem = tables(&[(0x1000, 0x2002)]);
        let mut read = |pa: u64| mem.get(&pa).copied();

        assert_eq!(translate(&mut read, 0x1000, false, 0x1234), None);
    }
}
