//! The control socket's wire format: frames, the fields of a message, and how registers,
//! events and errors are written into one and read back (the tables of [`super`]).

use std::io::{Read, Write};

use super::{SocketError, CLIENT_BACKEND, MAX_FRAME, MAX_TRANSFER};
use crate::control::{ControlError, RegisterFile, SparcRegisters, StopEvent, VcpuId, X86Registers};

pub(super) fn read_frame(stream: &mut impl Read) -> Result<Option<Vec<u8>>, SocketError> {
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

pub(super) fn write_frame(stream: &mut impl Write, body: &[u8]) -> Result<(), SocketError> {
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
pub(super) struct Fields<'a>(pub(super) &'a [u8]);

impl<'a> Fields<'a> {
    pub(super) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], SocketError> {
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
    pub(super) fn u8(&mut self, what: &str) -> Result<u8, SocketError> {
        Ok(self.take(1, what)?[0])
    }
    pub(super) fn u16(&mut self, what: &str) -> Result<u16, SocketError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub(super) fn u32(&mut self, what: &str) -> Result<u32, SocketError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(b))
    }
    pub(super) fn u64(&mut self, what: &str) -> Result<u64, SocketError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(b))
    }
    pub(super) fn bytes(&mut self, what: &str) -> Result<&'a [u8], SocketError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    pub(super) fn str(&mut self, what: &str) -> Result<String, SocketError> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| SocketError::Malformed(format!("{what} is not UTF-8")))
    }
    pub(super) fn len(&mut self, what: &str) -> Result<usize, SocketError> {
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
pub(super) struct Message(pub(super) Vec<u8>);

impl Message {
    pub(super) fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub(super) fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub(super) fn bytes(mut self, b: &[u8]) -> Self {
        self = self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
        self
    }
}

pub(super) fn put_registers(m: Message, regs: &RegisterFile) -> Message {
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

pub(super) fn get_registers(f: &mut Fields<'_>) -> Result<RegisterFile, SocketError> {
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

pub(super) fn put_event(m: Message, event: StopEvent) -> Message {
    match event {
        StopEvent::Breakpoint { vcpu, pc } => m.u8(0).u32(vcpu.0).u64(pc),
        StopEvent::Stepped { vcpu } => m.u8(1).u32(vcpu.0),
        StopEvent::Paused => m.u8(2),
        StopEvent::Exited => m.u8(3),
        StopEvent::Watchpoint { vcpu, pc, addr } => m.u8(4).u32(vcpu.0).u64(pc).u64(addr),
    }
}

pub(super) fn get_event(f: &mut Fields<'_>) -> Result<StopEvent, SocketError> {
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
        4 => StopEvent::Watchpoint {
            vcpu: VcpuId(f.u32("vcpu")?),
            pc: f.u64("pc")?,
            addr: f.u64("addr")?,
        },
        other => return Err(SocketError::Malformed(format!("unknown event {other}"))),
    })
}

pub(super) fn error_body(e: &ControlError) -> Vec<u8> {
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

pub(super) fn get_error(f: &mut Fields<'_>) -> Result<ControlError, SocketError> {
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
