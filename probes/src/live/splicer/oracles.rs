//! Oracles read from the guest's own tracing state.

use std::collections::BTreeMap;

use anyhow::{bail, Context};
use exotap_introspect::btf::Btf;
use exotap_vmm::control::Machine;

use crate::live::attach::Survey;
use crate::live::guest_memory::BackendMemory;
use crate::live::kernel_image::KernelImage;

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

/// Reads the guest's kprobe hit counters: what [`guest_kprobe_hits`] needs, found once.
#[derive(Debug, Clone)]
pub struct KprobeReader {
    survey: Survey,
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
            devent: off("trace_kprobe", "devent")?,
            list_in_devent: off("dyn_event", "list")?,
            ops_in_devent: off("dyn_event", "ops")?,
            nhit: off("trace_kprobe", "nhit")?,
            symbol: off("trace_kprobe", "symbol")?,
            nmissed: off("trace_kprobe", "rp.kp.nmissed")?,
            offset: off("trace_kprobe", "rp.kp.offset").ok(),
            head: image
                .address("dyn_event_list")?
                .wrapping_add(survey.kaslr.slide),
            kprobe_ops: image
                .symbols
                .get("trace_kprobe_ops")
                .map(|s| s.addr.wrapping_add(survey.kaslr.slide)),
        })
    }

    /// Hits and misses per kprobe'd function (the guest stopped).
    ///
    /// # Errors
    /// When guest memory cannot be read or the list does not close.
    pub fn read(&self, machine: &mut dyn Machine) -> anyhow::Result<BTreeMap<String, (u64, u64)>> {
        let mut out = BTreeMap::new();
        for ((name, _), (hits, missed)) in self.read_sites(machine)? {
            let e = out.entry(name).or_insert((0, 0));
            e.0 += hits;
            e.1 += missed;
        }
        Ok(out)
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
        let survey = &self.survey;
        let (head, kprobe_ops) = (self.head, self.kprobe_ops);
        let (devent, list_in_devent, ops_in_devent) =
            (self.devent, self.list_in_devent, self.ops_in_devent);
        let (nhit, symbol, nmissed) = (self.nhit, self.symbol, self.nmissed);
        let cpus = survey.layout.per_cpu_offsets.clone();
        let mut mem = BackendMemory(&mut *machine);
        let mut space = survey.space(&mut mem);
        let u64_at = |space: &mut exotap_introspect::paging::AddressSpace<'_, _>, a: u64| {
            let mut b = [0u8; 8];
            space.read(a, &mut b).map(|()| u64::from_le_bytes(b))
        };
        let mut out = BTreeMap::new();
        let mut node = u64_at(&mut space, head)?;
        let mut steps = 0;
        while node != head {
            steps += 1;
            if steps > 100_000 {
                bail!("dyn_event_list does not close");
            }
            let ev = node - list_in_devent;
            let tk = ev - devent;
            let ops = u64_at(&mut space, ev + ops_in_devent)?;
            if kprobe_ops.is_none_or(|k| k == ops) {
                let name_ptr = u64_at(&mut space, tk + symbol)?;
                let mut name = [0u8; 128];
                space.read(name_ptr, &mut name)?;
                let name = String::from_utf8_lossy(name.split(|b| *b == 0).next().unwrap_or(&[]))
                    .into_owned();
                let offset = match self.offset {
                    Some(o) => u64::from(space.read_u32(tk + o)?),
                    None => 0,
                };
                let per_cpu = u64_at(&mut space, tk + nhit)?;
                let mut hits = 0u64;
                for base in &cpus {
                    hits += u64_at(&mut space, per_cpu.wrapping_add(*base))?;
                }
                let missed = u64_at(&mut space, tk + nmissed)?;
                let e = out.entry((name, offset)).or_insert((0, 0));
                e.0 += hits;
                e.1 += missed;
            }
            node = u64_at(&mut space, node)?;
        }
        Ok(out)
    }
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
    let next = off("ftrace_page", "next")?;
    let records = off("ftrace_page", "records")?;
    let index = off("ftrace_page", "index")?;
    let rec_size = btf
        .struct_by_name("dyn_ftrace")
        .ok()
        .and_then(|id| btf.size_of(id))
        .unwrap_or(16);
    let start = image
        .address("ftrace_pages_start")?
        .wrapping_add(survey.kaslr.slide);
    let mut mem = BackendMemory(&mut *machine);
    let mut space = survey.space(&mut mem);
    let mut b = [0u8; 8];
    space.read(start, &mut b)?;
    let mut page = u64::from_le_bytes(b);
    let mut out = Vec::new();
    let mut steps = 0;
    while page != 0 {
        steps += 1;
        if steps > 100_000 {
            bail!("the ftrace_pages list does not end");
        }
        space.read(page + records, &mut b)?;
        let recs = u64::from_le_bytes(b);
        let mut n = [0u8; 4];
        space.read(page + index, &mut n)?;
        let n = u32::from_le_bytes(n);
        if n > 1 << 20 {
            bail!("an ftrace page claims {n} records");
        }
        let mut buf = vec![0u8; n as usize * rec_size as usize];
        space.read(recs, &mut buf)?;
        for rec in buf.chunks(rec_size as usize) {
            let ip = u64::from_le_bytes(rec[..8].try_into().unwrap_or_default());
            if ip != 0 {
                out.push(ip);
            }
        }
        space.read(page + next, &mut b)?;
        page = u64::from_le_bytes(b);
    }
    Ok(out)
}
