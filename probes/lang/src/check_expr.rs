//! Type inference and checks for expressions (the statement side is in [`check`](super::check)).

use super::ast::*;
use super::builtins;
use super::check::{Checker, Shape, Ty};
use super::diag::Diagnostic;
use super::format::{arg_kinds, parse_format, ArgKind};
use super::value::linear_buckets;

/// Why embedded C is refused, and what to do instead.
const EMBEDDED_C_HINT: &str = "exotap loads no module into the guest, so no C code runs there; \
     write it in the script language (built-ins such as kernel_long(), kernel_string() and @cast read guest memory)";

impl Checker<'_> {
    /// Infers the type of `e`, checking it on the way.
    pub(crate) fn expr(&mut self, e: &Expr) -> Ty {
        match &e.kind {
            ExprKind::Num(_) => Ty::Long,
            ExprKind::Str(_) => Ty::Str,
            ExprKind::Var(name) => self.var_read(name, e.span),
            ExprKind::Target(t) => self.target(t, e.span),
            ExprKind::Index(ix) => {
                let ty = self.index_keys(ix, e.span);
                if let Some(g) = self.globals.get_mut(&ix.array.name) {
                    g.read = true;
                }
                ty
            }
            ExprKind::Unary(_, x) => {
                self.expect(x, Ty::Long);
                Ty::Long
            }
            ExprKind::Binary(op, p) => self.binary(*op, &p.0, &p.1, e.span),
            ExprKind::Ternary(p) => {
                self.expect(&p.0, Ty::Long);
                if self.statically_undefined(&p.0) {
                    // `@defined($x) ? $x : y` where $x cannot exist: only `y` is ever used.
                    return self.expr(&p.2);
                }
                let a = self.expr(&p.1);
                let b = self.expr(&p.2);
                match (a, b) {
                    (Ty::Unknown, Ty::Unknown) => Ty::Unknown,
                    (Ty::Unknown, t) => {
                        self.constrain(&p.1, t);
                        t
                    }
                    (t, Ty::Unknown) => {
                        self.constrain(&p.2, t);
                        t
                    }
                    (a, b) if a == b => a,
                    (a, b) => {
                        self.emit(
                            Diagnostic::error(
                                format!("type mismatch: the branches of '?:' are a {a} and a {b}"),
                                e.span,
                            )
                            .with_label("both branches must have one type"),
                        );
                        a
                    }
                }
            }
            ExprKind::Assign(op, p) => self.assign(*op, &p.0, &p.1, e.span),
            ExprKind::IncDec(i) => {
                self.write_target(&i.target, Ty::Long);
                Ty::Long
            }
            ExprKind::Aggregate(p) => {
                self.write_target(&p.0, Ty::Stats);
                self.expect(&p.1, Ty::Long);
                Ty::Long
            }
            ExprKind::Stat(_, target) => {
                self.aggregate_operand(target, e.span);
                Ty::Long
            }
            ExprKind::Hist(..) => {
                self.emit(
                    Diagnostic::error("a histogram can only be printed", e.span)
                        .with_hint("write print(@hist_log(x)) as a statement of its own"),
                );
                Ty::Void
            }
            ExprKind::Call(c) => self.call(c, e.span),
            ExprKind::Entry(x) => self.entry(x, e.span),
            ExprKind::Defined(x) => {
                self.scope.defined += 1;
                self.expr(x);
                self.scope.defined -= 1;
                Ty::Long
            }
            ExprKind::Cast(c) => {
                self.expect(&c.pointer, Ty::Long);
                for index in &c.indexes {
                    self.expect(index, Ty::Long);
                }
                if let Some(like) = &c.like {
                    if like.is_empty() {
                        let local = match &c.pointer.kind {
                            ExprKind::Var(v) => v.as_str(),
                            _ => "?",
                        };
                        self.emit(
                            Diagnostic::error(
                                format!(
                                    "{local}->member: the local variable '{local}' is not copied \
                                     from a target variable or an @cast in this probe, so it has \
                                     no kernel type (SystemTap's autocast)"
                                ),
                                e.span,
                            )
                            .with_hint(format!(
                                "copy it from one ({local} = $param) or write \
                                 @cast({local}, \"struct TYPE\")->member"
                            )),
                        );
                    } else if let Some(k) = self.scope.kinds.iter().find(|k| !k.has_target_vars()) {
                        self.emit(Diagnostic::error(
                            format!(
                                "the local copied from {like} has its type only where {like} is: \
                                 target variables are not available in '{}' probes",
                                k.family()
                            ),
                            e.span,
                        ));
                    }
                } else if c.type_name.trim().is_empty() {
                    self.emit(
                        Diagnostic::error("@cast needs a type name", e.span)
                            .with_hint("e.g. @cast(p, \"struct task_struct\", \"kernel\")->pid"),
                    );
                }
                // `->member$$`: the pretty-printed text of the member.
                if c.members.last().is_some_and(|m| m.ends_with('$')) {
                    Ty::Str
                } else {
                    Ty::Long
                }
            }
            ExprKind::Variance(target, shift) => {
                if let Some(name) = self.aggregate_operand(target, e.span) {
                    self.variance_shift(&name, *shift, e.span);
                }
                Ty::Long
            }
            ExprKind::Embedded(_) => {
                self.emit(
                    Diagnostic::error("embedded C code is not supported", e.span)
                        .with_label("C code")
                        .with_hint(EMBEDDED_C_HINT),
                );
                Ty::Long
            }
            ExprKind::AddressOf(x) => {
                self.expr(x);
                Ty::Long
            }
            ExprKind::Wildcard => {
                self.emit(
                    Diagnostic::error("'*' stands for a key only in 'delete a[k, *]'", e.span)
                        .with_hint("name the key, or delete with '*' for every value of it"),
                );
                Ty::Unknown
            }
            ExprKind::RegexMatch(p, _) => {
                self.expect(&p.0, Ty::Str);
                match &p.1.kind {
                    ExprKind::Str(re) => {
                        if let Err(err) = regex::Regex::new(re) {
                            self.emit(
                                Diagnostic::error("invalid regular expression", p.1.span)
                                    .with_label(first_line(&err.to_string())),
                            );
                        }
                    }
                    _ => {
                        self.emit(
                            Diagnostic::error(
                                "the regular expression of '=~' must be a string literal",
                                p.1.span,
                            )
                            .with_hint("regular expressions are compiled before the script runs"),
                        );
                        self.expr(&p.1);
                    }
                }
                Ty::Long
            }
            ExprKind::In(i) => {
                let keys = self.array_arity(&i.array.name, i.keys.len(), i.array.span);
                self.require_global_array(&i.array);
                for (k, key) in i.keys.iter().enumerate() {
                    self.key(&i.array.name, k, keys.get(k).copied(), key);
                }
                if let Some(g) = self.globals.get_mut(&i.array.name) {
                    g.read = true;
                }
                Ty::Long
            }
        }
    }

    /// When `e` calls a script function with no declared type and no value returned: makes
    /// it a long (its value 0) and says so.
    fn void_function_as_long(&mut self, e: &Expr) -> bool {
        let ExprKind::Call(c) = &e.kind else {
            return false;
        };
        let Some(&i) = self.functions.get(&c.name.name) else {
            return false;
        };
        let f = &self.script.functions[i];
        if f.ret.is_some() || !matches!(f.body, FunctionBody::Block(_)) {
            return false;
        }
        if self.function_ret[i] == Ty::Void {
            self.function_ret[i] = Ty::Long;
            self.changed = true;
        }
        true
    }

    /// Checks that `e` has type `want`, pushing `want` into untyped variables.
    pub(crate) fn expect(&mut self, e: &Expr, want: Ty) -> Ty {
        let got = self.expr(e);
        match got {
            Ty::Unknown => self.constrain(e, want),
            Ty::Stats if want != Ty::Stats => self.stats_as_value(e.span),
            // As in SystemTap, a script function that returns nothing and has no declared
            // type is a long (0) where a long is needed (`n && report()`).
            Ty::Void if want == Ty::Long && self.void_function_as_long(e) => {}
            Ty::Void => self.emit(
                Diagnostic::error("this function returns no value", e.span)
                    .with_label(format!("a {want} is needed here")),
            ),
            got if got != want => self.emit(
                Diagnostic::error(
                    format!("type mismatch: expected a {want}, found a {got}"),
                    e.span,
                )
                .with_label(format!("this is a {got}"))
                .with_hint(match want {
                    Ty::Str => "convert a long with sprint(n) or sprintf(\"%d\", n)",
                    Ty::Long => "convert a string with strtol(s, 10)",
                    _ => "use a value of the expected type",
                }),
            ),
            _ => {}
        }
        want
    }

    pub(crate) fn stats_as_value(&mut self, span: Span) {
        self.emit(
            Diagnostic::error("an aggregate cannot be used as a value", span)
                .with_label("aggregate")
                .with_hint("extract a value with @count, @sum, @min, @max or @avg"),
        );
    }

    /// Gives an untyped expression a type where it names something typeable.
    fn constrain(&mut self, e: &Expr, want: Ty) {
        match &e.kind {
            ExprKind::Var(name) => self.set_var(name, want, e.span),
            ExprKind::Index(ix) => self.set_global_value(&ix.array.name, want, e.span),
            ExprKind::Call(c) => {
                if let Some(&f) = self.functions.get(&c.name.name) {
                    if self.function_ret[f] == Ty::Unknown && matches!(want, Ty::Long | Ty::Str) {
                        self.function_ret[f] = want;
                        self.changed = true;
                    }
                }
            }
            ExprKind::Ternary(p) => {
                self.constrain(&p.1, want);
                self.constrain(&p.2, want);
            }
            ExprKind::Assign(None, p) => self.constrain(&p.0, want),
            _ => {}
        }
    }

    fn var_read(&mut self, name: &str, span: Span) -> Ty {
        if let Some(g) = self.globals.get_mut(name) {
            g.read = true;
            let (shape, value) = (g.shape, g.value);
            if shape == Shape::Array {
                self.emit(
                    Diagnostic::error(format!("array '{name}' is used without an index"), span)
                        .with_hint(format!("read one element as {name}[key]")),
                );
                return Ty::Unknown;
            }
            if shape == Shape::Unknown {
                if let Some(g) = self.globals.get_mut(name) {
                    g.shape = Shape::Scalar;
                }
            }
            return value;
        }
        if !self.scope.assigned.contains(name) {
            self.undefined(name, span);
            return Ty::Unknown;
        }
        let ty = self.local_ty(name);
        if ty == Ty::Unknown {
            self.emit(
                Diagnostic::error(format!("could not infer the type of '{name}'"), span)
                    .with_hint("give it a value of a known type, e.g. x = 0 or x = \"\""),
            );
        }
        ty
    }

    /// Whether `cond` is `@defined(x)` with a target variable in `x` where none can exist
    /// (guest-free probes, functions): SystemTap then drops the branch it guards unchecked.
    pub(crate) fn statically_undefined(&self, cond: &Expr) -> bool {
        let ExprKind::Defined(x) = &cond.kind else {
            return false;
        };
        let no_targets =
            self.scope.function.is_some() || self.scope.kinds.iter().any(|k| !k.has_target_vars());
        no_targets && mentions_target(x)
    }

    /// `@entry(x)`: only in `.return` probes, where `x` is what it was at the entry.
    fn entry(&mut self, x: &Expr, span: Span) -> Ty {
        if self.scope.function.is_some() {
            self.emit(
                Diagnostic::error("'@entry' used in a function", span).with_hint(
                    "use @entry(...) in the .return probe and pass the value as an argument",
                ),
            );
        } else if self.scope.kinds.is_empty() || !self.scope.kinds.iter().all(|k| k.is_return()) {
            self.emit(
                Diagnostic::error("'@entry' is only available in .return probes", span)
                    .with_label("not a .return probe")
                    .with_hint("probe kernel.function(\"f\").return and use @entry(...) there"),
            );
        }
        let t = self.expr(x);
        if t == Ty::Stats || t == Ty::Void {
            self.expect_value(x, t);
            return Ty::Unknown;
        }
        t
    }

    /// Records the bit shift `@variance(name, shift)` uses; one per aggregate, as in SystemTap.
    fn variance_shift(&mut self, name: &str, shift: u32, span: Span) {
        let Some(g) = self.globals.get_mut(name) else {
            return;
        };
        match g.hist.variance_shift {
            None => g.hist.variance_shift = Some(shift),
            Some(have) if have == shift => {}
            Some(have) => self.emit(
                Diagnostic::error(
                    format!("'{name}' is used with @variance bit shifts {have} and {shift}"),
                    span,
                )
                .with_hint("use one bit shift per aggregate"),
            ),
        }
    }

    fn target(&mut self, t: &TargetVar, span: Span) -> Ty {
        // Inside @defined a variable that cannot exist here is simply not defined.
        if self.scope.defined > 0
            && (self.scope.function.is_some()
                || self.scope.kinds.iter().any(|k| !k.has_target_vars()))
        {
            return Ty::Long;
        }
        if self.scope.function.is_some() {
            self.emit(
                Diagnostic::error(
                    format!("target variable '{}' used in a function", t.name),
                    span,
                )
                .with_hint("read it in the probe handler and pass it as an argument"),
            );
            return Ty::Long;
        }
        let kinds = self.scope.kinds.clone();
        if let Some(k) = kinds.iter().find(|k| !k.has_target_vars()) {
            self.emit(
                Diagnostic::error(
                    format!(
                        "target variable '{}' is not available in '{}' probes",
                        t.name,
                        k.family()
                    ),
                    span,
                )
                .with_hint("target variables exist only at kernel probe points"),
            );
            return Ty::Long;
        }
        // `$x$`, `$x$$`, `$p->m$`: SystemTap's pretty-printed text of the value.
        let base = t.name.trim_end_matches('$');
        let pretty = base.len() < t.name.len() && base.len() > 1
            || t.members.last().is_some_and(|m| m.ends_with('$'));
        match base {
            "$return" if !kinds.iter().all(|k| k.is_return()) => {
                self.emit(
                    Diagnostic::error("'$return' is only available in .return probes", span)
                        .with_hint("probe kernel.function(\"f\").return to see the return value"),
                );
                Ty::Long
            }
            "$$parms" | "$$vars" | "$$locals" | "$$return" => {
                if !t.members.is_empty() {
                    self.emit(Diagnostic::error(
                        format!("'{}' has no members", t.name),
                        span,
                    ));
                }
                Ty::Str
            }
            n if n.starts_with("$$") => {
                self.emit(
                    Diagnostic::error(format!("unknown context variable '{n}'"), span)
                        .with_hint("known: $$parms, $$vars, $$locals, $$return"),
                );
                Ty::Str
            }
            _ if pretty => Ty::Str,
            _ => Ty::Long,
        }
    }

    fn require_global_array(&mut self, array: &Ident) -> bool {
        if self.globals.contains_key(&array.name) {
            return true;
        }
        self.emit(
            Diagnostic::error(
                format!("'{}' is not a global array", array.name),
                array.span,
            )
            .with_hint(format!("arrays must be declared: global {}", array.name)),
        );
        false
    }

    pub(crate) fn key(&mut self, array: &str, k: usize, key_ty: Option<Ty>, key: &Expr) {
        let got = self.expr(key);
        match (key_ty, got) {
            (_, Ty::Stats) => self.stats_as_value(key.span),
            (_, Ty::Void) => self.emit(Diagnostic::error(
                "this function returns no value",
                key.span,
            )),
            (Some(Ty::Unknown), t @ (Ty::Long | Ty::Str)) => self.set_key(array, k, t, key.span),
            (Some(want @ (Ty::Long | Ty::Str)), Ty::Unknown) => self.constrain(key, want),
            (Some(_), t) if t != Ty::Unknown => self.set_key(array, k, t, key.span),
            _ => {}
        }
    }

    /// Checks the keys of `a[k...]`; returns the element type.
    pub(crate) fn index_keys(&mut self, ix: &IndexExpr, span: Span) -> Ty {
        if !self.require_global_array(&ix.array) {
            return Ty::Unknown;
        }
        let keys = self.array_arity(&ix.array.name, ix.keys.len(), span);
        for (k, key) in ix.keys.iter().enumerate() {
            self.key(&ix.array.name, k, keys.get(k).copied(), key);
        }
        self.globals
            .get(&ix.array.name)
            .map(|g| g.value)
            .unwrap_or(Ty::Unknown)
    }

    fn binary(&mut self, op: BinOp, l: &Expr, r: &Expr, span: Span) -> Ty {
        if op == BinOp::Concat {
            self.expect(l, Ty::Str);
            self.expect(r, Ty::Str);
            return Ty::Str;
        }
        if !op.is_comparison() {
            self.expect(l, Ty::Long);
            self.expect(r, Ty::Long);
            return Ty::Long;
        }
        let a = self.expr(l);
        let b = self.expr(r);
        match (a, b) {
            (Ty::Stats, _) | (Ty::Void, _) => self.expect_value(l, a),
            (_, Ty::Stats) | (_, Ty::Void) => self.expect_value(r, b),
            (Ty::Unknown, t) if t != Ty::Unknown => self.constrain(l, t),
            (t, Ty::Unknown) if t != Ty::Unknown => self.constrain(r, t),
            (a, b) if a != b && a != Ty::Unknown => self.emit(
                Diagnostic::error(
                    format!("type mismatch: cannot compare a {a} with a {b}"),
                    span,
                )
                .with_label(format!("'{}' needs two longs or two strings", op.symbol())),
            ),
            _ => {}
        }
        Ty::Long
    }

    fn expect_value(&mut self, e: &Expr, t: Ty) {
        if t == Ty::Stats {
            self.stats_as_value(e.span);
        } else {
            self.emit(Diagnostic::error("this function returns no value", e.span));
        }
    }

    fn assign(&mut self, op: Option<BinOp>, lhs: &Expr, rhs: &Expr, span: Span) -> Ty {
        let want = match op {
            None => {
                let t = self.expr(rhs);
                match t {
                    Ty::Stats => {
                        self.stats_as_value(rhs.span);
                        return Ty::Unknown;
                    }
                    Ty::Void => {
                        self.emit(Diagnostic::error(
                            "this function returns no value",
                            rhs.span,
                        ));
                        return Ty::Unknown;
                    }
                    Ty::Unknown => {
                        let l = self.lvalue_ty(lhs);
                        if matches!(l, Ty::Long | Ty::Str) {
                            self.constrain(rhs, l);
                        }
                        l
                    }
                    t => t,
                }
            }
            Some(BinOp::Concat) => {
                self.expect(rhs, Ty::Str);
                Ty::Str
            }
            Some(_) => {
                self.expect(rhs, Ty::Long);
                Ty::Long
            }
        };
        let _ = span;
        self.write_target(lhs, want);
        want
    }

    /// The current type of an assignable expression, without reporting.
    fn lvalue_ty(&self, e: &Expr) -> Ty {
        match &e.kind {
            ExprKind::Var(n) => match self.globals.get(n) {
                Some(g) => g.value,
                None => self.local_ty(n),
            },
            ExprKind::Index(ix) => self
                .globals
                .get(&ix.array.name)
                .map_or(Ty::Unknown, |g| g.value),
            ExprKind::Target(_) => Ty::Long,
            _ => Ty::Unknown,
        }
    }

    /// Records a write of a value of type `ty` (Stats for `<<<`) into `target`.
    fn write_target(&mut self, target: &Expr, ty: Ty) {
        match &target.kind {
            ExprKind::Var(name) => {
                if let Some(g) = self.globals.get_mut(name) {
                    g.written = true;
                    if g.shape == Shape::Array {
                        self.emit(
                            Diagnostic::error(
                                format!("array '{name}' is assigned without an index"),
                                target.span,
                            )
                            .with_hint(format!("assign one element as {name}[key] = value")),
                        );
                        return;
                    }
                    g.shape = Shape::Scalar;
                    if g.value == Ty::Stats && ty != Ty::Stats {
                        self.emit(
                            Diagnostic::error(
                                format!("'{name}' is an aggregate and can only take '<<<'"),
                                target.span,
                            )
                            .with_hint(format!("add a value with {name} <<< value")),
                        );
                        return;
                    }
                } else if ty == Ty::Stats {
                    self.emit(
                        Diagnostic::error(
                            format!("aggregate '{name}' must be a global"),
                            target.span,
                        )
                        .with_hint(format!("declare it with 'global {name}'")),
                    );
                    return;
                }
                self.set_var(name, ty, target.span);
            }
            ExprKind::Index(ix) => {
                let have = self.index_keys(ix, target.span);
                if let Some(g) = self.globals.get_mut(&ix.array.name) {
                    g.written = true;
                }
                if have == Ty::Stats && ty != Ty::Stats {
                    self.emit(Diagnostic::error(
                        format!(
                            "'{}' holds aggregates and can only take '<<<'",
                            ix.array.name
                        ),
                        target.span,
                    ));
                    return;
                }
                self.set_global_value(&ix.array.name, ty, target.span);
            }
            ExprKind::Target(t) => {
                self.target(t, target.span);
                let plain =
                    t.members.is_empty() && !t.name.starts_with("$$") && !t.name.ends_with('$');
                let entry_param = t.name != "$return"
                    && !self.scope.kinds.is_empty()
                    && self.scope.kinds.iter().all(|k| !k.is_return());
                if !self.guru {
                    self.emit(
                        Diagnostic::error(
                            format!("cannot write target variable '{}'", t.name),
                            target.span,
                        )
                        .with_hint("changing guest state needs guru mode: run with -g"),
                    );
                } else if !plain || !(t.name == "$return" || entry_param) {
                    self.emit(
                        Diagnostic::error(
                            format!("cannot write target variable '{}' here", t.name),
                            target.span,
                        )
                        .with_hint(
                            "guru mode writes $return in .return probes and a parameter \
                             ($name) at function entries",
                        ),
                    );
                }
            }
            _ => self.emit(Diagnostic::error("not assignable", target.span)),
        }
    }

    /// Checks the operand of `@count(x)`, `@hist_log(x)`, ... and returns the global's name.
    fn aggregate_operand(&mut self, target: &Expr, span: Span) -> Option<String> {
        let name = match &target.kind {
            ExprKind::Var(name) if self.globals.contains_key(name) => {
                if let Some(g) = self.globals.get_mut(name) {
                    if g.shape == Shape::Unknown {
                        g.shape = Shape::Scalar;
                    }
                }
                name.clone()
            }
            ExprKind::Index(ix) => {
                self.index_keys(ix, target.span);
                ix.array.name.clone()
            }
            _ => {
                self.emit(
                    Diagnostic::error("statistics need a global aggregate", target.span)
                        .with_label("not a global aggregate")
                        .with_hint("feed a global with 'name <<< value' and use @count(name)"),
                );
                return None;
            }
        };
        let _ = span;
        if let Some(g) = self.globals.get_mut(&name) {
            g.read = true;
        }
        self.set_global_value(&name, Ty::Stats, target.span);
        Some(name)
    }

    fn hist(&mut self, kind: HistKind, target: &Expr, span: Span) {
        let Some(name) = self.aggregate_operand(target, span) else {
            return;
        };
        if let HistKind::Linear {
            start,
            stop,
            interval,
        } = kind
        {
            if linear_buckets(start, stop, interval).is_none() {
                self.emit(
                    Diagnostic::error("invalid @hist_linear layout", span).with_hint(
                        "need interval > 0, stop > start and (stop - start) / interval at most 125",
                    ),
                );
                return;
            }
        }
        let Some(g) = self.globals.get_mut(&name) else {
            return;
        };
        match kind {
            HistKind::Log => g.hist.log = true,
            HistKind::Linear { .. } => match g.hist.linear {
                None => g.hist.linear = Some(kind),
                Some(other) if other == kind => {}
                Some(_) => self.emit(
                    Diagnostic::error(
                        format!("'{name}' is printed with two different @hist_linear layouts"),
                        span,
                    )
                    .with_hint("use one start, stop and interval per aggregate"),
                ),
            },
        }
    }

    fn call(&mut self, c: &Call, span: Span) -> Ty {
        let name = c.name.name.as_str();
        match name {
            "printf" | "sprintf" => {
                self.printf(c, span);
                return if name == "printf" { Ty::Void } else { Ty::Str };
            }
            "print" | "println" | "sprint" | "sprintln" | "printd" | "printdln" => {
                let delimited = name.starts_with("printd");
                if delimited {
                    match c.args.first() {
                        Some(d) => {
                            self.expect(d, Ty::Str);
                        }
                        None => self.emit(Diagnostic::error(
                            format!("'{name}' needs a delimiter"),
                            span,
                        )),
                    }
                }
                if name == "print" && c.args.is_empty() {
                    self.emit(Diagnostic::error(
                        "'print' needs at least one argument",
                        span,
                    ));
                }
                for (i, a) in c.args.iter().enumerate().skip(usize::from(delimited)) {
                    if let ExprKind::Hist(kind, target) = &a.kind {
                        if c.args.len() != 1 || delimited {
                            self.emit(
                                Diagnostic::error("a histogram must be printed on its own", a.span)
                                    .with_hint("print(@hist_log(x)) with no other argument"),
                            );
                        }
                        self.hist(*kind, target, a.span);
                        continue;
                    }
                    let t = self.expr(a);
                    if t == Ty::Stats || t == Ty::Void {
                        self.expect_value(a, t);
                    }
                    let _ = i;
                }
                return if name.starts_with('s') {
                    Ty::Str
                } else {
                    Ty::Void
                };
            }
            _ => {}
        }
        if name == "set_return" && !self.functions.contains_key(name) {
            return self.set_return(c, span);
        }
        let builtin = builtins::lookup_call(name, c.args.len())
            .filter(|_| !self.functions.contains_key(name));
        if let Some(b) = builtin {
            self.arity(name, b.params.len(), c.args.len(), span);
            for (a, &p) in c.args.iter().zip(b.params) {
                self.expect(a, p);
            }
            return b.ret;
        }
        let Some(&f) = self.functions.get(name) else {
            self.emit(
                Diagnostic::error(format!("unknown function '{name}'"), c.name.span)
                    .with_label("not a built-in nor defined in this script"),
            );
            for a in &c.args {
                self.expr(a);
            }
            return Ty::Unknown;
        };
        let func = &self.script.functions[f];
        if matches!(func.body, FunctionBody::Embedded(_)) {
            self.emit(
                Diagnostic::error(
                    format!("function '{name}' is written in embedded C, which exotap cannot run"),
                    c.name.span,
                )
                .with_label("calls a C function")
                .with_hint(EMBEDDED_C_HINT),
            );
        }
        let body = self.script.probes.len() + f;
        self.arity(name, func.params.len(), c.args.len(), span);
        let params: Vec<String> = func.params.iter().map(|p| p.name.name.clone()).collect();
        for (a, p) in c.args.iter().zip(&params) {
            let want = self.locals[body].get(p).copied().unwrap_or(Ty::Unknown);
            if want == Ty::Unknown {
                let got = self.expr(a);
                if matches!(got, Ty::Long | Ty::Str) {
                    self.locals[body].insert(p.clone(), got);
                    self.changed = true;
                } else if got == Ty::Stats || got == Ty::Void {
                    self.expect_value(a, got);
                }
            } else {
                self.expect(a, want);
            }
        }
        self.function_ret[f]
    }

    /// `set_return(v)`: guru mode, in a `.return` probe handler.
    fn set_return(&mut self, c: &Call, span: Span) -> Ty {
        self.arity("set_return", 1, c.args.len(), span);
        for a in &c.args {
            self.expect(a, Ty::Long);
        }
        let in_return = self.scope.function.is_none()
            && !self.scope.kinds.is_empty()
            && self.scope.kinds.iter().all(|k| k.is_return());
        if !self.guru {
            self.emit(
                Diagnostic::error("set_return() changes guest state", span)
                    .with_hint("changing guest state needs guru mode: run with -g"),
            );
        } else if !in_return {
            self.emit(
                Diagnostic::error("set_return() outside a .return probe handler", span)
                    .with_hint("probe kernel.function(\"f\").return { set_return(v) }"),
            );
        }
        Ty::Void
    }

    fn arity(&mut self, name: &str, want: usize, got: usize, span: Span) {
        if want != got {
            self.emit(Diagnostic::error(
                format!("function '{name}' takes {want} argument(s), {got} given"),
                span,
            ));
        }
    }

    fn printf(&mut self, c: &Call, span: Span) {
        let name = &c.name.name;
        let Some(first) = c.args.first() else {
            self.emit(Diagnostic::error(
                format!("'{name}' needs a format string"),
                span,
            ));
            return;
        };
        let ExprKind::Str(fmt) = &first.kind else {
            self.emit(
                Diagnostic::error(
                    format!("the format of '{name}' must be a string literal"),
                    first.span,
                )
                .with_hint("formats are checked before the script runs"),
            );
            for a in &c.args {
                self.expr(a);
            }
            return;
        };
        let pieces = match parse_format(fmt) {
            Ok(p) => p,
            Err(e) => {
                self.emit(Diagnostic::error(format!("bad format: {e}"), first.span).with_hint(
                    "conversions are %d %i %u %x %X %o %s %c %p and %%, with flags -+ 0# and widths",
                ));
                return;
            }
        };
        let kinds = arg_kinds(&pieces);
        let args = &c.args[1..];
        if kinds.len() != args.len() {
            self.emit(
                Diagnostic::error(
                    format!(
                        "format expects {} argument(s), {} given",
                        kinds.len(),
                        args.len()
                    ),
                    span,
                )
                .with_label("argument count does not match the format"),
            );
        }
        for (a, k) in args.iter().zip(kinds) {
            let want = match k {
                ArgKind::Long => Ty::Long,
                ArgKind::Str => Ty::Str,
            };
            self.expect(a, want);
        }
    }
}

/// The first line of a (possibly multi-line) error text.
fn first_line(text: &str) -> String {
    text.lines().last().unwrap_or(text).trim().to_string()
}

/// Whether `e` reads a target variable or guest memory through `@cast`.
fn mentions_target(e: &Expr) -> bool {
    match &e.kind {
        ExprKind::Target(_) | ExprKind::Cast(_) => true,
        ExprKind::Num(_)
        | ExprKind::Str(_)
        | ExprKind::Var(_)
        | ExprKind::Embedded(_)
        | ExprKind::Wildcard => false,
        ExprKind::Unary(_, x)
        | ExprKind::Stat(_, x)
        | ExprKind::Hist(_, x)
        | ExprKind::Entry(x)
        | ExprKind::Defined(x)
        | ExprKind::Variance(x, _)
        | ExprKind::AddressOf(x) => mentions_target(x),
        ExprKind::Binary(_, p)
        | ExprKind::Assign(_, p)
        | ExprKind::Aggregate(p)
        | ExprKind::RegexMatch(p, _) => mentions_target(&p.0) || mentions_target(&p.1),
        ExprKind::Ternary(p) => {
            mentions_target(&p.0) || mentions_target(&p.1) || mentions_target(&p.2)
        }
        ExprKind::IncDec(i) => mentions_target(&i.target),
        ExprKind::Index(ix) => ix.keys.iter().any(mentions_target),
        ExprKind::Call(c) => c.args.iter().any(mentions_target),
        ExprKind::In(i) => i.keys.iter().any(mentions_target),
    }
}
