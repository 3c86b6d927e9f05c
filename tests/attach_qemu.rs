//! End-to-end: attach to a live Debian guest under QEMU TCG over the gdbstub, find the KASLR
//! slide, map the patch heap and splice a counter into `__x64_sys_getpid`
//! (`exotap selftest`), with the guest's own `/proc/kallsyms`, the workload's call count and
//! the guest's kprobe hit count as the oracles.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::{exotap, have_qemu, host_result, result, run};

const CALLS: &str = "20000";

/// One boot of `exotap selftest` with the patch heap placed as `heap_args` say; returns the
/// slide after checking everything else.
fn selftest_boot(heap_args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let console = dir.path().join("console.log");

    let (code, out, err) = run(exotap()
        .args(["selftest", "--calls", CALLS, "--timeout", "400"])
        .args(heap_args)
        .arg("--console")
        .arg(&console));

    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    let ctx = format!(
        "stdout:\n{out}\nstderr:\n{err}\nconsole tail:\n{}",
        tail(&transcript)
    );
    assert_eq!(code, 0, "{ctx}");
    assert!(out.contains("EXOTAP-DONE 0"), "{ctx}");
    // The slide exotap found puts the symbols where the guest itself says they are.
    for name in ["_text", "vfs_read", "__x64_sys_getpid"] {
        let guest = result(&out, &format!("kallsyms.{name}"));
        assert!(guest.is_some_and(|a| a.len() == 16), "{ctx}");
        assert_eq!(
            host_result(&out, &format!("addr.{name}")),
            guest,
            "{name}: {ctx}"
        );
    }
    // The heap lies wholly outside the image, on the side asked for (auto: either).
    let hex = |key: &str| {
        let text = host_result(&out, key);
        assert!(text.is_some(), "no {key}: {ctx}");
        u64::from_str_radix(text.unwrap().trim_start_matches("0x"), 16).unwrap()
    };
    let (text, end) = (hex("addr._text"), hex("addr._end"));
    let heap_va = hex("heap.va");
    let heap_end = heap_va + hex("heap.size");
    let after = heap_va >= end;
    let before = heap_end <= text;
    match heap_args.get(1).copied().unwrap_or("auto") {
        "before" => assert!(before, "heap {heap_va:x}..{heap_end:x}: {ctx}"),
        _ => assert!(after || before, "heap {heap_va:x}..{heap_end:x}: {ctx}"),
    }
    // vfs_read starts with the boot-time ftrace nop5.
    assert_eq!(
        host_result(&out, "bytes.vfs_read"),
        Some("0f1f440000"),
        "{ctx}"
    );
    // The guest's kprobe was armed before the splice: the entry was a call, not the nop5.
    let spliced_over = host_result(&out, "bytes.__x64_sys_getpid.spliced_over").unwrap_or("");
    assert!(spliced_over.starts_with("e8"), "{ctx}");
    // The counter in the patch heap saw every call, like the workload and the guest's kprobe.
    assert_eq!(result(&out, "getpid.calls"), Some(CALLS), "{ctx}");
    assert_eq!(result(&out, "kprobe.__do_sys_getpid"), Some(CALLS), "{ctx}");
    assert_eq!(
        host_result(&out, "counter.__x64_sys_getpid"),
        Some(CALLS),
        "{ctx}"
    );
    // Detaching put the exact original bytes back, and the guest powered off cleanly.
    assert_eq!(
        host_result(&out, "bytes.__x64_sys_getpid.restored"),
        Some(spliced_over),
        "{ctx}"
    );
    let attach_ms: f64 = host_result(&out, "attach_ms.median")
        .unwrap()
        .parse()
        .unwrap();
    eprintln!("attach time median of 5: {attach_ms} ms");
    host_result(&out, "slide").unwrap().to_owned()
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

#[test]
fn two_boots_two_slides_each_matching_kallsyms_and_getpid_splice_counts_exactly() {
    if !have_qemu("two_boots_two_slides_each_matching_kallsyms_and_getpid_splice_counts_exactly") {
        return;
    }

    // The first boot places the heap as `exotap` does by default: after `_end`, or before
    // `_text` when a high slide leaves no room below the module area (one boot in 15). The
    // second always puts it before `_text`, so that path is proven live on every run; 16 MiB
    // fit there at any slide (`_text` is at least 0xffffffff81000000).
    let mut slides = vec![
        selftest_boot(&[]),
        selftest_boot(&["--heap-place", "before", "--heap-size", "16"]),
    ];
    // KASLR has ~500 slots: two boots share a slide about once in 500; a third boot settles it.
    if slides[0] == slides[1] {
        slides.push(selftest_boot(&[]));
    }

    slides.sort();
    slides.dedup();
    assert!(
        slides.len() >= 2,
        "KASLR gave the same slide every boot: {slides:?}"
    );
}

#[test]
fn info_on_a_dead_target_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");

    let (code, out, err) = run(exotap()
        .args(["info", "--gdb-timeout", "2", "--target"])
        .arg(format!("unix:{}", socket.display())));

    assert_eq!(code, 125, "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("cannot attach to unix:"), "{err}");
}
