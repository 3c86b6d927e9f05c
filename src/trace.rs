//! Running a probe script against a live guest over QEMU's gdbstub: trap probes evaluated by
//! the host (DESIGN.md, key mechanism 4).
//!
//! Each resolved entry point gets a gdbstub software breakpoint. On a hit the host runs the
//! probe body on a [`LiveContext`] (registers, arguments named by BTF, the current task, kernel
//! memory), then resumes the vCPU through an out-of-line copy of the displaced entry
//! instruction in the patch heap followed by a jump back. The breakpoint stays in place, so
//! no step is needed and no hit on another vCPU is missed while one resumes. One stop per hit:
//! exact, but slow (milliseconds per hit under TCG); in-guest splices are the fast path.
//!
//! Entry points only for now: a function's entry instruction is the ftrace nop5 or, while the
//! guest's own ftrace uses it, a `call`, both of which [`crate::entry_patch`] relocates.
//! `.return` probes, `timer.profile` and source-level points are refused with the reason.

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use exotap_introspect::btf::Btf;
use exotap_introspect::layout::TaskOffsets;
use exotap_probes::lang::check::Program;
use exotap_probes::lang::context::{Context, MemoryError};
use exotap_probes::lang::driver::ScriptSource;
use exotap_probes::lang::kernel_points::KernelSymbols;
use exotap_probes::lang::output::{Format, Output};
use exotap_probes::lang::point::PointKind;
use exotap_probes::lang::resolve::resolve_program;
use exotap_probes::lang::runtime::Session;
use exotap_probes::lang::value::Value;
use exotap_probes::lang::Limits;
use exotap_vmm::control::{Machine, RegisterFile, StopEvent, VcpuId, X86Registers};
use exotap_vmm::gdb::GdbMachine;

use crate::attach::{self, Attached, Survey};
use crate::entry_patch::relocated_entry;
use crate::kernel_image::KernelImage;

/// Where the out-of-line entry copies start inside the patch heap, and their spacing.
const OOL_OFFSET: u64 = 0x10000;
const OOL_SLOT: u64 = 16;
/// SysV argument registers, as indices into [`X86Registers::gpr`] (rdi rsi rdx rcx r8 r9).
const ARG_REGS: [usize; 6] = [5, 4, 3, 2, 8, 9];
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
    /// Set by Ctrl-C: end probes run, then exotap detaches and the guest runs on.
    pub stop: Arc<AtomicBool>,
}

/// One breakpoint and what it runs.
#[derive(Debug, Clone)]
struct ArmedPoint {
    probe: usize,
    name: String,
    function: String,
    /// The entry instruction the out-of-line copy was made from.
    original: [u8; 5],
    /// The copy: virtual (where the vCPU resumes) and physical (where it is written).
    resume_at: u64,
    copy_phys: u64,
    params: Vec<String>,
}

impl ArmedPoint {
    /// Remakes the out-of-line copy when the guest changed the entry since it was made (its
    /// own ftrace turns the nop5 into a call and back): the hit must run what is there now.
    fn refresh(&mut self, machine: &mut GdbMachine, vcpu: VcpuId, addr: u64) -> anyhow::Result<()> {
        let mut now = [0u8; 5];
        machine.read_virt(vcpu, addr, &mut now)?;
        if now != self.original {
            let code = relocated_entry(addr, now, self.resume_at)
                .with_context(|| format!("the guest changed {}'s entry", self.name))?;
            machine.write_phys(self.copy_phys, &code)?;
            tracing::debug!("{}: entry now {now:02x?}, copy remade", self.name);
            self.original = now;
        }
        Ok(())
    }
}

/// The guest side of a probe hit: read on demand from the stopped vCPU.
struct LiveContext<'a> {
    machine: RefCell<&'a mut GdbMachine>,
    vcpu: VcpuId,
    regs: X86Registers,
    point: &'a ArmedPoint,
    survey: &'a Survey,
    tasks: Option<TaskOffsets>,
    task: OnceCell<Option<(i64, String)>>,
}

impl LiveContext<'_> {
    fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; len];
        // The vCPU stopped in kernel code, so its CR3 is the kernel's: QEMU walks it.
        self.machine
            .borrow_mut()
            .read_virt(self.vcpu, addr, &mut buf)
            .ok()?;
        Some(buf)
    }

    fn read_u64(&self, addr: u64) -> Option<u64> {
        let b = self.read(addr, 8)?;
        Some(u64::from_le_bytes(b.try_into().ok()?))
    }

    /// pid and comm of the current task, read once per hit.
    fn task(&self) -> Option<&(i64, String)> {
        self.task
            .get_or_init(|| {
                let offsets = self.tasks?;
                let base = self.regs.kernel_percpu_base();
                let task =
                    self.read_u64(base.wrapping_add(self.survey.layout.current_task_offset))?;
                let pid = self.read(task.wrapping_add(offsets.pid), 4)?;
                let pid = i32::from_le_bytes(pid.try_into().ok()?);
                let comm = self.read(task.wrapping_add(offsets.comm), 16)?;
                let comm = comm.split(|b| *b == 0).next().unwrap_or(&comm);
                Some((i64::from(pid), String::from_utf8_lossy(comm).into_owned()))
            })
            .as_ref()
    }

    fn argument(&self, index: usize) -> Option<u64> {
        ARG_REGS.get(index).map(|r| self.regs.gpr[*r])
    }
}

impl Context for LiveContext<'_> {
    fn target(&self, path: &str) -> Option<Value> {
        if path == "$$parms" {
            let text: Vec<String> = self
                .point
                .params
                .iter()
                .enumerate()
                .filter_map(|(i, p)| Some(format!("{p}={:#x}", self.argument(i)?)))
                .collect();
            return Some(Value::Str(text.join(" ")));
        }
        let name = path.strip_prefix('$')?;
        let index = self.point.params.iter().position(|p| p == name)?;
        self.argument(index).map(|v| Value::Long(v as i64))
    }

    fn pid(&self) -> i64 {
        self.task().map_or(-1, |t| t.0)
    }

    fn tid(&self) -> i64 {
        self.pid()
    }

    fn ppid(&self) -> i64 {
        -1
    }

    fn uid(&self) -> i64 {
        -1
    }

    fn execname(&self) -> String {
        self.task().map_or_else(String::new, |t| t.1.clone())
    }

    fn cpu(&self) -> i64 {
        i64::from(self.vcpu.0)
    }

    fn probefunc(&self) -> String {
        self.point.function.clone()
    }

    fn read_kernel(&self, addr: u64, len: usize) -> Result<Vec<u8>, MemoryError> {
        self.read(addr, len).ok_or(MemoryError::Unreadable { addr })
    }
}

/// Resolves the script's kernel points, writes the out-of-line entry copies into the patch
/// heap and sets the breakpoints. Returns the armed points by (slid) address.
fn arm(
    att: &mut Attached,
    survey: &Survey,
    image: &KernelImage,
    btf: Option<&Btf>,
    prog: &Program,
    heap: (u64, u64),
) -> anyhow::Result<HashMap<u64, ArmedPoint>> {
    let unsupported: Vec<String> = prog
        .probes
        .iter()
        .flat_map(|p| p.points.iter())
        .filter(|(_, kind)| match kind {
            PointKind::TimerProfile => true,
            PointKind::KernelFunction { site, .. } => {
                matches!(site, exotap_probes::lang::point::FunctionSite::Return)
            }
            PointKind::Syscall { ret, .. } => *ret,
            _ => false,
        })
        .map(|(pt, _)| pt.to_string())
        .collect();
    if !unsupported.is_empty() {
        bail!(
            "the gdbstub tracer runs entry probes only; not yet: {}",
            unsupported.join(", ")
        );
    }
    let resolver = KernelSymbols::new(&image.symbols, btf);
    let resolved = resolve_program(prog, &resolver)?;
    let plan = attach::map_patch_heap(&mut att.machine, survey, heap.0, heap.1)?;
    let mut armed = HashMap::new();
    let slide = survey.kaslr.slide;
    for (probe, point) in resolved {
        let Some(link) = point.address else {
            continue; // begin, end, timers: the host runs those
        };
        let addr = link.wrapping_add(slide);
        if armed.contains_key(&addr) {
            tracing::warn!("{} is already probed at {addr:#x}; skipped", point.name);
            continue;
        }
        let mut original = [0u8; 5];
        att.machine.read_virt(VcpuId(0), addr, &mut original)?;
        let slot = u64::try_from(armed.len())?;
        let at = plan.va + OOL_OFFSET + slot * OOL_SLOT;
        let code = match relocated_entry(addr, original, at) {
            Ok(code) => code,
            Err(e) => {
                tracing::warn!("{} skipped: {e}", point.name);
                continue;
            }
        };
        if OOL_OFFSET + (slot + 1) * OOL_SLOT > plan.size {
            bail!(
                "too many probe points for a {} MiB patch heap",
                plan.size >> 20
            );
        }
        let copy_phys = plan.phys + OOL_OFFSET + slot * OOL_SLOT;
        att.machine.write_phys(copy_phys, &code)?;
        att.machine.set_breakpoint(addr, true)?;
        let function = image
            .symbols
            .lookup_addr(link)
            .map_or_else(String::new, |(s, _)| s.name.clone());
        let params = point
            .variables
            .iter()
            .filter_map(|v| v.strip_prefix('$'))
            .map(|v| v.split(':').next().unwrap_or(v).to_owned())
            .collect();
        armed.insert(
            addr,
            ArmedPoint {
                probe,
                name: point.name.clone(),
                function,
                original,
                resume_at: at,
                copy_phys,
                params,
            },
        );
    }
    if armed.is_empty() {
        bail!("none of the script's kernel probe points could be armed");
    }
    tracing::info!("armed {} probe points", armed.len());
    Ok(armed)
}

fn registers(machine: &mut GdbMachine, vcpu: VcpuId) -> anyhow::Result<X86Registers> {
    match machine.registers(vcpu)? {
        RegisterFile::X86_64(r) => Ok(r),
        RegisterFile::Sparc64(_) => bail!("{vcpu} is not x86-64"),
    }
}

/// Attaches, arms the script and starts the tracer thread, which runs the begin probes, then
/// every hit, timers, and finally the end probes once the guest powers off, the script calls
/// `exit()`, or Ctrl-C. The thread returns the script's exit code.
///
/// # Errors
/// When attaching or arming fails (the guest is then detached).
pub fn start(
    target: &attach::TargetArgs,
    image: &KernelImage,
    heap: (u64, u64),
    script: GuestScript,
) -> anyhow::Result<JoinHandle<i32>> {
    let mut att = attach::attach(target)?;
    let survey = attach::survey(&mut att, image)?;
    let btf = Btf::from_elf(image.vmlinux.bytes()).ok();
    let tasks = attach::task_offsets(image).ok();
    let armed = match arm(&mut att, &survey, image, btf.as_ref(), &script.prog, heap) {
        Ok(armed) => armed,
        Err(e) => {
            let _ = att.machine.detach();
            return Err(e);
        }
    };
    std::thread::Builder::new()
        .name("exotap-tracer".into())
        .spawn(move || trace(att.machine, &survey, tasks, armed, script))
        .context("cannot start the tracer thread")
}

fn trace(
    mut machine: GdbMachine,
    survey: &Survey,
    tasks: Option<TaskOffsets>,
    mut armed: HashMap<u64, ArmedPoint>,
    script: GuestScript,
) -> i32 {
    let GuestScript {
        source,
        prog,
        limits,
        format,
        out,
        stop,
    } = script;
    let output = Output::new(format, Box::new(out), Box::new(std::io::stderr()));
    let mut session = Session::new(&prog, limits, output, &source.name, &source.text);
    session.begin();
    let start = Instant::now();
    let mut timers: Vec<(usize, String, Duration, Instant)> = Vec::new();
    for (i, p) in prog.probes.iter().enumerate() {
        for (pt, kind) in &p.points {
            if let PointKind::Timer { period_ns } = kind {
                let period = Duration::from_nanos(*period_ns);
                timers.push((i, pt.to_string(), period, start + period));
            }
        }
    }
    let host = exotap_probes::lang::context::CapturedContext {
        execname: "exotap".into(),
        ..Default::default()
    };
    let mut hits = 0u64;
    let mut gone = false;
    if let Err(e) = machine.resume() {
        tracing::error!("cannot resume the guest: {e}");
        gone = true;
    }
    while !gone && !session.stopping() && !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        for timer in timers.iter_mut().filter(|t| t.3 <= now) {
            session.fire(timer.0, &timer.1, &host);
            timer.3 += timer.2;
        }
        let event = match machine.wait_event(POLL) {
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
            Some(StopEvent::Breakpoint { vcpu, pc }) => match armed.get_mut(&pc) {
                Some(point) => {
                    hits += 1;
                    hit(&mut machine, &mut session, vcpu, point, survey, tasks)
                }
                None => machine.resume().map_err(Into::into),
            },
            Some(_) => machine.resume().map_err(Into::into),
        };
        if let Err(e) = step {
            tracing::error!("tracing stopped: {e:#}");
            break;
        }
    }
    tracing::info!("{hits} probe hits handled by the host");
    if !gone {
        // Detaching removes the breakpoints; the guest runs on.
        let _ = machine.pause();
        if let Err(e) = machine.detach() {
            tracing::warn!("detaching failed: {e}");
        }
    }
    session.finish()
}

fn hit(
    machine: &mut GdbMachine,
    session: &mut Session<'_>,
    vcpu: VcpuId,
    point: &mut ArmedPoint,
    survey: &Survey,
    tasks: Option<TaskOffsets>,
) -> anyhow::Result<()> {
    let regs = registers(machine, vcpu)?;
    point.refresh(machine, vcpu, regs.rip)?;
    {
        let ctx = LiveContext {
            machine: RefCell::new(&mut *machine),
            vcpu,
            regs,
            point,
            survey,
            tasks,
            task: OnceCell::new(),
        };
        session.fire(point.probe, &point.name, &ctx);
    }
    machine.set_pc(vcpu, point.resume_at)?;
    machine.resume()?;
    Ok(())
}
