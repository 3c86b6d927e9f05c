//! Backends that run the machine under the instrumentation.
//!
//! * [`qemu`]: launch `qemu-system-x86_64` with a kernel and initramfs, watch its serial
//!   console for the guest protocol, and (in a later step) attach over its gdbstub.
//! * [`shared_ram`]: guest RAM in a shared memory backend, mapped by exotap (the zero-stop
//!   data path of the QEMU backend).
//! * [`host`]: what this host's `/dev/kvm` can do, used by backend auto-selection.
//! * [`console`]: the guest protocol on the serial console (`EXOTAP-*` markers).
//! * [`control_socket`]: a running exotap VMM's control socket: the control interface over
//!   a unix socket, for another exotap process (`--target vmm:PATH`).
//! * [`kvm`]: exotap's own minimal VMM on `/dev/kvm` (hardware virtualization only).
//! * [`unicorn`]: one emulated x86-64 or SPARC V9 CPU (Unicorn) with a flat memory map,
//!   for deterministic runs of mini-kernels and extracted kernel functions.

pub mod console;
pub mod control;
pub mod control_socket;
pub mod gdb;
pub mod host;
pub mod kvm;
pub mod qemu;
pub mod shared_ram;
#[cfg(feature = "unicorn")]
pub mod unicorn;
