//! Benchmarks of the x86-64 structural analysis.
fn main() {}
