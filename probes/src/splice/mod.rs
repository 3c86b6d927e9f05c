//! Splicing: planning, relocation and code patches.
