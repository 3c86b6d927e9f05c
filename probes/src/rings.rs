//! Per-vCPU ring buffers in the patch heap (DESIGN.md, key mechanism 6), shared by `exotap
//! trace` (entry/return records) and compiled probes (output records).
//!
//! Each vCPU's ring is a [`HEADER`]-byte header whose first `u64` is the head (records ever
//! reserved there, taken with `lock xadd`), then `slots` records of `record` bytes. A record's
//! first `u64` (its TSC) is stored last by its writer and is never 0 once written, so 0 means
//! "not finished yet". The host drains the rings with the guest stopped: from where it stopped
//! last ([`window`]) up to the first unfinished record ([`take`]), then zeroes what it took, so
//! a slot being rewritten reads as unfinished. A burst of more than `slots` records between two
//! drains overwrites the oldest ones: [`window`] counts them as lost. Everything read back is
//! guest data: a head below what was taken, or past it by more than a ring, never panics.

use iced_x86::code_asm::{
    eax, edx, qword_ptr, rax, rcx, rdx, AsmRegister64, CodeAssembler, CodeLabel,
};
use iced_x86::{Code, IcedError, Instruction, MemoryOperand, Register};

/// Bytes of a ring's header.
pub const HEADER: u64 = 64;

/// One ring per vCPU, laid out one after the other from `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingSet {
    /// The first ring (a guest virtual address in the patch heap).
    pub base: u64,
    /// Rings (vCPUs).
    pub cpus: u32,
    /// Records per ring (a power of two).
    pub slots: u32,
    /// Bytes per record (a power of two, at least 8).
    pub record: u64,
}

impl RingSet {
    /// Bytes of one vCPU's ring.
    pub fn ring_bytes(&self) -> u64 {
        HEADER + u64::from(self.slots) * self.record
    }

    /// Bytes of all the rings.
    pub fn bytes(&self) -> u64 {
        self.ring_bytes() * u64::from(self.cpus)
    }

    /// Address of vCPU `cpu`'s ring (its head).
    pub fn ring(&self, cpu: u32) -> u64 {
        self.base + u64::from(cpu) * self.ring_bytes()
    }

    /// Address of record slot `slot` of vCPU `cpu`'s ring.
    pub fn slot(&self, cpu: u32, slot: u64) -> u64 {
        self.ring(cpu) + HEADER + slot * self.record
    }

    /// Reserves a record in the running vCPU's ring and leaves its address in `dst` (not
    /// rax, rcx or rdx); jumps to `skip` when the vCPU number (at the per-CPU offset
    /// `cpu_number`) has no ring. Clobbers rax, rcx, rdx and the flags.
    ///
    /// # Errors
    /// When the assembler refuses an instruction.
    pub fn emit_reserve(
        &self,
        a: &mut CodeAssembler,
        cpu_number: u64,
        dst: AsmRegister64,
        skip: CodeLabel,
    ) -> Result<(), IcedError> {
        let mut cpu = Instruction::with2(
            Code::Mov_r32_rm32,
            Register::EAX,
            MemoryOperand::with_base_displ(Register::None, cpu_number as i64),
        )?;
        cpu.set_segment_prefix(Register::GS);
        cpu.set_memory_displ_size(4);
        a.add_instruction(cpu)?;
        a.cmp(eax, self.cpus)?;
        a.jae(skip)?;
        match i32::try_from(self.ring_bytes()) {
            Ok(ring) => a.imul_3(rax, rax, ring)?,
            Err(_) => {
                a.mov(rcx, self.ring_bytes())?;
                a.imul_2(rax, rcx)?;
            }
        }
        a.add_instruction(Instruction::with2(
            Code::Lea_r64_m,
            Register::RCX,
            MemoryOperand::with_base_displ(Register::RIP, self.base as i64),
        )?)?;
        a.add(rcx, rax)?;
        a.mov(edx, 1)?;
        a.lock().xadd(qword_ptr(rcx), rdx)?;
        a.and(edx, self.slots - 1)?;
        a.shl(rdx, self.record.trailing_zeros())?;
        a.lea(dst, qword_ptr(rcx + rdx + HEADER as i32))
    }
}

/// The records of one ring still to take: from the first not yet taken, or the oldest still
/// in the ring when a burst overwrote some; returns that index and how many were lost.
pub fn window(head: u64, taken: u64, slots: u32) -> (u64, u64) {
    // A head below what was taken cannot come from the patches: trust the head.
    let taken = taken.min(head);
    let oldest = head.saturating_sub(u64::from(slots));
    if taken < oldest {
        (oldest, oldest - taken)
    } else {
        (taken, 0)
    }
}

/// The records `[from, to)` as (first slot, count) spans of a ring of `slots` records: one,
/// or two where they wrap; at most a ring's worth.
pub fn spans(from: u64, to: u64, slots: u32) -> Vec<(u64, u64)> {
    let slots = u64::from(slots.max(1));
    let count = to.saturating_sub(from).min(slots);
    let first = from % slots;
    let head_part = count.min(slots - first);
    let mut out = Vec::new();
    if head_part > 0 {
        out.push((first, head_part));
    }
    if count > head_part {
        out.push((0, count - head_part));
    }
    out
}

/// Splits consecutive records of `record` bytes; stops at the first unfinished one (first
/// `u64` 0) unless `last`, which skips it. Returns the finished records and how many records
/// (finished or skipped) were consumed.
pub fn take(bytes: &[u8], record: usize, last: bool) -> (Vec<&[u8]>, u64) {
    let mut out = Vec::new();
    let mut consumed = 0;
    for chunk in bytes.chunks_exact(record.max(8)) {
        let tsc = u64::from_le_bytes(chunk[..8].try_into().unwrap_or_default());
        if tsc == 0 && !last {
            break;
        }
        consumed += 1;
        if tsc != 0 {
            out.push(chunk);
        }
    }
    (out, consumed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_takes_from_the_last_drain_or_counts_what_a_burst_overwrote() {
        assert_eq!(window(10, 4, 8), (4, 0));
        assert_eq!(window(20, 4, 8), (12, 8));
        assert_eq!(
            window(3, 9, 8),
            (3, 0),
            "a head below what was taken is trusted"
        );
    }

    #[test]
    fn spans_split_where_the_ring_wraps_and_never_exceed_a_ring() {
        assert_eq!(spans(6, 10, 8), vec![(6, 2), (0, 2)]);
        assert_eq!(spans(0, 100, 8), vec![(0, 8)]);
        assert_eq!(spans(5, 5, 8), Vec::<(u64, u64)>::new());
    }

    #[test]
    fn take_waits_for_an_unfinished_record_until_the_last_drain() {
        let mut bytes = vec![0u8; 3 * 16];
        bytes[0] = 1;
        bytes[32] = 3;

        let (now, n) = take(&bytes, 16, false);
        let (last, m) = take(&bytes, 16, true);

        assert_eq!((now.len(), n), (1, 1));
        assert_eq!((last.len(), m), (2, 3));
    }

    #[test]
    fn ring_addresses_follow_the_layout() {
        let set = RingSet {
            base: 0x1000,
            cpus: 2,
            slots: 4,
            record: 32,
        };

        assert_eq!((set.ring_bytes(), set.bytes()), (64 + 128, 2 * 192));
        assert_eq!(
            (set.ring(1), set.slot(1, 2)),
            (0x1000 + 192, 0x1000 + 192 + 64 + 64)
        );
    }
}
