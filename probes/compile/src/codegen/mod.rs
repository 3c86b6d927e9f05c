//! One probe body as x86-64 code.
//!
//! Entered with `r15` pointing at the registers the site saved (see [`super::site`]); every
//! other register is free. The body keeps its locals and key buffers in a frame under `rbp`,
//! `r14` counts down the statement budget (MAXACTION), `r13` holds the current task, `rbx`
//! points at the catch record just above the probe's frame (and is where the stack goes back
//! to when the hit ends, also from inside a user function), `r12` counts the user functions
//! the hit is nested in (see the functions module). Every
//! intermediate value goes on the stack, so calls (table helpers, kernel clock functions)
//! never need registers saved. A long is in `rax`; a string (see [`super::data`]) is in
//! `rax` (bytes 0-7) and `rdx` (bytes 8-15).
//!
//! Semantics follow the interpreter (probes/lang/src/eval*.rs), which is the oracle of the
//! differential tests: wrapping arithmetic, shifts by the count's low 6 bits, a division by
//! zero ends the hit with a probe error, one statement-budget tick per statement and per
//! loop iteration.

use std::collections::HashMap;

use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, MemoryOperand, Register};

use exotap_lang::ast::*;
use exotap_lang::check::{Program, Ty};
use exotap_lang::Limits;

use super::data::{field, DataLayout, GlobalSlot, Interner, ValueKind, KEY, MAX_KEYS};
use super::types::{cast_defined, chain_base, chain_defined, target_chain, ChainBase, Step};
use super::{Facts, SitePoint, Unsupported};

/// Bytes of the kernel-read buffer in a body's frame.
const SCRATCH: i32 = 8;
/// How deep array lookups may nest inside each other's keys.
const MAX_KEY_DEPTH: usize = 4;
/// Registers the site saves, in push order (after the flags).
pub const SAVED: [Register; 15] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RBX,
    Register::RSI,
    Register::RDI,
    Register::RBP,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];
/// Bytes the site pushes: the flags and [`SAVED`].
pub const SAVED_BYTES: i32 = 8 * 16;

/// Offset of a saved register from `r15`.
pub fn saved_offset(reg: Register) -> i32 {
    let i = SAVED.iter().position(|r| *r == reg).unwrap_or(0);
    (14 - i as i32) * 8
}

/// SysV argument registers.
pub const ARGS: [Register; 6] = [
    Register::RDI,
    Register::RSI,
    Register::RDX,
    Register::RCX,
    Register::R8,
    Register::R9,
];

/// What every body of a script shares.
#[derive(Debug, Clone, Copy)]
pub struct Env<'a> {
    /// The checked program.
    pub prog: &'a Program,
    /// Limits (MAXACTION).
    pub limits: &'a Limits,
    /// Kernel offsets.
    pub facts: &'a Facts,
    /// Where the globals are.
    pub layout: &'a DataLayout,
    /// Virtual address of the data.
    pub data: u64,
    /// The table helpers: global name and insert (true) or find (false) → address.
    pub helpers: &'a HashMap<(String, bool), u64>,
}

/// Kind of a value in registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum K {
    Long,
    Str,
}

type R<T> = Result<T, Unsupported>;

/// Runs an assembler call and names a refusal as an unsupported construct at the current
/// span (a macro, so the call may borrow the assembler mutably first).
macro_rules! asm {
    ($g:ident, $e:expr) => {{
        let r = $e;
        $g.asm(r)
    }};
}

// After the macro: the submodules use it.
mod aggregates;
mod calls;
mod entry;
mod foreach;
mod functions;
mod memory;
mod operators;
mod sprintf;
mod stack;
mod string_search;
mod strings;
mod updates;
pub(crate) use exotap_lang::walk;

pub(crate) use calls::is_print;
pub use calls::{prints, record_bytes};
pub use entry::{emit_entry_value, entry_values, EntryError, EntryValue};
pub use strings::{builds_strings, keeps_entry_values, regex_patterns};
pub(crate) use strings::{runtime_helpers as string_helpers, APPEND, INTERN};

fn rip(addr: u64) -> MemoryOperand {
    MemoryOperand::with_base_displ(Register::RIP, addr as i64)
}

struct Gen<'a, 'b> {
    a: &'b mut CodeAssembler,
    env: Env<'a>,
    interner: &'b mut Interner,
    point: &'b SitePoint,
    /// The site's address (the first frame of `backtrace()`).
    pc: u64,
    locals: HashMap<String, (i32, K)>,
    locals_size: i32,
    /// Locals holding strings read from memory: name → buffer offset under the scratch.
    texts: HashMap<String, i32>,
    depth: usize,
    loops: Vec<(CodeLabel, CodeLabel)>,
    end: CodeLabel,
    errors: Errors,
    span: Span,
    /// Levels of key buffers in the current frame (array lookups nested in keys).
    key_levels: usize,
    /// Inside `&`: the next member chain laid out ends at its last member's address.
    address_of: bool,
    /// `foreach` loops the current frame has state for, and how many are open.
    foreach_levels: usize,
    foreach_depth: usize,
    /// User functions: their entry labels, and those still to emit (after the body).
    functions: functions::Functions,
    /// Bytes the open `try` blocks of the current frame pushed (saved catch records): the
    /// stack at a statement is `rbp - frame - try_pushed`.
    try_pushed: i32,
    /// Loops open when the innermost `try` with a catch record began: a `break` or
    /// `continue` to one of them would leave the record set, so it is refused.
    try_loops: Option<usize>,
    /// The `@entry(...)` values the entry kept in the call's slot (return bodies only): by
    /// [`exotap_lang::context::entry_key`], the first word and whether a string.
    entry_values: Vec<(usize, usize, bool)>,
}

/// Where each kind of probe error jumps: the probe's counters, or inside `try` the handler.
#[derive(Debug, Clone, Copy)]
struct Errors {
    div: CodeLabel,
    budget: CodeLabel,
    fault: CodeLabel,
    overflow: CodeLabel,
    empty: CodeLabel,
    /// `error()`, with its message in rax/rdx.
    other: CodeLabel,
    /// A call past MAXNESTING.
    nesting: CodeLabel,
    /// A built string the string table had no room for.
    strings: CodeLabel,
    /// A string function's argument out of range, with the interpreter's message in
    /// rax/rdx (`stringat`, `strtol`).
    argument: CodeLabel,
}

/// Bytes above a probe's frame for the catch record (see [`functions`]): the handler's
/// address (0: none), its frame pointer and its nesting depth; then [`HIT_WORD`].
const CATCH_RECORD: i32 = 32;
/// Where in the catch record a hit keeps the address of the count of hits in progress it
/// counted itself into (see [`strings`]'s `enter_hit`).
const HIT_WORD: i32 = 24;

/// Emits probe `point.probe`'s body (with its condition) for `point`, at a site at `pc`.
///
/// # Errors
/// The first construct that does not compile.
pub fn emit_body(
    a: &mut CodeAssembler,
    env: Env<'_>,
    interner: &mut Interner,
    point: &SitePoint,
    pc: u64,
) -> R<()> {
    emit_return_body(a, env, interner, point, pc, &[])
}

/// As [`emit_body`], for a return body whose `@entry(...)` values (other than parameters)
/// the entry computed into the call's slot (the trampoline pushed them under the entry's
/// arguments).
///
/// # Errors
/// The first construct that does not compile.
pub fn emit_return_body(
    a: &mut CodeAssembler,
    env: Env<'_>,
    interner: &mut Interner,
    point: &SitePoint,
    pc: u64,
    entry_values: &[EntryValue<'_>],
) -> R<()> {
    let probe = probe_of(env, point)?;
    let mut g = Gen::new(a, env, interner, point, pc)?;
    g.entry_values = entry_values
        .iter()
        .map(|v| (exotap_lang::context::entry_key(v.expr), v.word, v.string))
        .collect();
    let asm = |e: IcedError| g_asm(point, probe, e);
    g.prologue().map_err(asm)?;
    if let Some(data) = point.guard {
        // Another event of the callback's class: not this probe's hit.
        g.a.mov(rax, data).map_err(asm)?;
        g.a.cmp(qword_ptr(r15 + saved_offset(Register::RDI)), rax)
            .map_err(asm)?;
        g.a.jne(g.end).map_err(asm)?;
    }
    if let Some(cond) = &probe.condition {
        g.long(cond)?;
        g.a.test(rax, rax).map_err(asm)?;
        g.a.jz(g.end).map_err(asm)?;
    }
    g.block(&probe.body)?;
    g.finish()
}

fn probe_of<'p>(env: Env<'p>, point: &SitePoint) -> R<&'p exotap_lang::ast::Probe> {
    env.prog
        .script
        .probes
        .get(point.probe)
        .ok_or_else(|| Unsupported {
            probe: Some(point.probe),
            span: Span::default(),
            construct: "a probe that is not in the program".into(),
        })
}

fn g_asm(point: &SitePoint, probe: &exotap_lang::ast::Probe, e: IcedError) -> Unsupported {
    Unsupported {
        probe: Some(point.probe),
        span: probe.span,
        construct: format!("code the assembler refused ({e})"),
    }
}

impl<'a, 'b> Gen<'a, 'b> {
    /// A generator for `point`'s probe: its locals laid out, its labels made.
    fn new(
        a: &'b mut CodeAssembler,
        env: Env<'a>,
        interner: &'b mut Interner,
        point: &'b SitePoint,
        pc: u64,
    ) -> R<Self> {
        let probe = probe_of(env, point)?;
        let mut locals = HashMap::new();
        let mut size = 0i32;
        // Locals that hold a string read from memory: a MAXSTRINGLEN buffer each, below the
        // rest.
        let text_names = memory::text_locals(&probe.body);
        let text_bytes = memory::text_slot(env.limits);
        let mut texts = HashMap::new();
        if let Some(types) = env.prog.locals.get(point.probe) {
            let mut names: Vec<_> = types.iter().collect();
            names.sort_by(|x, y| x.0.cmp(y.0));
            for (name, ty) in names {
                if env.prog.globals.contains_key(name) {
                    continue;
                }
                if *ty == Ty::Str && text_names.contains(name) {
                    let at = (texts.len() as i32 + 1) * text_bytes;
                    texts.insert(name.clone(), at);
                    continue;
                }
                let k = match ty {
                    Ty::Long | Ty::Unknown => K::Long,
                    Ty::Str => K::Str,
                    _ => {
                        return Err(Unsupported {
                            probe: Some(point.probe),
                            span: probe.span,
                            construct: format!("the local {name} of type {ty}"),
                        })
                    }
                };
                size += if k == K::Str { 16 } else { 8 };
                locals.insert(name.clone(), (size, k));
            }
        }
        let end = a.create_label();
        let errors = Errors {
            div: a.create_label(),
            budget: a.create_label(),
            fault: a.create_label(),
            overflow: a.create_label(),
            empty: a.create_label(),
            other: a.create_label(),
            nesting: a.create_label(),
            strings: a.create_label(),
            argument: a.create_label(),
        };
        Ok(Gen {
            a,
            env,
            interner,
            point,
            pc,
            locals,
            locals_size: size,
            texts,
            depth: 0,
            loops: Vec::new(),
            end,
            errors,
            span: probe.span,
            key_levels: MAX_KEY_DEPTH,
            address_of: false,
            foreach_levels: foreach::FOREACH_LEVELS,
            foreach_depth: 0,
            functions: functions::Functions::default(),
            try_pushed: 0,
            try_loops: None,
            entry_values: Vec::new(),
        })
    }

    /// The epilogue, then the user functions the code calls (after it: the site's code goes
    /// on past them).
    fn finish(mut self) -> R<()> {
        let r = self.epilogue();
        self.asm(r)?;
        let mut after = self.a.create_label();
        let r = self.a.jmp(after);
        self.asm(r)?;
        self.emit_functions()?;
        self.place(&mut after)
    }
}

impl Gen<'_, '_> {
    fn no(&self, construct: impl Into<String>) -> Unsupported {
        Unsupported {
            probe: Some(self.point.probe),
            span: self.span,
            construct: construct.into(),
        }
    }

    fn frame_size(&self) -> i32 {
        let texts = self.texts.values().copied().max().unwrap_or(0);
        let foreach = self.foreach_levels as i32 * foreach::FOREACH_STATE;
        (self.locals_size + self.keys_bytes() + SCRATCH + texts + foreach + 15) / 16 * 16
    }

    /// Bytes of the key buffers in the current frame.
    fn keys_bytes(&self) -> i32 {
        (self.key_levels * MAX_KEYS) as i32 * KEY as i32
    }

    /// Frame offset (from rbp) of the state of the `foreach` open at `level`.
    fn foreach_state(&self, level: usize) -> i32 {
        let texts = self.texts.values().copied().max().unwrap_or(0);
        self.scratch() - texts - (level as i32 + 1) * foreach::FOREACH_STATE
    }

    /// Frame offset (from rbp) of the buffer of the text local at `at` (see `texts`).
    fn text_local(&self, at: i32) -> i32 {
        self.scratch() - at
    }

    /// The 8-byte buffer kernel reads copy into (below the key buffers).
    fn scratch(&self) -> i32 {
        -(self.locals_size + self.keys_bytes() + SCRATCH)
    }

    fn key_buffer(&self, depth: usize) -> i32 {
        -(self.locals_size + ((depth + 1) * MAX_KEYS) as i32 * KEY as i32)
    }

    fn prologue(&mut self) -> Result<(), IcedError> {
        let frame = self.frame_size();
        // rbx keeps the probe's stack for the end of the hit (also from inside functions)
        // and points at the catch record; r12 counts the user functions the hit is nested in.
        self.a.sub(rsp, CATCH_RECORD)?;
        self.a.mov(rbp, rsp)?;
        self.a.mov(rbx, rsp)?;
        self.a.mov(qword_ptr(rbx), 0)?;
        self.a.xor(r12d, r12d)?;
        self.a.sub(rsp, frame)?;
        self.zero_locals()?;
        self.enter_probe()?;
        self.enter_hit()
    }

    /// Locals start at 0 and "" (the key buffers need no clearing).
    fn zero_locals(&mut self) -> Result<(), IcedError> {
        if self.locals_size > 0 {
            self.a.xor(eax, eax)?;
            for off in (8..=self.locals_size).step_by(8) {
                self.a.mov(qword_ptr(rbp - off), rax)?;
            }
        }
        let texts: Vec<i32> = self.texts.values().map(|at| self.text_local(*at)).collect();
        for off in texts {
            self.a.mov(byte_ptr(rbp + off), 0)?;
        }
        Ok(())
    }

    fn enter_probe(&mut self) -> Result<(), IcedError> {
        self.a
            .mov(r14, self.env.limits.max_action.min(i64::MAX as u64))?;
        let mut cur = Instruction::with2(
            Code::Mov_r64_rm64,
            Register::R13,
            MemoryOperand::with_base_displ(Register::None, self.env.facts.current_task as i64),
        )?;
        cur.set_segment_prefix(Register::GS);
        cur.set_memory_displ_size(4);
        self.a.add_instruction(cur)
    }

    fn epilogue(&mut self) -> Result<(), IcedError> {
        let data = self.env.data;
        let mut common = self.a.create_label();
        self.a.jmp(self.end)?;
        self.a.set_label(&mut self.errors.div)?;
        self.count(data + field::DIV_ZERO)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.budget)?;
        self.count(data + field::MAXACTION)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.fault)?;
        self.count(data + field::FAULTS)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.overflow)?;
        self.count(data + field::OVERFLOW)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.empty)?;
        self.count(data + field::EMPTY)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.other)?;
        self.count(data + field::RAISED)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.nesting)?;
        self.count(data + field::NESTING)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.strings)?;
        self.count(data + field::STRINGS)?;
        self.a.jmp(common)?;
        self.a.set_label(&mut self.errors.argument)?;
        self.count(data + field::ARGUMENTS)?;
        self.a.set_label(&mut common)?;
        self.count(data + field::ERRORS)?;
        self.a.set_label(&mut self.end)?;
        self.leave_hit()?;
        self.a.lea(rsp, qword_ptr(rbx + CATCH_RECORD))?;
        Ok(())
    }

    fn count(&mut self, addr: u64) -> Result<(), IcedError> {
        let mut inc = Instruction::with1(Code::Inc_rm64, rip(addr))?;
        inc.set_has_lock_prefix(true);
        self.a.add_instruction(inc)
    }

    fn asm<T>(&mut self, r: Result<T, IcedError>) -> R<T> {
        r.map_err(|e| self.no(format!("code the assembler refused ({e})")))
    }

    fn tick(&mut self) -> R<()> {
        let r = (|| {
            self.a.dec(r14)?;
            self.a.js(self.errors.budget)
        })();
        asm!(self, r)
    }

    fn block(&mut self, b: &Block) -> R<()> {
        for s in &b.stmts {
            self.stmt(s)?;
        }
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt) -> R<()> {
        self.span = s.span;
        self.tick()?;
        match &s.kind {
            StmtKind::Empty => Ok(()),
            StmtKind::Block(b) => self.block(b),
            StmtKind::Expr(e) => self.expr(e).map(|_| ()),
            StmtKind::If(i) if i.cond.defined_test().is_some() => {
                let (test, negated) = i.cond.defined_test().ok_or_else(|| self.no("@defined"))?;
                if self.defined_here(test)? != negated {
                    self.stmt(&i.then)
                } else if let Some(e) = &i.els {
                    self.stmt(e)
                } else {
                    Ok(())
                }
            }
            StmtKind::If(i) => {
                let mut els = self.a.create_label();
                let mut done = self.a.create_label();
                self.long(&i.cond)?;
                asm!(self, self.a.test(rax, rax))?;
                asm!(self, self.a.jz(els))?;
                self.stmt(&i.then)?;
                asm!(self, self.a.jmp(done))?;
                self.place(&mut els)?;
                if let Some(e) = &i.els {
                    self.stmt(e)?;
                }
                self.place(&mut done)
            }
            StmtKind::While(w) => {
                let mut top = self.a.create_label();
                let mut out = self.a.create_label();
                self.place(&mut top)?;
                self.span = s.span;
                self.long(&w.0)?;
                asm!(self, self.a.test(rax, rax))?;
                asm!(self, self.a.jz(out))?;
                self.tick()?;
                self.loops.push((top, out));
                self.stmt(&w.1)?;
                self.loops.pop();
                asm!(self, self.a.jmp(top))?;
                self.place(&mut out)
            }
            StmtKind::For(f) => {
                let mut top = self.a.create_label();
                let mut step = self.a.create_label();
                let mut out = self.a.create_label();
                if let Some(e) = &f.init {
                    self.expr(e)?;
                }
                self.place(&mut top)?;
                if let Some(c) = &f.cond {
                    self.long(c)?;
                    asm!(self, self.a.test(rax, rax))?;
                    asm!(self, self.a.jz(out))?;
                }
                self.span = s.span;
                self.tick()?;
                self.loops.push((step, out));
                self.stmt(&f.body)?;
                self.loops.pop();
                self.place(&mut step)?;
                if let Some(e) = &f.step {
                    self.expr(e)?;
                }
                asm!(self, self.a.jmp(top))?;
                self.place(&mut out)
            }
            StmtKind::Next => asm!(self, self.a.jmp(self.end)),
            StmtKind::Break | StmtKind::Continue => {
                let Some((cont, brk)) = self.loops.last().copied() else {
                    return Err(self.no("break or continue outside a loop"));
                };
                if self.try_loops.is_some_and(|n| self.loops.len() <= n) {
                    return Err(
                        self.no("break or continue out of a try block that calls user functions")
                    );
                }
                let to = if matches!(s.kind, StmtKind::Break) {
                    brk
                } else {
                    cont
                };
                asm!(self, self.a.jmp(to))
            }
            StmtKind::Foreach(fe) => self.foreach(fe),
            StmtKind::Return(e) => self.ret(e.as_ref()),
            StmtKind::Delete(e) => self.delete(e),
            StmtKind::Try(t) => self.try_catch(t),
        }
    }

    /// Sets a label on a no-op (two labels may not share an instruction).
    fn place(&mut self, l: &mut CodeLabel) -> R<()> {
        let r = (|| {
            self.a.set_label(l)?;
            self.a.nop()
        })();
        asm!(self, r)
    }

    fn long(&mut self, e: &Expr) -> R<()> {
        match self.expr(e)? {
            K::Long => Ok(()),
            K::Str => Err(self.no("a string where a number is needed")),
        }
    }

    fn push(&mut self, k: K) -> R<()> {
        let r = (|| {
            if k == K::Str {
                self.a.push(rdx)?;
            }
            self.a.push(rax)
        })();
        asm!(self, r)
    }

    fn string_const(&mut self, s: &str) -> R<K> {
        if self.env.layout.strings.is_some() && s.len() >= 16 {
            // Where the guest builds strings, every long string is in its string table.
            return self.built_const(s);
        }
        self.host_string(s)
    }

    /// A string constant in the host's encoding (inline, or interned by the host).
    fn host_string(&mut self, s: &str) -> R<K> {
        let raw = self.interner.encode(s);
        let lo = u64::from_le_bytes(raw[..8].try_into().unwrap_or_default());
        let hi = u64::from_le_bytes(raw[8..].try_into().unwrap_or_default());
        asm!(self, self.a.mov(rax, lo))?;
        asm!(self, self.a.mov(rdx, hi))?;
        Ok(K::Str)
    }

    fn global(&self, name: &str) -> Option<&GlobalSlot> {
        self.env.layout.globals.get(name)
    }

    fn expr(&mut self, e: &Expr) -> R<K> {
        let saved = self.span;
        self.span = e.span;
        let k = self.expr_inner(e)?;
        self.span = saved;
        Ok(k)
    }

    fn expr_inner(&mut self, e: &Expr) -> R<K> {
        match &e.kind {
            ExprKind::Num(n) => {
                asm!(self, self.a.mov(rax, *n))?;
                Ok(K::Long)
            }
            ExprKind::Str(s) => self.string_const(s),
            ExprKind::Var(name) => self.load_var(name),
            ExprKind::Target(t) => self.target(t),
            ExprKind::Index(ix) => {
                let slot = self.array(&ix.array.name)?;
                let k =
                    value_k(&slot.value).ok_or_else(|| self.no("an aggregate used as a value"))?;
                self.lookup(&ix.array.name, &ix.keys, false)?;
                let r = (|| {
                    let mut absent = self.a.create_label();
                    let mut done = self.a.create_label();
                    self.a.test(rax, rax)?;
                    self.a.jz(absent)?;
                    if k == K::Str {
                        self.a.mov(rdx, qword_ptr(rax + 8))?;
                    }
                    self.a.mov(rax, qword_ptr(rax))?;
                    self.a.jmp(done)?;
                    self.a.set_label(&mut absent)?;
                    self.a.xor(eax, eax)?;
                    self.a.xor(edx, edx)?;
                    self.a.set_label(&mut done)?;
                    self.a.nop()
                })();
                asm!(self, r)?;
                Ok(k)
            }
            ExprKind::Unary(op, x) => {
                self.long(x)?;
                let r = match op {
                    UnOp::Neg => self.a.neg(rax),
                    UnOp::Plus => Ok(()),
                    UnOp::BitNot => self.a.not(rax),
                    UnOp::Not => (|| {
                        self.a.test(rax, rax)?;
                        self.a.sete(al)?;
                        self.a.movzx(eax, al)
                    })(),
                };
                asm!(self, r)?;
                Ok(K::Long)
            }
            ExprKind::Binary(op, b) => self.binary(*op, &b.0, &b.1),
            ExprKind::Ternary(t) if matches!(t.0.kind, ExprKind::Defined(_)) => {
                // `@choose_defined(a, b)`: only the branch that exists here is compiled.
                if self.defined_here(&t.0)? {
                    self.expr(&t.1)
                } else {
                    self.expr(&t.2)
                }
            }
            ExprKind::Ternary(t) => {
                let mut els = self.a.create_label();
                let mut done = self.a.create_label();
                self.long(&t.0)?;
                asm!(self, self.a.test(rax, rax))?;
                asm!(self, self.a.jz(els))?;
                let ka = self.expr(&t.1)?;
                asm!(self, self.a.jmp(done))?;
                self.place(&mut els)?;
                let kb = self.expr(&t.2)?;
                self.place(&mut done)?;
                if ka != kb {
                    return Err(self.no("a ternary whose branches differ in type"));
                }
                Ok(ka)
            }
            ExprKind::Assign(op, b) => self.assign(*op, &b.0, &b.1),
            ExprKind::IncDec(i) => self.inc_dec(i),
            ExprKind::Aggregate(b) => self.aggregate(&b.0, &b.1),
            ExprKind::Stat(op, target) => self.stat(*op, target),
            ExprKind::Hist(..) => Err(self.no("a histogram used as a value in a kernel probe")),
            ExprKind::Call(c) => self.call(c),
            // As the interpreter: a parameter's value at the entry, also in a return probe.
            ExprKind::Entry(x) => match &x.kind {
                ExprKind::Target(t) if t.members.is_empty() && t.name.starts_with('$') => {
                    self.target(t)
                }
                _ => self.entry_value(e),
            },
            ExprKind::Defined(_) => {
                let yes = self.defined_here(e)?;
                asm!(self, self.a.mov(eax, u32::from(yes)))?;
                Ok(K::Long)
            }
            ExprKind::Cast(c) => self.cast(c),
            ExprKind::Variance(target, _) => self.variance(target),
            ExprKind::Embedded(_) => Err(self.no("embedded C")),
            // `&$p->m...` and `&@cast(p, "T")->m...`: the chain, its last member's address.
            ExprKind::AddressOf(x) => match &x.kind {
                ExprKind::Target(t)
                    if t.name.starts_with('$')
                        && !t.name.starts_with("$$")
                        && !t.members.is_empty() =>
                {
                    self.address_of = true;
                    let k = self.target(t);
                    self.address_of = false;
                    k
                }
                // `&@cast(p, "T")`: the structure's address, `p` itself.
                ExprKind::Cast(c) if c.members.is_empty() && c.indexes.is_empty() => {
                    self.long(&c.pointer)?;
                    Ok(K::Long)
                }
                ExprKind::Cast(c) if !c.members.is_empty() => {
                    self.address_of = true;
                    let k = self.cast(c);
                    self.address_of = false;
                    k
                }
                _ => Err(self
                    .no("& of something other than a member of a target variable or of a @cast")),
            },
            ExprKind::RegexMatch(p, negated) => self.regex_match(&p.0, &p.1, *negated),
            ExprKind::Wildcard => Err(self.no("a * key in a kernel probe")),
            ExprKind::In(i) => {
                self.array(&i.array.name)?;
                self.lookup(&i.array.name, &i.keys, false)?;
                let r = (|| {
                    self.a.test(rax, rax)?;
                    self.a.setne(al)?;
                    self.a.movzx(eax, al)
                })();
                asm!(self, r)?;
                Ok(K::Long)
            }
        }
    }

    /// `@defined(x)` (given as the whole `Defined` expression) at this probe point, known
    /// when compiling as the interpreter answers it: a parameter the point has (or
    /// `$return` in a return probe) is defined; a member chain, of a variable or of a `@cast`,
    /// is where it lays out from the kernel's types ([`chain_defined`], [`cast_defined`]).
    fn defined_here(&self, e: &Expr) -> R<bool> {
        let ExprKind::Defined(x) = &e.kind else {
            return Err(self.no("@defined of this"));
        };
        let mut answer = Ok(true);
        walk::expr_all(x, &mut |e| {
            let here = match &e.kind {
                ExprKind::Target(t) if t.name.starts_with("@var(") => {
                    let spec = super::globals::spec_of(&t.name).unwrap_or_default();
                    Ok(self.global_read(t, &spec).is_ok())
                }
                ExprKind::Target(t) if t.name.starts_with("$$") => {
                    Err(format!("@defined of {}", t.path()))
                }
                ExprKind::Target(t) if !t.members.is_empty() => {
                    let base = chain_base(
                        &t.name,
                        &self.point.params,
                        self.point.is_return,
                        self.point.locals.as_deref(),
                    );
                    Ok(chain_defined(
                        self.env.facts.types.as_deref(),
                        &self.point.function,
                        &t.name,
                        base,
                        &t.members,
                    ))
                }
                ExprKind::Target(t) if t.name == "$return" => Ok(self.point.is_return),
                ExprKind::Target(t) => {
                    let name = t.name.trim_start_matches('$');
                    let local = !self.point.is_return
                        && self
                            .point
                            .locals
                            .as_ref()
                            .and_then(|l| l.get(name))
                            .is_some_and(|l| l.is_ok());
                    Ok(local || self.point.params.iter().any(|p| p == name))
                }
                ExprKind::Cast(c) => Ok(cast_defined(self.env.facts.types.as_deref(), c)),
                ExprKind::Embedded(_) => Ok(false),
                _ => Ok(true),
            };
            answer = match (answer.clone(), here) {
                (Err(e), _) | (_, Err(e)) => Err(e),
                (Ok(a), Ok(b)) => Ok(a && b),
            };
        });
        answer.map_err(|c| self.no(c))
    }

    fn array(&self, name: &str) -> R<GlobalSlot> {
        match self.global(name) {
            Some(slot) if slot.table.is_some() => Ok(slot.clone()),
            _ => Err(self.no(format!("{name}, which is not a compiled array"))),
        }
    }

    fn load_var(&mut self, name: &str) -> R<K> {
        if self.env.prog.globals.contains_key(name) {
            let slot = self
                .global(name)
                .cloned()
                .ok_or_else(|| self.no(format!("the global {name}")))?;
            if slot.table.is_some() {
                return Err(self.no(format!("the array {name} used as a value")));
            }
            let addr = self.env.data + slot.offset;
            return match slot.value {
                ValueKind::Long => {
                    asm!(
                        self,
                        self.a.add_instruction(
                            Instruction::with2(Code::Mov_r64_rm64, Register::RAX, rip(addr))
                                .map_err(|e| self.no(e.to_string()))?,
                        )
                    )?;
                    Ok(K::Long)
                }
                ValueKind::Str => {
                    self.lea(Register::RCX, addr)?;
                    asm!(self, self.a.mov(rdx, qword_ptr(rcx + 8)))?;
                    asm!(self, self.a.mov(rax, qword_ptr(rcx)))?;
                    Ok(K::Str)
                }
                ValueKind::Stats(_) => {
                    Err(self.no(format!("the aggregate {name} used as a value")))
                }
            };
        }
        if self.texts.contains_key(name) {
            return Err(self.no(format!(
                "{name}, which holds a string read from memory, used other than as an argument \
                 of printf/print/println"
            )));
        }
        let (off, k) = *self
            .locals
            .get(name)
            .ok_or_else(|| self.no(format!("the variable {name}")))?;
        if k == K::Str {
            asm!(self, self.a.mov(rdx, qword_ptr(rbp - off + 8)))?;
        }
        asm!(self, self.a.mov(rax, qword_ptr(rbp - off)))?;
        Ok(k)
    }

    fn lea(&mut self, reg: Register, addr: u64) -> R<()> {
        let i = Instruction::with2(Code::Lea_r64_m, reg, rip(addr))
            .map_err(|e| self.no(e.to_string()))?;
        asm!(self, self.a.add_instruction(i))
    }

    fn target(&mut self, t: &TargetVar) -> R<K> {
        if let Some(spec) = super::globals::spec_of(&t.name) {
            return self.kernel_global(t, &spec);
        }
        if t.name.starts_with("$$") {
            return Err(self.no(format!(
                "{} (a text listing of variables, formatted on the host)",
                t.name
            )));
        }
        let name = t.name.trim_start_matches('$');
        // A parameter in an argument register is read there; one passed on the stack (the
        // seventh on) by its DWARF location, where the point has one.
        let param = self
            .point
            .params
            .iter()
            .position(|p| p == name)
            .is_some_and(|i| i < ARGS.len());
        if t.name != "$return" && !self.point.is_return && !param {
            if let Some(local) = self.point.locals.as_ref().and_then(|l| l.get(name)) {
                let local = local.clone().map_err(|why| self.no(why))?;
                return self.local(t, &local);
            }
        }
        let base = if t.members.is_empty() {
            None
        } else {
            Some(self.target_type(&t.name)?)
        };
        let reg = if t.name == "$return" {
            if !self.point.is_return {
                return Err(self.no("$return outside a return probe"));
            }
            Register::RAX
        } else {
            let name = t.name.trim_start_matches('$');
            let i = self
                .point
                .params
                .iter()
                .position(|p| p == name)
                .ok_or_else(|| self.no(format!("the target variable {}", t.name)))?;
            *ARGS
                .get(i)
                .ok_or_else(|| self.no(format!("{}, passed on the stack", t.name)))?
        };
        let off = if self.point.is_return && reg != Register::RAX {
            // The entry's value, which the trampoline pushed under the saved registers.
            let i = ARGS.iter().position(|r| *r == reg).unwrap_or(0) as i32;
            8 * i - super::site::ENTRY_ARGS
        } else {
            saved_offset(reg)
        };
        asm!(self, self.a.mov(rax, qword_ptr(r15 + off)))?;
        if let Some(base) = base {
            self.members(&t.path(), base, &t.members)?;
        }
        Ok(K::Long)
    }
}

impl Gen<'_, '_> {
    /// A target variable by its DWARF location at the point ([`super::locals`]): a saved
    /// register (the probed code's `rsp` is just above the saved registers), a stack slot
    /// read with `copy_from_kernel_nofault`, or a constant; then its member chain, laid out
    /// from the struct its pointer type names.
    fn local(&mut self, t: &TargetVar, local: &super::locals::Local) -> R<K> {
        use super::locals::{Place, DWARF_RSP};
        use exotap_introspect::x86::regs::DWARF_GPRS as DWARF_REGS;
        let load = |g: &mut Self, reg: u16| -> R<()> {
            if reg == DWARF_RSP {
                return asm!(g, g.a.lea(rax, qword_ptr(r15 + SAVED_BYTES)));
            }
            let r = *DWARF_REGS
                .get(usize::from(reg))
                .ok_or_else(|| g.no(format!("{} in DWARF register {reg}", t.name)))?;
            asm!(g, g.a.mov(rax, qword_ptr(r15 + saved_offset(r))))
        };
        match local.place {
            Place::Const(v) => asm!(self, self.a.mov(rax, v))?,
            Place::Address(a) => {
                asm!(
                    self,
                    self.a.mov(rax, a.wrapping_add(self.env.facts.data_slide))
                )?;
            }
            Place::Register(reg) | Place::Computed { reg, .. } => {
                load(self, reg)?;
                if let Place::Computed { add, .. } = local.place {
                    asm!(self, self.a.mov(rcx, add))?;
                    asm!(self, self.a.add(rax, rcx))?;
                }
                let r = match (local.size, local.signed) {
                    (8, _) => Ok(()),
                    (4, true) => self.a.movsxd(rax, eax),
                    (4, false) => self.a.mov(eax, eax),
                    (2, true) => self.a.movsx(rax, ax),
                    (2, false) => self.a.movzx(eax, ax),
                    (_, true) => self.a.movsx(rax, al),
                    (_, false) => self.a.movzx(eax, al),
                };
                asm!(self, r)?;
            }
            Place::Memory { base, offset } => {
                load(self, base)?;
                self.steps(&local.steps(offset))?;
            }
        }
        if !t.members.is_empty() {
            let address = std::mem::take(&mut self.address_of);
            let what = if address {
                format!("&{}", t.path())
            } else {
                t.path()
            };
            let types = self
                .env
                .facts
                .types
                .clone()
                .ok_or_else(|| self.no(format!("{what} (no kernel type information)")))?;
            let steps = target_chain(
                types.as_ref(),
                &self.point.function,
                &t.name,
                ChainBase::Local(local.pointee.as_deref()),
                &t.members,
                address,
            )
            .map_err(|e| self.no(format!("{what}: {e}")))?;
            self.steps(&steps)?;
        }
        Ok(K::Long)
    }
}

impl Gen<'_, '_> {
    /// The layout of a kernel global's read ([`super::globals`]): its slid address and the
    /// steps from there, or why it does not compile.
    fn global_read(&self, t: &TargetVar, spec: &str) -> Result<(u64, Vec<Step>), String> {
        let what = t.path();
        let global = match self.env.facts.globals.get(spec) {
            Some(Ok(g)) => g,
            Some(Err(why)) => return Err(format!("{what}: {why}")),
            None => return Err(format!("{what} (the kernel global was not looked up)")),
        };
        let types = self
            .env
            .facts
            .types
            .clone()
            .ok_or_else(|| format!("{what} (no kernel type information)"))?;
        let steps = super::globals::steps(types.as_ref(), global.ty, &t.members)
            .map_err(|e| format!("{what} ({}): {e}", global.type_name))?;
        Ok((global.link.wrapping_add(self.env.facts.data_slide), steps))
    }

    /// `@var("name")->members`: from the global's slid address, each read through
    /// `copy_from_kernel_nofault` (an unmapped address is a probe error).
    fn kernel_global(&mut self, t: &TargetVar, spec: &str) -> R<K> {
        let (at, steps) = self.global_read(t, spec).map_err(|why| self.no(why))?;
        asm!(self, self.a.mov(rax, at))?;
        self.steps(&steps)?;
        Ok(K::Long)
    }

    /// `jiffies()`: the kernel's `jiffies_64`, read at its slid address.
    pub(super) fn jiffies(&mut self) -> R<K> {
        let link = self
            .env
            .facts
            .jiffies
            .ok_or_else(|| self.no("jiffies() (the kernel has no jiffies_64 symbol)"))?;
        asm!(
            self,
            self.a
                .mov(rax, link.wrapping_add(self.env.facts.data_slide))
        )?;
        self.steps(&[Step::Read {
            offset: 0,
            size: 8,
            signed: false,
        }])?;
        Ok(K::Long)
    }
}

fn value_k(v: &ValueKind) -> Option<K> {
    match v {
        ValueKind::Long => Some(K::Long),
        ValueKind::Str => Some(K::Str),
        ValueKind::Stats(_) => None,
    }
}
