//! Lookups over a parsed [`Btf`]: types by name, qualifier/typedef resolution, sizes, member
//! offsets by path (`"pid"`, `"se.vruntime"`, `"comm[3]"`) and function prototypes.
//!
//! Type graphs from a hostile blob can loop (`typedef a` → `const` → `typedef a`): every walk
//! is bounded by [`MAX_DEPTH`].

use super::{Btf, Kind, Member, TypeId};

/// The longest typedef/qualifier/member chain followed before giving up.
pub const MAX_DEPTH: usize = 64;

/// Errors of BTF lookups.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    /// No type of that name and kind.
    #[error("no {kind} named `{name}` in the BTF")]
    NoSuchType {
        /// "struct", "union", "function", ...
        kind: &'static str,
        /// The name looked for.
        name: String,
    },
    /// A path step needs a struct or union.
    #[error("`{path}` is not a struct or union, so it has no member `{member}`")]
    NotAggregate {
        /// The path up to here.
        path: String,
        /// The member asked for.
        member: String,
    },
    /// The aggregate lacks the member.
    #[error("`{path}` has no member `{member}`")]
    NoSuchMember {
        /// The path up to here.
        path: String,
        /// The member asked for.
        member: String,
    },
    /// A subscript on something that is not an array.
    #[error("`{0}` is not an array")]
    NotArray(String),
    /// The path does not parse.
    #[error("member path `{0}` is malformed (expected e.g. `se.vruntime` or `comm[3]`)")]
    BadPath(String),
    /// The type graph loops or is deeper than [`MAX_DEPTH`].
    #[error("type {0} is nested deeper than {MAX_DEPTH} levels (a loop?)")]
    TooDeep(TypeId),
    /// A size is unknown or an offset overflows.
    #[error("the size or offset of `{0}` cannot be computed")]
    NoSize(String),
}

/// Where a member lives inside its outermost aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberLocation {
    /// Offset in bits from the start of the aggregate.
    pub bit_offset: u64,
    /// Width for bitfields.
    pub bitfield_size: Option<u8>,
    /// The member's type.
    pub ty: TypeId,
}

impl MemberLocation {
    /// The byte offset, `None` for a bitfield or a member that does not start on a byte.
    pub fn byte_offset(&self) -> Option<u64> {
        (self.bitfield_size.is_none() && self.bit_offset.is_multiple_of(8))
            .then_some(self.bit_offset / 8)
    }
}

/// A function's prototype, names resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FuncSignature {
    /// Return type (0: void).
    pub ret: TypeId,
    /// Parameter names (possibly empty) and types.
    pub params: Vec<(String, TypeId)>,
    /// Whether it ends with `...`.
    pub variadic: bool,
}

impl Btf {
    /// The first type named `name` for which `accept` holds.
    pub fn find(&self, name: &str, accept: impl Fn(&Kind) -> bool) -> Option<TypeId> {
        self.iter()
            .find(|(_, t)| accept(&t.kind) && self.str_at(t.name) == name)
            .map(|(id, _)| id)
    }

    /// The struct named `name` (a definition, not a forward declaration).
    ///
    /// # Errors
    /// [`LookupError::NoSuchType`] when there is none.
    pub fn struct_by_name(&self, name: &str) -> Result<TypeId, LookupError> {
        self.find(name, |k| matches!(k, Kind::Struct { .. }))
            .ok_or_else(|| LookupError::NoSuchType {
                kind: "struct",
                name: name.into(),
            })
    }

    /// The union named `name`.
    ///
    /// # Errors
    /// [`LookupError::NoSuchType`] when there is none.
    pub fn union_by_name(&self, name: &str) -> Result<TypeId, LookupError> {
        self.find(name, |k| matches!(k, Kind::Union { .. }))
            .ok_or_else(|| LookupError::NoSuchType {
                kind: "union",
                name: name.into(),
            })
    }

    /// The type spelled as C: `struct file`, `union thread_union`, `enum pid_type`, or a
    /// typedef/base type name (`pid_t`, `int`).
    ///
    /// # Errors
    /// [`LookupError::NoSuchType`] when there is none.
    pub fn type_by_spec(&self, spec: &str) -> Result<TypeId, LookupError> {
        let spec = spec.trim();
        let no_type = || LookupError::NoSuchType {
            kind: "type",
            name: spec.into(),
        };
        match spec.split_once(char::is_whitespace) {
            Some(("struct", name)) => self.struct_by_name(name.trim()),
            Some(("union", name)) => self.union_by_name(name.trim()),
            Some(("enum", name)) => self
                .find(name.trim(), |k| matches!(k, Kind::Enum { .. }))
                .ok_or_else(no_type),
            _ => self
                .find(spec, |k| {
                    matches!(k, Kind::Typedef(_) | Kind::Int { .. } | Kind::Float { .. })
                })
                .or_else(|| {
                    self.find(spec, |k| {
                        matches!(
                            k,
                            Kind::Struct { .. } | Kind::Union { .. } | Kind::Enum { .. }
                        )
                    })
                })
                .ok_or_else(no_type),
        }
    }

    /// Strips typedefs, `const`, `volatile`, `restrict` and type tags.
    ///
    /// # Errors
    /// [`LookupError::TooDeep`] on a loop.
    pub fn resolve(&self, id: TypeId) -> Result<TypeId, LookupError> {
        let mut cur = id;
        for _ in 0..MAX_DEPTH {
            match self.get(cur).map(|t| &t.kind) {
                Some(
                    Kind::Typedef(t)
                    | Kind::Const(t)
                    | Kind::Volatile(t)
                    | Kind::Restrict(t)
                    | Kind::TypeTag(t),
                ) => cur = *t,
                _ => return Ok(cur),
            }
        }
        Err(LookupError::TooDeep(id))
    }

    /// Size in bytes of type `id`; pointers are 8 bytes (BTF does not record it; x86-64).
    /// `None` for `void`, functions and what cannot be sized.
    pub fn size_of(&self, id: TypeId) -> Option<u64> {
        self.size_of_depth(id, 0)
    }

    fn size_of_depth(&self, id: TypeId, depth: usize) -> Option<u64> {
        if depth > MAX_DEPTH {
            return None;
        }
        match &self.get(self.resolve(id).ok()?)?.kind {
            Kind::Int { size, .. }
            | Kind::Struct { size, .. }
            | Kind::Union { size, .. }
            | Kind::Enum { size, .. }
            | Kind::Float { size }
            | Kind::Datasec { size, .. } => Some(u64::from(*size)),
            Kind::Ptr(_) => Some(8),
            Kind::Array { elem, len, .. } => self
                .size_of_depth(*elem, depth + 1)?
                .checked_mul(u64::from(*len)),
            Kind::Var { ty, .. } => self.size_of_depth(*ty, depth + 1),
            _ => None,
        }
    }

    /// Members of the struct/union `id` after resolving typedefs and qualifiers.
    fn members_of(&self, id: TypeId) -> Option<&[Member]> {
        match &self.get(self.resolve(id).ok()?)?.kind {
            Kind::Struct { members, .. } | Kind::Union { members, .. } => Some(members),
            _ => None,
        }
    }

    /// Finds member `name` in aggregate `id`, looking through anonymous struct/union members
    /// as C does. Returns the bit offset relative to `id` and the member.
    fn find_member(&self, id: TypeId, name: &str, depth: usize) -> Option<(u64, &Member)> {
        if depth > MAX_DEPTH {
            return None;
        }
        let members = self.members_of(id)?;
        if let Some(m) = members.iter().find(|m| self.str_at(m.name) == name) {
            return Some((u64::from(m.bit_offset), m));
        }
        members
            .iter()
            .filter(|m| m.name == 0 || self.str_at(m.name).is_empty())
            .find_map(|m| {
                let (inner, found) = self.find_member(m.ty, name, depth + 1)?;
                Some((u64::from(m.bit_offset).checked_add(inner)?, found))
            })
    }

    /// Location of the member at `path` inside aggregate `id`. A path is member names joined
    /// by `.`, each optionally followed by `[N]` subscripts: `se.vruntime`, `comm[3]`.
    ///
    /// # Errors
    /// [`LookupError`] when the path is malformed or a step does not exist.
    pub fn member(&self, id: TypeId, path: &str) -> Result<MemberLocation, LookupError> {
        let mut loc = MemberLocation {
            bit_offset: 0,
            bitfield_size: None,
            ty: id,
        };
        let mut walked = self.name(id).to_owned();
        for step in path.split('.') {
            let (member, subscripts) =
                split_subscripts(step).ok_or_else(|| LookupError::BadPath(path.into()))?;
            if self.members_of(loc.ty).is_none() {
                return Err(LookupError::NotAggregate {
                    path: walked,
                    member: member.into(),
                });
            }
            let (off, m) =
                self.find_member(loc.ty, member, 0)
                    .ok_or_else(|| LookupError::NoSuchMember {
                        path: walked.clone(),
                        member: member.into(),
                    })?;
            walked = format!("{walked}.{member}");
            loc = MemberLocation {
                bit_offset: loc
                    .bit_offset
                    .checked_add(off)
                    .ok_or_else(|| LookupError::NoSize(walked.clone()))?,
                bitfield_size: m.bitfield_size,
                ty: m.ty,
            };
            for index in subscripts {
                let Some(Kind::Array { elem, .. }) =
                    self.get(self.resolve(loc.ty)?).map(|t| &t.kind)
                else {
                    return Err(LookupError::NotArray(walked));
                };
                let elem_bits = self
                    .size_of(*elem)
                    .and_then(|s| s.checked_mul(8)?.checked_mul(index))
                    .ok_or_else(|| LookupError::NoSize(walked.clone()))?;
                walked = format!("{walked}[{index}]");
                loc.bit_offset = loc
                    .bit_offset
                    .checked_add(elem_bits)
                    .ok_or_else(|| LookupError::NoSize(walked.clone()))?;
                loc.ty = *elem;
            }
        }
        Ok(loc)
    }

    /// Location of `path` inside `struct struct_name`, e.g. (`"task_struct"`, `"pid"`).
    ///
    /// # Errors
    /// [`LookupError`] when the struct or a path step does not exist.
    pub fn struct_member(
        &self,
        struct_name: &str,
        path: &str,
    ) -> Result<MemberLocation, LookupError> {
        self.member(self.struct_by_name(struct_name)?, path)
    }

    /// The prototype of the function named `name` (a BTF `FUNC`).
    ///
    /// # Errors
    /// [`LookupError::NoSuchType`] when there is no such function or its prototype is missing.
    pub fn func_signature(&self, name: &str) -> Result<FuncSignature, LookupError> {
        let no_func = || LookupError::NoSuchType {
            kind: "function",
            name: name.into(),
        };
        let func = self
            .find(name, |k| matches!(k, Kind::Func { .. }))
            .ok_or_else(no_func)?;
        let Some(Kind::Func { proto, .. }) = self.get(func).map(|t| &t.kind) else {
            return Err(no_func());
        };
        let Some(Kind::FuncProto { ret, params }) = self.get(*proto).map(|t| &t.kind) else {
            return Err(no_func());
        };
        let variadic = params.last().is_some_and(|p| p.ty == 0);
        let named = params.iter().take(params.len() - usize::from(variadic));
        Ok(FuncSignature {
            ret: *ret,
            params: named
                .map(|p| (self.str_at(p.name).to_owned(), p.ty))
                .collect(),
            variadic,
        })
    }
}

/// `comm[3][1]` → (`comm`, [3, 1]); `None` when malformed.
fn split_subscripts(step: &str) -> Option<(&str, Vec<u64>)> {
    let (name, mut rest) = step.split_once('[').map_or((step, ""), |(n, r)| (n, r));
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return None;
    }
    let mut subscripts = Vec::new();
    if !rest.is_empty() {
        rest = step.get(name.len()..)?;
    }
    while let Some(after_open) = rest.strip_prefix('[') {
        let (index, after) = after_open.split_once(']')?;
        subscripts.push(index.trim().parse().ok()?);
        rest = after;
    }
    rest.is_empty().then_some((name, subscripts))
}

#[cfg(test)]
mod tests {
    use super::split_subscripts;

    #[test]
    fn split_subscripts_reads_plain_and_indexed_steps() {
        assert_eq!(split_subscripts("pid"), Some(("pid", vec![])));
        assert_eq!(split_subscripts("comm[3]"), Some(("comm", vec![3])));
        assert_eq!(split_subscripts("m[1][2]"), Some(("m", vec![1, 2])));
    }

    #[test]
    fn split_subscripts_refuses_malformed_steps() {
        assert_eq!(split_subscripts(""), None);
        assert_eq!(split_subscripts("a[x]"), None);
        assert_eq!(split_subscripts("a[1"), None);
        assert_eq!(split_subscripts("a[1]b"), None);
        assert_eq!(split_subscripts("a-b"), None);
    }
}
