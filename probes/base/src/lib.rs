//! What every layer of the probe engine shares (docs/architecture.md): the guest kernel's
//! image on the host ([`kernel_image`]), the format of the per-vCPU trace rings that compiled
//! code writes and the host drains ([`rings`]), and the procfs files a script serves from the
//! host ([`procfs`]).

pub mod kernel_image;
pub mod procfs;
pub mod rings;
