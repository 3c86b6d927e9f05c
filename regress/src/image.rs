//! Loading a statically linked ELF kernel image (a mini-kernel): its loadable segments and
//! its symbols, with the checks guest data needs (no trust in sizes or offsets).

use std::path::Path;

use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};

/// Errors of loading an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The file cannot be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not an ELF the loader understands.
    #[error("{path} is not a usable ELF image: {why}")]
    Parse {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
    /// A symbol the harness needs is missing.
    #[error("{path} has no symbol {name}")]
    MissingSymbol {
        /// The file.
        path: String,
        /// The symbol.
        name: String,
    },
}

/// One loadable segment.
#[derive(Debug, Clone)]
pub struct Segment {
    /// Its virtual address.
    pub addr: u64,
    /// Its size in memory (the rest past `data` is zero).
    pub size: u64,
    /// Its initialized bytes.
    pub data: Vec<u8>,
    /// Whether it is executable.
    pub exec: bool,
}

/// A symbol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symbol {
    /// Its name.
    pub name: String,
    /// Its address.
    pub addr: u64,
    /// Its size (0 when unknown).
    pub size: u64,
}

/// A loaded image.
#[derive(Debug, Clone)]
pub struct ElfImage {
    /// Where it came from.
    pub path: String,
    /// Its entry point.
    pub entry: u64,
    /// Its loadable segments, by address.
    pub segments: Vec<Segment>,
    /// Its symbols (functions, objects and plain labels), by address.
    pub symbols: Vec<Symbol>,
}

impl ElfImage {
    /// Loads an ELF file.
    ///
    /// # Errors
    /// Unreadable or malformed files.
    pub fn load(path: &Path) -> Result<Self, ImageError> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| ImageError::Read {
            path: name.clone(),
            source,
        })?;
        Self::parse(&name, &bytes)
    }

    /// Parses ELF bytes.
    ///
    /// # Errors
    /// Malformed files.
    pub fn parse(name: &str, bytes: &[u8]) -> Result<Self, ImageError> {
        let bad = |why: String| ImageError::Parse {
            path: name.to_owned(),
            why,
        };
        let file = object::File::parse(bytes).map_err(|e| bad(e.to_string()))?;
        let mut segments = Vec::new();
        for seg in file.segments() {
            let data = seg.data().map_err(|e| bad(e.to_string()))?.to_vec();
            let size = seg.size();
            if size == 0 {
                continue;
            }
            if (data.len() as u64) > size || seg.address().checked_add(size).is_none() {
                return Err(bad(format!(
                    "segment at {:#x} is inconsistent",
                    seg.address()
                )));
            }
            let exec = match seg.flags() {
                object::SegmentFlags::Elf { p_flags } => p_flags & object::elf::PF_X != 0,
                _ => false,
            };
            segments.push(Segment {
                addr: seg.address(),
                size,
                data,
                exec,
            });
        }
        segments.sort_by_key(|s| s.addr);
        if segments.is_empty() {
            return Err(bad("no loadable segments".into()));
        }
        let mut symbols: Vec<Symbol> = file
            .symbols()
            .filter(|s| {
                !matches!(
                    s.kind(),
                    SymbolKind::Section | SymbolKind::File | SymbolKind::Tls
                ) && !s.is_undefined()
            })
            .filter_map(|s| {
                Some(Symbol {
                    name: s.name().ok()?.to_owned(),
                    addr: s.address(),
                    size: s.size(),
                })
            })
            .filter(|s| !s.name.is_empty())
            .collect();
        symbols.sort_by_key(|s| s.addr);
        Ok(Self {
            path: name.to_owned(),
            entry: file.entry(),
            segments,
            symbols,
        })
    }

    /// The address of a symbol.
    ///
    /// # Errors
    /// [`ImageError::MissingSymbol`].
    pub fn symbol(&self, name: &str) -> Result<u64, ImageError> {
        self.symbols
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.addr)
            .ok_or_else(|| ImageError::MissingSymbol {
                path: self.path.clone(),
                name: name.to_owned(),
            })
    }

    /// The executable segment (the text). Mini-kernels have exactly one.
    #[must_use]
    pub fn text(&self) -> Option<&Segment> {
        self.segments.iter().find(|s| s.exec)
    }

    /// Start addresses of the symbols inside the text: the function boundaries.
    #[must_use]
    pub fn text_symbol_starts(&self) -> Vec<u64> {
        let Some(text) = self.text() else {
            return Vec::new();
        };
        self.symbols
            .iter()
            .map(|s| s.addr)
            .filter(|&a| a >= text.addr && a < text.addr + text.data.len() as u64)
            .collect()
    }
}
