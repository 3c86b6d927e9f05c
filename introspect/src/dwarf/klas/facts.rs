//! What DWARF says about registers and struct layouts: which register holds a pointer to which
//! struct over which pc range (parameters and locals, inlined copies included), and which
//! member a byte offset of a struct falls in.

use std::collections::HashMap;

use gimli::AttributeValue;

use super::super::types::TypeRef;
use super::super::vars::{describe, Location};
use super::super::{DebugInfo, DieRef, Unit, R};
use crate::btf::cdecl::{Body, BodyMember, Shape, TypeShapes};

/// Over `lo..hi`, DWARF register `reg` holds a pointer to the struct/union `ty`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fact {
    pub lo: u64,
    pub hi: u64,
    pub reg: u16,
    pub ty: DieRef,
}

/// How deep DIE trees and type chains are followed.
const MAX_DEPTH: usize = 48;

/// Struct layouts and names, parsed once per struct DIE.
/// A struct's name and members.
type Aggregate = (String, Vec<BodyMember<TypeRef>>);

#[derive(Debug, Default)]
pub(crate) struct Layouts {
    bodies: HashMap<DieRef, Option<Aggregate>>,
    sizes: HashMap<TypeRef, u64>,
    hits: HashMap<(DieRef, u64, u64), Option<MemberHit>>,
    aggregates: HashMap<TypeRef, Option<DieRef>>,
    pointers: HashMap<TypeRef, (Option<DieRef>, bool)>,
}

/// The member covering an access.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MemberHit {
    /// `f_pos`, `f_path.dentry` (anonymous members leave no component).
    pub path: String,
    /// The innermost member's type.
    pub ty: TypeRef,
    /// Whether the access starts exactly at that member.
    pub at_start: bool,
}

impl Layouts {
    /// Name and members of the struct/union `st`.
    pub(crate) fn get(&mut self, info: &DebugInfo<'_>, st: DieRef) -> Option<&Aggregate> {
        self.bodies
            .entry(st)
            .or_insert_with(|| match info.body(TypeRef::new(st))? {
                Body::Aggregate { name, members, .. } => Some((name, members)),
                Body::Enum { .. } => None,
            })
            .as_ref()
    }

    /// Size in bytes of the struct `st` (0 when unknown).
    pub(crate) fn size(&mut self, info: &DebugInfo<'_>, st: DieRef) -> u64 {
        self.type_size(info, TypeRef::new(st))
    }

    fn type_size(&mut self, info: &DebugInfo<'_>, ty: TypeRef) -> u64 {
        *self
            .sizes
            .entry(ty)
            .or_insert_with(|| TypeShapes::size_of(info, ty).unwrap_or(0))
    }

    /// The struct/union `ty` is, typedefs seen through.
    pub(crate) fn aggregate(&mut self, info: &DebugInfo<'_>, ty: TypeRef) -> Option<DieRef> {
        *self.aggregates.entry(ty).or_insert_with(|| {
            let inner = info.strip_typedefs(ty);
            matches!(info.body(inner), Some(Body::Aggregate { .. })).then_some(inner.die)
        })
    }

    /// What the pointer type `ty` points to: a struct, and whether it is a function.
    pub(crate) fn pointer(&mut self, info: &DebugInfo<'_>, ty: TypeRef) -> (Option<DieRef>, bool) {
        *self
            .pointers
            .entry(ty)
            .or_insert_with(|| (info.pointee_struct(ty), info.is_function_pointer(ty)))
    }

    /// The member of `st` that an access of `size` bytes at byte `off` touches, descending
    /// into embedded structs and unions.
    pub(crate) fn member_at(
        &mut self,
        info: &DebugInfo<'_>,
        st: DieRef,
        off: u64,
        size: u64,
    ) -> Option<MemberHit> {
        if let Some(hit) = self.hits.get(&(st, off, size)) {
            return hit.clone();
        }
        let hit = self.find_member(info, st, off, size);
        self.hits.insert((st, off, size), hit.clone());
        hit
    }

    fn find_member(
        &mut self,
        info: &DebugInfo<'_>,
        st: DieRef,
        off: u64,
        size: u64,
    ) -> Option<MemberHit> {
        let mut path: Vec<String> = Vec::new();
        let (mut st, mut off) = (st, off);
        for _ in 0..MAX_DEPTH {
            let members = self.get(info, st)?.1.clone();
            let hit = members.iter().find(|m| {
                let start = m.bit_offset / 8;
                let len = match m.bit_size {
                    Some(bits) => (m.bit_offset % 8 + bits).div_ceil(8),
                    None => self.type_size(info, m.ty).max(1),
                };
                start <= off && off < start.saturating_add(len)
            })?;
            let (name, ty, start) = (hit.name.clone(), hit.ty, hit.bit_offset / 8);
            let whole = self.type_size(info, ty);
            if !name.is_empty() {
                path.push(name);
            }
            let nested = self.aggregate(info, ty);
            match nested {
                Some(inner) if !(off == start && size >= whole) => {
                    st = inner;
                    off -= start;
                }
                _ => {
                    return Some(MemberHit {
                        path: path.join("."),
                        ty,
                        at_start: off == start,
                    })
                }
            }
        }
        None
    }
}

impl DebugInfo<'_> {
    /// The struct/union DIE that a pointer type `ty` points to (typedefs and qualifiers seen
    /// through on both sides).
    pub(crate) fn pointee_struct(&self, ty: TypeRef) -> Option<DieRef> {
        let ptr = self.strip_typedefs(ty);
        let Shape::Pointer(target) = self.shape(ptr) else {
            return None;
        };
        let target = self.strip_typedefs(target);
        matches!(self.body(target), Some(Body::Aggregate { .. })).then_some(target.die)
    }

    /// Whether `ty` is a pointer to a function.
    pub(crate) fn is_function_pointer(&self, ty: TypeRef) -> bool {
        let Shape::Pointer(target) = self.shape(self.strip_typedefs(ty)) else {
            return false;
        };
        matches!(
            self.shape(self.strip_typedefs(target)),
            Shape::Function { .. }
        )
    }

    /// Register facts of the function at `func`, whose code is `ranges`: its parameters and
    /// locals, and those of functions inlined into it, that point to structs.
    pub(crate) fn register_facts(&self, func: DieRef, ranges: &[(u64, u64)]) -> Vec<Fact> {
        let Ok((unit, off)) = self.unit_of(func) else {
            return Vec::new();
        };
        let Ok(mut tree) = unit.entries_tree(Some(off)) else {
            return Vec::new();
        };
        let Ok(root) = tree.root() else {
            return Vec::new();
        };
        let mut vars = Vec::new();
        walk(root, &unit, &mut vars, 0);
        let mut facts = Vec::new();
        for var in vars {
            self.facts_of(&unit, var, ranges, &mut facts);
        }
        facts
    }

    fn var_type(&self, die: DieRef) -> Option<TypeRef> {
        let mut cur = die;
        for _ in 0..4 {
            let (u, o) = self.unit_of(cur).ok()?;
            let e = u.entry(o).ok()?;
            if let Some(v) = e.attr_value(gimli::DW_AT_type).ok().flatten() {
                return Self::die_ref(&u, v).map(TypeRef::new);
            }
            // An inlined or out-of-line copy's origin, or the declaration a definition
            // completes (`struct kvm_x86_ops kvm_x86_ops;` after the header's `extern`).
            let origin = match e.attr_value(gimli::DW_AT_abstract_origin).ok().flatten() {
                Some(origin) => origin,
                None => e.attr_value(gimli::DW_AT_specification).ok()??,
            };
            cur = Self::die_ref(&u, origin)?;
        }
        None
    }

    fn facts_of(&self, unit: &Unit<'_>, var: DieRef, ranges: &[(u64, u64)], out: &mut Vec<Fact>) {
        let Some(ty) = self.var_type(var).and_then(|t| self.pointee_struct(t)) else {
            return;
        };
        let Ok((_, off)) = self.unit_of(var) else {
            return;
        };
        let Ok(entry) = unit.entry(off) else { return };
        let Ok(Some(value)) = entry.attr_value(gimli::DW_AT_location) else {
            return;
        };
        if let AttributeValue::Exprloc(expr) = value {
            if let Location::Register(reg) = describe(expr, unit.encoding()) {
                out.extend(ranges.iter().map(|&(lo, hi)| Fact { lo, hi, reg, ty }));
            }
            return;
        }
        let Ok(Some(offset)) = self.dwarf.attr_locations_offset(unit, value) else {
            return;
        };
        let Ok(mut list) = self.dwarf.locations(unit, offset) else {
            return;
        };
        while let Ok(Some(item)) = list.next() {
            if let Location::Register(reg) = describe(item.data, unit.encoding()) {
                out.push(Fact {
                    lo: item.range.begin,
                    hi: item.range.end,
                    reg,
                    ty,
                });
            }
        }
    }
}

/// Parameters and variables under a function, through blocks and inlined subroutines.
fn walk(
    node: gimli::EntriesTreeNode<'_, '_, '_, R<'_>>,
    unit: &Unit<'_>,
    out: &mut Vec<DieRef>,
    depth: usize,
) {
    if depth > MAX_DEPTH {
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
            (gimli::DW_TAG_formal_parameter | gimli::DW_TAG_variable, Some(d)) => out.push(d),
            (gimli::DW_TAG_lexical_block | gimli::DW_TAG_inlined_subroutine, _) => {
                walk(child, unit, out, depth + 1)
            }
            _ => {}
        }
    }
}

/// A global variable that is a struct or an array of structs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GlobalVar {
    pub addr: u64,
    pub size: u64,
    pub st: DieRef,
    /// Size of one struct.
    pub elem: u64,
    pub array: bool,
}

/// Global struct variables by address, so that `[rip + X]` accesses resolve to members.
#[derive(Debug, Clone, Default)]
pub struct Globals {
    vars: Vec<GlobalVar>,
}

impl Globals {
    /// The struct and struct-array variables with static addresses of `index`.
    pub fn from_index(info: &DebugInfo<'_>, index: &super::super::Index) -> Globals {
        let mut vars: Vec<GlobalVar> = index
            .iter()
            .filter(|e| e.kind == super::super::EntryKind::Variable && e.low != 0)
            .filter_map(|e| {
                let ty = info.var_type(e.die)?;
                let size = TypeShapes::size_of(info, ty)?;
                let stripped = info.strip_typedefs(ty);
                let (elem_ty, array) = match info.shape(stripped) {
                    Shape::Array(elem, _) => (info.strip_typedefs(elem), true),
                    _ => (stripped, false),
                };
                if !matches!(info.body(elem_ty), Some(Body::Aggregate { .. })) {
                    return None;
                }
                let elem = TypeShapes::size_of(info, elem_ty).filter(|&s| s > 0)?;
                Some(GlobalVar {
                    addr: e.low,
                    size,
                    st: elem_ty.die,
                    elem,
                    array,
                })
            })
            .collect();
        vars.sort_by_key(|v| v.addr);
        Globals { vars }
    }

    /// Number of variables.
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }

    /// The variable holding `addr`.
    pub(crate) fn find(&self, addr: u64) -> Option<&GlobalVar> {
        let at = self.vars.partition_point(|v| v.addr <= addr);
        let v = self.vars.get(at.checked_sub(1)?)?;
        (addr < v.addr.saturating_add(v.size)).then_some(v)
    }
}
