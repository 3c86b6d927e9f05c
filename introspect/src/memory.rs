//! What introspection asks of a guest: "something I can read guest-physical memory from".
//!
//! The trait is consumer-side (vm-memory's lesson): a live backend implements it over its
//! control interface, tests and snapshots implement it over bytes in host memory.

use std::collections::BTreeMap;

/// Why guest-physical memory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Part of the range is not backed by anything the reader knows about.
    #[error("guest-physical memory at {addr:#x} ({len} bytes) is not accessible")]
    Unmapped {
        /// First byte of the requested range.
        addr: u64,
        /// Length of the requested range.
        len: usize,
    },
    /// The range runs past the end of the 64-bit address space.
    #[error("guest-physical range at {addr:#x} ({len} bytes) wraps around the address space")]
    Wraps {
        /// First byte of the requested range.
        addr: u64,
        /// Length of the requested range.
        len: usize,
    },
    /// The backend behind the reader failed.
    #[error("the guest-memory backend failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Read access to guest-physical memory.
pub trait PhysicalMemory {
    /// Fills `buf` with the guest-physical bytes starting at `addr`.
    ///
    /// # Errors
    /// [`MemoryError::Unmapped`] when any byte of the range is not readable,
    /// [`MemoryError::Backend`] when the backend fails.
    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError>;

    /// Reads a little-endian `u64` at `addr`.
    ///
    /// # Errors
    /// As [`PhysicalMemory::read_phys`].
    fn read_phys_u64(&mut self, addr: u64) -> Result<u64, MemoryError> {
        let mut bytes = [0u8; 8];
        self.read_phys(addr, &mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }
}

impl<M: PhysicalMemory + ?Sized> PhysicalMemory for &mut M {
    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        (**self).read_phys(addr, buf)
    }
}

/// Guest-physical memory held as a few disjoint regions of bytes: a snapshot, or page tables
/// built by hand in a test. Also writable, so tests can apply planned changes.
#[derive(Debug, Clone, Default)]
pub struct SparseMemory {
    /// Region start → bytes. Regions never overlap.
    regions: BTreeMap<u64, Vec<u8>>,
}

impl SparseMemory {
    /// An empty memory: every read fails.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a region of `bytes` at `addr`.
    ///
    /// # Errors
    /// [`MemoryError::Wraps`] when the region runs past the address space, and
    /// [`MemoryError::Unmapped`] (naming the new region) when it overlaps an existing one.
    pub fn add_region(&mut self, addr: u64, bytes: Vec<u8>) -> Result<(), MemoryError> {
        let len = bytes.len();
        let end = range_end(addr, len)?;
        let overlaps = self
            .regions
            .range(..end)
            .next_back()
            .is_some_and(|(start, data)| {
                range_end(*start, data.len()).is_ok_and(|region_end| region_end > addr)
            });
        if overlaps {
            return Err(MemoryError::Unmapped { addr, len });
        }
        self.regions.insert(addr, bytes);
        Ok(())
    }

    /// Adds `len` zero bytes at `addr`.
    ///
    /// # Errors
    /// As [`SparseMemory::add_region`].
    pub fn add_zeroed(&mut self, addr: u64, len: usize) -> Result<(), MemoryError> {
        self.add_region(addr, vec![0; len])
    }

    /// Overwrites bytes inside one existing region.
    ///
    /// # Errors
    /// [`MemoryError::Unmapped`] when the range is not inside a single region.
    pub fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), MemoryError> {
        let (offset, region) = self.locate_mut(addr, data.len())?;
        let end = offset + data.len();
        region[offset..end].copy_from_slice(data);
        Ok(())
    }

    /// Writes a little-endian `u64` inside one existing region.
    ///
    /// # Errors
    /// As [`SparseMemory::write_phys`].
    pub fn write_phys_u64(&mut self, addr: u64, value: u64) -> Result<(), MemoryError> {
        self.write_phys(addr, &value.to_le_bytes())
    }

    /// (start, length) of every region.
    #[cfg(test)]
    pub(crate) fn region_spans(&self) -> Vec<(u64, usize)> {
        self.regions.iter().map(|(a, b)| (*a, b.len())).collect()
    }

    fn locate(&self, addr: u64, len: usize) -> Result<(usize, &Vec<u8>), MemoryError> {
        let end = range_end(addr, len)?;
        let (start, region) = self
            .regions
            .range(..=addr)
            .next_back()
            .ok_or(MemoryError::Unmapped { addr, len })?;
        let region_end = range_end(*start, region.len())?;
        if end > region_end {
            return Err(MemoryError::Unmapped { addr, len });
        }
        let offset =
            usize::try_from(addr - start).map_err(|_| MemoryError::Unmapped { addr, len })?;
        Ok((offset, region))
    }

    fn locate_mut(&mut self, addr: u64, len: usize) -> Result<(usize, &mut Vec<u8>), MemoryError> {
        let (offset, _) = self.locate(addr, len)?;
        let (_, region) = self
            .regions
            .range_mut(..=addr)
            .next_back()
            .ok_or(MemoryError::Unmapped { addr, len })?;
        Ok((offset, region))
    }
}

impl PhysicalMemory for SparseMemory {
    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        let (offset, region) = self.locate(addr, buf.len())?;
        let end = offset + buf.len();
        buf.copy_from_slice(&region[offset..end]);
        Ok(())
    }
}

/// One past the last byte of `len` bytes at `addr`.
fn range_end(addr: u64, len: usize) -> Result<u64, MemoryError> {
    u64::try_from(len)
        .ok()
        .and_then(|len64| addr.checked_add(len64))
        .ok_or(MemoryError::Wraps { addr, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_memory_reads_inside_a_region() {
        let mut mem = SparseMemory::new();
        mem.add_region(0x1000, vec![1, 2, 3, 4]).unwrap();
        let mut buf = [0u8; 2];

        mem.read_phys(0x1001, &mut buf).unwrap();

        assert_eq!(buf, [2, 3]);
    }

    #[test]
    fn sparse_memory_refuses_read_across_region_end() {
        let mut mem = SparseMemory::new();
        mem.add_region(0x1000, vec![0; 4]).unwrap();
        let mut buf = [0u8; 2];

        let err = mem.read_phys(0x1003, &mut buf).unwrap_err();

        assert!(matches!(
            err,
            MemoryError::Unmapped {
                addr: 0x1003,
                len: 2
            }
        ));
    }

    #[test]
    fn sparse_memory_refuses_read_below_first_region() {
        let mut mem = SparseMemory::new();
        mem.add_region(0x1000, vec![0; 4]).unwrap();

        let err = mem.read_phys(0x800, &mut [0u8; 1]).unwrap_err();

        assert!(matches!(err, MemoryError::Unmapped { .. }));
    }

    #[test]
    fn sparse_memory_refuses_wrapping_read() {
        let mut mem = SparseMemory::new();

        let err = mem.read_phys(u64::MAX, &mut [0u8; 2]).unwrap_err();

        assert!(matches!(err, MemoryError::Wraps { .. }));
    }

    #[test]
    fn sparse_memory_refuses_overlapping_region() {
        let mut mem = SparseMemory::new();
        mem.add_zeroed(0x1000, 0x1000).unwrap();

        let err = mem.add_zeroed(0x1800, 0x1000).unwrap_err();

        assert!(matches!(err, MemoryError::Unmapped { addr: 0x1800, .. }));
    }

    #[test]
    fn sparse_memory_write_then_read_u64_round_trips() {
        let mut mem = SparseMemory::new();
        mem.add_zeroed(0x2000, 0x1000).unwrap();

        mem.write_phys_u64(0x2ff8, 0xdead_beef_0123_4567).unwrap();

        assert_eq!(mem.read_phys_u64(0x2ff8).unwrap(), 0xdead_beef_0123_4567);
    }
}
