//! Walking a kernel stack with the ORC tables, the way Linux 6.1's `unwind_next_frame` does,
//! from outside the guest: every word comes through [`StackMemory`] and is untrusted.

use std::ops::Range;

use super::entry::{OrcEntry, OrcReg, OrcType};
use super::patched::PatchedRules;
use super::stack::{InactiveTaskFrame, IretFrame, PtRegs, StackMemory};
use super::table::OrcTable;

/// Frames [`Unwinder`] reports at most unless told otherwise.
pub const DEFAULT_MAX_FRAMES: usize = 64;

/// Why an unwind stopped before the end of the stack.
#[derive(Debug, thiserror::Error)]
pub enum UnwindError {
    /// A stack word could not be read.
    #[error("reading the {what} at {addr:#x} failed")]
    StackRead {
        /// What the word was for.
        what: &'static str,
        /// Its guest-virtual address.
        addr: u64,
        /// The reader's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// No table covers the pc (and the frame-pointer guess is off or the pc is not a
    /// kernel address).
    #[error("no ORC entry covers {pc:#x}: not kernel text, or code of a module whose table was not given, BPF, or a trampoline")]
    NoEntry {
        /// The pc.
        pc: u64,
    },
    /// The entry for the pc says there is no unwind information there.
    #[error("the ORC data has no rule for {pc:#x} (undefined entry)")]
    Undefined {
        /// The pc.
        pc: u64,
    },
    /// The entry's type is not one the layout defines.
    #[error("the ORC entry for {pc:#x} has unknown type {value}")]
    UnknownType {
        /// The pc.
        pc: u64,
        /// The type field.
        value: u8,
    },
    /// The entry bases the caller's stack pointer on a register no rule can use.
    #[error(
        "the ORC entry for {pc:#x} bases the stack pointer on {reg}, which has no meaning there"
    )]
    UnsupportedSpReg {
        /// The pc.
        pc: u64,
        /// The base register.
        reg: OrcReg,
    },
    /// The entry bases the caller's stack pointer on a general register whose value is
    /// not known: only a full register set (the starting vCPU registers, or a `pt_regs`
    /// frame) has it.
    #[error("the ORC entry for {pc:#x} bases the stack pointer on {reg}, whose value is unknown here (no full register set)")]
    MissingRegister {
        /// The pc.
        pc: u64,
        /// The register.
        reg: OrcReg,
    },
    /// The entry bases the saved frame pointer on a register no rule can use.
    #[error(
        "the ORC entry for {pc:#x} bases the frame pointer on {reg}, which has no meaning there"
    )]
    UnsupportedBpReg {
        /// The pc.
        pc: u64,
        /// The base register.
        reg: OrcReg,
    },
    /// An address computed from the entry runs off either end of the address space.
    #[error("the frame computed from the ORC entry for {pc:#x} lies outside the address space")]
    AddressOverflow {
        /// The pc.
        pc: u64,
    },
    /// The saved stack pointer of a sleeping task leaves no room for its frame.
    #[error("the task's saved stack pointer {thread_sp:#x} leaves no room for its switch frame")]
    TaskFrameOverflow {
        /// `task->thread.sp`.
        thread_sp: u64,
    },
    /// The caller's stack pointer is not above the callee's on the same stack: corrupt
    /// ORC data or a corrupt stack, which would otherwise loop.
    #[error("the stack goes the wrong way at {pc:#x}: the caller's stack pointer {sp:#x} is not above {prev_sp:#x}")]
    WrongDirection {
        /// The pc being unwound.
        pc: u64,
        /// The caller's stack pointer.
        sp: u64,
        /// The callee's stack pointer.
        prev_sp: u64,
    },
    /// A stack switch led back to a frame already reported.
    #[error("the unwind came back to a frame it already reported (pc {pc:#x}, sp {sp:#x})")]
    Cycle {
        /// The repeated pc.
        pc: u64,
        /// The repeated stack pointer.
        sp: u64,
    },
}

/// Where an unwind starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnwindStart {
    /// The pc.
    pub ip: u64,
    /// The stack pointer.
    pub sp: u64,
    /// The frame pointer (callee-saved `rbp`, whatever it holds).
    pub bp: u64,
    /// Every register, when known (a stopped vCPU). Rules based on `r10`, `r13`, `rdi` or
    /// `rdx` (entry code) need them.
    pub regs: Option<PtRegs>,
    /// `ip` is the exact interrupted instruction rather than a return address.
    pub signal: bool,
}

impl UnwindStart {
    /// Starts from a vCPU's registers (or a `pt_regs` the caller found): the pc is exact.
    pub fn from_regs(regs: PtRegs) -> Self {
        Self {
            ip: regs.ip,
            sp: regs.sp,
            bp: regs.bp,
            regs: Some(regs),
            signal: true,
        }
    }

    /// Starts from a task that is not running, as Linux 6.1's `__unwind_start` does:
    /// `thread_sp` (`task->thread.sp`) points at the [`InactiveTaskFrame`] that
    /// `__switch_to_asm` pushed; the pc is its return address, the stack pointer is just
    /// above the frame, the frame pointer is the saved `rbp`. `ret_from_fork` (its running
    /// address, when known) marks a task that never ran, whose pc is exact.
    ///
    /// # Errors
    /// [`UnwindError::TaskFrameOverflow`], [`UnwindError::StackRead`].
    pub fn from_inactive_task<M: StackMemory + ?Sized>(
        mem: &mut M,
        thread_sp: u64,
        ret_from_fork: Option<u64>,
    ) -> Result<Self, UnwindError> {
        let sp = thread_sp
            .checked_add(InactiveTaskFrame::SIZE)
            .ok_or(UnwindError::TaskFrameOverflow { thread_sp })?;
        let frame = InactiveTaskFrame::read(mem, thread_sp)
            .map_err(|(addr, err)| stack_read("inactive task frame", addr, err))?;
        Ok(Self {
            ip: frame.ret_addr,
            sp,
            bp: frame.bp,
            regs: None,
            signal: Some(frame.ret_addr) == ret_from_fork,
        })
    }
}

/// How the unwinder reached a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// The starting state.
    Start,
    /// A return address on the stack.
    Call,
    /// A full `struct pt_regs` (interrupt, exception, syscall entry).
    Interrupt,
    /// A hardware iret frame only.
    Iret,
}

/// One frame of a backtrace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    /// The pc: the exact instruction when `signal`, else a return address.
    pub pc: u64,
    /// The stack pointer in this frame (for a call frame: just above the return address).
    pub sp: u64,
    /// The frame pointer as far as the unwinder tracks it.
    pub bp: u64,
    /// How the frame was found.
    pub kind: FrameKind,
    /// `pc` is exact (interrupted) rather than a return address.
    pub signal: bool,
    /// Every step to this frame followed ORC data; false from the first frame-pointer
    /// guess on.
    pub reliable: bool,
    /// The registers of an [`FrameKind::Interrupt`] frame (and of the start, when given).
    pub regs: Option<PtRegs>,
}

/// How a backtrace ended.
#[derive(Debug)]
pub enum StackEnd {
    /// An end-of-stack entry: the bottom of a kernel thread or of the entry code.
    EndOfStack,
    /// The next frame is in user mode (a `pt_regs` or iret frame saved from CPL 3, or a
    /// start in user mode).
    UserMode {
        /// The user pc.
        pc: u64,
        /// The user stack pointer.
        sp: u64,
    },
    /// The frame limit was reached.
    FrameLimit {
        /// The limit.
        max: usize,
    },
    /// The unwind failed; the frames before the failure are kept.
    Error(UnwindError),
}

impl From<UnwindError> for StackEnd {
    fn from(err: UnwindError) -> Self {
        Self::Error(err)
    }
}

/// The frames of one unwind and how it ended.
#[derive(Debug)]
pub struct Backtrace {
    /// Innermost first.
    pub frames: Vec<Frame>,
    /// Why there are no more.
    pub end: StackEnd,
}

impl Backtrace {
    /// Whether the unwind reached the bottom of the stack or user mode.
    pub fn is_complete(&self) -> bool {
        matches!(self.end, StackEnd::EndOfStack | StackEnd::UserMode { .. })
    }

    /// Whether it is complete and followed ORC data all the way (no guesses).
    pub fn is_reliable(&self) -> bool {
        self.is_complete() && self.frames.iter().all(|frame| frame.reliable)
    }

    /// The pcs, innermost first.
    pub fn pcs(&self) -> impl Iterator<Item = u64> + '_ {
        self.frames.iter().map(|frame| frame.pc)
    }
}

/// The registers the unwinder can still use, as the kernel tracks `regs`/`prev_regs`.
#[derive(Debug, Clone, Copy)]
enum KnownRegs {
    /// Only ip, sp, bp.
    None,
    /// A full register set.
    Full(PtRegs),
    /// An iret frame, and the full set of the frame before it when there was one.
    Iret {
        frame: IretFrame,
        prev_full: Option<PtRegs>,
    },
}

impl KnownRegs {
    /// The value of a general register, from the full set at hand or the previous one.
    fn get(&self, reg: impl Fn(&PtRegs) -> u64) -> Option<u64> {
        match self {
            Self::Full(regs)
            | Self::Iret {
                prev_full: Some(regs),
                ..
            } => Some(reg(regs)),
            _ => None,
        }
    }

    fn user_mode(&self) -> bool {
        match self {
            Self::None => false,
            Self::Full(regs) => regs.user_mode(),
            Self::Iret { frame, .. } => frame.user_mode(),
        }
    }
}

/// The unwinder's state between frames.
#[derive(Debug, Clone, Copy)]
struct State {
    ip: u64,
    sp: u64,
    bp: u64,
    regs: KnownRegs,
    signal: bool,
}

/// A table and the slide from its addresses to running ones.
#[derive(Debug, Clone, Copy)]
struct SlidTable<'t> {
    table: &'t OrcTable,
    slide: u64,
}

/// Unwinds kernel stacks with the ORC tables of the kernel image and of any modules.
#[derive(Debug, Clone)]
pub struct Unwinder<'t> {
    tables: Vec<SlidTable<'t>>,
    max_frames: usize,
    guess_frame_pointers: bool,
    stacks: Vec<Range<u64>>,
    patched: Option<&'t PatchedRules>,
    entry_returns: Vec<u64>,
}

impl<'t> Unwinder<'t> {
    /// An unwinder over `table`, whose addresses plus `slide` (the KASLR slide for a
    /// vmlinux file's link-time table, 0 for a table read from guest memory at running
    /// addresses) are running addresses.
    pub fn new(table: &'t OrcTable, slide: u64) -> Self {
        Self {
            tables: vec![SlidTable { table, slide }],
            max_frames: DEFAULT_MAX_FRAMES,
            guess_frame_pointers: false,
            stacks: Vec::new(),
            patched: None,
            entry_returns: Vec::new(),
        }
    }

    /// Adds another table (a module's), with its slide.
    pub fn with_table(mut self, table: &'t OrcTable, slide: u64) -> Self {
        self.tables.push(SlidTable { table, slide });
        self
    }

    /// Reports at most `max` frames (at least 1).
    pub fn with_max_frames(mut self, max: usize) -> Self {
        self.max_frames = max.max(1);
        self
    }

    /// For a kernel-half pc no table covers, guess a frame-pointer frame as the kernel does
    /// for BPF and trampolines, marking it and every later frame unreliable. Off by
    /// default: such a pc ends the unwind with [`UnwindError::NoEntry`].
    pub fn with_frame_pointer_guess(mut self, guess: bool) -> Self {
        self.guess_frame_pointers = guess;
        self
    }

    /// Declares a stack (a task, IRQ or exception stack, `[low, high)`). Within one
    /// declared stack the stack pointer must grow from frame to frame even across entry
    /// frames; without declarations only steps that may switch stacks (register frames and
    /// indirect or register-based stack pointers) may go down.
    pub fn with_stack(mut self, stack: Range<u64>) -> Self {
        self.stacks.push(stack);
        self
    }

    /// Rules for code the kernel patched at boot, taking precedence over the tables inside
    /// their sites ([`PatchedRules`]).
    pub fn with_patched(mut self, patched: &'t PatchedRules) -> Self {
        self.patched = Some(patched);
        self
    }

    /// Declares a return address that is a routine's first instruction, not the one after a
    /// call: a new task's `ret_from_fork` (`ret_from_fork_asm` where the kernel has it),
    /// which `__switch_to` returns to the first time the task runs. Its rule is looked up
    /// at the address itself, as the kernel's `__unwind_start` does for a task that never
    /// ran; one byte back is the end of the routine before it.
    pub fn with_entry_return(mut self, addr: u64) -> Self {
        self.entry_returns.push(addr);
        self
    }

    /// The ORC entry in force at the running address `addr`.
    pub fn entry_at(&self, addr: u64) -> Option<OrcEntry> {
        if let Some(entry) = self.patched.and_then(|p| p.entry_at(addr)) {
            return Some(entry);
        }
        self.tables.iter().find_map(|slid| {
            let link = addr.wrapping_sub(slid.slide);
            if !slid.table.covers(link) {
                return None;
            }
            slid.table.lookup(link).map(|(_, entry)| entry)
        })
    }

    /// Unwinds from `start`, reading the stack through `mem`. Never fails as a whole: the
    /// frames found before a problem are returned with the problem as [`StackEnd::Error`].
    pub fn unwind<M: StackMemory + ?Sized>(&self, start: &UnwindStart, mem: &mut M) -> Backtrace {
        let regs = start.regs.map_or(KnownRegs::None, KnownRegs::Full);
        let in_user = regs.user_mode() || (!is_kernel_half(start.ip) && start.ip != 0);
        if in_user {
            return Backtrace {
                frames: Vec::new(),
                end: StackEnd::UserMode {
                    pc: start.ip,
                    sp: start.sp,
                },
            };
        }
        let mut state = State {
            ip: start.ip,
            sp: start.sp,
            bp: start.bp,
            regs,
            signal: start.signal,
        };
        let mut reliable = self.has_rule(state.ip, state.signal);
        let mut frames = vec![Frame {
            pc: state.ip,
            sp: state.sp,
            bp: state.bp,
            kind: FrameKind::Start,
            signal: state.signal,
            reliable,
            regs: start.regs,
        }];
        loop {
            let (next, kind) = match self.step(&state, mem) {
                Ok(next) => next,
                Err(end) => return Backtrace { frames, end },
            };
            if !self.has_rule(next.ip, next.signal) {
                if !(self.guess_frame_pointers && is_kernel_half(next.ip)) {
                    return Backtrace::failed(frames, UnwindError::NoEntry { pc: next.ip });
                }
                reliable = false;
            }
            if frames.iter().any(|f| f.pc == next.ip && f.sp == next.sp) {
                let err = UnwindError::Cycle {
                    pc: next.ip,
                    sp: next.sp,
                };
                return Backtrace::failed(frames, err);
            }
            if frames.len() >= self.max_frames {
                return Backtrace {
                    frames,
                    end: StackEnd::FrameLimit {
                        max: self.max_frames,
                    },
                };
            }
            frames.push(Frame {
                pc: next.ip,
                sp: next.sp,
                bp: next.bp,
                kind,
                signal: next.signal,
                reliable,
                regs: match next.regs {
                    KnownRegs::Full(regs) => Some(regs),
                    _ => None,
                },
            });
            state = next;
        }
    }

    /// Whether some table covers the address the pc is looked up at (ip 0 has the kernel's
    /// built-in NULL-call rule).
    fn has_rule(&self, ip: u64, signal: bool) -> bool {
        let addr = lookup_addr(ip, signal);
        addr == 0 || self.entry_at(addr).is_some()
    }

    /// One step of `unwind_next_frame`: the caller's state from this one, or why the stack
    /// ends here (cleanly or not).
    fn step<M: StackMemory + ?Sized>(
        &self,
        st: &State,
        mem: &mut M,
    ) -> Result<(State, FrameKind), StackEnd> {
        let pc = st.ip;
        let addr = lookup_addr(pc, st.signal);
        let entry = if addr == 0 {
            OrcEntry::NULL_CALL
        } else {
            match self.entry_at(addr) {
                Some(entry) => entry,
                None if self.guess_frame_pointers && is_kernel_half(pc) => {
                    OrcEntry::FRAME_POINTER_GUESS
                }
                None => return Err(UnwindError::NoEntry { pc }.into()),
            }
        };
        match entry.kind {
            OrcType::Undefined => return Err(UnwindError::Undefined { pc }.into()),
            OrcType::EndOfStack => return Err(StackEnd::EndOfStack),
            OrcType::Unknown(value) => return Err(UnwindError::UnknownType { pc, value }.into()),
            OrcType::Call | OrcType::Regs | OrcType::RegsPartial => {}
        }
        let overflow = UnwindError::AddressOverflow { pc };
        let offset = i64::from(entry.sp_offset);
        let cfa = match entry.sp_reg {
            OrcReg::Sp => st.sp.checked_add_signed(offset).ok_or(overflow)?,
            OrcReg::Bp => st.bp.checked_add_signed(offset).ok_or(overflow)?,
            OrcReg::SpIndirect => read(mem, st.sp, "saved stack pointer")?
                .checked_add_signed(offset)
                .ok_or(overflow)?,
            OrcReg::BpIndirect => {
                let at = st.bp.checked_add_signed(offset).ok_or(overflow)?;
                read(mem, at, "saved stack pointer")?
            }
            reg @ (OrcReg::R10 | OrcReg::R13 | OrcReg::Di | OrcReg::Dx) => st
                .regs
                .get(|r| match reg {
                    OrcReg::R10 => r.r10,
                    OrcReg::R13 => r.r13,
                    OrcReg::Di => r.di,
                    _ => r.dx,
                })
                .ok_or(UnwindError::MissingRegister { pc, reg })?,
            reg @ (OrcReg::Undefined | OrcReg::PrevSp | OrcReg::Unknown(_)) => {
                return Err(UnwindError::UnsupportedSpReg { pc, reg }.into())
            }
        };
        let (ip, sp, regs, kind) = match entry.kind {
            OrcType::Regs => {
                cfa.checked_add(PtRegs::SIZE)
                    .ok_or(UnwindError::AddressOverflow { pc })?;
                let regs =
                    PtRegs::read(mem, cfa).map_err(|(at, err)| stack_read("pt_regs", at, err))?;
                (
                    regs.ip,
                    regs.sp,
                    KnownRegs::Full(regs),
                    FrameKind::Interrupt,
                )
            }
            OrcType::RegsPartial => {
                cfa.checked_add(IretFrame::SIZE)
                    .ok_or(UnwindError::AddressOverflow { pc })?;
                let frame = IretFrame::read(mem, cfa)
                    .map_err(|(at, err)| stack_read("iret frame", at, err))?;
                let prev_full = match st.regs {
                    KnownRegs::Full(regs) => Some(regs),
                    KnownRegs::Iret { prev_full, .. } => prev_full,
                    KnownRegs::None => None,
                };
                let regs = KnownRegs::Iret { frame, prev_full };
                (frame.ip, frame.sp, regs, FrameKind::Iret)
            }
            _ => {
                let slot = cfa
                    .checked_sub(8)
                    .ok_or(UnwindError::AddressOverflow { pc })?;
                let ip = read(mem, slot, "return address")?;
                (ip, cfa, KnownRegs::None, FrameKind::Call)
            }
        };
        if regs.user_mode() {
            return Err(StackEnd::UserMode { pc: ip, sp });
        }
        let bp_offset = i64::from(entry.bp_offset);
        let bp = match entry.bp_reg {
            OrcReg::Undefined => regs.get(|r| r.bp).unwrap_or(st.bp),
            OrcReg::PrevSp => {
                let at = cfa
                    .checked_add_signed(bp_offset)
                    .ok_or(UnwindError::AddressOverflow { pc })?;
                read(mem, at, "saved frame pointer")?
            }
            OrcReg::Bp => {
                let at = st
                    .bp
                    .checked_add_signed(bp_offset)
                    .ok_or(UnwindError::AddressOverflow { pc })?;
                read(mem, at, "saved frame pointer")?
            }
            reg => return Err(UnwindError::UnsupportedBpReg { pc, reg }.into()),
        };
        let may_switch = matches!(entry.kind, OrcType::Regs | OrcType::RegsPartial)
            || entry.sp_reg.may_switch_stacks();
        if sp <= st.sp && self.same_stack(st.sp, sp, may_switch) {
            return Err(UnwindError::WrongDirection {
                pc,
                sp,
                prev_sp: st.sp,
            }
            .into());
        }
        let next = State {
            ip,
            sp,
            bp,
            regs,
            signal: entry.signal || (kind == FrameKind::Call && self.entry_returns.contains(&ip)),
        };
        Ok((next, kind))
    }

    /// Whether two stack pointers must be on the same stack: both in one declared stack,
    /// or, when a declared stack does not settle it, the step could not switch stacks.
    fn same_stack(&self, prev_sp: u64, sp: u64, may_switch: bool) -> bool {
        let stack_of = |at: u64| self.stacks.iter().position(|s| s.contains(&at));
        match (stack_of(prev_sp), stack_of(sp)) {
            (Some(a), Some(b)) => a == b,
            _ => !may_switch,
        }
    }
}

impl Backtrace {
    fn failed(frames: Vec<Frame>, err: UnwindError) -> Self {
        Self {
            frames,
            end: StackEnd::Error(err),
        }
    }
}

/// The address whose entry applies: a return address belongs to its call instruction, so
/// one byte back (that also keeps a call to a noreturn function in its own function).
fn lookup_addr(ip: u64, signal: bool) -> u64 {
    if signal {
        ip
    } else {
        ip.wrapping_sub(1)
    }
}

/// Whether an address is in the upper (kernel) half of the canonical address space.
fn is_kernel_half(addr: u64) -> bool {
    addr >> 63 == 1
}

fn read<M: StackMemory + ?Sized>(
    mem: &mut M,
    addr: u64,
    what: &'static str,
) -> Result<u64, UnwindError> {
    mem.read_u64(addr)
        .map_err(|err| stack_read(what, addr, err))
}

fn stack_read<E: std::error::Error + Send + Sync + 'static>(
    what: &'static str,
    addr: u64,
    err: E,
) -> UnwindError {
    UnwindError::StackRead {
        what,
        addr,
        source: Box::new(err),
    }
}
