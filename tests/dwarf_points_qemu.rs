//! End-to-end: probe points that DWARF places (issue 39) probe every place they name, and
//! nothing else.
//! - `kernel.function("F").inline`: every place the compiler inlined F (each
//!   `DW_TAG_inlined_subroutine`'s entry pc, `exotap lines --inlined`);
//! - `kernel.function("F")`: F's out-of-line entry and each of those places, as SystemTap;
//! - `kernel.field("struct file", "f_pos").read|.write`: every instruction that reads or writes
//!   the member (KLAS's join points, `exotap joinpoints`).
//!
//! The oracle is the guest's own kprobes at those same places (`caller+offset`), each
//! filtered on the workload's comm: one guest run, in which the job first counts a
//! deterministic workload (`dd` moving single bytes: one `ksys_read` and one `ksys_write` per
//! byte, each with its inlined `fdget_pos`, `file_ppos` and `fdput_pos` and its read and write
//! of `f_pos`) with its kprobes, removes them, and then lets exotap attach and runs the same
//! workload again under the probes. Every place must count what the guest counted there;
//! host-evaluated and compiled. The places are listed by exotap's own `lines --inlined` and
//! `joinpoints` (the join-point finder and the DWARF index); the counts are the guest's.
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
/// The most places the guest is asked to kprobe in one run.
const MAX_SITES: usize = 80;

/// One place a point names: what it is (for messages) and where, as `caller+offset`
/// (decimal offset, as kprobe_events takes it).
#[derive(Debug, Clone)]
struct Place {
    what: String,
    site: String,
}

/// The places between `<` and `>` at the end of the lines of `exotap ARGS` that `keep`
/// selects: `... 0xffffffff8134a615 <ksys_write+37>`.
fn places(args: &[&str], keep: impl Fn(&str) -> bool, what: &str) -> Vec<Place> {
    let (code, out, err) = run(exotap().args(args));
    assert_eq!(code, 0, "exotap {args:?}: {err}");
    out.lines()
        .filter(|l| keep(l))
        .filter_map(|l| {
            let site = l.split('<').nth(1)?.split('>').next()?;
            Some(Place {
                what: what.to_owned(),
                site: site.to_owned(),
            })
        })
        .collect()
}

/// The inlined instances of `function` (`exotap lines --inlined`).
fn inlined(function: &str) -> Vec<Place> {
    let prefix = format!("{function} inlined at ");
    places(
        &["lines", "--inlined", "--brief", function],
        |l| l.starts_with(&prefix),
        function,
    )
}

/// The instructions that access `struct file`'s `f_pos` as `access` (`read` or `write`; a
/// read-write counts as both), from `exotap joinpoints`: lines such as
/// `0xffffffff8134a537 <ksys_read+119> fs/read_write.c:615 write file.f_pos`.
fn f_pos_accesses(access: &str) -> Vec<Place> {
    places(
        &["joinpoints", "struct file.f_pos"],
        |l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.len() == 5 && (words[3] == access || words[3] == "read-write")
        },
        &format!("f_pos {access}"),
    )
}

/// Runs `points` (exotap's probe points) against the guest's kprobes at `all` (see the
/// module doc) with `--compile mode`; every place must count what the guest's kprobe there
/// counted, and at least `hit` places must be reached by the workload.
fn count_like_the_guests_kprobes(mode: &str, points: &[String], mut all: Vec<Place>, hit: usize) {
    let test = format!("{points:?} ({mode})");
    if !have_qemu(&test) {
        return;
    }
    let expected_points = all.len();
    // The places the workload reaches come first (ksys_read, ksys_write); the rest count 0
    // in both runs, which checks that nothing else is probed there.
    all.sort_by_key(|p| !(p.site.starts_with("ksys_read+") || p.site.starts_with("ksys_write+")));
    all.truncate(MAX_SITES);

    let dd = format!("dd if=/dev/zero of=/dev/null bs=1 count={BYTES} 2>/dev/null");
    let mut job =
        String::from("T=/sys/kernel/tracing\necho 8192 > $T/buffer_size_kb\necho > $T/trace\n");
    for (n, p) in all.iter().enumerate() {
        job += &format!(
            "echo 'p:exotap/in{n} {}' >> $T/kprobe_events || exotap_result kprobe.failed.in{n} 1\n\
             [ -d $T/events/exotap/in{n} ] && echo 'comm == \"dd\"' > $T/events/exotap/in{n}/filter\n",
            p.site
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
    // symdata (in the end probe, on the host): "caller+0xOFF/0xSIZE [kernel]", the place by
    // its caller as the kprobe names it.
    let script = format!(
        "global hits\n\
         probe {} {{ if (execname() == \"dd\") hits[addr()]++ }}\n\
         probe end {{ foreach (a in hits) printf(\"place %s=%d\\n\", symdata(a), hits[a]) }}\n",
        points.join(", ")
    );
    let (code, out, err, transcript) =
        common::boot_attached_in_job(&script, mode, &job, "600", &[]);
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    common::assert_console_clean(&transcript);
    if mode == "never" {
        assert!(
            err.contains(&format!("armed {expected_points} probe sites"))
                && err.contains("refused 0"),
            "every place is armed: {ctx}"
        );
    } else {
        assert!(!err.contains("not instrumented"), "{ctx}");
    }

    // exotap's counts by caller+offset.
    let mut counted: BTreeMap<String, u64> = BTreeMap::new();
    for line in out.lines().filter_map(|l| l.strip_prefix("place ")) {
        let (place, n) = line.rsplit_once('=').unwrap();
        let (caller, offset) = place.split('/').next().unwrap().split_once("+0x").unwrap();
        let offset = u64::from_str_radix(offset, 16).unwrap();
        *counted.entry(format!("{caller}+{offset}")).or_default() += n.parse::<u64>().unwrap();
    }
    let mut compared = 0;
    let mut reached = 0;
    let mut wrong = Vec::new();
    for (n, p) in all.iter().enumerate() {
        if result(&out, &format!("kprobe.failed.in{n}")).is_some() {
            eprintln!(
                "the guest could not kprobe {} ({}): not compared",
                p.site, p.what
            );
            counted.remove(&p.site);
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
            p.site
        );
        let got = counted.remove(&p.site).unwrap_or(0);
        compared += 1;
        reached += usize::from(got > 0);
        if got != expected {
            wrong.push(format!(
                "{} at {}: exotap counted {got}, the guest's kprobe {expected}",
                p.what, p.site
            ));
        }
    }
    eprintln!(
        "{mode}: {compared} places of {points:?} compared with the guest's kprobes there, \
         {reached} of them reached by the workload"
    );
    assert!(wrong.is_empty(), "{}\n{ctx}", wrong.join("\n"));
    assert!(reached >= hit, "only {reached} places were reached: {ctx}");
    // Nothing was counted outside the places compared (unless some were left out).
    assert!(
        counted.is_empty() || expected_points > MAX_SITES,
        "counted outside the compared places: {counted:?}\n{ctx}"
    );
}

fn inline_points(mode: &str) {
    let all: Vec<Place> = FUNCTIONS.iter().flat_map(|f| inlined(f)).collect();
    for f in FUNCTIONS {
        assert!(
            all.iter().filter(|p| p.what == *f).count() >= 2,
            "{f}: fewer than two inlined instances in the DWARF: {all:?}"
        );
    }
    let points: Vec<String> = FUNCTIONS
        .iter()
        .map(|f| format!("kernel.function(\"{f}\").inline"))
        .collect();
    // Each of dd's reads and writes runs its own copies of the three.
    count_like_the_guests_kprobes(mode, &points, all, 4);
}

/// Functions with an out-of-line copy and inlined instances both: each of `dd`'s reads and
/// writes calls `rw_verify_area` out of line (it is inlined once more, in `kernel_read`) and
/// `__fdget` inlined in `__fdget_pos` (its out-of-line copy serves other callers).
const WITH_ENTRY: &[&str] = &["rw_verify_area", "__fdget"];

/// `kernel.function("F")` = F's entry and every inlined instance, each place counted as the
/// guest's kprobe there counts it.
fn entry_and_inline_points(mode: &str) {
    let mut all = Vec::new();
    for f in WITH_ENTRY {
        // An "instance" inside F's own code is DWARF's picture of F's out-of-line body
        // (`fput+21` in `fput`): not a place of its own (every call passes both).
        let copies: Vec<Place> = inlined(f)
            .into_iter()
            .filter(|p| !p.site.starts_with(&format!("{f}+")))
            .collect();
        assert!(!copies.is_empty(), "{f}: no inlined instance in the DWARF");
        all.push(Place {
            what: format!("{f} entry"),
            site: format!("{f}+0"),
        });
        all.extend(copies);
    }
    let points: Vec<String> = WITH_ENTRY
        .iter()
        .map(|f| format!("kernel.function(\"{f}\")"))
        .collect();
    // rw_verify_area's entry and __fdget's instance in __fdget_pos at each read and write.
    count_like_the_guests_kprobes(mode, &points, all, 2);
}

fn f_pos_points(mode: &str, access: &str) {
    let all = f_pos_accesses(access);
    assert!(all.len() >= 5, "few f_pos {access}s: {all:?}");
    let point = format!("kernel.field(\"struct file\", \"f_pos\").{access}");
    // ksys_read and ksys_write each read and write f_pos once per call.
    count_like_the_guests_kprobes(mode, &[point], all, 2);
}

#[test]
fn inlined_instances_count_as_the_guests_kprobes_host_evaluated() {
    inline_points("never");
}

#[test]
fn a_function_is_its_entry_and_its_inlined_instances_compiled() {
    entry_and_inline_points("require");
}

#[test]
fn a_function_is_its_entry_and_its_inlined_instances_host_evaluated() {
    entry_and_inline_points("never");
}

#[test]
fn inlined_instances_count_as_the_guests_kprobes_compiled() {
    inline_points("require");
}

#[test]
fn member_writes_count_as_the_guests_kprobes_host_evaluated() {
    f_pos_points("never", "write");
}

#[test]
fn member_writes_count_as_the_guests_kprobes_compiled() {
    f_pos_points("require", "write");
}

#[test]
fn member_reads_count_as_the_guests_kprobes_compiled() {
    f_pos_points("require", "read");
}
