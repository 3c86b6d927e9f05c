//! Expression evaluation: operators, variables, arrays, aggregates and calls.

use std::collections::HashMap;

use super::ast::*;
use super::check::Ty;
use super::context::Context;
use super::eval::{default_of, fail, stat_value, EResult, Flow, Frame, Interp, Stop, Store};
use super::point::PROCFS_VALUE;
use super::value::{Stats, Value};

impl Interp<'_> {
    /// Evaluates `e`.
    /// The values of a `@cast` chain's computed subscripts (`->fd[i]`), in order, after its
    /// pointer (the compiled code's order too).
    fn cast_indexes(
        &mut self,
        c: &crate::ast::CastExpr,
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<Vec<i64>> {
        c.indexes
            .iter()
            .map(|i| Ok(self.eval(i, f, ctx)?.as_long()))
            .collect()
    }

    pub(crate) fn eval(&mut self, e: &Expr, f: &mut Frame, ctx: &dyn Context) -> EResult<Value> {
        Ok(match &e.kind {
            ExprKind::Num(n) => Value::Long(*n),
            ExprKind::Str(s) => self.string(s.clone()),
            ExprKind::Var(_) | ExprKind::Index(_) => self.load(e, None, f, ctx)?,
            ExprKind::Target(t) => match ctx.target(&t.path()) {
                Some(v) => v,
                // A kernel global (`@var`) answers its read error through `member_chain`.
                None => match (
                    t.members.is_empty() && !t.name.starts_with("@var("),
                    ctx.member_chain(t),
                ) {
                    (false, Some(Ok(v))) => v,
                    (false, Some(Err(why))) => return fail(why, e.span),
                    _ => {
                        return fail(
                            format!("target variable '{}' is not available here", t.path()),
                            e.span,
                        )
                    }
                },
            },
            ExprKind::Unary(op, x) => {
                let v = self.eval(x, f, ctx)?.as_long();
                Value::Long(match op {
                    UnOp::Neg => v.wrapping_neg(),
                    UnOp::Plus => v,
                    UnOp::Not => i64::from(v == 0),
                    UnOp::BitNot => !v,
                })
            }
            ExprKind::Binary(op, p) => self.binary(*op, &p.0, &p.1, e.span, f, ctx)?,
            ExprKind::Ternary(p) => {
                if self.eval(&p.0, f, ctx)?.as_long() != 0 {
                    self.eval(&p.1, f, ctx)?
                } else {
                    self.eval(&p.2, f, ctx)?
                }
            }
            // An element's keys are evaluated once, after the value (as SystemTap does, and
            // the compiled code: `a[i++] += 1` moves `i` once).
            ExprKind::Assign(op, p) => {
                let rhs = self.eval(&p.1, f, ctx)?;
                let keys = self.element_keys(&p.0, f, ctx)?;
                let v = match op {
                    None => rhs,
                    // A procfs file's contents grow past MAXSTRINGLEN (up to the read's
                    // maxsize, which the host applies), as stap's procfs buffer does.
                    Some(BinOp::Concat) if matches!(&p.0.kind, ExprKind::Var(n) if n == PROCFS_VALUE) =>
                    {
                        let old = self.load(&p.0, None, f, ctx)?;
                        Value::Str(format!("{}{}", old.as_str(), rhs.as_str()))
                    }
                    Some(op) => {
                        let old = self.load(&p.0, keys.as_deref(), f, ctx)?;
                        self.apply(*op, old, rhs, e.span)?
                    }
                };
                self.store(&p.0, keys, v.clone(), f, ctx)?;
                v
            }
            ExprKind::IncDec(i) => {
                let keys = self.element_keys(&i.target, f, ctx)?;
                let old = self.load(&i.target, keys.as_deref(), f, ctx)?.as_long();
                let new = if i.increment {
                    old.wrapping_add(1)
                } else {
                    old.wrapping_sub(1)
                };
                self.store(&i.target, keys, Value::Long(new), f, ctx)?;
                Value::Long(if i.prefix { new } else { old })
            }
            ExprKind::Aggregate(p) => {
                let v = self.eval(&p.1, f, ctx)?.as_long();
                self.with_stats(&p.0, f, ctx, true, |s| s.add(v))?;
                Value::Long(v)
            }
            ExprKind::Stat(op, target) => {
                let stats = self.stats_of(target, f, ctx)?;
                match stats.as_ref().and_then(|s| stat_value(s, *op)) {
                    Some(v) => Value::Long(v),
                    // As SystemTap: an empty aggregate counts and sums to 0; its
                    // @min/@max/@avg are errors.
                    None if matches!(*op, StatOp::Count | StatOp::Sum) => Value::Long(0),
                    None => return fail("empty aggregate", e.span),
                }
            }
            ExprKind::Variance(target, _) => {
                let stats = self.stats_of(target, f, ctx)?;
                match stats.as_ref().and_then(Stats::variance) {
                    Some(v) => Value::Long(v),
                    None => return fail("empty aggregate", e.span),
                }
            }
            // The value the entry of this call computed, where the backend evaluated it
            // there (host-evaluated return probes do: see `Interp::entry_values`).
            ExprKind::Entry(x) => match ctx.entry_value(super::context::entry_key(e)) {
                Some(Ok(v)) => v,
                Some(Err(why)) => return fail(format!("@entry(...) at the entry: {why}"), e.span),
                None => match &x.kind {
                    // A kernel context answers a parameter with its value at the entry, also
                    // in a .return probe.
                    ExprKind::Target(t) if t.members.is_empty() && t.name.starts_with('$') => {
                        self.eval(x, f, ctx)?
                    }
                    _ => {
                        return fail(
                            "@entry(...) of anything but a parameter needs the expression \
                             evaluated at the function's entry, which this backend does not \
                             do (probes stopped in the live guest do)",
                            e.span,
                        )
                    }
                },
            },
            ExprKind::Defined(x) => Value::Long(i64::from(defined(x, ctx))),
            ExprKind::Cast(c) => {
                let pointer = self.eval(&c.pointer, f, ctx)?.as_long() as u64;
                if c.members.is_empty() && c.indexes.is_empty() {
                    // The pointer itself, whatever the context knows of types.
                    return Ok(Value::Long(pointer as i64));
                }
                let indexes = self.cast_indexes(c, f, ctx)?;
                match ctx.cast(pointer, c, &indexes) {
                    Some(Ok(v)) => return Ok(v),
                    Some(Err(why)) => return fail(why, e.span),
                    None => {}
                }
                return fail(
                    "@cast is not supported at run time yet: reading kernel types needs the \
                     guest's type information, which the interpreter does not have",
                    e.span,
                );
            }
            ExprKind::Embedded(_) => return fail("embedded C code cannot run", e.span),
            ExprKind::Wildcard => return fail("'*' is a key only in delete", e.span),
            ExprKind::AddressOf(x) => {
                let answer = match &x.kind {
                    ExprKind::Target(t) if !t.members.is_empty() => {
                        ctx.member_address(Some(t), None)
                    }
                    // `&@cast(p, "T")`: the structure's address, `p` itself.
                    ExprKind::Cast(c) if c.members.is_empty() && c.indexes.is_empty() => {
                        return self.eval(&c.pointer, f, ctx);
                    }
                    ExprKind::Cast(c) if !c.members.is_empty() => {
                        let pointer = self.eval(&c.pointer, f, ctx)?.as_long() as u64;
                        let indexes = self.cast_indexes(c, f, ctx)?;
                        ctx.member_address(None, Some((pointer, c, &indexes)))
                    }
                    _ => None,
                };
                match answer {
                    Some(Ok(v)) => return Ok(v),
                    Some(Err(why)) => return fail(why, e.span),
                    None => {}
                }
                return fail(
                    "'&' of a struct member is not supported at run time here: it needs the \
                     kernel's type layout, which only a kernel probe that stopped the guest has",
                    e.span,
                );
            }
            ExprKind::RegexMatch(p, negated) => {
                let text = self.eval(&p.0, f, ctx)?;
                let pattern = self.eval(&p.1, f, ctx)?;
                let matched = self.regex_match(text.as_str(), pattern.as_str(), e.span)?;
                Value::Long(i64::from(matched != *negated))
            }
            ExprKind::Hist(..) => Value::Long(0),
            ExprKind::Call(c) => self.call(c, e.span, f, ctx)?,
            ExprKind::In(i) => {
                let keys = self.keys(&i.keys, f, ctx)?;
                let found = match self.globals.get(&i.array.name) {
                    Some(Store::Array(m)) => m.contains_key(&keys),
                    Some(Store::StatsArray(m)) => m.contains_key(&keys),
                    _ => false,
                };
                Value::Long(i64::from(found))
            }
        })
    }

    fn binary(
        &mut self,
        op: BinOp,
        l: &Expr,
        r: &Expr,
        span: Span,
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<Value> {
        match op {
            BinOp::And => {
                let v =
                    self.eval(l, f, ctx)?.as_long() != 0 && self.eval(r, f, ctx)?.as_long() != 0;
                Ok(Value::Long(i64::from(v)))
            }
            BinOp::Or => {
                let v =
                    self.eval(l, f, ctx)?.as_long() != 0 || self.eval(r, f, ctx)?.as_long() != 0;
                Ok(Value::Long(i64::from(v)))
            }
            _ => {
                let a = self.eval(l, f, ctx)?;
                let b = self.eval(r, f, ctx)?;
                self.apply(op, a, b, span)
            }
        }
    }

    /// Applies a non-short-circuit binary operator.
    fn apply(&self, op: BinOp, a: Value, b: Value, span: Span) -> EResult<Value> {
        use std::cmp::Ordering::*;
        if op == BinOp::Concat {
            return Ok(self.string(format!("{}{}", a.as_str(), b.as_str())));
        }
        if op.is_comparison() {
            let ord = a.compare(&b);
            let t = match op {
                BinOp::Eq => ord == Equal,
                BinOp::Ne => ord != Equal,
                BinOp::Lt => ord == Less,
                BinOp::Le => ord != Greater,
                BinOp::Gt => ord == Greater,
                _ => ord != Less,
            };
            return Ok(Value::Long(i64::from(t)));
        }
        let (x, y) = (a.as_long(), b.as_long());
        let shift = (y & 63) as u32;
        Ok(Value::Long(match op {
            BinOp::Add => x.wrapping_add(y),
            BinOp::Sub => x.wrapping_sub(y),
            BinOp::Mul => x.wrapping_mul(y),
            BinOp::Div | BinOp::Mod if y == 0 => return fail("division by 0", span),
            BinOp::Div => x.wrapping_div(y),
            BinOp::Mod => x.wrapping_rem(y),
            BinOp::Shl => x.wrapping_shl(shift),
            BinOp::Shr => x.wrapping_shr(shift),
            BinOp::BitAnd => x & y,
            BinOp::BitOr => x | y,
            BinOp::BitXor => x ^ y,
            _ => 0,
        }))
    }

    /// The keys of an array element `e` names, evaluated now (`None` for anything else).
    fn element_keys(
        &mut self,
        e: &Expr,
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<Option<Vec<Value>>> {
        match &e.kind {
            ExprKind::Index(ix) => self.keys(&ix.keys, f, ctx).map(Some),
            _ => Ok(None),
        }
    }

    /// Reads a variable or array element (missing elements read as 0 or ""), at `keys` when
    /// given (the element's keys already evaluated).
    fn load(
        &mut self,
        e: &Expr,
        keys: Option<&[Value]>,
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<Value> {
        match &e.kind {
            ExprKind::Var(name) => {
                if let Some(store) = self.globals.get(name) {
                    return Ok(match store {
                        Store::Scalar(v) => v.clone(),
                        _ => Value::Long(0),
                    });
                }
                Ok(match f.locals.get(name) {
                    Some(v) => v.clone(),
                    None => default_of(self.local_ty(f, name)),
                })
            }
            ExprKind::Index(ix) => {
                let keys = match keys {
                    Some(k) => k.to_vec(),
                    None => self.keys(&ix.keys, f, ctx)?,
                };
                let ty = self
                    .prog
                    .globals
                    .get(&ix.array.name)
                    .map_or(Ty::Long, |g| g.value);
                Ok(match self.globals.get(&ix.array.name) {
                    Some(Store::Array(m)) => {
                        m.get(&keys).cloned().unwrap_or_else(|| default_of(ty))
                    }
                    _ => default_of(ty),
                })
            }
            ExprKind::Target(_) => self.eval(e, f, ctx),
            _ => fail("not assignable", e.span),
        }
    }

    fn capacity(&self, array: &str) -> usize {
        self.prog
            .globals
            .get(array)
            .and_then(|g| g.max_entries)
            .unwrap_or(self.limits.max_map_entries)
    }

    /// Whether a full array drops its oldest entry (`global a%`).
    fn wraps(&self, array: &str) -> bool {
        self.prog.globals.get(array).is_some_and(|g| g.wrap)
    }

    /// `text =~ pattern`, compiling each pattern once.
    fn regex_match(&mut self, text: &str, pattern: &str, span: Span) -> EResult<bool> {
        if !self.regexes.contains_key(pattern) {
            match regex::Regex::new(pattern) {
                Ok(re) => {
                    self.regexes.insert(pattern.to_string(), re);
                }
                Err(_) => return fail("invalid regular expression", span),
            }
        }
        Ok(self
            .regexes
            .get(pattern)
            .is_some_and(|re| re.is_match(text)))
    }

    /// Writes a variable or array element (at `keys` when given).
    fn store(
        &mut self,
        e: &Expr,
        keys: Option<Vec<Value>>,
        v: Value,
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<()> {
        match &e.kind {
            ExprKind::Var(name) => {
                if let Some(store) = self.globals.get_mut(name) {
                    *store = Store::Scalar(v);
                } else {
                    f.locals.insert(name.clone(), v);
                }
                Ok(())
            }
            ExprKind::Index(ix) => {
                let keys = match keys {
                    Some(k) => k,
                    None => self.keys(&ix.keys, f, ctx)?,
                };
                let cap = self.capacity(&ix.array.name);
                let wrap = self.wraps(&ix.array.name);
                if let Some(Store::Array(m)) = self.globals.get_mut(&ix.array.name) {
                    if !m.contains_key(&keys) && m.len() >= cap {
                        if !wrap {
                            return fail("array overflow, check MAXMAPENTRIES", ix.array.span);
                        }
                        m.shift_remove_index(0);
                    }
                    m.insert(keys, v);
                }
                Ok(())
            }
            ExprKind::Target(t) if t.members.is_empty() => ctx
                .write_target(&t.path(), v.as_long())
                .or_else(|why| fail(why, e.span)),
            ExprKind::Target(t) => fail(
                format!("writing the member chain '{}' is not supported", t.path()),
                e.span,
            ),
            _ => fail("not assignable", e.span),
        }
    }

    /// Runs `op` on the aggregate `target` names, creating the array entry when `create`.
    fn with_stats(
        &mut self,
        target: &Expr,
        f: &mut Frame,
        ctx: &dyn Context,
        create: bool,
        op: impl FnOnce(&mut Stats),
    ) -> EResult<()> {
        match &target.kind {
            ExprKind::Var(name) => {
                if let Some(Store::Stats(s)) = self.globals.get_mut(name) {
                    op(s);
                }
            }
            ExprKind::Index(ix) => {
                let keys = self.keys(&ix.keys, f, ctx)?;
                let cap = self.capacity(&ix.array.name);
                let wrap = self.wraps(&ix.array.name);
                let layout = self
                    .prog
                    .globals
                    .get(&ix.array.name)
                    .map(|g| g.hist)
                    .unwrap_or_default();
                if let Some(Store::StatsArray(m)) = self.globals.get_mut(&ix.array.name) {
                    if let Some(s) = m.get_mut(&keys) {
                        op(s);
                    } else if create {
                        if m.len() >= cap {
                            if !wrap {
                                return fail("array overflow, check MAXMAPENTRIES", ix.array.span);
                            }
                            m.shift_remove_index(0);
                        }
                        let mut s = Stats::new(layout);
                        op(&mut s);
                        m.insert(keys, s);
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// A copy of the aggregate `target` names (None for a missing array entry).
    pub(crate) fn stats_of(
        &mut self,
        target: &Expr,
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<Option<Stats>> {
        let mut out = None;
        self.with_stats(target, f, ctx, false, |s| out = Some(s.clone()))?;
        Ok(out)
    }

    fn call(&mut self, c: &Call, span: Span, f: &mut Frame, ctx: &dyn Context) -> EResult<Value> {
        let prog = self.prog;
        let Some(&index) = prog.functions.get(&c.name.name) else {
            return self.builtin(c, span, f, ctx);
        };
        let func = &prog.script.functions[index];
        let FunctionBody::Block(body) = &func.body else {
            return fail("embedded C code cannot run", span);
        };
        if self.depth >= self.limits.max_nesting {
            return fail("MAXNESTING exceeded", span);
        }
        let mut locals = HashMap::new();
        for (p, a) in func.params.iter().zip(&c.args) {
            let v = self.eval(a, f, ctx)?;
            locals.insert(p.name.name.clone(), v);
        }
        let mut frame = Frame {
            body: prog.script.probes.len() + index,
            locals,
        };
        self.depth += 1;
        let result = self.block(body, &mut frame, ctx);
        self.depth -= 1;
        let ret = prog.function_ret.get(index).copied().unwrap_or(Ty::Void);
        match result? {
            Flow::Return(Some(v)) => Ok(v),
            _ => Ok(default_of(ret)),
        }
    }

    /// `error()` and friends: raise a script error.
    pub(crate) fn raise<T>(&self, message: String, span: Span) -> EResult<T> {
        Err(Stop::Error(super::eval::ScriptError { message, span }))
    }
}

/// Whether every target variable in `e` resolves in `ctx` (`@defined`). A `@cast` never
/// does: the interpreter has no kernel types.
fn defined(e: &Expr, ctx: &dyn Context) -> bool {
    match &e.kind {
        ExprKind::Target(t) => ctx.target_defined(t),
        ExprKind::Cast(c) => ctx.cast_defined(c) && defined(&c.pointer, ctx),
        ExprKind::Embedded(_) => false,
        ExprKind::Num(_) | ExprKind::Str(_) | ExprKind::Var(_) | ExprKind::Wildcard => true,
        ExprKind::Unary(_, x)
        | ExprKind::Stat(_, x)
        | ExprKind::Hist(_, x)
        | ExprKind::Entry(x)
        | ExprKind::Defined(x)
        | ExprKind::Variance(x, _) => defined(x, ctx),
        ExprKind::AddressOf(x) => defined(x, ctx),
        ExprKind::Binary(_, p)
        | ExprKind::Assign(_, p)
        | ExprKind::Aggregate(p)
        | ExprKind::RegexMatch(p, _) => defined(&p.0, ctx) && defined(&p.1, ctx),
        ExprKind::Ternary(p) => defined(&p.0, ctx) && defined(&p.1, ctx) && defined(&p.2, ctx),
        ExprKind::IncDec(i) => defined(&i.target, ctx),
        ExprKind::Index(ix) => ix.keys.iter().all(|k| defined(k, ctx)),
        ExprKind::Call(c) => c.args.iter().all(|a| defined(a, ctx)),
        ExprKind::In(i) => i.keys.iter().all(|k| defined(k, ctx)),
    }
}
