//! Test-only ground truth for KLAS: runs a native x86-64 program under ptrace, single-steps
//! it, decodes each instruction with iced and records every memory access whose address falls
//! in the given ranges (the struct instances of the program).
//!
//! The issue asked for Unicorn; the workspace has no Unicorn, and the host is x86-64, so the
//! program runs natively, one instruction at a time. The observation is the same: which
//! instruction touched which bytes.

use iced_x86::{Decoder, DecoderOptions, InstructionInfoFactory, OpAccess, Register};

/// One executed access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Touch {
    pub rip: u64,
    pub addr: u64,
    pub size: u64,
    pub write: bool,
}

fn reg_value(regs: &libc::user_regs_struct, reg: Register) -> Option<u64> {
    let full = reg.full_register();
    let v = match full {
        Register::RAX => regs.rax,
        Register::RBX => regs.rbx,
        Register::RCX => regs.rcx,
        Register::RDX => regs.rdx,
        Register::RSI => regs.rsi,
        Register::RDI => regs.rdi,
        Register::RBP => regs.rbp,
        Register::RSP => regs.rsp,
        Register::R8 => regs.r8,
        Register::R9 => regs.r9,
        Register::R10 => regs.r10,
        Register::R11 => regs.r11,
        Register::R12 => regs.r12,
        Register::R13 => regs.r13,
        Register::R14 => regs.r14,
        Register::R15 => regs.r15,
        Register::RIP => regs.rip,
        Register::FS => regs.fs_base,
        Register::GS => regs.gs_base,
        Register::ES | Register::CS | Register::SS | Register::DS => 0,
        _ => return None,
    };
    // Narrow index registers (e.g. a 32-bit index) use the low bits only.
    Some(match reg.size() {
        4 => v & 0xffff_ffff,
        2 => v & 0xffff,
        1 => v & 0xff,
        _ => v,
    })
}

/// What a traced run saw.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    /// Accesses to the watched ranges.
    pub touches: Vec<Touch>,
    /// Every instruction address executed.
    pub executed: std::collections::HashSet<u64>,
}

/// Runs `path` to its end, returning the accesses that touch one of `ranges` (start, len),
/// or why it could not.
pub(crate) fn trace(path: &std::path::Path, ranges: &[(u64, u64)]) -> Result<Trace, String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    let argv = [c_path.as_ptr(), std::ptr::null()];
    // SAFETY: fork in a test process; the child only calls async-signal-safe functions
    // (ptrace, execv, _exit) before exec.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err("fork failed".into());
    }
    if pid == 0 {
        // SAFETY: child side of fork: ask to be traced, exec the program, or exit.
        unsafe {
            libc::ptrace(
                libc::PTRACE_TRACEME,
                0,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            );
            libc::execv(c_path.as_ptr(), argv.as_ptr());
            libc::_exit(127);
        }
    }
    let mut status = 0;
    let mut out = Trace::default();
    let mut factory = InstructionInfoFactory::new();
    let inside = |a: u64| ranges.iter().any(|&(s, l)| a >= s && a < s + l);
    loop {
        // SAFETY: waiting for our own child.
        if unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
            return Err("waitpid failed".into());
        }
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            break;
        }
        // SAFETY: user_regs_struct is plain data; PTRACE_GETREGS fills it for a stopped tracee.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        // SAFETY: the child is stopped under our trace; regs is a valid out pointer.
        unsafe {
            libc::ptrace(
                libc::PTRACE_GETREGS,
                pid,
                std::ptr::null_mut::<libc::c_void>(),
                &mut regs as *mut _ as *mut libc::c_void,
            );
        }
        out.executed.insert(regs.rip);
        let mut code = [0u8; 16];
        for (i, chunk) in code.chunks_mut(8).enumerate() {
            // SAFETY: reading the stopped tracee's text; an unmapped address returns -1.
            let word = unsafe {
                libc::ptrace(
                    libc::PTRACE_PEEKTEXT,
                    pid,
                    (regs.rip + 8 * i as u64) as *mut libc::c_void,
                    std::ptr::null_mut::<libc::c_void>(),
                )
            };
            chunk.copy_from_slice(&word.to_le_bytes());
        }
        let mut decoder = Decoder::with_ip(64, &code, regs.rip, DecoderOptions::NONE);
        let instr = decoder.decode();
        for mem in factory.info(&instr).used_memory() {
            let Some(addr) = mem.virtual_address(0, |r, _, _| reg_value(&regs, r)) else {
                continue;
            };
            if inside(addr) {
                let write = matches!(
                    mem.access(),
                    OpAccess::Write
                        | OpAccess::CondWrite
                        | OpAccess::ReadWrite
                        | OpAccess::ReadCondWrite
                );
                out.touches.push(Touch {
                    rip: regs.rip,
                    addr,
                    size: mem.memory_size().size() as u64,
                    write,
                });
            }
        }
        // SAFETY: resume the stopped tracee for one instruction.
        unsafe {
            libc::ptrace(
                libc::PTRACE_SINGLESTEP,
                pid,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            );
        }
    }
    Ok(out)
}
