//! The control socket's server: the thread that accepts one client at a time, answers its
//! requests on a [`Machine`], and hands the machine to `on_end` when the client goes.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::sock_ctrl_msg::ScmSocket as _;

use super::wire::{error_body, put_event, put_registers, read_frame, write_frame, Fields, Message};
use super::{
    SocketError, MAGIC, MAX_WAIT, OP_BREAKPOINT, OP_HELLO, OP_IDT_BASE, OP_IS_PAUSED, OP_PAUSE,
    OP_PAUSE_COUNT, OP_READ_PHYS, OP_READ_VIRT, OP_REGISTERS, OP_RELEASE, OP_RESUME, OP_SET_PC,
    OP_SET_REGISTER, OP_SHARE_RAM, OP_STEP, OP_VCPUS, OP_WAIT_EVENT, OP_WRITE_PHYS, OP_WRITE_VIRT,
    VERSION,
};
use crate::control::{ControlError, Machine, VcpuId};

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
/// The socket failed, or a frame was over [`MAX_FRAME`](super::MAX_FRAME) (the connection
/// cannot go on).
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
