//! The name index: every named function, inlined instance, type and global variable of a
//! DWARF file, sorted by name, in one flat file that is used straight from a memory map.
//!
//! Built once per build id by a parallel one-pass `scan` (a progress callback
//! reports it), written to a temporary file and renamed into the cache, then only mapped:
//! a warm lookup is a binary search, no deserialization. The file is checked like any
//! other input; a stale or corrupt one is rebuilt.
//!
//! Layout (little-endian): header (`EXOTAPIX`, version, layer, build id, counts), `n`
//! fixed-size records sorted by name, the `.debug_info` offsets of every unit (so that a warm
//! query finds a DIE's unit by binary search instead of walking every unit header of a
//! 300 MB section, which costs tens of milliseconds of page faults), then the string blob the
//! records point into.

use foldhash::{HashMap, HashSet};
use rayon::slice::ParallelSliceMut as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use super::pattern::{file_matches, glob_match};
pub use super::scan::Layer;
use super::scan::{scan, UnitEntries};
use super::{DebugInfo, DieRef, DwarfError};

const MAGIC: &[u8; 8] = b"EXOTAPIX";
/// 3: an entry's `low` is its `DW_AT_entry_pc` when that lies inside its `low_pc..high_pc`.
/// 4: ... or inside one of its ranges; an entry pc in none of them gives the first range.
const VERSION: u32 = 4;
const RECORD: usize = 48;

/// Errors of the on-disk index.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    /// The index file could not be read, written or renamed.
    #[error("cannot access the index file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not an index of this build and layer (or not an index at all).
    #[error("{path} is not a current index of this debug file ({why})")]
    Stale {
        /// The file.
        path: PathBuf,
        /// What did not match.
        why: &'static str,
    },
    /// The debug file has no build id to key the cache with.
    #[error("the debug file has no GNU build id to key its index with")]
    NoBuildId,
    /// The index would not fit the format's 32-bit string offsets.
    #[error("the index strings exceed 4 GiB")]
    TooBig,
}

/// What an index entry names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EntryKind {
    /// A function with code (`low`..`high` is its entry range).
    Function,
    /// An abstract inline function (no code of its own).
    Abstract,
    /// An inlined instance of a function (`file:line` is the call site).
    Inlined,
    /// `struct`.
    Struct,
    /// `union`.
    Union,
    /// `enum`.
    Enum,
    /// `typedef`.
    Typedef,
    /// A base type (`int`, `long unsigned int`).
    BaseType,
    /// A global or static variable (`low` is its address when static).
    Variable,
}

impl EntryKind {
    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(code: u8) -> Option<EntryKind> {
        use EntryKind::*;
        [
            Function, Abstract, Inlined, Struct, Union, Enum, Typedef, BaseType, Variable,
        ]
        .get(usize::from(code))
        .copied()
    }

    /// Whether it names a type.
    pub fn is_type(self) -> bool {
        matches!(
            self,
            EntryKind::Struct
                | EntryKind::Union
                | EntryKind::Enum
                | EntryKind::Typedef
                | EntryKind::BaseType
        )
    }
}

/// One entry of the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'i> {
    /// The name.
    pub name: &'i str,
    /// What it is.
    pub kind: EntryKind,
    /// Its DIE.
    pub die: DieRef,
    /// Entry pc (functions, inlined instances) or address (static variables); 0 otherwise.
    pub low: u64,
    /// End of the entry range.
    pub high: u64,
    /// Declaring file (call site for inlined instances), `""` when unknown.
    pub file: &'i str,
    /// Declaring line (call line for inlined instances).
    pub line: u32,
}

/// Bytes of an index: mapped from the cache, or just built.
#[derive(Debug)]
enum Bytes {
    Map(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// An index of one layer of one debug file.
#[derive(Debug)]
pub struct Index {
    bytes: Bytes,
    count: usize,
    records_at: usize,
    units_at: usize,
    units: usize,
    strings_at: usize,
    /// Units that referred to DIEs outside themselves for a name (kept for diagnostics).
    pub unnamed: u64,
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// The header: magic, version, layer, build id length, build id, count, strings length,
/// unnamed count, unit count.
fn header(
    layer: Layer,
    build_id: &[u8],
    count: u64,
    strings_len: u64,
    unnamed: u64,
    units: u64,
) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&u32::from(layer == Layer::Inlines).to_le_bytes());
    h.extend_from_slice(&(build_id.len() as u64).to_le_bytes());
    h.extend_from_slice(build_id);
    while !h.len().is_multiple_of(8) {
        h.push(0);
    }
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&strings_len.to_le_bytes());
    h.extend_from_slice(&unnamed.to_le_bytes());
    h.extend_from_slice(&units.to_le_bytes());
    h
}

impl Index {
    /// The index file of `layer` for `build_id` under `cache_dir`.
    pub fn path(cache_dir: &Path, build_id: &[u8], layer: Layer) -> PathBuf {
        let hex: String = build_id.iter().map(|b| format!("{b:02x}")).collect();
        // The format version is in the name too, so that exotap builds of different versions
        // sharing a cache keep their own files instead of rebuilding each other's.
        let file = match layer {
            Layer::Names => "names",
            Layer::Inlines => "inlines",
        };
        cache_dir.join(hex).join(format!("{file}.v{VERSION}.idx"))
    }

    /// Maps an existing index and checks that it belongs to `build_id` and `layer`.
    ///
    /// # Errors
    /// [`IndexError::Io`] when it cannot be read, [`IndexError::Stale`] when it is not a
    /// complete index of this build and layer.
    pub fn open(path: &Path, build_id: &[u8], layer: Layer) -> Result<Index, IndexError> {
        let io = |source| IndexError::Io {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: index files are written to a temporary name and renamed into place, never
        // modified afterwards, so the mapped bytes do not change while mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Index::from_bytes(Bytes::Map(map), build_id, layer).map_err(|why| IndexError::Stale {
            path: path.to_owned(),
            why,
        })
    }

    fn from_bytes(bytes: Bytes, build_id: &[u8], layer: Layer) -> Result<Index, &'static str> {
        let b: &[u8] = match &bytes {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        };
        if b.get(..8) != Some(MAGIC.as_slice()) {
            return Err("bad magic");
        }
        if u32_at(b, 8) != Some(VERSION) {
            return Err("other format version");
        }
        if u32_at(b, 12) != Some(u32::from(layer == Layer::Inlines)) {
            return Err("other layer");
        }
        let id_len =
            usize::try_from(u64_at(b, 16).ok_or("truncated")?).map_err(|_| "bad build id")?;
        let id_end = 24usize.checked_add(id_len).ok_or("bad build id")?;
        if b.get(24..id_end) != Some(build_id) {
            return Err("other build id");
        }
        let counts_at = id_end.div_ceil(8) * 8;
        let count =
            usize::try_from(u64_at(b, counts_at).ok_or("truncated")?).map_err(|_| "bad count")?;
        let strings_len = usize::try_from(u64_at(b, counts_at + 8).ok_or("truncated")?)
            .map_err(|_| "bad count")?;
        let unnamed = u64_at(b, counts_at + 16).ok_or("truncated")?;
        let units = usize::try_from(u64_at(b, counts_at + 24).ok_or("truncated")?)
            .map_err(|_| "bad count")?;
        let records_at = counts_at + 32;
        let units_at = count
            .checked_mul(RECORD)
            .and_then(|n| n.checked_add(records_at))
            .ok_or("bad count")?;
        let strings_at = units
            .checked_mul(8)
            .and_then(|n| n.checked_add(units_at))
            .ok_or("bad count")?;
        if strings_at.checked_add(strings_len) != Some(b.len()) {
            return Err("truncated");
        }
        Ok(Index {
            bytes,
            count,
            records_at,
            units_at,
            units,
            strings_at,
            unnamed,
        })
    }

    fn data(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The `.debug_info` offset of every unit, in file order (as recorded when it was built).
    pub fn unit_starts(&self) -> Vec<u64> {
        (0..self.units)
            .map_while(|i| u64_at(self.data(), self.units_at + i * 8))
            .collect()
    }

    fn string(&self, off: Option<u32>, len: Option<u32>) -> &str {
        let strings = self.data().get(self.strings_at..).unwrap_or_default();
        let (Some(off), Some(len)) = (off, len) else {
            return "";
        };
        let (off, len) = (off as usize, len as usize);
        off.checked_add(len)
            .and_then(|end| strings.get(off..end))
            .and_then(|s| std::str::from_utf8(s).ok())
            .unwrap_or("")
    }

    fn name_at(&self, i: usize) -> &str {
        let at = self.records_at + i * RECORD;
        self.string(u32_at(self.data(), at), u32_at(self.data(), at + 4))
    }

    /// Entry `i` in name order; `None` past the end or for a corrupt record.
    pub fn get(&self, i: usize) -> Option<Entry<'_>> {
        if i >= self.count {
            return None;
        }
        let b = self.data();
        let at = self.records_at + i * RECORD;
        Some(Entry {
            name: self.string(u32_at(b, at), u32_at(b, at + 4)),
            file: self.string(u32_at(b, at + 8), u32_at(b, at + 12)),
            kind: EntryKind::from_code(*b.get(at + 16)?)?,
            line: u32_at(b, at + 20)?,
            die: DieRef(u64_at(b, at + 24)?),
            low: u64_at(b, at + 32)?,
            high: u64_at(b, at + 40)?,
        })
    }

    /// All entries in name order.
    pub fn iter(&self) -> impl Iterator<Item = Entry<'_>> {
        (0..self.count).filter_map(|i| self.get(i))
    }

    /// Entries named exactly `name`.
    pub fn lookup(&self, name: &str) -> impl Iterator<Item = Entry<'_>> {
        let first = self.partition(|n| n < name);
        let end = self.partition(|n| n <= name);
        (first..end).filter_map(|i| self.get(i))
    }

    /// Entries named `name` of `kind`.
    pub fn lookup_kind(&self, name: &str, kind: EntryKind) -> impl Iterator<Item = Entry<'_>> {
        self.lookup(name).filter(move |e| e.kind == kind)
    }

    fn partition(&self, before: impl Fn(&str) -> bool) -> usize {
        let (mut lo, mut hi) = (0, self.count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if before(self.name_at(mid)) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Entries whose name matches the glob `pattern` (`*`, `?`, `[abc]`); a literal prefix
    /// narrows the search by binary search.
    pub fn glob(&self, pattern: &str) -> Vec<Entry<'_>> {
        let prefix_len = pattern.find(['*', '?', '[']).unwrap_or(pattern.len());
        let prefix = &pattern[..prefix_len];
        let first = self.partition(|n| n < prefix);
        (first..self.count)
            .map_while(|i| self.get(i).filter(|e| e.name.starts_with(prefix)))
            .filter(|e| glob_match(pattern, e.name))
            .collect()
    }

    /// Entries matching a SystemTap-style function pattern, `FUNC[@FILE]`: `FUNC` a name or
    /// glob (`vfs_*`), `FILE` a path or glob matched against the declaring file's path and
    /// its trailing components (`fs/open.c`, `*/open.c`, `open.c`). Only entries of `kinds`.
    pub fn functions(&self, pattern: &str, kinds: &[EntryKind]) -> Vec<Entry<'_>> {
        let (func, file) = match pattern.split_once('@') {
            Some((f, file)) => (f, Some(file)),
            None => (pattern, None),
        };
        let candidates: Vec<Entry<'_>> = if func.contains(['*', '?', '[']) {
            self.glob(func)
        } else {
            self.lookup(func).collect()
        };
        candidates
            .into_iter()
            .filter(|e| kinds.contains(&e.kind))
            .filter(|e| file.is_none_or(|f| file_matches(e.file, f)))
            .collect()
    }

    /// Builds the index of `layer` by scanning `info`, without touching the disk.
    ///
    /// # Errors
    /// [`DwarfError`] when the DWARF is malformed.
    pub fn build(
        info: &DebugInfo<'_>,
        layer: Layer,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<Index, DwarfError> {
        let build_id = info.build_id().unwrap_or_default();
        let start = std::time::Instant::now();
        let units = scan(info, layer, progress)?;
        let scanned = start.elapsed();
        let starts: Vec<u64> = info.unit_headers()?.iter().map(super::unit_start).collect();
        let bytes = serialize(&units, &starts, layer, build_id)?;
        tracing::debug!(?layer, ?scanned, serialized = ?start.elapsed() - scanned, bytes = bytes.len(), "built the debug-info index");
        Index::from_bytes(Bytes::Owned(bytes), build_id, layer).map_err(|why| {
            DwarfError::Index(IndexError::Stale {
                path: PathBuf::from("(in memory)"),
                why,
            })
        })
    }

    /// Opens the cached index of `layer` under `cache_dir`, building and caching it first
    /// when it is absent, stale or corrupt.
    ///
    /// # Errors
    /// [`IndexError::NoBuildId`] for a file without build id; DWARF errors while building;
    /// [`IndexError::Io`] when the cache cannot be written.
    pub fn load_or_build(
        info: &DebugInfo<'_>,
        cache_dir: &Path,
        layer: Layer,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<Index, DwarfError> {
        let build_id = info.build_id().ok_or(IndexError::NoBuildId)?;
        let path = Index::path(cache_dir, build_id, layer);
        match Index::open(&path, build_id, layer) {
            Ok(index) => {
                info.seed_unit_starts(index.unit_starts());
                return Ok(index);
            }
            Err(IndexError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            }
            Err(e) => tracing::warn!(error = %e, "rebuilding the debug-info index"),
        }
        let index = Index::build(info, layer, progress)?;
        write_atomically(&path, index.data())?;
        Ok(index)
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), IndexError> {
    let io = |source| IndexError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("index"),
        std::process::id()
    ));
    let mut file = std::fs::File::create(&tmp).map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io)
}

/// Interns names and files, sorts, and lays out the file. Types are kept once per
/// (kind, name): the first definition in unit order, as every unit repeats the types it uses.
fn serialize<'u>(
    units: &'u [UnitEntries<'_>],
    starts: &[u64],
    layer: Layer,
    build_id: &[u8],
) -> Result<Vec<u8>, IndexError> {
    let mut strings = Strings::default();
    let mut seen_types: HashSet<(EntryKind, &[u8])> = HashSet::default();
    let mut records: Vec<([u8; RECORD], &'u [u8])> = Vec::new();
    let mut unnamed = 0;
    for unit in units {
        unnamed += unit.unnamed;
        for e in &unit.entries {
            if e.kind.is_type() && !seen_types.insert((e.kind, e.name)) {
                continue;
            }
            let (name_off, name_len) = strings.intern(e.name)?;
            let file = unit
                .files
                .get(e.file as usize)
                .map(String::as_bytes)
                .unwrap_or_default();
            let (file_off, file_len) = strings.intern(file)?;
            let mut r = [0u8; RECORD];
            r[0..4].copy_from_slice(&name_off.to_le_bytes());
            r[4..8].copy_from_slice(&name_len.to_le_bytes());
            r[8..12].copy_from_slice(&file_off.to_le_bytes());
            r[12..16].copy_from_slice(&file_len.to_le_bytes());
            r[16] = e.kind.code();
            r[20..24].copy_from_slice(&e.line.to_le_bytes());
            r[24..32].copy_from_slice(&e.die.to_le_bytes());
            r[32..40].copy_from_slice(&e.low.to_le_bytes());
            r[40..48].copy_from_slice(&e.high.to_le_bytes());
            records.push((r, e.name));
        }
    }
    records.par_sort_unstable_by(|a, b| {
        a.1.cmp(b.1)
            .then(a.0[16].cmp(&b.0[16]))
            .then(a.0[24..32].cmp(&b.0[24..32]))
    });
    let mut out = header(
        layer,
        build_id,
        records.len() as u64,
        strings.blob.len() as u64,
        unnamed,
        starts.len() as u64,
    );
    out.reserve(records.len() * RECORD + starts.len() * 8 + strings.blob.len());
    for (r, _) in &records {
        out.extend_from_slice(r);
    }
    for s in starts {
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.extend_from_slice(&strings.blob);
    Ok(out)
}

/// The string blob being built, each distinct string stored once.
#[derive(Default)]
struct Strings<'u> {
    blob: Vec<u8>,
    seen: HashMap<&'u [u8], (u32, u32)>,
}

impl<'u> Strings<'u> {
    fn intern(&mut self, s: &'u [u8]) -> Result<(u32, u32), IndexError> {
        if let Some(v) = self.seen.get(s) {
            return Ok(*v);
        }
        let off = u32::try_from(self.blob.len()).map_err(|_| IndexError::TooBig)?;
        let len = u32::try_from(s.len()).map_err(|_| IndexError::TooBig)?;
        self.blob.extend_from_slice(s);
        self.seen.insert(s, (off, len));
        Ok((off, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dwarf::testing::{fixture_file, names};

    #[test]
    fn names_layer_finds_functions_types_variables_and_abstract_inlines() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();

        let index = names(&info);

        let task_pid: Vec<_> = index.lookup_kind("task_pid", EntryKind::Function).collect();
        assert_eq!(task_pid.len(), 1);
        assert_eq!(info.symbols().by_name("task_pid")[0].addr, task_pid[0].low);
        assert!(task_pid[0].file.ends_with("dwarf_fixture.c") && task_pid[0].line == 32);
        assert_eq!(index.lookup_kind("task", EntryKind::Struct).count(), 1);
        assert_eq!(index.lookup_kind("color", EntryKind::Enum).count(), 1);
        assert_eq!(index.lookup_kind("pid_t", EntryKind::Typedef).count(), 1);
        assert_eq!(index.lookup_kind("twice", EntryKind::Abstract).count(), 1);
        assert!(index
            .lookup_kind("global_task", EntryKind::Variable)
            .next()
            .is_some_and(|v| v.low != 0));
    }

    #[test]
    fn inlines_layer_names_instances_by_their_origin_with_the_call_site() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();

        let index = Index::build(&info, Layer::Inlines, &|_, _| {}).unwrap();

        let twice: Vec<_> = index.lookup_kind("twice", EntryKind::Inlined).collect();
        assert!(!twice.is_empty());
        assert!(twice
            .iter()
            .all(|e| e.line == 46 && e.file.ends_with("dwarf_fixture.c")));
    }

    #[test]
    fn functions_takes_globs_and_file_patterns() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);

        let by_glob: Vec<&str> = index
            .functions("*_pid*", &[EntryKind::Function])
            .iter()
            .map(|e| e.name)
            .collect();
        let by_file = index.functions("*@dwarf_fixture.c", &[EntryKind::Function]);
        let elsewhere = index.functions("*@other.c", &[EntryKind::Function]);

        assert_eq!(by_glob, vec!["sum_pids", "task_pid"]);
        assert!(
            by_file.iter().any(|e| e.name == "main") && by_file.iter().any(|e| e.name == "say")
        );
        assert!(elsewhere.is_empty());
    }

    #[test]
    fn load_or_build_caches_by_build_id_and_rebuilds_a_corrupt_file() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let built = Index::load_or_build(&info, dir.path(), Layer::Names, &|_, _| {}).unwrap();
        let path = Index::path(dir.path(), info.build_id().unwrap(), Layer::Names);

        let reopened = Index::open(&path, info.build_id().unwrap(), Layer::Names).unwrap();
        let other_build = Index::open(&path, b"other", Layer::Names);
        let other_layer = Index::open(&path, info.build_id().unwrap(), Layer::Inlines);
        std::fs::write(&path, b"EXOTAPIX garbage").unwrap();
        let rebuilt = Index::load_or_build(&info, dir.path(), Layer::Names, &|_, _| {}).unwrap();

        assert_eq!(reopened.len(), built.len());
        assert_eq!(
            reopened.unit_starts(),
            info.unit_headers()
                .unwrap()
                .iter()
                .map(crate::dwarf::unit_start)
                .collect::<Vec<_>>()
        );
        assert!(matches!(
            other_build,
            Err(IndexError::Stale {
                why: "other build id",
                ..
            })
        ));
        assert!(matches!(
            other_layer,
            Err(IndexError::Stale {
                why: "other layer",
                ..
            })
        ));
        assert_eq!(rebuilt.len(), built.len());
    }

    #[test]
    fn truncated_or_flipped_index_bytes_give_errors_or_entries_never_panics() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let id = info.build_id().unwrap();
        let bytes = names(&info).data().to_vec();

        for len in (0..bytes.len()).step_by(7) {
            let _ = Index::from_bytes(Bytes::Owned(bytes[..len].to_vec()), id, Layer::Names);
        }
        for at in (0..bytes.len()).step_by(3) {
            let mut bad = bytes.clone();
            bad[at] ^= 0x5a;
            if let Ok(index) = Index::from_bytes(Bytes::Owned(bad), id, Layer::Names) {
                let _ = index.iter().count();
                let _ = index.lookup("task").count();
                let _ = index.glob("s*").len();
            }
        }
    }
}
