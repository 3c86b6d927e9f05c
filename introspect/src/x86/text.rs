//! Whole-text analysis: the set of all direct branch targets, and every function's CFG and
//! liveness as it is first asked for.
//!
//! Function ranges come from the caller (kallsyms, ELF symbols, System.map): this module
//! does not care where. Ranges are guest data, so bad ones are set aside, not trusted.

use std::sync::OnceLock;

use rayon::prelude::*;

use super::cfg::Cfg;
use super::decode::{AnalysisConfig, FunctionDecoder, Insn};
use super::liveness::Liveness;
use super::regs::LiveState;

/// Errors of whole-text analysis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TextError {
    /// The text would run past the top of the address space.
    #[error("text of {len} bytes at {base:#x} runs past the end of the address space")]
    AddressOverflow {
        /// The text's first address.
        base: u64,
        /// Its length.
        len: usize,
    },
    /// A function range is empty, reversed, or not inside the text.
    #[error("function range {start:#x}..{end:#x} is empty or not inside the text")]
    RangeOutsideText {
        /// The range's start.
        start: u64,
        /// The range's end.
        end: u64,
    },
    /// A function range starts inside the previous one.
    #[error("function range {start:#x}..{end:#x} overlaps the function before it")]
    RangeOverlaps {
        /// The range's start.
        start: u64,
        /// The range's end.
        end: u64,
    },
}

/// Code bytes and the virtual address of the first one.
#[derive(Clone, Copy, Debug)]
pub struct CodeView<'a> {
    base: u64,
    bytes: &'a [u8],
}

impl<'a> CodeView<'a> {
    /// A view of `bytes` mapped at `base`.
    ///
    /// # Errors
    /// [`TextError::AddressOverflow`] if `base + bytes.len()` does not fit in 64 bits.
    pub fn new(base: u64, bytes: &'a [u8]) -> Result<Self, TextError> {
        let len = bytes.len();
        u64::try_from(len)
            .ok()
            .and_then(|l| base.checked_add(l))
            .ok_or(TextError::AddressOverflow { base, len })?;
        Ok(Self { base, bytes })
    }

    /// The first address.
    #[must_use]
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The address just past the last byte.
    #[must_use]
    pub fn end(&self) -> u64 {
        // Checked in `new`.
        self.base.wrapping_add(self.bytes.len() as u64)
    }

    /// All bytes.
    #[must_use]
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The bytes of `[start, end)`, if that range is non-empty and inside the view.
    #[must_use]
    pub fn range(&self, start: u64, end: u64) -> Option<&'a [u8]> {
        if start < self.base || end <= start || end > self.end() {
            return None;
        }
        let from = usize::try_from(start - self.base).ok()?;
        let to = usize::try_from(end - self.base).ok()?;
        self.bytes.get(from..to)
    }
}

/// A function's address range `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FunctionRange {
    /// First address.
    pub start: u64,
    /// Address just past the function (for symbol tables without sizes: the next symbol).
    pub end: u64,
}

impl FunctionRange {
    /// Whether `addr` is inside the range.
    #[must_use]
    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.start && addr < self.end
    }
}

/// Ranges from sorted-or-not function start addresses, each ending where the next
/// starts; the last ends at `text_end`. Duplicates and starts at or past `text_end` are
/// dropped.
#[must_use]
pub fn ranges_from_starts(starts: &[u64], text_end: u64) -> Vec<FunctionRange> {
    let mut sorted: Vec<u64> = starts.iter().copied().filter(|&s| s < text_end).collect();
    sorted.sort_unstable();
    sorted.dedup();
    sorted
        .iter()
        .enumerate()
        .map(|(i, &start)| FunctionRange {
            start,
            end: sorted.get(i + 1).copied().unwrap_or(text_end),
        })
        .collect()
}

/// One function's CFG and liveness.
#[derive(Clone, Debug, Default)]
pub struct FunctionAnalysis {
    /// The control-flow graph (holds the decoded instructions).
    pub cfg: Cfg,
    /// Liveness at block boundaries.
    pub liveness: Liveness,
}

impl FunctionAnalysis {
    /// Decodes and analyzes the function whose bytes `code` start at `start`.
    #[must_use]
    pub fn analyze(code: &[u8], start: u64, config: &AnalysisConfig) -> Self {
        let mut decoder = FunctionDecoder::new(config);
        Self::analyze_with(&mut decoder, code, start)
    }

    fn analyze_with(decoder: &mut FunctionDecoder<'_>, code: &[u8], start: u64) -> Self {
        let insns = decoder.decode(code, start);
        let cfg = Cfg::build(start, start.wrapping_add(code.len() as u64), insns);
        let liveness = Liveness::compute(&cfg);
        Self { cfg, liveness }
    }

    /// The instruction starting exactly at `addr`.
    #[must_use]
    pub fn insn_at(&self, addr: u64) -> Option<&Insn> {
        self.cfg.insn_index_at(addr).map(|i| &self.cfg.insns()[i])
    }

    /// What is live just before the instruction at `addr`, if one starts there.
    #[must_use]
    pub fn live_before(&self, addr: u64) -> Option<LiveState> {
        let i = self.cfg.insn_index_at(addr)?;
        Some(self.liveness.before_insn(&self.cfg, i))
    }
}

/// Every direct branch and call target in the analyzed text, sorted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BranchTargets(Vec<u64>);

impl BranchTargets {
    /// The set of `targets`.
    #[must_use]
    pub fn new(mut targets: Vec<u64>) -> Self {
        targets.par_sort_unstable();
        targets.dedup();
        Self(targets)
    }

    /// The first target strictly inside `(start, end)`: a branch that would land in the
    /// middle of bytes starting at `start`.
    #[must_use]
    pub fn first_strictly_inside(&self, start: u64, end: u64) -> Option<u64> {
        let i = self.0.partition_point(|&t| t <= start);
        self.0.get(i).copied().filter(|&t| t < end)
    }

    /// Targets that are already sorted and distinct (e.g. read back from a cache), or `None`
    /// when they are not.
    #[must_use]
    pub fn from_sorted(targets: Vec<u64>) -> Option<Self> {
        targets
            .windows(2)
            .all(|w| w[0] < w[1])
            .then_some(Self(targets))
    }

    /// The targets, sorted and distinct.
    #[must_use]
    pub fn as_slice(&self) -> &[u64] {
        &self.0
    }

    /// Whether `addr` is a target.
    #[must_use]
    pub fn contains(&self, addr: u64) -> bool {
        self.0.binary_search(&addr).is_ok()
    }

    /// Number of distinct targets.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The ranges to analyse, sorted, and why the others are set aside (empty, outside `text`,
/// overlapping the one before).
fn keep_ranges(
    text: CodeView<'_>,
    ranges: &[FunctionRange],
) -> (Vec<FunctionRange>, Vec<TextError>) {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    let mut kept: Vec<FunctionRange> = Vec::with_capacity(sorted.len());
    let mut rejected = Vec::new();
    for r in sorted {
        if text.range(r.start, r.end).is_none() {
            rejected.push(TextError::RangeOutsideText {
                start: r.start,
                end: r.end,
            });
        } else if kept.last().is_some_and(|prev| r.start < prev.end) {
            rejected.push(TextError::RangeOverlaps {
                start: r.start,
                end: r.end,
            });
        } else {
            kept.push(r);
        }
    }
    (kept, rejected)
}

/// A text of `len` zero bytes to [`TextAnalysis::fill`] piece by piece: a zeroed allocation
/// of that size is the allocator's fresh zero pages (`calloc`), which take no memory until
/// written, so a 14 MB text of which a plan reads a few functions costs a few pages.
#[must_use]
pub fn zeroed_text(len: usize) -> Vec<u8> {
    vec![0; len]
}

/// The analysis of a whole text section: every direct branch target, found up front (a splice
/// must know whether any branch of the kernel lands inside the bytes it overwrites), and each
/// function's CFG and liveness, made the first time that function is asked for and kept. A
/// plan that touches a few functions analyses a few: the whole kernel's CFGs (3.5 million
/// instructions of Debian's 6.1) took 400 MB and most of the time.
#[derive(Debug, Default)]
pub struct TextAnalysis {
    base: u64,
    bytes: Vec<u8>,
    config: AnalysisConfig,
    ranges: Vec<FunctionRange>,
    functions: Vec<OnceLock<FunctionAnalysis>>,
    targets: BranchTargets,
    rejected: Vec<TextError>,
}

impl TextAnalysis {
    /// Analyzes every function of `ranges` in `text` (a copy of its bytes is kept: see
    /// [`TextAnalysis::analyze_owned`]). Ranges that are empty, outside the text or
    /// overlapping an earlier one are set aside in [`TextAnalysis::rejected`].
    #[must_use]
    pub fn analyze(text: CodeView<'_>, ranges: &[FunctionRange], config: &AnalysisConfig) -> Self {
        Self::analyze_owned(text.base(), text.bytes().to_vec(), ranges, config)
    }

    /// [`TextAnalysis::analyze`] of the text `bytes` at `base`, taken rather than copied. The branch targets are found here, in parallel; the functions'
    /// CFGs when they are first asked for.
    #[must_use]
    pub fn analyze_owned(
        base: u64,
        bytes: Vec<u8>,
        ranges: &[FunctionRange],
        config: &AnalysisConfig,
    ) -> Self {
        let Ok(text) = CodeView::new(base, &bytes) else {
            return Self {
                rejected: vec![TextError::AddressOverflow {
                    base,
                    len: bytes.len(),
                }],
                ..Self::default()
            };
        };
        let (kept, rejected) = keep_ranges(text, ranges);
        // Each function decoded once for its targets alone, in parallel chunks of functions.
        let decoder = FunctionDecoder::new(config);
        let mut targets: Vec<u64> = kept
            .par_chunks(256)
            .map(|chunk| {
                let mut out = Vec::new();
                for r in chunk {
                    let code = text.range(r.start, r.end).unwrap_or_default();
                    decoder.branch_targets_into(code, r.start, &mut out);
                }
                out.sort_unstable();
                out.dedup();
                out
            })
            .flatten_iter()
            .collect();
        targets.shrink_to_fit();
        let functions = (0..kept.len()).map(|_| OnceLock::new()).collect();
        Self {
            base,
            bytes,
            config: config.clone(),
            ranges: kept,
            functions,
            targets: BranchTargets::new(targets),
            rejected,
        }
    }

    /// [`TextAnalysis::analyze_owned`] with the branch targets already known (an earlier
    /// analysis of the same text, ranges and configuration, kept by the caller): nothing is
    /// decoded up front.
    #[must_use]
    pub fn with_targets(
        base: u64,
        bytes: Vec<u8>,
        ranges: &[FunctionRange],
        config: &AnalysisConfig,
        targets: BranchTargets,
    ) -> Self {
        let (kept, rejected) = match CodeView::new(base, &bytes) {
            Ok(text) => keep_ranges(text, ranges),
            Err(e) => (Vec::new(), vec![e]),
        };
        let functions = (0..kept.len()).map(|_| OnceLock::new()).collect();
        Self {
            base,
            bytes,
            config: config.clone(),
            ranges: kept,
            functions,
            targets,
            rejected,
        }
    }

    /// The text the analysis reads (its bytes from [`TextAnalysis::base`] on).
    #[must_use]
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The address of the text's first byte.
    #[must_use]
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Writes `data` into the text at `at` (a caller that reads the text piece by piece, as
    /// it needs it, over a text it created zeroed), and forgets the analysis of every
    /// function the write overlaps, so that none is ever made from bytes since replaced.
    ///
    /// # Errors
    /// [`TextError::RangeOutsideText`] when `data` does not fit inside the text at `at`.
    pub fn fill(&mut self, at: u64, data: &[u8]) -> Result<(), TextError> {
        let outside = TextError::RangeOutsideText {
            start: at,
            end: at.wrapping_add(data.len() as u64),
        };
        let from = usize::try_from(at.wrapping_sub(self.base)).map_err(|_| outside)?;
        let to = from.checked_add(data.len()).ok_or(outside)?;
        if at < self.base || to > self.bytes.len() {
            return Err(outside);
        }
        self.bytes[from..to].copy_from_slice(data);
        let end = at + data.len() as u64;
        let first = self.ranges.partition_point(|r| r.end <= at);
        for (r, f) in self.ranges[first..]
            .iter()
            .zip(&mut self.functions[first..])
            .take_while(|(r, _)| r.start < end)
        {
            if r.start < end && at < r.end {
                *f = OnceLock::new();
            }
        }
        Ok(())
    }

    /// The targets inside the function `range` of its own direct branches (and calls) in the
    /// text now that [`TextAnalysis::branch_targets`] lacks: none for a function whose targets
    /// were found in this very text; a target missing says the targets were found in another
    /// text (a cache entry that does not belong to it). Targets outside the function are left
    /// out: calls and tail calls elsewhere change with what the kernel patches in at run time
    /// (ftrace trampolines, static calls) and say nothing about this function's decoding.
    #[must_use]
    pub fn targets_missing_from(&self, range: &FunctionRange) -> Vec<u64> {
        let Some(code) = CodeView::new(self.base, &self.bytes)
            .ok()
            .and_then(|t| t.range(range.start, range.end))
        else {
            return Vec::new();
        };
        let mut own = Vec::new();
        FunctionDecoder::new(&self.config).branch_targets_into(code, range.start, &mut own);
        own.retain(|&t| range.contains(t) && !self.targets.contains(t));
        own.sort_unstable();
        own.dedup();
        own
    }

    /// Adds `extra` to the branch targets (targets the text does not show now but may at
    /// run time: the destinations of jump labels that are off).
    pub fn add_targets(&mut self, extra: impl IntoIterator<Item = u64>) {
        let mut all = std::mem::take(&mut self.targets).0;
        all.extend(extra);
        self.targets = BranchTargets::new(all);
    }

    /// The analysis of the `i`th function of [`TextAnalysis::ranges`], made now if it was
    /// not yet.
    fn function(&self, i: usize) -> Option<&FunctionAnalysis> {
        let r = self.ranges.get(i)?;
        Some(self.functions.get(i)?.get_or_init(|| {
            let code = CodeView::new(self.base, &self.bytes)
                .ok()
                .and_then(|t| t.range(r.start, r.end))
                .unwrap_or_default();
            FunctionAnalysis::analyze(code, r.start, &self.config)
        }))
    }

    /// Every analyzed function, in address order (those not analyzed yet are, in parallel,
    /// first).
    pub fn functions(&self) -> impl Iterator<Item = &FunctionAnalysis> + '_ {
        (0..self.functions.len()).into_par_iter().for_each(|i| {
            self.function(i);
        });
        self.functions.iter().filter_map(OnceLock::get)
    }

    /// How many functions there are (analyzed yet or not).
    #[must_use]
    pub fn function_count(&self) -> usize {
        self.functions.len()
    }

    /// How many functions have been analyzed so far.
    #[must_use]
    pub fn analyzed_count(&self) -> usize {
        self.functions.iter().filter(|f| f.get().is_some()).count()
    }

    /// The function ranges that were analyzed, in address order.
    #[must_use]
    pub fn ranges(&self) -> &[FunctionRange] {
        &self.ranges
    }

    /// The function whose range holds `addr`.
    #[must_use]
    pub fn function_containing(&self, addr: u64) -> Option<&FunctionAnalysis> {
        let i = self
            .ranges
            .partition_point(|r| r.start <= addr)
            .checked_sub(1)?;
        if self.ranges[i].contains(addr) {
            self.function(i)
        } else {
            None
        }
    }

    /// All direct branch and call targets of all analyzed functions.
    #[must_use]
    pub fn branch_targets(&self) -> &BranchTargets {
        &self.targets
    }

    /// Ranges that were not analyzed, and why.
    #[must_use]
    pub fn rejected(&self) -> &[TextError] {
        &self.rejected
    }

    /// Total number of decoded instructions (every function analyzed).
    #[must_use]
    pub fn insn_count(&self) -> usize {
        self.functions().map(|f| f.cfg.insns().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use iced_x86::code_asm::*;

    use super::*;

    const BASE: u64 = 0xffff_ffff_8100_0000;

    /// Two functions: `f` calls `g` and jumps inside itself; `g` returns.
    fn two_functions() -> (Vec<u8>, u64) {
        let mut a = CodeAssembler::new(64).unwrap();
        let mut g = a.create_label();
        let mut skip = a.create_label();
        a.test(rdi, rdi).unwrap();
        a.je(skip).unwrap();
        a.call(g).unwrap();
        a.set_label(&mut skip).unwrap();
        a.ret().unwrap();
        a.set_label(&mut g).unwrap();
        a.mov(eax, 7i32).unwrap();
        a.ret().unwrap();
        let result = a
            .assemble_options(
                BASE,
                iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
            )
            .unwrap();
        let g_addr = result.label_ip(&g).unwrap();
        (result.inner.code_buffer, g_addr)
    }

    #[test]
    fn analyzes_each_function_and_finds_them_by_address() {
        let (bytes, g) = two_functions();
        let text = CodeView::new(BASE, &bytes).unwrap();
        let ranges = ranges_from_starts(&[g, BASE], text.end());

        let analysis = TextAnalysis::analyze(text, &ranges, &AnalysisConfig::new());

        assert_eq!(analysis.function_count(), 2);
        assert_eq!(
            analysis.function_containing(g + 1).map(|f| f.cfg.start()),
            Some(g)
        );
        assert_eq!(
            analysis.function_containing(BASE).map(|f| f.cfg.start()),
            Some(BASE)
        );
        assert!(analysis.function_containing(text.end()).is_none());
    }

    #[test]
    fn branch_targets_cover_calls_and_jumps_of_all_functions() {
        let (bytes, g) = two_functions();
        let text = CodeView::new(BASE, &bytes).unwrap();
        let ranges = ranges_from_starts(&[BASE, g], text.end());

        let analysis = TextAnalysis::analyze(text, &ranges, &AnalysisConfig::new());

        assert!(analysis.branch_targets().contains(g));
        assert_eq!(analysis.branch_targets().len(), 2);
    }

    #[test]
    fn a_text_filled_piece_by_piece_analyses_as_the_whole_and_forgets_what_it_overwrote() {
        let (bytes, g) = two_functions();
        let whole = TextAnalysis::analyze(
            CodeView::new(BASE, &bytes).unwrap(),
            &ranges_from_starts(&[BASE, g], BASE + bytes.len() as u64),
            &AnalysisConfig::new(),
        );
        let ranges = ranges_from_starts(&[BASE, g], BASE + bytes.len() as u64);
        let mut lazy = TextAnalysis::with_targets(
            BASE,
            zeroed_text(bytes.len()),
            &ranges,
            &AnalysisConfig::new(),
            whole.branch_targets().clone(),
        );
        assert!(lazy.bytes().iter().all(|&b| b == 0));
        // Analysed over zeros first (what a caller must not plan on) ...
        let zeros = lazy.function_containing(g).unwrap().cfg.insns().len();
        assert_ne!(
            zeros,
            whole.function_containing(g).unwrap().cfg.insns().len()
        );
        // ... then filled: the analysis is made again from the new bytes.
        let split = usize::try_from(g - BASE).unwrap();
        lazy.fill(g, &bytes[split..]).unwrap();
        lazy.fill(BASE, &bytes[..split]).unwrap();
        assert_eq!(lazy.bytes(), &bytes[..]);
        for at in [BASE, g] {
            let (a, b) = (
                lazy.function_containing(at).unwrap(),
                whole.function_containing(at).unwrap(),
            );
            assert_eq!(
                a.cfg.insns().len(),
                b.cfg.insns().len(),
                "function at {at:#x}"
            );
            assert_eq!(a.live_before(at), b.live_before(at));
        }
        // Outside the text: an error, nothing written.
        assert!(lazy.fill(BASE + bytes.len() as u64 - 1, &[0, 0]).is_err());
        assert!(lazy.fill(BASE - 1, &[0]).is_err());
        assert_eq!(lazy.bytes(), &bytes[..]);
    }

    #[test]
    fn targets_missing_from_names_a_functions_own_targets_that_the_set_lacks() {
        let (bytes, g) = two_functions();
        let ranges = ranges_from_starts(&[BASE, g], BASE + bytes.len() as u64);
        let whole = TextAnalysis::analyze(
            CodeView::new(BASE, &bytes).unwrap(),
            &ranges,
            &AnalysisConfig::new(),
        );
        assert!(ranges
            .iter()
            .all(|r| whole.targets_missing_from(r).is_empty()));
        // `f`'s own targets: `skip` (its `je`) inside it, `g` (its call) outside.
        let skip = *whole
            .branch_targets()
            .as_slice()
            .iter()
            .find(|&&t| t != g)
            .unwrap();
        assert!(ranges[0].contains(skip) && !ranges[0].contains(g));
        let lacking = |gone: u64| {
            TextAnalysis::with_targets(
                BASE,
                bytes.clone(),
                &ranges,
                &AnalysisConfig::new(),
                BranchTargets::new(
                    whole
                        .branch_targets()
                        .as_slice()
                        .iter()
                        .copied()
                        .filter(|&t| t != gone)
                        .collect(),
                ),
            )
        };
        let mut without_skip = lacking(skip);
        assert_eq!(without_skip.targets_missing_from(&ranges[0]), vec![skip]);
        assert!(without_skip.targets_missing_from(&ranges[1]).is_empty());
        // A call elsewhere is not the function's own decoding.
        assert!(lacking(g).targets_missing_from(&ranges[0]).is_empty());
        without_skip.add_targets([skip, BASE + 1000]);
        assert!(without_skip.targets_missing_from(&ranges[0]).is_empty());
        assert!(without_skip.branch_targets().contains(BASE + 1000));
    }

    #[test]
    fn ranges_outside_text_or_overlapping_are_rejected() {
        let (bytes, _) = two_functions();
        let text = CodeView::new(BASE, &bytes).unwrap();
        let ranges = [
            FunctionRange {
                start: BASE,
                end: BASE + 4,
            },
            FunctionRange {
                start: BASE + 2,
                end: BASE + 6,
            },
            FunctionRange {
                start: BASE + 100,
                end: BASE + 200,
            },
            FunctionRange {
                start: BASE + 9,
                end: BASE + 9,
            },
        ];

        let analysis = TextAnalysis::analyze(text, &ranges, &AnalysisConfig::new());

        assert_eq!(analysis.function_count(), 1);
        assert_eq!(analysis.rejected().len(), 3);
    }

    /// Targets as the CFG sees them: every analysed function's instructions' flow targets.
    fn cfg_targets(analysis: &TextAnalysis) -> BranchTargets {
        BranchTargets::new(
            analysis
                .functions()
                .flat_map(|f| f.cfg.branch_targets().collect::<Vec<_>>())
                .collect(),
        )
    }

    #[test]
    fn the_up_front_targets_are_the_cfgs_targets_for_every_kind_of_branch() {
        // Conditional and unconditional jumps inside and out, a call, xbegin, a jmp to a
        // return thunk (a return: no target), an indirect jump, a far jump (no target).
        let mut a = CodeAssembler::new(64).unwrap();
        let mut thunk = a.create_label();
        let mut inside = a.create_label();
        a.test(rdi, rdi).unwrap();
        a.jne(inside).unwrap();
        a.call(thunk).unwrap();
        a.set_label(&mut inside).unwrap();
        a.xbegin(inside).unwrap();
        a.jmp(rax).unwrap();
        a.jmp(thunk).unwrap();
        a.set_label(&mut thunk).unwrap();
        a.ret().unwrap();
        let result = a
            .assemble_options(
                BASE,
                iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
            )
            .unwrap();
        let thunk_addr = result.label_ip(&thunk).unwrap();
        let mut bytes = result.inner.code_buffer;
        // jmp far [rax] (FF /5): a far branch.
        bytes.extend_from_slice(&[0xff, 0x28]);
        let text = CodeView::new(BASE, &bytes).unwrap();
        for config in [
            AnalysisConfig::new(),
            AnalysisConfig::new().with_return_thunk(thunk_addr),
        ] {
            let ranges = ranges_from_starts(&[BASE, thunk_addr], text.end());

            let analysis = TextAnalysis::analyze(text, &ranges, &config);

            assert_eq!(analysis.analyzed_count(), 0, "nothing analysed up front");
            assert_eq!(*analysis.branch_targets(), cfg_targets(&analysis));
            assert_eq!(analysis.analyzed_count(), 2);
        }
    }

    #[test]
    fn the_up_front_targets_of_the_real_kernel_are_its_cfgs_targets() {
        let Some(vmlinux) = crate::bzimage::tests::real_vmlinux() else {
            return;
        };
        let text = vmlinux.section(".text").unwrap();
        let bytes = vmlinux.section_data(".text").unwrap();
        let starts: Vec<u64> = crate::kallsyms::extract(&vmlinux)
            .unwrap()
            .symbols
            .iter()
            .filter(|s| matches!(s.kind, 't' | 'T' | 'w' | 'W'))
            .map(|s| s.addr)
            .collect();
        let view = CodeView::new(text.addr, bytes).unwrap();
        let ranges = ranges_from_starts(&starts, view.end());

        let analysis = TextAnalysis::analyze(view, &ranges, &AnalysisConfig::new());

        assert!(
            analysis.function_count() > 40_000,
            "{}",
            analysis.function_count()
        );
        assert!(analysis.branch_targets().len() > 100_000);
        assert_eq!(*analysis.branch_targets(), cfg_targets(&analysis));
    }

    #[test]
    fn code_view_rejects_wrapping_base() {
        let bytes = [0u8; 16];

        let view = CodeView::new(u64::MAX - 4, &bytes);

        assert!(matches!(view, Err(TextError::AddressOverflow { .. })));
    }

    #[test]
    fn first_strictly_inside_ignores_the_start_itself() {
        let targets = BranchTargets::new(vec![10, 20, 13]);

        assert_eq!(targets.first_strictly_inside(10, 15), Some(13));
        assert_eq!(targets.first_strictly_inside(13, 20), None);
        assert_eq!(targets.first_strictly_inside(20, 25), None);
    }
}
