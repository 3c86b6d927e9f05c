//! The live verbs: `exotap count`, `time`, `trace`, `nullify`, `replace`, `splice-report`.
//! Their arguments and their output; the engine under them is `exotap_probes::live`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use exotap_guest_images::{self as images, GuestJob};
use exotap_probes::live::attach::Target;
use exotap_probes::live::jit::{JitOptions, LiveJit};
use exotap_probes::live::operation::{requests, Operation};
use exotap_probes::live::splicer::KprobeReader;
use exotap_probes::live::splicer::{
    category, guest_ftrace_sites, guest_kprobe_hits, why_not, Action, Request, CODE_OFFSET,
};
use exotap_probes::live::stacks::TaskLayout;
use exotap_probes::live::GuestSession;
use exotap_vmm::control::StopEvent;
use exotap_vmm::host::Backend;
use exotap_vmm::kvm::{self, KvmConfig, KvmMachine, KvmPhaseHook};
use exotap_vmm::qemu::{self, Accel, PatchHeapRange, PhaseHook, QemuConfig, QemuError, Timeouts};

use crate::kernel_image::KernelImage;
use crate::phase_script::PhaseScript;

mod args;
mod blocks;
mod trace_view;

use args::parse_value;
pub use args::{
    BlockFormat, CountArgs, CoverageArgs, LiveArgs, NullifyArgs, ReplaceArgs, ReportArgs, TimeArgs,
    TraceArgs,
};

use trace_view::{histogram_lines, TraceView};

/// What `count --blocks` asked for.
#[derive(Debug, Clone)]
struct BlocksRun {
    depth: u32,
    lazy: bool,
    all: bool,
    format: BlockFormat,
    /// The guest's kprobe hits per (symbol, offset) at its `kprobes-in` wait.
    kprobes_in: Option<BTreeMap<(String, u64), (u64, u64)>>,
    /// ... and at its `kprobes-out` wait.
    kprobes_out: Option<BTreeMap<(String, u64), (u64, u64)>>,
    /// Where to write the line coverage (lcov).
    lcov: Option<PathBuf>,
    /// Whether a job exotap booted announces its waits (`exotap_wait`): the counts are then
    /// read where its reader sleeps ([`VerbRun::settle`]). Not with --target: no job of
    /// ours runs there, and nothing would be seen.
    job_waits: bool,
}

/// The state between install and removal.
struct Live {
    session: GuestSession,
    kprobes_before: Option<BTreeMap<String, (u64, u64)>>,
    /// The trace records shown so far (`exotap trace`), once the first arrived.
    trace_view: Option<TraceView>,
    /// When the rings were last drained.
    streamed: Instant,
    /// The guest's stops counted when the splices went in ([`GuestSession::stops`]).
    stops_at_install: u64,
    /// Records drained while the splices were in, and the time the drains took.
    drained: (u64, Duration),
    /// `count --blocks`: the translations in the guest.
    jit: Option<LiveJit>,
}

/// A verb's run against one guest: the verb's session, and what the verb prints.
struct VerbRun {
    image: KernelImage,
    op: Operation,
    heap: (u64, u64),
    compare_kprobes: bool,
    live: Option<Live>,
    out: Box<dyn Write + Send>,
    /// Whether a site asked for was refused (exit code 1).
    refused_any: bool,
    /// The first error writing the output ([`VerbRun::say`]).
    out_error: Option<std::io::Error>,
    /// `--perfetto`: where the trace's Perfetto file goes.
    perfetto: Option<PathBuf>,
    /// Whether trace records still stream (off after a failed drain: the rest are read at
    /// removal).
    streaming: bool,
    /// `count --blocks`.
    blocks: Option<BlocksRun>,
}

impl VerbRun {
    /// Prints a line of the verb's output. A write that fails (the reader of a pipe went
    /// away: `exotap trace F | head -5`) is kept: the run then removes what it put in and
    /// ends with that error (exit 141 for a closed pipe), printing nothing more.
    fn say(&mut self, line: &str) {
        if self.out_error.is_some() {
            return;
        }
        if let Err(e) = writeln!(self.out, "{line}").and_then(|()| self.out.flush()) {
            self.out_error = Some(e);
        }
    }

    /// Attaches (the guest stops), plans, installs, resumes. On an error the session's
    /// drop takes out whatever went in and detaches.
    fn install(&mut self, target: &Target) -> anyhow::Result<()> {
        let mut session = GuestSession::attach(target, &self.image)?;
        self.settle(&mut session)?;
        self.install_with(session)
    }

    /// Plans and installs on an attached session (the guest stopped), then resumes.
    fn install_with(&mut self, mut session: GuestSession) -> anyhow::Result<()> {
        let kprobes_before = self.install_on(&mut session)?;
        if matches!(self.op, Operation::Report { install: None, .. }) {
            // The report plans in one stop: nothing stays.
            return session.detach();
        }
        let mut live = Live {
            session,
            kprobes_before,
            trace_view: None,
            streamed: Instant::now(),
            stops_at_install: 0,
            drained: (0, Duration::ZERO),
            jit: None,
        };
        if self.blocks.is_some() {
            let functions: Vec<(String, u64)> =
                requests(&self.op, &self.image, live.session.survey.kaslr.slide)?
                    .into_iter()
                    .map(|r| (r.name, r.addr))
                    .collect();
            let options = JitOptions {
                depth: self.blocks.as_ref().map_or(1, |b| b.depth),
                lazy: self.blocks.as_ref().is_some_and(|b| b.lazy),
                ..JitOptions::default()
            };
            let jit = LiveJit::install(&mut live.session, &self.image, &functions, &options)?;
            for r in jit.entries_refused() {
                tracing::info!(
                    "no entry splice at {} ({:#x}): {}",
                    r.name,
                    r.addr,
                    r.reason
                );
            }
            live.jit = Some(jit);
        }
        if live.session.splicer().is_some_and(|s| s.rings.is_some()) {
            // While the guest is still stopped: streaming then needs no stop of its own.
            self.trace_view(&mut live)?;
        }
        live.session.resume()?;
        live.stops_at_install = live.session.stops();
        self.live = Some(live);
        Ok(())
    }

    fn install_on(
        &mut self,
        session: &mut GuestSession,
    ) -> anyhow::Result<Option<BTreeMap<String, (u64, u64)>>> {
        let slide = session.survey.kaslr.slide;
        let requests = requests(&self.op, &self.image, slide)?;
        let splicer = session.plan(&self.image, self.heap)?;
        if matches!(self.op, Operation::Trace(_)) {
            // The task of each record: its pid and name.
            splicer.trace_task = exotap_probes::live::attach::task_offsets(&self.image)
                .map_err(|e| tracing::warn!("trace records will not name their tasks: {e:#}"))
                .ok();
        }
        if let Operation::Report { list, install } = self.op.clone() {
            self.report(session, list, install)?;
            return Ok(None);
        }
        if self.blocks.is_some() {
            // The JIT installs its own entry splices (install_with).
            return Ok(None);
        }
        let report = session.install(&requests)?;
        let installed = session.splicer().map_or(&[][..], |s| &s.installed[..]);
        for s in installed {
            tracing::debug!("{} at {:#x}: patch at {:#x}", s.name, s.addr, s.patch);
        }
        let count = installed.len();
        for r in &report.refused {
            self.refused_any = true;
            self.say(&format!(
                "refused {} at {:#x}: {}",
                r.name, r.addr, r.reason
            ));
        }
        if count == 0 {
            bail!(
                "none of the {} sites asked for could be spliced",
                requests.len()
            );
        }
        tracing::info!(
            "{count} splices installed in {:.1} ms (planning {:.1} ms)",
            report.write_time.as_secs_f64() * 1e3,
            report.plan_time.as_secs_f64() * 1e3
        );
        if self.compare_kprobes {
            let btf = self.image.btf()?;
            let hits = guest_kprobe_hits(&mut session.machine, &session.survey, &self.image, btf)?;
            return Ok(Some(hits));
        }
        Ok(None)
    }

    fn report(
        &mut self,
        session: &mut GuestSession,
        list: bool,
        install: Option<usize>,
    ) -> anyhow::Result<()> {
        let btf = self.image.btf()?;
        let sites = guest_ftrace_sites(&mut session.machine, &session.survey, &self.image, btf)?;
        let slide = session.survey.kaslr.slide;
        session.plan(&self.image, self.heap)?;
        // The report plans at every function: the whole text, read now.
        let (machine, splicer) = session.parts()?;
        splicer.kernel.load_all(machine)?;
        let splicer = &*splicer;
        let patch = splicer.heap_va + CODE_OFFSET;
        let mut tally: BTreeMap<String, usize> = BTreeMap::new();
        let mut lines = Vec::new();
        let mut spliceable = Vec::new();
        for &ip in &sites {
            let d = splicer.kernel.plan(ip, patch);
            *tally.entry(category(&d)).or_default() += 1;
            let name = self
                .image
                .symbols
                .lookup_addr(ip.wrapping_sub(slide))
                .map_or_else(
                    || format!("{ip:#x}"),
                    |(s, o)| {
                        if o == 0 {
                            s.name.clone()
                        } else {
                            format!("{}+{o:#x}", s.name)
                        }
                    },
                );
            match why_not(&d) {
                Some(why) => lines.push(format!("  {name}: {why}")),
                None => spliceable.push((name, ip)),
            }
        }
        self.say(&format!(
            "live text: {} KiB read in {:.2} s, {} functions analysed in {:.2} s",
            (splicer.kernel.facts.text.1 - splicer.kernel.facts.text.0) >> 10,
            splicer.kernel.read_time.as_secs_f64(),
            splicer.kernel.facts.starts.len(),
            splicer.kernel.analysis_time.as_secs_f64()
        ));
        self.say(&format!(
            "ftrace sites (available_filter_functions): {}",
            sites.len()
        ));
        for (k, n) in &tally {
            self.say(&format!("  {n:>8}  {k}"));
        }
        if list {
            for l in lines {
                self.say(&l);
            }
        }
        let mut entries: BTreeMap<String, usize> = BTreeMap::new();
        for &start in &splicer.kernel.facts.starts {
            *entries
                .entry(category(
                    &splicer.kernel.plan(splicer.kernel.entry(start)?, patch),
                ))
                .or_default() += 1;
        }
        self.say(&format!(
            "all function entries (kallsyms text symbols): {}",
            splicer.kernel.facts.starts.len()
        ));
        for (k, n) in &entries {
            self.say(&format!("  {n:>8}  {k}"));
        }
        if let Some(n) = install {
            let requests: Vec<Request> = spliceable
                .into_iter()
                .take(n)
                .map(|(name, addr)| Request {
                    name,
                    addr,
                    action: Action::Count,
                })
                .collect();
            let packets = session.machine.request_count();
            let started = Instant::now();
            let rep = session.install(&requests)?;
            let all = started.elapsed();
            let packets = session
                .machine
                .request_count()
                .zip(packets)
                .map_or_else(|| "not counted".to_owned(), |(a, b)| (a - b).to_string());
            let installed = session.splicer().map_or(0, |s| s.installed.len());
            self.say(&format!(
                "install: {installed} of {} splices in one batch in {:.3} s ({:.0} points/s; plan+generate {:.3} s, check+write {:.3} s); refused {}",
                requests.len(),
                all.as_secs_f64(),
                installed as f64 / all.as_secs_f64().max(1e-9),
                rep.plan_time.as_secs_f64(),
                rep.write_time.as_secs_f64(),
                rep.refused.len()
            ));
            self.say(&format!(
                "install split: plan+generate {:.3} s, text pages read {:.3} s, heap writes {:.3} s, text writes {:.3} s ({} spans, {} bytes); gdbstub packets {packets}",
                rep.plan_time.as_secs_f64(),
                rep.snapshot_time.as_secs_f64(),
                rep.heap_time.as_secs_f64(),
                rep.text_time.as_secs_f64(),
                rep.text_spans,
                rep.text_bytes,
            ));
            for r in &rep.refused {
                self.say(&format!(
                    "refused {} at {:#x}: {}",
                    r.name, r.addr, r.reason
                ));
            }
        }
        Ok(())
    }

    /// Prints the trace records that arrived since the last drain, at most every
    /// [`STREAM_EVERY`] with the guest stopped for the read, or every [`STREAM_SHARED_EVERY`]
    /// with no stop when the guest's RAM is shared. Nothing to do without trace rings.
    ///
    /// A failed drain turns streaming off with a warning rather than ending the run: the
    /// splices must still come out, and removal reads what is left in the rings.
    fn stream(&mut self) {
        if !self.streaming {
            return;
        }
        let Some(mut live) = self.live.take() else {
            return;
        };
        if let Err(e) = self.stream_on(&mut live) {
            self.streaming = false;
            eprintln!(
                "exotap: warning: trace streaming stopped: {e:#}; the records left are read at removal"
            );
        }
        self.live = Some(live);
    }

    fn stream_on(&mut self, live: &mut Live) -> anyhow::Result<()> {
        let rings = live.session.splicer().is_some_and(|s| s.rings.is_some());
        let shared = live.session.is_shared();
        // exotap's own VMM reads guest memory while the guest runs: no stop, the fast cadence.
        let every = if shared || live.session.machine.reads_while_running() {
            STREAM_SHARED_EVERY
        } else {
            STREAM_EVERY
        };
        if !rings || live.streamed.elapsed() < every {
            return Ok(());
        }
        let started = Instant::now();
        let drained = if shared {
            live.session.drain(false)
        } else {
            // A backend that maps guest memory (exotap's own VMM) is read while the guest
            // runs; over a gdbstub without shared RAM the guest stops for the read.
            let paused = live.session.pause_for_read()?;
            let drained = live.session.drain(false);
            live.session.resume_after_read(paused)?;
            drained
        };
        live.streamed = Instant::now();
        let records = drained?;
        live.drained.0 += records.len() as u64;
        live.drained.1 += started.elapsed();
        if let Some(view) = live.trace_view.as_mut() {
            // One flush per drain, not per line: at a million records a second a write(2)
            // per line would slow the drains until the rings overflow.
            let mut text = String::new();
            for line in view.lines(&records) {
                text.push_str(&line);
                text.push('\n');
            }
            if self.out_error.is_none() {
                if let Err(e) = self
                    .out
                    .write_all(text.as_bytes())
                    .and_then(|()| self.out.flush())
                {
                    self.out_error = Some(e);
                }
            }
        }
        Ok(())
    }

    /// Makes the trace view (reading the guest's TSC rate) if there is none yet; the guest
    /// stopped.
    fn trace_view(&self, live: &mut Live) -> anyhow::Result<()> {
        if live.trace_view.is_none() {
            let khz = live.session.tsc_khz(&self.image)?;
            let names = live
                .session
                .splicer()
                .map(|s| &s.trace_names[..])
                .unwrap_or_default()
                .iter()
                .map(|(id, n)| (u64::from(*id), n.clone()))
                .collect();
            let mut view = TraceView::new(names, khz);
            view.perfetto = self
                .perfetto
                .as_deref()
                .map(crate::perfetto::SliceTrace::new);
            live.trace_view = Some(view);
        }
        Ok(())
    }

    /// Stops the guest, reads counts, removes every splice, detaches.
    fn remove(&mut self) -> anyhow::Result<()> {
        if self.live.is_none() {
            return Ok(());
        }
        let Some(mut live) = self.live.take() else {
            return Ok(());
        };
        let stops_while_in = live.session.stops().saturating_sub(live.stops_at_install);
        if let Err(e) = self.settle(&mut live.session) {
            // The removal goes on (its own errors are the ones to report).
            eprintln!("exotap: warning: {e:#}");
        }
        live.session.pause()?;
        // Where the data path needs no stops (exotap's own VMM, in process or through its
        // control socket), the count of stops is the proof: say it.
        let backend = live.session.machine.backend();
        let via = match backend {
            "kvm" => Some("kvm backend"),
            b if b == exotap_vmm::control_socket::CLIENT_BACKEND => {
                Some("exotap's VMM, through its control socket")
            }
            _ => None,
        };
        if let Some(via) = via {
            self.say(&format!(
                "vCPU pauses between install and removal: {stops_while_in} ({via})"
            ));
        }
        if live.session.splicer().is_some_and(|s| s.rings.is_some()) {
            // With shared RAM a thread of its own drained the rings: its own count and time
            // (the main thread only decoded and printed what it handed over).
            let (n, took, passes) = match live.session.stop_drainer() {
                Some(d) => (
                    d.records,
                    d.reading,
                    format!(
                        " by the drainer thread in {} passes, {:.1} ms of its CPU time ({:.0} records/s); in the {} passes that took records, {:.1} ms ({:.0} records/s), {:.1} ms of CPU time ({:.0} records/s); buffers: {} made ready while the rings were empty, {} new while taking records",
                        d.passes,
                        d.reading_cpu.as_secs_f64() * 1e3,
                        d.records as f64 / d.reading_cpu.as_secs_f64().max(1e-9),
                        d.busy_passes,
                        d.busy_reading.as_secs_f64() * 1e3,
                        d.records as f64 / d.busy_reading.as_secs_f64().max(1e-9),
                        d.busy_reading_cpu.as_secs_f64() * 1e3,
                        d.records as f64 / d.busy_reading_cpu.as_secs_f64().max(1e-9),
                        d.prepared_buffers,
                        d.new_buffers
                    ),
                ),
                None => (live.drained.0, live.drained.1, String::new()),
            };
            self.say(&format!(
                "data path: {}; the guest was stopped {stops_while_in} times while the splices were in; {n} records drained while it ran, in {:.1} ms of reading ({:.0} records/s){passes}",
                if live.session.is_shared() {
                    "shared memory"
                } else if live.session.machine.reads_while_running() {
                    "the VMM's own mapping of guest memory"
                } else {
                    "stop-and-read"
                },
                took.as_secs_f64() * 1e3,
                n as f64 / took.as_secs_f64().max(1e-9)
            ));
        }
        let result = self.remove_on(&mut live);
        // Removes whatever the failed removal left, then detaches.
        let detached = live.session.detach();
        result?;
        detached
    }

    fn remove_on(&mut self, live: &mut Live) -> anyhow::Result<()> {
        if let Some(jit) = live.jit.take() {
            return self.remove_blocks(live, jit);
        }
        let kprobes_after = match (&live.kprobes_before, self.image.btf().ok()) {
            (Some(_), Some(btf)) => Some(guest_kprobe_hits(
                &mut live.session.machine,
                &live.session.survey,
                &self.image,
                btf,
            )?),
            _ => None,
        };
        let started = Instant::now();
        let installed = live.session.splicer().map_or(0, |s| s.installed.len());
        let report = live.session.remove()?;
        let removal = started.elapsed();
        let slide = live.session.survey.kaslr.slide;
        if matches!(self.op, Operation::Report { .. }) {
            let hit = report.counts.iter().filter(|c| c.2 > 0).count();
            let total: u64 = report.counts.iter().map(|c| c.2).sum();
            self.say(&format!(
                "hits while in: {total} calls of {hit} of the {installed} functions"
            ));
            self.say(&format!(
                "removal: {installed} splices in {:.3} s ({:.0} points/s); text pages {} identical: {}",
                removal.as_secs_f64(),
                installed as f64 / removal.as_secs_f64().max(1e-9),
                report.pages,
                if report.differing.is_empty() && report.before == report.after { "yes" } else { "NO" }
            ));
            if !report.differing.is_empty() {
                bail!("{} text pages differ after removal", report.differing.len());
            }
            return Ok(());
        }
        if !report.counts.is_empty() {
            let header = if kprobes_after.is_some() {
                format!(
                    "{:>12}  {:>12}  {:>8}  FUNCTION",
                    "COUNT", "KPROBE", "MISSED"
                )
            } else {
                format!("{:>12}  FUNCTION", "COUNT")
            };
            self.say(&header);
        }
        for (name, addr, n) in &report.counts {
            match (&live.kprobes_before, &kprobes_after) {
                (Some(before), Some(after)) => {
                    // The guest's kprobe may name the function by an alias at the same
                    // address (__do_sys_getpid for __x64_sys_getpid). The splice address
                    // is not the symbol's where an endbr64 comes first (IBT kernels): the
                    // aliases are those of the function's own symbol.
                    let entry = self
                        .image
                        .symbols
                        .lookup_addr(addr.wrapping_sub(slide))
                        .map_or(*addr, |(s, _)| s.addr.wrapping_add(slide));
                    let aliases: Vec<String> = std::iter::once(name.clone())
                        .chain(
                            self.image
                                .symbols
                                .iter()
                                .filter(|s| s.addr.wrapping_add(slide) == entry && s.is_text())
                                .map(|s| s.name.clone()),
                        )
                        .collect();
                    let k = aliases.iter().find_map(|a| {
                        let a1 = after.get(a)?;
                        let b = before.get(a).copied().unwrap_or_default();
                        Some((counter_delta(b.0, a1.0), counter_delta(b.1, a1.1)))
                    });
                    match k {
                        Some((hits, missed)) => {
                            self.say(&format!("{n:>12}  {hits:>12}  {missed:>8}  {name}"));
                        }
                        None => self.say(&format!("{n:>12}  {:>12}  {:>8}  {name}", "-", "-")),
                    }
                }
                _ => self.say(&format!("{n:>12}  {name}")),
            }
        }
        let khz = if report.histograms.is_empty() {
            0
        } else {
            live.session.tsc_khz(&self.image)?
        };
        if !report.overruns.is_empty() {
            self.trace_view(live)?;
            if let Some(view) = live.trace_view.as_mut() {
                let lines = view.lines(&report.records);
                let shown = view.shown;
                for line in lines {
                    self.say(&line);
                }
                self.say(&format!(
                    "trace: {shown} records; lost to ring overruns per vCPU: {:?}",
                    report.overruns
                ));
                if let Some(trace) = view.perfetto.take() {
                    trace.finish()?;
                }
            }
        }
        if !report.histograms.is_empty() {
            self.say(&format!(
                "inclusive time per call (TSC {khz} kHz; {} calls not timed: in-flight table full; {} calls in flight at removal were given their return addresses back)",
                report.timing_misses, report.returns_restored
            ));
            for (name, buckets) in &report.histograms {
                let total: u64 = buckets.iter().sum();
                self.say(&format!("{name}: {total} calls timed"));
                for line in histogram_lines(buckets, khz) {
                    self.say(&line);
                }
            }
        }
        for c in &report.changed {
            self.say(&format!("left {} at {:#x}: {}", c.name, c.addr, c.reason));
        }
        self.say(&format!(
            "text: {} page{} touched; sha256 before {} after {}: {}",
            report.pages,
            if report.pages == 1 { "" } else { "s" },
            &report.before[..16],
            &report.after[..16],
            if report.differing.is_empty() && report.before == report.after {
                "identical"
            } else {
                "DIFFERENT"
            }
        ));
        for (slot, why) in &report.returns_unrestored {
            self.say(&format!(
                "return address slot {slot:#x} of a timed call in flight cannot be read: {why}; \
                 not put back"
            ));
        }
        if !report.differing.is_empty() {
            bail!("{} text pages differ after removal", report.differing.len());
        }
        if !report.returns_unrestored.is_empty() {
            bail!(
                "{} return addresses of timed calls in flight could not be checked at removal",
                report.returns_unrestored.len()
            );
        }
        Ok(())
    }
}

/// Whether standard output is a pipe whose reading end was closed (`poll` reports `POLLERR`
/// on the writing end then): the reader went away before anything was written.
fn stdout_reader_gone() -> bool {
    let mut fd = libc::pollfd {
        fd: libc::STDOUT_FILENO,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no timeout.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n == 1 && fd.revents & libc::POLLERR != 0
}

/// How much a guest counter grew from `before` to `after`: its difference, or `reset`
/// where it went down (the guest's kprobe was re-registered, or its counter is not to be
/// trusted). Never an underflow.
fn counter_delta(before: u64, after: u64) -> String {
    after
        .checked_sub(before)
        .map_or_else(|| "reset".to_owned(), |d| d.to_string())
}

/// How often the trace rings are drained while the guest runs (each drain stops it).
pub const STREAM_EVERY: Duration = Duration::from_millis(250);
/// How often they are drained through shared RAM (no stop).
pub const STREAM_SHARED_EVERY: Duration = Duration::from_millis(10);

/// Hooks a verb's run to the guest's `splice` and `unsplice` waits.
struct SpliceHook {
    verb: VerbRun,
    target: Target,
    heap: (u64, u64),
    /// `count --trap-script`.
    phase: Option<PhaseScript>,
}

impl PhaseHook for SpliceHook {
    fn tick(&mut self) -> Result<(), QemuError> {
        self.verb.stream();
        self.verb.watch_jit();
        Ok(())
    }

    fn at_wait(&mut self, phase: &str) -> Result<(), QemuError> {
        let result = match phase {
            "splice" => self.verb.install(&self.target),
            "unsplice" => self.verb.remove(),
            "kprobes-in" => self.verb.read_kprobe_sites(&self.target, true),
            "kprobes-out" => self.verb.read_kprobe_sites(&self.target, false),
            "jit-mark" => self.verb.mark_jit(),
            crate::phase_script::START | crate::phase_script::END => match &mut self.phase {
                Some(p) => p.at_wait(phase, &self.target, &self.verb.image, self.heap),
                None => Ok(()),
            },
            _ => Ok(()),
        };
        result.map_err(|e| QemuError::Hook {
            phase: phase.to_owned(),
            message: format!("{e:#}"),
        })
    }
}

/// Hooks a verb's run to the guest's `splice` and `unsplice` waits on exotap's own VMM: the
/// session is a handle on the VM ([`KvmMachine::control`]), and the trace rings stream from
/// guest memory while the guest runs.
struct KvmSpliceHook {
    verb: VerbRun,
}

impl KvmPhaseHook for KvmSpliceHook {
    fn at_wait(&mut self, phase: &str, machine: &mut KvmMachine) -> Result<(), String> {
        let result = match phase {
            "splice" => GuestSession::over(Box::new(machine.control()), &self.verb.image)
                .and_then(|session| self.verb.install_with(session)),
            "unsplice" => self.verb.remove(),
            _ => Ok(()),
        };
        result.map_err(|e| format!("{e:#}"))
    }

    fn tick(&mut self, _machine: &mut KvmMachine) -> Result<(), String> {
        self.verb.stream();
        Ok(())
    }
}

/// Anonymous memory for a booted guest's RAM, shared with exotap; `None` (with a warning:
/// the guest is then stopped for reads) where it cannot be made.
pub(crate) fn guest_ram() -> Option<exotap_vmm::shared_ram::RamMemfd> {
    exotap_vmm::shared_ram::RamMemfd::create()
        .map_err(|e| {
            tracing::warn!("no shared guest RAM ({e}): the guest is stopped for each read");
        })
        .ok()
}

fn run(op: Operation, live: &LiveArgs, perfetto: Option<PathBuf>) -> anyhow::Result<i32> {
    run_with(op, live, perfetto, None, None)
}

fn run_with(
    op: Operation,
    live: &LiveArgs,
    perfetto: Option<PathBuf>,
    blocks: Option<BlocksRun>,
    phase: Option<PhaseScript>,
) -> anyhow::Result<i32> {
    // Before anything is loaded: a refused backend says why at once.
    // A running exotap VMM (--target vmm:PATH) is whatever backend it is; nothing to choose.
    let vmm_target = live
        .target
        .as_ref()
        .is_some_and(|t| t.starts_with(exotap_probes::live::attach::VMM_PREFIX));
    let backend = if vmm_target {
        Backend::Qemu
    } else {
        let needs_qemu = match (&live.target, &phase) {
            (Some(_), _) => Some("--target (attaching to a running guest's gdbstub)"),
            (None, Some(_)) => Some("--trap-script (host-evaluated trap probes)"),
            (None, None) => None,
        };
        crate::backend::resolve(live.backend, needs_qemu)?
    };
    if phase.is_some() && live.target.is_some() {
        bail!(
            "--trap-script runs in a guest exotap boots (from its job's `exotap_wait {}` to its `exotap_wait {}`): not with --target",
            crate::phase_script::START,
            crate::phase_script::END
        );
    }
    let image = live.image.load()?;
    // Unknown names fail here, before any guest is touched.
    requests(&op, &image, 0)?;
    // Parsed here (kept by the image), before any guest is touched: the run needs it at once.
    let _ = image.btf();
    let make_run = |image, heap| VerbRun {
        image,
        op,
        heap,
        compare_kprobes: live.compare_kprobes,
        perfetto,
        live: None,
        out: Box::new(std::io::stdout()),
        refused_any: false,
        out_error: None,
        streaming: true,
        blocks,
    };
    if let Some(target) = &live.target {
        let heap = crate::script::parse_heap(&live.heap)?;
        let mut verb = make_run(image, heap);
        let mut target = Target::new(target.clone());
        target.shm.clone_from(&live.shm);
        if target.shm.is_none() && !vmm_target && matches!(verb.op, Operation::Trace(_)) {
            eprintln!(
                "exotap: the guest is stopped for each read of the trace rings; for the zero-stop path, {}",
                exotap_probes::live::shared::FAST_PATH_HINT
            );
        }
        verb.install(&target)?;
        if matches!(verb.op, Operation::Report { install: None, .. }) {
            return Ok(0);
        }
        let stop = exotap_probes::lang::driver::stop_on_ctrl_c()
            .unwrap_or_else(|_| Arc::new(AtomicBool::new(false)));
        let deadline = live
            .duration
            .map(|s| Instant::now() + Duration::from_secs_f64(s));
        match live.duration {
            Some(s) => eprintln!("exotap: splices in; removed after {s} s, or at Ctrl-C"),
            None => eprintln!("exotap: splices in; Ctrl-C removes them"),
        }
        loop {
            if verb.out_error.is_none() && stdout_reader_gone() {
                // `exotap count F --target A | head`: count prints at the end, so the reader
                // going away is seen on the pipe itself, not on a write.
                verb.out_error = Some(std::io::ErrorKind::BrokenPipe.into());
            }
            if stop.load(Ordering::SeqCst)
                || deadline.is_some_and(|d| Instant::now() >= d)
                || verb.out_error.is_some()
            {
                break;
            }
            verb.stream();
            verb.watch_jit();
            let Some(l) = verb.live.as_mut() else { break };
            let wait = if l.session.is_shared() { 10 } else { 100 };
            match l.session.wait(Duration::from_millis(wait))? {
                None => {}
                Some(StopEvent::Exited) => {
                    if let Some(live) = verb.live.take() {
                        live.session.abandon();
                    }
                    bail!("the guest ended with the splices in");
                }
                Some(event) => match l.jit.as_mut() {
                    // A lazy-translation stop (the JIT's stub breakpoints).
                    Some(jit) => {
                        jit.on_stop(&mut l.session, &verb.image, &event)?;
                    }
                    None => l.session.resume()?,
                },
            }
        }
        verb.remove()?;
        if let Some(e) = verb.out_error.take() {
            return Err(anyhow::Error::new(e).context("cannot write standard output"));
        }
        return Ok(i32::from(verb.refused_any));
    }
    // Boot a guest for the run.
    let job = match (&live.job, &live.run) {
        (Some(path), _) => GuestJob::from_script(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the job {}", path.display()))?,
        ),
        (None, cmd) => GuestJob::from_script(format!(
            "exotap_wait splice\n{}\nexotap_wait unsplice\n",
            cmd.as_deref().unwrap_or("syscall-loop 1000")
        )),
    };
    let work = tempfile::Builder::new()
        .prefix("exotap-splice-")
        .tempdir()
        .context("cannot create a working directory")?;
    let initrd = match &live.initrd {
        Some(path) => path.clone(),
        None => {
            let initrd = work.path().join("initramfs.cpio.gz");
            images::write_initramfs(&job, &initrd).context("cannot build the initramfs")?;
            initrd
        }
    };
    let mut sink: Box<dyn Write> = match &live.console {
        Some(path) => Box::new(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create {}", path.display()))?,
        ),
        None => Box::new(std::io::stderr()),
    };
    let timeouts = Timeouts {
        boot: Duration::from_secs(live.machine.boot_timeout),
        total: Duration::from_secs(live.machine.timeout),
    };
    if backend == Backend::Kvm {
        let mut config = KvmConfig::new(image.path.clone(), initrd)?;
        config.cpus = live.machine.cpus;
        let heap = (config.patch_heap.base, config.patch_heap.size);
        let mut hook = KvmSpliceHook {
            verb: make_run(image, heap),
        };
        let outcome = kvm::run(&config, timeouts, &mut sink, &mut hook);
        drop(sink);
        if let Some(live) = hook.verb.live.take() {
            tracing::warn!(
                "the guest ended before its `exotap_wait unsplice`: splices not removed"
            );
            live.session.abandon();
        }
        return finish(outcome?, hook.verb.refused_any);
    }
    let mut config = QemuConfig::new(image.path.clone(), initrd)?;
    config.accel = if exotap_vmm::host::detect().usable() {
        Accel::Kvm
    } else {
        Accel::Tcg
    };
    config.cpus = live.machine.cpus;
    config.tcg_threads = live.machine.tcg_threads.into();
    config.patch_heap = PatchHeapRange::place(config.memory_mib << 20, 64 << 20)?;
    let socket = work.path().join("gdb.sock");
    config.gdbstub = Some(format!("unix:{},server=on,wait=off", socket.display()));
    let heap = (config.patch_heap.base, config.patch_heap.size);
    let mut target = Target::new(format!("unix:{}", socket.display()));
    let ram = (!live.stop_and_read).then(guest_ram).flatten();
    if let Some(ram) = &ram {
        config.shared_ram = Some(ram.path());
        target.shm = Some(ram.path());
    }
    let mut hook = SpliceHook {
        verb: make_run(image, heap),
        target,
        heap,
        phase,
    };
    let outcome = qemu::run(&config, work.path(), timeouts, &mut sink, &mut hook);
    drop(sink);
    if let Some(live) = hook.verb.live.take() {
        tracing::warn!("the guest ended before its `exotap_wait unsplice`: splices not removed");
        // Its QEMU is gone: nothing to remove them from.
        live.session.abandon();
    }
    if let Some(phase) = &mut hook.phase {
        if phase.never_started() {
            tracing::warn!(
                "the job never reached `exotap_wait {}`: the --trap-script did not run",
                crate::phase_script::START
            );
        } else if let Err(e) = phase.stop() {
            tracing::warn!("{e:#}");
        }
    }
    finish(outcome?, hook.verb.refused_any)
}

/// Prints the guest's results and its rc; the exit code: the guest's, else 1 when a site was
/// refused.
fn finish(outcome: qemu::RunOutcome, refused_any: bool) -> anyhow::Result<i32> {
    for (key, value) in &outcome.results {
        outln!("EXOTAP-RESULT {key}={value}");
    }
    outln!("EXOTAP-DONE {}", outcome.rc);
    if outcome.rc != 0 {
        return Ok(outcome.rc);
    }
    Ok(i32::from(refused_any))
}

/// `exotap count`.
///
/// # Errors
/// Unknown functions, attach or guest failures.
pub fn run_count(args: &CountArgs) -> anyhow::Result<i32> {
    let blocks = args.blocks.then(|| BlocksRun {
        depth: args.depth,
        lazy: args.lazy,
        all: args.all_blocks,
        format: args.format,
        kprobes_in: None,
        kprobes_out: None,
        lcov: args.lcov.clone(),
        job_waits: args.live.target.is_none(),
    });
    if args.lcov.is_some()
        && crate::debuginfo::LineLookup::beside(&args.live.image.bzimage_path()?).is_none()
    {
        bail!(
            "--lcov needs the kernel's -dbg vmlinux in the cache: exotap image fetch --debuginfo"
        );
    }
    let phase = args
        .trap_script
        .as_deref()
        .map(PhaseScript::load)
        .transpose()?;
    run_with(
        Operation::Count(args.patterns.clone()),
        &args.live,
        None,
        blocks,
        phase,
    )
}

/// `exotap coverage`.
///
/// # Errors
/// No cached debug info, no function in the file, as [`run_count`].
pub fn run_coverage(args: &CoverageArgs) -> anyhow::Result<i32> {
    let lines = crate::debuginfo::LineLookup::beside(&args.live.image.bzimage_path()?).context(
        "coverage needs the kernel's -dbg vmlinux in the cache: exotap image fetch --debuginfo",
    )?;
    let mut patterns = args.patterns.clone();
    if let Some(file) = &args.file {
        let image = args.live.image.load()?;
        for (name, low) in lines.functions_in(file)? {
            // The kallsyms name at that address (a static function's DWARF name may stand
            // for several, or carry no `.isra` suffix).
            let sym = image
                .symbols
                .lookup_addr(low)
                .filter(|(_, off)| *off == 0)
                .map_or(name, |(s, _)| s.name.clone());
            if !patterns.contains(&sym) {
                patterns.push(sym);
            }
        }
    }
    let blocks = BlocksRun {
        depth: args.depth,
        lazy: args.lazy,
        all: false,
        format: args.format,
        kprobes_in: None,
        kprobes_out: None,
        lcov: Some(args.output.clone()),
        job_waits: args.live.target.is_none(),
    };
    run_with(
        Operation::Count(patterns),
        &args.live,
        None,
        Some(blocks),
        None,
    )
}

/// `exotap nullify`.
///
/// # Errors
/// As [`run_count`], and a bad VALUE.
pub fn run_nullify(args: &NullifyArgs) -> anyhow::Result<i32> {
    let value = parse_value(&args.value)?;
    run(
        Operation::Nullify(args.function.clone(), value),
        &args.live,
        None,
    )
}

/// `exotap replace`.
///
/// # Errors
/// As [`run_count`].
pub fn run_replace(args: &ReplaceArgs) -> anyhow::Result<i32> {
    run(
        Operation::Replace(args.function.clone(), args.other.clone()),
        &args.live,
        None,
    )
}

/// `exotap time`.
///
/// # Errors
/// As [`run_count`].
pub fn run_time(args: &TimeArgs) -> anyhow::Result<i32> {
    run(Operation::Time(args.functions.clone()), &args.live, None)
}

/// `exotap trace`.
///
/// # Errors
/// As [`run_count`].
pub fn run_trace(args: &TraceArgs) -> anyhow::Result<i32> {
    run(
        Operation::Trace(args.functions.clone()),
        &args.live,
        args.perfetto.clone(),
    )
}

/// `exotap splice-report`.
///
/// # Errors
/// As [`run_count`].
pub fn run_report(args: &ReportArgs) -> anyhow::Result<i32> {
    run(
        Operation::Report {
            list: args.list,
            install: args.install,
        },
        &args.live,
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::counter_delta;

    #[test]
    fn a_guest_counter_that_went_down_is_a_reset_not_an_underflow() {
        assert_eq!(counter_delta(3, 10), "7");
        assert_eq!(counter_delta(5, 5), "0");
        assert_eq!(counter_delta(10, 3), "reset");
        assert_eq!(counter_delta(u64::MAX, 0), "reset");
        assert_eq!(counter_delta(0, u64::MAX), u64::MAX.to_string());
    }
}
