//! Parameters and locals of a function with their locations at its entry, as SystemTap's
//! `$var` needs them: a register, a frame slot, an address, a constant, or "optimized out".

use std::fmt;

use gimli::{AttributeValue, Operation};

use super::types::TypeRef;
use super::{DebugInfo, DieRef, DwarfError, Unit, R};
use crate::btf::cdecl::declaration;

/// x86-64 DWARF register names (System V psABI numbering).
const X86_64_REGS: [&str; 17] = [
    "rax", "rdx", "rcx", "rbx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15", "rip",
];

/// The name of DWARF register `n` on x86-64 (`xmmN` above the integer ones).
pub fn register_name(n: u16) -> String {
    match X86_64_REGS.get(usize::from(n)) {
        Some(r) => (*r).to_owned(),
        None if (17..33).contains(&n) => format!("xmm{}", n - 17),
        None => format!("reg{n}"),
    }
}

/// Where a variable lives at a pc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// In a register.
    Register(u16),
    /// At register + offset (`DW_OP_bregN`).
    Memory {
        /// Base register.
        base: u16,
        /// Offset.
        offset: i64,
    },
    /// At frame base + offset (`DW_OP_fbreg`).
    Frame(i64),
    /// At a fixed address (`DW_OP_addr`).
    Address(u64),
    /// A known constant.
    Const(i64),
    /// A DWARF expression exotap does not simplify, in text.
    Expr(String),
    /// Not available at that pc.
    OptimizedOut,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Register(r) => write!(f, "%{}", register_name(*r)),
            Location::Memory { base, offset } => write!(f, "{offset}(%{})", register_name(*base)),
            Location::Frame(off) => write!(f, "frame_base{off:+}"),
            Location::Address(a) => write!(f, "{a:#x}"),
            Location::Const(v) => write!(f, "constant {v}"),
            Location::Expr(e) => write!(f, "{e}"),
            Location::OptimizedOut => write!(f, "<optimized out>"),
        }
    }
}

/// A parameter or local.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variable {
    /// Name.
    pub name: String,
    /// A parameter (else a local).
    pub is_param: bool,
    /// Its type as C.
    pub type_name: String,
    /// Its type.
    pub ty: TypeRef,
    /// Where it is at the function's entry pc.
    pub at_entry: Location,
    /// Its DIE.
    pub die: DieRef,
}

impl fmt::Display for Variable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_param { "param" } else { "local" };
        write!(f, "{kind} {}: {}", self.type_name, self.at_entry)
    }
}

/// Simplifies a location expression to a [`Location`].
pub(crate) fn describe(expr: gimli::Expression<R<'_>>, encoding: gimli::Encoding) -> Location {
    let mut ops = expr.operations(encoding);
    let mut all = Vec::new();
    while let Ok(Some(op)) = ops.next() {
        all.push(op);
    }
    match all.as_slice() {
        [] => Location::OptimizedOut,
        [Operation::Register { register }] => Location::Register(register.0),
        [Operation::RegisterOffset {
            register, offset, ..
        }] => Location::Memory {
            base: register.0,
            offset: *offset,
        },
        [Operation::FrameOffset { offset }] => Location::Frame(*offset),
        [Operation::Address { address }] => Location::Address(*address),
        [Operation::UnsignedConstant { value }, Operation::StackValue] => {
            Location::Const(*value as i64)
        }
        [Operation::SignedConstant { value }, Operation::StackValue] => Location::Const(*value),
        [Operation::ImplicitValue { data }] => {
            Location::Expr(format!("implicit value {:02x?}", data.slice()))
        }
        other => Location::Expr(other.iter().map(op_text).collect::<Vec<_>>().join(" ")),
    }
}

fn op_text(op: &Operation<R<'_>>) -> String {
    match op {
        Operation::Register { register } => format!("%{}", register_name(register.0)),
        Operation::RegisterOffset {
            register, offset, ..
        } => format!("breg({}){offset:+}", register_name(register.0)),
        Operation::EntryValue { .. } => "entry_value(..)".into(),
        Operation::StackValue => "stack_value".into(),
        Operation::Piece { size_in_bits, .. } => format!("piece({size_in_bits} bits)"),
        Operation::UnsignedConstant { value } => format!("{value}"),
        Operation::SignedConstant { value } => format!("{value}"),
        Operation::PlusConstant { value } => format!("+{value}"),
        other => format!("{other:?}")
            .split([' ', '{', '('])
            .next()
            .unwrap_or("?")
            .to_owned(),
    }
}

impl<'a> DebugInfo<'a> {
    /// The location of a variable DIE at `pc`.
    fn location_at(
        &self,
        unit: &Unit<'a>,
        entry: &gimli::DebuggingInformationEntry<'_, '_, R<'a>>,
        pc: u64,
    ) -> Location {
        if let Ok(Some(value)) = entry.attr_value(gimli::DW_AT_const_value) {
            return match value {
                AttributeValue::Sdata(v) => Location::Const(v),
                v => v
                    .udata_value()
                    .map_or(Location::Expr("constant block".into()), |u| {
                        Location::Const(u as i64)
                    }),
            };
        }
        let Ok(Some(value)) = entry.attr_value(gimli::DW_AT_location) else {
            return Location::OptimizedOut;
        };
        if let AttributeValue::Exprloc(expr) = value {
            return describe(expr, unit.encoding());
        }
        let Ok(Some(offset)) = self.dwarf.attr_locations_offset(unit, value) else {
            return Location::OptimizedOut;
        };
        let Ok(mut list) = self.dwarf.locations(unit, offset) else {
            return Location::OptimizedOut;
        };
        while let Ok(Some(item)) = list.next() {
            if item.range.begin <= pc && pc < item.range.end {
                return describe(item.data, unit.encoding());
            }
        }
        Location::OptimizedOut
    }

    /// The whole location list of the variable DIE `die`: each pc range `[low, high)` with
    /// where the variable lives there. A single location expression (valid wherever the
    /// variable is in scope) is one range `[0, u64::MAX)`; no location gives an empty list.
    ///
    /// # Errors
    /// [`DwarfError::NoUnitAt`] or [`DwarfError::Gimli`] when the DIE or its list is malformed.
    pub fn location_list(&self, die: DieRef) -> Result<Vec<(u64, u64, Location)>, DwarfError> {
        let (unit, off) = self.unit_of(die)?;
        let entry = unit.entry(off).map_err(super::gimli_err("variable DIE"))?;
        let value = entry
            .attr_value(gimli::DW_AT_location)
            .map_err(super::gimli_err("DW_AT_location"))?;
        let Some(value) = value else {
            if entry
                .attr_value(gimli::DW_AT_const_value)
                .ok()
                .flatten()
                .is_some()
            {
                return Ok(vec![(0, u64::MAX, self.location_at(&unit, &entry, 0))]);
            }
            return Ok(Vec::new());
        };
        if let AttributeValue::Exprloc(expr) = value {
            return Ok(vec![(0, u64::MAX, describe(expr, unit.encoding()))]);
        }
        let Some(offset) = self
            .dwarf
            .attr_locations_offset(&unit, value)
            .map_err(super::gimli_err("location list offset"))?
        else {
            return Ok(Vec::new());
        };
        let mut list = self
            .dwarf
            .locations(&unit, offset)
            .map_err(super::gimli_err("location list"))?;
        let mut out = Vec::new();
        while let Some(item) = list
            .next()
            .map_err(super::gimli_err("location list entry"))?
        {
            out.push((
                item.range.begin,
                item.range.end,
                describe(item.data, unit.encoding()),
            ));
        }
        Ok(out)
    }

    /// A variable's own DIE, or its abstract origin for name and type.
    fn variable(&self, die: DieRef, is_param: bool, pc: u64) -> Option<Variable> {
        let (unit, off) = self.unit_of(die).ok()?;
        let entry = unit.entry(off).ok()?;
        let at_entry = self.location_at(&unit, &entry, pc);
        let mut source = die;
        for _ in 0..4 {
            let (u, o) = self.unit_of(source).ok()?;
            let e = u.entry(o).ok()?;
            if let Some(name) = self.attr_str(&u, &e, gimli::DW_AT_name) {
                let ty = e
                    .attr_value(gimli::DW_AT_type)
                    .ok()
                    .flatten()
                    .and_then(|v| Self::die_ref(&u, v));
                let ty = ty.map_or(TypeRef::VOID, TypeRef::new);
                let type_name = declaration(self, ty, &name);
                return Some(Variable {
                    name,
                    is_param,
                    type_name,
                    ty,
                    at_entry,
                    die,
                });
            }
            source = Self::die_ref(&u, e.attr_value(gimli::DW_AT_abstract_origin).ok()??)?;
        }
        None
    }

    /// Parameters then locals of the function at `func` (a subprogram DIE with code), with
    /// their locations at `entry_pc`. Locals of nested blocks are included; variables of
    /// functions inlined into it are not.
    ///
    /// # Errors
    /// DWARF errors reading the function's DIEs.
    pub fn variables(&self, func: DieRef, entry_pc: u64) -> Result<Vec<Variable>, DwarfError> {
        let (unit, off) = self.unit_of(func)?;
        let mut tree = unit
            .entries_tree(Some(off))
            .map_err(super::gimli_err("function DIEs"))?;
        let root = tree.root().map_err(super::gimli_err("function DIE"))?;
        let mut found: Vec<(bool, DieRef)> = Vec::new();
        collect(root, &unit, &mut found, 0);
        let mut vars: Vec<Variable> = found
            .into_iter()
            .filter_map(|(p, d)| self.variable(d, p, entry_pc))
            .collect();
        vars.sort_by_key(|v| !v.is_param);
        Ok(vars)
    }
}

/// Walks a function's subtree: parameters and variables, through lexical blocks.
fn collect(
    node: gimli::EntriesTreeNode<'_, '_, '_, R<'_>>,
    unit: &Unit<'_>,
    out: &mut Vec<(bool, DieRef)>,
    depth: usize,
) {
    if depth > 64 {
        return;
    }
    let mut children = node.children();
    while let Ok(Some(child)) = children.next() {
        let tag = child.entry().tag();
        let global = child
            .entry()
            .offset()
            .to_debug_info_offset(&unit.header)
            .map(|o| DieRef(o.0 as u64));
        match (tag, global) {
            (gimli::DW_TAG_formal_parameter, Some(d)) => out.push((true, d)),
            (gimli::DW_TAG_variable, Some(d)) => out.push((false, d)),
            (gimli::DW_TAG_lexical_block, _) => collect(child, unit, out, depth + 1),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dwarf::testing::{fixture_file, names};
    use crate::dwarf::EntryKind;

    fn vars_of(name: &str) -> Option<Vec<(String, bool, String, Location)>> {
        let file = fixture_file()?;
        let info = file.load().unwrap();
        let index = names(&info);
        let f = index.lookup_kind(name, EntryKind::Function).next().unwrap();
        let vars = info.variables(f.die, f.low).unwrap();
        Some(
            vars.into_iter()
                .map(|v| (v.name, v.is_param, v.type_name, v.at_entry))
                .collect(),
        )
    }

    #[test]
    fn parameters_are_in_their_abi_registers_at_entry() {
        let Some(vars) = vars_of("sum_pids") else {
            return;
        };

        assert_eq!(
            vars[0],
            (
                "t".into(),
                true,
                "struct task *t".into(),
                Location::Register(5)
            )
        );
        assert_eq!(
            vars[1],
            ("n".into(), true, "int n".into(), Location::Register(4))
        );
        assert!(vars[2..].iter().all(|v| !v.1));
        assert!(vars.iter().any(|v| v.0 == "total"));
    }

    #[test]
    fn location_lists_cover_the_entry_location_and_agree_with_it() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);
        let mut lists = 0;
        for f in index.iter().filter(|e| e.kind == EntryKind::Function) {
            for v in info.variables(f.die, f.low).unwrap() {
                let list = info.location_list(v.die).unwrap();
                lists += usize::from(list.len() > 1);
                let at_entry = list
                    .iter()
                    .find(|(lo, hi, _)| *lo <= f.low && f.low < *hi)
                    .map_or(Location::OptimizedOut, |(_, _, l)| l.clone());
                assert_eq!(at_entry, v.at_entry, "{} in {}", v.name, f.name);
                assert!(list.iter().all(|(lo, hi, _)| lo < hi));
            }
        }
        assert!(lists > 0, "the -O2 fixture has no variable that moves");
    }

    #[test]
    fn locations_print_as_registers_frames_and_constants() {
        assert_eq!(Location::Register(5).to_string(), "%rdi");
        assert_eq!(
            Location::Memory { base: 7, offset: 8 }.to_string(),
            "8(%rsp)"
        );
        assert_eq!(Location::Frame(-16).to_string(), "frame_base-16");
        assert_eq!(Location::Const(0).to_string(), "constant 0");
        assert_eq!(register_name(17), "xmm0");
        assert_eq!(register_name(99), "reg99");
    }
}
