//! The instrumentation engine and the probe language.

pub mod lang;
pub mod splice;
