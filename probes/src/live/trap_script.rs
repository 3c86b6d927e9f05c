//! Running a probe script against a live guest over QEMU's gdbstub with every kernel probe
//! evaluated by the host ([`super::traps`]): one stop per hit, exact but slow (milliseconds
//! per hit under TCG). Scripts whose kernel probes compile run from splices instead
//! ([`super::compiled`]); this path is `--compile=never`, the reference they are checked
//! against.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use exotap_introspect::heap::HeapPlacement;
use exotap_vmm::control::{Machine, StopEvent};

use crate::lang::check::Program;
use crate::lang::driver::ScriptSource;
use crate::lang::output::{Format, Output};
use crate::lang::runtime::{host_timers, Session};
use crate::lang::Limits;

use super::attach;
use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::splicer::KprobeReader;
use super::traps::{TrapArea, Traps};

/// How often the loop looks at timers and Ctrl-C while the guest runs.
const POLL: Duration = Duration::from_millis(20);

/// A checked script ready to run against a guest.
pub struct GuestScript {
    /// Its source (for error positions).
    pub source: ScriptSource,
    /// The checked program.
    pub prog: Program,
    /// Runtime limits.
    pub limits: Limits,
    /// Text or JSON.
    pub format: Format,
    /// Where the script's output goes.
    pub out: Box<dyn Write + Send>,
    /// Where the run's diagnostics go: the script's warnings and errors, `HOST-RESULT` lines.
    pub err: Box<dyn Write + Send>,
    /// Set by Ctrl-C: end probes run, then exotap detaches and the guest runs on.
    pub stop: Arc<AtomicBool>,
    /// Read the guest's own kprobe hit counters at install and at removal, and print the
    /// difference per function as `HOST-RESULT kprobe.FUNCTION=N`.
    pub compare_kprobes: bool,
}

impl std::fmt::Debug for GuestScript {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestScript")
            .field("source", &self.source.name)
            .field("format", &self.format)
            .field("compare_kprobes", &self.compare_kprobes)
            .finish_non_exhaustive()
    }
}

/// Attaches, arms the script and starts the tracer thread, which runs the begin probes, then
/// every hit, timers, and finally the end probes once the guest powers off, the script calls
/// `exit()`, or Ctrl-C. The thread returns the script's exit code.
///
/// # Errors
/// When attaching or arming fails (the guest is then detached).
pub fn start(
    target: &attach::Target,
    image: &KernelImage,
    heap: (u64, u64),
    mut script: GuestScript,
) -> anyhow::Result<JoinHandle<i32>> {
    // On an error, dropping the session detaches (QEMU drops the breakpoints set so far).
    let mut session = GuestSession::attach(target, image)?;
    super::tracepoints::call_sites_where_off(&mut session, image, &mut script.prog)?;
    let plan = attach::map_patch_heap(
        &mut session.machine,
        &session.survey.clone(),
        HeapPlacement::Auto,
        heap.0,
        heap.1,
    )?;
    let area = TrapArea {
        va: plan.va,
        phys: plan.phys,
        size: plan.size,
    };
    let traps = Traps::arm(&mut session, image, &script.prog, area, &|_| true)?;
    let kprobes = if script.compare_kprobes {
        let btf = image.btf()?;
        Some(KprobeReader::new(&session.survey, image, btf)?)
    } else {
        None
    };
    // Measured last before begin runs (see live::compiled: the paused guest's clock stands
    // still).
    let clock_offset = guest_clock_offset(&mut session, image);
    std::thread::Builder::new()
        .name("exotap-tracer".into())
        .spawn(move || {
            Tracer {
                session,
                traps,
                kprobes,
                clock_offset,
            }
            .run(script)
        })
        .context("cannot start the tracer thread")
}

/// The tracer thread's state.
struct Tracer {
    /// The attached guest (its drop detaches should the thread unwind).
    session: GuestSession,
    traps: Traps,
    /// With `compare_kprobes`: reads the guest's own kprobe hits.
    kprobes: Option<KprobeReader>,
    /// The guest's clock ([`guest_clock_offset`]).
    clock_offset: Option<GuestClock>,
}

/// The guest's clock as probes run on the host read it: the host's plus the offset measured
/// at attach, less the time the guest spent paused since (where its clocks stand still
/// then: [`exotap_vmm::control::Machine::paused_clock`]).
pub(crate) struct GuestClock {
    offset: i64,
    /// The backend's paused time, and its value when the offset was measured.
    paused: Option<(std::sync::Arc<exotap_vmm::control::PausedClock>, u64)>,
}

impl GuestClock {
    /// Makes `session`'s `gettimeofday_*()` read this clock.
    pub(crate) fn apply(&self, session: &mut Session<'_>) {
        session.set_clock_offset(self.offset);
        if let Some((clock, mark)) = &self.paused {
            let (clock, mark) = (std::sync::Arc::clone(clock), *mark);
            session.set_clock_drift(Box::new(move || {
                i64::try_from(clock.paused_ns().saturating_sub(mark)).unwrap_or(i64::MAX)
            }));
        }
    }
}

/// [`GuestSession::clock_offset_ns`] and the backend's paused time, or `None` (said) when the
/// offset cannot be measured: probes run on the host then read the host's clock.
pub(crate) fn guest_clock_offset(
    session: &mut GuestSession,
    image: &KernelImage,
) -> Option<GuestClock> {
    // Asked first (it may take a monitor command): the mark must follow the measurement
    // closely.
    let clock = session.machine.paused_clock();
    match session.clock_offset_ns(image) {
        Ok(ns) => {
            tracing::debug!("the guest's clock is {ns} ns ahead of the host's");
            // Marked now: the offset holds the pause in progress up to here, the drift the
            // rest of it and every pause after.
            let paused = clock.map(|clock| {
                let mark = clock.paused_ns();
                (clock, mark)
            });
            Some(GuestClock { offset: ns, paused })
        }
        Err(e) => {
            tracing::warn!(
                "gettimeofday_*() in probes run on the host read the host's clock, not the \
                 guest's: {e:#}"
            );
            None
        }
    }
}

impl Tracer {
    fn run(mut self, script: GuestScript) -> i32 {
        let GuestScript {
            source,
            prog,
            limits,
            format,
            out,
            err,
            stop,
            ..
        } = script;
        let output = Output::new(format, Box::new(out), Box::new(err));
        let mut session = Session::new(&prog, limits, output, &source.name, &source.text);
        if let Some(symbols) = self.traps.kernel_symbols() {
            session.set_kernel_symbols(symbols);
        }
        if let Some(clock) = &self.clock_offset {
            clock.apply(&mut session);
        }
        // Begin, end and timer probes lay out `@cast` chains with the kernel's types.
        let types = self.traps.kernel_types();
        session.set_host_context(Box::new(super::host_context::HostContext::new(
            types.clone(),
        )));
        session.begin();
        let mut timers = host_timers(&prog, Instant::now());
        // Timers that read guest memory fire with the guest stopped (as a SystemTap timer
        // reads kernel memory in the kernel); the others while it runs.
        let timer_reads: Vec<bool> = timers
            .iter()
            .map(|t| crate::lang::walk::probe_reads_guest_memory(&prog, t.0))
            .collect();
        let host = super::host_context::HostContext::new(types.clone());
        let mut hits = 0u64;
        let mut gone = false;
        // Read with the guest still paused after arming, as at the end after disarming:
        // both counts bracket the same window as the breakpoints.
        let kprobes_before = self
            .kprobes
            .as_ref()
            .map(|k| k.read(&mut self.session.machine));
        if let Err(e) = self.session.machine.resume() {
            tracing::error!("cannot resume the guest: {e}");
            gone = true;
        }
        // The script's procfs files, served by the host, answered between hits.
        let files = match crate::lang::runtime::serve_procfs(&prog) {
            Ok(files) => files,
            Err(e) => {
                session.error(&e.to_string());
                None
            }
        };
        let profile_every = Duration::from_secs(1) / super::traps::PROFILE_HZ;
        let mut next_sample = Instant::now() + profile_every;
        while !gone && !session.stopping() && !stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            for (k, timer) in timers.iter_mut().enumerate().filter(|(_, t)| t.3 <= now) {
                if timer_reads[k] {
                    let fired = self.session.machine.pause().and_then(|()| {
                        {
                            let ctx = super::host_context::HostContext::with_memory(
                                types.clone(),
                                &mut *self.session.machine,
                            );
                            session.fire(timer.0, &timer.1, &ctx);
                        }
                        self.session.machine.resume()
                    });
                    if let Err(e) = fired {
                        tracing::error!("lost the guest: {:#}", anyhow::Error::from(e));
                        gone = true;
                    }
                } else {
                    session.fire(timer.0, &timer.1, &host);
                }
                timer.3 += timer.2;
            }
            while let Some(request) = files.as_ref().and_then(|f| f.next(Duration::ZERO)) {
                session.answer_procfs(request, &host);
            }
            let mut wait = POLL;
            if self.traps.profiles() {
                if next_sample <= now {
                    if let Err(e) = self.traps.sample(&mut self.session, &mut session) {
                        tracing::error!("timer.profile stopped: {e:#}");
                        break;
                    }
                    // Behind (samples slower than the period): no catch-up burst.
                    next_sample = (next_sample + profile_every).max(Instant::now());
                }
                wait = wait.min(next_sample.saturating_duration_since(Instant::now()));
            }
            let event = match self.session.machine.wait_event(wait) {
                Ok(event) => event,
                Err(e) => {
                    tracing::error!("lost the guest: {:#}", anyhow::Error::from(e));
                    gone = true;
                    continue;
                }
            };
            let step = match event {
                None => Ok(()),
                Some(StopEvent::Exited) => {
                    gone = true;
                    Ok(())
                }
                Some(StopEvent::Breakpoint { vcpu, pc }) if self.traps.owns(pc) => {
                    hits += 1;
                    self.traps
                        .hit(&mut self.session, &mut session, vcpu, pc)
                        .and_then(|()| self.session.resume())
                }
                Some(StopEvent::Watchpoint { vcpu, addr, .. }) if self.traps.watches(addr) => {
                    hits += 1;
                    self.traps
                        .watch_hit(&mut self.session, &mut session, vcpu, addr)
                        .and_then(|()| self.session.resume())
                }
                Some(_) => self.session.machine.resume().map_err(Into::into),
            };
            if let Err(e) = step {
                tracing::error!("tracing stopped: {e:#}");
                break;
            }
        }
        tracing::info!("{hits} probe hits handled by the host");
        if gone {
            // The guest ended or the connection is lost: nothing to put back.
            self.session.abandon();
        } else {
            self.traps.disarm(&mut self.session.machine);
            if let (Some(reader), Some(before)) = (&self.kprobes, kprobes_before) {
                match (before, reader.read(&mut self.session.machine)) {
                    (Ok(before), Ok(after)) => {
                        for (name, (hits, missed)) in after {
                            let (h0, m0) = before.get(&name).copied().unwrap_or_default();
                            let n = hits
                                .saturating_add(missed)
                                .saturating_sub(h0.saturating_add(m0));
                            session.note(&format!("HOST-RESULT kprobe.{name}={n}"));
                        }
                    }
                    (Err(e), _) | (_, Err(e)) => {
                        tracing::warn!("cannot read the guest's kprobes: {e:#}");
                    }
                }
            }
            // End probes read the guest's memory as timers do: the guest stays stopped and
            // attached while they run, and goes on after the detach.
            if self.session.pause().is_ok() {
                let code = {
                    let ctx = super::host_context::HostContext::with_memory(
                        types.clone(),
                        &mut *self.session.machine,
                    );
                    session.finish_with(Some(&ctx))
                };
                if let Err(e) = self.session.detach() {
                    tracing::warn!("{e:#}");
                }
                return code;
            }
            if let Err(e) = self.session.detach() {
                tracing::warn!("{e:#}");
            }
        }
        session.finish()
    }
}
