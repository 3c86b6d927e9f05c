//! The guest kernel's image on the host: its ELF vmlinux and the symbols recovered from its
//! kallsyms tables. Which image (a cached Debian kernel, a path) is the caller's choice.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
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
        let vmlinux = Vmlinux::from_bzimage(&bytes)
            .with_context(|| format!("cannot unpack the vmlinux inside {}", path.display()))?;
        let found = kallsyms::extract(&vmlinux)
            .with_context(|| format!("cannot recover the symbols of {}", path.display()))?;
        let symbols = SymbolTable::from_kallsyms(&found);
        Ok(Self {
            path,
            vmlinux,
            symbols,
            load_time: start.elapsed(),
        })
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

/// The cached Debian kernel (for unit tests that need a real image): `None` only when it is
/// not cached (no `vmlinuz` in the cache, or no HOME/XDG_CACHE_HOME to find the cache), for
/// the caller to print its `SKIP: ... not cached`.
///
/// # Panics
/// When the file is there but cannot be examined or does not load: a cache that is present
/// and broken fails the test; it is not a kernel that was never fetched.
#[cfg(test)]
pub(crate) fn cached_debian_image() -> Option<KernelImage> {
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
