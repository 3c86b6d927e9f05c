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

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use exotap_introspect::heap::HeapPlacement;
use exotap_introspect::layout::TaskOffsets;
use exotap_vmm::control::Machine;

use crate::compile::site::{ReturnSwap, INFLIGHT, PROBE_SLOTS, SLOT};
use crate::rings::RingSet;
use crate::splice::{generate, PatchHeap, PatchRequest, Probe, Site, SpliceDecision};

use super::attach::{self, Survey};
use super::guest_memory::BackendMemory;
use super::kernel_image::KernelImage;

/// Start of the splice engine's part of the patch heap (below: the trap probes of
/// [`super::trap_script`]).
pub const REGION: u64 = 0x10_0000;
/// Start of the patches (between [`REGION`] and this: counters).
pub const CODE_OFFSET: u64 = 0x20_0000;
/// The most bytes one patch may take: a traced function's trampoline, entry half (with the
/// chained return swap of nested probes) and relocated instruction take up to 817 with the
/// task's pid and name (`patches::tests`), a timed one less.
const MAX_PATCH: u64 = 1024;
/// The most bytes one compiled-probe site may take (bodies, trampoline, relocation).
const MAX_COMPILED: u64 = 64 << 10;
/// Patch space reserved per site of a batch (a counting patch is 20 to 40 bytes).
const AVERAGE_PATCH: u64 = 64;
/// Text pages are hashed and compared in units of this size.
const PAGE: u64 = 4096;
/// Bytes per gdbstub read of the text (the client splits them into packets).
const READ_CHUNK: usize = 1 << 20;

mod drain;
mod kernel;
mod modules;
mod oracles;
mod pages;
mod patches;
mod records;
mod targets_cache;

pub use kernel::{category, endbr_or_seal, why_not, KernelFacts, LiveKernel};
pub use modules::{ModuleTables, ModuleText};
pub use oracles::{guest_ftrace_sites, guest_kprobe_hits, KprobeReader};
pub use pages::{changed_sites, page_spans, PageSnapshot, MERGE_GAP};
use pages::{pages_of, snapshot};
pub use patches::{diverting_patch, jmp_rel32, timed_entry_patch, EntryPatch};
pub use patches::{Rings, BUCKETS, TRACE_RECORD};
pub use records::{ring_spans, ring_spans_of, ring_window, take_records, TraceRecord};

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
    /// The entry half at `at`; with `returns` (the table of calls in flight, its miss
    /// counter, the trampoline, the heap) it also swaps the return address.
    ///
    /// # Errors
    /// When the code cannot be generated.
    fn entry(&mut self, site: u32, at: u64, returns: Option<ReturnSwap>)
        -> anyhow::Result<Vec<u8>>;
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
    /// Timed calls in flight at removal whose stack slot could not be read, so their return
    /// address could not be checked or put back: (slot address, why). Each is also logged.
    pub returns_unrestored: Vec<(u64, String)>,
    /// Trace records (cpu, record), oldest first per vCPU.
    pub records: Vec<(u32, TraceRecord)>,
    /// Records lost per vCPU (ring overruns).
    pub overruns: Vec<u64>,
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
            cpu_number: attach::percpu_variable(image, None, "cpu_number").ok(),
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
        // A function's probe goes past its `endbr64` on an IBT kernel (see
        // [`LiveKernel::entry`]); from here on the site's address is that one.
        // The text of the functions they are in, read now where it was not yet.
        let addrs: Vec<u64> = requests.iter().map(|r| r.addr).collect();
        self.kernel.prepare(machine, &addrs)?;
        let past_endbr: Vec<Request> = requests
            .iter()
            .map(|r| {
                Ok(Request {
                    addr: self.kernel.entry(r.addr)?,
                    ..r.clone()
                })
            })
            .collect::<anyhow::Result<_>>()?;
        let requests = &past_endbr[..];
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
                    let heap = (self.heap_va, self.heap_va.saturating_add(self.heap_size));
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
                    let swap = ReturnSwap {
                        table,
                        misses,
                        trampoline: patch,
                        heap,
                    };
                    timed_entry_patch(&site, &swap, hist, trace)
                        .map(|p| (p.code, p.splice))
                        .map_err(|e| format!("{e:#}"))
                }
                Action::Compiled(k) => {
                    let (table, misses) = self.inflight.unwrap_or_default();
                    let heap = (self.heap_va, self.heap_va.saturating_add(self.heap_size));
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
                            ret = Some(ReturnSwap {
                                table,
                                misses,
                                trampoline: patch,
                                heap,
                            });
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
        // A span across pages that are not physically adjacent (module text) goes in pieces.
        let mut phys: Vec<(u64, &[u8])> = Vec::with_capacity(spans.len());
        for (addr, bytes) in &spans {
            let mut done = 0usize;
            while done < bytes.len() {
                let at = addr + done as u64;
                let mut n = usize::try_from(PAGE - (at % PAGE))?.min(bytes.len() - done);
                while done + n < bytes.len() && self.kernel.contiguous(at, (n + 1) as u64) {
                    n = (n + usize::try_from(PAGE)?).min(bytes.len() - done);
                }
                let p = self
                    .kernel
                    .phys(at)
                    .with_context(|| format!("{at:#x} is not kernel text"))?;
                phys.push((p, &bytes[done..done + n]));
                done += n;
            }
        }
        machine.write_phys_batch(&phys)?;
        Ok((spans.len(), spans.iter().map(|s| s.1.len()).sum()))
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
            let ReturnsRestored {
                in_flight: n,
                restored,
                unrestored,
            } = self.restore_returns(machine, table)?;
            self.journal.clear_tables(machine)?;
            report.returns_restored = restored;
            let mut m = [0u8; 8];
            machine.read_phys(self.heap_phys(misses), &mut m)?;
            report.timing_misses = u64::from_le_bytes(m);
            tracing::debug!(
                "{n} timed calls in flight at removal, {restored} return addresses put back, \
                 {} unreadable",
                unrestored.len()
            );
            report.returns_unrestored = unrestored;
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

    /// Takes out the splices inside `range` (a module's text the guest is about to free;
    /// the guest stopped): the original bytes go back where exotap's `jmp` still is, the
    /// touched pages leave the before/after comparison (the module's text goes away with
    /// them), and the module's text is forgotten, so that a module loaded there later is read
    /// anew. No call of a module's function is in flight when the kernel frees it, so no
    /// return address points into these sites' trampolines. Returns the sites taken out.
    ///
    /// # Errors
    /// When guest memory cannot be read or written.
    pub fn remove_range(
        &mut self,
        machine: &mut dyn Machine,
        range: std::ops::Range<u64>,
    ) -> anyhow::Result<usize> {
        let (gone, keep): (Vec<Installed>, Vec<Installed>) = std::mem::take(&mut self.installed)
            .into_iter()
            .partition(|s| range.contains(&s.addr));
        self.installed = keep;
        if !gone.is_empty() {
            let pages = pages_of(gone.iter().map(|s| (s.addr, s.original.len())));
            let now = snapshot(machine, &self.kernel, &pages)?;
            let writes: Vec<(u64, Vec<u8>)> = gone
                .iter()
                .filter(|s| now.bytes(s.addr, 5).unwrap_or_default() == s.splice)
                .map(|s| (s.addr, s.original[..5].to_vec()))
                .collect();
            self.write_text(machine, &now, &writes)?;
        }
        self.before
            .0
            .retain(|page, _| !(range.start & !(PAGE - 1)..range.end).contains(page));
        self.kernel.forget_module(&range);
        Ok(gone.len())
    }

    /// Puts back the return addresses of timed calls still in flight (their stack slot still
    /// holds a trampoline); a slot that cannot be read is logged as a warning and returned.
    /// A call whose vCPU stopped inside the trampoline finishes there when the guest resumes.
    fn restore_returns(
        &self,
        machine: &mut dyn Machine,
        table: u64,
    ) -> anyhow::Result<ReturnsRestored> {
        let trampolines: BTreeSet<u64> = self.installed_timing.iter().copied().collect();
        let bytes = (INFLIGHT + u64::from(PROBE_SLOTS)) * SLOT;
        let mut buf = vec![0u8; usize::try_from(bytes)?];
        machine.read_phys(self.heap_phys(table), &mut buf)?;
        let (mut n, mut restored, mut unrestored, mut gone) = (0, 0, Vec::new(), 0);
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
            match space.read(key, &mut now) {
                Ok(()) => {}
                // A kernel stack is mapped for as long as its task lives: an unmapped slot
                // belongs to a task that ended inside the call (exit and exit_group never
                // return), whose stack is gone with it. Nothing will return there.
                Err(exotap_introspect::paging::PagingError::NotPresent { .. }) => {
                    gone += 1;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(
                        "a timed call in flight at removal: its return address slot at \
                         {key:#x} cannot be read ({e}); its return address is not put back"
                    );
                    unrestored.push((key, e.to_string()));
                    continue;
                }
            }
            if !trampolines.contains(&u64::from_le_bytes(now)) {
                continue;
            }
            let phys = space.translate(key)?.phys;
            machine.write_phys(phys, &original.to_le_bytes())?;
            restored += 1;
        }
        if gone > 0 {
            tracing::debug!(
                "{gone} calls in flight at removal belong to tasks that ended inside them \
                 (their stacks are unmapped): nothing returns there"
            );
        }
        Ok(ReturnsRestored {
            in_flight: n,
            restored,
            unrestored,
        })
    }
}

/// What [`Splicer::restore_returns`] did.
#[derive(Debug)]
struct ReturnsRestored {
    /// Timed calls in flight.
    in_flight: usize,
    /// Return addresses put back.
    restored: usize,
    /// Return address slots that could not be read: (address, why).
    unrestored: Vec<(u64, String)>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
