//! Resolving kernel probe points against the guest kernel's symbols (kallsyms from the image)
//! and, for `-L`, the parameters its BTF records.
//!
//! Addresses are link-time; the backend adds the KASLR slide when it attaches. Points that need
//! source positions or struct layouts from DWARF (`@file`, `:line`, `kernel.statement("f@file:
//! line")`, `kernel.field`) say so instead of guessing.

use exotap_introspect::btf::cdecl::declaration;
use exotap_introspect::btf::Btf;
use exotap_introspect::symbols::{Symbol, SymbolTable};

use super::ast::ProbePoint;
use super::point::PointKind;
use super::resolve::{NoSymbols, ProbePointResolver, ResolveError, ResolvedPoint};

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
}

impl<'a> KernelSymbols<'a> {
    /// A resolver over `symbols`; `btf` adds parameters as target variables.
    pub fn new(symbols: &'a SymbolTable, btf: Option<&'a Btf>) -> Self {
        Self { symbols, btf }
    }

    /// Code symbols matching `pattern`, one per name, in name order.
    fn functions(&self, pattern: &str) -> Vec<&'a Symbol> {
        let mut found: Vec<&Symbol> = self
            .symbols
            .matching(pattern)
            .into_iter()
            .filter(|s| s.is_text())
            .collect();
        found.sort_by(|a, b| a.name.cmp(&b.name));
        found.dedup_by(|a, b| a.name == b.name);
        found
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
        }
    }
}

/// `func+OFFSET` split into the function pattern and the byte offset (decimal or `0x` hex).
fn function_offset(spec: &str) -> Option<(&str, u64)> {
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

fn needs_debuginfo(point: &ProbePoint, why: &str) -> ResolveError {
    ResolveError::NeedsDebugInfo {
        what: format!("{point} {why}"),
    }
}

impl ProbePointResolver for KernelSymbols<'_> {
    fn resolve(
        &self,
        point: &ProbePoint,
        kind: &PointKind,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        let found = match kind {
            PointKind::KernelFunction { file: Some(_), .. }
            | PointKind::KernelFunction { line: Some(_), .. } => {
                return Err(needs_debuginfo(point, "filters by source file or line"));
            }
            PointKind::KernelFunction { pattern, site, .. } => self
                .functions(pattern)
                .into_iter()
                .map(|sym| {
                    let name = format!("kernel.function(\"{}\"){}", sym.name, site.suffix());
                    self.point(name, sym, self.parameters(&sym.name))
                })
                .collect(),
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
                    })
                    .collect()
            }
            PointKind::KernelStatement { .. } => {
                return Err(needs_debuginfo(point, "names a source line"));
            }
            PointKind::KernelField { .. } => {
                return Err(needs_debuginfo(
                    point,
                    "needs struct layouts and variable locations",
                ));
            }
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
            PointKind::TimerProfile => vec![ResolvedPoint {
                name: point.to_string(),
                address: None,
                variables: Vec::new(),
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
    use crate::lang::resolve::list;

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
        ])
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
