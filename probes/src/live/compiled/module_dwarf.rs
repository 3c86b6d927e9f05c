//! Target variables in kernel modules: each module's DWARF, from its debug file in the `-dbg`
//! package (kept beside the -dbg vmlinux, `kernels/ABI/debug/modules/NAME.ko`, for the
//! modules `exotap image fetch --debuginfo` keeps).
//!
//! A module's debug file is a relocatable object: its DWARF means nothing until its sections
//! have addresses ([`exotap_introspect::dwarf::relocatable`]). Two placements serve:
//! - **made up**, when the script is planned (no guest yet, the module perhaps not loaded):
//!   names, scopes and types are right, addresses are not; the probe's variables are checked
//!   at every matching function, and a template's code compiled, as for a kernel function;
//! - **live**, when a module with points is found in the guest (at attach or when it loads):
//!   each allocated section is where the running module's own symbols say (a symbol's
//!   running address less its offset in its section), so that every DWARF location, global
//!   addresses included, is the running one (less the KASLR slide, as the kernel's are
//!   kept). A debug file of another build of the module does not agree with the running
//!   symbols, and is refused.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use exotap_introspect::dwarf::relocatable::section_symbols;
use exotap_introspect::dwarf::DebugFile;
use exotap_introspect::symbols::wildcard_match;

use crate::compile::locals::{locals_at, Locals};
use crate::lang::point::SourceLine;
use crate::live::kernel_image::KernelImage;
use crate::live::modules::GuestModule;

/// The debug files of modules beside the image's cached -dbg vmlinux.
fn debug_dir(image: &KernelImage) -> Option<PathBuf> {
    Some(image.path.parent()?.join("debug").join("modules"))
}

/// The module names whose debug files are cached (`kvm_amd` for `kvm-amd.ko`, as the kernel
/// names modules), with their files.
pub(crate) fn cached_debug_files(image: &KernelImage) -> Vec<(String, PathBuf)> {
    debug_dir(image).map_or_else(Vec::new, |dir| debug_files_in(&dir))
}

/// The module debug files (`NAME.ko`) in `dir`, by module name as the kernel names modules
/// (`kvm_amd` for `kvm-amd.ko`), sorted; none where `dir` cannot be read.
pub fn debug_files_in(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e
                .file_name()
                .to_str()?
                .strip_suffix(".ko")?
                .replace('-', "_");
            Some((name, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// Where a module statement is: its function, its address, and its lines (the point's
/// `N-M`, or `(N, N)` for each line of `:*`).
pub(crate) type StatementSite = (String, u64, (u32, u32));

/// A module's DWARF at one placement of its sections.
pub(crate) struct ModuleDwarf {
    file: DebugFile,
    /// Its inlined instances' index, built at the first `.inline` asked of it.
    inlines: std::sync::OnceLock<exotap_introspect::dwarf::index::Index>,
    /// Its names' index (source files and their units), built at the first statement.
    names: std::sync::OnceLock<exotap_introspect::dwarf::index::Index>,
    /// Its functions (text symbols of the debug file), their addresses there and sizes.
    functions: Vec<(String, u64, u64)>,
}

impl std::fmt::Debug for ModuleDwarf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModuleDwarf")
            .field("file", &self.file.path())
            .field("functions", &self.functions.len())
            .finish()
    }
}

impl ModuleDwarf {
    fn open(path: &Path, address: &dyn Fn(&str) -> Option<u64>) -> anyhow::Result<ModuleDwarf> {
        let (file, _) = DebugFile::relocated(path, address)
            .with_context(|| format!("cannot read the module debug file {}", path.display()))?;
        let functions = {
            let info = file.load()?;
            info.symbols()
                .iter()
                .map(|s| (s.name.to_owned(), s.addr, s.size))
                .collect()
        };
        Ok(ModuleDwarf {
            file,
            inlines: std::sync::OnceLock::new(),
            names: std::sync::OnceLock::new(),
            functions,
        })
    }

    /// `path` with its sections at made-up addresses (see the module doc).
    ///
    /// # Errors
    /// When the file cannot be read or placed.
    pub(crate) fn made_up(path: &Path) -> anyhow::Result<ModuleDwarf> {
        Self::open(path, &|_| None)
    }

    /// `path` placed where `module` runs, less `slide`: each allocated section at the
    /// address most of its symbols agree on.
    ///
    /// # Errors
    /// When the file cannot be read or placed, or its symbols do not agree with the running
    /// module's (another build of it).
    pub(crate) fn live(path: &Path, module: &GuestModule, slide: u64) -> anyhow::Result<Self> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read the module debug file {}", path.display()))?;
        let symbols = section_symbols(&bytes)
            .with_context(|| format!("cannot read the symbols of {}", path.display()))?;
        let running: HashMap<&str, u64> = module.symbols().collect();
        // Per section, how many symbols vote for each base.
        let mut votes: HashMap<&str, HashMap<u64, usize>> = HashMap::new();
        for s in &symbols {
            if let Some(&at) = running.get(s.name.as_str()) {
                let base = at.wrapping_sub(slide).wrapping_sub(s.offset);
                *votes
                    .entry(s.section.as_str())
                    .or_default()
                    .entry(base)
                    .or_default() += 1;
            }
        }
        let mut bases: HashMap<String, u64> = HashMap::new();
        for (section, counts) in votes {
            let total: usize = counts.values().sum();
            let (base, n) = counts
                .into_iter()
                .max_by_key(|(b, n)| (*n, std::cmp::Reverse(*b)))
                .unwrap_or_default();
            // Names shared by two static functions may disagree; most must not.
            if section == ".text" && n * 10 < total * 9 {
                bail!(
                    "the debug file {} is not of the module {} the guest runs: only {n} of \
                     {total} of its .text symbols agree on where .text is",
                    path.display(),
                    module.name
                );
            }
            bases.insert(section.to_owned(), base);
        }
        if !bases.contains_key(".text") {
            bail!(
                "the debug file {} shares no .text symbol with the module {} the guest runs",
                path.display(),
                module.name
            );
        }
        Self::open(path, &|name| bases.get(name).copied())
    }

    /// The functions whose names match `pattern`, with their addresses, in address order.
    pub(crate) fn functions(&self, pattern: &str) -> Vec<(&str, u64)> {
        let mut found: Vec<(&str, u64)> = self
            .functions
            .iter()
            .filter(|(n, _, _)| wildcard_match(pattern, n))
            .map(|(n, a, _)| (n.as_str(), *a))
            .collect();
        found.sort_by_key(|(_, a)| *a);
        found.dedup_by_key(|(_, a)| *a);
        found
    }

    /// The inlined instances of the functions matching `pattern`, as (function, entry pc),
    /// by entry pc: DWARF's `DW_TAG_inlined_subroutine`s, scanned from the module's own
    /// debug info (small: not indexed on disk, and each placement's addresses differ).
    ///
    /// # Errors
    /// When the DWARF cannot be read.
    pub(crate) fn inlined(
        &self,
        pattern: &str,
        file: Option<&str>,
    ) -> anyhow::Result<Vec<(String, u64)>> {
        use exotap_introspect::dwarf::index::{EntryKind, Index, Layer};
        // `f@FILE`: the functions FILE declares (the abstract instance's file; an instance
        // records only its call site), as `kernel.function("f@FILE").inline` keeps them.
        let declared = match file {
            None => None,
            Some(file) => {
                let info = self.file.load()?;
                let names: BTreeSet<String> = self
                    .names(&info)?
                    .functions(
                        &format!("{pattern}@{file}"),
                        &[EntryKind::Abstract, EntryKind::Function],
                    )
                    .into_iter()
                    .map(|f| f.name.to_owned())
                    .collect();
                Some(names)
            }
        };
        let index = match self.inlines.get() {
            Some(index) => index,
            None => {
                let info = self.file.load()?;
                let built = Index::build(&info, Layer::Inlines, &|_, _| {})?;
                self.inlines.get_or_init(|| built)
            }
        };
        let mut found: Vec<(String, u64)> = index
            .functions(pattern, &[EntryKind::Inlined])
            .into_iter()
            .filter(|e| e.low != 0)
            .filter(|e| declared.as_ref().is_none_or(|d| d.contains(e.name)))
            .map(|e| (e.name.to_owned(), e.low))
            .collect();
        found.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
        found.dedup();
        Ok(found)
    }

    /// The code of `at`'s lines in the functions matching `pattern`, as (function, address,
    /// lines): for each function the lowest `is_stmt` address of the lines, as
    /// `kernel.statement("f@FILE:N")` has it (the lines the point names); for `FILE:*`, every
    /// line of each function matching `pattern` that FILE defines, at its lowest address in
    /// the function (each its own line). A line with no code is an error that names the next
    /// line with some, as the kernel's is.
    ///
    /// # Errors
    /// When the DWARF cannot be read, or no function matching `pattern` has code of the lines.
    pub(crate) fn statements(
        &self,
        pattern: &str,
        at: &SourceLine,
    ) -> anyhow::Result<Vec<StatementSite>> {
        let Some((first, last)) = at.lines else {
            return self.every_line(pattern, &at.file);
        };
        let info = self.file.load()?;
        let names = self.names(&info)?;
        let mut sites = Vec::new();
        let mut next_code = None;
        for line in first..=last {
            let found = info.line_addresses(names, &at.file, line)?;
            let before = sites.len();
            sites.extend(
                found
                    .iter()
                    .filter(|(_, l, _)| *l == line)
                    .map(|(path, _, addr)| (path.clone(), *addr)),
            );
            if sites.len() == before {
                let next = found.iter().map(|(_, l, _)| *l).filter(|l| *l > line).min();
                next_code = next_code.or(next);
            }
        }
        let mut best: std::collections::BTreeMap<&str, (u64, String)> =
            std::collections::BTreeMap::new();
        let mut elsewhere = BTreeSet::new();
        for (path, addr) in sites {
            let Some(function) = self.function_at(addr) else {
                continue;
            };
            if !wildcard_match(pattern, function) {
                elsewhere.insert(function);
                continue;
            }
            let e = best.entry(function).or_insert((addr, path.clone()));
            if addr < e.0 {
                *e = (addr, path);
            }
        }
        if best.is_empty() {
            let lines = if first == last {
                format!("line {first}")
            } else {
                format!("lines {first}-{last}")
            };
            if !elsewhere.is_empty() {
                let holders: Vec<&str> = elsewhere.into_iter().collect();
                bail!(
                    "{lines} of {} has code only in {}, not in a function matching '{pattern}'",
                    at.file,
                    holders.join(", ")
                );
            }
            match next_code {
                Some(next) => bail!(
                    "{lines} of {} has no code in a function matching '{pattern}'; the next \
                     line with code is {next}",
                    at.file
                ),
                None => bail!(
                    "{lines} of {} has no code in a function matching '{pattern}' (or no file \
                     of the module ends with {})",
                    at.file,
                    at.file
                ),
            }
        }
        Ok(best
            .into_iter()
            .map(|(f, (addr, _))| (f.to_owned(), addr, (first, last)))
            .collect())
    }

    /// `f@FILE:*`: every line of FILE in the code of each function matching `pattern` that
    /// FILE defines, at its lowest `is_stmt` address there, as (function, address, (line,
    /// line)), by function and line.
    ///
    /// # Errors
    /// When the DWARF cannot be read, or FILE defines no function matching `pattern`.
    fn every_line(&self, pattern: &str, file: &str) -> anyhow::Result<Vec<StatementSite>> {
        let defined = self.functions_in_file(pattern, file)?;
        if defined.is_empty() {
            bail!("no function matching '{pattern}' is defined in a file ending with {file}");
        }
        let info = self.file.load()?;
        let in_file =
            |path: &str| wildcard_match(file, path) || wildcard_match(&format!("*/{file}"), path);
        let mut out = Vec::new();
        for (name, low, size) in self
            .functions
            .iter()
            .filter(|(n, _, _)| defined.contains(n))
        {
            let high = low.saturating_add(*size);
            let table = info.line_table_at(*low)?;
            let mut lines: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
            for (path, row) in table.rows_in(*low, high) {
                if row.is_stmt && in_file(path) {
                    let e = lines.entry(row.line).or_insert(row.addr);
                    *e = (*e).min(row.addr);
                }
            }
            out.extend(
                lines
                    .into_iter()
                    .map(|(line, addr)| (name.clone(), addr, (line, line))),
            );
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// The instructions of the module that access `field`'s member, as (function, address),
    /// by address: KLAS's join points ([`exotap_introspect::dwarf::klas`]) in the module's
    /// DWARF and the code of its debug file, where `exotap joinpoints` finds the kernel's.
    /// The code is the file's, unrelocated: an access through one of the module's own global
    /// variables (a RIP-relative operand the loader fills in) is not seen; accesses through
    /// pointers (registers) are.
    ///
    /// # Errors
    /// When the DWARF cannot be read, or the member is not `struct S.member`.
    pub(crate) fn field_accesses(
        &self,
        field: &crate::lang::point::MemberAccess,
    ) -> anyhow::Result<Vec<(String, u64)>> {
        use crate::lang::point::FieldAccess;
        use exotap_introspect::dwarf::klas::{self, Access, MemberQuery};
        let query = MemberQuery::parse(&format!("{}.{}", field.structure, field.member))?;
        let info = self.file.load()?;
        let names = self.names(&info)?;
        let points = klas::join_points_everywhere(self.file.bytes(), names, &query, &|_, _| {})?;
        Ok(points
            .into_iter()
            .filter(|p| match field.access {
                FieldAccess::Read => matches!(p.access, Access::Read | Access::ReadWrite),
                FieldAccess::Write => matches!(p.access, Access::Write | Access::ReadWrite),
                FieldAccess::Call => p.access == Access::Call,
            })
            .filter_map(|p| Some((self.function_at(p.addr)?.to_owned(), p.addr)))
            .collect())
    }

    /// Its names' index, built at the first question that needs it.
    fn names(
        &self,
        info: &exotap_introspect::dwarf::DebugInfo<'_>,
    ) -> anyhow::Result<&exotap_introspect::dwarf::index::Index> {
        use exotap_introspect::dwarf::index::{Index, Layer};
        Ok(match self.names.get() {
            Some(index) => index,
            None => {
                let built = Index::build(info, Layer::Names, &|_, _| {})?;
                self.names.get_or_init(|| built)
            }
        })
    }

    /// The names of the functions matching `pattern` that `file` (a trailing path, globs
    /// allowed) defines, as the module's DWARF says.
    ///
    /// # Errors
    /// When the DWARF cannot be read.
    pub(crate) fn functions_in_file(
        &self,
        pattern: &str,
        file: &str,
    ) -> anyhow::Result<BTreeSet<String>> {
        use exotap_introspect::dwarf::EntryKind;
        let info = self.file.load()?;
        Ok(self
            .names(&info)?
            .functions(&format!("{pattern}@{file}"), &[EntryKind::Function])
            .into_iter()
            .filter(|f| f.low != 0)
            .map(|f| f.name.to_owned())
            .collect())
    }

    /// [`Self::functions_in_file`], and with `lines` (`f@FILE:N-M`) only those that have code
    /// of the lines, as `kernel.function("f@FILE:N")` keeps them.
    ///
    /// # Errors
    /// When the DWARF cannot be read, or no function matching `pattern` has code of the lines
    /// (naming the next line with code, or the functions that have some).
    pub(crate) fn functions_in_file_at(
        &self,
        pattern: &str,
        file: &str,
        lines: Option<(u32, u32)>,
    ) -> anyhow::Result<BTreeSet<String>> {
        let mut names = self.functions_in_file(pattern, file)?;
        if let Some(lines) = lines {
            let at = SourceLine {
                file: file.to_owned(),
                lines: Some(lines),
            };
            let with_code: BTreeSet<String> = self
                .statements(pattern, &at)?
                .into_iter()
                .map(|(f, _, _)| f)
                .collect();
            names.retain(|n| with_code.contains(n));
        }
        Ok(names)
    }

    /// The function whose code holds `addr`.
    fn function_at(&self, addr: u64) -> Option<&str> {
        self.functions
            .iter()
            .find(|(_, start, size)| (*start..start.saturating_add(*size)).contains(&addr))
            .map(|(name, _, _)| name.as_str())
    }

    /// The target variables in scope at `pc`, as [`locals_at`] gives a kernel's.
    ///
    /// # Errors
    /// When the DWARF cannot be read there.
    pub(crate) fn locals(&self, pc: u64) -> Result<Locals, String> {
        let info = self
            .file
            .load()
            .map_err(|e| format!("cannot read {}: {e}", self.file.path().display()))?;
        locals_at(&info, pc)
    }

    /// The byte offset of `member` (a path `a.b` through named struct and union members) in
    /// `structure`, as the module's DWARF lays it out.
    ///
    /// # Errors
    /// When the DWARF has no such struct or member.
    pub(crate) fn member_offset(&self, structure: &str, member: &str) -> Result<u64, String> {
        let info = self
            .file
            .load()
            .map_err(|e| format!("cannot read {}: {e}", self.file.path().display()))?;
        let names = self.names(&info).map_err(|e| format!("{e:#}"))?;
        let mut ty = info
            .find_type(names, structure)
            .map_err(|e| format!("{}: {e}", self.file.path().display()))?;
        let mut offset = 0u64;
        let path: Vec<&str> = member
            .split(['.', '-', '>'])
            .filter(|m| !m.is_empty())
            .collect();
        for (i, name) in path.iter().enumerate() {
            let found = info
                .layout(ty)
                .and_then(|members| members.into_iter().find(|m| m.name == *name))
                .ok_or_else(|| {
                    format!(
                        "the DWARF of {} lays out no {structure}.{member}",
                        self.file.path().display()
                    )
                })?;
            offset = offset.saturating_add(found.bit_offset / 8);
            if i + 1 < path.len() {
                ty = info.find_type(names, &found.type_name).map_err(|e| {
                    format!(
                        "{structure}.{member}: {} is not a named struct ({e})",
                        found.name
                    )
                })?;
            }
        }
        Ok(offset)
    }

    /// The code of the debug file at `pc`: up to one instruction's 15 bytes.
    fn code_at(&self, pc: u64) -> Option<Vec<u8>> {
        let info = self.file.load().ok()?;
        (1..=15u64)
            .rev()
            .find_map(|n| info.code(pc, pc.checked_add(n)?).map(<[u8]>::to_vec))
    }
}

/// How a statement found in `module` is named: `module("m").statement("f@FILE:N")` (or
/// `:N-M`), the file as the point wrote it.
pub(crate) fn statement_name(
    module: &str,
    function: &str,
    file: &str,
    lines: (u32, u32),
) -> String {
    let (first, last) = lines;
    let lines = if first == last {
        first.to_string()
    } else {
        format!("{first}-{last}")
    };
    format!("module(\"{module}\").statement(\"{function}@{file}:{lines}\")")
}

/// The name of the instruction `offset` bytes into `function` of `module`:
/// `module("m").statement("f+0x1c")`.
pub(crate) fn offset_name(module: &str, function: &str, offset: u64) -> String {
    format!("module(\"{module}\").statement(\"{function}+{offset:#x}\")")
}

/// The name of a member access point in `module`: `module("m").field("struct S", "x").write`.
pub(crate) fn field_name(module: &str, field: &crate::lang::point::MemberAccess) -> String {
    format!(
        "module(\"{module}\").field(\"{}\", \"{}\").{}",
        field.structure,
        field.member,
        field.suffix()
    )
}

/// The target variables a module point's probe reads (it reads some besides `$return`):
/// what must be there at each function it names (read outside `@defined`; what is read only
/// inside `@defined` is simply read where DWARF has it).
#[derive(Debug, Clone, Default)]
pub struct ModuleVars {
    /// Read outside `@defined`.
    pub required: BTreeSet<String>,
    /// At a member access (`module("m").field(...)`): the member, for `$object` and
    /// `$value`.
    pub field: Option<crate::lang::point::MemberAccess>,
}

impl ModuleVars {
    /// The variables of `function` at `pc` in `dwarf`: `Err` naming each required one that is
    /// not there or cannot be read, as a kernel function's are named.
    pub(crate) fn at(
        &self,
        dwarf: &ModuleDwarf,
        point: &str,
        pc: u64,
    ) -> Result<Arc<Locals>, Vec<String>> {
        let mut locals = dwarf
            .locals(pc)
            .map_err(|why| vec![format!("{point}: {why}")])?;
        // At a member access: the object accessed, and the value a plain store writes (the
        // instruction as the debug file has it; its operands are registers the loader does
        // not touch).
        if let Some(field) = &self.field {
            let code = dwarf.code_at(pc);
            let offset = || dwarf.member_offset(&field.structure, &field.member);
            for name in ["object", "value"] {
                if locals.get(name).is_some() {
                    continue;
                }
                let local = code
                    .as_deref()
                    .and_then(|code| {
                        crate::live::target_vars::member_access_variable(
                            code,
                            pc,
                            &field.structure,
                            &offset,
                            name,
                        )
                    })
                    .unwrap_or_else(|| {
                        Err(format!(
                            "${name}: the module's debug file has no code at {pc:#x}"
                        ))
                    });
                locals.vars.insert(name.to_owned(), local);
            }
        }
        let errors = crate::live::target_vars::unreadable(point, pc, &locals, &self.required);
        if errors.is_empty() {
            Ok(Arc::new(locals))
        } else {
            Err(errors)
        }
    }
}

/// Each place of `m` in `dwarf` (one module's debug file): its function, address and (for a
/// statement) its lines; and, where a statement found no code, why.
///
/// # Errors
/// When the DWARF cannot be read.
fn places(
    dwarf: &ModuleDwarf,
    m: &super::plan::ModulePoint,
) -> anyhow::Result<(Vec<StatementSite>, Option<String>)> {
    if let Some(field) = &m.field {
        let found = dwarf.field_accesses(field)?;
        return Ok((
            found.into_iter().map(|(f, pc)| (f, pc, (0, 0))).collect(),
            None,
        ));
    }
    if let Some(line) = &m.statement {
        return Ok(match dwarf.statements(&m.pattern, line) {
            Ok(found) => (found, None),
            Err(e) => (Vec::new(), Some(format!("{e:#}"))),
        });
    }
    if m.site == crate::lang::point::FunctionSite::Inline {
        let found = dwarf.inlined(&m.pattern, m.file.as_deref())?;
        return Ok((
            found.into_iter().map(|(f, pc)| (f, pc, (0, 0))).collect(),
            None,
        ));
    }
    let wildcard = m.pattern.contains(['*', '?', '[']);
    let in_file = match &m.file {
        Some(file) => Some(dwarf.functions_in_file_at(&m.pattern, file, m.line)?),
        None => None,
    };
    let found = dwarf
        .functions(&m.pattern)
        .into_iter()
        .filter(|(f, _)| super::modules::is_function(f, wildcard))
        .filter(|(f, _)| in_file.as_ref().is_none_or(|names| names.contains(*f)))
        .map(|(f, pc)| (f.to_owned(), pc.wrapping_add(m.offset.unwrap_or(0)), (0, 0)))
        .collect();
    Ok((found, None))
}

/// The name of `m`'s place in `function` of module `module` (`lines`: a statement's).
fn place_name(
    module: &str,
    m: &super::plan::ModulePoint,
    function: &str,
    lines: (u32, u32),
) -> String {
    match (&m.statement, &m.field, m.offset) {
        (_, Some(field), _) => field_name(module, field),
        (Some(line), None, _) => statement_name(module, function, &line.file, lines),
        (None, None, Some(offset)) => offset_name(module, function, offset),
        (None, None, None) => format!(
            "module(\"{module}\").function(\"{function}\"){}",
            m.site.suffix()
        ),
    }
}

/// A listed module point: its name and, for `-L`, the target variables there.
pub type ListedPoint = (String, Vec<String>);

/// `-l`/`-L` of module point `kind` from the cached debug files of the modules it names,
/// without a guest: each place's name (a statement per line, a function per function, a
/// member access once per module) and, with `with_vars`, the variables there
/// (`$name`, `$name:struct S *` where it points to a struct; at a member access `$object`
/// and, for a plain store, `$value`).
///
/// # Errors
/// No cached debug file for a module it names (saying which are kept), a DWARF that cannot
/// be read, or no place at all.
pub fn list_from_debug_files(
    image: &KernelImage,
    kind: &crate::lang::point::PointKind,
    name: &str,
    with_vars: bool,
) -> anyhow::Result<Vec<ListedPoint>> {
    let Some(m) = super::plan::ModulePoint::from_kind(kind, 0, name, false) else {
        bail!("{name} is not a module point");
    };
    let files: Vec<(String, PathBuf)> = cached_debug_files(image)
        .into_iter()
        .filter(|(n, _)| wildcard_match(&m.module, n))
        .collect();
    if files.is_empty() {
        let kept: Vec<String> = cached_debug_files(image)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        bail!(
            "{name}: no debug file of a module matching '{}' is cached ({}); give --target \
             ADDR to list a module's functions from the live guest",
            m.module,
            if kept.is_empty() {
                "exotap image fetch --debuginfo keeps some modules' with the vmlinux".to_owned()
            } else {
                format!("kept: {}", kept.join(", "))
            }
        );
    }
    let vars = ModuleVars {
        required: BTreeSet::new(),
        field: m.field.clone(),
    };
    let mut found = Vec::new();
    let mut no_code = None;
    let mut made_up = HashMap::new();
    for (module, path) in &files {
        let dwarf: &ModuleDwarf = match made_up.entry(path.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(ModuleDwarf::made_up(path)?),
        };
        let (at, why) = places(dwarf, &m)?;
        if let Some(why) = why {
            no_code.get_or_insert(why);
        }
        for (function, pc, lines) in at {
            let point = place_name(module, &m, &function, lines);
            let listed = if with_vars {
                vars.at(dwarf, &point, pc)
                    .map(|locals| listed_variables(&locals))
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            found.push((point, listed));
        }
    }
    if found.is_empty() {
        return Err(nothing_found(
            name,
            &m,
            &files,
            &made_up,
            no_code.as_deref(),
        ));
    }
    let mut seen = BTreeSet::new();
    found.retain(|p| seen.insert(p.clone()));
    Ok(found)
}

/// Why module point `name` (`m`) has no place in the debug files `files` (read into
/// `made_up`): a statement's line without code (`no_code`), a member the module's types lack
/// or no instruction accessing it, or no function or inlined instance matching.
fn nothing_found(
    name: &str,
    m: &super::plan::ModulePoint,
    files: &[(String, PathBuf)],
    made_up: &HashMap<PathBuf, ModuleDwarf>,
    no_code: Option<&str>,
) -> anyhow::Error {
    let modules = files
        .iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if let Some(why) = no_code {
        return anyhow::anyhow!("no match for probe point '{name}': {why}");
    }
    if let Some(field) = &m.field {
        // A member the module's types do not have says so.
        if let Some(Err(why)) = files.iter().find_map(|(_, path)| {
            Some(
                made_up
                    .get(path)?
                    .member_offset(&field.structure, &field.member),
            )
        }) {
            return anyhow::anyhow!("no match for probe point '{name}': {why}");
        }
        return anyhow::anyhow!(
            "no match for probe point '{name}': no instruction of {modules} {}s {}'s member {}",
            field.suffix(),
            field.structure,
            field.member
        );
    }
    anyhow::anyhow!(
        "no match for probe point '{name}': no {} of the debug file of {modules} matches '{}'{}",
        if m.site == crate::lang::point::FunctionSite::Inline {
            "inlined instance"
        } else {
            "function"
        },
        m.pattern,
        m.file
            .as_ref()
            .map_or_else(String::new, |f| format!(" in a file ending with {f}"))
    )
}

/// `-L`'s words for the variables of `locals` that can be read, in DWARF's order.
fn listed_variables(locals: &Locals) -> Vec<String> {
    let mut names: Vec<String> = locals.order.iter().map(|(n, _)| n.clone()).collect();
    for extra in locals.vars.keys() {
        if !names.contains(extra) {
            names.push(extra.clone());
        }
    }
    names
        .into_iter()
        .filter_map(|n| match locals.vars.get(&n)? {
            Ok(local) => Some(match &local.pointee {
                Some(s) => format!("${n}:{s} *"),
                None => format!("${n}"),
            }),
            Err(_) => None,
        })
        .collect()
}

/// At planning: the target variables `m`'s probe reads, checked at every function of the
/// cached debug files of the modules `m` names (made-up placement), and the first
/// function's kept as the template's (whose code [`crate::compile::check`] compiles).
/// `Ok(false)`: an optional point left out, with a warning, for want of a debug file.
///
/// # Errors
/// A variable that is not at some function, or no debug file for a point that reads
/// variables.
pub(super) fn plan_vars(
    image: &KernelImage,
    prog: &crate::lang::check::Program,
    m: &mut super::plan::ModulePoint,
    made_up: &mut HashMap<PathBuf, ModuleDwarf>,
) -> anyhow::Result<bool> {
    let (mut required, mut optional) = crate::live::target_vars::names_read(prog, m.template.probe);
    required.remove("return");
    optional.remove("return");
    let inline = m.site == crate::lang::point::FunctionSite::Inline;
    let statement = m.statement.clone();
    let field = m.field.clone();
    // Points that only the debug file knows: checked here even when nothing is read.
    let from_dwarf = inline || statement.is_some() || m.file.is_some() || field.is_some();
    // At a return the parameters are BTF's, as at the entry (and `$return`).
    if m.template.is_return || !from_dwarf && required.is_empty() && optional.is_empty() {
        return Ok(true);
    }
    let files: Vec<(String, PathBuf)> = cached_debug_files(image)
        .into_iter()
        .filter(|(name, _)| wildcard_match(&m.module, name))
        .collect();
    if files.is_empty() {
        if from_dwarf {
            let why = format!(
                "{}: a module's {} come from its debug file in the -dbg package, which the \
                 cache does not hold for a module matching '{}'",
                m.template.name,
                if inline {
                    "inlined instances"
                } else if field.is_some() {
                    "member accesses"
                } else {
                    "source positions"
                },
                m.module
            );
            if m.optional {
                tracing::warn!("{why}; optional probe point skipped");
                return Ok(false);
            }
            bail!(why);
        }
        if required.is_empty() {
            return Ok(true);
        }
        let kept: Vec<String> = cached_debug_files(image)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let why = format!(
            "{}: the probe reads ${}, and a module's target variables come from its debug file \
             in the -dbg package, which the cache does not hold for a module matching '{}' ({})",
            m.template.name,
            required.iter().next().map_or("", String::as_str),
            m.module,
            if kept.is_empty() {
                "exotap image fetch --debuginfo keeps the modules' with the vmlinux".to_owned()
            } else {
                format!("kept: {}", kept.join(", "))
            }
        );
        if m.optional {
            tracing::warn!("{why}; optional probe point skipped");
            return Ok(false);
        }
        bail!(why);
    }
    let reads = !(required.is_empty() && optional.is_empty());
    let vars = ModuleVars {
        required,
        field: field.clone(),
    };
    let mut errors = Vec::new();
    let mut template = None;
    let mut count = 0usize;
    let mut no_code = None;
    for (name, path) in &files {
        // Each debug file read and placed once per plan (the nfsd tapset names one module
        // at seventeen points).
        let dwarf = match made_up.entry(path.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(ModuleDwarf::made_up(path)?),
        };
        let dwarf: &ModuleDwarf = dwarf;
        let (at, why) = places(dwarf, m)?;
        if let Some(why) = why {
            no_code.get_or_insert(why);
        }
        count += at.len();
        if !reads {
            continue;
        }
        for (function, pc, lines) in at {
            let point = place_name(name, m, &function, lines);
            match vars.at(dwarf, &point, pc) {
                Ok(locals) => {
                    template.get_or_insert(locals);
                }
                Err(mut why) => errors.append(&mut why),
            }
        }
    }
    if !errors.is_empty() {
        errors.sort();
        errors.dedup();
        return Err(crate::live::target_vars::UnreadableTargets(errors).into());
    }
    if count == 0 && !m.optional {
        return Err(nothing_found(
            &m.template.name,
            m,
            &files,
            made_up,
            no_code.as_deref(),
        ));
    }
    if !reads {
        return Ok(true);
    }
    // No place (an optional point), or only `@defined` reads: nothing to check here.
    let Some(template) = template else {
        m.vars = Some(vars);
        return Ok(true);
    };
    m.template.locals = Some(template);
    m.vars = Some(vars);
    Ok(true)
}

/// The kernel's BTF with the own types of the module the script's module points name (its
/// split BTF, from its debug file): what member chains through a module's types are laid
/// out from. `None` when no point names a module with a cached debug file; where points
/// name several, the first one's (a split BTF's ids continue the kernel's, so two modules'
/// cannot be joined without renumbering one), with a warning.
pub(super) fn module_types(
    image: &KernelImage,
    btf: &exotap_introspect::btf::Btf,
    points: &[super::plan::ModulePoint],
) -> Option<exotap_introspect::btf::Btf> {
    let files = cached_debug_files(image);
    let mut named: Vec<&(String, PathBuf)> = files
        .iter()
        .filter(|(name, _)| points.iter().any(|p| wildcard_match(&p.module, name)))
        .collect();
    named.dedup_by_key(|(name, _)| name.clone());
    let (name, path) = named.first()?;
    if named.len() > 1 {
        tracing::warn!(
            "the script's points name modules {}: member chains see the types of {name} only",
            named
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    split_btf(btf, name, path)
}

/// The kernel's BTF with module `name`'s own types, from its cached debug file (`None`
/// where it is not cached or its BTF cannot be read, with a warning for the latter).
pub(crate) fn module_types_of(
    image: &KernelImage,
    btf: &exotap_introspect::btf::Btf,
    name: &str,
) -> Option<exotap_introspect::btf::Btf> {
    let files = cached_debug_files(image);
    let (name, path) = files.iter().find(|(n, _)| n == name)?;
    split_btf(btf, name, path)
}

fn split_btf(
    btf: &exotap_introspect::btf::Btf,
    name: &str,
    path: &Path,
) -> Option<exotap_introspect::btf::Btf> {
    let bytes = std::fs::read(path)
        .map_err(|e| tracing::warn!("cannot read {}: {e}", path.display()))
        .ok()?;
    exotap_introspect::btf::Btf::from_elf_split(&bytes, btf)
        .map_err(|e| {
            tracing::warn!(
                "the BTF of module {name} ({}) cannot be read ({e}): its own types are not \
                 known to member chains",
                path.display()
            )
        })
        .ok()
}

/// The parameter names of the function `pattern` names in `btf` (the kernel's with a
/// module's): of the function of that name, or of the first whose name matches a wildcard.
/// Empty when BTF has none.
pub(super) fn btf_params(btf: &exotap_introspect::btf::Btf, pattern: &str) -> Vec<String> {
    use exotap_introspect::btf::Kind;
    let name = if pattern.contains(['*', '?', '[']) {
        let Some(name) = btf
            .iter()
            .filter(|(_, t)| matches!(t.kind, Kind::Func { .. }))
            .map(|(_, t)| btf.str_at(t.name))
            .find(|n| wildcard_match(pattern, n))
        else {
            return Vec::new();
        };
        name.to_owned()
    } else {
        pattern.to_owned()
    };
    btf.func_signature(&name)
        .map(|sig| sig.params.into_iter().map(|(n, _)| n).collect())
        .unwrap_or_default()
}
