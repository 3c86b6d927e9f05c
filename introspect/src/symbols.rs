//! A kernel symbol table from any source (kallsyms, System.map, an ELF `.symtab`), with the
//! lookups probes need: exact, wildcard, by address, text only, and after a KASLR slide.

use crate::kallsyms::Kallsyms;
use object::{Object, ObjectSection, ObjectSymbol, SectionKind, SymbolKind, SymbolSection};

/// Lowest address of the kernel image mapping (`__START_KERNEL_map`): symbols from here up
/// move with the KASLR slide; lower ones (per-CPU offsets, absolute values) do not.
pub const KERNEL_MAP_BASE: u64 = 0xffff_ffff_8000_0000;

/// Why a symbol table could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SymbolError {
    /// A System.map line is not `ADDRESS TYPE NAME`.
    #[error("System.map line {line} is not \"ADDRESS TYPE NAME\": {text:?}")]
    BadMapLine {
        /// 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
    /// Debian's unsigned kernel package ships a placeholder System.map.
    #[error("this System.map is Debian's placeholder; the real one is in the -dbg package")]
    PlaceholderMap,
    /// The ELF file cannot be read.
    #[error("the ELF file's symbols cannot be read")]
    Elf(#[source] object::Error),
    /// The ELF file has no symbols (stripped).
    #[error("the ELF file has no .symtab (it is stripped)")]
    NoSymtab,
}

/// One symbol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symbol {
    /// Its name.
    pub name: String,
    /// Address (link-time, or slid when the table was slid).
    pub addr: u64,
    /// `nm`-style type character.
    pub kind: char,
    /// Size in bytes: from the ELF when known, else the distance to the next higher symbol
    /// (0 for the last one).
    pub size: u64,
}

impl Symbol {
    /// Whether the symbol is code (`T`, `t`, `W`, `w`).
    pub fn is_text(&self) -> bool {
        matches!(self.kind, 'T' | 't' | 'W' | 'w')
    }
}

/// Symbols sorted by address, with a name index.
#[derive(Debug, Clone, Default)]
pub struct SymbolTable {
    symbols: Vec<Symbol>,
    /// Indices into `symbols`, sorted by name (then address).
    by_name: Vec<usize>,
}

impl SymbolTable {
    /// Builds a table; sizes of 0 are derived from the next higher address.
    pub fn new(mut symbols: Vec<Symbol>) -> Self {
        // Stable: symbols the kernel ranks alike keep the order given (kallsyms' own).
        symbols.sort_by(|a, b| {
            a.addr
                .cmp(&b.addr)
                .then_with(|| alias_rank(a).cmp(&alias_rank(b)))
        });
        // Walking down: `higher` is the lowest address above the current alias group.
        let (mut higher, mut group) = (None::<u64>, None::<u64>);
        for sym in symbols.iter_mut().rev() {
            if group != Some(sym.addr) {
                higher = group.or(higher);
                group = Some(sym.addr);
            }
            if sym.size == 0 {
                sym.size = higher.map_or(0, |next| next - sym.addr);
            }
        }
        let mut by_name: Vec<usize> = (0..symbols.len()).collect();
        by_name.sort_by(|a, b| symbols[*a].name.cmp(&symbols[*b].name).then(a.cmp(b)));
        Self { symbols, by_name }
    }

    /// The symbols recovered from kallsyms.
    pub fn from_kallsyms(kallsyms: &Kallsyms) -> Self {
        Self::new(
            kallsyms
                .symbols
                .iter()
                .map(|s| Symbol {
                    name: s.name.clone(),
                    addr: s.addr,
                    kind: s.kind,
                    size: 0,
                })
                .collect(),
        )
    }

    /// Parses a System.map (`nm -n` output).
    ///
    /// # Errors
    /// [`SymbolError::PlaceholderMap`] for Debian's stub, [`SymbolError::BadMapLine`].
    pub fn from_system_map(text: &str) -> Result<Self, SymbolError> {
        if text.contains("The real System.map is in") {
            return Err(SymbolError::PlaceholderMap);
        }
        let mut symbols = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let bad = || SymbolError::BadMapLine {
                line: i + 1,
                text: line.to_owned(),
            };
            match fields.as_slice() {
                [] => continue,
                [addr, kind, name] => {
                    let addr = u64::from_str_radix(addr, 16).map_err(|_| bad())?;
                    let mut kind_chars = kind.chars();
                    let (Some(kind), None) = (kind_chars.next(), kind_chars.next()) else {
                        return Err(bad());
                    };
                    symbols.push(Symbol {
                        name: (*name).to_owned(),
                        addr,
                        kind,
                        size: 0,
                    });
                }
                _ => return Err(bad()),
            }
        }
        Ok(Self::new(symbols))
    }

    /// Reads the `.symtab` of an unstripped ELF vmlinux (e.g. from the -dbg package).
    ///
    /// # Errors
    /// [`SymbolError::Elf`], [`SymbolError::NoSymtab`].
    pub fn from_elf(data: &[u8]) -> Result<Self, SymbolError> {
        let file = object::File::parse(data).map_err(SymbolError::Elf)?;
        let mut symbols = Vec::new();
        for sym in file.symbols() {
            let Ok(name) = sym.name() else { continue };
            if name.is_empty()
                || sym.is_undefined()
                || matches!(sym.kind(), SymbolKind::File | SymbolKind::Section)
            {
                continue;
            }
            let section = match sym.section() {
                SymbolSection::Section(index) => file.section_by_index(index).ok(),
                _ => None,
            };
            let kind = nm_kind(sym.kind(), section.map(|s| s.kind()), sym.is_global());
            symbols.push(Symbol {
                name: name.to_owned(),
                addr: sym.address(),
                kind,
                size: sym.size(),
            });
        }
        if symbols.is_empty() {
            return Err(SymbolError::NoSymtab);
        }
        Ok(Self::new(symbols))
    }

    /// Number of symbols.
    pub fn len(&self) -> usize {
        self.symbols.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.symbols.is_empty()
    }

    /// All symbols by address.
    pub fn iter(&self) -> impl Iterator<Item = &Symbol> {
        self.symbols.iter()
    }

    /// The symbol called `name` (the lowest-addressed one when static functions share it).
    pub fn get(&self, name: &str) -> Option<&Symbol> {
        self.all_named(name).next()
    }

    /// Every symbol called `name`, by address.
    pub fn all_named<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a Symbol> + 'a {
        let first = self
            .by_name
            .partition_point(|i| self.symbols[*i].name.as_str() < name);
        let end = self
            .by_name
            .partition_point(|i| self.symbols[*i].name.as_str() <= name);
        self.by_name[first..end].iter().map(|i| &self.symbols[*i])
    }

    /// Symbols whose names match a shell-style pattern (`*` any run, `?` one character), in
    /// name order. A pattern without wildcards is an exact lookup.
    pub fn matching(&self, pattern: &str) -> Vec<&Symbol> {
        if !pattern.contains(['*', '?']) {
            return self.all_named(pattern).collect();
        }
        // Names sharing the literal prefix are contiguous in the name index.
        let prefix = &pattern[..pattern.find(['*', '?']).unwrap_or(pattern.len())];
        let first = self
            .by_name
            .partition_point(|i| self.symbols[*i].name.as_str() < prefix);
        self.by_name[first..]
            .iter()
            .map(|i| &self.symbols[*i])
            .take_while(|sym| sym.name.starts_with(prefix))
            .filter(|sym| wildcard_match(pattern, &sym.name))
            .collect()
    }

    /// The symbol containing `addr` and the offset into it: of the symbols at the highest
    /// address at or below `addr`, the last by name, when its size covers `addr` (or it has
    /// no known size). Probe points name their function so (`__x64_sys_getpid`, not the
    /// `__do_sys_getpid` the kernel gives the same address); see [`Self::kernel_lookup`].
    pub fn lookup_addr(&self, addr: u64) -> Option<(&Symbol, u64)> {
        let (group, offset) = self.alias_group(addr)?;
        let sym = group.iter().max_by(|a, b| a.name.cmp(&b.name))?;
        (sym.size == 0 || offset < sym.size).then_some((sym, offset))
    }

    /// As [`Self::lookup_addr`], but where symbols share the address, the first (in the
    /// kernel's order, `alias_rank`) whose size covers `addr`: the name the kernel's own
    /// `kallsyms_lookup` gives (`%pS`, `/proc/PID/stack`), for stack frames and `symname()`.
    pub fn kernel_lookup(&self, addr: u64) -> Option<(&Symbol, u64)> {
        let (group, offset) = self.alias_group(addr)?;
        group
            .iter()
            .find(|sym| sym.size == 0 || offset < sym.size)
            .map(|sym| (sym, offset))
    }

    /// The symbols at the highest address at or below `addr`, and `addr`'s offset from it.
    fn alias_group(&self, addr: u64) -> Option<(&[Symbol], u64)> {
        let after = self.symbols.partition_point(|sym| sym.addr <= addr);
        let at = self.symbols.get(after.checked_sub(1)?)?.addr;
        let first = self.symbols.partition_point(|sym| sym.addr < at);
        Some((&self.symbols[first..after], addr - at))
    }

    /// Only the code symbols.
    pub fn text_only(&self) -> Self {
        Self::new(
            self.symbols
                .iter()
                .filter(|s| s.is_text())
                .cloned()
                .collect(),
        )
    }

    /// The table with every kernel-image symbol (at or above [`KERNEL_MAP_BASE`]) moved by
    /// the KASLR `slide`; per-CPU and absolute symbols stay.
    pub fn slid(&self, slide: u64) -> Self {
        let symbols = self
            .symbols
            .iter()
            .map(|sym| Symbol {
                addr: slide_addr(sym.addr, slide),
                ..sym.clone()
            })
            .collect();
        Self::new(symbols)
    }
}

/// `addr` after a KASLR slide, when it is a kernel-image address.
pub fn slide_addr(addr: u64, slide: u64) -> u64 {
    if addr >= KERNEL_MAP_BASE {
        addr.wrapping_add(slide)
    } else {
        addr
    }
}

/// Shell-style match: `*` is any run of characters, `?` exactly one.
pub fn wildcard_match(pattern: &str, name: &str) -> bool {
    let (pattern, name) = (pattern.as_bytes(), name.as_bytes());
    let (mut p, mut n) = (0, 0);
    // Where the last `*` was and how much of `name` it has swallowed: backtrack there.
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, n));
                p += 1;
            }
            Some(c) if *c == b'?' || *c == name[n] => {
                p += 1;
                n += 1;
            }
            _ => match star {
                Some((star_p, star_n)) => {
                    p = star_p + 1;
                    n = star_n + 1;
                    star = Some((star_p, star_n + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|c| *c == b'*')
}

/// How the kernel orders symbols at one address (scripts/kallsyms.c, `compare_symbols`):
/// weak ones last, then names a linker script may provide (`__start_*`, `__stop_*`,
/// `__end_*`, `__*_start`, `__*_end`), then by the number of leading underscores; symbols
/// ranked alike keep the order they were given in. `kallsyms_lookup` names an address by
/// the first of them.
fn alias_rank(sym: &Symbol) -> (bool, bool, usize) {
    let name = sym.name.as_str();
    let weak = matches!(sym.kind, 'w' | 'W');
    let linker = name.len() >= 8
        && name.starts_with("__")
        && (name[2..].starts_with("start_")
            || name[2..].starts_with("stop_")
            || name[2..].starts_with("end_")
            || name.ends_with("_start")
            || name.ends_with("_end"));
    (
        weak,
        linker,
        name.len() - name.trim_start_matches('_').len(),
    )
}

/// The `nm` type character for an ELF symbol.
fn nm_kind(kind: SymbolKind, section: Option<SectionKind>, global: bool) -> char {
    let local = match (kind, section) {
        (SymbolKind::Text, _) | (_, Some(SectionKind::Text)) => 't',
        (_, Some(SectionKind::UninitializedData | SectionKind::UninitializedTls)) => 'b',
        (_, Some(SectionKind::ReadOnlyData | SectionKind::ReadOnlyString)) => 'r',
        (_, Some(_)) => 'd',
        (_, None) => 'a',
    };
    if global {
        local.to_ascii_uppercase()
    } else {
        local
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAP: &str = "\
ffffffff81000000 T _text
ffffffff81000000 T startup_64
ffffffff81234560 T vfs_read
ffffffff81234700 t vfs_readv_helper
ffffffff81234800 T __x64_sys_getpid
ffffffff81234900 T __ia32_sys_getpid
ffffffff82000000 D linux_banner
0000000000012340 D current_task
";

    fn table() -> SymbolTable {
        SymbolTable::from_system_map(MAP).unwrap()
    }

    #[test]
    fn system_map_sizes_come_from_next_higher_symbol() {
        let table = table();

        assert_eq!(table.get("vfs_read").unwrap().size, 0x1a0);
        assert_eq!(table.get("_text").unwrap().size, 0x23_4560);
        assert_eq!(table.get("linux_banner").unwrap().size, 0);
    }

    #[test]
    fn an_address_several_symbols_share_is_named_as_the_kernel_names_it() {
        // As the Debian 6.1 guest's kallsyms lists them (its `%pS` and /proc/PID/stack name
        // the thunk `__x86_indirect_thunk_array`), then aliases given in the other order:
        // fewer leading underscores first, weak symbols and linker-provided names last.
        let map = "\
ffffffff81e01ae0 T __x86_indirect_thunk_array
ffffffff81e01ae0 T __x86_indirect_thunk_rax
ffffffff81e01b00 T __x86_indirect_thunk_rcx
ffffffff81f00000 T __memcpy
ffffffff81f00000 W memcpy_weak
ffffffff81f00000 T memcpy
ffffffff81f00040 T __end_of_copy
ffffffff81f00040 T copy_end_helper
ffffffff81f00080 T next
";
        let table = SymbolTable::from_system_map(map).unwrap();
        let name = |addr| {
            table
                .kernel_lookup(addr)
                .map(|(s, off)| (s.name.as_str(), off))
        };

        assert_eq!(
            name(0xffff_ffff_81e0_1ae4),
            Some(("__x86_indirect_thunk_array", 4))
        );
        assert_eq!(name(0xffff_ffff_81f0_0010), Some(("memcpy", 0x10)));
        assert_eq!(name(0xffff_ffff_81f0_0040), Some(("copy_end_helper", 0)));
        // Probe points keep naming such an address by the last name.
        let last = table.lookup_addr(0xffff_ffff_81e0_1ae0).unwrap().0;
        assert_eq!(last.name, "__x86_indirect_thunk_rax");
    }

    #[test]
    fn system_map_refuses_debian_placeholder() {
        let text = "ffffffffffffffff B The real System.map is in the linux-image-6.1-dbg package\n";

        let err = SymbolTable::from_system_map(text).unwrap_err();

        assert!(matches!(err, SymbolError::PlaceholderMap));
    }

    #[test]
    fn system_map_reports_bad_line_number() {
        let err =
            SymbolTable::from_system_map("ffffffff81000000 T _text\nnot hex T x\n").unwrap_err();

        assert!(matches!(err, SymbolError::BadMapLine { line: 2, .. }));
    }

    #[test]
    fn matching_star_prefix_pattern() {
        let table = table();

        let names: Vec<&str> = table
            .matching("vfs_*")
            .iter()
            .map(|s| s.name.as_str())
            .collect();

        assert_eq!(names, ["vfs_read", "vfs_readv_helper"]);
    }

    #[test]
    fn matching_leading_star_pattern() {
        let table = table();

        let names: Vec<&str> = table
            .matching("*sys_getpid")
            .iter()
            .map(|s| s.name.as_str())
            .collect();

        assert_eq!(names, ["__ia32_sys_getpid", "__x64_sys_getpid"]);
    }

    #[test]
    fn matching_question_mark_is_one_character() {
        assert!(wildcard_match("vfs_rea?", "vfs_read"));
        assert!(!wildcard_match("vfs_rea?", "vfs_rea"));
        assert!(wildcard_match("*a*b*", "xxaxxbxx"));
        assert!(!wildcard_match("*a*b", "xxaxxbxx"));
    }

    #[test]
    fn matching_without_wildcard_is_exact() {
        let table = table();

        assert_eq!(table.matching("vfs_read").len(), 1);
        assert!(table.matching("vfs_rea").is_empty());
    }

    #[test]
    fn lookup_addr_gives_symbol_and_offset() {
        let table = table();

        let (sym, offset) = table.lookup_addr(0xffff_ffff_8123_4565).unwrap();

        assert_eq!((sym.name.as_str(), offset), ("vfs_read", 5));
    }

    #[test]
    fn lookup_addr_below_first_symbol_is_none() {
        assert!(table().lookup_addr(0x10).is_none());
    }

    #[test]
    fn text_only_drops_data() {
        let text = table().text_only();

        assert!(text.get("linux_banner").is_none());
        assert!(text.get("vfs_readv_helper").is_some());
    }

    #[test]
    fn slid_moves_image_symbols_but_not_percpu() {
        let slid = table().slid(0x1e00_0000);

        assert_eq!(slid.get("vfs_read").unwrap().addr, 0xffff_ffff_9f23_4560);
        assert_eq!(slid.get("current_task").unwrap().addr, 0x12340);
    }

    #[test]
    fn all_named_returns_every_duplicate() {
        let map =
            "ffffffff81000010 t helper\nffffffff81000020 t helper\nffffffff81000030 t other\n";
        let table = SymbolTable::from_system_map(map).unwrap();

        assert_eq!(table.all_named("helper").count(), 2);
        assert_eq!(table.get("helper").unwrap().addr, 0xffff_ffff_8100_0010);
    }

    /// An x86-64 ELF object with text, data and bss symbols, written at test time.
    fn elf_fixture() -> Vec<u8> {
        use object::write::{Object as ElfWriter, Symbol as ElfSymbol, SymbolSection as At};
        use object::{Architecture, BinaryFormat, Endianness, SymbolFlags, SymbolScope};
        let mut elf = ElfWriter::new(BinaryFormat::Elf, Architecture::X86_64, Endianness::Little);
        let text = elf.section_id(object::write::StandardSection::Text);
        let data = elf.section_id(object::write::StandardSection::Data);
        let bss = elf.section_id(object::write::StandardSection::UninitializedData);
        elf.append_section_data(text, &[0x90; 0x40], 16);
        elf.append_section_data(data, &[0; 0x100], 8);
        elf.append_section_bss(bss, 0x1000, 8);
        let symbols = [
            (
                "vfs_read",
                0x0,
                0x20,
                SymbolKind::Text,
                SymbolScope::Linkage,
                text,
            ),
            (
                "helper",
                0x20,
                0,
                SymbolKind::Text,
                SymbolScope::Compilation,
                text,
            ),
            (
                "init_task",
                0x0,
                0x100,
                SymbolKind::Data,
                SymbolScope::Linkage,
                data,
            ),
            (
                "idt_table",
                0x0,
                0x1000,
                SymbolKind::Data,
                SymbolScope::Compilation,
                bss,
            ),
        ];
        for (name, value, size, kind, scope, section) in symbols {
            elf.add_symbol(ElfSymbol {
                name: name.as_bytes().to_vec(),
                value,
                size,
                kind,
                scope,
                weak: false,
                section: At::Section(section),
                flags: SymbolFlags::None,
            });
        }
        elf.write().unwrap()
    }

    #[test]
    fn from_elf_reads_kinds_and_sizes_of_symtab() {
        let table = SymbolTable::from_elf(&elf_fixture()).unwrap();

        let kind_and_size = |name: &str| table.get(name).map(|s| (s.kind, s.size));

        assert_eq!(kind_and_size("vfs_read"), Some(('T', 0x20)));
        assert_eq!(kind_and_size("init_task"), Some(('D', 0x100)));
        assert_eq!(kind_and_size("idt_table"), Some(('b', 0x1000)));
        assert_eq!(table.get("helper").map(|s| s.kind), Some('t'));
    }

    #[test]
    fn from_elf_refuses_non_elf() {
        assert!(matches!(
            SymbolTable::from_elf(&[0u8; 16]),
            Err(SymbolError::Elf(_))
        ));
    }

    #[test]
    fn from_elf_reports_stripped_image() {
        let Some(vmlinux) = crate::bzimage::tests::real_vmlinux() else {
            return;
        };

        let err = SymbolTable::from_elf(vmlinux.bytes()).unwrap_err();

        assert!(matches!(err, SymbolError::NoSymtab));
    }

    #[test]
    fn from_kallsyms_real_image_finds_vfs_read_with_size() {
        let Some(vmlinux) = crate::bzimage::tests::real_vmlinux() else {
            return;
        };
        let table = SymbolTable::from_kallsyms(&crate::kallsyms::extract(&vmlinux).unwrap());

        let vfs_read = table.get("vfs_read").unwrap();

        assert!(
            vfs_read.size > 16 && vfs_read.size < 4096,
            "size {}",
            vfs_read.size
        );
        assert!(table.matching("__x64_sys_*").len() > 300);
        assert_eq!(
            table.lookup_addr(vfs_read.addr + 3).unwrap().0.name,
            "vfs_read"
        );
    }
}
