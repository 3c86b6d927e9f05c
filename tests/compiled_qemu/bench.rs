//! By-hand benches (`--ignored`): a compiled probe against the host-evaluated one and the
//! guest's own kprobe, and a mixed script's compiled probe.

use super::*;

/// The least `EXOTAP-RESULT PREFIXn.pread.ns_per_call` over the rounds n of a transcript
/// (the machine is noisy: the minimum is the loop undisturbed).
fn pread_ns(console: &str, prefix: &str) -> f64 {
    (0..ROUNDS)
        .filter_map(|n| result(console, &format!("{prefix}{n}.pread.ns_per_call")))
        .filter_map(|v| v.parse::<f64>().ok())
        .fold(f64::NAN, f64::min)
}

/// Rounds of each loop in a bench guest.
const ROUNDS: u32 = 3;

/// Boots one guest that runs `syscall-loop N` unprobed (`base.`), with the probes of `args`
/// between its `attach`/`detach` (or `splice`/`unsplice`) waits (`probed.`), then with the
/// guest's own kprobe on vfs_read (`kprobe.`); returns the console.
fn bench_boot(args: &[&str], waits: (&str, &str), calls: u32) -> String {
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let rounds = |prefix: &str| -> String {
        (0..ROUNDS)
            .map(|n| format!("syscall-loop {calls} | sed 's/RESULT /RESULT {prefix}{n}./'\n"))
            .collect()
    };
    let job = format!(
        "T=/sys/kernel/tracing\n\
         {}\
         exotap_wait {}\n\
         {}\
         exotap_wait {}\n\
         echo 'p:exotap/vr vfs_read' >> $T/kprobe_events\n\
         echo 1 > $T/events/exotap/enable\n\
         {}\
         echo 0 > $T/events/exotap/enable\n\
         echo > $T/kprobe_events\n\
         {}",
        rounds("base"),
        waits.0,
        rounds("probed"),
        waits.1,
        rounds("kprobe"),
        rounds("after"),
    );
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();
    let (code, out, err) = run(exotap()
        .args(args)
        .arg("--job")
        .arg(&job_file)
        .arg("--console")
        .arg(&console));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    std::fs::read_to_string(&console).unwrap()
}

/// Per-hit cost of `s[execname()] <<< $count` on vfs_read: compiled, host-evaluated, the
/// guest's own kprobe (each against the unprobed loop of the same guest) and `exotap count`.
/// Run by hand: `cargo test --release --test compiled_qemu -- --ignored --nocapture bench`.
#[test]
#[ignore = "a benchmark: run by hand, numbers in the closing note"]
fn bench_compiled_vs_host_evaluated_vs_guest_kprobe() {
    if !have_qemu("bench_compiled_vs_host_evaluated_vs_guest_kprobe") {
        return;
    }
    let script = r#"global s; probe kernel.function("vfs_read") { s[execname()] <<< $count }"#;
    let boot = |mode: &'static str| -> Vec<&'static str> {
        vec![
            "boot",
            "--timeout",
            "900",
            "--attach-in-job",
            "--compile",
            mode,
            "--script-text",
            script,
        ]
    };
    let compiled = bench_boot(&boot("require"), ("attach", "detach"), 20000);
    let host = bench_boot(&boot("never"), ("attach", "detach"), 100);
    let count = bench_boot(&["count", "vfs_read"], ("splice", "unsplice"), 20000);
    // Unprobed: the better of the loops before the install and after the kprobe.
    let bare = |c: &str| pread_ns(c, "base").min(pread_ns(c, "after"));
    let hit = |c: &str, p: &str| pread_ns(c, p) - bare(c);
    let (c, h, k, v) = (
        hit(&compiled, "probed"),
        hit(&host, "probed"),
        hit(&compiled, "kprobe"),
        hit(&count, "probed"),
    );
    println!(
        "vfs_read per-hit ns (pread ns/call minus the same guest's unprobed loop):\n\
         compiled {c:.0} (base {:.0}), host-evaluated {h:.0} (base {:.0}), guest kprobe {k:.0}, \
         count verb {v:.0} (base {:.0})\n\
         host/compiled {:.0}x, kprobe/compiled {:.2}, compiled/count {:.2}",
        bare(&compiled),
        bare(&host),
        bare(&count),
        h / c.max(1.0),
        k / c.max(1.0),
        c / v.max(1.0),
    );
    // Inclusive time of ksys_read measured by a compiled entry/return pair, against the
    // workload's own timing of the same read(2) calls (18 bytes of /dev/zero) unprobed, in the
    // same guest. The script finds the median from 50 ns buckets.
    let timing = r#"global t, d, b
        probe kernel.function("ksys_read") { if (execname() == "syscall-loop") t[tid()] = gettimeofday_ns() }
        probe kernel.function("ksys_read").return {
          if (execname() == "syscall-loop" && tid() in t) {
            n = gettimeofday_ns() - t[tid()]; delete t[tid()]
            d <<< n; b[n < 100000 ? n / 50 : 2000]++
          }
        }
        probe end {
          foreach (k+ in b) { seen += b[k]; if (seen * 2 >= @count(d)) { printf("median=%d\n", k * 50); break } }
          printf("avg=%d count=%d\n", @avg(d), @count(d)); print(@hist_log(d))
        }"#;
    let dir = tempfile::tempdir().unwrap();
    let (console, job) = (dir.path().join("console.log"), dir.path().join("job.sh"));
    std::fs::write(
        &job,
        "syscall-loop 20000 read | sed 's/RESULT /RESULT base./'\n\
         exotap_wait attach\nsyscall-loop 20000 read\nexotap_wait detach\n",
    )
    .unwrap();
    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            "900",
            "--attach-in-job",
            "--compile",
            "require",
        ])
        .args(["--script-text", timing, "--job"])
        .arg(&job)
        .arg("--console")
        .arg(&console));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let console = std::fs::read_to_string(&console).unwrap();
    let ns = |key: &str| -> f64 {
        result(&console, key)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} on the console:\n{console}"))
    };
    let (base, probed) = (ns("base.read.ns_per_call"), ns("read.ns_per_call"));
    let median = out
        .lines()
        .find_map(|l| l.strip_prefix("median="))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("the script's median");
    println!(
        "ksys_read inclusive time (compiled):\n{out}\n\
         median {median:.0} ns; the workload's read(2): {base:.0} ns/call unprobed, \
         {probed:.0} probed; median/unprobed {:.2}",
        median / base
    );
    assert!(
        median <= 2.0 * base && median * 2.0 >= base,
        "median {median} ns against {base} ns/call"
    );
}

#[test]
#[ignore = "a benchmark: run by hand, numbers in the closing note"]
fn bench_a_mixed_scripts_compiled_probe_costs_what_a_compiled_scripts_does() {
    if !have_qemu("bench_a_mixed_scripts_compiled_probe_costs_what_a_compiled_scripts_does") {
        return;
    }
    let compiled = r#"global s; probe kernel.function("vfs_read") { s[execname()] <<< $count }"#;
    // The same probe beside a host-evaluated one (`symdata()` does not compile) on a
    // function the workload never calls.
    let mixed = r#"global s, w
        probe kernel.function("vfs_read") { s[execname()] <<< $count }
        probe kernel.function("ksys_sync") { if (symdata(2) != "") w++ }"#;
    let boot = |script: &'static str, mode: &'static str| -> Vec<&'static str> {
        vec![
            "boot",
            "--timeout",
            "900",
            "--attach-in-job",
            "--compile",
            mode,
            "--script-text",
            script,
        ]
    };
    let c = bench_boot(&boot(compiled, "require"), ("attach", "detach"), 20000);
    let m = bench_boot(&boot(mixed, "auto"), ("attach", "detach"), 20000);
    let bare = |c: &str| pread_ns(c, "base").min(pread_ns(c, "after"));
    let hit = |c: &str| pread_ns(c, "probed") - bare(c);
    println!(
        "vfs_read per-hit ns (pread ns/call minus the same guest's unprobed loop): compiled \
         script {:.0} (base {:.0}), the same probe in a mixed script {:.0} (base {:.0}), \
         mixed/compiled {:.2}",
        hit(&c),
        bare(&c),
        hit(&m),
        bare(&m),
        hit(&m) / hit(&c).max(1.0),
    );
}
