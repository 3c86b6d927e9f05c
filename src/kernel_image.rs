//! The guest kernel's image on the host: the bzImage from the cache (or a path), its ELF
//! vmlinux, and the symbols recovered from its kallsyms tables. `exotap symbols`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use exotap_guest_images as images;
use exotap_introspect::bzimage::Vmlinux;
use exotap_introspect::kallsyms;
use exotap_introspect::symbols::SymbolTable;

/// Which kernel image to read.
#[derive(Debug, Args, Clone)]
pub struct ImageArgs {
    /// Kernel ABI name or package name; fetched into the cache when missing.
    #[arg(long, default_value = images::DEFAULT_KERNEL, value_name = "VERSION")]
    pub kernel: String,
    /// Read this bzImage instead of a cached Debian kernel.
    #[arg(long, value_name = "PATH")]
    pub bzimage: Option<PathBuf>,
}

impl ImageArgs {
    /// The bzImage path, fetching the kernel into the cache when needed.
    ///
    /// # Errors
    /// When the kernel cannot be fetched.
    pub fn bzimage_path(&self) -> anyhow::Result<PathBuf> {
        match &self.bzimage {
            Some(path) => Ok(path.clone()),
            None => Ok(images::ensure_kernel(&self.kernel)
                .context("cannot get the guest kernel")?
                .bzimage),
        }
    }
}

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

    /// Loads the image `args` names.
    ///
    /// # Errors
    /// As [`ImageArgs::bzimage_path`] and [`KernelImage::load`].
    pub fn from_args(args: &ImageArgs) -> anyhow::Result<Self> {
        Self::load(args.bzimage_path()?)
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
}

/// `exotap symbols PATTERN`.
#[derive(Debug, Args)]
pub struct SymbolsArgs {
    /// Symbol name or wildcard pattern (`vfs_*`, `*sys_getpid`, `?`).
    pub pattern: String,
    /// Only code symbols (T, t, W, w).
    #[arg(long)]
    pub text: bool,
    /// Add this KASLR slide (hex with 0x) to every address, e.g. the one `exotap info` printed.
    #[arg(long, value_parser = crate::attach::parse_u64, value_name = "SLIDE")]
    pub slide: Option<u64>,
    #[command(flatten)]
    pub image: ImageArgs,
}

/// Prints the symbols matching a pattern as `nm` does, with sizes; exit code 1 when none match.
///
/// # Errors
/// When the image cannot be loaded.
pub fn run_symbols(args: &SymbolsArgs) -> anyhow::Result<i32> {
    let image = KernelImage::from_args(&args.image)?;
    let slide = args.slide.unwrap_or(0);
    let mut found = 0usize;
    for sym in image.symbols.matching(&args.pattern) {
        if args.text && !sym.is_text() {
            continue;
        }
        found += 1;
        outln!(
            "{:016x} {} {} (size {:#x})",
            sym.addr.wrapping_add(slide),
            sym.kind,
            sym.name,
            sym.size
        );
    }
    tracing::debug!(
        "{} symbols in {} recovered in {:.0} ms",
        image.symbols.len(),
        image.path.display(),
        image.load_time.as_secs_f64() * 1e3
    );
    if found == 0 {
        eprintln!(
            "exotap: no symbol matches {} (of {} in {})",
            args.pattern,
            image.symbols.len(),
            image.path.display()
        );
        return Ok(1);
    }
    Ok(0)
}
