//! Per-vCPU ring buffers in the patch heap (DESIGN.md, key mechanism 6), shared by `exotap
//! trace` (entry/return records) and compiled probes (output records).
//!
//! Each vCPU's ring is a [`HEADER`]-byte header whose first `u64` is the head (records ever
//! reserved there, taken with `lock xadd`), then `slots` records of `record` bytes. A record's
//! first `u64` (its TSC) is stored last by its writer and is never 0 once written, so 0 means
//! "not finished yet". The host takes records from where it stopped last ([`window`]) up to
//! the first unfinished one ([`take`]), then zeroes what it took, so a slot being rewritten
//! reads as unfinished. A burst of more than `slots` records between two drains overwrites
//! the oldest ones: [`window`] counts them as lost. Everything read back is guest data: a
//! head below what was taken, or past it by more than a ring, never panics.
//!
//! # Two readers
//!
//! - **Stopped** (the gdbstub path): the host pauses every vCPU, reads, zeroes, resumes. No
//!   writer runs during the read, so there is nothing to order.
//! - **Concurrent** ([`drain_concurrent`], the shared-memory path): the vCPUs keep running
//!   while the host reads the rings through guest RAM it has mapped. The protocol is
//!   lock-free on both sides (the writer never waits for the host), and its memory ordering
//!   is this:
//!
//!   *Writer* (patch code on one vCPU, x86 TSO): (W1) `lock xadd` on the head reserves index
//!   `j` (a full barrier); (W2) plain stores of the record's fields into slot `j % slots`;
//!   (W3) a plain store of the TSC into the record's first word. x86 keeps stores in program
//!   order, so a reader that sees W3 sees W2, and a reader that sees any W2/W3 store of `j`
//!   sees W1 of `j` on a later load.
//!
//!   *Reader* (host): (R1) load the head `h` with `Acquire`; for each index `i` in the
//!   window below `h`: (R2) load the record's TSC with `Acquire`: 0 means unfinished, the
//!   take ends there (it resumes at `i` next time); otherwise (R3) copy the other fields with
//!   volatile reads. Then (R4) an `Acquire` fence and a second load of the head `h2`. A
//!   record `i` whose slot a later writer could have reused during the copy has
//!   `i + slots < h2 + 1`, i.e. `i < h2 - slots`: it is dropped and counted lost, never
//!   delivered torn (if R3 saw any store of writer `i + slots`, R4 sees its W1: R4 is after
//!   R3, and x86 does not reorder loads). (R5) For every record kept, a `lock cmpxchg`
//!   replaces its TSC with 0 only if it still holds the TSC read at R2, so the zeroing never
//!   erases a newer record that finished in between (its W3 changed the TSC); a writer that
//!   reserved the slot after R4 and stores its TSC after R5 leaves a finished record.
//!
//!   One case stays unresolved by design, and is counted: after an overrun (the host was
//!   lapped), the skipped slots were never zeroed, so a writer that has reserved such a slot
//!   but not yet stored its TSC leaves the previous lap's record there, which reads as
//!   finished. It can only happen when records were already lost (the overrun count says so).

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

/// `eax` = the running vCPU's number: `mov eax, gs:[cpu_number]`, the kernel's per-CPU
/// `cpu_number` at that offset from the GS base.
///
/// # Errors
/// When the assembler refuses the instruction.
pub fn emit_cpu_number(a: &mut CodeAssembler, cpu_number: u64) -> Result<(), IcedError> {
    let mut cpu = Instruction::with2(
        Code::Mov_r32_rm32,
        Register::EAX,
        MemoryOperand::with_base_displ(Register::None, cpu_number as i64),
    )?;
    cpu.set_segment_prefix(Register::GS);
    cpu.set_memory_displ_size(4);
    a.add_instruction(cpu)
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
        emit_cpu_number(a, cpu_number)?;
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

/// Guest memory that a concurrent reader reaches while the vCPUs run: the ring addresses of
/// a [`RingSet`] (patch-heap addresses) to bytes. Every method bounds-checks its address.
pub trait RingMemory {
    /// The failure of an access (an address outside the memory).
    type Error;

    /// Loads the 8-aligned `u64` at `addr` with `Acquire` ordering.
    ///
    /// # Errors
    /// When `addr` is outside the memory or unaligned.
    fn load_acquire(&self, addr: u64) -> Result<u64, Self::Error>;

    /// Copies `buf.len()` bytes at `addr` (volatile: they may change during the copy).
    ///
    /// # Errors
    /// When the range is outside the memory.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), Self::Error>;

    /// Replaces the `u64` at `addr` with `new` if it holds `current` (atomically); whether
    /// it did.
    ///
    /// # Errors
    /// When `addr` is outside the memory or unaligned.
    fn compare_exchange(&self, addr: u64, current: u64, new: u64) -> Result<bool, Self::Error>;
}

/// What one concurrent take of one ring found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taken {
    /// The finished records one after the other, oldest first, each `record` bytes.
    pub records: Vec<u8>,
    /// Records lost: overwritten before the host read them, or reused during the read.
    pub lost: u64,
}

/// Takes vCPU `cpu`'s finished records from its ring while the vCPUs may be writing it (the
/// concurrent reader of the module documentation); `taken` is how many records of that ring
/// the host has consumed so far, and is advanced. With `last` (the guest is stopped for good)
/// an unfinished record is skipped rather than waited for, and nothing is zeroed.
///
/// # Errors
/// When the ring's memory cannot be reached (a head or slot outside the memory).
pub fn drain_concurrent<M: RingMemory>(
    mem: &M,
    set: &RingSet,
    cpu: u32,
    taken: &mut u64,
    last: bool,
) -> Result<Taken, M::Error> {
    // In batches, each validated on its own: a reader that fell behind loses only the
    // batches a writer overtook, not a whole ring's read. At most a ring's worth in all: a
    // hostile head far ahead costs one ring, no more.
    let slots = u64::from(set.slots.max(1));
    let batch = slots.min(BATCH);
    let mut out = Taken::default();
    // Room for what is there now (at most a ring): the output grows once, not by doubling.
    let head = mem.load_acquire(set.ring(cpu))?;
    let waiting = head.saturating_sub(*taken).min(slots);
    out.records
        .reserve(usize::try_from(waiting.saturating_mul(set.record)).unwrap_or(0));
    let mut budget = slots;
    while budget > 0 {
        let before = *taken;
        let more = take_batch(mem, set, cpu, taken, last, batch.min(budget), &mut out)?;
        budget = budget.saturating_sub(taken.saturating_sub(before).max(1));
        if !more {
            break;
        }
    }
    Ok(out)
}

/// Records read and validated together by [`drain_concurrent`].
const BATCH: u64 = 4096;

/// One batch of [`drain_concurrent`]: R1 to R5 of the module documentation over at most
/// `max` records; whether there may be more to take now.
///
/// R2 and R3 are done as two passes over the batch rather than record by record: first every
/// TSC (R2, `Acquire` loads, up to the first unfinished record), then one bulk copy of the
/// finished records (R3). Each record's R2 still comes before its R3, which is all the
/// protocol asks, and the bulk copy goes straight into the output (no copy per record, no
/// allocation per batch once the output has grown): measured by `benches/ring_drain.rs`,
/// this is what makes the reader several times faster than a load and a 56-byte read per
/// record.
fn take_batch<M: RingMemory>(
    mem: &M,
    set: &RingSet,
    cpu: u32,
    taken: &mut u64,
    last: bool,
    max: u64,
    out: &mut Taken,
) -> Result<bool, M::Error> {
    let slots = u64::from(set.slots.max(1));
    let record = usize::try_from(set.record.max(8)).unwrap_or(8);
    let head_at = set.ring(cpu);
    // R1.
    let head = mem.load_acquire(head_at)?;
    let (from, lost) = window(head, *taken, set.slots);
    out.lost = out.lost.saturating_add(lost);
    // Not past the ring's end in one batch: the slots of [from, end) are contiguous.
    let to_wrap = slots - from % slots;
    let end = head.min(from.saturating_add(max.min(to_wrap)));
    // R2 for each record, into the TSCs of the batch.
    let mut tscs: Vec<u64> = Vec::with_capacity(usize::try_from(end - from).unwrap_or(0));
    let mut unfinished = false;
    for index in from..end {
        let tsc = mem.load_acquire(set.slot(cpu, index % slots))?;
        if tsc == 0 && !last {
            unfinished = true;
            break;
        }
        tscs.push(tsc);
    }
    let next = from + tscs.len() as u64;
    // R3: the records [from, next) in one copy, after every TSC load above.
    let start = out.records.len();
    if !tscs.is_empty() {
        out.records.resize(start + tscs.len() * record, 0);
        mem.read(set.slot(cpu, from % slots), &mut out.records[start..])?;
    }
    // R4.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    let head_after = mem.load_acquire(head_at)?;
    let reused_below = head_after.saturating_sub(slots);
    // Records a writer may have reused during the copy are the oldest of the batch.
    let reused = usize::try_from(reused_below.saturating_sub(from).min(tscs.len() as u64))
        .unwrap_or(tscs.len());
    out.lost = out.lost.saturating_add(reused as u64);
    let mut kept = start;
    for (i, &tsc) in tscs.iter().enumerate().skip(reused) {
        if tsc == 0 {
            // Only with `last`: a record never finished, skipped.
            continue;
        }
        if !last {
            // R5: a failure means a newer record finished there; it stays for later.
            mem.compare_exchange(set.slot(cpu, (from + i as u64) % slots), tsc, 0)?;
        }
        let at = start + i * record;
        if kept != at {
            out.records.copy_within(at..at + record, kept);
        }
        // The TSC R2 read, which R5 compared with (the copy's is the same, or the record
        // was reused and is not kept).
        out.records[kept..kept + 8].copy_from_slice(&tsc.to_le_bytes());
        kept += record;
    }
    out.records.truncate(kept);
    *taken = next;
    Ok(!unfinished && next < head_after && next == end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A vCPU's writes, run between two accesses of the reader.
    type Writer = Box<dyn FnMut(&mut Vec<u8>)>;

    /// Guest memory as a flat byte array at address 0, with a hook that runs a "writer" right
    /// after the reader's n-th access (to interleave a vCPU with the reader).
    struct FakeRam {
        bytes: RefCell<Vec<u8>>,
        accesses: RefCell<u32>,
        writer_at: u32,
        writer: RefCell<Option<Writer>>,
    }

    impl FakeRam {
        fn new(len: usize) -> Self {
            Self {
                bytes: RefCell::new(vec![0; len]),
                accesses: RefCell::new(0),
                writer_at: u32::MAX,
                writer: RefCell::new(None),
            }
        }

        fn tick(&self) {
            let mut n = self.accesses.borrow_mut();
            *n += 1;
            if *n == self.writer_at {
                if let Some(w) = self.writer.borrow_mut().as_mut() {
                    w(&mut self.bytes.borrow_mut());
                }
            }
        }

        fn word(&self, addr: u64) -> u64 {
            let b = self.bytes.borrow();
            let a = addr as usize;
            u64::from_le_bytes(b[a..a + 8].try_into().unwrap())
        }
    }

    impl RingMemory for FakeRam {
        type Error = ();

        fn load_acquire(&self, addr: u64) -> Result<u64, ()> {
            self.tick();
            let len = self.bytes.borrow().len() as u64;
            if addr + 8 > len {
                return Err(());
            }
            Ok(self.word(addr))
        }

        fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ()> {
            self.tick();
            let b = self.bytes.borrow();
            let src = b.get(addr as usize..addr as usize + buf.len()).ok_or(())?;
            buf.copy_from_slice(src);
            Ok(())
        }

        fn compare_exchange(&self, addr: u64, current: u64, new: u64) -> Result<bool, ()> {
            self.tick();
            if self.word(addr) != current {
                return Ok(false);
            }
            let a = addr as usize;
            self.bytes.borrow_mut()[a..a + 8].copy_from_slice(&new.to_le_bytes());
            Ok(true)
        }
    }

    const SET: RingSet = RingSet {
        base: 0,
        cpus: 1,
        slots: 4,
        record: 16,
    };

    /// What the patch code does: reserve, fields, TSC last.
    fn write_record(bytes: &mut [u8], index: u64, tsc: u64, value: u64) {
        bytes[..8].copy_from_slice(&(index + 1).to_le_bytes());
        let at = SET.slot(0, index % 4) as usize;
        bytes[at + 8..at + 16].copy_from_slice(&value.to_le_bytes());
        bytes[at..at + 8].copy_from_slice(&tsc.to_le_bytes());
    }

    fn values(taken: &Taken) -> Vec<u64> {
        taken
            .records
            .chunks_exact(16)
            .map(|r| u64::from_le_bytes(r[8..16].try_into().unwrap()))
            .collect()
    }

    #[test]
    fn concurrent_drain_takes_finished_records_and_zeroes_their_tsc() {
        let ram = FakeRam::new(SET.bytes() as usize);
        for i in 0..3 {
            write_record(&mut ram.bytes.borrow_mut(), i, 100 + i, 10 + i);
        }
        let mut taken = 0;

        let got = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();

        assert_eq!((values(&got), got.lost, taken), (vec![10, 11, 12], 0, 3));
        assert_eq!(
            ram.word(SET.slot(0, 0)),
            0,
            "the taken slot reads unfinished"
        );
    }

    #[test]
    fn concurrent_drain_waits_at_a_reserved_unfinished_record() {
        let ram = FakeRam::new(SET.bytes() as usize);
        write_record(&mut ram.bytes.borrow_mut(), 0, 100, 10);
        ram.bytes.borrow_mut()[..8].copy_from_slice(&2u64.to_le_bytes()); // index 1 reserved
        let mut taken = 0;

        let now = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();
        write_record(&mut ram.bytes.borrow_mut(), 1, 101, 11);
        let later = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();

        assert_eq!(
            (values(&now), values(&later), taken),
            (vec![10], vec![11], 2)
        );
    }

    #[test]
    fn a_record_whose_slot_is_reused_during_the_read_is_lost_not_torn() {
        let mut ram = FakeRam::new(SET.bytes() as usize);
        for i in 0..4 {
            write_record(&mut ram.bytes.borrow_mut(), i, 100 + i, 10 + i);
        }
        // Right after the reader loads record 0's TSC, a writer laps the ring and rewrites
        // slot 0 (index 4) with a new value: the copy of record 0 would be torn.
        ram.writer_at = 3;
        ram.writer = RefCell::new(Some(Box::new(|b: &mut Vec<u8>| {
            write_record(b, 4, 104, 99)
        })));
        let mut taken = 0;

        let got = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();

        assert_eq!(
            values(&got),
            vec![11, 12, 13],
            "record 0 is dropped, not delivered as 99"
        );
        assert_eq!(got.lost, 1);
        assert_eq!(
            ram.word(SET.slot(0, 0)),
            104,
            "the zeroing left the newer record alone"
        );
    }

    #[test]
    fn a_head_below_what_was_taken_is_trusted_without_a_panic() {
        let ram = FakeRam::new(SET.bytes() as usize);
        write_record(&mut ram.bytes.borrow_mut(), 0, 100, 10);
        let mut taken = 50;

        let got = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();

        assert_eq!(
            (values(&got), taken),
            (vec![], 1),
            "the reader resumes at the head"
        );
    }

    #[test]
    fn a_hostile_head_costs_one_ring_and_an_out_of_range_ring_is_an_error() {
        let ram = FakeRam::new(SET.bytes() as usize);
        ram.bytes.borrow_mut()[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let far = RingSet {
            base: 1 << 40,
            ..SET
        };
        let mut taken = 0;

        let got = drain_concurrent(&ram, &SET, 0, &mut taken, true).unwrap();

        assert!(got.records.is_empty());
        assert_eq!(got.lost, u64::MAX - 4);
        assert!(drain_concurrent(&ram, &far, 0, &mut 0, false).is_err());
    }

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
