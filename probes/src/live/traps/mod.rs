//! Host-evaluated probes at breakpoints (DESIGN.md, key mechanism 4): the probes of a script
//! that run on the host, at one stop of the guest per hit.
//!
//! Each point gets a gdbstub software breakpoint (QEMU keeps it outside guest memory). On a
//! hit the host runs the probe body on a `LiveContext` (registers, arguments named by BTF,
//! member chains typed by BTF, the current task, kernel memory), then gets the vCPU past the
//! probed instruction with the breakpoint still in place: relative branches, calls and
//! returns are emulated by the host, anything else resumes through an out-of-line copy in the
//! patch heap followed by a jump back ([`super::trap_point`]). No step is needed and no hit
//! on another vCPU is missed while one resumes.
//!
//! Points are any instruction boundary of a kernel function (`kernel.statement(ADDR)
//! .absolute`, `kernel.statement("func+OFFSET")`, entries), checked by decoding the function
//! from its start with the live bytes. The instruction is read again at every hit and its
//! action remade when the guest changed it: an entry is the ftrace nop5 or, while the guest's
//! own ftrace uses it, a `call`; static keys flip jumps. The trap machinery keeps to heap
//! offsets below 1 MiB (return trampoline at +0x8000, 32-byte out-of-line slots from
//! +0x10000); splice patches use the rest.
//!
//! `.return` probes work as kretprobes do: at the entry hit the return address on
//! the stack is swapped for a trampoline in the patch heap that carries a breakpoint; its hit
//! runs the return probes (`$return` is rax) and resumes at the original return address.
//! [`Traps::disarm`] puts back every swapped return address still on a stack, so calls in
//! flight return normally. While swapped, a stack unwind inside the guest sees the
//! trampoline's address. `timer.profile` and source-level points are refused with the reason.

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context as _};
use exotap_introspect::btf::Btf;
use exotap_introspect::layout::TaskOffsets;
use exotap_introspect::paging::{pti_kernel_cr3, AddressSpace};
use exotap_vmm::control::{Machine, RegisterFile, VcpuId, X86Registers};

use crate::compile::globals::{spec_of, KernelGlobals};
use crate::compile::locals::{Local, Locals};
use crate::compile::types::{
    cast_address_chain, cast_defined, chain_base, chain_defined, target_chain, BtfTypes, ChainBase,
    KernelTypes, Step,
};
use crate::lang::ast::{CastExpr, TargetVar};
use crate::lang::check::Program;
use crate::lang::context::{Context, MemoryError};
use crate::lang::kernel_points::KernelSymbols;
use crate::lang::point::PointKind;
use crate::lang::resolve::resolve_program;
use crate::lang::runtime::Session;
use crate::lang::value::Value;

use super::attach::{self, Survey};
use super::guest_memory::{read_kernel, BackendMemory};
use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::tracepoints::{
    tracepoint_callback, tracepoint_name, tracepoints_on, TRACEPOINT_ITERATOR,
};
use super::trap_point::{decode_at, plan as plan_trap, Effect, TrapAction};

/// Names of [`X86Registers::gpr`], for the writes.
const GPR_NAMES: [&str; 16] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15",
];

mod context;
mod removal;
mod returns;
mod text;
mod watches;

use text::{plan_point, TextMap};

use context::LiveContext;
use returns::{Call, Entry, Ledger, Return};

/// Where the out-of-line entry copies start inside the patch heap, and their spacing.
const OOL_OFFSET: u64 = 0x10000;
const OOL_SLOT: u64 = 32;
/// The trap machinery keeps below this heap offset (splice patches live above it).
pub const OOL_END: u64 = 0x10_0000;
/// The most bytes of one function decoded to check a boundary.
const MAX_FUNCTION: u64 = 1 << 20;
/// SysV argument registers, as indices into [`X86Registers::gpr`] (rdi rsi rdx rcx r8 r9).
const ARG_REGS: [usize; 6] = [5, 4, 3, 2, 8, 9];
/// The return trampoline inside the patch heap.
const TRAMPOLINE_OFFSET: u64 = 0x8000;
/// The return trampoline's code while exotap is attached: `jmp .` (see [`arm`]).
const PARKED: [u8; 2] = [0xeb, 0xfe];
/// Its code once the return addresses are back: `ud2`.
const LOUD: [u8; 2] = [0x0f, 0x0b];
/// How often the stops look at every vCPU for one parked at the return trampoline.
const PARKED_LOOK: std::time::Duration = std::time::Duration::from_millis(100);

/// One probe of a site: its index in the program and how the point is named.
#[derive(Debug, Clone)]
struct SiteProbe {
    probe: usize,
    name: String,
    /// A tracepoint probe at its event's callback, which the events of its class share:
    /// the `__data` (first argument) of this event's calls ([`tracepoint_callback`]).
    guard: Option<u64>,
}

/// One breakpoint at an instruction boundary and what it runs.
#[derive(Debug, Clone)]
struct ArmedPoint {
    /// Probes run at the point.
    entry: Vec<SiteProbe>,
    /// Probes run when the call returns (function entries only).
    ret: Vec<SiteProbe>,
    /// Name used in errors.
    name: String,
    function: String,
    /// The instruction bytes (and what follows, up to [`MAX_INSN`]) the action was made from.
    window: Vec<u8>,
    /// How a hit gets past the instruction.
    action: TrapAction,
    /// The point's out-of-line slot: virtual (where the vCPU resumes) and physical (where
    /// the copy is written).
    slot: u64,
    slot_phys: u64,
    params: Vec<String>,
    /// Target variables by their DWARF location here ([`super::target_vars`]).
    locals: Option<Arc<Locals>>,
}

impl ArmedPoint {
    /// A point whose probes run at stops that are not at a breakpoint (a `timer.profile`
    /// sample, a watchpoint's access): named, with no instruction to get past.
    fn stopless(name: String, function: String) -> Self {
        Self {
            entry: Vec::new(),
            ret: Vec::new(),
            name,
            function,
            window: Vec::new(),
            // Never carried out: the vCPU goes on from where it stopped.
            action: TrapAction::OutOfLine {
                code: Vec::new(),
                rip_relative: false,
            },
            slot: 0,
            slot_phys: 0,
            params: Vec::new(),
            locals: None,
        }
    }

    /// Remakes the action when the guest changed the instruction since it was made (its own
    /// ftrace turns an entry nop5 into a call and back, static keys flip jumps): the hit
    /// must do what is there now. Patching keeps lengths, so the point stays a boundary.
    fn refresh(
        &mut self,
        machine: &mut dyn Machine,
        vcpu: VcpuId,
        addr: u64,
    ) -> anyhow::Result<()> {
        let mut now = vec![0u8; self.window.len()];
        machine.read_virt(vcpu, addr, &mut now)?;
        if now != self.window {
            let instr = decode_at(&self.function, &now, addr)
                .with_context(|| format!("the guest changed {}", self.name))?;
            let action = plan_trap(&instr, &now, self.slot)
                .with_context(|| format!("the guest changed {}", self.name))?;
            if let TrapAction::OutOfLine { code, .. } = &action {
                machine.write_phys(self.slot_phys, code)?;
            }
            tracing::debug!("{}: now {instr}, action remade", self.name);
            self.window = now;
            self.action = action;
        }
        Ok(())
    }
}

/// Where a `task_struct` keeps what `pid()`, `ppid()` and `uid()` answer, from BTF.
#[derive(Debug, Clone, Copy)]
struct TaskIds {
    /// `tgid` (an `i32`): the process id.
    tgid: u64,
    /// `real_parent` (a task pointer).
    real_parent: u64,
    /// `cred` (a pointer to `struct cred`).
    cred: u64,
    /// `uid` in `struct cred` (a `kuid_t`, its `val` first).
    uid: u64,
}

impl TaskIds {
    fn from_btf(btf: &Btf) -> Option<Self> {
        let off = |s: &str, m: &str| btf.struct_member(s, m).ok()?.byte_offset();
        Some(Self {
            tgid: off("task_struct", "tgid")?,
            real_parent: off("task_struct", "real_parent")?,
            cred: off("task_struct", "cred")?,
            uid: off("cred", "uid")?,
        })
    }
}

/// How often [`Traps::sample`] runs the `timer.profile` probes: every vCPU this many times a
/// second. SystemTap's fire at the kernel's HZ (250 on Debian) on every CPU; each sample here
/// stops the whole guest, so the host samples less often.
pub const PROFILE_HZ: u32 = 100;

/// Resolves the script's kernel points, checks each is an instruction boundary that can be
/// trapped, writes the out-of-line copies into the patch heap and sets the breakpoints (and
/// the return trampoline's). Returns the armed sites by (slid) address and the trampoline's
/// address.
fn arm(
    att: &mut GuestSession,
    image: &KernelImage,
    btf: Option<&Btf>,
    prog: &Program,
    area: TrapArea,
    host: &dyn Fn(usize) -> bool,
) -> anyhow::Result<(HashMap<u64, ArmedPoint>, u64)> {
    let survey = att.survey.clone();
    let survey = &survey;
    let lines = super::target_vars::source_lines(image);
    let resolver = KernelSymbols::new(&image.symbols, btf).with_lines(lines.as_ref());
    let resolved = resolve_program(prog, &resolver)?;
    tracepoints_on(
        att,
        image,
        btf,
        resolved
            .iter()
            .filter(|(probe, _)| host(*probe))
            .filter_map(|(_, point)| tracepoint_name(&point.name)),
    )?;
    let (locals, left_out) = super::target_vars::point_locals(image, prog, &resolved)?;
    let resolved: Vec<_> = resolved
        .into_iter()
        .filter(|(probe, p)| !p.address.is_some_and(|a| left_out.contains(&(*probe, a))))
        .collect();
    let plan = area;
    let text = TextMap::new(image);
    let mut armed: HashMap<u64, ArmedPoint> = HashMap::new();
    let mut refused: Vec<String> = Vec::new();
    let slide = survey.kaslr.slide;
    let trampoline = plan.va + TRAMPOLINE_OFFSET;
    let mut needs_trampoline = false;
    let slots = (OOL_END.min(plan.size) - OOL_OFFSET) / OOL_SLOT;
    let mut callbacks: HashMap<String, Option<(u64, u64)>> = HashMap::new();
    for (probe, point) in resolved {
        let Some(point_link) = point.address else {
            if host(probe) && is_module_point(&point.name) {
                bail!(
                    "{}: probes in kernel modules run compiled only (the host path places its \
                     breakpoints from the image's symbols, which have none of a module's)",
                    point.name
                );
            }
            continue; // begin, end, timers: the host runs those
        };
        if !host(probe) {
            continue; // compiled into the guest
        }
        let tracepoint = tracepoint_name(&point.name);
        let callback = match tracepoint {
            Some(name) => match callbacks.get(name) {
                Some(c) => *c,
                None => {
                    let c = tracepoint_callback(att, image, btf, name)?;
                    callbacks.insert(name.to_owned(), c);
                    c
                }
            },
            None => None,
        };
        let (link, guard) = match callback {
            Some((callback, data)) => (callback, Some(data)),
            None => (point_link, None),
        };
        let addr = link.wrapping_add(slide);
        let is_return = point.name.ends_with(".return");
        let probe = SiteProbe {
            probe,
            name: point.name.clone(),
            guard,
        };
        if let Some(site) = armed.get_mut(&addr) {
            needs_trampoline |= is_return;
            if is_return {
                site.ret.push(probe);
            } else {
                site.entry.push(probe);
            }
            continue;
        }
        let slot_index = u64::try_from(armed.len())?;
        if slot_index >= slots {
            bail!("too many probe points: the patch heap has {slots} out-of-line slots for traps");
        }
        let slot = plan.va + OOL_OFFSET + slot_index * OOL_SLOT;
        let slot_phys = plan.phys + OOL_OFFSET + slot_index * OOL_SLOT;
        let planned = plan_point(&mut att.machine, &text, slide, link, slot).and_then(
            |(function, window, action)| {
                if is_return && text.function(link).is_none_or(|f| f.1 != link) {
                    bail!("a return probe needs a function entry");
                }
                if let TrapAction::OutOfLine { code, .. } = &action {
                    if code.len() as u64 > OOL_SLOT {
                        bail!(
                            "its out-of-line copy takes {} bytes, more than a {OOL_SLOT}-byte slot",
                            code.len()
                        );
                    }
                    att.machine.write_phys(slot_phys, code)?;
                }
                Ok((function, window, action))
            },
        );
        let (function, window, action) = match planned {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("{} refused: {e:#}", point.name);
                refused.push(format!("{}: {e:#}", point.name));
                continue;
            }
        };
        att.machine.set_breakpoint(addr, true)?;
        // A tracepoint's point is its iterator `__traceiter_NAME(void *__data, ARGS)`, whose
        // variables leave out `__data`: the arguments start at the second register.
        let data = tracepoint_name(&point.name).map(|_| String::new());
        let params = data
            .into_iter()
            .chain(super::target_vars::btf_params(&point))
            .collect();
        let point_locals = locals.get(&(probe.probe, point_link)).cloned();
        // A tracepoint's probe runs in its callback, but its variables and probefunc() are
        // the tracepoint's (its iterator's).
        let function = match tracepoint {
            Some(name) => format!("{TRACEPOINT_ITERATOR}{name}"),
            None => function,
        };
        needs_trampoline |= is_return;
        let (entry, ret) = if is_return {
            (Vec::new(), vec![probe])
        } else {
            (vec![probe], Vec::new())
        };
        armed.insert(
            addr,
            ArmedPoint {
                entry,
                ret,
                name: point.name.clone(),
                function,
                window,
                action,
                slot,
                slot_phys,
                params,
                locals: point_locals,
            },
        );
    }
    if armed.is_empty() && !refused.is_empty() {
        bail!(
            "none of the script's kernel probe points could be armed:\n  {}",
            refused.join("\n  ")
        );
    }
    if needs_trampoline {
        // Never executed while exotap is attached: the breakpoint stops a vCPU there first.
        // Should a stop be missed all the same, `jmp .` parks the vCPU there instead of
        // running on, where the next look at every vCPU ([`Traps::hit_in`], the removal)
        // finds it and sends it on to its caller; the removal puts `ud2` back, so that a
        // return address left swapped after the detach is a loud oops, never a hang.
        // Journaled first: a guardian moves a vCPU stopped there to its return address if
        // exotap dies.
        super::recover::Journal {
            heap_phys: plan.phys,
        }
        .set_trampoline(&mut att.machine, trampoline)?;
        att.machine
            .write_phys(plan.phys + TRAMPOLINE_OFFSET, &PARKED)?;
        att.machine.set_breakpoint(trampoline, true)?;
    }
    let mut kinds: Vec<(&str, usize)> = Vec::new();
    for site in armed.values() {
        let kind = site.action.kind();
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => kinds.push((kind, 1)),
        }
    }
    kinds.sort_unstable();
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    tracing::info!(
        "armed {} probe sites ({}), refused {}",
        armed.len(),
        kinds.join(", "),
        refused.len()
    );
    Ok((armed, trampoline))
}

/// Reads kernel memory at `at`: vCPU 0's own view first (one request); when it stopped in
/// user mode under PTI that view lacks most kernel text and data, and the kernel's page
/// tables are walked instead.
pub(super) fn read_guest(machine: &mut dyn Machine, at: u64, buf: &mut [u8]) -> anyhow::Result<()> {
    machine
        .read_virt(VcpuId(0), at, buf)
        .map_err(anyhow::Error::from)
        .or_else(|_| read_kernel(machine, at, buf))
}

fn registers(machine: &mut dyn Machine, vcpu: VcpuId) -> anyhow::Result<X86Registers> {
    match machine.registers(vcpu)? {
        RegisterFile::X86_64(r) => Ok(r),
        RegisterFile::Sparc64(_) => bail!("{vcpu} is not x86-64"),
    }
}

/// The trap part of the patch heap: below the splice engine's region.
#[derive(Debug, Clone, Copy)]
pub struct TrapArea {
    /// Virtual address of the heap's start.
    pub va: u64,
    /// Its guest-physical address.
    pub phys: u64,
    /// Bytes mapped.
    pub size: u64,
}

/// The sessions a hit's probes run in: `main`, the script's, and in check mode
/// (`--compile check`) a `shadow` that runs every kernel probe on the host over globals of
/// its own, the reference the compiled probes' results are compared with at the end.
pub struct HitSessions<'s, 'p> {
    /// The script's session.
    pub main: &'s mut Session<'p>,
    /// Check mode's shadow, and the probes compiled into the guest, which the main
    /// session does not run (their compiled bodies do).
    pub shadow: Option<(&'s mut Session<'p>, &'s std::collections::BTreeSet<usize>)>,
}

impl std::fmt::Debug for HitSessions<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HitSessions")
            .field("shadow", &self.shadow.is_some())
            .finish_non_exhaustive()
    }
}

impl HitSessions<'_, '_> {
    /// Fires probe `probe` in the main session, unless it is compiled.
    fn fire_main(&mut self, probe: usize, name: &str, ctx: &dyn Context) {
        if !self
            .shadow
            .as_ref()
            .is_some_and(|(_, compiled)| compiled.contains(&probe))
        {
            self.main.fire(probe, name, ctx);
        }
    }

    /// Fires probe `probe` in the shadow, if there is one.
    fn fire_shadow(&mut self, probe: usize, name: &str, ctx: &dyn Context) {
        if let Some((shadow, _)) = self.shadow.as_mut() {
            shadow.fire(probe, name, ctx);
        }
    }
}

/// The host-evaluated probes of a script: breakpoints at their points, the return
/// trampoline, and the return addresses swapped while calls are in flight.
pub struct Traps {
    tasks: Option<TaskOffsets>,
    ids: Option<TaskIds>,
    stacks: Option<super::stacks::KernelStacks>,
    /// The script unwinds or names kernel code: each stop checks the guest's module list
    /// for modules loaded since (their frames and names).
    watch_modules: bool,
    task_layout: Option<super::stacks::TaskLayout>,
    /// The kernel's types, for member chains and `@cast`.
    types: Option<BtfTypes>,
    /// The kernel globals the script reads (`@var`), link-time.
    globals: KernelGlobals,
    /// Link-time address of `jiffies_64`, for `jiffies()`.
    jiffies: Option<u64>,
    armed: HashMap<u64, ArmedPoint>,
    trampoline: u64,
    /// The calls in flight whose return addresses are swapped, by stack slot.
    pending: Ledger,
    /// The recovery journal, where every swap is written before it is made (so that a
    /// guardian or `exotap recover` can put it back if exotap dies).
    journal: super::recover::Journal,
    /// `timer.profile` probes the host runs on every vCPU at each sample ([`Traps::sample`]).
    profile: Vec<SiteProbe>,
    /// The point those probes' contexts name.
    profile_point: ArmedPoint,
    /// When the stops last looked for a vCPU parked at the return trampoline.
    parked_look: std::time::Instant,
    /// Returns handled for a vCPU found at the trampoline with no stop reported there.
    unreported_returns: u64,
    /// `kernel.data` probes' watchpoints ([`watches`]).
    watches: Vec<watches::Watch>,
}

impl std::fmt::Debug for Traps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Traps")
            .field("armed", &self.armed.len())
            .field("trampoline", &format_args!("{:#x}", self.trampoline))
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl Traps {
    /// Arms the kernel points of the probes `host` picks: checks each is an instruction
    /// boundary that can be trapped, writes the out-of-line copies into `area` and sets the
    /// breakpoints (the guest paused). Points that cannot be trapped are refused with a
    /// warning.
    ///
    /// # Errors
    /// When guest memory cannot be read or written, or no point could be armed.
    pub fn arm(
        guest: &mut GuestSession,
        image: &KernelImage,
        prog: &Program,
        area: TrapArea,
        host: &dyn Fn(usize) -> bool,
    ) -> anyhow::Result<Self> {
        let btf = image.btf().ok();
        let tasks = attach::task_offsets(image).ok();
        let stacks = super::stacks::KernelStacks::load_for(image, guest, btf)
            .map_err(|e| tracing::warn!("backtrace() will be empty: {e:#}"))
            .ok();
        let task_layout = btf.and_then(|btf| {
            super::stacks::TaskLayout::from_btf(btf)
                .map_err(|e| tracing::warn!("task_backtrace() will be empty: {e:#}"))
                .ok()
        });
        let globals = super::target_vars::kernel_globals(image, prog, btf)?;
        let (armed, trampoline) = arm(guest, image, btf, prog, area, host)?;
        let watches = watches::arm(guest, image, prog, host)?;
        Ok(Self {
            watches,
            globals,
            jiffies: image.symbols.get("jiffies_64").map(|s| s.addr),
            tasks,
            ids: btf.and_then(TaskIds::from_btf),
            stacks,
            watch_modules: crate::compile::snapshot::names_kernel_code(prog),
            task_layout,
            types: btf.cloned().map(BtfTypes),
            armed,
            trampoline,
            pending: Ledger::new(super::recover::RETURN_SLOTS),
            journal: super::recover::Journal {
                heap_phys: area.phys,
            },
            profile: prog
                .probes
                .iter()
                .enumerate()
                .filter(|(i, _)| host(*i))
                .flat_map(|(i, p)| p.points.iter().map(move |pt| (i, pt)))
                .filter(|(_, (_, kind))| matches!(kind, PointKind::TimerProfile))
                .map(|(probe, (pt, _))| SiteProbe {
                    probe,
                    name: pt.to_string(),
                    guard: None,
                })
                .collect(),
            profile_point: ArmedPoint::stopless("timer.profile".into(), String::new()),
            parked_look: std::time::Instant::now(),
            unreported_returns: 0,
        })
    }

    /// Reads the guest's module list again where modules came or went since (the guest
    /// stopped), when the script unwinds or names kernel code.
    fn know_new_modules(&mut self, guest: &mut GuestSession) {
        if let (true, Some(stacks)) = (self.watch_modules, self.stacks.as_mut()) {
            let mut mem = BackendMemory(&mut *guest.machine);
            stacks.refresh_modules_if_changed(&mut guest.survey.space(&mut mem));
        }
    }

    /// Whether the script has `timer.profile` probes for [`Traps::sample`].
    pub fn profiles(&self) -> bool {
        !self.profile.is_empty()
    }

    /// One `timer.profile` tick: stops the guest, runs the `timer.profile` probes once for
    /// every vCPU in the context it was stopped in (`addr()` its pc, `user_mode()` its
    /// privilege, the current task its task), and lets it run on. SystemTap's fires on each
    /// CPU's profiling timer interrupt at the kernel's HZ; from outside, the host samples
    /// every vCPU at a rate of its choosing ([`PROFILE_HZ`]).
    ///
    /// # Errors
    /// When the guest cannot be stopped, read or resumed.
    pub fn sample(
        &mut self,
        guest: &mut GuestSession,
        session: &mut Session<'_>,
    ) -> anyhow::Result<()> {
        guest.machine.pause()?;
        self.know_new_modules(guest);
        let machine = &mut guest.machine;
        for vcpu in machine.vcpus()? {
            let regs = registers(machine, vcpu)?;
            let ctx = self.context_at(
                &self.profile_point,
                machine,
                &guest.survey,
                vcpu,
                regs,
                None,
                &[],
            );
            for p in &self.profile {
                session.fire(p.probe, &p.name, &ctx);
            }
        }
        machine.resume()?;
        Ok(())
    }

    /// Names kernel pcs for the whole script session (`sprint_stack()` in `end` probes);
    /// `None` without the ORC tables and symbols.
    pub fn kernel_symbols(&self) -> Option<crate::lang::eval::KernelSymbols> {
        self.stacks
            .as_ref()
            .map(super::stacks::KernelStacks::symbol_lookup)
    }

    /// The kernel's types, for the script's begin, end and timer probes
    /// ([`super::host_context::HostContext`]).
    pub(crate) fn kernel_types(&self) -> Option<Arc<dyn KernelTypes>> {
        self.types
            .as_ref()
            .map(|t| Arc::new(BtfTypes(t.0.clone())) as Arc<dyn KernelTypes>)
    }

    /// Whether a stop at `pc` is one of these traps'.
    pub fn owns(&self, pc: u64) -> bool {
        pc == self.trampoline || self.armed.contains_key(&pc)
    }

    /// Whether a hit at armed point `pc` fires only probes of `probes` (and swaps no return
    /// address): in check mode, a point whose probes are all compiled runs in the shadow
    /// alone, so the script's own globals need no round trip through the guest for it.
    pub fn fires_only(&self, pc: u64, probes: &std::collections::BTreeSet<usize>) -> bool {
        self.armed.get(&pc).is_some_and(|site| {
            site.ret.is_empty() && site.entry.iter().all(|p| probes.contains(&p.probe))
        })
    }

    /// The return trampoline's address.
    pub fn trampoline(&self) -> u64 {
        self.trampoline
    }

    /// Where a hit at armed point `pc` resumes when it resumes through the point's
    /// out-of-line copy (`None`: the host emulates the instruction there, or no point).
    pub fn out_of_line(&self, pc: u64) -> Option<u64> {
        let site = self.armed.get(&pc)?;
        matches!(site.action, TrapAction::OutOfLine { .. }).then_some(site.slot)
    }

    /// How many points are armed.
    pub fn points(&self) -> usize {
        self.armed.len()
    }

    #[allow(clippy::too_many_arguments)]
    fn context<'a>(
        &'a self,
        machine: &'a mut dyn Machine,
        survey: &'a Survey,
        vcpu: VcpuId,
        regs: X86Registers,
        site: u64,
        at_return: Option<(X86Registers, u64)>,
        entry_values: &'a [(usize, Result<Value, String>)],
    ) -> Option<LiveContext<'a>> {
        let point = self.armed.get(&site)?;
        Some(self.context_at(point, machine, survey, vcpu, regs, at_return, entry_values))
    }

    #[allow(clippy::too_many_arguments)]
    fn context_at<'a>(
        &'a self,
        point: &'a ArmedPoint,
        machine: &'a mut dyn Machine,
        survey: &'a Survey,
        vcpu: VcpuId,
        regs: X86Registers,
        at_return: Option<(X86Registers, u64)>,
        entry_values: &'a [(usize, Result<Value, String>)],
    ) -> LiveContext<'a> {
        LiveContext {
            machine: RefCell::new(machine),
            vcpu,
            regs,
            point,
            survey,
            tasks: self.tasks,
            ids: self.ids,
            task: OnceCell::new(),
            stacks: self.stacks.as_ref(),
            task_layout: self.task_layout,
            at_return,
            entry_values,
            types: self.types.as_ref(),
            globals: &self.globals,
            jiffies: self.jiffies,
            writes: RefCell::new(Vec::new()),
        }
    }

    /// A hit at an armed point `pc`: runs its probes on `session` and moves the vCPU past
    /// the instruction (or to the return trampoline's caller); the caller resumes.
    ///
    /// # Errors
    /// When the vCPU's registers or memory cannot be read or written.
    pub fn hit(
        &mut self,
        guest: &mut GuestSession,
        session: &mut Session<'_>,
        vcpu: VcpuId,
        pc: u64,
    ) -> anyhow::Result<()> {
        let mut sessions = HitSessions {
            main: session,
            shadow: None,
        };
        self.hit_in(guest, &mut sessions, vcpu, pc)
    }

    /// [`Traps::hit`], the probes running in `sessions` (check mode's shadow too).
    ///
    /// # Errors
    /// As [`Traps::hit`].
    pub fn hit_in(
        &mut self,
        guest: &mut GuestSession,
        sessions: &mut HitSessions<'_, '_>,
        vcpu: VcpuId,
        pc: u64,
    ) -> anyhow::Result<()> {
        if pc == self.trampoline {
            self.returned(guest, sessions, vcpu)?;
        } else {
            self.entered(guest, sessions, vcpu, pc)?;
        }
        if self.parked_look.elapsed() >= PARKED_LOOK && !self.pending.is_empty() {
            self.parked_look = std::time::Instant::now();
            self.send_on_parked(guest, sessions, vcpu)?;
        }
        Ok(())
    }

    fn entered(
        &mut self,
        guest: &mut GuestSession,
        sessions: &mut HitSessions<'_, '_>,
        vcpu: VcpuId,
        pc: u64,
    ) -> anyhow::Result<()> {
        if !self.armed.contains_key(&pc) {
            return Ok(());
        }
        self.know_new_modules(guest);
        let machine = &mut guest.machine;
        let survey = &guest.survey;
        let mut regs = registers(machine, vcpu)?;
        let Some(site) = self.armed.get_mut(&pc) else {
            return Ok(());
        };
        site.refresh(machine, vcpu, pc)?;
        let action = site.action.clone();
        let slot_va = site.slot;
        let wants_return = !site.ret.is_empty();
        let mut entry = site.entry.clone();
        // At an event callback the class shares, only this event's calls.
        entry.retain(|p| p.guard.is_none_or(|g| g == regs.gpr[5]));
        let site_ret = site.ret.clone();
        let mut writes = Vec::new();
        let mut entry_values = Vec::new();
        if let Some(ctx) = self.context(machine, survey, vcpu, regs, pc, None, &[]) {
            for p in &entry {
                sessions.fire_main(p.probe, &p.name, &ctx);
            }
            // The implicit entry side of the return probes' `@entry(...)` (as stap's): their
            // expressions as they are now, kept with this call's swapped return address.
            if wants_return {
                for r in &site_ret {
                    entry_values.extend(sessions.main.entry_values(r.probe, &r.name, &ctx));
                }
            }
            writes = ctx.writes.take();
            for p in &entry {
                sessions.fire_shadow(p.probe, &p.name, &ctx);
            }
            // The shadow's guru writes: the compiled code (or the main session) made them.
            ctx.writes.take();
        }
        // Guru writes of parameters: the function runs with them (and a return probe sees
        // them as the entry's, as compiled).
        for (r, v) in writes {
            machine.set_register(vcpu, GPR_NAMES[r], v)?;
            regs.gpr[r] = v;
        }
        if wants_return {
            self.swap_return(machine, vcpu, pc, regs, entry_values)?;
        }
        match action {
            TrapAction::OutOfLine { .. } => machine.set_pc(vcpu, slot_va)?,
            TrapAction::Emulate(e) => {
                let rsp = regs.gpr[7];
                let top = if matches!(e, super::trap_point::Emulation::Ret { .. }) {
                    let mut b = [0u8; 8];
                    machine.read_virt(vcpu, rsp, &mut b)?;
                    u64::from_le_bytes(b)
                } else {
                    0
                };
                let Effect {
                    rip,
                    rsp: new_rsp,
                    rcx,
                    store,
                } = e.effect(regs.rflags, regs.gpr[2], rsp, top);
                if let Some((at, value)) = store {
                    machine.write_virt(vcpu, at, &value.to_le_bytes())?;
                }
                if let Some(v) = new_rsp {
                    machine.set_register(vcpu, "rsp", v)?;
                }
                if let Some(v) = rcx {
                    machine.set_register(vcpu, "rcx", v)?;
                }
                machine.set_pc(vcpu, rip)?;
            }
        }
        Ok(())
    }

    /// Swaps the return address of the call entering at `site` (rsp points at it) for the
    /// trampoline, journaled first; a tail call stacks on its caller's swap ([`returns`]).
    fn swap_return(
        &mut self,
        machine: &mut dyn Machine,
        vcpu: VcpuId,
        site: u64,
        regs: X86Registers,
        entry_values: Vec<(usize, Result<Value, String>)>,
    ) -> anyhow::Result<()> {
        let slot = regs.gpr[7];
        let mut now = [0u8; 8];
        machine.read_virt(vcpu, slot, &mut now)?;
        let now = u64::from_le_bytes(now);
        let call = Call {
            site,
            entry_regs: regs,
            entry_values,
        };
        let entry = self.pending.enter(slot, now, self.trampoline, call);
        tracing::debug!(
            "{vcpu} entered {site:#x}: return address {now:#x} at {slot:#x}: {entry:?}"
        );
        let stale = match entry {
            Entry::Swap { index, stale } => {
                self.journal.set_return(machine, index, slot, now)?;
                machine.write_virt(vcpu, slot, &self.trampoline.to_le_bytes())?;
                stale
            }
            Entry::Missed { stale } => stale,
            Entry::Chained => Vec::new(),
            Entry::Unaccounted => {
                tracing::error!(
                    "{vcpu} entered {} with its return address at {slot:#x} already swapped for \
                     the trampoline, and exotap has no record of that swap: its return probes \
                     will not run",
                    self.armed.get(&site).map_or("?", |p| p.name.as_str())
                );
                Vec::new()
            }
        };
        for index in stale {
            self.journal.set_return(machine, index, 0, 0)?;
        }
        Ok(())
    }

    fn returned(
        &mut self,
        guest: &mut GuestSession,
        sessions: &mut HitSessions<'_, '_>,
        vcpu: VcpuId,
    ) -> anyhow::Result<()> {
        self.know_new_modules(guest);
        let machine = &mut guest.machine;
        let survey = &guest.survey;
        let mut regs = registers(machine, vcpu)?;
        // `ret` popped the swapped slot: it was just below the stack pointer.
        let slot = regs.gpr[7].wrapping_sub(8);
        let left = self.pending.leave(slot);
        tracing::debug!(
            "{vcpu} returned through {slot:#x}: {}",
            match &left {
                Return::Calls(c) => format!("{} calls, to {:#x}", c.calls.len(), c.original),
                Return::Unaccounted { .. } => "unaccounted".to_owned(),
            }
        );
        let chain = match left {
            Return::Calls(chain) => chain,
            Return::Unaccounted { fallback } => {
                return self.unaccounted_return(machine, survey, vcpu, regs, slot, fallback);
            }
        };
        // The probes see the code where it returned to (the caller, at the original return
        // address), not the trampoline: a stack unwound here starts in the caller.
        regs.rip = chain.original;
        // A tail chain's calls end together, innermost first; each sees the return value the
        // one inside it left (a `$return = v` included).
        for call in chain.calls.iter().rev() {
            let mut writes = Vec::new();
            let ret = self
                .armed
                .get(&call.site)
                .map(|s| s.ret.clone())
                .unwrap_or_default();
            if let Some(ctx) = self.context(
                machine,
                survey,
                vcpu,
                regs,
                call.site,
                Some((call.entry_regs, regs.gpr[0])),
                &call.entry_values,
            ) {
                for r in &ret {
                    sessions.fire_main(r.probe, &r.name, &ctx);
                }
                writes = ctx.writes.take();
                for r in &ret {
                    sessions.fire_shadow(r.probe, &r.name, &ctx);
                }
                ctx.writes.take();
            }
            // `$return = v`, `set_return(v)`: the caller gets it.
            for (r, v) in writes {
                machine.set_register(vcpu, GPR_NAMES[r], v)?;
                regs.gpr[r] = v;
            }
        }
        machine.set_pc(vcpu, chain.original)?;
        self.journal.set_return(machine, chain.index, 0, 0)?;
        Ok(())
    }

    /// A stop at the trampoline that no swap recorded here accounts for: an error, reported
    /// with the task and the slot. The task goes on to the return address the last call
    /// through the same slot went back to (the case of a swap recorded twice); with none, it
    /// stays at the trampoline and the run stops, since resuming would run its `ud2`.
    fn unaccounted_return(
        &self,
        machine: &mut dyn Machine,
        survey: &Survey,
        vcpu: VcpuId,
        regs: X86Registers,
        slot: u64,
        fallback: Option<u64>,
    ) -> anyhow::Result<()> {
        let (pid, comm) = self
            .armed
            .values()
            .next()
            .map(|point| {
                let ctx = self.context_at(point, machine, survey, vcpu, regs, None, &[]);
                (ctx.pid(), ctx.execname())
            })
            .unwrap_or((-1, String::new()));
        let Some(to) = fallback else {
            bail!(
                "{vcpu} (pid {pid}, {comm}) reached the return trampoline with no swapped return \
                 address recorded at {slot:#x}, nor a return through that slot before"
            );
        };
        tracing::error!(
            "{vcpu} (pid {pid}, {comm}) reached the return trampoline with no swapped return \
             address recorded at {slot:#x}: sent to {to:#x}, where the last call through that \
             slot returned"
        );
        machine.set_pc(vcpu, to)?;
        Ok(())
    }
}

/// Whether a resolved point's name is a point in a kernel module (`module("m")...`,
/// `kprobe.module("m")...`), which the live guest places, not the image.
pub(crate) fn is_module_point(name: &str) -> bool {
    name.starts_with("module(") || name.starts_with("kprobe.module(")
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::live::kernel_image::cached_debian_image as image;

    #[test]
    fn task_ids_are_laid_out_from_the_kernels_btf() {
        let Some(image) = image() else {
            eprintln!("SKIP: the Debian kernel is not cached (exotap boot fetches it)");
            return;
        };
        let btf = Btf::from_elf(image.vmlinux.bytes()).unwrap();
        let ids = TaskIds::from_btf(&btf).unwrap();
        let pid = btf
            .struct_member("task_struct", "pid")
            .unwrap()
            .byte_offset();
        // tgid follows pid in struct task_struct; uid comes early in struct cred, right
        // after its usage counter (and the debug fields, where configured).
        assert_eq!(Some(ids.tgid), pid.map(|p| p + 4));
        assert!(ids.real_parent > ids.tgid && ids.cred > ids.real_parent);
        assert!(
            ids.uid >= 4 && ids.uid < 64 && ids.uid.is_multiple_of(4),
            "{}",
            ids.uid
        );
    }
}
