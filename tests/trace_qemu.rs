//! End-to-end: a probe script runs against the live Debian guest (`exotap boot --script`),
//! with host-evaluated breakpoint probes (`--compile never`: this path is the oracle the
//! compiled one is checked against in tests/compiled_qemu/). Oracles: the workload's own call
//! counts, and a kprobe the guest arms on the same function through its own kprobe_events
//! (which also turns the entry nop5 into an ftrace call under the breakpoint, so the
//! out-of-line copy must follow).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::{boot_with_gdbstub, exotap, have_qemu, result, run};

const CALLS: u64 = 200;
/// syscall-loop.c preads into `char buf[64]`, `sizeof(buf)` bytes per call.
const PREAD_BYTES: u64 = 64;

fn value(out: &str, key: &str) -> Option<u64> {
    let prefix = format!("{key}=");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

#[test]
fn script_counts_match_the_workload_and_the_guests_own_kprobe() {
    if !have_qemu("script_counts_match_the_workload_and_the_guests_own_kprobe") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let job = format!(
        "T=/sys/kernel/tracing\n\
         echo 'p:exotap/getppid __do_sys_getppid' >> $T/kprobe_events\n\
         echo 1 > $T/events/exotap/getppid/enable\n\
         syscall-loop {CALLS}\n\
         exotap_result kprobe.getppid \"$(awk '$1==\"getppid\" || $1==\"exotap/getppid\" {{print $2}}' $T/kprobe_profile)\"\n"
    );
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();
    let script = r#"
        global getppid, reads, bytes
        probe kernel.syscall("getppid") { if (execname() == "syscall-loop") getppid++ }
        probe kernel.function("vfs_read") {
          if (execname() == "syscall-loop") { reads++; bytes += $count }
        }
        probe end { printf("getppid=%d\nreads=%d\nbytes=%d\n", getppid, reads, bytes) }
    "#;

    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            "400",
            "--compile",
            "never",
            "--script-text",
            script,
            "--job",
        ])
        .arg(&job_file)
        .arg("--console")
        .arg(&console));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    assert_eq!(
        result(&out, "getppid.calls"),
        Some(CALLS.to_string().as_str()),
        "{ctx}"
    );
    assert_eq!(
        result(&out, "kprobe.getppid"),
        Some(CALLS.to_string().as_str()),
        "{ctx}"
    );
    assert_eq!(value(&out, "getppid"), Some(CALLS), "{ctx}");
    assert_eq!(
        result(&out, "pread.calls"),
        Some(CALLS.to_string().as_str()),
        "{ctx}"
    );
    assert_eq!(value(&out, "reads"), Some(CALLS), "{ctx}");
    assert_eq!(value(&out, "bytes"), Some(CALLS * PREAD_BYTES), "{ctx}");
}

#[test]
fn return_probes_see_the_value_the_workload_got_and_every_call_returns() {
    if !have_qemu("return_probes_see_the_value_the_workload_got_and_every_call_returns") {
        return;
    }
    let script = r#"
        global entries, returns, values
        probe kernel.syscall("getppid") { if (execname() == "syscall-loop") entries++ }
        probe kernel.syscall("getppid").return {
          if (execname() == "syscall-loop") { returns++; values[$return]++ }
        }
        probe end {
          printf("entries=%d\nreturns=%d\n", entries, returns)
          foreach (v in values) printf("value%d=%d\n", v, values[v])
        }
    "#;

    let (code, out, err) = run(exotap().args([
        "boot",
        "--timeout",
        "400",
        "--compile",
        "never",
        "--script-text",
        script,
        "--run",
        "syscall-loop 50",
        "--console",
        "/dev/null",
    ]));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(value(&out, "entries"), Some(50), "{ctx}");
    assert_eq!(value(&out, "returns"), Some(50), "{ctx}");
    // The workload prints what getppid returned to it; every return probe saw that value.
    let ppid = result(&out, "getppid.value").unwrap();
    assert_eq!(value(&out, &format!("value{ppid}")), Some(50), "{ctx}");
}

#[test]
fn script_with_errors_stops_before_booting() {
    let (code, _out, err) = run(exotap().args([
        "boot",
        "--script-text",
        r#"probe kernel.function("vfs_read") { x = "a" + 1 }"#,
    ]));

    assert_eq!(code, 125, "{err}");
    assert!(err.contains("type mismatch"), "{err}");
    assert!(err.contains("the script has errors"), "{err}");
}

#[test]
fn detaching_mid_call_gives_the_swapped_return_address_back() {
    if !have_qemu("detaching_mid_call_gives_the_swapped_return_address_back") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    // The script ends (exit() from a timer) while `sleep 8` is inside hrtimer_nanosleep, whose
    // return address is swapped for the trampoline at that moment.
    let script = r#"
        global n
        probe kernel.function("hrtimer_nanosleep") { n++ }
        probe kernel.function("hrtimer_nanosleep").return { println("returned") }
        probe timer.s(3) { printf("entered=%d\n", n); exit() }
    "#;

    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            "400",
            "--compile",
            "never",
            "--script-text",
            script,
            "--run",
        ])
        .arg("sleep 8; exotap_result slept yes")
        .arg("--console")
        .arg(&console));

    let transcript = std::fs::read_to_string(&console).unwrap();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(value(&out, "entered"), Some(1), "{ctx}");
    assert!(
        !out.contains("returned"),
        "the sleep cannot have returned yet: {ctx}"
    );
    assert!(
        err.contains("1 calls in flight got their return addresses back"),
        "{ctx}"
    );
    assert_eq!(result(&out, "slept"), Some("yes"), "{ctx}");
    for bad in ["Oops", "BUG:", "WARNING:", "general protection"] {
        assert!(
            !transcript.contains(bad),
            "{bad} in the console:\n{transcript}"
        );
    }
}

#[test]
fn run_with_target_traces_a_guest_someone_else_booted() {
    if !have_qemu("run_with_target_traces_a_guest_someone_else_booted") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gdb.sock");
    // The guest sleeps long enough after EXOTAP-READY for exotap to attach.
    let (mut guest, mut console) = boot_with_gdbstub(
        &[
            "--timeout",
            "300",
            "--run",
            "sleep 8; syscall-loop 100; sleep 1",
        ],
        &socket,
        "EXOTAP-READY",
    );

    let (code, out, err) = run(exotap()
        .args(["run", "--compile", "never", "--target"])
        .arg(format!("unix:{}", socket.display()))
        .args([
            "-e",
            r#"global n; probe kernel.syscall("getppid") { if (execname() == "syscall-loop") n++ }
               probe end { printf("n=%d\n", n) }"#,
        ]));

    let mut rest = String::new();
    std::io::Read::read_to_string(&mut console, &mut rest).unwrap();
    assert!(guest.wait().unwrap().success(), "{rest}");
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(
        value(&out, "n"),
        Some(100),
        "stdout:\n{out}\nstderr:\n{err}"
    );
    assert_eq!(result(&rest, "getppid.calls"), Some("100"), "{rest}");
}

#[test]
fn a_script_prints_to_stdout_beside_the_console_without_a_deadlock() {
    if !have_qemu("a_script_prints_to_stdout_beside_the_console_without_a_deadlock") {
        return;
    }
    // No --console: the console and the script's output share stdout (the console sink once
    // held stdout's lock for the whole run, and the first println stopped the tracer).
    let (code, out, err) = run(exotap().args([
        "boot",
        "--timeout",
        "300",
        "--compile",
        "never",
        "--script-text",
        r#"probe kernel.function("__do_sys_getppid") { if (execname() == "syscall-loop") println("hit ", execname()) }"#,
        "--run",
        "syscall-loop 3",
    ]));
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(
        out.lines().filter(|l| *l == "hit syscall-loop").count(),
        3,
        "{ctx}"
    );
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
}
