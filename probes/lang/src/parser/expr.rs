//! Expressions: precedence climbing over [`BINARY`], unary operators, primaries.

use super::*;

impl Parser {
    /// Parses one expression (assignment level).
    pub(super) fn expr(&mut self) -> PResult<Expr> {
        self.enter()?;
        let e = self.assignment();
        self.leave();
        e
    }

    pub(super) fn assignment(&mut self) -> PResult<Expr> {
        let lhs = self.ternary()?;
        let op = match &self.peek().tok {
            Tok::Op(o) => *o,
            _ => return Ok(lhs),
        };
        if op == "<<<" {
            self.bump();
            check_lvalue(&lhs, op)?;
            let rhs = self.expr()?;
            let span = lhs.span.to(rhs.span);
            return Ok(Expr {
                kind: ExprKind::Aggregate(Box::new((lhs, rhs))),
                span,
            });
        }
        let Some(&(_, bin)) = ASSIGN.iter().find(|(t, _)| *t == op) else {
            return Ok(lhs);
        };
        self.bump();
        check_lvalue(&lhs, op)?;
        let rhs = self.expr()?;
        let span = lhs.span.to(rhs.span);
        Ok(Expr {
            kind: ExprKind::Assign(bin, Box::new((lhs, rhs))),
            span,
        })
    }

    pub(super) fn ternary(&mut self) -> PResult<Expr> {
        let cond = self.binary(1)?;
        if !self.eat_op("?") {
            return Ok(cond);
        }
        let then = self.expr()?;
        self.expect_op(":")?;
        self.enter()?;
        let els = self.ternary();
        self.leave();
        let els = els?;
        let span = cond.span.to(els.span);
        Ok(Expr {
            kind: ExprKind::Ternary(Box::new((cond, then, els))),
            span,
        })
    }

    pub(super) fn binary(&mut self, min_prec: u8) -> PResult<Expr> {
        let mut lhs = self.unary()?;
        loop {
            if min_prec <= IN_PREC && self.is_kw("in") {
                self.bump();
                let array = self.ident("an array name")?;
                let span = lhs.span.to(array.span);
                lhs = Expr {
                    kind: ExprKind::In(Box::new(InExpr {
                        keys: vec![lhs],
                        array,
                    })),
                    span,
                };
                continue;
            }
            let op = match &self.peek().tok {
                Tok::Op(o) => *o,
                _ => break,
            };
            if (op == "=~" || op == "!~") && min_prec <= REGEX_PREC {
                self.bump();
                self.enter()?;
                let rhs = self.binary(REGEX_PREC + 1);
                self.leave();
                let rhs = rhs?;
                let span = lhs.span.to(rhs.span);
                lhs = Expr {
                    kind: ExprKind::RegexMatch(Box::new((lhs, rhs)), op == "!~"),
                    span,
                };
                continue;
            }
            let Some(&(_, bin, prec)) = BINARY.iter().find(|(t, _, _)| *t == op) else {
                break;
            };
            if prec < min_prec {
                break;
            }
            self.bump();
            self.enter()?;
            let rhs = self.binary(prec + 1);
            self.leave();
            let rhs = rhs?;
            let span = lhs.span.to(rhs.span);
            lhs = Expr {
                kind: ExprKind::Binary(bin, Box::new((lhs, rhs))),
                span,
            };
        }
        Ok(lhs)
    }

    pub(super) fn unary(&mut self) -> PResult<Expr> {
        let t = self.peek().clone();
        let op = match t.tok {
            Tok::Op("-") => Some(UnOp::Neg),
            Tok::Op("+") => Some(UnOp::Plus),
            Tok::Op("!") => Some(UnOp::Not),
            Tok::Op("~") => Some(UnOp::BitNot),
            _ => None,
        };
        if let Some(op) = op {
            self.bump();
            // `-9223372036854775808` is a literal, not the negation of an overflowing one.
            if op == UnOp::Neg {
                if let Tok::Num(n) = self.peek().tok {
                    let end = self.bump().span;
                    return Ok(Expr {
                        kind: ExprKind::Num(n.wrapping_neg()),
                        span: t.span.to(end),
                    });
                }
            }
            self.enter()?;
            let inner = self.unary();
            self.leave();
            let inner = inner?;
            let span = t.span.to(inner.span);
            return Ok(Expr {
                kind: ExprKind::Unary(op, Box::new(inner)),
                span,
            });
        }
        if t.tok == Tok::Op("&") {
            self.bump();
            self.enter()?;
            let inner = self.unary();
            self.leave();
            let inner = inner?;
            let member = match &inner.kind {
                ExprKind::Target(v) => !v.name.starts_with("$$"),
                // `&@cast(p, "T")` is the structure's address (SystemTap's @container_of).
                ExprKind::Cast(_) => true,
                _ => false,
            };
            if !member {
                return Err(ParseError::Unexpected {
                    expected: "a target variable or struct member after '&' ($var, $p->member \
                               or @cast(...)->member)"
                        .into(),
                    found: "something else".into(),
                    span: inner.span,
                });
            }
            let span = t.span.to(inner.span);
            return Ok(Expr {
                kind: ExprKind::AddressOf(Box::new(inner)),
                span,
            });
        }
        if matches!(t.tok, Tok::Op("++") | Tok::Op("--")) {
            self.bump();
            self.enter()?;
            let target = self.unary();
            self.leave();
            let target = target?;
            check_lvalue(&target, if t.tok == Tok::Op("++") { "++" } else { "--" })?;
            let span = t.span.to(target.span);
            let increment = t.tok == Tok::Op("++");
            let inc = IncDec {
                prefix: true,
                increment,
                target,
            };
            return Ok(Expr {
                kind: ExprKind::IncDec(Box::new(inc)),
                span,
            });
        }
        let e = self.primary()?;
        if self.is_op("++") || self.is_op("--") {
            let op = self.bump();
            let increment = op.tok == Tok::Op("++");
            check_lvalue(&e, if increment { "++" } else { "--" })?;
            let span = e.span.to(op.span);
            let inc = IncDec {
                prefix: false,
                increment,
                target: e,
            };
            return Ok(Expr {
                kind: ExprKind::IncDec(Box::new(inc)),
                span,
            });
        }
        Ok(e)
    }

    pub(super) fn expr_list(&mut self, close: &str) -> PResult<Vec<Expr>> {
        let mut out = Vec::new();
        if self.is_op(close) {
            self.bump();
            return Ok(out);
        }
        loop {
            out.push(self.expr()?);
            if !self.eat_op(",") {
                break;
            }
        }
        self.expect_op(close)?;
        Ok(out)
    }

    pub(super) fn primary(&mut self) -> PResult<Expr> {
        let t = self.peek().clone();
        let kind = match t.tok {
            Tok::Num(n) => {
                self.bump();
                ExprKind::Num(n)
            }
            Tok::Str(s) => {
                self.bump();
                ExprKind::Str(s)
            }
            Tok::Op("(") => {
                self.bump();
                let e = self.expr()?;
                self.expect_op(")")?;
                return Ok(e);
            }
            Tok::Op("[") => {
                self.bump();
                let keys = self.expr_list("]")?;
                if !self.eat_kw("in") {
                    return self.unexpected("'in' after a key list");
                }
                let array = self.ident("an array name")?;
                ExprKind::In(Box::new(InExpr { keys, array }))
            }
            Tok::Target(name) => {
                self.bump();
                let members = self.target_members()?;
                ExprKind::Target(TargetVar { name, members })
            }
            Tok::At(name) => return self.at_expr(&name),
            Tok::Embedded(code) => {
                self.bump();
                ExprKind::Embedded(code)
            }
            Tok::Op("*") if self.wildcard_keys => {
                self.bump();
                ExprKind::Wildcard
            }
            Tok::Ident(ref s) if !KEYWORDS.contains(&s.as_str()) => {
                let name = self.ident("a name")?;
                if self.eat_op("(") {
                    let args = self.expr_list(")")?;
                    ExprKind::Call(Box::new(Call { name, args }))
                } else if self.eat_op("[") {
                    let keys = self.expr_list("]")?;
                    if keys.is_empty() {
                        return Err(ParseError::Unexpected {
                            expected: "at least one array key".into(),
                            found: "'[]'".into(),
                            span: self.prev_end(),
                        });
                    }
                    ExprKind::Index(Box::new(IndexExpr { array: name, keys }))
                } else if self.is_op("->") {
                    // SystemTap's autocast: the local keeps the type of what it was copied
                    // from, which the checker finds.
                    let (members, indexes) = self.member_chain()?;
                    ExprKind::Cast(Box::new(CastExpr {
                        pointer: Expr {
                            kind: ExprKind::Var(name.name),
                            span: name.span,
                        },
                        type_name: String::new(),
                        module: None,
                        members,
                        indexes,
                        like: Some(String::new()),
                    }))
                } else {
                    ExprKind::Var(name.name)
                }
            }
            _ => return self.unexpected("an expression"),
        };
        Ok(Expr {
            kind,
            span: t.span.to(self.prev_end()),
        })
    }

    pub(super) fn at_expr(&mut self, name: &str) -> PResult<Expr> {
        let start = self.bump().span;
        let bare = &name[1..];
        if let Some(op) = StatOp::from_name(bare) {
            self.expect_op("(")?;
            let target = self.expr()?;
            self.expect_op(")")?;
            let span = start.to(self.prev_end());
            return Ok(Expr {
                kind: ExprKind::Stat(op, Box::new(target)),
                span,
            });
        }
        let kind = match bare {
            "hist_log" => {
                self.expect_op("(")?;
                let target = self.expr()?;
                self.expect_op(")")?;
                ExprKind::Hist(HistKind::Log, Box::new(target))
            }
            "hist_linear" => {
                self.expect_op("(")?;
                let target = self.expr()?;
                let mut nums = [0i64; 3];
                for n in &mut nums {
                    self.expect_op(",")?;
                    match self.literal()? {
                        (Literal::Num(v), _) => *n = v,
                        (_, span) => {
                            return Err(ParseError::Unexpected {
                                expected: "a number literal".into(),
                                found: "a string".into(),
                                span,
                            })
                        }
                    }
                }
                self.expect_op(")")?;
                let [start, stop, interval] = nums;
                ExprKind::Hist(
                    HistKind::Linear {
                        start,
                        stop,
                        interval,
                    },
                    Box::new(target),
                )
            }
            "entry" => ExprKind::Entry(Box::new(self.one_argument()?)),
            "defined" => ExprKind::Defined(Box::new(self.one_argument()?)),
            "choose_defined" => {
                self.expect_op("(")?;
                let first = self.expr()?;
                self.expect_op(",")?;
                let second = self.expr()?;
                self.expect_op(")")?;
                let test = Expr {
                    kind: ExprKind::Defined(Box::new(first.clone())),
                    span: first.span,
                };
                ExprKind::Ternary(Box::new((test, first, second)))
            }
            "variance" => {
                self.expect_op("(")?;
                let target = self.expr()?;
                let mut shift = 0;
                if self.eat_op(",") {
                    shift = match self.literal()? {
                        (Literal::Num(n @ 0..=62), _) => n as u32,
                        (_, span) => {
                            return Err(ParseError::Unexpected {
                                expected: "a bit shift from 0 to 62".into(),
                                found: "something else".into(),
                                span,
                            })
                        }
                    };
                }
                self.expect_op(")")?;
                ExprKind::Variance(Box::new(target), shift)
            }
            "cast" => {
                self.expect_op("(")?;
                let pointer = self.expr()?;
                self.expect_op(",")?;
                let type_name = self.string_literal("the type name as a string")?;
                let module = if self.eat_op(",") {
                    Some(self.string_literal("the module as a string")?)
                } else {
                    None
                };
                self.expect_op(")")?;
                let (members, indexes) = self.member_chain()?;
                ExprKind::Cast(Box::new(CastExpr {
                    pointer,
                    type_name,
                    module,
                    members,
                    indexes,
                    like: None,
                }))
            }
            "var" => {
                self.expect_op("(")?;
                let spec = self.string_literal("the variable as a string, e.g. \"name@file.c\"")?;
                if self.eat_op(",") {
                    self.string_literal("the module as a string")?;
                }
                self.expect_op(")")?;
                // A kernel global, found by its symbol (and file), not a local of the point.
                let name = format!("@var(\"{}\")", spec.escape_default());
                let members = self.target_members()?;
                ExprKind::Target(TargetVar { name, members })
            }
            _ => {
                return Err(ParseError::UnknownAt {
                    name: name.to_string(),
                    span: start,
                })
            }
        };
        Ok(Expr {
            kind,
            span: start.to(self.prev_end()),
        })
    }

    /// The member chain of a target variable, whose indexes must be constants (the captured
    /// value of `$p->a[2]` is named by its path).
    fn target_members(&mut self) -> PResult<Vec<String>> {
        let (members, indexes) = self.member_chain()?;
        match indexes.first() {
            Some(index) => Err(ParseError::Unsupported {
                what: "a member index computed at run time on a target variable ($p->a[i]: \
                       host-evaluated probes capture target values by their path, so the \
                       index must be a constant)"
                    .into(),
                span: index.span,
            }),
            None => Ok(members),
        }
    }

    /// `->a->b[2]->c$` after a target variable or `@cast(...)`: member names (keywords
    /// included: `->function`), with a constant array index (`[2]`) or a pretty-printing
    /// suffix (`$`, `$$`) kept in the member's text. An index before any member is a
    /// member of its own (`@cast(p, "long")[1]`). An index that is not a number literal is
    /// written `[?]` and its expression returned beside the members, in order.
    fn member_chain(&mut self) -> PResult<(Vec<String>, Vec<Expr>)> {
        let mut members: Vec<String> = Vec::new();
        let mut indexes = Vec::new();
        loop {
            if self.is_op("[") {
                let constant = match self.peek_at(1) {
                    Tok::Num(_) => matches!(self.peek_at(2), Tok::Op("]")),
                    Tok::Op("-") => {
                        matches!(self.peek_at(2), Tok::Num(_))
                            && matches!(self.peek_at(3), Tok::Op("]"))
                    }
                    _ => false,
                };
                let index = if constant {
                    self.constant_index()?
                } else {
                    self.bump();
                    self.enter()?;
                    let e = self.expr();
                    self.leave();
                    indexes.push(e?);
                    self.expect_op("]")?;
                    "[?]".to_string()
                };
                match members.last_mut() {
                    Some(last) => last.push_str(&index),
                    None => members.push(index),
                }
                continue;
            }
            if !self.eat_op("->") {
                return Ok((members, indexes));
            }
            let mut name = match &self.peek().tok {
                Tok::Ident(s) => s.clone(),
                _ => return self.unexpected("a struct member name"),
            };
            let end = self.bump().span;
            if let Tok::Target(suffix) = &self.peek().tok {
                if (suffix == "$" || suffix == "$$") && self.peek().span.start == end.end {
                    name.push_str(suffix);
                    self.bump();
                }
            }
            members.push(name);
        }
    }

    /// `[N]` in a member chain.
    fn constant_index(&mut self) -> PResult<String> {
        self.expect_op("[")?;
        let n = match self.literal()? {
            (Literal::Num(n), _) => n,
            (_, span) => {
                return Err(ParseError::Unexpected {
                    expected: "a constant array index".into(),
                    found: "a string".into(),
                    span,
                })
            }
        };
        self.expect_op("]")?;
        Ok(format!("[{n}]"))
    }

    /// `( expr )` after an `@` operator.
    fn one_argument(&mut self) -> PResult<Expr> {
        self.expect_op("(")?;
        let e = self.expr()?;
        self.expect_op(")")?;
        Ok(e)
    }

    fn string_literal(&mut self, what: &str) -> PResult<String> {
        match self.peek().tok.clone() {
            Tok::Str(s) => {
                self.bump();
                Ok(s)
            }
            _ => self.unexpected(what),
        }
    }
}
