use super::*;
use exotap_introspect::x86::AnalysisConfig;
use exotap_vmm::control::{Machine, RegisterFile, X86Registers};
use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine, VCPU};
use iced_x86::code_asm::*;

const TEXT: u64 = 0xffff_ffff_8100_0000;
const HEAP: u64 = 0xffff_ffff_8200_0000;
const STACK_TOP: u64 = 0xffff_ffff_8010_0000;
const HALT: u64 = TEXT + 0xff0;
const G: u64 = TEXT + 0x100;

/// `f(n)`: sums `g(n) + ...` for n down to 1, calling `g` directly and through rsi;
/// `g` returns rax + 1 and leaves its own return address in rdx.
fn text() -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut top = a.create_label();
    let mut done = a.create_label();
    a.xor(eax, eax).unwrap();
    a.mov(rsi, G).unwrap();
    a.set_label(&mut top).unwrap();
    a.test(rdi, rdi).unwrap();
    a.je(done).unwrap();
    a.add(rax, rdi).unwrap();
    a.call(G).unwrap();
    a.call(rsi).unwrap();
    a.dec(rdi).unwrap();
    a.jmp(top).unwrap();
    a.set_label(&mut done).unwrap();
    a.ret().unwrap();
    let mut f = a.assemble(TEXT).unwrap();
    f.resize(0x100, 0xcc);
    let mut g = CodeAssembler::new(64).unwrap();
    g.mov(rdx, qword_ptr(rsp)).unwrap();
    g.lea(rax, qword_ptr(rax + 1)).unwrap();
    g.ret().unwrap();
    f.extend(g.assemble(G).unwrap());
    f.resize(0x1000, 0xcc);
    f[0xff0] = 0xf4;
    f
}

struct Fixture {
    bytes: Vec<u8>,
    f: FunctionAnalysis,
    g: FunctionAnalysis,
}

fn fixture() -> Fixture {
    let bytes = text();
    let config = AnalysisConfig::new();
    let f_end = TEXT + text_len(&bytes[..0x100]);
    let f = FunctionAnalysis::analyze(&bytes[..(f_end - TEXT) as usize], TEXT, &config);
    let g_len = text_len(&bytes[0x100..0x200]) as usize;
    let g = FunctionAnalysis::analyze(&bytes[0x100..0x100 + g_len], G, &config);
    Fixture { bytes, f, g }
}

fn text_len(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .rposition(|&b| b != 0xcc)
        .map_or(0, |i| i as u64 + 1)
}

fn layout(code: u64) -> CacheLayout {
    CacheLayout {
        code: HEAP..HEAP + code,
        counters: HEAP + 0x4000..HEAP + 0x5000,
        table: HEAP + 0x6000..HEAP + 0x8000,
    }
}

/// What one run ends with: (end, rax, rdx, instruction profile, counter bytes).
type Run = (
    RunEnd,
    u64,
    u64,
    std::collections::HashMap<u64, u64>,
    Vec<u8>,
);

/// Runs from `rip` with rdi = n; returns (end, rax, rdx, instruction profile, the
/// counter area's bytes).
fn run(bytes: &[u8], t: Option<&Translation>, rip: u64) -> Run {
    run_on(bytes, t, rip, 0, HEAP + 0x4000)
}

/// As [`run`], with the GS base `gs_base`, returning the 4 KiB at `counters`.
fn run_on(bytes: &[u8], t: Option<&Translation>, rip: u64, gs_base: u64, counters: u64) -> Run {
    let mut m = UnicornMachine::new(Isa::X86_64).unwrap();
    m.map(TEXT, 0x1000).unwrap();
    m.map(HEAP, 0x1_0000).unwrap();
    m.map(STACK_TOP - 0x1000, 0x1000).unwrap();
    m.write(TEXT, bytes).unwrap();
    if let Some(t) = t {
        m.write(t.code_at, &t.code).unwrap();
        m.write(t.table_at, &t.table).unwrap();
    }
    m.write(STACK_TOP - 8, &HALT.to_le_bytes()).unwrap();
    m.set_halt(Some(HALT)).unwrap();
    m.set_budget(100_000);
    let mut regs = X86Registers {
        rip,
        rflags: 0x2,
        ..X86Registers::default()
    };
    regs.gpr[5] = 4;
    regs.gpr[7] = STACK_TOP - 8;
    m.set_x86_registers(&regs).unwrap();
    m.set_gs_base(gs_base).unwrap();
    m.start_profile().unwrap();
    let end = m.run().unwrap();
    let profile = m.take_profile().unwrap_or_default();
    let RegisterFile::X86_64(r) = m.registers(VCPU).unwrap() else {
        panic!("not x86-64")
    };
    let mut bytes = vec![0; 0x1000];
    m.read(counters, &mut bytes).unwrap();
    (end, r.gpr[0], r.gpr[3], profile, bytes)
}

fn translate_both(fx: &Fixture, keyed: &[u64]) -> Translation {
    let view = CodeView::new(TEXT, &fx.bytes).unwrap();
    let mut t = Translator::new(layout(0x4000), keyed).unwrap();
    t.translate(view, &fx.f).unwrap();
    t.translate(view, &fx.g).unwrap();
    t.finish().unwrap()
}

#[test]
fn translated_function_computes_the_same_and_counts_every_leader_exactly() {
    let fx = fixture();
    let t = translate_both(&fx, &[]);
    let (end0, rax0, rdx0, profile, _) = run(&fx.bytes, None, TEXT);

    let entry = t.entry(TEXT).unwrap();
    let (end1, rax1, rdx1, _, counters) = run(&fx.bytes, Some(&t), entry);

    assert_eq!(end0, RunEnd::Halted(HALT));
    assert_eq!(end1, end0);
    assert_eq!((rax1, rdx1), (rax0, rdx0));
    for (leader, count) in t.counts(&counters) {
        assert_eq!(
            count,
            profile.get(&leader).copied().unwrap_or(0),
            "{leader:#x}"
        );
    }
    assert!(t.blocks.len() >= 5);
    assert!(t.exits.is_empty());
}

#[test]
fn per_cpu_counters_count_exactly_into_the_copy_of_the_cpu_that_ran() {
    // Two "CPUs": per-CPU bases 0x2000 apart; with this delta, CPU A's copy of the
    // counter area (HEAP+0x4000..) is at HEAP+0xa000 and CPU B's at HEAP+0xc000.
    const GS_A: u64 = HEAP - 0x10_0000;
    const GS_B: u64 = GS_A + 0x2000;
    let gs_delta = 0x6000u64.wrapping_sub(GS_A);
    let fx = fixture();
    let view = CodeView::new(TEXT, &fx.bytes).unwrap();
    let mut t = Translator::new(layout(0x4000), &[])
        .unwrap()
        .with_per_cpu_counters(gs_delta)
        .unwrap();
    assert_eq!(t.counter_mode(), CounterMode::PerCpu { gs_delta });
    t.translate(view, &fx.f).unwrap();
    t.translate(view, &fx.g).unwrap();
    let t = t.finish().unwrap();
    let (end0, rax0, rdx0, profile, _) = run(&fx.bytes, None, TEXT);
    let entry = t.entry(TEXT).unwrap();

    // The increment is a plain `inc qword gs:[disp32]`, no lock.
    let first = &t.blocks[0];
    let at = (first.cache - t.code_at) as usize + if first.saves_flags { 5 } else { 0 };
    let insn = iced_x86::Decoder::with_ip(64, &t.code[at..], first.cache, 0).decode();
    assert_eq!(insn.code(), Code::Inc_rm64, "{insn}");
    assert_eq!(insn.segment_prefix(), Register::GS);
    assert!(!insn.has_lock_prefix());
    let (end_a, rax_a, rdx_a, _, shared_a) =
        run_on(&fx.bytes, Some(&t), entry, GS_A, HEAP + 0x4000);
    let (_, _, _, _, copy_a) = run_on(&fx.bytes, Some(&t), entry, GS_A, HEAP + 0xa000);
    let (end_b, _, _, _, copy_b) = run_on(&fx.bytes, Some(&t), entry, GS_B, HEAP + 0xc000);
    let (_, _, _, _, other_b) = run_on(&fx.bytes, Some(&t), entry, GS_B, HEAP + 0xa000);

    assert_eq!(end_a, end0);
    assert_eq!(end_b, end0);
    assert_eq!((rax_a, rdx_a), (rax0, rdx0));
    for copy in [&copy_a, &copy_b] {
        for (leader, count) in t.counts(copy) {
            assert_eq!(
                count,
                profile.get(&leader).copied().unwrap_or(0),
                "{leader:#x}"
            );
        }
    }
    assert!(t.counts(&copy_a).iter().any(|&(_, c)| c > 1));
    // Nothing went to the shared area, nor to the other CPU's copy.
    assert!(shared_a.iter().all(|&b| b == 0));
    assert!(other_b.iter().all(|&b| b == 0));
}

#[test]
fn a_per_cpu_counter_area_out_of_gs_reach_is_refused() {
    let err = Translator::new(layout(0x4000), &[])
        .unwrap()
        .with_per_cpu_counters(1 << 40)
        .unwrap_err();
    assert!(
        matches!(err, TranslateError::CounterOutOfReach { .. }),
        "{err}"
    );
}

#[test]
fn callees_see_the_original_return_address() {
    let fx = fixture();
    let t = translate_both(&fx, &[]);
    let (_, _, rdx0, _, _) = run(&fx.bytes, None, TEXT);

    let (_, _, rdx1, _, _) = run(&fx.bytes, Some(&t), t.entry(TEXT).unwrap());

    assert!((TEXT..TEXT + 0x100).contains(&rdx0), "{rdx0:#x}");
    assert_eq!(rdx1, rdx0);
}

/// `h(n)`: calls `g` directly n times in a loop (`g` as in [`text`], at the same place).
fn direct_calls_text() -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut top = a.create_label();
    a.xor(eax, eax).unwrap();
    a.set_label(&mut top).unwrap();
    a.call(G).unwrap();
    a.add(rax, 2).unwrap();
    a.dec(rdi).unwrap();
    a.jne(top).unwrap();
    a.ret().unwrap();
    let mut bytes = a.assemble(TEXT).unwrap();
    bytes.resize(0x100, 0xcc);
    bytes.extend_from_slice(&text()[0x100..]);
    bytes
}

/// h alone translated, g left out: g's `ret` pops h's original return address, so after
/// the first call h runs on in its original code, uncounted. With g a native leaf, each
/// call is made from the cache and returns into it: every leader of h counts what ran,
/// h computes the same, and g sees a return address in the cache (the one place a stack
/// holds one).
#[test]
fn a_native_leaf_returns_into_the_cache_and_the_caller_counts_on() {
    let bytes = direct_calls_text();
    let h_end = TEXT + text_len(&bytes[..0x100]);
    let h = FunctionAnalysis::analyze(
        &bytes[..(h_end - TEXT) as usize],
        TEXT,
        &AnalysisConfig::new(),
    );
    let view = CodeView::new(TEXT, &bytes).unwrap();
    let translate = |leaves: HashSet<u64>| {
        let mut t = Translator::new(layout(0x4000), &[])
            .unwrap()
            .with_native_leaves(leaves);
        t.translate(view, &h).unwrap();
        t.finish().unwrap()
    };
    let (end0, rax0, _, profile, _) = run(&bytes, None, TEXT);
    let ran = |leader: u64| profile.get(&leader).copied().unwrap_or(0);

    let plain = translate(HashSet::new());
    let (end1, rax1, _, _, counters1) = run(&bytes, Some(&plain), plain.entry(TEXT).unwrap());
    let leaf = translate(HashSet::from([G]));
    let (end2, rax2, rdx2, _, counters2) = run(&bytes, Some(&leaf), leaf.entry(TEXT).unwrap());

    assert_eq!(end0, RunEnd::Halted(HALT));
    assert_eq!((&end1, rax1), (&end0, rax0));
    assert_eq!((&end2, rax2), (&end0, rax0));
    assert!(
        plain.counts(&counters1).iter().any(|&(l, c)| c < ran(l)),
        "every leader counted what ran without the leaf: {:?}",
        plain.counts(&counters1)
    );
    for (leader, count) in leaf.counts(&counters2) {
        assert_eq!(count, ran(leader), "{leader:#x}");
    }
    assert!(leaf.counts(&counters2).iter().any(|&(_, c)| c == 4));
    assert!(
        (leaf.code_at..leaf.code_at + leaf.code.len() as u64).contains(&rdx2),
        "{rdx2:#x}"
    );
}

#[test]
fn an_exception_table_instruction_runs_at_its_original_address() {
    let fx = fixture();
    let add = fx.f.cfg.insns()[4].addr;
    let t = translate_both(&fx, &[add]);
    let (_, rax0, _, _, _) = run(&fx.bytes, None, TEXT);

    let (end, rax1, _, profile, counters) = run(&fx.bytes, Some(&t), t.entry(TEXT).unwrap());

    assert_eq!(end, RunEnd::Halted(HALT));
    assert_eq!(rax1, rax0);
    assert_eq!(
        t.exits,
        vec![CacheExit {
            addr: add,
            reason: ExitReason::ExceptionTable
        }]
    );
    // It ran in place, once per loop iteration.
    assert_eq!(profile.get(&add).copied(), Some(4));
    assert!(t.counts(&counters).iter().any(|&(_, c)| c > 0));
}

#[test]
fn a_full_cache_refuses_the_function_and_every_later_one_and_stays_consistent() {
    let fx = fixture();
    let view = CodeView::new(TEXT, &fx.bytes).unwrap();
    let dispatch_only = Translator::new(layout(0x400), &[]).unwrap().code_used();
    let mut sizing = Translator::new(layout(0x4000), &[]).unwrap();
    sizing.translate(view, &fx.g).unwrap();
    let g_size = sizing.code_used() - dispatch_only;
    // Room for the dispatch routine and g, not for f.
    let mut filler = layout(0x400);
    filler.code.end = filler.code.start + dispatch_only + g_size + 8;
    let mut t2 = Translator::new(filler, &[]).unwrap();

    t2.translate(view, &fx.g).unwrap();
    let refused = t2.translate(view, &fx.f);
    let again = t2.translate(view, &fx.f);
    let translation = t2.finish().unwrap();
    // Entering at f's original code with g translated: g's returns find no
    // translation of f and return to the original.
    let (_, rax0, _, _, _) = run(&fx.bytes, None, TEXT);
    let (end, rax1, _, _, _) = run(&fx.bytes, Some(&translation), TEXT);

    assert!(matches!(
        refused,
        Err(TranslateError::Full {
            source: CacheError::CodeFull { .. },
            ..
        })
    ));
    assert!(matches!(again, Err(TranslateError::Full { .. })));
    assert!(translation.full.is_some());
    assert_eq!(translation.functions.len(), 1);
    assert_eq!((end, rax1), (RunEnd::Halted(HALT), rax0));
}

#[test]
fn a_lazy_target_goes_through_a_stub_that_is_relinked_to_its_later_translation() {
    let fx = fixture();
    let view = CodeView::new(TEXT, &fx.bytes).unwrap();
    let mut t = Translator::new(layout(0x4000), &[])
        .unwrap()
        .with_lazy(HashSet::from([G]));
    t.translate(view, &fx.f).unwrap();
    let first = t.link().unwrap();
    let before = t.snapshot();
    let (_, rax0, _, profile, _) = run(&fx.bytes, None, TEXT);
    // Before the host translates g, the stub runs g's original code.
    let (end1, rax1, _, _, _) = run(&fx.bytes, Some(&before), before.entry(TEXT).unwrap());

    t.translate(view, &fx.g).unwrap();
    let second = t.link().unwrap();
    let (stub, jump) = t.resolve(G).unwrap();
    let mut after = t.snapshot();
    let off = (stub - after.code_at) as usize;
    after.code[off..off + 5].copy_from_slice(&jump);
    let (end2, rax2, _, _, counters) = run(&fx.bytes, Some(&after), after.entry(TEXT).unwrap());

    assert_eq!(first.stubs, vec![(G, stub)]);
    assert_eq!(stub % STUB_BYTES, 0);
    assert_eq!(before.code[off], 0xe9);
    assert_eq!(second.code_at, first.code_at + first.code.len() as u64);
    assert_eq!(second.functions.len(), 1);
    assert_eq!(second.functions[0].start, G);
    assert!(second.stubs.is_empty() && !second.table.is_empty());
    assert_eq!((end1, rax1), (RunEnd::Halted(HALT), rax0));
    assert_eq!((end2, rax2), (RunEnd::Halted(HALT), rax0));
    // Relinked: g runs translated (directly through the stub, and through the table),
    // its returns land in f's translation, and every block counts as the profile.
    for (leader, count) in after.counts(&counters) {
        assert_eq!(
            count,
            profile.get(&leader).copied().unwrap_or(0),
            "{leader:#x}"
        );
    }
    assert_eq!(profile.get(&G).copied(), Some(8));
}

#[test]
fn a_lazy_target_the_full_cache_cannot_take_keeps_its_stub_to_the_original_code() {
    let fx = fixture();
    let view = CodeView::new(TEXT, &fx.bytes).unwrap();
    let mut sizing = Translator::new(layout(0x4000), &[])
        .unwrap()
        .with_lazy(HashSet::from([G]));
    sizing.translate(view, &fx.f).unwrap();
    let f_and_stub = sizing.link().unwrap();
    // Room for the dispatch routine, f and g's stub, not for g.
    let mut small = layout(0x400);
    small.code.end = f_and_stub.code_at + f_and_stub.code.len() as u64 + 4;
    let mut t = Translator::new(small, &[])
        .unwrap()
        .with_lazy(HashSet::from([G]));
    t.translate(view, &fx.f).unwrap();
    let first = t.link().unwrap();

    let refused = t.translate(view, &fx.g);
    let second = t.link().unwrap();
    let snapshot = t.snapshot();
    let (_, rax0, _, _, _) = run(&fx.bytes, None, TEXT);
    let (end, rax1, _, _, _) = run(&fx.bytes, Some(&snapshot), snapshot.entry(TEXT).unwrap());

    assert_eq!(first.stubs.len(), 1);
    assert!(matches!(refused, Err(TranslateError::Full { .. })));
    assert!(second.code.is_empty() && second.functions.is_empty());
    assert_eq!(t.resolve(G), None);
    // The stub still jumps to g's original code: the kernel computes the same.
    assert_eq!((end, rax1), (RunEnd::Halted(HALT), rax0));
}

#[test]
fn counters_save_flags_only_where_liveness_says_they_are_live() {
    let fx = fixture();

    let t = translate_both(&fx, &[]);

    // Every block of this fixture starts with a flag-writing instruction or a call.
    assert!(t.blocks.iter().all(|b| !b.saves_flags), "{:?}", t.blocks);
}

#[test]
fn a_counter_where_flags_are_live_keeps_every_status_flag() {
    // f: rax = rdi + rsi; jmp L; L: pushfq; pop rax; ret. The flags of the `add` are
    // live at L, so L's counter keeps them; the flags f returns must be the original's.
    let mut a = CodeAssembler::new(64).unwrap();
    let mut l = a.create_label();
    a.mov(rax, rdi).unwrap();
    a.add(rax, rsi).unwrap();
    a.jmp(l).unwrap();
    a.set_label(&mut l).unwrap();
    a.pushfq().unwrap();
    a.pop(rax).unwrap();
    a.ret().unwrap();
    let mut bytes = a.assemble(TEXT).unwrap();
    let f_len = bytes.len();
    bytes.resize(0x1000, 0xcc);
    bytes[0xff0] = 0xf4;
    let f = FunctionAnalysis::analyze(&bytes[..f_len], TEXT, &AnalysisConfig::new());
    let view = CodeView::new(TEXT, &bytes).unwrap();
    let mut tr = Translator::new(layout(0x4000), &[]).unwrap();
    tr.translate(view, &f).unwrap();
    let t = tr.finish().unwrap();
    assert!(t.blocks.iter().any(|b| b.saves_flags), "{:?}", t.blocks);
    let flags_after = |rip: u64, translated: bool, x: u64, y: u64| {
        let mut m = UnicornMachine::new(Isa::X86_64).unwrap();
        m.map(TEXT, 0x1000).unwrap();
        m.map(HEAP, 0x1_0000).unwrap();
        m.map(STACK_TOP - 0x1000, 0x1000).unwrap();
        m.write(TEXT, &bytes).unwrap();
        if translated {
            m.write(t.code_at, &t.code).unwrap();
            m.write(t.table_at, &t.table).unwrap();
        }
        m.write(STACK_TOP - 8, &HALT.to_le_bytes()).unwrap();
        m.set_halt(Some(HALT)).unwrap();
        m.set_budget(1_000);
        let mut regs = X86Registers {
            rip,
            rflags: 0x2,
            ..X86Registers::default()
        };
        regs.gpr[4] = y;
        regs.gpr[5] = x;
        regs.gpr[7] = STACK_TOP - 8;
        m.set_x86_registers(&regs).unwrap();
        assert_eq!(m.run().unwrap(), RunEnd::Halted(HALT));
        let RegisterFile::X86_64(r) = m.registers(VCPU).unwrap() else {
            panic!("not x86-64")
        };
        let mut counters = vec![0; 0x1000];
        m.read(HEAP + 0x4000, &mut counters).unwrap();
        (r.gpr[0] & 0x8d5, t.counts(&counters))
    };
    // OF SF AF PF; CF ZF AF PF; none.
    for (x, y) in [(i64::MAX as u64, 1), (u64::MAX, 1), (1, 2)] {
        let (original, _) = flags_after(TEXT, false, x, y);
        let (translated, counts) = flags_after(t.entry(TEXT).unwrap(), true, x, y);
        assert_eq!(translated, original, "{x:#x} + {y:#x}");
        assert!(counts.iter().all(|&(_, c)| c == 1), "{counts:?}");
    }
    assert_ne!(flags_after(TEXT, false, i64::MAX as u64, 1).0 & 0x800, 0);
    assert_ne!(flags_after(TEXT, false, u64::MAX, 1).0 & 0x41, 0);
}

#[test]
fn a_call_through_a_retpoline_thunk_enters_the_translated_callee_through_the_table() {
    // f: rax = 0; rcx = G; call THUNK (which does `jmp *%rcx`); ret.
    let thunk = TEXT + 0x200;
    let mut a = CodeAssembler::new(64).unwrap();
    a.xor(eax, eax).unwrap();
    a.mov(rcx, G).unwrap();
    a.call(thunk).unwrap();
    a.ret().unwrap();
    let mut bytes = a.assemble(TEXT).unwrap();
    let f_len = bytes.len();
    bytes.resize(0x100, 0xcc);
    let mut g = CodeAssembler::new(64).unwrap();
    g.lea(rax, qword_ptr(rax + 1)).unwrap();
    g.ret().unwrap();
    bytes.extend(g.assemble(G).unwrap());
    bytes.resize(0x200, 0xcc);
    let mut t = CodeAssembler::new(64).unwrap();
    t.jmp(rcx).unwrap();
    bytes.extend(t.assemble(thunk).unwrap());
    bytes.resize(0x1000, 0xcc);
    bytes[0xff0] = 0xf4;
    let config = AnalysisConfig::new();
    let f = FunctionAnalysis::analyze(&bytes[..f_len], TEXT, &config);
    let g = FunctionAnalysis::analyze(&bytes[0x100..0x105], G, &config);
    let view = CodeView::new(TEXT, &bytes).unwrap();
    let translate = |thunks: HashMap<u64, Register>| {
        let mut t = Translator::new(layout(0x4000), &[])
            .unwrap()
            .with_thunks(thunks);
        t.translate(view, &f).unwrap();
        t.translate(view, &g).unwrap();
        t.finish().unwrap()
    };
    let with = translate(HashMap::from([(thunk, Register::RCX)]));
    let without = translate(HashMap::new());
    let g_count = |t: &Translation, counters: &[u8]| {
        t.counts(counters)
            .into_iter()
            .find(|&(leader, _)| leader == G)
            .map(|(_, n)| n)
    };

    let (end1, rax1, _, _, c1) = run(&bytes, Some(&with), with.entry(TEXT).unwrap());
    let (end0, rax0, _, _, c0) = run(&bytes, Some(&without), without.entry(TEXT).unwrap());

    assert_eq!((end1, rax1), (RunEnd::Halted(HALT), 1));
    assert_eq!((end0, rax0), (RunEnd::Halted(HALT), 1));
    // Through the table g runs translated (counted); through the original thunk it
    // runs its original code (not counted).
    assert_eq!(g_count(&with, &c1), Some(1));
    assert_eq!(g_count(&without, &c0), Some(0));
}

#[test]
fn entry_splice_is_a_jmp_rel32_to_the_translation() {
    let splice = entry_splice(TEXT, HEAP + 0x40).unwrap();

    assert_eq!(splice[0], 0xe9);
    let rel = i32::from_le_bytes([splice[1], splice[2], splice[3], splice[4]]);
    assert_eq!(TEXT + 5 + rel as u64, HEAP + 0x40);
    assert_eq!(entry_splice(0x1000, 0xffff_ffff_8000_0000), None);
}

/// A function with `loop`, `jrcxz`, a call through a RIP-relative pointer, a jump
/// through a register and a `ret 8`: sums 1..=rdi into rax via `g`.
fn odd_flows() -> (Vec<u8>, Vec<FunctionAnalysis>) {
    let ptr_at = TEXT + 0x800;
    let mut a = CodeAssembler::new(64).unwrap();
    let mut top = a.create_label();
    let mut out = a.create_label();
    let mut after = a.create_label();
    a.xor(eax, eax).unwrap();
    a.mov(rcx, rdi).unwrap();
    a.jrcxz(out).unwrap();
    a.set_label(&mut top).unwrap();
    a.call(qword_ptr(ptr_at)).unwrap();
    a.loop_(top).unwrap();
    a.set_label(&mut out).unwrap();
    a.lea(rdx, qword_ptr(after)).unwrap();
    a.jmp(rdx).unwrap();
    a.int3().unwrap();
    a.set_label(&mut after).unwrap();
    a.push(rax).unwrap();
    a.call(G + 0x10).unwrap();
    a.ret().unwrap();
    let mut bytes = a.assemble(TEXT).unwrap();
    bytes.resize(0x100, 0xcc);
    // g: rax += rcx (called through the pointer); h, at G + 0x10: drops the word
    // pushed before the call with `ret 8`.
    let mut g = CodeAssembler::new(64).unwrap();
    g.add(rax, rcx).unwrap();
    g.ret().unwrap();
    bytes.extend(g.assemble(G).unwrap());
    bytes.resize(0x110, 0xcc);
    let mut h = CodeAssembler::new(64).unwrap();
    h.ret_1(8).unwrap();
    bytes.extend(h.assemble(G + 0x10).unwrap());
    bytes.resize(0x1000, 0xcc);
    bytes[0xff0] = 0xf4;
    bytes[0x800..0x808].copy_from_slice(&G.to_le_bytes());
    let config = AnalysisConfig::new();
    let f_len = text_len(&bytes[..0x100]) as usize;
    let f = FunctionAnalysis::analyze(&bytes[..f_len], TEXT, &config);
    let g = FunctionAnalysis::analyze(&bytes[0x100..0x104], G, &config);
    let h = FunctionAnalysis::analyze(&bytes[0x110..0x113], G + 0x10, &config);
    (bytes, vec![f, g, h])
}

#[test]
fn loop_jrcxz_memory_calls_register_jumps_and_ret_imm_run_as_the_original() {
    let (bytes, functions) = odd_flows();
    let view = CodeView::new(TEXT, &bytes).unwrap();
    let mut t = Translator::new(layout(0x4000), &[]).unwrap();
    for f in &functions {
        t.translate(view, f).unwrap();
    }
    let t = t.finish().unwrap();
    let (end0, rax0, _, profile, _) = run(&bytes, None, TEXT);

    let (end1, rax1, _, _, counters) = run(&bytes, Some(&t), t.entry(TEXT).unwrap());

    assert_eq!(end0, RunEnd::Halted(HALT));
    assert_eq!((end1, rax1), (end0, rax0));
    assert_eq!(rax0, 4 + 3 + 2 + 1);
    let exits: Vec<ExitReason> = t.exits.iter().map(|e| e.reason).collect();
    assert_eq!(exits, vec![ExitReason::Trap, ExitReason::SpecialReturn]);
    for (leader, count) in t.counts(&counters) {
        assert_eq!(
            count,
            profile.get(&leader).copied().unwrap_or(0),
            "{leader:#x}"
        );
    }
}

#[test]
fn hostile_text_gives_translations_inside_the_cache_or_errors_never_a_panic() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let config = AnalysisConfig::new();
    for round in 0..64u64 {
        let text: Vec<u8> = (0..1024).map(|_| next() as u8).collect();
        let view = CodeView::new(TEXT, &text).unwrap();
        let keyed: Vec<u64> = (0..8).map(|_| TEXT + next() % 1024).collect::<Vec<_>>();
        let mut keyed = keyed;
        keyed.sort_unstable();
        let code = 0x1000 * (1 + round % 4);
        let layout = layout(code);
        let mut t = Translator::new(layout.clone(), &keyed).unwrap();
        for start in (0..text.len()).step_by(64) {
            let f =
                FunctionAnalysis::analyze(&text[start..start + 64], TEXT + start as u64, &config);
            let _ = t.translate(view, &f);
        }

        let Ok(t) = t.finish() else {
            continue;
        };

        assert!(t.code.len() as u64 <= code);
        assert!(t
            .blocks
            .iter()
            .all(|b| layout.counters.contains(&b.counter) && layout.code.contains(&b.cache)));
    }
}

/// IBT (`CONFIG_X86_KERNEL_IBT`): an indirect `jmp` or `call` must land on an `endbr64`.
/// None lands in the cache: the kernel enters it by direct `jmp` (entry splices) and by the
/// dispatch routine's `ret`, and the cache itself holds no indirect branch (the fixture's
/// `call rsi` goes through the dispatch routine), so no address in it needs an `endbr64`,
/// and the code would hold on CET hardware too (QEMU TCG does not enforce IBT).
#[test]
fn the_cache_holds_no_indirect_jump_or_call() {
    let fx = fixture();
    let t = translate_both(&fx, &[]);
    let mut decoder =
        iced_x86::Decoder::with_ip(64, &t.code, t.code_at, iced_x86::DecoderOptions::NONE);
    let mut decoded = 0;
    for instr in &mut decoder {
        assert!(!instr.is_invalid(), "undecodable at {:#x}", instr.ip());
        assert!(
            !matches!(
                instr.flow_control(),
                FlowControl::IndirectBranch | FlowControl::IndirectCall
            ),
            "{instr} at {:#x}",
            instr.ip()
        );
        decoded += 1;
    }
    assert!(decoded > 20, "{decoded}");
    // The fixture's own indirect call is there to be rewritten.
    assert!(fx
        .f
        .cfg
        .insns()
        .iter()
        .any(|i| matches!(i.flow, exotap_introspect::x86::Flow::IndirectCall)));
}
