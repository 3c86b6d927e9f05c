//! Mini-kernels for the splicing-safety regression, built from
//! `guest-images/minikernels/<arch>/` with gcc and cached by a hash of their sources, flags
//! and compiler (as the workloads are).
//!
//! The x86-64 one is built the way Linux builds its text for ftrace: `-pg -mfentry
//! -mnop-mcount` gives every function a 5-byte nop at its entry; `-mcmodel=kernel`
//! places it in the top 2 GiB; `-mno-red-zone` lets code patches push below `rsp`.
//!
//! The SPARC v9 one is built with Debian's cross compiler `sparc64-linux-gnu-gcc`
//! (package `gcc-sparc64-linux-gnu`), `-mcmodel=medlow` (linked at 16 MiB: every address
//! is a `sethi`/`or` pair), `-mno-fpu` and `-mflat` (no register windows: its `entry.S`
//! says why Unicorn's SPARC64 CPU cannot run windowed code).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::cache;
use crate::workloads::WorkloadError;

/// The x86-64 mini-kernel's sources: (file name, contents); `common.h` is shared with SPARC.
pub const X86_64_SOURCES: &[(&str, &str)] = &[
    ("kernel.c", include_str!("../minikernels/x86_64/kernel.c")),
    ("common.h", include_str!("../minikernels/common.h")),
    ("entry.S", include_str!("../minikernels/x86_64/entry.S")),
    (
        "kernel.lds",
        include_str!("../minikernels/x86_64/kernel.lds"),
    ),
];

/// gcc flags of the x86-64 mini-kernel.
pub const X86_64_CFLAGS: &[&str] = &[
    "-O2",
    "-fno-pic",
    "-no-pie",
    "-static",
    "-nostdlib",
    "-ffreestanding",
    "-fno-builtin",
    "-pg",
    "-mfentry",
    "-mnop-mcount",
    "-mcmodel=kernel",
    "-mno-red-zone",
    "-fno-asynchronous-unwind-tables",
    "-fno-stack-protector",
    "-fcf-protection=none",
    "-Wall",
    "-Wl,--build-id=none",
    "-Tkernel.lds",
];

/// The SPARC v9 mini-kernel's sources: (file name, contents); `common.h` is shared with x86-64.
pub const SPARC64_SOURCES: &[(&str, &str)] = &[
    ("kernel.c", include_str!("../minikernels/sparc64/kernel.c")),
    ("common.h", include_str!("../minikernels/common.h")),
    ("entry.S", include_str!("../minikernels/sparc64/entry.S")),
    (
        "kernel.lds",
        include_str!("../minikernels/sparc64/kernel.lds"),
    ),
];

/// The SPARC cross compiler (Debian's `gcc-sparc64-linux-gnu`).
pub const SPARC64_GCC: &str = "sparc64-linux-gnu-gcc";

/// gcc flags of the SPARC v9 mini-kernel.
pub const SPARC64_CFLAGS: &[&str] = &[
    "-O2",
    "-mcmodel=medlow",
    "-mno-fpu",
    "-mflat",
    "-fno-pic",
    "-no-pie",
    "-static",
    "-nostdlib",
    "-ffreestanding",
    "-fno-builtin",
    "-fno-asynchronous-unwind-tables",
    "-fno-stack-protector",
    "-Wall",
    "-Wl,--build-id=none",
    "-Tkernel.lds",
];

/// A built mini-kernel.
#[derive(Debug, Clone)]
pub struct MiniKernel {
    /// The linked ELF executable (with its symbol table).
    pub elf: PathBuf,
}

/// Builds (or reuses from the cache) the x86-64 mini-kernel.
///
/// # Errors
/// gcc missing or failing, or the cache not writable.
pub fn ensure_x86_64() -> Result<MiniKernel, WorkloadError> {
    let root = cache::cache_root()?.join("minikernels");
    build("gcc", "x86_64", X86_64_SOURCES, X86_64_CFLAGS, &root)
}

/// Builds (or reuses from the cache) the SPARC v9 mini-kernel with
/// [`SPARC64_GCC`].
///
/// # Errors
/// The cross compiler missing or failing, or the cache not writable.
pub fn ensure_sparc64() -> Result<MiniKernel, WorkloadError> {
    let root = cache::cache_root()?.join("minikernels");
    build(
        SPARC64_GCC,
        "sparc64",
        SPARC64_SOURCES,
        SPARC64_CFLAGS,
        &root,
    )
}

fn build(
    compiler: &str,
    arch: &str,
    sources: &[(&str, &str)],
    cflags: &[&str],
    root: &Path,
) -> Result<MiniKernel, WorkloadError> {
    let version = Command::new(compiler)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(WorkloadError::NoCompiler)?;
    let mut hasher = Sha256::new();
    hasher.update(&version.stdout);
    for (name, text) in sources {
        for part in [*name, *text] {
            hasher.update(part.as_bytes());
            hasher.update([0]);
        }
    }
    hasher.update(cflags.join(" ").as_bytes());
    let key = cache::hex(&hasher.finalize()[..8]);
    let name = format!("minikernel-{arch}");
    let dir = root.join(format!("{arch}-{key}"));
    let elf = dir.join(&name);
    if cache::verify(&dir, &[&name]).is_ok() {
        return Ok(MiniKernel { elf });
    }
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| WorkloadError::Io { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let mut inputs = Vec::new();
    for (file, text) in sources {
        let path = dir.join(file);
        std::fs::write(&path, text).map_err(io_err(&path))?;
        if !file.ends_with(".lds") && !file.ends_with(".h") {
            inputs.push(path);
        }
    }
    tracing::info!(arch, "building the mini-kernel with {compiler}");
    let out = Command::new(compiler)
        .current_dir(&dir)
        .args(cflags)
        .arg("-o")
        .arg(&elf)
        .args(&inputs)
        .stdin(Stdio::null())
        .output()
        .map_err(WorkloadError::NoCompiler)?;
    if !out.status.success() {
        return Err(WorkloadError::Compile {
            name,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    cache::seal(&dir, &name, &key, std::slice::from_ref(&name))?;
    Ok(MiniKernel { elf })
}
