//! The JIT against a live guest (issue 18): chosen kernel functions, and the functions
//! they call directly (to a depth), translated from the *live* text into a code cache in
//! the patch heap ([`crate::jit`]), entered through a `jmp` splice at each translated
//! function's entry, counted per basic block while the guest runs, and taken out again.
//!
//! # Install (the guest stopped)
//! The session's live text and its analysis ([`super::splicer::LiveKernel`]) give each
//! function's CFG and liveness; the translator copies the functions block by block into a
//! region of the patch heap (code, block counters, lookup table). Calls to retpoline
//! thunks go through the lookup table like `call *%rax`. The code goes over the backend's
//! write path (QEMU then drops its translated blocks of those addresses), the zeroed
//! counters and the table through the shared RAM where there is one. Then the entry
//! splices go in as one batch of the splicer ([`Action::Enter`]: journaled for recovery,
//! checked against the bytes planned over, restored byte-exact).
//!
//! # What is counted, and what is not
//! A block's counter counts the executions of its translation. Code runs outside the cache
//! after an instruction the kernel finds by address (user accesses with exception-table
//! entries run at their original address), after a return from a function that is not
//! translated (its `ret` pops an ORIGINAL return address, which lands in original text:
//! the stack never holds a cache address), and after a lookup miss of an indirect branch.
//! From there the rest of that execution of the function, and of its callers up the stack,
//! runs uncounted until the next entry splice is hit. Re-entry at such return sites is not
//! built (issue 18).
//!
//! # Lazy translation ([`JitOptions::lazy`], [`LiveJit::serve`])
//! A direct call or jump from translated code to a function start that has no translation
//! (yet) is linked to a stub: an 8-byte-aligned `jmp <original target>` in the cache, with
//! an exotap breakpoint on it (QEMU's gdbstub keeps breakpoints outside guest memory). The
//! first vCPU to reach a stub stops the guest (all vCPUs: the gdbstub is all-stop); exotap
//! translates the target from the session's text, appends the code after the cache's end,
//! writes its lookup-table slots (cache address first, then the key), arms the stubs the
//! new code brings, rewrites the stub's `jmp` to the translation (the backend's write path,
//! so QEMU drops its blocks there), takes the breakpoint out and splices the function's
//! entry; then the guest resumes, and the stopped vCPU runs the new `jmp`. Every patch is
//! made with every vCPU stopped, so no vCPU sees half a stub; the `jmp` lies inside one
//! aligned quadword all the same. A later call through the stub jumps straight into the
//! translation: in steady state nothing stops. A target that cannot be translated keeps its
//! `jmp` to the original; a full cache takes every breakpoint out (stubs then run original
//! code) and is reported. Return addresses stay original ones (a stub is entered by the
//! same `push <original return address>; jmp` as a linked call). At removal every
//! breakpoint comes out first, so a vCPU stopped at a stub goes on to the original code.
//!
//! # Text that changes ([`LiveJit::watch`])
//! A function whose text changed under its translation is translated again from its new
//! text (at most [`MAX_RETRANSLATIONS`] times): every block head of the earlier translations
//! becomes a `jmp` to the new translation's block at the same leader, and the lookup table
//! maps its instructions to the new code. Past the bound, or when the new text cannot be
//! translated, the heads go to the original code instead and the function runs there.
//!
//! # Remove (the guest stopped)
//! The counters are read; the splicer writes back every entry's original bytes and hashes
//! the touched pages; the lookup table is zeroed, so every return and indirect branch still
//! in the cache continues at its original target; then exotap checks that no vCPU's RIP and
//! no return address of a kernel stack (each vCPU's unwound from its registers, every other
//! task's from its saved `thread.sp`, with the image's ORC tables, interrupt frames
//! included) points into the cache's code, letting the guest run 100 ms and checking again
//! while one does ([`Reachability`], up to 20 times). Only then is the heap given up.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use exotap_introspect::x86::{thunk_register, Flow};
use exotap_vmm::control::{Machine, StopEvent, VcpuId};

use super::attach;
use super::guest_memory::BackendMemory;
use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::splicer::{Action, InstallReport, NotInstalled, RemoveReport, Request};
use super::stacks::{list_tasks, KernelStacks, PageCache, TaskLayout};
use crate::jit::{CacheLayout, ExitReason, Link, TranslateError, Translation, Translator};

mod counters;
mod lazy;
mod text;

use counters::{map_counter_alias, per_cpu_copies};

/// What to translate and how much room to give it.
#[derive(Debug, Clone)]
pub struct JitOptions {
    /// Direct callees are translated to this depth (0: only the functions asked for).
    pub depth: u32,
    /// At most this many functions are translated in all.
    pub max_functions: usize,
    /// Bytes of translated code.
    pub code_bytes: u64,
    /// Bytes of block counters (8 a block).
    pub counter_bytes: u64,
    /// Bytes of lookup table (16 a slot; at most half the slots are used).
    pub table_bytes: u64,
    /// Lazy translation: a direct call or jump from translated code to a function not
    /// translated yet stops the guest once, at a stub; the host translates the function,
    /// relinks the stub and gives it an entry splice ([`LiveJit::serve`]).
    pub lazy: bool,
}

impl Default for JitOptions {
    fn default() -> Self {
        Self {
            depth: 1,
            max_functions: 4000,
            code_bytes: 8 << 20,
            counter_bytes: 1 << 20,
            table_bytes: 20 << 20,
            lazy: false,
        }
    }
}

/// One block's count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCount {
    /// The function's name.
    pub function: String,
    /// The function's entry (running kernel).
    pub function_addr: u64,
    /// The block leader (running kernel).
    pub leader: u64,
    /// Executions of the block's translation.
    pub count: u64,
    /// Whether the function was asked for (else it was translated as a callee).
    pub requested: bool,
}

/// Translations in a live guest, between install and removal.
#[derive(Debug)]
pub struct LiveJit {
    /// What was translated.
    pub translation: Translation,
    /// The cache's parts in the patch heap.
    pub layout: CacheLayout,
    /// Where each CPU's copy of the block counters is, in bytes past `layout.counters`
    /// (one copy at 0: a counter shared by every CPU, incremented with `lock inc`).
    pub counter_copies: Vec<u64>,
    /// The lookup table at install: probes a hit takes on average and at most, and the
    /// longest run of full slots ([`crate::jit::LookupTable::probe_lengths`]).
    pub table_probes: (f64, usize, usize),
    /// Function entry → name, for every translated function.
    pub names: BTreeMap<u64, String>,
    /// The entries asked for.
    pub requested: BTreeSet<u64>,
    /// Functions the translator refused, and why.
    pub refused: Vec<(String, String)>,
    /// Time to choose and translate the functions.
    pub translate_time: Duration,
    /// Bytes of original text translated.
    pub source_bytes: u64,
    /// The entry splices' install report (entries refused are reachable only from
    /// translated callers).
    pub entries: InstallReport,
    /// Entry splices in place.
    pub entries_installed: usize,
    /// Per translated function: (entry, end, the text it was translated from, its
    /// instructions' addresses), to see the kernel change it ([`LiveJit::watch`]).
    sources: Vec<(u64, u64, Vec<u8>, Vec<u64>)>,
    /// Functions whose text changed under their translation, and were sent back to their
    /// original code.
    pub invalidated: Vec<Invalidation>,
    /// Functions whose text changed but could not be invalidated yet (a vCPU was inside a
    /// block head); tried again at the next look.
    pending: BTreeSet<u64>,
    /// When the text was last compared.
    watched: Option<Instant>,
    /// The translator, kept for lazy translation.
    translator: Option<Translator<'static>>,
    /// Lazy translation so far.
    pub lazy: LazyStats,
    /// Stubs with a breakpoint in place.
    armed: BTreeSet<u64>,
    /// Block counts at [`LiveJit::mark`], subtracted at removal.
    marked: Option<BTreeMap<(u64, u64), u64>>,
    /// Translations made again per function after its text changed.
    retranslations: BTreeMap<u64, u32>,
    /// Functions sent back to their original code for good.
    given_up: BTreeSet<u64>,
}

/// What lazy translation did.
#[derive(Debug, Clone, Default)]
pub struct LazyStats {
    /// Whether it is on.
    pub on: bool,
    /// Stops at a stub (each translated a function, or found it could not).
    pub stops: u64,
    /// Stops at [`LiveJit::mark`].
    pub stops_at_mark: Option<u64>,
    /// Functions translated lazily.
    pub translated: usize,
    /// Entry splices added for them.
    pub entries: usize,
    /// Stubs made (each an untranslated target of a translated direct call or jump).
    pub stubs: usize,
    /// Time the stops took, the guest stopped (translation, writes, breakpoints).
    pub stopped: Duration,
    /// Why lazy translation stopped early (the cache full): stubs then run original code.
    pub full: Option<String>,
    /// Breakpoint stops at no armed stub (resumed at once).
    pub other_stops: u64,
    /// Functions translated lazily from text the kernel had changed since exotap read it.
    pub changed_text: usize,
    /// The function each stop was for, in order (the first `stops_at_mark` of them came
    /// before the mark): which paths a workload reached late.
    pub order: Vec<String>,
}

/// A translation given up because the kernel changed the text under it (the guest arming
/// a kprobe, a static key or ftrace flipping): from then on the function runs its
/// original code, uncounted.
#[derive(Debug, Clone)]
pub struct Invalidation {
    /// The function.
    pub function: String,
    /// Its entry.
    pub start: u64,
    /// The first byte that changed.
    pub at: u64,
    /// What was there, and what is there now.
    pub was: u8,
    /// See `was`.
    pub now: u8,
    /// Whether the function was translated again from its new text (else it runs its
    /// original code from then on).
    pub retranslated: bool,
}

/// How many times one function is translated again after its text changed; after that it
/// runs its original code (a function the kernel keeps patching costs a translation each
/// time).
pub const MAX_RETRANSLATIONS: u32 = 8;

/// What the reachability check at removal found.
#[derive(Debug, Clone, Default)]
pub struct Reachability {
    /// Checks made (each with the guest stopped).
    pub checks: u32,
    /// Words that pointed into the cache at the last check: (where, what).
    pub found: Vec<(String, u64)>,
    /// Stack frames unwound at the last check.
    pub frames: usize,
    /// Tasks whose stacks were scanned.
    pub tasks: usize,
}

impl Reachability {
    /// Whether the cache was unreachable at the last check.
    pub fn unreachable(&self) -> bool {
        self.found.is_empty()
    }
}

/// What a removal found.
#[derive(Debug)]
pub struct JitRemoval {
    /// Block counts read at the stop before the text was restored.
    pub counts: Vec<BlockCount>,
    /// The splicer's removal report (text pages before and after).
    pub text: RemoveReport,
    /// The reachability check.
    pub reach: Reachability,
}

/// How often the reachability check looks again while something still points into the cache.
const REACH_CHECKS: u32 = 20;

/// Names of translated functions: the image's symbol at each entry.
fn name_of(image: &KernelImage, slide: u64, addr: u64) -> String {
    image
        .symbols
        .lookup_addr(addr.wrapping_sub(slide))
        .map_or_else(
            || format!("{addr:#x}"),
            |(s, o)| {
                if o == 0 {
                    s.name.clone()
                } else {
                    format!("{}+{o:#x}", s.name)
                }
            },
        )
}

/// Whether the guest's CPU runs `lahf`/`sahf` in 64-bit mode, which translated code uses to
/// keep the status flags (crate::jit::translate, "Flags"): `X86_FEATURE_LAHF_LM`, bit 0 of
/// word 6 (CPUID 0x8000_0001 ECX) of `boot_cpu_data.x86_capability`, as the kernel found it
/// at boot.
fn guest_has_lahf_lm(session: &mut GuestSession, image: &KernelImage) -> anyhow::Result<bool> {
    /// `CPUID_8000_0001_ECX`'s word in `x86_capability`.
    const WORD: u64 = 6;
    let btf = image.btf()?;
    let at = btf
        .struct_member("cpuinfo_x86", "x86_capability")
        .context("struct cpuinfo_x86 in the kernel's BTF")?;
    let boot = image
        .symbols
        .get("boot_cpu_data")
        .context("the kernel image has no boot_cpu_data")?
        .addr
        .wrapping_add(session.survey.kaslr.slide);
    let word = boot + at.bit_offset / 8 + WORD * 4;
    let survey = session.survey.clone();
    let (machine, _) = session.parts()?;
    let mut mem = BackendMemory(&mut *machine);
    let mut space = survey.space(&mut mem);
    let mut bytes = [0u8; 4];
    space
        .read(word, &mut bytes)
        .with_context(|| format!("reading boot_cpu_data's capabilities at {word:#x}"))?;
    Ok(u32::from_le_bytes(bytes) & 1 != 0)
}

impl LiveJit {
    /// Translates `functions` (names and running-kernel entries) and their direct callees
    /// to `options.depth`, writes the cache and splices every translated entry that takes a
    /// splice. The session must be planned ([`GuestSession::plan`]) and the guest stopped.
    ///
    /// # Errors
    /// No room in the heap, a function with no code, the cache too small for the functions
    /// asked for, guest memory that cannot be written.
    pub fn install(
        session: &mut GuestSession,
        image: &KernelImage,
        functions: &[(String, u64)],
        options: &JitOptions,
    ) -> anyhow::Result<Self> {
        let slide = session.survey.kaslr.slide;
        let started = Instant::now();
        if !guest_has_lahf_lm(session, image)? {
            anyhow::bail!(
                "the guest's CPU has no LAHF/SAHF in 64-bit mode (CPUID LAHF_LM), which \
                 translated code uses to keep the flags: the JIT cannot run on it"
            );
        }
        let per_cpu = per_cpu_copies(
            &session.survey.layout.per_cpu_offsets,
            options.counter_bytes,
        );
        // The counter area: one copy (shared), or a copy per CPU laid out as the CPUs'
        // per-CPU bases are.
        let counter_area = per_cpu
            .as_ref()
            .map_or(options.counter_bytes, |c| c.span.max(options.counter_bytes));
        let total = options
            .code_bytes
            .checked_add(counter_area)
            .and_then(|t| t.checked_add(options.table_bytes))
            .context("the cache size overflows")?;
        let base = session.alloc(total, 0x1000)?;
        let counters_at = base + options.code_bytes;
        let mut layout = CacheLayout {
            code: base..counters_at,
            counters: counters_at..counters_at + options.counter_bytes,
            table: counters_at + counter_area..base + total,
        };
        let mut counter_copies = vec![0];
        let mut gs_delta = None;
        if let Some(copies) = per_cpu {
            match map_counter_alias(session, image, counters_at, copies.span) {
                Ok(delta) => {
                    layout.counters = counters_at..counters_at + copies.per_copy;
                    gs_delta = Some(delta);
                    counter_copies = copies.offsets;
                }
                Err(e) => tracing::info!(
                    "one block counter shared by every CPU (`lock inc`), not one per CPU: {e:#}"
                ),
            }
        }
        let (machine, splicer) = session.parts()?;
        // The walk over callees reads any function: the whole text, now.
        splicer.kernel.load_all(machine)?;
        let thunks: HashMap<u64, iced_x86::Register> = image
            .symbols
            .iter()
            .filter_map(|s| Some((s.addr.wrapping_add(slide), thunk_register(&s.name)?)))
            .collect();
        let kernel = &splicer.kernel;
        let ctx = kernel.context();
        let facts = &kernel.facts;
        let starts: BTreeSet<u64> = facts.starts.iter().copied().collect();
        let special: BTreeSet<u64> = ["__fentry__", "__x86_return_thunk"]
            .iter()
            .filter_map(|n| image.symbols.get(n))
            .map(|s| s.addr.wrapping_add(slide))
            .collect();
        let translatable = |addr: u64| {
            starts.contains(&addr)
                && !thunks.contains_key(&addr)
                && !special.contains(&addr)
                && !facts.forbidden.iter().any(|r| r.contains(&addr))
                && !facts.self_patched.iter().any(|r| r.contains(&addr))
        };
        // The functions asked for, then their direct callees breadth first.
        let mut order: Vec<u64> = Vec::new();
        let mut seen = BTreeSet::new();
        let mut queue: VecDeque<(u64, u32)> = VecDeque::new();
        let mut refused = Vec::new();
        for (name, addr) in functions {
            if !translatable(*addr) {
                anyhow::bail!(
                    "{name} at {addr:#x} cannot be translated: not a function start in the \
                     instrumentable text (entry and noinstr code, thunks and self-patched \
                     code are not)"
                );
            }
            if seen.insert(*addr) {
                queue.push_back((*addr, 0));
            }
        }
        while let Some((addr, depth)) = queue.pop_front() {
            if order.len() >= options.max_functions {
                break;
            }
            let Some(f) = ctx
                .analysis
                .function_containing(addr)
                .filter(|f| f.cfg.start() == addr)
            else {
                refused.push((
                    name_of(image, slide, addr),
                    "no analysed function starts there".to_owned(),
                ));
                continue;
            };
            order.push(addr);
            if depth >= options.depth {
                continue;
            }
            for insn in f.cfg.insns() {
                let target = match insn.flow {
                    Flow::Call { target }
                    | Flow::TailJump { target }
                    | Flow::CondTailJump { target } => target,
                    _ => continue,
                };
                if translatable(target) && seen.insert(target) {
                    queue.push_back((target, depth + 1));
                }
            }
        }
        // Callees that are not translated and call nothing (`__memset` in a kernel that
        // keeps it in its noinstr text): called from the cache, they return into it.
        let entry_text = ["__entry_text_start", "__entry_text_end"]
            .map(|n| image.symbols.get(n).map(|s| s.addr.wrapping_add(slide)));
        let in_entry_text = |a: u64| match entry_text {
            [Some(start), Some(end)] => (start..end).contains(&a),
            _ => true,
        };
        let leaf_ok = |a: u64| {
            starts.contains(&a)
                && !thunks.contains_key(&a)
                && !special.contains(&a)
                && !in_entry_text(a)
        };
        let mut native_leaves = HashSet::new();
        for &addr in &order {
            let Some(f) = ctx.analysis.function_containing(addr) else {
                continue;
            };
            for insn in f.cfg.insns() {
                if let Flow::Call { target } = insn.flow {
                    if !translatable(target)
                        && !native_leaves.contains(&target)
                        && is_native_leaf(&ctx, &facts.self_patched, &leaf_ok, target, 3)
                    {
                        native_leaves.insert(target);
                    }
                }
            }
        }
        if !native_leaves.is_empty() {
            tracing::debug!(
                "{} leaf callees that are not translated are called from the cache: {}",
                native_leaves.len(),
                native_leaves
                    .iter()
                    .map(|&a| name_of(image, slide, a))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        let mut translator = Translator::new_owned(layout.clone(), facts.address_keyed.clone())?
            .with_thunks(thunks.clone())
            .with_native_leaves(native_leaves);
        if let Some(delta) = gs_delta {
            translator = translator.with_per_cpu_counters(delta)?;
        }
        if options.lazy {
            // Every function start the same rules admit; the ranges once sorted and merged
            // (tens of thousands of starts against thousands of self-patched sites).
            let mut out: Vec<Range<u64>> = facts
                .forbidden
                .iter()
                .chain(&facts.self_patched)
                .cloned()
                .collect();
            out.sort_by_key(|r| r.start);
            let mut merged: Vec<Range<u64>> = Vec::new();
            for r in out {
                match merged.last_mut() {
                    Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                    _ => merged.push(r),
                }
            }
            let inside = |a: u64| {
                let i = merged.partition_point(|r| r.start <= a);
                i > 0 && merged[i - 1].contains(&a)
            };
            let lazy: std::collections::HashSet<u64> = facts
                .starts
                .iter()
                .copied()
                .filter(|a| !thunks.contains_key(a) && !special.contains(a) && !inside(*a))
                .collect();
            translator = translator.with_lazy(lazy);
        }
        let mut names = BTreeMap::new();
        let mut sources = Vec::new();
        let mut source_bytes = 0;
        for &addr in &order {
            let Some(f) = ctx.analysis.function_containing(addr) else {
                continue;
            };
            let name = name_of(image, slide, addr);
            match translator.translate(ctx.text, f) {
                Ok(()) => {
                    source_bytes += f.cfg.end() - f.cfg.start();
                    names.insert(addr, name);
                    let bytes = ctx
                        .text
                        .range(f.cfg.start(), f.cfg.end())
                        .unwrap_or_default()
                        .to_vec();
                    let insns = f.cfg.insns().iter().map(|i| i.addr).collect();
                    sources.push((f.cfg.start(), f.cfg.end(), bytes, insns));
                }
                Err(e @ TranslateError::Full { .. }) => {
                    refused.push((name, format!("{e:#}")));
                    if functions.iter().any(|(_, a)| *a == addr) {
                        return Err(anyhow::Error::new(e)
                            .context("the code cache cannot take the functions asked for"));
                    }
                }
                Err(e) => {
                    refused.push((name, format!("{e}")));
                    if functions.iter().any(|(_, a)| *a == addr) {
                        return Err(anyhow::Error::new(e));
                    }
                }
            }
        }
        translator.link()?;
        let (hash, table_probes) = translator.table_probe_lengths();
        let (mean, most, run) = table_probes;
        tracing::info!(
            "JIT lookup table: home slots from the low {} bits, {mean:.2} probes a hit on average, {most} at most; longest run of full slots {run}",
            hash.bits
        );
        let translation = translator.snapshot();
        let translate_time = started.elapsed();
        // Code over the backend's write path; data (zeroed counters, the table) through the
        // shared RAM when there is one.
        splicer.write_heap(machine, translation.code_at, &translation.code)?;
        let zeros = vec![0u8; usize::try_from(counter_area)?];
        match &splicer.shared {
            Some(shared) => {
                shared.write_heap(counters_at, &zeros)?;
                shared.write_heap(translation.table_at, &translation.table)?;
            }
            None => {
                splicer.write_heap(machine, counters_at, &zeros)?;
                splicer.write_heap(machine, translation.table_at, &translation.table)?;
            }
        }
        let requests: Vec<Request> = translation
            .functions
            .values()
            .map(|f| Request {
                name: names.get(&f.start).cloned().unwrap_or_default(),
                addr: f.start,
                action: Action::Enter(f.entry),
            })
            .collect();
        let entries = session.install(&requests)?;
        let entries_installed = session.splicer().map_or(0, |s| s.installed.len());
        let mut lazy = LazyStats {
            on: options.lazy,
            stubs: translation.stubs.len(),
            ..LazyStats::default()
        };
        let mut armed = BTreeSet::new();
        if options.lazy && session.machine.backend() != "qemu gdbstub" {
            // Only the gdbstub's stops are served while the guest runs.
            tracing::warn!(
                "no lazy translation on the {} backend: only over QEMU's gdbstub",
                session.machine.backend()
            );
            lazy.on = false;
        }
        if lazy.on {
            for &stub in translation.stubs.values() {
                match session.machine.set_breakpoint(stub, true) {
                    Ok(()) => {
                        armed.insert(stub);
                    }
                    Err(e) => {
                        tracing::warn!(
                            "no lazy translation: the backend sets no breakpoint in the cache ({e})"
                        );
                        lazy.on = false;
                        break;
                    }
                }
            }
            if !lazy.on {
                for stub in std::mem::take(&mut armed) {
                    let _ = session.machine.set_breakpoint(stub, false);
                }
            }
        }
        tracing::info!(
            "JIT: {} functions ({} bytes of text) translated in {:.1} ms into {} bytes of cache; {} entry splices",
            translation.functions.len(),
            source_bytes,
            translate_time.as_secs_f64() * 1e3,
            translation.code.len(),
            entries_installed
        );
        Ok(Self {
            translation,
            layout,
            counter_copies,
            table_probes,
            names,
            requested: functions.iter().map(|(_, a)| *a).collect(),
            refused,
            translate_time,
            source_bytes,
            entries,
            entries_installed,
            sources,
            invalidated: Vec::new(),
            pending: BTreeSet::new(),
            watched: None,
            translator: Some(translator),
            lazy,
            armed,
            marked: None,
            retranslations: BTreeMap::new(),
            given_up: BTreeSet::new(),
        })
    }

    /// Reads the block counts now (the guest stopped for it, then resumed): removal reports
    /// the executions after this point, and the lazy-translation stops after it are counted
    /// apart (a workload run twice: the second run should need no stop).
    ///
    /// # Errors
    /// When the guest cannot be stopped, read or resumed.
    pub fn mark(&mut self, session: &mut GuestSession) -> anyhow::Result<()> {
        session.pause()?;
        let counts = self.counts(session)?;
        self.marked = Some(
            counts
                .into_iter()
                .map(|b| ((b.function_addr, b.leader), b.count))
                .collect(),
        );
        self.lazy.stops_at_mark = Some(self.lazy.stops);
        session.resume()?;
        Ok(())
    }

    /// (entry, end) of every translated function, running-kernel addresses.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.sources.iter().map(|(s, e, _, _)| (*s, *e)).collect()
    }

    /// Entry splices refused by the planner (their functions are entered only from
    /// translated callers).
    pub fn entries_refused(&self) -> &[NotInstalled] {
        &self.entries.refused
    }

    /// Cache exits by reason.
    pub fn exits(&self) -> BTreeMap<ExitReason, usize> {
        let mut out = BTreeMap::new();
        for e in &self.translation.exits {
            *out.entry(e.reason).or_default() += 1;
        }
        out
    }

    /// Reads every block counter (the guest stopped, or running where the RAM is shared).
    ///
    /// # Errors
    /// When the heap cannot be read.
    pub fn counts(&self, session: &mut GuestSession) -> anyhow::Result<Vec<BlockCount>> {
        let range = &self.translation.counters;
        let len = usize::try_from(range.end - range.start)?;
        let (machine, splicer) = session.parts()?;
        // Each CPU's copy, summed.
        let mut bytes = vec![0u8; len];
        for &offset in &self.counter_copies {
            let copy = match &splicer.shared {
                Some(shared) => shared.read_heap(range.start + offset, len)?,
                None => splicer.read_heap(machine, range.start + offset, len)?,
            };
            for (sum, part) in bytes.chunks_exact_mut(8).zip(copy.chunks_exact(8)) {
                let total = u64::from_le_bytes(sum[..].try_into()?)
                    .wrapping_add(u64::from_le_bytes(part.try_into()?));
                sum.copy_from_slice(&total.to_le_bytes());
            }
        }
        // A function translated again after its text changed has two blocks per leader:
        // one count, their sum.
        let mut out: Vec<BlockCount> = Vec::new();
        let mut at: HashMap<(u64, u64), usize> = HashMap::new();
        for (b, (leader, count)) in self
            .translation
            .blocks
            .iter()
            .zip(self.translation.counts(&bytes))
        {
            if let Some(&i) = at.get(&(b.function, leader)) {
                out[i].count += count;
                continue;
            }
            at.insert((b.function, leader), out.len());
            out.push(BlockCount {
                function: self.names.get(&b.function).cloned().unwrap_or_default(),
                function_addr: b.function,
                leader,
                count,
                requested: self.requested.contains(&b.function),
            });
        }
        Ok(out)
    }

    /// Reads the counters, takes the entry splices out (text byte-identical), zeroes the
    /// lookup table and checks that nothing points into the cache any more (see the module
    /// documentation). Leaves the guest stopped.
    ///
    /// # Errors
    /// When the guest cannot be stopped, read or written, or the task list cannot be read.
    pub fn remove(
        self,
        session: &mut GuestSession,
        image: &KernelImage,
    ) -> anyhow::Result<JitRemoval> {
        session.pause()?;
        let mut counts = self.counts(session)?;
        if let Some(marked) = &self.marked {
            for b in &mut counts {
                let before = marked
                    .get(&(b.function_addr, b.leader))
                    .copied()
                    .unwrap_or(0);
                b.count = b.count.saturating_sub(before);
            }
        }
        // Every stub runs its `jmp` (to the original code, or a translation) from now on.
        for &stub in &self.armed {
            session.machine.set_breakpoint(stub, false)?;
        }
        let text = session.remove()?;
        let zeros = vec![0u8; self.translation.table.len()];
        {
            let (machine, splicer) = session.parts()?;
            match &splicer.shared {
                Some(shared) => shared.write_heap(self.translation.table_at, &zeros)?,
                None => splicer.write_heap(machine, self.translation.table_at, &zeros)?,
            }
        }
        let code =
            self.layout.code.start..self.translation.code_at + self.translation.code.len() as u64;
        let btf = image.btf()?;
        let tasks = TaskLayout::from_btf(btf)?;
        let stacks = KernelStacks::load_with(image, session.survey.kaslr.slide, Some(btf))?;
        let mut reach = Reachability::default();
        for check in 1..=REACH_CHECKS {
            reach = check_reachability(session, &code, &tasks, &stacks)?;
            reach.checks = check;
            if reach.unreachable() {
                break;
            }
            tracing::info!(
                "the code cache is still reachable ({} words); letting the guest run 100 ms",
                reach.found.len()
            );
            session.resume()?;
            std::thread::sleep(Duration::from_millis(100));
            session.pause()?;
        }
        Ok(JitRemoval {
            counts,
            text,
            reach,
        })
    }
}

/// Writes a link into the guest (stopped): the code over the backend's write path (QEMU
/// drops its translated blocks there), each table slot cache address first, then its
/// original address, through the shared RAM when there is one. Nothing runs the new code
/// before the stub's `jmp` is rewritten, which comes after.
fn write_link(
    machine: &mut dyn Machine,
    splicer: &super::splicer::Splicer,
    link: &Link,
) -> anyhow::Result<()> {
    if !link.code.is_empty() {
        splicer.write_heap(machine, link.code_at, &link.code)?;
    }
    for (at, slot) in &link.table {
        match &splicer.shared {
            Some(shared) => {
                shared.write_heap(at + 8, &slot[8..])?;
                shared.write_heap(*at, &slot[..8])?;
            }
            None => {
                splicer.write_heap(machine, at + 8, &slot[8..])?;
                splicer.write_heap(machine, *at, &slot[..8])?;
            }
        }
    }
    Ok(())
}

/// One look, with the guest stopped, for RIPs and return addresses inside `code`: every
/// vCPU's stack unwound from its registers, every other task's from its saved `thread.sp`,
/// with the image's ORC tables (what the kernel's own unwinder follows, interrupt frames
/// included). A raw scan of the stacks would also find dead words left below live frames
/// by the dispatch routine (it writes a cache address where `ret` pops it), which no
/// return ever uses.
fn check_reachability(
    session: &mut GuestSession,
    code: &Range<u64>,
    tasks: &TaskLayout,
    stacks: &KernelStacks,
) -> anyhow::Result<Reachability> {
    let survey = session.survey.clone();
    let machine: &mut dyn Machine = &mut *session.machine;
    let mut reach = Reachability::default();
    let look = |reach: &mut Reachability, what: String, bt: &exotap_introspect::orc::Backtrace| {
        reach.frames += bt.frames.len();
        for frame in &bt.frames {
            if code.contains(&frame.pc) {
                reach.found.push((what.clone(), frame.pc));
            }
        }
    };
    for vcpu in machine.vcpus()? {
        let regs = attach::x86_registers(machine, vcpu)?;
        let VcpuId(n) = vcpu;
        if code.contains(&regs.rip) {
            reach.found.push((format!("vCPU {n} RIP"), regs.rip));
        }
        if regs.in_kernel() {
            let mut mem = BackendMemory(&mut *machine);
            let mut space = survey.space(&mut mem);
            let mut cache = PageCache::new(&mut space);
            let bt = stacks.unwind_vcpu(&regs, &mut cache);
            look(&mut reach, format!("vCPU {n} stack"), &bt);
        }
    }
    let mut mem = BackendMemory(&mut *machine);
    let mut space = survey.space(&mut mem);
    let list = list_tasks(&mut space, survey.layout.init_task, tasks)?;
    reach.tasks = list.len();
    for task in list {
        if task.on_cpu {
            continue; // a vCPU's, unwound above
        }
        let mut cache = PageCache::new(&mut space);
        let bt = stacks.unwind_task(task.thread_sp, &mut cache);
        look(
            &mut reach,
            format!("task {} ({}) stack", task.pid, task.comm),
            &bt,
        );
    }
    Ok(reach)
}

/// Whether the function starting at `addr` may be called from the code cache with the
/// cache's return address ([`Translator::with_native_leaves`]): a function start `ok` admits
/// whose instructions neither call (directly or not) nor jump indirectly, whose bytes the
/// kernel never rewrites at run time (no jump label or static call), and whose tail jumps
/// go only to such functions (followed `depth` deep).
fn is_native_leaf(
    ctx: &crate::splice::SpliceContext<'_>,
    self_patched: &[std::ops::Range<u64>],
    ok: &impl Fn(u64) -> bool,
    addr: u64,
    depth: u32,
) -> bool {
    if !ok(addr) {
        return false;
    }
    let Some(f) = ctx.analysis.function_containing(addr) else {
        return false;
    };
    let (start, end) = (f.cfg.start(), f.cfg.end());
    if start != addr || self_patched.iter().any(|r| r.start < end && start < r.end) {
        return false;
    }
    f.cfg.insns().iter().all(|insn| match insn.flow {
        Flow::Next | Flow::Jump { .. } | Flow::CondJump { .. } | Flow::Return => true,
        Flow::TailJump { target } | Flow::CondTailJump { target } => {
            depth > 0 && is_native_leaf(ctx, self_patched, ok, target, depth - 1)
        }
        Flow::Call { .. } | Flow::IndirectCall | Flow::IndirectJump | Flow::Invalid => false,
    })
}
