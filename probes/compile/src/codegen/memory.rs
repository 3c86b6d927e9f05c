//! Reads of guest memory in a compiled body: member chains of target variables and `@cast`,
//! and strings read from memory (`kernel_string*()`, `user_string*()`).
//!
//! Every read goes through one of the kernel's fault-tolerant routines, called from the body
//! (their addresses are in [`Facts`](super::super::Facts)): a bad address is an error code,
//! which ends the hit with a probe error (`FAULTS`), as the interpreter ends it with a copy
//! fault.
//!
//! A string read from memory is up to MAXSTRINGLEN - 1 bytes, too long for the 16-byte
//! compiled string. It compiles as a direct argument of `printf`/`print`/`println` (read into
//! a MAXSTRINGLEN-byte buffer on the stack, then copied whole into the output record, whose
//! layout gives it that many bytes: see [`super::super::data`]), and into a local assigned by
//! a statement of its own (`s = kernel_string(p)`: the local gets such a buffer in the frame)
//! that is then only printed. Used anywhere else (a key, a value, a comparison, a
//! concatenation) it is refused by [`super::super::check`], so a string is never cut shorter
//! than the interpreter would cut it, and compared or hashed only as the interpreter would
//! (which compares text after replacing invalid UTF-8: raw bytes would not be the same).

use std::collections::{HashMap, HashSet};

use iced_x86::code_asm::*;

use exotap_lang::ast::*;
use exotap_lang::Limits;

use super::super::types::{chain, Step, TypeRef};
use super::super::KSYM_NAME_LEN;
use super::calls::is_print;
use super::stack::{guard_busy, guard_enter, guard_leave};
use super::{walk, Gen, K, R};

/// The memory-string built-ins: name → (reads user memory, takes a length).
pub(super) fn text_call(e: &Expr) -> Option<(&Call, bool, bool)> {
    let ExprKind::Call(c) = &e.kind else {
        return None;
    };
    match c.name.name.as_str() {
        "kernel_string" => Some((c, false, false)),
        "kernel_string_n" => Some((c, false, true)),
        "user_string" => Some((c, true, false)),
        "user_string_n" => Some((c, true, true)),
        _ => None,
    }
}

/// Bytes a string read from memory takes on the stack, in a frame and in a record.
pub(super) fn text_slot(limits: &Limits) -> i32 {
    let n = i32::try_from(limits.max_string_len).unwrap_or(i32::MAX);
    (n.clamp(1, 1 << 20) + 15) / 16 * 16
}

/// Locals that `body` assigns a string read from memory (`s = kernel_string(p)` as a
/// statement) and only ever prints (each read of one is a direct argument of
/// printf/print/println/printd/printdln): they get a MAXSTRINGLEN buffer of their own, whose
/// text goes into the output record whole. A local used any other way holds a string value
/// (interned in the guest's string table, see [`Gen::text_value`]).
pub(super) fn text_locals(body: &Block) -> HashSet<String> {
    fn stmt(s: &Stmt, out: &mut HashSet<String>) {
        match &s.kind {
            StmtKind::Block(b) => b.stmts.iter().for_each(|s| stmt(s, out)),
            StmtKind::Expr(e) => {
                if let ExprKind::Assign(None, p) = &e.kind {
                    if let (ExprKind::Var(name), Some(_)) = (&p.0.kind, text_call(&p.1)) {
                        out.insert(name.clone());
                    }
                }
            }
            StmtKind::If(i) => {
                stmt(&i.then, out);
                if let Some(e) = &i.els {
                    stmt(e, out);
                }
            }
            StmtKind::While(w) => stmt(&w.1, out),
            StmtKind::For(f) => stmt(&f.body, out),
            StmtKind::Foreach(f) => stmt(&f.body, out),
            StmtKind::Try(t) => t
                .body
                .stmts
                .iter()
                .chain(&t.handler.stmts)
                .for_each(|s| stmt(s, out)),
            _ => {}
        }
    }
    let mut out = HashSet::new();
    body.stmts.iter().for_each(|s| stmt(s, &mut out));
    // Every occurrence of each, and those that keep it a text local.
    let mut all: HashMap<&str, usize> = HashMap::new();
    let mut kept: HashMap<&str, usize> = HashMap::new();
    walk::block_exprs(body, &mut |e: &Expr| match &e.kind {
        ExprKind::Var(n) => *all.entry(n.as_str()).or_default() += 1,
        ExprKind::Assign(None, p) if text_call(&p.1).is_some() => {
            if let ExprKind::Var(n) = &p.0.kind {
                *kept.entry(n.as_str()).or_default() += 1;
            }
        }
        ExprKind::Call(c) if is_print(c) => {
            for a in &c.args {
                if let ExprKind::Var(n) = &a.kind {
                    *kept.entry(n.as_str()).or_default() += 1;
                }
            }
        }
        _ => {}
    });
    out.retain(|n| all.get(n.as_str()) == kept.get(n.as_str()));
    out
}

/// Whether `block` reads a string from memory as a value: anywhere but as a direct argument
/// of a print, or into one of `texts` (see [`text_locals`]). Such a string is interned in the
/// guest's string table.
pub(super) fn reads_text_values(block: &Block, texts: &HashSet<String>) -> bool {
    let mut calls = 0usize;
    let mut kept = 0usize;
    walk::block_exprs(block, &mut |e: &Expr| {
        if text_call(e).is_some() {
            calls += 1;
        }
        match &e.kind {
            ExprKind::Assign(None, p) if text_call(&p.1).is_some() => {
                if matches!(&p.0.kind, ExprKind::Var(n) if texts.contains(n)) {
                    kept += 1;
                }
            }
            ExprKind::Call(c) if is_print(c) => {
                kept += c.args.iter().filter(|a| text_call(a).is_some()).count();
            }
            _ => {}
        }
    });
    calls > kept
}

impl Gen<'_, '_> {
    /// Copies `size` bytes (1, 2, 4 or 8) at `rax + offset` into the scratch slot with the
    /// nofault routine `copy`, and loads them into `rax` (sign-extended when `signed`); a
    /// fault ends the hit as a probe error.
    pub(super) fn copy_in(
        &mut self,
        copy: u64,
        offset: i32,
        size: u8,
        signed: bool,
    ) -> Result<(), IcedError> {
        let scratch = self.scratch();
        self.a.lea(rsi, qword_ptr(rax + offset))?;
        self.a.lea(rdi, qword_ptr(rbp + scratch))?;
        self.a.mov(edx, u32::from(size))?;
        self.a.call(copy)?;
        self.a.test(rax, rax)?;
        self.a.jnz(self.errors.fault)?;
        match (size, signed) {
            (8, _) => self.a.mov(rax, qword_ptr(rbp + scratch)),
            (4, true) => self.a.movsxd(rax, dword_ptr(rbp + scratch)),
            (4, false) => self.a.mov(eax, dword_ptr(rbp + scratch)),
            (2, true) => self.a.movsx(rax, word_ptr(rbp + scratch)),
            (2, false) => self.a.movzx(eax, word_ptr(rbp + scratch)),
            (_, true) => self.a.movsx(rax, byte_ptr(rbp + scratch)),
            (_, false) => self.a.movzx(eax, byte_ptr(rbp + scratch)),
        }
    }
    /// `kernel_string(p)` (and the other three) as a value: the text read into a buffer on
    /// the stack, then interned in the guest's string table (up to 15 bytes inline), as a
    /// string built in the guest is. The bytes are kept as read; the interpreter holds the
    /// same text with invalid UTF-8 replaced, which only a string that is not UTF-8 shows.
    pub(super) fn text_value(&mut self, c: &Call, user: bool, with_n: bool) -> R<K> {
        let intern = self.string_helper(super::strings::INTERN)?;
        let text = self.text_bytes();
        let strings = self.errors.strings;
        asm!(self, self.a.sub(rsp, text))?;
        self.text(c, user, with_n)?;
        let r = (|| {
            // rcx = the text's length (it ends at a NUL inside the buffer).
            self.a.mov(rdi, rsp)?;
            self.a.xor(eax, eax)?;
            self.a.mov(ecx, text as u32)?;
            self.a.repne().scasb()?;
            self.a.lea(rcx, qword_ptr(rdi - 1))?;
            self.a.mov(rsi, rsp)?;
            self.a.sub(rcx, rsi)?;
            self.a.call(intern)?;
            self.a.lea(rsp, qword_ptr(rsp + text))?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(K::Str)
    }

    /// `symname(addr)`: the name of the kernel function at `addr`, from the guest kernel's
    /// own `kallsyms_lookup` into a [`KSYM_NAME_LEN`]-byte buffer on the stack (cut at
    /// MAXSTRINGLEN - 1 bytes, as the interpreter cuts it); an address outside the kernel's
    /// text, or one kallsyms does not know, is its own text `0x...`, as the interpreter
    /// answers. The call runs with interrupts off under this CPU's guard bit, which the
    /// kernel's unwinder takes too ([`super::stack`]): a probe on a function the lookup runs
    /// (or an NMI during one) finds it set and answers the address instead of recursing,
    /// counted in `STACKS_BUSY`.
    pub(super) fn symname(&mut self, c: &Call) -> R<K> {
        let Some(kallsyms) = self.env.facts.memory.kallsyms else {
            return Err(self.no("symname() (the kernel has no kallsyms_lookup)"));
        };
        let arg = c
            .args
            .first()
            .ok_or_else(|| self.no("symname() without an address"))?;
        let intern = self.string_helper(super::strings::INTERN)?;
        let strings = self.errors.strings;
        let data = self.env.data;
        let cpu_number = self.env.facts.cpu_number;
        let most = u32::try_from(self.env.limits.max_string_len.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(KSYM_NAME_LEN - 1);
        // [rsp]: the address, [rsp + 8]: padding, [rsp + 16, +KSYM_NAME_LEN): the name.
        const NAME: i32 = 16;
        let frame = NAME + KSYM_NAME_LEN as i32;
        self.long(arg)?;
        let r = (|| {
            let mut busy = self.a.create_label();
            let mut hex = self.a.create_label();
            let mut digit = self.a.create_label();
            let mut decimal = self.a.create_label();
            let mut found = self.a.create_label();
            let mut cut = self.a.create_label();
            let mut intern_it = self.a.create_label();
            self.a.sub(rsp, frame)?;
            self.a.mov(qword_ptr(rsp), rax)?;
            // Only the kernel's own text: the symbols the host names as well.
            self.a.mov(rdx, kallsyms.text_start)?;
            self.a.cmp(rax, rdx)?;
            self.a.jb(hex)?;
            self.a.mov(rdx, kallsyms.text_end)?;
            self.a.cmp(rax, rdx)?;
            self.a.jae(hex)?;
            guard_enter(self.a, data, cpu_number, busy)?;
            // [rsp]: the CPU, [rsp + 8]: the flags, then the frame above (16-byte aligned).
            self.a.push(rax)?;
            self.a.mov(rdi, qword_ptr(rsp + 16))?;
            self.a.xor(esi, esi)?;
            self.a.xor(edx, edx)?;
            self.a.xor(ecx, ecx)?;
            self.a.lea(r8, qword_ptr(rsp + 16 + NAME))?;
            self.a.call(kallsyms.lookup)?;
            self.a.pop(rdx)?;
            guard_leave(self.a, data)?;
            self.a.popfq()?;
            self.a.test(rax, rax)?;
            self.a.jnz(found)?;
            self.a.jmp(hex)?;
            self.a.set_label(&mut busy)?;
            guard_busy(self.a, data)?;
            self.a.popfq()?;
            // The address as `0x` and its hex digits, written backwards from NAME + 32.
            self.a.set_label(&mut hex)?;
            self.a.mov(rax, qword_ptr(rsp))?;
            self.a.lea(rsi, qword_ptr(rsp + NAME + 32))?;
            self.a.set_label(&mut digit)?;
            self.a.dec(rsi)?;
            self.a.mov(edx, eax)?;
            self.a.and(edx, 15)?;
            self.a.cmp(edx, 10)?;
            self.a.jb(decimal)?;
            self.a.add(edx, i32::from(b'a' - b'0' - 10))?;
            self.a.set_label(&mut decimal)?;
            self.a.add(edx, i32::from(b'0'))?;
            self.a.mov(byte_ptr(rsi), dl)?;
            self.a.shr(rax, 4)?;
            self.a.jnz(digit)?;
            self.a.sub(rsi, 2)?;
            self.a
                .mov(word_ptr(rsi), u32::from(u16::from_le_bytes(*b"0x")))?;
            self.a.lea(rcx, qword_ptr(rsp + NAME + 32))?;
            self.a.sub(rcx, rsi)?;
            self.a.jmp(intern_it)?;
            // The name: up to its NUL.
            self.a.set_label(&mut found)?;
            self.a.lea(rdi, qword_ptr(rsp + NAME))?;
            self.a.mov(rsi, rdi)?;
            self.a.xor(eax, eax)?;
            self.a.mov(ecx, KSYM_NAME_LEN)?;
            self.a.repne().scasb()?;
            self.a.jne(cut)?;
            self.a.dec(rdi)?;
            self.a.set_label(&mut cut)?;
            self.a.mov(rcx, rdi)?;
            self.a.sub(rcx, rsi)?;
            // Either text cut at `most` bytes, as the interpreter cuts a string.
            self.a.set_label(&mut intern_it)?;
            self.a.mov(edx, most)?;
            self.a.cmp(rcx, rdx)?;
            self.a.cmova(rcx, rdx)?;
            self.a.call(intern)?;
            self.a.lea(rsp, qword_ptr(rsp + frame))?;
            self.a.test(r8, r8)?;
            self.a.jnz(strings)
        })();
        asm!(self, r)?;
        Ok(K::Str)
    }

    /// Bytes a string read from memory takes on the stack and in a record.
    pub(super) fn text_bytes(&self) -> i32 {
        text_slot(self.env.limits)
    }

    /// `name = kernel_string(...)` into the local's own buffer (at `at`, see `texts`).
    pub(super) fn assign_text(
        &mut self,
        name: &str,
        at: i32,
        op: Option<BinOp>,
        value: &Expr,
    ) -> R<K> {
        let Some((c, user, with_n)) = text_call(value).filter(|_| op.is_none()) else {
            return Err(self.no(format!(
                "{name}, which holds a string read from memory, assigned another value"
            )));
        };
        let text = self.text_bytes();
        let off = self.text_local(at);
        asm!(self, self.a.sub(rsp, text))?;
        self.text(c, user, with_n)?;
        let r = (|| {
            self.a.mov(rsi, rsp)?;
            self.a.lea(rdi, qword_ptr(rbp + off))?;
            self.a.mov(ecx, text as u32)?;
            self.a.rep().movsb()?;
            self.a.add(rsp, text)
        })();
        asm!(self, r)?;
        // The statement's value is not a string the rest of the body can use.
        Ok(K::Long)
    }

    /// Reads the string of `c` into the buffer at `rsp` (the caller reserved
    /// [`Self::text_bytes`] there); leaves `rax` = the buffer.
    pub(super) fn text(&mut self, c: &Call, user: bool, with_n: bool) -> R<()> {
        let name = c.name.name.as_str();
        let fns = self.env.facts.memory;
        let (strncpy, copy_one) = if user {
            (fns.strncpy_user, fns.copy_user)
        } else {
            (fns.strncpy_kernel, self.env.facts.copy_nofault)
        };
        let (Some(strncpy), Some(copy_one)) = (strncpy, copy_one) else {
            return Err(self.no(format!(
                "{name}() (the kernel lacks its nofault string copy routines)"
            )));
        };
        let addr = c
            .args
            .first()
            .ok_or_else(|| self.no(format!("{name}() without an address")))?;
        let most = i64::try_from(self.env.limits.max_string_len.saturating_sub(1))
            .unwrap_or(i64::MAX)
            .min(i64::from(i32::MAX));
        self.long(addr)?;
        if with_n {
            let n = c
                .args
                .get(1)
                .ok_or_else(|| self.no(format!("{name}() without a length")))?;
            asm!(self, self.a.push(rax))?;
            asm!(self, self.a.push(rax))?; // keeps the stack 16-byte aligned
            self.long(n)?;
            asm!(self, self.a.mov(rcx, rax))?;
            asm!(self, self.a.pop(rax))?;
            asm!(self, self.a.pop(rax))?;
        } else {
            asm!(self, self.a.mov(rcx, most))?;
        }
        // The overloads with a string for an unreadable address (a literal here) answer it
        // instead of the fault, as the interpreter does.
        let fallback = match c.args.get(if with_n { 2 } else { 1 }) {
            None => None,
            Some(Expr {
                kind: ExprKind::Str(s),
                ..
            }) => Some(exotap_lang::value::truncate(
                s.clone(),
                self.env.limits.max_string_len,
            )),
            Some(_) => {
                return Err(self.no(format!(
                    "{name}() with a string for an unreadable address that is not a literal"
                )))
            }
        };
        let fault = match fallback {
            Some(_) => self.a.create_label(),
            None => self.errors.fault,
        };
        // rax = address, rcx = n. L = clamp(n, 0, MAXSTRINGLEN - 1) bytes at most, read up
        // to the first NUL. strncpy_*_nofault(dst, src, L) reads bytes 0..L-1 but keeps L-1
        // of them (its last byte becomes the NUL): when it returns L, the byte at L-1 is read
        // again on its own, so exactly the bytes the interpreter reads are read.
        let r = (|| {
            let mut fits = self.a.create_label();
            self.a.mov(byte_ptr(rsp), 0)?;
            self.a.test(rcx, rcx)?;
            self.a.jle(fits)?;
            self.a.mov(rdx, most)?;
            self.a.cmp(rcx, rdx)?;
            self.a.cmovg(rcx, rdx)?;
            self.a.push(rax)?;
            self.a.push(rcx)?;
            self.a.lea(rdi, qword_ptr(rsp + 16))?;
            self.a.mov(rsi, rax)?;
            self.a.mov(rdx, rcx)?;
            self.a.call(strncpy)?;
            self.a.pop(rcx)?;
            self.a.pop(rsi)?;
            self.a.test(rax, rax)?;
            self.a.js(fault)?;
            self.a.cmp(rax, rcx)?;
            self.a.jl(fits)?;
            // dst[L-1] = the byte at src + L - 1, read alone; dst[L] = 0.
            self.a.lea(rdi, qword_ptr(rsp + rcx - 1))?;
            self.a.mov(byte_ptr(rsp + rcx), 0)?;
            self.a.lea(rsi, qword_ptr(rsi + rcx - 1))?;
            self.a.mov(edx, 1)?;
            self.a.call(copy_one)?;
            self.a.test(rax, rax)?;
            self.a.jnz(fault)?;
            self.a.set_label(&mut fits)?;
            let Some(text) = &fallback else {
                return self.a.mov(rax, rsp);
            };
            let mut done = self.a.create_label();
            let mut fault = fault;
            self.a.jmp(done)?;
            self.a.set_label(&mut fault)?;
            let mut bytes = text.as_bytes().to_vec();
            bytes.push(0);
            for (i, chunk) in bytes.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                self.a.mov(rax, u64::from_le_bytes(word))?;
                self.a.mov(qword_ptr(rsp + 8 * i as i32), rax)?;
            }
            self.a.set_label(&mut done)?;
            self.a.mov(rax, rsp)
        })();
        asm!(self, r)
    }

    /// Applies a member chain's steps to the value in `rax`.
    pub(super) fn steps(&mut self, steps: &[Step]) -> R<()> {
        self.steps_indexed(steps, 0)
    }

    /// As [`Self::steps`], with the chain's `indexes` computed subscripts in 16-byte slots on
    /// the stack, the first deepest (`[rsp + 16 × (indexes - 1 - slot)]`).
    pub(super) fn steps_indexed(&mut self, steps: &[Step], indexes: usize) -> R<()> {
        let copy = self.env.facts.copy_nofault.ok_or_else(|| {
            self.no("a member chain (the kernel has no copy_from_kernel_nofault)")
        })?;
        for step in steps {
            let r = match *step {
                Step::Index { slot, scale } => {
                    let at = indexes
                        .checked_sub(slot + 1)
                        .and_then(|d| i32::try_from(16 * d).ok())
                        .ok_or_else(|| self.no("a subscript without its value"))?;
                    let scale = i32::try_from(scale)
                        .map_err(|_| self.no("a subscript of elements past 2 GiB"))?;
                    (|| {
                        self.a.imul_3(rcx, qword_ptr(rsp + at), scale)?;
                        self.a.add(rax, rcx)
                    })()
                }
                Step::Address { offset } => {
                    let off =
                        i32::try_from(offset).map_err(|_| self.no("a member offset past 2 GiB"))?;
                    self.a.add(rax, off)
                }
                Step::Read {
                    offset,
                    size,
                    signed,
                } => {
                    let off =
                        i32::try_from(offset).map_err(|_| self.no("a member offset past 2 GiB"))?;
                    self.copy_in(copy, off, size, signed)
                }
            };
            asm!(self, r)?;
        }
        Ok(())
    }

    /// The type of the target variable `name` at this point (a parameter, or `$return`).
    pub(super) fn target_type(&self, name: &str) -> R<TypeRef> {
        let types = self
            .env
            .facts
            .types
            .clone()
            .ok_or_else(|| self.no(format!("{name}->... (no kernel type information)")))?;
        let param = (name != "$return").then(|| name.trim_start_matches('$'));
        types
            .param(&self.point.function, param)
            .ok_or_else(|| self.no(format!("{name}->... (BTF has no type for it)")))
    }

    /// A member chain from the value in `rax`, of type `base`.
    pub(super) fn members(&mut self, what: &str, base: TypeRef, members: &[String]) -> R<()> {
        let types = self
            .env
            .facts
            .types
            .clone()
            .ok_or_else(|| self.no(format!("{what} (no kernel type information)")))?;
        let lay = if std::mem::take(&mut self.address_of) {
            super::super::types::address_chain
        } else {
            chain
        };
        let steps =
            lay(types.as_ref(), base, members).map_err(|e| self.no(format!("{what}: {e}")))?;
        self.steps(&steps)
    }

    /// `@cast(p, "type")->m...`: `p` read as a pointer to `type`.
    pub(super) fn cast(&mut self, c: &CastExpr) -> R<K> {
        // `&` applies to this chain, not to any inside the pointer's expression.
        let address = std::mem::take(&mut self.address_of);
        let what = format!("@cast(..., \"{}\")", c.type_name);
        if c.members.is_empty() {
            // The pointer itself, as the interpreter answers.
            self.long(&c.pointer)?;
            return Ok(K::Long);
        }
        let types = self
            .env
            .facts
            .types
            .clone()
            .ok_or_else(|| self.no(format!("{what} (no kernel type information)")))?;
        let steps = if let Some(like) = &c.like {
            // Autocast: laid out as the target variable the local was copied from is here.
            let local = match &c.pointer.kind {
                ExprKind::Var(v) => v.as_str(),
                _ => "the local",
            };
            let what = format!("{local}->... (copied from {like})");
            let base = super::super::types::chain_base(
                like,
                &self.point.params,
                self.point.is_return,
                self.point.locals.as_deref(),
            )
            .ok_or_else(|| self.no(format!("{what}: {like} is not defined here")))?;
            super::super::types::target_chain(
                types.as_ref(),
                &self.point.function,
                like,
                base,
                &c.members,
                address,
            )
            .map_err(|e| self.no(format!("{what}: {e}")))?
        } else {
            // A module's type is known where the script probes that module (its split BTF
            // joins the kernel's).
            let ty = types.named(&c.type_name).ok_or_else(|| {
                self.no(if c.of_kernel() {
                    format!("{what} (BTF has no such type)")
                } else {
                    format!("{what} of a module's type, which is known only for the module the script probes")
                })
            })?;
            let lay = if address {
                super::super::types::cast_address_chain
            } else {
                super::super::types::cast_chain
            };
            lay(types.as_ref(), ty, &c.members).map_err(|e| self.no(format!("{what}: {e}")))?
        };
        self.long(&c.pointer)?;
        if c.indexes.is_empty() {
            self.steps(&steps)?;
            return Ok(K::Long);
        }
        // The pointer, then each computed subscript, in 16-byte slots on the stack (the
        // interpreter's order); the walk's `Index` steps read them there.
        let n = c.indexes.len();
        asm!(self, self.a.push(rax))?;
        asm!(self, self.a.push(rax))?;
        for index in &c.indexes {
            self.long(index)?;
            asm!(self, self.a.push(rax))?;
            asm!(self, self.a.push(rax))?;
        }
        let slots = i32::try_from(16 * n).map_err(|_| self.no("so many subscripts"))?;
        asm!(self, self.a.mov(rax, qword_ptr(rsp + slots)))?;
        self.steps_indexed(&steps, n)?;
        asm!(self, self.a.add(rsp, slots + 16))?;
        Ok(K::Long)
    }
}
