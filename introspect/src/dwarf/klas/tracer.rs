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

/// Why a program could not be traced to its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TraceError {
    /// This environment does not let a process be traced: `PTRACE_TRACEME` was refused with
    /// `EPERM` (a seccomp filter, Yama's `ptrace_scope` 3, or the tests already under a
    /// tracer). The only cause a test may skip for.
    NotPermitted(String),
    /// Anything else (fork, execv, waitpid or a ptrace request failed, the program exited
    /// with an error or ran no instruction): a failure of the run.
    Failed(String),
}

impl std::fmt::Display for TraceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotPermitted(why) => write!(f, "ptrace is not permitted here: {why}"),
            Self::Failed(why) => f.write_str(why),
        }
    }
}

/// What the child reports through its close-on-exec pipe when it fails before its exec.
const STAGE_TRACEME: u8 = 1;
const STAGE_EXECV: u8 = 2;

/// The calling thread's `errno`, as an error.
fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Runs `path` to its end, returning the accesses that touch one of `ranges` (start, len),
/// or why it could not. Every system call is checked: only a refused `PTRACE_TRACEME`
/// ([`TraceError::NotPermitted`]) is an environment's limit, everything else is
/// [`TraceError::Failed`], as is a program that exits with a non-zero status or runs no
/// instruction.
pub(crate) fn trace(path: &std::path::Path, ranges: &[(u64, u64)]) -> Result<Trace, TraceError> {
    use std::os::unix::ffi::OsStrExt;
    let failed = |what: &str, e: std::io::Error| TraceError::Failed(format!("{what}: {e}"));
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| TraceError::Failed(e.to_string()))?;
    let argv = [c_path.as_ptr(), std::ptr::null()];
    // The child writes [stage, errno (4 bytes, native order)] here when PTRACE_TRACEME or
    // execv fails; the pipe closes on a successful exec, so the parent reads nothing.
    let mut fds = [0; 2];
    // SAFETY: fds is a valid out array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(failed("pipe2", last_error()));
    }
    let [read_end, write_end] = fds;
    // SAFETY: fork in a test process; the child only calls async-signal-safe functions
    // (ptrace, write, execv, _exit) before exec.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = last_error();
        // SAFETY: closing the two ends this function opened.
        unsafe {
            libc::close(read_end);
            libc::close(write_end);
        }
        return Err(failed("fork", e));
    }
    if pid == 0 {
        // SAFETY: child side of fork: ask to be traced and exec the program; on a failure,
        // report the stage and errno to the parent and exit.
        unsafe {
            let report = |stage: u8| {
                let errno = *libc::__errno_location();
                let mut msg = [0u8; 5];
                msg[0] = stage;
                msg[1..].copy_from_slice(&errno.to_ne_bytes());
                libc::write(write_end, msg.as_ptr().cast(), msg.len());
            };
            libc::close(read_end);
            if libc::ptrace(
                libc::PTRACE_TRACEME,
                0,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            ) < 0
            {
                report(STAGE_TRACEME);
                libc::_exit(127);
            }
            libc::execv(c_path.as_ptr(), argv.as_ptr());
            report(STAGE_EXECV);
            libc::_exit(127);
        }
    }
    // SAFETY: the parent's copy of the child's end.
    unsafe { libc::close(write_end) };
    let mut msg = [0u8; 5];
    let mut got = 0;
    while got < msg.len() {
        // SAFETY: reading into the rest of msg from the pipe this function opened.
        let n = unsafe { libc::read(read_end, msg[got..].as_mut_ptr().cast(), msg.len() - got) };
        match n {
            0 => break,
            n if n > 0 => got += n.unsigned_abs(),
            _ if last_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => {
                let e = last_error();
                reap(pid);
                // SAFETY: closing the end this function opened.
                unsafe { libc::close(read_end) };
                return Err(failed("reading the child's report", e));
            }
        }
    }
    // SAFETY: closing the end this function opened.
    unsafe { libc::close(read_end) };
    if got > 0 {
        let errno = i32::from_ne_bytes([msg[1], msg[2], msg[3], msg[4]]);
        let e = std::io::Error::from_raw_os_error(errno);
        // The child has exited (127); reap it.
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        return Err(match (got, msg[0]) {
            (5, STAGE_TRACEME) if errno == libc::EPERM => {
                TraceError::NotPermitted(format!("PTRACE_TRACEME: {e}"))
            }
            (5, STAGE_TRACEME) => failed("PTRACE_TRACEME", e),
            (5, STAGE_EXECV) => failed(&format!("execv {}", path.display()), e),
            _ => TraceError::Failed(format!(
                "the child's report is cut short or garbled: {:?}",
                &msg[..got]
            )),
        });
    }
    let mut out = Trace::default();
    let mut factory = InstructionInfoFactory::new();
    let inside = |a: u64| ranges.iter().any(|&(s, l)| a >= s && a < s + l);
    // Kills and reaps the stopped child, and says why.
    let abort = |what: &str, e: std::io::Error| {
        reap(pid);
        failed(what, e)
    };
    let mut status = 0;
    loop {
        // SAFETY: waiting for our own child.
        if unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
            let e = last_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(abort("waitpid", e));
        }
        if libc::WIFEXITED(status) {
            let code = libc::WEXITSTATUS(status);
            if code != 0 {
                return Err(TraceError::Failed(format!(
                    "{} exited with status {code} under the tracer",
                    path.display()
                )));
            }
            break;
        }
        if libc::WIFSIGNALED(status) {
            return Err(TraceError::Failed(format!(
                "{} was killed by signal {} under the tracer",
                path.display(),
                libc::WTERMSIG(status)
            )));
        }
        // A signal for the program (not the trap of a step or of its exec) is passed on with
        // the next step, as it would have come untraced; its instruction has not run yet.
        let signal = libc::WSTOPSIG(status);
        if signal != libc::SIGTRAP {
            // SAFETY: resume the stopped tracee for one instruction, delivering its signal.
            let resumed = unsafe {
                libc::ptrace(
                    libc::PTRACE_SINGLESTEP,
                    pid,
                    std::ptr::null_mut::<libc::c_void>(),
                    signal as usize as *mut libc::c_void,
                )
            };
            if resumed < 0 {
                return Err(abort("PTRACE_SINGLESTEP", last_error()));
            }
            continue;
        }
        // SAFETY: user_regs_struct is plain data; PTRACE_GETREGS fills it for a stopped tracee.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        // SAFETY: the child is stopped under our trace; regs is a valid out pointer.
        let got_regs = unsafe {
            libc::ptrace(
                libc::PTRACE_GETREGS,
                pid,
                std::ptr::null_mut::<libc::c_void>(),
                &mut regs as *mut _ as *mut libc::c_void,
            )
        };
        if got_regs < 0 {
            return Err(abort("PTRACE_GETREGS", last_error()));
        }
        out.executed.insert(regs.rip);
        let mut code = [0u8; 16];
        for (i, chunk) in code.chunks_mut(8).enumerate() {
            let at = regs.rip + 8 * i as u64;
            // PEEKTEXT returns the word, so -1 is an error only with errno set.
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: reading the stopped tracee's text; an unmapped address fails (EIO).
            let word = unsafe {
                libc::ptrace(
                    libc::PTRACE_PEEKTEXT,
                    pid,
                    at as *mut libc::c_void,
                    std::ptr::null_mut::<libc::c_void>(),
                )
            };
            // SAFETY: errno is this thread's.
            let errno = unsafe { *libc::__errno_location() };
            if word == -1 && errno != 0 {
                // The instruction's own first bytes must be readable; the second word may lie
                // past the end of the mapping (then it stays zero).
                if i == 0 {
                    return Err(abort(
                        &format!("PTRACE_PEEKTEXT at {at:#x}"),
                        std::io::Error::from_raw_os_error(errno),
                    ));
                }
                break;
            }
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
        let stepped = unsafe {
            libc::ptrace(
                libc::PTRACE_SINGLESTEP,
                pid,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            )
        };
        if stepped < 0 {
            return Err(abort("PTRACE_SINGLESTEP", last_error()));
        }
    }
    if out.executed.is_empty() {
        return Err(TraceError::Failed(format!(
            "{} exited without a single traced instruction",
            path.display()
        )));
    }
    Ok(out)
}

/// Kills the child `pid` and waits for it (after a failure mid-trace).
fn reap(pid: libc::pid_t) {
    let mut status = 0;
    // SAFETY: signalling and waiting for our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
    }
}
