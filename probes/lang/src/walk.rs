//! Walks over a body's syntax, for the questions the evaluator and the code generator ask
//! before they run or emit a construct: which user functions a probe reaches, whether a
//! `foreach` body writes the array it walks, whether a `try` block reads memory, whether a
//! function touches tables.

use crate::ast::*;
use crate::check::Program;

/// Calls `f` on every expression in `s`, nested ones included.
pub fn stmt_exprs<'p>(s: &'p Stmt, f: &mut impl FnMut(&'p Expr)) {
    match &s.kind {
        StmtKind::Empty | StmtKind::Next | StmtKind::Break | StmtKind::Continue => {}
        StmtKind::Block(b) => block_exprs(b, f),
        StmtKind::Expr(e) | StmtKind::Delete(e) => expr_all(e, f),
        StmtKind::Return(e) => {
            if let Some(e) = e {
                expr_all(e, f);
            }
        }
        StmtKind::If(i) => {
            expr_all(&i.cond, f);
            stmt_exprs(&i.then, f);
            if let Some(e) = &i.els {
                stmt_exprs(e, f);
            }
        }
        StmtKind::While(w) => {
            expr_all(&w.0, f);
            stmt_exprs(&w.1, f);
        }
        StmtKind::For(fs) => {
            for e in [&fs.init, &fs.cond, &fs.step].into_iter().flatten() {
                expr_all(e, f);
            }
            stmt_exprs(&fs.body, f);
        }
        StmtKind::Foreach(fe) => {
            for e in fe.slice.iter().flatten() {
                expr_all(e, f);
            }
            if let Some(l) = &fe.limit {
                expr_all(l, f);
            }
            stmt_exprs(&fe.body, f);
        }
        StmtKind::Try(t) => {
            block_exprs(&t.body, f);
            block_exprs(&t.handler, f);
        }
    }
}

/// Calls `f` on every expression in `b`.
pub fn block_exprs<'p>(b: &'p Block, f: &mut impl FnMut(&'p Expr)) {
    for s in &b.stmts {
        stmt_exprs(s, f);
    }
}

/// Calls `f` on `e` and every expression inside it.
pub fn expr_all<'p>(e: &'p Expr, f: &mut impl FnMut(&'p Expr)) {
    f(e);
    match &e.kind {
        ExprKind::Num(_)
        | ExprKind::Str(_)
        | ExprKind::Var(_)
        | ExprKind::Target(_)
        | ExprKind::Embedded(_)
        | ExprKind::Wildcard => {}
        ExprKind::Index(ix) => ix.keys.iter().for_each(|k| expr_all(k, f)),
        ExprKind::In(i) => i.keys.iter().for_each(|k| expr_all(k, f)),
        ExprKind::Call(c) => c.args.iter().for_each(|a| expr_all(a, f)),
        ExprKind::Unary(_, x)
        | ExprKind::Stat(_, x)
        | ExprKind::Hist(_, x)
        | ExprKind::Entry(x)
        | ExprKind::Defined(x)
        | ExprKind::Variance(x, _)
        | ExprKind::AddressOf(x) => expr_all(x, f),
        ExprKind::Binary(_, p)
        | ExprKind::Assign(_, p)
        | ExprKind::Aggregate(p)
        | ExprKind::RegexMatch(p, _) => {
            expr_all(&p.0, f);
            expr_all(&p.1, f);
        }
        ExprKind::Ternary(t) => {
            expr_all(&t.0, f);
            expr_all(&t.1, f);
            expr_all(&t.2, f);
        }
        ExprKind::IncDec(i) => expr_all(&i.target, f),
        ExprKind::Cast(c) => expr_all(&c.pointer, f),
    }
}

/// Calls `f` on every expression in `b`, nested ones included, each after those inside it
/// (so `f` may replace an expression whole).
pub fn block_exprs_mut(b: &mut Block, f: &mut impl FnMut(&mut Expr)) {
    for s in &mut b.stmts {
        stmt_exprs_mut(s, f);
    }
}

fn stmt_exprs_mut(s: &mut Stmt, f: &mut impl FnMut(&mut Expr)) {
    match &mut s.kind {
        StmtKind::Empty | StmtKind::Next | StmtKind::Break | StmtKind::Continue => {}
        StmtKind::Block(b) => block_exprs_mut(b, f),
        StmtKind::Expr(e) | StmtKind::Delete(e) => expr_all_mut(e, f),
        StmtKind::Return(e) => {
            if let Some(e) = e {
                expr_all_mut(e, f);
            }
        }
        StmtKind::If(i) => {
            expr_all_mut(&mut i.cond, f);
            stmt_exprs_mut(&mut i.then, f);
            if let Some(e) = &mut i.els {
                stmt_exprs_mut(e, f);
            }
        }
        StmtKind::While(w) => {
            expr_all_mut(&mut w.0, f);
            stmt_exprs_mut(&mut w.1, f);
        }
        StmtKind::For(fs) => {
            for e in [&mut fs.init, &mut fs.cond, &mut fs.step]
                .into_iter()
                .flatten()
            {
                expr_all_mut(e, f);
            }
            stmt_exprs_mut(&mut fs.body, f);
        }
        StmtKind::Foreach(fe) => {
            for e in fe.slice.iter_mut().flatten() {
                expr_all_mut(e, f);
            }
            if let Some(l) = &mut fe.limit {
                expr_all_mut(l, f);
            }
            stmt_exprs_mut(&mut fe.body, f);
        }
        StmtKind::Try(t) => {
            block_exprs_mut(&mut t.body, f);
            block_exprs_mut(&mut t.handler, f);
        }
    }
}

/// Calls `f` on every expression inside `e`, then on `e`.
pub fn expr_all_mut(e: &mut Expr, f: &mut impl FnMut(&mut Expr)) {
    match &mut e.kind {
        ExprKind::Num(_)
        | ExprKind::Str(_)
        | ExprKind::Var(_)
        | ExprKind::Target(_)
        | ExprKind::Embedded(_)
        | ExprKind::Wildcard => {}
        ExprKind::Index(ix) => ix.keys.iter_mut().for_each(|k| expr_all_mut(k, f)),
        ExprKind::In(i) => i.keys.iter_mut().for_each(|k| expr_all_mut(k, f)),
        ExprKind::Call(c) => c.args.iter_mut().for_each(|a| expr_all_mut(a, f)),
        ExprKind::Unary(_, x)
        | ExprKind::Stat(_, x)
        | ExprKind::Hist(_, x)
        | ExprKind::Entry(x)
        | ExprKind::Defined(x)
        | ExprKind::Variance(x, _)
        | ExprKind::AddressOf(x) => expr_all_mut(x, f),
        ExprKind::Binary(_, p)
        | ExprKind::Assign(_, p)
        | ExprKind::Aggregate(p)
        | ExprKind::RegexMatch(p, _) => {
            expr_all_mut(&mut p.0, f);
            expr_all_mut(&mut p.1, f);
        }
        ExprKind::Ternary(t) => {
            expr_all_mut(&mut t.0, f);
            expr_all_mut(&mut t.1, f);
            expr_all_mut(&mut t.2, f);
        }
        ExprKind::IncDec(i) => expr_all_mut(&mut i.target, f),
        ExprKind::Cast(c) => {
            expr_all_mut(&mut c.pointer, f);
            c.indexes.iter_mut().for_each(|x| expr_all_mut(x, f));
        }
    }
    f(e);
}

/// The body of user function `index`, when it is a block.
pub fn function_body(prog: &Program, index: usize) -> Option<&Block> {
    match &prog.script.functions.get(index)?.body {
        FunctionBody::Block(b) => Some(b),
        _ => None,
    }
}

/// The user functions `s` calls directly, by index.
pub fn called_functions(prog: &Program, s: &Stmt) -> Vec<usize> {
    let mut out = Vec::new();
    stmt_exprs(s, &mut |e| {
        if let ExprKind::Call(c) = &e.kind {
            if let Some(&i) = prog.functions.get(&c.name.name) {
                out.push(i);
            }
        }
    });
    out
}

/// The user functions reachable from `start` (transitively), by index, `start` included.
pub fn reachable_functions(prog: &Program, start: &[usize]) -> Vec<usize> {
    let mut seen: Vec<usize> = Vec::new();
    let mut todo: Vec<usize> = start.to_vec();
    while let Some(i) = todo.pop() {
        if seen.contains(&i) {
            continue;
        }
        seen.push(i);
        if let Some(b) = function_body(prog, i) {
            for s in &b.stmts {
                todo.extend(called_functions(prog, s));
            }
        }
    }
    seen
}

/// Whether `e` writes global `name`: assigns, increments, `<<<` or deletes it (whole or an
/// element).
pub fn writes_global(e: &Expr, name: &str) -> bool {
    let target = |t: &Expr| match &t.kind {
        ExprKind::Var(n) => n == name,
        ExprKind::Index(ix) => ix.array.name == name,
        _ => false,
    };
    match &e.kind {
        ExprKind::Assign(_, p) | ExprKind::Aggregate(p) => target(&p.0),
        ExprKind::IncDec(i) => target(&i.target),
        _ => false,
    }
}

/// Whether statement `s` (or a user function it reaches) writes or deletes global `name`.
pub fn stmt_writes(prog: &Program, s: &Stmt, name: &str) -> bool {
    let mut hit = false;
    let visit = |s: &Stmt, hit: &mut bool| {
        stmt_exprs(s, &mut |e| *hit |= writes_global(e, name));
        *hit |= deletes(s, name);
    };
    visit(s, &mut hit);
    for i in reachable_functions(prog, &called_functions(prog, s)) {
        if let Some(b) = function_body(prog, i) {
            for s in &b.stmts {
                visit(s, &mut hit);
            }
        }
    }
    hit
}

/// Whether probe `probe` of `prog` (its condition, its body, or a user function it reaches)
/// may read guest memory ([`reads_memory`]): a host-side probe that does needs the guest
/// stopped.
pub fn probe_reads_guest_memory(prog: &Program, probe: usize) -> bool {
    let Some(p) = prog.script.probes.get(probe) else {
        return true;
    };
    let mut hit = false;
    if let Some(c) = &p.condition {
        expr_all(c, &mut |e| hit |= reads_memory(e));
    }
    block_exprs(&p.body, &mut |e| {
        expr_all(e, &mut |i| hit |= reads_memory(i))
    });
    let direct: Vec<usize> = p
        .body
        .stmts
        .iter()
        .flat_map(|s| called_functions(prog, s))
        .collect();
    for f in reachable_functions(prog, &direct) {
        if let Some(b) = function_body(prog, f) {
            block_exprs(b, &mut |e| expr_all(e, &mut |i| hit |= reads_memory(i)));
        }
    }
    hit
}

/// Whether probe `probe` of `prog` (its condition, its body, or a user function it reaches)
/// may write or delete any global.
pub fn probe_writes_globals(prog: &Program, probe: usize) -> bool {
    let Some(p) = prog.script.probes.get(probe) else {
        return true;
    };
    let names: Vec<&String> = prog.globals.keys().collect();
    let mut hit = false;
    if let Some(c) = &p.condition {
        expr_all(c, &mut |e| {
            hit |= names.iter().any(|n| writes_global(e, n));
        });
    }
    hit || p
        .body
        .stmts
        .iter()
        .any(|s| names.iter().any(|n| stmt_writes(prog, s, n)))
}

/// Whether `s` holds a `delete` of global `name` (or of one of its elements).
fn deletes(s: &Stmt, name: &str) -> bool {
    match &s.kind {
        StmtKind::Delete(e) => match &e.kind {
            ExprKind::Var(n) => n == name,
            ExprKind::Index(ix) => ix.array.name == name,
            _ => false,
        },
        StmtKind::Block(b) => b.stmts.iter().any(|s| deletes(s, name)),
        StmtKind::If(i) => {
            deletes(&i.then, name) || i.els.as_ref().is_some_and(|e| deletes(e, name))
        }
        StmtKind::While(w) => deletes(&w.1, name),
        StmtKind::For(f) => deletes(&f.body, name),
        StmtKind::Foreach(f) => deletes(&f.body, name),
        StmtKind::Try(t) => t
            .body
            .stmts
            .iter()
            .chain(&t.handler.stmts)
            .any(|s| deletes(s, name)),
        _ => false,
    }
}

/// Whether `e` reads guest memory (whose fault message the interpreter takes from the host).
pub fn reads_memory(e: &Expr) -> bool {
    match &e.kind {
        ExprKind::Target(t) => !t.members.is_empty(),
        ExprKind::Cast(_) => true,
        ExprKind::Call(c) => c.name.name.starts_with("kernel_") || c.name.name.starts_with("user_"),
        _ => false,
    }
}

/// Whether `e` may produce a string the host interns (longer than 15 bytes), which the guest
/// cannot order: long literals and the probe point's names.
pub fn may_intern(e: &Expr) -> bool {
    match &e.kind {
        ExprKind::Str(s) => s.len() >= 16 || s.as_bytes().first() == Some(&1),
        ExprKind::Call(c) => matches!(
            c.name.name.as_str(),
            "probefunc"
                | "ppfunc"
                | "pp"
                | "substr"
                | "sprint"
                | "sprintln"
                | "text_str"
                | "string_quoted"
                | "str_replace"
                | "sprintf"
        ),
        // A built string over 15 bytes is in the guest's string table.
        ExprKind::Binary(BinOp::Concat, _) | ExprKind::Assign(Some(BinOp::Concat), _) => true,
        _ => false,
    }
}

/// Whether `b` uses arrays or aggregates (then a function's frame needs key buffers).
pub fn uses_tables(prog: &Program, b: &Block) -> bool {
    let mut hit = false;
    block_exprs(b, &mut |e| {
        hit |= match &e.kind {
            ExprKind::Index(_) | ExprKind::In(_) | ExprKind::Stat(..) | ExprKind::Hist(..) => true,
            ExprKind::Var(n) => prog.globals.get(n).is_some_and(|g| {
                g.value == crate::check::Ty::Stats || g.shape == crate::check::Shape::Array
            }),
            _ => false,
        };
    });
    let mut foreach = false;
    for s in &b.stmts {
        foreach |= has_foreach(s);
    }
    hit || foreach
}

fn has_foreach(s: &Stmt) -> bool {
    match &s.kind {
        StmtKind::Foreach(_) => true,
        StmtKind::Block(b) => b.stmts.iter().any(has_foreach),
        StmtKind::If(i) => has_foreach(&i.then) || i.els.as_ref().is_some_and(has_foreach),
        StmtKind::While(w) => has_foreach(&w.1),
        StmtKind::For(f) => has_foreach(&f.body),
        StmtKind::Try(t) => t.body.stmts.iter().chain(&t.handler.stmts).any(has_foreach),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::check;
    use crate::parser::parse;
    use crate::Limits;

    fn program(src: &str) -> Program {
        check(parse(src, &Limits::default()).unwrap()).unwrap()
    }

    #[test]
    fn functions_reached_through_calls_are_found_once_each() {
        let prog = program(
            "function a(n) { return b(n) + b(n) } function b(n) { return c(n) } \
             function c(n) { return n ? c(n - 1) : 0 } function unused() { return 1 } \
             probe begin { x = a(3) }",
        );
        let start = called_functions(&prog, &prog.script.probes[0].body.stmts[0]);

        let mut reached = reachable_functions(&prog, &start);

        reached.sort_unstable();
        assert_eq!(reached, vec![0, 1, 2]);
    }

    #[test]
    fn writes_are_seen_in_the_body_and_in_the_functions_it_calls() {
        let prog = program(
            "global a, b function f() { delete b[1] } \
             probe begin { foreach (k in a) { a[k]++ } foreach (k in b) f() } \
             probe end { a[1] = 1; b[1] = 2 }",
        );
        let body = &prog.script.probes[0].body.stmts;
        let (StmtKind::Foreach(first), StmtKind::Foreach(second)) = (&body[0].kind, &body[1].kind)
        else {
            panic!("not two foreach loops")
        };

        let found = (
            stmt_writes(&prog, &first.body, "a"),
            stmt_writes(&prog, &first.body, "b"),
            stmt_writes(&prog, &second.body, "b"),
        );

        assert_eq!(found, (true, false, true));
    }

    #[test]
    fn long_literals_and_point_names_may_be_interned_short_literals_not() {
        let prog =
            program(r#"probe begin { x = "short"; y = "a literal of twenty"; z = probefunc() }"#);
        let mut interned = Vec::new();

        block_exprs(&prog.script.probes[0].body, &mut |e| {
            if matches!(e.kind, ExprKind::Str(_) | ExprKind::Call(_)) {
                interned.push(may_intern(e));
            }
        });

        assert_eq!(interned, vec![false, true, true]);
    }
}
