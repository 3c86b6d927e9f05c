//! SPARC v9 splicing, as KernInst did it on Solaris/UltraSPARC: one instruction word is
//! replaced by `ba,a` to a code patch (or to a springboard that long-jumps to the patch
//! when it is beyond `ba,a`'s ±8 MiB reach); the patch runs the probe, then the relocated
//! original instruction, then jumps back.
//!
//! The decoder/encoder here is hand-written: there is no maintained Rust crate that both
//! decodes and encodes SPARC v9 (crates.io has only bindings to C disassemblers —
//! Capstone, LLVM — which decode to text and cannot encode), and the subset splicing
//! needs is small and regular: every instruction is one big-endian 32-bit word in one of
//! three formats. [`decode`] classifies a word (format-1 `call`; format-2 `sethi`, `Bicc`,
//! `BPcc`, `BPr`, `FBfcc`, `FBPfcc`; format-3 ALU/load/store/`jmpl`/`save`/`restore`/
//! `return`/traps) and knows which are delayed control-transfer instructions (DCTIs),
//! whether their delay slot is annulled, and their PC-relative targets; the `enc_*`
//! functions build the few words patches need.
//!
//! Planning rules ([`plan`]):
//! - an ordinary instruction is relocated alone; a DCTI is relocated together with its
//!   delay slot (the splice replaces the DCTI; the patch runs both);
//! - a delay-slot instruction is probed by splicing its DCTI (the pair is relocated).
//!   Normally the probe runs before the DCTI; when the DCTI is a conditional branch that
//!   annuls its delay slot, the slot runs only when the branch is taken, so the probe
//!   runs on the patch's taken path instead. Refused: delay slots that are branch
//!   targets (they also run without the DCTI), the delay slot of `ba,a`/`bn,a` (it
//!   never runs), and DCTI couples;
//! - instructions whose meaning depends on where they are and that cannot be rewritten
//!   (`rd %pc`, traps `Tcc`, `done`/`retry`, `illtrap`, undecodable words) are refused;
//! - an indirect call `jmpl ..., %rd` whose address uses `%rd` is refused (the patch
//!   sets `%rd` to the original return address before jumping).
//!
//! Scratch registers: the counting probe stores `%l0`/`%l1` just below the stack pointer
//! (`[%sp + 2047 - 16]`: the v9 ABI's stack bias is 2047, and nothing lives below `%sp`
//! — there is no red zone, signal and trap frames may land there at any time), uses
//! them, and reloads them; long jumps do the same with `%l0` (`stx %l0, [..]; sethi
//! %hi(T), %l0; jmpl %l0 + %lo(T), %g0; ldx [..], %l0` — the reload in the delay slot
//! runs after `jmpl` has read `%l0`). None of it touches the condition codes. KernInst
//! got its scratch registers from a `save`/`restore` bracket instead (a fresh window's
//! locals are dead by construction); that needs a CPU that runs register windows, and
//! Unicorn's SPARC64 does not (see `guest-images/minikernels/sparc64/entry.S`), so the
//! mini-kernel is built with `-mflat` and patches use the stack.
//!
//! Relocation: a conditional branch keeps its condition and annul bit and now branches
//! to a taken-path label inside the patch; the patch's fall-through jumps back to the
//! instruction after the delay slot, the taken path to the original target. A `call`
//! becomes `sethi`/`or` of the original call address into `%o7` (so the callee returns
//! to the original code, and `%o7` has the value the original `call` would have
//! written), the delay slot, and a jump to the callee. Long jumps and `sethi`/`or`
//! pairs need 32-bit addresses (`-mcmodel=medlow` kernels); others are refused at patch
//! generation with an error.

use std::collections::BTreeSet;

/// Reach of `ba,a` (disp22, in words): ±8 MiB.
pub const BA_REACH: i64 = 1 << 23;
/// The v9 ABI's stack bias: `%sp + 2047` is the real stack pointer.
pub const STACK_BIAS: i32 = 2047;
/// Where a patch keeps `%l0` while it uses it: just below the real stack pointer.
const SPILL_L0: i32 = STACK_BIAS - 16;
/// Where a patch keeps `%l1`.
const SPILL_L1: i32 = STACK_BIAS - 8;

/// Test-only fault injection into the SPARC relocator, to prove that the splicing-safety
/// regression detects a broken relocation. Only built with the `fault-injection`
/// feature, which only the regression's own tests enable.
#[cfg(feature = "fault-injection")]
pub mod fault {
    use std::sync::atomic::{AtomicBool, Ordering};

    static DROP_DELAY_SLOT: AtomicBool = AtomicBool::new(false);

    /// Makes every later relocation of a DCTI replace its delay slot by a `nop`
    /// (process-wide), or stops doing so.
    pub fn set_drop_delay_slot(on: bool) {
        DROP_DELAY_SLOT.store(on, Ordering::SeqCst);
    }

    pub(crate) fn drop_delay_slot() -> bool {
        DROP_DELAY_SLOT.load(Ordering::SeqCst)
    }
}

#[cfg(not(feature = "fault-injection"))]
mod fault {
    pub(crate) fn drop_delay_slot() -> bool {
        false
    }
}

/// Which branch format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BranchFormat {
    /// `Bicc` (disp22).
    Bicc,
    /// `BPcc` (disp19, with a cc field and prediction bit).
    BPcc,
    /// `BPr` (branch on register contents, disp16).
    BPr,
    /// `FBfcc` (disp22).
    FBfcc,
    /// `FBPfcc` (disp19).
    FBPfcc,
}

impl BranchFormat {
    /// Bits of the displacement field (in words).
    #[must_use]
    pub fn disp_bits(self) -> u32 {
        match self {
            Self::Bicc | Self::FBfcc => 22,
            Self::BPcc | Self::FBPfcc => 19,
            Self::BPr => 16,
        }
    }
}

/// What an instruction word is, as far as splicing cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// `call disp30`.
    Call {
        /// The callee.
        target: u64,
    },
    /// A conditional or unconditional PC-relative branch.
    Branch {
        /// Its format.
        format: BranchFormat,
        /// The condition field (for BPr, `rcond`).
        cond: u8,
        /// The annul bit.
        annul: bool,
        /// The target.
        target: u64,
    },
    /// `jmpl rs1 + op2, rd` (`jmp`, `ret`, `retl`, indirect calls).
    Jmpl {
        /// The link register.
        rd: u8,
        /// The base register.
        rs1: u8,
        /// The index register, when not an immediate.
        rs2: Option<u8>,
    },
    /// `return rs1 + op2` (v9: restore and jump).
    Return,
    /// `sethi imm22, rd` (with rd = 0 and imm = 0: `nop`).
    Sethi,
    /// `save`.
    Save,
    /// `restore`.
    Restore,
    /// `rd %pc, rd`: reads the address it sits at.
    ReadPc,
    /// `Tcc`: a trap.
    Trap,
    /// `done`/`retry`: return from a trap.
    DoneRetry,
    /// `illtrap` or a reserved format-2 opcode.
    IllTrap,
    /// Any other arithmetic, logical, load, store, state-register or FP instruction:
    /// not a control transfer and not PC-relative.
    Other,
}

/// A decoded instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Insn {
    /// Its address.
    pub addr: u64,
    /// Its word.
    pub word: u32,
    /// What it is.
    pub kind: Kind,
}

fn sext(v: u32, bits: u32) -> i64 {
    let shift = 64 - bits;
    (i64::from(v) << shift) >> shift
}

fn target(addr: u64, disp_words: i64) -> u64 {
    addr.wrapping_add((disp_words * 4) as u64)
}

/// Decodes one word at `addr`.
#[must_use]
pub fn decode(addr: u64, word: u32) -> Insn {
    let op = word >> 30;
    let kind = match op {
        1 => Kind::Call {
            target: target(addr, sext(word & 0x3fff_ffff, 30)),
        },
        0 => {
            let op2 = (word >> 22) & 7;
            let annul = word & (1 << 29) != 0;
            let cond = ((word >> 25) & 0xf) as u8;
            let branch = |format: BranchFormat, disp: i64| Kind::Branch {
                format,
                cond,
                annul,
                target: target(addr, disp),
            };
            match op2 {
                1 => branch(BranchFormat::BPcc, sext(word & 0x7_ffff, 19)),
                2 => branch(BranchFormat::Bicc, sext(word & 0x3f_ffff, 22)),
                3 if word & (1 << 28) == 0 => {
                    let d16 = ((word >> 20) & 3) << 14 | (word & 0x3fff);
                    Kind::Branch {
                        format: BranchFormat::BPr,
                        cond: ((word >> 25) & 7) as u8,
                        annul,
                        target: target(addr, sext(d16, 16)),
                    }
                }
                4 => Kind::Sethi,
                5 => branch(BranchFormat::FBPfcc, sext(word & 0x7_ffff, 19)),
                6 => branch(BranchFormat::FBfcc, sext(word & 0x3f_ffff, 22)),
                _ => Kind::IllTrap,
            }
        }
        2 => {
            let op3 = (word >> 19) & 0x3f;
            let rd = ((word >> 25) & 0x1f) as u8;
            let rs1 = ((word >> 14) & 0x1f) as u8;
            let imm = word & (1 << 13) != 0;
            match op3 {
                0x38 => Kind::Jmpl {
                    rd,
                    rs1,
                    rs2: (!imm).then_some((word & 0x1f) as u8),
                },
                0x39 => Kind::Return,
                0x3c => Kind::Save,
                0x3d => Kind::Restore,
                0x3a => Kind::Trap,
                0x3e => Kind::DoneRetry,
                // rd %pc: rdasr with rs1 = 5.
                0x28 if rs1 == 5 => Kind::ReadPc,
                _ => Kind::Other,
            }
        }
        _ => Kind::Other,
    };
    Insn { addr, word, kind }
}

impl Insn {
    /// Whether it is a delayed control transfer (its next word is a delay slot).
    #[must_use]
    pub fn is_dcti(&self) -> bool {
        matches!(
            self.kind,
            Kind::Call { .. } | Kind::Branch { .. } | Kind::Jmpl { .. } | Kind::Return
        )
    }

    /// Whether the delay slot runs every time this DCTI runs (false: annulled, so it
    /// runs only when the branch is taken, or never for `ba,a`/`bn,a`).
    #[must_use]
    pub fn delay_slot_always_runs(&self) -> bool {
        match self.kind {
            Kind::Branch { annul, .. } => !annul,
            _ => self.is_dcti(),
        }
    }

    /// Whether it is a branch whose outcome depends on a condition (not `ba`/`bn`,
    /// `fba`/`fbn`; every BPr is conditional).
    #[must_use]
    pub fn is_conditional(&self) -> bool {
        match self.kind {
            Kind::Branch {
                format: BranchFormat::BPr,
                ..
            } => true,
            Kind::Branch { cond, .. } => cond & 7 != 0,
            _ => false,
        }
    }

    /// The PC-relative target of a branch or call.
    #[must_use]
    pub fn direct_target(&self) -> Option<u64> {
        match self.kind {
            Kind::Call { target } | Kind::Branch { target, .. } => Some(target),
            _ => None,
        }
    }
}

// ---- the encoder ----

/// `nop` (`sethi 0, %g0`).
pub const NOP: u32 = 0x0100_0000;
/// `%g0`.
pub const G0: u8 = 0;
/// `%o6`, the stack pointer.
pub const SP: u8 = 14;
/// `%o7`, the link register of `call`.
pub const O7: u8 = 15;
/// `%l0`.
pub const L0: u8 = 16;
/// `%l1`.
pub const L1: u8 = 17;

fn simm13(v: i32) -> u32 {
    (v as u32) & 0x1fff
}

fn fmt3_imm(op: u32, op3: u32, rd: u8, rs1: u8, imm: i32) -> u32 {
    op << 30
        | u32::from(rd & 0x1f) << 25
        | op3 << 19
        | u32::from(rs1 & 0x1f) << 14
        | 1 << 13
        | simm13(imm)
}

/// `sethi %hi(value), rd` (bits 31..10 of a 32-bit value).
#[must_use]
pub fn enc_sethi(value: u32, rd: u8) -> u32 {
    u32::from(rd & 0x1f) << 25 | 4 << 22 | value >> 10
}

/// `or rs1, simm13, rd`.
#[must_use]
pub fn enc_or_imm(rs1: u8, imm: i32, rd: u8) -> u32 {
    fmt3_imm(2, 0x02, rd, rs1, imm)
}

/// `add rs1, simm13, rd`.
#[must_use]
pub fn enc_add_imm(rs1: u8, imm: i32, rd: u8) -> u32 {
    fmt3_imm(2, 0x00, rd, rs1, imm)
}

/// `jmpl rs1 + simm13, rd`.
#[must_use]
pub fn enc_jmpl(rs1: u8, imm: i32, rd: u8) -> u32 {
    fmt3_imm(2, 0x38, rd, rs1, imm)
}

/// `save rs1, simm13, rd`.
#[must_use]
pub fn enc_save(rs1: u8, imm: i32, rd: u8) -> u32 {
    fmt3_imm(2, 0x3c, rd, rs1, imm)
}

/// `restore %g0, %g0, %g0`.
#[must_use]
pub fn enc_restore() -> u32 {
    2 << 30 | 0x3d << 19
}

/// `ldx [rs1 + simm13], rd`.
#[must_use]
pub fn enc_ldx(rs1: u8, imm: i32, rd: u8) -> u32 {
    fmt3_imm(3, 0x0b, rd, rs1, imm)
}

/// `stx rd, [rs1 + simm13]`.
#[must_use]
pub fn enc_stx(rd: u8, rs1: u8, imm: i32) -> u32 {
    fmt3_imm(3, 0x0e, rd, rs1, imm)
}

/// `ba,a` from `from` to `to`, when in reach.
#[must_use]
pub fn enc_ba_a(from: u64, to: u64) -> Option<u32> {
    let disp = disp_words(from, to, 22)?;
    Some(1 << 29 | 8 << 25 | 2 << 22 | disp)
}

/// The displacement in words from `from` to `to` as a `bits`-bit field, when it fits.
fn disp_words(from: u64, to: u64, bits: u32) -> Option<u32> {
    let delta = to.wrapping_sub(from) as i64;
    if delta % 4 != 0 {
        return None;
    }
    let words = delta / 4;
    let half = 1i64 << (bits - 1);
    (-half..half)
        .contains(&words)
        .then_some((words as u32) & ((1u32 << bits) - 1))
}

/// `insn` (a branch) re-encoded at `at` with its target moved to `to`.
fn retarget_branch(insn: &Insn, at: u64, to: u64) -> Option<u32> {
    let Kind::Branch { format, .. } = insn.kind else {
        return None;
    };
    let disp = disp_words(at, to, format.disp_bits())?;
    Some(match format {
        BranchFormat::Bicc | BranchFormat::FBfcc => insn.word & !0x3f_ffff | disp,
        BranchFormat::BPcc | BranchFormat::FBPfcc => insn.word & !0x7_ffff | disp,
        BranchFormat::BPr => insn.word & !(3 << 20 | 0x3fff) | (disp >> 14) << 20 | (disp & 0x3fff),
    })
}

fn lo10(v: u32) -> i32 {
    (v & 0x3ff) as i32
}

// ---- the planner ----

/// Why a point cannot be spliced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, thiserror::Error)]
pub enum SparcRefusal {
    /// Outside the analysed text, or not word-aligned.
    #[error("outside the text or not word-aligned")]
    OutsideText,
    /// An `illtrap` or reserved opcode.
    #[error("illtrap or reserved opcode")]
    IllTrap,
    /// `rd %pc` reads its own address.
    #[error("reads %pc")]
    ReadsPc,
    /// A trap instruction (`Tcc`): its trap state would record the patch address.
    #[error("trap instruction (Tcc)")]
    Trap,
    /// `done`/`retry` return from a trap; never relocated.
    #[error("done/retry")]
    DoneRetry,
    /// A delay-slot instruction that is also a branch target: it runs without its
    /// DCTI, so a probe at the DCTI would miscount it.
    #[error("delay-slot instruction is a branch target")]
    DelaySlotIsBranchTarget,
    /// The delay slot of `ba,a` or `bn,a`: it never runs.
    #[error("delay slot of ba,a/bn,a (never runs)")]
    AnnulledDelaySlot,
    /// A DCTI in a delay slot (a DCTI couple), or one whose delay slot holds a DCTI.
    #[error("DCTI couple")]
    DctiCouple,
    /// The delay slot to relocate with the DCTI cannot be relocated.
    #[error("delay slot cannot be relocated ({0})")]
    DelaySlotNotRelocatable(&'static str),
    /// `jmpl rs1 + rs2, rd` with `rd` among its sources.
    #[error("indirect call whose address uses its link register")]
    LinkRegisterIsSource,
}

/// Where and how a point is spliced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparcSite {
    /// The instruction probed.
    pub point: u64,
    /// The word the splice replaces (the point, or its DCTI for a delay slot).
    pub at: u64,
    /// The relocated instructions: the one at `at`, and its delay slot for a DCTI.
    pub insns: Vec<Insn>,
    /// The probe runs on the taken path of the relocated branch (the point is the delay
    /// slot of a conditional branch that annuls it).
    pub probe_when_taken: bool,
}

/// The text the planner works on: words by address and every possible branch target.
#[derive(Debug, Clone)]
pub struct SparcText {
    base: u64,
    words: Vec<u32>,
    targets: BTreeSet<u64>,
}

impl SparcText {
    /// The text at `base` (big-endian words), with branch targets from its direct
    /// branches and calls plus every word-aligned text address found as a 32- or 64-bit
    /// big-endian value in `data` (jump tables, function pointers: a conservative
    /// over-approximation).
    #[must_use]
    pub fn new(base: u64, text: &[u8], data: &[&[u8]]) -> Self {
        let words: Vec<u32> = text
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let end = base + 4 * words.len() as u64;
        let in_text = |a: u64| a >= base && a < end && a.is_multiple_of(4);
        let mut targets = BTreeSet::new();
        for (i, &w) in words.iter().enumerate() {
            if let Some(t) = decode(base + 4 * i as u64, w).direct_target() {
                if in_text(t) {
                    targets.insert(t);
                }
            }
        }
        for bytes in data {
            for c in bytes.chunks_exact(4) {
                let v = u64::from(u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                if in_text(v) {
                    targets.insert(v);
                }
            }
            for c in bytes.chunks_exact(8) {
                let v = u64::from_be_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
                if in_text(v) {
                    targets.insert(v);
                }
            }
        }
        Self {
            base,
            words,
            targets,
        }
    }

    /// The instruction at `addr`.
    #[must_use]
    pub fn insn(&self, addr: u64) -> Option<Insn> {
        if addr < self.base || !addr.is_multiple_of(4) {
            return None;
        }
        let i = usize::try_from((addr - self.base) / 4).ok()?;
        self.words.get(i).map(|&w| decode(addr, w))
    }

    /// Whether some branch, call or data word may transfer control to `addr`.
    #[must_use]
    pub fn is_branch_target(&self, addr: u64) -> bool {
        self.targets.contains(&addr)
    }

    /// Whether `addr` is the delay slot of the instruction before it.
    #[must_use]
    pub fn in_delay_slot(&self, addr: u64) -> bool {
        addr.checked_sub(4)
            .and_then(|a| self.insn(a))
            .is_some_and(|i| i.is_dcti())
    }
}

/// Why an instruction cannot be relocated at all.
fn not_relocatable(insn: &Insn) -> Option<SparcRefusal> {
    match insn.kind {
        Kind::IllTrap => Some(SparcRefusal::IllTrap),
        Kind::ReadPc => Some(SparcRefusal::ReadsPc),
        Kind::Trap => Some(SparcRefusal::Trap),
        Kind::DoneRetry => Some(SparcRefusal::DoneRetry),
        Kind::Jmpl { rd, rs1, rs2 } if rd != G0 && (rs1 == rd || rs2 == Some(rd)) => {
            Some(SparcRefusal::LinkRegisterIsSource)
        }
        _ => None,
    }
}

/// Checks a DCTI and its delay slot for relocation as a pair.
fn pair(text: &SparcText, dcti: Insn) -> Result<Vec<Insn>, SparcRefusal> {
    if let Some(r) = not_relocatable(&dcti) {
        return Err(r);
    }
    let slot = text.insn(dcti.addr + 4).ok_or(SparcRefusal::OutsideText)?;
    if slot.is_dcti() {
        return Err(SparcRefusal::DctiCouple);
    }
    if let Some(r) = not_relocatable(&slot) {
        return Err(SparcRefusal::DelaySlotNotRelocatable(match r {
            SparcRefusal::ReadsPc => "reads %pc",
            SparcRefusal::Trap => "trap",
            SparcRefusal::DoneRetry => "done/retry",
            _ => "illtrap",
        }));
    }
    Ok(vec![dcti, slot])
}

/// Decides how to splice a probe at `addr`.
///
/// # Errors
/// The reason the point cannot be spliced.
pub fn plan(text: &SparcText, addr: u64) -> Result<SparcSite, SparcRefusal> {
    let insn = text.insn(addr).ok_or(SparcRefusal::OutsideText)?;
    if text.in_delay_slot(addr) {
        let dcti = text.insn(addr - 4).ok_or(SparcRefusal::OutsideText)?;
        if insn.is_dcti() || text.in_delay_slot(addr - 4) {
            return Err(SparcRefusal::DctiCouple);
        }
        if text.is_branch_target(addr) {
            return Err(SparcRefusal::DelaySlotIsBranchTarget);
        }
        let probe_when_taken = !dcti.delay_slot_always_runs();
        if probe_when_taken && !dcti.is_conditional() {
            return Err(SparcRefusal::AnnulledDelaySlot);
        }
        let insns = pair(text, dcti)?;
        return Ok(SparcSite {
            point: addr,
            at: dcti.addr,
            insns,
            probe_when_taken,
        });
    }
    let insns = if insn.is_dcti() {
        pair(text, insn)?
    } else {
        if let Some(r) = not_relocatable(&insn) {
            return Err(r);
        }
        vec![insn]
    };
    Ok(SparcSite {
        point: addr,
        at: addr,
        insns,
        probe_when_taken: false,
    })
}

// ---- patches ----

/// Errors of building a patch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SparcPatchError {
    /// An address that must be built with `sethi`/`or` is not below 4 GiB.
    #[error("{0:#x} is not a 32-bit address (only -mcmodel=medlow layouts are supported)")]
    Not32Bit(u64),
    /// The patch is beyond `ba,a` reach of the splice and no springboard was given, or
    /// the springboard is out of reach too.
    #[error("the patch at {patch:#x} is out of ba,a reach of {at:#x} and no springboard in reach was given")]
    OutOfReach {
        /// The splice.
        at: u64,
        /// The patch.
        patch: u64,
    },
    /// A site with no instruction, or more than a DCTI and its delay slot.
    #[error("malformed site")]
    BadSite,
    /// A trap at a DCTI counts the DCTI's executions, not those of the delay slot it
    /// annuls.
    #[error("a trap at the branch cannot count the delay slot it annuls")]
    TrapAtAnnullingBranch,
}

/// A built SPARC splice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparcPatch {
    /// The patch code (big-endian words), at the patch address.
    pub code: Vec<u8>,
    /// The word to write at the site (`ba,a` to the patch or the springboard).
    pub splice: [u8; 4],
    /// The springboard code, when one is used, to write at the springboard address.
    pub springboard: Option<Vec<u8>>,
}

fn addr32(a: u64) -> Result<u32, SparcPatchError> {
    u32::try_from(a).map_err(|_| SparcPatchError::Not32Bit(a))
}

/// Appends a jump from `words`' next slot (at `base + 4 * len`) to `to`: `ba,a` when in
/// reach, otherwise the [`long_jump`].
fn push_jump(words: &mut Vec<u32>, base: u64, to: u64) -> Result<(), SparcPatchError> {
    let here = base + 4 * words.len() as u64;
    if let Some(w) = enc_ba_a(here, to) {
        words.push(w);
        return Ok(());
    }
    words.extend(long_jump(to)?);
    Ok(())
}

/// `stx %l0, [%sp + 2039]; sethi %hi(to), %l0; jmpl %l0 + %lo(to), %g0; ldx [%sp + 2039], %l0`.
///
/// # Errors
/// `to` is not a 32-bit address.
pub fn long_jump(to: u64) -> Result<[u32; 4], SparcPatchError> {
    let t = addr32(to)?;
    Ok([
        enc_stx(L0, SP, SPILL_L1),
        enc_sethi(t, L0),
        enc_jmpl(L0, lo10(t), G0),
        enc_ldx(SP, SPILL_L1, L0),
    ])
}

/// Builds the patch at `patch` for `site`: a 64-bit counter increment at `counter`
/// (with `%l0`/`%l1` kept below the stack pointer meanwhile), the relocated
/// instruction(s), the jump(s) back;
/// and the splice word, through `springboard` (an address in `ba,a` reach of the site,
/// with room for 4 words) when the patch is out of reach.
///
/// # Errors
/// Addresses that are not 32-bit, a patch out of reach without a usable springboard.
pub fn generate(
    site: &SparcSite,
    patch: u64,
    counter: u64,
    springboard: Option<u64>,
) -> Result<SparcPatch, SparcPatchError> {
    let c = addr32(counter)?;
    let count = [
        enc_stx(L0, SP, SPILL_L0),
        enc_stx(L1, SP, SPILL_L1),
        enc_sethi(c, L0),
        enc_ldx(L0, lo10(c), L1),
        enc_add_imm(L1, 1, L1),
        enc_stx(L1, L0, lo10(c)),
        enc_ldx(SP, SPILL_L0, L0),
        enc_ldx(SP, SPILL_L1, L1),
    ];
    let mut w: Vec<u32> = Vec::new();
    if site.probe_when_taken {
        relocate(&mut w, patch, site, &count)?;
    } else {
        w.extend(count);
        relocate(&mut w, patch, site, &[])?;
    }
    let code = w.iter().flat_map(|x| x.to_be_bytes()).collect();
    let (splice, springboard_code) = match enc_ba_a(site.at, patch) {
        Some(word) => (word, None),
        None => {
            let sb = springboard.ok_or(SparcPatchError::OutOfReach { at: site.at, patch })?;
            let word =
                enc_ba_a(site.at, sb).ok_or(SparcPatchError::OutOfReach { at: site.at, patch })?;
            let code = long_jump(patch)?
                .iter()
                .flat_map(|x| x.to_be_bytes())
                .collect();
            (word, Some(code))
        }
    };
    Ok(SparcPatch {
        code,
        splice: splice.to_be_bytes(),
        springboard: springboard_code,
    })
}

/// The out-of-line copy of a trap probe at `site.at` (a breakpoint there, resumed at the
/// copy): the relocated instruction(s) and the jumps back, as big-endian bytes at `at`.
///
/// # Errors
/// Addresses that are not 32-bit; a delay-slot point its branch annuls (the trap would
/// count the branch).
pub fn out_of_line(site: &SparcSite, at: u64) -> Result<Vec<u8>, SparcPatchError> {
    if site.probe_when_taken {
        return Err(SparcPatchError::TrapAtAnnullingBranch);
    }
    let mut w = Vec::new();
    relocate(&mut w, at, site, &[])?;
    Ok(w.iter().flat_map(|x| x.to_be_bytes()).collect())
}

/// Appends the relocated instruction(s) of `site` and the jumps back to `w` (which sits
/// at `base`); `taken` goes at the start of a relocated branch's taken path.
fn relocate(
    w: &mut Vec<u32>,
    base: u64,
    site: &SparcSite,
    taken: &[u32],
) -> Result<(), SparcPatchError> {
    let (first, slot) = match site.insns.as_slice() {
        [one] => (*one, None),
        [dcti, slot] => (*dcti, Some(*slot)),
        _ => return Err(SparcPatchError::BadSite),
    };
    let Some(slot) = slot else {
        w.push(first.word);
        return push_jump(w, base, first.addr + 4);
    };
    let slot_word = if fault::drop_delay_slot() {
        NOP
    } else {
        slot.word
    };
    let after = first.addr + 8;
    // Only a branch has a taken path to put a probe on.
    if !taken.is_empty() && !matches!(first.kind, Kind::Branch { .. }) {
        return Err(SparcPatchError::BadSite);
    }
    match first.kind {
        Kind::Branch { target, .. } => {
            // branch' L_t; delay; <jump to after>; L_t: <jump to target>
            let branch_at = base + 4 * w.len() as u64;
            let mut fall = Vec::new();
            push_jump(&mut fall, branch_at + 8, after)?;
            let taken_at = branch_at + 8 + 4 * fall.len() as u64;
            let b = retarget_branch(&first, branch_at, taken_at).ok_or(SparcPatchError::BadSite)?;
            w.push(b);
            w.push(slot_word);
            w.extend(fall);
            w.extend(taken);
            push_jump(w, base, target)
        }
        Kind::Call { target } => {
            let a = addr32(first.addr)?;
            w.push(enc_sethi(a, O7));
            w.push(enc_or_imm(O7, lo10(a), O7));
            w.push(slot_word);
            push_jump(w, base, target)
        }
        Kind::Jmpl { rd, .. } => {
            if rd != G0 {
                let a = addr32(first.addr)?;
                w.push(enc_sethi(a, rd));
                w.push(enc_or_imm(rd, lo10(a), rd));
                // The same jump without the link.
                w.push(first.word & !(0x1f << 25));
            } else {
                w.push(first.word);
            }
            w.push(slot_word);
            Ok(())
        }
        Kind::Return => {
            w.push(first.word);
            w.push(slot_word);
            Ok(())
        }
        _ => Err(SparcPatchError::BadSite),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Words from sparc64-linux-gnu-objdump of the mini-kernel.
    #[test]
    fn decodes_the_control_transfers_gcc_emits() {
        let call = decode(0x100_0a4c, 0x7fff_fffa);
        let bleu = decode(0x100_0a40, 0x0840_0012);
        let ret = decode(0x100_0a88, 0x81cf_e008);
        let jmp = decode(0x100_0d40, 0x81c0_4000);
        let save = decode(0x100_0a34, 0x9de3_bf50);
        let nop = decode(0, NOP);

        assert_eq!(call.kind, Kind::Call { target: 0x100_0a34 });
        assert_eq!(
            bleu.kind,
            Kind::Branch {
                format: BranchFormat::BPcc,
                cond: 4,
                annul: false,
                target: 0x100_0a88
            }
        );
        assert_eq!(ret.kind, Kind::Return);
        assert_eq!(
            jmp.kind,
            Kind::Jmpl {
                rd: 0,
                rs1: 1,
                rs2: Some(0)
            }
        );
        assert_eq!(save.kind, Kind::Save);
        assert_eq!(nop.kind, Kind::Sethi);
        assert!(call.is_dcti() && bleu.is_dcti() && ret.is_dcti() && jmp.is_dcti());
        assert!(!save.is_dcti());
    }

    #[test]
    fn encodes_what_the_assembler_does() {
        // save %sp, -176, %sp / restore / ret / ba,a .+8 / sethi %hi(0x1000000), %g1
        assert_eq!(enc_save(SP, -176, SP), 0x9de3_bf50);
        assert_eq!(enc_restore(), 0x81e8_0000);
        assert_eq!(enc_jmpl(31, 8, G0), 0x81c7_e008);
        assert_eq!(enc_ba_a(0x1000, 0x1008), Some(0x3080_0002));
        assert_eq!(enc_sethi(0x100_0000, 1), 0x0300_4000);
        // ldx [%l0 + 8], %l1 / stx %l1, [%l0 + 8] / or %o7, 0x10, %o7
        assert_eq!(enc_ldx(L0, 8, L1), 0xe25c_2008);
        assert_eq!(enc_stx(L1, L0, 8), 0xe274_2008);
        assert_eq!(enc_or_imm(O7, 0x10, O7), 0x9e13_e010);
    }

    #[test]
    fn ba_a_reach_is_8_mib() {
        assert!(enc_ba_a(0x100_0000, 0x100_0000 + (8 << 20) - 4).is_some());
        assert!(enc_ba_a(0x100_0000, 0x100_0000 + (8 << 20)).is_none());
        assert!(enc_ba_a(0x100_0000 + (8 << 20), 0x100_0000).is_some());
        assert!(enc_ba_a(0x100_0000 + (8 << 20) + 4, 0x100_0000).is_none());
    }

    #[test]
    fn retargeted_branches_decode_to_the_new_target() {
        for word in [0x0840_0012u32, 0x1280_0005, 0x02c2_4003, 0x2b80_0007] {
            let insn = decode(0x4000, word);
            let w = retarget_branch(&insn, 0x9000, 0x8ff0).unwrap();
            let back = decode(0x9000, w);
            assert_eq!(back.direct_target(), Some(0x8ff0), "{word:#x}");
            let (
                Kind::Branch {
                    cond: c0,
                    annul: a0,
                    ..
                },
                Kind::Branch {
                    cond: c1,
                    annul: a1,
                    ..
                },
            ) = (insn.kind, back.kind)
            else {
                panic!("{word:#x} is not a branch");
            };
            assert_eq!((c0, a0), (c1, a1));
        }
    }

    fn text(words: &[u32], data: &[&[u8]]) -> SparcText {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_be_bytes()).collect();
        SparcText::new(0x1000, &bytes, data)
    }

    #[test]
    fn planner_pairs_dctis_and_refuses_what_it_must() {
        // 0x1000 add; 0x1004 be,a 0x1010; 0x1008 add (annulled slot); 0x100c call 0x1000;
        // 0x1010 add (slot, a branch target); 0x1014 retl; 0x1018 nop; 0x101c rd %pc, %g1
        let add = enc_add_imm(8, 1, 8);
        let words = [
            add,
            0x2280_0003,
            add,
            0x7fff_fffd,
            add,
            enc_jmpl(O7, 8, G0),
            NOP,
            0x8341_4000,
        ];
        let t = text(&words, &[]);

        assert_eq!(plan(&t, 0x1000).unwrap().insns.len(), 1);
        assert_eq!(plan(&t, 0x1004).unwrap().insns.len(), 2);
        let annulled = plan(&t, 0x1008).unwrap();
        assert!(annulled.probe_when_taken && annulled.at == 0x1004);
        assert_eq!(plan(&t, 0x1010), Err(SparcRefusal::DelaySlotIsBranchTarget));
        let slot = plan(&t, 0x1018).unwrap();
        assert_eq!((slot.point, slot.at), (0x1018, 0x1014));
        assert_eq!(plan(&t, 0x101c), Err(SparcRefusal::ReadsPc));
        assert_eq!(plan(&t, 0x1002), Err(SparcRefusal::OutsideText));
    }

    #[test]
    fn the_delay_slot_of_ba_a_never_runs_and_is_refused() {
        let t = text(&[0x3080_0002, enc_add_imm(8, 1, 8), NOP], &[]);

        assert_eq!(plan(&t, 0x1004), Err(SparcRefusal::AnnulledDelaySlot));
        assert!(!plan(&t, 0x1000).unwrap().probe_when_taken);
    }

    #[test]
    fn data_words_pointing_into_text_are_branch_targets() {
        let words = [NOP, enc_jmpl(O7, 8, G0), NOP];
        let table = 0x1008u32.to_be_bytes();
        let t = text(&words, &[&table]);

        assert_eq!(plan(&t, 0x1008), Err(SparcRefusal::DelaySlotIsBranchTarget));
    }

    #[test]
    fn a_far_patch_needs_a_springboard_in_reach() {
        let t = text(&[enc_add_imm(8, 1, 8)], &[]);
        let site = plan(&t, 0x1000).unwrap();
        let far = 0x1000_0000;

        let without = generate(&site, far, far - 8, None);
        let with = generate(&site, far, far - 8, Some(0x2000)).unwrap();

        assert!(matches!(without, Err(SparcPatchError::OutOfReach { .. })));
        assert_eq!(with.splice, enc_ba_a(0x1000, 0x2000).unwrap().to_be_bytes());
        let sb: Vec<u8> = long_jump(far)
            .unwrap()
            .iter()
            .flat_map(|w| w.to_be_bytes())
            .collect();
        assert_eq!(with.springboard, Some(sb));
    }
}
