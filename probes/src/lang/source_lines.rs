//! Source positions of the guest kernel from its -dbg vmlinux (DWARF): the functions a
//! source file defines and the addresses where a source line begins, for the `@FILE` and
//! `:LINE` filters of `kernel.function(...)` and `kernel.statement(...)`.
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
