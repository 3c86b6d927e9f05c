//! Splicing a live guest over QEMU's gdbstub: the splicer under `exotap count`, `nullify`,
//! `replace`, `time`, `trace`, `splice-report` and compiled scripts (DESIGN.md, key mechanism 2).
//!
//! With every vCPU stopped (gdbstub all-stop), exotap reads the guest's *live* kernel text
//! (boot-time alternatives, jump labels, static calls and the guest's ftrace have rewritten
//! it since the image was built), analyses all of it (CFG and liveness, so the planner sees
//! every branch target), plans each requested site (splice, trap or refuse, with the
//! reason), generates the patches into the patch heap, checks that every site still holds
//! the bytes it planned over (a site that changed under exotap is refused and named), and
//! writes the `jmp rel32`s in one batch. Removal, again with the guest stopped, writes back
//! the exact original bytes where exotap's `jmp` still is; a SHA-256 of every text page
//! touched, taken before the install and after the removal, shows the text is
//! byte-identical.
//!
//! The kernel rewrites some text itself at run time: jump labels (`__jump_table`) and
//! static calls (`.static_call_sites`, `.static_call.text`) are refused as self-patched;
//! exception- and bug-table instructions as address-keyed; `.entry.text` and
//! `.noinstr.text` as forbidden (they run before the kernel's page tables and state are
//! set up, or must not be instrumented). Alternatives are applied once at boot, before any
//! attach, so the live bytes already are their final form.
//!
//! The guest's ftrace (and kprobes on ftrace sites) also rewrites function entries: while a
//! tracer is on a function its entry holds `call <ftrace trampoline>` instead of the nop5.
//! A splice over that relocates the call as `push <entry+5>; jmp <trampoline>`, so ftrace
//! sees the return address it expects. The guest's ftrace refuses (with a WARN) to change an
//! entry that does not hold what it expects, so the order is: the guest enables its tracer,
//! exotap splices, exotap unsplices, the guest disables its tracer.
//!
//! Patch-heap layout: below [`REGION`] belongs to the trap probes ([`super::trap_script`]); from
//! [`REGION`] the data area (counters) and from [`CODE_OFFSET`] the patches, the trace rings and
//! the in-flight table.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use exotap_introspect::btf::Btf;
use exotap_introspect::heap::HeapPlacement;
use exotap_introspect::layout::TaskOffsets;
use exotap_introspect::x86::{
    ranges_from_starts, thunk_register, AnalysisConfig, CallEffect, CodeView, TextAnalysis,
};
use exotap_vmm::control::Machine;
use iced_x86::code_asm::{rax, CodeAssembler};
use iced_x86::Register;
use sha2::{Digest, Sha256};

use crate::rings::RingSet;
use crate::splice::{
    generate, plan, PatchHeap, PatchRequest, Probe, Refusal, Site, SpliceContext, SpliceDecision,
    TrapReason,
};

use super::attach::{self, Survey};
use super::guest_memory::BackendMemory;
use super::kernel_image::KernelImage;

/// Start of the splice engine's part of the patch heap (below: the trap probes of
/// [`super::trap_script`]).
pub const REGION: u64 = 0x10_0000;
/// Start of the patches (between [`REGION`] and this: counters).
pub const CODE_OFFSET: u64 = 0x20_0000;
/// The most bytes one patch may take (a timed function's trampoline, entry half and
/// relocated instruction take about 200, a traced one about 520 with the task's pid and name).
const MAX_PATCH: u64 = 768;
/// The most bytes one compiled-probe site may take (bodies, trampoline, relocation).
const MAX_COMPILED: u64 = 64 << 10;
/// Patch space reserved per site of a batch (a counting patch is 20 to 40 bytes).
const AVERAGE_PATCH: u64 = 64;
/// Text pages are hashed and compared in units of this size.
const PAGE: u64 = 4096;
/// Bytes per gdbstub read of the text (the client splits them into packets).
const READ_CHUNK: usize = 1 << 20;

// ---------------------------------------------------------------------------------------
// What the kernel image says about its text.
// ---------------------------------------------------------------------------------------

/// Facts from the image, slid to the running kernel.
#[derive(Debug, Default)]
pub struct KernelFacts {
    /// The text's range `[start, end)`.
    pub text: (u64, u64),
    /// Function start addresses (kallsyms `T`/`t` inside the text).
    pub starts: Vec<u64>,
    /// Ranges not to instrument.
    pub forbidden: Vec<Range<u64>>,
    /// Bytes the kernel rewrites at run time.
    pub self_patched: Vec<Range<u64>>,
    /// Instructions the kernel finds by address, sorted.
    pub address_keyed: Vec<u64>,
    /// Calls and returns the analysis must model specially.
    pub config: AnalysisConfig,
}

/// A table of fixed-size entries between two symbols of the image (link-time contents).
fn table<'i>(
    image: &'i KernelImage,
    start: &str,
    stop: &str,
    entry: usize,
) -> anyhow::Result<(u64, &'i [u8])> {
    let from = image.address(start)?;
    let to = image.address(stop)?;
    let len = usize::try_from(
        to.checked_sub(from)
            .context("table ends before it starts")?,
    )?;
    if len % entry != 0 {
        bail!("{start}..{stop} is {len} bytes, not a multiple of {entry}");
    }
    let bytes = image
        .vmlinux
        .read_at(from, len)
        .with_context(|| format!("cannot read {start}..{stop} from the image"))?;
    Ok((from, bytes))
}

/// The address a 32-bit self-relative field at `table_addr + offset` points to.
fn relative(table_addr: u64, bytes: &[u8], offset: usize) -> Option<u64> {
    let raw: [u8; 4] = bytes.get(offset..offset + 4)?.try_into().ok()?;
    let disp = i64::from(i32::from_le_bytes(raw));
    Some(
        table_addr
            .wrapping_add(offset as u64)
            .wrapping_add(disp as u64),
    )
}

impl KernelFacts {
    /// Reads the facts from the image and slides them.
    ///
    /// # Errors
    /// When a symbol or table the engine relies on is missing.
    pub fn from_image(image: &KernelImage, slide: u64) -> anyhow::Result<Self> {
        let (start, end) = image
            .vmlinux
            .text_range()
            .context("the image has no .text")?;
        let s = |a: u64| a.wrapping_add(slide);
        let mut facts = Self {
            text: (s(start), s(end)),
            ..Self::default()
        };
        let mut config = AnalysisConfig::new();
        for sym in image.symbols.iter() {
            if matches!(sym.kind, 'T' | 't' | 'W' | 'w') && sym.addr >= start && sym.addr < end {
                facts.starts.push(s(sym.addr));
            }
            if sym.name == "__fentry__" {
                config = config.with_call_effect(s(sym.addr), CallEffect::TRANSPARENT);
            }
            if sym.name == "__x86_return_thunk" {
                config = config.with_return_thunk(s(sym.addr));
            }
            if let Some(reg) = thunk_register(&sym.name) {
                config = config.with_call_effect(s(sym.addr), CallEffect::sysv_reading(reg));
            }
        }
        facts.config = config;
        for (from, to) in [
            ("__entry_text_start", "__entry_text_end"),
            ("__noinstr_text_start", "__noinstr_text_end"),
        ] {
            facts
                .forbidden
                .push(s(image.address(from)?)..s(image.address(to)?));
        }
        facts.self_patched.push(
            s(image.address("__static_call_text_start")?)
                ..s(image.address("__static_call_text_end")?),
        );
        // struct jump_entry { s32 code; s32 target; long key; }
        let (at, bytes) = table(image, "__start___jump_table", "__stop___jump_table", 16)?;
        for i in (0..bytes.len()).step_by(16) {
            if let Some(code) = relative(at, bytes, i) {
                facts.self_patched.push(s(code)..s(code) + 5);
            }
        }
        // struct static_call_site { s32 addr; s32 key; }
        let (at, bytes) = table(
            image,
            "__start_static_call_sites",
            "__stop_static_call_sites",
            8,
        )?;
        for i in (0..bytes.len()).step_by(8) {
            if let Some(site) = relative(at, bytes, i) {
                facts.self_patched.push(s(site)..s(site) + 5);
            }
        }
        // Sorted and disjoint, as the planner binary-searches them.
        facts.self_patched =
            crate::splice::disjoint_ranges(std::mem::take(&mut facts.self_patched));
        facts.forbidden = crate::splice::disjoint_ranges(std::mem::take(&mut facts.forbidden));
        // struct exception_table_entry { int insn, fixup, data; }
        let (at, bytes) = table(image, "__start___ex_table", "__stop___ex_table", 12)?;
        for i in (0..bytes.len()).step_by(12) {
            facts.address_keyed.extend(relative(at, bytes, i).map(s));
        }
        // struct bug_entry { s32 bug_addr_disp; s32 file_disp; u16 line; u16 flags; }
        let (at, bytes) = table(image, "__start___bug_table", "__stop___bug_table", 12)?;
        for i in (0..bytes.len()).step_by(12) {
            facts.address_keyed.extend(relative(at, bytes, i).map(s));
        }
        facts.address_keyed.sort_unstable();
        facts.address_keyed.dedup();
        Ok(facts)
    }
}

// ---------------------------------------------------------------------------------------
// The live text and its analysis.
// ---------------------------------------------------------------------------------------

/// The running kernel's text as read from the stopped guest, analysed.
pub struct LiveKernel {
    /// Facts from the image.
    pub facts: KernelFacts,
    /// Guest-physical address of the text's first byte (the text is contiguous).
    pub text_phys: u64,
    bytes: Vec<u8>,
    analysis: TextAnalysis,
    /// Time to read the text over the gdbstub.
    pub read_time: Duration,
    /// Time to analyse it.
    pub analysis_time: Duration,
}

impl std::fmt::Debug for LiveKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveKernel")
            .field("text", &self.facts.text)
            .field("functions", &self.analysis.functions().len())
            .finish_non_exhaustive()
    }
}

impl LiveKernel {
    /// Reads and analyses the live text of a stopped guest.
    ///
    /// # Errors
    /// When the image lacks a table, or the text cannot be read.
    pub fn read(
        machine: &mut dyn Machine,
        survey: &Survey,
        image: &KernelImage,
    ) -> anyhow::Result<Self> {
        let facts = KernelFacts::from_image(image, survey.kaslr.slide)?;
        let (start, end) = facts.text;
        let text_va = image.address("_text")?.wrapping_add(survey.kaslr.slide);
        let text_phys = survey.kaslr.text_phys + (start - text_va);
        // The image is mapped contiguously; check both ends through the page tables.
        for va in [start, end - 1] {
            let t = survey
                .space(&mut BackendMemory(&mut *machine))
                .translate(va)
                .with_context(|| format!("kernel text at {va:#x} is not mapped"))?;
            if t.phys != text_phys + (va - start) {
                bail!(
                    "kernel text at {va:#x} maps to {:#x}, not {:#x}: not contiguous",
                    t.phys,
                    text_phys + (va - start)
                );
            }
        }
        let started = Instant::now();
        let len = usize::try_from(end - start)?;
        let bytes = match machine.read_phys_bulk(text_phys, len) {
            Some(bytes) => bytes,
            None => {
                let mut bytes = vec![0u8; len];
                for (i, chunk) in bytes.chunks_mut(READ_CHUNK).enumerate() {
                    let at = text_phys + (i * READ_CHUNK) as u64;
                    machine
                        .read_phys(at, chunk)
                        .with_context(|| format!("cannot read the kernel text at {at:#x}"))?;
                }
                bytes
            }
        };
        let read_time = started.elapsed();
        let started = Instant::now();
        let view = CodeView::new(start, &bytes)?;
        let ranges = ranges_from_starts(&facts.starts, view.end());
        let analysis = TextAnalysis::analyze(view, &ranges, &facts.config);
        let analysis_time = started.elapsed();
        tracing::info!(
            "read {} KiB of live kernel text in {:.2} s ({:.1} MB/s), analysed {} functions in {:.2} s",
            bytes.len() >> 10,
            read_time.as_secs_f64(),
            bytes.len() as f64 / read_time.as_secs_f64().max(1e-9) / 1e6,
            analysis.functions().len(),
            analysis_time.as_secs_f64()
        );
        Ok(Self {
            facts,
            text_phys,
            bytes,
            analysis,
            read_time,
            analysis_time,
        })
    }

    /// The planner's context.
    pub fn context(&self) -> SpliceContext<'_> {
        SpliceContext {
            text: CodeView::new(self.facts.text.0, &self.bytes)
                .unwrap_or_else(|_| CodeView::new(0, &[]).unwrap_or_else(|_| unreachable!())),
            analysis: &self.analysis,
            forbidden: &self.facts.forbidden,
            self_patched: &self.facts.self_patched,
            address_keyed: &self.facts.address_keyed,
        }
    }

    /// Plans a splice at `addr` for a patch at `patch`.
    pub fn plan(&self, addr: u64, patch: u64) -> SpliceDecision {
        plan(&self.context(), addr, patch)
    }

    /// Guest-physical address of a text address.
    pub fn phys(&self, va: u64) -> Option<u64> {
        (va >= self.facts.text.0 && va < self.facts.text.1)
            .then(|| self.text_phys + (va - self.facts.text.0))
    }
}

/// A one-line reason for a plan that is not a splice.
pub fn why_not(decision: &SpliceDecision) -> Option<String> {
    match decision {
        SpliceDecision::Splice(_) => None,
        SpliceDecision::Trap {
            reason: TrapReason::ShortInstruction { len },
            ..
        } => Some(format!(
            "the instruction there is {len} bytes, shorter than a 5-byte jmp (needs a trap probe)"
        )),
        SpliceDecision::Refuse(r) => Some(r.to_string()),
    }
}

/// A short category name for a plan, for tallies.
pub fn category(decision: &SpliceDecision) -> String {
    match decision {
        SpliceDecision::Splice(_) => "splice".into(),
        SpliceDecision::Trap { .. } => "trap (short instruction)".into(),
        SpliceDecision::Refuse(Refusal::Unsupported { mnemonic, .. }) => {
            format!("refuse: unsupported {mnemonic:?}")
        }
        SpliceDecision::Refuse(r) => {
            let name = format!("{r:?}");
            format!("refuse: {}", name.split([' ', '{']).next().unwrap_or(""))
        }
    }
}

// ---------------------------------------------------------------------------------------
// Installing and removing.
// ---------------------------------------------------------------------------------------

/// What a splice does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Count calls, then run the function.
    Count,
    /// Count, then return at once with this value in rax.
    Nullify(u64),
    /// Count, then jump to this other function (which returns to the caller).
    Replace(u64),
    /// Time every call from entry to return (rdtsc pairs) into a log2 histogram.
    Time,
    /// Record every entry (first argument) and return (return value) with its TSC in the
    /// per-vCPU rings, under this function id.
    Trace(u32),
    /// Run compiled probe bodies ([`super::compiled`]): site number N of the [`SiteCode`] given
    /// to [`Splicer::install_compiled`].
    Compiled(u32),
    /// Jump straight to this address, with no patch of its own: the entry splice of a
    /// function translated into the JIT's code cache ([`super::jit`]), whose translation
    /// runs the spliced instruction.
    Enter(u64),
}

/// The code of compiled-probe sites, asked for by [`Splicer::install_compiled`].
pub trait SiteCode {
    /// Whether site `site` has return probes (then it gets a return trampoline).
    fn has_returns(&self, site: u32) -> bool;
    /// The entry half at `at`; with `returns` = (table of calls in flight, its miss
    /// counter, the trampoline) it also swaps the return address.
    ///
    /// # Errors
    /// When the code cannot be generated.
    fn entry(
        &mut self,
        site: u32,
        at: u64,
        returns: Option<(u64, u64, u64)>,
    ) -> anyhow::Result<Vec<u8>>;
    /// The return trampoline at `at`, over the table of calls in flight `table`.
    ///
    /// # Errors
    /// When the code cannot be generated.
    fn trampoline(&mut self, site: u32, at: u64, table: u64) -> anyhow::Result<Vec<u8>>;
}

/// One site asked for.
#[derive(Debug, Clone)]
pub struct Request {
    /// Name shown in output.
    pub name: String,
    /// Address of the instruction.
    pub addr: u64,
    /// What to do there.
    pub action: Action,
}

/// One splice in place.
#[derive(Debug, Clone)]
pub struct Installed {
    /// Name shown in output.
    pub name: String,
    /// The spliced instruction.
    pub addr: u64,
    /// Its original bytes (what removal writes back; only the first five change).
    pub original: Vec<u8>,
    /// The `jmp rel32` written there.
    pub splice: [u8; 5],
    /// The patch.
    pub patch: u64,
    /// The hit counter.
    pub counter: u64,
    /// For [`Action::Time`]: the histogram (64 log2 buckets of TSC cycles) and the return
    /// trampoline.
    pub timing: Option<(u64, u64)>,
}

/// A site that was not installed, and why.
#[derive(Debug, Clone)]
pub struct NotInstalled {
    /// Name shown in output.
    pub name: String,
    /// The address.
    pub addr: u64,
    /// Why.
    pub reason: String,
}

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
fn pages_of(sites: impl Iterator<Item = (u64, usize)>) -> BTreeSet<u64> {
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
fn snapshot(
    machine: &mut dyn Machine,
    kernel: &LiveKernel,
    pages: &BTreeSet<u64>,
) -> anyhow::Result<PageSnapshot> {
    let mut out = BTreeMap::new();
    let list: Vec<u64> = pages.iter().copied().collect();
    // Many pages: one bulk read of the span through the monitor, when QEMU is local.
    if let (Some(&first), Some(&last)) = (list.first(), list.last()) {
        let len = usize::try_from(last + PAGE - first)?;
        if list.len() >= 64 {
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
        while j < list.len() && list[j] == list[j - 1] + PAGE && j - i < 256 {
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

/// `jmp rel32` from `from` to `to`.
fn jmp_rel32(from: u64, to: u64) -> anyhow::Result<[u8; 5]> {
    let rel = i32::try_from(to.wrapping_sub(from.wrapping_add(5)) as i64)
        .with_context(|| format!("{to:#x} is out of rel32 reach of {from:#x}"))?;
    let mut out = [0xe9, 0, 0, 0, 0];
    out[1..].copy_from_slice(&rel.to_le_bytes());
    Ok(out)
}

/// A patch that counts and then returns `value` (nullify) or jumps to `other` (replace),
/// never running the spliced instruction.
fn diverting_patch(
    at: u64,
    counter: u64,
    action: Action,
    return_thunk: Option<u64>,
) -> anyhow::Result<Vec<u8>> {
    let mut a = CodeAssembler::new(64)?;
    // Flags are dead at a function entry (SysV: callers assume they are clobbered).
    let mut inc = iced_x86::Instruction::with1(
        iced_x86::Code::Inc_rm64,
        iced_x86::MemoryOperand::with_base_displ(Register::RIP, counter as i64),
    )?;
    inc.set_has_lock_prefix(true);
    a.add_instruction(inc)?;
    a.set_prefer_short_branch(false);
    match action {
        Action::Nullify(value) => {
            a.mov(rax, value)?;
            match return_thunk {
                Some(thunk) => a.jmp(thunk)?,
                None => a.ret()?,
            }
        }
        Action::Replace(other) => a.jmp(other)?,
        Action::Count
        | Action::Time
        | Action::Trace(_)
        | Action::Compiled(_)
        | Action::Enter(_) => {
            bail!("this patch relocates the original instruction")
        }
    }
    Ok(a.assemble(at)?)
}

// ---------------------------------------------------------------------------------------
// Entry/exit pairs inside the guest (`exotap time`).
//
// The entry patch claims a slot in a table of calls in flight, keyed by the address of the
// return-address slot on the stack (unique per call in flight: tasks have their own stacks,
// and nested calls sit deeper), stores the original return address and an rdtsc there, and
// swaps the return address for the function's return trampoline. The trampoline finds the
// slot again (the `ret` left rsp just above it), puts the original return address back
// where `ret` will pop it, adds the elapsed cycles to a log2 histogram, frees the slot and
// returns to the caller. A full table (more than INFLIGHT calls in flight) skips the timing
// of that call and counts a miss. Removal puts back every swapped return address still on
// a stack, as kretprobes do; the trampolines stay in the heap for calls in the middle of one.
// ---------------------------------------------------------------------------------------

// The table of calls in flight and its hash are the compiled probes' (one table layout for
// `time`, `trace` and compiled `.return` probes).
use crate::compile::site::{emit_swap, emit_unswap, INFLIGHT, PROBE_SLOTS, SLOT};
/// Histogram buckets (log2 of cycles).
pub const BUCKETS: usize = 64;

fn rip_mem(addr: u64) -> iced_x86::MemoryOperand {
    iced_x86::MemoryOperand::with_base_displ(Register::RIP, addr as i64)
}

/// Per-vCPU ring buffers of entry/exit records (`exotap trace`).
///
/// Each vCPU's ring is a 64-byte header (the `u64` head: records ever reserved, with
/// `lock xadd`) and `slots` records of [`TRACE_RECORD`] bytes: TSC at +0, value at +8 (the
/// first argument at entry, the return value at exit), function id at +16, kind at +20
/// (1 entry, 2 exit), stack slot at +24 (pairs an entry with its exit), the running task's
/// pid at +32 and its `comm` (16 bytes) at +40 (zero when the kernel's task offsets are
/// unknown), 8 bytes reserved. The TSC is stored last. The host drains the rings while the guest runs (every 250 ms for `exotap trace`, the
/// guest stopped for the read) and at removal ([`Splicer::drain_rings`]): it takes the records
/// from where it stopped last up to the first one whose TSC is still 0 (its writer has not
/// finished), then zeroes the records it took, so that a slot being rewritten reads as
/// unfinished. A burst of more than `slots` records between two drains overwrites the oldest
/// ones: those are counted as lost (overruns).
#[derive(Debug, Clone, Copy)]
pub struct Rings {
    /// The rings (crate::rings: the protocol `trace` shares with compiled probes).
    pub set: RingSet,
    /// The per-CPU offset of `cpu_number` (gs-relative).
    pub cpu_number: u64,
    /// Where the running task's pid and name are: the per-CPU offset of `current_task`, and
    /// `task_struct`'s pid and comm offsets.
    pub task: Option<(u64, TaskOffsets)>,
}

/// Bytes per trace record.
pub const TRACE_RECORD: u64 = 64;

/// Writes one record; r8 = TSC, `value` = the value, rsi = the stack slot. Clobbers rax,
/// rcx, rdx and the flags.
fn emit_record(
    a: &mut CodeAssembler,
    rings: &Rings,
    id: u32,
    kind: u32,
    value: iced_x86::code_asm::AsmRegister64,
) -> anyhow::Result<()> {
    use iced_x86::code_asm::{dword_ptr, qword_ptr, r8, rdx, rsi};
    let mut skip = a.create_label();
    rings.set.emit_reserve(a, rings.cpu_number, rdx, skip)?;
    a.mov(qword_ptr(rdx + 8), value)?;
    a.mov(dword_ptr(rdx + 16), id)?;
    a.mov(dword_ptr(rdx + 20), kind)?;
    a.mov(qword_ptr(rdx + 24), rsi)?;
    match rings.task {
        Some((current_task, task)) => {
            use iced_x86::code_asm::{ecx, rcx};
            let mut cur = iced_x86::Instruction::with2(
                iced_x86::Code::Mov_r64_rm64,
                Register::RAX,
                iced_x86::MemoryOperand::with_base_displ(Register::None, current_task as i64),
            )?;
            cur.set_segment_prefix(Register::GS);
            cur.set_memory_displ_size(4);
            a.add_instruction(cur)?;
            let pid = i32::try_from(task.pid)?;
            let comm = i32::try_from(task.comm)?;
            a.mov(ecx, dword_ptr(rax + pid))?;
            a.mov(dword_ptr(rdx + 32), ecx)?;
            a.mov(rcx, qword_ptr(rax + comm))?;
            a.mov(qword_ptr(rdx + 40), rcx)?;
            a.mov(rcx, qword_ptr(rax + comm + 8))?;
            a.mov(qword_ptr(rdx + 48), rcx)?;
        }
        None => {
            a.mov(dword_ptr(rdx + 32), 0)?;
            a.mov(qword_ptr(rdx + 40), 0)?;
            a.mov(qword_ptr(rdx + 48), 0)?;
        }
    }
    a.mov(qword_ptr(rdx), r8)?;
    a.set_label(&mut skip)?;
    a.nop()?;
    Ok(())
}

/// The entry half: claim a slot, save the return address and the TSC, swap in the
/// trampoline (and with `trace`, record the entry with the first argument). Preserves every
/// register and (function entry) needs no flags.
fn timing_entry(
    at: u64,
    table: u64,
    misses: u64,
    trampoline: u64,
    trace: Option<(&Rings, u32)>,
) -> anyhow::Result<Vec<u8>> {
    use iced_x86::code_asm::{qword_ptr, r8, rcx, rdi, rdx, rsi, rsp};
    let mut a = CodeAssembler::new(64)?;
    let mut done = a.create_label();
    a.push(rax)?;
    a.push(rcx)?;
    a.push(rdx)?;
    a.push(rsi)?;
    a.push(r8)?;
    a.lea(rsi, qword_ptr(rsp + 40))?;
    emit_swap(&mut a, table, misses, trampoline, done)?;
    if let Some((rings, id)) = trace {
        a.mov(r8, rax)?;
        emit_record(&mut a, rings, id, 1, rdi)?;
    }
    a.set_label(&mut done)?;
    a.pop(r8)?;
    a.pop(rsi)?;
    a.pop(rdx)?;
    a.pop(rcx)?;
    a.pop(rax)?;
    Ok(a.assemble(at)?)
}

/// The return trampoline of one timed (histogram) or traced (ring record) function.
fn timing_trampoline(
    at: u64,
    table: u64,
    histogram: u64,
    trace: Option<(&Rings, u32)>,
) -> anyhow::Result<Vec<u8>> {
    use iced_x86::code_asm::{qword_ptr, r8, r9, rcx, rdx, rsi, rsp};
    let mut a = CodeAssembler::new(64)?;
    a.lea(rsp, qword_ptr(rsp - 8))?; // the slot `ret` popped; no flags touched
    a.push(rax)?;
    a.push(rcx)?;
    a.push(rdx)?;
    a.push(rsi)?;
    a.push(r8)?;
    a.push(r9)?;
    a.pushfq()?;
    a.mov(r9, rax)?; // the return value
    a.lea(rsi, qword_ptr(rsp + 56))?;
    emit_unswap(&mut a, table)?;
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(r8, rax)?;
    a.sub(rax, qword_ptr(rcx + 16))?;
    a.mov(qword_ptr(rcx), 0)?;
    match trace {
        Some((rings, id)) => emit_record(&mut a, rings, id, 2, r9)?,
        None => {
            a.or(rax, 1)?;
            a.bsr(rdx, rax)?;
            a.add_instruction(iced_x86::Instruction::with2(
                iced_x86::Code::Lea_r64_m,
                Register::RCX,
                rip_mem(histogram),
            )?)?;
            a.lock().inc(qword_ptr(rcx + rdx * 8))?;
        }
    }
    a.popfq()?;
    a.pop(r9)?;
    a.pop(r8)?;
    a.pop(rsi)?;
    a.pop(rdx)?;
    a.pop(rcx)?;
    a.pop(rax)?;
    a.ret()?;
    Ok(a.assemble(at)?)
}

/// A splicing session on a stopped guest: heap, kernel, what is in place.
pub struct Splicer {
    /// The live kernel.
    pub kernel: LiveKernel,
    /// Where the patch heap is mapped in kernel space (its start).
    pub heap_va: u64,
    heap_phys: u64,
    heap_size: u64,
    /// The guest's RAM shared with exotap (set by the session): rings and counters are then
    /// read and zeroed through it while the guest runs. Code goes over the gdbstub unless
    /// no vCPU can have run it (`untouched_heap`).
    pub shared: Option<super::shared::SharedHeap>,
    data: PatchHeap,
    code: PatchHeap,
    return_thunk: Option<u64>,
    /// The table of timed calls in flight and its miss counter, once allocated.
    inflight: Option<(u64, u64)>,
    /// The kernel's page tables (to reach stacks).
    survey: Survey,
    /// Every return trampoline installed in this session.
    installed_timing: Vec<u64>,
    /// The trace rings, once allocated.
    pub rings: Option<Rings>,
    /// The per-CPU offset of `cpu_number`.
    cpu_number: Option<u64>,
    /// `task_struct`'s pid and comm offsets, for the task in trace records (set by the
    /// caller before the install: finding them parses the BTF).
    pub trace_task: Option<TaskOffsets>,
    /// Names of traced functions by id.
    pub trace_names: Vec<(u32, String)>,
    /// Per vCPU: records taken from its ring so far, and records lost to overruns.
    ring_taken: Vec<u64>,
    ring_lost: Vec<u64>,
    /// With shared RAM, the thread that drains the rings while the guest runs (started by
    /// the first streaming drain; [`super::drainer`]), and what it drained once stopped.
    drainer: Option<super::drainer::Drainer>,
    drained: Option<super::drainer::DrainState>,
    /// Records the stopped drainer had taken but not yet handed out.
    pending: Vec<(u32, TraceRecord)>,
    /// Splices in place.
    pub installed: Vec<Installed>,
    /// The touched pages as they were before the install.
    pub before: PageSnapshot,
    /// What a guardian or `exotap recover` needs to undo this session ([`super::recover`]).
    journal: super::recover::Journal,
    /// Whether no exotap had used the heap since the guest booted (its recovery journal's
    /// header was still all zero when this session mapped it): then no code ever ran in it
    /// before this session, which writes each code block once, so the blocks the batches
    /// allocate have no translated blocks in QEMU and go in through the shared RAM.
    untouched_heap: bool,
}

impl std::fmt::Debug for Splicer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Splicer")
            .field("heap_va", &self.heap_va)
            .field("installed", &self.installed.len())
            .finish_non_exhaustive()
    }
}

/// What an install did.
#[derive(Debug, Clone, Default)]
pub struct InstallReport {
    /// Sites refused (planner, patch generation, or changed under us).
    pub refused: Vec<NotInstalled>,
    /// Time to plan and generate.
    pub plan_time: Duration,
    /// Time to snapshot, check and write (the guest stopped).
    pub write_time: Duration,
    /// Of `write_time`: reading the touched text pages (the snapshot and check).
    pub snapshot_time: Duration,
    /// Of `write_time`: writing the heap (patch code, zeroed data, the recovery journal).
    pub heap_time: Duration,
    /// Of `write_time`: writing the jumps into the text.
    pub text_time: Duration,
    /// The text writes: spans written and their bytes (unchanged bytes between near
    /// changes included).
    pub text_spans: usize,
    /// See `text_spans`.
    pub text_bytes: usize,
    /// Compiled sites whose instruction takes no splice (shorter than a 5-byte `jmp`): their
    /// code is in the heap, entered from a breakpoint at the site. (site, where a vCPU
    /// stopped there goes on: the body, then the relocated instruction and a jump back.)
    pub entered: Vec<(u64, u64)>,
}

/// What a removal found.
#[derive(Debug, Clone, Default)]
pub struct RemoveReport {
    /// Hits per installed site, in install order.
    pub counts: Vec<(String, u64, u64)>,
    /// Sites exotap found changed by someone else (left alone).
    pub changed: Vec<NotInstalled>,
    /// Digest of the touched pages before the install.
    pub before: String,
    /// Digest after the removal.
    pub after: String,
    /// Pages that differ.
    pub differing: Vec<u64>,
    /// Number of pages compared.
    pub pages: usize,
    /// For timed functions: name and histogram (log2 buckets of TSC cycles).
    pub histograms: Vec<(String, Vec<u64>)>,
    /// Timed calls skipped because the table of calls in flight was full.
    pub timing_misses: u64,
    /// Timed calls in flight at removal whose return address was put back.
    pub returns_restored: usize,
    /// Trace records (cpu, record), oldest first per vCPU.
    pub records: Vec<(u32, TraceRecord)>,
    /// Records lost per vCPU (ring overruns).
    pub overruns: Vec<u64>,
}

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

/// The records `[from, to)` as (first slot, count) spans of a ring of `slots` records.
pub fn ring_spans(from: u64, to: u64, slots: u32) -> Vec<(u64, u64)> {
    ring_spans_of(from, to, slots)
}

/// Decodes consecutive trace records; stops at the first unfinished one (TSC 0, stored last
/// by its writer) unless `last`, which skips it. Returns the finished records and how many
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
        let tsc = word(0);
        if tsc == 0 && !last {
            break;
        }
        consumed += 1;
        if tsc != 0 {
            records.push(TraceRecord {
                tsc,
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

impl Splicer {
    /// Maps the patch heap (if not yet) and reads the live text; the guest must be stopped.
    ///
    /// # Errors
    /// When the heap cannot be mapped or the text read.
    pub fn new(
        machine: &mut dyn Machine,
        survey: &Survey,
        image: &KernelImage,
        heap: (u64, u64),
    ) -> anyhow::Result<Self> {
        // Read before the mapping writes its marker and the journal its header. A failed
        // read only means the slow path.
        let untouched_heap = {
            let mut header = vec![0u8; 4096];
            machine
                .read_phys(heap.0 + super::recover::JOURNAL, &mut header)
                .is_ok()
                && header.iter().all(|&b| b == 0)
        };
        // A hidden range too large for either side of the kernel image (see
        // exotap_introspect::heap): map as much of it as fits (splices need a few MiB).
        let mut size = heap.1;
        let plan = loop {
            match attach::map_patch_heap(machine, survey, HeapPlacement::Auto, heap.0, size) {
                Ok(plan) => break plan,
                Err(e) if size > 4 << 20 => {
                    tracing::debug!("patch heap of {} MiB: {e:#}; trying half", size >> 20);
                    size /= 2;
                }
                Err(e) => return Err(e),
            }
        };
        if plan.size <= CODE_OFFSET + MAX_PATCH {
            bail!(
                "the patch heap ({} bytes) is too small for splices",
                plan.size
            );
        }
        // A backend that maps guest memory (exotap's own VMM) reads and analyses the text
        // while the guest runs: seconds of analysis cost it no stop (a stopped KVM guest's
        // clock runs on, and its RCU reports a stall). Install checks every site's bytes
        // again with the guest stopped.
        let run_meanwhile = machine.reads_while_running() && machine.is_paused();
        if run_meanwhile {
            machine.resume()?;
        }
        let kernel = LiveKernel::read(machine, survey, image);
        if run_meanwhile {
            machine.pause()?;
        }
        let kernel = kernel?;
        let return_thunk = image
            .symbols
            .get("__x86_return_thunk")
            .map(|s| s.addr.wrapping_add(survey.kaslr.slide));
        Ok(Self {
            kernel,
            heap_va: plan.va,
            heap_phys: plan.phys,
            heap_size: plan.size,
            shared: None,
            data: PatchHeap::new(plan.va + REGION, plan.va + CODE_OFFSET)?,
            code: PatchHeap::new(plan.va + CODE_OFFSET, plan.va + plan.size)?,
            return_thunk,
            inflight: None,
            survey: survey.clone(),
            installed_timing: Vec::new(),
            rings: None,
            // A per-CPU symbol: an offset from the GS base, not slid.
            cpu_number: image.symbols.get("cpu_number").map(|s| s.addr),
            trace_task: None,
            trace_names: Vec::new(),
            ring_taken: Vec::new(),
            ring_lost: Vec::new(),
            drainer: None,
            drained: None,
            pending: Vec::new(),
            installed: Vec::new(),
            before: PageSnapshot::default(),
            journal: super::recover::Journal {
                heap_phys: plan.phys,
            },
            untouched_heap: untouched_heap && plan.phys == heap.0,
        })
    }

    /// The mapped patch heap: kernel virtual address, guest-physical address, size.
    pub fn heap_range(&self) -> (u64, u64, u64) {
        (self.heap_va, self.heap_phys, self.heap_size)
    }

    fn heap_phys(&self, va: u64) -> u64 {
        self.heap_phys + (va - self.heap_va)
    }

    /// The part of the patch heap below [`REGION`], which the host-evaluated probes of a
    /// mixed script use ([`super::traps`]).
    pub fn trap_area(&self) -> super::traps::TrapArea {
        super::traps::TrapArea {
            va: self.heap_va,
            phys: self.heap_phys,
            size: REGION,
        }
    }

    /// Plans, generates and installs `requests` in one batch (the guest stopped).
    ///
    /// # Errors
    /// When guest memory cannot be written (sites already written stay listed in
    /// `installed`, so removal puts them back).
    pub fn install(
        &mut self,
        machine: &mut dyn Machine,
        requests: &[Request],
    ) -> anyhow::Result<InstallReport> {
        self.install_with(machine, requests, None)
    }

    /// As [`Splicer::install`], for requests with [`Action::Compiled`] sites whose code
    /// `code` generates.
    ///
    /// # Errors
    /// As [`Splicer::install`].
    pub fn install_compiled(
        &mut self,
        machine: &mut dyn Machine,
        requests: &[Request],
        code: &mut dyn SiteCode,
    ) -> anyhow::Result<InstallReport> {
        self.install_with(machine, requests, Some(code))
    }

    /// The guest's vCPUs (per-CPU areas).
    pub fn cpus(&self) -> usize {
        self.survey.layout.per_cpu_offsets.len().max(1)
    }

    /// Heap memory for a compiled script's data and helpers (from the patch area).
    ///
    /// # Errors
    /// When the heap is full.
    pub fn alloc(&mut self, size: u64, align: u64) -> anyhow::Result<u64> {
        Ok(self.code.alloc(size.max(1), align)?)
    }

    /// Writes `bytes` at heap address `va` (the guest stopped).
    ///
    /// # Errors
    /// When guest memory cannot be written.
    pub fn write_heap(
        &self,
        machine: &mut dyn Machine,
        va: u64,
        bytes: &[u8],
    ) -> anyhow::Result<()> {
        Ok(machine.write_phys(self.heap_phys(va), bytes)?)
    }

    /// Reads `len` bytes at heap address `va` (the guest stopped).
    ///
    /// # Errors
    /// When guest memory cannot be read.
    pub fn read_heap(
        &self,
        machine: &mut dyn Machine,
        va: u64,
        len: usize,
    ) -> anyhow::Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        machine.read_phys(self.heap_phys(va), &mut buf)?;
        Ok(buf)
    }

    fn install_with(
        &mut self,
        machine: &mut dyn Machine,
        requests: &[Request],
        mut compiled: Option<&mut dyn SiteCode>,
    ) -> anyhow::Result<InstallReport> {
        let started = Instant::now();
        let mut report = InstallReport::default();
        // One block of counters and one of code for the whole batch, each written to the
        // guest with one write.
        let n = u64::try_from(requests.len())?.max(1);
        let data_block = self.data.alloc(8 * n, 64)?;
        let block_size = requests
            .iter()
            .map(|r| match r.action {
                Action::Time | Action::Trace(_) => MAX_PATCH,
                Action::Compiled(_) => MAX_COMPILED,
                _ => AVERAGE_PATCH,
            })
            .sum::<u64>()
            .max(MAX_PATCH);
        let code_block = match self.code.alloc(block_size, 16) {
            Ok(block) => block,
            Err(e) => {
                let _ = self.data.free(data_block);
                return Err(e.into());
            }
        };
        let mut code_buf: Vec<u8> = Vec::new();
        // Histograms and the table of calls in flight, zeroed before the jumps go in.
        let mut zero: Vec<(u64, u64)> = Vec::new();
        let returns = |k: u32| compiled.as_ref().is_some_and(|c| c.has_returns(k));
        let paired = |a: Action| match a {
            Action::Time | Action::Trace(_) => true,
            Action::Compiled(k) => returns(k),
            _ => false,
        };
        if self.rings.is_none()
            && requests
                .iter()
                .any(|r| matches!(r.action, Action::Trace(_)))
        {
            let cpu_number = self
                .cpu_number
                .context("the kernel has no cpu_number per-CPU variable")?;
            let cpus = u32::try_from(self.survey.layout.per_cpu_offsets.len().max(1))?;
            // 512 KiB of records in all; 32 MiB when the host reads them while the guest runs
            // (zeroed through the shared RAM, or the VMM's own mapping of guest memory, not the
            // gdbstub): with 2 vCPUs a ring then holds 262,144 records, about 120 ms of the
            // fastest traced syscall loop under TCG, while the drainer thread polls every 1 to
            // 10 ms (live::drainer, by the rate it sees; the VMM's reads every 10 ms). (Nested KVM measured:
            // 512 KiB lost 35,904 of 40,000 records of a 20,000-call getpid loop on the VMM
            // between two 250-ms drains.)
            let all: u64 = if self.shared.is_some() || machine.reads_while_running() {
                32 << 20
            } else {
                512 << 10
            };
            let slots = (all / TRACE_RECORD / u64::from(cpus)).clamp(64, 1 << 19);
            let slots = 1u32 << (63 - slots.leading_zeros());
            let mut rings = Rings {
                set: RingSet {
                    base: 0,
                    cpus,
                    slots,
                    record: TRACE_RECORD,
                },
                cpu_number,
                task: self
                    .trace_task
                    .map(|t| (self.survey.layout.current_task_offset, t)),
            };
            let bytes = rings.set.bytes();
            // The rings and the in-flight table are large (rings grow with the vCPUs, the
            // table's slots keep six argument registers: 513 KiB): they come from the 62 MiB
            // above CODE_OFFSET, which every patch reaches just as well, not from the 1 MiB
            // counter region.
            rings.set.base = self.code.alloc(bytes, 64)?;
            zero.push((rings.set.base, bytes));
            self.rings = Some(rings);
            self.ring_taken = vec![0; cpus as usize];
            self.ring_lost = vec![0; cpus as usize];
        }
        let mut new_table = None;
        if self.inflight.is_none() && requests.iter().any(|r| paired(r.action)) {
            let bytes = (INFLIGHT + u64::from(PROBE_SLOTS)) * SLOT;
            let table = self.code.alloc(bytes, 64)?;
            let misses = self.data.alloc(8, 8)?;
            zero.push((table, bytes));
            zero.push((misses, 8));
            self.inflight = Some((table, misses));
            new_table = Some((table, bytes));
        }
        // (request, site bytes, splice, patch, counter, timing)
        #[allow(clippy::type_complexity)]
        let mut ready: Vec<(usize, Vec<u8>, [u8; 5], u64, u64, Option<(u64, u64)>)> = Vec::new();
        let mut seen = BTreeSet::new();
        for (i, req) in requests.iter().enumerate() {
            let refuse = |reason: String| NotInstalled {
                name: req.name.clone(),
                addr: req.addr,
                reason,
            };
            if !seen.insert(req.addr) || self.installed.iter().any(|s| s.addr == req.addr) {
                report
                    .refused
                    .push(refuse("another splice is already at this address".into()));
                continue;
            }
            let patch = code_block + code_buf.len() as u64;
            let counter = data_block + 8 * i as u64;
            // A compiled site the planner would trap is still generated: a breakpoint enters
            // its code, with no text written.
            let (site, by_breakpoint): (Site, bool) = match self.kernel.plan(req.addr, patch) {
                SpliceDecision::Splice(site) => (site, false),
                SpliceDecision::Trap { site, .. } if matches!(req.action, Action::Compiled(_)) => {
                    (site, true)
                }
                other => {
                    report
                        .refused
                        .push(refuse(why_not(&other).unwrap_or_default()));
                    continue;
                }
            };
            let mut timing = None;
            let mut entry_of = None;
            let built = match req.action {
                Action::Time | Action::Trace(_) => {
                    let (table, misses) = self.inflight.unwrap_or_default();
                    let trace = match (req.action, &self.rings) {
                        (Action::Trace(id), Some(rings)) => Some((rings, id)),
                        _ => None,
                    };
                    let hist = if trace.is_none() {
                        let hist = self.data.alloc(BUCKETS as u64 * 8, 64)?;
                        zero.push((hist, BUCKETS as u64 * 8));
                        hist
                    } else {
                        0
                    };
                    timing = Some((hist, patch));
                    (|| -> anyhow::Result<(Vec<u8>, [u8; 5])> {
                        let mut code = timing_trampoline(patch, table, hist, trace)?;
                        code.resize(code.len().div_ceil(16) * 16, 0xcc);
                        let entry_at = patch + code.len() as u64;
                        let entry = timing_entry(entry_at, table, misses, patch, trace)?;
                        let reloc_at = entry_at + entry.len() as u64;
                        let moved = generate(&PatchRequest {
                            original: &site.bytes,
                            addr: site.addr,
                            patch: reloc_at,
                            probes: &[],
                            live: site.live,
                            call_return: crate::splice::CallReturn::default(),
                        })?;
                        code.extend_from_slice(&entry);
                        code.extend_from_slice(&moved.code);
                        Ok((code, jmp_rel32(req.addr, entry_at)?))
                    })()
                    .map_err(|e| format!("{e:#}"))
                }
                Action::Compiled(k) => {
                    let (table, misses) = self.inflight.unwrap_or_default();
                    let Some(gen) = compiled.as_deref_mut() else {
                        bail!("a compiled site without its code");
                    };
                    (|| -> anyhow::Result<(Vec<u8>, [u8; 5])> {
                        let mut code = Vec::new();
                        let mut ret = None;
                        if by_breakpoint && gen.has_returns(k) {
                            bail!("a return probe whose entry instruction takes no splice");
                        }
                        if gen.has_returns(k) {
                            code = gen.trampoline(k, patch, table)?;
                            code.resize(code.len().div_ceil(16) * 16, 0xcc);
                            ret = Some((table, misses, patch));
                            timing = Some((0, patch));
                        }
                        let entry_at = patch + code.len() as u64;
                        entry_of = Some(entry_at);
                        let entry = gen.entry(k, entry_at, ret)?;
                        let moved_at = entry_at + entry.len() as u64;
                        let moved = if by_breakpoint {
                            // Any length: nothing is written over it.
                            crate::splice::out_of_line(&site.bytes, site.addr, moved_at)?.code
                        } else {
                            generate(&PatchRequest {
                                original: &site.bytes,
                                addr: site.addr,
                                patch: moved_at,
                                probes: &[],
                                live: site.live,
                                call_return: crate::splice::CallReturn::default(),
                            })?
                            .code
                        };
                        code.extend_from_slice(&entry);
                        code.extend_from_slice(&moved);
                        Ok((code, jmp_rel32(req.addr, entry_at)?))
                    })()
                    .map_err(|e| format!("{e:#}"))
                }
                Action::Enter(to) => jmp_rel32(req.addr, to)
                    .map(|splice| (Vec::new(), splice))
                    .map_err(|e| format!("{e:#}")),
                Action::Count => {
                    let probes = [Probe::Count { counter }];
                    generate(&PatchRequest::for_site(&site, patch, &probes))
                        .map(|p| (p.code, p.splice))
                        .map_err(|e| format!("{e:#}"))
                }
                action => diverting_patch(patch, counter, action, self.return_thunk)
                    .and_then(|code| Ok((code, jmp_rel32(req.addr, patch)?)))
                    .map_err(|e| format!("{e:#}")),
            };
            match built {
                Ok((code, _)) if code_buf.len() as u64 + code.len() as u64 > block_size => {
                    report.refused.push(refuse(format!(
                        "the batch's {block_size} bytes of patch space are used up"
                    )));
                }
                Ok((code, splice))
                    if code.len() as u64 <= MAX_PATCH
                        || (matches!(req.action, Action::Compiled(_))
                            && code.len() as u64 <= MAX_COMPILED) =>
                {
                    code_buf.extend_from_slice(&code);
                    code_buf.resize(code_buf.len().div_ceil(16) * 16, 0xcc);
                    match entry_of.filter(|_| by_breakpoint) {
                        Some(entry) => report.entered.push((req.addr, entry)),
                        None => ready.push((i, site.bytes.clone(), splice, patch, counter, timing)),
                    }
                }
                Ok((code, _)) => report.refused.push(refuse(format!(
                    "the patch is {} bytes, too big",
                    code.len()
                ))),
                Err(e) => report
                    .refused
                    .push(refuse(format!("no patch can be generated: {e}"))),
            }
        }
        if code_buf.is_empty() {
            let _ = self.code.free(code_block);
        } else {
            self.code.shrink(code_block, code_buf.len() as u64)?;
        }
        report.plan_time = started.elapsed();
        let started = Instant::now();
        // Snapshot the pages about to change (also the "before" of the text hash), and
        // check every site still holds what was planned over.
        let pages = pages_of(ready.iter().map(|r| (requests[r.0].addr, r.1.len())));
        let now = snapshot(machine, &self.kernel, &pages)?;
        tracing::debug!(
            "{} pages read in {:.3} s",
            pages.len(),
            started.elapsed().as_secs_f64()
        );
        report.snapshot_time = started.elapsed();
        let planned: Vec<(u64, Vec<u8>)> = ready
            .iter()
            .map(|r| (requests[r.0].addr, r.1.clone()))
            .collect();
        let changed = changed_sites(&planned, &now);
        let changed_idx: BTreeSet<usize> = changed.iter().map(|c| c.0).collect();
        for (k, seen_now) in &changed {
            let req = &requests[ready[*k].0];
            report.refused.push(NotInstalled {
                name: req.name.clone(),
                addr: req.addr,
                reason: format!(
                    "the site changed under exotap: planned over {}, now holds {}",
                    hex(&ready[*k].1),
                    hex(seen_now)
                ),
            });
        }
        // Counters (zeroed) and patches first, then the jumps, page by page.
        match &self.shared {
            Some(shared) => shared.write_heap(data_block, &vec![0u8; 8 * n as usize])?,
            None => machine.write_phys(self.heap_phys(data_block), &vec![0u8; 8 * n as usize])?,
        }
        for (at, len) in zero {
            let zeros = vec![0u8; usize::try_from(len)?];
            match &self.shared {
                // Data, never executed: the shared RAM is fine (and fast for big rings).
                Some(shared) => shared.write_heap(at, &zeros)?,
                None => machine.write_phys(self.heap_phys(at), &zeros)?,
            }
        }
        if !code_buf.is_empty() {
            match &self.shared {
                // Never run (a fresh block of a heap no earlier session used): nothing for
                // QEMU to invalidate.
                Some(shared) if self.untouched_heap => {
                    shared.write_unexecuted_code(code_block, &code_buf)?;
                }
                // Code that may have run before: over the gdbstub, which invalidates QEMU's
                // translated blocks of these addresses (a write into the shared RAM would
                // not: see exotap_vmm::shared_ram).
                _ => machine.write_phys(self.heap_phys(code_block), &code_buf)?,
            }
        }
        tracing::debug!(
            "{} bytes of patches written at {:.3} s",
            code_buf.len(),
            started.elapsed().as_secs_f64()
        );
        let keep: Vec<_> = ready
            .into_iter()
            .enumerate()
            .filter(|(k, _)| !changed_idx.contains(k))
            .map(|(_, r)| r)
            .collect();
        let writes: Vec<(u64, Vec<u8>)> = keep
            .iter()
            .map(|r| (requests[r.0].addr, r.2.to_vec()))
            .collect();
        // The recovery journal before the guest changes ([`super::recover`]): heap data,
        // through the shared RAM when there is one.
        let shared = self.shared.clone();
        let mut data_path;
        let journal_machine: &mut dyn Machine = match &shared {
            Some(shared) => {
                data_path = super::shared::HeapDataPath {
                    machine: &mut *machine,
                    shared,
                };
                &mut data_path
            }
            None => &mut *machine,
        };
        if let Some((table, bytes)) = new_table {
            self.journal
                .record_table(journal_machine, self.heap_phys(table), bytes)?;
        }
        if !keep.is_empty() {
            let block = self
                .code
                .alloc((keep.len() * super::recover::TEXT_ENTRY) as u64, 32)?;
            let phys: Vec<u64> = keep
                .iter()
                .map(|r| {
                    let addr = requests[r.0].addr;
                    self.kernel
                        .phys(addr)
                        .with_context(|| format!("{addr:#x} is not kernel text"))
                })
                .collect::<anyhow::Result<_>>()?;
            let entries: Vec<(u64, &[u8], &[u8])> = keep
                .iter()
                .zip(&phys)
                .map(|(r, &p)| (p, &r.1[..5], &r.2[..]))
                .collect();
            self.journal
                .record_text(journal_machine, self.heap_phys(block), &entries)?;
        }
        tracing::debug!(
            "journal written at {:.3} s",
            started.elapsed().as_secs_f64()
        );
        report.heap_time = started.elapsed() - report.snapshot_time;
        let text_started = Instant::now();
        (report.text_spans, report.text_bytes) = self.write_text(machine, &now, &writes)?;
        report.text_time = text_started.elapsed();
        tracing::debug!("text written at {:.3} s", started.elapsed().as_secs_f64());
        for (addr, bytes) in now.0 {
            self.before.0.entry(addr).or_insert(bytes);
        }
        for r in keep {
            let req = &requests[r.0];
            self.installed.push(Installed {
                name: req.name.clone(),
                addr: req.addr,
                original: r.1,
                splice: r.2,
                patch: r.3,
                counter: r.4,
                timing: r.5,
            });
            if let Some((_, trampoline)) = r.5.filter(|t| t.1 != 0) {
                self.installed_timing.push(trampoline);
            }
            if let Action::Trace(id) = req.action {
                self.trace_names.push((id, req.name.clone()));
            }
        }
        report.write_time = started.elapsed();
        Ok(report)
    }

    /// Writes `writes` into the text: each page's changed span at once. Returns the spans
    /// written and their bytes.
    fn write_text(
        &self,
        machine: &mut dyn Machine,
        now: &PageSnapshot,
        writes: &[(u64, Vec<u8>)],
    ) -> anyhow::Result<(usize, usize)> {
        let spans = page_spans(now, writes)?;
        tracing::debug!(
            "{} text writes: {} spans, {} bytes",
            writes.len(),
            spans.len(),
            spans.iter().map(|s| s.1.len()).sum::<usize>()
        );
        // Text always over the gdbstub: QEMU then drops its translated blocks of these bytes
        // (a write into the shared RAM would leave the vCPUs running the old instructions).
        // All spans in one pipelined batch: no round trip per span.
        let phys: Vec<(u64, &[u8])> = spans
            .iter()
            .map(|(addr, bytes)| {
                self.kernel
                    .phys(*addr)
                    .map(|p| (p, &bytes[..]))
                    .with_context(|| format!("{addr:#x} is not kernel text"))
            })
            .collect::<anyhow::Result<_>>()?;
        machine.write_phys_batch(&phys)?;
        Ok((spans.len(), spans.iter().map(|s| s.1.len()).sum()))
    }

    /// Takes the trace records written since the last drain, oldest first per vCPU (the
    /// guest stopped). A record still being written (TSC 0) ends the take for its vCPU until
    /// the next drain; with `last` (at removal) it is skipped instead. The records taken are
    /// zeroed in the guest unless `last`.
    ///
    /// # Errors
    /// When the rings cannot be read or written.
    pub fn drain_rings(
        &mut self,
        machine: &mut dyn Machine,
        last: bool,
    ) -> anyhow::Result<Vec<(u32, TraceRecord)>> {
        let Some(Rings { set: rings, .. }) = self.rings else {
            return Ok(Vec::new());
        };
        if let Some(shared) = &self.shared {
            let shared = shared.clone();
            if last {
                self.stop_drainer();
                let mut out = std::mem::take(&mut self.pending);
                out.extend(self.drain_shared(&shared, rings, true)?);
                return Ok(out);
            }
            return self.drain_by_thread(shared, rings);
        }
        // Read every ring first: a failed read changes nothing, and removal finds it all.
        let mut taken = Vec::new();
        for cpu in 0..rings.cpus {
            let at = rings.ring(cpu);
            let mut head = [0u8; 8];
            machine.read_phys(self.heap_phys(at), &mut head)?;
            let head = u64::from_le_bytes(head);
            let before = self.ring_taken.get(cpu as usize).copied().unwrap_or(0);
            let (from, lost) = ring_window(head, before, rings.slots);
            let mut bytes = Vec::new();
            for (slot, n) in ring_spans(from, head, rings.slots) {
                let mut buf = vec![0u8; usize::try_from(n * TRACE_RECORD)?];
                let va = rings.slot(cpu, slot);
                machine.read_phys(self.heap_phys(va), &mut buf)?;
                bytes.extend_from_slice(&buf);
            }
            let (records, count) = take_records(&bytes, last);
            taken.push((cpu, from, count, lost, records));
        }
        let mut out = Vec::new();
        for (cpu, from, count, lost, records) in taken {
            if !last {
                for (slot, n) in ring_spans(from, from + count, rings.slots) {
                    let zeros = vec![0u8; usize::try_from(n * TRACE_RECORD)?];
                    let va = rings.slot(cpu, slot);
                    machine.write_phys(self.heap_phys(va), &zeros)?;
                }
            }
            let i = cpu as usize;
            if let (Some(t), Some(l)) = (self.ring_taken.get_mut(i), self.ring_lost.get_mut(i)) {
                *t = from + count;
                *l += lost;
            }
            out.extend(records.into_iter().map(|r| (cpu, r)));
        }
        Ok(out)
    }

    /// [`Splicer::drain_rings`] through the shared RAM while the guest runs: the records
    /// the drainer thread took since the last call (starting it on the first call).
    fn drain_by_thread(
        &mut self,
        shared: super::shared::SharedHeap,
        rings: RingSet,
    ) -> anyhow::Result<Vec<(u32, TraceRecord)>> {
        if self.drainer.is_none() && self.drained.is_none() {
            let state = super::drainer::DrainState {
                taken: self.ring_taken.clone(),
                lost: self.ring_lost.clone(),
                ..Default::default()
            };
            self.drainer = Some(super::drainer::Drainer::start(shared, rings, state)?);
        }
        let Some(drainer) = &self.drainer else {
            return Ok(std::mem::take(&mut self.pending));
        };
        let ended = drainer.ended();
        let mut out = std::mem::take(&mut self.pending);
        for batch in drainer.try_batches() {
            let (records, _) = take_records(&batch.records, true);
            out.extend(records.into_iter().map(|r| (batch.cpu, r)));
        }
        if ended {
            self.stop_drainer();
            out.append(&mut self.pending);
            if let Some(e) = self.drained.as_ref().and_then(|d| d.error.clone()) {
                self.pending = out;
                anyhow::bail!("the ring drainer stopped: {e}");
            }
        }
        Ok(out)
    }

    /// Stops the drainer thread (if one runs): its readers' positions and counts come back
    /// here, the records it had not handed out wait for the next drain, and what it drained
    /// is kept for [`Splicer::drain_statistics`]. Streaming drains after it return only
    /// those records.
    pub fn stop_drainer(&mut self) {
        let Some(drainer) = self.drainer.take() else {
            return;
        };
        let (batches, state) = drainer.stop();
        for batch in batches {
            let (records, _) = take_records(&batch.records, true);
            self.pending
                .extend(records.into_iter().map(|r| (batch.cpu, r)));
        }
        for (i, (&t, &l)) in state.taken.iter().zip(&state.lost).enumerate() {
            if let (Some(taken), Some(lost)) =
                (self.ring_taken.get_mut(i), self.ring_lost.get_mut(i))
            {
                *taken = t;
                *lost = l;
            }
        }
        self.drained = Some(state);
    }

    /// What the drainer thread did, once stopped ([`Splicer::stop_drainer`]).
    pub fn drain_statistics(&self) -> Option<&super::drainer::DrainState> {
        self.drained.as_ref()
    }

    /// [`Splicer::drain_rings`] through the shared RAM, the vCPUs running
    /// ([`crate::rings::drain_concurrent`]).
    fn drain_shared(
        &mut self,
        shared: &super::shared::SharedHeap,
        rings: RingSet,
        last: bool,
    ) -> anyhow::Result<Vec<(u32, TraceRecord)>> {
        let mut out = Vec::new();
        for cpu in 0..rings.cpus {
            let i = cpu as usize;
            let (Some(taken), Some(lost)) = (self.ring_taken.get_mut(i), self.ring_lost.get_mut(i))
            else {
                continue;
            };
            let got = crate::rings::drain_concurrent(shared, &rings, cpu, taken, last)?;
            *lost += got.lost;
            let (records, _) = take_records(&got.records, true);
            out.extend(records.into_iter().map(|r| (cpu, r)));
        }
        Ok(out)
    }

    /// Records lost to ring overruns so far, per vCPU.
    pub fn ring_losses(&self) -> &[u64] {
        &self.ring_lost
    }

    /// Reads every counter (the guest stopped, or running when the RAM is shared).
    ///
    /// # Errors
    /// When the heap cannot be read.
    pub fn counts(&self, machine: &mut dyn Machine) -> anyhow::Result<Vec<(String, u64, u64)>> {
        if self.installed.is_empty() {
            return Ok(Vec::new());
        }
        let lo = self.installed.iter().map(|s| s.counter).min().unwrap_or(0);
        let hi = self.installed.iter().map(|s| s.counter).max().unwrap_or(0) + 8;
        let buf = match &self.shared {
            Some(shared) => shared.read_heap(lo, usize::try_from(hi - lo)?)?,
            None => {
                let mut buf = vec![0u8; usize::try_from(hi - lo)?];
                machine.read_phys(self.heap_phys(lo), &mut buf)?;
                buf
            }
        };
        Ok(self
            .installed
            .iter()
            .map(|s| {
                let o = (s.counter - lo) as usize;
                let raw: [u8; 8] = buf[o..o + 8].try_into().unwrap_or_default();
                (s.name.clone(), s.addr, u64::from_le_bytes(raw))
            })
            .collect())
    }

    /// Reads the counters, writes back every original instruction where exotap's `jmp` still
    /// is, and compares the touched pages with their state before the install (the guest
    /// stopped).
    ///
    /// # Errors
    /// When guest memory cannot be read or written.
    pub fn remove(&mut self, machine: &mut dyn Machine) -> anyhow::Result<RemoveReport> {
        let counts = self.counts(machine)?;
        let mut report = RemoveReport {
            // Timed and traced sites have no counter.
            counts: counts
                .into_iter()
                .zip(&self.installed)
                .filter(|(_, s)| s.timing.is_none())
                .map(|(c, _)| c)
                .collect(),
            ..RemoveReport::default()
        };
        for s in &self.installed {
            if let Some((hist, _)) = s.timing.filter(|t| t.0 != 0) {
                let mut buf = vec![0u8; BUCKETS * 8];
                machine.read_phys(self.heap_phys(hist), &mut buf)?;
                let buckets = buf
                    .chunks(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect();
                report.histograms.push((s.name.clone(), buckets));
            }
        }
        if self.rings.is_some() {
            report.records = self.drain_rings(machine, true)?;
            report.overruns.clone_from(&self.ring_lost);
        }
        let pages = pages_of(self.installed.iter().map(|s| (s.addr, s.original.len())));
        let now = snapshot(machine, &self.kernel, &pages)?;
        let mut writes = Vec::new();
        for s in std::mem::take(&mut self.installed) {
            let seen = now.bytes(s.addr, 5).unwrap_or_default();
            if seen == s.splice {
                writes.push((s.addr, s.original[..5].to_vec()));
            } else if seen != s.original[..5] {
                report.changed.push(NotInstalled {
                    name: s.name,
                    addr: s.addr,
                    reason: format!(
                        "someone else changed the site: exotap wrote {}, it holds {}; left alone",
                        hex(&s.splice),
                        hex(&seen)
                    ),
                });
            }
        }
        self.write_text(machine, &now, &writes)?;
        self.journal.clear_text(machine)?;
        if let Some((table, misses)) = self.inflight {
            let (n, restored) = self.restore_returns(machine, table)?;
            self.journal.clear_tables(machine)?;
            report.returns_restored = restored;
            let mut m = [0u8; 8];
            machine.read_phys(self.heap_phys(misses), &mut m)?;
            report.timing_misses = u64::from_le_bytes(m);
            tracing::debug!(
                "{n} timed calls in flight at removal, {restored} return addresses put back"
            );
        }
        let pages: BTreeSet<u64> = self.before.0.keys().copied().collect();
        let after = snapshot(machine, &self.kernel, &pages)?;
        report.before = self.before.digest();
        report.after = after.digest();
        report.differing = self.before.differing(&after);
        report.pages = pages.len();
        self.before = PageSnapshot::default();
        Ok(report)
    }

    /// Puts back the return addresses of timed calls still in flight (their stack slot still
    /// holds a trampoline); returns (calls in flight, addresses put back). A call whose vCPU
    /// stopped inside the trampoline finishes there when the guest resumes.
    fn restore_returns(
        &self,
        machine: &mut dyn Machine,
        table: u64,
    ) -> anyhow::Result<(usize, usize)> {
        let trampolines: BTreeSet<u64> = self.installed_timing.iter().copied().collect();
        let bytes = (INFLIGHT + u64::from(PROBE_SLOTS)) * SLOT;
        let mut buf = vec![0u8; usize::try_from(bytes)?];
        machine.read_phys(self.heap_phys(table), &mut buf)?;
        let (mut n, mut restored) = (0, 0);
        let word =
            |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
        for slot in buf.chunks(SLOT as usize) {
            let key = word(slot, 0);
            if key == 0 {
                continue;
            }
            n += 1;
            let original = word(slot, 8);
            let mut mem = BackendMemory(&mut *machine);
            let mut space = self.survey.space(&mut mem);
            let mut now = [0u8; 8];
            if space.read(key, &mut now).is_err() || !trampolines.contains(&u64::from_le_bytes(now))
            {
                continue;
            }
            let phys = space.translate(key)?.phys;
            machine.write_phys(phys, &original.to_le_bytes())?;
            restored += 1;
        }
        Ok((n, restored))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------
// Oracles read from the guest's own tracing state.
// ---------------------------------------------------------------------------------------

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
            (101, 21, 7, 2),
            (0, 0, 7, 1),
            (103, 23, 7, 2),
        ]);

        let (running, consumed) = take_records(&bytes, false);
        let (last, consumed_last) = take_records(&bytes, true);

        assert_eq!(
            consumed, 2,
            "stops at the record whose TSC is not written yet"
        );
        assert_eq!(
            running.iter().map(|r| r.tsc).collect::<Vec<_>>(),
            [100, 101]
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
            [100, 101, 103]
        );
    }

    #[test]
    fn relative_table_fields_resolve_against_their_own_address() {
        let bytes = [0xf0, 0xff, 0xff, 0xff, 0x10, 0, 0, 0];

        assert_eq!(relative(0x1000, &bytes, 0), Some(0x1000 - 0x10));
        assert_eq!(relative(0x1000, &bytes, 4), Some(0x1014));
        assert_eq!(relative(0x1000, &bytes, 6), None);
    }

    #[test]
    fn jmp_rel32_encodes_the_displacement_from_the_next_instruction() {
        assert_eq!(
            jmp_rel32(0xffff_ffff_8100_0000, 0xffff_ffff_8100_0105).unwrap(),
            [0xe9, 0x00, 0x01, 0x00, 0x00]
        );
        assert!(jmp_rel32(0xffff_ffff_8100_0000, 0x4000_0000_0000).is_err());
    }

    #[test]
    fn nullify_patch_counts_sets_rax_and_returns_through_the_thunk() {
        let at = 0xffff_ffff_c000_0000;
        let counter = at + 0x1000;
        let thunk = 0xffff_ffff_81e0_1ef0;

        let code = diverting_patch(at, counter, Action::Nullify(4242), Some(thunk)).unwrap();

        let insns: Vec<_> =
            iced_x86::Decoder::with_ip(64, &code, at, iced_x86::DecoderOptions::NONE)
                .into_iter()
                .collect();
        assert_eq!(insns.len(), 3);
        assert!(insns[0].has_lock_prefix());
        assert_eq!(insns[0].ip_rel_memory_address(), counter);
        assert_eq!(insns[1].immediate64(), 4242);
        assert_eq!(insns[2].near_branch_target(), thunk);
    }
}
