//! Hostile page tables: guest memory is the fuzz input, walked from a CR3 inside it.
#![no_main]

use exotap_introspect::memory::SparseMemory;
use exotap_introspect::paging::{read_virt, translate};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 17 {
        return;
    }
    let (head, tables) = data.split_at(17);
    let va = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
    let cr3 = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default()) & 0xfff_f000;
    let la57 = head[16] & 1 == 1;
    let mut mem = SparseMemory::new();
    if mem.add_region(0, tables.to_vec()).is_err() {
        return;
    }
    let _ = translate(&mut mem, cr3, la57, va);
    let mut buf = [0u8; 64];
    let _ = read_virt(&mut mem, cr3, la57, va, &mut buf);
});
