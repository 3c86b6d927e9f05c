//! x86-64 structural analysis: decoding, basic blocks, control-flow graphs and
//! register/flag liveness, per function and for a whole kernel text.
//!
//! Input is bytes plus addresses and function ranges; where the ranges come from
//! (kallsyms, ELF, System.map) is the caller's business. Decoding is iced-x86.

pub mod cfg;
pub mod decode;
pub mod liveness;
pub mod regs;
pub mod text;

pub use cfg::{BasicBlock, BlockExit, Cfg};
pub use decode::{thunk_register, AnalysisConfig, CallEffect, Flow, FunctionDecoder, Insn};
pub use liveness::Liveness;
pub use regs::{LiveState, RegSet, StatusFlags};
pub use text::{
    ranges_from_starts, zeroed_text, BranchTargets, CodeView, FunctionAnalysis, FunctionRange,
    TextAnalysis, TextError,
};
