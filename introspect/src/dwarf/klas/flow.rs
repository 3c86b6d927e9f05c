//! The disassembly side of KLAS join points: a forward dataflow over a function's
//! instructions that knows which registers point into which structs (DWARF facts, register
//! copies, loads of pointer members, `lea` of members and of global struct variables), and
//! reports every memory operand whose base points into a struct as a member access.
//!
//! Where paths join (branch targets), a register keeps what it points to only if every
//! incoming path agrees; loops are iterated to a fixpoint. Calls clobber caller-saved registers.

use std::collections::HashMap;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register,
};

use super::super::symtab::Symtab;
use super::super::{DebugInfo, DieRef};
use super::facts::{Fact, Globals, Layouts};
use super::Access;

use crate::x86::regs::DWARF_GPRS;

/// Registers a call may change (System V, which the kernel follows).
const CALLER_SAVED: [Register; 9] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RSI,
    Register::RDI,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
];

/// Passes over a function before giving up on a fixpoint (then joins forget everything).
const MAX_PASSES: usize = 8;

/// A member access found in the code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Site {
    pub addr: u64,
    pub access: Access,
    pub st: DieRef,
    pub path: String,
}

/// Where a register points: `bias` bytes into an instance of `st`; `array` when the instance
/// is an element of an array (offsets wrap at the element size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ptr {
    st: DieRef,
    bias: u64,
    array: bool,
}

/// 0..16 for a 64-bit general register (any width names its full register).
fn gpr(reg: Register) -> Option<usize> {
    let full = reg.full_register();
    full.is_gpr64().then(|| full.number())
}

/// What the pass knows about the registers at one point.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct State {
    points_to: [Option<Ptr>; 16],
    /// Address of the load that put a function-pointer member into the register.
    fn_from: [Option<u64>; 16],
}

impl State {
    fn clear(&mut self, reg: usize) {
        if let (Some(p), Some(f)) = (self.points_to.get_mut(reg), self.fn_from.get_mut(reg)) {
            *p = None;
            *f = None;
        }
    }

    /// What both paths agree on.
    fn meet(&self, other: &State) -> State {
        let mut out = self.clone();
        for r in 0..16 {
            if out.points_to[r] != other.points_to[r] {
                out.points_to[r] = None;
            }
            if out.fn_from[r] != other.fn_from[r] {
                out.fn_from[r] = None;
            }
        }
        out
    }
}

/// The register an indirect-branch thunk (`__x86_indirect_thunk_rax`) jumps through.
fn thunk_register(symbols: &Symtab<'_>, target: u64) -> Option<usize> {
    // Several names can share the address (`__x86_indirect_thunk_array` and `..._rax`).
    symbols
        .at(target)
        .find_map(|sym| crate::x86::thunk_register(sym.name).and_then(gpr))
}

fn falls_through(instr: &Instruction) -> bool {
    !matches!(
        instr.flow_control(),
        FlowControl::UnconditionalBranch
            | FlowControl::IndirectBranch
            | FlowControl::Return
            | FlowControl::Exception
    )
}

/// What one memory operand reaches.
struct MemHit {
    st: DieRef,
    hit: super::facts::MemberHit,
    /// The register now points into a struct at this byte offset (for `lea`).
    off: u64,
    array: bool,
}

/// One function's analysis.
pub(crate) struct Pass<'p, 'a> {
    pub info: &'p DebugInfo<'a>,
    pub layouts: &'p mut Layouts,
    pub symbols: &'p Symtab<'a>,
    pub facts: &'p [Fact],
    pub globals: &'p Globals,
}

impl Pass<'_, '_> {
    /// Decodes `code` (address, bytes) and returns the member accesses of every struct.
    pub(crate) fn run(&mut self, code: &[(u64, &[u8])]) -> Vec<Site> {
        let mut instrs = Vec::new();
        let mut entries = Vec::new();
        for &(addr, bytes) in code {
            entries.push(instrs.len());
            let mut decoder = Decoder::with_ip(64, bytes, addr, DecoderOptions::NONE);
            let mut instr = Instruction::default();
            while decoder.can_decode() {
                decoder.decode_out(&mut instr);
                instrs.push(instr);
            }
        }
        let at: HashMap<u64, usize> = instrs
            .iter()
            .enumerate()
            .map(|(i, ins)| (ins.ip(), i))
            .collect();
        let mut sources: Vec<Vec<usize>> = vec![Vec::new(); instrs.len()];
        for (i, ins) in instrs.iter().enumerate() {
            if matches!(
                ins.flow_control(),
                FlowControl::ConditionalBranch | FlowControl::UnconditionalBranch
            ) {
                if let Some(&t) = at.get(&ins.near_branch_target()) {
                    sources[t].push(i);
                }
            }
        }
        let mut factory = InstructionInfoFactory::new();
        let mut outs: Vec<Option<State>> = vec![None; instrs.len()];
        let mut converged = false;
        for _ in 0..MAX_PASSES {
            let mut changed = false;
            for i in 0..instrs.len() {
                let input = self.input(i, &instrs, &entries, &sources, &outs, true);
                let out = self.transfer(&instrs[i], input, &mut factory, None);
                if outs[i].as_ref() != Some(&out) {
                    outs[i] = Some(out);
                    changed = true;
                }
            }
            if !changed {
                converged = true;
                break;
            }
        }
        let mut sites = Vec::new();
        let mut final_outs: Vec<Option<State>> = vec![None; instrs.len()];
        for i in 0..instrs.len() {
            let input = if converged {
                self.input(i, &instrs, &entries, &sources, &outs, true)
            } else {
                self.input(i, &instrs, &entries, &sources, &final_outs, false)
            };
            final_outs[i] = Some(self.transfer(&instrs[i], input, &mut factory, Some(&mut sites)));
        }
        sites
    }

    /// The state before instruction `i`: the meet of its predecessors' states (unknown
    /// predecessors are skipped when `optimistic`, else they make the state empty), then the
    /// DWARF facts at its address.
    fn input(
        &self,
        i: usize,
        instrs: &[Instruction],
        entries: &[usize],
        sources: &[Vec<usize>],
        outs: &[Option<State>],
        optimistic: bool,
    ) -> State {
        let mut incoming: Option<State> = None;
        let mut unknown = false;
        let mut join =
            |s: Option<&State>, incoming: &mut Option<State>| match (s, incoming.as_ref()) {
                (Some(s), None) => *incoming = Some(s.clone()),
                (Some(s), Some(cur)) => *incoming = Some(cur.meet(s)),
                (None, _) => unknown = true,
            };
        if entries.contains(&i) {
            join(Some(&State::default()), &mut incoming);
        } else if i > 0 && falls_through(&instrs[i - 1]) {
            join(outs[i - 1].as_ref(), &mut incoming);
        }
        for &s in &sources[i] {
            join(outs[s].as_ref(), &mut incoming);
        }
        let mut state = if unknown && !optimistic {
            State::default()
        } else {
            incoming.unwrap_or_default()
        };
        let ip = instrs[i].ip();
        for f in self.facts.iter().filter(|f| f.lo <= ip && ip < f.hi) {
            if let Some(r) = DWARF_GPRS.get(usize::from(f.reg)).and_then(|&r| gpr(r)) {
                state.points_to[r] = Some(Ptr {
                    st: f.ty,
                    bias: 0,
                    array: false,
                });
                state.fn_from[r] = None;
            }
        }
        state
    }

    /// The struct and member a memory operand of `instr` reaches.
    fn memory_member(&mut self, instr: &Instruction, state: &State) -> Option<MemHit> {
        let disp = instr.memory_displacement64();
        let (st, off, array) = match instr.memory_base() {
            Register::RIP | Register::None if instr.memory_index() == Register::None => {
                let g = self.globals.find(disp)?;
                (g.st, (disp - g.addr) % g.elem.max(1), g.array)
            }
            base => {
                let p = state.points_to[gpr(base)?]?;
                let size = self.layouts.size(self.info, p.st);
                let off = p.bias.wrapping_add(disp) as i64;
                let off = match (p.array, u64::try_from(off)) {
                    (true, _) if size > 0 => off.rem_euclid(size as i64) as u64,
                    (false, Ok(off)) => off,
                    _ => return None,
                };
                (p.st, off, p.array)
            }
        };
        let size = (instr.memory_size().size() as u64).max(1);
        let hit = self.layouts.member_at(self.info, st, off, size)?;
        Some(MemHit {
            st,
            hit,
            off,
            array,
        })
    }

    /// The state after `instr`; records sites into `sites` on the final pass.
    fn transfer(
        &mut self,
        instr: &Instruction,
        mut state: State,
        factory: &mut InstructionInfoFactory,
        mut sites: Option<&mut Vec<Site>>,
    ) -> State {
        let has_mem = (0..instr.op_count()).any(|i| instr.op_kind(i) == OpKind::Memory);
        let dst = (instr.op_count() == 2
            && instr.op0_kind() == OpKind::Register
            && instr.op0_register().is_gpr64())
        .then(|| gpr(instr.op0_register()))
        .flatten();
        let mut gives: Option<(usize, Option<Ptr>, Option<u64>)> = None;
        if has_mem && instr.mnemonic() != Mnemonic::Nop {
            if let Some(m) = self.memory_member(instr, &state) {
                let is_lea = instr.mnemonic() == Mnemonic::Lea;
                if let (Some(sites), false) = (sites.as_deref_mut(), is_lea) {
                    let access = if matches!(
                        instr.flow_control(),
                        FlowControl::IndirectCall | FlowControl::IndirectBranch
                    ) {
                        Access::Call
                    } else {
                        match factory
                            .info(instr)
                            .used_memory()
                            .first()
                            .map(|u| u.access())
                        {
                            Some(OpAccess::Write | OpAccess::CondWrite) => Access::Write,
                            Some(OpAccess::ReadWrite | OpAccess::ReadCondWrite) => {
                                Access::ReadWrite
                            }
                            _ => Access::Read,
                        }
                    };
                    sites.push(Site {
                        addr: instr.ip(),
                        access,
                        st: m.st,
                        path: m.hit.path.clone(),
                    });
                }
                if let Some(dst) = dst {
                    gives = if is_lea {
                        let embedded = self.layouts.aggregate(self.info, m.hit.ty);
                        let ptr = if let (true, Some(inner), false) =
                            (m.hit.at_start, embedded, m.hit.path.is_empty())
                        {
                            Some(Ptr {
                                st: inner,
                                bias: 0,
                                array: false,
                            })
                        } else {
                            Some(Ptr {
                                st: m.st,
                                bias: m.off,
                                array: m.array,
                            })
                        };
                        Some((dst, ptr, None))
                    } else if instr.mnemonic() == Mnemonic::Mov {
                        let (pointee, is_fn) = self.layouts.pointer(self.info, m.hit.ty);
                        let loaded = pointee.map(|st| Ptr {
                            st,
                            bias: 0,
                            array: false,
                        });
                        let fnptr = is_fn.then_some(instr.ip());
                        Some((dst, loaded, fnptr))
                    } else {
                        None
                    };
                }
            }
        }
        if matches!(
            instr.flow_control(),
            FlowControl::Call
                | FlowControl::IndirectCall
                | FlowControl::UnconditionalBranch
                | FlowControl::IndirectBranch
        ) {
            if let Some(sites) = sites {
                self.mark_call(instr, &state, sites);
            }
            if matches!(
                instr.flow_control(),
                FlowControl::Call | FlowControl::IndirectCall
            ) {
                for r in CALLER_SAVED.iter().filter_map(|&r| gpr(r)) {
                    state.clear(r);
                }
            }
            return state;
        }
        // A register copy keeps what the source points to.
        if instr.mnemonic() == Mnemonic::Mov && instr.op1_kind() == OpKind::Register {
            if let (Some(d), Some(s)) = (
                dst,
                gpr(instr.op1_register()).filter(|_| instr.op1_register().is_gpr64()),
            ) {
                state.points_to[d] = state.points_to[s];
                state.fn_from[d] = state.fn_from[s];
                return state;
            }
        }
        // Stepping a pointer through an array by whole elements keeps it on the same member.
        let keeps = match (instr.mnemonic(), dst, instr.op1_kind()) {
            (
                Mnemonic::Add | Mnemonic::Sub,
                Some(d),
                OpKind::Immediate8to64 | OpKind::Immediate32to64,
            ) => state.points_to[d].filter(|p| {
                let size = self.layouts.size(self.info, p.st);
                p.array && size > 0 && instr.immediate64().is_multiple_of(size)
            }),
            _ => None,
        };
        for used in factory.info(instr).used_registers() {
            if matches!(
                used.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            ) {
                if let Some(r) = gpr(used.register()) {
                    state.clear(r);
                }
            }
        }
        if let (Some(d), Some(p)) = (dst, keeps) {
            state.points_to[d] = Some(p);
        }
        if let Some((d, ptr, fnptr)) = gives {
            state.points_to[d] = ptr;
            state.fn_from[d] = fnptr;
        }
        state
    }

    /// `call reg`, `jmp reg` or a retpoline thunk through a register that holds a function
    /// pointer loaded from a member: that load is a call through the member.
    fn mark_call(&self, instr: &Instruction, state: &State, sites: &mut [Site]) {
        let reg = match instr.op0_kind() {
            OpKind::Register => gpr(instr.op0_register()),
            OpKind::NearBranch64 => thunk_register(self.symbols, instr.near_branch_target()),
            _ => None,
        };
        if let Some(load) = reg.and_then(|r| state.fn_from[r]) {
            if let Some(site) = sites.iter_mut().rev().find(|s| s.addr == load) {
                site.access = Access::Call;
            }
        }
    }
}
