//! Aggregates: `<<<` into statistics (count, sum, min, max, histogram buckets and the
//! running variance) and the values read from them (`@count`, `@sum`, `@min`, `@max`,
//! `@avg`, `@variance`).

use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, Register};

use exotap_lang::ast::*;

use super::super::data::{field, ValueKind};
use super::{rip, Gen, K, R};

/// Spins on a held variance lock before the step is dropped.
const SPINS: u32 = 1000;

impl Gen<'_, '_> {
    /// `@count(x)`, `@sum`, `@min`, `@max`, `@avg` of an aggregate as the interpreter gives
    /// them: @count of an empty (or absent) one is 0, the others end the hit with a probe
    /// error; @avg is the sum divided by the count, truncated.
    pub(super) fn stat(&mut self, op: StatOp, target: &Expr) -> R<K> {
        match &target.kind {
            ExprKind::Var(name) if self.env.prog.globals.contains_key(name) => {
                let slot = self
                    .global(name)
                    .cloned()
                    .ok_or_else(|| self.no(format!("the global {name}")))?;
                if !matches!(slot.value, ValueKind::Stats(_)) || slot.table.is_some() {
                    return Err(self.no(format!("{} of {name}", op.name())));
                }
                self.lea(Register::RAX, self.env.data + slot.offset)?;
            }
            ExprKind::Index(ix) => {
                let slot = self.array(&ix.array.name)?;
                if !matches!(slot.value, ValueKind::Stats(_)) {
                    return Err(self.no(format!("{} of {}", op.name(), ix.array.name)));
                }
                self.lookup(&ix.array.name, &ix.keys, false)?;
            }
            _ => return Err(self.no(format!("{} of this", op.name()))),
        }
        let empty = self.errors.empty;
        let r = (|| {
            let mut absent = self.a.create_label();
            let mut done = self.a.create_label();
            self.a.test(rax, rax)?;
            self.a.jz(absent)?;
            self.a.mov(rcx, qword_ptr(rax))?;
            // As SystemTap (and the interpreter): an empty aggregate counts and sums to 0;
            // its @min/@max/@avg are errors.
            if op == StatOp::Sum {
                self.a.test(rcx, rcx)?;
                self.a.jz(absent)?;
            } else if op != StatOp::Count {
                self.a.test(rcx, rcx)?;
                self.a.jz(empty)?;
            }
            match op {
                StatOp::Count => self.a.mov(rax, rcx)?,
                StatOp::Sum => self.a.mov(rax, qword_ptr(rax + 8))?,
                StatOp::Min => self.a.mov(rax, qword_ptr(rax + 16))?,
                StatOp::Max => self.a.mov(rax, qword_ptr(rax + 24))?,
                StatOp::Avg => {
                    // i64 wrapping division: the count is positive, so only -1 is odd.
                    let mut normal = self.a.create_label();
                    self.a.mov(rax, qword_ptr(rax + 8))?;
                    self.a.cmp(rcx, -1)?;
                    self.a.jne(normal)?;
                    self.a.neg(rax)?;
                    self.a.jmp(done)?;
                    self.a.set_label(&mut normal)?;
                    self.a.cqo()?;
                    self.a.idiv(rcx)?;
                }
            }
            self.a.jmp(done)?;
            self.a.set_label(&mut absent)?;
            if matches!(op, StatOp::Count | StatOp::Sum) {
                self.a.xor(eax, eax)?;
            } else {
                self.a.jmp(empty)?;
            }
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    pub(super) fn aggregate(&mut self, target: &Expr, value: &Expr) -> R<K> {
        self.long(value)?;
        asm!(self, self.a.push(rax))?;
        let (kind, _) = self.place_of(target)?;
        let ValueKind::Stats(layout) = kind else {
            return Err(self.no("<<< into something that is not an aggregate"));
        };
        let r = (|| {
            let mut skip = self.a.create_label();
            let mut min_loop = self.a.create_label();
            let mut min_done = self.a.create_label();
            let mut max_loop = self.a.create_label();
            let mut max_done = self.a.create_label();
            self.a.mov(rdi, rax)?;
            self.a.pop(rsi)?;
            self.a.test(rdi, rdi)?;
            self.a.jz(skip)?;
            self.a.lock().inc(qword_ptr(rdi))?;
            self.a.lock().add(qword_ptr(rdi + 8), rsi)?;
            // min and max: compare-and-swap, a bounded number of tries.
            self.a.mov(r8d, 64)?;
            self.a.set_label(&mut min_loop)?;
            self.a.mov(rax, qword_ptr(rdi + 16))?;
            self.a.cmp(rsi, rax)?;
            self.a.jge(min_done)?;
            self.a.lock().cmpxchg(qword_ptr(rdi + 16), rsi)?;
            self.a.je(min_done)?;
            self.a.dec(r8d)?;
            self.a.jnz(min_loop)?;
            self.a.set_label(&mut min_done)?;
            self.a.mov(r8d, 64)?;
            self.a.set_label(&mut max_loop)?;
            self.a.mov(rax, qword_ptr(rdi + 24))?;
            self.a.cmp(rsi, rax)?;
            self.a.jle(max_done)?;
            self.a.lock().cmpxchg(qword_ptr(rdi + 24), rsi)?;
            self.a.je(max_done)?;
            self.a.dec(r8d)?;
            self.a.jnz(max_loop)?;
            self.a.set_label(&mut max_done)?;
            self.a.nop()?;
            if layout.log {
                // bucket = 64 for 0, 64 + bits(v) for v > 0, 64 - bits(|v|) for v < 0
                let mut nz = self.a.create_label();
                let mut neg = self.a.create_label();
                let mut have = self.a.create_label();
                let mut capped = self.a.create_label();
                self.a.mov(ecx, 64)?;
                self.a.test(rsi, rsi)?;
                self.a.jnz(nz)?;
                self.a.jmp(have)?;
                self.a.set_label(&mut nz)?;
                self.a.mov(rax, rsi)?;
                self.a.neg(rax)?;
                self.a.cmovl(rax, rsi)?; // |v| (i64::MIN stays itself: 64 bits)
                self.a.bsr(rcx, rax)?;
                self.a.inc(ecx)?;
                self.a.test(rsi, rsi)?;
                self.a.js(neg)?;
                self.a.add(ecx, 64)?;
                self.a.cmp(ecx, 127)?;
                self.a.jbe(capped)?;
                self.a.mov(ecx, 127)?;
                self.a.set_label(&mut capped)?;
                self.a.jmp(have)?;
                self.a.set_label(&mut neg)?;
                self.a.mov(eax, 64)?;
                self.a.sub(eax, ecx)?;
                self.a.mov(ecx, eax)?;
                self.a.set_label(&mut have)?;
                self.a
                    .lock()
                    .inc(qword_ptr(rdi + rcx * 8 + layout.log_offset() as i32))?;
            }
            if let Some((start, _, interval, n)) = layout.linear {
                let mut under = self.a.create_label();
                let mut have = self.a.create_label();
                let mut capped = self.a.create_label();
                self.a.mov(rax, rsi)?;
                self.a.mov(rcx, start)?;
                self.a.cmp(rax, rcx)?;
                self.a.jl(under)?;
                self.a.sub(rax, rcx)?;
                self.a.xor(edx, edx)?;
                self.a.mov(rcx, interval)?;
                self.a.div(rcx)?;
                self.a.inc(rax)?;
                self.a.cmp(rax, (n - 1) as i32)?;
                self.a.jbe(capped)?;
                self.a.mov(eax, (n - 1) as u32)?;
                self.a.set_label(&mut capped)?;
                self.a.jmp(have)?;
                self.a.set_label(&mut under)?;
                self.a.xor(eax, eax)?;
                self.a.set_label(&mut have)?;
                self.a
                    .lock()
                    .inc(qword_ptr(rdi + rax * 8 + layout.linear_offset() as i32))?;
            }
            if let Some(shift) = layout.variance {
                self.welford_step(layout.variance_offset() as i32, shift)?;
            }
            self.a.set_label(&mut skip)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    /// The running variance's step for the value in rsi of the statistics at rdi, as the
    /// interpreter's `Stats::add` takes it, under the state's lock word; a lock held past
    /// the spin budget drops the step and counts a dropped update.
    fn welford_step(&mut self, at: i32, shift: u32) -> Result<(), IcedError> {
        let dropped = self.env.data + field::DROPPED;
        let mut spin = self.a.create_label();
        let mut locked = self.a.create_label();
        let mut step = self.a.create_label();
        let mut unlock = self.a.create_label();
        let mut done = self.a.create_label();
        self.a.lea(r9, qword_ptr(rdi + at))?;
        self.a.mov(r8d, SPINS)?;
        self.a.set_label(&mut spin)?;
        self.a.xor(eax, eax)?;
        self.a.mov(ecx, 1)?;
        self.a.lock().cmpxchg(qword_ptr(r9), rcx)?;
        self.a.je(locked)?;
        self.a.pause()?;
        self.a.dec(r8d)?;
        self.a.jnz(spin)?;
        let mut inc = Instruction::with1(Code::Inc_rm64, rip(dropped))?;
        inc.set_has_lock_prefix(true);
        self.a.add_instruction(inc)?;
        self.a.jmp(done)?;
        self.a.set_label(&mut locked)?;
        self.a.mov(rax, rsi)?;
        let shift = shift % 64;
        if shift != 0 {
            self.a.shl(rax, shift)?;
        }
        self.a.mov(rcx, qword_ptr(r9 + 8))?;
        self.a.inc(rcx)?;
        self.a.mov(qword_ptr(r9 + 8), rcx)?;
        self.a.cmp(rcx, 1)?;
        self.a.jne(step)?;
        self.a.mov(qword_ptr(r9 + 16), rax)?;
        self.a.mov(qword_ptr(r9 + 24), 0)?;
        self.a.jmp(unlock)?;
        self.a.set_label(&mut step)?;
        // delta = scaled - avg; avg += delta / n; m2 += delta * (scaled - avg)
        self.a.mov(r10, rax)?;
        self.a.sub(rax, qword_ptr(r9 + 16))?;
        self.a.mov(r11, rax)?;
        self.a.cqo()?;
        self.a.idiv(rcx)?;
        self.a.add(rax, qword_ptr(r9 + 16))?;
        self.a.mov(qword_ptr(r9 + 16), rax)?;
        self.a.mov(rdx, r10)?;
        self.a.sub(rdx, rax)?;
        self.a.imul_2(rdx, r11)?;
        self.a.add(qword_ptr(r9 + 24), rdx)?;
        self.a.set_label(&mut unlock)?;
        self.a.mov(qword_ptr(r9), 0)?;
        self.a.set_label(&mut done)?;
        self.a.nop()
    }

    /// `@variance(x)` as the interpreter's `Stats::variance` gives it: an empty (or absent)
    /// aggregate ends the hit with a probe error, one value gives 0.
    pub(super) fn variance(&mut self, target: &Expr) -> R<K> {
        let layout = match &target.kind {
            ExprKind::Var(name) if self.env.prog.globals.contains_key(name) => {
                let slot = self
                    .global(name)
                    .cloned()
                    .ok_or_else(|| self.no(format!("the global {name}")))?;
                self.lea(Register::RAX, self.env.data + slot.offset)?;
                match slot.value {
                    ValueKind::Stats(l) if slot.table.is_none() => l,
                    _ => return Err(self.no(format!("@variance of {name}"))),
                }
            }
            ExprKind::Index(ix) => {
                let slot = self.array(&ix.array.name)?;
                let ValueKind::Stats(l) = slot.value else {
                    return Err(self.no(format!("@variance of {}", ix.array.name)));
                };
                self.lookup(&ix.array.name, &ix.keys, false)?;
                l
            }
            _ => return Err(self.no("@variance of this")),
        };
        let Some(shift) = layout.variance else {
            return Err(self.no("@variance of an aggregate without variance state"));
        };
        let at = layout.variance_offset() as i32;
        let shift = shift % 64;
        let empty = self.errors.empty;
        let r = (|| {
            let mut zero = self.a.create_label();
            let mut done = self.a.create_label();
            self.a.test(rax, rax)?;
            self.a.jz(empty)?;
            self.a.mov(rcx, qword_ptr(rax))?;
            self.a.test(rcx, rcx)?;
            self.a.jz(empty)?;
            self.a.cmp(rcx, 2)?;
            self.a.jl(zero)?;
            self.a.mov(r8, rax)?;
            // avg = (sum << shift) / count; d = avg_s - avg
            self.a.mov(rax, qword_ptr(r8 + 8))?;
            if shift != 0 {
                self.a.shl(rax, shift)?;
            }
            self.a.cqo()?;
            self.a.idiv(rcx)?;
            self.a.mov(r9, qword_ptr(r8 + at + 16))?;
            self.a.sub(r9, rax)?;
            // (m2 + count * d * d) / (count - 1) >> 2 * shift
            self.a.imul_2(r9, r9)?;
            self.a.imul_2(r9, rcx)?;
            self.a.add(r9, qword_ptr(r8 + at + 24))?;
            self.a.mov(rax, r9)?;
            self.a.dec(rcx)?;
            self.a.cqo()?;
            self.a.idiv(rcx)?;
            if shift != 0 {
                self.a.sar(rax, (2 * shift).min(63))?;
            }
            self.a.jmp(done)?;
            self.a.set_label(&mut zero)?;
            self.a.xor(eax, eax)?;
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }
}
