//! The CPU state the 64-bit boot protocol asks for at the kernel's entry: long mode with
//! paging on, an identity map of what the kernel touches first, a GDT with `__BOOT_CS`
//! (0x10) and `__BOOT_DS` (0x18) as flat 4 GiB segments, interrupts off, `%rsi` = the zero
//! page, entry at the protected-mode kernel's start + 0x200.
//!
//! Everything here is a pure function from addresses to values and bytes; [`super::vcpu`]
//! writes them to the vCPU.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs};

use super::layout::{
    BOOT_STACK, GDT_ADDR, IDT_ADDR, PDPT_ADDR, PD_ADDR, PML4_ADDR, ZERO_PAGE_ADDR,
};

/// Page-table entry bits.
pub const PTE_PRESENT: u64 = 1 << 0;
/// Writable.
pub const PTE_WRITE: u64 = 1 << 1;
/// Large page (2 MiB in a PD).
pub const PTE_PS: u64 = 1 << 7;
/// How many page directories the identity map has (each maps 1 GiB).
pub const IDENTITY_GIB: u64 = 4;

/// CR0 bits.
pub const CR0_PE: u64 = 1 << 0;
/// Extension type (always 1 on modern CPUs).
pub const CR0_ET: u64 = 1 << 4;
/// Paging.
pub const CR0_PG: u64 = 1 << 31;
/// CR4.PAE.
pub const CR4_PAE: u64 = 1 << 5;
/// EFER.LME.
pub const EFER_LME: u64 = 1 << 8;
/// EFER.LMA.
pub const EFER_LMA: u64 = 1 << 10;

/// `__BOOT_CS`.
pub const BOOT_CS: u16 = 0x10;
/// `__BOOT_DS`.
pub const BOOT_DS: u16 = 0x18;
/// The TSS selector (KVM wants a usable TR for VM entry on VMX).
pub const BOOT_TSS: u16 = 0x20;

/// The page tables: `(guest-physical address, 4096 bytes)` for the PML4, the PDPT and the
/// page directories identity-mapping the first [`IDENTITY_GIB`] GiB with 2 MiB pages.
pub fn identity_page_tables() -> Vec<(u64, Vec<u8>)> {
    let mut pml4 = vec![0u8; 4096];
    pml4[..8].copy_from_slice(&(PDPT_ADDR | PTE_PRESENT | PTE_WRITE).to_le_bytes());
    let mut pdpt = vec![0u8; 4096];
    let mut tables = Vec::new();
    for gib in 0..IDENTITY_GIB {
        let pd_addr = PD_ADDR + gib * 0x1000;
        let at = (gib * 8) as usize;
        pdpt[at..at + 8].copy_from_slice(&(pd_addr | PTE_PRESENT | PTE_WRITE).to_le_bytes());
        let mut pd = vec![0u8; 4096];
        for (i, entry) in pd.chunks_exact_mut(8).enumerate() {
            let phys = (gib << 30) | ((i as u64) << 21);
            entry.copy_from_slice(&(phys | PTE_PRESENT | PTE_WRITE | PTE_PS).to_le_bytes());
        }
        tables.push((pd_addr, pd));
    }
    tables.insert(0, (PDPT_ADDR, pdpt));
    tables.insert(0, (PML4_ADDR, pml4));
    tables
}

/// A GDT descriptor from flags (access byte in bits 0-7, flags nibble in bits 12-15, as
/// firecracker's `gdt_entry`), base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The boot GDT: null, null, `__BOOT_CS` (64-bit code), `__BOOT_DS` (data), TSS.
pub fn gdt() -> [u64; 5] {
    [
        0,
        0,
        gdt_entry(0xa09b, 0, 0xfffff),
        gdt_entry(0xc093, 0, 0xfffff),
        gdt_entry(0x808b, 0, 0xfffff),
    ]
}

/// The GDT as bytes.
pub fn gdt_bytes() -> Vec<u8> {
    gdt().iter().flat_map(|e| e.to_le_bytes()).collect()
}

/// The KVM segment a GDT descriptor describes.
pub fn segment(selector: u16, entry: u64) -> kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let raw_limit = (entry & 0xffff) | ((entry >> 32) & 0x000f_0000);
    let g = (entry >> 55) & 1;
    let limit = if g == 1 {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    kvm_segment {
        base,
        limit: limit as u32,
        selector,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: g as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: u8::from((entry >> 47) & 1 == 0),
        padding: 0,
    }
}

/// Sets the long-mode part of `sregs` (which holds KVM's reset state).
pub fn long_mode_sregs(sregs: &mut kvm_sregs) {
    let table = gdt();
    let code = segment(BOOT_CS, table[2]);
    let data = segment(BOOT_DS, table[3]);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = segment(BOOT_TSS, table[4]);
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit = (table.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 7;
    sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 = CR4_PAE;
    sregs.efer = EFER_LME | EFER_LMA;
}

/// The general registers at entry: `rip` at the 64-bit entry, `rsi` the zero page.
pub fn boot_regs(kernel_load: u64) -> kvm_regs {
    kvm_regs {
        rip: kernel_load + 0x200,
        rsi: ZERO_PAGE_ADDR,
        rsp: BOOT_STACK,
        rbp: BOOT_STACK,
        rflags: 0x2,
        ..Default::default()
    }
}

/// The FPU at entry: x87 control word and MXCSR at their reset values.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(tables: &[(u64, Vec<u8>)], table: u64, index: usize) -> u64 {
        let (_, bytes) = tables.iter().find(|(a, _)| *a == table).unwrap();
        u64::from_le_bytes(bytes[index * 8..index * 8 + 8].try_into().unwrap())
    }

    /// Walks the tables as the MMU does (Intel SDM 4.5, 2 MiB pages).
    fn walk(tables: &[(u64, Vec<u8>)], va: u64) -> Option<u64> {
        let pml4e = entry(tables, PML4_ADDR, ((va >> 39) & 0x1ff) as usize);
        if pml4e & 1 == 0 {
            return None;
        }
        let pdpte = entry(
            tables,
            pml4e & 0x000f_ffff_ffff_f000,
            ((va >> 30) & 0x1ff) as usize,
        );
        if pdpte & 1 == 0 {
            return None;
        }
        let pde = entry(
            tables,
            pdpte & 0x000f_ffff_ffff_f000,
            ((va >> 21) & 0x1ff) as usize,
        );
        assert_eq!(pde & 0x80, 0x80, "2 MiB page");
        Some((pde & 0x000f_ffff_ffe0_0000) | (va & 0x1f_ffff))
    }

    #[test]
    fn identity_map_covers_four_gib_with_2mib_pages() {
        let tables = identity_page_tables();

        for va in [
            0u64,
            0x7000,
            0x100000,
            0x1234_5678,
            0x3c00_0000,
            0xffff_ffff,
        ] {
            assert_eq!(walk(&tables, va), Some(va), "{va:#x}");
        }
        assert_eq!(entry(&tables, PML4_ADDR, 1), 0);
        assert_eq!(entry(&tables, PDPT_ADDR, 4), 0, "nothing above 4 GiB");
    }

    #[test]
    fn page_tables_sit_where_cr3_and_the_layout_say() {
        let tables = identity_page_tables();
        let addrs: Vec<u64> = tables.iter().map(|(a, _)| *a).collect();

        assert_eq!(addrs, [0x9000, 0xa000, 0xb000, 0xc000, 0xd000, 0xe000]);
        assert!(tables.iter().all(|(_, t)| t.len() == 4096));
    }

    #[test]
    fn boot_gdt_has_flat_code_and_data_at_the_protocols_selectors() {
        // boot.rst: "__BOOT_CS(0x10) and __BOOT_DS(0x18); both descriptors must be 4G flat
        // segment; __BOOT_CS must have execute/read permission, and __BOOT_DS must have
        // read/write permission".
        let table = gdt();

        assert_eq!(table[(BOOT_CS / 8) as usize], 0x00af_9b00_0000_ffff);
        assert_eq!(table[(BOOT_DS / 8) as usize], 0x00cf_9300_0000_ffff);
        let cs = segment(BOOT_CS, table[2]);
        assert_eq!(
            (cs.base, cs.limit, cs.l, cs.type_, cs.present),
            (0, 0xffff_ffff, 1, 0xb, 1)
        );
        let ds = segment(BOOT_DS, table[3]);
        assert_eq!(
            (ds.base, ds.limit, ds.db, ds.type_, ds.s),
            (0, 0xffff_ffff, 1, 0x3, 1)
        );
    }

    #[test]
    fn long_mode_registers_follow_the_64_bit_protocol() {
        let mut sregs = kvm_sregs::default();

        long_mode_sregs(&mut sregs);
        let regs = boot_regs(0x100000);

        assert_eq!(sregs.cr0 & (CR0_PE | CR0_PG), CR0_PE | CR0_PG);
        assert_eq!(sregs.cr4 & CR4_PAE, CR4_PAE);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(sregs.cr3, 0x9000);
        assert_eq!(
            (sregs.cs.selector, sregs.ds.selector, sregs.ss.selector),
            (0x10, 0x18, 0x18)
        );
        assert_eq!(regs.rip, 0x100200, "64-bit entry at load address + 0x200");
        assert_eq!(regs.rsi, 0x7000, "%rsi holds the zero page");
        assert_eq!(regs.rflags & (1 << 9), 0, "interrupts off");
    }
}
