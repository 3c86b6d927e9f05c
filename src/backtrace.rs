//! `exotap backtrace`: the kernel stacks of every vCPU and every task of a live guest,
//! unwound from outside it while it is stopped; and what `exotap profile` shares with it:
//! attaching for stacks ([`LiveStacks`], over any backend's control interface) and booting
//! a guest, on QEMU or exotap's own KVM VMM, whose job says when ([`GuestArgs`],
//! [`StackHook`]).

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use exotap_guest_images::{self as images, GuestJob};
use exotap_introspect::orc::{Backtrace, StackEnd};
use exotap_vmm::host::Backend;
use exotap_vmm::kvm::{self, KvmConfig, KvmMachine, KvmPhaseHook};
use exotap_vmm::qemu::{self, Accel, PhaseHook, QemuConfig, RunOutcome, Timeouts};

use crate::attach::TargetArgs;
use crate::backend::{BackendChoice, MachineArgs};
use crate::kernel_image::{ImageArgs, KernelImage};
use exotap_probes::live::sampling::LiveStacks;

/// How to reach the guest: a running one (`--target`) or one booted for the command.
#[derive(Debug, Args, Clone)]
pub struct GuestArgs {
    /// Attach to a running guest instead of booting one: its gdbstub (tcp:HOST:PORT or
    /// unix:PATH) or a running exotap VMM's control socket (vmm:PATH).
    #[arg(long, short = 't', value_name = "ADDR")]
    pub target: Option<String>,
    /// Booting: the machine. `kvm` is exotap's own VMM on /dev/kvm (each stop pauses its
    /// vCPU threads; memory is read through its own mapping); `qemu` is QEMU over its
    /// gdbstub; `auto` takes kvm where /dev/kvm is hardware virtualization (not kvm_pvm),
    /// qemu otherwise.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto, conflicts_with = "target")]
    pub backend: BackendChoice,
    /// Booting: the command the guest runs (see the subcommand for where exotap steps in).
    #[arg(long, value_name = "COMMAND", conflicts_with = "job")]
    pub run: Option<String>,
    /// Booting: a job script for the guest instead of --run, with the subcommand's
    /// `exotap_wait` points in it.
    #[arg(long, value_name = "FILE")]
    pub job: Option<PathBuf>,
    /// Booting: this initramfs instead of one built from --run or --job (its job must have
    /// the subcommand's `exotap_wait` points).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["run", "job", "target"])]
    pub initrd: Option<PathBuf>,
    /// Booting: copy the serial console to FILE instead of standard error.
    #[arg(long, value_name = "FILE")]
    pub console: Option<PathBuf>,
    #[command(flatten)]
    pub machine: MachineArgs,
    #[command(flatten)]
    pub image: ImageArgs,
}

impl GuestArgs {
    /// The guest's job: `--job`, or `--run` (or `default_command`) placed by `wrap`.
    ///
    /// # Errors
    /// When the job file cannot be read.
    pub fn job(
        &self,
        default_command: &str,
        wrap: impl Fn(&str) -> String,
    ) -> anyhow::Result<GuestJob> {
        Ok(match &self.job {
            Some(path) => GuestJob::from_script(
                std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read the job {}", path.display()))?,
            ),
            None => GuestJob::from_script(wrap(self.run.as_deref().unwrap_or(default_command))),
        })
    }

    /// Builds the guest for `job` on the backend `--backend` picks: its initramfs, and QEMU's
    /// settings with a gdbstub on a socket, or exotap's VMM's.
    ///
    /// # Errors
    /// A refused backend (with why), or when the working directory or the initramfs cannot
    /// be made.
    pub fn plan(&self, image: &KernelImage, job: &GuestJob) -> anyhow::Result<BootPlan> {
        let backend = crate::backend::resolve(self.backend, None)?;
        let work = tempfile::Builder::new()
            .prefix("exotap-stacks-")
            .tempdir()
            .context("cannot create a working directory")?;
        let initrd = match &self.initrd {
            Some(path) => path.clone(),
            None => {
                let initrd = work.path().join("initramfs.cpio.gz");
                images::write_initramfs(job, &initrd).context("cannot build the initramfs")?;
                initrd
            }
        };
        let config = if backend == Backend::Kvm {
            let mut config = KvmConfig::new(image.path.clone(), initrd)?;
            config.cpus = self.machine.cpus;
            BootConfig::Kvm(config)
        } else {
            let mut config = QemuConfig::new(image.path.clone(), initrd)?;
            config.accel = if exotap_vmm::host::detect().usable() {
                Accel::Kvm
            } else {
                Accel::Tcg
            };
            config.cpus = self.machine.cpus;
            config.tcg_threads = self.machine.tcg_threads.into();
            let socket = work.path().join("gdb.sock");
            config.gdbstub = Some(format!("unix:{},server=on,wait=off", socket.display()));
            BootConfig::Qemu {
                config,
                target: TargetArgs {
                    target: format!("unix:{}", socket.display()),
                    gdb_timeout: 10,
                },
            }
        };
        Ok(BootPlan {
            work,
            config,
            console: self.console.clone(),
            boot_timeout: self.machine.boot_timeout,
            timeout: self.machine.timeout,
        })
    }
}

/// The machine a [`BootPlan`] boots.
#[derive(Debug)]
enum BootConfig {
    /// QEMU, with the gdbstub the hook attaches to.
    Qemu {
        config: QemuConfig,
        target: TargetArgs,
    },
    /// exotap's own VMM: the hook takes a handle on it ([`KvmMachine::control`]).
    Kvm(KvmConfig),
}

/// How a hook reaches the booted guest at a wait.
#[derive(Clone, Copy)]
pub enum Reach<'a> {
    /// QEMU's gdbstub.
    Gdb(&'a TargetArgs),
    /// exotap's own VMM, in this process.
    Kvm(&'a KvmMachine),
}

impl Reach<'_> {
    /// Attaches for stacks: the guest stops and stays stopped.
    ///
    /// # Errors
    /// As [`LiveStacks::attach`] and [`LiveStacks::over`].
    pub fn attach(self, image: &KernelImage) -> anyhow::Result<LiveStacks> {
        match self {
            Reach::Gdb(target) => LiveStacks::attach(&target.to_target(), image),
            Reach::Kvm(machine) => LiveStacks::over(Box::new(machine.control()), image),
        }
    }
}

/// What `backtrace` and `profile` do at the booted guest's waits, on either backend.
pub trait StackHook {
    /// The guest waits at `phase`; it goes on once this returns.
    ///
    /// # Errors
    /// An error stops the run.
    fn step(&mut self, phase: &str, reach: Reach<'_>) -> anyhow::Result<()>;
}

/// A [`StackHook`] on QEMU's path.
struct OnQemu<'h, H: ?Sized> {
    hook: &'h mut H,
    target: TargetArgs,
}

impl<H: StackHook + ?Sized> PhaseHook for OnQemu<'_, H> {
    fn at_wait(&mut self, phase: &str) -> Result<(), qemu::QemuError> {
        self.hook
            .step(phase, Reach::Gdb(&self.target))
            .map_err(|e| qemu::QemuError::Hook {
                phase: phase.to_owned(),
                message: format!("{e:#}"),
            })
    }
}

/// A [`StackHook`] on exotap's VMM.
struct OnKvm<'h, H: ?Sized>(&'h mut H);

impl<H: StackHook + ?Sized> KvmPhaseHook for OnKvm<'_, H> {
    fn at_wait(&mut self, phase: &str, machine: &mut KvmMachine) -> Result<(), String> {
        self.0
            .step(phase, Reach::Kvm(machine))
            .map_err(|e| format!("{e:#}"))
    }
}

/// A guest ready to boot (see [`GuestArgs::plan`]).
#[derive(Debug)]
pub struct BootPlan {
    work: tempfile::TempDir,
    config: BootConfig,
    console: Option<PathBuf>,
    boot_timeout: u64,
    timeout: u64,
}

impl BootPlan {
    /// Boots the guest, `hook` stepping in at its waits, and prints the job's results and
    /// exit code.
    ///
    /// # Errors
    /// When the guest cannot be booted, fails, or the hook fails.
    pub fn run(self, hook: &mut dyn StackHook) -> anyhow::Result<RunOutcome> {
        let mut sink: Box<dyn Write> = match &self.console {
            Some(path) => Box::new(
                std::fs::File::create(path)
                    .with_context(|| format!("cannot create {}", path.display()))?,
            ),
            None => Box::new(std::io::stderr()),
        };
        let timeouts = Timeouts {
            boot: Duration::from_secs(self.boot_timeout),
            total: Duration::from_secs(self.timeout),
        };
        let outcome = match self.config {
            BootConfig::Qemu { config, target } => qemu::run(
                &config,
                self.work.path(),
                timeouts,
                &mut sink,
                &mut OnQemu { hook, target },
            )?,
            BootConfig::Kvm(config) => kvm::run(&config, timeouts, &mut sink, &mut OnKvm(hook))?,
        };
        for (key, value) in &outcome.results {
            outln!("EXOTAP-RESULT {key}={value}");
        }
        outln!("EXOTAP-DONE {}", outcome.rc);
        Ok(outcome)
    }
}

/// How a backtrace ended, in a few words.
pub fn end_text(end: &StackEnd) -> String {
    match end {
        StackEnd::EndOfStack => "end of stack".into(),
        StackEnd::UserMode { pc, .. } => format!("user mode at {pc:#x}"),
        StackEnd::FrameLimit { max } => format!("stopped after {max} frames"),
        StackEnd::Error(err) => {
            let mut text = format!("unwind failed: {err}");
            let mut source = std::error::Error::source(err);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        }
    }
}

/// `exotap backtrace`.
#[derive(Debug, Args)]
pub struct BacktraceArgs {
    /// Only these tasks (thread ids); default: every task.
    #[arg(long, value_name = "PID")]
    pub pid: Vec<i32>,
    /// Leave out scheduler and lock functions, as the kernel's saved traces
    /// (`/proc/PID/stack`) do.
    #[arg(long)]
    pub proc_style: bool,
    #[command(flatten)]
    pub guest: GuestArgs,
}

/// Prints the stacks of a stopped guest.
fn print_stacks(live: &mut LiveStacks, args: &BacktraceArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let vcpus = live.vcpu_stacks()?;
    let tasks = live.task_stacks()?;
    let stacks = &live.stacks;
    let print_frames = |bt: &Backtrace| {
        for frame in &bt.frames {
            if args.proc_style && stacks.is_scheduler(frame) {
                continue;
            }
            let guess = if frame.reliable { "" } else { "? " };
            outln!("  [<{:016x}>] {guess}{}", frame.pc, stacks.describe(frame));
        }
        outln!("  -- {}", end_text(&bt.end));
    };
    for v in &vcpus {
        let (pid, comm) = v.current.clone().unwrap_or((-1, "?".into()));
        let mode = if v.in_kernel { "kernel" } else { "user" };
        outln!("{} pid {pid} ({comm}) {mode}", v.vcpu);
        print_frames(&v.backtrace);
    }
    let mut complete = 0;
    let mut shown = 0;
    for (task, bt) in &tasks {
        if !args.pid.is_empty() && !args.pid.contains(&task.pid) {
            continue;
        }
        shown += 1;
        let Some(bt) = bt else {
            outln!(
                "task {} ({}) {} on a CPU: see its vCPU",
                task.pid,
                task.comm,
                task.state_letter()
            );
            continue;
        };
        complete += usize::from(bt.is_complete());
        outln!("task {} ({}) {}", task.pid, task.comm, task.state_letter());
        print_frames(bt);
    }
    eprintln!(
        "exotap: {} vCPUs and {shown} tasks unwound in {:.1} ms ({complete} complete)",
        vcpus.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// Prints, detaches.
fn backtrace_once(mut live: LiveStacks, args: &BacktraceArgs) -> anyhow::Result<()> {
    let printed = print_stacks(&mut live, args);
    live.release()?;
    printed
}

/// Prints the stacks at the guest's `exotap_wait backtrace`.
struct BacktraceHook<'a> {
    image: &'a KernelImage,
    args: &'a BacktraceArgs,
}

impl StackHook for BacktraceHook<'_> {
    fn step(&mut self, phase: &str, reach: Reach<'_>) -> anyhow::Result<()> {
        if phase != "backtrace" {
            return Ok(());
        }
        backtrace_once(reach.attach(self.image)?, self.args)
    }
}

/// `exotap backtrace`: with `--target`, the stacks of that guest now; booting, the stacks
/// at the job's `exotap_wait backtrace` (`--run CMD` runs `CMD; exotap_wait backtrace`).
///
/// # Errors
/// Attach, unwind-setup or guest failures.
pub fn run_backtrace(args: &BacktraceArgs) -> anyhow::Result<i32> {
    if args.guest.target.is_none() {
        // A refused backend says why before anything is loaded.
        crate::backend::resolve(args.guest.backend, None)?;
    }
    let image = args.guest.image.load()?;
    if let Some(target) = &args.guest.target {
        let target = TargetArgs {
            target: target.clone(),
            gdb_timeout: 10,
        };
        backtrace_once(LiveStacks::attach(&target.to_target(), &image)?, args)?;
        return Ok(0);
    }
    let job = args.guest.job("sleep 1000 &\nsleep 1", |cmd| {
        format!("{cmd}\nexotap_wait backtrace\n")
    })?;
    let plan = args.guest.plan(&image, &job)?;
    let mut hook = BacktraceHook {
        image: &image,
        args,
    };
    let outcome = plan.run(&mut hook)?;
    Ok(outcome.rc)
}
