//! `foreach` over a compiled array, in the interpreter's order.
//!
//! The interpreter walks a snapshot of the array: in insertion order, or sorted on the value
//! (a statistic of it for aggregate arrays) or on one key, ascending or descending, ties
//! broken by the keys in order (probes/lang/src/eval.rs, `sort_rows`). The guest has no room
//! for a snapshot, so each iteration selects the next element from the table itself: the
//! smallest published element (in that order) that comes after the previous one. Every
//! selection scans the table's slots once, so a walk costs elements × capacity slot visits,
//! bounded; the order is total because keys are unique, so no element comes twice and the
//! walk ends. A body that writes the array it walks would see its own changes, unlike the
//! snapshot: such a `foreach` is refused by name. Each iteration ticks the statement budget
//! (MAXACTION) as the interpreter does.

use iced_x86::code_asm::*;
use iced_x86::Register;

use exotap_lang::ast::*;

use super::super::data::{ValueKind, ENTRY_KEYS, KEY, TABLE_HEADER};
use super::{walk, Gen, K, R};

/// `foreach` loops nested in one body at most.
pub(super) const FOREACH_LEVELS: usize = 3;
/// Frame bytes of one `foreach`'s state: the previous element, iterations, the limit, the
/// scan's cursor, slots left to scan, the best element so far.
pub(super) const FOREACH_STATE: i32 = 48;

const PREV: i32 = 0;
const DONE: i32 = 8;
const LIMIT: i32 = 16;
const CURSOR: i32 = 24;
const LEFT: i32 = 32;
const BEST: i32 = 40;

/// What one comparison step looks at in an entry.
#[derive(Debug, Clone, Copy)]
enum Part {
    /// A long at this offset (signed).
    Long(i32),
    /// A 16-byte string at this offset (bytes, unsigned).
    Str(i32),
    /// The insertion number (unsigned).
    Sequence,
    /// A statistic of the aggregate at this offset.
    Stat(i32, StatOp),
}

impl Gen<'_, '_> {
    pub(super) fn foreach(&mut self, fe: &Foreach) -> R<()> {
        let name = fe.array.name.as_str();
        let slot = self.array(name)?;
        let (nkeys, _) = slot.table.unwrap_or((0, 0));
        if fe.keys.len() != nkeys {
            return Err(self.no(format!(
                "foreach over {name} with {} keys, not {nkeys}",
                fe.keys.len()
            )));
        }
        if self.foreach_depth >= FOREACH_LEVELS {
            return Err(self.no(format!(
                "foreach nested more than {FOREACH_LEVELS} deep in a kernel probe"
            )));
        }
        if walk::stmt_writes(self.env.prog, &fe.body, name) {
            return Err(self.no(format!(
                "foreach over {name} whose body changes {name} (the interpreter walks a \
                 snapshot, the guest walks the table itself)"
            )));
        }
        let vo = slot.value_offset() as i32;
        let key = |i: usize| ENTRY_KEYS as i32 + KEY as i32 * i as i32;
        let key_part = |i: usize| {
            if slot.key_is_str.get(i).copied().unwrap_or(false) {
                Part::Str(key(i))
            } else {
                Part::Long(key(i))
            }
        };
        // The order: the sort's part first (reversed when descending), then every key.
        let (primary, descending) = match fe.sort {
            None => (Part::Sequence, false),
            Some(s) => {
                let part = match (s.key, slot.value) {
                    (SortKey::Key(i), _) if i < nkeys => key_part(i),
                    (SortKey::Key(i), _) => {
                        return Err(self.no(format!("foreach sorted on key {i} of {name}")))
                    }
                    (SortKey::Value, ValueKind::Long) => Part::Long(vo),
                    (SortKey::Value, ValueKind::Str) => Part::Str(vo),
                    (SortKey::Value, ValueKind::Stats(_)) => {
                        Part::Stat(vo, s.stat.unwrap_or(StatOp::Count))
                    }
                };
                (part, s.descending)
            }
        };
        let mut parts = vec![primary];
        if fe.sort.is_some() {
            parts.extend((0..nkeys).map(key_part));
        }
        if parts.iter().any(|p| matches!(p, Part::Str(_))) && self.interns_strings() {
            return Err(self.no(format!(
                "foreach over {name} sorted on strings, in a script with strings longer than \
                 15 bytes (the guest orders only the strings it holds inline)"
            )));
        }
        let state = self.foreach_state(self.foreach_depth);
        // The limit is evaluated once, before the walk.
        match &fe.limit {
            Some(l) => self.long(l)?,
            None => asm!(self, self.a.mov(rax, i64::MAX))?,
        }
        asm!(self, self.a.mov(qword_ptr(rbp + state + LIMIT), rax))?;
        // `in a[k, *]`: the named keys, evaluated once after the limit (as the interpreter
        // does), wait in a key buffer of their own for the whole walk: the body's lookups
        // use the buffers after it.
        let slice = match &fe.slice {
            Some(keys) => Some(self.named_keys(name, &slot, keys)?),
            None => None,
        };
        let named = slice.as_ref().map_or(&[][..], |s| &s.1[..]);
        let slice_buf = slice.as_ref().map_or(0, |s| s.0);
        if slice.is_some() {
            self.depth += 1;
        }
        let walked = self.walk(fe, &slot, &parts, descending, state, named, slice_buf);
        if slice.is_some() {
            self.depth -= 1;
        }
        walked
    }

    /// The walk of [`Self::foreach`] once its limit (and slice keys) are in the frame.
    #[allow(clippy::too_many_arguments)]
    fn walk(
        &mut self,
        fe: &Foreach,
        slot: &super::super::data::GlobalSlot,
        parts: &[Part],
        descending: bool,
        state: i32,
        named: &[usize],
        slice_buf: i32,
    ) -> R<()> {
        let (_, cap) = slot.table.unwrap_or((0, 0));
        let vo = slot.value_offset() as i32;
        let key = |i: usize| ENTRY_KEYS as i32 + KEY as i32 * i as i32;
        let entries = self.env.data + slot.offset + TABLE_HEADER;
        let entry_size = slot.entry_size() as i32;
        let mut less = self.a.create_label();
        let mut top = self.a.create_label();
        let mut out = self.a.create_label();
        let r = (|| {
            self.a.xor(eax, eax)?;
            self.a.mov(qword_ptr(rbp + state + PREV), rax)?;
            self.a.mov(qword_ptr(rbp + state + DONE), rax)?;
            self.a.set_label(&mut top)?;
            self.a.mov(rax, qword_ptr(rbp + state + DONE))?;
            self.a.cmp(rax, qword_ptr(rbp + state + LIMIT))?;
            self.a.jge(out)?;
            Ok(())
        })();
        asm!(self, r)?;
        self.lea(Register::RAX, entries)?;
        let r = (|| {
            let mut scan = self.a.create_label();
            let mut no_prev = self.a.create_label();
            let mut take = self.a.create_label();
            let mut skip = self.a.create_label();
            self.a.mov(qword_ptr(rbp + state + CURSOR), rax)?;
            self.a.mov(qword_ptr(rbp + state + LEFT), cap as i32)?;
            self.a.mov(qword_ptr(rbp + state + BEST), 0)?;
            self.a.set_label(&mut scan)?;
            self.a.mov(rsi, qword_ptr(rbp + state + CURSOR))?;
            self.a.cmp(qword_ptr(rsi), 2)?;
            self.a.jne(skip)?;
            // In the slice...
            for &i in named {
                for half in [0, 8] {
                    self.a
                        .mov(rax, qword_ptr(rbp + slice_buf + 16 * i as i32 + half))?;
                    self.a.cmp(rax, qword_ptr(rsi + key(i) + half))?;
                    self.a.jne(skip)?;
                }
            }
            // ...after the previous element...
            self.a.mov(rdi, qword_ptr(rbp + state + PREV))?;
            self.a.test(rdi, rdi)?;
            self.a.jz(no_prev)?;
            self.a.call(less)?;
            self.a.test(eax, eax)?;
            self.a.jz(skip)?;
            self.a.set_label(&mut no_prev)?;
            // ...and before the best so far.
            self.a.mov(rdi, qword_ptr(rbp + state + CURSOR))?;
            self.a.mov(rsi, qword_ptr(rbp + state + BEST))?;
            self.a.test(rsi, rsi)?;
            self.a.jz(take)?;
            self.a.call(less)?;
            self.a.test(eax, eax)?;
            self.a.jz(skip)?;
            self.a.set_label(&mut take)?;
            self.a.mov(rax, qword_ptr(rbp + state + CURSOR))?;
            self.a.mov(qword_ptr(rbp + state + BEST), rax)?;
            self.a.set_label(&mut skip)?;
            self.a.add(qword_ptr(rbp + state + CURSOR), entry_size)?;
            self.a.dec(qword_ptr(rbp + state + LEFT))?;
            self.a.jnz(scan)?;
            self.a.mov(rax, qword_ptr(rbp + state + BEST))?;
            self.a.test(rax, rax)?;
            self.a.jz(out)?;
            self.a.mov(qword_ptr(rbp + state + PREV), rax)?;
            self.a.inc(qword_ptr(rbp + state + DONE))
        })();
        asm!(self, r)?;
        self.span = fe.array.span;
        self.tick()?;
        // Bind the keys (and the value) of the element.
        asm!(self, self.a.mov(rax, qword_ptr(rbp + state + PREV)))?;
        for (i, ident) in fe.keys.iter().enumerate() {
            self.bind(&ident.name, key(i))?;
        }
        if let (Some(v), false) = (&fe.value, matches!(slot.value, ValueKind::Stats(_))) {
            self.bind(&v.name, vo)?;
        }
        self.foreach_depth += 1;
        self.loops.push((top, out));
        let body = self.stmt(&fe.body);
        self.loops.pop();
        self.foreach_depth -= 1;
        body?;
        let r = (|| {
            self.a.jmp(top)?;
            // less(rdi, rsi): eax = 1 when the element at rdi comes first.
            self.a.set_label(&mut less)?;
            let mut first = self.a.create_label();
            let mut second = self.a.create_label();
            for (i, part) in parts.iter().enumerate() {
                let (lt, gt) = if i == 0 && descending {
                    (second, first)
                } else {
                    (first, second)
                };
                emit_compare(self.a, *part, lt, gt)?;
            }
            self.a.xor(eax, eax)?;
            self.a.ret()?;
            self.a.set_label(&mut first)?;
            self.a.mov(eax, 1)?;
            self.a.ret()?;
            self.a.set_label(&mut second)?;
            self.a.xor(eax, eax)?;
            self.a.ret()
        })();
        asm!(self, r)?;
        self.place(&mut out)
    }

    /// Copies the long or string at `rax + at` into local `name` (rax kept).
    fn bind(&mut self, name: &str, at: i32) -> R<()> {
        let (off, k) = *self
            .locals
            .get(name)
            .ok_or_else(|| self.no(format!("the foreach variable {name}")))?;
        let r = (|| {
            self.a.mov(rcx, qword_ptr(rax + at))?;
            self.a.mov(qword_ptr(rbp - off), rcx)?;
            if k == K::Str {
                self.a.mov(rcx, qword_ptr(rax + at + 8))?;
                self.a.mov(qword_ptr(rbp - off + 8), rcx)?;
            }
            Ok(())
        })();
        asm!(self, r)
    }

    /// Whether any body of the script may hold a string the host interns (see
    /// [`walk::may_intern`]); the points' names count when probes use them.
    pub(super) fn interns_strings(&self) -> bool {
        let prog = self.env.prog;
        // printf's format is never a value in the guest.
        let mut formats = std::collections::HashSet::new();
        let mut strings = Vec::new();
        let mut visit = |e: &Expr| {
            if let ExprKind::Call(c) = &e.kind {
                if c.name.name == "printf" {
                    if let Some(f) = c.args.first() {
                        formats.insert(f as *const Expr);
                    }
                }
            }
            if walk::may_intern(e) {
                strings.push(e as *const Expr);
            }
        };
        for p in &prog.script.probes {
            for s in &p.body.stmts {
                walk::stmt_exprs(s, &mut visit);
            }
        }
        for f in &prog.script.functions {
            if let FunctionBody::Block(b) = &f.body {
                walk::block_exprs(b, &mut visit);
            }
        }
        let mut hit = strings.iter().any(|e| !formats.contains(e));
        for init in prog.globals.values().filter_map(|g| g.init.as_ref()) {
            hit |= matches!(init, Literal::Str(s) if s.len() >= 16);
        }
        hit
    }
}

/// Compares `part` of the entries at rdi and rsi: jumps to `lt` when rdi's is smaller, to
/// `gt` when larger, falls through when equal. Clobbers rax, rcx, rdx, r8.
fn emit_compare(
    a: &mut CodeAssembler,
    part: Part,
    lt: CodeLabel,
    gt: CodeLabel,
) -> Result<(), IcedError> {
    match part {
        Part::Long(at) => {
            a.mov(rax, qword_ptr(rdi + at))?;
            a.cmp(rax, qword_ptr(rsi + at))?;
            a.jl(lt)?;
            a.jg(gt)
        }
        Part::Sequence => {
            a.mov(rax, qword_ptr(rdi + 8))?;
            a.cmp(rax, qword_ptr(rsi + 8))?;
            a.jb(lt)?;
            a.ja(gt)
        }
        Part::Str(at) => {
            for half in [0, 8] {
                a.mov(rax, qword_ptr(rdi + at + half))?;
                a.mov(rcx, qword_ptr(rsi + at + half))?;
                a.bswap(rax)?;
                a.bswap(rcx)?;
                a.cmp(rax, rcx)?;
                a.jb(lt)?;
                a.ja(gt)?;
            }
            Ok(())
        }
        Part::Stat(at, op) => {
            emit_stat(a, Register::RDI, at, op)?;
            a.mov(r8, rax)?;
            emit_stat(a, Register::RSI, at, op)?;
            a.cmp(r8, rax)?;
            a.jl(lt)?;
            a.jg(gt)
        }
    }
}

/// rax = statistic `op` of the aggregate at `entry + at`, 0 when it has no values (as the
/// interpreter sorts them). Clobbers rcx, rdx.
fn emit_stat(a: &mut CodeAssembler, entry: Register, at: i32, op: StatOp) -> Result<(), IcedError> {
    let base = if entry == Register::RDI { rdi } else { rsi };
    let mut done = a.create_label();
    a.mov(rcx, qword_ptr(base + at))?;
    if op == StatOp::Count {
        a.mov(rax, rcx)?;
        return Ok(());
    }
    a.xor(eax, eax)?;
    a.test(rcx, rcx)?;
    a.jle(done)?;
    match op {
        StatOp::Sum => a.mov(rax, qword_ptr(base + at + 8))?,
        StatOp::Min => a.mov(rax, qword_ptr(base + at + 16))?,
        StatOp::Max => a.mov(rax, qword_ptr(base + at + 24))?,
        // The count is positive here, so the division cannot trap.
        _ => {
            a.mov(rax, qword_ptr(base + at + 8))?;
            a.cqo()?;
            a.idiv(rcx)?;
        }
    }
    a.set_label(&mut done)?;
    a.nop()
}
