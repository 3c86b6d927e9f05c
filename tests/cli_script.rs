//! The command line as stap users type it: `exotap FILE.stp ARGS...` without the `run`
//! subcommand, stap's `-p N`, `-g`, `-D NAME=VALUE`, `-o FILE` and `-x PID`, and the script's
//! arguments reaching `$1`, `@1`, `argc` and `argv`; the checks of `count --trap-script` made
//! before a guest boots. Guest-free scripts only: no guest needed.

#![allow(clippy::expect_used, clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use std::path::PathBuf;

use common::{exotap, run};

/// Writes `text` to a script file in a fresh directory (kept alive by the returned guard).
fn script(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("t.stp");
    std::fs::write(&path, text).expect("write script");
    (dir, path)
}

#[test]
fn a_file_with_arguments_runs_without_the_run_subcommand() {
    let (_dir, path) =
        script("probe begin { printf(\"%d %s %d %s\\n\", $1 * 2, @2, argc, argv[2]) }");
    let (code, out, err) = run(exotap().arg(&path).args(["21", "two"]));
    assert_eq!(
        (code, out.as_str()),
        (0, "42 two 2 two\n"),
        "stderr:\n{err}"
    );
}

#[test]
fn the_run_subcommand_takes_arguments_too() {
    let (_dir, path) = script("probe begin { println(@1) }");
    let (code, out, err) = run(exotap().arg("run").arg(&path).arg("hello"));
    assert_eq!((code, out.as_str()), (0, "hello\n"), "stderr:\n{err}");
}

#[test]
fn dash_e_takes_every_word_as_an_argument() {
    let (code, out, err) = run(exotap().args(["-e", "probe begin { println($1 + $2) }", "1", "2"]));
    assert_eq!((code, out.as_str()), (0, "3\n"), "stderr:\n{err}");
}

#[test]
fn a_missing_argument_fails_pass_one_as_stap_says() {
    let (_dir, path) = script("probe begin { println($1) }");
    let (code, _, err) = run(exotap().args(["-p", "1"]).arg(&path));
    assert_eq!(code, 1, "stderr:\n{err}");
    assert!(
        err.contains("command line argument index 1 out of range [1-0]"),
        "{err}"
    );
}

#[test]
fn target_pid_and_guru_mode_reach_the_script() {
    let (_dir, path) =
        script("probe begin { println(target(), %( guru_mode == 1 %? \" guru\" %: \" user\" %)) }");
    let (code, out, err) = run(exotap().args(["-g", "-x", "4321"]).arg(&path));
    assert_eq!((code, out.as_str()), (0, "4321 guru\n"), "stderr:\n{err}");
}

#[test]
fn output_goes_to_the_dash_o_file() {
    let (dir, path) = script("probe begin { println(\"to the file\") }");
    let out_file = dir.path().join("out.txt");
    let (code, out, err) = run(exotap().arg("-o").arg(&out_file).arg(&path));
    let written = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert_eq!(
        (code, out.as_str(), written.as_str()),
        (0, "", "to the file\n"),
        "stderr:\n{err}"
    );
}

#[test]
fn an_unknown_define_only_warns_and_a_limit_applies() {
    let (_dir, path) = script("probe begin { for (i = 0; i < 100; i++) n++ }");
    let (code, _, err) = run(exotap()
        .args(["-D", "STP_NO_OVERLOAD=1", "-D", "MAXACTION=10"])
        .arg(&path));
    assert_eq!(code, 1, "MAXACTION=10 must stop the loop; stderr:\n{err}");
    assert!(err.contains("STP_NO_OVERLOAD has no effect"), "{err}");
    assert!(err.contains("MAXACTION"), "{err}");
}

#[test]
fn a_malformed_limit_is_refused() {
    let (_dir, path) = script("probe begin { }");
    let (code, _, err) = run(exotap().args(["-D", "MAXACTION=lots"]).arg(&path));
    assert_eq!(code, 125, "stderr:\n{err}");
    assert!(err.contains("bad -D MAXACTION=lots"), "{err}");
}

#[test]
fn subcommands_still_win_over_a_script_file_name() {
    let (code, out, err) = run(exotap().arg("host"));
    assert_eq!(code, 0, "stderr:\n{err}");
    assert!(!out.is_empty());
}

#[test]
fn dash_capital_i_adds_a_directory_of_tapset_functions() {
    let (dir, path) = script("probe begin { println(twice(21), \" \", ctime(0)) }");
    let lib = dir.path().join("tapset");
    std::fs::create_dir(&lib).expect("tapset dir");
    std::fs::write(lib.join("mine.stp"), "function twice(x) { return 2 * x }\n")
        .expect("write tapset");
    let (code, out, err) = run(exotap().arg("-I").arg(&lib).arg(&path));
    assert_eq!(
        (code, out.as_str()),
        (0, "42 Thu Jan  1 00:00:00 1970\n"),
        "stderr:\n{err}"
    );
}

#[test]
fn a_target_variable_write_is_checked_in_guru_mode_only() {
    let (_dir, path) = script("probe kernel.function(\"vfs_read\") { $count = 0 }");
    let (plain, _, plain_err) = run(exotap().args(["-p", "2"]).arg(&path));
    let (guru, _, guru_err) = run(exotap().args(["-g", "-p", "2"]).arg(&path));
    assert_eq!(
        (plain, guru),
        (1, 0),
        "plain:\n{plain_err}\nguru:\n{guru_err}"
    );
    assert!(plain_err.contains("run with -g"), "{plain_err}");
}

/// `count --blocks --trap-script`: what is wrong with the script, or with where it would run,
/// is said before any guest boots (and without a cached kernel).
#[test]
fn a_trap_script_is_checked_before_anything_boots() {
    let count = |path: &std::path::Path, extra: &[&str]| {
        run(exotap()
            .args(["count", "--blocks", "vfs_read", "--trap-script"])
            .arg(path)
            .args(extra))
    };
    let (_dir, bad) = script("probe kernel.function(\"vfs_read\") { n++ \n");
    let (code, out, err) = count(&bad, &[]);
    assert_ne!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("the script has errors"), "{err}");
    assert!(!err.contains("booting"), "{err}");

    let (_dir, no_kernel) = script("probe begin { println(1) }");
    let (code, _, err) = count(&no_kernel, &[]);
    assert_ne!(code, 0, "stderr:\n{err}");
    assert!(err.contains("the script has no kernel probe"), "{err}");

    let (_dir, good) = script("global n\nprobe kernel.function(\"vfs_read\") { n++ }\n");
    let (code, _, err) = count(&good, &["--target", "tcp:127.0.0.1:9"]);
    assert_ne!(code, 0, "stderr:\n{err}");
    assert!(err.contains("not with --target"), "{err}");

    // Refused on any host: for the trap script where KVM runs Linux, for the host elsewhere.
    let (code, _, err) = count(&good, &["--backend", "kvm"]);
    assert_ne!(code, 0, "stderr:\n{err}");
    assert!(err.contains("--backend kvm refused"), "{err}");

    let missing = std::path::Path::new("/nonexistent/t.stp");
    let (code, _, err) = count(missing, &[]);
    assert_ne!(code, 0, "stderr:\n{err}");
    assert!(
        err.contains("cannot read script /nonexistent/t.stp"),
        "{err}"
    );

    // Without --blocks the option is refused by the argument parser.
    let (code, _, err) = run(exotap()
        .args(["count", "vfs_read", "--trap-script"])
        .arg(&good));
    assert_eq!(code, 2, "stderr:\n{err}");
    assert!(err.contains("--blocks"), "{err}");
}

/// stap's `-T SECONDS` ends a script that would run forever the way Ctrl-C does: its end
/// probe runs (and prints), exit 0.
#[test]
fn dash_capital_t_ends_the_script_and_runs_its_end_probe() {
    let (code, out, err) = run(exotap().args([
        "-T",
        "1",
        "-e",
        "global n; probe timer.ms(50) { n++ } probe end { printf(\"ended %d\\n\", n > 0) }",
    ]));
    assert_eq!((code, out.as_str()), (0, "ended 1\n"), "stderr:\n{err}");
}

/// stap's `-w` silences the checker's warnings (here: an optional probe point that does not
/// exist); without it the warning is printed.
#[test]
fn dash_w_silences_warnings() {
    let text = "probe nosuch.thing?, begin { exit() }";
    let (code, _, err) = run(exotap().args(["-e", text]));
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("optional probe point skipped"), "{err}");
    let (code, _, err) = run(exotap().args(["-w", "-e", text]));
    assert_eq!((code, err.as_str()), (0, ""));
}

/// The stap options an example's command line carries that mean nothing to exotap are
/// accepted (`-s`, `-k`, `--all-modules`), `--bpf` with a warning that says what exotap does
/// instead; the script runs as without them.
#[test]
fn stap_options_without_an_effect_here_are_accepted() {
    let (code, out, err) = run(exotap().args([
        "-s",
        "8",
        "-k",
        "--all-modules",
        "--bpf",
        "-e",
        "probe begin { println(\"ran\"); exit() }",
    ]));
    assert_eq!((code, out.as_str()), (0, "ran\n"), "stderr:\n{err}");
    assert!(
        err.contains("--bpf") && err.contains("not into eBPF"),
        "{err}"
    );
}

/// stap's `-c CMD` with `--target`: refused (exotap cannot start a command inside a guest
/// that is already running), saying what to do instead; nothing runs.
#[test]
fn dash_c_with_a_running_guest_is_refused_with_what_to_do() {
    let (code, out, err) = run(exotap().args([
        "-c",
        "ls",
        "--target",
        "unix:/nonexistent/gdb.sock",
        "-e",
        "probe begin { println(1) }",
    ]));
    assert_eq!((code, out.as_str()), (125, ""), "stderr:\n{err}");
    assert!(
        err.contains("-c \"ls\" with --target") && err.contains("-x PID"),
        "{err}"
    );
}

/// stap's `-c CMD`: exotap boots the guest with CMD as its job, the script runs from before
/// CMD starts until it exits, and target() is CMD's pid: syscall-loop's 100 getppid calls
/// (exactly COUNT, guest-images/workloads/syscall-loop.c) are all the target's.
#[test]
fn dash_c_runs_the_command_in_a_booted_guest_with_target_its_pid() {
    if !common::have_qemu("dash_c_runs_the_command_in_a_booted_guest_with_target_its_pid") {
        return;
    }
    let (code, out, err) = run(exotap().args([
        "-c",
        "syscall-loop 100",
        "-e",
        r#"global mine, other
           probe kernel.syscall("getppid") {
             if (execname() == "syscall-loop") { if (pid() == target()) mine++; else other++ }
           }
           probe end { printf("getppid by the target %d, by other syscall-loops %d (%d)\n",
                              mine, other, target() > 1) }"#,
    ]));
    assert_eq!(
        (code, out.as_str()),
        (
            0,
            "getppid by the target 100, by other syscall-loops 0 (1)\n"
        ),
        "stderr:\n{err}"
    );
}
