//! A running KVM guest under the shared control interface ([`Machine`]).
//!
//! Memory is read and written directly in the VMM's mapping of guest RAM and the patch heap;
//! virtual addresses go through the paused vCPU's own page tables (4- or 5-level, large pages).
//! Registers come from the snapshot each vCPU leaves when it parks.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::devices::Devices;
use super::vcpu::{RunRequest, Snapshot, VcpuShared, VcpuState, VmEvent, DEBUG_STEP, DEBUG_SW_BP};
use crate::control::{ControlError, Machine, RegisterFile, StopEvent, VcpuId};

const BACKEND: &str = "kvm";

/// One vCPU as the host holds it.
#[derive(Debug)]
pub struct VcpuHandle {
    /// Shared with the thread.
    pub shared: Arc<VcpuShared>,
    /// The thread (None once joined).
    pub thread: Option<JoinHandle<()>>,
}

impl VcpuHandle {
    fn ask(&self, request: RunRequest) {
        if let Some(t) = &self.thread {
            let pthread = std::os::unix::thread::JoinHandleExt::as_pthread_t(t);
            self.shared.ask(request, pthread);
        }
    }
}

/// A KVM guest: its memory, its vCPU threads, their events.
#[derive(Debug)]
pub struct KvmMachine {
    pub(crate) memory: Arc<GuestMemoryMmap>,
    pub(crate) vcpus: Vec<VcpuHandle>,
    pub(crate) events: Receiver<VmEvent>,
    pub(crate) devices: Arc<Mutex<Devices>>,
    /// Keeps the VM (and so the vCPUs' VM) alive as long as the machine.
    pub(crate) _vm: kvm_ioctls::VmFd,
    breakpoints: BTreeMap<u64, (u64, u8)>,
    paused: bool,
    /// Why the guest is gone, once it is.
    ended: Option<VmEvent>,
}

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
        events: Receiver<VmEvent>,
        devices: Arc<Mutex<Devices>>,
        vm: kvm_ioctls::VmFd,
    ) -> Self {
        Self {
            memory,
            vcpus,
            events,
            devices,
            _vm: vm,
            breakpoints: BTreeMap::new(),
            paused: false,
            ended: None,
        }
    }

    fn handle(&self, vcpu: VcpuId) -> Result<&VcpuHandle, ControlError> {
        self.vcpus
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
        if self.ended.is_some() {
            return true;
        }
        let was_paused = self.paused;
        if self.pause().is_err() {
            return false;
        }
        let dead = self.vcpus.iter().all(|v| match v.shared.state() {
            VcpuState::Finished => true,
            _ => v.shared.snapshot().is_some_and(|s| s.stopped_for_good()),
        });
        for v in &self.vcpus {
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
            self.ended = Some(VmEvent::Halted);
        } else if !was_paused {
            let _ = self.resume();
        }
        dead
    }

    /// Why the guest ended, once it has.
    pub fn ended(&self) -> Option<&VmEvent> {
        self.ended.as_ref()
    }

    /// Writes bytes to the guest's go channel (ttyS1).
    ///
    /// # Errors
    /// When the UART's FIFO is full.
    pub fn send_go(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.devices
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send_go(bytes)
    }

    /// Takes one event from the vCPUs within `timeout`; remembers the end of the guest.
    pub(crate) fn next_event(&mut self, timeout: Duration) -> Option<VmEvent> {
        match self.events.recv_timeout(timeout) {
            Ok(event) => {
                if matches!(
                    event,
                    VmEvent::Reset { .. } | VmEvent::PowerOff { .. } | VmEvent::Failed { .. }
                ) {
                    self.ended.get_or_insert(event.clone());
                }
                Some(event)
            }
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => {
                self.ended.get_or_insert(VmEvent::Failed {
                    vcpu: 0,
                    message: "every vCPU thread is gone".into(),
                });
                None
            }
        }
    }

    /// Stops every vCPU thread and joins it.
    pub fn shutdown(&mut self) {
        for v in &self.vcpus {
            v.ask(RunRequest::Stop);
        }
        for v in &mut self.vcpus {
            if let Some(t) = v.thread.take() {
                let _ = t.join();
            }
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
        let mem = &self.memory;
        let mut read = |pa: u64| mem.read_obj::<u64>(GuestAddress(pa)).ok();
        translate(&mut read, regs.cr3, regs.cr4 & CR4_LA57 != 0, va).ok_or(unmapped)
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
        self.vcpus
            .iter()
            .all(|v| matches!(v.shared.state(), VcpuState::Paused | VcpuState::Finished))
    }
}

impl Drop for KvmMachine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Machine for KvmMachine {
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        Ok((0..self.vcpus.len() as u32).map(VcpuId).collect())
    }

    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.memory
            .read_slice(buf, GuestAddress(addr))
            .map_err(|_| ControlError::Memory {
                addr,
                len: buf.len(),
                space: "physical",
            })
    }

    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.memory
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

    fn pause(&mut self) -> Result<(), ControlError> {
        for v in &self.vcpus {
            v.ask(RunRequest::Pause);
        }
        for v in &self.vcpus {
            v.shared.wait_stopped();
        }
        self.paused = true;
        Ok(())
    }

    fn resume(&mut self) -> Result<(), ControlError> {
        if self.ended.is_some() {
            return Ok(());
        }
        for v in &self.vcpus {
            v.ask(RunRequest::Run);
        }
        self.paused = false;
        Ok(())
    }

    fn is_paused(&self) -> bool {
        self.paused
    }

    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError> {
        if !self.all_stopped() {
            return Err(ControlError::Running);
        }
        if insert {
            if self.breakpoints.contains_key(&addr) {
                return Ok(());
            }
            let (pa, _) = self.translate_for(VcpuId(0), addr)?;
            let mut orig = [0u8];
            self.read_phys(pa, &mut orig)?;
            self.write_phys(pa, &[0xcc])?;
            self.breakpoints.insert(addr, (pa, orig[0]));
        } else if let Some((pa, orig)) = self.breakpoints.remove(&addr) {
            self.write_phys(pa, &[orig])?;
        }
        let control = if self.breakpoints.is_empty() {
            0
        } else {
            DEBUG_SW_BP
        };
        for v in &self.vcpus {
            v.shared.set_debug(control);
        }
        Ok(())
    }

    fn wait_event(&mut self, timeout: Duration) -> Result<Option<StopEvent>, ControlError> {
        if self.ended.is_some() {
            return Ok(Some(StopEvent::Exited));
        }
        let Some(event) = self.next_event(timeout) else {
            return Ok(self.ended.as_ref().map(|_| StopEvent::Exited));
        };
        let stop = match event {
            VmEvent::Breakpoint { vcpu, pc } => StopEvent::Breakpoint {
                vcpu: VcpuId(vcpu),
                pc,
            },
            VmEvent::Stepped { vcpu } => StopEvent::Stepped { vcpu: VcpuId(vcpu) },
            VmEvent::Reset { .. }
            | VmEvent::PowerOff { .. }
            | VmEvent::Failed { .. }
            | VmEvent::Halted => StopEvent::Exited,
        };
        self.pause()?;
        Ok(Some(stop))
    }

    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError> {
        let handle = self.handle(vcpu)?;
        if handle.shared.state() != VcpuState::Paused {
            return Err(ControlError::Running);
        }
        let restore = if self.breakpoints.is_empty() {
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
                None if self.ended.is_some() => break Ok(StopEvent::Exited),
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
    fn not_present_entry_is_unmapped() {
        let mem = tables(&[(0x1000, 0x2002)]);
        let mut read = |pa: u64| mem.get(&pa).copied();

        assert_eq!(translate(&mut read, 0x1000, false, 0x1234), None);
    }
}
