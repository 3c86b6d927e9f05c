//! Probe point resolution: from what a point means ([`PointKind`]) to concrete places in the
//! guest kernel. The symbol table lives in introspect/; this module only defines the interface
//! and a resolver for when no symbols are at hand.

use super::ast::ProbePoint;
use super::check::Program;
use super::diag::Diagnostic;
use super::parser::parse;
use super::point::{classify, DataTarget, FieldAccess, FunctionSite, PointKind};
use super::Limits;

/// One concrete place a probe point stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedPoint {
    /// How it is listed, e.g. `kernel.function("vfs_read@fs/read_write.c:450")`.
    pub name: String,
    /// Guest kernel virtual address, when it is one.
    pub address: Option<u64>,
    /// Target variables available there (for `-L`).
    pub variables: Vec<String>,
    /// An inlined instance the point did not name itself (`kernel.function("F")` adds F's
    /// instances; `.inline` names them): where it cannot be served (a variable the probe
    /// reads is not there, the instruction takes no probe), it is left out with a warning,
    /// where a place the point named is an error.
    pub implicit: bool,
}

/// Why a probe point could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// Resolving needs the guest kernel's symbols, which this resolver does not have.
    #[error("{what}: resolving it needs the guest kernel's symbols")]
    NeedsSymbols {
        /// What the point means.
        what: String,
    },
    /// Resolving needs the -dbg vmlinux, which is not cached.
    #[error(
        "{what} names a source file or line: that needs the kernel's DWARF debug info, and no \
         -dbg vmlinux is cached (run `exotap image fetch --debuginfo`)"
    )]
    NoDebugInfo {
        /// The point.
        what: String,
    },
    /// A source position that does not resolve (no code at the line, bad line), in words.
    #[error("{0}")]
    Source(String),
    /// Nothing matches.
    #[error("no match for probe point '{0}'")]
    NoMatch(String),
}

/// Finds the places a probe point stands for.
pub trait ProbePointResolver {
    /// Resolves `point` (already classified as `kind`).
    ///
    /// # Errors
    /// When it cannot be resolved.
    fn resolve(
        &self,
        point: &ProbePoint,
        kind: &PointKind,
    ) -> Result<Vec<ResolvedPoint>, ResolveError>;
}

/// A resolver with no symbol source: host-side points resolve to themselves, kernel points
/// need symbols.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoSymbols;

impl ProbePointResolver for NoSymbols {
    fn resolve(
        &self,
        point: &ProbePoint,
        kind: &PointKind,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        if kind.needs_guest() {
            return Err(ResolveError::NeedsSymbols {
                what: format!("{point} is {}", describe(kind)),
            });
        }
        Ok(vec![ResolvedPoint {
            name: point.to_string(),
            address: None,
            variables: Vec::new(),
            implicit: false,
        }])
    }
}

fn location(file: &Option<String>, line: &Option<String>) -> String {
    match (file, line) {
        (Some(f), Some(l)) => format!(" in {f} at line {l}"),
        (Some(f), None) => format!(" in {f}"),
        _ => String::new(),
    }
}

/// What a probe point means, in words.
pub fn describe(kind: &PointKind) -> String {
    match kind {
        PointKind::Begin(n) => format!("the session start (order {n})"),
        PointKind::End(n) => format!("the normal session end (order {n})"),
        PointKind::Error(n) => format!("the session end after errors (order {n})"),
        PointKind::Never => "a point that never fires".to_string(),
        PointKind::Timer { period_ns } => format!("a host timer every {period_ns} ns"),
        PointKind::TimerProfile => "every scheduler tick of every guest CPU".to_string(),
        PointKind::InputChar => "each byte of exotap's standard input".to_string(),
        PointKind::InputLine => "each line of exotap's standard input".to_string(),
        PointKind::Procfs { name, write, .. } => format!(
            "each {} of the procfs file {name} the host serves",
            if *write { "write" } else { "read" }
        ),
        PointKind::KernelFunction {
            pattern,
            file,
            line,
            site,
        } => {
            let what = match site {
                FunctionSite::Entry => "the entry of",
                FunctionSite::Call => "the entry of the out-of-line instances of",
                FunctionSite::Inline => "the inlined instances of",
                FunctionSite::Return => "the return of",
            };
            format!(
                "{what} kernel functions matching '{pattern}'{}",
                location(file, line)
            )
        }
        PointKind::ModuleFunction {
            module,
            pattern,
            statement: Some(line),
            ..
        } => {
            let lines = match line.lines {
                None => "every line".to_owned(),
                Some((first, last)) if first == last => format!("line {first}"),
                Some((first, last)) => format!("lines {first}-{last}"),
            };
            format!(
                "{lines} of {} in the functions matching '{pattern}' of the kernel modules \
                 matching '{module}' (found in the live guest)",
                line.file
            )
        }
        PointKind::ModuleFunction {
            module,
            field: Some(f),
            ..
        } => format!(
            "the instructions that {} {}'s member {} in the kernel modules matching '{module}' \
             (found in the live guest)",
            match f.access {
                FieldAccess::Read => "read",
                FieldAccess::Write => "write",
                FieldAccess::Call => "call through",
            },
            f.structure,
            f.member
        ),
        PointKind::ModuleFunction {
            module,
            pattern,
            offset: Some(offset),
            ..
        } => format!(
            "the instruction at offset {offset:#x} into function '{pattern}' of the kernel \
             modules matching '{module}' (found in the live guest)"
        ),
        PointKind::ModuleFunction {
            module,
            pattern,
            file,
            line,
            site,
            statement: None,
            field: None,
            offset: None,
        } => {
            let what = match site {
                FunctionSite::Return => "the return of",
                FunctionSite::Inline => "the inlined instances of",
                _ => "the entry of",
            };
            let line = line.map(|(first, last)| {
                if first == last {
                    first.to_string()
                } else {
                    format!("{first}-{last}")
                }
            });
            format!(
                "{what} the functions matching '{pattern}'{} of the kernel modules matching \
                 '{module}' (found in the live guest)",
                location(file, &line)
            )
        }
        PointKind::KernelStatement {
            function,
            file,
            line,
        } => {
            format!(
                "a statement of kernel function '{function}'{}",
                location(file, line)
            )
        }
        PointKind::KernelAddress(a) => format!("the kernel instruction at {a:#x}"),
        PointKind::KernelField {
            structure,
            member,
            access,
        } => {
            let what = match access {
                FieldAccess::Read => "every read of",
                FieldAccess::Write => "every write of",
                FieldAccess::Call => "every call through",
            };
            format!("{what} member '{member}' of '{structure}'")
        }
        PointKind::Syscall { name, ret } => {
            let when = if *ret {
                "the return of"
            } else {
                "the entry of"
            };
            format!("{when} system calls matching '{name}'")
        }
        PointKind::KernelTrace { name } => format!("the kernel tracepoints matching '{name}'"),
        PointKind::KernelData {
            target,
            len,
            write_only,
        } => {
            let what = match target {
                DataTarget::Address(a) => format!("the kernel data at {a:#x}"),
                DataTarget::Symbol(s) => format!("the kernel data '{s}'"),
            };
            let access = if *write_only {
                "write"
            } else {
                "read or write"
            };
            format!("each {access} of {len} byte(s) of {what}")
        }
    }
}

/// Resolves every probe point of `prog` with SystemTap's rules: a point marked `?` that does
/// not resolve is dropped, and once a point marked `!` resolves, the later points of the same
/// probe are not tried. Returns (probe index, place) pairs.
///
/// # Errors
/// The first failure of a point that is not optional.
pub fn resolve_program(
    prog: &Program,
    resolver: &dyn ProbePointResolver,
) -> Result<Vec<(usize, ResolvedPoint)>, ResolveError> {
    let mut out = Vec::new();
    for (i, probe) in prog.probes.iter().enumerate() {
        for (point, kind) in &probe.points {
            // `!` (sufficient) implies `?` (optional), as in SystemTap.
            let optional = point.optional || point.sufficient;
            match resolver.resolve(point, kind) {
                Ok(found) if found.is_empty() && !optional => {
                    return Err(ResolveError::NoMatch(point.to_string()))
                }
                Ok(found) => {
                    let resolved = !found.is_empty();
                    out.extend(found.into_iter().map(|r| (i, r)));
                    if resolved && point.sufficient {
                        break;
                    }
                }
                Err(_) if optional => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(out)
}

/// Why a `-l`/`-L` listing failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ListError {
    /// The pattern is not a probe point.
    #[error("'{pattern}' is not a probe point")]
    BadPattern {
        /// The pattern.
        pattern: String,
        /// The source text the diagnostics point into.
        text: String,
        /// What is wrong.
        diagnostics: Vec<Diagnostic>,
    },
    /// Resolution failed.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
}

/// Lists what `pattern` (a probe point such as `kernel.function("vfs_*")`) matches.
///
/// # Errors
/// When the pattern is not a probe point or cannot be resolved.
pub fn list(
    pattern: &str,
    resolver: &dyn ProbePointResolver,
) -> Result<Vec<ResolvedPoint>, ListError> {
    let source = format!("probe {pattern} {{}}");
    let bad = |diagnostics: Vec<Diagnostic>| ListError::BadPattern {
        pattern: pattern.to_string(),
        text: source.clone(),
        diagnostics,
    };
    let script = parse(&source, &Limits::default()).map_err(|e| bad(vec![Diagnostic::from(&e)]))?;
    let mut out = Vec::new();
    for probe in &script.probes {
        for point in &probe.points {
            let kind = classify(point)
                .map_err(|e| bad(vec![Diagnostic::error(e.to_string(), e.span())]))?;
            out.extend(resolver.resolve(point, &kind)?);
        }
    }
    // As stap's: a point listed once, however many places share its name (the inlined
    // instances of one function).
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert((p.name.clone(), p.variables.clone())));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn begin_lists_itself_without_symbols() {
        let found = list("begin", &NoSymbols).unwrap();
        assert_eq!(found[0].name, "begin");
    }

    #[test]
    fn kernel_function_needs_symbols() {
        let err = list(r#"kernel.function("vfs_*@fs/read_write.c")"#, &NoSymbols).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("kernel functions matching 'vfs_*' in fs/read_write.c"),
            "{text}"
        );
        assert!(text.contains("symbols"));
    }

    /// Knows one kernel function, `a`.
    struct OneFunction;

    impl ProbePointResolver for OneFunction {
        fn resolve(
            &self,
            point: &ProbePoint,
            kind: &PointKind,
        ) -> Result<Vec<ResolvedPoint>, ResolveError> {
            match kind {
                PointKind::KernelFunction { pattern, .. } if pattern == "a" => {
                    Ok(vec![ResolvedPoint {
                        name: point.to_string(),
                        address: Some(0x1000),
                        variables: vec!["$x".into()],
                        implicit: false,
                    }])
                }
                PointKind::KernelFunction { .. } => Err(ResolveError::NoMatch(point.to_string())),
                _ => NoSymbols.resolve(point, kind),
            }
        }
    }

    fn program(src: &str) -> Program {
        crate::check::check(parse(src, &Limits::default()).unwrap()).unwrap()
    }

    #[test]
    fn optional_point_that_does_not_resolve_is_dropped() {
        let prog = program("probe kernel.function(\"zz\")?, kernel.function(\"a\") { }");
        let found = resolve_program(&prog, &OneFunction).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].1.address, Some(0x1000));
    }

    #[test]
    fn sufficient_point_stops_the_list_when_it_resolves() {
        let prog = program("probe kernel.function(\"a\")!, kernel.function(\"zz\") { }");
        assert_eq!(resolve_program(&prog, &OneFunction).unwrap().len(), 1);
    }

    #[test]
    fn sufficient_point_that_does_not_resolve_is_optional() {
        let prog = program("probe kernel.function(\"zz\")!, kernel.function(\"a\") { }");
        assert_eq!(resolve_program(&prog, &OneFunction).unwrap().len(), 1);
    }

    #[test]
    fn mandatory_point_that_does_not_resolve_fails() {
        let prog = program("probe kernel.function(\"zz\") { }");
        assert!(resolve_program(&prog, &OneFunction).is_err());
    }

    #[test]
    fn garbage_pattern_is_a_bad_pattern() {
        assert!(matches!(
            list("{{{", &NoSymbols),
            Err(ListError::BadPattern { .. })
        ));
    }
}
