//! Probe and function kinds beyond kprobes: `symname()`, `timer.profile`, tracepoints, member
//! chains and casts, a member chain through NULL.

use super::*;

/// `symname()` compiles: the guest kernel's own `kallsyms_lookup` names the address in the
/// guest, and the host names it from the image's symbols (the oracle). In check mode, on the
/// same hits: the probe's own address and one byte past it, 0 and a data address (they print
/// as themselves), and the `read_iter` of the files the workload reads (their names are the
/// kernel's own: mm/shmem.c for the workload's file in the initramfs's tmpfs,
/// drivers/char/mem.c for /dev/zero). Then every pc a tick interrupted (`timer.profile`,
/// which check mode does not run on the host) keeps its name from the guest, and the `end`
/// probe, on the host, names the same pc: the two must agree.
#[test]
fn symname_compiles_and_names_what_the_host_names() {
    if !have_qemu("symname_compiles_and_names_what_the_host_names") {
        return;
    }
    let script = r#"global n, ops
      probe kernel.function("vfs_read") {
        if (execname() == "syscall-loop") {
          if (n++ < 3)
            printf("%s|%s|%s|%s\n", symname(addr()), symname(addr() + 1), symname(0), symname($file->f_op))
          ops[symname($file->f_op->read_iter)]++
        }
      }
      probe end { foreach (s in ops) printf("%s %d\n", s, ops[s]) }"#;
    let (code, out, err, con) = boot(script, "check", "syscall-loop 30 pread read");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(printed_the_same(&err), "{ctx}");
    let printed = script_output(&out);
    assert!(
        printed.contains("vfs_read|vfs_read|0x0|0xffffffff"),
        "{ctx}"
    );
    assert!(
        printed.contains("shmem_file_read_iter 30\n") && printed.contains("read_iter_zero 30\n"),
        "{ctx}"
    );
    assert_no_oops(&con);

    let ticks = r#"global names
      probe timer.profile { if (!user_mode()) names[addr()] = symname(addr()) }
      probe end { foreach (pc in names) printf("%s %s\n", names[pc], symname(pc)) }"#;
    let (code, out, err, con) = boot(ticks, "require", "syscall-loop 5000; sleep 0.2");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let printed = script_output(&out);
    let lines: Vec<&str> = printed.lines().filter(|l| !l.is_empty()).collect();
    let differ: Vec<&&str> = lines
        .iter()
        .filter(|l| l.split_once(' ').is_none_or(|(guest, host)| guest != host))
        .collect();
    let named = lines.iter().filter(|l| !l.starts_with("0x")).count();
    eprintln!(
        "{} pcs a tick interrupted, {named} named, {} named differently in the guest",
        lines.len(),
        differ.len()
    );
    assert!(differ.is_empty(), "{differ:?}\n{ctx}");
    assert!(named >= 5, "{ctx}");
    assert_no_oops(&con);
}

#[test]
fn compiled_timer_profile_samples_every_tick_with_the_interrupted_pc() {
    if !have_qemu("compiled_timer_profile_samples_every_tick_with_the_interrupted_pc") {
        return;
    }
    // Every tick runs update_process_times: the guest's own kprobe on it counts the samples.
    // A shell loop spends its ticks in user mode, syscall-loop in the kernel: both kinds are
    // sampled, each pc on its side of the address space (kernel pcs are negative longs).
    let job = "T=/sys/kernel/tracing\n\
               echo 'p:exotap/k0 update_process_times' >> $T/kprobe_events\n\
               echo 1 > $T/events/exotap/enable\n\
               exotap_wait attach\n\
               sh -c 'i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done'\n\
               syscall-loop 20000\n\
               exotap_wait detach\n\
               echo 0 > $T/events/exotap/enable\n\
               echo > $T/kprobe_events\n";
    let script = r#"global n, user, kernel, bad, by
      probe timer.profile {
        n++
        pc = addr()
        if (user_mode()) { user++; if (pc <= 0 || pc >= 0x800000000000) bad++ }
        else { kernel++; if (pc >= 0) bad++ }
        by[execname()]++
      }
      probe end {
        printf("n %d user %d kernel %d bad %d\n", n, user, kernel, bad)
        foreach (e in by- limit 4) printf("%s %d\n", e, by[e])
      }"#;

    let (code, out, err, transcript) = boot_compared(script, job, "500");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let printed = script_output(&out);
    let totals = totals(&printed, "n").unwrap_or_else(|| panic!("no totals: {ctx}"));
    let [n, user, kernel, bad] = totals[..] else {
        panic!("totals: {ctx}")
    };
    let ticks = host_result(&err, "kprobe.update_process_times")
        .and_then(|k| k.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no kprobe count: {ctx}"));
    eprintln!("timer.profile: {n} samples ({user} user, {kernel} kernel) = {ticks} ticks");
    assert_eq!(n, ticks, "samples vs the guest's ticks: {ctx}");
    assert!(user > 0 && kernel > 0 && user + kernel == n, "{ctx}");
    assert_eq!(bad, 0, "{ctx}");
    assert!(
        printed.contains("syscall-loop ") && printed.contains("sh "),
        "{ctx}"
    );
    assert_no_oops(&transcript);
}

#[test]
fn tracepoint_probes_compile_and_print_what_the_host_path_prints_on_the_same_hits() {
    if !have_qemu("tracepoint_probes_compile_and_print_what_the_host_path_prints_on_the_same_hits")
    {
        return;
    }
    // sched_switch(preempt, prev, next, prev_state): the task switched out is the one
    // running the probe, the one switched in another; counted per pair of names and printed
    // for syscall-loop, compiled and host-evaluated on the same hits (check mode).
    let script = r#"global n, own, other, pairs
      probe kernel.trace("sched_switch") {
        n++
        if ($prev->pid == tid()) own++
        if ($next != $prev) other++
        if (execname() == "syscall-loop") pairs[kernel_string($prev->comm), $next->pid > 0]++
      }
      probe end {
        printf("own %d other %d of %d\n", own, other, n)
        foreach ([p, x] in pairs) printf("%s %d %d\n", p, x, pairs[p, x])
      }"#;
    let on = "T=/sys/kernel/tracing; [ -d $T/events ] || mount -t tracefs none $T\n\
              echo 1 > $T/events/sched/sched_switch/enable\n\
              exotap_wait attach\n\
              syscall-loop 20; sleep 0.1; syscall-loop 20\n\
              exotap_wait detach\n";
    // A stop per sched_switch for the host-evaluated shadow (about 1,400 of them, ~2 min on a
    // 2-core host). Each stop once also read the compiled probes' 752 KiB of globals, which
    // the shadow never uses: 0.4 s a stop, past this bound (the guest killed at it).
    let (code, out, err, con) = boot_in_job(script, "check", on, "400");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(printed_the_same(&err), "{ctx}");
    let printed = script_output(&out);
    let totals = totals(&printed, "own").unwrap_or_else(|| panic!("no totals: {ctx}"));
    let [own, other, n] = totals[..] else {
        panic!("totals: {ctx}")
    };
    assert!(n > 0 && own == n && other == n, "{ctx}");
    assert!(printed.contains("syscall-loop 1 "), "{ctx}");
    assert_no_oops(&con);

    // Off in the guest, compiled required: exotap probes the tracepoint's call site (the
    // inlined trace_sched_switch), whose first instruction is the static key's own jump,
    // bytes the kernel patches itself: no compiled body goes there, and the refusal says so
    // before anything goes in.
    let off = "exotap_wait attach\nsyscall-loop 5\nexotap_wait detach\n";
    let (code, out, err, _) = boot_in_job(script, "require", off, "400");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_ne!(code, 0, "{ctx}");
    assert!(
        err.contains("trace_sched_switch") && err.contains("the kernel patches the bytes"),
        "{ctx}"
    );
}

/// A tracepoint that nothing in the guest turned on fires all the same: exotap probes its
/// call sites, the inlined instances of `trace_sched_process_fork` (live::tracepoints),
/// with the tracepoint's arguments from DWARF there, and leaves the guest's tracing state
/// as it was. The guest's own kprobe on `kernel_clone`, which calls it once per successful
/// fork, counts the same window.
#[test]
fn a_tracepoint_the_guest_has_off_fires_at_its_call_sites() {
    if !have_qemu("a_tracepoint_the_guest_has_off_fires_at_its_call_sites") {
        return;
    }
    let job = "T=/sys/kernel/tracing\n\
               echo 'p:exotap/k0 kernel_clone' >> $T/kprobe_events\n\
               echo 1 > $T/events/exotap/enable\n\
               exotap_wait attach\n\
               i=0; while [ $i -lt 40 ]; do /bin/true; i=$((i+1)); done\n\
               exotap_wait detach\n\
               echo 0 > $T/events/exotap/enable\n\
               echo > $T/kprobe_events\n\
               exotap_result fork.enable $(cat $T/events/sched/sched_process_fork/enable)\n";
    let script = r#"global n, named, younger
      probe kernel.trace("sched_process_fork") {
        n++
        if ($child->pid > $parent->pid) younger++
        if (kernel_string($parent->comm) != "") named++
      }
      probe end { printf("forks %d younger %d named %d\n", n, younger, named) }"#;

    let (code, out, err, con) = boot_in_job(script, "auto", job, "400");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(
        err.contains("probing its 1 call sites (the inlined trace_sched_process_fork)"),
        "{ctx}"
    );
    let printed = script_output(&out);
    let totals = totals(&printed, "forks").unwrap_or_else(|| panic!("no totals: {ctx}"));
    let [n, younger, named] = totals[..] else {
        panic!("totals: {ctx}")
    };
    let clones = host_result(&err, "kprobe.kernel_clone")
        .and_then(|k| k.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no kprobe count: {ctx}"));
    eprintln!("sched_process_fork at its call sites: {n} = kernel_clone's kprobe {clones}");
    assert!(n >= 40, "{ctx}");
    assert_eq!(n, clones, "{ctx}");
    assert_eq!((younger, named), (n, n), "{ctx}");
    // Nothing in the guest turned the tracepoint on, exotap included.
    let enable =
        common::result(&out, "fork.enable").or_else(|| common::result(&con, "fork.enable"));
    assert_eq!(enable, Some("0"), "{ctx}");
    assert_no_oops(&con);
}

/// Member chains and `@cast` on both paths; syscall-loop creates its 18-byte file
/// `/tmp/syscall-loop.small` (a name of 18 bytes) with mode 0644, opens it for writing once
/// and for reading 61 times, and preads 64 bytes from it 60 times.
const CHAINS: &str = r#"global sizes, names, modes, opened
  probe kernel.function("vfs_read") {
    if (execname() != "syscall-loop") next
    sizes[$file->f_inode->i_size] <<< $count
    names[$file->f_path->dentry->d_name->len]++
    modes[@cast($file, "struct file")->f_inode->i_mode & 511] += $count
  }
  probe kernel.function("do_filp_open").return {
    if (execname() == "syscall-loop") opened[$return->f_flags & 3]++
  }
  probe end {
    foreach (s in sizes) printf("size %d: %d reads of %d bytes\n", s, @count(sizes[s]), @sum(sizes[s]))
    foreach (l in names) printf("name of %d bytes: %d\n", l, names[l])
    foreach (m in modes) printf("mode %d: %d\n", m, modes[m])
    foreach (f in opened) printf("opened with access mode %d: %d\n", f, opened[f])
  }"#;

#[test]
fn member_chains_and_casts_print_the_same_compiled_and_host_evaluated() {
    if !have_qemu("member_chains_and_casts_print_the_same_compiled_and_host_evaluated") {
        return;
    }
    let (code_c, out_c, err_c, con_c) = boot(CHAINS, "require", "syscall-loop 60");
    let (code_h, out_h, err_h, _) = boot(CHAINS, "never", "syscall-loop 60");

    let ctx = format!("compiled stderr:\n{err_c}\nhost stderr:\n{err_h}");
    assert_eq!((code_c, code_h), (0, 0), "{ctx}");
    let out = script_output(&out_c);
    for line in [
        "size 18: 60 reads of 3840 bytes\n",
        "name of 18 bytes: 60\n",
        "mode 420: 3840\n",
        "opened with access mode 1: 1\n",
    ] {
        assert!(out.contains(line), "{line} missing from:\n{out}\n{ctx}");
    }
    assert_eq!(out, script_output(&out_h), "{ctx}");
    assert_no_oops(&con_c);
}

#[test]
fn a_host_evaluated_member_chain_through_null_is_a_probe_error_and_the_guest_lives() {
    if !have_qemu("a_host_evaluated_member_chain_through_null_is_a_probe_error_and_the_guest_lives")
    {
        return;
    }
    let script = r#"global x; probe kernel.syscall("getpid") { if (execname() == "syscall-loop") x = @cast(0, "struct file")->f_inode->i_ino }"#;

    let (code, out, err, console) = boot(script, "never", "syscall-loop 5");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 1, "a probe error is a script error: {ctx}");
    assert!(
        err.contains("kernel read fault in @cast(..., \"struct file\")")
            && err.contains("cannot read guest memory at 0x"),
        "{ctx}"
    );
    assert!(
        out.contains("EXOTAP-DONE 0"),
        "the guest's job finished: {ctx}"
    );
    assert_no_oops(&console);
}

/// Timer and end probes run on the host and read the guest's kernel memory, the guest stopped
/// for them (as a SystemTap timer reads it in the kernel): the task that runs the job, found
/// by a compiled probe, has the same command name and pid read from the host (`@cast` chains,
/// `kernel_string`, the tapset's `task_execname`) as the compiled probe read in the guest.
#[test]
fn timer_and_end_probes_read_guest_memory() {
    if !have_qemu("timer_and_end_probes_read_guest_memory") {
        return;
    }
    let script = r#"global parent, pcomm, pid_seen, timer_seen
      probe kernel.syscall("getppid") {
        if (execname() == "syscall-loop" && !parent) {
          parent = task_parent(task_current())
          pcomm = task_execname(parent)
          pid_seen = ppid()
        }
      }
      probe timer.ms(100) {
        if (parent && !timer_seen) {
          timer_seen = 1
          printf("timer: %s %d\n", kernel_string(@cast(parent, "task_struct")->comm),
                 @cast(parent, "task_struct")->tgid)
        }
      }
      probe end {
        printf("end: %s %d\n", task_execname(parent), task_pid(parent))
        printf("guest: %s %d\n", pcomm, pid_seen)
      }"#;
    let job = "exotap_wait attach\nsyscall-loop 20\nsleep 2\nexotap_wait detach\n";
    for mode in ["auto", "never"] {
        let (code, out, err, con) = boot_in_job(script, mode, job, "400");
        let ctx = format!("--compile {mode}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 0, "{ctx}");
        let printed = script_output(&out);
        let line = |tag: &str| {
            printed
                .lines()
                .find_map(|l| l.strip_prefix(tag))
                .unwrap_or_else(|| panic!("no {tag} line: {ctx}"))
                .to_owned()
        };
        let guest = line("guest: ");
        assert!(!guest.starts_with(' ') && !guest.ends_with(" 0"), "{ctx}");
        assert_eq!(line("timer: "), guest, "{ctx}");
        assert_eq!(line("end: "), guest, "{ctx}");
        assert_no_oops(&con);
    }
}

/// At a syscall wrapper's entry (`__x64_sys_openat(const struct pt_regs *regs)`), the system
/// call's own parameters by their `SYSCALL_DEFINE` names (`$dfd`, `$filename`, `$flags`,
/// `$mode`), which DWARF has in scope only further in, read from the caller's registers as
/// SystemTap's nd_syscall does: syscall-loop's two opens of its small file
/// (guest-images/workloads/syscall-loop.c: glibc's `open` is `openat(AT_FDCWD, ...)`), the
/// first creating it for writing with mode 0644, the second reading it.
#[test]
fn a_syscall_wrapper_entry_reads_the_syscall_parameters_by_name() {
    if !have_qemu("a_syscall_wrapper_entry_reads_the_syscall_parameters_by_name") {
        return;
    }
    let script = r#"global opens
      probe kernel.function("__x64_sys_openat") {
        if (execname() == "syscall-loop") opens[$dfd, user_string($filename), $flags & 3, $mode]++
      }
      probe end {
        foreach ([d, f, a+, m] in opens) printf("%d %s %d %o %d\n", d, f, a, m, opens[d, f, a, m])
      }"#;
    for mode in ["auto", "never"] {
        let (code, out, err, con) = boot(script, mode, "syscall-loop 5 pread");
        let ctx = format!("--compile {mode}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 0, "{ctx}");
        assert_eq!(
            script_output(&out),
            "-100 /tmp/syscall-loop.small 0 0 1\n-100 /tmp/syscall-loop.small 1 644 1\n",
            "{ctx}"
        );
        assert_no_oops(&con);
    }
}

/// `kernel.field("struct file", "f_pos").write` (KLAS's join points) gives the handler the
/// object written (`$object`, the struct the accessing instruction addresses, less the
/// member's offset) and the value a plain store writes (`$value`): at every write of `dd`'s
/// reads and writes of regular files, `$object` is the file `vfs_read` or `vfs_write` was
/// called with (captured at its entry, an independent oracle), and the new position is what
/// the file held before plus the bytes the call returned (at the writes in `ksys_read` and
/// `ksys_write`, which store the position the call left).
#[test]
fn a_member_write_gives_the_object_and_the_value_written() {
    if !have_qemu("a_member_write_gives_the_object_and_the_value_written") {
        return;
    }
    let script = r#"global file, ret, before, same, other, advanced, writes, elsewhere, regular
      probe kernel.function("vfs_read"), kernel.function("vfs_write") {
        if (execname() == "dd") { file[tid()] = $file; before[tid()] = $file->f_pos }
      }
      probe kernel.function("vfs_read").return, kernel.function("vfs_write").return {
        if (execname() == "dd") ret[tid()] = $return
      }
      probe kernel.field("struct file", "f_pos").write {
        if (execname() != "dd" || !(tid() in file)) next
        // The position a read or write leaves (dd also seeks: vfs_setpos writes f_pos too).
        if (probefunc() != "ksys_read" && probefunc() != "ksys_write") { elsewhere++; next }
        writes++
        if ($object == file[tid()]) same++; else other++
        // A regular file's position moves by what the call returned (/dev/null's, where dd
        // writes its report, stays).
        if (($object->f_inode->i_mode & 0170000) == 0100000) {
          regular++
          if ($value == before[tid()] + ret[tid()]) advanced++
        }
      }
      probe end {
        printf("writes %d same %d other %d regular %d advanced %d\n", writes, same, other,
               regular, advanced)
      }"#;
    let job = "exotap_wait attach\n\
               i=0; while [ $i -lt 5 ]; do dd if=/init of=/tmp/copy bs=64 2>/dev/null; i=$((i+1)); done\n\
               exotap_wait detach\n";
    for mode in ["auto", "never"] {
        let (code, out, err, con) = boot_in_job(script, mode, job, "400");
        let ctx = format!("--compile {mode}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 0, "{ctx}");
        let printed = script_output(&out);
        let totals = totals(&printed, "writes").unwrap_or_else(|| panic!("no totals: {ctx}"));
        let [writes, same, other, regular, advanced] = totals[..] else {
            panic!("totals: {ctx}")
        };
        eprintln!(
            "--compile {mode}: {writes} f_pos writes, $object = the call's file at {same}, \
             $value = the position it left at {advanced} of {regular} in regular files"
        );
        // Each dd copies /init (more than 64 bytes) in reads and writes of 64 bytes.
        assert!(regular >= 20 && writes > regular, "{ctx}");
        assert_eq!((same, other, advanced), (writes, 0, regular), "{ctx}");
        assert_no_oops(&con);
    }
}
