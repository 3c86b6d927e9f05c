//! The trace records of `exotap trace` and how the host takes them from a ring.

/// One entry or exit record of `exotap trace`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceRecord {
    /// TSC.
    pub tsc: u64,
    /// First argument (entry) or return value (exit).
    pub value: u64,
    /// Function id (index of the request).
    pub id: u32,
    /// 1 entry, 2 exit.
    pub kind: u32,
    /// The call's stack slot (pairs entry and exit).
    pub slot: u64,
    /// The running task's pid (0 when unknown).
    pub pid: u32,
    /// The running task's name (`comm`, NUL-padded).
    pub comm: [u8; 16],
}

impl TraceRecord {
    /// The task's name as text (up to its first NUL).
    pub fn task_name(&self) -> String {
        let end = self.comm.iter().position(|&b| b == 0).unwrap_or(16);
        String::from_utf8_lossy(&self.comm[..end]).into_owned()
    }
}

pub use crate::rings::{spans as ring_spans_of, window as ring_window};

use super::TRACE_RECORD;

/// The records `[from, to)` as (first slot, count) spans of a ring of `slots` records.
pub fn ring_spans(from: u64, to: u64, slots: u32) -> Vec<(u64, u64)> {
    ring_spans_of(from, to, slots)
}

/// Decodes consecutive trace records, read with the guest stopped after earlier takes zeroed
/// what they took (or as [`crate::rings::drain_concurrent`] hands them out); stops at the
/// first unfinished one ([`crate::rings::is_finished`]: its mark, stored last by its writer)
/// unless `last`, which skips it. Returns the finished records and how many
/// records (finished or skipped) were consumed.
pub fn take_records(bytes: &[u8], last: bool) -> (Vec<TraceRecord>, u64) {
    // The loop of `crate::rings::take`, decoding as it goes: this runs on every record
    // streamed (`benches/ring_drain.rs`), and a list of slices first costs a pass and an
    // allocation.
    let mut records = Vec::with_capacity(bytes.len() / TRACE_RECORD as usize);
    let mut consumed = 0;
    for chunk in bytes.chunks_exact(TRACE_RECORD as usize) {
        let word = |o: usize| u64::from_le_bytes(chunk[o..o + 8].try_into().unwrap_or_default());
        let half = |o: usize| u32::from_le_bytes(chunk[o..o + 4].try_into().unwrap_or_default());
        let mark = word(0);
        let finished = crate::rings::is_finished(mark);
        if !finished && !last {
            break;
        }
        consumed += 1;
        if finished {
            records.push(TraceRecord {
                tsc: mark & !1,
                value: word(8),
                id: half(16),
                kind: half(20),
                slot: word(24),
                pid: half(32),
                comm: chunk[40..56].try_into().unwrap_or_default(),
            });
        }
    }
    (records, consumed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record_bytes(records: &[(u64, u64, u32, u32)]) -> Vec<u8> {
        let mut bytes = Vec::new();
        for &(tsc, value, id, kind) in records {
            bytes.extend_from_slice(&tsc.to_le_bytes());
            bytes.extend_from_slice(&value.to_le_bytes());
            bytes.extend_from_slice(&id.to_le_bytes());
            bytes.extend_from_slice(&kind.to_le_bytes());
            bytes.extend_from_slice(&0x1000u64.to_le_bytes());
            bytes.extend_from_slice(&42u32.to_le_bytes());
            bytes.extend_from_slice(&[0; 4]);
            bytes.extend_from_slice(b"dd\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
            bytes.extend_from_slice(&[0; 8]);
        }
        bytes
    }

    #[test]
    fn ring_window_takes_from_the_last_drain_or_counts_what_a_burst_overwrote() {
        // 3 written, 1 taken before: take from 1, nothing lost.
        assert_eq!(ring_window(3, 1, 4), (1, 0));
        // 10 written, 1 taken: slots hold 6..10, 5 records were overwritten.
        assert_eq!(ring_window(10, 1, 4), (6, 5));
        // Nothing new.
        assert_eq!(ring_window(7, 7, 4), (7, 0));
        // A head below what was taken (a hostile or reset guest) is trusted, not underflowed.
        assert_eq!(ring_window(2, 9, 4), (2, 0));
    }

    #[test]
    fn ring_spans_split_where_the_ring_wraps() {
        assert_eq!(ring_spans(2, 6, 4), vec![(2, 2), (0, 2)]);
        assert_eq!(ring_spans(5, 7, 4), vec![(1, 2)]);
        assert_eq!(ring_spans(4, 8, 4), vec![(0, 4)]);
        assert!(ring_spans(3, 3, 4).is_empty());
        // Never more than the ring holds.
        assert_eq!(ring_spans(0, 100, 4), vec![(0, 4)]);
    }

    #[test]
    fn take_records_waits_for_an_unfinished_record_until_the_last_drain() {
        let bytes = record_bytes(&[
            (100, 20, 7, 1),
            (103, 21, 7, 2),
            // Reserved on an odd lap: the mark holds the lap tag 1, not a TSC yet.
            (1, 0, 7, 1),
            (104, 23, 7, 2),
        ]);

        let (running, consumed) = take_records(&bytes, false);
        let (last, consumed_last) = take_records(&bytes, true);

        assert_eq!(
            consumed, 2,
            "stops at the record whose mark is not written yet"
        );
        assert_eq!(
            running.iter().map(|r| r.tsc).collect::<Vec<_>>(),
            [100, 102],
            "TSCs without the lap tag bit"
        );
        assert_eq!(
            (running[0].value, running[0].id, running[0].kind),
            (20, 7, 1)
        );
        assert_eq!(
            (running[0].pid, running[0].task_name()),
            (42, "dd".to_owned())
        );
        assert_eq!(consumed_last, 4, "at removal it is skipped, not waited for");
        assert_eq!(
            last.iter().map(|r| r.tsc).collect::<Vec<_>>(),
            [100, 102, 104]
        );
    }
}
