//! Kernel stacks in a compiled body: `print_backtrace()`, and `backtrace()` /
//! `sprint_backtrace()` as arguments of `printf`/`print`/`println`, as records that carry a
//! stack snapshot (the saved registers and the stack bytes above the probed code's stack
//! pointer) for the host to unwind. The record layout and the bounds of the copy are in
//! [`crate::compile::snapshot`].

use iced_x86::code_asm::*;

use crate::lang::ast::*;

use super::super::data::{OutputKind, MAX_PRINT_ARGS};
use super::super::snapshot::{
    stack_arg, StackArg, StackFormat, StackOutput, REGS, SNAPSHOT_HEAD, STACK_FORMAT, STACK_SIZE,
};
use super::memory::text_call;
use super::{Gen, K, R, SAVED_BYTES};

/// Fewest stack bytes a record must have room for (a few frames).
const MIN_SNAPSHOT: u64 = 512;
/// Bytes of a page: the copy goes a page at a time and stops at the first that faults.
const PAGE: i32 = 4096;

impl Gen<'_, '_> {
    /// `print_backtrace()`.
    pub(super) fn print_backtrace(&mut self) -> R<K> {
        self.stack_record(StackOutput::PrintBacktrace, &[])
    }

    /// `printf`/`print`/`println` (as `kind`) of `values`, at least one of them a stack.
    pub(super) fn print_stack(&mut self, kind: OutputKind, values: &[Expr]) -> R<K> {
        let output = match kind {
            OutputKind::Printf(fmt) => StackOutput::Printf(fmt),
            OutputKind::Print(ln) => StackOutput::Print(ln),
            OutputKind::Hist { .. } => return Err(self.no("a histogram beside a kernel stack")),
        };
        self.stack_record(output, values)
    }

    /// A record of `values` (longs, 16-byte strings and stacks) and a stack snapshot.
    fn stack_record(&mut self, output: StackOutput, values: &[Expr]) -> R<K> {
        let name = match &output {
            StackOutput::PrintBacktrace => "print_backtrace",
            StackOutput::Printf(_) => "printf",
            StackOutput::Print(_) => "print",
        };
        let Some(rings) = self.env.layout.ring_set(self.env.data) else {
            return Err(self.no(format!("{name}() of a kernel stack without output rings")));
        };
        if self.point.is_return {
            return Err(self.no(
                "a kernel stack in a return probe (the compiled return trampoline stands \
                 outside the probed function, so its stack would not be the probe's)",
            ));
        }
        let copy = self.env.facts.copy_nofault.ok_or_else(|| {
            self.no("a kernel stack (the kernel has no copy_from_kernel_nofault)")
        })?;
        if values.len() > MAX_PRINT_ARGS {
            return Err(self.no(format!(
                "{name}() with more than {MAX_PRINT_ARGS} arguments"
            )));
        }
        let mut args = Vec::new();
        for v in values {
            let is_text = text_call(v).is_some()
                || matches!(&v.kind, ExprKind::Var(n) if self.texts.contains_key(n));
            if is_text {
                return Err(self.no(format!(
                    "{name}() of a string read from memory beside a kernel stack"
                )));
            }
            if let Some(stack) = stack_arg(v) {
                asm!(self, self.a.xor(eax, eax))?;
                asm!(self, self.a.xor(edx, edx))?;
                args.push(stack);
            } else {
                let k = self.expr(v)?;
                if k == K::Long {
                    asm!(self, self.a.xor(edx, edx))?;
                }
                // A string built in the guest may be an index into its string table, which a
                // stack record does not carry (printf records copy the text instead).
                if k == K::Str && super::strings::builds_strings(self.env.prog) {
                    return Err(self.no(format!(
                        "{name}() of a string beside a kernel stack, in a script that builds \
                         strings"
                    )));
                }
                args.push(if k == K::Str {
                    StackArg::Str
                } else {
                    StackArg::Long
                });
            }
            asm!(self, self.a.push(rdx))?;
            asm!(self, self.a.push(rax))?;
        }
        let mut format = StackFormat {
            output,
            args,
            snapshot_bytes: 0,
            pc: 0,
            max_string_len: self.env.limits.max_string_len,
        };
        let head = format.snapshot_at() + SNAPSHOT_HEAD;
        let room = self.env.layout.record.saturating_sub(head) / 8 * 8;
        if room < MIN_SNAPSHOT {
            return Err(self.no(format!(
                "{name}() of a kernel stack in a {}-byte record",
                self.env.layout.record
            )));
        }
        format.snapshot_bytes = room;
        let at = i32::try_from(format.snapshot_at()).map_err(|_| self.no("a record offset"))?;
        let snap = u32::try_from(room).map_err(|_| self.no("a snapshot size"))?;
        let pushed = 16 * format.args.len() as i32;
        let count = format.args.len();
        let id = u32::try_from(self.interner.stacks.len())
            .ok()
            .filter(|i| i & STACK_FORMAT == 0)
            .ok_or_else(|| self.no("too many stack formats"))?
            | STACK_FORMAT;
        self.interner.stacks.push(format);
        let cpu_number = self.env.facts.cpu_number;
        let copied = at + 8;
        let regs = at + 16;
        let stack = at + SNAPSHOT_HEAD as i32;
        let r = (|| {
            let mut skip = self.a.create_label();
            let mut done = self.a.create_label();
            let mut next = self.a.create_label();
            let mut stop = self.a.create_label();
            rings.emit_reserve(self.a, cpu_number, rdi, skip)?;
            self.a.mov(dword_ptr(rdi + 8), id)?;
            self.a.mov(r8, rdi)?;
            for i in (0..count as i32).rev() {
                self.a.pop(rax)?;
                self.a.pop(rdx)?;
                self.a.mov(qword_ptr(r8 + 16 + 16 * i), rax)?;
                self.a.mov(qword_ptr(r8 + 16 + 16 * i + 8), rdx)?;
            }
            // The registers the site saved, and the probed code's stack pointer.
            self.a.lea(rdi, qword_ptr(r8 + regs))?;
            self.a.mov(rsi, r15)?;
            self.a.mov(ecx, REGS as u32)?;
            self.a.rep().movsb()?;
            self.a.lea(rax, qword_ptr(r15 + SAVED_BYTES))?;
            self.a.mov(qword_ptr(r8 + at), rax)?;
            self.a.mov(qword_ptr(r8 + copied), 0)?;
            // Bytes to copy: the room, or up to the stack's 16 KiB boundary if nearer.
            self.a.neg(rax)?;
            self.a.and(eax, (STACK_SIZE - 1) as i32)?;
            self.a.mov(ecx, snap)?;
            self.a.cmp(rax, rcx)?;
            self.a.cmova(rax, rcx)?;
            // [rsp] = bytes to copy, [rsp + 8] = the record; then a page at a time, and a
            // page that faults ends the copy.
            self.a.push(r8)?;
            self.a.push(rax)?;
            self.a.set_label(&mut next)?;
            self.a.mov(r8, qword_ptr(rsp + 8))?;
            self.a.mov(rcx, qword_ptr(r8 + copied))?;
            self.a.mov(rdx, qword_ptr(rsp))?;
            self.a.sub(rdx, rcx)?;
            self.a.jbe(stop)?;
            self.a.lea(rsi, qword_ptr(r15 + SAVED_BYTES))?;
            self.a.add(rsi, rcx)?;
            self.a.mov(eax, esi)?;
            self.a.and(eax, PAGE - 1)?;
            self.a.mov(r9d, PAGE as u32)?;
            self.a.sub(r9, rax)?;
            self.a.cmp(rdx, r9)?;
            self.a.cmova(rdx, r9)?;
            self.a.lea(rdi, qword_ptr(r8 + stack))?;
            self.a.add(rdi, rcx)?;
            self.a.push(rdx)?;
            self.a.push(rdx)?; // keeps the stack 16-byte aligned
            self.a.call(copy)?;
            self.a.pop(rdx)?;
            self.a.pop(rdx)?;
            self.a.test(rax, rax)?;
            self.a.jnz(stop)?;
            self.a.mov(r8, qword_ptr(rsp + 8))?;
            self.a.add(qword_ptr(r8 + copied), rdx)?;
            self.a.jmp(next)?;
            self.a.set_label(&mut stop)?;
            self.a.mov(r8, qword_ptr(rsp + 8))?;
            self.a.add(rsp, 16)?;
            self.a.rdtsc()?;
            self.a.shl(rdx, 32)?;
            self.a.or(rax, rdx)?;
            self.a.or(rax, 1)?; // never 0: 0 marks an unfinished record
            self.a.mov(qword_ptr(r8), rax)?;
            self.a.jmp(done)?;
            self.a.set_label(&mut skip)?;
            self.a.add(rsp, pushed)?;
            self.a.set_label(&mut done)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        Ok(K::Long)
    }
}
