//! BTF types seen as C declarator shapes, so [`cdecl`](super::cdecl) can print them.

use super::cdecl::{gdb_base_name, Body, BodyMember, Shape, TypeShapes};
use super::{Btf, Kind, TypeId};

impl Btf {
    fn keyword_name(&self, keyword: &str, id: TypeId) -> String {
        match self.name(id) {
            "" => format!("{keyword} {{...}}"),
            name => format!("{keyword} {name}"),
        }
    }
}

impl TypeShapes for Btf {
    type Id = TypeId;

    fn shape(&self, id: TypeId) -> Shape<TypeId> {
        let Some(ty) = self.get(id) else {
            return Shape::Unknown;
        };
        match &ty.kind {
            Kind::Void => Shape::Void,
            Kind::Int { .. } | Kind::Float { .. } => {
                Shape::Named(gdb_base_name(self.name(id)).to_owned())
            }
            Kind::Typedef(_) => Shape::Named(self.name(id).to_owned()),
            Kind::Struct { .. } => Shape::Named(self.keyword_name("struct", id)),
            Kind::Union { .. } => Shape::Named(self.keyword_name("union", id)),
            Kind::Enum { .. } => Shape::Named(self.keyword_name("enum", id)),
            Kind::Fwd { union } => {
                Shape::Named(self.keyword_name(if *union { "union" } else { "struct" }, id))
            }
            Kind::Ptr(t) => Shape::Pointer(*t),
            Kind::Array { elem, len, .. } => Shape::Array(*elem, Some(u64::from(*len))),
            Kind::Const(t) => Shape::Qualified("const", *t),
            Kind::Volatile(t) => Shape::Qualified("volatile", *t),
            Kind::Restrict(t) => Shape::Qualified("restrict", *t),
            Kind::TypeTag(t) | Kind::Var { ty: t, .. } => self.shape(*t),
            Kind::Func { proto, .. } => match self.get(*proto).map(|t| &t.kind) {
                Some(Kind::FuncProto { .. }) => self.shape(*proto),
                _ => Shape::Unknown,
            },
            Kind::FuncProto { ret, params } => {
                let variadic = params.last().is_some_and(|p| p.ty == 0);
                let named = params.iter().take(params.len() - usize::from(variadic));
                Shape::Function {
                    ret: *ret,
                    params: named.map(|p| p.ty).collect(),
                    variadic,
                    prototyped: true,
                }
            }
            Kind::Datasec { .. } | Kind::DeclTag { .. } => Shape::Unknown,
        }
    }

    fn body(&self, id: TypeId) -> Option<Body<TypeId>> {
        let ty = self.get(id)?;
        let name = self.str_at(ty.name).to_owned();
        let (union, size, members) = match &ty.kind {
            Kind::Struct { size, members } => (false, size, members),
            Kind::Union { size, members } => (true, size, members),
            Kind::Enum { values, .. } => {
                let values = values
                    .iter()
                    .map(|v| (self.str_at(v.name).to_owned(), v.value))
                    .collect();
                return Some(Body::Enum { name, values });
            }
            _ => return None,
        };
        let members = members
            .iter()
            .map(|m| BodyMember {
                name: self.str_at(m.name).to_owned(),
                ty: m.ty,
                bit_offset: u64::from(m.bit_offset),
                bit_size: m.bitfield_size.map(u64::from),
            })
            .collect();
        Some(Body::Aggregate {
            union,
            name,
            size: u64::from(*size),
            members,
            incomplete: false,
        })
    }

    fn typedef_target(&self, id: TypeId) -> Option<TypeId> {
        match self.get(id)?.kind {
            Kind::Typedef(t) => Some(t),
            _ => None,
        }
    }

    fn size_of(&self, id: TypeId) -> Option<u64> {
        Btf::size_of(self, id)
    }
}
