//! The SPARC v9 harness: the mini-kernel (big-endian, `-mcmodel=medlow`, linked at
//! 16 MiB) at its link address in the Unicorn backend, a springboard area and a patch
//! heap mapped after it, and the splice checks of [`exotap_probes::splice::sparc`].
//!
//! The patch heap is either near the image (in `ba,a` reach: splices jump straight to
//! their patches) or, with [`Placement::Far`], 256 MiB away: then every splice goes
//! through a springboard in the area next to the image, as KernInst did when its patch
//! heap was out of branch range.
//!
//! What "the same" means after a spliced run: it halts at `exotap_halt`; the 32 integer
//! registers are equal; every byte of the image (text, read-only data, data, bss) is
//! equal, the spliced words put back first, except the dead part of the stack (below the
//! final stack pointer), where patches keep their scratch registers.
//!
//! Entry code (`_start`, before it sets the stack pointer) is left out: patches need a
//! valid `%sp`.
//!
//! Trap probes (with [`Options::traps_everywhere`]): a breakpoint at the spliced word's
//! address, resumed at an out-of-line copy of the relocated instruction(s) — handled
//! inside the emulator (a code hook that counts and moves the pc) or, with
//! `in_emulator_traps` off, as breakpoint stops through the control interface. Every
//! splice point is checked that way too, except delay slots of annulling branches (a
//! trap at the branch counts the branch).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use exotap_probes::splice::sparc::{self, SparcSite, SparcText};
use exotap_vmm::control::{Machine, RegisterFile};
use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine, VCPU};

use crate::image::ElfImage;
use crate::{Divergence, Options, ProbeKind, RegressError, Report};

/// SPARC64's page size.
const PAGE: u64 = 0x2000;
/// Bytes reserved per code patch.
const PATCH_SLOT: u64 = 128;
/// Bytes per springboard.
const SPRINGBOARD_SLOT: u64 = 16;
/// Distance from the image's end to the springboard area.
const SPRINGBOARD_GAP: u64 = 0x10_0000;
/// Distance from the image's end to a near patch heap.
const NEAR_GAP: u64 = 0x20_0000;
/// A far patch heap: far beyond `ba,a` reach of the image at 16 MiB.
pub const FAR_HEAP: u64 = 0x1000_0000;
/// How many more instructions than the reference a spliced run may execute.
const BUDGET_FACTOR: u64 = 8;
/// The most instructions a reference run may take.
const REFERENCE_BUDGET: u64 = 50_000_000;

/// Where the patch heap is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// In `ba,a` reach of the image: no springboards.
    Near,
    /// 256 MiB away: every splice goes through a springboard.
    Far,
}

fn round_up(v: u64) -> u64 {
    v.div_ceil(PAGE) * PAGE
}

/// What a run left behind.
#[derive(Debug, Clone)]
struct Outcome {
    end: RunEnd,
    regs: [u64; 32],
    memory: Vec<(u64, Vec<u8>)>,
}

/// The mini-kernel loaded in a Unicorn SPARC64 machine that can be reset between runs.
struct Harness {
    m: UnicornMachine,
    regions: Vec<(u64, Vec<u8>)>,
    entry: u64,
    halt: u64,
    /// The bottom of the kernel's stack (`exotap_stack_bottom`).
    stack_bottom: u64,
    heap: u64,
    heap_size: u64,
    springboards: u64,
    /// Where patch slot 0 is (after the counters).
    slots: u64,
    in_emulator_traps: bool,
    budget: u64,
    runs: usize,
}

impl Harness {
    fn new(image: &ElfImage, placement: Placement, heap_size: u64) -> Result<Self, RegressError> {
        let halt = image.symbol("exotap_halt")?;
        let stack_bottom = image.symbol("exotap_stack_bottom")?;
        let mut pages: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        for seg in &image.segments {
            let start = seg.addr & !(PAGE - 1);
            let end = round_up(seg.addr + seg.size);
            for page in (start..end).step_by(PAGE as usize) {
                pages.entry(page).or_insert_with(|| vec![0; PAGE as usize]);
            }
            for (i, byte) in seg.data.iter().enumerate() {
                let a = seg.addr + i as u64;
                if let Some(p) = pages.get_mut(&(a & !(PAGE - 1))) {
                    p[(a & (PAGE - 1)) as usize] = *byte;
                }
            }
        }
        let mut regions: Vec<(u64, Vec<u8>)> = Vec::new();
        for (page, bytes) in pages {
            match regions.last_mut() {
                Some((a, b)) if *a + b.len() as u64 == page => b.extend(bytes),
                _ => regions.push((page, bytes)),
            }
        }
        let Some(end) = regions.last().map(|(a, b)| *a + b.len() as u64) else {
            return Err(RegressError::Layout("no segments".into()));
        };
        if end > 0xffff_ffff - FAR_HEAP {
            return Err(RegressError::Layout(
                "the SPARC harness needs an image below 4 GiB (-mcmodel=medlow)".into(),
            ));
        }
        let mut m = UnicornMachine::new(Isa::Sparc64)?;
        for (addr, bytes) in &regions {
            m.map(*addr, bytes.len() as u64)?;
        }
        let springboards = round_up(end + SPRINGBOARD_GAP);
        m.map(springboards, PAGE)?;
        let heap = match placement {
            Placement::Near => round_up(end + NEAR_GAP),
            Placement::Far => FAR_HEAP,
        };
        let heap_size = round_up(heap_size);
        m.map(heap, heap_size)?;
        m.set_halt(Some(halt))?;
        Ok(Self {
            m,
            regions,
            entry: image.entry,
            halt,
            stack_bottom,
            heap,
            heap_size,
            springboards,
            slots: heap,
            in_emulator_traps: true,
            budget: REFERENCE_BUDGET,
            runs: 0,
        })
    }

    fn reset(&mut self) -> Result<(), RegressError> {
        for (addr, bytes) in &self.regions {
            self.m.write(*addr, bytes)?;
        }
        let zero = vec![0u8; self.heap_size as usize];
        self.m.write(self.heap, &zero)?;
        for i in 0..32 {
            self.m.set_sparc_reg(i, 0)?;
        }
        self.m.set_pc(VCPU, self.entry)?;
        self.m.set_budget(self.budget);
        Ok(())
    }

    /// Runs to the end; breakpoints in `trampolines` are counted in `hits` and resumed at
    /// their out-of-line copy.
    fn run(
        &mut self,
        trampolines: &HashMap<u64, u64>,
        hits: &mut HashMap<u64, u64>,
    ) -> Result<Outcome, RegressError> {
        self.runs += 1;
        let mut total = 0u64;
        let end = loop {
            match self.m.run()? {
                RunEnd::Breakpoint(pc) if total >= self.budget => {
                    break RunEnd::BudgetExhausted(pc)
                }
                RunEnd::Breakpoint(pc) => match trampolines.get(&pc) {
                    Some(&ool) => {
                        total += 1;
                        *hits.entry(pc).or_insert(0) += 1;
                        self.m.set_pc(VCPU, ool)?;
                    }
                    None => break RunEnd::Breakpoint(pc),
                },
                end => break end,
            }
        };
        let RegisterFile::Sparc64(r) = self.m.registers(VCPU)? else {
            return Err(RegressError::Layout("not a SPARC machine".into()));
        };
        // Below the stack pointer is dead (patches keep scratch registers there).
        let dead = self.stack_bottom..r.r[14].wrapping_add(sparc::STACK_BIAS as u64);
        let mut memory = Vec::new();
        for (addr, bytes) in &self.regions {
            let mut now = vec![0u8; bytes.len()];
            self.m.read(*addr, &mut now)?;
            for (i, b) in now.iter_mut().enumerate() {
                if dead.contains(&(addr + i as u64)) {
                    *b = 0;
                }
            }
            memory.push((*addr, now));
        }
        Ok(Outcome {
            end,
            regs: r.r,
            memory,
        })
    }

    fn read_u64(&self, addr: u64) -> Result<u64, RegressError> {
        let mut b = [0u8; 8];
        self.m.read(addr, &mut b)?;
        Ok(u64::from_be_bytes(b))
    }
}

fn compare(reference: &Outcome, got: &Outcome) -> Option<String> {
    if reference.end != got.end {
        return Some(format!(
            "run ended {:?}, the reference {:?}",
            got.end, reference.end
        ));
    }
    for (i, (a, b)) in reference.regs.iter().zip(&got.regs).enumerate() {
        if a != b {
            return Some(format!("register r{i} is {b:#x}, the reference {a:#x}"));
        }
    }
    for ((addr, a), (_, b)) in reference.memory.iter().zip(&got.memory) {
        if let Some(off) = a.iter().zip(b).position(|(x, y)| x != y) {
            return Some(format!(
                "memory at {:#x} is {:#04x}, the reference {:#04x}",
                addr + off as u64,
                b[off],
                a[off]
            ));
        }
    }
    None
}

/// One point built for a run: a splice, or a trap with its out-of-line copy.
#[derive(Debug, Clone)]
struct Built {
    site: SparcSite,
    /// The original word at `site.at`.
    original: [u8; 4],
    probe: Probe,
    slot: usize,
}

#[derive(Debug, Clone)]
enum Probe {
    Splice(sparc::SparcPatch),
    Trap(Vec<u8>),
}

/// Builds the SPARC v9 mini-kernel and runs the regression over it with the patch heap
/// near the image.
///
/// # Errors
/// The cross compiler missing or failing, emulator failure, a reference run that does
/// not halt.
pub fn regress_minikernel(options: &Options) -> Result<Report, RegressError> {
    let kernel = exotap_guest_images::minikernel::ensure_sparc64()?;
    let image = ElfImage::load(&kernel.elf)?;
    regress(&image, options, Placement::Near)
}

/// Runs the SPARC regression over `image` (a SPARC v9 mini-kernel).
///
/// # Errors
/// Emulator failure, a reference run that does not halt, an image the harness cannot
/// lay out.
pub fn regress(
    image: &ElfImage,
    options: &Options,
    placement: Placement,
) -> Result<Report, RegressError> {
    let started = Instant::now();
    let batch = options.batch.max(1);
    let mut report = Report {
        image: format!("{} (SPARC v9, patch heap {placement:?})", image.path),
        ..Report::default()
    };
    let counters_size = round_up(8 * batch as u64);
    let mut h = Harness::new(image, placement, counters_size + batch as u64 * PATCH_SLOT)?;
    let counters = h.heap;
    let slots = h.heap + counters_size;
    h.slots = slots;
    if batch as u64 * SPRINGBOARD_SLOT > PAGE {
        return Err(RegressError::Layout(
            "batch too large for the springboard area".into(),
        ));
    }

    // The reference run, with the oracle profile.
    h.in_emulator_traps = options.in_emulator_traps;
    h.reset()?;
    h.m.start_profile()?;
    let reference = h.run(&HashMap::new(), &mut HashMap::new())?;
    let profile = h.m.take_profile().unwrap_or_default();
    if reference.end != RunEnd::Halted(h.halt) {
        return Err(RegressError::ReferenceDidNotHalt(format!(
            "{:?}",
            reference.end
        )));
    }
    report.reference_instructions = profile.values().sum();
    report.checksum = reference.regs[8];
    h.budget = report
        .reference_instructions
        .saturating_mul(BUDGET_FACTOR)
        .max(10_000);

    let segment = image
        .text()
        .ok_or_else(|| RegressError::Layout("no executable segment".into()))?;
    // The executable segment also holds read-only data: the text ends at _etext.
    let text_end = image.symbol("_etext")?;
    let text_len = text_end
        .checked_sub(segment.addr)
        .and_then(|n| usize::try_from(n).ok())
        .filter(|&n| n <= segment.data.len())
        .ok_or_else(|| RegressError::Layout("_etext is outside the text segment".into()))?;
    let (code, rodata) = segment.data.split_at(text_len);
    let mut data: Vec<&[u8]> = vec![rodata];
    data.extend(
        image
            .segments
            .iter()
            .filter(|s| !s.exec)
            .map(|s| s.data.as_slice()),
    );
    let analysis = SparcText::new(segment.addr, code, &data);
    let text = segment;
    let mut funcs: Vec<(u64, u64, String)> = image
        .symbols
        .iter()
        .filter(|s| s.size > 0 && s.addr >= text.addr && s.addr + s.size <= text_end)
        .map(|s| (s.addr, s.addr + s.size, s.name.clone()))
        .collect();
    funcs.sort();
    funcs.dedup_by_key(|f| f.0);
    let entry_end = funcs
        .iter()
        .map(|f| f.0)
        .find(|&a| a > image.entry)
        .unwrap_or(text_end);
    let func_name = |addr: u64| -> String {
        funcs
            .iter()
            .find(|(s, e, _)| addr >= *s && addr < *e)
            .map_or_else(|| format!("{addr:#x}"), |f| f.2.clone())
    };

    // Plan every instruction of every function (the entry code aside).
    let mut sites = Vec::new();
    report.functions = funcs.len();
    for (start, end, _) in &funcs {
        for addr in (*start..*end).step_by(4) {
            report.points += 1;
            if (image.entry..entry_end).contains(&addr) {
                *report
                    .refused
                    .entry("entry code: no stack pointer yet".into())
                    .or_insert(0) += 1;
                continue;
            }
            match sparc::plan(&analysis, addr) {
                Ok(site) => sites.push(site),
                Err(r) => *report.refused.entry(r.to_string()).or_insert(0) += 1,
            }
        }
    }
    // Entry code outside any sized symbol (the assembly _start) is not counted above.
    report.splice_points = sites.len();
    let sites: Vec<SparcSite> = sites.into_iter().step_by(options.stride.max(1)).collect();
    report.executed_points = sites
        .iter()
        .filter(|s| profile.get(&s.point).copied().unwrap_or(0) > 0)
        .count();

    let phase = Instant::now();
    check_all(
        &mut h,
        &reference,
        &profile,
        &sites,
        ProbeKind::Splice,
        batch,
        slots,
        counters,
        &mut report,
        &func_name,
    )?;
    report.splice_time = phase.elapsed();
    if options.traps_everywhere {
        let phase = Instant::now();
        let trap_sites: Vec<SparcSite> =
            sites.into_iter().filter(|s| !s.probe_when_taken).collect();
        check_all(
            &mut h,
            &reference,
            &profile,
            &trap_sites,
            ProbeKind::Trap,
            batch,
            slots,
            counters,
            &mut report,
            &func_name,
        )?;
        report.trap_time = phase.elapsed();
    }
    report.runs = h.runs;
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Checks `sites` in batches with distinct spliced/trapped words.
#[allow(clippy::too_many_arguments)]
fn check_all(
    h: &mut Harness,
    reference: &Outcome,
    profile: &HashMap<u64, u64>,
    sites: &[SparcSite],
    kind: ProbeKind,
    batch: usize,
    slots: u64,
    counters: u64,
    report: &mut Report,
    func_name: &dyn Fn(u64) -> String,
) -> Result<(), RegressError> {
    let mut pending: Vec<SparcSite> = sites.to_vec();
    while !pending.is_empty() {
        let mut batch_sites: Vec<SparcSite> = Vec::new();
        let mut rest = Vec::new();
        for s in pending {
            if batch_sites.len() < batch && batch_sites.iter().all(|b| b.at != s.at) {
                batch_sites.push(s);
            } else {
                rest.push(s);
            }
        }
        pending = rest;
        let mut built = Vec::new();
        for (slot, site) in batch_sites.into_iter().enumerate() {
            match build(h, &site, kind, slot, slots, counters) {
                Ok(b) => built.push(b),
                Err(e) => report.build_errors.push((site.point, e)),
            }
        }
        check_batch(
            h, reference, profile, &built, kind, slots, counters, report, func_name,
        )?;
    }
    Ok(())
}

fn build(
    h: &Harness,
    site: &SparcSite,
    kind: ProbeKind,
    slot: usize,
    slots: u64,
    counters: u64,
) -> Result<Built, String> {
    let mut original = [0u8; 4];
    h.m.read(site.at, &mut original)
        .map_err(|e| e.to_string())?;
    let patch_at = slots + slot as u64 * PATCH_SLOT;
    if kind == ProbeKind::Trap {
        let code = sparc::out_of_line(site, patch_at).map_err(|e| e.to_string())?;
        if code.len() as u64 > PATCH_SLOT {
            return Err(format!("out-of-line copy of {} bytes", code.len()));
        }
        return Ok(Built {
            site: site.clone(),
            original,
            probe: Probe::Trap(code),
            slot,
        });
    }
    let springboard = h.springboards + slot as u64 * SPRINGBOARD_SLOT;
    let patch = sparc::generate(
        site,
        patch_at,
        counters + 8 * slot as u64,
        Some(springboard),
    )
    .map_err(|e| e.to_string())?;
    if patch.code.len() as u64 > PATCH_SLOT {
        return Err(format!("patch of {} bytes", patch.code.len()));
    }
    Ok(Built {
        site: site.clone(),
        original,
        probe: Probe::Splice(patch),
        slot,
    })
}

/// Runs `points` together; on a divergence re-runs each alone (in slot 0) to name it.
#[allow(clippy::too_many_arguments)]
fn check_batch(
    h: &mut Harness,
    reference: &Outcome,
    profile: &HashMap<u64, u64>,
    points: &[Built],
    kind: ProbeKind,
    slots: u64,
    counters: u64,
    report: &mut Report,
    func_name: &dyn Fn(u64) -> String,
) -> Result<(), RegressError> {
    if points.is_empty() {
        return Ok(());
    }
    // The counting sweep's kinds: a trap, else a counting splice.
    match kind {
        ProbeKind::Trap => report.traps_checked += points.len(),
        _ => report.splices_checked += points.len(),
    }
    report.springboards += points
        .iter()
        .filter(|p| matches!(&p.probe, Probe::Splice(s) if s.springboard.is_some()))
        .count();
    let Some(failure) = run_points(h, reference, profile, points, counters)? else {
        return Ok(());
    };
    if points.len() == 1 {
        report.divergences.push(Divergence {
            points: vec![points[0].site.point],
            function: func_name(points[0].site.point),
            kind,
            what: failure,
        });
        return Ok(());
    }
    let mut named = false;
    for p in points {
        let single = match build(h, &p.site, kind, 0, slots, counters) {
            Ok(s) => s,
            Err(e) => {
                report.build_errors.push((p.site.point, e));
                continue;
            }
        };
        if let Some(what) = run_points(h, reference, profile, &[single], counters)? {
            named = true;
            report.divergences.push(Divergence {
                points: vec![p.site.point],
                function: func_name(p.site.point),
                kind,
                what,
            });
        }
    }
    if !named {
        report.divergences.push(Divergence {
            points: points.iter().map(|p| p.site.point).collect(),
            function: func_name(points[0].site.point),
            kind,
            what: format!("only together: {failure}"),
        });
    }
    Ok(())
}

/// One run with `points` spliced; `Some(what)` on a divergence.
fn run_points(
    h: &mut Harness,
    reference: &Outcome,
    profile: &HashMap<u64, u64>,
    points: &[Built],
    counters: u64,
) -> Result<Option<String>, RegressError> {
    h.reset()?;
    let mut trampolines = HashMap::new();
    for p in points {
        let patch_at = h.slots + p.slot as u64 * PATCH_SLOT;
        match &p.probe {
            Probe::Splice(patch) => {
                h.m.write(patch_at, &patch.code)?;
                if let Some(sb) = &patch.springboard {
                    h.m.write(h.springboards + p.slot as u64 * SPRINGBOARD_SLOT, sb)?;
                }
                h.m.write(p.site.at, &patch.splice)?;
            }
            Probe::Trap(code) => {
                h.m.write(patch_at, code)?;
                if h.in_emulator_traps {
                    h.m.add_redirect(p.site.at, patch_at)?;
                } else {
                    h.m.set_breakpoint(p.site.at, true)?;
                    trampolines.insert(p.site.at, patch_at);
                }
            }
        }
    }
    let mut hits = HashMap::new();
    let outcome = h.run(&trampolines, &mut hits);
    hits.extend(h.m.take_redirects()?);
    for p in points {
        match p.probe {
            Probe::Splice(_) => h.m.write(p.site.at, &p.original)?,
            Probe::Trap(_) if !h.in_emulator_traps => h.m.set_breakpoint(p.site.at, false)?,
            Probe::Trap(_) => {}
        }
    }
    let mut outcome = match outcome {
        Ok(o) => o,
        Err(RegressError::Emulator(e)) => return Ok(Some(format!("emulator: {e}"))),
        Err(e) => return Err(e),
    };
    for p in points {
        for (addr, bytes) in &mut outcome.memory {
            if p.site.at >= *addr && p.site.at + 4 <= *addr + bytes.len() as u64 {
                let off = (p.site.at - *addr) as usize;
                bytes[off..off + 4].copy_from_slice(&p.original);
            }
        }
    }
    if let Some(what) = compare(reference, &outcome) {
        return Ok(Some(what));
    }
    for p in points {
        let expected = profile.get(&p.site.point).copied().unwrap_or(0);
        let got = match p.probe {
            Probe::Splice(_) => h.read_u64(counters + 8 * p.slot as u64)?,
            Probe::Trap(_) => hits.get(&p.site.at).copied().unwrap_or(0),
        };
        if got != expected {
            return Ok(Some(format!(
                "probe at {:#x} counted {got}, the instruction ran {expected} times",
                p.site.point
            )));
        }
    }
    Ok(None)
}
