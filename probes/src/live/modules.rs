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

use std::collections::BTreeSet;
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
/// Largest string table offset a module's symbol names are read up to. The kernel keeps only
/// its core symbols' names there (a few hundred KiB for the largest Debian modules); a name
/// offset past this is a hostile or corrupt `st_name`, not a 4-GiB read.
const MAX_STRTAB: u64 = 8 << 20;
/// Most bytes of ORC tables, symbol tables and string tables one walk of the list reads, all
/// modules together: [`MAX_MODULES`] modules each within the caps above could otherwise
/// claim tens of GiB.
const MAX_TABLE_BYTES: u64 = 256 << 20;
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

/// Guest-virtual memory as flat regions (no page tables): the readers' tests.
#[cfg(test)]
pub(crate) struct Flat(pub(crate) exotap_introspect::memory::SparseMemory);

#[cfg(test)]
impl VirtualMemory for Flat {
    fn read_virt(&mut self, va: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        Ok(exotap_introspect::memory::PhysicalMemory::read_phys(
            &mut self.0,
            va,
            buf,
        )?)
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
    /// Where its `struct module` is.
    pub address: u64,
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
    /// Its symbols inside its core text (name, running address), by address: its functions,
    /// and the `__pfx_`/`__cfi_` padding before them on kernels built with call padding.
    pub fn symbols_in_text(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.symbols
            .iter()
            .filter(|s| self.text.contains(&s.addr))
            .map(|s| (s.name.as_str(), s.addr))
    }

    /// All its symbols (name, running address): text, data and read-only data.
    pub fn symbols(&self) -> impl Iterator<Item = (&str, u64)> + '_ {
        self.symbols.iter().map(|s| (s.name.as_str(), s.addr))
    }

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
/// When the list itself cannot be walked (an unreadable node, a node whose `struct module`
/// would lie outside the address space, a node visited twice, or a list that never comes
/// back to the head within [`MAX_MODULES`]).
pub fn read_modules<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    head: u64,
    layout: &ModuleLayout,
    orc_layout: OrcLayout,
) -> anyhow::Result<Vec<GuestModule>> {
    let mut modules = Vec::new();
    let mut budget = Budget(MAX_TABLE_BYTES);
    let mut seen = BTreeSet::new();
    let mut node = read_u64(mem, head).context("cannot read the kernel's module list head")?;
    while node != head {
        if seen.len() >= MAX_MODULES {
            bail!("the module list at {head:#x} does not come back to its head");
        }
        if !seen.insert(node) {
            bail!(
                "the module list at {head:#x} does not come back to its head: it loops back \
                 to {node:#x}"
            );
        }
        let module = node.checked_sub(layout.list).with_context(|| {
            format!(
                "the module list node {node:#x} lies below its offset {:#x} in struct module",
                layout.list
            )
        })?;
        if read_u32(mem, field(module, layout.state, "module state")?)? != STATE_UNFORMED {
            modules.push(read_module(mem, module, layout, orc_layout, &mut budget)?);
        }
        node = read_u64(mem, node)
            .with_context(|| format!("cannot follow the module list node at {node:#x}"))?;
    }
    Ok(modules)
}

/// Bytes of tables (ORC, symbols, names) all modules of one walk may still read: a list of
/// [`MAX_MODULES`] hostile modules, each within its own caps, still reads a bounded total.
#[derive(Debug)]
struct Budget(u64);

impl Budget {
    /// Takes `bytes` for `what`, or says the walk has read all it may.
    fn take(&mut self, bytes: u64, what: &str) -> anyhow::Result<()> {
        match self.0.checked_sub(bytes) {
            Some(left) => {
                self.0 = left;
                Ok(())
            }
            None => bail!(
                "{what} ({bytes} bytes) would take the modules' tables past \
                 {MAX_TABLE_BYTES} bytes in all"
            ),
        }
    }
}

/// `base + offset` for the guest field `what`, or an error where it would leave the address
/// space (a hostile pointer).
fn field(base: u64, offset: u64, what: &str) -> anyhow::Result<u64> {
    base.checked_add(offset).with_context(|| {
        format!("{what} at {base:#x} + {offset:#x} lies outside the address space")
    })
}

/// `len` bytes at `va` (`len` already capped by the caller), or an error where the range
/// would wrap the address space.
fn read_block<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    va: u64,
    len: u64,
    what: &str,
) -> anyhow::Result<Vec<u8>> {
    field(va, len, what)?;
    let mut buf = vec![0u8; usize::try_from(len)?];
    mem.read_virt(va, &mut buf)
        .with_context(|| format!("cannot read {what} ({len} bytes at {va:#x})"))?;
    Ok(buf)
}

/// One module: its name and text must read; its tables and symbols may fail (kept as its
/// problem).
fn read_module<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    module: u64,
    layout: &ModuleLayout,
    orc_layout: OrcLayout,
    budget: &mut Budget,
) -> anyhow::Result<GuestModule> {
    let mut name = vec![0u8; usize::try_from(layout.name.1).unwrap_or(0).min(MAX_NAME)];
    mem.read_virt(field(module, layout.name.0, "module name")?, &mut name)
        .with_context(|| format!("cannot read the name of the module at {module:#x}"))?;
    let name = String::from_utf8_lossy(name.split(|b| *b == 0).next().unwrap_or(&[])).into_owned();
    let base = read_u64(mem, field(module, layout.text.0, "module text base")?)?;
    let size = read_u32(mem, field(module, layout.text.1, "module text size")?)?;
    let text = base..base.saturating_add(u64::from(size));
    let orc = read_orc(mem, module, layout, orc_layout, budget)
        .with_context(|| format!("cannot read the ORC tables of module {name}"));
    let symbols = read_symbols(mem, module, layout, budget)
        .with_context(|| format!("cannot read the symbols of module {name}"));
    let problem = [orc.as_ref().err(), symbols.as_ref().err()]
        .into_iter()
        .flatten()
        .map(|e| format!("{e:#}"))
        .reduce(|a, b| format!("{a}; {b}"));
    Ok(GuestModule {
        name,
        address: module,
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
    budget: &mut Budget,
) -> anyhow::Result<OrcTable> {
    let (num, ip_ptr, entries_ptr) = layout.orcs;
    let count = u64::from(read_u32(mem, field(module, num, "arch.num_orcs")?)?);
    if count == 0 || count > MAX_ORCS {
        bail!("it claims {count} entries (at most {MAX_ORCS} are read)");
    }
    let ip_addr = read_u64(mem, field(module, ip_ptr, "arch.orc_unwind_ip")?)?;
    let entries_addr = read_u64(mem, field(module, entries_ptr, "arch.orc_unwind")?)?;
    // count <= MAX_ORCS: neither product overflows.
    let (ip_bytes, entry_bytes) = (count * 4, count * ENTRY_SIZE as u64);
    budget.take(ip_bytes + entry_bytes, "its ORC tables")?;
    let ips = read_block(mem, ip_addr, ip_bytes, "the ORC ip table")?;
    let entries = read_block(mem, entries_addr, entry_bytes, "the ORC entries")?;
    Ok(OrcTable::parse_with_layout(
        &ips, ip_addr, &entries, orc_layout,
    )?)
}

fn read_symbols<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    module: u64,
    layout: &ModuleLayout,
    budget: &mut Budget,
) -> anyhow::Result<Vec<ModuleSymbol>> {
    let kallsyms = read_u64(mem, field(module, layout.kallsyms, "kallsyms")?)?;
    let (symtab_at, num_at, strtab_at) = layout.symtab;
    let symtab = read_u64(mem, field(kallsyms, symtab_at, "kallsyms->symtab")?)?;
    let count = u64::from(read_u32(
        mem,
        field(kallsyms, num_at, "kallsyms->num_symtab")?,
    )?);
    let strtab = read_u64(mem, field(kallsyms, strtab_at, "kallsyms->strtab")?)?;
    if count > MAX_SYMBOLS {
        bail!("it claims {count} symbols (at most {MAX_SYMBOLS} are read)");
    }
    // count <= MAX_SYMBOLS: no overflow.
    let symtab_bytes = count * SYM_SIZE as u64;
    budget.take(symtab_bytes, "its symbol table")?;
    let raw = read_block(mem, symtab, symtab_bytes, "the symbol table")?;
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
    let last = u64::from(wanted.iter().map(|(n, _)| *n).max().unwrap_or(0));
    if last > MAX_STRTAB {
        bail!(
            "a symbol's name starts at offset {last:#x} of its string table, past the \
             {MAX_STRTAB:#x} bytes a module's string table is read up to"
        );
    }
    budget.take(last + MAX_NAME as u64, "its string table")?;
    let mut strings = read_block(mem, strtab, last, "the string table")?;
    strings.extend(read_cstr(
        mem,
        field(strtab, last, "the last symbol name")?,
    )?);
    strings.push(0);
    let mut symbols: Vec<ModuleSymbol> = wanted
        .into_iter()
        .filter_map(|(offset, addr)| {
            let tail = strings.get(usize::try_from(offset).ok()?..)?;
            let name = tail.split(|b| *b == 0).next()?;
            let name = String::from_utf8_lossy(name.get(..MAX_NAME).unwrap_or(name)).into_owned();
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
pub(crate) fn read_cstr<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    va: u64,
) -> anyhow::Result<Vec<u8>> {
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
        at = field(at, chunk.len() as u64, "a symbol name")?;
        out.extend(chunk);
    }
    Ok(out)
}

/// A little-endian `u64` at `va`.
pub(crate) fn read_u64<R: VirtualMemory + ?Sized>(mem: &mut R, va: u64) -> anyhow::Result<u64> {
    let mut b = [0u8; 8];
    mem.read_virt(va, &mut b)
        .with_context(|| format!("cannot read guest memory at {va:#x}"))?;
    Ok(u64::from_le_bytes(b))
}

/// A little-endian `u32` at `va`.
pub(crate) fn read_u32<R: VirtualMemory + ?Sized>(mem: &mut R, va: u64) -> anyhow::Result<u32> {
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

    /// Guest-virtual memory as flat regions (no page tables), and the longest read asked of
    /// it (every buffer the reader allocates for guest data is read into at once).
    struct Flat(SparseMemory, usize);

    impl VirtualMemory for Flat {
        fn read_virt(&mut self, va: u64, buf: &mut [u8]) -> anyhow::Result<()> {
            self.1 = self.1.max(buf.len());
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
        Flat(mem, 0)
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
        let err = read_modules(&mut Flat(mem, 0), HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap_err();
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

    /// The largest single read (and so allocation) the reader may make for one table: the
    /// string table up to [`MAX_STRTAB`]; the symbol and ORC tables are capped below it.
    const LARGEST_READ: usize = MAX_STRTAB as usize;

    #[test]
    fn a_hostile_name_offset_is_an_error_not_a_4_gib_read() {
        let mut mem = two_modules();
        let evdev = 0xffff_ffff_c010_0000u64;
        // The first symbol's st_name: u32::MAX would size a 4-GiB string table read.
        mem.0
            .write_phys(
                evdev + 0x1000 + 0x300 + SYM_SIZE as u64,
                &u32::MAX.to_le_bytes(),
            )
            .unwrap();

        let modules = read_modules(&mut mem, HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap();

        let problem = modules[0].problem.as_deref().unwrap();
        assert!(
            problem.contains("symbols of module evdev")
                && problem.contains("offset 0xffffffff of its string table"),
            "{problem}"
        );
        // The ORC tables still read; the other module is untouched.
        assert!(modules[0].orc.is_some());
        assert_eq!(
            modules[1].lookup(TEXT + 0x2020),
            Some(("tun_chr_read_iter", 0x10, 0x3f0))
        );
        assert!(mem.1 <= 0x1000, "a read of {} bytes", mem.1);
    }

    #[test]
    fn hostile_pointers_are_errors_not_wrapped_addresses() {
        // A list node below the list's offset in struct module.
        let mut mem = SparseMemory::new();
        mem.add_region(HEAD, 4u64.to_le_bytes().to_vec()).unwrap();
        let err = read_modules(&mut Flat(mem, 0), HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap_err();
        assert!(
            format!("{err:#}").contains("lies below its offset"),
            "{err:#}"
        );

        // A kallsyms pointer at the top of the address space (its fields are not read at
        // wrapped, low addresses), and a string table whose names would run past the top.
        let mut mem = two_modules();
        let (evdev, tun) = (0xffff_ffff_c010_0000u64, 0xffff_ffff_c030_0000u64);
        mem.0
            .write_phys(evdev + 120, &(u64::MAX - 4).to_le_bytes())
            .unwrap();
        mem.0
            .write_phys(tun + 0x1000 + 0x210, &u64::MAX.to_le_bytes())
            .unwrap();
        let modules = read_modules(&mut mem, HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap();
        let problem = modules[0].problem.as_deref().unwrap();
        assert!(
            problem.contains("symbols of module evdev") && problem.contains("0xfffffffffffffffb"),
            "{problem}"
        );
        let problem = modules[1].problem.as_deref().unwrap();
        assert!(
            problem.contains("symbols of module tun")
                && problem.contains("the string table at 0xffffffffffffffff + 0x1")
                && problem.contains("lies outside the address space"),
            "{problem}"
        );
        assert!(modules[0].orc.is_some() && modules[1].orc.is_some());
    }

    #[test]
    fn all_modules_together_read_a_bounded_total() {
        // 40 modules each claiming the most ORC entries one module may (10 MiB of tables):
        // past the walk's total the rest are refused before anything is allocated.
        let mut mem = SparseMemory::new();
        let at = |i: u64| 0xffff_ffff_c100_0000 + 0x2000 * i;
        mem.add_region(HEAD, (at(0) + 8).to_le_bytes().to_vec())
            .unwrap();
        for i in 0..40 {
            let next = if i == 39 { HEAD } else { at(i + 1) + 8 };
            module(&mut mem, at(i), next, "big", 0, i, &[]);
            mem.write_phys(at(i) + 96, &(MAX_ORCS as u32).to_le_bytes())
                .unwrap();
        }
        let mut mem = Flat(mem, 0);

        let modules = read_modules(&mut mem, HEAD, &LAYOUT, OrcLayout::Linux4_14).unwrap();

        assert_eq!(modules.len(), 40);
        let refused = modules
            .iter()
            .filter(|m| m.problem.as_deref().is_some_and(|p| p.contains("in all")))
            .count();
        let per_module = MAX_ORCS * (4 + ENTRY_SIZE as u64);
        assert!(
            refused >= 40 - (MAX_TABLE_BYTES / per_module) as usize,
            "{refused}"
        );
        assert!(mem.1 <= LARGEST_READ, "a read of {} bytes", mem.1);
    }

    /// xorshift64*: a fixed-seed generator, so a failure reproduces.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Reads `mem` as the module list at `head` and uses what it gives: any outcome but a
    /// panic or a read larger than one capped table.
    fn read_and_use(mut mem: Flat, head: u64) {
        if let Ok(modules) = read_modules(&mut mem, head, &LAYOUT, OrcLayout::Linux4_14) {
            assert!(modules.len() <= MAX_MODULES);
            for m in &modules {
                for addr in [m.text.start, m.text.start.wrapping_add(0x1a5), m.text.end] {
                    let _ = m.lookup(addr);
                }
                if let Some(orc) = &m.orc {
                    let _ = orc.covers(m.text.start);
                }
            }
        }
        assert!(mem.1 <= LARGEST_READ, "a read of {} bytes", mem.1);
    }

    #[test]
    fn random_corruption_of_the_module_list_gives_ok_or_err_never_a_panic() {
        let (a, b, c) = (
            0xffff_ffff_c010_0000u64,
            0xffff_ffff_c020_0000u64,
            0xffff_ffff_c030_0000u64,
        );
        // (start, length) of every region two_modules() maps.
        let regions: Vec<(u64, u64)> = [a, b, c]
            .iter()
            .flat_map(|&m| [(m, 0x100), (m + 0x1000, 0x1000)])
            .chain([(HEAD, 8)])
            .collect();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..2000 {
            let mut mem = two_modules();
            for _ in 0..1 + rng.below(8) {
                let (start, len) = regions[rng.below(regions.len() as u64) as usize];
                let at = start + (rng.below(len) & !3).min(len.saturating_sub(8));
                let (r0, r1) = regions[rng.below(regions.len() as u64) as usize];
                let value = match rng.below(6) {
                    0 => rng.next(),
                    1 => u64::from(u32::MAX),
                    2 => rng.below(1 << 24),
                    3 => r0 + rng.below(r1),
                    4 => u64::MAX - rng.below(64),
                    _ => 0,
                };
                let width = if len >= 8 && rng.below(2) == 0 { 8 } else { 4 };
                let _ = mem.0.write_phys(at, &value.to_le_bytes()[..width]);
            }
            read_and_use(mem, HEAD);
        }
    }

    #[test]
    fn random_bytes_as_the_module_list_give_ok_or_err_never_a_panic() {
        // 16 KiB of random words, half of them pointers into it; the head at its start.
        const BASE: u64 = 0xffff_ffff_c000_0000;
        const LEN: u64 = 0x4000;
        let mut rng = Rng(0x0123_4567_89ab_cdef);
        for _ in 0..300 {
            let mut bytes = vec![0u8; LEN as usize];
            for word in bytes.chunks_exact_mut(8) {
                let value = match rng.below(4) {
                    0 | 1 => BASE + (rng.below(LEN) & !7),
                    2 => rng.below(1 << 12),
                    _ => rng.next(),
                };
                word.copy_from_slice(&value.to_le_bytes());
            }
            let mut mem = SparseMemory::new();
            mem.add_region(BASE, bytes).unwrap();
            read_and_use(Flat(mem, 0), BASE);
        }
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
