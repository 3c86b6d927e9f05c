//! JIT mode over the vmlinux library functions: each call of [`super::CALLS`] runs with
//! the called function, every function it reaches by direct calls and jumps (the
//! closure: `__fentry__`, retpoline thunks, helpers; bounded by [`MAX_CLOSURE`]) and the
//! scratch comparators (reached by indirect calls) translated into the code cache.

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::time::Instant;

use exotap_introspect::x86::{AnalysisConfig, CodeView, FunctionAnalysis, TextAnalysis};
use exotap_probes::splice::SpliceContext;
use exotap_vmm::control::X86Registers;

use super::{builtin_functions, load, resolve_all, Loaded, Scratch, Setup, CALLS, SCRATCH};
use crate::jit::{check, JitFunction, JitReport};
use crate::x86::{Harness, Region};
use crate::RegressError;

/// The patch heap: the 1 MiB between the image's end (plus the harness's gap) and the
/// scratch area.
const HEAP_SIZE: usize = 0x10_0000;

/// The most functions translated for one call.
const MAX_CLOSURE: usize = 64;

/// The scratch comparators, `(offset, length)` in the scratch area.
const SCRATCH_FUNCTIONS: [(usize, usize); 2] = [(0x10, 5), (0x20, 7)];

/// The function at `start` and every function it reaches by direct branches and calls
/// whose entry is a sized code symbol, breadth first.
fn closure(
    loaded: &Loaded,
    view: CodeView<'_>,
    config: &AnalysisConfig,
    start: u64,
) -> Vec<FunctionAnalysis> {
    let range_at = |addr: u64| -> Option<(u64, u64)> {
        let i = loaded.code_symbols.partition_point(|s| s.0 < addr);
        loaded
            .code_symbols
            .get(i)
            .filter(|s| s.0 == addr)
            .map(|s| (s.0, s.1))
    };
    let mut out = Vec::new();
    let mut seen: HashSet<u64> = HashSet::from([start]);
    let mut todo: VecDeque<(u64, u64)> = range_at(start).into_iter().collect();
    while let Some((s, e)) = todo.pop_front() {
        if out.len() >= MAX_CLOSURE {
            break;
        }
        let Some(bytes) = view.range(s, e) else {
            continue;
        };
        let f = FunctionAnalysis::analyze(bytes, s, config);
        for insn in f.cfg.insns() {
            let Some(target) = insn.flow.target() else {
                continue;
            };
            if (s..e).contains(&target) || !seen.insert(target) {
                continue;
            }
            if let Some(range) = range_at(target) {
                todo.push_back(range);
            }
        }
        out.push(f);
    }
    out
}

/// Runs the JIT regression over the built-in calls of the vmlinux at `vmlinux`.
///
/// # Errors
/// The image cannot be loaded; emulator failure.
pub fn regress_jit(vmlinux: &Path) -> Result<JitReport, RegressError> {
    let started = Instant::now();
    let names = builtin_functions();
    let loaded = load(vmlinux, &names)?;
    let text_range = loaded.text_base..loaded.text_base + loaded.text.len() as u64;
    let (callable, unusable) = resolve_all(&names, &loaded.symbols, &text_range);
    let view = CodeView::new(loaded.text_base, &loaded.text)
        .map_err(|e| RegressError::Layout(e.to_string()))?;
    // `__x86_return_thunk` is an untyped (SYM_CODE) symbol: take it whatever its type,
    // so that `jmp __x86_return_thunk` is a return that goes through the lookup.
    let mut config = AnalysisConfig::new();
    let thunk = loaded
        .symbols
        .get(super::RETURN_THUNK)
        .and_then(|facts| facts.first())
        .map(|f| f.addr)
        .or(loaded.return_thunk);
    if let Some(thunk) = thunk {
        config = config.with_return_thunk(thunk);
    }
    let ranges: Vec<_> = {
        let mut r: Vec<_> = callable.iter().map(|c| c.1).collect();
        r.sort_by_key(|r| r.start);
        r
    };
    let analysis = TextAnalysis::analyze(view, &ranges, &config);
    let ctx = SpliceContext::new(view, &analysis);
    let image_start = loaded
        .regions
        .iter()
        .map(|r| r.addr)
        .filter(|&a| a >= 0xffff_8000_0000_0000)
        .min()
        .unwrap_or(loaded.text_base);
    let image_end = loaded
        .regions
        .iter()
        .map(|r| r.addr + r.init.len() as u64)
        .max()
        .unwrap_or(loaded.text_base);
    let mut regions = loaded.regions.clone();
    regions.push(Region {
        addr: SCRATCH,
        init: vec![0; super::SCRATCH_SIZE],
        reset: true,
        compare: true,
    });
    let mut h = Harness::with_regions(
        regions,
        image_start,
        image_end,
        Scratch::HALT,
        X86Registers::default(),
        HEAP_SIZE,
    )?;
    let mut report = JitReport {
        image: format!(
            "{} ({} functions called)",
            vmlinux.display(),
            callable.len()
        ),
        skipped: unusable.iter().map(ToString::to_string).collect(),
        ..JitReport::default()
    };
    let symbol_name = |addr: u64| -> String {
        let i = loaded.code_symbols.partition_point(|s| s.0 <= addr);
        match i.checked_sub(1).and_then(|i| loaded.code_symbols.get(i)) {
            Some((s, e, name)) if addr < *e => format!("{name}+{:#x}", addr - s),
            _ if addr >= SCRATCH && addr < SCRATCH + super::SCRATCH_SIZE as u64 => {
                format!("scratch+{:#x}", addr - SCRATCH)
            }
            _ => format!("{addr:#x}"),
        }
    };
    for (name, range) in &callable {
        let setup: Setup = CALLS
            .iter()
            .find(|c| c.0 == name)
            .map_or(super::generic_setup as Setup, |c| c.1);
        let mut scratch = Scratch::new();
        let args = setup(&mut scratch);
        let scratch_bytes = scratch.bytes.clone();
        h.set_region_init(SCRATCH, scratch.bytes)?;
        let mut start = X86Registers {
            rip: range.start,
            rflags: 0x2,
            ..X86Registers::default()
        };
        for (slot, value) in [5usize, 4, 3, 2, 8].into_iter().zip(args) {
            start.gpr[slot] = value;
        }
        start.gpr[7] = h.push_return_address(Scratch::HALT)?;
        h.start = start;

        let translated = closure(&loaded, view, &config, range.start);
        let scratch_view = CodeView::new(SCRATCH, &scratch_bytes)
            .map_err(|e| RegressError::Layout(e.to_string()))?;
        let comparators: Vec<FunctionAnalysis> = SCRATCH_FUNCTIONS
            .iter()
            .map(|&(off, len)| {
                FunctionAnalysis::analyze(
                    &scratch_bytes[off..off + len],
                    SCRATCH + off as u64,
                    &config,
                )
            })
            .collect();
        let functions: Vec<JitFunction<'_>> = translated
            .iter()
            .map(|f| (view, f))
            .chain(comparators.iter().map(|f| (scratch_view, f)))
            .collect();
        match check(&mut h, &ctx, &functions, &mut report, &symbol_name) {
            Ok(()) => {}
            Err(RegressError::ReferenceDidNotHalt(why)) => report.skipped.push(format!(
                "{name} (its untranslated call did not return: {why})"
            )),
            Err(e) => return Err(e),
        }
    }
    report.elapsed = started.elapsed();
    Ok(report)
}
