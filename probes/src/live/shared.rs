//! The patch heap read through guest RAM shared with QEMU (the zero-stop data path): counters,
//! trace rings and compiled output rings are read while the vCPUs run, no gdbstub stop.
//!
//! QEMU must run with its RAM in a shared memory backend
//! ([`exotap_vmm::qemu::shared_ram_args`]); exotap does that itself when it boots the guest,
//! and `--target ... --shm FILE` names the file of a guest someone else started that way.
//! Before the file is trusted, [`SharedHeap::verify`] compares a page read through it with
//! the same page read over the gdbstub: a wrong file is refused, and the session falls back
//! to stop-and-read.
//!
//! Only data goes through here; kernel text and patch code are written over the gdbstub,
//! which invalidates QEMU's translated blocks (see [`exotap_vmm::shared_ram`]).

use std::path::Path;
use std::sync::Arc;

use exotap_vmm::control::{ControlError, Machine, RegisterFile, StopEvent, VcpuId};
use exotap_vmm::shared_ram::{SharedRam, SharedRamError};

use crate::rings::RingMemory;

/// How to start QEMU so that exotap can read its guest without stopping it.
pub const FAST_PATH_HINT: &str = "start QEMU with its RAM shared: -object memory-backend-file,id=ram,size=<RAM>M,mem-path=/dev/shm/guest-ram,share=on -machine memory-backend=ram (same size as -m), and give exotap --shm /dev/shm/guest-ram";

/// Errors of the shared heap.
#[derive(Debug, thiserror::Error)]
pub enum SharedHeapError {
    /// The file cannot be mapped.
    #[error("cannot use the shared guest RAM")]
    Ram(#[from] SharedRamError),
    /// The gdbstub could not read the page to compare.
    #[error("cannot read guest-physical {0:#x} over the gdbstub to check the shared RAM file")]
    Gdb(u64),
    /// The file is not this guest's RAM.
    #[error("{path} is not this guest's RAM: guest-physical {addr:#x} differs from what the gdbstub reads there")]
    NotThisGuest {
        /// The file.
        path: String,
        /// The page compared.
        addr: u64,
    },
    /// A heap address outside the patch heap.
    #[error("{addr:#x} (+{len} bytes) is outside the patch heap")]
    OutsideHeap {
        /// The address.
        addr: u64,
        /// The length.
        len: u64,
    },
}

/// Guest RAM shared with QEMU, and where the patch heap is in it.
#[derive(Debug, Clone)]
pub struct SharedHeap {
    ram: Arc<SharedRam>,
    /// The heap's kernel virtual address, guest-physical address and size (once mapped).
    heap: Option<(u64, u64, u64)>,
}

impl SharedHeap {
    /// Maps the RAM file at `path`.
    ///
    /// # Errors
    /// When it cannot be mapped.
    pub fn open(path: &Path) -> Result<Self, SharedHeapError> {
        Ok(Self {
            ram: Arc::new(SharedRam::open(path)?),
            heap: None,
        })
    }

    /// Checks that the file is the guest's RAM: the page at guest-physical `page` (pick one
    /// that is not zero, e.g. the kernel's page-table root) must read the same through the
    /// file and over the gdbstub (the guest paused).
    ///
    /// # Errors
    /// [`SharedHeapError::NotThisGuest`] when they differ, or either read fails.
    pub fn verify(&self, machine: &mut dyn Machine, page: u64) -> Result<(), SharedHeapError> {
        let mut over_gdb = vec![0u8; 4096];
        machine
            .read_phys(page, &mut over_gdb)
            .map_err(|_| SharedHeapError::Gdb(page))?;
        let mut shared = vec![0u8; 4096];
        self.ram.read(page, &mut shared)?;
        if over_gdb != shared || over_gdb.iter().all(|&b| b == 0) {
            return Err(SharedHeapError::NotThisGuest {
                path: self.ram.path().display().to_string(),
                addr: page,
            });
        }
        Ok(())
    }

    /// Tells where the patch heap is: kernel virtual `va`, guest-physical `phys`, `size`
    /// bytes. Heap addresses are translated and bounded by it from then on.
    pub fn set_heap(&mut self, va: u64, phys: u64, size: u64) {
        self.heap = Some((va, phys, size));
    }

    /// The guest-physical address of heap range `[va, va + len)`.
    #[inline]
    fn phys(&self, va: u64, len: usize) -> Result<u64, SharedHeapError> {
        let len = u64::try_from(len).unwrap_or(u64::MAX);
        let outside = SharedHeapError::OutsideHeap { addr: va, len };
        let (base, phys, size) = self
            .heap
            .ok_or(SharedHeapError::OutsideHeap { addr: va, len })?;
        let offset = va
            .checked_sub(base)
            .ok_or(SharedHeapError::OutsideHeap { addr: va, len })?;
        match offset.checked_add(len) {
            Some(end) if end <= size => phys.checked_add(offset).ok_or(outside),
            _ => Err(outside),
        }
    }

    /// Reads heap bytes at `va` while the guest runs.
    ///
    /// # Errors
    /// Outside the heap or the shared RAM.
    pub fn read_heap(&self, va: u64, len: usize) -> Result<Vec<u8>, SharedHeapError> {
        let mut buf = vec![0u8; len];
        self.ram.read(self.phys(va, len)?, &mut buf)?;
        Ok(buf)
    }

    /// Reads guest-physical memory anywhere in the guest's RAM (not only the heap), the
    /// vCPUs running: the JIT compares the kernel text it translated with what is there now.
    ///
    /// # Errors
    /// A range outside the RAM file.
    pub fn read_phys(&self, phys: u64, buf: &mut [u8]) -> Result<(), SharedHeapError> {
        Ok(self.ram.read(phys, buf)?)
    }

    /// Writes data (never code: see the module documentation) at heap address `va`.
    ///
    /// # Errors
    /// Outside the heap or the shared RAM.
    pub fn write_heap(&self, va: u64, data: &[u8]) -> Result<(), SharedHeapError> {
        Ok(self.ram.write(self.phys(va, data.len())?, data)?)
    }

    /// Writes code at heap address `va` that no vCPU has ever run: QEMU then holds no
    /// translated block of these bytes, so there is nothing to invalidate, and TCG
    /// translates them from this memory when a vCPU first jumps there. The caller answers
    /// for "never run" (see `Splicer`'s `untouched_heap`); code that may have run is
    /// written over the gdbstub.
    ///
    /// # Errors
    /// Outside the heap or the shared RAM.
    pub fn write_unexecuted_code(&self, va: u64, code: &[u8]) -> Result<(), SharedHeapError> {
        Ok(self.ram.write(self.phys(va, code.len())?, code)?)
    }
}

impl SharedHeap {
    /// Whether guest-physical `[phys, phys + len)` is inside the patch heap.
    fn in_heap(&self, phys: u64, len: usize) -> bool {
        let Some((_, base, size)) = self.heap else {
            return false;
        };
        let len = u64::try_from(len).unwrap_or(u64::MAX);
        phys.checked_sub(base)
            .and_then(|o| o.checked_add(len))
            .is_some_and(|end| end <= size)
    }
}

/// The gdbstub machine, with physical reads and writes that fall inside the patch heap
/// going through the shared RAM instead: for the heap's data (the recovery journal, counters,
/// rings), never for code, which the caller writes on the machine itself (see the module
/// documentation). Everything else goes to the machine.
pub struct HeapDataPath<'a> {
    /// The guest's gdbstub.
    pub machine: &'a mut dyn Machine,
    /// The shared RAM.
    pub shared: &'a SharedHeap,
}

impl std::fmt::Debug for HeapDataPath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HeapDataPath")
    }
}

impl Machine for HeapDataPath<'_> {
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        self.machine.vcpus()
    }

    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        if self.shared.in_heap(addr, buf.len()) && self.shared.ram.read(addr, buf).is_ok() {
            return Ok(());
        }
        self.machine.read_phys(addr, buf)
    }

    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        if self.shared.in_heap(addr, data.len()) && self.shared.ram.write(addr, data).is_ok() {
            return Ok(());
        }
        self.machine.write_phys(addr, data)
    }

    fn read_virt(&mut self, vcpu: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.machine.read_virt(vcpu, addr, buf)
    }

    fn write_virt(&mut self, vcpu: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.machine.write_virt(vcpu, addr, data)
    }

    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError> {
        self.machine.registers(vcpu)
    }

    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError> {
        self.machine.set_pc(vcpu, pc)
    }

    fn pause(&mut self) -> Result<(), ControlError> {
        self.machine.pause()
    }

    fn resume(&mut self) -> Result<(), ControlError> {
        self.machine.resume()
    }

    fn is_paused(&self) -> bool {
        self.machine.is_paused()
    }

    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError> {
        self.machine.set_breakpoint(addr, insert)
    }

    fn wait_event(
        &mut self,
        timeout: std::time::Duration,
    ) -> Result<Option<StopEvent>, ControlError> {
        self.machine.wait_event(timeout)
    }

    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError> {
        self.machine.step(vcpu)
    }
}

/// The shared RAM as guest-physical memory, read while the guest runs (page-table walks for
/// the module list: [`crate::live::stacks::KernelStacks::refresh_modules_if_changed`]).
#[derive(Debug)]
pub struct SharedPhysical<'a>(pub &'a SharedHeap);

impl exotap_introspect::memory::PhysicalMemory for SharedPhysical<'_> {
    fn read_phys(
        &mut self,
        addr: u64,
        buf: &mut [u8],
    ) -> Result<(), exotap_introspect::memory::MemoryError> {
        self.0
            .read_phys(addr, buf)
            .map_err(|_| exotap_introspect::memory::MemoryError::Unmapped {
                addr,
                len: buf.len(),
            })
    }
}

impl RingMemory for SharedHeap {
    type Error = SharedHeapError;

    #[inline]
    fn load_acquire(&self, addr: u64) -> Result<u64, SharedHeapError> {
        Ok(self.ram.load_acquire(self.phys(addr, 8)?)?)
    }

    #[inline]
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), SharedHeapError> {
        Ok(self.ram.read(self.phys(addr, buf.len())?, buf)?)
    }

    #[inline]
    fn load_each<F: FnMut(u64) -> bool>(
        &self,
        addr: u64,
        stride: u64,
        count: u64,
        f: F,
    ) -> Result<(), SharedHeapError> {
        let Some(last) = count.checked_sub(1) else {
            return Ok(());
        };
        // The range from the first word to the end of the last, in the heap as a whole.
        let span = last
            .checked_mul(stride)
            .and_then(|s| s.checked_add(8))
            .and_then(|s| usize::try_from(s).ok())
            .ok_or(SharedHeapError::OutsideHeap {
                addr,
                len: u64::MAX,
            })?;
        Ok(self
            .ram
            .load_each(self.phys(addr, span)?, stride, count, f)?)
    }

    #[inline]
    fn append(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<(), SharedHeapError> {
        Ok(self.ram.append(self.phys(addr, len)?, len, out)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rings::{drain_concurrent, RingSet};

    const HEAP_VA: u64 = 0xffff_ffff_a000_0000;

    fn heap_over(ram: &[u8]) -> (tempfile::NamedTempFile, SharedHeap) {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), ram).unwrap();
        let mut heap = SharedHeap::open(file.path()).unwrap();
        heap.set_heap(HEAP_VA, 0x2000, 0x2000);
        (file, heap)
    }

    #[test]
    fn heap_addresses_translate_to_their_physical_offset_and_stay_inside_the_heap() {
        let mut ram = vec![0u8; 0x5000];
        ram[0x2010] = 0x5a;
        let (_file, heap) = heap_over(&ram);

        assert_eq!(heap.read_heap(HEAP_VA + 0x10, 1).unwrap(), [0x5a]);
        assert!(
            heap.read_heap(HEAP_VA + 0x1ff9, 8).is_err(),
            "crosses the heap's end"
        );
        assert!(heap.read_heap(HEAP_VA - 8, 8).is_err(), "below the heap");
        assert!(heap.read_heap(u64::MAX, 2).is_err(), "wraps");
    }

    #[test]
    fn strided_loads_equal_one_load_each_and_stay_inside_the_heap() {
        let ram: Vec<u8> = (0..0x5000u64 / 8).flat_map(|w| w.to_le_bytes()).collect();
        let (_file, heap) = heap_over(&ram);
        let mut seen = Vec::new();

        heap.load_each(HEAP_VA + 0x40, 0x40, 4, |w| {
            seen.push(w);
            true
        })
        .unwrap();
        let one_each: Vec<u64> = (0..4)
            .map(|k| heap.load_acquire(HEAP_VA + 0x40 + 0x40 * k).unwrap())
            .collect();

        assert_eq!(seen, one_each);
        assert_eq!(seen[0], 0x2040 / 8, "the heap's physical offset");
        // The last word would be at 0x2000 into the heap: past its end, though the RAM
        // goes on.
        assert!(heap
            .load_each(HEAP_VA + 0x1000, 0x400, 5, |_| true)
            .is_err());
        assert!(heap.load_each(HEAP_VA + 0x1000, 0x400, 4, |_| true).is_ok());
        assert!(
            heap.load_each(HEAP_VA, u64::MAX, 3, |_| true).is_err(),
            "wraps"
        );
    }

    #[test]
    fn a_ring_in_the_file_drains_through_the_heap_mapping() {
        let set = RingSet {
            base: HEAP_VA + 0x100,
            cpus: 1,
            slots: 2,
            record: 16,
        };
        let mut ram = vec![0u8; 0x5000];
        let ring = 0x2100;
        ram[ring..ring + 8].copy_from_slice(&1u64.to_le_bytes());
        // Record 0 finished: its mark is the TSC 78 with lap tag 0.
        ram[ring + 64..ring + 72].copy_from_slice(&78u64.to_le_bytes());
        ram[ring + 72] = 9;
        let (file, heap) = heap_over(&ram);
        let mut taken = 0;

        let got = drain_concurrent(&heap, &set, 0, &mut taken, false).unwrap();

        assert_eq!(got.records.len(), 16, "one record");
        assert_eq!((got.records[0], got.records[8]), (78, 9));
        assert_eq!(
            std::fs::read(file.path()).unwrap(),
            ram,
            "the reader writes nothing"
        );
    }
}
