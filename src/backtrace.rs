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
use exotap_introspect::btf::Btf;
use exotap_introspect::orc::{Backtrace, StackEnd, StackMemory};
use exotap_vmm::control::{Machine, VcpuId};
use exotap_vmm::host::Backend;
use exotap_vmm::kvm::{self, KvmConfig, KvmMachine, KvmPhaseHook};
use exotap_vmm::qemu::{self, Accel, PhaseHook, QemuConfig, RunOutcome, Timeouts};

use crate::attach::TargetArgs;
use crate::backend::BackendChoice;
use exotap_probes::live::session::AnyMachine;
use crate::kernel_image::{ImageArgs, KernelImage};
use exotap_probes::live::attach::{self, Survey};
use exotap_probes::live::guest_memory::BackendMemory;
use exotap_probes::live::stacks::{list_tasks, GuestTask, KernelStacks, PageCache, TaskLayout};

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
    /// Booting: copy the serial console to FILE instead of standard error.
    #[arg(long, value_name = "FILE")]
    pub console: Option<PathBuf>,
    /// Booting: seconds until the guest must finish.
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub timeout: u64,
    /// Booting: number of vCPUs.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub cpus: u32,
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
        let initrd = work.path().join("initramfs.cpio.gz");
        images::write_initramfs(job, &initrd).context("cannot build the initramfs")?;
        let config = if backend == Backend::Kvm {
            let mut config = KvmConfig::new(image.path.clone(), initrd)?;
            config.cpus = self.cpus;
            BootConfig::Kvm(config)
        } else {
            let mut config = QemuConfig::new(image.path.clone(), initrd)?;
            config.accel = if exotap_vmm::host::detect().usable() {
                Accel::Kvm
            } else {
                Accel::Tcg
            };
            config.cpus = self.cpus;
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
            timeout: self.timeout,
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
            Reach::Gdb(target) => LiveStacks::attach(target, image),
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
            boot: Duration::from_secs(120),
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

/// One vCPU's kernel stack at a stop.
#[derive(Debug)]
pub struct VcpuStack {
    /// The vCPU.
    pub vcpu: VcpuId,
    /// Whether it was running kernel code.
    pub in_kernel: bool,
    /// Its current task's pid and command name, when readable.
    pub current: Option<(i32, String)>,
    /// Its kernel stack (no frames in user mode).
    pub backtrace: Backtrace,
}

/// A guest attached for stacks: the slide, the layout, the ORC tables, `task_struct`.
pub struct LiveStacks {
    /// The guest: QEMU's gdbstub, exotap's VMM in process or through its control socket.
    pub machine: AnyMachine,
    /// Slide and layout.
    pub survey: Survey,
    /// ORC tables and symbols at the running addresses.
    pub stacks: KernelStacks,
    /// `task_struct` members.
    pub tasks: TaskLayout,
}

impl std::fmt::Debug for LiveStacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveStacks")
            .field("stacks", &self.stacks)
            .finish_non_exhaustive()
    }
}

impl LiveStacks {
    /// Attaches (the guest stops and stays stopped) and learns what unwinding needs:
    /// to a gdbstub, or to a running exotap VMM's control socket (`vmm:PATH`).
    ///
    /// # Errors
    /// When attaching or any step of the survey fails; the guest is detached then.
    pub fn attach(target: &TargetArgs, image: &KernelImage) -> anyhow::Result<Self> {
        if let Some(path) = target.target.strip_prefix(attach::VMM_PREFIX) {
            let machine = exotap_vmm::control_socket::ControlClient::connect(
                std::path::Path::new(path),
                Duration::from_secs(target.gdb_timeout),
            )
            .with_context(|| format!("cannot attach to {}", target.target))?;
            return Self::over(Box::new(machine), image);
        }
        let att = attach::attach(&target.to_target())?;
        Self::over(Box::new(att.machine), image)
    }

    /// Stacks over a machine already reached: pauses it (it stays paused) and learns what
    /// unwinding needs.
    ///
    /// # Errors
    /// When the guest cannot be paused or any step of the survey fails; the machine is
    /// released then.
    pub fn over(mut machine: AnyMachine, image: &KernelImage) -> anyhow::Result<Self> {
        let started = Instant::now();
        let learned = (|| {
            machine.pause().context("cannot pause the guest")?;
            let survey = attach::survey_machine(&mut *machine, started, image)?;
            let btf = Btf::from_elf(image.vmlinux.bytes())
                .context("the kernel image has no usable BTF")?;
            let tasks = TaskLayout::from_btf(&btf)?;
            let stacks = KernelStacks::load(image, survey.kaslr.slide)?;
            anyhow::Ok((survey, stacks, tasks))
        })();
        match learned {
            Ok((survey, stacks, tasks)) => Ok(Self {
                machine,
                survey,
                stacks,
                tasks,
            }),
            Err(err) => {
                let _ = machine.release();
                Err(err)
            }
        }
    }

    /// Lets the guest go: the gdbstub's detach (taken only from a stopped guest), or a
    /// resume.
    ///
    /// # Errors
    /// When the backend refuses.
    pub fn release(mut self) -> anyhow::Result<()> {
        self.machine.pause().context("cannot stop the guest to detach")?;
        self.machine.release().context("cannot detach")
    }

    /// Every vCPU's kernel stack; the guest must be stopped.
    ///
    /// # Errors
    /// When the vCPUs or their registers cannot be read.
    pub fn vcpu_stacks(&mut self) -> anyhow::Result<Vec<VcpuStack>> {
        let vcpus = self.machine.vcpus()?;
        let mut regs = Vec::with_capacity(vcpus.len());
        for vcpu in vcpus {
            regs.push((vcpu, self.machine.stack_registers(vcpu)?));
        }
        let mut mem = BackendMemory(&mut *self.machine);
        let mut space = self.survey.space(&mut mem);
        // One cache for the whole stop: the current tasks' and the stacks' pages.
        let mut cache = PageCache::new(&mut space);
        let mut out = Vec::with_capacity(regs.len());
        for (vcpu, r) in regs {
            let current_slot = r
                .kernel_percpu_base()
                .wrapping_add(self.survey.layout.current_task_offset);
            let current = cache
                .read_u64(current_slot)
                .ok()
                .and_then(|task| read_task_name(&mut cache, task, &self.tasks));
            let backtrace = self.stacks.unwind_vcpu(&r, &mut cache);
            out.push(VcpuStack {
                vcpu,
                in_kernel: r.in_kernel(),
                current,
                backtrace,
            });
        }
        Ok(out)
    }

    /// Every task and its kernel stack, unwound from its saved stack pointer (a task
    /// running on a CPU gets no stack here: its saved one is stale; see
    /// [`Self::vcpu_stacks`]). The guest must be stopped.
    ///
    /// # Errors
    /// When the task list cannot be walked.
    pub fn task_stacks(&mut self) -> anyhow::Result<Vec<(GuestTask, Option<Backtrace>)>> {
        let mut mem = BackendMemory(&mut *self.machine);
        let mut space = self.survey.space(&mut mem);
        let tasks = list_tasks(&mut space, self.survey.layout.init_task, &self.tasks)?;
        let mut cache = PageCache::new(&mut space);
        Ok(tasks
            .into_iter()
            .map(|task| {
                let bt =
                    (!task.on_cpu).then(|| self.stacks.unwind_task(task.thread_sp, &mut cache));
                (task, bt)
            })
            .collect())
    }
}

/// A task's pid and command name, read word by word through `mem`.
fn read_task_name<S: StackMemory + ?Sized>(
    mem: &mut S,
    task: u64,
    layout: &TaskLayout,
) -> Option<(i32, String)> {
    let pid = mem.read_u64(task.wrapping_add(layout.pid)).ok()? as u32 as i32;
    let comm_at = task.wrapping_add(layout.comm);
    let mut comm = [0u8; 16];
    comm[..8].copy_from_slice(&mem.read_u64(comm_at).ok()?.to_le_bytes());
    comm[8..].copy_from_slice(&mem.read_u64(comm_at.wrapping_add(8)).ok()?.to_le_bytes());
    let name = comm.split(|b| *b == 0).next().unwrap_or(&comm);
    Some((pid, String::from_utf8_lossy(name).into_owned()))
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
        backtrace_once(LiveStacks::attach(&target, &image)?, args)?;
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
