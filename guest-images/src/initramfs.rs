//! An initramfs as the kernel expects it: a newc ("070701") cpio archive, gzip-compressed.
//!
//! The archive is built in memory from a small tree description and written deterministically
//! (fixed mtime and inode numbers, parents before children) so the same inputs give the same
//! bytes. The cpio framing itself comes from the `cpio` crate.

use std::collections::BTreeMap;
use std::io::{self, Write};

use cpio::newc::{Builder, ModeFileType};
use flate2::write::GzEncoder;
use flate2::Compression;

/// Errors of building an initramfs.
#[derive(Debug, thiserror::Error)]
pub enum InitramfsError {
    /// A path is not absolute-free and normalized.
    #[error("`{0}` is not a valid path inside the initramfs (use a/b/c, no `..`, no leading `/`)")]
    BadPath(String),
    /// A path was added twice.
    #[error("`{0}` is already in the initramfs")]
    Duplicate(String),
    /// A file exceeds the newc format's 4 GiB limit.
    #[error("`{0}` is too large for a newc archive")]
    TooLarge(String),
    /// Writing failed.
    #[error("cannot write the initramfs")]
    Write(#[source] io::Error),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Dir,
    File(Vec<u8>),
    Symlink(String),
    CharDevice { major: u32, minor: u32 },
}

/// An initramfs under construction.
#[derive(Debug, Default, Clone)]
pub struct Initramfs {
    /// Path → (permission bits, node). BTreeMap order puts `a` before `a/b`.
    nodes: BTreeMap<String, (u32, Node)>,
}

fn check_path(path: &str) -> Result<(), InitramfsError> {
    let ok = !path.is_empty()
        && !path.starts_with('/')
        && !path.ends_with('/')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if ok {
        Ok(())
    } else {
        Err(InitramfsError::BadPath(path.to_owned()))
    }
}

impl Initramfs {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    fn insert(&mut self, path: &str, mode: u32, node: Node) -> Result<(), InitramfsError> {
        check_path(path)?;
        // Create missing parents as 0755 directories.
        let mut parent = String::new();
        for comp in path
            .split('/')
            .collect::<Vec<_>>()
            .split_last()
            .map(|(_, p)| p)
            .unwrap_or(&[])
        {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(comp);
            self.nodes
                .entry(parent.clone())
                .or_insert((0o755, Node::Dir));
        }
        match self.nodes.get(path) {
            Some((_, Node::Dir)) if node == Node::Dir => Ok(()),
            Some(_) => Err(InitramfsError::Duplicate(path.to_owned())),
            None => {
                self.nodes.insert(path.to_owned(), (mode & 0o7777, node));
                Ok(())
            }
        }
    }

    /// Adds a directory (and its parents).
    ///
    /// # Errors
    /// For a bad path, or one already holding something other than a directory.
    pub fn dir(&mut self, path: &str, mode: u32) -> Result<(), InitramfsError> {
        self.insert(path, mode, Node::Dir)
    }

    /// Adds a regular file.
    ///
    /// # Errors
    /// For a bad or duplicate path, or a file over 4 GiB.
    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) -> Result<(), InitramfsError> {
        if u32::try_from(data.len()).is_err() {
            return Err(InitramfsError::TooLarge(path.to_owned()));
        }
        self.insert(path, mode, Node::File(data))
    }

    /// Adds a symbolic link.
    ///
    /// # Errors
    /// For a bad or duplicate path.
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<(), InitramfsError> {
        self.insert(path, 0o777, Node::Symlink(target.to_owned()))
    }

    /// Adds a character device node.
    ///
    /// # Errors
    /// For a bad or duplicate path.
    pub fn char_device(
        &mut self,
        path: &str,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), InitramfsError> {
        self.insert(path, mode, Node::CharDevice { major, minor })
    }

    /// Number of entries (not counting the trailer).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the tree is empty.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Writes the uncompressed newc archive.
    ///
    /// # Errors
    /// When the writer fails.
    pub fn write_cpio<W: Write>(&self, mut out: W) -> Result<W, InitramfsError> {
        for (ino, (path, (mode, node))) in (1u32..).zip(&self.nodes) {
            let (kind, nlink, data): (ModeFileType, u32, &[u8]) = match node {
                Node::Dir => (ModeFileType::Directory, 2, &[]),
                Node::File(data) => (ModeFileType::Regular, 1, data),
                Node::Symlink(target) => (ModeFileType::Symlink, 1, target.as_bytes()),
                Node::CharDevice { .. } => (ModeFileType::Char, 1, &[]),
            };
            let mut builder = Builder::new(path)
                .ino(ino)
                .mode(*mode)
                .set_mode_file_type(kind)
                .uid(0)
                .gid(0)
                .nlink(nlink)
                .mtime(0);
            if let Node::CharDevice { major, minor } = node {
                builder = builder.rdev_major(*major).rdev_minor(*minor);
            }
            let size =
                u32::try_from(data.len()).map_err(|_| InitramfsError::TooLarge(path.clone()))?;
            let mut writer = builder.write(out, size);
            writer.write_all(data).map_err(InitramfsError::Write)?;
            out = writer.finish().map_err(InitramfsError::Write)?;
        }
        cpio::newc::trailer(out).map_err(InitramfsError::Write)
    }

    /// Writes the gzip-compressed archive, as the kernel's `initrd=` expects.
    ///
    /// # Errors
    /// When the writer fails.
    pub fn write_gz<W: Write>(&self, out: W) -> Result<W, InitramfsError> {
        let gz = GzEncoder::new(out, Compression::fast());
        self.write_cpio(gz)?.finish().map_err(InitramfsError::Write)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn sample() -> Initramfs {
        let mut fs = Initramfs::new();
        fs.file("bin/busybox", 0o755, b"\x7fELF fake".to_vec())
            .unwrap();
        fs.symlink("bin/sh", "busybox").unwrap();
        fs.file("etc/exotap/job.sh", 0o644, b"echo hi\n".to_vec())
            .unwrap();
        fs.char_device("dev/console", 0o600, 5, 1).unwrap();
        fs.dir("proc", 0o555).unwrap();
        fs
    }

    #[test]
    fn parents_are_created_once_before_children() {
        let fs = sample();

        let paths: Vec<&str> = fs.nodes.keys().map(String::as_str).collect();

        assert_eq!(
            paths,
            [
                "bin",
                "bin/busybox",
                "bin/sh",
                "dev",
                "dev/console",
                "etc",
                "etc/exotap",
                "etc/exotap/job.sh",
                "proc"
            ]
        );
    }

    #[test]
    fn rejects_escaping_and_duplicate_paths() {
        let mut fs = sample();

        assert!(matches!(
            fs.file("../x", 0o644, vec![]),
            Err(InitramfsError::BadPath(_))
        ));
        assert!(matches!(
            fs.file("/abs", 0o644, vec![]),
            Err(InitramfsError::BadPath(_))
        ));
        assert!(matches!(
            fs.file("a//b", 0o644, vec![]),
            Err(InitramfsError::BadPath(_))
        ));
        assert!(matches!(
            fs.symlink("bin/sh", "x"),
            Err(InitramfsError::Duplicate(_))
        ));
        assert!(matches!(
            fs.file("bin", 0o644, vec![]),
            Err(InitramfsError::Duplicate(_))
        ));
    }

    #[test]
    fn archive_reads_back_with_the_cpio_crate_reader() {
        let bytes = sample().write_cpio(Vec::new()).unwrap();

        let mut names = Vec::new();
        let mut rest: &[u8] = &bytes;
        loop {
            let reader = cpio::NewcReader::new(rest).unwrap();
            if reader.entry().is_trailer() {
                break;
            }
            let e = reader.entry();
            names.push((
                e.name().to_owned(),
                e.mode(),
                e.file_size(),
                e.rdev_major(),
                e.rdev_minor(),
            ));
            rest = reader.finish().unwrap();
        }

        assert_eq!(names.len(), 9);
        assert!(names.contains(&("bin/sh".into(), 0o120777, 7, 0, 0)));
        assert!(names.contains(&("dev/console".into(), 0o020600, 0, 5, 1)));
        assert!(names.contains(&("bin/busybox".into(), 0o100755, 9, 0, 0)));
    }

    #[test]
    fn archive_lists_with_debian_cpio_tool() {
        if Command::new("cpio").arg("--version").output().is_err() {
            eprintln!("SKIP: GNU cpio is not installed (apt-get install cpio); the cpio-crate read-back test still ran");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let gz = dir.path().join("initrd.gz");
        std::fs::write(&gz, sample().write_gz(Vec::new()).unwrap()).unwrap();
        let cpio_bytes = {
            use std::io::Read;
            let mut d = flate2::read::GzDecoder::new(std::fs::File::open(&gz).unwrap());
            let mut v = Vec::new();
            d.read_to_end(&mut v).unwrap();
            v
        };
        std::fs::write(dir.path().join("a.cpio"), cpio_bytes).unwrap();

        let out = Command::new("sh")
            .arg("-c")
            .arg("cpio -itv --quiet < a.cpio")
            .current_dir(dir.path())
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&out.stdout);

        assert!(
            out.status.success(),
            "cpio failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<&str> = listing.lines().collect();
        assert_eq!(lines.len(), 9, "{listing}");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("lrwxrwxrwx") && l.ends_with("bin/sh -> busybox")),
            "{listing}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("crw-------")
                && l.contains("5,")
                && l.ends_with("dev/console")),
            "{listing}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("-rwxr-xr-x") && l.ends_with("bin/busybox")),
            "{listing}"
        );
    }

    #[test]
    fn output_is_deterministic() {
        assert_eq!(
            sample().write_gz(Vec::new()).unwrap(),
            sample().write_gz(Vec::new()).unwrap()
        );
    }
}
