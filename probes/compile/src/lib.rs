//! Compiled probes: a checked script's kernel probe bodies turned into x86-64 code that runs
//! inside the guest, entered from a splice, with no stop of the VM (DESIGN.md, key
//! mechanism 8).
//!
//! SystemTap compiles a script into a kernel module and bpftrace into BPF; exotap compiles it
//! into machine code that it writes into the patch heap from outside. The pieces:
//!
//! - [`data`]: where the script's globals live in the heap (scalars, fixed-capacity hash
//!   tables for associative arrays, statistics with their histograms), the header the host
//!   watches (`exit()`, probe errors, dropped updates), the 16-byte string encoding, and the
//!   host's decoding of all of it into the interpreter's stores (and back).
//! - [`codegen`]: one probe body: statements and expressions, updates of globals (arrays,
//!   statistics, `delete`), built-in functions and output records.
//! - [`site`]: the code a splice enters: save the registers, run the bodies, restore, then
//!   the relocated instruction; and for `.return` probes the kretprobe-style return
//!   trampoline.
//!
//! Where: function entries and returns, statements at an offset or address where the
//! splice planner accepts the instruction, tracepoints (`kernel.trace`, entered at the
//! tracepoint's iterator `__traceiter_NAME`, or at its one callback where the kernel calls
//! that past the iterator: live/tracepoints.rs; the arguments from the second register on),
//! and `timer.profile` (each tick's [`PROFILE_FUNCTION`]).
//!
//! What compiles: `if/else`, `while`, `for`, `next`, `break`, `continue`; `foreach` over an
//! array in the interpreter's order (insertion order, or sorted on the value, a statistic or
//! a key, `+`/`-`, with `limit`; each step selects the next element from the table, see
//! [`codegen`]'s foreach module); user functions as real calls (parameters, locals, return
//! values, recursion up to MAXNESTING, a probe error past it); `try`/`catch (msg)` with the
//! interpreter's messages, also for errors inside the functions the block calls, and
//! `error()`; `@defined` and `@choose_defined` (answered when compiling, from the point's
//! parameters); longs and strings
//! (up to 15 bytes inline, longer ones interned by the host, or, for strings built in the
//! guest, in the script's string table: see [`codegen`]'s strings module); strings built in
//! the guest with `.` and `.=`, `substr`, `strlen`, `sprint`/`sprintln`, `sprintf` (a
//! literal format, see [`codegen`]'s sprintf module), `text_str`, `string_quoted` and
//! `str_replace`, and searched with `isinstr`, `strpos`, `stringat` and `strtol` (see its
//! string_search module), cut at MAXSTRINGLEN as SystemTap cuts them, anywhere a string goes
//! (locals, returns, keys, values, comparisons, output); locals; global scalars, arrays
//! keyed by up to [`data::MAX_KEYS`] values and statistics (`<<<` with count, sum, min, max,
//! `@hist_log` and `@hist_linear` buckets, and the running variance for `@variance`); `++`,
//! `--`, `=`, `+=` and friends (atomic where they touch globals); wrapping arrays (`a%[N]`:
//! a full array loses its oldest element to an insert); `in`; `delete` of an
//! element, of `a[k, *]` and of a whole array; arithmetic, comparisons (strings ordered by
//! their bytes where the script holds every string inline), logic and the ternary operator;
//! `execname() pid() tid() ppid() uid() cpu() probefunc() ppfunc() pp()`,
//! `gettimeofday_{s,ms,us,ns}()` (the kernel's own `ktime_get_real_fast_ns`, called from the
//! body), `kernel_long()`, `kernel_int()`, `kernel_short()`, `kernel_char()` (through the
//! kernel's `copy_from_kernel_nofault`: a bad address ends the hit with a probe error),
//! `jiffies()` and kernel globals `@var("name[@file]")->m...` ([`globals`]: an absolute
//! address slid at install, read the same fault-tolerant way), `task_utime()`/`task_stime()`,
//! `exit()`; `printf` with a literal format,
//! `print` and `println`, `printd`/`printdln` with a literal delimiter (output records in per-vCPU rings, formatted by the host), also of
//! `@hist_log`/`@hist_linear` (the statistics copied into the record); `@count`, `@sum`,
//! `@min`, `@max`, `@avg`, `@variance` of aggregates; `$params` in registers at function
//! entries, and in return probes as they were at the entry (also `@entry($param)`);
//! `@entry(expr)` of any long or string expression in a return probe, computed at the entry
//! and kept in the call's slot (up to [`site::ENTRY_VALUES`] words per function);
//! `task_current()`, `target()`, `signal_str()`, and `ctime()`/`tz_ctime()` as print
//! arguments (the host renders the time in the record);
//! `$locals` and `$params` anywhere by their DWARF location at the point ([`locals`]); and
//! `$return`; in guru mode (`-g`, the checker refuses them without) `$param = v` at entries
//! and `$return = v` or `set_return(v)` in return probes, written where the site restores
//! the registers from; member
//! chains of them and `@cast(p, "type")->m...`, laid out from the kernel's BTF ([`types`])
//! and read with `copy_from_kernel_nofault` at each step; strings read from memory (`kernel_string`,
//! `kernel_string_n`, `user_string`, `user_string_n`, through `strncpy_from_*_nofault`) as
//! arguments of `printf`/`print`/`println`, directly or through a local that is only printed
//! (see [`codegen`]'s memory module: a MAXSTRINGLEN-byte slot in the record), and as values
//! anywhere else (interned in the guest's string table as built strings are; a literal
//! fallback for an unreadable address as the interpreter answers it); `print_backtrace()`, and `backtrace()` /
//! `sprint_backtrace()` as `printf`/`print` arguments, as stack snapshots the host unwinds
//! ([`snapshot`]).
//! Everything else is named by [`Unsupported`] and the script runs on the host path.
//!
//! Safety inside the guest: a division by zero, an exhausted per-hit statement budget
//! (MAXACTION), a faulting kernel read (a bad pointer anywhere in a member chain, a string at
//! a bad address), an array overflow (an insert into an array that
//! holds its most elements), a call past MAXNESTING and an `error()` outside `try` end the
//! hit and count a probe error in the header; an update that gives up on a busy slot (or on
//! an aggregate's variance lock) counts a dropped update; no loop in the generated code is
//! unbounded (table probes, spin waits, `foreach` selection scans and script loops all carry
//! a budget). User functions run on the kernel stack the probed function runs on: a function
//! whose MAXNESTING frames would pass 6 KiB is refused by name. A `foreach` step scans the
//! whole table (its capacity: twice the array's size, at least 16 slots), so declaring small
//! arrays (`global a[64]`) keeps walks cheap.

pub mod codegen;
pub mod data;
pub mod globals;
pub mod locals;
pub mod regex;
pub mod site;
pub mod snapshot;
pub mod types;

use std::collections::HashSet;

use exotap_lang::ast::Span;
use exotap_lang::check::Program;
use exotap_lang::point::PointKind;
use exotap_lang::Limits;

pub use data::{DataLayout, Header, Interner};
pub use site::{entry_code, return_code, runtime, Runtime, SiteBodies};

/// Offsets and addresses in the guest kernel that generated code uses.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// Per-CPU offset (gs-relative) of the current task pointer.
    pub current_task: u64,
    /// Per-CPU offset of `cpu_number`.
    pub cpu_number: u64,
    /// `task_struct` member offsets.
    pub task: TaskFields,
    /// Slid address of `ktime_get_real_fast_ns` (for `gettimeofday_*()`).
    pub realtime_ns: Option<u64>,
    /// Slid address of `copy_from_kernel_nofault` (for `kernel_long()`, `kernel_int()`: a bad
    /// address is a probe error, never a fault in the guest).
    pub copy_nofault: Option<u64>,
    /// The kernel's other fault-tolerant copy routines (strings from memory).
    pub memory: MemoryFns,
    /// Slid address of `stack_trace_save_regs` (for `backtrace()` as a value: the guest's
    /// own ORC unwinder walks the probed code's stack, see [`codegen`]'s stack module).
    pub stack_save: Option<u64>,
    /// The guest kernel's types, for member chains (`$p->m->n`, `@cast`); `None`: they do not
    /// compile.
    pub types: Option<std::sync::Arc<dyn types::KernelTypes>>,
    /// The kernel globals the script reads (`@var`), at link-time addresses ([`globals`]).
    pub globals: std::sync::Arc<globals::KernelGlobals>,
    /// Link-time address of `jiffies_64` (for `jiffies()`).
    pub jiffies: Option<u64>,
    /// The KASLR slide added to the link-time addresses of kernel data (`@var`,
    /// `jiffies()`): 0 while checking what compiles, the live slide at install.
    pub data_slide: u64,
    /// Where a tick's interrupted registers are (`timer.profile`'s `addr()` and
    /// `user_mode()`); `None`: they do not compile.
    pub irq_regs: Option<IrqRegs>,
}

/// The interrupted registers of the tick a `timer.profile` probe runs in: the per-CPU
/// `__irq_regs` pointer (gs-relative offset, as `get_irq_regs()` reads it) to the
/// interrupt's `struct pt_regs`, and the offsets of `ip` and `cs` in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IrqRegs {
    /// Per-CPU offset of `__irq_regs`.
    pub percpu: u64,
    /// `pt_regs.ip`.
    pub ip: u64,
    /// `pt_regs.cs`.
    pub cs: u64,
}

/// The kernel function every tick runs on its CPU, where a compiled `timer.profile` probe
/// is spliced: `update_process_times(user_tick)`, called with the interrupted registers in
/// `irq_regs` (a CPU idle under NO_HZ takes no tick, so it takes no sample either).
pub const PROFILE_FUNCTION: &str = "update_process_times";

/// The point name of a `timer.profile` probe.
pub const PROFILE_POINT: &str = "timer.profile";

/// Slid addresses of the kernel routines compiled code calls besides `copy_from_kernel_nofault`:
/// the fault-tolerant string copies (mm/maccess.c: a bad address is an error code, never a
/// fault in the guest), and the kernel's own symbol lookup for `symname()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryFns {
    /// `strncpy_from_kernel_nofault(dst, src, count)` (for `kernel_string*()`).
    pub strncpy_kernel: Option<u64>,
    /// `strncpy_from_user_nofault(dst, src, count)` (for `user_string*()`).
    pub strncpy_user: Option<u64>,
    /// `copy_from_user_nofault(dst, src, len)` (the last byte of a user string at its limit).
    pub copy_user: Option<u64>,
    /// `kallsyms_lookup()` and the kernel's text (`_stext`, `_etext`) it names for
    /// `symname()`.
    pub kallsyms: Option<Kallsyms>,
}

/// The guest kernel's symbol lookup, `kallsyms_lookup(addr, *size, *offset, **modname,
/// namebuf)`: lock-free for the kernel's own text (a binary search and the expansion of a
/// compressed name into `namebuf`, [`KSYM_NAME_LEN`] bytes). Compiled `symname()` asks it
/// only for addresses in `[text_start, text_end)`, the text whose symbols the host names
/// too; any other address prints as itself (`0x...`), as the interpreter answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kallsyms {
    /// `kallsyms_lookup`.
    pub lookup: u64,
    /// `_stext`.
    pub text_start: u64,
    /// `_etext`.
    pub text_end: u64,
}

/// The room `kallsyms_lookup` may fill in its `namebuf` (`KSYM_NAME_LEN` since Linux 6.1;
/// 128 before, so this covers both).
pub const KSYM_NAME_LEN: u32 = 512;

impl MemoryFns {
    /// The kernel symbols it needs, by name.
    pub const SYMBOLS: [&'static str; 6] = [
        "strncpy_from_kernel_nofault",
        "strncpy_from_user_nofault",
        "copy_from_user_nofault",
        "kallsyms_lookup",
        "_stext",
        "_etext",
    ];

    /// The routines at the addresses `lookup` gives for [`Self::SYMBOLS`].
    pub fn from_symbols(lookup: impl Fn(&str) -> Option<u64>) -> Self {
        let [k, u, c, kallsyms, stext, etext] = Self::SYMBOLS;
        MemoryFns {
            strncpy_kernel: lookup(k),
            strncpy_user: lookup(u),
            copy_user: lookup(c),
            kallsyms: match (lookup(kallsyms), lookup(stext), lookup(etext)) {
                (Some(lookup), Some(text_start), Some(text_end)) if text_start < text_end => {
                    Some(Kallsyms {
                        lookup,
                        text_start,
                        text_end,
                    })
                }
                _ => None,
            },
        }
    }

    /// The same routines after a KASLR slide of `slide` bytes.
    pub fn slid(self, slide: u64) -> Self {
        let s = |a: Option<u64>| a.map(|a| a.wrapping_add(slide));
        MemoryFns {
            strncpy_kernel: s(self.strncpy_kernel),
            strncpy_user: s(self.strncpy_user),
            copy_user: s(self.copy_user),
            kallsyms: self.kallsyms.map(|k| Kallsyms {
                lookup: k.lookup.wrapping_add(slide),
                text_start: k.text_start.wrapping_add(slide),
                text_end: k.text_end.wrapping_add(slide),
            }),
        }
    }
}

/// `task_struct` (and `cred`) member offsets, from BTF.
#[derive(Debug, Clone, Copy, Default)]
pub struct TaskFields {
    /// `pid` (the thread id, an i32).
    pub pid: u64,
    /// `tgid` (the process id, an i32).
    pub tgid: Option<u64>,
    /// `comm` (`char[16]`).
    pub comm: u64,
    /// `real_parent` (a task pointer).
    pub real_parent: Option<u64>,
    /// `cred` (a pointer to `struct cred`).
    pub cred: Option<u64>,
    /// `cred.uid` (a u32).
    pub cred_uid: Option<u64>,
    /// `utime` (a u64: nanoseconds since Linux 4.11).
    pub utime: Option<u64>,
    /// `stime` (the same).
    pub stime: Option<u64>,
}

/// One kernel probe point a compiled body runs at.
#[derive(Debug, Clone)]
pub struct SitePoint {
    /// Index of the probe in the program.
    pub probe: usize,
    /// The point's name, as `pp()` gives it.
    pub name: String,
    /// The function it is in, as `probefunc()` gives it.
    pub function: String,
    /// Parameter names in calling-convention order (from BTF).
    pub params: Vec<String>,
    /// A `.return` probe.
    pub is_return: bool,
    /// The target variables at the point by their DWARF locations (statement probes, and
    /// entries whose body reads a variable BTF does not name), from the -dbg vmlinux.
    pub locals: Option<std::sync::Arc<locals::Locals>>,
    /// At a tracepoint's event callback, which the events of its class share: the body runs
    /// only when the callback's first argument (`__data`, the event's own) is this.
    pub guard: Option<u64>,
}

/// A construct that does not compile, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported {
    /// The probe it is in (None: a global or the program as a whole).
    pub probe: Option<usize>,
    /// Where in the source.
    pub span: Span,
    /// What it is, e.g. "foreach in a kernel probe".
    pub construct: String,
}

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.construct)
    }
}

/// The probes of `prog` with a point in the guest (what a compiled script runs there), with
/// their source.
pub(crate) fn guest_probes(prog: &Program) -> impl Iterator<Item = &exotap_lang::ast::Probe> {
    prog.script
        .probes
        .iter()
        .zip(&prog.probes)
        .filter(|(_, info)| info.points.iter().any(|(_, k)| k.needs_guest()))
        .map(|(p, _)| p)
}

/// Kernel probes of `prog` (index and whether it is a return probe), and the constructs that
/// keep the program from compiling: kernel points that are not function entries, returns or
/// statements at an offset or address.
pub fn kernel_probes(prog: &Program) -> (Vec<usize>, Vec<Unsupported>) {
    let mut probes = Vec::new();
    let mut refused = Vec::new();
    for (i, p) in prog.probes.iter().enumerate() {
        let mut kernel = false;
        for (pt, kind) in &p.points {
            match kind {
                // `@FILE`/`:LINE` resolve (with the -dbg vmlinux) to entries and statements;
                // `.inline` to the instances' entry pcs, statements in their callers.
                PointKind::KernelFunction { .. } => kernel = true,
                // A module's function entries and returns, found when the script attaches.
                PointKind::ModuleFunction { .. } => kernel = true,
                PointKind::Syscall { .. } => kernel = true,
                // `func+OFFSET` and `.absolute`: compiled where the splice planner accepts
                // the instruction (live::compiled asks it).
                PointKind::KernelStatement { .. } | PointKind::KernelAddress(_) => kernel = true,
                // `kernel.field`: the accessing instructions, statements in their functions.
                PointKind::KernelField { .. } => kernel = true,
                // A tracepoint's iterator `__traceiter_NAME` is a function entry (see
                // live::compiled: its arguments start at the second register).
                PointKind::KernelTrace { .. } => kernel = true,
                // Each tick's `update_process_times` ([`PROFILE_FUNCTION`]).
                PointKind::TimerProfile => kernel = true,
                k if k.needs_guest() => refused.push(Unsupported {
                    probe: Some(i),
                    span: pt.span,
                    construct: format!(
                        "the probe point {pt} (only function entries, returns, tracepoints \
                         and statements at an offset compile)"
                    ),
                }),
                _ => {}
            }
        }
        if kernel {
            probes.push(i);
        }
    }
    (probes, refused)
}

/// Checks that every kernel probe of `prog` compiles at `points`; returns every construct
/// that does not (empty: the whole program compiles).
pub fn check(
    prog: &Program,
    limits: &Limits,
    facts: &Facts,
    points: &[SitePoint],
) -> Vec<Unsupported> {
    let (_, mut refused) = kernel_probes(prog);
    let layout = match DataLayout::new(prog, limits) {
        Ok(l) if codegen::prints(prog) => l.with_rings(1),
        Ok(l) => l,
        Err(mut e) => {
            refused.append(&mut e);
            return refused;
        }
    };
    // Assemble at made-up addresses: only whether it compiles matters here.
    let base = 0xffff_ffff_a000_0000;
    let rt = match site::runtime(&layout, base, base + layout.size) {
        Ok(rt) => rt,
        Err(e) => {
            refused.push(Unsupported {
                probe: None,
                span: Span::default(),
                construct: format!("the table helpers ({e})"),
            });
            return refused;
        }
    };
    let env = codegen::Env {
        prog,
        limits,
        facts,
        layout: &layout,
        data: base,
        helpers: &rt.helpers,
    };
    let mut interner = Interner::default();
    let mut seen = HashSet::new();
    let code = base + (8 << 20);
    for p in points {
        if !seen.insert((p.probe, p.is_return)) {
            continue;
        }
        let (entry, ret) = if p.is_return {
            (Vec::new(), vec![p.clone()])
        } else {
            (vec![p.clone()], Vec::new())
        };
        let bodies = SiteBodies { entry, ret, pc: 0 };
        let r = if p.is_return {
            site::return_code(env, &mut interner, code, &bodies, base)
        } else {
            site::entry_code(env, &mut interner, code, &bodies, None)
        };
        if let Err(mut e) = r {
            e.probe.get_or_insert(p.probe);
            refused.push(e);
        }
    }
    refused.sort_by_key(|u| (u.span.start, u.construct.clone()));
    refused.dedup();
    refused
}
