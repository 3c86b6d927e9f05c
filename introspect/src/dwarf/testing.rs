//! Test fixtures: C programs of `guest-images/testprogs` built with `gcc -g -O2`, and the
//! Debian `-dbg` vmlinux when it is cached. Both print `SKIP: reason` when unavailable.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The directory holding the C sources.
pub(crate) fn testprogs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-images/testprogs")
}

/// Builds `testprogs/<name>.c` into `target/testprogs/<name>` (once per process, reused
/// while newer than its source) with `gcc -g -O2 <extra>`; `None` after printing why not.
pub(crate) fn fixture(name: &str, extra: &[&str]) -> Option<PathBuf> {
    static BUILT: OnceLock<Mutex<()>> = OnceLock::new();
    let _one_at_a_time = BUILT.get_or_init(|| Mutex::new(())).lock().ok()?;
    let source = testprogs_dir().join(format!("{name}.c"));
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/testprogs");
    let out = out_dir.join(name);
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    if modified(&out).is_some() && modified(&out) >= modified(&source) {
        return Some(out);
    }
    if Command::new("gcc").arg("--version").output().is_err() {
        println!("SKIP: gcc is not installed; cannot build the {name} fixture");
        return None;
    }
    std::fs::create_dir_all(&out_dir).ok()?;
    let tmp = out_dir.join(format!(".{name}.{}", std::process::id()));
    let status = Command::new("gcc")
        .args(["-g", "-O2"])
        .args(extra)
        .arg("-o")
        .arg(&tmp)
        .arg(&source)
        .status()
        .ok()?;
    assert!(status.success(), "gcc failed on {}", source.display());
    std::fs::rename(&tmp, &out).ok()?;
    Some(out)
}

/// The DWARF fixture (`testprogs/dwarf_fixture.c`) mapped, or `None` after printing why not.
pub(crate) fn fixture_file() -> Option<super::DebugFile> {
    let path = fixture("dwarf_fixture", &[])?;
    Some(super::DebugFile::open(&path).unwrap())
}

/// The names index of `info`, built in memory.
pub(crate) fn names(info: &super::DebugInfo<'_>) -> super::Index {
    super::Index::build(info, super::index::Layer::Names, &|_, _| {}).unwrap()
}

/// Whether gdb is installed (prints why a comparison is skipped when not).
pub(crate) fn have_gdb() -> bool {
    let ok = Command::new("gdb")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        println!("SKIP: gdb is not installed; the comparison with gdb is skipped");
    }
    ok
}

/// gdb's output for `commands` on `path`, one string per command.
pub(crate) fn gdb_batch(path: &Path, commands: &[&str]) -> Vec<String> {
    let mut cmd = Command::new("gdb");
    cmd.args(["-nx", "-batch"]);
    for c in commands {
        cmd.arg("-ex").arg(c).arg("-ex").arg("echo ==sep==\\n");
    }
    let out = cmd.arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split("==sep==\n")
        .map(str::to_owned)
        .collect()
}
