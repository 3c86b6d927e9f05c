//! Recursive-descent parser from tokens to the [`ast`](super::ast). Expression and statement
//! nesting are bounded by [`Limits::max_parse_depth`] so hostile input cannot exhaust the stack.

use super::ast::*;
use super::lexer::{tokenize, LexError, Tok, Token};
use super::limits::Limits;

/// Why a script could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The tokenizer failed.
    #[error(transparent)]
    Lex(#[from] LexError),
    /// A token that does not fit the grammar here.
    #[error("expected {expected}, found {found}")]
    Unexpected {
        /// What the grammar wanted.
        expected: String,
        /// What was there.
        found: String,
        /// Where.
        span: Span,
    },
    /// Nesting deeper than the limit.
    #[error("nesting deeper than {limit} levels")]
    TooDeep {
        /// The limit.
        limit: usize,
        /// Where it was exceeded.
        span: Span,
    },
    /// The script is larger than the limit.
    #[error("script is {len} bytes, more than the limit of {limit}")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// Valid SystemTap that exotap does not take.
    #[error("{what} is not supported")]
    Unsupported {
        /// The construct.
        what: String,
        /// Where.
        span: Span,
    },
    /// The left side of an assignment is not a variable or array element.
    #[error("left side of '{op}' is not assignable")]
    NotAssignable {
        /// The operator.
        op: String,
        /// The left side.
        span: Span,
    },
}

impl ParseError {
    /// Where the error is.
    pub fn span(&self) -> Span {
        match self {
            ParseError::Lex(e) => e.span(),
            ParseError::Unexpected { span, .. }
            | ParseError::TooDeep { span, .. }
            | ParseError::Unsupported { span, .. }
            | ParseError::NotAssignable { span, .. } => *span,
            ParseError::TooLong { .. } => Span::new(0, 0),
        }
    }

    /// A suggestion shown under the error.
    pub fn hint(&self) -> Option<String> {
        match self {
            ParseError::Unsupported { what, .. } if what.contains("embedded C") => {
                Some("exotap never runs C code in the guest; use script functions".into())
            }
            ParseError::TooDeep { .. } => Some("split the expression using local variables".into()),
            ParseError::NotAssignable { .. } => {
                Some("assign to a variable or an array element such as a[k]".into())
            }
            _ => None,
        }
    }
}

const KEYWORDS: &[&str] = &[
    "probe", "global", "function", "if", "else", "while", "for", "foreach", "in", "limit",
    "next", "break", "continue", "return", "delete", "try", "catch",
];

/// Parses a whole script.
///
/// # Errors
/// The first syntax error.
pub fn parse(src: &str, limits: &Limits) -> Result<Script, ParseError> {
    if src.len() > limits.max_source_len {
        return Err(ParseError::TooLong { len: src.len(), limit: limits.max_source_len });
    }
    let tokens = tokenize(src)?;
    let mut p = Parser { tokens, pos: 0, depth: 0, max_depth: limits.max_parse_depth };
    p.script()
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    depth: usize,
    max_depth: usize,
}

type PResult<T> = Result<T, ParseError>;

/// Binary operator table: token, operator, precedence (higher binds tighter).
const BINARY: &[(&str, BinOp, u8)] = &[
    ("||", BinOp::Or, 1),
    ("&&", BinOp::And, 2),
    ("|", BinOp::BitOr, 3),
    ("^", BinOp::BitXor, 4),
    ("&", BinOp::BitAnd, 5),
    ("==", BinOp::Eq, 7),
    ("!=", BinOp::Ne, 7),
    ("<", BinOp::Lt, 7),
    ("<=", BinOp::Le, 7),
    (">", BinOp::Gt, 7),
    (">=", BinOp::Ge, 7),
    ("<<", BinOp::Shl, 8),
    (">>", BinOp::Shr, 8),
    (".", BinOp::Concat, 9),
    ("+", BinOp::Add, 10),
    ("-", BinOp::Sub, 10),
    ("*", BinOp::Mul, 11),
    ("/", BinOp::Div, 11),
    ("%", BinOp::Mod, 11),
];
/// Precedence of `k in a`.
const IN_PREC: u8 = 6;

const ASSIGN: &[(&str, Option<BinOp>)] = &[
    ("=", None),
    ("+=", Some(BinOp::Add)),
    ("-=", Some(BinOp::Sub)),
    ("*=", Some(BinOp::Mul)),
    ("/=", Some(BinOp::Div)),
    ("%=", Some(BinOp::Mod)),
    ("<<=", Some(BinOp::Shl)),
    (">>=", Some(BinOp::Shr)),
    ("&=", Some(BinOp::BitAnd)),
    ("|=", Some(BinOp::BitOr)),
    ("^=", Some(BinOp::BitXor)),
    (".=", Some(BinOp::Concat)),
];

impl Parser {
    fn peek(&self) -> &Token {
        let last = self.tokens.len().saturating_sub(1);
        &self.tokens[self.pos.min(last)]
    }

    fn peek_at(&self, n: usize) -> &Tok {
        let last = self.tokens.len().saturating_sub(1);
        &self.tokens[(self.pos + n).min(last)].tok
    }

    fn bump(&mut self) -> Token {
        let t = self.peek().clone();
        if self.pos < self.tokens.len() {
            self.pos += 1;
        }
        t
    }

    fn prev_end(&self) -> Span {
        self.tokens.get(self.pos.wrapping_sub(1)).map(|t| t.span).unwrap_or_default()
    }

    fn is_op(&self, op: &str) -> bool {
        matches!(&self.peek().tok, Tok::Op(o) if *o == op)
    }

    fn is_kw(&self, kw: &str) -> bool {
        matches!(&self.peek().tok, Tok::Ident(s) if s == kw)
    }

    fn eat_op(&mut self, op: &str) -> bool {
        let hit = self.is_op(op);
        if hit {
            self.pos += 1;
        }
        hit
    }

    fn eat_kw(&mut self, kw: &str) -> bool {
        let hit = self.is_kw(kw);
        if hit {
            self.pos += 1;
        }
        hit
    }

    fn unexpected<T>(&self, expected: &str) -> PResult<T> {
        let t = self.peek();
        Err(ParseError::Unexpected {
            expected: expected.to_string(),
            found: t.tok.describe(),
            span: t.span,
        })
    }

    fn expect_op(&mut self, op: &str) -> PResult<Span> {
        if self.is_op(op) {
            Ok(self.bump().span)
        } else {
            self.unexpected(&format!("'{op}'"))
        }
    }

    fn ident(&mut self, what: &str) -> PResult<Ident> {
        match &self.peek().tok {
            Tok::Ident(s) if !KEYWORDS.contains(&s.as_str()) => {
                let name = s.clone();
                let span = self.bump().span;
                Ok(Ident { name, span })
            }
            _ => self.unexpected(what),
        }
    }

    fn enter(&mut self) -> PResult<()> {
        self.depth += 1;
        if self.depth > self.max_depth {
            return Err(ParseError::TooDeep { limit: self.max_depth, span: self.peek().span });
        }
        Ok(())
    }

    fn leave(&mut self) {
        self.depth = self.depth.saturating_sub(1);
    }

    fn unsupported<T>(&self, what: &str) -> PResult<T> {
        Err(ParseError::Unsupported { what: what.to_string(), span: self.peek().span })
    }

    // ----- top level -----

    fn script(&mut self) -> PResult<Script> {
        let mut script = Script::default();
        loop {
            match &self.peek().tok {
                Tok::Eof => return Ok(script),
                Tok::Op(";") => {
                    self.bump();
                }
                Tok::Ident(s) if s == "global" => {
                    self.bump();
                    self.globals(&mut script.globals)?;
                }
                Tok::Ident(s) if s == "probe" => script.probes.push(self.probe()?),
                Tok::Ident(s) if s == "function" => script.functions.push(self.function()?),
                Tok::Ident(s) if s == "private" => return self.unsupported("'private'"),
                Tok::Embedded(_) => return self.unsupported("embedded C code"),
                Tok::At(s) if s == "@define" => return self.unsupported("'@define' macros"),
                Tok::Op("%(") => return self.unsupported("preprocessor conditional '%('"),
                _ => return self.unexpected("'probe', 'global' or 'function'"),
            }
        }
    }

    fn literal(&mut self) -> PResult<(Literal, Span)> {
        let start = self.peek().span;
        let negative = self.eat_op("-");
        match self.peek().tok.clone() {
            Tok::Num(n) => {
                let span = start.to(self.bump().span);
                Ok((Literal::Num(if negative { n.wrapping_neg() } else { n }), span))
            }
            Tok::Str(s) if !negative => Ok((Literal::Str(s), self.bump().span)),
            _ => self.unexpected("a number or string literal"),
        }
    }

    fn globals(&mut self, out: &mut Vec<Global>) -> PResult<()> {
        loop {
            let name = self.ident("a global variable name")?;
            let mut g = Global { name, init: None, array_size: None };
            if self.eat_op("[") {
                let size = if self.is_op("]") {
                    None
                } else {
                    match self.literal()? {
                        (Literal::Num(n), _) if n > 0 => Some(n),
                        (_, span) => {
                            return Err(ParseError::Unexpected {
                                expected: "a positive array size".into(),
                                found: "something else".into(),
                                span,
                            })
                        }
                    }
                };
                self.expect_op("]")?;
                g.array_size = Some(size.unwrap_or(0));
            } else if self.eat_op("=") {
                g.init = Some(self.literal()?);
                if matches!(self.peek().tok, Tok::Op(o) if o != "," && o != ";") {
                    return self.unexpected("',' or the end of the declaration (initial values are literals)");
                }
            }
            out.push(g);
            if !self.eat_op(",") {
                return Ok(());
            }
        }
    }

    fn decl_type(&mut self) -> PResult<Option<DeclType>> {
        if !self.eat_op(":") {
            return Ok(None);
        }
        match &self.peek().tok {
            Tok::Ident(s) if s == "long" => {
                self.bump();
                Ok(Some(DeclType::Long))
            }
            Tok::Ident(s) if s == "string" => {
                self.bump();
                Ok(Some(DeclType::Str))
            }
            _ => self.unexpected("type 'long' or 'string'"),
        }
    }

    fn function(&mut self) -> PResult<Function> {
        let start = self.bump().span;
        let name = self.ident("a function name")?;
        let ret = self.decl_type()?;
        self.expect_op("(")?;
        let mut params = Vec::new();
        if !self.is_op(")") {
            loop {
                let name = self.ident("a parameter name")?;
                let ty = self.decl_type()?;
                params.push(Param { name, ty });
                if !self.eat_op(",") {
                    break;
                }
            }
        }
        self.expect_op(")")?;
        let body = if let Tok::Embedded(_) = self.peek().tok {
            FunctionBody::Embedded(self.bump().span)
        } else {
            FunctionBody::Block(self.block()?)
        };
        Ok(Function { name, ret, params, body, span: start.to(self.prev_end()) })
    }

    fn probe(&mut self) -> PResult<Probe> {
        let start = self.bump().span;
        let mut points = vec![self.probe_point()?];
        while self.eat_op(",") {
            points.push(self.probe_point()?);
        }
        if self.is_op("=") || self.is_op("+=") {
            return self.unsupported("a probe alias");
        }
        let condition = if self.eat_kw("if") {
            self.expect_op("(")?;
            let e = self.expr()?;
            self.expect_op(")")?;
            Some(e)
        } else {
            None
        };
        let body = self.block()?;
        Ok(Probe { points, condition, body, span: start.to(self.prev_end()) })
    }

    fn probe_point(&mut self) -> PResult<ProbePoint> {
        let start = self.peek().span;
        let mut components = Vec::new();
        loop {
            let t = self.peek().clone();
            let name = match t.tok {
                Tok::Ident(s) => s,
                Tok::Op("*") => "*".to_string(),
                _ => return self.unexpected("a probe point component"),
            };
            self.bump();
            let mut args = Vec::new();
            if self.eat_op("(") {
                loop {
                    args.push(self.literal()?.0);
                    if !self.eat_op(",") {
                        break;
                    }
                }
                self.expect_op(")")?;
            }
            components.push(Component { name, args, span: t.span.to(self.prev_end()) });
            if !self.eat_op(".") {
                break;
            }
        }
        let mut optional = false;
        let mut sufficient = false;
        loop {
            if self.eat_op("?") {
                optional = true;
            } else if self.eat_op("!") {
                sufficient = true;
            } else {
                break;
            }
        }
        Ok(ProbePoint { components, optional, sufficient, span: start.to(self.prev_end()) })
    }

    // ----- statements -----

    fn block(&mut self) -> PResult<Block> {
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
        Ok(Block { stmts, span: start.to(end) })
    }

    fn stmt(&mut self) -> PResult<Stmt> {
        self.enter()?;
        let s = self.stmt_inner();
        self.leave();
        s
    }

    fn stmt_inner(&mut self) -> PResult<Stmt> {
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
                    let els = if self.eat_kw("else") { Some(self.stmt()?) } else { None };
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
                    StmtKind::Delete(self.expr()?)
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
            Tok::Embedded(_) => return self.unsupported("embedded C code"),
            _ => StmtKind::Expr(self.expr()?),
        };
        self.eat_op(";");
        Ok(Stmt { kind, span: start.to(self.prev_end()) })
    }

    fn paren_expr(&mut self) -> PResult<Expr> {
        self.expect_op("(")?;
        let e = self.expr()?;
        self.expect_op(")")?;
        Ok(e)
    }

    fn for_stmt(&mut self) -> PResult<StmtKind> {
        self.bump();
        self.expect_op("(")?;
        let init = if self.is_op(";") { None } else { Some(self.expr()?) };
        self.expect_op(";")?;
        let cond = if self.is_op(";") { None } else { Some(self.expr()?) };
        self.expect_op(";")?;
        let step = if self.is_op(")") { None } else { Some(self.expr()?) };
        self.expect_op(")")?;
        let body = self.stmt()?;
        Ok(StmtKind::For(Box::new(ForStmt { init, cond, step, body })))
    }

    fn sort_suffix(&mut self) -> Option<bool> {
        if self.eat_op("+") {
            Some(false)
        } else if self.eat_op("-") {
            Some(true)
        } else {
            None
        }
    }

    fn foreach(&mut self) -> PResult<StmtKind> {
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
                    set_sort(self, Sort { key, descending, stat: None })?;
                }
                if !self.eat_op(",") {
                    break;
                }
            }
            self.expect_op("]")?;
        } else {
            keys.push(self.ident("a key variable or '['")?);
            if let Some(descending) = self.sort_suffix() {
                set_sort(self, Sort { key: SortKey::Key(0), descending, stat: None })?;
            }
        }
        if !self.eat_kw("in") {
            return self.unexpected("'in'");
        }
        let array = self.ident("an array name")?;
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
            set_sort(self, Sort { key: SortKey::Value, descending, stat })?;
        } else if stat.is_some() {
            return self.unexpected("'+' or '-' after the statistic");
        }
        let limit = if self.eat_kw("limit") { Some(self.expr()?) } else { None };
        self.expect_op(")")?;
        let body = self.stmt()?;
        Ok(StmtKind::Foreach(Box::new(Foreach { value, keys, array, sort, limit, body })))
    }

    // ----- expressions -----

    /// Parses one expression (assignment level).
    fn expr(&mut self) -> PResult<Expr> {
        self.enter()?;
        let e = self.assignment();
        self.leave();
        e
    }

    fn assignment(&mut self) -> PResult<Expr> {
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
            return Ok(Expr { kind: ExprKind::Aggregate(Box::new((lhs, rhs))), span });
        }
        let Some(&(_, bin)) = ASSIGN.iter().find(|(t, _)| *t == op) else { return Ok(lhs) };
        self.bump();
        check_lvalue(&lhs, op)?;
        let rhs = self.expr()?;
        let span = lhs.span.to(rhs.span);
        Ok(Expr { kind: ExprKind::Assign(bin, Box::new((lhs, rhs))), span })
    }

    fn ternary(&mut self) -> PResult<Expr> {
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
        Ok(Expr { kind: ExprKind::Ternary(Box::new((cond, then, els))), span })
    }

    fn binary(&mut self, min_prec: u8) -> PResult<Expr> {
        let mut lhs = self.unary()?;
        loop {
            if min_prec <= IN_PREC && self.is_kw("in") {
                self.bump();
                let array = self.ident("an array name")?;
                let span = lhs.span.to(array.span);
                lhs = Expr { kind: ExprKind::In(Box::new(InExpr { keys: vec![lhs], array })), span };
                continue;
            }
            let op = match &self.peek().tok {
                Tok::Op(o) => *o,
                _ => break,
            };
            let Some(&(_, bin, prec)) = BINARY.iter().find(|(t, _, _)| *t == op) else { break };
            if prec < min_prec {
                break;
            }
            self.bump();
            self.enter()?;
            let rhs = self.binary(prec + 1);
            self.leave();
            let rhs = rhs?;
            let span = lhs.span.to(rhs.span);
            lhs = Expr { kind: ExprKind::Binary(bin, Box::new((lhs, rhs))), span };
        }
        Ok(lhs)
    }

    fn unary(&mut self) -> PResult<Expr> {
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
                    return Ok(Expr { kind: ExprKind::Num(n.wrapping_neg()), span: t.span.to(end) });
                }
            }
            self.enter()?;
            let inner = self.unary();
            self.leave();
            let inner = inner?;
            let span = t.span.to(inner.span);
            return Ok(Expr { kind: ExprKind::Unary(op, Box::new(inner)), span });
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
            let inc = IncDec { prefix: true, increment, target };
            return Ok(Expr { kind: ExprKind::IncDec(Box::new(inc)), span });
        }
        let e = self.primary()?;
        if self.is_op("++") || self.is_op("--") {
            let op = self.bump();
            let increment = op.tok == Tok::Op("++");
            check_lvalue(&e, if increment { "++" } else { "--" })?;
            let span = e.span.to(op.span);
            let inc = IncDec { prefix: false, increment, target: e };
            return Ok(Expr { kind: ExprKind::IncDec(Box::new(inc)), span });
        }
        Ok(e)
    }

    fn expr_list(&mut self, close: &str) -> PResult<Vec<Expr>> {
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

    fn primary(&mut self) -> PResult<Expr> {
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
                let mut members = Vec::new();
                while self.eat_op("->") {
                    members.push(self.ident("a struct member name")?.name);
                }
                ExprKind::Target(TargetVar { name, members })
            }
            Tok::At(name) => return self.at_expr(&name),
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
                } else {
                    ExprKind::Var(name.name)
                }
            }
            _ => return self.unexpected("an expression"),
        };
        Ok(Expr { kind, span: t.span.to(self.prev_end()) })
    }

    fn at_expr(&mut self, name: &str) -> PResult<Expr> {
        let start = self.bump().span;
        let bare = &name[1..];
        if let Some(op) = StatOp::from_name(bare) {
            self.expect_op("(")?;
            let target = self.expr()?;
            self.expect_op(")")?;
            let span = start.to(self.prev_end());
            return Ok(Expr { kind: ExprKind::Stat(op, Box::new(target)), span });
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
                ExprKind::Hist(HistKind::Linear { start, stop, interval }, Box::new(target))
            }
            "define" => return self.unsupported("'@define' macros"),
            _ => {
                return Err(ParseError::Unexpected {
                    expected: "@count, @sum, @min, @max, @avg, @hist_log or @hist_linear".into(),
                    found: format!("'{name}'"),
                    span: start,
                })
            }
        };
        Ok(Expr { kind, span: start.to(self.prev_end()) })
    }
}

fn check_lvalue(e: &Expr, op: &str) -> PResult<()> {
    match e.kind {
        ExprKind::Var(_) | ExprKind::Index(_) | ExprKind::Target(_) => Ok(()),
        _ => Err(ParseError::NotAssignable { op: op.to_string(), span: e.span }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(src: &str) -> Script {
        parse(src, &Limits::default()).unwrap()
    }

    fn body_expr(src: &str) -> ExprKind {
        let script = parse_ok(&format!("probe begin {{ {src} }}"));
        match &script.probes[0].body.stmts[0].kind {
            StmtKind::Expr(e) => e.kind.clone(),
            other => panic!("not an expression: {other:?}"),
        }
    }

    #[test]
    fn multiplication_binds_tighter_than_addition() {
        let ExprKind::Assign(None, parts) = body_expr("x = 1 + 2 * 3") else { panic!() };
        let ExprKind::Binary(BinOp::Add, operands) = &parts.1.kind else { panic!() };
        assert!(matches!(operands.1.kind, ExprKind::Binary(BinOp::Mul, _)));
    }

    #[test]
    fn concatenation_binds_looser_than_addition() {
        let ExprKind::Assign(None, parts) = body_expr("s = \"a\" . 1 + 2") else { panic!() };
        assert!(matches!(parts.1.kind, ExprKind::Binary(BinOp::Concat, _)));
    }

    #[test]
    fn probe_with_comma_list_and_condition_parses() {
        let script = parse_ok("probe begin, timer.ms(100)? if (1) { }");
        assert_eq!(script.probes[0].points.len(), 2);
        assert!(script.probes[0].points[1].optional);
        assert!(script.probes[0].condition.is_some());
    }

    #[test]
    fn field_probe_point_takes_two_arguments() {
        let script = parse_ok(r#"probe kernel.field("struct file", "f_pos").write { }"#);
        assert_eq!(script.probes[0].points[0].components[1].args.len(), 2);
    }

    #[test]
    fn foreach_with_value_sort_and_limit_parses() {
        let script = parse_ok("global a probe begin { foreach (v = [k, j-] in a limit 3) {} }");
        let StmtKind::Foreach(f) = &script.probes[0].body.stmts[0].kind else { panic!() };
        assert_eq!(f.keys.len(), 2);
        assert_eq!(f.sort, Some(Sort { key: SortKey::Key(1), descending: true, stat: None }));
        assert!(f.value.is_some() && f.limit.is_some());
    }

    #[test]
    fn foreach_with_two_sort_orders_is_an_error() {
        let err = parse("global a probe begin { foreach ([k+] in a-) {} }", &Limits::default());
        assert!(matches!(err, Err(ParseError::Unexpected { .. })));
    }

    #[test]
    fn membership_with_key_list_parses() {
        assert!(matches!(body_expr("[1, \"a\"] in arr"), ExprKind::In(_)));
    }

    #[test]
    fn assignment_to_literal_is_rejected() {
        let err = parse("probe begin { 1 = 2 }", &Limits::default());
        assert!(matches!(err, Err(ParseError::NotAssignable { .. })));
    }

    #[test]
    fn deep_parentheses_hit_the_depth_limit() {
        let src = format!("probe begin {{ x = {}1{} }}", "(".repeat(5000), ")".repeat(5000));
        let err = parse(&src, &Limits::default());
        assert!(matches!(err, Err(ParseError::TooDeep { .. })));
    }

    #[test]
    fn deep_unary_chain_hits_the_depth_limit() {
        let src = format!("probe begin {{ x = {}1 }}", "!".repeat(100_000));
        assert!(matches!(parse(&src, &Limits::default()), Err(ParseError::TooDeep { .. })));
    }

    #[test]
    fn deep_blocks_hit_the_depth_limit() {
        let src = format!("probe begin {}{}", "{".repeat(5000), "}".repeat(5000));
        assert!(matches!(parse(&src, &Limits::default()), Err(ParseError::TooDeep { .. })));
    }

    #[test]
    fn negative_minimum_long_is_a_literal() {
        let ExprKind::Assign(None, parts) = body_expr("x = -9223372036854775808") else { panic!() };
        assert!(matches!(parts.1.kind, ExprKind::Num(i64::MIN)));
    }

    #[test]
    fn embedded_c_at_top_level_is_unsupported() {
        let err = parse("%{ #include <x.h> %}", &Limits::default());
        assert!(matches!(err, Err(ParseError::Unsupported { .. })));
    }

    #[test]
    fn hist_linear_takes_three_literals() {
        let e = body_expr("print(@hist_linear(s, 0, 100, -10))");
        let ExprKind::Call(call) = e else { panic!() };
        assert!(matches!(
            call.args[0].kind,
            ExprKind::Hist(HistKind::Linear { start: 0, stop: 100, interval: -10 }, _)
        ));
    }
}
