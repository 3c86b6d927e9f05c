//! Development probe: connect to a QEMU gdbstub and print what the control interface sees.
//!
//! `cargo run -p exotap-vmm --example gdbprobe -- tcp:127.0.0.1:1234` against
//! `exotap boot --gdbstub tcp::1234 --run 'sleep 60'`.
#![allow(clippy::unwrap_used)]
use exotap_vmm::control::{Machine, RegisterFile};
use exotap_vmm::gdb::GdbMachine;
use std::time::Duration;

fn main() {
    let addr = std::env::args().nth(1).unwrap();
    let t = std::time::Instant::now();
    let mut m = GdbMachine::connect(&addr, Duration::from_secs(5)).unwrap();
    println!("connected in {:?}", t.elapsed());
    for v in m.vcpus().unwrap() {
        let RegisterFile::X86_64(r) = m.registers(v).unwrap() else {
            continue;
        };
        println!(
            "{v}: rip={:#x} cs={:#x} cr3={:#x} cr4={:#x} gs={:#x} kgs={:#x} efer={:#x}",
            r.rip, r.segments[0], r.cr3, r.cr4, r.gs_base, r.kernel_gs_base, r.efer
        );
        let mut b = [0u8; 8];
        m.read_virt(v, r.rip, &mut b).unwrap();
        println!("  at rip: {b:02x?}");
    }
    let info = m.client().monitor("info registers").unwrap();
    for l in info
        .lines()
        .filter(|l| l.starts_with("IDT") || l.starts_with("GDT") || l.starts_with("CPU"))
    {
        println!("monitor: {l}");
    }
    m.resume().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    m.pause().unwrap();
    println!("paused again: {}", m.is_paused());
    m.detach().unwrap();
}
