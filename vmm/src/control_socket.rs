//! A running exotap VMM's control socket: the [`Machine`] interface over a unix socket, so that
//! another exotap process (`exotap run --target vmm:PATH`, `exotap count --target vmm:PATH`)
//! drives the VMM's guest as the VMM's own engine does.
//!
//! # Why hand-written
//! The messages are the [`Machine`] trait's calls, a dozen fixed records of integers and byte
//! strings; a serialization crate would add a dependency to the static exotap of the nested
//! test for less code than the framing below. The GDB remote protocol (QEMU's gdbstub) does
//! not carry what the engine needs from a VMM (IDTR, the pause count, the patch heap).
//!
//! # The protocol
//! One client at a time, request then response, over a `SOCK_STREAM` unix socket. Every
//! message is a frame: a little-endian `u32` length of the body, then the body. Integers are
//! little-endian; a byte string (`bytes`, `str`) is a `u32` length and its bytes.
//!
//! A request body is an opcode byte and its arguments:
//!
//! | op | name | arguments | answer |
//! |---|---|---|---|
//! | 1 | hello | magic `EXOTAPVM`, `u32` version ([`VERSION`]), `u32` client pid | `u32` version, `str` backend, `u8` flags (bit 0: memory is read while the vCPUs run; bit 1: op 19 shares the RAM), `u8` heap known, `u64` heap GPA, `u64` heap size |
//! | 2 | vcpus | | `u32` n, n × `u32` vCPU id |
//! | 3 | read physical | `u64` addr, `u32` len | `bytes` |
//! | 4 | write physical | `u64` addr, `bytes` data | |
//! | 5 | read virtual | `u32` vCPU, `u64` addr, `u32` len | `bytes` |
//! | 6 | write virtual | `u32` vCPU, `u64` addr, `bytes` data | |
//! | 7 | registers | `u32` vCPU | `u8` arch (0 x86-64: 16 GPRs, rip, rflags as `u64`, 6 segment selectors as `u16`, fs_base, gs_base, kernel_gs_base, cr0, cr2, cr3, cr4, efer as `u64`; 1 SPARC V9: 32 registers, pc, npc, pstate, ccr, cwp as `u64`) |
//! | 8 | set pc | `u32` vCPU, `u64` pc | |
//! | 9 | pause | | |
//! | 10 | resume | | |
//! | 11 | is paused | | `u8` |
//! | 12 | breakpoint | `u64` addr, `u8` insert | |
//! | 13 | wait event | `u32` timeout in ms (at most [`MAX_WAIT`]) | `u8` 0 none, 1 an event |
//! | 14 | step | `u32` vCPU | event |
//! | 15 | IDT base | `u32` vCPU | `u64` |
//! | 16 | set register | `u32` vCPU, `str` name, `u64` value | |
//! | 17 | pause count | | `u8` known, `u64` count |
//! | 18 | release | | |
//! | 19 | share RAM | | `u32` n, n × (`u64` GPA, `u64` size, `u64` file offset); the response frame carries one file descriptor (`SCM_RIGHTS`), the file holding them all |
//!
//! The hello's flags bit 1 says the server can share its guest RAM (op 19). exotap's VMM keeps
//! the RAM in a memfd; a client maps it and reads and writes guest-physical memory there with
//! no request (counters, rings, maps; on KVM text too, since no translated-block cache sits
//! between the file and the vCPUs). Regions in another file, and addresses outside them, go
//! through ops 3 and 4. A client checks that every region lies inside the file before it maps
//! it (a mapping past the file's end faults on access).
//! An event is a `u8` kind: 0 breakpoint (`u32` vCPU, `u64` pc), 1 stepped (`u32` vCPU),
//! 2 paused, 3 exited.
//!
//! A response body is a status byte: 0 and the answer, or 1 and an error: a `u8` kind, then
//! 0 memory (`u64` addr, `u64` len, `u8` 0 physical / 1 virtual), 1 no such vCPU (`u32`),
//! 2 the guest is running, 3 anything else (`str` message). A request the server cannot parse
//! (unknown opcode, short arguments, a transfer over [`MAX_TRANSFER`]) is answered with an
//! error and the connection goes on; a frame over [`MAX_FRAME`] ends the connection. The
//! client splits larger transfers.
//!
//! # When a client ends
//! A client can change the guest only through its connection. When the connection ends (the
//! client exited, or was killed with its probes in), the server hands its machine to the
//! `on_end` of [`ControlServer::spawn`] (exotap's VMM undoes what the client's recovery journal
//! still lists there) and resumes a guest the client left paused.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vm_memory::{Bytes as _, GuestMemoryMmap};
use vmm_sys_util::sock_ctrl_msg::ScmSocket as _;

use crate::control::{
    ControlError, Machine, RegisterFile, SparcRegisters, StopEvent, VcpuId, X86Registers,
};

/// The protocol version this side speaks.
pub const VERSION: u32 = 1;
/// The hello's magic.
const MAGIC: &[u8; 8] = b"EXOTAPVM";
/// The largest memory transfer in one request (the client splits larger ones).
pub const MAX_TRANSFER: usize = 1 << 20;
/// The largest frame either side accepts.
pub const MAX_FRAME: usize = MAX_TRANSFER + 4096;
/// The longest a wait-event request blocks the server.
pub const MAX_WAIT: Duration = Duration::from_secs(10);
/// The backend name the client reports: [`Machine::backend`] of a [`ControlClient`].
pub const CLIENT_BACKEND: &str = "exotap vmm (control socket)";

const OP_HELLO: u8 = 1;
const OP_VCPUS: u8 = 2;
const OP_READ_PHYS: u8 = 3;
const OP_WRITE_PHYS: u8 = 4;
const OP_READ_VIRT: u8 = 5;
const OP_WRITE_VIRT: u8 = 6;
const OP_REGISTERS: u8 = 7;
const OP_SET_PC: u8 = 8;
const OP_PAUSE: u8 = 9;
const OP_RESUME: u8 = 10;
const OP_IS_PAUSED: u8 = 11;
const OP_BREAKPOINT: u8 = 12;
const OP_WAIT_EVENT: u8 = 13;
const OP_STEP: u8 = 14;
const OP_IDT_BASE: u8 = 15;
const OP_SET_REGISTER: u8 = 16;
const OP_PAUSE_COUNT: u8 = 17;
const OP_RELEASE: u8 = 18;
const OP_SHARE_RAM: u8 = 19;

/// Errors of the protocol itself (the [`Machine`] calls' own errors travel inside it).
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The socket failed.
    #[error("the control socket failed")]
    Io(#[from] std::io::Error),
    /// A frame too large to be one of ours.
    #[error("a frame of {0} bytes is over the protocol's limit")]
    FrameTooLarge(usize),
    /// A message that does not parse.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The other side speaks another protocol or version, or refused the hello.
    #[error("the hello was refused: {0}")]
    Hello(String),
}

fn read_frame(stream: &mut impl Read) -> Result<Option<Vec<u8>>, SocketError> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(SocketError::FrameTooLarge(len));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok(Some(body))
}

fn write_frame(stream: &mut impl Write, body: &[u8]) -> Result<(), SocketError> {
    if body.len() > MAX_FRAME {
        return Err(SocketError::FrameTooLarge(body.len()));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    stream.write_all(&frame)?;
    Ok(())
}

/// Reads a message's fields in order, every one bounds-checked.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], SocketError> {
        if self.0.len() < n {
            return Err(SocketError::Malformed(format!(
                "{what}: {n} bytes wanted, {} left",
                self.0.len()
            )));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, SocketError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, SocketError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, SocketError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self, what: &str) -> Result<u64, SocketError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(b))
    }
    fn bytes(&mut self, what: &str) -> Result<&'a [u8], SocketError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    fn str(&mut self, what: &str) -> Result<String, SocketError> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| SocketError::Malformed(format!("{what} is not UTF-8")))
    }
    fn len(&mut self, what: &str) -> Result<usize, SocketError> {
        let n = self.u32(what)? as usize;
        if n > MAX_TRANSFER {
            return Err(SocketError::Malformed(format!(
                "{what} of {n} bytes is over the {MAX_TRANSFER}-byte limit of one transfer"
            )));
        }
        Ok(n)
    }
}

/// Builds a message.
#[derive(Default)]
struct Message(Vec<u8>);

impl Message {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, b: &[u8]) -> Self {
        self = self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
}

fn put_registers(m: Message, regs: &RegisterFile) -> Message {
    match regs {
        RegisterFile::X86_64(r) => {
            let mut m = m.u8(0);
            for v in r.gpr.iter().chain([&r.rip, &r.rflags]) {
                m = m.u64(*v);
            }
            for s in r.segments {
                m = m.u16(s);
            }
            for v in [
                r.fs_base,
                r.gs_base,
                r.kernel_gs_base,
                r.cr0,
                r.cr2,
                r.cr3,
                r.cr4,
                r.efer,
            ] {
                m = m.u64(v);
            }
            m
        }
        RegisterFile::Sparc64(r) => {
            let mut m = m.u8(1);
            for v in r.r.iter().chain([&r.pc, &r.npc, &r.pstate, &r.ccr, &r.cwp]) {
                m = m.u64(*v);
            }
            m
        }
    }
}

fn get_registers(f: &mut Fields<'_>) -> Result<RegisterFile, SocketError> {
    match f.u8("architecture")? {
        0 => {
            let mut r = X86Registers::default();
            for v in &mut r.gpr {
                *v = f.u64("gpr")?;
            }
            r.rip = f.u64("rip")?;
            r.rflags = f.u64("rflags")?;
            for s in &mut r.segments {
                *s = f.u16("segment")?;
            }
            for v in [
                &mut r.fs_base,
                &mut r.gs_base,
                &mut r.kernel_gs_base,
                &mut r.cr0,
                &mut r.cr2,
                &mut r.cr3,
                &mut r.cr4,
                &mut r.efer,
            ] {
                *v = f.u64("system register")?;
            }
            Ok(RegisterFile::X86_64(r))
        }
        1 => {
            let mut r = SparcRegisters::default();
            for v in &mut r.r {
                *v = f.u64("register")?;
            }
            for v in [&mut r.pc, &mut r.npc, &mut r.pstate, &mut r.ccr, &mut r.cwp] {
                *v = f.u64("register")?;
            }
            Ok(RegisterFile::Sparc64(r))
        }
        other => Err(SocketError::Malformed(format!(
            "unknown architecture {other}"
        ))),
    }
}

fn put_event(m: Message, event: StopEvent) -> Message {
    match event {
        StopEvent::Breakpoint { vcpu, pc } => m.u8(0).u32(vcpu.0).u64(pc),
        StopEvent::Stepped { vcpu } => m.u8(1).u32(vcpu.0),
        StopEvent::Paused => m.u8(2),
        StopEvent::Exited => m.u8(3),
    }
}

fn get_event(f: &mut Fields<'_>) -> Result<StopEvent, SocketError> {
    Ok(match f.u8("event")? {
        0 => StopEvent::Breakpoint {
            vcpu: VcpuId(f.u32("vcpu")?),
            pc: f.u64("pc")?,
        },
        1 => StopEvent::Stepped {
            vcpu: VcpuId(f.u32("vcpu")?),
        },
        2 => StopEvent::Paused,
        3 => StopEvent::Exited,
        other => return Err(SocketError::Malformed(format!("unknown event {other}"))),
    })
}

fn error_body(e: &ControlError) -> Vec<u8> {
    let m = Message::default().u8(1);
    match e {
        ControlError::Memory { addr, len, space } => m
            .u8(0)
            .u64(*addr)
            .u64(*len as u64)
            .u8(u8::from(*space == "virtual")),
        ControlError::NoVcpu(v) => m.u8(1).u32(v.0),
        ControlError::Running => m.u8(2),
        other => {
            let mut text = other.to_string();
            let mut source = std::error::Error::source(other);
            while let Some(s) = source {
                text.push_str(&format!(": {s}"));
                source = s.source();
            }
            m.u8(3).bytes(text.as_bytes())
        }
    }
    .0
}

fn get_error(f: &mut Fields<'_>) -> Result<ControlError, SocketError> {
    Ok(match f.u8("error kind")? {
        0 => ControlError::Memory {
            addr: f.u64("addr")?,
            len: usize::try_from(f.u64("len")?).unwrap_or(usize::MAX),
            space: if f.u8("space")? == 1 {
                "virtual"
            } else {
                "physical"
            },
        },
        1 => ControlError::NoVcpu(VcpuId(f.u32("vcpu")?)),
        2 => ControlError::Running,
        _ => ControlError::Backend {
            backend: CLIENT_BACKEND,
            source: f.str("message")?.into(),
        },
    })
}

/// What the server knows of the guest beyond the [`Machine`] (the hello tells it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServedGuest {
    /// The patch heap the VMM keeps out of the guest's RAM map (GPA, size).
    pub patch_heap: Option<(u64, u64)>,
}

/// The server's answer to one request; `Err` for a request that does not parse.
fn answer(
    machine: &mut dyn Machine,
    guest: &ServedGuest,
    body: &[u8],
) -> Result<Result<Message, ControlError>, SocketError> {
    let mut f = Fields(body);
    let ok = Message::default().u8(0);
    let vcpu = |f: &mut Fields<'_>| f.u32("vcpu").map(VcpuId);
    let op = f.u8("opcode")?;
    Ok(match op {
        OP_HELLO => {
            // A second hello on a connection is answered the same way.
            let (heap_known, (gpa, size)) = match guest.patch_heap {
                Some(h) => (1, h),
                None => (0, (0, 0)),
            };
            Ok(ok
                .u32(VERSION)
                .bytes(machine.backend().as_bytes())
                .u8(u8::from(machine.reads_while_running())
                    | u8::from(!machine.shared_regions().is_empty()) << 1)
                .u8(heap_known)
                .u64(gpa)
                .u64(size))
        }
        OP_VCPUS => machine
            .vcpus()
            .map(|v| v.iter().fold(ok.u32(v.len() as u32), |m, id| m.u32(id.0))),
        OP_READ_PHYS => {
            let addr = f.u64("addr")?;
            let len = f.len("length")?;
            // The backend's bulk path where it has one (QEMU's pmemsave beats gdb packets).
            if let Some(bytes) = machine.read_phys_bulk(addr, len).filter(|b| b.len() == len) {
                return Ok(Ok(ok.bytes(&bytes)));
            }
            let mut buf = vec![0u8; len];
            machine.read_phys(addr, &mut buf).map(|()| ok.bytes(&buf))
        }
        OP_WRITE_PHYS => {
            let addr = f.u64("addr")?;
            let data = f.bytes("data")?;
            machine.write_phys(addr, data).map(|()| ok)
        }
        OP_READ_VIRT => {
            let v = vcpu(&mut f)?;
            let addr = f.u64("addr")?;
            let mut buf = vec![0u8; f.len("length")?];
            machine
                .read_virt(v, addr, &mut buf)
                .map(|()| ok.bytes(&buf))
        }
        OP_WRITE_VIRT => {
            let v = vcpu(&mut f)?;
            let addr = f.u64("addr")?;
            let data = f.bytes("data")?;
            machine.write_virt(v, addr, data).map(|()| ok)
        }
        OP_REGISTERS => {
            let v = vcpu(&mut f)?;
            machine.registers(v).map(|r| put_registers(ok, &r))
        }
        OP_SET_PC => {
            let v = vcpu(&mut f)?;
            let pc = f.u64("pc")?;
            machine.set_pc(v, pc).map(|()| ok)
        }
        OP_PAUSE => machine.pause().map(|()| ok),
        OP_RESUME => machine.resume().map(|()| ok),
        OP_IS_PAUSED => Ok(ok.u8(u8::from(machine.is_paused()))),
        OP_BREAKPOINT => {
            let addr = f.u64("addr")?;
            let insert = f.u8("insert")? != 0;
            machine.set_breakpoint(addr, insert).map(|()| ok)
        }
        OP_WAIT_EVENT => {
            let ms = Duration::from_millis(u64::from(f.u32("timeout")?)).min(MAX_WAIT);
            machine.wait_event(ms).map(|e| match e {
                Some(e) => put_event(ok.u8(1), e),
                None => ok.u8(0),
            })
        }
        OP_STEP => {
            let v = vcpu(&mut f)?;
            machine.step(v).map(|e| put_event(ok, e))
        }
        OP_IDT_BASE => {
            let v = vcpu(&mut f)?;
            machine.idt_base(v).map(|b| ok.u64(b))
        }
        OP_SET_REGISTER => {
            let v = vcpu(&mut f)?;
            let name = f.str("register name")?;
            let value = f.u64("value")?;
            machine.set_register(v, &name, value).map(|()| ok)
        }
        OP_PAUSE_COUNT => Ok(match machine.pause_count() {
            Some(n) => ok.u8(1).u64(n),
            None => ok.u8(0).u64(0),
        }),
        OP_RELEASE => machine.release().map(|()| ok),
        other => return Err(SocketError::Malformed(format!("unknown opcode {other}"))),
    })
}

/// Serves one client on `stream` until it hangs up: each request frame gets one response
/// frame.
///
/// # Errors
/// The socket failed, or a frame was over [`MAX_FRAME`] (the connection cannot go on).
pub fn serve_connection(
    stream: &mut UnixStream,
    machine: &mut dyn Machine,
    guest: &ServedGuest,
) -> Result<(), SocketError> {
    while let Some(body) = read_frame(stream)? {
        if body.first() == Some(&OP_SHARE_RAM) {
            share_ram(stream, machine)?;
            continue;
        }
        let reply = match answer(machine, guest, &body) {
            Ok(Ok(m)) => m.0,
            Ok(Err(e)) => error_body(&e),
            Err(e) => {
                Message::default()
                    .u8(1)
                    .u8(3)
                    .bytes(format!("the VMM cannot parse the request: {e}").as_bytes())
                    .0
            }
        };
        write_frame(stream, &reply)?;
    }
    Ok(())
}

/// Answers op 19: the regions of the machine's RAM in its first region's file, with that
/// file's descriptor attached to the frame.
fn share_ram(stream: &mut UnixStream, machine: &mut dyn Machine) -> Result<(), SocketError> {
    let regions = machine.shared_regions();
    let Some(first) = regions.first().map(|r| Arc::clone(&r.file)) else {
        return write_frame(stream, &Message::default().u8(0).u32(0).0);
    };
    let same: Vec<_> = regions
        .iter()
        .filter(|r| Arc::ptr_eq(&r.file, &first))
        .collect();
    let body = same
        .iter()
        .fold(Message::default().u8(0).u32(same.len() as u32), |m, r| {
            m.u64(r.gpa).u64(r.size).u64(r.offset)
        });
    let mut frame = (body.0.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body.0);
    let sent = stream
        .send_with_fd(&frame[..], std::os::fd::AsRawFd::as_raw_fd(&*first))
        .map_err(|e| SocketError::Io(std::io::Error::from_raw_os_error(e.errno())))?;
    stream.write_all(&frame[sent..])?;
    Ok(())
}

/// Who is connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Client {
    /// The client's pid, as its hello said.
    pub pid: u32,
}

/// Called with the machine when a client's connection ends, before the server resumes a
/// guest left paused.
pub type OnEnd = Box<dyn FnMut(&mut dyn Machine, Client) + Send>;
/// Makes a machine handle for a new client.
pub type MakeMachine = Box<dyn FnMut() -> Box<dyn Machine + Send> + Send>;

/// The listening side: a thread that accepts clients, one at a time.
pub struct ControlServer {
    path: PathBuf,
    client: Arc<Mutex<Option<Client>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .field("client", &self.client())
            .finish_non_exhaustive()
    }
}

/// How often the accept loop looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(50);

impl ControlServer {
    /// Binds `path` (which must not exist), so that a bad path fails before the guest boots.
    ///
    /// # Errors
    /// The socket cannot be created there.
    pub fn bind(path: &Path) -> Result<UnixListener, SocketError> {
        if path.exists() {
            return Err(SocketError::Io(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists (remove a stale socket first)", path.display()),
            )));
        }
        Ok(UnixListener::bind(path)?)
    }

    /// Serves clients on `listener` (bound at `path`, removed when the server is dropped):
    /// each gets a machine from `make`; a client that connects while another is served is
    /// refused with a message naming the one served. When a connection ends, `on_end` gets its
    /// machine, then a guest left paused is resumed.
    ///
    /// # Errors
    /// The accept thread cannot start.
    pub fn spawn(
        listener: UnixListener,
        path: PathBuf,
        guest: ServedGuest,
        mut make: MakeMachine,
        on_end: OnEnd,
    ) -> Result<Self, SocketError> {
        listener.set_nonblocking(true)?;
        let client = Arc::new(Mutex::new(None::<Client>));
        let stop = Arc::new(AtomicBool::new(false));
        let on_end = Arc::new(Mutex::new(on_end));
        let thread = std::thread::Builder::new()
            .name("vmm-control".into())
            .spawn({
                let client = Arc::clone(&client);
                let stop = Arc::clone(&stop);
                move || {
                    while !stop.load(Ordering::SeqCst) {
                        let stream = match listener.accept() {
                            Ok((s, _)) => s,
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                std::thread::sleep(ACCEPT_POLL);
                                continue;
                            }
                            Err(e) => {
                                tracing::warn!("control socket: accept failed: {e}");
                                std::thread::sleep(ACCEPT_POLL);
                                continue;
                            }
                        };
                        let machine = make();
                        let client = Arc::clone(&client);
                        let on_end = Arc::clone(&on_end);
                        let spawned = std::thread::Builder::new()
                            .name("vmm-client".into())
                            .spawn(move || serve_client(stream, machine, guest, &client, &on_end));
                        if let Err(e) = spawned {
                            tracing::warn!("control socket: cannot serve a client: {e}");
                        }
                    }
                }
            })?;
        Ok(Self {
            path,
            client,
            stop,
            thread: Some(thread),
        })
    }

    /// The client being served, if one is.
    pub fn client(&self) -> Option<Client> {
        *self
            .client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One connection: the hello (refused while another client is served), the requests, and
/// what its end leaves to do.
fn serve_client(
    mut stream: UnixStream,
    mut machine: Box<dyn Machine + Send>,
    guest: ServedGuest,
    client: &Mutex<Option<Client>>,
    on_end: &Mutex<OnEnd>,
) {
    let _ = stream.set_nonblocking(false);
    let refuse = |stream: &mut UnixStream, why: String| {
        let body = Message::default().u8(1).u8(3).bytes(why.as_bytes()).0;
        let _ = write_frame(stream, &body);
    };
    // The hello first: its pid names the client.
    let hello = match read_frame(&mut stream) {
        Ok(Some(body)) => body,
        _ => return,
    };
    let mut f = Fields(&hello);
    let pid = match (
        f.u8("opcode"),
        f.take(8, "magic"),
        f.u32("version"),
        f.u32("pid"),
    ) {
        (Ok(OP_HELLO), Ok(m), Ok(VERSION), Ok(pid)) if m == MAGIC => pid,
        (Ok(OP_HELLO), Ok(m), Ok(v), _) if m == MAGIC => {
            refuse(
                &mut stream,
                format!("this VMM speaks version {VERSION} of the control protocol, not {v}"),
            );
            return;
        }
        _ => {
            refuse(
                &mut stream,
                "this is exotap's VMM control socket; the first request must be its hello".into(),
            );
            return;
        }
    };
    {
        let mut held = client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(other) = *held {
            refuse(
                &mut stream,
                format!(
                    "the VMM serves one client at a time, and exotap pid {} holds it",
                    other.pid
                ),
            );
            return;
        }
        *held = Some(Client { pid });
    }
    tracing::info!("control socket: client pid {pid} connected");
    let served = match answer(&mut *machine, &guest, &hello) {
        Ok(Ok(m)) => write_frame(&mut stream, &m.0)
            .and_then(|()| serve_connection(&mut stream, &mut *machine, &guest)),
        Ok(Err(e)) => write_frame(&mut stream, &error_body(&e)),
        Err(e) => Err(e),
    };
    if let Err(e) = served {
        let cause = std::error::Error::source(&e)
            .map(|c| format!(": {c}"))
            .unwrap_or_default();
        tracing::warn!("control socket: client pid {pid}: {e}{cause}");
    }
    tracing::info!("control socket: client pid {pid} disconnected");
    {
        let mut end = on_end
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (*end)(&mut *machine, Client { pid });
    }
    if machine.is_paused() {
        if let Err(e) = machine.resume() {
            tracing::warn!(
                "control socket: cannot resume the guest client pid {pid} left paused: {e}"
            );
        }
    }
    *client
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
}

/// The [`Machine`] of a guest that a running exotap VMM serves on its control socket.
#[derive(Debug)]
pub struct ControlClient {
    stream: std::cell::RefCell<UnixStream>,
    backend: String,
    reads_while_running: bool,
    patch_heap: Option<(u64, u64)>,
    /// The server's RAM mapped here (op 19), where it shares it.
    ram: Option<GuestMemoryMmap>,
}

fn lost(e: SocketError) -> ControlError {
    ControlError::Backend {
        backend: CLIENT_BACKEND,
        source: Box::new(e),
    }
}

impl ControlClient {
    /// Connects to the control socket at `path` and says hello; each answer is awaited for
    /// `timeout`.
    ///
    /// # Errors
    /// Nothing listens there, or it is not a VMM's control socket of this version, or it
    /// serves another client.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Self, ControlError> {
        let stream = UnixStream::connect(path).map_err(|e| ControlError::Backend {
            backend: CLIENT_BACKEND,
            source: format!("cannot connect to {}: {e}", path.display()).into(),
        })?;
        stream
            .set_read_timeout(Some(timeout.max(MAX_WAIT + Duration::from_secs(5))))
            .map_err(|e| lost(e.into()))?;
        let mut client = Self {
            stream: std::cell::RefCell::new(stream),
            backend: String::new(),
            reads_while_running: false,
            patch_heap: None,
            ram: None,
        };
        let mut hello = Message::default().u8(OP_HELLO);
        hello.0.extend_from_slice(MAGIC);
        let hello = hello.u32(VERSION).u32(std::process::id());
        let answer = client.call(&hello).map_err(|e| match e {
            ControlError::Backend { source, .. } => lost(SocketError::Hello(source.to_string())),
            e => e,
        })?;
        let mut f = Fields(&answer);
        let parsed = (|| -> Result<bool, SocketError> {
            let version = f.u32("version")?;
            if version != VERSION {
                return Err(SocketError::Hello(format!(
                    "the VMM speaks version {version}, this exotap {VERSION}"
                )));
            }
            client.backend = f.str("backend")?;
            let flags = f.u8("flags")?;
            client.reads_while_running = flags & 1 != 0;
            let known = f.u8("heap known")? != 0;
            let heap = (f.u64("heap gpa")?, f.u64("heap size")?);
            client.patch_heap = known.then_some(heap);
            Ok(flags & 2 != 0)
        })();
        if parsed.map_err(lost)? {
            match client.map_ram() {
                Ok(ram) => {
                    if let Some(ram) = &ram {
                        use vm_memory::{GuestMemoryBackend as _, GuestMemoryRegion as _};
                        let bytes: u64 = ram.iter().map(|r| r.len()).sum();
                        tracing::info!(
                            "the VMM's guest RAM is mapped here ({} MiB in {} regions): guest \
                             memory is read and written with no request",
                            bytes >> 20,
                            ram.num_regions()
                        );
                    }
                    client.ram = ram;
                }
                Err(e) => tracing::warn!(
                    "the VMM offers its RAM, but it cannot be mapped here ({e}): guest memory \
                     goes through the socket"
                ),
            }
        }
        Ok(client)
    }

    /// Whether the server's guest RAM is mapped in this process (op 19).
    pub fn maps_ram(&self) -> bool {
        self.ram.is_some()
    }

    /// Asks for the server's RAM (op 19) and maps it.
    fn map_ram(&self) -> Result<Option<GuestMemoryMmap>, SocketError> {
        let stream = self.stream.borrow_mut();
        write_frame(&mut &*stream, &[OP_SHARE_RAM])?;
        let mut got = vec![0u8; 4096];
        let (n, file) = stream
            .recv_with_fd(&mut got)
            .map_err(|e| SocketError::Io(std::io::Error::from_raw_os_error(e.errno())))?;
        got.truncate(n);
        while got.len() < 4 {
            let mut b = [0u8; 4];
            let k = (&*stream).read(&mut b[..4 - got.len()])?;
            if k == 0 {
                return Err(SocketError::Malformed("the RAM answer ended early".into()));
            }
            got.extend_from_slice(&b[..k]);
        }
        let len = u32::from_le_bytes([got[0], got[1], got[2], got[3]]) as usize;
        if len > MAX_FRAME || got.len() > 4 + len {
            return Err(SocketError::Malformed(format!(
                "a RAM answer of {len} bytes ({} read)",
                got.len() - 4
            )));
        }
        let mut rest = vec![0u8; 4 + len - got.len()];
        (&*stream).read_exact(&mut rest)?;
        got.extend_from_slice(&rest);
        let mut f = Fields(&got[4..]);
        if f.u8("status")? != 0 {
            return Err(SocketError::Malformed(format!(
                "the VMM refused to share its RAM: {}",
                get_error(&mut f).map_or_else(|e| e.to_string(), |e| e.to_string())
            )));
        }
        let n = f.u32("regions")?;
        let Some(file) = file else {
            return if n == 0 {
                Ok(None)
            } else {
                Err(SocketError::Malformed(format!(
                    "{n} RAM regions and no file descriptor"
                )))
            };
        };
        // recvmsg(2) without MSG_CMSG_CLOEXEC: keep the descriptor out of the commands
        // exotap starts.
        // SAFETY: fcntl on a descriptor this process owns (`file`); no memory is passed.
        unsafe {
            libc::fcntl(
                std::os::fd::AsRawFd::as_raw_fd(&file),
                libc::F_SETFD,
                libc::FD_CLOEXEC,
            );
        }
        let file = Arc::new(file);
        let file_len = file.metadata()?.len();
        let mut ranges = Vec::new();
        for _ in 0..n.min(64) {
            let (gpa, size, offset) = (f.u64("gpa")?, f.u64("size")?, f.u64("offset")?);
            let inside = offset.checked_add(size).is_some_and(|end| end <= file_len);
            if !inside || size == 0 || gpa.checked_add(size).is_none() {
                return Err(SocketError::Malformed(format!(
                    "RAM region {gpa:#x}+{size:#x} at file offset {offset:#x} is not inside the \
                     {file_len}-byte file"
                )));
            }
            let size = usize::try_from(size)
                .map_err(|_| SocketError::Malformed(format!("RAM region of {size} bytes")))?;
            ranges.push((
                vm_memory::GuestAddress(gpa),
                size,
                Some(vm_memory::FileOffset::from_arc(Arc::clone(&file), offset)),
            ));
        }
        ranges.sort_by_key(|r| r.0);
        GuestMemoryMmap::from_ranges_with_files(&ranges)
            .map(Some)
            .map_err(|e| SocketError::Malformed(format!("cannot map the VMM's RAM: {e}")))
    }

    /// The backend behind the socket (`kvm`).
    pub fn served_backend(&self) -> &str {
        &self.backend
    }

    /// Sends one request and returns the answer's payload (after the status byte).
    fn call(&self, request: &Message) -> Result<Vec<u8>, ControlError> {
        let mut stream = self.stream.borrow_mut();
        write_frame(&mut *stream, &request.0).map_err(lost)?;
        let body = read_frame(&mut *stream).map_err(lost)?.ok_or_else(|| {
            lost(SocketError::Io(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the VMM closed the control socket (it exited?)",
            )))
        })?;
        let mut f = Fields(&body);
        match f.u8("status").map_err(lost)? {
            0 => Ok(f.0.to_vec()),
            _ => Err(get_error(&mut f).map_err(lost)?),
        }
    }

    fn call_unit(&self, request: Message) -> Result<(), ControlError> {
        self.call(&request).map(drop)
    }

    /// Reads `buf` from `addr` in requests of at most [`MAX_TRANSFER`] bytes, each made by
    /// `request(at, len)`; an answer of another length is an error.
    fn read_chunked(
        &self,
        addr: u64,
        buf: &mut [u8],
        request: impl Fn(u64, u32) -> Message,
    ) -> Result<(), ControlError> {
        for (i, chunk) in buf.chunks_mut(MAX_TRANSFER).enumerate() {
            let at = addr.wrapping_add((i * MAX_TRANSFER) as u64);
            let a = self.call(&request(at, chunk.len() as u32))?;
            let got = Self::parse(&a, |f| f.bytes("data").map(<[u8]>::to_vec))?;
            if got.len() != chunk.len() {
                return Err(lost(SocketError::Malformed(format!(
                    "{} bytes for a read of {}",
                    got.len(),
                    chunk.len()
                ))));
            }
            chunk.copy_from_slice(&got);
        }
        Ok(())
    }

    fn parse<T>(
        answer: &[u8],
        get: impl FnOnce(&mut Fields<'_>) -> Result<T, SocketError>,
    ) -> Result<T, ControlError> {
        get(&mut Fields(answer)).map_err(lost)
    }
}

impl Machine for ControlClient {
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        let a = self.call(&Message::default().u8(OP_VCPUS))?;
        Self::parse(&a, |f| {
            let n = f.u32("count")?;
            (0..n).map(|_| f.u32("vcpu").map(VcpuId)).collect()
        })
    }

    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        if let Some(ram) = &self.ram {
            if ram.read_slice(buf, vm_memory::GuestAddress(addr)).is_ok() {
                return Ok(());
            }
        }
        self.read_chunked(addr, buf, |at, len| {
            Message::default().u8(OP_READ_PHYS).u64(at).u32(len)
        })
    }

    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        if let Some(ram) = &self.ram {
            if ram.write_slice(data, vm_memory::GuestAddress(addr)).is_ok() {
                return Ok(());
            }
        }
        for (i, chunk) in data.chunks(MAX_TRANSFER).enumerate() {
            let at = addr.wrapping_add((i * MAX_TRANSFER) as u64);
            self.call_unit(Message::default().u8(OP_WRITE_PHYS).u64(at).bytes(chunk))?;
        }
        Ok(())
    }

    fn read_virt(&mut self, vcpu: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.read_chunked(addr, buf, |at, len| {
            Message::default()
                .u8(OP_READ_VIRT)
                .u32(vcpu.0)
                .u64(at)
                .u32(len)
        })
    }

    fn write_virt(&mut self, vcpu: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        for (i, chunk) in data.chunks(MAX_TRANSFER).enumerate() {
            let at = addr.wrapping_add((i * MAX_TRANSFER) as u64);
            self.call_unit(
                Message::default()
                    .u8(OP_WRITE_VIRT)
                    .u32(vcpu.0)
                    .u64(at)
                    .bytes(chunk),
            )?;
        }
        Ok(())
    }

    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError> {
        let a = self.call(&Message::default().u8(OP_REGISTERS).u32(vcpu.0))?;
        Self::parse(&a, get_registers)
    }

    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError> {
        self.call_unit(Message::default().u8(OP_SET_PC).u32(vcpu.0).u64(pc))
    }

    fn pause(&mut self) -> Result<(), ControlError> {
        self.call_unit(Message::default().u8(OP_PAUSE))
    }

    fn resume(&mut self) -> Result<(), ControlError> {
        self.call_unit(Message::default().u8(OP_RESUME))
    }

    /// Asks the VMM; a lost connection reads as not paused.
    fn is_paused(&self) -> bool {
        self.call(&Message::default().u8(OP_IS_PAUSED))
            .ok()
            .and_then(|a| a.first().copied())
            .is_some_and(|b| b != 0)
    }

    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError> {
        self.call_unit(
            Message::default()
                .u8(OP_BREAKPOINT)
                .u64(addr)
                .u8(u8::from(insert)),
        )
    }

    fn wait_event(&mut self, timeout: Duration) -> Result<Option<StopEvent>, ControlError> {
        let ms = u32::try_from(timeout.min(MAX_WAIT).as_millis()).unwrap_or(u32::MAX);
        let a = self.call(&Message::default().u8(OP_WAIT_EVENT).u32(ms))?;
        Self::parse(&a, |f| match f.u8("some")? {
            0 => Ok(None),
            _ => get_event(f).map(Some),
        })
    }

    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError> {
        let a = self.call(&Message::default().u8(OP_STEP).u32(vcpu.0))?;
        Self::parse(&a, get_event)
    }

    fn backend(&self) -> &'static str {
        CLIENT_BACKEND
    }

    fn idt_base(&mut self, vcpu: VcpuId) -> Result<u64, ControlError> {
        let a = self.call(&Message::default().u8(OP_IDT_BASE).u32(vcpu.0))?;
        Self::parse(&a, |f| f.u64("idt base"))
    }

    fn set_register(&mut self, vcpu: VcpuId, name: &str, value: u64) -> Result<(), ControlError> {
        self.call_unit(
            Message::default()
                .u8(OP_SET_REGISTER)
                .u32(vcpu.0)
                .bytes(name.as_bytes())
                .u64(value),
        )
    }

    fn reads_while_running(&self) -> bool {
        self.reads_while_running
    }

    /// The VMM undoes what a client's journal lists when its connection ends (killed or
    /// not): no guardian process is needed.
    fn guest_outlives_process(&self) -> bool {
        false
    }

    fn pause_count(&self) -> Option<u64> {
        let a = self.call(&Message::default().u8(OP_PAUSE_COUNT)).ok()?;
        let mut f = Fields(&a);
        let known = f.u8("known").ok()? != 0;
        let n = f.u64("count").ok()?;
        known.then_some(n)
    }

    fn patch_heap(&self) -> Option<(u64, u64)> {
        self.patch_heap
    }

    fn release(&mut self) -> Result<(), ControlError> {
        self.call_unit(Message::default().u8(OP_RELEASE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        fn set_register(
            &mut self,
            vcpu: VcpuId,
            name: &str,
            value: u64,
        ) -> Result<(), ControlError> {
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
        std::os::unix::fs::FileExt::read_exact_at(
            &*file,
            &mut back,
            offset + size - ours.len() as u64,
        )
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
}
