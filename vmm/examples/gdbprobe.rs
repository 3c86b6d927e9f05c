//! Development probe: connect to a QEMU gdbstub and print what the client sees.
#![allow(clippy::unwrap_used)]
use exotap_vmm::gdb::GdbClient;
use std::time::Duration;

fn main() {
    tracing_subscriber::fmt().with_env_filter("trace").with_writer(std::io::stderr).init();
    let addr = std::env::args().nth(1).unwrap();
    let t = std::time::Instant::now();
    let mut c = GdbClient::connect(&addr, Duration::from_secs(5)).unwrap();
    println!("connected in {:?}: {:?} features; stop={:?}", t.elapsed(), c.packet_size(), c.stop_reason());
    for r in c.registers() { print!("{}:{}:{} ", r.name, r.regnum, r.bitsize); }
    println!();
    let threads = c.threads().unwrap();
    println!("threads {threads:?}");
    for th in &threads {
        let rip = c.read_register_u64(*th, "rip").unwrap();
        let cr3 = c.read_register_u64(*th, "cr3").unwrap();
        let cr4 = c.read_register_u64(*th, "cr4").unwrap();
        let gs = c.read_register_u64(*th, "gs_base").unwrap();
        println!("{th:?} rip={rip:#x} cr3={cr3:#x} cr4={cr4:#x} gs_base={gs:#x}");
        let mut b = [0u8; 16];
        c.read_memory(rip, &mut b).unwrap();
        println!("  bytes at rip {:02x?}", b);
    }
    c.set_physical_mode(true).unwrap();
    let mut b = [0u8; 16];
    c.read_memory(0x1000, &mut b).unwrap();
    println!("phys 0x1000: {b:02x?}");
    let t = std::time::Instant::now();
    let mut big = vec![0u8; 1 << 20];
    c.read_memory(0x100_0000, &mut big).unwrap();
    println!("1 MiB phys read in {:?}", t.elapsed());
    c.set_physical_mode(false).unwrap();
    c.resume().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    println!("interrupt: {:?}", c.interrupt());
    println!("step: {:?}", c.step(threads[0]));
    c.detach().unwrap();
}
