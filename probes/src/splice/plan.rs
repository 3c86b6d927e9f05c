//! The splice planner: for an instruction address, decide whether to splice (one
//! instruction of at least five bytes becomes a `jmp rel32` to a patch), fall back to a
//! trap probe (`int3`), or refuse, always with the reason.
//!
//! The planner never overwrites more than one instruction (KernInst's rule: no thread
//! can be caught between two replaced instructions, and branch targets inside the
//! replaced bytes are refused).

use std::ops::Range;

use exotap_introspect::x86::{CodeView, Flow, LiveState, TextAnalysis};
use iced_x86::{Code, FlowControl, Instruction, Mnemonic, OpKind, Register};

use super::reloc::decode_one;

/// The most bytes a patch may put before the relocated instruction and its jump back;
/// reach checks allow for the relocated copy to sit anywhere in
/// `[patch, patch + PATCH_REACH_SLACK]`.
pub const PATCH_REACH_SLACK: u64 = 4096;

/// Length of the `jmp rel32` a splice writes.
pub const SPLICE_LEN: usize = 5;

/// Why an address cannot be instrumented (neither spliced nor trapped).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No analyzed function holds the address.
    #[error("{addr:#x} is not inside any analyzed function")]
    OutsideFunction {
        /// The address asked for.
        addr: u64,
    },
    /// The function's bytes have not been read from the guest (a plan asked before the
    /// text was read: a bug of the caller, refused rather than planned over unread bytes).
    #[error("the text of the function holding {addr:#x} has not been read from the guest")]
    TextNotRead {
        /// The address asked for.
        addr: u64,
    },
    /// The bytes the splice would replace cross from one page of a module's text into one
    /// that is not physically after it (module text is mapped page by page).
    #[error("the splice at {addr:#x} would cross into a page of module text that is not physically after its first")]
    SplitPages {
        /// The address asked for.
        addr: u64,
    },
    /// The address is inside an instruction, not at its start.
    #[error("{addr:#x} is not the start of an instruction")]
    NotInstructionBoundary {
        /// The address asked for.
        addr: u64,
        /// Start of the instruction that holds it, when there is one.
        insn_start: Option<u64>,
    },
    /// The bytes there do not decode.
    #[error("the bytes at {addr:#x} do not decode as an instruction")]
    Undecodable {
        /// The address.
        addr: u64,
    },
    /// A direct branch in the function targets the middle of an instruction, so its
    /// linear-sweep decoding cannot be trusted.
    #[error("the function's decoding is inconsistent: the branch at {branch:#x} targets {target:#x}, inside an instruction")]
    InconsistentDecode {
        /// The branch.
        branch: u64,
        /// Its target.
        target: u64,
    },
    /// Some branch lands strictly inside the bytes the splice would replace.
    #[error("a branch targets {target:#x}, inside the instruction at {addr:#x}")]
    BranchIntoInstruction {
        /// The instruction.
        addr: u64,
        /// The offending target.
        target: u64,
    },
    /// The instruction is in a range the caller forbade (entry code, `noinstr`).
    #[error("{addr:#x} is in the forbidden range {range:#x?}")]
    ForbiddenRange {
        /// The instruction.
        addr: u64,
        /// The range.
        range: Range<u64>,
    },
    /// The kernel rewrites these bytes itself (alternatives, jump labels, static
    /// calls, ftrace sites): it would clash with the splice.
    #[error("the kernel patches the bytes at {range:#x?} itself")]
    SelfPatchedSite {
        /// The instruction.
        addr: u64,
        /// The kernel's patch site.
        range: Range<u64>,
    },
    /// The kernel looks this instruction up by address (exception table, bug table):
    /// a relocated copy would not be found there.
    #[error("the kernel looks up the instruction at {addr:#x} by its address")]
    AddressKeyedSite {
        /// The instruction.
        addr: u64,
    },
    /// The instruction cannot safely run elsewhere.
    #[error("{mnemonic:?} at {addr:#x} cannot be moved: it {why}")]
    Unsupported {
        /// The instruction.
        addr: u64,
        /// Its mnemonic.
        mnemonic: Mnemonic,
        /// Why.
        why: &'static str,
    },
    /// The previous instruction (`sti`, `mov ss`) blocks interrupts for exactly one
    /// instruction; a jump to a patch would use up that shadow.
    #[error("{addr:#x} follows {previous:?}, whose interrupt shadow covers it")]
    InterruptShadow {
        /// The instruction.
        addr: u64,
        /// The previous instruction's mnemonic.
        previous: Mnemonic,
    },
    /// A RIP-relative operand or a branch target is more than ±2 GiB from the patch.
    #[error("{target:#x}, used by the instruction at {addr:#x}, is out of rel32 reach of the patch at {patch:#x}")]
    OperandOutOfReach {
        /// The instruction.
        addr: u64,
        /// The absolute operand or target.
        target: u64,
        /// The patch address.
        patch: u64,
    },
    /// The patch is more than ±2 GiB from the instruction.
    #[error("the patch at {patch:#x} is out of rel32 reach of {addr:#x}")]
    PatchOutOfReach {
        /// The instruction.
        addr: u64,
        /// The patch address.
        patch: u64,
    },
}

/// Why a site gets a trap probe instead of a splice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrapReason {
    /// The instruction is shorter than the five bytes of a `jmp rel32`.
    ShortInstruction {
        /// Its length.
        len: usize,
    },
}

/// The instruction at a site that can be instrumented, and what is live before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Site {
    /// Its address.
    pub addr: u64,
    /// Its bytes (what removal restores).
    pub bytes: Vec<u8>,
    /// It, decoded at `addr`.
    pub instruction: Instruction,
    /// Registers and flags live before it: what a patch must preserve.
    pub live: LiveState,
}

impl Site {
    /// The address of the next instruction.
    #[must_use]
    pub fn next(&self) -> u64 {
        self.addr.wrapping_add(self.bytes.len() as u64)
    }
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpliceDecision {
    /// Replace the instruction by a `jmp rel32` to the patch.
    Splice(Site),
    /// Put an `int3` on it instead.
    Trap {
        /// The site.
        site: Site,
        /// Why not a splice.
        reason: TrapReason,
    },
    /// Do not touch it.
    Refuse(Refusal),
}

/// Everything the planner consults besides the address.
#[derive(Debug, Clone, Copy)]
pub struct SpliceContext<'a> {
    /// The kernel text the analysis was made from.
    pub text: CodeView<'a>,
    /// Its structural analysis.
    pub analysis: &'a TextAnalysis,
    /// Ranges not to instrument at all (e.g. `.entry.text`, `.noinstr.text`). Sorted and
    /// disjoint (see [`disjoint_ranges`]): the planner binary-searches them.
    pub forbidden: &'a [Range<u64>],
    /// Bytes the kernel rewrites itself (alternatives, jump labels, static calls, and
    /// ftrace sites when the guest's ftrace may be used).
    /// Sorted and disjoint, as `forbidden`.
    pub self_patched: &'a [Range<u64>],
    /// Instruction addresses the kernel looks up (exception and bug tables), sorted.
    pub address_keyed: &'a [u64],
}

impl<'a> SpliceContext<'a> {
    /// A context with no forbidden, self-patched or address-keyed sites.
    #[must_use]
    pub fn new(text: CodeView<'a>, analysis: &'a TextAnalysis) -> Self {
        Self {
            text,
            analysis,
            forbidden: &[],
            self_patched: &[],
            address_keyed: &[],
        }
    }
}

/// Decides how to instrument the instruction at `addr`, given that its patch would be
/// at `patch`.
#[must_use]
pub fn plan(ctx: &SpliceContext<'_>, addr: u64, patch: u64) -> SpliceDecision {
    match plan_site(ctx, addr, patch) {
        Ok(decision) => decision,
        Err(refusal) => SpliceDecision::Refuse(refusal),
    }
}

fn plan_site(ctx: &SpliceContext<'_>, addr: u64, patch: u64) -> Result<SpliceDecision, Refusal> {
    let func = ctx
        .analysis
        .function_containing(addr)
        .ok_or(Refusal::OutsideFunction { addr })?;
    let cfg = &func.cfg;
    let index = cfg
        .insn_index_at(addr)
        .ok_or_else(|| Refusal::NotInstructionBoundary {
            addr,
            insn_start: cfg.insn_index_containing(addr).map(|i| cfg.insns()[i].addr),
        })?;
    let insn = cfg.insns()[index];
    if insn.flow == Flow::Invalid {
        return Err(Refusal::Undecodable { addr });
    }
    if let Some(&(branch, target)) = cfg.bad_targets().first() {
        return Err(Refusal::InconsistentDecode { branch, target });
    }
    let end = insn.end();
    if let Some(range) = first_overlapping(ctx.forbidden, addr, end) {
        return Err(Refusal::ForbiddenRange {
            addr,
            range: range.clone(),
        });
    }
    if let Some(range) = first_overlapping(ctx.self_patched, addr, end) {
        return Err(Refusal::SelfPatchedSite {
            addr,
            range: range.clone(),
        });
    }
    if ctx.address_keyed.binary_search(&addr).is_ok() {
        return Err(Refusal::AddressKeyedSite { addr });
    }
    let bytes = ctx
        .text
        .range(addr, end)
        .ok_or(Refusal::Undecodable { addr })?;
    let instruction = decode_one(bytes, addr).map_err(|_| Refusal::Undecodable { addr })?;
    if let Some(why) = unsupported(&instruction) {
        return Err(Refusal::Unsupported {
            addr,
            mnemonic: instruction.mnemonic(),
            why,
        });
    }
    if let Some(prev) = index.checked_sub(1).map(|i| cfg.insns()[i]) {
        let prev_bytes = ctx.text.range(prev.addr, prev.end()).unwrap_or_default();
        if let Ok(prev_instr) = decode_one(prev_bytes, prev.addr) {
            if opens_interrupt_shadow(&prev_instr) {
                return Err(Refusal::InterruptShadow {
                    addr,
                    previous: prev_instr.mnemonic(),
                });
            }
        }
    }
    let short = bytes.len() < SPLICE_LEN;
    // A trap's out-of-line copy only needs its memory operand in reach: the host
    // emulates branches.
    let checked_targets = [
        instruction
            .is_ip_rel_memory_operand()
            .then(|| instruction.ip_rel_memory_address()),
        direct_target(&instruction).filter(|_| !short),
    ];
    for target in checked_targets.into_iter().flatten() {
        if !reachable_from_patch(patch, target) {
            return Err(Refusal::OperandOutOfReach {
                addr,
                target,
                patch,
            });
        }
    }
    let site = Site {
        addr,
        bytes: bytes.to_vec(),
        instruction,
        live: func.liveness.before_insn(cfg, index),
    };
    if short {
        return Ok(SpliceDecision::Trap {
            site,
            reason: TrapReason::ShortInstruction { len: bytes.len() },
        });
    }
    // The whole text's targets include this function's own.
    if let Some(target) = ctx
        .analysis
        .branch_targets()
        .first_strictly_inside(addr, end)
    {
        return Err(Refusal::BranchIntoInstruction { addr, target });
    }
    let splice_next = addr.wrapping_add(SPLICE_LEN as u64);
    if !fits_rel32(splice_next, patch) || !reachable_from_patch(patch, end) {
        return Err(Refusal::PatchOutOfReach { addr, patch });
    }
    Ok(SpliceDecision::Splice(site))
}

/// The first of `ranges` (sorted and disjoint) that overlaps `[start, end)`: a binary
/// search, since a batch plans thousands of sites against tens of thousands of
/// self-patched ranges (every jump label).
fn first_overlapping(ranges: &[Range<u64>], start: u64, end: u64) -> Option<&Range<u64>> {
    // Disjoint and sorted by start: sorted by end too.
    let i = ranges.partition_point(|r| r.end <= start);
    ranges.get(i).filter(|r| r.start < end && start < r.end)
}

/// `ranges` sorted, with overlapping ones merged, as [`SpliceContext`] needs them. Empty
/// ranges are dropped.
#[must_use]
pub fn disjoint_ranges(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.retain(|r| r.start < r.end);
    ranges.sort_by_key(|r| (r.start, r.end));
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start < last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Whether a rel32 field in an instruction ending at `next` can reach `target`.
#[must_use]
pub fn fits_rel32(next: u64, target: u64) -> bool {
    i32::try_from(target.wrapping_sub(next) as i64).is_ok()
}

fn reachable_from_patch(patch: u64, target: u64) -> bool {
    fits_rel32(patch, target) && fits_rel32(patch.wrapping_add(PATCH_REACH_SLACK), target)
}

fn direct_target(instr: &Instruction) -> Option<u64> {
    let direct = matches!(
        instr.flow_control(),
        FlowControl::Call | FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch
    ) || instr.mnemonic() == Mnemonic::Xbegin;
    (direct && matches!(instr.op0_kind(), OpKind::NearBranch64)).then(|| instr.near_branch_target())
}

fn opens_interrupt_shadow(instr: &Instruction) -> bool {
    instr.mnemonic() == Mnemonic::Sti || writes_ss(instr)
}

fn writes_ss(instr: &Instruction) -> bool {
    (instr.mnemonic() == Mnemonic::Mov || instr.mnemonic() == Mnemonic::Pop)
        && instr.op0_kind() == OpKind::Register
        && instr.op0_register() == Register::SS
}

/// Why an instruction must not run anywhere but where it is, if it must not.
fn unsupported(instr: &Instruction) -> Option<&'static str> {
    let why = match instr.mnemonic() {
        Mnemonic::Swapgs => "swaps the GS base, so the code around it runs with a user GS",
        Mnemonic::Sysret
        | Mnemonic::Sysretq
        | Mnemonic::Sysexit
        | Mnemonic::Sysexitq
        | Mnemonic::Iret
        | Mnemonic::Iretd
        | Mnemonic::Iretq
        | Mnemonic::Uiret
        | Mnemonic::Eretu
        | Mnemonic::Erets => "returns to another privilege level",
        Mnemonic::Syscall
        | Mnemonic::Sysenter
        | Mnemonic::Int
        | Mnemonic::Int1
        | Mnemonic::Int3
        | Mnemonic::Into => "traps, and the handler may look at where it trapped",
        Mnemonic::Ud0 | Mnemonic::Ud1 | Mnemonic::Ud2 => {
            "raises #UD, which the kernel's bug table resolves by address (BUG/WARN)"
        }
        Mnemonic::Vmlaunch | Mnemonic::Vmresume | Mnemonic::Vmrun | Mnemonic::Rsm => {
            "enters another execution mode"
        }
        Mnemonic::Retf => "is a far return",
        _ if opens_interrupt_shadow(instr) => {
            "opens an interrupt shadow that must cover the next original instruction"
        }
        _ if instr.code() == Code::Mov_cr_r64 && instr.op0_register() == Register::CR3 => {
            "switches page tables, and the patch is not mapped in every one (PTI)"
        }
        _ if matches!(instr.op0_kind(), OpKind::FarBranch16 | OpKind::FarBranch32)
            || matches!(instr.code(), Code::Jmp_m1664 | Code::Call_m1664) =>
        {
            "is a far transfer"
        }
        _ => return None,
    };
    Some(why)
}

#[cfg(test)]
mod tests {
    use exotap_introspect::x86::{ranges_from_starts, AnalysisConfig, RegSet};
    use iced_x86::code_asm::*;
    use iced_x86::{BlockEncoderOptions, MemoryOperand};

    use super::*;

    const BASE: u64 = 0xffff_ffff_8100_0000;
    const FENTRY: u64 = 0xffff_ffff_8000_0000;
    const DATA: u64 = 0xffff_ffff_8200_0000;
    const PATCH: u64 = 0xffff_ffff_bfe0_0000;
    const FAR_PATCH: u64 = 0xffff_c900_0000_0000;

    /// Fixture text: function starts and named instruction addresses.
    struct Fixture {
        bytes: Vec<u8>,
        starts: Vec<u64>,
        fentry_call: u64,
        rip_load: u64,
        push_rbx: u64,
        imm64_mov: u64,
        after_sti: u64,
        plain_load: u64,
        swapgs: u64,
        ud2: u64,
        cr3_write: u64,
        garbage: u64,
        inconsistent_fn: u64,
    }

    fn rip_load(a: &mut CodeAssembler) {
        let i = Instruction::with2(
            Code::Mov_r64_rm64,
            Register::RAX,
            MemoryOperand::with_base_displ(Register::RIP, DATA as i64),
        )
        .unwrap();
        a.add_instruction(i).unwrap();
    }

    fn fixture() -> Fixture {
        let mut a = CodeAssembler::new(64).unwrap();
        let mut labels: Vec<CodeLabel> = (0..14).map(|_| a.create_label()).collect();
        // f: the typical traced function.
        a.set_label(&mut labels[0]).unwrap();
        a.call(FENTRY).unwrap();
        a.set_label(&mut labels[1]).unwrap();
        rip_load(&mut a);
        a.set_label(&mut labels[2]).unwrap();
        a.push(rbx).unwrap();
        a.set_label(&mut labels[3]).unwrap();
        a.mov(rbx, 0x1122_3344_5566_7788u64).unwrap();
        a.pop(rbx).unwrap();
        a.ret().unwrap();
        // g: odd instructions.
        a.set_label(&mut labels[4]).unwrap();
        a.sti().unwrap();
        a.set_label(&mut labels[5]).unwrap();
        a.mov(rax, qword_ptr(rdi + 0x100)).unwrap();
        a.set_label(&mut labels[13]).unwrap();
        a.mov(rcx, qword_ptr(rdi + 0x108)).unwrap();
        a.set_label(&mut labels[6]).unwrap();
        a.swapgs().unwrap();
        a.set_label(&mut labels[7]).unwrap();
        a.ud2().unwrap();
        a.set_label(&mut labels[8]).unwrap();
        a.mov(cr3, rax).unwrap();
        a.set_label(&mut labels[9]).unwrap();
        a.db(&[0xff, 0xff]).unwrap();
        a.ret().unwrap();
        // h: jumps into the middle of f's `mov rbx, imm64` (a cross-function target).
        a.set_label(&mut labels[10]).unwrap();
        a.jmp(BASE + 5 + 7 + 1 + 2).unwrap();
        // k: jumps into the middle of its own instruction.
        a.set_label(&mut labels[11]).unwrap();
        a.jmp(labels[12]).unwrap();
        a.set_label(&mut labels[12]).unwrap();
        a.mov(rax, 0x1122_3344_5566_7788u64).unwrap();
        a.ret().unwrap();
        let r = a
            .assemble_options(BASE, BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS)
            .unwrap();
        let ip = |l: &CodeLabel| r.label_ip(l).unwrap();
        let mut bytes = r.inner.code_buffer.clone();
        // Retarget k's `jmp` (2 bytes: EB disp8) one byte further, into the mov.
        let k = (ip(&labels[11]) - BASE) as usize;
        bytes[k + 1] += 1;
        Fixture {
            starts: vec![
                ip(&labels[0]),
                ip(&labels[4]),
                ip(&labels[10]),
                ip(&labels[11]),
            ],
            fentry_call: ip(&labels[0]),
            rip_load: ip(&labels[1]),
            push_rbx: ip(&labels[2]),
            imm64_mov: ip(&labels[3]),
            after_sti: ip(&labels[5]),
            plain_load: ip(&labels[13]),
            swapgs: ip(&labels[6]),
            ud2: ip(&labels[7]),
            cr3_write: ip(&labels[8]),
            garbage: ip(&labels[9]),
            inconsistent_fn: ip(&labels[12]),
            bytes,
        }
    }

    #[derive(Default)]
    struct Sites {
        forbidden: Vec<Range<u64>>,
        self_patched: Vec<Range<u64>>,
        address_keyed: Vec<u64>,
    }

    fn decide_with(fx: &Fixture, addr: u64, patch: u64, sites: &Sites) -> SpliceDecision {
        let text = CodeView::new(BASE, &fx.bytes).unwrap();
        let ranges = ranges_from_starts(&fx.starts, text.end());
        let analysis = TextAnalysis::analyze(text, &ranges, &AnalysisConfig::new());
        let ctx = SpliceContext {
            forbidden: &sites.forbidden,
            self_patched: &sites.self_patched,
            address_keyed: &sites.address_keyed,
            ..SpliceContext::new(text, &analysis)
        };
        plan(&ctx, addr, patch)
    }

    fn decide(fx: &Fixture, addr: u64, patch: u64) -> SpliceDecision {
        decide_with(fx, addr, patch, &Sites::default())
    }

    fn refusal(decision: SpliceDecision) -> Refusal {
        match decision {
            SpliceDecision::Refuse(r) => r,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn overlapping_ranges_merge_and_the_first_overlapping_one_is_found() {
        let ranges = disjoint_ranges(vec![30..35, 10..15, 12..20, 40..40, 50..55]);

        assert_eq!(ranges, vec![10..20, 30..35, 50..55]);
        assert_eq!(first_overlapping(&ranges, 0, 10), None);
        assert_eq!(first_overlapping(&ranges, 5, 11), Some(&(10..20)));
        assert_eq!(first_overlapping(&ranges, 19, 31), Some(&(10..20)));
        assert_eq!(first_overlapping(&ranges, 20, 30), None);
        assert_eq!(first_overlapping(&ranges, 34, 60), Some(&(30..35)));
        assert_eq!(first_overlapping(&ranges, 55, 60), None);
    }

    #[test]
    fn fentry_call_is_spliced_with_arguments_live() {
        let fx = fixture();

        let decision = decide(&fx, fx.fentry_call, PATCH);

        let SpliceDecision::Splice(site) = decision else {
            panic!("{decision:?}")
        };
        assert_eq!(site.bytes.len(), 5);
        assert_eq!(site.next(), fx.rip_load);
        assert!(site.live.regs.contains(Register::RDI));
        assert!(site.live.flags.is_empty());
    }

    #[test]
    fn rip_relative_load_in_reach_is_spliced_with_rax_dead() {
        let fx = fixture();

        let decision = decide(&fx, fx.rip_load, PATCH);

        let SpliceDecision::Splice(site) = decision else {
            panic!("{decision:?}")
        };
        assert!(!site.live.regs.contains(Register::RAX));
    }

    #[test]
    fn one_byte_push_gets_a_trap() {
        let fx = fixture();

        let decision = decide(&fx, fx.push_rbx, PATCH);

        let SpliceDecision::Trap { site, reason } = decision else {
            panic!("{decision:?}")
        };
        assert_eq!(reason, TrapReason::ShortInstruction { len: 1 });
        assert!(site.live.regs.contains(Register::RBX));
    }

    #[test]
    fn address_past_text_is_outside_any_function() {
        let fx = fixture();

        let r = refusal(decide(&fx, BASE + fx.bytes.len() as u64, PATCH));

        assert_eq!(
            r,
            Refusal::OutsideFunction {
                addr: BASE + fx.bytes.len() as u64
            }
        );
    }

    #[test]
    fn address_inside_an_instruction_is_not_a_boundary() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.rip_load + 2, PATCH));

        assert_eq!(
            r,
            Refusal::NotInstructionBoundary {
                addr: fx.rip_load + 2,
                insn_start: Some(fx.rip_load)
            }
        );
    }

    #[test]
    fn cross_function_branch_into_instruction_refuses_splice() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.imm64_mov, PATCH));

        assert_eq!(
            r,
            Refusal::BranchIntoInstruction {
                addr: fx.imm64_mov,
                target: fx.imm64_mov + 2
            }
        );
    }

    #[test]
    fn function_with_branch_into_its_own_instruction_is_inconsistent() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.inconsistent_fn, PATCH));

        assert!(
            matches!(r, Refusal::InconsistentDecode { target, .. } if target == fx.inconsistent_fn + 1)
        );
    }

    #[test]
    fn garbage_bytes_are_undecodable() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.garbage, PATCH));

        assert_eq!(r, Refusal::Undecodable { addr: fx.garbage });
    }

    #[test]
    fn instruction_after_sti_is_in_the_interrupt_shadow() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.after_sti, PATCH));

        assert_eq!(
            r,
            Refusal::InterruptShadow {
                addr: fx.after_sti,
                previous: Mnemonic::Sti
            }
        );
    }

    #[test]
    fn swapgs_ud2_and_cr3_writes_are_unsupported() {
        let fx = fixture();

        let refusals: Vec<Refusal> = [fx.swapgs, fx.ud2, fx.cr3_write]
            .iter()
            .map(|&addr| refusal(decide(&fx, addr, PATCH)))
            .collect();

        assert!(refusals
            .iter()
            .all(|r| matches!(r, Refusal::Unsupported { .. })));
    }

    #[test]
    fn rip_relative_operand_out_of_reach_of_far_patch_is_refused() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.rip_load, FAR_PATCH));

        assert_eq!(
            r,
            Refusal::OperandOutOfReach {
                addr: fx.rip_load,
                target: DATA,
                patch: FAR_PATCH
            }
        );
    }

    #[test]
    fn call_target_out_of_reach_of_far_patch_is_refused() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.fentry_call, FAR_PATCH));

        assert_eq!(
            r,
            Refusal::OperandOutOfReach {
                addr: fx.fentry_call,
                target: FENTRY,
                patch: FAR_PATCH
            }
        );
    }

    #[test]
    fn plain_instruction_with_far_patch_is_refused_for_patch_reach() {
        let fx = fixture();

        let r = refusal(decide(&fx, fx.plain_load, FAR_PATCH));

        assert_eq!(
            r,
            Refusal::PatchOutOfReach {
                addr: fx.plain_load,
                patch: FAR_PATCH
            }
        );
    }

    #[test]
    fn forbidden_range_is_refused() {
        let fx = fixture();
        let range = fx.rip_load..fx.rip_load + 1;
        let sites = Sites {
            forbidden: vec![range],
            ..Sites::default()
        };

        let r = refusal(decide_with(&fx, fx.rip_load, PATCH, &sites));

        assert!(matches!(r, Refusal::ForbiddenRange { .. }));
    }

    #[test]
    fn kernel_self_patched_site_is_refused() {
        let fx = fixture();
        let range = fx.fentry_call..fx.fentry_call + 5;
        let sites = Sites {
            self_patched: vec![range],
            ..Sites::default()
        };

        let r = refusal(decide_with(&fx, fx.fentry_call, PATCH, &sites));

        assert!(matches!(r, Refusal::SelfPatchedSite { .. }));
    }

    #[test]
    fn exception_table_site_is_refused() {
        let fx = fixture();
        let sites = Sites {
            address_keyed: vec![fx.rip_load],
            ..Sites::default()
        };

        let r = refusal(decide_with(&fx, fx.rip_load, PATCH, &sites));

        assert_eq!(r, Refusal::AddressKeyedSite { addr: fx.rip_load });
    }

    #[test]
    fn live_registers_before_call_exclude_dead_scratch() {
        let fx = fixture();

        let SpliceDecision::Splice(site) = decide(&fx, fx.fentry_call, PATCH) else {
            panic!("expected a splice")
        };

        assert!(!site.live.regs.contains(Register::R10));
        assert_ne!(site.live.regs, RegSet::ALL);
    }
}
