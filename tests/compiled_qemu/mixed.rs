//! Timer probes that only read run without stops; one script of compiled and host probes
//! over the same globals.

use super::*;

/// A timer probe that only reads the compiled globals reads them while the guest runs (the
/// shared RAM): no stop between install and removal. One that writes a global (`delete`)
/// stops the guest at each firing, as the globals go back to the guest.
#[test]
fn timer_probes_that_only_read_do_not_stop_the_guest() {
    if !have_qemu("timer_probes_that_only_read_do_not_stop_the_guest") {
        return;
    }
    let probe = r#"global n
      probe kernel.syscall("getppid") { if (execname() == "syscall-loop") n++ }
      probe end { printf("end n=%d\n", n) }"#;
    let reads = format!(r#"{probe} probe timer.ms(50) {{ printf("tick n=%d\n", n) }}"#);
    let writes = format!(r#"{probe} probe timer.ms(50) {{ printf("tick n=%d\n", n); delete n }}"#);
    // exotap's HOST-RESULT lines go to stderr.
    let pauses = |err: &str| -> u64 {
        err.lines()
            .find_map(|l| l.strip_prefix("HOST-RESULT pauses.between_install_and_removal="))
            .and_then(|n| n.trim().parse().ok())
            .expect("a pauses line")
    };
    let ticks = |out: &str| -> Vec<u64> {
        out.lines()
            .filter_map(|l| l.strip_prefix("tick n="))
            .map(|n| n.parse().expect("a count"))
            .collect()
    };

    let (code_r, out_r, err_r, con_r) = boot(&reads, "require", "syscall-loop 20000");
    let (code_w, out_w, err_w, _) = boot(&writes, "require", "syscall-loop 20000");

    let ctx = format!("reads:\n{out_r}\n{err_r}\nwrites:\n{out_w}\n{err_w}");
    assert_eq!((code_r, code_w), (0, 0), "{ctx}");
    let (seen, stopped) = (ticks(&out_r), ticks(&out_w));
    eprintln!(
        "read-only timer: {} firings, {} pauses; deleting timer: {} firings, {} pauses",
        seen.len(),
        pauses(&err_r),
        stopped.len(),
        pauses(&err_w)
    );
    assert!(!seen.is_empty() && !stopped.is_empty(), "{ctx}");
    assert_eq!(pauses(&err_r), 0, "{ctx}");
    assert!(pauses(&err_w) >= stopped.len() as u64, "{ctx}");
    // What the reading timer saw only grows, up to the final count: the workload's calls.
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{ctx}");
    assert!(*seen.last().unwrap() <= 20000, "{ctx}");
    assert!(out_r.contains("end n=20000\n"), "{ctx}");
    // The deleting timer's counts add up to the workload's calls.
    let end: u64 = out_w
        .lines()
        .find_map(|l| l.strip_prefix("end n="))
        .and_then(|n| n.parse().ok())
        .expect("an end line");
    assert_eq!(stopped.iter().sum::<u64>() + end, 20000, "{ctx}");
    assert_no_oops(&con_r);
}

/// A mixed script: the getppid and close probes compile, the vfs_read probe (`symdata()`,
/// which has no compiled form; `=~` had this role before it compiled) does not and runs on
/// the host, and they share `n` and `reads` both ways.
const MIXED: &str = r#"global n, reads, last
  probe kernel.syscall("getppid") {
    if (execname() == "syscall-loop") { n++; if (n % 20 == 0) printf("getppid %d\n", n) }
  }
  probe kernel.function("vfs_read") {
    if (execname() != "syscall-loop" || symdata(2) == "") next
    reads[$file->f_inode->i_size, n]++
    t = 0
    foreach ([s, m] in reads) t += reads[s, m]
    if (t % 20 == 0)
      printf("read %d of a file of %d bytes after %d getppid, mode %d\n", t,
             $file->f_inode->i_size, n, @cast($file, "struct file")->f_inode->i_mode & 511)
  }
  probe kernel.syscall("close") {
    if (execname() == "syscall-loop") last = reads[18, n]
  }
  probe end {
    printf("n=%d last=%d\n", n, last)
    foreach ([s, m] in reads) printf("%d %d %d\n", s, m, reads[s, m])
  }"#;

#[test]
fn a_mixed_script_runs_compiled_and_host_probes_over_the_same_globals() {
    if !have_qemu("a_mixed_script_runs_compiled_and_host_probes_over_the_same_globals") {
        return;
    }
    let (code_r, _, err_r, _) = boot(MIXED, "require", "syscall-loop 60");
    let (code_a, out_a, err_a, con_a) = boot(MIXED, "auto", "syscall-loop 60");
    let (code_h, out_h, err_h, con_h) = boot(MIXED, "never", "syscall-loop 60");

    let ctx = format!("mixed stderr:\n{err_a}\nhost stderr:\n{err_h}");
    assert_eq!(code_r, 125, "--compile=require refuses: {err_r}");
    assert!(
        err_r.contains("the function symdata() in a kernel probe"),
        "{err_r}"
    );
    assert_eq!((code_a, code_h), (0, 0), "{ctx}");
    assert!(
        err_a.contains("the script runs mixed: 2 kernel probes compiled")
            && err_a.contains(":5: probe kernel.function(\"vfs_read\")")
            && err_a.contains("the function symdata() in a kernel probe"),
        "{ctx}"
    );
    let out = script_output(&out_a);
    // The workload's own counts: 60 getppid before 60 preads of its 18-byte file, then the
    // close that the compiled probe sees after the host probe's last update.
    assert!(
        out.contains("getppid 60\nread 20 of a file of 18 bytes after 60 getppid, mode 420\n")
            && out.ends_with("n=60 last=60\n18 60 60\n"),
        "{out}\n{ctx}"
    );
    assert_eq!(out, script_output(&out_h), "{ctx}");
    // The compiled getppid probe keeps splice speed beside the host-evaluated one.
    let ns = |console: &str| result(console, "getppid.ns_per_call").map(str::to_owned);
    eprintln!(
        "getppid ns per call: mixed (compiled probe) {:?}, host-evaluated {:?}",
        ns(&con_a),
        ns(&con_h)
    );
    assert_no_oops(&con_a);
}
