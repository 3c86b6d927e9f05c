//! The control socket's client: a [`Machine`] whose calls are requests to a running exotap
//! VMM, with the guest's RAM mapped here where the server shares it (op 19).

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use vm_memory::{Bytes as _, GuestMemoryMmap};
use vmm_sys_util::sock_ctrl_msg::ScmSocket as _;

use super::wire::{get_error, get_event, get_registers, read_frame, write_frame, Fields, Message};
use super::{
    SocketError, CLIENT_BACKEND, MAGIC, MAX_FRAME, MAX_TRANSFER, MAX_WAIT, OP_BREAKPOINT, OP_HELLO,
    OP_IDT_BASE, OP_IS_PAUSED, OP_PAUSE, OP_PAUSE_COUNT, OP_READ_PHYS, OP_READ_VIRT, OP_REGISTERS,
    OP_RELEASE, OP_RESUME, OP_SET_PC, OP_SET_REGISTER, OP_SHARE_RAM, OP_STEP, OP_VCPUS,
    OP_WAIT_EVENT, OP_WRITE_PHYS, OP_WRITE_VIRT, VERSION,
};
use crate::control::{ControlError, Machine, RegisterFile, StopEvent, VcpuId};

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
