//! The loaded modules of a live guest, read from outside it: the kernel's `modules` list,
//! each module's core text, its ORC tables (`mod->arch.orc_unwind_ip`, `orc_unwind`,
//! `num_orcs`: the kernel sorted them at load, the ips relative to their own slots as in
//! vmlinux) and its kallsyms (`mod->kallsyms`: an `Elf64_Sym` array and its string table), so
//! a stack through module code unwinds past it and its frames are named as the kernel's `%pB`
//! names them, `func+0xoff/0xsize [module]`.
//!
//! Offsets come from the image's BTF (`struct module`: `core_layout` up to 6.3, `mem[MOD_TEXT]`
//! from 6.4). Everything read is untrusted guest memory: the walk is bounded, every count is
//! capped before anything is allocated, and a module whose tables cannot be read is kept with
//! its problem (its frames then end an unwind, as before) instead of failing the others.

use std::ops::Range;

use anyhow::{bail, Context};
use exotap_introspect::btf::Btf;
use exotap_introspect::memory::PhysicalMemory;
use exotap_introspect::orc::{OrcLayout, OrcTable, ENTRY_SIZE};
use exotap_introspect::paging::AddressSpace;

/// Most modules a walk of the list visits before it calls the list corrupt.
pub const MAX_MODULES: usize = 4096;
/// Most ORC entries one module may claim (the largest Debian module, kvm, has about 60,000).
const MAX_ORCS: u64 = 1 << 20;
/// Most symbols one module's kallsyms may claim.
const MAX_SYMBOLS: u64 = 1 << 18;
/// Longest symbol name read (the kernel's `KSYM_NAME_LEN`).
const MAX_NAME: usize = 512;
/// `MODULE_STATE_UNFORMED`: a module still being loaded, skipped as the kernel's lookups do.
const STATE_UNFORMED: u32 = 3;
/// Size of an `Elf64_Sym`.
const SYM_SIZE: usize = 24;
/// `SHN_UNDEF`.
const SHN_UNDEF: u16 = 0;

/// Reads guest-virtual memory (an [`AddressSpace`], or a fake in tests).
pub trait VirtualMemory {
    /// Fills `buf` from `va`.
    ///
    /// # Errors
    /// When any byte cannot be read.
    fn read_virt(&mut self, va: u64, buf: &mut [u8]) -> anyhow::Result<()>;
}

impl<M: PhysicalMemory + ?Sized> VirtualMemory for AddressSpace<'_, M> {
    fn read_virt(&mut self, va: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        Ok(self.read(va, buf)?)
    }
}

/// Where `struct module` and `struct mod_kallsyms` keep what the unwinder needs, from BTF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModuleLayout {
    /// `list` (on the kernel's `modules` list).
    pub list: u64,
    /// `state` (`enum module_state`, 4 bytes).
    pub state: u64,
    /// `name` and its length (`MODULE_NAME_LEN`).
    pub name: (u64, u64),
    /// The core text's base pointer and its size (`core_layout.base`/`text_size`, or
    /// `mem[0].base`/`size`), the size a 4-byte `unsigned int`.
    pub text: (u64, u64),
    /// `arch.num_orcs` (4 bytes), `arch.orc_unwind_ip`, `arch.orc_unwind`.
    pub orcs: (u64, u64, u64),
    /// `kallsyms` (a pointer to `struct mod_kallsyms`).
    pub kallsyms: u64,
    /// In `struct mod_kallsyms`: `symtab`, `num_symtab` (4 bytes), `strtab`.
    pub symtab: (u64, u64, u64),
}

impl ModuleLayout {
    /// Reads the offsets from BTF.
    ///
    /// # Errors
    /// A member missing (a kernel without ORC in modules, or laid out otherwise).
    pub fn from_btf(btf: &Btf) -> anyhow::Result<Self> {
        let offset = |ty: &str, path: &str| -> anyhow::Result<u64> {
            btf.struct_member(ty, path)
                .ok()
                .and_then(|m| m.byte_offset())
                .with_context(|| format!("BTF has no byte offset for {ty}.{path}"))
        };
        let module = |path: &str| offset("module", path);
        let name_len = btf
            .struct_member("module", "name")
            .ok()
            .and_then(|m| btf.size_of(m.ty))
            .context("BTF has no size for module.name")?;
        let text = match (module("core_layout.base"), module("core_layout.text_size")) {
            (Ok(base), Ok(size)) => (base, size),
            _ => (module("mem[0].base")?, module("mem[0].size")?),
        };
        Ok(Self {
            list: module("list")?,
            state: module("state")?,
            name: (module("name")?, name_len),
            text,
            orcs: (
                module("arch.num_orcs")?,
                module("arch.orc_unwind_ip")?,
                module("arch.orc_unwind")?,
            ),
            kallsyms: module("kallsyms")?,
            symtab: (
                offset("mod_kallsyms", "symtab")?,
                offset("mod_kallsyms", "num_symtab")?,
                offset("mod_kallsyms", "strtab")?,
            ),
        })
    }
}

/// A module symbol the kernel's `find_kallsyms_symbol` considers: defined, named, not a
/// mapping symbol.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ModuleSymbol {
    addr: u64,
    name: String,
}

/// A loaded module as the host sees it.
#[derive(Debug, Clone)]
pub struct GuestModule {
    /// Its name, as `[name]` ends its frames.
    pub name: String,
    /// Its core text, running addresses.
    pub text: Range<u64>,
    /// Its ORC tables at running addresses; `None` when they could not be read.
    pub orc: Option<OrcTable>,
    /// Its symbols by address (for equal addresses, symbol-table order).
    symbols: Vec<ModuleSymbol>,
    /// What could not be read, if anything.
    pub problem: Option<String>,
}

impl GuestModule {
    /// The symbol `addr` is named by, its offset and size, as the kernel's
    /// `find_kallsyms_symbol` answers for core text: the symbol with the highest address at
    /// or below `addr` (the first of equals), sized up to the next symbol above `addr` or the
    /// end of the text. `None` outside the text or below every symbol.
    pub fn lookup(&self, addr: u64) -> Option<(&str, u64, u64)> {
        if !self.text.contains(&addr) {
            return None;
        }
        let after = self.symbols.partition_point(|s| s.addr <= addr);
        let best_addr = self.symbols.get(after.checked_sub(1)?)?.addr;
        let first = self.symbols.partition_point(|s| s.addr < best_addr);
        let best = self.symbols.get(first)?;
        if best.addr == 0 {
            return None;
        }
        let next = self
            .symbols
            .get(after)
            .map_or(self.text.end, |s| s.addr.min(self.text.end));
        Some((&best.name, addr - best.addr, next - best.addr))
    }
}

/// Every formed module on the list at `head` (the kernel's `modules`), innermost problems
/// kept per module.
///
/// # Errors
/// When the list itself cannot be walked (an unreadable node, or one that never comes back
/// to the head within [`MAX_MODULES`]).
pub fn read_modules<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    head: u64,
    layout: &ModuleLayout,
    orc_layout: OrcLayout,
) -> anyhow::Result<Vec<GuestModule>> {
    let mut modules = Vec::new();
    let mut node = read_u64(mem, head).context("cannot read the kernel's module list head")?;
    while node != head {
        if modules.len() >= MAX_MODULES {
            bail!("the module list at {head:#x} does not come back to its head");
        }
        let module = node.wrapping_sub(layout.list);
        if read_u32(mem, module.wrapping_add(layout.state))? != STATE_UNFORMED {
            modules.push(read_module(mem, module, layout, orc_layout)?);
        }
        node = read_u64(mem, node)
            .with_context(|| format!("cannot follow the module list node at {node:#x}"))?;
    }
    Ok(modules)
}

/// One module: its name and text must read; its tables and symbols may fail (kept as its
/// problem).
fn read_module<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    module: u64,
    layout: &ModuleLayout,
    orc_layout: OrcLayout,
) -> anyhow::Result<GuestModule> {
    let at = |offset: u64| module.wrapping_add(offset);
    let mut name = vec![0u8; usize::try_from(layout.name.1).unwrap_or(0).min(MAX_NAME)];
    mem.read_virt(at(layout.name.0), &mut name)
        .with_context(|| format!("cannot read the name of the module at {module:#x}"))?;
    let name = String::from_utf8_lossy(name.split(|b| *b == 0).next().unwrap_or(&[])).into_owned();
    let base = read_u64(mem, at(layout.text.0))?;
    let size = read_u32(mem, at(layout.text.1))?;
    let text = base..base.saturating_add(u64::from(size));
    let orc = read_orc(mem, at(0), layout, orc_layout)
        .with_context(|| format!("cannot read the ORC tables of module {name}"));
    let symbols = read_symbols(mem, module, layout)
        .with_context(|| format!("cannot read the symbols of module {name}"));
    let problem = [orc.as_ref().err(), symbols.as_ref().err()]
        .into_iter()
        .flatten()
        .map(|e| format!("{e:#}"))
        .reduce(|a, b| format!("{a}; {b}"));
    Ok(GuestModule {
        name,
        text,
        orc: orc.ok(),
        symbols: symbols.unwrap_or_default(),
        problem,
    })
}

fn read_orc<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    module: u64,
    layout: &ModuleLayout,
    orc_layout: OrcLayout,
) -> anyhow::Result<OrcTable> {
    let (num, ip_ptr, entries_ptr) = layout.orcs;
    let count = u64::from(read_u32(mem, module.wrapping_add(num))?);
    if count == 0 || count > MAX_ORCS {
        bail!("it claims {count} entries");
    }
    let ip_addr = read_u64(mem, module.wrapping_add(ip_ptr))?;
    let entries_addr = read_u64(mem, module.wrapping_add(entries_ptr))?;
    let mut ips = vec![0u8; (count * 4) as usize];
    mem.read_virt(ip_addr, &mut ips)?;
    let mut entries = vec![0u8; count as usize * ENTRY_SIZE];
    mem.read_virt(entries_addr, &mut entries)?;
    Ok(OrcTable::parse_with_layout(
        &ips, ip_addr, &entries, orc_layout,
    )?)
}

fn read_symbols<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    module: u64,
    layout: &ModuleLayout,
) -> anyhow::Result<Vec<ModuleSymbol>> {
    let kallsyms = read_u64(mem, module.wrapping_add(layout.kallsyms))?;
    let (symtab_at, num_at, strtab_at) = layout.symtab;
    let symtab = read_u64(mem, kallsyms.wrapping_add(symtab_at))?;
    let count = u64::from(read_u32(mem, kallsyms.wrapping_add(num_at))?);
    let strtab = read_u64(mem, kallsyms.wrapping_add(strtab_at))?;
    if count > MAX_SYMBOLS {
        bail!("it claims {count} symbols");
    }
    let mut raw = vec![0u8; count as usize * SYM_SIZE];
    mem.read_virt(symtab, &mut raw)?;
    // (name offset, value) of the symbols the kernel's lookup considers; ELF's first symbol
    // is the null one and is skipped, as the kernel does.
    let wanted: Vec<(u32, u64)> = raw
        .chunks_exact(SYM_SIZE)
        .skip(1)
        .filter_map(|sym| {
            let word = |r: Range<usize>| sym.get(r).unwrap_or_default();
            let name = u32::from_le_bytes(word(0..4).try_into().ok()?);
            let shndx = u16::from_le_bytes(word(6..8).try_into().ok()?);
            let value = u64::from_le_bytes(word(8..16).try_into().ok()?);
            (shndx != SHN_UNDEF && name != 0).then_some((name, value))
        })
        .collect();
    // The string table in one read up to the last name's start, then that name by itself.
    let last = wanted.iter().map(|(n, _)| *n).max().unwrap_or(0);
    let mut strings = vec![0u8; last as usize];
    mem.read_virt(strtab, &mut strings)?;
    strings.extend(read_cstr(mem, strtab.wrapping_add(u64::from(last)))?);
    strings.push(0);
    let mut symbols: Vec<ModuleSymbol> = wanted
        .into_iter()
        .filter_map(|(offset, addr)| {
            let tail = strings.get(offset as usize..)?;
            let name = tail.split(|b| *b == 0).next()?;
            let name = String::from_utf8_lossy(&name[..name.len().min(MAX_NAME)]).into_owned();
            (!name.is_empty() && !is_mapping_symbol(&name)).then_some(ModuleSymbol { addr, name })
        })
        .collect();
    symbols.sort_by_key(|s| s.addr);
    Ok(symbols)
}

/// The kernel's `is_mapping_symbol`: ARM-style `$a`, `$d`, `$t`, `$x` (alone or with a `.`
/// suffix), and local labels.
fn is_mapping_symbol(name: &str) -> bool {
    let b = name.as_bytes();
    if b.first() == Some(&b'.') && b.get(1) == Some(&b'L') {
        return true;
    }
    b.first() == Some(&b'$')
        && b.get(1).is_some_and(|c| b"axtd".contains(c))
        && matches!(b.get(2), None | Some(b'.'))
}

/// A NUL-terminated string of at most [`MAX_NAME`] bytes, read a page at a time so a
/// string near the end of mapped memory reads.
fn read_cstr<R: VirtualMemory + ?Sized>(mem: &mut R, va: u64) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = va;
    while out.len() < MAX_NAME {
        let page_left = 4096 - (at & 4095) as usize;
        let mut chunk = vec![0u8; page_left.min(MAX_NAME - out.len())];
        mem.read_virt(at, &mut chunk)?;
        if let Some(end) = chunk.iter().position(|b| *b == 0) {
            out.extend_from_slice(&chunk[..end]);
            return Ok(out);
        }
        at = at.wrapping_add(chunk.len() as u64);
        out.extend(chunk);
    }
    Ok(out)
}

fn read_u64<R: VirtualMemory + ?Sized>(mem: &mut R, va: u64) -> anyhow::Result<u64> {
    let mut b = [0u8; 8];
    mem.read_virt(va, &mut b)
        .with_context(|| format!("cannot read guest memory at {va:#x}"))?;
    Ok(u64::from_le_bytes(b))
}

fn read_u32<R: VirtualMemory + ?Sized>(mem: &mut R, va: u64) -> anyhow::Result<u32> {
    let mut b = [0u8; 4];
    mem.read_virt(va, &mut b)
        .with_context(|| format!("cannot read guest memory at {va:#x}"))?;
    Ok(u32::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use exotap_introspect::memory::SparseMemory;
    use exotap_introspect::orc::{encode_tables, RawOrcEntry};

    /// Guest-virtual memory as flat regions (no page tables).
    struct Flat(SparseMemory);

    impl VirtualMemory for Flat {
        fn read_virt(&mut self, va: u64, buf: &mut [u8]) -> anyhow::Result<()> {
            Ok(self.0.read_phys(va, buf)?)
        }
    }

    const LAYOUT: ModuleLayout = ModuleLayout {
        list: 8,
        state: 0,
        name: (24, 56),
        text: (80, 88),
        orcs: (96, 104, 112),
        kallsyms: 120,
        symtab: (0, 8, 16),
    };
    const HEAD: u64 = 0xffff_ffff_82b2_73e0;
    const TEXT: u64 = 0xffff_ffff_c000_0000;

    /// A module struct at `at` named `name` in `state`, its text `TEXT + 0x1000 * slot`
    /// (0x400 bytes), two ORC rows, and symbols `(name, offset into the text, shndx)`.
    fn module(
        mem: &mut SparseMemory,
        at: u64,
        next: u64,
        name: &str,
        state: u32,
        slot: u64,
        syms: &[(&str, u64, u16)],
    ) {
        let text = TEXT + 0x1000 * slot;
        let data = at + 0x1000;
        let mut s = vec![0u8; 0x100];
        s[0..4].copy_from_slice(&state.to_le_bytes());
        s[8..16].copy_from_slice(&next.to_le_bytes());
        s[24..24 + name.len()].copy_from_slice(name.as_bytes());
        s[80..88].copy_from_slice(&text.to_le_bytes());
        s[88..92].copy_from_slice(&0x400u32.to_le_bytes());
        let call = RawOrcEntry {
            sp_offset: 8,
            bp_offset: 0,
            flags: 5,
        };
        let (ips, entries) = encode_tables(
            data,
            &[(text, call), (text + 0x400, RawOrcEntry::default())],
        )
        .unwrap();
        s[96..100].copy_from_slice(&2u32.to_le_bytes());
        s[104..112].copy_from_slice(&data.to_le_bytes());
        s[112..120].copy_from_slice(&(data + 0x100).to_le_bytes());
        s[120..128].copy_from_slice(&(data + 0x200).to_le_bytes());
        mem.add_region(at, s).unwrap();
        let mut d = vec![0u8; 0x1000];
        d[..ips.len()].copy_from_slice(&ips);
        d[0x100..0x100 + entries.len()].copy_from_slice(&entries);
        // mod_kallsyms at +0x200, symtab at +0x300, strtab at +0x800.
        d[0x200..0x208].copy_from_slice(&(data + 0x300).to_le_bytes());
        d[0x208..0x20c].copy_from_slice(&(syms.len() as u32 + 1).to_le_bytes());
        d[0x210..0x218].copy_from_slice(&(data + 0x800).to_le_bytes());
        let mut str_at = 1usize;
        for (i, (sym, offset, shndx)) in syms.iter().enumerate() {
            let e = 0x300 + (i + 1) * SYM_SIZE;
            d[e..e + 4].copy_from_slice(&(str_at as u32).to_le_bytes());
            d[e + 6..e + 8].copy_from_slice(&shndx.to_le_bytes());
            d[e + 8..e + 16].copy_from_slice(&(text + offset).to_le_bytes());
            d[0x800 + str_at..0x800 + str_at + sym.len()].copy_from_slice(sym.as_bytes());
            str_at += sym.len() + 1;
        }
        mem.add_region(data, d).unwrap();
    }

    /// The list head and two modules (and an unformed one between them).
    fn two_modules() -> Flat {
        let mut mem = SparseMemory::new();
        let (a, b, c): (u64, u64, u64) = (
            0xffff_ffff_c010_0000,
            0xffff_ffff_c020_0000,
            0xffff_ffff_c030_0000,
        );
        mem.add_region(HEAD, (a + 8).to_le_bytes().to_vec())
            .unwrap();
        module(
            &mut mem,
            a,
            b + 8,
            "evdev",
            0,
            0,
            &[
                ("evdev_read", 0x100, 1),
                ("evdev_alias", 0x100, 1),
                ("$x", 0x180, 1),
                ("input_event", 0, SHN_UNDEF),
                ("evdev_poll", 0x200, 1),
            ],
        );
        module(&mut mem, b, c + 8, "loading", STATE_UNFORMED, 1, &[]);
        module(
            &mut mem,
            c,
            HEAD,
            "tun",
            1,
            2,
            &[("tun_chr_read_iter", 0x10, 1)],
        );
        Flat(mem)
    }

    #[test]
    fn the_list_gives_formed_modules_with_their_tables_and_symbols() {
        let mut mem = two_modules();

        let modules = read_modules(&mut mem, HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap();

        let names: Vec<&str> = modules.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["evdev", "tun"]);
        let evdev = &modules[0];
        assert_eq!(evdev.text, TEXT..TEXT + 0x400);
        assert!(evdev.problem.is_none(), "{:?}", evdev.problem);
        let orc = evdev.orc.as_ref().unwrap();
        assert_eq!(orc.ip_range(), (TEXT, TEXT + 0x400));
        assert!(modules[1].orc.as_ref().unwrap().covers(TEXT + 0x2010));
    }

    #[test]
    fn a_module_address_is_named_as_the_kernels_find_kallsyms_symbol_names_it() {
        let mut mem = two_modules();
        let modules = read_modules(&mut mem, HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap();
        let evdev = &modules[0];

        // The first of two symbols at one address; the mapping symbol `$x` and the
        // undefined `input_event` neither name nor bound anything.
        assert_eq!(
            evdev.lookup(TEXT + 0x1a5),
            Some(("evdev_read", 0xa5, 0x100))
        );
        // The last symbol runs to the end of the text.
        assert_eq!(
            evdev.lookup(TEXT + 0x3ff),
            Some(("evdev_poll", 0x1ff, 0x200))
        );
        // Below every symbol, and outside the text.
        assert_eq!(evdev.lookup(TEXT + 0x80), None);
        assert_eq!(evdev.lookup(TEXT + 0x400), None);
        assert_eq!(
            modules[1].lookup(TEXT + 0x2020),
            Some(("tun_chr_read_iter", 0x10, 0x3f0))
        );
    }

    #[test]
    fn a_cyclic_list_or_hostile_counts_are_errors_not_hangs_or_huge_allocations() {
        // A node that points at itself never returns to the head.
        let mut mem = SparseMemory::new();
        let node: u64 = 0xffff_ffff_c010_0008;
        mem.add_region(HEAD, node.to_le_bytes().to_vec()).unwrap();
        module(&mut mem, node - 8, node, "loop", 0, 0, &[]);
        let err = read_modules(&mut Flat(mem), HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap_err();
        assert!(format!("{err:#}").contains("does not come back"), "{err:#}");

        // A module claiming billions of ORC entries and symbols keeps its name and text,
        // and says what it could not read.
        let mut mem = two_modules();
        let evdev = 0xffff_ffff_c010_0000u64;
        mem.0
            .write_phys(evdev + 96, &u32::MAX.to_le_bytes())
            .unwrap();
        mem.0
            .write_phys(evdev + 0x1000 + 0x208, &u32::MAX.to_le_bytes())
            .unwrap();
        let modules = read_modules(&mut mem, HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap();
        let problem = modules[0].problem.as_deref().unwrap();
        assert!(modules[0].orc.is_none() && modules[0].lookup(TEXT + 0x1a5).is_none());
        assert!(
            problem.contains("4294967295 entries") && problem.contains("symbols"),
            "{problem}"
        );
        assert_eq!(modules[1].name, "tun");
    }

    #[test]
    fn mapping_symbols_are_the_kernels() {
        for (name, mapping) in [
            ("$x", true),
            ("$d.1", true),
            ("$a", true),
            (".L123", true),
            ("$xy", false),
            ("$q", false),
            ("x$", false),
        ] {
            assert_eq!(is_mapping_symbol(name), mapping, "{name}");
        }
    }
}
