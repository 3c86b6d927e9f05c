//! The code cache translator over hot functions of the real Debian kernel (VFS, syscall
//! entries, scheduler, user copies; link-time text from the cached bzImage): every one
//! translates, the instructions with exception-table entries leave the cache exactly
//! where the image's `__ex_table` says, and the cache size and translation rate are
//! printed. (Running them is the Unicorn regression's and the live guest's business.)

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use exotap_introspect::x86::{ranges_from_starts, CodeView, FunctionAnalysis};
use exotap_probes::jit::{CacheLayout, ExitReason, Translator};
use exotap_probes::live::splicer::KernelFacts;
use exotap_probes::live::KernelImage;

const HOT: &[&str] = &[
    "vfs_read",
    "vfs_write",
    "ksys_read",
    "ksys_write",
    "__x64_sys_read",
    "__x64_sys_write",
    "__x64_sys_getpid",
    "rw_verify_area",
    "__fdget_pos",
    "fput",
    "do_sys_openat2",
    "do_filp_open",
    "path_openat",
    "getname_flags",
    "strncpy_from_user",
    "strnlen_user",
    "_copy_to_user",
    "_copy_from_user",
    "pipe_read",
    "pipe_write",
    "filemap_read",
    "copy_page_to_iter",
    "__schedule",
    "pick_next_task_fair",
    "update_curr",
    "enqueue_task_fair",
    "dequeue_task_fair",
    "try_to_wake_up",
];

#[test]
fn hot_kernel_functions_translate_and_user_accesses_leave_the_cache() {
    let Some(dir) =
        exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)
    else {
        println!("SKIP: no cached Debian kernel (exotap image fetch)");
        return;
    };
    let image = KernelImage::load(dir.join("vmlinuz")).unwrap();
    let facts = KernelFacts::from_image(&image, 0).unwrap();
    let (start, end) = facts.text;
    let text = image
        .vmlinux
        .read_at(start, usize::try_from(end - start).unwrap())
        .unwrap();
    let view = CodeView::new(start, text).unwrap();
    let ranges = ranges_from_starts(&facts.starts, view.end());
    let heap = (end + 0x40_0000) & !0x1f_ffff;
    let layout = CacheLayout::split(heap..heap + 0x80_0000).unwrap();
    let mut functions = Vec::new();
    for name in HOT {
        let Some(sym) = image.symbols.get(name) else {
            continue;
        };
        let Some(range) = ranges.iter().find(|r| r.start == sym.addr) else {
            continue;
        };
        let bytes = view.range(range.start, range.end).unwrap();
        functions.push((
            *name,
            FunctionAnalysis::analyze(bytes, range.start, &facts.config),
        ));
    }

    let started = Instant::now();
    let mut translator = Translator::new(layout, &facts.address_keyed).unwrap();
    for (_, f) in &functions {
        translator.translate(view, f).unwrap();
    }
    translator.link().unwrap();
    let (hash, (mean, most, run)) = translator.table_probe_lengths();
    println!(
        "lookup table: low {} bits, {mean:.2} probes a hit on average, {most} at most, longest run {run}",
        hash.bits
    );
    // The kernel's dense text spreads over the slots: no long runs for a return to walk.
    assert!(mean < 1.5 && most <= 16, "{mean} {most}");
    let translation = translator.finish().unwrap();
    let elapsed = started.elapsed();

    let source_bytes: u64 = functions
        .iter()
        .map(|(_, f)| f.cfg.end() - f.cfg.start())
        .sum();
    let mut exits: BTreeMap<String, usize> = BTreeMap::new();
    for e in &translation.exits {
        *exits.entry(format!("{:?}", e.reason)).or_default() += 1;
    }
    println!(
        "{} functions ({} bytes of text), {} blocks ({} save flags): {} bytes of cache, {} lookup entries, {} counters; {:.1} ms ({:.0} functions/s, {:.1} MB/s of text); exits {exits:?}",
        functions.len(),
        source_bytes,
        translation.blocks.len(),
        translation.blocks.iter().filter(|b| b.saves_flags).count(),
        translation.code.len(),
        translation.table_entries,
        translation.blocks.len(),
        elapsed.as_secs_f64() * 1e3,
        functions.len() as f64 / elapsed.as_secs_f64(),
        source_bytes as f64 / elapsed.as_secs_f64() / 1e6,
    );
    let keyed: BTreeSet<u64> = facts.address_keyed.iter().copied().collect();
    let expected: BTreeSet<u64> = functions
        .iter()
        .flat_map(|(_, f)| f.cfg.insns().iter().map(|i| i.addr))
        .filter(|a| keyed.contains(a))
        .collect();
    let left: BTreeSet<u64> = translation
        .exits
        .iter()
        .filter(|e| e.reason == ExitReason::ExceptionTable)
        .map(|e| e.addr)
        .collect();

    assert!(functions.len() >= 20, "{} found", functions.len());
    assert_eq!(translation.functions.len(), functions.len());
    assert!(translation.full.is_none());
    assert!(!expected.is_empty());
    assert_eq!(left, expected);
    // IBT: no indirect jmp or call in the cache, so no address in it needs an `endbr64`
    // (the kernel enters it by direct jmps and the dispatch routine's `ret`).
    let decoder = iced_x86::Decoder::with_ip(
        64,
        &translation.code,
        translation.code_at,
        iced_x86::DecoderOptions::NONE,
    );
    for instr in decoder {
        assert!(!instr.is_invalid(), "undecodable at {:#x}", instr.ip());
        assert!(
            !matches!(
                instr.flow_control(),
                iced_x86::FlowControl::IndirectBranch | iced_x86::FlowControl::IndirectCall
            ),
            "{instr} at {:#x}",
            instr.ip()
        );
    }
}
