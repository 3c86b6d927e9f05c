//! Statement and source-line probes, and DWARF locals at them.

use super::*;

/// The cached kernel in `dir`: `None` when its `vmlinuz` is absent (not cached); panics when
/// it is there and does not load (a broken cache fails the test; it does not skip it).
#[allow(clippy::panic)] // that panic is the point
fn load_cached(dir: &std::path::Path) -> Option<exotap_probes::live::kernel_image::KernelImage> {
    let path = dir.join("vmlinuz");
    if !path.exists() {
        return None;
    }
    match exotap_probes::live::kernel_image::KernelImage::load(path.clone()) {
        Ok(image) => Some(image),
        Err(e) => panic!("the cached kernel {} does not load: {e:#}", path.display()),
    }
}

/// Offsets into the cached kernel's `vfs_read` of two instructions of its entry block (run
/// at every call): the first of at least 5 bytes (a splice fits) and the first shorter one
/// (none fits), past the ftrace site at +0. `None` when the kernel is not cached; panics when
/// the entry block lacks one kind (then the test would check nothing).
fn vfs_read_prologue_offsets() -> Option<(u64, u64)> {
    use iced_x86::{Decoder, DecoderOptions, FlowControl};
    let dir = exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)?;
    // Not cached: None (the caller skips); cached but broken: a failure, not a skip.
    let image = load_cached(&dir)?;
    let start = image.address("vfs_read").unwrap();
    let code = image.vmlinux.read_at(start, 128).unwrap();
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    let (mut long, mut short) = (None, None);
    // +0 is the ftrace site (`call __fentry__` in the file, a nop once booted).
    for insn in decoder.iter().skip(1) {
        if insn.flow_control() != FlowControl::Next || insn.is_invalid() {
            break;
        }
        let offset = insn.ip() - start;
        if insn.len() >= 5 {
            long.get_or_insert(offset);
        } else {
            short.get_or_insert(offset);
        }
    }
    let found = long.zip(short);
    assert!(
        found.is_some(),
        "vfs_read's entry block has no instruction of each kind (>= 5 bytes: {long:?}, \
         shorter: {short:?})"
    );
    found
}

#[test]
fn statement_probes_compile_at_a_splice_or_behind_a_breakpoint_and_count_as_the_host_path() {
    if !have_qemu(
        "statement_probes_compile_at_a_splice_or_behind_a_breakpoint_and_count_as_the_host_path",
    ) {
        return;
    }
    let Some((long, short)) = vfs_read_prologue_offsets() else {
        eprintln!("SKIP: the Debian kernel is not cached (exotap image fetch)");
        return;
    };
    let script = format!(
        r#"global n, m
  probe kernel.statement("vfs_read+{long:#x}") {{ if (execname() == "syscall-loop") n++ }}
  probe kernel.statement("vfs_read+{short:#x}") {{ if (execname() == "syscall-loop") m++ }}
  probe end {{ printf("n=%d m=%d\n", n, m) }}"#
    );

    let (code_c, out_c, err_c, con_c) = boot(&script, "require", "syscall-loop 60");
    let (code_h, out_h, err_h, _) = boot(&script, "never", "syscall-loop 60");

    let ctx = format!("script:\n{script}\ncompiled stderr:\n{err_c}\nhost stderr:\n{err_h}");
    assert_eq!((code_c, code_h), (0, 0), "{ctx}");
    // The short one is entered from a breakpoint, the long one spliced (not listed).
    let entered = err_c
        .split("a breakpoint enters their compiled body")
        .nth(1)
        .unwrap_or_default();
    assert!(
        entered.contains(&format!("vfs_read+{short:#x}\"): the instruction there is"))
            && !entered.contains(&format!("vfs_read+{long:#x}\")")),
        "{ctx}"
    );
    // The workload's own count: syscall-loop preads 60 times, each one vfs_read.
    assert_eq!(result(&con_c, "pread.calls"), Some("60"), "{ctx}");
    assert_eq!(script_output(&out_c), "n=60 m=60\n", "{ctx}");
    assert_eq!(script_output(&out_c), script_output(&out_h), "{ctx}");
    assert_no_oops(&con_c);
    eprintln!("vfs_read+{long:#x} spliced, vfs_read+{short:#x} behind a breakpoint: n=60 m=60");
}

/// Source-line probes (resolved with the cached -dbg vmlinux) run through the statement path:
/// fs/read_write.c 456 (`if (!(file->f_mode & FMODE_CAN_READ))`, a 5-byte `test`: spliced)
/// and 461 (the `rw_verify_area` call's setup, a 3-byte `mov`: behind a breakpoint) run once
/// per `vfs_read`, as does the entry `vfs_read@fs/read_write.c`. Oracle: the workload's own
/// pread count.
#[test]
fn source_line_probes_count_what_the_workload_calls() {
    if !have_qemu("source_line_probes_count_what_the_workload_calls") {
        return;
    }
    let Some(dir) =
        exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)
    else {
        eprintln!("SKIP: the Debian kernel is not cached");
        return;
    };
    if !dir.join("debug/vmlinux").is_file() {
        eprintln!("SKIP: no cached -dbg vmlinux (exotap image fetch --debuginfo)");
        return;
    }
    let script = r#"global n, m, e
  probe kernel.statement("vfs_read@fs/read_write.c:456") { if (execname() == "syscall-loop") n++ }
  probe kernel.statement("*@fs/read_write.c:461") { if (execname() == "syscall-loop") m++ }
  probe kernel.function("vfs_read@fs/read_write.c") { if (execname() == "syscall-loop") e++ }
  probe end { printf("n=%d m=%d e=%d\n", n, m, e) }"#;

    let (code, out, err, con) = boot(script, "require", "syscall-loop 40");

    let ctx = format!("stderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(result(&con, "pread.calls"), Some("40"), "{ctx}");
    assert_eq!(script_output(&out), "n=40 m=40 e=40\n", "{ctx}");
    assert_no_oops(&con);
    eprintln!("{err}pread.calls=40, script: {}", script_output(&out));
}

/// Whether the cached Debian kernel is the build whose `vfs_read` offsets the locals test
/// names (`+0xf1`: `testl $0x4004000,0x44(%rbp)` after a read returned > 0; `+0x1b6`: `test
/// %r15,%r15` in the inlined `new_sync_read`), with its -dbg vmlinux cached.
fn vfs_read_locals_build() -> bool {
    let Some(dir) =
        exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)
    else {
        return false;
    };
    if !dir.join("debug/vmlinux").is_file() {
        return false;
    }
    let Some(image) = load_cached(&dir) else {
        return false;
    };
    let start = image.address("vfs_read").unwrap();
    let at = |off: u64, len: usize| image.vmlinux.read_at(start + off, len).ok();
    at(0xf1, 7) == Some(&[0xf7, 0x45, 0x44, 0x00, 0x40, 0x00, 0x04][..])
        && at(0x1b6, 3) == Some(&[0x4d, 0x85, 0xff][..])
}

#[test]
fn dwarf_locals_at_statement_probes_read_what_the_workload_determines() {
    if !have_qemu("dwarf_locals_at_statement_probes_read_what_the_workload_determines") {
        return;
    }
    if !vfs_read_locals_build() {
        eprintln!(
            "SKIP: needs the cached Debian kernel these vfs_read offsets are for and its -dbg \
             vmlinux (exotap image fetch --debuginfo)"
        );
        return;
    }
    // Oracles: syscall-loop's preads of its 18-byte file into a 64-byte buffer at offset 0:
    // `ret` (a local in rbx) is 18, `count` (a parameter the function saved in a stack slot
    // at the CFA - 160) is 64, the file's own position stays 0 (`$file`, in rbp there, is a
    // local pointer whose member chain is laid out from BTF), each once per pread; and the
    // host-evaluated path, reading the same places from the stopped vCPU.
    let script = r#"global n, m
      probe kernel.statement("vfs_read+0xf1") {
        if (execname() == "syscall-loop") { n++; if ($ret != 18 || $file->f_pos != 0) printf("ret=%d f_pos=%d\n", $ret, $file->f_pos) }
      }
      probe kernel.statement("vfs_read+0x1b6") {
        if (execname() == "syscall-loop") { m++; if ($count != 64) printf("count=%d\n", $count) }
      }
      probe end { printf("n=%d m=%d\n", n, m) }"#;

    let (code_c, out_c, err_c, con_c) = boot(script, "require", "syscall-loop 30");
    let (code_h, out_h, err_h, _) = boot(script, "never", "syscall-loop 30");

    let ctx = format!("compiled stderr:\n{err_c}\nhost stderr:\n{err_h}");
    assert_eq!((code_c, code_h), (0, 0), "{ctx}");
    assert_eq!(result(&con_c, "pread.calls"), Some("30"), "{ctx}");
    assert_eq!(script_output(&out_c), "n=30 m=30\n", "{ctx}");
    assert_eq!(script_output(&out_c), script_output(&out_h), "{ctx}");
    assert_no_oops(&con_c);
}

#[test]
fn a_local_optimized_out_at_the_probe_address_stops_the_script_naming_it() {
    if !have_qemu("a_local_optimized_out_at_the_probe_address_stops_the_script_naming_it") {
        return;
    }
    if !vfs_read_locals_build() {
        eprintln!("SKIP: needs the cached Debian kernel these vfs_read offsets are for and its -dbg vmlinux");
        return;
    }
    let script = r#"probe kernel.statement("vfs_read+0x1b6") { println($ret) }"#;

    let (code, _, err, _) = boot(script, "auto", "true");

    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("vfs_read+0x1b6\"): $ret is optimized out at"),
        "{err}"
    );
}
