//! `exotap regress`: the splicing-safety differential regression (see regress/).

use exotap_regress::{Options, Report};

/// Which mini-kernels `exotap regress` sweeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Arch {
    /// Both; SPARC is skipped with a note when its cross compiler is missing.
    All,
    /// The x86-64 mini-kernel.
    #[value(name = "x86_64")]
    X86_64,
    /// The SPARC v9 mini-kernel (needs sparc64-linux-gnu-gcc).
    Sparc64,
}

/// How `exotap regress` prints its reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One block of lines per image.
    Text,
    /// One JSON document: an array with an object per image (points, refusals by reason,
    /// build errors and divergences with their addresses), for a CI system to show.
    Json,
    /// A JUnit XML report (what CI systems show as test results): a test suite per image,
    /// a passing case per probe kind with its points checked, a failing case per divergence
    /// and per build error, a skipped case per function left out.
    Junit,
}

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
    /// Also run the sweep over 55 library and time-conversion functions of the Debian
    /// kernel's vmlinux, and the entry patches of time, trace, nullify and replace at each
    /// of their entries the planner splices (needs the -dbg package in the cache: `exotap
    /// image fetch --debuginfo`).
    #[arg(long)]
    pub vmlinux: bool,
    /// Sweep the vmlinux functions named in FILE instead of the built-in list (implies
    /// --vmlinux). One symbol name per line; `#` starts a comment; blank lines are ignored.
    /// A built-in function keeps its prepared arguments; any other is called with each of
    /// its five argument registers pointing at its own zeroed 1 KiB buffer, and is reported
    /// skipped when that call does not return. A name that is not a function of the
    /// vmlinux's main text (unknown, data, no size, init code, an ambiguous static name)
    /// is an error naming it, before anything runs.
    #[arg(long, value_name = "FILE")]
    pub functions: Option<std::path::PathBuf>,
    /// Which mini-kernels to sweep.
    #[arg(long, value_enum, default_value = "all")]
    pub arch: Arch,
    /// JIT mode instead of the splice sweep: every function of the x86-64 mini-kernel
    /// (and, with --vmlinux, every built-in vmlinux call with its callees) runs translated
    /// into a code cache with block counters; the run must match the untranslated one and
    /// every count must equal Unicorn's own block hook. x86-64 only.
    #[arg(long, conflicts_with_all = ["full", "batch", "functions"])]
    pub jit: bool,
    /// With --vmlinux: the kernel whose -dbg vmlinux is swept (ABI name, as `exotap image
    /// fetch --kernel KERNEL --debuginfo` caches it).
    #[arg(long, env = "EXOTAP_KERNEL", default_value = exotap_guest_images::DEFAULT_KERNEL, value_name = "VERSION")]
    pub kernel: String,
    /// Output format of the splice sweep (`--jit` prints text).
    #[arg(long, value_enum, default_value = "text", conflicts_with = "jit")]
    pub format: Format,
}

/// `exotap regress --jit`: the JIT-mode reports; exit code 1 on any divergence.
fn run_jit(args: &RegressArgs) -> anyhow::Result<i32> {
    if args.arch == Arch::Sparc64 {
        anyhow::bail!("the JIT mode is x86-64 only (SPARC translation is not built yet)");
    }
    let mut reports = vec![exotap_regress::regress_jit_x86_minikernel()?];
    if args.vmlinux {
        let path = exotap_regress::vmlinux::cached_vmlinux(&args.kernel).ok_or_else(|| {
            anyhow::anyhow!(
                "no vmlinux with symbols of {} in the cache: run exotap image fetch --kernel {} --debuginfo",
                args.kernel,
                args.kernel
            )
        })?;
        reports.push(exotap_regress::vmlinux::regress_jit(&path)?);
    }
    let mut failed = false;
    for report in &reports {
        outln!("{report}\n");
        failed |= !report.divergences.is_empty();
    }
    Ok(i32::from(failed))
}

/// Builds the mini-kernels (x86-64, SPARC v9), runs the sweeps, prints the reports;
/// exit code 1 when anything diverged or could not be built.
///
/// # Errors
/// When the regression cannot run (no gcc, emulator failure, no cached vmlinux), or the
/// function list is unreadable or names a function the vmlinux sweep cannot call.
pub fn run(args: &RegressArgs) -> anyhow::Result<i32> {
    if args.jit {
        return run_jit(args);
    }
    let mut options = if args.full {
        Options::full()
    } else {
        Options::ci()
    };
    if let Some(batch) = args.batch {
        options.batch = usize::from(batch);
    }
    let mut vmlinux_report = None;
    // The vmlinux sweep runs first (its report prints last): a bad list or a missing
    // vmlinux should not wait for the mini-kernel sweeps.
    let functions = args
        .functions
        .as_deref()
        .map(exotap_regress::vmlinux::read_function_list)
        .transpose()?;
    if args.vmlinux || functions.is_some() {
        let path = exotap_regress::vmlinux::cached_vmlinux(&args.kernel).ok_or_else(|| {
            anyhow::anyhow!(
                "no vmlinux with symbols of {} in the cache: run exotap image fetch --kernel {} --debuginfo",
                args.kernel,
                args.kernel
            )
        })?;
        vmlinux_report = Some(match &functions {
            Some(names) => exotap_regress::vmlinux::regress_functions(&path, names, &options)?,
            None => exotap_regress::vmlinux::regress(&path, &options)?,
        });
    }
    let mut reports: Vec<Report> = Vec::new();
    if args.arch != Arch::Sparc64 {
        reports.push(exotap_regress::regress_x86_minikernel(&options)?);
    }
    if args.arch != Arch::X86_64 {
        let gcc = exotap_guest_images::minikernel::SPARC64_GCC;
        let have_gcc = std::process::Command::new(gcc)
            .arg("--version")
            .output()
            .is_ok();
        if have_gcc {
            reports.push(exotap_regress::sparc::regress_minikernel(&options)?);
        } else if args.arch == Arch::Sparc64 {
            anyhow::bail!(
                "{gcc} is not installed: apt-get install gcc-sparc64-linux-gnu (ci/install-deps.sh)"
            );
        } else {
            eprintln!("note: {gcc} is not installed: the SPARC v9 mini-kernel is skipped (apt-get install gcc-sparc64-linux-gnu)");
        }
    }
    reports.extend(vmlinux_report);
    let failed = reports
        .iter()
        .any(|r| !r.divergences.is_empty() || !r.build_errors.is_empty());
    match args.format {
        Format::Text => {
            for report in &reports {
                outln!("{report}\n");
            }
        }
        Format::Json => {
            let doc: Vec<serde_json::Value> = reports.iter().map(report_json).collect();
            outln!("{}", serde_json::to_string_pretty(&doc)?);
        }
        Format::Junit => outln!("{}", report_junit(&reports)?),
    }
    Ok(i32::from(failed))
}

/// One report as JSON (`--format json`): the numbers of the text form, every build error
/// and every divergence with its points.
fn report_json(r: &Report) -> serde_json::Value {
    let hex = |a: u64| format!("{a:#x}");
    serde_json::json!({
        "image": r.image,
        "functions": r.functions,
        "points": r.points,
        "accepted": { "splice": r.splice_points, "trap": r.trap_points },
        "executed_by_reference": r.executed_points,
        "refused": r.refused,
        "checked": { "splices": r.splices_checked, "traps": r.traps_checked },
        "entries_checked": r.entries_checked.iter()
            .map(|(kind, n)| (kind.to_string(), serde_json::json!(n)))
            .collect::<serde_json::Map<_, _>>(),
        "entries_refused": r.entries_refused,
        "springboards": r.springboards,
        "runs": r.runs,
        "reference": { "instructions": r.reference_instructions, "checksum": hex(r.checksum) },
        "skipped": r.skipped,
        "build_errors": r.build_errors.iter()
            .map(|(a, why)| serde_json::json!({ "address": hex(*a), "why": why }))
            .collect::<Vec<_>>(),
        "divergences": r.divergences.iter()
            .map(|d| serde_json::json!({
                "kind": d.kind.to_string(),
                "points": d.points.iter().map(|p| hex(*p)).collect::<Vec<_>>(),
                "function": d.function,
                "what": d.what,
            }))
            .collect::<Vec<_>>(),
        "seconds": r.elapsed.as_secs_f64(),
    })
}

/// The reports as one JUnit XML document (`--format junit`): per image a `testsuite`, with a
/// passing `testcase` per probe kind (splices, traps) naming the points it checked, a failing
/// one per divergence (its points, function and what differed) and per build error, and a
/// skipped one per function the sweep left out.
fn report_junit(reports: &[Report]) -> anyhow::Result<String> {
    use quick_xml::events::{BytesDecl, BytesEnd, BytesStart, Event};
    let mut w = quick_xml::Writer::new_with_indent(Vec::new(), b' ', 2);
    w.write_event(Event::Decl(BytesDecl::new("1.0", Some("UTF-8"), None)))?;
    let count = |r: &Report| {
        2 + r.entries_checked.len() + r.divergences.len() + r.build_errors.len() + r.skipped.len()
    };
    let failures = |r: &Report| r.divergences.len() + r.build_errors.len();
    let mut all = BytesStart::new("testsuites");
    all.push_attribute(("name", "exotap regress"));
    all.push_attribute((
        "tests",
        reports
            .iter()
            .map(count)
            .sum::<usize>()
            .to_string()
            .as_str(),
    ));
    all.push_attribute((
        "failures",
        reports
            .iter()
            .map(failures)
            .sum::<usize>()
            .to_string()
            .as_str(),
    ));
    w.write_event(Event::Start(all))?;
    for r in reports {
        let mut suite = BytesStart::new("testsuite");
        suite.push_attribute(("name", r.image.as_str()));
        suite.push_attribute(("tests", count(r).to_string().as_str()));
        suite.push_attribute(("failures", failures(r).to_string().as_str()));
        suite.push_attribute(("skipped", r.skipped.len().to_string().as_str()));
        suite.push_attribute(("time", format!("{:.3}", r.elapsed.as_secs_f64()).as_str()));
        w.write_event(Event::Start(suite))?;
        let case = |w: &mut quick_xml::Writer<Vec<u8>>,
                    class: &str,
                    name: &str,
                    inner: Option<(&str, &str)>|
         -> anyhow::Result<()> {
            let mut c = BytesStart::new("testcase");
            c.push_attribute(("classname", class));
            c.push_attribute(("name", name));
            match inner {
                None => w.write_event(Event::Empty(c))?,
                Some((tag, message)) => {
                    w.write_event(Event::Start(c))?;
                    let mut f = BytesStart::new(tag);
                    f.push_attribute(("message", message));
                    w.write_event(Event::Empty(f))?;
                    w.write_event(Event::End(BytesEnd::new("testcase")))?;
                }
            }
            Ok(())
        };
        let image = r.image.as_str();
        case(
            &mut w,
            image,
            &format!(
                "splices: {} points accepted, {} checked against the reference",
                r.splice_points, r.splices_checked
            ),
            None,
        )?;
        case(
            &mut w,
            image,
            &format!(
                "traps: {} points accepted, {} checked against the reference",
                r.trap_points, r.traps_checked
            ),
            None,
        )?;
        for (kind, n) in &r.entries_checked {
            case(
                &mut w,
                image,
                &format!(
                    "{kind}: {n} function entries checked against the reference and its own oracle"
                ),
                None,
            )?;
        }
        for d in &r.divergences {
            let points: Vec<String> = d.points.iter().map(|p| format!("{p:#x}")).collect();
            case(
                &mut w,
                &format!("{image}.divergence"),
                &format!("{} at {} in {}", d.kind, points.join(" "), d.function),
                Some(("failure", &d.what)),
            )?;
        }
        for (at, why) in &r.build_errors {
            case(
                &mut w,
                &format!("{image}.build"),
                &format!("probe code for {at:#x}"),
                Some(("failure", why)),
            )?;
        }
        for what in &r.skipped {
            case(
                &mut w,
                &format!("{image}.skipped"),
                what,
                Some(("skipped", what)),
            )?;
        }
        w.write_event(Event::End(BytesEnd::new("testsuite")))?;
    }
    w.write_event(Event::End(BytesEnd::new("testsuites")))?;
    Ok(String::from_utf8(w.into_inner())?)
}

#[cfg(test)]
mod tests {
    use super::{report_json, report_junit};
    use exotap_regress::{Divergence, ProbeKind, Report};

    #[test]
    fn the_json_report_names_every_divergence_and_build_error_with_its_addresses() {
        let mut r = Report {
            image: "mini".into(),
            points: 10,
            splice_points: 6,
            trap_points: 3,
            ..Report::default()
        };
        r.refused.insert("Unsupported (Ud2)".into(), 1);
        r.build_errors.push((0x1000, "no room".into()));
        r.divergences.push(Divergence {
            points: vec![0xffff_ffff_8100_0010, 0xffff_ffff_8100_0014],
            function: "f".into(),
            kind: ProbeKind::Trap,
            what: "rax 1 != 2".into(),
        });
        let j = report_json(&r);
        assert_eq!(j["accepted"]["splice"], 6);
        assert_eq!(j["accepted"]["trap"], 3);
        assert_eq!(j["refused"]["Unsupported (Ud2)"], 1);
        assert_eq!(j["build_errors"][0]["address"], "0x1000");
        assert_eq!(j["divergences"][0]["kind"], "trap");
        assert_eq!(j["divergences"][0]["points"][1], "0xffffffff81000014");
        assert_eq!(j["divergences"][0]["what"], "rax 1 != 2");
    }

    /// The JUnit report, read back with an XML parser: a suite per image, its counts, the
    /// failing case of each divergence and build error with its message (escaped), and the
    /// passing cases of the probe kinds.
    #[test]
    fn the_junit_report_has_a_failing_case_per_divergence_and_build_error() {
        let mut r = Report {
            image: "mini <x86>".into(),
            splice_points: 6,
            splices_checked: 6,
            trap_points: 3,
            traps_checked: 3,
            ..Report::default()
        };
        r.build_errors.push((0x1000, "no room".into()));
        r.divergences.push(Divergence {
            points: vec![0xffff_ffff_8100_0010],
            function: "f".into(),
            kind: ProbeKind::Splice,
            what: "rax 1 != 2 & \"more\"".into(),
        });
        r.skipped.push("g: its call does not return".into());
        let ok = Report {
            image: "sparc".into(),
            ..Report::default()
        };
        let xml = report_junit(&[r, ok]).unwrap();
        let mut reader = quick_xml::Reader::from_str(&xml);
        let mut suites = Vec::new();
        let mut failures = Vec::new();
        let mut cases = 0;
        loop {
            match reader.read_event().unwrap() {
                quick_xml::events::Event::Eof => break,
                quick_xml::events::Event::Start(e) | quick_xml::events::Event::Empty(e) => {
                    let attr = |k: &str| {
                        e.try_get_attribute(k).unwrap().map(|a| {
                            a.normalized_value(quick_xml::XmlVersion::Explicit1_0)
                                .unwrap()
                                .into_owned()
                        })
                    };
                    match e.name().as_ref() {
                        b"testsuite" => suites.push((
                            attr("name").unwrap(),
                            attr("tests").unwrap(),
                            attr("failures").unwrap(),
                            attr("skipped").unwrap(),
                        )),
                        b"testcase" => cases += 1,
                        b"failure" => failures.push(attr("message").unwrap()),
                        _ => {}
                    }
                }
                _ => {}
            }
        }
        let s = |a: &str, b: &str, c: &str, d: &str| {
            (a.to_owned(), b.to_owned(), c.to_owned(), d.to_owned())
        };
        assert_eq!(
            suites,
            [s("mini <x86>", "5", "2", "1"), s("sparc", "2", "0", "0")]
        );
        assert_eq!(cases, 7);
        assert_eq!(failures, ["rax 1 != 2 & \"more\"", "no room"]);
    }
}
