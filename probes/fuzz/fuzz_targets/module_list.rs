//! The loaded-module list of a hostile guest (`exotap_probes::live::modules::read_modules`):
//! the list nodes, each `struct module`'s name, text, ORC table pointers and counts, its
//! `mod_kallsyms` (symbol table, count, string table) and every `st_name`, all read from a
//! memory image the fuzzer writes, at offsets the fuzzer picks. The input is a header of
//! fuzzed values (the list head, the struct offsets, the ORC layout) and the guest memory at
//! a fixed kernel address. The walk must end with the modules or an error: no panic, no
//! hang, and no read (so no buffer) larger than one module's capped table.
#![no_main]

use exotap_introspect::memory::{PhysicalMemory, SparseMemory};
use exotap_introspect::orc::OrcLayout;
use exotap_probes::live::modules::{read_modules, ModuleLayout, VirtualMemory, MAX_MODULES};
use libfuzzer_sys::fuzz_target;

const HEAD: usize = 32;
/// Where the fuzzed memory is mapped: in the module area, as the kernel's modules are.
const BASE: u64 = 0xffff_ffff_c000_0000;
/// The largest single read the reader may make (a module's string table, 8 MiB).
const LARGEST_READ: usize = 8 << 20;

/// The fuzzed memory, and the longest read asked of it.
struct Flat(SparseMemory, usize);

impl VirtualMemory for Flat {
    fn read_virt(&mut self, va: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        self.1 = self.1.max(buf.len());
        Ok(self.0.read_phys(va, buf)?)
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < HEAD {
        return;
    }
    let (head, memory) = data.split_at(HEAD);
    // Offsets into the structures: small, as BTF gives them, and often overlapping.
    let off = |i: usize| u64::from(head[i]) * 4;
    let layout = ModuleLayout {
        list: off(0),
        state: off(1),
        name: (off(2), u64::from(head[3])),
        text: (off(4), off(5)),
        orcs: (off(6), off(7), off(8)),
        kallsyms: off(9),
        symtab: (off(10), off(11), off(12)),
    };
    let orc_layout = match head[13] % 3 {
        0 => OrcLayout::Linux4_14,
        1 => OrcLayout::Linux6_3,
        _ => OrcLayout::Linux6_4,
    };
    let len = memory.len() as u64;
    let list_head =
        BASE + u64::from(u32::from_le_bytes([head[14], head[15], head[16], head[17]])) % (len + 1);
    let mut mem = SparseMemory::new();
    if mem.add_region(BASE, memory.to_vec()).is_err() {
        return;
    }
    let mut flat = Flat(mem, 0);
    if let Ok(modules) = read_modules(&mut flat, list_head, &layout, orc_layout) {
        assert!(modules.len() <= MAX_MODULES);
        for m in &modules {
            for addr in [
                m.text.start,
                m.text.start.wrapping_add(0x10),
                m.text.end.wrapping_sub(1),
            ] {
                if let Some((_, offset, size)) = m.lookup(addr) {
                    assert!(offset < size);
                }
            }
        }
    }
    assert!(flat.1 <= LARGEST_READ, "a read of {} bytes", flat.1);
});
