//! `exotap boot`: boot the Debian guest under QEMU with the workloads.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use exotap_guest_images::{self as images, GuestJob};
use exotap_vmm::host;
use exotap_vmm::qemu::{
    self, Accel, GoAtOnce, PatchHeapRange, PhaseHook, QemuConfig, QemuError, Timeouts,
};

use crate::attach;
use crate::backend::{BackendChoice, TcgThreadsChoice};
use crate::kernel_image::KernelImage;
use exotap_probes::lang::check::Program;
use exotap_probes::lang::driver::{compile_with, stop_on_ctrl_c, ScriptSource};
use exotap_probes::lang::invocation::Invocation;
use exotap_probes::lang::output::Format;
use exotap_probes::lang::Limits;
use exotap_probes::live::attach::Target;
use exotap_probes::live::compiled::{self, CompileMode};
use exotap_probes::live::trap_script::GuestScript;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AccelChoice {
    /// KVM where hardware virtualization works (not kvm_pvm), TCG otherwise.
    Auto,
    /// QEMU's software emulation.
    Tcg,
    /// Hardware KVM; refused where it cannot run Linux.
    Kvm,
}

#[derive(Debug, Args)]
pub struct BootArgs {
    /// Kernel ABI name or package name; fetched into the cache when missing.
    #[arg(long, env = "EXOTAP_KERNEL", default_value = images::DEFAULT_KERNEL, value_name = "VERSION")]
    pub kernel: String,
    /// Boot this bzImage instead of a cached Debian kernel.
    #[arg(long, value_name = "PATH")]
    pub bzimage: Option<PathBuf>,
    /// A shell script run by the guest's init instead of the default workload job. It may use
    /// exotap_phase NAME, exotap_wait NAME and exotap_result KEY VALUE.
    #[arg(long, value_name = "FILE", conflicts_with = "run")]
    pub job: Option<PathBuf>,
    /// A shell command line run by the guest's init instead of the default workload job.
    #[arg(long, value_name = "COMMAND")]
    pub run: Option<String>,
    /// Copy the serial console to FILE instead of stdout (results and the rc are still printed).
    #[arg(long, value_name = "FILE")]
    pub console: Option<PathBuf>,
    /// Make the guest wait for the host at this phase (repeatable; `all` for every phase).
    #[arg(long, value_name = "PHASE")]
    pub hold: Vec<String>,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 1024, value_name = "MiB")]
    pub memory: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub cpus: u32,
    /// Size of the hidden patch-heap range in MiB (a multiple of 2).
    #[arg(long, default_value_t = 64, value_name = "MiB")]
    pub heap_size: u64,
    /// Accelerator.
    #[arg(long, value_enum, default_value_t = AccelChoice::Auto)]
    pub accel: AccelChoice,
    /// QEMU TCG: how many host threads run the vCPUs.
    #[arg(long, value_enum, default_value_t = TcgThreadsChoice::Single, value_name = "MODE")]
    pub tcg_threads: TcgThreadsChoice,
    /// The machine: exotap's own KVM VMM or QEMU. `auto` takes kvm where /dev/kvm is hardware
    /// virtualization, qemu otherwise. --gdb and --gdbstub need qemu; so does a --script
    /// whose kernel probes do not all compile (kvm runs compiled probes only).
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Boot with this initramfs instead of building one (--job/--run are then ignored).
    #[arg(long, value_name = "PATH")]
    pub initrd: Option<PathBuf>,
    /// kvm backend: splice a call counter at this kernel function's entry while the guest is
    /// between its `splice` and `unsplice` waits; prints HOST-RESULT counter.FUNCTION=N.
    #[arg(long, value_name = "FUNCTION")]
    pub count_entry: Option<String>,
    /// kvm backend: serve the guest's control interface on a unix socket at PATH while the VMM
    /// runs, for `exotap run|count|trace|... --target vmm:PATH` from another exotap process
    /// (compiled probes and splices; the protocol is in vmm/src/control_socket/mod.rs). The socket
    /// appears at EXOTAP-READY. A client that ends with its probes in (killed) has them
    /// removed by the VMM at once.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["script", "script_text", "count_entry", "gdb", "gdbstub"])]
    pub control_socket: Option<PathBuf>,
    /// With --control-socket: the guest waits at `attach` before its job until a client's
    /// splices are in and the guest runs again, and at `detach` after its job until no client
    /// is connected (each wait at most --timeout).
    #[arg(long, requires = "control_socket")]
    pub await_client: bool,
    /// Seconds until the guest must print EXOTAP-READY.
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    pub boot_timeout: u64,
    /// Seconds until the guest must finish its job.
    #[arg(long, default_value_t = 900, value_name = "SECONDS")]
    pub timeout: u64,
    /// Boot with KASLR off.
    #[arg(long)]
    pub nokaslr: bool,
    /// Extra kernel parameters.
    #[arg(long, value_name = "PARAMS")]
    pub append: Option<String>,
    /// Attach over QEMU's gdbstub once the guest is up (before its job runs), print what
    /// exotap sees (vCPUs, page tables, attach time), detach, and let the job run.
    #[arg(long, conflicts_with = "gdbstub")]
    pub gdb: bool,
    /// Expose QEMU's gdbstub for `exotap attach` or gdb, as a QEMU -gdb device: `tcp::1234`
    /// or `unix:PATH,server=on,wait=off`.
    #[arg(long, value_name = "DEVICE")]
    pub gdbstub: Option<String>,
    /// At each `exotap_wait NAME` of the job, hold the guest until a line arrives on standard
    /// input (end of input lets it go too): time to attach another exotap or gdb through
    /// --gdbstub and install probes before the work they watch begins.
    #[arg(long, conflicts_with_all = ["script", "script_text", "gdb", "control_socket"])]
    pub go_on_stdin: bool,
    /// Put the guest's RAM in FILE, shared (a QEMU memory-backend-file with share=on; use a
    /// tmpfs path such as /dev/shm/guest-ram), so that `exotap ... --target --shm FILE`
    /// reads trace rings and counters without stopping the guest.
    #[arg(long, value_name = "FILE")]
    pub shm: Option<PathBuf>,
    /// Run this probe script against the guest: exotap attaches right after EXOTAP-READY,
    /// arms the script's probe points, runs begin probes, every hit, and end probes once the
    /// guest powers off (or the script calls exit()).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["gdb", "gdbstub"])]
    pub script: Option<PathBuf>,
    /// Script text instead of --script FILE.
    #[arg(long, value_name = "SCRIPT", conflicts_with_all = ["script", "gdb", "gdbstub"])]
    pub script_text: Option<String>,
    /// Whether the script's kernel probes run compiled inside the guest (auto: per probe,
    /// those that do not compile on the host with a stop per hit, saying why).
    #[arg(long, value_enum, default_value_t = crate::script::CompileArg::Auto)]
    pub compile: crate::script::CompileArg,
    /// With --script: the job itself calls `exotap_wait attach` (where exotap attaches and
    /// installs the probes) and `exotap_wait detach` (where it reads them and removes them),
    /// so it can prepare the guest first (e.g. arm the guest's own kprobes).
    #[arg(long, requires = "script")]
    pub attach_in_job: bool,
    /// With --script: print the guest's own kprobe hits between install
    /// and removal, per function, as HOST-RESULT kprobe.FUNCTION=N on stderr.
    #[arg(long)]
    pub compare_kprobes: bool,
    /// Guru mode for the script, as stap's -g: it may write `$return` in .return probes
    /// (or call `set_return(v)`) and parameters at function entries.
    #[arg(short = 'g', long = "guru")]
    pub guru: bool,
    /// Output format of the script.
    #[arg(long, value_enum, default_value_t = crate::script::OutputFormat::Text)]
    pub format: crate::script::OutputFormat,
    /// Write the script's output to FILE instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub script_output: Option<PathBuf>,
    /// The QEMU binary.
    #[arg(long, default_value = "qemu-system-x86_64", value_name = "PATH")]
    pub qemu: PathBuf,
}

fn pick_accel(choice: AccelChoice) -> anyhow::Result<Accel> {
    let support = host::detect();
    match choice {
        AccelChoice::Tcg => Ok(Accel::Tcg),
        AccelChoice::Kvm if support.usable() => Ok(Accel::Kvm),
        AccelChoice::Kvm => bail!("--accel kvm refused: {}", support.explain()),
        AccelChoice::Auto if support.usable() => Ok(Accel::Kvm),
        AccelChoice::Auto => {
            tracing::info!("{}", support.explain());
            Ok(Accel::Tcg)
        }
    }
}

fn job(args: &BootArgs) -> anyhow::Result<GuestJob> {
    if let Some(path) = &args.job {
        let script = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the job script {}", path.display()))?;
        return Ok(GuestJob::from_script(script));
    }
    Ok(match &args.run {
        Some(command) => GuestJob::from_script(format!("{command}\n")),
        None => GuestJob::default_workload(),
    })
}

/// Lets the guest go from a wait once a line arrives on standard input (`--go-on-stdin`).
struct GoOnStdin;

impl PhaseHook for GoOnStdin {
    fn at_wait(&mut self, phase: &str) -> Result<(), QemuError> {
        eprintln!("exotap boot: the guest waits at {phase}; a line on standard input lets it go");
        let mut line = String::new();
        match std::io::stdin().read_line(&mut line) {
            Ok(0) => eprintln!("exotap boot: standard input ended; the guest goes on from {phase}"),
            Ok(_) => {}
            Err(e) => eprintln!(
                "exotap boot: cannot read standard input ({e}); the guest goes on from {phase}"
            ),
        }
        Ok(())
    }
}

/// Attaches at the guest's `attach` wait point, prints what it sees and detaches.
struct AttachHook {
    target: Target,
    image: KernelImage,
}

impl PhaseHook for AttachHook {
    fn at_wait(&mut self, phase: &str) -> Result<(), QemuError> {
        if phase != "attach" {
            return Ok(());
        }
        let result = attach::attach(&self.target).and_then(|mut att| {
            let printed = attach::print_info(&mut att, &self.image);
            att.machine.detach()?;
            printed
        });
        result.map_err(|e| QemuError::Hook {
            phase: phase.to_owned(),
            message: format!("{e:#}"),
        })
    }
}

/// Starts the tracer at the guest's `attach` wait point.
struct ScriptHook {
    target: Target,
    image: KernelImage,
    heap: (u64, u64),
    script: Option<GuestScript>,
    compile: CompileMode,
    tracer: Option<std::thread::JoinHandle<i32>>,
    /// The script's stop flag, set at the guest's `detach` wait.
    stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The script's exit code, once it ended at `detach`.
    rc: Option<i32>,
}

impl PhaseHook for ScriptHook {
    fn at_wait(&mut self, phase: &str) -> Result<(), QemuError> {
        if phase == "detach" {
            // The job is done: end the script (end probes, removal) while the guest waits.
            if let (Some(stop), Some(tracer)) = (&self.stop, self.tracer.take()) {
                stop.store(true, std::sync::atomic::Ordering::SeqCst);
                self.rc = Some(tracer.join().map_err(|_| QemuError::Hook {
                    phase: phase.to_owned(),
                    message: "the script thread panicked".into(),
                })?);
            }
            return Ok(());
        }
        // `attach.PID` (a `-c CMD` job, [`command_job`]): the process that is about to exec
        // the command, whose pid target() answers.
        let pid = phase
            .strip_prefix("attach.")
            .and_then(|p| p.parse::<i64>().ok());
        let Some(mut script) = self
            .script
            .take()
            .filter(|_| phase == "attach" || pid.is_some())
        else {
            return Ok(());
        };
        if let Some(pid) = pid {
            script.prog.target_pid = pid;
        }
        self.stop = Some(script.stop.clone());
        let started =
            compiled::start_script(&self.target, &self.image, self.heap, script, self.compile);
        match started {
            Ok(handle) => {
                self.tracer = Some(handle);
                Ok(())
            }
            Err(e) => Err(QemuError::Hook {
                phase: phase.to_owned(),
                message: format!("{e:#}"),
            }),
        }
    }
}

/// The job of `exotap -c CMD SCRIPT` (stap's `-c`): a child reports its pid at the `attach`
/// wait (`attach.PID`, where the host starts the script with target() = PID), then execs
/// `sh -c CMD`, keeping that pid; the job waits for it and then at `detach`, where the host
/// ends the script (end probes, removal) before the guest powers off.
pub(crate) fn command_job(command: &str) -> GuestJob {
    let quoted = command.replace('\'', r"'\''");
    GuestJob::from_script(format!(
        "( read -r pid _ < /proc/self/stat; exotap_wait \"attach.$pid\"; exec sh -c '{quoted}' )\n\
         rc=$?\n\
         exotap_wait detach\n\
         exit $rc\n"
    ))
}

/// `exotap -c CMD SCRIPT` without `--target` (stap's `-c`): boots the guest kernel `image`
/// names under QEMU with CMD as its job, runs `script` from just before CMD starts (target()
/// = CMD's pid) until CMD exits, and returns the script's exit code (125 when the guest
/// failed). The guest's console goes to a file, whose last lines are printed when the guest
/// fails.
///
/// # Errors
/// When the kernel cannot be fetched, or QEMU cannot start.
pub(crate) fn run_with_command(
    image: &crate::kernel_image::ImageArgs,
    script: GuestScript,
    command: &str,
    compile: CompileMode,
) -> anyhow::Result<i32> {
    let bzimage = image.bzimage_path()?;
    let work = tempfile::Builder::new()
        .prefix("exotap-c-")
        .tempdir()
        .context("cannot create a working directory")?;
    let initrd = work.path().join("initramfs.cpio.gz");
    images::write_initramfs(&command_job(command), &initrd)
        .context("cannot build the initramfs")?;
    let mut config = QemuConfig::new(bzimage, initrd)?;
    config.accel = pick_accel(AccelChoice::Auto)?;
    config.patch_heap = PatchHeapRange::place(config.memory_mib << 20, 64 << 20)?;
    let ram = crate::verbs::guest_ram();
    if let Some(ram) = &ram {
        config.shared_ram = Some(ram.path());
    }
    let gdb_socket = work.path().join("gdb.sock");
    config.gdbstub = Some(format!("unix:{},server=on,wait=off", gdb_socket.display()));
    config.attach_point = true;
    config.attach_in_job = true;
    let console_path = work.path().join("console.log");
    let mut console = File::create(&console_path)
        .with_context(|| format!("cannot create {}", console_path.display()))?;
    let mut target = Target::new(format!("unix:{}", gdb_socket.display()));
    target.shm.clone_from(&config.shared_ram);
    let mut hook = ScriptHook {
        target,
        image: KernelImage::load(config.kernel.clone())?,
        heap: (config.patch_heap.base, config.patch_heap.size),
        script: Some(script),
        compile,
        tracer: None,
        stop: None,
        rc: None,
    };
    // The command runs as long as it runs: a day at most, as a bound on a guest that hangs.
    let timeouts = Timeouts {
        boot: Duration::from_secs(120),
        total: Duration::from_secs(24 * 3600),
    };
    let outcome = qemu::run(&config, work.path(), timeouts, &mut console, &mut hook);
    let script_rc = match hook.tracer.take() {
        Some(tracer) => tracer
            .join()
            .map_err(|_| anyhow::anyhow!("the tracer thread panicked"))?,
        None => hook.rc.unwrap_or(0),
    };
    drop(console);
    match outcome {
        Ok(outcome) => {
            tracing::info!("-c {command:?} exited with {}", outcome.rc);
            Ok(script_rc)
        }
        Err(e) => {
            let text = std::fs::read_to_string(&console_path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(30)..].join("\n");
            eprintln!("exotap: the guest running -c {command:?} failed: {e}\nits console's last lines:\n{tail}");
            Ok(125)
        }
    }
}

/// Reads and checks the script `--script`/`--script-text` names (before booting anything).
fn guest_script(args: &BootArgs) -> anyhow::Result<Option<GuestScript>> {
    let source = match (&args.script, &args.script_text) {
        (Some(path), _) => ScriptSource {
            name: path.display().to_string(),
            text: std::fs::read_to_string(path)
                .with_context(|| format!("cannot read script {}", path.display()))?,
        },
        (None, Some(text)) => ScriptSource {
            name: "<input>".into(),
            text: text.clone(),
        },
        (None, None) => return Ok(None),
    };
    let (prog, limits) = compile_checked(&source, args.guru)?;
    let out: Box<dyn Write + Send> = match &args.script_output {
        Some(path) => Box::new(
            File::create(path).with_context(|| format!("cannot create {}", path.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    let stop = stop_on_ctrl_c().unwrap_or_else(|e| {
        tracing::warn!("cannot catch Ctrl-C ({e})");
        std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false))
    });
    Ok(Some(GuestScript {
        source,
        prog,
        limits,
        format: match args.format {
            crate::script::OutputFormat::Text => Format::Text,
            crate::script::OutputFormat::Json => Format::Json,
        },
        out,
        err: Box::new(std::io::stderr()),
        stop,
        compare_kprobes: args.compare_kprobes,
    }))
}

/// Compiles and checks a script to run in a guest: its errors are printed (rendered against
/// the source) and refuse it, its warnings are printed.
pub(crate) fn compile_checked(
    source: &ScriptSource,
    guru: bool,
) -> anyhow::Result<(Program, Limits)> {
    let limits = Limits::default();
    let color = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let invocation = Invocation {
        guru,
        ..Invocation::default()
    };
    let prog = match compile_with(source, &limits, &invocation) {
        Ok(prog) => prog,
        Err(diags) => {
            for d in &diags {
                eprint!("{}", d.render(&source.name, &source.text, color));
            }
            bail!("the script has errors");
        }
    };
    for d in &prog.warnings {
        eprint!("{}", d.render(&source.name, &source.text, color));
    }
    Ok((prog, limits))
}

/// A script to run on exotap's own VMM: compiled, its plan made before booting.
struct KvmScript {
    script: GuestScript,
    image: KernelImage,
    plan: compiled::Plan,
}

/// Whether this boot runs on exotap's own KVM VMM; for a script there, its compiled plan.
///
/// The backend is refused (or `auto` takes qemu) before anything is loaded when the host
/// cannot run the VMM or --gdb/--gdbstub ask for QEMU; a script then runs on kvm only when
/// every kernel probe compiles, since host-evaluated trap probes need exits that the VMM's
/// session does not take (and that nested KVM under TCG does not deliver).
fn use_kvm(
    args: &BootArgs,
    script: &mut Option<GuestScript>,
) -> anyhow::Result<(bool, Option<KvmScript>)> {
    if args.control_socket.is_some() && args.backend == BackendChoice::Qemu {
        bail!("--control-socket is exotap's VMM's (--backend kvm); QEMU's is --gdbstub");
    }
    let needs_qemu = if args.gdb {
        Some("--gdb")
    } else if args.gdbstub.is_some() {
        Some("--gdbstub")
    } else if args.go_on_stdin {
        Some("--go-on-stdin")
    } else {
        None
    };
    let choice = if args.backend == BackendChoice::Auto && args.accel == AccelChoice::Tcg {
        BackendChoice::Qemu
    } else {
        args.backend
    };
    let choice = if args.control_socket.is_some() {
        BackendChoice::Kvm
    } else {
        choice
    };
    if crate::backend::resolve(choice, needs_qemu)? == host::Backend::Qemu {
        return Ok((false, None));
    }
    let Some(guest_script) = script.take() else {
        return Ok((true, None));
    };
    let image = KernelImage::load(kernel_path(args)?)?;
    let mode: CompileMode = args.compile.into();
    let why = if mode == CompileMode::Never {
        "--compile never (host-evaluated trap probes)".to_owned()
    } else if mode == CompileMode::Check {
        "--compile check (host-evaluated trap probes beside the compiled ones)".to_owned()
    } else if !guest_script.prog.needs_guest() {
        "a script without kernel probes".to_owned()
    } else {
        match compiled::plan(&image, &guest_script.prog, &guest_script.limits) {
            Ok(Ok(plan)) => {
                return Ok((
                    true,
                    Some(KvmScript {
                        script: guest_script,
                        image,
                        plan,
                    }),
                ))
            }
            Ok(Err(constructs)) => format!(
                "host-evaluated trap probes (these do not compile:\n{})",
                compiled::describe(
                    &constructs,
                    &guest_script.source.name,
                    &guest_script.source.text
                )
            ),
            Err(e) => format!("host-evaluated trap probes ({e:#})"),
        }
    };
    if args.backend == BackendChoice::Kvm {
        let nested = if host::nested() {
            format!("; and here {}", exotap_vmm::kvm::NESTED_TRAPS_REFUSED)
        } else {
            String::new()
        };
        bail!("--backend kvm refused: {why} needs the qemu backend{nested}");
    }
    tracing::info!("backend qemu: the script needs {why}");
    *script = Some(guest_script);
    Ok((false, None))
}

/// The bzImage --bzimage or --kernel names (fetched into the cache when missing).
fn kernel_path(args: &BootArgs) -> anyhow::Result<PathBuf> {
    Ok(match &args.bzimage {
        Some(path) => path.clone(),
        None => {
            images::ensure_kernel(&args.kernel)
                .context("cannot get the guest kernel")?
                .bzimage
        }
    })
}

/// Runs a compiled script on exotap's own VMM: installs at the guest's `attach` wait (the
/// session is a handle on the VM), ends it at `detach`.
struct KvmScriptHook {
    image: KernelImage,
    heap: (u64, u64),
    pending: Option<(GuestScript, compiled::Plan)>,
    tracer: Option<std::thread::JoinHandle<i32>>,
    stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    rc: Option<i32>,
}

impl exotap_vmm::kvm::KvmPhaseHook for KvmScriptHook {
    fn at_wait(
        &mut self,
        phase: &str,
        machine: &mut exotap_vmm::kvm::KvmMachine,
    ) -> Result<(), String> {
        if phase == "detach" {
            if let (Some(stop), Some(tracer)) = (&self.stop, self.tracer.take()) {
                stop.store(true, std::sync::atomic::Ordering::SeqCst);
                self.rc = Some(
                    tracer
                        .join()
                        .map_err(|_| "the script thread panicked".to_owned())?,
                );
            }
            return Ok(());
        }
        let Some((script, plan)) = self.pending.take().filter(|_| phase == "attach") else {
            return Ok(());
        };
        self.stop = Some(script.stop.clone());
        let session =
            exotap_probes::live::GuestSession::over(Box::new(machine.control()), &self.image);
        let started = session.and_then(|session| {
            // Only scripts whose every kernel probe compiles come here (the VMM takes no
            // breakpoint exits).
            compiled::start_on(
                session,
                None,
                &self.image,
                self.heap,
                script,
                plan,
                compiled::CompileMode::Require,
            )
        });
        match started {
            Ok(handle) => {
                self.tracer = Some(handle);
                Ok(())
            }
            Err(e) => Err(format!("{e:#}")),
        }
    }
}

/// `exotap boot` on exotap's own KVM VMM.
fn run_kvm(
    args: &BootArgs,
    bzimage: PathBuf,
    initrd: PathBuf,
    script: Option<KvmScript>,
) -> anyhow::Result<i32> {
    use exotap_vmm::kvm::{self, KvmConfig, Plain};
    let mut config = KvmConfig::new(bzimage, initrd)?;
    config.memory_mib = args.memory;
    config.cpus = args.cpus;
    config.patch_heap = PatchHeapRange::place(args.memory << 20, args.heap_size << 20)?;
    config.hold = args.hold.clone();
    config.kaslr = !args.nokaslr;
    config.attach_point = script.is_some() || args.await_client;
    config.attach_in_job = args.attach_in_job;
    config.append = args
        .append
        .iter()
        .flat_map(|a| a.split_whitespace().map(str::to_owned))
        .collect();
    tracing::info!(
        "patch heap: {} (backend kvm: a memory slot outside the e820 RAM map)",
        config.patch_heap
    );
    let mut sink: Box<dyn Write> = match &args.console {
        Some(path) => Box::new(
            File::create(path)
                .with_context(|| format!("cannot create the console file {}", path.display()))?,
        ),
        // Not locked: a script's output goes to stdout from its own thread.
        None => Box::new(std::io::stdout()),
    };
    let timeouts = Timeouts {
        boot: Duration::from_secs(args.boot_timeout),
        total: Duration::from_secs(args.timeout),
    };
    let mut script_rc = 0;
    let outcome = match (script, &args.count_entry) {
        (Some(s), _) => {
            let mut hook = KvmScriptHook {
                image: s.image,
                heap: (config.patch_heap.base, config.patch_heap.size),
                pending: Some((s.script, s.plan)),
                tracer: None,
                stop: None,
                rc: None,
            };
            let outcome = kvm::run(&config, timeouts, &mut sink, &mut hook);
            if let Some(tracer) = hook.tracer.take() {
                script_rc = tracer
                    .join()
                    .map_err(|_| anyhow::anyhow!("the script thread panicked"))?;
            } else if let Some(rc) = hook.rc {
                script_rc = rc;
            }
            outcome?
        }
        (None, Some(function)) => {
            let mut hook = crate::kvm_splice::CountingSplice::new(
                KernelImage::load(config.kernel.clone())?,
                config.patch_heap,
                function.clone(),
            );
            kvm::run(&config, timeouts, &mut sink, &mut hook)?
        }
        (None, None) => match &args.control_socket {
            Some(path) => {
                let mut hook = crate::vmm_control::ControlHook::new(
                    path.clone(),
                    config.patch_heap,
                    args.await_client,
                    timeouts.total,
                )?;
                kvm::run(&config, timeouts, &mut sink, &mut hook)?
            }
            None => kvm::run(&config, timeouts, &mut sink, &mut Plain(GoAtOnce))?,
        },
    };
    drop(sink);
    if args.console.is_some() {
        for (key, value) in &outcome.results {
            outln!("EXOTAP-RESULT {key}={value}");
        }
        outln!("EXOTAP-DONE {}", outcome.rc);
    }
    tracing::info!(
        "guest job exited with {}; EXOTAP-READY after {:.2} s, the VM stopped after {:.2} s",
        outcome.rc,
        outcome.ready_after.as_secs_f64(),
        outcome.wall.as_secs_f64()
    );
    if outcome.rc == 0 && script_rc != 0 {
        return Ok(script_rc);
    }
    Ok(outcome.rc)
}

pub fn run(args: &BootArgs) -> anyhow::Result<i32> {
    let mut script = guest_script(args)?;
    let (kvm, kvm_script) = use_kvm(args, &mut script)?;
    if args.count_entry.is_some() && !kvm {
        bail!("--count-entry needs the kvm backend (exotap selftest does it over QEMU)");
    }
    let bzimage = kernel_path(args)?;
    let work = tempfile::Builder::new()
        .prefix("exotap-boot-")
        .tempdir()
        .context("cannot create a working directory")?;
    let initrd = match &args.initrd {
        Some(path) => path.clone(),
        None => {
            let initrd = work.path().join("initramfs.cpio.gz");
            images::write_initramfs(&job(args)?, &initrd).context("cannot build the initramfs")?;
            initrd
        }
    };
    if kvm {
        return run_kvm(args, bzimage, initrd, kvm_script);
    }

    let mut config = QemuConfig::new(bzimage, initrd)?;
    config.qemu = args.qemu.clone();
    config.memory_mib = args.memory;
    config.cpus = args.cpus;
    config.accel = pick_accel(args.accel)?;
    config.tcg_threads = args.tcg_threads.into();
    config.patch_heap = PatchHeapRange::place(args.memory << 20, args.heap_size << 20)?;
    config.hold = args.hold.clone();
    config.kaslr = !args.nokaslr;
    config.gdbstub = args.gdbstub.clone();
    config.shared_ram = args.shm.clone();
    // A script's compiled probes are read through the guest's RAM, shared, with no stop.
    let _ram = (script.is_some() && args.shm.is_none())
        .then(crate::verbs::guest_ram)
        .flatten();
    if let Some(ram) = &_ram {
        config.shared_ram = Some(ram.path());
    }
    let gdb_socket = work.path().join("gdb.sock");
    if args.gdb || script.is_some() {
        config.gdbstub = Some(format!("unix:{},server=on,wait=off", gdb_socket.display()));
        config.attach_point = true;
        config.attach_in_job = args.attach_in_job;
    }
    config.append = args
        .append
        .iter()
        .flat_map(|a| a.split_whitespace().map(str::to_owned))
        .collect();
    tracing::info!(
        "patch heap: {} (hidden from the guest with {})",
        config.patch_heap,
        config.patch_heap.kernel_param()
    );

    let mut sink: Box<dyn Write> = match &args.console {
        Some(path) => Box::new(
            File::create(path)
                .with_context(|| format!("cannot create the console file {}", path.display()))?,
        ),
        // Not `stdout().lock()`: a script's output goes to stdout from the tracer thread, and a
        // lock held for the whole run by this thread would stop it at its first print.
        None => Box::new(std::io::stdout()),
    };
    let timeouts = Timeouts {
        boot: Duration::from_secs(args.boot_timeout),
        total: Duration::from_secs(args.timeout),
    };
    let mut gdb_target = Target::new(format!("unix:{}", gdb_socket.display()));
    gdb_target.shm.clone_from(&config.shared_ram);
    let mut script_rc = 0;
    let outcome = if let Some(script) = script {
        let mut hook = ScriptHook {
            target: gdb_target,
            image: KernelImage::load(config.kernel.clone())?,
            heap: (config.patch_heap.base, config.patch_heap.size),
            script: Some(script),
            compile: args.compile.into(),
            tracer: None,
            stop: None,
            rc: None,
        };
        let outcome = qemu::run(&config, work.path(), timeouts, &mut sink, &mut hook);
        if let Some(tracer) = hook.tracer.take() {
            script_rc = tracer
                .join()
                .map_err(|_| anyhow::anyhow!("the tracer thread panicked"))?;
        } else if let Some(rc) = hook.rc {
            script_rc = rc;
        }
        outcome?
    } else if args.gdb {
        let mut hook = AttachHook {
            target: gdb_target,
            image: KernelImage::load(config.kernel.clone())?,
        };
        qemu::run(&config, work.path(), timeouts, &mut sink, &mut hook)?
    } else if args.go_on_stdin {
        qemu::run(&config, work.path(), timeouts, &mut sink, &mut GoOnStdin)?
    } else {
        qemu::run(&config, work.path(), timeouts, &mut sink, &mut GoAtOnce)?
    };
    drop(sink);
    if args.console.is_some() {
        for (key, value) in &outcome.results {
            outln!("EXOTAP-RESULT {key}={value}");
        }
        outln!("EXOTAP-DONE {}", outcome.rc);
    }
    tracing::info!(
        "guest job exited with {}; EXOTAP-READY after {:.2} s, QEMU exited after {:.2} s",
        outcome.rc,
        outcome.ready_after.as_secs_f64(),
        outcome.wall.as_secs_f64()
    );
    if outcome.rc == 0 && script_rc != 0 {
        return Ok(script_rc);
    }
    Ok(outcome.rc)
}
