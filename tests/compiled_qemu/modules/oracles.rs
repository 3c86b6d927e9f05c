//! What binutils and gdb read in a module's debug file from the cache, without exotap: the
//! lines of `evdev_open` and their addresses, its stores to a member, the relocated
//! references to a module's global. The oracles of the module tests.

/// The debug file of module `name` (`evdev.ko`) of the default kernel, from the cache.
#[allow(clippy::expect_used)] // a fixture that fails fails the test
pub(super) fn module_debug_file(name: &str) -> std::path::PathBuf {
    let cached = exotap_guest_images::ensure_kernel(exotap_guest_images::DEFAULT_KERNEL)
        .expect("the default kernel is not in the cache");
    let ko = cached
        .bzimage
        .parent()
        .unwrap()
        .join("debug/modules")
        .join(name);
    assert!(
        ko.is_file(),
        "{} is absent: `exotap image fetch --debuginfo` keeps it with the vmlinux",
        ko.display()
    );
    ko
}

/// What gdb, reading evdev's debug file from the cache, says of `commands` (one `-ex` each).
pub(super) fn gdb_on_evdev(commands: &[String]) -> String {
    gdb_on(&module_debug_file("evdev.ko"), commands)
}

/// What gdb says of `commands` (one `-ex` each) reading `file`.
#[allow(clippy::panic)] // a fixture that fails fails the test
pub(super) fn gdb_on(file: &std::path::Path, commands: &[String]) -> String {
    let mut gdb = std::process::Command::new("gdb");
    gdb.args(["-nx", "-batch"]);
    for c in commands {
        gdb.arg("-ex").arg(c);
    }
    let out = gdb
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("cannot run gdb (ci/install-deps.sh installs it): {e}"));
    assert!(out.status.success(), "gdb on {} failed", file.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// How many lines after its own `evdev_open_lines` asks gdb about (evdev_open is shorter).
pub(super) const EVDEV_OPEN_LINES: u32 = 60;

/// gdb's `Line N of "FILE" starts at address 0x.. <evdev_open+OFF> ...` or `... contains no
/// code`, for `evdev_open`'s own line and each after it, as (line, file, offset when it has
/// code).
#[allow(clippy::panic, clippy::expect_used)] // a fixture that fails fails the test
pub(super) fn evdev_open_lines() -> Vec<(u32, String, Option<u64>)> {
    let decl = gdb_on_evdev(&["info line evdev_open".to_owned()]);
    let parse = |l: &str| -> Option<(u32, String)> {
        let rest = l.strip_prefix("Line ")?;
        let (n, rest) = rest.split_once(" of \"")?;
        let (file, _) = rest.split_once('"')?;
        Some((n.parse().ok()?, file.to_owned()))
    };
    let (first, _) = decl
        .lines()
        .find_map(parse)
        .unwrap_or_else(|| panic!("gdb gave no line of evdev_open:\n{decl}"));
    let asks: Vec<String> = (first..first + EVDEV_OPEN_LINES)
        .map(|n| format!("info line drivers/input/evdev.c:{n}"))
        .collect();
    let text = gdb_on_evdev(&asks);
    text.lines()
        .filter_map(|l| {
            let (n, file) = parse(l)?;
            let offset = l
                .split_once("starts at address ")
                .and_then(|(_, rest)| rest.split_once("<evdev_open+"))
                .and_then(|(_, rest)| rest.split_once('>'))
                .and_then(|(off, _)| off.parse().ok());
            Some((n, file, offset))
        })
        .collect()
}

/// The length of the instruction at `evdev_open+offset`, as gdb decodes evdev's debug file.
#[allow(clippy::panic, clippy::expect_used)] // a fixture that fails fails the test
pub(super) fn evdev_open_instruction_length(offset: u64) -> u64 {
    let text = gdb_on_evdev(&[format!("x/2i evdev_open+{offset}")]);
    let at: Vec<u64> = text
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once("<evdev_open+")?;
            rest.split_once('>')?.0.parse().ok()
        })
        .collect();
    match at.as_slice() {
        [a, b] => b - a,
        _ => panic!("gdb did not decode two instructions at evdev_open+{offset}:\n{text}"),
    }
}

/// The first line of evdev_open past its first 16 bytes whose first instruction has a
/// splice's room (5 bytes), as gdb reads evdev's debug file: (line, file, offset).
#[allow(clippy::panic)] // a fixture that fails fails the test
pub(super) fn evdev_open_line_with_room() -> (u32, String, u64) {
    let lines = evdev_open_lines();
    lines
        .iter()
        .filter_map(|(n, f, off)| off.filter(|o| *o >= 16).map(|o| (*n, f.clone(), o)))
        .find(|(_, _, o)| evdev_open_instruction_length(*o) >= 5)
        .unwrap_or_else(|| {
            panic!("no line of evdev_open past its prologue starts a splice's room: {lines:?}")
        })
}

/// gdb's byte offset of `struct evdev_client`'s `bufsize`, and the offsets in `evdev_open`
/// of the instructions that store to that offset from a base register (`mov ...,0xOFF(%reg)`),
/// as gdb lays out and disassembles evdev's debug file: the member writes, found without
/// exotap's join-point finder. (`evdev_open` is where evdev sets a client's buffer size.)
#[allow(clippy::panic)] // a fixture that fails fails the test
pub(super) fn bufsize_stores_in_evdev_open() -> (u64, Vec<u64>) {
    let text = gdb_on_evdev(&[
        "ptype /o struct evdev_client".to_owned(),
        "disassemble evdev_open".to_owned(),
    ]);
    let member = text
        .lines()
        .find(|l| l.trim_end().ends_with(" bufsize;"))
        .and_then(|l| l.trim_start().strip_prefix("/*"))
        .and_then(|rest| rest.split('|').next())
        .and_then(|off| off.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("gdb lays out no bufsize in struct evdev_client:\n{text}"));
    let target = format!(",{member:#x}(%r");
    let stores: Vec<u64> = text
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once("<+")?;
            let (offset, instr) = rest.split_once(">:")?;
            let instr = instr.trim();
            (instr.starts_with("mov") && instr.contains(&target))
                .then(|| offset.parse().ok())
                .flatten()
        })
        .collect();
    assert!(
        !stores.is_empty(),
        "gdb shows no store to bufsize ({member:#x}) in evdev_open:\n{text}"
    );
    (member, stores)
}

/// The places in module debug file `ko` that reach member bytes `member` (offsets into the
/// global `global`) RIP-relative, as binutils' `objdump -dr` shows the file's own
/// relocations: a `R_X86_64_PC32 global+A` at P in the instruction ending at N reaches
/// `global + A + (N - P)`. As (function, offset into it).
#[allow(clippy::panic)] // a fixture that fails fails the test
pub(super) fn objdump_global_member_sites(
    ko: &std::path::Path,
    global: &str,
    member: std::ops::Range<u64>,
) -> std::collections::BTreeSet<(String, u64)> {
    let out = std::process::Command::new("objdump")
        .args(["-dr", "--no-show-raw-insn"])
        .arg(ko)
        .output()
        .unwrap_or_else(|e| panic!("cannot run objdump (binutils, with gcc): {e}"));
    assert!(out.status.success(), "objdump -dr {} failed", ko.display());
    let text = String::from_utf8_lossy(&out.stdout);
    let hex = |s: &str| u64::from_str_radix(s.trim(), 16).ok();
    // (function, its address, the instruction's address, the relocation's place, addend)
    let mut relocs = Vec::new();
    let mut starts: Vec<u64> = Vec::new();
    let mut function: Option<(String, u64)> = None;
    for line in text.lines() {
        if let Some((addr, name)) = line
            .strip_suffix(">:")
            .and_then(|l| l.split_once(" <"))
            .and_then(|(a, n)| Some((hex(a)?, n.to_owned())))
        {
            function = Some((name, addr));
            continue;
        }
        let Some((addr, rest)) = line.split_once(':') else {
            continue;
        };
        let Some(addr) = hex(addr) else { continue };
        let rest = rest.trim();
        if let Some(target) = rest.strip_prefix("R_X86_64_PC32") {
            let target = target.trim();
            let Some(addend) = target.strip_prefix(global).and_then(|a| {
                if a.is_empty() {
                    return Some(0);
                }
                if let Some(v) = a.strip_prefix("+0x") {
                    return i64::try_from(hex(v)?).ok();
                }
                Some(-i64::try_from(hex(a.strip_prefix("-0x")?)?).ok()?)
            }) else {
                continue;
            };
            if let (Some((f, at)), Some(insn)) = (&function, starts.last()) {
                relocs.push((f.clone(), *at, *insn, addr, addend));
            }
        } else if !rest.is_empty() {
            starts.push(addr);
        }
    }
    relocs
        .into_iter()
        .filter_map(|(f, at, insn, place, addend)| {
            // The instruction after this one: where its RIP-relative operand counts from.
            let next = starts.iter().copied().find(|&s| s > insn)?;
            let off = addend.checked_add(i64::try_from(next.checked_sub(place)?).ok()?)?;
            member
                .contains(&u64::try_from(off).ok()?)
                .then(|| (f, insn - at))
        })
        .collect()
}
