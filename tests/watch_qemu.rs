//! End-to-end: `kernel.data` probes (hardware watchpoints through QEMU's gdbstub) run on every
//! access of the data they watch, in the context of the task that made it, and on nothing else.
//!
//! The oracle is the guest job itself: after exotap attaches it writes
//! `/proc/sys/vm/dirty_background_ratio` (the kernel variable `dirty_background_ratio`, which
//! only that sysctl writes) exactly WRITES times from its shell and reads `/proc/sys/vm/dirty_ratio`
//! (`vm_dirty_ratio`) READS times with `cat`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

mod common;

use common::{have_qemu, result};

const WRITES: u64 = 12;
const READS: u64 = 7;

#[test]
fn kernel_data_probes_see_every_write_and_read_of_the_watched_variable() {
    if !have_qemu("kernel_data_probes_see_every_write_and_read_of_the_watched_variable") {
        return;
    }
    let job = format!(
        "old=$(cat /proc/sys/vm/dirty_background_ratio)\n\
         exotap_wait attach\n\
         i=0\n\
         while [ $i -lt {WRITES} ]; do echo $((5 + i % 3)) > /proc/sys/vm/dirty_background_ratio; i=$((i + 1)); done\n\
         i=0\n\
         while [ $i -lt {READS} ]; do cat /proc/sys/vm/dirty_ratio > /dev/null; i=$((i + 1)); done\n\
         exotap_wait detach\n\
         echo $old > /proc/sys/vm/dirty_background_ratio\n\
         exotap_result writes {WRITES}\n"
    );
    let script = "global writes, writers, cat_reads, first\n\
         probe kernel.data(\"dirty_background_ratio\").write {\n\
           writes++; writers[execname()]++\n\
           if (!first++) { printf(\"first write at %s\\n\", pp()); print_backtrace() }\n\
         }\n\
         probe kernel.data(\"vm_dirty_ratio\").length(4).rw { if (execname() == \"cat\") cat_reads++ }\n\
         probe end {\n\
           printf(\"writes=%d cat_reads=%d\\n\", writes, cat_reads)\n\
           foreach (c in writers) printf(\"writer %s=%d\\n\", c, writers[c])\n\
         }\n";
    let (code, out, err, transcript) =
        common::boot_attached_in_job(script, "auto", &job, "600", &[]);
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    assert_eq!(result(&out, "writes"), Some("12"), "{ctx}");
    common::assert_console_clean(&transcript);
    assert!(err.contains("2 watchpoints on kernel data"), "{ctx}");

    // Every write, by the job's shell and nothing else; at least one read per `cat` (the
    // sysctl handler reads the value it formats).
    let line = out
        .lines()
        .find(|l| l.starts_with("writes="))
        .unwrap_or_else(|| panic!("no counts: {ctx}"));
    let count = |key: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {line}"))
    };
    assert_eq!(count("writes="), WRITES, "{ctx}");
    assert!(count("cat_reads=") >= READS, "{ctx}");
    // One writer: the job's shell (the guest's init runs the job).
    let writers: Vec<&str> = out.lines().filter(|l| l.starts_with("writer ")).collect();
    assert_eq!(writers.len(), 1, "{ctx}");
    assert!(writers[0].ends_with(&format!("={WRITES}")), "{ctx}");
    // The first write's stack: the sysctl's handler, called from the write system call.
    let stack = out
        .split("first write at kernel.data(\"dirty_background_ratio\").write")
        .nth(1)
        .unwrap_or_else(|| panic!("no first write: {ctx}"));
    assert!(
        stack.contains("dirty_background_ratio_handler") || stack.contains("proc_dointvec_minmax"),
        "{ctx}"
    );
    assert!(
        stack.contains("vfs_write") || stack.contains("ksys_write"),
        "{ctx}"
    );
}
