//! The guest kernel's image on the host: its ELF vmlinux and the symbols recovered from its
//! kallsyms tables. Which image (a cached Debian kernel, a path) is the caller's choice.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use exotap_introspect::btf::Btf;
use exotap_introspect::bzimage::Vmlinux;
use exotap_introspect::kallsyms;
use exotap_introspect::symbols::SymbolTable;

/// A kernel image with its symbols (link-time addresses).
pub struct KernelImage {
    /// The bzImage it came from.
    pub path: PathBuf,
    /// The decompressed ELF vmlinux.
    pub vmlinux: Vmlinux,
    /// Every kallsyms symbol.
    pub symbols: SymbolTable,
    /// Time to decompress and recover the symbols.
    pub load_time: Duration,
    /// The image's BTF, parsed the first time it is asked for ([`KernelImage::btf`]).
    btf: std::sync::OnceLock<Result<Btf, String>>,
}

impl std::fmt::Debug for KernelImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelImage")
            .field("path", &self.path)
            .field("symbols", &self.symbols.len())
            .field("load_time", &self.load_time)
            .finish_non_exhaustive()
    }
}

impl KernelImage {
    /// Reads a bzImage, decompresses its vmlinux and recovers the kallsyms symbols.
    ///
    /// # Errors
    /// When the file cannot be read, is not a bzImage we can decompress, or has no kallsyms.
    pub fn load(path: PathBuf) -> anyhow::Result<Self> {
        let start = Instant::now();
        let bytes = std::fs::read(&path)
            .with_context(|| format!("cannot read the kernel image {}", path.display()))?;
        let cached = exotap_guest_images::cache::cache_root()
            .map_err(anyhow::Error::from)
            .and_then(|root| unpacked(&root.join("unpacked"), &bytes));
        let vmlinux = match cached {
            Ok(vmlinux) => vmlinux,
            Err(e) => {
                tracing::debug!("no unpacked copy of {} is used: {e:#}", path.display());
                Vmlinux::from_bzimage(&bytes).with_context(|| {
                    format!("cannot unpack the vmlinux inside {}", path.display())
                })?
            }
        };
        let found = kallsyms::extract(&vmlinux)
            .with_context(|| format!("cannot recover the symbols of {}", path.display()))?;
        let symbols = SymbolTable::from_kallsyms(&found);
        Ok(Self {
            path,
            vmlinux,
            symbols,
            load_time: start.elapsed(),
            btf: std::sync::OnceLock::new(),
        })
    }

    /// The image's BTF (its `.BTF` section), parsed once, the first time it is asked for,
    /// and shared by everything that reads the kernel's types.
    ///
    /// # Errors
    /// When the image has no `.BTF` section or it does not parse (the same error each time).
    pub fn btf(&self) -> anyhow::Result<&Btf> {
        self.btf
            .get_or_init(|| Btf::from_elf(self.vmlinux.bytes()).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| anyhow::anyhow!("the kernel image has no usable BTF: {e}"))
    }

    /// The link-time address of a symbol that must exist.
    ///
    /// # Errors
    /// When the kernel has no such symbol.
    pub fn address(&self, name: &str) -> anyhow::Result<u64> {
        self.symbols
            .get(name)
            .map(|s| s.addr)
            .with_context(|| format!("the kernel has no symbol {name}"))
    }

    /// The kernel's release (`uname -r`: `6.12.117+deb12-cloud-amd64`), read from its
    /// `linux_banner` (`Linux version RELEASE (...`); `None` where the image has no banner
    /// of that form.
    pub fn release(&self) -> Option<String> {
        let at = self.address("linux_banner").ok()?;
        let bytes = self.vmlinux.read_at(at, 256).ok()?;
        let text = bytes.split(|b| *b == 0).next()?;
        let text = std::str::from_utf8(text).ok()?;
        let release = text
            .strip_prefix("Linux version ")?
            .split_whitespace()
            .next()?;
        Some(release.to_owned())
    }
}

/// The vmlinux of the bzImage `bytes`, mapped from the unpacked copy kept under `root`
/// (`ROOT/SHA256/vmlinux`, named after the bzImage's sha256, with a manifest checked as any
/// cached component's: `exotap_guest_images::cache`), unpacked and stored there first when it
/// is absent, stale or corrupt. Mapped, only the pages read (symbols, BTF, ORC, the tables the
/// splicer reads) are resident: the unpacked 6.1 vmlinux is 67 MB, and unpacking it took as
/// long as the rest of a load.
///
/// # Errors
/// When the cache cannot be written or read, or the bzImage does not unpack.
fn unpacked(root: &std::path::Path, bytes: &[u8]) -> anyhow::Result<Vmlinux> {
    use exotap_guest_images::cache;
    use sha2::{Digest, Sha256};
    let key = cache::hex(&Sha256::digest(bytes));
    let dir = root.join(&key);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // One unpacking at a time per kernel (tests run side by side).
    let lock = std::fs::File::create(dir.join(".lock"))?;
    lock.lock()?;
    let file = dir.join("vmlinux");
    if let Err(why) = cache::verify(&dir, &["vmlinux"]) {
        if why != cache::Staleness::Missing {
            tracing::warn!(
                "the unpacked kernel {} is unusable, {why}: unpacking it again",
                file.display()
            );
        }
        cache::invalidate(&dir);
        let vmlinux = Vmlinux::from_bzimage(bytes).context("cannot unpack the vmlinux")?;
        let tmp = dir.join("vmlinux.tmp");
        std::fs::write(&tmp, vmlinux.bytes())
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        // A new file, never the one another exotap may have mapped.
        std::fs::rename(&tmp, &file)?;
        cache::seal(&dir, "bzImage", &key, &["vmlinux".to_owned()])?;
    }
    let opened =
        std::fs::File::open(&file).with_context(|| format!("cannot open {}", file.display()))?;
    let vmlinux =
        Vmlinux::map(&opened).with_context(|| format!("cannot map {}", file.display()))?;
    drop(lock);
    prune_unpacked(root, &dir);
    Ok(vmlinux)
}

/// How many unpacked kernels the cache keeps: the most recently used (a load rewrites its
/// directory's `.lock`).
const UNPACKED_KEEP: usize = 4;

/// Removes the unpacked kernels of `root` past the [`UNPACKED_KEEP`] most recently used,
/// `current` among them, leaving any another exotap is unpacking now (its lock is held). A
/// copy another exotap has mapped outlives its removal (the mapping keeps the file).
fn prune_unpacked(root: &std::path::Path, current: &std::path::Path) {
    let Ok(read) = std::fs::read_dir(root) else {
        return;
    };
    let mut others: Vec<(std::time::SystemTime, std::path::PathBuf)> = read
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p != current)
        .filter_map(|p| Some((std::fs::metadata(p.join(".lock")).ok()?.modified().ok()?, p)))
        .collect();
    others.sort_by_key(|o| std::cmp::Reverse(o.0));
    for (_, old) in others.into_iter().skip(UNPACKED_KEEP - 1) {
        let Ok(lock) = std::fs::File::open(old.join(".lock")) else {
            continue;
        };
        if lock.try_lock().is_ok() {
            let _ = std::fs::remove_dir_all(&old);
        }
    }
}

/// The cached Debian kernel (for unit tests that need a real image): `None` only when it is
/// not cached (no `vmlinuz` in the cache, or no HOME/XDG_CACHE_HOME to find the cache), for
/// the caller to print its `SKIP: ... not cached`.
///
/// # Panics
/// When the file is there but cannot be examined or does not load: a cache that is present
/// and broken fails the test; it is not a kernel that was never fetched.
///
/// For the unit tests of this crate and of the crates above it (their dev-dependency on this
/// one enables the `testing` feature).
#[cfg(any(test, feature = "testing"))]
#[allow(
    clippy::panic,
    reason = "a test helper: a cache that is present and broken fails the test"
)]
pub fn cached_debian_image() -> Option<KernelImage> {
    let dir = exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)?;
    let path = dir.join("vmlinuz");
    match std::fs::metadata(&path) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => panic!("cannot examine the cached kernel {}: {e}", path.display()),
    }
    match KernelImage::load(path.clone()) {
        Ok(image) => Some(image),
        Err(e) => panic!(
            "the cached kernel {} is present but does not load: {e:#}",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use exotap_introspect::bzimage::Vmlinux;

    #[test]
    fn an_unpacked_copy_is_kept_mapped_and_a_corrupt_one_is_unpacked_again() {
        let Some(dir) =
            exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)
        else {
            println!("SKIP: no HOME or XDG_CACHE_HOME to find the kernel cache");
            return;
        };
        let bytes = match std::fs::read(dir.join("vmlinuz")) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("SKIP: the default guest kernel is not cached (exotap image fetch)");
                return;
            }
            Err(e) => panic!("cannot read the cached kernel: {e}"),
        };
        let root = tempfile::tempdir().unwrap();
        let want = Vmlinux::from_bzimage(&bytes).unwrap();

        let first = super::unpacked(root.path(), &bytes).unwrap();
        let second = super::unpacked(root.path(), &bytes).unwrap();

        let same = |v: &Vmlinux| v.bytes() == want.bytes();
        assert!(same(&first) && same(&second), "the unpacked copy differs");
        let keyed: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
        assert_eq!(keyed.len(), 1, "one directory per bzImage");
        let file = keyed[0].as_ref().unwrap().path().join("vmlinux");
        drop((first, second));
        // Corrupt it (a write: another modification time): detected and unpacked again.
        let mut bad = std::fs::read(&file).unwrap();
        bad[0x1000] ^= 0xff;
        std::fs::write(&file, &bad).unwrap();
        let third = super::unpacked(root.path(), &bytes).unwrap();
        assert!(same(&third), "the corrupt copy was used");
        assert!(
            std::fs::read(&file).unwrap() == want.bytes(),
            "the corrupt copy was not replaced"
        );
    }

    #[test]
    fn only_the_most_recently_used_unpacked_kernels_are_kept() {
        let root = tempfile::tempdir().unwrap();
        let now = std::time::SystemTime::now();
        let dir = |i: u64| {
            let d = root.path().join(format!("k{i}"));
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("vmlinux"), b"elf").unwrap();
            let lock = std::fs::File::create(d.join(".lock")).unwrap();
            // k0 used last, k5 first.
            lock.set_modified(now - std::time::Duration::from_secs(60 * (i + 1)))
                .unwrap();
            d
        };
        let dirs: Vec<_> = (0..6).map(dir).collect();
        // k5, the oldest, is being unpacked by another exotap: left.
        let busy = std::fs::File::open(dirs[5].join(".lock")).unwrap();
        busy.lock().unwrap();
        let current = root.path().join("current");
        std::fs::create_dir(&current).unwrap();

        super::prune_unpacked(root.path(), &current);

        let mut left: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["current", "k0", "k1", "k2", "k5"]);
    }

    #[test]
    fn the_release_is_read_from_the_images_banner() {
        let Some(image) = super::cached_debian_image() else {
            println!("SKIP: the default guest kernel is not cached (exotap image fetch)");
            return;
        };
        // Debian names the package after the release `uname -r` prints.
        assert_eq!(
            image.release().as_deref(),
            Some(exotap_guest_images::DEFAULT_KERNEL)
        );
    }
}
