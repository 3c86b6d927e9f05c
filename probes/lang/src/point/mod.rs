//! Probe point families: what a written probe point means, before any symbol lookup.

use super::ast::{Literal, ProbePoint, Span};

mod module;
use module::{module_field, module_function, module_statement};

/// Which instances of a kernel function a `kernel.function` point covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FunctionSite {
    /// Entry of the out-of-line instance and, for a name without wildcards with the -dbg
    /// vmlinux, each inlined instance, as in SystemTap (see `kernel_points`).
    Entry,
    /// `.call`: entry of out-of-line instances only.
    Call,
    /// `.inline`: inlined instances only.
    Inline,
    /// `.return`: return of out-of-line instances.
    Return,
}

impl FunctionSite {
    /// The probe-point suffix that selects this site (`""`, `.call`, `.inline`, `.return`).
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Entry => "",
            Self::Call => ".call",
            Self::Inline => ".inline",
            Self::Return => ".return",
        }
    }
}

/// How a struct member is accessed (KLAS join points).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldAccess {
    /// Loads of the member.
    Read,
    /// Stores to the member.
    Write,
    /// Indirect calls through a function-pointer member.
    Call,
}

/// The member accesses a `module("m").field("struct S", "member").ACCESS` point names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberAccess {
    /// The struct, with its `struct ` prefix.
    pub structure: String,
    /// Member name (a path: `a.b`).
    pub member: String,
    /// Which accesses.
    pub access: FieldAccess,
}

impl FieldAccess {
    /// The access a point's last component (`read`, `write`, `call`) names.
    pub fn from_suffix(suffix: &str) -> Option<FieldAccess> {
        match suffix {
            "read" => Some(FieldAccess::Read),
            "write" => Some(FieldAccess::Write),
            "call" => Some(FieldAccess::Call),
            _ => None,
        }
    }
}

impl MemberAccess {
    /// `.read`, `.write` or `.call`, as the point ends.
    pub fn suffix(&self) -> &'static str {
        match self.access {
            FieldAccess::Read => "read",
            FieldAccess::Write => "write",
            FieldAccess::Call => "call",
        }
    }
}

/// A source line of a statement point: `FILE:N` or `FILE:N-M` (a range of lines), or
/// `FILE:*` (every line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceLine {
    /// The source file, as a trailing path (`drivers/input/evdev.c`, `evdev.c`).
    pub file: String,
    /// The first and last line; `None` for `*`, every line of the functions the point names.
    pub lines: Option<(u32, u32)>,
}

impl SourceLine {
    /// `N`, `N-M` or `*`, as the point wrote it.
    pub fn lines_text(&self) -> String {
        match self.lines {
            None => "*".to_owned(),
            Some((first, last)) if first == last => first.to_string(),
            Some((first, last)) => format!("{first}-{last}"),
        }
    }
}

/// `N` or `N-M` (1-based, N ≤ M), as statement points write lines.
pub fn parse_lines(spec: &str) -> Option<(u32, u32)> {
    let (a, b) = match spec.split_once('-') {
        Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
        None => {
            let n = spec.trim().parse().ok()?;
            (n, n)
        }
    };
    (a <= b && a > 0).then_some((a, b))
}

/// What a probe point means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PointKind {
    /// `begin` / `begin(N)`: once at start, ordered by N.
    Begin(i64),
    /// `end` / `end(N)`: once at normal exit.
    End(i64),
    /// `error` / `error(N)`: once at exit after a runtime error.
    Error(i64),
    /// `never`: never fires (useful to type-check code).
    Never,
    /// `timer.ms(N)` and friends: on the host's wall clock, every `period_ns`.
    Timer {
        /// Period in nanoseconds.
        period_ns: u64,
    },
    /// `timer.profile`: every scheduler tick of every guest CPU.
    TimerProfile,
    /// `input.char`: each byte of exotap's standard input (on the host, as stap's reads its
    /// own), in the local `char`.
    InputChar,
    /// `input.line`: each line of exotap's standard input, its newline included, in the local
    /// `line`.
    InputLine,
    /// `procfs("NAME").read[.maxsize(N)]` / `procfs("NAME").write` (`procfs.read`: the name
    /// `command`; `procfs.umask(M)...`): a file the host serves (`exotap_probes_base::procfs`), whose
    /// reads run the `.read` probe and return what it left in `$value`, and whose writes run
    /// the `.write` probe with the bytes written in `$value`.
    Procfs {
        /// The file's name.
        name: String,
        /// `.write` rather than `.read`.
        write: bool,
        /// `.maxsize(N)`: the most bytes a read returns.
        maxsize: Option<u64>,
        /// `.umask(M)`: the permission bits taken away from the file's (0o600 without).
        umask: Option<u32>,
    },
    /// `kernel.function("pattern@file:line")[.call|.inline|.return]`.
    KernelFunction {
        /// Function name pattern, with `*` and `?` wildcards.
        pattern: String,
        /// `@file` filter.
        file: Option<String>,
        /// `:line` filter.
        line: Option<String>,
        /// Which instances.
        site: FunctionSite,
    },
    /// `module("m").function("pattern")[.call|.return]` (or `kprobe.module(...)`): functions
    /// of a loaded kernel module, found in the live guest's module list when the script
    /// attaches (their symbols are the module's own kallsyms), not in the image.
    ModuleFunction {
        /// Module name pattern, with `*` and `?` wildcards.
        module: String,
        /// Function name pattern, with `*` and `?` wildcards.
        pattern: String,
        /// `@FILE`: only the functions the module's DWARF says FILE defines.
        file: Option<String>,
        /// `@FILE:N` (or `:N-M`): only those of them with code of the lines, as
        /// `kernel.function("f@FILE:N")` has it.
        line: Option<(u32, u32)>,
        /// Which instances (`Entry`, `Call`, `Return` or `Inline`; `Entry` for a statement).
        site: FunctionSite,
        /// `module("m").statement("f@FILE:LINE")`: the source line, in the functions
        /// matching `pattern` (from the module's DWARF line table, when it is placed).
        statement: Option<SourceLine>,
        /// `module("m").field("struct S", "member").ACCESS`: the instructions of the
        /// functions matching `pattern` (`*`) that access the member (KLAS's join points in
        /// the module's DWARF and code, when it is placed).
        field: Option<MemberAccess>,
        /// `module("m").statement("f+OFFSET")`: the instruction at a byte offset into the
        /// function `pattern` (an instruction boundary, as the planner checks when the module
        /// is placed).
        offset: Option<u64>,
    },
    /// `kernel.statement("func@file:line")`, or `kernel.statement("func+OFFSET")` (an
    /// instruction boundary at a byte offset into the function).
    KernelStatement {
        /// Function name pattern.
        function: String,
        /// Source file.
        file: Option<String>,
        /// Source line.
        line: Option<String>,
    },
    /// `kernel.statement(ADDR).absolute`.
    KernelAddress(u64),
    /// `kernel.field("struct S", "member").read|.write|.call`.
    KernelField {
        /// The struct, with its `struct ` prefix.
        structure: String,
        /// Member name.
        member: String,
        /// Which accesses.
        access: FieldAccess,
    },
    /// `kernel.syscall("name")[.return]`.
    Syscall {
        /// Syscall name pattern.
        name: String,
        /// `.return`.
        ret: bool,
    },
    /// `kernel.trace("[system:]name")`: a kernel tracepoint, its arguments from BTF's
    /// `btf_trace_NAME` typedef.
    KernelTrace {
        /// Tracepoint name pattern, without the `system:` prefix.
        name: String,
    },
    /// `kernel.data(ADDR|"symbol")[.length(N)].write|.rw`: a hardware watchpoint on `len`
    /// bytes of kernel data; the probe runs after each access, on the vCPU that made it.
    KernelData {
        /// What is watched.
        target: DataTarget,
        /// How many bytes (1, 2, 4 or 8).
        len: u64,
        /// `.write` (writes only) rather than `.rw` (reads and writes).
        write_only: bool,
    },
}

/// The data a `kernel.data` probe watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataTarget {
    /// A link-time kernel address (`kernel.data(0xffffffff82a4c6e0)`).
    Address(u64),
    /// A kernel data symbol (`kernel.data("vm_dirty_ratio")`), slid like any symbol.
    Symbol(String),
}

impl PointKind {
    /// Whether this point fires inside the guest kernel (so it needs a guest to run).
    pub fn needs_guest(&self) -> bool {
        !matches!(
            self,
            PointKind::Begin(_)
                | PointKind::End(_)
                | PointKind::Error(_)
                | PointKind::Never
                | PointKind::Timer { .. }
                | PointKind::InputChar
                | PointKind::InputLine
                | PointKind::Procfs { .. }
        )
    }

    /// The local a probe on this point starts with: `char` for `input.char`, `line` for
    /// `input.line`, [`PROCFS_VALUE`] for procfs probes (strings).
    pub fn given_local(&self) -> Option<&'static str> {
        match self {
            PointKind::InputChar => Some("char"),
            PointKind::InputLine => Some("line"),
            PointKind::Procfs { .. } => Some(PROCFS_VALUE),
            _ => None,
        }
    }

    /// Whether this point reads exotap's standard input (`input.char`, `input.line`).
    pub fn reads_input(&self) -> bool {
        matches!(self, PointKind::InputChar | PointKind::InputLine)
    }

    /// Whether target variables (`$x`) can be read at this point.
    pub fn has_target_vars(&self) -> bool {
        matches!(
            self,
            PointKind::KernelFunction { .. }
                | PointKind::KernelStatement { .. }
                | PointKind::KernelAddress(_)
                | PointKind::KernelField { .. }
                | PointKind::Syscall { .. }
                | PointKind::KernelTrace { .. }
                // A module function's: at its entry from the module's DWARF; at its return
                // `$return` and its parameters as at the entry, from the module's BTF.
                | PointKind::ModuleFunction { .. }
        )
    }

    /// Whether `$return` is available.
    pub fn is_return(&self) -> bool {
        matches!(
            self,
            PointKind::KernelFunction {
                site: FunctionSite::Return,
                ..
            } | PointKind::ModuleFunction {
                site: FunctionSite::Return,
                ..
            } | PointKind::Syscall { ret: true, .. }
        )
    }

    /// The family name used in messages (`begin`, `timer`, `kernel.function`, ...).
    pub fn family(&self) -> &'static str {
        match self {
            PointKind::Begin(_) => "begin",
            PointKind::End(_) => "end",
            PointKind::Error(_) => "error",
            PointKind::Never => "never",
            PointKind::Timer { .. } => "timer",
            PointKind::TimerProfile => "timer.profile",
            PointKind::InputChar => "input.char",
            PointKind::InputLine => "input.line",
            PointKind::Procfs { .. } => "procfs",
            PointKind::KernelFunction { .. } => "kernel.function",
            PointKind::ModuleFunction {
                statement: Some(_), ..
            }
            | PointKind::ModuleFunction {
                offset: Some(_), ..
            } => "module.statement",
            PointKind::ModuleFunction { field: Some(_), .. } => "module.field",
            PointKind::ModuleFunction { .. } => "module.function",
            PointKind::KernelStatement { .. } | PointKind::KernelAddress(_) => "kernel.statement",
            PointKind::KernelField { .. } => "kernel.field",
            PointKind::Syscall { .. } => "kernel.syscall",
            PointKind::KernelTrace { .. } => "kernel.trace",
            PointKind::KernelData { .. } => "kernel.data",
        }
    }
}

/// Why a probe point means nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PointError {
    /// No family matches.
    #[error("unknown probe point '{text}'")]
    Unknown {
        /// The point as written.
        text: String,
        /// Where.
        span: Span,
    },
    /// A family exotap knows but does not provide, with the reason.
    #[error("probe point '{text}' is not supported: {reason}")]
    OutOfScope {
        /// The point as written.
        text: String,
        /// Why, and what to use instead.
        reason: String,
        /// Where.
        span: Span,
    },
    /// The family matches but an argument is wrong.
    #[error("bad argument to '{family}': {reason}")]
    BadArgument {
        /// The family.
        family: String,
        /// What is wrong.
        reason: String,
        /// Where.
        span: Span,
    },
}

impl PointError {
    /// Where the error is.
    pub fn span(&self) -> Span {
        match self {
            PointError::Unknown { span, .. }
            | PointError::OutOfScope { span, .. }
            | PointError::BadArgument { span, .. } => *span,
        }
    }
}

/// The families, for hints and for `-L`.
pub const KNOWN_FAMILIES: &str =
    "begin, end, error, never, input.char, input.line, timer.ms|us|ns|s|hz|jiffies(N), \
timer.profile, kernel.function(\"pat[@file[:line]]\")[.call|.inline|.return], \
kernel.statement(\"func@file:line\"), kernel.statement(\"func+OFFSET\"), \
kernel.statement(ADDR).absolute, \
kernel.field(\"struct S\", \"member\").read|.write|.call, kernel.syscall(\"name\")[.return], \
kernel.trace(\"tracepoint\"), module(\"m\").function(\"pat\")[.call|.return], kernel.data(ADDR|\"symbol\")[.length(N)].write|.rw, kprobe.function(\"name\")[.return], \
kprobe.statement(ADDR).absolute, and the tapset's aliases (syscall.*, vfs.*, scheduler.*, ...)";

fn split_location(spec: &str) -> (String, Option<String>, Option<String>) {
    match spec.split_once('@') {
        None => (spec.to_string(), None, None),
        Some((func, rest)) => match rest.rsplit_once(':') {
            Some((file, line)) => (
                func.to_string(),
                Some(file.to_string()),
                Some(line.to_string()),
            ),
            None => (func.to_string(), Some(rest.to_string()), None),
        },
    }
}

/// Says what `point` means.
///
/// # Errors
/// When it matches no family or an argument is wrong.
pub fn classify(point: &ProbePoint) -> Result<PointKind, PointError> {
    let names: Vec<&str> = point.components.iter().map(|c| c.name.as_str()).collect();
    let args = |i: usize| {
        point
            .components
            .get(i)
            .map(|c| c.args.as_slice())
            .unwrap_or(&[])
    };
    let bad = |family: &str, reason: &str| PointError::BadArgument {
        family: family.to_string(),
        reason: reason.to_string(),
        span: point.span,
    };
    let unknown = || PointError::Unknown {
        text: point.to_string(),
        span: point.span,
    };
    let seq = |family: &str| -> Result<i64, PointError> {
        match args(0) {
            [] => Ok(0),
            [Literal::Num(n)] => Ok(*n),
            _ => Err(bad(family, "expected one number (the order)")),
        }
    };
    let one_str = |i: usize, family: &str| -> Result<String, PointError> {
        match args(i) {
            [Literal::Str(s)] if !s.is_empty() => Ok(s.clone()),
            _ => Err(bad(family, "expected one non-empty string")),
        }
    };
    // `.return.maxactive(N)`: how many calls of the function a kretprobe may follow at once.
    // exotap's return probes share fixed pools instead (trap probes: RETURN_SLOTS calls in
    // flight; compiled probes: their return table), and count and report every call that
    // misses its return probe, so N is checked and accepted but neither lowers nor raises
    // that limit (probes/README.md).
    let maxactive = |family: &str| -> Result<(), PointError> {
        match args(3) {
            [Literal::Num(n)] if *n > 0 => Ok(()),
            _ => Err(bad(family, "maxactive takes one positive number")),
        }
    };
    if let Some(reason) = out_of_scope(&names) {
        return Err(PointError::OutOfScope {
            text: point.to_string(),
            reason: reason.to_string(),
            span: point.span,
        });
    }
    let known_root = matches!(
        names.first(),
        Some(
            &("begin"
                | "end"
                | "error"
                | "never"
                | "timer"
                | "kernel"
                | "kprobe"
                | "module"
                | "input"
                | "procfs")
        )
    );
    if !known_root {
        return Err(unknown());
    }
    for (i, c) in point.components.iter().enumerate() {
        let allowed = matches!(
            (names.first(), i),
            (Some(&"kernel" | &"kprobe"), 1)
                | (Some(&"module"), 0 | 1)
                | (Some(&"timer"), 1)
                | (Some(&"begin" | &"end" | &"error"), 0)
        ) || (c.name == "maxactive" && i == 3)
            || (names.first() == Some(&"kprobe")
                && names.get(1) == Some(&"module")
                && (i == 2 || (c.name == "maxactive" && i == 4)))
            || (c.name == "length" && i == 2 && names.get(1) == Some(&"data"))
            || (names.first() == Some(&"procfs")
                && matches!(c.name.as_str(), "procfs" | "umask" | "maxsize"));
        if !c.args.is_empty() && !allowed {
            return Err(bad(&c.name, "this component takes no argument"));
        }
    }
    match names.as_slice() {
        ["begin"] => Ok(PointKind::Begin(seq("begin")?)),
        ["end"] => Ok(PointKind::End(seq("end")?)),
        ["error"] => Ok(PointKind::Error(seq("error")?)),
        ["never"] => Ok(PointKind::Never),
        ["input", "char"] => Ok(PointKind::InputChar),
        ["input", "line"] => Ok(PointKind::InputLine),
        ["procfs", ..] => procfs_point(point),
        ["timer", "profile"] | ["timer", "profile", "tick"] => Ok(PointKind::TimerProfile),
        ["timer", unit] => {
            let n = match args(1) {
                [Literal::Num(n)] if *n > 0 => *n as u64,
                _ => return Err(bad("timer", "expected one positive number")),
            };
            let period_ns = match *unit {
                "ns" | "nsec" => Some(n),
                "us" | "usec" => n.checked_mul(1_000),
                "ms" | "msec" => n.checked_mul(1_000_000),
                "s" | "sec" => n.checked_mul(1_000_000_000),
                "jiffies" => n.checked_mul(4_000_000),
                "hz" if n <= 1_000_000_000 => Some(1_000_000_000 / n),
                "hz" => return Err(bad("timer.hz", "at most 1000000000 Hz")),
                _ => return Err(unknown()),
            }
            .ok_or_else(|| bad("timer", "period too long"))?;
            Ok(PointKind::Timer { period_ns })
        }
        ["kernel", "function", rest @ ..] => {
            let spec = one_str(1, "kernel.function")?;
            let (pattern, file, line) = split_location(&spec);
            if pattern.is_empty() {
                return Err(bad("kernel.function", "empty function name"));
            }
            let site = match rest {
                [] => FunctionSite::Entry,
                ["call"] => FunctionSite::Call,
                ["inline"] => FunctionSite::Inline,
                ["return"] => FunctionSite::Return,
                ["return", "maxactive"] => {
                    maxactive("kernel.function")?;
                    FunctionSite::Return
                }
                _ => return Err(unknown()),
            };
            Ok(PointKind::KernelFunction {
                pattern,
                file,
                line,
                site,
            })
        }
        ["module", "function", rest @ ..] => module_function(point, 0, rest),
        ["kprobe", "module", "function", rest @ ..] => module_function(point, 1, rest),
        ["module", "statement"] => module_statement(point),
        ["module", "field", access] => module_field(point, access),
        ["module", "field"] => Err(bad("module.field", "say .read, .write or .call")),
        ["module", ..] | ["kprobe", "module", ..] => Err(PointError::OutOfScope {
            text: point.to_string(),
            reason: "in a kernel module exotap probes functions (module(\"m\").function(\"f\") \
                     and its .call, .return and .inline) and source lines \
                     (module(\"m\").statement(\"f@FILE:LINE\"))"
                .to_string(),
            span: point.span,
        }),
        ["kernel", "statement", rest @ ..] => match (args(1), rest) {
            ([Literal::Num(addr)], ["absolute"]) => Ok(PointKind::KernelAddress(*addr as u64)),
            ([Literal::Num(_)], []) => Err(bad("kernel.statement", "an address needs .absolute")),
            ([Literal::Str(spec)], []) => {
                let (function, file, line) = split_location(spec);
                if function.is_empty() {
                    return Err(bad("kernel.statement", "empty function name"));
                }
                Ok(PointKind::KernelStatement {
                    function,
                    file,
                    line,
                })
            }
            ([Literal::Str(_)], _) | ([Literal::Num(_)], _) => Err(unknown()),
            _ => Err(bad(
                "kernel.statement",
                "expected \"func@file:line\" or an address",
            )),
        },
        ["kernel", "field", access] => {
            let (structure, member) = match args(1) {
                [Literal::Str(s), Literal::Str(m)] if !s.is_empty() && !m.is_empty() => {
                    (s.clone(), m.clone())
                }
                _ => return Err(bad("kernel.field", "expected (\"struct S\", \"member\")")),
            };
            let access = FieldAccess::from_suffix(access).ok_or_else(unknown)?;
            Ok(PointKind::KernelField {
                structure,
                member,
                access,
            })
        }
        ["kernel", "field"] => Err(bad("kernel.field", "say .read, .write or .call")),
        ["kernel", "syscall", rest @ ..] => {
            let name = one_str(1, "kernel.syscall")?;
            let ret = match rest {
                [] => false,
                ["return"] => true,
                _ => return Err(unknown()),
            };
            Ok(PointKind::Syscall { name, ret })
        }
        ["kernel", "trace"] => {
            let spec = one_str(1, "kernel.trace")?;
            // `system:name` (SystemTap's form); the name alone is unique in the kernel.
            let name = spec.rsplit_once(':').map_or(spec.as_str(), |(_, n)| n);
            if name.is_empty() {
                return Err(bad("kernel.trace", "empty tracepoint name"));
            }
            Ok(PointKind::KernelTrace {
                name: name.to_string(),
            })
        }
        // A kprobe on a function is what exotap's kernel.function already is: a probe on the
        // symbol, its parameters from BTF.
        ["kprobe", "function", rest @ ..] => {
            let pattern = one_str(1, "kprobe.function")?;
            let site = match rest {
                [] => FunctionSite::Call,
                ["return"] => FunctionSite::Return,
                ["return", "maxactive"] => {
                    maxactive("kprobe.function")?;
                    FunctionSite::Return
                }
                _ => return Err(unknown()),
            };
            Ok(PointKind::KernelFunction {
                pattern,
                file: None,
                line: None,
                site,
            })
        }
        ["kernel", "data", rest @ ..] => {
            let target = match args(1) {
                [Literal::Num(addr)] => DataTarget::Address(*addr as u64),
                [Literal::Str(sym)] if !sym.is_empty() => DataTarget::Symbol(sym.clone()),
                _ => return Err(bad("kernel.data", "expected an address or a symbol's name")),
            };
            let (len, access) = match rest {
                [access] => (1, *access),
                ["length", access] => match args(2) {
                    [Literal::Num(n)] if [1, 2, 4, 8].contains(n) => (*n as u64, *access),
                    _ => {
                        return Err(bad(
                            "kernel.data",
                            "a watchpoint's length is 1, 2, 4 or 8 bytes",
                        ))
                    }
                },
                _ => return Err(unknown()),
            };
            let write_only = match access {
                "write" => true,
                "rw" => false,
                _ => return Err(unknown()),
            };
            Ok(PointKind::KernelData {
                target,
                len,
                write_only,
            })
        }
        ["kprobe", "statement", "absolute"] => match args(1) {
            [Literal::Num(addr)] => Ok(PointKind::KernelAddress(*addr as u64)),
            _ => Err(bad("kprobe.statement", "expected an address")),
        },
        _ => Err(unknown()),
    }
}

/// The variable a procfs probe reads and writes as `$value` (a local of the probe: the
/// checker renames the target variable, so no script name can clash with it).
pub const PROCFS_VALUE: &str = "$value";

/// `procfs[("NAME")][.umask(M)].read[.maxsize(N)]` or `procfs[("NAME")][.umask(M)].write`.
fn procfs_point(point: &ProbePoint) -> Result<PointKind, PointError> {
    let bad = |reason: String| PointError::BadArgument {
        family: "procfs".to_string(),
        reason,
        span: point.span,
    };
    let mut parts = point.components.iter().peekable();
    let root = parts.next().ok_or_else(|| bad("empty point".into()))?;
    let name = match root.args.as_slice() {
        [] => "command".to_string(),
        [Literal::Str(s)] => s.clone(),
        _ => return Err(bad("procfs takes one string, the file's name".into())),
    };
    // A name is one path component, as a file in /proc/systemtap/MODULE/ is.
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(bad(format!(
            "{name:?} is not a file name (one path component)"
        )));
    }
    let number = |c: &crate::ast::Component, what: &str| match c.args.as_slice() {
        [Literal::Num(n)] if *n >= 0 => Ok(*n as u64),
        _ => Err(bad(format!("{what} takes one number"))),
    };
    let mut umask = None;
    if parts.peek().is_some_and(|c| c.name == "umask") {
        let c = parts.next().unwrap_or(root);
        umask = Some((number(c, "umask")? & 0o777) as u32);
    }
    let write = match parts.next().map(|c| c.name.as_str()) {
        Some("read") => false,
        Some("write") => true,
        _ => return Err(bad("expected .read or .write after procfs(...)".into())),
    };
    let mut maxsize = None;
    if let Some(c) = parts.next() {
        if c.name != "maxsize" || write {
            return Err(bad(format!(
                "unexpected .{} (only .read takes .maxsize(N))",
                c.name
            )));
        }
        maxsize = Some(number(c, "maxsize")?);
    }
    if let Some(c) = parts.next() {
        return Err(bad(format!("unexpected .{} at the end", c.name)));
    }
    Ok(PointKind::Procfs {
        name,
        write,
        maxsize,
        umask,
    })
}

/// Why a family SystemTap has is out of exotap's scope, for the points it names.
fn out_of_scope(names: &[&str]) -> Option<&'static str> {
    match names.first()? {
        &"process" => Some(
            "user-space probe points (process.*, uprobes) are out of exotap's scope: exotap \
             instruments the guest kernel from outside, with no agent in the guest's processes; \
             probe the kernel side instead (syscall.*, kernel.function)",
        ),
        &"perf" => Some(
            "perf events need the guest's perf subsystem armed from inside it, which exotap \
             does not do; use timer.profile for sampling",
        ),
        &"netfilter" => Some(
            "netfilter probes register a hook function in the guest's network stack, which \
             exotap does not do; probe nf_hook_slow or the protocol's functions with \
             kernel.function instead",
        ),
        &"nfs" | &"sunrpc" => Some(
            "exotap has no NFS client or RPC tapset (nfs.*, sunrpc.*) yet: probe those modules' \
             functions with module(\"nfs\").function(\"...\") (the server's nfsd.* points \
             are in the tapset)",
        ),
        &"glib" | &"python2" | &"python3" | &"java" | &"tcl" => Some(
            "these tapsets are markers in user-space programs (process.mark), and user-space \
             probe points are out of exotap's scope",
        ),
        &"stap" | &"staprun" | &"stapio" => Some(
            "these are markers inside SystemTap's own programs (user-space probe points), \
             which exotap neither is nor probes",
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parser::parse, Limits};

    pub(super) fn kind(point: &str) -> Result<PointKind, PointError> {
        let script = parse(&format!("probe {point} {{}}"), &Limits::default()).unwrap();
        classify(&script.probes[0].points[0])
    }

    #[test]
    fn function_pattern_with_file_filter_splits() {
        assert_eq!(
            kind(r#"kernel.function("vfs_*@fs/read_write.c").return"#).unwrap(),
            PointKind::KernelFunction {
                pattern: "vfs_*".into(),
                file: Some("fs/read_write.c".into()),
                line: None,
                site: FunctionSite::Return,
            }
        );
    }

    #[test]
    fn kernel_data_takes_an_address_or_a_symbol_a_length_and_write_or_rw() {
        assert_eq!(
            kind(r#"kernel.data("vm_dirty_ratio").rw"#).unwrap(),
            PointKind::KernelData {
                target: DataTarget::Symbol("vm_dirty_ratio".into()),
                len: 1,
                write_only: false,
            }
        );
        assert_eq!(
            kind("kernel.data(0xffffffff82a4c6e0).length(8).write").unwrap(),
            PointKind::KernelData {
                target: DataTarget::Address(0xffff_ffff_82a4_c6e0),
                len: 8,
                write_only: true,
            }
        );
        for bad in [
            "kernel.data(0x1000).length(3).write",
            "kernel.data(0x1000).length(16).rw",
            "kernel.data(0x1000).read",
            "kernel.data(0x1000)",
            r#"kernel.data("").write"#,
        ] {
            assert!(kind(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn return_maxactive_takes_a_positive_count_after_return_only() {
        for point in [
            r#"kernel.function("vfs_read").return.maxactive(16)"#,
            r#"kprobe.function("vfs_read").return.maxactive(1)"#,
        ] {
            assert!(
                matches!(
                    kind(point).unwrap(),
                    PointKind::KernelFunction {
                        site: FunctionSite::Return,
                        ..
                    }
                ),
                "{point}"
            );
        }
        for point in [
            r#"kernel.function("vfs_read").return.maxactive(0)"#,
            r#"kernel.function("vfs_read").return.maxactive"#,
        ] {
            match kind(point) {
                Err(PointError::BadArgument { reason, .. }) => {
                    assert_eq!(reason, "maxactive takes one positive number", "{point}")
                }
                other => panic!("{point}: {other:?}"),
            }
        }
        // SystemTap's order only: `.maxactive(N)` follows `.return`.
        assert!(matches!(
            kind(r#"kernel.function("vfs_read").maxactive(4).return"#),
            Err(PointError::BadArgument { .. } | PointError::Unknown { .. })
        ));
        assert!(matches!(
            kind(r#"kernel.function("vfs_read").maxactive(4)"#),
            Err(PointError::BadArgument { .. } | PointError::Unknown { .. })
        ));
    }

    #[test]
    fn procfs_points_name_their_file_direction_size_and_mask() {
        let procfs = |name: &str, write, maxsize, umask| PointKind::Procfs {
            name: name.into(),
            write,
            maxsize,
            umask,
        };
        assert_eq!(
            kind(r#"procfs("x").read"#).unwrap(),
            procfs("x", false, None, None)
        );
        assert_eq!(
            kind(r#"procfs("x").write"#).unwrap(),
            procfs("x", true, None, None)
        );
        // stap's default name, its size and mask components.
        assert_eq!(
            kind("procfs.read").unwrap(),
            procfs("command", false, None, None)
        );
        assert_eq!(
            kind(r#"procfs("__prometheus").read.maxsize(0x10000)"#).unwrap(),
            procfs("__prometheus", false, Some(0x10000), None)
        );
        assert_eq!(
            kind(r#"procfs("x").umask(0022).write"#).unwrap(),
            procfs("x", true, None, Some(0o22))
        );
        // The host serves them: no guest needed, `$value` is the probe's own.
        let k = kind(r#"procfs("x").read"#).unwrap();
        assert!(!k.needs_guest());
        assert_eq!(k.given_local(), Some(PROCFS_VALUE));
        assert!(!k.reads_input());
        for bad in [
            r#"procfs("x")"#,
            r#"procfs("x").write.maxsize(10)"#,
            r#"procfs("a/b").read"#,
            r#"procfs("..").read"#,
            r#"procfs("x").read.maxsize(1).more"#,
            r#"procfs(1).read"#,
        ] {
            assert!(
                matches!(kind(bad), Err(PointError::BadArgument { .. })),
                "{bad}: {:?}",
                kind(bad)
            );
        }
    }

    #[test]
    fn timer_ms_is_in_nanoseconds() {
        assert_eq!(
            kind("timer.ms(5)").unwrap(),
            PointKind::Timer {
                period_ns: 5_000_000
            }
        );
    }

    #[test]
    fn timer_with_zero_period_is_rejected() {
        assert!(matches!(
            kind("timer.ms(0)"),
            Err(PointError::BadArgument { .. })
        ));
    }

    #[test]
    fn absolute_statement_takes_an_address() {
        assert_eq!(
            kind("kernel.statement(0xffffffff81000000).absolute").unwrap(),
            PointKind::KernelAddress(0xffff_ffff_8100_0000)
        );
    }

    #[test]
    fn field_write_is_a_join_point() {
        assert!(matches!(
            kind(r#"kernel.field("struct file", "f_pos").write"#).unwrap(),
            PointKind::KernelField {
                access: FieldAccess::Write,
                ..
            }
        ));
    }

    #[test]
    fn unknown_family_is_reported_with_its_text() {
        let err = kind("kernel.fuction(\"x\")").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown probe point 'kernel.fuction(\"x\")'"
        );
    }

    #[test]
    fn syscall_return_is_a_return_point() {
        assert!(kind(r#"kernel.syscall("read").return"#)
            .unwrap()
            .is_return());
    }

    #[test]
    fn trace_point_drops_its_system_prefix() {
        assert_eq!(
            kind(r#"kernel.trace("sched:sched_switch")"#).unwrap(),
            PointKind::KernelTrace {
                name: "sched_switch".into()
            }
        );
    }

    #[test]
    fn kprobe_function_return_is_a_function_return() {
        assert!(matches!(
            kind(r#"kprobe.function("vfs_read").return"#).unwrap(),
            PointKind::KernelFunction {
                site: FunctionSite::Return,
                ..
            }
        ));
    }

    #[test]
    fn user_space_points_are_refused_with_the_reason() {
        let err = kind(r#"process("/bin/ls").function("main")"#).unwrap_err();
        assert!(err.to_string().contains("user-space probe points"), "{err}");
    }
}
