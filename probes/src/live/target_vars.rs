//! Which target variables each kernel probe point of a script reads, and where they are
//! there: the parameters BTF names at function entries, and everything else (`$locals`,
//! `$params` at statement probes) by its DWARF location at the point's address, from the
//! guest kernel's -dbg vmlinux when it is cached ([`crate::compile::locals`]).
//!
//! Both live paths ask here before they start (the compiled bodies and the host-evaluated
//! ones read the same places), and a variable that does not exist at a point, is optimized
//! out there, or lives where exotap cannot read it is an error that names it, the point and
//! the function, before anything is put into the guest, as SystemTap's semantic errors are.
//! Reads inside `@defined(...)` are not errors: there a missing variable is simply not
//! defined. The kernel globals a script reads (`@var("name[@file]")`) are found here too
//! ([`kernel_globals`]), with the same errors before anything starts; `$$locals` and
//! `$$vars` make a point read every variable DWARF has in scope there.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use exotap_introspect::btf::Btf;
use exotap_introspect::dwarf::index::{EntryKind, Index, Layer};
use exotap_introspect::dwarf::DebugFile;

use crate::compile::globals::{spec_of, split_spec, KernelGlobal, KernelGlobals};
use crate::compile::locals::{locals_at, Locals};
use crate::lang::ast::{ExprKind, Stmt, StmtKind};
use crate::lang::check::Program;
use crate::lang::resolve::ResolvedPoint;
use crate::lang::walk;

use super::kernel_image::KernelImage;

/// Target variables a script reads that cannot be read where it reads them: the script does
/// not start, compiled or not.
#[derive(Debug, thiserror::Error)]
#[error("target variables that cannot be read:\n  {}", .0.join("\n  "))]
pub struct UnreadableTargets(pub Vec<String>);

/// The target variables by DWARF location, per (probe, link-time address); points absent
/// here read only BTF parameters (or nothing).
pub type PointLocals = HashMap<(usize, u64), Arc<Locals>>;

/// The name [`names_read`] gives `$$locals` and `$$vars`: every variable in scope is read.
const ALL_LOCALS: &str = "$*"; // `plain` makes it `*`

/// Target variable names a probe reads (without `$`): those read outside `@defined`
/// (required), and those only inside it.
pub(crate) fn names_read(prog: &Program, probe: usize) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut required = BTreeSet::new();
    let mut optional = BTreeSet::new();
    let Some(p) = prog.script.probes.get(probe) else {
        return (required, optional);
    };
    // Reads under `@defined(...)`, and in the branches it chooses between (`@defined($a) ?
    // $a : $b`, `if (@defined($a)) ... else ...`), are optional: the branch that cannot be
    // read at a point is not compiled (nor evaluated) there.
    let mut guarded = BTreeSet::new();
    let mark = |e: &crate::lang::ast::Expr,
                guarded: &mut BTreeSet<u32>,
                optional: &mut BTreeSet<String>| {
        walk::expr_all(e, &mut |inner| {
            if let ExprKind::Target(t) = &inner.kind {
                guarded.insert(inner.span.start);
                optional.insert(t.name.clone());
            }
        });
    };
    guarded_branches(&p.body.stmts, &mut |e| mark(e, &mut guarded, &mut optional));
    let mut visit = |e: &crate::lang::ast::Expr| match &e.kind {
        ExprKind::Defined(x) => mark(x, &mut guarded, &mut optional),
        ExprKind::Ternary(t) if matches!(t.0.kind, ExprKind::Defined(_)) => {
            for branch in [&t.0, &t.1, &t.2] {
                mark(branch, &mut guarded, &mut optional);
            }
        }
        ExprKind::Target(t) if !guarded.contains(&e.span.start) => {
            required.insert(t.name.clone());
        }
        // `fh->m` on a local copied from `$fhp` (autocast): `$fhp`'s type at the point.
        ExprKind::Cast(c) => {
            if let Some(like) = c.like.as_ref().filter(|l| !l.is_empty()) {
                if guarded.contains(&e.span.start) {
                    optional.insert(like.clone());
                } else {
                    required.insert(like.clone());
                }
            }
        }
        _ => {}
    };
    if let Some(c) = &p.condition {
        walk::expr_all(c, &mut visit);
    }
    walk::block_exprs(&p.body, &mut visit);
    // `$$locals` and `$$vars` list every variable in scope: the point needs its DWARF.
    let all = |set: &BTreeSet<String>| {
        set.iter()
            .any(|n| matches!(n.trim_end_matches('$'), "$$locals" | "$$vars"))
    };
    if all(&required) {
        required.insert(ALL_LOCALS.into());
    } else if all(&optional) {
        optional.insert(ALL_LOCALS.into());
    }
    let plain = |set: BTreeSet<String>| -> BTreeSet<String> {
        set.into_iter()
            .filter(|n| n != "$return" && !n.starts_with("$$") && n.starts_with('$'))
            .map(|n| n.trim_end_matches('$').trim_start_matches('$').to_owned())
            .filter(|n| !n.is_empty())
            .collect()
    };
    (plain(required), plain(optional))
}

/// Calls `f` on every expression inside an `if (@defined(...))` (or `if (!@defined(...))`)
/// statement's condition and branches, at any depth of `stmts`.
fn guarded_branches<'p>(stmts: &'p [Stmt], f: &mut impl FnMut(&'p crate::lang::ast::Expr)) {
    for s in stmts {
        match &s.kind {
            StmtKind::If(i) if i.cond.defined_test().is_some() => {
                walk::stmt_exprs(s, f);
            }
            StmtKind::Block(b) => guarded_branches(&b.stmts, f),
            StmtKind::If(i) => {
                guarded_branches(std::slice::from_ref(&i.then), f);
                if let Some(e) = &i.els {
                    guarded_branches(std::slice::from_ref(e), f);
                }
            }
            StmtKind::While(w) => guarded_branches(std::slice::from_ref(&w.1), f),
            StmtKind::For(fs) => guarded_branches(std::slice::from_ref(&fs.body), f),
            StmtKind::Foreach(fe) => guarded_branches(std::slice::from_ref(&fe.body), f),
            StmtKind::Try(t) => {
                guarded_branches(&t.body.stmts, f);
                guarded_branches(&t.handler.stmts, f);
            }
            _ => {}
        }
    }
}

/// The cached -dbg vmlinux beside the image (`kernels/ABI/debug/vmlinux`, stored with its
/// manifest once verified).
fn debug_vmlinux(image: &KernelImage) -> Option<PathBuf> {
    let dir = image.path.parent()?.join("debug");
    (dir.join("manifest.json").is_file() && dir.join("vmlinux").is_file())
        .then(|| dir.join("vmlinux"))
}

/// The source positions of the cached -dbg vmlinux beside the image, for `@FILE`/`:LINE`
/// points; its name index is cached with the others in `CACHE/debuginfo` (the image is
/// `CACHE/kernels/ABI/bzImage`).
pub fn source_lines(image: &KernelImage) -> Option<crate::lang::source_lines::SourceLines> {
    let path = debug_vmlinux(image)?;
    let cache = image.path.parent()?.parent()?.parent()?.join("debuginfo");
    crate::lang::source_lines::SourceLines::open(&path, &cache)
        .map_err(|e| tracing::warn!("cannot open the cached -dbg vmlinux: {e:#}"))
        .ok()
}

/// The struct and member of a `kernel.field("struct S", "member").ACCESS` point.
fn field_of(point: &str) -> Option<(&str, &str)> {
    let rest = point.strip_prefix("kernel.field(\"")?;
    let (structure, rest) = rest.split_once("\", \"")?;
    let (member, _) = rest.split_once("\")")?;
    Some((structure, member))
}

/// `$object` and `$value` at a member access (KLAS's join point): `$object`, the address of
/// the struct whose member the instruction accesses (its memory operand's address less the
/// member's offset, laid out from BTF; a `struct S *`, so `$object->m` reads its members),
/// and for a plain store (`mov` of a register or an immediate) `$value`, what it writes. An
/// access that cannot give one (an index register in the operand, a read-modify-write) says
/// why; another name is `None`.
fn field_variable(
    image: &KernelImage,
    link: u64,
    structure: &str,
    member: &str,
    name: &str,
) -> Option<Result<crate::compile::locals::Local, String>> {
    let bytes = image.vmlinux.read_at(link, 15).ok()?;
    let offset = || {
        let btf = image.btf().map_err(|e| format!("$object: {e:#}"))?;
        let path: Vec<&str> = member
            .split(['.', '-', '>'])
            .filter(|m| !m.is_empty())
            .collect();
        let plain = structure.trim_start_matches("struct ").trim();
        btf.struct_member(plain, &path.join("."))
            .ok()
            .and_then(|l| l.byte_offset())
            .ok_or_else(|| format!("$object: BTF lays out no {structure}.{member}"))
    };
    member_access_variable(bytes, link, structure, &offset, name)
}

/// `$object` or `$value` (`name`) at the member access whose instruction is `bytes` at
/// `link` (as [`field_variable`] has them), the member at the byte offset `offset` gives
/// in `structure` (asked only for `$object`). Another name is `None`.
pub(crate) fn member_access_variable(
    bytes: &[u8],
    link: u64,
    structure: &str,
    offset: &dyn Fn() -> Result<u64, String>,
    name: &str,
) -> Option<Result<crate::compile::locals::Local, String>> {
    use crate::compile::locals::{Local, Place};
    use exotap_introspect::x86::regs::DWARF_GPRS;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind, Register};
    let mut decoder = Decoder::with_ip(64, bytes, link, DecoderOptions::NONE);
    let instr = decoder.decode();
    let dwarf = |r: Register| {
        DWARF_GPRS
            .iter()
            .position(|g| *g == r.full_register())
            .and_then(|i| u16::try_from(i).ok())
    };
    let at = format!("{instr} at {link:#x}");
    Some(match name {
        "object" => (|| {
            let plain = structure.trim_start_matches("struct ").trim();
            let offset = i64::try_from(offset()?).map_err(|_| "$object: offset".to_owned())?;
            if instr.memory_index() != Register::None {
                return Err(format!(
                    "$object: {at} addresses the member with an index register"
                ));
            }
            let disp = instr.memory_displacement64() as i64;
            let place = match instr.memory_base() {
                Register::RIP => Place::Address((disp - offset) as u64),
                base => Place::Computed {
                    reg: dwarf(base)
                        .ok_or_else(|| format!("$object: {at} has no base register"))?,
                    add: disp - offset,
                },
            };
            Ok(Local {
                place,
                size: 8,
                signed: false,
                pointee: Some(format!("struct {plain}")),
                is_param: false,
            })
        })(),
        "value" => {
            let size = u8::try_from(instr.memory_size().size()).unwrap_or(0);
            let store = instr.mnemonic() == Mnemonic::Mov
                && instr.op0_kind() == OpKind::Memory
                && matches!(size, 1 | 2 | 4 | 8);
            if !store {
                Err(format!(
                    "$value: {at} is not a plain store of a register or a constant"
                ))
            } else {
                match instr.op1_kind() {
                    OpKind::Register => dwarf(instr.op1_register())
                        .map(|r| Local {
                            place: Place::Register(r),
                            size,
                            signed: false,
                            pointee: None,
                            is_param: false,
                        })
                        .ok_or_else(|| {
                            format!("$value: {at} stores a register exotap cannot read")
                        }),
                    OpKind::Immediate8
                    | OpKind::Immediate16
                    | OpKind::Immediate32
                    | OpKind::Immediate32to64
                    | OpKind::Immediate8to64 => Ok(Local {
                        place: Place::Const(instr.immediate(1) as i64),
                        size,
                        signed: false,
                        pointee: None,
                        is_param: false,
                    }),
                    _ => Err(format!(
                        "$value: {at} is not a plain store of a register or a constant"
                    )),
                }
            }
        }
        _ => return None,
    })
}

/// Parameter `name` of system call `call` at the entry of its wrapper `__x64_sys_CALL(const
/// struct pt_regs *regs)`: the syscall's parameters are `SYSCALL_DEFINE`'s, in the order of
/// `__do_sys_CALL` (or `__se_sys_CALL`) in DWARF, and the N-th is in the caller's register
/// di, si, dx, r10, r8 or r9 of that `pt_regs` (laid out from BTF), as SystemTap's
/// `nd_syscall` tapset reads them. Typed as `__do_sys_CALL` declares it.
fn syscall_argument(
    image: &KernelImage,
    info: &exotap_introspect::dwarf::DebugInfo<'_>,
    index: &Index,
    call: &str,
    name: &str,
) -> Option<crate::compile::locals::Local> {
    const REGS: [&str; 6] = ["di", "si", "dx", "r10", "r8", "r9"];
    /// DWARF's number for rdi, the wrapper's `regs` at its entry.
    const DWARF_RDI: u16 = 5;
    let func = [format!("__do_sys_{call}"), format!("__se_sys_{call}")]
        .iter()
        .find_map(|f| {
            index
                .functions(f, &[EntryKind::Abstract, EntryKind::Function])
                .into_iter()
                .next()
        })?;
    let params: Vec<_> = info
        .variables(func.die, func.low)
        .ok()?
        .into_iter()
        .filter(|v| v.is_param)
        .collect();
    let at = params.iter().position(|v| v.name == name)?;
    let reg = REGS.get(at)?;
    let scalar = info.scalar(params[at].ty)?;
    let offset = image
        .btf()
        .ok()?
        .struct_member("pt_regs", reg)
        .ok()?
        .byte_offset()?;
    Some(crate::compile::locals::Local {
        place: crate::compile::locals::Place::Memory {
            base: DWARF_RDI,
            offset: i64::try_from(offset).ok()?,
        },
        size: scalar.size,
        signed: scalar.signed,
        pointee: scalar.pointee,
        is_param: true,
    })
}

/// The parameter names BTF gives a resolved point (`$name:type`).
pub fn btf_params(point: &ResolvedPoint) -> Vec<String> {
    point
        .variables
        .iter()
        .filter_map(|v| v.strip_prefix('$'))
        .map(|v| v.split(':').next().unwrap_or(v).to_owned())
        .collect()
}

/// Finds where the target variables the probes of `prog` read are at each of their points
/// in `resolved` that needs DWARF: statement probes, and entries that read a name BTF does
/// not give as a parameter. Return probes read parameters (as at the entry) and `$return`
/// only, as before.
///
/// Also returns the implicit inlined instances (`ResolvedPoint::implicit`) left out because
/// a variable their probe reads is not there, as (probe, link-time address), each warned of.
///
/// # Errors
/// Every variable read outside `@defined` that does not exist at a point, is optimized out
/// there or lives where exotap cannot read it, each named with the point and the function;
/// and such reads when no -dbg vmlinux is cached.
pub fn point_locals(
    image: &KernelImage,
    prog: &Program,
    resolved: &[(usize, ResolvedPoint)],
) -> anyhow::Result<(PointLocals, Vec<(usize, u64)>)> {
    let mut out = PointLocals::new();
    let mut dropped: Vec<(usize, u64)> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let mut reads: HashMap<usize, (BTreeSet<String>, BTreeSet<String>)> = HashMap::new();
    let path = debug_vmlinux(image);
    let file = path.as_deref().map(DebugFile::open).transpose();
    let file = match file {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("cannot open the cached -dbg vmlinux: {e}");
            None
        }
    };
    let info = file
        .as_ref()
        .map(DebugFile::load)
        .transpose()
        .unwrap_or_else(|e| {
            tracing::warn!("cannot read the cached -dbg vmlinux: {e}");
            None
        });
    // The -dbg vmlinux's name index, loaded for the first syscall wrapper that needs it.
    let names: std::cell::OnceCell<Option<Index>> = std::cell::OnceCell::new();
    for (probe, point) in resolved {
        let before = errors.len();
        'point: {
            let Some(link) = point.address else {
                break 'point;
            };
            if point.name.ends_with(".return") {
                break 'point;
            }
            let (required, optional) = reads
                .entry(*probe)
                .or_insert_with(|| names_read(prog, *probe));
            let params = btf_params(point);
            // BTF parameters in the six argument registers are read there; the others (the
            // seventh on, on the stack) by their DWARF location.
            let in_registers =
                |n: &String| params.iter().position(|p| p == n).is_some_and(|i| i < 6);
            let needed: Vec<&String> = required
                .iter()
                .chain(optional.iter())
                .filter(|n| !in_registers(n))
                .collect();
            if needed.is_empty() {
                break 'point;
            }
            let must: Vec<&String> = required.iter().filter(|n| !in_registers(n)).collect();
            let Some(info) = &info else {
                if must.iter().any(|n| *n == "*") {
                    errors.push(format!(
                        "{}: $$locals and $$vars list the variables DWARF has in scope there, and \
                         they need the kernel's -dbg vmlinux (exotap image fetch --debuginfo)",
                        point.name
                    ));
                } else if let Some(name) = must.first() {
                    errors.push(format!(
                        "{}: ${name} is not a parameter the kernel's BTF names there; locals, and \
                         parameters away from a function's entry, need the kernel's -dbg vmlinux \
                         (exotap image fetch --debuginfo)",
                        point.name
                    ));
                }
                break 'point;
            };
            // The cached debug info must be this kernel's: the bytes at the point agree.
            let same = match (info.code(link, link + 16), image.vmlinux.read_at(link, 16)) {
                (Some(a), Ok(b)) => a == b,
                _ => false,
            };
            if !same {
                errors.push(format!(
                    "{}: the cached -dbg vmlinux ({}) does not hold this kernel's code at {link:#x}",
                    point.name,
                    path.as_deref()
                        .unwrap_or(std::path::Path::new("?"))
                        .display()
                ));
                break 'point;
            }
            let mut locals = match locals_at(info, link) {
                Ok(l) => l,
                Err(why) => {
                    if !must.is_empty() {
                        errors.push(format!("{}: {why}", point.name));
                    }
                    break 'point;
                }
            };
            // At a member access (`kernel.field`): the object accessed, and the value a plain
            // store writes.
            if let Some((structure, member)) = field_of(&point.name) {
                for name in ["object", "value"] {
                    if locals.get(name).is_none() {
                        if let Some(local) = field_variable(image, link, structure, member, name) {
                            locals.vars.insert(name.to_owned(), local);
                        }
                    }
                }
            }
            // At a syscall wrapper's entry (`kernel.function("sys_NAME")`), the system call's
            // own parameters, which DWARF has in scope only further in.
            let wrapper = image
                .symbols
                .lookup_addr(link)
                .filter(|(_, off)| *off == 0)
                .and_then(|(sym, _)| sym.name.strip_prefix("__x64_sys_").map(str::to_owned));
            if let Some(call) = wrapper {
                let missing: Vec<String> = must
                    .iter()
                    .filter(|n| locals.get(n).is_none())
                    .map(|n| (*n).clone())
                    .collect();
                for name in &missing {
                    let index = names.get_or_init(|| {
                        let cache = image.path.parent()?.parent()?.parent()?.join("debuginfo");
                        Index::load_or_build(info, &cache, Layer::Names, &|_, _| {})
                            .map_err(|e| {
                                tracing::warn!("cannot index the cached -dbg vmlinux: {e}")
                            })
                            .ok()
                    });
                    if let Some(local) = index
                        .as_ref()
                        .and_then(|index| syscall_argument(image, info, index, &call, name))
                    {
                        locals.vars.insert(name.clone(), Ok(local));
                    }
                }
            }
            errors.extend(unreadable(&point.name, link, &locals, must));
            out.insert((*probe, link), Arc::new(locals));
        }
        // An inlined instance the point did not name, whose variables are not all there:
        // left out, where a place the point named is an error.
        if point.implicit && errors.len() > before {
            for why in errors.drain(before..) {
                tracing::warn!("left out: {why}");
            }
            if let Some(link) = point.address {
                dropped.push((*probe, link));
            }
        }
    }
    if !errors.is_empty() {
        errors.sort();
        errors.dedup();
        return Err(UnreadableTargets(errors).into());
    }
    Ok((out, dropped))
}

/// Why each of `must` (target variable names without `$`; `*` stands for all and is no
/// error) cannot be read at `point` (address `pc`) from `locals`: not in scope there, or
/// not readable (optimized out, a location exotap does not read).
pub(crate) fn unreadable<'n>(
    point: &str,
    pc: u64,
    locals: &crate::compile::locals::Locals,
    must: impl IntoIterator<Item = &'n String>,
) -> Vec<String> {
    let mut errors = Vec::new();
    for name in must.into_iter().filter(|n| *n != "*") {
        match locals.get(name) {
            Some(Ok(_)) => {}
            Some(Err(why)) => errors.push(format!("{point}: {why} in {}", locals.function)),
            None => errors.push(format!(
                "{point}: no variable ${name} in scope at {pc:#x}, in {} (there: {})",
                locals.function,
                if locals.vars.is_empty() {
                    "none".to_owned()
                } else {
                    locals.names()
                }
            )),
        }
    }
    errors
}

/// The `@var(...)` specifications the probes of `prog` read: those outside `@defined`
/// (required), and those only inside it.
fn globals_read(prog: &Program) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut required = BTreeSet::new();
    let mut optional = BTreeSet::new();
    for p in &prog.script.probes {
        let mut guarded = BTreeSet::new();
        let mut visit = |e: &crate::lang::ast::Expr| {
            walk::expr_all(e, &mut |inner| match &inner.kind {
                ExprKind::Defined(x) => walk::expr_all(x, &mut |g| {
                    guarded.insert(g.span.start);
                    if let ExprKind::Target(t) = &g.kind {
                        optional.extend(spec_of(&t.name));
                    }
                }),
                ExprKind::Target(t) if !guarded.contains(&inner.span.start) => {
                    required.extend(spec_of(&t.name));
                }
                _ => {}
            })
        };
        if let Some(c) = &p.condition {
            visit(c);
        }
        walk::block_exprs(&p.body, &mut visit);
    }
    optional.retain(|s| !required.contains(s));
    (required, optional)
}

/// The debug info of the cached -dbg vmlinux and its name index, opened on demand.
struct Dwarf<'f> {
    info: exotap_introspect::dwarf::DebugInfo<'f>,
    index: Index,
}

/// Finds the kernel globals (`@var("name")`, `@var("name@file.c")`) the probes of `prog` read:
/// their link-time address (the image's symbols; DWARF for a `name@file` static) and their
/// type (BTF's `VAR`, else the -dbg vmlinux's DWARF when cached, by the type's name in BTF).
///
/// # Errors
/// Every global read outside `@defined` that cannot be found or typed, each with the reason.
pub fn kernel_globals(
    image: &KernelImage,
    prog: &Program,
    btf: Option<&Btf>,
) -> anyhow::Result<KernelGlobals> {
    let (required, optional) = globals_read(prog);
    let mut out = KernelGlobals::new();
    if required.is_empty() && optional.is_empty() {
        return Ok(out);
    }
    let file = debug_vmlinux(image).and_then(|p| DebugFile::open(&p).ok());
    let mut dwarf: Option<Option<Dwarf<'_>>> = None;
    let cache = image
        .path
        .parent()
        .and_then(|p| p.parent())
        .and_then(|p| p.parent())
        .map(|p| p.join("debuginfo"));
    let open = || -> Option<Dwarf<'_>> {
        let info = file.as_ref()?.load().ok()?;
        let index = Index::load_or_build(&info, cache.as_deref()?, Layer::Names, &|_, _| {})
            .map_err(|e| tracing::warn!("cannot index the cached -dbg vmlinux: {e}"))
            .ok()?;
        Some(Dwarf { info, index })
    };
    let mut errors = Vec::new();
    for spec in required.iter().chain(optional.iter()) {
        let needs_dwarf = spec.contains('@') || btf.and_then(|b| btf_var(b, spec)).is_none();
        if needs_dwarf && dwarf.is_none() {
            dwarf = Some(open());
        }
        let d = dwarf.as_ref().and_then(Option::as_ref);
        let found = resolve_global(image, btf, d, spec);
        if let (Err(why), true) = (&found, required.contains(spec)) {
            errors.push(format!("@var(\"{spec}\"): {why}"));
        }
        out.insert(spec.clone(), found);
    }
    if !errors.is_empty() {
        return Err(UnreadableTargets(errors).into());
    }
    Ok(out)
}

/// The BTF `VAR` called `name`: its type.
fn btf_var(btf: &Btf, name: &str) -> Option<u32> {
    btf.iter().find_map(|(id, t)| match &t.kind {
        exotap_introspect::btf::Kind::Var { ty, .. } if btf.name(id) == name => Some(*ty),
        _ => None,
    })
}

/// One global: address and type, or why not.
fn resolve_global(
    image: &KernelImage,
    btf: Option<&Btf>,
    dwarf: Option<&Dwarf<'_>>,
    spec: &str,
) -> Result<KernelGlobal, String> {
    let (name, file) = split_spec(spec);
    let no_dwarf = "the kernel's BTF does not type it and no -dbg vmlinux is cached (exotap \
                    image fetch --debuginfo)";
    let btf = btf.ok_or("the kernel image has no BTF")?;
    // The DWARF variable: in `file` when one is named, else any of that name.
    let entry = dwarf.and_then(|d| {
        d.index
            .lookup_kind(name, EntryKind::Variable)
            .find(|e| file.is_none_or(|f| e.file.ends_with(f) || f.ends_with(e.file)))
    });
    let link = match (file, &entry) {
        (Some(_), Some(e)) if e.low != 0 => e.low,
        (Some(f), _) if dwarf.is_none() => {
            return Err(format!(
                "a variable of {f} is found by DWARF, and {no_dwarf}"
            ))
        }
        (Some(f), _) => return Err(format!("DWARF has no static variable {name} in {f}")),
        (None, _) => match image.symbols.get(name) {
            Some(s) => s.addr,
            None => match &entry {
                Some(e) if e.low != 0 => e.low,
                _ => return Err(format!("the kernel has no symbol {name}")),
            },
        },
    };
    if let Some(ty) = btf_var(btf, name).filter(|_| file.is_none()) {
        return Ok(KernelGlobal {
            link,
            ty,
            type_name: exotap_introspect::btf::cdecl::declaration(btf, ty, ""),
        });
    }
    let d = dwarf.ok_or(no_dwarf)?;
    // A linker-script alias (`jiffies = jiffies_64`) takes the type of the variable DWARF
    // places at its address.
    let die = match entry {
        Some(e) => e.die,
        None => {
            d.index
                .iter()
                .find(|e| e.kind == EntryKind::Variable && e.low == link)
                .ok_or_else(|| format!("DWARF has no variable {name} (nor one at {link:#x})"))?
                .die
        }
    };
    let (_, c_type) = d
        .info
        .variable_type(die)
        .ok_or_else(|| format!("DWARF gives {name} no type"))?;
    let mut spec_ty = c_type.as_str();
    for q in ["volatile ", "const "] {
        spec_ty = spec_ty.trim_start_matches(q);
    }
    let ty = btf
        .type_by_spec(spec_ty)
        .map_err(|_| format!("its type {c_type} is not one BTF names"))?;
    Ok(KernelGlobal {
        link,
        ty,
        type_name: c_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lang::driver::{compile as check_script, ScriptSource};
    use crate::lang::kernel_points::KernelSymbols;
    use crate::lang::resolve::resolve_program;
    use crate::lang::Limits;

    /// `vfs_read+0xf1` (`testl $0x4004000,0x44(%rbp)`, after a read that returned > 0) and
    /// `vfs_read+0x1b6` (`test %r15,%r15`, in the inlined `new_sync_read`) of the cached
    /// Debian 6.1 cloud kernel, with its -dbg vmlinux; `None` (after saying why) otherwise.
    fn kernel() -> Option<KernelImage> {
        // A cached kernel that does not load panics there: a failure, not a skip.
        let Some(image) = crate::live::kernel_image::cached_debian_image() else {
            eprintln!("SKIP: the Debian kernel is not cached (exotap image fetch)");
            return None;
        };
        if debug_vmlinux(&image).is_none() {
            eprintln!("SKIP: no cached -dbg vmlinux (exotap image fetch --debuginfo)");
            return None;
        }
        // Every build has vfs_read with more than 0x1b9 bytes: not finding them is a failure.
        let start = image.address("vfs_read").unwrap();
        let at = |off: u64, len: usize| {
            image
                .vmlinux
                .read_at(start + off, len)
                .unwrap_or_else(|e| panic!("cannot read vfs_read+{off:#x}: {e:#}"))
        };
        if at(0xf1, 7) != [0xf7, 0x45, 0x44, 0x00, 0x40, 0x00, 0x04]
            || at(0x1b6, 3) != [0x4d, 0x85, 0xff]
        {
            eprintln!(
                "SKIP: the cached kernel is another build of vfs_read than these offsets are for"
            );
            return None;
        }
        Some(image)
    }

    fn locals(image: &KernelImage, text: &str) -> anyhow::Result<PointLocals> {
        let source = ScriptSource {
            name: "t.stp".into(),
            text: text.into(),
        };
        let prog = check_script(&source, &Limits::default()).unwrap();
        let btf = image.btf().ok();
        let resolved = resolve_program(&prog, &KernelSymbols::new(&image.symbols, btf)).unwrap();
        point_locals(image, &prog, &resolved).map(|(locals, _)| locals)
    }

    /// The link-time address of `name` in the -dbg package's System.map (the outside oracle:
    /// the linker's own map, not kallsyms).
    fn system_map(image: &KernelImage, name: &str) -> Option<u64> {
        let map = std::fs::read_to_string(image.path.parent()?.join("debug/System.map")).ok()?;
        map.lines().find_map(|l| {
            let mut f = l.split_whitespace();
            let (addr, _, sym) = (f.next()?, f.next()?, f.next()?);
            (sym == name).then(|| u64::from_str_radix(addr, 16).ok())?
        })
    }

    /// Every call site of a tracepoint (an inlined `trace_NAME`) has the tracepoint's
    /// arguments in scope at the pc it is probed at, those whose DWARF entry pc lies in
    /// none of the instance's ranges included (two of `trace_block_rq_complete`'s four in
    /// 6.1: caller code scheduled before it, where only the caller's variables are).
    #[test]
    fn each_tracepoint_call_site_has_the_tracepoint_arguments_in_scope() {
        let Some(image) = kernel() else { return };
        let lines = source_lines(&image).expect("the cached -dbg vmlinux opens");
        let source = ScriptSource {
            name: "t.stp".into(),
            text: r#"global x
              probe kernel.function("trace_block_rq_complete").inline { x = $rq + $nr_bytes }
              probe kernel.function("trace_sched_switch").inline { x = $prev + $next }"#
                .into(),
        };
        let prog = check_script(&source, &Limits::default()).unwrap();
        let btf = image.btf().ok();
        let resolver = KernelSymbols::new(&image.symbols, btf).with_lines(Some(&lines));
        let resolved = resolve_program(&prog, &resolver).unwrap();
        assert!(resolved.len() >= 3, "{resolved:?}");
        let (locals, left_out) = point_locals(&image, &prog, &resolved)
            .unwrap_or_else(|e| panic!("call sites without their arguments: {e:#}"));
        assert_eq!(locals.len(), resolved.len());
        assert!(left_out.is_empty(), "{left_out:?}");
    }

    /// A branch that `@defined` or `!@defined` decides reads its variables only where it is
    /// kept (SystemTap elides the other at elaboration): they are optional, the rest required.
    #[test]
    fn reads_under_a_negated_defined_test_are_optional() {
        let source = ScriptSource {
            name: "t.stp".into(),
            text: r#"global x
              probe kernel.function("vfs_read") {
                if (!@defined($file->f_no_such_member)) x = $rq
                if (@defined($pos)) x = $q else x = $r
                x = $count
              }"#
            .into(),
        };
        let prog = check_script(&source, &Limits::default()).unwrap();
        let (required, optional) = names_read(&prog, 0);
        let names = |s: &[&str]| s.iter().map(|n| (*n).to_owned()).collect::<BTreeSet<_>>();
        assert_eq!(required, names(&["count"]));
        assert_eq!(optional, names(&["file", "pos", "q", "r", "rq"]));
    }

    fn globals(image: &KernelImage, text: &str) -> anyhow::Result<KernelGlobals> {
        let source = ScriptSource {
            name: "t.stp".into(),
            text: text.into(),
        };
        let prog = check_script(&source, &Limits::default()).unwrap();
        let btf = image.btf().ok();
        kernel_globals(image, &prog, btf)
    }

    #[test]
    fn kernel_globals_are_found_at_the_linkers_address_with_their_dwarf_type() {
        let Some(image) = kernel() else { return };

        let found = globals(
            &image,
            r#"probe kernel.function("vfs_read") {
                 println(@var("jiffies"), @var("init_task")->pid, @var("nr_threads@kernel/fork.c"))
                 if (@defined(@var("no_such_global_anywhere"))) println(1)
               }"#,
        )
        .unwrap();

        let get = |spec: &str| found.get(spec).unwrap().as_ref().unwrap();
        // `jiffies = jiffies_64` (arch/x86/kernel/vmlinux.lds.S): the alias takes the type
        // of the variable DWARF has at its address.
        assert_eq!(get("jiffies").link, system_map(&image, "jiffies").unwrap());
        assert_eq!(
            get("jiffies").link,
            system_map(&image, "jiffies_64").unwrap()
        );
        assert_eq!(get("jiffies").type_name, "u64");
        assert_eq!(
            get("init_task").link,
            system_map(&image, "init_task").unwrap()
        );
        assert_eq!(get("init_task").type_name, "struct task_struct");
        let threads = get("nr_threads@kernel/fork.c");
        assert_eq!(threads.link, system_map(&image, "nr_threads").unwrap());
        assert_eq!(threads.type_name, "int");
        assert!(found
            .get("no_such_global_anywhere")
            .unwrap()
            .as_ref()
            .is_err());
    }

    #[test]
    fn an_unknown_global_or_one_of_the_wrong_file_is_an_error_naming_it() {
        let Some(image) = kernel() else { return };

        let err = globals(
            &image,
            r#"probe kernel.function("vfs_read") {
                 println(@var("no_such_global_anywhere"), @var("nr_threads@fs/read_write.c"))
               }"#,
        )
        .unwrap_err()
        .to_string();

        assert!(
            err.contains("@var(\"no_such_global_anywhere\"): the kernel has no symbol"),
            "{err}"
        );
        assert!(
            err.contains("DWARF has no static variable nr_threads in fs/read_write.c"),
            "{err}"
        );
    }

    #[test]
    fn locals_of_a_statement_probe_come_from_their_dwarf_location_there() {
        let Some(image) = kernel() else { return };

        let found = locals(
            &image,
            r#"probe kernel.statement("vfs_read+0xf1") { println($ret, $file->f_pos) }
               probe kernel.statement("vfs_read+0x1b6") { println($count) }"#,
        )
        .unwrap();

        let start = image.address("vfs_read").unwrap();
        let ret_site = found.get(&(0, start + 0xf1)).unwrap();
        // The read's result in rbx (`mov %rax,%rbx` after the read method returned), `file`
        // in rbp; `count` saved in the stack slot at the CFA - 160 (`mov %rdx,(%rsp)` with
        // 160 bytes of frame, return address included).
        let ret = ret_site.get("ret").unwrap().as_ref().unwrap();
        assert_eq!(
            (ret.place, ret.size, ret.signed),
            (crate::compile::locals::Place::Register(3), 8, true)
        );
        let file = ret_site.get("file").unwrap().as_ref().unwrap();
        assert_eq!(file.pointee.as_deref(), Some("struct file"));
        let count_site = found.get(&(1, start + 0x1b6)).unwrap();
        assert_eq!(
            count_site.get("count").unwrap().as_ref().unwrap().place,
            crate::compile::locals::Place::Memory { base: 7, offset: 0 }
        );
        assert!(count_site
            .function
            .starts_with("new_sync_read (inlined into vfs_read)"));
    }

    #[test]
    fn an_absent_optimized_out_or_unreadable_local_is_an_error_naming_it() {
        let Some(image) = kernel() else { return };

        let err = locals(
            &image,
            r#"probe kernel.statement("vfs_read+0x1b6") { println($ret, $nosuch) }
               probe kernel.statement("vfs_read+0xf1") { println($count, @defined($zz)) }
               probe kernel.function("vfs_read") { println($file, $ret) }"#,
        )
        .unwrap_err();

        let text = format!("{err:#}");
        assert!(err.is::<UnreadableTargets>(), "{text}");
        assert!(
            text.contains("vfs_read+0x1b6\"): $ret is optimized out at"),
            "{text}"
        );
        assert!(
            text.contains("vfs_read+0x1b6\"): no variable $nosuch in scope at"),
            "{text}"
        );
        assert!(text.contains("vfs_read+0xf1\"): $count has a location exotap cannot read: the DWARF expression entry_value"), "{text}");
        assert!(
            text.contains("kernel.function(\"vfs_read\"): $ret is optimized out"),
            "{text}"
        );
        assert!(
            !text.contains("$zz") && !text.contains("\"): $file"),
            "{text}"
        );
        assert_eq!(text.lines().count(), 5, "{text}");
    }

    #[test]
    fn the_branch_at_defined_chooses_against_is_not_required() {
        let Some(image) = kernel() else { return };

        // As grapher.stp's `count = @defined($c) ? $c : $count` at pty_write, and an `if`:
        // `$ret` (optimized out at the entry) is read only where `@defined` chose it.
        let found = locals(
            &image,
            r#"probe kernel.function("vfs_read") {
                 x = @defined($nope) ? $nope : $ret
                 if (@defined($zz)) println($zz) else println($ret, x)
               }"#,
        );

        assert!(found.is_ok(), "{found:?}");
    }

    #[test]
    fn an_entry_that_reads_only_btf_parameters_needs_no_debug_info() {
        let Some(image) = kernel() else { return };

        let found = locals(
            &image,
            r#"probe kernel.function("vfs_read") { println($file, $count) }"#,
        )
        .unwrap();

        assert!(found.is_empty());
    }
}
