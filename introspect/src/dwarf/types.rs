//! DWARF types as C: [`TypeShapes`] over DIEs, so `ptype` prints what gdb prints, plus
//! struct layouts (member offsets and sizes) and lookups like `struct file` by name.

use gimli::{AttributeValue, DwTag};

use super::index::{EntryKind, Index};
use super::{DebugInfo, DieRef, DwarfError};
use crate::btf::cdecl::{gdb_base_name, Body, BodyMember, Shape, TypeShapes};

/// A type: a DIE, and for a multi-dimensional array which dimension starts the type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TypeRef {
    /// The DIE.
    pub die: DieRef,
    /// Array dimension (0 for everything else).
    pub dim: u16,
}

impl TypeRef {
    /// `void` (no DIE).
    pub const VOID: TypeRef = TypeRef {
        die: DieRef(u64::MAX),
        dim: 0,
    };

    /// The type at `die`.
    pub fn new(die: DieRef) -> TypeRef {
        TypeRef { die, dim: 0 }
    }
}

/// A member of a struct layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutMember {
    /// Name (empty: anonymous struct/union).
    pub name: String,
    /// Offset in bits from the start of the struct.
    pub bit_offset: u64,
    /// Size in bytes of the member's type.
    pub byte_size: u64,
    /// Width for bitfields.
    pub bit_size: Option<u64>,
    /// The member's type as C.
    pub type_name: String,
}

/// What a DIE says about itself, read once.
struct Die {
    tag: DwTag,
    name: Option<String>,
    ty: TypeRef,
    byte_size: Option<u64>,
    declaration: bool,
    prototyped: bool,
}

/// How many levels of typedef/qualifier a size computation follows.
const MAX_CHAIN: usize = 32;

impl<'a> DebugInfo<'a> {
    fn die(&self, die: DieRef) -> Option<Die> {
        let (unit, off) = self.unit_of(die).ok()?;
        let entry = unit.entry(off).ok()?;
        let ty = entry
            .attr_value(gimli::DW_AT_type)
            .ok()
            .flatten()
            .and_then(|v| Self::die_ref(&unit, v));
        Some(Die {
            tag: entry.tag(),
            name: self.attr_str(&unit, &entry, gimli::DW_AT_name),
            ty: ty.map_or(TypeRef::VOID, TypeRef::new),
            byte_size: entry
                .attr(gimli::DW_AT_byte_size)
                .ok()
                .flatten()
                .and_then(|a| a.udata_value()),
            declaration: matches!(
                entry.attr_value(gimli::DW_AT_declaration),
                Ok(Some(AttributeValue::Flag(true)))
            ),
            prototyped: matches!(
                entry.attr_value(gimli::DW_AT_prototyped),
                Ok(Some(AttributeValue::Flag(true)))
            ),
        })
    }

    /// Children of `die` with their tags and offsets, in order.
    fn children(&self, die: DieRef) -> Vec<(DwTag, DieRef)> {
        let Ok((unit, off)) = self.unit_of(die) else {
            return Vec::new();
        };
        let Ok(mut tree) = unit.entries_tree(Some(off)) else {
            return Vec::new();
        };
        let Ok(root) = tree.root() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut children = root.children();
        while let Ok(Some(child)) = children.next() {
            let e = child.entry();
            if let Some(g) = e.offset().to_debug_info_offset(&unit.header) {
                out.push((e.tag(), DieRef(g.0 as u64)));
            }
        }
        out
    }

    /// Array dimensions of an array DIE: element counts, `None` for an unknown bound.
    fn dimensions(&self, die: DieRef) -> Vec<Option<u64>> {
        let Ok((unit, _)) = self.unit_of(die) else {
            return Vec::new();
        };
        self.children(die)
            .into_iter()
            .filter(|(tag, _)| *tag == gimli::DW_TAG_subrange_type)
            .map(|(_, sub)| {
                let (_, off) = self.unit_of(sub).ok()?;
                let entry = unit.entry(off).ok()?;
                let num = |at| {
                    entry
                        .attr(at)
                        .ok()
                        .flatten()
                        .and_then(|a: gimli::Attribute<_>| {
                            a.udata_value()
                                .or_else(|| a.sdata_value().map(|v| v as u64))
                        })
                };
                if let Some(count) = num(gimli::DW_AT_count) {
                    return Some(count);
                }
                let upper = entry.attr(gimli::DW_AT_upper_bound).ok().flatten()?;
                let upper = upper
                    .sdata_value()
                    .or_else(|| upper.udata_value().map(|v| v as i64))?;
                let lower = num(gimli::DW_AT_lower_bound).unwrap_or(0) as i64;
                u64::try_from(upper.checked_sub(lower)?.checked_add(1)?).ok()
            })
            .collect()
    }

    fn keyword_name(keyword: &str, name: Option<String>) -> String {
        match name {
            Some(n) => format!("{keyword} {n}"),
            None => format!("{keyword} {{...}}"),
        }
    }

    /// Finds a type by C spelling: `struct file`, `union thread_union`, `enum pid_type`, or a
    /// typedef/base type name (`pid_t`, `int`).
    ///
    /// # Errors
    /// [`DwarfError::NotFound`] when the index has no such type.
    pub fn find_type(&self, index: &Index, spec: &str) -> Result<TypeRef, DwarfError> {
        let spec = spec.trim();
        let (kinds, name): (&[EntryKind], &str) = match spec.split_once(char::is_whitespace) {
            Some(("struct", n)) => (&[EntryKind::Struct], n.trim()),
            Some(("union", n)) => (&[EntryKind::Union], n.trim()),
            Some(("enum", n)) => (&[EntryKind::Enum], n.trim()),
            _ => (
                &[
                    EntryKind::Typedef,
                    EntryKind::BaseType,
                    EntryKind::Struct,
                    EntryKind::Union,
                    EntryKind::Enum,
                ],
                spec,
            ),
        };
        kinds
            .iter()
            .find_map(|k| index.lookup_kind(name, *k).next())
            .map(|e| TypeRef::new(e.die))
            .ok_or_else(|| DwarfError::NotFound {
                kind: "type",
                name: spec.to_owned(),
            })
    }

    /// Strips typedefs and qualifiers.
    pub fn strip_typedefs(&self, ty: TypeRef) -> TypeRef {
        let mut cur = ty;
        for _ in 0..MAX_CHAIN {
            match self.die(cur.die) {
                Some(d) if cur.dim == 0 && is_transparent(d.tag) => cur = d.ty,
                _ => return cur,
            }
        }
        cur
    }

    /// The members of the struct/union `ty` with offsets and sizes (gdb's `ptype /o` rows at
    /// the first level).
    pub fn layout(&self, ty: TypeRef) -> Option<Vec<LayoutMember>> {
        let Body::Aggregate { members, .. } = self.body(self.strip_typedefs(ty))? else {
            return None;
        };
        Some(
            members
                .into_iter()
                .map(|m| LayoutMember {
                    byte_size: TypeShapes::size_of(self, m.ty).unwrap_or(0),
                    type_name: crate::btf::cdecl::declaration(self, m.ty, ""),
                    name: m.name,
                    bit_offset: m.bit_offset,
                    bit_size: m.bit_size,
                })
                .collect(),
        )
    }

    fn member(&self, die: DieRef) -> Option<BodyMember<TypeRef>> {
        let (unit, off) = self.unit_of(die).ok()?;
        let entry = unit.entry(off).ok()?;
        let ty = entry
            .attr_value(gimli::DW_AT_type)
            .ok()
            .flatten()
            .and_then(|v| Self::die_ref(&unit, v));
        let udata = |at| {
            entry
                .attr(at)
                .ok()
                .flatten()
                .and_then(|a: gimli::Attribute<_>| a.udata_value())
        };
        let byte_offset = match entry
            .attr_value(gimli::DW_AT_data_member_location)
            .ok()
            .flatten()
        {
            Some(AttributeValue::Exprloc(expr)) => plus_uconst(expr.0.slice()),
            Some(v) => v.udata_value(),
            None => None,
        };
        let bit_size = udata(gimli::DW_AT_bit_size);
        let bit_offset = match (
            udata(gimli::DW_AT_data_bit_offset),
            udata(gimli::DW_AT_bit_offset),
        ) {
            (Some(bits), _) => bits,
            // DWARF 2/3 bitfields: offset from the storage unit's most significant bit.
            (None, Some(msb)) => {
                let storage = udata(gimli::DW_AT_byte_size).unwrap_or(0) * 8;
                (byte_offset.unwrap_or(0) * 8 + storage).saturating_sub(msb + bit_size.unwrap_or(0))
            }
            (None, None) => byte_offset.unwrap_or(0).saturating_mul(8),
        };
        Some(BodyMember {
            name: self
                .attr_str(&unit, &entry, gimli::DW_AT_name)
                .unwrap_or_default(),
            ty: ty.map_or(TypeRef::VOID, TypeRef::new),
            bit_offset,
            bit_size,
        })
    }

    fn enumerators(&self, die: DieRef) -> Vec<(String, i128)> {
        self.children(die)
            .into_iter()
            .filter(|(tag, _)| *tag == gimli::DW_TAG_enumerator)
            .filter_map(|(_, e)| {
                let (unit, off) = self.unit_of(e).ok()?;
                let entry = unit.entry(off).ok()?;
                let value = match entry.attr_value(gimli::DW_AT_const_value).ok()?? {
                    AttributeValue::Sdata(v) => i128::from(v),
                    AttributeValue::Data1(v) => i128::from(v),
                    AttributeValue::Data2(v) => i128::from(v),
                    AttributeValue::Data4(v) => i128::from(v),
                    AttributeValue::Data8(v) => i128::from(v),
                    AttributeValue::Udata(v) => i128::from(v),
                    _ => return None,
                };
                Some((self.attr_str(&unit, &entry, gimli::DW_AT_name)?, value))
            })
            .collect()
    }
}

/// `DW_OP_plus_uconst N` (old-style member locations) → N.
fn plus_uconst(expr: &[u8]) -> Option<u64> {
    let (&op, rest) = expr.split_first()?;
    if op != gimli::DW_OP_plus_uconst.0 {
        return None;
    }
    let mut r = gimli::EndianSlice::new(rest, gimli::LittleEndian);
    gimli::Reader::read_uleb128(&mut r).ok()
}

fn is_transparent(tag: DwTag) -> bool {
    matches!(
        tag,
        gimli::DW_TAG_typedef
            | gimli::DW_TAG_const_type
            | gimli::DW_TAG_volatile_type
            | gimli::DW_TAG_restrict_type
            | gimli::DW_TAG_atomic_type
    )
}

impl TypeShapes for DebugInfo<'_> {
    type Id = TypeRef;

    fn shape(&self, ty: TypeRef) -> Shape<TypeRef> {
        if ty == TypeRef::VOID {
            return Shape::Void;
        }
        let Some(d) = self.die(ty.die) else {
            return Shape::Unknown;
        };
        match d.tag {
            gimli::DW_TAG_base_type => d.name.map_or(Shape::Unknown, |n| {
                Shape::Named(gdb_base_name(&n).to_owned())
            }),
            gimli::DW_TAG_typedef | gimli::DW_TAG_unspecified_type => {
                d.name.map_or(Shape::Unknown, Shape::Named)
            }
            gimli::DW_TAG_structure_type => Shape::Named(Self::keyword_name("struct", d.name)),
            gimli::DW_TAG_union_type => Shape::Named(Self::keyword_name("union", d.name)),
            gimli::DW_TAG_enumeration_type => Shape::Named(Self::keyword_name("enum", d.name)),
            gimli::DW_TAG_pointer_type | gimli::DW_TAG_reference_type => Shape::Pointer(d.ty),
            gimli::DW_TAG_const_type => Shape::Qualified("const", d.ty),
            gimli::DW_TAG_volatile_type => Shape::Qualified("volatile", d.ty),
            gimli::DW_TAG_restrict_type => Shape::Qualified("restrict", d.ty),
            gimli::DW_TAG_atomic_type => Shape::Qualified("_Atomic", d.ty),
            gimli::DW_TAG_array_type => {
                let dims = self.dimensions(ty.die);
                let here = dims.get(usize::from(ty.dim)).copied().flatten();
                let inner = if usize::from(ty.dim) + 1 < dims.len() {
                    TypeRef {
                        die: ty.die,
                        dim: ty.dim + 1,
                    }
                } else {
                    d.ty
                };
                Shape::Array(inner, here)
            }
            gimli::DW_TAG_subroutine_type | gimli::DW_TAG_subprogram => {
                let children = self.children(ty.die);
                let params = children
                    .iter()
                    .filter(|(tag, _)| *tag == gimli::DW_TAG_formal_parameter)
                    .map(|(_, p)| self.die(*p).map_or(TypeRef::VOID, |pd| pd.ty))
                    .collect();
                let variadic = children
                    .iter()
                    .any(|(tag, _)| *tag == gimli::DW_TAG_unspecified_parameters);
                Shape::Function {
                    ret: d.ty,
                    params,
                    variadic,
                    prototyped: d.prototyped,
                }
            }
            _ => Shape::Unknown,
        }
    }

    fn body(&self, ty: TypeRef) -> Option<Body<TypeRef>> {
        if ty == TypeRef::VOID || ty.dim != 0 {
            return None;
        }
        let d = self.die(ty.die)?;
        let union = match d.tag {
            gimli::DW_TAG_structure_type => false,
            gimli::DW_TAG_union_type => true,
            gimli::DW_TAG_enumeration_type => {
                return Some(Body::Enum {
                    name: d.name.unwrap_or_default(),
                    values: self.enumerators(ty.die),
                });
            }
            _ => return None,
        };
        let members = if d.declaration {
            Vec::new()
        } else {
            self.children(ty.die)
                .into_iter()
                .filter(|(tag, _)| *tag == gimli::DW_TAG_member)
                .filter_map(|(_, m)| self.member(m))
                .collect()
        };
        Some(Body::Aggregate {
            union,
            name: d.name.unwrap_or_default(),
            size: d.byte_size.unwrap_or(0),
            members,
            incomplete: d.declaration,
        })
    }

    fn size_of(&self, ty: TypeRef) -> Option<u64> {
        self.size_of_depth(ty, 0)
    }

    fn typedef_target(&self, ty: TypeRef) -> Option<TypeRef> {
        if ty == TypeRef::VOID || ty.dim != 0 {
            return None;
        }
        let d = self.die(ty.die)?;
        (d.tag == gimli::DW_TAG_typedef).then_some(d.ty)
    }
}

impl DebugInfo<'_> {
    /// Size in bytes; `depth` bounds array-of-array recursion in a looping graph.
    fn size_of_depth(&self, ty: TypeRef, depth: usize) -> Option<u64> {
        if depth > MAX_CHAIN {
            return None;
        }
        let mut cur = ty;
        for _ in 0..MAX_CHAIN {
            if cur == TypeRef::VOID {
                return None;
            }
            let d = self.die(cur.die)?;
            match d.tag {
                gimli::DW_TAG_array_type => {
                    let dims = self.dimensions(cur.die);
                    let count = dims
                        .iter()
                        .skip(usize::from(cur.dim))
                        .try_fold(1u64, |acc, n| acc.checked_mul((*n)?))?;
                    return self.size_of_depth(d.ty, depth + 1)?.checked_mul(count);
                }
                tag if is_transparent(tag) => cur = d.ty,
                gimli::DW_TAG_pointer_type | gimli::DW_TAG_reference_type => {
                    return Some(d.byte_size.unwrap_or(8))
                }
                _ => return d.byte_size,
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::btf::cdecl::{declaration, ptype};
    use crate::dwarf::testing::{fixture_file, gdb_batch, have_gdb, names};

    const TASK: &str = "type = struct task {
    pid_t pid;
    char comm[16];
    struct list_head tasks;
    union {
        int a;
        long b;
    };
    unsigned int flags : 3;
    unsigned int state : 5;
    int (*fn)(struct task *, const char *);
    int matrix[2][3];
    const volatile unsigned long *cv;
}
";

    #[test]
    fn ptype_of_the_fixture_struct_is_gdbs() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);
        let task = info.find_type(&index, "struct task").unwrap();

        assert_eq!(ptype(&info, task, false), TASK);
        if have_gdb() {
            let theirs = gdb_batch(
                file.path(),
                &["ptype /o struct task", "ptype enum color", "ptype pid_t"],
            );
            assert_eq!(ptype(&info, task, true), theirs[0]);
            assert_eq!(
                ptype(&info, info.find_type(&index, "enum color").unwrap(), false),
                theirs[1]
            );
            assert_eq!(
                ptype(&info, info.find_type(&index, "pid_t").unwrap(), false),
                theirs[2]
            );
        }
    }

    #[test]
    fn layout_gives_offsets_and_sizes_of_members() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);

        let layout = info
            .layout(info.find_type(&index, "struct task").unwrap())
            .unwrap();

        let rows: Vec<(&str, u64, u64, Option<u64>)> = layout
            .iter()
            .map(|m| (m.name.as_str(), m.bit_offset, m.byte_size, m.bit_size))
            .collect();
        assert_eq!(
            rows,
            vec![
                ("pid", 0, 4, None),
                ("comm", 32, 16, None),
                ("tasks", 192, 16, None),
                ("", 320, 8, None),
                ("flags", 384, 4, Some(3)),
                ("state", 387, 4, Some(5)),
                ("fn", 448, 8, None),
                ("matrix", 512, 24, None),
                ("cv", 704, 8, None),
            ]
        );
        assert_eq!(layout[7].type_name, "int [2][3]");
    }

    #[test]
    fn find_type_names_what_is_missing() {
        let Some(file) = fixture_file() else { return };
        let info = file.load().unwrap();
        let index = names(&info);

        let missing = info.find_type(&index, "struct nothing");

        assert!(matches!(
            missing,
            Err(DwarfError::NotFound { kind: "type", .. })
        ));
        assert_eq!(declaration(&info, TypeRef::VOID, "p"), "void p");
    }
}
