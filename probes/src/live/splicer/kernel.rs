//! What the kernel image says about its text, and the live text and its analysis.

use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use exotap_introspect::x86::{
    ranges_from_starts, thunk_register, AnalysisConfig, CallEffect, CodeView, TextAnalysis,
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
/// after it still sees every call.
fn endbr_or_seal(bytes: &[u8]) -> bool {
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
    bytes: std::sync::Arc<[u8]>,
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
            .field("functions", &self.analysis.function_count())
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
        let bytes: std::sync::Arc<[u8]> = bytes.into();
        let view = CodeView::new(start, &bytes)?;
        let ranges = ranges_from_starts(&facts.starts, view.end());
        let (analysis, cached) = analyze(start, &bytes, &ranges, &facts.config);
        let analysis_time = started.elapsed();
        tracing::info!(
            "read {} KiB of live kernel text in {:.2} s ({:.1} MB/s); the branch targets of its {} functions {} in {:.3} s",
            bytes.len() >> 10,
            read_time.as_secs_f64(),
            bytes.len() as f64 / read_time.as_secs_f64().max(1e-9) / 1e6,
            analysis.function_count(),
            if cached { "read from the cache" } else { "found" },
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

    /// Where a probe of the function starting at `addr` goes: past the `endbr64` an IBT
    /// kernel (`CONFIG_X86_KERNEL_IBT`) begins its functions with, or past the 4-byte nop the
    /// kernel seals an unneeded one with. There the ftrace site sits, as it does at the entry
    /// itself on a kernel built without IBT; a jmp over the `endbr64` would also leave an
    /// indirect call landing on a jmp, which IBT faults. Read from the live text, not from
    /// the kernel's configuration; `addr` itself where it is not a function's start or
    /// begins with anything else.
    pub fn entry(&self, addr: u64) -> u64 {
        if self.facts.starts.binary_search(&addr).is_err() {
            return addr;
        }
        let at = usize::try_from(addr.wrapping_sub(self.facts.text.0)).unwrap_or(usize::MAX);
        match self.bytes.get(at..) {
            Some(b) if endbr_or_seal(b) => addr + 4,
            _ => addr,
        }
    }

    /// Guest-physical address of a text address.
    pub fn phys(&self, va: u64) -> Option<u64> {
        (va >= self.facts.text.0 && va < self.facts.text.1)
            .then(|| self.text_phys + (va - self.facts.text.0))
    }
}

/// The analysis of the live text `bytes` at `base`, its branch targets read from the cache
/// when an earlier run found them for this very text ([`super::targets_cache`]), else found
/// and stored there; and whether they came from the cache. Without a usable cache they are
/// found every time.
fn analyze(
    base: u64,
    bytes: &std::sync::Arc<[u8]>,
    ranges: &[exotap_introspect::x86::FunctionRange],
    config: &AnalysisConfig,
) -> (TextAnalysis, bool) {
    let shared = std::sync::Arc::clone(bytes);
    let Ok(root) = exotap_guest_images::cache::cache_root() else {
        return (
            TextAnalysis::analyze_shared(base, shared, ranges, config),
            false,
        );
    };
    let entry = super::targets_cache::entry(&root.join("analysis"), base, bytes, ranges, config);
    match super::targets_cache::load(&entry) {
        Ok(targets) => {
            return (
                TextAnalysis::with_targets(base, shared, ranges, config, targets),
                true,
            );
        }
        Err(e) if entry.exists() => {
            tracing::warn!(
                "the cached branch targets {} are unusable ({e:#}): finding them again",
                entry.display()
            );
        }
        Err(_) => {}
    }
    let analysis = TextAnalysis::analyze_shared(base, shared, ranges, config);
    if let Err(e) = super::targets_cache::store(&entry, analysis.branch_targets()) {
        tracing::debug!("the branch targets are not kept: {e:#}");
    }
    (analysis, false)
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
            bytes: bytes.into(),
            analysis,
            read_time: Duration::ZERO,
            analysis_time: Duration::ZERO,
        }
    }

    #[test]
    fn a_function_probe_goes_past_an_endbr64_or_its_seal_and_nowhere_else() {
        let k = ibt_text();
        let f = |i: u64| k.facts.text.0 + 16 * i;

        assert_eq!(k.entry(f(0)), f(0) + 4);
        assert_eq!(k.entry(f(1)), f(1));
        assert_eq!(k.entry(f(2)), f(2) + 4);
        assert_eq!(k.entry(f(3)), f(3));
        assert_eq!(k.entry(f(4)), f(4) + 4);
        // Not a function's start: as asked, even where endbr64's bytes are.
        assert_eq!(k.entry(f(3) + 9), f(3) + 9);
        assert_eq!(k.entry(f(0) + 4), f(0) + 4);
        // Past the text's end: as asked.
        assert_eq!(k.entry(f(5)), f(5));
    }

    #[test]
    fn the_splice_past_an_endbr64_lands_on_the_ftrace_nop() {
        let k = ibt_text();
        let at = k.entry(k.facts.text.0);
        match k.plan(at, 0xffff_ffff_c000_0000) {
            SpliceDecision::Splice(site) => {
                assert_eq!(site.addr, at);
                assert_eq!(site.bytes[..5], [0x0f, 0x1f, 0x44, 0x00, 0x00]);
            }
            other => panic!("no splice past the endbr64: {other:?}"),
        }
    }

    #[test]
    fn relative_table_fields_resolve_against_their_own_address() {
        let bytes = [0xf0, 0xff, 0xff, 0xff, 0x10, 0, 0, 0];

        assert_eq!(relative(0x1000, &bytes, 0), Some(0x1000 - 0x10));
        assert_eq!(relative(0x1000, &bytes, 4), Some(0x1014));
        assert_eq!(relative(0x1000, &bytes, 6), None);
    }
}
