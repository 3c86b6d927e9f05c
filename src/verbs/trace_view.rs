//! The text of `exotap trace` (and its Perfetto slices) and of timing histograms.

use std::collections::BTreeMap;

use exotap_probes::live::splicer::TraceRecord;

/// Trace records as text, as they arrive: time since the first record, vCPU, entry (`->`
/// with the first argument) or return (`<-` with the return value and the call's duration
/// when its entry came before).
#[derive(Debug)]
pub struct TraceView {
    names: BTreeMap<u64, String>,
    khz: u32,
    first: Option<u64>,
    /// Entries whose return has not come yet, by (stack slot, function id): their TSC and
    /// vCPU.
    open: BTreeMap<(u64, u32), (u64, u32)>,
    /// The same records as Perfetto slices (`--perfetto`).
    pub perfetto: Option<crate::perfetto::SliceTrace>,
    /// Records shown so far.
    pub shown: u64,
}

impl TraceView {
    /// A view naming function ids with `names`, TSC at `khz`.
    pub fn new(names: BTreeMap<u64, String>, khz: u32) -> Self {
        TraceView {
            names,
            khz: khz.max(1),
            first: None,
            open: BTreeMap::new(),
            perfetto: None,
            shown: 0,
        }
    }

    /// The lines of one batch, in TSC order.
    pub fn lines(&mut self, records: &[(u32, TraceRecord)]) -> Vec<String> {
        let mut sorted: Vec<&(u32, TraceRecord)> = records.iter().collect();
        sorted.sort_by_key(|(cpu, r)| (r.tsc, *cpu));
        let Some(batch_first) = sorted.first().map(|r| r.1.tsc) else {
            return Vec::new();
        };
        let first = *self.first.get_or_insert(batch_first);
        let khz = u128::from(self.khz);
        // Nanoseconds, the unit of the Perfetto timeline too: both views show the same times.
        let ns =
            |cycles: u64| u64::try_from(u128::from(cycles) * 1_000_000 / khz).unwrap_or(u64::MAX);
        let us = |ns: u64| format!("{}.{:03}", ns / 1000, ns % 1000);
        self.shown += sorted.len() as u64;
        let mut lines = Vec::with_capacity(sorted.len());
        for (cpu, r) in sorted {
            let name = self.names.get(&u64::from(r.id)).map_or("?", String::as_str);
            let at = ns(r.tsc.saturating_sub(first));
            let task = r.task_name();
            if r.kind == 1 {
                self.open.insert((r.slot, r.id), (r.tsc, *cpu));
                if let Some(p) = self.perfetto.as_mut() {
                    p.begin(*cpu, at, name, &task, r.pid, r.value);
                }
                lines.push(format!(
                    "{:>14} us  cpu{cpu}  {task}[{}]  -> {name}(arg0={:#x})",
                    us(at),
                    r.pid,
                    r.value
                ));
            } else {
                let entry = self.open.remove(&(r.slot, r.id));
                let took = entry
                    // The difference of the two times shown (so the text adds up).
                    .map(|(t, _)| {
                        let entered = ns(t.saturating_sub(first));
                        format!("  [{} us]", us(at.saturating_sub(entered)))
                    })
                    .unwrap_or_default();
                if let (Some(p), Some((_, entry_cpu))) = (self.perfetto.as_mut(), entry) {
                    p.end(entry_cpu, at, r.value);
                }
                lines.push(format!(
                    "{:>14} us  cpu{cpu}  {task}[{}]  <- {name} = {}{took}",
                    us(at),
                    r.pid,
                    r.value as i64
                ));
            }
        }
        lines
    }
}

/// A log2 histogram of TSC cycles as text, bucket bounds in ns (bpftrace's `hist` style).
pub fn histogram_lines(buckets: &[u64], tsc_khz: u32) -> Vec<String> {
    let Some(first) = buckets.iter().position(|&n| n > 0) else {
        return Vec::new();
    };
    let last = buckets.iter().rposition(|&n| n > 0).unwrap_or(first);
    let max = buckets.iter().copied().max().unwrap_or(1).max(1);
    let ns = |cycles: u128| -> String {
        let khz = u128::from(tsc_khz.max(1));
        let v = cycles * 1_000_000 / khz;
        match v {
            v if v >= 10_000_000 => format!("{} ms", v / 1_000_000),
            v if v >= 10_000 => format!("{} us", v / 1000),
            v => format!("{v} ns"),
        }
    };
    (first..=last)
        .map(|i| {
            let n = buckets[i];
            let lo = if i == 0 { 0 } else { 1u128 << i };
            let hi = 1u128 << (i + 1);
            let bar = "@".repeat(usize::try_from(n * 40 / max).unwrap_or(0));
            format!("  [{:>8}, {:>8}) {n:>10} |{bar:<40}|", ns(lo), ns(hi))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_view_pairs_a_return_with_an_entry_from_an_earlier_drain() {
        let names = BTreeMap::from([(7, "vfs_read".to_owned())]);
        let mut view = TraceView::new(names, 1_000_000); // 1 GHz: 1000 cycles a microsecond
        let rec = |tsc, value, kind| TraceRecord {
            tsc,
            value,
            id: 7,
            kind,
            slot: 0xffff_c900_0000_0f00,
            pid: 42,
            comm: *b"dd\0\0\0\0\0\0\0\0\0\0\0\0\0\0",
        };

        let first = view.lines(&[(1, rec(5000, 0x10, 1))]);
        let second = view.lines(&[(1, rec(7001, 18, 2))]);

        assert_eq!(
            first,
            ["         0.000 us  cpu1  dd[42]  -> vfs_read(arg0=0x10)"]
        );
        assert_eq!(
            second,
            ["         2.001 us  cpu1  dd[42]  <- vfs_read = 18  [2.001 us]"]
        );
        assert_eq!(view.shown, 2);
    }

    #[test]
    fn entries_at_the_same_tsc_on_two_vcpus_pair_by_their_tasks_stack_slot() {
        // Under TCG two vCPUs enter the same function at the same TSC (seen in 4 of 30 runs of
        // tests/perfetto_qemu.rs); each return must take its own task's entry.
        let names = BTreeMap::from([(3, "__x64_sys_getppid".to_owned())]);
        let mut view = TraceView::new(names, 1_000_000);
        let rec = |tsc, kind, slot, pid, comm: &[u8; 16]| TraceRecord {
            tsc,
            value: 0,
            id: 3,
            kind,
            slot,
            pid,
            comm: *comm,
        };
        let a = *b"a\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
        let b = *b"b\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";

        let lines = view.lines(&[
            (0, rec(1000, 1, 0xffff_c900_0001_0f58, 94, &a)),
            (1, rec(1000, 1, 0xffff_c900_0002_0f58, 95, &b)),
            // b returns first, on the other vCPU from a.
            (1, rec(1300, 2, 0xffff_c900_0002_0f58, 95, &b)),
            (0, rec(1900, 2, 0xffff_c900_0001_0f58, 94, &a)),
        ]);

        assert_eq!(
            lines,
            [
                "         0.000 us  cpu0  a[94]  -> __x64_sys_getppid(arg0=0x0)",
                "         0.000 us  cpu1  b[95]  -> __x64_sys_getppid(arg0=0x0)",
                "         0.300 us  cpu1  b[95]  <- __x64_sys_getppid = 0  [0.300 us]",
                "         0.900 us  cpu0  a[94]  <- __x64_sys_getppid = 0  [0.900 us]",
            ]
        );
    }
}
