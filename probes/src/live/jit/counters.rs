//! Per-CPU block counters for the live JIT ([`crate::jit::CounterMode::PerCpu`]): one copy of
//! the counters per CPU, laid out as the CPUs' per-CPU bases are, and reached through a data
//! alias of the heap in the kernel's direct map.

use anyhow::Context as _;
use exotap_vmm::control::Machine;

use super::super::attach;
use super::super::guest_memory::{read_kernel, BackendMemory};
use super::super::kernel_image::KernelImage;
use super::super::session::GuestSession;

/// Per-CPU counter copies planned from the CPUs' per-CPU bases ([`per_cpu_copies`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CounterCopies {
    /// Each CPU's copy, in bytes past the first (the lowest per-CPU base's), by CPU.
    pub(super) offsets: Vec<u64>,
    /// Bytes of each copy.
    pub(super) per_copy: u64,
    /// Bytes from the first copy's start to the last one's end.
    pub(super) span: u64,
}

/// The most room per-CPU copies may take in the patch heap.
const MAX_COUNTER_SPAN: u64 = 16 << 20;

/// Lays out one copy of `counter_bytes` of counters per CPU, each CPU's copy as far from
/// the first as its per-CPU base is from the lowest (so one `gs` displacement reaches every
/// CPU's own copy). A copy is cut to the smallest distance between two bases, and to a
/// multiple of 4 KiB. `None` (one shared counter then) with one CPU, or when two CPUs
/// share a base, copies would have under 4 KiB, or they would take more than
/// [`MAX_COUNTER_SPAN`].
pub(super) fn per_cpu_copies(per_cpu_offsets: &[u64], counter_bytes: u64) -> Option<CounterCopies> {
    let lowest = *per_cpu_offsets.iter().min()?;
    let mut sorted = per_cpu_offsets.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if per_cpu_offsets.len() < 2 || sorted.len() != per_cpu_offsets.len() {
        return None;
    }
    let gap = sorted.windows(2).map(|w| w[1] - w[0]).min()?;
    let per_copy = counter_bytes.min(gap) & !0xfff;
    let span = (sorted.last()? - lowest).checked_add(per_copy)?;
    (per_copy > 0 && span <= MAX_COUNTER_SPAN).then(|| CounterCopies {
        offsets: per_cpu_offsets.iter().map(|o| o - lowest).collect(),
        per_copy,
        span,
    })
}

/// `page_offset_base` where the kernel has no such variable (no memory KASLR).
const DEFAULT_PAGE_OFFSET: u64 = 0xffff_8880_0000_0000;

/// Maps the heap's `len` bytes at `va` a second time, data only, where the kernel's direct
/// map would have them (`page_offset_base` + physical address: the kernel maps no RAM
/// there, the heap being hidden), which is within a 32-bit displacement of the per-CPU
/// bases the kernel allocated in its direct map; checks the alias through the kernel's
/// page tables and that the vCPUs' per-CPU bases are the kernel's `__per_cpu_offset`s.
/// Returns the translator's `gs` delta ([`crate::jit::CounterMode::PerCpu`]) for copies
/// laid out by [`per_cpu_copies`] from `va`. The alias's entries stay after the session,
/// as the heap's mapping does (an NX mapping of memory only exotap uses).
pub(super) fn map_counter_alias(
    session: &mut GuestSession,
    image: &KernelImage,
    va: u64,
    len: u64,
) -> anyhow::Result<u64> {
    const SIZE_2M: u64 = 2 << 20;
    let slide = session.survey.kaslr.slide;
    let offsets = session.survey.layout.per_cpu_offsets.clone();
    let lowest = *offsets.iter().min().context("no CPU")?;
    let (heap_va, heap_phys, heap_size) = session
        .splicer()
        .context("the session is not planned")?
        .heap_range();
    anyhow::ensure!(
        va >= heap_va && va + len <= heap_va + heap_size,
        "the counters are not in the heap"
    );
    let machine: &mut dyn Machine = &mut *session.machine;
    let mut bases = Vec::new();
    for vcpu in machine.vcpus()? {
        bases.push(attach::x86_registers(machine, vcpu)?.kernel_percpu_base());
    }
    anyhow::ensure!(
        bases.iter().any(|b| offsets.contains(b)),
        "no vCPU's GS base ({bases:#x?}) is one of the kernel's per-CPU offsets"
    );
    let page_offset = match image.symbols.get("page_offset_base") {
        Some(sym) => session
            .survey
            .space(&mut BackendMemory(&mut *machine))
            .read_u64(sym.addr.wrapping_add(slide))
            .context("reading page_offset_base")?,
        None => DEFAULT_PAGE_OFFSET,
    };
    let phys = heap_phys + (va - heap_va);
    let first = phys & !(SIZE_2M - 1);
    let end = (phys + len).next_multiple_of(SIZE_2M);
    let alias = page_offset.wrapping_add(first);
    let writes = exotap_introspect::heap::plan_data_alias(
        &mut session.survey.space(&mut BackendMemory(&mut *machine)),
        alias,
        first,
        end - first,
    )
    .with_context(|| format!("no data alias of the heap at {alias:#x}"))?;
    for w in writes.iter().filter(|w| w.old != w.new) {
        machine.write_phys(w.entry_addr, &w.new.to_le_bytes())?;
    }
    const MARK: &[u8; 8] = b"exotapgs";
    machine.write_phys(phys, MARK)?;
    let mut seen = [0u8; 8];
    read_kernel(machine, page_offset.wrapping_add(phys), &mut seen)
        .context("the counters' alias cannot be read")?;
    machine.write_phys(phys, &[0; 8])?;
    anyhow::ensure!(&seen == MARK, "the counters' alias shows {seen:02x?}");
    // gs_base(n) + counter + delta = alias(counter) + (offsets[n] - lowest).
    Ok(page_offset
        .wrapping_add(heap_phys)
        .wrapping_sub(heap_va)
        .wrapping_sub(lowest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_cpu_copies_lie_as_far_apart_as_the_per_cpu_bases_and_fit_between_them() {
        // Bases 256 KiB apart, given out of order: CPU 1 has the lowest.
        let bases = [
            0xffff_8880_3e64_0000,
            0xffff_8880_3e60_0000,
            0xffff_8880_3e68_0000,
        ];

        let copies = per_cpu_copies(&bases, 1 << 20).unwrap();

        assert_eq!(copies.offsets, [0x4_0000, 0, 0x8_0000]);
        assert_eq!(copies.per_copy, 0x4_0000);
        assert_eq!(copies.span, 0xc_0000);
        // Room to spare between bases: a copy is what was asked for.
        assert_eq!(per_cpu_copies(&bases, 0x1_0000).unwrap().per_copy, 0x1_0000);
    }

    #[test]
    fn no_per_cpu_copies_for_one_cpu_shared_bases_tiny_gaps_or_a_huge_span() {
        assert_eq!(per_cpu_copies(&[0x1000_0000], 1 << 20), None);
        assert_eq!(per_cpu_copies(&[0x1000_0000, 0x1000_0000], 1 << 20), None);
        assert_eq!(per_cpu_copies(&[0x1000_0000, 0x1000_0800], 1 << 20), None);
        assert_eq!(per_cpu_copies(&[0x1000_0000, 0x2000_0000], 1 << 20), None);
        assert_eq!(per_cpu_copies(&[], 1 << 20), None);
    }
}
