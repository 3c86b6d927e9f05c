//! End-to-end: `kernel.function("F").inline` probes every place the compiler inlined F, and
//! nothing else (issue 39).
//!
//! The places come from the -dbg vmlinux's DWARF (`exotap lines --inlined`: each
//! `DW_TAG_inlined_subroutine`'s entry pc, as `caller+offset`). The oracle is the guest's own
//! kprobes at those same places, each filtered on the workload's comm: one guest run, in which
//! the job first counts a deterministic workload (`dd` moving single bytes: one `ksys_read`
//! and one `ksys_write` per byte, each with its inlined `fdget_pos`, `file_ppos` and
//! `fdput_pos`) with its kprobes, removes them, and then lets exotap attach and runs the same
//! workload again under the `.inline` probes. Every place must count what the guest counted
//! there; host-evaluated and compiled.
//!
//! The two runs cannot share one window: exotap refuses to splice over a guest kprobe's
//! `int3` (its copy would copy the trap), and a kprobe registered over a splice would copy
//! exotap's jump.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

mod common;

use std::collections::BTreeMap;

use common::{exotap, have_qemu, result, run};

/// Inline helpers of the read and write system calls, each inlined in several callers.
const FUNCTIONS: &[&str] = &["fdget_pos", "file_ppos", "fdput_pos"];
/// Bytes `dd` moves one at a time (a read and a write each).
const BYTES: u64 = 300;
/// The most instances the guest is asked to kprobe (of all functions together).
const MAX_SITES: usize = 60;

/// One inlined instance: the function and its place as `caller+offset` (decimal offset).
#[derive(Debug, Clone)]
struct Instance {
    function: String,
    site: String,
}

/// The inlined instances of `function` from `exotap lines --inlined`: lines such as
/// `fdget_pos inlined at fs/read_write.c:628 0xffffffff8134a615 <ksys_write+37>`.
fn instances(function: &str) -> Vec<Instance> {
    let (code, out, err) = run(exotap().args(["lines", "--inlined", "--brief", function]));
    assert_eq!(code, 0, "exotap lines --inlined {function}: {err}");
    out.lines()
        .filter(|l| l.starts_with(&format!("{function} inlined at ")))
        .filter_map(|l| {
            let site = l.rsplit_once('<')?.1.strip_suffix('>')?;
            Some(Instance {
                function: function.to_owned(),
                site: site.to_owned(),
            })
        })
        .collect()
}

fn inline_counts_equal_the_guests_kprobes(mode: &str) {
    let test = format!("inline_counts_equal_the_guests_kprobes ({mode})");
    if !have_qemu(&test) {
        return;
    }
    let mut all: Vec<Instance> = FUNCTIONS.iter().flat_map(|f| instances(f)).collect();
    // The places the workload reaches come first (ksys_read, ksys_write); the rest count 0
    // in both runs, which checks that nothing else is probed there.
    all.sort_by_key(|i| !(i.site.starts_with("ksys_read+") || i.site.starts_with("ksys_write+")));
    all.truncate(MAX_SITES);
    for f in FUNCTIONS {
        assert!(
            all.iter().filter(|i| i.function == *f).count() >= 2,
            "{f}: fewer than two inlined instances in the DWARF: {all:?}"
        );
    }

    let dd = format!("dd if=/dev/zero of=/dev/null bs=1 count={BYTES} 2>/dev/null");
    let mut job =
        String::from("T=/sys/kernel/tracing\necho 8192 > $T/buffer_size_kb\necho > $T/trace\n");
    for (n, i) in all.iter().enumerate() {
        job += &format!(
            "echo 'p:exotap/in{n} {}' >> $T/kprobe_events || exotap_result kprobe.failed.in{n} 1\n\
             [ -d $T/events/exotap/in{n} ] && echo 'comm == \"dd\"' > $T/events/exotap/in{n}/filter\n",
            i.site
        );
    }
    job += &format!(
        "echo 1 > $T/events/exotap/enable\n\
         {dd}\n\
         echo 0 > $T/events/exotap/enable\n\
         awk '$1 ~ /in[0-9]+$/ {{sub(/.*\\//, \"\", $1); print $1 \"=\" $3}}' $T/kprobe_profile |\n\
           while read kv; do exotap_result \"kmiss.${{kv%%=*}}\" \"${{kv#*=}}\"; done\n\
         awk '{{for (i = 1; i <= NF; i++) if ($i ~ /^in[0-9]+:$/) c[$i]++}}\n\
              END {{for (k in c) printf \"kprobe.%s=%d\\n\", substr(k, 1, length(k) - 1), c[k]}}' $T/trace |\n\
           while read kv; do exotap_result \"${{kv%%=*}}\" \"${{kv#*=}}\"; done\n\
         echo > $T/kprobe_events\n\
         exotap_wait attach\n\
         {dd}\n\
         exotap_wait detach\n"
    );
    let points: Vec<String> = FUNCTIONS
        .iter()
        .map(|f| format!("kernel.function(\"{f}\").inline"))
        .collect();
    // symdata (in the end probe, on the host): "caller+0xOFF/0xSIZE", the place by its
    // caller as the kprobe names it.
    let script = format!(
        "global hits\n\
         probe {} {{ if (execname() == \"dd\") hits[pp(), addr()]++ }}\n\
         probe end {{ foreach ([p, a] in hits) printf(\"inline %s %s=%d\\n\", p, symdata(a), hits[p, a]) }}\n",
        points.join(", ")
    );
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();
    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            "600",
            "--compile",
            mode,
            "--script-text",
        ])
        .arg(&script)
        .args(["--attach-in-job", "--job"])
        .arg(&job_file)
        .arg("--console")
        .arg(&console));
    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    for bad in [
        "Oops",
        "BUG:",
        "WARNING:",
        "general protection",
        "invalid opcode",
    ] {
        assert!(
            !transcript.contains(bad),
            "{bad} in the console:\n{transcript}"
        );
    }
    if mode == "never" {
        assert!(
            err.contains(&format!("armed {} probe sites", total_instances()))
                && err.contains("refused 0"),
            "every inlined instance is armed: {ctx}"
        );
    } else {
        assert!(!err.contains("not instrumented"), "{ctx}");
    }

    // exotap's counts by (function, caller+offset).
    let mut counted: BTreeMap<(String, String), u64> = BTreeMap::new();
    for line in out.lines().filter_map(|l| l.strip_prefix("inline ")) {
        let (point, rest) = line.split_once(' ').unwrap();
        let (place, n) = rest.rsplit_once('=').unwrap();
        let function = point
            .strip_prefix("kernel.function(\"")
            .and_then(|p| p.split(['@', '"']).next())
            .unwrap()
            .to_owned();
        let (caller, offset) = place.split('/').next().unwrap().split_once("+0x").unwrap();
        let offset = u64::from_str_radix(offset, 16).unwrap();
        *counted
            .entry((function, format!("{caller}+{offset}")))
            .or_default() += n.parse::<u64>().unwrap();
    }
    let mut compared = 0;
    let mut hit = 0;
    let mut wrong = Vec::new();
    for (n, i) in all.iter().enumerate() {
        if result(&out, &format!("kprobe.failed.in{n}")).is_some() {
            eprintln!(
                "the guest could not kprobe {} ({}): not compared",
                i.site, i.function
            );
            continue;
        }
        let expected: u64 = result(&out, &format!("kprobe.in{n}"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let missed: u64 = result(&out, &format!("kmiss.in{n}"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        assert_eq!(
            missed, 0,
            "the guest's kprobe at {} missed hits: {ctx}",
            i.site
        );
        let got = counted
            .remove(&(i.function.clone(), i.site.clone()))
            .unwrap_or(0);
        compared += 1;
        hit += u64::from(got > 0);
        if got != expected {
            wrong.push(format!(
                "{} inlined at {}: exotap counted {got}, the guest's kprobe {expected}",
                i.function, i.site
            ));
        }
    }
    eprintln!(
        "{mode}: {compared} inlined instances of {FUNCTIONS:?} compared with the guest's \
         kprobes there, {hit} of them hit by the workload"
    );
    assert!(wrong.is_empty(), "{}\n{ctx}", wrong.join("\n"));
    // Every read and write of dd went through its own inlined copies.
    assert!(hit >= 4, "only {hit} instances were hit: {ctx}");
    // Nothing outside the instances asked for (or beyond MAX_SITES) was counted.
    assert!(
        counted.values().all(|n| *n == 0) || all.len() == MAX_SITES,
        "counted outside the compared instances: {counted:?}\n{ctx}"
    );
}

/// How many inlined instances the three functions have in all (the points exotap arms).
fn total_instances() -> usize {
    FUNCTIONS.iter().map(|f| instances(f).len()).sum()
}

#[test]
fn inlined_instances_count_as_the_guests_kprobes_host_evaluated() {
    inline_counts_equal_the_guests_kprobes("never");
}

#[test]
fn inlined_instances_count_as_the_guests_kprobes_compiled() {
    inline_counts_equal_the_guests_kprobes("require");
}
