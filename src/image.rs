//! `exotap image ...`: guest images in the cache.

use anyhow::Context;
use clap::{Args, Subcommand};
use exotap_guest_images as images;

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Fetch the Debian cloud kernel (and busybox, and the workloads) into the cache.
    ///
    /// A second fetch verifies the cached files (size and sha256) and downloads nothing.
    Fetch(FetchArgs),
}

#[derive(Debug, Args)]
pub struct FetchArgs {
    /// Kernel ABI name or package name (linux-image-VERSION-unsigned).
    #[arg(long, default_value = images::DEFAULT_KERNEL, value_name = "VERSION")]
    pub kernel: String,
    /// Also fetch the matching -dbg package's vmlinux (with DWARF) and System.map (~282 MB download).
    #[arg(long)]
    pub debuginfo: bool,
}

pub fn run(cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Fetch(args) => fetch(&args),
    }
}

fn fetch(args: &FetchArgs) -> anyhow::Result<()> {
    let kernel = images::ensure_kernel(&args.kernel).context("cannot fetch the guest kernel")?;
    outln!(
        "kernel     {} ({}) {}",
        kernel.abi,
        kernel.version,
        kernel.bzimage.display()
    );
    outln!("config     {}", kernel.config.display());
    for module in &kernel.modules {
        outln!("module     {}", module.display());
    }
    let busybox = images::kernel::ensure_busybox().context("cannot fetch busybox")?;
    outln!("busybox    {}", busybox.display());
    for w in images::workloads::ensure_workloads().context("cannot build the workloads")? {
        outln!("workload   {} {}", w.name, w.binary.display());
    }
    if args.debuginfo {
        let debug = images::ensure_debuginfo(&args.kernel)
            .context("cannot fetch the kernel's debug info")?;
        outln!("vmlinux    {}", debug.vmlinux.display());
        outln!("System.map {}", debug.system_map.display());
    }
    Ok(())
}
