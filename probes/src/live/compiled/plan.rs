//! What a script needs to run compiled: the points, the kernel facts, and the kernel
//! probes that run on the host instead (and why).

use std::collections::BTreeSet;
use std::thread::JoinHandle;

use anyhow::{bail, Context as _};
use exotap_introspect::btf::Btf;

use crate::compile::{self, Facts, SitePoint, TaskFields, Unsupported};
use crate::lang::check::Program;
use crate::lang::kernel_points::KernelSymbols;
use crate::lang::resolve::resolve_program;
use crate::lang::Limits;

use crate::live::attach::Target;
use crate::live::kernel_image::KernelImage;
use crate::live::trap_script::GuestScript;

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
/// host at breakpoints in the same session ([`crate::live::traps`]).
#[derive(Debug, Clone)]
pub struct Plan {
    pub(super) points: Vec<(u64, SitePoint)>,
    /// Kernel probes evaluated on the host, by index in the program.
    pub(super) host: BTreeSet<usize>,
    /// Why each of them does not compile.
    pub(super) refused: Vec<Unsupported>,
    /// The compiled points that are statements (link-time), which compile only where the
    /// live kernel's splice planner accepts the instruction.
    pub(super) statements: BTreeSet<u64>,
    pub(super) facts: Facts,
    pub(super) realtime_link: Option<u64>,
    pub(super) copy_link: Option<u64>,
    /// The points in kernel modules, found in the live guest when the script attaches
    /// ([`super::modules`]).
    pub(super) modules: Vec<ModulePoint>,
    /// The inlined instances the points did not name (`kernel.function("F")` adds F's), as
    /// (probe, link-time address): left out where the planner refuses them.
    pub(super) implicit: BTreeSet<(usize, u64)>,
    /// The kernel's BTF with the probed module's own types and functions
    /// ([`super::module_dwarf::module_types`]): its functions' parameters, by name.
    pub(super) module_btf: Option<std::sync::Arc<Btf>>,
}

/// A `module("M").function("F")` point of the script, to be found in the live guest.
#[derive(Debug, Clone)]
pub struct ModulePoint {
    /// Module name pattern.
    pub module: String,
    /// Function name pattern.
    pub pattern: String,
    /// Entry (`Entry`/`Call`), `Return` or `Inline`.
    pub site: crate::lang::point::FunctionSite,
    /// `module("m").statement("f@FILE:N")`: the line, in the functions matching `pattern`.
    pub statement: Option<crate::lang::point::SourceLine>,
    /// `module("m").function("f@FILE")`: only the functions FILE defines.
    pub file: Option<String>,
    /// `module("m").function("f@FILE:N")` (or `:N-M`): only those with code of the lines.
    pub line: Option<(u32, u32)>,
    /// `module("m").field("struct S", "member").ACCESS`: the member's accesses.
    pub field: Option<crate::lang::point::MemberAccess>,
    /// `module("m").statement("f+OFFSET")`: the instruction at this offset into f.
    pub offset: Option<u64>,
    /// Whether the point may match nothing (`?` or `!`).
    pub optional: bool,
    /// The site point each function found gets (its name and function set then).
    pub template: SitePoint,
    /// The target variables its probe reads from the module's DWARF (`None`: none but
    /// `$return`), found at each function when the module is placed.
    pub vars: Option<super::module_dwarf::ModuleVars>,
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
        current_task: crate::live::attach::percpu_variable(image, Some(btf), "current_task")?,
        cpu_number: crate::live::attach::percpu_variable(image, Some(btf), "cpu_number")?,
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
        globals: std::sync::Arc::new(crate::live::target_vars::kernel_globals(
            image,
            prog,
            Some(btf),
        )?),
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
    let btf = image.btf()?;
    let mut facts = facts(image, prog, btf)?;
    let lines = crate::live::target_vars::source_lines(image);
    let resolver = KernelSymbols::new(&image.symbols, Some(btf)).with_lines(lines.as_ref());
    let resolved = resolve_program(prog, &resolver)?;
    let (locals, left_out) = crate::live::target_vars::point_locals(image, prog, &resolved)?;
    let resolved: Vec<_> = resolved
        .into_iter()
        .filter(|(probe, p)| !p.address.is_some_and(|a| left_out.contains(&(*probe, a))))
        .collect();
    let mut implicit = BTreeSet::new();
    let mut points = Vec::new();
    let mut elsewhere = Vec::new();
    let mut statements = BTreeSet::new();
    let mut modules = Vec::new();
    let mut made_up = std::collections::HashMap::new();
    for (probe, point) in resolved {
        if let Some(mut m) = module_point(prog, probe, &point.name) {
            if super::module_dwarf::plan_vars(image, prog, &mut m, &mut made_up)? {
                modules.push(m);
            }
            continue;
        }
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
        // splice where the planner accepts the instruction ([`start`] asks it); so do an
        // inlined instance (`.inline`), in the code of the function it was inlined into,
        // and a member access (`kernel.field`).
        let statement = point.name.starts_with("kernel.statement(")
            || point.name.starts_with("kernel.field(")
            || point.name.ends_with(".inline");
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
        let data = crate::live::tracepoints::tracepoint_name(&point.name).map(|_| String::new());
        let params = data
            .into_iter()
            .chain(crate::live::target_vars::btf_params(&point))
            .collect();
        if statement {
            statements.insert(link);
        }
        if point.implicit {
            implicit.insert((probe, link));
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
    // A module's own types (`struct evdev`) and its functions' parameters come with the
    // kernel's from its split BTF.
    let module_btf =
        super::module_dwarf::module_types(image, btf, &modules).map(std::sync::Arc::new);
    if let Some(types) = &module_btf {
        facts.types = Some(std::sync::Arc::new(compile::types::BtfTypes(Btf::clone(
            types,
        ))));
        for m in modules.iter_mut().filter(|m| {
            m.site != crate::lang::point::FunctionSite::Inline
                && m.statement.is_none()
                && m.field.is_none()
        }) {
            m.template.params = super::module_dwarf::btf_params(types, &m.pattern);
        }
    }
    let only: Vec<SitePoint> = points
        .iter()
        .map(|p| p.1.clone())
        .chain(modules.iter().map(|m| m.template.clone()))
        .collect();
    let mut refused = compile::check(prog, limits, &facts, &only);
    refused.append(&mut elsewhere);
    refused.sort_by_key(|u| (u.span.start, u.construct.clone()));
    refused.dedup();
    if refused.iter().any(|u| u.probe.is_none()) {
        return Ok(Err(refused));
    }
    let host: BTreeSet<usize> = refused.iter().filter_map(|u| u.probe).collect();
    // A module's probes run compiled or not at all: the host path places its breakpoints
    // from the image's symbols, which have none of a module's.
    if let Some(m) = modules.iter().find(|m| host.contains(&m.template.probe)) {
        let why: Vec<String> = refused
            .iter()
            .filter(|u| u.probe == Some(m.template.probe))
            .map(|u| u.construct.clone())
            .collect();
        bail!(
            "{} does not compile ({}), and probes in kernel modules run compiled only",
            m.template.name,
            why.join("; ")
        );
    }
    points.retain(|(_, p)| !host.contains(&p.probe));
    if points.is_empty() && modules.is_empty() {
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
        modules,
        implicit,
        module_btf,
    }))
}

/// The module point `name` of probe `probe` stands for, if it is one.
fn module_point(prog: &Program, probe: usize, name: &str) -> Option<ModulePoint> {
    let (point, kind) = prog
        .probes
        .get(probe)?
        .points
        .iter()
        .find(|(p, _)| p.to_string() == name)?;
    ModulePoint::from_kind(kind, probe, name, point.optional || point.sufficient)
}

impl ModulePoint {
    /// The module point of `kind` (none for another kind), as probe `probe`'s point `name`.
    pub(crate) fn from_kind(
        kind: &crate::lang::point::PointKind,
        probe: usize,
        name: &str,
        optional: bool,
    ) -> Option<ModulePoint> {
        let crate::lang::point::PointKind::ModuleFunction {
            module,
            pattern,
            file,
            line,
            site,
            statement,
            field,
            offset,
        } = kind
        else {
            return None;
        };
        let is_return = *site == crate::lang::point::FunctionSite::Return;
        Some(ModulePoint {
            module: module.clone(),
            pattern: pattern.clone(),
            site: *site,
            statement: statement.clone(),
            file: file.clone(),
            line: *line,
            field: field.clone(),
            offset: *offset,
            optional,
            template: SitePoint {
                probe,
                name: name.to_owned(),
                function: pattern.clone(),
                params: Vec::new(),
                is_return,
                locals: None,
                guard: None,
            },
            vars: None,
        })
    }
}

/// Starts `script` against `target`: compiled into the guest where it compiles (as `mode`
/// says), per probe: the kernel probes that do not compile run on the host at breakpoints in
/// the same session, over the same globals, each named with what does not compile. A script
/// of which nothing compiles runs through the host-evaluated tracer
/// ([`crate::live::trap_script`]).
///
/// # Errors
/// As [`crate::live::compiled::start`] and [`crate::live::trap_script::start`]; with
/// [`CompileMode::Require`], a script of which some kernel probe does not compile.
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
            Ok(Ok(plan)) => return super::start(target, image, heap, script, plan, mode),
            Ok(Err(constructs)) => describe(&constructs, &script.source.name, &script.source.text),
            // Not a matter of compiling: the host path could not read them either.
            Err(e) if e.is::<crate::live::target_vars::UnreadableTargets>() => return Err(e),
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
    crate::live::trap_script::start(target, image, heap, script)
}

/// What `--compile=auto` says of a mixed run: which kernel probes run compiled, which on
/// the host and why (`why`: [`describe`] of the refused constructs).
pub(super) fn mixed_report(script: &GuestScript, plan: &Plan, why: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lang::driver::{compile as check_script, ScriptSource};

    use crate::live::kernel_image::cached_debian_image as image;

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
            probe kernel.function("vfs_write") { if (symdata(2) != "") s = 1 }
            probe kernel.statement("vfs_read+0x5") { a[n] = 1 }"#,
        );

        let plan = plan(&image, &prog, &Limits::default()).unwrap().unwrap();

        assert_eq!(plan.host, BTreeSet::from([1]));
        assert_eq!(plan.refused.len(), 1);
        assert!(
            plan.refused[0].construct.contains("symdata()"),
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
    fn a_script_of_which_nothing_compiles_is_refused_whole() {
        let Some(image) = image() else {
            eprintln!("SKIP: the Debian kernel is not cached (exotap boot fetches it)");
            return;
        };
        let prog = program(
            r#"global s; probe kernel.function("vfs_read") { if (symdata(2) != "") s = 1 }"#,
        );

        let refused = plan(&image, &prog, &Limits::default())
            .unwrap()
            .unwrap_err();

        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].probe, Some(0));
    }
}
