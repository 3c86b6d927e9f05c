//! SystemTap's pretty-printed target variables: `$var$`, `$var$$`, `$$parms$`, `$$return$`,
//! laid out from the guest kernel's BTF and read from guest memory on the host.
//!
//! As SystemTap prints them: a pointer to a struct or union is followed once and the
//! aggregate printed as `{.member=value, ...}`; integers and enums in decimal, pointers as
//! `0x...`, `char` arrays as quoted strings. With one `$` nested structs and arrays show as
//! `{...}` and `[...]`; with `$$` they are expanded too (pointers inside are never followed).
//! Guest memory is untrusted: every read is bounded, a member that cannot be read prints
//! `?`, and the text stops at [`MAX_TEXT`] bytes and [`MAX_DEPTH`] levels.

use std::fmt::Write as _;

use exotap_introspect::btf::{Btf, Kind, TypeId};

/// Longest text made (SystemTap cuts at MAXSTRINGLEN anyway).
pub const MAX_TEXT: usize = 4096;
/// Deepest nesting expanded by `$$`.
pub const MAX_DEPTH: usize = 8;
/// Most elements of an array expanded by `$$`.
const MAX_ELEMENTS: u32 = 64;

/// Reads `len` bytes of guest memory at an address.
pub type Read<'a> = &'a dyn Fn(u64, usize) -> Option<Vec<u8>>;

/// `value` (a register or variable of type `ty`) pretty-printed: a pointer to an aggregate
/// is followed and the aggregate printed; anything else as its value.
#[must_use]
pub fn pretty(btf: &Btf, ty: TypeId, value: u64, deep: bool, read: Read<'_>) -> String {
    let mut out = String::new();
    let ty = strip(btf, ty);
    match btf.get(ty).map(|t| &t.kind) {
        Some(Kind::Ptr(to)) => {
            let to = strip(btf, *to);
            if value != 0 && is_aggregate(btf, to) {
                aggregate(btf, to, value, deep, 0, read, &mut out);
            } else {
                let _ = write!(out, "{value:#x}");
            }
        }
        Some(Kind::Int { size, encoding, .. }) => {
            let _ = write!(out, "{}", int(value, *size, encoding.signed));
        }
        Some(Kind::Enum { size, signed, .. }) => {
            let _ = write!(out, "{}", int(value, *size, *signed));
        }
        _ => {
            let _ = write!(out, "{value:#x}");
        }
    }
    out
}

/// `ty` without typedefs and qualifiers.
fn strip(btf: &Btf, ty: TypeId) -> TypeId {
    btf.resolve(ty).unwrap_or(ty)
}

fn is_aggregate(btf: &Btf, ty: TypeId) -> bool {
    matches!(
        btf.get(ty).map(|t| &t.kind),
        Some(Kind::Struct { .. } | Kind::Union { .. })
    )
}

/// The low `size` bytes of `raw`, sign-extended when `signed`.
fn int(raw: u64, size: u32, signed: bool) -> i128 {
    let bits = size.clamp(1, 8) * 8;
    let masked = if bits == 64 {
        raw
    } else {
        raw & ((1u64 << bits) - 1)
    };
    if signed && bits < 64 && masked >> (bits - 1) & 1 == 1 {
        i128::from(masked) - (1i128 << bits)
    } else if signed && bits == 64 {
        i128::from(masked as i64)
    } else {
        i128::from(masked)
    }
}

fn full(out: &str) -> bool {
    out.len() >= MAX_TEXT
}

/// The aggregate `ty` at `addr` as `{.m=v, ...}`.
fn aggregate(
    btf: &Btf,
    ty: TypeId,
    addr: u64,
    deep: bool,
    depth: usize,
    read: Read<'_>,
    out: &mut String,
) {
    let members = match btf.get(ty).map(|t| &t.kind) {
        Some(Kind::Struct { members, .. } | Kind::Union { members, .. }) => members,
        _ => {
            out.push('?');
            return;
        }
    };
    out.push('{');
    for (i, m) in members.iter().enumerate() {
        if full(out) {
            break;
        }
        if i > 0 {
            out.push_str(", ");
        }
        let name = btf.str_at(m.name);
        if !name.is_empty() {
            let _ = write!(out, ".{name}=");
        }
        let at = addr.wrapping_add(u64::from(m.bit_offset / 8));
        match m.bitfield_size {
            Some(width) => bitfield(btf, m.ty, at, m.bit_offset % 8, width, read, out),
            None => member(btf, m.ty, at, deep, depth + 1, read, out),
        }
    }
    out.push('}');
}

/// A bitfield `width` bits wide, `shift` bits into the byte at `at`.
fn bitfield(
    btf: &Btf,
    ty: TypeId,
    at: u64,
    shift: u32,
    width: u8,
    read: Read<'_>,
    out: &mut String,
) {
    let bytes = (shift + u32::from(width)).div_ceil(8) as usize;
    let Some(raw) = read(at, bytes.min(8)) else {
        out.push('?');
        return;
    };
    let mut v = 0u64;
    for (i, b) in raw.iter().enumerate() {
        v |= u64::from(*b) << (8 * i);
    }
    let v = (v >> shift) & ((1u64 << width.min(63)) - 1);
    let signed = matches!(
        btf.get(strip(btf, ty)).map(|t| &t.kind),
        Some(Kind::Int { encoding, .. }) if encoding.signed
    );
    if signed && width > 0 && width < 64 && v >> (width - 1) & 1 == 1 {
        let _ = write!(out, "{}", i128::from(v) - (1i128 << width));
    } else {
        let _ = write!(out, "{v}");
    }
}

/// The member of type `ty` stored at `at`.
fn member(
    btf: &Btf,
    ty: TypeId,
    at: u64,
    deep: bool,
    depth: usize,
    read: Read<'_>,
    out: &mut String,
) {
    let ty = strip(btf, ty);
    let Some(kind) = btf.get(ty).map(|t| &t.kind) else {
        out.push('?');
        return;
    };
    let scalar = |size: u32| -> Option<u64> {
        let raw = read(at, size.clamp(1, 8) as usize)?;
        let mut v = 0u64;
        for (i, b) in raw.iter().enumerate() {
            v |= u64::from(*b) << (8 * i);
        }
        Some(v)
    };
    match kind {
        Kind::Int { size, encoding, .. } => match scalar(*size) {
            Some(v) => {
                let _ = write!(out, "{}", int(v, *size, encoding.signed));
            }
            None => out.push('?'),
        },
        Kind::Enum { size, signed, .. } => match scalar(*size) {
            Some(v) => {
                let _ = write!(out, "{}", int(v, *size, *signed));
            }
            None => out.push('?'),
        },
        Kind::Ptr(_) => match scalar(8) {
            Some(v) => {
                let _ = write!(out, "{v:#x}");
            }
            None => out.push('?'),
        },
        Kind::Struct { .. } | Kind::Union { .. } => {
            if deep && depth < MAX_DEPTH {
                aggregate(btf, ty, at, deep, depth, read, out);
            } else {
                out.push_str("{...}");
            }
        }
        Kind::Array { elem, len, .. } => {
            let elem = strip(btf, *elem);
            let is_char = matches!(
                btf.get(elem).map(|t| &t.kind),
                Some(Kind::Int { size: 1, encoding, .. }) if encoding.char || encoding.signed
            ) && btf.name(elem).contains("char");
            if is_char {
                let n = (*len).min(MAX_TEXT as u32) as usize;
                match read(at, n) {
                    Some(bytes) => {
                        let s = bytes.split(|b| *b == 0).next().unwrap_or(&bytes);
                        let _ = write!(out, "{:?}", String::from_utf8_lossy(s));
                    }
                    None => out.push('?'),
                }
            } else if deep && depth < MAX_DEPTH {
                let size = btf.size_of(elem).unwrap_or(0);
                out.push('[');
                for i in 0..(*len).min(MAX_ELEMENTS) {
                    if full(out) || size == 0 {
                        break;
                    }
                    if i > 0 {
                        out.push_str(", ");
                    }
                    let at = at.wrapping_add(u64::from(i) * size);
                    member(btf, elem, at, deep, depth + 1, read, out);
                }
                if *len > MAX_ELEMENTS {
                    out.push_str(", ...");
                }
                out.push(']');
            } else {
                out.push_str("[...]");
            }
        }
        _ => out.push('?'),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_keep_their_size_and_sign() {
        assert_eq!(int(0xffff_ffff, 4, true), -1);
        assert_eq!(int(0xffff_ffff, 4, false), 4_294_967_295);
        assert_eq!(int(0x1_0000_0005, 4, false), 5);
        assert_eq!(int(u64::MAX, 8, true), -1);
        assert_eq!(int(u64::MAX, 8, false), i128::from(u64::MAX));
        assert_eq!(int(0x80, 1, true), -128);
    }

    /// A `struct file` laid out in fake guest memory at the offsets BTF gives its members
    /// (the cached Debian kernel's BTF), printed one level and fully.
    #[test]
    fn a_struct_file_prints_its_members_from_btf() {
        // A cached kernel that does not load panics there: a failure, not a skip.
        let Some(image) = crate::live::kernel_image::cached_debian_image() else {
            eprintln!("SKIP: no cached kernel (exotap image fetch)");
            return;
        };
        let btf = Btf::from_elf(image.vmlinux.bytes()).unwrap();
        let file = btf.struct_by_name("file").unwrap();
        let size = usize::try_from(btf.size_of(file).unwrap()).unwrap();
        let off =
            |m: &str| usize::try_from(btf.member(file, m).unwrap().byte_offset().unwrap()).unwrap();
        let base = 0xffff_8880_0100_0000u64;
        let mut mem = vec![0u8; size];
        mem[off("f_flags")..off("f_flags") + 4].copy_from_slice(&0x8000u32.to_le_bytes());
        mem[off("f_pos")..off("f_pos") + 8].copy_from_slice(&(-5i64).to_le_bytes());
        mem[off("f_inode")..off("f_inode") + 8]
            .copy_from_slice(&0xffff_8880_0200_0040u64.to_le_bytes());
        let read = |at: u64, len: usize| -> Option<Vec<u8>> {
            let start = usize::try_from(at.checked_sub(base)?).ok()?;
            mem.get(start..start.checked_add(len)?).map(<[u8]>::to_vec)
        };
        // `$file$`: the parameter's type is `struct file *`.
        let ptr = btf
            .func_signature("vfs_read")
            .unwrap()
            .params
            .iter()
            .find(|p| p.0 == "file")
            .unwrap()
            .1;
        let shallow = pretty(&btf, ptr, base, false, &read);
        assert!(
            shallow.starts_with('{') && shallow.ends_with('}'),
            "{shallow}"
        );
        assert!(shallow.contains(".f_flags=32768"), "{shallow}");
        assert!(shallow.contains(".f_pos=-5"), "{shallow}");
        assert!(shallow.contains(".f_inode=0xffff888002000040"), "{shallow}");
        assert!(shallow.contains(".f_path={...}"), "{shallow}");
        let full = pretty(&btf, ptr, base, true, &read);
        assert!(full.contains(".f_path={.mnt=0x0, .dentry=0x0}"), "{full}");
        // Past the fake memory (a bad pointer): the members print `?`, nothing panics.
        let bad = pretty(&btf, ptr, base + 0x10_0000, false, &read);
        assert!(bad.contains(".f_flags=?"), "{bad}");
        // A NULL pointer and a plain integer print as values.
        assert_eq!(pretty(&btf, ptr, 0, false, &read), "0x0");
        let count = btf.func_signature("vfs_read").unwrap().params[2].1;
        assert_eq!(pretty(&btf, count, 64, false, &read), "64");
    }
}
