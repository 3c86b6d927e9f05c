//! Trap probes at any instruction boundary: which instruction sits at a probed address, how
//! the vCPU gets past it without the breakpoint there, and why a point is refused.
//!
//! The breakpoint stays in place while the guest runs (QEMU's gdbstub breakpoints do not
//! touch guest memory), so a stopped vCPU cannot just resume at the probed address. Instead:
//!
//! * relative branches, calls and returns are **emulated by the host**: `jmp`, `jcc`,
//!   `loop*`, `jrcxz`, `call rel32` and `ret [imm16]` set RIP (and RSP, RCX, the pushed return
//!   address) from the registers at the stop. Relocating them would work for most (iced turns
//!   a short `jcc` into a near one), but `loop` and `jrcxz` only exist with 8-bit offsets, and
//!   emulation needs no heap slot at all;
//! * everything else runs as an **out-of-line copy** in the patch heap: the instruction
//!   re-encoded there by the splice relocator ([`crate::splice::patch::out_of_line`],
//!   which rewrites RIP-relative operands and turns an indirect `call` into `push original
//!   return address; jmp`), then a `jmp` back to the next instruction.
//!
//! Either way it is one stop per hit and no single-step, and a hit on another vCPU while one
//! resumes is never missed.
//!
//! Refused, with the reason: an address that is not an instruction boundary of its function
//! (decoded from the function's start with the live bytes, so boot-time patching is seen),
//! undecodable bytes, an `int3` already there (a guest kprobe: copying it would copy the
//! trap), trap and privilege-changing instructions (`ud2` and `int` are found by address in
//! the kernel's bug and exception tables; `iret`, `sysret`, `syscall` change mode), `xbegin`,
//! `loop`/`jrcxz` with a 32-bit counter, and (decided by the caller) instructions with an
//! exception-table fixup and the entry text, which runs on the user page tables where the
//! patch heap is not mapped.

use iced_x86::{
    Code, ConditionCode, Decoder, DecoderOptions, FlowControl, Instruction, Mnemonic, OpKind,
};

use crate::splice::patch::out_of_line;

/// Longest x86 instruction.
pub const MAX_INSN: usize = 15;

/// RFLAGS bits the conditions read.
const CF: u64 = 1 << 0;
const PF: u64 = 1 << 2;
const ZF: u64 = 1 << 6;
const SF: u64 = 1 << 7;
const OF: u64 = 1 << 11;

/// Why a trap point cannot be armed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Outside the function's bytes.
    #[error("{addr:#x} is outside {function} [{start:#x}, {end:#x})")]
    Outside {
        /// The address.
        addr: u64,
        /// The function.
        function: String,
        /// Its first byte.
        start: u64,
        /// One past its last byte.
        end: u64,
    },
    /// Inside an instruction.
    #[error(
        "{addr:#x} is not an instruction boundary of {function}: it is inside the {len}-byte \
         instruction at {insn:#x}"
    )]
    NotBoundary {
        /// The address.
        addr: u64,
        /// The function.
        function: String,
        /// The instruction that covers it.
        insn: u64,
        /// Its length.
        len: usize,
    },
    /// Undecodable bytes on the way or at the point.
    #[error("{function} has undecodable bytes at {at:#x}, so {addr:#x} cannot be checked")]
    Undecodable {
        /// The address.
        addr: u64,
        /// The function.
        function: String,
        /// Where.
        at: u64,
    },
    /// An instruction that cannot run out of line and is not emulated.
    #[error("the instruction at {addr:#x} ({text}) {why}")]
    Unsupported {
        /// The address.
        addr: u64,
        /// The instruction as text.
        text: String,
        /// Why.
        why: &'static str,
    },
    /// The relocator refused.
    #[error("the instruction at {addr:#x} ({text}) cannot run out of line: {why}")]
    Relocation {
        /// The address.
        addr: u64,
        /// The instruction as text.
        text: String,
        /// The relocator's reason.
        why: String,
    },
}

/// A relative control transfer the host carries out itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emulation {
    /// `jmp rel`.
    Jump {
        /// Target.
        target: u64,
    },
    /// `jcc rel`.
    CondJump {
        /// The condition.
        cond: ConditionCode,
        /// Taken target.
        target: u64,
        /// Fall-through.
        next: u64,
    },
    /// `loop`, `loope`, `loopne` (`rcx -= 1`, then a condition) and `jrcxz`.
    Counter {
        /// Which.
        op: CounterOp,
        /// Taken target.
        target: u64,
        /// Fall-through.
        next: u64,
    },
    /// `call rel32`: push the next address, go to the target.
    Call {
        /// Callee.
        target: u64,
        /// Return address pushed.
        next: u64,
    },
    /// `ret` / `ret imm16`.
    Ret {
        /// Extra bytes popped after the return address.
        pop: u16,
    },
}

/// The RCX-counting branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterOp {
    /// `loop`.
    Loop,
    /// `loope`.
    Loope,
    /// `loopne`.
    Loopne,
    /// `jrcxz`.
    Jrcxz,
}

/// What to do at a hit to get past the probed instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrapAction {
    /// Resume at the out-of-line copy, whose bytes these are (placed at the slot address it
    /// was made for).
    OutOfLine {
        /// The copy.
        code: Vec<u8>,
        /// Whether the instruction has a RIP-relative operand (rewritten in the copy).
        rip_relative: bool,
    },
    /// Let the host do it.
    Emulate(Emulation),
}

impl TrapAction {
    /// A short name for reports: `jmp`, `jcc`, `loop`, `call`, `ret`, `rip-relative`,
    /// `out-of-line`.
    pub fn kind(&self) -> &'static str {
        match self {
            TrapAction::OutOfLine {
                rip_relative: true, ..
            } => "rip-relative",
            TrapAction::OutOfLine { .. } => "out-of-line",
            TrapAction::Emulate(Emulation::Jump { .. }) => "jmp",
            TrapAction::Emulate(Emulation::CondJump { .. }) => "jcc",
            TrapAction::Emulate(Emulation::Counter { .. }) => "loop",
            TrapAction::Emulate(Emulation::Call { .. }) => "call",
            TrapAction::Emulate(Emulation::Ret { .. }) => "ret",
        }
    }
}

/// The register and memory changes an emulated instruction makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effect {
    /// New RIP.
    pub rip: u64,
    /// New RSP, if it changes.
    pub rsp: Option<u64>,
    /// New RCX, if it changes.
    pub rcx: Option<u64>,
    /// A 64-bit store: (address, value).
    pub store: Option<(u64, u64)>,
}

/// Whether `cond` holds for these flags.
pub fn condition_holds(cond: ConditionCode, rflags: u64) -> bool {
    let set = |bit: u64| rflags & bit != 0;
    let sf_ne_of = set(SF) != set(OF);
    match cond {
        ConditionCode::None => true,
        ConditionCode::o => set(OF),
        ConditionCode::no => !set(OF),
        ConditionCode::b => set(CF),
        ConditionCode::ae => !set(CF),
        ConditionCode::e => set(ZF),
        ConditionCode::ne => !set(ZF),
        ConditionCode::be => set(CF) || set(ZF),
        ConditionCode::a => !set(CF) && !set(ZF),
        ConditionCode::s => set(SF),
        ConditionCode::ns => !set(SF),
        ConditionCode::p => set(PF),
        ConditionCode::np => !set(PF),
        ConditionCode::l => sf_ne_of,
        ConditionCode::ge => !sf_ne_of,
        ConditionCode::le => set(ZF) || sf_ne_of,
        ConditionCode::g => !set(ZF) && !sf_ne_of,
    }
}

impl Emulation {
    /// What the instruction does given `rip`-independent state: the flags, RCX and RSP at
    /// the stop, and (for `ret`) the 8 bytes at RSP.
    pub fn effect(&self, rflags: u64, rcx: u64, rsp: u64, top_of_stack: u64) -> Effect {
        let jump = |rip| Effect {
            rip,
            rsp: None,
            rcx: None,
            store: None,
        };
        match *self {
            Emulation::Jump { target } => jump(target),
            Emulation::CondJump { cond, target, next } => jump(if condition_holds(cond, rflags) {
                target
            } else {
                next
            }),
            Emulation::Counter { op, target, next } => {
                let (rcx_after, taken) = match op {
                    CounterOp::Jrcxz => (None, rcx == 0),
                    CounterOp::Loop | CounterOp::Loope | CounterOp::Loopne => {
                        let left = rcx.wrapping_sub(1);
                        let zf = rflags & ZF != 0;
                        let taken = left != 0
                            && match op {
                                CounterOp::Loope => zf,
                                CounterOp::Loopne => !zf,
                                _ => true,
                            };
                        (Some(left), taken)
                    }
                };
                Effect {
                    rip: if taken { target } else { next },
                    rsp: None,
                    rcx: rcx_after,
                    store: None,
                }
            }
            Emulation::Call { target, next } => {
                let sp = rsp.wrapping_sub(8);
                Effect {
                    rip: target,
                    rsp: Some(sp),
                    rcx: None,
                    store: Some((sp, next)),
                }
            }
            Emulation::Ret { pop } => Effect {
                rip: top_of_stack,
                rsp: Some(rsp.wrapping_add(8).wrapping_add(u64::from(pop))),
                rcx: None,
                store: None,
            },
        }
    }
}

/// Decodes `function` (whose live bytes `code` start at `start`) from its start up to `addr`
/// and returns the instruction at `addr`, refusing when `addr` is not an instruction
/// boundary of that linear decoding.
///
/// # Errors
/// [`Refusal::Outside`], [`Refusal::NotBoundary`], [`Refusal::Undecodable`].
pub fn instruction_at(
    function: &str,
    start: u64,
    code: &[u8],
    addr: u64,
) -> Result<Instruction, Refusal> {
    let end = start.wrapping_add(code.len() as u64);
    if addr < start || addr >= end {
        return Err(Refusal::Outside {
            addr,
            function: function.to_owned(),
            start,
            end,
        });
    }
    let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
    let mut instr = Instruction::default();
    while decoder.can_decode() {
        decoder.decode_out(&mut instr);
        if instr.is_invalid() {
            return Err(Refusal::Undecodable {
                addr,
                function: function.to_owned(),
                at: instr.ip(),
            });
        }
        if instr.ip() == addr {
            return Ok(instr);
        }
        if instr.next_ip() > addr {
            return Err(Refusal::NotBoundary {
                addr,
                function: function.to_owned(),
                insn: instr.ip(),
                len: instr.len(),
            });
        }
    }
    // The last instruction ran past the end of the bytes.
    Err(Refusal::Undecodable {
        addr,
        function: function.to_owned(),
        at: instr.ip(),
    })
}

/// Decides how a hit at `instr` (decoded at its real address) gets past it, making the
/// out-of-line copy for slot address `slot` when it is not emulated. `bytes` start with the
/// instruction.
///
/// # Errors
/// [`Refusal::Unsupported`] and [`Refusal::Relocation`].
pub fn plan(instr: &Instruction, bytes: &[u8], slot: u64) -> Result<TrapAction, Refusal> {
    let addr = instr.ip();
    let unsupported = |why| Refusal::Unsupported {
        addr,
        text: instr.to_string(),
        why,
    };
    let next = instr.next_ip();
    match instr.mnemonic() {
        Mnemonic::Int3 => {
            return Err(unsupported(
                "is an int3 already there (a guest kprobe or another debugger's breakpoint): \
                 a copy would copy the trap",
            ))
        }
        Mnemonic::Ud0
        | Mnemonic::Ud1
        | Mnemonic::Ud2
        | Mnemonic::Int
        | Mnemonic::Int1
        | Mnemonic::Into => {
            return Err(unsupported(
                "traps on purpose and the kernel looks its bug or exception-table entry up by \
                 address, which a copy elsewhere would not have",
            ))
        }
        Mnemonic::Iret
        | Mnemonic::Iretd
        | Mnemonic::Iretq
        | Mnemonic::Sysret
        | Mnemonic::Sysretq
        | Mnemonic::Sysexit
        | Mnemonic::Sysexitq
        | Mnemonic::Syscall
        | Mnemonic::Sysenter
        | Mnemonic::Retf => {
            return Err(unsupported(
                "changes privilege or code segment; it is neither emulated nor run out of line",
            ))
        }
        _ => {}
    }
    let emulated = match instr.flow_control() {
        FlowControl::UnconditionalBranch if instr.op0_kind() == OpKind::NearBranch64 => {
            Some(Emulation::Jump {
                target: instr.near_branch_target(),
            })
        }
        FlowControl::Call if instr.op0_kind() == OpKind::NearBranch64 => Some(Emulation::Call {
            target: instr.near_branch_target(),
            next,
        }),
        FlowControl::Return => Some(Emulation::Ret {
            pop: if instr.op_count() == 1 {
                instr.immediate16()
            } else {
                0
            },
        }),
        FlowControl::ConditionalBranch => {
            let target = instr.near_branch_target();
            let counter = match instr.code() {
                Code::Loop_rel8_64_RCX => Some(CounterOp::Loop),
                Code::Loope_rel8_64_RCX => Some(CounterOp::Loope),
                Code::Loopne_rel8_64_RCX => Some(CounterOp::Loopne),
                Code::Jrcxz_rel8_64 => Some(CounterOp::Jrcxz),
                _ => None,
            };
            if let Some(op) = counter {
                Some(Emulation::Counter { op, target, next })
            } else if matches!(
                instr.mnemonic(),
                Mnemonic::Loop | Mnemonic::Loope | Mnemonic::Loopne | Mnemonic::Jecxz
            ) {
                return Err(unsupported("counts in ECX (address-size prefix)"));
            } else if instr.condition_code() != ConditionCode::None
                && instr.op0_kind() == OpKind::NearBranch64
            {
                Some(Emulation::CondJump {
                    cond: instr.condition_code(),
                    target,
                    next,
                })
            } else {
                return Err(unsupported(
                    "is a conditional branch this tracer does not know",
                ));
            }
        }
        FlowControl::XbeginXabortXend => {
            return Err(unsupported("starts or ends a transaction"));
        }
        FlowControl::Interrupt | FlowControl::Exception => {
            return Err(unsupported("raises an exception or interrupt"));
        }
        _ => None,
    };
    if let Some(e) = emulated {
        return Ok(TrapAction::Emulate(e));
    }
    let len = instr.len().min(bytes.len());
    let copy = out_of_line(&bytes[..len], addr, slot).map_err(|e| Refusal::Relocation {
        addr,
        text: instr.to_string(),
        why: e.to_string(),
    })?;
    Ok(TrapAction::OutOfLine {
        code: copy.code,
        rip_relative: instr.is_ip_rel_memory_operand(),
    })
}

/// Decodes the one instruction at `addr` from `bytes` (which start there).
///
/// # Errors
/// [`Refusal::Undecodable`] when they do not start with a valid instruction.
pub fn decode_at(function: &str, bytes: &[u8], addr: u64) -> Result<Instruction, Refusal> {
    let mut decoder = Decoder::with_ip(64, bytes, addr, DecoderOptions::NONE);
    let instr = decoder.decode();
    if instr.is_invalid() {
        return Err(Refusal::Undecodable {
            addr,
            function: function.to_owned(),
            at: addr,
        });
    }
    Ok(instr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::code_asm::*;

    const FUNC: u64 = 0xffff_ffff_8134_9950;
    const SLOT: u64 = 0xffff_ffff_8400_0000 + 0x10000;

    fn assemble(f: impl FnOnce(&mut CodeAssembler)) -> Vec<u8> {
        let mut a = CodeAssembler::new(64).unwrap();
        f(&mut a);
        a.assemble(FUNC).unwrap()
    }

    /// nop5; mov rax, [rip+0x1000]; je +; call; ret
    fn function() -> Vec<u8> {
        assemble(|a| {
            let mut done = a.create_label();
            a.db(&[0x0f, 0x1f, 0x44, 0x00, 0x00]).unwrap(); // +0x0
                                                            // +0x5: mov rax, [rip+0x1000] (rip-relative, 7 bytes)
            a.db(&[0x48, 0x8b, 0x05, 0x00, 0x10, 0x00, 0x00]).unwrap();
            a.test(eax, eax).unwrap(); // +0xc
            a.je(done).unwrap(); // +0xe (short)
            a.call(0xffff_ffff_8100_2000u64).unwrap(); // +0x10
            a.set_label(&mut done).unwrap();
            a.ret().unwrap(); // +0x15
        })
    }

    fn action_at(offset: u64) -> Result<TrapAction, Refusal> {
        let code = function();
        let instr = instruction_at("f", FUNC, &code, FUNC + offset)?;
        plan(&instr, &code[offset as usize..], SLOT)
    }

    #[test]
    fn boundaries_are_found_by_decoding_from_the_start() {
        let code = function();

        assert_eq!(instruction_at("f", FUNC, &code, FUNC + 5).unwrap().len(), 7);
        let err = instruction_at("f", FUNC, &code, FUNC + 7).unwrap_err();
        assert_eq!(
            err,
            Refusal::NotBoundary {
                addr: FUNC + 7,
                function: "f".into(),
                insn: FUNC + 5,
                len: 7
            }
        );
        assert!(
            err.to_string().contains("not an instruction boundary"),
            "{err}"
        );
        assert!(matches!(
            instruction_at("f", FUNC, &code, FUNC + 0x100),
            Err(Refusal::Outside { .. })
        ));
    }

    #[test]
    fn rip_relative_load_runs_out_of_line_with_its_operand_fixed_up() {
        let TrapAction::OutOfLine { code, rip_relative } = action_at(5).unwrap() else {
            panic!("not out of line");
        };

        assert!(rip_relative);
        let mut d = Decoder::with_ip(64, &code, SLOT, DecoderOptions::NONE);
        let mov = d.decode();
        assert_eq!(mov.mnemonic(), Mnemonic::Mov);
        assert!(mov.is_ip_rel_memory_operand());
        assert_eq!(mov.ip_rel_memory_address(), FUNC + 0xc + 0x1000);
        let back = d.decode();
        assert_eq!(back.mnemonic(), Mnemonic::Jmp);
        assert_eq!(back.near_branch_target(), FUNC + 0xc);
    }

    #[test]
    fn branches_calls_and_returns_are_emulated() {
        assert_eq!(
            action_at(0xe).unwrap(),
            TrapAction::Emulate(Emulation::CondJump {
                cond: ConditionCode::e,
                target: FUNC + 0x15,
                next: FUNC + 0x10
            })
        );
        assert_eq!(
            action_at(0x10).unwrap(),
            TrapAction::Emulate(Emulation::Call {
                target: 0xffff_ffff_8100_2000,
                next: FUNC + 0x15
            })
        );
        assert_eq!(
            action_at(0x15).unwrap(),
            TrapAction::Emulate(Emulation::Ret { pop: 0 })
        );
    }

    #[test]
    fn jcc_follows_the_flags() {
        let je = Emulation::CondJump {
            cond: ConditionCode::e,
            target: 1,
            next: 2,
        };
        assert_eq!(je.effect(ZF, 0, 0, 0).rip, 1);
        assert_eq!(je.effect(0, 0, 0, 0).rip, 2);
        let jl = Emulation::CondJump {
            cond: ConditionCode::l,
            target: 1,
            next: 2,
        };
        assert_eq!(jl.effect(SF, 0, 0, 0).rip, 1);
        assert_eq!(jl.effect(SF | OF, 0, 0, 0).rip, 2);
        assert!(condition_holds(ConditionCode::be, CF));
        assert!(!condition_holds(ConditionCode::a, ZF));
        assert!(condition_holds(ConditionCode::g, 0));
        assert!(!condition_holds(ConditionCode::g, OF));
    }

    #[test]
    fn call_pushes_the_next_address_and_ret_pops_it() {
        let call = Emulation::Call {
            target: 0x1000,
            next: 0x2005,
        };
        let e = call.effect(0, 0, 0x8000, 0);
        assert_eq!(e.rip, 0x1000);
        assert_eq!(e.rsp, Some(0x7ff8));
        assert_eq!(e.store, Some((0x7ff8, 0x2005)));

        let ret = Emulation::Ret { pop: 16 };
        let e = ret.effect(0, 0, 0x7ff8, 0x2005);
        assert_eq!(e.rip, 0x2005);
        assert_eq!(e.rsp, Some(0x8010));
    }

    #[test]
    fn loop_decrements_rcx_and_jrcxz_tests_it() {
        let code = assemble(|a| {
            let mut top = a.create_label();
            a.set_label(&mut top).unwrap();
            a.loop_(top).unwrap();
            a.jrcxz(top).unwrap();
        });
        let lp = plan(&decode_at("f", &code, FUNC).unwrap(), &code, SLOT).unwrap();
        let TrapAction::Emulate(lp) = lp else {
            panic!("loop not emulated")
        };
        assert_eq!(lp.effect(0, 2, 0, 0).rip, FUNC);
        assert_eq!(lp.effect(0, 2, 0, 0).rcx, Some(1));
        assert_eq!(lp.effect(0, 1, 0, 0).rip, FUNC + 2);
        assert_eq!(lp.effect(0, 1, 0, 0).rcx, Some(0));

        let jr = plan(
            &decode_at("f", &code[2..], FUNC + 2).unwrap(),
            &code[2..],
            SLOT,
        )
        .unwrap();
        let TrapAction::Emulate(jr) = jr else {
            panic!("jrcxz not emulated")
        };
        assert_eq!(jr.effect(0, 0, 0, 0).rip, FUNC);
        assert_eq!(jr.effect(0, 5, 0, 0).rip, FUNC + 4);
        assert_eq!(jr.effect(0, 5, 0, 0).rcx, None);
    }

    #[test]
    fn traps_and_mode_changes_are_refused_with_the_reason() {
        for (bytes, why) in [
            (&[0xcc][..], "int3 already there"),
            (&[0x0f, 0x0b][..], "traps on purpose"),
            (&[0x48, 0xcf][..], "changes privilege"),
            (&[0x0f, 0x05][..], "changes privilege"),
        ] {
            let instr = decode_at("f", bytes, FUNC).unwrap();
            let err = plan(&instr, bytes, SLOT).unwrap_err();
            assert!(err.to_string().contains(why), "{bytes:02x?}: {err}");
        }
    }

    #[test]
    fn indirect_call_runs_out_of_line_keeping_the_return_address() {
        let bytes = [0xff, 0xd0]; // call rax
        let instr = decode_at("f", &bytes, FUNC).unwrap();

        let TrapAction::OutOfLine { code, rip_relative } = plan(&instr, &bytes, SLOT).unwrap()
        else {
            panic!("not out of line");
        };

        assert!(!rip_relative);
        let mut d = Decoder::with_ip(64, &code, SLOT, DecoderOptions::NONE);
        let push = d.decode();
        assert_eq!(push.mnemonic(), Mnemonic::Push);
        assert_eq!(push.immediate32to64() as u64, FUNC + 2);
        assert_eq!(d.decode().mnemonic(), Mnemonic::Jmp);
    }
}
