//! ORC: the x86-64 kernel's own unwind tables, read and walked from outside the guest.
//!
//! No published Rust crate parses ORC, so this is written by hand from the kernel's
//! definitions (`arch/x86/include/asm/orc_types.h`, `arch/x86/kernel/unwind_orc.c`,
//! `scripts/orc_hash.sh`, Linux 6.1 and later); the facts it relies on are below.
//!
//! # The tables
//! objtool emits two parallel arrays, sorted at build time by `scripts/sorttable`:
//! - `.orc_unwind_ip`: one `s32` per entry, relative to the entry's own address
//!   (ip = address of the slot + value). Being relative, KASLR does not change them: a table
//!   read from guest memory at running addresses yields running ips.
//! - `.orc_unwind`: one 6-byte `struct orc_entry` per ip: `s16 sp_offset`, `s16 bp_offset`,
//!   then a little-endian 16-bit field `sp_reg:4, bp_reg:4` and, depending on the kernel,
//!   `type:2, end:1` (up to 6.2 and all of 6.1.y), `type:2, signal:1, end:1` (6.3) or
//!   `type:3, signal:1` (6.4+); see [`OrcLayout`].
//! - `.orc_header` (6.4+, and late 6.3.y): 20 bytes, the SHA-1 of the `ORC_REG_*`/
//!   `ORC_TYPE_*` defines and the `struct orc_entry` text, naming the layout. An unknown
//!   hash is an error ([`OrcTableError::UnknownHeader`]); a missing header is normal before
//!   6.4, and the layout is then told apart by the bit the 6.3 `end` flag uses.
//!
//! The entry for an address is the last one whose ip is at or below it (binary search; the
//! kernel's `orc_lookup` block index only speeds that up and is not read here). For a
//! return address the lookup uses the address minus one, so the rule of the call
//! instruction applies; for the starting pc and after an interrupt frame (a "signal"
//! frame) the exact pc.
//!
//! # The rule of an entry
//! - Caller's stack pointer (the CFA): `sp_reg + sp_offset`, with `sp_reg` one of
//!   `ORC_REG_SP` (5), `BP` (4), `SP_INDIRECT` (9: `*sp + sp_offset`), `BP_INDIRECT` (8:
//!   `*(bp + sp_offset)`), or a general register saved by entry code, `R10` (6), `R13` (7),
//!   `DI` (3), `DX` (2), which only a full register set provides. `UNDEFINED` (0) means no
//!   rule.
//! - What sits at the CFA: `ORC_TYPE_CALL`, the return address at CFA − 8;
//!   `ORC_TYPE_REGS`, a full `struct pt_regs` (168 bytes, [`PtRegs`]) whose ip and sp are the
//!   caller's; `ORC_TYPE_REGS_PARTIAL`, only the hardware iret frame (ip, cs, flags, sp, ss).
//! - Caller's frame pointer: unchanged (`UNDEFINED`, or taken from a register frame), or
//!   loaded from `PREV_SP + bp_offset` or `BP + bp_offset`.
//! - End of the stack: before 6.4, an undefined `sp_reg` with the `end` bit (without it,
//!   the entry is a gap terminator and unwinding through it fails); from 6.4 the types
//!   `END_OF_STACK` and `UNDEFINED`.
//!
//! # The unwinder
//! [`Unwinder::unwind`] follows Linux 6.1's `unwind_next_frame`: it stops at user mode
//! (`cs & 3` in a register frame), at end-of-stack entries, at a pc no table covers (or
//! guesses a frame-pointer frame there, if asked), and at a frame limit; it refuses a
//! caller stack pointer that is not above the callee's unless the step may switch stacks.
//! It does not undo return addresses replaced by the function-graph tracer or kretprobes
//! (`return_to_handler`, `__kretprobe_trampoline` appear as such).
//!
//! Code the kernel patches at boot (alternatives) can run with a stack the tables do not
//! describe; [`PatchedRules`] derives the rules of such sites from the running text and
//! [`Unwinder::with_patched`] puts them first.
//!
//! # Where the tables come from
//! [`OrcTable::from_elf`] on the `-dbg` vmlinux, [`OrcTable::from_vmlinux`] on the ELF
//! inside a bzImage (the Debian image keeps its section headers, so this works there too),
//! or [`OrcTable::parse`] on bytes read from guest memory between the `__start_orc_unwind_ip`,
//! `__stop_orc_unwind_ip` and `__start_orc_unwind` symbols (kallsyms has them).

mod entry;
mod format;
mod patched;
mod stack;
mod table;
mod unwind;

pub use entry::{
    OrcEntry, OrcLayout, OrcReg, OrcType, RawOrcEntry, ENTRY_SIZE, HEADER_SIZE, KNOWN_HEADERS,
};
pub use format::format_backtrace;
pub use patched::{
    alternatives, undescribed_sites, AltError, AltInstrLayout, AltSite, Alternative, PatchedRules,
    THUNK_ENTRY,
};
pub use stack::{
    InactiveTaskFrame, IretFrame, OutsideSnapshot, PtRegs, StackMemory, StackSnapshot,
};
pub use table::{encode_tables, OrcTable, OrcTableError};
pub use unwind::{
    Backtrace, Frame, FrameKind, StackEnd, UnwindError, UnwindStart, Unwinder, DEFAULT_MAX_FRAMES,
};

#[cfg(test)]
mod real_kernel_tests;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
