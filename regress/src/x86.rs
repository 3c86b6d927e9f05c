//! The x86-64 harness: the image at its link address in the Unicorn backend, a stack
//! below it, a patch heap above it (in rel32 reach, as exotap places it past `_end`), and
//! the splice/trap checks.
//!
//! What "the same" means after a probed run: the run halts at the halt address; the 16
//! general-purpose registers are equal; rflags are equal except the status flags (the
//! planner lets a patch clobber status flags where liveness says they are dead, and
//! nothing reads them after the last function returns); every byte of the image's
//! segments is equal (the spliced `jmp` excepted, which is put back before comparing);
//! the live part of the stack (from the final `rsp` up) is equal. Memory below `rsp` is
//! dead (the image is built with `-mno-red-zone`, as the kernel is), and patches use it.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use exotap_introspect::x86::{ranges_from_starts, AnalysisConfig, CodeView, TextAnalysis};
use exotap_probes::splice::{
    generate, out_of_line, plan, PatchRequest, Probe, Refusal, Site, SpliceContext, SpliceDecision,
};
use exotap_vmm::control::{Machine, RegisterFile, X86Registers};
use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine, VCPU};

use crate::image::ElfImage;
use crate::{Divergence, Options, ProbeKind, RegressError, Report};

const PAGE: u64 = 0x1000;
/// The patch heap's size for the splice sweep (patches and counters of one batch).
pub(crate) const HEAP_SIZE: usize = 0x4_0000;
/// The stack: 64 KiB ending 1 MiB below the image.
const STACK_SIZE: u64 = 0x1_0000;
/// The patch heap's distance above the image's end.
const HEAP_GAP: u64 = 0x10_0000;
/// Bytes reserved for one code patch or out-of-line copy.
const PATCH_SLOT: u64 = 128;
/// Status flags in rflags (CF PF AF ZF SF OF).
const STATUS_FLAGS: u64 = 0x8d5;
/// How many more instructions than the reference a probed run may execute (per probe
/// hit the patch adds a handful).
const BUDGET_FACTOR: u64 = 8;
/// The most instructions a reference run may take.
pub(crate) const REFERENCE_BUDGET: u64 = 50_000_000;

fn round_up(v: u64) -> u64 {
    v.div_ceil(PAGE) * PAGE
}

/// A region of guest memory and its initial contents.
#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub(crate) addr: u64,
    pub(crate) init: Vec<u8>,
    /// Written back before every run (otherwise only spliced bytes are put back).
    pub(crate) reset: bool,
    /// Compared after every run.
    pub(crate) compare: bool,
}

/// What a run left behind.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) end: RunEnd,
    pub(crate) gpr: [u64; 16],
    rflags: u64,
    /// Image memory, then the live stack (from rsp up).
    pub(crate) memory: Vec<(u64, Vec<u8>)>,
    /// Breakpoint hits per address (trap runs).
    hits: HashMap<u64, u64>,
}

impl Outcome {
    /// Puts the first five of `original`'s bytes back at `addr` in the memory the run left
    /// (where a splice's `jmp` was), so that the text compares with the reference's.
    pub(crate) fn unsplice(&mut self, addr: u64, original: &[u8]) {
        for (start, bytes) in &mut self.memory {
            if addr >= *start && addr + 5 <= *start + bytes.len() as u64 {
                let off = (addr - *start) as usize;
                bytes[off..off + 5].copy_from_slice(&original[..5]);
            }
        }
    }
}

/// The image loaded in a Unicorn machine that can be reset between runs.
pub(crate) struct Harness {
    pub(crate) m: UnicornMachine,
    image_regions: Vec<Region>,
    stack: Region,
    heap: Region,
    /// Registers at the start of a run (rsp is set to the top of the stack minus
    /// `stack_pushed`).
    pub(crate) start: X86Registers,
    /// Bytes the caller placed on top of the stack (a return address), in `stack.init`.
    pub(crate) halt: u64,
    pub(crate) budget: u64,
    pub(crate) runs: usize,
    /// Traps handled inside the emulator (a code hook that moves the pc) instead of as
    /// breakpoint events through the control interface.
    pub(crate) in_emulator_traps: bool,
}

impl Harness {
    pub(crate) fn new(image: &ElfImage, heap_size: usize) -> Result<Self, RegressError> {
        let halt = image.symbol("exotap_halt")?;
        // Page-rounded images of the segments (segments may share pages).
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
        let mut image_regions: Vec<Region> = Vec::new();
        for (page, bytes) in pages {
            match image_regions.last_mut() {
                Some(r) if r.addr + r.init.len() as u64 == page => r.init.extend(bytes),
                _ => image_regions.push(Region {
                    addr: page,
                    init: bytes,
                    reset: true,
                    compare: true,
                }),
            }
        }
        let (Some(first), Some(last)) = (image_regions.first(), image_regions.last()) else {
            return Err(RegressError::Layout("no segments".into()));
        };
        let image_start = first.addr;
        let image_end = last.addr + last.init.len() as u64;
        let mut start = X86Registers {
            rip: image.entry,
            rflags: 0x2,
            ..X86Registers::default()
        };
        start.gpr[7] = image_start - HEAP_GAP - 16;
        Self::with_regions(
            image_regions,
            image_start,
            image_end,
            halt,
            start,
            heap_size,
        )
    }

    /// A harness over `image_regions` (already page-aligned), with a stack below
    /// `image_start` and a patch heap above `image_end`.
    pub(crate) fn with_regions(
        image_regions: Vec<Region>,
        image_start: u64,
        image_end: u64,
        halt: u64,
        start: X86Registers,
        heap_size: usize,
    ) -> Result<Self, RegressError> {
        let mut m = UnicornMachine::new(Isa::X86_64)?;
        let stack = Region {
            addr: image_start
                .checked_sub(HEAP_GAP + STACK_SIZE)
                .ok_or_else(|| RegressError::Layout("image too low for a stack".into()))?,
            init: vec![0; STACK_SIZE as usize],
            reset: true,
            compare: false,
        };
        let heap = Region {
            addr: image_end
                .checked_add(HEAP_GAP)
                .ok_or_else(|| RegressError::Layout("image too high for a heap".into()))?,
            init: vec![0; heap_size],
            reset: true,
            compare: false,
        };
        for r in image_regions.iter().chain([&stack, &heap]) {
            m.map(r.addr, r.init.len() as u64)?;
            m.write(r.addr, &r.init)?;
        }
        m.set_halt(Some(halt))?;
        Ok(Self {
            m,
            image_regions,
            stack,
            heap,
            start,
            halt,
            budget: u64::MAX,
            runs: 0,
            in_emulator_traps: false,
        })
    }

    /// Replaces the initial contents of the region at `addr`.
    pub(crate) fn set_region_init(&mut self, addr: u64, init: Vec<u8>) -> Result<(), RegressError> {
        let region = self
            .image_regions
            .iter_mut()
            .find(|r| r.addr == addr && r.init.len() == init.len())
            .ok_or_else(|| RegressError::Layout(format!("no region of that size at {addr:#x}")))?;
        region.init = init;
        Ok(())
    }

    /// Puts `ret` on top of the initial stack as a return address; returns the `rsp`
    /// a called function starts with (aligned as the ABI wants at entry).
    pub(crate) fn push_return_address(&mut self, ret: u64) -> Result<u64, RegressError> {
        let len = self.stack.init.len();
        self.stack.init[len - 24..len - 16].copy_from_slice(&ret.to_le_bytes());
        Ok(self.stack.addr + len as u64 - 24)
    }

    pub(crate) fn heap_base(&self) -> u64 {
        self.heap.addr
    }

    pub(crate) fn heap_end(&self) -> u64 {
        self.heap.addr + self.heap.init.len() as u64
    }

    /// Puts memory and registers back to the state before the first instruction.
    pub(crate) fn reset(&mut self) -> Result<(), RegressError> {
        for r in self.image_regions.iter().chain([&self.stack, &self.heap]) {
            if r.reset {
                self.m.write(r.addr, &r.init)?;
            }
        }
        self.m.set_x86_registers(&self.start)?;
        self.m.set_budget(self.budget);
        Ok(())
    }

    /// Runs to the end; at a breakpoint in `trampolines`, counts the hit and continues
    /// at the out-of-line copy.
    pub(crate) fn run(&mut self, trampolines: &HashMap<u64, u64>) -> Result<Outcome, RegressError> {
        self.runs += 1;
        let mut hits: HashMap<u64, u64> = HashMap::new();
        let mut total_hits = 0u64;
        let end = loop {
            match self.m.run()? {
                RunEnd::Breakpoint(pc) if total_hits >= self.budget => {
                    break RunEnd::BudgetExhausted(pc)
                }
                RunEnd::Breakpoint(pc) => match trampolines.get(&pc) {
                    Some(&ool) => {
                        total_hits += 1;
                        *hits.entry(pc).or_insert(0) += 1;
                        self.m.set_pc(VCPU, ool)?;
                    }
                    None => break RunEnd::Breakpoint(pc),
                },
                end => break end,
            }
        };
        let RegisterFile::X86_64(regs) = self.m.registers(VCPU)? else {
            return Err(RegressError::Layout("not an x86-64 register file".into()));
        };
        let mut memory = Vec::new();
        for r in self.image_regions.iter().filter(|r| r.compare) {
            let mut buf = vec![0; r.init.len()];
            self.m.read(r.addr, &mut buf)?;
            memory.push((r.addr, buf));
        }
        let stack_end = self.stack.addr + STACK_SIZE;
        let rsp = regs.gpr[7].clamp(self.stack.addr, stack_end);
        let mut live = vec![0; (stack_end - rsp) as usize];
        self.m.read(rsp, &mut live)?;
        memory.push((rsp, live));
        Ok(Outcome {
            end,
            gpr: regs.gpr,
            rflags: regs.rflags,
            memory,
            hits,
        })
    }
}

/// The first difference between a probed run and the reference, if any.
pub(crate) fn compare(reference: &Outcome, probed: &Outcome) -> Option<String> {
    if probed.end != reference.end {
        return Some(format!(
            "ended with {:?} instead of {:?}",
            probed.end, reference.end
        ));
    }
    for (i, (a, b)) in reference.gpr.iter().zip(&probed.gpr).enumerate() {
        if a != b {
            let name = exotap_vmm::control::X86_GPR_NAMES[i];
            return Some(format!("{name} is {b:#x} instead of {a:#x}"));
        }
    }
    if reference.rflags & !STATUS_FLAGS != probed.rflags & !STATUS_FLAGS {
        return Some(format!(
            "rflags {:#x} instead of {:#x}",
            probed.rflags, reference.rflags
        ));
    }
    if reference.memory.len() != probed.memory.len() {
        return Some("different memory layout".into());
    }
    for ((addr, a), (addr_b, b)) in reference.memory.iter().zip(&probed.memory) {
        if addr != addr_b || a.len() != b.len() {
            return Some(format!(
                "live stack starts at {addr_b:#x} instead of {addr:#x}"
            ));
        }
        if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
            return Some(format!(
                "memory at {:#x} is {:#04x} instead of {:#04x}",
                addr + i as u64,
                b[i],
                a[i]
            ));
        }
    }
    None
}

/// A planned point with what it takes to instrument it.
#[derive(Debug, Clone)]
struct Point {
    addr: u64,
    original: Vec<u8>,
    /// The planned site (splices).
    site: Option<Site>,
    /// Splice: (patch code, splice bytes) at the point's patch slot.
    splice: Option<(Vec<u8>, [u8; 5])>,
    /// Trap: the out-of-line copy at the point's trap slot.
    ool: Option<Vec<u8>>,
}

fn reason_key(r: &Refusal) -> String {
    match r {
        Refusal::Unsupported { mnemonic, .. } => format!("Unsupported ({mnemonic:?})"),
        other => {
            let dbg = format!("{other:?}");
            dbg.split([' ', '{', '('])
                .next()
                .unwrap_or_default()
                .to_owned()
        }
    }
}

/// Runs the regression over an x86-64 image with `exotap_halt` and the text's symbols as
/// function boundaries.
///
/// # Errors
/// Emulator failure or a reference run that does not halt.
pub fn regress(image: &ElfImage, options: &Options) -> Result<Report, RegressError> {
    let started = Instant::now();
    let text = image
        .text()
        .ok_or_else(|| RegressError::Layout("no executable segment".into()))?;
    let view =
        CodeView::new(text.addr, &text.data).map_err(|e| RegressError::Layout(e.to_string()))?;
    let ranges = ranges_from_starts(&image.text_symbol_starts(), view.end());
    let analysis = TextAnalysis::analyze(view, &ranges, &AnalysisConfig::new());
    let ctx = SpliceContext::new(view, &analysis);

    let mut h = Harness::new(image, HEAP_SIZE)?;
    h.in_emulator_traps = options.in_emulator_traps;
    let mut report = Report {
        image: image.path.clone(),
        functions: analysis.function_count(),
        ..Report::default()
    };
    let func_name = |addr: u64| -> String {
        image
            .symbols
            .iter()
            .rev()
            .find(|s| s.addr <= addr && s.addr >= text.addr)
            .map_or_else(
                || "?".into(),
                |s| format!("{}+{:#x}", s.name, addr - s.addr),
            )
    };
    let addrs: Vec<u64> = analysis
        .functions()
        .flat_map(|f| f.cfg.insns().iter().map(|i| i.addr))
        .collect();
    sweep(&mut h, &ctx, &addrs, options, &mut report, &func_name)?;
    report.elapsed = started.elapsed();
    Ok(report)
}

/// The reference run, then every point of `addrs` planned, probed and checked; adds
/// to `report`.
pub(crate) fn sweep(
    h: &mut Harness,
    ctx: &SpliceContext<'_>,
    addrs: &[u64],
    options: &Options,
    report: &mut Report,
    func_name: &dyn Fn(u64) -> String,
) -> Result<(), RegressError> {
    // The reference run, profiled, with a generous bound.
    h.budget = REFERENCE_BUDGET;
    h.reset()?;
    h.m.start_profile()?;
    let reference = h.run(&HashMap::new())?;
    let profile = h.m.take_profile().unwrap_or_default();
    let reference_instructions: u64 = profile.values().sum();
    report.reference_instructions += reference_instructions;
    if reference.end != RunEnd::Halted(h.halt) {
        return Err(RegressError::ReferenceDidNotHalt(format!(
            "{:?}",
            reference.end
        )));
    }
    report.checksum = report.checksum.rotate_left(7) ^ reference.gpr[0];
    h.budget = reference_instructions
        .saturating_mul(BUDGET_FACTOR)
        .saturating_add(100_000);

    // Plan every instruction; build each accepted point's patch at its own slot.
    let batch = options.batch.max(1);
    let slots_per_batch = 2 * batch as u64;
    let counters = h.heap_base();
    let slots = counters + round_up(8 * batch as u64);
    if slots + slots_per_batch * PATCH_SLOT > h.heap_end() {
        return Err(RegressError::Layout(
            "batch too large for the patch heap".into(),
        ));
    }
    let mut points = Vec::new();
    {
        for &addr in addrs {
            report.points += 1;
            // Slot i of a batch is fixed per position, so plan against the farthest.
            let far_slot = slots + (slots_per_batch - 1) * PATCH_SLOT;
            match plan(ctx, addr, far_slot) {
                SpliceDecision::Refuse(r) => {
                    *report.refused.entry(reason_key(&r)).or_insert(0) += 1
                }
                SpliceDecision::Splice(site) => {
                    report.splice_points += 1;
                    points.push((site.addr, site.bytes.clone(), Some(site)));
                }
                SpliceDecision::Trap { site, .. } => {
                    report.trap_points += 1;
                    points.push((site.addr, site.bytes.clone(), None));
                }
            }
        }
    }
    let stride = options.stride.max(1);
    let points: Vec<_> = points.into_iter().step_by(stride).collect();
    report.executed_points += points
        .iter()
        .filter(|(a, _, _)| profile.get(a).copied().unwrap_or(0) > 0)
        .count();

    // Splices, batched.
    let phase = Instant::now();
    let splice_sites: Vec<_> = points
        .iter()
        .filter_map(|(_, _, site)| site.clone())
        .collect();
    for chunk in splice_sites.chunks(batch) {
        let mut built = Vec::new();
        for (i, site) in chunk.iter().enumerate() {
            let patch_at = slots + 2 * i as u64 * PATCH_SLOT;
            let counter = counters + 8 * i as u64;
            let probes = [Probe::Count { counter }];
            match generate(&PatchRequest::for_site(site, patch_at, &probes)) {
                Ok(p) if p.code.len() as u64 <= PATCH_SLOT => built.push(Point {
                    addr: site.addr,
                    original: site.bytes.clone(),
                    site: Some(site.clone()),
                    splice: Some((p.code, p.splice)),
                    ool: None,
                }),
                Ok(p) => report
                    .build_errors
                    .push((site.addr, format!("patch of {} bytes", p.code.len()))),
                Err(e) => report.build_errors.push((site.addr, error_chain(&e))),
            }
        }
        check_batch(
            h,
            &reference,
            &profile,
            &built,
            ProbeKind::Splice,
            slots,
            counters,
            report,
            func_name,
        )?;
    }

    report.splice_time += phase.elapsed();
    let phase = Instant::now();
    // Traps, batched: the planner's trap points, and every splice point too if asked.
    let trap_points: Vec<_> = points
        .iter()
        .filter(|(_, _, site)| options.traps_everywhere || site.is_none())
        .collect();
    for chunk in trap_points.chunks(batch) {
        let mut built = Vec::new();
        for (i, (addr, bytes, _)) in chunk.iter().enumerate() {
            let at = slots + (2 * i as u64 + 1) * PATCH_SLOT;
            match out_of_line(bytes, *addr, at) {
                Ok(o) if o.code.len() as u64 <= PATCH_SLOT => built.push(Point {
                    addr: *addr,
                    original: bytes.clone(),
                    site: None,
                    splice: None,
                    ool: Some(o.code),
                }),
                Ok(o) => report
                    .build_errors
                    .push((*addr, format!("out-of-line copy of {} bytes", o.code.len()))),
                Err(e) => report.build_errors.push((*addr, error_chain(&e))),
            }
        }
        check_batch(
            h,
            &reference,
            &profile,
            &built,
            ProbeKind::Trap,
            slots,
            counters,
            report,
            func_name,
        )?;
    }
    report.trap_time += phase.elapsed();
    report.runs = h.runs;
    Ok(())
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// Instruments `points` together (slot i each), runs, compares; on a divergence,
/// re-runs each point alone to name the culprits.
#[allow(clippy::too_many_arguments)]
fn check_batch(
    h: &mut Harness,
    reference: &Outcome,
    profile: &HashMap<u64, u64>,
    points: &[Point],
    kind: ProbeKind,
    slots: u64,
    counters: u64,
    report: &mut Report,
    func_name: &dyn Fn(u64) -> String,
) -> Result<(), RegressError> {
    if points.is_empty() {
        return Ok(());
    }
    let failures = run_points(h, reference, profile, points, kind, slots, counters)?;
    // The counting sweep's kinds: a trap, else a counting splice.
    match kind {
        ProbeKind::Trap => report.traps_checked += points.len(),
        _ => report.splices_checked += points.len(),
    }
    let Some(batch_failure) = failures else {
        return Ok(());
    };
    if points.len() == 1 {
        report.divergences.push(Divergence {
            points: vec![points[0].addr],
            function: func_name(points[0].addr),
            kind,
            what: batch_failure,
        });
        return Ok(());
    }
    let mut named = false;
    for p in points {
        // Alone, in slot 0: rebuild so the patch matches the slot.
        let single = rebuild_in_slot0(p, kind, slots, counters);
        let single = match single {
            Ok(s) => s,
            Err(e) => {
                report.build_errors.push((p.addr, e));
                continue;
            }
        };
        if let Some(what) = run_points(h, reference, profile, &[single], kind, slots, counters)? {
            named = true;
            report.divergences.push(Divergence {
                points: vec![p.addr],
                function: func_name(p.addr),
                kind,
                what,
            });
        }
    }
    if !named {
        report.divergences.push(Divergence {
            points: points.iter().map(|p| p.addr).collect(),
            function: func_name(points[0].addr),
            kind,
            what: format!("only together: {batch_failure}"),
        });
    }
    Ok(())
}

fn rebuild_in_slot0(
    p: &Point,
    kind: ProbeKind,
    slots: u64,
    counters: u64,
) -> Result<Point, String> {
    let mut out = Point {
        addr: p.addr,
        original: p.original.clone(),
        site: p.site.clone(),
        splice: None,
        ool: None,
    };
    match kind {
        ProbeKind::Splice => {
            let site = p.site.as_ref().ok_or("a splice point without its site")?;
            let probes = [Probe::Count { counter: counters }];
            let patch = generate(&PatchRequest::for_site(site, slots, &probes))
                .map_err(|e| error_chain(&e))?;
            out.splice = Some((patch.code, patch.splice));
        }
        ProbeKind::Trap => {
            let o = out_of_line(&p.original, p.addr, slots + PATCH_SLOT)
                .map_err(|e| error_chain(&e))?;
            out.ool = Some(o.code);
        }
        other => return Err(format!("{other} is not a kind of the counting sweep")),
    }
    Ok(out)
}

/// One run with `points` instrumented in slots 0.. ; `Some(what)` on a divergence.
fn run_points(
    h: &mut Harness,
    reference: &Outcome,
    profile: &HashMap<u64, u64>,
    points: &[Point],
    kind: ProbeKind,
    slots: u64,
    counters: u64,
) -> Result<Option<String>, RegressError> {
    h.reset()?;
    let mut trampolines = HashMap::new();
    for (i, p) in points.iter().enumerate() {
        if let Some((code, splice)) = &p.splice {
            h.m.write(slots + 2 * i as u64 * PATCH_SLOT, code)?;
            h.m.write(p.addr, splice)?;
        }
        if let Some(code) = &p.ool {
            let at = slots + (2 * i as u64 + 1) * PATCH_SLOT;
            h.m.write(at, code)?;
            if h.in_emulator_traps {
                h.m.add_redirect(p.addr, at)?;
            } else {
                h.m.set_breakpoint(p.addr, true)?;
                trampolines.insert(p.addr, at);
            }
        }
    }
    let mut outcome = h.run(&trampolines);
    for p in points.iter().filter(|p| p.splice.is_some()) {
        h.m.write(p.addr, &p.original)?;
    }
    let redirected = h.m.take_redirects()?;
    if let Ok(o) = outcome.as_mut() {
        o.hits.extend(redirected);
    }
    for p in points {
        if p.ool.is_some() && !h.in_emulator_traps {
            h.m.set_breakpoint(p.addr, false)?;
        }
    }
    let mut outcome = match outcome.as_mut() {
        Ok(o) => o.clone(),
        Err(RegressError::Emulator(e)) => return Ok(Some(format!("emulator: {e}"))),
        Err(_) => return outcome.map(|_| None),
    };
    // Put the original bytes back under each splice before comparing the text.
    for p in points.iter().filter(|p| p.splice.is_some()) {
        outcome.unsplice(p.addr, &p.original);
    }
    if let Some(what) = compare(reference, &outcome) {
        return Ok(Some(what));
    }
    for (i, p) in points.iter().enumerate() {
        let expected = profile.get(&p.addr).copied().unwrap_or(0);
        let got = match kind {
            ProbeKind::Trap => outcome.hits.get(&p.addr).copied().unwrap_or(0),
            _ => {
                let mut b = [0u8; 8];
                h.m.read(counters + 8 * i as u64, &mut b)?;
                u64::from_le_bytes(b)
            }
        };
        if got != expected {
            return Ok(Some(format!(
                "probe at {:#x} counted {got}, the instruction ran {expected} times",
                p.addr
            )));
        }
    }
    Ok(None)
}
