//! Planning the patch heap's mapping (DESIGN.md, key mechanism 1): hidden guest-physical
//! memory mapped executable just past the kernel image, by 2 MiB PMD entries written into the
//! kernel's own page-table page for that range, so every kernel instruction reaches it with a
//! `jmp rel32`.
//!
//! This only plans: it reads the tables and returns the entry writes. The entries it fills
//! are non-present now, and x86 never caches non-present entries in the TLB, so the writes
//! need no flush.

use crate::memory::PhysicalMemory;
use crate::paging::{
    AddressSpace, PagingError, TableLevel, PTE_ACCESSED, PTE_ADDR_MASK, PTE_DIRTY, PTE_GLOBAL,
    PTE_PAGE_SIZE, PTE_PRESENT, PTE_WRITABLE, SIZE_2M,
};

/// First address past the kernel-image mapping (the module area starts here).
pub const KERNEL_IMAGE_LIMIT: u64 = 0xffff_ffff_c000_0000;
/// Flags of a heap PMD entry: present, writable, 2 MiB, global, accessed, dirty; executable
/// (NX clear) and supervisor-only.
pub const HEAP_PMD_FLAGS: u64 =
    PTE_PRESENT | PTE_WRITABLE | PTE_PAGE_SIZE | PTE_GLOBAL | PTE_ACCESSED | PTE_DIRTY;

/// Why the heap cannot be mapped there.
#[derive(Debug, thiserror::Error)]
pub enum HeapError {
    /// The physical range is not whole 2 MiB pages.
    #[error(
        "the heap's physical range {phys:#x}+{size:#x} is not whole, 2 MiB-aligned 2 MiB pages"
    )]
    Misaligned {
        /// Physical start.
        phys: u64,
        /// Size.
        size: u64,
    },
    /// The physical range does not fit in a page-table entry.
    #[error("the heap's physical range {phys:#x}+{size:#x} is beyond 52-bit physical addresses")]
    PhysicalTooHigh {
        /// Physical start.
        phys: u64,
        /// Size.
        size: u64,
    },
    /// The virtual range would run into the module area.
    #[error(
        "the heap at {va:#x}+{size:#x} would run past {KERNEL_IMAGE_LIMIT:#x} into the module \
         area"
    )]
    PastImageMapping {
        /// Virtual start.
        va: u64,
        /// Size.
        size: u64,
    },
    /// No PMD page exists for the range: the PUD entry is not present, or is a 1 GiB page.
    #[error(
        "there is no PMD page for the heap at {va:#x}: the kernel maps nothing there to extend"
    )]
    NoPmdPage {
        /// The heap page without a PMD page.
        va: u64,
        /// The walk's failure.
        #[source]
        source: PagingError,
    },
    /// A page table on the way could not be read.
    #[error("walking the page tables for the heap at {va:#x} failed")]
    Walk {
        /// The heap page.
        va: u64,
        /// The cause.
        #[source]
        source: PagingError,
    },
    /// Something is already mapped where the heap would go.
    #[error("{va:#x} is already mapped (PMD entry at {entry_addr:#x} is {entry:#x}); refusing to replace it")]
    Occupied {
        /// The heap page.
        va: u64,
        /// Physical address of its PMD entry.
        entry_addr: u64,
        /// The entry's current value.
        entry: u64,
    },
}

/// One PMD entry to write (and, to unmap, to restore).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PmdWrite {
    /// Guest-physical address of the entry.
    pub entry_addr: u64,
    /// Its value now.
    pub old: u64,
    /// The value that maps the heap page.
    pub new: u64,
}

/// Where the heap goes and the entry writes that put it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeapPlan {
    /// Virtual start: `_end` rounded up to 2 MiB.
    pub va: u64,
    /// Physical start.
    pub phys: u64,
    /// Size in bytes.
    pub size: u64,
    /// The PMD page(s) written into, in order of first use.
    pub pmd_pages: Vec<u64>,
    /// One write per 2 MiB page, by address.
    pub writes: Vec<PmdWrite>,
}

/// Plans mapping `size` bytes of hidden guest-physical memory at `phys` right after the
/// kernel image whose (slid) `_end` is `kernel_end`.
///
/// # Errors
/// [`HeapError::Misaligned`], [`HeapError::PhysicalTooHigh`], [`HeapError::PastImageMapping`],
/// [`HeapError::NoPmdPage`], [`HeapError::Occupied`], [`HeapError::Walk`].
pub fn plan<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    kernel_end: u64,
    phys: u64,
    size: u64,
) -> Result<HeapPlan, HeapError> {
    if size == 0 || !phys.is_multiple_of(SIZE_2M) || !size.is_multiple_of(SIZE_2M) {
        return Err(HeapError::Misaligned { phys, size });
    }
    let phys_last = phys
        .checked_add(size - 1)
        .ok_or(HeapError::PhysicalTooHigh { phys, size })?;
    if phys_last & !PTE_ADDR_MASK & !(SIZE_2M - 1) != 0 {
        return Err(HeapError::PhysicalTooHigh { phys, size });
    }
    let past = HeapError::PastImageMapping {
        va: kernel_end,
        size,
    };
    let va = kernel_end.checked_next_multiple_of(SIZE_2M).ok_or(past)?;
    if va
        .checked_add(size)
        .is_none_or(|end| end > KERNEL_IMAGE_LIMIT)
    {
        return Err(HeapError::PastImageMapping { va, size });
    }
    let mut pmd_pages = Vec::new();
    let mut writes = Vec::new();
    for page in 0..size / SIZE_2M {
        let page_va = va + page * SIZE_2M;
        let slot = space.pmd_slot(page_va).map_err(|source| {
            if is_missing_pmd_page(&source) {
                HeapError::NoPmdPage {
                    va: page_va,
                    source,
                }
            } else {
                HeapError::Walk {
                    va: page_va,
                    source,
                }
            }
        })?;
        if slot.entry & PTE_PRESENT != 0 {
            return Err(HeapError::Occupied {
                va: page_va,
                entry_addr: slot.entry_addr,
                entry: slot.entry,
            });
        }
        if !pmd_pages.contains(&slot.pmd_page) {
            pmd_pages.push(slot.pmd_page);
        }
        let new = (phys + page * SIZE_2M) | HEAP_PMD_FLAGS;
        writes.push(PmdWrite {
            entry_addr: slot.entry_addr,
            old: slot.entry,
            new,
        });
    }
    Ok(HeapPlan {
        va,
        phys,
        size,
        pmd_pages,
        writes,
    })
}

/// Whether a walk failure means "no PMD page" (as opposed to unreadable memory).
fn is_missing_pmd_page(err: &PagingError) -> bool {
    matches!(
        err,
        PagingError::NotPresent {
            level: TableLevel::Pml5 | TableLevel::Pml4 | TableLevel::Pud,
            ..
        } | PagingError::LargePage { .. }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paging::tests::TableBuilder;
    use crate::paging::{translate, PageSize, PTE_NO_EXECUTE};

    /// Slid `_end` of the Debian 6.1 kernel at slide 0x2a000000.
    const END: u64 = 0xffff_ffff_ad83_0000;
    const HEAP_VA: u64 = 0xffff_ffff_ada0_0000;
    const HEAP_PHYS: u64 = 0x1_0000_0000;
    const SIZE: u64 = 64 << 20;

    /// Kernel image mapped by 2 MiB pages up to `_end`, like level2_kernel_pgt after boot.
    fn guest() -> TableBuilder {
        let mut tb = TableBuilder::new(false);
        let start = (END - 0x280_0000) & !(SIZE_2M - 1);
        for va in (start..END).step_by(SIZE_2M as usize) {
            let flags = PTE_PRESENT | PTE_GLOBAL | PTE_NO_EXECUTE;
            tb.map(va, 0x100_0000 + (va - start), TableLevel::Pmd, flags);
        }
        tb
    }

    #[test]
    fn plan_maps_heap_at_end_rounded_up_to_2m() {
        let mut tb = guest();
        let pmd_page = tb.table_at(END, TableLevel::Pmd);

        let plan = plan(&mut tb.space(), END, HEAP_PHYS, SIZE).unwrap();

        assert_eq!(plan.va, HEAP_VA);
        assert_eq!(plan.pmd_pages, [pmd_page]);
        assert_eq!(plan.writes.len(), 32);
        assert_eq!(plan.writes[0].old, 0);
        assert_eq!(plan.writes[0].new, HEAP_PHYS | 0x1e3);
        assert_eq!(plan.writes[1].entry_addr, plan.writes[0].entry_addr + 8);
    }

    #[test]
    fn plan_writes_give_executable_global_2m_mapping() {
        let mut tb = guest();
        let plan = plan(&mut tb.space(), END, HEAP_PHYS, SIZE).unwrap();

        for write in &plan.writes {
            tb.mem.write_phys_u64(write.entry_addr, write.new).unwrap();
        }
        let tr = translate(&mut tb.mem, tb.cr3, false, HEAP_VA + SIZE - 1).unwrap();

        assert_eq!(tr.phys, HEAP_PHYS + SIZE - 1);
        assert_eq!(tr.page_size, PageSize::Size2M);
        assert!(!tr.flags.no_execute && tr.flags.writable && tr.flags.global && !tr.flags.user);
    }

    #[test]
    fn plan_refuses_occupied_pmd_entry() {
        let mut tb = guest();
        tb.map(
            HEAP_VA + 4 * SIZE_2M,
            0x4000_0000,
            TableLevel::Pmd,
            PTE_PRESENT,
        );

        let err = plan(&mut tb.space(), END, HEAP_PHYS, SIZE).unwrap_err();

        assert!(matches!(err, HeapError::Occupied { va, .. } if va == HEAP_VA + 4 * SIZE_2M));
    }

    #[test]
    fn plan_refuses_range_into_module_area() {
        let mut tb = guest();

        let err = plan(
            &mut tb.space(),
            KERNEL_IMAGE_LIMIT - SIZE_2M,
            HEAP_PHYS,
            SIZE,
        )
        .unwrap_err();

        assert!(matches!(err, HeapError::PastImageMapping { .. }));
    }

    #[test]
    fn plan_refuses_misaligned_physical_range() {
        let mut tb = guest();

        let err = plan(&mut tb.space(), END, HEAP_PHYS + 0x1000, SIZE).unwrap_err();

        assert!(matches!(err, HeapError::Misaligned { .. }));
    }

    #[test]
    fn plan_refuses_physical_range_past_52_bits() {
        let mut tb = guest();

        let err = plan(&mut tb.space(), END, 1 << 52, SIZE).unwrap_err();

        assert!(matches!(err, HeapError::PhysicalTooHigh { .. }));
    }

    #[test]
    fn plan_reports_missing_pmd_page() {
        let mut tb = TableBuilder::new(false);
        tb.table_at(END, TableLevel::Pud);

        let err = plan(&mut tb.space(), END, HEAP_PHYS, SIZE).unwrap_err();

        assert!(matches!(
            err,
            HeapError::NoPmdPage {
                source: PagingError::NotPresent {
                    level: TableLevel::Pud,
                    ..
                },
                ..
            }
        ));
    }
}
