//! exotap's debug info against gdb on the Debian `-dbg` vmlinux: `info line` of 50 sampled
//! functions and `ptype /o` of 20 structs must be gdb's, byte for byte; the CLI answers the
//! bench queries (`lines vfs_read`, `ptype struct file`) as gdb does.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;

use exotap_guest_images as images;
use exotap_introspect::btf::cdecl;
use exotap_introspect::dwarf::index::Layer;
use exotap_introspect::dwarf::{DebugFile, DebugInfo, EntryKind, Index};

/// The structs whose layouts are compared.
const STRUCTS: [&str; 20] = [
    "file",
    "inode",
    "dentry",
    "super_block",
    "task_struct",
    "mm_struct",
    "vm_area_struct",
    "sk_buff",
    "sock",
    "socket",
    "net_device",
    "page",
    "list_head",
    "path",
    "cred",
    "file_operations",
    "kiocb",
    "iov_iter",
    "address_space",
    "pid",
];

/// How many functions are sampled.
const FUNCTIONS: usize = 50;

const SEPARATOR: &str = "==exotap-separator==";

fn debug_vmlinux() -> Option<PathBuf> {
    let path = images::cache::cache_root()
        .ok()?
        .join("kernels")
        .join(images::DEFAULT_KERNEL)
        .join("debug/vmlinux");
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "SKIP: {} is absent (run `exotap image fetch --debuginfo`)",
            path.display()
        );
        None
    }
}

/// Whether gdb is installed (printing the skip when not); panics when it is there but cannot
/// run or fails, which is a failure, not a missing tool.
fn have_gdb() -> bool {
    let out = match Command::new("gdb").arg("--version").output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("SKIP: gdb is not installed (ci/install-deps.sh installs it)");
            return false;
        }
        other => other.expect("cannot run gdb --version"),
    };
    assert!(
        out.status.success(),
        "gdb --version failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    true
}

/// Functions gdb and exotap must resolve to the same code: one definition, one ELF symbol at
/// its entry, never inlined (an inlined function gives gdb several answers). Spread evenly
/// over the sorted names.
fn sample_functions(index: &Index, info: &DebugInfo<'_>) -> Vec<(String, u64)> {
    let mut counts: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut inlined: HashSet<&str> = HashSet::new();
    for e in index.iter() {
        match e.kind {
            EntryKind::Function => *counts.entry(e.name).or_default() += 1,
            EntryKind::Abstract => {
                inlined.insert(e.name);
            }
            _ => {}
        }
    }
    let candidates: Vec<(String, u64)> = index
        .iter()
        .filter(|e| e.kind == EntryKind::Function && counts.get(e.name) == Some(&1))
        .filter(|e| {
            !inlined.contains(e.name)
                && e.name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
        .filter(|e| {
            let syms = info.symbols().by_name(e.name);
            syms.len() == 1 && syms[0].addr == e.low
        })
        .map(|e| (e.name.to_owned(), e.low))
        .collect();
    let step = (candidates.len() / FUNCTIONS).max(1);
    candidates
        .into_iter()
        .step_by(step)
        .take(FUNCTIONS)
        .collect()
}

/// Runs gdb once with every command, returning each command's output.
fn gdb(vmlinux: &PathBuf, commands: &[String]) -> Vec<String> {
    let mut cmd = Command::new("gdb");
    cmd.args(["-nx", "-batch"]);
    for c in commands {
        cmd.arg("-ex")
            .arg(c)
            .arg("-ex")
            .arg(format!("echo {SEPARATOR}\\n"));
    }
    let out = cmd.arg(vmlinux).output().expect("cannot run gdb");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split(&format!("{SEPARATOR}\n"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn info_line_of_sampled_functions_and_struct_layouts_equal_gdbs() {
    let Some(vmlinux) = debug_vmlinux() else {
        return;
    };
    if !have_gdb() {
        return;
    }
    let file = DebugFile::open(&vmlinux).unwrap();
    let info = file.load().unwrap();
    let cache = images::cache::cache_root().unwrap().join("debuginfo");
    let index = Index::load_or_build(&info, &cache, Layer::Names, &|_, _| {}).unwrap();
    let functions = sample_functions(&index, &info);
    assert_eq!(functions.len(), FUNCTIONS);
    let mut commands: Vec<String> = functions
        .iter()
        .map(|(f, _)| format!("info line {f}"))
        .collect();
    commands.extend(STRUCTS.iter().map(|s| format!("ptype /o struct {s}")));

    let ours_lines: Vec<String> = functions
        .iter()
        .map(|(_, entry)| format!("{}\n", info.info_line(*entry).unwrap()))
        .collect();
    let ours_types: Vec<String> = STRUCTS
        .iter()
        .map(|s| {
            cdecl::ptype(
                &info,
                info.find_type(&index, &format!("struct {s}")).unwrap(),
                true,
            )
        })
        .collect();
    let theirs = gdb(&vmlinux, &commands);

    let mut differ = Vec::new();
    for (i, (ours, (name, _))) in ours_lines.iter().zip(&functions).enumerate() {
        if theirs.get(i) != Some(ours) {
            differ.push(format!(
                "info line {name}:\n  exotap: {ours}  gdb:    {:?}",
                theirs.get(i)
            ));
        }
    }
    for (i, (ours, name)) in ours_types.iter().zip(STRUCTS).enumerate() {
        let theirs = theirs
            .get(FUNCTIONS + i)
            .map(String::as_str)
            .unwrap_or_default();
        if theirs != ours {
            let first = ours.lines().zip(theirs.lines()).find(|(a, b)| a != b);
            differ.push(format!(
                "ptype /o struct {name}: first differing line {first:?}"
            ));
        }
    }
    println!(
        "gdb comparison: {}/{FUNCTIONS} info line answers and {}/{} ptype /o layouts equal",
        FUNCTIONS - differ.iter().filter(|d| d.starts_with("info")).count(),
        STRUCTS.len() - differ.iter().filter(|d| d.starts_with("ptype")).count(),
        STRUCTS.len()
    );
    assert!(
        differ.is_empty(),
        "exotap differs from gdb:\n{}",
        differ.join("\n")
    );
}

#[test]
fn cli_answers_the_bench_queries_as_gdb_does() {
    let Some(vmlinux) = debug_vmlinux() else {
        return;
    };
    if !have_gdb() {
        return;
    }
    let file = DebugFile::open(&vmlinux).unwrap();
    let inside = file.load().unwrap().symbols().by_name("vfs_read")[0].addr + 5;
    let commands = [
        "info line vfs_read".to_owned(),
        "ptype struct file".to_owned(),
        format!("info line *{inside:#x}"),
    ];
    let theirs = gdb(&vmlinux, &commands);

    let (rc1, lines, err1) = common::run(common::exotap().args(["lines", "--brief", "vfs_read"]));
    let (rc2, ptype, err2) = common::run(common::exotap().args(["ptype", "struct file"]));
    let (rc3, line_of, err3) =
        common::run(common::exotap().args(["where", &format!("{inside:#x}")]));

    assert_eq!((rc1, rc2, rc3), (0, 0, 0), "{err1}{err2}{err3}");
    assert_eq!(Some(&lines), theirs.first());
    assert_eq!(Some(&ptype), theirs.get(1));
    // gdb: `Line 451 of "fs/read_write.c" starts at address 0x... <vfs_read+5> and ends at
    // 0x... <...>.`; exotap: `fs/read_write.c:451 0x... <vfs_read+5> (line's code S..E)`.
    let gdb_line = theirs.get(2).unwrap();
    let words: Vec<&str> = gdb_line.split_whitespace().collect();
    let (line, path) = (words[1], words[3].trim_matches('"'));
    let (start, end) = (words[7], words[12]);
    assert_eq!(
        line_of.trim(),
        format!("{path}:{line} {inside:#x} <vfs_read+5> (line's code {start}..{end})"),
        "gdb: {gdb_line}"
    );
}

/// Without a cached -dbg vmlinux, `ptype` and `vars` answer from the kernel image's BTF, say so
/// on stderr, and agree with the DWARF answers.
#[test]
fn ptype_and_vars_fall_back_to_btf_without_the_dbg_vmlinux_and_agree_with_dwarf() {
    let Some(vmlinux) = debug_vmlinux() else {
        return;
    };
    // A cache holding the kernel (linked to the real one) but no debug/ directory.
    let kernel_dir = vmlinux.parent().unwrap().parent().unwrap().to_owned();
    let xdg = tempfile::tempdir().unwrap();
    let bare = xdg
        .path()
        .join("exotap/kernels")
        .join(images::DEFAULT_KERNEL);
    std::fs::create_dir_all(&bare).unwrap();
    for entry in std::fs::read_dir(&kernel_dir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "debug" {
            std::os::unix::fs::symlink(entry.path(), bare.join(entry.file_name())).unwrap();
        }
    }
    let bare_cache = |args: &[&str]| {
        common::run(
            common::exotap()
                .args(args)
                .env("XDG_CACHE_HOME", xdg.path()),
        )
    };

    let (rc_btf, btf_ptype, err_btf) = bare_cache(&["ptype", "-o", "struct file"]);
    let (rc_dwarf, dwarf_ptype, err_dwarf) = common::run(common::exotap().args([
        "ptype",
        "-o",
        "struct file",
        "--vmlinux",
        vmlinux.to_str().unwrap(),
    ]));
    let (rc_vars, btf_vars, err_vars) = bare_cache(&["vars", "vfs_read"]);
    let (_, dwarf_vars, _) = common::run(common::exotap().args([
        "vars",
        "vfs_read",
        "--vmlinux",
        vmlinux.to_str().unwrap(),
    ]));

    assert_eq!(
        (rc_btf, rc_dwarf, rc_vars),
        (0, 0, 0),
        "{err_btf}{err_dwarf}{err_vars}"
    );
    assert!(
        err_btf.contains("BTF") && err_vars.contains("BTF"),
        "{err_btf}"
    );
    assert!(!xdg
        .path()
        .join("exotap/kernels")
        .join(images::DEFAULT_KERNEL)
        .join("debug")
        .exists());
    assert_eq!(btf_ptype, dwarf_ptype);
    // The parameters, in order, with their entry registers: the DWARF lines that BTF can know.
    let params = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("  param "))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(params(&btf_vars), params(&dwarf_vars));
    assert_eq!(params(&btf_vars).len(), 4);
}

/// Every nfsd.* point of the tapset, each local it defines read, planned as `run --compile
/// require` plans a script before it attaches: each variable checked in the nfsd module's
/// DWARF at every function, each probe compiled with its BTF types (`svc_rqst`,
/// `nfsd3_*args`, `svc_fh` through the autocast `fh`). The attach then fails (no guest), and
/// that is the only error.
#[test]
fn the_nfsd_tapset_plans_against_the_nfsd_modules_debug_info() {
    let Some(vmlinux) = debug_vmlinux() else {
        return;
    };
    let nfsd = vmlinux.with_file_name("modules").join("nfsd.ko");
    assert!(
        nfsd.is_file(),
        "{} is absent: `exotap image fetch --debuginfo` keeps it with the vmlinux",
        nfsd.display()
    );
    let plan = |script: &str| {
        let out = common::exotap()
            .args(["run", "--compile", "require"])
            .args([
                "--target",
                "unix:/nonexistent/exotap-test.sock",
                "-e",
                script,
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let script = r#"global n, b
        probe nfsd.proc.entries {
            filename .= "" // not every procedure names a file, as in SystemTap's
            n[client_ip, name, argstr, filename] <<< version
            if (fh) n[d_name(fh->fh_dentry), "", "", ""] <<< fh->fh_export->ex_path->mnt
        }
        probe nfsd.proc.read, nfsd.proc.write, nfsd.proc.commit { b[name] <<< size + offset + count }
        probe nfsd.proc.create { b[name] <<< createmode + filelen }
        probe nfsd.proc.rename { b[tname] <<< tlen }
        probe nfsd.proc.compound { b[name] <<< num }
        probe nfsd.entries { n[client_ip, name, argstr, ""] <<< 1 }
        probe nfsd.lookup, nfsd.create, nfsd.unlink, nfsd.rename {
            b[filename] <<< filelen + (fh->fh_dentry != 0)
        }
        probe nfsd.read, nfsd.write { b[name] <<< size + vlen }
        probe nfsd.dispatch { b[name] <<< proc + version }
        probe nfsd.unlink.return { b[retstr] <<< addr_from_rqst(@entry($rqstp)) }"#;
    let err = plan(script);
    assert!(
        err.contains("cannot attach to unix:/nonexistent/exotap-test.sock"),
        "the plan failed before the attach:\n{err}"
    );
    // A variable no nfsd procedure has: named at each function, before anything attaches.
    let err = plan(r#"probe module("nfsd").function("nfsd3_proc_re*") { x = $nosuch }"#);
    for f in ["nfsd3_proc_read", "nfsd3_proc_remove", "nfsd3_proc_rename"] {
        assert!(
            err.contains(&format!("function(\"{f}\"): no variable $nosuch in scope")),
            "{f}:\n{err}"
        );
    }
    assert!(!err.contains("cannot attach"), "{err}");
}
