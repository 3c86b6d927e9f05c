//! Source positions of the guest kernel from its -dbg vmlinux (DWARF): the functions a
//! source file defines, the addresses where a source line begins, and the places a function
//! was inlined, for the `@FILE` and `:LINE` filters of `kernel.function(...)` and
//! `kernel.statement(...)`, for `kernel.function(...).inline`, and the member accesses of
//! `kernel.field(...)` (KLAS's join points).
//!
//! The DWARF reading (name index, line tables) is introspect's; this module only asks it.

use std::path::{Path, PathBuf};

use exotap_introspect::dwarf::index::Layer;
use exotap_introspect::dwarf::{DebugFile, EntryKind, Index};

/// A function defined in a source file: (name, declaring file, declaration line, entry,
/// end) with link-time addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFunction {
    /// The function's name.
    pub name: String,
    /// The file that defines it, as DWARF names it (`fs/read_write.c`).
    pub file: String,
    /// The line of its definition.
    pub line: u32,
    /// Entry pc (link-time).
    pub low: u64,
    /// End of its main range (link-time).
    pub high: u64,
}

/// One place a function was inlined: its name and declaration (as the abstract function
/// has them), the call site, and the instance's entry pc (link-time: `DW_AT_entry_pc`, or its
/// `low_pc`, or the start of its first range).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InlinedCopy {
    /// The inlined function's name.
    pub name: String,
    /// The file that declares it (`include/linux/file.h`), `""` when DWARF does not say.
    pub file: String,
    /// Its declaration line (0 when unknown).
    pub line: u32,
    /// The file of the call site that it was inlined into.
    pub call_file: String,
    /// The line of that call.
    pub call_line: u32,
    /// The instance's entry pc.
    pub entry: u64,
}

/// What a source line maps to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineSites {
    /// The `is_stmt` addresses where the line begins, as (file, address), by address.
    Code(Vec<(String, u64)>),
    /// The line has no code; the nearest later line that has some, if any.
    NoCode {
        /// The next line with code in that file.
        next: Option<u32>,
    },
}

/// The -dbg vmlinux of the guest kernel, with the directory its name index is cached in.
#[derive(Debug)]
pub struct SourceLines {
    file: DebugFile,
    cache: PathBuf,
}

impl SourceLines {
    /// Opens the -dbg vmlinux at `path`; its name index lives (or is built once) in `cache`.
    ///
    /// # Errors
    /// When the file cannot be opened.
    pub fn open(path: &Path, cache: &Path) -> anyhow::Result<Self> {
        Ok(Self {
            file: DebugFile::open(path)?,
            cache: cache.to_owned(),
        })
    }

    /// Path of the -dbg vmlinux.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The functions with code matching `pattern` (glob) defined in a file matching `file`
    /// (a trailing path, globs allowed: `fs/read_write.c`, `read_write.c`, `fs/*.c`), by name
    /// then address.
    ///
    /// # Errors
    /// Unreadable DWARF or index.
    pub fn functions(&self, pattern: &str, file: &str) -> anyhow::Result<Vec<SourceFunction>> {
        let info = self.file.load()?;
        let names = Index::load_or_build(&info, &self.cache, Layer::Names, &|_, _| {})?;
        let mut out: Vec<SourceFunction> = names
            .functions(&format!("{pattern}@{file}"), &[EntryKind::Function])
            .into_iter()
            .filter(|f| f.low != 0)
            .map(|f| SourceFunction {
                name: f.name.to_owned(),
                file: f.file.to_owned(),
                line: f.line,
                low: f.low,
                high: f.high,
            })
            .collect();
        out.sort_by(|a, b| (&a.name, a.low).cmp(&(&b.name, b.low)));
        out.dedup_by(|a, b| a.name == b.name && a.low == b.low);
        Ok(out)
    }

    /// The inlined instances of the functions matching `pattern` (a name or glob) declared
    /// in a file matching `file` (`*`: any), by entry pc; one per function and entry pc (a
    /// function inlined into another inlined one can share its entry).
    ///
    /// # Errors
    /// Unreadable DWARF.
    pub fn inlined(&self, pattern: &str, file: &str) -> anyhow::Result<Vec<InlinedCopy>> {
        let info = self.file.load()?;
        let names = Index::load_or_build(&info, &self.cache, Layer::Names, &|_, _| {})?;
        // The declaring file is the abstract function's; an instance records its call site.
        let declared: std::collections::HashMap<&str, (&str, u32)> = names
            .functions(
                &format!("{pattern}@{file}"),
                &[EntryKind::Abstract, EntryKind::Function],
            )
            .into_iter()
            .map(|f| (f.name, (f.file, f.line)))
            .collect();
        let inlines = Index::load_or_build(&info, &self.cache, Layer::Inlines, &|_, _| {})?;
        let mut out: Vec<InlinedCopy> = inlines
            .functions(pattern, &[EntryKind::Inlined])
            .into_iter()
            .filter(|e| e.low != 0)
            .filter_map(|e| {
                let (decl_file, decl_line) = match declared.get(e.name) {
                    Some(d) => *d,
                    // Matched by name but declared elsewhere: out when a file was asked for.
                    None if file != "*" => return None,
                    None => ("", 0),
                };
                Some(InlinedCopy {
                    name: e.name.to_owned(),
                    file: decl_file.to_owned(),
                    line: if decl_line == u32::MAX { 0 } else { decl_line },
                    call_file: e.file.to_owned(),
                    call_line: e.line,
                    entry: e.low,
                })
            })
            .collect();
        out.sort_by(|a, b| (a.entry, &a.name).cmp(&(b.entry, &b.name)));
        out.dedup_by(|a, b| a.entry == b.entry && a.name == b.name);
        Ok(out)
    }

    /// The instructions that access `member` of `structure` (`struct file`, `f_pos`) the
    /// way `access` asks (a read-modify-write counts as both), by address: KLAS's join
    /// points, found in every function by introspect's analysis (`exotap joinpoints`). Each
    /// is `(address, "<function+offset>")`.
    ///
    /// # Errors
    /// A query that is not a struct and member name, or unreadable DWARF.
    pub fn field_accesses(
        &self,
        structure: &str,
        member: &str,
        access: crate::point::FieldAccess,
    ) -> anyhow::Result<Vec<(u64, String)>> {
        use crate::point::FieldAccess;
        use exotap_introspect::dwarf::klas::{self, Access, MemberQuery};
        let query = MemberQuery::parse(&format!("{structure}.{member}"))?;
        let info = self.file.load()?;
        let names = Index::load_or_build(&info, &self.cache, Layer::Names, &|_, _| {})?;
        let points =
            klas::join_points_cached(self.file.bytes(), &names, &query, &self.cache, &|_, _| {})?;
        Ok(points
            .into_iter()
            .filter(|p| match access {
                FieldAccess::Read => matches!(p.access, Access::Read | Access::ReadWrite),
                FieldAccess::Write => matches!(p.access, Access::Write | Access::ReadWrite),
                FieldAccess::Call => p.access == Access::Call,
            })
            .map(|p| (p.addr, p.function))
            .collect())
    }

    /// Every line of `f`'s own file that has code in `f`'s main range, with the lowest
    /// `is_stmt` address of each (stap's `:*`), by line.
    ///
    /// # Errors
    /// Unreadable DWARF.
    pub fn function_lines(&self, f: &SourceFunction) -> anyhow::Result<Vec<(u32, u64)>> {
        let info = self.file.load()?;
        let table = info.line_table_at(f.low)?;
        let mut lines: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
        for (path, row) in table.rows_in(f.low, f.high) {
            if row.is_stmt && path == f.file {
                let e = lines.entry(row.line).or_insert(row.addr);
                *e = (*e).min(row.addr);
            }
        }
        Ok(lines.into_iter().collect())
    }

    /// Where `line` of `file` (a trailing path, no globs) begins: every `is_stmt` row of the
    /// line tables for exactly that line, or, when it has none, the next line that has code.
    ///
    /// # Errors
    /// Unreadable DWARF or index.
    pub fn line(&self, file: &str, line: u32) -> anyhow::Result<LineSites> {
        let info = self.file.load()?;
        let names = Index::load_or_build(&info, &self.cache, Layer::Names, &|_, _| {})?;
        // introspect falls forward to the next line with code (gdb's choice); a probe on a
        // line with no code is an error instead, naming that line.
        let sites = info.line_addresses(&names, file, line)?;
        let exact: Vec<(String, u64)> = sites
            .iter()
            .filter(|(_, l, _)| *l == line)
            .map(|(f, _, a)| (f.clone(), *a))
            .collect();
        if exact.is_empty() {
            let next = sites.iter().map(|(_, l, _)| *l).filter(|l| *l > line).min();
            return Ok(LineSites::NoCode { next });
        }
        Ok(LineSites::Code(exact))
    }
}

/// Checked against gdb on the cached -dbg vmlinux of the default guest kernel.
#[cfg(test)]
mod tests {
    use std::process::Command;

    use crate::kernel_points::KernelSymbols;
    use crate::resolve::{list, ResolveError, ResolvedPoint};
    use exotap_probes_base::kernel_image::KernelImage;

    /// The cached kernel and its -dbg vmlinux; `None` (after saying why) when either is not
    /// cached. One that is there but does not load or open panics: a failure, not a skip.
    fn kernel() -> Option<(KernelImage, super::SourceLines)> {
        let Some(image) = exotap_probes_base::kernel_image::cached_debian_image() else {
            println!("SKIP: the default guest kernel is not cached (exotap image fetch)");
            return None;
        };
        // Where exotap image fetch --debuginfo puts it (live::target_vars::source_lines, which
        // logs an open failure and gives None, is not used: that would skip a broken file).
        let dir = image.path.with_file_name("debug");
        if !(dir.join("manifest.json").is_file() && dir.join("vmlinux").is_file()) {
            println!("SKIP: no cached -dbg vmlinux (exotap image fetch --debuginfo)");
            return None;
        }
        let cache = image
            .path
            .ancestors()
            .nth(3)
            .expect("the cache holds the kernel three levels down")
            .join("debuginfo");
        let lines = super::SourceLines::open(&dir.join("vmlinux"), &cache).unwrap_or_else(|e| {
            panic!(
                "the cached -dbg vmlinux {} does not open: {e:#}",
                dir.join("vmlinux").display()
            )
        });
        Some((image, lines))
    }

    /// gdb's output for `commands` on `vmlinux`; `None` (after saying why) when gdb is not
    /// installed. Panics when gdb cannot be run otherwise or runs and fails.
    fn gdb(vmlinux: &std::path::Path, commands: &[String]) -> Option<String> {
        let mut cmd = Command::new("gdb");
        cmd.args(["-nx", "-batch"]);
        for c in commands {
            cmd.arg("-ex").arg(c);
        }
        match cmd.arg(vmlinux).output() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("SKIP: gdb is not installed; the comparison with gdb is skipped");
                None
            }
            Err(e) => panic!("cannot run gdb: {e}"),
            Ok(out) => {
                assert!(
                    out.status.success(),
                    "gdb -batch on {} failed ({}):\n{}",
                    vmlinux.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                Some(String::from_utf8_lossy(&out.stdout).into())
            }
        }
    }

    fn resolve(
        image: &KernelImage,
        lines: &super::SourceLines,
        point: &str,
    ) -> Result<Vec<ResolvedPoint>, String> {
        list(
            point,
            &KernelSymbols::new(&image.symbols, None).with_lines(Some(lines)),
        )
        .map_err(|e| e.to_string())
    }

    /// `kernel.function("F").inline` is at one place per location of gdb's `break F` (gdb
    /// puts a breakpoint on every inlined instance), each within a few instructions of gdb's
    /// address: gdb skips an instance's prologue, or takes the start of its first range where
    /// GCC's `DW_AT_entry_pc` names a later one; exotap takes the entry pc, as elfutils'
    /// `dwarf_entrypc` (SystemTap) does. A file filter keeps the function's declaring file,
    /// not the callers'.
    #[test]
    fn inlined_instances_are_the_locations_of_gdbs_breakpoint() {
        let Some((image, lines)) = kernel() else {
            return;
        };
        let functions = ["file_ppos", "fdget_pos", "fdput_pos"];
        let commands: Vec<String> = functions
            .iter()
            .map(|f| format!("break {f}"))
            .chain(["info breakpoints".to_owned()])
            .collect();
        let Some(out) = gdb(lines.path(), &commands) else {
            return;
        };
        for (n, f) in functions.iter().enumerate() {
            // "1.3    y   0xffffffff8134a506 in file_ppos at fs/read_write.c:599"
            let gdb_at: Vec<u64> = out
                .lines()
                .filter(|l| l.trim_start().starts_with(&format!("{}.", n + 1)))
                .filter(|l| l.contains(&format!(" in {f} at ")))
                .filter_map(|l| l.split_whitespace().find(|w| w.starts_with("0x")))
                .map(|w| u64::from_str_radix(&w[2..], 16).unwrap())
                .collect();
            assert!(gdb_at.len() >= 2, "{f}: gdb found {gdb_at:?} in:\n{out}");
            let found = resolve(&image, &lines, &format!(r#"kernel.function("{f}").inline"#));
            // -l lists the name once; the points themselves are one per instance.
            assert_eq!(found.as_ref().map(Vec::len), Ok(1), "{f}: {found:?}");
            let copies = lines.inlined(f, "*").unwrap();
            assert_eq!(
                copies.len(),
                gdb_at.len(),
                "{f}: {copies:?} vs gdb {gdb_at:x?}"
            );
            for at in &gdb_at {
                assert!(
                    copies.iter().any(|c| c.entry.abs_diff(*at) < 32),
                    "{f}: gdb's location {at:#x} is not at an instance entry: {copies:?}"
                );
            }
            assert!(copies.iter().all(|c| c.name == *f), "{f}: {copies:?}");
        }
        // file_ppos is declared in fs/read_write.c, fdget_pos in include/linux/file.h.
        assert_eq!(
            lines.inlined("file_ppos", "fs/read_write.c").unwrap().len(),
            4
        );
        assert!(lines
            .inlined("fdget_pos", "fs/read_write.c")
            .unwrap()
            .is_empty());
        assert!(!lines.inlined("fdget_pos", "file.h").unwrap().is_empty());
    }

    /// For every line of fs/read_write.c 450-500 where gdb's `info line` says "starts at
    /// address A <func+off>", the statement probe is at A (the line's first address) and
    /// `kernel.function("*@fs/read_write.c:LINE")` is func.
    #[test]
    fn statement_lines_begin_where_gdb_says_they_start() {
        let Some((image, lines)) = kernel() else {
            return;
        };
        let commands: Vec<String> = (450..=500)
            .map(|l| format!("info line fs/read_write.c:{l}"))
            .collect();
        let Some(out) = gdb(lines.path(), &commands) else {
            return;
        };
        let mut compared = 0;
        for text in out.lines().filter(|l| l.contains(" starts at address ")) {
            // Line 456 of "fs/read_write.c" starts at address 0xffffffff81349981 <vfs_read+49> and ...
            let line: u32 = text.split(' ').nth(1).unwrap().parse().unwrap();
            let after = text.split(" starts at address ").nth(1).unwrap();
            let addr = u64::from_str_radix(after[2..].split(' ').next().unwrap(), 16).unwrap();
            let func = after.split('<').nth(1).unwrap();
            let func = func.split(['+', '>']).next().unwrap();

            let found = resolve(
                &image,
                &lines,
                &format!(r#"kernel.statement("*@fs/read_write.c:{line}")"#),
            )
            .unwrap();
            let lowest = found.iter().filter_map(|p| p.address).min();
            assert_eq!(lowest, Some(addr), "line {line}: {found:?} vs gdb: {text}");
            let funcs = resolve(
                &image,
                &lines,
                &format!(r#"kernel.function("*@fs/read_write.c:{line}")"#),
            )
            .unwrap();
            assert!(
                funcs
                    .iter()
                    .any(|p| p.name.starts_with(&format!("kernel.function(\"{func}@"))),
                "line {line}: {funcs:?} vs gdb: {text}"
            );
            compared += 1;
        }
        println!("{compared} lines of fs/read_write.c 450-500 start where gdb says");
        assert!(
            compared >= 5,
            "gdb gave only {compared} lines with code:\n{out}"
        );
    }

    /// `vfs_*@fs/read_write.c` (and the shorter `@read_write.c`) is the list gdb's `info
    /// functions ^vfs_` gives under "File fs/read_write.c:", declaration lines included.
    #[test]
    fn file_filter_keeps_the_functions_gdb_lists_for_the_file() {
        let Some((image, lines)) = kernel() else {
            return;
        };
        let Some(out) = gdb(lines.path(), &["info functions ^vfs_".to_owned()]) else {
            return;
        };
        let mut in_file = false;
        let mut expected: Vec<String> = Vec::new();
        for l in out.lines() {
            if l.starts_with("File ") {
                in_file = l == "File fs/read_write.c:";
            } else if in_file && !l.trim().is_empty() {
                // 450:	ssize_t vfs_read(struct file *, char *, size_t, loff_t *);
                let (line, decl) = l.split_once(':').unwrap();
                let name = decl
                    .split('(')
                    .next()
                    .unwrap()
                    .rsplit([' ', '*'])
                    .next()
                    .unwrap();
                expected.push(format!(
                    r#"kernel.function("{name}@fs/read_write.c:{line}")"#
                ));
            }
        }
        expected.sort();

        for point in [
            r#"kernel.function("vfs_*@fs/read_write.c")"#,
            r#"kernel.function("vfs_*@read_write.c")"#,
            r#"kernel.function("vfs_*@fs/read_wri*.c")"#,
        ] {
            let mut ours: Vec<String> = resolve(&image, &lines, point)
                .unwrap()
                .into_iter()
                .map(|p| p.name)
                .collect();
            ours.sort();
            assert_eq!(ours, expected, "{point}");
        }
        assert!(expected.len() >= 5, "{out}");
    }

    #[test]
    fn a_line_without_code_names_the_next_line_with_code_and_a_range_takes_each_line() {
        let Some((image, lines)) = kernel() else {
            return;
        };
        // 450 is vfs_read's signature line; its body's first statement (line 451) has code.
        let err = resolve(
            &image,
            &lines,
            r#"kernel.statement("*@fs/read_write.c:450")"#,
        )
        .unwrap_err();
        assert!(
            err.contains("line 450 of fs/read_write.c has no code; the next line with code is 451"),
            "{err}"
        );

        let one = |l: u32| {
            resolve(
                &image,
                &lines,
                &format!(r#"kernel.statement("vfs_read@fs/read_write.c:{l}")"#),
            )
            .unwrap()
        };
        let both = resolve(
            &image,
            &lines,
            r#"kernel.statement("vfs_read@fs/read_write.c:461-462")"#,
        )
        .unwrap();
        // One probe per function: the range's lowest address.
        assert_eq!(both.len(), 1);
        assert_eq!(
            both[0].address,
            one(461)[0].address.min(one(462)[0].address)
        );
    }

    /// `:*` lists every line of the function once, inside it, and includes the line gdb's
    /// `info line do_sys_open` gives for its entry, at gdb's address.
    #[test]
    fn every_line_of_a_function_includes_gdbs_entry_line() {
        let Some((image, lines)) = kernel() else {
            return;
        };
        let Some(out) = gdb(lines.path(), &["info line do_sys_open".to_owned()]) else {
            return;
        };
        // Line 1334 of "fs/open.c" starts at address 0xffffffff81347520 <do_sys_open> and ...
        // (then the lines of its inlined copies in the syscalls).
        let Some(text) = out.lines().find(|l| l.contains(" <do_sys_open> ")) else {
            panic!("gdb names no out-of-line do_sys_open: {out}");
        };
        let line: u32 = text.split(' ').nth(1).unwrap().parse().unwrap();
        let addr = text.split(" starts at address 0x").nth(1).unwrap();
        let addr = u64::from_str_radix(addr.split(' ').next().unwrap(), 16).unwrap();

        let found = resolve(
            &image,
            &lines,
            r#"kernel.statement("do_sys_open@fs/open.c:*")"#,
        )
        .unwrap();

        let entry = format!("kernel.statement(\"do_sys_open@fs/open.c:{line}\") (do_sys_open+0x0)");
        assert!(
            found
                .iter()
                .any(|p| p.name == entry && p.address == Some(addr)),
            "{found:?} vs gdb: {out}"
        );
        assert!(found.len() >= 3, "{found:?}");
        let mut names: Vec<&str> = found.iter().map(|p| p.name.as_str()).collect();
        names.dedup();
        assert_eq!(names.len(), found.len());
    }

    #[test]
    fn without_the_debug_vmlinux_a_source_line_says_how_to_get_it() {
        let symbols = exotap_introspect::symbols::SymbolTable::new(Vec::new());
        let err = list(
            r#"kernel.statement("*@fs/read_write.c:500")"#,
            &KernelSymbols::new(&symbols, None),
        )
        .unwrap_err();
        assert!(matches!(
            err,
            crate::resolve::ListError::Resolve(ResolveError::NoDebugInfo { .. })
        ));
        assert!(
            err.to_string().contains("exotap image fetch --debuginfo"),
            "{err}"
        );
    }
}
