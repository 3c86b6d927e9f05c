//! Signatures of the built-in functions (the part of SystemTap's tapset library exotap has).
//! The printing family (`print`, `printf`, ...) is variadic and checked specially.

use super::check::Ty;

/// A built-in function's signature.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    /// Name.
    pub name: &'static str,
    /// Parameter types.
    pub params: &'static [Ty],
    /// Result type ([`Ty::Void`] for none).
    pub ret: Ty,
    /// One line of documentation, for listings and hints.
    pub doc: &'static str,
}

const L: Ty = Ty::Long;
const S: Ty = Ty::Str;

/// The fixed-arity built-ins.
pub const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "exit",
        params: &[],
        // SystemTap's exit() may stand in an expression (`n && exit()`).
        ret: L,
        doc: "end the session after this probe",
    },
    Builtin {
        name: "error",
        params: &[S],
        ret: Ty::Void,
        doc: "raise a script error",
    },
    Builtin {
        name: "warn",
        params: &[S],
        ret: Ty::Void,
        doc: "print a warning on stderr",
    },
    Builtin {
        name: "log",
        params: &[S],
        ret: Ty::Void,
        doc: "print a line",
    },
    Builtin {
        name: "strlen",
        params: &[S],
        ret: L,
        doc: "length in bytes",
    },
    Builtin {
        name: "substr",
        params: &[S, L, L],
        ret: S,
        doc: "substring (start, length)",
    },
    Builtin {
        name: "isinstr",
        params: &[S, S],
        ret: L,
        doc: "1 if s2 occurs in s1",
    },
    Builtin {
        name: "strpos",
        params: &[S, S],
        ret: L,
        doc: "offset of s2 in s1, or -1",
    },
    Builtin {
        name: "stringat",
        params: &[S, L],
        ret: L,
        doc: "byte at an offset",
    },
    Builtin {
        name: "strtol",
        params: &[S, L],
        ret: L,
        doc: "parse an integer in a base",
    },
    Builtin {
        name: "str_replace",
        params: &[S, S, S],
        ret: S,
        doc: "replace all occurrences",
    },
    Builtin {
        name: "text_str",
        params: &[S],
        ret: S,
        doc: "escape non-printable characters",
    },
    Builtin {
        name: "string_quoted",
        params: &[S],
        ret: S,
        doc: "quote and escape",
    },
    Builtin {
        name: "isdigit",
        params: &[S],
        ret: L,
        doc: "1 if the first byte is a digit",
    },
    Builtin {
        name: "str_upper",
        params: &[S],
        ret: S,
        doc: "ASCII upper case",
    },
    Builtin {
        name: "str_lower",
        params: &[S],
        ret: S,
        doc: "ASCII lower case",
    },
    Builtin {
        name: "abs",
        params: &[L],
        ret: L,
        doc: "absolute value",
    },
    Builtin {
        name: "min",
        params: &[L, L],
        ret: L,
        doc: "smaller of two",
    },
    Builtin {
        name: "max",
        params: &[L, L],
        ret: L,
        doc: "larger of two",
    },
    Builtin {
        name: "randint",
        params: &[L],
        ret: L,
        doc: "random integer in [0, n)",
    },
    Builtin {
        name: "pid",
        params: &[],
        ret: L,
        doc: "process id of the probed context",
    },
    Builtin {
        name: "tid",
        params: &[],
        ret: L,
        doc: "thread id of the probed context",
    },
    Builtin {
        name: "ppid",
        params: &[],
        ret: L,
        doc: "parent process id",
    },
    Builtin {
        name: "uid",
        params: &[],
        ret: L,
        doc: "user id",
    },
    Builtin {
        name: "cpu",
        params: &[],
        ret: L,
        doc: "CPU the probe fired on",
    },
    Builtin {
        name: "execname",
        params: &[],
        ret: S,
        doc: "command name",
    },
    Builtin {
        name: "probefunc",
        params: &[],
        ret: S,
        doc: "probed function name",
    },
    Builtin {
        name: "ppfunc",
        params: &[],
        ret: S,
        doc: "probed function name",
    },
    Builtin {
        name: "pp",
        params: &[],
        ret: S,
        doc: "the probe point that fired",
    },
    Builtin {
        name: "target",
        params: &[],
        ret: L,
        doc: "target process id (-x PID; 0 without)",
    },
    Builtin {
        name: "gettimeofday_s",
        params: &[],
        ret: L,
        doc: "seconds since the epoch",
    },
    Builtin {
        name: "gettimeofday_ms",
        params: &[],
        ret: L,
        doc: "milliseconds since the epoch",
    },
    Builtin {
        name: "gettimeofday_us",
        params: &[],
        ret: L,
        doc: "microseconds since the epoch",
    },
    Builtin {
        name: "gettimeofday_ns",
        params: &[],
        ret: L,
        doc: "nanoseconds since the epoch",
    },
    Builtin {
        name: "kernel_string",
        params: &[L],
        ret: S,
        doc: "NUL-terminated guest string",
    },
    Builtin {
        name: "kernel_string_n",
        params: &[L, L],
        ret: S,
        doc: "NUL-terminated guest string of at most n bytes",
    },
    Builtin {
        name: "user_string",
        params: &[L],
        ret: S,
        doc: "NUL-terminated string in the current process's memory",
    },
    Builtin {
        name: "user_string_n",
        params: &[L, L],
        ret: S,
        doc: "NUL-terminated string in the current process's memory, at most n bytes",
    },
    Builtin {
        name: "kernel_long",
        params: &[L],
        ret: L,
        doc: "8-byte guest value",
    },
    Builtin {
        name: "kernel_int",
        params: &[L],
        ret: L,
        doc: "4-byte signed guest value",
    },
    Builtin {
        name: "kernel_short",
        params: &[L],
        ret: L,
        doc: "2-byte signed guest value",
    },
    Builtin {
        name: "kernel_char",
        params: &[L],
        ret: L,
        doc: "1-byte signed guest value",
    },
    Builtin {
        name: "backtrace",
        params: &[],
        ret: S,
        doc: "the kernel stack's pcs in hex, innermost first (compiled probes: as a printf/print argument)",
    },
    Builtin {
        name: "sprint_backtrace",
        params: &[],
        ret: S,
        doc: "the kernel stack, one `0xADDR : func+0xoff/0xsize [kernel]` line a frame",
    },
    Builtin {
        name: "print_backtrace",
        params: &[],
        ret: Ty::Void,
        doc: "print the kernel stack as sprint_backtrace() gives it",
    },
    Builtin {
        name: "task_backtrace",
        params: &[Ty::Long],
        ret: Ty::Str,
        doc: "the kernel stack's pcs in hex of the task_struct at the address (host-evaluated probes): running or sleeping",
    },
    Builtin {
        name: "sprint_stack",
        params: &[Ty::Str],
        ret: Ty::Str,
        doc: "a backtrace() string's pcs with their symbols, one `0xADDR : func+0xoff/0xsize [kernel]` line a frame (for stacks kept as map keys)",
    },
    Builtin {
        name: "print_stack",
        params: &[Ty::Str],
        ret: Ty::Void,
        doc: "print a backtrace() string as sprint_stack() gives it",
    },
];

/// The variadic printing family.
pub const PRINTERS: &[&str] = &[
    "print", "println", "printf", "sprint", "sprintln", "sprintf", "printd", "printdln",
];

/// Looks a fixed-arity built-in up (those of this table, then the tapset's
/// [native](super::native::NATIVE) ones).
pub fn lookup(name: &str) -> Option<&'static Builtin> {
    BUILTINS
        .iter()
        .chain(super::native::NATIVE)
        .find(|b| b.name == name)
}

/// The signature of built-in `name` called with `args` arguments: its overload of that
/// arity, else its one signature.
pub fn lookup_call(name: &str, args: usize) -> Option<&'static Builtin> {
    super::native::overload(name, args).or_else(|| lookup(name))
}

/// Whether `name` is one of the core built-ins, which a script may not redefine (the
/// tapset's native functions, like its script ones, give way to a script's own).
pub fn is_core(name: &str) -> bool {
    BUILTINS.iter().any(|b| b.name == name) || PRINTERS.contains(&name)
}

/// Whether `name` is any built-in.
pub fn is_builtin(name: &str) -> bool {
    lookup(name).is_some()
        || super::native::OVERLOADS.iter().any(|b| b.name == name)
        || PRINTERS.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn substr_takes_string_and_two_longs() {
        let b = lookup("substr").unwrap();
        assert_eq!(b.params, &[Ty::Str, Ty::Long, Ty::Long]);
    }

    #[test]
    fn printers_are_builtins_without_fixed_signature() {
        assert!(is_builtin("printf"));
        assert!(lookup("printf").is_none());
    }
}
