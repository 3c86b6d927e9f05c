//! The on-disk cache: `$XDG_CACHE_HOME/exotap` (default `~/.cache/exotap`).
//!
//! Every cached component (a kernel, its debug info, busybox, a built workload) lives in its
//! own directory with a `manifest.json` recording the size and sha256 of each file at the time
//! it was stored. Reuse checks size and hash, so a truncated or corrupted file is noticed and
//! the component fetched again instead of booting garbage.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Name of the manifest file inside a component directory.
pub const MANIFEST: &str = "manifest.json";

/// Errors of the cache.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Neither `XDG_CACHE_HOME` nor `HOME` is set.
    #[error("cannot locate the cache directory: neither XDG_CACHE_HOME nor HOME is set")]
    NoHome,
    /// A file of the component could not be read or hashed.
    #[error("cannot read cached file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The manifest could not be written.
    #[error("cannot write the manifest {path}")]
    WriteManifest {
        /// The manifest path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The manifest could not be serialized.
    #[error("cannot encode the manifest")]
    Encode(#[source] serde_json::Error),
}

/// The root of exotap's cache.
///
/// # Errors
/// [`CacheError::NoHome`] when no environment variable says where home is.
pub fn cache_root() -> Result<PathBuf, CacheError> {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir).join("exotap"));
    }
    let home = std::env::var_os("HOME")
        .filter(|d| !d.is_empty())
        .ok_or(CacheError::NoHome)?;
    Ok(PathBuf::from(home).join(".cache").join("exotap"))
}

/// Size and hash of one cached file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Size in bytes.
    pub size: u64,
    /// Lower-case hex sha256 of the content.
    pub sha256: String,
}

/// What a component directory holds, recorded when it was stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Where the component came from (e.g. `linux-image-6.1.0-50-cloud-amd64-unsigned`).
    pub source: String,
    /// The source's version (e.g. the Debian package version `6.1.176-1`).
    pub version: String,
    /// Files relative to the component directory.
    pub files: BTreeMap<String, FileRecord>,
}

/// Why a cached component cannot be reused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Staleness {
    /// No manifest (never fetched, or an interrupted fetch).
    Missing,
    /// The manifest is unreadable.
    BadManifest(String),
    /// A file listed in the manifest is gone.
    FileMissing(String),
    /// A file's size or hash differs from the manifest.
    Corrupt {
        /// The file.
        file: String,
        /// What differs.
        what: String,
    },
    /// The manifest does not list a file the caller needs.
    Incomplete(String),
}

impl std::fmt::Display for Staleness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing => write!(f, "not in the cache"),
            Self::BadManifest(why) => write!(f, "its manifest is unreadable ({why})"),
            Self::FileMissing(file) => write!(f, "{file} is missing"),
            Self::Corrupt { file, what } => write!(f, "{file} is corrupt ({what})"),
            Self::Incomplete(file) => write!(f, "the manifest does not list {file}"),
        }
    }
}

/// Hashes a file with sha256, returning its record.
///
/// # Errors
/// [`CacheError::Read`] when the file cannot be read.
pub fn hash_file(path: &Path) -> Result<FileRecord, CacheError> {
    let read_err = |source| CacheError::Read {
        path: path.to_owned(),
        source,
    };
    let mut file = fs::File::open(path).map_err(read_err)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(read_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok(FileRecord {
        size,
        sha256: hex(&hasher.finalize()),
    })
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads the manifest of `dir` and checks every file it lists (size, then sha256), and that it
/// lists each of `required`. Returns the manifest when the component can be reused.
///
/// # Errors
/// The reason the component is stale.
pub fn verify(dir: &Path, required: &[&str]) -> Result<Manifest, Staleness> {
    let text = match fs::read_to_string(dir.join(MANIFEST)) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Staleness::Missing),
        Err(e) => return Err(Staleness::BadManifest(e.to_string())),
    };
    let manifest: Manifest =
        serde_json::from_str(&text).map_err(|e| Staleness::BadManifest(e.to_string()))?;
    if let Some(file) = required.iter().find(|f| !manifest.files.contains_key(**f)) {
        return Err(Staleness::Incomplete((*file).to_owned()));
    }
    for (name, want) in &manifest.files {
        let path = dir.join(name);
        let meta = fs::metadata(&path).map_err(|_| Staleness::FileMissing(name.clone()))?;
        if meta.len() != want.size {
            return Err(Staleness::Corrupt {
                file: name.clone(),
                what: format!("size {} instead of {}", meta.len(), want.size),
            });
        }
        let got = hash_file(&path).map_err(|e| Staleness::Corrupt {
            file: name.clone(),
            what: e.to_string(),
        })?;
        if got.sha256 != want.sha256 {
            return Err(Staleness::Corrupt {
                file: name.clone(),
                what: format!("sha256 {} instead of {}", got.sha256, want.sha256),
            });
        }
    }
    Ok(manifest)
}

/// Hashes `files` (relative to `dir`) and writes the manifest, last, so that an interrupted
/// store leaves no manifest and is retried.
///
/// # Errors
/// When a file cannot be hashed or the manifest cannot be written.
pub fn seal(
    dir: &Path,
    source: &str,
    version: &str,
    files: &[String],
) -> Result<Manifest, CacheError> {
    let mut records = BTreeMap::new();
    for name in files {
        records.insert(name.clone(), hash_file(&dir.join(name))?);
    }
    let manifest = Manifest {
        source: source.to_owned(),
        version: version.to_owned(),
        files: records,
    };
    let text = serde_json::to_string_pretty(&manifest).map_err(CacheError::Encode)?;
    let path = dir.join(MANIFEST);
    let tmp = dir.join(format!("{MANIFEST}.tmp"));
    let write_err = |source| CacheError::WriteManifest {
        path: path.clone(),
        source,
    };
    fs::write(&tmp, text).map_err(write_err)?;
    fs::rename(&tmp, &path).map_err(write_err)?;
    Ok(manifest)
}

/// Removes the manifest so the component is fetched again.
pub fn invalidate(dir: &Path) {
    let _ = fs::remove_file(dir.join(MANIFEST));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed_dir() -> (tempfile::TempDir, Manifest) {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("a.bin"), b"hello kernel").unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        fs::write(dir.path().join("sub/b.ko"), vec![7u8; 4096]).unwrap();
        let files = vec!["a.bin".to_owned(), "sub/b.ko".to_owned()];
        let manifest = seal(dir.path(), "pkg", "1.0", &files).unwrap();
        (dir, manifest)
    }

    #[test]
    fn hash_matches_known_sha256_of_abc() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("abc");
        fs::write(&path, b"abc").unwrap();

        let record = hash_file(&path).unwrap();

        // FIPS 180-2 test vector.
        assert_eq!(
            record.sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(record.size, 3);
    }

    #[test]
    fn verify_accepts_untouched_component() {
        let (dir, manifest) = sealed_dir();

        let verified = verify(dir.path(), &["a.bin"]).unwrap();

        assert_eq!(verified, manifest);
    }

    #[test]
    fn verify_detects_same_size_corruption() {
        let (dir, _) = sealed_dir();
        fs::write(dir.path().join("a.bin"), b"hello kerneL").unwrap();

        let err = verify(dir.path(), &[]).unwrap_err();

        assert!(
            matches!(err, Staleness::Corrupt { ref file, ref what } if file == "a.bin" && what.contains("sha256"))
        );
    }

    #[test]
    fn verify_detects_truncation() {
        let (dir, _) = sealed_dir();
        fs::write(dir.path().join("sub/b.ko"), vec![7u8; 100]).unwrap();

        let err = verify(dir.path(), &[]).unwrap_err();

        assert!(matches!(err, Staleness::Corrupt { ref what, .. } if what.contains("size 100")));
    }

    #[test]
    fn verify_detects_deleted_file() {
        let (dir, _) = sealed_dir();
        fs::remove_file(dir.path().join("a.bin")).unwrap();

        assert_eq!(
            verify(dir.path(), &[]).unwrap_err(),
            Staleness::FileMissing("a.bin".into())
        );
    }

    #[test]
    fn verify_reports_missing_manifest_and_required_file() {
        let (dir, _) = sealed_dir();

        assert_eq!(
            verify(dir.path(), &["vmlinux"]).unwrap_err(),
            Staleness::Incomplete("vmlinux".into())
        );
        invalidate(dir.path());
        assert_eq!(verify(dir.path(), &[]).unwrap_err(), Staleness::Missing);
    }
}
