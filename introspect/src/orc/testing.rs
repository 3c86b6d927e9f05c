//! Test fixtures: synthetic ORC entries and tables (Linux 4.14 layout, as the Debian 6.1
//! kernel uses), stacks built word by word, and the cached Debian `-dbg` vmlinux.

use super::entry::{OrcLayout, RawOrcEntry};
use super::stack::StackSnapshot;
use super::table::{encode_tables, OrcTable};

/// Where synthetic kernel text starts.
pub(crate) const TEXT: u64 = 0xffff_ffff_8100_0000;
/// Where synthetic tables say their ip table sits.
pub(crate) const IP_TABLE: u64 = 0xffff_ffff_8200_0000;

/// `ORC_REG_*` numbers.
pub(crate) const DX: u16 = 2;
pub(crate) const BP: u16 = 4;
pub(crate) const SP: u16 = 5;
pub(crate) const R13: u16 = 7;
pub(crate) const BP_INDIRECT: u16 = 8;
pub(crate) const SP_INDIRECT: u16 = 9;
pub(crate) const PREV_SP: u16 = 1;
/// Linux 4.14-layout type numbers.
pub(crate) const CALL: u16 = 0;
pub(crate) const REGS: u16 = 1;
pub(crate) const REGS_PARTIAL: u16 = 2;

/// An entry in the Linux 4.14 layout.
pub(crate) fn entry(
    sp_reg: u16,
    sp_offset: i16,
    bp_reg: u16,
    bp_offset: i16,
    kind: u16,
) -> RawOrcEntry {
    RawOrcEntry {
        sp_offset,
        bp_offset,
        flags: sp_reg | (bp_reg << 4) | (kind << 8),
    }
}

/// A call frame `sp_offset` bytes deep, frame pointer untouched.
pub(crate) fn call(sp_offset: i16) -> RawOrcEntry {
    entry(SP, sp_offset, 0, 0, CALL)
}

/// The bottom of a stack: undefined sp with the `end` bit.
pub(crate) fn end_of_stack() -> RawOrcEntry {
    RawOrcEntry {
        sp_offset: 0,
        bp_offset: 0,
        flags: 1 << 10,
    }
}

/// A table of `(offset from TEXT, entry)` rows, ending with a terminator at `TEXT + 0x1000`.
pub(crate) fn text_table(rows: &[(u64, RawOrcEntry)]) -> OrcTable {
    table_at(TEXT, rows)
}

/// As [`text_table`] for text starting at `base`.
pub(crate) fn table_at(base: u64, rows: &[(u64, RawOrcEntry)]) -> OrcTable {
    let mut all: Vec<(u64, RawOrcEntry)> = rows.iter().map(|&(off, e)| (base + off, e)).collect();
    all.push((base + 0x1000, RawOrcEntry::default()));
    let (ips, entries) = encode_tables(IP_TABLE, &all).unwrap();
    OrcTable::parse_with_layout(&ips, IP_TABLE, &entries, OrcLayout::Linux4_14).unwrap()
}

/// A stack region built word by word at `base`, zero elsewhere.
#[derive(Debug, Clone)]
pub(crate) struct StackImage {
    base: u64,
    words: Vec<u64>,
}

impl StackImage {
    /// `len` zero bytes at `base`.
    pub(crate) fn new(base: u64, len: usize) -> Self {
        Self {
            base,
            words: vec![0; len / 8],
        }
    }

    /// Stores `value` at `addr`.
    pub(crate) fn put(&mut self, addr: u64, value: u64) -> &mut Self {
        let index = usize::try_from((addr - self.base) / 8).unwrap();
        self.words[index] = value;
        self
    }

    /// Stores consecutive words from `addr`.
    pub(crate) fn put_words(&mut self, addr: u64, values: &[u64]) -> &mut Self {
        for (i, &value) in (0u64..).zip(values) {
            self.put(addr + i * 8, value);
        }
        self
    }

    /// The region's bytes.
    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// The snapshot the unwinder reads.
    pub(crate) fn snapshot(&self) -> StackSnapshot {
        StackSnapshot::new(self.base, self.bytes())
    }
}

/// The cached Debian `-dbg` vmlinux, mapped, or `None` after printing why it is skipped (it
/// is absent); panics when it is there but cannot be opened or mapped.
pub(crate) fn debug_vmlinux() -> Option<memmap2::Mmap> {
    let file = debug_vmlinux_file()?;
    // SAFETY: the cache file is only ever replaced whole (written elsewhere, then renamed),
    // never modified in place, so the mapping stays valid for the test's lifetime.
    Some(unsafe { memmap2::Mmap::map(&file) }.unwrap())
}

/// The cached Debian `-dbg` vmlinux, opened, or `None` after printing why it is skipped (it
/// is absent); panics when it is there but cannot be opened.
pub(crate) fn debug_vmlinux_file() -> Option<std::fs::File> {
    let release = crate::bzimage::tests::RELEASE;
    let Some(dir) = crate::bzimage::cached_kernel_dir(release) else {
        println!("SKIP: no HOME or XDG_CACHE_HOME to find the kernel cache");
        return None;
    };
    let path = dir.join("debug").join("vmlinux");
    let file = match std::fs::File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!(
                "SKIP: {} is absent; run `exotap image fetch --debuginfo` first",
                path.display()
            );
            return None;
        }
        // Present but unreadable: a failure, not a missing cache.
        Err(e) => panic!("cannot open the cached {}: {e}", path.display()),
    };
    Some(file)
}
