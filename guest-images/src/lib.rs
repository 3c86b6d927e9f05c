//! Guest images: Debian kernel packages fetched and cached, an initramfs built in Rust, and the
//! workload programs compiled from `guest-images/workloads/*.c`.

pub mod cache;
pub mod debian;
pub mod init;
pub mod initramfs;
pub mod kernel;
pub mod minikernel;
pub mod workloads;

use std::path::{Path, PathBuf};

pub use init::GuestJob;
pub use kernel::{
    ensure_debuginfo, ensure_kernel, Debuginfo, Kernel, DEBUG_MODULES, DEFAULT_KERNEL,
};

/// Errors of preparing a guest's initramfs.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// Fetching busybox failed.
    #[error("cannot get busybox for the initramfs")]
    Busybox(#[source] kernel::ImageError),
    /// Building the workloads failed.
    #[error(transparent)]
    Workloads(#[from] workloads::WorkloadError),
    /// Assembling the archive failed.
    #[error(transparent)]
    Initramfs(#[from] initramfs::InitramfsError),
    /// Reading or writing a file failed.
    #[error("cannot access {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The initramfs for `job`: busybox, `/init`, the job and every workload (add files to it,
/// e.g. modules, before writing it).
///
/// # Errors
/// When busybox or the workloads cannot be had.
pub fn build_initramfs(job: &GuestJob) -> Result<initramfs::Initramfs, PrepareError> {
    let busybox_path = kernel::ensure_busybox().map_err(PrepareError::Busybox)?;
    let busybox = std::fs::read(&busybox_path).map_err(io_err(&busybox_path))?;
    let mut built = Vec::new();
    for w in workloads::ensure_workloads()? {
        let bytes = std::fs::read(&w.binary).map_err(io_err(&w.binary))?;
        built.push((w, bytes));
    }
    Ok(init::assemble(busybox, &built, job)?)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PrepareError {
    let path = path.to_owned();
    move |source| PrepareError::Io { path, source }
}

/// Builds the gzip'd initramfs for `job` at `out`: busybox, `/init`, the job and every workload.
///
/// # Errors
/// When busybox or the workloads cannot be had, or the file cannot be written.
pub fn write_initramfs(job: &GuestJob, out: &Path) -> Result<(), PrepareError> {
    let fs = build_initramfs(job)?;
    let file = std::fs::File::create(out).map_err(io_err(out))?;
    let mut writer = std::io::BufWriter::new(file);
    fs.write_gz(&mut writer)?;
    std::io::Write::flush(&mut writer).map_err(io_err(out))?;
    Ok(())
}
