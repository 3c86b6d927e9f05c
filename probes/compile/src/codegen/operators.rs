//! Binary operators with the interpreter's semantics: short-circuit logic, wrapping
//! arithmetic, division and remainder (by zero: a probe error; by -1: no trap), shifts by the
//! count's low 6 bits, comparisons of longs, and of strings (equality, and byte order where
//! the script holds every string inline).

use iced_x86::code_asm::*;

use exotap_lang::ast::*;

use super::{Gen, K, R};

impl Gen<'_, '_> {
    pub(super) fn binary(&mut self, op: BinOp, x: &Expr, y: &Expr) -> R<K> {
        if matches!(op, BinOp::And | BinOp::Or) {
            let mut short = self.a.create_label();
            let mut done = self.a.create_label();
            self.long(x)?;
            asm!(self, self.a.test(rax, rax))?;
            if op == BinOp::And {
                asm!(self, self.a.jz(short))?;
            } else {
                asm!(self, self.a.jnz(short))?;
            }
            self.long(y)?;
            let r = (|| {
                self.a.test(rax, rax)?;
                self.a.setne(al)?;
                self.a.movzx(eax, al)?;
                self.a.jmp(done)?;
                self.a.set_label(&mut short)?;
                self.a.mov(eax, u32::from(op == BinOp::Or))?;
                self.a.set_label(&mut done)?;
                self.a.nop()
            })();
            asm!(self, r)?;
            return Ok(K::Long);
        }
        if op == BinOp::Concat {
            return self.concat(x, y);
        }
        let kx = self.expr(x)?;
        self.push(kx)?;
        let ky = self.expr(y)?;
        if kx != ky {
            return Err(self.no("a comparison of a string with a number"));
        }
        if kx == K::Str {
            if !matches!(op, BinOp::Eq | BinOp::Ne) {
                return self.order_strings(op);
            }
            let r = (|| {
                self.a.mov(r8, rax)?;
                self.a.mov(r9, rdx)?;
                self.a.pop(rax)?;
                self.a.pop(rdx)?;
                self.a.xor(rax, r8)?;
                self.a.xor(rdx, r9)?;
                self.a.or(rax, rdx)?;
                if op == BinOp::Eq {
                    self.a.sete(al)?;
                } else {
                    self.a.setne(al)?;
                }
                self.a.movzx(eax, al)
            })();
            asm!(self, r)?;
            return Ok(K::Long);
        }
        asm!(self, self.a.mov(rcx, rax))?;
        asm!(self, self.a.pop(rax))?;
        self.apply(op)?;
        Ok(K::Long)
    }

    /// `x < y` (and `<=`, `>`, `>=`) of the string pushed (x) and the one in rax/rdx (y):
    /// byte order, as the interpreter's; only where the script holds every string inline.
    fn order_strings(&mut self, op: BinOp) -> R<K> {
        if self.env.layout.strings.is_some() {
            return self.order_texts(op);
        }
        if self.interns_strings() {
            return Err(self.no(
                "ordering strings in a script with strings longer than 15 bytes (the guest \
                 orders only the strings it holds inline)",
            ));
        }
        let r = (|| {
            let mut decided = self.a.create_label();
            self.a.mov(r8, rax)?;
            self.a.mov(r9, rdx)?;
            self.a.pop(rax)?;
            self.a.pop(rdx)?;
            self.a.bswap(rax)?;
            self.a.bswap(r8)?;
            self.a.cmp(rax, r8)?;
            self.a.jne(decided)?;
            self.a.bswap(rdx)?;
            self.a.bswap(r9)?;
            self.a.cmp(rdx, r9)?;
            self.a.set_label(&mut decided)?;
            match op {
                BinOp::Lt => self.a.setb(al)?,
                BinOp::Le => self.a.setbe(al)?,
                BinOp::Gt => self.a.seta(al)?,
                _ => self.a.setae(al)?,
            }
            self.a.movzx(eax, al)
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    /// rax = rax OP rcx (longs).
    pub(super) fn apply(&mut self, op: BinOp) -> R<()> {
        let err_div = self.errors.div;
        let r = (|| {
            match op {
                BinOp::Add => self.a.add(rax, rcx)?,
                BinOp::Sub => self.a.sub(rax, rcx)?,
                BinOp::Mul => self.a.imul_2(rax, rcx)?,
                BinOp::Div | BinOp::Mod => {
                    let mut normal = self.a.create_label();
                    let mut done = self.a.create_label();
                    self.a.test(rcx, rcx)?;
                    self.a.jz(err_div)?;
                    self.a.cmp(rcx, -1)?;
                    self.a.jne(normal)?;
                    if op == BinOp::Div {
                        self.a.neg(rax)?;
                    } else {
                        self.a.xor(eax, eax)?;
                    }
                    self.a.jmp(done)?;
                    self.a.set_label(&mut normal)?;
                    self.a.cqo()?;
                    self.a.idiv(rcx)?;
                    if op == BinOp::Mod {
                        self.a.mov(rax, rdx)?;
                    }
                    self.a.set_label(&mut done)?;
                    self.a.nop()?;
                }
                BinOp::Shl => self.a.shl(rax, cl)?,
                BinOp::Shr => self.a.sar(rax, cl)?,
                BinOp::BitAnd => self.a.and(rax, rcx)?,
                BinOp::BitOr => self.a.or(rax, rcx)?,
                BinOp::BitXor => self.a.xor(rax, rcx)?,
                BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => {
                    self.a.cmp(rax, rcx)?;
                    match op {
                        BinOp::Eq => self.a.sete(al)?,
                        BinOp::Ne => self.a.setne(al)?,
                        BinOp::Lt => self.a.setl(al)?,
                        BinOp::Le => self.a.setle(al)?,
                        BinOp::Gt => self.a.setg(al)?,
                        _ => self.a.setge(al)?,
                    }
                    self.a.movzx(eax, al)?;
                }
                BinOp::And | BinOp::Or | BinOp::Concat => {}
            }
            Ok(())
        })();
        asm!(self, r)
    }
}
