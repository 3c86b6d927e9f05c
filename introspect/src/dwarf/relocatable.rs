//! The DWARF of a relocatable object (a kernel module's `.ko` from the `-dbg` package) made
//! readable as a linked file's: its allocated sections placed at addresses, and the
//! relocations of its other sections (`.rela.debug_info`, `.rela.debug_line`, ...) applied,
//! and of its code where they name its own symbols (its globals, for the join-point finder).
//!
//! In a `.ko` every address in the DWARF is zero plus a relocation against a section symbol:
//! unrelocated, every function starts at 0 and every name reads the first string of
//! `.debug_str`. The kernel's module loader places each allocated section somewhere in the
//! vmalloc area at load; [`place`] takes those addresses (the caller finds them in the live
//! guest) and lays out the sections it is not given one for after each other, so the same
//! file also serves with no guest at all (names, types, scopes; the addresses are then
//! made-up). The result is a copy of the file with section headers and symbols at their
//! addresses, which [`super::DebugInfo::new`] reads as it reads the vmlinux.
//!
//! Hand-written on `object`'s reader: neither `object` nor `gimli` applies relocations to a
//! copy of the file (gimli's `RelocateReader` would make every reader of this crate generic
//! over it), and a module needs two kinds (`R_X86_64_64`, `R_X86_64_32`; `R_AARCH64_ABS64`
//! and `ABS32` on arm64). The file is untrusted input: every offset is checked.

use object::{
    Object, ObjectSection, ObjectSymbol, RelocationFlags, RelocationTarget, SectionFlags,
    SectionIndex, SymbolSection,
};

use super::DwarfError;

/// Where sections are laid out when the caller gives no address: away from 0, which DWARF
/// uses for a discarded function.
const MADE_UP_BASE: u64 = 0x10_0000;

/// Where each allocated section of an object was placed: (section name, address).
pub type Placement = Vec<(String, u64)>;

/// A symbol of a relocatable object defined in one of its allocated sections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionSymbol {
    /// The symbol's name.
    pub name: String,
    /// The section it is in.
    pub section: String,
    /// Its offset in the section.
    pub offset: u64,
}

fn malformed(why: impl Into<String>) -> DwarfError {
    DwarfError::Relocatable(why.into())
}

/// The named symbols of `bytes` (an ELF relocatable object) in its allocated sections: what
/// a caller matches against the running module's symbols to learn where each section is.
///
/// # Errors
/// [`DwarfError::Elf`] when the file is malformed.
pub fn section_symbols(bytes: &[u8]) -> Result<Vec<SectionSymbol>, DwarfError> {
    let file = object::File::parse(bytes).map_err(DwarfError::Elf)?;
    let mut out = Vec::new();
    for sym in file.symbols() {
        let (Ok(name), SymbolSection::Section(index)) = (sym.name(), sym.section()) else {
            continue;
        };
        if name.is_empty() || sym.kind() == object::SymbolKind::Section {
            continue;
        }
        let Ok(section) = file.section_by_index(index) else {
            continue;
        };
        if !allocated(&section) {
            continue;
        }
        out.push(SectionSymbol {
            name: name.to_owned(),
            section: section.name().unwrap_or_default().to_owned(),
            offset: sym.address(),
        });
    }
    Ok(out)
}

fn allocated(section: &object::Section<'_, '_>) -> bool {
    match section.flags() {
        SectionFlags::Elf { sh_flags } => sh_flags & u64::from(object::elf::SHF_ALLOC) != 0,
        _ => false,
    }
}

fn executable(section: &object::Section<'_, '_>) -> bool {
    match section.flags() {
        SectionFlags::Elf { sh_flags } => {
            let want = u64::from(object::elf::SHF_ALLOC | object::elf::SHF_EXECINSTR);
            sh_flags & want == want
        }
        _ => false,
    }
}

/// Applies the relocations of code `section` (placed at `base`) whose symbol the object
/// defines: absolute (`R_X86_64_64`, `_32`, `_32S`) and PC-relative (`R_X86_64_PC32`,
/// `_PLT32`) ones. A reference to a symbol the object does not define (the kernel's: its
/// address is the running kernel's) and any other kind are left as the file has them: the
/// code is read, never run.
fn relocate_code(
    file: &object::File<'_>,
    section: &object::Section<'_, '_>,
    base: u64,
    base_of: &dyn Fn(SectionIndex) -> u64,
    out: &mut [u8],
) -> Result<(), DwarfError> {
    let Some((start, size)) = section.file_range() else {
        // SHT_NOBITS: no bytes to relocate.
        return Ok(());
    };
    for (offset, reloc) in section.relocations() {
        let RelocationTarget::Symbol(s) = reloc.target() else {
            continue;
        };
        let Ok(sym) = file.symbol_by_index(s) else {
            continue;
        };
        let SymbolSection::Section(index) = sym.section() else {
            continue;
        };
        let value = base_of(index)
            .wrapping_add(sym.address())
            .wrapping_add_signed(reloc.addend());
        let RelocationFlags::Elf { r_type } = reloc.flags() else {
            continue;
        };
        let bytes: Vec<u8> = match r_type {
            object::elf::R_X86_64_64 => value.to_le_bytes().to_vec(),
            object::elf::R_X86_64_32 | object::elf::R_X86_64_32S => {
                value.to_le_bytes()[..4].to_vec()
            }
            object::elf::R_X86_64_PC32 | object::elf::R_X86_64_PLT32 => {
                value.wrapping_sub(base.wrapping_add(offset)).to_le_bytes()[..4].to_vec()
            }
            _ => continue,
        };
        if offset.saturating_add(bytes.len() as u64) > size {
            return Err(malformed(format!(
                "a relocation at {offset:#x} past the end of {}",
                section.name().unwrap_or_default()
            )));
        }
        write(out, start + offset, &bytes)?;
    }
    Ok(())
}

/// `bytes` (an ELF64 little-endian relocatable object) with each allocated section at the
/// address `address(name)` gives it (the others after each other from a made-up base), its
/// symbols at their sections' addresses, and the relocations of its non-allocated sections
/// (the DWARF) and of its code's references to its own symbols applied. Returns the copy and
/// the address of each allocated section.
///
/// # Errors
/// [`DwarfError::Relocatable`] when the file is not an ELF64 little-endian relocatable object, is
/// malformed, has compressed sections to relocate, or a relocation of a kind this does not
/// apply.
pub fn place(
    bytes: &[u8],
    address: &dyn Fn(&str) -> Option<u64>,
) -> Result<(Vec<u8>, Placement), DwarfError> {
    let file = object::File::parse(bytes).map_err(DwarfError::Elf)?;
    if file.kind() != object::ObjectKind::Relocatable || !file.is_64() || !file.is_little_endian() {
        return Err(malformed(
            "not an ELF64 little-endian relocatable object (a kernel module)",
        ));
    }
    let shoff = read_u64(bytes, 0x28)?;
    let shentsize = u64::from(read_u16(bytes, 0x3a)?);
    if shentsize < 64 {
        return Err(malformed("section headers smaller than ELF64's"));
    }
    // Section addresses: given, or laid out.
    let mut bases: Vec<Option<u64>> = Vec::new();
    let mut placed = Vec::new();
    let mut next = MADE_UP_BASE;
    for section in file.sections() {
        let i = section.index().0;
        if bases.len() <= i {
            bases.resize(i + 1, None);
        }
        if !allocated(&section) {
            continue;
        }
        let name = section.name().unwrap_or_default();
        let base = match address(name) {
            Some(a) => a,
            None => {
                let align = section.align().max(1);
                let at = next.checked_next_multiple_of(align).unwrap_or(next);
                next = at.saturating_add(section.size()).saturating_add(0x1000);
                at
            }
        };
        bases[i] = Some(base);
        placed.push((name.to_owned(), base));
    }
    let base_of = |index: SectionIndex| bases.get(index.0).copied().flatten().unwrap_or(0);
    let mut out = bytes.to_vec();
    // Section headers' sh_addr (offset 16 of an Elf64_Shdr).
    for (i, base) in bases.iter().enumerate() {
        if let Some(base) = base {
            let at = shoff
                .checked_add((i as u64).saturating_mul(shentsize))
                .and_then(|o| o.checked_add(16))
                .ok_or_else(|| malformed("section header offset overflows"))?;
            write(&mut out, at, &base.to_le_bytes())?;
        }
    }
    // Symbols' st_value (offset 8 of an Elf64_Sym; st_shndx at 6).
    if let Some(symtab) = file.section_by_name(".symtab") {
        if let Some((start, size)) = symtab.file_range() {
            let mut at = start;
            while at.saturating_add(24) <= start.saturating_add(size) {
                let shndx = read_u16(bytes, at + 6)?;
                if let Some(Some(base)) = bases.get(usize::from(shndx)) {
                    let value = read_u64(bytes, at + 8)?;
                    write(&mut out, at + 8, &value.wrapping_add(*base).to_le_bytes())?;
                }
                at += 24;
            }
        }
    }
    // The code's references to the module's own data (`mov kvm_x86_ops+0x2e0(%rip)`): what
    // the join-point finder reads global addresses from.
    for section in file.sections() {
        if executable(&section) {
            relocate_code(
                &file,
                &section,
                base_of(section.index()),
                &base_of,
                &mut out,
            )?;
        }
    }
    // The relocations of the non-allocated sections.
    for section in file.sections() {
        if allocated(&section) {
            continue;
        }
        let mut relocations = section.relocations().peekable();
        if relocations.peek().is_none() {
            continue;
        }
        let name = section.name().unwrap_or_default().to_owned();
        if matches!(section.flags(), SectionFlags::Elf { sh_flags } if sh_flags & u64::from(object::elf::SHF_COMPRESSED) != 0)
        {
            return Err(malformed(format!(
                "section {name} is compressed and has relocations"
            )));
        }
        let (start, size) = section
            .file_range()
            .ok_or_else(|| malformed(format!("section {name} has relocations and no bytes")))?;
        for (offset, reloc) in relocations {
            let symbol = match reloc.target() {
                RelocationTarget::Symbol(s) => {
                    let sym = file.symbol_by_index(s).map_err(DwarfError::Elf)?;
                    match sym.section() {
                        SymbolSection::Section(index) => base_of(index).wrapping_add(sym.address()),
                        // Undefined (an extern's declaration) or absolute.
                        SymbolSection::Absolute => sym.address(),
                        _ => 0,
                    }
                }
                RelocationTarget::Absolute => 0,
                _ => {
                    return Err(malformed(format!(
                        "a relocation in {name} of an unknown target"
                    )))
                }
            };
            let value = symbol.wrapping_add_signed(reloc.addend());
            let RelocationFlags::Elf { r_type } = reloc.flags() else {
                return Err(malformed("not an ELF relocation"));
            };
            let width = match r_type {
                object::elf::R_X86_64_64 | object::elf::R_AARCH64_ABS64 => 8,
                object::elf::R_X86_64_32
                | object::elf::R_X86_64_32S
                | object::elf::R_AARCH64_ABS32 => 4,
                other => {
                    return Err(malformed(format!(
                        "relocation type {other} in {name}, which exotap does not apply"
                    )))
                }
            };
            if offset.saturating_add(width) > size {
                return Err(malformed(format!(
                    "a relocation at {offset:#x} past the end of {name}"
                )));
            }
            let bytes = value.to_le_bytes();
            write(&mut out, start + offset, &bytes[..width as usize])?;
        }
    }
    Ok((out, placed))
}

/// The `N` bytes at `at`, bounds-checked.
fn read<const N: usize>(bytes: &[u8], at: u64) -> Result<[u8; N], DwarfError> {
    let at = usize::try_from(at).map_err(|_| malformed("offset out of range"))?;
    bytes
        .get(at..at.saturating_add(N))
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| malformed(format!("offset {at:#x} past the end of the file")))
}

fn read_u16(bytes: &[u8], at: u64) -> Result<u16, DwarfError> {
    read(bytes, at).map(u16::from_le_bytes)
}

fn read_u64(bytes: &[u8], at: u64) -> Result<u64, DwarfError> {
    read(bytes, at).map(u64::from_le_bytes)
}

fn write(out: &mut [u8], at: u64, value: &[u8]) -> Result<(), DwarfError> {
    let at = usize::try_from(at).map_err(|_| malformed("offset out of range"))?;
    out.get_mut(at..at.saturating_add(value.len()))
        .ok_or_else(|| malformed(format!("offset {at:#x} past the end of the file")))?
        .copy_from_slice(value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dwarf::testing::fixture;
    use crate::dwarf::DebugInfo;

    const TEXT: u64 = 0xffff_ffff_c000_1000;
    const INIT: u64 = 0xffff_ffff_c020_0000;

    fn module_like() -> Option<Vec<u8>> {
        let path = fixture("module_like", &["-c"])?;
        Some(std::fs::read(path).expect("read the fixture"))
    }

    #[test]
    fn a_modules_dwarf_reads_at_the_addresses_its_sections_are_given() {
        let Some(bytes) = module_like() else { return };
        let given = |name: &str| match name {
            ".text" => Some(TEXT),
            ".init.text" => Some(INIT),
            _ => None,
        };
        let (placed, sections) = place(&bytes, &given).expect("place the object");
        assert!(
            sections.contains(&(".text".to_owned(), TEXT)),
            "{sections:?}"
        );
        assert!(
            sections.contains(&(".init.text".to_owned(), INIT)),
            "{sections:?}"
        );
        // A section not given is laid out away from 0 and from the others.
        let data = sections
            .iter()
            .find(|(n, _)| n.starts_with(".data"))
            .map(|(_, a)| *a)
            .expect(".data placed");
        assert!(data >= MADE_UP_BASE, "{data:#x}");
        let info = DebugInfo::new(&placed).expect("DWARF");
        // The symbols are where their sections are (symbol table, not DWARF).
        let count = info.symbols().by_name("count_hit");
        let init = info.symbols().by_name("module_like_init");
        assert_eq!(count.len(), 1, "{count:?}");
        assert_eq!(init.len(), 1, "{init:?}");
        assert!(
            (TEXT..TEXT + 0x1000).contains(&count[0].addr),
            "{:#x}",
            count[0].addr
        );
        assert_eq!(init[0].addr, INIT, "the only function of .init.text");
        // DWARF agrees (its addresses and names are all relocations): the scope at each
        // entry is that function's, with its parameters by name.
        for (addr, function, params) in [
            (count[0].addr, "count_hit", vec!["c", "by"]),
            (INIT, "module_like_init", vec!["arg"]),
        ] {
            let scope = info
                .scope_at(addr)
                .expect("scope")
                .expect("a function covers it");
            assert_eq!(scope.function, function);
            let names: Vec<&str> = scope
                .vars
                .iter()
                .filter(|v| v.is_param)
                .map(|v| v.name.as_str())
                .collect();
            assert_eq!(names, params, "at {addr:#x}");
        }
        // Unrelocated, the same file puts both functions at 0: no scope is found at TEXT.
        let raw = DebugInfo::new(&bytes).expect("raw DWARF");
        assert!(raw.scope_at(count[0].addr).expect("scope").is_none());
    }

    /// A member of a module's own global reached RIP-relative (`shared_counter.hits += by`)
    /// is a join point only once the code's relocation against the global is applied: in
    /// the unrelocated file its displacement is 0. A member reached through a parameter
    /// (`c->hits` in `count_hit`) is one either way.
    #[test]
    fn a_modules_own_global_is_reached_through_its_relocated_code() {
        use crate::dwarf::klas::{join_points_everywhere, MemberQuery};
        let Some(bytes) = module_like() else { return };
        let query = MemberQuery::parse("struct counter.hits").expect("query");
        let in_function = |placed: &[u8], function: &str| -> usize {
            let info = DebugInfo::new(placed).expect("DWARF");
            let names = crate::dwarf::testing::names(&info);
            join_points_everywhere(placed, &names, &query, &|_, _| {})
                .expect("join points")
                .iter()
                .filter(|j| j.function.starts_with(&format!("<{function}+")))
                .count()
        };
        let (placed, _) = place(&bytes, &|_| None).expect("place the object");
        assert!(
            in_function(&placed, "count_hit") > 0,
            "through the parameter"
        );
        assert!(
            in_function(&placed, "bump_shared") > 0,
            "shared_counter.hits, RIP-relative"
        );
        // The same placement with the code's relocations undone: the global is out of reach.
        let file = object::File::parse(&*bytes).expect("parse");
        let text = file.section_by_name(".text").expect(".text");
        let (start, size) = text.file_range().expect("bytes");
        let mut unrelocated = placed.clone();
        let (start, end) = (start as usize, (start + size) as usize);
        unrelocated[start..end].copy_from_slice(&bytes[start..end]);
        assert_eq!(in_function(&unrelocated, "bump_shared"), 0);
        assert!(in_function(&unrelocated, "count_hit") > 0);
    }

    #[test]
    fn section_symbols_name_each_symbols_section_and_offset() {
        let Some(bytes) = module_like() else { return };
        let syms = section_symbols(&bytes).expect("symbols");
        let find = |n: &str| syms.iter().find(|s| s.name == n).cloned();
        let init = find("module_like_init").expect("init function");
        assert_eq!((init.section.as_str(), init.offset), (".init.text", 0));
        // `.data.rel.local`: its initializer holds a pointer.
        let global = find("module_counter").expect("global");
        assert!(global.section.starts_with(".data"), "{global:?}");
        assert_eq!(find("count_hit").expect("function").section, ".text");
    }

    #[test]
    fn what_is_not_a_sound_relocatable_object_is_an_error_not_a_panic() {
        let Some(bytes) = module_like() else { return };
        // Every truncation: an error or (cut in the trailing padding) a result, never a panic.
        for len in (0..bytes.len()).step_by(97) {
            let _ = place(&bytes[..len], &|_| None);
        }
        // A relocation pointing past its section: corrupt the first .rela.debug_info entry's
        // offset (r_offset, the first 8 bytes of an Elf64_Rela).
        let file = object::File::parse(&*bytes).expect("parse");
        let rela = file
            .section_by_name(".rela.debug_info")
            .expect(".rela.debug_info");
        let (start, _) = rela.file_range().expect("bytes");
        let mut bad = bytes.clone();
        bad[start as usize..start as usize + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let err = place(&bad, &|_| None).expect_err("a relocation past its section");
        assert!(err.to_string().contains("past the end"), "{err}");
        // A linked executable is not a module.
        let Some(exe) = fixture("dwarf_fixture", &[]) else {
            return;
        };
        let exe = std::fs::read(exe).expect("read");
        let err = place(&exe, &|_| None).expect_err("not relocatable");
        assert!(err.to_string().contains("relocatable"), "{err}");
    }
}
