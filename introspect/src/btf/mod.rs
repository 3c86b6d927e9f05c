//! BTF (BPF Type Format): the compact type information the kernel carries in its own image
//! (`.BTF` section of vmlinux), used when no `-dbg` DWARF is at hand.
//!
//! [`Btf::parse`] reads a raw blob (header, type section, string section) with every kind of
//! Linux 6.1, checking every offset, length and type reference, so that the lookups in
//! [`query`] never index out of bounds: a hostile blob gives a [`BtfError`], never a panic.

pub mod cdecl;
pub mod query;
mod shapes;

use object::{Object, ObjectSection};

pub use query::{LookupError, MemberLocation};

/// BTF type id; 0 is `void`.
pub type TypeId = u32;

const MAGIC: u16 = 0xeb9f;
const HEADER_LEN: usize = 24;

/// Errors of parsing a BTF blob.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    /// The blob is shorter than its header says.
    #[error("BTF blob is truncated: {what} needs bytes up to {end}, the blob has {len}")]
    Truncated {
        /// Which part.
        what: &'static str,
        /// Where that part would end.
        end: u64,
        /// Bytes present.
        len: usize,
    },
    /// Not a BTF blob.
    #[error("not BTF: magic is {0:#06x}")]
    BadMagic(u16),
    /// A version we do not read.
    #[error("BTF version {0} is not supported (only 1)")]
    BadVersion(u8),
    /// A type record has a kind this reader does not know.
    #[error("type {id} has unknown kind {kind}")]
    UnknownKind {
        /// The type id.
        id: TypeId,
        /// The kind number.
        kind: u32,
    },
    /// A type points at a string that is not in the string section.
    #[error("type {id} names string offset {offset}, which is not a string of the section")]
    BadString {
        /// The type id.
        id: TypeId,
        /// The offset.
        offset: u32,
    },
    /// A type refers to a type id that does not exist.
    #[error("type {id} refers to type {target}, but there are only {count} types")]
    BadReference {
        /// The referring type.
        id: TypeId,
        /// The missing target.
        target: TypeId,
        /// Number of types (ids 1..=count).
        count: u32,
    },
    /// The ELF file could not be read.
    #[error("cannot read the ELF file")]
    Elf(#[source] object::Error),
    /// The ELF file has no `.BTF` section.
    #[error("the ELF file has no .BTF section")]
    NoBtfSection,
}

/// How an integer is interpreted (`BTF_INT_ENCODING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IntEncoding {
    /// Signed.
    pub signed: bool,
    /// A character type.
    pub char: bool,
    /// `_Bool`.
    pub bool: bool,
}

/// A member of a struct or union.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// String offset of the name (0: anonymous).
    pub name: u32,
    /// The member's type.
    pub ty: TypeId,
    /// Offset from the start of the aggregate, in bits.
    pub bit_offset: u32,
    /// Width of a bitfield in bits; `None` for an ordinary member.
    pub bitfield_size: Option<u8>,
}

/// One enumerator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enumerator {
    /// String offset of the name.
    pub name: u32,
    /// The value (ENUM64 values are kept whole).
    pub value: i128,
}

/// A function prototype parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// String offset of the name (0: unnamed).
    pub name: u32,
    /// The type; 0 in the last parameter means `...`.
    pub ty: TypeId,
}

/// A variable placed in a data section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecVar {
    /// The `VAR` type.
    pub ty: TypeId,
    /// Offset in the section.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
}

/// What a type is. Names live in [`Type::name`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// `void` (type id 0 only).
    Void,
    /// An integer.
    Int {
        /// Storage size in bytes.
        size: u32,
        /// Signedness and character/bool flags.
        encoding: IntEncoding,
        /// Bit offset of the value inside its storage.
        bit_offset: u8,
        /// Number of value bits.
        bits: u8,
    },
    /// Pointer to `target`.
    Ptr(TypeId),
    /// An array.
    Array {
        /// Element type.
        elem: TypeId,
        /// Index type.
        index: TypeId,
        /// Number of elements.
        len: u32,
    },
    /// A struct.
    Struct {
        /// Size in bytes.
        size: u32,
        /// Members in declaration order.
        members: Vec<Member>,
    },
    /// A union.
    Union {
        /// Size in bytes.
        size: u32,
        /// Members in declaration order.
        members: Vec<Member>,
    },
    /// An enum (ENUM or ENUM64).
    Enum {
        /// Size in bytes.
        size: u32,
        /// Whether the values are signed.
        signed: bool,
        /// The enumerators.
        values: Vec<Enumerator>,
    },
    /// A forward declaration.
    Fwd {
        /// `union` rather than `struct`.
        union: bool,
    },
    /// A typedef of `target`.
    Typedef(TypeId),
    /// `volatile target`.
    Volatile(TypeId),
    /// `const target`.
    Const(TypeId),
    /// `restrict target`.
    Restrict(TypeId),
    /// A function (name + prototype).
    Func {
        /// The `FUNC_PROTO`.
        proto: TypeId,
        /// 0 static, 1 global, 2 extern.
        linkage: u16,
    },
    /// A function prototype.
    FuncProto {
        /// Return type (0: void).
        ret: TypeId,
        /// Parameters.
        params: Vec<Param>,
    },
    /// A variable.
    Var {
        /// Its type.
        ty: TypeId,
        /// 0 static, 1 global.
        linkage: u32,
    },
    /// A data section with its variables.
    Datasec {
        /// Size in bytes.
        size: u32,
        /// The variables.
        vars: Vec<SecVar>,
    },
    /// A floating-point type.
    Float {
        /// Size in bytes.
        size: u32,
    },
    /// A declaration tag on `target` (or one of its members/params).
    DeclTag {
        /// The tagged type.
        target: TypeId,
        /// -1 for the type itself, else the member/parameter index.
        component: i32,
    },
    /// A type tag on `target`.
    TypeTag(TypeId),
}

/// One type: its name and kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Type {
    /// String offset of the name (0: anonymous).
    pub name: u32,
    /// What it is.
    pub kind: Kind,
}

/// A parsed BTF blob. Every string offset and type id stored in it has been checked.
#[derive(Debug, Clone)]
pub struct Btf {
    /// Index = type id; `types[0]` is `void`.
    types: Vec<Type>,
    strings: Vec<u8>,
}

/// Little/big endian reader over a bounds-checked slice.
#[derive(Clone, Copy)]
struct Reader<'a> {
    bytes: &'a [u8],
    big_endian: bool,
}

impl Reader<'_> {
    fn u32_at(&self, at: usize) -> Option<u32> {
        let raw: [u8; 4] = self.bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(if self.big_endian {
            u32::from_be_bytes(raw)
        } else {
            u32::from_le_bytes(raw)
        })
    }
}

fn truncated(what: &'static str, end: u64, len: usize) -> BtfError {
    BtfError::Truncated { what, end, len }
}

impl Btf {
    /// Parses a raw BTF blob (what the `.BTF` section or `/sys/kernel/btf/vmlinux` holds).
    ///
    /// # Errors
    /// [`BtfError`] when the header, a section or a type record is malformed or refers to a
    /// string or type that does not exist.
    pub fn parse(blob: &[u8]) -> Result<Btf, BtfError> {
        Self::parse_on(blob, None)
    }

    /// Parses a split BTF blob (a kernel module's `.BTF`, whose type ids and string offsets
    /// continue those of `base`, the vmlinux's) into one BTF holding `base`'s types and the
    /// module's: a module's own types (`struct evdev`) and the kernel's they refer to.
    ///
    /// # Errors
    /// As [`Btf::parse`]; a reference past the combined types or strings is one.
    pub fn parse_split(blob: &[u8], base: &Btf) -> Result<Btf, BtfError> {
        Self::parse_on(blob, Some(base))
    }

    /// [`Btf::parse_split`] of the `.BTF` section of an ELF file (a module's `.ko`).
    ///
    /// # Errors
    /// As [`Btf::from_elf`] and [`Btf::parse_split`].
    pub fn from_elf_split(elf: &[u8], base: &Btf) -> Result<Btf, BtfError> {
        let file = object::File::parse(elf).map_err(BtfError::Elf)?;
        let section = file.section_by_name(".BTF").ok_or(BtfError::NoBtfSection)?;
        let data = section.data().map_err(BtfError::Elf)?;
        Btf::parse_split(data, base)
    }

    fn parse_on(blob: &[u8], base: Option<&Btf>) -> Result<Btf, BtfError> {
        let magic_le = blob.get(..2).map(|m| u16::from_le_bytes([m[0], m[1]]));
        let big_endian = match magic_le {
            Some(MAGIC) => false,
            Some(m) if m.swap_bytes() == MAGIC => true,
            Some(m) => return Err(BtfError::BadMagic(m)),
            None => return Err(truncated("the magic", 2, blob.len())),
        };
        let r = Reader {
            bytes: blob,
            big_endian,
        };
        let field = |at: usize| {
            r.u32_at(at)
                .ok_or(truncated("the header", HEADER_LEN as u64, blob.len()))
        };
        let version = blob.get(2).copied().unwrap_or(0);
        if version != 1 {
            return Err(BtfError::BadVersion(version));
        }
        let hdr_len = u64::from(field(4)?);
        let section = |off_at: usize, what: &'static str| -> Result<&[u8], BtfError> {
            let start = hdr_len + u64::from(field(off_at)?);
            let end = start + u64::from(field(off_at + 4)?);
            let range = usize::try_from(start).ok().zip(usize::try_from(end).ok());
            range
                .and_then(|(s, e)| blob.get(s..e))
                .ok_or(truncated(what, end, blob.len()))
        };
        let type_section = section(8, "the type section")?;
        let own = section(16, "the string section")?;
        let reader = Reader {
            bytes: type_section,
            big_endian,
        };
        let (types, strings) = match base {
            None => (types::parse_all(reader)?, own.to_vec()),
            Some(base) => {
                let mut strings = Vec::with_capacity(base.strings.len() + own.len());
                strings.extend_from_slice(&base.strings);
                strings.extend_from_slice(own);
                (types::parse_after(reader, base.types.clone())?, strings)
            }
        };
        let btf = Btf { types, strings };
        btf.validate()?;
        Ok(btf)
    }

    /// Parses the `.BTF` section of an ELF file (e.g. the vmlinux inside a bzImage).
    ///
    /// # Errors
    /// [`BtfError::Elf`] when the ELF is malformed, [`BtfError::NoBtfSection`] without `.BTF`,
    /// and whatever [`Btf::parse`] finds wrong in the section.
    pub fn from_elf(elf: &[u8]) -> Result<Btf, BtfError> {
        let file = object::File::parse(elf).map_err(BtfError::Elf)?;
        let section = file.section_by_name(".BTF").ok_or(BtfError::NoBtfSection)?;
        let data = section.data().map_err(BtfError::Elf)?;
        Btf::parse(data)
    }

    /// Number of types, `void` included (ids are `0..len()`).
    pub fn len(&self) -> usize {
        self.types.len()
    }

    /// Whether there is nothing but `void`.
    pub fn is_empty(&self) -> bool {
        self.types.len() <= 1
    }

    /// The type with id `id`.
    pub fn get(&self, id: TypeId) -> Option<&Type> {
        self.types.get(usize::try_from(id).ok()?)
    }

    /// All types with their ids, `void` first.
    pub fn iter(&self) -> impl Iterator<Item = (TypeId, &Type)> {
        (0..).zip(self.types.iter())
    }

    /// The string at `offset` of the string section; `""` for offsets that [`Btf::parse`]
    /// did not check (only checked offsets are stored in types).
    pub fn str_at(&self, offset: u32) -> &str {
        self.try_str_at(offset).unwrap_or("")
    }

    /// The name of type `id` (`""` when anonymous or absent).
    pub fn name(&self, id: TypeId) -> &str {
        self.get(id).map_or("", |t| self.str_at(t.name))
    }

    fn try_str_at(&self, offset: u32) -> Option<&str> {
        let tail = self.strings.get(usize::try_from(offset).ok()?..)?;
        let end = tail.iter().position(|&b| b == 0)?;
        std::str::from_utf8(&tail[..end]).ok()
    }

    fn validate(&self) -> Result<(), BtfError> {
        let count = u32::try_from(self.types.len().saturating_sub(1)).unwrap_or(u32::MAX);
        for (id, ty) in self.iter() {
            let check_str = |offset: u32| match self.try_str_at(offset) {
                Some(_) => Ok(()),
                None => Err(BtfError::BadString { id, offset }),
            };
            let check_ty = |target: TypeId| {
                if target <= count {
                    Ok(())
                } else {
                    Err(BtfError::BadReference { id, target, count })
                }
            };
            check_str(ty.name)?;
            for target in types::references(&ty.kind) {
                check_ty(target)?;
            }
            for name in types::inner_names(&ty.kind) {
                check_str(name)?;
            }
        }
        Ok(())
    }
}

mod types;

#[cfg(test)]
mod tests;
