//! Address-space allocation inside the patch heap: a bump pointer plus a first-fit free
//! list over a virtual range `[start, end)`, with alignment.
//!
//! Only addresses are handed out here; mapping the heap and writing into it is the
//! caller's business. Freeing a patch is only safe once no vCPU can be inside it, which
//! the caller must know (e.g. after a quiescent period); this allocator cannot tell.

use std::collections::BTreeMap;

/// Errors of the patch-heap allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PatchHeapError {
    /// The range is empty or reversed.
    #[error("the heap range {start:#x}..{end:#x} is empty")]
    EmptyRange {
        /// Its start.
        start: u64,
        /// Its end.
        end: u64,
    },
    /// Alignment must be a non-zero power of two.
    #[error("alignment {0:#x} is not a power of two")]
    BadAlignment(u64),
    /// Zero-byte allocations are not handed out.
    #[error("a zero-byte allocation was asked for")]
    ZeroSize,
    /// No free space of that size and alignment is left.
    #[error("no {size:#x} bytes aligned to {align:#x} are left in the heap")]
    OutOfSpace {
        /// Bytes asked for.
        size: u64,
        /// Alignment asked for.
        align: u64,
    },
    /// The address is not the start of a live allocation.
    #[error("{0:#x} is not the start of a live allocation")]
    NotAllocated(u64),
    /// A shrink asked to grow.
    #[error("cannot shrink the allocation at {addr:#x} from {size:#x} to {new_size:#x} bytes")]
    BadShrink {
        /// The allocation.
        addr: u64,
        /// Its size.
        size: u64,
        /// The size asked for.
        new_size: u64,
    },
}

/// The patch heap's address space.
#[derive(Debug, Clone)]
pub struct PatchHeap {
    start: u64,
    end: u64,
    bump: u64,
    /// Free blocks below `bump`, start → length, never adjacent to each other.
    free: BTreeMap<u64, u64>,
    /// Live allocations, start → length.
    live: BTreeMap<u64, u64>,
}

impl PatchHeap {
    /// A heap over `[start, end)`.
    ///
    /// # Errors
    /// [`PatchHeapError::EmptyRange`] when `end <= start`.
    pub fn new(start: u64, end: u64) -> Result<Self, PatchHeapError> {
        if end <= start {
            return Err(PatchHeapError::EmptyRange { start, end });
        }
        Ok(Self {
            start,
            end,
            bump: start,
            free: BTreeMap::new(),
            live: BTreeMap::new(),
        })
    }

    /// Allocates `size` bytes aligned to `align`; returns the address.
    ///
    /// # Errors
    /// [`PatchHeapError::ZeroSize`], [`PatchHeapError::BadAlignment`],
    /// [`PatchHeapError::OutOfSpace`].
    pub fn alloc(&mut self, size: u64, align: u64) -> Result<u64, PatchHeapError> {
        if size == 0 {
            return Err(PatchHeapError::ZeroSize);
        }
        if !align.is_power_of_two() {
            return Err(PatchHeapError::BadAlignment(align));
        }
        let out_of_space = PatchHeapError::OutOfSpace { size, align };
        let fit = self.free.iter().find_map(|(&block, &len)| {
            let addr = align_up(block, align)?;
            let block_end = block.checked_add(len)?;
            (addr.checked_add(size)? <= block_end).then_some((block, len, addr))
        });
        let addr = if let Some((block, len, addr)) = fit {
            self.free.remove(&block);
            if addr > block {
                self.free.insert(block, addr - block);
            }
            let tail = addr + size;
            if tail < block + len {
                self.free.insert(tail, block + len - tail);
            }
            addr
        } else {
            let addr = align_up(self.bump, align).ok_or(out_of_space)?;
            let new_bump = addr.checked_add(size).ok_or(out_of_space)?;
            if new_bump > self.end {
                return Err(out_of_space);
            }
            if addr > self.bump {
                self.release(self.bump, addr - self.bump);
            }
            self.bump = new_bump;
            addr
        };
        self.live.insert(addr, size);
        Ok(addr)
    }

    /// Frees the allocation that starts at `addr`.
    ///
    /// # Errors
    /// [`PatchHeapError::NotAllocated`] if no live allocation starts there (including a
    /// second free of the same one).
    pub fn free(&mut self, addr: u64) -> Result<(), PatchHeapError> {
        let size = self
            .live
            .remove(&addr)
            .ok_or(PatchHeapError::NotAllocated(addr))?;
        self.release(addr, size);
        Ok(())
    }

    /// Gives back the tail of the allocation at `addr` beyond `new_size` bytes (a patch
    /// turned out shorter than reserved).
    ///
    /// # Errors
    /// [`PatchHeapError::NotAllocated`], [`PatchHeapError::BadShrink`] when
    /// `new_size` is zero or larger than the allocation.
    pub fn shrink(&mut self, addr: u64, new_size: u64) -> Result<(), PatchHeapError> {
        let size = *self
            .live
            .get(&addr)
            .ok_or(PatchHeapError::NotAllocated(addr))?;
        if new_size == 0 || new_size > size {
            return Err(PatchHeapError::BadShrink {
                addr,
                size,
                new_size,
            });
        }
        if new_size < size {
            self.live.insert(addr, new_size);
            self.release(addr + new_size, size - new_size);
        }
        Ok(())
    }

    /// Bytes in live allocations.
    #[must_use]
    pub fn used(&self) -> u64 {
        self.live.values().sum()
    }

    /// The heap's range.
    #[must_use]
    pub fn range(&self) -> (u64, u64) {
        (self.start, self.end)
    }

    /// Puts `[addr, addr + len)` back: merges with free neighbours, and lowers the bump
    /// pointer when the block reaches it.
    fn release(&mut self, mut addr: u64, mut len: u64) {
        if let Some((&prev, &prev_len)) = self.free.range(..addr).next_back() {
            if prev + prev_len == addr {
                self.free.remove(&prev);
                addr = prev;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.free.get(&(addr + len)) {
            self.free.remove(&(addr + len));
            len += next_len;
        }
        if addr + len == self.bump {
            self.bump = addr;
        } else {
            self.free.insert(addr, len);
        }
    }
}

fn align_up(addr: u64, align: u64) -> Option<u64> {
    Some(addr.checked_add(align - 1)? & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: u64 = 0xffff_ffff_a000_0000;

    #[test]
    fn allocations_are_aligned_and_disjoint() {
        let mut heap = PatchHeap::new(START, START + 0x1000).unwrap();

        let a = heap.alloc(3, 1).unwrap();
        let b = heap.alloc(16, 16).unwrap();

        assert_eq!(a, START);
        assert_eq!(b, START + 16);
        assert_eq!(heap.used(), 19);
    }

    #[test]
    fn freed_block_is_reused_first_fit() {
        let mut heap = PatchHeap::new(START, START + 0x1000).unwrap();
        let a = heap.alloc(64, 16).unwrap();
        let _b = heap.alloc(64, 16).unwrap();
        heap.free(a).unwrap();

        let c = heap.alloc(32, 16).unwrap();

        assert_eq!(c, a);
    }

    #[test]
    fn freeing_everything_coalesces_back_to_an_empty_heap() {
        let mut heap = PatchHeap::new(START, START + 0x100).unwrap();
        let a = heap.alloc(0x40, 1).unwrap();
        let b = heap.alloc(0x40, 1).unwrap();
        let c = heap.alloc(0x40, 1).unwrap();
        heap.free(b).unwrap();
        heap.free(a).unwrap();
        heap.free(c).unwrap();

        let whole = heap.alloc(0x100, 1).unwrap();

        assert_eq!(whole, START);
    }

    #[test]
    fn exhausted_heap_reports_out_of_space() {
        let mut heap = PatchHeap::new(START, START + 0x20).unwrap();
        heap.alloc(0x18, 1).unwrap();

        let result = heap.alloc(0x10, 1);

        assert_eq!(
            result,
            Err(PatchHeapError::OutOfSpace {
                size: 0x10,
                align: 1
            })
        );
    }

    #[test]
    fn double_free_is_an_error() {
        let mut heap = PatchHeap::new(START, START + 0x100).unwrap();
        let a = heap.alloc(8, 8).unwrap();
        heap.free(a).unwrap();

        assert_eq!(heap.free(a), Err(PatchHeapError::NotAllocated(a)));
    }

    #[test]
    fn alignment_gap_becomes_free_space() {
        let mut heap = PatchHeap::new(START, START + 0x100).unwrap();
        heap.alloc(1, 1).unwrap();
        heap.alloc(8, 64).unwrap();

        let small = heap.alloc(8, 8).unwrap();

        assert_eq!(small, START + 8);
    }

    #[test]
    fn shrink_returns_the_tail() {
        let mut heap = PatchHeap::new(START, START + 0x100).unwrap();
        let a = heap.alloc(0x80, 1).unwrap();
        heap.shrink(a, 0x10).unwrap();

        let b = heap.alloc(0x10, 1).unwrap();

        assert_eq!(b, START + 0x10);
        assert_eq!(heap.used(), 0x20);
    }

    #[test]
    fn bad_inputs_are_rejected() {
        let mut heap = PatchHeap::new(START, START + 0x100).unwrap();

        assert_eq!(heap.alloc(0, 1), Err(PatchHeapError::ZeroSize));
        assert_eq!(heap.alloc(8, 3), Err(PatchHeapError::BadAlignment(3)));
        assert!(PatchHeap::new(START, START).is_err());
        assert_eq!(
            heap.alloc(8, 1u64 << 63),
            Err(PatchHeapError::OutOfSpace {
                size: 8,
                align: 1 << 63
            })
        );
    }
}
