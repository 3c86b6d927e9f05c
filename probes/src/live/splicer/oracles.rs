//! Oracles read from the guest's own tracing state.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{bail, Context};
use exotap_introspect::btf::Btf;
use exotap_vmm::control::Machine;

use crate::live::attach::Survey;
use crate::live::guest_memory::BackendMemory;
use crate::live::kernel_image::KernelImage;
use crate::live::modules::{read_cstr, read_u32, read_u64, VirtualMemory};

/// The guest's own kprobes (`kprobe_events`): name of the probed symbol → (hits, misses),
/// summed over the CPUs, read from its `trace_kprobe` structures (the numbers
/// `kprobe_profile` prints) at this instant.
///
/// # Errors
/// When BTF lacks the structures or guest memory cannot be read.
pub fn guest_kprobe_hits(
    machine: &mut dyn Machine,
    survey: &Survey,
    image: &KernelImage,
    btf: &Btf,
) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
    KprobeReader::new(survey, image, btf)?.read(machine)
}

/// Most nodes a walk of `dyn_event_list` or of the `ftrace_pages` list visits before it
/// calls the list corrupt.
const MAX_LIST_NODES: usize = 100_000;
/// Most records one `ftrace_page` may claim.
const MAX_PAGE_RECORDS: u64 = 1 << 20;
/// Most ftrace records read in all (kernels have tens of thousands).
const MAX_FTRACE_RECORDS: u64 = 1 << 22;
/// Largest `struct dyn_ftrace` believed (16 bytes on x86-64).
const MAX_FTRACE_RECORD: u64 = 256;

/// `base + offset` for the guest field `what`, or an error where a hostile pointer would
/// take it out of the address space.
fn field(base: u64, offset: u64, what: &str) -> anyhow::Result<u64> {
    base.checked_add(offset).with_context(|| {
        format!("{what} at {base:#x} + {offset:#x} lies outside the address space")
    })
}

/// Reads the guest's kprobe hit counters: what [`guest_kprobe_hits`] needs, found once.
#[derive(Debug, Clone)]
pub struct KprobeReader {
    survey: Survey,
    offsets: KprobeOffsets,
}

/// Where the kernel keeps its kprobe events: the list head (a running address) and the
/// offsets BTF gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KprobeOffsets {
    head: u64,
    kprobe_ops: Option<u64>,
    devent: u64,
    list_in_devent: u64,
    ops_in_devent: u64,
    nhit: u64,
    symbol: u64,
    nmissed: u64,
    /// `trace_kprobe.rp.kp.offset` (the `+OFFSET` of `p SYMBOL+OFFSET`).
    offset: Option<u64>,
    /// `trace_kprobe.rp.handler`: set on a return probe (`r SYMBOL`), as the kernel's own
    /// `trace_kprobe_is_return` reads it.
    handler: Option<u64>,
}

impl KprobeReader {
    /// Finds the kernel's kprobe event list and the offsets to read it.
    ///
    /// # Errors
    /// When BTF or the symbols lack what is needed.
    pub fn new(survey: &Survey, image: &KernelImage, btf: &Btf) -> anyhow::Result<Self> {
        let off = |s: &str, m: &str| -> anyhow::Result<u64> {
            btf.struct_member(s, m)
                .ok()
                .and_then(|l| l.byte_offset())
                .with_context(|| format!("BTF has no {s}.{m}"))
        };
        Ok(Self {
            survey: survey.clone(),
            offsets: KprobeOffsets {
                devent: off("trace_kprobe", "devent")?,
                list_in_devent: off("dyn_event", "list")?,
                ops_in_devent: off("dyn_event", "ops")?,
                nhit: off("trace_kprobe", "nhit")?,
                symbol: off("trace_kprobe", "symbol")?,
                nmissed: off("trace_kprobe", "rp.kp.nmissed")?,
                offset: off("trace_kprobe", "rp.kp.offset").ok(),
                handler: off("trace_kprobe", "rp.handler").ok(),
                head: image
                    .address("dyn_event_list")?
                    .wrapping_add(survey.kaslr.slide),
                kprobe_ops: image
                    .symbols
                    .get("trace_kprobe_ops")
                    .map(|s| s.addr.wrapping_add(survey.kaslr.slide)),
            },
        })
    }

    /// Hits and misses per kprobe'd function (the guest stopped).
    ///
    /// # Errors
    /// When guest memory cannot be read or the list does not close.
    pub fn read(&self, machine: &mut dyn Machine) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
        Ok(by_function(self.read_sites(machine)?))
    }

    /// Hits and misses per kprobe, keyed by (symbol, offset): `p vfs_read+0x1c` is
    /// `("vfs_read", 0x1c)` (the guest stopped).
    ///
    /// # Errors
    /// When guest memory cannot be read or the list does not close.
    pub fn read_sites(
        &self,
        machine: &mut dyn Machine,
    ) -> anyhow::Result<BTreeMap<(String, u64), (u64, u64)>> {
        let cpus = self.survey.layout.per_cpu_offsets.clone();
        let mut mem = BackendMemory(&mut *machine);
        let mut space = self.survey.space(&mut mem);
        read_kprobe_list(&mut space, &self.offsets, &cpus)
    }
}

/// Per-site counts summed per function (saturating: the counters are guest data).
fn by_function(sites: BTreeMap<(String, u64), (u64, u64)>) -> BTreeMap<String, (u64, u64)> {
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for ((name, _), (hits, missed)) in sites {
        let e = out.entry(name).or_default();
        e.0 = e.0.saturating_add(hits);
        e.1 = e.1.saturating_add(missed);
    }
    out
}

/// Walks `dyn_event_list` in `mem`: every node is checked (no wrapped address), the walk
/// ends with an error at a node seen before or after [`MAX_LIST_NODES`], and the counters
/// are summed saturating (`cpus`: the kernel's per-CPU offsets).
fn read_kprobe_list<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    o: &KprobeOffsets,
    cpus: &[u64],
) -> anyhow::Result<BTreeMap<(String, u64), (u64, u64)>> {
    let mut out: BTreeMap<(String, u64), (u64, u64)> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    let mut node = read_u64(mem, o.head).context("cannot read dyn_event_list")?;
    while node != o.head {
        if seen.len() >= MAX_LIST_NODES {
            bail!("dyn_event_list does not close within {MAX_LIST_NODES} nodes");
        }
        if !seen.insert(node) {
            bail!("dyn_event_list does not close: it loops back to {node:#x}");
        }
        let ev = node.checked_sub(o.list_in_devent).with_context(|| {
            format!("the dyn_event_list node {node:#x} lies below its offset in struct dyn_event")
        })?;
        let tk = ev.checked_sub(o.devent).with_context(|| {
            format!("the dyn_event at {ev:#x} lies below its offset in struct trace_kprobe")
        })?;
        let ops = read_u64(mem, field(ev, o.ops_in_devent, "dyn_event.ops")?)?;
        if o.kprobe_ops.is_none_or(|k| k == ops) {
            let name_ptr = read_u64(mem, field(tk, o.symbol, "trace_kprobe.symbol")?)?;
            // A page at a time: the string may end just before unmapped memory (seen on
            // 6.12: a kmalloc'd name 32 bytes before the end of the direct map's last page).
            let name = read_cstr(mem, name_ptr)
                .with_context(|| format!("cannot read a kprobe's symbol at {name_ptr:#x}"))?;
            let mut name = String::from_utf8_lossy(&name).into_owned();
            // A return probe counts the function's returns: `vfs_read%return`, as stap
            // names the point.
            if let Some(h) = o.handler {
                if read_u64(mem, field(tk, h, "trace_kprobe.rp.handler")?)? != 0 {
                    name.push_str("%return");
                }
            }
            let offset = match o.offset {
                Some(off) => u64::from(read_u32(mem, field(tk, off, "trace_kprobe offset")?)?),
                None => 0,
            };
            let per_cpu = read_u64(mem, field(tk, o.nhit, "trace_kprobe.nhit")?)?;
            let mut hits = 0u64;
            for base in cpus {
                // per_cpu_ptr(): the kernel's own (unsigned, wrapping) addition.
                hits = hits.saturating_add(read_u64(mem, per_cpu.wrapping_add(*base))?);
            }
            let missed = read_u64(mem, field(tk, o.nmissed, "trace_kprobe nmissed")?)?;
            let e = out.entry((name, offset)).or_default();
            e.0 = e.0.saturating_add(hits);
            e.1 = e.1.saturating_add(missed);
        }
        node = read_u64(mem, node)
            .with_context(|| format!("cannot follow the dyn_event_list node at {node:#x}"))?;
    }
    Ok(out)
}

/// The addresses of the guest's ftrace records (what `available_filter_functions` lists),
/// read from its `ftrace_pages` list.
///
/// # Errors
/// When BTF lacks the structures or guest memory cannot be read.
pub fn guest_ftrace_sites(
    machine: &mut dyn Machine,
    survey: &Survey,
    image: &KernelImage,
    btf: &Btf,
) -> anyhow::Result<Vec<u64>> {
    let off = |s: &str, m: &str| -> anyhow::Result<u64> {
        btf.struct_member(s, m)
            .ok()
            .and_then(|l| l.byte_offset())
            .with_context(|| format!("BTF has no {s}.{m}"))
    };
    let offsets = FtraceOffsets {
        next: off("ftrace_page", "next")?,
        records: off("ftrace_page", "records")?,
        index: off("ftrace_page", "index")?,
        record_size: btf
            .struct_by_name("dyn_ftrace")
            .ok()
            .and_then(|id| btf.size_of(id))
            .unwrap_or(16),
    };
    let start = image
        .address("ftrace_pages_start")?
        .wrapping_add(survey.kaslr.slide);
    let mut mem = BackendMemory(&mut *machine);
    let mut space = survey.space(&mut mem);
    read_ftrace_pages(&mut space, start, &offsets)
}

/// `struct ftrace_page`'s members and `struct dyn_ftrace`'s size, from BTF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FtraceOffsets {
    next: u64,
    records: u64,
    index: u64,
    record_size: u64,
}

/// Walks the `ftrace_pages` list from the pointer at `start`: bounded in nodes (a node seen
/// twice is an error), records per page and records in all, every address checked.
fn read_ftrace_pages<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    start: u64,
    o: &FtraceOffsets,
) -> anyhow::Result<Vec<u64>> {
    let size = o.record_size;
    if !(8..=MAX_FTRACE_RECORD).contains(&size) {
        bail!("struct dyn_ftrace is {size} bytes, not 8 to {MAX_FTRACE_RECORD}");
    }
    let mut page = read_u64(mem, start).context("cannot read ftrace_pages_start")?;
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    while page != 0 {
        if seen.len() >= MAX_LIST_NODES {
            bail!("the ftrace_pages list does not end within {MAX_LIST_NODES} pages");
        }
        if !seen.insert(page) {
            bail!("the ftrace_pages list does not end: it loops back to {page:#x}");
        }
        let recs = read_u64(mem, field(page, o.records, "ftrace_page.records")?)?;
        let n = u64::from(read_u32(mem, field(page, o.index, "ftrace_page.index")?)?);
        if n > MAX_PAGE_RECORDS {
            bail!("an ftrace page claims {n} records");
        }
        if out.len() as u64 + n > MAX_FTRACE_RECORDS {
            bail!("the ftrace pages claim more than {MAX_FTRACE_RECORDS} records");
        }
        // n <= MAX_PAGE_RECORDS, size <= MAX_FTRACE_RECORD: no overflow.
        let len = n * size;
        field(recs, len, "an ftrace page's records")?;
        let mut buf = vec![0u8; usize::try_from(len)?];
        mem.read_virt(recs, &mut buf)
            .with_context(|| format!("cannot read {n} ftrace records at {recs:#x}"))?;
        for rec in buf.chunks_exact(usize::try_from(size)?) {
            let ip = u64::from_le_bytes(
                rec.get(..8)
                    .and_then(|b| b.try_into().ok())
                    .unwrap_or_default(),
            );
            if ip != 0 {
                out.push(ip);
            }
        }
        page = read_u64(mem, field(page, o.next, "ftrace_page.next")?)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::modules::Flat;
    use exotap_introspect::memory::SparseMemory;

    const HEAD: u64 = 0xffff_ffff_8300_0000;
    const OPS: u64 = 0xffff_ffff_8200_0000;
    /// Two CPUs' per-CPU offsets.
    const CPUS: [u64; 2] = [0xffff_8880_1000_0000, 0xffff_8880_1100_0000];
    /// `trace_kprobe`: `devent` (a `dyn_event`: `list` at 0, `ops` at 16) at 8, `nhit` at
    /// 32, `symbol` at 40, `nmissed` at 48, `offset` at 56, `rp.handler` at 64.
    const KPROBES: KprobeOffsets = KprobeOffsets {
        head: HEAD,
        kprobe_ops: Some(OPS),
        devent: 8,
        list_in_devent: 0,
        ops_in_devent: 16,
        nhit: 32,
        symbol: 40,
        nmissed: 48,
        offset: Some(56),
        handler: Some(64),
    };

    /// A `trace_kprobe` at `at` on the list before `next`, its per-CPU hits `hits`.
    fn kprobe(
        mem: &mut SparseMemory,
        at: u64,
        next: u64,
        ops: u64,
        name: &str,
        hits: [u64; 2],
        missed: u64,
    ) {
        // A page, as the guest maps memory (names are read up to the end of their page).
        let mut t = vec![0u8; 0x1000];
        let word =
            |t: &mut Vec<u8>, o: usize, v: u64| t[o..o + 8].copy_from_slice(&v.to_le_bytes());
        word(&mut t, 8, next);
        word(&mut t, 24, ops);
        // nhit: a per-CPU pointer (an offset the CPUs' bases are added to).
        let percpu = at & 0xffff_ffff;
        word(&mut t, 32, percpu);
        word(&mut t, 40, at + 0x80);
        word(&mut t, 48, missed);
        t[56..60].copy_from_slice(&0x1cu32.to_le_bytes());
        t[0x80..0x80 + name.len()].copy_from_slice(name.as_bytes());
        mem.add_region(at, t).unwrap();
        for (cpu, h) in CPUS.iter().zip(hits) {
            mem.add_region(cpu + percpu, h.to_le_bytes().to_vec())
                .unwrap();
        }
    }

    /// The list head and two kprobes on one function (and a non-kprobe event).
    fn kprobes(hits: [u64; 2]) -> Flat {
        let mut mem = SparseMemory::new();
        let (a, b, c) = (
            0xffff_8880_0200_0000u64,
            0xffff_8880_0200_1000u64,
            0xffff_8880_0200_2000u64,
        );
        mem.add_region(HEAD, (a + 8).to_le_bytes().to_vec())
            .unwrap();
        kprobe(&mut mem, a, b + 8, OPS, "vfs_read", hits, 1);
        kprobe(&mut mem, b, c + 8, OPS + 8, "uprobe", [5, 5], 0);
        kprobe(&mut mem, c, HEAD, OPS, "vfs_read", [1, 2], u64::MAX);
        Flat(mem)
    }

    #[test]
    fn kprobe_counters_are_summed_over_cpus_and_sites_saturating() {
        let sites = read_kprobe_list(&mut kprobes([3, 4]), &KPROBES, &CPUS).unwrap();
        assert_eq!(
            sites.into_iter().collect::<Vec<_>>(),
            [(("vfs_read".to_owned(), 0x1c), (10, u64::MAX))]
        );

        // Counters near the top (a hostile or wrapped guest counter) saturate.
        let sites = read_kprobe_list(&mut kprobes([u64::MAX, 4]), &KPROBES, &CPUS).unwrap();
        assert_eq!(sites[&("vfs_read".to_owned(), 0x1c)], (u64::MAX, u64::MAX));
        let mut twice = sites.clone();
        twice.insert(("vfs_read".to_owned(), 0), (u64::MAX, 1));
        assert_eq!(by_function(twice)["vfs_read"], (u64::MAX, u64::MAX));
    }

    /// A kprobe's symbol that ends just before unmapped memory reads (the string is read a
    /// page at a time, not as a fixed-size buffer that runs past it).
    #[test]
    fn a_kprobe_symbol_at_the_end_of_mapped_memory_reads() {
        let mut mem = kprobes([3, 4]);
        // The first kprobe's name moved to the last 16 bytes before a page nothing maps.
        let a = 0xffff_8880_0200_0000u64;
        let name_at = 0xffff_8880_0300_0ff0u64;
        let mut tail = b"vfs_write".to_vec();
        tail.resize(16, 0);
        mem.0.add_region(name_at, tail).unwrap();
        mem.0.write_phys(a + 40, &name_at.to_le_bytes()).unwrap();
        let sites = read_kprobe_list(&mut mem, &KPROBES, &CPUS).unwrap();
        assert_eq!(sites[&("vfs_write".to_owned(), 0x1c)], (7, 1));
        assert_eq!(sites[&("vfs_read".to_owned(), 0x1c)], (3, u64::MAX));
    }

    #[test]
    fn a_return_probe_counts_apart_from_the_entry_probe_on_the_same_function() {
        let mut mem = kprobes([3, 4]);
        // The third node becomes `r vfs_read`: its handler set.
        let c = 0xffff_8880_0200_2000u64;
        mem.0
            .write_phys(c + 64, &0xffff_ffff_8123_4560u64.to_le_bytes())
            .unwrap();
        let sites = read_kprobe_list(&mut mem, &KPROBES, &CPUS).unwrap();
        assert_eq!(sites[&("vfs_read".to_owned(), 0x1c)], (7, 1));
        assert_eq!(sites[&("vfs_read%return".to_owned(), 0x1c)], (3, u64::MAX));
        let by = by_function(sites);
        assert_eq!(
            (by["vfs_read"], by["vfs_read%return"]),
            ((7, 1), (3, u64::MAX))
        );
    }

    #[test]
    fn a_hostile_kprobe_list_is_an_error_not_a_panic_or_a_hang() {
        // A node that points at itself.
        let mut mem = kprobes([1, 1]);
        let a = 0xffff_8880_0200_0000u64;
        mem.0.write_phys(a + 8, &(a + 8).to_le_bytes()).unwrap();
        let err = read_kprobe_list(&mut mem, &KPROBES, &CPUS).unwrap_err();
        assert!(format!("{err:#}").contains("loops back"), "{err:#}");

        // A node below its offsets in the structures.
        let mut mem = kprobes([1, 1]);
        mem.0.write_phys(HEAD, &4u64.to_le_bytes()).unwrap();
        let err = read_kprobe_list(&mut mem, &KPROBES, &CPUS).unwrap_err();
        assert!(format!("{err:#}").contains("lies below"), "{err:#}");

        // A node whose fields would wrap the address space.
        let mut mem = kprobes([1, 1]);
        mem.0
            .write_phys(HEAD, &(u64::MAX - 4).to_le_bytes())
            .unwrap();
        let err = read_kprobe_list(&mut mem, &KPROBES, &CPUS).unwrap_err();
        assert!(
            format!("{err:#}").contains("lies outside the address space"),
            "{err:#}"
        );
    }

    const FTRACE: FtraceOffsets = FtraceOffsets {
        next: 0,
        records: 8,
        index: 16,
        record_size: 16,
    };
    const START: u64 = 0xffff_ffff_8300_1000;

    /// `ftrace_pages_start` and a list of `pages`, each (records' ips).
    fn ftrace(pages: &[&[u64]]) -> Flat {
        let mut mem = SparseMemory::new();
        let page = |i: usize| 0xffff_8880_0300_0000u64 + 0x1000 * i as u64;
        let first = if pages.is_empty() { 0 } else { page(0) };
        mem.add_region(START, first.to_le_bytes().to_vec()).unwrap();
        for (i, ips) in pages.iter().enumerate() {
            let mut p = vec![0u8; 0x1000];
            let next = if i + 1 == pages.len() { 0 } else { page(i + 1) };
            p[0..8].copy_from_slice(&next.to_le_bytes());
            p[8..16].copy_from_slice(&(page(i) + 0x100).to_le_bytes());
            p[16..20].copy_from_slice(&(ips.len() as u32).to_le_bytes());
            for (r, ip) in ips.iter().enumerate() {
                p[0x100 + 16 * r..0x108 + 16 * r].copy_from_slice(&ip.to_le_bytes());
            }
            mem.add_region(page(i), p).unwrap();
        }
        Flat(mem)
    }

    #[test]
    fn ftrace_pages_give_their_records() {
        let sites = read_ftrace_pages(&mut ftrace(&[&[1, 0, 2], &[3]]), START, &FTRACE).unwrap();
        assert_eq!(sites, [1, 2, 3]);
    }

    #[test]
    fn a_hostile_ftrace_list_is_an_error_not_a_panic_a_hang_or_a_huge_read() {
        let page0 = 0xffff_8880_0300_0000u64;
        // A page that points at itself.
        let mut mem = ftrace(&[&[1]]);
        mem.0.write_phys(page0, &page0.to_le_bytes()).unwrap();
        let err = read_ftrace_pages(&mut mem, START, &FTRACE).unwrap_err();
        assert!(format!("{err:#}").contains("loops back"), "{err:#}");

        // A page claiming 4 billion records.
        let mut mem = ftrace(&[&[1]]);
        mem.0
            .write_phys(page0 + 16, &u32::MAX.to_le_bytes())
            .unwrap();
        let err = read_ftrace_pages(&mut mem, START, &FTRACE).unwrap_err();
        assert!(format!("{err:#}").contains("4294967295 records"), "{err:#}");

        // Records at the top of the address space.
        let mut mem = ftrace(&[&[1]]);
        mem.0
            .write_phys(page0 + 8, &(u64::MAX - 8).to_le_bytes())
            .unwrap();
        let err = read_ftrace_pages(&mut mem, START, &FTRACE).unwrap_err();
        assert!(
            format!("{err:#}").contains("lies outside the address space"),
            "{err:#}"
        );

        // A record size that would not hold an address.
        let err = read_ftrace_pages(
            &mut ftrace(&[&[1]]),
            START,
            &FtraceOffsets {
                record_size: 0,
                ..FTRACE
            },
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("0 bytes"), "{err:#}");
    }
}
