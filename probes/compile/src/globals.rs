//! Kernel global variables, `@var("name")` and `@var("name@file.c")`, for the compiled bodies
//! and the host-evaluated ones alike.
//!
//! A global is an address and a type. The address is the link-time one (kallsyms or
//! System.map for `@var("name")`; the DWARF variable of that file for `@var("name@file")`,
//! where several files may have a `static` of the same name), slid by the KASLR slide when the
//! script is installed. The type comes from BTF's `VAR` entries where the kernel has them (6.1
//! emits them for per-CPU variables only), else from the -dbg vmlinux's DWARF when it is cached
//! (its type's name looked up in BTF, so member chains are laid out as every other chain is,
//! [`super::types`]). A linker-script alias (`jiffies = jiffies_64` on x86) has no DWARF
//! variable of its own: it takes the type of the variable DWARF places at its address.
//!
//! The value is read through guest memory from the address: an integer or pointer is read,
//! an array is its address (as in C), and a struct needs a member (`@var("init_task")->comm`).
//! The compiled code does each read with the kernel's `copy_from_kernel_nofault`, so an
//! unmapped address is a probe error, never a fault in the guest.

use std::collections::BTreeMap;

use super::types::{cast_chain, chain, KernelTypes, Shape, Step, TypeRef};

/// One kernel global variable: where it is at link time and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelGlobal {
    /// Link-time address.
    pub link: u64,
    /// Its type, as [`KernelTypes`] names it.
    pub ty: TypeRef,
    /// The type as C, for messages.
    pub type_name: String,
}

/// The globals a script reads, by `@var` specification (`"jiffies"`, `"x@fs/file.c"`), or why
/// each cannot be read.
pub type KernelGlobals = BTreeMap<String, Result<KernelGlobal, String>>;

/// The specification inside a target variable's name, when it is an `@var(...)`:
/// `@var("jiffies")` gives `jiffies`.
pub fn spec_of(target: &str) -> Option<String> {
    let inner = target.strip_prefix("@var(\"")?.strip_suffix("\")")?;
    // The parser keeps the literal escaped (`escape_default`); names have no escapes.
    Some(inner.replace("\\\"", "\"").replace("\\\\", "\\"))
}

/// The name part and the file part of a specification (`name@file`).
pub fn split_spec(spec: &str) -> (&str, Option<&str>) {
    match spec.split_once('@') {
        Some((name, file)) => (name, Some(file)),
        None => (spec, None),
    }
}

/// The steps that read `members` of a global of type `ty` from its address (or, with no
/// members, the global itself).
///
/// # Errors
/// A sentence naming what cannot be read: a struct without a member, a member chain from
/// something that is neither a struct nor a pointer to one, a type that is not a value.
pub fn steps(
    types: &dyn KernelTypes,
    ty: TypeRef,
    members: &[String],
) -> Result<Vec<Step>, String> {
    match (types.shape(ty), members.is_empty()) {
        (Shape::Aggregate, false) => cast_chain(types, ty, members),
        (Shape::Aggregate, true) => {
            Err("is a struct or union, not a value: name a member (->m)".into())
        }
        (Shape::Int { size, signed }, true) => Ok(vec![Step::Read {
            offset: 0,
            size,
            signed,
        }]),
        (Shape::Pointer(_), true) => Ok(vec![Step::Read {
            offset: 0,
            size: 8,
            signed: false,
        }]),
        (Shape::Array, true) => Ok(vec![Step::Address { offset: 0 }]),
        (Shape::Pointer(_), false) => {
            let mut s = vec![Step::Read {
                offset: 0,
                size: 8,
                signed: false,
            }];
            s.extend(chain(types, ty, members)?);
            Ok(s)
        }
        (Shape::Int { .. } | Shape::Array, false) => {
            Err("has members only when it is a struct or a pointer to one".into())
        }
        (Shape::Other, _) => Err("has a type that is neither an integer nor a pointer".into()),
    }
}

/// The address steps of `&@var("x")->members` (or `&@var("x")`).
///
/// # Errors
/// As [`steps`].
pub fn address_steps(
    types: &dyn KernelTypes,
    ty: TypeRef,
    members: &[String],
) -> Result<Vec<Step>, String> {
    if members.is_empty() {
        return Ok(vec![Step::Address { offset: 0 }]);
    }
    match types.shape(ty) {
        Shape::Aggregate => super::types::cast_address_chain(types, ty, members),
        Shape::Pointer(_) => {
            let mut s = vec![Step::Read {
                offset: 0,
                size: 8,
                signed: false,
            }];
            s.extend(super::types::address_chain(types, ty, members)?);
            Ok(s)
        }
        _ => Err("has members only when it is a struct or a pointer to one".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1: struct task { int pid @8; char comm[16] @16; struct task *parent @32 }
    /// 2: int; 3: char[16]; 4: struct task *; 5: unsigned long
    #[derive(Debug)]
    struct Types;

    impl KernelTypes for Types {
        fn param(&self, _: &str, _: Option<&str>) -> Option<TypeRef> {
            None
        }
        fn named(&self, _: &str) -> Option<TypeRef> {
            None
        }
        fn shape(&self, ty: TypeRef) -> Shape {
            match ty {
                1 => Shape::Aggregate,
                2 => Shape::Int {
                    size: 4,
                    signed: true,
                },
                3 => Shape::Array,
                4 => Shape::Pointer(1),
                5 => Shape::Int {
                    size: 8,
                    signed: false,
                },
                _ => Shape::Other,
            }
        }
        fn member(&self, ty: TypeRef, name: &str) -> Option<(u64, TypeRef)> {
            match (ty, name) {
                (1, "pid") => Some((8, 2)),
                (1, "comm") => Some((16, 3)),
                (1, "parent") => Some((32, 4)),
                _ => None,
            }
        }
    }

    fn m(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn specifications_come_out_of_the_var_name_with_their_file() {
        assert_eq!(spec_of("@var(\"jiffies\")").as_deref(), Some("jiffies"));
        assert_eq!(spec_of("$jiffies"), None);
        assert_eq!(
            split_spec("nr_threads@kernel/fork.c"),
            ("nr_threads", Some("kernel/fork.c"))
        );
        assert_eq!(split_spec("jiffies"), ("jiffies", None));
    }

    #[test]
    fn a_scalar_global_is_one_read_at_its_address() {
        assert_eq!(
            steps(&Types, 5, &[]),
            Ok(vec![Step::Read {
                offset: 0,
                size: 8,
                signed: false
            }])
        );
        assert_eq!(
            steps(&Types, 2, &[]),
            Ok(vec![Step::Read {
                offset: 0,
                size: 4,
                signed: true
            }])
        );
    }

    #[test]
    fn a_struct_global_starts_inside_the_struct_and_a_pointer_is_read_first() {
        assert_eq!(
            steps(&Types, 1, &m(&["pid"])),
            Ok(vec![Step::Read {
                offset: 8,
                size: 4,
                signed: true
            }])
        );
        assert_eq!(
            steps(&Types, 1, &m(&["comm"])),
            Ok(vec![Step::Address { offset: 16 }])
        );
        assert_eq!(
            steps(&Types, 4, &m(&["pid"])),
            Ok(vec![
                Step::Read {
                    offset: 0,
                    size: 8,
                    signed: false
                },
                Step::Read {
                    offset: 8,
                    size: 4,
                    signed: true
                }
            ])
        );
        assert_eq!(
            address_steps(&Types, 1, &m(&["parent"])),
            Ok(vec![Step::Address { offset: 32 }])
        );
    }

    #[test]
    fn a_bare_struct_and_members_of_an_integer_are_refused() {
        assert!(steps(&Types, 1, &[]).unwrap_err().contains("name a member"));
        assert!(steps(&Types, 2, &m(&["x"]))
            .unwrap_err()
            .contains("members only"));
        assert!(steps(&Types, 1, &m(&["nope"]))
            .unwrap_err()
            .contains("no such member"));
    }
}
