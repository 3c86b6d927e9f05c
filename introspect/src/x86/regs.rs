//! Register and status-flag sets: the state that liveness tracks.
//!
//! Only the sixteen general-purpose registers (as whole 64-bit registers) and the six
//! arithmetic status flags are tracked. Vector, segment and control registers are not:
//! the code patches exotap generates never touch them.

use core::fmt;

use iced_x86::Register;

/// DWARF register numbers 0..16 (the x86-64 psABI's numbering: rax, rdx, rcx, rbx, rsi, rdi,
/// rbp, rsp, r8..r15) as iced registers.
pub const DWARF_GPRS: [Register; 16] = [
    Register::RAX,
    Register::RDX,
    Register::RCX,
    Register::RBX,
    Register::RSI,
    Register::RDI,
    Register::RBP,
    Register::RSP,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];

/// A set of 64-bit general-purpose registers, one bit per register in iced's order
/// (rax, rcx, rdx, rbx, rsp, rbp, rsi, rdi, r8..r15).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RegSet(u16);

impl RegSet {
    /// No register.
    pub const EMPTY: Self = Self(0);
    /// All sixteen registers.
    pub const ALL: Self = Self(0xffff);

    /// SysV argument registers: rdi, rsi, rdx, rcx, r8, r9.
    pub const SYSV_ARGS: Self = Self::of(&[
        Register::RDI,
        Register::RSI,
        Register::RDX,
        Register::RCX,
        Register::R8,
        Register::R9,
    ]);
    /// SysV caller-saved (call-clobbered) registers: rax, rcx, rdx, rsi, rdi, r8..r11.
    pub const SYSV_CALLER_SAVED: Self = Self::of(&[
        Register::RAX,
        Register::RCX,
        Register::RDX,
        Register::RSI,
        Register::RDI,
        Register::R8,
        Register::R9,
        Register::R10,
        Register::R11,
    ]);
    /// SysV callee-saved registers: rbx, rbp, r12..r15 (rsp is separate).
    pub const SYSV_CALLEE_SAVED: Self = Self::of(&[
        Register::RBX,
        Register::RBP,
        Register::R12,
        Register::R13,
        Register::R14,
        Register::R15,
    ]);
    /// The SysV return-value registers: rax, rdx.
    pub const SYSV_RETURN: Self = Self::of(&[Register::RAX, Register::RDX]);
    /// The stack pointer alone.
    pub const RSP: Self = Self::of(&[Register::RSP]);

    /// The set of the given registers; sub-registers count as their full register and
    /// anything that is not a general-purpose register is ignored.
    #[must_use]
    pub const fn of(regs: &[Register]) -> Self {
        let mut bits = 0u16;
        let mut i = 0;
        while i < regs.len() {
            if let Some(index) = gpr_index(regs[i]) {
                bits |= 1 << index;
            }
            i += 1;
        }
        Self(bits)
    }

    /// The raw bits, bit `n` for the `n`-th register in iced's order.
    #[must_use]
    pub const fn bits(self) -> u16 {
        self.0
    }

    /// The set with the given raw bits.
    #[must_use]
    pub const fn from_bits(bits: u16) -> Self {
        Self(bits)
    }

    /// Whether `reg` (or the full register it is part of) is in the set.
    #[must_use]
    pub const fn contains(self, reg: Register) -> bool {
        match gpr_index(reg) {
            Some(index) => self.0 & (1 << index) != 0,
            None => false,
        }
    }

    /// The set with `reg`'s full register added.
    #[must_use]
    pub const fn with(self, reg: Register) -> Self {
        match gpr_index(reg) {
            Some(index) => Self(self.0 | (1 << index)),
            None => self,
        }
    }

    /// Union.
    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// The registers of `self` not in `other`.
    #[must_use]
    pub const fn minus(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }

    /// Whether the set is empty.
    #[must_use]
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The registers in the set, as 64-bit registers, in iced's order.
    pub fn iter(self) -> impl Iterator<Item = Register> {
        GPR64
            .iter()
            .enumerate()
            .filter(move |(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, r)| *r)
    }
}

impl fmt::Debug for RegSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

const GPR64: [Register; 16] = [
    Register::RAX,
    Register::RCX,
    Register::RDX,
    Register::RBX,
    Register::RSP,
    Register::RBP,
    Register::RSI,
    Register::RDI,
    Register::R8,
    Register::R9,
    Register::R10,
    Register::R11,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];

/// The index (0..16) of the 64-bit register that `reg` is part of, if it is a
/// general-purpose register. `ah`..`bh` map to rax..rbx.
#[must_use]
pub const fn gpr_index(reg: Register) -> Option<u8> {
    let r = reg as u32;
    let index = if r >= Register::RAX as u32 && r <= Register::R15 as u32 {
        r - Register::RAX as u32
    } else if r >= Register::EAX as u32 && r <= Register::R15D as u32 {
        r - Register::EAX as u32
    } else if r >= Register::AX as u32 && r <= Register::R15W as u32 {
        r - Register::AX as u32
    } else if r >= Register::AL as u32 && r <= Register::BL as u32 {
        r - Register::AL as u32
    } else if r >= Register::AH as u32 && r <= Register::BH as u32 {
        r - Register::AH as u32
    } else if r >= Register::SPL as u32 && r <= Register::R15L as u32 {
        r - Register::SPL as u32 + 4
    } else {
        return None;
    };
    Some(index as u8)
}

/// A set of arithmetic status flags (OF, SF, ZF, AF, CF, PF), using iced's
/// [`iced_x86::RflagsBits`] values.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct StatusFlags(u8);

impl StatusFlags {
    /// No flag.
    pub const EMPTY: Self = Self(0);
    /// Overflow flag.
    pub const OF: Self = Self(iced_x86::RflagsBits::OF as u8);
    /// Sign flag.
    pub const SF: Self = Self(iced_x86::RflagsBits::SF as u8);
    /// Zero flag.
    pub const ZF: Self = Self(iced_x86::RflagsBits::ZF as u8);
    /// Auxiliary-carry flag.
    pub const AF: Self = Self(iced_x86::RflagsBits::AF as u8);
    /// Carry flag.
    pub const CF: Self = Self(iced_x86::RflagsBits::CF as u8);
    /// Parity flag.
    pub const PF: Self = Self(iced_x86::RflagsBits::PF as u8);
    /// All six status flags.
    pub const ALL: Self =
        Self(Self::OF.0 | Self::SF.0 | Self::ZF.0 | Self::AF.0 | Self::CF.0 | Self::PF.0);

    /// The status flags among iced `RflagsBits` bits; other bits are dropped.
    #[must_use]
    pub const fn from_rflags(bits: u32) -> Self {
        Self((bits & Self::ALL.0 as u32) as u8)
    }

    /// The bits, in iced's `RflagsBits` encoding.
    #[must_use]
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// Union.
    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }

    /// The flags of `self` not in `other`.
    #[must_use]
    pub const fn minus(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }

    /// Whether the two sets share a flag.
    #[must_use]
    pub const fn intersects(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether the set is empty.
    #[must_use]
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Debug for StatusFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::OF, "OF"),
            (Self::SF, "SF"),
            (Self::ZF, "ZF"),
            (Self::AF, "AF"),
            (Self::CF, "CF"),
            (Self::PF, "PF"),
        ];
        f.debug_set()
            .entries(
                names
                    .iter()
                    .filter(|(flag, _)| self.intersects(*flag))
                    .map(|(_, name)| name),
            )
            .finish()
    }
}

/// What is live (may be read before being overwritten) at a program point.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash, Debug)]
pub struct LiveState {
    /// Live general-purpose registers.
    pub regs: RegSet,
    /// Live status flags.
    pub flags: StatusFlags,
}

impl LiveState {
    /// Nothing live.
    pub const NONE: Self = Self {
        regs: RegSet::EMPTY,
        flags: StatusFlags::EMPTY,
    };
    /// Everything live: the conservative answer where the analysis knows nothing.
    pub const ALL: Self = Self {
        regs: RegSet::ALL,
        flags: StatusFlags::ALL,
    };

    /// Union.
    #[must_use]
    pub const fn union(self, other: Self) -> Self {
        Self {
            regs: self.regs.union(other.regs),
            flags: self.flags.union(other.flags),
        }
    }

    /// `self` without what `other` holds.
    #[must_use]
    pub const fn minus(self, other: Self) -> Self {
        Self {
            regs: self.regs.minus(other.regs),
            flags: self.flags.minus(other.flags),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_registers_map_to_their_full_register() {
        let set = RegSet::of(&[Register::AL, Register::R9D, Register::SIL, Register::BH]);

        assert_eq!(
            set,
            RegSet::of(&[Register::RAX, Register::R9, Register::RSI, Register::RBX])
        );
    }

    #[test]
    fn non_gpr_registers_are_ignored() {
        let set = RegSet::of(&[Register::XMM0, Register::CR3, Register::RIP, Register::GS]);

        assert!(set.is_empty());
    }

    #[test]
    fn caller_saved_and_callee_saved_partition_all_but_rsp() {
        let union = RegSet::SYSV_CALLER_SAVED
            .union(RegSet::SYSV_CALLEE_SAVED)
            .union(RegSet::RSP);

        assert_eq!(union, RegSet::ALL);
    }

    #[test]
    fn status_flags_drop_non_status_bits() {
        let flags = StatusFlags::from_rflags(iced_x86::RflagsBits::DF | iced_x86::RflagsBits::CF);

        assert_eq!(flags, StatusFlags::CF);
    }

    #[test]
    fn iter_lists_registers_in_iced_order() {
        let regs: Vec<_> = RegSet::of(&[Register::R15, Register::RAX]).iter().collect();

        assert_eq!(regs, vec![Register::RAX, Register::R15]);
    }
}
