//! End-to-end: probe scripts compiled into the live Debian guest (`exotap boot --script`,
//! exotap_probes::compile). Oracles: the guest's own kprobes read at the same stops as the
//! install and the removal, the workload's own call counts, and the host-evaluated path
//! (`--compile never`), which must print the same bytes on the same deterministic workload.
//! The boot helpers live here; the tests in modules by what they compile (`counts`,
//! `differential`, `kinds`, `stacks`, `mixed`, `statements`, `returns`, `target`, and the
//! by-hand `bench`).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

#[path = "../common/mod.rs"]
mod common;

mod bench;
mod counts;
mod differential;
mod kinds;
mod mixed;
mod modules;
mod returns;
mod stacks;
mod statements;
mod target;

use std::collections::BTreeMap;

use common::{boot, exotap, have_qemu, host_result, result, run};

/// Boots the guest with a compiled `script` whose `job` calls `exotap_wait attach` and
/// `exotap_wait detach` itself (after arming the guest's kprobes, which exotap then reads at
/// its install and removal stops); returns (code, stdout, stderr, console).
fn boot_compared(script: &str, job: &str, timeout: &str) -> (i32, String, String, String) {
    boot_in_job(script, "require", job, timeout)
}

/// [`boot_compared`] with `--compile MODE`.
fn boot_in_job(
    script: &str,
    mode: &str,
    job: &str,
    timeout: &str,
) -> (i32, String, String, String) {
    common::boot_attached_in_job(script, mode, job, timeout, &["--compare-kprobes"])
}

/// Boots `script` on `job` compiled (`--compile require`) and host-evaluated (both exit 0);
/// returns the compiled run's stdout and console, the host-evaluated run's stdout, and both
/// stderrs (for assertion messages).
fn boot_both(script: &str, job: &str) -> (String, String, String, String) {
    let (code_c, out_c, err_c, con_c) = boot(script, "require", job);
    let (code_h, out_h, err_h, _) = boot(script, "never", job);
    let ctx = format!("compiled stderr:\n{err_c}\nhost stderr:\n{err_h}");
    assert_eq!((code_c, code_h), (0, 0), "{ctx}");
    (out_c, con_c, out_h, ctx)
}

/// Whether check mode's verdict on stderr says both sides printed the same.
fn printed_the_same(err: &str) -> bool {
    err.lines()
        .any(|l| l.starts_with("check: ") && l.contains("printed the same"))
}

fn assert_no_oops(console: &str) {
    for bad in [
        "Oops",
        "BUG:",
        "WARNING:",
        "general protection",
        "Call Trace",
    ] {
        assert!(!console.contains(bad), "{bad} in the console:\n{console}");
    }
}

/// The script's own output: stdout without the guest's `EXOTAP-` lines that `boot` adds.
fn script_output(out: &str) -> String {
    out.lines()
        .filter(|l| !l.starts_with("EXOTAP-"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// The numbers of the line of `printed` that a script printed as `FIRST n WORD n WORD n...`
/// (the first such line), in order; `None` when there is none or a number does not parse.
fn totals(printed: &str, first: &str) -> Option<Vec<u64>> {
    let line = printed
        .lines()
        .find(|l| l.split_whitespace().next() == Some(first))?;
    line.split_whitespace()
        .skip(1)
        .step_by(2)
        .map(|v| v.parse().ok())
        .collect()
}

/// The `PREFIX COUNT TEXT` lines of `out` as text → count (counts of one text added up).
fn counted(out: &str, prefix: &str) -> std::collections::BTreeMap<String, u64> {
    let mut m = std::collections::BTreeMap::new();
    for l in out.lines().filter_map(|l| l.strip_prefix(prefix)) {
        let (n, text) = l.split_once(' ').unwrap();
        *m.entry(text.to_owned()).or_insert(0) += n.parse::<u64>().unwrap();
    }
    m
}
