//! The in-guest lookup table and the dispatch routine that consults it.
//!
//! Returns, indirect jumps and indirect calls leave translated code with their original
//! target on top of the stack and jump to the dispatch routine. It looks the target up
//! in an open-addressing table of `(original address, cache address)` pairs in the patch
//! heap and continues at the translation, or at the original address on a miss (the
//! kernel then runs its own code, correct but uncounted). All registers and flags are
//! kept (the status flags through `lahf`/`seto` and back, never `popfq`; a CPU without
//! LAHF/SAHF in 64-bit mode is refused before anything is translated). The routine ends
//! with `ret`, which pops the target in one instruction: nothing is ever left below `rsp`
//! for an interrupt to overwrite.
//!
//! The table is written by the host only; the guest reads it. It is kept at most half
//! full, so every probe sequence ends at an empty slot and the loop is bounded.

use iced_x86::code_asm::{al, ecx, qword_ptr, rax, rbx, rcx, rdx, rsp, CodeAssembler};

/// Bytes per table slot: the original address, then the cache address.
pub const SLOT_BYTES: u64 = 16;

/// Errors of the lookup table.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    /// The table has no room for another entry without passing half full.
    #[error("the lookup table is half full ({entries} of {slots} slots)")]
    Full {
        /// Entries held.
        entries: usize,
        /// Slots.
        slots: usize,
    },
    /// The region given for the table holds fewer than two slots.
    #[error("{bytes} bytes cannot hold a lookup table")]
    TooSmall {
        /// The region's size.
        bytes: u64,
    },
    /// iced could not assemble the dispatch routine.
    #[error("cannot assemble the dispatch routine")]
    Assemble(#[source] iced_x86::IcedError),
}

/// The host's copy of the lookup table, written to the guest as a whole.
#[derive(Debug, Clone)]
pub struct LookupTable {
    at: u64,
    slots: Vec<(u64, u64)>,
    entries: usize,
    /// Slots written since [`LookupTable::take_changed`] last ran (lazy translation writes
    /// only these to the guest).
    changed: Vec<usize>,
}

/// The slot a target hashes to; the dispatch routine computes the same.
fn home_slot(target: u64, slots: usize) -> usize {
    (((target >> 4) ^ target) as usize) & (slots - 1)
}

impl LookupTable {
    /// A table at `at` with as many slots (a power of two) as `bytes` hold.
    ///
    /// # Errors
    /// [`LookupError::TooSmall`] under two slots.
    pub fn new(at: u64, bytes: u64) -> Result<Self, LookupError> {
        let fit = bytes / SLOT_BYTES;
        if fit < 2 {
            return Err(LookupError::TooSmall { bytes });
        }
        let slots = 1usize << (63 - fit.leading_zeros());
        Ok(Self {
            at,
            slots: vec![(0, 0); slots],
            entries: 0,
            changed: Vec::new(),
        })
    }

    /// The table's guest address.
    #[must_use]
    pub fn addr(&self) -> u64 {
        self.at
    }

    /// The number of slots.
    #[must_use]
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// The number of entries.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries
    }

    /// Whether the table is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Entries the table can still take.
    #[must_use]
    pub fn room(&self) -> usize {
        (self.slots.len() / 2).saturating_sub(self.entries)
    }

    /// Maps `original` (never 0) to `cache`; a second insert of the same original
    /// address replaces the first.
    ///
    /// # Errors
    /// [`LookupError::Full`] when the table is half full.
    pub fn insert(&mut self, original: u64, cache: u64) -> Result<(), LookupError> {
        let n = self.slots.len();
        let mut i = home_slot(original, n);
        loop {
            let slot = &mut self.slots[i];
            if slot.0 == original {
                slot.1 = cache;
                self.changed.push(i);
                return Ok(());
            }
            if slot.0 == 0 {
                if self.entries >= n / 2 {
                    return Err(LookupError::Full {
                        entries: self.entries,
                        slots: n,
                    });
                }
                *slot = (original, cache);
                self.entries += 1;
                self.changed.push(i);
                return Ok(());
            }
            i = (i + 1) & (n - 1);
        }
    }

    /// The cache address of `original`, as the dispatch routine finds it.
    #[must_use]
    pub fn get(&self, original: u64) -> Option<u64> {
        let n = self.slots.len();
        let mut i = home_slot(original, n);
        for _ in 0..n {
            match self.slots[i] {
                (0, _) => return None,
                (o, c) if o == original => return Some(c),
                _ => i = (i + 1) & (n - 1),
            }
        }
        None
    }

    /// The slots written since the last call, as (guest address, the slot's 16 bytes), in
    /// slot order.
    pub fn take_changed(&mut self) -> Vec<(u64, [u8; 16])> {
        let mut changed = std::mem::take(&mut self.changed);
        changed.sort_unstable();
        changed.dedup();
        changed
            .into_iter()
            .map(|i| {
                let (o, c) = self.slots[i];
                let mut bytes = [0u8; 16];
                bytes[..8].copy_from_slice(&o.to_le_bytes());
                bytes[8..].copy_from_slice(&c.to_le_bytes());
                (self.at + i as u64 * SLOT_BYTES, bytes)
            })
            .collect()
    }

    /// The table's bytes, as the guest reads them.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        self.slots
            .iter()
            .flat_map(|(o, c)| o.to_le_bytes().into_iter().chain(c.to_le_bytes()))
            .collect()
    }
}

/// Assembles the dispatch routine at `at` for `table`. On entry the original target is
/// at `[rsp]`; it leaves with that slot popped and every register and flag as it found
/// them, at the target's translation or at the target itself.
///
/// # Errors
/// [`LookupError::Assemble`] (not expected).
pub fn dispatch_routine(at: u64, table: &LookupTable) -> Result<Vec<u8>, LookupError> {
    let slots = table.slots() as u32;
    let build = || -> Result<Vec<u8>, iced_x86::IcedError> {
        let mut a = CodeAssembler::new(64)?;
        let mut probe = a.create_label();
        let mut hit = a.create_label();
        let mut miss = a.create_label();
        // The status flags go into `ah` (`lahf`: SF ZF AF PF CF) and `al` (`seto`: OF), not
        // through `pushfq`/`popfq`: the routine changes no other flag, and `popfq` (which may
        // change IF, TF and AC) costs more on hardware and ends QEMU's translated block.
        a.push(rax)?;
        a.push(rcx)?;
        a.push(rdx)?;
        a.push(rbx)?;
        a.lahf()?;
        a.seto(al)?;
        a.mov(rdx, qword_ptr(rsp + 32))?;
        a.mov(rcx, rdx)?;
        a.shr(rcx, 4)?;
        a.xor(rcx, rdx)?;
        a.and(ecx, slots.wrapping_sub(1) as i32)?;
        a.shl(ecx, 4)?;
        a.mov(rbx, table.addr())?;
        a.set_label(&mut probe)?;
        a.cmp(rdx, qword_ptr(rbx + rcx))?;
        a.je(hit)?;
        a.cmp(qword_ptr(rbx + rcx), 0)?;
        a.je(miss)?;
        a.add(ecx, SLOT_BYTES as i32)?;
        a.and(
            ecx,
            (slots.wrapping_mul(SLOT_BYTES as u32)).wrapping_sub(1) as i32,
        )?;
        a.jmp(probe)?;
        a.set_label(&mut hit)?;
        a.mov(rdx, qword_ptr(rbx + rcx + 8))?;
        a.mov(qword_ptr(rsp + 32), rdx)?;
        a.set_label(&mut miss)?;
        // OF back from `al` (0x7f + 1 overflows, 0x7f + 0 does not), then the rest from `ah`.
        a.add(al, 0x7f)?;
        a.sahf()?;
        a.pop(rbx)?;
        a.pop(rdx)?;
        a.pop(rcx)?;
        a.pop(rax)?;
        a.ret()?;
        a.assemble(at)
    };
    build().map_err(LookupError::Assemble)
}

#[cfg(test)]
mod tests {
    use super::*;
    use exotap_vmm::control::{Machine, RegisterFile, X86Registers};
    use exotap_vmm::unicorn::{Isa, RunEnd, UnicornMachine, VCPU};

    const CODE: u64 = 0xffff_ffff_a000_0000;
    const TABLE: u64 = CODE + 0x1000;
    const STACK: u64 = CODE + 0x8000;

    /// Runs the dispatch routine with `target` on the stack; returns where it went and
    /// the registers it left.
    fn dispatch(table: &LookupTable, target: u64, halt: u64) -> (RunEnd, X86Registers) {
        let mut m = UnicornMachine::new(Isa::X86_64).unwrap();
        m.map(CODE, 0x1_0000).unwrap();
        let code = dispatch_routine(CODE, table).unwrap();
        m.write(CODE, &code).unwrap();
        m.write(TABLE, &table.to_bytes()).unwrap();
        m.write(STACK - 8, &target.to_le_bytes()).unwrap();
        m.set_halt(Some(halt)).unwrap();
        let mut regs = X86Registers {
            rip: CODE,
            rflags: 0x2 | 0x1 | 0x40 | 0x800,
            ..X86Registers::default()
        };
        for (i, r) in regs.gpr.iter_mut().enumerate() {
            *r = 0x1111 * (i as u64 + 1);
        }
        regs.gpr[7] = STACK - 8;
        m.set_x86_registers(&regs).unwrap();
        let end = m.run().unwrap();
        let RegisterFile::X86_64(after) = m.registers(VCPU).unwrap() else {
            panic!("not x86-64")
        };
        (end, after)
    }

    #[test]
    fn a_known_target_continues_at_its_translation_with_registers_and_flags_kept() {
        let mut table = LookupTable::new(TABLE, 0x400).unwrap();
        for k in 0..20u64 {
            table
                .insert(0xffff_ffff_8100_0000 + k * 16, CODE + 0x4000 + k)
                .unwrap();
        }
        let target = 0xffff_ffff_8100_0000 + 7 * 16;

        let (end, regs) = dispatch(&table, target, CODE + 0x4007);

        assert_eq!(end, RunEnd::Halted(CODE + 0x4007));
        assert_eq!(regs.gpr[7], STACK);
        assert_eq!(regs.gpr[0], 0x1111);
        assert_eq!(regs.gpr[1], 0x2222);
        assert_eq!(regs.gpr[3], 0x4444);
        assert_eq!(regs.rflags & 0x8d5, 0x1 | 0x40 | 0x800);
    }

    #[test]
    fn an_unknown_target_continues_at_the_original_address() {
        let mut table = LookupTable::new(TABLE, 0x400).unwrap();
        table.insert(0xffff_ffff_8100_0010, CODE + 0x4000).unwrap();
        let target = 0xffff_ffff_8100_0020;

        let (end, regs) = dispatch(&table, target, target);

        assert_eq!(end, RunEnd::Halted(target));
        assert_eq!(regs.gpr[7], STACK);
    }

    #[test]
    fn colliding_targets_are_all_found_and_the_table_refuses_past_half_full() {
        let mut table = LookupTable::new(TABLE, 16 * SLOT_BYTES).unwrap();
        // All hash to the same home slot: targets that differ only above bit 8.
        let targets: Vec<u64> = (1..=8u64).map(|k| k << 20).collect();
        for (k, t) in targets.iter().enumerate() {
            table.insert(*t, 100 + k as u64).unwrap();
        }

        let ninth = table.insert(9 << 20, 1);

        assert!(matches!(
            ninth,
            Err(LookupError::Full {
                entries: 8,
                slots: 16
            })
        ));
        for (k, t) in targets.iter().enumerate() {
            assert_eq!(table.get(*t), Some(100 + k as u64));
        }
        assert_eq!(table.get(10 << 20), None);
    }
}
