//! What the kernel image says about its text, and the live text and its analysis.

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use exotap_introspect::x86::{
    ranges_from_starts, thunk_register, zeroed_text, AnalysisConfig, BranchTargets, CallEffect,
    CodeView, TextAnalysis,
};
use exotap_vmm::control::Machine;

use crate::splice::{plan, Refusal, SpliceContext, SpliceDecision, TrapReason};

use crate::live::attach::Survey;
use crate::live::guest_memory::BackendMemory;
use crate::live::kernel_image::KernelImage;

use super::READ_CHUNK;

/// `endbr64`: the first instruction of every function an indirect branch may reach on a
/// kernel built with IBT.
pub const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
/// Whether `bytes` begin with `endbr64` or a 4-byte nop: what an IBT kernel writes over an
/// `endbr64` no indirect branch needs (it seals it), `nopl -0x2a(%rax)` (`0f 1f 40 d6`) in
/// earlier kernels, `osp nopl (%rax)` (`66 0f 1f 00`, seen at `vfs_read` in Debian's 6.12)
/// in later ones. Any 4-byte nop at a function's start is taken the same way: a probe
/// after it still sees every call. `exotap regress` places its entry patches by the same rule.
pub fn endbr_or_seal(bytes: &[u8]) -> bool {
    let Some(head) = bytes.get(..4) else {
        return false;
    };
    if head == ENDBR64 {
        return true;
    }
    let mut decoder = iced_x86::Decoder::new(64, head, iced_x86::DecoderOptions::NONE);
    let insn = decoder.decode();
    insn.len() == 4 && insn.mnemonic() == iced_x86::Mnemonic::Nop
}

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
    /// Where each jump label jumps when its key is on, sorted: a branch target whatever the
    /// key's state now (the kernel flips static keys at run time, under a splice too).
    pub jump_targets: Vec<u64>,
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
pub(super) fn relative(table_addr: u64, bytes: &[u8], offset: usize) -> Option<u64> {
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
        facts.starts.sort_unstable();
        facts.starts.dedup();
        facts.config = config;
        for (from, to) in [
            ("__entry_text_start", "__entry_text_end"),
            ("__noinstr_text_start", "__noinstr_text_end"),
        ] {
            facts
                .forbidden
                .push(s(image.address(from)?)..s(image.address(to)?));
        }
        // `__init` code: freed after boot, its pages poisoned and given back to the
        // allocator (what is there now is no code of this function).
        if let (Ok(from), Ok(to)) = (image.address("_sinittext"), image.address("_einittext")) {
            facts.forbidden.push(s(from)..s(to));
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
            facts.jump_targets.extend(relative(at, bytes, i + 4).map(s));
        }
        facts.jump_targets.sort_unstable();
        facts.jump_targets.dedup();
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

/// The running kernel's text, analysed, read from the guest as the plans need it.
///
/// Its branch targets come from the cache when an earlier attach found them for the same
/// build on a CPU with the same capabilities, whatever the KASLR slide (the splicer's
/// `targets_cache` module); then no byte of the text is read up front, and
/// [`LiveKernel::prepare`] reads the pages of the functions a plan touches (and checks the
/// targets inside each against the cached ones: a cache entry that does not belong to this
/// text is found out, and everything is read and found again).
/// Otherwise the whole text is read and analysed at once, and its targets kept for the next
/// attach.
pub struct LiveKernel {
    /// Facts from the image.
    pub facts: KernelFacts,
    /// Guest-physical address of the text's first byte (the text is contiguous).
    pub text_phys: u64,
    analysis: TextAnalysis,
    /// Which pages of the text have been read (every one once `whole`).
    loaded: Vec<bool>,
    whole: bool,
    /// The cache entry of the targets (where they are written again when found again).
    entry: Option<std::path::PathBuf>,
    /// Time to read the text (the whole of it, or the pages read so far).
    pub read_time: Duration,
    /// Time to find its branch targets, or read them from the cache.
    pub analysis_time: Duration,
    /// The text of the loaded modules probes go into ([`LiveKernel::add_module`]).
    modules: Vec<super::modules::ModuleText>,
}

impl std::fmt::Debug for LiveKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveKernel")
            .field("text", &self.facts.text)
            .field("functions", &self.analysis.function_count())
            .field("whole", &self.whole)
            .finish_non_exhaustive()
    }
}

/// Text pages (4 KiB) a plan reads one by one; past a quarter of the text it reads all of it
/// at once (one bulk read beats thousands of small ones).
const PAGE: u64 = 4096;

impl LiveKernel {
    /// Reads the live text of a stopped guest and analyses it, or, where the cache has this
    /// text's branch targets, reads nothing of it yet (see the type's doc).
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
        let len = usize::try_from(end - start)?;
        let ranges = ranges_from_starts(&facts.starts, end);
        let pages = len.div_ceil(PAGE as usize);
        let cpu = boot_cpu_caps(machine, survey, image);
        let build = image.vmlinux.build_id().map(<[u8]>::to_vec);
        let root = exotap_guest_images::cache::cache_root()
            .ok()
            .map(|r| r.join("analysis"));
        let entry = match (&root, &build, &cpu) {
            (Some(root), Some(build), Some(cpu)) => Some(super::targets_cache::entry(
                root,
                start,
                super::targets_cache::Identity::Build { build, cpu },
                &ranges,
                &facts.config,
            )),
            _ => None,
        };
        if let Some(entry) = &entry {
            let started = Instant::now();
            match super::targets_cache::load(entry, start) {
                Ok(targets) => {
                    let analysis = TextAnalysis::with_targets(
                        start,
                        zeroed_text(len),
                        &ranges,
                        &facts.config,
                        targets,
                    );
                    let analysis_time = started.elapsed();
                    tracing::info!(
                        "the branch targets of the {} functions of the live kernel text read \
                         from the cache ({}) in {:.3} s; its pages are read as plans need them",
                        analysis.function_count(),
                        entry.display(),
                        analysis_time.as_secs_f64()
                    );
                    return Ok(Self {
                        facts,
                        text_phys,
                        analysis,
                        loaded: vec![false; pages],
                        whole: false,
                        entry: Some(entry.clone()),
                        read_time: Duration::ZERO,
                        analysis_time,
                        modules: Vec::new(),
                    });
                }
                Err(e) if entry.exists() => tracing::warn!(
                    "the cached branch targets {} are unusable ({e:#}): finding them again",
                    entry.display()
                ),
                Err(_) => {}
            }
        }
        let mut kernel = Self {
            facts,
            text_phys,
            analysis: TextAnalysis::default(),
            loaded: vec![false; pages],
            whole: false,
            entry,
            read_time: Duration::ZERO,
            analysis_time: Duration::ZERO,
            modules: Vec::new(),
        };
        kernel.read_whole(machine, root.as_deref())?;
        Ok(kernel)
    }

    /// Reads the whole text, finds its branch targets (and adds the jump labels' targets)
    /// and keeps them in the cache: under the build's entry where there is one, else under
    /// one keyed by the text's bytes (a build without a build-id, a guest whose CPU state
    /// could not be read), which is then also read back here when it is there.
    fn read_whole(
        &mut self,
        machine: &mut dyn Machine,
        root: Option<&std::path::Path>,
    ) -> anyhow::Result<()> {
        let (start, end) = self.facts.text;
        let len = usize::try_from(end - start)?;
        let started = Instant::now();
        let bytes = match machine.read_phys_bulk(self.text_phys, len) {
            Some(bytes) => bytes,
            None => {
                let mut bytes = vec![0u8; len];
                for (i, chunk) in bytes.chunks_mut(READ_CHUNK).enumerate() {
                    let at = self.text_phys + (i * READ_CHUNK) as u64;
                    machine
                        .read_phys(at, chunk)
                        .with_context(|| format!("cannot read the kernel text at {at:#x}"))?;
                }
                bytes
            }
        };
        self.read_time += started.elapsed();
        let started = Instant::now();
        let view = CodeView::new(start, &bytes)?;
        let ranges = ranges_from_starts(&self.facts.starts, view.end());
        // Without the build's entry, one keyed by these very bytes.
        let text_keyed = self.entry.is_none();
        if text_keyed {
            self.entry = root.map(|root| {
                super::targets_cache::entry(
                    root,
                    start,
                    super::targets_cache::Identity::Text(&bytes),
                    &ranges,
                    &self.facts.config,
                )
            });
        }
        let cached = if text_keyed {
            self.entry
                .as_deref()
                .and_then(|e| super::targets_cache::load(e, start).ok())
        } else {
            None
        };
        let from_cache = cached.is_some();
        self.analysis = match cached {
            Some(targets) => {
                TextAnalysis::with_targets(start, bytes, &ranges, &self.facts.config, targets)
            }
            None => {
                let mut analysis =
                    TextAnalysis::analyze_owned(start, bytes, &ranges, &self.facts.config);
                analysis.add_targets(self.facts.jump_targets.iter().copied());
                if let Some(entry) = &self.entry {
                    // The text's own targets: those outside it (calls into ftrace
                    // trampolines, modules) change from boot to boot and are no plan's concern.
                    let inside = BranchTargets::new(
                        analysis
                            .branch_targets()
                            .as_slice()
                            .iter()
                            .copied()
                            .filter(|t| (start..end).contains(t))
                            .collect(),
                    );
                    match super::targets_cache::store(entry, start, &inside) {
                        Ok(()) => tracing::info!("the branch targets kept in {}", entry.display()),
                        Err(e) => tracing::debug!("the branch targets are not kept: {e:#}"),
                    }
                }
                analysis
            }
        };
        self.analysis_time += started.elapsed();
        self.loaded.iter_mut().for_each(|p| *p = true);
        self.whole = true;
        tracing::info!(
            "read {} KiB of live kernel text in {:.2} s ({:.1} MB/s); the branch targets of its {} functions {} in {:.3} s",
            len >> 10,
            self.read_time.as_secs_f64(),
            len as f64 / self.read_time.as_secs_f64().max(1e-9) / 1e6,
            self.analysis.function_count(),
            if from_cache { "read from the cache" } else { "found" },
            self.analysis_time.as_secs_f64()
        );
        Ok(())
    }

    /// Reads the whole text now (a plan that needs all of it: the JIT's walk over callees).
    ///
    /// # Errors
    /// When the text cannot be read.
    pub fn load_all(&mut self, machine: &mut dyn Machine) -> anyhow::Result<()> {
        if self.whole {
            return Ok(());
        }
        let root = self
            .entry
            .as_deref()
            .and_then(std::path::Path::parent)
            .map(std::path::Path::to_path_buf);
        self.read_whole(machine, root.as_deref())
    }

    /// Reads the pages of the functions that hold `addrs` (each function whole, and the
    /// 16 bytes after it that its last instruction may reach into), where they were not read
    /// yet, and checks each function's own branch targets against the cached ones. A target
    /// missing means the cache entry is not this text's: the whole text is read and its
    /// targets found again (and the entry rewritten). Past a quarter of the text, all of it
    /// is read at once.
    ///
    /// # Errors
    /// When guest memory cannot be read.
    pub fn prepare(&mut self, machine: &mut dyn Machine, addrs: &[u64]) -> anyhow::Result<()> {
        if self.whole {
            return Ok(());
        }
        let (start, end) = self.facts.text;
        let mut ranges: Vec<_> = addrs.iter().filter_map(|&a| self.range_of(a)).collect();
        ranges.sort_unstable();
        ranges.dedup();
        let mut wanted: Vec<usize> = Vec::new();
        for r in &ranges {
            let from = (r.start - start) / PAGE;
            let to = (r.end.saturating_add(16).min(end) - start).div_ceil(PAGE);
            wanted.extend((from..to).filter_map(|p| usize::try_from(p).ok()));
        }
        wanted.sort_unstable();
        wanted.dedup();
        wanted.retain(|&p| !self.loaded.get(p).copied().unwrap_or(true));
        if wanted.len() * 4 > self.loaded.len() {
            return self.load_all(machine);
        }
        let started = Instant::now();
        // Runs of consecutive pages, each read at once.
        let mut i = 0;
        while i < wanted.len() {
            let mut j = i + 1;
            while j < wanted.len() && wanted[j] == wanted[j - 1] + 1 {
                j += 1;
            }
            let first = wanted[i] as u64 * PAGE;
            let last = ((wanted[j - 1] as u64 + 1) * PAGE).min(end - start);
            let mut buf = vec![0u8; usize::try_from(last - first)?];
            machine
                .read_phys(self.text_phys + first, &mut buf)
                .with_context(|| format!("cannot read the kernel text at {:#x}", start + first))?;
            self.analysis.fill(start + first, &buf)?;
            for p in &wanted[i..j] {
                self.loaded[*p] = true;
            }
            i = j;
        }
        self.read_time += started.elapsed();
        if !wanted.is_empty() {
            tracing::debug!(
                "read {} page(s) of live kernel text for {} function(s) in {:.4} s",
                wanted.len(),
                ranges.len(),
                started.elapsed().as_secs_f64()
            );
        }
        for r in &ranges {
            let missing = self.analysis.targets_missing_from(r);
            if let Some(t) = missing.first() {
                tracing::warn!(
                    "the cached branch targets {} lack {t:#x} (one of {} of the function at \
                     {:#x}): they are not this text's; reading the whole text to find them again",
                    self.entry
                        .as_deref()
                        .map_or_else(String::new, |e| e.display().to_string()),
                    missing.len(),
                    r.start
                );
                if let Some(entry) = &self.entry {
                    let _ = std::fs::remove_file(entry);
                }
                return self.load_all(machine);
            }
        }
        Ok(())
    }

    /// Whether every byte of `[from, to)` has been read from the guest.
    fn is_loaded(&self, from: u64, to: u64) -> bool {
        if self.whole {
            return true;
        }
        let (start, end) = self.facts.text;
        if from < start || to > end || from >= to {
            return false;
        }
        let first = (from - start) / PAGE;
        let last = (to - 1 - start) / PAGE;
        (first..=last).all(|p| {
            usize::try_from(p)
                .ok()
                .and_then(|p| self.loaded.get(p))
                .copied()
                .unwrap_or(false)
        })
    }

    /// The range of the function holding `addr` (without analysing it).
    fn range_of(&self, addr: u64) -> Option<exotap_introspect::x86::FunctionRange> {
        let all = self.analysis.ranges();
        all.partition_point(|r| r.start <= addr)
            .checked_sub(1)
            .and_then(|i| all.get(i))
            .filter(|r| r.contains(addr))
            .copied()
    }

    /// The planner's context.
    pub fn context(&self) -> SpliceContext<'_> {
        SpliceContext {
            text: CodeView::new(self.facts.text.0, self.analysis.bytes())
                .unwrap_or_else(|_| CodeView::new(0, &[]).unwrap_or_else(|_| unreachable!())),
            analysis: &self.analysis,
            forbidden: &self.facts.forbidden,
            self_patched: &self.facts.self_patched,
            address_keyed: &self.facts.address_keyed,
        }
    }

    /// Reads a loaded module's text and tables (the guest stopped), so that splices can go
    /// into it; a module added before is kept as it was read.
    ///
    /// # Errors
    /// As [`super::modules::ModuleText::read`].
    pub fn add_module(
        &mut self,
        machine: &mut dyn Machine,
        survey: &Survey,
        module: &crate::live::modules::GuestModule,
        tables: &super::modules::ModuleTables,
    ) -> anyhow::Result<()> {
        if self.modules.iter().any(|m| m.text == module.text) {
            return Ok(());
        }
        let started = Instant::now();
        let text =
            super::modules::ModuleText::read(machine, survey, module, tables, &self.facts.config)?;
        tracing::info!(
            "read the {} KiB of module {}'s text at {:#x} and its tables in {:.3} s",
            (text.text.end - text.text.start) >> 10,
            text.name,
            text.text.start,
            started.elapsed().as_secs_f64()
        );
        self.modules.push(text);
        Ok(())
    }

    /// Forgets the module whose text is `range` (it is being freed).
    pub fn forget_module(&mut self, range: &Range<u64>) {
        self.modules.retain(|m| m.text != *range);
    }

    /// The module whose text holds `addr`, of those added.
    fn module_of(&self, addr: u64) -> Option<&super::modules::ModuleText> {
        self.modules.iter().find(|m| m.contains(addr))
    }

    /// Plans a splice at `addr` for a patch at `patch`: refused where the function there has
    /// not been read ([`LiveKernel::prepare`] first). In a module's text too; there a splice
    /// whose bytes would cross into a page not physically after the first is refused (the
    /// journal and the writes keep a splice as one physical range).
    pub fn plan(&self, addr: u64, patch: u64) -> SpliceDecision {
        if let Some(m) = self.module_of(addr) {
            let decision = plan(&m.context(), addr, patch);
            if let SpliceDecision::Splice(site) = &decision {
                if !self.contiguous(addr, site.bytes.len().max(5) as u64) {
                    return SpliceDecision::Refuse(Refusal::SplitPages { addr });
                }
            }
            return decision;
        }
        if let Some(r) = self.range_of(addr) {
            if !self.is_loaded(r.start, r.end) {
                return SpliceDecision::Refuse(Refusal::TextNotRead { addr });
            }
        }
        plan(&self.context(), addr, patch)
    }

    /// Where a probe of the function starting at `addr` goes: past the `endbr64` an IBT
    /// kernel (`CONFIG_X86_KERNEL_IBT`) begins its functions with, or past the 4-byte nop the
    /// kernel seals an unneeded one with. There the ftrace site sits, as it does at the entry
    /// itself on a kernel built without IBT; a jmp over the `endbr64` would also leave an
    /// indirect call landing on a jmp, which IBT faults. Read from the live text, not from
    /// the kernel's configuration; `addr` itself where it is not a function's start or
    /// begins with anything else.
    ///
    /// # Errors
    /// When the function's first bytes have not been read ([`LiveKernel::prepare`] first).
    pub fn entry(&self, addr: u64) -> anyhow::Result<u64> {
        if let Some(m) = self.module_of(addr) {
            return Ok(match m.bytes_at(addr) {
                Some(b) if m.starts.binary_search(&addr).is_ok() && endbr_or_seal(b) => addr + 4,
                _ => addr,
            });
        }
        if self.facts.starts.binary_search(&addr).is_err() {
            return Ok(addr);
        }
        if !self.is_loaded(addr, (addr + 4).min(self.facts.text.1)) {
            bail!("the kernel text at {addr:#x} has not been read from the guest");
        }
        let at = usize::try_from(addr.wrapping_sub(self.facts.text.0)).unwrap_or(usize::MAX);
        Ok(match self.analysis.bytes().get(at..) {
            Some(b) if endbr_or_seal(b) => addr + 4,
            _ => addr,
        })
    }

    /// Guest-physical address of a text address.
    pub fn phys(&self, va: u64) -> Option<u64> {
        if va >= self.facts.text.0 && va < self.facts.text.1 {
            return Some(self.text_phys + (va - self.facts.text.0));
        }
        self.module_of(va).and_then(|m| m.phys(va))
    }

    /// Whether `[va, va + len)` is one physically contiguous run of text (always in the
    /// kernel's own text; in a module's only where its pages happen to be adjacent).
    pub fn contiguous(&self, va: u64, len: u64) -> bool {
        let Some(first) = self.phys(va) else {
            return false;
        };
        let last = va + len.max(1) - 1;
        let mut page = va & !(PAGE - 1);
        while page <= last {
            let at = page.max(va);
            if self.phys(at) != Some(first + (at - va)) {
                return false;
            }
            page += PAGE;
        }
        true
    }
}

/// The guest's boot-time CPU capabilities: `boot_cpu_data.x86_capability` (its feature and
/// bug words), which decide the alternatives, retpolines and returns the kernel patched into
/// its text at boot; where the member is and how long it is from the image's BTF. `None`
/// where the kernel has no such symbol or member, or it cannot be read.
fn boot_cpu_caps(
    machine: &mut dyn Machine,
    survey: &Survey,
    image: &KernelImage,
) -> Option<Vec<u8>> {
    let btf = image.btf().ok()?;
    let member = btf.struct_member("cpuinfo_x86", "x86_capability").ok()?;
    let offset = member.byte_offset()?;
    let len = usize::try_from(btf.size_of(member.ty)?.min(PAGE)).ok()?;
    let at = image
        .symbols
        .get("boot_cpu_data")?
        .addr
        .wrapping_add(survey.kaslr.slide)
        .wrapping_add(offset);
    let mut bytes = vec![0u8; len];
    survey
        .space(&mut BackendMemory(machine))
        .read(at, &mut bytes)
        .ok()?;
    Some(bytes)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The seal of earlier kernels (`nopl -0x2a(%rax)`).
    const ENDBR_POISON: [u8; 4] = [0x0f, 0x1f, 0x40, 0xd6];

    /// A text of five 16-byte functions: `endbr64` then the ftrace nop; the nop alone (a
    /// kernel without IBT); the sealed `endbr64` then the nop; one beginning with four 1-byte
    /// nops whose `endbr64` bytes sit inside it, not at its start; the later seal.
    fn ibt_text() -> LiveKernel {
        const BASE: u64 = 0xffff_ffff_8100_0000;
        const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];
        let mut bytes = Vec::new();
        for prefix in [
            &ENDBR64[..],
            &[],
            &ENDBR_POISON[..],
            &[0x90; 4][..],
            &[0x66, 0x0f, 0x1f, 0x00][..],
        ] {
            let mut f = prefix.to_vec();
            f.extend_from_slice(&NOP5);
            if prefix == [0x90; 4] {
                f.extend_from_slice(&ENDBR64);
            }
            f.push(0xc3);
            f.resize(16, 0xcc);
            bytes.extend_from_slice(&f);
        }
        let starts: Vec<u64> = (0..5).map(|i| BASE + 16 * i).collect();
        let view = CodeView::new(BASE, &bytes).unwrap();
        let ranges = ranges_from_starts(&starts, view.end());
        let config = AnalysisConfig::new();
        let analysis = TextAnalysis::analyze(view, &ranges, &config);
        LiveKernel {
            facts: KernelFacts {
                text: (BASE, BASE + bytes.len() as u64),
                starts,
                ..KernelFacts::default()
            },
            text_phys: 0x100_0000,
            analysis,
            modules: Vec::new(),
            loaded: vec![true],
            whole: true,
            entry: None,
            read_time: Duration::ZERO,
            analysis_time: Duration::ZERO,
        }
    }

    #[test]
    fn a_function_probe_goes_past_an_endbr64_or_its_seal_and_nowhere_else() {
        let k = ibt_text();
        let f = |i: u64| k.facts.text.0 + 16 * i;

        let entry = |a| k.entry(a).unwrap();

        assert_eq!(entry(f(0)), f(0) + 4);
        assert_eq!(entry(f(1)), f(1));
        assert_eq!(entry(f(2)), f(2) + 4);
        assert_eq!(entry(f(3)), f(3));
        assert_eq!(entry(f(4)), f(4) + 4);
        // Not a function's start: as asked, even where endbr64's bytes are.
        assert_eq!(entry(f(3) + 9), f(3) + 9);
        assert_eq!(entry(f(0) + 4), f(0) + 4);
        // Past the text's end: as asked.
        assert_eq!(entry(f(5)), f(5));
    }

    #[test]
    fn the_splice_past_an_endbr64_lands_on_the_ftrace_nop() {
        let k = ibt_text();
        let at = k.entry(k.facts.text.0).unwrap();
        match k.plan(at, 0xffff_ffff_c000_0000) {
            SpliceDecision::Splice(site) => {
                assert_eq!(site.addr, at);
                assert_eq!(site.bytes[..5], [0x0f, 0x1f, 0x44, 0x00, 0x00]);
            }
            other => panic!("no splice past the endbr64: {other:?}"),
        }
    }

    /// Guest-physical memory holding a text at [`TEXT_PHYS`], counting the pages read.
    struct TextRam {
        text: Vec<u8>,
        pages_read: usize,
    }

    const TEXT_PHYS: u64 = 0x200_0000;
    const LAZY_BASE: u64 = 0xffff_ffff_8100_0000;

    impl Machine for TextRam {
        fn vcpus(&mut self) -> Result<Vec<exotap_vmm::control::VcpuId>, ControlError> {
            Ok(vec![exotap_vmm::control::VcpuId(0)])
        }
        fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
            let len = buf.len();
            let bad = || ControlError::Memory {
                addr,
                len,
                space: "physical",
            };
            let from =
                usize::try_from(addr.checked_sub(TEXT_PHYS).ok_or_else(bad)?).map_err(|_| bad())?;
            let src = self.text.get(from..from + len).ok_or_else(bad)?;
            buf.copy_from_slice(src);
            self.pages_read += buf.len().div_ceil(4096);
            Ok(())
        }
        fn write_phys(&mut self, _: u64, _: &[u8]) -> Result<(), ControlError> {
            Err(unsupported("write"))
        }
        fn read_virt(
            &mut self,
            _: exotap_vmm::control::VcpuId,
            _: u64,
            _: &mut [u8],
        ) -> Result<(), ControlError> {
            Err(unsupported("read_virt"))
        }
        fn write_virt(
            &mut self,
            _: exotap_vmm::control::VcpuId,
            _: u64,
            _: &[u8],
        ) -> Result<(), ControlError> {
            Err(unsupported("write_virt"))
        }
        fn registers(
            &mut self,
            _: exotap_vmm::control::VcpuId,
        ) -> Result<exotap_vmm::control::RegisterFile, ControlError> {
            Err(unsupported("registers"))
        }
        fn set_pc(&mut self, _: exotap_vmm::control::VcpuId, _: u64) -> Result<(), ControlError> {
            Err(unsupported("set_pc"))
        }
        fn pause(&mut self) -> Result<(), ControlError> {
            Ok(())
        }
        fn resume(&mut self) -> Result<(), ControlError> {
            Ok(())
        }
        fn is_paused(&self) -> bool {
            true
        }
        fn set_breakpoint(&mut self, _: u64, _: bool) -> Result<(), ControlError> {
            Err(unsupported("breakpoints"))
        }
        fn wait_event(
            &mut self,
            _: Duration,
        ) -> Result<Option<exotap_vmm::control::StopEvent>, ControlError> {
            Ok(None)
        }
        fn step(
            &mut self,
            _: exotap_vmm::control::VcpuId,
        ) -> Result<exotap_vmm::control::StopEvent, ControlError> {
            Err(unsupported("step"))
        }
    }

    fn unsupported(what: &'static str) -> ControlError {
        ControlError::Unsupported {
            backend: "test",
            what,
        }
    }

    /// The 5-byte nop.
    const NOP5: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];

    /// Eight functions of 0x1800 bytes (each straddles page boundaries): `endbr64`, twenty
    /// 5-byte nops closed by a `jnz` back to the second (at +9), a `jmp` forward to +0x1000,
    /// 5-byte nops up to there (the first at +0x6f), a nop, `ret`, int3 padding.
    fn lazy_text() -> (Vec<u8>, Vec<u64>) {
        const SIZE: usize = 0x1800;
        let mut text = Vec::new();
        let mut starts = Vec::new();
        for i in 0..8u64 {
            starts.push(LAZY_BASE + i * SIZE as u64);
            let mut f = ENDBR64.to_vec();
            for _ in 0..20 {
                f.extend_from_slice(&NOP5);
            }
            // jnz rel8 back to +9.
            let next = f.len() as i64 + 2;
            f.extend_from_slice(&[0x75, (9 - next) as i8 as u8]);
            // jmp rel32 to +0x1000.
            let next = f.len() as i32 + 5;
            f.push(0xe9);
            f.extend_from_slice(&(0x1000 - next).to_le_bytes());
            while f.len() + 5 <= 0x1000 {
                f.extend_from_slice(&NOP5);
            }
            f.resize(0x1000, 0x90);
            f.push(0x90);
            f.push(0xc3);
            f.resize(SIZE, 0xcc);
            text.extend_from_slice(&f);
        }
        (text, starts)
    }

    /// A kernel over `text` as [`LiveKernel::read`] makes it on a cache hit: nothing read,
    /// `targets` from the cache entry `entry`.
    fn lazy_kernel(
        text: &[u8],
        starts: &[u64],
        targets: BranchTargets,
        entry: std::path::PathBuf,
    ) -> LiveKernel {
        let end = LAZY_BASE + text.len() as u64;
        let ranges = ranges_from_starts(starts, end);
        let config = AnalysisConfig::new();
        LiveKernel {
            facts: KernelFacts {
                text: (LAZY_BASE, end),
                starts: starts.to_vec(),
                config: config.clone(),
                ..KernelFacts::default()
            },
            text_phys: TEXT_PHYS,
            modules: Vec::new(),
            analysis: TextAnalysis::with_targets(
                LAZY_BASE,
                zeroed_text(text.len()),
                &ranges,
                &config,
                targets,
            ),
            loaded: vec![false; text.len().div_ceil(4096)],
            whole: false,
            entry: Some(entry),
            read_time: Duration::ZERO,
            analysis_time: Duration::ZERO,
        }
    }

    /// The targets of the whole of `text`, as the cold path finds them.
    fn all_targets(text: &[u8], starts: &[u64]) -> BranchTargets {
        let view = CodeView::new(LAZY_BASE, text).unwrap();
        let ranges = ranges_from_starts(starts, view.end());
        TextAnalysis::analyze(view, &ranges, &AnalysisConfig::new())
            .branch_targets()
            .clone()
    }

    use exotap_vmm::control::ControlError;

    #[test]
    fn with_cached_targets_only_the_pages_of_the_planned_functions_are_read_and_plans_equal_a_whole_read(
    ) {
        let (text, starts) = lazy_text();
        let dir = tempfile::tempdir().unwrap();
        let mut k = lazy_kernel(
            &text,
            &starts,
            all_targets(&text, &starts),
            dir.path().join("x.targets"),
        );
        let mut ram = TextRam {
            text: text.clone(),
            pages_read: 0,
        };
        let f3 = starts[3];

        // Before its text is read, nothing is planned over zeros.
        assert!(matches!(
            k.plan(f3 + 4, 0xffff_ffff_c000_0000),
            SpliceDecision::Refuse(Refusal::TextNotRead { .. })
        ));
        assert!(k.entry(f3).is_err());

        k.prepare(&mut ram, &[f3 + 0x10]).unwrap();
        // Function 3 is 0x4800..0x6000 of the text: pages 4 and 5 (the 16 bytes after it
        // reach into page 6).
        assert_eq!(ram.pages_read, 3, "pages read for one function");
        assert!(!k.whole);
        let mut whole = lazy_kernel(
            &text,
            &starts,
            all_targets(&text, &starts),
            dir.path().join("y.targets"),
        );
        whole.load_all(&mut ram).unwrap();
        assert!(whole.whole);
        assert_eq!(k.entry(f3).unwrap(), f3 + 4);
        for at in [f3 + 4, f3 + 9, f3 + 0x68, f3 + 0x6a, f3 + 0x6f, f3 + 0x1000] {
            let lazy = format!("{:?}", k.plan(at, 0xffff_ffff_c000_0000));
            let full = format!("{:?}", whole.plan(at, 0xffff_ffff_c000_0000));
            assert_eq!(lazy, full, "plan at {at:#x}");
        }
        assert!(matches!(
            k.plan(f3 + 4, 0xffff_ffff_c000_0000),
            SpliceDecision::Splice(_)
        ));
        // The next function, 0x6000..0x7800: page 6 was read with function 3 (the bytes past
        // its end), so only page 7.
        let before = ram.pages_read;
        k.prepare(&mut ram, &[starts[4]]).unwrap();
        assert_eq!(ram.pages_read - before, 1);
        // Unread functions are still refused.
        assert!(matches!(
            k.plan(starts[0] + 4, 0xffff_ffff_c000_0000),
            SpliceDecision::Refuse(Refusal::TextNotRead { .. })
        ));
    }

    #[test]
    fn a_cached_entry_that_lacks_a_target_of_a_planned_function_is_found_out_and_replaced() {
        let (text, starts) = lazy_text();
        let dir = tempfile::tempdir().unwrap();
        let entry = dir.path().join("k.targets");
        let good = all_targets(&text, &starts);
        // Another text's targets: function 5's loop target is not among them.
        let lacking: Vec<u64> = good
            .as_slice()
            .iter()
            .copied()
            .filter(|&t| t != starts[5] + 9)
            .collect();
        let stale = BranchTargets::from_sorted(lacking).unwrap();
        super::super::targets_cache::store(&entry, LAZY_BASE, &stale).unwrap();
        let mut k = lazy_kernel(&text, &starts, stale, entry.clone());
        let mut ram = TextRam {
            text: text.clone(),
            pages_read: 0,
        };

        // Function 2 does not show it: its targets are all there.
        k.prepare(&mut ram, &[starts[2]]).unwrap();
        assert!(!k.whole);
        // Function 5 does: the whole text is read and its targets found again.
        k.prepare(&mut ram, &[starts[5]]).unwrap();
        assert!(k.whole, "the stale entry was trusted");
        assert!(k.analysis.branch_targets().contains(starts[5] + 9));
        assert_eq!(
            super::super::targets_cache::load(&entry, LAZY_BASE).unwrap(),
            good,
            "the entry was not written again with the text's own targets"
        );
    }

    #[test]
    fn jump_label_targets_are_targets_whatever_their_keys_state() {
        let (text, starts) = lazy_text();
        let dir = tempfile::tempdir().unwrap();
        let mut k = lazy_kernel(
            &text,
            &starts,
            BranchTargets::default(),
            dir.path().join("j.targets"),
        );
        // A jump label (off: its site a nop) whose target the text does not show: here two
        // bytes into the 5-byte nop at +0x169, so that the planner's refusal shows it sees it.
        let label_target = starts[6] + 0x169 + 2;
        k.facts.jump_targets = vec![label_target];
        let mut ram = TextRam {
            text,
            pages_read: 0,
        };
        k.load_all(&mut ram).unwrap();

        assert!(k.analysis.branch_targets().contains(label_target));
        assert!(matches!(
            k.plan(starts[6] + 0x169, 0xffff_ffff_c000_0000),
            SpliceDecision::Refuse(Refusal::BranchIntoInstruction { target, .. }) if target == label_target
        ));
        assert!(matches!(
            k.plan(starts[7] + 0x169, 0xffff_ffff_c000_0000),
            SpliceDecision::Splice(_)
        ));
    }

    #[test]
    fn relative_table_fields_resolve_against_their_own_address() {
        let bytes = [0xf0, 0xff, 0xff, 0xff, 0x10, 0, 0, 0];

        assert_eq!(relative(0x1000, &bytes, 0), Some(0x1000 - 0x10));
        assert_eq!(relative(0x1000, &bytes, 4), Some(0x1014));
        assert_eq!(relative(0x1000, &bytes, 6), None);
    }
}
