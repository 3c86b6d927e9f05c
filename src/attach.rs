//! Attaching to a live guest over QEMU's gdbstub: `exotap attach`, `exotap info`,
//! `exotap mem read`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use exotap_introspect::btf::Btf;
use exotap_introspect::heap::HeapPlacement;
use exotap_introspect::kaslr::{self, Kaslr, KaslrAnchors};
use exotap_introspect::layout::{read_task, KernelLayout, TaskOffsets};
use exotap_introspect::memory::PhysicalMemory;
use exotap_introspect::paging::{pti_kernel_cr3, AddressSpace};
use exotap_vmm::control::{Machine, RegisterFile, VcpuId, X86Registers};
use exotap_vmm::gdb::GdbMachine;

use crate::guest_memory::BackendMemory;
use crate::kernel_image::{ImageArgs, KernelImage};

/// Where the guest's gdbstub is.
#[derive(Debug, Args, Clone)]
pub struct TargetArgs {
    /// The gdbstub: tcp:HOST:PORT (QEMU -s is tcp:localhost:1234), HOST:PORT or unix:PATH.
    #[arg(
        long,
        short = 't',
        value_name = "ADDR",
        default_value = "tcp:localhost:1234",
        env = "EXOTAP_TARGET"
    )]
    pub target: String,
    /// Seconds to wait for each answer of the gdbstub.
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub gdb_timeout: u64,
}

#[derive(Debug, Subcommand)]
pub enum MemCommand {
    /// Print LEN bytes of guest memory at ADDR as a hex dump.
    Read {
        /// Address (hex with 0x, or decimal).
        #[arg(value_parser = parse_u64)]
        addr: u64,
        /// Number of bytes.
        #[arg(value_parser = parse_u64)]
        len: u64,
        /// ADDR is guest-physical (default: guest-virtual, through vCPU 0's page tables).
        #[arg(long)]
        phys: bool,
        /// The vCPU whose page tables translate a virtual ADDR.
        #[arg(long, default_value_t = 0)]
        vcpu: u32,
        #[command(flatten)]
        target: TargetArgs,
    },
}

/// Parses `0x...` hex or decimal.
pub fn parse_u64(text: &str) -> Result<u64, String> {
    let t = text.replace('_', "");
    let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    };
    parsed.map_err(|e| format!("`{text}` is not an address or size ({e})"))
}

/// A connected guest.
pub struct Attached {
    /// The guest's control interface.
    pub machine: GdbMachine,
    /// When connecting began.
    pub started: Instant,
}

/// `exotap attach` / `exotap info`: the gdbstub and the kernel image the guest runs.
#[derive(Debug, Args, Clone)]
pub struct InfoArgs {
    /// The gdbstub (same as --target): `exotap attach tcp:localhost:1234`.
    #[arg(value_name = "TARGET", conflicts_with = "target")]
    pub target_address: Option<String>,
    #[command(flatten)]
    pub target: TargetArgs,
    #[command(flatten)]
    pub image: ImageArgs,
}

/// Attaches, loads the image's symbols, finds the slide and layout, prints them, detaches.
///
/// # Errors
/// When any step fails; the guest is detached (and runs on) either way.
pub fn run_info(args: &InfoArgs) -> anyhow::Result<()> {
    let image = KernelImage::from_args(&args.image)?;
    let mut target = args.target.clone();
    if let Some(address) = &args.target_address {
        target.target.clone_from(address);
    }
    let mut att = attach(&target)?;
    let printed = print_info(&mut att, &image);
    att.machine.detach()?;
    printed
}

/// Connects to the gdbstub (which pauses the guest).
pub fn attach(target: &TargetArgs) -> anyhow::Result<Attached> {
    let started = Instant::now();
    let machine = GdbMachine::connect(&target.target, Duration::from_secs(target.gdb_timeout))
        .with_context(|| format!("cannot attach to {}", target.target))?;
    crate::recover::note_target(&target.target);
    Ok(Attached { machine, started })
}

/// The IDT base from QEMU's `info registers` (the gdbstub does not expose IDTR).
pub fn idt_base(machine: &mut GdbMachine) -> Option<u64> {
    let text = machine.client().monitor("info registers").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("IDT="))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
}

/// CR4.LA57: 5-level paging.
const CR4_LA57: u64 = 1 << 12;

fn x86_registers(machine: &mut GdbMachine, vcpu: VcpuId) -> anyhow::Result<X86Registers> {
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
    /// The IDT base QEMU reports.
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
    let machine = &mut att.machine;
    let regs = x86_registers(machine, VcpuId(0))?;
    let cr3 = pti_kernel_cr3(regs.cr3);
    let la57 = regs.cr4 & CR4_LA57 != 0;
    let idt_base = idt_base(machine).context("QEMU's monitor did not report the IDT base")?;
    let anchors = KaslrAnchors::from_image(&image.symbols, &image.vmlinux)
        .context("the image lacks a KASLR anchor")?;
    let mut mem = BackendMemory(machine);
    let mut space = AddressSpace::new(&mut mem, cr3, la57);
    let kaslr =
        kaslr::detect(&mut space, idt_base, &anchors).context("cannot find the KASLR slide")?;
    let layout = KernelLayout::read(&mut space, &image.symbols, kaslr.slide)
        .context("cannot read the kernel layout")?;
    Ok(Survey {
        cr3,
        la57,
        idt_base,
        kaslr,
        layout,
        ready_after: att.started.elapsed(),
    })
}

/// `task_struct`'s pid and comm offsets from the BTF in the image.
///
/// # Errors
/// When the image has no BTF or its task_struct lacks the members.
pub fn task_offsets(image: &KernelImage) -> anyhow::Result<TaskOffsets> {
    let btf = Btf::from_elf(image.vmlinux.bytes()).context("the kernel image has no usable BTF")?;
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

/// Prints what exotap sees of the guest.
pub fn print_info(att: &mut Attached, image: &KernelImage) -> anyhow::Result<()> {
    let survey = survey(att, image)?;
    let tasks = task_offsets(image);
    let m = &mut att.machine;
    let vcpus = m.vcpus()?;
    let banner = {
        let link = image.address("linux_banner")?;
        let mut buf = [0u8; 256];
        let mut mem = BackendMemory(&mut *m);
        survey
            .space(&mut mem)
            .read(link.wrapping_add(survey.kaslr.slide), &mut buf)?;
        let text = buf.split(|b| *b == 0).next().unwrap_or(&buf);
        String::from_utf8_lossy(text).trim_end().to_owned()
    };
    let l = &survey.layout;
    outln!("banner        {banner}");
    outln!(
        "attach time   {:.1} ms (connect to slide and layout known; the image's symbols were loaded before, in {:.0} ms)",
        survey.ready_after.as_secs_f64() * 1e3,
        image.load_time.as_secs_f64() * 1e3
    );
    outln!(
        "KASLR slide   {:#x} (IDT gates and linux_banner agree); _text at guest-physical {:#x}",
        survey.kaslr.slide,
        survey.kaslr.text_phys
    );
    outln!("text          {:#x}..{:#x}", l.text.0, l.text.1);
    outln!("_end          {:#x}", l.end);
    outln!(
        "image PMD     page at guest-physical {:#x}",
        l.image_pmd_page
    );
    outln!("init_task     {:#x}", l.init_task);
    outln!(
        "page tables   cr3 {:#x}, {}-level",
        survey.cr3,
        if survey.la57 { 5 } else { 4 }
    );
    outln!("vCPUs         {}", vcpus.len());
    outln!("IDT base      {:#018x}", survey.idt_base);
    for v in vcpus {
        let r = x86_registers(m, v)?;
        let base = r.kernel_percpu_base();
        let mut mem = BackendMemory(&mut *m);
        let mut space = survey.space(&mut mem);
        let current = match (&tasks, survey.layout.current_task_at(&mut space, base)) {
            (Ok(offsets), Ok(task)) => match read_task(&mut space, task, *offsets) {
                Ok(t) => format!("current pid {} ({}) task {:#x}", t.pid, t.comm, t.task),
                Err(e) => format!("current task {task:#x} unreadable: {e}"),
            },
            (Err(e), _) => format!("current task unknown: {e:#}"),
            (_, Err(e)) => format!("current task unknown: {e}"),
        };
        let rip = match image
            .symbols
            .lookup_addr(r.rip.wrapping_sub(survey.kaslr.slide))
        {
            Some((sym, off)) => format!("{}+{off:#x}", sym.name),
            None => format!("{:#x}", r.rip),
        };
        outln!(
            "{v:<13} {} mode at {rip}, per-cpu base {base:#x}, {current}",
            if r.in_kernel() { "kernel" } else { "user" },
        );
    }
    Ok(())
}

/// Formats bytes like `xxd`: offset, 16 hex bytes, ASCII.
pub fn hexdump(addr: u64, bytes: &[u8]) -> String {
    let mut out = String::new();
    for (i, line) in bytes.chunks(16).enumerate() {
        let hex: Vec<String> = line.iter().map(|b| format!("{b:02x}")).collect();
        let ascii: String = line
            .iter()
            .map(|b| {
                if b.is_ascii_graphic() || *b == b' ' {
                    *b as char
                } else {
                    '.'
                }
            })
            .collect();
        out.push_str(&format!(
            "{:016x}: {:<48} {}\n",
            addr + (i as u64) * 16,
            hex.join(" "),
            ascii
        ));
    }
    out
}

pub fn run_mem(cmd: &MemCommand) -> anyhow::Result<()> {
    let MemCommand::Read {
        addr,
        len,
        phys,
        vcpu,
        target,
    } = cmd;
    if *len > 1 << 24 {
        bail!("refusing to read {len} bytes at once (at most 16 MiB)");
    }
    let mut att = attach(target)?;
    let mut buf = vec![0u8; usize::try_from(*len)?];
    if *phys {
        att.machine.read_phys(*addr, &mut buf)?;
    } else {
        att.machine.read_virt(VcpuId(*vcpu), *addr, &mut buf)?;
    }
    out!("{}", hexdump(*addr, &buf));
    att.machine.detach()?;
    Ok(())
}

/// `--heap-place`: which side of the kernel image the patch heap goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HeapPlaceArg {
    /// Just past `_end` where it fits below the module area, else just below `_text`.
    #[default]
    Auto,
    /// Just past `_end`, or fail.
    After,
    /// Just below `_text`, or fail.
    Before,
}

impl From<HeapPlaceArg> for HeapPlacement {
    fn from(arg: HeapPlaceArg) -> Self {
        match arg {
            HeapPlaceArg::Auto => Self::Auto,
            HeapPlaceArg::After => Self::After,
            HeapPlaceArg::Before => Self::Before,
        }
    }
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
    machine: &mut GdbMachine,
    survey: &Survey,
    placement: HeapPlacement,
    phys: u64,
    size: u64,
) -> anyhow::Result<exotap_introspect::heap::HeapPlan> {
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
        .context("the mapped patch heap cannot be read at its virtual address")?;
    if &seen != HEAP_MARKER {
        bail!(
            "the patch heap at {:#x} shows {seen:02x?}, not the marker",
            plan.va
        );
    }
    // Whatever goes into the guest from here on is journaled, and a guardian undoes it if
    // this process dies (src/recover.rs).
    crate::recover::Journal::open(plan.phys, plan.va, plan.size, machine)?;
    crate::recover::guard_noted(plan.phys)?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_in_hex_and_decimal() {
        assert_eq!(
            parse_u64("0xffff_ffff_8100_0000"),
            Ok(0xffff_ffff_8100_0000)
        );
        assert_eq!(parse_u64("4096"), Ok(4096));
        assert!(parse_u64("0xzz").is_err());
    }

    #[test]
    fn hexdump_shows_offsets_hex_and_ascii() {
        let dump = hexdump(0x1000, b"Linux version 6.1\x00");

        assert_eq!(
            dump,
            "0000000000001000: 4c 69 6e 75 78 20 76 65 72 73 69 6f 6e 20 36 2e  Linux version 6.\n\
             0000000000001010: 31 00                                            1.\n"
        );
    }
}
