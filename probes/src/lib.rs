//! The instrumentation engine and the probe language.

pub mod compile;
pub mod jit;
pub mod kernel_image;
pub mod lang;
pub mod live;
pub mod procfs;
pub mod rings;
pub mod splice;
