//! Module probes at the places a module's DWARF names: a source line, every line of a
//! function, an offset into it, the accesses to a member. Each counted over the same opens
//! of evdev's device as the guest's kprobe on `evdev_open` counts them, at the addresses gdb
//! gives.

use super::oracles::{
    bufsize_stores_in_evdev_open, evdev_open_line_with_room, evdev_open_lines, gdb_on_evdev,
};
use super::*;

/// A run of `script` over `OPENS` opens of evdev's first device, with the guest's kprobe on
/// `evdev_open` counting them: exotap's stdout and stderr, all as one context for messages,
/// the kprobe's count (checked: one per open) and where the guest's kallsyms has evdev_open.
struct OpensRun {
    out: String,
    err: String,
    ctx: String,
    kprobe: u64,
    evdev_open: u64,
}

#[allow(clippy::panic)] // a fixture that fails fails the test
fn run_over_opens(script: &str) -> OpensRun {
    let job = format!(
        "insmod /modules/evdev.ko\n\
         T=/sys/kernel/tracing\n\
         echo 'p:exotap/evdev_open evdev:evdev_open' >> $T/kprobe_events || echo KPROBE-FAILED\n\
         echo 1 > $T/events/exotap/enable\n\
         exotap_result evdev_open \"$(grep ' evdev_open\t' /proc/kallsyms | cut -d' ' -f1)\"\n\
         exotap_wait attach\n\
         i=0\n\
         while [ $i -lt {OPENS} ]; do : < /dev/input/event0; i=$((i+1)); done\n\
         exotap_wait detach\n\
         {KPROBE_COUNTS}"
    );
    let dir = tempfile::tempdir().unwrap();
    let initrd = initramfs(dir.path(), &job);
    let console = dir.path().join("console.log");
    let (code, out, err, transcript, ctx) = boot_script(&initrd, &console, script);
    assert_eq!(code, 0, "{ctx}");
    assert!(!transcript.contains("KPROBE-FAILED"), "{ctx}");
    let kprobe: u64 = result(&transcript, "kprobe.evdev_open")
        .and_then(|k| k.parse().ok())
        .unwrap_or_else(|| panic!("no kprobe count of evdev_open: {ctx}"));
    assert_eq!(kprobe, u64::from(OPENS), "{ctx}");
    let evdev_open = result(&transcript, "evdev_open")
        .and_then(|a| u64::from_str_radix(a, 16).ok())
        .unwrap_or_else(|| panic!("no address of evdev_open in the guest's kallsyms: {ctx}"));
    OpensRun {
        out,
        err,
        ctx,
        kprobe,
        evdev_open,
    }
}

/// `module("evdev").statement("evdev_open@FILE:LINE")`: the first line gdb places past the
/// first 16 bytes of evdev_open whose first instruction is long enough for a splice (5
/// bytes; its first statements after the prologue, run at every call that allocates its
/// client), probed compiled at the address gdb gives for it (`addr()` equals
/// the guest's own `evdev_open` in `/proc/kallsyms` plus gdb's offset) and counted once per
/// call, as the guest's kprobe on `evdev_open` counts calls. (Not a kprobe at the line's own
/// address: its `int3` would be where exotap splices, which exotap refuses.) And
/// `module("evdev").function("evdev_open@FILE")`, the function by the file DWARF says defines
/// it, and `module("evdev").function("evdev_*@FILE:LINE")`, the functions with code of that
/// line (evdev_open alone), at their entries as often.
#[test]
fn a_statement_in_a_module_counts_like_the_guests_kprobe_at_gdbs_address_for_its_line() {
    if !have_qemu(
        "a_statement_in_a_module_counts_like_the_guests_kprobe_at_gdbs_address_for_its_line",
    ) {
        return;
    }
    let (line, file, offset) = evdev_open_line_with_room();
    let point = format!("module(\"evdev\").statement(\"evdev_open@{file}:{line}\")");
    let script = format!(
        "global n, e, f, o\nprobe {point} {{ n[pp(), addr()]++ }}\n\
         probe module(\"evdev\").function(\"evdev_open@{file}\") {{ e[pp()]++ }}\n\
         probe module(\"evdev\").function(\"evdev_*@{file}:{line}\") {{ f[pp()]++ }}\n\
         probe module(\"evdev\").statement(\"evdev_open+{offset}\") {{ o[pp(), addr()]++ }}\n\
         probe module(\"evdev\").statement(\"evdev_open+{inside}\")? {{ o[pp(), addr()]++ }}\n\
         probe end {{ foreach ([p, a] in n) printf(\"stmt %s@%x %d\\n\", p, a, n[p, a])\n\
                      foreach (p in e) printf(\"entry %s %d\\n\", p, e[p])\n\
                      foreach (p in f) printf(\"byline %s %d\\n\", p, f[p])\n\
                      foreach ([p, a] in o) printf(\"offset %s@%x %d\\n\", p, a, o[p, a]) }}",
        inside = offset + 1
    );
    let OpensRun {
        out,
        err,
        ctx,
        kprobe,
        evdev_open,
    } = run_over_opens(&script);
    assert_eq!(
        printed(&out, "stmt "),
        BTreeMap::from([(format!("{point}@{:x}", evdev_open + offset), kprobe)]),
        "{ctx}"
    );
    // The function by its file (the DWARF's): its entry, as the kprobe counts it.
    assert_eq!(
        printed(&out, "entry "),
        BTreeMap::from([(
            "module(\"evdev\").function(\"evdev_open\")".to_owned(),
            kprobe
        )]),
        "{ctx}"
    );
    // The functions matching evdev_* with code of that line: evdev_open alone, at its entry.
    assert_eq!(
        printed(&out, "byline "),
        BTreeMap::from([(
            "module(\"evdev\").function(\"evdev_open\")".to_owned(),
            kprobe
        )]),
        "{ctx}"
    );
    // The same instruction by its offset (a second probe there), once per open; one byte
    // further is inside it, which the planner refuses (an optional point: left out, saying
    // why).
    assert_eq!(
        printed(&out, "offset "),
        BTreeMap::from([(
            format!(
                "module(\"evdev\").statement(\"evdev_open+{offset:#x}\")@{:x}",
                evdev_open + offset
            ),
            kprobe
        )]),
        "{ctx}"
    );
    assert!(
        err.contains(&format!("evdev_open+{:#x}", offset + 1))
            && err.contains("not the start of an instruction"),
        "{ctx}"
    );
    assert_eq!(
        host_result(&err, "pauses.between_install_and_removal"),
        Some("0"),
        "{ctx}"
    );
    eprintln!("{point} (evdev_open+{offset}, as gdb says): {kprobe} hits, as the guest's kprobe");
}

/// What `run --compile require` says when it plans `script` and fails (before any guest:
/// the target does not exist), after checking that it failed.
fn planning_error(script: &str) -> String {
    let (code, _, err) = run(exotap().args(["run", "--compile", "require"]).args([
        "--target",
        "unix:/nonexistent/exotap-test.sock",
        "-e",
        script,
    ]));
    assert_ne!(code, 0, "{err}");
    err
}

/// A line of evdev_open without code is refused when the script is planned, naming the next
/// line with code as gdb has it; a line of evdev_open asked of another function names
/// evdev_open; a function asked of a file that defines none is refused (before any guest: the
/// attach would fail next).
#[test]
fn a_module_line_without_code_is_refused_naming_the_next_line_with_code() {
    let lines = evdev_open_lines();
    let Some(pos) = lines
        .iter()
        .position(|(_, _, off)| off.is_none())
        .filter(|&i| lines[i + 1..].iter().any(|(_, _, off)| off.is_some()))
    else {
        panic!("no line of evdev_open without code before one with: {lines:?}");
    };
    let (line, file, _) = &lines[pos];
    let next = lines[pos + 1..]
        .iter()
        .find(|(_, _, off)| off.is_some())
        .map(|(n, _, _)| *n)
        .unwrap();
    let script = format!("probe module(\"evdev\").statement(\"evdev_open@{file}:{line}\") {{ }}");
    let err = planning_error(&script);
    assert!(
        err.contains(&format!("line {line} of {file} has no code"))
            && err.contains(&format!("the next line with code is {next}")),
        "{err}"
    );
    // A line with code, asked of another function: the error names the one that has it.
    let script =
        format!("probe module(\"evdev\").statement(\"evdev_release@{file}:{next}\") {{ }}");
    let err = planning_error(&script);
    assert!(
        err.contains(&format!(
            "line {next} of {file} has code only in evdev_open, not in a function matching \
             'evdev_release'"
        )),
        "{err}"
    );
    // A function by a file that defines none of that name.
    let err =
        planning_error("probe module(\"evdev\").function(\"evdev_*@include/linux/input.h\") { }");
    assert!(
        err.contains(
            "no function of the debug file of evdev matches 'evdev_*' in a file ending \
                      with include/linux/input.h"
        ),
        "{err}"
    );
}

/// `module("evdev").field("struct evdev_client", "bufsize").write` (KLAS's join points in a
/// module): the instructions it probes are the stores gdb shows in `evdev_open` (`addr()`
/// equals the guest's own `evdev_open` plus gdb's offset), each counted once per open as the
/// guest's kprobe on `evdev_open` counts; `$value` is the size written (evdev rounds it to a
/// power of two of at least 64) and `$object` the client each `evdev_release` later gets in
/// `file->private_data`; compiled, no vCPU pause.
#[test]
fn member_writes_in_a_module_are_gdbs_stores_counted_as_the_guests_kprobe() {
    if !have_qemu("member_writes_in_a_module_are_gdbs_stores_counted_as_the_guests_kprobe") {
        return;
    }
    let (member, stores) = bufsize_stores_in_evdev_open();
    let point = "module(\"evdev\").field(\"struct evdev_client\", \"bufsize\").write";
    let script = format!(
        "global n, objects, released, odd, nrel\n\
         probe {point} {{\n\
           n[pp(), addr()]++\n\
           objects[$object] = 1\n\
           if ($value < 64 || ($value & ($value - 1)) != 0) odd[$value]++\n\
         }}\n\
         probe module(\"evdev\").function(\"evdev_release\") {{\n\
           released[$file->private_data] = 1\n\
           nrel++\n\
         }}\n\
         probe end {{\n\
           foreach ([p, a] in n) printf(\"write %s@%x %d\\n\", p, a, n[p, a])\n\
           foreach (o in released) if (!(o in objects)) printf(\"unseen %x\\n\", o)\n\
           foreach (v in odd) printf(\"odd %d %d\\n\", v, odd[v])\n\
           printf(\"released %d\\n\", nrel)\n\
         }}"
    );
    let OpensRun {
        out,
        err,
        ctx,
        kprobe,
        evdev_open,
    } = run_over_opens(&script);
    let expected: BTreeMap<String, u64> = stores
        .iter()
        .map(|off| (format!("{point}@{:x}", evdev_open + off), kprobe))
        .collect();
    assert_eq!(printed(&out, "write "), expected, "{ctx}");
    assert!(
        !out.contains("unseen "),
        "a released client no write saw: {ctx}"
    );
    assert!(
        !out.contains("odd "),
        "$value is not evdev's buffer size: {ctx}"
    );
    assert!(
        out.contains(&format!("released {OPENS}\n")),
        "one release per open: {ctx}"
    );
    assert_eq!(
        host_result(&err, "pauses.between_install_and_removal"),
        Some("0"),
        "{ctx}"
    );
    eprintln!(
        "{point}: {} stores (gdb: bufsize at {member:#x}, evdev_open+{stores:?}), {kprobe} hits \
         each, as the guest's kprobe on evdev_open",
        stores.len()
    );
}

/// `module("evdev").statement("evdev_open@FILE:*")`: every line of evdev.c in evdev_open's
/// code (its own and those of evdev.c's helpers inlined into it), each its own probe. At the
/// address each line fired at, gdb (reading evdev's debug file, `info line *ADDR`) names the
/// same line; the line the statement test above probes fired once per open, as the guest's
/// kprobe on `evdev_open` counts; several lines ran at every open.
#[test]
fn every_line_of_a_module_function_fires_where_gdb_places_the_line() {
    if !have_qemu("every_line_of_a_module_function_fires_where_gdb_places_the_line") {
        return;
    }
    let (line, file, _) = evdev_open_line_with_room();
    let script = format!(
        "global n\nprobe module(\"evdev\").statement(\"evdev_open@{file}:*\") {{ n[pp(), addr()]++ }}\n\
         probe end {{ foreach ([p, a] in n) printf(\"line %s %x %d\\n\", p, a, n[p, a]) }}"
    );
    let OpensRun {
        out,
        ctx,
        kprobe,
        evdev_open,
        ..
    } = run_over_opens(&script);
    // (line, offset into evdev_open, hits), from `line PP ADDR N`.
    let prefix = format!("module(\"evdev\").statement(\"evdev_open@{file}:");
    let fired: Vec<(u32, u64, u64)> = out
        .lines()
        .filter_map(|l| l.strip_prefix("line "))
        .map(|l| {
            let parsed = (|| {
                let (rest, n) = l.rsplit_once(' ')?;
                let (pp, addr) = rest.rsplit_once(' ')?;
                let line = pp
                    .strip_prefix(&prefix)?
                    .strip_suffix("\")")?
                    .parse()
                    .ok()?;
                let addr = u64::from_str_radix(addr, 16).ok()?;
                Some((line, addr.checked_sub(evdev_open)?, n.parse().ok()?))
            })();
            parsed.unwrap_or_else(|| panic!("not a line of evdev_open: {l}: {ctx}"))
        })
        .collect();
    assert!(!fired.is_empty(), "{ctx}");
    let asks: Vec<String> = fired
        .iter()
        .map(|(_, off, _)| format!("info line *(evdev_open+{off})"))
        .collect();
    let answers = gdb_on_evdev(&asks);
    let gdb_lines: Vec<u32> = answers
        .lines()
        .filter_map(|l| l.strip_prefix("Line ")?.split_once(' ')?.0.parse().ok())
        .collect();
    assert_eq!(gdb_lines.len(), fired.len(), "{answers}\n{ctx}");
    // Where several lines share an address (an inlined helper's first line, a line whose code
    // is its neighbour's), gdb names the last for the address and says of ours that it "is at"
    // that address but has no code of its own.
    let shared: Vec<(u32, u64)> = fired
        .iter()
        .zip(&gdb_lines)
        .filter(|((ours, _, _), gdb)| ours != *gdb)
        .map(|((ours, off, _), _)| (*ours, *off))
        .collect();
    let asks: Vec<String> = shared
        .iter()
        .map(|(l, _)| format!("info line {file}:{l}"))
        .collect();
    let said = if asks.is_empty() {
        String::new()
    } else {
        gdb_on_evdev(&asks)
    };
    for (l, off) in &shared {
        assert!(
            said.contains(&format!(
                "Line {l} of \"{file}\" is at address 0x"
            )) && said
                .lines()
                .any(|s| s.starts_with(&format!("Line {l} of")) && s.contains(&format!("<evdev_open+{off}>"))),
            "line {l} fired at evdev_open+{off}, where gdb names another line:\n{answers}\n{said}\n{ctx}"
        );
    }
    let at_line: Vec<u64> = fired
        .iter()
        .filter(|(l, _, _)| *l == line)
        .map(|(_, _, n)| *n)
        .collect();
    assert_eq!(at_line, vec![kprobe], "line {line}: {ctx}");
    let every_open = fired.iter().filter(|(_, _, n)| *n == kprobe).count();
    assert!(
        every_open >= 3,
        "{every_open} lines ran at every open: {ctx}"
    );
    eprintln!(
        "evdev_open@{file}:*: {} lines fired ({every_open} at every open), each at an address \
         gdb gives its line",
        fired.len()
    );
}
