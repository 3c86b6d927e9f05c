//! A hostile guest: everything exotap reads from a live guest's memory, over a memory image
//! the fuzzer writes. The input is a header of fuzzed values (CR3, addresses, offsets, ring
//! heads) and the guest-physical memory from address 0:
//! - page-table walks from a CR3 inside it (loops, self-references, huge pages anywhere);
//! - the current task through a per-CPU base, and a task's pid and comm at fuzzed offsets;
//! - the task list walked through `tasks.next` pointers as `exotap` walks it (cycles, pointers
//!   out of RAM): bounded, it must end;
//! - ring heads that point anywhere (far past the ring, below what was taken): the windows and
//!   spans the drain computes stay within one ring, and the records taken stay in the buffer;
//!   the concurrent (shared-memory) reader over a ring set anywhere in that memory takes at
//!   most a ring's records and never reads outside the memory;
//! - a compiled script's globals decoded from heap bytes (hash tables with garbage states,
//!   sequence numbers, counts and interned-string ids).
//! The outcome is always a value or an error: no panic, no hang, bounded memory.
#![no_main]

use exotap_introspect::layout::{read_task, TaskOffsets};
use exotap_introspect::memory::SparseMemory;
use exotap_introspect::paging::AddressSpace;
use exotap_probes::compile::data::{DataLayout, Header, Interner};
use exotap_probes::lang::driver::{compile, ScriptSource};
use exotap_probes::lang::Limits;
use exotap_probes::rings::{drain_concurrent, spans, take, window, RingMemory, RingSet};
use libfuzzer_sys::fuzz_target;

const HEAD: usize = 64;
/// The most tasks a walk visits before it calls the list broken.
const MAX_TASKS: usize = 4096;

/// The fuzzed memory as the concurrent ring reader sees shared RAM (bounds-checked).
struct Flat<'a>(std::cell::RefCell<Vec<u8>>, std::marker::PhantomData<&'a ()>);

impl RingMemory for Flat<'_> {
    type Error = ();
    fn load_acquire(&self, addr: u64) -> Result<u64, ()> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ()> {
        let mem = self.0.borrow();
        let at = usize::try_from(addr).map_err(|_| ())?;
        let src = mem.get(at..at.checked_add(buf.len()).ok_or(())?).ok_or(())?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

fn word(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default())
}

fuzz_target!(|data: &[u8]| {
    if data.len() < HEAD {
        return;
    }
    let (head, memory) = data.split_at(HEAD);
    let cr3 = word(head, 0) & 0xfff_f000;
    let la57 = head[63] & 1 == 1;
    let gs_base = word(head, 1);
    let task_offsets = TaskOffsets {
        pid: word(head, 2) & 0xfff,
        comm: (word(head, 2) >> 16) & 0xfff,
    };
    let tasks_offset = (word(head, 2) >> 32) & 0xfff;

    let mut mem = SparseMemory::new();
    if mem.add_region(0, memory.to_vec()).is_err() {
        return;
    }
    let mut space = AddressSpace::new(&mut mem, cr3, la57);
    // The current task through the per-CPU base, then the task list from it.
    if let Ok(task) = space.read_u64(gs_base) {
        let mut at = task;
        for _ in 0..MAX_TASKS {
            let _ = read_task(&mut space, at, task_offsets);
            match space.read_u64(at.wrapping_add(tasks_offset)) {
                Ok(next) => {
                    at = next.wrapping_sub(tasks_offset);
                    if at == task {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
    }

    // Ring heads as a hostile guest may leave them.
    let (ring_head, taken, slots) = (word(head, 3), word(head, 4), (word(head, 5) as u32) | 1);
    let (from, lost) = window(ring_head, taken, slots);
    assert!(from <= ring_head.max(taken));
    let _ = lost;
    let total: u64 = spans(from, ring_head, slots).iter().map(|s| s.1).sum();
    assert!(total <= u64::from(slots));
    for (first, count) in spans(from, ring_head, slots) {
        assert!(first < u64::from(slots) && first + count <= u64::from(slots));
    }
    let record = 8 + (head[62] as usize % 16) * 8;
    let (records, consumed) = take(memory, record, head[61] & 1 == 1);
    assert!(consumed as usize <= memory.len() / record && records.len() <= consumed as usize);

    // The concurrent reader over a ring set the header places in the memory.
    let set = RingSet {
        base: word(head, 6) % (memory.len() as u64 + 1),
        cpus: 1 + u32::from(head[60] & 3),
        slots: 1 << (head[59] % 12),
        record: 8 << (head[58] % 4),
    };
    let flat = Flat(std::cell::RefCell::new(memory.to_vec()), std::marker::PhantomData);
    for cpu in 0..set.cpus {
        let mut taken_so_far = taken;
        if let Ok(got) = drain_concurrent(&flat, &set, cpu, &mut taken_so_far, head[61] & 2 == 2) {
            assert!(got.records.len() as u64 <= u64::from(set.slots) * set.record);
        }
    }

    // A compiled script's data area, as the host decodes it.
    let _ = Header::decode(memory);
    let src = ScriptSource {
        name: "fuzz.stp".into(),
        text: "global a, s, n, t; probe begin { a[\"x\", 1] = 2; s <<< 3; n = 4; t[\"name\"] = \"v\" }"
            .into(),
    };
    if let Ok(prog) = compile(&src, &Limits::default()) {
        if let Ok(layout) = DataLayout::new(&prog, &Limits::default()) {
            let interner = Interner::default();
            for name in ["a", "s", "n", "t"] {
                let _ = layout.decode(name, memory, &interner);
            }
        }
    }
});
