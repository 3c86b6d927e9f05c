//! Embeds `workloads/*.c` so the exotap binary can build its guest programs from any directory.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    // The manifest directory of this build, not of the one that compiled the script: a
    // target directory shared between worktrees reuses the compiled script.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".to_owned());
    let dir = Path::new(&manifest).join("workloads");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut sources: Vec<_> = std::fs::read_dir(&dir)
        .map(|it| it.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    sources.retain(|p| p.extension().is_some_and(|e| e == "c"));
    sources.sort();
    let mut code = String::from(
        "/// Workload programs: (name, C source).\npub const SOURCES: &[(&str, &str)] = &[\n",
    );
    for path in &sources {
        println!("cargo:rerun-if-changed={}", path.display());
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let _ = writeln!(
            code,
            "    ({name:?}, include_str!({:?})),",
            path.display().to_string()
        );
    }
    code.push_str("];\n");
    let out = Path::new(&std::env::var("OUT_DIR").unwrap_or_default()).join("workloads.rs");
    if let Err(e) = std::fs::write(&out, code) {
        println!("cargo:warning=cannot write {}: {e}", out.display());
    }
}
