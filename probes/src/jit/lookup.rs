//! The in-guest lookup table and the dispatch routine that consults it.
//!
//! Returns, indirect jumps and indirect calls leave translated code with their original
//! target on top of the stack and jump to the dispatch routine. It looks the target up
//! in an open-addressing table of `(original address, cache address)` pairs in the patch
//! heap and continues at the translation, or at the original address on a miss (the
//! kernel then runs its own code, correct but uncounted). The routine ends with `ret`,
//! which pops the target in one instruction: nothing is ever left below `rsp` for an
//! interrupt to overwrite.
//!
//! **No flag is touched.** The routine uses only `mov`, `movzx`, `bswap`, `lea`, `not`,
//! `push`, `pop`, `jrcxz`, `jmp` and `ret`, none of which writes a flag, so it keeps every
//! flag without saving any: the home slot is the target's low bits
//! ([`Hash`](struct@Hash)), taken by `movzx` and a 256-entry mask table after the slots, and
//! a key is compared as `lea rcx, [key + !target + 1]` (their difference), then `jrcxz`. Saving the status flags
//! (`lahf`/`seto` and back, as it did before) cost two out-of-line flag computations per
//! return under QEMU TCG, about a tenth of the time the JIT bench spent in the cache.
//!
//! The table is written by the host only; the guest reads it. It is kept at most half
//! full, and a probe never wraps: it runs up from the target's home slot to the target or
//! an empty slot, and the host never fills the last slot, so every probe ends inside the
//! table.

use iced_x86::code_asm::{
    ch, dh, dl, dword_ptr, dx, eax, ecx, edx, qword_ptr, rax, rbx, rcx, rdx, rsp, CodeAssembler,
};

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
    /// The slots take 2 GiB or more: the mask table after them is out of a displacement's
    /// reach.
    #[error("{bytes} bytes of lookup-table slots are more than a displacement reaches")]
    TooLarge {
        /// The slots' size.
        bytes: u64,
    },
    /// iced could not assemble the dispatch routine.
    #[error("cannot assemble the dispatch routine")]
    Assemble(#[source] iced_x86::IcedError),
}

/// How a target's home slot is computed, in the dispatch routine and on the host: its low
/// `bits` bits (8 to 24), the widest whose homes fit in the table with an eighth more
/// slots to probe past the highest. Instruction addresses are dense in the text a table
/// covers, so the low bits spread them evenly; mixes of shifted bytes (tried first:
/// `low 16 bits + 1024 * bits 16-23`) fold neighbouring 64 KiB of text onto overlapping
/// home ranges, and with 96,000 entries from the kernel's hot text the longest run of
/// occupied slots was 23,000 slots (235 probes a hit on average, the JIT bench 38 times
/// slower than without the JIT).
///
/// Without a flag written, the routine takes the low 8 or 16 bits with `movzx` and the
/// next byte's low bits through a 256-entry table of masked, shifted values stored after
/// the slots ([`LookupTable::to_bytes`]), added with `lea`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hash {
    /// Bits of the target that make its home.
    pub bits: u32,
}

impl Hash {
    /// Homes it gives.
    #[must_use]
    pub fn homes(self) -> usize {
        1 << self.bits
    }

    /// The home slot of `target`.
    #[must_use]
    pub fn home(self, target: u64) -> usize {
        (target & ((1 << self.bits) - 1)) as usize
    }

    /// The widest hash whose homes, and an eighth more to probe past the highest, fit in
    /// `slots`.
    fn for_slots(slots: usize) -> Option<Hash> {
        (8..=24)
            .rev()
            .map(|bits| Hash { bits })
            .find(|h| h.homes() + h.homes() / 8 <= slots)
    }

    /// The mask table's entry for byte value `i` of the target's bits 8-15 (hashes of 9 to
    /// 15 bits) or 16-23 (17 to 24 bits): that byte's low bits the hash takes, in place.
    fn mask(self, i: u32) -> u32 {
        match self.bits {
            9..=15 => (i & ((1 << (self.bits - 8)) - 1)) << 8,
            17..=24 => (i & ((1 << (self.bits - 16)) - 1)) << 16,
            _ => 0,
        }
    }
}

/// Bytes of the mask table after the slots: 256 `u32`s.
const MASK_BYTES: u64 = 256 * 4;

/// The host's copy of the lookup table, written to the guest as a whole.
#[derive(Debug, Clone)]
pub struct LookupTable {
    at: u64,
    slots: Vec<(u64, u64)>,
    hash: Hash,
    entries: usize,
    /// Slots written since [`LookupTable::take_changed`] last ran (lazy translation writes
    /// only these to the guest).
    changed: Vec<usize>,
}

impl LookupTable {
    /// A table at `at` in `bytes`: as many slots as fit before the 1 KiB mask table, and
    /// the widest [`Hash`](struct@Hash) they take.
    ///
    /// # Errors
    /// [`LookupError::TooSmall`] under 288 slots (5.5 KiB in all), the narrowest hash's
    /// homes and room past them.
    pub fn new(at: u64, bytes: u64) -> Result<Self, LookupError> {
        let slots =
            usize::try_from(bytes.saturating_sub(MASK_BYTES) / SLOT_BYTES).unwrap_or(usize::MAX);
        let hash = Hash::for_slots(slots).ok_or(LookupError::TooSmall { bytes })?;
        Ok(Self {
            at,
            slots: vec![(0, 0); slots],
            hash,
            entries: 0,
            changed: Vec::new(),
        })
    }

    /// How home slots are computed.
    #[must_use]
    pub fn hash(&self) -> Hash {
        self.hash
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
    /// [`LookupError::Full`] when the table is half full, or the probe from `original`'s
    /// home would reach the last slot (which stays empty, to end every probe).
    pub fn insert(&mut self, original: u64, cache: u64) -> Result<(), LookupError> {
        let n = self.slots.len();
        let full = LookupError::Full {
            entries: self.entries,
            slots: n,
        };
        let mut i = self.hash.home(original);
        while i + 1 < n {
            let slot = &mut self.slots[i];
            if slot.0 == original {
                slot.1 = cache;
                self.changed.push(i);
                return Ok(());
            }
            if slot.0 == 0 {
                if self.entries >= n / 2 {
                    return Err(full);
                }
                *slot = (original, cache);
                self.entries += 1;
                self.changed.push(i);
                return Ok(());
            }
            i += 1;
        }
        Err(full)
    }

    /// The cache address of `original`, as the dispatch routine finds it.
    #[must_use]
    pub fn get(&self, original: u64) -> Option<u64> {
        let mut i = self.hash.home(original);
        while let Some(&(o, c)) = self.slots.get(i) {
            match o {
                0 => return None,
                o if o == original => return Some(c),
                _ => i += 1,
            }
        }
        None
    }

    /// Probes the dispatch routine makes to find each entry (the mean, the most), and the
    /// longest run of occupied slots (a miss that lands in it probes to its end).
    #[must_use]
    pub fn probe_lengths(&self) -> (f64, usize, usize) {
        let (mut sum, mut most, mut run, mut longest) = (0usize, 0usize, 0usize, 0usize);
        for (i, &(o, _)) in self.slots.iter().enumerate() {
            if o == 0 {
                run = 0;
                continue;
            }
            run += 1;
            longest = longest.max(run);
            let n = i + 1 - self.hash.home(o);
            sum += n;
            most = most.max(n);
        }
        (sum as f64 / self.entries.max(1) as f64, most, longest)
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

    /// The table's bytes, as the guest reads them: the slots, then the hash's mask table.
    #[must_use]
    pub fn to_bytes(&self) -> Vec<u8> {
        self.slots
            .iter()
            .flat_map(|(o, c)| o.to_le_bytes().into_iter().chain(c.to_le_bytes()))
            .chain((0..256).flat_map(|i| self.hash.mask(i).to_le_bytes()))
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
    let bytes = table.slots() as u64 * SLOT_BYTES;
    let masks = i32::try_from(bytes).map_err(|_| LookupError::TooLarge { bytes })?;
    let build = || -> Result<Vec<u8>, iced_x86::IcedError> {
        let mut a = CodeAssembler::new(64)?;
        let mut probe = a.create_label();
        let mut hit = a.create_label();
        let mut miss = a.create_label();
        a.push(rax)?;
        a.push(rcx)?;
        a.push(rdx)?;
        a.push(rbx)?;
        a.mov(rdx, qword_ptr(rsp + 32))?;
        a.mov(rbx, table.addr())?;
        // The home slot into eax ([`Hash::home`]): the low byte or 16 bits by `movzx`,
        // the next byte's low bits from the mask table.
        let bits = table.hash().bits;
        if bits < 16 {
            a.movzx(eax, dl)?;
        } else {
            a.movzx(eax, dx)?;
        }
        if bits != 8 && bits != 16 {
            if bits < 16 {
                a.movzx(ecx, dh)?;
            } else {
                a.mov(ecx, edx)?;
                a.bswap(ecx)?;
                // ch is now bits 16-23.
                a.movzx(ecx, ch)?;
            }
            a.mov(ecx, dword_ptr(rbx + rcx * 4 + masks))?;
            a.lea(eax, rax + rcx)?;
        }
        // Two quadwords a slot.
        a.lea(eax, rax + rax)?;
        a.not(rdx)?;
        a.set_label(&mut probe)?;
        a.mov(rcx, qword_ptr(rbx + rax * 8))?;
        a.jrcxz(miss)?;
        // key + !target + 1 = key - target.
        a.lea(rcx, rcx + rdx + 1)?;
        a.jrcxz(hit)?;
        a.lea(eax, rax + 2)?;
        a.jmp(probe)?;
        a.set_label(&mut hit)?;
        a.mov(rcx, qword_ptr(rbx + rax * 8 + 8))?;
        a.mov(qword_ptr(rsp + 32), rcx)?;
        a.set_label(&mut miss)?;
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
    /// The stack grows down from here, towards the routine at `CODE`.
    const STACK: u64 = CODE + 0x1000;
    const TABLE: u64 = CODE + 0x2000;
    /// Flags set on entry: CF, ZF, OF (and SF clear), which the routine must keep.
    const FLAGS_IN: u64 = 0x1 | 0x40 | 0x800;

    /// Runs the dispatch routine with `target` on the stack; returns where it went and
    /// the registers it left.
    fn dispatch(table: &LookupTable, target: u64, halt: u64) -> (RunEnd, X86Registers) {
        let mut m = UnicornMachine::new(Isa::X86_64).unwrap();
        m.map(CODE, 0x80_0000).unwrap();
        let code = dispatch_routine(CODE, table).unwrap();
        m.write(CODE, &code).unwrap();
        m.write(TABLE, &table.to_bytes()).unwrap();
        m.write(STACK - 8, &target.to_le_bytes()).unwrap();
        m.set_halt(Some(halt)).unwrap();
        m.set_budget(1_000_000);
        let mut regs = X86Registers {
            rip: CODE,
            rflags: 0x2 | FLAGS_IN,
            ..X86Registers::default()
        };
        for (i, r) in regs.gpr.iter_mut().enumerate() {
            *r = 0x1111 * (i as u64 + 1);
        }
        // GDB's order: rax, rbx, rcx, rdx, rsi, rdi, rbp, rsp, r8-r15.
        regs.gpr[7] = STACK - 8;
        m.set_x86_registers(&regs).unwrap();
        let end = m.run().unwrap();
        let RegisterFile::X86_64(after) = m.registers(VCPU).unwrap() else {
            panic!("not x86-64")
        };
        (end, after)
    }

    /// Registers and flags as the routine found them, the target popped.
    fn assert_kept(regs: &X86Registers) {
        for (i, &r) in regs.gpr.iter().enumerate() {
            let expected = if i == 7 {
                STACK
            } else {
                0x1111 * (i as u64 + 1)
            };
            assert_eq!(r, expected, "register {i}");
        }
        assert_eq!(regs.rflags & 0x8d5, FLAGS_IN);
    }

    #[test]
    fn a_known_target_continues_at_its_translation_with_registers_and_flags_kept() {
        let mut table = LookupTable::new(TABLE, 0x2000).unwrap();
        for k in 0..20u64 {
            table
                .insert(0xffff_ffff_8100_0000 + k * 16, CODE + 0x1_0000 + k)
                .unwrap();
        }
        let target = 0xffff_ffff_8100_0000 + 7 * 16;

        let (end, regs) = dispatch(&table, target, CODE + 0x1_0007);

        assert_eq!(end, RunEnd::Halted(CODE + 0x1_0007));
        assert_kept(&regs);
    }

    #[test]
    fn an_unknown_target_continues_at_the_original_address() {
        let mut table = LookupTable::new(TABLE, 0x2000).unwrap();
        table
            .insert(0xffff_ffff_8100_0010, CODE + 0x1_0000)
            .unwrap();
        let target = 0xffff_ffff_8100_0020;

        let (end, regs) = dispatch(&table, target, target);

        assert_eq!(end, RunEnd::Halted(target));
        assert_kept(&regs);
    }

    #[test]
    fn every_hash_finds_what_the_host_inserted_and_misses_the_rest() {
        // Pseudo-random kernel-text addresses (an LCG), some with the same low bits.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            0xffff_ffff_8100_0000 + ((x >> 33) & 0x1ff_ffff)
        };
        for (bytes, bits) in [
            (0x2000, 8),
            (0x4000, 9),
            (0xc000, 11),
            (0x13_0000, 16),
            (0x50_0000, 18),
        ] {
            let hash = Hash { bits };
            let mut table = LookupTable::new(TABLE, bytes).unwrap();
            assert_eq!(table.hash(), hash);
            let mut targets: Vec<u64> = (0..200).map(|_| next()).collect();
            targets.extend((0..8).map(|k| 0xffff_ffff_8200_0000 + (k << 16) + 0x123));
            targets.sort_unstable();
            targets.dedup();
            for (k, &t) in targets.iter().enumerate() {
                table.insert(t, CODE + 0x70_0000 + k as u64).unwrap();
            }
            for (k, &t) in targets.iter().enumerate().step_by(23) {
                let cache = CODE + 0x70_0000 + k as u64;
                assert_eq!(table.get(t), Some(cache));
                let (end, regs) = dispatch(&table, t, cache);
                assert_eq!(end, RunEnd::Halted(cache), "{hash:?} {t:#x}");
                assert_kept(&regs);
            }
            let absent = 0xffff_ffff_8300_0123;
            assert_eq!(table.get(absent), None);
            let (end, regs) = dispatch(&table, absent, absent);
            assert_eq!(end, RunEnd::Halted(absent), "{hash:?}");
            assert_kept(&regs);
        }
    }

    #[test]
    fn colliding_targets_are_all_found_and_the_table_refuses_past_half_full() {
        let mut table = LookupTable::new(TABLE, 512 * SLOT_BYTES + MASK_BYTES).unwrap();
        assert_eq!(table.hash(), Hash { bits: 8 });
        // All have the same home slot: targets that differ only above bit 8.
        let targets: Vec<u64> = (1..=256u64).map(|k| k << 20).collect();
        for (k, t) in targets.iter().enumerate() {
            table.insert(*t, 100 + k as u64).unwrap();
        }

        let next = table.insert(257 << 20, 1);

        assert!(matches!(
            next,
            Err(LookupError::Full {
                entries: 256,
                slots: 512
            })
        ));
        for (k, t) in targets.iter().enumerate() {
            assert_eq!(table.get(*t), Some(100 + k as u64));
        }
        assert_eq!(table.get(300 << 20), None);
    }

    #[test]
    fn a_probe_never_reaches_the_last_slot_and_small_tables_are_refused() {
        // 300 slots: homes 0-255; a run from home 255 may take slots up to 298, never 299.
        let mut table = LookupTable::new(TABLE, 300 * SLOT_BYTES + MASK_BYTES).unwrap();
        let at_255: Vec<u64> = (1..=45u64).map(|k| (k << 20) | 0xff).collect();
        for t in &at_255[..44] {
            table.insert(*t, 1).unwrap();
        }

        let last = table.insert(at_255[44], 1);

        assert!(matches!(last, Err(LookupError::Full { .. })), "{last:?}");
        assert_eq!(table.to_bytes()[299 * 16..300 * 16].to_vec(), vec![0u8; 16]);
        assert!(matches!(
            LookupTable::new(TABLE, 287 * SLOT_BYTES + MASK_BYTES),
            Err(LookupError::TooSmall { .. })
        ));
    }
}
