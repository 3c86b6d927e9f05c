//! Helpers shared by the end-to-end tests.

#![allow(dead_code, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Output, Stdio};

/// The exotap binary under test.
pub fn exotap() -> Command {
    Command::new(env!("CARGO_BIN_EXE_exotap"))
}

/// Whether QEMU is installed; prints why a test skips when it is not.
pub fn have_qemu(test: &str) -> bool {
    let ok = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "SKIP {test}: qemu-system-x86_64 is not installed (ci/install-deps.sh installs it)"
        );
    }
    ok
}

/// Runs and captures, returning (exit code, stdout, stderr).
pub fn run(cmd: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().expect("cannot run exotap");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

/// The value of `EXOTAP-RESULT key=value` in a console transcript.
pub fn result<'a>(console: &'a str, key: &str) -> Option<&'a str> {
    let prefix = format!("EXOTAP-RESULT {key}=");
    console
        .lines()
        .find_map(|l| l.find(&prefix).map(|at| l[at + prefix.len()..].trim_end()))
}

/// The value of `HOST-RESULT key=value` (what exotap found from outside the guest).
pub fn host_result<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    let prefix = format!("HOST-RESULT {key}=");
    out.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::trim_end))
}

/// A guest someone else booted: `exotap boot ARGS` with its gdbstub on the unix socket
/// `socket`, read until a console line contains `until`. Returns the child and the rest of
/// its console. exotap boot's own log (why QEMU ended, if it does) goes to
/// [`boot_log`]`(socket)`.
pub fn boot_with_gdbstub<S: AsRef<std::ffi::OsStr>>(
    args: &[S],
    socket: &Path,
    until: &str,
) -> (Child, BufReader<ChildStdout>) {
    let mut guest = exotap()
        .arg("boot")
        .args(args)
        .arg("--gdbstub")
        .arg(format!("unix:{},server=on,wait=off", socket.display()))
        // For a job's `exotap_wait` under `--go-on-stdin`: a line on the child's stdin lets the
        // guest go; otherwise never read.
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(boot_log(socket)).map_or_else(|_| Stdio::null(), Stdio::from))
        .spawn()
        .expect("cannot start exotap boot");
    let mut console = BufReader::new(guest.stdout.take().expect("piped stdout"));
    let mut line = String::new();
    while !line.contains(until) {
        line.clear();
        let n = console
            .read_line(&mut line)
            .expect("cannot read the console");
        assert!(n > 0, "the guest ended before printing {until}");
    }
    (guest, console)
}

/// Where [`boot_with_gdbstub`] writes the log (stderr) of the `exotap boot` whose gdbstub is
/// at `socket`.
pub fn boot_log(socket: &Path) -> std::path::PathBuf {
    socket.with_extension("boot.log")
}

/// Boots the guest with `script` and `mode`, running `command`; returns (code, stdout,
/// stderr, console).
pub fn boot(script: &str, mode: &str, command: &str) -> (i32, String, String, String) {
    let dir = tempfile::tempdir().expect("cannot make a temporary directory");
    let console = dir.path().join("console.log");
    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            "400",
            "--compile",
            mode,
            "--script-text",
            script,
        ])
        .args(["--run", command, "--console"])
        .arg(&console));
    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    (code, out, err, transcript)
}

/// Samples of `exotap profile --format json` output whose stack is rooted at task `comm`.
pub fn profile_samples_of(doc: &serde_json::Value, comm: &str) -> u64 {
    doc["stacks"]
        .as_array()
        .map(|stacks| {
            stacks
                .iter()
                .filter(|s| s["frames"][0] == comm)
                .map(|s| s["count"].as_u64().unwrap_or(0))
                .sum()
        })
        .unwrap_or(0)
}

/// The kernels of the kernel matrix (issue 38): `EXOTAP_KERNELS` (ABI names separated by
/// commas or spaces, e.g. `6.1.0-50-cloud-amd64,6.12.117+deb12-cloud-amd64`), or the default
/// guest kernel alone. `ci/test.sh` sets it to the default kernel and the newest 6.12 cloud
/// kernel apt knows.
pub fn matrix_kernels() -> Vec<String> {
    kernels_from_env("EXOTAP_KERNELS")
}

/// The kernels the environment variable `var` lists (ABI names separated by commas or
/// spaces), or the default guest kernel alone when it is unset or empty.
pub fn kernels_from_env(var: &str) -> Vec<String> {
    match std::env::var(var) {
        Ok(list) if !list.trim().is_empty() => list
            .split([',', ' '])
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect(),
        _ => vec![exotap_guest_images::DEFAULT_KERNEL.to_owned()],
    }
}

/// Fetches `kernel` into the cache (`exotap image fetch --kernel`, with `--debuginfo` when
/// `debuginfo`: nothing to do when it is there), failing the test when that fails.
pub fn fetch_kernel(kernel: &str, debuginfo: bool) {
    let mut cmd = exotap();
    cmd.args(["image", "fetch", "--kernel", kernel]);
    if debuginfo {
        cmd.arg("--debuginfo");
    }
    let (code, out, err) = run(&mut cmd);
    assert_eq!(
        code, 0,
        "exotap image fetch --kernel {kernel}:\n{out}\n{err}"
    );
}

/// A sample: its name, its labels (sorted), its value.
pub type Sample = (String, Vec<(String, String)>, f64);

/// The samples of a scrape, as Prometheus's Python client parses them: (name, labels,
/// value). Panics when the text does not parse.
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    const PARSE: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append([s.name, sorted(s.labels.items()), s.value])
print(json.dumps(out))
"#;
    // Debian's python3-prometheus-client (ci/install-deps.sh) is for the system python.
    let mut child = std::process::Command::new("/usr/bin/python3")
        .args(["-c", PARSE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect(
            "cannot run /usr/bin/python3 (ci/install-deps.sh installs python3-prometheus-client)",
        );
    std::io::Write::write_all(
        &mut child.stdin.take().expect("piped stdin"),
        text.as_bytes(),
    )
    .expect("cannot write to the parser");
    let out = child.wait_with_output().expect("the parser's output");
    assert!(
        out.status.success(),
        "Prometheus's parser refused the metrics (or python3-prometheus-client is missing: \
         ci/install-deps.sh installs it):\n{}\n--- the metrics:\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Sample> = serde_json::from_slice(&out.stdout).expect("json from the parser");
    rows
}

/// Fails when the guest's console shows the kernel hurt: an oops, a BUG, a WARNING, a general
/// protection fault or an invalid opcode.
pub fn assert_console_clean(transcript: &str) {
    for bad in [
        "Oops",
        "BUG:",
        "WARNING:",
        "general protection",
        "invalid opcode",
    ] {
        assert!(
            !transcript.contains(bad),
            "{bad} in the console:\n{transcript}"
        );
    }
}

/// Boots the guest with `script` (`--compile MODE`) whose `job` calls `exotap_wait attach`
/// and `exotap_wait detach` itself (`--attach-in-job`), with `extra` options (such as
/// `--compare-kprobes`); returns (code, stdout, stderr, console).
pub fn boot_attached_in_job(
    script: &str,
    mode: &str,
    job: &str,
    timeout: &str,
    extra: &[&str],
) -> (i32, String, String, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let console = dir.path().join("console.log");
    let job_file = dir.path().join("job.sh");
    std::fs::write(&job_file, job).expect("the job file");
    let (code, out, err) = run(exotap()
        .args([
            "boot",
            "--timeout",
            timeout,
            "--compile",
            mode,
            "--script-text",
            script,
        ])
        .arg("--attach-in-job")
        .args(extra)
        .arg("--job")
        .arg(&job_file)
        .arg("--console")
        .arg(&console));
    let transcript = std::fs::read_to_string(&console).unwrap_or_default();
    (code, out, err, transcript)
}

/// The console of a booted guest, read line by line from the start as it comes (so that a
/// line's time of arrival is when the guest printed it, give or take the pipe): for a test
/// whose job would run on long after the checks, to end the guest as soon as its job shows
/// it still runs after them (instead of waiting out a fixed length of workload).
pub struct Console {
    lines: std::sync::mpsc::Receiver<(std::time::Instant, String)>,
    read: String,
}

impl Console {
    /// Follows `console` (the one [`boot_with_gdbstub`] returns) from here on.
    pub fn follow(mut console: BufReader<ChildStdout>) -> Self {
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || loop {
            let mut line = String::new();
            let n = console.read_line(&mut line).unwrap_or(0);
            if n == 0 || tx.send((std::time::Instant::now(), line)).is_err() {
                break;
            }
        });
        Self {
            lines,
            read: String::new(),
        }
    }

    /// Waits until each of `beats` (a line each loop of the job prints once per round) has
    /// been printed twice after `since` (the first may close a round begun before it);
    /// returns the whole console read. A job that stops beating fails after 120 s (a round
    /// takes seconds), a guest that ends fails.
    pub fn beats_after(mut self, since: std::time::Instant, beats: &[&str]) -> String {
        let mut seen = vec![0usize; beats.len()];
        while seen.iter().any(|n| *n < 2) {
            let left = std::time::Duration::from_secs(120).saturating_sub(since.elapsed());
            let (at, line) = match self.lines.recv_timeout(left) {
                Ok(got) => got,
                Err(e) => panic!(
                    "the job did not beat twice more ({beats:?}: {seen:?}; {e}):\n{}",
                    self.read
                ),
            };
            if at > since {
                for (n, beat) in seen.iter_mut().zip(beats) {
                    *n += usize::from(line.contains(beat));
                }
            }
            self.read.push_str(&line);
        }
        self.read
    }
}

/// The initramfs of `job` with `kernel`'s cached evdev.ko in `/modules` (the tests of module
/// text: stacks through it, probes in it), written under `dir`.
pub fn initramfs_with_evdev(dir: &Path, kernel: &str, job: &str) -> std::path::PathBuf {
    use exotap_guest_images::{self as images, GuestJob};
    let cached = images::ensure_kernel(kernel).expect("the kernel is not in the cache");
    let evdev = cached
        .modules
        .iter()
        .find(|p| p.file_name().is_some_and(|n| n == "evdev.ko"))
        .unwrap_or_else(|| panic!("{kernel}: evdev.ko is not in the kernel cache"));
    let mut fs = images::build_initramfs(&GuestJob::from_script(job)).expect("the initramfs");
    fs.file(
        "modules/evdev.ko",
        0o644,
        std::fs::read(evdev).expect("evdev.ko"),
    )
    .expect("evdev.ko in the initramfs");
    let out = dir.join("initramfs.cpio.gz");
    let mut file =
        std::io::BufWriter::new(std::fs::File::create(&out).expect("the initramfs file"));
    fs.write_gz(&mut file).expect("the initramfs written");
    std::io::Write::flush(&mut file).expect("the initramfs written");
    out
}
