//! Kernel stacks as map keys, unwound in the guest and on the host, at entries and returns.

use super::*;

/// Kernel stacks as map keys, both ways in ONE run: the first probe compiles (the guest's
/// own unwinder, `stack_trace_save_regs`, walks from the probe point), the second does not
/// (`symdata()`) and runs on the host at a breakpoint on the same function, where
/// exotap's ORC unwinder walks the stopped vCPU. Both see every hit, so the two arrays
/// must be equal, key for key and count for count, whatever the guest did.
const STACK_KEYS: &str = r#"global compiled, host
  probe kernel.function("dput") {
    if (execname() == "syscall-loop") compiled[backtrace()] <<< 1
  }
  probe kernel.function("dput") {
    if (execname() == "syscall-loop" && symdata(2) != "") host[backtrace()] <<< 1
  }
  probe end {
    foreach (s in compiled) printf("compiled %d %s\n", @count(compiled[s]), s)
    foreach (s in host) printf("host %d %s\n", @count(host[s]), s)
  }"#;

#[test]
fn kernel_stacks_as_keys_are_the_same_unwound_in_the_guest_and_on_the_host() {
    if !have_qemu("kernel_stacks_as_keys_are_the_same_unwound_in_the_guest_and_on_the_host") {
        return;
    }
    let (code, out, err, console) = boot(STACK_KEYS, "auto", "syscall-loop 20");

    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert!(
        err.contains("the script runs mixed: 1 kernel probes compiled")
            || err.contains("the script runs mixed: 1 kernel probe compiled"),
        "{ctx}"
    );
    let out = script_output(&out);
    let (compiled, host) = (counted(&out, "compiled "), counted(&out, "host "));
    let stacks = compiled.len();
    let hits: u64 = compiled.values().sum();
    let deepest = compiled
        .keys()
        .map(|s| s.split(' ').count())
        .max()
        .unwrap_or(0);
    eprintln!("dput from syscall-loop: {hits} hits over {stacks} distinct stacks (deepest {deepest} frames), equal both ways");
    assert_eq!(compiled, host, "{ctx}");
    // The workload's opens and closes reach dput along several paths, each at least the
    // probe point, the syscall's frames and the entry from user space.
    assert!(stacks >= 2 && hits >= 20 && deepest >= 5, "{ctx}");
    let first: std::collections::BTreeSet<&str> = compiled
        .keys()
        .filter_map(|s| s.split(' ').next())
        .collect();
    assert_eq!(first.len(), 1, "every stack starts at dput: {ctx}");
    assert_no_oops(&console);
}

/// Kernel stacks at a function's entry and at its return, compiled and host-evaluated: at
/// the return the code stands in the caller at the return address, so each return's stack
/// is its entry's without the first frame, hit for hit. Compiled, the return's key comes
/// from the guest's unwinder started at the address the trampoline put back, and the
/// printed stack from a snapshot the host unwinds; host-evaluated, from the vCPU stopped at
/// the trampoline, unwound from the original return address.
const RETURN_STACKS: &str = r#"global e, r, p
  probe kernel.function("dput") { if (execname() == "syscall-loop") e[backtrace()] <<< 1 }
  probe kernel.function("dput").return {
    if (execname() == "syscall-loop") {
      r[backtrace()] <<< 1
      if (p++ < 3) printf("printed %s\n", backtrace())
    }
  }
  probe end {
    foreach (s in e) printf("entry %d %s\n", @count(e[s]), s)
    foreach (s in r) printf("return %d %s\n", @count(r[s]), s)
  }"#;

#[test]
fn a_return_probes_stack_is_its_entrys_without_the_first_frame_both_ways() {
    if !have_qemu("a_return_probes_stack_is_its_entrys_without_the_first_frame_both_ways") {
        return;
    }
    for mode in ["require", "never"] {
        let (code, out, err, console) = boot(RETURN_STACKS, mode, "syscall-loop 20");
        let ctx = format!("--compile {mode}\nstdout:\n{out}\nstderr:\n{err}");
        assert_eq!(code, 0, "{ctx}");
        let out = script_output(&out);
        let (entries, returns) = (counted(&out, "entry "), counted(&out, "return "));
        let mut expected = std::collections::BTreeMap::new();
        for (stack, n) in &entries {
            let caller = stack.split_once(' ').map_or("", |(_, rest)| rest);
            *expected.entry(caller.to_owned()).or_insert(0) += n;
        }
        let hits: u64 = returns.values().sum();
        eprintln!(
            "--compile {mode}: {hits} returns of dput over {} stacks, each its entry's less the first frame",
            returns.len()
        );
        assert!(returns.len() >= 2 && hits >= 20, "{ctx}");
        assert_eq!(returns, expected, "{ctx}");
        let printed: Vec<&str> = out
            .lines()
            .filter_map(|l| l.strip_prefix("printed "))
            .collect();
        assert_eq!(printed.len(), 3, "{ctx}");
        for stack in printed {
            assert!(
                returns.contains_key(stack),
                "{stack} is no return's key: {ctx}"
            );
        }
        assert_no_oops(&console);
    }
}
