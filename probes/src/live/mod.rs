//! The live engine: instrumenting a running guest kernel from outside it, through any
//! backend's control interface ([`exotap_vmm::control::Machine`]: QEMU's gdbstub, or
//! exotap's own KVM VMM, whose session is a handle on the VM and reads guest memory without
//! stopping it, [`GuestSession::over`]). Every live path of exotap goes through it: the verbs (`count`, `time`, `trace`,
//! `nullify`, `replace`, `splice-report`) and scripts, compiled into the guest
//! ([`compiled`]) or evaluated by the host at trap probes ([`trap_script`]).
//!
//! # A session
//!
//! A [`GuestSession`] is one attachment of the engine to one guest: from connecting to the
//! gdbstub to detaching. Its phases, in order:
//!
//! 1. **Attach** ([`GuestSession::attach`]): connect (the guest stops) and survey the
//!    running kernel: the KASLR slide, the kernel layout ([`attach::Survey`]).
//! 2. **Plan** ([`GuestSession::plan`]): map the patch heap into kernel space, read and
//!    analyse the live kernel text ([`splicer::LiveKernel`]); every site can then be
//!    planned: splice, trap or refusal with its reason ([`splicer::LiveKernel::plan`]).
//!    Names become [`splicer::Request`]s with [`operation::requests`] (verbs) or from the
//!    script's resolved probe points ([`compiled`]).
//! 3. **Install** ([`GuestSession::install`], [`GuestSession::install_compiled`]): generate
//!    the patches into the heap, check every site still holds the bytes it was planned over,
//!    write the `jmp`s in one batch, all with the guest stopped. Trap probes are armed on
//!    the session's machine instead ([`trap_script`]): gdbstub breakpoints with out-of-line
//!    copies in the patch heap.
//! 4. **Run and drain** ([`GuestSession::resume`], [`GuestSession::wait`],
//!    [`GuestSession::pause`], [`GuestSession::drain`]): the guest runs; the host stops it
//!    briefly to drain the per-vCPU rings and read counters and data, or, when the guest's
//!    RAM is shared with exotap ([`shared`]), reads them while the vCPUs run, with no stop.
//! 5. **Remove** ([`GuestSession::remove`]): with the guest stopped, write back the exact
//!    original bytes, read the final counters, histograms and records, and hash the touched
//!    text pages before and after ([`splicer::RemoveReport`]).
//! 6. **Detach** ([`GuestSession::detach`]): QEMU drops its breakpoints, the guest runs on.
//!
//! # Who calls what
//!
//! - `src/verbs.rs` (the binary) parses the verbs' arguments into an
//!   [`operation::Operation`], drives one session through the phases (booting a guest for
//!   the run or attaching to `--target`), and prints what the reports say.
//! - [`compiled::start_script`] plans a script: compiled when every kernel probe compiles
//!   ([`compiled::start`]: phases 1-6 on a session, begin/end/timer probes on the host),
//!   else host-evaluated ([`trap_script::start`]: attach, breakpoints, one stop per hit).
//!
//! # Errors and cleanup
//!
//! Every phase returns an error rather than panicking on bad guest data. Removal always
//! runs: a session dropped without [`GuestSession::detach`] (an error in a later phase, a
//! panic unwinding, an early return) pauses the guest, removes every splice still in and
//! detaches. Ctrl-C (and `--duration`, and the guest's `exotap_wait unsplice`) is the
//! callers' stop flag ([`crate::lang::driver::stop_on_ctrl_c`]): they leave their loop and
//! run the remove phase as for a normal end. A guest that ended ([`GuestSession::abandon`])
//! is not touched again.
//!
//! What a session puts into the guest is journaled in the patch heap first, and a guardian
//! process undoes it if the process dies without removing it ([`recover`]).
//!
//! The library never prints: what a verb or script shows goes to the writer it is given
//! (a script's output, the verbs' report lines formatted by the binary), and diagnostics go
//! through `tracing`.

pub mod attach;
mod check;
pub mod compiled;
pub mod drainer;
pub mod guest_memory;
mod host_context;
pub mod jit;
pub use crate::kernel_image;
pub mod modules;
pub mod operation;
pub mod pretty;
pub mod recover;
pub mod sampling;
pub mod session;
pub mod shared;
pub mod splicer;
pub mod stacks;
pub mod target_vars;
pub mod tracepoints;
pub mod trap_point;
pub mod trap_script;
pub mod traps;

pub use kernel_image::KernelImage;
pub use session::GuestSession;
