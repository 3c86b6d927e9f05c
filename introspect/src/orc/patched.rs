//! ORC rules for code the kernel patched at boot, derived from the running text.
//!
//! objtool writes one ORC rule per instruction of an alternatives site for the variants it
//! checked, and the kernel may patch in another whose stack differs. Debian 6.1's
//! `__switch_to_asm` is the case seen: its `FILL_RETURN_BUFFER` site holds a `jmp` over it
//! in the image, one replacement is a single `call; int3; add $8, %rsp` (the rules objtool
//! wrote: 64 bytes above the stack pointer after the call), and CPUs with
//! `X86_FEATURE_RSB_CTXSW` run the other, a 16-round loop of two intra-function calls each,
//! whose second call and `add` run 64 and 72 bytes deep where the table says 56. A sample
//! there read the return address from the wrong slot, and the profile showed the stack as
//! `[incomplete]`. The kernel's own unwinder has the same blind spot.
//!
//! Here the rules of such a site come from the instructions the guest runs: the stack height
//! at each instruction, walked with iced-x86 from the rule in force where the site begins,
//! following the site's own jumps and intra-function calls (which never return: the fill
//! drops their return addresses) as objtool follows them. Only sites where the table does
//! not describe every variant are read ([`undescribed_sites`]); a live variant
//! this walk cannot follow (a write to `%rsp` it does not model, a frame pointer changed,
//! two heights at one instruction, a height at the site's end other than at its start)
//! keeps objtool's rules. A jump out of the site ends the walk (a tail call, or a
//! retpoline's jump to the return thunk). The retpoline thunks, whose table rules say
//! nothing, are walked the same way from [`THUNK_ENTRY`].
//!
//! `.altinstructions` holds one `struct alt_instr` per (site, replacement): `s32
//! instr_offset` and `s32 repl_offset`, each relative to its own field, then the feature
//! word(s) and `u8 instrlen`, `u8 replacementlen`. The structure grew between kernels
//! (12 bytes in 6.1, 14 in 6.12), so its size and field offsets come from the kernel's BTF.

use std::ops::Range;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register,
};

use super::entry::{OrcEntry, OrcReg, OrcType};
use super::table::OrcTable;
use crate::btf::Btf;
use crate::bzimage::Vmlinux;

/// Why the alternatives of an image could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AltError {
    /// The BTF lacks `struct alt_instr` or one of its fields.
    #[error("the kernel's BTF has no `struct alt_instr` with {0}")]
    Layout(&'static str),
    /// A section is missing or unreadable.
    #[error("the image's {0} section is missing or has no bytes")]
    Section(&'static str),
    /// The table is not a whole number of entries.
    #[error(".altinstructions has {len} bytes, not a multiple of struct alt_instr's {size}")]
    Length {
        /// Bytes in the section.
        len: usize,
        /// Bytes in one entry.
        size: usize,
    },
}

/// Where the fields of `struct alt_instr` are, from BTF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AltInstrLayout {
    /// Bytes in one entry.
    pub size: usize,
    /// Offset of `s32 instr_offset`.
    pub instr_offset: usize,
    /// Offset of `s32 repl_offset`.
    pub repl_offset: usize,
    /// Offset of `u8 instrlen`.
    pub instrlen: usize,
    /// Offset of `u8 replacementlen`.
    pub replacementlen: usize,
}

impl AltInstrLayout {
    /// The layout the kernel's BTF gives.
    ///
    /// # Errors
    /// [`AltError::Layout`] when BTF lacks the structure, its size or a field.
    pub fn from_btf(btf: &Btf) -> Result<Self, AltError> {
        let id = btf
            .struct_by_name("alt_instr")
            .map_err(|_| AltError::Layout("a definition"))?;
        let size = btf
            .size_of(id)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or(AltError::Layout("a size"))?;
        let field = |name: &'static str| {
            btf.struct_member("alt_instr", name)
                .ok()
                .and_then(|m| m.byte_offset())
                .and_then(|o| usize::try_from(o).ok())
                .ok_or(AltError::Layout(name))
        };
        let layout = Self {
            size,
            instr_offset: field("instr_offset")?,
            repl_offset: field("repl_offset")?,
            instrlen: field("instrlen")?,
            replacementlen: field("replacementlen")?,
        };
        let fits =
            |offset: usize, width: usize| offset.checked_add(width).is_some_and(|e| e <= size);
        if !(fits(layout.instr_offset, 4)
            && fits(layout.repl_offset, 4)
            && fits(layout.instrlen, 1)
            && fits(layout.replacementlen, 1))
        {
            return Err(AltError::Layout("fields inside its size"));
        }
        Ok(layout)
    }
}

/// An alternatives site: `[addr, addr + len)` at link-time addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AltSite {
    /// Its first byte.
    pub addr: u64,
    /// Its length (`instrlen`).
    pub len: u8,
}

/// One entry of `.altinstructions`: a site and one replacement for it, at link-time
/// addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alternative {
    /// The site.
    pub site: AltSite,
    /// The replacement's first byte (in `.altinstr_replacement`).
    pub replacement: u64,
    /// Its length.
    pub replacement_len: u8,
}

/// Every entry of the image's `.altinstructions`.
///
/// # Errors
/// [`AltError::Section`] without `.altinstructions`, [`AltError::Length`] for a table that
/// is not whole entries.
pub fn alternatives(
    vmlinux: &Vmlinux,
    layout: &AltInstrLayout,
) -> Result<Vec<Alternative>, AltError> {
    let missing = AltError::Section(".altinstructions");
    let table = vmlinux
        .section_data(".altinstructions")
        .map_err(|_| AltError::Section(".altinstructions"))?;
    let table_addr = vmlinux.section(".altinstructions").ok_or(missing)?.addr;
    if layout.size == 0 || table.len() % layout.size != 0 {
        return Err(AltError::Length {
            len: table.len(),
            size: layout.size,
        });
    }
    // A layout made by hand may put a field past the entry: such entries are skipped.
    Ok(table
        .chunks_exact(layout.size)
        .enumerate()
        .filter_map(|(index, entry)| {
            let entry_addr = table_addr.wrapping_add((index * layout.size) as u64);
            let rel = |offset: usize| {
                let bytes: [u8; 4] = entry.get(offset..offset.checked_add(4)?)?.try_into().ok()?;
                Some(
                    entry_addr
                        .wrapping_add(offset as u64)
                        .wrapping_add_signed(i64::from(i32::from_le_bytes(bytes))),
                )
            };
            Some(Alternative {
                site: AltSite {
                    addr: rel(layout.instr_offset)?,
                    len: *entry.get(layout.instrlen)?,
                },
                replacement: rel(layout.repl_offset)?,
                replacement_len: *entry.get(layout.replacementlen)?,
            })
        })
        .collect())
}

/// The sites of the image's `.altinstructions` whose variants the table does not all
/// describe, sorted, each once: where the rules walked through the original or through some
/// replacement (padded with nops to the site's length, as the kernel pads it) differ from
/// the table's at an instruction. Only these need their running text read; at the others
/// the table holds whichever variant runs (objtool checked them all). A variant the walk
/// cannot follow does not count (reading it would not help), nor does code outside the
/// image's file bytes.
///
/// # Errors
/// As [`alternatives`].
pub fn undescribed_sites(
    vmlinux: &Vmlinux,
    layout: &AltInstrLayout,
    table: &OrcTable,
) -> Result<Vec<AltSite>, AltError> {
    let table_rule = |addr| table.lookup(addr).map(|(_, entry)| entry);
    let undescribed = |site: &AltSite, variant: u64, len: u8| {
        let (Some(start), Ok(bytes)) = (
            table_rule(site.addr),
            vmlinux.read_at(variant, usize::from(len)),
        ) else {
            return false;
        };
        let mut code = bytes.to_vec();
        code.resize(usize::from(site.len).max(code.len()), NOP);
        site_rules(&code[..usize::from(site.len)], site.addr, start)
            .is_some_and(|rules| rules.iter().any(|&(ip, rule)| table_rule(ip) != Some(rule)))
    };
    let mut sites: Vec<AltSite> = alternatives(vmlinux, layout)?
        .into_iter()
        .filter(|alt| {
            alt.site.len > 0
                && (undescribed(&alt.site, alt.site.addr, alt.site.len)
                    || undescribed(&alt.site, alt.replacement, alt.replacement_len))
        })
        .map(|alt| alt.site)
        .collect();
    sites.sort_by_key(|s| s.addr);
    sites.dedup();
    Ok(sites)
}

/// The one-byte `nop` the kernel pads a shorter replacement with (before optimizing them).
const NOP: u8 = 0x90;

fn is_direct(insn: &Instruction) -> bool {
    matches!(
        insn.op0_kind(),
        OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
    )
}

fn writes(info: &mut InstructionInfoFactory, insn: &Instruction, reg: Register) -> bool {
    info.info(insn).used_registers().iter().any(|used| {
        used.register().full_register() == reg
            && matches!(
                used.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            )
    })
}

/// The rule at the first instruction of a retpoline thunk (`__x86_indirect_thunk_rax`, ...):
/// the return address on top of the stack. A thunk is reached by a call, or by a tail call's
/// jump once the caller's frame is gone: either way the return address is there. The kernel
/// annotates the thunks `UNWIND_HINT_EMPTY` (6.1: the end of the stack, so a sample there
/// showed a one-frame stack as complete) or `UNWIND_HINT_UNDEFINED` (6.12: an unwind that
/// fails); the rules walked from this one through the running thunk follow its retpoline
/// (`call 1f; int3; 1: mov %reg, (%rsp); ret`, 8 bytes deeper after the call).
/// The same rule as the kernel's for a call through a NULL pointer.
pub const THUNK_ENTRY: OrcEntry = OrcEntry::NULL_CALL;

/// A rule and the running address of the instruction it holds from.
type Rule = (u64, OrcEntry);

/// Rules for the running addresses of patched sites, checked before the tables.
#[derive(Debug, Clone, Default)]
pub struct PatchedRules {
    /// Each site's running range and its rules, ascending.
    sites: Vec<(Range<u64>, Vec<Rule>)>,
}

impl PatchedRules {
    /// Derives the rules of each of `sites` (link-time addresses; running ones are `slide`
    /// above) from its running bytes, which `read` fills (false: unreadable, the site keeps
    /// the table's rules). `table_rule` gives the table's rule at a link-time address.
    pub fn derive(
        sites: &[AltSite],
        slide: u64,
        table_rule: impl Fn(u64) -> Option<OrcEntry>,
        mut read: impl FnMut(u64, &mut [u8]) -> bool,
    ) -> Self {
        let mut rules = Self::default();
        for site in sites {
            let Some(start) = table_rule(site.addr) else {
                continue;
            };
            let running = site.addr.wrapping_add(slide);
            let mut bytes = vec![0; usize::from(site.len)];
            if !read(running, &mut bytes) {
                continue;
            }
            match site_rules(&bytes, running, start) {
                Some(site_rules) if !site_rules.is_empty() => {
                    let end = running.saturating_add(u64::from(site.len));
                    rules.sites.push((running..end, site_rules));
                }
                _ => tracing::debug!(
                    site = format_args!("{running:#x}"),
                    "the patched code at an alternatives site keeps the table's ORC rules"
                ),
            }
        }
        rules.sites.sort_by_key(|(range, _)| range.start);
        rules
    }

    /// Adds the sites of `other` (derived from other starting rules).
    pub fn extend(&mut self, other: Self) {
        self.sites.extend(other.sites);
        self.sites.sort_by_key(|(range, _)| range.start);
    }

    /// Sites with rules of their own.
    pub fn len(&self) -> usize {
        self.sites.len()
    }

    /// Whether no site has rules of its own.
    pub fn is_empty(&self) -> bool {
        self.sites.is_empty()
    }

    /// Each rule with the running address of the instruction it was derived at, ascending.
    pub fn iter(&self) -> impl Iterator<Item = (u64, OrcEntry)> + '_ {
        self.sites
            .iter()
            .flat_map(|(_, rules)| rules.iter().copied())
    }

    /// The rule at running address `addr`, when a patched site holds it.
    pub fn entry_at(&self, addr: u64) -> Option<OrcEntry> {
        let at = self.sites.partition_point(|(range, _)| range.start <= addr);
        let (range, rules) = self.sites.get(at.checked_sub(1)?)?;
        if !range.contains(&addr) {
            return None;
        }
        let i = rules.partition_point(|(ip, _)| *ip <= addr);
        rules.get(i.checked_sub(1)?).map(|(_, rule)| *rule)
    }
}

/// The rule at each instruction of the code `bytes` running at `addr`, when the stack height
/// can be followed from `start` (the rule where the site begins) through all of it; `None`
/// when it cannot (see the module docs).
fn site_rules(bytes: &[u8], addr: u64, start: OrcEntry) -> Option<Vec<Rule>> {
    if start.sp_reg != OrcReg::Sp || start.kind != OrcType::Call || start.signal {
        // A rule not based on the stack pointer does not move with it.
        return None;
    }
    let end = addr.checked_add(bytes.len() as u64)?;
    let start_height = i32::from(start.sp_offset);
    let mut heights: Vec<(u64, i32)> = Vec::new();
    let mut work = vec![(addr, start_height)];
    let mut info = InstructionInfoFactory::new();
    while let Some((ip, height)) = work.pop() {
        if ip == end {
            // Leaving the site at its end: the table's rules go on from there.
            if height != start_height {
                return None;
            }
            continue;
        }
        if !(addr..end).contains(&ip) {
            return None;
        }
        if let Some(&(_, seen)) = heights.iter().find(|(at, _)| *at == ip) {
            if seen != height {
                return None;
            }
            continue;
        }
        heights.push((ip, height));
        let offset = usize::try_from(ip - addr).ok()?;
        let mut decoder = Decoder::with_ip(64, &bytes[offset..], ip, DecoderOptions::NONE);
        let insn = decoder.decode();
        if insn.is_invalid() || writes(&mut info, &insn, Register::RBP) {
            return None;
        }
        let next = insn.next_ip();
        let target_inside = |insn: &Instruction| {
            is_direct(insn) && (addr..end).contains(&insn.near_branch_target())
        };
        match insn.flow_control() {
            FlowControl::Call => {
                if target_inside(&insn) {
                    // An intra-function call whose return address the code drops.
                    work.push((insn.near_branch_target(), height.checked_add(8)?));
                } else {
                    work.push((next, height));
                }
            }
            FlowControl::UnconditionalBranch => {
                // A jump out of the site ends the walk there: a tail call, or 6.1's
                // retpolines' `jmp __x86_return_thunk` standing for their `ret`.
                if target_inside(&insn) || is_direct(&insn) && insn.near_branch_target() == end {
                    work.push((insn.near_branch_target(), height));
                }
            }
            FlowControl::ConditionalBranch => {
                if !is_direct(&insn) {
                    return None;
                }
                let target = insn.near_branch_target();
                if target_inside(&insn) || target == end {
                    work.push((target, height));
                }
                work.push((next, height));
            }
            FlowControl::Return
            | FlowControl::IndirectBranch
            | FlowControl::Interrupt
            | FlowControl::Exception => {}
            // A call out of the site (a paravirt op's `call *pv_ops...`) returns.
            FlowControl::IndirectCall => work.push((next, height)),
            FlowControl::Next | FlowControl::XbeginXabortXend => {
                work.push((next, height.checked_add(stack_change(&mut info, &insn)?)?));
            }
        }
    }
    heights.sort_by_key(|(ip, _)| *ip);
    heights
        .into_iter()
        .map(|(ip, height)| {
            let sp_offset = i16::try_from(height).ok().filter(|h| *h > 0)?;
            Some((ip, OrcEntry { sp_offset, ..start }))
        })
        .collect()
}

/// Bytes an instruction that does not branch adds to the stack's height, when it is one the
/// walk models: pushes and pops, `add`/`sub` of an immediate to `%rsp`, `lea d(%rsp), %rsp`,
/// and anything that leaves `%rsp` alone.
fn stack_change(info: &mut InstructionInfoFactory, insn: &Instruction) -> Option<i32> {
    let is_rsp =
        |op: u32| insn.op_kind(op) == OpKind::Register && insn.op_register(op) == Register::RSP;
    let immediate = || {
        matches!(
            insn.op1_kind(),
            OpKind::Immediate8to64 | OpKind::Immediate32to64 | OpKind::Immediate32
        )
        .then(|| i32::try_from(insn.immediate(1) as i64).ok())
        .flatten()
    };
    match insn.mnemonic() {
        Mnemonic::Add if is_rsp(0) => immediate()?.checked_neg(),
        Mnemonic::Sub if is_rsp(0) => immediate(),
        Mnemonic::Lea
            if is_rsp(0)
                && insn.memory_base() == Register::RSP
                && insn.memory_index() == Register::None =>
        {
            i32::try_from(insn.memory_displacement64() as i64)
                .ok()?
                .checked_neg()
        }
        Mnemonic::Leave | Mnemonic::Enter => None,
        _ if insn.stack_pointer_increment() != 0 => insn.stack_pointer_increment().checked_neg(),
        _ if writes(info, insn, Register::RSP) => None,
        _ => Some(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SITE: u64 = 0xffff_ffff_8100_3298;

    fn start() -> OrcEntry {
        OrcEntry {
            sp_reg: OrcReg::Sp,
            sp_offset: 56,
            bp_reg: OrcReg::PrevSp,
            bp_offset: -16,
            kind: OrcType::Call,
            signal: false,
        }
    }

    fn heights(rules: &[(u64, OrcEntry)]) -> Vec<(u64, i16)> {
        rules
            .iter()
            .map(|(ip, e)| (ip - SITE, e.sp_offset))
            .collect()
    }

    /// The RSB-stuffing loop of Debian 6.1's `__switch_to_asm` (its
    /// `.altinstr_replacement` bytes for `X86_FEATURE_RSB_CTXSW`): `mov $16, %r12`; `1: call
    /// 2f; int3; 2: call 3f; int3; 3: add $16, %rsp; dec %r12; jnz 1b; lfence`.
    const RSB_LOOP: &str = "49c7c410000000e801000000cce801000000cc4883c41049ffcc75eb0faee8";

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn the_rsb_stuffing_loop_runs_64_and_72_bytes_deep_between_its_calls() {
        let rules = site_rules(&hex(RSB_LOOP), SITE, start()).unwrap();
        // The int3s after each call (0xc, 0x12) never run and have no rule of their own.
        assert_eq!(
            heights(&rules),
            [
                (0, 56),
                (7, 56),
                (0xd, 64),
                (0x13, 72),
                (0x17, 56),
                (0x1a, 56),
                (0x1c, 56)
            ]
        );
        assert!(rules
            .iter()
            .all(|(_, e)| e.bp_reg == OrcReg::PrevSp && e.bp_offset == -16));
    }

    #[test]
    fn a_retpoline_thunk_runs_8_bytes_deeper_after_its_call() {
        // The retpoline of later kernels: `call 1f; int3; 1: mov %rax, (%rsp); ret`, then
        // int3 padding.
        let code = hex("e801000000cc48890424c3cccccc");
        let rules = site_rules(&code, SITE, THUNK_ENTRY).unwrap();
        assert_eq!(heights(&rules), [(0, 8), (6, 16), (0xa, 16)]);
        // Debian 6.1's: `call 1f; 2: pause; lfence; jmp 2b; 1: mov %rax, (%rsp); jmp
        // __x86_return_thunk` (out of the site).
        let code = hex("e807000000f3900faee8ebf948890424e99b070000");
        let rules = site_rules(&code, SITE, THUNK_ENTRY).unwrap();
        assert_eq!(heights(&rules), [(0, 8), (0xc, 16), (0x10, 16)]);
        // With `jmp *%rax` patched in (no retpoline): the entry only.
        let rules = site_rules(&[0xff, 0xe0, 0xcc], SITE, THUNK_ENTRY).unwrap();
        assert_eq!(heights(&rules), [(0, 8)]);
    }

    #[test]
    fn a_jump_over_the_site_keeps_the_height() {
        // `jmp` to the site's end, then padding the jump skips.
        let mut code = vec![0xeb, 0x1d];
        code.extend([0x90; 0x1d]);
        let rules = site_rules(&code, SITE, start()).unwrap();
        assert_eq!(heights(&rules), [(0, 56)]);
    }

    #[test]
    fn code_the_walk_cannot_follow_keeps_the_tables_rules() {
        // `mov %rdi, %rsp`: a stack switch the walk does not model.
        assert!(site_rules(&[0x48, 0x89, 0xfc], SITE, start()).is_none());
        // `push %rax` with no pop: the site would end 8 bytes deeper than it began.
        assert!(site_rules(&[0x50], SITE, start()).is_none());
        // `pop %rbp`: the frame pointer's rule would change.
        assert!(site_rules(&[0x50, 0x5d], SITE, start()).is_none());
        // A rule based on the frame pointer does not move with the stack pointer.
        let bp_based = OrcEntry {
            sp_reg: OrcReg::Bp,
            ..start()
        };
        assert!(site_rules(&hex(RSB_LOOP), SITE, bp_based).is_none());
        // Bytes that do not decode.
        assert!(site_rules(&[0x0f, 0xff], SITE, start()).is_none());
    }

    #[test]
    fn a_balanced_push_and_pop_and_calls_out_of_the_site_are_followed() {
        // pushf; pop %rax: a paravirt `save_fl` patched in.
        let rules = site_rules(&[0x9c, 0x58], SITE, start()).unwrap();
        assert_eq!(heights(&rules), [(0, 56), (1, 64)]);
        // call *0x10(%rip), the paravirt original, and a direct call out: both return.
        let rules = site_rules(&[0xff, 0x15, 0x10, 0, 0, 0], SITE, start()).unwrap();
        assert_eq!(heights(&rules), [(0, 56)]);
        let rules = site_rules(&[0xe8, 0, 0, 0x10, 0], SITE, start()).unwrap();
        assert_eq!(heights(&rules), [(0, 56)]);
    }

    #[test]
    fn rules_are_looked_up_by_running_address_inside_their_site_only() {
        let code = hex(RSB_LOOP);
        let slide = 0x1000;
        let site = AltSite {
            addr: SITE,
            len: code.len() as u8,
        };
        let rules = PatchedRules::derive(
            &[site],
            slide,
            |link| (link == SITE).then(start),
            |at, buf| {
                assert_eq!(at, SITE + slide);
                buf.copy_from_slice(&code);
                true
            },
        );
        assert_eq!(rules.len(), 1);
        let at = |off: u64| rules.entry_at(SITE + slide + off).map(|e| e.sp_offset);
        assert_eq!(at(0x13), Some(72));
        // A return address's lookup (one byte back) inside the second call.
        assert_eq!(at(0x11), Some(64));
        assert_eq!(at(0x1e), Some(56));
        assert_eq!(at(code.len() as u64), None);
        assert_eq!(rules.entry_at(SITE + slide - 1), None);
        // An unreadable site keeps the table's rules.
        let unread = PatchedRules::derive(&[site], slide, |_| Some(start()), |_, _| false);
        assert!(unread.is_empty());
    }
}
