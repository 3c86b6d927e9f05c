//! Elaboration: probe points are classified, names resolved (globals are declared, locals are
//! whatever a body assigns), and types inferred by iterating to a fixed point, as SystemTap's
//! semantic pass does. Expressions are checked in [`check_expr`](super::check_expr).

use std::collections::{HashMap, HashSet};
use std::fmt;

use indexmap::IndexMap;

use super::ast::*;
use super::builtins;
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
}

impl Program {
    /// Whether any probe point needs a guest kernel.
    pub fn needs_guest(&self) -> bool {
        self.probes.iter().any(|p| p.points.iter().any(|(_, k)| k.needs_guest()))
    }

    /// Globals that are written but never read: SystemTap prints them at exit.
    pub fn displayed_globals(&self) -> impl Iterator<Item = (&String, &GlobalInfo)> {
        self.globals.iter().filter(|(_, g)| g.written && !g.read)
    }
}

/// How many inference rounds before giving up on a fixed point.
const MAX_ROUNDS: usize = 32;

/// Checks `script`.
///
/// # Errors
/// All errors found, warnings included (in source order).
pub fn check(script: Script) -> Result<Program, Vec<Diagnostic>> {
    let mut c = Checker::new(&script);
    c.declare();
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
    let Checker { globals, functions, function_ret, locals, probes, diags, .. } = c;
    let (errors, warnings): (Vec<_>, Vec<_>) =
        diags.into_iter().partition(|d| d.severity == super::diag::Severity::Error);
    if !errors.is_empty() {
        let mut all = errors;
        all.extend(warnings);
        all.sort_by_key(|d| (d.span.start, d.span.end));
        return Err(all);
    }
    Ok(Program { script, globals, functions, function_ret, locals, probes, warnings })
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
    pub report: bool,
    pub changed: bool,
    pub scope: Scope,
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
            report: true,
            changed: false,
            scope: Scope::default(),
        }
    }

    /// Records a diagnostic once, in the reporting pass only.
    pub fn emit(&mut self, d: Diagnostic) {
        if self.report && self.seen.insert((d.span.start, d.span.end, d.message.clone())) {
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
                shape: if g.array_size.is_some() { Shape::Array } else { Shape::Unknown },
                value,
                keys: Vec::new(),
                max_entries: g.array_size.filter(|&n| n > 0).map(|n| n as usize),
                init,
                read: false,
                written: false,
                hist: HistLayout::default(),
            };
            self.globals.insert(g.name.name.clone(), info);
        }
        let nprobes = self.script.probes.len();
        for (i, f) in self.script.functions.iter().enumerate() {
            let name = &f.name.name;
            if builtins::is_builtin(name) {
                self.emit(
                    Diagnostic::error(format!("function '{name}' redefines a built-in"), f.name.span)
                        .with_hint("pick another name"),
                );
            } else if self.functions.contains_key(name) {
                self.emit(Diagnostic::error(format!("duplicate function '{name}'"), f.name.span));
            } else {
                self.functions.insert(name.clone(), i);
            }
            let has_value = match &f.body {
                FunctionBody::Block(b) => returns_value(&b.stmts),
                FunctionBody::Embedded(span) => {
                    self.emit(
                        Diagnostic::error("embedded C code is not supported", *span)
                            .with_hint("exotap never runs C code in the guest; write the body in the script language"),
                    );
                    false
                }
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
        for p in &self.script.probes {
            let mut points = Vec::new();
            for pt in &p.points {
                match classify(pt) {
                    Ok(kind) => points.push((pt.clone(), kind)),
                    Err(e) if pt.optional => self.emit(
                        Diagnostic::warning(format!("{e}; optional probe point skipped"), e.span()),
                    ),
                    Err(e) => {
                        let d = Diagnostic::error(e.to_string(), e.span())
                            .with_label("in this probe point")
                            .with_hint(format!("known probe points: {KNOWN_FAMILIES}"));
                        self.emit(d);
                    }
                }
            }
            self.probes.push(ProbeInfo { points });
        }
    }

    fn walk_all(&mut self) {
        let script = self.script;
        for (i, p) in script.probes.iter().enumerate() {
            let kinds = self.probes.get(i).map(|p| p.points.iter().map(|(_, k)| k.clone()).collect());
            let mut assigned = HashSet::new();
            collect_assigned(&p.body.stmts, &mut assigned);
            self.scope = Scope {
                body: i,
                function: None,
                kinds: kinds.unwrap_or_default(),
                assigned,
                loops: 0,
            };
            if let Some(cond) = &p.condition {
                self.expect(cond, Ty::Long);
            }
            self.block(&p.body);
        }
        let nprobes = script.probes.len();
        for (i, f) in script.functions.iter().enumerate() {
            let FunctionBody::Block(body) = &f.body else { continue };
            let mut assigned: HashSet<String> =
                f.params.iter().map(|p| p.name.name.clone()).collect();
            collect_assigned(&body.stmts, &mut assigned);
            self.scope =
                Scope { body: nprobes + i, function: Some(i), kinds: Vec::new(), assigned, loops: 0 };
            self.block(body);
        }
    }

    fn finish(&mut self) {
        let has_errors = self.diags.iter().any(|d| d.severity == super::diag::Severity::Error);
        if !has_errors && self.probes.iter().all(|p| p.points.is_empty()) {
            let span = self.script.probes.first().map(|p| p.span).unwrap_or_default();
            self.emit(
                Diagnostic::error("no probes found", span)
                    .with_hint("a script needs at least one probe, e.g. probe begin { ... }"),
            );
        }
        let names: Vec<String> = self.globals.keys().cloned().collect();
        for name in names {
            let Some(g) = self.globals.get(&name).cloned() else { continue };
            let span = g.span;
            if !g.read && !g.written && g.value == Ty::Unknown && g.init.is_none() {
                self.emit(Diagnostic::warning(format!("global '{name}' is never used"), span));
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
            if self.function_ret[i] == Ty::Unknown {
                self.emit(
                    Diagnostic::error(
                        format!("could not infer the return type of function '{}'", f.name.name),
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

    // ----- statements -----

    pub fn block(&mut self, b: &Block) {
        for s in &b.stmts {
            self.stmt(s);
        }
    }

    fn stmt(&mut self, s: &Stmt) {
        match &s.kind {
            StmtKind::Empty | StmtKind::Next => {}
            StmtKind::Block(b) => self.block(b),
            StmtKind::Expr(e) => {
                let t = self.expr(e);
                if t == Ty::Stats {
                    self.stats_as_value(e.span);
                }
            }
            StmtKind::If(i) => {
                self.expect(&i.cond, Ty::Long);
                self.stmt(&i.then);
                if let Some(e) = &i.els {
                    self.stmt(e);
                }
            }
            StmtKind::While(w) => {
                self.expect(&w.0, Ty::Long);
                self.in_loop(&w.1);
            }
            StmtKind::For(f) => {
                if let Some(e) = &f.init {
                    self.expr(e);
                }
                if let Some(e) = &f.cond {
                    self.expect(e, Ty::Long);
                }
                if let Some(e) = &f.step {
                    self.expr(e);
                }
                self.in_loop(&f.body);
            }
            StmtKind::Foreach(f) => self.foreach(f),
            StmtKind::Break | StmtKind::Continue => {
                if self.scope.loops == 0 {
                    let what = if matches!(s.kind, StmtKind::Break) { "break" } else { "continue" };
                    self.emit(Diagnostic::error(format!("'{what}' outside a loop"), s.span));
                }
            }
            StmtKind::Return(value) => match (self.scope.function, value) {
                (None, _) => self.emit(
                    Diagnostic::error("'return' outside a function", s.span)
                        .with_hint("use 'next' to leave a probe handler"),
                ),
                (Some(_), None) => {}
                (Some(f), Some(e)) => {
                    let want = self.function_ret[f];
                    if want == Ty::Unknown {
                        let got = self.expr(e);
                        if matches!(got, Ty::Long | Ty::Str) {
                            self.function_ret[f] = got;
                            self.changed = true;
                        }
                    } else {
                        self.expect(e, want);
                    }
                }
            },
            StmtKind::Delete(e) => self.delete(e),
            StmtKind::Try(t) => {
                self.block(&t.body);
                if let Some(v) = &t.var {
                    self.set_var(&v.name, Ty::Str, v.span);
                }
                self.block(&t.handler);
            }
        }
    }

    fn in_loop(&mut self, body: &Stmt) {
        self.scope.loops += 1;
        self.stmt(body);
        self.scope.loops -= 1;
    }

    fn delete(&mut self, e: &Expr) {
        match &e.kind {
            ExprKind::Var(name) => {
                if let Some(g) = self.globals.get_mut(name) {
                    g.written = true;
                } else if !self.scope.assigned.contains(name) {
                    self.undefined(name, e.span);
                }
            }
            ExprKind::Index(ix) => {
                self.index_keys(ix, e.span);
            }
            _ => self.emit(
                Diagnostic::error("only variables and array elements can be deleted", e.span)
                    .with_label("not a variable"),
            ),
        }
    }

    fn foreach(&mut self, f: &Foreach) {
        let name = &f.array.name;
        let Some(g) = self.globals.get(name) else {
            self.emit(
                Diagnostic::error(format!("foreach over '{name}', which is not a global array"), f.array.span)
                    .with_hint(format!("declare it with 'global {name}' and index it as {name}[k]")),
            );
            return;
        };
        let (value_ty, shape) = (g.value, g.shape);
        if shape == Shape::Scalar {
            self.emit(Diagnostic::error(format!("foreach over scalar '{name}'"), f.array.span));
            return;
        }
        let keys = self.array_arity(name, f.keys.len(), f.array.span);
        if let Some(g) = self.globals.get_mut(name) {
            g.read = true;
        }
        for (k, ident) in f.keys.iter().enumerate() {
            let key_ty = keys.get(k).copied().unwrap_or(Ty::Unknown);
            let local = self.local_ty(&ident.name);
            if key_ty == Ty::Unknown && matches!(local, Ty::Long | Ty::Str) {
                self.set_key(name, k, local, ident.span);
            } else {
                self.set_var(&ident.name, key_ty, ident.span);
            }
        }
        if let Some(v) = &f.value {
            if value_ty == Ty::Stats {
                self.emit(
                    Diagnostic::error(format!("cannot bind the aggregates of '{name}' to '{}'", v.name), v.span)
                        .with_hint(format!("use @count({name}[k]), @sum({name}[k]), ... in the body")),
                );
            } else if value_ty == Ty::Unknown {
                let local = self.local_ty(&v.name);
                if matches!(local, Ty::Long | Ty::Str) {
                    self.set_global_value(name, local, v.span);
                }
            } else {
                self.set_var(&v.name, value_ty, v.span);
            }
        }
        if let Some(sort) = f.sort {
            if sort.stat.is_some() && value_ty != Ty::Stats && value_ty != Ty::Unknown {
                self.emit(Diagnostic::error(
                    format!("sorting '{name}' by a statistic, but it is not an aggregate array"),
                    f.array.span,
                ));
            }
        }
        if let Some(limit) = &f.limit {
            self.expect(limit, Ty::Long);
        }
        self.in_loop(&f.body);
    }

    // ----- symbols -----

    pub fn undefined(&mut self, name: &str, span: Span) {
        self.emit(
            Diagnostic::error(format!("undefined variable '{name}'"), span)
                .with_label("never assigned in this body and not a global")
                .with_hint(format!("declare it with 'global {name}' or assign it before use")),
        );
    }

    pub fn local_ty(&self, name: &str) -> Ty {
        self.locals[self.scope.body].get(name).copied().unwrap_or(Ty::Unknown)
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
        let slot = self.locals[self.scope.body].entry(name.to_string()).or_insert(Ty::Unknown);
        if *slot == Ty::Unknown {
            *slot = ty;
            self.changed = true;
        } else if *slot != ty {
            let have = *slot;
            self.clash(name, have, ty, span);
        }
    }

    pub fn set_global_value(&mut self, name: &str, ty: Ty, span: Span) {
        let Some(g) = self.globals.get_mut(name) else { return };
        if g.value == Ty::Unknown {
            g.value = ty;
            self.changed = true;
        } else if g.value != ty {
            let have = g.value;
            self.clash(name, have, ty, span);
        }
    }

    pub fn set_key(&mut self, name: &str, k: usize, ty: Ty, span: Span) {
        let Some(g) = self.globals.get_mut(name) else { return };
        let Some(slot) = g.keys.get_mut(k) else { return };
        if *slot == Ty::Unknown {
            *slot = ty;
            self.changed = true;
        } else if *slot != ty && ty != Ty::Unknown {
            let have = *slot;
            self.emit(
                Diagnostic::error(
                    format!("type mismatch: key {} of '{name}' is a {have}, not a {ty}", k + 1),
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
        let Some(g) = self.globals.get_mut(name) else { return Vec::new() };
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
        self.globals.get(name).map(|g| g.keys.clone()).unwrap_or_default()
    }
}

/// Whether any `return expr` occurs in `stmts`.
fn returns_value(stmts: &[Stmt]) -> bool {
    stmts.iter().any(|s| match &s.kind {
        StmtKind::Return(Some(_)) => true,
        StmtKind::Block(b) => returns_value(&b.stmts),
        StmtKind::If(i) => {
            returns_value(std::slice::from_ref(&i.then))
                || i.els.as_ref().is_some_and(|e| returns_value(std::slice::from_ref(e)))
        }
        StmtKind::While(w) => returns_value(std::slice::from_ref(&w.1)),
        StmtKind::For(f) => returns_value(std::slice::from_ref(&f.body)),
        StmtKind::Foreach(f) => returns_value(std::slice::from_ref(&f.body)),
        StmtKind::Try(t) => returns_value(&t.body.stmts) || returns_value(&t.handler.stmts),
        _ => false,
    })
}

/// Names a body assigns: they are its locals (unless global).
fn collect_assigned(stmts: &[Stmt], out: &mut HashSet<String>) {
    for s in stmts {
        match &s.kind {
            StmtKind::Expr(e) | StmtKind::Delete(e) => collect_expr(e, out),
            StmtKind::Return(Some(e)) => collect_expr(e, out),
            StmtKind::Block(b) => collect_assigned(&b.stmts, out),
            StmtKind::If(i) => {
                collect_expr(&i.cond, out);
                collect_assigned(std::slice::from_ref(&i.then), out);
                if let Some(e) = &i.els {
                    collect_assigned(std::slice::from_ref(e), out);
                }
            }
            StmtKind::While(w) => {
                collect_expr(&w.0, out);
                collect_assigned(std::slice::from_ref(&w.1), out);
            }
            StmtKind::For(f) => {
                for e in [&f.init, &f.cond, &f.step].into_iter().flatten() {
                    collect_expr(e, out);
                }
                collect_assigned(std::slice::from_ref(&f.body), out);
            }
            StmtKind::Foreach(f) => {
                out.extend(f.keys.iter().map(|k| k.name.clone()));
                out.extend(f.value.iter().map(|v| v.name.clone()));
                if let Some(l) = &f.limit {
                    collect_expr(l, out);
                }
                collect_assigned(std::slice::from_ref(&f.body), out);
            }
            StmtKind::Try(t) => {
                collect_assigned(&t.body.stmts, out);
                out.extend(t.var.iter().map(|v| v.name.clone()));
                collect_assigned(&t.handler.stmts, out);
            }
            _ => {}
        }
    }
}

fn collect_expr(e: &Expr, out: &mut HashSet<String>) {
    match &e.kind {
        ExprKind::Assign(_, parts) | ExprKind::Aggregate(parts) => {
            if let ExprKind::Var(n) = &parts.0.kind {
                out.insert(n.clone());
            }
            collect_expr(&parts.0, out);
            collect_expr(&parts.1, out);
        }
        ExprKind::IncDec(i) => {
            if let ExprKind::Var(n) = &i.target.kind {
                out.insert(n.clone());
            }
        }
        ExprKind::Unary(_, x) | ExprKind::Stat(_, x) | ExprKind::Hist(_, x) => collect_expr(x, out),
        ExprKind::Binary(_, p) => {
            collect_expr(&p.0, out);
            collect_expr(&p.1, out);
        }
        ExprKind::Ternary(p) => {
            collect_expr(&p.0, out);
            collect_expr(&p.1, out);
            collect_expr(&p.2, out);
        }
        ExprKind::Index(ix) => ix.keys.iter().for_each(|k| collect_expr(k, out)),
        ExprKind::Call(c) => c.args.iter().for_each(|a| collect_expr(a, out)),
        ExprKind::In(i) => i.keys.iter().for_each(|k| collect_expr(k, out)),
        ExprKind::Num(_) | ExprKind::Str(_) | ExprKind::Var(_) | ExprKind::Target(_) => {}
    }
}
