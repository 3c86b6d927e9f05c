//! The CLI's own output when standard output fails: a reader that closed the pipe (`exotap
//! symbols '*' | head -1`) ends the command quietly with 141 (128 + SIGPIPE, as a shell shows
//! a tool SIGPIPE killed), and any other write error (a full disk) is reported with exit code
//! 125. Neither may panic: a panic in a command with splices in a live guest would leave them
//! there. A probe script's output follows the same rule: a closed pipe stops the session
//! quietly with 141, a full disk is a script error (exit code 1).

#![allow(clippy::expect_used)] // test helpers outside #[test] fns

mod common;

use std::process::Command;

use common::{exotap, run};

/// Runs `cmd` with standard output a pipe whose reader is gone; returns (exit code, stderr).
fn into_closed_pipe(cmd: &mut Command) -> (i32, String) {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let (code, _, err) = run(cmd.stdout(writer));
    (code, err)
}

/// Runs `cmd` with standard output `/dev/full`; returns (exit code, stderr), or `None` (and
/// says why) where the host has no `/dev/full`.
fn into_full_disk(cmd: &mut Command) -> Option<(i32, String)> {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("SKIP: this host has no /dev/full to fill");
        return None;
    };
    let (code, _, err) = run(cmd.stdout(full));
    Some((code, err))
}

#[test]
fn a_reader_that_closed_the_pipe_ends_the_command_quietly() {
    let (code, err) = into_closed_pipe(exotap().arg("host"));
    assert_eq!(code, 141, "stderr:\n{err}");
    assert!(
        err.is_empty(),
        "nothing to say about a closed pipe, got:\n{err}"
    );
}

#[test]
fn a_full_disk_is_reported_as_an_error() {
    let Some((code, err)) = into_full_disk(exotap().arg("host")) else {
        return;
    };
    assert_eq!(code, 125, "stderr:\n{err}");
    assert!(
        err.contains("exotap: error: cannot write standard output: No space left on device"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_script_whose_reader_closed_the_pipe_stops_quietly() {
    let script =
        "probe begin { for (i = 0; i < 100; i++) println(i) } probe end { println(\"end\") }";

    let (code, err) = into_closed_pipe(exotap().args(["-e", script]));

    assert_eq!(code, 141, "stderr:\n{err}");
    assert!(
        err.is_empty(),
        "nothing to say about a closed pipe, got:\n{err}"
    );
}

#[test]
fn a_script_writing_to_a_full_disk_reports_a_script_error() {
    let Some((code, err)) = into_full_disk(exotap().args(["-e", "probe begin { println(1) }"]))
    else {
        return;
    };

    assert_eq!(code, 1, "stderr:\n{err}");
    assert!(
        err.contains("ERROR: output failed: No space left on device"),
        "{err}"
    );
}
