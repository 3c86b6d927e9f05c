//! Running a probe script compiled into the guest (crate::compile): kernel probe
//! bodies run as native code entered from splices, with no stop per hit; begin, end and timer
//! probes, and the kernel probes that do not compile ([`super::traps`], one stop per hit), run
//! on the host over the same globals. Where a host-evaluated and a compiled probe share a
//! point, the host-evaluated one runs first: its breakpoint stops the vCPU before the
//! splice's jump.
//!
//! The globals a script's kernel probes update live in the patch heap. The host brings them
//! into the interpreter before any host probe runs (one stop and one bulk read: `pmemsave`
//! when QEMU runs on this host), and writes them back after it (a timer's `delete` empties a
//! table), with the guest stopped in between so no update is lost. A timer probe that writes
//! no global only reads them: where the guest's memory can be read while it runs (shared
//! RAM, exotap's own VMM) it gets them with no stop. It also looks at the data's
//! header every [`POLL_EVERY`] (one short stop): `exit()` ends the session, a probe error
//! (division by zero, MAXACTION) stops it as the interpreter would, and dropped updates (a
//! full table) are reported at the end. Booted guests wait at `exotap_wait detach` after
//! their job, where the host reads the final state and removes the splices before the guest
//! powers off.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use exotap_introspect::btf::Btf;
use exotap_vmm::control::{Machine as _, StopEvent};

use crate::compile::{
    self, codegen::Env, data::Header, DataLayout, Facts, Interner, Runtime, SiteBodies, SitePoint,
    TaskFields, Unsupported,
};
use crate::lang::check::Program;
use crate::lang::kernel_points::KernelSymbols;
use crate::lang::output::Output;
use crate::lang::resolve::resolve_program;
use crate::lang::runtime::{host_context, host_timers, Session};
use crate::lang::Limits;

use super::attach::Target;
use super::check::{check_verdict, Copied, Shared, Tee};
use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::splicer::{Action, KprobeReader, Request, SiteCode};
use super::trap_script::GuestScript;
use super::traps::{HitSessions, Traps};
use crate::splice::{SpliceDecision, TrapReason};

mod hits;
use hits::{finish_hits, settle_returns, twin_hit};

/// How often the host looks at the data's header (exit, errors) while the guest runs.
pub const POLL_EVERY: Duration = Duration::from_millis(250);
/// How often they are read when the guest's RAM is shared (no stop).
pub const POLL_SHARED_EVERY: Duration = Duration::from_millis(20);
/// How long one wait for a guest event lasts.
const WAIT: Duration = Duration::from_millis(20);

/// Whether scripts run compiled into the guest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CompileMode {
    /// Per probe: the kernel probes that compile run from splices, the others at
    /// breakpoints on the host, saying why.
    #[default]
    Auto,
    /// Every kernel probe compiled, or an error naming what does not compile.
    Require,
    /// Host-evaluated (a stop per hit): the reference the compiled path is checked against.
    Never,
    /// Both, on the same hits: the kernel probes run as with `Auto`, and every one of them
    /// also on the host at a breakpoint (a stop per hit) into a shadow session with globals
    /// of its own; at the end the two outputs must be the same bytes, else the run says
    /// where they part and exits 1.
    Check,
}

/// What the image says a compiled run needs: the points, the kernel facts (link-time
/// addresses; slid at attach), and the kernel probes that do not compile, which run on the
/// host at breakpoints in the same session ([`super::traps`]).
#[derive(Debug, Clone)]
pub struct Plan {
    points: Vec<(u64, SitePoint)>,
    /// Kernel probes evaluated on the host, by index in the program.
    host: BTreeSet<usize>,
    /// Why each of them does not compile.
    refused: Vec<Unsupported>,
    /// The compiled points that are statements (link-time), which compile only where the
    /// live kernel's splice planner accepts the instruction.
    statements: BTreeSet<u64>,
    facts: Facts,
    realtime_link: Option<u64>,
    copy_link: Option<u64>,
}

/// The facts the generated code needs, from the image's symbols and BTF.
fn facts(image: &KernelImage, prog: &Program, btf: &Btf) -> anyhow::Result<Facts> {
    let member = |s: &str, m: &str| -> Option<u64> {
        btf.struct_member(s, m).ok().and_then(|m| m.byte_offset())
    };
    let need = |s: &str, m: &str| -> anyhow::Result<u64> {
        member(s, m).with_context(|| format!("BTF has no byte offset for {s}.{m}"))
    };
    Ok(Facts {
        // Per-CPU symbols are offsets from the GS base: not slid.
        current_task: image.address("current_task")?,
        cpu_number: image.address("cpu_number")?,
        task: TaskFields {
            pid: need("task_struct", "pid")?,
            tgid: member("task_struct", "tgid"),
            comm: need("task_struct", "comm")?,
            real_parent: member("task_struct", "real_parent"),
            cred: member("task_struct", "cred"),
            cred_uid: member("cred", "uid"),
            utime: member("task_struct", "utime"),
            stime: member("task_struct", "stime"),
        },
        globals: std::sync::Arc::new(super::target_vars::kernel_globals(image, prog, Some(btf))?),
        jiffies: image.symbols.get("jiffies_64").map(|s| s.addr),
        data_slide: 0,
        realtime_ns: image.symbols.get("ktime_get_real_fast_ns").map(|s| s.addr),
        copy_nofault: image
            .symbols
            .get("copy_from_kernel_nofault")
            .map(|s| s.addr),
        memory: compile::MemoryFns::from_symbols(|n| image.symbols.get(n).map(|s| s.addr)),
        stack_save: image.symbols.get("stack_trace_save_regs").map(|s| s.addr),
        types: Some(std::sync::Arc::new(compile::types::BtfTypes(btf.clone()))),
        irq_regs: ["__irq_regs", "irq_regs"]
            .iter()
            .find_map(|n| image.symbols.get(n))
            .zip(member("pt_regs", "ip").zip(member("pt_regs", "cs")))
            .map(|(s, (ip, cs))| compile::IrqRegs {
                percpu: s.addr,
                ip,
                cs,
            }),
    })
}

/// Decides from the image alone which kernel probes of `prog` compile: those run from
/// splices, the others on the host at breakpoints, per probe.
///
/// # Errors
/// `Ok(Err(constructs))` when none compiles or something of the whole program does not (a
/// global's layout); `Err` when the image lacks what any compiled run needs (BTF, symbols)
/// or a point does not resolve.
pub fn plan(
    image: &KernelImage,
    prog: &Program,
    limits: &Limits,
) -> anyhow::Result<Result<Plan, Vec<Unsupported>>> {
    let btf = Btf::from_elf(image.vmlinux.bytes()).context("the kernel image has no usable BTF")?;
    let facts = facts(image, prog, &btf)?;
    let lines = super::target_vars::source_lines(image);
    let resolver = KernelSymbols::new(&image.symbols, Some(&btf)).with_lines(lines.as_ref());
    let resolved = resolve_program(prog, &resolver)?;
    let locals = super::target_vars::point_locals(image, prog, &resolved)?;
    let mut points = Vec::new();
    let mut elsewhere = Vec::new();
    let mut statements = BTreeSet::new();
    for (probe, point) in resolved {
        let profile = point.name.starts_with(compile::PROFILE_POINT);
        let link = match point.address {
            Some(link) => link,
            // Each tick's update_process_times runs a compiled timer.profile probe.
            None if profile => match image.symbols.get(compile::PROFILE_FUNCTION) {
                Some(s) => s.addr,
                None => {
                    elsewhere.push(Unsupported {
                        probe: Some(probe),
                        span: prog.script.probes[probe].span,
                        construct: format!(
                            "{} (the kernel has no {})",
                            point.name,
                            compile::PROFILE_FUNCTION
                        ),
                    });
                    continue;
                }
            },
            None => continue,
        };
        let is_return = point.name.ends_with(".return");
        // A statement (`func+OFFSET`, `.absolute`) runs its body in its function, at a
        // splice where the planner accepts the instruction ([`start`] asks it).
        let statement = point.name.starts_with("kernel.statement(");
        let function = image
            .symbols
            .lookup_addr(link)
            .filter(|(s, off)| *off == 0 || (statement && s.is_text()))
            .map(|(s, _)| s.name.clone());
        let Some(function) = function else {
            elsewhere.push(Unsupported {
                probe: Some(probe),
                span: prog.script.probes[probe].span,
                construct: format!("{} (not a function entry)", point.name),
            });
            continue;
        };
        // A tracepoint's point is its iterator `__traceiter_NAME(void *__data, ARGS)`, whose
        // variables leave out `__data`: the arguments start at the second register (as the
        // host-evaluated path reads them, live::traps).
        let data = super::tracepoints::tracepoint_name(&point.name).map(|_| String::new());
        let params = data
            .into_iter()
            .chain(super::target_vars::btf_params(&point))
            .collect();
        if statement {
            statements.insert(link);
        }
        points.push((
            link,
            SitePoint {
                probe,
                name: point.name.clone(),
                function,
                params,
                is_return,
                locals: locals.get(&(probe, link)).cloned(),
                guard: None,
            },
        ));
    }
    let only: Vec<SitePoint> = points.iter().map(|p| p.1.clone()).collect();
    let mut refused = compile::check(prog, limits, &facts, &only);
    refused.append(&mut elsewhere);
    refused.sort_by_key(|u| (u.span.start, u.construct.clone()));
    refused.dedup();
    if refused.iter().any(|u| u.probe.is_none()) {
        return Ok(Err(refused));
    }
    let host: BTreeSet<usize> = refused.iter().filter_map(|u| u.probe).collect();
    points.retain(|(_, p)| !host.contains(&p.probe));
    if points.is_empty() {
        return Ok(Err(refused));
    }
    let realtime_link = facts.realtime_ns;
    let copy_link = facts.copy_nofault;
    Ok(Ok(Plan {
        points,
        host,
        refused,
        statements,
        facts,
        realtime_link,
        copy_link,
    }))
}

/// Starts `script` against `target`: compiled into the guest where it compiles (as `mode`
/// says), per probe: the kernel probes that do not compile run on the host at breakpoints in
/// the same session, over the same globals, each named with what does not compile. A script
/// of which nothing compiles runs through the host-evaluated tracer
/// ([`super::trap_script`]).
///
/// # Errors
/// As [`start`] and [`super::trap_script::start`]; with [`CompileMode::Require`], a script of
/// which some kernel probe does not compile.
pub fn start_script(
    target: &Target,
    image: &KernelImage,
    heap: (u64, u64),
    script: GuestScript,
    mode: CompileMode,
) -> anyhow::Result<JoinHandle<i32>> {
    if mode == CompileMode::Check && !script.prog.needs_guest() {
        bail!("the script has no kernel probe: --compile=check has nothing to check");
    }
    if mode != CompileMode::Never && script.prog.needs_guest() {
        let why = match plan(image, &script.prog, &script.limits) {
            Ok(Ok(plan)) => return start(target, image, heap, script, plan, mode),
            Ok(Err(constructs)) => describe(&constructs, &script.source.name, &script.source.text),
            // Not a matter of compiling: the host path could not read them either.
            Err(e) if e.is::<super::target_vars::UnreadableTargets>() => return Err(e),
            Err(e) => format!("  {e:#}"),
        };
        if mode == CompileMode::Require {
            bail!("the script's kernel probes do not compile (--compile=require):\n{why}");
        }
        if mode == CompileMode::Check {
            bail!("no kernel probe of the script compiles: --compile=check has nothing to check:\n{why}");
        }
        tracing::warn!(
            "the script's kernel probes run on the host instead, one stop of the guest per hit \
             (milliseconds each under TCG), because these do not compile:\n{why}"
        );
    }
    super::trap_script::start(target, image, heap, script)
}

/// What `--compile=auto` says of a mixed run: which kernel probes run compiled, which on
/// the host and why (`why`: [`describe`] of the refused constructs).
fn mixed_report(script: &GuestScript, plan: &Plan, why: &str) -> String {
    let name = |i: usize| {
        let probe = &script.prog.probes[i];
        let (line, _) = crate::lang::diag::line_col(
            &script.source.text,
            script.prog.script.probes[i].span.start,
        );
        let points: Vec<String> = probe.points.iter().map(|(p, _)| p.to_string()).collect();
        format!(
            "  {}:{line}: probe {}",
            script.source.name,
            points.join(", ")
        )
    };
    let compiled: BTreeSet<usize> = plan.points.iter().map(|p| p.1.probe).collect();
    let compiled: Vec<String> = compiled.into_iter().map(name).collect();
    let host: Vec<String> = plan.host.iter().copied().map(name).collect();
    format!(
        "the script runs mixed: {} kernel probes compiled into the guest (splice speed):\n{}\n\
         {} on the host instead, one stop of the guest per hit (milliseconds each under TCG):\n\
         {}\nbecause these do not compile:\n{why}",
        compiled.len(),
        compiled.join("\n"),
        host.len(),
        host.join("\n"),
    )
}

/// One line per construct, for messages: "file:line:col: construct".
pub fn describe(unsupported: &[Unsupported], file: &str, source: &str) -> String {
    unsupported
        .iter()
        .map(|u| {
            let (line, col) = crate::lang::diag::line_col(source, u.span.start);
            format!("  {file}:{line}:{col}: {}", u.construct)
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The compiled sites of one install, as the splice engine asks for their code.
struct Sites<'a> {
    env: Env<'a>,
    interner: &'a mut Interner,
    bodies: Vec<SiteBodies>,
    /// Each site's address (the first frame of the stacks its bodies snapshot).
    addrs: Vec<u64>,
}

impl SiteCode for Sites<'_> {
    fn has_returns(&self, site: u32) -> bool {
        self.bodies
            .get(site as usize)
            .is_some_and(|b| !b.ret.is_empty())
    }

    fn entry(
        &mut self,
        site: u32,
        at: u64,
        returns: Option<(u64, u64, u64)>,
    ) -> anyhow::Result<Vec<u8>> {
        let bodies = self.bodies.get(site as usize).context("no such site")?;
        let stacks_before = self.interner.stacks.len();
        let code = compile::entry_code(self.env, self.interner, at, bodies, returns)
            .map_err(|u| anyhow::anyhow!("{u}"))?;
        // The stack records these bodies write start at the probe point.
        let addr = self.addrs.get(site as usize).copied().unwrap_or(0);
        for format in self.interner.stacks.iter_mut().skip(stacks_before) {
            format.pc = addr;
        }
        Ok(code)
    }

    fn trampoline(&mut self, site: u32, at: u64, table: u64) -> anyhow::Result<Vec<u8>> {
        let bodies = self.bodies.get(site as usize).context("no such site")?;
        compile::return_code(self.env, self.interner, at, bodies, table)
            .map_err(|u| anyhow::anyhow!("{u}"))
    }
}

/// The guest side of a compiled run.
struct Guest {
    session: GuestSession,
    layout: DataLayout,
    data: u64,
    interner: Interner,
    /// Per vCPU: output records taken so far.
    taken: Vec<u64>,
    /// Output records lost to ring overruns (or unreadable).
    lost: u64,
    /// Sites whose compiled code a breakpoint enters (no splice fits there): site to code.
    entered: HashMap<u64, u64>,
    /// The data as the last pull read it (the guest still stopped).
    pulled: Option<Vec<u8>>,
    /// The kernel's ORC tables and symbols, when the probes take stack snapshots.
    stacks: Option<super::stacks::KernelStacks>,
}

/// What an output record prints: a stack record unwound from its snapshot
/// ([`compile::snapshot`]), any other as the interner renders it; `None` for a record no
/// format knows (a hostile guest), or a stack record without the kernel's ORC tables.
fn printed(
    interner: &Interner,
    stacks: Option<&super::stacks::KernelStacks>,
    rec: &[u8],
) -> Option<compile::data::Printed> {
    let Some(format) = compile::snapshot::stack_format(&interner.stacks, rec) else {
        return interner.printed(rec);
    };
    let stacks = stacks?;
    compile::snapshot::render(format, rec, &|raw| interner.decode(raw), &|snap| {
        super::stacks::snapshot_backtrace(stacks, snap)
    })
    .map(compile::data::Printed::Text)
}

impl Guest {
    fn read_data(&mut self) -> anyhow::Result<Vec<u8>> {
        let len = usize::try_from(self.layout.globals_size)?;
        self.session.read_heap(self.data, len)
    }

    /// Takes the output records written since the last drain, in TSC order across vCPUs (the
    /// guest stopped). A record still being written ends its vCPU's take until the next
    /// drain; with `last` it is skipped instead.
    fn drain(&mut self, last: bool) -> anyhow::Result<Vec<compile::data::Printed>> {
        use crate::rings::{spans, take, window};
        let Some(rings) = self.layout.ring_set(self.data) else {
            return Ok(Vec::new());
        };
        self.taken.resize(rings.cpus as usize, 0);
        let record = usize::try_from(rings.record)?;
        let mut records = Vec::new();
        if let Some(shared) = self.session.shared_heap().cloned() {
            // The zero-stop path: the vCPUs may be running ([`crate::rings`]).
            for cpu in 0..rings.cpus {
                let Some(taken) = self.taken.get_mut(cpu as usize) else {
                    continue;
                };
                let got = crate::rings::drain_concurrent(&shared, &rings, cpu, taken, last)?;
                self.lost += got.lost;
                for rec in got.records.chunks_exact(record) {
                    let tsc = u64::from_le_bytes(rec[..8].try_into().unwrap_or_default());
                    match printed(&self.interner, self.stacks.as_ref(), rec) {
                        Some(text) => records.push((tsc, text)),
                        None => self.lost += 1,
                    }
                }
            }
            records.sort_by_key(|r| r.0);
            return Ok(records.into_iter().map(|r| r.1).collect());
        }
        for cpu in 0..rings.cpus {
            let head = self.session.read_heap(rings.ring(cpu), 8)?;
            let head = u64::from_le_bytes(head.try_into().unwrap_or_default());
            let (from, lost) = window(head, self.taken[cpu as usize], rings.slots);
            self.lost += lost;
            let mut bytes = Vec::new();
            for (slot, n) in spans(from, head, rings.slots) {
                let len = usize::try_from(n * rings.record)?;
                bytes.extend(self.session.read_heap(rings.slot(cpu, slot), len)?);
            }
            let (finished, consumed) = take(&bytes, record, last);
            for rec in finished {
                let tsc = u64::from_le_bytes(rec[..8].try_into().unwrap_or_default());
                match printed(&self.interner, self.stacks.as_ref(), rec) {
                    Some(text) => records.push((tsc, text)),
                    None => self.lost += 1,
                }
            }
            if !last {
                for (slot, n) in spans(from, from + consumed, rings.slots) {
                    let zeros = vec![0u8; usize::try_from(n * rings.record)?];
                    self.session.write_heap(rings.slot(cpu, slot), &zeros)?;
                }
            }
            self.taken[cpu as usize] = from + consumed;
        }
        records.sort_by_key(|r| r.0);
        Ok(records.into_iter().map(|r| r.1).collect())
    }

    /// Prints what the compiled probes printed since the last look.
    fn print(&mut self, session: &mut Session<'_>, last: bool) -> anyhow::Result<()> {
        for printed in self.drain(last)? {
            match printed {
                compile::data::Printed::Text(text) => session.text(&text),
                compile::data::Printed::Hist {
                    name,
                    kind,
                    buckets,
                    newline,
                } => {
                    session.hist(
                        &name,
                        &crate::lang::hist::Histogram {
                            kind,
                            buckets: &buckets,
                        },
                    );
                    if newline {
                        session.text("\n");
                    }
                }
            }
        }
        Ok(())
    }

    /// The data's header (error counts, exit), read while the guest runs when its RAM is
    /// shared, else with the guest stopped.
    fn header(&mut self) -> anyhow::Result<Header> {
        let len = compile::data::HEADER as usize;
        let bytes = match self.session.shared_heap() {
            Some(shared) => shared.read_heap(self.data, len)?,
            None => self.session.read_heap(self.data, len)?,
        };
        Ok(Header::decode(&bytes))
    }

    /// Brings every compiled global into the session (the guest stopped); keeps what it
    /// read for the [`Guest::push`] that follows.
    fn pull(&mut self, session: &mut Session<'_>) -> anyhow::Result<Header> {
        let data = self.read_data()?;
        let header = self.bring_in(session, &data);
        self.pulled = Some(data);
        Ok(header)
    }

    /// Brings every compiled global into the session while the guest runs (through the
    /// shared RAM, or a backend that reads guest memory while it runs), for host probes that
    /// only read them: nothing is written back. Each table entry is one the guest had
    /// published (a slot being written is skipped); an aggregate's fields come from
    /// separate atomic updates, so a hit in flight may show in its count before its sum.
    fn pull_running(&mut self, session: &mut Session<'_>) -> anyhow::Result<Header> {
        let len = usize::try_from(self.layout.globals_size)?;
        let data = match self.session.shared_heap() {
            Some(shared) => shared.read_heap(self.data, len)?,
            None => self.session.read_heap(self.data, len)?,
        };
        Ok(self.bring_in(session, &data))
    }

    /// Decodes every compiled global of `data` into the session; returns the header.
    fn bring_in(&self, session: &mut Session<'_>, data: &[u8]) -> Header {
        for name in self.layout.globals.keys() {
            if let Some(store) = self.layout.decode(name, data, &self.interner) {
                session.set_global(name, store);
            }
        }
        Header::decode(data)
    }

    /// Writes every compiled global from the session back, keeping the header (the guest
    /// stopped, right after a pull): only the bytes that differ from what the pull read.
    fn push(&mut self, session: &Session<'_>, prog: &Program) -> anyhow::Result<()> {
        let data = match self.pulled.take() {
            Some(data) => data,
            None => self.read_data()?,
        };
        let header = data[..compile::data::HEADER as usize].to_vec();
        let mut fresh = self.layout.initial(prog, &mut self.interner);
        fresh[..header.len()].copy_from_slice(&header);
        self.layout.keep_strings(&data, &mut fresh);
        for name in self.layout.globals.keys() {
            if let Some(store) = session.global(name) {
                if let Err(e) = self
                    .layout
                    .encode_into(name, store, &mut self.interner, &mut fresh)
                {
                    tracing::warn!("cannot give {name} back to the compiled probes: {e}");
                }
            }
        }
        for (at, len) in changed_spans(&data, &fresh, SPAN_GAP) {
            self.session
                .write_heap(self.data + at as u64, &fresh[at..at + len])?;
        }
        Ok(())
    }
}

/// Unchanged bytes between two changed ones that [`changed_spans`] writes anyway rather
/// than start another write.
const SPAN_GAP: usize = 64;

/// The spans (offset, length) where `new` differs from `old` (same length), merged across
/// runs of fewer than `gap` equal bytes.
fn changed_spans(old: &[u8], new: &[u8], gap: usize) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for (i, _) in old.iter().zip(new).enumerate().filter(|(_, (a, b))| a != b) {
        match spans.last_mut() {
            Some((at, len)) if i < *at + *len + gap => *len = i + 1 - *at,
            _ => spans.push((i, 1)),
        }
    }
    spans
}

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
    script: GuestScript,
    mut plan: Plan,
    mode: CompileMode,
) -> anyhow::Result<JoinHandle<i32>> {
    let slide = session.survey.kaslr.slide;
    // A compiled tracepoint probe needs its tracepoint on...
    {
        let btf = Btf::from_elf(image.vmlinux.bytes()).ok();
        let names: Vec<&str> = plan
            .points
            .iter()
            .filter_map(|(_, p)| super::tracepoints::tracepoint_name(&p.name))
            .collect();
        super::tracepoints::tracepoints_on(&mut session, image, btf.as_ref(), names.into_iter())?;
        // ... and goes into its one callback where the kernel calls that past the iterator
        // (tracepoints::tracepoint_callback).
        for (link, point) in &mut plan.points {
            if let Some(name) = super::tracepoints::tracepoint_name(&point.name) {
                if let Some((callback, data)) = super::tracepoints::tracepoint_callback(
                    &mut session,
                    image,
                    btf.as_ref(),
                    name,
                )? {
                    *link = callback;
                    point.guard = Some(data);
                }
            }
        }
    }
    // On an error from here on, dropping the session detaches.
    let splicer = session.plan(image, heap)?;
    let patch = splicer.heap_va + super::splicer::CODE_OFFSET;
    let mut entered = Vec::new();
    for link in std::mem::take(&mut plan.statements) {
        let why = match splicer.kernel.plan(link.wrapping_add(slide), patch) {
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
        let btf =
            Btf::from_elf(image.vmlinux.bytes()).context("the kernel image has no usable BTF")?;
        Some(KprobeReader::new(&session.survey, image, &btf)?)
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
    // their records count as lost, as the host-evaluated path's stacks are empty).
    let stacks = if compile::snapshot::takes_snapshots(&script.prog) {
        super::stacks::KernelStacks::load(image, slide)
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

/// What an install puts in: the program, its points and the kernel's facts (slid).
#[derive(Clone, Copy)]
struct Install<'a> {
    prog: &'a Program,
    limits: &'a Limits,
    plan: &'a Plan,
    facts: &'a Facts,
    slide: u64,
}

/// Generates the sites' code and the data, writes them and installs the splices; returns the
/// guest side.
fn install(
    mut guest: GuestSession,
    what: &Install<'_>,
    session: &Session<'_>,
) -> anyhow::Result<Guest> {
    let Install {
        prog,
        limits,
        plan,
        facts,
        slide,
    } = *what;
    #[allow(clippy::type_complexity)]
    let r = (|| -> anyhow::Result<(DataLayout, u64, Interner, HashMap<u64, u64>)> {
        let mut layout = DataLayout::new(prog, limits).map_err(|u| {
            anyhow::anyhow!(
                "{}",
                u.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            )
        })?;
        if compile::codegen::prints(prog) {
            let cpus = u32::try_from(guest.parts()?.1.cpus())?;
            layout = layout.with_rings(cpus);
        }
        let data = guest.alloc(layout.size, 64)?;
        // Assembled once to learn its size, then again where it goes.
        let size = compile::runtime(&layout, data, data)?.code.len() as u64;
        let rt_at = guest.alloc(size.max(16), 16)?;
        let rt: Runtime = compile::runtime(&layout, data, rt_at)?;
        let mut interner = Interner::default();
        let mut bytes = layout.initial(prog, &mut interner);
        for name in layout.globals.keys() {
            if let Some(store) = session.global(name) {
                if let Err(e) = layout.encode_into(name, store, &mut interner, &mut bytes) {
                    tracing::warn!("{name} starts empty in the guest: {e}");
                }
            }
        }
        bytes.resize(usize::try_from(layout.size)?, 0);
        guest.write_heap(data, &bytes)?;
        if !rt.code.is_empty() {
            guest.write_heap(rt_at, &rt.code)?;
        }
        // One site per address: its entry bodies and its return bodies.
        let mut by_addr: BTreeMap<u64, SiteBodies> = BTreeMap::new();
        let mut names: HashMap<u64, String> = HashMap::new();
        for (link, p) in &plan.points {
            let addr = link.wrapping_add(slide);
            let site = by_addr.entry(addr).or_insert_with(|| SiteBodies {
                pc: addr,
                ..SiteBodies::default()
            });
            names.entry(addr).or_insert_with(|| p.function.clone());
            if p.is_return {
                site.ret.push(p.clone());
            } else {
                site.entry.push(p.clone());
            }
        }
        let mut requests = Vec::new();
        let mut bodies = Vec::new();
        for (addr, b) in by_addr {
            requests.push(Request {
                name: names.get(&addr).cloned().unwrap_or_default(),
                addr,
                action: Action::Compiled(u32::try_from(bodies.len())?),
            });
            bodies.push(b);
        }
        let env = Env {
            prog,
            limits,
            facts,
            layout: &layout,
            data,
            helpers: &rt.helpers,
        };
        let mut sites = Sites {
            env,
            interner: &mut interner,
            bodies,
            addrs: requests.iter().map(|r| r.addr).collect(),
        };
        let report = guest.install_compiled(&requests, &mut sites)?;
        for r in &report.refused {
            tracing::warn!("{} ({:#x}) not instrumented: {}", r.name, r.addr, r.reason);
        }
        for (site, _) in &report.entered {
            guest.machine.set_breakpoint(*site, true)?;
        }
        if report.refused.len() == requests.len() {
            bail!(
                "none of the script's kernel probe points could be spliced: {}",
                report
                    .refused
                    .iter()
                    .map(|r| format!("{}: {}", r.name, r.reason))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
        tracing::info!(
            "compiled probes in at {} sites ({} refused), {} KiB of data, planned in {:.3} s",
            guest.splicer().map_or(0, |s| s.installed.len()),
            report.refused.len(),
            layout.size >> 10,
            report.plan_time.as_secs_f64()
        );
        Ok((layout, data, interner, report.entered.into_iter().collect()))
    })();
    // On an error, dropping the session takes out whatever went in and detaches.
    let (layout, data, interner, entered) = r?;
    Ok(Guest {
        session: guest,
        layout,
        data,
        interner,
        taken: Vec::new(),
        lost: 0,
        entered,
        pulled: None,
        stacks: None,
    })
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
}

/// A hit of a host-evaluated probe of a mixed script (the guest stopped at it): what the
/// compiled probes printed so far comes first, then the probe runs over the globals brought
/// from the guest, which go back before the guest resumes.
fn host_hit(
    guest: &mut Guest,
    traps: &mut Traps,
    sessions: &mut HitSessions<'_, '_>,
    prog: &Program,
    at: (exotap_vmm::control::VcpuId, u64),
) -> anyhow::Result<()> {
    host_hit_stopped(guest, traps, sessions, prog, at)?;
    guest.session.resume()
}

/// [`host_hit`], the guest left stopped.
fn host_hit_stopped(
    guest: &mut Guest,
    traps: &mut Traps,
    sessions: &mut HitSessions<'_, '_>,
    prog: &Program,
    (vcpu, pc): (exotap_vmm::control::VcpuId, u64),
) -> anyhow::Result<()> {
    guest.print(sessions.main, false)?;
    guest.pull(sessions.main)?;
    traps.hit_in(&mut guest.session, sessions, vcpu, pc)?;
    guest.push(sessions.main, prog)
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
    session.set_kernel_symbols(super::stacks::symbol_lookup(symbols.clone()));
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
        shadow.set_kernel_symbols(super::stacks::symbol_lookup(symbols.clone()));
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
    // The guest's own kprobe counters, read at the same stops as the install and the removal.
    let kprobes_before = kprobes.as_ref().map(|k| k.read(&mut guest.session.machine));
    let _ = ready.send(Ok(()));
    let mut timers = host_timers(&prog, Instant::now());
    // Timer probes that write no global read the compiled ones while the guest runs, where
    // the backend can; the others stop it (they write the globals back, which the vCPUs
    // must not update meanwhile).
    let timer_writes: Vec<bool> = timers
        .iter()
        .map(|t| compile::codegen::walk::probe_writes_globals(&prog, t.0))
        .collect();
    let host = host_context();
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
    let mut host_hits = 0u64;
    let mut entered_hits = 0u64;
    let mut twin_emulated = false;
    while !gone && !session.stopping() && !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        let due: Vec<usize> = (0..timers.len()).filter(|i| timers[*i].3 <= now).collect();
        if !due.is_empty() || now >= next_poll {
            let shared = guest.session.is_shared();
            let reads_running = shared || guest.session.machine.reads_while_running();
            let step = (|| -> anyhow::Result<bool> {
                if shared && due.is_empty() {
                    // Output and header through the shared RAM: no stop.
                    guest.print(&mut session, false)?;
                    header = guest.header()?;
                    return Ok(header.exit || header.errors > 0);
                }
                // (Check mode compares at stops: a vCPU between its host-evaluated and its
                // compiled run of a hit is finished first, below.)
                if reads_running
                    && check.is_none()
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
                let paused = if due.is_empty() {
                    guest.session.pause_for_read()?
                } else {
                    guest.session.pause()?;
                    if let (Some(compiled), Some(t)) = (check.as_ref(), traps.as_mut()) {
                        finish_hits(&mut guest, Some(t), &facts)?;
                        let mut sessions = HitSessions {
                            main: &mut session,
                            shadow: shadow.as_mut().map(|s| (s, compiled)),
                        };
                        settle_returns(&mut guest, t, &mut sessions, &prog)?;
                    }
                    true
                };
                guest.print(&mut session, false)?;
                if due.is_empty() {
                    header = guest.header()?;
                } else {
                    header = guest.pull(&mut session)?;
                    for i in &due {
                        let (probe, name, period, _) = timers[*i].clone();
                        session.fire(probe, &name, &host);
                        if let Some(shadow) = shadow.as_mut() {
                            shadow.fire(probe, &name, &host);
                        }
                        timers[*i].3 += period;
                    }
                    guest.push(&session, &prog)?;
                }
                let end = header.exit || header.errors > 0;
                if !end {
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
                + if guest.session.is_shared() {
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
                    let at_copy = twin_hit(&mut guest, t, &mut sessions, &prog, (vcpu, pc));
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
                if traps.as_ref().is_some_and(|t| t.owns(pc)) =>
            {
                host_hits += 1;
                let step = match traps.as_mut() {
                    Some(t) => {
                        let mut sessions = HitSessions {
                            main: &mut session,
                            shadow: shadow.as_mut().zip(check.as_ref()),
                        };
                        host_hit(&mut guest, t, &mut sessions, &prog, (vcpu, pc))
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
    if !guest.entered.is_empty() {
        tracing::info!("{entered_hits} hits entered compiled code from a breakpoint");
    }
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
        let mut disarmed = false;
        let end = (|| -> anyhow::Result<()> {
            guest.session.pause()?;
            finish_hits(&mut guest, traps.as_ref(), &facts)?;
            if let (Some(compiled), Some(t)) = (check.as_ref(), traps.as_mut()) {
                let mut sessions = HitSessions {
                    main: &mut session,
                    shadow: shadow.as_mut().map(|s| (s, compiled)),
                };
                settle_returns(&mut guest, t, &mut sessions, &prog)?;
            }
            guest.print(&mut session, true)?;
            header = guest.pull(&mut session)?;
            if let (Some(reader), Some(before)) = (&kprobes, &kprobes_before) {
                match (before, reader.read(&mut guest.session.machine)) {
                    (Ok(before), Ok(after)) => {
                        for (name, (hits, missed)) in after {
                            let (h0, m0) = before.get(&name).copied().unwrap_or_default();
                            let n = (hits + missed).saturating_sub(h0 + m0);
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
        // After a failed removal, the detach tries it again.
        if let Err(e) = guest.session.detach() {
            tracing::warn!("{e:#}");
        }
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
            "{} backtrace() calls in compiled probes gave an empty stack: the kernel's \
             unwinder was already running on their CPU (a probe on a function the unwinder \
             runs, or one in an NMI)",
            header.stacks_busy
        ));
    }
    if header.dropped > 0 {
        session.error(&format!(
            "{} array updates dropped: a table was full (raise MAXMAPENTRIES) or a slot stayed busy",
            header.dropped
        ));
    }
    let mut code = session.finish();
    if let Some(shadow) = shadow {
        shadow.finish();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lang::driver::{compile as check_script, ScriptSource};

    /// The cached Debian kernel, when present.
    fn image() -> Option<KernelImage> {
        let dir =
            exotap_introspect::bzimage::cached_kernel_dir(exotap_guest_images::DEFAULT_KERNEL)?;
        KernelImage::load(dir.join("vmlinuz")).ok()
    }

    fn program(text: &str) -> Program {
        let source = ScriptSource {
            name: "t.stp".into(),
            text: text.into(),
        };
        check_script(&source, &Limits::default()).unwrap()
    }

    #[test]
    fn a_probe_that_does_not_compile_goes_to_the_host_and_the_others_stay_compiled() {
        let Some(image) = image() else {
            eprintln!("SKIP: the Debian kernel is not cached (exotap boot fetches it)");
            return;
        };
        let prog = program(
            r#"global n, a, s
            probe kernel.function("vfs_read") { n++ }
            probe kernel.function("vfs_write") { if (symname(2) != "") s = 1 }
            probe kernel.statement("vfs_read+0x5") { a[n] = 1 }"#,
        );

        let plan = plan(&image, &prog, &Limits::default()).unwrap().unwrap();

        assert_eq!(plan.host, BTreeSet::from([1]));
        assert_eq!(plan.refused.len(), 1);
        assert!(
            plan.refused[0].construct.contains("symname()"),
            "{:?}",
            plan.refused
        );
        let compiled: BTreeSet<usize> = plan.points.iter().map(|p| p.1.probe).collect();
        assert_eq!(compiled, BTreeSet::from([0, 2]));
        let vfs_read = image.address("vfs_read").unwrap();
        assert_eq!(plan.statements, BTreeSet::from([vfs_read + 5]));
        let statement = plan.points.iter().find(|p| p.1.probe == 2).unwrap();
        assert_eq!(statement.1.function, "vfs_read");
    }

    #[test]
    fn changed_spans_merge_close_changes_and_keep_far_ones_apart() {
        let old = vec![0u8; 300];
        let mut new = old.clone();
        new[3] = 1;
        new[10] = 1;
        new[200] = 1;

        assert_eq!(changed_spans(&old, &new, 64), vec![(3, 8), (200, 1)]);
        assert_eq!(changed_spans(&old, &old, 64), vec![]);
    }

    #[test]
    fn a_script_of_which_nothing_compiles_is_refused_whole() {
        let Some(image) = image() else {
            eprintln!("SKIP: the Debian kernel is not cached (exotap boot fetches it)");
            return;
        };
        let prog = program(
            r#"global s; probe kernel.function("vfs_read") { if (symname(2) != "") s = 1 }"#,
        );

        let refused = plan(&image, &prog, &Limits::default())
            .unwrap()
            .unwrap_err();

        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].probe, Some(0));
    }
}
