//! Debian packages fetched with `apt-get download` and unpacked without installing them.
//!
//! `apt-get` already knows the archive, mirrors, signatures and proxies of the host, so we let
//! it download; the package's data tar is then streamed out of `dpkg-deb --fsys-tarfile` and
//! only the files we want are written, with a progress bar over the bytes read.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// Errors of fetching and unpacking Debian packages.
#[derive(Debug, thiserror::Error)]
pub enum DebianError {
    /// A command could not be started.
    #[error("cannot run `{command}` (is it installed? exotap needs apt-get and dpkg-deb)")]
    Spawn {
        /// The command line.
        command: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// apt does not know the package.
    #[error("apt does not know the package {package}{}", suggestion.as_ref().map(|s| format!("; {s}")).unwrap_or_default())]
    UnknownPackage {
        /// The package.
        package: String,
        /// What to do instead.
        suggestion: Option<String>,
    },
    /// `apt-get download` failed.
    #[error("`apt-get download {package}` failed with {status}: {stderr}")]
    Download {
        /// The package.
        package: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// The last lines it printed.
        stderr: String,
    },
    /// `apt-get download` succeeded but left no .deb.
    #[error("`apt-get download {0}` left no .deb file")]
    NoDeb(String),
    /// Unpacking failed.
    #[error("cannot unpack {deb}")]
    Unpack {
        /// The package file.
        deb: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A file we need is not in the package.
    #[error("{deb} has no file matching {what}")]
    MissingFile {
        /// The package file.
        deb: PathBuf,
        /// What was looked for.
        what: String,
    },
    /// A local file operation failed.
    #[error("cannot write {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// What apt knows of a package's candidate version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageInfo {
    /// Package name.
    pub name: String,
    /// Candidate version.
    pub version: String,
    /// Size of the .deb in bytes, when apt says.
    pub size: Option<u64>,
}

fn run_capture(cmd: &mut Command) -> Result<std::process::Output, DebianError> {
    let command = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .output()
        .map_err(|source| DebianError::Spawn { command, source })
}

/// Parses `apt-cache show --no-all-versions` output.
pub fn parse_apt_show(text: &str) -> Option<PackageInfo> {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_owned()))
    };
    Some(PackageInfo {
        name: field("Package:")?,
        version: field("Version:")?,
        size: field("Size:").and_then(|s| s.parse().ok()),
    })
}

/// Asks apt for the candidate version of `name`; `None` when apt does not know it.
///
/// # Errors
/// When `apt-cache` cannot run.
pub fn candidate(name: &str) -> Result<Option<PackageInfo>, DebianError> {
    let out = run_capture(Command::new("apt-cache").args(["show", "--no-all-versions", name]))?;
    if !out.status.success() {
        return Ok(None);
    }
    Ok(parse_apt_show(&String::from_utf8_lossy(&out.stdout)))
}

/// Picks the newest name matching `linux-image-<ver>-cloud-amd64-unsigned` from
/// `apt-cache search --names-only` output, comparing the version numerically.
pub fn newest_cloud_kernel_in(search_output: &str) -> Option<String> {
    search_output
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("linux-image-") && n.ends_with("-cloud-amd64-unsigned"))
        .max_by_key(|n| version_key(n))
        .map(str::to_owned)
}

/// Numeric components of a name, for ordering `6.1.0-9` before `6.1.0-50` before `6.12.1`.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// The x86-64 kernels in `apt-cache search` output that exotap can fetch (the unsigned
/// `cloud-amd64` and `amd64` flavours), as ABI names, oldest first.
pub fn x86_kernels_in(search_output: &str) -> Vec<String> {
    let mut abis: Vec<String> = search_output
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter_map(|n| n.strip_prefix("linux-image-")?.strip_suffix("-unsigned"))
        .filter(|abi| {
            abi.ends_with("-cloud-amd64") || abi.ends_with("-amd64") && !abi.ends_with("-rt-amd64")
        })
        .map(str::to_owned)
        .collect();
    abis.sort_by_key(|a| version_key(a));
    abis.dedup();
    abis
}

/// The x86-64 kernels apt knows ([`x86_kernels_in`]).
///
/// # Errors
/// When `apt-cache` cannot run.
pub fn x86_kernels() -> Result<Vec<String>, DebianError> {
    let out = run_capture(Command::new("apt-cache").args([
        "search",
        "--names-only",
        "^linux-image-.*-amd64-unsigned$",
    ]))?;
    Ok(x86_kernels_in(&String::from_utf8_lossy(&out.stdout)))
}

/// The newest cloud kernel apt knows, if any.
///
/// # Errors
/// When `apt-cache` cannot run.
pub fn newest_cloud_kernel() -> Result<Option<String>, DebianError> {
    let out = run_capture(Command::new("apt-cache").args([
        "search",
        "--names-only",
        "^linux-image-.*-cloud-amd64-unsigned$",
    ]))?;
    Ok(newest_cloud_kernel_in(&String::from_utf8_lossy(
        &out.stdout,
    )))
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_owned());
    pb
}

fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|it| {
            it.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Downloads `info`'s .deb into `dir` (which should be empty) with a progress bar.
///
/// # Errors
/// When apt-get fails or leaves no package file.
pub fn download(info: &PackageInfo, dir: &Path) -> Result<PathBuf, DebianError> {
    tracing::info!(package = %info.name, version = %info.version, size = info.size, "downloading");
    let pb = bar(info.size.unwrap_or(0), "download");
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (pb, done, dir) = (pb.clone(), done.clone(), dir.to_owned());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                pb.set_position(dir_bytes(&dir));
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let spec = format!("{}={}", info.name, info.version);
    let out = run_capture(Command::new("apt-get").current_dir(dir).args([
        "-q",
        "-o",
        "APT::Sandbox::User=root",
        "download",
        &spec,
    ]));
    done.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    let out = out?;
    if !out.status.success() {
        pb.abandon();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        return Err(DebianError::Download {
            package: spec,
            status: out.status,
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join(" / "),
        });
    }
    pb.set_position(dir_bytes(dir));
    pb.finish_and_clear();
    fs::read_dir(dir)
        .map_err(|source| DebianError::Io {
            path: dir.to_owned(),
            source,
        })?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .ok_or(DebianError::NoDeb(info.name.clone()))
}

struct CountingReader<R> {
    inner: R,
    pb: ProgressBar,
}

impl<R: Read> Read for CountingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.pb.inc(n as u64);
        Ok(n)
    }
}

/// Unpacks from `deb` every regular file for which `select` returns a destination (relative to
/// `dest`), streaming `dpkg-deb --fsys-tarfile`. Returns the destinations written.
///
/// # Errors
/// When dpkg-deb fails, the tar stream is malformed, or a file cannot be written.
pub fn extract(
    deb: &Path,
    dest: &Path,
    select: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<String>, DebianError> {
    let unpack_err = |source| DebianError::Unpack {
        deb: deb.to_owned(),
        source,
    };
    let installed_kib = run_capture(
        Command::new("dpkg-deb")
            .arg("-f")
            .arg(deb)
            .arg("Installed-Size"),
    )
    .ok()
    .and_then(|o| {
        String::from_utf8_lossy(&o.stdout)
            .trim()
            .parse::<u64>()
            .ok()
    })
    .unwrap_or(0);
    let mut child = Command::new("dpkg-deb")
        .arg("--fsys-tarfile")
        .arg(deb)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| DebianError::Spawn {
            command: format!("dpkg-deb --fsys-tarfile {}", deb.display()),
            source,
        })?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| unpack_err(io::Error::other("dpkg-deb has no stdout")))?;
    let pb = bar(installed_kib * 1024, "unpack");
    let mut archive = tar::Archive::new(CountingReader {
        inner: stdout,
        pb: pb.clone(),
    });
    let mut written = Vec::new();
    let result = (|| -> Result<(), DebianError> {
        for entry in archive.entries().map_err(unpack_err)? {
            let mut entry = entry.map_err(unpack_err)?;
            if entry.header().entry_type() != tar::EntryType::Regular {
                continue;
            }
            let path = entry.path().map_err(unpack_err)?;
            let name = path.to_string_lossy();
            let name = name.trim_start_matches("./");
            let Some(rel) = select(name) else { continue };
            let out = dest.join(&rel);
            let io_err = |source| DebianError::Io {
                path: out.clone(),
                source,
            };
            if let Some(parent) = out.parent() {
                fs::create_dir_all(parent).map_err(io_err)?;
            }
            let mut file = fs::File::create(&out).map_err(io_err)?;
            io::copy(&mut entry, &mut file).map_err(io_err)?;
            written.push(rel);
        }
        // Drain so dpkg-deb does not die of a broken pipe.
        io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(unpack_err)?;
        Ok(())
    })();
    let status = child.wait().map_err(unpack_err)?;
    pb.finish_and_clear();
    result?;
    if !status.success() {
        return Err(unpack_err(io::Error::other(format!(
            "dpkg-deb exited with {status}"
        ))));
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_cloud_kernel_orders_versions_numerically() {
        let search = "\
linux-image-6.1.0-9-cloud-amd64-unsigned - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-50-cloud-amd64-unsigned - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-50-cloud-amd64 - Linux 6.1 for x86-64 cloud (signed)
linux-image-6.12.9+deb12-cloud-amd64-unsigned - Linux 6.12 for x86-64 cloud
linux-image-6.12.115+deb12-cloud-amd64-unsigned - Linux 6.12 for x86-64 cloud
";

        assert_eq!(
            newest_cloud_kernel_in(search).as_deref(),
            Some("linux-image-6.12.115+deb12-cloud-amd64-unsigned")
        );
    }

    #[test]
    fn x86_kernels_are_the_unsigned_cloud_and_generic_flavours_in_version_order() {
        let search = "\
linux-image-6.12.57+deb12-cloud-amd64-unsigned - Linux 6.12 for x86-64 cloud (unsigned)
linux-image-6.1.0-50-cloud-amd64-unsigned - Linux 6.1 for x86-64 cloud (unsigned)
linux-image-6.1.0-50-cloud-amd64-dbg - Debug symbols for linux-image-6.1.0-50-cloud-amd64
linux-image-6.1.0-9-amd64-unsigned - Linux 6.1 for 64-bit PCs (unsigned)
linux-image-6.1.0-50-rt-amd64-unsigned - Linux 6.1 for 64-bit PCs, PREEMPT_RT (unsigned)
linux-image-6.1.0-50-cloud-arm64-unsigned - Linux 6.1 for arm64 cloud (unsigned)
";

        let kernels = x86_kernels_in(search);

        assert_eq!(
            kernels,
            [
                "6.1.0-9-amd64",
                "6.1.0-50-cloud-amd64",
                "6.12.57+deb12-cloud-amd64"
            ]
        );
    }

    #[test]
    fn newest_cloud_kernel_of_nothing_is_none() {
        assert_eq!(newest_cloud_kernel_in(""), None);
    }

    #[test]
    fn apt_show_fields_are_parsed() {
        let text = "Package: busybox-static\nVersion: 1:1.35.0-4+deb12u1+b1\nSize: 928188\nDescription: x\n";

        let info = parse_apt_show(text).unwrap();

        assert_eq!(info.name, "busybox-static");
        assert_eq!(info.version, "1:1.35.0-4+deb12u1+b1");
        assert_eq!(info.size, Some(928188));
    }
}
