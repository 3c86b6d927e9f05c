//! `sprintf` formatted in the guest, with the interpreter's rendering
//! (probes/lang/src/format.rs `render`): `%d %i %u %x %X %o %c %s %p` and `%%`, the flags
//! `- 0 + space #`, widths and precisions, fixed or taken from an argument (`*`).
//!
//! The format must be a literal: it is parsed here, and each piece becomes code that
//! writes into a build buffer ([`super::strings`]) which stops at MAXSTRINGLEN - 1 bytes
//! (cut back to a character boundary, as the interpreter cuts its strings). Widths and the
//! text of `%s` count characters, not bytes, as the interpreter does. A conversion's body
//! (its digits, the text of `%s`, the bytes of `%c`) is laid out first, then written with
//! its prefix, zeros and fill in the order its flags say.

use iced_x86::code_asm::*;

use exotap_lang::ast::*;
use exotap_lang::format::{
    arg_kinds, parse_format, ArgKind, Conv, Piece, Spec, Width, MAX_FIELD_WIDTH,
};
use exotap_lang::value::truncate;

use super::{Gen, K, R};

/// Bytes of the digits area (the octal digits of a u64 and more).
const DIGITS: i32 = 32;
/// Bytes of the conversion's variables.
const VARS: i32 = 64;
/// The variables' offsets in their area.
const FILL: i32 = 0;
const ZEROS: i32 = 8;
const LEFT: i32 = 16;
const SIGN: i32 = 24;
const BODY: i32 = 32;
const BODY_LEN: i32 = 40;

/// What a conversion writes, in order.
#[derive(Debug, Clone, Copy)]
enum Part {
    /// The fill (FILL of them) of this byte.
    Fill(u8),
    /// The precision's zeros (ZEROS of them).
    Zeros,
    /// The prefix: fixed bytes, and the sign byte (SIGN, when not 0) for `%d`.
    Prefix,
    /// The body (BODY_LEN bytes at BODY).
    Body,
}

/// Where the areas lie, as offsets from rsp once the output buffer is open.
#[derive(Debug, Clone, Copy)]
struct Areas {
    /// The text of a `%s` argument.
    text: i32,
    /// The digits.
    digits: i32,
    /// The variables.
    vars: i32,
    /// The first argument (the others below it, 16 bytes each).
    args: i32,
    /// How many arguments.
    n: i32,
}

impl Areas {
    fn arg(&self, i: usize) -> i32 {
        self.args + (self.n - 1 - i as i32) * 16
    }

    fn var(&self, v: i32) -> i32 {
        self.vars + v
    }
}

impl Gen<'_, '_> {
    /// `sprintf(fmt, ...)` with a literal format.
    pub(super) fn sprintf(&mut self, c: &Call) -> R<K> {
        let fmt = match c.args.first().map(|a| &a.kind) {
            Some(ExprKind::Str(s)) => s.clone(),
            _ => return Err(self.no("sprintf with a format that is not a literal")),
        };
        // The interpreter holds the literal cut at MAXSTRINGLEN, as every string.
        let fmt = truncate(fmt, self.env.limits.max_string_len);
        let pieces = parse_format(&fmt).map_err(|e| {
            self.no(format!(
                "sprintf with a format that is bad as MAXSTRINGLEN cuts it ({e}: a probe \
                 error at every hit)"
            ))
        })?;
        let values = &c.args[1..];
        let kinds = arg_kinds(&pieces);
        if kinds.len() > values.len() {
            return Err(self.no(format!(
                "sprintf with {} arguments for a format that takes {}",
                values.len(),
                kinds.len()
            )));
        }
        // Arguments past the conversions (a format MAXSTRINGLEN cut) are evaluated, unused.
        for (i, v) in values.iter().enumerate() {
            let k = self.expr(v)?;
            match (k, kinds.get(i)) {
                (_, None) => {}
                (K::Long, Some(ArgKind::Long)) => {
                    asm!(self, self.a.push(rax))?;
                    asm!(self, self.a.push(rax))?;
                }
                (K::Str, Some(ArgKind::Str)) => self.push(K::Str)?,
                _ => {
                    return Err(
                        self.no("sprintf with an argument of another type than its conversion")
                    )
                }
            }
        }
        let bytes = self.build_bytes();
        asm!(self, self.a.sub(rsp, bytes + DIGITS + VARS))?;
        self.open_cut_buffer()?;
        let areas = Areas {
            text: bytes,
            digits: 2 * bytes,
            vars: 2 * bytes + DIGITS,
            args: 2 * bytes + DIGITS + VARS,
            n: kinds.len() as i32,
        };
        let mut next = 0usize;
        for p in &pieces {
            match p {
                Piece::Lit(s) => self.put_literal(s.as_bytes())?,
                Piece::Conv(spec) => self.conversion(spec, &areas, &mut next)?,
            }
        }
        self.cut_at_character()?;
        self.close_buffer(bytes + DIGITS + VARS + 16 * areas.n)
    }

    /// Copies rdx bytes from rsi to the output (rdi, room rcx), as many as there is room for.
    fn put_copy(&mut self) -> R<()> {
        self.put_bounded(true)
    }

    /// Writes rdx bytes of al to the output, as many as there is room for.
    fn put_fill(&mut self) -> R<()> {
        self.put_bounded(false)
    }

    /// rdx bytes to the output (rdi, room rcx), cut to the room: copied from rsi
    /// (`rep movsb`) or filled with al (`rep stosb`).
    fn put_bounded(&mut self, copy: bool) -> R<()> {
        let r = (|| {
            let mut fits = self.a.create_label();
            self.a.cmp(rdx, rcx)?;
            self.a.jbe(fits)?;
            self.a.mov(rdx, rcx)?;
            self.a.set_label(&mut fits)?;
            self.a.sub(rcx, rdx)?;
            self.a.xchg(rcx, rdx)?;
            if copy {
                self.a.rep().movsb()?;
            } else {
                self.a.rep().stosb()?;
            }
            self.a.mov(rcx, rdx)
        })();
        asm!(self, r)
    }

    /// Writes `text` to the output.
    fn put_literal(&mut self, text: &[u8]) -> R<()> {
        if text.is_empty() {
            return Ok(());
        }
        let r = (|| {
            let mut data = self.a.create_label();
            let mut over = self.a.create_label();
            self.a.jmp(over)?;
            self.a.set_label(&mut data)?;
            self.a.db(text)?;
            self.a.set_label(&mut over)?;
            self.a.lea(rsi, qword_ptr(data))?;
            self.a.mov(edx, text.len() as u32)
        })();
        asm!(self, r)?;
        self.put_copy()
    }

    /// A width or precision into rax: fixed, or the next argument (clamped as `render`
    /// clamps it; a negative `*` width sets LEFT).
    fn field(&mut self, w: Option<Width>, areas: &Areas, next: &mut usize, width: bool) -> R<bool> {
        match w {
            None => {
                asm!(self, self.a.xor(eax, eax))?;
                Ok(false)
            }
            Some(Width::Fixed(n)) => {
                asm!(self, self.a.mov(eax, n.min(MAX_FIELD_WIDTH) as u32))?;
                Ok(true)
            }
            Some(Width::Arg) => {
                let at = areas.arg(*next);
                *next += 1;
                let left = areas.var(LEFT);
                let r = (|| {
                    let mut positive = self.a.create_label();
                    let mut small = self.a.create_label();
                    self.a.mov(rax, qword_ptr(rsp + at))?;
                    self.a.test(rax, rax)?;
                    self.a.jns(positive)?;
                    if width {
                        self.a.mov(qword_ptr(rsp + left), 1)?;
                        self.a.neg(rax)?; // i64::MIN stays 2^63 as unsigned: clamped below
                    } else {
                        self.a.xor(eax, eax)?;
                    }
                    self.a.set_label(&mut positive)?;
                    self.a.cmp(rax, MAX_FIELD_WIDTH as i32)?;
                    self.a.jbe(small)?;
                    self.a.mov(eax, MAX_FIELD_WIDTH as u32)?;
                    self.a.set_label(&mut small)?;
                    self.a.nop()
                })();
                asm!(self, r)?;
                Ok(true)
            }
        }
    }

    /// One conversion.
    fn conversion(&mut self, spec: &Spec, areas: &Areas, next: &mut usize) -> R<()> {
        let conv = spec
            .conv
            .ok_or_else(|| self.no("sprintf with a conversion without its character"))?;
        let vars = areas.vars;
        // LEFT from the flag (a negative `*` width sets it too), SIGN cleared.
        let r = (|| {
            self.a
                .mov(qword_ptr(rsp + vars + LEFT), i32::from(spec.left))?;
            self.a.mov(qword_ptr(rsp + vars + SIGN), 0)
        })();
        asm!(self, r)?;
        self.field(spec.width, areas, next, true)?;
        asm!(self, self.a.mov(qword_ptr(rsp + vars + FILL), rax))?;
        let has_precision = self.field(spec.precision, areas, next, false)?;
        let precision = spec.precision.is_some() && has_precision;
        asm!(self, self.a.mov(qword_ptr(rsp + vars + ZEROS), rax))?;
        let arg = areas.arg(*next);
        *next += 1;
        // The body, its length in characters in r11, and the prefix's fixed bytes.
        let (prefix, numeric): (&[u8], bool) = match conv {
            Conv::Str => {
                self.text_body(arg, areas, precision)?;
                (b"", false)
            }
            Conv::Char => {
                self.char_body(arg, areas)?;
                (b"", false)
            }
            Conv::Signed | Conv::Unsigned | Conv::Hex { .. } | Conv::Octal | Conv::Pointer => {
                let (base, upper) = match conv {
                    Conv::Hex { upper } => (16, upper),
                    Conv::Pointer => (16, false),
                    Conv::Octal => (8, false),
                    _ => (10, false),
                };
                if conv == Conv::Pointer {
                    // "0x" and 16 digits, padded with blanks: no precision of its own.
                    asm!(self, self.a.mov(qword_ptr(rsp + vars + ZEROS), 16))?;
                }
                let signed = conv == Conv::Signed;
                self.number_body(arg, areas, base, upper, signed, spec)?;
                let prefix: &[u8] = match conv {
                    Conv::Hex { upper: false } if spec.alt => b"0x",
                    Conv::Hex { upper: true } if spec.alt => b"0X",
                    Conv::Octal if spec.alt => b"0",
                    Conv::Pointer => b"0x",
                    _ => b"",
                };
                (prefix, conv != Conv::Pointer)
            }
        };
        // FILL = width - (characters of the body, prefix and sign), or 0.
        let r = (|| {
            let mut some = self.a.create_label();
            self.a.add(r11, prefix.len() as i32)?;
            self.a.cmp(qword_ptr(rsp + vars + SIGN), 0)?;
            self.a.je(some)?;
            self.a.inc(r11)?;
            self.a.set_label(&mut some)?;
            let mut none = self.a.create_label();
            let mut done = self.a.create_label();
            self.a.mov(rax, qword_ptr(rsp + vars + FILL))?;
            self.a.sub(rax, r11)?;
            self.a.jbe(none)?;
            self.a.mov(qword_ptr(rsp + vars + FILL), rax)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut none)?;
            self.a.mov(qword_ptr(rsp + vars + FILL), 0)?;
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        let zero = spec.zero && numeric;
        let right: &[Part] = if zero {
            &[Part::Prefix, Part::Fill(b'0'), Part::Zeros, Part::Body]
        } else {
            &[Part::Fill(b' '), Part::Prefix, Part::Zeros, Part::Body]
        };
        let left: &[Part] = &[Part::Prefix, Part::Zeros, Part::Body, Part::Fill(b' ')];
        if spec.width == Some(Width::Arg) {
            let mut to_left = self.a.create_label();
            let mut done = self.a.create_label();
            asm!(self, self.a.cmp(qword_ptr(rsp + vars + LEFT), 0))?;
            asm!(self, self.a.jne(to_left))?;
            self.parts(right, prefix, vars)?;
            asm!(self, self.a.jmp(done))?;
            self.place(&mut to_left)?;
            self.parts(left, prefix, vars)?;
            self.place(&mut done)
        } else if spec.left {
            self.parts(left, prefix, vars)
        } else {
            self.parts(right, prefix, vars)
        }
    }

    fn parts(&mut self, parts: &[Part], prefix: &[u8], vars: i32) -> R<()> {
        for p in parts {
            match p {
                Part::Fill(b) => {
                    asm!(self, self.a.mov(al, u32::from(*b)))?;
                    asm!(self, self.a.mov(rdx, qword_ptr(rsp + vars + FILL)))?;
                    self.put_fill()?;
                }
                Part::Zeros => {
                    asm!(self, self.a.mov(al, u32::from(b'0')))?;
                    asm!(self, self.a.mov(rdx, qword_ptr(rsp + vars + ZEROS)))?;
                    self.put_fill()?;
                }
                Part::Prefix => {
                    let r = (|| {
                        let mut none = self.a.create_label();
                        self.a.mov(rax, qword_ptr(rsp + vars + SIGN))?;
                        self.a.test(rax, rax)?;
                        self.a.jz(none)?;
                        self.a.jrcxz(none)?;
                        self.a.mov(byte_ptr(rdi), al)?;
                        self.a.inc(rdi)?;
                        self.a.dec(rcx)?;
                        self.a.set_label(&mut none)?;
                        self.a.nop()
                    })();
                    asm!(self, r)?;
                    self.put_literal(prefix)?;
                }
                Part::Body => {
                    asm!(self, self.a.mov(rsi, qword_ptr(rsp + vars + BODY)))?;
                    asm!(self, self.a.mov(rdx, qword_ptr(rsp + vars + BODY_LEN)))?;
                    self.put_copy()?;
                }
            }
        }
        Ok(())
    }

    /// `%s`: the text of the argument at `arg` in the text area, cut at the precision's
    /// characters (ZEROS holds the precision; cleared after); r11 = its characters.
    fn text_body(&mut self, arg: i32, areas: &Areas, precision: bool) -> R<()> {
        let (text, vars) = (areas.text, areas.vars);
        let room = self.build_room();
        // The output's cursor and room wait on the stack while the text is laid out.
        let r = (|| {
            self.a.push(rcx)?;
            self.a.push(rdi)?;
            self.a.lea(rdi, qword_ptr(rsp + (text + 16)))?;
            self.a.mov(ecx, room)?;
            self.a.mov(rax, qword_ptr(rsp + (arg + 16)))?;
            self.a.mov(rdx, qword_ptr(rsp + (arg + 24)))
        })();
        asm!(self, r)?;
        self.append()?;
        let r = (|| {
            let mut top = self.a.create_label();
            let mut cont = self.a.create_label();
            let mut done = self.a.create_label();
            self.a.mov(rdx, rdi)?;
            self.a.pop(rdi)?;
            self.a.pop(rcx)?;
            self.a.lea(rsi, qword_ptr(rsp + text))?;
            // rdx: the text's bytes; r9: bytes taken, r11: characters taken, r10: most
            // characters.
            self.a.sub(rdx, rsi)?;
            if precision {
                self.a.mov(r10, qword_ptr(rsp + vars + ZEROS))?;
            } else {
                self.a.mov(r10, -1i64)?;
            }
            self.a.xor(r9d, r9d)?;
            self.a.xor(r11d, r11d)?;
            self.a.set_label(&mut top)?;
            self.a.cmp(r9, rdx)?;
            self.a.jae(done)?;
            self.a.movzx(eax, byte_ptr(rsi + r9))?;
            self.a.and(eax, 0xc0)?;
            self.a.cmp(eax, 0x80)?;
            self.a.je(cont)?;
            self.a.cmp(r11, r10)?;
            self.a.jae(done)?;
            self.a.inc(r11)?;
            self.a.set_label(&mut cont)?;
            self.a.inc(r9)?;
            self.a.jmp(top)?;
            self.a.set_label(&mut done)?;
            self.a.mov(qword_ptr(rsp + vars + BODY), rsi)?;
            self.a.mov(qword_ptr(rsp + vars + BODY_LEN), r9)?;
            self.a.mov(qword_ptr(rsp + vars + ZEROS), 0)
        })();
        asm!(self, r)
    }

    /// `%c`: the byte of the argument at `arg` as a character (two bytes of UTF-8 from
    /// 0x80, as Rust's `char::from(u8)`); r11 = 1.
    fn char_body(&mut self, arg: i32, areas: &Areas) -> R<()> {
        let (digits, vars) = (areas.digits, areas.vars);
        let r = (|| {
            let mut wide = self.a.create_label();
            let mut done = self.a.create_label();
            self.a.lea(rsi, qword_ptr(rsp + digits))?;
            self.a.mov(qword_ptr(rsp + vars + BODY), rsi)?;
            self.a.movzx(eax, byte_ptr(rsp + arg))?;
            self.a.cmp(eax, 0x80)?;
            self.a.jae(wide)?;
            self.a.mov(byte_ptr(rsi), al)?;
            self.a.mov(qword_ptr(rsp + vars + BODY_LEN), 1)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut wide)?;
            self.a.mov(edx, eax)?;
            self.a.shr(edx, 6)?;
            self.a.or(edx, 0xc0)?;
            self.a.mov(byte_ptr(rsi), dl)?;
            self.a.and(eax, 0x3f)?;
            self.a.or(eax, 0x80)?;
            self.a.mov(byte_ptr(rsi + 1), al)?;
            self.a.mov(qword_ptr(rsp + vars + BODY_LEN), 2)?;
            self.a.set_label(&mut done)?;
            self.a.mov(qword_ptr(rsp + vars + ZEROS), 0)?;
            self.a.mov(r11d, 1)
        })();
        asm!(self, r)
    }

    /// The digits of the argument at `arg` in `base` at the end of the digits area, ZEROS
    /// turned from the precision into the zeros it adds, SIGN set for `%d`; r11 = the
    /// digits and zeros.
    fn number_body(
        &mut self,
        arg: i32,
        areas: &Areas,
        base: u32,
        upper: bool,
        signed: bool,
        spec: &Spec,
    ) -> R<()> {
        let (digits, vars) = (areas.digits, areas.vars);
        let r = (|| {
            let mut digit = self.a.create_label();
            let mut decimal = self.a.create_label();
            let mut no_zeros = self.a.create_label();
            let mut zeros_done = self.a.create_label();
            self.a.mov(rax, qword_ptr(rsp + arg))?;
            if signed {
                let mut positive = self.a.create_label();
                let mut signed_done = self.a.create_label();
                self.a.test(rax, rax)?;
                self.a.jns(positive)?;
                self.a.neg(rax)?; // i64::MIN stays 2^63, right as unsigned
                self.a.mov(qword_ptr(rsp + vars + SIGN), i32::from(b'-'))?;
                self.a.jmp(signed_done)?;
                self.a.set_label(&mut positive)?;
                self.a.nop()?;
                if spec.plus {
                    self.a.mov(qword_ptr(rsp + vars + SIGN), i32::from(b'+'))?;
                } else if spec.space {
                    self.a.mov(qword_ptr(rsp + vars + SIGN), i32::from(b' '))?;
                }
                self.a.set_label(&mut signed_done)?;
            }
            self.a.lea(r9, qword_ptr(rsp + (digits + DIGITS)))?;
            self.a.mov(r10d, base)?;
            self.a.set_label(&mut digit)?;
            self.a.xor(edx, edx)?;
            self.a.div(r10)?;
            self.a.cmp(dl, 10)?;
            self.a.jb(decimal)?;
            self.a.add(
                dl,
                u32::from(if upper { b'A' } else { b'a' }) - 10 - u32::from(b'0'),
            )?;
            self.a.set_label(&mut decimal)?;
            self.a.add(dl, u32::from(b'0'))?;
            self.a.dec(r9)?;
            self.a.mov(byte_ptr(r9), dl)?;
            self.a.test(rax, rax)?;
            self.a.jnz(digit)?;
            self.a.mov(qword_ptr(rsp + vars + BODY), r9)?;
            self.a.lea(r11, qword_ptr(rsp + (digits + DIGITS)))?;
            self.a.sub(r11, r9)?;
            self.a.mov(qword_ptr(rsp + vars + BODY_LEN), r11)?;
            // Zeros up to the precision.
            self.a.mov(rax, qword_ptr(rsp + vars + ZEROS))?;
            self.a.sub(rax, r11)?;
            self.a.jbe(no_zeros)?;
            self.a.mov(qword_ptr(rsp + vars + ZEROS), rax)?;
            self.a.add(r11, rax)?;
            self.a.jmp(zeros_done)?;
            self.a.set_label(&mut no_zeros)?;
            self.a.mov(qword_ptr(rsp + vars + ZEROS), 0)?;
            self.a.set_label(&mut zeros_done)?;
            self.a.nop()
        })();
        asm!(self, r)
    }
}
