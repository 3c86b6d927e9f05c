//! Compiled probes in a kernel module (`module("evdev").function(...)`), found in the live
//! guest's module list when the script attaches: counts against the guest's own kprobes on
//! the same functions (`evdev:FUNC`, armed by the guest before exotap attaches) and the
//! workload's own count of its opens.

use super::*;

mod listing;
mod oracles;
mod places;

/// Opens of the keyboard's event device the job makes while the probes are in...
const OPENS: u32 = 25;
/// ... and readers of it, each of which opens it once more and reads once.
const READERS: u32 = 3;

/// The end of a job: the guest's kprobe events turned off, each one's hits printed as
/// `kprobe.NAME`, the events removed.
const KPROBE_COUNTS: &str = "echo 0 > $T/events/exotap/enable
while read -r name hits missed; do
  exotap_result \"kprobe.${name##*/}\" \"$hits\"
done < $T/kprobe_profile
echo > $T/kprobe_events
";

/// The job: evdev loaded from the initramfs, the guest's kprobes on every function of it
/// ftrace lists, then (probes in) `OPENS` opens and closes of the first event device.
fn job() -> String {
    format!(
        "insmod /modules/evdev.ko\n\
         T=/sys/kernel/tracing\n\
         n=0\n\
         for f in $(grep ' \\[evdev\\]$' $T/available_filter_functions | cut -d' ' -f1); do\n\
           echo \"p:exotap/$f evdev:$f\" >> $T/kprobe_events && n=$((n+1))\n\
         done\n\
         exotap_result kprobes \"$n\"\n\
         echo 1 > $T/events/exotap/enable\n\
         exotap_result module.loaded \"$(grep -c '^evdev ' /proc/modules)\"\n\
         exotap_wait attach\n\
         i=0\n\
         while [ $i -lt {OPENS} ]; do : < /dev/input/event0; i=$((i+1)); done\n\
         exotap_result opens \"$i\"\n\
         for i in $(seq {READERS}); do cat /dev/input/event0 > /dev/null & r=$!; sleep 0.2; kill $r; wait $r; done\n\
         exotap_wait detach\n\
         {KPROBE_COUNTS}"
    )
}

/// The counts a script printed as `TAG NAME N` lines (`tag` with its space), by name.
fn printed(out: &str, tag: &str) -> BTreeMap<String, u64> {
    out.lines()
        .filter_map(|l| {
            let (name, n) = l.strip_prefix(tag)?.rsplit_once(' ')?;
            Some((name.to_owned(), n.parse().ok()?))
        })
        .collect()
}

/// Boots `initrd` with `script` compiled in (`--compile require`), attached in the job:
/// exotap's exit code, stdout and stderr, the guest's console (written to `console`), and
/// all of these as one context for assertion messages.
fn boot_script(
    initrd: &std::path::Path,
    console: &std::path::Path,
    script: &str,
) -> (i32, String, String, String, String) {
    let (code, out, err) = run(exotap()
        .args(["boot", "--timeout", "300", "--compile", "require"])
        .args(["--script-text", script, "--attach-in-job"])
        .arg("--initrd")
        .arg(initrd)
        .arg("--console")
        .arg(console));
    let transcript = std::fs::read_to_string(console).unwrap_or_default();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nconsole:\n{transcript}");
    (code, out, err, transcript, ctx)
}

/// The initramfs of `job`, with the default kernel's evdev.ko in `/modules`.
fn initramfs(dir: &std::path::Path, job: &str) -> std::path::PathBuf {
    common::initramfs_with_evdev(dir, exotap_guest_images::DEFAULT_KERNEL, job)
}

#[test]
fn module_function_counts_equal_the_guests_kprobes_on_a_module_loaded_before_the_script() {
    if !have_qemu(
        "module_function_counts_equal_the_guests_kprobes_on_a_module_loaded_before_the_script",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = initramfs(dir.path(), &job());
    let console = dir.path().join("console.log");
    let script = r#"global c, all
        probe module("evdev").function("evdev_open"),
              module("evdev").function("evdev_release"),
              module("evdev").function("evdev_fasync") { c[probefunc()]++ }
        probe module("evdev").function("evdev_open").return {
            c["evdev_open.return"]++
            if ($return != 0) c["evdev_open.failed"]++
        }
        probe module("ev*").function("evdev_*") { all[probefunc()]++ }
        probe end {
            foreach (f in c+) printf("c %s %d\n", f, c[f])
            foreach (f in all+) printf("all %s %d\n", f, all[f])
        }"#;
    let (code, out, err, transcript, ctx) = boot_script(&initrd, &console, script);
    assert_eq!(code, 0, "{ctx}");
    assert_eq!(result(&transcript, "module.loaded"), Some("1"), "{ctx}");
    assert_eq!(
        result(&transcript, "opens"),
        Some(&*OPENS.to_string()),
        "{ctx}"
    );
    let counts = printed(&out, "c ");
    let all = printed(&out, "all ");
    // The guest's kprobes on the same functions, over the same window (armed before exotap
    // attached, read after it left): the same counts.
    for f in ["evdev_open", "evdev_release"] {
        let k: u64 = result(&transcript, &format!("kprobe.{f}"))
            .and_then(|k| k.parse().ok())
            .unwrap_or_else(|| panic!("no kprobe count for {f}: {ctx}"));
        assert_eq!(counts.get(f).copied().unwrap_or(0), k, "{f}: {ctx}");
        assert_eq!(
            all.get(f).copied().unwrap_or(0),
            k,
            "{f} by wildcard: {ctx}"
        );
        // Each open and close of the job, and nothing else opened the device meanwhile.
        assert_eq!(k, u64::from(OPENS + READERS), "{f}: {ctx}");
    }
    // The wildcard over every evdev function against the guest's kprobe on each: every
    // function either side saw, the same count.
    let kprobes: BTreeMap<&str, u64> = transcript
        .lines()
        .filter_map(|l| {
            let rest = &l[l.find("EXOTAP-RESULT kprobe.")? + "EXOTAP-RESULT kprobe.".len()..];
            let (name, n) = rest.trim_end().split_once('=')?;
            Some((name, n.parse().ok()?))
        })
        .collect();
    let armed: usize = result(&transcript, "kprobes")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(
        armed >= 10 && kprobes.len() == armed,
        "{armed} kprobes armed: {ctx}"
    );
    for (name, &k) in &kprobes {
        assert_eq!(all.get(*name).copied().unwrap_or(0), k, "{name}: {ctx}");
    }
    for name in all.keys() {
        assert!(
            kprobes.contains_key(name.as_str()),
            "{name} has no kprobe: {ctx}"
        );
    }
    // A function the workload never calls: 0 on both sides.
    assert_eq!(
        result(&transcript, "kprobe.evdev_fasync"),
        Some("0"),
        "{ctx}"
    );
    assert_eq!(counts.get("evdev_fasync"), None, "{ctx}");
    // `$return` at a module's return probe: each open succeeded.
    assert_eq!(counts.get("evdev_open.failed"), None, "{ctx}");
    assert_eq!(
        counts.get("evdev_open.return"),
        Some(&u64::from(OPENS + READERS)),
        "{ctx}"
    );
    assert_eq!(all.get("evdev_read"), Some(&u64::from(READERS)), "{ctx}");
    // Compiled: the guest never stopped between install and removal.
    assert_eq!(
        host_result(&err, "pauses.between_install_and_removal"),
        Some("0"),
        "{ctx}"
    );
    eprintln!(
        "evdev_open/evdev_release counted {} times each, equal to the guest's kprobes; \
         {} of evdev's functions equal to the guest's kprobes on them: {all:?}",
        OPENS + READERS,
        kprobes.len()
    );
}

/// evdev's functions the compiler inlined, each into one caller: (function, caller).
const INLINED: [(&str, &str); 4] = [
    ("evdev_open_device", "evdev_open"),
    ("evdev_attach_client", "evdev_open"),
    ("evdev_close_device", "evdev_release"),
    ("evdev_detach_client", "evdev_release"),
];

#[test]
fn inlined_instances_in_a_module_run_once_per_call_of_their_caller() {
    if !have_qemu("inlined_instances_in_a_module_run_once_per_call_of_their_caller") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = initramfs(dir.path(), &job());
    let console = dir.path().join("console.log");
    // The instances come from evdev's DWARF; `$evdev` at the opening one by its location,
    // that one named with its declaring file (`f@FILE`).
    let probes: String = INLINED
        .iter()
        .map(|(f, _)| {
            format!("probe module(\"evdev\").function(\"{f}\").inline {{ c[\"{f}\"]++ }}\n")
        })
        .collect();
    let script = format!(
        "global c, dev, whole\n{probes}\
         probe module(\"evdev\").function(\"evdev_open_device@drivers/input/evdev.c\").inline {{ dev[$evdev->exist]++ }}\n\
         probe module(\"evdev\").function(\"evdev_attach_client\") {{ whole++ }}\n\
         probe end {{ foreach (f in c) printf(\"c %s %d\\n\", f, c[f])\n\
                      printf(\"whole %d\\n\", whole)\n\
                      foreach (e in dev) printf(\"exist %d %d\\n\", e, dev[e]) }}"
    );
    let (code, out, err, transcript, ctx) = boot_script(&initrd, &console, &script);
    assert_eq!(code, 0, "{ctx}");
    let counts = printed(&out, "c ");
    // Each inlined copy ran once per call of the function it is in, as the guest's kprobe
    // on that function counted them.
    for (f, caller) in INLINED {
        let k: u64 = result(&transcript, &format!("kprobe.{caller}"))
            .and_then(|k| k.parse().ok())
            .unwrap_or_else(|| panic!("no kprobe count for {caller}: {ctx}"));
        assert_eq!(k, u64::from(OPENS + READERS), "{caller}: {ctx}");
        assert_eq!(counts.get(f).copied(), Some(k), "{f} in {caller}: {ctx}");
    }
    // Without `.inline`, a function named without wildcards is its entry and its inlined
    // instances, as in SystemTap: evdev_attach_client has no out-of-line copy.
    assert!(
        out.contains(&format!("whole {}\n", OPENS + READERS)),
        "{ctx}"
    );
    // The device existed at every open.
    assert_eq!(
        printed(&out, "exist "),
        BTreeMap::from([("1".to_owned(), u64::from(OPENS + READERS))]),
        "{ctx}"
    );
    // Compiled, every instance: none refused (an instance whose instruction is too short for
    // a splice is entered from a breakpoint, one stop per hit, nothing evaluated on the host).
    assert!(err.contains("(0 refused)"), "{ctx}");
}

/// Sizes of the reads the job's readers ask of evdev, one reader each.
const READ_SIZES: [u32; 2] = [48, 96];

/// The job: evdev loaded, the device number of its first event device as the guest's `stat`
/// gives it, the guest's kprobe on `evdev_read`, then (probes in) `OPENS` opens and one
/// reader of each of [`READ_SIZES`] bytes.
fn vars_job() -> String {
    let readers: String = READ_SIZES
        .iter()
        .map(|n| {
            format!(
                "dd if=/dev/input/event0 of=/dev/null bs={n} count=1 2>/dev/null & r=$!; \
                 sleep 0.2; kill $r; wait $r\n"
            )
        })
        .collect();
    format!(
        "insmod /modules/evdev.ko\n\
         T=/sys/kernel/tracing\n\
         exotap_result event0 \"$(stat -c '%t %T' /dev/input/event0)\"\n\
         echo 'p:exotap/evdev_read evdev:evdev_read' >> $T/kprobe_events\n\
         echo 1 > $T/events/exotap/enable\n\
         exotap_wait attach\n\
         i=0\n\
         while [ $i -lt {OPENS} ]; do : < /dev/input/event0; i=$((i+1)); done\n\
         {readers}\
         exotap_wait detach\n\
         echo 0 > $T/events/exotap/enable\n\
         exotap_result kprobe.evdev_read \"$(awk '{{print $2}}' $T/kprobe_profile)\"\n\
         echo > $T/kprobe_events\n"
    )
}

/// The device number the job's result `tag` holds as the guest's `stat -c '%t %T'` gives it
/// (hex major and minor), as the kernel keeps it in an inode (`MKDEV`: the major above 20
/// bits of minor).
fn device_number(transcript: &str, tag: &str) -> Option<u64> {
    parse_device_number(result(transcript, tag)?)
}

/// `MAJOR MINOR` in hex (`stat -c '%t %T'`) as the kernel's `dev_t` ([`device_number`]).
fn parse_device_number(text: &str) -> Option<u64> {
    let (major, minor) = text.split_once(' ')?;
    let (major, minor) = (
        u64::from_str_radix(major, 16).ok()?,
        u64::from_str_radix(minor, 16).ok()?,
    );
    Some((major << 20) | minor)
}

#[test]
fn module_target_variables_come_from_the_modules_dwarf() {
    if !have_qemu("module_target_variables_come_from_the_modules_dwarf") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = initramfs(dir.path(), &vars_job());
    let console = dir.path().join("console.log");
    // `$inode` and `$count` are parameters of evdev's functions, described only by evdev's
    // own debug file; `$inode->i_rdev` is laid out from the kernel's BTF.
    // At the returns, the parameters as they were at the entry (from evdev's BTF).
    let script = r#"global rdev, sizes, opened
        probe module("evdev").function("evdev_open") { rdev[$inode->i_rdev]++ }
        probe module("evdev").function("evdev_read") { sizes[$count]++ }
        probe module("evdev").function("evdev_open").return {
            opened[sprintf("%d/%d", @entry($inode->i_rdev), $return)]++
        }
        probe end {
            foreach (d in rdev) printf("rdev %d %d\n", d, rdev[d])
            foreach (n in sizes+) printf("size %d %d\n", n, sizes[n])
            foreach (k in opened) printf("opened %s %d\n", k, opened[k])
        }"#;
    let (code, out, err, transcript, ctx) = boot_script(&initrd, &console, script);
    assert_eq!(code, 0, "{ctx}");
    // The device number the guest's stat gives.
    let device = device_number(&transcript, "event0")
        .unwrap_or_else(|| panic!("no device number of event0: {ctx}"));
    let rdev = printed(&out, "rdev ");
    let expected = BTreeMap::from([(
        device.to_string(),
        u64::from(OPENS + READ_SIZES.len() as u32),
    )]);
    assert_eq!(
        rdev, expected,
        "every open of event0, its device number: {ctx}"
    );
    let opened: BTreeMap<String, u64> = expected
        .iter()
        .map(|(d, n)| (format!("{d}/0"), *n))
        .collect();
    assert_eq!(
        printed(&out, "opened "),
        opened,
        "each open returned 0: {ctx}"
    );
    // Each reader's size, once each, and as many reads as the guest's kprobe counted.
    let sizes = printed(&out, "size ");
    let asked: BTreeMap<String, u64> = READ_SIZES.iter().map(|n| (n.to_string(), 1)).collect();
    assert_eq!(sizes, asked, "{ctx}");
    assert_eq!(
        result(&transcript, "kprobe.evdev_read"),
        Some(&*READ_SIZES.len().to_string()),
        "{ctx}"
    );
    assert_eq!(
        host_result(&err, "pauses.between_install_and_removal"),
        Some("0"),
        "{ctx}"
    );
    eprintln!("evdev's $inode->i_rdev and $count read from its debug file: {rdev:?} {sizes:?}");
}

/// evdev's functions the guest's kprobes watch in [`LOAD_JOB`], registered before evdev is
/// loaded (the kernel arms a kprobe on a module that is not there when the module comes).
const WATCHED: &str = "evdev_open evdev_release evdev_read evdev_connect evdev_disconnect \
                       evdev_cleanup evdev_free evdev_fasync";

/// The job: with exotap's probes in, twice: the guest's kprobes on [`WATCHED`], pending (the
/// kernel arms them when the module comes; it does not arm them again at a second load, so
/// each round defines its own), evdev loaded (its init connects it to every input device),
/// opened, unloaded under the probes, and the kprobes' counts printed.
fn load_job() -> String {
    format!(
        "T=/sys/kernel/tracing\n\
         exotap_wait attach\n\
         for round in 1 2; do\n\
           for f in {WATCHED}; do echo \"p:exotap/$f evdev:$f\" >> $T/kprobe_events; done\n\
           echo 1 > $T/events/exotap/enable\n\
           insmod /modules/evdev.ko\n\
           exotap_result round$round.event0 \"$(stat -c '%t %T' /dev/input/event0)\"\n\
           exotap_result round$round.events \"$(for e in /dev/input/event*; do stat -c '%t %T' $e; done | tr '\\n' ,)\"\n\
           i=0\n\
           while [ $i -lt {OPENS} ]; do : < /dev/input/event0; i=$((i+1)); done\n\
           rmmod evdev\n\
           exotap_result round$round.gone \"$(grep -c '^evdev ' /proc/modules)\"\n\
           echo 0 > $T/events/exotap/enable\n\
           while read -r name hits missed; do\n\
             exotap_result \"kprobe$round.${{name##*/}}\" \"$hits\"\n\
           done < $T/kprobe_profile\n\
           echo > $T/kprobe_events\n\
         done\n\
         exotap_wait detach\n"
    )
}

#[test]
fn module_probes_go_in_when_the_module_loads_and_out_before_it_is_freed() {
    if !have_qemu("module_probes_go_in_when_the_module_loads_and_out_before_it_is_freed") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let initrd = initramfs(dir.path(), &load_job());
    let console = dir.path().join("console.log");
    // `$inode` from evdev's debug file, placed where each load put the module.
    // `$evdev` is a `struct evdev`, a type of evdev's own: laid out from its split BTF, also
    // through a local copied from it.
    let script = r#"global c, rdev, devt, auto
        probe module("evdev").function("evdev_*") { c[probefunc()]++ }
        probe module("evdev").function("evdev_open") { rdev[$inode->i_rdev]++ }
        probe module("evdev").function("evdev_cleanup") {
            devt[$evdev->dev->devt]++
            e = $evdev
            auto[e->dev->devt]++
        }
        probe end {
            foreach (f in c+) printf("c %s %d\n", f, c[f])
            foreach (d in rdev) printf("rdev %d %d\n", d, rdev[d])
            foreach (d in devt) printf("devt %d %d\n", d, devt[d])
            foreach (d in auto) printf("auto %d %d\n", d, auto[d])
        }"#;
    let (code, out, err, transcript, ctx) = boot_script(&initrd, &console, script);
    assert_eq!(code, 0, "{ctx}");
    for bad in ["Oops", "BUG:", "general protection", "WARNING:"] {
        assert!(!transcript.contains(bad), "{bad}: {ctx}");
    }
    // Unloaded each round, with exotap's probes in.
    assert_eq!(result(&transcript, "round1.gone"), Some("0"), "{ctx}");
    assert_eq!(result(&transcript, "round2.gone"), Some("0"), "{ctx}");
    let counts = printed(&out, "c ");
    // Each watched function: the script's count over both loads equals the guest's kprobe,
    // its init's connects and its exit's disconnects included.
    for f in WATCHED.split_whitespace() {
        let k: u64 = (1..=2)
            .map(|round| {
                result(&transcript, &format!("kprobe{round}.{f}"))
                    .and_then(|k| k.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("no kprobe count for {f} in round {round}: {ctx}"))
            })
            .sum();
        assert_eq!(counts.get(f).copied().unwrap_or(0), k, "{f}: {ctx}");
    }
    assert_eq!(
        counts.get("evdev_open"),
        Some(&u64::from(2 * OPENS)),
        "{ctx}"
    );
    assert!(
        counts.get("evdev_connect").is_some_and(|&n| n >= 2)
            && counts.get("evdev_connect") == counts.get("evdev_disconnect"),
        "{ctx}"
    );
    // Every open read its inode's device number, the one the guest's stat gives, at both
    // loads.
    let devices: BTreeMap<String, u64> = (1..=2)
        .map(|round| {
            device_number(&transcript, &format!("round{round}.event0"))
                .unwrap_or_else(|| panic!("no device number of event0 in round {round}: {ctx}"))
                .to_string()
        })
        .fold(BTreeMap::new(), |mut m, d| {
            *m.entry(d).or_insert(0) += u64::from(OPENS);
            m
        });
    assert_eq!(printed(&out, "rdev "), devices, "{ctx}");
    // Each unload cleans up every event device evdev made, each with its device number.
    let mut cleaned: BTreeMap<String, u64> = BTreeMap::new();
    for round in 1..=2 {
        let list = result(&transcript, &format!("round{round}.events"))
            .unwrap_or_else(|| panic!("no event devices in round {round}: {ctx}"));
        for pair in list.split(',').filter(|p| !p.is_empty()) {
            let d = parse_device_number(pair)
                .unwrap_or_else(|| panic!("bad device number {pair:?}: {ctx}"));
            *cleaned.entry(d.to_string()).or_insert(0) += 1;
        }
    }
    assert!(!cleaned.is_empty(), "{ctx}");
    assert_eq!(printed(&out, "devt "), cleaned, "{ctx}");
    // The same through a local copied from `$evdev` (autocast).
    assert_eq!(printed(&out, "auto "), cleaned, "{ctx}");
    // Each load and unload stopped the guest once; no hit did.
    assert_eq!(
        host_result(&err, "modules.loads_unloads"),
        Some("2/2"),
        "{ctx}"
    );
    eprintln!("over two loads and unloads of evdev, equal to the guest's kprobes: {counts:?}");
}
