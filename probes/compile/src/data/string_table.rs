//! The table of strings kernel probes build in the guest, as laid out in the compiled data
//! (see the module doc of [`super`]) and read back by the host.

use super::*;

/// The table of strings longer than 15 bytes that kernel probes build (`.`, `substr`,
/// `sprint`): open-addressed, each entry a state word (0 free, 1 being written, 2 ready,
/// 3 freed by the host's collector: a tombstone that lookups pass over and inserts reuse),
/// the text's hash, then the text, NUL-terminated, in a MAXSTRINGLEN slot. A built string's
/// 16-byte encoding is byte 0 = 2 and its entry's index at +8, so equal texts have equal
/// encodings, as the host's interned strings do; the host reads the text back from the data
/// it pulls (the table lies inside `globals_size`).
///
/// Before the entries, the table's head ([`STRING_TABLE_HEAD`] bytes, at `head`): the entries
/// in use at +0 (the guest counts the ones it claims, the collector sets it to what is left),
/// then from [`HITS`] a word per CPU ([`HIT_CPUS`] of them, [`HIT_STRIDE`] bytes apart so no
/// two share a cache line) counting the compiled hits in progress there, which the host's
/// collector reads: see [`collect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StringTable {
    /// Byte offset of the head from the data's start.
    pub head: u64,
    /// Byte offset of the first entry from the data's start.
    pub offset: u64,
    /// Entries (a power of two).
    pub entries: u32,
    /// Bytes of an entry's text slot: MAXSTRINGLEN rounded up to 16 (the NUL included).
    pub text: u64,
    /// Whether the host may collect it: not where a table index can live outside the globals
    /// and a hit in progress (see [`collect`]).
    pub collectable: bool,
}

/// Offset in the string table's head of the count of entries in use.
pub const IN_USE: u64 = 0;
/// Offset in the string table's head of the first CPU's count of hits in progress.
pub const HITS: u64 = 64;
/// CPUs with a count of hits in progress of their own (a CPU past them shares CPU
/// `cpu % HIT_CPUS`'s: the counts are updated with `lock`, so sharing costs only speed).
pub const HIT_CPUS: u32 = 128;
/// Bytes between two CPUs' counts of hits in progress (a cache line).
pub const HIT_STRIDE: u64 = 64;
/// Bytes of the string table's head.
pub const STRING_TABLE_HEAD: u64 = HITS + HIT_CPUS as u64 * HIT_STRIDE;

/// Entries of the string table: 2 MiB of texts at the default MAXSTRINGLEN. 1,024 filled
/// faster than the host could collect them: `errsnoop.stp` (a new `argstr` every syscall)
/// under the soak's workload ran out between two collections of its 5 MiB of data.
pub const STRING_ENTRIES: u32 = 4096;
/// Bytes before an entry's text (state, hash).
pub const STRING_HEAD: u64 = 16;
/// The largest MAXSTRINGLEN with which kernel probes build strings (a built string takes a
/// buffer of that size on the kernel stack while it is made, an ordering, `text_str`,
/// `strpos`, `isinstr` or `sprintf` two, `str_replace` three).
pub const MAX_BUILT_STRING: usize = 1024;

impl StringTable {
    /// Bytes of one entry.
    pub fn entry_size(&self) -> u64 {
        STRING_HEAD + self.text
    }

    /// The text of entry `index` in `data` (the data's bytes from its start), as the
    /// interpreter holds strings: invalid UTF-8 replaced.
    pub fn text_of(&self, data: &[u8], index: u64) -> Option<String> {
        if index >= u64::from(self.entries) {
            return None;
        }
        let at = self.offset + index * self.entry_size();
        let at = usize::try_from(at).ok()?;
        let text = usize::try_from(self.text).ok()?;
        let bytes = data.get(at + STRING_HEAD as usize..at + STRING_HEAD as usize + text)?;
        let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
        Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
    }

    /// Interns `text` in the table in `data` (the data's bytes from its start) as the guest
    /// would: the entry already holding it, or else the first freed entry of its chain, or
    /// the free one that ends the chain, counted in use; entries being written (a guest
    /// stopped mid-write) are passed over. `None`: no room (or a text too long for a slot).
    pub fn place(&self, data: &mut [u8], text: &str) -> Option<u64> {
        let bytes = text.as_bytes();
        if bytes.len() as u64 >= self.text || bytes.contains(&0) {
            return None;
        }
        let hash = Self::hash(bytes);
        let mask = u64::from(self.entries - 1);
        let mut freed = None;
        let mut free = None;
        for step in 0..u64::from(MAX_PROBES.min(self.entries)) {
            let index = hash.wrapping_add(step) & mask;
            let entry = self.entry(data, index)?;
            let state = word(entry, 0);
            let slot = &entry[STRING_HEAD as usize..];
            let same = word(entry, 8) == hash
                && slot.get(..bytes.len()) == Some(bytes)
                && slot.get(bytes.len()) == Some(&0);
            match state {
                2 if same => return Some(index),
                3 => {
                    freed.get_or_insert(index);
                }
                0 => {
                    free = Some(index);
                    break;
                }
                _ => {}
            }
        }
        let index = freed.or(free)?;
        let entry = self.entry(data, index)?;
        entry[..8].copy_from_slice(&2u64.to_le_bytes());
        entry[8..16].copy_from_slice(&hash.to_le_bytes());
        let text = &mut entry[STRING_HEAD as usize..];
        text.fill(0);
        text[..bytes.len()].copy_from_slice(bytes);
        let in_use = usize::try_from(self.head + IN_USE).ok()?;
        let count = word(data, self.head + IN_USE).saturating_add(1);
        data.get_mut(in_use..in_use + 8)?
            .copy_from_slice(&count.to_le_bytes());
        Some(index)
    }

    /// The bytes of entry `index` in `data` (`None` past the data).
    fn entry<'d>(&self, data: &'d mut [u8], index: u64) -> Option<&'d mut [u8]> {
        let at = usize::try_from(self.offset + index * self.entry_size()).ok()?;
        data.get_mut(at..at + self.entry_size() as usize)
    }

    /// The hash of a text, as the guest computes it (FNV-1a over its bytes).
    pub fn hash(text: &[u8]) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in text {
            h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
        h
    }
}
