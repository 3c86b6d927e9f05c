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
    /// Register + offset is the value itself (`DW_OP_bregN; DW_OP_stack_value`).
    Value {
        /// Base register.
        base: u16,
        /// Offset.
        offset: i64,
    },
    /// At frame base + offset (`DW_OP_fbreg`).
    Frame(i64),
    /// The low 32 bits of the word at frame base + offset are the value (`DW_OP_fbreg;
    /// DW_OP_deref; DW_OP_const4u 0xffffffff; DW_OP_and; DW_OP_stack_value`: GCC's form for
    /// a 32-bit variable kept in a 64-bit stack slot).
    FrameLow32(i64),
    /// At a fixed address (`DW_OP_addr`).
    Address(u64),
    /// A fixed (link-time) address is the value itself (`DW_OP_addr; DW_OP_stack_value`:
    /// e.g. a `_RET_IP_`-like argument the compiler knew, a function's own address).
    AddressValue(u64),
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
            Location::Value { base, offset } => {
                write!(f, "breg({}){offset:+} stack_value", register_name(*base))
            }
            Location::Frame(off) => write!(f, "frame_base{off:+}"),
            Location::Address(a) => write!(f, "{a:#x}"),
            Location::AddressValue(a) => write!(f, "value {a:#x}"),
            Location::FrameLow32(o) => write!(f, "low 32 bits of frame{o:+}"),
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
        [Operation::RegisterOffset {
            register, offset, ..
        }, Operation::StackValue] => Location::Value {
            base: register.0,
            offset: *offset,
        },
        [Operation::FrameOffset { offset }] => Location::Frame(*offset),
        [Operation::FrameOffset { offset }, Operation::Deref {
            size, space: false, ..
        }, Operation::UnsignedConstant { value: 0xffff_ffff }, Operation::And, Operation::StackValue]
            if *size >= 4 =>
        {
            Location::FrameLow32(*offset)
        }
        [Operation::Address { address }] => Location::Address(*address),
        [Operation::Address { address }, Operation::StackValue] => Location::AddressValue(*address),
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

    /// A global variable's type (`DW_AT_type` of its DIE, or of the declaration it
    /// specifies) and that type as C (`struct task_struct`, `long unsigned int`), for
    /// `@var("name")` reads.
    pub fn variable_type(&self, die: DieRef) -> Option<(TypeRef, String)> {
        let mut source = die;
        for _ in 0..4 {
            let (u, o) = self.unit_of(source).ok()?;
            let e = u.entry(o).ok()?;
            if let Some(v) = e.attr_value(gimli::DW_AT_type).ok().flatten() {
                let ty = TypeRef::new(Self::die_ref(&u, v)?);
                return Some((ty, declaration(self, ty, "")));
            }
            let next = e
                .attr_value(gimli::DW_AT_specification)
                .ok()
                .flatten()
                .or_else(|| e.attr_value(gimli::DW_AT_abstract_origin).ok().flatten())?;
            source = Self::die_ref(&u, next)?;
        }
        None
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

/// A variable's value as a scalar: what a `$var` read gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scalar {
    /// Bytes (1, 2, 4 or 8).
    pub size: u8,
    /// Sign-extended when read.
    pub signed: bool,
    /// For a pointer to a named struct or union: `struct NAME` / `union NAME`, the type its
    /// members (`$var->m`) are laid out from.
    pub pointee: Option<String>,
}

/// Where the frame base of a function is (`DW_AT_frame_base`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameBase {
    /// `DW_OP_call_frame_cfa`: the canonical frame address from the call frame information.
    Cfa,
    /// Another expression, simplified.
    Other(Location),
}

/// The variables visible at one pc: those of the innermost function (out-of-line or inlined)
/// whose code covers it, from the blocks that cover it, then those of the functions it was
/// inlined into (gdb's frames up the inline chain); where a name repeats, the innermost wins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeAt {
    /// The innermost function covering the pc (an inlined one's own name).
    pub function: String,
    /// Whether that function is an inlined instance inside the out-of-line one.
    pub inlined: bool,
    /// The out-of-line function whose code holds the pc.
    pub out_of_line: String,
    /// The frame base of the out-of-line function holding the pc.
    pub frame_base: Option<FrameBase>,
    /// Parameters then locals, one per name; [`Variable::at_entry`] is the location at the pc.
    pub vars: Vec<Variable>,
}

/// What a walk down to a pc has found so far.
#[derive(Default)]
struct Walk {
    /// Variables: (block depth, is a parameter, DIE).
    found: Vec<(usize, bool, DieRef)>,
    /// The innermost function covering the pc: DIE, inlined, the frame base.
    frame: Option<(DieRef, bool, Option<FrameBase>)>,
    /// The out-of-line function covering it.
    subprogram: Option<DieRef>,
}

impl<'a> DebugInfo<'a> {
    /// The variables in scope at the link-time address `pc` with their locations there, as a
    /// debugger finds them from the innermost frame up the inline chain. `None` when no
    /// function's code covers `pc`.
    ///
    /// # Errors
    /// DWARF errors reading the unit or its DIEs.
    pub fn scope_at(&self, pc: u64) -> Result<Option<ScopeAt>, DwarfError> {
        let Some(unit_offset) = self.unit_for_address(pc)? else {
            return Ok(None);
        };
        let unit = self.unit_at(unit_offset)?;
        let mut tree = unit
            .entries_tree(None)
            .map_err(super::gimli_err("unit DIEs"))?;
        let root = tree.root().map_err(super::gimli_err("unit DIE"))?;
        let mut walk = Walk::default();
        self.descend(&unit, root, pc, 0, &mut walk)?;
        let Walk {
            mut found,
            frame: Some((function, inlined, frame_base)),
            subprogram: Some(subprogram),
        } = walk
        else {
            return Ok(None);
        };
        // Innermost first, so that a name declared again in an inner block wins.
        found.sort_by_key(|(depth, ..)| std::cmp::Reverse(*depth));
        let mut vars: Vec<Variable> = Vec::new();
        for (_, is_param, die) in found {
            if let Some(v) = self.variable(die, is_param, pc) {
                if !vars.iter().any(|have| have.name == v.name) {
                    vars.push(v);
                }
            }
        }
        vars.sort_by_key(|v| !v.is_param);
        Ok(Some(ScopeAt {
            function: self.die_name(function).unwrap_or_default(),
            inlined,
            out_of_line: self.die_name(subprogram).unwrap_or_default(),
            frame_base,
            vars,
        }))
    }

    /// Walks into the children of `node` whose code covers `pc`, collecting variables; a
    /// function (out-of-line or inlined) that covers it starts the collection again.
    fn descend(
        &self,
        unit: &Unit<'a>,
        node: gimli::EntriesTreeNode<'_, '_, '_, R<'a>>,
        pc: u64,
        depth: usize,
        walk: &mut Walk,
    ) -> Result<(), DwarfError> {
        if depth > 64 {
            return Ok(());
        }
        let mut children = node.children();
        while let Some(child) = children.next().map_err(super::gimli_err("DIE children"))? {
            let entry = child.entry();
            let tag = entry.tag();
            let Some(die) = entry
                .offset()
                .to_debug_info_offset(&unit.header)
                .map(|o| DieRef(o.0 as u64))
            else {
                continue;
            };
            match tag {
                gimli::DW_TAG_formal_parameter | gimli::DW_TAG_variable if walk.frame.is_some() => {
                    walk.found
                        .push((depth, tag == gimli::DW_TAG_formal_parameter, die));
                }
                gimli::DW_TAG_subprogram
                | gimli::DW_TAG_inlined_subroutine
                | gimli::DW_TAG_lexical_block => {
                    let (covers, has_ranges) = self.covers(unit, entry, pc)?;
                    let block = tag == gimli::DW_TAG_lexical_block;
                    if !(covers || block && !has_ranges && walk.frame.is_some()) {
                        continue;
                    }
                    if tag == gimli::DW_TAG_subprogram {
                        let base = entry
                            .attr_value(gimli::DW_AT_frame_base)
                            .ok()
                            .flatten()
                            .and_then(|v| match v {
                                AttributeValue::Exprloc(e) => Some(frame_base(e, unit.encoding())),
                                _ => None,
                            });
                        walk.frame = Some((die, false, base));
                        walk.subprogram = Some(die);
                        walk.found.clear();
                    } else if tag == gimli::DW_TAG_inlined_subroutine {
                        // The caller's variables stay visible below the inlined function's
                        // own, as in gdb's frames up the inline chain.
                        let base = walk.frame.as_ref().and_then(|f| f.2.clone());
                        walk.frame = Some((die, true, base));
                    }
                    self.descend(unit, child, pc, depth + 1, walk)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether the code of `entry` covers `pc`, and whether it has any range at all.
    fn covers(
        &self,
        unit: &Unit<'a>,
        entry: &gimli::DebuggingInformationEntry<'_, '_, R<'a>>,
        pc: u64,
    ) -> Result<(bool, bool), DwarfError> {
        let mut ranges = self
            .dwarf
            .die_ranges(unit, entry)
            .map_err(super::gimli_err("DIE ranges"))?;
        let mut any = false;
        while let Some(r) = ranges.next().map_err(super::gimli_err("DIE range"))? {
            any = true;
            if r.begin <= pc && pc < r.end {
                return Ok((true, true));
            }
        }
        Ok((false, any))
    }

    /// The canonical frame address at the link-time `pc` from `.debug_frame` (the kernel's),
    /// else `.eh_frame` (user programs'): (DWARF register, offset), CFA = register + offset.
    /// `None` when no entry covers `pc` or its rule is an expression.
    ///
    /// # Errors
    /// [`DwarfError::Gimli`] when the call frame information is malformed.
    pub fn cfa_at(&self, pc: u64) -> Result<Option<(u16, i64)>, DwarfError> {
        use gimli::UnwindSection;
        use object::{Object, ObjectSection};
        let endian = if self.elf.is_little_endian() {
            gimli::RunTimeEndian::Little
        } else {
            gimli::RunTimeEndian::Big
        };
        let section = |name: &str| {
            self.elf
                .section_by_name(name)
                .and_then(|s| Some((s.address(), s.data().ok()?)))
        };
        let rule = |row: &gimli::UnwindTableRow<usize>| match row.cfa() {
            gimli::CfaRule::RegisterAndOffset { register, offset } => {
                Some((register.0, offset.to_owned()))
            }
            gimli::CfaRule::Expression(_) => None,
        };
        let mut ctx = Box::new(gimli::UnwindContext::new());
        if let Some((_, data)) = section(".debug_frame") {
            let mut frame = gimli::DebugFrame::new(data, endian);
            frame.set_address_size(8);
            let bases = gimli::BaseAddresses::default();
            match frame.unwind_info_for_address(
                &bases,
                &mut ctx,
                pc,
                gimli::DebugFrame::cie_from_offset,
            ) {
                Ok(row) => return Ok(rule(row)),
                Err(gimli::Error::NoUnwindInfoForAddress) => {}
                Err(e) => return Err(super::gimli_err("call frame information")(e)),
            }
        }
        if let Some((addr, data)) = section(".eh_frame") {
            let mut frame = gimli::EhFrame::new(data, endian);
            frame.set_address_size(8);
            let mut bases = gimli::BaseAddresses::default().set_eh_frame(addr);
            if let Some((text, _)) = section(".text") {
                bases = bases.set_text(text);
            }
            match frame.unwind_info_for_address(
                &bases,
                &mut ctx,
                pc,
                gimli::EhFrame::cie_from_offset,
            ) {
                Ok(row) => return Ok(rule(row)),
                Err(gimli::Error::NoUnwindInfoForAddress) => {}
                Err(e) => return Err(super::gimli_err("call frame information")(e)),
            }
        }
        Ok(None)
    }

    /// What reading a variable of type `ty` as a scalar gives: its size, signedness and, for
    /// a pointer to a named struct or union, that type. `None` for a struct, union, array,
    /// float or function value, or a size other than 1, 2, 4 or 8.
    pub fn scalar(&self, ty: TypeRef) -> Option<Scalar> {
        let ty = self.strip_typedefs(ty);
        if ty == TypeRef::VOID || ty.dim != 0 {
            return None;
        }
        let (unit, off) = self.unit_of(ty.die).ok()?;
        let entry = unit.entry(off).ok()?;
        let size = entry
            .attr(gimli::DW_AT_byte_size)
            .ok()
            .flatten()
            .and_then(|a| a.udata_value());
        let size = match entry.tag() {
            gimli::DW_TAG_pointer_type | gimli::DW_TAG_reference_type => size.or(Some(8)),
            _ => size,
        }
        .filter(|s| matches!(s, 1 | 2 | 4 | 8))? as u8;
        match entry.tag() {
            gimli::DW_TAG_base_type => {
                let encoding = match entry.attr_value(gimli::DW_AT_encoding).ok().flatten() {
                    Some(AttributeValue::Encoding(e)) => e,
                    _ => return None,
                };
                let signed = matches!(encoding, gimli::DW_ATE_signed | gimli::DW_ATE_signed_char);
                let integer = signed
                    || matches!(
                        encoding,
                        gimli::DW_ATE_unsigned
                            | gimli::DW_ATE_unsigned_char
                            | gimli::DW_ATE_boolean
                    );
                integer.then_some(Scalar {
                    size,
                    signed,
                    pointee: None,
                })
            }
            gimli::DW_TAG_enumeration_type => {
                let under = entry
                    .attr_value(gimli::DW_AT_type)
                    .ok()
                    .flatten()
                    .and_then(|v| Self::die_ref(&unit, v));
                let signed = under
                    .and_then(|u| self.scalar(TypeRef::new(u)))
                    .is_some_and(|s| s.signed);
                Some(Scalar {
                    size,
                    signed,
                    pointee: None,
                })
            }
            gimli::DW_TAG_pointer_type | gimli::DW_TAG_reference_type => {
                let to = entry
                    .attr_value(gimli::DW_AT_type)
                    .ok()
                    .flatten()
                    .and_then(|v| Self::die_ref(&unit, v))
                    .map(|d| self.strip_typedefs(TypeRef::new(d)));
                let pointee = to.and_then(|t| {
                    let (u, o) = self.unit_of(t.die).ok()?;
                    let e = u.entry(o).ok()?;
                    let keyword = match e.tag() {
                        gimli::DW_TAG_structure_type => "struct",
                        gimli::DW_TAG_union_type => "union",
                        _ => return None,
                    };
                    let name = self.attr_str(&u, &e, gimli::DW_AT_name)?;
                    Some(format!("{keyword} {name}"))
                });
                Some(Scalar {
                    size: 8,
                    signed: false,
                    pointee,
                })
            }
            _ => None,
        }
    }
}

/// A function's frame base expression.
fn frame_base(expr: gimli::Expression<R<'_>>, encoding: gimli::Encoding) -> FrameBase {
    let mut ops = expr.operations(encoding);
    if let (Ok(Some(Operation::CallFrameCFA)), Ok(None)) = (ops.next(), ops.next()) {
        return FrameBase::Cfa;
    }
    FrameBase::Other(describe(expr, encoding))
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
    fn the_scope_at_a_functions_entry_has_its_parameters_in_abi_registers_and_typed_scalars() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);
        let f = index
            .lookup_kind("sum_pids", EntryKind::Function)
            .next()
            .unwrap();

        let scope = info.scope_at(f.low).unwrap().unwrap();

        // sum_pids(struct task *t, int n) { int total; for (int i ...) }: psABI rdi, rsi.
        assert_eq!(
            (scope.function.as_str(), scope.inlined),
            ("sum_pids", false)
        );
        assert_eq!(scope.out_of_line, "sum_pids");
        let get = |n: &str| scope.vars.iter().find(|v| v.name == n).unwrap();
        assert_eq!(get("t").at_entry, Location::Register(5));
        assert_eq!(get("n").at_entry, Location::Register(4));
        assert!(get("t").is_param && !get("total").is_param && !get("i").is_param);
        assert_eq!(
            info.scalar(get("t").ty),
            Some(Scalar {
                size: 8,
                signed: false,
                pointee: Some("struct task".into())
            })
        );
        assert_eq!(
            info.scalar(get("n").ty),
            Some(Scalar {
                size: 4,
                signed: true,
                pointee: None
            })
        );
        // At a function's first instruction the CFA is rsp + 8 (the return address).
        assert_eq!(info.cfa_at(f.low).unwrap(), Some((7, 8)));
        assert!(info.scope_at(0).unwrap().is_none());
    }

    /// GCC's two forms beyond the plain ones, from their bytes: a 32-bit value in a 64-bit
    /// frame slot (fbreg -24; deref; const4u 0xffffffff; and; stack_value) and a link-time
    /// address that is the value (addr A; stack_value).
    #[test]
    fn a_masked_frame_word_and_an_address_value_are_described() {
        let encoding = gimli::Encoding {
            format: gimli::Format::Dwarf32,
            version: 5,
            address_size: 8,
        };
        let expr = |bytes: &'static [u8]| -> gimli::Expression<R<'static>> {
            gimli::Expression(gimli::EndianSlice::new(bytes, gimli::RunTimeEndian::Little))
        };
        const MASKED: [u8; 10] = [0x91, 0x68, 0x06, 0x0c, 0xff, 0xff, 0xff, 0xff, 0x1a, 0x9f];
        assert_eq!(describe(expr(&MASKED), encoding), Location::FrameLow32(-24));
        // Another mask is not the low 32 bits: left as an expression.
        const OTHER: [u8; 10] = [0x91, 0x68, 0x06, 0x0c, 0xff, 0xff, 0x00, 0x00, 0x1a, 0x9f];
        assert!(matches!(
            describe(expr(&OTHER), encoding),
            Location::Expr(_)
        ));
        const ADDRESS: [u8; 10] = [0x03, 0x10, 0x32, 0x54, 0x81, 0xff, 0xff, 0xff, 0xff, 0x9f];
        assert_eq!(
            describe(expr(&ADDRESS), encoding),
            Location::AddressValue(0xffff_ffff_8154_3210)
        );
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
