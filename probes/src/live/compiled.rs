//! Running a probe script compiled into the guest (crate::compile): kernel probe
//! bodies run as native code entered from splices, with no stop per hit; begin, end and timer
//! probes, and the kernel probes that do not compile ([`super::traps`], one stop per hit), run
//! on the host over the same globals. Where a host-evaluated and a compiled probe share a
//! point, the host-evaluated one runs first: its breakpoint stops the vCPU before the
//! splice's jump.
//!
//! The globals a script's kernel probes update live in the patch heap. The host brings them
//! into the interpreter before any host probe runs (one stop and one bulk read: `pmemsave`
//! when QEMU runs on this host), and writes back after it what the host probe changed, element
//! by element (a timer's `delete` empties a table), with the guest stopped in between so no
//! update is lost: an element a vCPU stopped in the middle of writing is left as it is (a
//! table re-encoded whole lost such elements, found by check mode). A timer probe that writes
//! no global only reads them: where the guest's memory can be read while it runs (shared
//! RAM, exotap's own VMM) it gets them with no stop. It also looks at the data's
//! header every [`POLL_EVERY`] (one short stop): `exit()` ends the session, a probe error
//! (division by zero, MAXACTION) stops it as the interpreter would, and dropped updates (a
//! full table) are reported at the end. A look that finds the string table of built strings
//! past a quarter full collects it (crate::compile::data::collect), with the guest stopped
//! (a stop of its own where the look made none) and no compiled hit in progress, and the
//! next look comes after [`POLL_SHARED_EVERY`]; what the collector did is said at the end
//! (`HOST-RESULT strings.collections=...`). Booted guests
//! wait at `exotap_wait detach` after their job, where the host reads the final state and
//! removes the splices before the guest powers off.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use exotap_vmm::control::{Machine as _, StopEvent};

use crate::compile::{self, data::Header, Facts, Unsupported};
use crate::lang::output::Output;
use crate::lang::runtime::{host_timers, Session};

use super::attach::Target;
use super::check::{check_verdict, Copied, Shared, Tee};
use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::splicer::KprobeReader;
use super::trap_script::GuestScript;
use super::traps::{HitSessions, Traps};
use crate::splice::{SpliceDecision, TrapReason};

mod hits;
use hits::{finish_hits, settle_returns, twin_hit};

/// Check mode writes both outputs whole (`compiled.out`, `host.out`) into the directory this
/// environment variable names.
pub const CHECK_DUMP: &str = "EXOTAP_CHECK_DUMP";

/// How often the host looks at the data's header (exit, errors) while the guest runs.
pub const POLL_EVERY: Duration = Duration::from_millis(250);
/// How often they are read when the guest's RAM is shared (no stop).
pub const POLL_SHARED_EVERY: Duration = Duration::from_millis(20);
/// How long one wait for a guest event lasts.
const WAIT: Duration = Duration::from_millis(20);

mod guest;
mod install;
mod module_dwarf;
mod modules;
mod plan;

use guest::Guest;
use install::{install, module_event, Install};
pub use module_dwarf::{debug_files_in, list_from_debug_files, ListedPoint};
pub use modules::list_module_functions;
use plan::mixed_report;
pub use plan::{describe, plan, start_script, CompileMode, Plan};

/// Attaches, compiles and installs the script's kernel probes, and starts the thread that
/// runs the session. Returns once the probes are in (so a booted guest's job starts
/// instrumented); the thread returns the script's exit code.
///
/// Statement points go to the host too where the live kernel's splice planner refuses their
/// instruction (shorter than a 5-byte `jmp`, a branch target inside it); `mode` says whether
/// that, or any probe that does not compile, is reported or an error.
///
/// # Errors
/// When attaching, generating or installing fails (the guest is then left as it was); with
/// [`CompileMode::Require`], a probe that does not compile.
pub fn start(
    target: &Target,
    image: &KernelImage,
    heap: (u64, u64),
    script: GuestScript,
    plan: Plan,
    mode: CompileMode,
) -> anyhow::Result<JoinHandle<i32>> {
    let session = GuestSession::attach(target, image)?;
    start_on(session, Some(target), image, heap, script, plan, mode)
}

/// [`start`] on a session already attached (exotap's own KVM VMM hands one over). With no
/// `target` to re-attach through, a script of which no kernel probe compiles is an error
/// instead of a fall-back to the host path.
///
/// # Errors
/// As [`start`].
pub fn start_on(
    mut session: GuestSession,
    target: Option<&Target>,
    image: &KernelImage,
    heap: (u64, u64),
    mut script: GuestScript,
    mut plan: Plan,
    mode: CompileMode,
) -> anyhow::Result<JoinHandle<i32>> {
    let slide = session.survey.kaslr.slide;
    // Tracepoints that cannot fire through their iterator in this guest are probed at their
    // call sites (live::tracepoints): the plan is made again for those points.
    if super::tracepoints::call_sites_where_off(&mut session, image, &mut script.prog)? > 0 {
        match plan::plan(image, &script.prog, &script.limits)? {
            Ok(again) => plan = again,
            Err(constructs) => {
                let why = describe(&constructs, &script.source.name, &script.source.text);
                if mode == CompileMode::Require || mode == CompileMode::Check {
                    bail!(
                        "the script's kernel probes do not compile at the tracepoints' call \
                         sites (--compile={}):\n{why}",
                        if mode == CompileMode::Require {
                            "require"
                        } else {
                            "check"
                        }
                    );
                }
                let Some(target) = target else {
                    bail!(
                        "the script's kernel probes do not compile at the tracepoints' call \
                         sites, and this backend cannot run them on the host:\n{why}"
                    );
                };
                tracing::warn!(
                    "the script's kernel probes run on the host instead, one stop of the guest \
                     per hit, because these do not compile:\n{why}"
                );
                session.detach()?;
                return super::trap_script::start(target, image, heap, script);
            }
        }
    }
    // A compiled tracepoint probe needs its tracepoint on...
    {
        let btf = image.btf().ok();
        let names: Vec<&str> = plan
            .points
            .iter()
            .filter_map(|(_, p)| super::tracepoints::tracepoint_name(&p.name))
            .collect();
        super::tracepoints::tracepoints_on(&mut session, image, btf, names.into_iter())?;
        // ... and goes into its one callback where the kernel calls that past the iterator
        // (tracepoints::tracepoint_callback).
        for (link, point) in &mut plan.points {
            if let Some(name) = super::tracepoints::tracepoint_name(&point.name) {
                if let Some((callback, data)) =
                    super::tracepoints::tracepoint_callback(&mut session, image, btf, name)?
                {
                    *link = callback;
                    point.guard = Some(data);
                }
            }
        }
    }
    // On an error from here on, dropping the session detaches.
    session.plan(image, heap)?;
    let watch = modules::place_module_points(&mut session, image, &mut plan)?;
    let (machine, splicer) = session.parts()?;
    // The text of the functions the statements are in (read as plans need it).
    let slid: Vec<u64> = plan
        .statements
        .iter()
        .map(|l| l.wrapping_add(slide))
        .collect();
    splicer.kernel.prepare(machine, &slid)?;
    let patch = splicer.heap_va + super::splicer::CODE_OFFSET;
    let mut entered = Vec::new();
    for link in std::mem::take(&mut plan.statements) {
        let at = splicer.kernel.entry(link.wrapping_add(slide))?;
        let why = match splicer.kernel.plan(at, patch) {
            SpliceDecision::Splice(_) => None,
            SpliceDecision::Trap {
                reason: TrapReason::ShortInstruction { len },
                ..
            } => {
                entered.push((link, len));
                None
            }
            SpliceDecision::Refuse(why) => Some(why),
        };
        let Some(why) = why else {
            plan.statements.insert(link);
            continue;
        };
        // An inlined instance the point did not name: left out, not sent to the host.
        let implicit = &plan.implicit;
        plan.points.retain(|(l, p)| {
            let keep = *l != link || !implicit.contains(&(p.probe, link));
            if !keep {
                tracing::warn!(
                    "left out: {} at {:#x}: {why}",
                    p.name,
                    link.wrapping_add(slide)
                );
            }
            keep
        });
        for (_, p) in plan.points.iter().filter(|(l, _)| *l == link) {
            plan.host.insert(p.probe);
            plan.refused.push(Unsupported {
                probe: Some(p.probe),
                span: script.prog.script.probes[p.probe].span,
                construct: format!(
                    "{}: the compiled body cannot go there ({why}); the host path tries a \
                     breakpoint",
                    p.name
                ),
            });
        }
    }
    let host = plan.host.clone();
    plan.points.retain(|(_, p)| !host.contains(&p.probe));
    if !plan.refused.is_empty() {
        let why = describe(&plan.refused, &script.source.name, &script.source.text);
        if mode == CompileMode::Require {
            bail!("some of the script's kernel probes do not compile (--compile=require):\n{why}");
        }
        if mode == CompileMode::Check && plan.points.is_empty() {
            bail!("no kernel probe of the script compiles: --compile=check has nothing to check:\n{why}");
        }
        if plan.points.is_empty() {
            tracing::warn!(
                "the script's kernel probes run on the host instead, one stop of the guest per \
                 hit (milliseconds each under TCG), because these do not compile:\n{why}"
            );
            let Some(target) = target else {
                bail!(
                    "no kernel probe of the script compiles, and this backend cannot run them \
                     on the host:\n{why}"
                );
            };
            session.detach()?;
            return super::trap_script::start(target, image, heap, script);
        }
        tracing::warn!("{}", mixed_report(&script, &plan, &why));
    }
    if !entered.is_empty() {
        let points: Vec<String> = entered
            .iter()
            .flat_map(|(link, len)| {
                plan.points
                    .iter()
                    .filter(move |(l, _)| l == link)
                    .map(move |(_, p)| {
                        format!("  {}: the instruction there is {len} bytes", p.name)
                    })
            })
            .collect();
        tracing::warn!(
            "these compiled probe points take no splice: a breakpoint enters their compiled \
             body, one stop of the guest per hit but nothing evaluated on the host:\n{}",
            points.join("\n")
        );
    }
    let mut facts = plan.facts.clone();
    facts.current_task = session.survey.layout.current_task_offset;
    facts.realtime_ns = plan.realtime_link.map(|a| a.wrapping_add(slide));
    facts.copy_nofault = plan.copy_link.map(|a| a.wrapping_add(slide));
    facts.memory = plan.facts.memory.slid(slide);
    facts.stack_save = plan.facts.stack_save.map(|a| a.wrapping_add(slide));
    facts.data_slide = slide;
    let kprobes = if script.compare_kprobes {
        let btf = image.btf()?;
        Some(KprobeReader::new(&session.survey, image, btf)?)
    } else {
        None
    };
    // Check mode: every compiled probe runs on the host too, into a shadow session.
    let check: Option<BTreeSet<usize>> =
        (mode == CompileMode::Check).then(|| plan.points.iter().map(|(_, p)| p.probe).collect());
    // The probes that do not compile (in check mode all of them) get their breakpoints now,
    // before any splice goes in (the guest stays paused until the thread installs and
    // resumes).
    let traps = if plan.host.is_empty() && check.is_none() {
        None
    } else {
        let area = session
            .splicer()
            .context("the session has no splicer after its plan")?
            .trap_area();
        let host = plan.host.clone();
        let also = check.clone().unwrap_or_default();
        let traps = Traps::arm(&mut session, image, &script.prog, area, &|i| {
            host.contains(&i) || also.contains(&i)
        })?;
        tracing::info!(
            "{} host-evaluated probe points armed beside the compiled ones",
            traps.points()
        );
        Some(traps)
    };
    // Stack snapshots are unwound on the host, with the image's ORC tables (without them
    // their records count as lost, as the host-evaluated path's stacks are empty); probes
    // run on the host name kernel addresses, modules' too, with the same tables.
    let stacks = if compile::snapshot::names_kernel_code(&script.prog) {
        super::stacks::KernelStacks::load_for(image, &mut session, None)
            .map_err(|e| {
                tracing::warn!("the kernel stacks compiled probes print cannot be unwound: {e:#}")
            })
            .ok()
    } else {
        None
    };
    // The guest's clock, measured last before begin runs: it stands still while the guest is
    // paused (under TCG), so time spent here after measuring it (arming breakpoints: tens of
    // ms) would put begin's clock ahead of the compiled probes' (negative intervals).
    let clock_offset = super::trap_script::guest_clock_offset(&mut session, image);
    // Probes run on the host (`end`, timers) name kernel addresses with the image's symbols.
    let symbols = super::stacks::text_symbols(image, slide);
    let (ready_tx, ready_rx) = mpsc::channel::<anyhow::Result<()>>();
    let handle = std::thread::Builder::new()
        .name("exotap-compiled".into())
        .spawn(move || {
            let started = Started {
                plan,
                facts,
                slide,
                kprobes,
                traps,
                stacks,
                symbols,
                check,
                clock_offset,
                watch,
            };
            run(session, script, started, ready_tx)
        })
        .context("cannot start the script thread")?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => {
            let _ = handle.join();
            bail!("the script thread ended before installing its probes")
        }
    }
}

/// What [`start`] hands the session's thread besides the guest and the script.
struct Started {
    plan: Plan,
    /// The kernel facts, slid.
    facts: Facts,
    slide: u64,
    kprobes: Option<KprobeReader>,
    /// The host-evaluated probes of a mixed script.
    traps: Option<Traps>,
    /// The kernel's ORC tables and symbols, when compiled probes print kernel stacks.
    stacks: Option<super::stacks::KernelStacks>,
    /// The kernel's text symbols at running addresses, for probes run on the host.
    symbols: exotap_introspect::symbols::SymbolTable,
    /// Check mode: the compiled probes (see [`CompileMode::Check`]).
    check: Option<BTreeSet<usize>>,
    /// The guest's clock: probes run on the host read it, as the compiled ones do.
    clock_offset: Option<super::trap_script::GuestClock>,
    /// The script's probes in kernel modules, placed as modules load and unload.
    watch: Option<modules::ModuleWatch>,
}

/// A hit of a host-evaluated probe of a mixed script (the guest stopped at it): what the
/// compiled probes printed so far comes first, then the probe runs over the globals brought
/// from the guest, which go back before the guest resumes.
fn host_hit(
    guest: &mut Guest,
    traps: &mut Traps,
    sessions: &mut HitSessions<'_, '_>,
    at: (exotap_vmm::control::VcpuId, u64),
) -> anyhow::Result<()> {
    host_hit_stopped(guest, traps, sessions, at)?;
    guest.session.resume()
}

/// [`host_hit`], the guest left stopped.
fn host_hit_stopped(
    guest: &mut Guest,
    traps: &mut Traps,
    sessions: &mut HitSessions<'_, '_>,
    (vcpu, pc): (exotap_vmm::control::VcpuId, u64),
) -> anyhow::Result<()> {
    // Check mode's twin of a compiled probe fires in the shadow only: the main session's
    // globals (the compiled data, hundreds of KiB read through the stub) stay in the guest.
    if sessions
        .shadow
        .as_ref()
        .is_some_and(|(_, compiled)| traps.fires_only(pc, compiled))
    {
        return traps.hit_in(&mut guest.session, sessions, vcpu, pc);
    }
    guest.print(sessions.main, false)?;
    guest.pull(sessions.main)?;
    traps.hit_in(&mut guest.session, sessions, vcpu, pc)?;
    guest.push(sessions.main)
}

fn run(
    guest: GuestSession,
    script: GuestScript,
    started: Started,
    ready: mpsc::Sender<anyhow::Result<()>>,
) -> i32 {
    let Started {
        plan,
        facts,
        slide,
        kprobes,
        mut traps,
        stacks,
        symbols,
        check,
        clock_offset,
        mut watch,
    } = started;
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
    // Check mode: copies of both outputs, and the diagnostics kept for the verdict.
    let (main_copy, shadow_copy) = (Copied::default(), Copied::default());
    let err = Shared(std::rc::Rc::new(std::cell::RefCell::new(err)));
    let output = if check.is_some() {
        Output::new(
            format,
            Box::new(Tee(out, main_copy.clone())),
            Box::new(err.clone()),
        )
    } else {
        Output::new(format, Box::new(out), Box::new(err.clone()))
    };
    let mut session = Session::new(&prog, limits.clone(), output, &source.name, &source.text);
    // Begin, end and timer probes lay out `@cast` chains with the kernel's types.
    session.set_host_context(Box::new(super::host_context::HostContext::new(
        facts.types.clone(),
    )));
    let namer = || match &stacks {
        Some(stacks) => stacks.symbol_lookup(),
        None => super::stacks::symbol_lookup(symbols.clone()),
    };
    session.set_kernel_symbols(namer());
    if let Some(clock) = &clock_offset {
        clock.apply(&mut session);
    }
    session.begin();
    let mut shadow = check.as_ref().map(|_| {
        let output = Output::new(
            format,
            Box::new(shadow_copy.clone()),
            Box::new(std::io::sink()),
        );
        let mut shadow = Session::new(&prog, limits.clone(), output, &source.name, &source.text);
        shadow.set_kernel_symbols(namer());
        if let Some(clock) = &clock_offset {
            clock.apply(&mut shadow);
        }
        shadow
    });
    if let Some(shadow) = shadow.as_mut() {
        shadow.begin();
    }
    let what = Install {
        prog: &prog,
        limits: &limits,
        plan: &plan,
        facts: &facts,
        slide,
    };
    let mut guest = match install(guest, &what, &session) {
        Ok(g) => g,
        Err(e) => {
            let _ = ready.send(Err(e));
            return 1;
        }
    };
    guest.stacks = stacks;
    if let Some(w) = &watch {
        for at in w.breakpoints() {
            if let Err(e) = guest.session.machine.set_breakpoint(at, true) {
                let _ = ready.send(Err(e.into()));
                return 1;
            }
        }
    }
    // The guest's own kprobe counters, read at the same stops as the install and the removal.
    let kprobes_before = kprobes.as_ref().map(|k| k.read(&mut guest.session.machine));
    let _ = ready.send(Ok(()));
    let mut timers = host_timers(&prog, Instant::now());
    // Timer probes that write no global and read no guest memory read the compiled globals
    // while the guest runs, where the backend can; the others stop it (they write the globals
    // back, which the vCPUs must not update meanwhile, or read kernel memory, as a
    // SystemTap timer does: HostContext::with_memory).
    let timer_writes: Vec<bool> = timers
        .iter()
        .map(|t| {
            crate::lang::walk::probe_writes_globals(&prog, t.0)
                || crate::lang::walk::probe_reads_guest_memory(&prog, t.0)
        })
        .collect();
    let host = super::host_context::HostContext::new(facts.types.clone());
    // The script's procfs files, served by the host: each access is answered like a timer
    // that writes the globals (a stop, the compiled data pulled in, written back after).
    let files = match crate::lang::runtime::serve_procfs(&prog) {
        Ok(files) => files,
        Err(e) => {
            session.error(&e.to_string());
            None
        }
    };
    let mut gone = false;
    let mut header = Header::default();
    let mut lost = 0;
    // Whether the guest ended (its splices went with it): nothing to remove then.
    let mut exited = false;
    if let Err(e) = guest.session.resume() {
        tracing::error!("{e:#}");
        gone = true;
    }
    let pauses_at_install = guest.session.pause_count();
    let mut next_poll = Instant::now() + POLL_EVERY;
    // A collection that finds a vCPU in a compiled hit may let the guest run a moment and
    // look again, unless a breakpoint of the run could stop a vCPU meanwhile.
    // Whether the last look found the string table filling: the next one comes soon.
    let mut churning = false;
    let collect_tries = if traps.is_none() && guest.entered.is_empty() {
        guest::COLLECT_TRIES
    } else {
        1
    };
    let mut host_hits = 0u64;
    let mut entered_hits = 0u64;
    let mut twin_emulated = false;
    while !gone && !session.stopping() && !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        let due: Vec<usize> = (0..timers.len()).filter(|i| timers[*i].3 <= now).collect();
        let requests: Vec<crate::procfs::Request> = files
            .iter()
            .flat_map(|f| std::iter::from_fn(|| f.next(Duration::ZERO)))
            .collect();
        if !due.is_empty() || !requests.is_empty() || now >= next_poll {
            let shared = guest.session.is_shared();
            let reads_running = shared || guest.session.machine.reads_while_running();
            let step = (|| -> anyhow::Result<bool> {
                if shared && due.is_empty() && requests.is_empty() {
                    // Output and header through the shared RAM: no stop.
                    guest.print(&mut session, false)?;
                    header = guest.header()?;
                    let end = header.exit || header.errors > 0;
                    if !end {
                        churning = guest.collect_strings(collect_tries)?;
                    }
                    return Ok(end);
                }
                // (Check mode compares at stops: a vCPU between its host-evaluated and its
                // compiled run of a hit is finished first, below.)
                if reads_running
                    && check.is_none()
                    && requests.is_empty()
                    && !due.is_empty()
                    && due.iter().all(|i| !timer_writes[*i])
                {
                    // Timers that only read: the globals as the guest has them now, no stop
                    // (never in check mode, so no shadow to fire them in).
                    guest.print(&mut session, false)?;
                    header = guest.pull_running(&mut session)?;
                    for i in &due {
                        let (probe, name, period, _) = timers[*i].clone();
                        session.fire(probe, &name, &host);
                        timers[*i].3 += period;
                    }
                    return Ok(header.exit || header.errors > 0);
                }
                // A backend that maps guest memory (exotap's own VMM) is read, and its rings
                // drained, while the guest runs; timers write the globals back: a stop then.
                let host_probes = !due.is_empty() || !requests.is_empty();
                let paused = if !host_probes {
                    guest.session.pause_for_read()?
                } else {
                    guest.session.pause()?;
                    if let (Some(compiled), Some(t)) = (check.as_ref(), traps.as_mut()) {
                        finish_hits(&mut guest, Some(t), &facts)?;
                        let mut sessions = HitSessions {
                            main: &mut session,
                            shadow: shadow.as_mut().map(|s| (s, compiled)),
                        };
                        settle_returns(&mut guest, t, &mut sessions)?;
                    }
                    true
                };
                guest.print(&mut session, false)?;
                if !host_probes {
                    header = guest.header()?;
                } else {
                    header = guest.pull(&mut session)?;
                    {
                        // The guest is stopped: these probes read its kernel memory too.
                        let host = super::host_context::HostContext::with_memory(
                            facts.types.clone(),
                            &mut *guest.session.machine,
                        );
                        for i in &due {
                            let (probe, name, period, _) = timers[*i].clone();
                            session.fire(probe, &name, &host);
                            if let Some(shadow) = shadow.as_mut() {
                                shadow.fire(probe, &name, &host);
                            }
                            timers[*i].3 += period;
                        }
                        for request in requests {
                            session.answer_procfs(request, &host);
                        }
                    }
                    guest.push(&session)?;
                }
                let end = header.exit || header.errors > 0;
                if !end {
                    churning = guest.collect_strings(collect_tries)?;
                    guest.session.resume_after_read(paused)?;
                }
                Ok(end)
            })();
            match step {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    tracing::error!("lost the guest: {e:#}");
                    gone = true;
                    break;
                }
            }
            next_poll = Instant::now()
                + if guest.session.is_shared() || churning {
                    POLL_SHARED_EVERY
                } else {
                    POLL_EVERY
                };
        }
        match guest.session.wait(WAIT) {
            Ok(None) => {}
            Ok(Some(StopEvent::Exited)) => {
                gone = true;
                exited = true;
            }
            Ok(Some(StopEvent::Breakpoint { vcpu, pc })) if guest.entered.contains_key(&pc) => {
                entered_hits += 1;
                let code = guest.entered.get(&pc).copied().unwrap_or(pc);
                // Check mode: the host-evaluated twin at the same breakpoint runs first (as
                // at a splice, where its breakpoint comes before the patch), then the vCPU
                // goes from the twin's out-of-line copy into the compiled code instead,
                // which ends with the same instruction.
                let twin = check.is_some() && traps.as_ref().is_some_and(|t| t.owns(pc));
                let mut step: anyhow::Result<()> = Ok(());
                let mut enter = true;
                if let (true, Some(t)) = (twin, traps.as_mut()) {
                    host_hits += 1;
                    let mut sessions = HitSessions {
                        main: &mut session,
                        shadow: shadow.as_mut().zip(check.as_ref()),
                    };
                    let at_copy = twin_hit(&mut guest, t, &mut sessions, (vcpu, pc));
                    enter = matches!(at_copy, Ok(true));
                    if matches!(at_copy, Ok(false)) && !twin_emulated {
                        twin_emulated = true;
                        tracing::warn!(
                            "check: the host-evaluated twin at {pc:#x} emulates its instruction, \
                             so its hits do not enter the compiled code: their output will differ"
                        );
                    }
                    step = at_copy.map(drop);
                }
                let step = step
                    .and_then(|()| {
                        if enter {
                            guest.session.machine.set_pc(vcpu, code)?;
                        }
                        Ok(())
                    })
                    .and_then(|()| guest.session.resume());
                if let Err(e) = step {
                    tracing::error!("lost the guest: {e:#}");
                    gone = true;
                }
            }
            Ok(Some(StopEvent::Breakpoint { vcpu, pc }))
                if watch.as_ref().is_some_and(|w| w.owns(pc)) =>
            {
                let step = match watch.as_mut() {
                    Some(w) => module_event(&mut guest, w, (&prog, &limits, &facts), (vcpu, pc)),
                    None => Ok(()),
                }
                .and_then(|()| guest.session.resume());
                if let Err(e) = step {
                    tracing::error!("a module's load or unload at {pc:#x} failed: {e:#}");
                    gone = true;
                }
            }
            Ok(Some(StopEvent::Breakpoint { vcpu, pc }))
                if traps.as_ref().is_some_and(|t| t.owns(pc)) =>
            {
                host_hits += 1;
                let step = match traps.as_mut() {
                    Some(t) => {
                        let mut sessions = HitSessions {
                            main: &mut session,
                            shadow: shadow.as_mut().zip(check.as_ref()),
                        };
                        host_hit(&mut guest, t, &mut sessions, (vcpu, pc))
                    }
                    None => Ok(()),
                };
                if let Err(e) = step {
                    // End as after `exit()`: the return addresses this run swapped on kernel
                    // stacks must go back (the disarm below), or their calls return into the
                    // trampoline's `ud2` once exotap detaches. If the guest is really lost,
                    // the removal says so.
                    tracing::error!(
                        "a host-evaluated probe at {pc:#x} failed: {e:#}; ending the run"
                    );
                    break;
                }
            }
            Ok(Some(StopEvent::Watchpoint { vcpu, addr, .. }))
                if traps.as_ref().is_some_and(|t| t.watches(addr)) =>
            {
                host_hits += 1;
                let step = match traps.as_mut() {
                    Some(t) => {
                        let mut sessions = HitSessions {
                            main: &mut session,
                            shadow: shadow.as_mut().zip(check.as_ref()),
                        };
                        t.watch_hit_in(&mut guest.session, &mut sessions, vcpu, addr)
                            .and_then(|()| guest.session.resume())
                    }
                    None => Ok(()),
                };
                if let Err(e) = step {
                    tracing::error!(
                        "a kernel.data probe at {addr:#x} failed: {e:#}; ending the run"
                    );
                    break;
                }
            }
            Ok(Some(_)) => {
                // Compiled probes set no breakpoints: a stop is someone else's; go on.
                if let Err(e) = guest.session.resume() {
                    tracing::error!("{e:#}");
                    gone = true;
                }
            }
            Err(e) => {
                tracing::error!("{e:#}");
                gone = true;
            }
        }
    }
    if traps.is_some() {
        tracing::info!("{host_hits} hits of host-evaluated probes");
    }
    if guest.layout.strings.is_some_and(|t| t.collectable) {
        let c = guest.collections;
        tracing::info!(
            "built strings collected {} times, {} entries freed; {} attempts found a vCPU in \
             a compiled hit",
            c.collections,
            c.freed,
            c.busy
        );
        session.note(&format!(
            "HOST-RESULT strings.collections={} strings.freed={} strings.busy={}",
            c.collections, c.freed, c.busy
        ));
    }
    if !guest.entered.is_empty() {
        tracing::info!("{entered_hits} hits entered compiled code from a breakpoint");
    }
    // The session, still attached after the removal, until the end probes ran.
    let mut attached: Option<GuestSession> = None;
    if gone {
        session.error(
            "the guest ended before exotap read its compiled probes' data: their last updates are lost",
        );
        if exited {
            guest.session.abandon();
        } else if let Some(t) = traps.as_mut() {
            // Best effort: swapped return addresses back before the drop's removal.
            let _ = guest.session.pause();
            t.disarm(&mut guest.session.machine);
        }
        // Else dropping the session tries the removal and detaches.
    } else {
        if let (Some(now), Some(then)) = (guest.session.pause_count(), pauses_at_install) {
            session.note(&format!(
                "HOST-RESULT pauses.between_install_and_removal={}",
                now.saturating_sub(then)
            ));
        }
        if let Some(w) = &watch {
            tracing::info!(
                "kernel modules: {} loads and {} unloads of probed modules seen, {} sites put \
                 in and {} taken out at them",
                w.loads,
                w.unloads,
                w.sites_in,
                w.sites_out
            );
            session.note(&format!(
                "HOST-RESULT modules.loads_unloads={}/{}",
                w.loads, w.unloads
            ));
        }
        let mut disarmed = false;
        let end = (|| -> anyhow::Result<()> {
            guest.session.pause()?;
            finish_hits(&mut guest, traps.as_ref(), &facts)?;
            if let (Some(compiled), Some(t)) = (check.as_ref(), traps.as_mut()) {
                let mut sessions = HitSessions {
                    main: &mut session,
                    shadow: shadow.as_mut().map(|s| (s, compiled)),
                };
                settle_returns(&mut guest, t, &mut sessions)?;
            }
            guest.print(&mut session, true)?;
            header = guest.pull(&mut session)?;
            if let (Some(reader), Some(before)) = (&kprobes, &kprobes_before) {
                match (before, reader.read(&mut guest.session.machine)) {
                    (Ok(before), Ok(after)) => {
                        for (name, (hits, missed)) in after {
                            let (h0, m0) = before.get(&name).copied().unwrap_or_default();
                            let n = hits
                                .saturating_add(missed)
                                .saturating_sub(h0.saturating_add(m0));
                            session.note(&format!("HOST-RESULT kprobe.{name}={n}"));
                        }
                    }
                    (Err(e), _) => tracing::warn!("cannot read the guest's kprobes: {e:#}"),
                    (_, Err(e)) => tracing::warn!("cannot read the guest's kprobes: {e:#}"),
                }
            }
            let removed = guest.session.remove()?;
            // The host-evaluated probes' swapped return addresses go back after the compiled
            // ones: where both swapped one (a host-evaluated and a compiled `.return` probe
            // of one function: mixed scripts, check mode), the host's breakpoint came first,
            // so the compiled probe kept the host's trampoline as the "original", and only
            // this order (the reverse of the swaps) puts the caller's address back.
            if let Some(t) = traps.as_mut() {
                t.disarm(&mut guest.session.machine);
            }
            disarmed = true;
            if !removed.differing.is_empty() {
                tracing::warn!(
                    "{} text pages differ after removal",
                    removed.differing.len()
                );
            }
            // A timed call whose return address slot could not be read kept exotap's
            // trampoline as its return address (also logged where it was found).
            if !removed.returns_unrestored.is_empty() {
                session.warn(&format!(
                    "{} calls in flight at removal: their return address slots could not be \
                     read, so their return addresses were not put back",
                    removed.returns_unrestored.len()
                ));
            }
            // As stap's skipped probes (a kretprobe's missed instances): said, not a script
            // error that would keep the end probes from running.
            if removed.timing_misses > 0 {
                session.warn(&format!(
                    "Number of skipped probes: {}: calls not followed to their return (their \
                     .return probes did not run), the table of calls in flight being full",
                    removed.timing_misses
                ));
            }
            Ok(())
        })();
        if let Err(e) = end {
            tracing::error!("removing the compiled probes failed: {e:#}");
            if !disarmed {
                if let Some(t) = traps.as_mut() {
                    t.disarm(&mut guest.session.machine);
                }
            }
        }
        lost = guest.lost;
        // Detached after the end probes, which read the stopped guest's memory as timers do.
        attached = Some(guest.session);
    }
    if lost > 0 {
        session.warn(&format!(
            "{lost} output records of compiled probes lost: a vCPU printed more than its ring \
             holds between two looks of the host"
        ));
    }
    if header.overflow > 0 {
        session.error(&format!(
            "array overflow in a compiled probe ({} times), check MAXMAPENTRIES",
            header.overflow
        ));
    }
    if header.faults > 0 {
        session.error(&format!(
            "kernel read fault in a compiled probe ({} times): an address that is not mapped",
            header.faults
        ));
    }
    if header.empty > 0 {
        session.error(&format!(
            "empty aggregate in a compiled probe ({} times)",
            header.empty
        ));
    }
    if header.div_zero > 0 {
        session.error(&format!(
            "division by 0 in a compiled probe ({} times)",
            header.div_zero
        ));
    }
    if header.max_action > 0 {
        session.error(&format!(
            "MAXACTION exceeded in a compiled probe ({} times)",
            header.max_action
        ));
    }
    if header.nesting > 0 {
        session.error(&format!(
            "MAXNESTING exceeded in a compiled probe ({} times)",
            header.nesting
        ));
    }
    if header.raised > 0 {
        session.error(&format!(
            "error() raised in a compiled probe ({} times)",
            header.raised
        ));
    }
    if header.strings > 0 {
        session.error(&format!(
            "{} strings built in a compiled probe had no room in its string table (or a text \
             the guest cannot read)",
            header.strings
        ));
    }
    if header.arguments > 0 {
        session.error(&format!(
            "string function argument out of range in a compiled probe ({} times): a \
             stringat() index past the string or a strtol() base outside 2 to 36",
            header.arguments
        ));
    }
    if header.stacks_busy > 0 {
        session.warn(&format!(
            "{} backtrace() or symname() calls in compiled probes gave an empty stack or the \
             bare address: the kernel's unwinder or symbol lookup was already running on \
             their CPU (a probe on a function they run, or one in an NMI)",
            header.stacks_busy
        ));
    }
    if header.dropped > 0 {
        session.error(&format!(
            "{} array updates or lookups dropped: a table was full (raise MAXMAPENTRIES) or a \
             slot stayed busy (another vCPU writing it)",
            header.dropped
        ));
    }
    let stopped = attached.as_mut().is_some_and(|live| live.pause().is_ok());
    let mut code = match attached.as_mut() {
        Some(live) if stopped => {
            let ctx = super::host_context::HostContext::with_memory(
                facts.types.clone(),
                &mut *live.machine,
            );
            session.finish_with(Some(&ctx))
        }
        _ => session.finish(),
    };
    // After a failed removal, the detach tries it again.
    if let Some(live) = attached {
        if let Err(e) = live.detach() {
            tracing::warn!("{e:#}");
        }
    }
    if let Some(shadow) = shadow {
        shadow.finish();
        // For a difference to be looked into whole: both outputs as files.
        if let Some(dir) = std::env::var_os(CHECK_DUMP) {
            let dir = std::path::PathBuf::from(dir);
            for (name, out) in [("compiled.out", &main_copy), ("host.out", &shadow_copy)] {
                if let Err(e) = std::fs::write(dir.join(name), &*out.0.borrow()) {
                    tracing::warn!("{CHECK_DUMP}: cannot write {name}: {e}");
                }
            }
        }
        let verdict = match check_verdict(&main_copy.0.borrow(), &shadow_copy.0.borrow()) {
            Ok(lines) => format!(
                "check: the compiled probes and the same probes evaluated on the host (at \
                 {host_hits} stops) printed the same {lines} lines"
            ),
            Err(why) => {
                code = code.max(1);
                format!(
                    "check: the compiled probes and the same probes evaluated on the host (at \
                     {host_hits} stops) printed different output: {why}"
                )
            }
        };
        let mut err = err;
        let _ = std::io::Write::write_all(&mut err, format!("{verdict}\n").as_bytes());
    }
    code
}
