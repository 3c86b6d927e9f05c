//! Attaching to a live guest (over QEMU's gdbstub, or exotap's own KVM VMM) and surveying it: the KASLR slide, the
//! kernel layout, the patch heap's mapping.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use exotap_introspect::btf::Btf;
use exotap_introspect::heap::{HeapPlacement, HeapPlan};
use exotap_introspect::kaslr::{self, Kaslr, KaslrAnchors};
use exotap_introspect::layout::{KernelLayout, TaskOffsets};
use exotap_introspect::memory::PhysicalMemory;
use exotap_introspect::paging::{pti_kernel_cr3, AddressSpace};
use exotap_vmm::control::{Machine, RegisterFile, VcpuId, X86Registers};
use exotap_vmm::gdb::GdbMachine;

use super::guest_memory::{read_kernel, BackendMemory};
use super::kernel_image::KernelImage;

/// The prefix of a target that is a running exotap VMM's control socket (`vmm:PATH`).
pub const VMM_PREFIX: &str = "vmm:";

/// Connects to the running exotap VMM `target` names (`vmm:PATH`); `None` for any other
/// target (a gdbstub). Its memory is read while the guest runs, and the VMM itself undoes
/// what a dead client left.
///
/// # Errors
/// When nothing answers at the socket, or the VMM refuses the client.
pub fn vmm_client(
    target: &Target,
) -> Option<anyhow::Result<exotap_vmm::control_socket::ControlClient>> {
    let path = target.address.strip_prefix(VMM_PREFIX)?;
    Some(
        exotap_vmm::control_socket::ControlClient::connect(
            std::path::Path::new(path),
            target.gdb_timeout,
        )
        .with_context(|| format!("cannot attach to {}", target.address)),
    )
}

/// Where a guest's gdbstub (or exotap VMM's control socket) is and how long to wait for its
/// answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The gdbstub: `tcp:HOST:PORT`, `HOST:PORT` or `unix:PATH`; or `vmm:PATH`, the control
    /// socket of `exotap boot --backend kvm --control-socket PATH`
    /// ([`super::GuestSession::attach`] takes it; [`attach`] refuses it).
    pub address: String,
    /// How long to wait for each answer of the gdbstub.
    pub gdb_timeout: Duration,
    /// The guest's RAM file, when QEMU runs with a shared memory backend: rings, counters
    /// and data are then read without stopping the vCPUs ([`super::shared`]).
    pub shm: Option<std::path::PathBuf>,
}

impl Target {
    /// The gdbstub at `address`, answers awaited for 10 s.
    pub fn new(address: impl Into<String>) -> Self {
        Self {
            address: address.into(),
            gdb_timeout: Duration::from_secs(10),
            shm: None,
        }
    }
}

/// A connected guest.
#[derive(Debug)]
pub struct Attached {
    /// The guest's control interface.
    pub machine: GdbMachine,
    /// When connecting began.
    pub started: Instant,
}

/// Connects to the gdbstub (which pauses the guest).
///
/// # Errors
/// When the gdbstub cannot be reached or does not answer.
pub fn attach(target: &Target) -> anyhow::Result<Attached> {
    if target.address.starts_with(VMM_PREFIX) {
        bail!(
            "{} is an exotap VMM's control socket: it serves splices and compiled probes \
             (count, time, trace, nullify, replace, splice-report, and scripts whose kernel \
             probes all compile); this needs QEMU's gdbstub (host-evaluated trap probes, \
             backtrace, profile, attach, recover: the VMM undoes a dead client's probes itself)",
            target.address
        );
    }
    let started = Instant::now();
    let machine = GdbMachine::connect(&target.address, target.gdb_timeout)
        .with_context(|| format!("cannot attach to {}", target.address))?;
    super::recover::note_target(&target.address);
    Ok(Attached { machine, started })
}

/// The IDT base of vCPU 0 as the backend reports it (QEMU: its monitor's `info registers`,
/// as the gdbstub does not expose IDTR; kvm: the vCPU's own IDTR).
pub fn idt_base(machine: &mut dyn Machine) -> Option<u64> {
    machine.idt_base(VcpuId(0)).ok()
}

/// CR4.LA57: 5-level paging.
const CR4_LA57: u64 = 1 << 12;

/// vCPU `vcpu`'s registers, which must be x86-64 ones.
///
/// # Errors
/// When the registers cannot be read or are not x86-64 ones.
pub fn x86_registers(machine: &mut dyn Machine, vcpu: VcpuId) -> anyhow::Result<X86Registers> {
    match machine.registers(vcpu)? {
        RegisterFile::X86_64(r) => Ok(r),
        RegisterFile::Sparc64(_) => bail!("{vcpu} is not an x86-64 vCPU"),
    }
}

/// What exotap knows of a running kernel once attached: the slide and the layout.
#[derive(Debug, Clone)]
pub struct Survey {
    /// The kernel page-table root (PTI's kernel half of vCPU 0's CR3).
    pub cr3: u64,
    /// 5-level paging.
    pub la57: bool,
    /// The IDT base the backend reports.
    pub idt_base: u64,
    /// Slide and physical load address.
    pub kaslr: Kaslr,
    /// Text, `_end`, page tables, per-CPU bases.
    pub layout: KernelLayout,
    /// Time from connecting to the slide and layout being known.
    pub ready_after: Duration,
}

impl Survey {
    /// The address space of the kernel as vCPUs in kernel mode see it.
    pub fn space<'m, M: PhysicalMemory>(&self, mem: &'m mut M) -> AddressSpace<'m, M> {
        AddressSpace::new(mem, self.cr3, self.la57)
    }
}

/// Finds the KASLR slide (two anchors that must agree) and the kernel layout of a paused guest.
///
/// # Errors
/// When registers or memory cannot be read, the anchors are missing or disagree.
pub fn survey(att: &mut Attached, image: &KernelImage) -> anyhow::Result<Survey> {
    survey_machine(&mut att.machine, att.started, image)
}

/// [`survey`] of a paused guest on any backend; `started` is when attaching began.
///
/// # Errors
/// As [`survey`].
pub fn survey_machine(
    machine: &mut dyn Machine,
    started: Instant,
    image: &KernelImage,
) -> anyhow::Result<Survey> {
    let regs = x86_registers(machine, VcpuId(0))?;
    let cr3 = pti_kernel_cr3(regs.cr3);
    let la57 = regs.cr4 & CR4_LA57 != 0;
    let idt_base = idt_base(machine).with_context(|| {
        format!(
            "the {} backend did not report the IDT base",
            machine.backend()
        )
    })?;
    let anchors = KaslrAnchors::from_image(&image.symbols, &image.vmlinux)
        .context("the image lacks a KASLR anchor")?;
    let mut mem = BackendMemory(machine);
    let mut space = AddressSpace::new(&mut mem, cr3, la57);
    let kaslr =
        kaslr::detect(&mut space, idt_base, &anchors).context("cannot find the KASLR slide")?;
    let layout = KernelLayout::read(&mut space, &image.symbols, kaslr.slide)
        .context("cannot read the kernel layout")?;
    let cr3 = kernel_root(&mut mem, image, &kaslr, la57).unwrap_or(cr3);
    Ok(Survey {
        cr3,
        la57,
        idt_base,
        kaslr,
        layout,
        ready_after: started.elapsed(),
    })
}

/// The kernel's own page-table root, `init_top_pgt` (the kernel's `swapper_pg_dir`), for the
/// survey: the CR3 vCPU 0 had at the attach is the root of whatever process ran there, and
/// that process's page tables are freed when it exits, so a long session would read the kernel
/// through a freed (and maybe reused) page. Its physical address comes from the image (its
/// offset from `_text`, plus `_text`'s physical address) and is used only when it maps
/// `_text` and itself as the attach-time root does; `None` (keep that root) otherwise.
fn kernel_root<M: PhysicalMemory>(
    mem: &mut M,
    image: &KernelImage,
    kaslr: &exotap_introspect::kaslr::Kaslr,
    la57: bool,
) -> Option<u64> {
    let text = image.address("_text").ok()?;
    let pgd = image.address("init_top_pgt").ok()?;
    let root = kaslr.text_phys.checked_add(pgd.checked_sub(text)?)?;
    let mut space = AddressSpace::new(mem, root, la57);
    let text_ok = space
        .translate(text.wrapping_add(kaslr.slide))
        .is_ok_and(|t| t.phys == kaslr.text_phys);
    let self_ok = space
        .translate(pgd.wrapping_add(kaslr.slide))
        .is_ok_and(|t| t.phys == root);
    if text_ok && self_ok {
        Some(root)
    } else {
        tracing::debug!(
            "init_top_pgt at {root:#x} does not map the kernel as vCPU 0's CR3 does; \
             reading through that CR3"
        );
        None
    }
}

/// `task_struct`'s pid and comm offsets from the BTF in the image.
///
/// # Errors
/// When the image has no BTF or its task_struct lacks the members.
pub fn task_offsets(image: &KernelImage) -> anyhow::Result<TaskOffsets> {
    let btf = image.btf()?;
    let offset = |member: &str| -> anyhow::Result<u64> {
        btf.struct_member("task_struct", member)
            .ok()
            .and_then(|m| m.byte_offset())
            .with_context(|| format!("BTF has no byte offset for task_struct.{member}"))
    };
    Ok(TaskOffsets {
        pid: offset("pid")?,
        comm: offset("comm")?,
    })
}

/// The link-time (unslid) per-CPU offset of the kernel's per-CPU variable `name`
/// (`cpu_number`, `current_task`): its own symbol where the kernel has one, else the member
/// of that name in `struct pcpu_hot` (kernels that gathered their hottest per-CPU variables
/// there keep no symbol of their own), its offset from the image's BTF (`btf` when the caller
/// has it parsed already, else parsed here, only in that case).
///
/// # Errors
/// When neither exists, or the image has no BTF where it is needed.
pub fn percpu_variable(image: &KernelImage, btf: Option<&Btf>, name: &str) -> anyhow::Result<u64> {
    if let Some(sym) = image.symbols.get(name) {
        return Ok(sym.addr);
    }
    let hot = image.symbols.get("pcpu_hot").with_context(|| {
        format!("the kernel has neither a {name} per-CPU variable nor a pcpu_hot to hold it")
    })?;
    let btf = match btf {
        Some(btf) => btf,
        None => image.btf()?,
    };
    let offset = btf
        .struct_member("pcpu_hot", name)
        .ok()
        .and_then(|m| m.byte_offset())
        .with_context(|| {
            format!("the kernel has no {name} per-CPU variable, nor pcpu_hot.{name} in its BTF")
        })?;
    Ok(hot.addr + offset)
}

/// Marker written at the start of the patch heap to check the mapping through the backend's
/// own page walk.
const HEAP_MARKER: &[u8; 16] = b"exotap patchheap";

/// Maps the hidden physical range into kernel space next to the image (PMD entries written
/// with the guest paused) and checks, through the backend's own virtual read, that it shows up.
///
/// # Errors
/// When the plan is refused (occupied range, no PMD page, ...) or the check fails.
pub fn map_patch_heap(
    machine: &mut dyn Machine,
    survey: &Survey,
    placement: HeapPlacement,
    phys: u64,
    size: u64,
) -> anyhow::Result<HeapPlan> {
    let plan = exotap_introspect::heap::plan(
        &mut survey.space(&mut BackendMemory(&mut *machine)),
        (survey.layout.text.0, survey.layout.end),
        placement,
        phys,
        size,
    )
    .context("cannot plan the patch heap mapping")?;
    for w in &plan.writes {
        machine.write_phys(w.entry_addr, &w.new.to_le_bytes())?;
    }
    machine.write_phys(plan.phys, HEAP_MARKER)?;
    let mut seen = [0u8; 16];
    machine
        .read_virt(VcpuId(0), plan.va, &mut seen)
        .map_err(anyhow::Error::from)
        .or_else(|_| read_kernel(machine, plan.va, &mut seen))
        .context("the mapped patch heap cannot be read at its virtual address")?;
    if &seen != HEAP_MARKER {
        bail!(
            "the patch heap at {:#x} shows {seen:02x?}, not the marker",
            plan.va
        );
    }
    // Whatever goes into the guest from here on is journaled, and a guardian undoes it if
    // this process dies ([`super::recover`]).
    super::recover::Journal::open(plan.phys, plan.va, plan.size, machine)?;
    // exotap's own VMM's guest ends with this process: nothing is left to undo then.
    if machine.guest_outlives_process() {
        super::recover::guard_noted(plan.phys)?;
    }
    Ok(plan)
}
