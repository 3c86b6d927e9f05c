//! The splicing-safety differential regression (DESIGN.md: instrumentation must never
//! change what the kernel computes, on every point exotap accepts).
//!
//! A kernel image (the x86-64 mini-kernel built from `guest-images/minikernels/`) runs in
//! the Unicorn backend once unspliced, with a code hook counting every instruction's
//! executions: the reference. Then, for every instruction of every function, the splice
//! planner decides splice, trap or refuse; every accepted point is instrumented with a
//! counting probe (a splice: `jmp` to a code patch in a patch heap mapped next to the
//! kernel; a trap: a breakpoint whose handler counts and resumes through the
//! out-of-line copy), the image runs again, and the run must end the same way, with the
//! same registers and memory (heap excluded), and with the probe's count equal to the
//! reference's execution count of that instruction. Anything else is a divergence.
//!
//! [`sparc`] does the same for the SPARC v9 mini-kernel with KernInst-style `ba,a` splices
//! (springboards when the patch heap is out of reach).
//!
//! Points can be instrumented in batches (each with its own counter and patch) to save
//! runs; a batch that diverges is re-run point by point so the report names the points.

pub mod image;
pub mod jit;
pub mod sparc;
pub mod vmlinux;
pub mod x86;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

pub use image::{ElfImage, ImageError};

/// Errors that stop the regression itself (as opposed to divergences, which it reports).
#[derive(Debug, thiserror::Error)]
pub enum RegressError {
    /// The image cannot be built or loaded.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// Building the mini-kernel failed.
    #[error("cannot build the mini-kernel")]
    Build(#[from] exotap_guest_images::workloads::WorkloadError),
    /// The emulator failed.
    #[error("the emulator failed")]
    Emulator(#[from] exotap_vmm::control::ControlError),
    /// The unspliced reference run did not end at the halt address.
    #[error("the reference run did not halt: {0}")]
    ReferenceDidNotHalt(String),
    /// The image is not laid out as the harness expects.
    #[error("the image is not usable: {0}")]
    Layout(String),
    /// Listed functions that the sweep cannot call (not in the image, not code, ...).
    #[error("cannot sweep {}", unusable_list(.0))]
    Unusable(Vec<vmlinux::UnusableFunction>),
}

fn unusable_list(functions: &[vmlinux::UnusableFunction]) -> String {
    let names: Vec<String> = functions.iter().map(ToString::to_string).collect();
    names.join("; ")
}

/// How a probe is attached at a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProbeKind {
    /// A splice (`jmp rel32` to a code patch with a counter).
    Splice,
    /// A trap (breakpoint; the host counts and resumes through an out-of-line copy).
    Trap,
    /// `exotap time`'s entry patch and return trampoline (a histogram of cycles).
    Time,
    /// `exotap trace`'s entry patch and return trampoline (ring records).
    Trace,
    /// `exotap nullify`'s diverting patch (returns a value, the function never runs).
    Nullify,
    /// `exotap replace`'s diverting patch (a jump to another function).
    Replace,
}

impl fmt::Display for ProbeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Splice => "splice",
            Self::Trap => "trap",
            Self::Time => "time",
            Self::Trace => "trace",
            Self::Nullify => "nullify",
            Self::Replace => "replace",
        })
    }
}

/// A point where instrumentation changed what the kernel did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// The instrumented instruction(s): one, unless only a whole batch diverges.
    pub points: Vec<u64>,
    /// The function holding the first point.
    pub function: String,
    /// How it was probed.
    pub kind: ProbeKind,
    /// What differed.
    pub what: String,
}

/// What the regression found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The image.
    pub image: String,
    /// Functions analysed.
    pub functions: usize,
    /// Instruction starts considered.
    pub points: usize,
    /// Points the planner would splice.
    pub splice_points: usize,
    /// Points the planner would trap.
    pub trap_points: usize,
    /// Refused points by reason.
    pub refused: BTreeMap<String, usize>,
    /// Accepted points the reference run executed at least once.
    pub executed_points: usize,
    /// Accepted points whose patch or out-of-line copy could not be built, with why.
    pub build_errors: Vec<(u64, String)>,
    /// Spliced runs checked (points).
    pub splices_checked: usize,
    /// Trap runs checked (points).
    pub traps_checked: usize,
    /// Function entries checked per entry patch kind (time, trace, nullify, replace: the
    /// vmlinux sweep, [`vmlinux`]'s entries module), each run under its kind's own oracle.
    pub entries_checked: BTreeMap<ProbeKind, usize>,
    /// Function entries the planner would not splice (no entry patch checked there), with why.
    pub entries_refused: Vec<String>,
    /// Splices checked that reached their patch through a springboard (SPARC: patch
    /// beyond `ba,a` reach).
    pub springboards: usize,
    /// Emulator runs made (reference included).
    pub runs: usize,
    /// Instructions of the reference run.
    pub reference_instructions: u64,
    /// The reference run's checksum.
    pub checksum: u64,
    /// Functions left out, with why: not in this image, or their unprobed reference call
    /// did not return (not a divergence: there is nothing to compare against).
    pub skipped: Vec<String>,
    /// Divergences: must be empty.
    pub divergences: Vec<Divergence>,
    /// Wall time.
    pub elapsed: Duration,
    /// Wall time of the splice runs.
    pub splice_time: Duration,
    /// Wall time of the trap runs.
    pub trap_time: Duration,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "image: {}", self.image)?;
        writeln!(
            f,
            "reference: {} instructions, checksum {:#018x}",
            self.reference_instructions, self.checksum
        )?;
        writeln!(
            f,
            "points tried: {} in {} functions",
            self.points, self.functions
        )?;
        writeln!(
            f,
            "accepted: {} (splice {}, trap {}), {} of them executed by the reference run",
            self.splice_points + self.trap_points,
            self.splice_points,
            self.trap_points,
            self.executed_points
        )?;
        let refused: usize = self.refused.values().sum();
        writeln!(f, "refused: {refused}")?;
        for (reason, n) in &self.refused {
            writeln!(f, "  {n:>6}  {reason}")?;
        }
        writeln!(
            f,
            "checked: {} splices, {} traps in {} runs",
            self.splices_checked, self.traps_checked, self.runs
        )?;
        if !self.entries_checked.is_empty() || !self.entries_refused.is_empty() {
            let per_kind: Vec<String> = self
                .entries_checked
                .iter()
                .map(|(kind, n)| {
                    let bad = self.divergences.iter().filter(|d| d.kind == *kind).count();
                    format!("{kind} {n} ({bad} diverged)")
                })
                .collect();
            writeln!(
                f,
                "function entries checked per patch kind: {}; {} entries not spliced",
                per_kind.join(", "),
                self.entries_refused.len()
            )?;
            for why in self.entries_refused.iter().take(20) {
                writeln!(f, "  {why}")?;
            }
        }
        if self.springboards > 0 {
            writeln!(f, "through springboards: {}", self.springboards)?;
        }
        if !self.skipped.is_empty() {
            writeln!(f, "skipped: {}", self.skipped.join("; "))?;
        }
        writeln!(f, "build errors: {}", self.build_errors.len())?;
        for (addr, why) in self.build_errors.iter().take(20) {
            writeln!(f, "  {addr:#x}: {why}")?;
        }
        let by_kind: Vec<String> = [ProbeKind::Splice, ProbeKind::Trap]
            .into_iter()
            .chain(self.entries_checked.keys().copied())
            .map(|kind| {
                let n = self.divergences.iter().filter(|d| d.kind == kind).count();
                format!("{kind} {n}")
            })
            .collect();
        writeln!(
            f,
            "divergences: {} ({})",
            self.divergences.len(),
            by_kind.join(", ")
        )?;
        for d in self.divergences.iter().take(50) {
            let points: Vec<String> = d.points.iter().map(|p| format!("{p:#x}")).collect();
            writeln!(
                f,
                "  {} {} in {}: {}",
                d.kind,
                points.join(","),
                d.function,
                d.what
            )?;
        }
        write!(
            f,
            "time: {:.1} s (splice runs {:.1} s, trap runs {:.1} s)",
            self.elapsed.as_secs_f64(),
            self.splice_time.as_secs_f64(),
            self.trap_time.as_secs_f64()
        )
    }
}

/// What to check.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Points instrumented together in one run (1: one run per point).
    pub batch: usize,
    /// Also check a trap probe at every splice point (the trap path is every point's
    /// fallback), not only where the planner chose a trap.
    pub traps_everywhere: bool,
    /// Handle trap probes inside the emulator (a code hook moves the pc to the
    /// out-of-line copy) rather than as breakpoint stops through the control interface
    /// (one emulator exit and resume per hit: exact, but slow for hot points).
    pub in_emulator_traps: bool,
    /// Check only every `stride`-th accepted point (1: all of them).
    pub stride: usize,
}

impl Options {
    /// The CI sweep: every accepted point, batched.
    #[must_use]
    pub fn ci() -> Self {
        Self {
            batch: 16,
            traps_everywhere: true,
            in_emulator_traps: true,
            stride: 1,
        }
    }

    /// The exhaustive sweep: one run per point and probe kind.
    #[must_use]
    pub fn full() -> Self {
        Self {
            batch: 1,
            traps_everywhere: true,
            in_emulator_traps: false,
            stride: 1,
        }
    }
}

/// Builds the x86-64 mini-kernel and runs the JIT regression over it: every function
/// translated with block counters ([`jit`]).
///
/// # Errors
/// gcc missing or failing, emulator failure, a reference run that does not halt.
pub fn regress_jit_x86_minikernel() -> Result<jit::JitReport, RegressError> {
    let kernel = exotap_guest_images::minikernel::ensure_x86_64()?;
    let image = ElfImage::load(&kernel.elf)?;
    jit::regress_image(&image)
}

/// Builds the x86-64 mini-kernel and runs the regression over it.
///
/// # Errors
/// gcc missing or failing, emulator failure, a reference run that does not halt.
pub fn regress_x86_minikernel(options: &Options) -> Result<Report, RegressError> {
    let kernel = exotap_guest_images::minikernel::ensure_x86_64()?;
    let image = ElfImage::load(&kernel.elf)?;
    x86::regress(&image, options)
}
