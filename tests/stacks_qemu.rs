//! End-to-end: kernel stacks unwound from outside a live Debian guest under QEMU TCG
//! (`exotap backtrace`, `exotap profile`), with the guest's own `/proc/PID/stack` as the
//! oracle for sleeping tasks.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{exotap, have_qemu, run};

/// The end of a job: every task started after `$start` printed by the guest's own
/// `/proc/PID/stack` between `PROC-STACK-BEGIN PID COMM` and `PROC-STACK-END PID`, then the
/// host's stop.
macro_rules! print_proc_stacks {
    () => {
        r#"for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" -gt "$start" ] || continue
  read -r comm < $d/comm 2>/dev/null || continue
  st=$(cat /proc/$p/stack 2>/dev/null) || continue
  echo "PROC-STACK-BEGIN $p $comm"
  echo "$st"
  echo "PROC-STACK-END $p"
done
exotap_wait backtrace
"#
    };
}

/// Guest job: tasks blocked in four different ways, each printed by the guest's own
/// `/proc/PID/stack`, then the host's stop. The tasks stay blocked (nothing ever writes
/// their pipes or opens the other end of their fifos; they sleep 1000 s), so the stacks
/// the guest printed are the stacks at the stop.
const BLOCKED_JOB: &str = concat!(
    r#"start=$(sh -c 'echo $$')
for i in 1 2 3 4 5 6; do sleep 1000 & done
for i in 1 2 3 4 5 6; do sh -c 'sleep 1000; :' & done
for i in 1 2 3 4 5 6; do mkfifo /tmp/f$i; cat /tmp/f$i > /dev/null & done
for i in 1 2 3 4 5 6; do sleep 1000 | cat > /dev/null & done
sleep 2
"#,
    print_proc_stacks!()
);

/// `/proc/PID/stack` blocks from the console: pid → (comm, frames without the `[<0>] `).
fn guest_stacks(console: &str) -> BTreeMap<i32, (String, Vec<String>)> {
    let mut stacks = BTreeMap::new();
    let mut current: Option<(i32, String, Vec<String>)> = None;
    for line in console.lines() {
        if let Some(rest) = line.strip_prefix("PROC-STACK-BEGIN ") {
            let (pid, comm) = rest.split_once(' ').unwrap();
            current = Some((pid.parse().unwrap(), comm.to_owned(), Vec::new()));
        } else if line.starts_with("PROC-STACK-END") {
            let (pid, comm, frames) = current.take().unwrap();
            stacks.insert(pid, (comm, frames));
        } else if let Some((_, _, frames)) = current.as_mut() {
            frames.push(line.trim_start_matches("[<0>] ").to_owned());
        }
    }
    stacks
}

/// `exotap backtrace` output: task pid → frames (`func+0xoff/0xsize`) and the end line.
fn host_stacks(out: &str) -> BTreeMap<i32, (Vec<String>, String)> {
    let mut stacks = BTreeMap::new();
    let mut current: Option<i32> = None;
    for line in out.lines() {
        if let Some(rest) = line.strip_prefix("task ") {
            let pid: i32 = rest.split(' ').next().unwrap().parse().unwrap();
            stacks.insert(pid, (Vec::new(), String::new()));
            current = Some(pid);
        } else if line.starts_with("vcpu") {
            current = None;
        } else if let (Some(pid), Some(frame)) = (current, line.strip_prefix("  [<")) {
            let entry = stacks.get_mut(&pid).unwrap();
            entry.0.push(frame.split_once("] ").unwrap().1.to_owned());
        } else if let (Some(pid), Some(end)) = (current, line.strip_prefix("  -- ")) {
            stacks.get_mut(&pid).unwrap().1 = end.to_owned();
        }
    }
    stacks
}

#[test]
fn sleeping_task_stacks_equal_the_guests_own_proc_pid_stack() {
    if !have_qemu("sleeping_task_stacks_equal_the_guests_own_proc_pid_stack") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.sh");
    std::fs::write(&job, BLOCKED_JOB).unwrap();

    let (out, transcript, ctx) = proc_style_backtrace(dir.path(), "--job", &job);

    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    let guest = guest_stacks(&transcript);
    let host = host_stacks(&out);
    let mut compared = 0;
    let mut leaves = BTreeSet::new();
    for (pid, (comm, frames)) in &guest {
        let (ours, end) = host
            .get(pid)
            .unwrap_or_else(|| panic!("exotap did not list task {pid} ({comm}): {ctx}"));
        assert_eq!(ours, frames, "task {pid} ({comm}): {ctx}");
        // Every one of these tasks sleeps in a system call: the unwind ends at user mode.
        assert!(end.starts_with("user mode at "), "task {pid}: {end}");
        assert!(frames.len() >= 4, "task {pid} ({comm}) shallow: {frames:?}");
        leaves.insert(frames[0].split('+').next().unwrap().to_owned());
        compared += 1;
    }
    // 6 sleeps, 6 shells in wait4 with their 6 sleeps, 6 cats opening fifos, 6 cats reading
    // pipes with their 6 sleeps.
    assert!(compared >= 20, "only {compared} tasks compared: {ctx}");
    for leaf in [
        "hrtimer_nanosleep",
        "do_wait",
        "wait_for_partner",
        "pipe_read",
    ] {
        assert!(
            leaves.contains(leaf),
            "no task blocked in {leaf}: {leaves:?}"
        );
    }
    // The stopped vCPUs were unwound from their registers to the end of their stacks.
    let vcpus: Vec<&str> = out.lines().filter(|l| l.starts_with("vcpu")).collect();
    assert_eq!(vcpus.len(), 2, "{ctx}");
    eprintln!("{compared} tasks equal to /proc/PID/stack; leaves {leaves:?}");
}

/// `exotap boot --compile never --script SCRIPT` over `guest` (`--job FILE` or `--initrd
/// FILE`), which must end with 0: its standard output, the guest's console and both (with
/// standard error) for failure messages.
fn boot_host_evaluated(
    dir: &std::path::Path,
    script: &str,
    guest: &str,
    file: &std::path::Path,
    timeout: u32,
) -> (String, String, String) {
    let script_file = dir.join("script.stp");
    std::fs::write(&script_file, script).unwrap();
    let timeout = timeout.to_string();
    run_guest(
        dir,
        &[
            "boot".as_ref(),
            "--timeout".as_ref(),
            timeout.as_ref(),
            "--compile".as_ref(),
            "never".as_ref(),
            "--script".as_ref(),
            script_file.as_os_str(),
            guest.as_ref(),
            file.as_os_str(),
        ],
    )
}

/// `exotap ARGS --console FILE`, which must end with 0: its standard output, the guest's
/// console and both (with standard error) for failure messages.
fn run_guest(dir: &std::path::Path, args: &[&std::ffi::OsStr]) -> (String, String, String) {
    let console = dir.join("console.log");
    let (code, out, err) = run(exotap().args(args).arg("--console").arg(&console));
    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nconsole:\n{transcript}");
    assert_eq!(code, 0, "{ctx}");
    (out, transcript, ctx)
}

/// `exotap backtrace --proc-style` over `guest` (`--job FILE` or `--initrd FILE`), as
/// [`run_guest`].
fn proc_style_backtrace(
    dir: &std::path::Path,
    guest: &str,
    file: &std::path::Path,
) -> (String, String, String) {
    run_guest(
        dir,
        &[
            "backtrace".as_ref(),
            "--proc-style".as_ref(),
            "--timeout".as_ref(),
            "300".as_ref(),
            guest.as_ref(),
            file.as_os_str(),
        ],
    )
}

/// Guest job for module text: evdev loaded from the initramfs, readers of every input
/// event device (they sleep in `evdev_read`, module code, and nothing ever types), printed by
/// `/proc/PID/stack` as in [`BLOCKED_JOB`], then the host's stop.
const MODULE_JOB: &str = concat!(
    r#"start=$(sh -c 'echo $$')
insmod /modules/evdev.ko
for e in /dev/input/event*; do for i in 1 2 3; do cat $e > /dev/null & done; done
sleep 2
"#,
    print_proc_stacks!()
);

/// The initramfs of `job` (e.g. [`MODULE_JOB`]), with the default kernel's evdev.ko in
/// `/modules`.
fn module_initramfs(dir: &std::path::Path, job: &str) -> std::path::PathBuf {
    common::initramfs_with_evdev(dir, exotap_guest_images::DEFAULT_KERNEL, job)
}

#[test]
fn stacks_through_module_text_equal_the_guests_own_proc_pid_stack() {
    if !have_qemu("stacks_through_module_text_equal_the_guests_own_proc_pid_stack") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = module_initramfs(dir.path(), MODULE_JOB);

    let (out, transcript, ctx) = proc_style_backtrace(dir.path(), "--initrd", &initrd);

    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    let guest = guest_stacks(&transcript);
    let host = host_stacks(&out);
    let mut in_module = 0;
    for (pid, (comm, frames)) in &guest {
        let (ours, end) = host
            .get(pid)
            .unwrap_or_else(|| panic!("exotap did not list task {pid} ({comm}): {ctx}"));
        assert_eq!(ours, frames, "task {pid} ({comm}): {ctx}");
        if frames.iter().any(|f| f.ends_with(" [evdev]")) {
            // Through the module's frames to the system call's entry and user mode.
            assert!(end.starts_with("user mode at "), "task {pid}: {end}");
            in_module += 1;
        }
    }
    // Three readers of each input device QEMU's PC gives the guest (at least the keyboard).
    assert!(in_module >= 3, "only {in_module} tasks in evdev: {ctx}");
    eprintln!("{in_module} tasks through evdev equal to /proc/PID/stack");
}

/// A script's view of tasks sleeping in module code: `task_backtrace()` at the guest's own
/// `proc_pid_stack`, printed there and kept for `end` (the module was loaded after the
/// script's probes were armed, so exotap learns of it at a stop).
const MODULE_SCRIPT: &str = r#"global kept
probe kernel.function("proc_pid_stack") {
  if ($task == task_current()) next
  p = @cast($task, "task_struct")->pid
  printf("TASK-STACK-BEGIN %d\n", p)
  print_stack(task_backtrace($task))
  printf("TASK-STACK-END\n")
  kept[p] = task_backtrace($task)
}
probe end {
  foreach (p in kept) {
    printf("END-STACK-BEGIN %d\n", p)
    print_stack(kept[p])
    printf("END-STACK-END\n")
  }
}
"#;

#[test]
fn scripts_name_module_frames_as_the_guest_does_at_hits_and_in_end() {
    if !have_qemu("scripts_name_module_frames_as_the_guest_does_at_hits_and_in_end") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = module_initramfs(
        dir.path(),
        &MODULE_JOB.replace("exotap_wait backtrace\n", ""),
    );
    let (out, transcript, ctx) =
        boot_host_evaluated(dir.path(), MODULE_SCRIPT, "--initrd", &initrd, 300);
    let guest = guest_stacks(&transcript);
    let at_hits = script_blocks(&out, "TASK-STACK-BEGIN ", "TASK-STACK-END");
    let in_end = script_blocks(&out, "END-STACK-BEGIN ", "END-STACK-END");
    let mut in_module = 0;
    for (pid, (comm, frames)) in &guest {
        if !frames.iter().any(|f| f.ends_with(" [evdev]")) {
            continue;
        }
        for (when, blocks) in [("at the hit", &at_hits), ("in end", &in_end)] {
            let ours = blocks
                .iter()
                .find(|(p, _)| i64::from(*pid) == *p)
                .unwrap_or_else(|| panic!("no stack of task {pid} ({comm}) {when}: {ctx}"));
            assert_eq!(&ours.1, frames, "task {pid} ({comm}) {when}: {ctx}");
        }
        in_module += 1;
    }
    assert!(in_module >= 3, "only {in_module} tasks in evdev: {ctx}");
    eprintln!("{in_module} tasks through evdev: the script's stacks equal /proc/PID/stack");
}

/// Guest job: evdev loaded after the script's probes are in, then three opens of the
/// keyboard's event device, the first through evdev's `evdev_open` into the kernel's
/// `input_open_device`.
const MODULE_OPEN_JOB: &str = "insmod /modules/evdev.ko\n\
    for i in 1 2 3; do cat /dev/input/event0 > /dev/null & done\n\
    sleep 2\n";

/// The stacks a script printed at `input_open_device`, each a list of `%pB` names.
fn module_open_stacks(mode: &str) -> Vec<Vec<String>> {
    let dir = tempfile::tempdir().unwrap();
    let initrd = module_initramfs(dir.path(), MODULE_OPEN_JOB);
    let console = dir.path().join("console.log");
    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            "300",
            "--compile",
            mode,
            "--script-text",
        ])
        .arg(
            "global keys\n\
             probe kernel.function(\"input_open_device\") { \
             printf(\"OPEN-BEGIN 0\\n\"); print_backtrace(); printf(\"OPEN-END\\n\"); \
             keys[backtrace()]++ }\n\
             probe end { foreach (k in keys) { \
             printf(\"KEY-BEGIN %d\\n\", keys[k]); print_stack(k); printf(\"KEY-END\\n\") } }",
        )
        .arg("--initrd")
        .arg(&initrd)
        .arg("--console")
        .arg(&console));
    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    let ctx = format!("--compile {mode}: stdout:\n{out}\nstderr:\n{err}\nconsole:\n{transcript}");
    assert_eq!(code, 0, "{ctx}");
    let stacks: Vec<Vec<String>> = script_blocks(&out, "OPEN-BEGIN ", "OPEN-END")
        .into_iter()
        .map(|(_, frames)| frames)
        .collect();
    // evdev opens the input device at its first open only.
    assert_eq!(stacks.len(), 1, "{ctx}");
    // The stack kept as a key (a string of pcs: the kernel's own unwinder in compiled
    // code), named by the host in `end` after the module was loaded.
    let keys = script_blocks(&out, "KEY-BEGIN ", "KEY-END");
    assert_eq!(keys.len(), 1, "{ctx}");
    assert!(
        keys[0]
            .1
            .iter()
            .any(|f| f.starts_with("evdev_open+") && f.ends_with(" [evdev]"))
            && keys[0]
                .1
                .last()
                .is_some_and(|f| f.starts_with("entry_SYSCALL_64_after_hwframe+")),
        "{ctx}"
    );
    stacks
}

#[test]
fn compiled_snapshots_unwind_through_a_module_loaded_after_the_script_started() {
    if !have_qemu("compiled_snapshots_unwind_through_a_module_loaded_after_the_script_started") {
        return;
    }
    let compiled = module_open_stacks("require");
    let host = module_open_stacks("never");

    for stack in compiled.iter().chain(&host) {
        assert!(
            stack
                .iter()
                .any(|f| f.starts_with("evdev_open+") && f.ends_with(" [evdev]")),
            "{stack:?}"
        );
        assert!(
            stack
                .last()
                .is_some_and(|f| f.starts_with("entry_SYSCALL_64_after_hwframe+")),
            "{stack:?}"
        );
    }
    // The same path each time: the compiled probe's snapshots name what the host-evaluated
    // probe's stops unwound (checked against the guest's /proc/PID/stack above).
    assert_eq!(compiled, host);
    eprintln!("compiled and host-evaluated: {:?}", compiled[0]);
}

/// A script's view of the same tasks: `task_backtrace($task)` at the guest's own
/// `proc_pid_stack` (the function behind `/proc/PID/stack`), so the host unwinds the very
/// task the guest is about to print, at the same moment; and kernel stacks as map keys,
/// counted at every getppid and printed with their symbols at the end. `print_stack`, not
/// `printf` of `sprint_stack`: a string is cut at 512 bytes, as SystemTap's MAXSTRINGLEN.
const STACK_SCRIPT: &str = r#"global stacks
probe kernel.function("proc_pid_stack") {
  if ($task == task_current()) next
  printf("TASK-STACK-BEGIN %d\n", @cast($task, "task_struct")->pid)
  print_stack(task_backtrace($task))
  printf("TASK-STACK-END\n")
}
probe kernel.function("stack_trace_save_tsk") {
  if ($tsk != task_current()) next
  printf("SELF-STACK-BEGIN %d\n", pid())
  print_backtrace()
  printf("SELF-STACK-END\n")
}
probe kernel.function("__x64_sys_getppid") {
  if (execname() == "syscall-loop") stacks[backtrace()]++
}
probe end {
  foreach (k in stacks) {
    printf("KEY-BEGIN %d\n", stacks[k])
    print_stack(k)
    printf("KEY-END\n")
  }
}
"#;

/// Blocks of `BEGIN` header lines, each's number and frame names (`func+0xoff/0xsize` from
/// ` 0xADDR : NAME [kernel]` lines).
fn script_blocks(out: &str, begin: &str, end: &str) -> Vec<(i64, Vec<String>)> {
    let mut blocks = Vec::new();
    let mut current: Option<(i64, Vec<String>)> = None;
    for line in out.lines() {
        if let Some(n) = line.strip_prefix(begin) {
            current = Some((n.trim().parse().unwrap(), Vec::new()));
        } else if line.starts_with(end) {
            blocks.extend(current.take());
        } else if let Some((_, frames)) = current.as_mut() {
            let name = line.split(" : ").nth(1).unwrap_or(line);
            frames.push(name.trim_end_matches(" [kernel]").to_owned());
        }
    }
    blocks
}

#[test]
fn task_backtrace_equals_the_guests_own_proc_pid_stack_and_stacks_count_as_map_keys() {
    if !have_qemu(
        "task_backtrace_equals_the_guests_own_proc_pid_stack_and_stacks_count_as_map_keys",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.sh");
    // Then tasks that read their own stack: running, on a vCPU, when the probe stops the
    // guest, so exotap unwinds them from the vCPU's registers (what drgn cannot do).
    let job_text = BLOCKED_JOB.replace(
        "exotap_wait backtrace\n",
        "for i in 1 2 3 4 5 6 7 8; do\n\
           sh -c 'echo \"SELF-STACK-BEGIN $$\"; exec cat /proc/self/stack'\n\
           echo SELF-STACK-END\n\
         done\n\
         syscall-loop 50\n",
    );
    std::fs::write(&job, job_text).unwrap();
    let (out, transcript, ctx) = boot_host_evaluated(dir.path(), STACK_SCRIPT, "--job", &job, 600);
    let guest = guest_stacks(&transcript);
    let host = script_blocks(&out, "TASK-STACK-BEGIN ", "TASK-STACK-END");
    let mut compared = 0;
    for (pid, (comm, frames)) in &guest {
        let ours = host
            .iter()
            .find(|(p, _)| i64::from(*pid) == *p)
            .unwrap_or_else(|| panic!("the script printed no stack of task {pid} ({comm}): {ctx}"));
        assert_eq!(&ours.1, frames, "task {pid} ({comm}): {ctx}");
        compared += 1;
    }
    assert!(compared >= 20, "only {compared} tasks compared: {ctx}");
    // Running tasks: the guest's /proc/self/stack (from inside stack_trace_save_tsk, which
    // leaves itself out) against exotap's unwind at that function's entry, from the vCPU.
    let guest_self = script_blocks(
        &transcript.replace("[<0>] ", ""),
        "SELF-STACK-BEGIN ",
        "SELF-STACK-END",
    );
    let host_self = script_blocks(&out, "SELF-STACK-BEGIN ", "SELF-STACK-END");
    assert_eq!(guest_self.len(), 8, "{ctx}");
    for (pid, frames) in &guest_self {
        let ours = host_self
            .iter()
            .find(|(p, _)| p == pid)
            .unwrap_or_else(|| panic!("no stack of running task {pid}: {ctx}"));
        assert!(
            ours.1
                .first()
                .is_some_and(|f| f.starts_with("stack_trace_save_tsk+")),
            "task {pid}: {:?}\n{ctx}",
            ours.1
        );
        assert_eq!(&ours.1[1..], frames.as_slice(), "running task {pid}: {ctx}");
        assert!(frames.len() >= 6, "task {pid}: {frames:?}");
    }
    // Every getppid the workload made (its own count; the shells call getppid too) counted
    // under a stack that starts in __x64_sys_getppid and came from the system call entry.
    // Its first frame is named `__do_sys_getppid`: on this kernel `__x64_sys_getppid`,
    // `__ia32_sys_getppid` and `__do_sys_getppid` share one address, and exotap names an
    // address as the kernel's own kallsyms_lookup does (`/proc/PID/stack`, `%pS`).
    let calls: i64 = common::result(&out, "getppid.calls")
        .unwrap()
        .parse()
        .unwrap();
    let keys = script_blocks(&out, "KEY-BEGIN ", "KEY-END");
    assert_eq!(keys.iter().map(|k| k.0).sum::<i64>(), calls, "{ctx}");
    for (_, frames) in &keys {
        assert!(frames[0].starts_with("__do_sys_getppid+0x"), "{frames:?}");
        assert!(
            frames.iter().any(|f| f.starts_with("do_syscall_64+"))
                && frames.iter().any(|f| f.starts_with("entry_SYSCALL_64")),
            "{frames:?}"
        );
    }
    eprintln!(
        "{compared} task_backtrace() stacks equal to /proc/PID/stack; {} running tasks' \
         print_backtrace() equal to their /proc/self/stack; {} getppid stacks as keys",
        guest_self.len(),
        keys.len()
    );
}

#[test]
fn profile_of_a_cached_file_read_loop_is_dominated_by_the_read_path() {
    if !have_qemu("profile_of_a_cached_file_read_loop_is_dominated_by_the_read_path") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let folded = dir.path().join("out.folded");
    let svg = dir.path().join("out.svg");
    // 32 MiB in the guest's tmpfs, read again and again in 1 MiB reads: the time goes to
    // copying page-cache pages to user space, under ksys_read.
    let workload = "dd if=/dev/zero of=/tmp/big bs=1M count=32 2>/dev/null; i=0; \
                    while [ $i -lt 25 ]; do dd if=/tmp/big of=/dev/null bs=1M 2>/dev/null; \
                    i=$((i+1)); done";

    let (code, out, err) = run(exotap()
        .args([
            "profile",
            "--hz",
            "20",
            "--baseline",
            "--timeout",
            "300",
            "--run",
        ])
        .arg(workload)
        .arg("--folded")
        .arg(&folded)
        .arg("--svg")
        .arg(&svg)
        .arg("--console")
        .arg(dir.path().join("console.log")));

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let text = std::fs::read_to_string(&folded).unwrap();
    let lines: Vec<(&str, u64)> = text
        .lines()
        .map(|l| {
            let (stack, count) = l.rsplit_once(' ').unwrap();
            (stack, count.parse().unwrap())
        })
        .collect();
    let total: u64 = lines.iter().map(|(_, n)| n).sum();
    // The idle loop (swapper/N) holds the vCPU dd does not run on; of the rest, dd's
    // reads are the majority, and the hottest busy stack is one of them.
    let busy: Vec<&(&str, u64)> = lines
        .iter()
        .filter(|(s, _)| !s.starts_with("swapper/"))
        .collect();
    let busy_total: u64 = busy.iter().map(|(_, n)| n).sum();
    let dd_reading: u64 = busy
        .iter()
        .filter(|(s, _)| s.starts_with("dd;") && s.contains(";ksys_read;vfs_read;"))
        .map(|(_, n)| n)
        .sum();
    assert!(total >= 40, "too few samples ({total}): {ctx}");
    assert!(
        dd_reading * 2 >= busy_total,
        "only {dd_reading} of {busy_total} busy samples are dd under ksys_read:\n{text}"
    );
    let (hottest, _) = busy.first().unwrap();
    assert!(
        hottest.starts_with("dd;") && hottest.contains(";ksys_read;vfs_read;"),
        "hottest busy stack: {hottest}\n{text}"
    );
    // Every kernel sample unwound to the end of its stack, but a sample stopped in an IDT
    // entry stub itself (`asm_exc_*`, `asm_sysvec_*`, `asm_common_interrupt` as the innermost
    // frame): at its first instructions the unwinder does not yet find the interrupted frame
    // (a known gap, seen once in some runs under load: `swapper/0;[incomplete];0x0;
    // asm_sysvec_apic_timer_interrupt`); at most one such sample.
    let in_entry_stub = |s: &str| {
        s.rsplit(';').next().is_some_and(|f| {
            f.starts_with("asm_exc_") || f.starts_with("asm_sysvec_") || f == "asm_common_interrupt"
        })
    };
    let incomplete: Vec<&(&str, u64)> = lines
        .iter()
        .filter(|(s, _)| s.contains("[incomplete]"))
        .collect();
    assert!(
        incomplete.iter().all(|(s, _)| in_entry_stub(s))
            && incomplete.iter().map(|(_, n)| n).sum::<u64>() <= 1,
        "incomplete unwinds: {incomplete:?}\n{text}"
    );
    // A sample in a retpoline thunk unwinds through it to its caller: the kernel's table
    // says the stack ends there (6.1's `UNWIND_HINT_EMPTY`), which showed `comm;thunk`.
    let cut_at_thunk: Vec<&(&str, u64)> = lines
        .iter()
        .filter(|(s, _)| {
            let frames: Vec<&str> = s.split(';').collect();
            frames.len() == 2 && frames[1].starts_with("__x86_indirect_thunk")
        })
        .collect();
    assert!(
        cut_at_thunk.is_empty(),
        "stacks that end at a thunk: {cut_at_thunk:?}\n{text}"
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(
        picture.starts_with("<?xml") && picture.contains("<svg"),
        "{picture:.200}"
    );
    assert!(
        picture.contains("vfs_read"),
        "the flame graph lacks vfs_read"
    );
    let overhead = out.lines().find(|l| l.starts_with("overhead: ")).unwrap();
    assert!(out.lines().any(|l| l.starts_with("workload: ")), "{ctx}");
    eprintln!("{overhead}");
}

#[test]
fn profile_with_target_samples_a_guest_someone_else_booted_and_lets_it_run_on() {
    if !have_qemu("profile_with_target_samples_a_guest_someone_else_booted_and_lets_it_run_on") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gdb.sock");
    // The guest reads a cached file for a while, then ends on its own: it must still get
    // there after exotap sampled it and left.
    let job = "dd if=/dev/zero of=/tmp/big bs=1M count=16 2>/dev/null\n\
               exotap_result ready 1\n\
               i=0; while [ $i -lt 60 ]; do dd if=/tmp/big of=/dev/null bs=1M 2>/dev/null; \
               i=$((i+1)); done\n";
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).unwrap();
    let (mut guest, mut console) = common::boot_with_gdbstub(
        &["--timeout", "300", "--job", job_file.to_str().unwrap()],
        &socket,
        "EXOTAP-RESULT ready=1",
    );

    let (code, out, err) = run(exotap()
        .args([
            "profile",
            "--hz",
            "10",
            "--duration",
            "2",
            "--format",
            "json",
        ])
        .arg("--target")
        .arg(format!("unix:{}", socket.display())));

    let mut rest = String::new();
    std::io::Read::read_to_string(&mut console, &mut rest).unwrap();
    let guest_ok = guest.wait().unwrap().success();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(
        guest_ok && rest.contains("EXOTAP-DONE 0"),
        "guest after exotap:\n{rest}"
    );
    let json = out.find('{').map(|at| &out[at..]).unwrap();
    let report: serde_json::Value = serde_json::from_str(json).unwrap();
    let stops = report["stops"].as_u64().unwrap();
    let samples = report["samples"].as_u64().unwrap();
    let fraction = report["stop_fraction"].as_f64().unwrap();
    let counted: u64 = report["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["count"].as_u64().unwrap())
        .sum();
    assert!(stops >= 5, "{ctx}");
    // Two vCPUs a stop, and every sample lands in one folded stack.
    assert_eq!(samples, 2 * stops, "{ctx}");
    assert_eq!(counted, samples, "{ctx}");
    assert!(fraction > 0.0 && fraction < 1.0, "{ctx}");
    for bad in ["Oops", "BUG:", "WARNING:"] {
        assert!(!rest.contains(bad), "{bad} in the console:\n{rest}");
    }
}

/// SystemTap's `profiling/pf2.stp` reduced to what can be checked: `timer.profile` samples
/// every vCPU, `addr()` and `user_mode()` say where it was, `symname()` names the kernel pcs
/// and `execname()` reads the task also in user mode (through the kernel's CR3 under PTI).
const PROFILE_SCRIPT: &str = r#"global pcount, kern, user, bad, dd, unamed, syms
probe timer.profile {
  pcount <<< 1
  if (user_mode()) {
    user++
    if (addr() < 0) bad++
    if (execname() != "") unamed++
  } else {
    kern++
    if (addr() >= 0) bad++
    syms[symname(addr())]++
  }
  if (execname() == "dd") dd++
}
probe end {
  printf("PROFILE samples=%d kernel=%d user=%d bad=%d dd=%d user_named=%d\n",
         @count(pcount), kern, user, bad, dd, unamed)
  foreach (s in syms- limit 30) printf("SYM %s %d\n", s, syms[s])
}
"#;

#[test]
fn timer_profile_samples_every_vcpu_where_it_runs() {
    if !have_qemu("timer_profile_samples_every_vcpu_where_it_runs") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.sh");
    let script = dir.path().join("pf.stp");
    std::fs::write(
        &job,
        "dd if=/dev/zero of=/tmp/big bs=1M count=16 2>/dev/null\nexotap_wait profile\n\
         i=0; while [ $i -lt 12 ]; do dd if=/tmp/big of=/dev/null bs=1M 2>/dev/null; \
         i=$((i+1)); done\n",
    )
    .unwrap();
    std::fs::write(&script, PROFILE_SCRIPT).unwrap();
    let console = dir.path().join("console.log");

    let (code, out, err) = run(exotap()
        .args(["boot", "--timeout", "600", "--compile", "never", "--script"])
        .arg(&script)
        .arg("--job")
        .arg(&job)
        .arg("--console")
        .arg(&console));

    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nconsole:\n{transcript}");
    assert_eq!(code, 0, "{ctx}");
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("PROFILE "))
        .unwrap_or_else(|| panic!("no PROFILE line: {ctx}"));
    let field = |k: &str| -> u64 {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {line}"))
            .parse()
            .unwrap()
    };
    let (samples, kernel, user, bad, dd) = (
        field("samples"),
        field("kernel"),
        field("user"),
        field("bad"),
        field("dd"),
    );
    // Every sample is one vCPU in one mode, its pc on that mode's side of the address space.
    assert!(samples >= 40, "too few samples: {line}");
    assert_eq!(kernel + user, samples, "{line}");
    assert_eq!(bad, 0, "a pc on the wrong side for its mode: {line}");
    // The task is read in user mode too (the user CR3 maps no kernel data under PTI).
    assert_eq!(field("user_named"), user, "{line}");
    // dd's read loop keeps one of the two vCPUs busy for most of the window.
    assert!(
        dd * 5 >= samples,
        "dd in only {dd} of {samples} samples: {line}"
    );
    // The kernel pcs' names are the kernel's text symbols (the -dbg System.map, an outside
    // list, when cached).
    let syms: Vec<(&str, u64)> = out
        .lines()
        .filter_map(|l| l.strip_prefix("SYM "))
        .map(|l| {
            let (s, n) = l.rsplit_once(' ').unwrap();
            (s, n.parse().unwrap())
        })
        .collect();
    assert!(!syms.is_empty(), "{ctx}");
    let map = exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)
        .map(|d| d.join("debug/System.map"))
        .and_then(|p| match std::fs::read_to_string(&p) {
            Ok(map) => Some(map),
            // Not cached: the names are not checked (SKIP below).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => panic!("cannot read the cached {}: {e}", p.display()),
        });
    match map {
        Some(map) => {
            let text: BTreeSet<&str> = map
                .lines()
                .filter_map(|l| {
                    let mut w = l.split_whitespace();
                    let (_, kind, name) = (w.next()?, w.next()?, w.next()?);
                    matches!(kind, "t" | "T" | "W" | "w").then_some(name)
                })
                .collect();
            for (s, _) in &syms {
                assert!(
                    text.contains(s),
                    "{s} is no text symbol of System.map: {ctx}"
                );
            }
        }
        None => eprintln!("SKIP: no -dbg System.map cached; symbol names not checked"),
    }
    eprintln!(
        "{line}; hottest kernel pcs: {:?}",
        &syms[..syms.len().min(5)]
    );
}

/// Guest job for the stack-snapshot comparison: the guest's own kprobe on the probed
/// function, armed before exotap attaches and read by exotap at its install and removal
/// stops (`--compare-kprobes`), around a fixed number of getppid calls.
const GETPPID_JOB: &str = "T=/sys/kernel/tracing\n\
    echo 'p:exotap/gp __x64_sys_getppid' >> $T/kprobe_events\n\
    echo 1 > $T/events/exotap/enable\n\
    exotap_wait attach\n\
    syscall-loop 100\n\
    exotap_wait detach\n\
    echo 0 > $T/events/exotap/enable\n\
    echo > $T/kprobe_events\n";

/// One record a hit: the stack as `print_backtrace()` prints it, then (a second record)
/// its pcs as `backtrace()` gives them; the workload's reads, one frame deeper; and the
/// timer tick's pcs, one line a hit (a tick may interrupt a probed function at its first
/// byte, so its frames as lines would not say where a stack starts). The tick runs on the
/// IRQ stack: a snapshot of it ends where the unwind goes back to the interrupted task's.
const GETPPID_STACKS: &str = r#"probe kernel.function("__x64_sys_getppid") {
  print_backtrace()
  printf("PCS %s\n", backtrace())
}
probe kernel.function("vfs_read") {
  if (execname() == "syscall-loop") print_backtrace()
}
probe kernel.function("scheduler_tick") { printf("TICK %s\n", backtrace()) }
"#;

/// What one run of `GETPPID_STACKS` printed.
struct Printed {
    out: String,
    err: String,
    /// The stacks printed by `print_backtrace()`, as (pc, name) frame lists.
    stacks: Vec<Vec<(u64, String)>>,
    /// The `backtrace()` strings of getppid.
    pcs: Vec<String>,
    /// The `backtrace()` strings of the ticks, as words.
    ticks: Vec<Vec<String>>,
}

/// Runs `GETPPID_STACKS` with `--compile MODE`.
fn getppid_stacks(mode: &str) -> Printed {
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.sh");
    std::fs::write(&job, GETPPID_JOB).unwrap();
    let console = dir.path().join("console.log");
    let (code, out, err) = run(exotap()
        .args(["boot", "--timeout", "400", "--compile", mode])
        .args(["--script-text", GETPPID_STACKS])
        .args(["--attach-in-job", "--compare-kprobes", "--job"])
        .arg(&job)
        .arg("--console")
        .arg(&console));
    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    assert_eq!(
        code, 0,
        "--compile {mode}: stdout:\n{out}\nstderr:\n{err}\nconsole:\n{transcript}"
    );
    let mut stacks: Vec<Vec<(u64, String)>> = Vec::new();
    let mut pcs = Vec::new();
    let mut ticks = Vec::new();
    for line in out.lines() {
        if let Some(words) = line.strip_prefix("PCS ") {
            pcs.push(words.to_owned());
            continue;
        }
        if let Some(words) = line.strip_prefix("TICK ") {
            ticks.push(words.split(' ').map(str::to_owned).collect());
            continue;
        }
        // The cut marker, kept as a last frame named "...".
        if line.starts_with(" ... (") {
            if let Some(stack) = stacks.last_mut() {
                stack.push((0, "...".to_owned()));
            }
            continue;
        }
        let Some((addr, name)) = line.trim_start().split_once(" : ") else {
            continue;
        };
        let Ok(pc) = u64::from_str_radix(addr.trim_start_matches("0x"), 16) else {
            continue;
        };
        let name = name.trim_end_matches(" [kernel]").to_owned();
        // A stack starts at a probe point, a probed function's first byte (an interrupted pc
        // may be at another function's first byte; a return address never is). The kernel
        // names __x64_sys_getppid's address __do_sys_getppid (they alias).
        let probed = ["__do_sys_getppid", "vfs_read"]
            .iter()
            .any(|f| name.starts_with(&format!("{f}+0x0/")));
        if probed || stacks.is_empty() {
            stacks.push(Vec::new());
        }
        stacks.last_mut().unwrap().push((pc, name));
    }
    Printed {
        out,
        err,
        stacks,
        pcs,
        ticks,
    }
}

#[test]
fn compiled_print_backtrace_unwinds_snapshots_to_the_host_evaluated_stacks() {
    if !have_qemu("compiled_print_backtrace_unwinds_snapshots_to_the_host_evaluated_stacks") {
        return;
    }
    let Printed {
        out,
        err,
        stacks: compiled,
        pcs: compiled_pcs,
        ticks: compiled_ticks,
    } = getppid_stacks("require");
    let Printed {
        out: host_out,
        err: host_err,
        stacks: host,
        ticks: host_ticks,
        ..
    } = getppid_stacks("never");
    let ctx = format!(
        "compiled stdout:\n{out}\ncompiled stderr:\n{err}\nhost stdout:\n{host_out}\nhost \
         stderr:\n{host_err}"
    );
    // Compiled: no host stop per hit (nothing fell back), one stack per hit of the guest's
    // own kprobe on the function, none lost.
    assert!(!err.contains("run on the host"), "{ctx}");
    assert!(!err.contains("records of compiled probes lost"), "{ctx}");
    let kprobe: usize = common::host_result(&err, "kprobe.__x64_sys_getppid")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no kprobe count: {ctx}"));
    assert!(kprobe >= 100, "{ctx}");
    let getppid = |stacks: &[Vec<(u64, String)>]| {
        stacks
            .iter()
            .filter(|s| s[0].1.starts_with("__do_sys_getppid+0x0/"))
            .count()
    };
    assert_eq!(getppid(&compiled), kprobe, "{ctx}");
    assert_eq!(compiled_pcs.len(), kprobe, "{ctx}");
    // The frames by name (the two boots have different KASLR slides) equal the host's.
    let names = |stacks: &[Vec<(u64, String)>]| -> BTreeSet<Vec<String>> {
        stacks
            .iter()
            .map(|s| s.iter().map(|f| f.1.clone()).collect())
            .collect()
    };
    assert!(!host.is_empty(), "{ctx}");
    assert_eq!(names(&compiled), names(&host), "{ctx}");
    // The host-evaluated path stopped at the same hits of the same workload.
    assert_eq!(
        common::host_result(&host_err, "kprobe.__x64_sys_getppid"),
        Some(kprobe.to_string().as_str()),
        "{ctx}"
    );
    assert_eq!(getppid(&host), kprobe, "{ctx}");
    assert_eq!(compiled.len(), host.len(), "{ctx}");
    let reads = names(&compiled)
        .into_iter()
        .filter(|s| s[0].starts_with("vfs_read+0x0/"))
        .count();
    assert!(reads >= 1, "{ctx}");
    for stack in names(&compiled) {
        assert!(
            stack[0].starts_with("__do_sys_getppid+0x0/") || stack[0].starts_with("vfs_read+0x0/"),
            "{stack:?}"
        );
        assert!(
            stack.iter().any(|f| f.starts_with("do_syscall_64+"))
                && stack.iter().any(|f| f.starts_with("entry_SYSCALL_64")),
            "{stack:?}"
        );
    }
    // The timer ticks: the interrupt's 8 frames (scheduler_tick up to
    // sysvec_apic_timer_interrupt) are those of some host-evaluated tick, once moved by the
    // difference of the two boots' KASLR slides (getppid's address in each); a snapshot taken
    // on the IRQ stack ends where the unwind would go back to the interrupted task's stack,
    // which the host's unwind crosses.
    let getppid_pc = |stacks: &[Vec<(u64, String)>]| {
        stacks
            .iter()
            .find(|s| s[0].1.starts_with("__do_sys_getppid+0x0/"))
            .map(|s| s[0].0)
            .unwrap_or_else(|| panic!("no getppid stack: {ctx}"))
    };
    let slide = getppid_pc(&host).wrapping_sub(getppid_pc(&compiled));
    let interrupt = |words: &[String], delta: u64| -> Vec<u64> {
        words
            .iter()
            .take(8)
            .filter_map(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16).ok())
            .map(|pc| pc.wrapping_add(delta))
            .collect()
    };
    let host_interrupts: BTreeSet<Vec<u64>> = host_ticks.iter().map(|t| interrupt(t, 0)).collect();
    let cut = compiled_ticks
        .iter()
        .filter(|t| t.last().is_some_and(|w| w == "..."))
        .count();
    assert!(
        !compiled_ticks.is_empty() && cut > 0,
        "no tick was cut: {ctx}"
    );
    for tick in &compiled_ticks {
        let frames = interrupt(tick, slide);
        assert_eq!(frames.len(), 8, "tick {tick:?}: {ctx}");
        assert!(
            host_interrupts.contains(&frames),
            "tick {tick:?}: no host-evaluated tick came the same way: {ctx}"
        );
    }
    assert!(
        host_ticks.iter().all(|t| !t.contains(&"...".to_owned())),
        "{ctx}"
    );
    // backtrace() gives the same pcs as the print_backtrace() lines of the same run.
    let pc_lists: BTreeSet<String> = compiled
        .iter()
        .filter(|s| s[0].1.starts_with("__do_sys_getppid+0x0/"))
        .map(|s| {
            s.iter()
                .map(|f| format!("{:#x}", f.0))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let strings: BTreeSet<String> = compiled_pcs.into_iter().collect();
    assert_eq!(strings, pc_lists, "{ctx}");
    assert!(
        names(&compiled)
            .iter()
            .all(|s| s.last().is_some_and(|f| f != "...")),
        "{ctx}"
    );
    eprintln!(
        "{} compiled tick stacks, {cut} cut at the IRQ stack; {} compiled getppid stacks (the \
         guest's kprobe: {kprobe} hits), {} compiled syscall stacks in all, {} host-evaluated; \
         distinct: {:?}",
        compiled_ticks.len(),
        getppid(&compiled),
        compiled.len(),
        host.len(),
        names(&compiled)
    );
}
