//! Linear-sweep decoding of one function into compact instruction summaries.
//!
//! Each instruction is reduced to what structural analysis needs: its address and length,
//! how control leaves it, and which registers and status flags it reads and surely
//! overwrites. Calls, returns and jumps out of the function get the register effects of
//! the calling convention (SysV, overridable per call target), so liveness needs no
//! knowledge of other functions.

use std::collections::HashMap;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory,
    InstructionInfoOptions, Mnemonic, OpAccess, OpKind, Register,
};

use super::regs::{gpr_index, LiveState, RegSet, StatusFlags};

/// The register an indirect-branch thunk jumps through, from the thunk's name
/// (`__x86_indirect_thunk_rax`, `__x86_indirect_call_thunk_r11`), as retpoline builds emit them.
pub fn thunk_register(name: &str) -> Option<Register> {
    let suffix = name
        .strip_prefix("__x86_indirect_thunk_")
        .or_else(|| name.strip_prefix("__x86_indirect_call_thunk_"))?;
    let reg = match suffix {
        "rax" => Register::RAX,
        "rbx" => Register::RBX,
        "rcx" => Register::RCX,
        "rdx" => Register::RDX,
        "rsi" => Register::RSI,
        "rdi" => Register::RDI,
        "rbp" => Register::RBP,
        "r8" => Register::R8,
        "r9" => Register::R9,
        "r10" => Register::R10,
        "r11" => Register::R11,
        "r12" => Register::R12,
        "r13" => Register::R13,
        "r14" => Register::R14,
        "r15" => Register::R15,
        _ => return None,
    };
    Some(reg)
}

/// How control leaves an instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Flow {
    /// Falls through to the next instruction (also traps that resume, like `ud2`, `int3`).
    Next,
    /// Direct call; falls through after the callee returns.
    Call {
        /// The callee's address.
        target: u64,
    },
    /// Indirect call; falls through after the callee returns.
    IndirectCall,
    /// Direct unconditional jump inside the function.
    Jump {
        /// The jump's target.
        target: u64,
    },
    /// Direct conditional jump (or `xbegin`) inside the function; also falls through.
    CondJump {
        /// The taken target.
        target: u64,
    },
    /// Direct unconditional jump out of the function: a tail call.
    TailJump {
        /// The jump's target.
        target: u64,
    },
    /// Direct conditional jump out of the function: a conditional tail call.
    CondTailJump {
        /// The taken target.
        target: u64,
    },
    /// Indirect jump (`jmp rax`, `jmp [mem]`): targets unknown.
    IndirectJump,
    /// Function return: `ret`, `iret`, `sysret` or a `jmp` to a return thunk.
    Return,
    /// Bytes that do not decode.
    Invalid,
}

impl Flow {
    /// Whether execution can continue at the next instruction.
    #[must_use]
    pub const fn falls_through(self) -> bool {
        matches!(
            self,
            Self::Next
                | Self::Call { .. }
                | Self::IndirectCall
                | Self::CondJump { .. }
                | Self::CondTailJump { .. }
        )
    }

    /// The direct target of a branch or call, if any.
    #[must_use]
    pub const fn target(self) -> Option<u64> {
        match self {
            Self::Call { target }
            | Self::Jump { target }
            | Self::CondJump { target }
            | Self::TailJump { target }
            | Self::CondTailJump { target } => Some(target),
            _ => None,
        }
    }
}

/// A decoded instruction reduced to its structural effects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Insn {
    /// Address of the first byte.
    pub addr: u64,
    /// Length in bytes (1..=15).
    pub len: u8,
    /// How control leaves it.
    pub flow: Flow,
    /// Registers and flags it may read, including what a call, return or tail call
    /// makes live by convention.
    pub uses: LiveState,
    /// Registers and flags it surely overwrites (partial-register and conditional
    /// writes are not kills), including what a call clobbers.
    pub kills: LiveState,
}

impl Insn {
    /// The address just past the instruction.
    #[must_use]
    pub const fn end(&self) -> u64 {
        self.addr.wrapping_add(self.len as u64)
    }
}

/// The register effects of calling a function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallEffect {
    /// Registers the callee may read.
    pub reads: RegSet,
    /// Registers the callee may overwrite.
    pub clobbers: RegSet,
    /// Whether the callee may overwrite the status flags.
    pub clobbers_flags: bool,
}

impl CallEffect {
    /// A SysV function: reads the six argument registers, clobbers the caller-saved
    /// registers and the flags.
    pub const SYSV: Self = Self {
        reads: RegSet::SYSV_ARGS,
        clobbers: RegSet::SYSV_CALLER_SAVED,
        clobbers_flags: true,
    };

    /// A call that leaves every register and flag as it was and reads none: the model
    /// for `call __fentry__`, which the booted kernel has turned into a 5-byte nop (and
    /// whose tracers preserve all registers when ftrace turns it back on), so liveness
    /// at the entry site is that of the function body.
    pub const TRANSPARENT: Self = Self {
        reads: RegSet::EMPTY,
        clobbers: RegSet::EMPTY,
        clobbers_flags: false,
    };

    /// The SysV effect plus reading `reg` (e.g. `__x86_indirect_thunk_rax` reads rax).
    #[must_use]
    pub const fn sysv_reading(reg: Register) -> Self {
        Self {
            reads: RegSet::SYSV_ARGS.with(reg),
            ..Self::SYSV
        }
    }
}

/// What the analysis needs to know about the kernel beyond the bytes.
#[derive(Clone, Debug, Default)]
pub struct AnalysisConfig {
    return_thunks: Vec<u64>,
    call_effects: HashMap<u64, CallEffect>,
}

impl AnalysisConfig {
    /// A configuration with no return thunks and SysV effects for every call.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Treat a `jmp` to `addr` (e.g. `__x86_return_thunk`) as a function return.
    #[must_use]
    pub fn with_return_thunk(mut self, addr: u64) -> Self {
        if let Err(pos) = self.return_thunks.binary_search(&addr) {
            self.return_thunks.insert(pos, addr);
        }
        self
    }

    /// Use `effect` instead of the SysV one for calls and tail calls to `addr`.
    #[must_use]
    pub fn with_call_effect(mut self, addr: u64, effect: CallEffect) -> Self {
        self.call_effects.insert(addr, effect);
        self
    }

    /// The addresses a `jmp` to is a return, sorted.
    #[must_use]
    pub fn return_thunks(&self) -> &[u64] {
        &self.return_thunks
    }

    /// Whether a `jmp` to `addr` is a return.
    #[must_use]
    pub fn is_return_thunk(&self, addr: u64) -> bool {
        self.return_thunks.binary_search(&addr).is_ok()
    }

    /// The effect of calling `addr`.
    #[must_use]
    pub fn call_effect(&self, addr: u64) -> CallEffect {
        self.call_effects
            .get(&addr)
            .copied()
            .unwrap_or(CallEffect::SYSV)
    }
}

/// What a SysV function's caller still needs after it returns: return values,
/// callee-saved registers, the stack pointer. Flags are dead.
const RETURN_LIVE: LiveState = LiveState {
    regs: RegSet::SYSV_RETURN
        .union(RegSet::SYSV_CALLEE_SAVED)
        .union(RegSet::RSP),
    flags: StatusFlags::EMPTY,
};

/// A reusable decoder of functions: holds iced's info factory so decoding many functions
/// allocates nothing per instruction.
#[derive(Debug)]
pub struct FunctionDecoder<'c> {
    config: &'c AnalysisConfig,
    info: InstructionInfoFactory,
}

impl<'c> FunctionDecoder<'c> {
    /// A decoder that uses `config` for calls and return thunks.
    #[must_use]
    pub fn new(config: &'c AnalysisConfig) -> Self {
        Self {
            config,
            info: InstructionInfoFactory::new(),
        }
    }

    /// Decodes `code`, the bytes of the function at `start`, into `out` (cleared first).
    /// Undecodable bytes become [`Flow::Invalid`] instructions and decoding goes on after
    /// them, so hostile bytes never fail or panic.
    pub fn decode_into(&mut self, code: &[u8], start: u64, out: &mut Vec<Insn>) {
        out.clear();
        let end = start.wrapping_add(code.len() as u64);
        let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
        let mut instr = Instruction::default();
        while decoder.can_decode() {
            decoder.decode_out(&mut instr);
            out.push(self.summarize(&instr, start, end));
        }
    }

    /// Appends to `out` the targets of `code`'s direct branches and calls, the bytes of the
    /// function at `start`: what [`Flow::target`] gives for each of [`FunctionDecoder::decode`]'s
    /// instructions, without their register effects and without keeping them (the whole
    /// kernel's branch targets, padding of a megabyte of `int3` included, in constant memory).
    pub fn branch_targets_into(&self, code: &[u8], start: u64, out: &mut Vec<u64>) {
        let mut decoder = Decoder::with_ip(64, code, start, DecoderOptions::NONE);
        let mut instr = Instruction::default();
        while decoder.can_decode() {
            decoder.decode_out(&mut instr);
            if instr.is_invalid() {
                continue;
            }
            let target = match instr.flow_control() {
                FlowControl::ConditionalBranch | FlowControl::Call => {
                    Some(instr.near_branch_target())
                }
                FlowControl::XbeginXabortXend if instr.mnemonic() == Mnemonic::Xbegin => {
                    Some(instr.near_branch_target())
                }
                FlowControl::UnconditionalBranch => {
                    let far = matches!(instr.op0_kind(), OpKind::FarBranch16 | OpKind::FarBranch32);
                    let target = instr.near_branch_target();
                    (!far && !self.config.is_return_thunk(target)).then_some(target)
                }
                _ => None,
            };
            out.extend(target);
        }
    }

    /// Decodes `code`, the bytes of the function at `start`.
    #[must_use]
    pub fn decode(&mut self, code: &[u8], start: u64) -> Vec<Insn> {
        let mut out = Vec::with_capacity(code.len() / 4 + 1);
        self.decode_into(code, start, &mut out);
        out
    }

    fn summarize(&mut self, instr: &Instruction, start: u64, end: u64) -> Insn {
        let addr = instr.ip();
        // iced lengths are 1..=15, so this never truncates.
        let len = instr.len() as u8;
        if instr.is_invalid() {
            return Insn {
                addr,
                len,
                flow: Flow::Invalid,
                uses: LiveState::ALL,
                kills: LiveState::NONE,
            };
        }
        let (mut uses, mut kills) = self.register_effects(instr);
        uses.flags = StatusFlags::from_rflags(instr.rflags_read());
        kills.flags = if flags_write_is_conditional(instr) {
            StatusFlags::EMPTY
        } else {
            StatusFlags::from_rflags(instr.rflags_modified())
        };
        let inside = |t: u64| t >= start && t < end;
        let flow = match instr.flow_control() {
            FlowControl::Next | FlowControl::Interrupt | FlowControl::Exception => Flow::Next,
            FlowControl::XbeginXabortXend => {
                if instr.mnemonic() == Mnemonic::Xbegin {
                    let target = instr.near_branch_target();
                    if inside(target) {
                        Flow::CondJump { target }
                    } else {
                        Flow::CondTailJump { target }
                    }
                } else {
                    Flow::Next
                }
            }
            FlowControl::ConditionalBranch => {
                let target = instr.near_branch_target();
                if inside(target) {
                    Flow::CondJump { target }
                } else {
                    Flow::CondTailJump { target }
                }
            }
            FlowControl::UnconditionalBranch => {
                let target = instr.near_branch_target();
                if instr.op0_kind() == OpKind::FarBranch16
                    || instr.op0_kind() == OpKind::FarBranch32
                {
                    Flow::IndirectJump
                } else if self.config.is_return_thunk(target) {
                    Flow::Return
                } else if inside(target) {
                    Flow::Jump { target }
                } else {
                    Flow::TailJump { target }
                }
            }
            FlowControl::IndirectBranch => Flow::IndirectJump,
            FlowControl::Return => Flow::Return,
            FlowControl::Call => Flow::Call {
                target: instr.near_branch_target(),
            },
            FlowControl::IndirectCall => Flow::IndirectCall,
        };
        match flow {
            Flow::Call { target } => {
                let effect = self.config.call_effect(target);
                apply_call(&mut uses, &mut kills, effect);
            }
            Flow::IndirectCall => apply_call(&mut uses, &mut kills, CallEffect::SYSV),
            Flow::TailJump { target } | Flow::CondTailJump { target } => {
                let effect = self.config.call_effect(target);
                uses = uses.union(RETURN_LIVE.minus(LiveState {
                    regs: RegSet::SYSV_RETURN,
                    flags: StatusFlags::EMPTY,
                }));
                uses.regs = uses.regs.union(effect.reads);
            }
            Flow::Return => uses = uses.union(RETURN_LIVE),
            Flow::IndirectJump => uses = LiveState::ALL,
            Flow::Next | Flow::Jump { .. } | Flow::CondJump { .. } | Flow::Invalid => {}
        }
        Insn {
            addr,
            len,
            flow,
            uses,
            kills,
        }
    }

    fn register_effects(&mut self, instr: &Instruction) -> (LiveState, LiveState) {
        let mut uses = RegSet::EMPTY;
        let mut kills = RegSet::EMPTY;
        let info = self
            .info
            .info_options(instr, InstructionInfoOptions::NO_MEMORY_USAGE);
        for used in info.used_registers() {
            let reg = used.register();
            if gpr_index(reg).is_none() {
                continue;
            }
            // 32- and 64-bit writes replace the whole register; 8- and 16-bit ones keep
            // the rest of it, so they do not kill it.
            let whole = reg.size() >= 4;
            match used.access() {
                OpAccess::Read | OpAccess::CondRead | OpAccess::ReadCondWrite => {
                    uses = uses.with(reg);
                }
                OpAccess::ReadWrite => {
                    uses = uses.with(reg);
                    if whole {
                        kills = kills.with(reg);
                    }
                }
                OpAccess::Write if whole => kills = kills.with(reg),
                _ => {}
            }
        }
        (
            LiveState {
                regs: uses,
                flags: StatusFlags::EMPTY,
            },
            LiveState {
                regs: kills,
                flags: StatusFlags::EMPTY,
            },
        )
    }
}

fn apply_call(uses: &mut LiveState, kills: &mut LiveState, effect: CallEffect) {
    uses.regs = uses.regs.union(effect.reads).union(RegSet::RSP);
    kills.regs = kills.regs.union(effect.clobbers.minus(RegSet::RSP));
    if effect.clobbers_flags {
        kills.flags = StatusFlags::ALL;
    }
}

/// Shifts and rotates by a count of zero (or by `cl`, which may be zero) leave the flags
/// alone, so their flag writes are not kills.
fn flags_write_is_conditional(instr: &Instruction) -> bool {
    let shift = matches!(
        instr.mnemonic(),
        Mnemonic::Shl
            | Mnemonic::Sal
            | Mnemonic::Shr
            | Mnemonic::Sar
            | Mnemonic::Rol
            | Mnemonic::Ror
            | Mnemonic::Rcl
            | Mnemonic::Rcr
            | Mnemonic::Shld
            | Mnemonic::Shrd
    );
    if !shift {
        return false;
    }
    let last = instr.op_count().saturating_sub(1);
    match instr.op_kind(last) {
        OpKind::Immediate8 => instr.immediate8() & 0x1f == 0,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use iced_x86::code_asm::*;

    use super::*;

    const BASE: u64 = 0xffff_ffff_8100_0000;

    fn decode(asm: &mut CodeAssembler) -> Vec<Insn> {
        let bytes = asm.assemble(BASE).unwrap();
        let config = AnalysisConfig::new();
        FunctionDecoder::new(&config).decode(&bytes, BASE)
    }

    #[test]
    fn add_reads_both_operands_and_kills_destination_and_flags() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.add(rax, rbx).unwrap();

        let insns = decode(&mut a);

        assert_eq!(
            insns[0].uses.regs,
            RegSet::of(&[Register::RAX, Register::RBX])
        );
        assert_eq!(insns[0].kills.regs, RegSet::of(&[Register::RAX]));
        assert_eq!(insns[0].kills.flags, StatusFlags::ALL);
    }

    #[test]
    fn byte_write_does_not_kill_full_register() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(al, 1i32).unwrap();

        let insns = decode(&mut a);

        assert!(insns[0].kills.regs.is_empty());
    }

    #[test]
    fn dword_write_kills_full_register() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(eax, 1i32).unwrap();

        let insns = decode(&mut a);

        assert_eq!(insns[0].kills.regs, RegSet::of(&[Register::RAX]));
    }

    #[test]
    fn memory_operand_registers_are_read() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(rcx, qword_ptr(rdi + rsi * 8 + 16)).unwrap();

        let insns = decode(&mut a);

        assert_eq!(
            insns[0].uses.regs,
            RegSet::of(&[Register::RDI, Register::RSI])
        );
    }

    #[test]
    fn shift_by_cl_does_not_kill_flags() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.shl(rax, cl).unwrap();

        let insns = decode(&mut a);

        assert!(insns[0].kills.flags.is_empty());
    }

    #[test]
    fn inc_preserves_carry() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.inc(rax).unwrap();

        let insns = decode(&mut a);

        assert_eq!(
            insns[0].kills.flags,
            StatusFlags::ALL.minus(StatusFlags::CF)
        );
    }

    #[test]
    fn call_reads_arguments_and_clobbers_caller_saved() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.call(0xffff_ffff_8200_0000u64).unwrap();

        let insns = decode(&mut a);

        assert_eq!(insns[0].uses.regs, RegSet::SYSV_ARGS.union(RegSet::RSP));
        assert_eq!(
            insns[0].kills.regs,
            RegSet::SYSV_CALLER_SAVED.union(RegSet::RSP)
        );
        assert_eq!(
            insns[0].flow,
            Flow::Call {
                target: 0xffff_ffff_8200_0000
            }
        );
    }

    #[test]
    fn transparent_call_keeps_everything_but_its_own_stack_use() {
        let fentry = 0xffff_ffff_8200_0000u64;
        let mut a = CodeAssembler::new(64).unwrap();
        a.call(fentry).unwrap();
        let bytes = a.assemble(BASE).unwrap();
        let config = AnalysisConfig::new().with_call_effect(fentry, CallEffect::TRANSPARENT);

        let insns = FunctionDecoder::new(&config).decode(&bytes, BASE);

        assert_eq!(insns[0].kills.regs, RegSet::RSP);
        assert!(insns[0].kills.flags.is_empty());
        assert_eq!(insns[0].uses.regs, RegSet::RSP);
    }

    #[test]
    fn jmp_to_return_thunk_is_a_return() {
        let thunk = 0xffff_ffff_8200_0000u64;
        let mut a = CodeAssembler::new(64).unwrap();
        a.jmp(thunk).unwrap();
        let bytes = a.assemble(BASE).unwrap();
        let config = AnalysisConfig::new().with_return_thunk(thunk);

        let insns = FunctionDecoder::new(&config).decode(&bytes, BASE);

        assert_eq!(insns[0].flow, Flow::Return);
        assert_eq!(insns[0].uses, RETURN_LIVE);
    }

    #[test]
    fn jmp_out_of_function_is_a_tail_call() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.jmp(0xffff_ffff_8200_0000u64).unwrap();

        let insns = decode(&mut a);

        assert_eq!(
            insns[0].flow,
            Flow::TailJump {
                target: 0xffff_ffff_8200_0000
            }
        );
        assert!(insns[0].uses.regs.contains(Register::RDI));
        assert!(!insns[0].uses.regs.contains(Register::RAX));
    }

    #[test]
    fn garbage_bytes_decode_as_invalid_without_panicking() {
        let bytes = [0x0f, 0x0b, 0xff, 0xff, 0x0f];
        let config = AnalysisConfig::new();

        let insns = FunctionDecoder::new(&config).decode(&bytes, BASE);

        assert_eq!(insns[0].flow, Flow::Next);
        assert!(insns.iter().skip(1).all(|i| i.flow == Flow::Invalid));
    }
}
