//! The syntax tree of a probe script. Every node carries the [`Span`] of its source text so
//! that the checker and the runtime can point at it.

use std::fmt;

/// A byte range in the script's source text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Span {
    /// First byte.
    pub start: u32,
    /// One past the last byte.
    pub end: u32,
}

impl Span {
    /// A span from `start` to `end` (byte offsets).
    pub fn new(start: usize, end: usize) -> Self {
        let clamp = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        Span {
            start: clamp(start),
            end: clamp(end.max(start)),
        }
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }

    /// The byte range, for slicing the source.
    pub fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }
}

/// A name with its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ident {
    /// The name.
    pub name: String,
    /// Where it is written.
    pub span: Span,
}

/// A whole script: globals, functions and probes in source order.
#[derive(Debug, Clone, Default)]
pub struct Script {
    /// `global` declarations.
    pub globals: Vec<Global>,
    /// `function` definitions.
    pub functions: Vec<Function>,
    /// `probe` definitions, with probe aliases already expanded.
    pub probes: Vec<Probe>,
    /// `probe NAME = POINTS { prologue }` and `probe NAME += POINTS { epilogue }`
    /// definitions (kept for listings; [`Script::probes`] holds their expansions).
    pub aliases: Vec<ProbeAlias>,
    /// Parsed for guru mode (`-g`): target variables may be written.
    pub guru: bool,
}

/// A literal usable in declarations and probe point arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Literal {
    /// A 64-bit integer.
    Num(i64),
    /// A string.
    Str(String),
}

impl fmt::Display for Literal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Literal::Num(n) => write!(f, "{n}"),
            Literal::Str(s) => write!(f, "\"{}\"", s.escape_default()),
        }
    }
}

/// `global x`, `global x = 5`, `global a[100]`.
#[derive(Debug, Clone)]
pub struct Global {
    /// The variable.
    pub name: Ident,
    /// Initial value of a scalar.
    pub init: Option<(Literal, Span)>,
    /// `[N]`: declared as an array with at most N entries.
    pub array_size: Option<i64>,
    /// `global a%` or `global a%[N]`: a full array drops its oldest entry for a new one
    /// instead of failing.
    pub wrap: bool,
}

/// A declared type: `:long` or `:string`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeclType {
    /// 64-bit integer.
    Long,
    /// String.
    Str,
}

/// A function parameter.
#[derive(Debug, Clone)]
pub struct Param {
    /// Its name.
    pub name: Ident,
    /// Its declared type, if any.
    pub ty: Option<DeclType>,
}

/// The body of a function.
#[derive(Debug, Clone)]
pub enum FunctionBody {
    /// Script statements.
    Block(Block),
    /// `%{ ... %}` embedded C, which exotap never runs.
    Embedded(Span),
}

/// `function name:type (params) { body }`.
#[derive(Debug, Clone)]
pub struct Function {
    /// Its name.
    pub name: Ident,
    /// Declared return type.
    pub ret: Option<DeclType>,
    /// Parameters.
    pub params: Vec<Param>,
    /// Body.
    pub body: FunctionBody,
    /// The whole definition.
    pub span: Span,
}

/// One `name` or `name(args)` part of a probe point.
#[derive(Debug, Clone)]
pub struct Component {
    /// The component's name (`kernel`, `function`, `return`, `ms`, ...).
    pub name: String,
    /// Literal arguments in parentheses.
    pub args: Vec<Literal>,
    /// Where it is written.
    pub span: Span,
}

/// A probe point as written: `kernel.function("vfs_*").return?`.
#[derive(Debug, Clone)]
pub struct ProbePoint {
    /// Dotted components.
    pub components: Vec<Component>,
    /// `?`: dropped silently when it does not resolve.
    pub optional: bool,
    /// `!`: when it resolves, later points of the same probe are not tried.
    pub sufficient: bool,
    /// The whole point.
    pub span: Span,
}

impl fmt::Display for ProbePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in self.components.iter().enumerate() {
            if i > 0 {
                f.write_str(".")?;
            }
            f.write_str(&c.name)?;
            if !c.args.is_empty() {
                f.write_str("(")?;
                for (j, a) in c.args.iter().enumerate() {
                    if j > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{a}")?;
                }
                f.write_str(")")?;
            }
        }
        if self.optional {
            f.write_str("?")?;
        }
        if self.sufficient {
            f.write_str("!")?;
        }
        Ok(())
    }
}

/// `probe P1, P2 if (cond) { body }`.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The probe points, in order.
    pub points: Vec<ProbePoint>,
    /// `if (cond)`: the body runs only when it is true.
    pub condition: Option<Expr>,
    /// The handler.
    pub body: Block,
    /// The whole definition.
    pub span: Span,
}

/// A probe alias: `probe NAME = POINTS { prologue }` (SystemTap's tapset style) or
/// `probe NAME += POINTS { epilogue }`. A probe on NAME becomes a probe on POINTS whose body
/// is the prologue then its own body (or its own body then the epilogue).
#[derive(Debug, Clone)]
pub struct ProbeAlias {
    /// The names it defines (usually one).
    pub names: Vec<ProbePoint>,
    /// What a use of a name stands for.
    pub points: Vec<ProbePoint>,
    /// `+=`: the body runs after the user's body rather than before.
    pub epilogue: bool,
    /// The alias's own statements.
    pub body: Block,
    /// The whole definition.
    pub span: Span,
    /// From the tapset library: prologue assignments to locals the probe never uses are
    /// dropped at expansion, as SystemTap elides them.
    pub library: bool,
}

/// `{ statements }`.
#[derive(Debug, Clone, Default)]
pub struct Block {
    /// The statements.
    pub stmts: Vec<Stmt>,
    /// Braces included.
    pub span: Span,
}

/// A statement with its span.
#[derive(Debug, Clone)]
pub struct Stmt {
    /// What it is.
    pub kind: StmtKind,
    /// Where.
    pub span: Span,
}

/// The statements of the language.
#[derive(Debug, Clone)]
pub enum StmtKind {
    /// `;`.
    Empty,
    /// `{ ... }`.
    Block(Block),
    /// An expression evaluated for its effect.
    Expr(Expr),
    /// `if (c) s else s`.
    If(Box<IfStmt>),
    /// `while (c) s`.
    While(Box<(Expr, Stmt)>),
    /// `for (init; cond; step) s`.
    For(Box<ForStmt>),
    /// `foreach (...)`.
    Foreach(Box<Foreach>),
    /// `next`: leave the probe handler.
    Next,
    /// `break`.
    Break,
    /// `continue`.
    Continue,
    /// `return` or `return e`.
    Return(Option<Expr>),
    /// `delete a[k]`, `delete a`, `delete x`.
    Delete(Expr),
    /// `try { } catch (msg) { }`.
    Try(Box<TryStmt>),
}

/// `if` with optional `else`.
#[derive(Debug, Clone)]
pub struct IfStmt {
    /// Condition.
    pub cond: Expr,
    /// Taken when true.
    pub then: Stmt,
    /// Taken when false.
    pub els: Option<Stmt>,
}

/// `for (init; cond; step) body`.
#[derive(Debug, Clone)]
pub struct ForStmt {
    /// Run once first.
    pub init: Option<Expr>,
    /// Loop while true (absent: forever).
    pub cond: Option<Expr>,
    /// Run after each iteration.
    pub step: Option<Expr>,
    /// The loop body.
    pub body: Stmt,
}

/// `try { body } catch (var) { handler }`.
#[derive(Debug, Clone)]
pub struct TryStmt {
    /// Guarded statements.
    pub body: Block,
    /// Receives the error message.
    pub var: Option<Ident>,
    /// Runs on error.
    pub handler: Block,
}

/// What a `foreach` sorts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    /// The value (`a+`), or a statistic of it for aggregate arrays.
    Value,
    /// The n-th key (`[k+]`).
    Key(usize),
}

/// A `foreach` sort order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sort {
    /// What is compared.
    pub key: SortKey,
    /// `-` suffix.
    pub descending: bool,
    /// For aggregate arrays: the statistic compared (`a @sum -`); `@count` when absent.
    pub stat: Option<StatOp>,
}

/// `foreach (v = [k1, k2] in array- limit n) body`.
#[derive(Debug, Clone)]
pub struct Foreach {
    /// `v =`: receives the value.
    pub value: Option<Ident>,
    /// Key variables.
    pub keys: Vec<Ident>,
    /// The iterated array.
    pub array: Ident,
    /// `in a[k, *]`: only the entries whose keys equal these, `*` ([`ExprKind::Wildcard`])
    /// matching any key.
    pub slice: Option<Vec<Expr>>,
    /// Sort order.
    pub sort: Option<Sort>,
    /// `limit n`.
    pub limit: Option<Expr>,
    /// The loop body.
    pub body: Stmt,
}

/// Statistics extracted from an aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatOp {
    /// Number of values.
    Count,
    /// Sum.
    Sum,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Integer average.
    Avg,
}

impl StatOp {
    /// Parses `count`, `sum`, ... (without the `@`).
    pub fn from_name(name: &str) -> Option<StatOp> {
        Some(match name {
            "count" => StatOp::Count,
            "sum" => StatOp::Sum,
            "min" => StatOp::Min,
            "max" => StatOp::Max,
            "avg" => StatOp::Avg,
            _ => return None,
        })
    }

    /// The name with its `@`.
    pub fn name(self) -> &'static str {
        match self {
            StatOp::Count => "@count",
            StatOp::Sum => "@sum",
            StatOp::Min => "@min",
            StatOp::Max => "@max",
            StatOp::Avg => "@avg",
        }
    }
}

/// Histogram layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HistKind {
    /// Power-of-two buckets.
    Log,
    /// `@hist_linear(x, start, stop, interval)`.
    Linear {
        /// Lowest bucket start.
        start: i64,
        /// Upper bound.
        stop: i64,
        /// Bucket width.
        interval: i64,
    },
}

/// Binary operators with plain operands (long or string comparisons, `.`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    /// `+`
    Add,
    /// `-`
    Sub,
    /// `*`
    Mul,
    /// `/`
    Div,
    /// `%`
    Mod,
    /// `<<`
    Shl,
    /// `>>`
    Shr,
    /// `&`
    BitAnd,
    /// `|`
    BitOr,
    /// `^`
    BitXor,
    /// `&&`
    And,
    /// `||`
    Or,
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
    /// `.` string concatenation
    Concat,
}

impl BinOp {
    /// The operator as written.
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Mod => "%",
            BinOp::Shl => "<<",
            BinOp::Shr => ">>",
            BinOp::BitAnd => "&",
            BinOp::BitOr => "|",
            BinOp::BitXor => "^",
            BinOp::And => "&&",
            BinOp::Or => "||",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Concat => ".",
        }
    }

    /// Comparisons work on two longs or two strings.
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge
        )
    }
}

/// Unary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnOp {
    /// `-`
    Neg,
    /// `+`
    Plus,
    /// `!`
    Not,
    /// `~`
    BitNot,
}

/// An expression with its span.
#[derive(Debug, Clone)]
pub struct Expr {
    /// What it is.
    pub kind: ExprKind,
    /// Where.
    pub span: Span,
}

impl Expr {
    /// `@defined(x)` or `!@defined(x)` as an `if`'s condition: the `@defined` expression,
    /// and whether the test is negated. SystemTap decides such a branch at elaboration, so
    /// the branch it drops is never resolved (`if (!@defined($t->m)) ... $var_elsewhere`).
    pub fn defined_test(&self) -> Option<(&Expr, bool)> {
        match &self.kind {
            ExprKind::Defined(_) => Some((self, false)),
            ExprKind::Unary(UnOp::Not, inner) if matches!(inner.kind, ExprKind::Defined(_)) => {
                Some((inner, true))
            }
            _ => None,
        }
    }
}

/// A target variable: `$name`, `$name->a->b`, `$return`, `$$parms`; a kernel global
/// `@var("name")` or `@var("name@file.c")` keeps its `@var(...)` text as its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetVar {
    /// Name with its `$` or `$$` (or `@var("name@file")`).
    pub name: String,
    /// `->member` chain.
    pub members: Vec<String>,
}

impl TargetVar {
    /// The full path, used as the key of a captured value (`$file->f_pos`).
    pub fn path(&self) -> String {
        let mut s = self.name.clone();
        for m in &self.members {
            s.push_str("->");
            s.push_str(m);
        }
        s
    }
}

/// The expressions of the language.
#[derive(Debug, Clone)]
pub enum ExprKind {
    /// Integer literal.
    Num(i64),
    /// String literal.
    Str(String),
    /// A variable: local or global scalar (or a whole array where one is expected).
    Var(String),
    /// A target variable of the probed kernel context.
    Target(TargetVar),
    /// `a[k1, k2]`.
    Index(Box<IndexExpr>),
    /// Unary operator.
    Unary(UnOp, Box<Expr>),
    /// Binary operator.
    Binary(BinOp, Box<(Expr, Expr)>),
    /// `c ? a : b`.
    Ternary(Box<(Expr, Expr, Expr)>),
    /// `x = e`, `x += e` (op is None for `=`).
    Assign(Option<BinOp>, Box<(Expr, Expr)>),
    /// `++x`, `x--`, ...
    IncDec(Box<IncDec>),
    /// `s <<< v`.
    Aggregate(Box<(Expr, Expr)>),
    /// `@count(s)`.
    Stat(StatOp, Box<Expr>),
    /// `@hist_log(s)`, `@hist_linear(s, a, b, c)`.
    Hist(HistKind, Box<Expr>),
    /// `f(args)`.
    Call(Box<Call>),
    /// `[k1, k2] in a`.
    In(Box<InExpr>),
    /// `@entry(e)` in a `.return` probe: `e` as it was at the function's entry.
    Entry(Box<Expr>),
    /// `@defined(e)`: 1 when the target variables (or `@cast` members) of `e` resolve at the
    /// probe point, else 0; `e` is not evaluated. `@choose_defined(a, b)` is
    /// `@defined(a) ? a : b`.
    Defined(Box<Expr>),
    /// `@cast(p, "type"[, "module"])->member...`: guest memory at `p` read as a kernel type.
    Cast(Box<CastExpr>),
    /// `@variance(s[, shift])`: the variance of an aggregate, with `shift` bits of fixed-point
    /// precision inside (SystemTap's Welford integer algorithm).
    Variance(Box<Expr>, u32),
    /// `%{ ... %}` used as a value: embedded C, which exotap parses but never runs.
    Embedded(String),
    /// `&$var`, `&$p->member` or `&@cast(...)->member`: the address of a kernel variable or
    /// of a struct member.
    AddressOf(Box<Expr>),
    /// `s =~ "regex"` (or `!~` when the flag is set): POSIX extended regular expression match.
    RegexMatch(Box<(Expr, Expr)>, bool),
    /// `*` as a key of `delete a[k, *]`: every value of that key.
    Wildcard,
}

/// `@cast(pointer, "type", "module")->a->b`.
#[derive(Debug, Clone)]
pub struct CastExpr {
    /// The address.
    pub pointer: Expr,
    /// The type name (`struct task_struct`, `task_struct`, `uintptr_t`).
    pub type_name: String,
    /// Where the type is looked up (`kernel`, `kernel<linux/sched.h>`), when given.
    pub module: Option<String>,
    /// `->member` chain. A member index computed at run time (`->fd[i]`, `@cast(p, "T")[j]`)
    /// is written `[?]` in its member's text, and its expression is in
    /// [`CastExpr::indexes`].
    pub members: Vec<String>,
    /// The computed member indexes, in the order of the `[?]` in `members`.
    pub indexes: Vec<Expr>,
    /// SystemTap's autocast, `p->m` on a local `p`: the type is that of the target variable
    /// named here (with its `$`) at each point, the one the probe copied `p` from (`p =
    /// $fhp`). The parser leaves it empty and [`crate::check`] names the variable; `None`
    /// for an `@cast`.
    pub like: Option<String>,
}

impl CastExpr {
    /// Whether the type is the kernel's own: no module, `kernel`, or `kernel<linux/x.h>`
    /// (SystemTap's way of naming a header that declares a kernel type).
    pub fn of_kernel(&self) -> bool {
        self.module
            .as_deref()
            .is_none_or(|m| m == "kernel" || (m.starts_with("kernel<") && m.ends_with('>')))
    }
}

/// `array[keys]`.
#[derive(Debug, Clone)]
pub struct IndexExpr {
    /// The array.
    pub array: Ident,
    /// The keys.
    pub keys: Vec<Expr>,
}

/// Increment or decrement.
#[derive(Debug, Clone)]
pub struct IncDec {
    /// `++x` rather than `x++`.
    pub prefix: bool,
    /// `++` rather than `--`.
    pub increment: bool,
    /// The variable or element.
    pub target: Expr,
}

/// A function call.
#[derive(Debug, Clone)]
pub struct Call {
    /// Called function.
    pub name: Ident,
    /// Arguments.
    pub args: Vec<Expr>,
}

/// Membership test.
#[derive(Debug, Clone)]
pub struct InExpr {
    /// Keys tested.
    pub keys: Vec<Expr>,
    /// The array.
    pub array: Ident,
}
