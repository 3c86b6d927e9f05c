//! Every kernel symbol, recovered from the kallsyms tables in a stripped vmlinux's `.rodata`.
//!
//! `scripts/kallsyms.c` (base-relative) emits, each table 8-byte aligned, in this order up to
//! Linux 6.3: `kallsyms_offsets` (s32 per symbol), `kallsyms_relative_base` (u64),
//! `kallsyms_num_syms`, `kallsyms_names` (length-prefixed, token-compressed; the first
//! expanded character is the type), `kallsyms_markers` (u32 per 256 names),
//! `kallsyms_seqs_of_names` (3 bytes per symbol; 6.2+, backported to late 6.1.y),
//! `kallsyms_token_table` (256 NUL-terminated tokens), `kallsyms_token_index` (256 u16).
//! From 6.4 the offsets and relative base follow the token index instead.
//!
//! Nothing is labelled, so the tables are found the way vmlinux-to-elf does: the token table
//! through its run of single-digit tokens `"0\0 1\0 … 9\0"`, confirmed by the token index
//! that follows it, then walking backwards. Every step is cross-checked (token index,
//! markers against the names, symbol count, sorted addresses inside the image) so a false
//! match gives an error, never wrong symbols.

use crate::bzimage::{ImageError, Vmlinux};
use crate::symbols::KERNEL_MAP_BASE;

/// Why the kallsyms tables could not be recovered.
#[derive(Debug, thiserror::Error)]
pub enum KallsymsError {
    /// The image has no `.rodata` to search.
    #[error("the vmlinux has no readable .rodata section")]
    NoRodata(#[source] ImageError),
    /// No run of digit tokens confirmed by a token index.
    #[error(
        "no kallsyms token table in .rodata ({candidates} digit runs looked at, none followed by \
         a matching token index): the kernel was built without CONFIG_KALLSYMS or with an \
         unknown layout"
    )]
    NoTokenTable {
        /// How many `"0\0…9\0"` runs were tried.
        candidates: usize,
    },
    /// A token table was found, but no markers/names/count before it fit together.
    #[error(
        "found the kallsyms token table at {token_table:#x}, but no markers, names and symbol \
         count before it agree with each other"
    )]
    NoNames {
        /// Link-time address of the token table.
        token_table: u64,
    },
    /// Names and markers were found, but no offsets decode to sorted addresses in the image.
    #[error(
        "found {num_syms} kallsyms names at {names:#x}, but no kallsyms_offsets table decodes to \
         sorted addresses inside the image"
    )]
    NoOffsets {
        /// Link-time address of the names.
        names: u64,
        /// The symbol count.
        num_syms: usize,
    },
}

/// One symbol as kallsyms records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KallsymsSymbol {
    /// Its name.
    pub name: String,
    /// Link-time address (per-CPU symbols: offset inside the per-CPU area).
    pub addr: u64,
    /// `nm`-style type character (`T`, `t`, `D`, `r`, ...).
    pub kind: char,
}

/// Where each table was found (link-time addresses) and how offsets decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KallsymsLayout {
    /// `kallsyms_offsets`.
    pub offsets: u64,
    /// `kallsyms_relative_base`'s address.
    pub relative_base_addr: u64,
    /// Its value.
    pub relative_base: u64,
    /// `kallsyms_num_syms`'s address.
    pub num_syms_addr: u64,
    /// `kallsyms_names`.
    pub names: u64,
    /// `kallsyms_markers`.
    pub markers: u64,
    /// `kallsyms_seqs_of_names`, when the kernel has it.
    pub seqs_of_names: Option<u64>,
    /// `kallsyms_token_table`.
    pub token_table: u64,
    /// `kallsyms_token_index`.
    pub token_index: u64,
    /// Symbol count.
    pub num_syms: usize,
    /// CONFIG_KALLSYMS_ABSOLUTE_PERCPU: non-negative offsets are absolute addresses.
    pub absolute_percpu: bool,
}

/// The recovered symbols, in kallsyms order (sorted by address).
#[derive(Debug, Clone)]
pub struct Kallsyms {
    /// Where the tables are.
    pub layout: KallsymsLayout,
    /// The symbols.
    pub symbols: Vec<KallsymsSymbol>,
}

/// Recovers every symbol of a vmlinux from its kallsyms tables.
///
/// # Errors
/// [`KallsymsError::NoRodata`], then the first step that fails: [`KallsymsError::NoTokenTable`],
/// [`KallsymsError::NoNames`], [`KallsymsError::NoOffsets`].
pub fn extract(vmlinux: &Vmlinux) -> Result<Kallsyms, KallsymsError> {
    let rodata = vmlinux.section(".rodata").map(|s| s.addr);
    let data = vmlinux
        .section_data(".rodata")
        .map_err(KallsymsError::NoRodata)?;
    // The image's sections leave gaps that linker-script symbols (`__end_rodata`, ...) point
    // into, so the image counts as one range; per-CPU sections are linked at 0.
    let ranges = vmlinux
        .sections()
        .iter()
        .filter(|s| s.size > 0)
        .map(|s| (s.addr, s.addr.saturating_add(s.size)));
    let (image, low): (Vec<_>, Vec<_>) = ranges.partition(|(start, _)| *start >= KERNEL_MAP_BASE);
    let hull = image
        .iter()
        .map(|r| r.0)
        .min()
        .zip(image.iter().map(|r| r.1).max());
    let valid: Vec<(u64, u64)> = hull.into_iter().chain(low).collect();
    extract_from(data, rodata.unwrap_or(0), &valid)
}

/// Recovers symbols from `data` (a copy of `.rodata` linked at `base`); `valid` lists the
/// `[start, end]` address ranges (inclusive end) a decoded symbol may have.
///
/// # Errors
/// As [`extract`].
pub fn extract_from(
    data: &[u8],
    base: u64,
    valid: &[(u64, u64)],
) -> Result<Kallsyms, KallsymsError> {
    let view = View { data, base };
    let mut candidates = 0;
    let mut found_table = None;
    for digit_run in find_all(data, DIGIT_TOKENS) {
        candidates += 1;
        let Some(tokens) = view.token_table_around(digit_run) else {
            continue;
        };
        found_table = Some(tokens.start);
        let Some(names) = view.names_before(&tokens) else {
            continue;
        };
        let Some((layout, offsets)) = view.offsets_for(&tokens, &names, valid) else {
            return Err(KallsymsError::NoOffsets {
                names: view.addr(names.start),
                num_syms: names.count,
            });
        };
        let symbols = view.decode(&tokens, &names, offsets, &layout);
        return Ok(Kallsyms { layout, symbols });
    }
    match found_table {
        Some(start) => Err(KallsymsError::NoNames {
            token_table: view.addr(start),
        }),
        None => Err(KallsymsError::NoTokenTable { candidates }),
    }
}

/// Tokens 0x30..=0x39 of every real token table: digits occur in symbol names, so each is
/// kept as a single-character token.
const DIGIT_TOKENS: &[u8] = b"0\x001\x002\x003\x004\x005\x006\x007\x008\x009\x00";
/// Upper bound on the symbol count; real kernels have ~10^5.
const MAX_SYMS: usize = 1 << 22;
/// Longest compressed name: the two-byte length prefix's maximum.
const MAX_NAME: usize = 0x3fff;

/// A validated token table.
struct Tokens {
    start: usize,
    /// (offset, length) of each of the 256 tokens.
    spans: Vec<(usize, usize)>,
    index: usize,
    index_end: usize,
}

/// Validated names and markers.
struct Names {
    num_syms_at: usize,
    start: usize,
    count: usize,
    markers: usize,
    seqs: Option<usize>,
}

/// `.rodata` bytes with their link-time base, for address-aligned reads.
struct View<'a> {
    data: &'a [u8],
    base: u64,
}

impl View<'_> {
    fn addr(&self, pos: usize) -> u64 {
        self.base.wrapping_add(pos as u64)
    }

    /// `pos` rounded down so its link-time address is a multiple of `align` (a power of two).
    fn align_down(&self, pos: usize, align: u64) -> usize {
        pos - (self.addr(pos) & (align - 1)) as usize
    }

    /// `pos` rounded up so its link-time address is 8-byte aligned.
    fn align8(&self, pos: usize) -> Option<usize> {
        let misalign = (self.addr(pos) & 7) as usize;
        pos.checked_add((8 - misalign) & 7)
    }

    fn u16_at(&self, pos: usize) -> Option<u16> {
        let bytes = self.data.get(pos..pos.checked_add(2)?)?;
        Some(u16::from_le_bytes([bytes[0], bytes[1]]))
    }

    fn u32_at(&self, pos: usize) -> Option<u32> {
        let bytes = self.data.get(pos..pos.checked_add(4)?)?;
        Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    fn u64_at(&self, pos: usize) -> Option<u64> {
        let bytes = self.data.get(pos..pos.checked_add(8)?)?;
        let mut le = [0u8; 8];
        le.copy_from_slice(bytes);
        Some(u64::from_le_bytes(le))
    }

    /// The token table containing a digit run at `digit_run` (token 0x30), if the 256 u16
    /// token index after it describes exactly those tokens.
    fn token_table_around(&self, digit_run: usize) -> Option<Tokens> {
        // Tokens are never empty, so stepping back over 0x30 NUL-terminated strings is exact.
        let mut start = digit_run;
        for _ in 0..0x30 {
            let prev_nul = start.checked_sub(1)?;
            let token_start = self.data[..prev_nul].iter().rposition(|b| *b == 0)? + 1;
            if token_start == prev_nul {
                return None;
            }
            start = token_start;
        }
        let mut spans = Vec::with_capacity(256);
        let mut pos = start;
        for _ in 0..256 {
            let len = self.data.get(pos..)?.iter().position(|b| *b == 0)?;
            if len == 0 {
                return None;
            }
            spans.push((pos - start, len));
            pos = pos.checked_add(len + 1)?;
        }
        let index = self.align8(pos)?;
        let consistent = spans.iter().enumerate().all(|(i, (offset, _))| {
            self.u16_at(index + 2 * i)
                .is_some_and(|v| usize::from(v) == *offset)
        });
        consistent.then_some(Tokens {
            start,
            spans,
            index,
            index_end: index + 512,
        })
    }

    /// Finds markers, names and the symbol count before the token table, with or without
    /// `kallsyms_seqs_of_names` between the markers and the tokens.
    fn names_before(&self, tokens: &Tokens) -> Option<Names> {
        let mut pos = self.align_down(tokens.start.checked_sub(4)?, 4);
        loop {
            if self.u32_at(pos) == Some(0) {
                if let Some(names) = self.names_with_markers_at(pos, tokens.start) {
                    return Some(names);
                }
            }
            pos = pos.checked_sub(4)?;
        }
    }

    /// Tries `markers` as the start of `kallsyms_markers` (its first entry is 0). The
    /// increasing run may continue into the bytes after the real table, so every prefix of
    /// it is a candidate.
    fn names_with_markers_at(&self, markers: usize, token_table: usize) -> Option<Names> {
        let mut values = vec![0u32];
        let mut end = markers + 4;
        while let Some(v) = self.u32_at(end).filter(|v| *v > values[values.len() - 1]) {
            values.push(v);
            end += 4;
        }
        (1..=values.len().min(MAX_SYMS / 256))
            .rev()
            .find_map(|groups| self.names_with_markers(markers, &values[..groups], token_table))
    }

    /// Tries `markers` as `kallsyms_markers` holding exactly `values`.
    fn names_with_markers(
        &self,
        markers: usize,
        values: &[u32],
        token_table: usize,
    ) -> Option<Names> {
        let groups = values.len();
        let lowest = (groups - 1) * 256 + 1;
        let highest = groups * 256;
        let markers_end = self.align8(markers + 4 * groups)?;
        let gap = token_table.checked_sub(markers_end)?;
        let (counts, seqs) = if gap == 0 {
            (lowest..=highest, None)
        } else {
            // kallsyms_seqs_of_names: 3 bytes per symbol, then padding to 8.
            let fewest = gap.saturating_sub(7).div_ceil(3).max(lowest);
            let most = (gap / 3).min(highest);
            (fewest..=most, Some(markers_end))
        };
        if counts.is_empty() {
            return None;
        }
        let last_marker = usize::try_from(values[groups - 1]).ok()?;
        let newest = markers.checked_sub(last_marker)?.checked_sub(8)?;
        let oldest = newest.saturating_sub(256 * (MAX_NAME + 2));
        let mut at = self.align_down(newest, 8);
        while at >= oldest {
            let count = self.u32_at(at).map_or(0, |v| v as usize);
            if counts.contains(&count)
                && seqs.is_none_or(|_| (3 * count + 7) & !7 == gap)
                && self.u32_at(at + 4) == Some(0)
                && self.names_match_markers(at + 8, count, values, markers)
                && seqs.is_none_or(|s| self.seqs_valid(s, count))
            {
                return Some(Names {
                    num_syms_at: at,
                    start: at + 8,
                    count,
                    markers,
                    seqs,
                });
            }
            at = at.checked_sub(8)?;
        }
        None
    }

    /// Whether `count` names from `start` hit every marker and end just before `markers`.
    fn names_match_markers(&self, start: usize, count: usize, markers: &[u32], end: usize) -> bool {
        let mut pos = start;
        for i in 0..count {
            if i % 256 == 0 && markers.get(i / 256).map(|m| *m as usize) != Some(pos - start) {
                return false;
            }
            match self.name_span(pos) {
                Some((data, len)) => pos = data + len,
                None => return false,
            }
        }
        self.align8(pos) == Some(end)
    }

    /// (start of the compressed bytes, their length) of the name at `pos`. Lengths of 128
    /// and more take two bytes (ULEB128), since Linux 6.1.
    fn name_span(&self, pos: usize) -> Option<(usize, usize)> {
        let first = *self.data.get(pos)?;
        let (data, len) = if first & 0x80 == 0 {
            (pos + 1, usize::from(first))
        } else {
            let second = *self.data.get(pos + 1)?;
            (
                pos + 2,
                usize::from(first & 0x7f) | (usize::from(second) << 7),
            )
        };
        (len > 0 && data.checked_add(len)? <= self.data.len()).then_some((data, len))
    }

    fn seqs_valid(&self, seqs: usize, count: usize) -> bool {
        self.data.get(seqs..seqs + 3 * count).is_some_and(|bytes| {
            bytes.chunks_exact(3).all(|s| {
                let seq = usize::from(s[0]) << 16 | usize::from(s[1]) << 8 | usize::from(s[2]);
                seq < count
            })
        })
    }

    /// Finds `kallsyms_offsets` and the relative base: before the count (up to 6.3) or after
    /// the token index (6.4+), keeping the one whose addresses are sorted and in the image.
    fn offsets_for(
        &self,
        tokens: &Tokens,
        names: &Names,
        valid: &[(u64, u64)],
    ) -> Option<(KallsymsLayout, usize)> {
        let table_len = (4 * names.count + 7) & !7;
        let before = names.num_syms_at.checked_sub(8).and_then(|base_at| {
            base_at
                .checked_sub(table_len)
                .map(|offsets| (offsets, base_at))
        });
        let after = self.align8(tokens.index_end).and_then(|offsets| {
            offsets
                .checked_add(table_len)
                .map(|base_at| (offsets, base_at))
        });
        [before, after]
            .into_iter()
            .flatten()
            .find_map(|(offsets, base_at)| {
                let relative_base = self.u64_at(base_at)?;
                let raw = self.data.get(offsets..offsets + 4 * names.count)?;
                let absolute_percpu = raw.chunks_exact(4).any(|b| b[3] & 0x80 != 0);
                let layout = KallsymsLayout {
                    offsets: self.addr(offsets),
                    relative_base_addr: self.addr(base_at),
                    relative_base,
                    num_syms_addr: self.addr(names.num_syms_at),
                    names: self.addr(names.start),
                    markers: self.addr(names.markers),
                    seqs_of_names: names.seqs.map(|s| self.addr(s)),
                    token_table: self.addr(tokens.start),
                    token_index: self.addr(tokens.index),
                    num_syms: names.count,
                    absolute_percpu,
                };
                addresses_plausible(&layout, raw, valid).then_some((layout, offsets))
            })
    }

    fn decode(
        &self,
        tokens: &Tokens,
        names: &Names,
        offsets: usize,
        layout: &KallsymsLayout,
    ) -> Vec<KallsymsSymbol> {
        let raw = self.data.get(offsets..).unwrap_or(&[]);
        let mut symbols = Vec::with_capacity(names.count);
        let mut pos = names.start;
        let mut expanded = Vec::with_capacity(64);
        for i in 0..names.count {
            let Some((data, len)) = self.name_span(pos) else {
                break;
            };
            pos = data + len;
            expanded.clear();
            for code in &self.data[data..data + len] {
                let (offset, token_len) = tokens.spans[usize::from(*code)];
                let token_at = tokens.start + offset;
                expanded.extend_from_slice(&self.data[token_at..token_at + token_len]);
            }
            let kind = expanded.first().map_or('?', |b| char::from(*b));
            let name = String::from_utf8_lossy(expanded.get(1..).unwrap_or(&[])).into_owned();
            let offset = raw
                .get(4 * i..4 * i + 4)
                .map_or(0, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            symbols.push(KallsymsSymbol {
                name,
                addr: symbol_address(layout, offset),
                kind,
            });
        }
        symbols
    }
}

/// Decodes one `kallsyms_offsets` entry as `kallsyms_sym_address()` does.
pub fn symbol_address(layout: &KallsymsLayout, offset: i32) -> u64 {
    if !layout.absolute_percpu {
        return layout.relative_base.wrapping_add(u64::from(offset as u32));
    }
    if offset >= 0 {
        offset as u64
    } else {
        // -1 - offset is in 0..=i32::MAX for a negative offset.
        layout
            .relative_base
            .wrapping_sub(1)
            .wrapping_sub(i64::from(offset) as u64)
    }
}

/// Addresses must be sorted and each inside some section of the image.
fn addresses_plausible(layout: &KallsymsLayout, raw: &[u8], valid: &[(u64, u64)]) -> bool {
    let inside = |addr: u64| {
        valid
            .iter()
            .any(|(start, end)| (*start..=*end).contains(&addr))
    };
    if !inside(layout.relative_base) {
        return false;
    }
    let mut previous = 0u64;
    raw.chunks_exact(4).all(|b| {
        let addr = symbol_address(layout, i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let sorted = addr >= previous;
        previous = addr;
        sorted && inside(addr)
    })
}

/// Start offsets of every occurrence of `needle` in `haystack`.
fn find_all<'a>(haystack: &'a [u8], needle: &'a [u8]) -> impl Iterator<Item = usize> + 'a {
    let first = needle.first().copied().unwrap_or(0);
    haystack
        .iter()
        .enumerate()
        .filter(move |(_, b)| **b == first)
        .map(|(i, _)| i)
        .filter(move |i| haystack[*i..].starts_with(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0xffff_ffff_8200_0000;
    const TEXT: u64 = 0xffff_ffff_8100_0000;
    const VALID: [(u64, u64); 2] = [(0, 0x4_0000), (TEXT, TEXT + 0x100_0000)];

    /// Which kallsyms.c the synthetic tables imitate.
    #[derive(Clone, Copy)]
    enum Generation {
        /// 6.1: offsets first, no kallsyms_seqs_of_names.
        Linux61,
        /// 6.2 and late 6.1.y: kallsyms_seqs_of_names between markers and tokens.
        WithSeqs,
        /// 6.4+: offsets and relative base after the token index.
        Linux64,
    }

    fn pad8(out: &mut Vec<u8>) {
        out.resize(out.len().next_multiple_of(8), 0);
    }

    /// Every code expands to itself when printable, to a 3-character token otherwise.
    fn token(code: usize) -> Vec<u8> {
        if (0x21..0x7f).contains(&code) {
            vec![code as u8]
        } else {
            format!("~{code:02x}").into_bytes()
        }
    }

    fn sample_symbols() -> Vec<KallsymsSymbol> {
        let mut symbols: Vec<KallsymsSymbol> = (0..3u64)
            .map(|i| KallsymsSymbol {
                name: format!("percpu_{i}"),
                addr: i * 0x40,
                kind: 'D',
            })
            .collect();
        symbols.push(KallsymsSymbol {
            name: "x".repeat(200),
            addr: TEXT,
            kind: 'T',
        });
        symbols.extend((1..600u64).map(|i| KallsymsSymbol {
            name: format!("sym_{i}"),
            addr: TEXT + i * 16,
            kind: if i % 2 == 0 { 't' } else { 'T' },
        }));
        symbols
    }

    /// Builds a `.rodata` image with kallsyms tables for `symbols` (sorted, absolute per-CPU).
    fn build(symbols: &[KallsymsSymbol], generation: Generation) -> Vec<u8> {
        let mut out = b"junk before 0\x001\x002\x003\x004\x005\x006\x007\x008\x009\x00".to_vec();
        pad8(&mut out);
        let mut offsets = Vec::new();
        for sym in symbols {
            let off = if sym.addr < TEXT {
                sym.addr as i32
            } else {
                TEXT.wrapping_sub(1).wrapping_sub(sym.addr) as i64 as i32
            };
            offsets.extend_from_slice(&off.to_le_bytes());
        }
        pad8(&mut offsets);
        let mut offsets_and_base = offsets;
        offsets_and_base.extend_from_slice(&TEXT.to_le_bytes());
        if !matches!(generation, Generation::Linux64) {
            out.extend_from_slice(&offsets_and_base);
        }
        out.extend_from_slice(&u64::try_from(symbols.len()).unwrap().to_le_bytes());
        let mut names = Vec::new();
        let mut markers = Vec::new();
        for (i, sym) in symbols.iter().enumerate() {
            if i % 256 == 0 {
                markers.extend_from_slice(&u32::try_from(names.len()).unwrap().to_le_bytes());
            }
            let len = sym.name.len() + 1;
            if len < 0x80 {
                names.push(len as u8);
            } else {
                names.extend_from_slice(&[(len & 0x7f) as u8 | 0x80, (len >> 7) as u8]);
            }
            names.push(sym.kind as u8);
            names.extend_from_slice(sym.name.as_bytes());
        }
        out.extend_from_slice(&names);
        pad8(&mut out);
        out.extend_from_slice(&markers);
        pad8(&mut out);
        if matches!(generation, Generation::WithSeqs) {
            for seq in (0..symbols.len()).rev() {
                out.extend_from_slice(&[(seq >> 16) as u8, (seq >> 8) as u8, seq as u8]);
            }
            pad8(&mut out);
        }
        let mut index = Vec::new();
        let table_start = out.len();
        for code in 0..256 {
            index.extend_from_slice(
                &u16::try_from(out.len() - table_start)
                    .unwrap()
                    .to_le_bytes(),
            );
            out.extend_from_slice(&token(code));
            out.push(0);
        }
        pad8(&mut out);
        out.extend_from_slice(&index);
        if matches!(generation, Generation::Linux64) {
            out.extend_from_slice(&offsets_and_base);
        }
        out.extend_from_slice(b"junk after");
        out
    }

    #[test]
    fn extract_from_recovers_every_symbol_of_6_1_layout() {
        let symbols = sample_symbols();
        let data = build(&symbols, Generation::Linux61);

        let kallsyms = extract_from(&data, BASE, &VALID).unwrap();

        assert_eq!(kallsyms.symbols, symbols);
        assert!(kallsyms.layout.absolute_percpu);
        assert_eq!(kallsyms.layout.seqs_of_names, None);
        assert_eq!(kallsyms.layout.relative_base, TEXT);
    }

    #[test]
    fn extract_from_skips_seqs_of_names() {
        let symbols = sample_symbols();
        let data = build(&symbols, Generation::WithSeqs);

        let kallsyms = extract_from(&data, BASE, &VALID).unwrap();

        assert_eq!(kallsyms.symbols, symbols);
        assert!(kallsyms.layout.seqs_of_names.is_some());
    }

    #[test]
    fn extract_from_finds_offsets_after_token_index_in_6_4_layout() {
        let symbols = sample_symbols();
        let data = build(&symbols, Generation::Linux64);

        let kallsyms = extract_from(&data, BASE, &VALID).unwrap();

        assert_eq!(kallsyms.symbols, symbols);
        assert!(kallsyms.layout.offsets > kallsyms.layout.token_index);
    }

    #[test]
    fn extract_from_reports_missing_token_table() {
        let data = vec![0u8; 4096];

        let err = extract_from(&data, BASE, &VALID).unwrap_err();

        assert!(matches!(err, KallsymsError::NoTokenTable { candidates: 0 }));
    }

    #[test]
    fn extract_from_refuses_inconsistent_markers() {
        let symbols = sample_symbols();
        let mut data = build(&symbols, Generation::Linux61);
        let second_marker = markers_offset(&data) + 4;
        data[second_marker] ^= 1;

        let err = extract_from(&data, BASE, &VALID).unwrap_err();

        assert!(matches!(err, KallsymsError::NoNames { .. }));
    }

    #[test]
    fn extract_from_refuses_addresses_outside_image() {
        let data = build(&sample_symbols(), Generation::Linux61);

        let err = extract_from(&data, BASE, &[(0, 0x4_0000)]).unwrap_err();

        assert!(matches!(
            err,
            KallsymsError::NoOffsets { num_syms: 603, .. }
        ));
    }

    #[test]
    fn symbol_address_decodes_absolute_percpu_and_relative_offsets() {
        let layout = extract_from(&build(&sample_symbols(), Generation::Linux61), BASE, &VALID)
            .unwrap()
            .layout;
        let relative = KallsymsLayout {
            absolute_percpu: false,
            ..layout
        };

        assert_eq!(symbol_address(&layout, 0x40), 0x40);
        assert_eq!(symbol_address(&layout, -1), TEXT);
        assert_eq!(symbol_address(&relative, 0x40), TEXT + 0x40);
    }

    /// Offset of `kallsyms_markers` in an intact synthetic image.
    fn markers_offset(data: &[u8]) -> usize {
        let layout = extract_from(data, BASE, &VALID).unwrap().layout;
        usize::try_from(layout.markers - BASE).unwrap()
    }

    #[test]
    fn real_image_kallsyms_has_the_kernel_symbols() {
        let Some(vmlinux) = crate::bzimage::tests::real_vmlinux() else {
            return;
        };

        let started = std::time::Instant::now();
        let kallsyms = extract(&vmlinux).unwrap();
        let elapsed = started.elapsed();

        println!(
            "kallsyms: {} symbols in {elapsed:?} (layout {:x?})",
            kallsyms.symbols.len(),
            kallsyms.layout
        );
        assert!(kallsyms.symbols.len() >= 40_000);
        let find = |name: &str| {
            kallsyms
                .symbols
                .iter()
                .find(|s| s.name == name)
                .unwrap_or_else(|| panic!("{name}"))
        };
        for name in [
            "vfs_read",
            "__x64_sys_getpid",
            "entry_SYSCALL_64",
            "_end",
            "init_task",
        ] {
            find(name);
        }
        let text = find("_text");
        assert_eq!(text.addr, vmlinux.text_range().unwrap().0);
        let banner = find("linux_banner");
        assert!(vmlinux
            .read_at(banner.addr, 13)
            .unwrap()
            .starts_with(b"Linux version"));
        let vfs_read = find("vfs_read");
        assert_eq!(vfs_read.kind, 'T');
        let call = vmlinux.read_at(vfs_read.addr, 5).unwrap();
        assert_eq!(call[0], 0xe8, "vfs_read starts with {call:02x?}");
        let rel32 = i32::from_le_bytes([call[1], call[2], call[3], call[4]]);
        let target = (vfs_read.addr + 5).wrapping_add_signed(i64::from(rel32));
        assert_eq!(target, find("__fentry__").addr);
    }

    #[test]
    fn mutated_tables_give_errors_or_symbols_never_panics() {
        use crate::mutation::{mutate_bytes, XorShift};

        let symbols = sample_symbols();
        let tables = [
            build(&symbols, Generation::Linux61),
            build(&symbols, Generation::WithSeqs),
            build(&symbols, Generation::Linux64),
        ];
        let mut rng = XorShift(0xdaba_0b0b_cafe_f00d);
        let mut recovered = 0;
        for case in 0..3000 {
            let mut data = tables[case % 3].clone();
            mutate_bytes(&mut rng, &mut data);

            let result = extract_from(&data, BASE, &VALID);

            recovered += usize::from(result.is_ok());
        }

        // Mutations that miss the tables (junk, name characters) leave them readable.
        assert!(recovered > 0);
    }
}
