//! Compiled probes in a kernel module (`module("evdev").function(...)`), found in the live
//! guest's module list when the script attaches: counts against the guest's own kprobes on
//! the same functions (`evdev:FUNC`, armed by the guest before exotap attaches) and the
//! workload's own count of its opens.

use super::*;

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

#[test]
fn listing_a_modules_functions_reads_the_live_guest_and_agrees_with_its_kallsyms() {
    if !have_qemu("listing_a_modules_functions_reads_the_live_guest_and_agrees_with_its_kallsyms") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let job = "insmod /modules/evdev.ko\n\
               grep '\\[evdev\\]$' /proc/kallsyms | sed 's/^/KALLSYMS /'\n\
               echo EVDEV-LISTED\n\
               sleep 600\n";
    let initrd = initramfs(dir.path(), job);
    let socket = dir.path().join("gdb.sock");
    let (mut guest, mut console) = common::boot_with_gdbstub(
        &[
            "--timeout".as_ref(),
            "300".as_ref(),
            "--initrd".as_ref(),
            initrd.as_os_str(),
        ],
        &socket,
        "EXOTAP-READY",
    );
    let mut kallsyms = std::collections::BTreeSet::new();
    let mut line = String::new();
    while !line.contains("EVDEV-LISTED") {
        line.clear();
        let n = std::io::BufRead::read_line(&mut console, &mut line).unwrap();
        assert!(n > 0, "the guest ended before listing evdev's symbols");
        // `ADDR t NAME [evdev]`: the module's text symbols the pattern names.
        let mut words = line.split_whitespace().skip(1);
        if let (Some(_), Some(kind), Some(name)) = (words.next(), words.next(), words.next()) {
            if matches!(kind, "t" | "T") && name.starts_with("evdev_") && !name.contains('.') {
                kallsyms.insert(name.to_owned());
            }
        }
    }
    let target = format!("unix:{}", socket.display());
    let (code, out, err) = run(exotap().args([
        "-l",
        r#"module("ev*").function("evdev_*")"#,
        "--target",
        &target,
    ]));
    let (code_vars, out_vars, err_vars) = run(exotap().args([
        "-L",
        r#"module("evdev").function("evdev_read")"#,
        "--target",
        &target,
    ]));
    // Without --target: from evdev's cached debug file; a module without one, an error.
    let (code_file, out_file, err_file) =
        run(exotap().args(["-l", r#"module("evdev").function("evdev_*")"#]));
    let (code_none, _, err_none) =
        run(exotap().args(["-l", r#"module("nosuchmod").function("f")"#]));
    let _ = guest.kill();
    let _ = guest.wait();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nkallsyms: {kallsyms:?}");
    assert_eq!(code, 0, "{ctx}");
    // The functions a listing of evdev's names.
    let functions = |listing: &str| -> std::collections::BTreeSet<String> {
        listing
            .lines()
            .filter_map(|l| {
                l.strip_prefix("module(\"evdev\").function(\"")?
                    .strip_suffix("\")")
                    .map(str::to_owned)
            })
            .collect()
    };
    let listed = functions(&out);
    assert!(kallsyms.len() >= 10, "{ctx}");
    assert_eq!(listed, kallsyms, "{ctx}");
    // `-L`: the parameters, with their types from evdev's BTF, written as a kernel
    // function's are (`evdev_read(struct file *file, char __user *buffer, size_t count,
    // loff_t *ppos)`).
    assert_eq!(code_vars, 0, "{out_vars}\n{err_vars}");
    assert_eq!(
        out_vars.trim(),
        r#"module("evdev").function("evdev_read") $file:struct file * $buffer:char * $count:size_t $ppos:loff_t *"#,
        "{err_vars}"
    );
    // The debug file has every function the live module has, and its init and exit, which
    // the kernel frees or leaves out of a loaded module's kallsyms.
    assert_eq!(code_file, 0, "{err_file}");
    let in_file = functions(&out_file);
    let extra: Vec<&String> = in_file.difference(&listed).collect();
    assert!(
        listed.is_subset(&in_file)
            && extra
                .iter()
                .all(|f| f.ends_with("_init") || f.ends_with("_exit")),
        "from the debug file: {in_file:?}\n{ctx}"
    );
    // Neither a live guest nor a debug file: said, not guessed.
    assert_ne!(code_none, 0, "{err_none}");
    assert!(err_none.contains("give --target"), "{err_none}");
    eprintln!(
        "{} evdev functions listed, as the guest's kallsyms has them",
        listed.len()
    );
}

/// The debug file of module `name` (`evdev.ko`) of the default kernel, from the cache.
#[allow(clippy::expect_used)] // a fixture that fails fails the test
fn module_debug_file(name: &str) -> std::path::PathBuf {
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
fn gdb_on_evdev(commands: &[String]) -> String {
    gdb_on(&module_debug_file("evdev.ko"), commands)
}

/// What gdb says of `commands` (one `-ex` each) reading `file`.
#[allow(clippy::panic)] // a fixture that fails fails the test
fn gdb_on(file: &std::path::Path, commands: &[String]) -> String {
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
const EVDEV_OPEN_LINES: u32 = 60;

/// gdb's `Line N of "FILE" starts at address 0x.. <evdev_open+OFF> ...` or `... contains no
/// code`, for `evdev_open`'s own line and each after it, as (line, file, offset when it has
/// code).
#[allow(clippy::panic, clippy::expect_used)] // a fixture that fails fails the test
fn evdev_open_lines() -> Vec<(u32, String, Option<u64>)> {
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
fn evdev_open_instruction_length(offset: u64) -> u64 {
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
fn evdev_open_line_with_room() -> (u32, String, u64) {
    let lines = evdev_open_lines();
    lines
        .iter()
        .filter_map(|(n, f, off)| off.filter(|o| *o >= 16).map(|o| (*n, f.clone(), o)))
        .find(|(_, _, o)| evdev_open_instruction_length(*o) >= 5)
        .unwrap_or_else(|| {
            panic!("no line of evdev_open past its prologue starts a splice's room: {lines:?}")
        })
}

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

/// gdb's byte offset of `struct evdev_client`'s `bufsize`, and the offsets in `evdev_open`
/// of the instructions that store to that offset from a base register (`mov ...,0xOFF(%reg)`),
/// as gdb lays out and disassembles evdev's debug file: the member writes, found without
/// exotap's join-point finder. (`evdev_open` is where evdev sets a client's buffer size.)
#[allow(clippy::panic)] // a fixture that fails fails the test
fn bufsize_stores_in_evdev_open() -> (u64, Vec<u64>) {
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

/// `-l`, `-L` and `exotap joinpoints --module` read a module's points from its cached debug
/// file, no guest: every line gdb gives code in `evdev_open` is listed as a statement (and
/// gdb places each listed line in `evdev_open`: inlined helpers' lines too), `-L`
/// names the function's parameters at each, the member writes `joinpoints` finds in
/// `evdev_open` are gdb's stores to `bufsize`, and a member evdev's types lack is an error
/// that says so, not a listing.
#[test]
#[allow(clippy::panic)] // a fixture that fails fails the test
fn module_points_list_from_the_debug_file_as_gdb_reads_it() {
    let lines = evdev_open_lines();
    let file = lines
        .first()
        .map(|(_, f, _)| f.clone())
        .unwrap_or_else(|| panic!("gdb gave no line of evdev_open"));
    let pattern = format!("module(\"evdev\").statement(\"evdev_open@{file}:*\")");
    let (code, out, err) = run(exotap().args(["-L", &pattern]));
    assert_eq!(code, 0, "{err}");
    let prefix = format!("module(\"evdev\").statement(\"evdev_open@{file}:");
    let listed: Vec<u32> = out
        .lines()
        .map(|l| {
            let (point, vars) = l.split_once(' ').unwrap_or((l, ""));
            assert!(
                vars.contains("$inode:struct inode *") && vars.contains("$file:struct file *"),
                "evdev_open's parameters at {point}: {vars:?}"
            );
            point
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_suffix("\")"))
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("not a line of evdev_open: {l}"))
        })
        .collect();
    let with_code: Vec<u32> = lines
        .iter()
        .filter(|(_, _, off)| off.is_some())
        .map(|(n, _, _)| *n)
        .collect();
    assert!(with_code.len() > 5, "{lines:?}");
    for n in &with_code {
        assert!(
            listed.contains(n),
            "line {n} has code (gdb) but is not listed: {out}"
        );
    }
    let others: Vec<String> = listed
        .iter()
        .filter(|n| !with_code.contains(n))
        .map(|n| format!("info line {file}:{n}"))
        .collect();
    // The others: lines of evdev.c's helpers inlined into evdev_open, and lines sharing an
    // address with another; gdb places each in evdev_open.
    if !others.is_empty() {
        let said = gdb_on_evdev(&others);
        let placed = said
            .lines()
            .filter(|l| l.starts_with("Line ") && l.contains("<evdev_open+"))
            .count();
        assert_eq!(
            placed,
            others.len(),
            "listed lines gdb does not place in evdev_open: {others:?}\n{said}"
        );
    }

    let (_, stores) = bufsize_stores_in_evdev_open();
    let (code, out, err) = run(exotap().args([
        "joinpoints",
        "--module",
        "evdev",
        "--function",
        "evdev_open",
        "struct evdev_client.bufsize",
    ]));
    assert_eq!(code, 0, "{err}");
    let found: Vec<u64> = out
        .lines()
        .filter(|l| l.contains(" write "))
        .filter_map(|l| {
            l.strip_prefix("<evdev_open+")?
                .split_once('>')?
                .0
                .parse()
                .ok()
        })
        .collect();
    assert_eq!(found, stores, "{out}");

    // `.inline` by file: the instances of the functions the file declares (DWARF's
    // declaring file; gdb's `info line` gives an instance's first line, often a helper's).
    // evdev's own helpers are declared in evdev.c, `spin_lock` in include/linux/spinlock.h
    // (the kernel's source); the two sets are disjoint, both within the whole module's.
    let inline_functions = |pattern: &str| -> std::collections::BTreeSet<String> {
        let (code, out, err) = run(exotap().args(["-l", pattern]));
        assert_eq!(code, 0, "{pattern}: {err}");
        out.lines()
            .map(|l| {
                l.strip_prefix("module(\"evdev\").function(\"")
                    .and_then(|r| r.strip_suffix("\").inline"))
                    .unwrap_or_else(|| panic!("{pattern} listed {l}"))
                    .to_owned()
            })
            .collect()
    };
    let all = inline_functions(r#"module("evdev").function("*").inline"#);
    let own = inline_functions(r#"module("evdev").function("*@drivers/input/evdev.c").inline"#);
    let headers = inline_functions(r#"module("evdev").function("*@include/linux/*.h").inline"#);
    let evdev_named: std::collections::BTreeSet<String> = all
        .iter()
        .filter(|f| f.starts_with("evdev_"))
        .cloned()
        .collect();
    assert!(
        evdev_named.len() >= 5
            && evdev_named.is_subset(&own)
            && own.is_subset(&all)
            && headers.is_subset(&all)
            && own.is_disjoint(&headers)
            && headers.contains("spin_lock"),
        "evdev.c: {own:?}\ninclude/linux: {headers:?}\nall: {all:?}"
    );

    let point = "module(\"evdev\").field(\"struct evdev_client\", \"bufsize\").write";
    let (code, out, err) = run(exotap().args(["-l", point]));
    assert_eq!((code, out.trim()), (0, point), "{err}");
    let (code, _, err) = run(exotap().args([
        "-l",
        "module(\"evdev\").field(\"struct evdev_client\", \"nosuch\").write",
    ]));
    assert!(
        code != 0 && err.contains("no match") && err.contains("evdev_client.nosuch"),
        "{err}"
    );
}

/// The places in module debug file `ko` that reach member bytes `member` (offsets into the
/// global `global`) RIP-relative, as binutils' `objdump -dr` shows the file's own
/// relocations: a `R_X86_64_PC32 global+A` at P in the instruction ending at N reaches
/// `global + A + (N - P)`. As (function, offset into it).
#[allow(clippy::panic)] // a fixture that fails fails the test
fn objdump_global_member_sites(
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

/// `exotap joinpoints --module kvm 'struct kvm_x86_ops.nested_ops'`: the reads of a member
/// of the module's own global `kvm_x86_ops` (RIP-relative, relocated in the debug file) are
/// the places `objdump -dr` shows reaching the member's bytes through the file's relocations
/// against `kvm_x86_ops`, at the same function and offset.
#[test]
#[allow(clippy::panic)] // a fixture that fails fails the test
fn a_modules_global_member_accesses_are_objdumps_relocated_references() {
    let ko = module_debug_file("kvm.ko");
    let layout = gdb_on(&ko, &["ptype /o struct kvm_x86_ops".to_owned()]);
    let offset = layout
        .lines()
        .find(|l| l.trim_end().ends_with("*nested_ops;"))
        .and_then(|l| l.trim_start().strip_prefix("/*"))
        .and_then(|rest| rest.split('|').next())
        .and_then(|off| off.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("gdb lays out no nested_ops in struct kvm_x86_ops:\n{layout}"));
    let expected = objdump_global_member_sites(&ko, "kvm_x86_ops", offset..offset + 8);
    assert!(expected.len() >= 5, "objdump: {expected:?}");
    let (code, out, err) = run(exotap().args([
        "joinpoints",
        "--module",
        "kvm",
        "struct kvm_x86_ops.nested_ops",
    ]));
    assert_eq!(code, 0, "{err}");
    let found: std::collections::BTreeSet<(String, u64)> = out
        .lines()
        .filter_map(|l| {
            let (function, rest) = l.strip_prefix('<')?.split_once('>')?;
            let (name, off) = function.rsplit_once('+')?;
            rest.contains("kvm_x86_ops.nested_ops")
                .then(|| Some((name.to_owned(), off.parse().ok()?)))?
        })
        .collect();
    assert_eq!(found, expected, "{out}");
}
