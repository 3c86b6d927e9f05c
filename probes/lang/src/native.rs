//! Native built-ins of the tapset library: the functions SystemTap writes in embedded C,
//! which exotap implements in Rust ([`NATIVE`]), and the ones whose answer needs something
//! host-evaluated probes do not have yet ([`UNAVAILABLE`]: the checker accepts them, and a
//! call at run time is an error that says why). The tapset's script-language functions are
//! in `probes/lang/tapset/*.stp`.

use super::builtins::Builtin;
use super::check::Ty;
use super::syscalls;

const L: Ty = Ty::Long;
const S: Ty = Ty::Str;

/// Native built-ins with a host implementation (in `eval_call`).
pub const NATIVE: &[Builtin] = &[
    Builtin {
        name: "ctime",
        params: &[L],
        ret: S,
        doc: "seconds since the epoch as UTC text, `Thu Jan  1 00:00:00 1970`",
    },
    Builtin {
        name: "tz_ctime",
        params: &[L],
        ret: S,
        doc: "seconds since the epoch as text with the zone (exotap: UTC)",
    },
    Builtin {
        name: "errno_str",
        params: &[L],
        ret: S,
        doc: "the symbolic name of an errno value (ENOENT), negative or not",
    },
    Builtin {
        name: "return_str",
        params: &[L, L],
        ret: S,
        doc: "a return value as text: format 1 decimal, 2 hex, 3 octal; errors with their name",
    },
    Builtin {
        name: "signal_str",
        params: &[L],
        ret: S,
        doc: "the name of a signal number (SIGKILL)",
    },
    Builtin {
        name: "syscall_name",
        params: &[L],
        ret: S,
        doc: "the name of an x86-64 system call number",
    },
    Builtin {
        name: "_sys_open_flag_str",
        params: &[L],
        ret: S,
        doc: "open(2) flags as O_... names joined by '|'",
    },
    Builtin {
        name: "get_cycles",
        params: &[],
        ret: L,
        doc: "a cycle counter; host-evaluated probes answer the host's monotonic nanoseconds",
    },
    Builtin {
        name: "local_clock_ns",
        params: &[],
        ret: L,
        doc: "a monotonic clock in nanoseconds (host-evaluated probes: the host's)",
    },
    Builtin {
        name: "local_clock_us",
        params: &[],
        ret: L,
        doc: "a monotonic clock in microseconds (host-evaluated probes: the host's)",
    },
    Builtin {
        name: "cpu_clock_ns",
        params: &[L],
        ret: L,
        doc: "a CPU's monotonic clock in nanoseconds (host-evaluated probes: the host's)",
    },
    Builtin {
        name: "cpu_clock_us",
        params: &[L],
        ret: L,
        doc: "a CPU's monotonic clock in microseconds (host-evaluated probes: the host's)",
    },
    Builtin {
        name: "pn",
        params: &[],
        ret: S,
        doc: "the probe point as written (exotap: as pp() names it)",
    },
    Builtin {
        name: "system",
        params: &[S],
        ret: Ty::Void,
        doc: "run a shell command on the host, as SystemTap runs it on its host",
    },
    Builtin {
        name: "user_char",
        params: &[L],
        ret: L,
        doc: "1-byte signed value in the current process's memory",
    },
    Builtin {
        name: "user_short",
        params: &[L],
        ret: L,
        doc: "2-byte signed value in the current process's memory",
    },
    Builtin {
        name: "user_ushort",
        params: &[L],
        ret: L,
        doc: "2-byte unsigned value in the current process's memory",
    },
    Builtin {
        name: "user_int",
        params: &[L],
        ret: L,
        doc: "4-byte signed value in the current process's memory",
    },
    Builtin {
        name: "user_uint",
        params: &[L],
        ret: L,
        doc: "4-byte unsigned value in the current process's memory",
    },
    Builtin {
        name: "user_long",
        params: &[L],
        ret: L,
        doc: "8-byte value in the current process's memory",
    },
    Builtin {
        name: "task_current",
        params: &[],
        ret: L,
        doc: "the address of the probed context's current task_struct",
    },
    Builtin {
        name: "jiffies",
        params: &[],
        ret: L,
        doc: "the guest kernel's jiffies counter",
    },
    Builtin {
        name: "user_mode",
        params: &[],
        ret: L,
        doc: "1 when the probe fired in user mode",
    },
    Builtin {
        name: "symname",
        params: &[L],
        ret: S,
        doc: "the kernel symbol an address is in",
    },
    Builtin {
        name: "symdata",
        params: &[L],
        ret: S,
        doc: "the kernel symbol an address is in, with offset and size",
    },
    Builtin {
        name: "print_syms",
        params: &[S],
        ret: Ty::Void,
        doc: "print a backtrace string's addresses with their symbols",
    },
    Builtin {
        name: "addr",
        params: &[],
        ret: L,
        doc: "the address the probe fired at",
    },
    Builtin {
        name: "uaddr",
        params: &[],
        ret: L,
        doc: "the user-space address of the probed process",
    },
    Builtin {
        name: "usymname",
        params: &[L],
        ret: S,
        doc: "the user-space symbol an address is in",
    },
    Builtin {
        name: "usymdata",
        params: &[L],
        ret: S,
        doc: "the user-space symbol an address is in, with offset and size",
    },
    Builtin {
        name: "sprint_ubacktrace",
        params: &[],
        ret: S,
        doc: "the user-space stack",
    },
    Builtin {
        name: "print_ubacktrace",
        params: &[],
        ret: Ty::Void,
        doc: "print the user-space stack",
    },
    Builtin {
        name: "ubacktrace",
        params: &[],
        ret: S,
        doc: "the user-space stack's pcs",
    },
    Builtin {
        name: "int_arg",
        params: &[L],
        ret: L,
        doc: "argument N of the probed function as a signed int (from registers)",
    },
    Builtin {
        name: "uint_arg",
        params: &[L],
        ret: L,
        doc: "argument N of the probed function as an unsigned int",
    },
    Builtin {
        name: "long_arg",
        params: &[L],
        ret: L,
        doc: "argument N of the probed function as a long",
    },
    Builtin {
        name: "ulong_arg",
        params: &[L],
        ret: L,
        doc: "argument N of the probed function as an unsigned long",
    },
    Builtin {
        name: "pointer_arg",
        params: &[L],
        ret: L,
        doc: "argument N of the probed function as a pointer",
    },
    Builtin {
        name: "pid2task",
        params: &[L],
        ret: L,
        doc: "the task_struct of a process id",
    },
    Builtin {
        name: "pid2execname",
        params: &[L],
        ret: S,
        doc: "the command name of a process id",
    },
    Builtin {
        name: "printk",
        params: &[L, S],
        ret: Ty::Void,
        doc: "write to the guest kernel's log",
    },
    Builtin {
        name: "returnval",
        params: &[],
        ret: L,
        doc: "the probed function's return value (in .return probes)",
    },
    Builtin {
        name: "task_dentry_path",
        params: &[L, L, L],
        ret: S,
        doc: "the path of a dentry in a task's mount namespace",
    },
    Builtin {
        name: "inode_path",
        params: &[L],
        ret: S,
        doc: "the path of an inode",
    },
    Builtin {
        name: "reverse_path_walk",
        params: &[L],
        ret: S,
        doc: "the path of a dentry, walked up to the root",
    },
    Builtin {
        name: "d_path",
        params: &[L],
        ret: S,
        doc: "the path of a struct path",
    },
    Builtin {
        name: "switch_file",
        params: &[],
        ret: Ty::Void,
        doc: "start the next output file (-o with -S)",
    },
    Builtin {
        name: "modname",
        params: &[L],
        ret: S,
        doc: "the kernel module an address is in",
    },
    Builtin {
        name: "symfileline",
        params: &[L],
        ret: S,
        doc: "the source file and line of a kernel address; the address in hex where no line \
              is known (always, for now: probes do not look up line tables)",
    },
    Builtin {
        name: "usymfileline",
        params: &[L],
        ret: S,
        doc: "the source file and line of a user-space address",
    },
    Builtin {
        name: "umodname",
        params: &[L],
        ret: S,
        doc: "the user-space module an address is in",
    },
    Builtin {
        name: "target_set_pid",
        params: &[L],
        ret: L,
        doc: "whether a pid is the target process or one of its descendants",
    },
    Builtin {
        name: "proc_mem_size",
        params: &[],
        ret: L,
        doc: "the current process's virtual memory size, in pages",
    },
    Builtin {
        name: "proc_mem_rss",
        params: &[],
        ret: L,
        doc: "the current process's resident set, in pages",
    },
    Builtin {
        name: "proc_mem_shr",
        params: &[],
        ret: L,
        doc: "the current process's shared pages",
    },
    Builtin {
        name: "addr_to_node",
        params: &[L],
        ret: L,
        doc: "the NUMA node of a physical address",
    },
];

/// Second signatures of built-ins SystemTap overloads by arity: the string readers with a
/// fallback for an unreadable address, `ansi_set_color` with a background and an attribute,
/// `ctime()` of now, and the current task's `task_utime()`/`task_stime()`.
pub const OVERLOADS: &[Builtin] = &[
    Builtin {
        name: "user_string",
        params: &[L, S],
        ret: S,
        doc: "a user-space string, or the second argument when it cannot be read",
    },
    Builtin {
        name: "kernel_string",
        params: &[L, S],
        ret: S,
        doc: "a kernel string, or the second argument when it cannot be read",
    },
    Builtin {
        name: "user_string_n",
        params: &[L, L, S],
        ret: S,
        doc: "at most n bytes of a user-space string, or the third argument when unreadable",
    },
    Builtin {
        name: "kernel_string_n",
        params: &[L, L, S],
        ret: S,
        doc: "at most n bytes of a kernel string, or the third argument when unreadable",
    },
    Builtin {
        name: "ansi_set_color",
        params: &[L],
        ret: Ty::Void,
        doc: "set the terminal's foreground color (30-37)",
    },
    Builtin {
        name: "ansi_set_color",
        params: &[L, L],
        ret: Ty::Void,
        doc: "set the terminal's foreground (30-37) and background (40-47) colors",
    },
    Builtin {
        name: "ansi_set_color",
        params: &[L, L, L],
        ret: Ty::Void,
        doc: "set the terminal's colors and an attribute (0-8)",
    },
    Builtin {
        name: "ctime",
        params: &[],
        ret: S,
        doc: "the current time as UTC text",
    },
    Builtin {
        name: "task_utime",
        params: &[],
        ret: L,
        doc: "user time of the current task: task_struct's utime (nanoseconds since Linux 4.11)",
    },
    Builtin {
        name: "task_utime",
        params: &[L],
        ret: L,
        doc: "user time of the thread with this id (0 when there is none)",
    },
    Builtin {
        name: "task_stime",
        params: &[],
        ret: L,
        doc: "system time of the current task: task_struct's stime (nanoseconds since Linux 4.11)",
    },
    Builtin {
        name: "task_stime",
        params: &[L],
        ret: L,
        doc: "system time of the thread with this id (0 when there is none)",
    },
    Builtin {
        name: "proc_mem_size",
        params: &[L],
        ret: L,
        doc: "the same for a process id",
    },
    Builtin {
        name: "proc_mem_rss",
        params: &[L],
        ret: L,
        doc: "the same for a process id",
    },
    Builtin {
        name: "proc_mem_shr",
        params: &[L],
        ret: L,
        doc: "the same for a process id",
    },
];

/// The signature of `name` called with `args` arguments, when SystemTap overloads it.
pub fn overload(name: &str, args: usize) -> Option<&'static Builtin> {
    OVERLOADS
        .iter()
        .find(|b| b.name == name && b.params.len() == args)
}

/// Why a native built-in has no answer in host-evaluated probes yet, by name.
pub const UNAVAILABLE: &[(&str, &str)] = &[
    (
        "task_dentry_path",
        "host-evaluated probes do not walk dentries and mounts yet",
    ),
    (
        "inode_path",
        "host-evaluated probes do not walk dentries and mounts yet",
    ),
    (
        "reverse_path_walk",
        "host-evaluated probes do not walk dentries and mounts yet",
    ),
    (
        "d_path",
        "host-evaluated probes do not walk dentries and mounts yet",
    ),
    (
        "switch_file",
        "exotap writes one output stream (no -S output rotation)",
    ),
    (
        "modname",
        "exotap resolves against the kernel image only, not loaded modules",
    ),
    (
        "usymfileline",
        "user-space symbols are out of exotap's scope (no user-space probing)",
    ),
    (
        "umodname",
        "user-space modules are out of exotap's scope (no user-space probing)",
    ),
    (
        "target_set_pid",
        "the target set follows process.begin probes, and user-space probing is out of exotap's scope",
    ),
    (
        "proc_mem_size",
        "host-evaluated probes do not walk the task's mm counters yet",
    ),
    (
        "proc_mem_rss",
        "host-evaluated probes do not walk the task's mm counters yet",
    ),
    (
        "proc_mem_shr",
        "host-evaluated probes do not walk the task's mm counters yet",
    ),
    (
        "addr_to_node",
        "host-evaluated probes do not read the guest's NUMA layout yet",
    ),
    (
        "task_utime",
        "task_utime(tid) finds the thread with pid2task, and host-evaluated probes do not walk \
         the guest's pid hash yet; task_utime() of the current task needs a kernel probe that \
         stopped the guest",
    ),
    (
        "task_stime",
        "task_stime(tid) finds the thread with pid2task, and host-evaluated probes do not walk \
         the guest's pid hash yet; task_stime() of the current task needs a kernel probe that \
         stopped the guest",
    ),
    (
        "jiffies",
        "only a kernel probe that stopped the guest reads the kernel's jiffies_64 here (a \
         compiled probe reads it in the guest)",
    ),
    (
        "user_mode",
        "only a probe that stopped the guest where it ran (a kernel function entry, a statement \
         or timer.profile) knows the privilege level it was stopped at",
    ),
    (
        "addr",
        "only a probe that stopped the guest where it ran (a kernel function entry, a statement \
         or timer.profile) has the pc it was stopped at; a .return probe stands at exotap's \
         trampoline",
    ),
    (
        "uaddr",
        "user-space probing (process.*, uprobes) is out of exotap's scope",
    ),
    (
        "usymname",
        "user-space symbols are out of exotap's scope (no user-space probing)",
    ),
    (
        "usymdata",
        "user-space symbols are out of exotap's scope (no user-space probing)",
    ),
    (
        "sprint_ubacktrace",
        "user-space stacks are out of exotap's scope (no user-space probing)",
    ),
    (
        "print_ubacktrace",
        "user-space stacks are out of exotap's scope (no user-space probing)",
    ),
    (
        "ubacktrace",
        "user-space stacks are out of exotap's scope (no user-space probing)",
    ),
    (
        "pid2task",
        "host-evaluated probes do not walk the guest's pid hash yet",
    ),
    (
        "pid2execname",
        "host-evaluated probes do not walk the guest's pid hash yet",
    ),
    (
        "printk",
        "writing to the guest's kernel log would run code in the guest, which exotap's \
         host-evaluated probes do not do",
    ),
];

/// Why `name` cannot run in host-evaluated probes, when it cannot.
pub fn unavailable(name: &str) -> Option<&'static str> {
    UNAVAILABLE
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, w)| *w)
}

/// The symbolic names of the errno values 1..=133 (Linux, x86-64).
const ERRNO: &[&str] = &[
    "EPERM",
    "ENOENT",
    "ESRCH",
    "EINTR",
    "EIO",
    "ENXIO",
    "E2BIG",
    "ENOEXEC",
    "EBADF",
    "ECHILD",
    "EAGAIN",
    "ENOMEM",
    "EACCES",
    "EFAULT",
    "ENOTBLK",
    "EBUSY",
    "EEXIST",
    "EXDEV",
    "ENODEV",
    "ENOTDIR",
    "EISDIR",
    "EINVAL",
    "ENFILE",
    "EMFILE",
    "ENOTTY",
    "ETXTBSY",
    "EFBIG",
    "ENOSPC",
    "ESPIPE",
    "EROFS",
    "EMLINK",
    "EPIPE",
    "EDOM",
    "ERANGE",
    "EDEADLK",
    "ENAMETOOLONG",
    "ENOLCK",
    "ENOSYS",
    "ENOTEMPTY",
    "ELOOP",
    "",
    "ENOMSG",
    "EIDRM",
    "ECHRNG",
    "EL2NSYNC",
    "EL3HLT",
    "EL3RST",
    "ELNRNG",
    "EUNATCH",
    "ENOCSI",
    "EL2HLT",
    "EBADE",
    "EBADR",
    "EXFULL",
    "ENOANO",
    "EBADRQC",
    "EBADSLT",
    "",
    "EBFONT",
    "ENOSTR",
    "ENODATA",
    "ETIME",
    "ENOSR",
    "ENONET",
    "ENOPKG",
    "EREMOTE",
    "ENOLINK",
    "EADV",
    "ESRMNT",
    "ECOMM",
    "EPROTO",
    "EMULTIHOP",
    "EDOTDOT",
    "EBADMSG",
    "EOVERFLOW",
    "ENOTUNIQ",
    "EBADFD",
    "EREMCHG",
    "ELIBACC",
    "ELIBBAD",
    "ELIBSCN",
    "ELIBMAX",
    "ELIBEXEC",
    "EILSEQ",
    "ERESTART",
    "ESTRPIPE",
    "EUSERS",
    "ENOTSOCK",
    "EDESTADDRREQ",
    "EMSGSIZE",
    "EPROTOTYPE",
    "ENOPROTOOPT",
    "EPROTONOSUPPORT",
    "ESOCKTNOSUPPORT",
    "EOPNOTSUPP",
    "EPFNOSUPPORT",
    "EAFNOSUPPORT",
    "EADDRINUSE",
    "EADDRNOTAVAIL",
    "ENETDOWN",
    "ENETUNREACH",
    "ENETRESET",
    "ECONNABORTED",
    "ECONNRESET",
    "ENOBUFS",
    "EISCONN",
    "ENOTCONN",
    "ESHUTDOWN",
    "ETOOMANYREFS",
    "ETIMEDOUT",
    "ECONNREFUSED",
    "EHOSTDOWN",
    "EHOSTUNREACH",
    "EALREADY",
    "EINPROGRESS",
    "ESTALE",
    "EUCLEAN",
    "ENOTNAM",
    "ENAVAIL",
    "EISNAM",
    "EREMOTEIO",
    "EDQUOT",
    "ENOMEDIUM",
    "EMEDIUMTYPE",
    "ECANCELED",
    "ENOKEY",
    "EKEYEXPIRED",
    "EKEYREVOKED",
    "EKEYREJECTED",
    "EOWNERDEAD",
    "ENOTRECOVERABLE",
    "ERFKILL",
    "EHWPOISON",
];

/// The symbolic name of errno `e` (sign ignored), or "" when it has none.
pub fn errno_str(e: i64) -> String {
    let n = e.unsigned_abs();
    // The kernel-internal restart codes a syscall return can show.
    let internal = match n {
        512 => Some("ERESTARTSYS"),
        513 => Some("ERESTARTNOINTR"),
        514 => Some("ERESTARTNOHAND"),
        515 => Some("ENOIOCTLCMD"),
        516 => Some("ERESTART_RESTARTBLOCK"),
        _ => None,
    };
    if let Some(s) = internal {
        return s.to_string();
    }
    usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_sub(1))
        .and_then(|i| ERRNO.get(i))
        .map_or_else(String::new, |s| (*s).to_string())
}

/// SystemTap's `return_str(format, ret)`: an error (-4095..-1) as `-2 (ENOENT)`, anything
/// else in decimal (1), hex (2) or octal (3).
pub fn return_str(format: i64, ret: i64) -> String {
    if (-4095..0).contains(&ret) {
        let name = errno_str(ret);
        if !name.is_empty() {
            return format!("{ret} ({name})");
        }
    }
    match format {
        2 => format!("{ret:#x}"),
        3 => format!("{ret:#o}"),
        _ => ret.to_string(),
    }
}

/// The signal names of 1..=31 (x86-64).
const SIGNALS: &[&str] = &[
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGILL",
    "SIGTRAP",
    "SIGABRT",
    "SIGBUS",
    "SIGFPE",
    "SIGKILL",
    "SIGUSR1",
    "SIGSEGV",
    "SIGUSR2",
    "SIGPIPE",
    "SIGALRM",
    "SIGTERM",
    "SIGSTKFLT",
    "SIGCHLD",
    "SIGCONT",
    "SIGSTOP",
    "SIGTSTP",
    "SIGTTIN",
    "SIGTTOU",
    "SIGURG",
    "SIGXCPU",
    "SIGXFSZ",
    "SIGVTALRM",
    "SIGPROF",
    "SIGWINCH",
    "SIGIO",
    "SIGPWR",
    "SIGSYS",
];

/// The name of signal `sig`: SIGHUP..SIGSYS, SIGRTMIN+n for real-time ones, else `SIG<n>`.
pub fn signal_str(sig: i64) -> String {
    match sig {
        0 => "0".to_string(),
        1..=31 => SIGNALS[(sig - 1) as usize].to_string(),
        32..=64 => format!("SIGRTMIN+{}", sig - 32),
        _ => format!("SIG{sig}"),
    }
}

/// The name of x86-64 system call `nr`, `syscall_<nr>` when it has none.
pub fn syscall_name(nr: i64) -> String {
    syscalls::name(nr).map_or_else(|| format!("syscall_{nr}"), str::to_string)
}

/// open(2) flags as SystemTap's `_sys_open_flag_str` writes them.
pub fn open_flags(flags: i64) -> String {
    let mut parts = vec![match flags & 3 {
        0 => "O_RDONLY".to_string(),
        1 => "O_WRONLY".to_string(),
        2 => "O_RDWR".to_string(),
        _ => "O_ACCMODE".to_string(),
    }];
    let mut rest = flags & !3;
    for (bit, name) in OPEN_FLAGS {
        if rest & bit != 0 {
            parts.push((*name).to_string());
            rest &= !bit;
        }
    }
    if rest != 0 {
        parts.push(format!("{rest:#o}"));
    }
    parts.join("|")
}

/// The open(2) flag bits [`open_flags`] names, in the order it writes them.
pub const OPEN_FLAGS: &[(i64, &str)] = &[
    (0o100, "O_CREAT"),
    (0o200, "O_EXCL"),
    (0o400, "O_NOCTTY"),
    (0o1000, "O_TRUNC"),
    (0o2000, "O_APPEND"),
    (0o4000, "O_NONBLOCK"),
    (0o10000, "O_DSYNC"),
    (0o20000, "O_ASYNC"),
    (0o40000, "O_DIRECT"),
    (0o100000, "O_LARGEFILE"),
    (0o200000, "O_DIRECTORY"),
    (0o400000, "O_NOFOLLOW"),
    (0o1000000, "O_NOATIME"),
    (0o2000000, "O_CLOEXEC"),
    (0o4000000, "__O_SYNC"),
    (0o10000000, "O_PATH"),
    (0o20000000, "__O_TMPFILE"),
];

/// What the integer reads of guest memory read, by name: bytes, sign-extended, and whether
/// the address is a user one (`user_*`, read in the task's address space) rather than a
/// kernel one (`kernel_*`).
pub fn memory_read(name: &str) -> Option<(u8, bool, bool)> {
    Some(match name {
        "kernel_long" => (8, true, false),
        "kernel_int" => (4, true, false),
        "kernel_short" => (2, true, false),
        "kernel_char" => (1, true, false),
        "user_long" => (8, true, true),
        "user_int" => (4, true, true),
        "user_uint" => (4, false, true),
        "user_short" => (2, true, true),
        "user_ushort" => (2, false, true),
        "user_char" => (1, true, true),
        _ => return None,
    })
}

/// C's `ctime()` of `secs` since the epoch, in UTC, without the newline:
/// `Thu Jan  1 00:00:00 1970`.
pub fn ctime(secs: i64) -> String {
    const DAYS: &[&str] = &["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: &[&str] = &[
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let weekday = DAYS[days.rem_euclid(7) as usize];
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{weekday} {} {day:>2} {:02}:{:02}:{:02} {year}",
        MONTHS[(month - 1) as usize],
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctime_of_the_epoch_is_c_ctime() {
        assert_eq!(ctime(0), "Thu Jan  1 00:00:00 1970");
    }

    #[test]
    fn ctime_of_a_leap_day() {
        assert_eq!(ctime(951_782_400), "Tue Feb 29 00:00:00 2000");
    }

    #[test]
    fn errno_names_the_negative_return_of_a_syscall() {
        assert_eq!(errno_str(-2), "ENOENT");
        assert_eq!(errno_str(133), "EHWPOISON");
        assert_eq!(errno_str(41), "");
    }

    #[test]
    fn return_str_names_errors_and_formats_the_rest() {
        assert_eq!(return_str(1, -13), "-13 (EACCES)");
        assert_eq!(return_str(2, 255), "0xff");
        assert_eq!(return_str(1, 3), "3");
    }

    #[test]
    fn signals_have_their_names() {
        assert_eq!(signal_str(9), "SIGKILL");
        assert_eq!(signal_str(34), "SIGRTMIN+2");
    }

    #[test]
    fn open_flags_name_the_access_mode_and_the_bits() {
        assert_eq!(open_flags(0o2101), "O_WRONLY|O_CREAT|O_APPEND");
    }

    #[test]
    fn every_unavailable_function_has_a_signature() {
        assert!(UNAVAILABLE
            .iter()
            .all(|(n, _)| NATIVE.iter().chain(OVERLOADS).any(|b| b.name == *n)));
    }
}
