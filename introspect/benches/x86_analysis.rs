//! Benchmarks of the x86-64 structural analysis (decode + CFG + liveness).
//!
//! `synthetic`: ~14.7 MB of generated functions, the size of a Debian cloud kernel's
//! `.text`. `kernel`: the real `.text` of the cached 6.1 cloud kernel, with its kallsyms
//! function ranges; skipped (with a message) when the kernel is not in the cache
//! (`exotap image fetch` puts it there).
//!
//! Run: `cargo bench -p exotap-introspect --bench x86_analysis`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use exotap_introspect::bzimage::{cached_kernel_dir, Vmlinux};
use exotap_introspect::kallsyms;
use exotap_introspect::x86::{
    ranges_from_starts, AnalysisConfig, CodeView, Flow, FunctionRange, TextAnalysis,
};
use iced_x86::code_asm::*;

const BASE: u64 = 0xffff_ffff_8100_0000;
const TEXT_SIZE: usize = 14_700_000;
const RELEASE: &str = "6.1.0-50-cloud-amd64";

/// One function shaped like typical kernel code: prologue, a loop, calls, a diamond,
/// RIP-relative loads, a return through a thunk.
fn template(thunk: u64) -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut head = a.create_label();
    let mut other = a.create_label();
    let mut join = a.create_label();
    a.call(BASE - 0x1000).unwrap();
    a.push(rbp).unwrap();
    a.mov(rbp, rsp).unwrap();
    a.push(rbx).unwrap();
    a.push(r12).unwrap();
    a.mov(rbx, rdi).unwrap();
    a.xor(eax, eax).unwrap();
    a.set_label(&mut head).unwrap();
    a.add(rax, qword_ptr(rbx + rsi * 8 + 0x10)).unwrap();
    a.mov(r12, qword_ptr(rbx + 0x28)).unwrap();
    a.test(r12, r12).unwrap();
    a.je(other).unwrap();
    a.mov(rdi, r12).unwrap();
    a.call(BASE - 0x2000).unwrap();
    a.jmp(join).unwrap();
    a.set_label(&mut other).unwrap();
    a.lea(rdi, qword_ptr(rbx + 0x40)).unwrap();
    a.mov(esi, 0x10i32).unwrap();
    a.set_label(&mut join).unwrap();
    a.dec(rsi).unwrap();
    a.jne(head).unwrap();
    a.cmp(dword_ptr(rbx + 0x8), 3i32).unwrap();
    a.setne(al).unwrap();
    a.movzx(eax, al).unwrap();
    a.pop(r12).unwrap();
    a.pop(rbx).unwrap();
    a.pop(rbp).unwrap();
    a.jmp(thunk).unwrap();
    a.int3().unwrap();
    a.int3().unwrap();
    a.assemble(BASE).unwrap()
}

fn synthetic() -> (Vec<u8>, Vec<FunctionRange>, AnalysisConfig) {
    let thunk = BASE - 0x3000;
    let one = template(thunk);
    let count = TEXT_SIZE / one.len();
    let mut text = Vec::with_capacity(count * one.len());
    let mut starts = Vec::with_capacity(count);
    for i in 0..count {
        starts.push(BASE + (i * one.len()) as u64);
        text.extend_from_slice(&one);
    }
    let end = BASE + text.len() as u64;
    let config = AnalysisConfig::new().with_return_thunk(thunk);
    (text, ranges_from_starts(&starts, end), config)
}

fn bench_synthetic(c: &mut Criterion) {
    let (text, ranges, config) = synthetic();
    let view = CodeView::new(BASE, &text).unwrap();
    let mut group = c.benchmark_group("x86_analysis");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.bench_function(format!("synthetic_{}_functions", ranges.len()), |b| {
        b.iter(|| TextAnalysis::analyze(view, &ranges, &config));
    });
    group.finish();
}

/// The cached kernel's text, its function ranges and its return thunk.
fn kernel() -> Option<(Vec<u8>, u64, Vec<FunctionRange>, AnalysisConfig)> {
    let dir = cached_kernel_dir(RELEASE)?;
    let image = std::fs::read(dir.join("vmlinuz")).ok()?;
    let vmlinux = Vmlinux::from_bzimage(&image).ok()?;
    let syms = kallsyms::extract(&vmlinux).ok()?;
    let (start, end) = vmlinux.text_range().ok()?;
    let len = usize::try_from(end - start).ok()?;
    let text = vmlinux.read_at(start, len).ok()?.to_vec();
    let starts: Vec<u64> = syms
        .symbols
        .iter()
        .filter(|s| matches!(s.kind, 'T' | 't') && s.addr >= start && s.addr < end)
        .map(|s| s.addr)
        .collect();
    let mut config = AnalysisConfig::new();
    if let Some(thunk) = syms.symbols.iter().find(|s| s.name == "__x86_return_thunk") {
        config = config.with_return_thunk(thunk.addr);
    }
    Some((text, start, ranges_from_starts(&starts, end), config))
}

fn bench_kernel(c: &mut Criterion) {
    let Some((text, base, ranges, config)) = kernel() else {
        eprintln!("skipping x86_analysis/kernel: {RELEASE} is not in the kernel cache");
        return;
    };
    let view = CodeView::new(base, &text).unwrap();
    let once = TextAnalysis::analyze(view, &ranges, &config);
    eprintln!(
        "kernel text: {} bytes, {} functions, {} instructions, {} branch targets, {} rejected ranges",
        text.len(),
        once.function_count(),
        once.insn_count(),
        once.branch_targets().len(),
        once.rejected().len()
    );
    let inconsistent: Vec<_> = once
        .functions()
        .filter(|f| !f.cfg.bad_targets().is_empty())
        .collect();
    let invalid = once
        .functions()
        .flat_map(|f| f.cfg.insns())
        .filter(|i| i.flow == Flow::Invalid)
        .count();
    eprintln!(
        "kernel text: {} functions with a branch into an instruction (first: {:x?}), {invalid} undecodable instructions",
        inconsistent.len(),
        inconsistent.first().map(|f| (f.cfg.start(), f.cfg.bad_targets()[0])),
    );
    let mut group = c.benchmark_group("x86_analysis");
    group.throughput(Throughput::Bytes(text.len() as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.bench_function(format!("kernel_{RELEASE}"), |b| {
        b.iter(|| TextAnalysis::analyze(view, &ranges, &config));
    });
    group.finish();
}

criterion_group!(benches, bench_synthetic, bench_kernel);
criterion_main!(benches);
