//! DWARF debug info of a guest kernel (the Debian `-dbg` vmlinux, 588 MB): functions with
//! their inlined instances, line tables, types, parameters and locals, and KLAS-style
//! member-access join points.
//!
//! Parsing is lazy, as in addr2line: [`DebugFile::open`] maps the file, [`DebugFile::load`]
//! only finds the sections; a unit is parsed when a query first needs it and kept. Name
//! lookups go through an [`index`] built once per build id and cached on disk. Every offset
//! read from the file is checked: a corrupt file gives a [`DwarfError`], never a panic.

pub mod index;
pub mod klas;
pub mod lines;
pub mod pattern;
pub mod relocatable;
mod scan;
pub mod symtab;
pub mod types;
pub mod vars;

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use gimli::{EndianSlice, RunTimeEndian};
use object::{Object, ObjectSection};

pub use index::{Entry, EntryKind, Index, IndexError};
pub use symtab::Symtab;

/// The gimli reader over the mapped file.
pub type R<'a> = EndianSlice<'a, RunTimeEndian>;
/// A parsed unit.
pub type Unit<'a> = gimli::Unit<R<'a>>;

/// A DIE named by its offset in `.debug_info` (unique in the file, unlike unit offsets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DieRef(pub u64);

/// Errors of reading DWARF.
#[derive(Debug, thiserror::Error)]
pub enum DwarfError {
    /// The file could not be opened or mapped.
    #[error("cannot map {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The ELF container is malformed.
    #[error("the ELF file is malformed")]
    Elf(#[source] object::Error),
    /// A relocatable object (a module's `.ko`) whose DWARF cannot be placed.
    #[error("cannot relocate the module's debug info: {0}")]
    Relocatable(String),
    /// The file has no `.debug_info`.
    #[error("the file has no DWARF (.debug_info is missing or empty); is it the -dbg vmlinux?")]
    NoDwarf,
    /// The DWARF is malformed.
    #[error("malformed DWARF {context}")]
    Gimli {
        /// What was being read.
        context: String,
        /// The cause.
        #[source]
        source: gimli::Error,
    },
    /// A DIE offset that lies in no unit.
    #[error("DIE {0:#x} lies in no unit of .debug_info")]
    NoUnitAt(u64),
    /// Nothing of that name.
    #[error("no {kind} named `{name}` in the debug info")]
    NotFound {
        /// "function", "struct", ...
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// The name index failed.
    #[error(transparent)]
    Index(#[from] IndexError),
}

/// Wraps a gimli error with what was being read.
pub(crate) fn gimli_err(context: impl Into<String>) -> impl FnOnce(gimli::Error) -> DwarfError {
    let context = context.into();
    move |source| DwarfError::Gimli { context, source }
}

/// A debug file mapped into memory.
#[derive(Debug)]
pub struct DebugFile {
    map: Bytes,
    path: PathBuf,
}

/// A debug file's bytes: mapped, or made in memory ([`DebugFile::relocated`]).
#[derive(Debug)]
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl DebugFile {
    /// Maps `path` read-only.
    ///
    /// # Errors
    /// [`DwarfError::Open`] when it cannot be opened or mapped.
    pub fn open(path: &Path) -> Result<DebugFile, DwarfError> {
        let open_err = |source| DwarfError::Open {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(open_err)?;
        // SAFETY: the mapping is read-only and private. The files mapped here are cache entries
        // that exotap writes once (to a temporary name, then renamed) and never modifies in
        // place, so the bytes do not change under the mapping while it lives.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(open_err)?;
        Ok(DebugFile {
            map: Bytes::Mapped(map),
            path: path.to_owned(),
        })
    }

    /// A kernel module's debug file (`path`, an ELF relocatable object) with its allocated
    /// sections at the addresses `address` gives by section name (the others laid out at
    /// made-up addresses) and its DWARF relocated to them ([`relocatable::place`]). Returns
    /// it and each allocated section's address.
    ///
    /// # Errors
    /// [`DwarfError::Open`] when the file cannot be read, [`DwarfError::Relocatable`] when it
    /// cannot be placed.
    pub fn relocated(
        path: &Path,
        address: &dyn Fn(&str) -> Option<u64>,
    ) -> Result<(DebugFile, relocatable::Placement), DwarfError> {
        let bytes = std::fs::read(path).map_err(|source| DwarfError::Open {
            path: path.to_owned(),
            source,
        })?;
        let (bytes, placed) = relocatable::place(&bytes, address)?;
        Ok((
            DebugFile {
                map: Bytes::Owned(bytes),
                path: path.to_owned(),
            },
            placed,
        ))
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Finds the ELF sections and DWARF sections; parses nothing else yet.
    ///
    /// # Errors
    /// [`DwarfError::Elf`] for a malformed ELF, [`DwarfError::NoDwarf`] without `.debug_info`.
    pub fn load(&self) -> Result<DebugInfo<'_>, DwarfError> {
        DebugInfo::new(&self.map)
    }
}

/// DWARF and ELF symbols of one file, parsed lazily.
pub struct DebugInfo<'a> {
    pub(crate) dwarf: gimli::Dwarf<R<'a>>,
    elf: object::File<'a>,
    units: OnceCell<Vec<gimli::UnitHeader<R<'a>>>>,
    unit_starts: OnceCell<Vec<u64>>,
    parsed: RefCell<HashMap<u64, Rc<Unit<'a>>>>,
    symbols: OnceCell<Symtab<'a>>,
    /// Lookups answered by [`symtab::describe_unsorted`] so far.
    unsorted_lookups: std::cell::Cell<u32>,
}

impl std::fmt::Debug for DebugInfo<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DebugInfo")
            .field("build_id", &self.build_id())
            .finish_non_exhaustive()
    }
}

impl<'a> DebugInfo<'a> {
    /// Reads the sections of the ELF file in `bytes`.
    ///
    /// # Errors
    /// As [`DebugFile::load`].
    pub fn new(bytes: &'a [u8]) -> Result<DebugInfo<'a>, DwarfError> {
        let elf = object::File::parse(bytes).map_err(DwarfError::Elf)?;
        let endian = if elf.is_little_endian() {
            RunTimeEndian::Little
        } else {
            RunTimeEndian::Big
        };
        let section = |id: gimli::SectionId| -> Result<R<'a>, DwarfError> {
            let data = match elf.section_by_name(id.name()) {
                Some(s) => s.data().map_err(DwarfError::Elf)?,
                None => &[],
            };
            Ok(EndianSlice::new(data, endian))
        };
        if section(gimli::SectionId::DebugInfo)?.is_empty() {
            return Err(DwarfError::NoDwarf);
        }
        let dwarf = gimli::Dwarf::load(section)?;
        Ok(DebugInfo {
            dwarf,
            elf,
            units: OnceCell::new(),
            unit_starts: OnceCell::new(),
            parsed: RefCell::default(),
            symbols: OnceCell::new(),
            unsorted_lookups: std::cell::Cell::new(0),
        })
    }

    /// The GNU build id, the key of the on-disk index.
    pub fn build_id(&self) -> Option<&'a [u8]> {
        self.elf.build_id().ok().flatten()
    }

    /// The bytes of `lo..hi` from the section that holds them (`None` outside every section
    /// with contents).
    pub fn code(&self, lo: u64, hi: u64) -> Option<&'a [u8]> {
        let section = self
            .elf
            .sections()
            .find(|s| s.address() <= lo && hi <= s.address().saturating_add(s.size()))?;
        let data = section.data().ok()?;
        let start = usize::try_from(lo.checked_sub(section.address())?).ok()?;
        let end = usize::try_from(hi.checked_sub(section.address())?).ok()?;
        data.get(start..end)
    }

    /// The ELF function symbols.
    pub fn symbols(&self) -> &Symtab<'a> {
        self.symbols.get_or_init(|| Symtab::from_elf(&self.elf))
    }

    /// `addr` as gdb writes it (`<vfs_read+5>`), as [`Symtab::describe`]. The first few
    /// lookups scan the ELF symbols without building the sorted table (a query that
    /// describes two addresses should not pay for sorting 150,000 symbols); later ones build
    /// it once and search it.
    pub fn describe(&self, addr: u64) -> Option<String> {
        const UNSORTED: u32 = 8;
        if self.symbols.get().is_none() && self.unsorted_lookups.get() < UNSORTED {
            self.unsorted_lookups.set(self.unsorted_lookups.get() + 1);
            if let Ok(found) = symtab::describe_unsorted(&self.elf, addr) {
                return found;
            }
        }
        self.symbols().describe(addr)
    }

    /// Every unit header, in file order (read once).
    ///
    /// # Errors
    /// [`DwarfError::Gimli`] when a header is malformed.
    pub fn unit_headers(&self) -> Result<&[gimli::UnitHeader<R<'a>>], DwarfError> {
        if let Some(units) = self.units.get() {
            return Ok(units);
        }
        let mut found = Vec::new();
        let mut iter = self.dwarf.units();
        while let Some(header) = iter.next().map_err(gimli_err("unit header"))? {
            found.push(header);
        }
        Ok(self.units.get_or_init(|| found))
    }

    /// The `.debug_info` offset of every unit, in file order: from the name index when one
    /// was opened (see [`DebugInfo::seed_unit_starts`]), else by reading every unit header.
    ///
    /// # Errors
    /// [`DwarfError::Gimli`] when a header is malformed.
    pub fn unit_starts(&self) -> Result<&[u64], DwarfError> {
        if let Some(starts) = self.unit_starts.get() {
            return Ok(starts);
        }
        let starts = self.unit_headers()?.iter().map(unit_start).collect();
        Ok(self.unit_starts.get_or_init(|| starts))
    }

    /// Takes the unit offsets recorded in an index of this file, sparing the walk over every
    /// unit header. Ignored unless strictly increasing, and once offsets are known. An offset
    /// that is no unit's start (an index from a corrupt cache) gives errors from
    /// [`DebugInfo::unit_at`], never a panic.
    pub fn seed_unit_starts(&self, starts: Vec<u64>) {
        if !starts.is_empty() && starts.windows(2).all(|w| w[0] < w[1]) {
            let _ = self.unit_starts.set(starts);
        }
    }

    /// The parsed unit that starts at `.debug_info` offset `unit_offset`.
    ///
    /// # Errors
    /// [`DwarfError::Gimli`] when the unit is malformed.
    pub fn unit_at(&self, unit_offset: u64) -> Result<Rc<Unit<'a>>, DwarfError> {
        if let Some(unit) = self.parsed.borrow().get(&unit_offset) {
            return Ok(Rc::clone(unit));
        }
        let offset = gimli::DebugInfoOffset(
            usize::try_from(unit_offset).map_err(|_| DwarfError::NoUnitAt(unit_offset))?,
        );
        let header = self
            .dwarf
            .debug_info
            .header_from_offset(offset)
            .map_err(gimli_err(format!("unit at {unit_offset:#x}")))?;
        let unit = Rc::new(
            self.dwarf
                .unit(header)
                .map_err(gimli_err(format!("unit at {unit_offset:#x}")))?,
        );
        self.parsed
            .borrow_mut()
            .insert(unit_offset, Rc::clone(&unit));
        Ok(unit)
    }

    /// The unit holding DIE `die` and the DIE's offset inside it.
    ///
    /// # Errors
    /// [`DwarfError::NoUnitAt`] when no unit covers `die`.
    pub fn unit_of(&self, die: DieRef) -> Result<(Rc<Unit<'a>>, gimli::UnitOffset), DwarfError> {
        let starts = self.unit_starts()?;
        let at = starts.partition_point(|&s| s <= die.0);
        let start = *at
            .checked_sub(1)
            .and_then(|i| starts.get(i))
            .ok_or(DwarfError::NoUnitAt(die.0))?;
        let unit = self.unit_at(start)?;
        let local = gimli::DebugInfoOffset(
            usize::try_from(die.0).map_err(|_| DwarfError::NoUnitAt(die.0))?,
        )
        .to_unit_offset(&unit.header)
        .ok_or(DwarfError::NoUnitAt(die.0))?;
        Ok((unit, local))
    }

    /// The unit whose `.debug_aranges` entry covers `addr`: a few microseconds, no scan.
    ///
    /// # Errors
    /// [`DwarfError::Gimli`] when `.debug_aranges` is malformed.
    pub fn unit_for_address(&self, addr: u64) -> Result<Option<u64>, DwarfError> {
        let mut sets = self.dwarf.debug_aranges.headers();
        while let Some(set) = sets.next().map_err(gimli_err("aranges header"))? {
            let mut entries = set.entries();
            while let Some(range) = entries.next().map_err(gimli_err("aranges entry"))? {
                let r = range.range();
                if r.begin <= addr && addr < r.end {
                    return Ok(Some(set.debug_info_offset().0 as u64));
                }
            }
        }
        Ok(None)
    }

    /// A string attribute (`DW_AT_name` ...) of `entry` in `unit`, lossily decoded.
    pub fn attr_str(
        &self,
        unit: &Unit<'a>,
        entry: &gimli::DebuggingInformationEntry<'_, '_, R<'a>>,
        at: gimli::DwAt,
    ) -> Option<String> {
        let value = entry.attr_value(at).ok()??;
        let s = self.dwarf.attr_string(unit, value).ok()?;
        Some(String::from_utf8_lossy(s.slice()).into_owned())
    }

    /// The `.debug_info` offset of a DIE given as a reference attribute value of `unit`.
    pub fn die_ref(unit: &Unit<'a>, value: gimli::AttributeValue<R<'a>>) -> Option<DieRef> {
        match value {
            gimli::AttributeValue::UnitRef(off) => off
                .to_debug_info_offset(&unit.header)
                .map(|o| DieRef(o.0 as u64)),
            gimli::AttributeValue::DebugInfoRef(off) => Some(DieRef(off.0 as u64)),
            _ => None,
        }
    }

    /// The name of a DIE, following `DW_AT_abstract_origin` and `DW_AT_specification`
    /// (concrete instances of inline functions carry no name of their own).
    pub fn die_name(&self, die: DieRef) -> Option<String> {
        let mut cur = die;
        for _ in 0..8 {
            let (unit, off) = self.unit_of(cur).ok()?;
            let entry = unit.entry(off).ok()?;
            if let Some(name) = self.attr_str(&unit, &entry, gimli::DW_AT_name) {
                return Some(name);
            }
            let origin = entry
                .attr_value(gimli::DW_AT_abstract_origin)
                .ok()
                .flatten()
                .or_else(|| entry.attr_value(gimli::DW_AT_specification).ok().flatten())?;
            cur = Self::die_ref(&unit, origin)?;
        }
        None
    }
}

/// `.debug_info` offset of a unit header.
pub(crate) fn unit_start(header: &gimli::UnitHeader<R<'_>>) -> u64 {
    match header.offset() {
        gimli::UnitSectionOffset::DebugInfoOffset(o) => o.0 as u64,
        gimli::UnitSectionOffset::DebugTypesOffset(o) => o.0 as u64,
    }
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dwarf::testing::{fixture, fixture_file, names};

    #[test]
    fn open_names_a_missing_file() {
        let err = DebugFile::open(Path::new("/nonexistent/vmlinux")).unwrap_err();

        assert!(matches!(err, DwarfError::Open { .. }));
    }

    #[test]
    fn load_refuses_non_elf_and_elf_without_dwarf() {
        let Some(path) = fixture("dwarf_fixture", &[]) else {
            return;
        };
        let stripped = path.with_file_name("dwarf_fixture.stripped");
        let objcopy = std::process::Command::new("objcopy")
            .arg("--strip-debug")
            .arg(&path)
            .arg(&stripped)
            .output();
        let out = match objcopy {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("SKIP: objcopy is not installed");
                return;
            }
            Err(e) => panic!("cannot run objcopy: {e}"),
            Ok(out) => out,
        };
        assert!(
            out.status.success(),
            "objcopy --strip-debug {} failed ({}):\n{}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let bytes = std::fs::read(&stripped).unwrap();

        assert!(matches!(
            DebugInfo::new(b"not an ELF file"),
            Err(DwarfError::Elf(_))
        ));
        assert!(matches!(DebugInfo::new(&bytes), Err(DwarfError::NoDwarf)));
    }

    #[test]
    fn unit_of_a_die_outside_every_unit_is_an_error() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();

        assert!(matches!(
            info.unit_of(DieRef(u64::MAX / 2)),
            Err(DwarfError::NoUnitAt(_))
        ));
    }

    #[test]
    fn flipped_bytes_in_the_dwarf_give_errors_or_answers_never_panics() {
        let Some(file) = fixture_file() else { return };
        let good = file.bytes().to_vec();
        let elf = object::File::parse(good.as_slice()).unwrap();
        let ranges: Vec<(u64, u64)> = [
            ".debug_info",
            ".debug_abbrev",
            ".debug_line",
            ".debug_str",
            ".debug_loclists",
        ]
        .iter()
        .filter_map(|n| elf.section_by_name(n)?.file_range())
        .collect();
        for (start, len) in ranges {
            for at in (start..start + len).step_by(5) {
                let mut bad = good.clone();
                bad[at as usize] ^= 0xff;
                let Ok(info) = DebugInfo::new(&bad) else {
                    continue;
                };
                let Ok(index) = Index::build(&info, index::Layer::Names, &|_, _| {}) else {
                    continue;
                };
                let _ = Index::build(&info, index::Layer::Inlines, &|_, _| {});
                for e in index.iter() {
                    let _ = info.info_line(e.low);
                    let _ = info.variables(e.die, e.low);
                    let _ = crate::btf::cdecl::ptype(&info, types::TypeRef::new(e.die), true);
                }
            }
        }
        assert!(!names(&file.load().unwrap()).is_empty());
    }
}
