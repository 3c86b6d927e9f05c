//! Statements: blocks, control flow, `foreach`, `try`.

use super::*;

impl Parser {
    pub(super) fn block(&mut self) -> PResult<Block> {
        let start = self.expect_op("{")?;
        self.enter()?;
        let mut stmts = Vec::new();
        while !self.is_op("}") {
            if matches!(self.peek().tok, Tok::Eof) {
                return self.unexpected("'}'");
            }
            stmts.push(self.stmt()?);
        }
        let end = self.bump().span;
        self.leave();
        Ok(Block {
            stmts,
            span: start.to(end),
        })
    }

    pub(super) fn stmt(&mut self) -> PResult<Stmt> {
        self.enter()?;
        let s = self.stmt_inner();
        self.leave();
        s
    }

    pub(super) fn stmt_inner(&mut self) -> PResult<Stmt> {
        let start = self.peek().span;
        let kind = match self.peek().tok.clone() {
            Tok::Op(";") => {
                self.bump();
                StmtKind::Empty
            }
            Tok::Op("{") => StmtKind::Block(self.block()?),
            Tok::Ident(kw) => match kw.as_str() {
                "if" => {
                    self.bump();
                    let cond = self.paren_expr()?;
                    let then = self.stmt()?;
                    let els = if self.eat_kw("else") {
                        Some(self.stmt()?)
                    } else {
                        None
                    };
                    StmtKind::If(Box::new(IfStmt { cond, then, els }))
                }
                "while" => {
                    self.bump();
                    let cond = self.paren_expr()?;
                    StmtKind::While(Box::new((cond, self.stmt()?)))
                }
                "for" => self.for_stmt()?,
                "foreach" => self.foreach()?,
                "next" | "break" | "continue" => {
                    self.bump();
                    match kw.as_str() {
                        "next" => StmtKind::Next,
                        "break" => StmtKind::Break,
                        _ => StmtKind::Continue,
                    }
                }
                "return" => {
                    self.bump();
                    if self.is_op(";") || self.is_op("}") {
                        StmtKind::Return(None)
                    } else {
                        StmtKind::Return(Some(self.expr()?))
                    }
                }
                "delete" => {
                    self.bump();
                    self.wildcard_keys = true;
                    let e = self.expr();
                    self.wildcard_keys = false;
                    StmtKind::Delete(e?)
                }
                "try" => {
                    self.bump();
                    let body = self.block()?;
                    if !self.eat_kw("catch") {
                        return self.unexpected("'catch'");
                    }
                    let var = if self.eat_op("(") {
                        let v = self.ident("a variable for the error message")?;
                        self.expect_op(")")?;
                        Some(v)
                    } else {
                        None
                    };
                    let handler = self.block()?;
                    StmtKind::Try(Box::new(TryStmt { body, var, handler }))
                }
                "else" | "catch" | "in" | "limit" => return self.unexpected("a statement"),
                "probe" | "global" | "function" => {
                    return self.unexpected("a statement (missing '}'?)")
                }
                _ => StmtKind::Expr(self.expr()?),
            },
            // Embedded C as a statement is an expression statement the checker refuses.
            _ => StmtKind::Expr(self.expr()?),
        };
        self.eat_op(";");
        Ok(Stmt {
            kind,
            span: start.to(self.prev_end()),
        })
    }

    pub(super) fn paren_expr(&mut self) -> PResult<Expr> {
        self.expect_op("(")?;
        let e = self.expr()?;
        self.expect_op(")")?;
        Ok(e)
    }

    pub(super) fn for_stmt(&mut self) -> PResult<StmtKind> {
        self.bump();
        self.expect_op("(")?;
        let init = if self.is_op(";") {
            None
        } else {
            Some(self.expr()?)
        };
        self.expect_op(";")?;
        let cond = if self.is_op(";") {
            None
        } else {
            Some(self.expr()?)
        };
        self.expect_op(";")?;
        let step = if self.is_op(")") {
            None
        } else {
            Some(self.expr()?)
        };
        self.expect_op(")")?;
        let body = self.stmt()?;
        Ok(StmtKind::For(Box::new(ForStmt {
            init,
            cond,
            step,
            body,
        })))
    }

    pub(super) fn sort_suffix(&mut self) -> Option<bool> {
        if self.eat_op("+") {
            Some(false)
        } else if self.eat_op("-") {
            Some(true)
        } else {
            None
        }
    }

    pub(super) fn foreach(&mut self) -> PResult<StmtKind> {
        self.bump();
        self.expect_op("(")?;
        let mut sort: Option<Sort> = None;
        let mut set_sort = |p: &Parser, s: Sort| -> PResult<()> {
            if sort.is_some() {
                return Err(ParseError::Unexpected {
                    expected: "at most one sort order in foreach".into(),
                    found: "a second one".into(),
                    span: p.prev_end(),
                });
            }
            sort = Some(s);
            Ok(())
        };
        let mut value = None;
        if matches!(self.peek().tok, Tok::Ident(_)) && matches!(self.peek_at(1), Tok::Op("=")) {
            value = Some(self.ident("a variable")?);
            self.bump();
        }
        let mut keys = Vec::new();
        if self.eat_op("[") {
            loop {
                keys.push(self.ident("a key variable")?);
                if let Some(descending) = self.sort_suffix() {
                    let key = SortKey::Key(keys.len() - 1);
                    set_sort(
                        self,
                        Sort {
                            key,
                            descending,
                            stat: None,
                        },
                    )?;
                }
                if !self.eat_op(",") {
                    break;
                }
            }
            self.expect_op("]")?;
        } else {
            keys.push(self.ident("a key variable or '['")?);
            if let Some(descending) = self.sort_suffix() {
                set_sort(
                    self,
                    Sort {
                        key: SortKey::Key(0),
                        descending,
                        stat: None,
                    },
                )?;
            }
        }
        if !self.eat_kw("in") {
            return self.unexpected("'in'");
        }
        let array = self.ident("an array name")?;
        let slice = if self.eat_op("[") {
            self.wildcard_keys = true;
            let keys = self.expr_list("]");
            self.wildcard_keys = false;
            let keys = keys?;
            if keys.is_empty() {
                return self.unexpected("the keys of an array slice");
            }
            Some(keys)
        } else {
            None
        };
        let mut stat = None;
        if let Tok::At(name) = self.peek().tok.clone() {
            match StatOp::from_name(&name[1..]) {
                Some(op) => {
                    self.bump();
                    stat = Some(op);
                }
                None => return self.unexpected("@count, @sum, @min, @max or @avg"),
            }
        }
        if let Some(descending) = self.sort_suffix() {
            set_sort(
                self,
                Sort {
                    key: SortKey::Value,
                    descending,
                    stat,
                },
            )?;
        } else if stat.is_some() {
            return self.unexpected("'+' or '-' after the statistic");
        }
        let limit = if self.eat_kw("limit") {
            Some(self.expr()?)
        } else {
            None
        };
        self.expect_op(")")?;
        let body = self.stmt()?;
        Ok(StmtKind::Foreach(Box::new(Foreach {
            value,
            keys,
            array,
            slice,
            sort,
            limit,
            body,
        })))
    }
}
