//! Strings searched and taken apart in the guest: `isinstr`, `strpos`, `stringat`,
//! `strtol` and `str_replace`, with the interpreter's semantics (probes/lang/src/eval_call.rs).
//!
//! Each lays its operands' texts into MAXSTRINGLEN buffers on the stack (as the other
//! string operations, see [`super::strings`]), NUL-terminated, and works on the bytes:
//! a naive search (at most MAXSTRINGLEN² byte comparisons, as SystemTap's own `strstr`),
//! C `strtol` digits, a replacement written into a build buffer that stops at
//! MAXSTRINGLEN - 1 bytes, cut back to a character boundary as the interpreter cuts it.
//!
//! `s =~ "pattern"` (and `!~`) walks the subject's bytes through the pattern's matcher, a
//! table the host built and laid in the data ([`super::super::regex`]): one class lookup
//! and one transition per byte, stopping at the absorbing "dead" and "matched" states, the
//! end-of-text flag deciding otherwise.
//!
//! `stringat` past the string and `strtol` with a base outside 2..=36 end the hit with a
//! probe error, counted apart ([`super::super::data::field::ARGUMENTS`]); inside `try`, the
//! handler gets the interpreter's message.

use iced_x86::code_asm::*;

use exotap_lang::ast::*;

use iced_x86::Register;

use super::{Gen, K, R};

/// Where [`Gen::lay_texts`] put the texts of strings pushed on the stack (offsets from rsp
/// once they are laid).
#[derive(Debug, Clone, Copy)]
struct Laid {
    /// Bytes of one text buffer.
    bytes: i32,
    /// How many texts.
    n: i32,
}

impl Laid {
    /// Offset of text `j` (NUL-terminated).
    fn text(&self, j: i32) -> i32 {
        j * self.bytes
    }

    /// Offset of text `j`'s length (8 bytes).
    fn len(&self, j: i32) -> i32 {
        self.n * self.bytes + 8 * j
    }

    /// Bytes the texts and their lengths take on the stack.
    fn total(&self) -> i32 {
        self.n * self.bytes + (8 * self.n + 15) / 16 * 16
    }
}

/// The interpreter's message for `stringat` past the string.
const INDEX_MESSAGE: &str = "string index out of range";

impl Gen<'_, '_> {
    /// Lays the texts of the strings whose encodings are at `at` (offsets from rsp now) into
    /// buffers under them; a text the guest cannot read is a probe error.
    fn lay_texts(&mut self, at: &[i32]) -> R<Laid> {
        let laid = Laid {
            bytes: self.build_bytes(),
            n: at.len() as i32,
        };
        let room = self.build_room();
        let total = laid.total();
        asm!(self, self.a.sub(rsp, total))?;
        asm!(self, self.a.xor(r8d, r8d))?;
        for (j, &off) in at.iter().enumerate() {
            let j = j as i32;
            let r = (|| {
                self.a.lea(rdi, qword_ptr(rsp + laid.text(j)))?;
                self.a.mov(ecx, room)?;
                self.a.mov(rax, qword_ptr(rsp + (total + off)))?;
                self.a.mov(rdx, qword_ptr(rsp + (total + off + 8)))
            })();
            asm!(self, r)?;
            self.append()?;
            let r = (|| {
                self.a.mov(byte_ptr(rdi), 0)?;
                self.a.lea(rax, qword_ptr(rsp + laid.text(j)))?;
                self.a.sub(rdi, rax)?;
                self.a.mov(qword_ptr(rsp + laid.len(j)), rdi)
            })();
            asm!(self, r)?;
        }
        let strings = self.errors.strings;
        let r = (|| {
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(laid)
    }

    /// Evaluates the string `e` and pushes it.
    fn push_string(&mut self, e: &Expr, what: &str) -> R<()> {
        self.string_operand(e, what)?;
        self.push(K::Str)
    }

    /// Evaluates the long `e` and pushes it in 16 bytes (as a string's slot).
    fn push_long16(&mut self, e: &Expr) -> R<()> {
        self.long(e)?;
        let r = (|| {
            self.a.push(rax)?;
            self.a.push(rax)
        })();
        asm!(self, r)
    }

    /// `subject =~ pattern` (`!~` when `negated`): 1 or 0, as the interpreter's
    /// `regex::Regex::is_match` on the subject's text.
    pub(super) fn regex_match(&mut self, subject: &Expr, pattern: &Expr, negated: bool) -> R<K> {
        let ExprKind::Str(pat) = &pattern.kind else {
            return Err(self.no("=~ with a pattern that is not a string literal"));
        };
        let Some((at, m)) = self.env.layout.matchers.get(pat) else {
            let why = match super::super::regex::build(pat) {
                Err(e) => e,
                Ok(_) => "no matcher was laid out for it".to_string(),
            };
            return Err(self.no(format!("=~ {pat:?}: {why}")));
        };
        let base = self.env.data + at;
        let start = u32::from(m.start);
        let stride = m.stride as u32;
        let transitions = m.transitions() as i32;
        self.push_string(subject, "=~")?;
        let laid = self.lay_texts(&[0])?;
        asm!(self, self.a.lea(rsi, qword_ptr(rsp + laid.text(0))))?;
        asm!(self, self.a.mov(rcx, qword_ptr(rsp + laid.len(0))))?;
        self.lea(Register::RDI, base)?;
        let r = (|| {
            let mut top = self.a.create_label();
            let mut end = self.a.create_label();
            let mut stop = self.a.create_label();
            self.a.mov(eax, start)?;
            self.a.set_label(&mut top)?;
            // 0: no match can follow; 1: matched.
            self.a.cmp(eax, 1)?;
            self.a.jbe(stop)?;
            self.a.test(rcx, rcx)?;
            self.a.jz(end)?;
            self.a.movzx(edx, byte_ptr(rsi))?;
            self.a.movzx(edx, byte_ptr(rdi + rdx))?;
            self.a.imul_3(eax, eax, stride)?;
            self.a.add(eax, edx)?;
            self.a.movzx(eax, word_ptr(rdi + rax * 2 + transitions))?;
            self.a.inc(rsi)?;
            self.a.dec(rcx)?;
            self.a.jmp(top)?;
            self.a.set_label(&mut end)?;
            self.a.movzx(eax, byte_ptr(rdi + rax + 256))?;
            self.a.set_label(&mut stop)?;
            self.a.add(rsp, laid.total() + 16)?;
            if negated {
                self.a.xor(eax, 1)?;
            }
            Ok(())
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    /// `strpos(s, t)`: the byte offset of the first `t` in `s` (0 for an empty `t`), or -1;
    /// `isinstr(s, t)`: whether there is one.
    pub(super) fn strpos(&mut self, c: &Call, isinstr: bool) -> R<K> {
        let name = if isinstr { "isinstr()" } else { "strpos()" };
        let [s, t] = c.args.as_slice() else {
            return Err(self.no(format!("{name} without two arguments")));
        };
        self.push_string(s, name)?;
        self.push_string(t, name)?;
        let laid = self.lay_texts(&[16, 0])?;
        let r = (|| {
            let mut top = self.a.create_label();
            let mut found = self.a.create_label();
            let mut missing = self.a.create_label();
            let mut out = self.a.create_label();
            self.a.mov(rcx, qword_ptr(rsp + laid.len(0)))?;
            self.a.mov(r11, qword_ptr(rsp + laid.len(1)))?;
            self.a.xor(r10d, r10d)?;
            self.a.test(r11, r11)?;
            self.a.jz(found)?;
            self.a.cmp(r11, rcx)?;
            self.a.ja(missing)?;
            self.a.mov(r9, rcx)?;
            self.a.sub(r9, r11)?; // the last start
            self.a.set_label(&mut top)?;
            self.a.lea(rsi, qword_ptr(rsp + r10 + laid.text(0)))?;
            self.a.lea(rdi, qword_ptr(rsp + laid.text(1)))?;
            self.a.mov(rcx, r11)?;
            self.a.repe().cmpsb()?;
            self.a.je(found)?;
            self.a.inc(r10)?;
            self.a.cmp(r10, r9)?;
            self.a.jbe(top)?;
            self.a.set_label(&mut missing)?;
            self.a.mov(rax, -1i64)?;
            self.a.jmp(out)?;
            self.a.set_label(&mut found)?;
            self.a.mov(rax, r10)?;
            self.a.set_label(&mut out)?;
            self.a.add(rsp, laid.total() + 32)?;
            if isinstr {
                // -1 → 0, an offset → 1.
                self.a.not(rax)?;
                self.a.shr(rax, 63)?;
            }
            Ok(())
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }

    /// `stringat(s, i)`: the byte at `i`; an index outside the string is a probe error.
    pub(super) fn stringat(&mut self, c: &Call) -> R<K> {
        let [s, i] = c.args.as_slice() else {
            return Err(self.no("stringat() without two arguments"));
        };
        self.push_string(s, "stringat()")?;
        self.push_long16(i)?;
        let laid = self.lay_texts(&[16])?;
        let mut outside = self.a.create_label();
        let mut done = self.a.create_label();
        let r = (|| {
            self.a.mov(rax, qword_ptr(rsp + laid.total()))?;
            // Unsigned: a negative index is past the end too.
            self.a.cmp(rax, qword_ptr(rsp + laid.len(0)))?;
            self.a.jae(outside)?;
            self.a.movzx(eax, byte_ptr(rsp + rax + laid.text(0)))?;
            self.a.add(rsp, laid.total() + 32)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut outside)
        })();
        asm!(self, r)?;
        self.string_const(INDEX_MESSAGE)?;
        let argument = self.errors.argument;
        asm!(self, self.a.jmp(argument))?;
        self.place(&mut done)?;
        Ok(K::Long)
    }

    /// `strtol(s, base)`: leading white space, a sign, `0x`/`0X` when the base is 16, then
    /// the digits of the base (either case) up to the first other byte, wrapping; a base
    /// outside 2..=36 is a probe error.
    pub(super) fn strtol(&mut self, c: &Call) -> R<K> {
        let [s, base] = c.args.as_slice() else {
            return Err(self.no("strtol() without two arguments"));
        };
        self.push_string(s, "strtol()")?;
        self.push_long16(base)?;
        let laid = self.lay_texts(&[16])?;
        let known = match base.kind {
            ExprKind::Num(n) => Some(n),
            _ => None,
        };
        let total = laid.total();
        let mut bad = self.a.create_label();
        let mut done = self.a.create_label();
        let r = (|| {
            let mut space = self.a.create_label();
            let mut skip = self.a.create_label();
            let mut sign = self.a.create_label();
            let mut plus = self.a.create_label();
            let mut digits = self.a.create_label();
            let mut next = self.a.create_label();
            let mut have = self.a.create_label();
            let mut end = self.a.create_label();
            let mut positive = self.a.create_label();
            self.a.mov(r9, qword_ptr(rsp + total))?;
            if !known.is_some_and(|b| (2..=36).contains(&b)) {
                self.a.lea(rax, qword_ptr(r9 - 2))?;
                self.a.cmp(rax, 34)?;
                self.a.ja(bad)?;
            }
            self.a.lea(rsi, qword_ptr(rsp + laid.text(0)))?;
            // White space as Rust's trim_start sees it: \t \n \v \f \r ' ', and in UTF-8
            // U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F and
            // U+3000 (a byte is read past the first only when the one before is no NUL).
            let mut skip2 = self.a.create_label();
            let mut skip3 = self.a.create_label();
            let mut wide = self.a.create_label();
            let mut e1 = self.a.create_label();
            let mut e2 = self.a.create_label();
            let mut e2_81 = self.a.create_label();
            let mut e3 = self.a.create_label();
            self.a.set_label(&mut space)?;
            self.a.movzx(eax, byte_ptr(rsi))?;
            self.a.cmp(al, b' ' as u32)?;
            self.a.je(skip)?;
            self.a.cmp(al, 9)?;
            self.a.jb(wide)?;
            self.a.cmp(al, 13)?;
            self.a.jbe(skip)?;
            self.a.set_label(&mut wide)?;
            self.a.cmp(al, 0xc2)?;
            self.a.jne(e1)?;
            self.a.movzx(edx, byte_ptr(rsi + 1))?;
            self.a.cmp(dl, 0x85)?;
            self.a.je(skip2)?;
            self.a.cmp(dl, 0xa0)?;
            self.a.je(skip2)?;
            self.a.jmp(sign)?;
            self.a.set_label(&mut e1)?;
            self.a.cmp(al, 0xe1)?;
            self.a.jne(e2)?;
            self.a.cmp(byte_ptr(rsi + 1), 0x9a)?;
            self.a.jne(sign)?;
            self.a.cmp(byte_ptr(rsi + 2), 0x80)?;
            self.a.je(skip3)?;
            self.a.jmp(sign)?;
            self.a.set_label(&mut e2)?;
            self.a.cmp(al, 0xe2)?;
            self.a.jne(e3)?;
            self.a.movzx(edx, byte_ptr(rsi + 1))?;
            self.a.cmp(dl, 0x80)?;
            self.a.jne(e2_81)?;
            self.a.movzx(edx, byte_ptr(rsi + 2))?;
            self.a.lea(ecx, dword_ptr(rdx - 0x80))?;
            self.a.cmp(ecx, 0x0a)?;
            self.a.jbe(skip3)?;
            for b in [0xa8u32, 0xa9, 0xaf] {
                self.a.cmp(dl, b)?;
                self.a.je(skip3)?;
            }
            self.a.jmp(sign)?;
            self.a.set_label(&mut e2_81)?;
            self.a.cmp(dl, 0x81)?;
            self.a.jne(sign)?;
            self.a.cmp(byte_ptr(rsi + 2), 0x9f)?;
            self.a.je(skip3)?;
            self.a.jmp(sign)?;
            self.a.set_label(&mut e3)?;
            self.a.cmp(al, 0xe3)?;
            self.a.jne(sign)?;
            self.a.cmp(byte_ptr(rsi + 1), 0x80)?;
            self.a.jne(sign)?;
            self.a.cmp(byte_ptr(rsi + 2), 0x80)?;
            self.a.jne(sign)?;
            self.a.set_label(&mut skip3)?;
            self.a.inc(rsi)?;
            self.a.set_label(&mut skip2)?;
            self.a.inc(rsi)?;
            self.a.set_label(&mut skip)?;
            self.a.inc(rsi)?;
            self.a.jmp(space)?;
            self.a.set_label(&mut sign)?;
            self.a.xor(r11d, r11d)?;
            self.a.cmp(al, b'-' as u32)?;
            self.a.jne(plus)?;
            self.a.mov(r11d, 1)?;
            self.a.inc(rsi)?;
            self.a.jmp(digits)?;
            self.a.set_label(&mut plus)?;
            self.a.cmp(al, b'+' as u32)?;
            self.a.jne(digits)?;
            self.a.inc(rsi)?;
            self.a.set_label(&mut digits)?;
            if known.is_none_or(|b| b == 16) {
                let mut prefixless = self.a.create_label();
                self.a.cmp(r9, 16)?;
                self.a.jne(prefixless)?;
                self.a.cmp(byte_ptr(rsi), b'0' as u32)?;
                self.a.jne(prefixless)?;
                self.a.movzx(eax, byte_ptr(rsi + 1))?;
                self.a.or(al, 0x20)?; // 'X' → 'x' (no other byte becomes 'x')
                self.a.cmp(al, b'x' as u32)?;
                self.a.jne(prefixless)?;
                self.a.add(rsi, 2)?;
                self.a.set_label(&mut prefixless)?;
            }
            self.a.xor(eax, eax)?;
            self.a.set_label(&mut next)?;
            self.a.movzx(edx, byte_ptr(rsi))?;
            self.a.lea(ecx, dword_ptr(rdx - b'0' as i32))?;
            self.a.cmp(ecx, 9)?;
            self.a.jbe(have)?;
            self.a.mov(ecx, edx)?;
            self.a.or(ecx, 0x20)?; // 'A'..'Z' → 'a'..'z'
            self.a.sub(ecx, b'a' as i32)?;
            self.a.cmp(ecx, 25)?;
            self.a.ja(end)?;
            self.a.add(ecx, 10)?;
            self.a.set_label(&mut have)?;
            self.a.cmp(rcx, r9)?;
            self.a.jae(end)?;
            self.a.imul_2(rax, r9)?;
            self.a.add(rax, rcx)?;
            self.a.inc(rsi)?;
            self.a.jmp(next)?;
            self.a.set_label(&mut end)?;
            self.a.test(r11, r11)?;
            self.a.jz(positive)?;
            self.a.neg(rax)?;
            self.a.set_label(&mut positive)?;
            self.a.add(rsp, total + 32)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut bad)
        })();
        asm!(self, r)?;
        // "strtol: base {base} is not between 2 and 36", as the interpreter says it.
        match known {
            Some(b) => {
                self.string_const(&format!("strtol: base {b} is not between 2 and 36"))?;
            }
            None => {
                self.string_const("strtol: base ")?;
                self.push(K::Str)?;
                asm!(self, self.a.mov(rax, qword_ptr(rsp + total + 16)))?;
                self.decimal()?;
                self.concat_pushed()?;
                self.push(K::Str)?;
                self.string_const(" is not between 2 and 36")?;
                self.concat_pushed()?;
            }
        }
        let argument = self.errors.argument;
        asm!(self, self.a.jmp(argument))?;
        self.place(&mut done)?;
        Ok(K::Long)
    }

    /// `str_replace(s, old, new)`: every `old` in `s`, left to right without overlaps,
    /// replaced by `new` (`s` itself when `old` is empty), cut at MAXSTRINGLEN - 1 bytes.
    pub(super) fn str_replace(&mut self, c: &Call) -> R<K> {
        let [s, old, new] = c.args.as_slice() else {
            return Err(self.no("str_replace() without three arguments"));
        };
        self.push_string(s, "str_replace()")?;
        self.push_string(old, "str_replace()")?;
        self.push_string(new, "str_replace()")?;
        let laid = self.lay_texts(&[32, 16])?;
        let total = laid.total();
        let mut replace = self.a.create_label();
        let mut done = self.a.create_label();
        let r = (|| {
            // An empty `old`: `s` as it is.
            self.a.cmp(qword_ptr(rsp + laid.len(1)), 0)?;
            self.a.jne(replace)?;
            self.a.mov(rax, qword_ptr(rsp + total + 32))?;
            self.a.mov(rdx, qword_ptr(rsp + total + 40))?;
            self.a.add(rsp, total + 48)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut replace)
        })();
        asm!(self, r)?;
        self.open_cut_buffer()?;
        let x = self.build_bytes();
        let mut top = self.a.create_label();
        let mut literal = self.a.create_label();
        let mut tail = self.a.create_label();
        let mut finish = self.a.create_label();
        let r = (|| {
            self.a.xor(r11d, r11d)?; // the offset in s
            self.a.set_label(&mut top)?;
            self.a.test(rcx, rcx)?;
            self.a.jz(finish)?;
            self.a.mov(rax, qword_ptr(rsp + x + laid.len(0)))?;
            self.a.sub(rax, r11)?; // bytes of s left
            self.a.cmp(rax, qword_ptr(rsp + x + laid.len(1)))?;
            self.a.jb(tail)?;
            self.a.push(rcx)?;
            self.a.push(rdi)?;
            self.a
                .lea(rsi, qword_ptr(rsp + r11 + (16 + x + laid.text(0))))?;
            self.a.lea(rdi, qword_ptr(rsp + 16 + x + laid.text(1)))?;
            self.a.mov(rcx, qword_ptr(rsp + 16 + x + laid.len(1)))?;
            self.a.repe().cmpsb()?;
            self.a.pop(rdi)?;
            self.a.pop(rcx)?;
            self.a.jne(literal)?;
            self.a.mov(rax, qword_ptr(rsp + x + total))?;
            self.a.mov(rdx, qword_ptr(rsp + x + total + 8))
        })();
        asm!(self, r)?;
        // `new` (r11 survives the helper).
        self.append()?;
        let r = (|| {
            self.a.add(r11, qword_ptr(rsp + x + laid.len(1)))?;
            self.a.jmp(top)?;
            self.a.set_label(&mut literal)?;
            self.a.mov(al, byte_ptr(rsp + r11 + (x + laid.text(0))))?;
            self.a.mov(byte_ptr(rdi), al)?;
            self.a.inc(rdi)?;
            self.a.dec(rcx)?;
            self.a.inc(r11)?;
            self.a.jmp(top)?;
            // Fewer bytes left than `old` has: the rest of s, as far as there is room.
            self.a.set_label(&mut tail)?;
            let mut fits = self.a.create_label();
            self.a.lea(rsi, qword_ptr(rsp + r11 + (x + laid.text(0))))?;
            self.a.mov(rdx, rax)?;
            self.a.cmp(rdx, rcx)?;
            self.a.jbe(fits)?;
            self.a.mov(rdx, rcx)?;
            self.a.set_label(&mut fits)?;
            self.a.sub(rcx, rdx)?;
            self.a.xchg(rcx, rdx)?;
            self.a.rep().movsb()?;
            self.a.mov(rcx, rdx)?;
            self.a.set_label(&mut finish)
        })();
        asm!(self, r)?;
        self.cut_at_character()?;
        self.close_buffer(total + 48)?;
        self.place(&mut done)?;
        Ok(K::Str)
    }

    /// Opens a build buffer at rsp as [`Gen::open_buffer`] does, with room for one byte more
    /// than a string holds: [`Gen::cut_at_character`] then cuts where the interpreter does.
    pub(super) fn open_cut_buffer(&mut self) -> R<()> {
        self.open_buffer()?;
        asm!(self, self.a.inc(ecx))
    }

    /// Cuts the text built from rsp to rdi (in a buffer from [`Gen::open_cut_buffer`]) to
    /// MAXSTRINGLEN - 1 bytes at a character boundary, as the interpreter's `truncate`.
    pub(super) fn cut_at_character(&mut self) -> R<()> {
        let most = self.build_room();
        let r = (|| {
            let mut short = self.a.create_label();
            let mut back = self.a.create_label();
            let mut cut = self.a.create_label();
            self.a.mov(rax, rdi)?;
            self.a.sub(rax, rsp)?;
            self.a.cmp(rax, most as i32)?;
            self.a.jbe(short)?;
            self.a.mov(eax, most)?;
            self.a.set_label(&mut back)?;
            self.a.test(rax, rax)?;
            self.a.jz(cut)?;
            self.a.movzx(edx, byte_ptr(rsp + rax))?;
            self.a.and(edx, 0xc0)?;
            self.a.cmp(edx, 0x80)?; // a continuation byte: not a boundary
            self.a.jne(cut)?;
            self.a.dec(rax)?;
            self.a.jmp(back)?;
            self.a.set_label(&mut cut)?;
            self.a.lea(rdi, qword_ptr(rsp + rax))?;
            self.a.set_label(&mut short)?;
            self.a.nop()
        })();
        asm!(self, r)
    }
}
