//! The live verbs' arguments (clap): how to reach the guest, and each verb's own.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::backend::{BackendChoice, MachineArgs};
use crate::kernel_image::ImageArgs;

/// How to reach the guest: a running one (`--target`) or one booted for the run.
#[derive(Debug, Args, Clone)]
pub struct LiveArgs {
    /// Attach to a running guest's gdbstub (tcp:HOST:PORT or unix:PATH), or to a running
    /// exotap VMM's control socket (vmm:PATH, `exotap boot --backend kvm --control-socket
    /// PATH`), instead of booting one: splices go in at once and come out at Ctrl-C, after
    /// --duration, or when the guest stops running.
    #[arg(long, short = 't', value_name = "ADDR")]
    pub target: Option<String>,
    /// With --target: the patch-heap range hidden from that guest, GPA:SIZE.
    #[arg(long, value_name = "GPA:SIZE", default_value = "0x3c000000:64M")]
    pub heap: String,
    /// With --target: the guest's RAM file, when its QEMU runs with a shared memory backend
    /// (`-object memory-backend-file,id=ram,size=1024M,mem-path=/dev/shm/guest-ram,share=on
    /// -machine memory-backend=ram`): trace records and counters are then read without
    /// stopping the guest. Without it, exotap stops the guest to read them.
    #[arg(long, value_name = "PATH", requires = "target")]
    pub shm: Option<PathBuf>,
    /// Booting: read trace records with the guest stopped (over the gdbstub), as for a
    /// --target without --shm, instead of through the guest RAM exotap shares with QEMU.
    #[arg(long, conflicts_with = "target")]
    pub stop_and_read: bool,
    /// With --target: remove the splices after this many seconds.
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,
    /// Booting: the command the guest runs while the splices are in (default: the syscall
    /// workload). The guest runs `exotap_wait splice; COMMAND; exotap_wait unsplice`.
    #[arg(long, value_name = "COMMAND", conflicts_with = "job")]
    pub run: Option<String>,
    /// Booting: a job script for the guest instead of --run. exotap splices at its
    /// `exotap_wait splice` and removes the splices at its `exotap_wait unsplice`.
    #[arg(long, value_name = "FILE")]
    pub job: Option<PathBuf>,
    /// Booting: boot with this initramfs instead of building one from --run or --job (its job
    /// must call `exotap_wait splice` and `exotap_wait unsplice`).
    #[arg(long, value_name = "PATH", conflicts_with_all = ["run", "job"])]
    pub initrd: Option<PathBuf>,
    /// Booting: copy the serial console to FILE instead of stdout.
    #[arg(long, value_name = "FILE")]
    pub console: Option<PathBuf>,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// Booting: the machine. `kvm` is exotap's own VMM on /dev/kvm (counters, rings and maps
    /// read straight from guest memory, no stop of the guest between install and removal);
    /// `qemu` is QEMU over its gdbstub; `auto` takes kvm where /dev/kvm is hardware
    /// virtualization (not kvm_pvm) and there is no --target, qemu otherwise.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Also read the guest's own kprobe hit counters (`kprobe_events` probes) when the
    /// splices go in and when they come out, and print their difference beside each count.
    #[arg(long)]
    pub compare_kprobes: bool,
    #[command(flatten)]
    pub image: ImageArgs,
}

/// `exotap count PATTERN...`.
#[derive(Debug, Args)]
pub struct CountArgs {
    /// Function names or wildcard patterns (`vfs_*`): every matching kernel function's entry
    /// is spliced with a call counter.
    #[arg(required = true, value_name = "PATTERN")]
    pub patterns: Vec<String>,
    /// Count every basic block instead of the calls: the functions (and their direct
    /// callees, see --depth) are translated into a code cache in the patch heap with a
    /// counter at each block leader, and entered through a splice at each entry (the JIT).
    /// With --compare-kprobes, the guest's own kprobes (`p FUNC+OFFSET` at the leaders) are
    /// read at the job's `exotap_wait kprobes-in` and `exotap_wait kprobes-out` and their
    /// hits printed beside each block.
    #[arg(long)]
    pub blocks: bool,
    /// With --blocks: translate direct callees to this depth (0: only the functions named).
    #[arg(long, default_value_t = 1, value_name = "N", requires = "blocks")]
    pub depth: u32,
    /// With --blocks: print the blocks of the translated callees too.
    #[arg(long, requires = "blocks")]
    pub all_blocks: bool,
    /// With --blocks: lazy translation. A direct call or jump from translated code to a
    /// function not translated yet stops the guest once (a breakpoint on a stub in the
    /// cache); exotap translates the function, relinks the stub and splices its entry. A job
    /// may `exotap_wait jit-mark`: the counts printed are those after it, and the stops
    /// before and after it are reported apart.
    #[arg(long, requires = "blocks")]
    pub lazy: bool,
    /// With --blocks: output format.
    #[arg(long, value_enum, default_value_t = BlockFormat::Text, requires = "blocks")]
    pub format: BlockFormat,
    /// With --blocks: also write the line coverage of the functions named as an lcov
    /// tracefile (needs the cached -dbg vmlinux: `exotap image fetch --debuginfo`).
    #[arg(long, value_name = "FILE", requires = "blocks")]
    pub lcov: Option<PathBuf>,
    /// Booting, with --blocks: a probe script run with host-evaluated trap probes (one stop
    /// of the guest per hit) from the job's `exotap_wait script-in` to its `exotap_wait
    /// script-out`, outside the splices; e.g. a trap probe at every block leader, the JIT's
    /// trap-per-block peer in one guest run. Its output goes to stdout
    #[arg(long, value_name = "FILE", requires = "blocks")]
    pub trap_script: Option<PathBuf>,
    #[command(flatten)]
    pub live: LiveArgs,
}

/// `exotap coverage PATTERN... | --file SOURCE -o OUT.info`.
#[derive(Debug, Args)]
pub struct CoverageArgs {
    /// Kernel functions (or wildcard patterns) to cover.
    #[arg(value_name = "PATTERN", required_unless_present = "file")]
    pub patterns: Vec<String>,
    /// Cover every function the debug info places in this source file (`fs/read_write.c`).
    #[arg(long, value_name = "SOURCE")]
    pub file: Option<String>,
    /// The lcov tracefile to write.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// Also print the blocks: a table, or JSON per basic block.
    #[arg(long, value_enum, default_value_t = BlockFormat::Text)]
    pub format: BlockFormat,
    /// Translate direct callees to this depth too (their lines are not reported).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub depth: u32,
    /// Lazy translation of the functions reached beyond --depth (see `count --lazy`).
    #[arg(long)]
    pub lazy: bool,
    #[command(flatten)]
    pub live: LiveArgs,
}

/// How `count --blocks` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BlockFormat {
    /// A table, one block a line.
    Text,
    /// One JSON object: the blocks, the cache and the removal checks.
    Json,
}

/// `exotap nullify FUNC VALUE`.
#[derive(Debug, Args)]
pub struct NullifyArgs {
    /// The kernel function: every call returns VALUE at once, without running it.
    pub function: String,
    /// The value returned (decimal, 0x hex, or negative like -1).
    #[arg(allow_hyphen_values = true)]
    pub value: String,
    #[command(flatten)]
    pub live: LiveArgs,
}

/// `exotap replace FUNC OTHER`.
#[derive(Debug, Args)]
pub struct ReplaceArgs {
    /// The kernel function whose calls are diverted.
    pub function: String,
    /// The kernel function that runs instead (same arguments, returns to the caller).
    pub other: String,
    #[command(flatten)]
    pub live: LiveArgs,
}

/// `exotap time FUNC...`.
#[derive(Debug, Args)]
pub struct TimeArgs {
    /// Kernel functions (or wildcard patterns): each call's time from entry to return
    /// (inclusive of callees and of sleeping) goes into a log2 histogram.
    #[arg(required = true, value_name = "FUNC")]
    pub functions: Vec<String>,
    #[command(flatten)]
    pub live: LiveArgs,
}

/// `exotap trace FUNC...`.
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Kernel functions (or wildcard patterns): every entry (with the first argument) and
    /// return (with the return value) is recorded with its TSC in per-vCPU rings.
    #[arg(required = true, value_name = "FUNC")]
    pub functions: Vec<String>,
    /// Also write the records to FILE as a Perfetto trace (ui.perfetto.dev): one track per
    /// vCPU, each call a slice from its entry to its return, with the task's name and pid.
    #[arg(long, value_name = "FILE")]
    pub perfetto: Option<PathBuf>,
    #[command(flatten)]
    pub live: LiveArgs,
}

/// `exotap splice-report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// List every site that is not a splice, with its reason.
    #[arg(long)]
    pub list: bool,
    /// Also install a counting splice at this many of the splice-able ftrace sites in one
    /// batch (print the install rate), leave them in while the guest runs (booted: between
    /// its splice and unsplice waits; --target: until Ctrl-C or --duration), then remove them
    /// in one batch (print the removal rate, the hits, and whether the text is identical).
    #[arg(long, value_name = "N")]
    pub install: Option<usize>,
    #[command(flatten)]
    pub live: LiveArgs,
}

/// A value given on the command line: decimal, `0x` hex, or negative (as its two's
/// complement).
pub(super) fn parse_value(text: &str) -> anyhow::Result<u64> {
    if let Some(neg) = text.strip_prefix('-') {
        let v: i64 = neg
            .parse()
            .with_context(|| format!("`{text}` is not a number"))?;
        return Ok((-v) as u64);
    }
    crate::attach::parse_u64(text).map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_values_parse_as_twos_complement() {
        assert_eq!(parse_value("-1").unwrap(), u64::MAX);
        assert_eq!(parse_value("0x10").unwrap(), 16);
        assert!(parse_value("x").is_err());
    }
}
