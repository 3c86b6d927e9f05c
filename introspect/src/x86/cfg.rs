//! Basic blocks and the control-flow graph of one function.
//!
//! Blocks end at branches, returns, tail calls and undecodable bytes, and start at branch
//! targets. Calls do not end a block: they fall through, and the graph lists them as call
//! edges. A direct branch into the middle of an instruction marks the function as
//! inconsistently decoded instead of failing.

use super::decode::{Flow, Insn};

/// One basic block: the instructions `first..end` (indices into [`Cfg::insns`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BasicBlock {
    /// Index of the first instruction.
    pub first: u32,
    /// Index one past the last instruction.
    pub end: u32,
    /// How the block is left.
    pub exit: BlockExit,
}

/// How a basic block is left; block successors are block indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockExit {
    /// Falls into the next block (which starts at a branch target).
    FallThrough {
        /// The next block.
        next: u32,
    },
    /// Unconditional direct jump inside the function.
    Jump {
        /// The target block.
        target: u32,
    },
    /// Conditional direct jump inside the function.
    CondJump {
        /// The taken block.
        target: u32,
        /// The fall-through block, if the function goes on after the branch.
        next: Option<u32>,
    },
    /// Leaves the function (return, tail call) or stops (undecodable bytes); what is live
    /// there is in the last instruction's uses.
    Leave,
    /// Unknown successors: indirect jump, direct branch to a non-boundary, or execution
    /// running past the end of the function. Everything is live there.
    Unknown,
}

/// The control-flow graph of one function.
#[derive(Clone, Debug, Default)]
pub struct Cfg {
    start: u64,
    end: u64,
    insns: Vec<Insn>,
    blocks: Vec<BasicBlock>,
    bad_targets: Vec<(u64, u64)>,
}

impl Cfg {
    /// Builds the graph of the function `[start, end)` from its linear-sweep decoding.
    #[must_use]
    pub fn build(start: u64, end: u64, insns: Vec<Insn>) -> Self {
        let n = insns.len();
        let mut leader = vec![false; n + 1];
        let mut bad_targets = Vec::new();
        if n > 0 {
            leader[0] = true;
        }
        for (i, insn) in insns.iter().enumerate() {
            match insn.flow {
                Flow::Jump { target } | Flow::CondJump { target } => {
                    match index_at(&insns, target) {
                        Some(t) => leader[t] = true,
                        None => bad_targets.push((insn.addr, target)),
                    }
                    leader[i + 1] = true;
                }
                Flow::TailJump { .. }
                | Flow::CondTailJump { .. }
                | Flow::IndirectJump
                | Flow::Return
                | Flow::Invalid => leader[i + 1] = true,
                Flow::Next | Flow::Call { .. } | Flow::IndirectCall => {}
            }
        }
        let mut block_of = vec![0u32; n];
        let mut blocks: Vec<BasicBlock> = Vec::new();
        for i in 0..n {
            if leader[i] {
                blocks.push(BasicBlock {
                    first: i as u32,
                    end: i as u32,
                    exit: BlockExit::Unknown,
                });
            }
            block_of[i] = (blocks.len() - 1) as u32;
        }
        let starts: Vec<u32> = blocks.iter().map(|block| block.first).collect();
        for (b, block) in blocks.iter_mut().enumerate() {
            let last_exclusive = starts.get(b + 1).map_or(n, |&next| next as usize);
            block.end = last_exclusive as u32;
            let last = &insns[last_exclusive - 1];
            let next = (last_exclusive < n).then(|| block_of[last_exclusive]);
            let target_block = |t: u64| index_at(&insns, t).map(|i| block_of[i]);
            block.exit = match last.flow {
                Flow::Jump { target } => match target_block(target) {
                    Some(target) => BlockExit::Jump { target },
                    None => BlockExit::Unknown,
                },
                Flow::CondJump { target } => match target_block(target) {
                    Some(target) => BlockExit::CondJump { target, next },
                    None => BlockExit::Unknown,
                },
                Flow::TailJump { .. } | Flow::Return | Flow::Invalid => BlockExit::Leave,
                Flow::IndirectJump => BlockExit::Unknown,
                Flow::Next | Flow::Call { .. } | Flow::IndirectCall | Flow::CondTailJump { .. } => {
                    match next {
                        Some(next) => BlockExit::FallThrough { next },
                        None => BlockExit::Unknown,
                    }
                }
            };
        }
        Self {
            start,
            end,
            insns,
            blocks,
            bad_targets,
        }
    }

    /// The function's first address.
    #[must_use]
    pub fn start(&self) -> u64 {
        self.start
    }

    /// The address just past the function.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.end
    }

    /// The instructions in address order.
    #[must_use]
    pub fn insns(&self) -> &[Insn] {
        &self.insns
    }

    /// The basic blocks in address order.
    #[must_use]
    pub fn blocks(&self) -> &[BasicBlock] {
        &self.blocks
    }

    /// The instructions of block `b`.
    #[must_use]
    pub fn block_insns(&self, block: &BasicBlock) -> &[Insn] {
        &self.insns[block.first as usize..block.end as usize]
    }

    /// Direct branches (source, target) whose target lies inside the function but not at
    /// an instruction boundary: the linear sweep and the code disagree.
    #[must_use]
    pub fn bad_targets(&self) -> &[(u64, u64)] {
        &self.bad_targets
    }

    /// The index of the instruction starting exactly at `addr`.
    #[must_use]
    pub fn insn_index_at(&self, addr: u64) -> Option<usize> {
        index_at(&self.insns, addr)
    }

    /// The index of the instruction whose bytes contain `addr`.
    #[must_use]
    pub fn insn_index_containing(&self, addr: u64) -> Option<usize> {
        let i = self
            .insns
            .partition_point(|insn| insn.addr <= addr)
            .checked_sub(1)?;
        (addr < self.insns[i].end()).then_some(i)
    }

    /// The index of the block holding instruction `insn`.
    #[must_use]
    pub fn block_of_insn(&self, insn: usize) -> Option<usize> {
        let b = self
            .blocks
            .partition_point(|block| block.first as usize <= insn)
            .checked_sub(1)?;
        (insn < self.blocks[b].end as usize).then_some(b)
    }

    /// Calls made by the function: (call instruction's address, callee) for direct calls.
    pub fn call_edges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.insns.iter().filter_map(|insn| match insn.flow {
            Flow::Call { target } => Some((insn.addr, target)),
            _ => None,
        })
    }

    /// Every direct branch and call target, inside the function or not.
    pub fn branch_targets(&self) -> impl Iterator<Item = u64> + '_ {
        self.insns.iter().filter_map(|insn| insn.flow.target())
    }

    /// The successor blocks of block `b`.
    #[must_use]
    pub fn successors(&self, b: usize) -> [Option<u32>; 2] {
        match self.blocks.get(b).map(|block| block.exit) {
            Some(BlockExit::FallThrough { next }) => [Some(next), None],
            Some(BlockExit::Jump { target }) => [Some(target), None],
            Some(BlockExit::CondJump { target, next }) => [Some(target), next],
            _ => [None, None],
        }
    }
}

fn index_at(insns: &[Insn], addr: u64) -> Option<usize> {
    insns.binary_search_by_key(&addr, |insn| insn.addr).ok()
}

#[cfg(test)]
mod tests {
    use iced_x86::code_asm::*;

    use super::*;
    use crate::x86::decode::{AnalysisConfig, FunctionDecoder};

    const BASE: u64 = 0xffff_ffff_8100_0000;

    fn cfg_of(bytes: &[u8]) -> Cfg {
        let config = AnalysisConfig::new();
        let insns = FunctionDecoder::new(&config).decode(bytes, BASE);
        Cfg::build(BASE, BASE + bytes.len() as u64, insns)
    }

    #[test]
    fn straight_line_function_is_one_block() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(rax, rdi).unwrap();
        a.add(rax, rsi).unwrap();
        a.ret().unwrap();

        let cfg = cfg_of(&a.assemble(BASE).unwrap());

        assert_eq!(cfg.blocks().len(), 1);
        assert_eq!(cfg.blocks()[0].exit, BlockExit::Leave);
    }

    #[test]
    fn loop_back_edge_targets_loop_head() {
        let mut a = CodeAssembler::new(64).unwrap();
        let mut head = a.create_label();
        a.xor(eax, eax).unwrap();
        a.set_label(&mut head).unwrap();
        a.add(rax, rdi).unwrap();
        a.dec(rsi).unwrap();
        a.jne(head).unwrap();
        a.ret().unwrap();

        let cfg = cfg_of(&a.assemble(BASE).unwrap());

        assert_eq!(cfg.blocks().len(), 3);
        assert_eq!(cfg.blocks()[0].exit, BlockExit::FallThrough { next: 1 });
        assert_eq!(
            cfg.blocks()[1].exit,
            BlockExit::CondJump {
                target: 1,
                next: Some(2)
            }
        );
        assert_eq!(cfg.blocks()[2].exit, BlockExit::Leave);
    }

    #[test]
    fn if_else_diamond_has_four_blocks() {
        let mut a = CodeAssembler::new(64).unwrap();
        let mut other = a.create_label();
        let mut join = a.create_label();
        a.test(rdi, rdi).unwrap();
        a.je(other).unwrap();
        a.mov(eax, 1i32).unwrap();
        a.jmp(join).unwrap();
        a.set_label(&mut other).unwrap();
        a.mov(eax, 2i32).unwrap();
        a.set_label(&mut join).unwrap();
        a.ret().unwrap();

        let cfg = cfg_of(&a.assemble(BASE).unwrap());

        assert_eq!(cfg.blocks().len(), 4);
        assert_eq!(
            cfg.blocks()[0].exit,
            BlockExit::CondJump {
                target: 2,
                next: Some(1)
            }
        );
        assert_eq!(cfg.blocks()[1].exit, BlockExit::Jump { target: 3 });
        assert_eq!(cfg.blocks()[2].exit, BlockExit::FallThrough { next: 3 });
        assert_eq!(cfg.successors(0), [Some(2), Some(1)]);
    }

    #[test]
    fn call_does_not_end_block_and_is_a_call_edge() {
        let callee = 0xffff_ffff_8200_0000u64;
        let mut a = CodeAssembler::new(64).unwrap();
        a.call(callee).unwrap();
        a.ret().unwrap();

        let cfg = cfg_of(&a.assemble(BASE).unwrap());

        assert_eq!(cfg.blocks().len(), 1);
        assert_eq!(cfg.call_edges().collect::<Vec<_>>(), vec![(BASE, callee)]);
    }

    #[test]
    fn jump_into_middle_of_instruction_is_a_bad_target() {
        // jmp +1 lands inside the 10-byte `mov rax, imm64` that follows.
        let mut a = CodeAssembler::new(64).unwrap();
        a.jmp(BASE + 2 + 1).unwrap();
        a.mov(rax, 0x1122_3344_5566_7788u64).unwrap();
        a.ret().unwrap();
        let bytes = a.assemble(BASE).unwrap();

        let cfg = cfg_of(&bytes);

        assert_eq!(cfg.bad_targets(), &[(BASE, BASE + 3)]);
        assert_eq!(cfg.blocks()[0].exit, BlockExit::Unknown);
    }

    #[test]
    fn indirect_jump_has_unknown_successors() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.jmp(rax).unwrap();

        let cfg = cfg_of(&a.assemble(BASE).unwrap());

        assert_eq!(cfg.blocks()[0].exit, BlockExit::Unknown);
    }

    #[test]
    fn falling_off_the_end_is_unknown() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.call(0xffff_ffff_8200_0000u64).unwrap();

        let cfg = cfg_of(&a.assemble(BASE).unwrap());

        assert_eq!(cfg.blocks()[0].exit, BlockExit::Unknown);
    }

    #[test]
    fn containing_lookup_finds_instruction_from_inner_byte() {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(rax, 0x1122_3344_5566_7788u64).unwrap();
        a.ret().unwrap();

        let cfg = cfg_of(&a.assemble(BASE).unwrap());

        assert_eq!(cfg.insn_index_containing(BASE + 4), Some(0));
        assert_eq!(cfg.insn_index_at(BASE + 4), None);
        assert_eq!(cfg.insn_index_containing(BASE + 10), Some(1));
        assert_eq!(cfg.insn_index_containing(BASE + 11), None);
    }

    #[test]
    fn empty_function_has_no_blocks() {
        let cfg = cfg_of(&[]);

        assert!(cfg.blocks().is_empty());
    }
}
