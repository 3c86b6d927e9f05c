//! End-to-end: boot the Debian guest under QEMU TCG and follow the guest protocol.

mod common;

use common::{exotap, have_qemu, result, run};

#[test]
fn default_workload_runs_both_phases_and_reports_done_0() {
    if !have_qemu("default_workload_runs_both_phases_and_reports_done_0") {
        return;
    }

    let (code, out, err) = run(exotap().args(["boot", "--timeout", "300", "--hold", "syscalls"]));

    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let markers: Vec<&str> = out
        .lines()
        .filter_map(|l| l.find("EXOTAP-").map(|at| &l[at..]))
        .filter(|m| !m.starts_with("EXOTAP-RESULT"))
        .collect();
    assert_eq!(
        markers,
        [
            "EXOTAP-READY",
            "EXOTAP-PHASE syscalls",
            "EXOTAP-WAIT syscalls",
            "EXOTAP-GO syscalls",
            "EXOTAP-PHASE mixed",
            "EXOTAP-DONE 0"
        ],
        "{out}"
    );
    for call in ["getpid", "getppid", "open_close", "pread"] {
        assert_eq!(
            result(&out, &format!("{call}.calls")),
            Some("20000"),
            "{out}"
        );
        let ns: u64 = result(&out, &format!("{call}.ns_per_call"))
            .unwrap()
            .parse()
            .unwrap();
        assert!(ns > 0, "{call} took no time? {out}");
    }
    assert_eq!(result(&out, "mixed.forks"), Some("20"), "{out}");
    assert_eq!(result(&out, "mixed.errors"), Some("0"), "{out}");
    assert!(
        err.contains("patch heap: 64 MiB at guest-physical 0x3c000000..0x40000000"),
        "{err}"
    );
}

#[test]
fn job_exit_code_becomes_exotaps_and_results_go_to_stdout_with_console_file() {
    if !have_qemu("job_exit_code_becomes_exotaps_and_results_go_to_stdout_with_console_file") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let job = "exotap_result kernel \"$(uname -r)\"\n\
               exotap_result tracefs \"$(test -e /sys/kernel/tracing/available_filter_functions && echo yes)\"\n\
               exotap_result heap_hidden \"$(grep -c '3c000000-3fffffff : Reserved' /proc/iomem)\"\n\
               exit 3\n";
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();

    let (code, out, err) = run(exotap()
        .args(["boot", "--timeout", "300", "--job"])
        .arg(&job_file)
        .arg("--console")
        .arg(&console));

    assert_eq!(code, 3, "stdout:\n{out}\nstderr:\n{err}");
    let transcript = std::fs::read_to_string(&console).unwrap();
    assert!(transcript.contains("EXOTAP-READY"), "{transcript}");
    assert_eq!(
        result(&out, "kernel"),
        Some("6.1.0-50-cloud-amd64"),
        "{out}"
    );
    assert_eq!(result(&out, "tracefs"), Some("yes"), "{out}");
    assert_eq!(
        result(&out, "heap_hidden"),
        Some("1"),
        "the memmap range must be reserved: {transcript}"
    );
    assert!(out.contains("EXOTAP-DONE 3"), "{out}");
}

#[test]
fn boot_timeout_fails_with_the_last_console_lines() {
    if !have_qemu("boot_timeout_fails_with_the_last_console_lines") {
        return;
    }

    let (code, out, err) =
        run(exotap().args(["boot", "--boot-timeout", "1", "--append", "loglevel=7"]));

    assert_eq!(code, 125, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains("did not reach EXOTAP-READY within 1 s; last console lines:"),
        "{err}"
    );
}
