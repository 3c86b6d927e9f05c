//! Register and status-flag liveness: backwards dataflow over a function's CFG.
//!
//! A register or flag is live at a point when some path from there may read it before
//! overwriting it. Where the analysis cannot see (indirect jumps, branches to
//! non-boundaries, running off the function's end) everything is live, so "dead" is
//! always safe to clobber.

use super::cfg::{BlockExit, Cfg};
use super::regs::LiveState;

/// Liveness at the entry and exit of every basic block of one function.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Liveness {
    live_in: Vec<LiveState>,
    live_out: Vec<LiveState>,
}

/// A block's transfer function: `live_in = gen ∪ (live_out − kill)`.
#[derive(Clone, Copy)]
struct Transfer {
    gen: LiveState,
    kill: LiveState,
}

impl Liveness {
    /// Solves liveness for `cfg`.
    #[must_use]
    pub fn compute(cfg: &Cfg) -> Self {
        let blocks = cfg.blocks();
        let transfers: Vec<Transfer> = blocks
            .iter()
            .map(|block| {
                cfg.block_insns(block).iter().rev().fold(
                    Transfer {
                        gen: LiveState::NONE,
                        kill: LiveState::NONE,
                    },
                    |t, insn| Transfer {
                        gen: insn.uses.union(t.gen.minus(insn.kills)),
                        kill: t.kill.union(insn.kills),
                    },
                )
            })
            .collect();
        let mut live_in = vec![LiveState::NONE; blocks.len()];
        let mut live_out = vec![LiveState::NONE; blocks.len()];
        // Sets only grow and are finite, so this terminates; reverse address order makes
        // most functions converge in two sweeps.
        let mut changed = true;
        while changed {
            changed = false;
            for b in (0..blocks.len()).rev() {
                let out = match blocks[b].exit {
                    BlockExit::Unknown => LiveState::ALL,
                    BlockExit::Leave => LiveState::NONE,
                    _ => cfg
                        .successors(b)
                        .iter()
                        .flatten()
                        .fold(LiveState::NONE, |acc, &s| {
                            acc.union(live_in.get(s as usize).copied().unwrap_or(LiveState::ALL))
                        }),
                };
                let t = transfers[b];
                let new_in = t.gen.union(out.minus(t.kill));
                if new_in != live_in[b] || out != live_out[b] {
                    live_in[b] = new_in;
                    live_out[b] = out;
                    changed = true;
                }
            }
        }
        Self { live_in, live_out }
    }

    /// What is live on entry to block `b` (everything, if `b` is out of range).
    #[must_use]
    pub fn block_entry(&self, b: usize) -> LiveState {
        self.live_in.get(b).copied().unwrap_or(LiveState::ALL)
    }

    /// What is live on exit from block `b` (everything, if `b` is out of range).
    #[must_use]
    pub fn block_exit(&self, b: usize) -> LiveState {
        self.live_out.get(b).copied().unwrap_or(LiveState::ALL)
    }

    /// What is live just before instruction `insn` (an index into [`Cfg::insns`]) runs:
    /// the state a patch spliced in place of that instruction may not clobber.
    /// Everything, if the index is out of range.
    #[must_use]
    pub fn before_insn(&self, cfg: &Cfg, insn: usize) -> LiveState {
        self.walk_back(cfg, insn, true)
    }

    /// What is live just after instruction `insn` completes (on its fall-through path
    /// and its branch paths together). Everything, if the index is out of range.
    #[must_use]
    pub fn after_insn(&self, cfg: &Cfg, insn: usize) -> LiveState {
        self.walk_back(cfg, insn, false)
    }

    fn walk_back(&self, cfg: &Cfg, insn: usize, include: bool) -> LiveState {
        let Some(b) = cfg.block_of_insn(insn) else {
            return LiveState::ALL;
        };
        let insns = cfg.insns();
        let end = cfg.blocks()[b].end as usize;
        let mut live = self.block_exit(b);
        for i in (insn..end).rev() {
            if i == insn && !include {
                break;
            }
            live = insns[i].uses.union(live.minus(insns[i].kills));
        }
        live
    }
}

#[cfg(test)]
mod tests {
    use iced_x86::code_asm::*;
    use iced_x86::Register;

    use super::*;
    use crate::x86::decode::{AnalysisConfig, FunctionDecoder};
    use crate::x86::regs::{RegSet, StatusFlags};

    const BASE: u64 = 0xffff_ffff_8100_0000;
    const THUNK: u64 = 0xffff_ffff_8200_0000;

    fn analyze(a: &mut CodeAssembler) -> (Cfg, Liveness) {
        let bytes = a.assemble(BASE).unwrap();
        let config = AnalysisConfig::new().with_return_thunk(THUNK);
        let insns = FunctionDecoder::new(&config).decode(&bytes, BASE);
        let cfg = Cfg::build(BASE, BASE + bytes.len() as u64, insns);
        let live = Liveness::compute(&cfg);
        (cfg, live)
    }

    fn regs(list: &[Register]) -> RegSet {
        RegSet::of(list)
    }

    const RETURN_REGS: &[Register] = &[
        Register::RAX,
        Register::RDX,
        Register::RBX,
        Register::RBP,
        Register::RSP,
        Register::R12,
        Register::R13,
        Register::R14,
        Register::R15,
    ];

    #[test]
    fn entry_of_add_function_needs_its_arguments_and_callee_saved() {
        // rax = rdi + rsi; ret
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(rax, rdi).unwrap();
        a.add(rax, rsi).unwrap();
        a.ret().unwrap();

        let (_, live) = analyze(&mut a);

        let expected = regs(RETURN_REGS)
            .minus(regs(&[Register::RAX]))
            .union(regs(&[Register::RDI, Register::RSI]));
        assert_eq!(live.block_entry(0).regs, expected);
        assert!(live.block_entry(0).flags.is_empty());
    }

    #[test]
    fn flags_live_between_cmp_and_jcc_only() {
        let mut a = CodeAssembler::new(64).unwrap();
        let mut skip = a.create_label();
        a.cmp(rdi, rsi).unwrap(); // 0
        a.mov(eax, 1i32).unwrap(); // 1: flags live across it
        a.jb(skip).unwrap(); // 2
        a.xor(eax, eax).unwrap(); // 3
        a.set_label(&mut skip).unwrap();
        a.jmp(THUNK).unwrap(); // 4: return through the thunk

        let (cfg, live) = analyze(&mut a);

        assert!(live.before_insn(&cfg, 0).flags.is_empty());
        assert_eq!(live.before_insn(&cfg, 1).flags, StatusFlags::CF);
        assert_eq!(live.before_insn(&cfg, 2).flags, StatusFlags::CF);
        assert!(live.after_insn(&cfg, 2).flags.is_empty());
        assert!(!live.before_insn(&cfg, 1).regs.contains(Register::RAX));
        assert!(live.before_insn(&cfg, 3).regs.contains(Register::RDX));
    }

    #[test]
    fn loop_keeps_accumulator_live_around_back_edge() {
        // rax = 0; do { rax += [rdi]; rdi += 8; } while (--rsi); ret
        let mut a = CodeAssembler::new(64).unwrap();
        let mut head = a.create_label();
        a.xor(eax, eax).unwrap();
        a.set_label(&mut head).unwrap();
        a.add(rax, qword_ptr(rdi)).unwrap();
        a.add(rdi, 8i32).unwrap();
        a.dec(rsi).unwrap();
        a.jne(head).unwrap();
        a.ret().unwrap();

        let (_, live) = analyze(&mut a);

        let loop_in = live.block_entry(1).regs;
        assert!(loop_in.contains(Register::RAX));
        assert!(loop_in.contains(Register::RDI));
        assert!(loop_in.contains(Register::RSI));
        assert!(!live.block_entry(0).regs.contains(Register::RAX));
        assert!(live.block_entry(1).flags.is_empty());
    }

    #[test]
    fn call_kills_caller_saved_so_they_are_dead_before_it() {
        // r10 set before a call and not used after: dead; rbx survives the call.
        let mut a = CodeAssembler::new(64).unwrap();
        a.call(0xffff_ffff_8300_0000u64).unwrap(); // 0
        a.mov(rax, rbx).unwrap(); // 1
        a.ret().unwrap(); // 2

        let (cfg, live) = analyze(&mut a);

        let before_call = live.before_insn(&cfg, 0);
        assert!(!before_call.regs.contains(Register::R10));
        assert!(before_call.regs.contains(Register::RBX));
        assert!(before_call.regs.contains(Register::RDI));
        assert!(before_call.flags.is_empty());
    }

    #[test]
    fn indirect_jump_makes_everything_live() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(ecx, 5i32).unwrap();
        a.jmp(rax).unwrap();

        let (cfg, live) = analyze(&mut a);

        assert_eq!(live.before_insn(&cfg, 1), LiveState::ALL);
        assert_eq!(
            live.before_insn(&cfg, 0).regs,
            RegSet::ALL.minus(regs(&[Register::RCX]))
        );
    }

    #[test]
    fn out_of_range_index_is_conservatively_all_live() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.ret().unwrap();

        let (cfg, live) = analyze(&mut a);

        assert_eq!(live.before_insn(&cfg, 7), LiveState::ALL);
    }
}
