//! Guest RAM shared with QEMU: the zero-stop data path of the QEMU backend.
//!
//! QEMU started with its RAM in a shared memory backend
//! (`-object memory-backend-file,id=exotap-ram,size=1024M,mem-path=/dev/shm/F,share=on
//! -machine memory-backend=exotap-ram`, see [`crate::qemu::QemuConfig::shared_ram`]) keeps the
//! guest's memory in that file; exotap maps the same file and reads counters, rings and maps
//! while the vCPUs run, with no gdbstub stop.
//!
//! Only RAM below [`IDENTITY_LIMIT`] is reachable: on QEMU's `pc` and `q35` machines the
//! backend's first bytes are guest-physical 0.. up to the PCI hole (at 2.75 GiB at the lowest),
//! so there the file offset is the guest-physical address; RAM above 4 GiB sits at other
//! offsets and is refused rather than guessed. The patch heap is placed in low RAM.
//!
//! **Text writes do not go through here.** QEMU's TCG keeps translated blocks of guest code;
//! a write through the gdbstub goes through QEMU's memory API, which invalidates the blocks
//! of the pages it touches, but a write into the shared file does not, so a vCPU could go on
//! running the old instructions. Kernel text is written over the gdbstub, and so is patch
//! code that may have run before; this path carries data (counters, ring records, compiled
//! globals) and patch code no vCPU has run yet (a heap no exotap used since the guest
//! booted: QEMU holds no translated block of it, see `exotap_probes::live::splicer`).
//!
//! The guest writes this memory concurrently and is hostile: every access is bounds-checked
//! ([`SharedRamError::OutOfRange`]), never panics, and plain reads are volatile copies (the
//! bytes may change under them; callers validate what they read, see
//! `exotap_probes::rings`).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Guest-physical addresses below this are at the same offset in the RAM file (QEMU's lowest
/// start of the PCI hole, q35 with more than 2.75 GiB of RAM).
pub const IDENTITY_LIMIT: u64 = 0xb000_0000;

/// Errors of the shared RAM mapping.
#[derive(Debug, thiserror::Error)]
pub enum SharedRamError {
    /// The file could not be opened.
    #[error("cannot open the guest RAM file {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is empty or too large to map.
    #[error("the guest RAM file {path} has {len} bytes: nothing to map")]
    Size {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: u64,
    },
    /// mmap(2) failed.
    #[error("cannot map the guest RAM file {path}")]
    Map {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The range is outside the mapped low RAM.
    #[error("guest-physical {addr:#x} (+{len} bytes) is outside the shared RAM ({limit:#x} bytes reachable)")]
    OutOfRange {
        /// The address.
        addr: u64,
        /// The length.
        len: u64,
        /// Bytes reachable from guest-physical 0.
        limit: u64,
    },
    /// An atomic access at an address that is not 8-byte aligned.
    #[error("guest-physical {0:#x} is not 8-byte aligned for an atomic access")]
    Unaligned(u64),
}

/// The guest's RAM, mapped shared from QEMU's memory backend file.
#[derive(Debug)]
pub struct SharedRam {
    base: NonNull<u8>,
    /// Bytes mapped.
    len: usize,
    /// Bytes reachable from guest-physical 0 (`len` capped at [`IDENTITY_LIMIT`]).
    reachable: u64,
    path: PathBuf,
}

// SAFETY: the mapping is plain shared memory; every access through `SharedRam` is a volatile
// or atomic access that tolerates concurrent writers (the guest), so sharing or sending the
// handle between threads adds no data race the guest does not already cause.
unsafe impl Send for SharedRam {}
// SAFETY: as for `Send`: `&SharedRam` only offers volatile and atomic accesses.
unsafe impl Sync for SharedRam {}

impl SharedRam {
    /// Maps the RAM file `path` read-write and shared.
    ///
    /// # Errors
    /// When the file cannot be opened or mapped, or is empty.
    pub fn open(path: &Path) -> Result<Self, SharedRamError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| SharedRamError::Open {
                path: path.to_owned(),
                source,
            })?;
        let size_err = |len| SharedRamError::Size {
            path: path.to_owned(),
            len,
        };
        let file_len = file
            .metadata()
            .map_err(|source| SharedRamError::Open {
                path: path.to_owned(),
                source,
            })?
            .len();
        let len = usize::try_from(file_len).map_err(|_| size_err(file_len))?;
        if len == 0 {
            return Err(size_err(file_len));
        }
        // SAFETY: a fresh shared mapping of a file we opened read-write, at an address the
        // kernel chooses; the result is checked for MAP_FAILED before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(SharedRamError::Map {
                path: path.to_owned(),
                source: std::io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| size_err(file_len))?;
        Ok(Self {
            base,
            len,
            reachable: file_len.min(IDENTITY_LIMIT),
            path: path.to_owned(),
        })
    }

    /// The mapped file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of guest RAM reachable from guest-physical 0.
    pub fn reachable(&self) -> u64 {
        self.reachable
    }

    /// The offset of `[addr, addr + len)` in the mapping, after the bounds check.
    #[inline]
    fn offset(&self, addr: u64, len: usize) -> Result<usize, SharedRamError> {
        let len64 = u64::try_from(len).unwrap_or(u64::MAX);
        let out = SharedRamError::OutOfRange {
            addr,
            len: len64,
            limit: self.reachable,
        };
        match addr.checked_add(len64) {
            Some(end) if end <= self.reachable => usize::try_from(addr).map_err(|_| out),
            _ => Err(out),
        }
    }

    /// Copies guest-physical `[addr, addr + buf.len())` into `buf` with volatile reads (the
    /// guest may be writing it: the caller validates what it gets).
    ///
    /// # Errors
    /// [`SharedRamError::OutOfRange`].
    #[inline]
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), SharedRamError> {
        let offset = self.offset(addr, buf.len())?;
        // Whole aligned words where the range allows (the ring reader's bulk copies are all
        // words): one volatile 8-byte load each, the rest a byte at a time.
        let lead = (8 - offset % 8) % 8;
        let lead = lead.min(buf.len());
        let (head, rest) = buf.split_at_mut(lead);
        let mut words = rest.chunks_exact_mut(8);
        for (i, byte) in head.iter_mut().enumerate() {
            // SAFETY: `offset(addr, len)` checked that `offset + len <= self.len`, so every
            // byte of `[offset, offset + len)` is inside the live mapping; a volatile read
            // tolerates the guest writing it, and a byte needs no alignment.
            *byte = unsafe { self.base.as_ptr().add(offset + i).read_volatile() };
        }
        let mut at = offset + lead;
        for word in &mut words {
            // SAFETY: `[at, at + 8)` is inside the checked range, and `at` is 8-aligned
            // (`offset + lead` is, and the mapping is page-aligned).
            let value = unsafe { self.base.as_ptr().add(at).cast::<u64>().read_volatile() };
            word.copy_from_slice(&value.to_ne_bytes());
            at += 8;
        }
        for byte in words.into_remainder() {
            // SAFETY: as for the leading bytes.
            *byte = unsafe { self.base.as_ptr().add(at).read_volatile() };
            at += 1;
        }
        Ok(())
    }

    /// Appends guest-physical `[addr, addr + len)` to `out`, read as [`SharedRam::read`] reads,
    /// straight into `out`'s spare capacity: no zero-fill of the room first (the ring reader's
    /// bulk copies: `benches/ring_drain.rs` in exotap-probes found that zero-fill at 15 % of
    /// its samples).
    ///
    /// # Errors
    /// [`SharedRamError::OutOfRange`].
    pub fn append(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<(), SharedRamError> {
        let offset = self.offset(addr, len)?;
        if !offset.is_multiple_of(8) || !len.is_multiple_of(8) {
            let start = out.len();
            out.resize(start + len, 0);
            return self.read(addr, &mut out[start..]);
        }
        out.reserve(len);
        let spare = &mut out.spare_capacity_mut()[..len];
        for (i, word) in spare.chunks_exact_mut(8).enumerate() {
            // SAFETY: `[offset + 8i, offset + 8i + 8)` is inside the range `offset(addr, len)`
            // checked, and 8-aligned (`offset` is, and the mapping is page-aligned).
            let value = unsafe {
                self.base
                    .as_ptr()
                    .add(offset + 8 * i)
                    .cast::<u64>()
                    .read_volatile()
            };
            for (dst, byte) in word.iter_mut().zip(value.to_ne_bytes()) {
                dst.write(byte);
            }
        }
        // SAFETY: the loop above initialised all `len` bytes after the old length (the
        // chunks of `spare`, which is exactly `len` bytes long and a multiple of 8).
        unsafe { out.set_len(out.len() + len) };
        Ok(())
    }

    /// Writes `data` at guest-physical `addr` with volatile writes. Data only: never kernel
    /// text or patch code (see the module documentation).
    ///
    /// # Errors
    /// [`SharedRamError::OutOfRange`].
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), SharedRamError> {
        let offset = self.offset(addr, data.len())?;
        for (i, byte) in data.iter().enumerate() {
            // SAFETY: in bounds as in `read`; the mapping is writable (PROT_WRITE).
            unsafe { self.base.as_ptr().add(offset + i).write_volatile(*byte) };
        }
        Ok(())
    }

    /// The 8-aligned `u64` at guest-physical `addr` as an atomic.
    #[inline]
    fn atomic(&self, addr: u64) -> Result<&AtomicU64, SharedRamError> {
        if !addr.is_multiple_of(8) {
            return Err(SharedRamError::Unaligned(addr));
        }
        let offset = self.offset(addr, 8)?;
        // SAFETY: in bounds (checked), 8-aligned (the mapping is page-aligned and `addr` is a
        // multiple of 8), and valid for the lifetime of `&self` (unmapped only in `drop`);
        // other writers of the word (the guest's `lock xadd` and stores) are hardware
        // atomic accesses of the same size.
        Ok(unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(offset).cast::<u64>()) })
    }

    /// Loads `count` `u64`s at `addr`, `addr + stride`, ... with `Acquire` ordering, in that
    /// order, handing each to `f` until it returns `false`: [`SharedRam::load_acquire`] with
    /// one bounds check for the whole range (the ring reader loads a mark per record).
    ///
    /// # Errors
    /// [`SharedRamError::OutOfRange`] for a range past the RAM (nothing is loaded),
    /// [`SharedRamError::Unaligned`] for an `addr` or `stride` not a multiple of 8.
    #[inline]
    pub fn load_each<F: FnMut(u64) -> bool>(
        &self,
        addr: u64,
        stride: u64,
        count: u64,
        mut f: F,
    ) -> Result<(), SharedRamError> {
        let Some(last) = count.checked_sub(1) else {
            return Ok(());
        };
        if !addr.is_multiple_of(8) || !stride.is_multiple_of(8) {
            return Err(SharedRamError::Unaligned(addr));
        }
        let out = SharedRamError::OutOfRange {
            addr,
            len: u64::MAX,
            limit: self.reachable,
        };
        let span = last
            .checked_mul(stride)
            .and_then(|s| s.checked_add(8))
            .and_then(|s| usize::try_from(s).ok())
            .ok_or(out)?;
        let offset = self.offset(addr, span)?;
        let stride = usize::try_from(stride).map_err(|_| SharedRamError::Unaligned(addr))?;
        for k in 0..=usize::try_from(last).unwrap_or(0) {
            // SAFETY: `offset + k * stride + 8 <= offset + span`, inside the range `offset`
            // checked; 8-aligned (`offset` and `stride` are, and the mapping is
            // page-aligned); valid while `&self` lives; other writers are hardware atomic
            // accesses of the same size (as in `atomic`).
            let word = unsafe {
                AtomicU64::from_ptr(self.base.as_ptr().add(offset + k * stride).cast::<u64>())
            };
            if !f(u64::from_le(word.load(Ordering::Acquire))) {
                break;
            }
        }
        Ok(())
    }

    /// Loads the `u64` at `addr` with `Acquire` ordering: the reads after it see at least
    /// what the guest wrote before the value it returns (x86 stores are ordered).
    ///
    /// # Errors
    /// [`SharedRamError::OutOfRange`], [`SharedRamError::Unaligned`].
    #[inline]
    pub fn load_acquire(&self, addr: u64) -> Result<u64, SharedRamError> {
        Ok(u64::from_le(self.atomic(addr)?.load(Ordering::Acquire)))
    }
}

/// Anonymous memory (a memfd) for the RAM of a guest exotap boots: QEMU inherits the
/// descriptor and opens it as `/proc/self/fd/N` (the same `N` in both processes), exotap maps
/// it the same way. Nothing is left behind on tmpfs when either process dies, even killed.
#[derive(Debug)]
pub struct RamMemfd {
    fd: std::os::fd::OwnedFd,
}

impl RamMemfd {
    /// Creates the memfd, inheritable by child processes (QEMU).
    ///
    /// # Errors
    /// When memfd_create(2) fails.
    pub fn create() -> std::io::Result<Self> {
        // SAFETY: a NUL-terminated name and no flags (no MFD_CLOEXEC: QEMU inherits it); the
        // returned descriptor is checked and then owned by `OwnedFd` alone.
        let fd = unsafe { libc::memfd_create(c"exotap-guest-ram".as_ptr(), 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        Ok(Self { fd })
    }

    /// The path that names it in this process and in its children: `/proc/self/fd/N`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }
}

impl Drop for SharedRam {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping made in `open`, unmapped once here;
        // no reference into it outlives `self` (every accessor borrows `self`).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ram_file(bytes: &[u8]) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), bytes).unwrap();
        file
    }

    #[test]
    fn append_adds_the_bytes_read_after_what_the_vector_holds() {
        let bytes: Vec<u8> = (0..=255).collect();
        let file = ram_file(&bytes);
        let ram = SharedRam::open(file.path()).unwrap();
        let mut out = vec![0xee];

        ram.append(16, 24, &mut out).unwrap();
        ram.append(3, 5, &mut out).unwrap();
        let past_the_end = ram.append(250, 8, &mut out);

        let mut expected = vec![0xee];
        expected.extend(16..40u8);
        expected.extend(3..8u8);
        assert_eq!(out, expected, "aligned words, then the unaligned fallback");
        assert!(matches!(
            past_the_end,
            Err(SharedRamError::OutOfRange { .. })
        ));
        assert_eq!(out.len(), 30, "a failed append adds nothing");
    }

    #[test]
    fn reads_and_writes_land_at_the_guest_physical_offset_of_the_file() {
        let mut bytes = vec![0u8; 8192];
        bytes[4096..4100].copy_from_slice(b"exo!");
        let file = ram_file(&bytes);
        let ram = SharedRam::open(file.path()).unwrap();
        let mut seen = [0u8; 4];

        ram.read(4096, &mut seen).unwrap();
        ram.write(16, &7u64.to_le_bytes()).unwrap();

        assert_eq!(&seen, b"exo!");
        assert_eq!(ram.load_acquire(16).unwrap(), 7);
        assert_eq!(
            std::fs::read(file.path()).unwrap()[16],
            7,
            "the file itself changed"
        );
    }

    #[test]
    fn ranges_past_the_end_or_wrapping_are_refused_without_a_panic() {
        let file = ram_file(&[0u8; 4096]);
        let ram = SharedRam::open(file.path()).unwrap();
        let mut buf = [0u8; 16];

        assert!(matches!(
            ram.read(4090, &mut buf),
            Err(SharedRamError::OutOfRange { .. })
        ));
        assert!(matches!(
            ram.read(u64::MAX - 4, &mut buf),
            Err(SharedRamError::OutOfRange { .. })
        ));
        assert!(matches!(
            ram.load_acquire(4096),
            Err(SharedRamError::OutOfRange { .. })
        ));
        assert!(matches!(
            ram.load_acquire(12),
            Err(SharedRamError::Unaligned(12))
        ));
    }

    #[test]
    fn load_each_loads_every_strided_word_until_told_to_stop_and_checks_the_whole_range() {
        let bytes: Vec<u8> = (0..512u64).flat_map(|w| (w * 3).to_le_bytes()).collect();
        let file = ram_file(&bytes);
        let ram = SharedRam::open(file.path()).unwrap();
        let mut seen = Vec::new();

        ram.load_each(64, 24, 5, |w| {
            seen.push(w);
            true
        })
        .unwrap();
        let mut until = Vec::new();
        ram.load_each(0, 8, 100, |w| {
            until.push(w);
            w < 6
        })
        .unwrap();
        let mut past = 0;
        let past_the_end = ram.load_each(4096 - 64, 64, 2, |_| {
            past += 1;
            true
        });

        // Words 8, 11, 14, 17, 20 (bytes 64, 88, ...), each word w holding 3w.
        assert_eq!(seen, [24, 33, 42, 51, 60]);
        assert_eq!(until, [0, 3, 6], "stops after the word it refused");
        assert!(matches!(
            past_the_end,
            Err(SharedRamError::OutOfRange { .. })
        ));
        assert_eq!(past, 0, "nothing is loaded from a range past the end");
        assert!(matches!(
            ram.load_each(8, 12, 2, |_| true),
            Err(SharedRamError::Unaligned(8))
        ));
        assert!(
            ram.load_each(u64::MAX - 7, 8, 0, |_| true).is_ok(),
            "nothing to load"
        );
    }

    #[test]
    fn a_memfd_is_reachable_through_its_proc_path_once_sized() {
        let memfd = RamMemfd::create().unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(memfd.path())
            .unwrap()
            .set_len(4096)
            .unwrap();
        let ram = SharedRam::open(&memfd.path()).unwrap();

        ram.write(8, &9u64.to_le_bytes()).unwrap();

        assert_eq!(
            SharedRam::open(&memfd.path())
                .unwrap()
                .load_acquire(8)
                .unwrap(),
            9
        );
    }

    #[test]
    fn an_empty_file_is_refused() {
        let file = ram_file(&[]);

        assert!(matches!(
            SharedRam::open(file.path()),
            Err(SharedRamError::Size { .. })
        ));
    }
}
