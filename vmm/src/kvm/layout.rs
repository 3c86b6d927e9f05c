//! Where things go in guest-physical memory, and the e820 map the kernel is given.
//!
//! Low memory follows what the Linux x86 boot protocol and firecracker do for a 64-bit entry:
//!
//! | range | what |
//! |---|---|
//! | `0x500..0x540` | GDT (`__BOOT_CS` = 0x10, `__BOOT_DS` = 0x18) |
//! | `0x540..0x548` | IDT (empty: interrupts stay off until the kernel loads its own) |
//! | `0x7000..0x8000` | the zero page (`struct boot_params`) |
//! | `0x8ff0` | boot stack top |
//! | `0x9000..0xf000` | identity page tables: PML4, PDPT, 4 PDs mapping 4 GiB with 2 MiB pages |
//! | `0x20000..` | kernel command line |
//! | `0x9fc00..0xa0000` | MP table (reserved in e820) |
//! | `0xe0000..0x100000` | ACPI tables, RSDP first (reserved in e820, like a PC BIOS area) |
//! | `0x100000..` | the bzImage's protected-mode kernel |
//! | below the patch heap | initramfs |
//! | top of guest memory | patch heap: a memory slot of its own, absent from the e820 RAM map |

use crate::qemu::PatchHeapRange;

/// GDT base.
pub const GDT_ADDR: u64 = 0x500;
/// IDT base.
pub const IDT_ADDR: u64 = 0x540;
/// The zero page.
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial stack pointer.
pub const BOOT_STACK: u64 = 0x8ff0;
/// PML4 of the identity map.
pub const PML4_ADDR: u64 = 0x9000;
/// PDPT of the identity map.
pub const PDPT_ADDR: u64 = 0xa000;
/// First of the four page directories.
pub const PD_ADDR: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x20000;
/// Room for the command line (the kernel's COMMAND_LINE_SIZE is 2048 on x86).
pub const CMDLINE_MAX: usize = 2048;
/// Start of the MP table area, the last KiB of conventional memory (the EBDA's usual place).
pub const MPTABLE_ADDR: u64 = 0x9fc00;
/// End of conventional memory.
pub const LOW_RAM_END: u64 = 0xa0000;
/// Start of the BIOS area that holds the ACPI tables ([`super::acpi::ACPI_ADDR`]).
pub const BIOS_AREA: u64 = 0xe0000;
/// Where the protected-mode kernel of the bzImage is loaded (`code32_start`'s default).
pub const KERNEL_ADDR: u64 = 0x100000;
/// Above this the 32-bit PCI/MMIO hole starts (IOAPIC, LAPIC): guest RAM stays below it.
pub const MMIO_HOLE: u64 = 0xc000_0000;
/// Page size.
pub const PAGE: u64 = 0x1000;

/// e820 entry types (arch/x86/include/asm/e820/types.h).
pub const E820_RAM: u32 = 1;
/// Reserved.
pub const E820_RESERVED: u32 = 2;

/// One e820 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// Start.
    pub addr: u64,
    /// Length.
    pub size: u64,
    /// [`E820_RAM`] or [`E820_RESERVED`].
    pub kind: u32,
}

/// Errors of laying out guest memory.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    /// Guest memory reaches into the MMIO hole.
    #[error(
        "{mib} MiB of guest memory reaches into the MMIO hole at {hole:#x} (at most {max} MiB)"
    )]
    TooMuchMemory {
        /// Requested.
        mib: u64,
        /// The hole.
        hole: u64,
        /// Largest allowed.
        max: u64,
    },
    /// The heap is not at the top of guest memory.
    #[error("the patch heap {0} is not at the top of guest memory")]
    HeapNotAtTop(PatchHeapRange),
    /// Too little RAM under the heap for the kernel.
    #[error("{0:#x} bytes of RAM below the patch heap are too few to boot")]
    TooLittleRam(u64),
    /// The initramfs does not fit.
    #[error("an initramfs of {size} bytes does not fit below {limit:#x}")]
    InitrdDoesNotFit {
        /// Its size.
        size: u64,
        /// Highest end.
        limit: u64,
    },
}

/// Guest-physical layout: RAM below the patch heap, the heap at the top.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryLayout {
    /// Bytes of guest memory in all (RAM and heap).
    pub memory: u64,
    /// The heap.
    pub heap: PatchHeapRange,
}

impl MemoryLayout {
    /// Checks that `heap` is the top of `memory_mib` MiB and that the rest can boot.
    ///
    /// # Errors
    /// Memory in the MMIO hole, a heap elsewhere, or less than 64 MiB of RAM.
    pub fn new(memory_mib: u64, heap: PatchHeapRange) -> Result<Self, LayoutError> {
        let memory = memory_mib << 20;
        if memory > MMIO_HOLE {
            return Err(LayoutError::TooMuchMemory {
                mib: memory_mib,
                hole: MMIO_HOLE,
                max: MMIO_HOLE >> 20,
            });
        }
        if heap.base.checked_add(heap.size) != Some(memory) {
            return Err(LayoutError::HeapNotAtTop(heap));
        }
        if heap.base < (64 << 20) {
            return Err(LayoutError::TooLittleRam(heap.base));
        }
        Ok(Self { memory, heap })
    }

    /// End of RAM (the heap's base).
    pub fn ram_end(&self) -> u64 {
        self.heap.base
    }

    /// The memory slots: (guest-physical start, size). Slot 0 is RAM, slot 1 the heap.
    pub fn slots(&self) -> [(u64, u64); 2] {
        [(0, self.heap.base), (self.heap.base, self.heap.size)]
    }

    /// The e820 map: conventional memory, the MP table's reserved KiB, the reserved BIOS area
    /// with the ACPI tables, RAM from 1 MiB to the
    /// heap. The heap is not listed, so the kernel never allocates from it.
    pub fn e820(&self) -> Vec<E820Entry> {
        vec![
            E820Entry {
                addr: 0,
                size: MPTABLE_ADDR,
                kind: E820_RAM,
            },
            E820Entry {
                addr: MPTABLE_ADDR,
                size: LOW_RAM_END - MPTABLE_ADDR,
                kind: E820_RESERVED,
            },
            E820Entry {
                addr: BIOS_AREA,
                size: KERNEL_ADDR - BIOS_AREA,
                kind: E820_RESERVED,
            },
            E820Entry {
                addr: KERNEL_ADDR,
                size: self.ram_end() - KERNEL_ADDR,
                kind: E820_RAM,
            },
        ]
    }

    /// Where an initramfs of `size` bytes goes: page-aligned, as high as possible below the
    /// heap and below `addr_max` (the setup header's `initrd_addr_max`, the highest byte).
    ///
    /// # Errors
    /// When it would overlap the kernel at 1 MiB (plus `kernel_end`).
    pub fn initrd_addr(
        &self,
        size: u64,
        addr_max: u64,
        kernel_end: u64,
    ) -> Result<u64, LayoutError> {
        let limit = self.ram_end().min(addr_max.saturating_add(1));
        let err = LayoutError::InitrdDoesNotFit { size, limit };
        let start = limit.checked_sub(size).ok_or(err.clone())? & !(PAGE - 1);
        if start < kernel_end {
            return Err(err);
        }
        Ok(start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> MemoryLayout {
        let heap = PatchHeapRange::place(1024 << 20, 64 << 20).unwrap();
        MemoryLayout::new(1024, heap).unwrap()
    }

    #[test]
    fn e820_lists_ram_below_the_heap_and_never_the_heap() {
        let l = layout();

        let map = l.e820();

        assert_eq!(
            map,
            vec![
                E820Entry {
                    addr: 0,
                    size: 0x9fc00,
                    kind: 1
                },
                E820Entry {
                    addr: 0x9fc00,
                    size: 0x400,
                    kind: 2
                },
                E820Entry {
                    addr: 0xe0000,
                    size: 0x20000,
                    kind: 2
                },
                E820Entry {
                    addr: 0x100000,
                    size: 0x3c00_0000 - 0x100000,
                    kind: 1
                },
            ]
        );
        let heap = (0x3c00_0000u64, 0x4000_0000u64);
        assert!(map
            .iter()
            .all(|e| e.addr + e.size <= heap.0 || e.addr >= heap.1));
    }

    #[test]
    fn slots_cover_memory_with_the_heap_separate() {
        assert_eq!(
            layout().slots(),
            [(0, 0x3c00_0000), (0x3c00_0000, 64 << 20)]
        );
    }

    #[test]
    fn initrd_goes_page_aligned_just_below_the_heap() {
        let addr = layout()
            .initrd_addr(0x1234, 0x7fff_ffff, 0x200_0000)
            .unwrap();

        assert_eq!(addr, 0x3c00_0000 - 0x2000);
    }

    #[test]
    fn initrd_respects_initrd_addr_max() {
        let heap = PatchHeapRange::place(3072 << 20, 64 << 20).unwrap();
        let l = MemoryLayout::new(3072, heap).unwrap();

        let addr = l.initrd_addr(0x1000, 0x7fff_ffff, 0x200_0000).unwrap();

        assert_eq!(addr, 0x8000_0000 - 0x1000);
    }

    #[test]
    fn memory_in_the_mmio_hole_or_a_heap_elsewhere_is_refused() {
        let heap = PatchHeapRange {
            base: 0xf000_0000,
            size: 64 << 20,
        };
        assert!(matches!(
            MemoryLayout::new(4096, heap),
            Err(LayoutError::TooMuchMemory { .. })
        ));
        let low = PatchHeapRange {
            base: 0x1000_0000,
            size: 64 << 20,
        };
        assert_eq!(
            MemoryLayout::new(1024, low),
            Err(LayoutError::HeapNotAtTop(low))
        );
    }
}
