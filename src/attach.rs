//! Attaching to a live guest over QEMU's gdbstub: `exotap attach`, `exotap info`,
//! `exotap mem read`.

use std::time::Duration;

use anyhow::bail;
use clap::{Args, Subcommand};
use exotap_introspect::heap::HeapPlacement;
use exotap_introspect::layout::read_task;
pub use exotap_probes::live::attach::{
    attach, map_patch_heap, survey, task_offsets, x86_registers, Attached, Survey, Target,
};
use exotap_probes::live::guest_memory::BackendMemory;
use exotap_vmm::control::{Machine, VcpuId};

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

impl TargetArgs {
    /// The engine's view of these arguments.
    pub fn to_target(&self) -> Target {
        Target {
            address: self.target.clone(),
            gdb_timeout: Duration::from_secs(self.gdb_timeout),
            shm: None,
        }
    }
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
    let image = args.image.load()?;
    let mut target = args.target.clone();
    if let Some(address) = &args.target_address {
        target.target.clone_from(address);
    }
    let mut att = attach(&target.to_target())?;
    let printed = print_info(&mut att, &image);
    att.machine.detach()?;
    printed
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
        "page tables   root {:#x} (the kernel's, read through), {}-level",
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
    let mut att = attach(&target.to_target())?;
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
