//! C declarations and `ptype`-style struct bodies, formatted the way gdb prints them, for any
//! type graph (BTF here, DWARF in [`crate::dwarf`]) that can say what shape a type has.

use std::fmt::Write as _;

/// The deepest declarator or nesting printed before writing `?` (hostile graphs can loop).
const MAX_DEPTH: usize = 32;

/// What a type looks like to a C declarator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape<Id> {
    /// `void`.
    Void,
    /// A name used as is: `int`, `u64`, `struct file`, `union {...}`.
    Named(String),
    /// Pointer to the target.
    Pointer(Id),
    /// Array of the element; `None` length prints `[]`.
    Array(Id, Option<u64>),
    /// `const`/`volatile`/`restrict` on the target.
    Qualified(&'static str, Id),
    /// A function type.
    Function {
        /// Return type.
        ret: Id,
        /// Parameter types.
        params: Vec<Id>,
        /// Whether a `...` follows the parameters.
        variadic: bool,
        /// Whether the prototype is known (`(void)` vs `()` when there are no parameters).
        prototyped: bool,
    },
    /// Something we cannot print.
    Unknown,
}

/// One member of a struct/union body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyMember<Id> {
    /// Name, empty when anonymous.
    pub name: String,
    /// Type.
    pub ty: Id,
    /// Offset in bits from the start of the aggregate.
    pub bit_offset: u64,
    /// Width of a bitfield.
    pub bit_size: Option<u64>,
}

/// The body of a struct, union or enum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body<Id> {
    /// A struct (`union: false`) or union.
    Aggregate {
        /// `true` for a union.
        union: bool,
        /// Name, empty when anonymous.
        name: String,
        /// Size in bytes.
        size: u64,
        /// Members in order.
        members: Vec<BodyMember<Id>>,
    },
    /// An enum.
    Enum {
        /// Name, empty when anonymous.
        name: String,
        /// Enumerators and values.
        values: Vec<(String, i128)>,
    },
}

/// A graph of C types.
pub trait TypeShapes {
    /// A type's handle.
    type Id: Copy;
    /// The declarator shape of `id`.
    fn shape(&self, id: Self::Id) -> Shape<Self::Id>;
    /// The body of `id` when it is a struct, union or enum (typedefs not followed).
    fn body(&self, id: Self::Id) -> Option<Body<Self::Id>>;
    /// Size in bytes.
    fn size_of(&self, id: Self::Id) -> Option<u64>;
}

/// `ty` declared with `name` in C (gdb's spelling): `struct inode *f_inode`,
/// `int (*open)(struct inode *, struct file *)`, `char comm[16]`; with an empty name the bare
/// type (`char [16]`).
pub fn declaration<G: TypeShapes>(g: &G, ty: G::Id, name: &str) -> String {
    declarator(g, ty, name.to_owned(), 0)
}

fn join(base: &str, inner: &str) -> String {
    if inner.is_empty() {
        base.to_owned()
    } else {
        format!("{base} {inner}")
    }
}

fn declarator<G: TypeShapes>(g: &G, ty: G::Id, inner: String, depth: usize) -> String {
    if depth > MAX_DEPTH {
        return join("?", &inner);
    }
    match g.shape(ty) {
        Shape::Void => join("void", &inner),
        Shape::Named(name) => join(&name, &inner),
        Shape::Unknown => join("?", &inner),
        Shape::Pointer(target) => {
            let wrapped = match g.shape(target) {
                Shape::Array(..) | Shape::Function { .. } => format!("(*{inner})"),
                _ => format!("*{inner}"),
            };
            declarator(g, target, wrapped, depth + 1)
        }
        Shape::Array(elem, len) => {
            let len = len.map(|n| n.to_string()).unwrap_or_default();
            declarator(g, elem, format!("{inner}[{len}]"), depth + 1)
        }
        Shape::Qualified(qual, target) => match g.shape(target) {
            // A qualified pointer: the qualifier sits after the star.
            Shape::Pointer(pointee) => {
                let inner = if inner.is_empty() {
                    format!("* {qual}")
                } else {
                    format!("* {qual} {inner}")
                };
                let wrapped = match g.shape(pointee) {
                    Shape::Array(..) | Shape::Function { .. } => format!("({inner})"),
                    _ => inner,
                };
                declarator(g, pointee, wrapped, depth + 1)
            }
            Shape::Named(_) | Shape::Void | Shape::Unknown => {
                let base = declarator(g, target, String::new(), depth + 1);
                join(&format!("{qual} {base}"), &inner)
            }
            // Qualified arrays/functions and stacked qualifiers: apply to what is inside.
            _ => {
                let base = declarator(g, target, inner, depth + 1);
                format!("{qual} {base}")
            }
        },
        Shape::Function {
            ret,
            params,
            variadic,
            prototyped,
        } => {
            let mut list: Vec<String> = params
                .iter()
                .map(|&p| declarator(g, p, String::new(), depth + 1))
                .collect();
            if variadic {
                list.push("...".into());
            }
            if list.is_empty() && prototyped {
                list.push("void".into());
            }
            declarator(g, ret, format!("{inner}({})", list.join(", ")), depth + 1)
        }
    }
}

/// The type printed as gdb's `ptype` does: the body of a struct/union/enum (anonymous
/// members expanded inline, named member types by name), or the declaration of anything else.
/// `offsets` adds gdb's `ptype /o` columns (`/* offset | size */`).
pub fn ptype<G: TypeShapes>(g: &G, ty: G::Id, offsets: bool) -> String {
    let mut out = String::new();
    match g.body(ty) {
        Some(body) => {
            let prefix = if offsets {
                "/* offset      |    size */  type = "
            } else {
                "type = "
            };
            out.push_str(prefix);
            write_body(g, &body, 0, offsets, 0, &mut out, 0);
            out.push('\n');
        }
        None => {
            let _ = writeln!(out, "type = {}", declaration(g, ty, ""));
        }
    }
    out
}

fn body_head(body: &Body<impl Copy>) -> String {
    let (keyword, name) = match body {
        Body::Aggregate {
            union: false, name, ..
        } => ("struct", name),
        Body::Aggregate {
            union: true, name, ..
        } => ("union", name),
        Body::Enum { name, .. } => ("enum", name),
    };
    if name.is_empty() {
        format!("{keyword} {{")
    } else {
        format!("{keyword} {name} {{")
    }
}

/// Writes `struct name {` ... `}` (no trailing name or newline). `indent` is the nesting
/// level of the body's closing brace; `base_bits` the body's offset in the outermost type.
fn write_body<G: TypeShapes>(
    g: &G,
    body: &Body<G::Id>,
    indent: usize,
    offsets: bool,
    base_bits: u64,
    out: &mut String,
    depth: usize,
) {
    out.push_str(&body_head(body));
    match body {
        Body::Enum { values, .. } => {
            let mut next = 0i128;
            let list: Vec<String> = values
                .iter()
                .map(|(name, value)| {
                    let text = if *value == next {
                        name.clone()
                    } else {
                        format!("{name} = {value}")
                    };
                    next = value.saturating_add(1);
                    text
                })
                .collect();
            out.pop();
            let _ = write!(out, "{{{}}}", list.join(", "));
        }
        Body::Aggregate { members, size, .. } => {
            out.push('\n');
            for m in members {
                write_member(g, m, indent + 1, offsets, base_bits, out, depth);
            }
            if offsets {
                let pad = " ".repeat(31 + 4 * indent);
                let _ = writeln!(out, "\n{pad}/* total size (bytes): {size:>4} */");
                out.push_str(&" ".repeat(29 + 4 * indent));
            } else {
                out.push_str(&"    ".repeat(indent));
            }
            out.push('}');
        }
    }
}

fn write_member<G: TypeShapes>(
    g: &G,
    m: &BodyMember<G::Id>,
    indent: usize,
    offsets: bool,
    base_bits: u64,
    out: &mut String,
    depth: usize,
) {
    let bits = base_bits.saturating_add(m.bit_offset);
    if offsets {
        let size = m
            .bit_size
            .map_or_else(|| g.size_of(m.ty).unwrap_or(0), |b| b);
        match m.bit_size {
            Some(_) => {
                let _ = write!(out, "/* {:>6}:{:>2}   |  {size:>6} */", bits / 8, bits % 8);
            }
            None => {
                let _ = write!(out, "/* {:>6}      |  {size:>6} */", bits / 8);
            }
        }
    }
    out.push_str(&"    ".repeat(indent));
    let inline = g.body(m.ty).filter(|b| match b {
        Body::Aggregate { name, .. } | Body::Enum { name, .. } => name.is_empty(),
    });
    match inline {
        Some(body) if depth < MAX_DEPTH => {
            write_body(g, &body, indent, offsets, bits, out, depth + 1);
            if !m.name.is_empty() {
                out.push(' ');
                out.push_str(&m.name);
            }
        }
        _ => out.push_str(&declaration(g, m.ty, &m.name)),
    }
    if let Some(width) = m.bit_size {
        let _ = write!(out, " : {width}");
    }
    out.push_str(";\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy graph: ids index a table.
    struct Toy(Vec<Shape<usize>>, Vec<Option<Body<usize>>>);

    impl TypeShapes for Toy {
        type Id = usize;
        fn shape(&self, id: usize) -> Shape<usize> {
            self.0.get(id).cloned().unwrap_or(Shape::Unknown)
        }
        fn body(&self, id: usize) -> Option<Body<usize>> {
            self.1.get(id).cloned().flatten()
        }
        fn size_of(&self, _id: usize) -> Option<u64> {
            Some(4)
        }
    }

    fn toy() -> Toy {
        let shapes = vec![
            Shape::Named("int".into()),   // 0
            Shape::Pointer(0),            // 1 int *
            Shape::Qualified("const", 0), // 2 const int
            Shape::Pointer(2),            // 3 const int *
            Shape::Qualified("const", 1), // 4 int * const
            Shape::Array(0, Some(16)),    // 5 int [16]
            Shape::Function {
                ret: 0,
                params: vec![1, 3],
                variadic: false,
                prototyped: true,
            }, // 6
            Shape::Pointer(6),            // 7 int (*)(int *, const int *)
            Shape::Pointer(5),            // 8 int (*)[16]
            Shape::Function {
                ret: 0,
                params: vec![],
                variadic: false,
                prototyped: true,
            }, // 9
            Shape::Pointer(9),            // 10
            Shape::Pointer(10),           // 11 pointer loop guard test not needed
        ];
        Toy(shapes, vec![])
    }

    #[test]
    fn declaration_places_stars_arrays_and_qualifiers_like_gdb() {
        let g = toy();
        assert_eq!(declaration(&g, 1, "p"), "int *p");
        assert_eq!(declaration(&g, 3, "p"), "const int *p");
        assert_eq!(declaration(&g, 4, "p"), "int * const p");
        assert_eq!(declaration(&g, 5, "a"), "int a[16]");
        assert_eq!(declaration(&g, 5, ""), "int [16]");
        assert_eq!(declaration(&g, 7, "fn"), "int (*fn)(int *, const int *)");
        assert_eq!(declaration(&g, 8, "pa"), "int (*pa)[16]");
        assert_eq!(declaration(&g, 10, "f"), "int (*f)(void)");
        assert_eq!(declaration(&g, 11, "f"), "int (**f)(void)");
    }

    #[test]
    fn declaration_of_a_self_referencing_pointer_stops() {
        let g = Toy(vec![Shape::Pointer(0)], vec![]);
        assert!(declaration(&g, 0, "p").starts_with('?'));
    }

    #[test]
    fn ptype_expands_anonymous_members_and_prints_bitfields() {
        let shapes = vec![
            Shape::Named("int".into()),
            Shape::Named("struct s".into()),
            Shape::Named("union {...}".into()),
        ];
        let inner = Body::Aggregate {
            union: true,
            name: String::new(),
            size: 4,
            members: vec![BodyMember {
                name: "a".into(),
                ty: 0,
                bit_offset: 0,
                bit_size: None,
            }],
        };
        let outer = Body::Aggregate {
            union: false,
            name: "s".into(),
            size: 8,
            members: vec![
                BodyMember {
                    name: String::new(),
                    ty: 2,
                    bit_offset: 0,
                    bit_size: None,
                },
                BodyMember {
                    name: "b".into(),
                    ty: 0,
                    bit_offset: 32,
                    bit_size: Some(3),
                },
            ],
        };
        let g = Toy(shapes, vec![None, Some(outer), Some(inner)]);

        let text = ptype(&g, 1, false);

        assert_eq!(
            text,
            "type = struct s {\n    union {\n        int a;\n    };\n    int b : 3;\n}\n"
        );
    }

    #[test]
    fn ptype_of_an_enum_prints_values_that_break_the_sequence() {
        let body = Body::Enum {
            name: "e".into(),
            values: vec![("A".into(), 0), ("B".into(), 1), ("C".into(), 8)],
        };
        let g = Toy(vec![Shape::Named("enum e".into())], vec![Some(body)]);

        assert_eq!(ptype(&g, 0, false), "type = enum e {A, B, C = 8}\n");
    }
}
