//! `exotap image ...`: guest images in the cache.

use anyhow::Context;
use clap::{Args, Subcommand};
use exotap_guest_images as images;

#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Fetch the Debian cloud kernel (and busybox, and the workloads) into the cache.
    ///
    /// A second fetch verifies every cached file (size and sha256) and downloads nothing.
    /// Other commands hash a cached file again only when it changed (size, modification
    /// time or inode) since the last full check.
    Fetch(FetchArgs),
    /// List the x86-64 Debian kernels apt knows (the unsigned cloud-amd64 and amd64
    /// packages) and what the cache holds of each.
    List,
}

#[derive(Debug, Args)]
pub struct FetchArgs {
    /// Kernel ABI name or package name (linux-image-VERSION-unsigned).
    #[arg(long, env = "EXOTAP_KERNEL", default_value = images::DEFAULT_KERNEL, value_name = "VERSION")]
    pub kernel: String,
    /// Also fetch the matching -dbg package's vmlinux (with DWARF), System.map and the debug
    /// files of some modules (evdev, kvm*, irqbypass, nfsd) (~282 MB download).
    #[arg(long)]
    pub debuginfo: bool,
}

pub fn run(cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Fetch(args) => fetch(&args),
        ImageCommand::List => list(),
    }
}

fn list() -> anyhow::Result<()> {
    let known = images::debian::x86_kernels().context("cannot ask apt which kernels it knows")?;
    if known.is_empty() {
        outln!("apt knows no linux-image-*-amd64-unsigned package: run apt-get update");
    }
    for abi in known {
        let held = match images::kernel::cached(&abi)? {
            (true, true) => "cached, with debug info",
            (true, false) => "cached",
            (false, true) => "debug info cached",
            (false, false) => "",
        };
        let default = if abi == images::DEFAULT_KERNEL {
            " (default)"
        } else {
            ""
        };
        outln!("{abi:<32} {held}{default}");
    }
    Ok(())
}

fn fetch(args: &FetchArgs) -> anyhow::Result<()> {
    // The command that says the cache is sound hashes all of it (other commands trust the
    // stamp of the last full check: guest_images::cache).
    images::cache::distrust_stamps();
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
    for module in &kernel.lacking_modules {
        outln!("module     {module}: not in this kernel's package (built in, or not built)");
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
        for m in &debug.modules {
            outln!("module     {}", m.display());
        }
    }
    Ok(())
}
