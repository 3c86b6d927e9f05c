//! Target variables by their DWARF location at the probe address (`$locals`, and `$params`
//! anywhere inside a function), for the compiled bodies and the host-evaluated ones alike.
//!
//! At a statement probe (`kernel.statement("f+OFFSET")`, `.absolute`) a parameter is rarely
//! still in its argument register and a local lives wherever the compiler put it at that pc.
//! The -dbg vmlinux says where: [`exotap_introspect::dwarf::DebugInfo::scope_at`] gives the
//! variables in scope at the pc (the innermost function's, as gdb shows them in frame 0) with
//! their location list entry there, and [`locals_at`] turns each into a [`Local`]: a saved
//! register, a register plus a constant, a stack or memory slot (`DW_OP_breg`, and
//! `DW_OP_fbreg` from a CFA frame base, the CFA taken from `.debug_frame`), or a constant.
//! Anything else (`DW_OP_entry_value`, pieces, computed values) is refused by name with the
//! expression, and a variable with no location at that pc is "optimized out" there: both
//! are errors when the script starts, as SystemTap's are.
//!
//! Without a -dbg vmlinux, function entries keep the BTF parameters in their ABI registers
//! (codegen's `target`) and statement probes have no target variables.

use std::collections::BTreeMap;

use exotap_introspect::dwarf::vars::{FrameBase, Location, ScopeAt};
use exotap_introspect::dwarf::DebugInfo;

use super::types::Step;

/// DWARF register numbers (x86-64 psABI) up to r15.
const LAST_GPR: u16 = 15;
/// DWARF's `rsp`.
pub const DWARF_RSP: u16 = 7;

/// Where a variable's value is at the probe address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// In a general register (DWARF number).
    Register(u16),
    /// A register plus a constant is the value (`DW_OP_bregN k; DW_OP_stack_value`).
    Computed {
        /// DWARF register.
        reg: u16,
        /// Added to it.
        add: i64,
    },
    /// In memory at register + offset (a stack slot, `DW_OP_bregN`, `DW_OP_fbreg`).
    Memory {
        /// DWARF register.
        base: u16,
        /// Byte offset.
        offset: i64,
    },
    /// A constant (`DW_AT_const_value`, `DW_OP_lit`/`constu; stack_value`).
    Const(i64),
    /// A link-time address is the value (`DW_OP_addr; stack_value`): the live value is it
    /// plus the KASLR slide.
    Address(u64),
}

/// A target variable at one probe address: where it is and how to read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Local {
    /// Where.
    pub place: Place,
    /// Bytes of its type (1, 2, 4 or 8).
    pub size: u8,
    /// Sign-extended.
    pub signed: bool,
    /// For a pointer to a struct or union: `struct NAME`, from which `$var->m` is laid out.
    pub pointee: Option<String>,
    /// A parameter of the function (else a local).
    pub is_param: bool,
}

/// The target variables at one probe address: name (without `$`) to the variable, or why it
/// cannot be read there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Locals {
    /// The function whose variables they are (an inlined one's own name).
    pub function: String,
    /// By name.
    pub vars: BTreeMap<String, Result<Local, String>>,
    /// The names in the order DWARF declares them (parameters first), each with whether it
    /// is a parameter, as `$$locals` and `$$vars` list them.
    pub order: Vec<(String, bool)>,
}

impl Locals {
    /// The variable `name` (with or without the `$`).
    pub fn get(&self, name: &str) -> Option<&Result<Local, String>> {
        self.vars.get(name.trim_start_matches('$'))
    }

    /// The names, with `$`, for an error's list of alternatives.
    pub fn names(&self) -> String {
        let names: Vec<String> = self.vars.keys().map(|n| format!("${n}")).collect();
        names.join(" ")
    }
}

impl Local {
    /// The value read on the host: `reg` gives a DWARF register's value at the probe
    /// address, `read` guest memory (address, length → bytes), `slide` the kernel's KASLR
    /// slide (for a link-time address that is the value).
    ///
    /// # Errors
    /// The address that could not be read.
    pub fn value(
        &self,
        reg: impl Fn(u16) -> u64,
        read: impl FnMut(u64, usize) -> Option<Vec<u8>>,
        slide: u64,
    ) -> Result<i64, u64> {
        let raw = match self.place {
            Place::Const(v) => return Ok(v),
            Place::Address(a) => a.wrapping_add(slide),
            Place::Register(r) => reg(r),
            Place::Computed { reg: r, add } => reg(r).wrapping_add(add as u64),
            Place::Memory { base, offset } => {
                return Step::follow(&self.steps(offset), reg(base), &[], read);
            }
        };
        Ok(self.extend(raw))
    }

    /// The read of a variable in memory at a base register + `offset`.
    pub fn steps(&self, offset: i64) -> Vec<Step> {
        vec![Step::Read {
            offset: offset as u64,
            size: self.size,
            signed: self.signed,
        }]
    }

    /// A register's bits cut to the variable's size and extended as its type says.
    pub fn extend(&self, raw: u64) -> i64 {
        let shift = 64 - 8 * u32::from(self.size);
        if shift == 0 {
            raw as i64
        } else if self.signed {
            ((raw << shift) as i64) >> shift
        } else {
            ((raw << shift) >> shift) as i64
        }
    }
}

/// The target variables at the link-time address `pc`.
///
/// # Errors
/// A sentence when no function's debug info covers `pc`, or the DWARF cannot be read.
pub fn locals_at(info: &DebugInfo<'_>, pc: u64) -> Result<Locals, String> {
    let scope = info
        .scope_at(pc)
        .map_err(|e| format!("cannot read the debug info at {pc:#x}: {e}"))?
        .ok_or_else(|| format!("no function's debug info covers {pc:#x}"))?;
    let cfa = match scope.frame_base {
        Some(FrameBase::Cfa) => info.cfa_at(pc).ok().flatten(),
        _ => None,
    };
    Ok(from_scope(info, &scope, pc, cfa))
}

fn from_scope(info: &DebugInfo<'_>, scope: &ScopeAt, pc: u64, cfa: Option<(u16, i64)>) -> Locals {
    let mut vars = BTreeMap::new();
    let mut order = Vec::new();
    for v in &scope.vars {
        if !vars.contains_key(&v.name) {
            order.push((v.name.clone(), v.is_param));
        }
        let local = info
            .scalar(v.ty)
            .ok_or_else(|| {
                format!(
                    "${} is a {}, not an integer or pointer",
                    v.name,
                    v.type_name.trim_end_matches(v.name.as_str()).trim_end()
                )
            })
            .and_then(|s| {
                let place = place(&v.at_entry, &scope.frame_base, cfa)
                    .map_err(|why| format!("${} {why} at {pc:#x}", v.name))?;
                // A value that is a word's low 32 bits is read as 4 bytes at most.
                let size = if matches!(v.at_entry, Location::FrameLow32(_)) {
                    s.size.min(4)
                } else {
                    s.size
                };
                Ok(Local {
                    place,
                    size,
                    signed: s.signed,
                    pointee: s.pointee,
                    is_param: v.is_param,
                })
            });
        vars.insert(v.name.clone(), local);
    }
    let function = if scope.inlined {
        format!("{} (inlined into {})", scope.function, scope.out_of_line)
    } else {
        scope.function.clone()
    };
    Locals {
        function,
        vars,
        order,
    }
}

/// A location as a [`Place`], or why not (a phrase: "is optimized out", "lives at ...").
fn place(
    at: &Location,
    frame_base: &Option<FrameBase>,
    cfa: Option<(u16, i64)>,
) -> Result<Place, String> {
    let gpr = |r: u16| {
        if r <= LAST_GPR {
            Ok(r)
        } else {
            Err(format!(
                "is in {}, not a general register",
                exotap_introspect::dwarf::vars::register_name(r)
            ))
        }
    };
    match at {
        Location::Register(r) => Ok(Place::Register(gpr(*r)?)),
        Location::Memory { base, offset } => Ok(Place::Memory {
            base: gpr(*base)?,
            offset: *offset,
        }),
        Location::Const(v) => Ok(Place::Const(*v)),
        // Little-endian: the word's low 32 bits are the 4 bytes at its address (the caller
        // reads at most 4, [`from_scope`]).
        Location::FrameLow32(off) => place(&Location::Frame(*off), frame_base, cfa),
        Location::Frame(off) => match (frame_base, cfa) {
            (Some(FrameBase::Cfa), Some((reg, cfa_off))) => Ok(Place::Memory {
                base: gpr(reg)?,
                offset: cfa_off
                    .checked_add(*off)
                    .ok_or("has a frame offset that overflows")?,
            }),
            (Some(FrameBase::Cfa), None) => {
                Err("lives in the frame, but no call frame information covers the pc".into())
            }
            (base, _) => Err(format!(
                "lives at frame base{off:+} and the frame base is {}",
                base.as_ref()
                    .map_or("missing".to_owned(), |b| format!("{b:?}"))
            )),
        },
        Location::OptimizedOut => Err("is optimized out".into()),
        Location::Address(a) => Err(format!(
            "is a static variable at {a:#x} (read it with @var or kernel_long)"
        )),
        Location::AddressValue(a) => Ok(Place::Address(*a)),
        Location::Value { base, offset } => Ok(Place::Computed {
            reg: gpr(*base)?,
            add: *offset,
        }),
        Location::Expr(e) => Err(format!(
            "has a location exotap cannot read: the DWARF expression {e}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local(place: Place, size: u8, signed: bool) -> Local {
        Local {
            place,
            size,
            signed,
            pointee: None,
            is_param: false,
        }
    }

    #[test]
    fn a_register_value_is_cut_to_its_type_and_extended_as_it_says() {
        let regs = |r: u16| if r == 3 { 0xdead_beef_ffff_fff0 } else { 0 };
        let none = |_: u64, _: usize| None;

        assert_eq!(
            local(Place::Register(3), 4, true).value(regs, none, 0),
            Ok(-16)
        );
        assert_eq!(
            local(Place::Register(3), 4, false).value(regs, none, 0),
            Ok(0xffff_fff0)
        );
        assert_eq!(
            local(Place::Computed { reg: 3, add: 0x10 }, 8, false).value(regs, none, 0),
            Ok(0xdead_bef0_0000_0000u64 as i64)
        );
    }

    #[test]
    fn a_link_time_address_that_is_the_value_is_slid() {
        let regs = |_: u16| 0;
        let none = |_: u64, _: usize| None;
        assert_eq!(
            place(&Location::AddressValue(0xffff_ffff_8100_0000), &None, None),
            Ok(Place::Address(0xffff_ffff_8100_0000))
        );
        assert_eq!(
            local(Place::Address(0xffff_ffff_8100_0000), 8, false).value(regs, none, 0x2a0_0000),
            Ok(0xffff_ffff_83a0_0000u64 as i64)
        );
    }

    #[test]
    fn a_stack_slot_is_read_at_its_register_plus_offset() {
        let regs = |r: u16| if r == DWARF_RSP { 0x1000 } else { 0 };
        let memory = |at: u64, len: usize| (at == 0x1010 && len == 2).then(|| vec![0xfe, 0xff]);

        assert_eq!(
            local(
                Place::Memory {
                    base: DWARF_RSP,
                    offset: 0x10
                },
                2,
                true
            )
            .value(regs, memory, 0),
            Ok(-2)
        );
    }

    #[test]
    fn frame_offsets_become_stack_slots_from_the_cfa_and_the_rest_is_named() {
        let cfa = Some(FrameBase::Cfa);

        assert_eq!(
            place(&Location::Frame(-160), &cfa, Some((DWARF_RSP, 168))),
            Ok(Place::Memory {
                base: DWARF_RSP,
                offset: 8
            })
        );
        assert!(place(&Location::OptimizedOut, &cfa, None)
            .unwrap_err()
            .contains("optimized out"));
        let entry = Location::Expr("entry_value(..) stack_value".into());
        assert!(place(&entry, &cfa, None)
            .unwrap_err()
            .contains("entry_value"));
        assert_eq!(
            place(
                &Location::Value {
                    base: DWARF_RSP,
                    offset: 8
                },
                &cfa,
                None
            ),
            Ok(Place::Computed {
                reg: DWARF_RSP,
                add: 8
            })
        );
        assert!(place(&Location::Register(17), &cfa, None)
            .unwrap_err()
            .contains("xmm0"));
    }
}
