//! The QEMU backend's launcher: run `qemu-system-x86_64` on a kernel and initramfs, stream the
//! serial console, follow the guest protocol ([`crate::console`]) and enforce timeouts.
//!
//! Machine configuration: `-M pc` (one of three `-M microvm` boots hung at TSC calibration on
//! our machines; `-M pc` booted every time), `-nodefaults`, console on the first serial port
//! (QEMU's stdout), the host's "go" channel on the second serial port (a unix socket on which
//! exotap listens and QEMU connects). A range at the top of low RAM is hidden from the guest with
//! `memmap=SIZE$ADDR` for the patch heap.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::console::{parse_marker, ConsoleTail, Marker};

/// 2 MiB: the patch heap is mapped with PMD entries, so base and size are multiples of this.
pub const LARGE_PAGE: u64 = 2 << 20;

/// Lowest address of the 32-bit PCI hole on `-M pc`: RAM above it is moved above 4 GiB.
const PC_LOWMEM_LIMIT: u64 = 0xe000_0000;

/// The longest console line kept whole; longer ones are split.
const MAX_LINE: u64 = 64 * 1024;
/// Bytes of QEMU's stderr kept for an error message.
const MAX_STDERR: u64 = 64 * 1024;
/// How long QEMU may take to exit after closing its console, and its stderr after that.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// Errors of the QEMU launcher.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    /// The patch heap does not fit the guest's memory.
    #[error("a {heap_mib} MiB patch heap does not fit in {memory_mib} MiB of guest RAM (it must be a multiple of 2 MiB and at most half of low RAM)")]
    HeapDoesNotFit {
        /// Requested heap size.
        heap_mib: u64,
        /// Guest memory.
        memory_mib: u64,
    },
    /// QEMU could not be started.
    #[error("cannot start {qemu} (apt-get install qemu-system-x86)")]
    Spawn {
        /// The QEMU binary.
        qemu: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The control socket could not be set up.
    #[error("cannot set up the guest control socket {path}")]
    ControlSocket {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The guest did not print `EXOTAP-READY` in time.
    #[error("the guest did not reach EXOTAP-READY within {secs} s; last console lines:\n{tail}")]
    BootTimeout {
        /// The timeout.
        secs: u64,
        /// The last console lines.
        tail: String,
    },
    /// The guest did not print `EXOTAP-DONE` in time.
    #[error("the guest did not finish within {secs} s; last console lines:\n{tail}")]
    RunTimeout {
        /// The timeout.
        secs: u64,
        /// The last console lines.
        tail: String,
    },
    /// QEMU exited before the guest printed `EXOTAP-DONE`.
    #[error("QEMU exited ({status}) before the guest printed EXOTAP-DONE{stderr}; last console lines:\n{tail}")]
    Died {
        /// QEMU's exit status.
        status: String,
        /// What QEMU printed on stderr.
        stderr: String,
        /// The last console lines.
        tail: String,
    },
    /// The host's work at a wait point failed.
    #[error("the host's work at phase {phase} failed: {message}")]
    Hook {
        /// The phase.
        phase: String,
        /// What went wrong.
        message: String,
    },
    /// Writing the console copy failed.
    #[error("cannot write the console output")]
    Sink(#[source] std::io::Error),
    /// The host could not send the go byte.
    #[error("cannot send the go byte to the guest for phase {phase}")]
    Go {
        /// The phase.
        phase: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// The accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Software emulation (TCG): works everywhere.
    Tcg,
    /// Hardware KVM: only where [`crate::host::KvmSupport::usable`].
    Kvm,
}

/// How QEMU's TCG runs the vCPUs (`-accel tcg,thread=...`).
///
/// Single is the default because QEMU 7.2's multi-threaded TCG (Debian bookworm's QEMU)
/// crashes a guest that rewrites its own hot text while another vCPU runs it. Measured:
/// the Debian 6.1 guest's job arming and disarming its own kprobes (`kprobe_events`) on
/// `schedule`, `try_to_wake_up`, `pick_next_task_fair`, `dput`, `fput` and `vfs_read` 150
/// times, no exotap attached, failed in 4 of 4 multi-threaded runs (3 oopses at RIP 0, called
/// from `swake_up_one`, `call_timer_fn` and the like, 10 to 30 s in; 1 hang, CPU 0's timers
/// dead and CPU 1 in a soft lockup) and in 0 of 7 single-threaded ones (45 s each). The
/// splice test's guest once died the same way (`__schedule`'s call of a
/// `pick_next_task_fair` being patched landed at 0) as it disarmed its own kprobes. The kernel
/// patches text live with `text_poke_bp` (int3, an IPI to sync every CPU, the new bytes): for
/// kprobes and ftrace, and for every static key and jump label it flips. exotap's own text
/// writes are not affected: they go in with every vCPU stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TcgThreads {
    /// One host thread runs every vCPU in turn (`thread=single`).
    #[default]
    Single,
    /// A host thread per vCPU (`thread=multi`): a multi-threaded workload runs faster, and a
    /// guest that patches its own text may crash (see the type's documentation).
    Multi,
}

/// The guest-physical range hidden from the guest for the patch heap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchHeapRange {
    /// First byte (2 MiB aligned).
    pub base: u64,
    /// Size in bytes (a multiple of 2 MiB).
    pub size: u64,
}

impl PatchHeapRange {
    /// Places a heap of `size` bytes at the top of the guest's low RAM.
    ///
    /// # Errors
    /// When the size is not a positive multiple of 2 MiB or is more than half of low RAM.
    pub fn place(memory_bytes: u64, size: u64) -> Result<Self, QemuError> {
        let lowmem = memory_bytes.min(PC_LOWMEM_LIMIT);
        let err = || QemuError::HeapDoesNotFit {
            heap_mib: size >> 20,
            memory_mib: memory_bytes >> 20,
        };
        if size == 0 || !size.is_multiple_of(LARGE_PAGE) || size > lowmem / 2 {
            return Err(err());
        }
        let base = (lowmem - size) & !(LARGE_PAGE - 1);
        Ok(Self { base, size })
    }

    /// The kernel parameter reserving the range: `memmap=SIZE$ADDR`.
    pub fn kernel_param(&self) -> String {
        format!("memmap={}M${:#x}", self.size >> 20, self.base)
    }
}

impl std::fmt::Display for PatchHeapRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} MiB at guest-physical {:#x}..{:#x}",
            self.size >> 20,
            self.base,
            self.base + self.size
        )
    }
}

/// How to run the guest.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// The QEMU binary.
    pub qemu: PathBuf,
    /// The bzImage.
    pub kernel: PathBuf,
    /// The initramfs.
    pub initrd: PathBuf,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Number of vCPUs.
    pub cpus: u32,
    /// Accelerator.
    pub accel: Accel,
    /// With [`Accel::Tcg`]: one host thread for every vCPU, or one each.
    pub tcg_threads: TcgThreads,
    /// `-cpu` model.
    pub cpu_model: String,
    /// The patch heap's hidden range.
    pub patch_heap: PatchHeapRange,
    /// Phases at which the guest waits for the host (`all` for every phase).
    pub hold: Vec<String>,
    /// Make the guest wait at phase `attach` after `EXOTAP-READY` (`exotap.attach=1`).
    pub attach_point: bool,
    /// With `attach_point`: the job itself waits at `attach` and `detach` (`exotap.attach=job`:
    /// the init does not), so it can prepare the guest before the host attaches.
    pub attach_in_job: bool,
    /// Keep KASLR on (`nokaslr` otherwise).
    pub kaslr: bool,
    /// Extra kernel parameters.
    pub append: Vec<String>,
    /// Expose QEMU's gdbstub at this QEMU `-gdb` device (e.g. `tcp::1234`,
    /// `unix:/run/g.sock,server=on,wait=off`).
    pub gdbstub: Option<String>,
    /// Put guest RAM in this file, shared (`memory-backend-file`, `share=on`), so exotap can
    /// map it and read its rings and counters while the vCPUs run
    /// ([`crate::shared_ram`]). A tmpfs path (`/dev/shm/...`) keeps it off the disk.
    pub shared_ram: Option<PathBuf>,
    /// Extra QEMU arguments, appended last.
    pub extra_args: Vec<String>,
}

/// The kernel parameter that skips the crypto manager's boot-time self-tests (`crypto/testmgr.c`'s
/// `notests`; a kernel without it passes it on to init, which ignores it).
pub const CRYPTO_SELFTESTS_OFF: &str = "cryptomgr.notests";

impl QemuConfig {
    /// The defaults: TCG with one thread for every vCPU, `-cpu max`, 1 GiB, 2 vCPUs, a 64 MiB patch heap, KASLR on.
    ///
    /// # Errors
    /// Never for the defaults; kept fallible as [`PatchHeapRange::place`] is.
    pub fn new(kernel: PathBuf, initrd: PathBuf) -> Result<Self, QemuError> {
        let memory_mib = 1024;
        Ok(Self {
            qemu: PathBuf::from("qemu-system-x86_64"),
            kernel,
            initrd,
            memory_mib,
            cpus: 2,
            accel: Accel::Tcg,
            tcg_threads: TcgThreads::default(),
            cpu_model: "max".into(),
            patch_heap: PatchHeapRange::place(memory_mib << 20, 64 << 20)?,
            hold: Vec::new(),
            attach_point: false,
            attach_in_job: false,
            kaslr: true,
            append: Vec::new(),
            gdbstub: None,
            shared_ram: None,
            extra_args: Vec::new(),
        })
    }

    /// The kernel command line.
    pub fn cmdline(&self) -> String {
        let mut params = vec![
            "console=ttyS0,115200".to_owned(),
            "panic=-1".to_owned(),
            "quiet".to_owned(),
            // The IO-APIC timer check counts timer ticks within a delay calibrated moments
            // before: under TCG on a loaded host it saw too few and panicked the boot
            // ("IO-APIC + timer doesn't work!", once in a local test run with three guests on
            // two cores). The timer works; virtual machines skip the check (as exotap's KVM
            // VMM does).
            "no_timer_check".to_owned(),
            // The crypto manager's self-tests of every algorithm at boot: 0.6 s of a 3.9 s TCG
            // boot of Debian's 6.1 (initcall_debug: crypto_algapi_init), in every test's
            // guest. The algorithms themselves are untouched.
            CRYPTO_SELFTESTS_OFF.to_owned(),
            self.patch_heap.kernel_param(),
        ];
        if !self.kaslr {
            params.push("nokaslr".into());
        }
        if self.attach_point && self.attach_in_job {
            params.push("exotap.attach=job".into());
        } else if self.attach_point {
            params.push("exotap.attach=1".into());
        }
        if !self.hold.is_empty() {
            params.push(format!("exotap.hold={}", self.hold.join(",")));
        }
        params.extend(self.append.iter().cloned());
        params.join(" ")
    }

    /// QEMU's arguments, with the go channel's unix socket at `control`.
    pub fn args(&self, control: &Path) -> Vec<String> {
        let accel = match (self.accel, self.tcg_threads) {
            (Accel::Tcg, TcgThreads::Single) => "tcg,thread=single",
            (Accel::Tcg, TcgThreads::Multi) => "tcg,thread=multi",
            (Accel::Kvm, _) => "kvm",
        };
        let mut args: Vec<String> = [
            "-M",
            "pc",
            "-accel",
            accel,
            "-cpu",
            &self.cpu_model,
            "-m",
            &format!("{}M", self.memory_mib),
            "-smp",
            &self.cpus.to_string(),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-chardev",
            "stdio,id=console,signal=off",
            "-serial",
            "chardev:console",
            "-chardev",
            &format!("socket,id=control,path={}", control.display()),
            "-serial",
            "chardev:control",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(["-kernel".into(), self.kernel.display().to_string()]);
        args.extend(["-initrd".into(), self.initrd.display().to_string()]);
        args.extend(["-append".into(), self.cmdline()]);
        if let Some(gdb) = &self.gdbstub {
            args.extend(["-gdb".into(), gdb.clone()]);
        }
        if let Some(path) = &self.shared_ram {
            args.extend(shared_ram_args(path, self.memory_mib));
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }
}

/// The QEMU arguments that put `memory_mib` MiB of guest RAM in the shared file `path`
/// (the zero-stop data path, [`crate::shared_ram`]).
pub fn shared_ram_args(path: &Path, memory_mib: u64) -> [String; 4] {
    [
        "-object".into(),
        format!(
            "memory-backend-file,id=exotap-ram,size={memory_mib}M,mem-path={},share=on",
            path.display()
        ),
        "-machine".into(),
        "memory-backend=exotap-ram".into(),
    ]
}

/// Limits of one run.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Until `EXOTAP-READY`.
    pub boot: Duration,
    /// Until `EXOTAP-DONE`, from the start.
    pub total: Duration,
}

/// What the host does at an `EXOTAP-WAIT` marker.
pub trait PhaseHook {
    /// Called when the guest waits at `phase`; the guest resumes once this returns `Ok`.
    ///
    /// # Errors
    /// An error stops the run.
    fn at_wait(&mut self, phase: &str) -> Result<(), QemuError>;

    /// Called about every 50 ms while the guest runs (between console lines), for work the
    /// host does alongside it, such as draining trace buffers. Does nothing by default.
    ///
    /// # Errors
    /// An error stops the run.
    fn tick(&mut self) -> Result<(), QemuError> {
        Ok(())
    }
}

/// A hook that lets the guest go at once.
#[derive(Debug, Default)]
pub struct GoAtOnce;

impl PhaseHook for GoAtOnce {
    fn at_wait(&mut self, _phase: &str) -> Result<(), QemuError> {
        Ok(())
    }
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The job's exit code from `EXOTAP-DONE`.
    pub rc: i32,
    /// `EXOTAP-RESULT` pairs in order.
    pub results: Vec<(String, String)>,
    /// Phases in order, with the time since start at which each began.
    pub phases: Vec<(String, Duration)>,
    /// Time from start to `EXOTAP-READY`.
    pub ready_after: Duration,
    /// Time from start to QEMU's exit.
    pub wall: Duration,
}

/// Kills QEMU if the run ends early.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

enum Event {
    Line(String),
    Eof,
}

/// Runs the guest to completion: copies every console line to `console`, answers waits with
/// `hook`, and returns when QEMU exits after `EXOTAP-DONE`.
///
/// # Errors
/// QEMU cannot start, a timeout passes (the error shows the last console lines), or QEMU exits
/// before the guest is done.
pub fn run(
    config: &QemuConfig,
    work_dir: &Path,
    timeouts: Timeouts,
    console: &mut dyn Write,
    hook: &mut dyn PhaseHook,
) -> Result<RunOutcome, QemuError> {
    let control_path = work_dir.join("control.sock");
    let _ = std::fs::remove_file(&control_path);
    let sock_err = |source| QemuError::ControlSocket {
        path: control_path.clone(),
        source,
    };
    let listener = UnixListener::bind(&control_path).map_err(sock_err)?;
    listener.set_nonblocking(true).map_err(sock_err)?;

    let args = config.args(&control_path);
    tracing::debug!(qemu = %config.qemu.display(), ?args, "starting QEMU");
    let mut command = Command::new(&config.qemu);
    command
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // A guest exotap booted ends with it, even when exotap is killed (SIGKILL skips
    // `ChildGuard`): its job would otherwise wait for a host that is gone.
    // SAFETY: the closure runs in the forked child before exec and only makes the
    // async-signal-safe prctl(2) call.
    unsafe {
        use std::os::unix::process::CommandExt as _;
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().map_err(|source| QemuError::Spawn {
        qemu: config.qemu.clone(),
        source,
    })?;
    let mut child = ChildGuard(child);
    let start = Instant::now();

    let (tx, rx) = mpsc::channel();
    if let Some(stdout) = child.0.stdout.take() {
        std::thread::spawn(move || forward_lines(stdout, &tx));
    }
    let (stderr_tx, stderr_rx) = mpsc::channel();
    if let Some(stderr) = child.0.stderr.take() {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ =
                std::io::Read::read_to_end(&mut std::io::Read::take(stderr, MAX_STDERR), &mut text);
            let _ = stderr_tx.send(String::from_utf8_lossy(&text).into_owned());
        });
    }

    let mut tail = ConsoleTail::new(30);
    let mut control: Option<UnixStream> = None;
    let mut outcome = RunOutcome {
        rc: -1,
        results: Vec::new(),
        phases: Vec::new(),
        ready_after: Duration::ZERO,
        wall: Duration::ZERO,
    };
    let mut ready = false;
    let mut done: Option<i32> = None;
    loop {
        if control.is_none() {
            if let Ok((stream, _)) = listener.accept() {
                control = Some(stream);
            }
        }
        let elapsed = start.elapsed();
        if !ready && elapsed > timeouts.boot {
            return Err(QemuError::BootTimeout {
                secs: timeouts.boot.as_secs(),
                tail: tail.render(),
            });
        }
        if elapsed > timeouts.total {
            return Err(QemuError::RunTimeout {
                secs: timeouts.total.as_secs(),
                tail: tail.render(),
            });
        }
        let received = rx.recv_timeout(Duration::from_millis(50));
        if ready {
            hook.tick()?;
        }
        let line = match received {
            Ok(Event::Line(line)) => line,
            Ok(Event::Eof) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
        };
        writeln!(console, "{line}").map_err(QemuError::Sink)?;
        tail.push(&line);
        match parse_marker(&line) {
            Some(Marker::Ready) => {
                ready = true;
                outcome.ready_after = start.elapsed();
            }
            Some(Marker::Phase(name)) => outcome.phases.push((name, start.elapsed())),
            Some(Marker::Wait(phase)) => {
                console.flush().map_err(QemuError::Sink)?;
                hook.at_wait(&phase)?;
                let stream =
                    wait_for_control(&listener, &mut control, timeouts.boot).map_err(|source| {
                        QemuError::Go {
                            phase: phase.clone(),
                            source,
                        }
                    })?;
                stream
                    .set_write_timeout(Some(timeouts.boot.max(Duration::from_millis(1))))
                    .and_then(|()| stream.write_all(b"g"))
                    .map_err(|source| QemuError::Go { phase, source })?;
            }
            Some(Marker::Result { key, value }) => outcome.results.push((key, value)),
            Some(Marker::Done(rc)) => done = Some(rc),
            Some(Marker::Go(_)) | None => {}
        }
    }
    console.flush().map_err(QemuError::Sink)?;
    // QEMU closed its console: it is exiting (or hung on the way out).
    let status: Option<ExitStatus> = wait_exit(&mut child.0, EXIT_GRACE);
    outcome.wall = start.elapsed();
    let stderr = stderr_rx.recv_timeout(EXIT_GRACE).unwrap_or_default();
    match done {
        Some(rc) => {
            outcome.rc = rc;
            Ok(outcome)
        }
        None => Err(QemuError::Died {
            status: status.map_or_else(|| "unknown status".into(), |s| s.to_string()),
            stderr: if stderr.trim().is_empty() {
                String::new()
            } else {
                format!("; QEMU said: {}", stderr.trim())
            },
            tail: tail.render(),
        }),
    }
}

/// Sends each console line (without its line end) to `tx`, then [`Event::Eof`]. A line
/// longer than [`MAX_LINE`] is sent in pieces: a console that never prints a newline costs
/// bounded memory.
fn forward_lines(console: impl std::io::Read, tx: &mpsc::Sender<Event>) {
    let mut reader = BufReader::new(console);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match std::io::Read::take(&mut reader, MAX_LINE).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                let line = line.trim_end_matches(['\n', '\r']).to_owned();
                if tx.send(Event::Line(line)).is_err() {
                    return;
                }
            }
        }
    }
    let _ = tx.send(Event::Eof);
}

/// Waits up to `grace` for `child` to exit, then kills it; its exit status if known.
fn wait_exit(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                tracing::warn!(
                    "QEMU did not exit {} s after closing its console; killing it",
                    grace.as_secs()
                );
                let _ = child.kill();
                return child.wait().ok();
            }
            Err(_) => return None,
        }
    }
}

fn wait_for_control<'a>(
    listener: &UnixListener,
    control: &'a mut Option<UnixStream>,
    limit: Duration,
) -> std::io::Result<&'a mut UnixStream> {
    let start = Instant::now();
    while control.is_none() {
        match listener.accept() {
            Ok((stream, _)) => *control = Some(stream),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && start.elapsed() < limit => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e),
        }
    }
    control
        .as_mut()
        .ok_or_else(|| std::io::Error::other("QEMU never connected the control port"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_goes_to_the_top_of_low_ram() {
        let heap = PatchHeapRange::place(1024 << 20, 64 << 20).unwrap();

        assert_eq!(
            heap,
            PatchHeapRange {
                base: 0x3c00_0000,
                size: 64 << 20
            }
        );
        assert_eq!(heap.kernel_param(), "memmap=64M$0x3c000000");
    }

    #[test]
    fn heap_stays_below_the_pci_hole_with_big_memory() {
        let heap = PatchHeapRange::place(8 << 30, 64 << 20).unwrap();

        assert_eq!(heap.base + heap.size, 0xe000_0000);
    }

    #[test]
    fn heap_of_odd_size_or_too_big_is_refused() {
        assert!(PatchHeapRange::place(1024 << 20, 3 << 20).is_err());
        assert!(PatchHeapRange::place(1024 << 20, 0).is_err());
        assert!(PatchHeapRange::place(256 << 20, 256 << 20).is_err());
    }

    #[test]
    fn cmdline_has_console_heap_and_hold() {
        let mut config = QemuConfig::new("bz".into(), "rd".into()).unwrap();
        config.hold = vec!["syscalls".into(), "mixed".into()];
        config.kaslr = false;

        let cmdline = config.cmdline();

        assert!(
            cmdline.starts_with("console=ttyS0,115200 panic=-1"),
            "{cmdline}"
        );
        assert!(cmdline.contains("memmap=64M$0x3c000000"), "{cmdline}");
        assert!(cmdline.contains("exotap.hold=syscalls,mixed"), "{cmdline}");
        assert!(cmdline.contains("nokaslr"), "{cmdline}");
        assert!(cmdline.contains(" no_timer_check "), "{cmdline}");
        assert!(cmdline.contains(" cryptomgr.notests "), "{cmdline}");
    }

    #[test]
    fn args_put_console_first_and_control_second() {
        let config = QemuConfig::new("bz".into(), "rd".into()).unwrap();

        let args = config.args(Path::new("/tmp/c.sock"));
        let serials: Vec<&String> = args
            .iter()
            .zip(args.iter().skip(1))
            .filter(|(flag, _)| *flag == "-serial")
            .map(|(_, v)| v)
            .collect();

        assert_eq!(serials, ["chardev:console", "chardev:control"]);
        assert!(args.windows(2).any(|w| w[0] == "-M" && w[1] == "pc"));
        assert!(args
            .windows(2)
            .any(|w| w[0] == "-accel" && w[1] == "tcg,thread=single"));
    }

    #[test]
    fn tcg_threads_multi_asks_for_a_thread_per_vcpu_and_kvm_takes_no_thread_option() {
        let mut config = QemuConfig::new("bz".into(), "rd".into()).unwrap();
        config.tcg_threads = TcgThreads::Multi;
        let multi = config.args(Path::new("/tmp/c.sock"));
        config.accel = Accel::Kvm;
        let kvm = config.args(Path::new("/tmp/c.sock"));

        assert!(multi
            .windows(2)
            .any(|w| w[0] == "-accel" && w[1] == "tcg,thread=multi"));
        assert!(kvm.windows(2).any(|w| w[0] == "-accel" && w[1] == "kvm"));
    }

    #[test]
    fn shared_ram_puts_the_memory_backend_in_the_file_at_the_guests_size() {
        let mut config = QemuConfig::new("bz".into(), "rd".into()).unwrap();
        config.shared_ram = Some("/dev/shm/g".into());

        let args = config.args(Path::new("/tmp/c.sock"));

        assert!(args.windows(2).any(|w| w[0] == "-object"
            && w[1]
                == "memory-backend-file,id=exotap-ram,size=1024M,mem-path=/dev/shm/g,share=on"));
        assert!(args
            .windows(2)
            .any(|w| w[0] == "-machine" && w[1] == "memory-backend=exotap-ram"));
    }

    #[test]
    fn console_line_without_newline_is_split_at_the_line_limit() {
        let mut console = vec![b'x'; 2 * MAX_LINE as usize + 10];
        console.extend_from_slice(b"\r\nEXOTAP-READY\n");
        let (tx, rx) = mpsc::channel();

        forward_lines(std::io::Cursor::new(console), &tx);

        let lengths: Vec<usize> = rx
            .try_iter()
            .map(|e| match e {
                Event::Line(line) if line.starts_with('x') => line.len(),
                Event::Line(line) => usize::from(line == "EXOTAP-READY"),
                Event::Eof => 0,
            })
            .collect();
        assert_eq!(lengths, [MAX_LINE as usize, MAX_LINE as usize, 10, 1, 0]);
    }

    #[test]
    fn child_that_does_not_exit_is_killed_after_the_grace() {
        let mut child = Command::new("sleep").arg("600").spawn().unwrap();
        let started = Instant::now();

        let status = wait_exit(&mut child, Duration::from_millis(200));

        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(status.is_some_and(|s| !s.success()), "{status:?}");
    }
}
