//! The one-pass scans that feed the [`index`](super::index): per unit, in parallel.
//!
//! The names layer reads only the unit's top-level DIEs (types, functions, variables) and
//! jumps over every subtree with `DW_AT_sibling`; the inlines layer walks every DIE to find
//! `DW_TAG_inlined_subroutine`. Names stay borrowed from `.debug_str` until the index is
//! written, so the scan allocates little.

use foldhash::HashMap;

use gimli::{AttributeValue, DwTag, UnitOffset};
use rayon::prelude::*;

use super::index::EntryKind;
use super::lines::file_path;
use super::{gimli_err, unit_start, DebugInfo, DwarfError, Unit, R};

/// An index entry before interning: the name borrowed from the file, the file name local to
/// the unit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawEntry<'a> {
    pub name: &'a [u8],
    pub kind: EntryKind,
    pub die: u64,
    pub low: u64,
    pub high: u64,
    /// Index into [`UnitEntries::files`]; `u32::MAX` for none.
    pub file: u32,
    pub line: u32,
}

/// What one unit contributed.
#[derive(Debug, Default)]
pub(crate) struct UnitEntries<'a> {
    pub entries: Vec<RawEntry<'a>>,
    pub files: Vec<String>,
    /// DIEs whose name could not be found (a reference outside the unit).
    pub unnamed: u64,
}

/// Which DIEs a scan collects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    /// Top-level types, functions with code, abstract inline functions, variables.
    Names,
    /// Every inlined instance (`DW_TAG_inlined_subroutine`), named by its abstract origin.
    Inlines,
}

/// The attributes of one DIE that the scans care about.
#[derive(Default)]
struct Attrs<'a> {
    name: Option<AttributeValue<R<'a>>>,
    decl_file: Option<u64>,
    decl_line: u64,
    declaration: bool,
    inline: bool,
    low: Option<AttributeValue<R<'a>>>,
    high: Option<AttributeValue<R<'a>>>,
    entry_pc: Option<AttributeValue<R<'a>>>,
    ranges: Option<AttributeValue<R<'a>>>,
    location: Option<AttributeValue<R<'a>>>,
    origin: Option<AttributeValue<R<'a>>>,
    sibling: Option<UnitOffset>,
}

fn read_attrs<'a>(
    cursor: &mut gimli::EntriesRaw<'_, '_, R<'a>>,
    abbrev: &gimli::Abbreviation,
) -> Result<Attrs<'a>, gimli::Error> {
    let mut a = Attrs::default();
    for spec in abbrev.attributes() {
        let attr = cursor.read_attribute(*spec)?;
        let value = attr.value();
        match attr.name() {
            gimli::DW_AT_name => a.name = Some(value),
            gimli::DW_AT_decl_file | gimli::DW_AT_call_file => a.decl_file = attr.udata_value(),
            gimli::DW_AT_decl_line | gimli::DW_AT_call_line => {
                a.decl_line = attr.udata_value().unwrap_or(0)
            }
            gimli::DW_AT_declaration => a.declaration = matches!(value, AttributeValue::Flag(true)),
            gimli::DW_AT_inline => a.inline = true,
            gimli::DW_AT_low_pc => a.low = Some(value),
            gimli::DW_AT_high_pc => a.high = Some(value),
            gimli::DW_AT_entry_pc => a.entry_pc = Some(value),
            gimli::DW_AT_ranges => a.ranges = Some(value),
            gimli::DW_AT_location => a.location = Some(value),
            gimli::DW_AT_abstract_origin | gimli::DW_AT_specification => a.origin = Some(value),
            gimli::DW_AT_sibling => {
                if let AttributeValue::UnitRef(off) = value {
                    a.sibling = Some(off);
                }
            }
            _ => {}
        }
    }
    Ok(a)
}

/// Per-unit state of a scan.
struct UnitScan<'u, 'a> {
    dwarf: &'u gimli::Dwarf<R<'a>>,
    unit: &'u Unit<'a>,
    out: UnitEntries<'a>,
    file_ids: HashMap<u64, u32>,
    /// Top-level named DIEs (abstract functions, declarations): unit offset → (name, file, line).
    named: HashMap<UnitOffset, (&'a [u8], u32, u32)>,
    /// Entries waiting for their origin's name: (entry index, origin).
    pending: Vec<(usize, AttributeValue<R<'a>>)>,
}

impl<'u, 'a> UnitScan<'u, 'a> {
    fn file_id(&mut self, index: Option<u64>) -> u32 {
        let Some(index) = index else { return u32::MAX };
        if let Some(id) = self.file_ids.get(&index) {
            return *id;
        }
        let path = file_path(self.dwarf, self.unit, index).unwrap_or_default();
        let id = u32::try_from(self.out.files.len()).unwrap_or(u32::MAX);
        self.out.files.push(path);
        self.file_ids.insert(index, id);
        id
    }

    fn name(&self, value: Option<AttributeValue<R<'a>>>) -> Option<&'a [u8]> {
        let s = self.dwarf.attr_string(self.unit, value?).ok()?;
        Some(s.slice())
    }

    /// Entry pc and end of the first range (gdb's `BLOCK_ENTRY_PC`), or `None` without code.
    fn pc_range(&self, a: &Attrs<'a>) -> Option<(u64, u64)> {
        let dwarf = self.dwarf;
        if let Some(low) = a
            .low
            .and_then(|v| dwarf.attr_address(self.unit, v).ok().flatten())
        {
            let high = match a.high? {
                AttributeValue::Udata(len) => low.checked_add(len)?,
                v => dwarf.attr_address(self.unit, v).ok().flatten()?,
            };
            // An inlined instance whose first instruction is not its entry (code of the
            // caller scheduled into it): the entry pc, as kprobes and SystemTap take it.
            let entry = a
                .entry_pc
                .and_then(|v| dwarf.attr_address(self.unit, v).ok().flatten())
                .filter(|pc| (low..high).contains(pc));
            return Some((entry.unwrap_or(low), high));
        }
        let offset = dwarf.attr_ranges_offset(self.unit, a.ranges?).ok()??;
        let mut ranges = dwarf.ranges(self.unit, offset).ok()?;
        let first = ranges.next().ok()??;
        let entry = a
            .entry_pc
            .and_then(|v| dwarf.attr_address(self.unit, v).ok().flatten());
        match entry {
            // An entry pc inside a later range: report the range that holds it. One in no
            // range at all (GCC gives some instances the pc of caller code scheduled before
            // them, where none of their variables is in scope): the first range, where the
            // instance's own code begins.
            Some(pc) if !(first.begin <= pc && pc < first.end) => {
                let mut found = (first.begin, first.end);
                while let Ok(Some(r)) = ranges.next() {
                    if r.begin <= pc && pc < r.end {
                        found = (pc, r.end);
                    }
                }
                Some(found)
            }
            _ => Some((first.begin, first.end)),
        }
    }

    fn push(&mut self, a: &Attrs<'a>, kind: EntryKind, die: UnitOffset, pc: (u64, u64)) {
        let file = self.file_id(a.decl_file);
        let line = u32::try_from(a.decl_line).unwrap_or(u32::MAX);
        let global = self.global(die);
        let name = self.name(a.name);
        let entry = RawEntry {
            name: name.unwrap_or_default(),
            kind,
            die: global,
            low: pc.0,
            high: pc.1,
            file,
            line,
        };
        if name.is_none() {
            if let Some(origin) = a.origin {
                self.pending.push((self.out.entries.len(), origin));
            } else {
                return;
            }
        }
        self.out.entries.push(entry);
    }

    fn global(&self, off: UnitOffset) -> u64 {
        off.to_debug_info_offset(&self.unit.header)
            .map_or(0, |o| o.0 as u64)
    }

    /// A top-level DIE of the names layer.
    fn top_level(&mut self, tag: DwTag, a: &Attrs<'a>, die: UnitOffset) {
        if tag == gimli::DW_TAG_subprogram && a.name.is_some() {
            let file = self.file_id(a.decl_file);
            if let Some(name) = self.name(a.name) {
                self.named.insert(
                    die,
                    (name, file, u32::try_from(a.decl_line).unwrap_or(u32::MAX)),
                );
            }
        }
        if a.declaration {
            return;
        }
        let kind = match tag {
            gimli::DW_TAG_structure_type => EntryKind::Struct,
            gimli::DW_TAG_union_type => EntryKind::Union,
            gimli::DW_TAG_enumeration_type => EntryKind::Enum,
            gimli::DW_TAG_typedef => EntryKind::Typedef,
            gimli::DW_TAG_base_type => EntryKind::BaseType,
            gimli::DW_TAG_variable if a.location.is_some() => EntryKind::Variable,
            gimli::DW_TAG_subprogram => match self.pc_range(a) {
                Some(pc) => return self.push(a, EntryKind::Function, die, pc),
                None if a.inline => EntryKind::Abstract,
                None => return,
            },
            _ => return,
        };
        if kind != EntryKind::Variable && kind != EntryKind::Abstract && a.name.is_none() {
            return;
        }
        let pc = if kind == EntryKind::Variable {
            (variable_address(a.location).unwrap_or(0), 0)
        } else {
            (0, 0)
        };
        self.push(a, kind, die, pc);
    }

    /// Names entries from their abstract origin / specification.
    fn resolve_pending(&mut self) {
        for (at, origin) in std::mem::take(&mut self.pending) {
            let found = match origin {
                AttributeValue::UnitRef(off) => self
                    .named
                    .get(&off)
                    .copied()
                    .or_else(|| self.read_name(off)),
                _ => None,
            };
            match (found, self.out.entries.get_mut(at)) {
                (Some((name, file, line)), Some(e)) => {
                    e.name = name;
                    if e.kind != EntryKind::Inlined && e.file == u32::MAX {
                        e.file = file;
                        e.line = line;
                    }
                }
                _ => self.out.unnamed += 1,
            }
        }
        self.out.entries.retain(|e| !e.name.is_empty());
    }

    /// Reads the name of a DIE that was not at top level (or not seen yet).
    fn read_name(&mut self, off: UnitOffset) -> Option<(&'a [u8], u32, u32)> {
        let entry = self.unit.entry(off).ok()?;
        let name = self.name(entry.attr_value(gimli::DW_AT_name).ok()?)?;
        let file = entry
            .attr(gimli::DW_AT_decl_file)
            .ok()
            .flatten()
            .and_then(|a| a.udata_value());
        let line = entry
            .attr(gimli::DW_AT_decl_line)
            .ok()
            .flatten()
            .and_then(|a| a.udata_value())
            .unwrap_or(0);
        Some((
            name,
            self.file_id(file),
            u32::try_from(line).unwrap_or(u32::MAX),
        ))
    }
}

/// `DW_OP_addr A` → A.
fn variable_address(location: Option<AttributeValue<R<'_>>>) -> Option<u64> {
    let AttributeValue::Exprloc(expr) = location? else {
        return None;
    };
    let bytes = expr.0.slice();
    let (&op, rest) = bytes.split_first()?;
    (op == gimli::DW_OP_addr.0 && rest.len() == 8)
        .then(|| u64::from_le_bytes(rest.try_into().unwrap_or([0; 8])))
}

/// Scans one unit.
fn scan_unit<'a>(
    dwarf: &gimli::Dwarf<R<'a>>,
    unit: &Unit<'a>,
    layer: Layer,
) -> Result<UnitEntries<'a>, gimli::Error> {
    let mut s = UnitScan {
        dwarf,
        unit,
        out: UnitEntries::default(),
        file_ids: HashMap::default(),
        named: HashMap::default(),
        pending: Vec::new(),
    };
    let mut cursor = unit.entries_raw(None)?;
    // The cursor restarts at depth 0 after a jump to a sibling; `bias` keeps true depths.
    let mut bias = 0isize;
    while !cursor.is_empty() {
        let offset = cursor.next_offset();
        let depth = cursor.next_depth() + bias;
        let Some(abbrev) = cursor.read_abbreviation()? else {
            if depth <= 0 {
                break;
            }
            continue;
        };
        let tag = abbrev.tag();
        let top = depth == 1;
        let wanted = match layer {
            Layer::Names => top,
            Layer::Inlines => {
                tag == gimli::DW_TAG_inlined_subroutine || (top && tag == gimli::DW_TAG_subprogram)
            }
        };
        if !wanted && (!top || !abbrev.has_children() || layer != Layer::Names) {
            cursor.skip_attributes(abbrev.attributes())?;
            continue;
        }
        let attrs = read_attrs(&mut cursor, abbrev)?;
        match layer {
            Layer::Names => s.top_level(tag, &attrs, offset),
            Layer::Inlines if tag == gimli::DW_TAG_inlined_subroutine => {
                if let Some(pc) = s.pc_range(&attrs) {
                    s.push(
                        &Attrs {
                            name: None,
                            ..attrs
                        },
                        EntryKind::Inlined,
                        offset,
                        pc,
                    );
                }
            }
            Layer::Inlines => {
                if let (Some(name), true) = (s.name(attrs.name), attrs.inline) {
                    let file = s.file_id(attrs.decl_file);
                    s.named.insert(
                        offset,
                        (
                            name,
                            file,
                            u32::try_from(attrs.decl_line).unwrap_or(u32::MAX),
                        ),
                    );
                }
            }
        }
        if layer == Layer::Names && top && abbrev.has_children() {
            // Only forward jumps: a hostile sibling pointing back would loop forever.
            if let Some(sibling) = attrs.sibling.filter(|s| *s > cursor.next_offset()) {
                cursor = unit.entries_raw(Some(sibling))?;
                bias = 1;
            }
        }
    }
    s.resolve_pending();
    Ok(s.out)
}

/// Scans every unit in parallel, calling `progress(done_bytes, total_bytes)` as units finish.
///
/// # Errors
/// [`DwarfError::Gimli`] for the first malformed unit.
pub(crate) fn scan<'a>(
    info: &DebugInfo<'a>,
    layer: Layer,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Vec<UnitEntries<'a>>, DwarfError> {
    let headers: Vec<_> = info.unit_headers()?.to_vec();
    let total: u64 = headers
        .iter()
        .map(|h| h.length_including_self() as u64)
        .sum();
    let done = std::sync::atomic::AtomicU64::new(0);
    let dwarf = &info.dwarf;
    // DebugInfo's unit cache is single-threaded; each worker parses its own units from the
    // shared, read-only gimli Dwarf instead.
    let results: Vec<Result<UnitEntries<'a>, DwarfError>> = headers
        .par_iter()
        .map(|header| {
            let start = unit_start(header);
            let unit = dwarf
                .unit(*header)
                .map_err(gimli_err(format!("unit at {start:#x}")))?;
            let out = scan_unit(dwarf, &unit, layer)
                .map_err(gimli_err(format!("DIEs of the unit at {start:#x}")))?;
            let now = done.fetch_add(
                header.length_including_self() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            progress(now + header.length_including_self() as u64, total);
            Ok(out)
        })
        .collect();
    results.into_iter().collect()
}
