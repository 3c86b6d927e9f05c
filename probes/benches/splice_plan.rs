//! The splice planner and patch generator over the real kernel text.
//!
//! Plans every function entry and every instruction of the cached 6.1 cloud kernel,
//! prints how many of each decision and refusal there are, generates a counting patch for
//! every entry splice (each one relocated and verified by decoding), and times planning
//! all function entries. Skipped, with a message, when the kernel is not in the cache
//! (`exotap image fetch` puts it there).
//!
//! Run: `cargo bench -p exotap-probes --bench splice_plan`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use exotap_introspect::bzimage::{cached_kernel_dir, Vmlinux};
use exotap_introspect::kallsyms;
use exotap_introspect::x86::{
    ranges_from_starts, AnalysisConfig, CallEffect, CodeView, TextAnalysis,
};
use exotap_probes::splice::{
    generate, plan, PatchRequest, Probe, Refusal, SpliceContext, SpliceDecision,
};
use iced_x86::Register;

const RELEASE: &str = "6.1.0-50-cloud-amd64";
const SIZE_2M: u64 = 2 << 20;

struct Kernel {
    text: Vec<u8>,
    base: u64,
    starts: Vec<u64>,
    config: AnalysisConfig,
    patch: u64,
}

fn thunk_register(name: &str) -> Option<Register> {
    let regs = [
        ("rax", Register::RAX),
        ("rbx", Register::RBX),
        ("rcx", Register::RCX),
        ("rdx", Register::RDX),
        ("rsi", Register::RSI),
        ("rdi", Register::RDI),
        ("rbp", Register::RBP),
        ("r8", Register::R8),
        ("r9", Register::R9),
        ("r10", Register::R10),
        ("r11", Register::R11),
        ("r12", Register::R12),
        ("r13", Register::R13),
        ("r14", Register::R14),
        ("r15", Register::R15),
    ];
    let suffix = name.strip_prefix("__x86_indirect_thunk_")?;
    regs.iter().find(|(n, _)| *n == suffix).map(|(_, r)| *r)
}

fn kernel() -> Option<Kernel> {
    let dir = cached_kernel_dir(RELEASE)?;
    let image = std::fs::read(dir.join("vmlinuz")).ok()?;
    let vmlinux = Vmlinux::from_bzimage(&image).ok()?;
    let syms = kallsyms::extract(&vmlinux).ok()?;
    let (start, end) = vmlinux.text_range().ok()?;
    let text = vmlinux
        .read_at(start, usize::try_from(end - start).ok()?)
        .ok()?
        .to_vec();
    let mut config = AnalysisConfig::new();
    let mut image_end = end;
    let mut starts = Vec::new();
    for s in &syms.symbols {
        if matches!(s.kind, 'T' | 't') && s.addr >= start && s.addr < end {
            starts.push(s.addr);
        }
        if s.name == "__fentry__" {
            config = config.with_call_effect(s.addr, CallEffect::TRANSPARENT);
        }
        if s.name == "__x86_return_thunk" {
            config = config.with_return_thunk(s.addr);
        }
        if let Some(reg) = thunk_register(&s.name) {
            config = config.with_call_effect(s.addr, CallEffect::sysv_reading(reg));
        }
        if s.name == "_end" {
            image_end = s.addr;
        }
    }
    Some(Kernel {
        text,
        base: start,
        starts,
        config,
        patch: image_end.div_ceil(SIZE_2M) * SIZE_2M,
    })
}

fn kind(decision: &SpliceDecision) -> String {
    match decision {
        SpliceDecision::Splice(_) => "splice".into(),
        SpliceDecision::Trap { .. } => "trap (short instruction)".into(),
        SpliceDecision::Refuse(r) => match r {
            Refusal::Unsupported { mnemonic, .. } => format!("refuse: unsupported {mnemonic:?}"),
            other => {
                let name = format!("{other:?}");
                format!("refuse: {}", name.split([' ', '{']).next().unwrap_or(""))
            }
        },
    }
}

fn bench_plan(c: &mut Criterion) {
    let Some(k) = kernel() else {
        eprintln!("skipping splice_plan: {RELEASE} is not in the kernel cache");
        return;
    };
    let view = CodeView::new(k.base, &k.text).unwrap();
    let ranges = ranges_from_starts(&k.starts, view.end());
    let analysis = TextAnalysis::analyze(view, &ranges, &k.config);
    let ctx = SpliceContext::new(view, &analysis);
    let entries: Vec<u64> = analysis.ranges().iter().map(|r| r.start).collect();

    let mut at_entries: BTreeMap<String, usize> = BTreeMap::new();
    let mut patches = (0usize, 0usize);
    let counter = k.patch + SIZE_2M;
    for &addr in &entries {
        let decision = plan(&ctx, addr, k.patch);
        *at_entries.entry(kind(&decision)).or_default() += 1;
        if let SpliceDecision::Splice(site) = &decision {
            let probes = [Probe::Count { counter }];
            match generate(&PatchRequest::for_site(site, k.patch, &probes)) {
                Ok(_) => patches.0 += 1,
                Err(e) => {
                    if patches.1 < 5 {
                        eprintln!("patch for {addr:#x} failed: {e}");
                    }
                    patches.1 += 1;
                }
            }
        }
    }
    eprintln!("function entries ({}):", entries.len());
    for (k, n) in &at_entries {
        eprintln!("  {n:>8}  {k}");
    }
    eprintln!(
        "counting patches for entry splices: {} generated and verified, {} failed",
        patches.0, patches.1
    );

    let started = Instant::now();
    let mut everywhere: BTreeMap<String, usize> = BTreeMap::new();
    let mut total = 0usize;
    for f in analysis.functions() {
        for insn in f.cfg.insns() {
            *everywhere
                .entry(kind(&plan(&ctx, insn.addr, k.patch)))
                .or_default() += 1;
            total += 1;
        }
    }
    eprintln!(
        "all {total} instructions planned in {:.2?}:",
        started.elapsed()
    );
    for (k, n) in &everywhere {
        eprintln!("  {n:>8}  {k}");
    }

    let mut group = c.benchmark_group("splice_plan");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    group.bench_function(format!("plan_{}_entries", entries.len()), |b| {
        b.iter(|| {
            entries
                .iter()
                .filter(|&&a| matches!(plan(&ctx, a, k.patch), SpliceDecision::Splice(_)))
                .count()
        });
    });
    group.finish();
}

criterion_group!(benches, bench_plan);
criterion_main!(benches);
