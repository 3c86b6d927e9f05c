//! End-to-end: SystemTap's own example scripts (Debian's `systemtap-doc`, taken at test time
//! and never committed), unchanged and with the arguments stap's own test suite gives them,
//! run one after another with `exotap run --target` against ONE live guest that runs the
//! mixed workload in a loop (fork/exec, file I/O, pipes, getppid/open/pread loops, HTTP over
//! loopback, ping, `kill -9`).
//!
//! Each example is checked on its output's shape (its header lines, the format of its rows,
//! numbers that parse), and where it counts kernel events, against the guest's own counts:
//! the job arms a kprobe (`kprobe_events`) on every function the examples' probes stand on,
//! and `--compare-kprobes` reads their hit counters at the stops where exotap installs and
//! removes its probes, so both count over the same window. Counts taken at a function's entry
//! must equal the guest's; counts taken at its return may differ by the calls in flight at
//! the two stops (a few: the guest has two vCPUs and a handful of tasks).
//!
//! The guest enables the scheduler, skb and irq tracepoints itself (tracefs `enable`), as a
//! user of `kernel.trace` probes must: exotap does not turn a guest's tracepoint on.
//!
//! A window is not a fixed time: under a loaded host a TCG guest crawls, so each example runs
//! until the guest finished two rounds of its workload after exotap installed the probes (and
//! at least the seconds its timer probes need), then gets SIGINT as stap's -T would give it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{exotap, have_qemu};

/// The functions the guest counts with its own kprobes: what the examples' probe points
/// (exotap's tapsets) stand on.
const KPROBES: &[&str] = &[
    "x64_sys_call",
    "__x64_sys_getppid",
    "__x64_sys_openat",
    "__x64_sys_open",
    "__x64_sys_close",
    "__x64_sys_pread64",
    "__x64_sys_read",
    "__x64_sys_write",
    "__x64_sys_kill",
    "__x64_sys_wait4",
    "__x64_sys_fork",
    "__x64_sys_execve",
    "vfs_read",
    "vfs_write",
    "wake_up_new_task",
    "bprm_execve",
    "do_exit",
    "__send_signal_locked",
    "handle_mm_fault",
    "__dev_queue_xmit",
    "dev_hard_start_xmit",
    "__netif_receive_skb",
    "inet_csk_accept",
];

/// The tracepoints the guest turns on for the examples' `kernel.trace` probes.
const EVENTS: &[&str] = &[
    "sched/sched_switch",
    "sched/sched_wakeup",
    "skb/kfree_skb",
    "irq/irq_handler_entry",
    "irq/irq_handler_exit",
    // For check mode's extra examples (CHECK_ONLY): block, memory, module and process.
    "block/block_rq_insert",
    "block/block_rq_issue",
    "block/block_rq_complete",
    "block/block_bio_frontmerge",
    "block/block_bio_backmerge",
    "kmem/mm_page_alloc",
    "kmem/mm_page_free",
    "filemap/mm_filemap_add_to_page_cache",
    "filemap/mm_filemap_delete_from_page_cache",
    "vmscan/mm_vmscan_direct_reclaim_end",
    "vmscan/mm_vmscan_lru_shrink_inactive",
    "vmscan/mm_vmscan_memcg_reclaim_end",
    "vmscan/mm_vmscan_memcg_softlimit_reclaim_end",
    "module/module_load",
    "sched/sched_process_exit",
    "timer/timer_expire_entry",
];

/// The guest's job: arm the kprobes and tracepoints, start an HTTP server on loopback, then
/// run rounds of the mixed workload until the host ends the guest, printing each round.
fn job() -> String {
    let mut job = String::from(
        "T=/sys/kernel/tracing\n\
         echo 0 > $T/tracing_on\n",
    );
    for f in KPROBES {
        job.push_str(&format!(
            "echo 'p:exotap/{f} {f}' >> $T/kprobe_events || exotap_result kprobe.failed {f}\n"
        ));
    }
    job.push_str("echo 1 > $T/events/exotap/enable\n");
    for e in EVENTS {
        job.push_str(&format!(
            "echo 1 > $T/events/{e}/enable || exotap_result event.failed {e}\n"
        ));
    }
    job.push_str(
        "ip link set lo up\n\
         mkdir -p /tmp/www\n\
         dd if=/dev/zero of=/tmp/www/f bs=1k count=8 2>/dev/null\n\
         httpd -p 127.0.0.1:8080 -h /tmp/www\n\
         exotap_result armed 1\n\
         i=0\n\
         while :; do\n\
           mixed 1 >/dev/null; syscall-loop 50 >/dev/null\n\
           wget -q -O /dev/null http://127.0.0.1:8080/f\n\
           ping -c 1 -W 1 127.0.0.1 >/dev/null\n\
           sleep 5 & kill -9 $!\n\
           sleep 0.3\n\
           i=$((i+1)); exotap_result round $i\n\
         done\n",
    );
    job
}

/// Where Debian's systemtap-doc keeps the examples: installed, in exotap's cache, or fetched
/// into the cache now with `apt-get download` (as ci/stap-examples.sh does). `None` (with the
/// reason printed) when none of these works.
fn examples_dir() -> Option<PathBuf> {
    let installed = PathBuf::from("/usr/share/systemtap/examples");
    if installed.join("process/syscalls_by_proc.stp").exists() {
        return Some(installed);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?
        .join("exotap/systemtap-doc");
    let dir = cache.join("usr/share/systemtap/examples");
    if dir.join("process/syscalls_by_proc.stp").exists() {
        return Some(dir);
    }
    let work = tempfile::tempdir().ok()?;
    let fetched = Command::new("apt-get")
        .args(["download", "systemtap-doc"])
        .current_dir(work.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let deb = std::fs::read_dir(work.path())
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"));
    let unpacked = fetched
        && deb.is_some_and(|deb| {
            Command::new("dpkg-deb")
                .arg("-x")
                .arg(deb)
                .arg(&cache)
                .status()
                .is_ok_and(|s| s.success())
        });
    if unpacked && dir.join("process/syscalls_by_proc.stp").exists() {
        Some(dir)
    } else {
        eprintln!(
            "SKIP stap_examples_live: SystemTap's examples are not installed and \
             `apt-get download systemtap-doc` failed (apt-get install systemtap-doc)"
        );
        None
    }
}

/// One example's run: its output, its diagnostics and the guest's kprobe hits over its window.
struct Run {
    out: String,
    err: String,
    kprobes: BTreeMap<String, u64>,
    /// Seconds from the start to the install, and in all.
    installed: f64,
    secs: f64,
}

impl Run {
    /// The guest's own hits of `function` between install and removal.
    fn k(&self, function: &str) -> Result<u64, String> {
        self.kprobes
            .get(function)
            .copied()
            .ok_or_else(|| format!("no guest kprobe count for {function}"))
    }

    /// The output's lines that are not blank.
    fn lines(&self) -> Vec<&str> {
        self.out.lines().filter(|l| !l.trim().is_empty()).collect()
    }
}

type Check = fn(&Run) -> Result<String, String>;

/// An example: its path under the examples directory, its arguments (as in its `.meta`
/// file's test line, with a process of the guest's workload for a process name), its
/// window, and its check.
struct Example {
    file: &'static str,
    args: &'static [&'static str],
    window: Window,
    check: Check,
}

/// How long an example runs after exotap installed its probes.
#[derive(Clone, Copy)]
enum Window {
    /// [`ROUNDS`] rounds of the workload, and at least this many seconds (its timers).
    Rounds(u64),
    /// This many seconds: for examples that stop the guest at every context switch or
    /// system call (or copy the compiled globals at each stop), under which a round of the
    /// workload takes a minute.
    Secs(u64),
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

fn num(field: &str) -> Result<i64, String> {
    field
        .trim()
        .parse()
        .map_err(|_| format!("'{field}' is not a number"))
}

/// The rows after the line that starts (trimmed) with `header`, split on whitespace; every
/// row must have at least `fields` fields.
fn rows_after<'a>(run: &'a Run, header: &str, fields: usize) -> Result<Vec<Vec<&'a str>>, String> {
    let lines = run.lines();
    let at = lines
        .iter()
        .position(|l| l.trim_start().starts_with(header))
        .ok_or_else(|| format!("no header line '{header}'"))?;
    let rows: Vec<Vec<&str>> = lines[at + 1..]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    if let Some(bad) = rows.iter().find(|r| r.len() < fields) {
        return Err(format!("a row with fewer than {fields} fields: {bad:?}"));
    }
    ensure(!rows.is_empty(), || format!("no rows after '{header}'"))?;
    Ok(rows)
}

/// `counted` (by the example at function entries) must equal the guest's own count.
fn equal(what: &str, counted: u64, function: &str, run: &Run) -> Result<String, String> {
    let k = run.k(function)?;
    ensure(counted == k, || {
        format!("{what}: the example counted {counted}, the guest's kprobe on {function} {k}")
    })?;
    Ok(format!("{what} {counted} = kprobe {function} {k}"))
}

/// `counted` by a host-evaluated probe at a function's entry: the guest's kprobe on the same
/// entry runs after exotap's breakpoint (its `call` to ftrace is the instruction the host
/// steps past), so a vCPU stopped for the removal between the two leaves the guest's count
/// short by one: at most one per vCPU.
fn at_entry(what: &str, counted: u64, function: &str, run: &Run) -> Result<String, String> {
    let k = run.k(function)?;
    ensure(counted >= k && counted <= k + VCPUS, || {
        format!(
            "{what}: the example counted {counted}, the guest's kprobe on {function} {k} \
             (a breakpoint probe counts the same or up to {VCPUS} more)"
        )
    })?;
    Ok(format!("{what} {counted} ~ kprobe {function} {k}"))
}

/// The guest's vCPUs (`exotap boot`'s default).
const VCPUS: u64 = 2;

/// `counted` (by the example at function returns) may differ from the guest's entry count
/// by the calls in flight at install and at removal: at most `slack`.
fn near(what: &str, counted: u64, function: &str, slack: u64, run: &Run) -> Result<String, String> {
    let k = run.k(function)?;
    ensure(counted.abs_diff(k) <= slack, || {
        format!(
            "{what}: the example counted {counted}, the guest's kprobe on {function} {k} \
             (more than {slack} apart)"
        )
    })?;
    Ok(format!("{what} {counted} ~ kprobe {function} {k}"))
}

/// Calls in flight at the two stops, for counts taken at returns: two vCPUs, and the tasks
/// of the workload that may sleep inside a call (a shell in wait4, httpd in accept, a pipe
/// read).
const IN_FLIGHT: u64 = 6;

fn syscalls_by_proc(run: &Run) -> Result<String, String> {
    ensure(run.out.starts_with("Collecting data..."), || {
        "no banner".into()
    })?;
    let rows = rows_after(run, "#SysCalls  Process Name", 2)?;
    let counts: Vec<i64> = rows.iter().map(|r| num(r[0])).collect::<Result<_, _>>()?;
    ensure(counts.windows(2).all(|w| w[0] >= w[1]), || {
        "not sorted by count".into()
    })?;
    ensure(rows.iter().any(|r| r[1] == "syscall-loop"), || {
        "no syscall-loop row".into()
    })?;
    equal(
        "syscalls",
        counts.iter().sum::<i64>() as u64,
        "x64_sys_call",
        run,
    )
}

fn syscalls_by_pid(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "#SysCalls  PID", 2)?;
    let mut total = 0;
    for r in &rows {
        total += num(r[0])?;
        ensure(num(r[1])? > 0, || format!("pid {} in {r:?}", r[1]))?;
    }
    equal("syscalls", total as u64, "x64_sys_call", run)
}

fn syscallbypid_nd(run: &Run) -> Result<String, String> {
    ensure(run.out.starts_with("Tracing syscall completions"), || {
        "no banner".into()
    })?;
    let rows = rows_after(run, "PID      CMD", 4)?;
    let mut by_name: BTreeMap<&str, u64> = BTreeMap::new();
    for r in &rows {
        num(r[0])?;
        *by_name.entry(r[r.len() - 2]).or_default() += num(r[r.len() - 1])? as u64;
    }
    let mut said = Vec::new();
    for name in ["close", "write", "read"] {
        let n = by_name.get(name).copied().unwrap_or(0);
        said.push(near(name, n, &format!("__x64_sys_{name}"), IN_FLIGHT, run)?);
    }
    Ok(said.join(", "))
}

fn thread_business(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "execname", 4)?;
    let mut total = 0;
    for r in rows.iter().filter(|r| r[0] != "execname") {
        num(r[1])?;
        total += num(r[2])?;
    }
    // It prints and clears its table every 5 s: what it printed is a part of the window.
    let k = run.k("x64_sys_call")?;
    ensure(total > 0 && total as u64 <= k, || {
        format!("printed {total} syscalls, the guest made {k} in the window")
    })?;
    Ok(format!(
        "syscalls printed {total} <= kprobe x64_sys_call {k}"
    ))
}

/// The rows of sig_by_proc / sig_by_pid: the signal name is a SIG* and the count the last.
fn signal_rows(run: &Run, header: &str) -> Result<String, String> {
    let rows = rows_after(run, header, 4)?;
    let mut total = 0;
    for r in &rows {
        ensure(r[r.len() - 2].starts_with("SIG"), || {
            format!("no signal name in {r:?}")
        })?;
        total += num(r[r.len() - 1])?;
    }
    ensure(rows.iter().any(|r| r.contains(&"SIGCHLD")), || {
        "no SIGCHLD".into()
    })?;
    at_entry("signals", total as u64, "__send_signal_locked", run)
}

fn sig_by_proc(run: &Run) -> Result<String, String> {
    signal_rows(run, "SENDER")
}

fn sig_by_pid(run: &Run) -> Result<String, String> {
    signal_rows(run, "SPID")
}

fn sigkill(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    for l in &lines {
        ensure(
            l.starts_with("SIGKILL was sent to ") && l.contains(" (pid:") && l.contains(" uid:"),
            || format!("row '{l}'"),
        )?;
    }
    ensure(!lines.is_empty(), || "no SIGKILL seen".into())?;
    // The job's only SIGKILLs are its `kill -9`, one kill(2) each.
    at_entry("SIGKILLs", lines.len() as u64, "__x64_sys_kill", run)
}

fn forktracker(run: &Run) -> Result<String, String> {
    let (mut created, mut execs) = (0, 0);
    for l in run.lines() {
        let (date, what) = l.split_once(" : ").ok_or_else(|| format!("row '{l}'"))?;
        ensure(date.split_whitespace().count() == 5, || {
            format!("date in '{l}'")
        })?;
        if what.contains(" created ") {
            created += 1;
        } else if what.contains(" is exec'ing ") {
            execs += 1;
        } else {
            return Err(format!("row '{l}'"));
        }
    }
    Ok(format!(
        "{}, {}",
        at_entry("forks", created, "wake_up_new_task", run)?,
        at_entry("execs", execs, "bprm_execve", run)?
    ))
}

fn proc_snoop(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "TIMESTAMP", 5)?;
    let mut creates = 0;
    let mut execs = 0;
    for r in &rows {
        for f in &r[..3] {
            num(f)?;
        }
        match (r[4], r.get(5).copied()) {
            ("create", _) => creates += 1,
            ("exec", Some("success" | "failed")) => {}
            ("exec", _) => execs += 1,
            ("start" | "exit" | "remove" | "sigsend" | "sighandle", _) => {}
            (other, _) => return Err(format!("action '{other}' in {r:?}")),
        }
    }
    Ok(format!(
        "{}, {}",
        at_entry("creates", creates, "wake_up_new_task", run)?,
        at_entry("execs", execs, "bprm_execve", run)?
    ))
}

fn sleeptime(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    ensure(!lines.is_empty(), || "no sleeps".into())?;
    for l in &lines {
        let f: Vec<&str> = l.split_whitespace().collect();
        ensure(
            f.len() == 5 && f[2].starts_with('(') && f[3].ends_with(':'),
            || format!("row '{l}'"),
        )?;
        num(f[0])?;
        num(f[1])?;
        ensure(num(f[4])? > 0, || format!("slept no time in '{l}'"))?;
    }
    Ok(format!("{} sleeps", lines.len()))
}

fn pstrace_exec(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    let heads = lines.iter().filter(|l| **l == "process traceback:").count();
    ensure(heads > 0, || "no traceback".into())?;
    for l in lines.iter().filter(|l| **l != "process traceback:") {
        // " name(pid) <- name(pid) <- ... init(1)": every ancestry ends at pid 1.
        ensure(l.contains(" <- ") && l.trim_end().ends_with("(1)"), || {
            format!("chain '{l}'")
        })?;
    }
    Ok(format!("{heads} tracebacks"))
}

fn spawn_seeker(run: &Run) -> Result<String, String> {
    // Two tables: forks by pid ("name(   PID)  N (pct%)", a pid's forks handed to its parent
    // when it exits) and by name ("name  N (pct%)"); each sums to every fork of the window.
    let lines = run.lines();
    let at = lines
        .iter()
        .position(|l| l.trim_start().starts_with("execname("))
        .ok_or("no 'execname(   PID)' header")?;
    let (mut pids, mut names, mut second) = (0, 0, false);
    for l in &lines[at + 1..] {
        let r: Vec<&str> = l.split_whitespace().collect();
        if r.first() == Some(&"execname") {
            second = true;
            continue;
        }
        ensure(r.len() >= 3 && r[r.len() - 1].ends_with("%)"), || {
            format!("row '{l}'")
        })?;
        let n = r
            .iter()
            .rev()
            .find(|f| f.parse::<i64>().is_ok() && !f.ends_with(')'))
            .ok_or_else(|| format!("row '{l}'"))?;
        if second {
            names += num(n)?;
        } else {
            pids += num(n)?;
        }
    }
    ensure(second && pids == names, || {
        format!("by pid {pids}, by name {names}")
    })?;
    at_entry("forks", names as u64, "wake_up_new_task", run)
}

fn execsnoop_nd(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "TIME", 10)?;
    for r in &rows {
        // TIME is ctime's five fields; then UID PPID PID COMM ARGS...
        ensure(num(r[5])? == 0, || format!("uid in {r:?}"))?;
        ensure(num(r[6])? > 0 && num(r[7])? > 0, || {
            format!("pids in {r:?}")
        })?;
    }
    near("execs", rows.len() as u64, "bprm_execve", 2, run)
}

/// Lines of a `@hist_log` histogram: "value |--- count", then rows "N |@@@ N".
fn histograms(run: &Run) -> Result<usize, String> {
    let lines = run.lines();
    let heads = lines
        .iter()
        .filter(|l| l.trim_start().starts_with("value |") && l.trim_end().ends_with("count"))
        .count();
    for l in lines.iter().filter(|l| {
        let t = l.trim_start();
        t.contains(" |") && t.starts_with(|c: char| c.is_ascii_digit() || c == '-')
    }) {
        let (value, rest) = l.split_once('|').unwrap();
        num(value)?;
        num(rest.trim_start_matches('@').trim())?;
    }
    ensure(heads > 0, || "no histogram".into())?;
    Ok(heads)
}

fn sched_latency(run: &Run) -> Result<String, String> {
    let heads = histograms(run)?;
    ensure(
        run.out
            .lines()
            .any(|l| l.starts_with("pid:") && l.contains(" prio:")),
        || "no 'pid:N prio:N' line".into(),
    )?;
    Ok(format!("{heads} histograms"))
}

fn cycle_thief(run: &Run) -> Result<String, String> {
    let heads = histograms(run)?;
    ensure(
        run.out
            .lines()
            .any(|l| l.starts_with("task ") && l.contains(" migrated: ")),
        || "no 'task N migrated: N' line".into(),
    )?;
    Ok(format!("{heads} histograms"))
}

fn sched_switch(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    let mut switches = 0;
    for l in &lines {
        let f: Vec<&str> = l.split_whitespace().collect();
        let at = f
            .iter()
            .position(|x| *x == "==>" || *x == "+")
            .ok_or_else(|| format!("row '{l}'"))?;
        ensure(at >= 4, || format!("row '{l}'"))?;
        num(f[at - 3])?; // the timestamp
        switches += usize::from(f[at] == "==>");
    }
    ensure(switches > 0, || "no context switch".into())?;
    Ok(format!(
        "{switches} switches, {} wakeups",
        lines.len() - switches
    ))
}

/// iostats: every probe compiled (syscall.open's `argstr = sprintf(...)` of
/// `user_string_quoted()` and `_sys_open_flag_str()` too).
fn iostats(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "name", 8)?;
    let (mut opens, mut reads, mut writes) = (0, 0, 0);
    for r in &rows {
        let n: Vec<i64> = r[1..].iter().map(|f| num(f)).collect::<Result<_, _>>()?;
        opens += n[0];
        reads += n[1];
        writes += n[4];
    }
    Ok(format!(
        "{}, {}, {}",
        at_entry("opens", opens as u64, "__x64_sys_open", run)?,
        near("reads", reads as u64, "__x64_sys_read", IN_FLIGHT, run)?,
        near("writes", writes as u64, "__x64_sys_write", IN_FLIGHT, run)?
    ))
}

/// "PID NAME r: N UNIT w: N UNIT" rows (traceio's timer prints them every second).
fn traceio(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    ensure(!lines.is_empty(), || "no rows".into())?;
    for l in &lines {
        let f: Vec<&str> = l.split_whitespace().collect();
        ensure(f.len() == 8 && f[2] == "r:" && f[5] == "w:", || {
            format!("row '{l}'")
        })?;
        num(f[0])?;
        num(f[3])?;
        num(f[6])?;
        for unit in [f[4], f[7]] {
            ensure(["B", "KiB", "MiB", "GiB"].contains(&unit), || {
                format!("unit in '{l}'")
            })?;
        }
    }
    ensure(lines.iter().any(|l| l.contains(" mixed ")), || {
        "no mixed row".into()
    })?;
    Ok(format!("{} rows", lines.len()))
}

fn pfaults(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    for l in &lines {
        let f: Vec<&str> = l.split(':').collect();
        ensure(f.len() == 6, || format!("row '{l}'"))?;
        num(f[0])?;
        num(f[1])?;
        num(f[2].trim_end_matches('d'))?;
        ensure(
            ["r", "w"].contains(&f[3]) && ["minor", "major"].contains(&f[4]),
            || format!("row '{l}'"),
        )?;
        ensure(num(f[5])? >= 0, || format!("time in '{l}'"))?;
    }
    // Only faults whose result is exactly "minor" (0) or has VM_FAULT_MAJOR print: a file
    // page's fault returns with VM_FAULT_LOCKED set too (and retries, errors), so fewer than
    // all; at most every fault the guest took, give or take those in flight at the stops.
    let k = run.k("handle_mm_fault")?;
    let n = lines.len() as u64;
    ensure(n > 0 && n <= k + VCPUS, || {
        format!("{n} faults printed, the guest's kprobe on handle_mm_fault {k}")
    })?;
    Ok(format!("faults printed {n} <= kprobe handle_mm_fault {k}"))
}

fn netdev(run: &Run) -> Result<String, String> {
    let (mut queued, mut hard, mut received) = (0, 0, 0);
    for l in run.lines() {
        ensure(
            l.starts_with("Device lo is ") && l.contains(" a packet with protocol "),
            || format!("row '{l}'"),
        )?;
        if l.contains("sending (queued)") {
            queued += 1;
        } else if l.contains("sending (hard)") {
            hard += 1;
        } else if l.contains("receiving") {
            received += 1;
        }
    }
    ensure(queued > 0, || "no packet sent".into())?;
    // netdev.rx is netif_rx, which loopback does not call (it hands packets to __netif_rx).
    ensure(received == 0, || {
        format!("{received} packets received through netif_rx")
    })?;
    Ok(format!(
        "{}, {}",
        at_entry("queued", queued, "__dev_queue_xmit", run)?,
        at_entry("hard", hard, "dev_hard_start_xmit", run)?
    ))
}

fn nettop(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "PID", 8)?;
    let mut sent = 0;
    for r in rows.iter().filter(|r| r[0] != "PID") {
        for f in [r[0], r[1], r[3], r[4], r[5], r[6]] {
            num(f)?;
        }
        ensure(r[2] == "lo", || format!("device in {r:?}"))?;
        sent += num(r[3])?;
    }
    // It prints and clears its table every 5 s: what it printed is a part of the window,
    // give or take a vCPU stopped for the removal between the example's probe and the
    // guest's kprobe on the same entry (at most one per vCPU, as `at_entry`).
    let k = run.k("__dev_queue_xmit")?;
    ensure(sent > 0 && sent as u64 <= k + VCPUS, || {
        format!("{sent} packets sent printed, the guest's kprobe on __dev_queue_xmit {k}")
    })?;
    Ok(format!(
        "packets printed {sent} <= kprobe __dev_queue_xmit {k} (+ {VCPUS})"
    ))
}

fn tcp_connections(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "UID", 5)?;
    for r in &rows {
        ensure(
            r[1] == "httpd" && r[3] == "8080" && r[4] == "127.0.0.1",
            || format!("row {r:?}"),
        )?;
        num(r[0])?;
        num(r[2])?;
    }
    // Counted at accept's return: httpd sleeps in accept across the install.
    near("accepts", rows.len() as u64, "inet_csk_accept", 1, run)
}

/// `tests/scripts/tracepoint_exits.stp`: a tracepoint only its event is on (one callback,
/// called past the iterator) counts every exit: as many as the guest's kprobe on `do_exit`,
/// which fires the tracepoint (tasks inside do_exit at the two stops apart).
fn tracepoint_exits(run: &Run) -> Result<String, String> {
    let line = run
        .out
        .lines()
        .find(|l| l.starts_with("exits "))
        .ok_or("no 'exits' line")?;
    let exits = num(line.trim_start_matches("exits "))? as u64;
    ensure(exits > 0, || "no exit counted".into())?;
    near("exits", exits, "do_exit", IN_FLIGHT, run)
}

fn dropwatch(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    ensure(
        lines.first() == Some(&"Monitoring for dropped packets"),
        || "no banner".into(),
    )?;
    ensure(
        lines.last() == Some(&"Stopping dropped packet monitor"),
        || "no ending".into(),
    )?;
    let middle = &lines[1..lines.len() - 1];
    let mut reports = 0;
    for l in middle {
        let f: Vec<&str> = l.split_whitespace().collect();
        // Every 5 s a ctime line ("Wed Nov 25 16:01:53 2026"), then "N packets dropped at X".
        if f.len() == 5 && f[3].matches(':').count() == 2 {
            num(f[4])?;
            reports += 1;
        } else {
            ensure(
                f.len() >= 5 && f[1..4] == ["packets", "dropped", "at"],
                || format!("row '{l}'"),
            )?;
            ensure(num(f[0])? > 0, || format!("row '{l}'"))?;
        }
    }
    ensure(reports > 0, || "no report".into())?;
    Ok(format!(
        "{reports} reports, {} drop sites",
        middle.len() - reports
    ))
}

fn func_time_stats(run: &Run) -> Result<String, String> {
    let line = run
        .out
        .lines()
        .find(|l| l.starts_with("intervals min:"))
        .ok_or("no 'intervals' line")?;
    let mut count = None;
    for kv in line.trim_start_matches("intervals ").split_whitespace() {
        let (k, v) = kv.split_once(':').ok_or_else(|| format!("'{kv}'"))?;
        let v = num(v.trim_end_matches("us"))?;
        if k == "count" {
            count = Some(v);
        }
    }
    histograms(run)?;
    let count = count.ok_or("no count")?;
    // Timed from syscall.read to its return: the reads in flight at the stops are not.
    let k = run.k("__x64_sys_read")?;
    ensure(count > 0 && count as u64 <= k, || {
        format!("{count} reads timed, the guest's kprobe on __x64_sys_read {k}")
    })?;
    near(
        "reads timed",
        count as u64,
        "__x64_sys_read",
        IN_FLIGHT,
        run,
    )
}

fn iotop(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "Process", 3)?;
    for r in rows.iter().filter(|r| r[0] != "Process") {
        num(r[r.len() - 1])?;
        num(r[r.len() - 2])?;
    }
    ensure(rows.iter().any(|r| r[0] == "mixed"), || {
        "no mixed row".into()
    })?;
    Ok(format!("{} rows", rows.len()))
}

fn strace_open(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    for l in &lines {
        let (who, call) = l.split_once(' ').ok_or_else(|| format!("row '{l}'"))?;
        ensure(who.ends_with(')') && who.contains('('), || {
            format!("row '{l}'")
        })?;
        ensure(call.starts_with("open (\"") && call.ends_with(')'), || {
            format!("row '{l}'")
        })?;
    }
    at_entry("opens", lines.len() as u64, "__x64_sys_open", run)
}

fn chng_cpu(run: &Run) -> Result<String, String> {
    // Blocks: "thread TID (mixed) context switched on cpuN state: N", then the kernel stack
    // as print_syms prints it, from the probed function (scheduler.cpu_on) outwards.
    let lines = run.lines();
    let mut blocks = 0;
    let mut first = false;
    for l in &lines {
        if let Some(rest) = l.strip_prefix("thread ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            // "TID (mixed) context switched on cpuN state: N"
            ensure(
                f.len() == 8 && f[1] == "(mixed)" && f[5].starts_with("cpu"),
                || format!("row '{l}'"),
            )?;
            num(f[0])?;
            num(f[5].trim_start_matches("cpu"))?;
            num(f[7])?;
            blocks += 1;
            first = true;
            continue;
        }
        let (addr, sym) = l
            .trim()
            .split_once(" : ")
            .ok_or_else(|| format!("frame '{l}'"))?;
        ensure(
            addr.starts_with("0xffffffff") && sym.ends_with(" [kernel]"),
            || format!("frame '{l}'"),
        )?;
        if first {
            ensure(sym.starts_with("finish_task_switch"), || {
                format!("the stack starts at '{sym}', not the probed function")
            })?;
            first = false;
        }
    }
    ensure(blocks > 0, || "no switch of mixed".into())?;
    Ok(format!("{blocks} switches with their stacks"))
}

fn probe_alias(run: &Run) -> Result<String, String> {
    let (mut io, mut process) = (0, 0);
    for l in run.lines() {
        let (who, n) = l.split_once(": ").ok_or_else(|| format!("row '{l}'"))?;
        let (_, group) = who.rsplit_once('/').ok_or_else(|| format!("row '{l}'"))?;
        match group {
            "io" => io += num(n)?,
            "process" => process += num(n)?,
            _ => return Err(format!("group in '{l}'")),
        }
    }
    ensure(run.out.contains("syscall-loop/io: "), || {
        "no syscall-loop/io".into()
    })?;
    // syscallgroup.io is syscall.{open,close,read,write}, .process syscall.{fork,execve}:
    // breakpoints at the entries, each followed by the guest's kprobe. A vCPU stopped between
    // the two for the removal leaves the guest's count short; one stopped there (inside the
    // kprobe's handler, before its count) for the install leaves exotap's short: the sum
    // differs by at most one per vCPU either way (CI saw io 438 against 439 once).
    let guest = |fs: &[&str]| -> Result<u64, String> {
        fs.iter().map(|f| run.k(&format!("__x64_sys_{f}"))).sum()
    };
    let (kio, kprocess) = (
        guest(&["open", "close", "read", "write"])?,
        guest(&["fork", "execve"])?,
    );
    let (io, process) = (io as u64, process as u64);
    ensure(
        (io + process).abs_diff(kio + kprocess) <= VCPUS
            && io.abs_diff(kio) <= VCPUS
            && process.abs_diff(kprocess) <= VCPUS,
        || {
            format!(
                "io {io} and process {process}, the guest's kprobes {kio} (open+close+read+write) \
             and {kprocess} (fork+execve)"
            )
        },
    )?;
    Ok(format!(
        "io {io} ~ kprobes open+close+read+write {kio}, process {process} ~ kprobes \
         fork+execve {kprocess}"
    ))
}

/// `@hist_log` histograms after the lines that start with each of `titles`: the sum of
/// each one's counts (0 where the title is followed by no histogram: an empty aggregate).
fn hist_totals(run: &Run, titles: &[&str]) -> Result<Vec<u64>, String> {
    let lines = run.lines();
    let mut totals = Vec::new();
    for title in titles {
        let at = lines
            .iter()
            .position(|l| l.starts_with(title))
            .ok_or_else(|| format!("no line '{title}'"))?;
        let mut total = 0u64;
        for l in &lines[at + 1..] {
            let t = l.trim_start();
            if t.starts_with("value |") {
                continue;
            }
            let Some((value, rest)) = t.split_once('|') else {
                break;
            };
            let Ok(_) = value.trim().parse::<i64>() else {
                break;
            };
            total += num(rest.trim_start_matches('@').trim())? as u64;
        }
        totals.push(total);
    }
    Ok(totals)
}

/// `gettimeofday_us() - @entry(gettimeofday_us())` in wait4's return: "TIMESTAMP PID (NAME)
/// wait4: ELAPSED WAITED_PID", one row per returned call.
fn wait4time(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    ensure(!lines.is_empty(), || "no rows".into())?;
    let mut last = 0;
    for l in &lines {
        let r: Vec<&str> = l.split_whitespace().collect();
        ensure(
            r.len() == 6 && r[3] == "wait4:" && r[2].starts_with('('),
            || format!("not a wait4 row: {l:?}"),
        )?;
        let (at, pid, elapsed, waited) = (num(r[0])?, num(r[1])?, num(r[4])?, num(r[5])?);
        ensure(
            at >= last && pid > 0 && elapsed >= 0 && waited >= -1,
            || format!("out of order, or a negative time or pid: {l:?}"),
        )?;
        last = at;
    }
    near(
        "wait4 returns",
        lines.len() as u64,
        "__x64_sys_wait4",
        IN_FLIGHT,
        run,
    )
}

/// `vfs.open.return` with `@entry(gettimeofday_us())`: "NAME[TID] MICROSECONDS PATH" for
/// opens that took at least 50 us (`sloth`); a breakpoint probe's two stops take longer.
fn slowvfs(run: &Run) -> Result<String, String> {
    let lines = run.lines();
    for l in &lines {
        let r: Vec<&str> = l.split_whitespace().collect();
        let tid = r
            .first()
            .and_then(|n| n.strip_suffix(']'))
            .and_then(|n| n.rsplit_once('['))
            .map(|(_, tid)| tid);
        ensure(r.len() >= 3 && tid.is_some(), || {
            format!("not a row: {l:?}")
        })?;
        ensure(
            num(tid.unwrap_or_default())? > 0 && num(r[1])? >= 10,
            || format!("a tid of 0 or a time under -G sloth=10 us: {l:?}"),
        )?;
    }
    ensure(
        lines
            .iter()
            .any(|l| l.starts_with("syscall-loop[") && l.ends_with("syscall-loop.small")),
        || "no open of syscall-loop's small file".into(),
    )?;
    Ok(format!("{} slow opens", lines.len()))
}

/// read/write latencies by `@entry(gettimeofday_ns())` in `@hist_log`s: one value per
/// returned call.
fn rwtime_nd(run: &Run) -> Result<String, String> {
    ensure(run.out.starts_with("Tracing read/write syscalls"), || {
        "no banner".into()
    })?;
    let t = hist_totals(
        run,
        &["syscall read latency (ns):", "syscall write latency (ns):"],
    )?;
    Ok(format!(
        "{}, {}",
        near("reads", t[0], "__x64_sys_read", IN_FLIGHT, run)?,
        near("writes", t[1], "__x64_sys_write", IN_FLIGHT, run)?
    ))
}

/// `user_string(@entry(pointer_arg(1)))` in open's return: the path the call opened, read
/// from the user's registers as the syscall wrapper got them.
fn opensnoop_nd(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "UID    PID", 5)?;
    for r in &rows {
        num(r[0])?;
        ensure(num(r[1])? > 0, || format!("pid in {r:?}"))?;
        num(r[r.len() - 2])?;
    }
    // syscall-loop.c opens this file with open(2), and the call succeeds.
    ensure(
        rows.iter().any(|r| {
            r[2] == "syscall-loop"
                && r[4] == "/tmp/syscall-loop.small"
                && num(r[3]).unwrap_or(-1) >= 0
        }),
        || "no successful open of /tmp/syscall-loop.small by syscall-loop".into(),
    )?;
    near("opens", rows.len() as u64, "__x64_sys_open", IN_FLIGHT, run)
}

/// `uint_arg(1)`/`uint_arg(2)` at kill's entry: the target and the signal, read (as stap's
/// `nd_syscall` makes them) from the user's registers in the wrapper's `pt_regs`. The job
/// kills a `sleep` with SIGKILL each round.
fn killsnoop_nd(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "FROM   COMMAND", 5)?;
    for r in &rows {
        ensure(num(r[0])? > 0 && num(r[3])? > 0, || {
            format!("pids in {r:?}")
        })?;
        num(r[2])?;
    }
    ensure(rows.iter().any(|r| r[2] == "9"), || "no SIGKILL row".into())?;
    near("kills", rows.len() as u64, "__x64_sys_kill", IN_FLIGHT, run)
}

/// exotap's own `tests/scripts/entry_values.stp`: `@entry` of a task fact, a dereference of a
/// parameter and a member chain, checked against what the kernel does to `*pos` in a pread
/// of syscall-loop's 18-byte file (0 at the entry, 18 at the return).
fn entry_values(run: &Run) -> Result<String, String> {
    let line = run
        .lines()
        .into_iter()
        .find(|l| l.starts_with("returns "))
        .ok_or_else(|| "no summary line".to_string())?;
    let f: Vec<&str> = line.split_whitespace().collect();
    ensure(f.len() == 10, || format!("not the summary: {line:?}"))?;
    let (returns, same_task, preads, advanced, named) =
        (num(f[1])?, num(f[3])?, num(f[5])?, num(f[7])?, num(f[9])?);
    ensure(same_task == returns, || {
        format!("@entry(tid())/@entry(execname()) differ from the return's: {line}")
    })?;
    ensure(preads > 0 && advanced == preads && named == preads, || {
        format!("@entry of *pos or of the file's name is not the entry's value: {line}")
    })?;
    Ok(format!(
        "{preads} preads with entry values, {}",
        near("returns", returns as u64, "vfs_read", IN_FLIGHT, run)?
    ))
}

const EXAMPLES: &[Example] = &[
    Example {
        file: "process/syscalls_by_proc.stp",
        args: &[],
        window: Window::Rounds(0),
        check: syscalls_by_proc,
    },
    Example {
        file: "process/syscalls_by_pid.stp",
        args: &[],
        window: Window::Rounds(0),
        check: syscalls_by_pid,
    },
    Example {
        file: "lwtools/syscallbypid-nd.stp",
        // Compiled (its syscall_name() compiles), the workload makes more (pid, command,
        // syscall) rows in its window than its end probe prints within the default MAXACTION
        // (rows sorted by count, the large ones last: cut off, as stap would cut them).
        args: &["-D", "MAXACTION=100000"],
        window: Window::Secs(3),
        check: syscallbypid_nd,
    },
    Example {
        file: "process/thread-business.stp",
        args: &[],
        window: Window::Secs(6),
        check: thread_business,
    },
    Example {
        file: "process/sig_by_proc.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sig_by_proc,
    },
    Example {
        file: "process/sig_by_pid.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sig_by_pid,
    },
    Example {
        file: "process/sigkill.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sigkill,
    },
    Example {
        file: "process/forktracker.stp",
        args: &[],
        window: Window::Rounds(0),
        check: forktracker,
    },
    Example {
        // Not one of SystemTap's: exotap's own, for tracepoints with one callback.
        file: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/scripts/tracepoint_exits.stp"
        ),
        args: &[],
        window: Window::Rounds(0),
        check: tracepoint_exits,
    },
    Example {
        file: "process/proc_snoop.stp",
        args: &[],
        window: Window::Rounds(0),
        check: proc_snoop,
    },
    Example {
        file: "process/sleeptime.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sleeptime,
    },
    Example {
        file: "process/pstrace_exec.stp",
        args: &["mixed"],
        window: Window::Rounds(0),
        check: pstrace_exec,
    },
    Example {
        file: "process/spawn_seeker.stp",
        args: &[],
        window: Window::Rounds(0),
        check: spawn_seeker,
    },
    Example {
        file: "process/chng_cpu.stp",
        args: &["mixed"],
        window: Window::Secs(4),
        check: chng_cpu,
    },
    Example {
        file: "lwtools/execsnoop-nd.stp",
        args: &[],
        window: Window::Rounds(0),
        check: execsnoop_nd,
    },
    Example {
        file: "process/sched-latency.stp",
        args: &[],
        window: Window::Secs(6),
        check: sched_latency,
    },
    Example {
        file: "process/cycle_thief.stp",
        args: &[],
        window: Window::Secs(3),
        check: cycle_thief,
    },
    Example {
        file: "profiling/sched_switch.stp",
        args: &[],
        window: Window::Secs(3),
        check: sched_switch,
    },
    Example {
        file: "io/iostats.stp",
        args: &[],
        // Its syscall.open runs on the host, and each host-evaluated hit of a mixed script
        // copies the compiled globals through the gdbstub: rounds take many seconds.
        window: Window::Secs(5),
        check: iostats,
    },
    Example {
        file: "io/traceio.stp",
        args: &[],
        window: Window::Rounds(2),
        check: traceio,
    },
    Example {
        file: "io/iotop.stp",
        args: &[],
        window: Window::Rounds(6),
        check: iotop,
    },
    Example {
        file: "memory/pfaults.stp",
        args: &[],
        window: Window::Rounds(0),
        check: pfaults,
    },
    Example {
        file: "network/netdev.stp",
        args: &[],
        window: Window::Rounds(0),
        check: netdev,
    },
    Example {
        file: "network/nettop.stp",
        args: &[],
        window: Window::Rounds(6),
        check: nettop,
    },
    Example {
        file: "network/tcp_connections.stp",
        args: &[],
        window: Window::Rounds(0),
        check: tcp_connections,
    },
    Example {
        file: "network/dropwatch.stp",
        args: &[],
        window: Window::Rounds(6),
        check: dropwatch,
    },
    Example {
        file: "general/func_time_stats.stp",
        args: &["syscall.read"],
        window: Window::Rounds(0),
        check: func_time_stats,
    },
    Example {
        file: "../../doc/systemtap/examples/tutorial/probe-alias.stp",
        args: &[],
        window: Window::Rounds(0),
        check: probe_alias,
    },
    Example {
        file: "../../doc/systemtap/examples/tutorial/strace-open.stp",
        args: &[],
        window: Window::Rounds(0),
        check: strace_open,
    },
    // `@entry` of expressions, evaluated at the entry by the host for breakpoint probes;
    // short windows (each return probe stops the guest twice per call).
    Example {
        file: "process/wait4time.stp",
        args: &[],
        window: Window::Secs(3),
        check: wait4time,
    },
    Example {
        file: "io/slowvfs.stp",
        // As stap's suite gives it: compiled, an open is timed without the stops that made
        // every one slower than the default 50 us.
        args: &["-G", "sloth=10"],
        window: Window::Secs(3),
        check: slowvfs,
    },
    Example {
        file: "lwtools/rwtime-nd.stp",
        args: &[],
        window: Window::Secs(3),
        check: rwtime_nd,
    },
    Example {
        file: "lwtools/opensnoop-nd.stp",
        args: &[],
        window: Window::Secs(3),
        check: opensnoop_nd,
    },
    Example {
        file: "lwtools/killsnoop-nd.stp",
        args: &[],
        window: Window::Rounds(0),
        check: killsnoop_nd,
    },
    Example {
        file: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/scripts/entry_values.stp"
        ),
        args: &[],
        window: Window::Rounds(0),
        check: entry_values,
    },
];

/// Round markers each [`Window::Rounds`] window sees: the first may end a round begun
/// before the install, so three hold two whole rounds (two HTTP requests: the first returns
/// from an `accept` entered before the install, which exotap did not see enter).
const ROUNDS: u64 = 3;

fn signal(child: &Child, sig: &str) {
    let _ = Command::new("kill")
        .args([format!("-{sig}"), child.id().to_string()])
        .status();
}

/// Runs `file ARGS` against the guest at `socket` over its window after the install, then
/// SIGINT; `--compile COMPILE`.
fn run_example(file: &Path, ex: &Example, socket: &Path, rounds: &AtomicU64, compile: &str) -> Run {
    let started = Instant::now();
    let mut child = exotap()
        .args(["run", "--compare-kprobes", "--compile", compile, "--target"])
        .arg(format!("unix:{}", socket.display()))
        .arg(file)
        .args(ex.args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start exotap run");
    let mut stdout = child.stdout.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let (tx, rx) = mpsc::channel::<String>();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let err = std::thread::spawn(move || {
        let mut all = String::new();
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    // The install: exotap names the sites it compiled in or armed.
    let deadline = started + Duration::from_secs(120);
    let mut installed = false;
    while !installed && Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => installed = l.contains("compiled probes in at") || l.contains("probe sites ("),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let installed_after = started.elapsed().as_secs_f64();
    if installed {
        let (want, secs) = match ex.window {
            Window::Rounds(secs) => (rounds.load(Ordering::SeqCst) + ROUNDS, secs),
            Window::Secs(secs) => (0, secs),
        };
        let least = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline
            && (rounds.load(Ordering::SeqCst) < want || Instant::now() < least)
            && child.try_wait().ok().flatten().is_none()
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        signal(&child, "INT");
    }
    let end = Instant::now() + Duration::from_secs(60);
    while child.try_wait().ok().flatten().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    let kprobes = err
        .lines()
        .filter_map(|l| l.strip_prefix("HOST-RESULT kprobe."))
        .filter_map(|l| {
            let (f, n) = l.split_once('=')?;
            Some((f.to_owned(), n.parse().ok()?))
        })
        .collect();
    Run {
        out,
        err,
        kprobes,
        installed: installed_after,
        secs: started.elapsed().as_secs_f64(),
    }
}

/// The guest the examples run against: booted with [`job`], its gdbstub at `socket`, its
/// console read by a thread that counts the workload's rounds.
struct LiveGuest {
    guest: Child,
    console: std::thread::JoinHandle<String>,
    rounds: Arc<AtomicU64>,
    socket: PathBuf,
    booted: f64,
    _dir: tempfile::TempDir,
}

impl LiveGuest {
    fn boot(began: Instant) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("gdb.sock");
        let job_file = dir.path().join("job.sh");
        std::fs::write(&job_file, job()).unwrap();
        let job_arg = job_file.to_str().unwrap().to_owned();
        let (guest, console) = common::boot_with_gdbstub(
            &["--timeout", "1800", "--job", &job_arg],
            &socket,
            "EXOTAP-RESULT armed=1",
        );
        let rounds = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&rounds);
        let console = std::thread::spawn(move || {
            let mut all = String::new();
            for line in console.lines().map_while(Result::ok) {
                if let Some(n) = line.split("EXOTAP-RESULT round=").nth(1) {
                    seen.store(n.trim().parse().unwrap_or(0), Ordering::SeqCst);
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        LiveGuest {
            guest,
            console,
            rounds,
            socket,
            booted: began.elapsed().as_secs_f64(),
            _dir: dir,
        }
    }

    /// Ends the guest; its console, checked for oopses.
    fn end(mut self) -> String {
        let _ = self.guest.kill();
        let _ = self.guest.wait();
        let console = self.console.join().unwrap_or_default();
        for bad in ["Oops", "BUG:", "general protection", "Call Trace"] {
            assert!(!console.contains(bad), "{bad} in the console:\n{console}");
        }
        console
    }
}

/// Examples with kernel probes that [`EXAMPLES`] leaves out (no checker of their own: they
/// need hardware, workloads or kernel features this guest lacks, so they print little):
/// check mode compares them too, each for a few seconds, with stap's test-suite arguments.
const CHECK_ONLY: &[(&str, &[&str])] = &[
    ("general/eventcount.stp", &["syscall_any"]),
    ("general/socket-events.stp", &[]),
    ("interrupt/interrupts-by-dev.stp", &[]),
    ("interrupt/scf.stp", &[]),
    ("io/deviceseeks.stp", &[]),
    ("io/disktop.stp", &[]),
    ("io/io_submit.stp", &[]),
    ("io/ioblktime.stp", &[]),
    ("io/iodevstats.stp", &[]),
    ("io/iotime.stp", &[]),
    ("io/traceaio.stp", &[]),
    ("locks/bkl_stats.stp", &[]),
    ("lwtools/accept2close-nd.stp", &[]),
    ("lwtools/biolatency-nd.stp", &["1", "1"]),
    ("lwtools/bitesize-nd.stp", &[]),
    ("lwtools/fslatency-nd.stp", &["1", "1"]),
    ("lwtools/fsslower-nd.stp", &[]),
    ("memory/cachestat.stp", &[]),
    ("memory/mmanonpage.stp", &[]),
    ("memory/mmfilepage.stp", &[]),
    ("memory/mmreclaim.stp", &[]),
    ("memory/mmwriteback.stp", &[]),
    ("memory/numa_faults.stp", &[]),
    ("memory/overcommit.stp", &[]),
    ("network/sk_stream_wait_memory.stp", &[]),
    ("network/socket-trace.stp", &[]),
    ("network/tcp_retransmission.stp", &[]),
    (
        "network/tcp_trace.stp",
        &["127.0.0.1:*-127.0.0.1:*", "timeout=1"],
    ),
    ("network/tcpdumplike.stp", &[]),
    ("process/futexes.stp", &[]),
    ("process/futexes2.stp", &[]),
    ("process/procmod_watcher.stp", &[]),
    ("process/proctop.stp", &[]),
    ("process/rlimit_nofile.stp", &[]),
    ("process/semop-watch.stp", &[]),
    ("process/sleepingBeauties.stp", &[]),
    ("profiling/latencytap.stp", &[]),
    ("profiling/periodic.stp", &[]),
    ("profiling/ioctl_handler.stp", &[]),
];

/// Examples that print times or durations: the host-evaluated twin reads the clock at the
/// stop, later than the compiled probe reads it (and the guest's clock stands still while
/// it is stopped under TCG), so those numbers differ by design. Their check passes when both
/// printed as many lines and the first lines that differ are the same with their digits
/// masked.
const TIMES: &[&str] = &[
    "forktracker.stp",
    "execsnoop-nd.stp",
    "proc_snoop.stp",
    "sleeptime.stp",
    "sched_switch.stp",
    "pfaults.stp",
    "func_time_stats.stp",
    "wait4time.stp",
    "slowvfs.stp",
    "socket-trace.stp",
    "procmod_watcher.stp",
    "iotime.stp",
];

/// Examples whose histograms are of durations: the buckets themselves differ by design (see
/// [`TIMES`]), so any difference is reported, not failed.
const TIME_HISTOGRAMS: &[&str] = &[
    "rwtime-nd.stp",
    "sched-latency.stp",
    "cycle_thief.stp",
    "func_time_stats.stp",
];

/// Whether check mode's verdict `v` (and the stderr after it) shows outputs that differ only
/// in their digits at the first line that differs, with as many lines on both sides.
fn differs_in_digits_only(v: &str, err: &str) -> bool {
    let counts = v
        .split("line ")
        .nth(1)
        .and_then(|r| {
            let w: Vec<&str> = r.split_whitespace().collect();
            Some((w.get(2)?.to_string(), w.get(5)?.to_string()))
        })
        .is_some_and(|(c, h)| c == h);
    // Each run of digits as one `#`, without spaces (numbers of other widths realign their
    // columns).
    let masked = |l: &str| {
        let mut out = String::new();
        for ch in l.chars().filter(|c| *c != ' ') {
            if ch.is_ascii_digit() {
                if !out.ends_with('#') {
                    out.push('#');
                }
            } else {
                out.push(ch);
            }
        }
        out
    };
    let line = |tag: &str| {
        err.lines()
            .find_map(|l| l.trim_start().strip_prefix(tag))
            .map(masked)
    };
    let (c, h) = (line("compiled:"), line("host-evaluated:"));
    counts && c.is_some() && c == h
}

/// `EXOTAP_EXAMPLES=a,b`: only the examples whose path contains one of them.
fn chosen() -> Vec<&'static Example> {
    let only = std::env::var("EXOTAP_EXAMPLES").unwrap_or_default();
    let only: Vec<&str> = only.split(',').filter(|s| !s.is_empty()).collect();
    EXAMPLES
        .iter()
        .filter(|ex| only.is_empty() || only.iter().any(|o| ex.file.contains(o)))
        .collect()
}

#[test]
fn systemtap_examples_run_unchanged_on_the_live_guest_and_agree_with_its_kprobes() {
    if !have_qemu("systemtap_examples_run_unchanged_on_the_live_guest_and_agree_with_its_kprobes") {
        return;
    }
    let Some(dir) = examples_dir() else {
        return;
    };
    let began = Instant::now();
    let live = LiveGuest::boot(began);
    let (socket, rounds, booted) = (live.socket.clone(), Arc::clone(&live.rounds), live.booted);

    let mut passed = Vec::new();
    let mut failed = Vec::new();
    let examples = chosen();
    for ex in &examples {
        let file = dir.join(ex.file);
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let run = run_example(&file, ex, &socket, &rounds, "auto");
        match (ex.check)(&run) {
            Ok(said) => {
                eprintln!(
                    "PASS {name} {} ({:.1} s, installed after {:.1} s): {said}",
                    ex.args.join(" "),
                    run.secs,
                    run.installed
                );
                passed.push(name);
            }
            Err(why) => {
                eprintln!(
                    "FAIL {name} {} ({:.1} s, installed after {:.1} s): {why}\n--- stdout:\n{}\n--- stderr:\n{}",
                    ex.args.join(" "),
                    run.secs,
                    run.installed,
                    run.out,
                    run.err
                );
                failed.push(format!("{name}: {why}"));
            }
        }
    }
    let console = live.end();
    eprintln!(
        "{} of {} SystemTap examples passed against the live guest in {:.0} s \
         (boot {booted:.0} s, {} rounds of the workload)",
        passed.len(),
        EXAMPLES.len(),
        began.elapsed().as_secs_f64(),
        rounds.load(Ordering::SeqCst)
    );
    assert!(
        !console.contains("kprobe.failed") && !console.contains("event.failed"),
        "the guest could not arm its oracle:\n{console}"
    );
    assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
    if examples.len() == EXAMPLES.len() {
        assert!(passed.len() >= 25, "only {} examples ran", passed.len());
    }
}

/// Issue 16's differential on SystemTap's own examples: each runs with `--compile check`
/// against the live guest, so its compiled probes and the same probes evaluated on the host
/// (a stop per hit, into globals of their own) see the same hits, and exotap compares what
/// the two print. Minutes: every hit of every probe stops the guest
/// (`cargo test --test stap_examples_live -- --ignored --nocapture`; `EXOTAP_EXAMPLES`
/// picks some, `EXOTAP_SHOW_OUTPUT` prints what each printed).
#[test]
#[ignore = "minutes of TCG with a stop per probe hit: run by hand, numbers in the closing note"]
fn systemtap_examples_print_the_same_compiled_and_host_evaluated_on_the_same_hits() {
    if !have_qemu("systemtap_examples_print_the_same_compiled_and_host_evaluated_on_the_same_hits")
    {
        return;
    }
    let Some(dir) = examples_dir() else {
        return;
    };
    let began = Instant::now();
    let live = LiveGuest::boot(began);
    let (socket, rounds) = (live.socket.clone(), Arc::clone(&live.rounds));
    let (mut same, mut differ, mut unchecked) = (Vec::new(), Vec::new(), Vec::new());
    let mut by_design = Vec::new();
    let only = std::env::var("EXOTAP_EXAMPLES").unwrap_or_default();
    let only: Vec<&str> = only.split(',').filter(|s| !s.is_empty()).collect();
    let extra: Vec<Example> = CHECK_ONLY
        .iter()
        .filter(|(f, _)| only.is_empty() || only.iter().any(|o| f.contains(o)))
        .map(|(file, args)| Example {
            file,
            args,
            window: Window::Secs(3),
            check: |_| Ok(String::new()),
        })
        .collect();
    for ex in chosen().into_iter().chain(&extra) {
        let file = dir.join(ex.file);
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if !file.exists() {
            eprintln!("UNCHECKED {name}: not in this systemtap-doc");
            unchecked.push(format!("{name}: not in this systemtap-doc"));
            continue;
        }
        let run = run_example(&file, ex, &socket, &rounds, "check");
        if std::env::var_os("EXOTAP_SHOW_OUTPUT").is_some() {
            eprintln!("--- {name} stdout:\n{}--- stderr:\n{}", run.out, run.err);
        }
        let verdict = run
            .err
            .lines()
            .find(|l| l.starts_with("check: "))
            .map(str::to_owned);
        match verdict {
            Some(v) if v.contains("printed the same") => {
                eprintln!("SAME {name} ({:.1} s): {v}", run.secs);
                same.push(name);
            }
            // Lines of several vCPUs: compiled in TSC order, host-evaluated in stop order.
            Some(v) if v.contains("(the same lines, in another order)") => {
                eprintln!("BY DESIGN {name} ({:.1} s): order differs: {v}", run.secs);
                by_design.push(name);
            }
            Some(v)
                if TIME_HISTOGRAMS.contains(&name.as_str())
                    || (TIMES.contains(&name.as_str()) && differs_in_digits_only(&v, &run.err)) =>
            {
                let detail: Vec<&str> = run
                    .err
                    .lines()
                    .skip_while(|l| !l.starts_with("check: "))
                    .take(3)
                    .collect();
                eprintln!(
                    "BY DESIGN {name} ({:.1} s): times differ: {}",
                    run.secs,
                    detail.join(" | ")
                );
                by_design.push(name);
            }
            Some(v) => {
                eprintln!(
                    "DIFFER {name} ({:.1} s): {v}\n--- stderr:\n{}",
                    run.secs, run.err
                );
                differ.push(format!("{name}: {v}"));
            }
            None => {
                let why = run
                    .err
                    .lines()
                    .find(|l| l.contains("nothing to check") || l.contains("rror"))
                    .unwrap_or("no verdict")
                    .to_owned();
                eprintln!("UNCHECKED {name} ({:.1} s): {why}", run.secs);
                unchecked.push(format!("{name}: {why}"));
            }
        }
    }
    live.end();
    eprintln!(
        "check mode: {} examples printed the same compiled and host-evaluated, {} differ only \
         in times or order (by design), {} differ, {} not checked (nothing compiles, or no \
         verdict), in {:.0} s",
        same.len(),
        by_design.len(),
        differ.len(),
        unchecked.len(),
        began.elapsed().as_secs_f64()
    );
    assert!(differ.is_empty(), "differ:\n{}", differ.join("\n"));
}
