//! `exotap boot --backend kvm --count-entry FUNCTION`: the counting entry splice of
//! `exotap selftest`, done through exotap's own VMM instead of QEMU's gdbstub.
//!
//! At the guest's wait point `splice` it pauses the vCPUs, finds the KASLR slide (IDT base
//! from the vCPU's IDTR, and `linux_banner`: both must agree), maps the patch heap past
//! `_end`, writes a counter and the patch into the heap and the `jmp` over the function's
//! entry instruction, and resumes. At `unsplice` it pauses, reads the counter, restores the
//! original bytes and resumes. No trap is used: int3 debug exits did not reach userspace under
//! QEMU TCG's emulated SVM, where this is verified (tests/kvm_nested/).
//!
//! Findings are printed as `HOST-RESULT key=value`, as `exotap selftest` does.

use anyhow::{bail, Context};
use exotap_introspect::heap;
use exotap_introspect::kaslr::{self, KaslrAnchors};
use exotap_introspect::layout::KernelLayout;
use exotap_introspect::paging::{pti_kernel_cr3, AddressSpace};
use exotap_vmm::control::{Machine, VcpuId};
use exotap_vmm::kvm::{KvmMachine, KvmPhaseHook};
use exotap_vmm::qemu::PatchHeapRange;

use crate::entry_patch::{counter_patch, jmp_rel32};
use crate::kernel_image::KernelImage;
use exotap_probes::live::guest_memory::BackendMemory;

/// Offsets inside the patch heap.
const COUNTER_OFFSET: u64 = 0x1000;
const PATCH_OFFSET: u64 = 0x2000;
/// CR4.LA57.
const CR4_LA57: u64 = 1 << 12;

fn report(key: &str, value: impl std::fmt::Display) {
    outln!("HOST-RESULT {key}={value}");
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A splice in place.
struct Placed {
    entry_phys: u64,
    original: [u8; 5],
    jump: [u8; 5],
    counter_phys: u64,
}

/// Splices a counter at one function's entry between the `splice` and `unsplice` waits.
pub struct CountingSplice {
    image: KernelImage,
    heap: PatchHeapRange,
    function: String,
    placed: Option<Placed>,
}

impl CountingSplice {
    /// A hook counting calls of `function` of `image`, with the patch heap at `heap`.
    pub fn new(image: KernelImage, heap: PatchHeapRange, function: String) -> Self {
        Self {
            image,
            heap,
            function,
            placed: None,
        }
    }

    fn splice(&mut self, m: &mut KvmMachine) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        m.pause()?;
        let snap = m.snapshot(VcpuId(0))?;
        let cr3 = pti_kernel_cr3(snap.regs.cr3);
        let la57 = snap.regs.cr4 & CR4_LA57 != 0;
        let anchors = KaslrAnchors::from_image(&self.image.symbols, &self.image.vmlinux)
            .context("the image lacks a KASLR anchor")?;
        let mut mem = BackendMemory(&mut *m);
        let mut space = AddressSpace::new(&mut mem, cr3, la57);
        let slide = kaslr::detect(&mut space, snap.idt_base, &anchors)
            .context("cannot find the KASLR slide")?
            .slide;
        let layout = KernelLayout::read(&mut space, &self.image.symbols, slide)
            .context("cannot read the kernel layout")?;
        let plan = heap::plan(
            &mut space,
            (layout.text.0, layout.end),
            heap::HeapPlacement::Auto,
            self.heap.base,
            self.heap.size,
        )
        .context("cannot plan the patch heap mapping")?;
        let entry = self.image.address(&self.function)?.wrapping_add(slide);
        let mut original = [0u8; 5];
        space.read(entry, &mut original)?;
        let entry_phys = space.translate(entry)?.phys;
        report("kvm.slide", format!("{slide:#x}"));
        report("kvm.heap.va", format!("{:#x}", plan.va));
        report(
            &format!("bytes.{}.spliced_over", self.function),
            hex(&original),
        );
        for w in &plan.writes {
            m.write_phys(w.entry_addr, &w.new.to_le_bytes())?;
        }
        let patch_va = plan.va + PATCH_OFFSET;
        let patch = counter_patch(entry, original, patch_va, plan.va + COUNTER_OFFSET)?;
        m.write_phys(plan.phys + COUNTER_OFFSET, &0u64.to_le_bytes())?;
        m.write_phys(plan.phys + PATCH_OFFSET, &patch)?;
        let jump = jmp_rel32(entry, patch_va)?;
        m.write_phys(entry_phys, &jump)?;
        self.placed = Some(Placed {
            entry_phys,
            original,
            jump,
            counter_phys: plan.phys + COUNTER_OFFSET,
        });
        report(
            "kvm.splice_ms",
            format!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
        );
        m.resume()?;
        Ok(())
    }

    fn unsplice(&mut self, m: &mut KvmMachine) -> anyhow::Result<()> {
        let Some(p) = self.placed.take() else {
            bail!("the guest reached unsplice without a splice in place");
        };
        m.pause()?;
        let mut now = [0u8; 5];
        m.read_phys(p.entry_phys, &mut now)?;
        if now != p.jump {
            bail!(
                "{}'s entry changed under the splice: {} instead of {}",
                self.function,
                hex(&now),
                hex(&p.jump)
            );
        }
        let mut counter = [0u8; 8];
        m.read_phys(p.counter_phys, &mut counter)?;
        m.write_phys(p.entry_phys, &p.original)?;
        m.read_phys(p.entry_phys, &mut now)?;
        report(
            &format!("counter.{}", self.function),
            u64::from_le_bytes(counter),
        );
        report("restored", if now == p.original { "yes" } else { "no" });
        m.resume()?;
        Ok(())
    }
}

impl KvmPhaseHook for CountingSplice {
    fn at_wait(&mut self, phase: &str, machine: &mut KvmMachine) -> Result<(), String> {
        let result = match phase {
            "splice" => self.splice(machine),
            "unsplice" => self.unsplice(machine),
            _ => Ok(()),
        };
        result.map_err(|e| format!("{e:#}"))
    }
}
