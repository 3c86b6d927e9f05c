//! The code cache's place in the patch heap: where translations, block counters and the
//! lookup table go, and the bump allocation of the first two. A cache that runs out of
//! room says so; nothing past its end is ever written.

use std::ops::Range;

/// Errors of the cache layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheError {
    /// The code area has no room for a translation.
    #[error("the code cache is full: {needed} more bytes needed, {left} left")]
    CodeFull {
        /// Bytes the translation needs.
        needed: u64,
        /// Bytes left.
        left: u64,
    },
    /// The counter area has no room for a function's block counters.
    #[error("the block counters are full: {needed} more needed, {left} left")]
    CountersFull {
        /// Counters the function needs.
        needed: u64,
        /// Counters left.
        left: u64,
    },
    /// The lookup table would pass half full.
    #[error("the lookup table is full: {needed} more entries needed, room for {left}")]
    TableFull {
        /// Entries the function needs.
        needed: usize,
        /// Entries the table can still take.
        left: usize,
    },
    /// The areas overlap, are empty, or are out of order.
    #[error("the cache areas are not usable: {0}")]
    Layout(&'static str),
}

/// Where the cache's parts lie in the guest (kernel virtual addresses, inside the patch
/// heap, so within rel32 reach of the kernel text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheLayout {
    /// Translated code (and the dispatch routine at its start).
    pub code: Range<u64>,
    /// Block counters, 8 bytes each.
    pub counters: Range<u64>,
    /// The lookup table.
    pub table: Range<u64>,
}

impl CacheLayout {
    /// Splits `heap` into code (the first half), counters (a quarter) and the table
    /// (the last quarter), each 4 KiB-aligned.
    ///
    /// # Errors
    /// [`CacheError::Layout`] for a range under 16 KiB.
    pub fn split(heap: Range<u64>) -> Result<Self, CacheError> {
        const PAGE: u64 = 0x1000;
        let start = heap.start.next_multiple_of(PAGE);
        let end = heap.end & !(PAGE - 1);
        if end <= start || end - start < 4 * PAGE {
            return Err(CacheError::Layout("less than 16 KiB"));
        }
        let quarter = ((end - start) / 4) & !(PAGE - 1);
        let layout = Self {
            code: start..start + 2 * quarter,
            counters: start + 2 * quarter..start + 3 * quarter,
            table: start + 3 * quarter..end,
        };
        layout.check()?;
        Ok(layout)
    }

    /// Checks that the areas are non-empty and disjoint.
    ///
    /// # Errors
    /// [`CacheError::Layout`].
    pub fn check(&self) -> Result<(), CacheError> {
        let areas = [&self.code, &self.counters, &self.table];
        if areas.iter().any(|r| r.end <= r.start) {
            return Err(CacheError::Layout("an empty area"));
        }
        for (i, a) in areas.iter().enumerate() {
            for b in &areas[i + 1..] {
                if a.start < b.end && b.start < a.end {
                    return Err(CacheError::Layout("overlapping areas"));
                }
            }
        }
        if !self.counters.start.is_multiple_of(8) || !self.table.start.is_multiple_of(16) {
            return Err(CacheError::Layout("misaligned counters or table"));
        }
        Ok(())
    }
}

/// A bump allocator over one area.
#[derive(Debug, Clone)]
pub(crate) struct Bump {
    area: Range<u64>,
    next: u64,
}

impl Bump {
    pub(crate) fn new(area: Range<u64>) -> Self {
        Self {
            next: area.start,
            area,
        }
    }

    /// The next free address.
    pub(crate) fn here(&self) -> u64 {
        self.next
    }

    /// Bytes left.
    pub(crate) fn left(&self) -> u64 {
        self.area.end.saturating_sub(self.next)
    }

    /// Takes `n` bytes, or says how many are left.
    pub(crate) fn take(&mut self, n: u64) -> Result<u64, u64> {
        if n > self.left() {
            return Err(self.left());
        }
        let at = self.next;
        self.next += n;
        Ok(at)
    }

    /// Bytes used.
    pub(crate) fn used(&self) -> u64 {
        self.next - self.area.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_gives_disjoint_aligned_areas_inside_the_heap() {
        let heap = 0xffff_ffff_a000_0123..0xffff_ffff_a010_0000;

        let layout = CacheLayout::split(heap.clone()).unwrap();

        assert!(layout.code.start >= heap.start && layout.table.end <= heap.end);
        assert_eq!(layout.code.end, layout.counters.start);
        assert_eq!(layout.counters.end, layout.table.start);
        assert_eq!(layout.code.start % 0x1000, 0);
    }

    #[test]
    fn a_tiny_heap_is_refused() {
        assert!(CacheLayout::split(0x1000..0x3000).is_err());
    }

    #[test]
    fn bump_refuses_past_the_end_and_says_what_is_left() {
        let mut bump = Bump::new(0x1000..0x1010);
        assert_eq!(bump.take(12), Ok(0x1000));
        assert_eq!(bump.take(8), Err(4));
        assert_eq!(bump.here(), 0x100c);
    }
}
