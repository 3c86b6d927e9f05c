//! Per-vCPU ring buffers in the patch heap (DESIGN.md, key mechanism 6), shared by `exotap
//! trace` (entry/return records) and compiled probes (output records).
//!
//! Each vCPU's ring is a [`HEADER`]-byte header whose first `u64` is the head (records ever
//! reserved there, taken with `lock xadd`), then `slots` records of `record` bytes. A record's
//! first `u64` is its *mark*: its writer stores the record's lap tag there when it reserves it
//! (`(index / slots) & 1`: 0 or 1, which reads as "not finished yet"), and the TSC with its
//! bit 0 replaced by that tag last ([`RingSet::emit_finish`]; TSCs lose one bit, a 2-cycle
//! resolution). A mark of at least 2 whose tag is the lap of the index read is a finished
//! record of that lap. The host takes records from where it stopped last ([`window`]) up to
//! the first unfinished one ([`take`], [`drain_concurrent`]). A burst of more than `slots`
//! records between two drains overwrites the oldest ones: [`window`] counts them as lost.
//! Everything read back is guest data: a head below what was taken, or past it by more than a
//! ring, never panics.
//!
//! # Two readers
//!
//! - **Stopped** (the gdbstub path): the host pauses every vCPU, reads, zeroes what it took,
//!   resumes. No writer runs during the read, so there is nothing to order, and a zeroed mark
//!   reads as unfinished, so [`take`] needs no lap: any mark of at least 2 is finished.
//! - **Concurrent** ([`drain_concurrent`], the shared-memory path): the vCPUs keep running
//!   while the host reads the rings through guest RAM it has mapped. The protocol is
//!   lock-free on both sides (the writer never waits for the host), the host writes nothing
//!   into the rings (each record costs it a cache line read from the writer's core, no
//!   ownership transfer and no locked instruction), and its memory ordering is this:
//!
//!   *Writer* (patch code on one vCPU, x86 TSO): (W1) `lock xadd` on the head reserves index
//!   `j` (a full barrier); (W2) a plain store of `j`'s lap tag into the mark; (W3) plain
//!   stores of the record's fields into slot `j % slots`; (W4) a plain store of the finished
//!   mark (TSC and tag). x86 keeps stores in program order, so a reader that sees W4 sees W3,
//!   and a reader that sees any W2-W4 store of `j` sees W1 of `j` on a later load.
//!
//!   *Reader* (host): (R1) load the head `h` with `Acquire`; for each index `i` in the
//!   window below `h`: (R2) load the record's mark with `Acquire`: below 2, or a tag other
//!   than `i`'s lap, means unfinished and the take ends there (it resumes at `i` next time).
//!   A tag from the slot's previous lap is what a reader sees when `i`'s writer has done W1
//!   but its W2 is not visible yet: the old record is never delivered as `i`. Otherwise (R3)
//!   copy the other fields with volatile reads. Then (R4) an `Acquire` fence and a second
//!   load of the head `h2`. A record `i` whose slot a later writer could have reused during
//!   the copy has `i + slots < h2 + 1`, i.e. `i < h2 - slots`: it is dropped and counted
//!   lost, never delivered torn (if R3 saw any store of writer `i + slots`, R4 sees its W1:
//!   R4 is after R3, and x86 does not reorder loads).
//!
//!   The tag is one bit, so a mark two laps old reads as current. That needs the writer of
//!   the lap in between to have reserved its slot and not yet done W2 while a whole ring of
//!   other records was written on the same vCPU and the reader was lapped: records were
//!   already lost then, and the overrun count says so.

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

    /// Reserves a record in the running vCPU's ring (W1 and W2 of the module documentation:
    /// the record's mark then holds its lap tag) and leaves its address in `dst` (not rax or
    /// rcx); jumps to `skip` when the vCPU number (at the per-CPU offset `cpu_number`) has no
    /// ring. Clobbers rax, rcx, rdx and the flags.
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
        // W1.
        a.lock().xadd(qword_ptr(rcx), rdx)?;
        // The lap tag of index rdx: bit log2(slots) of it.
        a.mov(eax, edx)?;
        a.shr(eax, self.slots.max(1).trailing_zeros())?;
        a.and(eax, 1)?;
        a.and(edx, self.slots - 1)?;
        a.shl(rdx, self.record.trailing_zeros())?;
        a.lea(dst, qword_ptr(rcx + rdx + HEADER as i32))?;
        // W2: the record reads as unfinished, and as this lap's.
        a.mov(qword_ptr(dst), rax)
    }

    /// Finishes the record at `record` reserved by [`RingSet::emit_reserve`] (W4 of the
    /// module documentation): its mark becomes the TSC in `tsc` with bit 0 replaced by the
    /// lap tag the reservation stored. Call it after every other store into the record.
    /// Changes `tsc` and the flags.
    ///
    /// # Errors
    /// When the assembler refuses an instruction.
    pub fn emit_finish(
        a: &mut CodeAssembler,
        record: AsmRegister64,
        tsc: AsmRegister64,
    ) -> Result<(), IcedError> {
        a.and(tsc, -2)?;
        a.or(tsc, qword_ptr(record))?;
        a.mov(qword_ptr(record), tsc)
    }
}

/// The lap tag of record `index` of a ring of `slots` records: bit 0 of its mark.
pub fn lap_tag(index: u64, slots: u32) -> u64 {
    (index / u64::from(slots.max(1))) & 1
}

/// Whether a record's mark (its first `u64`) is a finished record's: at least 2 (0 and 1 are
/// the lap tags a reservation stores). The record's TSC is then `mark & !1`.
pub fn is_finished(mark: u64) -> bool {
    mark >= 2
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

/// Splits consecutive records of `record` bytes, read with the guest stopped after earlier
/// takes zeroed what they took; stops at the first unfinished one ([`is_finished`]) unless
/// `last`, which skips it. Returns the finished records and how many records (finished or
/// skipped) were consumed.
pub fn take(bytes: &[u8], record: usize, last: bool) -> (Vec<&[u8]>, u64) {
    let mut out = Vec::new();
    let mut consumed = 0;
    for chunk in bytes.chunks_exact(record.max(8)) {
        let mark = u64::from_le_bytes(chunk[..8].try_into().unwrap_or_default());
        if !is_finished(mark) && !last {
            break;
        }
        consumed += 1;
        if is_finished(mark) {
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

    /// Loads `count` 8-aligned `u64`s with `Acquire` ordering, at `addr`, `addr + stride`,
    /// ..., in that order, handing each to `f` until it returns `false` (the reader's R2,
    /// one mark per record). The default loads each with [`RingMemory::load_acquire`]; a
    /// memory that can bounds-check the whole range once overrides it.
    ///
    /// # Errors
    /// When an address is outside the memory or unaligned (nothing is loaded from a range
    /// that an override finds outside).
    fn load_each<F: FnMut(u64) -> bool>(
        &self,
        addr: u64,
        stride: u64,
        count: u64,
        mut f: F,
    ) -> Result<(), Self::Error> {
        for k in 0..count {
            if !f(self.load_acquire(addr.wrapping_add(k.wrapping_mul(stride)))?) {
                break;
            }
        }
        Ok(())
    }

    /// Appends `len` bytes at `addr` to `out`, as [`RingMemory::read`] reads them (a memory
    /// that can copy into `out`'s spare capacity overrides this zero-fill and copy).
    ///
    /// # Errors
    /// When the range is outside the memory.
    fn append(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<(), Self::Error> {
        let start = out.len();
        out.resize(start + len, 0);
        self.read(addr, &mut out[start..])
    }
}

/// What one concurrent take of one ring found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taken {
    /// The finished records one after the other, oldest first, each `record` bytes; each
    /// one's mark replaced by its TSC (bit 0 clear, never below 2).
    pub records: Vec<u8>,
    /// Records lost: overwritten before the host read them, or reused during the read.
    pub lost: u64,
}

/// Takes vCPU `cpu`'s finished records from its ring while the vCPUs may be writing it (the
/// concurrent reader of the module documentation); `taken` is how many records of that ring
/// the host has consumed so far, and is advanced. With `last` (the guest is stopped for good)
/// an unfinished record is skipped rather than waited for. Nothing is written into the ring.
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
    let slots = u64::from(set.slots.max(1));
    let mut out = Taken::default();
    // Room for what is there now (at most a ring): the output grows once, not by doubling.
    let head = mem.load_acquire(set.ring(cpu))?;
    let waiting = head.saturating_sub(*taken).min(slots);
    out.records
        .reserve(usize::try_from(waiting.saturating_mul(set.record)).unwrap_or(0));
    drain_concurrent_into(mem, set, cpu, taken, last, slots, &mut out)?;
    Ok(out)
}

/// [`drain_concurrent`] into a buffer the caller brings (`out`, appended to), taking at most
/// `max` records, or skipping past them as lost (at least one in all: 0 is taken as 1);
/// whether there may be more to take now. A reader that hands records over in buffers of a
/// fixed size (the drainer thread's, which it reuses) calls this once per buffer.
///
/// # Errors
/// When the ring's memory cannot be reached (a head or slot outside the memory).
pub fn drain_concurrent_into<M: RingMemory>(
    mem: &M,
    set: &RingSet,
    cpu: u32,
    taken: &mut u64,
    last: bool,
    max: u64,
    out: &mut Taken,
) -> Result<bool, M::Error> {
    // In batches, each validated on its own: a reader that fell behind loses only the
    // batches a writer overtook, not a whole ring's read. At most `max`, so at most a ring's
    // worth from `drain_concurrent`: a hostile head far ahead costs one ring, no more.
    let batch = u64::from(set.slots.max(1)).min(BATCH);
    let mut budget = max.max(1);
    while budget > 0 {
        let before = *taken;
        let more = take_batch(mem, set, cpu, taken, last, batch.min(budget), out)?;
        budget = budget.saturating_sub(taken.saturating_sub(before).max(1));
        if !more {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Records read and validated together by [`drain_concurrent`].
const BATCH: u64 = 4096;

/// One batch of [`drain_concurrent`]: R1 to R4 of the module documentation over at most
/// `max` records; whether there may be more to take now.
///
/// R2 and R3 are done as two passes over the batch rather than record by record: first every
/// mark (R2, `Acquire` loads, up to the first unfinished record), then one bulk copy of the
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
    // Not past the ring's end in one batch: the slots of [from, end) are contiguous, and
    // share one lap tag.
    let to_wrap = slots - from % slots;
    let end = head.min(from.saturating_add(max.min(to_wrap)));
    let tag = lap_tag(from, set.slots);
    // R2 for each record, into the TSCs of the batch (0: unfinished, skipped with `last`).
    // The batch's slots are contiguous: one address computation (and, in shared RAM, one
    // bounds check) for all its marks, not a division and a check per record.
    let mut tscs: Vec<u64> = Vec::with_capacity(usize::try_from(end - from).unwrap_or(0));
    let mut unfinished = false;
    mem.load_each(
        set.slot(cpu, from % slots),
        set.record,
        end.saturating_sub(from),
        |mark| {
            let done = is_finished(mark) && mark & 1 == tag;
            if !done && !last {
                unfinished = true;
                return false;
            }
            tscs.push(if done { mark & !1 } else { 0 });
            true
        },
    )?;
    let next = from + tscs.len() as u64;
    // R3: the records [from, next) in one copy, after every mark load above.
    let start = out.records.len();
    if !tscs.is_empty() {
        mem.append(
            set.slot(cpu, from % slots),
            tscs.len() * record,
            &mut out.records,
        )?;
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
        let at = start + i * record;
        if kept != at {
            out.records.copy_within(at..at + record, kept);
        }
        // The mark R2 read, as a TSC (the copy's is the same, or the record was reused and
        // is not kept).
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
    }

    const SET: RingSet = RingSet {
        base: 0,
        cpus: 1,
        slots: 4,
        record: 16,
    };

    /// W1 and W2 of the patch code: reserve index `index`, store its lap tag.
    fn reserve(bytes: &mut [u8], index: u64) {
        bytes[..8].copy_from_slice(&(index + 1).to_le_bytes());
        let at = SET.slot(0, index % 4) as usize;
        bytes[at..at + 8].copy_from_slice(&lap_tag(index, SET.slots).to_le_bytes());
    }

    /// What the patch code does: reserve, tag, fields, the finished mark last.
    fn write_record(bytes: &mut [u8], index: u64, tsc: u64, value: u64) {
        reserve(bytes, index);
        let at = SET.slot(0, index % 4) as usize;
        bytes[at + 8..at + 16].copy_from_slice(&value.to_le_bytes());
        let mark = (tsc & !1) | lap_tag(index, SET.slots);
        bytes[at..at + 8].copy_from_slice(&mark.to_le_bytes());
    }

    fn values(taken: &Taken) -> Vec<u64> {
        taken
            .records
            .chunks_exact(16)
            .map(|r| u64::from_le_bytes(r[8..16].try_into().unwrap()))
            .collect()
    }

    fn tscs(taken: &Taken) -> Vec<u64> {
        taken
            .records
            .chunks_exact(16)
            .map(|r| u64::from_le_bytes(r[..8].try_into().unwrap()))
            .collect()
    }

    #[test]
    fn concurrent_drain_takes_finished_records_and_writes_nothing() {
        let ram = FakeRam::new(SET.bytes() as usize);
        for i in 0..6 {
            write_record(&mut ram.bytes.borrow_mut(), i, 100 + i, 10 + i);
        }
        let before = ram.bytes.borrow().clone();
        let mut taken = 2;

        let got = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();

        assert_eq!(
            (values(&got), got.lost, taken),
            (vec![12, 13, 14, 15], 0, 6)
        );
        assert_eq!(
            tscs(&got),
            vec![102, 102, 104, 104],
            "TSCs without the tag bit"
        );
        assert_eq!(*ram.bytes.borrow(), before, "the ring is left as it was");
    }

    #[test]
    fn concurrent_drain_waits_at_a_reserved_unfinished_record() {
        let ram = FakeRam::new(SET.bytes() as usize);
        write_record(&mut ram.bytes.borrow_mut(), 0, 100, 10);
        reserve(&mut ram.bytes.borrow_mut(), 1);
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
    fn a_slots_record_of_the_previous_lap_is_not_taken_for_the_next() {
        let ram = FakeRam::new(SET.bytes() as usize);
        for i in 0..4 {
            write_record(&mut ram.bytes.borrow_mut(), i, 100 + i, 10 + i);
        }
        let mut taken = 0;
        let first = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();
        // Index 4 reserved (the head says so), its tag not stored yet: slot 0 still holds
        // record 0, finished.
        ram.bytes.borrow_mut()[..8].copy_from_slice(&5u64.to_le_bytes());

        let early = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();
        write_record(&mut ram.bytes.borrow_mut(), 4, 104, 14);
        let later = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();

        assert_eq!(values(&first), vec![10, 11, 12, 13]);
        assert_eq!(
            values(&early),
            Vec::<u64>::new(),
            "record 0 not taken again"
        );
        assert_eq!((values(&later), taken), (vec![14], 5));
    }

    #[test]
    fn after_an_overrun_a_reserved_slot_is_not_read_as_its_old_record() {
        let ram = FakeRam::new(SET.bytes() as usize);
        for i in 0..8 {
            write_record(&mut ram.bytes.borrow_mut(), i, 100 + i, 10 + i);
        }
        // Index 8 reserved in slot 0, which holds record 4 (never taken: the reader was
        // lapped).
        ram.bytes.borrow_mut()[..8].copy_from_slice(&9u64.to_le_bytes());
        let mut taken = 0;

        let got = drain_concurrent(&ram, &SET, 0, &mut taken, false).unwrap();

        assert_eq!((values(&got), got.lost, taken), (vec![15, 16, 17], 5, 8));
    }

    #[test]
    fn a_record_whose_slot_is_reused_during_the_read_is_lost_not_torn() {
        let mut ram = FakeRam::new(SET.bytes() as usize);
        for i in 0..4 {
            write_record(&mut ram.bytes.borrow_mut(), i, 100 + i, 10 + i);
        }
        // Right after the reader loads record 0's mark (the 3rd access: the head twice, then
        // that mark; the writer runs at the start of the 4th), a writer laps the ring and
        // rewrites slot 0 (index 4) with a new value: the copy of record 0 would be torn.
        ram.writer_at = 4;
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
    }

    /// The writer as patch code emits it ([`RingSet::emit_reserve`], a field, then
    /// [`RingSet::emit_finish`]) run in Unicorn, and the concurrent reader on the memory it
    /// wrote: across a lap, and with a reservation whose record is not finished yet.
    #[test]
    fn the_emitted_writer_and_the_concurrent_reader_agree_across_laps() {
        use exotap_vmm::control::X86Registers;
        use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine};
        use iced_x86::code_asm::{qword_ptr, r12, rbx, rdi};

        const CODE: u64 = 0xffff_ffff_a000_0000;
        const PERCPU: u64 = CODE + 0x8000;
        const CPU_NUMBER: u64 = 0x10;
        let set = RingSet {
            base: CODE + 0x1_0000,
            ..SET
        };
        // Whole records: reserve, the value in rbx, the TSC in r12. Only the reservation:
        // a writer interrupted before its other stores.
        let assemble = |at: u64, finish: bool| {
            let mut a = CodeAssembler::new(64).unwrap();
            let mut skip = a.create_label();
            set.emit_reserve(&mut a, CPU_NUMBER, rdi, skip).unwrap();
            if finish {
                a.mov(qword_ptr(rdi + 8), rbx).unwrap();
                a.mov(rax, r12).unwrap();
                RingSet::emit_finish(&mut a, rdi, rax).unwrap();
            }
            a.set_label(&mut skip).unwrap();
            a.nop().unwrap();
            a.assemble(at).unwrap()
        };
        let whole = assemble(CODE, true);
        let reserve_only = assemble(CODE + 0x1000, false);
        let mut m = UnicornMachine::new(Isa::X86_64).unwrap();
        m.map(CODE, 0x2_0000).unwrap();
        m.write(CODE, &whole).unwrap();
        m.write(CODE + 0x1000, &reserve_only).unwrap();
        m.write(PERCPU + CPU_NUMBER, &0u32.to_le_bytes()).unwrap();
        m.set_gs_base(PERCPU).unwrap();
        let run = |m: &mut UnicornMachine, code: &[u8], at: u64, value: u64, tsc: u64| {
            let end = at + code.len() as u64 - 1;
            m.set_halt(Some(end)).unwrap();
            let mut regs = X86Registers {
                rip: at,
                rflags: 0x2,
                ..X86Registers::default()
            };
            regs.gpr[1] = value;
            regs.gpr[7] = PERCPU - 0x100;
            regs.gpr[12] = tsc;
            m.set_x86_registers(&regs).unwrap();
            assert_eq!(m.run().unwrap(), RunEnd::Halted(end));
        };
        struct Emu<'a>(&'a UnicornMachine);
        impl RingMemory for Emu<'_> {
            type Error = ();
            fn load_acquire(&self, addr: u64) -> Result<u64, ()> {
                let mut b = [0u8; 8];
                self.read(addr, &mut b)?;
                Ok(u64::from_le_bytes(b))
            }
            fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ()> {
                UnicornMachine::read(self.0, addr, buf).map_err(|_| ())
            }
        }
        let mut taken = 0;

        for i in 0..4 {
            run(&mut m, &whole, CODE, 10 + i, 1001 + i);
        }
        let lap0 = drain_concurrent(&Emu(&m), &set, 0, &mut taken, false).unwrap();
        for i in 4..6 {
            run(&mut m, &whole, CODE, 10 + i, 1001 + i);
        }
        run(&mut m, &reserve_only, CODE + 0x1000, 0, 0);
        let lap1 = drain_concurrent(&Emu(&m), &set, 0, &mut taken, false).unwrap();
        let mut mark = [0u8; 8];
        m.read(set.slot(0, 2), &mut mark).unwrap();

        assert_eq!(values(&lap0), vec![10, 11, 12, 13]);
        assert_eq!(tscs(&lap0), vec![1000, 1002, 1002, 1004]);
        assert_eq!(
            (values(&lap1), tscs(&lap1), taken),
            (vec![14, 15], vec![1004, 1006], 6),
            "record 6 is reserved, not finished: record 2 is not read in its place"
        );
        assert_eq!(u64::from_le_bytes(mark), 1, "the reservation's lap tag");
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
        // Finished, reserved (a lap tag: 1), finished, zeroed.
        let mut bytes = vec![0u8; 4 * 16];
        bytes[0] = 2;
        bytes[16] = 1;
        bytes[32] = 3;

        let (now, n) = take(&bytes, 16, false);
        let (last, m) = take(&bytes, 16, true);

        assert_eq!((now.len(), n), (1, 1));
        assert_eq!((last.len(), m), (2, 4));
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
