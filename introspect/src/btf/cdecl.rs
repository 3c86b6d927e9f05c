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
        /// Only declared (gdb's `<incomplete type>`).
        incomplete: bool,
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
    /// What a typedef names (`None` for anything else).
    fn typedef_target(&self, id: Self::Id) -> Option<Self::Id>;
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
        Shape::Qualified(first, target) => {
            // gdb prints stacked qualifiers together, in a fixed order.
            let mut quals = vec![first];
            let mut target = target;
            let mut shape = g.shape(target);
            while let Shape::Qualified(q, t) = shape {
                if quals.len() > MAX_DEPTH {
                    return join("?", &inner);
                }
                quals.push(q);
                target = t;
                shape = g.shape(t);
            }
            let quals: Vec<&str> = ["const", "volatile", "restrict", "_Atomic"]
                .into_iter()
                .filter(|q| quals.contains(q))
                .collect();
            let quals = quals.join(" ");
            match shape {
                // A qualified pointer: the qualifiers sit after the star.
                Shape::Pointer(pointee) => {
                    let inner = if inner.is_empty() {
                        format!("* {quals}")
                    } else {
                        format!("* {quals} {inner}")
                    };
                    let wrapped = match g.shape(pointee) {
                        Shape::Array(..) | Shape::Function { .. } => format!("({inner})"),
                        _ => inner,
                    };
                    declarator(g, pointee, wrapped, depth + 1)
                }
                Shape::Named(_) | Shape::Void | Shape::Unknown => {
                    let base = declarator(g, target, String::new(), depth + 1);
                    join(&format!("{quals} {base}"), &inner)
                }
                // Qualified arrays and functions: the qualifiers go in front.
                _ => {
                    let base = declarator(g, target, inner, depth + 1);
                    format!("{quals} {base}")
                }
            }
        }
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

/// gdb's spelling of GCC's base type names (`long unsigned int` → `unsigned long`).
pub fn gdb_base_name(name: &str) -> &str {
    match name {
        "short int" => "short",
        "short unsigned int" => "unsigned short",
        "long int" => "long",
        "long unsigned int" => "unsigned long",
        "long long int" => "long long",
        "long long unsigned int" => "unsigned long long",
        other => other,
    }
}

/// The type printed as gdb's `ptype` does: the body of a struct/union/enum (anonymous
/// members expanded inline, named member types by name), or the declaration of anything else.
/// `offsets` prints gdb's `ptype /o` instead: offset and size columns, holes and padding,
/// and struct/union members expanded.
pub fn ptype<G: TypeShapes>(g: &G, ty: G::Id, offsets: bool) -> String {
    let mut out = String::new();
    // Like gdb, look through typedefs at the top: `ptype pid_t` is `int`.
    let mut ty = ty;
    for _ in 0..MAX_DEPTH {
        match g.typedef_target(ty) {
            Some(target) => ty = target,
            None => break,
        }
    }
    match g.body(ty) {
        Some(body) => {
            let podata = offsets.then_some(Podata {
                offset_bits: 0,
                end_bits: 0,
            });
            if offsets {
                out.push_str("/* offset      |    size */  ");
            }
            out.push_str("type = ");
            write_body(g, &body, 0, podata, &mut out, 0);
            out.push('\n');
        }
        None => {
            let _ = writeln!(out, "type = {}", declaration(g, ty, ""));
        }
    }
    out
}

/// Width of gdb's `/* offset | size */` column.
const OFFSET_COLUMN: usize = 27;

/// gdb's `print_offset_data`: where the aggregate being printed starts in the outermost one,
/// and where (relative to the aggregate) the previous member ended.
#[derive(Debug, Clone, Copy)]
struct Podata {
    offset_bits: u64,
    end_bits: u64,
}

fn hole(out: &mut String, end_bits: u64, bitpos: u64, what: &str) {
    if end_bits > 0 && end_bits < bitpos {
        let hole = bitpos - end_bits;
        if !hole.is_multiple_of(8) {
            let _ = writeln!(out, "/* XXX {:>2}-bit {what:<7}    */", hole % 8);
        }
        if hole / 8 > 0 {
            let _ = writeln!(out, "/* XXX {:>2}-byte {what:<7}   */", hole / 8);
        }
    }
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

/// Writes `struct name {` ... `}` (no trailing name or newline); members are indented by
/// `level + 4` spaces, as gdb's `c_type_print_base_struct_union` does.
fn write_body<G: TypeShapes>(
    g: &G,
    body: &Body<G::Id>,
    level: usize,
    mut podata: Option<Podata>,
    out: &mut String,
    depth: usize,
) {
    out.push_str(&body_head(body));
    let (union, size, members, incomplete) = match body {
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
            return;
        }
        Body::Aggregate {
            union,
            size,
            members,
            incomplete,
            ..
        } => (*union, *size, members, *incomplete),
    };
    out.push('\n');
    if members.is_empty() {
        let column = if podata.is_some() { OFFSET_COLUMN } else { 0 };
        let what = if incomplete {
            "<incomplete type>"
        } else {
            "<no data fields>"
        };
        let _ = writeln!(out, "{}{what}", " ".repeat(column + level + 4));
    }
    for m in members {
        let ty_size = g.size_of(m.ty).unwrap_or(0);
        let mut nested = None;
        if let Some(pd) = podata.as_mut() {
            if union {
                let _ = write!(out, "/*                {ty_size:>6} */");
            } else {
                hole(out, pd.end_bits, m.bit_offset, "hole");
                let real = m.bit_offset.saturating_add(pd.offset_bits);
                let field_bits = match m.bit_size {
                    Some(bits) => {
                        let _ = write!(out, "/* {:>6}:{:>2}  ", real / 8, real % 8);
                        bits
                    }
                    None if pd.offset_bits % 8 != 0 => {
                        let _ = write!(out, "/* {:>6}:{:>2}  ", real / 8, real % 8);
                        ty_size.saturating_mul(8)
                    }
                    None => {
                        let _ = write!(out, "/* {:>6}     ", real / 8);
                        ty_size.saturating_mul(8)
                    }
                };
                let _ = write!(out, " |  {ty_size:>6} */");
                pd.end_bits = m.bit_offset.saturating_add(field_bits);
            }
            nested = Some(Podata {
                offset_bits: pd.offset_bits.saturating_add(m.bit_offset),
                end_bits: pd.end_bits.saturating_sub(ty_size.saturating_mul(8)),
            });
        }
        out.push_str(&" ".repeat(level + 4));
        let expand = g.body(m.ty).filter(|b| match b {
            Body::Aggregate { name, .. } => podata.is_some() || name.is_empty(),
            Body::Enum { name, .. } => name.is_empty(),
        });
        match expand {
            Some(inner) if depth < MAX_DEPTH => {
                let inner_pd = if matches!(inner, Body::Aggregate { .. }) {
                    nested
                } else {
                    None
                };
                write_body(g, &inner, level + 4, inner_pd, out, depth + 1);
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
    if let Some(pd) = podata {
        hole(out, pd.end_bits, size.saturating_mul(8), "padding");
        let _ = writeln!(
            out,
            "\n{}/* total size (bytes): {size:>4} */",
            " ".repeat(OFFSET_COLUMN + level + 4)
        );
        out.push_str(&" ".repeat(OFFSET_COLUMN + if level == 0 { 2 } else { 0 }));
    }
    out.push_str(&" ".repeat(level));
    out.push('}');
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
        fn typedef_target(&self, _id: usize) -> Option<usize> {
            None
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
            incomplete: false,
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
            incomplete: false,
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
