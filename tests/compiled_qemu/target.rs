//! `run --target` into a guest someone else booted, and pretty-printed targets.

use super::*;

#[test]
fn run_with_target_compiles_into_a_guest_someone_else_booted_and_leaves_it_running() {
    if !have_qemu("run_with_target_compiles_into_a_guest_someone_else_booted_and_leaves_it_running")
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("gdb.sock");
    // The guest sleeps long enough after EXOTAP-READY for exotap to attach, runs the loop,
    // and is still running when the script's timer ends it.
    let (mut guest, mut console) = common::boot_with_gdbstub(
        &[
            "--timeout",
            "300",
            "--run",
            "sleep 8; syscall-loop 100; sleep 12; syscall-loop 10",
        ],
        &socket,
        "EXOTAP-READY",
    );

    let (code, out, err) = run(exotap()
        .args(["run", "--compile", "require", "--target"])
        .arg(format!("unix:{}", socket.display()))
        .args([
            "-e",
            r#"global n; probe kernel.syscall("getppid") { if (execname() == "syscall-loop") n++ }
               probe timer.s(14) { exit() }
               probe end { printf("n=%d\n", n) }"#,
        ]));

    let mut rest = String::new();
    std::io::Read::read_to_string(&mut console, &mut rest).unwrap();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nconsole:\n{rest}");
    assert!(guest.wait().unwrap().success(), "{ctx}");
    assert_eq!(code, 0, "{ctx}");
    assert!(out.contains("n=100\n"), "{ctx}");
    assert!(
        rest.contains("EXOTAP-DONE 0"),
        "the guest ran on to its end: {ctx}"
    );
    assert_no_oops(&rest);
}

/// SystemTap's pretty-printed target variables and `&` of members on the host path, at the
/// first `vfs_read` of syscall-loop's 18-byte file (pread of 64 bytes at offset 0).
const PRETTY: &str = r#"global n
  probe kernel.function("vfs_read") {
    if (execname() != "syscall-loop" || n++ > 0) next
    printf("PARMS %s\n", $$parms$)
    printf("FILE %s\n", $file$$)
    printf("CHAIN %d %d\n", $file->f_inode->i_size, $file->f_path->dentry->d_name->len)
    printf("ADDR %d %d\n", &$file->f_pos - $file, &@cast($file, "struct file")->f_path->dentry - $file)
  }
  probe kernel.function("vfs_read").return {
    if (execname() == "syscall-loop" && n == 1) { printf("RET %s\n", $$return); n++ }
  }"#;

#[test]
fn pretty_printed_targets_and_member_addresses_show_what_the_workload_read() {
    if !have_qemu("pretty_printed_targets_and_member_addresses_show_what_the_workload_read") {
        return;
    }
    let (code, out, err, con) = boot(PRETTY, "never", "syscall-loop 2");
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let line = |tag: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(tag))
            .unwrap_or_else(|| panic!("no {tag} line: {ctx}"))
            .to_owned()
    };
    // The parameters: the file struct followed one level, the 64-byte count in decimal.
    let parms = line("PARMS ");
    assert!(parms.starts_with("file={"), "{parms}");
    assert!(parms.contains(".f_path={...}"), "{parms}");
    assert!(parms.contains(" count=64 "), "{parms}");
    // $file$$ expands nested structs: its path's members are the ones the chains read.
    let file = line("FILE ");
    assert!(file.contains(".f_path={.mnt=0x"), "{file}");
    let chain = line("CHAIN ");
    assert_eq!(chain, "18 18", "{ctx}");
    // Member addresses: the offsets the kernel's BTF gives (an outside layout: the -dbg
    // vmlinux's DWARF agrees, tests/debuginfo.rs).
    let dir =
        exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL).unwrap();
    let image = exotap_probes::live::kernel_image::KernelImage::load(dir.join("vmlinuz")).unwrap();
    let btf = exotap_introspect::btf::Btf::from_elf(image.vmlinux.bytes()).unwrap();
    let file_ty = btf.struct_by_name("file").unwrap();
    let off = |m: &str| btf.member(file_ty, m).unwrap().byte_offset().unwrap();
    assert_eq!(
        line("ADDR "),
        format!("{} {}", off("f_pos"), off("f_path") + 8),
        "{ctx}"
    );
    // The return value: the 18 bytes read.
    assert_eq!(line("RET "), "return=0x12", "{ctx}");
    assert_no_oops(&con);
}

/// SystemTap's autocast: a local copied from `$file` keeps `struct file *` for `->` (and `&`
/// of a member), compiled. The workload reads its 18-byte file 100 times (`pread`).
#[test]
fn a_local_copied_from_a_target_variable_keeps_its_type() {
    if !have_qemu("a_local_copied_from_a_target_variable_keeps_its_type") {
        return;
    }
    let script = r#"global sizes, differ
        probe kernel.function("vfs_read") {
            if (execname() != "syscall-loop") next
            f = $file
            sizes[f->f_inode->i_size]++
            if (&f->f_pos != &$file->f_pos || f->f_path->dentry != $file->f_path->dentry) differ++
        }
        probe end {
            foreach (s in sizes) printf("size %d %d\n", s, sizes[s])
            printf("differ %d\n", differ)
        }"#;
    let (code, out, err) = run(exotap()
        .args(["boot", "--timeout", "300", "--compile", "require"])
        .args(["--run", "syscall-loop 100 pread"])
        .args(["--script-text", script]));
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 0, "{ctx}");
    let sizes: Vec<&str> = out.lines().filter(|l| l.starts_with("size ")).collect();
    assert_eq!(sizes, ["size 18 100"], "{ctx}");
    assert!(out.contains("differ 0\n"), "{ctx}");
    assert_eq!(
        host_result(&err, "pauses.between_install_and_removal"),
        Some("0"),
        "{ctx}"
    );
}
