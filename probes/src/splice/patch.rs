//! Code patches: instrumentation snippet + relocated original instruction + `jmp` back,
//! and the five splice bytes that lead there.
//!
//! The snippet only preserves what liveness says is live: the status flags it writes
//! are saved with `pushfq`/`popfq` only when one of them is live at the splice point, and
//! the registers it uses are pushed and popped only when live. Pushing below `rsp` is
//! safe because the kernel is built without a red zone. Several probes at one point go
//! into one patch and share one save/restore.
//!
//! Timestamp records are 16 bytes: `tsc: u64` at +0, `probe id: u32` at +8, zero at +12.
//! A record's slot is reserved with `lock xadd` on the ring's head counter (which only
//! grows, so the host can count overruns as `head - tail > slots`); the id is stored
//! before the timestamp, so a reader that zeroes consumed slots sees a record as complete
//! once its timestamp is non-zero (x86 stores are not reordered with each other).

use exotap_introspect::x86::{LiveState, RegSet, StatusFlags};
use iced_x86::code_asm::{dword_ptr, edx, qword_ptr, rax, rcx, rdx, CodeAssembler};
use iced_x86::{
    BlockEncoderOptions, Code, Decoder, DecoderOptions, IcedError, Instruction, MemoryOperand,
    Register,
};

use super::plan::{Site, SPLICE_LEN};
use super::reloc::{decode_one, relocation_sequence, verify, CallReturn, RelocError, RelocShape};

/// Size of one timestamp record in a ring.
pub const RECORD_SIZE: u64 = 16;

/// Errors of patch generation.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    /// The instruction is shorter than the `jmp rel32` that would replace it.
    #[error("the instruction at {addr:#x} is {len} bytes, shorter than a splice")]
    ShortInstruction {
        /// Its address.
        addr: u64,
        /// Its length.
        len: usize,
    },
    /// A ring's slot count is not a power of two that fits the index mask.
    #[error("a ring of {0} slots is not a power of two between 1 and 2^31")]
    BadRing(u32),
    /// The original instruction cannot be relocated into the patch.
    #[error("the displaced instruction cannot be relocated into the patch")]
    Relocate(#[from] RelocError),
    /// iced could not assemble the patch (e.g. a counter out of rel32 reach).
    #[error("the patch at {patch:#x} cannot be assembled")]
    Assemble {
        /// The patch address.
        patch: u64,
        /// iced's reason.
        #[source]
        source: IcedError,
    },
    /// The splice `jmp` or the jump back cannot reach with rel32.
    #[error("{from:#x} cannot reach {to:#x} with a rel32 jump")]
    OutOfReach {
        /// Where the jump is.
        from: u64,
        /// Where it should go.
        to: u64,
    },
}

/// A timestamp ring buffer in the patch heap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ring {
    /// Address of the `u64` head counter (total records ever reserved).
    pub head: u64,
    /// Address of the first slot (`slot_count * RECORD_SIZE` bytes).
    pub slots: u64,
    /// Number of slots: a power of two, at most 2^31.
    pub slot_count: u32,
}

/// One instrumentation primitive run at the splice point, before the original
/// instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Probe {
    /// `lock inc qword [counter]`: an atomic 64-bit hit counter. Writes OF SF ZF AF PF
    /// (not CF).
    Count {
        /// Address of the counter.
        counter: u64,
    },
    /// `rdtsc` into a ring record with the probe's id. Uses rax, rdx, rcx and all
    /// status flags.
    Timestamp {
        /// The ring.
        ring: Ring,
        /// Probe id stored in the record.
        id: u32,
    },
}

impl Probe {
    fn clobbers(&self) -> LiveState {
        match self {
            Self::Count { .. } => LiveState {
                regs: RegSet::EMPTY,
                flags: StatusFlags::ALL.minus(StatusFlags::CF),
            },
            Self::Timestamp { .. } => LiveState {
                regs: RegSet::of(&[Register::RAX, Register::RDX, Register::RCX]),
                flags: StatusFlags::ALL,
            },
        }
    }
}

/// What to build.
#[derive(Clone, Copy, Debug)]
pub struct PatchRequest<'a> {
    /// The original instruction's bytes (extra trailing bytes are ignored).
    pub original: &'a [u8],
    /// Its address.
    pub addr: u64,
    /// Where the patch will be.
    pub patch: u64,
    /// The probes, run in order.
    pub probes: &'a [Probe],
    /// What is live before the instruction ([`LiveState::ALL`] when unknown).
    pub live: LiveState,
    /// How a displaced `call` returns.
    pub call_return: CallReturn,
}

impl<'a> PatchRequest<'a> {
    /// The request for a planned splice site.
    #[must_use]
    pub fn for_site(site: &'a Site, patch: u64, probes: &'a [Probe]) -> Self {
        Self {
            original: &site.bytes,
            addr: site.addr,
            patch,
            probes,
            live: site.live,
            call_return: CallReturn::default(),
        }
    }
}

/// What a patch saves and restores around its snippet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Saved {
    /// Whether it wraps the snippet in `pushfq`/`popfq`.
    pub flags: bool,
    /// The registers it pushes and pops.
    pub regs: RegSet,
}

/// A generated patch and the bytes to splice it in and out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Patch {
    /// The spliced instruction's address.
    pub addr: u64,
    /// The patch's address.
    pub patch: u64,
    /// The patch's bytes, to be written at `patch`.
    pub code: Vec<u8>,
    /// `jmp rel32` to the patch, to be written at `addr`. The rest of the original
    /// instruction's bytes stay as they are: no branch lands there (the planner checked),
    /// and any unknown one would behave exactly as before the splice.
    pub splice: [u8; SPLICE_LEN],
    /// The original instruction's bytes, which removal writes back.
    pub original: Vec<u8>,
    /// Address of the relocated original instruction inside the patch.
    pub relocated_at: u64,
    /// Address of the jump back inside the patch.
    pub jump_back_at: u64,
    /// What the relocated instruction became.
    pub shape: RelocShape,
    /// What the snippet saves and restores.
    pub saved: Saved,
}

/// An out-of-line copy for a trap probe: the relocated instruction and a jump back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfLine {
    /// Where it will be.
    pub at: u64,
    /// Its bytes.
    pub code: Vec<u8>,
    /// What the relocated instruction became.
    pub shape: RelocShape,
}

/// Generates a patch and its splice bytes.
///
/// # Errors
/// [`PatchError::ShortInstruction`], [`PatchError::BadRing`], [`PatchError::Relocate`]
/// (undecodable or not relocatable), [`PatchError::Assemble`] (an operand out of reach),
/// [`PatchError::OutOfReach`] (splice or jump back).
pub fn generate(req: &PatchRequest<'_>) -> Result<Patch, PatchError> {
    check_rings(req.probes)?;
    let orig = decode_one(req.original, req.addr)?;
    if orig.len() < SPLICE_LEN {
        return Err(PatchError::ShortInstruction {
            addr: req.addr,
            len: orig.len(),
        });
    }
    let assemble = |e| PatchError::Assemble {
        patch: req.patch,
        source: e,
    };
    let mut a = CodeAssembler::new(64).map_err(assemble)?;
    let saved = emit_snippet(&mut a, req.probes, req.live).map_err(assemble)?;
    let built = finish(a, &orig, req.patch, req.call_return)?;
    Ok(Patch {
        addr: req.addr,
        patch: req.patch,
        code: built.code,
        splice: splice_jmp(req.addr, req.patch)?,
        original: req.original[..orig.len()].to_vec(),
        relocated_at: built.relocated_at,
        jump_back_at: built.jump_back_at,
        shape: built.shape,
        saved,
    })
}

/// Generates the out-of-line copy a trap probe resumes through: the instruction at
/// `addr` relocated to `at`, then a jump back to the instruction after it. Calls keep
/// their original return address.
///
/// # Errors
/// As [`generate`], except that short instructions are fine.
pub fn out_of_line(original: &[u8], addr: u64, at: u64) -> Result<OutOfLine, PatchError> {
    let orig = decode_one(original, addr)?;
    let a = CodeAssembler::new(64).map_err(|e| PatchError::Assemble {
        patch: at,
        source: e,
    })?;
    let built = finish(a, &orig, at, CallReturn::Original)?;
    Ok(OutOfLine {
        at,
        code: built.code,
        shape: built.shape,
    })
}

struct Built {
    code: Vec<u8>,
    relocated_at: u64,
    jump_back_at: u64,
    shape: RelocShape,
}

/// Appends the relocated instruction and the jump back, assembles at `patch`, and checks
/// the result by decoding it.
fn finish(
    mut a: CodeAssembler,
    orig: &Instruction,
    patch: u64,
    call_return: CallReturn,
) -> Result<Built, PatchError> {
    let assemble = |e| PatchError::Assemble { patch, source: e };
    let first_relocated = a.instructions().len();
    let (seq, shape) = relocation_sequence(orig, call_return)?;
    for instr in seq {
        a.add_instruction(instr).map_err(assemble)?;
    }
    let next = orig.next_ip();
    a.set_prefer_short_branch(false);
    a.jmp(next).map_err(assemble)?;
    let result = a
        .assemble_options(patch, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)
        .map_err(assemble)?;
    let code = result.inner.code_buffer;
    let offset = result
        .inner
        .new_instruction_offsets
        .get(first_relocated)
        .map_or(0, |&o| o as usize);
    let relocated_at = patch.wrapping_add(offset as u64);
    let used = verify(
        orig,
        shape,
        code.get(offset..).unwrap_or_default(),
        relocated_at,
    )?;
    #[cfg(feature = "fault-injection")]
    let code = {
        let mut code = code;
        super::reloc::fault::apply(&mut code, offset, used, relocated_at);
        code
    };
    let back_offset = offset + used;
    let jump_back_at = patch.wrapping_add(back_offset as u64);
    let back =
        decode_one(code.get(back_offset..).unwrap_or_default(), jump_back_at).map_err(|_| {
            PatchError::OutOfReach {
                from: jump_back_at,
                to: next,
            }
        })?;
    if back.code() != Code::Jmp_rel32_64 || back.near_branch_target() != next {
        return Err(PatchError::OutOfReach {
            from: jump_back_at,
            to: next,
        });
    }
    Ok(Built {
        code,
        relocated_at,
        jump_back_at,
        shape,
    })
}

/// The `jmp rel32` from `addr` to `patch`.
fn splice_jmp(addr: u64, patch: u64) -> Result<[u8; SPLICE_LEN], PatchError> {
    let out_of_reach = PatchError::OutOfReach {
        from: addr,
        to: patch,
    };
    let jmp = Instruction::with_branch(Code::Jmp_rel32_64, patch)
        .map_err(|source| PatchError::Assemble { patch, source })?;
    let mut a = CodeAssembler::new(64).map_err(|source| PatchError::Assemble { patch, source })?;
    a.set_prefer_short_branch(false);
    a.add_instruction(jmp)
        .map_err(|source| PatchError::Assemble { patch, source })?;
    let bytes = a.assemble(addr).map_err(|_| out_of_reach)?;
    let mut decoder = Decoder::with_ip(64, &bytes, addr, DecoderOptions::NONE);
    let decoded = decoder.decode();
    if decoded.code() != Code::Jmp_rel32_64 || decoded.near_branch_target() != patch {
        return Err(PatchError::OutOfReach {
            from: addr,
            to: patch,
        });
    }
    bytes.try_into().map_err(|_| PatchError::OutOfReach {
        from: addr,
        to: patch,
    })
}

fn check_rings(probes: &[Probe]) -> Result<(), PatchError> {
    for probe in probes {
        if let Probe::Timestamp { ring, .. } = probe {
            if !ring.slot_count.is_power_of_two() || ring.slot_count > 1 << 31 {
                return Err(PatchError::BadRing(ring.slot_count));
            }
        }
    }
    Ok(())
}

/// Emits the probes with the save/restore liveness requires; returns what it saves.
fn emit_snippet(
    a: &mut CodeAssembler,
    probes: &[Probe],
    live: LiveState,
) -> Result<Saved, IcedError> {
    let clobbers = probes
        .iter()
        .fold(LiveState::NONE, |acc, p| acc.union(p.clobbers()));
    let saved = Saved {
        flags: clobbers.flags.intersects(live.flags),
        regs: RegSet::from_bits(clobbers.regs.bits() & live.regs.bits()),
    };
    if saved.flags {
        a.pushfq()?;
    }
    for reg in saved.regs.iter() {
        a.add_instruction(Instruction::with1(Code::Push_r64, reg)?)?;
    }
    for probe in probes {
        match *probe {
            Probe::Count { counter } => {
                let mut inc = Instruction::with1(Code::Inc_rm64, rip(counter))?;
                inc.set_has_lock_prefix(true);
                a.add_instruction(inc)?;
            }
            Probe::Timestamp { ring, id } => emit_timestamp(a, ring, id)?,
        }
    }
    for reg in saved.regs.iter().collect::<Vec<_>>().into_iter().rev() {
        a.add_instruction(Instruction::with1(Code::Pop_r64, reg)?)?;
    }
    if saved.flags {
        a.popfq()?;
    }
    Ok(saved)
}

fn emit_timestamp(a: &mut CodeAssembler, ring: Ring, id: u32) -> Result<(), IcedError> {
    a.rdtsc()?;
    a.shl(rdx, 32)?;
    a.or(rax, rdx)?;
    a.mov(edx, 1)?;
    let mut xadd = Instruction::with2(Code::Xadd_rm64_r64, rip(ring.head), Register::RDX)?;
    xadd.set_has_lock_prefix(true);
    a.add_instruction(xadd)?;
    // Checked by `check_rings`: slot_count - 1 fits in i32.
    a.and(edx, (ring.slot_count - 1) as i32)?;
    a.shl(rdx, RECORD_SIZE.trailing_zeros())?;
    a.add_instruction(Instruction::with2(
        Code::Lea_r64_m,
        Register::RCX,
        rip(ring.slots),
    )?)?;
    a.mov(dword_ptr(rcx + rdx + 8), id)?;
    a.mov(dword_ptr(rcx + rdx + 12), 0)?;
    a.mov(qword_ptr(rcx + rdx), rax)?;
    Ok(())
}

fn rip(addr: u64) -> MemoryOperand {
    MemoryOperand::with_base_displ(Register::RIP, addr as i64)
}

#[cfg(test)]
mod tests {
    use iced_x86::code_asm::*;
    use iced_x86::{Mnemonic, OpKind};

    use super::*;

    const ORIG: u64 = 0xffff_ffff_8100_1000;
    const PATCH: u64 = 0xffff_ffff_bfe0_0000;
    const DATA: u64 = 0xffff_ffff_8200_0040;
    const FENTRY: u64 = 0xffff_ffff_8000_0000;
    const COUNTER: u64 = 0xffff_ffff_bff0_0000;
    const RING: Ring = Ring {
        head: 0xffff_ffff_bff0_0100,
        slots: 0xffff_ffff_bff1_0000,
        slot_count: 1024,
    };

    fn assemble_at(ip: u64, f: impl FnOnce(&mut CodeAssembler)) -> Vec<u8> {
        let mut a = CodeAssembler::new(64).unwrap();
        f(&mut a);
        a.assemble(ip).unwrap()
    }

    fn rip_load() -> Vec<u8> {
        assemble_at(ORIG, |a| {
            a.add_instruction(
                Instruction::with2(Code::Mov_r64_rm64, Register::RAX, rip(DATA)).unwrap(),
            )
            .unwrap();
        })
    }

    fn decode_all(code: &[u8], ip: u64) -> Vec<Instruction> {
        Decoder::with_ip(64, code, ip, DecoderOptions::NONE)
            .into_iter()
            .collect()
    }

    fn mnemonics(code: &[u8], ip: u64) -> Vec<Mnemonic> {
        decode_all(code, ip)
            .iter()
            .map(Instruction::mnemonic)
            .collect()
    }

    fn request<'a>(original: &'a [u8], probes: &'a [Probe], live: LiveState) -> PatchRequest<'a> {
        PatchRequest {
            original,
            addr: ORIG,
            patch: PATCH,
            probes,
            live,
            call_return: CallReturn::Original,
        }
    }

    #[test]
    fn counter_with_dead_flags_is_one_locked_inc_before_the_relocated_load() {
        let original = rip_load();
        let probes = [Probe::Count { counter: COUNTER }];

        let patch = generate(&request(&original, &probes, LiveState::NONE)).unwrap();

        let code = decode_all(&patch.code, PATCH);
        assert_eq!(code.len(), 3);
        assert_eq!(code[0].mnemonic(), Mnemonic::Inc);
        assert!(code[0].has_lock_prefix());
        assert_eq!(code[0].ip_rel_memory_address(), COUNTER);
        assert_eq!(code[1].ip_rel_memory_address(), DATA);
        assert_eq!(code[1].ip(), patch.relocated_at);
        assert_eq!(code[2].near_branch_target(), ORIG + original.len() as u64);
        assert_eq!(code[2].ip(), patch.jump_back_at);
        assert_eq!(patch.saved, Saved::default());
    }

    #[test]
    fn splice_bytes_jump_to_the_patch_and_original_bytes_restore() {
        let original = rip_load();
        let probes = [Probe::Count { counter: COUNTER }];

        let patch = generate(&request(&original, &probes, LiveState::NONE)).unwrap();

        let jmp = decode_one(&patch.splice, ORIG).unwrap();
        assert_eq!(jmp.code(), Code::Jmp_rel32_64);
        assert_eq!(jmp.near_branch_target(), PATCH);
        assert_eq!(patch.original, original);
    }

    #[test]
    fn counter_with_live_zero_flag_is_wrapped_in_pushfq_popfq() {
        let original = rip_load();
        let probes = [Probe::Count { counter: COUNTER }];
        let live = LiveState {
            regs: RegSet::EMPTY,
            flags: StatusFlags::ZF,
        };

        let patch = generate(&request(&original, &probes, live)).unwrap();

        assert_eq!(
            mnemonics(&patch.code, PATCH),
            vec![
                Mnemonic::Pushfq,
                Mnemonic::Inc,
                Mnemonic::Popfq,
                Mnemonic::Mov,
                Mnemonic::Jmp
            ]
        );
    }

    #[test]
    fn counter_with_only_carry_live_needs_no_pushfq() {
        let original = rip_load();
        let probes = [Probe::Count { counter: COUNTER }];
        let live = LiveState {
            regs: RegSet::ALL,
            flags: StatusFlags::CF,
        };

        let patch = generate(&request(&original, &probes, live)).unwrap();

        assert!(!patch.saved.flags);
        assert_eq!(mnemonics(&patch.code, PATCH)[0], Mnemonic::Inc);
    }

    #[test]
    fn timestamp_saves_only_live_scratch_registers() {
        let original = rip_load();
        let probes = [Probe::Timestamp { ring: RING, id: 7 }];
        let live = LiveState {
            regs: RegSet::of(&[Register::RAX, Register::RCX]),
            flags: StatusFlags::EMPTY,
        };

        let patch = generate(&request(&original, &probes, live)).unwrap();

        let code = decode_all(&patch.code, PATCH);
        assert_eq!(code[0].mnemonic(), Mnemonic::Push);
        assert_eq!(code[0].op0_register(), Register::RAX);
        assert_eq!(code[1].op0_register(), Register::RCX);
        assert_eq!(code[2].mnemonic(), Mnemonic::Rdtsc);
        let pops: Vec<Register> = code
            .iter()
            .filter(|i| i.mnemonic() == Mnemonic::Pop)
            .map(|i| i.op0_register())
            .collect();
        assert_eq!(pops, vec![Register::RCX, Register::RAX]);
        assert_eq!(
            patch.saved.regs,
            RegSet::of(&[Register::RAX, Register::RCX])
        );
    }

    #[test]
    fn timestamp_record_uses_ring_head_slots_mask_and_id() {
        let original = rip_load();
        let probes = [Probe::Timestamp { ring: RING, id: 7 }];

        let patch = generate(&request(&original, &probes, LiveState::NONE)).unwrap();

        let code = decode_all(&patch.code, PATCH);
        let xadd = code
            .iter()
            .find(|i| i.mnemonic() == Mnemonic::Xadd)
            .unwrap();
        let and = code.iter().find(|i| i.mnemonic() == Mnemonic::And).unwrap();
        let lea = code.iter().find(|i| i.mnemonic() == Mnemonic::Lea).unwrap();
        let id_store = code
            .iter()
            .find(|i| i.op1_kind() == OpKind::Immediate32 && i.immediate32() == 7);
        assert!(xadd.has_lock_prefix());
        assert_eq!(xadd.ip_rel_memory_address(), RING.head);
        assert_eq!(and.immediate32(), RING.slot_count - 1);
        assert_eq!(lea.ip_rel_memory_address(), RING.slots);
        assert!(id_store.is_some());
    }

    #[test]
    fn two_probes_share_one_save_and_restore() {
        let original = rip_load();
        let probes = [
            Probe::Count { counter: COUNTER },
            Probe::Timestamp { ring: RING, id: 1 },
        ];

        let patch = generate(&request(&original, &probes, LiveState::ALL)).unwrap();

        let m = mnemonics(&patch.code, PATCH);
        assert_eq!(m.iter().filter(|&&x| x == Mnemonic::Pushfq).count(), 1);
        assert_eq!(m.iter().filter(|&&x| x == Mnemonic::Popfq).count(), 1);
        assert_eq!(m.iter().filter(|&&x| x == Mnemonic::Push).count(), 3);
        assert_eq!(m.iter().filter(|&&x| x == Mnemonic::Inc).count(), 1);
        assert_eq!(m.iter().filter(|&&x| x == Mnemonic::Rdtsc).count(), 1);
    }

    #[test]
    fn spliced_fentry_call_returns_to_the_original_next_instruction() {
        let original = assemble_at(ORIG, |a| a.call(FENTRY).unwrap());
        let probes = [Probe::Count { counter: COUNTER }];

        let patch = generate(&request(&original, &probes, LiveState::ALL)).unwrap();

        let code = decode_all(&patch.code, PATCH);
        let push = code.iter().find(|i| i.code() == Code::Pushq_imm32).unwrap();
        let jmp = code
            .iter()
            .find(|i| i.near_branch_target() == FENTRY)
            .unwrap();
        assert_eq!(push.immediate32to64() as u64, ORIG + 5);
        assert_eq!(jmp.mnemonic(), Mnemonic::Jmp);
        assert_eq!(
            patch.shape,
            RelocShape::CallAsPushJmp {
                return_to: ORIG + 5
            }
        );
    }

    #[test]
    fn near_jcc_keeps_its_target_and_falls_through_to_the_jump_back() {
        let target = ORIG + 0x400;
        let original = assemble_at(ORIG, |a| {
            a.add_instruction(Instruction::with_branch(Code::Jne_rel32_64, target).unwrap())
                .unwrap();
        });

        let patch = generate(&request(&original, &[], LiveState::ALL)).unwrap();

        let code = decode_all(&patch.code, PATCH);
        assert_eq!(code[0].mnemonic(), Mnemonic::Jne);
        assert_eq!(code[0].near_branch_target(), target);
        assert_eq!(code[1].near_branch_target(), ORIG + 6);
    }

    #[test]
    fn round_trip_every_absolute_target_matches_the_original() {
        let original = rip_load();
        let orig = decode_one(&original, ORIG).unwrap();
        let probes = [Probe::Count { counter: COUNTER }];

        let patch = generate(&request(&original, &probes, LiveState::ALL)).unwrap();

        let moved = decode_all(&patch.code, PATCH)
            .into_iter()
            .find(|i| i.ip() == patch.relocated_at)
            .unwrap();
        assert_eq!(moved.mnemonic(), orig.mnemonic());
        assert_eq!(moved.op0_register(), orig.op0_register());
        assert_eq!(moved.ip_rel_memory_address(), orig.ip_rel_memory_address());
    }

    #[test]
    fn request_for_site_uses_the_sites_bytes_and_liveness() {
        let original = rip_load();
        let site = Site {
            addr: ORIG,
            instruction: decode_one(&original, ORIG).unwrap(),
            bytes: original,
            live: LiveState {
                regs: RegSet::EMPTY,
                flags: StatusFlags::SF,
            },
        };
        let probes = [Probe::Count { counter: COUNTER }];

        let patch = generate(&PatchRequest::for_site(&site, PATCH, &probes)).unwrap();

        assert!(patch.saved.flags);
        assert_eq!(patch.original, site.bytes);
    }

    #[test]
    fn short_instruction_cannot_be_spliced() {
        let original = assemble_at(ORIG, |a| a.push(rbx).unwrap());

        let result = generate(&request(&original, &[], LiveState::ALL));

        assert!(matches!(
            result,
            Err(PatchError::ShortInstruction { len: 1, .. })
        ));
    }

    #[test]
    fn ring_with_non_power_of_two_slots_is_rejected() {
        let original = rip_load();
        let probes = [Probe::Timestamp {
            ring: Ring {
                slot_count: 1000,
                ..RING
            },
            id: 1,
        }];

        let result = generate(&request(&original, &probes, LiveState::ALL));

        assert!(matches!(result, Err(PatchError::BadRing(1000))));
    }

    #[test]
    fn patch_out_of_reach_is_an_error() {
        let original = assemble_at(ORIG, |a| a.mov(rax, qword_ptr(rdi + 0x100)).unwrap());
        let req = PatchRequest {
            patch: 0x4000_0000_0000,
            ..request(&original, &[], LiveState::ALL)
        };

        let result = generate(&req);

        assert!(matches!(result, Err(PatchError::OutOfReach { .. })));
    }

    #[test]
    fn counter_out_of_reach_fails_to_assemble() {
        let original = rip_load();
        let probes = [Probe::Count {
            counter: 0x4000_0000_0000,
        }];

        let result = generate(&request(&original, &probes, LiveState::ALL));

        assert!(matches!(result, Err(PatchError::Assemble { .. })));
    }

    #[test]
    fn out_of_line_copy_of_short_jcc_becomes_near_jcc_and_jump_back() {
        let original = assemble_at(ORIG, |a| a.je(ORIG + 0x30).unwrap());

        let copy = out_of_line(&original, ORIG, PATCH).unwrap();

        let code = decode_all(&copy.code, PATCH);
        assert_eq!(code[0].code(), Code::Je_rel32_64);
        assert_eq!(code[0].near_branch_target(), ORIG + 0x30);
        assert_eq!(code[1].near_branch_target(), ORIG + 2);
    }
}
