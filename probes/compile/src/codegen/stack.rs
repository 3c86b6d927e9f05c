//! Kernel stacks in a compiled body: `print_backtrace()`, and `backtrace()` /
//! `sprint_backtrace()` as arguments of `printf`/`print`/`println`, as records that carry a
//! stack snapshot (the saved registers and the stack bytes above the probed code's stack
//! pointer) for the host to unwind. The record layout and the bounds of the copy are in
//! [`crate::snapshot`].
//!
//! `backtrace()` anywhere else (a map key, `s[backtrace()] <<< 1`, a local, a comparison)
//! is a value the hit needs now, so the guest unwinds: the body lays a `struct pt_regs` of
//! the probed code out on its stack (the registers the site saved, the site's address as
//! `ip`, the stack pointer the probed code had, kernel `cs`/`ss`; in a return probe the
//! return address the trampoline put back and the stack above it) and calls the kernel's
//! own `stack_trace_save_regs(regs, store, n, 0)`: the guest's ORC unwinder, the one behind
//! `/proc/PID/stack`, walks from the probe point as exotap's host unwinder walks from a
//! stopped vCPU's registers, frame for frame (tests/compiled_qemu/stacks.rs compares the two).
//! Exotap's patch code has no ORC entries, but the walk starts at the probed code and
//! never passes through it. The pcs become the interpreter's text (`0x...` blank
//! separated, cut at MAXSTRINGLEN), a string built in the guest ([`super::strings`]).
//!
//! The walk runs with interrupts off and a per-CPU guard bit in the data's header: a probe
//! on a function the unwinder itself runs (or one in an NMI) finds its CPU's bit set and
//! gets an empty stack, counted ([`field::STACKS_BUSY`]), instead of recursing.

use iced_x86::code_asm::*;
use iced_x86::{Code, Instruction, Register};

use exotap_lang::ast::*;

use super::super::data::{field, OutputKind, MAX_PRINT_ARGS, STACK_GUARD_CPUS};
use super::super::snapshot::{
    stack_arg, StackArg, StackFormat, StackOutput, REGS, SNAPSHOT_HEAD, STACK_FORMAT, STACK_SIZE,
};
use super::memory::text_call;
use super::{rip, saved_offset, Gen, K, R, SAVED_BYTES};

/// Fewest stack bytes a record must have room for (a few frames).
const MIN_SNAPSHOT: u64 = 512;
/// Bytes of a page: the copy goes a page at a time and stops at the first that faults.
const PAGE: i32 = 4096;
/// Most frames `backtrace()` asks the guest's unwinder for (exotap's host unwinder stops at
/// as many).
const MAX_FRAMES: u32 = 64;
/// Bytes of one frame in `backtrace()`'s text: `0x` and 16 digits of a kernel address, and
/// the blank before the next.
const FRAME_TEXT: u32 = 19;
/// Bytes of x86-64's `struct pt_regs` (rounded up to 16).
const PT_REGS: i32 = 176;
/// `struct pt_regs` offsets: the general registers in its order, then the rest.
const PT_REGS_GPRS: [(Register, i32); 15] = [
    (Register::R15, 0),
    (Register::R14, 8),
    (Register::R13, 16),
    (Register::R12, 24),
    (Register::RBP, 32),
    (Register::RBX, 40),
    (Register::R11, 48),
    (Register::R10, 56),
    (Register::R9, 64),
    (Register::R8, 72),
    (Register::RAX, 80),
    (Register::RCX, 88),
    (Register::RDX, 96),
    (Register::RSI, 104),
    (Register::RDI, 112),
];
const PT_ORIG_AX: i32 = 120;
const PT_IP: i32 = 128;
const PT_CS: i32 = 136;
const PT_FLAGS: i32 = 144;
const PT_SP: i32 = 152;
const PT_SS: i32 = 160;
/// The kernel's code and stack selectors (`__KERNEL_CS`, `__KERNEL_DS`).
const KERNEL_CS: i32 = 0x10;
const KERNEL_DS: i32 = 0x18;
/// Offset of the flags the site saved, from `r15` (above the 15 registers).
const SAVED_FLAGS: i32 = 15 * 8;

impl Gen<'_, '_> {
    /// `backtrace()` as a value: the guest's unwinder from the probe point, as a string
    /// built in the guest (see the module documentation).
    pub(super) fn backtrace_string(&mut self) -> R<K> {
        let save = self.env.facts.stack_save.ok_or_else(|| {
            self.no("backtrace() as a value (the kernel has no stack_trace_save_regs)")
        })?;
        let room = self.build_room();
        // Frames past the text's room are cut anyway.
        let frames = (room / FRAME_TEXT + 1).min(MAX_FRAMES);
        let store = ((frames * 8 + 15) & !15) as i32;
        let area = store + PT_REGS;
        let regs = store;
        let pc = self.pc;
        let at_return = self.point.is_return;
        let data = self.env.data;
        let cpu_number = self.env.facts.cpu_number;
        let r = (|| {
            let mut busy = self.a.create_label();
            let mut walked = self.a.create_label();
            // [rsp, +store): the pcs; [rsp + store, +PT_REGS): the probed code's pt_regs.
            self.a.sub(rsp, area)?;
            for (reg, at) in PT_REGS_GPRS {
                self.a.mov(rax, qword_ptr(r15 + saved_offset(reg)))?;
                self.a.mov(qword_ptr(rsp + regs + at), rax)?;
            }
            self.a.mov(qword_ptr(rsp + regs + PT_ORIG_AX), -1)?;
            if at_return {
                // The trampoline put the original return address back in the slot at
                // r15 + SAVED_BYTES: the code returned there, its stack one word above.
                self.a.mov(rax, qword_ptr(r15 + SAVED_BYTES))?;
                self.a.mov(qword_ptr(rsp + regs + PT_IP), rax)?;
                self.a.lea(rax, qword_ptr(r15 + SAVED_BYTES + 8))?;
            } else {
                self.a.mov(rax, pc)?;
                self.a.mov(qword_ptr(rsp + regs + PT_IP), rax)?;
                self.a.lea(rax, qword_ptr(r15 + SAVED_BYTES))?;
            }
            self.a.mov(qword_ptr(rsp + regs + PT_SP), rax)?;
            self.a.mov(qword_ptr(rsp + regs + PT_CS), KERNEL_CS)?;
            self.a.mov(rax, qword_ptr(r15 + SAVED_FLAGS))?;
            self.a.mov(qword_ptr(rsp + regs + PT_FLAGS), rax)?;
            self.a.mov(qword_ptr(rsp + regs + PT_SS), KERNEL_DS)?;
            // Interrupts off, then this CPU's guard bit: set already, the unwinder is busy
            // here (this probe stands in its path, or came in an NMI during a walk).
            guard_enter(self.a, data, cpu_number, busy)?;
            self.a.push(rax)?; // the CPU, and keeps the stack 16-byte aligned
            self.a.lea(rdi, qword_ptr(rsp + 16 + regs))?;
            self.a.lea(rsi, qword_ptr(rsp + 16))?;
            self.a.mov(edx, frames)?;
            self.a.xor(ecx, ecx)?;
            self.a.call(save)?;
            self.a.pop(rdx)?;
            guard_leave(self.a, data)?;
            self.a.jmp(walked)?;
            self.a.set_label(&mut busy)?;
            guard_busy(self.a, data)?;
            self.a.xor(eax, eax)?;
            self.a.set_label(&mut walked)?;
            self.a.popfq()?;
            // The frames found, kept where pt_regs.orig_ax was.
            self.a.mov(eax, eax)?;
            self.a.mov(qword_ptr(rsp + regs + PT_ORIG_AX), rax)
        })();
        asm!(self, r)?;
        self.open_buffer()?;
        let bytes = self.build_bytes();
        let r = (|| {
            // rdi/rcx: the output and its room (r8 stays 0: every pc is readable);
            // r9: the frame, r10: the frames, r11: the pc being written.
            let mut frame = self.a.create_label();
            let mut digit = self.a.create_label();
            let mut first = self.a.create_label();
            let mut full = self.a.create_label();
            self.a.xor(r9d, r9d)?;
            self.a
                .mov(r10, qword_ptr(rsp + bytes + regs + PT_ORIG_AX))?;
            self.a.set_label(&mut frame)?;
            self.a.cmp(r9, r10)?;
            self.a.jae(full)?;
            self.a.test(r9, r9)?;
            self.a.jz(first)?;
            self.put_byte(b' ', full)?;
            self.a.set_label(&mut first)?;
            self.put_byte(b'0', full)?;
            self.put_byte(b'x', full)?;
            self.a.mov(r11, qword_ptr(rsp + bytes + 8 * r9))?;
            // Digits from the highest non-zero one ("0" for 0), as `{:#x}` writes them:
            // rdx = the shift of the next digit.
            self.a.mov(rax, r11)?;
            self.a.or(rax, 1)?;
            self.a.bsr(rdx, rax)?;
            self.a.and(edx, !3)?;
            self.a.set_label(&mut digit)?;
            self.a.test(rcx, rcx)?;
            self.a.jz(full)?;
            self.a.mov(rax, r11)?;
            self.a.xchg(rcx, rdx)?;
            self.a.shr(rax, cl)?;
            self.a.xchg(rcx, rdx)?;
            self.a.and(eax, 15)?;
            self.a.cmp(eax, 10)?;
            let mut decimal = self.a.create_label();
            self.a.jb(decimal)?;
            self.a.add(eax, i32::from(b'a' - b'0' - 10))?;
            self.a.set_label(&mut decimal)?;
            self.a.add(eax, i32::from(b'0'))?;
            self.a.mov(byte_ptr(rdi), al)?;
            self.a.inc(rdi)?;
            self.a.dec(rcx)?;
            self.a.sub(edx, 4)?;
            self.a.jns(digit)?;
            self.a.inc(r9)?;
            self.a.jmp(frame)?;
            self.a.set_label(&mut full)?;
            self.a.nop()
        })();
        asm!(self, r)?;
        self.close_buffer(area)
    }

    /// Writes `byte` to the build buffer (rdi, room rcx), or jumps to `full` when there is
    /// no room.
    fn put_byte(&mut self, byte: u8, full: CodeLabel) -> Result<(), IcedError> {
        self.a.test(rcx, rcx)?;
        self.a.jz(full)?;
        self.a.mov(byte_ptr(rdi), u32::from(byte))?;
        self.a.inc(rdi)?;
        self.a.dec(rcx)
    }

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
            // In a return trampoline r15 + SAVED_BYTES is the return-address slot.
            at_return: self.point.is_return,
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
            exotap_probes_base::rings::RingSet::emit_finish(self.a, r8, rax)?;
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

/// Interrupts off (the flags pushed) and this CPU's guard bit in the data's header taken, for
/// a call into a kernel routine a probe may stand in the path of (the unwinder, the symbol
/// lookup). Jumps to `busy`, the flags still pushed, where the bit is set already (a probe
/// inside that routine, or an NMI during it) or the CPU is past [`STACK_GUARD_CPUS`]. Leaves
/// the CPU in rax; clobbers rcx.
pub(super) fn guard_enter(
    a: &mut CodeAssembler,
    data: u64,
    cpu_number: u64,
    busy: CodeLabel,
) -> Result<(), IcedError> {
    a.pushfq()?;
    a.cli()?;
    exotap_probes_base::rings::emit_cpu_number(a, cpu_number)?;
    a.cmp(eax, STACK_GUARD_CPUS)?;
    a.jae(busy)?;
    a.add_instruction(Instruction::with2(
        Code::Lea_r64_m,
        Register::RCX,
        rip(data + field::STACK_GUARD),
    )?)?;
    a.lock().bts(qword_ptr(rcx), rax)?;
    a.jc(busy)
}

/// Gives back the guard bit of the CPU in rdx ([`guard_enter`]); clobbers rcx. The flags are
/// still the caller's to pop.
pub(super) fn guard_leave(a: &mut CodeAssembler, data: u64) -> Result<(), IcedError> {
    a.add_instruction(Instruction::with2(
        Code::Lea_r64_m,
        Register::RCX,
        rip(data + field::STACK_GUARD),
    )?)?;
    a.lock().btr(qword_ptr(rcx), rdx)
}

/// Counts a call that found its guard bit set ([`field::STACKS_BUSY`]).
pub(super) fn guard_busy(a: &mut CodeAssembler, data: u64) -> Result<(), IcedError> {
    let mut inc = Instruction::with1(Code::Inc_rm64, rip(data + field::STACKS_BUSY))?;
    inc.set_has_lock_prefix(true);
    a.add_instruction(inc)
}
