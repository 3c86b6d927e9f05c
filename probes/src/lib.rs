//! The instrumentation engine and the probe language.

pub mod compile;
pub mod jit;
pub mod lang;
pub mod live;
pub mod rings;
pub mod splice;
