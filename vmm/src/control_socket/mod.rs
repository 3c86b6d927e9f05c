//! A running exotap VMM's control socket: the [`Machine`] interface over a unix socket, so that
//! another exotap process (`exotap run --target vmm:PATH`, `exotap count --target vmm:PATH`)
//! drives the VMM's guest as the VMM's own engine does.
//!
//! # Why hand-written
//! The messages are the [`Machine`] trait's calls, a dozen fixed records of integers and byte
//! strings; a serialization crate would add a dependency to the static exotap of the nested
//! test for less code than the framing below. The GDB remote protocol (QEMU's gdbstub) does
//! not carry what the engine needs from a VMM (IDTR, the pause count, the patch heap).
//!
//! # The protocol
//! One client at a time, request then response, over a `SOCK_STREAM` unix socket. Every
//! message is a frame: a little-endian `u32` length of the body, then the body. Integers are
//! little-endian; a byte string (`bytes`, `str`) is a `u32` length and its bytes.
//!
//! A request body is an opcode byte and its arguments:
//!
//! | op | name | arguments | answer |
//! |---|---|---|---|
//! | 1 | hello | magic `EXOTAPVM`, `u32` version ([`VERSION`]), `u32` client pid | `u32` version, `str` backend, `u8` flags (bit 0: memory is read while the vCPUs run; bit 1: op 19 shares the RAM), `u8` heap known, `u64` heap GPA, `u64` heap size |
//! | 2 | vcpus | | `u32` n, n × `u32` vCPU id |
//! | 3 | read physical | `u64` addr, `u32` len | `bytes` |
//! | 4 | write physical | `u64` addr, `bytes` data | |
//! | 5 | read virtual | `u32` vCPU, `u64` addr, `u32` len | `bytes` |
//! | 6 | write virtual | `u32` vCPU, `u64` addr, `bytes` data | |
//! | 7 | registers | `u32` vCPU | `u8` arch (0 x86-64: 16 GPRs, rip, rflags as `u64`, 6 segment selectors as `u16`, fs_base, gs_base, kernel_gs_base, cr0, cr2, cr3, cr4, efer as `u64`; 1 SPARC V9: 32 registers, pc, npc, pstate, ccr, cwp as `u64`) |
//! | 8 | set pc | `u32` vCPU, `u64` pc | |
//! | 9 | pause | | |
//! | 10 | resume | | |
//! | 11 | is paused | | `u8` |
//! | 12 | breakpoint | `u64` addr, `u8` insert | |
//! | 13 | wait event | `u32` timeout in ms (at most [`MAX_WAIT`]) | `u8` 0 none, 1 an event |
//! | 14 | step | `u32` vCPU | event |
//! | 15 | IDT base | `u32` vCPU | `u64` |
//! | 16 | set register | `u32` vCPU, `str` name, `u64` value | |
//! | 17 | pause count | | `u8` known, `u64` count |
//! | 18 | release | | |
//! | 19 | share RAM | | `u32` n, n × (`u64` GPA, `u64` size, `u64` file offset); the response frame carries one file descriptor (`SCM_RIGHTS`), the file holding them all |
//!
//! The hello's flags bit 1 says the server can share its guest RAM (op 19). exotap's VMM keeps
//! the RAM in a memfd; a client maps it and reads and writes guest-physical memory there with
//! no request (counters, rings, maps; on KVM text too, since no translated-block cache sits
//! between the file and the vCPUs). Regions in another file, and addresses outside them, go
//! through ops 3 and 4. A client checks that every region lies inside the file before it maps
//! it (a mapping past the file's end faults on access).
//! An event is a `u8` kind: 0 breakpoint (`u32` vCPU, `u64` pc), 1 stepped (`u32` vCPU),
//! 2 paused, 3 exited.
//!
//! A response body is a status byte: 0 and the answer, or 1 and an error: a `u8` kind, then
//! 0 memory (`u64` addr, `u64` len, `u8` 0 physical / 1 virtual), 1 no such vCPU (`u32`),
//! 2 the guest is running, 3 anything else (`str` message). A request the server cannot parse
//! (unknown opcode, short arguments, a transfer over [`MAX_TRANSFER`]) is answered with an
//! error and the connection goes on; a frame over [`MAX_FRAME`] ends the connection. The
//! client splits larger transfers.
//!
//! # When a client ends
//! A client can change the guest only through its connection. When the connection ends (the
//! client exited, or was killed with its probes in), the server hands its machine to the
//! `on_end` of [`ControlServer::spawn`] (exotap's VMM undoes what the client's recovery journal
//! still lists there) and resumes a guest the client left paused.
//!
//! # The modules
//! `wire` writes and reads the messages; `server` answers them on a [`Machine`];
//! `client` is the [`Machine`] that sends them.
//!
//! [`Machine`]: crate::control::Machine

use std::time::Duration;

mod client;
mod server;
#[cfg(test)]
mod tests;
mod wire;

pub use client::ControlClient;
pub use server::{serve_connection, Client, ControlServer, MakeMachine, OnEnd, ServedGuest};

/// The protocol version this side speaks.
pub const VERSION: u32 = 1;
/// The hello's magic.
const MAGIC: &[u8; 8] = b"EXOTAPVM";
/// The largest memory transfer in one request (the client splits larger ones).
pub const MAX_TRANSFER: usize = 1 << 20;
/// The largest frame either side accepts.
pub const MAX_FRAME: usize = MAX_TRANSFER + 4096;
/// The longest a wait-event request blocks the server.
pub const MAX_WAIT: Duration = Duration::from_secs(10);
/// The backend name the client reports: [`Machine::backend`](crate::control::Machine::backend)
/// of a [`ControlClient`].
pub const CLIENT_BACKEND: &str = "exotap vmm (control socket)";

const OP_HELLO: u8 = 1;
const OP_VCPUS: u8 = 2;
const OP_READ_PHYS: u8 = 3;
const OP_WRITE_PHYS: u8 = 4;
const OP_READ_VIRT: u8 = 5;
const OP_WRITE_VIRT: u8 = 6;
const OP_REGISTERS: u8 = 7;
const OP_SET_PC: u8 = 8;
const OP_PAUSE: u8 = 9;
const OP_RESUME: u8 = 10;
const OP_IS_PAUSED: u8 = 11;
const OP_BREAKPOINT: u8 = 12;
const OP_WAIT_EVENT: u8 = 13;
const OP_STEP: u8 = 14;
const OP_IDT_BASE: u8 = 15;
const OP_SET_REGISTER: u8 = 16;
const OP_PAUSE_COUNT: u8 = 17;
const OP_RELEASE: u8 = 18;
const OP_SHARE_RAM: u8 = 19;

/// Errors of the protocol itself (the [`Machine`](crate::control::Machine) calls' own errors
/// travel inside it).
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The socket failed.
    #[error("the control socket failed")]
    Io(#[from] std::io::Error),
    /// A frame too large to be one of ours.
    #[error("a frame of {0} bytes is over the protocol's limit")]
    FrameTooLarge(usize),
    /// A message that does not parse.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The other side speaks another protocol or version, or refused the hello.
    #[error("the hello was refused: {0}")]
    Hello(String),
}
