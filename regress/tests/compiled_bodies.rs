//! Compiled probe bodies (exotap_probes::compile) run under Unicorn, hit by hit, against the
//! interpreter (exotap_probes::lang) as the oracle: after the same hits with the same
//! arguments and task, every global the guest code built decodes to what the interpreter
//! holds, and what it printed is what the interpreter printed. Errors (division by zero,
//! MAXACTION, a faulting kernel read, a full table) are counted in the data's header and the
//! code returns normally.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use exotap_probes::compile::{
    self, codegen::Env, data::Header, DataLayout, Facts, Interner, SiteBodies, SitePoint,
    TaskFields,
};
use exotap_probes::lang::context::CapturedContext;
use exotap_probes::lang::driver::{compile as check_script, ScriptSource};
use exotap_probes::lang::eval::Store;
use exotap_probes::lang::output::{Format, Output, SharedBuf};
use exotap_probes::lang::runtime::Session;
use exotap_probes::lang::value::{Stats, Value};
use exotap_probes::lang::Limits;
use exotap_vmm::control::X86Registers;
use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine};

const CODE: u64 = 0xffff_ffff_a000_0000;
const DATA: u64 = 0xffff_ffff_a100_0000;
const STACK: u64 = 0xffff_c900_0000_0000;
const PERCPU: u64 = 0xffff_8880_0100_0000;
const TASK: u64 = 0xffff_8880_0200_0000;
/// A stand-in for the kernel's `copy_from_kernel_nofault(dst, src, len)`: addresses below
/// 64 KiB fault (-EFAULT), others are copied byte by byte.
const COPY: u64 = CODE + 0xf_0000;

fn facts() -> Facts {
    Facts {
        current_task: 0x100,
        cpu_number: 0x108,
        task: TaskFields {
            pid: 0x10,
            tgid: Some(0x14),
            comm: 0x20,
            real_parent: Some(0x40),
            cred: Some(0x48),
            cred_uid: Some(0x4),
        },
        realtime_ns: None,
        copy_nofault: Some(COPY),
    }
}

/// One hit: the task and the two arguments.
#[derive(Debug, Clone)]
struct Hit {
    comm: &'static str,
    pid: i32,
    tgid: i32,
    a: i64,
    b: i64,
}

struct Rig {
    uc: UnicornMachine,
    layout: DataLayout,
    interner: Interner,
    entry: u64,
    end: u64,
}

fn rig(script: &str, limits: &Limits) -> (Rig, exotap_probes::lang::check::Program) {
    let prog = check_script(
        &ScriptSource {
            name: "t.stp".into(),
            text: script.into(),
        },
        limits,
    )
    .expect("the script checks");
    let facts = facts();
    let mut layout = DataLayout::new(&prog, limits).expect("lays out");
    if compile::codegen::prints(&prog) {
        layout = layout.with_rings(1);
    }
    let rt = compile::runtime(&layout, DATA, CODE).unwrap();
    let env = Env {
        prog: &prog,
        limits,
        facts: &facts,
        layout: &layout,
        data: DATA,
        helpers: &rt.helpers,
    };
    let mut interner = Interner::default();
    let bodies = SiteBodies {
        entry: vec![SitePoint {
            probe: 0,
            name: "kernel.function(\"f\")".into(),
            function: "f".into(),
            params: vec!["a".into(), "b".into()],
            is_return: false,
        }],
        ret: Vec::new(),
    };
    let entry = CODE + 0x8_0000;
    let mut code = compile::entry_code(env, &mut interner, entry, &bodies, None).expect("compiles");
    code.push(0xf4); // hlt: where the run ends (the relocated instruction would be here)
    let end = entry + code.len() as u64 - 1;

    let mut uc = UnicornMachine::new(Isa::X86_64).unwrap();
    uc.map(CODE, 1 << 20).unwrap();
    uc.map(DATA, layout.size.div_ceil(4096) * 4096).unwrap();
    uc.map(STACK, 64 << 10).unwrap();
    uc.map(PERCPU, 4096).unwrap();
    uc.map(TASK, 3 * 4096).unwrap();
    uc.write(CODE, &rt.code).unwrap();
    uc.write(entry, &code).unwrap();
    // copy_from_kernel_nofault: cmp rsi, 0x10000; jb fault; mov rcx, rdx; rep movsb;
    // xor eax, eax; ret; fault: mov rax, -14; ret
    let copy = [
        0x48, 0x81, 0xfe, 0x00, 0x00, 0x01, 0x00, // cmp rsi, 0x10000
        0x72, 0x08, // jb +8
        0x48, 0x89, 0xd1, // mov rcx, rdx
        0xf3, 0xa4, // rep movsb
        0x31, 0xc0, // xor eax, eax
        0xc3, // ret
        0x48, 0xc7, 0xc0, 0xf2, 0xff, 0xff, 0xff, // mov rax, -14
        0xc3, // ret
    ];
    uc.write(COPY, &copy).unwrap();
    let mut init = layout.initial(&prog, &mut interner);
    init.resize(layout.size as usize, 0);
    uc.write(DATA, &init).unwrap();
    uc.write(PERCPU + 0x100, &TASK.to_le_bytes()).unwrap();
    uc.write(PERCPU + 0x108, &0u32.to_le_bytes()).unwrap();
    // The parent (tgid 1) and the cred (uid 1000).
    uc.write(TASK + 0x40, &(TASK + 0x1000).to_le_bytes())
        .unwrap();
    uc.write(TASK + 0x1000 + 0x14, &1i32.to_le_bytes()).unwrap();
    uc.write(TASK + 0x48, &(TASK + 0x2000).to_le_bytes())
        .unwrap();
    uc.write(TASK + 0x2000 + 0x4, &1000u32.to_le_bytes())
        .unwrap();
    (
        Rig {
            uc,
            layout,
            interner,
            entry,
            end,
        },
        prog,
    )
}

impl Rig {
    fn hit(&mut self, h: &Hit) {
        let mut comm = [0u8; 16];
        comm[..h.comm.len()].copy_from_slice(h.comm.as_bytes());
        self.uc.write(TASK + 0x20, &comm).unwrap();
        self.uc.write(TASK + 0x10, &h.pid.to_le_bytes()).unwrap();
        self.uc.write(TASK + 0x14, &h.tgid.to_le_bytes()).unwrap();
        let mut regs = X86Registers::default();
        regs.gpr[5] = h.a as u64; // rdi
        regs.gpr[4] = h.b as u64; // rsi
        regs.gpr[7] = STACK + (60 << 10); // rsp
        regs.rip = self.entry;
        regs.rflags = 0x2;
        self.uc.set_x86_registers(&regs).unwrap();
        self.uc.set_gs_base(PERCPU).unwrap();
        self.uc.set_halt(Some(self.end)).unwrap();
        self.uc.set_budget(10_000_000);
        let end = self.uc.run().unwrap();
        assert!(
            matches!(end, RunEnd::Halted(_)),
            "the body did not return: {end:?}"
        );
    }

    fn data(&self) -> Vec<u8> {
        let mut buf = vec![0u8; self.layout.size as usize];
        self.uc.read(DATA, &mut buf).unwrap();
        buf
    }

    /// What the compiled code printed, in order.
    fn printed(&self) -> String {
        let Some(rings) = self.layout.ring_set(DATA) else {
            return String::new();
        };
        let mut head = [0u8; 8];
        self.uc.read(rings.ring(0), &mut head).unwrap();
        (0..u64::from_le_bytes(head))
            .map(|i| {
                let mut record = vec![0u8; rings.record as usize];
                self.uc.read(rings.slot(0, i), &mut record).unwrap();
                self.interner.render(&record).expect("a known format")
            })
            .collect()
    }
}

fn context(h: &Hit) -> CapturedContext {
    let mut ctx = CapturedContext {
        pid: i64::from(h.tgid),
        tid: i64::from(h.pid),
        ppid: 1,
        uid: 1000,
        execname: h.comm.into(),
        cpu: 0,
        probefunc: "f".into(),
        ..Default::default()
    };
    ctx.targets.insert("$a".into(), Value::Long(h.a));
    ctx.targets.insert("$b".into(), Value::Long(h.b));
    ctx
}

/// Pseudo-random hits (xorshift), with awkward values mixed in.
fn hits(n: usize) -> Vec<Hit> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let awkward = [
        0,
        1,
        -1,
        63,
        64,
        -64,
        1 << 40,
        i64::MIN,
        i64::MAX,
        99,
        100,
        -100,
        101,
    ];
    let comms = ["bash", "syscall-loop", "kworker/0:1", "a-long-name-15c"];
    (0..n)
        .map(|i| {
            let r = next();
            let b = if i % 3 == 0 {
                awkward[(r >> 8) as usize % awkward.len()]
            } else {
                (r as i64) >> (r % 50)
            };
            Hit {
                comm: comms[(r >> 4) as usize % comms.len()],
                pid: 100 + (r % 5) as i32,
                tgid: 100 + (r % 3) as i32,
                a: ((r >> 20) % 1000) as i64 - 200,
                b,
            }
        })
        .collect()
}

/// The interpreter's statistics with their running variance state cleared: the guest keeps
/// count, sum, min, max and buckets (scripts that read @variance do not compile).
fn without_variance(store: Store) -> Store {
    let clear = |mut s: Stats| {
        s.avg_s = 0;
        s.m2 = 0;
        s
    };
    match store {
        Store::Stats(s) => Store::Stats(clear(s)),
        Store::StatsArray(m) => {
            Store::StatsArray(m.into_iter().map(|(k, v)| (k, clear(v))).collect())
        }
        other => other,
    }
}

/// Runs `script` compiled under Unicorn and in the interpreter over the same hits; returns
/// the compiled run's header.
fn differential(script: &str, hits: &[Hit]) -> Header {
    differential_with(script, hits).0
}

/// As [`differential`], also saying how many hits the interpreter reported an error for.
fn differential_with(script: &str, hits: &[Hit]) -> (Header, u64) {
    let limits = Limits::default();
    let (mut rig, prog) = rig(script, &limits);
    let out = SharedBuf::default();
    let err = SharedBuf::default();
    let output = Output::new(Format::Text, Box::new(out.clone()), Box::new(err.clone()));
    let mut session = Session::new(&prog, limits.clone(), output, "t.stp", script);
    let mut failed = 0;
    for h in hits {
        rig.hit(h);
        if !session.fire(0, "kernel.function(\"f\")", &context(h)) {
            failed += 1;
        }
    }
    let data = rig.data();
    for name in prog.globals.keys() {
        let compiled = rig.layout.decode(name, &data, &rig.interner).unwrap();
        let interpreted = without_variance(session.global(name).unwrap().clone());
        assert_eq!(
            format!("{compiled:?}"),
            format!("{interpreted:?}"),
            "global {name} after {} hits",
            hits.len()
        );
    }
    assert_eq!(rig.printed(), out.contents(), "printed output");
    (Header::decode(&data), failed)
}

#[test]
fn arrays_statistics_arithmetic_and_context_match_the_interpreter() {
    let script = r#"
        global calls, sizes, small, last, tot, who, bits
        probe kernel.function("f") {
          calls[execname(), $a % 3]++
          sizes <<< $b
          if ($b < 0) small++
          last = execname()
          x = 0
          for (i = 0; i < $a % 5; i++) x += i * ($b >> 8)
          if ($a != 0) tot += x / $a - (x % 4) + (x << 2) - (x >> 1)
          who[pid(), tid()] <<< ppid() + uid() + cpu()
          bits[$b & 7] = $a > 0 && $b > 0 ? $a | $b : $a ^ ~$b
        }
        probe end { print(@hist_log(sizes)); print(@hist_linear(sizes, -100, 100, 25)) }
    "#;

    let header = differential(script, &hits(400));

    assert_eq!((header.valid, header.errors, header.dropped), (true, 0, 0));
}

#[test]
fn strings_in_keys_and_values_and_printf_match_the_interpreter() {
    let script = r#"
        global by, first, n
        probe kernel.function("f") {
          n++
          if (!(execname() in first)) first[execname()] = probefunc()
          s = execname() == "bash" ? "shell" : pp()
          by[s, execname(), $a] += $b % 1000
          if (n % 7 == 0) printf("%s %d %5d|%-4s|%x\n", execname(), n, $a, s == "shell" ? "sh" : "-", $b & 0xffff)
          if (n % 50 == 0) println("n=", n, " ", s)
        }
    "#;

    let header = differential(script, &hits(300));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn deleted_elements_come_back_as_new_ones_in_the_interpreters_order() {
    let script = r#"
        global t, d, seen, gone
        probe kernel.function("f") {
          k = $a % 13
          if (k in t) { d[k % 4] <<< t[k] + $b % 100; delete t[k]; gone++ }
          else t[k] = $b % 1000
          seen[execname()]++
          if ($b % 5 == 0) delete seen[execname()]
        }
    "#;

    let header = differential(script, &hits(500));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn a_division_by_zero_ends_the_hit_with_a_probe_error() {
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"global z, after; probe kernel.function("f") { z = 10 / $a; after++ }"#,
        &limits,
    );
    let hit = |a| Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a,
        b: 0,
    };

    rig.hit(&hit(0));
    rig.hit(&hit(5));
    rig.hit(&hit(-1));

    let data = rig.data();
    let header = Header::decode(&data);
    assert_eq!((header.errors, header.div_zero), (1, 1));
    assert_eq!(
        format!("{:?}", rig.layout.decode("after", &data, &rig.interner)),
        "Some(Scalar(Long(2)))",
        "the hit with the error stopped there"
    );
}

#[test]
fn an_endless_loop_runs_out_of_its_statement_budget() {
    let limits = Limits::default();
    let (mut rig, _) = rig(r#"probe kernel.function("f") { while (1) {} }"#, &limits);

    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: 0,
    });

    let header = Header::decode(&rig.data());
    assert_eq!((header.errors, header.max_action), (1, 1));
}

#[test]
fn a_faulting_kernel_read_is_a_probe_error_and_a_good_one_reads() {
    let limits = Limits::default();
    let (mut rig, _) = rig(
        r#"global v; probe kernel.function("f") { v = kernel_long($a) + kernel_int($a + 8) }"#,
        &limits,
    );
    rig.uc.write(TASK + 0x800, &7i64.to_le_bytes()).unwrap();
    rig.uc.write(TASK + 0x808, &(-2i32).to_le_bytes()).unwrap();

    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: 0,
        b: 0,
    });
    rig.hit(&Hit {
        comm: "t",
        pid: 1,
        tgid: 1,
        a: (TASK + 0x800) as i64,
        b: 0,
    });

    let data = rig.data();
    let header = Header::decode(&data);
    assert_eq!((header.errors, header.faults), (1, 1));
    assert_eq!(
        format!("{:?}", rig.layout.decode("v", &data, &rig.interner)),
        "Some(Scalar(Long(5)))"
    );
}

#[test]
fn an_array_past_its_size_overflows_with_a_probe_error_as_in_the_interpreter() {
    let script = r#"global a[4]; probe kernel.function("f") { a[$a]++; if ($a % 2) delete a[$a] }"#;
    let hits: Vec<Hit> = (0..100)
        .map(|a| Hit {
            comm: "t",
            pid: 1,
            tgid: 1,
            a,
            b: 0,
        })
        .collect();

    let (header, interpreter_errors) = differential_with(script, &hits);

    // Odd keys go at once, 0, 2, 4 and 6 stay: a[7] is the first insert into a full array.
    assert_eq!(interpreter_errors, 93);
    assert_eq!(
        (header.overflow, header.errors, header.dropped),
        (93, 93, 0)
    );
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
        };
        if !compile::check(&prog, &limits, &facts(), &[point]).is_empty() {
            continue;
        }
        let hit = Hit {
            comm: "corpus",
            pid: 7,
            tgid: 7,
            a: 3,
            b: -5,
        };
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
    assert!(
        compiled.len() >= 10,
        "only {} corpus cases compiled",
        compiled.len()
    );
}
