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

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use exotap_introspect::btf::Btf;
use exotap_introspect::x86::{thunk_register, Flow};
use exotap_vmm::control::{Machine, StopEvent, VcpuId};

use super::attach;
use super::guest_memory::{read_kernel, BackendMemory};
use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::splicer::{Action, InstallReport, NotInstalled, RemoveReport, Request};
use super::stacks::{list_tasks, KernelStacks, PageCache, TaskLayout};
use crate::jit::{CacheLayout, ExitReason, Link, TranslateError, Translation, Translator};

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
    let btf = Btf::from_elf(image.vmlinux.bytes()).context("the kernel image has no BTF")?;
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
        let mut translator = Translator::new_owned(layout.clone(), facts.address_keyed.clone())?
            .with_thunks(thunks.clone());
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

    /// Lazy translation while the guest runs: takes the guest's stops at stubs (waiting
    /// `wait` for the first, then briefly for more, at most `budget` in all) and serves
    /// each ([`LiveJit::lazy_stop`]), then lets the guest run again. Nothing without lazy
    /// translation. Returns the stops served.
    ///
    /// # Errors
    /// When the guest is lost, or cannot be read, written or resumed.
    pub fn serve(
        &mut self,
        session: &mut GuestSession,
        image: &KernelImage,
        wait: Duration,
        budget: Duration,
    ) -> anyhow::Result<u64> {
        if !self.lazy.on || session.machine.is_paused() {
            return Ok(0);
        }
        let started = Instant::now();
        let mut served = 0;
        let mut timeout = wait;
        while started.elapsed() < budget {
            match session.wait(timeout)? {
                None | Some(StopEvent::Exited) => break,
                Some(event) => {
                    served += u64::from(self.on_stop(session, image, &event)?);
                }
            }
            timeout = Duration::from_millis(5);
        }
        Ok(served)
    }

    /// Serves one stop of the guest that someone else waited for: a breakpoint at an
    /// armed stub is a lazy-translation stop ([`LiveJit::lazy_stop`]). The guest resumes
    /// after any stop but its end; whether it was a lazy-translation stop.
    ///
    /// # Errors
    /// As [`LiveJit::serve`].
    pub fn on_stop(
        &mut self,
        session: &mut GuestSession,
        image: &KernelImage,
        event: &StopEvent,
    ) -> anyhow::Result<bool> {
        let served = match *event {
            StopEvent::Breakpoint { pc, .. } => {
                let stop = Instant::now();
                let ours = self.armed.contains(&pc);
                if ours {
                    if let Err(e) = self.lazy_stop(session, image, pc) {
                        // The stub's `jmp` is whole either way (to the original, or to a
                        // translation written before the failure): the guest goes on.
                        if session.machine.set_breakpoint(pc, false).is_ok() {
                            self.armed.remove(&pc);
                        }
                        session.resume()?;
                        return Err(e);
                    }
                } else {
                    self.lazy.other_stops += 1;
                }
                self.lazy.stopped += stop.elapsed();
                ours
            }
            // A stop nobody asked for (an interrupt the stub answered late): go on.
            StopEvent::Stepped { .. } | StopEvent::Paused => false,
            StopEvent::Exited => return Ok(false),
        };
        session.resume()?;
        Ok(served)
    }

    /// One lazy-translation stop (the guest stopped at the stub at `stub`): translates the
    /// stub's target from the session's text, appends it to the cache and writes its
    /// lookup-table slots, arms the stubs it brings, turns the stub into a `jmp` to the
    /// translation, takes the breakpoint out and splices the function's entry. A target
    /// that cannot be translated keeps its stub's `jmp` to the original code; a full cache
    /// takes every breakpoint out (from then on stubs run the original code).
    fn lazy_stop(
        &mut self,
        session: &mut GuestSession,
        image: &KernelImage,
        stub: u64,
    ) -> anyhow::Result<()> {
        self.lazy.stops += 1;
        let slide = session.survey.kaslr.slide;
        let Some(translator) = self.translator.as_mut() else {
            return Ok(());
        };
        let Some(target) = translator.stub_target(stub) else {
            return Ok(());
        };
        let name = name_of(image, slide, target);
        let (machine, splicer) = session.parts()?;
        let ctx = splicer.kernel.context();
        let function = ctx
            .analysis
            .function_containing(target)
            .filter(|f| f.cfg.start() == target);
        // The kernel may have changed the function since its text was read (a jump label it
        // flipped): what is there now is translated.
        let made = function.map(|f| {
            let (start, end) = (f.cfg.start(), f.cfg.end());
            let known = ctx.text.range(start, end).unwrap_or_default().to_vec();
            let mut now = vec![0u8; known.len()];
            let read = match (&splicer.shared, splicer.kernel.phys(start)) {
                (Some(shared), Some(phys)) => shared.read_phys(phys, &mut now).is_ok(),
                _ => machine.read_virt(VcpuId(0), start, &mut now).is_ok(),
            };
            if !read || now == known {
                let insns: Vec<u64> = f.cfg.insns().iter().map(|i| i.addr).collect();
                translator
                    .translate(ctx.text, f)
                    .map(|()| (start, end, known, insns))
            } else {
                self.lazy.changed_text += 1;
                let fresh = exotap_introspect::x86::FunctionAnalysis::analyze(
                    &now,
                    start,
                    &splicer.kernel.facts.config,
                );
                let insns: Vec<u64> = fresh.cfg.insns().iter().map(|i| i.addr).collect();
                match exotap_introspect::x86::CodeView::new(start, &now) {
                    Ok(view) => translator
                        .translate(view, &fresh)
                        .map(|()| (start, end, now.clone(), insns)),
                    Err(_) => Err(TranslateError::NoCode { start }),
                }
            }
        });
        let translated = match made {
            None => Err("no analysed function starts there".to_owned()),
            Some(made) => match made {
                Ok((start, end, bytes, insns)) => {
                    self.sources.push((start, end, bytes, insns));
                    self.source_bytes += end - start;
                    Ok(())
                }
                Err(e @ TranslateError::Full { .. }) => {
                    self.lazy.full = Some(format!("{e:#}"));
                    Err(format!("{e:#}"))
                }
                Err(e) => Err(format!("{e:#}")),
            },
        };
        let link = translator.link()?;
        let resolve = translator.resolve(target);
        write_link(machine, splicer, &link)?;
        for &(_, new_stub) in &link.stubs {
            if self.lazy.full.is_none() && machine.set_breakpoint(new_stub, true).is_ok() {
                self.armed.insert(new_stub);
            }
        }
        if let Some((at, jump)) = resolve {
            splicer.write_heap(machine, at, &jump)?;
            let off = usize::try_from(at - self.translation.code_at)?;
            if let Some(code) = self.translation.code.get_mut(off..off + jump.len()) {
                code.copy_from_slice(&jump);
            }
        }
        machine.set_breakpoint(stub, false)?;
        self.armed.remove(&stub);
        if self.lazy.full.is_some() {
            tracing::warn!(
                "the code cache is full: lazy translation stops, untranslated targets run their original code"
            );
            for armed in std::mem::take(&mut self.armed) {
                machine.set_breakpoint(armed, false)?;
            }
        }
        self.apply(&link);
        let entry = match translated {
            Ok(()) => link
                .functions
                .iter()
                .find(|f| f.start == target)
                .map(|f| f.entry),
            Err(why) => {
                tracing::info!("lazy translation of {name} refused: {why}");
                self.refused.push((name.clone(), why));
                None
            }
        };
        let Some(entry) = entry else {
            return Ok(());
        };
        self.lazy.translated += 1;
        tracing::info!(
            "lazy translation {}: {name} at {target:#x} ({} blocks)",
            self.lazy.stops,
            link.blocks.len()
        );
        self.names.insert(target, name.clone());
        // Without its entry splice the function is still entered from translated code.
        match session.install(&[Request {
            name: name.clone(),
            addr: target,
            action: Action::Enter(entry),
        }]) {
            Ok(report) => {
                if report.refused.is_empty() {
                    self.lazy.entries += 1;
                }
                self.entries.refused.extend(report.refused);
            }
            Err(e) => tracing::warn!("no entry splice for {name}, translated lazily: {e:#}"),
        }
        self.entries_installed = session.splicer().map_or(0, |s| s.installed.len());
        Ok(())
    }

    /// Adds a link's code, blocks, functions, exits, stubs and table slots to the host's
    /// copy of the translation.
    fn apply(&mut self, link: &Link) {
        let t = &mut self.translation;
        let end = t.code_at + t.code.len() as u64;
        if link.code_at == end {
            t.code.extend_from_slice(&link.code);
        }
        t.blocks.extend_from_slice(&link.blocks);
        for f in &link.functions {
            t.functions.insert(f.start, *f);
        }
        t.exits.extend_from_slice(&link.exits);
        t.counters = link.counters.clone();
        for &(target, stub) in &link.stubs {
            t.stubs.insert(target, stub);
        }
        self.lazy.stubs = t.stubs.len();
        for (at, bytes) in &link.table {
            let off = (at - t.table_at) as usize;
            if let Some(slot) = t.table.get_mut(off..off + 16) {
                slot.copy_from_slice(bytes);
            }
        }
        if let Some(tr) = &self.translator {
            t.table_entries = tr.table_entries();
        }
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

    /// Compares the translated functions' text with what the guest holds now (through the
    /// shared RAM, the guest running; at most every 100 ms; nothing without shared RAM) and
    /// invalidates every function whose text changed past its entry instruction (the entry
    /// holds exotap's own splice): it is translated again from the new text and its old
    /// block heads jump to the new translation (see the module documentation), or, past
    /// [`MAX_RETRANSLATIONS`], its block heads become jumps to the original leaders (the
    /// entry block's: the relocated entry instruction, then a jump past it) and its
    /// lookup-table entries map to the original addresses, so every path into the old
    /// translation continues in the kernel's current code. The guest is stopped for the
    /// writes.
    ///
    /// # Errors
    /// When guest memory cannot be read or written, or the guest stopped.
    pub fn watch(&mut self, session: &mut GuestSession) -> anyhow::Result<Vec<Invalidation>> {
        if self
            .watched
            .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return Ok(Vec::new());
        }
        self.watched = Some(Instant::now());
        let changed = {
            let (_, splicer) = session.parts()?;
            let Some(shared) = splicer.shared.clone() else {
                return Ok(Vec::new());
            };
            let mut changed = Vec::new();
            for (k, (start, end, bytes, insns)) in self.sources.iter().enumerate() {
                if self.given_up.contains(start) {
                    continue;
                }
                let skip = insns.get(1).map_or(bytes.len() as u64, |n| n - start) as usize;
                let Some(phys) = splicer.kernel.phys(*start) else {
                    continue;
                };
                let mut now = vec![0u8; usize::try_from(end - start)?];
                if shared.read_phys(phys, &mut now).is_err() {
                    continue;
                }
                if let Some(i) = (skip..bytes.len()).find(|&i| now.get(i) != bytes.get(i)) {
                    let mut text = now.clone();
                    // The entry instruction holds exotap's splice: its original bytes.
                    text[..skip].copy_from_slice(&bytes[..skip]);
                    changed.push((k, i, now[i], text));
                }
            }
            changed
        };
        if changed.is_empty() {
            return Ok(Vec::new());
        }
        session.pause()?;
        let mut done = Vec::new();
        for (k, i, now, text) in changed {
            let (start, _, bytes, insns) = self.sources[k].clone();
            let Some(f) = self.translation.functions.get(&start).copied() else {
                continue;
            };
            let mut inv = Invalidation {
                function: self.names.get(&start).cloned().unwrap_or_default(),
                start,
                at: start + i as u64,
                was: bytes[i],
                now,
                retranslated: false,
            };
            let entry_insn = bytes
                .get(..insns.get(1).map_or(bytes.len(), |n| (n - start) as usize))
                .unwrap_or_default()
                .to_vec();
            match self.invalidate(session, f.start, &entry_insn, &insns, k, &text) {
                Ok(Some(retranslated)) => {
                    self.pending.remove(&start);
                    inv.retranslated = retranslated;
                    tracing::info!(
                        "{} changed at {:#x} ({:02x} -> {:02x}): {}",
                        inv.function,
                        inv.at,
                        inv.was,
                        inv.now,
                        if retranslated {
                            "translated again from its new text"
                        } else {
                            "its translation is given up, it runs its original code"
                        }
                    );
                    self.invalidated.push(inv.clone());
                    done.push(inv);
                }
                Ok(None) => {
                    self.pending.insert(start);
                }
                Err(e) => return Err(e),
            }
        }
        session.resume()?;
        Ok(done)
    }

    /// Sends every way into one function's translation (the `k`th source) to a new
    /// translation of `text` (its current text, entry instruction as before the splice) or,
    /// past [`MAX_RETRANSLATIONS`] or when it cannot be translated, back to its original
    /// code (the guest stopped). `None` when a vCPU or an interrupted context is inside a
    /// block head that would be overwritten; else whether it was translated again.
    fn invalidate(
        &mut self,
        session: &mut GuestSession,
        start: u64,
        entry_insn: &[u8],
        insns: &[u64],
        k: usize,
        text: &[u8],
    ) -> anyhow::Result<Option<bool>> {
        // Every head so far (an earlier translation's included): all go to the new one.
        let heads: Vec<(u64, u64)> = self
            .translation
            .blocks
            .iter()
            .filter(|b| b.function == start)
            .map(|b| (b.cache, b.leader))
            .collect();
        // A vCPU stopped inside the first five bytes of a block head (after its `pushfq`)
        // would resume in the middle of the new jump.
        for vcpu in session.machine.vcpus()? {
            let regs = attach::x86_registers(&mut *session.machine, vcpu)?;
            if heads.iter().any(|&(c, _)| regs.rip > c && regs.rip < c + 5) {
                return Ok(None);
            }
        }
        let retranslated = self.retranslate(session, start, k, text)?;
        let new_code = |leader: u64| -> Option<u64> {
            let tr = self.translator.as_ref()?;
            retranslated.then(|| tr.cache_of(leader)).flatten()
        };
        let mut writes = Vec::new();
        for &(cache, leader) in &heads {
            let mut code = Vec::new();
            let mut at = cache;
            if let Some(to) = new_code(leader) {
                if to == cache {
                    continue; // a head of the new translation itself
                }
                let rel = i32::try_from(to.wrapping_sub(at + 5) as i64)
                    .context("a translation is out of rel32 reach of another")?;
                code.push(0xe9);
                code.extend_from_slice(&rel.to_le_bytes());
                writes.push((cache, code));
                continue;
            }
            if leader == start {
                let moved = crate::splice::reloc::relocate(
                    entry_insn,
                    start,
                    cache,
                    crate::splice::reloc::CallReturn::Patch,
                )
                .map_err(|e| anyhow::anyhow!("cannot relocate the entry instruction: {e}"))?;
                code.extend_from_slice(&moved.bytes);
                at += moved.bytes.len() as u64;
            }
            let resume = if leader == start {
                start + entry_insn.len() as u64
            } else {
                leader
            };
            let rel = i32::try_from(resume.wrapping_sub(at + 5) as i64)
                .context("the original code is out of rel32 reach of the cache")?;
            code.push(0xe9);
            code.extend_from_slice(&rel.to_le_bytes());
            writes.push((cache, code));
        }
        // Instructions the new translation has are in the table already (its link).
        let keys: BTreeSet<u64> = insns
            .iter()
            .copied()
            .filter(|&a| new_code(a).is_none())
            .collect();
        let mut table = self.translation.table.clone();
        for slot in table.chunks_exact_mut(16) {
            let key = u64::from_le_bytes(slot[..8].try_into().unwrap_or_default());
            if key != 0 && keys.contains(&key) {
                slot[8..].copy_from_slice(&key.to_le_bytes());
            }
        }
        let (machine, splicer) = session.parts()?;
        // The table first: a return into this function then already goes to the original.
        match &splicer.shared {
            Some(shared) => shared.write_heap(self.translation.table_at, &table)?,
            None => splicer.write_heap(machine, self.translation.table_at, &table)?,
        }
        for (at, code) in writes {
            splicer.write_heap(machine, at, &code)?;
        }
        self.translation.table = table;
        if !retranslated {
            self.given_up.insert(start);
        }
        Ok(Some(retranslated))
    }

    /// Translates the `k`th source function again from `text` (its current bytes) and
    /// writes the new translation into the cache, unless it was translated
    /// [`MAX_RETRANSLATIONS`] times already or cannot be (the cache full, text that does
    /// not analyse). Whether it was.
    fn retranslate(
        &mut self,
        session: &mut GuestSession,
        start: u64,
        k: usize,
        text: &[u8],
    ) -> anyhow::Result<bool> {
        let done = self.retranslations.get(&start).copied().unwrap_or(0);
        let Some(translator) = self.translator.as_mut() else {
            return Ok(false);
        };
        if done >= MAX_RETRANSLATIONS {
            return Ok(false);
        }
        let end = start + text.len() as u64;
        let (machine, splicer) = session.parts()?;
        let analysis = exotap_introspect::x86::FunctionAnalysis::analyze(
            text,
            start,
            &splicer.kernel.facts.config,
        );
        let view = exotap_introspect::x86::CodeView::new(start, text)
            .context("the function's new text")?;
        translator.forget(start, end);
        if let Err(e) = translator.translate(view, &analysis) {
            tracing::info!("cannot translate the function at {start:#x} again: {e:#}");
            return Ok(false);
        }
        let link = translator.link()?;
        write_link(machine, splicer, &link)?;
        for &(_, stub) in &link.stubs {
            if self.lazy.on
                && self.lazy.full.is_none()
                && machine.set_breakpoint(stub, true).is_ok()
            {
                self.armed.insert(stub);
            }
        }
        self.apply(&link);
        self.retranslations.insert(start, done + 1);
        if let Some(source) = self.sources.get_mut(k) {
            source.2 = text.to_vec();
            source.3 = analysis.cfg.insns().iter().map(|i| i.addr).collect();
        }
        Ok(true)
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
        let btf = Btf::from_elf(image.vmlinux.bytes()).context("the kernel image has no BTF")?;
        let tasks = TaskLayout::from_btf(&btf)?;
        let stacks = KernelStacks::load_with(image, session.survey.kaslr.slide, Some(&btf))?;
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

/// Per-CPU counter copies planned from the CPUs' per-CPU bases ([`per_cpu_copies`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct CounterCopies {
    /// Each CPU's copy, in bytes past the first (the lowest per-CPU base's), by CPU.
    offsets: Vec<u64>,
    /// Bytes of each copy.
    per_copy: u64,
    /// Bytes from the first copy's start to the last one's end.
    span: u64,
}

/// The most room per-CPU copies may take in the patch heap.
const MAX_COUNTER_SPAN: u64 = 16 << 20;

/// Lays out one copy of `counter_bytes` of counters per CPU, each CPU's copy as far from
/// the first as its per-CPU base is from the lowest (so one `gs` displacement reaches every
/// CPU's own copy). A copy is cut to the smallest distance between two bases, and to a
/// multiple of 4 KiB. `None` (one shared counter then) with one CPU, or when two CPUs
/// share a base, copies would have under 4 KiB, or they would take more than
/// [`MAX_COUNTER_SPAN`].
fn per_cpu_copies(per_cpu_offsets: &[u64], counter_bytes: u64) -> Option<CounterCopies> {
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
fn map_counter_alias(
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
        if let exotap_vmm::control::RegisterFile::X86_64(r) = machine.registers(vcpu)? {
            bases.push(r.kernel_percpu_base());
        }
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
