//! The patches a splice enters: counting, nullifying and replacing ones, and the
//! entry/exit pairs of `exotap time` and `exotap trace`.

use anyhow::{bail, Context};
use exotap_introspect::layout::TaskOffsets;
use iced_x86::code_asm::{rax, CodeAssembler};
use iced_x86::Register;

use crate::rings::RingSet;
use crate::splice::{generate, CallReturn, PatchRequest, Site};

use super::Action;

/// `jmp rel32` from `from` to `to`.
///
/// # Errors
/// When `to` is out of rel32 reach of `from`.
pub fn jmp_rel32(from: u64, to: u64) -> anyhow::Result<[u8; 5]> {
    let rel = i32::try_from(to.wrapping_sub(from.wrapping_add(5)) as i64)
        .with_context(|| format!("{to:#x} is out of rel32 reach of {from:#x}"))?;
    let mut out = [0xe9, 0, 0, 0, 0];
    out[1..].copy_from_slice(&rel.to_le_bytes());
    Ok(out)
}

/// A patch that counts and then returns `value` (nullify) or jumps to `other` (replace),
/// never running the spliced instruction: the code `exotap nullify` and `exotap replace`
/// splice in at a function's entry (`exotap regress` runs it too). `return_thunk`: where the
/// kernel returns through (`__x86_return_thunk`), else a `ret`.
///
/// # Errors
/// For an action that runs the original instruction, or code the assembler refuses.
pub fn diverting_patch(
    at: u64,
    counter: u64,
    action: Action,
    return_thunk: Option<u64>,
) -> anyhow::Result<Vec<u8>> {
    let mut a = CodeAssembler::new(64)?;
    // Flags are dead at a function entry (SysV: callers assume they are clobbered).
    let mut inc = iced_x86::Instruction::with1(
        iced_x86::Code::Inc_rm64,
        iced_x86::MemoryOperand::with_base_displ(Register::RIP, counter as i64),
    )?;
    inc.set_has_lock_prefix(true);
    a.add_instruction(inc)?;
    a.set_prefer_short_branch(false);
    match action {
        Action::Nullify(value) => {
            a.mov(rax, value)?;
            match return_thunk {
                Some(thunk) => a.jmp(thunk)?,
                None => a.ret()?,
            }
        }
        Action::Replace(other) => a.jmp(other)?,
        Action::Count
        | Action::Time
        | Action::Trace(_)
        | Action::Compiled(_)
        | Action::Enter(_) => {
            bail!("this patch relocates the original instruction")
        }
    }
    Ok(a.assemble(at)?)
}

// ---------------------------------------------------------------------------------------
// Entry/exit pairs inside the guest (`exotap time`).
//
// The entry patch claims a slot in a table of calls in flight, keyed by the address of the
// return-address slot on the stack (tasks have their own stacks, and nested calls sit
// deeper; only a tail call from one timed function into another shares its caller's, and
// chains on it: `emit_swap`), stores the original return address and an rdtsc there, and
// swaps the return address for the function's return trampoline. The trampoline finds the
// slot again (the `ret` left rsp just above it), puts the original return address back
// where `ret` will pop it, adds the elapsed cycles to a log2 histogram, frees the slot and
// returns to the caller. A full table (more than INFLIGHT calls in flight) skips the timing
// of that call and counts a miss. Removal puts back every swapped return address still on
// a stack, as kretprobes do; the trampolines stay in the heap for calls in the middle of one.
// ---------------------------------------------------------------------------------------

// The table of calls in flight and its hash are the compiled probes' (one table layout for
// `time`, `trace` and compiled `.return` probes).
use crate::compile::site::{emit_swap, emit_unswap, ReturnSwap};
/// Histogram buckets (log2 of cycles).
pub const BUCKETS: usize = 64;

fn rip_mem(addr: u64) -> iced_x86::MemoryOperand {
    iced_x86::MemoryOperand::with_base_displ(Register::RIP, addr as i64)
}

/// Per-vCPU ring buffers of entry/exit records (`exotap trace`).
///
/// Each vCPU's ring is a 64-byte header (the `u64` head: records ever reserved, with
/// `lock xadd`) and `slots` records of [`TRACE_RECORD`] bytes: the mark at +0 (the lap tag
/// while the record is written, then the TSC with the tag in bit 0: [`crate::rings`]), value
/// at +8 (the first argument at entry, the return value at exit), function id at +16, kind at
/// +20 (1 entry, 2 exit), stack slot at +24 (pairs an entry with its exit), the running task's
/// pid at +32 and its `comm` (16 bytes) at +40 (zero when the kernel's task offsets are
/// unknown), 8 bytes reserved. The mark is stored last. The host drains the rings while the
/// guest runs: through the shared RAM with the vCPUs running where it has it
/// ([`crate::rings::drain_concurrent`], which writes nothing into the rings), else every 250
/// ms for `exotap trace` with the guest stopped for the read, and at removal
/// ([`super::Splicer::drain_rings`]). A stopped drain takes the records from where it stopped
/// last up to the first unfinished one, then zeroes the records it took. A burst of more
/// than `slots` records between two drains overwrites the oldest ones: those are counted as
/// lost (overruns).
#[derive(Debug, Clone, Copy)]
pub struct Rings {
    /// The rings (crate::rings: the protocol `trace` shares with compiled probes).
    pub set: RingSet,
    /// The per-CPU offset of `cpu_number` (gs-relative).
    pub cpu_number: u64,
    /// Where the running task's pid and name are: the per-CPU offset of `current_task`, and
    /// `task_struct`'s pid and comm offsets.
    pub task: Option<(u64, TaskOffsets)>,
}

/// Bytes per trace record.
pub const TRACE_RECORD: u64 = 64;

/// Writes one record; r8 = TSC, `value` = the value, rsi = the stack slot. Clobbers rax,
/// rcx, rdx and the flags.
fn emit_record(
    a: &mut CodeAssembler,
    rings: &Rings,
    id: u32,
    kind: u32,
    value: iced_x86::code_asm::AsmRegister64,
) -> anyhow::Result<()> {
    use iced_x86::code_asm::{dword_ptr, qword_ptr, r8, rdx, rsi};
    let mut skip = a.create_label();
    rings.set.emit_reserve(a, rings.cpu_number, rdx, skip)?;
    a.mov(qword_ptr(rdx + 8), value)?;
    a.mov(dword_ptr(rdx + 16), id)?;
    a.mov(dword_ptr(rdx + 20), kind)?;
    a.mov(qword_ptr(rdx + 24), rsi)?;
    match rings.task {
        Some((current_task, task)) => {
            use iced_x86::code_asm::{ecx, rcx};
            let mut cur = iced_x86::Instruction::with2(
                iced_x86::Code::Mov_r64_rm64,
                Register::RAX,
                iced_x86::MemoryOperand::with_base_displ(Register::None, current_task as i64),
            )?;
            cur.set_segment_prefix(Register::GS);
            cur.set_memory_displ_size(4);
            a.add_instruction(cur)?;
            let pid = i32::try_from(task.pid)?;
            let comm = i32::try_from(task.comm)?;
            a.mov(ecx, dword_ptr(rax + pid))?;
            a.mov(dword_ptr(rdx + 32), ecx)?;
            a.mov(rcx, qword_ptr(rax + comm))?;
            a.mov(qword_ptr(rdx + 40), rcx)?;
            a.mov(rcx, qword_ptr(rax + comm + 8))?;
            a.mov(qword_ptr(rdx + 48), rcx)?;
        }
        None => {
            a.mov(dword_ptr(rdx + 32), 0)?;
            a.mov(qword_ptr(rdx + 40), 0)?;
            a.mov(qword_ptr(rdx + 48), 0)?;
        }
    }
    RingSet::emit_finish(a, rdx, r8)?;
    a.set_label(&mut skip)?;
    a.nop()?;
    Ok(())
}

/// A built entry patch: its code (placed at the `trampoline` address of its
/// [`ReturnSwap`]), the splice that enters it, and where its entry half begins.
#[derive(Debug, Clone)]
pub struct EntryPatch {
    /// The return trampoline, then the entry half, then the relocated entry instruction.
    pub code: Vec<u8>,
    /// The `jmp rel32` written over the entry instruction.
    pub splice: [u8; 5],
    /// Where the splice jumps: the entry half.
    pub entry: u64,
}

/// The code `exotap time` (a log2 histogram of cycles at `histogram`) or `exotap trace`
/// (entry and return records into `trace`'s rings, with its id) splices in at the entry
/// `site`: the return trampoline at `swap.trampoline`, the entry half (claims a slot of the
/// table of calls in flight and swaps the return address), the relocated entry instruction
/// and a jump back. One builder for the splicer and `exotap regress`, which runs this code
/// under its oracles.
///
/// # Errors
/// When the instruction cannot be relocated, or the assembler refuses the code.
pub fn timed_entry_patch(
    site: &Site,
    swap: &ReturnSwap,
    histogram: u64,
    trace: Option<(&Rings, u32)>,
) -> anyhow::Result<EntryPatch> {
    let mut code = timing_trampoline(swap.trampoline, swap.table, histogram, trace)?;
    code.resize(code.len().div_ceil(16) * 16, 0xcc);
    let entry = swap.trampoline + code.len() as u64;
    let half = timing_entry(entry, swap, trace)?;
    let moved = generate(&PatchRequest {
        original: &site.bytes,
        addr: site.addr,
        patch: entry + half.len() as u64,
        probes: &[],
        live: site.live,
        call_return: CallReturn::default(),
    })?;
    code.extend_from_slice(&half);
    code.extend_from_slice(&moved.code);
    Ok(EntryPatch {
        code,
        splice: jmp_rel32(site.addr, entry)?,
        entry,
    })
}

/// The entry half: claim a slot, save the return address and the TSC, swap in the
/// trampoline (and with `trace`, record the entry with the first argument). Preserves every
/// register and (function entry) needs no flags.
fn timing_entry(
    at: u64,
    swap: &ReturnSwap,
    trace: Option<(&Rings, u32)>,
) -> anyhow::Result<Vec<u8>> {
    use iced_x86::code_asm::{qword_ptr, r8, rcx, rdi, rdx, rsi, rsp};
    let mut a = CodeAssembler::new(64)?;
    let mut done = a.create_label();
    a.push(rax)?;
    a.push(rcx)?;
    a.push(rdx)?;
    a.push(rsi)?;
    a.push(r8)?;
    a.lea(rsi, qword_ptr(rsp + 40))?;
    emit_swap(&mut a, swap, done)?;
    if let Some((rings, id)) = trace {
        a.mov(r8, rax)?;
        emit_record(&mut a, rings, id, 1, rdi)?;
    }
    a.set_label(&mut done)?;
    a.pop(r8)?;
    a.pop(rsi)?;
    a.pop(rdx)?;
    a.pop(rcx)?;
    a.pop(rax)?;
    Ok(a.assemble(at)?)
}

/// The return trampoline of one timed (histogram) or traced (ring record) function.
fn timing_trampoline(
    at: u64,
    table: u64,
    histogram: u64,
    trace: Option<(&Rings, u32)>,
) -> anyhow::Result<Vec<u8>> {
    use iced_x86::code_asm::{qword_ptr, r8, r9, rcx, rdx, rsi, rsp};
    let mut a = CodeAssembler::new(64)?;
    a.lea(rsp, qword_ptr(rsp - 8))?; // the slot `ret` popped; no flags touched
    a.push(rax)?;
    a.push(rcx)?;
    a.push(rdx)?;
    a.push(rsi)?;
    a.push(r8)?;
    a.push(r9)?;
    a.pushfq()?;
    a.mov(r9, rax)?; // the return value
    a.lea(rsi, qword_ptr(rsp + 56))?;
    emit_unswap(&mut a, table, at)?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(r8, rax)?;
    a.sub(rax, qword_ptr(rcx + 16))?;
    a.mov(qword_ptr(rcx), 0)?;
    match trace {
        Some((rings, id)) => emit_record(&mut a, rings, id, 2, r9)?,
        None => {
            a.or(rax, 1)?;
            a.bsr(rdx, rax)?;
            a.add_instruction(iced_x86::Instruction::with2(
                iced_x86::Code::Lea_r64_m,
                Register::RCX,
                rip_mem(histogram),
            )?)?;
            a.lock().inc(qword_ptr(rcx + rdx * 8))?;
        }
    }
    a.popfq()?;
    a.pop(r9)?;
    a.pop(r8)?;
    a.pop(rsi)?;
    a.pop(rdx)?;
    a.pop(rcx)?;
    a.pop(rax)?;
    a.ret()?;
    Ok(a.assemble(at)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jmp_rel32_encodes_the_displacement_from_the_next_instruction() {
        assert_eq!(
            jmp_rel32(0xffff_ffff_8100_0000, 0xffff_ffff_8100_0105).unwrap(),
            [0xe9, 0x00, 0x01, 0x00, 0x00]
        );
        assert!(jmp_rel32(0xffff_ffff_8100_0000, 0x4000_0000_0000).is_err());
    }

    /// A traced function's whole patch (its trampoline rounded up to 16 bytes as the
    /// splicer places it, its entry half, the longest relocated instruction) fits the space
    /// the splicer gives one timed or traced site; so does a timed one.
    #[test]
    fn a_traced_or_timed_patch_fits_the_space_a_site_is_given() {
        let heap = 0xffff_ffff_c000_0000u64;
        let rings = Rings {
            set: RingSet {
                base: heap + 0x10_0000,
                cpus: 64,
                slots: 4096,
                record: TRACE_RECORD,
            },
            cpu_number: 0x2_0000,
            task: Some((
                0x2_1000,
                TaskOffsets {
                    pid: 0x9a8,
                    comm: 0xbc0,
                },
            )),
        };
        let swap = ReturnSwap {
            table: heap + 0x20_0000,
            misses: heap + 0x30_0000,
            trampoline: heap,
            heap: (heap, heap + (64 << 20)),
        };
        for trace in [Some((&rings, 7)), None] {
            let tramp = timing_trampoline(heap, swap.table, heap + 0x40_0000, trace).unwrap();
            let entry_at = heap + tramp.len().div_ceil(16) as u64 * 16;
            let entry = timing_entry(entry_at, &swap, trace).unwrap();
            let total = (entry_at - heap) + entry.len() as u64 + 15;
            assert!(
                total <= super::super::MAX_PATCH,
                "a {} patch takes {total} bytes, more than {}",
                if trace.is_some() { "traced" } else { "timed" },
                super::super::MAX_PATCH
            );
        }
    }

    #[test]
    fn nullify_patch_counts_sets_rax_and_returns_through_the_thunk() {
        let at = 0xffff_ffff_c000_0000;
        let counter = at + 0x1000;
        let thunk = 0xffff_ffff_81e0_1ef0;

        let code = diverting_patch(at, counter, Action::Nullify(4242), Some(thunk)).unwrap();

        let insns: Vec<_> =
            iced_x86::Decoder::with_ip(64, &code, at, iced_x86::DecoderOptions::NONE)
                .into_iter()
                .collect();
        assert_eq!(insns.len(), 3);
        assert!(insns[0].has_lock_prefix());
        assert_eq!(insns[0].ip_rel_memory_address(), counter);
        assert_eq!(insns[1].immediate64(), 4242);
        assert_eq!(insns[2].near_branch_target(), thunk);
    }
}
