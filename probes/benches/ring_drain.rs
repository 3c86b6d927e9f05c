//! How fast the host takes records out of the trace rings through shared guest RAM (the
//! zero-stop data path of issue 19), without QEMU: two full rings of 262,144 records of 64
//! bytes (the layout `exotap trace` uses with shared RAM) in a file on tmpfs, taken with the
//! concurrent reader ([`drain_concurrent`]) and decoded into trace records.
//!
//! The end-to-end figure against a live guest, shared memory against stop-and-read, is the
//! `bench_data_path_shared_memory_against_stop_and_read` test of `tests/datapath_qemu.rs`.
//!
//! Run: `cargo bench -p exotap-probes --bench ring_drain`.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use exotap_probes::live::shared::SharedHeap;
use exotap_probes::live::splicer::{take_records, TRACE_RECORD};
use exotap_probes::rings::{drain_concurrent, is_finished, lap_tag, window, RingMemory, RingSet};

const HEAP_VA: u64 = 0xffff_ffff_a000_0000;
const SLOTS: u32 = 1 << 18;
const CPUS: u32 = 2;

fn fill(heap: &SharedHeap, set: &RingSet) {
    for cpu in 0..set.cpus {
        heap.write_heap(set.ring(cpu), &u64::from(set.slots).to_le_bytes())
            .unwrap();
        for i in 0..u64::from(set.slots) {
            // Finished on lap 0: a TSC with tag bit 0 clear.
            heap.write_heap(set.slot(cpu, i), &(1000 + 2 * i).to_le_bytes())
                .unwrap();
        }
    }
}

/// The reader as it was before the batched copy (R2 and R3 record by record: a mark load
/// and a 56-byte read each), kept here to give the ratio side by side in one run.
fn per_record_drain<M: RingMemory>(
    mem: &M,
    set: &RingSet,
    cpu: u32,
    taken: &mut u64,
) -> (Vec<u8>, u64) {
    let slots = u64::from(set.slots);
    let record = set.record as usize;
    let mut records = Vec::new();
    let mut lost = 0;
    loop {
        let head_at = set.ring(cpu);
        let Ok(head) = mem.load_acquire(head_at) else {
            break;
        };
        let (from, l) = window(head, *taken, set.slots);
        lost += l;
        let end = head.min(from + 1024);
        let mut read = Vec::new();
        let mut bytes = Vec::new();
        let mut next = from;
        while next < end {
            let at = set.slot(cpu, next % slots);
            let Ok(tsc) = mem.load_acquire(at) else { break };
            if !is_finished(tsc) || tsc & 1 != lap_tag(next, set.slots) {
                break;
            }
            let start = bytes.len();
            bytes.resize(start + record, 0);
            bytes[start..start + 8].copy_from_slice(&tsc.to_le_bytes());
            if mem.read(at + 8, &mut bytes[start + 8..]).is_err() {
                break;
            }
            read.push(next);
            next += 1;
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let Ok(head_after) = mem.load_acquire(head_at) else {
            break;
        };
        let reused_below = head_after.saturating_sub(slots);
        for (index, r) in read.into_iter().zip(bytes.chunks_exact(record)) {
            if index < reused_below {
                lost += 1;
                continue;
            }
            records.extend_from_slice(r);
        }
        *taken = next;
        if next == from || next >= head_after {
            break;
        }
    }
    (records, lost)
}

fn ring_drain(c: &mut Criterion) {
    let set = RingSet {
        base: HEAP_VA,
        cpus: CPUS,
        slots: SLOTS,
        record: TRACE_RECORD,
    };
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let path = dir.path().join("ram");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(set.bytes()).unwrap();
    let mut heap = SharedHeap::open(&path).unwrap();
    heap.set_heap(HEAP_VA, 0, set.bytes());
    // Every record's fields non-zero, as the patches write them.
    for cpu in 0..CPUS {
        for i in 0..u64::from(SLOTS) {
            heap.write_heap(set.slot(cpu, i) + 8, &[0x5a; 56]).unwrap();
        }
    }

    let mut group = c.benchmark_group("ring_drain");
    group.sample_size(10);
    group.throughput(Throughput::Elements(u64::from(SLOTS) * u64::from(CPUS)));
    // The drainer thread's part: records copied out of the rings.
    group.bench_function("take_two_full_rings", |b| {
        b.iter_batched(
            || fill(&heap, &set),
            |()| {
                let mut bytes = 0;
                for cpu in 0..CPUS {
                    let mut taken = 0;
                    let got = drain_concurrent(&heap, &set, cpu, &mut taken, false).unwrap();
                    assert_eq!(got.lost, 0);
                    bytes += got.records.len();
                    black_box(got);
                }
                assert_eq!(bytes, (SLOTS * CPUS) as usize * TRACE_RECORD as usize);
            },
            BatchSize::PerIteration,
        );
    });
    group.bench_function("take_two_full_rings_record_by_record_before", |b| {
        b.iter_batched(
            || fill(&heap, &set),
            |()| {
                let mut bytes = 0;
                for cpu in 0..CPUS {
                    let mut taken = 0;
                    let (got, lost) = per_record_drain(&heap, &set, cpu, &mut taken);
                    assert_eq!(lost, 0);
                    bytes += got.len();
                    black_box(got);
                }
                assert_eq!(bytes, (SLOTS * CPUS) as usize * TRACE_RECORD as usize);
            },
            BatchSize::PerIteration,
        );
    });
    // And the printing thread's first step: decoding them.
    group.bench_function("take_and_decode_two_full_rings", |b| {
        b.iter_batched(
            || fill(&heap, &set),
            |()| {
                let mut n = 0;
                for cpu in 0..CPUS {
                    let mut taken = 0;
                    let got = drain_concurrent(&heap, &set, cpu, &mut taken, false).unwrap();
                    assert_eq!(got.lost, 0);
                    let (records, _) = take_records(&got.records, true);
                    n += records.len();
                    black_box(records);
                }
                assert_eq!(n, (SLOTS * CPUS) as usize);
            },
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

criterion_group!(benches, ring_drain);
criterion_main!(benches);
