//! Probe errors, member chains and strings, return probes and entry values, guru writes, and
//! scripts that do not compile.

use super::*;

#[test]
fn compiled_probe_errors_are_counted_and_reported_and_the_guest_lives() {
    if !have_qemu("compiled_probe_errors_are_counted_and_reported_and_the_guest_lives") {
        return;
    }
    let cases = [
        (
            r#"global z; probe kernel.syscall("getpid") { if (execname() == "syscall-loop") z = 10 / (z - z) }"#,
            "division by 0 in a compiled probe",
        ),
        (
            r#"probe kernel.syscall("getpid") { if (execname() == "syscall-loop") while (1) {} }"#,
            "MAXACTION exceeded in a compiled probe",
        ),
        (
            r#"global a[4], i; probe kernel.syscall("getpid") { if (execname() == "syscall-loop") a[i++] = 1 }"#,
            "array overflow in a compiled probe",
        ),
        (
            r#"global x; probe kernel.syscall("getpid") { if (execname() == "syscall-loop") x = kernel_long(0) }"#,
            "kernel read fault in a compiled probe",
        ),
        (
            r#"probe kernel.syscall("getpid") { if (execname() == "syscall-loop") println(user_string(1)) }"#,
            "kernel read fault in a compiled probe",
        ),
        (
            r#"global x; probe kernel.syscall("getpid") { if (execname() == "syscall-loop") x = @cast(0, "struct file")->f_inode->i_ino }"#,
            "kernel read fault in a compiled probe",
        ),
        // Recursion on the guest's kernel stack, cut at MAXNESTING.
        (
            r#"function down:long (n:long) { return down(n + 1) }
               probe kernel.syscall("getpid") { if (execname() == "syscall-loop") down(0) }"#,
            "MAXNESTING exceeded in a compiled probe (50 times)",
        ),
        (
            r#"probe kernel.syscall("getpid") { if (execname() == "syscall-loop") error("no") }"#,
            "error() raised in a compiled probe (50 times)",
        ),
    ];
    for (script, message) in cases {
        let (code, out, err, console) = boot(script, "require", "syscall-loop 50");

        let ctx = format!("script:\n{script}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 1, "a probe error is a script error: {ctx}");
        assert!(err.contains(message), "{ctx}");
        assert!(
            out.contains("EXOTAP-DONE 0"),
            "the guest's job finished: {ctx}"
        );
        assert_no_oops(&console);
    }
}

#[test]
fn compiled_member_chains_and_kernel_strings_read_what_the_guest_reports() {
    if !have_qemu("compiled_member_chains_and_kernel_strings_read_what_the_guest_reports") {
        return;
    }
    // The oracle: the guest's own `stat -c %i` of the file `dd` reads (busybox `cat` would
    // use sendfile, not read).
    let script = r#"probe kernel.function("vfs_read") {
          if (execname() == "dd")
            printf("read ino=%d name=%s\n", $file->f_inode->i_ino,
                   kernel_string($file->f_path->dentry->d_name->name))
        }"#;

    let (code, out, err, console) = boot(
        script,
        "require",
        "dd if=/init of=/dev/null bs=64 count=1 2>/dev/null; exotap_result ino $(stat -c %i /init)",
    );

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let ino = result(&console, "ino").unwrap_or_else(|| panic!("no inode number: {ctx}"));
    assert!(
        out.contains(&format!("read ino={ino} name=init\n")),
        "{ctx}"
    );
    assert_no_oops(&console);
}

#[test]
fn compiled_and_host_evaluated_user_strings_print_the_same() {
    if !have_qemu("compiled_and_host_evaluated_user_strings_print_the_same") {
        return;
    }
    let script = r#"probe kernel.function("do_sys_openat2") {
          if (execname() == "dd")
            printf("open %s|%s| %d\n", user_string($filename), user_string_n($filename, 3), pid())
        }"#;
    // No `2>/dev/null`: busybox's shell may open the redirect in a child already named `dd`
    // or not yet, so that open counted in some runs and not in others.
    let job = "dd if=/init of=/dev/null bs=64 count=1";

    let (out_c, con_c, out_h, ctx) = boot_both(script, job);
    // The job's own dd: the process that opened /init. The guest's `exotap_wait` is a `dd`
    // too (of=/dev/null), and which of its runs fall between install and removal differs
    // between the paths (the host path arms its breakpoints at another moment).
    let job_opens = |out: &str| -> Vec<String> {
        let text = script_output(out);
        let pid = text
            .lines()
            .find_map(|l| l.strip_prefix("open /init|/in| "))
            .unwrap_or_else(|| panic!("no open of /init in:\n{text}\n{ctx}"))
            .to_owned();
        let mut lines: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_suffix(&format!(" {pid}")))
            .map(str::to_owned)
            .collect();
        // Their order may differ: the compiled records are ordered by TSC across the vCPUs,
        // the host-evaluated ones by stop.
        lines.sort();
        lines
    };
    let compiled = job_opens(&out_c);
    assert_eq!(
        compiled,
        ["open /dev/null|/de|", "open /init|/in|"],
        "the job's dd opens its two files: {ctx}"
    );
    assert_eq!(compiled, job_opens(&out_h), "{ctx}");
    assert_no_oops(&con_c);
}

#[test]
fn compiled_return_probes_see_the_entrys_arguments_as_the_host_path_does() {
    if !have_qemu("compiled_return_probes_see_the_entrys_arguments_as_the_host_path_does") {
        return;
    }
    // The oracle: dd's own request (64 bytes), and the host-evaluated path.
    let script = r#"probe kernel.function("ksys_read").return {
          if (execname() == "dd")
            printf("count=%d entry=%d return=%d\n", $count, @entry($count), $return)
        }"#;
    // No `2>/dev/null`: busybox's shell may open the redirect in a child already named `dd`
    // or not yet, so that open counted in some runs and not in others.
    let job = "dd if=/init of=/dev/null bs=64 count=1";

    let (out_c, con_c, out_h, ctx) = boot_both(script, job);
    assert!(
        script_output(&out_c).contains("count=64 entry=64 return=64\n"),
        "{out_c}\n{ctx}"
    );
    // Every line compiled printed, the host path printed too. (The host path printed one
    // more once, "count=1 entry=1 return=1" before dd's read: not explained yet.)
    let host = script_output(&out_h);
    for line in script_output(&out_c).lines() {
        assert!(host.contains(line), "{line} only compiled: {host}\n{ctx}");
    }
    assert_no_oops(&con_c);
}

#[test]
fn entry_values_of_expressions_are_computed_at_the_entry_both_ways() {
    if !have_qemu("entry_values_of_expressions_are_computed_at_the_entry_both_ways") {
        return;
    }
    // Oracles: dd's own request (64 bytes: ksys_read's third argument), its name, a clock
    // that cannot run backwards, and the host-evaluated path. 6 words of @entry values (a
    // function's most), the string in the last two.
    let script = r#"probe kernel.function("ksys_read").return {
          # Faults at every entry, but is never read: no probe error (as the interpreter
          # raises it only where the return reads it).
          if ($count == 12345) println(@entry(kernel_long(0)))
          if (execname() == "dd")
            printf("count=%d plus=%d arg=%d forward=%d name=%s\n", $count,
                   @entry($count + 1), @entry(pointer_arg(3)),
                   gettimeofday_ns() >= @entry(gettimeofday_ns()), @entry(execname()))
        }"#;
    let job = "dd if=/init of=/dev/null bs=64 count=1";

    let (out_c, con_c, out_h, ctx) = boot_both(script, job);
    let want = "count=64 plus=65 arg=64 forward=1 name=dd\n";
    assert!(script_output(&out_c).contains(want), "{out_c}\n{ctx}");
    assert!(script_output(&out_h).contains(want), "{out_h}\n{ctx}");
    assert!(!ctx.contains("ERROR"), "{ctx}");
    let host = script_output(&out_h);
    for line in script_output(&out_c).lines() {
        assert!(host.contains(line), "{line} only compiled: {host}\n{ctx}");
    }
    assert_no_oops(&con_c);
}

#[test]
fn a_guru_script_sets_the_return_value_the_guests_workload_sees() {
    if !have_qemu("a_guru_script_sets_the_return_value_the_guests_workload_sees") {
        return;
    }
    // Oracles: the workload's own getppid results (the last one it got, and its call
    // count), and a shell's $PPID (its own getppid at start), which the filter leaves alone.
    let script = r#"global n
        probe kernel.function("__x64_sys_getppid").return {
          if (execname() == "syscall-loop") { n++; if (n % 2) set_return(4242) else $return = 4242 }
        }
        probe end { printf("n=%d\n", n) }"#;
    let job = "syscall-loop 50; sh -c 'echo EXOTAP-RESULT other.ppid=$PPID'";
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");

    let (code, out, err) = run(exotap()
        .args(["boot", "-g", "--timeout", "400", "--compile", "require"])
        .args(["--script-text", script, "--run", job, "--console"])
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(result(&out, "getppid.value"), Some("4242"), "{ctx}");
    let calls = result(&out, "getppid.calls").unwrap_or("?");
    assert!(
        script_output(&out).contains(&format!("n={calls}\n")),
        "every call of the workload ran the body: {ctx}"
    );
    let other: i64 = result(&out, "other.ppid").unwrap().parse().unwrap();
    assert!(other > 0 && other != 4242, "{ctx}");
    assert_no_oops(&std::fs::read_to_string(&console).unwrap_or_default());
}

#[test]
fn guru_writes_of_return_values_and_parameters_reach_the_guest_compiled_and_host_evaluated() {
    if !have_qemu(
        "guru_writes_of_return_values_and_parameters_reach_the_guest_compiled_and_host_evaluated",
    ) {
        return;
    }
    // Oracles: syscall-loop's last getppid result and its call count; the bytes dd wrote
    // after its one 64-byte read was cut to 3 at ksys_read's entry, counted by wc.
    let script = r#"global n
        probe kernel.function("__x64_sys_getppid").return {
          if (execname() == "syscall-loop") { n++; if (n % 2) set_return(4242) else $return = 4242 }
        }
        probe kernel.function("ksys_read") { if (execname() == "dd") $count = 3 }
        probe end { printf("n=%d\n", n) }"#;
    let job = "syscall-loop 20; sh -c 'echo EXOTAP-RESULT dd.bytes=$(dd if=/init bs=64 count=1 2>/dev/null | wc -c)'";
    for mode in ["require", "never"] {
        let dir = tempfile::tempdir().unwrap();
        let console = dir.path().join("console.log");

        let (code, out, err) = run(exotap()
            .args(["boot", "-g", "--timeout", "400", "--compile", mode])
            .args(["--script-text", script, "--run", job, "--console"])
            .arg(&console));

        let ctx = format!("--compile {mode}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 0, "{ctx}");
        assert_eq!(result(&out, "getppid.value"), Some("4242"), "{ctx}");
        assert_eq!(result(&out, "getppid.calls"), Some("20"), "{ctx}");
        assert!(script_output(&out).contains("n=20\n"), "{ctx}");
        assert_eq!(result(&out, "dd.bytes"), Some("3"), "{ctx}");
        assert_no_oops(&std::fs::read_to_string(&console).unwrap_or_default());
    }
}

#[test]
fn a_guru_write_is_refused_without_g() {
    if !have_qemu("a_guru_write_is_refused_without_g") {
        return;
    }
    let script = r#"probe kernel.function("__x64_sys_getppid").return { $return = 4242 }"#;

    let (code, _, err, _) = boot(script, "require", "syscall-loop 5");

    assert_ne!(code, 0, "{err}");
    assert!(err.contains("run with -g"), "{err}");
}

#[test]
fn a_script_that_does_not_compile_names_the_construct_and_falls_back_or_fails() {
    if !have_qemu("a_script_that_does_not_compile_names_the_construct_and_falls_back_or_fails") {
        return;
    }
    let script = r#"global n
        probe kernel.syscall("getppid") { if (execname() == "syscall-loop") n++; x = symdata(n) }
        probe end { printf("n=%d\n", n) }"#;

    let (code_r, _, err_r, _) = boot(script, "require", "syscall-loop 5");
    let (code_a, out_a, err_a, _) = boot(script, "auto", "syscall-loop 5");

    assert_eq!(
        code_r, 125,
        "--compile=require refuses before the job runs: {err_r}"
    );
    assert!(
        err_r.contains("the function symdata() in a kernel probe"),
        "{err_r}"
    );
    assert_eq!(code_a, 0, "{err_a}");
    assert!(
        err_a.contains("run on the host instead") && err_a.contains("symdata()"),
        "{err_a}"
    );
    assert!(out_a.contains("n=5"), "auto ran it on the host: {out_a}");
}
