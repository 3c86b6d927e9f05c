//! Guest memory of a live [`Machine`] as introspect/ sees it: the consumer-side
//! [`PhysicalMemory`] trait over the backend's control interface.

use exotap_introspect::memory::{MemoryError, PhysicalMemory};
use exotap_vmm::control::{ControlError, Machine};

/// Reads guest-physical memory through a backend.
pub struct BackendMemory<'a, M: Machine + ?Sized>(pub &'a mut M);

impl<M: Machine + ?Sized> PhysicalMemory for BackendMemory<'_, M> {
    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
        self.0.read_phys(addr, buf).map_err(|e| match e {
            ControlError::Memory { addr, len, .. } => MemoryError::Unmapped { addr, len },
            other => MemoryError::Backend(Box::new(other)),
        })
    }
}

impl<M: Machine + ?Sized> std::fmt::Debug for BackendMemory<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BackendMemory")
    }
}
