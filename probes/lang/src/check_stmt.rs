//! Checks for statements: control flow, loops, `foreach`, `delete`, `try`; and the syntactic
//! scans that find a body's locals and whether a function returns a value.

use std::collections::HashSet;

use super::ast::*;
use super::check::{Checker, Shape, Ty};
use super::diag::Diagnostic;

impl Checker<'_> {
    pub(crate) fn block(&mut self, b: &Block) {
        for s in &b.stmts {
            self.stmt(s);
        }
    }

    pub(crate) fn stmt(&mut self, s: &Stmt) {
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
                if self.statically_undefined(&i.cond) {
                    // `if (@defined($x)) ...` where $x cannot exist: the branch is dropped.
                    if let Some(e) = &i.els {
                        self.stmt(e);
                    }
                    return;
                }
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
                    let what = if matches!(s.kind, StmtKind::Break) {
                        "break"
                    } else {
                        "continue"
                    };
                    self.emit(Diagnostic::error(
                        format!("'{what}' outside a loop"),
                        s.span,
                    ));
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

    pub(crate) fn in_loop(&mut self, body: &Stmt) {
        self.scope.loops += 1;
        self.stmt(body);
        self.scope.loops -= 1;
    }

    pub(crate) fn delete(&mut self, e: &Expr) {
        match &e.kind {
            ExprKind::Var(name) => {
                if let Some(g) = self.globals.get_mut(name) {
                    g.written = true;
                } else if !self.scope.assigned.contains(name) {
                    self.undefined(name, e.span);
                }
            }
            ExprKind::Index(ix) if ix.keys.iter().any(|k| matches!(k.kind, ExprKind::Wildcard)) => {
                // `delete a[k, *]`: the wildcards match any key; the others are typed as keys.
                if !self.globals.contains_key(&ix.array.name) {
                    self.index_keys(ix, e.span);
                    return;
                }
                let keys = self.array_arity(&ix.array.name, ix.keys.len(), e.span);
                for (k, key) in ix.keys.iter().enumerate() {
                    if !matches!(key.kind, ExprKind::Wildcard) {
                        self.key(&ix.array.name, k, keys.get(k).copied(), key);
                    }
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

    pub(crate) fn foreach(&mut self, f: &Foreach) {
        let name = &f.array.name;
        let Some(g) = self.globals.get(name) else {
            self.emit(
                Diagnostic::error(
                    format!("foreach over '{name}', which is not a global array"),
                    f.array.span,
                )
                .with_hint(format!(
                    "declare it with 'global {name}' and index it as {name}[k]"
                )),
            );
            return;
        };
        let (value_ty, shape) = (g.value, g.shape);
        if shape == Shape::Scalar {
            self.emit(Diagnostic::error(
                format!("foreach over scalar '{name}'"),
                f.array.span,
            ));
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
                    Diagnostic::error(
                        format!("cannot bind the aggregates of '{name}' to '{}'", v.name),
                        v.span,
                    )
                    .with_hint(format!(
                        "use @count({name}[k]), @sum({name}[k]), ... in the body"
                    )),
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
        if let Some(slice) = &f.slice {
            if slice.len() != f.keys.len() {
                self.emit(Diagnostic::error(
                    format!(
                        "the slice of '{name}' has {} keys, but the foreach binds {}",
                        slice.len(),
                        f.keys.len()
                    ),
                    f.array.span,
                ));
            }
            for (k, e) in slice.iter().enumerate() {
                if matches!(e.kind, ExprKind::Wildcard) {
                    continue;
                }
                let want = keys.get(k).copied().unwrap_or(Ty::Unknown);
                let got = self.expr(e);
                if want == Ty::Unknown && matches!(got, Ty::Long | Ty::Str) {
                    self.set_key(name, k, got, e.span);
                } else if want != Ty::Unknown {
                    self.expect(e, want);
                }
            }
        }
        if let Some(limit) = &f.limit {
            self.expect(limit, Ty::Long);
        }
        self.in_loop(&f.body);
    }
}

/// Whether any `return expr` occurs in `stmts`.
pub(crate) fn returns_value(stmts: &[Stmt]) -> bool {
    stmts.iter().any(|s| match &s.kind {
        StmtKind::Return(Some(_)) => true,
        StmtKind::Block(b) => returns_value(&b.stmts),
        StmtKind::If(i) => {
            returns_value(std::slice::from_ref(&i.then))
                || i.els
                    .as_ref()
                    .is_some_and(|e| returns_value(std::slice::from_ref(e)))
        }
        StmtKind::While(w) => returns_value(std::slice::from_ref(&w.1)),
        StmtKind::For(f) => returns_value(std::slice::from_ref(&f.body)),
        StmtKind::Foreach(f) => returns_value(std::slice::from_ref(&f.body)),
        StmtKind::Try(t) => returns_value(&t.body.stmts) || returns_value(&t.handler.stmts),
        _ => false,
    })
}

/// Names a body assigns: they are its locals (unless global).
pub(crate) fn collect_assigned(stmts: &[Stmt], out: &mut HashSet<String>) {
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
                for e in f.slice.iter().flatten() {
                    collect_expr(e, out);
                }
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
        ExprKind::Unary(_, x)
        | ExprKind::Stat(_, x)
        | ExprKind::Hist(_, x)
        | ExprKind::Entry(x)
        | ExprKind::Defined(x)
        | ExprKind::Variance(x, _)
        | ExprKind::AddressOf(x) => collect_expr(x, out),
        ExprKind::RegexMatch(p, _) => {
            collect_expr(&p.0, out);
            collect_expr(&p.1, out);
        }
        ExprKind::Cast(c) => {
            collect_expr(&c.pointer, out);
            for index in &c.indexes {
                collect_expr(index, out);
            }
        }
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
        ExprKind::Num(_)
        | ExprKind::Str(_)
        | ExprKind::Var(_)
        | ExprKind::Target(_)
        | ExprKind::Embedded(_)
        | ExprKind::Wildcard => {}
    }
}
