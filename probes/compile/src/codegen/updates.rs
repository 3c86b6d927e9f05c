//! Updates of globals: array lookups through the table helpers, assignment (also guru-mode
//! writes of target variables), `++`/`--` and `delete` (of an element, `a[k, *]`, a whole
//! array, and the oldest element of a full wrapping array).

use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, Register};

use exotap_lang::ast::*;

use super::super::data::{ValueKind, ENTRY_KEYS, TABLE_COUNT};
use super::{rip, value_k, Gen, K, MAX_KEY_DEPTH, R};

impl Gen<'_, '_> {
    /// `delete a[k]` marks the element deleted; `delete x` of a number or string resets it.
    pub(super) fn delete(&mut self, e: &Expr) -> R<()> {
        match &e.kind {
            ExprKind::Index(ix) if ix.keys.iter().any(|k| matches!(k.kind, ExprKind::Wildcard)) => {
                self.delete_matching(&ix.array.name, &ix.keys)
            }
            ExprKind::Index(ix) => {
                let slot = self.array(&ix.array.name)?;
                self.lookup(&ix.array.name, &ix.keys, false)?;
                let vo = slot.value_offset() as i32;
                let count = self.env.data + slot.offset + TABLE_COUNT;
                let r = (|| {
                    let mut absent = self.a.create_label();
                    self.a.test(rax, rax)?;
                    self.a.jz(absent)?;
                    self.a.mov(qword_ptr(rax - vo), 3)?;
                    let mut dec = Instruction::with1(Code::Dec_rm64, rip(count))?;
                    dec.set_has_lock_prefix(true);
                    self.a.add_instruction(dec)?;
                    self.a.set_label(&mut absent)?;
                    self.a.nop()
                })();
                asm!(self, r)
            }
            ExprKind::Var(name) if self.env.prog.globals.contains_key(name) => {
                let slot = self
                    .global(name)
                    .cloned()
                    .ok_or_else(|| self.no(format!("the global {name}")))?;
                if slot.table.is_some() {
                    return self.delete_all(name);
                }
                if matches!(slot.value, ValueKind::Stats(_)) {
                    return Err(self.no(format!(
                        "delete of the aggregate {name} in a kernel probe (its reset would not \
                         be one atomic update)"
                    )));
                }
                self.lea(Register::RCX, self.env.data + slot.offset)?;
                asm!(self, self.a.mov(qword_ptr(rcx), 0))?;
                if slot.value == ValueKind::Str {
                    asm!(self, self.a.mov(qword_ptr(rcx + 8), 0))?;
                }
                Ok(())
            }
            _ => Err(self.no("delete of this in a kernel probe")),
        }
    }

    /// `delete a[k, *]`: every published element whose named keys equal the given ones is
    /// marked deleted (one pass over the table, bounded).
    fn delete_matching(&mut self, name: &str, keys: &[Expr]) -> R<()> {
        let slot = self.array(name)?;
        let (buf, named) = self.named_keys(name, &slot, keys)?;
        self.delete_pass(&slot, &named, buf)
    }

    /// The keys of `name[k, *]` other than `*`, evaluated into the key buffer at the current
    /// depth (16 bytes a key): the buffer, and the positions of the keys in it.
    pub(super) fn named_keys(
        &mut self,
        name: &str,
        slot: &super::super::data::GlobalSlot,
        keys: &[Expr],
    ) -> R<(i32, Vec<usize>)> {
        let (nkeys, _) = slot.table.unwrap_or((0, 0));
        if keys.len() != nkeys {
            return Err(self.no(format!(
                "{name} indexed with {} keys, not {nkeys}",
                keys.len()
            )));
        }
        if self.depth >= self.key_levels {
            return Err(self.no(format!(
                "array lookups nested more than {} deep",
                self.key_levels
            )));
        }
        let buf = self.key_buffer(self.depth);
        self.depth += 1;
        let named = self.store_named_keys(name, slot, keys, buf);
        self.depth -= 1;
        named.map(|named| (buf, named))
    }

    fn store_named_keys(
        &mut self,
        name: &str,
        slot: &super::super::data::GlobalSlot,
        keys: &[Expr],
        buf: i32,
    ) -> R<Vec<usize>> {
        let mut named = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if matches!(key.kind, ExprKind::Wildcard) {
                continue;
            }
            let k = self.expr(key)?;
            if slot.key_is_str.get(i).copied().unwrap_or(false) != (k == K::Str) {
                return Err(self.no(format!("a key of {name} of the wrong type")));
            }
            let at = buf + 16 * i as i32;
            asm!(self, self.a.mov(qword_ptr(rbp + at), rax))?;
            if k == K::Str {
                asm!(self, self.a.mov(qword_ptr(rbp + at + 8), rdx))?;
            } else {
                asm!(self, self.a.mov(qword_ptr(rbp + at + 8), 0))?;
            }
            named.push(i);
        }
        Ok(named)
    }

    /// `delete a` of a whole array: every published element is marked deleted, as `delete
    /// a[k]` does one (a later insert of the same key brings it back as a new element, so
    /// the order matches the interpreter's fresh array).
    fn delete_all(&mut self, name: &str) -> R<()> {
        let slot = self.array(name)?;
        self.delete_pass(&slot, &[], 0)
    }

    /// One pass over the table of `slot`, bounded by its capacity: every published element
    /// whose keys `named` equal the ones in the frame at `buf` (16 bytes a key) is marked
    /// deleted (`lock cmpxchg` 2 → 3) and the element count goes down. No keys: every one.
    fn delete_pass(
        &mut self,
        slot: &super::super::data::GlobalSlot,
        named: &[usize],
        buf: i32,
    ) -> R<()> {
        let (_, cap) = slot.table.unwrap_or((0, 0));
        let table = self.env.data + slot.offset;
        let entry = slot.entry_size() as i32;
        self.lea(Register::RDI, table + super::super::data::TABLE_HEADER)?;
        let r = (|| {
            let mut each = self.a.create_label();
            let mut skip = self.a.create_label();
            self.a.mov(esi, cap)?;
            self.a.mov(edx, 3)?;
            self.a.set_label(&mut each)?;
            for &i in named {
                for half in [0, 8] {
                    let at = ENTRY_KEYS as i32 + 16 * i as i32 + half;
                    self.a
                        .mov(rax, qword_ptr(rbp + buf + 16 * i as i32 + half))?;
                    self.a.cmp(rax, qword_ptr(rdi + at))?;
                    self.a.jne(skip)?;
                }
            }
            self.a.mov(eax, 2)?;
            self.a.lock().cmpxchg(qword_ptr(rdi), rdx)?;
            self.a.jne(skip)?;
            let mut dec = Instruction::with1(Code::Dec_rm64, rip(table + TABLE_COUNT))?;
            dec.set_has_lock_prefix(true);
            self.a.add_instruction(dec)?;
            self.a.set_label(&mut skip)?;
            self.a.add(rdi, entry)?;
            self.a.dec(esi)?;
            self.a.jnz(each)
        })();
        asm!(self, r)
    }

    /// Leaves in rax the address of the array element (`insert`: created when absent; 0 when
    /// the table is full) or 0 when absent.
    pub(super) fn lookup(&mut self, name: &str, keys: &[Expr], insert: bool) -> R<()> {
        let slot = self.array(name)?;
        let want = slot.table.map_or(0, |t| t.0);
        if keys.len() != want {
            return Err(self.no(format!(
                "{name} indexed with {} keys, not {want}",
                keys.len()
            )));
        }
        if self.depth >= MAX_KEY_DEPTH {
            return Err(self.no(format!(
                "array lookups nested more than {MAX_KEY_DEPTH} deep"
            )));
        }
        let buf = self.key_buffer(self.depth);
        self.depth += 1;
        for (i, key) in keys.iter().enumerate() {
            let k = self.expr(key)?;
            let is_str = slot.key_is_str.get(i).copied().unwrap_or(false);
            if is_str != (k == K::Str) {
                self.depth -= 1;
                return Err(self.no(format!("a key of {name} of the wrong type")));
            }
            let at = buf + 16 * i as i32;
            asm!(self, self.a.mov(qword_ptr(rbp + at), rax))?;
            if k == K::Str {
                asm!(self, self.a.mov(qword_ptr(rbp + at + 8), rdx))?;
            } else {
                asm!(self, self.a.mov(qword_ptr(rbp + at + 8), 0))?;
            }
        }
        self.depth -= 1;
        let helper = *self
            .env
            .helpers
            .get(&(name.to_owned(), insert))
            .ok_or_else(|| self.no(format!("no table helper for {name}")))?;
        asm!(self, self.a.lea(rsi, qword_ptr(rbp + buf)))?;
        asm!(self, self.a.call(helper))?;
        if insert {
            let overflow = self.errors.overflow;
            if slot.wrap {
                // `a%`: a full array loses its oldest element, then the insert is tried
                // again once (another vCPU may have filled the room: then an overflow).
                let mut done = self.a.create_label();
                asm!(self, self.a.cmp(rax, 1))?;
                asm!(self, self.a.jne(done))?;
                self.delete_oldest(&slot)?;
                asm!(self, self.a.lea(rsi, qword_ptr(rbp + buf)))?;
                asm!(self, self.a.call(helper))?;
                asm!(self, self.a.cmp(rax, 1))?;
                asm!(self, self.a.je(overflow))?;
                self.place(&mut done)?;
            } else {
                asm!(self, self.a.cmp(rax, 1))?;
                asm!(self, self.a.je(overflow))?;
            }
        }
        Ok(())
    }

    /// Marks deleted the published element with the smallest insertion number (the
    /// interpreter's oldest); one pass over the table. Clobbers rax, rcx, rdx, rsi, rdi, r8.
    fn delete_oldest(&mut self, slot: &super::super::data::GlobalSlot) -> R<()> {
        let (_, cap) = slot.table.unwrap_or((0, 0));
        let table = self.env.data + slot.offset;
        let entry = slot.entry_size() as i32;
        self.lea(Register::RDI, table + super::super::data::TABLE_HEADER)?;
        let r = (|| {
            let mut each = self.a.create_label();
            let mut skip = self.a.create_label();
            let mut none = self.a.create_label();
            self.a.xor(r8d, r8d)?; // the oldest so far
            self.a.mov(esi, cap)?;
            self.a.set_label(&mut each)?;
            self.a.cmp(qword_ptr(rdi), 2)?;
            self.a.jne(skip)?;
            self.a.test(r8, r8)?;
            self.a.jz(none)?;
            self.a.mov(rax, qword_ptr(rdi + 8))?;
            self.a.cmp(rax, qword_ptr(r8 + 8))?;
            self.a.jae(skip)?;
            self.a.set_label(&mut none)?;
            self.a.mov(r8, rdi)?;
            self.a.set_label(&mut skip)?;
            self.a.add(rdi, entry)?;
            self.a.dec(esi)?;
            self.a.jnz(each)?;
            let mut gone = self.a.create_label();
            self.a.test(r8, r8)?;
            self.a.jz(gone)?;
            self.a.mov(eax, 2)?;
            self.a.mov(ecx, 3)?;
            self.a.lock().cmpxchg(qword_ptr(r8), rcx)?;
            self.a.jne(gone)?;
            let mut dec = Instruction::with1(Code::Dec_rm64, rip(table + TABLE_COUNT))?;
            dec.set_has_lock_prefix(true);
            self.a.add_instruction(dec)?;
            self.a.set_label(&mut gone)?;
            self.a.nop()
        })();
        asm!(self, r)
    }

    /// rax = address of a global scalar or an array element (created), or 0 (full table).
    pub(super) fn place_of(&mut self, target: &Expr) -> R<(ValueKind, bool)> {
        match &target.kind {
            ExprKind::Var(name) if self.env.prog.globals.contains_key(name) => {
                let slot = self
                    .global(name)
                    .cloned()
                    .ok_or_else(|| self.no(format!("the global {name}")))?;
                if slot.table.is_some() {
                    return Err(self.no(format!("the array {name} used as a scalar")));
                }
                self.lea(Register::RAX, self.env.data + slot.offset)?;
                Ok((slot.value, false))
            }
            ExprKind::Index(ix) => {
                let slot = self.array(&ix.array.name)?;
                self.lookup(&ix.array.name, &ix.keys, true)?;
                Ok((slot.value, true))
            }
            _ => Err(self.no("assigning to this")),
        }
    }

    pub(super) fn assign(&mut self, op: Option<BinOp>, target: &Expr, value: &Expr) -> R<K> {
        if op == Some(BinOp::Concat) && !matches!(target.kind, ExprKind::Target(_)) {
            // `s .= v` is `s = s . v` (an element's keys are evaluated twice: refused where
            // that could differ).
            if let ExprKind::Index(ix) = &target.kind {
                if ix.keys.iter().any(|k| !super::strings::plain_key(k)) {
                    return Err(self.no(".= to an element whose keys have side effects"));
                }
            }
            let joined = Expr {
                kind: ExprKind::Binary(BinOp::Concat, Box::new((target.clone(), value.clone()))),
                span: value.span,
            };
            return self.assign(None, target, &joined);
        }
        if let ExprKind::Target(t) = &target.kind {
            return self.write_target(t, op, value);
        }
        if let ExprKind::Var(name) = &target.kind {
            if let Some(at) = self.texts.get(name).copied() {
                return self.assign_text(name, at, op, value);
            }
            if !self.env.prog.globals.contains_key(name) {
                let (off, k) = *self
                    .locals
                    .get(name)
                    .ok_or_else(|| self.no(format!("the variable {name}")))?;
                match op {
                    None => {
                        let kv = self.expr(value)?;
                        if kv != k {
                            return Err(self.no(format!("{name} assigned a value of another type")));
                        }
                    }
                    Some(op) => {
                        if k == K::Str {
                            return Err(self.no("compound assignment to a string"));
                        }
                        self.long(value)?;
                        asm!(self, self.a.mov(rcx, rax))?;
                        asm!(self, self.a.mov(rax, qword_ptr(rbp - off)))?;
                        self.apply(op)?;
                    }
                }
                asm!(self, self.a.mov(qword_ptr(rbp - off), rax))?;
                if k == K::Str {
                    asm!(self, self.a.mov(qword_ptr(rbp - off + 8), rdx))?;
                }
                return Ok(k);
            }
        }
        let kv = self.expr(value)?;
        self.push(kv)?;
        let (kind, _) = self.place_of(target)?;
        let k = value_k(&kind).ok_or_else(|| self.no("assigning to an aggregate"))?;
        if k != kv {
            return Err(self.no("a global assigned a value of another type"));
        }
        if op.is_some() && k == K::Str {
            return Err(self.no("compound assignment to a string"));
        }
        let r = (|| {
            let mut full = self.a.create_label();
            let mut done = self.a.create_label();
            self.a.mov(rdi, rax)?;
            self.a.pop(rax)?;
            if k == K::Str {
                self.a.pop(rdx)?;
            }
            self.a.test(rdi, rdi)?;
            self.a.jz(full)?;
            match op {
                None => {
                    self.a.mov(qword_ptr(rdi), rax)?;
                    if k == K::Str {
                        self.a.mov(qword_ptr(rdi + 8), rdx)?;
                    }
                }
                Some(BinOp::Add) | Some(BinOp::Sub) => {
                    if op == Some(BinOp::Sub) {
                        self.a.neg(rax)?;
                    }
                    self.a.mov(rcx, rax)?;
                    self.a.lock().xadd(qword_ptr(rdi), rax)?;
                    self.a.add(rax, rcx)?;
                }
                Some(_) => {}
            }
            self.a.jmp(done)?;
            self.a.set_label(&mut full)?;
            self.a.nop()?;
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        if let Some(op) = op.filter(|o| !matches!(o, BinOp::Add | BinOp::Sub)) {
            // Other compound operators: load, apply, store (not atomic across vCPUs).
            let r = (|| {
                let skip = self.a.create_label();
                self.a.test(rdi, rdi)?;
                self.a.jz(skip)?;
                self.a.mov(rcx, rax)?;
                self.a.mov(rax, qword_ptr(rdi))?;
                self.a.push(rdi)?;
                Ok::<CodeLabel, IcedError>(skip)
            })();
            let mut skip = asm!(self, r)?;
            self.apply(op)?;
            let r = (|| {
                self.a.pop(rdi)?;
                self.a.mov(qword_ptr(rdi), rax)?;
                self.a.set_label(&mut skip)?;
                self.a.nop()
            })();
            asm!(self, r)?;
        }
        Ok(k)
    }

    /// Guru mode (the checker allows it only with `-g`): `$return = v` in a return probe
    /// changes the saved `rax` the trampoline returns to the caller; `$param = v` at an entry
    /// changes the saved argument register the function then runs with. Both are written
    /// where the site restores registers from, so nothing else in the guest is touched.
    pub(super) fn write_target(&mut self, t: &TargetVar, op: Option<BinOp>, value: &Expr) -> R<K> {
        if !t.members.is_empty() || t.name.starts_with("$$") {
            return Err(self.no(format!("a write to {}", t.path())));
        }
        let reg = if t.name == "$return" {
            if !self.point.is_return {
                return Err(self.no("$return outside a return probe"));
            }
            Register::RAX
        } else {
            if self.point.is_return {
                return Err(self.no(format!(
                    "a write to {} in a return probe (the function has run)",
                    t.name
                )));
            }
            let name = t.name.trim_start_matches('$');
            let i = self
                .point
                .params
                .iter()
                .position(|p| p == name)
                .ok_or_else(|| self.no(format!("the target variable {}", t.name)))?;
            *super::ARGS
                .get(i)
                .ok_or_else(|| self.no(format!("a write to {}, passed on the stack", t.name)))?
        };
        let at = super::saved_offset(reg);
        self.long(value)?;
        if let Some(op) = op {
            asm!(self, self.a.mov(rcx, rax))?;
            asm!(self, self.a.mov(rax, qword_ptr(r15 + at)))?;
            self.apply(op)?;
        }
        asm!(self, self.a.mov(qword_ptr(r15 + at), rax))?;
        Ok(K::Long)
    }

    pub(super) fn inc_dec(&mut self, i: &IncDec) -> R<K> {
        let delta: i32 = if i.increment { 1 } else { -1 };
        if let ExprKind::Var(name) = &i.target.kind {
            if !self.env.prog.globals.contains_key(name) {
                let (off, k) = *self
                    .locals
                    .get(name)
                    .ok_or_else(|| self.no(format!("the variable {name}")))?;
                if k == K::Str {
                    return Err(self.no("++ on a string"));
                }
                let r = (|| {
                    self.a.mov(rax, qword_ptr(rbp - off))?;
                    self.a.lea(rcx, qword_ptr(rax + delta))?;
                    self.a.mov(qword_ptr(rbp - off), rcx)?;
                    if i.prefix {
                        self.a.mov(rax, rcx)?;
                    }
                    Ok(())
                })();
                asm!(self, r)?;
                return Ok(K::Long);
            }
        }
        let (kind, _) = self.place_of(&i.target)?;
        if kind != ValueKind::Long {
            return Err(self.no("++ on something that is not a number"));
        }
        let r = (|| {
            let mut done = self.a.create_label();
            self.a.test(rax, rax)?;
            self.a.jz(done)?;
            self.a.mov(rcx, rax)?;
            self.a.mov(rax, i64::from(delta))?;
            self.a.lock().xadd(qword_ptr(rcx), rax)?;
            if i.prefix {
                self.a.add(rax, delta)?;
            }
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }
}
