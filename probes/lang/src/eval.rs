//! Tree-walking evaluator for checked programs. Every failure (division by zero, MAXACTION,
//! MAXMAPENTRIES, MAXNESTING, empty aggregates, unreadable guest memory, `error()`) is a
//! [`ScriptError`] for the session to report; nothing here panics on script input.

use std::collections::HashMap;

use indexmap::IndexMap;

use super::ast::*;
use super::check::{Program, Shape, Ty};
use super::context::Context;
use super::limits::Limits;
use super::output::Output;
use super::value::{truncate, Stats, Value};

/// A runtime error of the script, reported like SystemTap's `ERROR: ... near ...`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ScriptError {
    /// What went wrong.
    pub message: String,
    /// The construct that failed.
    pub span: Span,
}

/// Why evaluation stopped early: an error, `next` leaving the probe handler, or the output's
/// reader gone (not an error of the script; `try` does not catch it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stop {
    Error(ScriptError),
    Next,
    OutputClosed,
}

pub(crate) type EResult<T> = Result<T, Stop>;

/// A failed write of the script's output: [`Stop::OutputClosed`] for a broken pipe, else a
/// script error.
pub(crate) fn output_failed<T>(e: &std::io::Error, span: Span) -> EResult<T> {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Err(Stop::OutputClosed)
    } else {
        fail(format!("output failed: {e}"), span)
    }
}

pub(crate) fn fail<T>(message: impl Into<String>, span: Span) -> EResult<T> {
    Err(Stop::Error(ScriptError {
        message: message.into(),
        span,
    }))
}

/// How a statement finished.
pub(crate) enum Flow {
    Normal,
    Break,
    Continue,
    Return(Option<Value>),
}

/// Storage of one global.
#[derive(Debug, Clone, PartialEq)]
pub enum Store {
    /// Long or string scalar.
    Scalar(Value),
    /// Scalar aggregate.
    Stats(Stats),
    /// Array of longs or strings.
    Array(IndexMap<Vec<Value>, Value>),
    /// Array of aggregates.
    StatsArray(IndexMap<Vec<Value>, Stats>),
}

/// Local variables of one probe handler or function call.
pub(crate) struct Frame {
    pub body: usize,
    pub locals: HashMap<String, Value>,
}

/// The evaluator's state: globals, limits, output.
pub struct Interp<'p> {
    /// The checked program.
    pub prog: &'p Program,
    /// Limits in force.
    pub limits: Limits,
    /// Globals by name.
    pub globals: HashMap<String, Store>,
    /// Output streams.
    pub out: Output,
    /// Set by `exit()`.
    pub exit_requested: bool,
    pub(crate) actions: u64,
    /// The statements the probe running now may execute: MAXACTION, or
    /// MAXACTION_INTERRUPTIBLE for one that runs in process context on the host.
    pub(crate) action_limit: u64,
    pub(crate) depth: usize,
    pub(crate) rng: u64,
    pub(crate) point: String,
    /// Compiled `=~` patterns.
    pub(crate) regexes: HashMap<String, regex::Regex>,
    /// When the interpreter started: the origin of `get_cycles()` and the local clocks.
    pub(crate) started: std::time::Instant,
    /// Names kernel addresses (symbol, offset, size) in any probe, `end` too, where the
    /// probe's context has no symbols of its own (`sprint_stack()` of a stack kept as a
    /// map key, `symname()` in `end`): set by a runner that has the kernel's symbols.
    pub kernel_symbols: Option<KernelSymbols>,
    /// How far the target's wall clock is ahead of this host's, in ns: `gettimeofday_*()`
    /// and `ctime()` give the host's time plus it, so that probes run on the host (begin,
    /// end, timers, host-evaluated kernel probes) read the clock compiled probes read in
    /// the guest (set by a runner that measured it; 0 otherwise).
    pub clock_offset_ns: i64,
    /// How far the target's clock has fallen behind since the offset was measured, in ns,
    /// asked at each read: the time the guest spent paused where its clocks stand still
    /// then (QEMU TCG). Subtracted from the offset, so a probe run at a stop reads the time
    /// the guest's clock shows at that stop, not one its own stops have pushed ahead.
    pub clock_drift: Option<ClockDrift>,
}

/// A function naming kernel addresses (see [`Interp::kernel_symbols`]).
pub type KernelSymbols = Box<dyn Fn(u64) -> Option<NamedAddress> + Send>;

/// A kernel address named: the symbol that covers it, the offset into it, its size, and
/// the module whose text holds it (`None`: the kernel's own text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedAddress {
    /// The symbol.
    pub name: String,
    /// The address less the symbol's.
    pub offset: u64,
    /// The symbol's size.
    pub size: u64,
    /// The module, if any.
    pub module: Option<String>,
}

impl NamedAddress {
    /// The same name at another offset (a return address printed one past its lookup).
    pub fn with_offset(self, offset: u64) -> Self {
        Self { offset, ..self }
    }

    /// As SystemTap's `symdata()` and `print_syms()` name it: `func+0xoff/0xsize [module]`,
    /// `[kernel]` in the kernel's own text.
    pub fn systemtap(&self) -> String {
        format!(
            "{}+{:#x}/{:#x} [{}]",
            self.name,
            self.offset,
            self.size,
            self.module.as_deref().unwrap_or("kernel")
        )
    }
}

/// As the kernel's `%pB` prints it: `func+0xoff/0xsize`, with ` [module]` in a module.
impl std::fmt::Display for NamedAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}+{:#x}/{:#x}", self.name, self.offset, self.size)?;
        match &self.module {
            Some(module) => write!(f, " [{module}]"),
            None => Ok(()),
        }
    }
}

/// See [`Interp::clock_drift`].
pub type ClockDrift = Box<dyn Fn() -> i64 + Send>;

impl std::fmt::Debug for Interp<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interp")
            .field("exit_requested", &self.exit_requested)
            .finish_non_exhaustive()
    }
}

pub(crate) fn default_of(ty: Ty) -> Value {
    if ty == Ty::Str {
        Value::Str(String::new())
    } else {
        Value::Long(0)
    }
}

impl<'p> Interp<'p> {
    /// A fresh evaluator with globals at their initial values.
    pub fn new(prog: &'p Program, limits: Limits, out: Output) -> Self {
        let mut me = Interp {
            prog,
            limits,
            globals: HashMap::new(),
            out,
            exit_requested: false,
            actions: 0,
            action_limit: 0,
            depth: 0,
            rng: 0x2545_f491_4f6c_dd1d,
            point: String::new(),
            regexes: HashMap::new(),
            started: std::time::Instant::now(),
            kernel_symbols: None,
            clock_offset_ns: 0,
            clock_drift: None,
        };
        me.action_limit = me.limits.max_action;
        for name in prog.globals.keys() {
            let store = me.initial(name);
            me.globals.insert(name.clone(), store);
        }
        me
    }

    fn initial(&self, name: &str) -> Store {
        let Some(g) = self.prog.globals.get(name) else {
            return Store::Scalar(Value::Long(0));
        };
        match (g.shape, g.value) {
            (Shape::Array, Ty::Stats) => Store::StatsArray(IndexMap::new()),
            (Shape::Array, _) => Store::Array(IndexMap::new()),
            (_, Ty::Stats) => Store::Stats(Stats::new(g.hist)),
            (_, ty) => Store::Scalar(match &g.init {
                Some(Literal::Num(n)) => Value::Long(*n),
                Some(Literal::Str(s)) => {
                    Value::Str(truncate(s.clone(), self.limits.max_string_len))
                }
                None => default_of(ty),
            }),
        }
    }

    pub(crate) fn string(&self, s: String) -> Value {
        Value::Str(truncate(s, self.limits.max_string_len))
    }

    /// Runs the handler of probe `index` as fired at `point` on `ctx`.
    ///
    /// # Errors
    /// The script error that ended the handler.
    pub fn run_probe(
        &mut self,
        index: usize,
        point: &str,
        ctx: &dyn Context,
    ) -> Result<(), ScriptError> {
        self.run_probe_with(index, point, ctx, Vec::new())
    }

    /// Runs the handler of probe `index` with `locals` set first (`input.char`'s `char`).
    ///
    /// # Errors
    /// The script error that ended the handler.
    pub fn run_probe_with(
        &mut self,
        index: usize,
        point: &str,
        ctx: &dyn Context,
        locals: Vec<(String, Value)>,
    ) -> Result<(), ScriptError> {
        self.run_probe_keeping(index, point, ctx, locals, None)
            .map(drop)
    }

    /// [`Interp::run_probe_with`], returning the value local `keep` holds at the end (a
    /// procfs read probe's `$value`), also after `next`.
    ///
    /// # Errors
    /// The script error that ended the handler.
    pub fn run_probe_keeping(
        &mut self,
        index: usize,
        point: &str,
        ctx: &dyn Context,
        locals: Vec<(String, Value)>,
        keep: Option<&str>,
    ) -> Result<Option<Value>, ScriptError> {
        let prog = self.prog;
        let Some(probe) = prog.script.probes.get(index) else {
            return Ok(None);
        };
        self.actions = 0;
        // As SystemTap: a probe that runs in process context (begin, end, procfs; here also
        // every probe the host runs on its own, timers and input) may run ten times longer.
        let host_side = prog.probes.get(index).is_some_and(|p| {
            !p.points.is_empty() && p.points.iter().all(|(_, k)| !k.needs_guest())
        });
        self.action_limit = if host_side {
            self.limits.max_action_interruptible()
        } else {
            self.limits.max_action
        };
        self.depth = 0;
        self.point = point.to_string();
        let mut frame = Frame {
            body: index,
            locals: locals.into_iter().collect(),
        };
        let result = (|| {
            if let Some(cond) = &probe.condition {
                if self.eval(cond, &mut frame, ctx)?.as_long() == 0 {
                    return Ok(Flow::Normal);
                }
            }
            self.block(&probe.body, &mut frame, ctx)
        })();
        match result {
            Ok(_) | Err(Stop::Next | Stop::OutputClosed) => {
                Ok(keep.and_then(|k| frame.locals.remove(k)))
            }
            Err(Stop::Error(e)) => Err(e),
        }
    }

    /// The entry side of return probe `index`'s `@entry(...)` expressions: each one's inner
    /// expression evaluated on `ctx` (the function's entry) and kept under its
    /// [`entry_key`](super::context::entry_key), as SystemTap's implicit entry probe does; the
    /// return probe of the same call then reads them through [`Context::entry_value`]. Empty
    /// when the probe has none. An error is kept too and raised where the value is used.
    pub fn entry_values(
        &mut self,
        index: usize,
        point: &str,
        ctx: &dyn Context,
    ) -> Vec<(usize, Result<Value, String>)> {
        let prog = self.prog;
        let Some(probe) = prog.script.probes.get(index) else {
            return Vec::new();
        };
        let mut entries = Vec::new();
        let mut collect = |e: &'p Expr| {
            if matches!(e.kind, ExprKind::Entry(_)) {
                entries.push(e);
            }
        };
        if let Some(cond) = &probe.condition {
            crate::walk::expr_all(cond, &mut collect);
        }
        crate::walk::block_exprs(&probe.body, &mut collect);
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
            let ExprKind::Entry(x) = &e.kind else {
                continue;
            };
            self.actions = 0;
            self.action_limit = self.limits.max_action;
            self.depth = 0;
            self.point = point.to_string();
            let mut frame = Frame {
                body: index,
                locals: HashMap::new(),
            };
            let v = match self.eval(x, &mut frame, ctx) {
                Ok(v) => Ok(v),
                Err(Stop::Error(e)) => Err(e.message),
                Err(Stop::Next) => Err("'next' while evaluating @entry(...)".to_string()),
                Err(Stop::OutputClosed) => Err("the output's reader went away".to_string()),
            };
            out.push((super::context::entry_key(e), v));
        }
        out
    }

    pub(crate) fn tick(&mut self, span: Span) -> EResult<()> {
        self.actions += 1;
        if self.actions > self.action_limit {
            return fail("MAXACTION exceeded", span);
        }
        Ok(())
    }

    pub(crate) fn block(&mut self, b: &Block, f: &mut Frame, ctx: &dyn Context) -> EResult<Flow> {
        for s in &b.stmts {
            match self.stmt(s, f, ctx)? {
                Flow::Normal => {}
                other => return Ok(other),
            }
        }
        Ok(Flow::Normal)
    }

    fn stmt(&mut self, s: &Stmt, f: &mut Frame, ctx: &dyn Context) -> EResult<Flow> {
        self.tick(s.span)?;
        match &s.kind {
            StmtKind::Empty => {}
            StmtKind::Block(b) => return self.block(b, f, ctx),
            StmtKind::Expr(e) => {
                self.eval(e, f, ctx)?;
            }
            StmtKind::If(i) => {
                if self.eval(&i.cond, f, ctx)?.as_long() != 0 {
                    return self.stmt(&i.then, f, ctx);
                } else if let Some(e) = &i.els {
                    return self.stmt(e, f, ctx);
                }
            }
            StmtKind::While(w) => {
                while self.eval(&w.0, f, ctx)?.as_long() != 0 {
                    self.tick(s.span)?;
                    match self.stmt(&w.1, f, ctx)? {
                        Flow::Break => break,
                        Flow::Return(v) => return Ok(Flow::Return(v)),
                        Flow::Normal | Flow::Continue => {}
                    }
                }
            }
            StmtKind::For(fs) => {
                if let Some(e) = &fs.init {
                    self.eval(e, f, ctx)?;
                }
                loop {
                    if let Some(c) = &fs.cond {
                        if self.eval(c, f, ctx)?.as_long() == 0 {
                            break;
                        }
                    }
                    self.tick(s.span)?;
                    match self.stmt(&fs.body, f, ctx)? {
                        Flow::Break => break,
                        Flow::Return(v) => return Ok(Flow::Return(v)),
                        Flow::Normal | Flow::Continue => {}
                    }
                    if let Some(e) = &fs.step {
                        self.eval(e, f, ctx)?;
                    }
                }
            }
            StmtKind::Foreach(fe) => return self.foreach(fe, f, ctx),
            StmtKind::Next => return Err(Stop::Next),
            StmtKind::Break => return Ok(Flow::Break),
            StmtKind::Continue => return Ok(Flow::Continue),
            StmtKind::Return(v) => {
                let v = match v {
                    Some(e) => Some(self.eval(e, f, ctx)?),
                    None => None,
                };
                return Ok(Flow::Return(v));
            }
            StmtKind::Delete(e) => self.delete(e, f, ctx)?,
            StmtKind::Try(t) => match self.block(&t.body, f, ctx) {
                Err(Stop::Error(err)) => {
                    if let Some(v) = &t.var {
                        let msg = self.string(err.message);
                        f.locals.insert(v.name.clone(), msg);
                    }
                    return self.block(&t.handler, f, ctx);
                }
                other => return other,
            },
        }
        Ok(Flow::Normal)
    }

    fn delete(&mut self, e: &Expr, f: &mut Frame, ctx: &dyn Context) -> EResult<()> {
        match &e.kind {
            ExprKind::Var(name) => {
                if self.globals.contains_key(name) {
                    let fresh = match self.prog.globals.get(name).map(|g| (g.shape, g.value)) {
                        Some((Shape::Array, _)) | Some((_, Ty::Stats)) => self.initial(name),
                        Some((_, ty)) => Store::Scalar(default_of(ty)),
                        None => return Ok(()),
                    };
                    self.globals.insert(name.clone(), fresh);
                } else {
                    let ty = self.local_ty(f, name);
                    f.locals.insert(name.clone(), default_of(ty));
                }
            }
            ExprKind::Index(ix) if ix.keys.iter().any(|k| matches!(k.kind, ExprKind::Wildcard)) => {
                // `delete a[k, *]`: every entry whose named keys match.
                let mut pattern = Vec::with_capacity(ix.keys.len());
                for k in &ix.keys {
                    pattern.push(match k.kind {
                        ExprKind::Wildcard => None,
                        _ => Some(self.eval(k, f, ctx)?),
                    });
                }
                let hit = |keys: &Vec<Value>| {
                    keys.iter()
                        .zip(&pattern)
                        .all(|(k, p)| p.as_ref().is_none_or(|p| p == k))
                };
                match self.globals.get_mut(&ix.array.name) {
                    Some(Store::Array(m)) => m.retain(|k, _| !hit(k)),
                    Some(Store::StatsArray(m)) => m.retain(|k, _| !hit(k)),
                    _ => {}
                }
            }
            ExprKind::Index(ix) => {
                let keys = self.keys(&ix.keys, f, ctx)?;
                match self.globals.get_mut(&ix.array.name) {
                    Some(Store::Array(m)) => {
                        m.shift_remove(&keys);
                    }
                    Some(Store::StatsArray(m)) => {
                        m.shift_remove(&keys);
                    }
                    _ => {}
                }
            }
            _ => {}
        }
        Ok(())
    }

    pub(crate) fn local_ty(&self, f: &Frame, name: &str) -> Ty {
        self.prog
            .locals
            .get(f.body)
            .and_then(|m| m.get(name))
            .copied()
            .unwrap_or(Ty::Long)
    }

    pub(crate) fn keys(
        &mut self,
        keys: &[Expr],
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<Vec<Value>> {
        keys.iter().map(|k| self.eval(k, f, ctx)).collect()
    }

    fn foreach(&mut self, fe: &Foreach, f: &mut Frame, ctx: &dyn Context) -> EResult<Flow> {
        let limit = match &fe.limit {
            Some(e) => Some(self.eval(e, f, ctx)?.as_long()),
            None => None,
        };
        // `in a[k, *]`: the keys to match, None for `*`.
        let slice: Option<Vec<Option<Value>>> = match &fe.slice {
            Some(keys) => Some(
                keys.iter()
                    .map(|k| match k.kind {
                        ExprKind::Wildcard => Ok(None),
                        _ => self.eval(k, f, ctx).map(Some),
                    })
                    .collect::<EResult<_>>()?,
            ),
            None => None,
        };
        // Iterate over a snapshot, so the body may change the array freely.
        let stat = fe.sort.and_then(|s| s.stat).unwrap_or(StatOp::Count);
        let mut rows: Vec<(Vec<Value>, Value)> = match self.globals.get(&fe.array.name) {
            Some(Store::Array(m)) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Some(Store::StatsArray(m)) => m
                .iter()
                .map(|(k, s)| (k.clone(), Value::Long(stat_value(s, stat).unwrap_or(0))))
                .collect(),
            _ => Vec::new(),
        };
        if let Some(slice) = &slice {
            rows.retain(|(keys, _)| {
                keys.iter()
                    .zip(slice)
                    .all(|(k, want)| want.as_ref().is_none_or(|w| w == k))
            });
        }
        if let Some(sort) = fe.sort {
            sort_rows(&mut rows, sort);
        }
        let is_stats = matches!(self.globals.get(&fe.array.name), Some(Store::StatsArray(_)));
        for (n, (keys, value)) in rows.into_iter().enumerate() {
            if limit.is_some_and(|l| n as i64 >= l) {
                break;
            }
            self.tick(fe.array.span)?;
            for (ident, k) in fe.keys.iter().zip(keys) {
                f.locals.insert(ident.name.clone(), k);
            }
            if let (Some(v), false) = (&fe.value, is_stats) {
                f.locals.insert(v.name.clone(), value);
            }
            match self.stmt(&fe.body, f, ctx)? {
                Flow::Break => break,
                Flow::Return(v) => return Ok(Flow::Return(v)),
                Flow::Normal | Flow::Continue => {}
            }
        }
        Ok(Flow::Normal)
    }
}

/// Sorts foreach rows; ties fall back to the keys in order, so output is deterministic.
pub(crate) fn sort_rows(rows: &mut [(Vec<Value>, Value)], sort: Sort) {
    rows.sort_by(|a, b| {
        let primary = match sort.key {
            SortKey::Value => a.1.compare(&b.1),
            SortKey::Key(i) => match (a.0.get(i), b.0.get(i)) {
                (Some(x), Some(y)) => x.compare(y),
                _ => std::cmp::Ordering::Equal,
            },
        };
        let primary = if sort.descending {
            primary.reverse()
        } else {
            primary
        };
        primary.then_with(|| a.0.cmp(&b.0))
    });
}

/// A statistic of an aggregate; None when it needs data and there is none.
pub(crate) fn stat_value(s: &Stats, op: StatOp) -> Option<i64> {
    if op == StatOp::Count {
        return Some(s.count);
    }
    if s.count == 0 {
        return None;
    }
    Some(match op {
        StatOp::Count => s.count,
        StatOp::Sum => s.sum,
        StatOp::Min => s.min,
        StatOp::Max => s.max,
        StatOp::Avg => s.avg().unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::check;
    use crate::context::CapturedContext;
    use crate::output::{Format, SharedBuf};
    use crate::parser::parse;

    fn run_with(
        src: &str,
        limits: Limits,
        ctx: &CapturedContext,
    ) -> (String, Result<(), ScriptError>) {
        let prog = check(parse(src, &Limits::default()).unwrap()).unwrap();
        let buf = SharedBuf::default();
        let out = Output::new(
            Format::Text,
            Box::new(buf.clone()),
            Box::new(std::io::sink()),
        );
        let mut interp = Interp::new(&prog, limits, out);
        let r = interp.run_probe(0, "test", ctx);
        (buf.contents(), r)
    }

    fn run(src: &str) -> (String, Result<(), ScriptError>) {
        run_with(src, Limits::default(), &CapturedContext::default())
    }

    #[test]
    fn division_by_zero_is_a_script_error() {
        let (_, r) = run("probe begin { z = 0; x = 1 / z }");
        assert_eq!(r.unwrap_err().message, "division by 0");
    }

    #[test]
    fn minimum_long_divided_by_minus_one_wraps() {
        let (out, r) =
            run("probe begin { m = -9223372036854775808; n = -1; println(m / n, \" \", m % n) }");
        r.unwrap();
        assert_eq!(out, "-9223372036854775808 0\n");
    }

    #[test]
    fn an_elements_keys_are_evaluated_once_in_an_update() {
        // SystemTap moves `n` once per update; so does the compiled code.
        let (out, r) = run(
            "global r, n; probe begin { r[++n]++; r[++n] += 5; r[n++] -= 1; \
             x = r[++n]--; foreach (k in r) printf(\"%d=%d \", k, r[k]); println(n, \" \", x) }",
        );
        r.unwrap();
        assert_eq!(out, "1=1 2=4 4=-1 4 0\n");
    }

    #[test]
    fn infinite_loop_hits_maxaction() {
        let (_, r) = run("probe begin { for (;;) { } }");
        assert_eq!(r.unwrap_err().message, "MAXACTION exceeded");
    }

    /// SystemTap's MAXACTION_INTERRUPTIBLE: a begin probe runs ten times MAXACTION's
    /// statements (ansi_colors.stp's table); a kernel probe stays at MAXACTION.
    #[test]
    fn host_side_probes_run_ten_times_maxaction() {
        let loop_of = |n: u32| format!("for (i = 0; i < {n}; i++) {{ x += i }} println(x)");
        let (out, r) = run(&format!("probe begin {{ {} }}", loop_of(3000)));
        r.unwrap();
        assert_eq!(out, "4498500\n");
        let (_, r) = run(&format!("probe begin {{ {} }}", loop_of(6000)));
        assert_eq!(r.unwrap_err().message, "MAXACTION exceeded");
        let (_, r) = run(&format!(
            "probe kernel.function(\"vfs_read\") {{ {} }}",
            loop_of(3000)
        ));
        assert_eq!(r.unwrap_err().message, "MAXACTION exceeded");
        // -D MAXACTION_INTERRUPTIBLE=N sets it apart from MAXACTION.
        let mut limits = Limits::default();
        limits.set("MAXACTION_INTERRUPTIBLE=100").unwrap();
        let (_, r) = run_with(
            &format!("probe begin {{ {} }}", loop_of(100)),
            limits,
            &CapturedContext::default(),
        );
        assert_eq!(r.unwrap_err().message, "MAXACTION exceeded");
    }

    #[test]
    fn unbounded_recursion_hits_maxnesting() {
        let (_, r) = run("function f:long (n:long) { return f(n) }\nprobe begin { f(1) }");
        assert_eq!(r.unwrap_err().message, "MAXNESTING exceeded");
    }

    #[test]
    fn strings_are_cut_to_maxstringlen() {
        let limits = Limits {
            max_string_len: 4,
            ..Limits::default()
        };
        let (out, r) = run_with(
            "probe begin { println(\"abcdef\" . \"gh\") }",
            limits,
            &CapturedContext::default(),
        );
        r.unwrap();
        assert_eq!(out, "abc\n");
    }

    #[test]
    fn target_variables_come_from_the_captured_context() {
        let mut ctx = CapturedContext::default();
        ctx.targets.insert("$count".into(), Value::Long(4096));
        ctx.targets.insert("$file->f_pos".into(), Value::Long(7));
        let (out, r) = run_with(
            "probe kernel.function(\"vfs_read\") { printf(\"%d %d\\n\", $count, $file->f_pos) }",
            Limits::default(),
            &ctx,
        );
        r.unwrap();
        assert_eq!(out, "4096 7\n");
    }

    #[test]
    fn missing_target_variable_is_a_script_error() {
        let (_, r) = run("probe kernel.function(\"f\") { println($nope) }");
        assert!(r.unwrap_err().message.contains("$nope"));
    }

    #[test]
    fn kernel_string_reads_captured_memory() {
        let ctx = CapturedContext {
            memory: vec![(0x1000, b"bash\0junk".to_vec())],
            ..Default::default()
        };
        let (out, r) = run_with(
            "probe kernel.function(\"f\") { println(kernel_string(0x1000)) }",
            Limits::default(),
            &ctx,
        );
        r.unwrap();
        assert_eq!(out, "bash\n");
    }

    #[test]
    fn kernel_string_n_and_user_string_n_stop_at_n_bytes_or_the_nul() {
        let ctx = CapturedContext {
            memory: vec![(0x1000, b"bash\0junk\0".to_vec())],
            ..Default::default()
        };
        let (out, r) = run_with(
            "probe kernel.function(\"f\") { println(kernel_string_n(0x1000, 2), \"|\", \
             user_string_n(0x1000, 9), \"|\", user_string_n(0x1000, -1), \"|\", user_string(0x1005)) }",
            Limits::default(),
            &ctx,
        );
        r.unwrap();
        assert_eq!(out, "ba|bash||junk\n");
    }

    #[test]
    fn a_string_at_maxstringlen_stops_one_byte_short_without_reading_past_it() {
        // 7 readable bytes and no NUL: with MAXSTRINGLEN 8 the string is the 7 bytes, and the
        // unreadable eighth byte is never read.
        let ctx = CapturedContext {
            memory: vec![(0x1000, b"abcdefg".to_vec())],
            ..Default::default()
        };
        let limits = Limits {
            max_string_len: 8,
            ..Limits::default()
        };
        let (out, r) = run_with(
            "probe kernel.function(\"f\") { println(kernel_string(0x1000)) }",
            limits,
            &ctx,
        );
        r.unwrap();
        assert_eq!(out, "abcdefg\n");
    }

    #[test]
    fn user_string_of_an_unreadable_address_is_a_script_error() {
        let (_, r) = run("probe kernel.function(\"f\") { println(user_string(1)) }");
        assert!(r.unwrap_err().message.contains("user string copy fault"));
    }

    #[test]
    fn kernel_string_without_memory_is_a_script_error() {
        let (_, r) = run("probe kernel.function(\"f\") { println(kernel_string(0x1000)) }");
        assert!(r.unwrap_err().message.contains("kernel string copy fault"));
    }

    #[test]
    fn foreach_iterates_a_snapshot_so_deleting_is_safe() {
        let (out, r) = run("global a\nprobe begin { a[1]=1; a[2]=2; foreach (k+ in a) { delete a[k]; print(k) } println(\"\") }");
        r.unwrap();
        assert_eq!(out, "12\n");
    }

    #[test]
    fn sprint_of_a_histogram_is_its_text() {
        let (out, r) = run(
            "global s\nprobe begin { s <<< 1; t = sprint(@hist_log(s)); print(strlen(t) > 0) }",
        );
        r.unwrap();
        assert_eq!(out, "1");
    }

    #[test]
    fn probe_condition_false_skips_the_body() {
        let (out, r) = run("probe begin if (1 > 2) { println(\"x\") }");
        r.unwrap();
        assert_eq!(out, "");
    }

    /// A context at a return that also answers `@entry(...)` with what the entry evaluated.
    struct AtReturn {
        here: CapturedContext,
        entry: Vec<(usize, Result<Value, String>)>,
    }

    impl Context for AtReturn {
        fn target(&self, path: &str) -> Option<Value> {
            self.here.target(path)
        }
        fn pid(&self) -> i64 {
            self.here.pid
        }
        fn tid(&self) -> i64 {
            self.here.tid
        }
        fn ppid(&self) -> i64 {
            self.here.ppid
        }
        fn uid(&self) -> i64 {
            self.here.uid
        }
        fn execname(&self) -> String {
            self.here.execname.clone()
        }
        fn cpu(&self) -> i64 {
            self.here.cpu
        }
        fn probefunc(&self) -> String {
            self.here.probefunc.clone()
        }
        fn read_kernel(
            &self,
            addr: u64,
            len: usize,
        ) -> Result<Vec<u8>, crate::context::MemoryError> {
            self.here.read_kernel(addr, len)
        }
        fn entry_value(&self, key: usize) -> Option<Result<Value, String>> {
            self.entry
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.clone())
        }
    }

    fn captured(execname: &str, f_pos: i64) -> CapturedContext {
        let mut ctx = CapturedContext {
            execname: execname.into(),
            ..CapturedContext::default()
        };
        ctx.targets
            .insert("$file->f_pos".into(), Value::Long(f_pos));
        ctx.targets.insert("$file".into(), Value::Long(0x1000));
        ctx
    }

    /// Probe 0 bumps `g`; probe 1 is the return probe. Runs: g++, the entry side of probe 1
    /// on `entry`, g++ `between` times, probe 1 on `ret`. Returns its output.
    fn entry_then_return(
        src: &str,
        entry: &CapturedContext,
        between: usize,
        ret: CapturedContext,
    ) -> (String, Result<(), ScriptError>) {
        let prog = check(parse(src, &Limits::default()).unwrap()).unwrap();
        let buf = SharedBuf::default();
        let out = Output::new(
            Format::Text,
            Box::new(buf.clone()),
            Box::new(std::io::sink()),
        );
        let mut interp = Interp::new(&prog, Limits::default(), out);
        interp.run_probe(0, "begin", entry).unwrap();
        let values = interp.entry_values(1, "f.return", entry);
        for _ in 0..between {
            interp.run_probe(0, "begin", entry).unwrap();
        }
        let ctx = AtReturn {
            here: ret,
            entry: values,
        };
        let r = interp.run_probe(1, "f.return", &ctx);
        (buf.contents(), r)
    }

    #[test]
    fn entry_of_expressions_is_their_value_at_the_entry_of_the_call() {
        // At the entry: execname "sh", $file->f_pos 7, g 1. At the return: "cat", 9, g 3.
        let (out, r) = entry_then_return(
            "global g\nprobe begin { g++ }\n\
             probe kernel.function(\"f\").return {\n\
               printf(\"%s %s %d %d %d %d %d\\n\", @entry(execname()), execname(),\n\
                 @entry($file->f_pos), $file->f_pos, @entry(g), g, @entry(g * 10 + 1))\n\
             }",
            &captured("sh", 7),
            2,
            captured("cat", 9),
        );
        r.unwrap();
        assert_eq!(out, "sh cat 7 9 1 3 11\n");
    }

    #[test]
    fn entry_of_the_clock_measures_the_call() {
        let src = "global g\nprobe begin { g++ }\n\
             probe kernel.function(\"f\").return {\n\
               println(gettimeofday_us() - @entry(gettimeofday_us()))\n\
             }";
        let prog = check(parse(src, &Limits::default()).unwrap()).unwrap();
        let buf = SharedBuf::default();
        let out = Output::new(
            Format::Text,
            Box::new(buf.clone()),
            Box::new(std::io::sink()),
        );
        let mut interp = Interp::new(&prog, Limits::default(), out);
        let entry = captured("sh", 0);
        let values = interp.entry_values(1, "f.return", &entry);
        let slept = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let ctx = AtReturn {
            here: captured("sh", 0),
            entry: values,
        };
        interp.run_probe(1, "f.return", &ctx).unwrap();
        let elapsed_after = slept.elapsed().as_micros() as i64;
        let us: i64 = buf.contents().trim().parse().unwrap();
        // At least the 20 ms slept between entry and return, and at most what passed since
        // just before the entry value was taken... plus the clock's microsecond rounding.
        assert!(us >= 19_999, "{us} us < the 20 ms between entry and return");
        assert!(
            us <= elapsed_after + 1_000,
            "{us} us > {elapsed_after} us elapsed"
        );
    }

    #[test]
    fn an_error_at_the_entry_is_raised_where_its_value_is_used() {
        let (out, r) = entry_then_return(
            "global g\nprobe begin { g = 0 }\n\
             probe kernel.function(\"f\").return { println(\"before\"); println(@entry(1 / g)) }",
            &captured("sh", 0),
            0,
            captured("sh", 0),
        );
        assert_eq!(out, "before\n");
        assert_eq!(
            r.unwrap_err().message,
            "@entry(...) at the entry: division by 0"
        );
    }

    #[test]
    fn entry_of_an_expression_without_entry_values_names_what_is_missing() {
        let (_, r) = run("probe kernel.function(\"f\").return { println(@entry(execname())) }");
        let why = r.unwrap_err().message;
        assert!(why.contains("evaluated at the function's entry"), "{why}");
    }
}
