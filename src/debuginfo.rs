//! `exotap lines|ptype|vars|where`: source-level lookups in the guest kernel's debug info
//! (the Debian `-dbg` vmlinux, or the image's BTF for `ptype --btf`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use exotap_guest_images as images;
use exotap_introspect::btf::{cdecl, Btf};
use exotap_introspect::bzimage::Vmlinux;
use exotap_introspect::dwarf::index::Layer;
use exotap_introspect::dwarf::klas::{self, Globals, MemberQuery};
use exotap_introspect::dwarf::{DebugFile, DebugInfo, EntryKind, Index};

/// Which debug info to read.
#[derive(Debug, Args, Clone)]
pub struct DebugArgs {
    /// Kernel ABI name or package name; its -dbg vmlinux is fetched into the cache when missing.
    #[arg(long, env = "EXOTAP_KERNEL", default_value = images::DEFAULT_KERNEL, value_name = "VERSION")]
    pub kernel: String,
    /// Read this ELF file with DWARF instead of the cached -dbg vmlinux.
    #[arg(long, value_name = "PATH")]
    pub vmlinux: Option<PathBuf>,
    /// Print how long each step took, on stderr.
    #[arg(long)]
    pub timings: bool,
}

/// `exotap lines PATTERN`.
#[derive(Debug, Args)]
pub struct LinesArgs {
    /// Function name, glob or SystemTap pattern: `vfs_read`, `vfs_*`, `*@fs/open.c`.
    pub pattern: String,
    /// Only gdb's `info line` answer, not every line of the function.
    #[arg(long)]
    pub brief: bool,
    /// Also list the places the function was inlined.
    #[arg(long)]
    pub inlined: bool,
    #[command(flatten)]
    pub debug: DebugArgs,
}

/// `exotap ptype TYPE`.
#[derive(Debug, Args)]
pub struct PtypeArgs {
    /// A C type: `struct file` (one or two words), `union thread_union`, `enum pid_type`, `pid_t`.
    #[arg(required = true, num_args = 1..)]
    pub ty: Vec<String>,
    /// Show offsets and sizes (gdb's `ptype /o`).
    #[arg(short = 'o', long)]
    pub offsets: bool,
    /// Read the BTF of the kernel image instead of the -dbg DWARF (the default when no -dbg
    /// vmlinux is cached and no --vmlinux is given).
    #[arg(long)]
    pub btf: bool,
    #[command(flatten)]
    pub debug: DebugArgs,
}

/// `exotap vars PATTERN`.
#[derive(Debug, Args)]
pub struct VarsArgs {
    /// Function name or pattern (as for `lines`).
    pub pattern: String,
    /// Also print each variable's whole location list (pc ranges and where it lives in each).
    #[arg(long)]
    pub ranges: bool,
    /// Read the BTF of the kernel image (parameters only) instead of the -dbg DWARF.
    #[arg(long)]
    pub btf: bool,
    #[command(flatten)]
    pub debug: DebugArgs,
}

/// `exotap where FILE:LINE | ADDR`.
#[derive(Debug, Args)]
pub struct WhereArgs {
    /// A source line (`fs/open.c:1337`), or a link-time address (`0xffffffff81349955`) for
    /// its line: the line table both ways.
    pub location: String,
    #[command(flatten)]
    pub debug: DebugArgs,
}

/// `exotap joinpoints 'struct file.f_pos'`.
#[derive(Debug, Args)]
pub struct JoinpointsArgs {
    /// A struct member (`struct file.f_pos`, `file_operations.read_iter`) or a whole struct.
    #[arg(required = true, num_args = 1..)]
    pub member: Vec<String>,
    /// Only these functions (name, glob or `*@FILE` pattern) instead of the whole kernel.
    #[arg(long, value_name = "PATTERN")]
    pub function: Option<String>,
    /// Print only the count per access kind.
    #[arg(long)]
    pub count: bool,
    /// In this kernel module instead of the kernel (`evdev`, `kvm_amd`): its debug file from
    /// the -dbg package, kept beside the -dbg vmlinux for the modules `exotap image fetch
    /// --debuginfo` keeps. Places are printed as function+offset (a module's addresses are
    /// known only where it is loaded), the same places `module("M").field(...)` probes.
    #[arg(long, value_name = "MODULE", conflicts_with = "vmlinux")]
    pub module: Option<String>,
    #[command(flatten)]
    pub debug: DebugArgs,
}

/// Times the steps of a command when `--timings` is given.
struct Timer {
    on: bool,
    start: Instant,
}

impl Timer {
    fn new(on: bool) -> Timer {
        Timer {
            on,
            start: Instant::now(),
        }
    }

    fn mark(&self, what: &str) {
        if self.on {
            eprintln!(
                "[{:>8.1} ms] {what}",
                self.start.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}

/// The debug vmlinux at hand without fetching: `--vmlinux`, else the cached one. A cache entry
/// whose manifest exists was verified when it was stored; hashing 588 MB again on every lookup
/// would cost seconds.
fn cached_debug_file(args: &DebugArgs) -> anyhow::Result<Option<PathBuf>> {
    if let Some(path) = &args.vmlinux {
        return Ok(Some(path.clone()));
    }
    let abi = images::kernel::kernel_abi(&args.kernel)?;
    let dir = images::cache::cache_root()?
        .join("kernels")
        .join(abi)
        .join("debug");
    Ok(
        (dir.join("manifest.json").is_file() && dir.join("vmlinux").is_file())
            .then(|| dir.join("vmlinux")),
    )
}

/// The debug vmlinux: as [`cached_debug_file`], else fetched by `ensure_debuginfo` (~282 MB
/// download, verified). For the commands that need DWARF (lines, where, joinpoints).
fn debug_file(args: &DebugArgs) -> anyhow::Result<PathBuf> {
    if let Some(path) = cached_debug_file(args)? {
        return Ok(path);
    }
    Ok(images::ensure_debuginfo(&args.kernel)
        .context("cannot get the kernel's debug info")?
        .vmlinux)
}

/// The BTF of the guest kernel image (fetching the kernel, ~30 MB, when missing).
fn kernel_btf(kernel: &str) -> anyhow::Result<Btf> {
    let kernel = images::ensure_kernel(kernel).context("cannot get the guest kernel")?;
    let bytes = std::fs::read(&kernel.bzimage)
        .with_context(|| format!("cannot read {}", kernel.bzimage.display()))?;
    let vmlinux = Vmlinux::from_bzimage(&bytes)?;
    Ok(Btf::from_elf(vmlinux.bytes())?)
}

/// Says on stderr that BTF stands in for the absent DWARF.
fn note_btf_fallback() {
    eprintln!(
        "note: no -dbg vmlinux in the cache; answering from the kernel image's BTF \
         (`exotap image fetch --debuginfo` for DWARF)"
    );
}

/// Opens the cached index of `layer`, building it (with a progress bar) when absent.
fn index(info: &DebugInfo<'_>, layer: Layer) -> anyhow::Result<Index> {
    let cache = images::cache::cache_root()?.join("debuginfo");
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(match layer {
        Layer::Names => "indexing debug info (once per build)",
        Layer::Inlines => "indexing inlined functions (once per build)",
    });
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let index = Index::load_or_build(info, &cache, layer, &progress)
        .context("cannot index the debug info")?;
    bar.finish_and_clear();
    Ok(index)
}

/// `exotap lines`: gdb's `info line` answer for each matching function, then its lines.
pub fn run_lines(args: &LinesArgs) -> anyhow::Result<i32> {
    let t = Timer::new(args.debug.timings);
    let file = DebugFile::open(&debug_file(&args.debug)?)?;
    let info = file.load()?;
    let names = index(&info, Layer::Names)?;
    t.mark("index open");
    let funcs = names.functions(&args.pattern, &[EntryKind::Function]);
    if funcs.is_empty() && !args.inlined {
        bail!("no function matches `{}`", args.pattern);
    }
    for f in &funcs {
        outln!("{}", info.info_line(f.low)?);
        if args.brief {
            continue;
        }
        for (low, high) in info.pc_ranges(f.die)? {
            let table = info.line_table_at(low)?;
            for (path, row) in table
                .rows_in(low, high)
                .into_iter()
                .filter(|(_, r)| r.is_stmt)
            {
                let sym = info.describe(row.addr).unwrap_or_default();
                outln!("  {path}:{} {:#x} {sym}", row.line, row.addr);
            }
        }
    }
    t.mark("lines");
    if args.inlined {
        let inlines = index(&info, Layer::Inlines)?;
        for e in inlines.functions(&args.pattern, &[EntryKind::Inlined]) {
            let sym = info.describe(e.low).unwrap_or_default();
            outln!(
                "{} inlined at {}:{} {:#x} {sym}",
                e.name,
                e.file,
                e.line,
                e.low
            );
        }
        t.mark("inlined instances");
    }
    Ok(0)
}

/// `exotap ptype`: a type as gdb's `ptype` prints it.
pub fn run_ptype(args: &PtypeArgs) -> anyhow::Result<i32> {
    let t = Timer::new(args.debug.timings);
    let spec = args.ty.join(" ");
    let dwarf = if args.btf {
        None
    } else {
        cached_debug_file(&args.debug)?
    };
    let Some(path) = dwarf else {
        if !args.btf {
            note_btf_fallback();
        }
        let btf = kernel_btf(&args.debug.kernel)?;
        t.mark("BTF parsed");
        out!(
            "{}",
            cdecl::ptype(&btf, btf.type_by_spec(&spec)?, args.offsets)
        );
        return Ok(0);
    };
    let file = DebugFile::open(&path)?;
    let info = file.load()?;
    let names = index(&info, Layer::Names)?;
    t.mark("index open");
    let ty = info.find_type(&names, &spec)?;
    out!("{}", cdecl::ptype(&info, ty, args.offsets));
    t.mark("ptype");
    Ok(0)
}

/// `exotap vars`: parameters and locals with their locations at entry.
pub fn run_vars(args: &VarsArgs) -> anyhow::Result<i32> {
    let dwarf = if args.btf {
        None
    } else {
        cached_debug_file(&args.debug)?
    };
    let Some(path) = dwarf else {
        if !args.btf {
            note_btf_fallback();
        }
        return vars_from_btf(&kernel_btf(&args.debug.kernel)?, &args.pattern);
    };
    let file = DebugFile::open(&path)?;
    let info = file.load()?;
    let names = index(&info, Layer::Names)?;
    let funcs = names.functions(&args.pattern, &[EntryKind::Function]);
    if funcs.is_empty() {
        bail!("no function with code matches `{}`", args.pattern);
    }
    for f in funcs {
        outln!("{} at {}:{} (entry {:#x})", f.name, f.file, f.line, f.low);
        for v in info.variables(f.die, f.low)? {
            outln!("  {v}");
            if args.ranges {
                for (low, high, at) in info.location_list(v.die)? {
                    outln!("      [{low:#x}, {high:#x}) {at}");
                }
            }
        }
    }
    Ok(0)
}

/// The System V x86-64 integer argument registers, in order.
const ARG_REGS: [&str; 6] = ["rdi", "rsi", "rdx", "rcx", "r8", "r9"];

/// `exotap vars` from BTF: the parameters of each matching `FUNC` with their types; BTF has no
/// locals and no locations, so a parameter's register at entry comes from the x86-64 calling
/// convention while every earlier parameter is a scalar or pointer of at most 8 bytes.
fn vars_from_btf(btf: &Btf, pattern: &str) -> anyhow::Result<i32> {
    use exotap_introspect::btf::Kind;
    if pattern.contains('@') {
        bail!("BTF has no source files; `{pattern}` needs the -dbg DWARF (`exotap image fetch --debuginfo`)");
    }
    let mut names: Vec<&str> = btf
        .iter()
        .filter(|(_, t)| matches!(t.kind, Kind::Func { .. }))
        .map(|(id, _)| btf.name(id))
        .filter(|n| exotap_introspect::dwarf::pattern::glob_match(pattern, n))
        .collect();
    names.sort_unstable();
    names.dedup();
    if names.is_empty() {
        bail!("no function in the kernel's BTF matches `{pattern}`");
    }
    for name in names {
        let sig = btf.func_signature(name)?;
        outln!("{name} (BTF: parameters only, locations by the x86-64 calling convention)");
        let mut in_regs = true;
        for (i, (pname, ty)) in sig.params.iter().enumerate() {
            let scalar = btf
                .resolve(*ty)
                .ok()
                .and_then(|t| btf.get(t))
                .is_some_and(|t| {
                    matches!(t.kind, Kind::Int { .. } | Kind::Ptr(_) | Kind::Enum { .. })
                })
                && btf.size_of(*ty).is_some_and(|s| s <= 8);
            let at = match ARG_REGS.get(i) {
                Some(r) if in_regs && scalar => format!("%{r}"),
                _ => "<not known without DWARF>".to_owned(),
            };
            in_regs &= scalar;
            outln!("  param {}: {at}", cdecl::declaration(btf, *ty, pname));
        }
    }
    Ok(0)
}

/// `exotap where FILE:LINE`: the addresses of a source line, with their functions.
pub fn run_where(args: &WhereArgs) -> anyhow::Result<i32> {
    if let Some(hex) = args.location.strip_prefix("0x") {
        let addr = u64::from_str_radix(hex, 16)
            .with_context(|| format!("`{}` is not an address", args.location))?;
        let file = DebugFile::open(&debug_file(&args.debug)?)?;
        let info = file.load()?;
        let found = info
            .line_table_at(addr)
            .ok()
            .and_then(|table| table.find_pc(addr));
        let Some(line) = found else {
            bail!("no line information for {addr:#x}");
        };
        let sym = |a: u64| info.describe(a).unwrap_or_default();
        outln!(
            "{}:{} {addr:#x} {} (line's code {:#x}..{:#x})",
            line.file,
            line.line,
            sym(addr),
            line.start,
            line.end
        );
        return Ok(0);
    }
    let Some((path, line)) = args.location.rsplit_once(':') else {
        bail!("give FILE:LINE (fs/open.c:1337) or an address (0xffffffff81349955)");
    };
    let line: u32 = line
        .parse()
        .with_context(|| format!("`{line}` is not a line number"))?;
    let file = DebugFile::open(&debug_file(&args.debug)?)?;
    let info = file.load()?;
    let names = index(&info, Layer::Names)?;
    let sites = info.line_addresses(&names, path, line)?;
    if sites.is_empty() {
        bail!("no code for {path}:{line}");
    }
    for (file, line, addr) in sites {
        let sym = info.describe(addr).unwrap_or_default();
        outln!("{file}:{line} {addr:#x} {sym}");
    }
    Ok(0)
}

/// `exotap joinpoints`: the instructions that access a struct member (KLAS join points).
pub fn run_joinpoints(args: &JoinpointsArgs) -> anyhow::Result<i32> {
    let t = Timer::new(args.debug.timings);
    let query = MemberQuery::parse(&args.member.join(" "))?;
    let file = match &args.module {
        // At made-up addresses: names, lines and offsets into functions are right.
        Some(module) => {
            DebugFile::relocated(&module_debug_file(&args.debug, module)?, &|_| None)?.0
        }
        None => DebugFile::open(&debug_file(&args.debug)?)?,
    };
    let info = file.load()?;
    let names = index(&info, Layer::Names)?;
    t.mark("index open");
    let points = match &args.function {
        Some(pattern) => {
            let funcs = names.functions(pattern, &[EntryKind::Function]);
            if funcs.is_empty() {
                bail!("no function with code matches `{pattern}`");
            }
            info.join_points(&funcs, &Globals::from_index(&info, &names), &query)?
        }
        None if args.module.is_some() => {
            klas::join_points_everywhere(file.bytes(), &names, &query, &|_, _| {})?
        }
        None => {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_message("analysing every function");
            let progress = |done: u64, total: u64| {
                bar.set_length(total);
                bar.set_position(done);
            };
            let cache = images::cache::cache_root()?.join("debuginfo");
            let points = klas::join_points_cached(file.bytes(), &names, &query, &cache, &progress)?;
            bar.finish_and_clear();
            points
        }
    };
    t.mark("join points");
    let mut counts = std::collections::BTreeMap::new();
    for p in &points {
        *counts.entry(p.access.to_string()).or_insert(0usize) += 1;
        if args.count {
            continue;
        }
        if args.module.is_some() {
            outln!(
                "{} {}:{} {} {}",
                p.function,
                p.file,
                p.line,
                p.access,
                p.member
            );
        } else {
            outln!("{p}");
        }
    }
    let by_kind: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
    outln!(
        "{} join points for {}{} ({})",
        points.len(),
        args.member.join(" "),
        args.module
            .as_ref()
            .map_or_else(String::new, |m| format!(" in module {m}")),
        by_kind.join(", ")
    );
    Ok(0)
}

/// The cached debug file of kernel module `module` (`kvm_amd` or `kvm-amd`), kept beside the
/// -dbg vmlinux (`kernels/ABI/debug/modules/NAME.ko`); an error that names the kept ones.
fn module_debug_file(args: &DebugArgs, module: &str) -> anyhow::Result<PathBuf> {
    let abi = images::kernel::kernel_abi(&args.kernel)?;
    let dir = images::cache::cache_root()?
        .join("kernels")
        .join(abi)
        .join("debug")
        .join("modules");
    let wanted = module.replace('-', "_");
    let cached = exotap_probes::live::compiled::debug_files_in(&dir);
    if let Some((_, path)) = cached.iter().find(|(name, _)| *name == wanted) {
        return Ok(path.clone());
    }
    let kept: Vec<&str> = cached.iter().map(|(name, _)| name.as_str()).collect();
    bail!(
        "no debug file of module {module} for kernel {} in {} ({}; `exotap image fetch \
         --debuginfo --kernel {}` keeps a few modules' with the -dbg vmlinux)",
        args.kernel,
        dir.display(),
        if kept.is_empty() {
            "none is cached".to_owned()
        } else {
            format!("cached: {}", kept.join(", "))
        },
        args.kernel
    )
}

/// Source lines of kernel addresses from the cached `-dbg` vmlinux, for the commands that
/// show them when the debug info is at hand (`count --blocks`) and never fetch it.
pub struct LineLookup {
    file: DebugFile,
}

impl LineLookup {
    /// The cached debug vmlinux of the kernel whose bzImage is `bzimage`, if there is one:
    /// the cache keeps it beside the image (`kernels/ABI/debug/vmlinux`, with the manifest
    /// written once verified). A bzImage outside the cache has none: the debug info of
    /// another build would give wrong lines.
    pub fn beside(bzimage: &Path) -> Option<Self> {
        let dir = bzimage.parent()?.join("debug");
        if !(dir.join("manifest.json").is_file() && dir.join("vmlinux").is_file()) {
            return None;
        }
        DebugFile::open(&dir.join("vmlinux"))
            .ok()
            .map(|file| Self { file })
    }

    /// `file:line` of each link-time address, grouped by `function` (one line table a
    /// function): (function entry, addresses in it).
    pub fn lines(&self, groups: &[(u64, Vec<u64>)]) -> std::collections::HashMap<u64, String> {
        let mut out = std::collections::HashMap::new();
        let Ok(info) = self.file.load() else {
            return out;
        };
        for (entry, addrs) in groups {
            let Ok(table) = info.line_table_at(*entry) else {
                continue;
            };
            for &a in addrs {
                if let Some(line) = table.find_pc(a) {
                    out.insert(a, format!("{}:{}", line.file, line.line));
                }
            }
        }
        out
    }
}

impl LineLookup {
    /// The statement rows (address, file, line) of the link-time ranges `[low, high)`.
    pub fn rows(&self, ranges: &[(u64, u64)]) -> Vec<(u64, String, u32)> {
        let mut out = Vec::new();
        let Ok(info) = self.file.load() else {
            return out;
        };
        for &(low, high) in ranges {
            let Ok(table) = info.line_table_at(low) else {
                continue;
            };
            for (path, row) in table.rows_in(low, high) {
                if row.is_stmt {
                    out.push((row.addr, path.to_owned(), row.line));
                }
            }
        }
        out
    }

    /// The functions of a source file (`fs/read_write.c`), by their link-time entry.
    ///
    /// # Errors
    /// No debug index, or no function in the file.
    pub fn functions_in(&self, file: &str) -> anyhow::Result<Vec<(String, u64)>> {
        let info = self.file.load()?;
        let names = index(&info, Layer::Names)?;
        let found: Vec<(String, u64)> = names
            .functions(&format!("*@{file}"), &[EntryKind::Function])
            .into_iter()
            .filter(|f| f.low != 0)
            .map(|f| (f.name.to_owned(), f.low))
            .collect();
        if found.is_empty() {
            bail!("the debug info has no function in {file}");
        }
        Ok(found)
    }
}

/// Line coverage as an lcov tracefile (what `genhtml` renders): per source file its lines
/// (`DA:line,hits`) and functions (`FN`/`FNDA`). `rows` are the statement rows (address, file,
/// line) of the instrumented functions, `hits(address)` the count of the basic block holding
/// the address, and `functions` (name, file, first line, calls).
pub fn lcov(
    rows: &[(u64, String, u32)],
    hits: impl Fn(u64) -> u64,
    functions: &[(String, String, u32, u64)],
) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    let mut files: BTreeMap<&str, BTreeMap<u32, u64>> = BTreeMap::new();
    for (addr, file, line) in rows {
        let n = hits(*addr);
        let e = files.entry(file).or_default().entry(*line).or_insert(0);
        *e = (*e).max(n);
    }
    let mut out = String::from("TN:exotap\n");
    for (file, lines) in &files {
        let _ = writeln!(out, "SF:{file}");
        let fns: Vec<&(String, String, u32, u64)> =
            functions.iter().filter(|f| f.1 == *file).collect();
        for (name, _, line, _) in &fns {
            let _ = writeln!(out, "FN:{line},{name}");
        }
        for (name, _, _, calls) in &fns {
            let _ = writeln!(out, "FNDA:{calls},{name}");
        }
        let _ = writeln!(out, "FNF:{}", fns.len());
        let _ = writeln!(out, "FNH:{}", fns.iter().filter(|f| f.3 > 0).count());
        for (line, n) in lines {
            let _ = writeln!(out, "DA:{line},{n}");
        }
        let _ = writeln!(out, "LF:{}", lines.len());
        let _ = writeln!(out, "LH:{}", lines.values().filter(|n| **n > 0).count());
        out.push_str("end_of_record\n");
    }
    out
}

#[cfg(test)]
mod lcov_tests {
    use super::*;

    #[test]
    fn a_line_takes_the_most_executed_of_its_blocks_and_records_close_per_file() {
        let rows = vec![
            (0x10, "fs/a.c".to_owned(), 3),
            (0x20, "fs/a.c".to_owned(), 3),
            (0x30, "fs/a.c".to_owned(), 4),
            (0x40, "include/b.h".to_owned(), 9),
        ];
        let hits = |a: u64| match a {
            0x10 => 2,
            0x20 => 5,
            _ => 0,
        };
        let fns = vec![("f".to_owned(), "fs/a.c".to_owned(), 2, 2)];

        let text = lcov(&rows, hits, &fns);

        assert_eq!(
            text,
            "TN:exotap\nSF:fs/a.c\nFN:2,f\nFNDA:2,f\nFNF:1\nFNH:1\nDA:3,5\nDA:4,0\nLF:2\nLH:1\nend_of_record\n\
             SF:include/b.h\nFNF:0\nFNH:0\nDA:9,0\nLF:1\nLH:0\nend_of_record\n"
        );
    }
}
