//! Guest memory of a live [`Machine`] as introspect/ sees it: the consumer-side
//! [`PhysicalMemory`] trait over the backend's control interface.

use anyhow::Context as _;
use exotap_introspect::memory::{MemoryError, PhysicalMemory};
use exotap_introspect::paging::{pti_kernel_cr3, AddressSpace};
use exotap_vmm::control::{ControlError, Machine, RegisterFile, VcpuId};

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

/// The kernel's own view of virtual memory, whatever mode the vCPUs stopped in: vCPU 0's
/// page-table root with page-table isolation's user half cleared (the kernel half maps all of
/// the kernel: text, stacks, the patch heap), and whether it has five levels.
///
/// A backend's `read_virt` walks the vCPU's *current* CR3; a vCPU stopped in user mode under
/// PTI holds the user half, which maps almost no kernel memory, so kernel addresses read
/// through it fail. Kernel stacks, text and data are read and written through here instead.
///
/// # Errors
/// vCPU 0's registers cannot be read, or it is not x86-64.
fn kernel_root<M: Machine + ?Sized>(machine: &mut M) -> anyhow::Result<(u64, bool)> {
    match machine.registers(VcpuId(0))? {
        RegisterFile::X86_64(regs) => Ok((pti_kernel_cr3(regs.cr3), regs.cr4 & (1 << 12) != 0)),
        RegisterFile::Sparc64(_) => anyhow::bail!("kernel page tables are walked on x86-64 only"),
    }
}

/// Reads kernel virtual memory through the kernel's page tables (see `kernel_root`); the
/// guest is stopped.
///
/// # Errors
/// An address is not mapped, or the backend fails.
pub fn read_kernel<M: Machine + ?Sized>(
    machine: &mut M,
    va: u64,
    buf: &mut [u8],
) -> anyhow::Result<()> {
    let (cr3, la57) = kernel_root(machine)?;
    let mut mem = BackendMemory(machine);
    AddressSpace::new(&mut mem, cr3, la57)
        .read(va, buf)
        .with_context(|| format!("kernel address {va:#x} ({} bytes)", buf.len()))
}

/// Writes kernel virtual memory through the kernel's page tables, page by page at the
/// physical addresses they map to (see `kernel_root`); the guest is stopped. Kernel text
/// goes through the splicer, which knows QEMU must see its writes: this is for data (stack
/// slots, variables).
///
/// # Errors
/// An address is not mapped, or the backend fails.
pub fn write_kernel<M: Machine + ?Sized>(
    machine: &mut M,
    va: u64,
    data: &[u8],
) -> anyhow::Result<()> {
    let (cr3, la57) = kernel_root(machine)?;
    let mut done = 0usize;
    while done < data.len() {
        let at = va.wrapping_add(done as u64);
        let phys = {
            let mut mem = BackendMemory(&mut *machine);
            AddressSpace::new(&mut mem, cr3, la57)
                .translate(at)
                .with_context(|| format!("kernel address {at:#x}"))?
                .phys
        };
        let in_page = usize::try_from(0x1000 - (at & 0xfff)).unwrap_or(1);
        let n = in_page.min(data.len() - done);
        machine.write_phys(phys, &data[done..done + n])?;
        done += n;
    }
    Ok(())
}
