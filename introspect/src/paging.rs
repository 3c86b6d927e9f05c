//! x86-64 page-table walks from outside the guest: guest-virtual → guest-physical.
//!
//! 4-level paging, or 5-level when CR4.LA57 is set; 1 GiB and 2 MiB leaves. Every entry is
//! read from guest memory, so every entry is untrusted: a corrupt table gives an error.

use crate::memory::{MemoryError, PhysicalMemory};

/// Entry bit: the entry maps something.
pub const PTE_PRESENT: u64 = 1 << 0;
/// Entry bit: writes allowed.
pub const PTE_WRITABLE: u64 = 1 << 1;
/// Entry bit: user-mode access allowed.
pub const PTE_USER: u64 = 1 << 2;
/// Entry bit: the CPU has used the entry.
pub const PTE_ACCESSED: u64 = 1 << 5;
/// Entry bit: the page has been written.
pub const PTE_DIRTY: u64 = 1 << 6;
/// Entry bit (PDPT/PD level): the entry is a 1 GiB / 2 MiB leaf, not a table.
pub const PTE_PAGE_SIZE: u64 = 1 << 7;
/// Entry bit: the translation survives CR3 writes (needs CR4.PGE).
pub const PTE_GLOBAL: u64 = 1 << 8;
/// Entry bit: instruction fetches forbidden (needs EFER.NXE).
pub const PTE_NO_EXECUTE: u64 = 1 << 63;
/// The physical-address bits of an entry (bits 12..51).
pub const PTE_ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

/// Bytes in a 4 KiB page.
pub const SIZE_4K: u64 = 1 << 12;
/// Bytes in a 2 MiB page.
pub const SIZE_2M: u64 = 1 << 21;
/// Bytes in a 1 GiB page.
pub const SIZE_1G: u64 = 1 << 30;

/// A level of the page-table tree, by the Linux names (PGD is PML4, or PML5 with LA57).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableLevel {
    /// PML5 (only with LA57); the pgd there.
    Pml5,
    /// PML4; the pgd with 4-level paging, the p4d with 5-level.
    Pml4,
    /// Page-directory-pointer table (pud); can hold 1 GiB leaves.
    Pud,
    /// Page directory (pmd); can hold 2 MiB leaves.
    Pmd,
    /// Page table (pte); 4 KiB leaves.
    Pte,
}

impl TableLevel {
    /// Lowest bit of the virtual address this level's index starts at.
    fn shift(self) -> u32 {
        match self {
            Self::Pml5 => 48,
            Self::Pml4 => 39,
            Self::Pud => 30,
            Self::Pmd => 21,
            Self::Pte => 12,
        }
    }

    fn next(self) -> Option<Self> {
        match self {
            Self::Pml5 => Some(Self::Pml4),
            Self::Pml4 => Some(Self::Pud),
            Self::Pud => Some(Self::Pmd),
            Self::Pmd => Some(Self::Pte),
            Self::Pte => None,
        }
    }

    /// Physical address of the entry for `va` in the table at `table`.
    fn entry_addr(self, table: u64, va: u64) -> u64 {
        table | (((va >> self.shift()) & 0x1ff) * 8)
    }
}

impl std::fmt::Display for TableLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Pml5 => "PML5",
            Self::Pml4 => "PML4",
            Self::Pud => "PUD",
            Self::Pmd => "PMD",
            Self::Pte => "PTE",
        })
    }
}

/// Why a virtual address could not be translated.
#[derive(Debug, thiserror::Error)]
pub enum PagingError {
    /// The address is not canonical for the paging mode.
    #[error("{va:#x} is not a canonical address with {levels}-level paging")]
    NonCanonical {
        /// The address.
        va: u64,
        /// 4 or 5.
        levels: u8,
    },
    /// An entry on the walk is not present.
    #[error("{va:#x} is not mapped: the {level} entry at {entry_addr:#x} is {entry:#x}")]
    NotPresent {
        /// The address.
        va: u64,
        /// The level whose entry is not present.
        level: TableLevel,
        /// Physical address of that entry.
        entry_addr: u64,
        /// Its value.
        entry: u64,
    },
    /// The walk needed a table at a level, but the entry there is a large-page leaf.
    #[error("{va:#x} is mapped by a large page at the {level} level, there is no table below it")]
    LargePage {
        /// The address.
        va: u64,
        /// The level holding the leaf.
        level: TableLevel,
    },
    /// A table or the target could not be read.
    #[error("reading guest-physical memory for {va:#x} failed")]
    Memory {
        /// The virtual address being walked or read.
        va: u64,
        /// The cause.
        #[source]
        source: MemoryError,
    },
}

/// Access rights accumulated over the whole walk, as the CPU applies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageFlags {
    /// Writable at every level.
    pub writable: bool,
    /// User-accessible at every level.
    pub user: bool,
    /// No-execute at some level.
    pub no_execute: bool,
    /// The leaf is global.
    pub global: bool,
}

/// Size of the page that maps an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageSize {
    /// 4 KiB.
    Size4K,
    /// 2 MiB.
    Size2M,
    /// 1 GiB.
    Size1G,
}

impl PageSize {
    /// Bytes in a page of this size.
    pub fn bytes(self) -> u64 {
        match self {
            Self::Size4K => SIZE_4K,
            Self::Size2M => SIZE_2M,
            Self::Size1G => SIZE_1G,
        }
    }
}

/// The result of a walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Translation {
    /// Guest-physical address of the byte at the virtual address.
    pub phys: u64,
    /// Size of the mapping page.
    pub page_size: PageSize,
    /// Accumulated access rights.
    pub flags: PageFlags,
    /// Physical address of the leaf entry.
    pub leaf_entry_addr: u64,
    /// Value of the leaf entry.
    pub leaf_entry: u64,
}

/// Where the PMD entry that covers a virtual address lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PmdSlot {
    /// Physical address of the page directory (the PMD page).
    pub pmd_page: u64,
    /// Physical address of the entry for the address.
    pub entry_addr: u64,
    /// Its current value.
    pub entry: u64,
}

/// Physical address of the top-level table: CR3 without PCID and flag bits.
pub fn cr3_table(cr3: u64) -> u64 {
    cr3 & PTE_ADDR_MASK
}

/// Checks that `va` is canonical for the paging mode.
///
/// # Errors
/// [`PagingError::NonCanonical`] when the upper bits are not a sign extension.
pub fn check_canonical(la57: bool, va: u64) -> Result<(), PagingError> {
    let (bits, levels) = if la57 { (57, 5) } else { (48, 4) };
    let unused = 64 - bits;
    // Sign-extend the implemented bits and compare with the original.
    let extended = (((va << unused) as i64) >> unused) as u64;
    if extended == va {
        Ok(())
    } else {
        Err(PagingError::NonCanonical { va, levels })
    }
}

/// Translates a guest-virtual address through the tables rooted at `cr3`.
///
/// # Errors
/// [`PagingError::NonCanonical`], [`PagingError::NotPresent`] when an entry on the walk is not
/// present, [`PagingError::Memory`] when a table cannot be read.
pub fn translate<M: PhysicalMemory + ?Sized>(
    mem: &mut M,
    cr3: u64,
    la57: bool,
    va: u64,
) -> Result<Translation, PagingError> {
    check_canonical(la57, va)?;
    let mut level = if la57 {
        TableLevel::Pml5
    } else {
        TableLevel::Pml4
    };
    let mut table = cr3_table(cr3);
    let mut flags = PageFlags {
        writable: true,
        user: true,
        no_execute: false,
        global: false,
    };
    loop {
        let entry_addr = level.entry_addr(table, va);
        let entry = read_entry(mem, va, entry_addr)?;
        if entry & PTE_PRESENT == 0 {
            return Err(PagingError::NotPresent {
                va,
                level,
                entry_addr,
                entry,
            });
        }
        flags.writable &= entry & PTE_WRITABLE != 0;
        flags.user &= entry & PTE_USER != 0;
        flags.no_execute |= entry & PTE_NO_EXECUTE != 0;
        let leaf_size = match level {
            TableLevel::Pte => Some(PageSize::Size4K),
            TableLevel::Pmd if entry & PTE_PAGE_SIZE != 0 => Some(PageSize::Size2M),
            TableLevel::Pud if entry & PTE_PAGE_SIZE != 0 => Some(PageSize::Size1G),
            _ => None,
        };
        if let Some(page_size) = leaf_size {
            flags.global = entry & PTE_GLOBAL != 0;
            let offset_mask = page_size.bytes() - 1;
            let base = entry & PTE_ADDR_MASK & !offset_mask;
            return Ok(Translation {
                phys: base | (va & offset_mask),
                page_size,
                flags,
                leaf_entry_addr: entry_addr,
                leaf_entry: entry,
            });
        }
        table = entry & PTE_ADDR_MASK;
        level = match level.next() {
            Some(next) => next,
            None => return Err(PagingError::LargePage { va, level }),
        };
    }
}

/// Reads guest-virtual memory, translating page by page.
///
/// # Errors
/// As [`translate`] for the first page that fails, or [`PagingError::Memory`] when a mapped
/// page cannot be read.
pub fn read_virt<M: PhysicalMemory + ?Sized>(
    mem: &mut M,
    cr3: u64,
    la57: bool,
    va: u64,
    buf: &mut [u8],
) -> Result<(), PagingError> {
    let mut done = 0usize;
    while done < buf.len() {
        // A read that runs off the top of the address space must not wrap to address 0.
        let cur = va
            .checked_add(done as u64)
            .ok_or(PagingError::NonCanonical {
                va,
                levels: if la57 { 5 } else { 4 },
            })?;
        let tr = translate(mem, cr3, la57, cur)?;
        let page_left = tr.page_size.bytes() - (cur & (tr.page_size.bytes() - 1));
        let chunk = usize::try_from(page_left)
            .unwrap_or(usize::MAX)
            .min(buf.len() - done);
        mem.read_phys(tr.phys, &mut buf[done..done + chunk])
            .map_err(|source| PagingError::Memory { va: cur, source })?;
        done += chunk;
    }
    Ok(())
}

/// Finds the PMD entry (and its page directory) that covers `va`: where a 2 MiB mapping for
/// `va` would be written.
///
/// # Errors
/// [`PagingError::NotPresent`] when an upper level (PML5/PML4/PUD) has no table for `va`,
/// [`PagingError::LargePage`] when the PUD entry is a 1 GiB leaf, [`PagingError::Memory`].
pub fn pmd_slot<M: PhysicalMemory + ?Sized>(
    mem: &mut M,
    cr3: u64,
    la57: bool,
    va: u64,
) -> Result<PmdSlot, PagingError> {
    check_canonical(la57, va)?;
    let mut level = if la57 {
        TableLevel::Pml5
    } else {
        TableLevel::Pml4
    };
    let mut table = cr3_table(cr3);
    while level != TableLevel::Pmd {
        let entry_addr = level.entry_addr(table, va);
        let entry = read_entry(mem, va, entry_addr)?;
        if entry & PTE_PRESENT == 0 {
            return Err(PagingError::NotPresent {
                va,
                level,
                entry_addr,
                entry,
            });
        }
        if level == TableLevel::Pud && entry & PTE_PAGE_SIZE != 0 {
            return Err(PagingError::LargePage { va, level });
        }
        table = entry & PTE_ADDR_MASK;
        level = level.next().ok_or(PagingError::LargePage { va, level })?;
    }
    let entry_addr = TableLevel::Pmd.entry_addr(table, va);
    let entry = read_entry(mem, va, entry_addr)?;
    Ok(PmdSlot {
        pmd_page: table,
        entry_addr,
        entry,
    })
}

/// The kernel half of a PTI pair: with page-table isolation the user PGD is the kernel PGD
/// plus 4 KiB (bit 12 of CR3), so a vCPU stopped in user mode shows the user one. Only
/// meaningful when the guest runs with PTI; without it bit 12 is an ordinary address bit.
pub fn pti_kernel_cr3(cr3: u64) -> u64 {
    cr3 & !(1 << 12)
}

/// One guest address space: guest-physical memory plus the page-table root that maps it.
#[derive(Debug)]
pub struct AddressSpace<'m, M: PhysicalMemory + ?Sized> {
    /// Guest-physical memory.
    pub mem: &'m mut M,
    /// The page-table root (CR3 as the vCPU holds it; PCID bits are ignored).
    pub cr3: u64,
    /// Whether CR4.LA57 (5-level paging) is set.
    pub la57: bool,
}

impl<'m, M: PhysicalMemory + ?Sized> AddressSpace<'m, M> {
    /// An address space rooted at `cr3`.
    pub fn new(mem: &'m mut M, cr3: u64, la57: bool) -> Self {
        Self { mem, cr3, la57 }
    }

    /// As [`translate`].
    ///
    /// # Errors
    /// As [`translate`].
    pub fn translate(&mut self, va: u64) -> Result<Translation, PagingError> {
        translate(self.mem, self.cr3, self.la57, va)
    }

    /// As [`read_virt`].
    ///
    /// # Errors
    /// As [`read_virt`].
    pub fn read(&mut self, va: u64, buf: &mut [u8]) -> Result<(), PagingError> {
        read_virt(self.mem, self.cr3, self.la57, va, buf)
    }

    /// Reads a little-endian `u64` at a virtual address.
    ///
    /// # Errors
    /// As [`read_virt`].
    pub fn read_u64(&mut self, va: u64) -> Result<u64, PagingError> {
        let mut bytes = [0u8; 8];
        self.read(va, &mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// Reads a little-endian `u32` at a virtual address.
    ///
    /// # Errors
    /// As [`read_virt`].
    pub fn read_u32(&mut self, va: u64) -> Result<u32, PagingError> {
        let mut bytes = [0u8; 4];
        self.read(va, &mut bytes)?;
        Ok(u32::from_le_bytes(bytes))
    }

    /// As [`pmd_slot`].
    ///
    /// # Errors
    /// As [`pmd_slot`].
    pub fn pmd_slot(&mut self, va: u64) -> Result<PmdSlot, PagingError> {
        pmd_slot(self.mem, self.cr3, self.la57, va)
    }
}

fn read_entry<M: PhysicalMemory + ?Sized>(
    mem: &mut M,
    va: u64,
    entry_addr: u64,
) -> Result<u64, PagingError> {
    mem.read_phys_u64(entry_addr)
        .map_err(|source| PagingError::Memory { va, source })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::memory::SparseMemory;

    /// Builds page tables by hand in a [`SparseMemory`], allocating table pages upwards from a
    /// physical address.
    pub(crate) struct TableBuilder {
        pub mem: SparseMemory,
        pub cr3: u64,
        pub la57: bool,
        next_table: u64,
    }

    impl TableBuilder {
        pub fn new(la57: bool) -> Self {
            let mut builder = Self {
                mem: SparseMemory::new(),
                cr3: 0,
                la57,
                next_table: 0x10_0000,
            };
            builder.cr3 = builder.alloc_table();
            builder
        }

        fn alloc_table(&mut self) -> u64 {
            let table = self.next_table;
            self.mem.add_zeroed(table, 4096).unwrap();
            self.next_table += 4096;
            table
        }

        /// Returns the table at `level` for `va`, creating missing tables above it.
        pub fn table_at(&mut self, va: u64, target: TableLevel) -> u64 {
            let mut level = if self.la57 {
                TableLevel::Pml5
            } else {
                TableLevel::Pml4
            };
            let mut table = cr3_table(self.cr3);
            while level != target {
                let entry_addr = level.entry_addr(table, va);
                let mut entry = self.mem.read_phys_u64(entry_addr).unwrap();
                if entry & PTE_PRESENT == 0 {
                    entry = self.alloc_table() | PTE_PRESENT | PTE_WRITABLE;
                    self.mem.write_phys_u64(entry_addr, entry).unwrap();
                }
                table = entry & PTE_ADDR_MASK;
                level = level.next().unwrap();
            }
            table
        }

        /// Writes the leaf entry for `va` at `level` (`Pte`, `Pmd` or `Pud`).
        pub fn map(&mut self, va: u64, pa: u64, level: TableLevel, flags: u64) {
            let table = self.table_at(va, level);
            let size = if level == TableLevel::Pte {
                0
            } else {
                PTE_PAGE_SIZE
            };
            self.mem
                .write_phys_u64(level.entry_addr(table, va), pa | size | flags)
                .unwrap();
        }
    }

    impl TableBuilder {
        /// Maps `bytes` at `va` (page-aligned) onto fresh physical pages at `pa` with 4 KiB
        /// pages, present and global.
        pub fn map_data(&mut self, va: u64, pa: u64, bytes: &[u8]) {
            let pages = bytes.len().div_ceil(4096).max(1);
            let mut data = bytes.to_vec();
            data.resize(pages * 4096, 0);
            self.mem.add_region(pa, data).unwrap();
            for page in 0..pages as u64 {
                self.map(
                    va + page * 4096,
                    pa + page * 4096,
                    TableLevel::Pte,
                    PTE_PRESENT | PTE_GLOBAL,
                );
            }
        }

        pub fn space(&mut self) -> AddressSpace<'_, SparseMemory> {
            AddressSpace::new(&mut self.mem, self.cr3, self.la57)
        }

        /// Physical addresses of every table page allocated so far.
        pub fn table_pages(&self) -> Vec<u64> {
            (0x10_0000..self.next_table).step_by(4096).collect()
        }
    }

    const KERNEL_VA: u64 = 0xffff_ffff_8100_0000;

    #[test]
    fn translate_4k_page_in_4_level_tables() {
        let mut tb = TableBuilder::new(false);
        tb.map(
            KERNEL_VA,
            0x20_0000,
            TableLevel::Pte,
            PTE_PRESENT | PTE_GLOBAL,
        );

        let tr = translate(&mut tb.mem, tb.cr3, false, KERNEL_VA + 0x123).unwrap();

        assert_eq!(tr.phys, 0x20_0123);
        assert_eq!(tr.page_size, PageSize::Size4K);
        assert_eq!(
            tr.flags,
            PageFlags {
                writable: false,
                user: false,
                no_execute: false,
                global: true
            }
        );
    }

    #[test]
    fn translate_2m_page_keeps_offset_inside_large_page() {
        let mut tb = TableBuilder::new(false);
        tb.map(
            KERNEL_VA,
            0x4000_0000,
            TableLevel::Pmd,
            PTE_PRESENT | PTE_WRITABLE,
        );

        let tr = translate(&mut tb.mem, tb.cr3, false, KERNEL_VA + 0x1f_fff0).unwrap();

        assert_eq!(tr.phys, 0x401f_fff0);
        assert_eq!(tr.page_size, PageSize::Size2M);
        assert!(tr.flags.writable);
    }

    #[test]
    fn translate_1g_page() {
        let mut tb = TableBuilder::new(false);
        let va = 0xffff_8880_0000_0000;
        tb.map(
            va,
            0x1_0000_0000,
            TableLevel::Pud,
            PTE_PRESENT | PTE_NO_EXECUTE,
        );

        let tr = translate(&mut tb.mem, tb.cr3, false, va + 0x3456_789a).unwrap();

        assert_eq!(tr.phys, 0x1_3456_789a);
        assert_eq!(tr.page_size, PageSize::Size1G);
        assert!(tr.flags.no_execute);
    }

    #[test]
    fn translate_5_level_uses_pml5() {
        let mut tb = TableBuilder::new(true);
        let va = 0xff11_0000_0000_0000;
        tb.map(va, 0x30_0000, TableLevel::Pte, PTE_PRESENT);

        let tr = translate(&mut tb.mem, tb.cr3, true, va + 8).unwrap();

        assert_eq!(tr.phys, 0x30_0008);
    }

    #[test]
    fn translate_refuses_non_canonical_address() {
        let mut tb = TableBuilder::new(false);

        let err = translate(&mut tb.mem, tb.cr3, false, 0x0000_8000_0000_0000).unwrap_err();

        assert!(matches!(err, PagingError::NonCanonical { levels: 4, .. }));
    }

    #[test]
    fn canonical_with_la57_accepts_57_bit_address() {
        assert!(check_canonical(true, 0x00ff_0000_0000_0000).is_ok());
        assert!(check_canonical(false, 0x00ff_0000_0000_0000).is_err());
    }

    #[test]
    fn translate_reports_level_of_missing_entry() {
        let mut tb = TableBuilder::new(false);
        tb.table_at(KERNEL_VA, TableLevel::Pmd);

        let err = translate(&mut tb.mem, tb.cr3, false, KERNEL_VA).unwrap_err();

        assert!(matches!(
            err,
            PagingError::NotPresent {
                level: TableLevel::Pmd,
                entry: 0,
                ..
            }
        ));
    }

    #[test]
    fn translate_accumulates_user_and_writable_as_and() {
        let mut tb = TableBuilder::new(false);
        let va = 0x40_0000;
        tb.map(
            va,
            0x50_0000,
            TableLevel::Pte,
            PTE_PRESENT | PTE_WRITABLE | PTE_USER,
        );

        let tr = translate(&mut tb.mem, tb.cr3, false, va).unwrap();

        // Upper levels were made present|writable without the user bit.
        assert!(tr.flags.writable);
        assert!(!tr.flags.user);
    }

    #[test]
    fn translate_reports_table_pointing_outside_memory() {
        let mut tb = TableBuilder::new(false);
        let table = tb.table_at(KERNEL_VA, TableLevel::Pmd);
        let entry_addr = TableLevel::Pmd.entry_addr(table, KERNEL_VA);
        tb.mem
            .write_phys_u64(entry_addr, 0xdead_0000 | PTE_PRESENT)
            .unwrap();

        let err = translate(&mut tb.mem, tb.cr3, false, KERNEL_VA).unwrap_err();

        assert!(matches!(err, PagingError::Memory { .. }));
    }

    #[test]
    fn read_virt_crosses_into_discontiguous_page() {
        let mut tb = TableBuilder::new(false);
        tb.map(KERNEL_VA, 0x20_0000, TableLevel::Pte, PTE_PRESENT);
        tb.map(KERNEL_VA + 0x1000, 0x80_0000, TableLevel::Pte, PTE_PRESENT);
        tb.mem.add_region(0x20_0000, vec![0xaa; 4096]).unwrap();
        tb.mem.add_region(0x80_0000, vec![0xbb; 4096]).unwrap();
        let mut buf = [0u8; 4];

        read_virt(&mut tb.mem, tb.cr3, false, KERNEL_VA + 0xffe, &mut buf).unwrap();

        assert_eq!(buf, [0xaa, 0xaa, 0xbb, 0xbb]);
    }

    #[test]
    fn read_virt_fails_on_unmapped_second_page() {
        let mut tb = TableBuilder::new(false);
        tb.map(KERNEL_VA, 0x20_0000, TableLevel::Pte, PTE_PRESENT);
        tb.mem.add_region(0x20_0000, vec![0xaa; 4096]).unwrap();
        let mut buf = [0u8; 4];

        let err = read_virt(&mut tb.mem, tb.cr3, false, KERNEL_VA + 0xffe, &mut buf).unwrap_err();

        assert!(matches!(err, PagingError::NotPresent { va, .. } if va == KERNEL_VA + 0x1000));
    }

    #[test]
    fn pmd_slot_finds_entry_in_page_directory() {
        let mut tb = TableBuilder::new(false);
        let pmd_page = tb.table_at(KERNEL_VA, TableLevel::Pmd);
        let va = KERNEL_VA + 3 * SIZE_2M;

        let slot = pmd_slot(&mut tb.mem, tb.cr3, false, va).unwrap();

        assert_eq!(slot.pmd_page, pmd_page);
        assert_eq!(slot.entry_addr, pmd_page + ((va >> 21) & 0x1ff) * 8);
        assert_eq!(slot.entry, 0);
    }

    #[test]
    fn pmd_slot_reports_missing_pud_entry() {
        let mut tb = TableBuilder::new(false);
        tb.table_at(KERNEL_VA, TableLevel::Pud);

        let err = pmd_slot(&mut tb.mem, tb.cr3, false, KERNEL_VA).unwrap_err();

        assert!(matches!(
            err,
            PagingError::NotPresent {
                level: TableLevel::Pud,
                ..
            }
        ));
    }

    #[test]
    fn pti_kernel_cr3_clears_user_half_bit() {
        assert_eq!(pti_kernel_cr3(0x1_2345_1000 | 0x801), 0x1_2345_0801);
    }

    #[test]
    fn address_space_reads_u64_through_tables() {
        let mut tb = TableBuilder::new(false);
        tb.map(KERNEL_VA, 0x20_0000, TableLevel::Pte, PTE_PRESENT);
        tb.mem
            .add_region(0x20_0000, 0x1122_3344_5566_7788u64.to_le_bytes().to_vec())
            .unwrap();
        let (cr3, la57) = (tb.cr3, tb.la57);

        let value = AddressSpace::new(&mut tb.mem, cr3, la57)
            .read_u64(KERNEL_VA)
            .unwrap();

        assert_eq!(value, 0x1122_3344_5566_7788);
    }

    #[test]
    fn pmd_slot_refuses_1g_leaf() {
        let mut tb = TableBuilder::new(false);
        tb.map(KERNEL_VA, 0x4000_0000, TableLevel::Pud, PTE_PRESENT);

        let err = pmd_slot(&mut tb.mem, tb.cr3, false, KERNEL_VA).unwrap_err();

        assert!(matches!(
            err,
            PagingError::LargePage {
                level: TableLevel::Pud,
                ..
            }
        ));
    }

    #[test]
    fn table_pointing_at_itself_ends_the_walk_at_the_last_level() {
        let mut tb = TableBuilder::new(false);
        // Every PML4 entry points back at the PML4 (a recursive mapping, 4 levels deep).
        let pml4 = cr3_table(tb.cr3);
        for i in 0..512 {
            tb.mem
                .write_phys_u64(pml4 + 8 * i, pml4 | PTE_PRESENT | PTE_WRITABLE)
                .unwrap();
        }

        let tr = translate(&mut tb.mem, tb.cr3, false, KERNEL_VA + 0x42).unwrap();
        let slot = pmd_slot(&mut tb.mem, tb.cr3, false, KERNEL_VA).unwrap();

        // Four steps through the same page: the "page" is the PML4 itself.
        assert_eq!(tr.phys, pml4 | 0x42);
        assert_eq!(slot.pmd_page, pml4);
    }

    #[test]
    fn mutated_tables_give_errors_or_translations_never_panics() {
        use crate::mutation::{mutate_memory, XorShift};

        let vas = [
            KERNEL_VA,
            KERNEL_VA + SIZE_2M,
            0xffff_8880_0000_0000,
            0x40_0000,
            0xffff_ffff_ffff_f000,
        ];
        let mut rng = XorShift(0x853c_49e6_748f_ea9b);
        let mut answers = 0;
        for case in 0..2000 {
            let la57 = case % 4 == 0;
            let mut tb = TableBuilder::new(la57);
            for (i, va) in vas.into_iter().enumerate() {
                let va = if la57 { va | 0xff00_0000_0000_0000 } else { va };
                let level = [TableLevel::Pte, TableLevel::Pmd, TableLevel::Pud][i % 3];
                tb.map(
                    va,
                    0x4000_0000 * (i as u64 + 1),
                    level,
                    PTE_PRESENT | PTE_WRITABLE,
                );
            }
            tb.mem.add_zeroed(0x4000_0000, 0x2000).unwrap();
            let hot = tb.table_pages();
            mutate_memory(&mut tb.mem, &mut rng, &hot, 12);

            for va in vas {
                let va = if la57 { va | 0xff00_0000_0000_0000 } else { va };
                answers += usize::from(translate(&mut tb.mem, tb.cr3, la57, va).is_ok());
                let _ = pmd_slot(&mut tb.mem, tb.cr3, la57, va);
                let mut buf = [0u8; 0x1800];
                let _ = read_virt(&mut tb.mem, tb.cr3, la57, va.wrapping_sub(0x800), &mut buf);
            }
        }

        // Not every case breaks the walk: the mutations leave most translations working.
        assert!(answers > 0);
    }
}
