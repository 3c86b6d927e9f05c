//! x86-64 paging for the Unicorn backend: Unicorn's physical address space cannot hold kernel
//! addresses like `0xffffffff81000000`, so the backend builds real 4-level page tables (from
//! a pool of low physical memory) and maps each page of a region to a frame; reads and writes
//! go through the same translation the emulated CPU uses. On SPARC the MMU is off and
//! virtual addresses are physical.

use unicorn_engine::unicorn_const::Prot;
use unicorn_engine::RegisterX86;

use super::{backend, Isa, UnicornMachine, BACKEND, PAGE, TABLE_POOL};
use crate::control::ControlError;

const PTE_P: u64 = 1;
const PTE_W: u64 = 2;
const PTE_ADDR: u64 = 0x000f_ffff_ffff_f000;
const CR0_PE: u64 = 1;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;

impl UnicornMachine {
    pub(super) fn enable_paging(&mut self) -> Result<(), ControlError> {
        let size = TABLE_POOL.end - TABLE_POOL.start;
        self.uc
            .mem_map(TABLE_POOL.start, size, Prot::ALL)
            .map_err(backend)?;
        self.pml4 = self.alloc_table()?;
        self.uc
            .reg_write(RegisterX86::CR3, self.pml4)
            .map_err(backend)?;
        let cr4 = self.uc.reg_read(RegisterX86::CR4).map_err(backend)?;
        self.uc
            .reg_write(RegisterX86::CR4, cr4 | CR4_PAE)
            .map_err(backend)?;
        self.uc
            .reg_write(RegisterX86::CR0, CR0_PE | CR0_WP | CR0_PG)
            .map_err(backend)
    }

    pub(super) fn alloc_table(&mut self) -> Result<u64, ControlError> {
        if self.next_table >= TABLE_POOL.end {
            return Err(ControlError::Unsupported {
                backend: BACKEND,
                what: "map more memory: the page-table pool is full",
            });
        }
        let table = self.next_table;
        self.next_table += PAGE;
        Ok(table)
    }

    pub(super) fn read_u64_phys(&self, addr: u64) -> Result<u64, ControlError> {
        let mut b = [0u8; 8];
        self.uc.mem_read(addr, &mut b).map_err(backend)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Points the page-table entry of `vaddr` at `frame`, creating tables on the way.
    pub(super) fn map_page(&mut self, vaddr: u64, frame: u64) -> Result<(), ControlError> {
        let mut table = self.pml4;
        for shift in [39u32, 30, 21] {
            let slot = table + ((vaddr >> shift) & 0x1ff) * 8;
            let entry = self.read_u64_phys(slot)?;
            table = if entry & PTE_P != 0 {
                entry & PTE_ADDR
            } else {
                let next = self.alloc_table()?;
                self.uc
                    .mem_write(slot, &(next | PTE_P | PTE_W).to_le_bytes())
                    .map_err(backend)?;
                next
            };
        }
        let slot = table + ((vaddr >> 12) & 0x1ff) * 8;
        self.uc
            .mem_write(slot, &(frame | PTE_P | PTE_W).to_le_bytes())
            .map_err(backend)?;
        self.pages.insert(vaddr, frame);
        Ok(())
    }

    /// The physical address of a virtual one.
    pub(super) fn translate(&self, vaddr: u64) -> Option<u64> {
        match self.isa {
            Isa::X86_64 => self
                .pages
                .get(&(vaddr & !(PAGE - 1)))
                .map(|frame| frame | (vaddr & (PAGE - 1))),
            Isa::Sparc64 => Some(vaddr),
        }
    }

    /// Splits `[addr, addr + len)` into physically contiguous pieces:
    /// `(physical address, offset in the buffer, length)`.
    pub(super) fn pieces(&self, addr: u64, len: usize) -> Option<Vec<(u64, usize, usize)>> {
        let mut out = Vec::new();
        let mut done = 0usize;
        while done < len {
            let va = addr.checked_add(done as u64)?;
            let in_page = (PAGE - (va & (PAGE - 1))) as usize;
            let n = in_page.min(len - done);
            out.push((self.translate(va)?, done, n));
            done += n;
        }
        Some(out)
    }
}
