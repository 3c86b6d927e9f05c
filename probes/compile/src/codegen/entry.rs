//! `@entry(expr)` in return probes: the entry computes each such value (of anything but a
//! parameter, which the call's slot keeps anyway) in its own context and the call's slot in
//! the table of calls in flight keeps it, with why computing it failed, for the return
//! bodies to read (see [`super::super::site`]).

use iced_x86::code_asm::*;
use iced_x86::IcedError;

use exotap_lang::ast::*;
use exotap_lang::check::Program;

use super::super::data::Interner;
use super::super::{site, SitePoint};
use super::{g_asm, probe_of, walk, Env, Gen, CATCH_RECORD, K, R};

/// An `@entry(...)` value the entry computes and the call's slot keeps.
#[derive(Debug, Clone, Copy)]
pub struct EntryValue<'p> {
    /// The `@entry(...)` expression.
    pub expr: &'p Expr,
    /// The return body it is in: its index among the site's.
    pub body: usize,
    /// Its first word among the slot's entry values.
    pub word: usize,
    /// A string (two words; else a long, one).
    pub string: bool,
}

/// At a function's entry, computes the operand of `e` (an `@entry(...)` in `point`'s return
/// probe) as the interpreter does there (with no locals), and stores it in the 16 bytes just
/// above the stack pointer it starts with (a long in the first 8). A probe error while
/// computing it is counted and leaves what was there (the caller stores 0 first). Returns
/// whether it is a string.
///
/// # Errors
/// The first construct that does not compile.
pub fn emit_entry_value(
    a: &mut CodeAssembler,
    env: Env<'_>,
    interner: &mut Interner,
    point: &SitePoint,
    pc: u64,
    e: &Expr,
) -> R<bool> {
    let probe = probe_of(env, point)?;
    let mut g = Gen::new(a, env, interner, point, pc)?;
    g.locals.clear();
    g.locals_size = 0;
    g.texts.clear();
    g.span = e.span;
    let asm = |err: IcedError| g_asm(point, probe, err);
    let x = match &e.kind {
        ExprKind::Entry(x) => x,
        _ => e,
    };
    g.prologue().map_err(asm)?;
    let string = g.expr(x)? == K::Str;
    g.a.mov(qword_ptr(rbx + CATCH_RECORD), rax).map_err(asm)?;
    if string {
        g.a.mov(qword_ptr(rbx + CATCH_RECORD + 8), rdx)
            .map_err(asm)?;
    }
    // A probe error is not counted here: its kind goes into the value's third word, and the
    // return raises it where the body reads the value, as the interpreter reports an
    // `@entry(...)` that failed at the entry only where the return evaluates it.
    let mut common = g.a.create_label();
    g.a.jmp(g.end).map_err(asm)?;
    let errors = g.errors;
    for (label, kind) in [
        (errors.div, EntryError::Div),
        (errors.budget, EntryError::Budget),
        (errors.fault, EntryError::Fault),
        (errors.overflow, EntryError::Overflow),
        (errors.empty, EntryError::Empty),
        (errors.other, EntryError::Other),
        (errors.nesting, EntryError::Nesting),
        (errors.strings, EntryError::Strings),
        (errors.argument, EntryError::Other),
    ] {
        let mut label = label;
        g.a.set_label(&mut label).map_err(asm)?;
        g.a.mov(eax, kind as u32).map_err(asm)?;
        g.a.jmp(common).map_err(asm)?;
    }
    g.a.set_label(&mut common).map_err(asm)?;
    g.a.mov(qword_ptr(rbx + CATCH_RECORD + 16), rax)
        .map_err(asm)?;
    let mut end = g.end;
    g.a.set_label(&mut end).map_err(asm)?;
    g.leave_hit().map_err(asm)?;
    g.a.lea(rsp, qword_ptr(rbx + CATCH_RECORD)).map_err(asm)?;
    let mut after = g.a.create_label();
    g.a.jmp(after).map_err(asm)?;
    g.emit_functions()?;
    g.place(&mut after)?;
    Ok(string)
}

/// Why computing an `@entry(...)` value at the entry failed (0: it did not), kept with the
/// value for the return to raise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EntryError {
    /// A division by zero.
    Div = 1,
    /// MAXACTION.
    Budget = 2,
    /// A memory read that faulted.
    Fault = 3,
    /// An array past its size.
    Overflow = 4,
    /// An empty aggregate.
    Empty = 5,
    /// `error()` or a string function's bad argument.
    Other = 6,
    /// MAXNESTING.
    Nesting = 7,
    /// A full string table.
    Strings = 8,
}

/// The `@entry(...)` expressions of the return bodies `points` whose values the entry must
/// compute (those of anything but a parameter, which the slot keeps anyway), in the order
/// their slot words take.
pub fn entry_values<'p>(prog: &'p Program, points: &[SitePoint]) -> Vec<&'p Expr> {
    let mut out: Vec<&'p Expr> = Vec::new();
    for p in points {
        let Some(probe) = prog.script.probes.get(p.probe) else {
            continue;
        };
        let mut collect = |e: &'p Expr| {
            if let ExprKind::Entry(x) = &e.kind {
                let param = matches!(&x.kind,
                    ExprKind::Target(t) if t.members.is_empty() && t.name.starts_with('$'));
                if !param && !out.iter().any(|o| std::ptr::eq(*o, e)) {
                    out.push(e);
                }
            }
        };
        if let Some(cond) = &probe.condition {
            walk::expr_all(cond, &mut collect);
        }
        walk::block_exprs(&probe.body, &mut collect);
    }
    out
}

impl Gen<'_, '_> {
    /// `e`, an `@entry(...)` of anything but a parameter in a return body: the value the
    /// entry computed, which the trampoline pushed with the entry's arguments.
    pub(super) fn entry_value(&mut self, e: &Expr) -> R<K> {
        let key = exotap_lang::context::entry_key(e);
        let &(_, word, string) = self
            .entry_values
            .iter()
            .find(|v| v.0 == key)
            .ok_or_else(|| self.no("@entry(...) outside a return probe"))?;
        self.entry_failed(word)?;
        let off = site::entry_value_offset(word);
        asm!(self, self.a.mov(rax, qword_ptr(r15 + off)))?;
        if !string {
            return Ok(K::Long);
        }
        asm!(self, self.a.mov(rdx, qword_ptr(r15 + off + 8)))?;
        Ok(K::Str)
    }

    /// Raises the probe error the entry met computing the `@entry(...)` value at `word`, if
    /// it met one (its kind in the slot's error word, a byte per value).
    fn entry_failed(&mut self, word: usize) -> R<()> {
        let codes = site::entry_value_offset(0) - 8;
        let shift = 8 * word as u32;
        let e = self.errors;
        let mut ok = self.a.create_label();
        let r = (|| {
            self.a.mov(rax, qword_ptr(r15 + codes))?;
            if shift > 0 {
                self.a.shr(rax, shift)?;
            }
            self.a.movzx(eax, al)?;
            self.a.test(eax, eax)?;
            self.a.jz(ok)?;
            for (kind, label) in [
                (EntryError::Div, e.div),
                (EntryError::Budget, e.budget),
                (EntryError::Fault, e.fault),
                (EntryError::Overflow, e.overflow),
                (EntryError::Empty, e.empty),
                (EntryError::Nesting, e.nesting),
                (EntryError::Strings, e.strings),
            ] {
                self.a.cmp(eax, kind as u32)?;
                self.a.je(label)?;
            }
            Ok(())
        })();
        asm!(self, r)?;
        // Anything else (`error()`, a bad argument) as `error()` with a message.
        self.host_string("@entry(...) failed at the function's entry")?;
        asm!(self, self.a.jmp(e.other))?;
        self.place(&mut ok)
    }
}
