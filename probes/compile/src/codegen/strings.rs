//! Strings built in the guest: `.` (and `.=`), `substr`, `strlen`, `sprint`/`sprintln`,
//! `text_str`, `string_quoted`, and the byte order of strings that may be built.
//!
//! A compiled string value stays 16 bytes wherever it goes (locals, function returns,
//! globals, map keys and values, see [`super::super::data`]); a string built in the guest
//! takes a third form of that encoding: up to 15 bytes inline, as every short string, and
//! longer ones interned in the data's string table ([`super::super::data::StringTable`]),
//! byte 0 = 2 and the entry's index at +8. Interning keeps "equal texts, equal encodings",
//! so comparisons, hashing of keys and the host's decoding need nothing new.
//!
//! An operation lays its operands' texts into a MAXSTRINGLEN buffer on the stack (the
//! runtime's `append` helper: at most MAXSTRINGLEN - 1 bytes, so a result is cut there as
//! SystemTap cuts it), works on the bytes, then interns the result (the runtime's `intern`
//! helper) and frees the buffer. Where a script builds strings, its long string constants
//! (literals, `probefunc()`, `pp()`) are interned in the guest too, so that a built string
//! and a constant of the same text compare equal; printing copies a string's text into the
//! output record (the host never sees a table index there). A string the guest cannot
//! read the text of (one the host interned, given back from a host-evaluated probe) and a
//! string the full table has no room for end the hit with a probe error, counted apart
//! (`field::STRINGS`).
//!
//! Written by hand rather than calling the kernel's string routines: the text must stay
//! inside the buffer and the table whatever the guest's memory holds, and the helpers run
//! with no kernel function's calling convention to honour.

use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, Register};

use exotap_lang::ast::*;
use exotap_lang::check::Program;
use exotap_lang::value::truncate;

use super::super::data::{
    StringTable, HITS, HIT_CPUS, HIT_STRIDE, IN_USE, MAX_PROBES, STRING_HEAD,
};
use super::{rip, walk, Gen, HIT_WORD, K, R};

/// Key of the `append` helper in the runtime's helpers.
pub(crate) const APPEND: &str = "$append";
/// Key of the `intern` helper in the runtime's helpers.
pub(crate) const INTERN: &str = "$intern";
/// Byte 0 of a name-table entry whose name is longer than 15 bytes (never a text's first
/// byte: the names are ASCII).
const LONG_NAME: u8 = 0xff;
/// Times a reader waits for an entry being written before it gives up.
const SPINS: u32 = 1000;

/// Whether a kernel probe (or a user function, which a kernel probe may call) of `prog`
/// builds strings: then the data has a string table and the runtime its helpers.
pub fn builds_strings(prog: &Program) -> bool {
    let mut hit = false;
    let mut visit = |e: &Expr| {
        hit |= builds(e);
    };
    kernel_exprs(prog, &mut visit);
    // `backtrace()` other than as a print argument: its text is built in the guest.
    hit || super::super::snapshot::stack_uses(prog).1 > 0 || reads_text_values(prog)
}

/// Whether a kernel probe (its condition or body) or a user function reads a string from
/// memory as a value (see [`super::memory::reads_text_values`]).
fn reads_text_values(prog: &Program) -> bool {
    use super::memory::{reads_text_values as reads, text_call, text_locals};
    let (kernel, _) = super::super::kernel_probes(prog);
    let none = std::collections::HashSet::new();
    let in_condition = |c: &Expr| {
        let mut hit = false;
        walk::expr_all(c, &mut |e: &Expr| hit |= text_call(e).is_some());
        hit
    };
    kernel
        .iter()
        .filter_map(|&i| prog.script.probes.get(i))
        .any(|p| {
            p.condition.as_ref().is_some_and(in_condition) || reads(&p.body, &text_locals(&p.body))
        })
        || prog.script.functions.iter().any(|f| match &f.body {
            FunctionBody::Block(b) => reads(b, &none),
            _ => false,
        })
}

/// Visits every expression compiled code may run: those of kernel probes (conditions and
/// bodies; begin, end and timer probes run on the host) and of user functions, which a
/// kernel probe may call.
fn kernel_exprs(prog: &Program, mut visit: &mut dyn FnMut(&Expr)) {
    let (kernel, _) = super::super::kernel_probes(prog);
    for i in kernel {
        if let Some(p) = prog.script.probes.get(i) {
            if let Some(c) = &p.condition {
                walk::expr_all(c, &mut visit);
            }
            for s in &p.body.stmts {
                walk::stmt_exprs(s, &mut visit);
            }
        }
    }
    for f in &prog.script.functions {
        if let FunctionBody::Block(b) = &f.body {
            walk::block_exprs(b, &mut visit);
        }
    }
}

/// The distinct `=~` patterns of kernel probes (and of user functions, which a kernel probe
/// may call): each gets a matcher in the data.
pub fn regex_patterns(prog: &Program) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut visit = |e: &Expr| {
        if let ExprKind::RegexMatch(p, _) = &e.kind {
            if let ExprKind::Str(s) = &p.1.kind {
                if !out.contains(s) {
                    out.push(s.clone());
                }
            }
        }
    };
    kernel_exprs(prog, &mut visit);
    out
}

/// Whether a kernel probe keeps an `@entry(...)` value of anything but a parameter in its
/// call's slot: a built string's table index may then live there, outside the globals and
/// any hit, so the string table is not collected (see [`super::super::data::collect`]).
pub fn keeps_entry_values(prog: &Program) -> bool {
    let mut hit = false;
    let mut visit = |e: &Expr| {
        if let ExprKind::Entry(x) = &e.kind {
            let param = matches!(&x.kind,
                ExprKind::Target(t) if t.members.is_empty() && t.name.starts_with('$'));
            hit |= !param;
        }
    };
    kernel_exprs(prog, &mut visit);
    hit
}

/// Whether `e` itself builds a string (or reads one's text).
pub(super) fn builds(e: &Expr) -> bool {
    match &e.kind {
        // `=~` reads its subject's text (the string helpers lay it out).
        ExprKind::RegexMatch(..) => true,
        ExprKind::Binary(BinOp::Concat, _) | ExprKind::Assign(Some(BinOp::Concat), _) => true,
        ExprKind::Call(c) => matches!(
            c.name.name.as_str(),
            "substr"
                | "strlen"
                | "sprint"
                | "sprintln"
                | "text_str"
                | "string_quoted"
                | "isinstr"
                | "strpos"
                | "stringat"
                | "strtol"
                | "str_replace"
                | "sprintf"
                | "signal_str"
                | "errno_str"
                | "return_str"
                | "_sys_open_flag_str"
                | "syscall_name"
                | "symname"
        ),
        _ => false,
    }
}

/// Whether evaluating the key `e` twice gives the same value with no effect (a constant or
/// a variable).
pub(super) fn plain_key(e: &Expr) -> bool {
    matches!(
        e.kind,
        ExprKind::Num(_) | ExprKind::Str(_) | ExprKind::Var(_)
    )
}

/// Assembles the runtime's string helpers for the table `t` of data at `data`; returns the
/// labels of `append` and `intern`.
///
/// `append`: rax/rdx = a string's encoding, rdi = where its text goes, rcx = room; copies
/// the text (without a NUL), leaves rdi after it and rcx the room left, and sets r8 to 1
/// when the text cannot be read (a string the host interned, an index past the table).
/// Clobbers rsi, r9, r10.
///
/// `intern`: rsi = a text, rcx = its length (at most the table's text slot less one);
/// returns its encoding in rax/rdx and r8 = 0, or r8 = 1 when the table had no room (or
/// an entry stayed busy). A text not in the table takes its chain's first entry the host's
/// collector freed, else the free entry that ends the chain, and counts it in use.
/// Clobbers rcx, rdi, r9-r11.
pub(crate) fn runtime_helpers(
    a: &mut CodeAssembler,
    t: &StringTable,
    data: u64,
) -> Result<(CodeLabel, CodeLabel), IcedError> {
    let base = data + t.offset;
    let entry = i32::try_from(t.entry_size()).unwrap_or(i32::MAX);
    let mask = t.entries - 1;
    let most = (t.text - 1) as u32;

    // append
    let mut append = a.create_label();
    let mut table = a.create_label();
    let mut unreadable = a.create_label();
    a.set_label(&mut append)?;
    a.movzx(r9d, al)?;
    a.cmp(r9d, 2)?;
    a.je(table)?;
    a.cmp(r9d, 1)?;
    a.je(unreadable)?;
    a.push(rdx)?;
    a.push(rax)?;
    a.mov(rsi, rsp)?;
    a.mov(r9d, 15)?;
    copy_text(a)?;
    a.add(rsp, 16)?;
    a.ret()?;
    a.set_label(&mut table)?;
    a.cmp(rdx, i32::try_from(t.entries).unwrap_or(i32::MAX))?;
    a.jae(unreadable)?;
    a.imul_3(rsi, rdx, entry)?;
    a.add_instruction(Instruction::with2(
        Code::Lea_r64_m,
        Register::R10,
        rip(base + STRING_HEAD),
    )?)?;
    a.add(rsi, r10)?;
    a.mov(r9d, most)?;
    copy_text(a)?;
    a.ret()?;
    a.set_label(&mut unreadable)?;
    a.or(r8d, 1)?;
    a.ret()?;

    // intern
    let mut intern = a.create_label();
    let mut long = a.create_label();
    let mut hash = a.create_label();
    let mut hashed = a.create_label();
    let mut probe = a.create_label();
    let mut look = a.create_label();
    let mut ready = a.create_label();
    let mut busy = a.create_label();
    let mut next = a.create_label();
    let mut found = a.create_label();
    let mut fail = a.create_label();
    a.set_label(&mut intern)?;
    a.xor(r8d, r8d)?;
    a.cmp(rcx, 15)?;
    a.ja(long)?;
    // Inline, unless the first byte would read as another form (as the host's encoding).
    a.test(rcx, rcx)?;
    let mut inline = a.create_label();
    a.jz(inline)?;
    a.movzx(r9d, byte_ptr(rsi))?;
    a.cmp(r9d, 1)?;
    a.je(long)?;
    a.cmp(r9d, 2)?;
    a.je(long)?;
    a.set_label(&mut inline)?;
    a.push(0)?;
    a.push(0)?;
    a.mov(rdi, rsp)?;
    a.rep().movsb()?;
    a.pop(rax)?;
    a.pop(rdx)?;
    a.ret()?;
    a.set_label(&mut long)?;
    // FNV-1a over the bytes (StringTable::hash).
    a.mov(r9, 0xcbf2_9ce4_8422_2325u64)?;
    a.mov(r10, 0x100_0000_01b3u64)?;
    a.xor(edi, edi)?;
    a.set_label(&mut hash)?;
    a.cmp(rdi, rcx)?;
    a.jae(hashed)?;
    a.movzx(eax, byte_ptr(rsi + rdi))?;
    a.xor(r9, rax)?;
    a.imul_2(r9, r10)?;
    a.inc(rdi)?;
    a.jmp(hash)?;
    a.set_label(&mut hashed)?;
    // [rsp]: the index of the chain's first freed entry (a tombstone of the host's
    // collector), or -1 while none was passed.
    a.push(-1)?;
    let mut chain = a.create_label();
    let mut freed = a.create_label();
    let mut reuse = a.create_label();
    let mut fill = a.create_label();
    a.set_label(&mut chain)?;
    a.mov(r11, r9)?;
    a.and(r11d, mask as i32)?;
    a.mov(r10d, MAX_PROBES.min(t.entries))?;
    a.set_label(&mut probe)?;
    entry_address(a, base, entry)?;
    a.mov(edx, SPINS)?;
    a.set_label(&mut look)?;
    a.mov(rax, qword_ptr(rdi))?;
    a.cmp(rax, 2)?;
    a.je(ready)?;
    a.cmp(rax, 3)?;
    a.je(freed)?;
    a.test(rax, rax)?;
    a.jnz(busy)?;
    // A free entry ends the chain: the text is not in the table. It goes into the chain's
    // first freed entry if it passed one, else here: claimed (0 → 1), filled, published
    // (2; stores are not reordered).
    a.cmp(qword_ptr(rsp), -1)?;
    a.jne(reuse)?;
    a.mov(r8d, 1)?;
    a.lock().cmpxchg(qword_ptr(rdi), r8)?;
    a.mov(r8d, 0)?;
    a.jne(look)?;
    a.set_label(&mut fill)?;
    a.mov(qword_ptr(rdi + 8), r9)?;
    a.push(rdi)?;
    a.push(rsi)?;
    a.push(rcx)?;
    a.add(rdi, STRING_HEAD as i32)?;
    a.rep().movsb()?;
    a.mov(byte_ptr(rdi), 0)?;
    a.pop(rcx)?;
    a.pop(rsi)?;
    a.pop(rdi)?;
    a.mov(qword_ptr(rdi), 2)?;
    let mut in_use = Instruction::with1(Code::Inc_rm64, rip(data + t.head + IN_USE))?;
    in_use.set_has_lock_prefix(true);
    a.add_instruction(in_use)?;
    a.jmp(found)?;
    a.set_label(&mut freed)?;
    a.cmp(qword_ptr(rsp), -1)?;
    a.jne(next)?;
    a.mov(qword_ptr(rsp), r11)?;
    a.jmp(next)?;
    // The first freed entry: claimed (3 → 1). Another vCPU that took it first may have put
    // this very text there: the chain is looked at again from its start.
    a.set_label(&mut reuse)?;
    a.mov(r11, qword_ptr(rsp))?;
    entry_address(a, base, entry)?;
    a.mov(eax, 3)?;
    a.mov(r8d, 1)?;
    a.lock().cmpxchg(qword_ptr(rdi), r8)?;
    a.mov(r8d, 0)?;
    a.je(fill)?;
    a.mov(qword_ptr(rsp), -1)?;
    a.jmp(chain)?;
    a.set_label(&mut ready)?;
    a.cmp(qword_ptr(rdi + 8), r9)?;
    a.jne(next)?;
    a.cmp(byte_ptr(rdi + rcx + STRING_HEAD as i32), 0)?;
    a.jne(next)?;
    a.push(rdi)?;
    a.push(rsi)?;
    a.push(rcx)?;
    a.add(rdi, STRING_HEAD as i32)?;
    a.repe().cmpsb()?;
    a.pop(rcx)?;
    a.pop(rsi)?;
    a.pop(rdi)?;
    a.jne(next)?;
    a.set_label(&mut found)?;
    a.mov(eax, 2)?;
    a.mov(rdx, r11)?;
    a.pop(r10)?;
    a.ret()?;
    a.set_label(&mut busy)?;
    a.pause()?;
    a.dec(edx)?;
    a.jnz(look)?;
    a.jmp(fail)?;
    a.set_label(&mut next)?;
    a.inc(r11)?;
    a.and(r11d, mask as i32)?;
    a.dec(r10d)?;
    a.jnz(probe)?;
    // The chain's probes ran out with no free entry: a freed one passed on the way will do.
    a.cmp(qword_ptr(rsp), -1)?;
    a.jne(reuse)?;
    a.set_label(&mut fail)?;
    a.mov(r8d, 1)?;
    a.pop(r10)?;
    a.ret()?;
    Ok((append, intern))
}

/// Copies bytes from rsi to rdi until a NUL, r9 bytes of source or rcx bytes of room.
/// `rdi` = the address of the string table's entry `r11` (the table's entries at `base`,
/// `entry` bytes each). Clobbers rax.
fn entry_address(a: &mut CodeAssembler, base: u64, entry: i32) -> Result<(), IcedError> {
    a.imul_3(rdi, r11, entry)?;
    a.add_instruction(Instruction::with2(
        Code::Lea_r64_m,
        Register::RAX,
        rip(base),
    )?)?;
    a.add(rdi, rax)
}

fn copy_text(a: &mut CodeAssembler) -> Result<(), IcedError> {
    let mut top = a.create_label();
    let mut done = a.create_label();
    a.set_label(&mut top)?;
    a.test(r9, r9)?;
    a.jz(done)?;
    a.test(rcx, rcx)?;
    a.jz(done)?;
    a.mov(r10b, byte_ptr(rsi))?;
    a.test(r10b, r10b)?;
    a.jz(done)?;
    a.mov(byte_ptr(rdi), r10b)?;
    a.inc(rsi)?;
    a.inc(rdi)?;
    a.dec(rcx)?;
    a.dec(r9)?;
    a.jmp(top)?;
    a.set_label(&mut done)?;
    a.nop()
}

impl Gen<'_, '_> {
    /// Counts the hit in its CPU's word of the string table's head, which the host's
    /// collector reads (see [`super::super::data::collect`]), and keeps the word's address
    /// in the catch record for [`Gen::leave_hit`]. Clobbers rax and rcx; nothing where the
    /// table is not collected.
    pub(super) fn enter_hit(&mut self) -> Result<(), IcedError> {
        let Some(t) = self.env.layout.strings.filter(|t| t.collectable) else {
            return Ok(());
        };
        exotap_probes_base::rings::emit_cpu_number(self.a, self.env.facts.cpu_number)?;
        self.a.and(eax, (HIT_CPUS - 1) as i32)?;
        self.a.shl(eax, HIT_STRIDE.trailing_zeros())?;
        self.a.add_instruction(Instruction::with2(
            Code::Lea_r64_m,
            Register::RCX,
            rip(self.env.data + t.head + HITS),
        )?)?;
        self.a.add(rcx, rax)?;
        self.a.mov(qword_ptr(rbx + HIT_WORD), rcx)?;
        self.a.lock().inc(qword_ptr(rcx))
    }

    /// Counts the hit out of the word [`Gen::enter_hit`] counted it into (its CPU at the
    /// start, should its task have moved since). Clobbers rcx.
    pub(super) fn leave_hit(&mut self) -> Result<(), IcedError> {
        if !self.env.layout.strings.is_some_and(|t| t.collectable) {
            return Ok(());
        }
        self.a.mov(rcx, qword_ptr(rbx + HIT_WORD))?;
        self.a.lock().dec(qword_ptr(rcx))
    }
}

impl Gen<'_, '_> {
    /// Bytes of the buffer a string is built in: MAXSTRINGLEN, rounded up to 16.
    pub(super) fn build_bytes(&self) -> i32 {
        self.text_bytes()
    }

    /// Most bytes of a built string's text: MAXSTRINGLEN less its NUL.
    pub(super) fn build_room(&self) -> u32 {
        let most = self.env.limits.max_string_len.saturating_sub(1);
        u32::try_from(most)
            .unwrap_or(u32::MAX)
            .min(self.build_bytes() as u32 - 1)
    }

    pub(super) fn string_helper(&self, which: &str) -> R<u64> {
        self.env
            .helpers
            .get(&(which.to_owned(), false))
            .copied()
            .ok_or_else(|| self.no("a string built without the string table"))
    }

    /// Calls `append` for the string in rax/rdx (r8 gathers whether any text was unreadable).
    pub(super) fn append(&mut self) -> R<()> {
        let f = self.string_helper(APPEND)?;
        asm!(self, self.a.call(f))
    }

    /// Opens a build buffer at rsp: rdi at its start, rcx its room, r8 cleared.
    pub(super) fn open_buffer(&mut self) -> R<()> {
        let bytes = self.build_bytes();
        let room = self.build_room();
        let r = (|| {
            self.a.sub(rsp, bytes)?;
            self.a.mov(rdi, rsp)?;
            self.a.mov(ecx, room)?;
            self.a.xor(r8d, r8d)
        })();
        asm!(self, r)
    }

    /// Interns the text from rsp to rdi (unless r8 says a text was unreadable), frees the
    /// buffer and `extra` more bytes of stack, then ends the hit with a probe error when
    /// r8 is set. The string is in rax/rdx.
    pub(super) fn close_buffer(&mut self, extra: i32) -> R<K> {
        let f = self.string_helper(INTERN)?;
        let bytes = self.build_bytes();
        let strings = self.errors.strings;
        let r = (|| {
            let mut skip = self.a.create_label();
            self.a.test(r8, r8)?;
            self.a.jnz(skip)?;
            self.a.mov(rsi, rsp)?;
            self.a.mov(rcx, rdi)?;
            self.a.sub(rcx, rsi)?;
            self.a.call(f)?;
            self.a.set_label(&mut skip)?;
            self.a.add(rsp, bytes + extra)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(K::Str)
    }

    /// A string constant over 15 bytes, interned in the guest's table (cut to MAXSTRINGLEN,
    /// as the interpreter holds it).
    pub(super) fn built_const(&mut self, s: &str) -> R<K> {
        let text = truncate(s.to_owned(), self.env.limits.max_string_len);
        let f = self.string_helper(INTERN)?;
        let strings = self.errors.strings;
        let r = (|| {
            let mut bytes = self.a.create_label();
            let mut over = self.a.create_label();
            self.a.jmp(over)?;
            self.a.set_label(&mut bytes)?;
            self.a.db(text.as_bytes())?;
            self.a.set_label(&mut over)?;
            self.a.lea(rsi, qword_ptr(bytes))?;
            self.a.mov(ecx, text.len() as u32)?;
            self.a.call(f)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(K::Str)
    }

    /// A string operand.
    pub(super) fn string_operand(&mut self, e: &Expr, what: &str) -> R<()> {
        match self.expr(e)? {
            K::Str => Ok(()),
            K::Long => Err(self.no(format!("{what} of a number"))),
        }
    }

    /// `x . y`.
    pub(super) fn concat(&mut self, x: &Expr, y: &Expr) -> R<K> {
        self.string_operand(x, "concatenation")?;
        self.push(K::Str)?;
        self.string_operand(y, "concatenation")?;
        self.concat_pushed()
    }

    /// The string pushed, then the one in rax/rdx, as one string (the pushed one popped).
    pub(super) fn concat_pushed(&mut self) -> R<K> {
        let bytes = self.build_bytes();
        let r = (|| {
            self.a.push(rdx)?;
            self.a.push(rax)
        })();
        asm!(self, r)?;
        self.open_buffer()?;
        asm!(self, self.a.mov(rax, qword_ptr(rsp + bytes + 16)))?;
        asm!(self, self.a.mov(rdx, qword_ptr(rsp + bytes + 24)))?;
        self.append()?;
        asm!(self, self.a.mov(rax, qword_ptr(rsp + bytes)))?;
        asm!(self, self.a.mov(rdx, qword_ptr(rsp + bytes + 8)))?;
        self.append()?;
        self.close_buffer(32)
    }

    /// `strlen(s)`.
    pub(super) fn strlen(&mut self, c: &Call) -> R<K> {
        let [s] = c.args.as_slice() else {
            return Err(self.no("strlen() without one argument"));
        };
        self.string_operand(s, "strlen()")?;
        self.open_buffer()?;
        self.append()?;
        let bytes = self.build_bytes();
        let strings = self.errors.strings;
        let r = (|| {
            self.a.mov(rax, rdi)?;
            self.a.sub(rax, rsp)?;
            self.a.add(rsp, bytes)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    /// `substr(s, start, len)`, as the interpreter: "" when start < 0, len <= 0 or start at
    /// or past the end; else the bytes from start, at most len of them.
    pub(super) fn substr(&mut self, c: &Call) -> R<K> {
        let [s, start, len] = c.args.as_slice() else {
            return Err(self.no("substr() without three arguments"));
        };
        self.string_operand(s, "substr()")?;
        self.push(K::Str)?;
        self.long(start)?;
        asm!(self, self.a.push(rax))?;
        self.long(len)?;
        asm!(self, self.a.push(rax))?;
        let bytes = self.build_bytes();
        // Stack: len, start, the string.
        asm!(self, self.a.mov(rax, qword_ptr(rsp + 16)))?;
        asm!(self, self.a.mov(rdx, qword_ptr(rsp + 24)))?;
        self.open_buffer()?;
        self.append()?;
        let f = self.string_helper(INTERN)?;
        let strings = self.errors.strings;
        let r = (|| {
            let mut empty = self.a.create_label();
            let mut fits = self.a.create_label();
            let mut out = self.a.create_label();
            self.a.test(r8, r8)?;
            self.a.jnz(out)?;
            self.a.mov(rcx, rdi)?;
            self.a.sub(rcx, rsp)?; // the string's length
            self.a.mov(r9, qword_ptr(rsp + bytes + 8))?; // start
            self.a.mov(r10, qword_ptr(rsp + bytes))?; // len
            self.a.test(r9, r9)?;
            self.a.js(empty)?;
            self.a.test(r10, r10)?;
            self.a.jle(empty)?;
            self.a.cmp(r9, rcx)?;
            self.a.jae(empty)?;
            self.a.sub(rcx, r9)?;
            self.a.cmp(r10, rcx)?;
            self.a.jbe(fits)?;
            self.a.mov(r10, rcx)?;
            self.a.set_label(&mut fits)?;
            // Move the bytes to the buffer's start (forward: the source is above).
            self.a.lea(rsi, qword_ptr(rsp + r9))?;
            self.a.mov(rdi, rsp)?;
            self.a.mov(rcx, r10)?;
            self.a.rep().movsb()?;
            self.a.mov(rsi, rsp)?;
            self.a.mov(rcx, r10)?;
            self.a.call(f)?;
            self.a.jmp(out)?;
            self.a.set_label(&mut empty)?;
            self.a.xor(eax, eax)?;
            self.a.xor(edx, edx)?;
            self.a.set_label(&mut out)?;
            self.a.add(rsp, bytes + 32)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(K::Str)
    }

    /// `sprint(v, ...)`: each value as the interpreter prints it (a long in decimal), one
    /// after the other; `sprintln` adds a newline.
    pub(super) fn sprint(&mut self, c: &Call) -> R<K> {
        if c.name.name == "sprintln" {
            if c.args.is_empty() {
                return self.host_string("\n");
            }
            let plain = Call {
                name: Ident {
                    name: "sprint".into(),
                    ..c.name.clone()
                },
                ..c.clone()
            };
            self.sprint(&plain)?;
            self.push(K::Str)?;
            self.host_string("\n")?;
            return self.concat_pushed();
        }
        if c.args.is_empty() {
            return self.host_string("");
        }
        for (i, v) in c.args.iter().enumerate() {
            if i > 0 {
                self.push(K::Str)?;
            }
            if matches!(v.kind, ExprKind::Hist(..)) {
                return Err(self.no("sprint() of a histogram in a kernel probe"));
            }
            if self.expr(v)? == K::Long {
                self.decimal()?;
            }
            if i > 0 {
                self.concat_pushed()?;
            }
        }
        Ok(K::Str)
    }

    /// `signal_str(n)`, as the interpreter names signals: SIGHUP to SIGRTMIN+32 from a table,
    /// any other number `SIG<n>`.
    pub(super) fn signal_str(&mut self, c: &Call) -> R<K> {
        let names = (0..=64).map(exotap_lang::native::signal_str).collect();
        self.name_table(c, names, Some("SIG"), false)
    }

    /// `errno_str(e)`, as the interpreter names an errno (either sign): the table up to the
    /// kernel's restart codes (516), "" for any other.
    pub(super) fn errno_str(&mut self, c: &Call) -> R<K> {
        let names = (0..=516).map(exotap_lang::native::errno_str).collect();
        self.name_table(c, names, None, true)
    }

    /// `syscall_name(n)`, as the interpreter names x86-64 system calls: every number up to
    /// the highest named one from a table (`syscall_<n>` where it has no name), any other
    /// `syscall_<n>`.
    pub(super) fn syscall_name(&mut self, c: &Call) -> R<K> {
        let names = (0..=exotap_lang::syscalls::highest())
            .map(exotap_lang::native::syscall_name)
            .collect();
        self.name_table(c, names, Some("syscall_"), false)
    }

    /// The name of the number `c`'s one argument gives: `names[n]` from a table in the code
    /// (16 bytes per name: a short one inline, a longer one its text's place in the code,
    /// interned in the guest's string table), else `prefix` and the number in decimal, built
    /// (no prefix: ""). With `abs`, the number's absolute value picks the name.
    fn name_table(
        &mut self,
        c: &Call,
        names: Vec<String>,
        prefix: Option<&str>,
        abs: bool,
    ) -> R<K> {
        let [n] = c.args.as_slice() else {
            return Err(self.no(format!("{}() without one argument", c.name.name)));
        };
        let intern = self.string_helper(INTERN)?;
        // Entries first, then the texts of the long names.
        let mut table = Vec::new();
        let mut texts: Vec<u8> = Vec::new();
        let entries = 16 * names.len();
        for name in &names {
            let name = truncate(name.clone(), self.env.limits.max_string_len);
            if name.len() <= 15 {
                table.extend_from_slice(&self.interner.encode(&name));
            } else {
                let mut entry = [0u8; 16];
                entry[0] = LONG_NAME;
                entry[4..8].copy_from_slice(&(name.len() as u32).to_le_bytes());
                entry[8..12].copy_from_slice(&((entries + texts.len()) as u32).to_le_bytes());
                table.extend_from_slice(&entry);
                texts.extend_from_slice(name.as_bytes());
            }
        }
        table.extend_from_slice(&texts);
        let last = i32::try_from(names.len().saturating_sub(1))
            .map_err(|_| self.no("a name table past 2^31 entries"))?;
        self.long(n)?;
        if abs {
            // i64::MIN stays negative: past the table as unsigned.
            let r = (|| {
                self.a.mov(rcx, rax)?;
                self.a.neg(rax)?;
                self.a.cmovs(rax, rcx)
            })();
            asm!(self, r)?;
        }
        let mut other = self.a.create_label();
        let mut done = self.a.create_label();
        let strings = self.errors.strings;
        let r = (|| {
            let mut names = self.a.create_label();
            let mut short = self.a.create_label();
            self.a.cmp(rax, last)?;
            self.a.ja(other)?; // unsigned: negative numbers too
            self.a.shl(rax, 4)?;
            self.a.lea(rsi, qword_ptr(names))?;
            self.a.mov(rdx, qword_ptr(rsi + rax + 8))?;
            self.a.mov(rax, qword_ptr(rsi + rax))?;
            self.a.cmp(al, LONG_NAME as u32)?;
            self.a.jne(short)?;
            // A long name: intern its text (rsi = the text, rcx = its length).
            self.a.mov(ecx, edx)?;
            self.a.add(rsi, rcx)?;
            self.a.shr(rax, 32)?;
            self.a.mov(rcx, rax)?;
            self.a.call(intern)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)?;
            self.a.set_label(&mut short)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut names)?;
            self.a.db(&table)?;
            self.a.set_label(&mut other)?;
            self.a.push(rax)?;
            self.a.push(rax) // keeps the stack 16-byte aligned
        })();
        asm!(self, r)?;
        match prefix {
            Some(prefix) => {
                self.host_string(prefix)?;
                self.push(K::Str)?;
                asm!(self, self.a.mov(rax, qword_ptr(rsp + 16)))?;
                self.decimal()?;
                self.concat_pushed()?;
            }
            None => {
                self.host_string("")?;
            }
        }
        asm!(self, self.a.add(rsp, 16))?;
        self.place(&mut done)?;
        Ok(K::Str)
    }

    /// The long in rax as a decimal string in rax/rdx.
    pub(super) fn decimal(&mut self) -> R<()> {
        let f = self.string_helper(INTERN)?;
        let room = self.build_room();
        let strings = self.errors.strings;
        let r = (|| {
            let mut positive = self.a.create_label();
            let mut digit = self.a.create_label();
            let mut done = self.a.create_label();
            self.a.sub(rsp, 32)?;
            self.a.lea(rdi, qword_ptr(rsp + 32))?;
            self.a.mov(r11, rax)?;
            self.a.test(rax, rax)?;
            self.a.jns(positive)?;
            self.a.neg(rax)?; // i64::MIN stays 2^63, right as unsigned
            self.a.set_label(&mut positive)?;
            self.a.mov(r10d, 10)?;
            self.a.set_label(&mut digit)?;
            self.a.xor(edx, edx)?;
            self.a.div(r10)?;
            self.a.add(dl, b'0' as u32)?;
            self.a.dec(rdi)?;
            self.a.mov(byte_ptr(rdi), dl)?;
            self.a.test(rax, rax)?;
            self.a.jnz(digit)?;
            self.a.test(r11, r11)?;
            self.a.jns(done)?;
            self.a.dec(rdi)?;
            self.a.mov(byte_ptr(rdi), b'-' as u32)?;
            self.a.set_label(&mut done)?;
            self.a.mov(rsi, rdi)?;
            self.a.lea(rcx, qword_ptr(rsp + 32))?;
            self.a.sub(rcx, rdi)?;
            // At most MAXSTRINGLEN - 1 bytes, as the interpreter cuts it.
            let mut fits = self.a.create_label();
            self.a.cmp(rcx, room as i32)?;
            self.a.jbe(fits)?;
            self.a.mov(ecx, room)?;
            self.a.set_label(&mut fits)?;
            self.a.call(f)?;
            self.a.add(rsp, 32)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)
    }

    /// `text_str(s)`: as the interpreter's `escape` (`\"`, `\\`, `\n`, `\t`, `\r`, other
    /// control bytes and DEL as three octal digits), cut at MAXSTRINGLEN - 1 bytes.
    pub(super) fn text_str(&mut self, c: &Call) -> R<K> {
        let [s] = c.args.as_slice() else {
            return Err(self.no("text_str() without one argument"));
        };
        self.string_operand(s, "text_str()")?;
        self.open_buffer()?;
        self.append()?;
        let bytes = self.build_bytes();
        let room = self.build_room();
        let r = (|| {
            let mut top = self.a.create_label();
            let mut done = self.a.create_label();
            let mut octal = self.a.create_label();
            self.a.mov(byte_ptr(rdi), 0)?;
            self.a.sub(rsp, bytes)?;
            self.a.lea(rsi, qword_ptr(rsp + bytes))?;
            self.a.mov(rdi, rsp)?;
            self.a.mov(ecx, room)?;
            fn put(a: &mut CodeAssembler, done: CodeLabel, b: Option<u8>) -> Result<(), IcedError> {
                a.test(rcx, rcx)?;
                a.jz(done)?;
                match b {
                    Some(b) => a.mov(byte_ptr(rdi), u32::from(b))?,
                    None => a.mov(byte_ptr(rdi), dl)?,
                }
                a.inc(rdi)?;
                a.dec(rcx)
            }
            self.a.set_label(&mut top)?;
            self.a.movzx(eax, byte_ptr(rsi))?;
            self.a.test(al, al)?;
            self.a.jz(done)?;
            self.a.inc(rsi)?;
            let mut escapes = Vec::new();
            for (from, to) in [
                (b'"', b'"'),
                (b'\\', b'\\'),
                (b'\n', b'n'),
                (b'\t', b't'),
                (b'\r', b'r'),
            ] {
                let l = self.a.create_label();
                self.a.cmp(al, u32::from(from))?;
                self.a.je(l)?;
                escapes.push((l, to));
            }
            self.a.cmp(al, 0x20)?;
            self.a.jb(octal)?;
            self.a.cmp(al, 0x7f)?;
            self.a.je(octal)?;
            self.a.mov(edx, eax)?;
            put(self.a, done, None)?;
            self.a.jmp(top)?;
            for (mut l, to) in escapes {
                self.a.set_label(&mut l)?;
                put(self.a, done, Some(b'\\'))?;
                put(self.a, done, Some(to))?;
                self.a.jmp(top)?;
            }
            self.a.set_label(&mut octal)?;
            put(self.a, done, Some(b'\\'))?;
            for shift in [6u32, 3, 0] {
                self.a.mov(edx, eax)?;
                if shift > 0 {
                    self.a.shr(edx, shift)?;
                }
                self.a.and(edx, 7)?;
                self.a.add(dl, u32::from(b'0'))?;
                put(self.a, done, None)?;
            }
            self.a.jmp(top)?;
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        self.close_buffer(bytes)
    }

    /// `string_quoted(s)`: `text_str(s)` between double quotes (the interpreter's, cut at
    /// MAXSTRINGLEN - 1 bytes as a whole).
    pub(super) fn string_quoted(&mut self, c: &Call) -> R<K> {
        self.host_string("\"")?;
        self.push(K::Str)?;
        self.text_str(c)?;
        self.concat_pushed()?;
        self.push(K::Str)?;
        self.host_string("\"")?;
        self.concat_pushed()
    }

    /// `x < y` (and `<=`, `>`, `>=`) of the string pushed (x) and the one in rax/rdx (y),
    /// where strings may be in the guest's table: both texts laid out NUL-terminated, then
    /// compared byte by byte up to the shorter one's NUL (the interpreter's byte order).
    pub(super) fn order_texts(&mut self, op: BinOp) -> R<K> {
        let bytes = self.build_bytes();
        // y's text, then x's (8 + 8 bytes of the pushed x above y's buffer).
        self.open_buffer()?;
        self.append()?;
        asm!(self, self.a.mov(byte_ptr(rdi), 0))?;
        asm!(self, self.a.mov(r11, rdi))?;
        asm!(self, self.a.sub(r11, rsp))?; // y's length
        asm!(self, self.a.mov(rax, qword_ptr(rsp + bytes)))?;
        asm!(self, self.a.mov(rdx, qword_ptr(rsp + bytes + 8)))?;
        asm!(self, self.a.push(r11))?;
        asm!(self, self.a.push(r8))?;
        self.open_buffer()?;
        asm!(self, self.a.or(r8, qword_ptr(rsp + bytes)))?;
        self.append()?;
        let strings = self.errors.strings;
        let r = (|| {
            self.a.mov(byte_ptr(rdi), 0)?;
            self.a.mov(rcx, rdi)?;
            self.a.sub(rcx, rsp)?; // x's length
            self.a.mov(r11, qword_ptr(rsp + bytes + 8))?;
            let mut shorter = self.a.create_label();
            self.a.cmp(rcx, r11)?;
            self.a.jbe(shorter)?;
            self.a.mov(rcx, r11)?;
            self.a.set_label(&mut shorter)?;
            self.a.inc(rcx)?; // the NUL too
            self.a.mov(rsi, rsp)?; // x
            self.a.lea(rdi, qword_ptr(rsp + bytes + 16))?; // y
            self.a.repe().cmpsb()?;
            match op {
                BinOp::Lt => self.a.setb(al)?,
                BinOp::Le => self.a.setbe(al)?,
                BinOp::Gt => self.a.seta(al)?,
                _ => self.a.setae(al)?,
            }
            self.a.movzx(eax, al)?;
            self.a.add(rsp, 2 * bytes + 16 + 16)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    /// Copies the text of the string in rax/rdx into a MAXSTRINGLEN buffer pushed on the
    /// stack (NUL-terminated), for an output record; a text that cannot be read is a
    /// probe error.
    pub(super) fn text_on_stack(&mut self) -> R<()> {
        self.open_buffer()?;
        self.append()?;
        let strings = self.errors.strings;
        let r = (|| {
            self.a.mov(byte_ptr(rdi), 0)?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)
    }
}
