//! The on-disk cache: `$XDG_CACHE_HOME/exotap` (default `~/.cache/exotap`).
//!
//! Every cached component (a kernel, its debug info, busybox, a built workload) lives in its
//! own directory with a `manifest.json` recording the size and sha256 of each file at the time
//! it was stored. Reuse checks size and hash, so a truncated or corrupted file is noticed and
//! the component fetched again instead of booting garbage.
//!
//! Hashing every file at every use cost more than the use itself (the -dbg vmlinux is 500 MB):
//! a full check leaves a stamp (`.verified`: each file's size, modification time and inode as
//! the check saw them), and a later check whose files all still match the stamp is done
//! without hashing. A file changed since has another modification time or inode, and is
//! hashed again; as git does with its index, a file modified within [`RACY`] of the stamp
//! is never trusted to it (a write in the same timestamp tick as the check could keep the
//! time).

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

/// Set by [`distrust_stamps`].
static DISTRUST_STAMPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes every later [`verify`] of this process hash every file, whatever the stamps say
/// (`exotap image fetch`: the command that says the cache is sound checks all of it).
pub fn distrust_stamps() {
    DISTRUST_STAMPS.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Name of the stamp a full check leaves inside a component directory.
pub const STAMP: &str = ".verified";

/// How much older than its stamp a file must be for the stamp to vouch for it.
pub const RACY: std::time::Duration = std::time::Duration::from_secs(2);

/// What a full check saw of each file: size, modification time (ns since the epoch), inode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Stamp {
    /// When the check ended (ns since the epoch).
    checked_ns: i128,
    /// By file name (the manifest's own included).
    files: BTreeMap<String, (u64, i128, u64)>,
}

/// Size, modification time and inode of `path`.
fn file_identity(path: &Path) -> Option<(u64, i128, u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(path).ok()?;
    let mtime = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
    Some((meta.len(), mtime, meta.ino()))
}

/// The identities of the manifest and of every file it lists, now.
fn identities(dir: &Path, manifest: &Manifest) -> Option<BTreeMap<String, (u64, i128, u64)>> {
    std::iter::once(MANIFEST)
        .chain(manifest.files.keys().map(String::as_str))
        .map(|name| Some((name.to_owned(), file_identity(&dir.join(name))?)))
        .collect()
}

/// Whether the stamp in `dir` vouches for every file of `manifest` as it is now.
fn stamped(dir: &Path, manifest: &Manifest) -> bool {
    let Some(stamp) = fs::read_to_string(dir.join(STAMP))
        .ok()
        .and_then(|t| serde_json::from_str::<Stamp>(&t).ok())
    else {
        return false;
    };
    let racy = i128::try_from(RACY.as_nanos()).unwrap_or(i128::MAX);
    identities(dir, manifest).is_some_and(|now| {
        now == stamp.files
            && now
                .values()
                .all(|(_, mtime, _)| mtime.saturating_add(racy) < stamp.checked_ns)
    })
}

/// Leaves the stamp of a full check (best effort: without it the next check hashes again).
fn stamp(dir: &Path, manifest: &Manifest) {
    let checked_ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
    let Some(files) = identities(dir, manifest) else {
        return;
    };
    let Ok(text) = serde_json::to_string(&Stamp { checked_ns, files }) else {
        return;
    };
    let tmp = dir.join(format!("{STAMP}.tmp"));
    if fs::write(&tmp, text).is_ok() {
        let _ = fs::rename(&tmp, dir.join(STAMP));
    }
}

/// Reads the manifest of `dir` and checks every file it lists (size, then sha256, unless the
/// stamp of an earlier full check vouches for it: see the module's doc), and that it lists
/// each of `required`. Returns the manifest when the component can be reused.
///
/// # Errors
/// The reason the component is stale.
pub fn verify(dir: &Path, required: &[&str]) -> Result<Manifest, Staleness> {
    let manifest = verify_manifest(dir, required)?;
    if !DISTRUST_STAMPS.load(std::sync::atomic::Ordering::Relaxed) && stamped(dir, &manifest) {
        return Ok(manifest);
    }
    verify_files(dir, manifest)
}

/// [`verify`], hashing every file whatever the stamp says.
///
/// # Errors
/// The reason the component is stale.
pub fn verify_fully(dir: &Path, required: &[&str]) -> Result<Manifest, Staleness> {
    verify_files(dir, verify_manifest(dir, required)?)
}

/// The manifest of `dir`, when it lists each of `required`.
fn verify_manifest(dir: &Path, required: &[&str]) -> Result<Manifest, Staleness> {
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
    Ok(manifest)
}

/// Checks the size and sha256 of every file of `manifest`, and leaves the stamp.
fn verify_files(dir: &Path, manifest: Manifest) -> Result<Manifest, Staleness> {
    let _ = fs::remove_file(dir.join(STAMP));
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
    stamp(dir, &manifest);
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

/// Removes the manifest (and the stamp) so the component is fetched again.
pub fn invalidate(dir: &Path) {
    let _ = fs::remove_file(dir.join(STAMP));
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

    /// Sets the modification time of every file of `dir` a minute back, as files fetched
    /// a while ago have.
    fn age(dir: &Path) {
        let then = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        for name in [MANIFEST, "a.bin", "sub/b.ko"] {
            let f = fs::File::options()
                .write(true)
                .open(dir.join(name))
                .unwrap();
            f.set_modified(then).unwrap();
        }
    }

    /// Overwrites a.bin with bytes of the same size, keeping its modification time.
    fn corrupt_keeping_the_time(dir: &Path) {
        let path = dir.join("a.bin");
        let mtime = fs::metadata(&path).unwrap().modified().unwrap();
        fs::write(&path, b"hello kerneL").unwrap();
        fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
    }

    #[test]
    fn a_stamp_spares_the_hashing_of_files_it_saw_and_only_those() {
        let (dir, manifest) = sealed_dir();
        age(dir.path());
        assert_eq!(verify(dir.path(), &[]).unwrap(), manifest);
        assert!(
            dir.path().join(STAMP).exists(),
            "a full check leaves a stamp"
        );

        // What the stamp trades: a change that keeps size, time and inode is not hashed...
        corrupt_keeping_the_time(dir.path());
        assert_eq!(verify(dir.path(), &[]).unwrap(), manifest);
        // ... but a full check finds it, and leaves no stamp for it.
        assert!(matches!(
            verify_fully(dir.path(), &[]).unwrap_err(),
            Staleness::Corrupt { ref file, .. } if file == "a.bin"
        ));
        assert!(!dir.path().join(STAMP).exists());
    }

    #[test]
    fn a_file_changed_after_the_stamp_is_hashed_again() {
        let (dir, _) = sealed_dir();
        age(dir.path());
        verify(dir.path(), &[]).unwrap();
        // Another modification time (now): the stamp no longer vouches for the file.
        fs::write(dir.path().join("a.bin"), b"hello kerneL").unwrap();

        assert!(matches!(
            verify(dir.path(), &[]).unwrap_err(),
            Staleness::Corrupt { ref file, ref what } if file == "a.bin" && what.contains("sha256")
        ));
    }

    #[test]
    fn a_stamp_does_not_vouch_for_files_modified_just_before_it() {
        // Fresh files: modified within RACY of the check, possibly in its timestamp tick.
        let (dir, _) = sealed_dir();
        verify(dir.path(), &[]).unwrap();
        corrupt_keeping_the_time(dir.path());

        assert!(matches!(
            verify(dir.path(), &[]).unwrap_err(),
            Staleness::Corrupt { ref file, .. } if file == "a.bin"
        ));
    }
}
