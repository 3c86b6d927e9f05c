//! Real kernel functions: the Debian vmlinux (with symbols, from the -dbg package) mapped
//! at its link address in Unicorn, and library functions (string and memory helpers,
//! CRCs, bitmaps, sort, bsearch, rbtree and list walks, number parsing) called one by
//! one with arguments in a scratch area, each under the same splice/trap sweep as the
//! mini-kernel.
//!
//! The image runs as linked: alternatives, static calls and ftrace sites are not
//! patched (so `call __fentry__` and `jmp __x86_return_thunk` run as the linker left
//! them), and the planner gets no self-patched or exception-table sites (nothing patches
//! or faults here). The stack protector reads `%gs:0x28`: the per-CPU segment is mapped
//! at 0 with GS base 0. What is compared: the return value and every register, the
//! scratch area and the live stack. The kernel's own data is not compared (the chosen
//! functions do not write it).
//!
//! `exotap regress --functions FILE` sweeps the functions a file names instead
//! ([`read_function_list`], [`regress_functions`]); one outside `CALLS` gets generic
//! arguments (see `generic_setup`).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Instant;

use exotap_introspect::x86::{AnalysisConfig, CodeView, FunctionRange, TextAnalysis};
use exotap_probes::splice::SpliceContext;
use exotap_vmm::control::X86Registers;
use object::{Object, ObjectSegment, ObjectSymbol};

mod entries;
mod jit;

pub use jit::regress_jit;

use crate::x86::{sweep, Harness, Region};
use crate::{Options, RegressError, Report};

const PAGE: u64 = 0x1000;
/// Scratch area for arguments and stubs: 256 MiB into the kernel's text mapping, past any
/// image and its patch heap (6.12's image alone reaches 0xffff_ffff_8420_0000, over the
/// 0xffff_ffff_8400_0000 this once was), within rel32 reach of the image.
const SCRATCH: u64 = 0xffff_ffff_9000_0000;
const SCRATCH_SIZE: usize = 0x1_0000;

/// A bump allocator over the scratch area's initial contents.
#[derive(Debug)]
struct Scratch {
    bytes: Vec<u8>,
    next: usize,
}

impl Scratch {
    fn new() -> Self {
        let mut s = Self {
            bytes: vec![0; SCRATCH_SIZE],
            next: 0,
        };
        // 0: hlt (the return address of every call); 0x10: int cmp(const u32 *a, const
        // u32 *b) { return *a - *b; }; 0x20: the list_sort comparator on a u32 at +16.
        s.bytes[0] = 0xf4;
        s.bytes[0x10..0x15].copy_from_slice(&[0x8b, 0x07, 0x2b, 0x06, 0xc3]);
        s.bytes[0x20..0x27].copy_from_slice(&[0x8b, 0x46, 0x10, 0x2b, 0x42, 0x10, 0xc3]);
        s.next = 0x100;
        s
    }

    const HALT: u64 = SCRATCH;
    const CMP_U32: u64 = SCRATCH + 0x10;
    const CMP_LIST: u64 = SCRATCH + 0x20;

    fn alloc(&mut self, n: usize) -> u64 {
        let at = self.next.next_multiple_of(16);
        self.next = at + n;
        SCRATCH + at as u64
    }

    fn put(&mut self, data: &[u8]) -> u64 {
        let at = self.alloc(data.len());
        let off = (at - SCRATCH) as usize;
        self.bytes[off..off + data.len()].copy_from_slice(data);
        at
    }

    fn str(&mut self, s: &str) -> u64 {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.put(&v)
    }

    fn u64s(&mut self, v: &[u64]) -> u64 {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.put(&bytes)
    }

    fn u32s(&mut self, v: &[u32]) -> u64 {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.put(&bytes)
    }

    fn write_u64(&mut self, at: u64, v: u64) {
        let off = (at - SCRATCH) as usize;
        self.bytes[off..off + 8].copy_from_slice(&v.to_le_bytes());
    }
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 37 + 11) as u8).collect()
}

/// A balanced rbtree of `n` nodes (`rb_node`: parent|color, right, left), the root
/// pointer first; returns (root pointer address, the leftmost node).
fn rbtree(s: &mut Scratch, n: usize) -> (u64, u64) {
    let root = s.alloc(8);
    let nodes: Vec<u64> = (0..n).map(|_| s.alloc(24)).collect();
    fn build(s: &mut Scratch, nodes: &[u64], lo: usize, hi: usize, parent: u64, depth: u32) -> u64 {
        if lo >= hi {
            return 0;
        }
        let mid = (lo + hi) / 2;
        let node = nodes[mid];
        // Red at depth 3 (a valid colouring for 7..15 nodes), black elsewhere.
        let color = u64::from(depth == 3);
        let left = build(s, nodes, lo, mid, node, depth + 1);
        let right = build(s, nodes, mid + 1, hi, node, depth + 1);
        s.write_u64(node, parent | color);
        s.write_u64(node + 8, right);
        s.write_u64(node + 16, left);
        node
    }
    let top = build(s, &nodes, 0, n, 0, 0);
    s.write_u64(root, top);
    (root, nodes[0])
}

/// A circular list of nodes {list_head (16 bytes), u32 value}; returns the head.
fn list(s: &mut Scratch, values: &[u32]) -> u64 {
    let head = s.alloc(16);
    let nodes: Vec<u64> = values
        .iter()
        .map(|v| {
            let n = s.alloc(24);
            let off = (n + 16 - SCRATCH) as usize;
            s.bytes[off..off + 4].copy_from_slice(&v.to_le_bytes());
            n
        })
        .collect();
    let all: Vec<u64> = std::iter::once(head).chain(nodes).collect();
    for (i, &n) in all.iter().enumerate() {
        let next = all[(i + 1) % all.len()];
        let prev = all[(i + all.len() - 1) % all.len()];
        s.write_u64(n, next);
        s.write_u64(n + 8, prev);
    }
    head
}

/// A call: the function and how to set up its arguments.
type Setup = fn(&mut Scratch) -> [u64; 5];

/// The functions called, with their arguments. Each is a real kernel library function.
const CALLS: &[(&str, Setup)] = &[
    ("strlen", |s| [s.str("the quick brown fox"), 0, 0, 0, 0]),
    ("strnlen", |s| [s.str("jumps over"), 5, 0, 0, 0]),
    ("strcmp", |s| [s.str("kernel"), s.str("kernal"), 0, 0, 0]),
    ("strncmp", |s| [s.str("exotap"), s.str("exotic"), 4, 0, 0]),
    ("strcpy", |s| {
        [s.alloc(32), s.str("copy me please"), 0, 0, 0]
    }),
    ("strscpy", |s| {
        [s.alloc(32), s.str("truncated string"), 8, 0, 0]
    }),
    ("strchr", |s| {
        [s.str("hello world"), u64::from(b'o'), 0, 0, 0]
    }),
    ("strrchr", |s| {
        [s.str("hello world"), u64::from(b'o'), 0, 0, 0]
    }),
    ("strstr", |s| {
        [s.str("needle in a haystack"), s.str("hay"), 0, 0, 0]
    }),
    ("strspn", |s| [s.str("abcabcxyz"), s.str("abc"), 0, 0, 0]),
    ("strcspn", |s| [s.str("abcabcxyz"), s.str("yx"), 0, 0, 0]),
    ("strpbrk", |s| [s.str("abcabcxyz"), s.str("zy"), 0, 0, 0]),
    ("memcmp", |s| {
        let a = pattern(100);
        let mut b = a.clone();
        b[77] ^= 1;
        [s.put(&a), s.put(&b), 100, 0, 0]
    }),
    ("memchr", |s| {
        [
            s.put(&pattern(200)),
            u64::from(pattern(200)[150]),
            200,
            0,
            0,
        ]
    }),
    ("memscan", |s| {
        [s.put(&pattern(200)), u64::from(pattern(200)[99]), 200, 0, 0]
    }),
    ("crc16", |s| [0xffff, s.put(&pattern(96)), 96, 0, 0]),
    ("crc_ccitt", |s| [0, s.put(&pattern(96)), 96, 0, 0]),
    ("crc_itu_t", |s| [0, s.put(&pattern(96)), 96, 0, 0]),
    ("__bitmap_weight", |s| {
        [
            s.u64s(&[0xdead_beef_0123_4567, 0xffff_0000_ffff_0000, 0x5555, 0x1]),
            200,
            0,
            0,
            0,
        ]
    }),
    ("__bitmap_and", |s| {
        let a = s.u64s(&[0xf0f0_f0f0_f0f0_f0f0, 0xffff, u64::MAX, 7]);
        let b = s.u64s(&[0xff00_ff00_ff00_ff00, 0x00ff, 0x1234, 5]);
        [s.alloc(32), a, b, 200, 0]
    }),
    ("__bitmap_or", |s| {
        let a = s.u64s(&[0xf0f0_f0f0_f0f0_f0f0, 0xffff, 0, 7]);
        let b = s.u64s(&[0xff00_ff00_ff00_ff00, 0x00ff, 0x1234, 5]);
        [s.alloc(32), a, b, 250, 0]
    }),
    ("_find_next_bit", |s| {
        [s.u64s(&[0, 0, 0x100, 1]), 256, 10, 0, 0]
    }),
    ("_find_first_bit", |s| {
        [s.u64s(&[0, 0, 0, 0x8000]), 256, 0, 0, 0]
    }),
    ("_find_first_zero_bit", |s| {
        [s.u64s(&[u64::MAX, u64::MAX, 0xff, 0]), 256, 0, 0, 0]
    }),
    ("sort", |s| {
        let v: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % 101).collect();
        [s.u32s(&v), 40, 4, Scratch::CMP_U32, 0]
    }),
    ("bsearch", |s| {
        let v: Vec<u32> = (0..64u32).map(|i| i * 3).collect();
        [s.u32s(&[111]), s.u32s(&v), 64, 4, Scratch::CMP_U32]
    }),
    ("list_sort", |s| {
        let v: Vec<u32> = (0..24u32).map(|i| (i * 37 + 5) % 29).collect();
        [0, list(s, &v), Scratch::CMP_LIST, 0, 0]
    }),
    ("rb_first", |s| [rbtree(s, 15).0, 0, 0, 0, 0]),
    ("rb_next", |s| {
        let (_, first) = rbtree(s, 15);
        [first, 0, 0, 0, 0]
    }),
    ("rb_last", |s| [rbtree(s, 15).0, 0, 0, 0, 0]),
    ("int_sqrt", |_| [1_000_000_007, 0, 0, 0, 0]),
    ("gcd", |_| [1071 * 4096, 462 * 4096, 0, 0, 0]),
    ("lcm", |_| [84, 120, 0, 0, 0]),
    ("skip_spaces", |s| [s.str("   \t  text"), 0, 0, 0, 0]),
    ("strim", |s| [s.str("  padded both ends   "), 0, 0, 0, 0]),
    ("kstrtoull", |s| [s.str("0x1234abcd"), 0, s.alloc(8), 0, 0]),
    ("simple_strtoull", |s| {
        [s.str("98765xyz"), s.alloc(8), 10, 0, 0]
    }),
    ("hex2bin", |s| {
        [
            s.alloc(16),
            s.str("00112233445566778899aabbccddeeff"),
            16,
            0,
            0,
        ]
    }),
    ("bin2hex", |s| [s.alloc(64), s.put(&pattern(24)), 24, 0, 0]),
    ("__sw_hweight64", |_| [0x0123_4567_89ab_cdef, 0, 0, 0, 0]),
    ("__sw_hweight32", |_| [0xf0f0_1234, 0, 0, 0, 0]),
    // Arithmetic of lib/math and kernel/time whose entry is an ftrace site (most of lib/ is
    // built without one): the entry patches of `time`, `trace`, `nullify` and `replace`
    // splice there (entries.rs).
    ("int_pow", |_| [7, 13, 0, 0, 0]),
    ("reciprocal_value", |_| [1_000_003, 0, 0, 0, 0]),
    ("jiffies_to_msecs", |_| [123_456, 0, 0, 0, 0]),
    ("jiffies_to_usecs", |_| [123_456, 0, 0, 0, 0]),
    ("__msecs_to_jiffies", |_| [98_765, 0, 0, 0, 0]),
    ("__usecs_to_jiffies", |_| [98_765_432, 0, 0, 0, 0]),
    ("mktime64", |_| [2026, 11, 30, 4, 5]),
    ("ns_to_timespec64", |_| [3_141_592_653_589, 0, 0, 0, 0]),
    ("ns_to_kernel_old_timeval", |_| {
        [2_718_281_828_459, 0, 0, 0, 0]
    }),
    ("jiffies_to_clock_t", |_| [250_000, 0, 0, 0, 0]),
    ("nsec_to_clock_t", |_| [5_000_000_000, 0, 0, 0, 0]),
    ("clock_t_to_jiffies", |_| [4_321, 0, 0, 0, 0]),
    ("nsecs_to_jiffies64", |_| [7_000_000_123, 0, 0, 0, 0]),
    ("timespec64_to_jiffies", |s| {
        [s.u64s(&[12, 345_678_901]), 0, 0, 0, 0]
    }),
];

/// Bytes of each zero-filled buffer that a function outside [`CALLS`] gets as an argument.
const GENERIC_BUFFER: usize = 1024;

/// Arguments for a listed function that [`CALLS`] does not describe: each of the five
/// argument registers points at its own zero-filled buffer. A string argument is then
/// empty, a structure all zero, an output buffer writable; a count or flag argument gets a
/// kernel address, which may send the function past the scratch area: its unprobed call
/// then does not return and the function is reported skipped, not swept.
fn generic_setup(s: &mut Scratch) -> [u64; 5] {
    [(); 5].map(|()| s.alloc(GENERIC_BUFFER))
}

/// The functions the sweep calls by default (those of `CALLS`), each with arguments set
/// up for it.
#[must_use]
pub fn builtin_functions() -> Vec<&'static str> {
    CALLS.iter().map(|c| c.0).collect()
}

/// Errors of a function list (`exotap regress --functions FILE`).
#[derive(Debug, thiserror::Error)]
pub enum FunctionListError {
    /// The file cannot be read.
    #[error("cannot read the function list {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A line holds something other than one symbol name.
    #[error(
        "line {line}: `{text}` is not a function name (one name per line, `#` starts a comment)"
    )]
    NotAName {
        /// The line number, from 1.
        line: usize,
        /// The line's text without its comment.
        text: String,
    },
    /// A name is listed twice.
    #[error("line {line}: `{name}` is already listed on line {first}")]
    Duplicate {
        /// The line number of the repetition, from 1.
        line: usize,
        /// The name.
        name: String,
        /// The line number of the first listing.
        first: usize,
    },
    /// Nothing but comments and blank lines.
    #[error("the function list names no function")]
    Empty,
}

/// Whether `name` can be an ELF symbol of a kernel function (`foo`, `foo.constprop.0`).
fn is_symbol_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
}

/// Parses a function list: one name per line; `#` starts a comment (on its own line or
/// after a name); blank lines are ignored.
///
/// # Errors
/// A line that is not one symbol name, a name listed twice, or no name at all.
pub fn parse_function_list(text: &str) -> Result<Vec<String>, FunctionListError> {
    let mut names: Vec<String> = Vec::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let content = raw.split_once('#').map_or(raw, |(before, _)| before).trim();
        if content.is_empty() {
            continue;
        }
        if !is_symbol_name(content) {
            return Err(FunctionListError::NotAName {
                line,
                text: content.chars().take(80).collect(),
            });
        }
        if let Some(&first) = first_line.get(content) {
            return Err(FunctionListError::Duplicate {
                line,
                name: content.to_owned(),
                first,
            });
        }
        first_line.insert(content.to_owned(), line);
        names.push(content.to_owned());
    }
    if names.is_empty() {
        return Err(FunctionListError::Empty);
    }
    Ok(names)
}

/// Reads and parses a function list file (see [`parse_function_list`]).
///
/// # Errors
/// An unreadable file, or as [`parse_function_list`].
pub fn read_function_list(path: &Path) -> Result<Vec<String>, FunctionListError> {
    let text = std::fs::read_to_string(path).map_err(|source| FunctionListError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_function_list(&text)
}

/// Why a listed function cannot be swept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unusable {
    /// No symbol of that name.
    NotInVmlinux,
    /// Only data symbols of that name.
    NotCode,
    /// The symbol has size 0.
    NoSize,
    /// The function lies outside the text segment the sweep analyses.
    OutsideText,
    /// Several functions at different addresses have the name.
    Ambiguous(usize),
    /// Another listed name is the same function.
    AliasOf(String),
}

impl fmt::Display for Unusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotInVmlinux => f.write_str("no symbol of that name in the vmlinux"),
            Self::NotCode => f.write_str("a data symbol, not a function"),
            Self::NoSize => {
                f.write_str("its symbol has no size, so the sweep cannot tell where it ends")
            }
            Self::OutsideText => f.write_str(
                "outside the kernel's main text segment (init or entry code), which the sweep does not load as code",
            ),
            Self::Ambiguous(n) => write!(
                f,
                "{n} functions at different addresses have this name (static functions of different files)"
            ),
            Self::AliasOf(other) => write!(f, "the same function as `{other}`, listed before"),
        }
    }
}

/// A listed function the sweep cannot call, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnusableFunction {
    /// The name as listed.
    pub name: String,
    /// Why.
    pub why: Unusable,
}

impl fmt::Display for UnusableFunction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.why)
    }
}

/// One ELF symbol of a wanted name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SymbolFact {
    addr: u64,
    size: u64,
    code: bool,
}

/// Where the function `name` lies, from the symbols of that name and the text segment.
fn resolve(facts: &[SymbolFact], text: &Range<u64>) -> Result<FunctionRange, Unusable> {
    if facts.is_empty() {
        return Err(Unusable::NotInVmlinux);
    }
    let mut code: Vec<SymbolFact> = facts.iter().copied().filter(|f| f.code).collect();
    if code.is_empty() {
        return Err(Unusable::NotCode);
    }
    code.sort_by_key(|f| (f.addr, std::cmp::Reverse(f.size)));
    code.dedup_by_key(|f| f.addr);
    let [only] = code.as_slice() else {
        return Err(Unusable::Ambiguous(code.len()));
    };
    if only.size == 0 {
        return Err(Unusable::NoSize);
    }
    let end = only
        .addr
        .checked_add(only.size)
        .ok_or(Unusable::OutsideText)?;
    if only.addr < text.start || end > text.end {
        return Err(Unusable::OutsideText);
    }
    Ok(FunctionRange {
        start: only.addr,
        end,
    })
}

/// Resolves every name: the callable ones in list order, and the others with why.
fn resolve_all<S: AsRef<str>>(
    names: &[S],
    symbols: &HashMap<String, Vec<SymbolFact>>,
    text: &Range<u64>,
) -> (Vec<(String, FunctionRange)>, Vec<UnusableFunction>) {
    let mut callable: Vec<(String, FunctionRange)> = Vec::new();
    let mut unusable = Vec::new();
    for name in names {
        let name = name.as_ref();
        let facts = symbols.get(name).map_or(&[][..], Vec::as_slice);
        let why = match resolve(facts, text) {
            Ok(range) => match callable.iter().find(|(_, r)| r.start == range.start) {
                Some((other, _)) => Unusable::AliasOf(other.clone()),
                None => {
                    callable.push((name.to_owned(), range));
                    continue;
                }
            },
            Err(why) => why,
        };
        unusable.push(UnusableFunction {
            name: name.to_owned(),
            why,
        });
    }
    (callable, unusable)
}

/// The vmlinux with symbols of the Debian kernel `kernel` (ABI name), if its -dbg package is in the cache (where
/// `exotap image fetch` puts it: `$XDG_CACHE_HOME/exotap`, else `~/.cache/exotap`).
#[must_use]
pub fn cached_vmlinux(kernel: &str) -> Option<std::path::PathBuf> {
    let path = exotap_introspect::bzimage::cached_kernel_dir(kernel)?.join("debug/vmlinux");
    path.is_file().then_some(path)
}

struct Loaded {
    regions: Vec<Region>,
    text_base: u64,
    text: Vec<u8>,
    /// Every symbol of a wanted name.
    symbols: HashMap<String, Vec<SymbolFact>>,
    return_thunk: Option<u64>,
    /// The per-CPU offset of `cpu_number` (the per-CPU segment is mapped at 0: it reads 0):
    /// its own symbol, or `pcpu_hot.cpu_number` (6.12) from the vmlinux's BTF, the rule of
    /// `exotap_probes::live::attach::percpu_variable`.
    cpu_number: Option<u64>,
    /// Every sized code symbol in the text, `(start, end, name)`, sorted (the JIT mode
    /// translates callees too).
    code_symbols: Vec<(u64, u64, String)>,
}

const RETURN_THUNK: &str = "__x86_return_thunk";
/// The kernel's per-CPU vCPU number, which trace records read `gs:`-relative.
const CPU_NUMBER: &str = "cpu_number";
/// Where kernels that gathered their hottest per-CPU variables keep `cpu_number` (6.12).
const PCPU_HOT: &str = "pcpu_hot";

fn load<S: AsRef<str>>(path: &Path, names: &[S]) -> Result<Loaded, RegressError> {
    let bad = |why: String| RegressError::Layout(format!("{}: {why}", path.display()));
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    // SAFETY: the file is only read; a cached image is not modified while in use (the
    // cache replaces files by renaming).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(e.to_string()))?;
    let elf = object::File::parse(&*map).map_err(|e| bad(e.to_string()))?;
    let mut regions = Vec::new();
    let mut text = None;
    for seg in elf.segments() {
        let (addr, size) = (seg.address(), seg.size());
        let data = seg.data().map_err(|e| bad(e.to_string()))?;
        if size == 0 || data.len() as u64 > size || size > 0x1000_0000 {
            continue;
        }
        let exec = matches!(seg.flags(), object::SegmentFlags::Elf { p_flags } if p_flags & object::elf::PF_X != 0);
        // Page-align the region around the segment.
        let start = addr & !(PAGE - 1);
        let end = (addr + size).div_ceil(PAGE) * PAGE;
        let mut init = vec![0; (end - start) as usize];
        let off = (addr - start) as usize;
        init[off..off + data.len()].copy_from_slice(data);
        if exec && text.is_none() && addr >= 0xffff_8000_0000_0000 {
            text = Some((addr, data.to_vec()));
        }
        regions.push(Region {
            addr: start,
            init,
            reset: false,
            compare: false,
        });
    }
    let (text_base, text) = text.ok_or_else(|| bad("no kernel text segment".into()))?;
    let wanted: HashSet<&str> = names
        .iter()
        .map(AsRef::as_ref)
        .chain([RETURN_THUNK, CPU_NUMBER, PCPU_HOT])
        .collect();
    let mut symbols: HashMap<String, Vec<SymbolFact>> = HashMap::new();
    let text_end = text_base + text.len() as u64;
    let mut code_symbols = Vec::new();
    for sym in elf.symbols() {
        if sym.kind() == object::SymbolKind::Text
            && sym.size() > 0
            && sym.address() >= text_base
            && sym.address().saturating_add(sym.size()) <= text_end
        {
            if let Ok(name) = sym.name() {
                code_symbols.push((sym.address(), sym.address() + sym.size(), name.to_owned()));
            }
        }
        if let Ok(name) = sym.name() {
            if wanted.contains(name) {
                symbols
                    .entry(name.to_owned())
                    .or_default()
                    .push(SymbolFact {
                        addr: sym.address(),
                        size: sym.size(),
                        code: sym.kind() == object::SymbolKind::Text,
                    });
            }
        }
    }
    let return_thunk = symbols
        .get(RETURN_THUNK)
        .and_then(|facts| facts.iter().find(|f| f.code))
        .map(|f| f.addr);
    let data_symbol = |name: &str| {
        symbols
            .get(name)
            .and_then(|facts| facts.iter().find(|f| !f.code))
            .map(|f| f.addr)
    };
    let cpu_number = data_symbol(CPU_NUMBER).or_else(|| {
        let hot = data_symbol(PCPU_HOT)?;
        let btf = exotap_introspect::btf::Btf::from_elf(&map).ok()?;
        let member = btf.struct_member(PCPU_HOT, CPU_NUMBER).ok()?;
        Some(hot + member.byte_offset()?)
    });
    code_symbols.sort();
    code_symbols.dedup_by_key(|s| s.0);
    Ok(Loaded {
        regions,
        text_base,
        text,
        symbols,
        return_thunk,
        cpu_number,
        code_symbols,
    })
}

/// Runs the sweep over the kernel functions of [`builtin_functions`] found in `vmlinux`;
/// those this vmlinux lacks are reported skipped.
///
/// # Errors
/// Unreadable image, emulator failure.
pub fn regress(vmlinux: &Path, options: &Options) -> Result<Report, RegressError> {
    sweep_functions(vmlinux, &builtin_functions(), options, false)
}

/// Runs the sweep over the named functions (a list from [`read_function_list`]). A
/// function of [`builtin_functions`] is called with the arguments set up for it; any
/// other with generic arguments: each of the five argument registers points at its own
/// zero-filled 1 KiB buffer. A function whose unprobed call does not return is reported
/// skipped.
///
/// # Errors
/// [`RegressError::Unusable`], naming every listed function that is not in the vmlinux or
/// cannot be called (a data symbol, no size, outside the main text, an ambiguous static
/// name), before anything runs; otherwise as [`regress`].
pub fn regress_functions<S: AsRef<str>>(
    vmlinux: &Path,
    names: &[S],
    options: &Options,
) -> Result<Report, RegressError> {
    sweep_functions(vmlinux, names, options, true)
}

fn sweep_functions<S: AsRef<str>>(
    vmlinux: &Path,
    names: &[S],
    options: &Options,
    refuse_unusable: bool,
) -> Result<Report, RegressError> {
    let started = Instant::now();
    let loaded = load(vmlinux, names)?;
    let text_range = loaded.text_base..loaded.text_base + loaded.text.len() as u64;
    let (callable, unusable) = resolve_all(names, &loaded.symbols, &text_range);
    if refuse_unusable && !unusable.is_empty() {
        return Err(RegressError::Unusable(unusable));
    }
    let view = CodeView::new(loaded.text_base, &loaded.text)
        .map_err(|e| RegressError::Layout(e.to_string()))?;
    let mut generic: Vec<&str> = Vec::new();
    let mut calls: Vec<(&str, Setup, FunctionRange)> = callable
        .iter()
        .map(|(name, range)| {
            let setup = CALLS.iter().find(|c| c.0 == name).map_or_else(
                || {
                    generic.push(name);
                    generic_setup as Setup
                },
                |c| c.1,
            );
            (name.as_str(), setup, *range)
        })
        .collect();
    calls.sort_by_key(|c| c.2.start);
    let ranges: Vec<FunctionRange> = calls.iter().map(|c| c.2).collect();
    let mut config = AnalysisConfig::new();
    if let Some(thunk) = loaded.return_thunk {
        config = config.with_return_thunk(thunk);
    }
    let analysis = TextAnalysis::analyze(view, &ranges, &config);
    let ctx = SpliceContext::new(view, &analysis);

    let image_start = loaded
        .regions
        .iter()
        .map(|r| r.addr)
        .filter(|&a| a >= 0xffff_8000_0000_0000)
        .min()
        .unwrap_or(loaded.text_base);
    let image_end = loaded
        .regions
        .iter()
        .map(|r| r.addr + r.init.len() as u64)
        .max()
        .unwrap_or(loaded.text_base);
    let mut regions = loaded.regions;
    regions.push(Region {
        addr: SCRATCH,
        init: vec![0; SCRATCH_SIZE],
        reset: true,
        compare: true,
    });
    // The entry patches' data: zeroed by their checks themselves (a megabyte written before
    // each of the counting sweep's runs would slow it for nothing).
    regions.push(Region {
        addr: entries::DATA,
        init: vec![0; entries::DATA_SIZE],
        reset: false,
        compare: false,
    });
    let mut h = Harness::with_regions(
        regions,
        image_start,
        image_end,
        Scratch::HALT,
        X86Registers::default(),
        crate::x86::HEAP_SIZE,
    )?;
    h.in_emulator_traps = options.in_emulator_traps;
    let generic_note = if generic.is_empty() {
        String::new()
    } else {
        format!(
            "; with generic arguments (pointers to zeroed buffers): {}",
            generic.join(", ")
        )
    };
    let mut report = Report {
        image: format!(
            "{} ({} functions called{generic_note})",
            vmlinux.display(),
            calls.len()
        ),
        skipped: unusable.iter().map(ToString::to_string).collect(),
        ..Report::default()
    };
    tracing::info!(
        "loaded and mapped in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    for (name, setup, range) in &calls {
        let t = Instant::now();
        let mut scratch = Scratch::new();
        let args = setup(&mut scratch);
        h.set_region_init(SCRATCH, scratch.bytes)?;
        let mut start = X86Registers {
            rip: range.start,
            rflags: 0x2,
            ..X86Registers::default()
        };
        // rdi, rsi, rdx, rcx, r8.
        for (slot, value) in [5usize, 4, 3, 2, 8].into_iter().zip(args) {
            start.gpr[slot] = value;
        }
        start.gpr[7] = h.push_return_address(Scratch::HALT)?;
        h.start = start;
        let addrs: Vec<u64> = analysis
            .function_containing(range.start)
            .map(|f| f.cfg.insns().iter().map(|i| i.addr).collect())
            .unwrap_or_default();
        let func_name = |addr: u64| format!("{name}+{:#x}", addr - range.start);
        match sweep(&mut h, &ctx, &addrs, options, &mut report, &func_name) {
            Ok(()) => {
                report.functions += 1;
                entries::check_entry_kinds(
                    &mut h,
                    &ctx,
                    range.start,
                    name,
                    loaded.return_thunk,
                    loaded.cpu_number,
                    &mut report,
                )?;
            }
            Err(RegressError::ReferenceDidNotHalt(why)) => {
                report
                    .skipped
                    .push(format!("{name} (its unprobed call did not return: {why})"));
            }
            Err(e) => return Err(e),
        }
        tracing::info!("{name}: {:.2} s", t.elapsed().as_secs_f64());
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: Range<u64> = 0xffff_ffff_8100_0000..0xffff_ffff_8200_0000;

    fn code(addr: u64, size: u64) -> SymbolFact {
        SymbolFact {
            addr,
            size,
            code: true,
        }
    }

    #[test]
    fn function_list_skips_comments_and_blank_lines() {
        let text = "# my functions\n\nstrlen\n  memcmp   # trailing comment\n\t\nfoo.constprop.0\n";

        let names = parse_function_list(text).unwrap();

        assert_eq!(names, ["strlen", "memcmp", "foo.constprop.0"]);
    }

    #[test]
    fn function_list_refuses_two_names_on_a_line() {
        let err = parse_function_list("strlen\nstrcmp strncmp\n").unwrap_err();

        assert!(
            matches!(&err, FunctionListError::NotAName { line: 2, text } if text == "strcmp strncmp"),
            "{err}"
        );
        assert!(err.to_string().contains("line 2"), "{err}");
    }

    #[test]
    fn function_list_refuses_a_name_that_is_not_a_symbol() {
        let err = parse_function_list("0xffffffff81000000\n").unwrap_err();

        assert!(
            matches!(err, FunctionListError::NotAName { line: 1, .. }),
            "{err}"
        );
    }

    #[test]
    fn function_list_refuses_a_name_listed_twice() {
        let err = parse_function_list("strlen\n# again:\nstrlen\n").unwrap_err();

        assert!(
            matches!(&err, FunctionListError::Duplicate { line: 3, first: 1, name } if name == "strlen"),
            "{err}"
        );
    }

    #[test]
    fn function_list_of_only_comments_is_empty() {
        let err = parse_function_list("# nothing\n\n   # here\n").unwrap_err();

        assert!(matches!(err, FunctionListError::Empty), "{err}");
    }

    #[test]
    fn unreadable_function_list_names_the_file() {
        let err = read_function_list(Path::new("/nonexistent/functions.txt")).unwrap_err();

        assert!(
            err.to_string().contains("/nonexistent/functions.txt"),
            "{err}"
        );
    }

    #[test]
    fn unknown_names_are_all_named_with_why() {
        let symbols = HashMap::from([
            ("strlen".to_owned(), vec![code(TEXT.start + 0x100, 0x20)]),
            (
                "jiffies".to_owned(),
                vec![SymbolFact {
                    addr: TEXT.end + 0x1000,
                    size: 8,
                    code: false,
                }],
            ),
        ]);

        let (callable, unusable) =
            resolve_all(&["strlen", "no_such_fn", "jiffies"], &symbols, &TEXT);

        assert_eq!(callable.len(), 1);
        assert_eq!(
            unusable,
            [
                UnusableFunction {
                    name: "no_such_fn".into(),
                    why: Unusable::NotInVmlinux
                },
                UnusableFunction {
                    name: "jiffies".into(),
                    why: Unusable::NotCode
                },
            ]
        );
        let message = RegressError::Unusable(unusable).to_string();
        assert!(
            message.contains("no_such_fn (no symbol of that name"),
            "{message}"
        );
        assert!(message.contains("jiffies (a data symbol"), "{message}");
    }

    #[test]
    fn function_without_size_outside_text_or_ambiguous_is_refused() {
        let symbols = HashMap::from([
            ("sizeless".to_owned(), vec![code(TEXT.start + 0x10, 0)]),
            ("init_fn".to_owned(), vec![code(TEXT.end + 0x10, 0x40)]),
            (
                "cmp".to_owned(),
                vec![
                    code(TEXT.start + 0x200, 0x10),
                    code(TEXT.start + 0x300, 0x10),
                ],
            ),
            ("straddles".to_owned(), vec![code(TEXT.end - 0x10, 0x40)]),
        ]);

        let (callable, unusable) = resolve_all(
            &["sizeless", "init_fn", "cmp", "straddles"],
            &symbols,
            &TEXT,
        );

        assert!(callable.is_empty());
        let whys: Vec<Unusable> = unusable.into_iter().map(|u| u.why).collect();
        assert_eq!(
            whys,
            [
                Unusable::NoSize,
                Unusable::OutsideText,
                Unusable::Ambiguous(2),
                Unusable::OutsideText
            ]
        );
    }

    #[test]
    fn second_name_of_the_same_function_is_an_alias() {
        let symbols = HashMap::from([
            ("memmove".to_owned(), vec![code(TEXT.start + 0x40, 0x80)]),
            ("__memmove".to_owned(), vec![code(TEXT.start + 0x40, 0x80)]),
        ]);

        let (callable, unusable) = resolve_all(&["__memmove", "memmove"], &symbols, &TEXT);

        assert_eq!(callable.len(), 1);
        assert_eq!(unusable[0].why, Unusable::AliasOf("__memmove".into()));
    }

    #[test]
    fn local_and_global_symbols_at_one_address_are_one_function() {
        let symbols = HashMap::from([(
            "gcd".to_owned(),
            vec![
                code(TEXT.start + 0x500, 0x30),
                code(TEXT.start + 0x500, 0x30),
            ],
        )]);

        let (callable, unusable) = resolve_all(&["gcd"], &symbols, &TEXT);

        assert!(unusable.is_empty());
        assert_eq!(callable[0].1.end, TEXT.start + 0x530);
    }

    #[test]
    fn generic_arguments_point_at_distinct_zeroed_buffers() {
        let mut scratch = Scratch::new();

        let args = generic_setup(&mut scratch);

        for pair in args.windows(2) {
            assert!(pair[1] >= pair[0] + GENERIC_BUFFER as u64);
        }
        let last = (args[4] - SCRATCH) as usize + GENERIC_BUFFER;
        assert!(last <= SCRATCH_SIZE);
        assert!(scratch.bytes[(args[0] - SCRATCH) as usize..last]
            .iter()
            .all(|&b| b == 0));
    }

    #[test]
    fn every_builtin_function_is_a_valid_list_entry() {
        let text = builtin_functions().join("\n");

        let names = parse_function_list(&text).unwrap();

        assert_eq!(names.len(), CALLS.len());
    }
}
