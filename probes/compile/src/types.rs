//! Member chains of target variables (`$file->f_inode->i_ino`, `@cast(p, "struct
//! task_struct")->pid`), laid out on the host at compile time.
//!
//! A chain becomes a list of [`Step`]s: from the base value (a parameter, `$return` or the
//! `@cast` pointer), add a member's byte offset, and read through the pointer where the type
//! is a pointer (`->` into an embedded struct or union adds its offset without a read, as in
//! SystemTap). The generated code does each read with the kernel's
//! `copy_from_kernel_nofault`, so a NULL or bad pointer anywhere in the chain ends the hit
//! with a counted probe error (`FAULTS`), never a fault in the guest.
//!
//! The compiler asks about types through [`KernelTypes`] (the guest's BTF in a live run,
//! [`BtfTypes`]), so the layout walk is tested on made-up types too.

use exotap_introspect::btf::{Btf, Kind, TypeId};

/// A type, as [`KernelTypes`] names it.
pub type TypeRef = u32;

/// What a type is, as far as a member chain cares (typedefs and qualifiers stripped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// An integer or enum of `size` bytes (1, 2, 4 or 8).
    Int {
        /// Bytes.
        size: u8,
        /// Sign-extended when read.
        signed: bool,
    },
    /// A pointer to `TypeRef` (0: `void`).
    Pointer(TypeRef),
    /// A struct or union.
    Aggregate,
    /// An array (its value is its address, as in C).
    Array,
    /// Anything else (floats, functions, void).
    Other,
}

/// What the compiler needs to know about the guest kernel's types.
pub trait KernelTypes: std::fmt::Debug + Send + Sync {
    /// The type of `function`'s parameter `param`, or its return type (`None`).
    fn param(&self, function: &str, param: Option<&str>) -> Option<TypeRef>;
    /// A type named as `@cast` names it: `struct task_struct`, `task_struct`, `pid_t`.
    fn named(&self, spec: &str) -> Option<TypeRef>;
    /// What `ty` is.
    fn shape(&self, ty: TypeRef) -> Shape;
    /// Member `name` of the struct or union `ty` (looking through anonymous members): its
    /// byte offset and type. `None` also for a bitfield.
    fn member(&self, ty: TypeRef, name: &str) -> Option<(u64, TypeRef)>;
    /// The element type of the array `ty` (`None`: not an array, or not known).
    fn element(&self, _ty: TypeRef) -> Option<TypeRef> {
        None
    }
    /// The size of `ty` in bytes, for a subscript's stride (`None`: not known).
    fn size(&self, _ty: TypeRef) -> Option<u64> {
        None
    }
}

/// One step of a chain, applied to the value in hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Read `size` bytes at value + `offset` (sign-extended when `signed`): the new value.
    Read {
        /// Byte offset added first.
        offset: u64,
        /// 1, 2, 4 or 8.
        size: u8,
        /// Sign-extend.
        signed: bool,
    },
    /// value + `offset`: an array's address is its value.
    Address {
        /// Byte offset.
        offset: u64,
    },
    /// value + index × `scale`, the index the `slot`-th computed subscript of the chain
    /// (`@cast(p, "T")->fd[i]`), evaluated before the chain is walked.
    Index {
        /// Which computed subscript, in the chain's order.
        slot: usize,
        /// The element's size.
        scale: u64,
    },
}

impl Step {
    /// Applies the steps to `value` on the host, reading guest memory with `read` (address
    /// and size to the little-endian bytes): what the generated code does in the guest.
    ///
    /// # Errors
    /// The address of the first read that `read` could not do.
    pub fn follow(
        steps: &[Step],
        value: u64,
        indexes: &[i64],
        mut read: impl FnMut(u64, usize) -> Option<Vec<u8>>,
    ) -> Result<i64, u64> {
        let mut value = value;
        for step in steps {
            value = match *step {
                Step::Address { offset } => value.wrapping_add(offset),
                Step::Index { slot, scale } => {
                    // A chain is laid out with as many slots as its computed subscripts.
                    let index = indexes.get(slot).copied().unwrap_or(0) as u64;
                    value.wrapping_add(index.wrapping_mul(scale))
                }
                Step::Read {
                    offset,
                    size,
                    signed,
                } => {
                    let at = value.wrapping_add(offset);
                    let bytes = read(at, usize::from(size))
                        .filter(|b| b.len() == usize::from(size) && size <= 8)
                        .ok_or(at)?;
                    let mut buf = [0u8; 8];
                    buf[..bytes.len()].copy_from_slice(&bytes);
                    let raw = u64::from_le_bytes(buf);
                    let shift = 64 - 8 * u32::from(size);
                    if signed && shift > 0 {
                        (((raw << shift) as i64) >> shift) as u64
                    } else {
                        raw
                    }
                }
            };
        }
        Ok(value as i64)
    }
}

/// Lays out the chain `members` from a value of type `base`.
///
/// # Errors
/// A sentence naming the step that does not compile (no such member, a bitfield, a member
/// that is a struct, a step through something that is not a pointer).
pub fn chain(
    types: &dyn KernelTypes,
    base: TypeRef,
    members: &[String],
) -> Result<Vec<Step>, String> {
    walk(types, base, None, members, false)
}

/// Lays out `&` of the chain `members` (`&$file->f_pos`, `&$p->m->sub`): as [`chain`], but
/// the last member's address is the value, whatever its type (a struct too).
///
/// # Errors
/// As [`chain`], but for the last member's type.
pub fn address_chain(
    types: &dyn KernelTypes,
    base: TypeRef,
    members: &[String],
) -> Result<Vec<Step>, String> {
    walk(types, base, None, members, true)
}

/// `&@cast(p, "type")->members`: as [`address_chain`] from a pointer to `pointee`.
///
/// # Errors
/// As [`cast_chain`], but for the last member's type.
pub fn cast_address_chain(
    types: &dyn KernelTypes,
    pointee: TypeRef,
    members: &[String],
) -> Result<Vec<Step>, String> {
    if types.shape(pointee) != Shape::Aggregate {
        return Err("the type is not a struct or union".into());
    }
    walk(types, pointee, Some(pointee), members, true)
}

/// Lays out the chain `members` of `@cast(p, "type")`: `p` points to `pointee`.
///
/// # Errors
/// As [`chain`]; also when `pointee` is not a struct or union.
pub fn cast_chain(
    types: &dyn KernelTypes,
    pointee: TypeRef,
    members: &[String],
) -> Result<Vec<Step>, String> {
    if types.shape(pointee) != Shape::Aggregate {
        return Err("the type is not a struct or union".into());
    }
    walk(types, pointee, Some(pointee), members, false)
}

/// The walk: from a value of type `base`, or from a pointer to the aggregate `pointee`; with
/// `address`, the last member's address rather than its value.
fn walk(
    types: &dyn KernelTypes,
    base: TypeRef,
    pointee: Option<TypeRef>,
    members: &[String],
    address: bool,
) -> Result<Vec<Step>, String> {
    let mut steps = Vec::new();
    let mut ty = base;
    // The value in hand is a pointer to the current aggregate, plus `pending` bytes.
    let mut pending = 0u64;
    let mut through_pointer = false;
    let mut slots = 0;
    for (i, member) in members.iter().enumerate() {
        if member.ends_with('$') {
            return Err(format!("the pretty-printed member ->{member}"));
        }
        let (member, subscript) = match member.split_once('[') {
            None => (member.as_str(), None),
            Some((name, sub)) => {
                let sub = sub
                    .strip_suffix(']')
                    .filter(|s| !s.contains('['))
                    .ok_or_else(|| format!("the member {member} (one subscript at most)"))?;
                (name, Some(sub))
            }
        };
        if member.is_empty() {
            // `@cast(p, "T")[i]->...`: the i-th T from p.
            let (Some(sub), (0, Some(p))) = (subscript, (i, pointee)) else {
                return Err(format!("the subscript {} after a member", members[i]));
            };
            index(types, p, sub, &mut steps, &mut pending, &mut slots)?;
            ty = p;
            through_pointer = true;
            continue;
        }
        let aggregate = match (i, pointee) {
            (0, Some(p)) => p,
            _ => match types.shape(ty) {
                Shape::Pointer(to) if types.shape(to) == Shape::Aggregate => {
                    if through_pointer {
                        // Read the pointer itself, then step into what it points to.
                        steps.push(Step::Read {
                            offset: pending,
                            size: 8,
                            signed: false,
                        });
                        pending = 0;
                    }
                    to
                }
                Shape::Aggregate if i > 0 => ty,
                _ => {
                    return Err(format!(
                        "->{member} of something that is not a struct pointer"
                    ))
                }
            },
        };
        let (offset, next) = types
            .member(aggregate, member)
            .ok_or_else(|| format!("->{member}: no such member (or a bitfield)"))?;
        pending = pending
            .checked_add(offset)
            .ok_or_else(|| format!("->{member}: the offset overflows"))?;
        through_pointer = true;
        ty = next;
        if let Some(sub) = subscript {
            ty = match types.shape(ty) {
                Shape::Array => types
                    .element(ty)
                    .ok_or_else(|| format!("->{member}[]: the array's element type"))?,
                Shape::Pointer(to) => {
                    steps.push(Step::Read {
                        offset: pending,
                        size: 8,
                        signed: false,
                    });
                    pending = 0;
                    to
                }
                _ => {
                    return Err(format!(
                        "->{member}[] of something that is not an array or a pointer"
                    ))
                }
            };
            index(types, ty, sub, &mut steps, &mut pending, &mut slots)
                .map_err(|e| format!("->{member}[]: {e}"))?;
        }
    }
    if address {
        steps.push(Step::Address { offset: pending });
        return Ok(steps);
    }
    match types.shape(ty) {
        Shape::Int { size, signed } => steps.push(Step::Read {
            offset: pending,
            size,
            signed,
        }),
        Shape::Pointer(_) => steps.push(Step::Read {
            offset: pending,
            size: 8,
            signed: false,
        }),
        Shape::Array => steps.push(Step::Address { offset: pending }),
        Shape::Aggregate => {
            return Err(format!(
                "->{} is a struct or union, not a value",
                members.last().map_or("", String::as_str)
            ))
        }
        Shape::Other => {
            return Err(format!(
                "->{} has a type that is neither an integer nor a pointer",
                members.last().map_or("", String::as_str)
            ))
        }
    }
    Ok(steps)
}

/// Where a target variable's member chain starts at a point.
#[derive(Debug, Clone, Copy)]
pub enum ChainBase<'a> {
    /// A variable by its DWARF location ([`super::locals`]): its pointer type names the
    /// struct (`None`: it is not a pointer to a struct).
    Local(Option<&'a str>),
    /// A parameter of the probed function by its BTF type, or (`None`) its return value.
    Param(Option<&'a str>),
}

/// The base of target variable `name` (with its `$`) at a point of a function with BTF
/// parameters `params`, in a return probe or not: a parameter first, then a variable by its
/// DWARF location (not in return probes: the function's frame is gone), `$return` in a
/// return probe. `None` where the variable is not defined there.
pub fn chain_base<'a>(
    name: &'a str,
    params: &[String],
    is_return: bool,
    locals: Option<&'a super::locals::Locals>,
) -> Option<ChainBase<'a>> {
    if name == "$return" {
        return is_return.then_some(ChainBase::Param(None));
    }
    let bare = name.strip_prefix('$')?;
    if params.iter().any(|p| p == bare) {
        return Some(ChainBase::Param(Some(bare)));
    }
    if is_return {
        return None;
    }
    let local = locals?.get(bare)?.as_ref().ok()?;
    Some(ChainBase::Local(local.pointee.as_deref()))
}

/// Lays out `members` of the target variable `name` from `base` at a point of `function`,
/// as both the compiler and the host-evaluated path read it; with `address`, the last
/// member's address.
///
/// # Errors
/// As [`chain`], without the chain's path in front; also where the base has no struct type.
pub fn target_chain(
    types: &dyn KernelTypes,
    function: &str,
    name: &str,
    base: ChainBase<'_>,
    members: &[String],
    address: bool,
) -> Result<Vec<Step>, String> {
    match base {
        ChainBase::Local(pointee) => {
            let pointee = pointee.ok_or_else(|| format!("{name} is not a pointer to a struct"))?;
            let ty = types
                .named(pointee)
                .ok_or_else(|| format!("BTF has no {pointee}"))?;
            if address {
                cast_address_chain(types, ty, members)
            } else {
                cast_chain(types, ty, members)
            }
        }
        ChainBase::Param(param) => {
            let ty = types
                .param(function, param)
                .ok_or_else(|| format!("BTF has no type for {name} of {function}"))?;
            walk(types, ty, None, members, address)
        }
    }
}

/// `@defined` of the member chain `members` of target variable `name` (known when
/// compiling, as SystemTap knows it): the variable is defined at the point and the chain
/// lays out from its type, whatever the values the pointers hold when it runs.
pub fn chain_defined(
    types: Option<&dyn KernelTypes>,
    function: &str,
    name: &str,
    base: Option<ChainBase<'_>>,
    members: &[String],
) -> bool {
    match (base, types) {
        (None, _) => false,
        (Some(_), _) if members.is_empty() => true,
        (Some(_), None) => false,
        (Some(base), Some(types)) => {
            target_chain(types, function, name, base, members, false).is_ok()
        }
    }
}

/// `@defined(@cast(p, "T")->m...)`, known when compiling as SystemTap knows it: the kernel
/// has the type, and the chain lays out from it (without members: the type exists).
pub fn cast_defined(types: Option<&dyn KernelTypes>, cast: &exotap_lang::ast::CastExpr) -> bool {
    let Some(types) = types.filter(|_| cast.of_kernel()) else {
        return false;
    };
    types
        .named(&cast.type_name)
        .is_some_and(|ty| cast.members.is_empty() || cast_chain(types, ty, &cast.members).is_ok())
}

/// Steps to the element `sub` (a number, or `?`: the next computed subscript) of an array
/// of `elem` whose first element is at the value in hand plus `pending`.
fn index(
    types: &dyn KernelTypes,
    elem: TypeRef,
    sub: &str,
    steps: &mut Vec<Step>,
    pending: &mut u64,
    slots: &mut usize,
) -> Result<(), String> {
    let scale = types
        .size(elem)
        .filter(|s| *s > 0)
        .ok_or("the element's size is not known")?;
    if sub == "?" {
        if *pending != 0 {
            steps.push(Step::Address { offset: *pending });
            *pending = 0;
        }
        steps.push(Step::Index {
            slot: *slots,
            scale,
        });
        *slots += 1;
        return Ok(());
    }
    let n: i64 = sub.parse().map_err(|_| format!("the subscript [{sub}]"))?;
    let by = (n as u64).wrapping_mul(scale);
    *pending = pending.wrapping_add(by);
    Ok(())
}

/// [`KernelTypes`] from the guest kernel's BTF.
#[derive(Debug, Clone)]
pub struct BtfTypes(pub Btf);

impl KernelTypes for BtfTypes {
    fn param(&self, function: &str, param: Option<&str>) -> Option<TypeRef> {
        let sig = self.0.func_signature(function).ok()?;
        match param {
            None => Some(sig.ret),
            Some(name) => sig.params.iter().find(|p| p.0 == name).map(|p| p.1),
        }
    }

    fn named(&self, spec: &str) -> Option<TypeRef> {
        self.0.type_by_spec(spec).ok()
    }

    fn shape(&self, ty: TypeRef) -> Shape {
        let Some(t) = self.0.resolve(ty).ok().and_then(|id| self.0.get(id)) else {
            return Shape::Other;
        };
        match &t.kind {
            Kind::Int { size, encoding, .. } if matches!(size, 1 | 2 | 4 | 8) => Shape::Int {
                size: *size as u8,
                signed: encoding.signed,
            },
            Kind::Enum { size, .. } if matches!(size, 1 | 2 | 4 | 8) => Shape::Int {
                size: *size as u8,
                signed: false,
            },
            Kind::Ptr(to) => Shape::Pointer(*to),
            Kind::Struct { .. } | Kind::Union { .. } => Shape::Aggregate,
            Kind::Array { .. } => Shape::Array,
            _ => Shape::Other,
        }
    }

    fn member(&self, ty: TypeRef, name: &str) -> Option<(u64, TypeRef)> {
        let loc = self.0.member(ty as TypeId, name).ok()?;
        Some((loc.byte_offset()?, loc.ty))
    }

    fn element(&self, ty: TypeRef) -> Option<TypeRef> {
        match &self.0.get(self.0.resolve(ty).ok()?)?.kind {
            Kind::Array { elem, .. } => Some(*elem),
            _ => None,
        }
    }

    fn size(&self, ty: TypeRef) -> Option<u64> {
        self.0.size_of(ty)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// struct file (1) { int pad; struct inode *f_inode @8; struct { long a; } inner @16 }
    /// struct inode (3) { unsigned long i_ino @64; short i_mode @2; char name[4] @4 }
    #[derive(Debug)]
    struct Made;

    impl KernelTypes for Made {
        fn param(&self, _: &str, p: Option<&str>) -> Option<TypeRef> {
            (p == Some("file")).then_some(2)
        }
        fn named(&self, spec: &str) -> Option<TypeRef> {
            (spec == "struct inode").then_some(3)
        }
        fn shape(&self, ty: TypeRef) -> Shape {
            match ty {
                1 | 3 | 7 => Shape::Aggregate,
                2 => Shape::Pointer(1),
                4 => Shape::Pointer(3),
                5 => Shape::Int {
                    size: 8,
                    signed: false,
                },
                6 => Shape::Int {
                    size: 2,
                    signed: true,
                },
                8 => Shape::Array,
                _ => Shape::Other,
            }
        }
        fn member(&self, ty: TypeRef, name: &str) -> Option<(u64, TypeRef)> {
            match (ty, name) {
                (1, "f_inode") => Some((8, 4)),
                (1, "inner") => Some((16, 7)),
                (7, "a") => Some((0, 5)),
                (3, "i_ino") => Some((64, 5)),
                (3, "i_mode") => Some((2, 6)),
                (3, "name") => Some((4, 8)),
                _ => None,
            }
        }
        fn element(&self, ty: TypeRef) -> Option<TypeRef> {
            // char name[4]: elements of the 2-byte type 6 here, to see the stride.
            (ty == 8).then_some(6)
        }
        fn size(&self, ty: TypeRef) -> Option<u64> {
            match ty {
                3 => Some(0x48),
                4 => Some(8),
                6 => Some(2),
                _ => None,
            }
        }
    }

    #[test]
    fn subscripts_step_by_the_element_size_from_the_value_in_hand() {
        // @cast(p, "struct inode")[i]->name[j] at 0x1000, i = 2, j = 3: p + 2 * 0x48, then
        // name at +4, then 3 elements of 2 bytes, read as a short.
        let steps = cast_chain(&Made, 3, &members(&["[?]", "name[?]"])).unwrap();
        let mut reads = Vec::new();
        let value = Step::follow(&steps, 0x1000, &[2, 3], |at, len| {
            reads.push((at, len));
            Some(vec![0xfe, 0xff])
        });
        assert_eq!(value, Ok(-2));
        assert_eq!(reads, [(0x1000 + 2 * 0x48 + 4 + 3 * 2, 2)]);
        // A constant subscript folds into the offset; a pointer's subscript reads it first.
        assert_eq!(
            chain(&Made, 2, &members(&["f_inode[1]", "i_mode"])),
            Ok(vec![
                Step::Read {
                    offset: 8,
                    size: 8,
                    signed: false
                },
                Step::Read {
                    offset: 0x48 + 2,
                    size: 2,
                    signed: true
                },
            ])
        );
        // Subscripts of what is neither an array nor a pointer, of an unknown size, and a
        // second subscript are refused.
        assert!(chain(&Made, 2, &members(&["inner[1]"])).is_err());
        assert!(cast_chain(&Made, 3, &members(&["i_ino[0]"])).is_err());
        assert!(cast_chain(&Made, 3, &members(&["name[1][2]"])).is_err());
        assert!(chain(&Made, 2, &members(&["f_inode", "[1]"])).is_err());
    }

    fn members(m: &[&str]) -> Vec<String> {
        m.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_chain_reads_each_pointer_then_the_member() {
        assert_eq!(
            chain(&Made, 2, &members(&["f_inode", "i_mode"])),
            Ok(vec![
                Step::Read {
                    offset: 8,
                    size: 8,
                    signed: false
                },
                Step::Read {
                    offset: 2,
                    size: 2,
                    signed: true
                },
            ])
        );
    }

    #[test]
    fn an_embedded_struct_adds_its_offset_without_a_read() {
        assert_eq!(
            chain(&Made, 2, &members(&["inner", "a"])),
            Ok(vec![Step::Read {
                offset: 16,
                size: 8,
                signed: false
            }])
        );
    }

    #[test]
    fn a_cast_starts_inside_the_named_struct() {
        assert_eq!(
            cast_chain(&Made, 3, &members(&["i_ino"])),
            Ok(vec![Step::Read {
                offset: 64,
                size: 8,
                signed: false
            }])
        );
        assert!(cast_chain(&Made, 5, &members(&["i_ino"])).is_err());
    }

    #[test]
    fn address_of_a_member_reads_the_pointers_but_not_the_member() {
        // &$file->f_inode->i_mode: file->f_inode read, then i_mode's address.
        assert_eq!(
            address_chain(&Made, 2, &members(&["f_inode", "i_mode"])),
            Ok(vec![
                Step::Read {
                    offset: 8,
                    size: 8,
                    signed: false
                },
                Step::Address { offset: 2 },
            ])
        );
        // &$file->inner: a struct member has an address, though no value.
        assert_eq!(
            address_chain(&Made, 2, &members(&["inner"])),
            Ok(vec![Step::Address { offset: 16 }])
        );
        assert!(chain(&Made, 2, &members(&["inner"])).is_err());
        // &@cast(p, "struct inode")->i_ino: p plus the offset, nothing read.
        let steps = cast_address_chain(&Made, 3, &members(&["i_ino"])).unwrap();
        assert_eq!(Step::follow(&steps, 0x4000, &[], |_, _| None), Ok(0x4040));
        assert!(cast_address_chain(&Made, 5, &members(&["i_ino"])).is_err());
    }

    #[test]
    fn an_array_member_is_its_address() {
        assert_eq!(
            chain(&Made, 4, &members(&["name"])),
            Ok(vec![Step::Address { offset: 4 }])
        );
    }

    #[test]
    fn following_steps_reads_each_pointer_and_sign_extends_the_last() {
        let steps = chain(&Made, 2, &members(&["f_inode", "i_mode"])).unwrap();
        let memory = |at: u64, len: usize| match (at, len) {
            (0x1008, 8) => Some(0x2000u64.to_le_bytes().to_vec()),
            (0x2002, 2) => Some(vec![0xfe, 0xff]),
            _ => None,
        };

        assert_eq!(Step::follow(&steps, 0x1000, &[], memory), Ok(-2));
    }

    #[test]
    fn following_through_a_null_pointer_names_the_faulting_address() {
        let steps = chain(&Made, 2, &members(&["f_inode", "i_mode"])).unwrap();
        let memory = |at: u64, _: usize| (at == 0x1008).then(|| vec![0u8; 8]);

        assert_eq!(Step::follow(&steps, 0x1000, &[], memory), Err(2));
    }

    #[test]
    fn a_missing_member_a_struct_value_and_a_long_base_are_refused() {
        assert!(chain(&Made, 2, &members(&["nope"]))
            .unwrap_err()
            .contains("->nope"));
        assert!(chain(&Made, 2, &members(&["inner"]))
            .unwrap_err()
            .contains("struct"));
        assert!(chain(&Made, 5, &members(&["a"]))
            .unwrap_err()
            .contains("not a struct pointer"));
    }
}
