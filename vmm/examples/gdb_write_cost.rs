//! Development probe: what a gdbstub memory write costs, per packet and per byte, one
//! packet at a time against pipelined ([`Machine::write_phys_batch`]).
//!
//! `cargo run --release -p exotap-vmm --example gdb_write_cost -- tcp:127.0.0.1:1234 [PHYS]`
//! against a stopped QEMU (`qemu-system-x86_64 -S -gdb tcp::1234 ...`, or `exotap boot
//! --gdbstub tcp::1234 --run 'sleep 600'`). It writes back the bytes it read, so the guest
//! sees no change.
#![allow(clippy::unwrap_used)]
use exotap_vmm::control::Machine;
use exotap_vmm::gdb::GdbMachine;
use std::time::{Duration, Instant};

fn main() {
    let addr = std::env::args().nth(1).unwrap();
    let base = std::env::args().nth(2).map_or(0x10_0000, |a| {
        u64::from_str_radix(a.trim_start_matches("0x"), 16).unwrap()
    });
    let mut m = GdbMachine::connect(&addr, Duration::from_secs(10)).unwrap();
    let mut region = vec![0u8; 4 << 20];
    for (i, c) in region.chunks_mut(1 << 16).enumerate() {
        m.read_phys(base + (i << 16) as u64, c).unwrap();
    }
    for size in [8usize, 50, 200, 1000, 2000] {
        let n = (2_000_000 / (size + 500)).min(4000);
        // Spans `stride` apart, as splices spread over the text are.
        let stride = (region.len() / n).max(size);
        let writes: Vec<(u64, &[u8])> = (0..n)
            .map(|i| {
                (
                    base + (i * stride) as u64,
                    &region[i * stride..i * stride + size],
                )
            })
            .collect();
        for _ in 0..2 {
            let p0 = m.request_count().unwrap();
            let t = Instant::now();
            for &(a, d) in &writes {
                m.write_phys(a, d).unwrap();
            }
            let one = t.elapsed();
            let p1 = m.request_count().unwrap();
            let t = Instant::now();
            m.write_phys_batch(&writes).unwrap();
            let batch = t.elapsed();
            let p2 = m.request_count().unwrap();
            println!(
                "{n} writes of {size} bytes: one at a time {:.1} µs/packet ({} packets), pipelined {:.1} µs/packet ({} packets)",
                one.as_secs_f64() * 1e6 / (p1 - p0) as f64,
                p1 - p0,
                batch.as_secs_f64() * 1e6 / (p2 - p1) as f64,
                p2 - p1
            );
        }
    }
}
