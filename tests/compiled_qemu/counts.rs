//! Compiled counts and strings against the guest's own kprobes at the same stops and the
//! workload's own call counts; aggregates exact under two vCPUs hitting a million times.

use super::*;

#[test]
fn compiled_counts_equal_the_guests_own_kprobes_at_the_same_stops() {
    if !have_qemu("compiled_counts_equal_the_guests_own_kprobes_at_the_same_stops") {
        return;
    }
    // The guest arms a kprobe on every traceable syscall wrapper before exotap attaches (its
    // ftrace must find the nop5 it expects), and disarms them after exotap removed its
    // splices.
    let job = "T=/sys/kernel/tracing\n\
               i=0\n\
               for f in $(grep '^__x64_sys_' $T/available_filter_functions | cut -d' ' -f1); do\n\
                 echo \"p:exotap/k$i $f\" >> $T/kprobe_events 2>/dev/null && i=$((i+1))\n\
               done\n\
               echo 1 > $T/events/exotap/enable\n\
               exotap_result kprobes \"$i\"\n\
               exotap_wait attach\n\
               syscall-loop 2000\n\
               mixed 3\n\
               exotap_wait detach\n\
               echo 0 > $T/events/exotap/enable\n\
               echo > $T/kprobe_events\n";
    let script = r#"global c; probe kernel.function("__x64_sys_*") { c[probefunc()]++ }"#;

    let (code, out, err, transcript) = boot_compared(script, job, "500");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let counts: BTreeMap<String, u64> = out
        .lines()
        .filter_map(|l| {
            let (name, n) = l.strip_prefix("c[\"")?.split_once("\"]=")?;
            Some((name.to_owned(), n.parse().ok()?))
        })
        .collect();
    let mut compared = 0;
    for (name, n) in &counts {
        if let Some(k) = host_result(&err, &format!("kprobe.{name}")) {
            assert_eq!(k.parse::<u64>().ok(), Some(*n), "{name}: {ctx}");
            compared += 1;
        }
    }
    // Every kprobe'd wrapper the workload called was counted, and nothing else was hit.
    for line in err
        .lines()
        .filter_map(|l| l.strip_prefix("HOST-RESULT kprobe."))
    {
        let (name, k) = line.split_once('=').unwrap();
        if k != "0" {
            assert!(
                counts.contains_key(name),
                "{name} hit {k} times in the guest only: {ctx}"
            );
        }
    }
    eprintln!("{compared} syscall wrappers compared with the guest's kprobes, all equal");
    assert!(compared >= 10, "only {compared} functions compared: {ctx}");
    // getpid has no ftrace site (no kprobe): the workload's own count is its oracle.
    assert_eq!(
        counts.get("__x64_sys_getpid").copied(),
        result(&transcript, "getpid.calls").and_then(|v| v.parse().ok()),
        "{ctx}"
    );
    assert_no_oops(&transcript);
}

#[test]
fn compiled_strings_built_from_execname_and_pid_count_as_the_guests_kprobes() {
    if !have_qemu("compiled_strings_built_from_execname_and_pid_count_as_the_guests_kprobes") {
        return;
    }
    let job = "T=/sys/kernel/tracing\n\
               i=0\n\
               for f in __x64_sys_getppid __x64_sys_openat __x64_sys_close __x64_sys_pread64; do\n\
                 echo \"p:exotap/k$i $f\" >> $T/kprobe_events 2>/dev/null && i=$((i+1))\n\
               done\n\
               echo 1 > $T/events/exotap/enable\n\
               exotap_result kprobes \"$i\"\n\
               exotap_wait attach\n\
               syscall-loop 2000\n\
               mixed 2\n\
               exotap_wait detach\n\
               echo 0 > $T/events/exotap/enable\n\
               echo > $T/kprobe_events\n";
    // The key is built in the guest: "syscall-loop/pid=PID" passes 15 bytes, so it lives in
    // the compiled script's string table (shorter ones, e.g. "sh/pid=12", stay inline).
    let script = r#"global c
        probe kernel.function("__x64_sys_getppid"), kernel.function("__x64_sys_getpid"),
              kernel.function("__x64_sys_openat"), kernel.function("__x64_sys_close"),
              kernel.function("__x64_sys_pread64") {
          c[probefunc(), execname() . "/pid=" . sprint(pid())]++
        }"#;

    let (code, out, err, transcript) = boot_compared(script, job, "500");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(!err.contains("string table"), "{ctx}");
    // c["__x64_sys_getppid","syscall-loop/pid=123"]=2000
    let mut per_function = BTreeMap::<String, u64>::new();
    let mut by_loop = BTreeMap::<String, (String, u64)>::new();
    for l in out.lines() {
        let Some((func, rest)) = l.strip_prefix("c[\"").and_then(|r| r.split_once("\",\"")) else {
            continue;
        };
        let (who, n) = rest.split_once("\"]=").unwrap();
        let n: u64 = n.parse().unwrap();
        let (comm, pid) = who.rsplit_once("/pid=").unwrap();
        assert!(pid.parse::<u32>().is_ok_and(|p| p > 1), "{l}: {ctx}");
        assert!(!comm.is_empty() && comm.len() <= 15, "{l}: {ctx}");
        *per_function.entry(func.to_owned()).or_default() += n;
        if comm == "syscall-loop" {
            let before = by_loop.insert(func.to_owned(), (pid.to_owned(), n));
            assert!(before.is_none(), "one syscall-loop process, one key: {ctx}");
        }
    }
    let mut compared = 0;
    for f in ["getppid", "openat", "close", "pread64"] {
        let name = format!("__x64_sys_{f}");
        let k = host_result(&err, &format!("kprobe.{name}"));
        if let Some(k) = k {
            assert_eq!(
                k.parse::<u64>().ok(),
                Some(per_function.get(&name).copied().unwrap_or(0)),
                "{name}: {ctx}"
            );
            compared += 1;
        }
    }
    eprintln!(
        "{compared} functions: built-string keys sum to the guest's kprobe hits ({per_function:?}); \
         syscall-loop's keys: {by_loop:?}"
    );
    assert!(compared >= 3, "only {compared} functions compared: {ctx}");
    // The workload's own counts, under the key built from its execname and pid.
    for f in ["getpid", "getppid", "pread64"] {
        let calls: Option<u64> =
            result(&transcript, &format!("{}.calls", f.trim_end_matches("64")))
                .and_then(|v| v.parse().ok());
        let got = by_loop.get(&format!("__x64_sys_{f}")).map(|v| v.1);
        assert_eq!(got, calls, "{f}: {ctx}");
    }
    let pids: std::collections::BTreeSet<_> = by_loop.values().map(|v| &v.0).collect();
    assert_eq!(pids.len(), 1, "one pid for syscall-loop: {ctx}");
    assert_no_oops(&transcript);
}

#[test]
fn a_long_string_the_host_gives_the_guest_equals_the_same_text_built_there() {
    if !have_qemu("a_long_string_the_host_gives_the_guest_equals_the_same_text_built_there") {
        return;
    }
    // `want` is set on the host (begin) and handed to the guest at the install; the
    // compiled probe builds the same 26 bytes and must find them equal.
    let script = r#"global want, hits, other
        probe begin { want = "syscall-loop" . "/getppid-calls" }
        probe kernel.syscall("getppid") {
          if (execname() . "/getppid-calls" == want) hits++
          else other++
        }
        probe end { printf("hits=%d %s %d\n", hits, want, strlen(want)) }"#;

    let (code, out, err, console) = boot(script, "require", "syscall-loop 60");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let calls = result(&console, "getppid.calls").unwrap_or("?");
    assert!(
        script_output(&out).contains(&format!("hits={calls} syscall-loop/getppid-calls 26\n")),
        "{ctx}"
    );
    assert_no_oops(&console);
}

#[test]
fn compiled_string_functions_pick_out_the_workloads_calls() {
    if !have_qemu("compiled_string_functions_pick_out_the_workloads_calls") {
        return;
    }
    // Every string function that compiles, and `=~`/`!~` on inline and built strings, on
    // the guest's own execname: only syscall-loop's getppid calls pass all of them, as many
    // as it reports making.
    let script = r#"global hits, other
        probe kernel.syscall("getppid") {
          e = execname()
          k = sprintf("%s/%05d|%-4x|%c", e, 42, 255, 33)
          if (isinstr(e, "loop") && strpos(e, "-") == 7 && stringat(e, 0) == 115
              && strtol(sprintf("%x", 255), 16) == 255 && strtol(" -0x1f", 16) == -31
              && str_replace(e, "-", "__") == "syscall__loop"
              && k == "syscall-loop/00042|ff  |!"
              && e =~ "^sys[a-z]+-(loop|other)$" && k !~ "[A-Z]"
              && k =~ "^syscall-loop/0+42\\|ff +\\|!$") hits++
          else other++
        }
        probe end { printf("hits=%d\n", hits) }"#;

    let (code, out, err, console) = boot(script, "require", "syscall-loop 60");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let calls = result(&console, "getppid.calls").unwrap_or("?");
    assert!(
        script_output(&out).contains(&format!("hits={calls}\n")),
        "{ctx}"
    );
    assert!(!err.contains("compiled probe ("), "no probe errors: {ctx}");
    assert_no_oops(&console);
}

#[test]
fn compiled_aggregates_stay_exact_with_both_vcpus_hitting_a_million_times() {
    if !have_qemu("compiled_aggregates_stay_exact_with_both_vcpus_hitting_a_million_times") {
        return;
    }
    const EACH: u64 = 170_000;
    // Two loops at once, one per vCPU: every hit updates the same tables from both.
    let job = format!(
        "T=/sys/kernel/tracing\n\
         echo 'p:exotap/gp __do_sys_getppid' >> $T/kprobe_events\n\
         echo 'p:exotap/vr vfs_read' >> $T/kprobe_events\n\
         echo 1 > $T/events/exotap/enable\n\
         exotap_wait attach\n\
         syscall-loop {EACH} > /tmp/a & syscall-loop {EACH} > /tmp/b & wait\n\
         exotap_wait detach\n\
         echo 0 > $T/events/exotap/enable\n\
         echo > $T/kprobe_events\n\
         cat /tmp/a /tmp/b\n"
    );
    let script = r#"global calls, sizes, getpid
        probe kernel.function("__x64_sys_getpid") { if (execname() == "syscall-loop") getpid[cpu()]++ }
        probe kernel.function("__do_sys_getppid") { calls[cpu()]++ }
        probe kernel.function("vfs_read") { sizes[execname()] <<< $count }
        probe end {
          foreach (c in getpid) { printf("getpid cpu%d=%d\n", c, getpid[c]); gp += getpid[c] }
          foreach (c in calls) n += calls[c]
          foreach (e in sizes) { reads += @count(sizes[e]) }
          printf("getpid=%d\ngetppid=%d\nreads=%d\n", gp, n, reads)
          printf("loop.reads=%d\nloop.bytes=%d\n", @count(sizes["syscall-loop"]), @sum(sizes["syscall-loop"]))
        }"#;

    let (code, out, err, transcript) = boot_compared(script, &job, "900");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let value = |key: &str| -> Option<u64> {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .and_then(|v| v.trim().parse().ok())
    };
    let kprobe = |f: &str| host_result(&err, &format!("kprobe.{f}")).and_then(|v| v.parse().ok());
    let per_cpu = out.lines().filter(|l| l.starts_with("getpid cpu")).count();
    let hits =
        value("getpid").unwrap_or(0) + value("getppid").unwrap_or(0) + value("reads").unwrap_or(0);
    println!("{hits} hits on {per_cpu} vCPUs:\n{out}");
    assert_eq!(per_cpu, 2, "both vCPUs ran the loops: {ctx}");
    assert!(hits >= 1_000_000, "{ctx}");
    assert_eq!(value("getpid"), Some(2 * EACH), "{ctx}");
    assert_eq!(value("getppid"), kprobe("__do_sys_getppid"), "{ctx}");
    assert_eq!(value("reads"), kprobe("vfs_read"), "{ctx}");
    assert_eq!(value("loop.reads"), Some(2 * EACH), "{ctx}");
    // syscall-loop preads 64 bytes per call.
    assert_eq!(value("loop.bytes"), Some(2 * EACH * 64), "{ctx}");
    assert_no_oops(&transcript);
}
