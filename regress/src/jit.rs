//! JIT mode of the regression: every function of an x86-64 target translated into a code
//! cache ([`exotap_probes::jit`]) with a counter at every block leader, entered through a
//! splice at each function's entry (an in-emulator trap where the planner refuses the
//! splice), and run against the untranslated reference.
//!
//! Two oracles, both from Unicorn and neither from exotap's CFG: the run must end as the
//! reference did (registers, image memory, live stack: [`crate::x86`]'s comparison), and
//! each block counter must equal what Unicorn's own `hook_block` saw on the ORIGINAL run
//! at the leader's address: the number of executed Unicorn blocks that contain the
//! leader (a Unicorn block runs straight through, so each such block ran the leader
//! once). Unicorn's blocks are not CFG blocks (they end at calls and page ends, not at
//! jump targets), which is why the comparison is per leader address. The per-instruction
//! code-hook profile is compared with the block-hook oracle too, and any disagreement
//! between the two oracles is reported apart.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

use exotap_introspect::x86::{
    ranges_from_starts, AnalysisConfig, CodeView, FunctionAnalysis, TextAnalysis,
};
use exotap_probes::jit::{entry_splice, CacheLayout, TranslateError, Translator};
use exotap_probes::splice::{plan, SpliceContext, SpliceDecision};
use exotap_vmm::unicorn::RunEnd;

use crate::image::ElfImage;
use crate::x86::{compare, Harness, REFERENCE_BUDGET};
use crate::RegressError;

/// The patch heap of a JIT run: code, counters and the lookup table.
pub(crate) const JIT_HEAP_SIZE: usize = 0x20_0000;
/// How many more instructions than the reference a translated run may execute (a
/// return costs a table lookup of about twenty instructions).
const JIT_BUDGET_FACTOR: u64 = 40;

/// What the JIT regression found.
#[derive(Debug, Clone, Default)]
pub struct JitReport {
    /// The image.
    pub image: String,
    /// Runs (calls) checked, each a reference run and a translated run.
    pub runs: usize,
    /// Functions translated (summed over runs).
    pub functions: usize,
    /// Blocks counted.
    pub blocks: usize,
    /// Blocks the reference run executed at least once.
    pub blocks_executed: usize,
    /// Block counters compared with the oracle.
    pub counts_checked: usize,
    /// Counters kept inside `pushfq`/`popfq` (status flags live at the leader).
    pub counters_saving_flags: usize,
    /// Sum of all block counts (what the counters saw).
    pub block_executions: u64,
    /// Function entries sent into the cache by a splice, and by an in-emulator trap.
    pub entries_spliced: usize,
    /// See `entries_spliced`.
    pub entries_trapped: usize,
    /// Bytes of translated code (largest run).
    pub cache_bytes: u64,
    /// Lookup-table entries (largest run).
    pub table_entries: usize,
    /// Where translated code left the cache, by reason.
    pub exits: BTreeMap<String, usize>,
    /// Functions the translator refused, with why.
    pub refused: Vec<String>,
    /// Instructions of the reference runs, and of the translated runs.
    pub reference_instructions: u64,
    /// See `reference_instructions`.
    pub translated_instructions: u64,
    /// Leaders where Unicorn's block hook and its code hook disagree (oracle trouble,
    /// not a JIT divergence).
    pub oracle_disagreements: Vec<String>,
    /// Calls left out, with why.
    pub skipped: Vec<String>,
    /// Divergences: a different end state or a count that differs from the oracle.
    pub divergences: Vec<String>,
    /// Wall time.
    pub elapsed: Duration,
}

impl fmt::Display for JitReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "image: {} (JIT mode)", self.image)?;
        writeln!(
            f,
            "runs: {}, functions translated: {}, blocks counted: {} ({} executed)",
            self.runs, self.functions, self.blocks, self.blocks_executed
        )?;
        writeln!(
            f,
            "counts checked against Unicorn's block hook: {} ({} block executions); {} counters save flags",
            self.counts_checked, self.block_executions, self.counters_saving_flags
        )?;
        writeln!(
            f,
            "entries: {} by splice, {} by trap; cache: {} bytes, {} lookup entries (largest run)",
            self.entries_spliced, self.entries_trapped, self.cache_bytes, self.table_entries
        )?;
        writeln!(
            f,
            "instructions: reference {}, translated {}",
            self.reference_instructions, self.translated_instructions
        )?;
        for (why, n) in &self.exits {
            writeln!(f, "  cache exits ({why}): {n}")?;
        }
        for r in &self.refused {
            writeln!(f, "  refused: {r}")?;
        }
        if !self.skipped.is_empty() {
            writeln!(f, "skipped: {}", self.skipped.join("; "))?;
        }
        writeln!(
            f,
            "oracle disagreements (block hook vs code hook): {}",
            self.oracle_disagreements.len()
        )?;
        for d in self.oracle_disagreements.iter().take(20) {
            writeln!(f, "  {d}")?;
        }
        writeln!(f, "divergences: {}", self.divergences.len())?;
        for d in self.divergences.iter().take(50) {
            writeln!(f, "  {d}")?;
        }
        write!(f, "time: {:.1} s", self.elapsed.as_secs_f64())
    }
}

/// Executions per leader from Unicorn's block hook: each executed Unicorn block
/// `(start, size)` ran every leader it contains once.
fn block_hook_counts(blocks: &HashMap<(u64, u32), u64>, leaders: &[u64]) -> HashMap<u64, u64> {
    let sorted: std::collections::BTreeSet<u64> = leaders.iter().copied().collect();
    let mut counts: HashMap<u64, u64> = leaders.iter().map(|&l| (l, 0)).collect();
    for (&(start, size), &n) in blocks {
        for leader in sorted.range(start..start.saturating_add(u64::from(size))) {
            *counts.entry(*leader).or_insert(0) += n;
        }
    }
    counts
}

/// One function to translate: its bytes' view and its analysis.
pub(crate) type JitFunction<'a> = (CodeView<'a>, &'a FunctionAnalysis);

/// The reference run, then the translated run from `h.start` with `functions` in the
/// cache; adds to `report`.
///
/// # Errors
/// Emulator failure; a reference run that does not halt.
pub(crate) fn check(
    h: &mut Harness,
    ctx: &SpliceContext<'_>,
    functions: &[JitFunction<'_>],
    report: &mut JitReport,
    name: &dyn Fn(u64) -> String,
) -> Result<(), RegressError> {
    h.budget = REFERENCE_BUDGET;
    h.reset()?;
    h.m.start_block_profile()?;
    h.m.start_profile()?;
    let reference = h.run(&HashMap::new())?;
    let unicorn_blocks = h.m.take_block_profile().unwrap_or_default();
    let profile = h.m.take_profile().unwrap_or_default();
    if reference.end != RunEnd::Halted(h.halt) {
        return Err(RegressError::ReferenceDidNotHalt(format!(
            "{:?}",
            reference.end
        )));
    }
    let reference_instructions: u64 = profile.values().sum();
    report.reference_instructions += reference_instructions;
    report.runs += 1;

    let layout = CacheLayout::split(h.heap_base()..h.heap_end())
        .map_err(|e| RegressError::Layout(e.to_string()))?;
    let mut translator = Translator::new(layout, &[])
        .map_err(|e| RegressError::Layout(format!("translator: {e}")))?;
    for (view, f) in functions {
        if (f.cfg.start()..f.cfg.end().max(f.cfg.start() + 1)).contains(&h.halt) {
            // The run ends when the original halt address executes.
            continue;
        }
        match translator.translate(*view, f) {
            Ok(()) => {}
            Err(e @ TranslateError::Full { .. }) => {
                report.refused.push(format!("{}: {e}", name(f.cfg.start())));
                break;
            }
            Err(e) => report.refused.push(format!("{}: {e}", name(f.cfg.start()))),
        }
    }
    let t = translator
        .finish()
        .map_err(|e| RegressError::Layout(format!("linking the translation: {e}")))?;
    report.functions += t.functions.len();
    report.blocks += t.blocks.len();
    report.counters_saving_flags += t.blocks.iter().filter(|b| b.saves_flags).count();
    report.cache_bytes = report.cache_bytes.max(t.code.len() as u64);
    report.table_entries = report.table_entries.max(t.table_entries);
    for exit in &t.exits {
        *report
            .exits
            .entry(format!("{:?}", exit.reason))
            .or_insert(0) += 1;
    }

    // The translated run.
    h.budget = reference_instructions
        .saturating_mul(JIT_BUDGET_FACTOR)
        .saturating_add(100_000);
    h.reset()?;
    h.m.write(t.code_at, &t.code)?;
    h.m.write(t.table_at, &t.table)?;
    let mut splices: Vec<(u64, Vec<u8>)> = Vec::new();
    for f in t.functions.values() {
        let spliced = match plan(ctx, f.start, f.entry) {
            SpliceDecision::Splice(site) if site.addr == f.start => {
                entry_splice(f.start, f.entry).map(|bytes| (site.bytes.clone(), bytes))
            }
            _ => None,
        };
        match spliced {
            Some((original, bytes)) => {
                h.m.write(f.start, &bytes)?;
                splices.push((f.start, original));
                report.entries_spliced += 1;
            }
            None => {
                h.m.add_redirect(f.start, f.entry)?;
                report.entries_trapped += 1;
            }
        }
    }
    h.m.start_profile()?;
    let outcome = h.run(&HashMap::new());
    let translated_profile = h.m.take_profile().unwrap_or_default();
    report.translated_instructions += translated_profile.values().sum::<u64>();
    for (addr, original) in &splices {
        h.m.write(*addr, original)?;
    }
    h.m.take_redirects()?;
    let mut outcome = match outcome {
        Ok(o) => o,
        Err(RegressError::Emulator(e)) => {
            report
                .divergences
                .push(format!("{}: emulator: {e}", name(h.start.rip)));
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    for (addr, original) in &splices {
        for (start, bytes) in &mut outcome.memory {
            let Some(off) = addr.checked_sub(*start) else {
                continue;
            };
            if let Some(slot) = bytes.get_mut(off as usize..off as usize + 5) {
                slot.copy_from_slice(&original[..5]);
            }
        }
    }
    if let Some(what) = compare(&reference, &outcome) {
        report
            .divergences
            .push(format!("run from {}: {what}", name(h.start.rip)));
    }

    // The counts against Unicorn's block hook.
    let mut counter_bytes = vec![0u8; (t.counters.end - t.counters.start) as usize];
    h.m.read(t.counters.start, &mut counter_bytes)?;
    let leaders: Vec<u64> = t.blocks.iter().map(|b| b.leader).collect();
    let oracle = block_hook_counts(&unicorn_blocks, &leaders);
    for (leader, count) in t.counts(&counter_bytes) {
        let expected = oracle.get(&leader).copied().unwrap_or(0);
        let by_code_hook = profile.get(&leader).copied().unwrap_or(0);
        report.counts_checked += 1;
        report.block_executions += count;
        if expected > 0 {
            report.blocks_executed += 1;
        }
        if expected != by_code_hook {
            report.oracle_disagreements.push(format!(
                "{}: block hook {expected}, code hook {by_code_hook}",
                name(leader)
            ));
        }
        if count != expected {
            report.divergences.push(format!(
                "block at {} counted {count}, Unicorn's block hook ran it {expected} times",
                name(leader)
            ));
        }
    }
    Ok(())
}

/// The JIT regression over an x86-64 image with `exotap_halt`: every function of its
/// text translated, one run from the image's entry.
///
/// # Errors
/// Emulator failure or a reference run that does not halt.
pub fn regress_image(image: &ElfImage) -> Result<JitReport, RegressError> {
    let started = Instant::now();
    let text = image
        .text()
        .ok_or_else(|| RegressError::Layout("no executable segment".into()))?;
    let view =
        CodeView::new(text.addr, &text.data).map_err(|e| RegressError::Layout(e.to_string()))?;
    let ranges = ranges_from_starts(&image.text_symbol_starts(), view.end());
    let analysis = TextAnalysis::analyze(view, &ranges, &AnalysisConfig::new());
    let ctx = SpliceContext::new(view, &analysis);
    let mut h = Harness::new(image, JIT_HEAP_SIZE)?;
    let name = |addr: u64| -> String {
        image
            .symbols
            .iter()
            .rev()
            .find(|s| s.addr <= addr && s.addr >= text.addr)
            .map_or_else(
                || format!("{addr:#x}"),
                |s| format!("{}+{:#x}", s.name, addr - s.addr),
            )
    };
    let functions: Vec<JitFunction<'_>> = analysis.functions().map(|f| (view, f)).collect();
    let mut report = JitReport {
        image: image.path.clone(),
        ..JitReport::default()
    };
    check(&mut h, &ctx, &functions, &mut report, &name)?;
    report.elapsed = started.elapsed();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unicorn_block_counts_every_leader_inside_it_and_none_outside() {
        let blocks: HashMap<(u64, u32), u64> =
            [((0x100, 0x10), 3), ((0x108, 0x4), 2), ((0x200, 1), 7)].into();

        let counts = block_hook_counts(&blocks, &[0x100, 0x108, 0x110, 0x200]);

        assert_eq!(counts[&0x100], 3);
        assert_eq!(counts[&0x108], 5);
        assert_eq!(counts[&0x110], 0);
        assert_eq!(counts[&0x200], 7);
    }
}
