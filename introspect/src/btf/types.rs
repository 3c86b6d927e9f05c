//! Decoding of the type section: one `btf_type` record plus its kind-specific tail per type.

use super::{BtfError, Enumerator, IntEncoding, Kind, Member, Param, Reader, SecVar, Type, TypeId};

/// Kind numbers of `include/uapi/linux/btf.h`.
mod kind {
    pub const INT: u32 = 1;
    pub const PTR: u32 = 2;
    pub const ARRAY: u32 = 3;
    pub const STRUCT: u32 = 4;
    pub const UNION: u32 = 5;
    pub const ENUM: u32 = 6;
    pub const FWD: u32 = 7;
    pub const TYPEDEF: u32 = 8;
    pub const VOLATILE: u32 = 9;
    pub const CONST: u32 = 10;
    pub const RESTRICT: u32 = 11;
    pub const FUNC: u32 = 12;
    pub const FUNC_PROTO: u32 = 13;
    pub const VAR: u32 = 14;
    pub const DATASEC: u32 = 15;
    pub const FLOAT: u32 = 16;
    pub const DECL_TAG: u32 = 17;
    pub const TYPE_TAG: u32 = 18;
    pub const ENUM64: u32 = 19;
}

/// A cursor over the type section.
struct Cursor<'a> {
    r: Reader<'a>,
    pos: usize,
}

impl Cursor<'_> {
    fn u32(&mut self) -> Result<u32, BtfError> {
        let v = self.r.u32_at(self.pos).ok_or(BtfError::Truncated {
            what: "a type record",
            end: self.pos as u64 + 4,
            len: self.r.bytes.len(),
        })?;
        self.pos += 4;
        Ok(v)
    }

    fn at_end(&self) -> bool {
        self.pos >= self.r.bytes.len()
    }

    /// Refuses a count of trailing records that cannot fit in what is left, before allocating.
    fn check_room(&self, count: usize, record: usize) -> Result<(), BtfError> {
        let need = count.saturating_mul(record);
        let left = self.r.bytes.len().saturating_sub(self.pos);
        if need > left {
            return Err(BtfError::Truncated {
                what: "a type record's members",
                end: (self.pos as u64).saturating_add(need as u64),
                len: self.r.bytes.len(),
            });
        }
        Ok(())
    }
}

/// Decodes every type of the section; index 0 of the result is `void`.
pub(super) fn parse_all(r: Reader<'_>) -> Result<Vec<Type>, BtfError> {
    parse_after(
        r,
        vec![Type {
            name: 0,
            kind: Kind::Void,
        }],
    )
}

/// The types of `r` appended to `types` (a split BTF's ids continue its base's).
pub(super) fn parse_after(r: Reader<'_>, mut types: Vec<Type>) -> Result<Vec<Type>, BtfError> {
    let mut c = Cursor { r, pos: 0 };
    while !c.at_end() {
        let id = TypeId::try_from(types.len()).unwrap_or(TypeId::MAX);
        types.push(parse_one(&mut c, id)?);
    }
    Ok(types)
}

fn members(c: &mut Cursor<'_>, vlen: usize, kind_flag: bool) -> Result<Vec<Member>, BtfError> {
    c.check_room(vlen, 12)?;
    (0..vlen)
        .map(|_| {
            let name = c.u32()?;
            let ty = c.u32()?;
            let offset = c.u32()?;
            // With kind_flag, the offset word packs the bitfield size in its top byte.
            let (bit_offset, bitfield_size) = if kind_flag {
                let size = (offset >> 24) as u8;
                (offset & 0x00ff_ffff, (size != 0).then_some(size))
            } else {
                (offset, None)
            };
            Ok(Member {
                name,
                ty,
                bit_offset,
                bitfield_size,
            })
        })
        .collect()
}

fn parse_one(c: &mut Cursor<'_>, id: TypeId) -> Result<Type, BtfError> {
    let name = c.u32()?;
    let info = c.u32()?;
    let size_or_type = c.u32()?;
    let vlen = (info & 0xffff) as usize;
    let kind_num = (info >> 24) & 0x1f;
    let kind_flag = info >> 31 == 1;
    let kind = match kind_num {
        kind::INT => {
            let word = c.u32()?;
            let enc = (word >> 24) & 0x0f;
            Kind::Int {
                size: size_or_type,
                encoding: IntEncoding {
                    signed: enc & 1 != 0,
                    char: enc & 2 != 0,
                    bool: enc & 4 != 0,
                },
                bit_offset: (word >> 16) as u8,
                bits: word as u8,
            }
        }
        kind::PTR => Kind::Ptr(size_or_type),
        kind::ARRAY => {
            let elem = c.u32()?;
            let index = c.u32()?;
            let len = c.u32()?;
            Kind::Array { elem, index, len }
        }
        kind::STRUCT => Kind::Struct {
            size: size_or_type,
            members: members(c, vlen, kind_flag)?,
        },
        kind::UNION => Kind::Union {
            size: size_or_type,
            members: members(c, vlen, kind_flag)?,
        },
        kind::ENUM => {
            c.check_room(vlen, 8)?;
            let values = (0..vlen)
                .map(|_| {
                    let name = c.u32()?;
                    let raw = c.u32()?;
                    // kind_flag marks a signed enum; without it the value is unsigned.
                    let value = if kind_flag {
                        i128::from(raw as i32)
                    } else {
                        i128::from(raw)
                    };
                    Ok(Enumerator { name, value })
                })
                .collect::<Result<_, BtfError>>()?;
            Kind::Enum {
                size: size_or_type,
                signed: kind_flag,
                values,
            }
        }
        kind::ENUM64 => {
            c.check_room(vlen, 12)?;
            let values = (0..vlen)
                .map(|_| {
                    let name = c.u32()?;
                    let lo = u64::from(c.u32()?);
                    let hi = u64::from(c.u32()?);
                    let raw = hi << 32 | lo;
                    let value = if kind_flag {
                        i128::from(raw as i64)
                    } else {
                        i128::from(raw)
                    };
                    Ok(Enumerator { name, value })
                })
                .collect::<Result<_, BtfError>>()?;
            Kind::Enum {
                size: size_or_type,
                signed: kind_flag,
                values,
            }
        }
        kind::FWD => Kind::Fwd { union: kind_flag },
        kind::TYPEDEF => Kind::Typedef(size_or_type),
        kind::VOLATILE => Kind::Volatile(size_or_type),
        kind::CONST => Kind::Const(size_or_type),
        kind::RESTRICT => Kind::Restrict(size_or_type),
        kind::FUNC => Kind::Func {
            proto: size_or_type,
            linkage: vlen as u16,
        },
        kind::FUNC_PROTO => {
            c.check_room(vlen, 8)?;
            let params = (0..vlen)
                .map(|_| {
                    Ok(Param {
                        name: c.u32()?,
                        ty: c.u32()?,
                    })
                })
                .collect::<Result<_, BtfError>>()?;
            Kind::FuncProto {
                ret: size_or_type,
                params,
            }
        }
        kind::VAR => Kind::Var {
            ty: size_or_type,
            linkage: c.u32()?,
        },
        kind::DATASEC => {
            c.check_room(vlen, 12)?;
            let vars = (0..vlen)
                .map(|_| {
                    Ok(SecVar {
                        ty: c.u32()?,
                        offset: c.u32()?,
                        size: c.u32()?,
                    })
                })
                .collect::<Result<_, BtfError>>()?;
            Kind::Datasec {
                size: size_or_type,
                vars,
            }
        }
        kind::FLOAT => Kind::Float { size: size_or_type },
        kind::DECL_TAG => Kind::DeclTag {
            target: size_or_type,
            component: c.u32()? as i32,
        },
        kind::TYPE_TAG => Kind::TypeTag(size_or_type),
        other => return Err(BtfError::UnknownKind { id, kind: other }),
    };
    Ok(Type { name, kind })
}

/// Every type id that `kind` refers to (0 = void is always valid).
pub(super) fn references(kind: &Kind) -> Vec<TypeId> {
    match kind {
        Kind::Void
        | Kind::Int { .. }
        | Kind::Fwd { .. }
        | Kind::Float { .. }
        | Kind::Enum { .. } => Vec::new(),
        Kind::Ptr(t)
        | Kind::Typedef(t)
        | Kind::Volatile(t)
        | Kind::Const(t)
        | Kind::Restrict(t)
        | Kind::TypeTag(t)
        | Kind::Var { ty: t, .. }
        | Kind::DeclTag { target: t, .. } => vec![*t],
        Kind::Func { proto, .. } => vec![*proto],
        Kind::Array { elem, index, .. } => vec![*elem, *index],
        Kind::Struct { members, .. } | Kind::Union { members, .. } => {
            members.iter().map(|m| m.ty).collect()
        }
        Kind::FuncProto { ret, params } => std::iter::once(*ret)
            .chain(params.iter().map(|p| p.ty))
            .collect(),
        Kind::Datasec { vars, .. } => vars.iter().map(|v| v.ty).collect(),
    }
}

/// Every string offset stored inside `kind` (members, enumerators, parameters).
pub(super) fn inner_names(kind: &Kind) -> Vec<u32> {
    match kind {
        Kind::Struct { members, .. } | Kind::Union { members, .. } => {
            members.iter().map(|m| m.name).collect()
        }
        Kind::Enum { values, .. } => values.iter().map(|v| v.name).collect(),
        Kind::FuncProto { params, .. } => params.iter().map(|p| p.name).collect(),
        _ => Vec::new(),
    }
}
