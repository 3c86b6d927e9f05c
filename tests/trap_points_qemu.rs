//! End-to-end: trap probes at 100 random non-entry instruction boundaries inside hot kernel
//! functions, all armed at once in one guest run (`exotap boot --script`).
//!
//! The points are chosen (seeded; the seed is printed, `EXOTAP_TRAP_SEED` repeats a run) from
//! the image's own text with the x86 analysis: each lies in a basic block that every path
//! from the function's entry to its exits goes through (it post-dominates the entry) and that
//! is on no cycle, so it runs exactly once per call. The independent expectation of every
//! point's hit count is then the number of calls of its function, which the guest counts
//! itself with a kprobe event on the function's entry (`kprobe_events`), filtered on the
//! workload's comm like the probes are. No guest kprobe sits at any of our points: the guest
//! only probes entries and the points are never entries.
//!
//! Functions whose graph hides edges (indirect jumps, reachable blocks that run off the end)
//! are left out; `EXOTAP_TRAP_DEBUG=1` says which and why.
//!
//! The points include relative branches, calls and returns (emulated by the host) and
//! RIP-relative instructions (relocated out of line); the test reports how many of each.
//!
//! `trap_probe_costs_against_the_guests_own_kprobe` (ignored: a bench, not a check) measures,
//! in one guest run, the per-hit cost of a trap probe and of the guest's kprobe on the same
//! function with the same workload, from the workload's own ns per call.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use common::{exotap, have_qemu, result, run};
use exotap_introspect::bzimage::{cached_kernel_dir, Vmlinux};
use exotap_introspect::kallsyms;
use exotap_introspect::symbols::SymbolTable;
use exotap_introspect::x86::{AnalysisConfig, BlockExit, Cfg, Flow, FunctionAnalysis};
use iced_x86::{Decoder, DecoderOptions, Mnemonic};

const KERNEL: &str = "6.1.0-50-cloud-amd64";
/// Calls of each system call syscall-loop makes: keeps the trap hits (milliseconds each
/// under TCG) to about ten thousand (40 took 254 s of CI's 2 cores; every count is exact at
/// any number, 20 halves the stops).
const CALLS: u64 = 20;
const POINTS: usize = 100;
/// Of each special kind, at least this many when the functions have them.
const PER_KIND: usize = 6;

/// Functions on syscall-loop's paths (getpid, getppid, open/close, pread) that the guest can
/// kprobe. Missing ones are left out. Not the slab allocator: it also runs in interrupts that
/// arrive while another kprobe's handler runs, where the guest's kprobes miss hits (runs with
/// `kmem_cache_free` showed trap counts exactly the guest's count plus its `nmissed`), and its
/// system-wide calls would dominate the trap hits.
const HOT: &[&str] = &[
    "__do_sys_getppid",
    "__task_pid_nr_ns",
    "do_sys_openat2",
    "getname_flags",
    "do_filp_open",
    "path_openat",
    "alloc_empty_file",
    "get_unused_fd_flags",
    "alloc_fd",
    "fd_install",
    "do_dentry_open",
    "vfs_open",
    "putname",
    "may_open",
    "close_fd",
    "filp_close",
    "fput",
    "__x64_sys_pread64",
    "vfs_read",
    "rw_verify_area",
    "__fget_light",
    "__fdget",
    "security_file_open",
    "security_file_permission",
    "lookup_fast",
    "complete_walk",
    "terminate_walk",
    "path_init",
    "step_into",
    "walk_component",
    "generic_permission",
    "inode_permission",
    "task_work_add",
    "dput",
    "mntput",
    "__fput",
    "touch_atime",
    "atime_needs_update",
];

/// A chosen point.
#[derive(Debug, Clone)]
struct Point {
    function: String,
    /// Index into the chosen functions.
    fidx: usize,
    addr: u64,
    offset: u64,
    kind: &'static str,
    text: String,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn bzimage() -> Option<PathBuf> {
    let path = cached_kernel_dir(KERNEL)?.join("vmlinuz");
    path.exists().then_some(path)
}

/// Blocks that end by leaving the function (return, tail call, conditional tail call).
fn leaves(cfg: &Cfg, b: usize) -> bool {
    let block = &cfg.blocks()[b];
    let last = &cfg.insns()[block.end as usize - 1];
    matches!(block.exit, BlockExit::Leave) || matches!(last.flow, Flow::CondTailJump { .. })
}

/// Blocks reachable from the entry without passing through `avoid`.
fn reachable(cfg: &Cfg, avoid: Option<usize>) -> Vec<bool> {
    let n = cfg.blocks().len();
    let mut seen = vec![false; n];
    let mut stack = vec![0usize];
    if avoid == Some(0) {
        return seen;
    }
    while let Some(b) = stack.pop() {
        if seen[b] {
            continue;
        }
        seen[b] = true;
        for s in cfg.successors(b).into_iter().flatten() {
            let s = s as usize;
            if Some(s) != avoid && !seen[s] {
                stack.push(s);
            }
        }
    }
    seen
}

/// Whether `b` lies on a cycle.
fn on_cycle(cfg: &Cfg, b: usize) -> bool {
    let n = cfg.blocks().len();
    let mut seen = vec![false; n];
    let mut stack: Vec<usize> = cfg
        .successors(b)
        .into_iter()
        .flatten()
        .map(|s| s as usize)
        .collect();
    while let Some(x) = stack.pop() {
        if x == b {
            return true;
        }
        if seen[x] {
            continue;
        }
        seen[x] = true;
        stack.extend(cfg.successors(x).into_iter().flatten().map(|s| s as usize));
    }
    false
}

/// The instructions named by `__ex_table` (a fault there is fixed up by address).
fn fixups(vmlinux: &Vmlinux) -> HashSet<u64> {
    let Some(section) = vmlinux.section("__ex_table") else {
        return HashSet::new();
    };
    let data = vmlinux.section_data("__ex_table").unwrap();
    data.chunks_exact(12)
        .enumerate()
        .map(|(i, e)| {
            let rel = i32::from_le_bytes([e[0], e[1], e[2], e[3]]);
            (section.addr + 12 * i as u64).wrapping_add(rel as i64 as u64)
        })
        .collect()
}

/// Every instruction of `name` that runs exactly once per call, but the entry, with its kind.
fn once_per_call(
    vmlinux: &Vmlinux,
    symbols: &SymbolTable,
    config: &AnalysisConfig,
    fixups: &HashSet<u64>,
    name: &str,
) -> Option<Vec<(u64, &'static str, String)>> {
    let sym = symbols.get(name)?;
    if !sym.is_text() || sym.size == 0 {
        return None;
    }
    let code = vmlinux
        .read_at(sym.addr, usize::try_from(sym.size).ok()?)
        .ok()?;
    let fa = FunctionAnalysis::analyze(code, sym.addr, config);
    let cfg = &fa.cfg;
    let live = reachable(cfg, None);
    // Indirect jumps (jump tables) and branches into instructions hide edges: skip those.
    let hidden = !cfg.bad_targets().is_empty()
        || cfg.insns().iter().any(|i| {
            matches!(i.flow, Flow::IndirectJump | Flow::Invalid)
                || matches!(i.flow, Flow::TailJump { target }
                    if symbols.lookup_addr(target)
                        .is_some_and(|(s, _)| s.name.starts_with("__x86_indirect")))
        })
        || (0..cfg.blocks().len()).any(|b| {
            // Padding after the last return falls off the end unreached.
            live[b] && matches!(cfg.blocks()[b].exit, BlockExit::Unknown)
        });
    if hidden || cfg.blocks().is_empty() {
        if std::env::var_os("EXOTAP_TRAP_DEBUG").is_some() {
            let why: Vec<String> = cfg
                .insns()
                .iter()
                .filter(|i| matches!(i.flow, Flow::IndirectJump | Flow::Invalid))
                .map(|i| format!("{:#x} {:?}", i.addr - sym.addr, i.flow))
                .collect();
            let unknown: Vec<usize> = (0..cfg.blocks().len())
                .filter(|b| matches!(cfg.blocks()[*b].exit, BlockExit::Unknown))
                .collect();
            eprintln!(
                "{name}: hidden: bad {:?} unknown blocks {unknown:?} {why:?}",
                cfg.bad_targets()
            );
        }
        return None;
    }
    let mut out = Vec::new();
    for (b, block) in cfg.blocks().iter().enumerate() {
        if !live[b] || on_cycle(cfg, b) {
            continue;
        }
        // Post-dominates the entry: without it no exit is reachable.
        if b != 0 {
            let without = reachable(cfg, Some(b));
            if (0..without.len()).any(|x| without[x] && leaves(cfg, x)) {
                continue;
            }
        }
        for insn in &cfg.insns()[block.first as usize..block.end as usize] {
            if insn.addr == sym.addr || fixups.contains(&insn.addr) {
                continue;
            }
            let bytes = &code[(insn.addr - sym.addr) as usize..];
            let instr = Decoder::with_ip(64, bytes, insn.addr, DecoderOptions::NONE).decode();
            let kind = match instr.mnemonic() {
                // Alternatives and padding: what boot patched in may have other boundaries.
                Mnemonic::Nop
                | Mnemonic::Int3
                | Mnemonic::Ud2
                | Mnemonic::Clac
                | Mnemonic::Stac
                | Mnemonic::Lfence => continue,
                _ => match insn.flow {
                    Flow::Jump { .. } | Flow::TailJump { .. } => "jmp",
                    Flow::CondJump { .. } | Flow::CondTailJump { .. } => "jcc",
                    Flow::Call { .. } => "call",
                    Flow::Return => "ret",
                    _ if instr.is_ip_rel_memory_operand() => "rip-relative",
                    _ => "other",
                },
            };
            out.push((insn.addr, kind, instr.to_string()));
        }
    }
    Some(out)
}

/// Chooses the points: up to [`PER_KIND`] of each special kind first, then at random.
fn choose(seed: u64) -> Option<(Vec<String>, Vec<Point>)> {
    let bytes = std::fs::read(bzimage()?).ok()?;
    let vmlinux = Vmlinux::from_bzimage(&bytes).unwrap();
    let symbols = SymbolTable::from_kallsyms(&kallsyms::extract(&vmlinux).unwrap());
    let mut config = AnalysisConfig::new();
    if let Some(thunk) = symbols.get("__x86_return_thunk") {
        config = config.with_return_thunk(thunk.addr);
    }
    let fixups = fixups(&vmlinux);
    let mut functions = Vec::new();
    let mut pool = Vec::new();
    for name in HOT {
        let Some(found) = once_per_call(&vmlinux, &symbols, &config, &fixups, name) else {
            continue;
        };
        if found.is_empty() {
            continue;
        }
        let start = symbols.get(name).unwrap().addr;
        let fidx = functions.len();
        functions.push((*name).to_owned());
        pool.extend(found.into_iter().map(|(addr, kind, text)| Point {
            function: (*name).to_owned(),
            fidx,
            addr,
            offset: addr - start,
            kind,
            text,
        }));
    }
    let mut state = seed;
    let mut chosen: Vec<Point> = Vec::new();
    for kind in ["jcc", "jmp", "call", "ret", "rip-relative"] {
        let mut of_kind: Vec<usize> = (0..pool.len()).filter(|i| pool[*i].kind == kind).collect();
        for _ in 0..PER_KIND {
            if of_kind.is_empty() {
                break;
            }
            let pick = of_kind.swap_remove((splitmix(&mut state) % of_kind.len() as u64) as usize);
            chosen.push(pool[pick].clone());
        }
    }
    let taken: HashSet<u64> = chosen.iter().map(|p| p.addr).collect();
    let mut rest: Vec<Point> = pool
        .into_iter()
        .filter(|p| !taken.contains(&p.addr))
        .collect();
    while chosen.len() < POINTS && !rest.is_empty() {
        let pick = (splitmix(&mut state) % rest.len() as u64) as usize;
        chosen.push(rest.swap_remove(pick));
    }
    Some((functions, chosen))
}

fn seed() -> u64 {
    std::env::var("EXOTAP_TRAP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

fn kinds(points: &[Point]) -> BTreeMap<&'static str, usize> {
    let mut k = BTreeMap::new();
    for p in points {
        *k.entry(p.kind).or_insert(0) += 1;
    }
    k
}

#[test]
fn enough_once_per_call_points_of_every_kind_in_the_hot_functions() {
    if bzimage().is_none() {
        eprintln!("SKIP: the {KERNEL} kernel is not cached (exotap boot fetches it)");
        return;
    }
    let seed = seed();
    println!("seed {seed}");
    let (functions, points) = choose(seed).unwrap();
    let kinds = kinds(&points);
    println!("{} functions, kinds {kinds:?}", functions.len());
    for p in &points {
        println!("{}+{:#x} {} {}", p.function, p.offset, p.kind, p.text);
    }

    assert_eq!(points.len(), POINTS);
    for kind in ["jcc", "call", "ret", "rip-relative"] {
        assert!(
            kinds.get(kind).copied().unwrap_or(0) > 0,
            "no {kind}: {kinds:?}"
        );
    }
    let distinct: HashSet<u64> = points.iter().map(|p| p.addr).collect();
    assert_eq!(distinct.len(), POINTS);
}

fn value(out: &str, key: &str) -> Option<u64> {
    let prefix = format!("{key}=");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn trap_probes_at_100_random_instruction_boundaries_count_like_the_guests_kprobes() {
    if !have_qemu("trap_probes_at_100_random_instruction_boundaries") {
        return;
    }
    random_points_count_like_the_guests_kprobes("never");
}

/// The same points compiled (`--compile require`): a splice where the planner accepts the
/// instruction, else the compiled body behind a breakpoint; every one must compile.
#[test]
fn compiled_statements_at_100_random_instruction_boundaries_count_like_the_guests_kprobes() {
    if !have_qemu("compiled_statements_at_100_random_instruction_boundaries") {
        return;
    }
    random_points_count_like_the_guests_kprobes("require");
}

/// 100 random points of the hot functions as `kernel.statement(ADDR).absolute` probes run
/// with `--compile MODE`, each point's hits against the guest's own kprobe on its function.
fn random_points_count_like_the_guests_kprobes(mode: &str) {
    if bzimage().is_none() {
        eprintln!("SKIP: the {KERNEL} kernel is not cached (exotap boot fetches it)");
        return;
    }
    let seed = seed();
    let (functions, points) = choose(seed).unwrap();
    assert_eq!(points.len(), POINTS, "seed {seed}");
    let kinds = kinds(&points);
    eprintln!(
        "seed {seed} (EXOTAP_TRAP_SEED={seed} repeats it): {POINTS} points in {} functions, \
         kinds {kinds:?}",
        functions.len()
    );

    // The guest counts the calls of every function that has a point, on the workload's comm.
    // In as few syscalls as the shell allows: the job runs under the probes (with `--compile
    // never` each of its syscalls stops the guest at a trap or more), so the kprobes are
    // defined in one write, the comm filtered by one filter of their subsystem (the comm at
    // the event: the trace's own `comm-pid` column is the pid's latest comm, which names a
    // forked shell after its exec too), and the results printed by awk through one pipe, not
    // a shell loop (both tests: 98 s instead of 213 s, side by side on one machine).
    let used: Vec<usize> = {
        let mut u: Vec<usize> = points.iter().map(|p| p.fidx).collect();
        u.sort_unstable();
        u.dedup();
        u
    };
    let events: String = used
        .iter()
        .map(|f| format!("p:exotap/tp{f} {}\\n", functions[*f]))
        .collect();
    // `sleep 1`: the parent wakes while the exiting workload still frees its last objects
    // under its own comm; the kprobes must still see those.
    let job = format!(
        "T=/sys/kernel/tracing\n\
         echo 8192 > $T/buffer_size_kb\n\
         echo > $T/trace\n\
         printf '{events}' >> $T/kprobe_events || exotap_result kprobe.failed 1\n\
         echo 'comm == \"syscall-loop\"' > $T/events/exotap/filter\n\
         echo 1 > $T/events/exotap/enable\n\
         syscall-loop {CALLS}\n\
         sleep 1\n\
         echo 0 > $T/events/exotap/enable\n\
         cat $T/kprobe_profile\n\
         {{ awk '$1 ~ /tp[0-9]+$/ {{sub(/.*\\//, \"\", $1); print \"EXOTAP-RESULT kmiss.\" $1 \"=\" $3}}' $T/kprobe_profile\n\
           cat $T/per_cpu/cpu*/stats | awk '/^overrun/ {{s += $2}} END {{print \"EXOTAP-RESULT overruns=\" s+0}}'\n\
           awk '{{for (i = 1; i <= NF; i++) if ($i ~ /^tp[0-9]+:$/) c[$i]++}}\n\
                END {{for (k in c) printf \"EXOTAP-RESULT kprobe.%s=%d\\n\", substr(k, 1, length(k) - 1), c[k]}}' $T/trace\n\
         }} | cat\n"
    );
    let mut script = String::from("global hits\n");
    for (i, p) in points.iter().enumerate() {
        script += &format!(
            "probe kernel.statement({:#x}).absolute {{ if (execname() == \"syscall-loop\") hits[{i}]++ }}\n",
            p.addr
        );
    }
    script += "probe end { foreach (i in hits) printf(\"point%d=%d\\n\", i, hits[i]) }\n";
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let job_file = dir.path().join("job.sh");
    let script_file = dir.path().join("points.stp");
    std::fs::write(&job_file, job).unwrap();
    std::fs::write(&script_file, script).unwrap();

    let (code, out, err) = run(exotap()
        .args(["boot", "--timeout", "1500", "--compile", mode, "--script"])
        .arg(&script_file)
        .arg("--job")
        .arg(&job_file)
        .arg("--console")
        .arg(&console));

    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    let ctx = format!("seed {seed}\nstdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    // The workload completed.
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    for call in ["getpid", "getppid", "open_close", "pread"] {
        assert_eq!(
            result(&out, &format!("{call}.calls")),
            Some(CALLS.to_string().as_str()),
            "{ctx}"
        );
    }
    assert_eq!(result(&out, "kprobe.failed"), None, "{ctx}");
    assert_eq!(result(&out, "overruns"), Some("0"), "{ctx}");
    for bad in [
        "Oops",
        "BUG:",
        "WARNING:",
        "general protection",
        "kernel panic",
    ] {
        assert!(
            !transcript.contains(bad),
            "{bad} in the console:\n{transcript}"
        );
    }
    if mode == "never" {
        assert!(
            err.contains(&format!("armed {POINTS} probe sites")) && err.contains("refused 0"),
            "{ctx}"
        );
    } else {
        // --compile require ran (code 0): every probe compiled; none was left out.
        assert!(!err.contains("not instrumented"), "{ctx}");
    }
    let mut wrong = Vec::new();
    let mut explained = Vec::new();
    let mut total = 0;
    for (i, p) in points.iter().enumerate() {
        let expected: u64 = result(&out, &format!("kprobe.tp{}", p.fidx))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let got = value(&out, &format!("point{i}")).unwrap_or(0);
        let missed: u64 = result(&out, &format!("kmiss.tp{}", p.fidx))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        total += got;
        if got > expected && got <= expected + missed {
            // The guest's kprobe missed hits (an interrupt arrived while another kprobe's
            // handler ran on that CPU, and the guest says so): the trap saw them.
            explained.push(format!(
                "{}+{:#x}: {got} hits, the guest counted {expected} calls and missed {missed}",
                p.function, p.offset
            ));
            continue;
        }
        if got != expected || expected == 0 {
            wrong.push(format!(
                "{}+{:#x} ({}, {}): {got} hits, the guest counted {expected} calls",
                p.function, p.offset, p.kind, p.text
            ));
        }
    }
    // What exotap made of the points with the live bytes (emulated kinds, out-of-line;
    // spliced or behind a breakpoint).
    for line in err
        .lines()
        .filter(|l| l.contains("armed ") || l.contains("compiled probes in at"))
    {
        eprintln!("{}", line.trim());
    }
    eprintln!(
        "{total} counted hits on {POINTS} points; kinds {kinds:?}; {} equal to the guest's \
         count, {} within its missed kprobe hits:\n{}",
        POINTS - wrong.len() - explained.len(),
        explained.len(),
        explained.join("\n")
    );
    assert!(wrong.is_empty(), "{}\n{ctx}", wrong.join("\n"));
}

/// Every value of `EXOTAP-RESULT key=value`, in console order.
fn results(console: &str, key: &str) -> Vec<u64> {
    let prefix = format!("EXOTAP-RESULT {key}=");
    console
        .lines()
        .filter_map(|l| l.find(&prefix).map(|at| &l[at + prefix.len()..]))
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// Bench, not a check: one guest run, three phases of the same workload (syscall-loop's
/// getppid loop, which times itself): a trap probe inside `__do_sys_getppid` (the script
/// exits after the phase's calls, which detaches), nothing, and the guest's own kprobe on
/// `__do_sys_getppid`. Per-hit cost = phase ns per call minus the bare one.
#[test]
#[ignore = "bench: run with --ignored --nocapture"]
fn trap_probe_costs_against_the_guests_own_kprobe() {
    if !have_qemu("trap_probe_costs_against_the_guests_own_kprobe") {
        return;
    }
    const TRAP_CALLS: u64 = 300;
    const CALLS: u64 = 20000;
    let job = format!(
        "syscall-loop {TRAP_CALLS}\n\
         sleep 1\n\
         syscall-loop {CALLS}\n\
         T=/sys/kernel/tracing\n\
         echo 'p:exotap/getppid __do_sys_getppid' >> $T/kprobe_events\n\
         echo 1 > $T/events/exotap/getppid/enable\n\
         syscall-loop {CALLS}\n\
         cat $T/kprobe_profile\n"
    );
    // +5: the instruction after the ftrace nop5 entry, run out of line.
    let script = format!(
        "global n\n\
         probe kernel.statement(\"__do_sys_getppid+5\") {{\n\
           if (execname() == \"syscall-loop\" && ++n == {TRAP_CALLS}) exit()\n\
         }}\n\
         probe end {{ printf(\"trap.hits=%d\\n\", n) }}\n"
    );
    let dir = tempfile::tempdir().unwrap();
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();

    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            "900",
            "--compile",
            "never",
            "--script-text",
            &script,
            "--job",
        ])
        .arg(&job_file)
        .args(["--console", "/dev/null"]));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(value(&out, "trap.hits"), Some(TRAP_CALLS), "{ctx}");
    let ns = results(&out, "getppid.ns_per_call");
    assert_eq!(ns.len(), 3, "{ctx}");
    let (trap, bare, kprobe) = (ns[0] as f64, ns[1] as f64, ns[2] as f64);
    let trap_hit = trap - bare;
    let kprobe_hit = kprobe - bare;
    println!(
        "getppid ns/call: bare {bare}, trap probe {trap}, guest kprobe {kprobe}\n\
         per hit: trap probe {trap_hit:.0} ns, guest kprobe {kprobe_hit:.0} ns, \
         ratio trap/kprobe {:.1}",
        trap_hit / kprobe_hit.max(1.0)
    );
}

#[test]
fn a_point_inside_an_instruction_is_refused_with_the_reason() {
    if !have_qemu("a_point_inside_an_instruction_is_refused_with_the_reason") {
        return;
    }
    // The entry is the 5-byte ftrace nop: +1 is inside it, +5 is the next instruction.
    let (code, out, err) = run(exotap().args([
        "boot",
        "--timeout",
        "300",
        "--script-text",
        r#"probe kernel.statement("__do_sys_getppid+1") { }"#,
        "--run",
        "true",
        "--console",
        "/dev/null",
    ]));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 125, "{ctx}");
    assert!(
        // __x64_sys_getppid and __do_sys_getppid share the address.
        err.contains("is not an instruction boundary of __")
            && err.contains("sys_getppid: it is inside the 5-byte instruction at"),
        "{ctx}"
    );
}
