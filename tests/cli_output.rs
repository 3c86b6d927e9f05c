//! The CLI's own output when standard output fails: a reader that closed the pipe (`exotap
//! symbols '*' | head -1`) ends the command quietly with 141 (128 + SIGPIPE, as a shell shows
//! a tool SIGPIPE killed), and any other write error (a full disk) is reported with exit code
//! 125. Neither may panic: a panic in a command with splices in a live guest would leave them
//! there. A probe script's output follows the same rule: a closed pipe stops the session
//! quietly with 141, a full disk is a script error (exit code 1).

mod common;

use common::{exotap, run};

#[test]
fn a_reader_that_closed_the_pipe_ends_the_command_quietly() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let (code, _, err) = run(exotap().arg("host").stdout(writer));
    assert_eq!(code, 141, "stderr:\n{err}");
    assert!(
        err.is_empty(),
        "nothing to say about a closed pipe, got:\n{err}"
    );
}

#[test]
fn a_full_disk_is_reported_as_an_error() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("SKIP: this host has no /dev/full to fill");
        return;
    };
    let (code, _, err) = run(exotap().arg("host").stdout(full));
    assert_eq!(code, 125, "stderr:\n{err}");
    assert!(
        err.contains("exotap: error: cannot write standard output: No space left on device"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_script_whose_reader_closed_the_pipe_stops_quietly() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let script =
        "probe begin { for (i = 0; i < 100; i++) println(i) } probe end { println(\"end\") }";

    let (code, _, err) = run(exotap().args(["-e", script]).stdout(writer));

    assert_eq!(code, 141, "stderr:\n{err}");
    assert!(
        err.is_empty(),
        "nothing to say about a closed pipe, got:\n{err}"
    );
}

#[test]
fn a_script_writing_to_a_full_disk_reports_a_script_error() {
    let Ok(full) = std::fs::OpenOptions::new().write(true).open("/dev/full") else {
        eprintln!("SKIP: this host has no /dev/full to fill");
        return;
    };

    let (code, _, err) = run(exotap()
        .args(["-e", "probe begin { println(1) }"])
        .stdout(full));

    assert_eq!(code, 1, "stderr:\n{err}");
    assert!(
        err.contains("ERROR: output failed: No space left on device"),
        "{err}"
    );
}
