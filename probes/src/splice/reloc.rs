//! Relocating one instruction to another address with iced's `BlockEncoder`, and checking
//! the result by decoding it again.
//!
//! iced keeps RIP-relative memory operands and near-branch targets as absolute addresses,
//! so re-encoding at the new address rewrites the displacements. A direct `call` can be
//! relocated so that the callee still sees the original return address (ftrace computes
//! the traced function from it; unwinders look it up), see [`CallReturn`].

use iced_x86::{
    BlockEncoder, BlockEncoderOptions, Code, Decoder, DecoderOptions, FlowControl, IcedError,
    Instruction, InstructionBlock, MemoryOperand, Mnemonic, Register, RelocInfo,
};

/// Test-only fault injection into the relocator, to prove that the splicing-safety
/// regression (`exotap regress`) detects a broken relocation. Only built with the
/// `fault-injection` feature, which only the regression's own tests enable.
#[cfg(feature = "fault-injection")]
pub mod fault {
    use std::sync::atomic::{AtomicBool, Ordering};

    use iced_x86::{Decoder, DecoderOptions};

    static REL32_OFF_BY_ONE: AtomicBool = AtomicBool::new(false);

    /// Makes every later relocation put its first rel32 branch displacement or
    /// RIP-relative disp32 one byte off (process-wide), or stops doing so.
    pub fn set_rel32_off_by_one(on: bool) {
        REL32_OFF_BY_ONE.store(on, Ordering::SeqCst);
    }

    /// Applies the injected fault to `len` bytes of relocated code at `code[start..]`,
    /// which sit at `ip`.
    pub(crate) fn apply(code: &mut [u8], start: usize, len: usize, ip: u64) {
        if !REL32_OFF_BY_ONE.load(Ordering::SeqCst) {
            return;
        }
        let Some(bytes) = code.get(start..start + len) else {
            return;
        };
        let mut decoder = Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE);
        let mut pos = start;
        while decoder.can_decode() {
            let instr = decoder.decode();
            let offsets = decoder.get_constant_offsets(&instr);
            let field = if instr.is_ip_rel_memory_operand() && offsets.displacement_size() == 4 {
                Some(offsets.displacement_offset())
            } else if offsets.has_immediate()
                && offsets.immediate_size() == 4
                && (instr.is_jmp_near() || instr.is_jcc_near() || instr.is_call_near())
            {
                Some(offsets.immediate_offset())
            } else {
                None
            };
            if let Some(off) = field {
                let at = pos + off;
                if let Some(slot) = code.get_mut(at..at + 4) {
                    let v = i32::from_le_bytes([slot[0], slot[1], slot[2], slot[3]]);
                    slot.copy_from_slice(&v.wrapping_add(1).to_le_bytes());
                }
                return;
            }
            pos += instr.len();
        }
    }
}

/// Errors of relocation.
#[derive(Debug, thiserror::Error)]
pub enum RelocError {
    /// The original bytes are not a valid instruction.
    #[error("the bytes at {ip:#x} are not a valid instruction")]
    Undecodable {
        /// The original address.
        ip: u64,
    },
    /// The encoder could not place the instruction at the new address (e.g. a RIP-relative
    /// operand more than 2 GiB away).
    #[error("the instruction from {ip:#x} cannot be encoded at {new_ip:#x}")]
    Encode {
        /// The original address.
        ip: u64,
        /// The new address.
        new_ip: u64,
        /// iced's reason.
        #[source]
        source: IcedError,
    },
    /// The re-encoded instruction does not do the same thing as the original.
    #[error("the instruction from {ip:#x} re-encoded at {new_ip:#x} {what}")]
    Changed {
        /// The original address.
        ip: u64,
        /// The new address.
        new_ip: u64,
        /// What differs.
        what: &'static str,
    },
}

/// Where a relocated `call` makes its callee return.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CallReturn {
    /// `push <original next>; jmp <callee>`: the callee sees the original return
    /// address and returns straight to the instruction after the splice, as if the call
    /// had run in place. Indirect calls whose operand uses `rsp` fall back to
    /// [`CallReturn::Patch`] (the push would move their operand).
    #[default]
    Original,
    /// A plain `call` from the patch: the callee returns into the patch.
    Patch,
}

/// What relocation turned the instruction into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RelocShape {
    /// One instruction with the same meaning (displacements adjusted, a short branch may
    /// have become a near one).
    Same,
    /// A `call` as `push <return address>` (plus `mov dword [rsp+4], hi` when it does not
    /// fit a sign-extended 32-bit immediate) and a `jmp` to the callee.
    CallAsPushJmp {
        /// The return address pushed.
        return_to: u64,
    },
}

/// An instruction re-encoded at a new address.
#[derive(Clone, Debug)]
pub struct Relocated {
    /// The original instruction, decoded at its original address.
    pub original: Instruction,
    /// The new address.
    pub new_ip: u64,
    /// The new bytes.
    pub bytes: Vec<u8>,
    /// What it became.
    pub shape: RelocShape,
    /// Absolute addresses the encoder embedded (none expected for a verified relocation).
    pub reloc_infos: Vec<RelocInfo>,
}

/// Decodes the one instruction at the start of `bytes`, which sit at `ip`.
///
/// # Errors
/// [`RelocError::Undecodable`] if they do not start with a valid instruction.
pub fn decode_one(bytes: &[u8], ip: u64) -> Result<Instruction, RelocError> {
    let mut decoder = Decoder::with_ip(64, bytes, ip, DecoderOptions::NONE);
    let instr = decoder.decode();
    if instr.is_invalid() {
        return Err(RelocError::Undecodable { ip });
    }
    Ok(instr)
}

/// The instructions that do the work of `orig` elsewhere, before encoding, and their
/// shape.
///
/// # Errors
/// [`RelocError::Encode`] if a replacement instruction cannot be built (not expected).
pub fn relocation_sequence(
    orig: &Instruction,
    call_return: CallReturn,
) -> Result<(Vec<Instruction>, RelocShape), RelocError> {
    let return_to = orig.next_ip();
    let jmp = match (call_return, orig.flow_control()) {
        (CallReturn::Original, FlowControl::Call) if orig.code() == Code::Call_rel32_64 => Some(
            Instruction::with_branch(Code::Jmp_rel32_64, orig.near_branch_target())
                .map_err(|source| encode_error(orig, orig.ip(), source))?,
        ),
        (CallReturn::Original, FlowControl::IndirectCall)
            if orig.code() == Code::Call_rm64 && !uses_rsp(orig) =>
        {
            // Same operand layout: only the opcode changes.
            let mut jmp = *orig;
            jmp.set_code(Code::Jmp_rm64);
            Some(jmp)
        }
        _ => None,
    };
    let Some(jmp) = jmp else {
        return Ok((vec![*orig], RelocShape::Same));
    };
    let mut seq = push_u64(return_to).map_err(|source| encode_error(orig, orig.ip(), source))?;
    seq.push(jmp);
    Ok((seq, RelocShape::CallAsPushJmp { return_to }))
}

/// `push imm32` (sign-extended) and, when that is not the value, a fix of the high half.
/// Neither touches the flags.
fn push_u64(value: u64) -> Result<Vec<Instruction>, IcedError> {
    let low = value as u32 as i32;
    let mut seq = vec![Instruction::with1(Code::Pushq_imm32, low)?];
    if i64::from(low) as u64 != value {
        let high = (value >> 32) as u32;
        seq.push(Instruction::with2(
            Code::Mov_rm32_imm32,
            MemoryOperand::with_base_displ(Register::RSP, 4),
            high,
        )?);
    }
    Ok(seq)
}

fn uses_rsp(instr: &Instruction) -> bool {
    instr.memory_base() == Register::RSP
        || instr.memory_index() == Register::RSP
        || instr.op0_register() == Register::RSP
}

fn encode_error(orig: &Instruction, new_ip: u64, source: IcedError) -> RelocError {
    RelocError::Encode {
        ip: orig.ip(),
        new_ip,
        source,
    }
}

/// Re-encodes the instruction at the start of `bytes` (address `ip`) at `new_ip`, then
/// decodes the result and checks it means the same.
///
/// # Errors
/// [`RelocError::Undecodable`], [`RelocError::Encode`] (target out of reach),
/// [`RelocError::Changed`] (the encoder had to expand it or the check failed).
pub fn relocate(
    bytes: &[u8],
    ip: u64,
    new_ip: u64,
    call_return: CallReturn,
) -> Result<Relocated, RelocError> {
    let original = decode_one(bytes, ip)?;
    let (seq, shape) = relocation_sequence(&original, call_return)?;
    let options = BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS
        | BlockEncoderOptions::RETURN_RELOC_INFOS;
    let result = BlockEncoder::encode(64, InstructionBlock::new(&seq, new_ip), options)
        .map_err(|source| encode_error(&original, new_ip, source))?;
    verify(&original, shape, &result.code_buffer, new_ip)?;
    Ok(Relocated {
        original,
        new_ip,
        bytes: result.code_buffer,
        shape,
        reloc_infos: result.reloc_infos,
    })
}

/// Checks that `code`, at `new_ip`, starts with a relocation of `orig` of the given shape,
/// and returns how many bytes that relocation takes.
///
/// # Errors
/// [`RelocError::Changed`] naming the first difference.
pub fn verify(
    orig: &Instruction,
    shape: RelocShape,
    code: &[u8],
    new_ip: u64,
) -> Result<usize, RelocError> {
    let changed = |what| RelocError::Changed {
        ip: orig.ip(),
        new_ip,
        what,
    };
    let mut decoder = Decoder::with_ip(64, code, new_ip, DecoderOptions::NONE);
    let first = decoder.decode();
    match shape {
        RelocShape::Same => {
            if !same_meaning(orig, &first) {
                return Err(changed("differs in opcode, operands or target"));
            }
        }
        RelocShape::CallAsPushJmp { return_to } => {
            if first.code() != Code::Pushq_imm32 {
                return Err(changed("does not start by pushing the return address"));
            }
            let mut pushed = first.immediate32to64() as u64;
            let mut next = decoder.decode();
            if next.code() == Code::Mov_rm32_imm32 && next.memory_base() == Register::RSP {
                if next.memory_displacement64() != 4 {
                    return Err(changed("patches the wrong half of the return address"));
                }
                pushed = (pushed & 0xffff_ffff) | (u64::from(next.immediate32()) << 32);
                next = decoder.decode();
            }
            if pushed != return_to || return_to != orig.next_ip() {
                return Err(changed("pushes a different return address"));
            }
            let same_target = match orig.flow_control() {
                FlowControl::Call => {
                    next.mnemonic() == Mnemonic::Jmp
                        && next.flow_control() == FlowControl::UnconditionalBranch
                        && next.near_branch_target() == orig.near_branch_target()
                }
                _ => {
                    let mut expected = *orig;
                    expected.set_code(Code::Jmp_rm64);
                    same_meaning(&expected, &next)
                }
            };
            if !same_target {
                return Err(changed("jumps somewhere other than the callee"));
            }
            return Ok(next.next_ip().wrapping_sub(new_ip) as usize);
        }
    }
    Ok(first.len())
}

/// Whether two decoded instructions do the same thing, wherever they sit: same
/// mnemonic, same branch target, and for non-branches the same opcode and operands
/// (iced holds RIP-relative operands as absolute addresses, so equality covers them).
fn same_meaning(a: &Instruction, b: &Instruction) -> bool {
    if b.is_invalid() || a.mnemonic() != b.mnemonic() || a.flow_control() != b.flow_control() {
        return false;
    }
    match a.flow_control() {
        FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch | FlowControl::Call => {
            a.op0_kind() == b.op0_kind()
                && a.near_branch_target() == b.near_branch_target()
                && a.condition_code() == b.condition_code()
        }
        FlowControl::XbeginXabortXend if a.mnemonic() == Mnemonic::Xbegin => {
            a.near_branch_target() == b.near_branch_target()
        }
        _ => {
            a == b
                && (!a.is_ip_rel_memory_operand()
                    || a.ip_rel_memory_address() == b.ip_rel_memory_address())
        }
    }
}

#[cfg(test)]
mod tests {
    use iced_x86::code_asm::*;

    use super::*;

    const ORIG: u64 = 0xffff_ffff_8100_1000;
    const PATCH: u64 = 0xffff_ffff_a000_0000;
    const DATA: u64 = 0xffff_ffff_8200_0040;
    const CALLEE: u64 = 0xffff_ffff_8100_8000;

    fn bytes_of(f: impl FnOnce(&mut CodeAssembler)) -> Vec<u8> {
        let mut a = CodeAssembler::new(64).unwrap();
        f(&mut a);
        a.assemble(ORIG).unwrap()
    }

    fn decode_at(bytes: &[u8], ip: u64) -> Instruction {
        decode_one(bytes, ip).unwrap()
    }

    #[test]
    fn rip_relative_load_keeps_its_absolute_address() {
        let bytes = bytes_of(|a| {
            let i = Instruction::with2(
                Code::Mov_r64_rm64,
                Register::RAX,
                MemoryOperand::with_base_displ(Register::RIP, DATA as i64),
            )
            .unwrap();
            a.add_instruction(i).unwrap();
        });

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Original).unwrap();

        let moved = decode_at(&relocated.bytes, PATCH);
        assert_eq!(moved.ip_rel_memory_address(), DATA);
        assert_eq!(decode_at(&bytes, ORIG).ip_rel_memory_address(), DATA);
        assert_ne!(relocated.bytes, bytes);
        assert_eq!(relocated.shape, RelocShape::Same);
    }

    #[test]
    fn call_with_original_return_pushes_next_and_jumps_to_callee() {
        let bytes = bytes_of(|a| a.call(CALLEE).unwrap());

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Original).unwrap();

        let mut decoder = Decoder::with_ip(64, &relocated.bytes, PATCH, DecoderOptions::NONE);
        let push = decoder.decode();
        let jmp = decoder.decode();
        assert_eq!(push.immediate32to64() as u64, ORIG + 5);
        assert_eq!(jmp.near_branch_target(), CALLEE);
        assert_eq!(
            relocated.shape,
            RelocShape::CallAsPushJmp {
                return_to: ORIG + 5
            }
        );
    }

    #[test]
    fn call_with_low_return_address_fixes_the_high_half() {
        let orig = 0x0000_7fff_0000_1000u64;
        let mut a = CodeAssembler::new(64).unwrap();
        a.call(orig + 0x100).unwrap();
        let bytes = a.assemble(orig).unwrap();

        let relocated = relocate(&bytes, orig, orig + 0x1000_0000, CallReturn::Original).unwrap();

        assert_eq!(
            relocated.shape,
            RelocShape::CallAsPushJmp {
                return_to: orig + 5
            }
        );
        assert_eq!(relocated.bytes.len(), 5 + 8 + 5);
    }

    #[test]
    fn call_returning_into_patch_stays_a_call_to_the_same_callee() {
        let bytes = bytes_of(|a| a.call(CALLEE).unwrap());

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Patch).unwrap();

        let moved = decode_at(&relocated.bytes, PATCH);
        assert_eq!(moved.mnemonic(), Mnemonic::Call);
        assert_eq!(moved.near_branch_target(), CALLEE);
    }

    #[test]
    fn indirect_call_through_rip_relative_pointer_becomes_jmp_through_it() {
        let bytes = bytes_of(|a| {
            let i = Instruction::with1(
                Code::Call_rm64,
                MemoryOperand::with_base_displ(Register::RIP, DATA as i64),
            )
            .unwrap();
            a.add_instruction(i).unwrap();
        });

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Original).unwrap();

        let mut decoder = Decoder::with_ip(64, &relocated.bytes, PATCH, DecoderOptions::NONE);
        let _push = decoder.decode();
        let jmp = decoder.decode();
        assert_eq!(jmp.code(), Code::Jmp_rm64);
        assert_eq!(jmp.ip_rel_memory_address(), DATA);
    }

    #[test]
    fn indirect_call_through_stack_slot_stays_a_call() {
        let bytes = bytes_of(|a| a.call(qword_ptr(rsp + 8)).unwrap());

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Original).unwrap();

        assert_eq!(relocated.shape, RelocShape::Same);
        assert_eq!(
            decode_at(&relocated.bytes, PATCH).mnemonic(),
            Mnemonic::Call
        );
    }

    #[test]
    fn short_jcc_becomes_near_jcc_to_the_same_target() {
        let bytes = bytes_of(|a| a.jne(ORIG + 0x20).unwrap());

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Original).unwrap();

        let moved = decode_at(&relocated.bytes, PATCH);
        assert_eq!(bytes.len(), 2);
        assert_eq!(moved.code(), Code::Jne_rel32_64);
        assert_eq!(moved.near_branch_target(), ORIG + 0x20);
    }

    #[test]
    fn jmp_keeps_its_target() {
        let bytes = bytes_of(|a| a.jmp(CALLEE).unwrap());

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Original).unwrap();

        assert_eq!(
            decode_at(&relocated.bytes, PATCH).near_branch_target(),
            CALLEE
        );
    }

    #[test]
    fn plain_instruction_is_copied_byte_for_byte() {
        let bytes = bytes_of(|a| a.mov(qword_ptr(rdi + 0x18), rsi).unwrap());

        let relocated = relocate(&bytes, ORIG, PATCH, CallReturn::Original).unwrap();

        assert_eq!(relocated.bytes, bytes);
    }

    #[test]
    fn rip_relative_operand_out_of_reach_fails_to_encode() {
        let bytes = bytes_of(|a| {
            let i = Instruction::with2(
                Code::Mov_r64_rm64,
                Register::RAX,
                MemoryOperand::with_base_displ(Register::RIP, DATA as i64),
            )
            .unwrap();
            a.add_instruction(i).unwrap();
        });

        let result = relocate(&bytes, ORIG, 0x4000_0000_0000, CallReturn::Original);

        assert!(matches!(result, Err(RelocError::Encode { .. })));
    }

    #[test]
    fn jcc_out_of_reach_is_reported_not_silently_expanded() {
        let bytes = bytes_of(|a| a.jne(ORIG + 0x20).unwrap());

        let result = relocate(&bytes, ORIG, 0x4000_0000_0000, CallReturn::Original);

        assert!(matches!(result, Err(RelocError::Changed { .. })));
    }

    #[test]
    fn garbage_bytes_are_undecodable() {
        let result = relocate(&[0xff, 0xff], ORIG, PATCH, CallReturn::Original);

        assert!(matches!(result, Err(RelocError::Undecodable { ip: ORIG })));
    }

    #[test]
    fn verify_rejects_a_different_target() {
        let orig = decode_at(&bytes_of(|a| a.jmp(CALLEE).unwrap()), ORIG);
        let mut a = CodeAssembler::new(64).unwrap();
        a.jmp(CALLEE + 1).unwrap();
        let wrong = a.assemble(PATCH).unwrap();

        let result = verify(&orig, RelocShape::Same, &wrong, PATCH);

        assert!(matches!(result, Err(RelocError::Changed { .. })));
    }
}
