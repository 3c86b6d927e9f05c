//! Planning the patch heap's mapping (DESIGN.md, key mechanism 1): hidden guest-physical
//! memory mapped executable next to the kernel image, by 2 MiB PMD entries written into the
//! kernel's own page-table page for that range, so every kernel instruction reaches it with a
//! `jmp rel32`.
//!
//! The heap goes just past `_end` when it fits below the module area, and otherwise just below
//! `_text`: KASLR puts the image anywhere in the 1 GiB at [`KERNEL_IMAGE_START`], so with a
//! high slide (about one boot in 15 for a 64 MiB heap) there is no room above it. Both places
//! lie in that same 1 GiB, mapped by the one PMD page `level2_kernel_pgt`, whose entries
//! outside the image the kernel cleared at boot, and any two addresses in it are within the
//! ±2 GiB of a `rel32`.
//!
//! This only plans: it reads the tables and returns the entry writes. The entries it fills
//! are non-present now, and x86 never caches non-present entries in the TLB, so the writes
//! need no flush.

use crate::memory::PhysicalMemory;
use crate::paging::{
    AddressSpace, PagingError, TableLevel, PTE_ACCESSED, PTE_ADDR_MASK, PTE_DIRTY, PTE_GLOBAL,
    PTE_NO_EXECUTE, PTE_PAGE_SIZE, PTE_PRESENT, PTE_WRITABLE, SIZE_2M,
};

/// First address of the kernel-image mapping (`__START_KERNEL_map`).
pub const KERNEL_IMAGE_START: u64 = 0xffff_ffff_8000_0000;
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
    /// There is no room in the kernel-image mapping on the side(s) allowed.
    #[error(
        "a heap of {size:#x} bytes does not fit {}; use a smaller heap",
        no_room_where(*placement, *after, *before, *size)
    )]
    NoRoom {
        /// The side(s) allowed.
        placement: HeapPlacement,
        /// `_end` rounded up to 2 MiB.
        after: u64,
        /// `_text` rounded down to 2 MiB.
        before: u64,
        /// Size.
        size: u64,
    },
    /// The image range given is not inside the kernel-image mapping.
    #[error(
        "the kernel image {text:#x}..{end:#x} is not inside the kernel-image mapping \
         {KERNEL_IMAGE_START:#x}..{KERNEL_IMAGE_LIMIT:#x}"
    )]
    ImageOutsideMapping {
        /// `_text`.
        text: u64,
        /// `_end`.
        end: u64,
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

/// Where the caller wants the heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeapPlacement {
    /// After the image where it fits, else before it.
    #[default]
    Auto,
    /// After the image or nowhere.
    After,
    /// Before the image or nowhere.
    Before,
}

/// Which side of the kernel image the heap is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeapSide {
    /// Starting at `_end` rounded up to 2 MiB.
    AfterImage,
    /// Ending at `_text` rounded down to 2 MiB.
    BeforeImage,
}

/// Where the heap goes and the entry writes that put it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeapPlan {
    /// Virtual start: `_end` rounded up to 2 MiB, or `_text` rounded down less the size.
    pub va: u64,
    /// Which side of the image that is.
    pub side: HeapSide,
    /// Physical start.
    pub phys: u64,
    /// Size in bytes.
    pub size: u64,
    /// The PMD page(s) written into, in order of first use.
    pub pmd_pages: Vec<u64>,
    /// One write per 2 MiB page, by address.
    pub writes: Vec<PmdWrite>,
}

/// Plans mapping `size` bytes of hidden guest-physical memory at `phys` next to the kernel
/// image whose (slid) `[_text, _end)` is `image`: after it where it fits below the module
/// area, else before it (see the module doc); `placement` can insist on one side.
///
/// # Errors
/// [`HeapError::Misaligned`], [`HeapError::PhysicalTooHigh`], [`HeapError::NoRoom`],
/// [`HeapError::ImageOutsideMapping`], [`HeapError::NoPmdPage`], [`HeapError::Occupied`],
/// [`HeapError::Walk`].
pub fn plan<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    image: (u64, u64),
    placement: HeapPlacement,
    phys: u64,
    size: u64,
) -> Result<HeapPlan, HeapError> {
    check_physical(0, phys, size)?;
    let (va, side) = place(image, placement, size)?;
    let (pmd_pages, writes) = pmd_writes(space, va, phys, size, HEAP_PMD_FLAGS)?;
    Ok(HeapPlan {
        va,
        side,
        phys,
        size,
        pmd_pages,
        writes,
    })
}

/// Flags of a data alias's PMD entry: as [`HEAP_PMD_FLAGS`], not executable.
pub const DATA_ALIAS_PMD_FLAGS: u64 = HEAP_PMD_FLAGS | PTE_NO_EXECUTE;

/// Plans a second, data-only (NX) mapping of `size` bytes of the heap's physical memory at
/// `phys` at the virtual address `va`, by 2 MiB entries in the PMD page the kernel already
/// has there. The JIT maps part of the heap where the kernel's direct map would have it
/// (`page_offset_base + phys`), within a 32-bit displacement of every CPU's per-CPU base,
/// so translated code reaches per-CPU counters as `gs:[disp32]`. Entries that already map
/// this very range (an earlier session's) are accepted; anything else there is refused.
///
/// # Errors
/// [`HeapError::Misaligned`] (`va`, `phys` or `size` not whole 2 MiB pages),
/// [`HeapError::PhysicalTooHigh`], [`HeapError::NoPmdPage`] (no PMD page to extend: the
/// caller goes without the alias), [`HeapError::Occupied`], [`HeapError::Walk`].
pub fn plan_data_alias<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    va: u64,
    phys: u64,
    size: u64,
) -> Result<Vec<PmdWrite>, HeapError> {
    check_physical(va, phys, size)?;
    Ok(pmd_writes(space, va, phys, size, DATA_ALIAS_PMD_FLAGS)?.1)
}

/// Whether `[phys, phys + size)` is whole 2 MiB pages (and `va` 2 MiB-aligned) that a
/// page-table entry can address.
fn check_physical(va: u64, phys: u64, size: u64) -> Result<(), HeapError> {
    if size == 0 || !(phys | size | va).is_multiple_of(SIZE_2M) {
        return Err(HeapError::Misaligned { phys, size });
    }
    let phys_last = phys
        .checked_add(size - 1)
        .ok_or(HeapError::PhysicalTooHigh { phys, size })?;
    if phys_last & !PTE_ADDR_MASK & !(SIZE_2M - 1) != 0 {
        return Err(HeapError::PhysicalTooHigh { phys, size });
    }
    Ok(())
}

/// The PMD entries that map `[phys, phys + size)` at `va` with `flags`: the PMD pages
/// written into, in order of first use, and one write per 2 MiB page.
fn pmd_writes<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    va: u64,
    phys: u64,
    size: u64,
    flags: u64,
) -> Result<(Vec<u64>, Vec<PmdWrite>), HeapError> {
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
        let new = (phys + page * SIZE_2M) | flags;
        // An entry that maps this very heap page already is an earlier exotap's mapping (the
        // heap stays mapped after a session: trampolines in it may still be returned to).
        if slot.entry & PTE_PRESENT != 0 && slot.entry != new {
            return Err(HeapError::Occupied {
                va: page_va,
                entry_addr: slot.entry_addr,
                entry: slot.entry,
            });
        }
        if !pmd_pages.contains(&slot.pmd_page) {
            pmd_pages.push(slot.pmd_page);
        }
        writes.push(PmdWrite {
            entry_addr: slot.entry_addr,
            old: slot.entry,
            new,
        });
    }
    Ok((pmd_pages, writes))
}

/// The heap's virtual start for an image `[text, end)`: after it if it fits and `placement`
/// allows, else before it if that fits and is allowed.
fn place(
    (text, end): (u64, u64),
    placement: HeapPlacement,
    size: u64,
) -> Result<(u64, HeapSide), HeapError> {
    let inside = |va: u64| (KERNEL_IMAGE_START..=KERNEL_IMAGE_LIMIT).contains(&va);
    if text > end || !inside(text) || !inside(end) {
        return Err(HeapError::ImageOutsideMapping { text, end });
    }
    // `end` <= KERNEL_IMAGE_LIMIT, a multiple of 2 MiB, so neither rounding overflows.
    let after = end.next_multiple_of(SIZE_2M);
    let before = text & !(SIZE_2M - 1);
    let (try_after, try_before) = match placement {
        HeapPlacement::Auto => (true, true),
        HeapPlacement::After => (true, false),
        HeapPlacement::Before => (false, true),
    };
    if try_after && KERNEL_IMAGE_LIMIT - after >= size {
        Ok((after, HeapSide::AfterImage))
    } else if try_before && before - KERNEL_IMAGE_START >= size {
        Ok((before - size, HeapSide::BeforeImage))
    } else {
        Err(HeapError::NoRoom {
            placement,
            after,
            before,
            size,
        })
    }
}

/// Says where the heap did not fit, for [`HeapError::NoRoom`].
fn no_room_where(placement: HeapPlacement, after: u64, before: u64, size: u64) -> String {
    let after_msg = format!(
        "after the kernel image ({after:#x}+{size:#x} would run past {KERNEL_IMAGE_LIMIT:#x} \
         into the module area)"
    );
    let before_msg = format!(
        "before the kernel image (below {before:#x} there are only {:#x} bytes above \
         {KERNEL_IMAGE_START:#x})",
        before.saturating_sub(KERNEL_IMAGE_START)
    );
    match placement {
        HeapPlacement::Auto => format!("{after_msg} nor {before_msg}"),
        HeapPlacement::After => after_msg,
        HeapPlacement::Before => before_msg,
    }
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
    use crate::paging::{translate, PageSize};

    /// Slid `_text` and `_end` of the Debian 6.1 kernel at slide 0x2a000000.
    const TEXT: u64 = 0xffff_ffff_ab00_0000;
    const END: u64 = 0xffff_ffff_ad83_0000;
    const IMAGE: (u64, u64) = (TEXT, END);
    const HEAP_VA: u64 = 0xffff_ffff_ada0_0000;
    const HEAP_PHYS: u64 = 0x1_0000_0000;
    const SIZE: u64 = 64 << 20;

    /// The image `[text, end)` mapped by 2 MiB pages like level2_kernel_pgt after boot: the
    /// entries below `_text` keep their early identity-style mapping with only the present bit
    /// cleared (what `__startup_64` does), the rest past `_end` are zero.
    fn guest_at((text, end): (u64, u64)) -> TableBuilder {
        let mut tb = TableBuilder::new(false);
        for va in (KERNEL_IMAGE_START..text).step_by(SIZE_2M as usize) {
            let stale = va - KERNEL_IMAGE_START;
            tb.map(va, stale, TableLevel::Pmd, PTE_GLOBAL);
        }
        for va in (text..end).step_by(SIZE_2M as usize) {
            let flags = PTE_PRESENT | PTE_GLOBAL | PTE_NO_EXECUTE;
            tb.map(va, 0x100_0000 + (va - text), TableLevel::Pmd, flags);
        }
        tb
    }

    fn guest() -> TableBuilder {
        guest_at(IMAGE)
    }

    #[test]
    fn plan_maps_heap_at_end_rounded_up_to_2m() {
        let mut tb = guest();
        let pmd_page = tb.table_at(END, TableLevel::Pmd);

        let plan = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap();

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
        let plan = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap();

        for write in &plan.writes {
            tb.mem.write_phys_u64(write.entry_addr, write.new).unwrap();
        }
        let tr = translate(&mut tb.mem, tb.cr3, false, HEAP_VA + SIZE - 1).unwrap();

        assert_eq!(tr.phys, HEAP_PHYS + SIZE - 1);
        assert_eq!(tr.page_size, PageSize::Size2M);
        assert!(!tr.flags.no_execute && tr.flags.writable && tr.flags.global && !tr.flags.user);
    }

    #[test]
    fn plan_maps_again_over_a_heap_an_earlier_session_mapped() {
        let mut tb = guest();
        let first = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap();
        for write in &first.writes {
            tb.mem.write_phys_u64(write.entry_addr, write.new).unwrap();
        }

        let again = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap();

        assert_eq!(again.va, first.va);
        assert!(again.writes.iter().all(|w| w.old == w.new));
        // Another physical range over the same addresses is still someone else's mapping.
        let other = plan(
            &mut tb.space(),
            IMAGE,
            HeapPlacement::Auto,
            HEAP_PHYS + SIZE,
            SIZE,
        );
        assert!(
            matches!(other, Err(HeapError::Occupied { .. })),
            "{other:?}"
        );
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

        let err = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap_err();

        assert!(matches!(err, HeapError::Occupied { va, .. } if va == HEAP_VA + 4 * SIZE_2M));
    }

    /// The direct map's start (`page_offset_base`) in a KASLR boot.
    const DIRECT_MAP: u64 = 0xffff_9a80_0000_0000;

    /// A direct map of RAM below the heap's physical range by 2 MiB pages: the PMD page
    /// exists, the entries past the RAM are zero.
    fn guest_with_direct_map(ram: u64) -> TableBuilder {
        let mut tb = guest();
        for pa in (0..ram).step_by(SIZE_2M as usize) {
            let flags = PTE_PRESENT | PTE_WRITABLE | PTE_GLOBAL | PTE_NO_EXECUTE;
            tb.map(DIRECT_MAP + pa, pa, TableLevel::Pmd, flags);
        }
        tb
    }

    #[test]
    fn a_data_alias_maps_the_heap_pages_not_executable_in_the_direct_map() {
        const PHYS: u64 = 0x3c00_0000;
        let mut tb = guest_with_direct_map(PHYS);
        let va = DIRECT_MAP + PHYS;

        let writes = plan_data_alias(&mut tb.space(), va, PHYS, 4 * SIZE_2M).unwrap();
        for w in &writes {
            tb.mem.write_phys_u64(w.entry_addr, w.new).unwrap();
        }
        let last = translate(&mut tb.mem, tb.cr3, false, va + 4 * SIZE_2M - 1).unwrap();

        assert_eq!(writes.len(), 4);
        assert!(writes.iter().all(|w| w.old == 0));
        assert_eq!(last.phys, PHYS + 4 * SIZE_2M - 1);
        assert!(last.flags.no_execute && last.flags.writable && !last.flags.user);
        // An earlier session's alias is accepted as it is; other physical memory is not.
        let again = plan_data_alias(&mut tb.space(), va, PHYS, 4 * SIZE_2M).unwrap();
        assert!(again.iter().all(|w| w.old == w.new));
        let other = plan_data_alias(&mut tb.space(), va, PHYS + SIZE_2M, SIZE_2M);
        assert!(
            matches!(other, Err(HeapError::Occupied { .. })),
            "{other:?}"
        );
    }

    #[test]
    fn a_data_alias_refuses_ram_the_kernel_maps_no_pmd_page_and_misalignment() {
        let mut tb = guest_with_direct_map(0x3c00_0000);

        let ram = plan_data_alias(&mut tb.space(), DIRECT_MAP, 0, SIZE_2M);
        let nothing = plan_data_alias(
            &mut tb.space(),
            DIRECT_MAP + (1 << 40),
            0x3c00_0000,
            SIZE_2M,
        );
        let odd = plan_data_alias(
            &mut tb.space(),
            DIRECT_MAP + 0x3c00_1000,
            0x3c00_0000,
            SIZE_2M,
        );

        assert!(matches!(ram, Err(HeapError::Occupied { .. })), "{ram:?}");
        assert!(
            matches!(nothing, Err(HeapError::NoPmdPage { .. })),
            "{nothing:?}"
        );
        assert!(matches!(odd, Err(HeapError::Misaligned { .. })), "{odd:?}");
    }

    /// KASLR slide 0x39000000, as in a CI boot where the heap did not fit after `_end`.
    const HIGH_IMAGE: (u64, u64) = (0xffff_ffff_ba00_0000, 0xffff_ffff_bc83_0000);

    #[test]
    fn plan_goes_below_text_when_the_module_area_is_too_close() {
        let mut tb = guest_at(HIGH_IMAGE);
        let (text, _) = HIGH_IMAGE;

        let plan = plan(
            &mut tb.space(),
            HIGH_IMAGE,
            HeapPlacement::Auto,
            HEAP_PHYS,
            SIZE,
        )
        .unwrap();
        for write in &plan.writes {
            tb.mem.write_phys_u64(write.entry_addr, write.new).unwrap();
        }
        let first = translate(&mut tb.mem, tb.cr3, false, text - SIZE).unwrap();
        let last = translate(&mut tb.mem, tb.cr3, false, text - 1).unwrap();

        assert_eq!((plan.va, plan.side), (text - SIZE, HeapSide::BeforeImage));
        assert_eq!(plan.writes.len(), 32);
        let stale = text - SIZE - KERNEL_IMAGE_START;
        assert_eq!(plan.writes[0].old, stale | PTE_PAGE_SIZE | PTE_GLOBAL);
        assert_eq!((first.phys, last.phys), (HEAP_PHYS, HEAP_PHYS + SIZE - 1));
        assert!(!last.flags.no_execute);
    }

    #[test]
    fn plan_stays_after_end_when_it_fits_exactly() {
        let image = (0xffff_ffff_b000_0000, KERNEL_IMAGE_LIMIT - SIZE - 0x1000);
        let mut tb = guest_at(image);

        let plan = plan(&mut tb.space(), image, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap();

        assert_eq!(plan.va, KERNEL_IMAGE_LIMIT - SIZE);
        assert_eq!(plan.side, HeapSide::AfterImage);
    }

    #[test]
    fn plan_refuses_when_neither_side_has_room() {
        let image = (
            KERNEL_IMAGE_START + SIZE - SIZE_2M,
            KERNEL_IMAGE_LIMIT - SIZE_2M,
        );
        let mut tb = guest_at((image.0, image.0 + SIZE_2M));

        let err = plan(&mut tb.space(), image, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap_err();

        assert!(matches!(
            err,
            HeapError::NoRoom { after, before, size: SIZE, .. }
                if after == image.1 && before == image.0
        ));
        assert!(err.to_string().contains("use a smaller heap"), "{err}");
    }

    #[test]
    fn plan_refuses_an_image_outside_the_image_mapping() {
        let mut tb = guest();

        for image in [
            (0xffff_8880_0000_0000, 0xffff_8880_0200_0000),
            (TEXT, KERNEL_IMAGE_LIMIT + 0x1000),
            (END, TEXT),
        ] {
            let err =
                plan(&mut tb.space(), image, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap_err();
            assert!(
                matches!(err, HeapError::ImageOutsideMapping { .. }),
                "{image:x?}: {err}"
            );
        }
    }

    #[test]
    fn plan_puts_the_heap_on_the_side_asked_for_or_says_why_not() {
        let mut tb = guest();

        let before = plan(
            &mut tb.space(),
            IMAGE,
            HeapPlacement::Before,
            HEAP_PHYS,
            SIZE,
        );
        let after = plan(
            &mut tb.space(),
            HIGH_IMAGE,
            HeapPlacement::After,
            HEAP_PHYS,
            SIZE,
        );

        let before = before.unwrap();
        assert_eq!(
            (before.va, before.side),
            (TEXT - SIZE, HeapSide::BeforeImage)
        );
        let err = after.unwrap_err().to_string();
        assert!(err.contains("does not fit after the kernel image"), "{err}");
        assert!(err.contains("module area"), "{err}");
        let low = (
            KERNEL_IMAGE_START + 0x100_0000,
            KERNEL_IMAGE_START + 0x300_0000,
        );
        let mut tb = guest_at(low);
        let err = plan(&mut tb.space(), low, HeapPlacement::Before, HEAP_PHYS, SIZE).unwrap_err();
        assert!(
            err.to_string().contains("only 0x1000000 bytes above"),
            "{err}"
        );
    }

    #[test]
    fn plan_refuses_misaligned_physical_range() {
        let mut tb = guest();

        let err = plan(
            &mut tb.space(),
            IMAGE,
            HeapPlacement::Auto,
            HEAP_PHYS + 0x1000,
            SIZE,
        )
        .unwrap_err();

        assert!(matches!(err, HeapError::Misaligned { .. }));
    }

    #[test]
    fn plan_refuses_physical_range_past_52_bits() {
        let mut tb = guest();

        let err = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, 1 << 52, SIZE).unwrap_err();

        assert!(matches!(err, HeapError::PhysicalTooHigh { .. }));
    }

    #[test]
    fn plan_reports_missing_pmd_page() {
        let mut tb = TableBuilder::new(false);
        tb.table_at(END, TableLevel::Pud);

        let err = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, HEAP_PHYS, SIZE).unwrap_err();

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

    #[test]
    fn mutated_tables_give_a_plan_or_an_error_never_panics() {
        use crate::mutation::{mutate_memory, XorShift};

        let mut rng = XorShift(0x3c6e_f372_fe94_f82b);
        let mut plans = 0;
        for _ in 0..2000 {
            let mut tb = guest();
            let hot = tb.table_pages();
            mutate_memory(&mut tb.mem, &mut rng, &hot, 8);

            let result = plan(&mut tb.space(), IMAGE, HeapPlacement::Auto, HEAP_PHYS, SIZE);

            plans += usize::from(result.is_ok());
        }

        assert!(plans > 0);
    }
}
