//! Recursive-descent parser from tokens to the [`ast`](super::ast). Expression and statement
//! nesting are bounded by [`Limits::max_parse_depth`] so hostile input cannot exhaust the stack.

mod alias;
mod condition;
mod expr;
mod preprocess;
mod shadow;
mod stmt;

use super::ast::*;
use super::invocation::{declare_argv, Invocation};
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
    /// `$N` or `@N` beyond the arguments the script was given.
    #[error("command line argument index {index} out of range [1-{count}]")]
    ArgumentOutOfRange {
        /// N.
        index: usize,
        /// How many arguments there are.
        count: usize,
        /// The `$N` or `@N`.
        span: Span,
    },
    /// `$N` whose argument does not tokenize as script text.
    #[error("command line argument {index} is not script text: {reason}")]
    BadArgument {
        /// N.
        index: usize,
        /// The tokenizer's complaint.
        reason: String,
        /// The `$N`.
        span: Span,
    },
    /// A malformed `%( CONDITION %? ... %: ... %)` or a condition that cannot be evaluated.
    #[error("{message}")]
    Conditional {
        /// What is wrong.
        message: String,
        /// Where.
        span: Span,
    },
    /// `%(` without its `%)`.
    #[error("preprocessor conditional without its closing '%)'")]
    UnterminatedConditional {
        /// The `%(`.
        span: Span,
    },
    /// A malformed `@define` or macro invocation.
    #[error("{message}")]
    Macro {
        /// What is wrong.
        message: String,
        /// Where.
        span: Span,
    },
    /// `@name` that is neither an operator nor a macro defined before.
    #[error("unknown macro or operator '{name}'")]
    UnknownAt {
        /// The name with its `@`.
        name: String,
        /// Where.
        span: Span,
    },
    /// A probe alias that cannot be expanded.
    #[error("{message}")]
    Alias {
        /// What is wrong.
        message: String,
        /// Where.
        span: Span,
    },
    /// The tapset library could not be linked into the script.
    #[error("{message}")]
    Tapset {
        /// What is wrong.
        message: String,
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
            | ParseError::NotAssignable { span, .. }
            | ParseError::ArgumentOutOfRange { span, .. }
            | ParseError::BadArgument { span, .. }
            | ParseError::Conditional { span, .. }
            | ParseError::UnterminatedConditional { span }
            | ParseError::Macro { span, .. }
            | ParseError::Alias { span, .. }
            | ParseError::UnknownAt { span, .. } => *span,
            ParseError::TooLong { .. } | ParseError::Tapset { .. } => Span::new(0, 0),
        }
    }

    /// A suggestion shown under the error.
    pub fn hint(&self) -> Option<String> {
        match self {
            ParseError::TooDeep { .. } => Some("split the expression using local variables".into()),
            ParseError::NotAssignable { .. } => {
                Some("assign to a variable or an array element such as a[k]".into())
            }
            ParseError::ArgumentOutOfRange { count, .. } => Some(format!(
                "the script was given {count} argument(s); pass them after the file: exotap FILE.stp ARG..."
            )),
            ParseError::UnterminatedConditional { .. } => {
                Some("write %( CONDITION %? THEN %: ELSE %)".into())
            }
            ParseError::UnknownAt { .. } => Some(
                "operators: @count @sum @min @max @avg @variance @hist_log @hist_linear @entry \
                 @defined @choose_defined @cast @var; a macro must be defined with @define \
                 before use (SystemTap's tapset macros, .stpm, are not available)"
                    .into(),
            ),
            _ => None,
        }
    }
}

const KEYWORDS: &[&str] = &[
    "probe", "global", "function", "if", "else", "while", "for", "foreach", "in", "limit", "next",
    "break", "continue", "return", "delete", "try", "catch",
];

/// Parses a whole script run without arguments against exotap's default kernel facts.
///
/// # Errors
/// The first syntax error.
pub fn parse(src: &str, limits: &Limits) -> Result<Script, ParseError> {
    parse_with(src, limits, &Invocation::default())
}

/// Parses a whole script: tokens, then the preprocessor (conditionals, macros,
/// script arguments from `inv`), then the grammar; probe aliases are expanded at the end, and
/// `argc`/`argv` declared when the script names them ([`declare_argv`]).
///
/// # Errors
/// The first syntax or preprocessor error.
pub fn parse_with(src: &str, limits: &Limits, inv: &Invocation) -> Result<Script, ParseError> {
    if src.len() > limits.max_source_len {
        return Err(ParseError::TooLong {
            len: src.len(),
            limit: limits.max_source_len,
        });
    }
    // A token has at least one byte: the source limit bounds the expanded script too.
    let tokens = preprocess::preprocess(
        &tokenize(src)?,
        inv,
        limits.max_parse_depth,
        limits.max_source_len,
    )?;
    let mut p = Parser {
        tokens,
        pos: 0,
        depth: 0,
        max_depth: limits.max_parse_depth,
        wildcard_keys: false,
    };
    let mut script = p.script()?;
    let library = |e: super::tapset::TapsetError| ParseError::Tapset {
        message: e.to_string(),
    };
    super::tapset::link_aliases(&mut script, inv, limits).map_err(library)?;
    alias::expand(&mut script, limits.max_parse_depth)?;
    super::tapset::link_functions(&mut script, inv, limits).map_err(library)?;
    shadow::rename_shadowing_params(&mut script);
    let names_used = |name: &str| {
        p.tokens
            .iter()
            .any(|t| matches!(&t.tok, Tok::Ident(s) if s == name))
    };
    declare_argv(&mut script, inv, names_used);
    script.guru = inv.guru;
    Ok(script)
}

/// Parses a tapset library file: tokens, preprocessor and grammar, with its aliases kept
/// unexpanded and nothing linked (the library is what gets linked).
///
/// # Errors
/// The first syntax or preprocessor error.
pub(crate) fn parse_library(
    src: &str,
    limits: &Limits,
    inv: &Invocation,
) -> Result<Script, ParseError> {
    let tokens = preprocess::preprocess(&tokenize(src)?, inv, limits.max_parse_depth, usize::MAX)?;
    let mut p = Parser {
        tokens,
        pos: 0,
        depth: 0,
        max_depth: limits.max_parse_depth,
        wildcard_keys: false,
    };
    p.script()
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    depth: usize,
    max_depth: usize,
    /// Parsing the operand of `delete`, where `*` may stand for an array key.
    wildcard_keys: bool,
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
/// Most probe points one braced probe point may stand for (`a.{b,c}.{d,e}` is four).
const MAX_POINT_EXPANSION: usize = 10_000;
/// Precedence of `k in a`.
const IN_PREC: u8 = 6;
/// Precedence of `s =~ re` and `s !~ re`, that of the comparisons.
const REGEX_PREC: u8 = 7;

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
        self.tokens
            .get(self.pos.wrapping_sub(1))
            .map(|t| t.span)
            .unwrap_or_default()
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
            return Err(ParseError::TooDeep {
                limit: self.max_depth,
                span: self.peek().span,
            });
        }
        Ok(())
    }

    fn leave(&mut self) {
        self.depth = self.depth.saturating_sub(1);
    }

    fn unsupported<T>(&self, what: &str) -> PResult<T> {
        Err(ParseError::Unsupported {
            what: what.to_string(),
            span: self.peek().span,
        })
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
                Tok::Ident(s) if s == "probe" => match self.probe()? {
                    ProbeOrAlias::Probe(p) => script.probes.push(p),
                    ProbeOrAlias::Alias(a) => script.aliases.push(a),
                },
                Tok::Ident(s) if s == "function" => script.functions.push(self.function()?),
                Tok::Ident(s) if s == "private" => return self.unsupported("'private'"),
                // Top-level C (headers, helpers of C functions) is kept out of the script:
                // only calling a C function is refused, by the checker.
                Tok::Embedded(_) => {
                    self.bump();
                }
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
                Ok((
                    Literal::Num(if negative { n.wrapping_neg() } else { n }),
                    span,
                ))
            }
            Tok::Str(s) if !negative => Ok((Literal::Str(s), self.bump().span)),
            _ => self.unexpected("a number or string literal"),
        }
    }

    fn globals(&mut self, out: &mut Vec<Global>) -> PResult<()> {
        loop {
            let name = self.ident("a global variable name")?;
            let mut g = Global {
                name,
                init: None,
                array_size: None,
                wrap: false,
            };
            g.wrap = self.eat_op("%");
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
                g.wrap |= self.eat_op("%");
            } else if g.wrap {
                g.array_size = Some(0);
            } else if self.eat_op("=") {
                g.init = Some(self.literal()?);
                if matches!(self.peek().tok, Tok::Op(o) if o != "," && o != ";") {
                    return self.unexpected(
                        "',' or the end of the declaration (initial values are literals)",
                    );
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
        Ok(Function {
            name,
            ret,
            params,
            body,
            span: start.to(self.prev_end()),
        })
    }

    fn probe(&mut self) -> PResult<ProbeOrAlias> {
        let start = self.bump().span;
        let mut points = self.probe_points()?;
        while self.eat_op(",") {
            points.extend(self.probe_points()?);
        }
        if self.is_op("=") || self.is_op("+=") {
            let epilogue = self.bump().tok == Tok::Op("+=");
            let mut targets = self.probe_points()?;
            while self.eat_op(",") {
                targets.extend(self.probe_points()?);
            }
            let body = self.block()?;
            return Ok(ProbeOrAlias::Alias(ProbeAlias {
                names: points,
                points: targets,
                epilogue,
                body,
                span: start.to(self.prev_end()),
                library: false,
            }));
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
        Ok(ProbeOrAlias::Probe(Probe {
            points,
            condition,
            body,
            span: start.to(self.prev_end()),
        }))
    }

    /// One probe point as written, which braces make several: `syscall.{open,close}` is
    /// `syscall.open, syscall.close`.
    fn probe_points(&mut self) -> PResult<Vec<ProbePoint>> {
        let start = self.peek().span;
        // Each position holds its alternatives; without braces there is one.
        let mut positions: Vec<Vec<(Component, bool, bool)>> = Vec::new();
        loop {
            if self.eat_op("{") {
                let mut alternatives = vec![self.alternative()?];
                while self.eat_op(",") {
                    alternatives.push(self.alternative()?);
                }
                self.expect_op("}")?;
                positions.push(alternatives);
            } else {
                positions.push(vec![(self.component()?, false, false)]);
            }
            if !self.eat_op(".") {
                break;
            }
        }
        let (optional, sufficient) = self.point_flags();
        let span = start.to(self.prev_end());
        let combinations = positions
            .iter()
            .try_fold(1usize, |n, alternatives| n.checked_mul(alternatives.len()));
        if combinations.is_none_or(|n| n > MAX_POINT_EXPANSION) {
            return Err(ParseError::Unexpected {
                expected: format!("at most {MAX_POINT_EXPANSION} probe points from braces"),
                found: "more".into(),
                span,
            });
        }
        // (components, optional, sufficient) of every combination of alternatives.
        let mut points = vec![(Vec::new(), optional, sufficient)];
        for alternatives in positions {
            points = points
                .into_iter()
                .flat_map(|(prefix, o, s): (Vec<Component>, bool, bool)| {
                    alternatives.iter().map(move |(c, co, cs)| {
                        let mut p = prefix.clone();
                        p.push(c.clone());
                        (p, o || *co, s || *cs)
                    })
                })
                .collect();
        }
        Ok(points
            .into_iter()
            .map(|(components, optional, sufficient)| ProbePoint {
                components,
                optional,
                sufficient,
                span,
            })
            .collect())
    }

    /// `?` (optional) and `!` (sufficient) after a probe point or a braced alternative.
    fn point_flags(&mut self) -> (bool, bool) {
        let (mut optional, mut sufficient) = (false, false);
        loop {
            if self.eat_op("?") {
                optional = true;
            } else if self.eat_op("!") {
                sufficient = true;
            } else {
                return (optional, sufficient);
            }
        }
    }

    /// One alternative inside `{...}` of a probe point, with its own flags.
    fn alternative(&mut self) -> PResult<(Component, bool, bool)> {
        let c = self.component()?;
        let (optional, sufficient) = self.point_flags();
        Ok((c, optional, sufficient))
    }

    /// `name` or `name(literals)`; a name may glue words and `*` (`*execve`, `sys_*_at`).
    fn component(&mut self) -> PResult<Component> {
        let t = self.peek().clone();
        let mut name = match t.tok {
            Tok::Ident(s) => s,
            Tok::Op("*") => "*".to_string(),
            _ => return self.unexpected("a probe point component"),
        };
        let mut end = self.bump().span;
        loop {
            let next = self.peek();
            if next.span.start != end.end {
                break;
            }
            match &next.tok {
                Tok::Ident(s) => name.push_str(s),
                Tok::Op("*") => name.push('*'),
                Tok::Num(n) if name.ends_with('*') => name.push_str(&n.to_string()),
                _ => break,
            }
            end = self.bump().span;
        }
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
        Ok(Component {
            name,
            args,
            span: t.span.to(self.prev_end()),
        })
    }
}

/// What a `probe` definition turned out to be.
enum ProbeOrAlias {
    Probe(Probe),
    Alias(ProbeAlias),
}

fn check_lvalue(e: &Expr, op: &str) -> PResult<()> {
    match e.kind {
        ExprKind::Var(_) | ExprKind::Index(_) | ExprKind::Target(_) => Ok(()),
        _ => Err(ParseError::NotAssignable {
            op: op.to_string(),
            span: e.span,
        }),
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
        let ExprKind::Assign(None, parts) = body_expr("x = 1 + 2 * 3") else {
            panic!()
        };
        let ExprKind::Binary(BinOp::Add, operands) = &parts.1.kind else {
            panic!()
        };
        assert!(matches!(operands.1.kind, ExprKind::Binary(BinOp::Mul, _)));
    }

    #[test]
    fn concatenation_binds_looser_than_addition() {
        let ExprKind::Assign(None, parts) = body_expr("s = \"a\" . 1 + 2") else {
            panic!()
        };
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
        let StmtKind::Foreach(f) = &script.probes[0].body.stmts[0].kind else {
            panic!()
        };
        assert_eq!(f.keys.len(), 2);
        assert_eq!(
            f.sort,
            Some(Sort {
                key: SortKey::Key(1),
                descending: true,
                stat: None
            })
        );
        assert!(f.value.is_some() && f.limit.is_some());
    }

    #[test]
    fn foreach_with_two_sort_orders_is_an_error() {
        let err = parse(
            "global a probe begin { foreach ([k+] in a-) {} }",
            &Limits::default(),
        );
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
        let src = format!(
            "probe begin {{ x = {}1{} }}",
            "(".repeat(5000),
            ")".repeat(5000)
        );
        let err = parse(&src, &Limits::default());
        assert!(matches!(err, Err(ParseError::TooDeep { .. })));
    }

    #[test]
    fn deep_unary_chain_hits_the_depth_limit() {
        let src = format!("probe begin {{ x = {}1 }}", "!".repeat(100_000));
        assert!(matches!(
            parse(&src, &Limits::default()),
            Err(ParseError::TooDeep { .. })
        ));
    }

    #[test]
    fn deep_blocks_hit_the_depth_limit() {
        let src = format!("probe begin {}{}", "{".repeat(5000), "}".repeat(5000));
        assert!(matches!(
            parse(&src, &Limits::default()),
            Err(ParseError::TooDeep { .. })
        ));
    }

    #[test]
    fn negative_minimum_long_is_a_literal() {
        let ExprKind::Assign(None, parts) = body_expr("x = -9223372036854775808") else {
            panic!()
        };
        assert!(matches!(parts.1.kind, ExprKind::Num(i64::MIN)));
    }

    #[test]
    fn embedded_c_at_top_level_is_skipped() {
        let script = parse_ok("%{ #include <x.h> %}\nprobe begin { }");
        assert_eq!(script.probes.len(), 1);
    }

    #[test]
    fn embedded_c_expression_parses() {
        assert!(matches!(body_expr("x = %{ 1 %}"), ExprKind::Assign(..)));
    }

    #[test]
    fn script_arguments_are_substituted_before_the_grammar() {
        let inv = Invocation::with_args(["kernel.function(\"vfs_read\")", "5"]);
        let script = parse_with("probe $1 { x = $2 }", &Limits::default(), &inv).unwrap();
        assert_eq!(
            script.probes[0].points[0].to_string(),
            "kernel.function(\"vfs_read\")"
        );
    }

    #[test]
    fn missing_script_argument_is_an_error_with_a_hint() {
        let err = parse("probe begin { x = $1 }", &Limits::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "command line argument index 1 out of range [1-0]"
        );
        assert!(err
            .hint()
            .is_some_and(|h| h.contains("exotap FILE.stp ARG")));
    }

    #[test]
    fn preprocessor_conditional_selects_a_probe() {
        let script = parse_ok(r#"%( arch == "x86_64" %? probe begin { } %: probe end { } %)"#);
        assert_eq!(script.probes[0].points[0].to_string(), "begin");
    }

    #[test]
    fn entry_defined_cast_and_variance_parse() {
        assert!(matches!(body_expr("@entry($x)"), ExprKind::Entry(_)));
        assert!(matches!(body_expr("@defined($x)"), ExprKind::Defined(_)));
        assert!(matches!(
            body_expr("@variance(s, 3)"),
            ExprKind::Variance(_, 3)
        ));
        let ExprKind::Cast(c) = body_expr(r#"@cast(p, "struct task_struct", "kernel")->mm->pgd"#)
        else {
            panic!()
        };
        assert_eq!(
            (c.type_name.as_str(), c.module.as_deref(), c.members.len()),
            ("struct task_struct", Some("kernel"), 2)
        );
    }

    #[test]
    fn choose_defined_is_a_ternary_on_defined() {
        let ExprKind::Ternary(parts) = body_expr("@choose_defined($a, 0)") else {
            panic!()
        };
        assert!(matches!(parts.0.kind, ExprKind::Defined(_)));
    }

    #[test]
    fn var_without_file_is_a_kernel_global() {
        let ExprKind::Target(t) = body_expr(r#"@var("jiffies")"#) else {
            panic!()
        };
        assert_eq!(t.name, "@var(\"jiffies\")");
    }

    #[test]
    fn cast_without_a_type_string_is_an_error() {
        let err = parse("probe begin { @cast(p, 3) }", &Limits::default()).unwrap_err();
        assert!(
            err.to_string().contains("the type name as a string"),
            "{err}"
        );
    }

    #[test]
    fn variance_shift_above_62_is_an_error() {
        let err = parse("probe begin { @variance(s, 63) }", &Limits::default()).unwrap_err();
        assert!(err.to_string().contains("bit shift from 0 to 62"), "{err}");
    }

    #[test]
    fn braces_in_a_probe_point_make_one_point_per_alternative() {
        let script = parse_ok("probe mine.{open,close}.return, begin { }");
        let points: Vec<String> = script.probes[0]
            .points
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            points,
            vec!["mine.open.return", "mine.close.return", "begin"]
        );
    }

    #[test]
    fn brace_expansion_past_the_limit_is_an_error() {
        let src = format!("probe a{} {{ }}", ".{b,c}".repeat(20));
        let err = parse(&src, &Limits::default()).unwrap_err();
        assert!(
            err.to_string().contains("at most 10000 probe points"),
            "{err}"
        );
    }

    #[test]
    fn unclosed_brace_in_a_probe_point_is_an_error() {
        let err = parse("probe syscall.{open,close { }", &Limits::default()).unwrap_err();
        assert!(err.to_string().contains("expected '}'"), "{err}");
    }

    #[test]
    fn wildcard_glued_to_a_word_is_one_component() {
        let script = parse_ok("probe mine.*execve, mine.sys_*_at { }");
        assert_eq!(script.probes[0].points[0].components[1].name, "*execve");
        assert_eq!(script.probes[0].points[1].components[1].name, "sys_*_at");
    }

    #[test]
    fn percent_marks_a_wrapping_array() {
        let script = parse_ok("global a%, b%[10], c[5]%, d\nprobe begin { }");
        let wraps: Vec<(bool, Option<i64>)> = script
            .globals
            .iter()
            .map(|g| (g.wrap, g.array_size))
            .collect();
        assert_eq!(
            wraps,
            vec![
                (true, Some(0)),
                (true, Some(10)),
                (true, Some(5)),
                (false, None)
            ]
        );
    }

    #[test]
    fn address_of_a_member_parses() {
        assert!(matches!(body_expr("x = &$q->key"), ExprKind::Assign(..)));
        assert!(matches!(
            body_expr(r#"&@cast(p, "struct sembuf")->sem_num"#),
            ExprKind::AddressOf(_)
        ));
    }

    #[test]
    fn address_of_a_plain_variable_is_an_error() {
        let err = parse("probe begin { x = &y }", &Limits::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("a target variable or struct member after '&'"),
            "{err}"
        );
    }

    #[test]
    fn member_chain_takes_indexes_keywords_and_pretty_suffixes() {
        let ExprKind::Target(t) = body_expr("$tty->pgrp->numbers[0]->nr->function$$") else {
            panic!()
        };
        assert_eq!(t.path(), "$tty->pgrp->numbers[0]->nr->function$$");
    }

    #[test]
    fn target_member_index_must_be_a_constant() {
        let err = parse(r#"probe begin { x = $a->b[i] }"#, &Limits::default()).unwrap_err();
        assert!(
            err.to_string()
                .contains("a member index computed at run time on a target variable"),
            "{err}"
        );
    }

    #[test]
    fn cast_member_index_may_be_computed() {
        let ExprKind::Cast(c) = body_expr(r#"@cast(p, "struct s")->a[i + 1]->b[2]"#) else {
            panic!()
        };
        assert_eq!(c.members, ["a[?]", "b[2]"]);
        assert_eq!(c.indexes.len(), 1);
    }

    #[test]
    fn alternatives_in_braces_keep_their_own_flags() {
        let script = parse_ok(r#"probe kernel.{trace("a")!, trace("b")?} { }"#);
        let flags: Vec<(bool, bool)> = script.probes[0]
            .points
            .iter()
            .map(|p| (p.optional, p.sufficient))
            .collect();
        assert_eq!(flags, vec![(false, true), (true, false)]);
    }

    #[test]
    fn delete_takes_wildcard_keys() {
        let script = parse_ok("global a\nprobe begin { delete a[1, *] }");
        let StmtKind::Delete(e) = &script.probes[0].body.stmts[0].kind else {
            panic!()
        };
        let ExprKind::Index(ix) = &e.kind else {
            panic!()
        };
        assert!(matches!(ix.keys[1].kind, ExprKind::Wildcard));
    }

    #[test]
    fn wildcard_key_outside_delete_is_an_error() {
        let err = parse("global a\nprobe begin { x = a[1, *] }", &Limits::default()).unwrap_err();
        assert!(err.to_string().contains("expected an expression"), "{err}");
    }

    #[test]
    fn regex_match_binds_like_a_comparison() {
        let ExprKind::Binary(BinOp::Or, parts) = body_expr(r#"a !~ "x*" || b =~ "y""#) else {
            panic!()
        };
        assert!(matches!(parts.0.kind, ExprKind::RegexMatch(_, true)));
        assert!(matches!(parts.1.kind, ExprKind::RegexMatch(_, false)));
    }

    #[test]
    fn unknown_at_name_lists_the_operators_and_macros() {
        let err = parse("probe begin { @median(s) }", &Limits::default()).unwrap_err();
        assert_eq!(err.to_string(), "unknown macro or operator '@median'");
        assert!(err
            .hint()
            .is_some_and(|h| h.contains("defined with @define")));
    }

    #[test]
    fn hist_linear_takes_three_literals() {
        let e = body_expr("print(@hist_linear(s, 0, 100, -10))");
        let ExprKind::Call(call) = e else { panic!() };
        assert!(matches!(
            call.args[0].kind,
            ExprKind::Hist(
                HistKind::Linear {
                    start: 0,
                    stop: 100,
                    interval: -10
                },
                _
            )
        ));
    }
}
