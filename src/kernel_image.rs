//! Which guest kernel image to read (`--kernel`, `--bzimage`), loaded as the engine's
//! [`KernelImage`]; `exotap symbols`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use exotap_guest_images as images;
pub use exotap_probes::live::KernelImage;

/// Which kernel image to read.
#[derive(Debug, Args, Clone)]
pub struct ImageArgs {
    /// Kernel ABI name or package name; fetched into the cache when missing.
    #[arg(long, env = "EXOTAP_KERNEL", default_value = images::DEFAULT_KERNEL, value_name = "VERSION")]
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

    /// Loads the image these arguments name.
    ///
    /// # Errors
    /// As [`ImageArgs::bzimage_path`] and [`KernelImage::load`].
    pub fn load(&self) -> anyhow::Result<KernelImage> {
        KernelImage::load(self.bzimage_path()?)
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
    let image = args.image.load()?;
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
