//! Attaching to a live guest over QEMU's gdbstub: `exotap attach`, `exotap info`,
//! `exotap mem read`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use exotap_vmm::control::{Machine, RegisterFile, VcpuId};
use exotap_vmm::gdb::GdbMachine;

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

/// A connected guest and how long attaching took.
pub struct Attached {
    pub machine: GdbMachine,
    pub attach_time: Duration,
}

/// Connects to the gdbstub (which pauses the guest).
pub fn attach(target: &TargetArgs) -> anyhow::Result<Attached> {
    let start = Instant::now();
    let machine = GdbMachine::connect(&target.target, Duration::from_secs(target.gdb_timeout))
        .with_context(|| format!("cannot attach to {}", target.target))?;
    Ok(Attached {
        machine,
        attach_time: start.elapsed(),
    })
}

/// The IDT base from QEMU's `info registers` (the gdbstub does not expose IDTR).
pub fn idt_base(machine: &mut GdbMachine) -> Option<u64> {
    let text = machine.client().monitor("info registers").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("IDT="))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
}

/// Prints what exotap sees of the guest.
pub fn print_info(att: &mut Attached) -> anyhow::Result<()> {
    let m = &mut att.machine;
    let vcpus = m.vcpus()?;
    println!(
        "attach time   {:.1} ms",
        att.attach_time.as_secs_f64() * 1e3
    );
    println!("vCPUs         {}", vcpus.len());
    if let Some(idt) = idt_base(m) {
        println!("IDT base      {idt:#018x}");
    }
    for v in vcpus {
        let RegisterFile::X86_64(r) = m.registers(v)? else {
            continue;
        };
        let levels = if r.cr4 & (1 << 12) != 0 { 5 } else { 4 };
        println!(
            "{v:<13} rip {:#018x} ({} mode)  cr3 {:#x}  {}-level paging  per-cpu base {:#x}",
            r.rip,
            if r.in_kernel() { "kernel" } else { "user" },
            r.cr3,
            levels,
            r.kernel_percpu_base()
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
    print!("{}", hexdump(*addr, &buf));
    att.machine.detach()?;
    Ok(())
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
