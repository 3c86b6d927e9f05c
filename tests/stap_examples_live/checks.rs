//! The examples' checks: each reads one example's output (its header, its rows' format,
//! numbers that parse) and, where it counts kernel events, compares the counts with the
//! guest's own kprobe hits over the same window.

use std::collections::BTreeMap;

use super::Run;

pub(super) fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

pub(super) fn num(field: &str) -> Result<i64, String> {
    field
        .trim()
        .parse()
        .map_err(|_| format!("'{field}' is not a number"))
}

/// The rows after the line that starts (trimmed) with `header`, split on whitespace; every
/// row must have at least `fields` fields.
pub(super) fn rows_after<'a>(
    run: &'a Run,
    header: &str,
    fields: usize,
) -> Result<Vec<Vec<&'a str>>, String> {
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
pub(super) fn equal(what: &str, counted: u64, function: &str, run: &Run) -> Result<String, String> {
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
pub(super) fn at_entry(
    what: &str,
    counted: u64,
    function: &str,
    run: &Run,
) -> Result<String, String> {
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
pub(super) const VCPUS: u64 = 2;

/// `counted` (by the example at function returns) may differ from the guest's entry count
/// by the calls in flight at install and at removal: at most `slack`.
pub(super) fn near(
    what: &str,
    counted: u64,
    function: &str,
    slack: u64,
    run: &Run,
) -> Result<String, String> {
    let k = run.k(function)?;
    ensure(counted.abs_diff(k) <= slack, || {
        format!(
            "{what}: the example counted {counted}, the guest's kprobe on {function} {k} \
             (more than {slack} apart)"
        )
    })?;
    Ok(format!("{what} {counted} ~ kprobe {function} {k}"))
}

/// `counted` (by the example at function returns, only the calls that returned `>= 0`) is at
/// most the guest's entry count and the calls in flight, and at least that count less the
/// calls in flight and the failed calls, which the example leaves out and the guest's
/// kprobe does not: a tenth at most. (The same CI runs' unfiltered return counts of
/// `__x64_sys_read` equalled the guest's; iostats' filtered ones came 1, 4, 5 and 8 under it
/// in 80 to 102 reads: a read of a non-blocking socket with nothing to read, or one a signal
/// interrupted, returns < 0.)
pub(super) fn successful_at_return(
    what: &str,
    counted: u64,
    function: &str,
    run: &Run,
) -> Result<String, String> {
    let k = run.k(function)?;
    let failed = k / 10;
    ensure(
        counted <= k + IN_FLIGHT && counted + IN_FLIGHT + failed >= k,
        || {
            format!(
                "{what}: the example counted {counted} calls that returned >= 0, the guest's \
                 kprobe on {function} {k} entries (expected {}..={})",
                k.saturating_sub(IN_FLIGHT + failed),
                k + IN_FLIGHT
            )
        },
    )?;
    Ok(format!("{what} {counted} ~ kprobe {function} {k}"))
}

/// Calls in flight at the two stops, for counts taken at returns: two vCPUs, and the tasks
/// of the workload that may sleep inside a call (a shell in wait4, httpd in accept, a pipe
/// read).
pub(super) const IN_FLIGHT: u64 = 6;

pub(super) fn syscalls_by_proc(run: &Run) -> Result<String, String> {
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

pub(super) fn syscalls_by_pid(run: &Run) -> Result<String, String> {
    let rows = rows_after(run, "#SysCalls  PID", 2)?;
    let mut total = 0;
    for r in &rows {
        total += num(r[0])?;
        ensure(num(r[1])? > 0, || format!("pid {} in {r:?}", r[1]))?;
    }
    equal("syscalls", total as u64, "x64_sys_call", run)
}

pub(super) fn syscallbypid_nd(run: &Run) -> Result<String, String> {
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

pub(super) fn thread_business(run: &Run) -> Result<String, String> {
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
pub(super) fn signal_rows(run: &Run, header: &str) -> Result<String, String> {
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

pub(super) fn sig_by_proc(run: &Run) -> Result<String, String> {
    signal_rows(run, "SENDER")
}

pub(super) fn sig_by_pid(run: &Run) -> Result<String, String> {
    signal_rows(run, "SPID")
}

pub(super) fn sigkill(run: &Run) -> Result<String, String> {
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

pub(super) fn forktracker(run: &Run) -> Result<String, String> {
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

pub(super) fn proc_snoop(run: &Run) -> Result<String, String> {
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

pub(super) fn sleeptime(run: &Run) -> Result<String, String> {
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

pub(super) fn pstrace_exec(run: &Run) -> Result<String, String> {
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

pub(super) fn spawn_seeker(run: &Run) -> Result<String, String> {
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

pub(super) fn execsnoop_nd(run: &Run) -> Result<String, String> {
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
pub(super) fn histograms(run: &Run) -> Result<usize, String> {
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

pub(super) fn sched_latency(run: &Run) -> Result<String, String> {
    let heads = histograms(run)?;
    ensure(
        run.out
            .lines()
            .any(|l| l.starts_with("pid:") && l.contains(" prio:")),
        || "no 'pid:N prio:N' line".into(),
    )?;
    Ok(format!("{heads} histograms"))
}

pub(super) fn cycle_thief(run: &Run) -> Result<String, String> {
    let heads = histograms(run)?;
    ensure(
        run.out
            .lines()
            .any(|l| l.starts_with("task ") && l.contains(" migrated: ")),
        || "no 'task N migrated: N' line".into(),
    )?;
    Ok(format!("{heads} histograms"))
}

pub(super) fn sched_switch(run: &Run) -> Result<String, String> {
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
/// `user_string_quoted()` and `_sys_open_flag_str()` too). Its reads and writes are the
/// calls that returned `>= 0` (`if (count >= 0)` in its return probes).
pub(super) fn iostats(run: &Run) -> Result<String, String> {
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
        successful_at_return("reads", reads as u64, "__x64_sys_read", run)?,
        successful_at_return("writes", writes as u64, "__x64_sys_write", run)?
    ))
}

/// "PID NAME r: N UNIT w: N UNIT" rows (traceio's timer prints them every second).
pub(super) fn traceio(run: &Run) -> Result<String, String> {
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

pub(super) fn pfaults(run: &Run) -> Result<String, String> {
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

pub(super) fn netdev(run: &Run) -> Result<String, String> {
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

pub(super) fn nettop(run: &Run) -> Result<String, String> {
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

pub(super) fn tcp_connections(run: &Run) -> Result<String, String> {
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
pub(super) fn tracepoint_exits(run: &Run) -> Result<String, String> {
    let line = run
        .out
        .lines()
        .find(|l| l.starts_with("exits "))
        .ok_or("no 'exits' line")?;
    let exits = num(line.trim_start_matches("exits "))? as u64;
    ensure(exits > 0, || "no exit counted".into())?;
    near("exits", exits, "do_exit", IN_FLIGHT, run)
}

pub(super) fn dropwatch(run: &Run) -> Result<String, String> {
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

pub(super) fn func_time_stats(run: &Run) -> Result<String, String> {
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

pub(super) fn iotop(run: &Run) -> Result<String, String> {
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

pub(super) fn strace_open(run: &Run) -> Result<String, String> {
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

pub(super) fn chng_cpu(run: &Run) -> Result<String, String> {
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

pub(super) fn probe_alias(run: &Run) -> Result<String, String> {
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
pub(super) fn hist_totals(run: &Run, titles: &[&str]) -> Result<Vec<u64>, String> {
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
pub(super) fn wait4time(run: &Run) -> Result<String, String> {
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
pub(super) fn slowvfs(run: &Run) -> Result<String, String> {
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
pub(super) fn rwtime_nd(run: &Run) -> Result<String, String> {
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
pub(super) fn opensnoop_nd(run: &Run) -> Result<String, String> {
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
pub(super) fn killsnoop_nd(run: &Run) -> Result<String, String> {
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
pub(super) fn entry_values(run: &Run) -> Result<String, String> {
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
