//! `exotap regress`: the splicing-safety differential regression (see regress/).

use exotap_regress::{Options, Report};

/// Arguments of `exotap regress`.
#[derive(Debug, clap::Args)]
pub struct RegressArgs {
    /// The exhaustive sweep: one run per point and probe, traps as breakpoint stops
    /// through the control interface (the default batches points and handles traps
    /// inside the emulator).
    #[arg(long)]
    pub full: bool,
    /// Points probed together in one run (default 16; 1 with --full).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub batch: Option<u16>,
    /// Also run the sweep over 40 library functions of the Debian kernel's vmlinux (needs
    /// the -dbg package in the cache: `exotap image fetch --debuginfo`).
    #[arg(long)]
    pub vmlinux: bool,
}

/// Builds the x86-64 mini-kernel, runs the sweep, prints the report; exit code 1 when
/// anything diverged or could not be built.
///
/// # Errors
/// When the regression cannot run (no gcc, emulator failure).
pub fn run(args: &RegressArgs) -> anyhow::Result<i32> {
    let mut options = if args.full {
        Options::full()
    } else {
        Options::ci()
    };
    if let Some(batch) = args.batch {
        options.batch = usize::from(batch);
    }
    let mut reports: Vec<Report> = vec![exotap_regress::regress_x86_minikernel(&options)?];
    if args.vmlinux {
        let path = exotap_regress::vmlinux::cached_vmlinux().ok_or_else(|| {
            anyhow::anyhow!(
                "no vmlinux with symbols in the cache: run exotap image fetch --debuginfo"
            )
        })?;
        reports.push(exotap_regress::vmlinux::regress(&path, &options)?);
    }
    let mut failed = false;
    for report in &reports {
        println!("{report}\n");
        failed |= !report.divergences.is_empty() || !report.build_errors.is_empty();
    }
    Ok(i32::from(failed))
}
