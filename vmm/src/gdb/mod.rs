//! The GDB remote serial protocol, client side, as QEMU's gdbstub speaks it.

pub mod client;
#[cfg(test)]
mod fake_stub;
pub mod machine;
pub mod packet;
pub mod target;

pub use client::{GdbClient, GdbError, Interrupter, StopReply, ThreadId};
pub use machine::GdbMachine;
