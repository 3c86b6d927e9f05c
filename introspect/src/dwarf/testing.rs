//! Test fixtures: C programs of `guest-images/testprogs` built with `gcc -g -O2`, and gdb
//! to compare with. A helper prints `SKIP: reason` and returns `None`/`false` only when the
//! tool is not installed; any other failure (gcc or gdb ran and failed, an unreadable source,
//! a directory that cannot be made) panics, so that it fails the test instead of skipping it.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock, PoisonError};

/// The directory holding the C sources.
pub(crate) fn testprogs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-images/testprogs")
}

/// Whether `program --version` runs: `Ok(false)` when the program is not installed; `Err`
/// when it cannot be run for another reason, or runs and fails.
fn installed(program: &str) -> Result<bool, String> {
    match Command::new(program).arg("--version").output() {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(format!("cannot run {program} --version: {e}")),
        Ok(out) if !out.status.success() => Err(format!(
            "{program} --version failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(_) => Ok(true),
    }
}

/// Builds `testprogs/<name>.c` into `target/testprogs/<name>` (once per process, reused
/// while newer than its source) with `gcc -g -O2 <extra>`; `None` after printing why not
/// (gcc is not installed).
///
/// # Panics
/// On any other failure (see [`try_fixture`]): the test fails, it does not skip.
pub(crate) fn fixture(name: &str, extra: &[&str]) -> Option<PathBuf> {
    try_fixture(name, extra).unwrap_or_else(|why| panic!("{why}"))
}

/// [`fixture`], with its failures (an unreadable source, gcc that cannot run or fails, a
/// directory or file that cannot be made) as `Err`.
fn try_fixture(name: &str, extra: &[&str]) -> Result<Option<PathBuf>, String> {
    static BUILT: OnceLock<Mutex<()>> = OnceLock::new();
    // The lock guards no data, only the build: a test that panicked while holding it leaves
    // nothing half-done that the next build trusts (the output is renamed into place whole).
    let _one_at_a_time = BUILT
        .get_or_init(|| Mutex::new(()))
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let source = testprogs_dir().join(format!("{name}.c"));
    let out_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/testprogs");
    let out = out_dir.join(name);
    let source_time = std::fs::metadata(&source)
        .and_then(|m| m.modified())
        .map_err(|e| format!("cannot read the fixture source {}: {e}", source.display()))?;
    match std::fs::metadata(&out).and_then(|m| m.modified()) {
        Ok(built) if built >= source_time => return Ok(Some(out)),
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => {
            return Err(format!(
                "cannot read the built fixture {}: {e}",
                out.display()
            ))
        }
    }
    if !installed("gcc")? {
        println!("SKIP: gcc is not installed; cannot build the {name} fixture");
        return Ok(None);
    }
    std::fs::create_dir_all(&out_dir)
        .map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let tmp = out_dir.join(format!(".{name}.{}", std::process::id()));
    let built = Command::new("gcc")
        .args(["-g", "-O2"])
        .args(extra)
        .arg("-o")
        .arg(&tmp)
        .arg(&source)
        .output()
        .map_err(|e| format!("cannot run gcc on {}: {e}", source.display()))?;
    if !built.status.success() {
        return Err(format!(
            "gcc -g -O2 {} failed on {} ({}):\n{}",
            extra.join(" "),
            source.display(),
            built.status,
            String::from_utf8_lossy(&built.stderr).trim()
        ));
    }
    std::fs::rename(&tmp, &out).map_err(|e| {
        format!(
            "cannot move the built fixture {} to {}: {e}",
            tmp.display(),
            out.display()
        )
    })?;
    Ok(Some(out))
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

/// Whether gdb is installed (prints why a comparison is skipped when not); panics when gdb
/// is there but cannot run.
pub(crate) fn have_gdb() -> bool {
    let ok = installed("gdb").unwrap_or_else(|why| panic!("{why}"));
    if !ok {
        println!("SKIP: gdb is not installed; the comparison with gdb is skipped");
    }
    ok
}

/// gdb's output for `commands` on `path`, one string per command; panics when gdb fails.
pub(crate) fn gdb_batch(path: &Path, commands: &[&str]) -> Vec<String> {
    let mut cmd = Command::new("gdb");
    cmd.args(["-nx", "-batch"]);
    for c in commands {
        cmd.arg("-ex").arg(c).arg("-ex").arg("echo ==sep==\\n");
    }
    let out = cmd
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run gdb on {}: {e}", path.display()));
    assert!(
        out.status.success(),
        "gdb -batch on {} failed ({}):\n{}",
        path.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    String::from_utf8_lossy(&out.stdout)
        .split("==sep==\n")
        .map(str::to_owned)
        .collect()
}

/// A fixture that cannot be built is an error (which `fixture` panics with), not a `SKIP`.
#[test]
fn a_fixture_without_its_source_is_an_error_not_a_skip() {
    let missing = try_fixture("exotap_no_such_fixture", &[]);

    assert!(
        missing
            .as_ref()
            .is_err_and(|why| why.starts_with("cannot read the fixture source")),
        "{missing:?}"
    );
}
