//! `exotap profile`: a sampling profiler of the guest kernel from outside it. At each tick
//! every vCPU is stopped, its registers read, its kernel stack unwound with the image's ORC
//! tables, and the guest resumed; stacks are counted as folded stacks (root first, the
//! current task's name at the root) and written as text, folded lines, an SVG flame graph
//! (`inferno`) or JSON. The guest's time stopped is its cost, reported beside the result.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;

use crate::attach::TargetArgs;
use crate::backtrace::{GuestArgs, Reach, StackHook};
use crate::kernel_image::KernelImage;
use exotap_probes::live::sampling::{LiveStacks, Profile, Sampler};

/// Output format of the summary on standard output.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ProfileFormat {
    /// The hottest stacks and the overhead, as text.
    #[default]
    Text,
    /// One JSON object: settings, overhead, and every folded stack with its count.
    Json,
}

/// `exotap profile`.
#[derive(Debug, Args)]
pub struct ProfileArgs {
    /// Samples per second (each one stops every vCPU).
    #[arg(long, default_value_t = 49, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub hz: u32,
    /// Seconds to sample: required with --target; booting, sampling ends at the job's
    /// `exotap_wait unprofile` or after this long, whichever comes first.
    #[arg(long, value_name = "S")]
    pub duration: Option<f64>,
    /// Write the folded stacks (`comm;root;...;leaf COUNT`, flamegraph.pl's input) to FILE.
    #[arg(long, value_name = "FILE")]
    pub folded: Option<PathBuf>,
    /// Write an SVG flame graph to FILE.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Format of the summary on standard output.
    #[arg(long, value_enum, default_value_t = ProfileFormat::Text)]
    pub format: ProfileFormat,
    /// Stacks shown in the text summary.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub top: usize,
    /// Booting with --run: run the command once unsampled first and report both wall
    /// times (the job becomes `exotap_wait baseline; CMD; exotap_wait profile; CMD;
    /// exotap_wait unprofile`).
    #[arg(long, requires = "run")]
    pub baseline: bool,
    #[command(flatten)]
    pub guest: GuestArgs,
}

/// Steps in at the job's `baseline`, `profile` and `unprofile` waits.
struct ProfileHook<'a> {
    image: &'a KernelImage,
    hz: u32,
    duration: Option<f64>,
    sampler: Option<Sampler>,
    profile: Option<Profile>,
    /// When the guest was let go at `baseline` and at `profile`, and reached `profile` and
    /// `unprofile`.
    baseline_from: Option<Instant>,
    baseline: Option<Duration>,
    sampled_from: Option<Instant>,
    sampled: Option<Duration>,
}

impl StackHook for ProfileHook<'_> {
    fn step(&mut self, phase: &str, reach: Reach<'_>) -> anyhow::Result<()> {
        match phase {
            "baseline" => self.baseline_from = Some(Instant::now()),
            "profile" => {
                self.baseline = self.baseline_from.map(|t| t.elapsed());
                let live = reach.attach(self.image)?;
                self.sampler = Some(Sampler::start(live, self.hz, self.duration)?);
                self.sampled_from = Some(Instant::now());
            }
            "unprofile" => {
                self.sampled = self.sampled_from.map(|t| t.elapsed());
                let sampler = self
                    .sampler
                    .take()
                    .context("the job reached `unprofile` before `profile`")?;
                self.profile = Some(sampler.finish()?);
            }
            _ => {}
        }
        Ok(())
    }
}

/// Wall times of the workload without and with sampling (booted with `--baseline`).
#[derive(Debug, Clone, Copy)]
struct Workload {
    baseline: Option<Duration>,
    sampled: Option<Duration>,
}

/// `exotap profile`.
///
/// # Errors
/// Bad arguments, attach, unwind-setup or guest failures, unwritable output files.
pub fn run_profile(args: &ProfileArgs) -> anyhow::Result<i32> {
    if args.guest.target.is_none() {
        // A refused backend says why before anything is loaded.
        crate::backend::resolve(args.guest.backend, None)?;
    }
    let image = args.guest.image.load()?;
    let (profile, workload, rc) = if let Some(target) = &args.guest.target {
        let Some(duration) = args.duration else {
            bail!("--target needs --duration (seconds to sample)");
        };
        let target = TargetArgs {
            target: target.clone(),
            gdb_timeout: 10,
        };
        let live = LiveStacks::attach(&target.to_target(), &image)?;
        eprintln!("exotap: sampling at {} Hz for {duration} s", args.hz);
        let sampler = Sampler::start(live, args.hz, Some(duration))?;
        std::thread::sleep(Duration::from_secs_f64(duration));
        let workload = Workload {
            baseline: None,
            sampled: None,
        };
        (sampler.finish()?, workload, 0)
    } else {
        let job = args.guest.job("mixed 20", |cmd| {
            if args.baseline {
                format!(
                    "exotap_wait baseline\n{cmd}\nexotap_wait profile\n{cmd}\nexotap_wait unprofile\n"
                )
            } else {
                format!("exotap_wait profile\n{cmd}\nexotap_wait unprofile\n")
            }
        })?;
        let plan = args.guest.plan(&image, &job)?;
        let mut hook = ProfileHook {
            image: &image,
            hz: args.hz,
            duration: args.duration,
            sampler: None,
            profile: None,
            baseline_from: None,
            baseline: None,
            sampled_from: None,
            sampled: None,
        };
        let outcome = plan.run(&mut hook);
        if let Some(sampler) = hook.sampler.take() {
            // The guest ended (or failed) without `exotap_wait unprofile`.
            let _ = sampler.finish();
        }
        let outcome = outcome?;
        let profile = hook
            .profile
            .take()
            .context("the guest's job never reached `exotap_wait profile` and `unprofile`")?;
        let workload = Workload {
            baseline: hook.baseline,
            sampled: hook.sampled,
        };
        (profile, workload, outcome.rc)
    };
    write_outputs(args, &profile)?;
    match args.format {
        ProfileFormat::Text => print_text(args, &profile, workload),
        ProfileFormat::Json => print_json(args, &profile, workload)?,
    }
    Ok(rc)
}

fn write_outputs(args: &ProfileArgs, profile: &Profile) -> anyhow::Result<()> {
    let lines = profile.folded_lines();
    if let Some(path) = &args.folded {
        let mut text = lines.join("\n");
        text.push('\n');
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        if lines.is_empty() {
            bail!("no samples were taken: no flame graph to draw");
        }
        let file = std::fs::File::create(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut options = inferno::flamegraph::Options::default();
        options.title = "exotap profile: guest kernel stacks".into();
        options.count_name = "samples".into();
        inferno::flamegraph::from_lines(
            &mut options,
            lines.iter().map(String::as_str),
            std::io::BufWriter::new(file),
        )
        .with_context(|| format!("cannot draw the flame graph into {}", path.display()))?;
    }
    Ok(())
}

fn overhead_line(profile: &Profile) -> String {
    let per_stop = |d: Duration| {
        if profile.stops == 0 {
            0.0
        } else {
            d.as_secs_f64() * 1e3 / profile.stops as f64
        }
    };
    format!(
        "overhead: {} stops in {:.2} s, guest stopped {:.1}% of the time ({:.2} ms a stop: \
         {:.2} ms to stop, the rest reading registers and stacks)",
        profile.stops,
        profile.wall.as_secs_f64(),
        profile.stop_fraction() * 100.0,
        per_stop(profile.stopped),
        per_stop(profile.stopping)
    )
}

fn print_text(args: &ProfileArgs, profile: &Profile, workload: Workload) {
    outln!(
        "{} samples ({} vCPU stops at {} Hz): {} in user mode, {} incomplete unwinds",
        profile.samples,
        profile.stops,
        args.hz,
        profile.user,
        profile.incomplete
    );
    for line in profile.folded_lines().iter().take(args.top) {
        outln!("{line}");
    }
    outln!("{}", overhead_line(profile));
    if let (Some(base), Some(sampled)) = (workload.baseline, workload.sampled) {
        outln!(
            "workload: {:.3} s unsampled, {:.3} s sampled ({:+.1}%)",
            base.as_secs_f64(),
            sampled.as_secs_f64(),
            (sampled.as_secs_f64() / base.as_secs_f64() - 1.0) * 100.0
        );
    }
    if let Some(why) = &profile.ended_by {
        outln!("sampling ended early: {why}");
    }
}

fn print_json(args: &ProfileArgs, profile: &Profile, workload: Workload) -> anyhow::Result<()> {
    let stacks: Vec<serde_json::Value> = {
        let mut all: Vec<(&String, &u64)> = profile.stacks.iter().collect();
        all.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        all.into_iter()
            .map(|(stack, count)| {
                serde_json::json!({
                    "frames": stack.split(';').collect::<Vec<_>>(),
                    "count": count,
                })
            })
            .collect()
    };
    let value = serde_json::json!({
        "hz": args.hz,
        "samples": profile.samples,
        "stops": profile.stops,
        "user_samples": profile.user,
        "incomplete_unwinds": profile.incomplete,
        "sampling_s": profile.wall.as_secs_f64(),
        "stopped_s": profile.stopped.as_secs_f64(),
        "stopping_s": profile.stopping.as_secs_f64(),
        "stop_fraction": profile.stop_fraction(),
        "workload_unsampled_s": workload.baseline.map(|d| d.as_secs_f64()),
        "workload_sampled_s": workload.sampled.map(|d| d.as_secs_f64()),
        "ended_by": profile.ended_by,
        "stacks": stacks,
    });
    outln!("{}", serde_json::to_string_pretty(&value)?);
    Ok(())
}
