//! Constructs the guest cannot follow refused by name; casts, guarded bodies, `timer.profile`,
//! `addr()`/`user_mode()`, the run corpus as kernel probes, foreach over slices, calls that
//! never returned.

use super::nodes::*;
use super::*;

#[test]
fn foreach_and_try_forms_the_guest_cannot_follow_are_refused_by_name() {
    let cases = [
        (
            r#"global a; probe kernel.function("f") { a[$a]++; foreach (k in a) a[k + 1] = 1 }"#,
            "foreach over a whose body changes a",
        ),
        (
            r#"global a; probe kernel.function("f") { a[probefunc()]++; foreach (k+ in a) println(k) }"#,
            "sorted on strings, in a script with strings longer than 15 bytes",
        ),
        (
            r#"function g(n) { return 1 / n }
               probe kernel.function("f") { while (1) { try { g($a); break } catch { } } }"#,
            "break or continue out of a try block that calls user functions",
        ),
        (
            r#"probe kernel.function("f") { try { x = kernel_long($a) } catch (m) { println(m) } }"#,
            "a guest memory read inside try with catch (msg)",
        ),
    ];

    let refused: Vec<Vec<String>> = cases.iter().map(|(s, _)| refusals(s)).collect();

    for ((_, want), got) in cases.iter().zip(&refused) {
        assert!(
            got.len() == 1 && got[0].contains(want),
            "wanted {want:?}, got {got:?}"
        );
    }
}

#[test]
fn a_cast_reads_through_the_named_struct_and_a_null_pointer_is_a_fault() {
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"global v; probe kernel.function("f") { v = @cast($b, "struct node")->next->x }"#,
        &limits,
    );
    write_nodes(&mut rig.uc);
    let hit = |b: u64| Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: b as i64,
    };

    rig.hit(&hit(node(0)));
    rig.hit(&hit(0));

    let data = rig.data();
    let header = Header::decode(&data);
    assert_eq!((header.errors, header.faults), (1, 1));
    assert_eq!(
        format!("{:?}", rig.layout.decode("v", &data, &rig.interner)),
        format!("Some(Scalar(Long({})))", NODES[1].0)
    );
}

#[test]
fn guarded_bodies_run_only_for_their_first_argument() {
    // Two events of one class at their shared callback: each probe counts the calls whose
    // `__data` (here `$a`) is its own; an unguarded probe at the site counts them all.
    let limits = Limits::default();
    let script = r#"global n
        probe kernel.function("f") { n["first"]++ }
        probe kernel.function("f") { n["second"]++ }
        probe kernel.function("f") { n["all"]++ }"#;
    let (mut rig, _) = rig_guarded(
        script,
        &limits,
        &Invocation::default(),
        &[Some(0x1111), Some(0x2222), None],
    );
    for a in [0x1111, 0x2222, 0x2222, 0x3333, 0x2222] {
        rig.hit(&Hit {
            comm: "t",
            pid: 1,
            tgid: 1,
            a,
            b: 0,
        });
    }

    let data = rig.data();
    let n = format!(
        "{:?}",
        rig.layout.decode("n", &data, &rig.interner).unwrap()
    );
    for (key, count) in [("first", 1), ("second", 3), ("all", 5)] {
        assert!(
            n.contains(&format!("[Str(\"{key}\")]: Long({count})")),
            "{key} {count}: {n}"
        );
    }
}

#[test]
fn timer_profile_reads_the_ticks_interrupted_registers() {
    // The rig's CPU keeps its pt_regs pointer at gs:0x110 (its facts), ip at +0x80 and cs
    // at +0x88: a kernel pc, a user pc (cs 0x33), then no registers (a NULL pointer).
    let limits = Limits::default();
    let (mut rig, _) = rig_at(
        r#"global k, u
           probe timer.profile {
             if (user_mode()) u++; else k++
             printf("%s|%d %x\n", probefunc(), user_mode(), addr())
           }"#,
        &limits,
        &Invocation::default(),
        &[(None, "timer.profile")],
    );
    let regs = TASK + 0x2800;
    let hit = Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: 0,
    };
    for (at, pc, code_segment) in [
        (regs, 0xffff_ffff_8123_4567u64, 0x10u64),
        (regs, 0x40_1000, 0x33),
        (0, 0, 0),
    ] {
        rig.uc.write(PERCPU + 0x110, &at.to_le_bytes()).unwrap();
        rig.uc.write(regs + 0x80, &pc.to_le_bytes()).unwrap();
        rig.uc
            .write(regs + 0x88, &code_segment.to_le_bytes())
            .unwrap();
        rig.hit(&hit);
    }

    assert_eq!(rig.printed(), "|0 ffffffff81234567\n|1 401000\n|0 0\n");
    let data = rig.data();
    assert_eq!(Header::decode(&data).errors, 0);
}

#[test]
fn addr_and_user_mode_of_a_kernel_probe_are_its_point_in_kernel_mode() {
    // As the host-evaluated path answers them at its breakpoint: the probe point's address
    // (here the rig's site) and not user mode.
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"probe kernel.function("f") { printf("%x %d\n", addr(), user_mode()) }"#,
        &limits,
    );

    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: 0,
    });

    assert_eq!(rig.printed(), format!("{SITE:x} 0\n"));
}

#[test]
fn cast_subscripts_step_by_the_element_size_computed_or_constant() {
    // The nodes lie 0x40 bytes (sizeof(struct node)) apart from node(0); "alpha" is node 0's
    // name, node 1's s is 300.
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"global v, w, y, z, c
           probe kernel.function("f") {
             v = @cast($b, "struct node")[1]->x
             w = &@cast($b, "struct node")[$a + 1] - $b
             y = @cast($b, "struct node")->next[0]->s
             z = @cast($b, "struct node")->name[$a]
             c = @cast($b, "struct node")[$a]->name[1]
           }"#,
        &limits,
    );
    write_nodes(&mut rig.uc);

    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 2,
        b: node(0) as i64,
    });

    let data = rig.data();
    let header = Header::decode(&data);
    assert_eq!(header.errors, 0);
    let value = |name: &str| format!("{:?}", rig.layout.decode(name, &data, &rig.interner));
    let long = |v: i64| format!("Some(Scalar(Long({v})))");
    assert_eq!(value("v"), long(i64::from(NODES[1].0)));
    assert_eq!(value("w"), long(3 * 0x40));
    assert_eq!(value("y"), long(i64::from(NODES[1].3)));
    assert_eq!(value("z"), long(i64::from(b'p')));
    // Node 2's name is "fifteen-chars-x".
    assert_eq!(value("c"), long(i64::from(b'i')));
}

#[test]
fn user_string_of_a_bad_address_is_a_probe_error_and_prints_nothing() {
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"probe kernel.function("f") { println(user_string(1)) }"#,
        &limits,
    );

    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: 0,
    });

    let header = Header::decode(&rig.data());
    assert_eq!((header.errors, header.faults), (1, 1));
    assert_eq!(rig.printed(), "");
}

/// Every case of the language's run corpus (probes/tests/corpus/run) with one `begin` probe,
/// with that probe turned into a kernel probe: where its body compiles, one hit under Unicorn
/// leaves the globals and the output the interpreter gives, and an interpreter error is a
/// counted probe error.
#[test]
fn the_run_corpus_as_kernel_probes_matches_the_interpreter_wherever_it_compiles() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../probes/tests/corpus/run");
    let mut cases: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "stp"))
        .collect();
    cases.sort();
    let limits = Limits::default();
    let (mut one_begin, mut compiled) = (0, Vec::new());
    let mut reasons = std::collections::BTreeMap::<String, usize>::new();
    for case in &cases {
        let text = std::fs::read_to_string(case).unwrap();
        if text.matches("probe begin").count() != 1 || text.contains("probe begin(") {
            continue;
        }
        // The begin probe must be the script's first probe: the rig runs probe 0.
        let first = text.find("probe ").unwrap_or(0);
        if !text[first..].starts_with("probe begin") {
            continue;
        }
        one_begin += 1;
        let script = text.replacen("probe begin", "probe kernel.function(\"f\")", 1);
        let Ok(prog) = check_script(
            &ScriptSource {
                name: "t.stp".into(),
                text: script.clone(),
            },
            &limits,
        ) else {
            continue;
        };
        let point = SitePoint {
            probe: 0,
            name: "kernel.function(\"f\")".into(),
            function: "f".into(),
            params: vec!["a".into(), "b".into()],
            is_return: false,
            locals: None,
            guard: None,
        };
        let refused = compile::check(&prog, &limits, &facts(), &[point]);
        if let Some(first) = refused.first() {
            *reasons.entry(first.construct.clone()).or_insert(0) += 1;
            continue;
        }
        let hit = Hit {
            comm: "corpus",
            pid: 7,
            tgid: 7,
            a: 3,
            b: -5,
        };
        // Names the case when the body under Unicorn fails.
        eprintln!("corpus case {}", case.display());
        let (header, failed) = differential_with(&script, &[hit]);
        assert_eq!(header.errors, failed, "{}: probe errors", case.display());
        compiled.push(case.file_name().unwrap().to_string_lossy().into_owned());
    }
    println!(
        "run corpus: {} cases, {one_begin} with one begin probe, {} compiled as kernel probes and \
         matched the interpreter: {}",
        cases.len(),
        compiled.len(),
        compiled.join(" ")
    );
    let mut reasons: Vec<_> = reasons.into_iter().collect();
    reasons.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    for (why, n) in reasons {
        println!("  {n:3} did not compile: {why}");
    }
    // 53 of the 59 after foreach, user functions, try/catch, @variance, string order,
    // whole and wildcard deletes, @defined and wrapping arrays compiled; 73 of 99 with
    // strings built in the guest (64 of 94 before); 81 of 108 with isinstr, strpos,
    // stringat, strtol, str_replace and sprintf (6 cases of their own); 84 of 110 with
    // =~ and !~ (regex_match and 2 cases of their own): fewer is a regression.
    assert!(
        compiled.len() >= 84,
        "only {} corpus cases compiled",
        compiled.len()
    );
}

#[test]
fn foreach_over_slices_matches_the_interpreter_with_lookups_in_the_body() {
    // Slices on either key, of longs and strings, sorted and limited, nested in another
    // foreach, with lookups of other arrays in the body (they use the key buffers after the
    // slice's own).
    let script = r#"
        global a, b, names, n
        probe kernel.function("f") {
          n++
          a[$a % 5, n % 7]++
          b[n % 7] += $b % 100
          names[execname(), n % 3] = n
          if (n % 25 == 0) {
            foreach ([k, j] in a[$a % 5, *]) printf("%d %d %d %d\n", k, j, a[k, j], b[j])
            foreach ([k, j] in a[*, 3]- limit 2) printf("lim %d %d\n", k, j)
            foreach ([e, m] in names[execname(), *]) {
              foreach ([k, j] in a[m, *]+) printf("in %s %d %d %d\n", e, m, j, names[e, m])
            }
          }
        }
    "#;

    let header = differential(script, &hits(300));

    assert_eq!((header.valid, header.errors, header.dropped), (true, 0, 0));
}

/// Runs `code` (assembled at `CODE`) under Unicorn with `rsi` = `slot` until its `hlt`.
fn run_inflight(uc: &mut UnicornMachine, code: &[u8], slot: u64) {
    uc.write(CODE, code).unwrap();
    let mut regs = X86Registers::default();
    regs.gpr[4] = slot; // rsi
    regs.gpr[7] = STACK + (60 << 10); // rsp
    regs.rip = CODE;
    regs.rflags = 0x2;
    uc.set_x86_registers(&regs).unwrap();
    uc.set_halt(Some(CODE + code.len() as u64 - 1)).unwrap();
    uc.set_budget(100_000);
    let end = uc.run().unwrap();
    assert!(matches!(end, RunEnd::Halted(_)), "{end:?}");
}

/// The Unicorn rig for the return-address swap: the table at `DATA`, trampolines inside the
/// code region (the "heap"), a stack at `STACK`.
struct SwapRig {
    uc: UnicornMachine,
    misses: u64,
}

impl SwapRig {
    fn new() -> Self {
        use exotap_probes::compile::site::INFLIGHT_BYTES;
        let mut uc = UnicornMachine::new(Isa::X86_64).unwrap();
        uc.map(CODE, 1 << 20).unwrap();
        uc.map(DATA, (INFLIGHT_BYTES + 4096).div_ceil(4096) * 4096)
            .unwrap();
        uc.map(STACK, 64 << 10).unwrap();
        Self {
            uc,
            misses: DATA + INFLIGHT_BYTES,
        }
    }

    fn assemble(f: &dyn Fn(&mut CodeAssembler) -> Result<(), IcedError>) -> Vec<u8> {
        let mut a = CodeAssembler::new(64).unwrap();
        f(&mut a).unwrap();
        a.hlt().unwrap();
        a.assemble(CODE).unwrap()
    }

    /// The entry half of a function whose return trampoline is at `trampoline`.
    fn enter(&mut self, slot: u64, trampoline: u64) {
        use exotap_probes::compile::site::{emit_swap, ReturnSwap};
        let swap = ReturnSwap {
            table: DATA,
            misses: self.misses,
            trampoline,
            heap: (CODE, CODE + (1 << 20)),
        };
        let code = Self::assemble(&|a| {
            let mut done = a.create_label();
            emit_swap(a, &swap, done)?;
            a.set_label(&mut done)?;
            a.nop()
        });
        run_inflight(&mut self.uc, &code, slot);
    }

    /// What the trampoline at `trampoline` does to the table when `ret` popped `slot`: puts
    /// the original back and frees the call's slot.
    fn leave(&mut self, slot: u64, trampoline: u64) {
        use exotap_probes::compile::site::emit_unswap;
        let code = Self::assemble(&|a| {
            emit_unswap(a, DATA, trampoline)?;
            a.mov(qword_ptr(rcx), 0)
        });
        run_inflight(&mut self.uc, &code, slot);
    }

    fn word(&self, at: u64) -> u64 {
        let mut b = [0u8; 8];
        self.uc.read(at, &mut b).unwrap();
        u64::from_le_bytes(b)
    }

    /// Slots of the table keyed by `slot`.
    fn keyed(&self, slot: u64) -> usize {
        use exotap_probes::compile::site::{INFLIGHT_BYTES, SLOT};
        (0..INFLIGHT_BYTES / SLOT)
            .filter(|i| self.word(DATA + i * SLOT) == slot)
            .count()
    }
}

#[test]
fn a_call_that_never_returned_leaves_no_slot_a_later_call_at_the_same_stack_slot_returns_through() {
    let mut rig = SwapRig::new();
    let trampoline = CODE + 0x1000;
    let slot = STACK + 0x8ff0;

    // A call whose task exits inside it (its return never comes), then a new task on the same
    // stack calls through the same slot from another call site, and returns.
    rig.uc.write(slot, &0x1111u64.to_le_bytes()).unwrap();
    rig.enter(slot, trampoline);
    assert_eq!(rig.word(slot), trampoline);
    rig.uc.write(slot, &0x2222u64.to_le_bytes()).unwrap();
    rig.enter(slot, trampoline);
    rig.leave(slot, trampoline);

    assert_eq!(
        rig.word(slot),
        0x2222,
        "the return went to the dead call's caller"
    );
    assert_eq!(rig.keyed(slot), 0, "the dead call's slot is freed");
    assert_eq!(rig.word(rig.misses), 0);
}

#[test]
fn a_tail_call_into_another_probed_function_returns_through_both_trampolines_to_the_real_caller() {
    let mut rig = SwapRig::new();
    let (outer, inner) = (CODE + 0x1000, CODE + 0x2000);
    let slot = STACK + 0x8ff0;
    rig.uc.write(slot, &0x1111u64.to_le_bytes()).unwrap();

    // A's entry swaps; A ends in `jmp B`, so B enters with the same return-address slot.
    rig.enter(slot, outer);
    rig.enter(slot, inner);
    let swapped = rig.word(slot);
    // B's `ret` reaches B's trampoline, which returns into A's.
    rig.leave(slot, inner);
    let after_inner = rig.word(slot);
    rig.leave(slot, outer);

    assert_eq!(swapped, inner);
    assert_eq!(after_inner, outer, "B's trampoline returns into A's");
    assert_eq!(
        rig.word(slot),
        0x1111,
        "A's trampoline returns to A's caller"
    );
    assert_eq!(rig.keyed(slot), 0);
    assert_eq!(rig.word(rig.misses), 0);
}

#[test]
fn a_tail_call_back_into_a_function_already_in_the_chain_is_not_swapped_again() {
    let mut rig = SwapRig::new();
    let trampoline = CODE + 0x1000;
    let slot = STACK + 0x8ff0;
    rig.uc.write(slot, &0x1111u64.to_le_bytes()).unwrap();

    rig.enter(slot, trampoline);
    rig.enter(slot, trampoline);
    let keyed = rig.keyed(slot);
    rig.leave(slot, trampoline);

    assert_eq!(keyed, 1);
    assert_eq!(rig.word(rig.misses), 1, "the second entry counts a miss");
    assert_eq!(rig.word(slot), 0x1111);
}
