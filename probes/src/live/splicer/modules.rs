//! A loaded kernel module's text as the splicer sees it: its bytes and their analysis, the
//! guest-physical page under each of its pages, and the facts the planner needs, read from
//! the module's own `struct module` in the live guest (not from any image: a module's text is
//! wherever `module_alloc` put it, one page at a time, so no two of its pages need be
//! physically adjacent).
//!
//! What the planner must avoid comes from the module's own tables, found through BTF (each
//! table's member and entry size, so no kernel version is assumed; a table BTF does not
//! describe is left out with a debug line, as the kernel it came from has no such table):
//! - bytes the kernel rewrites at run time: its jump labels (`jump_entries`, whose targets are
//!   also branch targets whatever their key's state) and static calls
//!   (`static_call_sites`);
//! - instructions the kernel finds by address: its exception table (`extable`) and bug table
//!   (`bug_table`);
//! - code never to instrument: `noinstr_text_*`, `kprobes_text_*` and the functions its
//!   `kprobe_blacklist` names (`NOKPROBE_SYMBOL`).
//!
//! Function starts are the module's kallsyms (see [`crate::live::modules`]) inside its text;
//! calls out of the module go to the kernel's slid addresses, so the kernel's own
//! [`AnalysisConfig`] (`__fentry__`, return thunk, retpoline thunks) applies as it is.
//!
//! Everything read is untrusted guest memory: sizes and counts are capped before anything is
//! allocated.

use std::ops::Range;

use anyhow::{bail, Context as _};
use exotap_introspect::btf::Btf;
use exotap_introspect::x86::{ranges_from_starts, AnalysisConfig, CodeView, TextAnalysis};
use exotap_vmm::control::Machine;

use crate::live::attach::Survey;
use crate::live::guest_memory::BackendMemory;
use crate::live::modules::{read_u32, read_u64, GuestModule, VirtualMemory};
use crate::splice::SpliceContext;

use super::kernel::relative;

/// Bytes in a page of module text.
const PAGE: u64 = 4096;
/// Largest module text read (the largest Debian module's core text, amdgpu's, is about
/// 6 MiB); a bigger size is a corrupt or hostile `struct module`.
const MAX_TEXT: u64 = 64 << 20;
/// Most entries one of a module's tables may claim.
const MAX_ENTRIES: u64 = 1 << 20;
/// Bytes a jump label or static call site rewrites (a `jmp`/`call` rel32 or its nop).
const SITE_BYTES: u64 = 5;

/// Where `struct module` keeps a table: the pointer, its count (4 bytes), the entry's size
/// and the offset in an entry of the first `s32` relative to the entry's own address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Table {
    pointer: u64,
    count: u64,
    entry: u64,
    field: u64,
}

/// What the splicer reads of `struct module` beyond [`crate::live::modules::ModuleLayout`],
/// from BTF; `None` for what this kernel does not have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModuleTables {
    /// `jump_entries`: `struct jump_entry { s32 code; s32 target; ... }`; the target's offset.
    jump: Option<(Table, u64)>,
    static_calls: Option<Table>,
    extable: Option<Table>,
    bugs: Option<Table>,
    /// `(start pointer, size)` members of code never to instrument.
    no_probe: [Option<(u64, u64)>; 2],
    /// `kprobe_blacklist` (an array of function addresses) and its count.
    blacklist: Option<(u64, u64)>,
}

impl ModuleTables {
    /// Reads the members and entry layouts from BTF; what is missing stays `None`.
    pub fn from_btf(btf: &Btf) -> Self {
        let offset = |ty: &str, path: &str| -> Option<u64> {
            btf.struct_member(ty, path).ok()?.byte_offset()
        };
        let size = |ty: &str| -> Option<u64> { btf.size_of(btf.struct_by_name(ty).ok()?) };
        let table = |pointer: &str, count: &str, ty: &str, field: &str| -> Option<Table> {
            Some(Table {
                pointer: offset("module", pointer)?,
                count: offset("module", count)?,
                entry: size(ty).filter(|&s| s > 0)?,
                field: offset(ty, field)?,
            })
        };
        let jump = table("jump_entries", "num_jump_entries", "jump_entry", "code")
            .zip(offset("jump_entry", "target"));
        let pair = |start: &str, size: &str| offset("module", start).zip(offset("module", size));
        Self {
            jump,
            static_calls: table(
                "static_call_sites",
                "num_static_call_sites",
                "static_call_site",
                "addr",
            ),
            extable: table("extable", "num_exentries", "exception_table_entry", "insn"),
            bugs: table("bug_table", "num_bugs", "bug_entry", "bug_addr_disp"),
            no_probe: [
                pair("noinstr_text_start", "noinstr_text_size"),
                pair("kprobes_text_start", "kprobes_text_size"),
            ],
            blacklist: pair("kprobe_blacklist", "num_kprobe_blacklist"),
        }
    }
}

/// A module's text, analysed, and where each of its pages is in guest-physical memory.
pub struct ModuleText {
    /// The module's name.
    pub name: String,
    /// Its core text, running addresses.
    pub text: Range<u64>,
    /// The guest-physical address of each page of the text, in order.
    pages: Vec<u64>,
    /// Function starts (its kallsyms inside the text), sorted.
    pub starts: Vec<u64>,
    analysis: TextAnalysis,
    forbidden: Vec<Range<u64>>,
    self_patched: Vec<Range<u64>>,
    address_keyed: Vec<u64>,
}

impl std::fmt::Debug for ModuleText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModuleText")
            .field("name", &self.name)
            .field("text", &self.text)
            .field("functions", &self.starts.len())
            .finish_non_exhaustive()
    }
}

/// Reads `count` entries of `table` of the module at `module`, or `None` where it has none.
fn read_table<R: VirtualMemory + ?Sized>(
    mem: &mut R,
    module: u64,
    table: Table,
    what: &str,
) -> anyhow::Result<Option<(u64, Vec<u8>)>> {
    let at = read_u64(mem, module.wrapping_add(table.pointer))?;
    let count = u64::from(read_u32(mem, module.wrapping_add(table.count))?);
    if count == 0 || at == 0 {
        return Ok(None);
    }
    if count > MAX_ENTRIES {
        bail!("its {what} claims {count} entries (at most {MAX_ENTRIES} are read)");
    }
    // count <= 2^20 and entry sizes are small: no overflow.
    let len = count * table.entry;
    let mut bytes = vec![0u8; usize::try_from(len)?];
    mem.read_virt(at, &mut bytes)
        .with_context(|| format!("cannot read its {what} ({len} bytes at {at:#x})"))?;
    Ok(Some((at, bytes)))
}

impl ModuleText {
    /// Reads `module`'s text from the stopped guest (page by page through the kernel's page
    /// tables), analyses it with the kernel's `config`, and reads its tables.
    ///
    /// # Errors
    /// A text too large or unmapped, or a table that claims too much or cannot be read.
    pub fn read(
        machine: &mut dyn Machine,
        survey: &Survey,
        module: &GuestModule,
        tables: &ModuleTables,
        config: &AnalysisConfig,
    ) -> anyhow::Result<Self> {
        let Range { start, end } = module.text.clone();
        let len = end.saturating_sub(start);
        if len == 0 || len > MAX_TEXT || start % PAGE != 0 {
            bail!(
                "module {}'s text {start:#x}..{end:#x} is not a page-aligned range of at most \
                 {MAX_TEXT} bytes",
                module.name
            );
        }
        let mut bytes = vec![0u8; usize::try_from(len)?];
        let mut pages = Vec::with_capacity(usize::try_from(len.div_ceil(PAGE))?);
        for (i, chunk) in bytes.chunks_mut(PAGE as usize).enumerate() {
            let va = start + i as u64 * PAGE;
            let phys = survey
                .space(&mut BackendMemory(&mut *machine))
                .translate(va)
                .with_context(|| format!("module {}'s text at {va:#x} is not mapped", module.name))?
                .phys;
            machine
                .read_phys(phys, chunk)
                .with_context(|| format!("cannot read module {}'s text at {va:#x}", module.name))?;
            pages.push(phys);
        }
        let mut starts: Vec<u64> = module.symbols_in_text().map(|(_, addr)| addr).collect();
        starts.sort_unstable();
        starts.dedup();
        let mut text = Self {
            name: module.name.clone(),
            text: start..end,
            pages,
            starts,
            analysis: TextAnalysis::default(),
            forbidden: Vec::new(),
            self_patched: Vec::new(),
            address_keyed: Vec::new(),
        };
        let jump_targets = {
            let mut mem = BackendMemory(&mut *machine);
            let mut space = survey.space(&mut mem);
            text.read_tables(&mut space, module.address, tables)
                .with_context(|| format!("module {}", module.name))?
        };
        let ranges = ranges_from_starts(&text.starts, end);
        let mut analysis = TextAnalysis::analyze_owned(start, bytes, &ranges, config);
        analysis.add_targets(jump_targets);
        text.analysis = analysis;
        Ok(text)
    }

    /// Reads the module's tables into the planner's facts; returns its jump labels' targets.
    fn read_tables<R: VirtualMemory + ?Sized>(
        &mut self,
        mem: &mut R,
        module: u64,
        tables: &ModuleTables,
    ) -> anyhow::Result<Vec<u64>> {
        let mut targets = Vec::new();
        if let Some((table, target)) = tables.jump {
            if let Some((at, bytes)) = read_table(mem, module, table, "jump labels")? {
                for e in (0..bytes.len()).step_by(usize::try_from(table.entry)?) {
                    let base = at + e as u64;
                    let entry = &bytes[e..];
                    if let Some(code) = relative(base, entry, usize::try_from(table.field)?) {
                        self.self_patched
                            .push(code..code.saturating_add(SITE_BYTES));
                    }
                    targets.extend(relative(base, entry, usize::try_from(target)?));
                }
            }
        }
        if let Some(table) = tables.static_calls {
            if let Some((at, bytes)) = read_table(mem, module, table, "static call sites")? {
                for e in (0..bytes.len()).step_by(usize::try_from(table.entry)?) {
                    let field = usize::try_from(table.field)?;
                    if let Some(site) = relative(at + e as u64, &bytes[e..], field) {
                        self.self_patched
                            .push(site..site.saturating_add(SITE_BYTES));
                    }
                }
            }
        }
        for (table, what) in [
            (tables.extable, "exception table"),
            (tables.bugs, "bug table"),
        ] {
            let Some(table) = table else { continue };
            if let Some((at, bytes)) = read_table(mem, module, table, what)? {
                for e in (0..bytes.len()).step_by(usize::try_from(table.entry)?) {
                    let field = usize::try_from(table.field)?;
                    self.address_keyed
                        .extend(relative(at + e as u64, &bytes[e..], field));
                }
            }
        }
        for (start, size) in tables.no_probe.into_iter().flatten() {
            let from = read_u64(mem, module.wrapping_add(start))?;
            let len = u64::from(read_u32(mem, module.wrapping_add(size))?);
            if from != 0 && len != 0 {
                self.forbidden.push(from..from.saturating_add(len));
            }
        }
        if let Some((list, count)) = tables.blacklist {
            let at = read_u64(mem, module.wrapping_add(list))?;
            let n = u64::from(read_u32(mem, module.wrapping_add(count))?);
            if at != 0 && n != 0 {
                if n > MAX_ENTRIES {
                    bail!("its kprobe blacklist claims {n} entries");
                }
                let mut raw = vec![0u8; usize::try_from(n * 8)?];
                mem.read_virt(at, &mut raw)
                    .context("cannot read its kprobe blacklist")?;
                for word in raw.chunks_exact(8) {
                    let f = u64::from_le_bytes(word.try_into().unwrap_or_default());
                    let next = self.starts.partition_point(|&s| s <= f);
                    let to = self.starts.get(next).copied().unwrap_or(self.text.end);
                    self.forbidden.push(f..to.max(f + 1));
                }
            }
        }
        self.self_patched = crate::splice::disjoint_ranges(std::mem::take(&mut self.self_patched));
        self.forbidden = crate::splice::disjoint_ranges(std::mem::take(&mut self.forbidden));
        self.address_keyed.sort_unstable();
        self.address_keyed.dedup();
        targets.sort_unstable();
        targets.dedup();
        Ok(targets)
    }

    /// Whether `addr` is in the module's text.
    pub fn contains(&self, addr: u64) -> bool {
        self.text.contains(&addr)
    }

    /// The planner's context over the module's text.
    pub fn context(&self) -> SpliceContext<'_> {
        SpliceContext {
            text: CodeView::new(self.text.start, self.analysis.bytes())
                .unwrap_or_else(|_| CodeView::new(0, &[]).unwrap_or_else(|_| unreachable!())),
            analysis: &self.analysis,
            forbidden: &self.forbidden,
            self_patched: &self.self_patched,
            address_keyed: &self.address_keyed,
        }
    }

    /// The text's bytes from `addr` on (as read at attach).
    pub fn bytes_at(&self, addr: u64) -> Option<&[u8]> {
        let at = usize::try_from(addr.checked_sub(self.text.start)?).ok()?;
        self.analysis.bytes().get(at..)
    }

    /// Guest-physical address of a text address.
    pub fn phys(&self, va: u64) -> Option<u64> {
        if !self.contains(va) {
            return None;
        }
        let page = usize::try_from((va - self.text.start) / PAGE).ok()?;
        Some(self.pages.get(page)? + (va % PAGE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live::modules::Flat;
    use exotap_introspect::memory::SparseMemory;

    const MODULE: u64 = 0xffff_ffff_c100_0000;
    const TEXT: u64 = 0xffff_ffff_c000_0000;
    const DATA: u64 = 0xffff_ffff_c200_0000;

    /// `struct module` with each table's pointer and count at made-up offsets.
    const TABLES: ModuleTables = ModuleTables {
        jump: Some((
            Table {
                pointer: 0x00,
                count: 0x08,
                entry: 16,
                field: 0,
            },
            4,
        )),
        static_calls: Some(Table {
            pointer: 0x10,
            count: 0x18,
            entry: 8,
            field: 0,
        }),
        extable: Some(Table {
            pointer: 0x20,
            count: 0x28,
            entry: 12,
            field: 0,
        }),
        bugs: None,
        no_probe: [Some((0x30, 0x38)), None],
        blacklist: Some((0x40, 0x48)),
    };

    /// An `s32` at `at` that points at `to`.
    fn rel(at: u64, to: u64) -> [u8; 4] {
        (to.wrapping_sub(at) as i64 as i32).to_le_bytes()
    }

    /// The module: one jump label at TEXT+0x10 jumping to TEXT+0x40, a static call at
    /// TEXT+0x80, an exception-table entry at TEXT+0x90, noinstr text TEXT+0x200..0x240, and
    /// the blacklisted function at TEXT+0x100 (up to the next start, TEXT+0x180).
    fn guest(jump_count: u32) -> Flat {
        let mut m = vec![0u8; 0x50];
        let put = |m: &mut Vec<u8>, at: usize, v: &[u8]| m[at..at + v.len()].copy_from_slice(v);
        put(&mut m, 0x00, &DATA.to_le_bytes());
        put(&mut m, 0x08, &jump_count.to_le_bytes());
        put(&mut m, 0x10, &(DATA + 0x100).to_le_bytes());
        put(&mut m, 0x18, &1u32.to_le_bytes());
        put(&mut m, 0x20, &(DATA + 0x200).to_le_bytes());
        put(&mut m, 0x28, &1u32.to_le_bytes());
        put(&mut m, 0x30, &(TEXT + 0x200).to_le_bytes());
        put(&mut m, 0x38, &0x40u32.to_le_bytes());
        put(&mut m, 0x40, &(DATA + 0x300).to_le_bytes());
        put(&mut m, 0x48, &1u32.to_le_bytes());
        let mut d = vec![0u8; 0x400];
        put(&mut d, 0x000, &rel(DATA, TEXT + 0x10));
        put(&mut d, 0x004, &rel(DATA + 4, TEXT + 0x40));
        put(&mut d, 0x100, &rel(DATA + 0x100, TEXT + 0x80));
        put(&mut d, 0x200, &rel(DATA + 0x200, TEXT + 0x90));
        put(&mut d, 0x300, &(TEXT + 0x100).to_le_bytes());
        let mut mem = SparseMemory::new();
        mem.add_region(MODULE, m).unwrap();
        mem.add_region(DATA, d).unwrap();
        Flat(mem)
    }

    fn empty() -> ModuleText {
        ModuleText {
            name: "m".into(),
            text: TEXT..TEXT + 0x1000,
            pages: vec![0x10_0000],
            starts: vec![TEXT, TEXT + 0x100, TEXT + 0x180],
            analysis: TextAnalysis::default(),
            forbidden: Vec::new(),
            self_patched: Vec::new(),
            address_keyed: Vec::new(),
        }
    }

    #[test]
    fn a_modules_tables_give_the_planner_its_rewritten_keyed_and_forbidden_code() {
        let mut text = empty();

        let targets = text.read_tables(&mut guest(1), MODULE, &TABLES).unwrap();

        assert_eq!(targets, [TEXT + 0x40]);
        assert_eq!(
            text.self_patched,
            [TEXT + 0x10..TEXT + 0x15, TEXT + 0x80..TEXT + 0x85]
        );
        assert_eq!(text.address_keyed, [TEXT + 0x90]);
        assert_eq!(
            text.forbidden,
            [TEXT + 0x100..TEXT + 0x180, TEXT + 0x200..TEXT + 0x240]
        );
    }

    #[test]
    fn a_table_that_claims_too_many_entries_is_refused_before_anything_is_allocated() {
        let mut text = empty();

        let err = text
            .read_tables(&mut guest(u32::MAX), MODULE, &TABLES)
            .unwrap_err();

        assert!(
            format!("{err:#}").contains("claims 4294967295 entries"),
            "{err:#}"
        );
    }

    #[test]
    fn module_text_pages_map_one_by_one() {
        let mut text = empty();
        text.text = TEXT..TEXT + 0x2000;
        text.pages = vec![0x50_0000, 0x30_0000];

        assert_eq!(text.phys(TEXT + 0x10), Some(0x50_0010));
        assert_eq!(text.phys(TEXT + 0x1ffc), Some(0x30_0ffc));
        assert_eq!(text.phys(TEXT + 0x2000), None);
        assert_eq!(text.phys(TEXT - 1), None);
    }
}
