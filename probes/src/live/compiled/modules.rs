//! A compiled script's points in kernel modules, found in the live guest when it attaches:
//! the guest's module list and each module's own symbols (its kallsyms) name the functions;
//! the module's text is read and analysed for the splicer ([`super::super::splicer::ModuleText`])
//! and each function found becomes a compiled point like any kernel function's, at its running
//! address.
//!
//! As in SystemTap, a point whose module is not loaded is pending: it goes in when the module
//! arrives, and out when it goes. The host puts two breakpoints in the kernel:
//! - `do_init_module` (a module formed and on the list, its `COMING` notifiers run, its text
//!   final, its `init` not yet run): the points matching the new module are placed and their
//!   sites installed before any of its code runs;
//! - `jump_label_module_notify`, the first of the module notifiers, called with
//!   `MODULE_STATE_GOING` after the module's `exit` ran (and at a failed load): the module's
//!   splices come out there, before the next notifiers run. They must: the kprobes notifier
//!   disarms a guest kprobe on the module by having ftrace turn its call back into a nop,
//!   and ftrace, finding exotap's `jmp` where it expects its call, declares a bug and turns
//!   itself off for good (seen: every guest kprobe dead after the first unload). Where the
//!   kernel has no such function, `free_module` instead, with a warning.
//!
//! Each module load or unload stops the guest (the notifier, at every state change of every
//! module); no hit does.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use exotap_introspect::orc::{OrcLayout, OrcTable};
use exotap_introspect::symbols::wildcard_match;
use exotap_vmm::control::{Machine, RegisterFile, StopEvent, VcpuId};

use crate::compile::SitePoint;
use crate::live::guest_memory::BackendMemory;
use crate::live::kernel_image::KernelImage;
use crate::live::modules::{read_modules, GuestModule, ModuleLayout};
use crate::live::session::GuestSession;
use crate::live::splicer::{ModuleTables, Splicer};

use super::module_dwarf::{cached_debug_files, ModuleDwarf};
use super::plan::ModulePoint;
use super::Plan;

/// Whether a module symbol named `name` is a function a pattern may name: not the padding
/// before a function (`__pfx_`, `__cfi_`), and, for a wildcard, not a compiler-split part
/// (`f.cold`, `f.part.0`), as SystemTap leaves them out.
pub(super) fn is_function(name: &str, wildcard: bool) -> bool {
    !(name.starts_with("__pfx_") || name.starts_with("__cfi_") || wildcard && name.contains('.'))
}

/// Site points placed in a module, at their link-time addresses (running less the slide).
type Placed = Vec<(u64, SitePoint)>;

/// What the host needs to find a script's module points in the guest's module list.
pub(super) struct ModuleWatch {
    /// Every module point of the script (a module may come, go and come again).
    points: Vec<ModulePoint>,
    /// `do_init_module` and the unload's breakpoint, running addresses; `None` where the
    /// kernel has no `do_init_module` (then modules loaded later are not probed, with a
    /// warning).
    events: Option<(u64, u64)>,
    /// How the unload's breakpoint is read: `Some(GOING)` at `jump_label_module_notify(nb,
    /// state, module)`, where only `state == GOING` is an unload; `None` at
    /// `free_module(module)`.
    going: Option<u64>,
    head: u64,
    layout: ModuleLayout,
    orc: OrcLayout,
    tables: ModuleTables,
    slide: u64,
    /// The text of each module with sites in, by its `struct module`'s address.
    probed: HashMap<u64, (String, Range<u64>)>,
    /// The cached debug files of modules, by module name.
    debug_files: Vec<(String, PathBuf)>,
    /// The DWARF of each probed module whose points read target variables, placed where it
    /// runs, by its `struct module`'s address.
    dwarf: HashMap<u64, Arc<ModuleDwarf>>,
    /// The kernel's BTF with the probed module's: its functions' parameters.
    btf: Option<Arc<exotap_introspect::btf::Btf>>,
    /// Loads and unloads handled, and sites put in and taken out at them.
    pub(super) loads: u64,
    pub(super) unloads: u64,
    pub(super) sites_in: u64,
    pub(super) sites_out: u64,
}

impl std::fmt::Debug for ModuleWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModuleWatch")
            .field("points", &self.points.len())
            .field("events", &self.events)
            .field("probed", &self.probed)
            .finish_non_exhaustive()
    }
}

impl ModuleWatch {
    /// The breakpoints the watch stops at.
    pub(super) fn breakpoints(&self) -> Vec<u64> {
        self.events.map_or_else(Vec::new, |(a, b)| vec![a, b])
    }

    /// Whether a breakpoint at `pc` is the watch's.
    pub(super) fn owns(&self, pc: u64) -> bool {
        self.events.is_some_and(|(a, b)| pc == a || pc == b)
    }

    /// The guest's formed modules.
    fn read(
        &self,
        machine: &mut dyn Machine,
        survey: &crate::live::attach::Survey,
    ) -> anyhow::Result<Vec<GuestModule>> {
        let mut mem = BackendMemory(machine);
        let mut space = survey.space(&mut mem);
        read_modules(&mut space, self.head, &self.layout, self.orc)
            .context("cannot read the guest's module list")
    }

    /// The module's DWARF placed where it runs (read once per load).
    fn dwarf(&mut self, module: &GuestModule) -> Result<Arc<ModuleDwarf>, String> {
        if let Some(d) = self.dwarf.get(&module.address) {
            return Ok(Arc::clone(d));
        }
        let path = self
            .debug_files
            .iter()
            .find(|(n, _)| *n == module.name)
            .map(|(_, p)| p)
            .ok_or_else(|| {
                format!(
                    "the cache holds no debug file of module {}, where its target variables \
                     are described",
                    module.name
                )
            })?;
        let dwarf = ModuleDwarf::live(path, module, self.slide)
            .map(Arc::new)
            .map_err(|e| format!("{e:#}"))?;
        self.dwarf.insert(module.address, Arc::clone(&dwarf));
        Ok(dwarf)
    }

    /// The places `find` names in `module`'s DWARF placed where it runs, as (point name,
    /// function, address): each a statement in its function (no parameters in registers
    /// there; its variables by their DWARF locations, `$object` and `$value` at a member
    /// access), and why each of the others, or all of them, cannot be.
    fn dwarf_points(
        &mut self,
        module: &GuestModule,
        wanted: &ModulePoint,
        find: impl FnOnce(&ModuleDwarf) -> anyhow::Result<Vec<(String, String, u64)>>,
    ) -> (Placed, Vec<String>) {
        let name = &wanted.template.name;
        let dwarf = match self.dwarf(module) {
            Ok(d) => d,
            Err(why) => return (Vec::new(), vec![format!("{name}: {why}")]),
        };
        match find(&dwarf) {
            Ok(found) => dwarf_sites(wanted, &dwarf, found),
            Err(e) => (Vec::new(), vec![format!("{name}: {e:#}")]),
        }
    }

    /// The inlined instances `wanted` names in `module`, each in the function it was inlined
    /// into.
    fn inline_instances(
        &mut self,
        module: &GuestModule,
        wanted: &ModulePoint,
    ) -> (Placed, Vec<String>) {
        let slide = self.slide;
        self.dwarf_points(module, wanted, |dwarf| {
            Ok(dwarf
                .inlined(&wanted.pattern, wanted.file.as_deref())?
                .into_iter()
                .map(|(function, link)| {
                    let point = format!(
                        "module(\"{}\").function(\"{function}\").inline",
                        module.name
                    );
                    let into = module
                        .lookup(link.wrapping_add(slide))
                        .map_or_else(|| function.clone(), |(n, _, _)| n.to_owned());
                    (point, into, link)
                })
                .collect())
        })
    }

    /// The code of the source line `wanted` names in `module`'s functions (or of every line,
    /// `:*`), in each function that has some.
    fn statements(
        &mut self,
        module: &GuestModule,
        wanted: &ModulePoint,
        line: &crate::lang::point::SourceLine,
    ) -> (Placed, Vec<String>) {
        self.dwarf_points(module, wanted, |dwarf| {
            Ok(dwarf
                .statements(&wanted.pattern, line)?
                .into_iter()
                .map(|(function, link, lines)| {
                    let point = super::module_dwarf::statement_name(
                        &module.name,
                        &function,
                        &line.file,
                        lines,
                    );
                    (point, function, link)
                })
                .collect())
        })
    }

    /// The instructions of `module` that access the member `field` names, each in its
    /// function.
    fn member_accesses(
        &mut self,
        module: &GuestModule,
        wanted: &ModulePoint,
        field: &crate::lang::point::MemberAccess,
    ) -> (Placed, Vec<String>) {
        let point = super::module_dwarf::field_name(&module.name, field);
        self.dwarf_points(module, wanted, |dwarf| {
            Ok(dwarf
                .field_accesses(field)?
                .into_iter()
                .map(|(function, link)| (point.clone(), function, link))
                .collect())
        })
    }

    /// The points of the script (all, or the `only`th) in `module`, each function found as a
    /// site point at its running address less the slide, and why each function whose
    /// target variables cannot be read there is left out; reads the module's text for the
    /// splicer first.
    fn place(
        &mut self,
        machine: &mut dyn Machine,
        survey: &crate::live::attach::Survey,
        splicer: &mut Splicer,
        module: &GuestModule,
        only: Option<usize>,
    ) -> anyhow::Result<(Placed, Vec<String>)> {
        let mut found = Vec::new();
        let mut problems = Vec::new();
        let points = self.points.clone();
        for (i, wanted) in points.iter().enumerate() {
            if !wildcard_match(&wanted.module, &module.name) || only.is_some_and(|o| o != i) {
                continue;
            }
            if let Some(field) = &wanted.field {
                let (mut placed, mut why) = self.member_accesses(module, wanted, field);
                found.append(&mut placed);
                problems.append(&mut why);
                continue;
            }
            if let Some(line) = &wanted.statement {
                let (mut placed, mut why) = self.statements(module, wanted, line);
                found.append(&mut placed);
                problems.append(&mut why);
                continue;
            }
            if wanted.site == crate::lang::point::FunctionSite::Inline {
                let (mut placed, mut why) = self.inline_instances(module, wanted);
                found.append(&mut placed);
                problems.append(&mut why);
                continue;
            }
            let wildcard = wanted.pattern.contains(['*', '?', '[']);
            // `f@FILE`: the functions the module's DWARF says FILE defines.
            let in_file = match &wanted.file {
                None => None,
                Some(file) => match self.dwarf(module).and_then(|d| {
                    d.functions_in_file_at(&wanted.pattern, file, wanted.line)
                        .map_err(|e| format!("{e:#}"))
                }) {
                    Ok(names) => Some(names),
                    Err(why) => {
                        problems.push(format!("{}: {why}", wanted.template.name));
                        continue;
                    }
                },
            };
            // One probe per address: an alias (`cleanup_module` of the module's exit
            // function) is the same function.
            let mut seen = std::collections::BTreeSet::new();
            for (name, addr) in module.symbols_in_text() {
                if !is_function(name, wildcard)
                    || !wildcard_match(&wanted.pattern, name)
                    || in_file.as_ref().is_some_and(|names| !names.contains(name))
                    || !seen.insert(addr)
                {
                    continue;
                }
                // `f+OFFSET`: the instruction there (the planner checks it is one).
                let link = addr
                    .wrapping_sub(self.slide)
                    .wrapping_add(wanted.offset.unwrap_or(0));
                let point = match wanted.offset {
                    Some(offset) => super::module_dwarf::offset_name(&module.name, name, offset),
                    None => format!(
                        "module(\"{}\").function(\"{name}\"){}",
                        module.name,
                        wanted.site.suffix()
                    ),
                };
                let locals = match &wanted.vars {
                    None => None,
                    Some(vars) => match self
                        .dwarf(module)
                        .map_err(|why| vec![format!("{point}: {why}")])
                        .and_then(|dwarf| vars.at(&dwarf, &point, link))
                    {
                        Ok(locals) => Some(locals),
                        Err(mut why) => {
                            problems.append(&mut why);
                            continue;
                        }
                    },
                };
                // The parameters are where BTF says at the entry only.
                let params = match (&self.btf, wanted.offset) {
                    (Some(btf), None) => super::module_dwarf::btf_params(btf, name),
                    _ => Vec::new(),
                };
                found.push((
                    link,
                    SitePoint {
                        name: point,
                        function: name.to_owned(),
                        params,
                        locals,
                        ..wanted.template.clone()
                    },
                ));
            }
            // `module("m").function("f")`, a name without wildcards: also f's inlined
            // instances, as SystemTap (and `kernel.function("f")`) has it, where the module's
            // debug file is cached. An instance whose variables are not there is left out.
            if wanted.site == crate::lang::point::FunctionSite::Entry
                && wanted.offset.is_none()
                && !wildcard
                && in_file
                    .as_ref()
                    .is_none_or(|names| names.contains(&wanted.pattern))
                && self.debug_files.iter().any(|(n, _)| *n == module.name)
            {
                let (placed, why) = self.inline_instances(module, wanted);
                for w in why {
                    tracing::warn!("left out: {w}");
                }
                found.extend(placed.into_iter().filter_map(|(link, p)| {
                    // GCC's picture of f's own body inside its out-of-line copy is no place
                    // of its own.
                    let inside = module
                        .lookup(link.wrapping_add(self.slide))
                        .is_some_and(|(n, _, _)| n == wanted.pattern);
                    (!inside && !seen.contains(&link.wrapping_add(self.slide))).then(|| {
                        let name = p.name.trim_end_matches(".inline").to_owned();
                        (link, SitePoint { name, ..p })
                    })
                }));
            }
        }
        if !found.is_empty() {
            if let Some(problem) = &module.problem {
                tracing::warn!("module {}: {problem}", module.name);
            }
            splicer
                .kernel
                .add_module(&mut *machine, survey, module, &self.tables)?;
            self.probed
                .insert(module.address, (module.name.clone(), module.text.clone()));
        }
        Ok((found, problems))
    }

    /// At a watch breakpoint (the guest stopped): a module loading has its points placed
    /// and returned (running addresses) for the caller to install before its code runs; a
    /// module about to be freed has its splices taken out, and its text is returned (for
    /// the caller's breakpoints there). Then the vCPU steps past the breakpoint, which goes
    /// back in.
    ///
    /// # Errors
    /// When guest memory cannot be read or written, or the vCPU cannot step.
    pub(super) fn stopped(
        &mut self,
        session: &mut GuestSession,
        vcpu: VcpuId,
        pc: u64,
    ) -> anyhow::Result<ModuleEvent> {
        let survey = session.survey.clone();
        let (machine, splicer) = session.parts()?;
        let RegisterFile::X86_64(regs) = machine.registers(vcpu)? else {
            anyhow::bail!("module events are watched on x86-64 only");
        };
        // `do_init_module(mod)` and `free_module(mod)` take the module first (rdi), the
        // notifier third (rdx), after the state (rsi); GDB's order: rsi 4, rdi 5, rdx 3.
        let load = Some(pc) == self.events.map(|e| e.0);
        let (module, unload) = match self.going {
            Some(going) if !load => (regs.gpr[3], regs.gpr[4] == going),
            _ => (regs.gpr[5], !load),
        };
        let mut event = ModuleEvent::Other;
        if load {
            self.loads += 1;
            let loaded = self.read(&mut *machine, &survey)?;
            if let Some(m) = loaded.iter().find(|m| m.address == module) {
                let (placed, problems) = self.place(&mut *machine, &survey, splicer, m, None)?;
                for why in problems {
                    tracing::warn!("module {} loaded; left out: {why}", m.name);
                }
                let placed: Vec<(u64, SitePoint)> = placed
                    .into_iter()
                    .map(|(link, p)| (link.wrapping_add(self.slide), p))
                    .collect();
                tracing::info!(
                    "module {} loaded: {} probe points of the script in it",
                    m.name,
                    placed.len()
                );
                event = ModuleEvent::Loaded(placed);
            }
        } else if unload {
            self.dwarf.remove(&module);
            if let Some((name, text)) = self.probed.remove(&module) {
                self.unloads += 1;
                let out = splicer.remove_range(&mut *machine, text.clone())?;
                self.sites_out += out as u64;
                tracing::info!("module {name} unloading: its {out} sites taken out first");
                event = ModuleEvent::Unloading(text);
            }
        }
        // Past the breakpoint: out, one instruction, in again.
        machine.set_breakpoint(pc, false)?;
        let stepped = machine.step(vcpu);
        machine.set_breakpoint(pc, true)?;
        match stepped? {
            StopEvent::Stepped { .. } | StopEvent::Breakpoint { .. } => {}
            other => anyhow::bail!("stepping past {pc:#x} stopped with {other:?}"),
        }
        Ok(event)
    }
}

/// What a stop at the watch's breakpoints was.
#[derive(Debug)]
pub(super) enum ModuleEvent {
    /// A module is loading: the script's points in it (running addresses), to install.
    Loaded(Vec<(u64, SitePoint)>),
    /// A probed module is going: its text, whose splices are out.
    Unloading(Range<u64>),
    /// Another module's state changed.
    Other,
}

/// Finds `plan`'s module points in the live guest (after [`GuestSession::plan`]: the
/// splicer reads each probed module's text) and adds each function found to `plan.points`
/// (at its running address less the slide, as the points of the image are kept). Returns the
/// watch that places them in modules loaded later, and takes them out of modules unloaded.
///
/// # Errors
/// When the module list cannot be read, a probed module's text cannot be read, or a point
/// whose module is loaded finds no function there.
pub(super) fn place_module_points(
    session: &mut GuestSession,
    image: &KernelImage,
    plan: &mut Plan,
) -> anyhow::Result<Option<ModuleWatch>> {
    if plan.modules.is_empty() {
        return Ok(None);
    }
    let survey = session.survey.clone();
    let slide = survey.kaslr.slide;
    let btf = image.btf()?;
    let (head, layout, orc) = list_reader(image, slide)?;
    let going = btf_enum_value(btf, "module_state", "MODULE_STATE_GOING");
    let unload = match (image.symbols.get("jump_label_module_notify"), going) {
        (Some(s), Some(_)) => Some(s.addr),
        _ => {
            tracing::warn!(
                "the kernel has no jump_label_module_notify (or BTF no MODULE_STATE_GOING): \
                 a module's probes come out when it is freed, after its notifiers; a guest \
                 kprobe on its functions may then find exotap's splice and turn off ftrace"
            );
            image.symbols.get("free_module").map(|s| s.addr)
        }
    };
    let events = match (image.symbols.get("do_init_module"), unload) {
        (Some(a), Some(b)) => Some((a.addr.wrapping_add(slide), b.wrapping_add(slide))),
        _ => {
            tracing::warn!(
                "the kernel has no do_init_module or free_module: probes in modules loaded \
                 after the script starts are not placed, and a module unloaded under its \
                 probes is found out only at their removal"
            );
            None
        }
    };
    let going = going.filter(|_| image.symbols.get("jump_label_module_notify").is_some());
    let mut watch = ModuleWatch {
        points: std::mem::take(&mut plan.modules),
        events,
        going,
        head,
        layout,
        orc,
        tables: ModuleTables::from_btf(btf),
        slide,
        probed: HashMap::new(),
        debug_files: cached_debug_files(image),
        dwarf: HashMap::new(),
        btf: plan.module_btf.clone(),
        loads: 0,
        unloads: 0,
        sites_in: 0,
        sites_out: 0,
    };
    let (machine, splicer) = session.parts()?;
    let loaded = watch.read(&mut *machine, &survey)?;
    let points = watch.points.clone();
    for (i, wanted) in points.iter().enumerate() {
        let matching: Vec<&GuestModule> = loaded
            .iter()
            .filter(|m| wildcard_match(&wanted.module, &m.name))
            .collect();
        let mut found = 0usize;
        let mut problems = Vec::new();
        for module in &matching {
            let (placed, mut why) =
                watch.place(&mut *machine, &survey, splicer, module, Some(i))?;
            found += placed.len();
            plan.points.extend(placed);
            problems.append(&mut why);
        }
        if !problems.is_empty() {
            problems.sort();
            problems.dedup();
            return Err(crate::live::target_vars::UnreadableTargets(problems).into());
        }
        if found == 0 && !matching.is_empty() && !wanted.optional {
            anyhow::bail!(
                "no match for probe point '{}': no function of module {} matches '{}'",
                wanted.template.name,
                matching
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                wanted.pattern
            );
        }
        if matching.is_empty() {
            let names: Vec<&str> = loaded.iter().map(|m| m.name.as_str()).collect();
            tracing::warn!(
                "{}: no loaded module matches '{}' (loaded: {}); its probes go in when one \
                 loads",
                wanted.template.name,
                wanted.module,
                if names.is_empty() {
                    "none".to_owned()
                } else {
                    names.join(", ")
                }
            );
        }
    }
    tracing::info!(
        "{} compiled probe points in kernel modules",
        plan.points
            .iter()
            .filter(|(_, p)| p.name.starts_with("module("))
            .count()
    );
    Ok(Some(watch))
}

/// Where the guest's module list is (running address), how `struct module` is laid out,
/// and the ORC layout its modules' tables share with the kernel's.
fn list_reader(image: &KernelImage, slide: u64) -> anyhow::Result<(u64, ModuleLayout, OrcLayout)> {
    let head = image
        .symbols
        .get("modules")
        .context("the image's symbols have no `modules` list, where the loaded modules are")?
        .addr
        .wrapping_add(slide);
    let layout =
        ModuleLayout::from_btf(image.btf()?).context("cannot lay out `struct module` from BTF")?;
    let orc = OrcTable::from_vmlinux(&image.vmlinux)
        .context("cannot read the kernel's ORC tables (the modules' share their layout)")?
        .layout();
    Ok((head, layout, orc))
}

/// A function of a loaded module, for `-l`/`-L`: its module, name, running address and
/// parameters (`$name:type`, from the module's BTF where its debug file is cached).
pub type ListedFunction = (String, String, u64, Vec<String>);

/// The functions of the loaded modules matching `module` whose names match `pattern`, for
/// `-l`/`-L`: read from the live guest at `target` (attached for the read, then left).
///
/// # Errors
/// When the guest cannot be attached or its module list read.
pub fn list_module_functions(
    target: &crate::live::attach::Target,
    image: &KernelImage,
    module: &str,
    pattern: &str,
) -> anyhow::Result<Vec<ListedFunction>> {
    let mut session = GuestSession::attach(target, image)?;
    let survey = session.survey.clone();
    let (head, layout, orc) = list_reader(image, survey.kaslr.slide)?;
    let loaded = {
        let mut mem = BackendMemory(&mut *session.machine);
        let mut space = survey.space(&mut mem);
        read_modules(&mut space, head, &layout, orc)
            .context("cannot read the guest's module list")?
    };
    session.detach()?;
    let wildcard = pattern.contains(['*', '?', '[']);
    let btf = image.btf()?;
    let mut found: Vec<ListedFunction> = Vec::new();
    for m in loaded.iter().filter(|m| wildcard_match(module, &m.name)) {
        let types = super::module_dwarf::module_types_of(image, btf, &m.name);
        for (name, addr) in m.symbols_in_text() {
            if !is_function(name, wildcard) || !wildcard_match(pattern, name) {
                continue;
            }
            let params = types
                .as_ref()
                .and_then(|t| t.func_signature(name).ok())
                .map(|sig| {
                    sig.params
                        .iter()
                        .map(|(p, ty)| {
                            let t = types.as_ref().map_or(String::new(), |types| {
                                exotap_introspect::btf::cdecl::declaration(types, *ty, "")
                            });
                            format!("${p}:{t}")
                        })
                        .collect()
                })
                .unwrap_or_default();
            found.push((m.name.clone(), name.to_owned(), addr, params));
        }
    }
    found.sort();
    found.dedup();
    Ok(found)
}

/// The value of `enumerator` in BTF's `enum name`.
fn btf_enum_value(btf: &exotap_introspect::btf::Btf, name: &str, enumerator: &str) -> Option<u64> {
    use exotap_introspect::btf::Kind;
    let id = btf.find(name, |k| matches!(k, Kind::Enum { .. }))?;
    let Kind::Enum { values, .. } = &btf.get(id)?.kind else {
        return None;
    };
    values
        .iter()
        .find(|v| btf.str_at(v.name) == enumerator)
        .and_then(|v| u64::try_from(v.value).ok())
}

/// Site points at places the module's DWARF found, `(point, function it is in, address less
/// the slide)`: each with the target variables its probe reads there (no parameters in
/// registers: a place inside a function), and why each place without them is left out.
fn dwarf_sites(
    wanted: &ModulePoint,
    dwarf: &super::module_dwarf::ModuleDwarf,
    found: impl IntoIterator<Item = (String, String, u64)>,
) -> (Placed, Vec<String>) {
    let mut placed = Vec::new();
    let mut problems = Vec::new();
    for (point, function, link) in found {
        let locals = match &wanted.vars {
            None => None,
            Some(vars) => match vars.at(dwarf, &point, link) {
                Ok(l) => Some(l),
                Err(mut why) => {
                    problems.append(&mut why);
                    continue;
                }
            },
        };
        placed.push((
            link,
            SitePoint {
                name: point,
                function,
                params: Vec::new(),
                locals,
                ..wanted.template.clone()
            },
        ));
    }
    (placed, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_and_split_parts_are_not_functions_a_wildcard_names() {
        assert!(is_function("evdev_open", true));
        assert!(!is_function("__pfx_evdev_open", true));
        assert!(!is_function("__cfi_evdev_open", false));
        assert!(!is_function("evdev_do_ioctl.cold", true));
        assert!(is_function("evdev_do_ioctl.cold", false));
    }
}
