//! `exotap run FILE` / `exotap -e SCRIPT`: the probe language front end (the language itself
//! is in probes/lang/src).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use exotap_guest_images as images;
use exotap_introspect::btf::Btf;
use exotap_probes::lang::ast::ProbePoint;
use exotap_probes::lang::driver::{
    compile_with, run_job, run_listing, stop_on_ctrl_c, Job, ScriptSource,
};
use exotap_probes::lang::facts::TargetFacts;
use exotap_probes::lang::invocation::Invocation;
use exotap_probes::lang::kernel_points::KernelSymbols;
use exotap_probes::lang::limits::LimitError;
use exotap_probes::lang::output::Format;
use exotap_probes::lang::point::{FunctionSite, PointKind};
use exotap_probes::lang::resolve::{NoSymbols, ProbePointResolver, ResolveError, ResolvedPoint};
use exotap_probes::lang::Limits;
use exotap_probes::live::compiled::CompileMode;

use crate::kernel_image::{ImageArgs, KernelImage};

/// The kernel image, its BTF and the cached -dbg vmlinux's source positions, if any.
type Loaded = (
    KernelImage,
    Option<Btf>,
    Option<exotap_probes::lang::source_lines::SourceLines>,
);

/// Resolves kernel probe points with the guest kernel image's symbols and BTF, loading the
/// image the first time a kernel point needs it (host-only scripts never touch it).
struct LazyKernel {
    image: ImageArgs,
    loaded: std::cell::OnceCell<Result<Loaded, String>>,
    /// For `-l`/`-L`: the live guest whose loaded modules list a module point's functions
    /// (`Some(None)`: listing without `--target`).
    listing: Option<Option<String>>,
    /// `-L`: list each point's target variables too.
    list_vars: bool,
}

impl LazyKernel {
    fn new(image: ImageArgs) -> Self {
        Self {
            image,
            loaded: std::cell::OnceCell::new(),
            listing: None,
            list_vars: false,
        }
    }

    /// `module("M").function("F")` for `-l`/`-L`: the functions of the live guest's loaded
    /// modules (a module's functions are known only there).
    fn list_module(
        &self,
        point: &ProbePoint,
        loaded: &Loaded,
        (module, pattern, suffix, offset): (&str, &str, &str, Option<u64>),
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        let Some(Some(target)) = &self.listing else {
            return Err(ResolveError::Source(format!(
                "{point}: listing a module's functions needs --target ADDR"
            )));
        };
        let target = exotap_probes::live::attach::Target::new(target.clone());
        let found = exotap_probes::live::compiled::list_module_functions(
            &target, &loaded.0, module, pattern,
        )
        .map_err(|e| ResolveError::Source(format!("{point}: {e:#}")))?;
        Ok(found
            .into_iter()
            .map(|(m, f, addr, variables)| match offset {
                // Where the planner will check it is an instruction; no parameters there.
                Some(offset) => ResolvedPoint {
                    name: format!("module(\"{m}\").statement(\"{f}+{offset:#x}\")"),
                    address: Some(addr.wrapping_add(offset)),
                    variables: Vec::new(),
                    implicit: false,
                },
                None => ResolvedPoint {
                    name: format!("module(\"{m}\").function(\"{f}\"){suffix}"),
                    address: Some(addr),
                    variables,
                    implicit: false,
                },
            })
            .collect())
    }
}

impl ProbePointResolver for LazyKernel {
    fn resolve(
        &self,
        point: &ProbePoint,
        kind: &PointKind,
    ) -> Result<Vec<ResolvedPoint>, ResolveError> {
        if !kind.needs_guest() {
            return NoSymbols.resolve(point, kind);
        }
        let loaded = self.loaded.get_or_init(|| {
            let image = self.image.load().map_err(|e| format!("{e:#}"))?;
            let btf = match Btf::from_elf(image.vmlinux.bytes()) {
                Ok(btf) => Some(btf),
                Err(e) => {
                    tracing::warn!("no target variables for -L: the image's BTF is unusable ({e})");
                    None
                }
            };
            let lines = exotap_probes::live::target_vars::source_lines(&image);
            Ok((image, btf, lines))
        });
        match (loaded, kind) {
            (
                Ok(loaded),
                PointKind::ModuleFunction {
                    module,
                    pattern,
                    site,
                    file,
                    line,
                    statement,
                    field,
                    offset,
                },
            ) if self.listing.is_some() => {
                // Functions from the live guest's module list where there is one; the rest
                // (and functions without --target) from the modules' cached debug files.
                let from_dwarf = file.is_some()
                    || line.is_some()
                    || statement.is_some()
                    || field.is_some()
                    || *site == FunctionSite::Inline;
                if !from_dwarf && matches!(self.listing, Some(Some(_))) {
                    return self.list_module(
                        point,
                        loaded,
                        (module, pattern, site.suffix(), *offset),
                    );
                }
                let found = exotap_probes::live::compiled::list_from_debug_files(
                    &loaded.0,
                    kind,
                    &point.to_string(),
                    self.list_vars,
                )
                .map_err(|e| ResolveError::Source(format!("{e:#}")))?;
                Ok(found
                    .into_iter()
                    .map(|(name, variables)| ResolvedPoint {
                        name,
                        address: None,
                        variables,
                        implicit: false,
                    })
                    .collect())
            }
            (Ok((image, btf, lines)), _) => KernelSymbols::new(&image.symbols, btf.as_ref())
                .with_lines(lines.as_ref())
                .resolve(point, kind),
            (Err(e), _) => Err(ResolveError::NeedsSymbols {
                what: format!("{point} (the kernel image could not be loaded: {e})"),
            }),
        }
    }
}

/// `--compile`: whether scripts run compiled into the guest.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CompileArg {
    /// Per probe: the kernel probes that compile run in the guest, the others on the host
    /// (a stop per hit), each named with the construct that does not compile.
    #[default]
    Auto,
    /// Every kernel probe compiled, or an error naming what does not compile.
    Require,
    /// Host-evaluated (a stop per hit): the reference the compiled path is checked against.
    Never,
    /// Both on the same hits: compiled as with auto, and every kernel probe also evaluated
    /// on the host (a stop per hit) over globals of its own; at the end both outputs must be
    /// the same bytes, or the run says where they part and exits 1.
    Check,
}

impl From<CompileArg> for CompileMode {
    fn from(arg: CompileArg) -> Self {
        match arg {
            CompileArg::Auto => Self::Auto,
            CompileArg::Require => Self::Require,
            CompileArg::Never => Self::Never,
            CompileArg::Check => Self::Check,
        }
    }
}

/// Output format of a running script.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputFormat {
    /// SystemTap's text output.
    #[default]
    Text,
    /// One JSON object per line with a `type` field (printf, map, stats, hist).
    Json,
}

/// Run a probe script (SystemTap-like language): `exotap run FILE [ARGS...]`, or as `stap`
/// takes it, `exotap FILE [ARGS...]`.
#[derive(clap::Args, Debug)]
pub struct ScriptArgs {
    /// Script file to run (with -e, the script's first argument).
    #[arg(value_name = "FILE", conflicts_with_all = ["list", "list_vars"])]
    pub file: Option<String>,
    /// The script's arguments: `$1` (as script text) and `@1` (as a string) are the first,
    /// also `argv[1]`; `$#` and `argc` count them. Put `--` before one that starts with '-'.
    #[arg(value_name = "ARGS", allow_negative_numbers = true)]
    pub args: Vec<String>,
    #[command(flatten)]
    pub options: ScriptOptions,
}

impl ScriptArgs {
    /// Whether a script or listing was asked for (so `exotap` without a subcommand has work).
    pub fn any(&self) -> bool {
        self.file.is_some() || self.options.any()
    }
}

/// The script options `exotap` also takes without a subcommand (`exotap -e 'SCRIPT'`,
/// `exotap -l PATTERN`, `exotap FILE`), as `stap` does.
#[derive(clap::Args, Debug)]
pub struct ScriptOptions {
    /// Script text given on the command line.
    #[arg(short = 'e', value_name = "SCRIPT")]
    pub script: Option<String>,
    /// List the probe points matching PATTERN, e.g. 'kernel.function("vfs_*")'.
    #[arg(short = 'l', value_name = "PATTERN", conflicts_with_all = ["script", "list_vars"])]
    pub list: Option<String>,
    /// Like -l, with the target variables available at each point.
    #[arg(short = 'L', value_name = "PATTERN", conflicts_with = "script")]
    pub list_vars: Option<String>,
    /// Stop after pass N: 1 parse, 2 elaborate and check, 3 resolve probe points (5 runs).
    #[arg(short = 'p', value_name = "N", value_parser = clap::value_parser!(u8).range(1..=5))]
    pub pass: Option<u8>,
    /// Write the script's output to FILE instead of stdout.
    #[arg(short = 'o', value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub format: OutputFormat,
    /// Set a limit: MAXACTION, MAXACTION_INTERRUPTIBLE, MAXMAPENTRIES, MAXSTRINGLEN or
    /// MAXNESTING (-D MAXACTION=10000).
    /// Other names (stap passes them to its module's C compiler) are accepted with a warning.
    #[arg(short = 'D', value_name = "NAME=VALUE")]
    pub define: Vec<String>,
    /// Give scalar global NAME this initial value, as stap's -G (-G sloth=10): a number for
    /// a global that holds numbers, the text for one that holds strings.
    #[arg(short = 'G', value_name = "NAME=VALUE")]
    pub global: Vec<String>,
    /// Guru mode, as stap's -g: `guru_mode == 1` in preprocessor conditions, and target
    /// variables may be written.
    #[arg(short = 'g')]
    pub guru: bool,
    /// Add the tapset files (*.stp) of DIR to exotap's tapset library, as stap's -I.
    #[arg(short = 'I', value_name = "DIR")]
    pub include: Vec<std::path::PathBuf>,
    /// The target process: what the script's target() returns.
    #[arg(short = 'x', value_name = "PID")]
    pub target_pid: Option<i64>,
    /// Run the script against a running guest over its gdbstub (tcp:HOST:PORT or unix:PATH),
    /// or a running exotap VMM's control socket (vmm:PATH: compiled probes only), until
    /// exit(), Ctrl-C or the guest's end; then exotap detaches and the guest runs on.
    #[arg(long, value_name = "ADDR")]
    pub target: Option<String>,
    /// With --target: the guest-physical range hidden from that guest for the patch heap, as
    /// GPA:SIZE (the guest booted with memmap=SIZE$GPA; `exotap boot` hides 0x3c000000:64M).
    #[arg(long, value_name = "GPA:SIZE", default_value = "0x3c000000:64M")]
    pub heap: String,
    /// With --target: the guest's RAM file, when its QEMU runs with a shared memory backend
    /// (`exotap boot --shm FILE`, or QEMU's `-object memory-backend-file,...,share=on`): the
    /// compiled probes' output and header are then read without stopping the guest.
    #[arg(long, value_name = "PATH", requires = "target")]
    pub shm: Option<PathBuf>,
    /// With --target: print the guest's own kprobe hits between install
    /// and removal, per function, as HOST-RESULT kprobe.FUNCTION=N on stderr.
    #[arg(long)]
    pub compare_kprobes: bool,
    /// With --target: whether the script's kernel probes run compiled inside the guest
    /// (auto: per probe, those that do not compile on the host with a stop per hit, saying
    /// why).
    #[arg(long, value_enum, default_value_t = CompileArg::Auto)]
    pub compile: CompileArg,
    /// stap's -c CMD: boot the guest kernel (--kernel/--bzimage) with CMD as its job, run the
    /// script from just before CMD starts until it exits, target() = CMD's pid. Not with
    /// --target (exotap cannot start a command inside a running guest: use -x PID there).
    #[arg(short = 'c', value_name = "CMD")]
    pub command: Option<String>,
    /// End the script after SECONDS, as Ctrl-C would (its end probes run), as stap's -T.
    #[arg(short = 'T', value_name = "SECONDS")]
    pub timeout: Option<u64>,
    /// Do not print warnings, as stap's -w.
    #[arg(short = 'w')]
    pub no_warnings: bool,
    /// stap's -s MiB (the size of its module's output buffer): accepted for stap's command
    /// lines; exotap sizes its per-vCPU rings itself and says so when one overflows.
    #[arg(short = 's', value_name = "MIB")]
    pub buffer_mib: Option<u32>,
    /// stap's -k (keep its temporary build directory): accepted; exotap builds no module and
    /// leaves nothing to keep.
    #[arg(short = 'k')]
    pub keep_tmp: bool,
    /// stap's --all-modules (every module's symbols, for backtraces): accepted; exotap reads
    /// the guest's module list live.
    #[arg(long)]
    pub all_modules: bool,
    /// stap's --bpf (its eBPF back end): accepted with a warning; exotap compiles scripts into
    /// its own code in the guest (--compile), not into eBPF.
    #[arg(long)]
    pub bpf: bool,
    /// Where the script's procfs("NAME") files are served on this host, one FIFO per name:
    /// `cat DIR/NAME` runs its .read probe, `echo x > DIR/NAME` its .write probe. Default:
    /// $XDG_RUNTIME_DIR/exotap/PID (said on stderr at the start).
    #[arg(long, value_name = "DIR")]
    pub procfs_dir: Option<PathBuf>,
    /// Also serve the procfs files over HTTP at ADDR (e.g. 127.0.0.1:9900; off without):
    /// GET /procfs/NAME reads, PUT or POST /procfs/NAME writes, GET /metrics serves the
    /// prometheus tapset's `probe prometheus` in Prometheus's text format.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<std::net::SocketAddr>,
    /// The guest kernel whose symbols resolve kernel probe points.
    #[command(flatten)]
    pub image: ImageArgs,
}

/// Parses `GPA:SIZE` with SIZE in bytes or with a K/M/G suffix.
pub(crate) fn parse_heap(text: &str) -> anyhow::Result<(u64, u64)> {
    let (gpa, size) = text
        .split_once(':')
        .with_context(|| format!("--heap {text}: expected GPA:SIZE, e.g. 0x3c000000:64M"))?;
    let gpa = crate::attach::parse_u64(gpa).map_err(anyhow::Error::msg)?;
    let (digits, unit) = match size.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&size[..i], c.to_ascii_uppercase()),
        _ => (size, 'B'),
    };
    let shift = match unit {
        'B' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        other => bail!("--heap {text}: unknown size unit {other}"),
    };
    let n = crate::attach::parse_u64(digits).map_err(anyhow::Error::msg)?;
    let size = n
        .checked_mul(1 << shift)
        .with_context(|| format!("--heap {text}: size overflows"))?;
    Ok((gpa, size))
}

/// The facts `%( kernel_v ... %)` conditions see: the cached kernel's release (its ABI name,
/// as `uname -r` gives it) and its `.config`, read from the cache without fetching anything;
/// exotap's defaults (no CONFIG_ option set) when the kernel is not cached or is a `--bzimage`.
fn target_facts(image: &ImageArgs) -> TargetFacts {
    if let Some(path) = &image.bzimage {
        // The release from the image's own banner; its configuration is not in the image.
        let release = KernelImage::load(path.clone())
            .ok()
            .and_then(|i| i.release());
        return match release {
            Some(release) => TargetFacts {
                kernel_release: release,
                origin: format!(
                    "the banner of {} (its configuration is not read: CONFIG_ conditions are unset)",
                    path.display()
                ),
                ..TargetFacts::default()
            },
            None => TargetFacts {
                origin: format!(
                    "exotap's defaults ({} has no banner to read its release from; its configuration is not read)",
                    path.display()
                ),
                ..TargetFacts::default()
            },
        };
    }
    let Ok(abi) = images::kernel::kernel_abi(&image.kernel) else {
        return TargetFacts::default();
    };
    let config = images::cache::cache_root()
        .map(|root| root.join("kernels").join(&abi).join("config"))
        .ok()
        .and_then(|path| std::fs::read_to_string(&path).ok().map(|text| (path, text)));
    match config {
        Some((path, text)) => TargetFacts::from_config(
            &abi,
            "x86_64",
            &text,
            &format!("the cached kernel configuration {}", path.display()),
        ),
        None => TargetFacts {
            kernel_release: abi.clone(),
            origin: format!(
                "kernel {abi} without its configuration (not in the cache: `exotap image fetch`)"
            ),
            ..TargetFacts::default()
        },
    }
}

/// Compiles `source` into the script a guest runs: its errors printed (rendered against the
/// source) and `Ok(Err(1))`, its warnings printed unless `-w`; output to `-o FILE` or stdout.
///
/// # Errors
/// When the output file cannot be created.
fn guest_script(
    source: ScriptSource,
    args: &ScriptOptions,
    invocation: &Invocation,
    limits: Limits,
    format: Format,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Result<exotap_probes::live::trap_script::GuestScript, i32>> {
    let color = std::io::stderr().is_terminal();
    let prog = match compile_with(&source, &limits, invocation) {
        Ok(prog) => prog,
        Err(diags) => {
            for d in &diags {
                eprint!("{}", d.render(&source.name, &source.text, color));
            }
            return Ok(Err(1));
        }
    };
    if !invocation.no_warnings {
        for d in &prog.warnings {
            eprint!("{}", d.render(&source.name, &source.text, color));
        }
    }
    let out: Box<dyn Write + Send> = match &args.output {
        Some(path) => Box::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        ),
        None => Box::new(std::io::stdout()),
    };
    Ok(Ok(exotap_probes::live::trap_script::GuestScript {
        source,
        prog,
        limits,
        format,
        out,
        err: Box::new(std::io::stderr()),
        stop,
        compare_kprobes: args.compare_kprobes,
    }))
}

/// Runs a checked script against the guest at `target` until it ends.
fn run_attached(
    source: ScriptSource,
    target: &str,
    args: &ScriptOptions,
    invocation: &Invocation,
    limits: Limits,
    format: Format,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<i32> {
    let script = match guest_script(source, args, invocation, limits, format, stop)? {
        Ok(script) => script,
        Err(code) => return Ok(code),
    };
    let heap = parse_heap(&args.heap)?;
    let image = args.image.load()?;
    let mut target = exotap_probes::live::attach::Target::new(target);
    target.shm.clone_from(&args.shm);
    let tracer = exotap_probes::live::compiled::start_script(
        &target,
        &image,
        heap,
        script,
        args.compile.into(),
    )?;
    tracer
        .join()
        .map_err(|_| anyhow::anyhow!("the tracer thread panicked"))
}

/// `-c CMD` without `--target` (stap's `-c`): the script runs in a guest booted to run CMD,
/// from just before CMD starts until it exits, with target() = CMD's pid
/// ([`crate::boot::run_with_command`]).
fn run_command(
    source: ScriptSource,
    command: &str,
    args: &ScriptOptions,
    invocation: &Invocation,
    limits: Limits,
    format: Format,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<i32> {
    if invocation.target_pid.is_some() {
        bail!("-c CMD and -x PID both name target(): give one");
    }
    let script = match guest_script(source, args, invocation, limits, format, stop)? {
        Ok(script) => script,
        Err(code) => return Ok(code),
    };
    crate::boot::run_with_command(&args.image, script, command, args.compile.into())
}

impl ScriptOptions {
    /// Whether any script option was given (so `exotap` without a subcommand has work).
    pub fn any(&self) -> bool {
        self.script.is_some() || self.list.is_some() || self.list_vars.is_some()
    }
}

/// Applies the `-D NAME=VALUE` settings: limits by name; any other name only warns, since
/// stap passes it to the C compiler of a module exotap does not build.
fn limits_from(defines: &[String]) -> anyhow::Result<Limits> {
    let mut limits = Limits::default();
    for d in defines {
        match limits.set(d) {
            Ok(()) => {}
            Err(LimitError::Unknown(name)) => tracing::warn!(
                "-D {d}: {name} has no effect in exotap (it is not one of its limits)"
            ),
            Err(e) => return Err(e).with_context(|| format!("bad -D {d}")),
        }
    }
    Ok(limits)
}

/// Runs the script (or listing) `args` asks for; returns the process exit code.
///
/// # Errors
/// When the script or output file cannot be opened, or the options are inconsistent.
pub fn run(script_args: &ScriptArgs) -> anyhow::Result<i32> {
    let args = &script_args.options;
    let color = std::io::stderr().is_terminal();
    let resolver = LazyKernel::new(args.image.clone());
    let listing = args
        .list
        .as_ref()
        .map(|p| (p, false))
        .or(args.list_vars.as_ref().map(|p| (p, true)));
    if let Some((pattern, with_vars)) = listing {
        let resolver = LazyKernel {
            listing: Some(args.target.clone()),
            list_vars: with_vars,
            ..LazyKernel::new(args.image.clone())
        };
        let mut out = std::io::stdout();
        let code = run_listing(
            pattern,
            with_vars,
            &resolver,
            &mut out,
            &mut std::io::stderr(),
            color,
        );
        return Ok(code);
    }
    // As stap: with -e every word after the options is an argument of the script.
    let (source, script_args) = match (&args.script, &script_args.file) {
        (Some(text), first) => (
            ScriptSource {
                name: "<input>".to_string(),
                text: text.clone(),
            },
            first.iter().chain(&script_args.args).cloned().collect(),
        ),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read script {path}"))?;
            (
                ScriptSource {
                    name: path.clone(),
                    text,
                },
                script_args.args.clone(),
            )
        }
        (None, None) => bail!("give a script FILE, -e SCRIPT, -l PATTERN or -L PATTERN"),
    };
    if let (Some(command), Some(_)) = (&args.command, &args.target) {
        bail!(
            "-c {command:?} with --target: exotap cannot start a command inside a guest that is \
             already running; run it there and pass its pid with -x PID, or leave out --target \
             and exotap boots a guest that runs it"
        );
    }
    let limits = limits_from(&args.define)?;
    let facts = target_facts(&args.image);
    tracing::debug!(
        "preprocessor facts: kernel {} ({}), from {}",
        facts.kernel_release,
        facts.arch,
        facts.origin
    );
    let globals = args
        .global
        .iter()
        .map(|g| {
            g.split_once('=')
                .map(|(n, v)| (n.to_owned(), v.to_owned()))
                .with_context(|| format!("-G {g}: expected NAME=VALUE"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let invocation = Invocation {
        args: script_args,
        guru: args.guru,
        target_pid: args.target_pid,
        facts,
        include_dirs: args.include.clone(),
        globals,
        no_warnings: args.no_warnings,
        host_files: exotap_probes::procfs::HostFiles {
            dir: args.procfs_dir.clone(),
            http: args.http,
        },
    };
    if args.bpf {
        tracing::warn!(
            "--bpf: exotap compiles the script into its own code in the guest (--compile), not into eBPF"
        );
    }
    for (given, what) in [
        (
            args.buffer_mib.is_some(),
            "-s (exotap sizes its rings itself)",
        ),
        (
            args.keep_tmp,
            "-k (exotap builds no module, nothing to keep)",
        ),
        (
            args.all_modules,
            "--all-modules (exotap reads the guest's modules live)",
        ),
    ] {
        if given {
            tracing::debug!("stap option {what}: accepted, nothing to do");
        }
    }
    let out: Box<dyn Write> = match &args.output {
        Some(path) => {
            let f = std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?;
            Box::new(std::io::BufWriter::new(f))
        }
        None => Box::new(std::io::stdout()),
    };
    let stop = match stop_on_ctrl_c() {
        Ok(stop) => stop,
        Err(e) => {
            tracing::warn!("cannot catch Ctrl-C ({e}); the script can only end by itself");
            Arc::new(AtomicBool::new(false))
        }
    };
    if let Some(seconds) = args.timeout {
        // -T: the same end as a Ctrl-C after SECONDS (end probes run, probes removed).
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(seconds));
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let format = match args.format {
        OutputFormat::Text => Format::Text,
        OutputFormat::Json => Format::Json,
    };
    if let (Some(target), None | Some(5)) = (&args.target, args.pass) {
        drop(out);
        return run_attached(source, target, args, &invocation, limits, format, stop);
    }
    if let (Some(command), None | Some(5)) = (&args.command, args.pass) {
        drop(out);
        return run_command(source, command, args, &invocation, limits, format, stop);
    }
    let job = Job {
        source,
        last_pass: args.pass,
        format,
        limits,
        color,
        resolver: &resolver,
        invocation,
    };
    Ok(run_job(&job, out, Box::new(std::io::stderr()), &stop))
}
