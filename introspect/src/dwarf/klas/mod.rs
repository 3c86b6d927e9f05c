//! KLAS join points without compiler changes: the instructions that read or write member M of
//! struct S, or call through a function-pointer member, found from DWARF (parameter and local
//! locations, types, layouts) and disassembly with register copy propagation (`flow`).
//!
//! KLAS (Tokyo Tech) needed a modified gcc to mark member accesses; here a register is known
//! to point to `struct S` because DWARF says a variable of type `S *` lives in it over that pc
//! range, or because it was copied from such a register, loaded from a pointer member, or
//! computed as the address of an embedded member. A memory operand based on it, at
//! displacement `offsetof(S, M)`, is an access to M.
//!
//! Validation: the test `join_points_of_the_test_program_match_its_traced_accesses` builds
//! `guest-images/testprogs/klas.c` with `gcc -g -O2`, runs it and records every executed access
//! to its struct instances, then prints precision and recall of the static answer. The issue
//! asked for the run to be in Unicorn; the workspace has no Unicorn binding, and the program is
//! native x86-64, so the test-only `tracer` single-steps it under ptrace instead (same
//! observation: which instruction touched which bytes, read or write).

mod cache;
mod facts;
mod flow;
#[cfg(test)]
mod tracer;

use std::collections::BTreeMap;
use std::fmt;

use rayon::prelude::*;

use super::index::{Entry, EntryKind, Index};
use super::lines::LineTable;
use super::{unit_start, DebugInfo, DwarfError};
pub use cache::join_points_cached;
pub use facts::Globals;
use facts::Layouts;
use flow::Pass;

/// Errors of finding join points.
#[derive(Debug, thiserror::Error)]
pub enum KlasError {
    /// The query does not parse.
    #[error("`{0}` is not a member query like `struct file.f_pos` or `file_operations.read_iter`")]
    BadQuery(String),
    /// Reading the debug info failed.
    #[error(transparent)]
    Dwarf(#[from] DwarfError),
    /// A worker thread could not read the debug file that the caller had read.
    #[error("a worker could not read the debug file again: {0}")]
    Worker(String),
}

/// How an instruction touches the member.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Access {
    /// Loads it.
    Read,
    /// Stores it.
    Write,
    /// Both (`add [rbx+0x68], rax`).
    ReadWrite,
    /// Calls through it (a function-pointer member).
    Call,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "read",
            Access::Write => "write",
            Access::ReadWrite => "read-write",
            Access::Call => "call",
        })
    }
}

/// Which member accesses to find: `struct file.f_pos`, `file_operations.read_iter`, or a
/// whole struct (`struct sk_buff`: every member).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberQuery {
    /// The struct or union name.
    pub struct_name: String,
    /// The member path (`f_pos`, `f_path.dentry`); empty for every member.
    pub member: String,
}

impl MemberQuery {
    /// Parses `[struct |union ]NAME[.MEMBER[.MEMBER...]]`.
    ///
    /// # Errors
    /// [`KlasError::BadQuery`] when a name is empty or not an identifier.
    pub fn parse(text: &str) -> Result<MemberQuery, KlasError> {
        let t = text.trim();
        let t = t
            .strip_prefix("struct ")
            .or_else(|| t.strip_prefix("union "))
            .unwrap_or(t)
            .trim();
        let (name, member) = t.split_once('.').unwrap_or((t, ""));
        let ident =
            |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ident(name) || (!member.is_empty() && !member.split('.').all(ident)) {
            return Err(KlasError::BadQuery(text.to_owned()));
        }
        Ok(MemberQuery {
            struct_name: name.to_owned(),
            member: member.to_owned(),
        })
    }

    /// Whether an access to `path` of `struct_name` is wanted (`f_path` matches `f_path.dentry`).
    pub fn matches(&self, struct_name: &str, path: &str) -> bool {
        struct_name == self.struct_name
            && (self.member.is_empty()
                || path == self.member
                || path
                    .strip_prefix(self.member.as_str())
                    .is_some_and(|rest| rest.starts_with('.')))
    }
}

/// One join point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinPoint {
    /// The instruction's address.
    pub addr: u64,
    /// `<function+offset>`.
    pub function: String,
    /// Source file (gdb's line-table view: an inlined helper's header shows as such).
    pub file: String,
    /// Source line; 0 when unknown.
    pub line: u32,
    /// Read, write, read-write or call.
    pub access: Access,
    /// `struct.member.path`.
    pub member: String,
}

impl fmt::Display for JoinPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:#x} {} {}:{} {} {}",
            self.addr, self.function, self.file, self.line, self.access, self.member
        )
    }
}

impl<'a> DebugInfo<'a> {
    /// The member accesses of `query` in one function (an index entry of kind `Function`).
    ///
    /// # Errors
    /// DWARF errors reading the function's ranges.
    fn function_sites(
        &self,
        func: &Entry<'_>,
        layouts: &mut Layouts,
        globals: &Globals,
        query: &MemberQuery,
    ) -> Result<Vec<flow::Site>, DwarfError> {
        let ranges = self.pc_ranges(func.die)?;
        let code: Vec<(u64, &[u8])> = ranges
            .iter()
            .filter_map(|&(lo, hi)| Some((lo, self.code(lo, hi)?)))
            .collect();
        let facts = self.register_facts(func.die, &ranges);
        let symbols = self.symbols();
        let sites = Pass {
            info: self,
            layouts: &mut *layouts,
            symbols,
            facts: &facts,
            globals,
        }
        .run(&code);
        Ok(sites
            .into_iter()
            .filter(|s| {
                layouts
                    .get(self, s.st)
                    .is_some_and(|(name, _)| query.matches(name, &s.path))
            })
            .collect())
    }

    /// Join points of `query` in the functions `funcs` (all of one unit is fastest);
    /// `globals` resolves accesses to global struct variables.
    ///
    /// # Errors
    /// DWARF errors.
    pub fn join_points(
        &self,
        funcs: &[Entry<'_>],
        globals: &Globals,
        query: &MemberQuery,
    ) -> Result<Vec<JoinPoint>, DwarfError> {
        let mut layouts = Layouts::default();
        let mut out = Vec::new();
        let mut tables: BTreeMap<u64, LineTable> = BTreeMap::new();
        for f in funcs.iter().filter(|f| f.kind == EntryKind::Function) {
            for site in self.function_sites(f, &mut layouts, globals, query)? {
                let (unit, _) = self.unit_of(f.die)?;
                let start = unit_start(&unit.header);
                if let std::collections::btree_map::Entry::Vacant(slot) = tables.entry(start) {
                    slot.insert(LineTable::for_unit(self, &unit)?);
                }
                let line = tables.get(&start).and_then(|t| t.find_pc(site.addr));
                let name = layouts
                    .get(self, site.st)
                    .map(|(n, _)| n.clone())
                    .unwrap_or_default();
                out.push(JoinPoint {
                    addr: site.addr,
                    function: self.describe(site.addr).unwrap_or_default(),
                    file: line.as_ref().map(|l| l.file.clone()).unwrap_or_default(),
                    line: line.map_or(0, |l| l.line),
                    access: site.access,
                    member: if site.path.is_empty() {
                        name
                    } else {
                        format!("{name}.{}", site.path)
                    },
                });
            }
        }
        out.sort_by_key(|j| j.addr);
        out.dedup_by_key(|j| j.addr);
        Ok(out)
    }
}

/// Join points of `query` in every function of the file `bytes`, units in parallel (each
/// worker reads its own [`DebugInfo`]); `progress(done, total)` counts units.
///
/// # Errors
/// [`KlasError::Dwarf`] for the first unit that fails.
pub fn join_points_everywhere(
    bytes: &[u8],
    index: &Index,
    query: &MemberQuery,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Vec<JoinPoint>, KlasError> {
    let info = DebugInfo::new(bytes)?;
    let globals = Globals::from_index(&info, index);
    let starts: Vec<u64> = info.unit_starts()?.to_vec();
    let mut by_unit: BTreeMap<usize, Vec<Entry<'_>>> = BTreeMap::new();
    for e in index.iter().filter(|e| e.kind == EntryKind::Function) {
        let unit = starts.partition_point(|&s| s <= e.die.0).saturating_sub(1);
        by_unit.entry(unit).or_default().push(e);
    }
    let groups: Vec<Vec<Entry<'_>>> = by_unit.into_values().collect();
    let total = groups.len() as u64;
    let done = std::sync::atomic::AtomicU64::new(0);
    let results: Vec<Result<Vec<JoinPoint>, KlasError>> = groups
        .par_iter()
        .map_init(
            || DebugInfo::new(bytes).inspect(|worker| worker.seed_unit_starts(starts.clone())),
            |info, funcs| {
                let info = info
                    .as_ref()
                    .map_err(|e| KlasError::Worker(e.to_string()))?;
                let found = info.join_points(funcs, &globals, query)?;
                let now = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                progress(now, total);
                Ok(found)
            },
        )
        .collect();
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    all.sort_by_key(|j| j.addr);
    Ok(all)
}

#[cfg(test)]
mod tests;
