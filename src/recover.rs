//! `exotap recover` and the hidden `exotap guardian`: argument parsing and printing over the
//! engine's recovery (`exotap_probes::live::recover`: the journal, the guardian's life).

use std::time::Instant;

use anyhow::Context;
use clap::Args;
use exotap_probes::live::recover::{self, GuardianEnd, Journal};

/// `exotap recover`: remove everything an earlier exotap left in a guest.
#[derive(Debug, Args, Clone)]
pub struct RecoverArgs {
    #[command(flatten)]
    pub target: crate::attach::TargetArgs,
    /// The patch-heap range hidden from that guest, GPA:SIZE (as the exotap that died used).
    #[arg(long, value_name = "GPA:SIZE", default_value = "0x3c000000:64M")]
    pub heap: String,
    /// Also print a SHA-256 of the live kernel text (`_stext`..`_etext`) after recovery,
    /// to compare with one taken before exotap ran (needs the kernel image, --kernel).
    #[arg(long)]
    pub digest: bool,
    #[command(flatten)]
    pub image: crate::kernel_image::ImageArgs,
}

/// Attaches, recovers, prints what was done, detaches (which also removes any breakpoint
/// QEMU still holds and lets the guest run).
///
/// # Errors
/// When attaching or guest memory fails.
pub fn run_recover(args: &RecoverArgs) -> anyhow::Result<i32> {
    let (heap, _) = crate::script::parse_heap(&args.heap)?;
    let started = Instant::now();
    let mut att = exotap_probes::live::attach::attach(&args.target.to_target())?;
    let result = Journal { heap_phys: heap }
        .recover(&mut att.machine)
        .and_then(|report| {
            let digest = if args.digest {
                let image = args.image.load()?;
                Some(recover::text_digest(&mut att, &image)?)
            } else {
                None
            };
            Ok((report, digest))
        });
    let detached = att.machine.detach();
    let (report, digest) = result?;
    detached.context("cannot detach")?;
    match report.owner {
        _ if !report.anything() => {
            outln!("nothing to recover: the journal at {heap:#x} lists nothing left in the guest");
        }
        Some(pid) => outln!("left by exotap pid {pid}: {report}"),
        None => outln!("{report}"),
    }
    if let Some(d) = digest {
        outln!("kernel text sha256 {d}");
    }
    outln!(
        "guest resumed after {:.3} s",
        started.elapsed().as_secs_f64()
    );
    Ok(0)
}

/// `exotap guardian` (internal): started by exotap, waits for it to end.
#[derive(Debug, Args, Clone)]
pub struct GuardianArgs {
    /// The gdbstub.
    #[arg(long)]
    pub target: String,
    /// Physical address of the patch heap.
    #[arg(long, value_parser = crate::attach::parse_u64)]
    pub heap: u64,
    /// The exotap this guardian watches.
    #[arg(long)]
    pub parent: u32,
}

/// The guardian: waits on standard input, recovers if exotap died, says what it did.
///
/// # Errors
/// Recovery failed (after exotap died).
pub fn run_guardian(args: &GuardianArgs) -> anyhow::Result<i32> {
    match recover::guardian_main(std::io::stdin().lock(), &args.target, args.heap) {
        Ok(GuardianEnd::Recovered(report, took)) => {
            // Said even when the journal was empty: the detach itself dropped the breakpoints
            // and let a guest that was stopped at one run on.
            if report.anything() {
                eprintln!(
                    "exotap guardian: exotap (pid {}) ended without removing its probes; \
                     recovered in {:.3} s: {report}; breakpoints dropped, guest running",
                    args.parent,
                    took.as_secs_f64()
                );
            } else {
                eprintln!(
                    "exotap guardian: exotap (pid {}) ended without dismissing its guardian (an \
                     error, or killed); nothing of it was left in the guest (checked in {:.3} \
                     s); breakpoints dropped, guest running",
                    args.parent,
                    took.as_secs_f64()
                );
            }
            Ok(0)
        }
        Ok(_) => Ok(0),
        Err(e) => Err(e.context(format!(
            "exotap guardian: exotap (pid {}) died with probes in the guest",
            args.parent
        ))),
    }
}

/// Lets this exotap start guardians of itself (`exotap guardian ...`).
pub fn enable_guardian() {
    if let Ok(exe) = std::env::current_exe() {
        recover::set_guardian_program(exe, vec!["guardian".into()]);
    }
}
