//! One `struct orc_entry`: its bytes, the three bit layouts Linux has used, and the rule it
//! encodes (how to find the caller's stack pointer, frame pointer and return address).

use std::fmt;

/// Bytes in one `struct orc_entry`.
pub const ENTRY_SIZE: usize = 6;

/// Bytes in the `.orc_header` build hash (a SHA-1).
pub const HEADER_SIZE: usize = 20;

/// A base register of an ORC rule (`ORC_REG_*`, the same numbers in every layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrcReg {
    /// `ORC_REG_UNDEFINED` (0): no rule; for the frame pointer, "unchanged".
    Undefined,
    /// `ORC_REG_PREV_SP` (1): the caller's stack pointer (the CFA).
    PrevSp,
    /// `ORC_REG_DX` (2).
    Dx,
    /// `ORC_REG_DI` (3).
    Di,
    /// `ORC_REG_BP` (4).
    Bp,
    /// `ORC_REG_SP` (5).
    Sp,
    /// `ORC_REG_R10` (6).
    R10,
    /// `ORC_REG_R13` (7).
    R13,
    /// `ORC_REG_BP_INDIRECT` (8): the value stored at `bp + offset`.
    BpIndirect,
    /// `ORC_REG_SP_INDIRECT` (9): the value stored at `sp`, plus the offset.
    SpIndirect,
    /// 10 to 15: no meaning in any kernel so far.
    Unknown(u8),
}

impl OrcReg {
    /// The register numbered `value` (the low 4 bits are used).
    pub fn from_bits(value: u16) -> Self {
        match value & 0xf {
            0 => Self::Undefined,
            1 => Self::PrevSp,
            2 => Self::Dx,
            3 => Self::Di,
            4 => Self::Bp,
            5 => Self::Sp,
            6 => Self::R10,
            7 => Self::R13,
            8 => Self::BpIndirect,
            9 => Self::SpIndirect,
            // The mask keeps the value below 16, so the cast cannot truncate.
            other => Self::Unknown(other as u8),
        }
    }

    /// Whether a stack pointer based on this register may be on another stack than the
    /// current one (an entry or IRQ-stack switch) rather than further up the same stack.
    pub fn may_switch_stacks(self) -> bool {
        matches!(
            self,
            Self::SpIndirect | Self::BpIndirect | Self::R10 | Self::R13 | Self::Di | Self::Dx
        )
    }
}

impl fmt::Display for OrcReg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Undefined => f.write_str("undefined"),
            Self::PrevSp => f.write_str("prev_sp"),
            Self::Dx => f.write_str("dx"),
            Self::Di => f.write_str("di"),
            Self::Bp => f.write_str("bp"),
            Self::Sp => f.write_str("sp"),
            Self::R10 => f.write_str("r10"),
            Self::R13 => f.write_str("r13"),
            Self::BpIndirect => f.write_str("bp(ind)"),
            Self::SpIndirect => f.write_str("sp(ind)"),
            Self::Unknown(n) => write!(f, "reg{n}"),
        }
    }
}

/// What an entry says the code at its address is, normalised over the layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrcType {
    /// No unwind information here (a gap terminator, or code objtool could not follow):
    /// unwinding through it is an error.
    Undefined,
    /// The bottom of a stack (kernel-thread start, entry from user mode before the
    /// `pt_regs` are complete): the unwind ends here, successfully.
    EndOfStack,
    /// A normal function frame: the return address sits just below the caller's stack
    /// pointer.
    Call,
    /// A full `struct pt_regs` sits at the computed stack pointer (interrupt, exception or
    /// syscall entry).
    Regs,
    /// Only the hardware iret frame (`ip, cs, flags, sp, ss`) sits at the computed stack
    /// pointer.
    RegsPartial,
    /// A type value no kernel defines for this layout.
    Unknown(u8),
}

/// The bit layout of the 16-bit field of `struct orc_entry`, which changed twice.
///
/// | layout | bits 0-3 | 4-7 | 8.. | |
/// |---|---|---|---|---|
/// | [`OrcLayout::Linux4_14`] | sp_reg | bp_reg | type:2 (CALL 0, REGS 1, REGS_PARTIAL 2) | end:1 |
/// | [`OrcLayout::Linux6_3`] | sp_reg | bp_reg | type:2 (as above) | signal:1, end:1 |
/// | [`OrcLayout::Linux6_4`] | sp_reg | bp_reg | type:3 (UNDEFINED 0, END_OF_STACK 1, CALL 2, REGS 3, REGS_PARTIAL 4) | signal:1 |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OrcLayout {
    /// Linux 4.14 to 6.2, and every 6.1.y stable kernel (Debian bookworm's included).
    Linux4_14,
    /// Linux 6.3 (commit ffb1b4a41016 added the `signal` bit).
    Linux6_3,
    /// Linux 6.4 and later (commit fb799447ae29 made the type 3 bits wide and the end of
    /// the stack a type).
    Linux6_4,
}

/// The `.orc_header` hash of each layout: SHA-1 over the `#define ORC_REG_*`/`ORC_TYPE_*`
/// lines and the `struct orc_entry` definition of `arch/x86/include/asm/orc_types.h`, as
/// `scripts/orc_hash.sh` computes it.
///
/// The 6.4 value matches the `ORC_HASH` of independently built 6.x kernels. The 6.3 value is
/// computed from that header at blob 1343a62 (Linux 6.3.10 and later 6.3.y carry the
/// header); the 4.14 value from the 6.1.y header, in case a stable tree ever gains the
/// section (6.1.y has none).
pub const KNOWN_HEADERS: [(OrcLayout, [u8; HEADER_SIZE]); 3] = [
    (
        OrcLayout::Linux6_4,
        [
            0xfe, 0x5d, 0x32, 0xbf, 0x58, 0x1b, 0xd6, 0x3b, 0x2c, 0xa9, 0xa5, 0xc6, 0x5b, 0xa5,
            0xa6, 0x25, 0xea, 0xb3, 0xfe, 0x24,
        ],
    ),
    (
        OrcLayout::Linux6_3,
        [
            0xdb, 0x84, 0xae, 0xd4, 0x10, 0x3b, 0x31, 0xdd, 0x51, 0xe0, 0x17, 0xf8, 0xf7, 0x97,
            0x83, 0xca, 0x98, 0x5c, 0x2c, 0x51,
        ],
    ),
    (
        OrcLayout::Linux4_14,
        [
            0x02, 0x80, 0x3c, 0x7f, 0x34, 0x54, 0xab, 0xa6, 0x9f, 0x6e, 0xda, 0x15, 0xa1, 0xae,
            0x8f, 0x6d, 0x17, 0x6e, 0x59, 0xc8,
        ],
    ),
];

impl OrcLayout {
    /// The layout whose `.orc_header` hash is `header`, if it is one of [`KNOWN_HEADERS`].
    pub fn from_header(header: &[u8]) -> Option<Self> {
        KNOWN_HEADERS
            .iter()
            .find(|(_, hash)| hash.as_slice() == header)
            .map(|(layout, _)| *layout)
    }

    /// The layout of a table without `.orc_header` (every kernel before 6.4 but late 6.3.y):
    /// [`OrcLayout::Linux6_3`] when any entry has bit 11 set (its `end` bit, which every
    /// kernel's entry code uses), else [`OrcLayout::Linux4_14`], which never sets it.
    pub fn detect_headerless<'a>(entries: impl IntoIterator<Item = &'a RawOrcEntry>) -> Self {
        if entries
            .into_iter()
            .any(|entry| entry.flags & (1 << 11) != 0)
        {
            Self::Linux6_3
        } else {
            Self::Linux4_14
        }
    }
}

/// One `struct orc_entry` as stored: two little-endian `s16` offsets and the bitfield.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RawOrcEntry {
    /// `sp_offset`: added to the `sp_reg` base.
    pub sp_offset: i16,
    /// `bp_offset`: where the caller's frame pointer is saved, from the `bp_reg` base.
    pub bp_offset: i16,
    /// The 16-bit field holding `sp_reg`, `bp_reg`, `type` and the `end`/`signal` bits.
    pub flags: u16,
}

impl RawOrcEntry {
    /// Reads an entry from its 6 bytes.
    pub fn from_bytes(bytes: [u8; ENTRY_SIZE]) -> Self {
        Self {
            sp_offset: i16::from_le_bytes([bytes[0], bytes[1]]),
            bp_offset: i16::from_le_bytes([bytes[2], bytes[3]]),
            flags: u16::from_le_bytes([bytes[4], bytes[5]]),
        }
    }

    /// Encodes an entry (the inverse of [`RawOrcEntry::from_bytes`]).
    pub fn to_bytes(self) -> [u8; ENTRY_SIZE] {
        let [s0, s1] = self.sp_offset.to_le_bytes();
        let [b0, b1] = self.bp_offset.to_le_bytes();
        let [f0, f1] = self.flags.to_le_bytes();
        [s0, s1, b0, b1, f0, f1]
    }

    /// The rule this entry encodes under `layout`.
    pub fn decode(self, layout: OrcLayout) -> OrcEntry {
        let sp_reg = OrcReg::from_bits(self.flags);
        let bp_reg = OrcReg::from_bits(self.flags >> 4);
        let bit = |n: u16| self.flags & (1 << n) != 0;
        let (kind, signal) = match layout {
            OrcLayout::Linux4_14 | OrcLayout::Linux6_3 => {
                let end = if layout == OrcLayout::Linux4_14 {
                    bit(10)
                } else {
                    bit(11)
                };
                // Before 6.4 an undefined sp_reg meant "stop": at the end of the stack when
                // the end bit is set, with an error otherwise.
                let kind = match (sp_reg, end, (self.flags >> 8) & 0x3) {
                    (OrcReg::Undefined, true, _) => OrcType::EndOfStack,
                    (OrcReg::Undefined, false, _) => OrcType::Undefined,
                    (_, _, 0) => OrcType::Call,
                    (_, _, 1) => OrcType::Regs,
                    (_, _, 2) => OrcType::RegsPartial,
                    (_, _, other) => OrcType::Unknown(other as u8),
                };
                // 4.14 has no signal bit: a regs frame's ip is always the exact one.
                let signal = if layout == OrcLayout::Linux4_14 {
                    matches!(kind, OrcType::Regs | OrcType::RegsPartial)
                } else {
                    bit(10)
                };
                (kind, signal)
            }
            OrcLayout::Linux6_4 => {
                let kind = match (self.flags >> 8) & 0x7 {
                    0 => OrcType::Undefined,
                    1 => OrcType::EndOfStack,
                    2 => OrcType::Call,
                    3 => OrcType::Regs,
                    4 => OrcType::RegsPartial,
                    other => OrcType::Unknown(other as u8),
                };
                (kind, bit(11))
            }
        };
        OrcEntry {
            sp_reg,
            sp_offset: self.sp_offset,
            bp_reg,
            bp_offset: self.bp_offset,
            kind,
            signal,
        }
    }
}

/// The rule of one entry: how to compute the caller's registers from this frame's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OrcEntry {
    /// Base of the caller's stack pointer.
    pub sp_reg: OrcReg,
    /// Added to the base (after the load, for [`OrcReg::SpIndirect`]).
    pub sp_offset: i16,
    /// Where the caller's frame pointer is: [`OrcReg::Undefined`] (unchanged),
    /// [`OrcReg::PrevSp`] or [`OrcReg::Bp`] plus `bp_offset`.
    pub bp_reg: OrcReg,
    /// Offset of the saved frame pointer from `bp_reg`.
    pub bp_offset: i16,
    /// What kind of frame the caller's registers come from.
    pub kind: OrcType,
    /// The caller's ip is exact (an interrupted instruction), not a return address, so its
    /// own lookup must not step back one byte.
    pub signal: bool,
}

impl OrcEntry {
    /// The entry the kernel uses for ip 0 (a call through a NULL function pointer): the
    /// return address is on top of the stack.
    pub const NULL_CALL: Self = Self {
        sp_reg: OrcReg::Sp,
        sp_offset: 8,
        bp_reg: OrcReg::Undefined,
        bp_offset: 0,
        kind: OrcType::Call,
        signal: false,
    };

    /// The kernel's guess for code without ORC data (BPF, trampolines): a frame-pointer
    /// frame, `push %rbp; mov %rsp, %rbp`.
    pub const FRAME_POINTER_GUESS: Self = Self {
        sp_reg: OrcReg::Bp,
        sp_offset: 16,
        bp_reg: OrcReg::PrevSp,
        bp_offset: -16,
        kind: OrcType::Call,
        signal: false,
    };
}

impl fmt::Display for OrcEntry {
    /// After objtool's `orc_dump`: `sp:sp+8 bp:prev_sp-16 type:call signal:0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            OrcType::Undefined => "(und)",
            OrcType::EndOfStack => "end",
            OrcType::Call => "call",
            OrcType::Regs => "regs",
            OrcType::RegsPartial => "regs (partial)",
            OrcType::Unknown(_) => "?",
        };
        write!(f, "sp:{}{:+}", self.sp_reg, self.sp_offset)?;
        if self.bp_reg == OrcReg::Undefined {
            write!(f, " bp:(und)")?;
        } else {
            write!(f, " bp:{}{:+}", self.bp_reg, self.bp_offset)?;
        }
        write!(f, " type:{kind} signal:{}", u8::from(self.signal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(sp_reg: u16, bp_reg: u16, high: u16) -> RawOrcEntry {
        RawOrcEntry {
            sp_offset: 8,
            bp_offset: -16,
            flags: sp_reg | (bp_reg << 4) | (high << 8),
        }
    }

    #[test]
    fn raw_entry_round_trips_through_its_bytes() {
        let entry = RawOrcEntry {
            sp_offset: -24,
            bp_offset: 16,
            flags: 0x0215,
        };

        let decoded = RawOrcEntry::from_bytes(entry.to_bytes());

        assert_eq!(decoded, entry);
    }

    #[test]
    fn linux_4_14_layout_reads_call_with_sp_base() {
        let entry = raw(5, 1, 0);

        let rule = entry.decode(OrcLayout::Linux4_14);

        assert_eq!(
            (rule.sp_reg, rule.bp_reg, rule.kind, rule.signal),
            (OrcReg::Sp, OrcReg::PrevSp, OrcType::Call, false)
        );
    }

    #[test]
    fn linux_4_14_layout_treats_regs_frames_as_signal_frames() {
        let regs = raw(5, 0, 1).decode(OrcLayout::Linux4_14);
        let partial = raw(5, 0, 2).decode(OrcLayout::Linux4_14);

        assert_eq!(
            (regs.kind, regs.signal, partial.kind, partial.signal),
            (OrcType::Regs, true, OrcType::RegsPartial, true)
        );
    }

    #[test]
    fn linux_4_14_layout_end_bit_with_undefined_sp_is_end_of_stack() {
        let end = raw(0, 0, 0b100).decode(OrcLayout::Linux4_14);
        let undefined = raw(0, 0, 0).decode(OrcLayout::Linux4_14);

        assert_eq!(
            (end.kind, undefined.kind),
            (OrcType::EndOfStack, OrcType::Undefined)
        );
    }

    #[test]
    fn linux_6_3_layout_moves_end_to_bit_11_and_adds_signal() {
        let end = raw(0, 0, 0b1000).decode(OrcLayout::Linux6_3);
        let call_signal = raw(5, 0, 0b0100).decode(OrcLayout::Linux6_3);

        assert_eq!(
            (end.kind, call_signal.kind, call_signal.signal),
            (OrcType::EndOfStack, OrcType::Call, true)
        );
    }

    #[test]
    fn linux_6_4_layout_reads_three_bit_types() {
        let kinds: Vec<OrcType> = (0..8)
            .map(|t| raw(5, 0, t).decode(OrcLayout::Linux6_4).kind)
            .collect();

        assert_eq!(
            kinds,
            [
                OrcType::Undefined,
                OrcType::EndOfStack,
                OrcType::Call,
                OrcType::Regs,
                OrcType::RegsPartial,
                OrcType::Unknown(5),
                OrcType::Unknown(6),
                OrcType::Unknown(7),
            ]
        );
    }

    #[test]
    fn linux_6_4_layout_reads_signal_from_bit_11() {
        let entry = raw(5, 0, 0b1011).decode(OrcLayout::Linux6_4);

        assert_eq!((entry.kind, entry.signal), (OrcType::Regs, true));
    }

    #[test]
    fn header_hashes_name_their_layouts() {
        let layouts: Vec<Option<OrcLayout>> = KNOWN_HEADERS
            .iter()
            .map(|(_, hash)| OrcLayout::from_header(hash))
            .collect();

        assert_eq!(
            layouts,
            [
                Some(OrcLayout::Linux6_4),
                Some(OrcLayout::Linux6_3),
                Some(OrcLayout::Linux4_14)
            ]
        );
    }

    #[test]
    fn unknown_header_hash_names_no_layout() {
        let layout = OrcLayout::from_header(&[0xaa; HEADER_SIZE]);

        assert_eq!(layout, None);
    }

    #[test]
    fn headerless_detection_picks_6_3_only_when_bit_11_is_used() {
        let old = [raw(5, 0, 0), raw(0, 0, 0b100)];
        let new = [raw(5, 0, 0), raw(0, 0, 0b1000)];

        let detected = (
            OrcLayout::detect_headerless(&old),
            OrcLayout::detect_headerless(&new),
        );

        assert_eq!(detected, (OrcLayout::Linux4_14, OrcLayout::Linux6_3));
    }

    #[test]
    fn entry_displays_like_objtool_orc_dump() {
        let entry = raw(5, 1, 0).decode(OrcLayout::Linux4_14);

        assert_eq!(
            entry.to_string(),
            "sp:sp+8 bp:prev_sp-16 type:call signal:0"
        );
    }
}
