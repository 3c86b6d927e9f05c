//! Text page snapshots: hashes before and after, sites changed under exotap, and the
//! spans one batch writes.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, Context};
use exotap_vmm::control::Machine;
use sha2::{Digest, Sha256};

use super::{LiveKernel, PAGE};

/// A snapshot of text pages (contents by page address).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageSnapshot(pub BTreeMap<u64, Vec<u8>>);

impl PageSnapshot {
    /// SHA-256 over every page in address order (address, then contents).
    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        for (addr, bytes) in &self.0 {
            h.update(addr.to_le_bytes());
            h.update(bytes);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The bytes `[addr, addr+len)` if their pages are in the snapshot.
    pub fn bytes(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let mut out = Vec::with_capacity(len);
        for a in addr..addr.checked_add(len as u64)? {
            let page = self.0.get(&(a & !(PAGE - 1)))?;
            out.push(*page.get(usize::try_from(a & (PAGE - 1)).ok()?)?);
        }
        Some(out)
    }

    /// Pages whose contents differ from `other`'s (or are missing there).
    pub fn differing(&self, other: &Self) -> Vec<u64> {
        self.0
            .iter()
            .filter(|(a, b)| other.0.get(a) != Some(b))
            .map(|(a, _)| *a)
            .collect()
    }
}

/// The pages holding `[addr, addr+len)` for every site.
pub(super) fn pages_of(sites: impl Iterator<Item = (u64, usize)>) -> BTreeSet<u64> {
    let mut pages = BTreeSet::new();
    for (addr, len) in sites {
        let last = addr.wrapping_add(len.max(1) as u64 - 1);
        let mut p = addr & !(PAGE - 1);
        while p <= last {
            pages.insert(p);
            p += PAGE;
        }
    }
    pages
}

/// Reads pages of kernel text through their physical addresses, coalescing runs.
pub(super) fn snapshot(
    machine: &mut dyn Machine,
    kernel: &LiveKernel,
    pages: &BTreeSet<u64>,
) -> anyhow::Result<PageSnapshot> {
    let mut out = BTreeMap::new();
    let list: Vec<u64> = pages.iter().copied().collect();
    // Many pages: one bulk read of the span through the monitor, when QEMU is local.
    if let (Some(&first), Some(&last)) = (list.first(), list.last()) {
        let len = usize::try_from(last + PAGE - first)?;
        if list.len() >= 64 && kernel.contiguous(first, len as u64) {
            if let Some(bulk) = kernel
                .phys(first)
                .and_then(|phys| machine.read_phys_bulk(phys, len))
            {
                for &page in &list {
                    let o = usize::try_from(page - first)?;
                    out.insert(page, bulk[o..o + PAGE as usize].to_vec());
                }
                return Ok(PageSnapshot(out));
            }
        }
    }
    let mut i = 0;
    while i < list.len() {
        let mut j = i + 1;
        // Pages next to each other in both address spaces (module text need not be).
        while j < list.len()
            && list[j] == list[j - 1] + PAGE
            && kernel.phys(list[j]) == kernel.phys(list[j - 1]).map(|p| p + PAGE)
            && j - i < 256
        {
            j += 1;
        }
        let first = list[i];
        let phys = kernel
            .phys(first)
            .with_context(|| format!("{first:#x} is not kernel text"))?;
        let mut buf = vec![0u8; (j - i) * PAGE as usize];
        machine.read_phys(phys, &mut buf)?;
        for (k, page) in buf.chunks(PAGE as usize).enumerate() {
            out.insert(first + k as u64 * PAGE, page.to_vec());
        }
        i = j;
    }
    Ok(PageSnapshot(out))
}

/// Which sites still hold the bytes they were planned over, per a fresh snapshot.
/// Returns the indices that changed, with what is there now.
pub fn changed_sites(planned: &[(u64, Vec<u8>)], now: &PageSnapshot) -> Vec<(usize, Vec<u8>)> {
    planned
        .iter()
        .enumerate()
        .filter_map(|(i, (addr, bytes))| {
            let seen = now.bytes(*addr, bytes.len()).unwrap_or_default();
            (seen != *bytes).then_some((i, seen))
        })
        .collect()
}

/// Unchanged bytes between two changes below which one write covers both (writing the
/// bytes between as they are). Against a booted guest under TCG a gdbstub write costs QEMU
/// tens of µs, and every byte written costs too (QEMU drops the translated blocks of every
/// byte written, changed or not), so merging pays only across a few bytes. Measured with
/// `splice-report --install 10000`, one binary, gaps interleaved (text writes, debug
/// build, load 4): gap 16 0.293/0.293 s (9,155 packets), gap 96 0.353/0.565 s (5,099
/// packets, 264 KB); one packet at a time instead of pipelined: 0.311/0.309 and
/// 0.391/0.549 s.
pub const MERGE_GAP: usize = 16;

/// Applies byte writes to copies of the snapshot's pages and returns the spans to write:
/// changes closer than [`MERGE_GAP`] go in one span with the unchanged bytes between them
/// as the snapshot has them (the guest is stopped: they are the bytes in place), across a
/// page boundary too when both pages are in the snapshot (the text is physically
/// contiguous).
///
/// # Errors
/// When a write falls outside the snapshot.
pub fn page_spans(
    now: &PageSnapshot,
    writes: &[(u64, Vec<u8>)],
) -> anyhow::Result<Vec<(u64, Vec<u8>)>> {
    // Every changed byte, by address (a later write of the same byte wins).
    let mut changed: BTreeMap<u64, u8> = BTreeMap::new();
    for (addr, bytes) in writes {
        for (i, &b) in bytes.iter().enumerate() {
            let a = addr.wrapping_add(i as u64);
            if !now.0.contains_key(&(a & !(PAGE - 1))) {
                bail!("{a:#x} is not in the snapshot");
            }
            changed.insert(a, b);
        }
    }
    // Runs of changed bytes merged across gaps of at most MERGE_GAP present bytes.
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &a in changed.keys() {
        match runs.last_mut() {
            Some((_, hi))
                if a - *hi <= MERGE_GAP as u64 + 1
                    && (*hi & !(PAGE - 1)..=a & !(PAGE - 1))
                        .step_by(PAGE as usize)
                        .all(|p| now.0.contains_key(&p)) =>
            {
                *hi = a;
            }
            _ => runs.push((a, a)),
        }
    }
    let mut out = Vec::with_capacity(runs.len());
    for (lo, hi) in runs {
        let mut bytes = Vec::with_capacity(usize::try_from(hi - lo + 1)?);
        for a in lo..=hi {
            let b = match changed.get(&a) {
                Some(&b) => b,
                None => {
                    let page = now
                        .0
                        .get(&(a & !(PAGE - 1)))
                        .with_context(|| format!("{a:#x} is not in the snapshot"))?;
                    page[usize::try_from(a & (PAGE - 1))?]
                }
            };
            bytes.push(b);
        }
        out.push((lo, bytes));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(pages: &[(u64, u8)]) -> PageSnapshot {
        PageSnapshot(
            pages
                .iter()
                .map(|(a, fill)| (*a, vec![*fill; PAGE as usize]))
                .collect(),
        )
    }

    #[test]
    fn pages_of_a_site_crossing_a_page_boundary_are_both_pages() {
        let pages = pages_of([(0x1ffe, 5), (0x3000, 5)].into_iter());

        assert_eq!(
            pages.into_iter().collect::<Vec<_>>(),
            vec![0x1000, 0x2000, 0x3000]
        );
    }

    #[test]
    fn a_site_whose_bytes_changed_since_planning_is_reported() {
        let mut now = snap(&[(0x1000, 0x90)]);
        now.0.get_mut(&0x1000).unwrap()[0x10] = 0xe8;
        let planned = vec![(0x1000, vec![0x90; 5]), (0x100c, vec![0x90; 5])];

        let changed = changed_sites(&planned, &now);

        assert_eq!(changed, vec![(1, vec![0x90, 0x90, 0x90, 0x90, 0xe8])]);
    }

    #[test]
    fn a_site_outside_the_snapshot_counts_as_changed() {
        let now = snap(&[(0x1000, 0x90)]);

        let changed = changed_sites(&[(0x5000, vec![0x90; 5])], &now);

        assert_eq!(changed.len(), 1);
    }

    #[test]
    fn digests_differ_when_one_byte_does_and_differing_names_the_page() {
        let a = snap(&[(0x1000, 1), (0x2000, 2)]);
        let mut b = a.clone();
        b.0.get_mut(&0x2000).unwrap()[7] = 3;

        assert_ne!(a.digest(), b.digest());
        assert_eq!(a.differing(&b), vec![0x2000]);
        assert_eq!(a.digest(), a.clone().digest());
    }

    #[test]
    fn page_spans_write_the_gap_up_to_merge_gap_and_not_past_a_missing_page() {
        let now = snap(&[(0x1000, 0x90), (0x3000, 0xcc)]);
        let at_gap = 0x1010 + 1 + MERGE_GAP as u64;
        let writes = vec![
            (0x1010, vec![1]),
            (at_gap, vec![2]),
            (at_gap + 2 + MERGE_GAP as u64, vec![3]),
            (0x1fff, vec![4]),
            (0x3000, vec![5]),
        ];

        let spans = page_spans(&now, &writes).unwrap();

        let mut first = vec![0x90; MERGE_GAP + 2];
        first[0] = 1;
        first[MERGE_GAP + 1] = 2;
        assert_eq!(
            spans,
            vec![
                (0x1010, first),
                (at_gap + 2 + MERGE_GAP as u64, vec![3]),
                (0x1fff, vec![4]),
                // 0x2000 is not in the snapshot: no span crosses it.
                (0x3000, vec![5]),
            ]
        );
    }

    #[test]
    fn page_spans_merge_near_writes_keep_bytes_between_and_split_far_ones() {
        let mut now = snap(&[(0x1000, 0x90), (0x2000, 0xcc)]);
        now.0.get_mut(&0x1000).unwrap()[0x13] = 0x55;
        let writes = vec![
            (0x1010, vec![1, 2, 3]),
            (0x1014, vec![4]),
            (0x1ffe, vec![5, 6, 7]),
        ];

        let spans = page_spans(&now, &writes).unwrap();

        assert_eq!(spans.len(), 2, "{spans:x?}");
        assert_eq!(spans[0], (0x1010, vec![1, 2, 3, 0x55, 4]));
        // Across the page boundary, both pages being in the snapshot.
        assert_eq!(spans[1], (0x1ffe, vec![5, 6, 7]));
        assert!(page_spans(&now, &[(0x5000, vec![1])]).is_err());
    }
}
