//! Workload programs for the guest, compiled from `guest-images/workloads/*.c` with
//! `gcc -static -O2` and cached by a hash of their source and the compiler's identity.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::cache::{self, CacheError};

include!(concat!(env!("OUT_DIR"), "/workloads.rs"));

/// Compiler flags every workload is built with.
pub const CFLAGS: &[&str] = &["-static", "-O2", "-Wall"];

/// Errors of building workloads.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// gcc could not be started.
    #[error("cannot run gcc to build the guest workloads (apt-get install gcc libc6-dev)")]
    NoCompiler(#[source] std::io::Error),
    /// gcc rejected a workload.
    #[error("gcc failed to build workload {name}:\n{stderr}")]
    Compile {
        /// The workload.
        name: String,
        /// What gcc said.
        stderr: String,
    },
    /// The cache failed.
    #[error(transparent)]
    Cache(#[from] CacheError),
    /// A file operation failed.
    #[error("cannot write {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// A built workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Its name (the source's file stem), also its command name in the guest.
    pub name: String,
    /// The static executable.
    pub binary: PathBuf,
}

fn compiler_identity() -> Result<String, WorkloadError> {
    let out = Command::new("gcc")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(WorkloadError::NoCompiler)?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// Builds (or reuses from the cache) every workload.
///
/// # Errors
/// When gcc is missing or fails, or the cache cannot be written.
pub fn ensure_workloads() -> Result<Vec<Workload>, WorkloadError> {
    let root = cache::cache_root()?.join("workloads");
    let compiler = compiler_identity()?;
    SOURCES
        .iter()
        .map(|(name, source)| build_one(&root, name, source, &compiler))
        .collect()
}

fn build_one(
    root: &Path,
    name: &str,
    source: &str,
    compiler: &str,
) -> Result<Workload, WorkloadError> {
    let mut hasher = Sha256::new();
    for part in [source, compiler, &CFLAGS.join(" ")] {
        hasher.update(part.as_bytes());
        hasher.update([0]);
    }
    let key = cache::hex(&hasher.finalize()[..8]);
    let dir = root.join(format!("{name}-{key}"));
    let binary = dir.join(name);
    if cache::verify(&dir, &[name]).is_ok() {
        return Ok(Workload {
            name: name.to_owned(),
            binary,
        });
    }
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| WorkloadError::Io { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, source).map_err(io_err(&src))?;
    tracing::info!(workload = name, "compiling with gcc {}", CFLAGS.join(" "));
    let out = Command::new("gcc")
        .args(CFLAGS)
        .arg("-o")
        .arg(&binary)
        .arg(&src)
        .stdin(Stdio::null())
        .output()
        .map_err(WorkloadError::NoCompiler)?;
    if !out.status.success() {
        return Err(WorkloadError::Compile {
            name: name.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    cache::seal(&dir, name, &key, &[name.to_owned()])?;
    Ok(Workload {
        name: name.to_owned(),
        binary,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_required_workloads_are_embedded() {
        let names: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();

        assert!(names.contains(&"syscall-loop"), "{names:?}");
        assert!(names.contains(&"mixed"), "{names:?}");
    }
}
