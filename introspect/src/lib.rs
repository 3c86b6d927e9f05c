//! Understanding a guest kernel from outside it: page-table walks, symbols, KASLR, layout,
//! ORC stack unwinding.
//!
//! Everything here works on a read-only view of guest memory so it is testable on files
//! and snapshots.

pub mod btf;
pub mod bzimage;
pub mod dwarf;
pub mod heap;
pub mod kallsyms;
pub mod kaslr;
pub mod layout;
pub mod memory;
#[cfg(test)]
mod mutation;
pub mod orc;
pub mod paging;
pub mod symbols;
pub mod x86;
