//! End-to-end: the live splice engine against the Debian guest under QEMU
//! (`exotap count`, `exotap nullify`, `exotap splice-report`), booted by exotap or, with
//! `count --target`, by someone else.
//!
//! Oracles: the guest's own kprobes on the same functions (armed through its
//! `kprobe_events` before exotap splices, disarmed after exotap unsplices; on these
//! ftrace-able entries they put `call <ftrace trampoline>` in the entry, which the splice
//! relocates), read both by exotap from the guest's `trace_kprobe` counters at the very
//! stops where the splices go in and come out, and by the guest itself from
//! `kprobe_profile` around its wait points; the workload's own output (syscall-loop prints
//! how many calls it made and what getppid returned); `available_filter_functions`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;

use common::{boot_with_gdbstub, exotap, have_qemu, result, run};

/// Functions counted against the guest's kprobes: syscall entries, VFS, scheduler.
const FUNCTIONS: &[&str] = &[
    "__do_sys_getpid",
    "__do_sys_getppid",
    "__x64_sys_open",
    "__x64_sys_close",
    "__x64_sys_pread64",
    "ksys_read",
    "ksys_write",
    // Present in kallsyms but inlined into __x64_sys_pread64: both count 0.
    "ksys_pread64",
    "vfs_read",
    "vfs_write",
    "vfs_open",
    "rw_verify_area",
    "do_sys_openat2",
    "do_filp_open",
    "path_openat",
    "security_file_open",
    "alloc_empty_file",
    "fd_install",
    "close_fd",
    "filp_close",
    "fput",
    "__fput",
    "dput",
    "schedule",
    "try_to_wake_up",
    "pick_next_task_fair",
    "kernel_clone",
    "wake_up_new_task",
    "do_exit",
];

const CALLS: u64 = 300;

/// The count table: function → (ours, kprobe hits, kprobe misses), as exotap printed it.
fn table(out: &str) -> BTreeMap<String, (u64, Option<(u64, u64)>)> {
    let mut t = BTreeMap::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 4 {
            continue;
        }
        let Ok(ours) = f[0].parse::<u64>() else {
            continue;
        };
        let k = f[1].parse::<u64>().ok().zip(f[2].parse::<u64>().ok());
        t.insert(f[3].to_owned(), (ours, k));
    }
    t
}

/// The guest's vCPUs (`exotap boot`'s default).
const VCPUS: u64 = 2;

#[test]
fn counts_equal_the_guests_own_kprobe_hits_and_the_text_is_restored() {
    if !have_qemu("counts_equal_the_guests_own_kprobe_hits_and_the_text_is_restored") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let mut job = String::from("T=/sys/kernel/tracing\n");
    for (i, f) in FUNCTIONS.iter().enumerate() {
        job.push_str(&format!(
            "echo 'p:exotap/k{i} {f}' >> $T/kprobe_events || exotap_result kprobe_refused {f}\n"
        ));
    }
    job.push_str(
        "echo 1 > $T/events/exotap/enable\n\
         cat $T/kprobe_profile > /tmp/before\n\
         exotap_wait splice\n\
         syscall-loop 300\n\
         exotap_wait unsplice\n\
         cat $T/kprobe_profile > /tmp/after\n\
         awk 'NR==FNR {b[$1]=$2; next} {print \"EXOTAP-RESULT profile.\" $1 \"=\" $2-b[$1]}' /tmp/before /tmp/after\n\
         echo 0 > $T/events/exotap/enable\n\
         echo > $T/kprobe_events\n\
         exotap_result kprobes_left \"$(wc -l < $T/kprobe_events)\"\n",
    );
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();

    let mut cmd = exotap();
    cmd.arg("count")
        .args(FUNCTIONS)
        .arg("entry_SYSCALL_64")
        .args(["--compare-kprobes", "--timeout", "400", "--job"])
        .arg(&job_file)
        .arg("--console")
        .arg(&console);
    let started = std::time::Instant::now();
    let (code, out, err) = run(&mut cmd);
    let log = std::fs::read_to_string(&console).unwrap_or_default();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    eprintln!("{out}\n(took {:.0} s)", started.elapsed().as_secs_f64());

    // entry_SYSCALL_64 is refused with the planner's reason; everything else goes in.
    assert_eq!(code, 1, "{ctx}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("refused entry_SYSCALL_64") && l.contains("forbidden range")),
        "{ctx}"
    );
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    assert_eq!(result(&out, "getpid.calls"), Some("300"), "{ctx}");
    assert!(result(&out, "kprobe_refused").is_none(), "{ctx}");
    assert_eq!(result(&out, "kprobes_left"), Some("0"), "{ctx}");

    let t = table(&out);
    let mut compared = 0;
    let mut exact = 0;
    for f in FUNCTIONS {
        let (ours, kprobe) = t
            .get(*f)
            .unwrap_or_else(|| panic!("no count for {f}\n{ctx}"));
        let (hits, missed) = kprobe.unwrap_or_else(|| panic!("no kprobe for {f}\n{ctx}"));
        // Every call runs the splice's counter and then the relocated ftrace call into the
        // kprobe, which counts a hit, or a miss when it finds another kprobe running. Both are
        // read at the install and removal stops: a vCPU stopped between the splice's counter
        // and the kprobe's (or one already inside the ftrace call when the splice went in)
        // is counted by one side only, at most one call per vCPU at each stop. Measured once
        // under load (CI of 2026-11-25): filp_close 323 against 324.
        assert!(
            ours.abs_diff(hits + missed) <= VCPUS,
            "{f}: splice {ours}, kprobe {hits}+{missed}\n{ctx}"
        );
        if *ours == hits + missed {
            exact += 1;
        }
        // The guest's own profile spans a wider window (it is read before and after the
        // waits, whose shell, dd and console work also call VFS and scheduler functions).
        let profile: u64 = result(
            &out,
            &format!(
                "profile.k{}",
                FUNCTIONS.iter().position(|x| x == f).unwrap()
            ),
        )
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no guest profile for {f}\n{ctx}"));
        assert!(
            profile >= hits,
            "{f}: guest profile {profile} < {hits}\n{ctx}"
        );
        eprintln!(
            "{f:<22} splice {ours:>8}  kprobe {hits:>8}+{missed}  guest profile {profile:>8}"
        );
        if *ours > 0 {
            compared += 1;
        }
    }
    assert!(compared >= 20, "only {compared} functions were hit\n{ctx}");
    // The race above is rare: nearly every function counts exactly what the kprobe did.
    assert!(
        exact + 2 >= FUNCTIONS.len(),
        "only {exact} of {} functions counted exactly what the kprobe did\n{ctx}",
        FUNCTIONS.len()
    );
    for f in [
        "__do_sys_getpid",
        "__do_sys_getppid",
        "__x64_sys_pread64",
        "__x64_sys_open",
    ] {
        assert_eq!(t[f].0, CALLS, "{f}\n{ctx}");
    }
    assert!(
        out.lines()
            .any(|l| l.starts_with("text: ") && l.ends_with(": identical")),
        "{ctx}"
    );
    for bad in [
        "WARNING:",
        "BUG:",
        "Oops",
        "ftrace failed",
        "ftrace faulted",
    ] {
        assert!(!log.contains(bad), "console has {bad}:\n{log}");
    }
}

#[test]
fn nullified_getppid_returns_4242_until_removed() {
    if !have_qemu("nullified_getppid_returns_4242_until_removed") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let job = "exotap_wait splice\n\
               syscall-loop 100 | sed 's/EXOTAP-RESULT getppid/EXOTAP-RESULT during.getppid/'\n\
               exotap_wait unsplice\n\
               syscall-loop 100 | sed 's/EXOTAP-RESULT getppid/EXOTAP-RESULT after.getppid/'\n\
               exotap_result shell.ppid \"$PPID\"\n";
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();

    let (code, out, err) = run(exotap()
        .args([
            "nullify",
            "__x64_sys_getppid",
            "4242",
            "--timeout",
            "300",
            "--job",
        ])
        .arg(&job_file)
        .arg("--console")
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(result(&out, "during.getppid.value"), Some("4242"), "{ctx}");
    let after: i64 = result(&out, "after.getppid.value")
        .unwrap()
        .parse()
        .unwrap();
    assert!(after > 1 && after != 4242, "{ctx}");
    // Every getppid of the workload ran the patch (its counter) and no other caller
    // was in the window but the workload's own 100 calls.
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["100", "__x64_sys_getppid"]),
        "{ctx}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("text: ") && l.ends_with(": identical")),
        "{ctx}"
    );
}

#[test]
fn unknown_functions_are_refused_before_booting() {
    if exotap_introspect::bzimage::cached_kernel_dir("6.1.0-50-cloud-amd64").is_none() {
        eprintln!(
            "SKIP unknown_functions_are_refused_before_booting: the guest kernel is not cached"
        );
        return;
    }
    let (code, _out, err) = run(exotap().args(["nullify", "no_such_function_xyz", "1"]));

    assert_eq!(code, 125);
    assert!(err.contains("no function no_such_function_xyz"), "{err}");
}

/// Bench, not a timed assertion: per-call cost of getpid unprobed, with the guest's own
/// kprobe on it, and with exotap's counting splice, in one guest run with the same workload
/// (syscall-loop times its own calls); and the install rate for 10,000 entry splices in one
/// batch. Run: `cargo test --test splice_qemu -- --ignored --nocapture bench` (the per-call
/// numbers are the guest's own and do not depend on how exotap was built; the install rate
/// does: `exotap splice-report --install 10000` from a release build gives it for release).
#[test]
#[ignore = "bench: prints numbers (about 2 minutes under TCG)"]
fn bench_splice_vs_kprobe_per_call_and_install_rate() {
    if !have_qemu("bench_splice_vs_kprobe_per_call_and_install_rate") {
        return;
    }
    // TCG on a shared host is noisy (one run of the same loop varies by 2x): every
    // condition is run ROUNDS times, interleaved where the choreography allows, and the
    // minimum (least disturbed) and median are compared.
    let n = 5000;
    const ROUNDS: usize = 7;
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let job = format!(
        "T=/sys/kernel/tracing\n\
         t() {{ syscall-loop {n} | sed -n \"s/EXOTAP-RESULT getpid.ns_per_call=/EXOTAP-RESULT $1=/p\"; }}\n\
         echo 'p:exotap/getpid __do_sys_getpid' >> $T/kprobe_events\n\
         for i in $(seq {ROUNDS}); do\n\
           t unprobed.$i\n\
           echo 1 > $T/events/exotap/getpid/enable\n\
           t kprobe.$i\n\
           echo 0 > $T/events/exotap/getpid/enable\n\
         done\n\
         echo '-:exotap/getpid' >> $T/kprobe_events\n\
         exotap_wait splice\n\
         for i in $(seq {ROUNDS}); do t splice.$i; done\n\
         exotap_wait unsplice\n\
         for i in $(seq {ROUNDS}); do t after.$i; done\n"
    );
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();

    let (code, out, err) = run(exotap()
        .args(["count", "__x64_sys_getpid", "--timeout", "500", "--job"])
        .arg(&job_file)
        .arg("--console")
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let stats = |tag: &str| -> (f64, f64) {
        let mut v: Vec<f64> = (1..=ROUNDS)
            .map(|i| {
                result(&out, &format!("{tag}.{i}"))
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        v.sort_by(f64::total_cmp);
        (v[0], v[v.len() / 2])
    };
    let (u, k, s, a) = (
        stats("unprobed"),
        stats("kprobe"),
        stats("splice"),
        stats("after"),
    );
    println!(
        "getpid ns/call under TCG, {n} calls x {ROUNDS} rounds (min / median): unprobed {:.0} / {:.0}, \
         guest kprobe {:.0} / {:.0}, exotap splice {:.0} / {:.0}, unprobed after removal {:.0} / {:.0}",
        u.0, u.1, k.0, k.1, s.0, s.1, a.0, a.1
    );
    let base = u.0.min(a.0);
    println!(
        "ratios of minima: splice/unprobed {:.3}, kprobe/unprobed {:.3}, kprobe/splice {:.3}; \
         added per call: splice {:.0} ns, kprobe {:.0} ns",
        s.0 / base,
        k.0 / base,
        k.0 / s.0,
        s.0 - base,
        k.0 - base
    );
    assert!(
        out.contains(&format!("{:>12}  __x64_sys_getpid", n * ROUNDS)),
        "{ctx}"
    );

    let report_job = dir.path().join("report.sh");
    std::fs::write(&report_job, "exotap_wait splice\nexotap_wait unsplice\n").unwrap();
    let (code, out, err) = run(exotap()
        .args(["splice-report", "--install", "10000", "--job"])
        .arg(&report_job)
        .arg("--console")
        .arg(&console));
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    for line in out
        .lines()
        .filter(|l| l.starts_with("install:") || l.starts_with("removal:"))
    {
        println!("{line}");
    }
}

#[test]
fn every_ftrace_site_of_the_live_guest_is_spliceable_and_10000_install_and_restore() {
    if !have_qemu("every_ftrace_site_of_the_live_guest_is_spliceable_and_10000_install_and_restore")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let job = "T=/sys/kernel/tracing\n\
               exotap_result available_filter_functions \"$(wc -l < $T/available_filter_functions)\"\n\
               exotap_wait splice\n\
               syscall-loop 100\n\
               exotap_wait unsplice\n";
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();

    let (code, out, err) = run(exotap()
        .args(["splice-report", "--list", "--install", "10000", "--job"])
        .arg(&job_file)
        .arg("--console")
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    eprintln!("{out}");
    assert_eq!(code, 0, "{ctx}");
    let listed: usize = result(&out, "available_filter_functions")
        .unwrap()
        .parse()
        .unwrap();
    let sites: usize = out
        .lines()
        .find_map(|l| l.strip_prefix("ftrace sites (available_filter_functions): "))
        .unwrap()
        .parse()
        .unwrap();
    // exotap reads the guest's ftrace records from its memory; the guest counts its own list.
    assert_eq!(sites, listed, "{ctx}");
    let spliceable: usize = out
        .lines()
        .find_map(|l| l.trim().strip_suffix("  splice"))
        .map_or(0, |n| n.trim().parse().unwrap());
    // The ftrace-site section ends where the tally of all function entries begins.
    let section = out.split("all function entries").next().unwrap_or_default();
    let refusals: Vec<&str> = section
        .lines()
        .filter(|l| l.starts_with("  ") && l.contains(": "))
        .collect();
    assert_eq!(spliceable + refusals.len(), sites, "{ctx}");
    assert!(spliceable * 100 >= sites * 99, "{ctx}");
    assert!(
        out.contains("install: 10000 of 10000 splices in one batch"),
        "{ctx}"
    );
    assert!(
        out.contains("text pages") && out.contains("identical: yes"),
        "{ctx}"
    );
    assert_eq!(result(&out, "getpid.calls"), Some("100"), "{ctx}");
    // The 10,000 splices ran while the workload did: some functions were hit.
    let hits: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("hits while in: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(hits > 0, "{ctx}");
    let log = std::fs::read_to_string(&console).unwrap();
    for bad in ["WARNING:", "BUG:", "Oops"] {
        assert!(!log.contains(bad), "console has {bad}:\n{log}");
    }
}

#[test]
fn time_histograms_count_every_call_and_sleepers_get_their_return_addresses_back() {
    if !have_qemu("time_histograms_count_every_call_and_sleepers_get_their_return_addresses_back") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    // `sleep` is in schedule() when the splices come out: its return address is swapped.
    let job = "exotap_wait splice\n\
               syscall-loop 300\n\
               sleep 3 &\n\
               exotap_wait unsplice\n\
               wait\n\
               syscall-loop 50 | sed 's/EXOTAP-RESULT /EXOTAP-RESULT after./'\n";
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();

    let (code, out, err) = run(exotap()
        .args([
            "time",
            "__x64_sys_getppid",
            "vfs_read",
            "schedule",
            "--timeout",
            "300",
            "--job",
        ])
        .arg(&job_file)
        .arg("--console")
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    eprintln!("{out}");
    assert_eq!(code, 0, "{ctx}");
    let timed = |f: &str| -> u64 {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{f}: ")))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no histogram for {f}\n{ctx}"))
    };
    // Only the workload calls getppid; a read already blocked when the splices went in
    // (the shell's wait for the host) returns untimed.
    assert_eq!(timed("__x64_sys_getppid"), 300, "{ctx}");
    assert!(timed("vfs_read") >= 300, "{ctx}");
    assert!(timed("schedule") > 0, "{ctx}");
    let restored: usize = out
        .lines()
        .find_map(|l| l.split("; ").nth(2))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{ctx}"));
    assert!(
        restored >= 1,
        "the sleeping task's call was in flight\n{ctx}"
    );
    assert_eq!(result(&out, "after.getppid.calls"), Some("50"), "{ctx}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("text: ") && l.ends_with(": identical")),
        "{ctx}"
    );
    let log = std::fs::read_to_string(&console).unwrap();
    for bad in ["WARNING:", "BUG:", "Oops", "invalid opcode"] {
        assert!(!log.contains(bad), "console has {bad}:\n{log}");
    }
}

#[test]
fn trace_records_every_entry_and_return_with_the_return_value() {
    if !have_qemu("trace_records_every_entry_and_return_with_the_return_value") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");

    let (code, out, err) = run(exotap()
        .args([
            "trace",
            "__x64_sys_getppid",
            "__x64_sys_pread64",
            "--run",
            "syscall-loop 50",
            "--timeout",
            "300",
            "--console",
        ])
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let ppid = result(&out, "getppid.value").unwrap();
    let lines = |f: &str, arrow: &str| -> Vec<&str> {
        out.lines()
            .filter(|l| l.contains(&format!("{arrow} {f}")))
            .collect()
    };
    assert_eq!(lines("__x64_sys_getppid", "->").len(), 50, "{ctx}");
    let returns = lines("__x64_sys_getppid", "<-");
    assert_eq!(returns.len(), 50, "{ctx}");
    assert!(
        returns.iter().all(|l| l.contains(&format!("= {ppid}  ["))),
        "every return carries the value the workload got, and pairs with its entry\n{ctx}"
    );
    // syscall-loop preads 18 bytes (the small file's size) each time.
    let preads = lines("__x64_sys_pread64", "<-");
    assert_eq!(preads.len(), 50, "{ctx}");
    assert!(preads.iter().all(|l| l.contains("= 18  [")), "{ctx}");
    assert!(
        out.contains("trace: 200 records; lost to ring overruns per vCPU: [0, 0]"),
        "{ctx}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("text: ") && l.ends_with(": identical")),
        "{ctx}"
    );
}

#[test]
fn trace_streams_the_rings_so_bursts_beyond_their_size_lose_nothing() {
    if !have_qemu("trace_streams_the_rings_so_bursts_beyond_their_size_lose_nothing") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    // 20 bursts of 500 getppid calls = 20,000 records, more than the two vCPUs' rings hold
    // together on the stop-and-read path (512 KiB of 64-byte records: 2 x 4,096); between
    // bursts (0.4 s) the host drains the rings (every 250 ms, the guest stopped). The
    // shared-memory path is tests/datapath_qemu.rs.
    let bursts =
        "i=0; while [ $i -lt 20 ]; do syscall-loop 500 > /dev/null; sleep 0.4; i=$((i+1)); done";

    let (code, out, err) = run(exotap()
        .args([
            "trace",
            "__x64_sys_getppid",
            "--stop-and-read",
            "--run",
            bursts,
            "--timeout",
            "300",
            "--console",
        ])
        .arg(&console));

    let tail: Vec<&str> = out.lines().rev().take(8).collect();
    let ctx = format!("stdout (last lines):\n{tail:#?}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let count = |arrow: &str| {
        out.lines()
            .filter(|l| l.contains(&format!("{arrow} __x64_sys_getppid")))
            .count()
    };
    assert_eq!((count("->"), count("<-")), (10_000, 10_000), "{ctx}");
    assert!(
        out.contains("trace: 20000 records; lost to ring overruns per vCPU: [0, 0]"),
        "{ctx}"
    );
    // Read only at removal, the rings would have kept at most 8,192 of the 20,000: nothing
    // lost means they were drained while the guest ran.
}

#[test]
fn replaced_getppid_runs_getpid_instead() {
    if !have_qemu("replaced_getppid_runs_getpid_instead") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");

    let (code, out, err) = run(exotap()
        .args([
            "replace",
            "__x64_sys_getppid",
            "__x64_sys_getpid",
            "--run",
            "syscall-loop 50",
            "--timeout",
            "300",
            "--console",
        ])
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    // syscall-loop's getppid answered with its own pid, which getpid reports.
    let pid = result(&out, "getpid.value").unwrap();
    assert_eq!(result(&out, "getppid.value"), Some(pid), "{ctx}");
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["50", "__x64_sys_getppid"]),
        "{ctx}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("text: ") && l.ends_with(": identical")),
        "{ctx}"
    );
}

/// The path of the branch-target cache entry a `-v` run names ("... kept in PATH" or "...
/// from the cache (PATH) ...").
fn targets_entry(err: &str) -> Option<std::path::PathBuf> {
    err.lines().find_map(|l| {
        let at = l
            .find("kept in ")
            .map(|i| i + "kept in ".len())
            .or_else(|| {
                l.find("from the cache (")
                    .map(|i| i + "from the cache (".len())
            })?;
        let path = l[at..].split([')', ' ']).next()?;
        path.ends_with(".targets").then(|| path.into())
    })
}

#[test]
fn count_with_target_splices_a_guest_someone_else_booted() {
    if !have_qemu("count_with_target_splices_a_guest_someone_else_booted") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gdb.sock");
    // The guest arms its own kprobe on getpid, says so, and calls getpid in bursts for a
    // while, beating after each burst; it never disarms (exotap may still be spliced over the
    // entry then). `exotap count --target` attaches on its own, counts for 3 s and leaves:
    // four times, with the text's branch targets found (cold), read from the cache (warm),
    // from a corrupted cache entry, and from an entry of another text (issue 44: each is
    // found out and the targets found again, never used).
    let job = "T=/sys/kernel/tracing\n\
               echo 'p:exotap/g __do_sys_getpid' >> $T/kprobe_events\n\
               echo 1 > $T/events/exotap/enable\n\
               exotap_result armed 1\n\
               i=0\n\
               while [ $i -lt 600 ]; do syscall-loop 50 > /dev/null && echo BURST; sleep 0.3; i=$((i+1)); done\n";
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();
    let (mut guest, console) = boot_with_gdbstub(
        &["--timeout", "600", "--job", job_file.to_str().unwrap()],
        &socket,
        "EXOTAP-RESULT armed=1",
    );
    let console = common::Console::follow(console);

    // A cache of its own (the image named by path), so that the entries it breaks on
    // purpose are no other test's.
    let xdg = tempfile::tempdir().unwrap();
    let bzimage = exotap_guest_images::cache::cache_root()
        .unwrap()
        .join("kernels")
        .join(exotap_guest_images::DEFAULT_KERNEL)
        .join("vmlinuz");
    let mut entry: Option<std::path::PathBuf> = None;
    for case in ["cold", "warm", "corrupted", "foreign"] {
        match (case, &entry) {
            ("corrupted", Some(path)) => {
                let mut bytes = std::fs::read(path).unwrap();
                *bytes.last_mut().unwrap() ^= 0x40;
                std::fs::write(path, bytes).unwrap();
            }
            ("foreign", Some(path)) => {
                // A well-formed entry of no target at all (the sha256 of the empty payload
                // is the well-known e3b0c442...): every function with a branch inside it
                // shows it is not this text's.
                let mut bytes = b"EXOTAPBT".to_vec();
                bytes.extend_from_slice(&4u32.to_le_bytes());
                bytes.extend_from_slice(&0u32.to_le_bytes());
                bytes.extend_from_slice(&0u64.to_le_bytes());
                let empty: Vec<u8> = (0..32)
                    .map(|i| {
                        u8::from_str_radix(
                            &"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
                                [2 * i..2 * i + 2],
                            16,
                        )
                        .unwrap()
                    })
                    .collect();
                bytes.extend_from_slice(&empty);
                std::fs::write(path, bytes).unwrap();
            }
            _ => {}
        }
        let started = std::time::Instant::now();
        let (code, out, err) = run(exotap()
            .args([
                "-v",
                "count",
                "__do_sys_getpid",
                // A function with branches inside it: what shows a foreign entry (calls
                // elsewhere are not checked; they change with ftrace and static calls).
                "vfs_read",
                "--compare-kprobes",
                "--duration",
                "3",
            ])
            .arg("--bzimage")
            .arg(&bzimage)
            .env("XDG_CACHE_HOME", xdg.path())
            .arg("--target")
            .arg(format!("unix:{}", socket.display())));
        let took = started.elapsed().as_secs_f64();
        let ctx = format!("{case}: stdout:\n{out}\nstderr:\n{err}\n(count took {took:.1} s)");
        eprintln!("{ctx}");
        assert_eq!(code, 0, "{ctx}");
        let t = table(&out);
        let (ours, kprobe) = t
            .get("__do_sys_getpid")
            .expect("a count for __do_sys_getpid");
        let (hits, missed) = kprobe.expect("the guest's kprobe beside it");
        assert_eq!(*ours, hits + missed, "{ctx}");
        assert!(
            *ours >= 50,
            "3 s should see at least one burst of 50: {ctx}"
        );
        assert!(
            out.lines()
                .any(|l| l.starts_with("text: ") && l.ends_with(": identical")),
            "{ctx}"
        );
        let found = err.contains("functions found in");
        let lazy = err.contains("its pages are read as plans need them");
        match case {
            "cold" => assert!(found && !lazy, "the cold run found no targets: {ctx}"),
            "warm" => assert!(lazy && !found, "the warm run did not use the cache: {ctx}"),
            "corrupted" => assert!(
                err.contains("are unusable") && found && !lazy,
                "the corrupted entry was not refused: {ctx}"
            ),
            _ => assert!(
                lazy && err.contains("not this text's") && found,
                "the foreign entry was not found out: {ctx}"
            ),
        }
        let named = targets_entry(&err).unwrap_or_else(|| panic!("no cache entry named: {ctx}"));
        if let Some(prev) = &entry {
            assert_eq!(&named, prev, "another entry for the same text: {ctx}");
        }
        entry = Some(named);
    }
    // The foreign entry was written again with the text's own targets.
    let rewritten = std::fs::metadata(entry.as_ref().unwrap()).unwrap().len();
    assert!(rewritten > 64 + 8 * 1000, "{rewritten} bytes");

    // The guest goes on with its bursts after exotap left (two more), then it is ended.
    let rest = console.beats_after(std::time::Instant::now(), &["BURST"]);
    guest.kill().unwrap();
    guest.wait().unwrap();
    for bad in ["Oops", "BUG:", "WARNING:", "general protection"] {
        assert!(!rest.contains(bad), "{bad} in the console:\n{rest}");
    }
}
