//! Kernel stacks in compiled probes: a stack snapshot in the output record, unwound later on
//! the host (as `perf record --call-graph dwarf` copies registers and stack bytes into its
//! samples and unwinds them in `perf report`).
//!
//! The guest cannot unwind by itself: the kernel is built without frame pointers, and its
//! ORC tables are not something a probe body should walk. So `print_backtrace()`, and
//! `backtrace()` / `sprint_backtrace()` as arguments of `printf`/`print`/`println`, compile
//! into a record that holds, after the call's other arguments:
//!
//! ```text
//! +0    TSC (stored last, never 0)
//! +8    format id | STACK_FORMAT (u32): an index into Interner::stacks
//! +16   the other arguments, 16 bytes each (longs and 16-byte strings)
//! A     the probed code's stack pointer (A = 16 + 16 * arguments)
//! A+8   bytes of stack copied (0..=snapshot bytes)
//! A+16  the 128 bytes the site saved at r15: r15, r14, ..., rax, then the flags
//! A+144 the stack from the stack pointer up, as many bytes as copied
//! ```
//!
//! The copy goes through the kernel's `copy_from_kernel_nofault` (as every compiled memory
//! read does), a page at a time, and stops at the first page that faults. It never goes past
//! the next 16 KiB boundary above the stack pointer: task stacks are THREAD_SIZE (16 KiB)
//! sized and aligned, so that boundary is the top of the task's stack; IRQ and exception
//! stacks are vmapped or in the CPU entry area with guard pages above, where the copy faults
//! and stops. A snapshot holds up to the record's room (about 3.8 KiB in a 4 KiB record):
//! the unwinder reads the snapshot alone, so a frame whose words lie past it (a deep stack,
//! or a switch from an IRQ stack back to the task's) is cut, and the output says so with a
//! trailing marker ([`CUT_LINE`], [`CUT_WORD`]).
//!
//! The pc of the first frame is the probe point's address: the host fills it in
//! ([`StackFormat::pc`]) when it installs the site, since the code is generated before the
//! splice engine says where each site's code goes. In a return probe the stack pointer is
//! the call's return-address slot, where the trampoline put the original return address
//! back: the first frame is that address in the caller, its stack the words above
//! ([`StackFormat::at_return`]), as the host-evaluated path unwinds a return.
//!
//! `backtrace()` anywhere else (a map key: `s[backtrace()]++`, a local, a comparison) must
//! be known in the guest at the hit: there the guest's own unwinder walks the stack (see
//! the codegen's stack module), and the result is a string built in the guest.

use exotap_lang::ast::{Expr, ExprKind, FunctionBody};
use exotap_lang::check::Program;
use exotap_lang::value::{truncate, Value};

/// The bit of a record's format id that marks a stack record.
pub const STACK_FORMAT: u32 = 1 << 31;
/// Bytes of a snapshot before its stack bytes: the stack pointer, the bytes copied and the
/// saved registers.
pub const SNAPSHOT_HEAD: u64 = 16 + REGS;
/// Bytes of the registers the site saved (flags and 15 general registers).
pub const REGS: u64 = 128;
/// The alignment and size of a task's kernel stack (THREAD_SIZE on x86-64 without KASAN):
/// the copy never crosses a boundary of it.
pub const STACK_SIZE: u64 = 16 << 10;
/// The last line `print_backtrace()`/`sprint_backtrace()` give when the unwind went past the
/// snapshot.
pub const CUT_LINE: &str = " ... (frames past the stack snapshot are cut)";
/// The last word of `backtrace()` when the unwind went past the snapshot.
pub const CUT_WORD: &str = "...";

/// How a stack record holds one argument of its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StackArg {
    /// A long, 16 bytes.
    Long,
    /// A 16-byte string.
    Str,
    /// `backtrace()`: the pcs in hex, blank-separated.
    Pcs,
    /// `sprint_backtrace()`: one ` 0xADDR : func+0xoff/0xsize [kernel]` line a frame.
    Lines,
}

/// What a stack record prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StackOutput {
    /// `print_backtrace()`.
    PrintBacktrace,
    /// `printf(FORMAT, ...)`.
    Printf(String),
    /// `print(...)` (`println` when true).
    Print(bool),
}

/// One compiled call that prints a kernel stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StackFormat {
    /// What it prints.
    pub output: StackOutput,
    /// Its arguments (none for `print_backtrace()`); at most one of them a stack.
    pub args: Vec<StackArg>,
    /// Stack bytes the record has room for.
    pub snapshot_bytes: u64,
    /// The probe point's address (the first frame's pc); 0 until the host sets it.
    pub pc: u64,
    /// The probe's MAXSTRINGLEN (a stack as a string is cut to it, as the interpreter does).
    pub max_string_len: usize,
    /// Taken in a return probe: the record's stack starts at the call's return-address
    /// slot, where the trampoline put the original return address back; the stack is the
    /// caller's, at that address, one word above.
    pub at_return: bool,
}

impl StackFormat {
    /// Offset of the snapshot (its stack pointer) in the record.
    pub fn snapshot_at(&self) -> u64 {
        16 + 16 * self.args.len() as u64
    }

    /// Bytes of the record it needs.
    pub fn bytes(&self) -> u64 {
        self.snapshot_at() + SNAPSHOT_HEAD + self.snapshot_bytes
    }
}

/// A snapshot as a record holds it (everything in it is untrusted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot<'r> {
    /// The probe point's address.
    pub pc: u64,
    /// The probed code's stack pointer.
    pub sp: u64,
    /// The saved registers, r15 first, the flags last (the site's push order, reversed).
    pub regs: [u64; 16],
    /// The stack from `sp` up.
    pub stack: &'r [u8],
}

impl Snapshot<'_> {
    /// The word at the guest-virtual address `addr`, when the snapshot holds all of it.
    pub fn word(&self, addr: u64) -> Option<u64> {
        let off = usize::try_from(addr.checked_sub(self.sp)?).ok()?;
        let bytes = self.stack.get(off..off.checked_add(8)?)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    }

    /// The saved value of a register: `index` in `codegen::SAVED` (rax 0 ... r15 14), or
    /// 15 for the flags. The site pushed the flags first and r15 last, so the copy from
    /// r15 holds them in reverse.
    pub fn saved(&self, index: usize) -> u64 {
        let slot = if index >= 15 { 15 } else { 14 - index };
        self.regs.get(slot).copied().unwrap_or(0)
    }
}

/// A stack's frames as the host unwound them, and whether the unwind went past the snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unwound {
    /// Each frame's pc and its `func+0xoff/0xsize` name, innermost first.
    pub frames: Vec<(u64, String)>,
    /// The unwind needed a word the snapshot does not hold.
    pub cut: bool,
}

/// The stack a call of this name gives as an argument of `printf`/`print`, if it is one.
pub fn stack_arg(e: &Expr) -> Option<StackArg> {
    let ExprKind::Call(c) = &e.kind else {
        return None;
    };
    match c.name.name.as_str() {
        "backtrace" if c.args.is_empty() => Some(StackArg::Pcs),
        "sprint_backtrace" if c.args.is_empty() => Some(StackArg::Lines),
        _ => None,
    }
}

/// Whether any kernel probe of `prog` (or a function) takes a stack snapshot: its records
/// are then as large as records get.
pub fn takes_snapshots(prog: &Program) -> bool {
    stack_uses(prog).0 > 0
}

/// Whether any probe or function of `prog` unwinds or names kernel code (the host then
/// keeps the kernel's ORC tables and symbols, and the guest's modules', at hand).
pub fn names_kernel_code(prog: &Program) -> bool {
    use exotap_lang::walk::{block_exprs, expr_all};
    const NAMERS: &[&str] = &[
        "backtrace",
        "print_backtrace",
        "sprint_backtrace",
        "task_backtrace",
        "print_stack",
        "sprint_stack",
        "print_syms",
        "sprint_syms",
        "symname",
        "symdata",
    ];
    let mut found = false;
    let mut look = |e: &exotap_lang::ast::Expr| {
        if let exotap_lang::ast::ExprKind::Call(c) = &e.kind {
            found |= NAMERS.contains(&c.name.name.as_str());
        }
    };
    for p in &prog.script.probes {
        if let Some(c) = &p.condition {
            expr_all(c, &mut look);
        }
        block_exprs(&p.body, &mut look);
    }
    for f in &prog.script.functions {
        if let exotap_lang::ast::FunctionBody::Block(b) = &f.body {
            block_exprs(b, &mut look);
        }
    }
    found
}

/// The kernel stacks the kernel probes of `prog` (and its functions) take, as (snapshots,
/// values): snapshots are `print_backtrace()` and the stacks printed as arguments of a
/// print call (records the host unwinds); values are the other `backtrace()` calls
/// (`s[backtrace()]++`): strings the guest builds with the kernel's own unwinder (see the
/// codegen's stack module).
pub fn stack_uses(prog: &Program) -> (usize, usize) {
    use exotap_lang::walk::{block_exprs, expr_all};
    let (mut printed, mut stacks, mut print_backtrace) = (0usize, 0usize, 0usize);
    let mut look = |e: &Expr| {
        if let ExprKind::Call(c) = &e.kind {
            match c.name.name.as_str() {
                "backtrace" | "sprint_backtrace" => stacks += 1,
                "print_backtrace" => print_backtrace += 1,
                // `print_syms(backtrace())` prints what `print_backtrace()` prints: a
                // snapshot too, its `backtrace()` no string.
                "print_syms"
                    if c.args.len() == 1
                        && matches!(stack_arg(&c.args[0]), Some(StackArg::Pcs)) =>
                {
                    printed += 1;
                }
                _ if super::codegen::is_print(c) => {
                    printed += c.args.iter().filter(|a| stack_arg(a).is_some()).count();
                }
                _ => {}
            }
        }
    };
    for p in super::guest_probes(prog) {
        if let Some(c) = &p.condition {
            expr_all(c, &mut look);
        }
        block_exprs(&p.body, &mut look);
    }
    for f in &prog.script.functions {
        if let FunctionBody::Block(b) = &f.body {
            block_exprs(b, &mut look);
        }
    }
    (print_backtrace + printed, stacks.saturating_sub(printed))
}

fn word(record: &[u8], at: u64) -> Option<u64> {
    let at = usize::try_from(at).ok()?;
    let bytes = record.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// The stack format of a record, when it is a stack record.
pub fn stack_format<'f>(formats: &'f [StackFormat], record: &[u8]) -> Option<&'f StackFormat> {
    let id = u32::try_from(word(record, 8)? & 0xffff_ffff).ok()?;
    if id & STACK_FORMAT == 0 {
        return None;
    }
    formats.get(usize::try_from(id & !STACK_FORMAT).ok()?)
}

/// The snapshot in a record of `format` (`None`: the record is too short; a copied length
/// past the room is cut to it).
pub fn snapshot<'r>(format: &StackFormat, record: &'r [u8]) -> Option<Snapshot<'r>> {
    let at = format.snapshot_at();
    let sp = word(record, at)?;
    let copied = word(record, at + 8)?.min(format.snapshot_bytes);
    let mut regs = [0u64; 16];
    for (i, r) in regs.iter_mut().enumerate() {
        *r = word(record, at + 16 + 8 * i as u64)?;
    }
    let from = usize::try_from(at + SNAPSHOT_HEAD).ok()?;
    let to = from.checked_add(usize::try_from(copied).ok()?)?;
    let stack = record.get(from..to)?;
    if format.at_return {
        // The code returned to the address in the slot, with its stack pointer above it.
        let (slot, above) = stack.split_at_checked(8)?;
        return Some(Snapshot {
            pc: u64::from_le_bytes(slot.try_into().ok()?),
            sp: sp.checked_add(8)?,
            regs,
            stack: above,
        });
    }
    Some(Snapshot {
        pc: format.pc,
        sp,
        regs,
        stack,
    })
}

/// The ` 0xADDR : NAME [kernel]` lines of a stack, as the interpreter's
/// `sprint_backtrace()` writes them, with [`CUT_LINE`] last when it was cut.
pub fn stack_lines(stack: &Unwound) -> String {
    let mut lines: Vec<String> = stack
        .frames
        .iter()
        .map(|(pc, name)| {
            format!(
                " {pc:#018x} : {}",
                exotap_lang::eval_call::stap_frame_name(name)
            )
        })
        .collect();
    if stack.cut {
        lines.push(CUT_LINE.to_owned());
    }
    lines.join("\n")
}

/// A stack as `backtrace()` gives it: the pcs in hex, with [`CUT_WORD`] last when it was cut.
pub fn stack_pcs(stack: &Unwound) -> String {
    let mut words: Vec<String> = stack
        .frames
        .iter()
        .map(|(pc, _)| format!("{pc:#x}"))
        .collect();
    if stack.cut {
        words.push(CUT_WORD.to_owned());
    }
    words.join(" ")
}

/// The text of a stack record of `format`, the stack unwound by `unwind` (`None`: a record
/// too short for its format, a hostile guest). `decode` reads a 16-byte string argument.
pub fn render(
    format: &StackFormat,
    record: &[u8],
    decode: &dyn Fn(&[u8]) -> String,
    unwind: &dyn Fn(&Snapshot<'_>) -> Unwound,
) -> Option<String> {
    let snap = snapshot(format, record)?;
    let stack = unwind(&snap);
    if format.output == StackOutput::PrintBacktrace {
        let lines = stack_lines(&stack);
        return Some(if lines.is_empty() {
            lines
        } else {
            format!("{lines}\n")
        });
    }
    let mut args = Vec::new();
    for (i, arg) in format.args.iter().enumerate() {
        let at = 16 + 16 * i as u64;
        args.push(match arg {
            StackArg::Long => Value::Long(word(record, at)? as i64),
            StackArg::Str => {
                let from = usize::try_from(at).ok()?;
                Value::Str(decode(record.get(from..from + 16)?))
            }
            StackArg::Pcs => Value::Str(truncate(stack_pcs(&stack), format.max_string_len)),
            StackArg::Lines => Value::Str(truncate(stack_lines(&stack), format.max_string_len)),
        });
    }
    Some(match &format.output {
        StackOutput::Printf(fmt) => {
            let pieces = exotap_lang::format::parse_format(fmt).ok()?;
            exotap_lang::format::render(&pieces, &args)
        }
        StackOutput::Print(ln) => {
            let mut s: String = args.iter().map(ToString::to_string).collect();
            if *ln {
                s.push('\n');
            }
            s
        }
        StackOutput::PrintBacktrace => String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_names_kernel_code_in_a_body_a_condition_or_a_function_it_calls() {
        let names = |src: &str| {
            let prog = exotap_lang::check::check(
                exotap_lang::parser::parse(src, &exotap_lang::Limits::default()).unwrap(),
            )
            .unwrap();
            names_kernel_code(&prog)
        };
        let probe = |body: &str| format!("probe kernel.function(\"vfs_read\") {{ {body} }}");

        assert!(names(&probe("print_backtrace()")));
        assert!(names(&probe("println(symname(16))")));
        assert!(names(&format!(
            "global s\n{}\nprobe end {{ foreach (k in s) print_stack(k) }}",
            probe("s[backtrace()]++")
        )));
        assert!(names(
            "probe kernel.function(\"vfs_read\") if (symname(16) == \"x\") { println(1) }"
        ));
        assert!(names(&format!(
            "function f() {{ return sprint_backtrace() }}\n{}",
            probe("println(f())")
        )));
        assert!(!names(&probe("println(pid(), execname())")));
    }

    fn record(format: &StackFormat, sp: u64, stack: &[u8], args: &[[u8; 16]]) -> Vec<u8> {
        let mut r = vec![0u8; format.bytes() as usize];
        r[0..8].copy_from_slice(&1u64.to_le_bytes());
        r[8..12].copy_from_slice(&STACK_FORMAT.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            r[16 + 16 * i..32 + 16 * i].copy_from_slice(a);
        }
        let at = format.snapshot_at() as usize;
        r[at..at + 8].copy_from_slice(&sp.to_le_bytes());
        r[at + 8..at + 16].copy_from_slice(&(stack.len() as u64).to_le_bytes());
        for i in 0..16u64 {
            let w = at + 16 + 8 * i as usize;
            r[w..w + 8].copy_from_slice(&(100 + i).to_le_bytes());
        }
        let s = at + SNAPSHOT_HEAD as usize;
        r[s..s + stack.len()].copy_from_slice(stack);
        r
    }

    fn format(output: StackOutput, args: Vec<StackArg>) -> StackFormat {
        StackFormat {
            output,
            args,
            snapshot_bytes: 64,
            pc: 0xffff_ffff_8100_0000,
            max_string_len: 512,
            at_return: false,
        }
    }

    #[test]
    fn a_return_probes_snapshot_starts_in_the_caller_at_the_return_address() {
        let f = StackFormat {
            at_return: true,
            ..format(StackOutput::PrintBacktrace, Vec::new())
        };
        let stack: Vec<u8> = [0xffff_ffff_8123_4567u64, 7, 8]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let r = record(&f, 0x1000, &stack, &[]);

        let snap = snapshot(&f, &r).unwrap();

        assert_eq!((snap.pc, snap.sp), (0xffff_ffff_8123_4567, 0x1008));
        assert_eq!((snap.word(0x1008), snap.word(0x1010)), (Some(7), Some(8)));
        assert_eq!(snap.word(0x1000), None);
        // Nothing copied: not even the return address.
        assert!(snapshot(&f, &record(&f, 0x1000, &[], &[])).is_none());
    }

    #[test]
    fn a_snapshot_reads_words_only_inside_what_was_copied() {
        let f = format(StackOutput::PrintBacktrace, Vec::new());
        let stack: Vec<u8> = (0..4u64).flat_map(|w| (w * 3).to_le_bytes()).collect();
        let r = record(&f, 0x1000, &stack, &[]);

        let snap = snapshot(&f, &r).unwrap();

        assert_eq!(snap.word(0x1000), Some(0));
        assert_eq!(snap.word(0x1018), Some(9));
        assert_eq!(snap.word(0x1019), None);
        assert_eq!(snap.word(0xff8), None);
        assert_eq!((snap.pc, snap.sp), (0xffff_ffff_8100_0000, 0x1000));
        // r15 first (pushed last), the flags last; saved(0) is rax.
        assert_eq!(
            (snap.saved(14), snap.saved(0), snap.saved(15)),
            (100, 114, 115)
        );
    }

    #[test]
    fn a_copied_length_past_the_room_is_cut_to_it() {
        let f = format(StackOutput::PrintBacktrace, Vec::new());
        let mut r = record(&f, 0x1000, &[0u8; 64], &[]);
        let at = f.snapshot_at() as usize + 8;
        r[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());

        let snap = snapshot(&f, &r).unwrap();

        assert_eq!(snap.stack.len(), 64);
        assert!(snapshot(&f, &r[..40]).is_none());
    }

    #[test]
    fn print_backtrace_renders_the_interpreters_lines_and_marks_a_cut() {
        let f = format(StackOutput::PrintBacktrace, Vec::new());
        let r = record(&f, 0x1000, &[], &[]);
        let unwound = |cut| Unwound {
            frames: vec![
                (0xffff_ffff_8100_0000, "a+0x0/0x10".to_owned()),
                (0xffff_ffff_8100_0123, "b+0x23/0x40".to_owned()),
            ],
            cut,
        };

        let whole = render(&f, &r, &|_| String::new(), &|_| unwound(false)).unwrap();
        let cut = render(&f, &r, &|_| String::new(), &|_| unwound(true)).unwrap();

        assert_eq!(
            whole,
            " 0xffffffff81000000 : a+0x0/0x10 [kernel]\n 0xffffffff81000123 : b+0x23/0x40 [kernel]\n"
        );
        assert_eq!(cut, format!("{}{CUT_LINE}\n", whole));
    }

    #[test]
    fn printf_renders_the_other_arguments_around_the_stack() {
        let f = format(
            StackOutput::Printf("%d [%s] %s\n".into()),
            vec![StackArg::Long, StackArg::Pcs, StackArg::Str],
        );
        let mut s = [0u8; 16];
        s[..3].copy_from_slice(b"cat");
        let r = record(
            &f,
            0x1000,
            &[],
            &[(-7i64 as u64 as u128).to_le_bytes(), [0; 16], s],
        );
        let unwound = Unwound {
            frames: vec![
                (0xffff_ffff_8100_0000, String::new()),
                (0x10, String::new()),
            ],
            cut: true,
        };

        let text = render(
            &f,
            &r,
            &|b| String::from_utf8_lossy(&b[..3]).into_owned(),
            &|_| unwound.clone(),
        )
        .unwrap();

        assert_eq!(text, "-7 [0xffffffff81000000 0x10 ...] cat\n");
    }

    #[test]
    fn only_records_with_the_stack_bit_have_a_stack_format() {
        let formats = vec![format(StackOutput::PrintBacktrace, Vec::new())];
        let mut r = vec![0u8; 16];
        r[8..12].copy_from_slice(&STACK_FORMAT.to_le_bytes());
        let mut plain = r.clone();
        plain[8..12].copy_from_slice(&0u32.to_le_bytes());
        let mut unknown = r.clone();
        unknown[8..12].copy_from_slice(&(STACK_FORMAT | 5).to_le_bytes());

        assert!(stack_format(&formats, &r).is_some());
        assert!(stack_format(&formats, &plain).is_none());
        assert!(stack_format(&formats, &unknown).is_none());
    }
}
