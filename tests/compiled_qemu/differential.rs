//! The same script compiled and host-evaluated prints the same bytes (`DIFFERENTIAL`); both
//! read the same clock; check mode compares the two paths on the same hits; a call swapped by
//! both kinds of return probe returns to its caller.

use super::*;

/// Scripts whose output depends only on the workload (`syscall-loop 60`, filtered on its
/// name): each prints the same bytes compiled and host-evaluated.
const DIFFERENTIAL: &[&str] = &[
    // Counters by two keys, strings, ternary, compound assignment, `in`.
    r#"global calls, sizes, small, big, n
       probe kernel.function("vfs_read") {
         if (execname() != "syscall-loop") next
         calls[execname(), probefunc()]++
         sizes <<< $count
         n += $count > 32 ? 2 : 1
         if ($count < 100) small++; else big++
       }
       probe kernel.syscall("getppid") {
         if (execname() == "syscall-loop") calls[execname(), "getppid"] += 1
       }
       probe end {
         foreach ([e, f] in calls) printf("%s %s %d\n", e, f, calls[e, f])
         printf("n=%d small=%d big=%d in=%d\n", n, small, big, ["syscall-loop", "vfs_read"] in calls)
         printf("count=%d sum=%d min=%d max=%d avg=%d\n", @count(sizes), @sum(sizes), @min(sizes), @max(sizes), @avg(sizes))
         print(@hist_log(sizes))
       }"#,
    // Loops, locals, division, shifts, a linear histogram, return probes with $return.
    r#"global acc, h, rets
       probe kernel.function("vfs_read") {
         if (execname() != "syscall-loop") next
         x = 0; i = 0
         while (i < 5) { x += i * $count; i++ }
         for (j = 0; j < 3; j++) { if (j == 1) continue; x = x ^ (j << 3) }
         acc <<< x / 7 + x % 5 - (x >> 2)
         h <<< $count
       }
       probe kernel.function("__x64_sys_getppid").return {
         if (execname() == "syscall-loop") rets[$return > 0] <<< 1
       }
       probe end {
         printf("%d %d %d %d\n", @count(acc), @sum(acc), @min(acc), @max(acc))
         print(@hist_linear(h, 0, 128, 16))
         foreach (k in rets) printf("positive=%d n=%d\n", k, @count(rets[k]))
       }"#,
    // printf/println from kernel probes: output records in per-vCPU rings, printed by the
    // host in TSC order.
    r#"global n
       probe kernel.syscall("getppid") {
         if (execname() == "syscall-loop") {
           n++
           printf("%s call %d of %s (%x)\n", execname(), n, probefunc(), n * 255)
           if (n % 20 == 0) println("every twentieth: ", n, " ", pp())
         }
       }
       probe end { printf("n=%d\n", n) }"#,
    // Global strings and scalars written by kernel probes and read by end.
    r#"global last, seen, total = 5, nr, lo
       probe kernel.syscall("getpid") {
         if (execname() == "syscall-loop") { last = execname(); seen++; total = total + 2 }
       }
       probe kernel.function("vfs_read") {
         // *pos: the file offset syscall-loop preads at (0), read through the kernel
         if (execname() == "syscall-loop") { nr += kernel_long($pos) + 1; lo = kernel_int($pos) - 3 }
       }
       probe end { printf("%s %d %d %d %d\n", last, seen, total, nr, lo) }"#,
    // foreach sorted with a limit, user functions (recursive, and raising errors) called
    // inside try, @variance, string order: run inside the guest.
    r#"global seen[32], lat, order, caught, fsum, v
       function fact:long (n:long) { if (n <= 1) return 1; return n * fact(n - 1) }
       function check:long (c:long) { if (c > 100) error("big"); return 64 / (c - 64) }
       probe kernel.function("vfs_read") {
         if (execname() != "syscall-loop") next
         seen[$count % 7, execname()]++
         seen[fsum % 5, "x"]++
         lat <<< $count + fsum % 3
         fsum += fact($count % 6)
         try { fsum += check($count) } catch (m) { caught[m]++ }
         foreach ([k-, e] in seen limit 2) order[k] = seen[k, e]
         if (execname() < "zz") fsum++
         v = @variance(lat)
       }
       probe end {
         foreach ([k, e] in seen) printf("%d %s %d\n", k, e, seen[k, e])
         foreach (k in order) printf("order %d %d\n", k, order[k])
         foreach (m in caught) printf("caught %s %d\n", m, caught[m])
         printf("fsum=%d var=%d v=%d\n", fsum, @variance(lat), v)
       }"#,
];

#[test]
fn compiled_and_host_evaluated_scripts_print_the_same() {
    if !have_qemu("compiled_and_host_evaluated_scripts_print_the_same") {
        return;
    }
    for script in DIFFERENTIAL {
        let (code_c, out_c, err_c, con_c) = boot(script, "require", "syscall-loop 60");
        let (code_h, out_h, err_h, _) = boot(script, "never", "syscall-loop 60");

        let ctx = format!("script:\n{script}\ncompiled stderr:\n{err_c}\nhost stderr:\n{err_h}");
        assert_eq!((code_c, code_h), (0, 0), "{ctx}");
        assert!(!script_output(&out_c).trim().is_empty(), "{ctx}");
        assert_eq!(script_output(&out_c), script_output(&out_h), "{ctx}");
        assert_no_oops(&con_c);
    }
    eprintln!(
        "{} scripts printed the same compiled and host-evaluated",
        DIFFERENTIAL.len()
    );
}

/// Probes run on the host (begin) and compiled probes (in the guest) read one clock: the
/// guest's. A TCG guest's wall clock is seconds off the host's (its RTC has whole seconds,
/// and it drifts), so before the host side added the guest's offset a compiled probe's
/// `gettimeofday_us() - start` came out negative (-2.1 s measured on a fresh boot).
#[test]
fn begin_and_compiled_probes_read_the_same_clock() {
    if !have_qemu("begin_and_compiled_probes_read_the_same_clock") {
        return;
    }
    let script = r#"global start
      probe begin { start = gettimeofday_us() }
      probe kernel.syscall("getppid") {
        if (execname() == "syscall-loop") printf("since begin %d\n", gettimeofday_us() - start)
      }"#;
    let began = std::time::Instant::now();
    let (code, out, err, _) = boot(script, "require", "syscall-loop 3");
    let run_us = began.elapsed().as_micros() as i64;
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let since: Vec<i64> = out
        .lines()
        .filter_map(|l| l.strip_prefix("since begin "))
        .map(|n| n.parse().expect("a number"))
        .collect();
    assert_eq!(since.len(), 3, "{ctx}");
    // After begin, and within the run (plus the clock's tick of staleness).
    assert!(
        since.iter().all(|&us| (-10_000..run_us).contains(&us)),
        "{since:?} not within 0..{run_us} us: {ctx}"
    );
    assert!(since.windows(2).all(|w| w[0] <= w[1]), "{ctx}");
}

/// Host-evaluated probes read the guest's clock as it stands at their stop: under TCG it
/// stands still while exotap holds the guest, so the host's time plus the offset measured at
/// attach runs ahead of it by every pause since. The oracle is the compiled return probe of
/// the same call, which reads the guest's own clock (`ktime_get_real_fast_ns`): the duration
/// from a host-evaluated entry to it. Without the correction the entry's time gained about
/// 25 ms on the guest's clock at every call (-7.4 s after 300 calls); with it, about 0.25 ms
/// (the time between QEMU stopping the guest's ticks and exotap seeing the stop, and the
/// same at resume, counted as running). The bound: under 1 ms a call.
#[test]
fn host_evaluated_probes_read_the_guests_clock_across_their_own_stops() {
    if !have_qemu("host_evaluated_probes_read_the_guests_clock_across_their_own_stops") {
        return;
    }
    // symdata() keeps the entry probe on the host; the return probe compiles.
    let script = r#"global t, d
      probe kernel.function("__x64_sys_getppid") {
        if (execname() == "syscall-loop" && symdata(2) != "") t[tid()] = gettimeofday_us()
      }
      probe kernel.function("__x64_sys_getppid").return {
        if (execname() == "syscall-loop" && tid() in t) {
          d <<< gettimeofday_us() - t[tid()]
          delete t[tid()]
        }
      }
      probe end { printf("inside min=%d max=%d count=%d\n", @min(d), @max(d), @count(d)) }"#;
    let (code, out, err, console) = boot(script, "auto", "syscall-loop 300");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nconsole:\n{console}");
    assert_eq!(code, 0, "{ctx}");
    assert!(err.contains("on the host instead"), "not mixed: {ctx}");
    let field = |k: &str| -> i64 {
        out.lines()
            .find_map(|l| l.strip_prefix("inside "))
            .and_then(|l| l.split(' ').find_map(|f| f.strip_prefix(k)))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in the output: {ctx}"))
    };
    eprintln!(
        "host entry to compiled return of getppid: min {} us, max {} us, {} calls",
        field("min="),
        field("max="),
        field("count=")
    );
    assert_eq!(field("count="), 300, "{ctx}");
    assert!(field("max=") > 0, "{ctx}");
    assert!(field("min=") > -300_000, "{ctx}");
}

/// A compiled and a host-evaluated `.return` probe of one function both swap the return
/// address of a call (the host's breakpoint first, then the splice); a call still in flight
/// at removal (a `sleep` in `hrtimer_nanosleep`) must get its caller's address back, not
/// the host trampoline the compiled probe kept as "original": the removal undoes the swaps
/// in reverse order. It returns after exotap left; before, it ran the trampoline's `ud2`.
#[test]
fn a_call_swapped_by_a_compiled_and_a_host_return_probe_returns_to_its_caller_after_removal() {
    if !have_qemu(
        "a_call_swapped_by_a_compiled_and_a_host_return_probe_returns_to_its_caller_after_removal",
    ) {
        return;
    }
    let script = r#"global c, h
      probe kernel.function("hrtimer_nanosleep").return { c++ }
      probe kernel.function("hrtimer_nanosleep").return { if (symdata(2) != "") h++ }
      probe end { printf("compiled %d host %d\n", c, h) }"#;
    let job = "exotap_wait attach\n\
               sleep 3 &\n\
               sleep 1\n\
               exotap_wait detach\n\
               wait\n\
               exotap_result slept 1\n";
    let (code, out, err, console) = boot_in_job(script, "auto", job, "300");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nconsole:\n{console}");
    assert_eq!(code, 0, "{ctx}");
    assert!(err.contains("the script runs mixed"), "{ctx}");
    // `sleep 1` returned through both probes; `sleep 3` was still asleep at removal.
    assert!(out.contains("compiled 1 host 1\n"), "{ctx}");
    assert!(console.contains("EXOTAP-RESULT slept=1"), "{ctx}");
    assert_no_oops(&console);
    assert!(!console.contains("invalid opcode"), "{ctx}");
}

/// `--compile check` on the same scripts: the compiled probes and the same probes on the
/// host see the same hits in ONE run, and exotap compares what they print; a value that
/// differs by design (the time a probe reads, the host's probe running later, at its stop)
/// is caught and named.
#[test]
fn check_mode_compares_compiled_and_host_evaluated_probes_on_the_same_hits() {
    if !have_qemu("check_mode_compares_compiled_and_host_evaluated_probes_on_the_same_hits") {
        return;
    }
    for script in &DIFFERENTIAL[..2] {
        let (code, out, err, con) = boot(script, "check", "syscall-loop 30");
        let ctx = format!("script:\n{script}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 0, "{ctx}");
        let verdict = err.lines().find(|l| l.starts_with("check: ")).unwrap_or("");
        assert!(verdict.contains("printed the same"), "{ctx}");
        assert!(!script_output(&out).trim().is_empty(), "{ctx}");
        assert_no_oops(&con);
    }
    // The tapset's argument and return-value functions, compiled (a syscall wrapper's
    // arguments come from its pt_regs): syscall-loop preads 64 bytes from offset 0 of fd 3,
    // its 18-byte file, each time.
    let args = r#"global reads, returns, sizes
      probe kernel.function("__x64_sys_pread64") {
        if (execname() == "syscall-loop") reads[int_arg(1), ulong_arg(3), long_arg(4)]++
      }
      probe kernel.function("__x64_sys_pread64").return {
        if (execname() == "syscall-loop") returns[returnval(), uint_arg(3)]++
      }
      probe kernel.function("vfs_read") {
        if (execname() == "syscall-loop") sizes[long_arg(3)]++
      }
      probe end {
        foreach ([fd, n, off] in reads) printf("pread fd %d count %d offset %d: %d\n", fd, n, off, reads[fd, n, off])
        foreach ([r, n] in returns) printf("returned %d of %d: %d\n", r, n, returns[r, n])
        foreach (n in sizes) printf("vfs_read of %d: %d\n", n, sizes[n])
      }"#;
    let (code, out, err, _) = boot(args, "check", "syscall-loop 30");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("check: ") && l.contains("printed the same 3 lines")),
        "{ctx}"
    );
    let printed = script_output(&out);
    assert!(
        printed.contains("count 64 offset 0: 30\n")
            && printed.contains("returned 18 of 64: 30\n")
            && printed.contains("vfs_read of 64: 30\n"),
        "{ctx}"
    );
    // __switch_to's first instruction is too short for a splice: a breakpoint enters its
    // compiled body, and the host-evaluated twin at that breakpoint runs first.
    let switch = r#"global n, names
      probe kernel.function("__switch_to") { n++; names[execname()]++ }
      probe end { printf("%d\n", n); foreach (e+ in names) printf("%s %d\n", e, names[e]) }"#;
    // Sorted by name: the two vCPUs' first switches race, so the order of first inserts (an
    // unsorted foreach's order) may differ between the compiled code and the host's twins.
    let (code, out, err, con) = boot(switch, "check", "syscall-loop 5; sleep 0.1");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(printed_the_same(&err), "{ctx}");
    assert!(
        err.contains("hits entered compiled code from a breakpoint"),
        "{ctx}"
    );
    assert_no_oops(&con);
    let clock = r#"global n
      probe kernel.syscall("getppid") {
        if (execname() == "syscall-loop" && ++n == 3) printf("t=%d\n", gettimeofday_ns())
      }"#;
    let (code, out, err, _) = boot(clock, "check", "syscall-loop 5");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 1, "{ctx}");
    assert!(
        err.contains(
            "printed different output: line 1 of 2 (compiled) / 2 (host-evaluated) differs"
        ) && err.contains("compiled:        \"t=")
            && err.contains("host-evaluated:  \"t="),
        "{ctx}"
    );
}
