//! Hostile guest memory for tests: a deterministic generator and mutations of a
//! [`SparseMemory`] aimed at page-table entries and kernel variables, so that every live
//! reader is run against corrupt tables (cycles, entries pointing anywhere, large-page bits
//! where they make no sense) and corrupt data, and must give an error, never a panic or a
//! hang.

use crate::memory::SparseMemory;
use crate::paging::{PTE_ADDR_MASK, PTE_PAGE_SIZE, PTE_PRESENT, PTE_WRITABLE};

/// A xorshift64 generator: the same cases on every run.
#[derive(Debug)]
pub(crate) struct XorShift(pub(crate) u64);

impl XorShift {
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// A number below `n` (`n` > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// Applies one to `most` mutations to `mem`: three in four hit the 4 KiB pages at `hot` (page
/// tables, the variables a reader needs), the others anywhere in a region. A mutation
/// writes an aligned `u64` that looks like a page-table entry (pointing at a hot page, at
/// its own page, at nothing, with random flags), flips a bit, or scribbles 64 bytes.
pub(crate) fn mutate_memory(mem: &mut SparseMemory, rng: &mut XorShift, hot: &[u64], most: usize) {
    let regions = mem.region_spans();
    for _ in 0..=rng.below(most) {
        let addr = if !hot.is_empty() && rng.below(4) != 0 {
            let page = rng.pick(hot);
            // Half the time a slot in use: a live entry or a set variable.
            let live = live_slots(mem, page);
            if !live.is_empty() && rng.below(2) == 0 {
                rng.pick(&live)
            } else {
                page + 8 * rng.below(512) as u64
            }
        } else {
            let (start, len) = rng.pick(&regions);
            start + (8 * rng.below(len / 8)) as u64
        };
        let Ok(old) = crate::memory::PhysicalMemory::read_phys_u64(mem, addr) else {
            continue;
        };
        let flags =
            PTE_PRESENT | rng.pick(&[0, PTE_WRITABLE, PTE_PAGE_SIZE, PTE_PAGE_SIZE | PTE_WRITABLE]);
        let table = if hot.is_empty() { 0 } else { rng.pick(hot) };
        let new = match rng.below(9) {
            0 => 0,
            1 => u64::MAX,
            2 => rng.next(),
            3 => table | flags,
            // A cycle: the entry points at its own table.
            4 => (addr & PTE_ADDR_MASK & !0xfff) | flags,
            5 => PTE_ADDR_MASK | flags,
            6 => old ^ PTE_PRESENT,
            7 => old ^ PTE_PAGE_SIZE,
            _ => old ^ (1 << rng.below(64)),
        };
        let _ = mem.write_phys_u64(addr, new);
        if rng.below(16) == 0 {
            let scribble: Vec<u8> = (0..64).map(|_| rng.next() as u8).collect();
            let _ = mem.write_phys(addr & !63, &scribble);
        }
    }
}

/// Addresses of the non-zero `u64`s of the 4 KiB page at `page`.
fn live_slots(mem: &mut SparseMemory, page: u64) -> Vec<u64> {
    let mut bytes = vec![0u8; 4096];
    if crate::memory::PhysicalMemory::read_phys(mem, page, &mut bytes).is_err() {
        return Vec::new();
    }
    bytes
        .chunks_exact(8)
        .enumerate()
        .filter(|(_, slot)| slot.iter().any(|b| *b != 0))
        .map(|(i, _)| page + 8 * i as u64)
        .collect()
}

/// `bytes` with one to eight mutations: flipped bits, random bytes, cut, repeated or
/// swapped ranges.
pub(crate) fn mutate_bytes(rng: &mut XorShift, bytes: &mut Vec<u8>) {
    for _ in 0..=rng.below(8) {
        let len = bytes.len();
        if len == 0 {
            return;
        }
        let at = rng.below(len);
        match rng.below(5) {
            0 => bytes[at] ^= 1 << rng.below(8),
            1 => bytes[at] = rng.next() as u8,
            2 => {
                let end = (at + rng.below(64)).min(len);
                bytes.drain(at..end);
            }
            3 => {
                let end = (at + rng.below(64)).min(len);
                let piece = bytes[at..end].to_vec();
                let to = rng.below(len);
                bytes.splice(to..to, piece);
            }
            _ => {
                let other = rng.below(len);
                bytes.swap(at, other);
            }
        }
    }
}
