//! The instrumentation engine and the probe language.
