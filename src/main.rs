//! exotap: instrument an unmodified guest kernel from outside it.

/// `println!` for the CLI's own output, which does not panic when standard output is gone
/// (`exotap symbols 'vfs_*' | head -1`): see [`stdout_write`].
macro_rules! outln {
    () => { $crate::stdout_write(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::stdout_write(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` for the CLI's own output; see [`outln!`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::stdout_write(format_args!($($arg)*)) };
}

mod attach;
mod backend;
mod backtrace;
mod boot;
mod debuginfo;
mod entry_patch;
mod image;
mod kernel_image;
mod kvm_splice;
mod manual;
mod perfetto;
mod phase_script;
mod profile;
mod recover;
#[cfg(feature = "unicorn")]
mod regress;
mod script;
mod selftest;
mod verbs;
mod vmm_control;

use std::io::Write as _;
use std::process::ExitCode;
use std::sync::Mutex;

use clap::{Parser, Subcommand};

/// Exit code when exotap itself fails (as opposed to the guest's job).
pub const EXOTAP_FAILURE: u8 = 125;

/// Trace, profile and change an unmodified guest kernel from outside it: from a hypervisor,
/// an emulator or a QEMU gdbstub.
#[derive(Debug, Parser)]
///
/// Without a subcommand, `exotap FILE.stp [ARGS...]`, `exotap -e 'SCRIPT' [ARGS...]`,
/// `exotap -l PATTERN` and `exotap -L PATTERN` work as `exotap run` does, like `stap`.
#[command(
    name = "exotap",
    version,
    propagate_version = true,
    args_conflicts_with_subcommands = true,
    arg_required_else_help = true
)]
struct Cli {
    /// More log output (-v debug, -vv trace). EXOTAP_LOG=filter overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(flatten)]
    script: script::ScriptArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a probe script (SystemTap-like language; see probes/README.md).
    ///
    /// Exits with 0, 1 after a script error, or 125 when exotap itself failed.
    Run(script::ScriptArgs),
    /// Fetch and manage guest images (Debian kernels, debug info) in the cache.
    #[command(subcommand)]
    Image(image::ImageCommand),
    /// Boot the Debian guest under QEMU with the workloads and follow its job to the end.
    ///
    /// Exits with the guest job's exit code, or 125 when exotap or the guest failed
    /// (boot timeout, QEMU died, ...).
    Boot(boot::BootArgs),
    /// Say what this host can virtualize with (hardware KVM, kvm_pvm, none).
    Host,
    /// Attach to a running QEMU guest over its gdbstub and print what exotap sees
    /// (vCPUs, modes, page tables, attach time), then detach.
    Attach(attach::InfoArgs),
    /// Print what exotap sees of a running guest (same as attach): banner, KASLR slide,
    /// layout, vCPUs and their current tasks, attach time.
    Info(attach::InfoArgs),
    /// Boot a guest and prove exotap works on this host: attach, KASLR slide vs the guest's
    /// /proc/kallsyms, patch heap, a counting splice of __x64_sys_getpid checked against the
    /// workload and the guest's own kprobe hit count, exact restore. Prints HOST-RESULT lines.
    Selftest(selftest::SelftestArgs),
    /// List the guest kernel's symbols matching a pattern (from the kallsyms tables inside
    /// the image; link-time addresses unless --slide is given).
    Symbols(kernel_image::SymbolsArgs),
    /// Read guest memory.
    #[command(subcommand)]
    Mem(attach::MemCommand),
    /// Count calls of kernel functions by splicing a counter into each entry (`vfs_*`) of a
    /// live guest, until the guest's run ends (booted) or Ctrl-C (--target). Exact bytes
    /// restored at the end; prints the counts and the text-page hashes before and after.
    Count(verbs::CountArgs),
    /// Kernel line coverage out of the guest, through the JIT's block counters (`count
    /// --blocks`): an lcov tracefile with lines from the -dbg DWARF (`genhtml` renders it).
    Coverage(verbs::CoverageArgs),
    /// Time every call of kernel functions from entry to return, in the guest (rdtsc pairs,
    /// return addresses swapped as kretprobes do), and print log2 histograms at the end.
    Time(verbs::TimeArgs),
    /// Record every entry (first argument) and return (return value) of kernel functions with
    /// rdtsc timestamps and the task in per-vCPU ring buffers in the guest, printed as they
    /// come: read through the guest RAM shared with QEMU every 10 ms without stopping it, or
    /// with a stop every 250 ms for a --target without --shm. --perfetto also writes slices.
    Trace(verbs::TraceArgs),
    /// Make every call of a kernel function return VALUE at once (spliced, undone at the end).
    Nullify(verbs::NullifyArgs),
    /// Run another kernel function instead of FUNC (spliced, undone at the end).
    Replace(verbs::ReplaceArgs),
    /// Plan a splice at every ftrace site of the live guest (what available_filter_functions
    /// lists) and print how many are splice-able and why the others are not; --install N
    /// also installs N counting splices in one batch while the guest runs, and prints the rates.
    SpliceReport(verbs::ReportArgs),
    /// Source lines of kernel functions from the -dbg DWARF: gdb's `info line` answer, then
    /// every line with its address. Patterns as SystemTap's: `vfs_read`, `vfs_*`, `*@fs/open.c`.
    Lines(debuginfo::LinesArgs),
    /// Print a kernel type as gdb's `ptype` does (`-o`: with offsets), from the -dbg DWARF, or
    /// from the image's BTF with `--btf` or when no -dbg vmlinux is cached.
    Ptype(debuginfo::PtypeArgs),
    /// Parameters and locals of kernel functions with their locations at entry (`--ranges`:
    /// whole location lists); parameters only, from BTF, when no -dbg vmlinux is cached.
    Vars(debuginfo::VarsArgs),
    /// Addresses (and functions) of a kernel source line: `exotap where fs/open.c:1337`; or the
    /// source line of an address: `exotap where 0xffffffff81349955`.
    Where(debuginfo::WhereArgs),
    /// KLAS join points: the instructions that read, write or call through a struct member
    /// (`exotap joinpoints 'struct file.f_pos'`), from DWARF and disassembly.
    Joinpoints(debuginfo::JoinpointsArgs),
    /// Remove everything an earlier exotap left in a running guest (splices, swapped return
    /// addresses, breakpoints) and let it run: what the guardian does when an exotap dies.
    /// It finds exotap's work by the journal kept in the patch heap.
    Recover(recover::RecoverArgs),
    /// (internal) The guardian exotap starts beside itself: it recovers the guest if exotap
    /// dies without removing its probes.
    #[command(hide = true)]
    Guardian(recover::GuardianArgs),
    /// Splicing-safety regression: build the x86-64 and SPARC v9 mini-kernels, run them under
    /// Unicorn, then again with a counting splice or trap probe at every point the planner accepts;
    /// report points tried, accepted, refused by reason, and divergences (exit 1 if any).
    #[cfg(feature = "unicorn")]
    Regress(regress::RegressArgs),
    /// Kernel stacks of every vCPU (from its registers) and every task (from its saved stack
    /// pointer), unwound from outside with the image's ORC tables while the guest is stopped:
    /// a running guest now (--target), or a booted one at its job's `exotap_wait backtrace`.
    Backtrace(backtrace::BacktraceArgs),
    /// Sample every vCPU's kernel stack from the host (stop, read registers, unwind, resume)
    /// at --hz for --duration or while the guest runs --run; print the hottest stacks, write
    /// folded stacks (--folded), an SVG flame graph (--svg) or JSON, and the overhead.
    Profile(profile::ProfileArgs),
    /// Write exotap's manual pages (exotap.1 and one per subcommand) into a directory.
    Man(manual::ManArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(manual::CompletionsArgs),
}

/// Logging to stderr at `info` (`-v` debug, `-vv` trace; a script's `-w`: errors only).
fn init_logging(verbose: u8, no_warnings: bool) {
    let default = match verbose {
        0 if no_warnings => "error",
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("EXOTAP_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .init();
}

/// With `--target`, Ctrl-C, SIGTERM and SIGHUP are taken from the start: a signal during the
/// attach or the install ends the run with a normal removal once the probes are in, instead
/// of killing exotap half-way (its guardian would recover the guest, but the run would print
/// nothing). A booted guest's run keeps the default until its own handler goes in.
fn signals_stop_the_run() {
    if let Err(e) = exotap_probes::lang::driver::stop_on_ctrl_c() {
        tracing::warn!("Ctrl-C will not remove the probes: {e}");
    }
}

/// `exotap -v count ...`: the global `-v` before a subcommand's name. Without a subcommand
/// exotap reads its first word as a script FILE (as `stap` does), so clap would take
/// `count` for one; the leading `-v`/`-vv`/`--verbose` words are moved after the name
/// instead, where a global flag means the same.
fn verbose_after_subcommand(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    use clap::CommandFactory as _;
    let is_verbose = |a: &std::ffi::OsString| {
        a.to_str().is_some_and(|a| {
            a == "--verbose"
                || (a.len() > 1 && a.starts_with('-') && a[1..].chars().all(|c| c == 'v'))
        })
    };
    let flags = args.iter().skip(1).take_while(|a| is_verbose(a)).count();
    let Some(name) = args.get(1 + flags).and_then(|a| a.to_str()) else {
        return args;
    };
    if flags > 0
        && Cli::command()
            .get_subcommands()
            .any(|s| s.get_name() == name)
    {
        args[1..=1 + flags].rotate_left(flags);
    }
    args
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(verbose_after_subcommand(std::env::args_os().collect()));
    let no_warnings = match &cli.command {
        Some(Command::Run(a)) => a.options.no_warnings,
        _ => cli.script.options.no_warnings,
    };
    init_logging(cli.verbose, no_warnings);
    recover::enable_guardian();
    let Some(command) = cli.command else {
        let result = if cli.script.any() {
            if cli.script.options.target.is_some() {
                signals_stop_the_run();
            }
            script::run(&cli.script)
        } else {
            Err(anyhow::anyhow!(
                "give a subcommand, a script FILE, -e SCRIPT, -l PATTERN or -L PATTERN (see --help)"
            ))
        };
        if result.is_ok() {
            exotap_probes::live::recover::dismiss();
        }
        return exit_code(result);
    };
    // The live commands take Ctrl-C, SIGTERM and SIGHUP from the start: a signal during the
    // attach or the install ends the run with a normal removal once the probes are in,
    // instead of killing exotap half-way (the guardian would recover the guest, but the
    // run would print nothing).
    let target = match &command {
        Command::Run(a) => a.options.target.is_some(),
        Command::Count(verbs::CountArgs { live, .. })
        | Command::Coverage(verbs::CoverageArgs { live, .. })
        | Command::Time(verbs::TimeArgs { live, .. })
        | Command::Trace(verbs::TraceArgs { live, .. })
        | Command::Nullify(verbs::NullifyArgs { live, .. })
        | Command::Replace(verbs::ReplaceArgs { live, .. })
        | Command::SpliceReport(verbs::ReportArgs { live, .. }) => live.target.is_some(),
        _ => false,
    };
    if target {
        signals_stop_the_run();
    }
    let result = match command {
        Command::Run(args) => script::run(&args),
        Command::Image(cmd) => image::run(cmd).map(|()| 0),
        Command::Boot(args) => boot::run(&args),
        Command::Attach(args) | Command::Info(args) => attach::run_info(&args).map(|()| 0),
        Command::Selftest(args) => selftest::run(&args),
        Command::Symbols(args) => kernel_image::run_symbols(&args),
        Command::Mem(cmd) => attach::run_mem(&cmd).map(|()| 0),
        Command::Count(args) => verbs::run_count(&args),
        Command::Coverage(args) => verbs::run_coverage(&args),
        Command::Time(args) => verbs::run_time(&args),
        Command::Trace(args) => verbs::run_trace(&args),
        Command::Nullify(args) => verbs::run_nullify(&args),
        Command::Replace(args) => verbs::run_replace(&args),
        Command::SpliceReport(args) => verbs::run_report(&args),
        Command::Lines(args) => debuginfo::run_lines(&args),
        Command::Ptype(args) => debuginfo::run_ptype(&args),
        Command::Vars(args) => debuginfo::run_vars(&args),
        Command::Where(args) => debuginfo::run_where(&args),
        Command::Joinpoints(args) => debuginfo::run_joinpoints(&args),
        Command::Recover(args) => recover::run_recover(&args),
        Command::Guardian(args) => recover::run_guardian(&args),
        #[cfg(feature = "unicorn")]
        Command::Regress(args) => regress::run(&args),
        Command::Backtrace(args) => backtrace::run_backtrace(&args),
        Command::Profile(args) => profile::run_profile(&args),
        Command::Man(args) => manual::run_man(&args),
        Command::Completions(args) => manual::run_completions(&args),
        Command::Host => {
            let support = exotap_vmm::host::detect();
            outln!("{}", support.explain());
            Ok(0)
        }
    };
    // A normal end (the script's own exit code included) removed everything: the guardian
    // may go; so did a run whose reader went away (the live verbs end with that error only
    // after their removal). After any other error it stays, and recovers whatever is left.
    if result.as_ref().map_or_else(is_broken_pipe, |_| true) {
        exotap_probes::live::recover::dismiss();
    }
    exit_code(result)
}

/// The first error writing standard output, if any (see [`stdout_write`]).
static STDOUT_ERROR: Mutex<Option<std::io::Error>> = Mutex::new(None);

/// Writes the CLI's own output to standard output. `println!` panics when that fails (a
/// reader such as `head` that closed the pipe, a full disk); a panic in the middle of a
/// command that has splices in a live guest would leave them there. Instead the first error
/// is kept, later output is dropped, the command runs to its end (removing what it
/// installed), and [`exit_code`] reports the error.
fn stdout_write(args: std::fmt::Arguments<'_>) {
    let mut failed = STDOUT_ERROR
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if failed.is_none() {
        if let Err(err) = std::io::stdout().lock().write_fmt(args) {
            *failed = Some(err);
        }
    }
}

/// Exit code of a command whose reader closed the pipe (128 + SIGPIPE, as a shell shows a
/// tool killed by SIGPIPE).
const BROKEN_PIPE_EXIT: u8 = 141;

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn exit_code(result: anyhow::Result<i32>) -> ExitCode {
    let stdout_error = STDOUT_ERROR
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    // A reader that stopped reading is not worth a message, as for other Unix tools; any
    // other error of the command still is (e.g. splices it could not remove).
    let broken_pipe = match &result {
        Err(err) => is_broken_pipe(err),
        Ok(_) => stdout_error
            .as_ref()
            .is_some_and(|err| err.kind() == std::io::ErrorKind::BrokenPipe),
    };
    if broken_pipe {
        return ExitCode::from(BROKEN_PIPE_EXIT);
    }
    match (result, stdout_error) {
        (Err(err), _) => {
            eprintln!("exotap: error: {err:#}");
            ExitCode::from(EXOTAP_FAILURE)
        }
        (Ok(_), Some(err)) => {
            eprintln!("exotap: error: cannot write standard output: {err}");
            ExitCode::from(EXOTAP_FAILURE)
        }
        (Ok(code), None) => {
            ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(EXOTAP_FAILURE))
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_leading_verbose_flag_goes_after_the_subcommand_and_scripts_keep_their_words() {
        let v = |words: &[&str]| {
            super::verbose_after_subcommand(words.iter().map(Into::into).collect())
                .into_iter()
                .map(|w| w.into_string().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            v(&["exotap", "-v", "count", "vfs_read"]),
            ["exotap", "count", "-v", "vfs_read"]
        );
        assert_eq!(
            v(&["exotap", "-vv", "--verbose", "symbols", "x"]),
            ["exotap", "symbols", "-vv", "--verbose", "x"]
        );
        // A script's arguments that happen to be subcommand names stay arguments.
        assert_eq!(
            v(&["exotap", "-v", "t.stp", "count"]),
            ["exotap", "-v", "t.stp", "count"]
        );
        assert_eq!(
            v(&["exotap", "t.stp", "count"]),
            ["exotap", "t.stp", "count"]
        );
        assert_eq!(
            v(&["exotap", "-e", "S", "count"]),
            ["exotap", "-e", "S", "count"]
        );
        assert_eq!(v(&["exotap"]), ["exotap"]);
    }
}
