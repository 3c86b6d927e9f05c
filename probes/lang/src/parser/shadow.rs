//! A function parameter hides a global of the same name, as in SystemTap, where a name used
//! without an index is looked up among the function's parameters before the globals (an
//! indexed use, `name[k]`, is still the global array). The checker, the interpreter and the
//! compiler all look globals up first, so the parser renames such a parameter, and its uses
//! in the function's body, to a name no script can write (`name'`).

use std::collections::HashSet;

use super::super::ast::{Expr, ExprKind, Script, Stmt, StmtKind};

/// Renames the parameters of `script`'s functions that share a global's name.
pub(super) fn rename_shadowing_params(script: &mut Script) {
    let globals: HashSet<String> = script.globals.iter().map(|g| g.name.name.clone()).collect();
    for f in &mut script.functions {
        for p in &mut f.params {
            if !globals.contains(&p.name.name) {
                continue;
            }
            let from = p.name.name.clone();
            let to = format!("{from}'");
            if let super::super::ast::FunctionBody::Block(body) = &mut f.body {
                for s in &mut body.stmts {
                    stmt(s, &from, &to);
                }
            }
            p.name.name = to;
        }
    }
}

fn rename(name: &mut String, from: &str, to: &str) {
    if name == from {
        *name = to.to_string();
    }
}

fn stmt(s: &mut Stmt, from: &str, to: &str) {
    match &mut s.kind {
        StmtKind::Empty | StmtKind::Next | StmtKind::Break | StmtKind::Continue => {}
        StmtKind::Block(b) => b.stmts.iter_mut().for_each(|s| stmt(s, from, to)),
        StmtKind::Expr(e) | StmtKind::Delete(e) | StmtKind::Return(Some(e)) => expr(e, from, to),
        StmtKind::Return(None) => {}
        StmtKind::If(i) => {
            expr(&mut i.cond, from, to);
            stmt(&mut i.then, from, to);
            if let Some(e) = &mut i.els {
                stmt(e, from, to);
            }
        }
        StmtKind::While(w) => {
            expr(&mut w.0, from, to);
            stmt(&mut w.1, from, to);
        }
        StmtKind::For(f) => {
            for e in [&mut f.init, &mut f.cond, &mut f.step]
                .into_iter()
                .flatten()
            {
                expr(e, from, to);
            }
            stmt(&mut f.body, from, to);
        }
        StmtKind::Foreach(f) => {
            if let Some(v) = &mut f.value {
                rename(&mut v.name, from, to);
            }
            for k in &mut f.keys {
                rename(&mut k.name, from, to);
            }
            for e in f.slice.iter_mut().flatten() {
                expr(e, from, to);
            }
            if let Some(l) = &mut f.limit {
                expr(l, from, to);
            }
            stmt(&mut f.body, from, to);
        }
        StmtKind::Try(t) => {
            t.body.stmts.iter_mut().for_each(|s| stmt(s, from, to));
            if let Some(v) = &mut t.var {
                rename(&mut v.name, from, to);
            }
            t.handler.stmts.iter_mut().for_each(|s| stmt(s, from, to));
        }
    }
}

fn expr(e: &mut Expr, from: &str, to: &str) {
    match &mut e.kind {
        ExprKind::Var(name) => rename(name, from, to),
        ExprKind::Num(_)
        | ExprKind::Str(_)
        | ExprKind::Target(_)
        | ExprKind::Embedded(_)
        | ExprKind::Wildcard => {}
        ExprKind::Index(ix) => ix.keys.iter_mut().for_each(|k| expr(k, from, to)),
        ExprKind::In(i) => i.keys.iter_mut().for_each(|k| expr(k, from, to)),
        ExprKind::Call(c) => c.args.iter_mut().for_each(|a| expr(a, from, to)),
        ExprKind::Unary(_, x)
        | ExprKind::Stat(_, x)
        | ExprKind::Hist(_, x)
        | ExprKind::Entry(x)
        | ExprKind::Defined(x)
        | ExprKind::Variance(x, _)
        | ExprKind::AddressOf(x) => expr(x, from, to),
        ExprKind::Binary(_, p)
        | ExprKind::Assign(_, p)
        | ExprKind::Aggregate(p)
        | ExprKind::RegexMatch(p, _) => {
            expr(&mut p.0, from, to);
            expr(&mut p.1, from, to);
        }
        ExprKind::Ternary(p) => {
            expr(&mut p.0, from, to);
            expr(&mut p.1, from, to);
            expr(&mut p.2, from, to);
        }
        ExprKind::IncDec(i) => expr(&mut i.target, from, to),
        ExprKind::Cast(c) => {
            expr(&mut c.pointer, from, to);
            c.indexes.iter_mut().for_each(|i| expr(i, from, to));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::ast::{ExprKind, FunctionBody, StmtKind};
    use crate::parser::parse;
    use crate::Limits;

    #[test]
    fn parameter_named_like_a_global_array_is_renamed_but_indexes_stay_global() {
        let src = "global state function f(state) { return state > 0 ? state[1] : 0 } \
                   probe begin { f(1) }";
        let script = parse(src, &Limits::default()).unwrap();
        let f = &script.functions[0];
        assert_eq!(f.params[0].name.name, "state'");
        let FunctionBody::Block(body) = &f.body else {
            panic!("a block body")
        };
        let StmtKind::Return(Some(e)) = &body.stmts[0].kind else {
            panic!("a return")
        };
        let ExprKind::Ternary(t) = &e.kind else {
            panic!("a ternary")
        };
        assert!(
            matches!(&t.0.kind, ExprKind::Binary(_, p) if matches!(&p.0.kind, ExprKind::Var(n) if n == "state'"))
        );
        let ExprKind::Index(ix) = &t.1.kind else {
            panic!("an index")
        };
        assert_eq!(ix.array.name, "state");
        assert!(matches!(&ix.keys[0].kind, ExprKind::Num(1)));
    }
}
