//! Line tables, read the way gdb reads them, so that `exotap lines` and gdb's `info line`
//! give the same answers: rows are grouped per source file ("subfile"), an end marker
//! (line 0) is inserted where the program switches files, same-line rows with non-zero
//! discriminators are dropped, rows at one address prefer `is_stmt`, and a pc's line runs
//! to the next row of any file of the unit (gdb 13, `dwarf2/read.c` `lnp_state_machine`,
//! `buildsym.c`, `symtab.c` `find_pc_sect_line`).

use std::fmt;

use super::{gimli_err, DebugInfo, DwarfError, Unit, R};

/// A source file path as gdb names it: the include directory joined with the file name
/// (`fs/read_write.c`, `include/linux/fs.h`), or the name alone when it is absolute.
pub fn file_path(dwarf: &gimli::Dwarf<R<'_>>, unit: &Unit<'_>, index: u64) -> Option<String> {
    let header = unit.line_program.as_ref()?.header();
    file_path_in(dwarf, unit, header, index)
}

fn file_path_in(
    dwarf: &gimli::Dwarf<R<'_>>,
    unit: &Unit<'_>,
    header: &gimli::LineProgramHeader<R<'_>>,
    index: u64,
) -> Option<String> {
    let file = header.file(index)?;
    let name = dwarf.attr_string(unit, file.path_name()).ok()?;
    let name = String::from_utf8_lossy(name.slice()).into_owned();
    // DWARF 5 numbers the compilation directory 0 and gdb joins it too; DWARF 4 has no 0.
    let dir_index = file.directory_index();
    if name.starts_with('/') || (header.version() < 5 && dir_index == 0) {
        return Some(name);
    }
    let dir = file
        .directory(header)
        .and_then(|d| dwarf.attr_string(unit, d).ok());
    Some(match dir {
        Some(dir) if !dir.is_empty() => {
            let dir = String::from_utf8_lossy(dir.slice());
            format!("{}/{name}", dir.trim_end_matches('/'))
        }
        _ => name,
    })
}

/// One row of a subfile's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Row {
    /// Address.
    pub addr: u64,
    /// Line; 0 marks the end of a run.
    pub line: u32,
    /// Whether the row is a recommended breakpoint location.
    pub is_stmt: bool,
}

/// The rows of one source file of a unit, sorted by address (end markers first at ties).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subfile {
    /// The file, as [`file_path`] names it.
    pub name: String,
    /// Its rows.
    pub rows: Vec<Row>,
}

/// A unit's line table as gdb builds it.
#[derive(Debug, Clone, Default)]
pub struct LineTable {
    /// Subfiles in gdb's search order: the unit's main file, then newest first.
    pub subfiles: Vec<Subfile>,
}

/// The line holding a pc: where it starts and where the next line starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PcLine {
    /// The file.
    pub file: String,
    /// The line.
    pub line: u32,
    /// First address of the line's range.
    pub start: u64,
    /// First address after it.
    pub end: u64,
}

/// Builds subfile tables out of a row stream, as gdb's line-number state machine does.
#[derive(Debug, Default)]
pub(crate) struct TableBuilder {
    subfiles: Vec<Subfile>,
    /// Per sequence: the subfile and line of the last recorded row.
    last: Option<(usize, u32)>,
    last_addr: Option<u64>,
    stmt_at_addr: bool,
    nonzero_discriminator: bool,
}

impl TableBuilder {
    pub(crate) fn subfile(&mut self, name: &str) -> usize {
        match self.subfiles.iter().position(|s| s.name == name) {
            Some(i) => i,
            None => {
                self.subfiles.push(Subfile {
                    name: name.to_owned(),
                    rows: Vec::new(),
                });
                self.subfiles.len() - 1
            }
        }
    }

    /// Starts a sequence (gdb makes a fresh state machine per sequence).
    pub(crate) fn start_sequence(&mut self) {
        self.last = None;
        self.last_addr = None;
        self.stmt_at_addr = false;
        self.nonzero_discriminator = false;
    }

    /// buildsym's `record_line`: an end marker drops rows at its address, and none is
    /// recorded after another marker or in an empty table.
    fn record(&mut self, sub: usize, line: u32, addr: u64, is_stmt: bool) {
        let Some(s) = self.subfiles.get_mut(sub) else {
            return;
        };
        if line == 0 {
            let mut last_line = None;
            while let Some(last) = s.rows.last() {
                last_line = Some(last.line);
                if last.addr != addr {
                    break;
                }
                s.rows.pop();
            }
            if last_line.is_none_or(|l| l == 0) {
                return;
            }
        }
        s.rows.push(Row {
            addr,
            line,
            is_stmt,
        });
    }

    /// One row of the line program (`end_sequence` rows included).
    pub(crate) fn row(
        &mut self,
        sub: usize,
        line: u32,
        addr: u64,
        is_stmt: bool,
        discriminator: u64,
        end_sequence: bool,
    ) {
        let line_changed = self.last.is_none_or(|(_, l)| l != line);
        if line_changed {
            self.nonzero_discriminator = discriminator != 0;
        } else {
            self.nonzero_discriminator |= discriminator != 0;
        }
        let file_changed = self.last.map(|(s, _)| s) != Some(sub);
        let ignore = (file_changed
            && !end_sequence
            && self.last_addr == Some(addr)
            && !is_stmt
            && self.stmt_at_addr)
            || (!end_sequence && line == 0);
        if (file_changed && !ignore) || end_sequence {
            if let Some((last_sub, _)) = self.last {
                self.record(last_sub, 0, addr, true);
            }
        }
        if !end_sequence && !ignore {
            let record = file_changed || line_changed || !self.nonzero_discriminator;
            if record {
                self.record(sub, line, addr, is_stmt);
            }
            self.last = Some((sub, line));
        }
        if self.last_addr != Some(addr) {
            self.stmt_at_addr = false;
            self.last_addr = Some(addr);
        }
        self.stmt_at_addr |= is_stmt;
    }

    /// Sorts each subfile (end markers first at equal addresses) and orders the subfiles
    /// main file first, then newest first.
    pub(crate) fn finish(mut self, main: usize) -> LineTable {
        for s in &mut self.subfiles {
            s.rows.sort_by(|a, b| {
                a.addr
                    .cmp(&b.addr)
                    .then(((a.line != 0) as u8).cmp(&((b.line != 0) as u8)))
            });
        }
        let mut order: Vec<usize> = (0..self.subfiles.len())
            .rev()
            .filter(|&i| i != main)
            .collect();
        order.insert(0, main);
        let mut slots: Vec<Option<Subfile>> = self.subfiles.into_iter().map(Some).collect();
        let subfiles = order
            .into_iter()
            .filter_map(|i| slots.get_mut(i).and_then(Option::take))
            .collect();
        LineTable { subfiles }
    }
}

impl LineTable {
    /// The line table of `unit`.
    ///
    /// # Errors
    /// [`DwarfError::Gimli`] when the line program is malformed.
    pub fn for_unit(info: &DebugInfo<'_>, unit: &Unit<'_>) -> Result<LineTable, DwarfError> {
        let mut b = TableBuilder::default();
        let main_name = unit
            .name
            .map(|n| String::from_utf8_lossy(n.slice()).into_owned())
            .unwrap_or_default();
        let main = b.subfile(&main_name);
        let Some(program) = unit.line_program.clone() else {
            return Ok(b.finish(main));
        };
        let mut names: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
        let mut rows = program.rows();
        let mut skip_sequence = false;
        let mut new_sequence = true;
        while let Some((header, row)) = rows.next_row().map_err(gimli_err("line program"))? {
            let addr = row.address();
            if new_sequence {
                b.start_sequence();
                // A sequence at address 0 is code the linker discarded; gdb ignores it.
                skip_sequence = addr == 0;
                new_sequence = false;
            }
            if row.end_sequence() {
                new_sequence = true;
            }
            if skip_sequence {
                continue;
            }
            let file = row.file_index();
            let sub = match names.get(&file) {
                Some(&s) => s,
                None => {
                    let name = file_path_in(&info.dwarf, unit, header, file).unwrap_or_default();
                    let s = b.subfile(&name);
                    names.insert(file, s);
                    s
                }
            };
            let line = row
                .line()
                .map_or(0, |l| u32::try_from(l.get()).unwrap_or(u32::MAX));
            b.row(
                sub,
                line,
                addr,
                row.is_stmt(),
                row.discriminator(),
                row.end_sequence(),
            );
        }
        Ok(b.finish(main))
    }

    /// gdb's `find_pc_sect_line` within this unit: the line holding `pc` and its range.
    pub fn find_pc(&self, pc: u64) -> Option<PcLine> {
        let mut best: Option<(usize, usize)> = None;
        let mut best_end = 0u64;
        let mut alt: Option<u64> = None;
        for (si, sub) in self.subfiles.iter().enumerate() {
            let rows = &sub.rows;
            let Some(first) = rows.first() else { continue };
            if first.addr > pc && alt.is_none_or(|a| first.addr < a) {
                alt = Some(first.addr);
            }
            // gdb 13 ends the range at the very next row, even a non-statement row of the
            // same line (later gdbs skip those).
            let item = rows.partition_point(|r| r.addr <= pc);
            let prev = item.checked_sub(1);
            let best_addr = best
                .and_then(|(s, r)| self.subfiles.get(s)?.rows.get(r))
                .map(|r| r.addr);
            if let Some(p) = prev {
                if rows[p].line != 0 && best_addr.is_none_or(|b| rows[p].addr > b) {
                    let mut chosen = p;
                    if !rows[chosen].is_stmt {
                        let mut tmp = chosen;
                        while tmp > 0
                            && rows[tmp - 1].addr == rows[tmp].addr
                            && rows[tmp - 1].line != 0
                            && !rows[tmp].is_stmt
                        {
                            tmp -= 1;
                        }
                        if rows[tmp].is_stmt {
                            chosen = tmp;
                        }
                    }
                    best = Some((si, chosen));
                    if best_end <= rows[chosen].addr {
                        best_end = 0;
                    }
                }
            }
            let best_addr = best
                .and_then(|(s, r)| self.subfiles.get(s)?.rows.get(r))
                .map(|r| r.addr);
            if let (Some(b), Some(next)) = (best_addr, rows.get(item)) {
                if next.addr > b && (best_end == 0 || best_end > next.addr) {
                    best_end = next.addr;
                }
            }
        }
        let (s, r) = best?;
        let sub = self.subfiles.get(s)?;
        let row = sub.rows.get(r)?;
        if row.line == 0 {
            return None;
        }
        let end = match alt {
            Some(a) if best_end == 0 || a <= best_end => a,
            _ => best_end,
        };
        Some(PcLine {
            file: sub.name.clone(),
            line: row.line,
            start: row.addr,
            end,
        })
    }

    /// Start addresses of the rows for `line` in files whose path ends with `file`
    /// (`fs/open.c` matches `fs/open.c`, not `xfs/open.c`), as (file, line, address). Rows
    /// marked `is_stmt` when any exist; when `line` has no code, gdb's choice: the nearest
    /// later line that has some.
    pub fn addresses_of_line(&self, file: &str, line: u32) -> Vec<(String, u32, u64)> {
        let rows = || {
            self.subfiles
                .iter()
                .filter(|s| path_matches(&s.name, file))
                .flat_map(|s| s.rows.iter().map(move |r| (s.name.as_str(), *r)))
        };
        let target = if rows().any(|(_, r)| r.line == line) {
            line
        } else {
            match rows().map(|(_, r)| r.line).filter(|&l| l > line).min() {
                Some(next) => next,
                None => return Vec::new(),
            }
        };
        let hits: Vec<(&str, Row)> = rows().filter(|(_, r)| r.line == target).collect();
        let any_stmt = hits.iter().any(|(_, r)| r.is_stmt);
        let mut out: Vec<(String, u32, u64)> = hits
            .into_iter()
            .filter(|(_, r)| r.is_stmt || !any_stmt)
            .map(|(name, r)| (name.to_owned(), target, r.addr))
            .collect();
        out.sort_by_key(|(_, _, a)| *a);
        out.dedup_by_key(|(_, _, a)| *a);
        out
    }

    /// Every row (of all files) with `low <= addr < high`, by address: a function's lines.
    pub fn rows_in(&self, low: u64, high: u64) -> Vec<(&str, Row)> {
        let mut rows: Vec<(&str, Row)> = self
            .subfiles
            .iter()
            .flat_map(|s| {
                s.rows
                    .iter()
                    .filter(|r| r.addr >= low && r.addr < high && r.line != 0)
                    .map(|r| (s.name.as_str(), *r))
            })
            .collect();
        rows.sort_by_key(|(_, r)| r.addr);
        rows
    }
}

/// Whether `path` is `file` or ends with `/file`.
pub fn path_matches(path: &str, file: &str) -> bool {
    path == file
        || path
            .strip_suffix(file)
            .is_some_and(|head| head.ends_with('/'))
}

/// The answer to gdb's `info line FUNC`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InfoLine {
    /// `Line N of "FILE" starts at address A <f> and ends at B <f+n>.`
    Range {
        /// The line and its range.
        line: PcLine,
        /// `<sym+off>` of the start.
        start_sym: String,
        /// `<sym+off>` of the end.
        end_sym: String,
    },
    /// `No line number information available for address A <f>`
    NoLine {
        /// The address.
        addr: u64,
        /// `<sym+off>`.
        sym: String,
    },
}

impl fmt::Display for InfoLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InfoLine::Range { line, start_sym, end_sym: _ } if line.start == line.end => write!(
                f,
                "Line {} of \"{}\" is at address {:#x} {start_sym} but contains no code.",
                line.line, line.file, line.start
            ),
            InfoLine::Range { line, start_sym, end_sym } => write!(
                f,
                "Line {} of \"{}\" starts at address {:#x} {start_sym} and ends at {:#x} {end_sym}.",
                line.line, line.file, line.start, line.end
            ),
            InfoLine::NoLine { addr, sym } => write!(f, "No line number information available for address {addr:#x} {sym}"),
        }
    }
}

impl<'a> DebugInfo<'a> {
    /// The line table of the unit covering `addr` (by `.debug_aranges`).
    ///
    /// # Errors
    /// [`DwarfError::NoUnitAt`] when no unit covers it; DWARF errors.
    pub fn line_table_at(&self, addr: u64) -> Result<LineTable, DwarfError> {
        let unit_off = self
            .unit_for_address(addr)?
            .ok_or(DwarfError::NoUnitAt(addr))?;
        let unit = self.unit_at(unit_off)?;
        LineTable::for_unit(self, &unit)
    }

    /// The address ranges of a DIE with code (a function or inlined instance), in DWARF order.
    ///
    /// # Errors
    /// DWARF errors reading the DIE or its range list.
    pub fn pc_ranges(&self, die: super::DieRef) -> Result<Vec<(u64, u64)>, DwarfError> {
        let (unit, off) = self.unit_of(die)?;
        let entry = unit.entry(off).map_err(gimli_err("DIE"))?;
        let mut iter = self
            .dwarf
            .die_ranges(&unit, &entry)
            .map_err(gimli_err("DIE ranges"))?;
        let mut out = Vec::new();
        while let Some(r) = iter.next().map_err(gimli_err("DIE ranges"))? {
            out.push((r.begin, r.end));
        }
        Ok(out)
    }

    /// Addresses of `file:line` in every unit that declares something in `file` (its
    /// functions, inline functions or variables, found with the name index), by address.
    ///
    /// # Errors
    /// DWARF errors reading units or line programs.
    pub fn line_addresses(
        &self,
        index: &super::Index,
        file: &str,
        line: u32,
    ) -> Result<Vec<(String, u32, u64)>, DwarfError> {
        let mut units: Vec<u64> = Vec::new();
        for e in index.iter().filter(|e| path_matches(e.file, file)) {
            let (unit, _) = self.unit_of(e.die)?;
            units.push(super::unit_start(&unit.header));
        }
        units.sort_unstable();
        units.dedup();
        let mut out = Vec::new();
        for u in units {
            let unit = self.unit_at(u)?;
            out.extend(LineTable::for_unit(self, &unit)?.addresses_of_line(file, line));
        }
        out.sort_by_key(|(_, _, a)| *a);
        out.dedup_by_key(|(_, _, a)| *a);
        Ok(out)
    }

    /// gdb's `info line` for a function whose entry pc is `entry`.
    ///
    /// # Errors
    /// As [`DebugInfo::line_table_at`].
    pub fn info_line(&self, entry: u64) -> Result<InfoLine, DwarfError> {
        let table = self.line_table_at(entry)?;
        let sym = |a: u64| self.describe(a).unwrap_or_default();
        match table.find_pc(entry) {
            Some(found) if found.start >= entry => {
                // gdb looks the line up again from its start (find_line_pc_range).
                let line = table.find_pc(found.start).unwrap_or(found);
                Ok(InfoLine::Range {
                    start_sym: sym(line.start),
                    end_sym: sym(line.end),
                    line,
                })
            }
            _ => Ok(InfoLine::NoLine {
                addr: entry,
                sym: sym(entry),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dwarf::testing::{fixture_file, gdb_batch, have_gdb, names};
    use crate::dwarf::EntryKind;

    /// A builder with subfiles "a.c" (main, 0) and "b.h" (1).
    fn builder() -> TableBuilder {
        let mut b = TableBuilder::default();
        b.subfile("a.c");
        b.subfile("b.h");
        b.start_sequence();
        b
    }

    #[test]
    fn switching_files_ends_the_old_file_with_a_marker_that_drops_rows_at_its_address() {
        let mut b = builder();
        b.row(0, 10, 0x100, true, 0, false);
        b.row(0, 11, 0x104, true, 0, false);
        b.row(1, 50, 0x104, true, 0, false);
        b.row(1, 50, 0x108, true, 0, true);

        let t = b.finish(0);

        let a: Vec<(u64, u32)> = t.subfiles[0]
            .rows
            .iter()
            .map(|r| (r.addr, r.line))
            .collect();
        let h: Vec<(u64, u32)> = t.subfiles[1]
            .rows
            .iter()
            .map(|r| (r.addr, r.line))
            .collect();
        assert_eq!(a, vec![(0x100, 10), (0x104, 0)]);
        assert_eq!(h, vec![(0x104, 50), (0x108, 0)]);
    }

    #[test]
    fn a_non_statement_row_switching_back_at_the_same_address_is_ignored() {
        let mut b = builder();
        b.row(0, 10, 0x100, true, 0, false);
        b.row(1, 50, 0x100, true, 0, false);
        b.row(0, 10, 0x100, false, 0, false);
        b.row(1, 50, 0x101, false, 0, false);
        b.row(1, 50, 0x110, true, 0, true);

        let t = b.finish(0);

        // The pc's line is the header's, even though the main file's marker sorts first.
        let found = t.find_pc(0x100).unwrap();
        assert_eq!(
            (found.file.as_str(), found.line, found.start, found.end),
            ("b.h", 50, 0x100, 0x101)
        );
    }

    #[test]
    fn same_line_rows_with_discriminators_are_not_recorded_again() {
        let mut b = builder();
        b.row(0, 10, 0x100, true, 0, false);
        b.row(0, 10, 0x104, true, 3, false);
        b.row(0, 10, 0x108, true, 3, false);
        b.row(0, 11, 0x10c, true, 0, false);
        b.row(0, 11, 0x110, true, 0, true);

        let t = b.finish(0);

        let lines: Vec<(u64, u32)> = t.subfiles[0]
            .rows
            .iter()
            .map(|r| (r.addr, r.line))
            .collect();
        assert_eq!(lines, vec![(0x100, 10), (0x10c, 11), (0x110, 0)]);
    }

    #[test]
    fn find_pc_ends_a_line_at_the_next_row_even_a_non_statement_one() {
        let mut b = builder();
        b.row(0, 451, 0x950, true, 0, false);
        b.row(0, 451, 0x955, false, 0, false);
        b.row(0, 454, 0x963, true, 0, false);
        b.row(0, 454, 0x970, true, 0, true);

        let t = b.finish(0);

        assert_eq!(
            t.find_pc(0x950).map(|l| (l.line, l.start, l.end)),
            Some((451, 0x950, 0x955))
        );
        assert_eq!(t.find_pc(0x970), None);
        assert_eq!(t.find_pc(0x900), None);
    }

    #[test]
    fn addresses_of_line_falls_forward_to_the_next_line_with_code() {
        let mut b = builder();
        b.row(0, 10, 0x100, true, 0, false);
        b.row(0, 12, 0x104, true, 0, false);
        b.row(0, 12, 0x108, false, 0, false);
        b.row(0, 12, 0x10c, true, 0, true);
        let t = b.finish(0);

        assert_eq!(
            t.addresses_of_line("a.c", 11),
            vec![("a.c".to_owned(), 12, 0x104)]
        );
        assert_eq!(t.addresses_of_line("x/a.c", 10), vec![]);
        assert!(path_matches("fs/open.c", "open.c") && !path_matches("fs/reopen.c", "open.c"));
    }

    #[test]
    fn info_line_of_fixture_functions_equals_gdbs() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);
        let funcs = ["task_pid", "sum_pids", "main"];

        let ours: Vec<String> = funcs
            .iter()
            .map(|f| {
                let e = index.lookup_kind(f, EntryKind::Function).next().unwrap();
                format!("{}\n", info.info_line(e.low).unwrap())
            })
            .collect();

        assert!(
            ours[0].starts_with("Line 34 of \"")
                && ours[0].contains("dwarf_fixture.c\" starts at address")
        );
        if have_gdb() {
            let commands: Vec<String> = funcs.iter().map(|f| format!("info line {f}")).collect();
            let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
            assert_eq!(ours, gdb_batch(file.path(), &commands)[..3].to_vec());
        }
    }

    #[test]
    fn line_addresses_finds_the_loop_line_inside_sum_pids() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);
        let sum = index
            .lookup_kind("sum_pids", EntryKind::Function)
            .next()
            .unwrap();

        let sites = info.line_addresses(&index, "dwarf_fixture.c", 46).unwrap();

        assert!(!sites.is_empty());
        assert!(sites.iter().all(|(f, l, a)| f.ends_with("dwarf_fixture.c")
            && *l == 46
            && (sum.low..sum.high).contains(a)));
    }
}
