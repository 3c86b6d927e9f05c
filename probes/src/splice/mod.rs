//! Splicing (DESIGN.md, key mechanism 2): replace exactly one instruction of at least
//! five bytes by a `jmp rel32` to a code patch that runs the probes, then a relocated
//! copy of the displaced instruction, then jumps back.
//!
//! [`plan()`] decides per address whether to splice, trap or refuse, with a reason;
//! [`reloc`] moves one instruction to another address; [`patch`] generates the patch and
//! the splice bytes; [`patch_heap`] hands out patch-heap address space. [`sparc`] is the
//! SPARC v9 counterpart (decoder/encoder, planner, patches with springboards).

pub mod patch;
pub mod patch_heap;
pub mod plan;
pub mod reloc;
pub mod sparc;

pub use patch::{generate, out_of_line, OutOfLine, Patch, PatchError, PatchRequest, Probe, Ring};
pub use patch_heap::{PatchHeap, PatchHeapError};
pub use plan::{disjoint_ranges, plan, Refusal, Site, SpliceContext, SpliceDecision, TrapReason};
pub use reloc::{relocate, CallReturn, RelocError, RelocShape, Relocated};
