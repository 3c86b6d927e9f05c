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

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use exotap_introspect::x86::{AnalysisConfig, CodeView, FunctionRange, TextAnalysis};
use exotap_probes::splice::SpliceContext;
use exotap_vmm::control::X86Registers;
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::x86::{sweep, Harness, Region};
use crate::{Options, RegressError, Report};

const PAGE: u64 = 0x1000;
/// Scratch area for arguments and stubs (past the patch heap).
const SCRATCH: u64 = 0xffff_ffff_8400_0000;
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
];

/// The Debian kernel's vmlinux with symbols, if the -dbg package is in the cache.
#[must_use]
pub fn cached_vmlinux() -> Option<std::path::PathBuf> {
    let home = std::env::var_os("HOME")?;
    let path = Path::new(&home)
        .join(".cache/exotap/kernels")
        .join(exotap_guest_images::DEFAULT_KERNEL)
        .join("debug/vmlinux");
    path.is_file().then_some(path)
}

struct Loaded {
    regions: Vec<Region>,
    text_base: u64,
    text: Vec<u8>,
    symbols: HashMap<String, (u64, u64)>,
    return_thunk: Option<u64>,
}

fn load(path: &Path) -> Result<Loaded, RegressError> {
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
    let wanted: std::collections::HashSet<&str> = CALLS
        .iter()
        .map(|(n, _)| *n)
        .chain(["__x86_return_thunk"])
        .collect();
    let mut symbols = HashMap::new();
    for sym in elf.symbols() {
        if let Ok(name) = sym.name() {
            if wanted.contains(name) && sym.kind() == object::SymbolKind::Text {
                symbols.insert(name.to_owned(), (sym.address(), sym.size()));
            }
        }
    }
    let return_thunk = symbols.get("__x86_return_thunk").map(|&(a, _)| a);
    Ok(Loaded {
        regions,
        text_base,
        text,
        symbols,
        return_thunk,
    })
}

/// Runs the sweep over the kernel functions of [`CALLS`] found in `vmlinux`.
///
/// # Errors
/// Unreadable image, emulator failure, a reference call that does not return.
pub fn regress(vmlinux: &Path, options: &Options) -> Result<Report, RegressError> {
    let names: Vec<&str> = CALLS.iter().map(|c| c.0).collect();
    regress_functions(vmlinux, &names, options)
}

/// Runs the sweep over the named functions of [`CALLS`] only.
///
/// # Errors
/// As [`regress`].
pub fn regress_functions(
    vmlinux: &Path,
    names: &[&str],
    options: &Options,
) -> Result<Report, RegressError> {
    let started = Instant::now();
    let loaded = load(vmlinux)?;
    let view = CodeView::new(loaded.text_base, &loaded.text)
        .map_err(|e| RegressError::Layout(e.to_string()))?;
    let mut calls: Vec<(&str, Setup, FunctionRange)> = CALLS
        .iter()
        .filter(|(name, _)| names.contains(name))
        .filter_map(|&(name, setup)| {
            let &(start, size) = loaded.symbols.get(name)?;
            (size > 0).then_some((
                name,
                setup,
                FunctionRange {
                    start,
                    end: start + size,
                },
            ))
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
    let mut h = Harness::with_regions(
        regions,
        image_start,
        image_end,
        Scratch::HALT,
        X86Registers::default(),
    )?;
    h.in_emulator_traps = options.in_emulator_traps;
    let mut report = Report {
        image: format!("{} ({} functions called)", vmlinux.display(), calls.len()),
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
            Ok(()) => report.functions += 1,
            Err(RegressError::ReferenceDidNotHalt(why)) => {
                report.skipped.push(format!("{name}: {why}"));
            }
            Err(e) => return Err(e),
        }
        tracing::info!("{name}: {:.2} s", t.elapsed().as_secs_f64());
    }
    report.elapsed = started.elapsed();
    Ok(report)
}
