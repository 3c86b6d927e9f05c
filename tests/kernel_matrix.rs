//! The kernel matrix (issue 38): for each kernel of [`common::matrix_kernels`] (the default
//! guest kernel, or `EXOTAP_KERNELS`), one booted guest under a steady workload and every
//! capability checked on it from outside with `--target`, each against the guest's own
//! answer:
//! - the KASLR slide exotap finds = the one `/proc/kallsyms` shows (`_stext`);
//! - counts of ten functions = the guest's kprobes on them over the same window;
//! - a compiled script with a map, an aggregate and a `.return` probe: its entry count =
//!   the guest's kprobe, its returns = the guest's kretprobe (but for the calls in flight at
//!   either end);
//! - a compiled probe in a kernel module (evdev, which the job loads): its count = the
//!   guest's kprobe on the same function; from the module's DWARF (the -dbg package's debug
//!   file), `$inode` an input device's and a member write counted once per open;
//! - `trace`: entries and returns that pair up per task, 0 records lost;
//! - `nullify` getppid: the guest's getppid returns 4242 while it is in, its real value after;
//! - `backtrace --proc-style` of a sleeping task = its `/proc/PID/stack`;
//! - a SIGKILLed exotap: its guardian takes its splices out (`recover` finds nothing left);
//! - the kernel text's hash at the end = the one before anything went in, and no oops,
//!   BUG or WARNING in the console.
//!
//! `count --blocks` against the guest's kprobes at every block leader needs the job's
//! `exotap_wait` windows: `tests/jit_qemu.rs` runs it, on each kernel of
//! `EXOTAP_JIT_KERNELS` (`ci/test.sh` sets it to this matrix's kernels).
//!
//! ```text
//! EXOTAP_KERNELS=6.1.0-50-cloud-amd64,6.12.117+deb12-cloud-amd64,6.1.0-57-amd64,6.12.117+deb12-amd64 \
//!     cargo test --test kernel_matrix -- --nocapture
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{exotap, fetch_kernel, have_qemu, matrix_kernels, run};

/// The functions counted, each with the guest's own kprobe beside it: called by the
/// workload on every kernel of the matrix.
const COUNTED: &[&str] = &[
    "__x64_sys_getppid",
    "vfs_read",
    "vfs_write",
    "vfs_open",
    "rw_verify_area",
    "do_sys_openat2",
    "do_filp_open",
    "path_openat",
    "security_file_open",
    "alloc_empty_file",
];

/// The guest's vCPUs (`exotap boot`'s default).
const VCPUS: usize = 2;

/// Most calls of `vfs_read` in flight at the script's install or removal: one running on
/// each vCPU, and the job's sleeping readers (its shell, a `grep` on a pipe, the console).
const IN_FLIGHT: u64 = 8;

/// The compiled script: a map and an aggregate filled at `vfs_read`'s entry and return.
const SCRIPT: &str = r#"
global calls, got
probe kernel.function("vfs_read") { calls[execname()]++ }
probe kernel.function("vfs_read").return { got <<< $return }
probe timer.s(3) { exit() }
probe end {
    n = 0
    foreach (c in calls) n += calls[c]
    printf("calls %d\n", n)
    printf("returns %d\n", @count(got))
}
"#;

/// The guest's job: kprobes on the counted functions and a kretprobe on `vfs_read`, a task
/// that sleeps all along (its `/proc/PID/stack` printed), `_stext` from `/proc/kallsyms`,
/// then rounds of the workload, each printing getppid's value, until the host ends it.
fn job() -> String {
    let mut job = String::from("T=/sys/kernel/tracing\n");
    for f in COUNTED {
        job.push_str(&format!(
            "echo 'p:exotap/{f} {f}' >> $T/kprobe_events || exotap_result kprobe.failed {f}\n"
        ));
    }
    job.push_str(
        "echo 'r:exotap/vfs_read_ret vfs_read' >> $T/kprobe_events || exotap_result kprobe.failed vfs_read_ret\n\
         insmod /modules/evdev.ko || exotap_result kprobe.failed insmod-evdev\n\
         echo 'p:exotap/evdev_open evdev:evdev_open' >> $T/kprobe_events || exotap_result kprobe.failed evdev_open\n\
         echo 1 > $T/events/exotap/enable\n\
         sleep 100000 &\n\
         s=$!\n\
         exotap_result sleeper $s\n\
         exotap_result stext $(grep -m1 ' _stext$' /proc/kallsyms | cut -d' ' -f1)\n\
         sleep 1\n\
         sed 's/^/SLEEPER-STACK /' /proc/$s/stack\n\
         exotap_result armed 1\n\
         i=0\n\
         while :; do\n\
           syscall-loop 20 getppid open_close pread read | grep getppid.value\n\
           mixed 1 > /dev/null\n\
           for j in 1 2 3; do : < /dev/input/event0; done\n\
           sleep 0.2\n\
           i=$((i+1)); exotap_result round $i\n\
         done\n",
    );
    job
}

/// The initramfs of [`job`] with `kernel`'s evdev.ko in `/modules` (the module probes'
/// check: every kernel of the matrix builds evdev as a module).
fn initramfs(dir: &Path, kernel: &str) -> std::path::PathBuf {
    common::initramfs_with_evdev(dir, kernel, &job())
}

/// A booted guest with its console collected line by line.
struct Guest {
    kernel: String,
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    /// Set when the console closed (the guest ended).
    ended: Arc<AtomicBool>,
    target: String,
    _dir: tempfile::TempDir,
}

impl Guest {
    fn boot(kernel: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("gdb.sock");
        let initrd = initramfs(dir.path(), kernel);
        let mut child = exotap()
            .args(["boot", "--kernel", kernel, "--timeout", "1800", "--initrd"])
            .arg(&initrd)
            .arg("--gdbstub")
            .arg(format!("unix:{},server=on,wait=off", socket.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("cannot start exotap boot");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let ended = Arc::new(AtomicBool::new(false));
        for (stream, last) in [
            (
                Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
                true,
            ),
            (Box::new(child.stderr.take().unwrap()), false),
        ] {
            let (lines, ended) = (Arc::clone(&lines), Arc::clone(&ended));
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push(line);
                }
                if last {
                    ended.store(true, Ordering::SeqCst);
                }
            });
        }
        let guest = Self {
            kernel: kernel.to_owned(),
            child,
            lines,
            ended,
            target: format!("unix:{}", socket.display()),
            _dir: dir,
        };
        guest.wait_for("EXOTAP-RESULT armed=1", Duration::from_secs(900));
        let console = guest.console();
        assert!(
            !console.contains("kprobe.failed"),
            "{kernel}: the guest could not arm its kprobes:\n{console}"
        );
        guest
    }

    fn console(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    fn len(&self) -> usize {
        self.lines.lock().unwrap().len()
    }

    /// Waits until a console line contains `what`; panics with the console after `limit`.
    fn wait_for(&self, what: &str, limit: Duration) {
        let began = Instant::now();
        while !self.lines.lock().unwrap().iter().any(|l| l.contains(what)) {
            assert!(
                !self.ended.load(Ordering::SeqCst),
                "{}: the guest ended before printing {what}:\n{}",
                self.kernel,
                self.console()
            );
            assert!(
                began.elapsed() < limit,
                "{}: no {what} after {} s:\n{}",
                self.kernel,
                limit.as_secs(),
                self.console()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The `EXOTAP-RESULT key=` values printed from console line `from` on.
    fn results_from(&self, from: usize, key: &str) -> Vec<String> {
        let prefix = format!("EXOTAP-RESULT {key}=");
        self.lines.lock().unwrap()[from..]
            .iter()
            .filter_map(|l| {
                l.find(&prefix)
                    .map(|at| l[at + prefix.len()..].trim().to_owned())
            })
            .collect()
    }

    /// `exotap ARGS --kernel K --target T`: (exit code, stdout, stderr).
    fn exotap(&self, args: &[&str]) -> (i32, String, String) {
        run(exotap()
            .args(args)
            .args(["--kernel", &self.kernel, "--target", &self.target]))
    }

    /// The sha256 of the kernel text, and whether exotap's journal lists anything left.
    fn digest(&self) -> Result<(String, bool), String> {
        let (code, out, err) = self.exotap(&["recover", "--digest"]);
        let text = format!("{out}{err}");
        if code != 0 {
            return Err(format!("recover --digest exited {code}:\n{text}"));
        }
        let hash = text
            .lines()
            .find_map(|l| l.strip_prefix("kernel text sha256 "))
            .ok_or_else(|| format!("no text hash from recover --digest:\n{text}"))?;
        Ok((hash.trim().to_owned(), text.contains("nothing to recover")))
    }

    fn end(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::thread::sleep(Duration::from_millis(200));
        self.console()
    }
}

fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

/// The KASLR slide exotap reads = `_stext` in `/proc/kallsyms` less its link-time address.
fn slide(g: &Guest) -> Result<String, String> {
    let (code, out, err) = g.exotap(&["info"]);
    ensure(code == 0, || format!("info exited {code}:\n{out}\n{err}"))?;
    let hex = |s: &str| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok();
    let slide = out
        .lines()
        .find_map(|l| l.strip_prefix("KASLR slide"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(hex)
        .ok_or_else(|| format!("no KASLR slide in:\n{out}"))?;
    let (code, sym, err) = run(exotap().args(["symbols", "_stext", "--kernel", &g.kernel]));
    ensure(code == 0, || {
        format!("symbols exited {code}:\n{sym}\n{err}")
    })?;
    let link = sym
        .lines()
        .find(|l| l.ends_with(" _stext") || l.contains(" _stext "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(hex)
        .ok_or_else(|| format!("no _stext in:\n{sym}"))?;
    let kallsyms = g
        .results_from(0, "stext")
        .first()
        .and_then(|v| hex(v))
        .ok_or("the guest printed no _stext")?;
    ensure(link.wrapping_add(slide) == kallsyms, || {
        format!("_stext {link:#x} + slide {slide:#x} != /proc/kallsyms {kallsyms:#x}")
    })?;
    Ok(format!(
        "slide {slide:#x}: _stext at {kallsyms:#x} as /proc/kallsyms says"
    ))
}

/// The rows `COUNT KPROBE MISSED FUNCTION` of `count --compare-kprobes`.
fn count_rows(out: &str) -> BTreeMap<String, (u64, Option<(u64, u64)>)> {
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let [n, k, m, name] = f.as_slice() else {
                return None;
            };
            let n = n.parse().ok()?;
            let k = k.parse().ok().zip(m.parse().ok());
            Some(((*name).to_owned(), (n, k)))
        })
        .collect()
}

/// Counts of the ten functions = the guest's kprobe hits (with its misses) over the window.
fn counts(g: &Guest) -> Result<String, String> {
    let mut args = vec!["count"];
    args.extend_from_slice(COUNTED);
    args.extend_from_slice(&["--compare-kprobes", "--duration", "3"]);
    let (code, out, err) = g.exotap(&args);
    ensure(code == 0, || format!("count exited {code}:\n{out}\n{err}"))?;
    let rows = count_rows(&out);
    let mut total = 0;
    for f in COUNTED {
        let (n, k) = rows
            .get(*f)
            .ok_or_else(|| format!("no count of {f}:\n{out}\n{err}"))?;
        let (hits, missed) = k.ok_or_else(|| format!("no guest kprobe beside {f}:\n{out}"))?;
        ensure(*n == hits + missed, || {
            format!("{f}: exotap counted {n}, the guest's kprobe {hits} (+{missed} missed):\n{out}")
        })?;
        total += n;
    }
    ensure(rows.get("vfs_read").is_some_and(|r| r.0 > 0), || {
        format!("the workload's reads were not seen:\n{out}")
    })?;
    ensure(text_identical(&out), || {
        format!("text not restored:\n{out}")
    })?;
    Ok(format!(
        "{} functions, {total} calls = the guest's kprobes",
        COUNTED.len()
    ))
}

fn text_identical(out: &str) -> bool {
    out.lines()
        .any(|l| l.starts_with("text: ") && l.ends_with(": identical"))
}

/// The compiled script: calls = the guest's kprobe on `vfs_read`, returns = its kretprobe.
fn compiled(g: &Guest, dir: &Path) -> Result<String, String> {
    let file = dir.join("matrix.stp");
    std::fs::write(&file, SCRIPT).unwrap();
    let (code, out, err) = g.exotap(&[
        "run",
        "--compile",
        "require",
        "--compare-kprobes",
        file.to_str().unwrap(),
    ]);
    ensure(code == 0, || format!("run exited {code}:\n{out}\n{err}"))?;
    let field = |key: &str| -> Result<u64, String> {
        out.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| format!("no '{key}' in:\n{out}\n{err}"))
    };
    let kprobe = |key: &str| -> Result<u64, String> {
        err.lines()
            .find_map(|l| l.strip_prefix(&format!("HOST-RESULT kprobe.{key}=")))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| format!("no guest kprobe count for {key}:\n{err}"))
    };
    let (calls, returns) = (field("calls ")?, field("returns ")?);
    let (k, kr) = (kprobe("vfs_read")?, kprobe("vfs_read%return")?);
    ensure(calls == k, || {
        format!("the script counted {calls} calls, the guest's kprobe {k}:\n{out}\n{err}")
    })?;
    // The kretprobe, armed long before, also counts the returns of calls entered before the
    // script's probes went in (a task asleep in a read of a pipe or of the console); the
    // script's `.return` counts only those it saw enter, and neither counts a call still in
    // flight at the removal: they differ by the calls in flight at either end.
    ensure(returns.abs_diff(kr) <= IN_FLIGHT, || {
        format!(
            "the script counted {returns} returns, the guest's kretprobe {kr} (at most \
             {IN_FLIGHT} apart):\n{out}\n{err}"
        )
    })?;
    ensure(calls > 0, || format!("no call seen:\n{out}\n{err}"))?;
    Ok(format!(
        "compiled: {calls} calls = kprobe {k}, {returns} returns ~ kretprobe {kr}"
    ))
}

/// A compiled probe in a module (evdev, loaded by the job): its count = the guest's kprobe
/// on the same function over the same window (both read at the install and removal stops).
/// With the module's own DWARF (its debug file from the kernel's -dbg package): `$inode` at
/// each open is an input device's (major 13, Linux's `INPUT_MAJOR`), and the member write
/// `module("evdev").field("struct evdev_client", "bufsize").write` (each open sets its new
/// client's buffer size once) counts the opens too.
fn module(g: &Guest, dir: &Path) -> Result<String, String> {
    let file = dir.join("module.stp");
    std::fs::write(
        &file,
        "global n, major, w\n\
         probe module(\"evdev\").function(\"evdev_open\") { n++; major[$inode->i_rdev >> 20]++ }\n\
         probe module(\"evdev\").field(\"struct evdev_client\", \"bufsize\").write { w++ }\n\
         probe timer.s(2) { exit() }\n\
         probe end { printf(\"opens %d\\n\", n); printf(\"bufsize %d\\n\", w)\n\
                     foreach (m in major) printf(\"major %d %d\\n\", m, major[m]) }\n",
    )
    .unwrap();
    let (code, out, err) = g.exotap(&[
        "run",
        "--compile",
        "require",
        "--compare-kprobes",
        file.to_str().unwrap(),
    ]);
    ensure(code == 0, || format!("run exited {code}:\n{out}\n{err}"))?;
    let opens: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("opens "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no 'opens' in:\n{out}\n{err}"))?;
    let k: u64 = err
        .lines()
        .find_map(|l| l.strip_prefix("HOST-RESULT kprobe.evdev:evdev_open="))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no guest kprobe count for evdev:evdev_open:\n{err}"))?;
    ensure(opens == k && opens > 0, || {
        format!("the script counted {opens} opens, the guest's kprobe {k}:\n{out}\n{err}")
    })?;
    let majors: Vec<&str> = out.lines().filter(|l| l.starts_with("major ")).collect();
    ensure(majors == [format!("major 13 {opens}")], || {
        format!("$inode->i_rdev's majors at the {opens} opens: {majors:?}\n{out}\n{err}")
    })?;
    ensure(out.contains(&format!("bufsize {opens}\n")), || {
        format!("bufsize writes at {opens} opens:\n{out}\n{err}")
    })?;
    Ok(format!(
        "module evdev: {opens} opens = kprobe {k}, $inode major 13 at each, {opens} bufsize writes"
    ))
}

/// `trace vfs_write`: every return pairs with an entry of its task (but those in flight at
/// either end), and no record lost.
fn trace(g: &Guest) -> Result<String, String> {
    let (code, out, err) = g.exotap(&["trace", "vfs_write", "--duration", "3"]);
    ensure(code == 0, || format!("trace exited {code}:\n{out}\n{err}"))?;
    let summary = out
        .lines()
        .find(|l| l.starts_with("trace: "))
        .ok_or_else(|| format!("no trace summary:\n{out}\n{err}"))?;
    let lost = summary
        .split_once('[')
        .and_then(|(_, l)| l.strip_suffix(']'))
        .ok_or_else(|| format!("no overruns in '{summary}'"))?;
    ensure(lost.split(',').all(|n| n.trim() == "0"), || {
        format!("records lost: {summary}")
    })?;
    // `  TIME us  cpuN  comm[pid]  -> vfs_write(...)` and `... <- vfs_write = V [...]`.
    let mut open: BTreeMap<String, i64> = BTreeMap::new();
    let (mut entries, mut returns, mut unpaired) = (0, 0, 0);
    for l in out.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let Some(task) = f.get(3) else { continue };
        match f.get(4) {
            Some(&"->") => {
                entries += 1;
                *open.entry((*task).to_owned()).or_default() += 1;
            }
            Some(&"<-") => {
                returns += 1;
                let o = open.entry((*task).to_owned()).or_default();
                if *o > 0 {
                    *o -= 1;
                } else {
                    unpaired += 1;
                }
            }
            _ => {}
        }
    }
    let in_flight: i64 = open.values().sum();
    ensure(entries > 0, || format!("no entry traced:\n{out}"))?;
    ensure(unpaired <= VCPUS && in_flight <= VCPUS as i64, || {
        format!(
            "{entries} entries, {returns} returns: {unpaired} returns without their entry, \
             {in_flight} entries without their return:\n{out}"
        )
    })?;
    ensure(text_identical(&out), || {
        format!("text not restored:\n{out}")
    })?;
    Ok(format!(
        "trace: {entries} entries, {returns} returns, 0 lost"
    ))
}

/// `nullify __x64_sys_getppid 4242`: the guest sees 4242 while it is in, its real value after.
fn nullify(g: &Guest) -> Result<String, String> {
    let from = g.len();
    let (code, out, err) = g.exotap(&["nullify", "__x64_sys_getppid", "4242", "--duration", "4"]);
    ensure(code == 0, || {
        format!("nullify exited {code}:\n{out}\n{err}")
    })?;
    let until = g.len();
    let during: Vec<String> = g.lines.lock().unwrap()[from..until]
        .iter()
        .filter_map(|l| {
            l.split_once("getppid.value=")
                .map(|(_, v)| v.trim().to_owned())
        })
        .collect();
    ensure(during.iter().any(|v| v == "4242"), || {
        format!("no getppid of 4242 while nullified: {during:?}\n{out}\n{err}")
    })?;
    // The second value printed after removal comes from calls made after it.
    let began = Instant::now();
    loop {
        let after = g.results_from(until, "getppid.value");
        if let Some(v) = after.get(1) {
            ensure(v != "4242" && v.parse::<i64>().is_ok_and(|p| p > 0), || {
                format!("getppid after removal returned {v}")
            })?;
            ensure(text_identical(&out), || {
                format!("text not restored:\n{out}")
            })?;
            return Ok(format!("nullify: getppid 4242 while in, {v} after"));
        }
        ensure(began.elapsed() < Duration::from_secs(120), || {
            format!(
                "the guest printed no getppid after the removal:\n{}",
                g.console()
            )
        })?;
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `backtrace --proc-style` of the sleeping task = its `/proc/PID/stack`.
fn backtrace(g: &Guest) -> Result<String, String> {
    let pid = g
        .results_from(0, "sleeper")
        .first()
        .cloned()
        .ok_or("the guest printed no sleeper pid")?;
    let (code, out, err) = g.exotap(&["backtrace", "--pid", &pid, "--proc-style"]);
    ensure(code == 0, || {
        format!("backtrace exited {code}:\n{out}\n{err}")
    })?;
    // `  [<ffffffff8b5aced1>] hrtimer_nanosleep+0xa1/0x170`, after `task PID (sleep) S`.
    let ours: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with(&format!("task {pid} ")))
        .skip(1)
        .take_while(|l| l.trim_start().starts_with("[<"))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    let console = g.console();
    let theirs: Vec<&str> = console
        .lines()
        .filter_map(|l| l.strip_prefix("SLEEPER-STACK "))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    ensure(!theirs.is_empty() && ours == theirs, || {
        format!("exotap unwound {ours:?}, /proc/{pid}/stack says {theirs:?}:\n{out}")
    })?;
    Ok(format!(
        "backtrace: {} frames = /proc/{pid}/stack",
        ours.len()
    ))
}

/// A SIGKILLed `exotap count`: its guardian takes the splices out, `recover` finds nothing.
fn guardian(g: &Guest) -> Result<String, String> {
    let mut child = exotap()
        .args(["count", "vfs_read", "__x64_sys_getppid"])
        .args(["--kernel", &g.kernel, "--target", &g.target])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    while !line.contains("splices in") {
        line.clear();
        if err.read_line(&mut line).unwrap_or(0) == 0 {
            let _ = child.wait();
            return Err(format!(
                "exotap count ended before its splices went in:\n{seen}"
            ));
        }
        seen.push_str(&line);
    }
    let killed = Instant::now();
    Command::new("kill")
        .args(["-KILL", &child.id().to_string()])
        .status()
        .unwrap();
    let _ = child.wait();
    loop {
        let (_, clean) = g.digest()?;
        if clean {
            return Ok(format!(
                "SIGKILLed exotap: nothing left after {:.1} s",
                killed.elapsed().as_secs_f64()
            ));
        }
        ensure(killed.elapsed() < Duration::from_secs(60), || {
            "the guardian left the splices in for 60 s".to_owned()
        })?;
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn matrix_one(kernel: &str) -> Vec<(String, Result<String, String>)> {
    // With its -dbg package: the module check reads evdev's debug file.
    fetch_kernel(kernel, true);
    let began = Instant::now();
    let g = Guest::boot(kernel);
    eprintln!(
        "{kernel}: booted and armed in {:.0} s",
        began.elapsed().as_secs_f64()
    );
    let dir = tempfile::tempdir().unwrap();
    let mut results = Vec::new();
    let before = g.digest();
    type Check<'a> = Box<dyn Fn(&Guest) -> Result<String, String> + 'a>;
    let checks: Vec<(&str, Check<'_>)> = vec![
        ("slide", Box::new(slide)),
        ("count", Box::new(counts)),
        ("compiled", Box::new(|g: &Guest| compiled(g, dir.path()))),
        ("module", Box::new(|g: &Guest| module(g, dir.path()))),
        ("trace", Box::new(trace)),
        ("nullify", Box::new(nullify)),
        ("backtrace", Box::new(backtrace)),
        ("guardian", Box::new(guardian)),
    ];
    for (name, check) in checks {
        let t = Instant::now();
        let r = check(&g);
        eprintln!(
            "{kernel}: {name} ({:.1} s): {}",
            t.elapsed().as_secs_f64(),
            match &r {
                Ok(s) => format!("ok: {s}"),
                Err(e) => format!("FAILED: {e}"),
            }
        );
        results.push((name.to_owned(), r));
    }
    let after = g.digest();
    results.push((
        "text".to_owned(),
        match (before, after) {
            (Ok((b, _)), Ok((a, clean))) if a == b && clean => {
                Ok(format!("kernel text sha256 {} before and after", &a[..16]))
            }
            (b, a) => Err(format!("kernel text before {b:?}, after {a:?}")),
        },
    ));
    // The guest's job goes on: a round after every check.
    let rounds = g.results_from(0, "round").len();
    let waited = Instant::now();
    while g.results_from(0, "round").len() <= rounds && waited.elapsed() < Duration::from_secs(120)
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    let went_on = g.results_from(0, "round").len() > rounds;
    let console = g.end();
    let bad: Vec<&str> = [
        "Oops",
        "BUG:",
        "WARNING:",
        "general protection",
        "Call Trace",
    ]
    .into_iter()
    .filter(|b| console.contains(b))
    .collect();
    results.push((
        "guest".to_owned(),
        if bad.is_empty() && went_on {
            Ok(format!("{rounds} rounds of the workload, no oops"))
        } else {
            Err(format!(
                "the console has {bad:?}; the job went on: {went_on}:\n{console}"
            ))
        },
    ));
    results
}

#[test]
fn every_capability_holds_on_every_kernel_of_the_matrix() {
    let test = "every_capability_holds_on_every_kernel_of_the_matrix";
    if !have_qemu(test) {
        return;
    }
    let kernels = matrix_kernels();
    let mut failed = Vec::new();
    let mut lines = Vec::new();
    for kernel in &kernels {
        for (check, r) in matrix_one(kernel) {
            match r {
                Ok(s) => lines.push(format!("MATRIX {kernel} {check}: {s}")),
                Err(e) => {
                    lines.push(format!("MATRIX {kernel} {check}: FAILED"));
                    failed.push(format!("{kernel} {check}: {e}"));
                }
            }
        }
    }
    println!("{}", lines.join("\n"));
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
