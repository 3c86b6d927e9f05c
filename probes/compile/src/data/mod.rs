//! The compiled script's data in the patch heap, and the host's view of it.
//!
//! ```text
//! +0    header (128 bytes): magic "EXOTAPC1", exit flag, probe errors, division-by-zero
//!       errors, MAXACTION errors, dropped updates (every table's sum), kernel read faults,
//!       array overflows, reads of empty aggregates, calls past MAXNESTING, `error()`s,
//!       built strings with no room in the string table, string function arguments out
//!       of range, `backtrace()` calls that found the unwinder busy, the per-CPU unwinder
//!       guard bits
//! +128  globals, each 64-byte aligned, in declaration order:
//!       long scalar     8 bytes
//!       string scalar   16 bytes (see below)
//!       stats scalar    count, sum, min, max, then the log2 and linear buckets (8 bytes each),
//!                       then for `@variance` a lock word, the count, the shifted running
//!                       average and the squared differences (Welford, as the interpreter)
//!       array           64-byte table header (dropped updates at +0, the next insertion
//!                       number at +8, the element count at +16), then `capacity` entries: state (0 free, 1 being
//!                       written, 2 ready), insertion number, the keys (16 bytes each), the
//!                       value (as a scalar of its type)
//!       string table    when kernel probes build strings (see [`StringTable`]): its head
//!                       (entries in use, a count of compiled hits in progress per CPU),
//!                       then entries of a state word, a hash and a MAXSTRINGLEN text slot,
//!                       which the host collects ([`collect`])
//!       matchers        one per distinct `=~` pattern of kernel probes, 64-byte aligned:
//!                       the host-built table the guest walks (see [`super::regex`]);
//!                       constant, written with the initial bytes
//! ```
//!
//! After the globals, when kernel probes print: per vCPU, a ring of output records
//! (exotap_probes_base::rings: the protocol `exotap trace` uses too) of [`RECORD`] bytes, or more when a
//! `printf` prints strings read from memory (the next power of two that holds the largest
//! one, the ring keeping about the same bytes). A record holds its mark at +0 (the lap tag,
//! then the TSC with the tag in bit 0, stored last: exotap_probes_base::rings), the output format's id at
//! +8 and up to [`MAX_PRINT_ARGS`] arguments from +16, each as its format's [`ArgSlot`] says:
//! 16 bytes for a long or a string, MAXSTRINGLEN bytes (rounded up to 16, NUL-terminated) for
//! a string read from memory. The host drains the rings at every look (through the shared RAM
//! while the vCPUs run where it has it, else with the guest stopped) and prints the records
//! in TSC order across vCPUs; a burst of more than a ring between two looks overwrites the
//! oldest records, which the host counts as lost.
//!
//! Strings are 16 bytes: up to 15 bytes of text inline, NUL-padded (what `task_struct.comm`
//! holds, so `execname()` is two loads), or, for longer text the host knows (function names,
//! probe points, long literals), byte 0 = 1 and an id into the host's [`Interner`] at +8,
//! or, for longer text built in the guest, byte 0 = 2 and its entry in the string table at
//! +8 (where a script builds strings, its long constants are interned there too).
//! Equal strings have equal encodings, so the guest compares and hashes keys as bytes.
//!
//! Tables are open-addressed with linear probing over at most [`MAX_PROBES`] slots. A guest
//! claims a free slot with `lock cmpxchg` (state 0 → 1), writes the key and the initial value,
//! then publishes it (state 2; x86 stores are not reordered with older stores). A reader that
//! meets a slot being written spins a bounded number of times, then drops its update (and
//! counts it): a writer interrupted on its own CPU by the same probe can never deadlock it.
//! The element count in the header bounds an array to its size (MAXMAPENTRIES or `global
//! a[N]`): one insert more is an array overflow, as in the interpreter. A deleted element
//! keeps its slot (state 3) so probe chains stay whole; an insert of the same key revives it,
//! and an insert of a key found absent takes the chain's first deleted slot (so a wrapping
//! array, `a%`, does not fill its table with them).
//! Values are updated with `lock` instructions, so concurrent vCPUs give exact results.
//! The insertion number gives the host the order the interpreter keeps (`foreach` without a
//! sort walks an array in insertion order).

use indexmap::IndexMap;

use exotap_lang::ast::{HistKind, Literal};
use exotap_lang::check::{Program, Shape, Ty};
use exotap_lang::eval::Store;
use exotap_lang::value::{linear_buckets, truncate, Stats, Value, LOG_BUCKETS};
use exotap_lang::Limits;
use exotap_probes_base::rings::{RingSet, HEADER as RING_HEADER};

use super::Unsupported;

pub mod collect;
mod interner;
mod string_table;
mod writes;
pub use interner::{hash_key, Interner};
pub use string_table::{
    StringTable, HITS, HIT_CPUS, HIT_STRIDE, IN_USE, MAX_BUILT_STRING, STRING_ENTRIES, STRING_HEAD,
    STRING_TABLE_HEAD,
};
pub use writes::key_words;

/// "EXOTAPC1": the signature at the start of a compiled script's data.
pub const MAGIC: u64 = u64::from_le_bytes(*b"EXOTAPC1");
/// Bytes of the header.
pub const HEADER: u64 = 128;
/// Header fields (byte offsets).
pub mod field {
    /// Set to 1 by `exit()`.
    pub const EXIT: u64 = 8;
    /// Probe errors of any kind.
    pub const ERRORS: u64 = 16;
    /// Divisions (or remainders) by zero.
    pub const DIV_ZERO: u64 = 24;
    /// Hits that ran past MAXACTION statements.
    pub const MAXACTION: u64 = 32;
    /// Updates dropped because a table was full or a slot stayed busy, and lookups that
    /// gave up on a slot that stayed busy (they answer "absent").
    pub const DROPPED: u64 = 40;
    /// Reads of guest memory that faulted (`kernel_long` and friends, a member chain, a string).
    pub const FAULTS: u64 = 48;
    /// Inserts into an array that held its most elements (MAXMAPENTRIES or `global a[N]`).
    pub const OVERFLOW: u64 = 56;
    /// `@min`, `@max` or `@avg` of an aggregate with no values.
    pub const EMPTY: u64 = 64;
    /// Calls of user functions past MAXNESTING.
    pub const NESTING: u64 = 72;
    /// `error()` outside `try`.
    pub const RAISED: u64 = 80;
    /// Strings built in the guest that the string table had no room for (or a string the
    /// guest cannot read the text of): each ends its hit with a probe error.
    pub const STRINGS: u64 = 88;
    /// Arguments of string functions out of their range (`stringat`'s index past the
    /// string, `strtol`'s base outside 2..=36): each ends its hit with a probe error.
    pub const ARGUMENTS: u64 = 96;
    /// `backtrace()` and `symname()` calls that found the kernel's unwinder or symbol lookup
    /// already busy on their CPU (a probe on a function they run, or one in an NMI that came
    /// in during one): each gives an empty stack or the bare address, not a probe error.
    pub const STACKS_BUSY: u64 = 104;
    /// One bit per CPU (128 of them, two words): set while that CPU's compiled code runs
    /// the kernel's unwinder for `backtrace()`.
    pub const STACK_GUARD: u64 = 112;
}
/// CPUs [`field::STACK_GUARD`] has a bit for.
pub const STACK_GUARD_CPUS: u32 = 128;
/// Most keys of one array.
pub const MAX_KEYS: usize = 5;
/// Bytes per key.
pub const KEY: u64 = 16;
/// Most slots one lookup probes.
pub const MAX_PROBES: u32 = 64;
/// Table header bytes.
pub const TABLE_HEADER: u64 = 64;
/// Offset of the insertion counter in a table's header.
pub const TABLE_SEQUENCE: u64 = 8;
/// Offset of the element count in a table's header.
pub const TABLE_COUNT: u64 = 16;
/// Offset of the keys in a table entry (after its state and insertion number).
pub const ENTRY_KEYS: u64 = 16;
/// Bytes of a statistics value before its buckets.
pub const STATS_FIXED: u64 = 32;
/// Bytes of one output record.
pub const RECORD: u64 = 128;
/// Most arguments of one compiled `printf`/`print` (SystemTap's MAXPRINTARGS; the record
/// grows with them, up to [`MAX_RECORD`]).
pub const MAX_PRINT_ARGS: usize = 32;
/// Records per vCPU ring (of [`RECORD`] bytes; larger records get fewer, at least
/// [`MIN_RING_SLOTS`]).
pub const RING_SLOTS: u32 = 2048;
/// Fewest records per vCPU ring.
pub const MIN_RING_SLOTS: u32 = 512;
/// Largest output record.
pub const MAX_RECORD: u64 = 4096;
/// The largest data area the compiler lays out (the patch heap has 64 MiB in all).
pub const MAX_DATA: u64 = 48 << 20;

/// What a value is stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// 8 bytes.
    Long,
    /// 16 bytes.
    Str,
    /// Statistics.
    Stats(StatsLayout),
}

/// The buckets of a statistics value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsLayout {
    /// `@hist_log` buckets ([`LOG_BUCKETS`] of them).
    pub log: bool,
    /// `@hist_linear(start, stop, interval)` with its bucket count.
    pub linear: Option<(i64, i64, i64, usize)>,
    /// `@variance` with its bit shift: the running Welford state after the buckets (see
    /// [`VARIANCE_BYTES`]).
    pub variance: Option<u32>,
}

/// Bytes of the running variance state: a lock word (the Welford step is not one atomic
/// update), the values it has seen, the shifted running average and the sum of squared
/// differences, as the interpreter's `Stats` keeps them.
pub const VARIANCE_BYTES: u64 = 32;

impl StatsLayout {
    /// Byte offset of the first log bucket.
    pub fn log_offset(&self) -> u64 {
        STATS_FIXED
    }

    /// Byte offset of the first linear bucket.
    pub fn linear_offset(&self) -> u64 {
        STATS_FIXED + if self.log { LOG_BUCKETS as u64 * 8 } else { 0 }
    }

    /// Byte offset of the variance state (its lock word; the count, average and squares
    /// follow at +8, +16, +24).
    pub fn variance_offset(&self) -> u64 {
        self.linear_offset() + self.linear.map_or(0, |l| l.3 as u64 * 8)
    }
}

impl ValueKind {
    /// Bytes it takes.
    pub fn size(&self) -> u64 {
        match self {
            ValueKind::Long => 8,
            ValueKind::Str => 16,
            ValueKind::Stats(s) => {
                s.variance_offset()
                    + if s.variance.is_some() {
                        VARIANCE_BYTES
                    } else {
                        0
                    }
            }
        }
    }
}

/// Where a global lives and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalSlot {
    /// Byte offset from the data's start.
    pub offset: u64,
    /// What each value is.
    pub value: ValueKind,
    /// For arrays: the number of keys and the table's capacity (a power of two).
    pub table: Option<(usize, u32)>,
    /// For arrays: which keys are strings.
    pub key_is_str: Vec<bool>,
    /// For arrays: the most elements (MAXMAPENTRIES, or `global a[N]`); one more is an
    /// array overflow, a probe error, as in the interpreter.
    pub max_entries: u64,
    /// `global a%[N]`: an insert into a full array first deletes its oldest element.
    pub wrap: bool,
}

impl GlobalSlot {
    /// Bytes of one table entry (state, insertion number, keys, value, 8-byte aligned).
    pub fn entry_size(&self) -> u64 {
        let keys = self.table.map_or(0, |t| t.0 as u64);
        (ENTRY_KEYS + keys * KEY + self.value.size()).div_ceil(8) * 8
    }

    /// Bytes in all.
    pub fn size(&self) -> u64 {
        match self.table {
            Some((_, cap)) => TABLE_HEADER + u64::from(cap) * self.entry_size(),
            None => self.value.size(),
        }
    }

    /// Byte offset of an entry's value from the entry.
    pub fn value_offset(&self) -> u64 {
        ENTRY_KEYS + self.table.map_or(0, |t| t.0 as u64) * KEY
    }
}

/// What an output record prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputKind {
    /// `printf(FORMAT, ...)`.
    Printf(String),
    /// `print(...)` (`println` when true).
    Print(bool),
    /// `print(@hist_log(x))`, `print(@hist_linear(x, ...))` (`println` when `newline`): the
    /// record holds a copy of the statistics value, laid out as `layout`, from +16.
    Hist {
        /// Which histogram.
        kind: HistKind,
        /// The copied value's layout.
        layout: StatsLayout,
        /// `println`.
        newline: bool,
        /// The aggregate's name, as JSON output names the histogram.
        name: String,
        /// For an array element: whether each key is a string; the record holds the keys'
        /// 16-byte encodings after the statistics (JSON names it `a[k1,k2]`).
        keys: Vec<bool>,
    },
}

/// What one output record prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Printed {
    /// Text (`printf`, `print`, `println`).
    Text(String),
    /// A histogram, which JSON output prints as an object of its own.
    Hist {
        /// `s`, or `a[k1,k2]` for an array element, as the interpreter names it.
        name: String,
        /// Which histogram.
        kind: HistKind,
        /// Its buckets.
        buckets: Vec<u64>,
        /// `println`: a newline follows.
        newline: bool,
    },
}

/// How an output record holds one argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgSlot {
    /// A long: 8 bytes (in a 16-byte slot).
    Long,
    /// A 16-byte string.
    Str,
    /// A string read from memory: `slot` bytes, NUL-terminated; rendered as the interpreter
    /// holds it (invalid UTF-8 replaced, then cut to MAXSTRINGLEN, `max_string_len`).
    Text {
        /// Bytes in the record.
        slot: u32,
        /// MAXSTRINGLEN.
        max_string_len: u32,
    },
    /// `ctime(t)` (or `tz_ctime(t)`): the long `t` (in a 16-byte slot), which the host
    /// renders as the interpreter's `ctime` does, cut to MAXSTRINGLEN.
    Ctime {
        /// MAXSTRINGLEN.
        max_string_len: u32,
    },
}

impl ArgSlot {
    /// Bytes it takes in a record.
    pub fn size(&self) -> u64 {
        match self {
            ArgSlot::Long | ArgSlot::Str | ArgSlot::Ctime { .. } => 16,
            ArgSlot::Text { slot, .. } => u64::from(*slot),
        }
    }
}

/// The header as the host reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    /// The magic matched.
    pub valid: bool,
    /// `exit()` was called.
    pub exit: bool,
    /// Probe errors.
    pub errors: u64,
    /// Of which divisions by zero.
    pub div_zero: u64,
    /// Of which MAXACTION.
    pub max_action: u64,
    /// Dropped updates.
    pub dropped: u64,
    /// Of the errors, kernel reads that faulted.
    pub faults: u64,
    /// Of the errors, array overflows.
    pub overflow: u64,
    /// Of the errors, reads of empty aggregates.
    pub empty: u64,
    /// Of the errors, calls past MAXNESTING.
    pub nesting: u64,
    /// Of the errors, `error()` calls.
    pub raised: u64,
    /// Built strings the string table had no room for (see [`field::STRINGS`]).
    pub strings: u64,
    /// Arguments of string functions out of range (see [`field::ARGUMENTS`]).
    pub arguments: u64,
    /// `backtrace()` calls that gave an empty stack because the unwinder was busy on their
    /// CPU (see [`field::STACKS_BUSY`]).
    pub stacks_busy: u64,
}

fn word(bytes: &[u8], at: u64) -> u64 {
    usize::try_from(at)
        .ok()
        .and_then(|at| bytes.get(at..at.checked_add(8)?))
        .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
}

impl Header {
    /// Decodes the header's bytes (short input reads as zeros).
    pub fn decode(bytes: &[u8]) -> Self {
        Header {
            valid: word(bytes, 0) == MAGIC,
            exit: word(bytes, field::EXIT) != 0,
            errors: word(bytes, field::ERRORS),
            div_zero: word(bytes, field::DIV_ZERO),
            max_action: word(bytes, field::MAXACTION),
            dropped: word(bytes, field::DROPPED),
            faults: word(bytes, field::FAULTS),
            overflow: word(bytes, field::OVERFLOW),
            empty: word(bytes, field::EMPTY),
            nesting: word(bytes, field::NESTING),
            raised: word(bytes, field::RAISED),
            strings: word(bytes, field::STRINGS),
            arguments: word(bytes, field::ARGUMENTS),
            stacks_busy: word(bytes, field::STACKS_BUSY),
        }
    }
}

/// Where every global lives.
#[derive(Debug, Clone, Default)]
pub struct DataLayout {
    /// Globals by name.
    pub globals: IndexMap<String, GlobalSlot>,
    /// Bytes of the header and the globals (what the host reads to bring them over).
    pub globals_size: u64,
    /// The output rings: (offset, vCPUs), when kernel probes print.
    pub rings: Option<(u64, u32)>,
    /// Bytes of one output record (a power of two).
    pub record: u64,
    /// The table of strings built in the guest, when a kernel probe builds strings.
    pub strings: Option<StringTable>,
    /// The `=~` matchers by pattern: offset and table (patterns whose matcher cannot be
    /// built are left out: their probes are refused, naming why).
    pub matchers: IndexMap<String, (u64, super::regex::Matcher)>,
    /// Bytes in all.
    pub size: u64,
}

impl DataLayout {
    /// Adds output rings for `cpus` vCPUs after the globals.
    pub fn with_rings(mut self, cpus: u32) -> Self {
        let at = self.size.div_ceil(64) * 64;
        self.rings = Some((at, cpus.max(1)));
        self.size =
            at + u64::from(cpus.max(1)) * (RING_HEADER + u64::from(self.slots()) * self.record);
        self
    }
}

impl DataLayout {
    /// The output rings, for data at `data`.
    pub fn ring_set(&self, data: u64) -> Option<RingSet> {
        self.rings.map(|(offset, cpus)| RingSet {
            base: data + offset,
            cpus,
            slots: self.slots(),
            record: self.record,
        })
    }

    /// Records per ring.
    fn slots(&self) -> u32 {
        let bytes = u64::from(RING_SLOTS) * RECORD;
        u32::try_from(bytes / self.record.max(RECORD))
            .unwrap_or(RING_SLOTS)
            .max(MIN_RING_SLOTS)
    }
}

pub(super) fn value_kind(prog: &Program, name: &str) -> Result<ValueKind, String> {
    let g = &prog.globals[name];
    Ok(match g.value {
        Ty::Long => ValueKind::Long,
        Ty::Str => ValueKind::Str,
        Ty::Stats => ValueKind::Stats(StatsLayout {
            log: g.hist.log,
            variance: g.hist.variance_shift,
            linear: match g.hist.linear {
                Some(HistKind::Linear {
                    start,
                    stop,
                    interval,
                }) => {
                    let n = linear_buckets(start, stop, interval)
                        .ok_or_else(|| format!("the @hist_linear of {name} has bad bounds"))?;
                    Some((start, stop, interval, n))
                }
                _ => None,
            },
        }),
        Ty::Unknown | Ty::Void => return Err(format!("the global {name}, whose type is unknown")),
    })
}

impl DataLayout {
    /// Lays out every global of `prog`; tables get room for twice MAXMAPENTRIES (or the
    /// declared size), rounded up to a power of two.
    ///
    /// # Errors
    /// The globals that cannot be laid out (unknown types, too many keys, too large).
    pub fn new(prog: &Program, limits: &Limits) -> Result<Self, Vec<Unsupported>> {
        let mut out = DataLayout {
            globals: IndexMap::new(),
            globals_size: HEADER,
            rings: None,
            record: super::codegen::record_bytes(prog, limits),
            strings: None,
            matchers: IndexMap::new(),
            size: HEADER,
        };
        let mut refused = Vec::new();
        for (name, g) in &prog.globals {
            let refuse = |construct: String| Unsupported {
                probe: None,
                span: g.span,
                construct,
            };
            let value = match value_kind(prog, name) {
                Ok(v) => v,
                Err(e) => {
                    refused.push(refuse(e));
                    continue;
                }
            };
            let table = match g.shape {
                Shape::Array => {
                    if g.keys.len() > MAX_KEYS || g.keys.is_empty() {
                        refused.push(refuse(format!(
                            "the array {name} with {} keys (compiled arrays take 1 to {MAX_KEYS})",
                            g.keys.len()
                        )));
                        continue;
                    }
                    if g.keys.iter().any(|k| !matches!(k, Ty::Long | Ty::Str)) {
                        refused.push(refuse(format!(
                            "the array {name}, whose key types are unknown"
                        )));
                        continue;
                    }
                    let want = g.max_entries.unwrap_or(limits.max_map_entries).max(1);
                    let cap = u32::try_from(want.saturating_mul(2).next_power_of_two())
                        .unwrap_or(u32::MAX)
                        .max(16);
                    Some((g.keys.len(), cap))
                }
                _ => None,
            };
            let slot = GlobalSlot {
                wrap: g.wrap,
                offset: out.size,
                value,
                table,
                key_is_str: g.keys.iter().map(|k| *k == Ty::Str).collect(),
                max_entries: g.max_entries.unwrap_or(limits.max_map_entries) as u64,
            };
            out.size = (out.size + slot.size()).div_ceil(64) * 64;
            if out.size > MAX_DATA {
                refused.push(refuse(format!(
                    "the global {name}: the script's data would pass {} MiB",
                    MAX_DATA >> 20
                )));
                continue;
            }
            out.globals.insert(name.clone(), slot);
        }
        if super::codegen::builds_strings(prog) {
            if limits.max_string_len > MAX_BUILT_STRING {
                refused.push(Unsupported {
                    probe: None,
                    span: exotap_lang::ast::Span::default(),
                    construct: format!(
                        "building strings with MAXSTRINGLEN {} (kernel probes build strings up \
                         to MAXSTRINGLEN {MAX_BUILT_STRING}, in a buffer on the kernel stack)",
                        limits.max_string_len
                    ),
                });
            }
            let table = StringTable {
                head: out.size,
                offset: out.size + STRING_TABLE_HEAD,
                entries: STRING_ENTRIES,
                text: (limits.max_string_len.max(1) as u64).div_ceil(16) * 16,
                collectable: !super::codegen::keeps_entry_values(prog),
            };
            out.size =
                (table.offset + table.entry_size() * u64::from(table.entries)).div_ceil(64) * 64;
            out.strings = Some(table);
        }
        for pattern in super::codegen::regex_patterns(prog) {
            if let Ok(m) = super::regex::build(&pattern) {
                let at = out.size;
                out.size = (out.size + m.size() as u64).div_ceil(64) * 64;
                out.matchers.insert(pattern, (at, m));
            }
        }
        out.globals_size = out.size;
        if refused.is_empty() {
            Ok(out)
        } else {
            Err(refused)
        }
    }

    /// The data's initial bytes: the header's magic, initial scalar values (`global x = 5`)
    /// and empty statistics.
    pub fn initial(&self, prog: &Program, interner: &mut Interner) -> Vec<u8> {
        let mut bytes = vec![0u8; usize::try_from(self.globals_size).unwrap_or(0)];
        bytes[..8].copy_from_slice(&MAGIC.to_le_bytes());
        for (at, m) in self.matchers.values() {
            let table = m.bytes();
            if let Some(to) = bytes.get_mut(*at as usize..*at as usize + table.len()) {
                to.copy_from_slice(&table);
            }
        }
        for (name, slot) in &self.globals {
            let init = prog.globals.get(name).and_then(|g| g.init.clone());
            let store = match (slot.table, slot.value, init) {
                (None, ValueKind::Long, Some(Literal::Num(n))) => Store::Scalar(Value::Long(n)),
                (None, ValueKind::Str, Some(Literal::Str(s))) => Store::Scalar(Value::Str(s)),
                (None, ValueKind::Stats(_), _) => Store::Stats(Stats::default()),
                _ => continue,
            };
            let _ = self.encode_into(name, &store, interner, &mut bytes);
        }
        bytes
    }

    /// The text of a 16-byte string encoding in the data `data`: a string built in the guest
    /// from the string table, any other from `interner`.
    fn text(&self, interner: &Interner, data: &[u8], raw: &[u8]) -> String {
        if raw.first() == Some(&2) && raw.len() >= 16 {
            let index = u64::from_le_bytes(raw[8..16].try_into().unwrap_or_default());
            if let Some(t) = self.strings.and_then(|t| t.text_of(data, index)) {
                return t;
            }
            return format!("<built string {index}>");
        }
        interner.decode(raw)
    }

    /// Decodes global `name` from the data's bytes `data` into an interpreter store.
    /// Entries still being written are left out; a hostile guest gives garbage values, never
    /// a panic.
    pub fn decode(&self, name: &str, data: &[u8], interner: &Interner) -> Option<Store> {
        let slot = self.globals.get(name)?;
        let at = slot.offset;
        let Some((keys, cap)) = slot.table else {
            return Some(match slot.value {
                ValueKind::Long => Store::Scalar(Value::Long(word(data, at) as i64)),
                ValueKind::Str => Store::Scalar(Value::Str(self.text(
                    interner,
                    data,
                    bytes_at(data, at, 16),
                ))),
                ValueKind::Stats(layout) => Store::Stats(decode_stats(data, at, layout)),
            });
        };
        let entry = slot.entry_size();
        let mut scalars = IndexMap::new();
        let mut stats = IndexMap::new();
        let mut ready: Vec<(u64, u64)> = (0..u64::from(cap))
            .map(|i| at + TABLE_HEADER + i * entry)
            .filter(|e| word(data, *e) == 2)
            .map(|e| (word(data, e + 8), e))
            .collect();
        ready.sort_unstable();
        for (_, e) in ready {
            let key: Vec<Value> = (0..keys)
                .map(|k| {
                    let at = e + ENTRY_KEYS + k as u64 * KEY;
                    if slot.key_is_str.get(k).copied().unwrap_or(false) {
                        Value::Str(self.text(interner, data, bytes_at(data, at, 16)))
                    } else {
                        Value::Long(word(data, at) as i64)
                    }
                })
                .collect();
            let v = e + slot.value_offset();
            match slot.value {
                ValueKind::Long => {
                    scalars.insert(key, Value::Long(word(data, v) as i64));
                }
                ValueKind::Str => {
                    scalars.insert(
                        key,
                        Value::Str(self.text(interner, data, bytes_at(data, v, 16))),
                    );
                }
                ValueKind::Stats(layout) => {
                    stats.insert(key, decode_stats(data, v, layout));
                }
            }
        }
        Some(match slot.value {
            ValueKind::Stats(_) => Store::StatsArray(stats),
            _ => Store::Array(scalars),
        })
    }
}

fn bytes_at(data: &[u8], at: u64, len: usize) -> &[u8] {
    usize::try_from(at)
        .ok()
        .and_then(|at| data.get(at..at.checked_add(len)?))
        .unwrap_or_default()
}

fn decode_stats(data: &[u8], at: u64, layout: StatsLayout) -> Stats {
    let count = word(data, at) as i64;
    let variance = |off: u64| {
        layout.variance.map_or(0, |_| {
            word(data, at + layout.variance_offset() + off) as i64
        })
    };
    let mut s = Stats {
        variance_shift: layout.variance.unwrap_or(0),
        avg_s: variance(16),
        m2: variance(24),
        count,
        sum: word(data, at + 8) as i64,
        min: if count == 0 {
            0
        } else {
            word(data, at + 16) as i64
        },
        max: if count == 0 {
            0
        } else {
            word(data, at + 24) as i64
        },
        log: Vec::new(),
        linear: None,
    };
    if layout.log {
        s.log = (0..LOG_BUCKETS as u64)
            .map(|b| word(data, at + layout.log_offset() + b * 8))
            .collect();
    }
    if let Some((start, stop, interval, n)) = layout.linear {
        let buckets = (0..n as u64)
            .map(|b| word(data, at + layout.linear_offset() + b * 8))
            .collect();
        s.linear = Some((
            HistKind::Linear {
                start,
                stop,
                interval,
            },
            buckets,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use exotap_lang::driver::{compile, ScriptSource};

    pub(super) fn program(text: &str) -> Program {
        let src = ScriptSource {
            name: "t.stp".into(),
            text: text.into(),
        };
        compile(&src, &Limits::default()).expect("the test script checks")
    }

    /// A string table of four 32-byte entries after a 64-byte head, and its zeroed data.
    pub(super) fn tiny_table() -> (StringTable, Vec<u8>) {
        let t = StringTable {
            head: 0,
            offset: 64,
            entries: 4,
            text: 32,
            collectable: true,
        };
        (t, vec![0u8; 64 + 4 * 48])
    }

    #[test]
    fn a_string_placed_by_the_host_reads_back_and_is_found_again_in_its_entry() {
        let (t, mut data) = tiny_table();
        let text = "a-string-over-fifteen";

        let first = t.place(&mut data, text);
        let again = t.place(&mut data, text);
        let other = t.place(&mut data, "another-long-string");

        assert_eq!(first, Some(StringTable::hash(text.as_bytes()) & 3));
        assert_eq!(again, first);
        assert_ne!(other, first);
        assert_eq!(t.text_of(&data, first.unwrap()).as_deref(), Some(text));
        // 31 bytes and a NUL fill a slot; 32 do not fit; an index past the table reads nothing.
        assert!(t.place(&mut data, &"x".repeat(32)).is_none());
        assert!(t.place(&mut data, &"y".repeat(31)).is_some());
        assert_eq!(t.text_of(&data, 4), None);
    }

    #[test]
    fn short_strings_are_inline_and_long_ones_interned() {
        let mut i = Interner::default();
        let short = i.encode("bash");
        let long = i.encode("__x64_sys_getppid");
        assert_eq!(&short[..5], b"bash\0");
        assert_eq!(
            (long[0], i.decode(&long)),
            (1, "__x64_sys_getppid".to_string())
        );
        assert_eq!(i.decode(&short), "bash");
    }

    #[test]
    fn entries_being_written_and_garbage_states_are_left_out() {
        let prog = program("global a; probe begin { a[1] = 1 }");
        let layout = DataLayout::new(&prog, &Limits::default()).expect("lays out");
        let slot = &layout.globals["a"];
        let mut data = vec![0u8; layout.size as usize];
        let e = (slot.offset + TABLE_HEADER) as usize;
        data[e..e + 8].copy_from_slice(&1u64.to_le_bytes());
        data[e + slot.entry_size() as usize..][..8].copy_from_slice(&77u64.to_le_bytes());

        let Some(Store::Array(got)) = layout.decode("a", &data, &Interner::default()) else {
            panic!("not an array")
        };

        assert!(got.is_empty());
    }

    #[test]
    fn a_short_data_area_decodes_as_zeros_without_panicking() {
        let prog = program("global a, s; probe begin { a[1] = 1; s <<< 1 }");
        let layout = DataLayout::new(&prog, &Limits::default()).expect("lays out");

        let a = layout.decode("a", &[0xff; 100], &Interner::default());
        let s = layout.decode("s", &[], &Interner::default());

        assert!(matches!(a, Some(Store::Array(m)) if m.is_empty()));
        assert!(matches!(s, Some(Store::Stats(st)) if st.count == 0));
    }

    #[test]
    fn a_string_read_from_memory_renders_to_its_nul_and_a_short_hostile_record_does_not_panic() {
        let mut interner = Interner::default();
        let text = ArgSlot::Text {
            slot: 32,
            max_string_len: 64,
        };
        let id = interner.format(
            OutputKind::Printf("%s|%d|%s\n".into()),
            vec![text, ArgSlot::Long, text],
        );
        let mut record = vec![0u8; 16 + 32 + 16 + 32];
        record[8..12].copy_from_slice(&id.to_le_bytes());
        record[16..25].copy_from_slice(b"ab\xffc\0junk");
        record[48..56].copy_from_slice(&(-7i64).to_le_bytes());
        // The last string has no NUL: it ends with the slot.
        record[64..96].copy_from_slice(&[b'z'; 32]);

        let whole = interner.render(&record);
        let cut = interner.render(&record[..70]);

        assert_eq!(
            whole.as_deref(),
            Some(format!("ab\u{fffd}c|-7|{}\n", "z".repeat(32)).as_str())
        );
        assert_eq!(cut.as_deref(), Some("ab\u{fffd}c|-7|\n"));
    }

    #[test]
    fn invalid_utf8_read_from_memory_is_cut_to_maxstringlen_after_replacement_as_the_interpreter() {
        let mut interner = Interner::default();
        let id = interner.format(
            OutputKind::Print(false),
            vec![ArgSlot::Text {
                slot: 16,
                max_string_len: 8,
            }],
        );
        let mut record = vec![0u8; 32];
        record[8..12].copy_from_slice(&id.to_le_bytes());
        record[16..23].copy_from_slice(&[0xff; 7]);

        let got = interner.render(&record);

        // 7 bytes become 7 replacement characters (21 bytes), cut to 7 bytes: two whole ones.
        assert_eq!(got.as_deref(), Some("\u{fffd}\u{fffd}"));
    }

    #[test]
    fn the_header_reads_its_fields() {
        let mut h = vec![0u8; 64];
        h[..8].copy_from_slice(&MAGIC.to_le_bytes());
        h[8] = 1;
        h[16] = 3;
        h[24] = 2;

        let got = Header::decode(&h);

        assert_eq!(
            (got.valid, got.exit, got.errors, got.div_zero, got.dropped),
            (true, true, 3, 2, 0)
        );
    }
}
