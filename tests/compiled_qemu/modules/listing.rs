//! Listing module points (`-l`, `-L`, `exotap joinpoints --module`): from the live guest's
//! module list, and from a module's debug file without a guest, against the guest's kallsyms,
//! gdb and objdump.

use super::oracles::{
    bufsize_stores_in_evdev_open, evdev_open_lines, gdb_on, gdb_on_evdev, module_debug_file,
    objdump_global_member_sites,
};
use super::*;

#[test]
fn listing_a_modules_functions_reads_the_live_guest_and_agrees_with_its_kallsyms() {
    if !have_qemu("listing_a_modules_functions_reads_the_live_guest_and_agrees_with_its_kallsyms") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = "insmod /modules/evdev.ko\n\
               grep '\\[evdev\\]$' /proc/kallsyms | sed 's/^/KALLSYMS /'\n\
               echo EVDEV-LISTED\n\
               sleep 600\n";
    let initrd = initramfs(dir.path(), job);
    let socket = dir.path().join("gdb.sock");
    let (mut guest, mut console) = common::boot_with_gdbstub(
        &[
            "--timeout".as_ref(),
            "300".as_ref(),
            "--initrd".as_ref(),
            initrd.as_os_str(),
        ],
        &socket,
        "EXOTAP-READY",
    );
    let mut kallsyms = std::collections::BTreeSet::new();
    let mut line = String::new();
    while !line.contains("EVDEV-LISTED") {
        line.clear();
        let n = std::io::BufRead::read_line(&mut console, &mut line).unwrap();
        assert!(n > 0, "the guest ended before listing evdev's symbols");
        // `ADDR t NAME [evdev]`: the module's text symbols the pattern names.
        let mut words = line.split_whitespace().skip(1);
        if let (Some(_), Some(kind), Some(name)) = (words.next(), words.next(), words.next()) {
            if matches!(kind, "t" | "T") && name.starts_with("evdev_") && !name.contains('.') {
                kallsyms.insert(name.to_owned());
            }
        }
    }
    let target = format!("unix:{}", socket.display());
    let (code, out, err) = run(exotap().args([
        "-l",
        r#"module("ev*").function("evdev_*")"#,
        "--target",
        &target,
    ]));
    let (code_vars, out_vars, err_vars) = run(exotap().args([
        "-L",
        r#"module("evdev").function("evdev_read")"#,
        "--target",
        &target,
    ]));
    // Without --target: from evdev's cached debug file; a module without one, an error.
    let (code_file, out_file, err_file) =
        run(exotap().args(["-l", r#"module("evdev").function("evdev_*")"#]));
    let (code_none, _, err_none) =
        run(exotap().args(["-l", r#"module("nosuchmod").function("f")"#]));
    let _ = guest.kill();
    let _ = guest.wait();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nkallsyms: {kallsyms:?}");
    assert_eq!(code, 0, "{ctx}");
    // The functions a listing of evdev's names.
    let functions = |listing: &str| -> std::collections::BTreeSet<String> {
        listing
            .lines()
            .filter_map(|l| {
                l.strip_prefix("module(\"evdev\").function(\"")?
                    .strip_suffix("\")")
                    .map(str::to_owned)
            })
            .collect()
    };
    let listed = functions(&out);
    assert!(kallsyms.len() >= 10, "{ctx}");
    assert_eq!(listed, kallsyms, "{ctx}");
    // `-L`: the parameters, with their types from evdev's BTF, written as a kernel
    // function's are (`evdev_read(struct file *file, char __user *buffer, size_t count,
    // loff_t *ppos)`).
    assert_eq!(code_vars, 0, "{out_vars}\n{err_vars}");
    assert_eq!(
        out_vars.trim(),
        r#"module("evdev").function("evdev_read") $file:struct file * $buffer:char * $count:size_t $ppos:loff_t *"#,
        "{err_vars}"
    );
    // The debug file has every function the live module has, and its init and exit, which
    // the kernel frees or leaves out of a loaded module's kallsyms.
    assert_eq!(code_file, 0, "{err_file}");
    let in_file = functions(&out_file);
    let extra: Vec<&String> = in_file.difference(&listed).collect();
    assert!(
        listed.is_subset(&in_file)
            && extra
                .iter()
                .all(|f| f.ends_with("_init") || f.ends_with("_exit")),
        "from the debug file: {in_file:?}\n{ctx}"
    );
    // Neither a live guest nor a debug file: said, not guessed.
    assert_ne!(code_none, 0, "{err_none}");
    assert!(err_none.contains("give --target"), "{err_none}");
    eprintln!(
        "{} evdev functions listed, as the guest's kallsyms has them",
        listed.len()
    );
}

/// `-l`, `-L` and `exotap joinpoints --module` read a module's points from its cached debug
/// file, no guest: every line gdb gives code in `evdev_open` is listed as a statement (and
/// gdb places each listed line in `evdev_open`: inlined helpers' lines too), `-L`
/// names the function's parameters at each, the member writes `joinpoints` finds in
/// `evdev_open` are gdb's stores to `bufsize`, and a member evdev's types lack is an error
/// that says so, not a listing.
#[test]
#[allow(clippy::panic)] // a fixture that fails fails the test
fn module_points_list_from_the_debug_file_as_gdb_reads_it() {
    let lines = evdev_open_lines();
    let file = lines
        .first()
        .map(|(_, f, _)| f.clone())
        .unwrap_or_else(|| panic!("gdb gave no line of evdev_open"));
    let pattern = format!("module(\"evdev\").statement(\"evdev_open@{file}:*\")");
    let (code, out, err) = run(exotap().args(["-L", &pattern]));
    assert_eq!(code, 0, "{err}");
    let prefix = format!("module(\"evdev\").statement(\"evdev_open@{file}:");
    let listed: Vec<u32> = out
        .lines()
        .map(|l| {
            let (point, vars) = l.split_once(' ').unwrap_or((l, ""));
            assert!(
                vars.contains("$inode:struct inode *") && vars.contains("$file:struct file *"),
                "evdev_open's parameters at {point}: {vars:?}"
            );
            point
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix("\")"))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("not a line of evdev_open: {l}"))
        })
        .collect();
    let with_code: Vec<u32> = lines
        .iter()
        .filter(|(_, _, off)| off.is_some())
        .map(|(n, _, _)| *n)
        .collect();
    assert!(with_code.len() > 5, "{lines:?}");
    for n in &with_code {
        assert!(
            listed.contains(n),
            "line {n} has code (gdb) but is not listed: {out}"
        );
    }
    let others: Vec<String> = listed
        .iter()
        .filter(|n| !with_code.contains(n))
        .map(|n| format!("info line {file}:{n}"))
        .collect();
    // The others: lines of evdev.c's helpers inlined into evdev_open, and lines sharing an
    // address with another; gdb places each in evdev_open.
    if !others.is_empty() {
        let said = gdb_on_evdev(&others);
        let placed = said
            .lines()
            .filter(|l| l.starts_with("Line ") && l.contains("<evdev_open+"))
            .count();
        assert_eq!(
            placed,
            others.len(),
            "listed lines gdb does not place in evdev_open: {others:?}\n{said}"
        );
    }

    let (_, stores) = bufsize_stores_in_evdev_open();
    let (code, out, err) = run(exotap().args([
        "joinpoints",
        "--module",
        "evdev",
        "--function",
        "evdev_open",
        "struct evdev_client.bufsize",
    ]));
    assert_eq!(code, 0, "{err}");
    let found: Vec<u64> = out
        .lines()
        .filter(|l| l.contains(" write "))
        .filter_map(|l| {
            l.strip_prefix("<evdev_open+")?
                .split_once('>')?
                .0
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(found, stores, "{out}");

    // `.inline` by file: the instances of the functions the file declares (DWARF's
    // declaring file; gdb's `info line` gives an instance's first line, often a helper's).
    // evdev's own helpers are declared in evdev.c, `spin_lock` in include/linux/spinlock.h
    // (the kernel's source); the two sets are disjoint, both within the whole module's.
    let inline_functions = |pattern: &str| -> std::collections::BTreeSet<String> {
        let (code, out, err) = run(exotap().args(["-l", pattern]));
        assert_eq!(code, 0, "{pattern}: {err}");
        out.lines()
            .map(|l| {
                l.strip_prefix("module(\"evdev\").function(\"")
                    .and_then(|r| r.strip_suffix("\").inline"))
                    .unwrap_or_else(|| panic!("{pattern} listed {l}"))
                    .to_owned()
            })
            .collect()
    };
    let all = inline_functions(r#"module("evdev").function("*").inline"#);
    let own = inline_functions(r#"module("evdev").function("*@drivers/input/evdev.c").inline"#);
    let headers = inline_functions(r#"module("evdev").function("*@include/linux/*.h").inline"#);
    let evdev_named: std::collections::BTreeSet<String> = all
        .iter()
        .filter(|f| f.starts_with("evdev_"))
        .cloned()
        .collect();
    assert!(
        evdev_named.len() >= 5
            && evdev_named.is_subset(&own)
            && own.is_subset(&all)
            && headers.is_subset(&all)
            && own.is_disjoint(&headers)
            && headers.contains("spin_lock"),
        "evdev.c: {own:?}\ninclude/linux: {headers:?}\nall: {all:?}"
    );

    let point = "module(\"evdev\").field(\"struct evdev_client\", \"bufsize\").write";
    let (code, out, err) = run(exotap().args(["-l", point]));
    assert_eq!((code, out.trim()), (0, point), "{err}");
    let (code, _, err) = run(exotap().args([
        "-l",
        "module(\"evdev\").field(\"struct evdev_client\", \"nosuch\").write",
    ]));
    assert!(
        code != 0 && err.contains("no match") && err.contains("evdev_client.nosuch"),
        "{err}"
    );
}

/// `exotap joinpoints --module kvm 'struct kvm_x86_ops.nested_ops'`: the reads of a member
/// of the module's own global `kvm_x86_ops` (RIP-relative, relocated in the debug file) are
/// the places `objdump -dr` shows reaching the member's bytes through the file's relocations
/// against `kvm_x86_ops`, at the same function and offset.
#[test]
#[allow(clippy::panic)] // a fixture that fails fails the test
fn a_modules_global_member_accesses_are_objdumps_relocated_references() {
    let ko = module_debug_file("kvm.ko");
    let layout = gdb_on(&ko, &["ptype /o struct kvm_x86_ops".to_owned()]);
    let offset = layout
        .lines()
        .find(|l| l.trim_end().ends_with("*nested_ops;"))
        .and_then(|l| l.trim_start().strip_prefix("/*"))
        .and_then(|rest| rest.split('|').next())
        .and_then(|off| off.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("gdb lays out no nested_ops in struct kvm_x86_ops:\n{layout}"));
    let expected = objdump_global_member_sites(&ko, "kvm_x86_ops", offset..offset + 8);
    assert!(expected.len() >= 5, "objdump: {expected:?}");
    let (code, out, err) = run(exotap().args([
        "joinpoints",
        "--module",
        "kvm",
        "struct kvm_x86_ops.nested_ops",
    ]));
    assert_eq!(code, 0, "{err}");
    let found: std::collections::BTreeSet<(String, u64)> = out
        .lines()
        .filter_map(|l| {
            let (function, rest) = l.strip_prefix('<')?.split_once('>')?;
            let (name, off) = function.rsplit_once('+')?;
            rest.contains("kvm_x86_ops.nested_ops")
                .then(|| Some((name.to_owned(), off.parse().ok()?)))?
        })
        .collect();
    assert_eq!(found, expected, "{out}");
}
