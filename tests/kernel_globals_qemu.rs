//! End-to-end: kernel globals (`@var("name")`, `@var("name@file.c")`), `jiffies()`,
//! `task_utime()`/`task_stime()` and `$$locals`/`$$vars` in the live Debian guest, compiled
//! and host-evaluated. Oracles: what the guest says of itself at the same moment —
//! `/proc/timer_list`'s `jiffies:` read just before and just after the probed call,
//! `/proc/loadavg`'s thread total (the kernel's `nr_threads`), `/proc/self/stat`'s CPU times,
//! the file size `stat` gives, and the kernel's own fixed facts (`init_task` is pid 0,
//! `swapper/0`).

#![allow(clippy::unwrap_used, clippy::panic)] // test helpers outside #[test] fns

mod common;

use common::{boot, have_qemu, result};

/// The cached Debian kernel's directory when its -dbg vmlinux is cached too (the types of
/// `init_task` and `nr_threads` come from DWARF: 6.1's BTF types per-CPU variables only).
fn debug_kernel() -> Option<std::path::PathBuf> {
    let dir = exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)?;
    dir.join("debug/vmlinux").is_file().then_some(dir)
}

/// `key=value` fields of the first script output line starting with `tag`.
fn fields(out: &str, tag: &str) -> Vec<(String, String)> {
    let line = out
        .lines()
        .find(|l| l.starts_with(tag))
        .unwrap_or_else(|| panic!("no {tag} line in:\n{out}"));
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn field(fields: &[(String, String)], key: &str) -> String {
    fields
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key} in {fields:?}"))
}

fn number(fields: &[(String, String)], key: &str) -> i64 {
    field(fields, key).parse().unwrap()
}

/// `dd`'s 64-byte read (the guest's init reads with `dd bs=1` too) reads the globals, and
/// the job shell's read of its own `/proc/self/stat` (`proc_tgid_stat` runs in the reader)
/// its CPU times after a busy loop.
const GLOBALS: &str = r#"
probe kernel.function("vfs_read") {
  if (execname() == "dd" && $count == 64)
    printf("G pid=%d comm=%s nr=%d nrf=%d j=%d jf=%d\n", @var("init_task")->pid,
           kernel_string(@var("init_task")->comm), @var("nr_threads"),
           @var("nr_threads@kernel/fork.c"), @var("jiffies"), jiffies())
}
probe kernel.function("proc_tgid_stat") {
  if (execname() == "init") printf("T ut=%d st=%d\n", task_utime(), task_stime())
}"#;

const GUEST: &str = r#"exotap_result j0 $(grep -m1 "^jiffies" /proc/timer_list | cut -d" " -f2); exotap_result load "$(cat /proc/loadavg)"; dd if=/init of=/dev/null bs=64 count=1 2>/dev/null; exotap_result j1 $(grep -m1 "^jiffies" /proc/timer_list | cut -d" " -f2); i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; read -r l < /proc/self/stat; set -- $l; exotap_result times "${14} ${15}""#;

#[test]
fn kernel_globals_jiffies_and_task_times_agree_with_the_guest_compiled_and_host_evaluated() {
    if !have_qemu(
        "kernel_globals_jiffies_and_task_times_agree_with_the_guest_compiled_and_host_evaluated",
    ) {
        return;
    }
    if debug_kernel().is_none() {
        eprintln!(
            "SKIP: needs the cached Debian kernel's -dbg vmlinux (exotap image fetch --debuginfo)"
        );
        return;
    }
    for mode in ["require", "never"] {
        let (code, out, err, console) = boot(GLOBALS, mode, GUEST);
        let ctx = format!("mode {mode}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 0, "{ctx}");
        let g = fields(&out, "G ");
        assert_eq!(number(&g, "pid"), 0, "{ctx}");
        assert_eq!(field(&g, "comm"), "swapper/0", "{ctx}");
        // /proc/loadavg's fourth field is running/nr_threads, read just before dd started;
        // dd and the shell's command substitutions come and go around it.
        let load = result(&console, "load").unwrap_or_else(|| panic!("no load: {ctx}"));
        let threads: i64 = load
            .split_whitespace()
            .nth(3)
            .and_then(|f| f.split_once('/'))
            .map(|(_, total)| total.parse().unwrap())
            .unwrap();
        assert!(
            (number(&g, "nr") - threads).abs() <= 2,
            "nr_threads {} vs /proc/loadavg {threads}: {ctx}",
            number(&g, "nr")
        );
        assert_eq!(number(&g, "nr"), number(&g, "nrf"), "{ctx}");
        // jiffies between the guest's own reads before and after dd; jiffies() is the same
        // counter (jiffies_64) read a moment later in the same hit.
        let j0: i64 = result(&console, "j0").unwrap().parse().unwrap();
        let j1: i64 = result(&console, "j1").unwrap().parse().unwrap();
        let (j, jf) = (number(&g, "j"), number(&g, "jf"));
        assert!(j0 <= j && j <= j1, "{j0} <= {j} <= {j1}: {ctx}");
        assert!(j <= jf && jf <= j1, "{j} <= {jf} <= {j1}: {ctx}");
        // task_struct's utime/stime are nanoseconds of tick-sampled time; /proc/self/stat
        // gives them in USER_HZ (100) ticks after the kernel scaled both to the task's exact
        // runtime (cputime_adjust), keeping their ratio. Under TCG ticks get lost, so the
        // sampled total is below the exact one, but not by 5x, and the split is the same.
        let t = fields(&out, "T ");
        let times = result(&console, "times").unwrap();
        let mut ticks = times.split_whitespace().map(|v| v.parse::<i64>().unwrap());
        let (utime, stime) = (ticks.next().unwrap(), ticks.next().unwrap());
        let (ut, st) = (number(&t, "ut"), number(&t, "st"));
        let (sampled, exact) = (ut + st, (utime + stime) * 10_000_000);
        assert!(
            exact / 5 <= sampled && sampled <= exact * 3 / 2 + 30_000_000,
            "task_struct {ut}+{st} ns vs /proc/self/stat {utime}+{stime} ticks: {ctx}"
        );
        let split = |s: i64, total: i64| s as f64 / total as f64;
        assert!(
            (split(st, sampled) - split(stime * 10_000_000, exact)).abs() <= 0.05,
            "system share: task_struct {ut}+{st} ns vs /proc/self/stat {utime}+{stime}: {ctx}"
        );
        assert!(
            utime >= 10,
            "the busy loop ran {utime} ticks in user mode: {ctx}"
        );
    }
}

/// `vfs_read+0xf1` of the cached Debian 6.1 cloud kernel (inside the inlined
/// `fsnotify_file`, after a read that returned > 0), when this is that build.
fn vfs_read_build(dir: &std::path::Path) -> bool {
    let path = dir.join("vmlinuz");
    if !path.exists() {
        return false;
    }
    // Cached but broken: a failure, not a skip.
    let image = exotap_probes::live::kernel_image::KernelImage::load(path.clone())
        .unwrap_or_else(|e| panic!("the cached kernel {} does not load: {e:#}", path.display()));
    let start = image.address("vfs_read").unwrap();
    image.vmlinux.read_at(start + 0xf1, 7).ok()
        == Some(&[0xf7, 0x45, 0x44, 0x00, 0x40, 0x00, 0x04][..])
}

#[test]
fn dollar_locals_and_vars_list_the_scope_with_the_values_the_workload_determines() {
    if !have_qemu("dollar_locals_and_vars_list_the_scope_with_the_values_the_workload_determines") {
        return;
    }
    if !debug_kernel().is_some_and(|d| vfs_read_build(&d)) {
        eprintln!(
            "SKIP: needs the cached Debian kernel these vfs_read offsets are for and its -dbg \
             vmlinux (exotap image fetch --debuginfo)"
        );
        return;
    }
    // Oracles: busybox head reads /init whole in one read, so `ret` is its size as the
    // guest's `stat` says; `mask` (fsnotify_file's parameter) is FS_ACCESS (1) for a read;
    // `path` is `&file->f_path`, 16 bytes into `struct file` (include/linux/fs.h, 6.1);
    // `count` lives in a DWARF expression exotap does not read, so it is `?`.
    let script = r#"probe kernel.statement("vfs_read+0xf1") {
      if (execname() == "head") { println("L ", $$locals); println("V ", $$vars); exit() }
    }"#;
    let (code, out, err, console) = boot(
        script,
        "auto",
        "head -c 64 /init > /dev/null; exotap_result size $(stat -c %s /init)",
    );
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let size: u64 = result(&console, "size").unwrap().parse().unwrap();
    let hex = |v: &str| u64::from_str_radix(v.trim_start_matches("0x"), 16).unwrap();
    let locals = fields(&out, "L ");
    let names: Vec<&str> = locals.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["path", "ret"], "{ctx}");
    assert_eq!(hex(&field(&locals, "ret")), size, "{ctx}");
    let vars = fields(&out, "V ");
    let names: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        ["mask", "file", "buf", "count", "pos", "path", "ret"],
        "{ctx}"
    );
    assert_eq!(field(&vars, "mask"), "0x1", "{ctx}");
    assert_eq!(field(&vars, "count"), "?", "{ctx}");
    assert_eq!(
        hex(&field(&vars, "path")),
        hex(&field(&vars, "file")) + 16,
        "{ctx}"
    );
    assert_eq!(field(&vars, "ret"), field(&locals, "ret"), "{ctx}");
}
