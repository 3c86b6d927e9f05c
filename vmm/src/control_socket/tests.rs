//! The control socket against a fake guest: every call crosses with its values, shared RAM,
//! errors, one client at a time, hostile requests.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::wire::{read_frame, write_frame, Message};
use super::*;
use crate::control::{ControlError, Machine, RegisterFile, StopEvent, VcpuId, X86Registers};

/// What a fake guest holds: RAM, two vCPUs' registers, the pause state.
#[derive(Debug, Default)]
struct Guest {
    ram: Vec<u8>,
    regs: [X86Registers; 2],
    paused: bool,
    pauses: u64,
    ended_clients: Vec<u32>,
    paused_at_end: Vec<bool>,
    /// RAM in a file the server shares (op 19), read and written with pread/pwrite.
    shared: Option<crate::control::SharedRegion>,
    /// Physical reads and writes the server was asked for.
    phys_requests: u64,
}

/// A [`Machine`] over a shared [`Guest`] (what the server's `make` hands out).
#[derive(Debug, Clone)]
struct Fake(Arc<Mutex<Guest>>);

impl Fake {
    fn new(ram: usize) -> Self {
        let mut regs = [X86Registers::default(); 2];
        for (i, r) in regs.iter_mut().enumerate() {
            for (k, g) in r.gpr.iter_mut().enumerate() {
                *g = 0x1000 * (i as u64 + 1) + k as u64;
            }
            r.rip = 0xffff_ffff_8100_0000 + i as u64;
            r.rflags = 0x246;
            r.segments = [0x10, 0x18, 0, 0, 0, 0x2b];
            r.gs_base = 0xffff_8880_3fc0_0000;
            r.kernel_gs_base = 0x7f00_0000_0000;
            r.cr3 = 0x0123_4000;
            r.cr4 = 0x3406f0;
            r.efer = 0xd01;
        }
        Self(Arc::new(Mutex::new(Guest {
            ram: (0..ram).map(|i| (i * 7 % 251) as u8).collect(),
            regs,
            ..Guest::default()
        })))
    }
    fn g(&self) -> std::sync::MutexGuard<'_, Guest> {
        self.0.lock().unwrap()
    }
    /// The file offset of `len` bytes at `addr` when they lie in the shared region.
    fn in_shared(&self, addr: u64, len: usize) -> Option<u64> {
        let g = self.g();
        let r = g.shared.as_ref()?;
        (addr >= r.gpa && addr + len as u64 <= r.gpa + r.size).then(|| r.offset + addr - r.gpa)
    }
    fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, ControlError> {
        let start = usize::try_from(addr).unwrap_or(usize::MAX);
        match start.checked_add(len) {
            Some(end) if end <= self.g().ram.len() => Ok(start..end),
            _ => Err(ControlError::Memory {
                addr,
                len,
                space: "physical",
            }),
        }
    }
}

impl Machine for Fake {
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        Ok(vec![VcpuId(0), VcpuId(1)])
    }
    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.g().phys_requests += 1;
        if let Some(at) = self.in_shared(addr, buf.len()) {
            let file = Arc::clone(&self.g().shared.as_ref().unwrap().file);
            std::os::unix::fs::FileExt::read_exact_at(&*file, buf, at).unwrap();
            return Ok(());
        }
        let r = self.range(addr, buf.len())?;
        buf.copy_from_slice(&self.g().ram[r]);
        Ok(())
    }
    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.g().phys_requests += 1;
        if let Some(at) = self.in_shared(addr, data.len()) {
            let file = Arc::clone(&self.g().shared.as_ref().unwrap().file);
            std::os::unix::fs::FileExt::write_all_at(&*file, data, at).unwrap();
            return Ok(());
        }
        let r = self.range(addr, data.len())?;
        self.g().ram[r].copy_from_slice(data);
        Ok(())
    }
    fn shared_regions(&self) -> Vec<crate::control::SharedRegion> {
        self.g().shared.iter().cloned().collect()
    }
    fn read_virt(&mut self, _: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        Err(ControlError::Memory {
            addr,
            len: buf.len(),
            space: "virtual",
        })
    }
    fn write_virt(&mut self, _: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        Err(ControlError::Memory {
            addr,
            len: data.len(),
            space: "virtual",
        })
    }
    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError> {
        let g = self.g();
        if !g.paused {
            return Err(ControlError::Running);
        }
        g.regs
            .get(vcpu.0 as usize)
            .map(|r| RegisterFile::X86_64(*r))
            .ok_or(ControlError::NoVcpu(vcpu))
    }
    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError> {
        let mut g = self.g();
        let r = g
            .regs
            .get_mut(vcpu.0 as usize)
            .ok_or(ControlError::NoVcpu(vcpu))?;
        r.rip = pc;
        Ok(())
    }
    fn pause(&mut self) -> Result<(), ControlError> {
        let mut g = self.g();
        g.paused = true;
        g.pauses += 1;
        Ok(())
    }
    fn resume(&mut self) -> Result<(), ControlError> {
        self.g().paused = false;
        Ok(())
    }
    fn is_paused(&self) -> bool {
        self.0.lock().unwrap().paused
    }
    fn set_breakpoint(&mut self, _: u64, _: bool) -> Result<(), ControlError> {
        Err(ControlError::Refused {
            backend: "fake",
            what: "set a software breakpoint",
            why: "this fake takes no exits".into(),
        })
    }
    fn wait_event(&mut self, _: Duration) -> Result<Option<StopEvent>, ControlError> {
        Ok(Some(StopEvent::Breakpoint {
            vcpu: VcpuId(1),
            pc: 0xffff_ffff_8100_1234,
        }))
    }
    fn step(&mut self, _: VcpuId) -> Result<StopEvent, ControlError> {
        Err(ControlError::Unsupported {
            backend: "fake",
            what: "single-step",
        })
    }
    fn backend(&self) -> &'static str {
        "fake"
    }
    fn idt_base(&mut self, vcpu: VcpuId) -> Result<u64, ControlError> {
        Ok(0xffff_fe00_0000_0000 + u64::from(vcpu.0))
    }
    fn set_register(&mut self, vcpu: VcpuId, name: &str, value: u64) -> Result<(), ControlError> {
        let i = crate::control::X86_GPR_NAMES
            .iter()
            .position(|n| *n == name)
            .ok_or(ControlError::Unsupported {
                backend: "fake",
                what: "write that register",
            })?;
        let mut g = self.g();
        g.regs
            .get_mut(vcpu.0 as usize)
            .ok_or(ControlError::NoVcpu(vcpu))?
            .gpr[i] = value;
        Ok(())
    }
    fn reads_while_running(&self) -> bool {
        true
    }
    fn pause_count(&self) -> Option<u64> {
        Some(self.0.lock().unwrap().pauses)
    }
}

const HEAP: (u64, u64) = (0x1f00_0000, 16 << 20);

/// A server over `fake` on a socket in `dir`; its `on_end` notes the client and whether
/// the guest was paused then.
fn server(dir: &Path, fake: &Fake) -> ControlServer {
    let path = dir.join("vmm.sock");
    let listener = ControlServer::bind(&path).unwrap();
    let make = {
        let fake = fake.clone();
        Box::new(move || Box::new(fake.clone()) as Box<dyn Machine + Send>)
    };
    let seen = fake.clone();
    let on_end: OnEnd = Box::new(move |m, client| {
        let paused = m.is_paused();
        let mut g = seen.g();
        g.ended_clients.push(client.pid);
        g.paused_at_end.push(paused);
    });
    ControlServer::spawn(
        listener,
        path,
        ServedGuest {
            patch_heap: Some(HEAP),
        },
        make,
        on_end,
    )
    .unwrap()
}

fn connect(server: &ControlServer) -> ControlClient {
    ControlClient::connect(server.path(), Duration::from_secs(5)).unwrap()
}

/// Waits (bounded) until `cond` holds.
fn eventually(cond: impl Fn() -> bool) {
    let started = std::time::Instant::now();
    while !cond() {
        assert!(started.elapsed() < Duration::from_secs(10), "timed out");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn every_machine_call_crosses_the_socket_with_its_values() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(3 << 20);
    let server = server(dir.path(), &fake);
    let mut client = connect(&server);
    let before = fake.g().regs[1];

    client.pause().unwrap();
    let regs = client.registers(VcpuId(1)).unwrap();
    client.set_pc(VcpuId(0), 0xffff_ffff_8200_0000).unwrap();
    client
        .set_register(VcpuId(1), "rsp", 0xffff_c900_0001_0000)
        .unwrap();
    let paused = client.is_paused();
    client.resume().unwrap();

    assert_eq!(client.served_backend(), "fake");
    assert!(client.reads_while_running());
    assert!(!client.guest_outlives_process());
    assert_eq!(client.patch_heap(), Some(HEAP));
    assert_eq!(client.vcpus().unwrap(), [VcpuId(0), VcpuId(1)]);
    assert_eq!(regs, RegisterFile::X86_64(before));
    assert_eq!(fake.g().regs[0].rip, 0xffff_ffff_8200_0000);
    assert_eq!(fake.g().regs[1].gpr[7], 0xffff_c900_0001_0000);
    assert!(paused);
    assert!(!client.is_paused());
    assert_eq!(client.pause_count(), Some(1));
    assert_eq!(client.idt_base(VcpuId(1)).unwrap(), 0xffff_fe00_0000_0001);
    assert_eq!(
        client.wait_event(Duration::from_millis(1)).unwrap(),
        Some(StopEvent::Breakpoint {
            vcpu: VcpuId(1),
            pc: 0xffff_ffff_8100_1234
        })
    );
}

/// A server whose RAM sits in a file (as exotap's VMM keeps it in a memfd) hands the file
/// over: the client reads and writes that RAM with no request, the server's own pread and
/// pwrite see the same bytes, and addresses outside it still cross the socket.
#[test]
fn shared_ram_is_mapped_by_the_client_and_needs_no_request() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(64 << 10);
    let file = Arc::new(tempfile::tempfile().unwrap());
    file.set_len(3 << 20).unwrap();
    // 1 MiB of guest RAM at GPA 16 MiB, 1 MiB into the file.
    let (gpa, size, offset) = (16u64 << 20, 1u64 << 20, 1u64 << 20);
    fake.g().shared = Some(crate::control::SharedRegion {
        gpa,
        size,
        file: Arc::clone(&file),
        offset,
    });
    let server = server(dir.path(), &fake);
    let mut client = connect(&server);
    assert!(client.maps_ram());
    let asked = fake.g().phys_requests;

    // The server's side writes; the client reads it from its mapping.
    let theirs: Vec<u8> = (0..5000u32).map(|i| (i * 13 % 251) as u8).collect();
    std::os::unix::fs::FileExt::write_all_at(&*file, &theirs, offset + 4000).unwrap();
    let mut seen = vec![0u8; theirs.len()];
    client.read_phys(gpa + 4000, &mut seen).unwrap();
    // The client writes; the server's file holds it.
    let ours = b"written through the client's mapping";
    client
        .write_phys(gpa + size - ours.len() as u64, ours)
        .unwrap();
    let mut back = vec![0u8; ours.len()];
    std::os::unix::fs::FileExt::read_exact_at(&*file, &mut back, offset + size - ours.len() as u64)
        .unwrap();
    let local = fake.g().phys_requests - asked;
    // Outside the region (and across its end): through the socket, as before.
    let mut low = [0u8; 16];
    client.read_phys(100, &mut low).unwrap();
    let mut across = [0u8; 8];
    let across_result = client.read_phys(gpa + size - 4, &mut across);

    assert_eq!(seen, theirs);
    assert_eq!(&back, ours);
    assert_eq!(
        local, 0,
        "reads and writes in the shared RAM crossed the socket"
    );
    assert_eq!(low.to_vec(), fake.g().ram[100..116].to_vec());
    assert!(across_result.is_err(), "a read past the shared RAM's end");
    assert_eq!(fake.g().phys_requests - asked, 2);
}

/// A server that lies about its RAM (a region past the end of its file: touching such a
/// mapping would fault) is not mapped; the client goes on through the socket.
#[test]
fn a_shared_region_past_the_files_end_is_refused_and_the_socket_serves() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(64 << 10);
    let file = Arc::new(tempfile::tempfile().unwrap());
    file.set_len(1 << 20).unwrap();
    fake.g().shared = Some(crate::control::SharedRegion {
        gpa: 16 << 20,
        size: 2 << 20,
        file,
        offset: 0,
    });
    let server = server(dir.path(), &fake);
    let mut client = connect(&server);
    let mut low = [0u8; 16];
    client.read_phys(100, &mut low).unwrap();

    assert!(!client.maps_ram());
    assert_eq!(low.to_vec(), fake.g().ram[100..116].to_vec());
}

#[test]
fn transfers_larger_than_one_message_are_split_and_arrive_whole() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(3 << 20);
    let server = server(dir.path(), &fake);
    let mut client = connect(&server);
    let len = 2 * MAX_TRANSFER + 12345;
    let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8 ^ 0x5a).collect();

    client.write_phys(100, &data).unwrap();
    let mut back = vec![0u8; len];
    client.read_phys(100, &mut back).unwrap();

    assert_eq!(back, data);
    assert_eq!(&fake.g().ram[100..100 + len], &data[..]);
}

#[test]
fn the_machines_errors_arrive_as_the_same_errors() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(4096);
    let server = server(dir.path(), &fake);
    let mut client = connect(&server);
    let mut buf = [0u8; 16];

    let memory = client.read_phys(4090, &mut buf).unwrap_err();
    let virt = client.read_virt(VcpuId(0), 0x1234, &mut buf).unwrap_err();
    let running = client.registers(VcpuId(0)).unwrap_err();
    client.pause().unwrap();
    let no_vcpu = client.registers(VcpuId(7)).unwrap_err();
    let refused = client.set_breakpoint(0x1000, true).unwrap_err();

    assert!(matches!(
        memory,
        ControlError::Memory {
            addr: 4090,
            len: 16,
            space: "physical"
        }
    ));
    assert!(matches!(
        virt,
        ControlError::Memory {
            addr: 0x1234,
            len: 16,
            space: "virtual"
        }
    ));
    assert!(matches!(running, ControlError::Running));
    assert!(matches!(no_vcpu, ControlError::NoVcpu(VcpuId(7))));
    let why = std::error::Error::source(&refused).map(ToString::to_string);
    assert_eq!(
        why.as_deref(),
        Some("the fake backend refuses to set a software breakpoint: this fake takes no exits")
    );
}

#[test]
fn a_second_client_is_refused_with_the_pid_of_the_first_until_it_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(4096);
    let server = server(dir.path(), &fake);
    let first = connect(&server);
    eventually(|| server.client().is_some());

    let refused = ControlClient::connect(server.path(), Duration::from_secs(5)).unwrap_err();
    drop(first);
    eventually(|| server.client().is_none());
    let second = ControlClient::connect(server.path(), Duration::from_secs(5));

    let why = format!("{refused:?}");
    assert!(
        why.contains(&format!("exotap pid {} holds it", std::process::id())),
        "{why}"
    );
    assert!(second.is_ok());
}

#[test]
fn a_client_that_hangs_up_paused_goes_to_on_end_and_the_guest_runs_again() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(4096);
    let server = server(dir.path(), &fake);
    let mut client = connect(&server);
    client.pause().unwrap();

    drop(client);
    eventually(|| server.client().is_none());

    let g = fake.g();
    assert_eq!(g.ended_clients, [std::process::id()]);
    assert_eq!(g.paused_at_end, [true]);
    assert!(!g.paused);
}

/// One raw request on `stream`: (status, the rest).
fn raw(stream: &mut UnixStream, body: &[u8]) -> (u8, Vec<u8>) {
    write_frame(stream, body).unwrap();
    let reply = read_frame(stream).unwrap().unwrap();
    (reply[0], reply[1..].to_vec())
}

fn hello() -> Vec<u8> {
    let mut m = Message::default().u8(OP_HELLO);
    m.0.extend_from_slice(MAGIC);
    m.u32(VERSION).u32(4242).0
}

#[test]
fn bad_requests_get_an_error_naming_the_problem_and_the_connection_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(4096);
    let server = server(dir.path(), &fake);
    let mut s = UnixStream::connect(server.path()).unwrap();
    let (hello_status, _) = raw(&mut s, &hello());

    let too_long = Message::default()
        .u8(OP_READ_PHYS)
        .u64(0)
        .u32(MAX_TRANSFER as u32 + 1)
        .0;
    let (long_status, long_why) = raw(&mut s, &too_long);
    let (unknown_status, unknown_why) = raw(&mut s, &[99]);
    let (short_status, short_why) = raw(&mut s, &[OP_READ_PHYS, 1, 2]);
    let (ok_status, ok) = raw(&mut s, &Message::default().u8(OP_VCPUS).0);

    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert_eq!(hello_status, 0);
    assert_eq!(long_status, 1);
    assert!(
        text(&long_why).contains("over the 1048576-byte limit"),
        "{}",
        text(&long_why)
    );
    assert_eq!(unknown_status, 1);
    assert!(
        text(&unknown_why).contains("unknown opcode 99"),
        "{}",
        text(&unknown_why)
    );
    assert_eq!(short_status, 1);
    assert!(
        text(&short_why).contains("addr: 8 bytes wanted, 2 left"),
        "{}",
        text(&short_why)
    );
    assert_eq!(ok_status, 0);
    assert_eq!(ok, Message::default().u32(2).u32(0).u32(1).0);
}

#[test]
fn a_client_of_another_protocol_is_refused_and_an_oversized_frame_ends_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::new(4096);
    let server = server(dir.path(), &fake);
    let mut gdb = UnixStream::connect(server.path()).unwrap();
    let mut big = UnixStream::connect(server.path()).unwrap();

    let (status, why) = raw(&mut gdb, b"$qSupported#37");
    raw(&mut big, &hello());
    big.write_all(&(MAX_FRAME as u32 + 1).to_le_bytes())
        .unwrap();
    let mut rest = Vec::new();
    let closed = big.read_to_end(&mut rest);

    assert_eq!(status, 1);
    assert!(
        String::from_utf8_lossy(&why).contains("the first request must be its hello"),
        "{}",
        String::from_utf8_lossy(&why)
    );
    assert!(closed.is_ok() && rest.is_empty());
    eventually(|| server.client().is_none());
    assert_eq!(fake.g().ended_clients, [4242]);
}

#[test]
fn binding_over_an_existing_path_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("taken");
    std::fs::write(&path, b"").unwrap();

    let e = ControlServer::bind(&path).unwrap_err();

    assert!(format!("{e:?}").contains("taken exists"), "{e:?}");
}
