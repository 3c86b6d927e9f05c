//! Resolving kernel probe points against the guest kernel's symbols (kallsyms from the image)
//! and, for `-L`, the parameters its BTF records.
//!
//! Addresses are link-time; the backend adds the KASLR slide when it attaches. Points that need
//! source positions (`@file`, `:line`, `kernel.statement("f@file:line")`) are resolved with the
//! -dbg vmlinux's DWARF when one is given ([`KernelSymbols::with_lines`], see
//! [`super::source_lines`]), and otherwise say how to get it; so are the inlined instances of
//! `kernel.function("F").inline` (each instance's entry pc) and the member accesses of
//! `kernel.field("struct S", "member")` (KLAS's join points).
//!
//! `kernel.function("F")` (a name without wildcards, not `.call`) is, as in SystemTap, F's
//! out-of-line entry and each of its inlined instances (with the -dbg vmlinux; without it,
//! the entry alone). An instance the point did not name (`ResolvedPoint::implicit`) is left
//! out with a warning where it cannot be served: a variable the probe reads is not there
//! (optimized out in that copy), or the instruction takes no probe. A wildcard keeps to the
//! out-of-line entries (`.inline` names the instances): a pattern such as `vfs_*` or
//! `*@fs/proc/*.c` would add hundreds of instances, each a statement probe in its caller's
//! code, where the script's author asked for function entries.
//!
//! Source positions follow SystemTap: `@FILE` keeps the functions whose definition is in a
//! file whose path ends with FILE (globs allowed); `PAT@FILE:LINE` as a function keeps those
//! of them whose code holds that line; as a statement it stands for the lowest `is_stmt`
//! address of the line's rows in each containing function (functions matching PAT), i.e. one
//! probe per function where the line begins (an inlined copy of a header line in several
//! callers gives one probe per caller). `:N-M` is every line of the range that has code; `:*`
//! every line of the function's own file in the functions matching PAT defined in FILE. A
//! line with no code is an error naming the next line that has some.

use exotap_introspect::btf::cdecl::declaration;
use exotap_introspect::btf::Btf;
use exotap_introspect::symbols::{Symbol, SymbolTable};

use super::ast::ProbePoint;
use super::point::{parse_lines, FieldAccess, FunctionSite, PointKind};
use super::resolve::{NoSymbols, ProbePointResolver, ResolveError, ResolvedPoint};
use super::source_lines::{LineSites, SourceLines};

/// Where the x86-64 syscall entry points are named: `__x64_sys_NAME`.
const SYSCALL_PREFIX: &str = "__x64_sys_";

/// Every tracepoint `NAME` has an iterator function `__traceiter_NAME(void *__data, ARGS)`
/// that calls its probes; BTF names its arguments.
const TRACEPOINT_PREFIX: &str = "__traceiter_";

/// Resolves probe points with the kernel's symbol table (and BTF prototypes when present).
#[derive(Debug)]
pub struct KernelSymbols<'a> {
    symbols: &'a SymbolTable,
    btf: Option<&'a Btf>,
    lines: Option<&'a SourceLines>,
}

impl<'a> KernelSymbols<'a> {
    /// A resolver over `symbols`; `btf` adds parameters as target variables.
    pub fn new(symbols: &'a SymbolTable, btf: Option<&'a Btf>) -> Self {
        Self {
            symbols,
            btf,
            lines: None,
        }
    }

    /// Resolves `@FILE` and `:LINE` with the -dbg vmlinux's DWARF (`None`: they are refused
    /// with a note on how to get it).
    #[must_use]
    pub fn with_lines(mut self, lines: Option<&'a SourceLines>) -> Self {
        self.lines = lines;
        self
    }

    fn source_lines(&self, point: &ProbePoint) -> Result<&'a SourceLines, ResolveError> {
        self.lines.ok_or_else(|| ResolveError::NoDebugInfo {
            what: point.to_string(),
        })
    }

    /// The DWARF for a point that only DWARF can place (`what` ... "from the kernel's DWARF
    /// debug info"), or the error that says how to fetch it.
    fn dwarf_for(&self, point: &ProbePoint, what: &str) -> Result<&'a SourceLines, ResolveError> {
        self.lines.ok_or_else(|| {
            ResolveError::Source(format!(
                "{point}: {what} from the kernel's DWARF debug info, and no -dbg vmlinux is \
                 cached (run `exotap image fetch --debuginfo`)"
            ))
        })
    }

    /// `kernel.function("PAT@FILE[:LINE]")`: the functions matching PAT defined in FILE
    /// (holding LINE's code).
    fn source_functions(
        &self,
        point: &ProbePoint,
        pattern: &str,
        file: Option<&str>,
        line: Option<&str>,
        suffix: &str,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        let src = self.source_lines(point)?;
        let file = file.unwrap_or("*");
        let mut funcs = src
            .functions(pattern, file)
            .map_err(|e| dwarf_error(point, &e))?;
        if let Some(line) = line {
            let sites = self.line_sites(point, src, file, line)?;
            funcs.retain(|f| sites.iter().any(|(_, a)| (f.low..f.high).contains(a)));
        }
        if is_wildcard(pattern) || file.contains(['*', '?', '[']) {
            funcs.retain(|f| !self.is_init_text(f.low));
        }
        Ok(funcs
            .into_iter()
            .map(|f| ResolvedPoint {
                name: format!(
                    "kernel.function(\"{}@{}:{}\"){suffix}",
                    f.name, f.file, f.line
                ),
                address: Some(f.low),
                variables: self.parameters(&f.name),
                implicit: false,
            })
            .collect())
    }

    /// `kernel.function("PAT[@FILE]").inline`: each inlined instance of the functions
    /// matching PAT (declared in FILE), at its entry pc, as SystemTap probes them. The
    /// instances are in the caller's code: no BTF parameters (an inlined function's
    /// arguments are wherever the caller's code keeps them: DWARF says, per point).
    fn inlined(
        &self,
        point: &ProbePoint,
        pattern: &str,
        file: Option<&str>,
        line: Option<&str>,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        if line.is_some() {
            return Err(ResolveError::Source(format!(
                "{point}: a line does not select inlined instances (write \
                 kernel.statement(\"PAT@FILE:LINE\") for the code of a line)"
            )));
        }
        let src = self.dwarf_for(point, "the inlined instances of a function are known")?;
        let copies = src
            .inlined(pattern, file.unwrap_or("*"))
            .map_err(|e| dwarf_error(point, &e))?;
        // Copies inlined into `__init` code went with it after boot.
        Ok(copies
            .into_iter()
            .filter(|c| !self.is_init_text(c.entry))
            .map(|c| {
                let at = if c.file.is_empty() {
                    String::new()
                } else {
                    format!("@{}:{}", c.file, c.line)
                };
                ResolvedPoint {
                    name: format!("kernel.function(\"{}{at}\").inline", c.name),
                    address: Some(c.entry),
                    variables: Vec::new(),
                    implicit: false,
                }
            })
            .collect())
    }

    /// `kernel.field("struct S", "member").read|.write|.call`: every instruction that
    /// accesses the member so (KLAS's join points, from the -dbg vmlinux's DWARF and the
    /// code), each a statement probe in its function.
    fn field_accesses(
        &self,
        point: &ProbePoint,
        structure: &str,
        member: &str,
        access: FieldAccess,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        let src = self.dwarf_for(
            point,
            "the instructions that access a struct member are found",
        )?;
        let sites = src
            .field_accesses(structure, member, access)
            .map_err(|e| dwarf_error(point, &e))?;
        let suffix = match access {
            FieldAccess::Read => "read",
            FieldAccess::Write => "write",
            FieldAccess::Call => "call",
        };
        Ok(sites
            .into_iter()
            .filter(|(addr, _)| !self.is_init_text(*addr))
            .map(|(addr, _)| ResolvedPoint {
                name: format!("kernel.field(\"{structure}\", \"{member}\").{suffix}"),
                address: Some(addr),
                variables: Vec::new(),
                implicit: false,
            })
            .collect())
    }

    /// The rows where the lines `spec` (`N` or `N-M`) of `file` begin, as (file, address).
    fn line_sites(
        &self,
        point: &ProbePoint,
        src: &SourceLines,
        file: &str,
        spec: &str,
    ) -> Result<Vec<(String, u64)>, ResolveError> {
        if file.contains(['*', '?', '[']) {
            return Err(ResolveError::Source(format!(
                "{point}: a source line needs a file name without wildcards"
            )));
        }
        let (first, last) = parse_lines(spec).ok_or_else(|| {
            ResolveError::Source(format!("{point}: '{spec}' is not a line (write N or N-M)"))
        })?;
        let mut out = Vec::new();
        let mut next_code = None;
        for line in first..=last {
            match src.line(file, line).map_err(|e| dwarf_error(point, &e))? {
                LineSites::Code(sites) => out.extend(sites),
                LineSites::NoCode { next } => next_code = next_code.or(next),
            }
        }
        if out.is_empty() {
            let lines = if first == last {
                format!("line {first}")
            } else {
                format!("lines {first}-{last}")
            };
            return Err(ResolveError::Source(match next_code {
                Some(next) => format!(
                    "{point}: {lines} of {file} has no code; the next line with code is {next}"
                ),
                None => {
                    format!("{point}: {lines} of {file} has no code (or no file ends with {file})")
                }
            }));
        }
        Ok(out)
    }

    /// `kernel.statement("PAT@FILE:*")`: every line of the functions matching PAT defined in
    /// FILE (globs allowed), each at its lowest address in the function.
    fn every_line(
        &self,
        point: &ProbePoint,
        src: &SourceLines,
        pattern: &str,
        file: &str,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        let mut out = Vec::new();
        for f in src
            .functions(pattern, file)
            .map_err(|e| dwarf_error(point, &e))?
        {
            for (line, addr) in src.function_lines(&f).map_err(|e| dwarf_error(point, &e))? {
                out.push(ResolvedPoint {
                    name: format!(
                        "kernel.statement(\"{}@{}:{line}\") ({}+{:#x})",
                        f.name,
                        f.file,
                        f.name,
                        addr - f.low
                    ),
                    address: Some(addr),
                    variables: Vec::new(),
                    implicit: false,
                });
            }
        }
        Ok(out)
    }

    /// `kernel.statement("PAT@FILE:LINE")`: the lowest address of the line in each function
    /// matching PAT that holds it.
    fn source_statements(
        &self,
        point: &ProbePoint,
        pattern: &str,
        file: &str,
        line: &str,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        let src = self.source_lines(point)?;
        if line == "*" {
            return self.every_line(point, src, pattern, file);
        }
        let sites = self.line_sites(point, src, file, line)?;
        let mut best: std::collections::BTreeMap<String, (u64, u64, String)> =
            std::collections::BTreeMap::new();
        for (path, addr) in sites {
            let Some((sym, off)) = self.symbols.lookup_addr(addr) else {
                continue;
            };
            if !sym.is_text() || !exotap_introspect::dwarf::pattern::glob_match(pattern, &sym.name)
            {
                continue;
            }
            let e = best
                .entry(sym.name.clone())
                .or_insert((addr, off, path.clone()));
            if addr < e.0 {
                *e = (addr, off, path);
            }
        }
        Ok(best
            .into_iter()
            .map(|(name, (addr, off, path))| ResolvedPoint {
                name: format!("kernel.statement(\"{name}@{path}:{line}\") ({name}+{off:#x})"),
                address: Some(addr),
                variables: Vec::new(),
                implicit: false,
            })
            .collect())
    }

    /// Code symbols matching `pattern`, one per name, in name order. A wildcard leaves out
    /// `__init` code, as SystemTap's does: the kernel freed it after booting (its bytes are
    /// `int3` now), so it never runs again; a function named exactly is kept, and a probe
    /// there is refused with that reason.
    fn functions(&self, pattern: &str) -> Vec<&'a Symbol> {
        let wildcard = is_wildcard(pattern);
        let mut found: Vec<&Symbol> = self
            .symbols
            .matching(pattern)
            .into_iter()
            .filter(|s| s.is_text())
            .filter(|s| !(wildcard && self.is_init_text(s.addr)))
            .collect();
        found.sort_by(|a, b| a.name.cmp(&b.name));
        found.dedup_by(|a, b| a.name == b.name);
        found
    }

    /// Whether `addr` (link-time) is in the kernel's `__init` text (`_sinittext` ..
    /// `_einittext`).
    fn is_init_text(&self, addr: u64) -> bool {
        match (
            self.symbols.get("_sinittext"),
            self.symbols.get("_einittext"),
        ) {
            (Some(start), Some(end)) => (start.addr..end.addr).contains(&addr),
            _ => false,
        }
    }

    /// `$param:type` for each parameter BTF knows of `function`.
    fn parameters(&self, function: &str) -> Vec<String> {
        let Some(btf) = self.btf else {
            return Vec::new();
        };
        let Ok(sig) = btf.func_signature(function) else {
            return Vec::new();
        };
        sig.params
            .iter()
            .map(|(name, ty)| format!("${name}:{}", declaration(btf, *ty, "")))
            .collect()
    }

    fn point(&self, name: String, sym: &Symbol, variables: Vec<String>) -> ResolvedPoint {
        ResolvedPoint {
            name,
            address: Some(sym.addr),
            variables,
            implicit: false,
        }
    }
}

/// Whether a function pattern is a glob (`*`, `?`, `[...]`).
fn is_wildcard(pattern: &str) -> bool {
    pattern.contains(['*', '?', '['])
}

/// `func+OFFSET` split into the function pattern and the byte offset (decimal or `0x` hex).
pub(crate) fn function_offset(spec: &str) -> Option<(&str, u64)> {
    let (name, offset) = spec.rsplit_once('+')?;
    let offset = offset.trim();
    let offset = match offset
        .strip_prefix("0x")
        .or_else(|| offset.strip_prefix("0X"))
    {
        Some(hex) => u64::from_str_radix(hex, 16).ok()?,
        None => offset.parse().ok()?,
    };
    (!name.is_empty()).then_some((name, offset))
}

fn dwarf_error(point: &ProbePoint, e: &anyhow::Error) -> ResolveError {
    ResolveError::Source(format!("{point}: cannot read the -dbg vmlinux: {e:#}"))
}

impl ProbePointResolver for KernelSymbols<'_> {
    fn resolve(
        &self,
        point: &ProbePoint,
        kind: &PointKind,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        let found = match kind {
            PointKind::KernelFunction {
                pattern,
                file,
                line,
                site: FunctionSite::Inline,
            } => self.inlined(point, pattern, file.as_deref(), line.as_deref())?,
            PointKind::KernelFunction {
                pattern,
                file,
                line,
                site,
            } if file.is_some() || line.is_some() => self.source_functions(
                point,
                pattern,
                file.as_deref(),
                line.as_deref(),
                site.suffix(),
            )?,
            PointKind::KernelFunction { pattern, site, .. } => {
                let mut found: Vec<ResolvedPoint> = self
                    .functions(pattern)
                    .into_iter()
                    .map(|sym| {
                        let name = format!("kernel.function(\"{}\"){}", sym.name, site.suffix());
                        self.point(name, sym, self.parameters(&sym.name))
                    })
                    .collect();
                // `kernel.function("F")`: as in SystemTap, the out-of-line entry and every
                // inlined instance (where the -dbg vmlinux says where they are; see the
                // module doc for why a wildcard keeps to the entries).
                if *site == FunctionSite::Entry && !is_wildcard(pattern) && self.lines.is_some() {
                    // An "instance" inside F's own out-of-line code is how GCC describes the
                    // body of an out-of-line copy it made of F (`bprm_execve+100` in
                    // `bprm_execve`): every call passes both, so it is no instance of its own.
                    let own_body = |at: u64| {
                        self.symbols
                            .lookup_addr(at)
                            .is_some_and(|(sym, _)| sym.name == *pattern)
                    };
                    found.extend(
                        self.inlined(point, pattern, None, None)?
                            .into_iter()
                            .filter(|p| !p.address.is_some_and(own_body))
                            .map(|p| ResolvedPoint {
                                implicit: true,
                                ..p
                            }),
                    );
                }
                found
            }
            // A module's functions are known once the script attaches: the live guest's
            // module list and each module's kallsyms (exotap_probes' live::modules).
            PointKind::ModuleFunction { .. } => vec![ResolvedPoint {
                name: point.to_string(),
                address: None,
                variables: Vec::new(),
                implicit: false,
            }],
            PointKind::Syscall { name, ret } => self
                .functions(&format!("{SYSCALL_PREFIX}{name}"))
                .into_iter()
                .filter_map(|sym| {
                    let call = sym.name.strip_prefix(SYSCALL_PREFIX)?;
                    let suffix = if *ret { ".return" } else { "" };
                    Some(self.point(
                        format!("kernel.syscall(\"{call}\"){suffix}"),
                        sym,
                        self.parameters(&sym.name),
                    ))
                })
                .collect(),
            PointKind::KernelAddress(addr) => {
                let name = match self.symbols.lookup_addr(*addr) {
                    Some((sym, off)) => {
                        format!(
                            "kernel.statement({addr:#x}).absolute ({}+{off:#x})",
                            sym.name
                        )
                    }
                    None => format!("kernel.statement({addr:#x}).absolute"),
                };
                vec![ResolvedPoint {
                    name,
                    address: Some(*addr),
                    variables: Vec::new(),
                    implicit: false,
                }]
            }
            PointKind::KernelStatement {
                function,
                file: None,
                line: None,
            } if function.contains('+') => {
                let Some((name, offset)) = function_offset(function) else {
                    return Err(ResolveError::NoMatch(format!(
                        "{point} (write \"func+OFFSET\", the offset in decimal or 0x hex)"
                    )));
                };
                self.functions(name)
                    .into_iter()
                    .map(|sym| ResolvedPoint {
                        name: format!("kernel.statement(\"{}+{offset:#x}\")", sym.name),
                        address: Some(sym.addr.wrapping_add(offset)),
                        variables: Vec::new(),
                        implicit: false,
                    })
                    .collect()
            }
            PointKind::KernelStatement {
                function,
                file: Some(file),
                line: Some(line),
            } => self.source_statements(point, function, file, line)?,
            PointKind::KernelStatement { .. } => {
                return Err(ResolveError::Source(format!(
                    "{point}: a statement is \"func+OFFSET\" or \"PAT@FILE:LINE\""
                )));
            }
            PointKind::KernelField {
                structure,
                member,
                access,
            } => self.field_accesses(point, structure, member, *access)?,
            PointKind::KernelTrace { name } => self
                .functions(&format!("{TRACEPOINT_PREFIX}{name}"))
                .into_iter()
                .filter_map(|sym| {
                    let trace = sym.name.strip_prefix(TRACEPOINT_PREFIX)?;
                    // The iterator's first parameter is the probe's private data, not the
                    // tracepoint's.
                    let mut vars = self.parameters(&sym.name);
                    if !vars.is_empty() {
                        vars.remove(0);
                    }
                    Some(self.point(format!("kernel.trace(\"{trace}\")"), sym, vars))
                })
                .collect(),
            // A watchpoint, not code: no address to splice or trap (live::traps::watches
            // sets it); a symbol must be kernel data.
            PointKind::KernelData { target, .. } => {
                if let crate::point::DataTarget::Symbol(name) = target {
                    match self.symbols.get(name) {
                        None => return Err(ResolveError::NoMatch(point.to_string())),
                        Some(sym) if sym.is_text() => {
                            return Err(ResolveError::Source(format!(
                                "{point}: {name} is code, not data (probe it with \
                                 kernel.function or kernel.statement)"
                            )))
                        }
                        Some(_) => {}
                    }
                }
                vec![ResolvedPoint {
                    name: point.to_string(),
                    address: None,
                    variables: Vec::new(),
                    implicit: false,
                }]
            }
            PointKind::TimerProfile => vec![ResolvedPoint {
                name: point.to_string(),
                address: None,
                variables: Vec::new(),
                implicit: false,
            }],
            _ => return NoSymbols.resolve(point, kind),
        };
        if found.is_empty() {
            return Err(ResolveError::NoMatch(point.to_string()));
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resolve::list;

    fn table() -> SymbolTable {
        let sym = |name: &str, addr: u64, kind: char| Symbol {
            name: name.into(),
            addr,
            kind,
            size: 0,
        };
        SymbolTable::new(vec![
            sym("vfs_read", 0xffff_ffff_8134_9950, 'T'),
            sym("vfs_readv", 0xffff_ffff_8134_a000, 'T'),
            sym("vfs_write", 0xffff_ffff_8134_b000, 'T'),
            sym("vfs_caches", 0xffff_ffff_8200_0000, 'D'),
            sym("__x64_sys_getpid", 0xffff_ffff_810b_0d90, 'T'),
            sym("__do_sys_getpid", 0xffff_ffff_810b_0d90, 't'),
            sym("__traceiter_sched_switch", 0xffff_ffff_810c_0000, 'T'),
            // __init code, freed after boot.
            sym("_sinittext", 0xffff_ffff_8304_c000, 'T'),
            sym("vfs_caches_init", 0xffff_ffff_8304_d000, 't'),
            sym("_einittext", 0xffff_ffff_830a_f4bc, 'T'),
        ])
    }

    /// `.inline` and `kernel.field` come from DWARF: without the -dbg vmlinux each is an
    /// error that says how to get it, never the function's entry or nothing.
    #[test]
    fn inline_and_field_points_without_dwarf_say_which_file_to_fetch() {
        let symbols = table();
        for point in [
            r#"kernel.function("vfs_read").inline"#,
            r#"kernel.field("struct file", "f_pos").write"#,
        ] {
            let err = list(point, &KernelSymbols::new(&symbols, None)).unwrap_err();
            let text = err.to_string();
            assert!(
                text.contains("no -dbg vmlinux is cached")
                    && text.contains("exotap image fetch --debuginfo"),
                "{point}: {text}"
            );
        }
    }

    /// As SystemTap's: a wildcard leaves out `__init` code (the kernel freed it after
    /// booting); a function named exactly is still found.
    #[test]
    fn wildcards_leave_out_init_text() {
        let symbols = table();
        let names = |pattern: &str| -> Vec<String> {
            list(
                &format!(r#"kernel.function("{pattern}")"#),
                &KernelSymbols::new(&symbols, None),
            )
            .map(|found| found.into_iter().map(|p| p.name).collect())
            .unwrap_or_default()
        };
        assert!(!names("vfs_*").iter().any(|n| n.contains("vfs_caches_init")));
        assert!(names("vfs_*").iter().any(|n| n.contains("vfs_read")));
        assert_eq!(
            names("vfs_caches_init"),
            vec![r#"kernel.function("vfs_caches_init")"#.to_owned()]
        );
    }

    #[test]
    fn function_pattern_lists_matching_code_symbols_only() {
        let symbols = table();

        let found = list(
            r#"kernel.function("vfs_*")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap();

        let names: Vec<&str> = found.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                r#"kernel.function("vfs_read")"#,
                r#"kernel.function("vfs_readv")"#,
                r#"kernel.function("vfs_write")"#
            ]
        );
        assert_eq!(found[0].address, Some(0xffff_ffff_8134_9950));
    }

    #[test]
    fn return_suffix_is_kept() {
        let symbols = table();

        let found = list(
            r#"kernel.function("vfs_read").return"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap();

        assert_eq!(found[0].name, r#"kernel.function("vfs_read").return"#);
    }

    #[test]
    fn syscall_resolves_to_its_x64_entry() {
        let symbols = table();

        let found = list(
            r#"kernel.syscall("getpid")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap();

        assert_eq!(found.len(), 1);
        assert_eq!(found[0].name, r#"kernel.syscall("getpid")"#);
        assert_eq!(found[0].address, Some(0xffff_ffff_810b_0d90));
    }

    #[test]
    fn unknown_function_is_no_match() {
        let symbols = table();

        let err = list(
            r#"kernel.function("nope_*")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap_err();

        assert!(err.to_string().contains("no match"), "{err}");
    }

    #[test]
    fn file_filter_says_it_needs_debug_info() {
        let symbols = table();

        let err = list(
            r#"kernel.function("vfs_read@fs/read_write.c")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap_err();

        assert!(err.to_string().contains("debug info"), "{err}");
    }

    #[test]
    fn statement_at_function_offset_is_the_symbol_plus_the_offset() {
        let symbols = table();

        let found = list(
            r#"kernel.statement("vfs_read+0x1c")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap();

        assert_eq!(found.len(), 1);
        assert_eq!(found[0].name, r#"kernel.statement("vfs_read+0x1c")"#);
        assert_eq!(found[0].address, Some(0xffff_ffff_8134_9950 + 0x1c));
        let decimal = list(
            r#"kernel.statement("vfs_read+28")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap();
        assert_eq!(decimal[0].address, found[0].address);
    }

    #[test]
    fn statement_with_a_bad_offset_says_how_to_write_it() {
        let symbols = table();

        let err = list(
            r#"kernel.statement("vfs_read+zz")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap_err();

        assert!(err.to_string().contains("func+OFFSET"), "{err}");
    }

    #[test]
    fn absolute_statement_names_its_symbol() {
        let symbols = table();

        let found = list(
            "kernel.statement(0xffffffff81349960).absolute",
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap();

        assert!(
            found[0].name.ends_with("(vfs_read+0x10)"),
            "{}",
            found[0].name
        );
    }

    #[test]
    fn tracepoint_resolves_to_its_iterator() {
        let symbols = table();

        let found = list(
            r#"kernel.trace("sched:sched_switch")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap();

        assert_eq!(found[0].name, r#"kernel.trace("sched_switch")"#);
        assert_eq!(found[0].address, Some(0xffff_ffff_810c_0000));
    }
}
