//! Elaboration: probe points are classified, names resolved (globals are declared, locals are
//! whatever a body assigns), and types inferred by iterating to a fixed point, as SystemTap's
//! semantic pass does. Expressions are checked in `check_expr`.

use std::collections::{HashMap, HashSet};
use std::fmt;

use indexmap::IndexMap;

use super::ast::*;
use super::builtins;
use super::check_stmt::{collect_assigned, returns_value};
use super::diag::Diagnostic;
use super::point::{classify, PointKind, KNOWN_FAMILIES};
use super::value::HistLayout;

/// Types of the language.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ty {
    /// Not inferred (yet).
    Unknown,
    /// 64-bit integer.
    Long,
    /// String.
    Str,
    /// Statistics aggregate (`<<<`).
    Stats,
    /// No value (functions that return nothing).
    Void,
}

impl Ty {
    /// The type with its article, for messages: "a long", "an aggregate".
    pub fn article(self) -> String {
        match self {
            Ty::Stats => "an aggregate".to_string(),
            Ty::Void => "no value".to_string(),
            t => format!("a {t}"),
        }
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ty::Unknown => "unknown",
            Ty::Long => "long",
            Ty::Str => "string",
            Ty::Stats => "aggregate",
            Ty::Void => "no value",
        })
    }
}

/// Whether a global is an array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Not used yet.
    Unknown,
    /// A single value.
    Scalar,
    /// An associative array.
    Array,
}

/// What the checker knows about a global.
#[derive(Debug, Clone)]
pub struct GlobalInfo {
    /// Where it is declared.
    pub span: Span,
    /// Scalar or array.
    pub shape: Shape,
    /// Type of the scalar or of the array's values.
    pub value: Ty,
    /// Key types of an array (empty until used with keys).
    pub keys: Vec<Ty>,
    /// `global a[N]`.
    pub max_entries: Option<usize>,
    /// Initial value.
    pub init: Option<Literal>,
    /// Read somewhere (not counting `++`, `+=`, `<<<`).
    pub read: bool,
    /// Written somewhere.
    pub written: bool,
    /// Histograms kept for an aggregate.
    pub hist: HistLayout,
    /// `global a%`: a full array drops its oldest entry for a new one.
    pub wrap: bool,
}

/// A checked probe: the points that survived classification.
#[derive(Debug, Clone)]
pub struct ProbeInfo {
    /// Points with their meaning.
    pub points: Vec<(ProbePoint, PointKind)>,
}

/// A checked script, ready to run.
#[derive(Debug, Clone)]
pub struct Program {
    /// The syntax tree.
    pub script: Script,
    /// Globals in declaration order.
    pub globals: IndexMap<String, GlobalInfo>,
    /// Function name to index in `script.functions`.
    pub functions: HashMap<String, usize>,
    /// Function return types, by index.
    pub function_ret: Vec<Ty>,
    /// Per probe, then per function: local variable types.
    pub locals: Vec<HashMap<String, Ty>>,
    /// Per probe.
    pub probes: Vec<ProbeInfo>,
    /// Warnings (the script still runs).
    pub warnings: Vec<Diagnostic>,
    /// What `target()` returns: the `-x PID` of the invocation, 0 without.
    pub target_pid: i64,
    /// Where the host serves the script's procfs files.
    pub host_files: exotap_probes_base::procfs::HostFiles,
}

impl Program {
    /// Whether any probe point needs a guest kernel.
    pub fn needs_guest(&self) -> bool {
        self.probes
            .iter()
            .any(|p| p.points.iter().any(|(_, k)| k.needs_guest()))
    }

    /// Globals that are written but never read: SystemTap prints them at exit (not the
    /// tapset library's private `__` ones).
    pub fn displayed_globals(&self) -> impl Iterator<Item = (&String, &GlobalInfo)> {
        self.globals
            .iter()
            .filter(|(name, g)| g.written && !g.read && !name.starts_with("__"))
    }
}

/// How many inference rounds before giving up on a fixed point.
const MAX_ROUNDS: usize = 32;

/// Checks `script`.
///
/// # Errors
/// All errors found, warnings included (in source order).
pub fn check(script: Script) -> Result<Program, Vec<Diagnostic>> {
    check_guru(script, false)
}

/// A procfs probe's `$value` (the file's contents) is not a kernel variable: it becomes the
/// probe's string local [`PROCFS_VALUE`](super::point::PROCFS_VALUE), which the host sets
/// before a `.write` probe and reads after a `.read` probe.
fn procfs_value_as_local(script: &mut Script) {
    use super::point::PROCFS_VALUE;
    for probe in &mut script.probes {
        let procfs = probe
            .points
            .iter()
            .any(|p| matches!(classify(p), Ok(PointKind::Procfs { .. })));
        if !procfs {
            continue;
        }
        crate::walk::block_exprs_mut(&mut probe.body, &mut |e| {
            if let ExprKind::Target(t) = &e.kind {
                if t.name == PROCFS_VALUE && t.members.is_empty() {
                    e.kind = ExprKind::Var(PROCFS_VALUE.to_string());
                }
            }
        });
    }
}

/// SystemTap's autocast: in each probe (an alias's prologue and the probe's body are one),
/// a local copied from a target variable (`fh = $fhp`) keeps that variable's type at each
/// point, and one copied from an `@cast` its type, for `fh->member` ([`CastExpr::like`]).
/// The first copy in the probe names it; a local copied from nothing of the kind is left
/// unresolved, for the checker to report.
fn resolve_autocasts(script: &mut Script) {
    use super::ast::CastExpr;
    enum Source {
        Target(String),
        Cast(String, Option<String>),
    }
    for probe in &mut script.probes {
        let mut sources: HashMap<String, Source> = HashMap::new();
        crate::walk::block_exprs(&probe.body, &mut |e| {
            let ExprKind::Assign(None, pair) = &e.kind else {
                return;
            };
            let ExprKind::Var(local) = &pair.0.kind else {
                return;
            };
            let source = match &pair.1.kind {
                ExprKind::Target(t) if t.members.is_empty() && t.name.starts_with('$') => {
                    Source::Target(t.name.clone())
                }
                ExprKind::Cast(c)
                    if c.like.is_none() && c.members.is_empty() && c.indexes.is_empty() =>
                {
                    Source::Cast(c.type_name.clone(), c.module.clone())
                }
                _ => return,
            };
            sources.entry(local.clone()).or_insert(source);
        });
        if sources.is_empty() {
            continue;
        }
        crate::walk::block_exprs_mut(&mut probe.body, &mut |e| {
            let ExprKind::Cast(c) = &mut e.kind else {
                return;
            };
            let CastExpr {
                pointer,
                like: Some(like),
                ..
            } = c.as_mut()
            else {
                return;
            };
            let ExprKind::Var(local) = &pointer.kind else {
                return;
            };
            match sources.get(local) {
                Some(Source::Target(name)) if like.is_empty() => *like = name.clone(),
                Some(Source::Cast(ty, module)) if like.is_empty() => {
                    c.type_name = ty.clone();
                    c.module = module.clone();
                    c.like = None;
                }
                _ => {}
            }
        });
    }
}

/// As [`check`], in guru mode when `guru` (stap's `-g`): writes to target variables
/// (`$param = v` at kernel function entries, `$return = v` in return probes) and
/// `set_return(v)` are allowed; without it they are errors.
///
/// # Errors
/// As [`check`].
pub fn check_guru(mut script: Script, guru: bool) -> Result<Program, Vec<Diagnostic>> {
    procfs_value_as_local(&mut script);
    resolve_autocasts(&mut script);
    let mut c = Checker::new(&script);
    // `-g` reaches the checker either way: as the caller's flag or parsed into the script.
    c.guru = guru || script.guru;
    c.declare();
    // Inference rounds only collect types: a variable read before the statement that types
    // it is not an error until the reporting pass says it still has no type.
    c.report = false;
    for _ in 0..MAX_ROUNDS {
        c.changed = false;
        c.walk_all();
        if !c.changed {
            break;
        }
    }
    c.report = true;
    c.walk_all();
    c.finish();
    let Checker {
        globals,
        functions,
        function_ret,
        locals,
        probes,
        diags,
        ..
    } = c;
    let (errors, warnings): (Vec<_>, Vec<_>) = diags
        .into_iter()
        .partition(|d| d.severity == super::diag::Severity::Error);
    if !errors.is_empty() {
        let mut all = errors;
        all.extend(warnings);
        all.sort_by_key(|d| (d.span.start, d.span.end));
        return Err(all);
    }
    Ok(Program {
        script,
        globals,
        functions,
        function_ret,
        locals,
        probes,
        warnings,
        target_pid: 0,
        host_files: exotap_probes_base::procfs::HostFiles::default(),
    })
}

/// What the walker is inside.
#[derive(Debug, Clone, Default)]
pub(crate) struct Scope {
    /// Body index into `locals`.
    pub body: usize,
    /// Inside a function (index) rather than a probe.
    pub function: Option<usize>,
    /// Point kinds of the probe being checked.
    pub kinds: Vec<PointKind>,
    /// Names assigned in this body.
    pub assigned: HashSet<String>,
    /// Loop nesting.
    pub loops: usize,
    /// Inside `@defined(...)`: target variables that cannot exist here are not errors.
    pub defined: usize,
}

pub(crate) struct Checker<'a> {
    pub script: &'a Script,
    pub globals: IndexMap<String, GlobalInfo>,
    pub functions: HashMap<String, usize>,
    pub function_ret: Vec<Ty>,
    pub locals: Vec<HashMap<String, Ty>>,
    pub probes: Vec<ProbeInfo>,
    pub diags: Vec<Diagnostic>,
    seen: HashSet<(u32, u32, String)>,
    /// Probes with a probe point that could not be classified: their bodies are not checked
    /// (their variables often come from a tapset alias exotap does not have).
    unresolved: HashSet<usize>,
    pub report: bool,
    pub changed: bool,
    pub scope: Scope,
    /// `-g`: writes to target variables and `set_return()` are allowed.
    pub guru: bool,
}

impl<'a> Checker<'a> {
    fn new(script: &'a Script) -> Self {
        Checker {
            script,
            globals: IndexMap::new(),
            functions: HashMap::new(),
            function_ret: Vec::new(),
            locals: vec![HashMap::new(); script.probes.len() + script.functions.len()],
            probes: Vec::new(),
            diags: Vec::new(),
            seen: HashSet::new(),
            unresolved: HashSet::new(),
            report: true,
            changed: false,
            scope: Scope::default(),
            guru: false,
        }
    }

    /// Records a diagnostic once, in the reporting pass only.
    pub fn emit(&mut self, d: Diagnostic) {
        if self.report
            && self
                .seen
                .insert((d.span.start, d.span.end, d.message.clone()))
        {
            self.diags.push(d);
        }
    }

    fn declare(&mut self) {
        for g in &self.script.globals {
            if self.globals.contains_key(&g.name.name) {
                self.emit(
                    Diagnostic::error(format!("duplicate global '{}'", g.name.name), g.name.span)
                        .with_label("declared again here"),
                );
                continue;
            }
            let (value, init) = match &g.init {
                Some((lit @ Literal::Num(_), _)) => (Ty::Long, Some(lit.clone())),
                Some((lit @ Literal::Str(_), _)) => (Ty::Str, Some(lit.clone())),
                None => (Ty::Unknown, None),
            };
            let info = GlobalInfo {
                span: g.name.span,
                shape: if g.array_size.is_some() {
                    Shape::Array
                } else {
                    Shape::Unknown
                },
                value,
                keys: Vec::new(),
                max_entries: g.array_size.filter(|&n| n > 0).map(|n| n as usize),
                init,
                read: false,
                written: false,
                hist: HistLayout::default(),
                wrap: g.wrap,
            };
            self.globals.insert(g.name.name.clone(), info);
        }
        let nprobes = self.script.probes.len();
        for (i, f) in self.script.functions.iter().enumerate() {
            let name = &f.name.name;
            if builtins::is_core(name) {
                self.emit(
                    Diagnostic::error(
                        format!("function '{name}' redefines a built-in"),
                        f.name.span,
                    )
                    .with_hint("pick another name"),
                );
            } else if self.functions.contains_key(name) {
                self.emit(Diagnostic::error(
                    format!("duplicate function '{name}'"),
                    f.name.span,
                ));
            } else {
                self.functions.insert(name.clone(), i);
            }
            // A C function is refused where it is called (see `call`), so that scripts
            // carrying unused C helpers still run; its types come from its declaration or
            // from its call sites.
            let has_value = match &f.body {
                FunctionBody::Block(b) => returns_value(&b.stmts),
                FunctionBody::Embedded(_) => true,
            };
            let ret = match (f.ret, has_value) {
                (Some(DeclType::Long), _) => Ty::Long,
                (Some(DeclType::Str), _) => Ty::Str,
                (None, true) => Ty::Unknown,
                (None, false) => Ty::Void,
            };
            self.function_ret.push(ret);
            let locals = &mut self.locals[nprobes + i];
            for p in &f.params {
                let ty = match p.ty {
                    Some(DeclType::Long) => Ty::Long,
                    Some(DeclType::Str) => Ty::Str,
                    None => Ty::Unknown,
                };
                locals.insert(p.name.name.clone(), ty);
            }
        }
        for (index, p) in self.script.probes.iter().enumerate() {
            let mut points = Vec::new();
            for pt in &p.points {
                match classify(pt) {
                    Ok(kind) => points.push((pt.clone(), kind)),
                    Err(e) if pt.optional || pt.sufficient => self.emit(Diagnostic::warning(
                        format!("{e}; optional probe point skipped"),
                        e.span(),
                    )),
                    Err(e) => {
                        let d = Diagnostic::error(e.to_string(), e.span())
                            .with_label("in this probe point");
                        // An out-of-scope family's message says what to do instead.
                        let d = match e {
                            super::point::PointError::OutOfScope { .. } => d,
                            _ => d.with_hint(format!("known probe points: {KNOWN_FAMILIES}")),
                        };
                        self.emit(d);
                        self.unresolved.insert(index);
                    }
                }
            }
            // Every point optional and none known: SystemTap drops the probe, body and all
            // (its body's names often come from the alias that is missing).
            if points.is_empty() && !p.points.is_empty() {
                self.unresolved.insert(index);
            }
            self.probes.push(ProbeInfo { points });
        }
    }

    fn walk_all(&mut self) {
        let script = self.script;
        for (i, p) in script.probes.iter().enumerate() {
            if self.unresolved.contains(&i) {
                continue;
            }
            let kinds = self
                .probes
                .get(i)
                .map(|p| p.points.iter().map(|(_, k)| k.clone()).collect());
            let mut assigned = HashSet::new();
            collect_assigned(&p.body.stmts, &mut assigned);
            let kinds: Vec<PointKind> = kinds.unwrap_or_default();
            // `input.char`'s `char`, `input.line`'s `line`: strings the probe starts with.
            for local in kinds.iter().filter_map(PointKind::given_local) {
                assigned.insert(local.to_string());
                if let Some(body) = self.locals.get_mut(i) {
                    body.insert(local.to_string(), Ty::Str);
                }
            }
            self.scope = Scope {
                body: i,
                function: None,
                kinds,
                assigned,
                loops: 0,
                defined: 0,
            };
            if let Some(cond) = &p.condition {
                self.expect(cond, Ty::Long);
            }
            self.block(&p.body);
        }
        let nprobes = script.probes.len();
        for (i, f) in script.functions.iter().enumerate() {
            let FunctionBody::Block(body) = &f.body else {
                continue;
            };
            let mut assigned: HashSet<String> =
                f.params.iter().map(|p| p.name.name.clone()).collect();
            collect_assigned(&body.stmts, &mut assigned);
            self.scope = Scope {
                body: nprobes + i,
                function: Some(i),
                kinds: Vec::new(),
                assigned,
                loops: 0,
                defined: 0,
            };
            self.block(body);
        }
    }

    fn finish(&mut self) {
        // The guest paths (trap and compiled probes) run begin, end and timer probes on the
        // host but do not read exotap's standard input: a script that needs both is refused
        // here rather than having its input probes never fire.
        let points = || self.probes.iter().flat_map(|p| p.points.iter());
        let input = points().find(|(_, k)| k.reads_input());
        let kernel = points().find(|(_, k)| k.needs_guest());
        if let (Some((pt, _)), Some((kpt, _))) = (input, kernel) {
            let d = Diagnostic::error(
                format!(
                    "{pt} runs only in scripts without kernel probes: exotap reads its \
                     standard input in the guest-free runtime, and the guest paths that run \
                     {kpt} do not feed it to scripts yet"
                ),
                pt.span,
            );
            self.emit(d);
        }
        // Errors other than failed inference, which the checks below would only echo.
        let has_causes = self.diags.iter().any(|d| {
            d.severity == super::diag::Severity::Error && !d.message.starts_with("could not infer")
        });
        // A file of functions only (a tapset) is reported as such first, as SystemTap does,
        // rather than by the types its uncalled functions leave open.
        if !has_causes && self.probes.iter().all(|p| p.points.is_empty()) {
            let span = self
                .script
                .probes
                .first()
                .map(|p| p.span)
                .unwrap_or_default();
            self.emit(
                Diagnostic::error("no probes found", span)
                    .with_hint("a script needs at least one probe, e.g. probe begin { ... }"),
            );
        }
        let names: Vec<String> = self.globals.keys().cloned().collect();
        for name in names {
            let Some(g) = self.globals.get(&name).cloned() else {
                continue;
            };
            let span = g.span;
            // With other errors, a type that could not be inferred (or a global that looks
            // unused) is nearly always their consequence: an unknown function's result, the
            // unchecked body of a probe on an unknown point. Not worth reporting until those
            // are fixed.
            if has_causes {
                continue;
            }
            if !g.read && !g.written && g.value == Ty::Unknown && g.init.is_none() {
                self.emit(Diagnostic::warning(
                    format!("global '{name}' is never used"),
                    span,
                ));
                if let Some(g) = self.globals.get_mut(&name) {
                    g.value = Ty::Long;
                }
                continue;
            }
            if g.value == Ty::Unknown || g.keys.contains(&Ty::Unknown) {
                self.emit(
                    Diagnostic::error(format!("could not infer the type of global '{name}'"), span)
                        .with_label("declared here")
                        .with_hint("assign it a value (or a key) somewhere in the script"),
                );
            }
            if g.shape == Shape::Array && g.keys.is_empty() {
                self.emit(
                    Diagnostic::error(format!("array '{name}' is never indexed"), span)
                        .with_hint("use it as name[key] somewhere"),
                );
            }
        }
        let nprobes = self.script.probes.len();
        for (i, f) in self.script.functions.iter().enumerate() {
            if has_causes || matches!(f.body, FunctionBody::Embedded(_)) {
                continue;
            }
            if self.function_ret[i] == Ty::Unknown {
                self.emit(
                    Diagnostic::error(
                        format!(
                            "could not infer the return type of function '{}'",
                            f.name.name
                        ),
                        f.name.span,
                    )
                    .with_hint("declare it, as in function name:long (...)"),
                );
            }
            for p in &f.params {
                if self.locals[nprobes + i].get(&p.name.name) == Some(&Ty::Unknown) {
                    self.emit(
                        Diagnostic::error(
                            format!("could not infer the type of parameter '{}'", p.name.name),
                            p.name.span,
                        )
                        .with_hint("declare it, as in name:long or name:string"),
                    );
                }
            }
        }
    }

    // ----- symbols -----

    pub fn undefined(&mut self, name: &str, span: Span) {
        self.emit(
            Diagnostic::error(format!("undefined variable '{name}'"), span)
                .with_label("never assigned in this body and not a global")
                .with_hint(format!(
                    "declare it with 'global {name}' or assign it before use"
                )),
        );
    }

    pub fn local_ty(&self, name: &str) -> Ty {
        self.locals[self.scope.body]
            .get(name)
            .copied()
            .unwrap_or(Ty::Unknown)
    }

    /// Gives variable `name` (local or global scalar) type `ty`, reporting a clash.
    pub fn set_var(&mut self, name: &str, ty: Ty, span: Span) {
        if ty == Ty::Unknown || ty == Ty::Void {
            return;
        }
        if self.globals.contains_key(name) {
            self.set_global_value(name, ty, span);
            return;
        }
        let slot = self.locals[self.scope.body]
            .entry(name.to_string())
            .or_insert(Ty::Unknown);
        if *slot == Ty::Unknown {
            *slot = ty;
            self.changed = true;
        } else if *slot != ty {
            let have = *slot;
            self.clash(name, have, ty, span);
        }
    }

    pub fn set_global_value(&mut self, name: &str, ty: Ty, span: Span) {
        let Some(g) = self.globals.get_mut(name) else {
            return;
        };
        if g.value == Ty::Unknown {
            g.value = ty;
            self.changed = true;
        } else if g.value != ty {
            let have = g.value;
            self.clash(name, have, ty, span);
        }
    }

    pub fn set_key(&mut self, name: &str, k: usize, ty: Ty, span: Span) {
        let Some(g) = self.globals.get_mut(name) else {
            return;
        };
        let Some(slot) = g.keys.get_mut(k) else {
            return;
        };
        if *slot == Ty::Unknown {
            *slot = ty;
            self.changed = true;
        } else if *slot != ty && ty != Ty::Unknown {
            let have = *slot;
            self.emit(
                Diagnostic::error(
                    format!(
                        "type mismatch: key {} of '{name}' is a {have}, not a {ty}",
                        k + 1
                    ),
                    span,
                )
                .with_label(format!("this key is a {ty}")),
            );
        }
    }

    fn clash(&mut self, name: &str, have: Ty, ty: Ty, span: Span) {
        let msg = format!(
            "type mismatch: '{name}' is {} but is used as {} here",
            have.article(),
            ty.article()
        );
        let d = Diagnostic::error(msg, span).with_label(format!("used as {}", ty.article()));
        let d = if have == Ty::Stats || ty == Ty::Stats {
            d.with_hint("an aggregate only takes '<<<' and @count/@sum/@min/@max/@avg/@hist_*")
        } else {
            d.with_hint("a variable keeps one type in the whole script")
        };
        self.emit(d);
    }

    /// Checks or sets the number of keys of global array `name`; returns its key types.
    pub fn array_arity(&mut self, name: &str, n: usize, span: Span) -> Vec<Ty> {
        let Some(g) = self.globals.get_mut(name) else {
            return Vec::new();
        };
        match g.shape {
            Shape::Scalar => {
                self.emit(
                    Diagnostic::error(format!("'{name}' is a scalar but is indexed here"), span)
                        .with_hint("a global is either a scalar or an array, not both"),
                );
                return Vec::new();
            }
            Shape::Unknown | Shape::Array => g.shape = Shape::Array,
        }
        if g.keys.is_empty() {
            g.keys = vec![Ty::Unknown; n];
            self.changed = true;
        } else if g.keys.len() != n {
            let have = g.keys.len();
            self.emit(Diagnostic::error(
                format!("array '{name}' has {have} key(s) but is used with {n} here"),
                span,
            ));
        }
        self.globals
            .get(name)
            .map(|g| g.keys.clone())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parser::parse, Limits};

    fn checked(src: &str) -> Program {
        check(parse(src, &Limits::default()).unwrap()).unwrap()
    }

    fn errors(src: &str) -> Vec<String> {
        check(parse(src, &Limits::default()).unwrap())
            .unwrap_err()
            .into_iter()
            .map(|d| d.message)
            .collect()
    }

    #[test]
    fn global_type_comes_from_a_later_probe() {
        let p = checked("global x\nprobe begin { y = x }\nprobe end { x = \"s\" }");
        assert_eq!(p.globals["x"].value, Ty::Str);
        assert_eq!(p.locals[0]["y"], Ty::Str);
    }

    #[test]
    fn parameter_type_comes_from_the_call_site() {
        let p = checked("function f(a) { return a }\nprobe begin { f(\"s\") }");
        assert_eq!(p.locals[1]["a"], Ty::Str);
        assert_eq!(p.function_ret[0], Ty::Str);
    }

    #[test]
    fn array_key_and_value_types_are_inferred() {
        let p = checked("global a\nprobe begin { a[\"k\", 1] = 2 }");
        assert_eq!(p.globals["a"].keys, vec![Ty::Str, Ty::Long]);
        assert_eq!(p.globals["a"].value, Ty::Long);
    }

    #[test]
    fn undefined_variable_is_an_error() {
        assert_eq!(
            errors("probe begin { x = y }"),
            vec!["undefined variable 'y'"]
        );
    }

    #[test]
    fn incremented_global_is_displayed_at_exit() {
        let p = checked("global n\nprobe begin { n++ }");
        assert_eq!(p.displayed_globals().count(), 1);
    }

    #[test]
    fn read_global_is_not_displayed() {
        let p = checked("global n\nprobe begin { n++; println(n) }");
        assert_eq!(p.displayed_globals().count(), 0);
    }

    #[test]
    fn optional_unknown_point_is_dropped_with_a_warning() {
        let p = checked("probe nosuch.thing?, begin { }");
        assert_eq!(p.probes[0].points.len(), 1);
        assert_eq!(p.warnings.len(), 1);
    }

    #[test]
    fn histogram_layouts_are_recorded_per_aggregate() {
        let p = checked("global s\nprobe begin { s <<< 1; print(@hist_log(s)); print(@hist_linear(s, 0, 10, 2)) }");
        assert!(p.globals["s"].hist.log);
        assert_eq!(
            p.globals["s"].hist.linear,
            Some(HistKind::Linear {
                start: 0,
                stop: 10,
                interval: 2
            })
        );
    }

    #[test]
    fn kernel_point_makes_the_program_need_a_guest() {
        assert!(checked("probe kernel.function(\"f\") { }").needs_guest());
        assert!(!checked("probe timer.ms(1) { }").needs_guest());
    }

    #[test]
    fn local_read_before_its_typing_assignment_is_inferred() {
        let p = checked("probe begin { if (0) y = x + 1; x = 0 }");
        assert_eq!(p.locals[0]["x"], Ty::Long);
    }

    #[test]
    fn entry_outside_a_return_probe_is_an_error() {
        assert_eq!(
            errors("probe kernel.function(\"f\") { x = @entry($a) }"),
            vec!["'@entry' is only available in .return probes"]
        );
    }

    #[test]
    fn entry_in_a_return_probe_has_the_type_of_its_operand() {
        let p = checked("probe kernel.function(\"f\").return { s = @entry(execname()) }");
        assert_eq!(p.locals[0]["s"], Ty::Str);
    }

    #[test]
    fn defined_target_in_a_begin_probe_takes_the_fallback_unchecked() {
        let p = checked("probe begin { x = @choose_defined($nosuch, \"none\") }");
        assert_eq!(p.locals[0]["x"], Ty::Str);
    }

    #[test]
    fn target_outside_defined_in_a_begin_probe_is_still_an_error() {
        assert_eq!(
            errors("probe begin { x = @defined($a) + $a }"),
            vec!["target variable '$a' is not available in 'begin' probes"]
        );
    }

    #[test]
    fn calling_an_embedded_c_function_is_an_error_naming_the_alternative() {
        let diags = check(
            parse(
                "function f:long () %{ STAP_RETURN(1); %}\nprobe begin { println(f()) }",
                &Limits::default(),
            )
            .unwrap(),
        )
        .unwrap_err();
        assert_eq!(
            diags[0].message,
            "function 'f' is written in embedded C, which exotap cannot run"
        );
        assert!(diags[0]
            .hint
            .as_ref()
            .is_some_and(|h| h.contains("no module") && h.contains("script language")));
    }

    #[test]
    fn an_uncalled_embedded_c_function_is_fine() {
        let p = checked("function f(x) %{ /* C */ %}\nprobe begin { }");
        assert_eq!(p.warnings.len(), 0);
    }

    #[test]
    fn cast_reads_a_long_from_a_long_pointer() {
        let p =
            checked("probe begin { p = 0; v = @cast(p, \"struct task_struct\", \"kernel\")->pid }");
        assert_eq!(p.locals[0]["v"], Ty::Long);
    }

    #[test]
    fn cast_of_a_string_is_an_error() {
        assert_eq!(
            errors("probe begin { v = @cast(\"x\", \"struct file\")->f_pos }"),
            vec!["type mismatch: expected a long, found a string"]
        );
    }

    #[test]
    fn variance_records_its_bit_shift() {
        let p = checked("global s\nprobe begin { s <<< 1; println(@variance(s, 4)) }");
        assert_eq!(p.globals["s"].hist.variance_shift, Some(4));
    }

    #[test]
    fn variance_of_a_local_is_an_error() {
        assert_eq!(
            errors("probe begin { s = 1; println(@variance(s)) }"),
            vec!["statistics need a global aggregate"]
        );
    }

    #[test]
    fn regex_pattern_must_be_a_literal() {
        assert_eq!(
            errors("probe begin { p = \"a\"; x = \"s\" =~ p }"),
            vec!["the regular expression of '=~' must be a string literal"]
        );
    }

    #[test]
    fn invalid_regex_is_an_error_before_the_run() {
        assert_eq!(
            errors("probe begin { x = \"s\" =~ \"(\" }"),
            vec!["invalid regular expression"]
        );
    }

    #[test]
    fn regex_match_is_a_long() {
        let p = checked("probe begin { x = \"abc\" =~ \"^a.c$\" }");
        assert_eq!(p.locals[0]["x"], Ty::Long);
    }

    #[test]
    fn pretty_printed_target_is_a_string() {
        let p = checked("probe kernel.function(\"f\") { s = $file$; t = $file->f_path$$ }");
        assert_eq!((p.locals[0]["s"], p.locals[0]["t"]), (Ty::Str, Ty::Str));
    }

    #[test]
    fn address_of_a_member_is_a_long() {
        let p = checked("probe kernel.function(\"f\") { a = &$q->key }");
        assert_eq!(p.locals[0]["a"], Ty::Long);
    }

    #[test]
    fn wrapping_global_is_an_array() {
        let p = checked("global a%\nprobe begin { a[1] = 2 }");
        assert!(p.globals["a"].wrap && p.globals["a"].shape == Shape::Array);
    }

    #[test]
    fn wildcard_delete_types_the_named_keys() {
        let p = checked("global a\nprobe begin { a[1, \"s\"] = 1; delete a[2, *] }");
        assert_eq!(p.globals["a"].keys, vec![Ty::Long, Ty::Str]);
    }

    #[test]
    fn wildcard_inside_a_key_expression_is_an_error() {
        assert!(
            errors("global a\nprobe begin { a[1] = 1; delete a[abs(*)] }")
                .contains(&"'*' stands for a key only in 'delete a[k, *]'".to_string())
        );
    }

    #[test]
    fn body_of_a_probe_on_an_unknown_point_is_not_checked() {
        assert_eq!(
            errors("global g\nprobe nosuch.alias { g[x] = y }"),
            vec!["unknown probe point 'nosuch.alias'"]
        );
    }

    #[test]
    fn uninferred_types_are_not_reported_next_to_their_cause() {
        assert_eq!(
            errors("global g\nprobe begin { g = nosuch() }"),
            vec!["unknown function 'nosuch'"]
        );
    }

    #[test]
    fn body_of_a_probe_whose_optional_points_are_all_unknown_is_not_checked() {
        let p = checked("probe nosuch.alias ? { println(undefined_here) }\nprobe begin { }");
        assert_eq!(p.probes[0].points.len(), 0);
    }

    #[test]
    fn a_script_function_overrides_a_native_tapset_function() {
        let p = checked("function ctime(x) { return 1 }\nprobe begin { y = ctime(2) + 1 }");
        assert_eq!(p.locals[0]["y"], Ty::Long);
    }

    #[test]
    fn target_write_is_accepted_in_guru_mode() {
        let inv = crate::invocation::Invocation {
            guru: true,
            ..Default::default()
        };
        let script = crate::parser::parse_with(
            "probe kernel.function(\"f\") { $x = 1 }",
            &Limits::default(),
            &inv,
        )
        .unwrap();
        assert!(check(script).is_ok());
    }

    #[test]
    fn mismatch_is_reported_once() {
        assert_eq!(errors("probe begin { x = 1; x = \"a\" }").len(), 1);
    }
}
