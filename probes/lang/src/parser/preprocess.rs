//! The preprocessor, a pass over the tokens before the grammar sees them (as SystemTap's is):
//!
//! - `%( CONDITION %? THEN %: ELSE %)` keeps the tokens of one branch ([`condition`]);
//!   conditionals nest, and an untaken branch is skipped unexpanded;
//! - `@define NAME(a, b) %( BODY %)` defines a macro; `@NAME(x, y)` expands to BODY with
//!   `@a`, `@b` replaced by the tokens of the arguments (expanded themselves first);
//! - script arguments: `$1` becomes the tokens of the first argument's text (a number, a name,
//!   a whole probe point), `@1` a string literal of it; `$#` and `@#` their count (a number, a
//!   string). An index beyond the arguments is an error only where the tokens are kept.
//!
//! Expanded tokens keep spans inside the script: an argument's tokens take the span of the
//! `$N` they replace, a macro body's tokens the span they have in the `@define`.
//!
//! The tapset library's macros (SystemTap's `.stpm` files; ours are `probes/lang/tapset/*.stpm`)
//! are known in every script: a script's own `@define` of the same name hides one. Their
//! tokens take the span of the `@NAME` that uses them, since their own spans are in another
//! file.

use std::collections::HashMap;
use std::sync::OnceLock;

use super::super::ast::Span;
use super::super::invocation::Invocation;
use super::super::lexer::{tokenize, Tok, Token};
use super::condition;
use super::ParseError;

type PResult<T> = Result<T, ParseError>;

/// A macro from `@define`.
#[derive(Debug, Clone)]
struct Macro {
    /// Parameter names (without `@`); `None` for `@define NAME %( ... %)`, used without
    /// parentheses.
    params: Option<Vec<String>>,
    /// The tokens between `%(` and `%)`.
    body: Vec<Token>,
    /// From the tapset library: its spans are not the script's.
    library: bool,
}

/// The tapset library's macro files (`.stpm`): name and text.
pub(crate) const MACRO_FILES: &[(&str, &str)] =
    &[("macros.stpm", include_str!("../../tapset/macros.stpm"))];

/// The library's macros, read once; an error names the file (a bug in exotap).
fn library_macros() -> Result<&'static HashMap<String, Macro>, ParseError> {
    static MACROS: OnceLock<Result<HashMap<String, Macro>, String>> = OnceLock::new();
    let loaded = MACROS.get_or_init(|| {
        let empty = HashMap::new();
        let inv = Invocation::default();
        let mut pre = Preprocessor {
            inv: &inv,
            macros: HashMap::new(),
            library: &empty,
            depth: 0,
            max_depth: 100,
            max_tokens: usize::MAX,
        };
        for (file, text) in MACRO_FILES {
            let tokens = tokenize(text).map_err(|e| format!("{file}: {e}"))?;
            let mut out = Vec::new();
            pre.expand(&tokens, &HashMap::new(), &mut out)
                .map_err(|e| format!("{file}: {e}"))?;
            if let Some(t) = out.iter().find(|t| t.tok != Tok::Eof) {
                return Err(format!("{file}: {} outside a macro", t.tok.describe()));
            }
        }
        Ok(pre
            .macros
            .into_iter()
            .map(|(name, mut m)| {
                m.library = true;
                (name, m)
            })
            .collect())
    });
    loaded.as_ref().map_err(|message| ParseError::Tapset {
        message: format!("the tapset macros do not parse: {message}"),
    })
}

/// Runs the preprocessor over `tokens` (ending with [`Tok::Eof`]); macro expansions nest at
/// most `max_depth` deep.
///
/// # Errors
/// The first malformed conditional or macro, unknown condition, or out-of-range argument.
pub(super) fn preprocess(
    tokens: &[Token],
    inv: &Invocation,
    max_depth: usize,
    max_tokens: usize,
) -> PResult<Vec<Token>> {
    let mut pre = Preprocessor {
        inv,
        macros: HashMap::new(),
        library: library_macros()?,
        depth: 0,
        max_depth,
        max_tokens,
    };
    let mut out = Vec::with_capacity(tokens.len());
    pre.expand(tokens, &HashMap::new(), &mut out)?;
    Ok(join_adjacent_strings(out))
}

/// `"a" "b"` is `"ab"`, as in C and SystemTap (`@1 "@*:*"` builds one probe point argument).
fn join_adjacent_strings(tokens: Vec<Token>) -> Vec<Token> {
    let mut out: Vec<Token> = Vec::with_capacity(tokens.len());
    for t in tokens {
        if let (
            Some(Token {
                tok: Tok::Str(a),
                span,
            }),
            Tok::Str(b),
        ) = (out.last_mut(), &t.tok)
        {
            a.push_str(b);
            *span = span.to(t.span);
            continue;
        }
        out.push(t);
    }
    out
}

struct Preprocessor<'a> {
    inv: &'a Invocation,
    macros: HashMap<String, Macro>,
    /// The tapset library's macros, below the script's own.
    library: &'a HashMap<String, Macro>,
    depth: usize,
    max_depth: usize,
    /// Macros that use each other twice per level grow exponentially: the expansion is cut
    /// at this many tokens.
    max_tokens: usize,
}

fn is_op(t: &Token, op: &str) -> bool {
    matches!(&t.tok, Tok::Op(o) if *o == op)
}

/// `$N`, `@N`, `$#`, `@#`: the argument index (0 for the count).
fn argument_ref(name: &str) -> Option<(bool, Option<usize>)> {
    let (string, rest) = match name.as_bytes().first() {
        Some(b'$') => (false, &name[1..]),
        Some(b'@') => (true, &name[1..]),
        _ => return None,
    };
    if rest == "#" {
        return Some((string, None));
    }
    if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) {
        return Some((string, Some(rest.parse().unwrap_or(usize::MAX))));
    }
    None
}

impl Preprocessor<'_> {
    /// Expands `toks` into `out`. Nested conditionals, macro bodies and macro arguments
    /// each recurse here, at most `max_depth` deep.
    fn expand(
        &mut self,
        toks: &[Token],
        params: &HashMap<String, Vec<Token>>,
        out: &mut Vec<Token>,
    ) -> PResult<()> {
        self.depth += 1;
        let result = if self.depth > self.max_depth {
            Err(ParseError::TooDeep {
                limit: self.max_depth,
                span: toks.first().map(|t| t.span).unwrap_or_default(),
            })
        } else {
            self.expand_tokens(toks, params, out)
        };
        self.depth -= 1;
        result
    }

    fn expand_tokens(
        &mut self,
        toks: &[Token],
        params: &HashMap<String, Vec<Token>>,
        out: &mut Vec<Token>,
    ) -> PResult<()> {
        let mut i = 0;
        while i < toks.len() {
            let t = &toks[i];
            if out.len() > self.max_tokens {
                return Self::macro_error(
                    format!("macro expansion makes more than {} tokens", self.max_tokens),
                    t.span,
                );
            }
            match &t.tok {
                Tok::Op("%(") => i = self.conditional(toks, i, params, out)?,
                Tok::Op(op @ ("%?" | "%:" | "%)")) => {
                    return Err(ParseError::Conditional {
                        message: format!("'{op}' outside a preprocessor conditional"),
                        span: t.span,
                    })
                }
                Tok::At(name) if name == "@define" => i = self.define(toks, i)?,
                Tok::At(name) if params.contains_key(&name[1..]) => {
                    out.extend(params[&name[1..]].iter().cloned());
                    i += 1;
                }
                Tok::At(name)
                    if self.macros.contains_key(&name[1..])
                        || self.library.contains_key(&name[1..]) =>
                {
                    i = self.invoke(toks, i, params, out)?;
                }
                Tok::At(name) | Tok::Target(name) if argument_ref(name).is_some() => {
                    self.argument(t, out)?;
                    i += 1;
                }
                _ => {
                    out.push(t.clone());
                    i += 1;
                }
            }
        }
        Ok(())
    }

    /// Replaces `$N`/`@N`/`$#`/`@#`.
    fn argument(&self, t: &Token, out: &mut Vec<Token>) -> PResult<()> {
        let (Tok::At(name) | Tok::Target(name)) = &t.tok else {
            return Ok(());
        };
        let Some((string, index)) = argument_ref(name) else {
            return Ok(());
        };
        let args = &self.inv.args;
        let tok = |tok| Token { tok, span: t.span };
        let Some(index) = index else {
            let n = args.len();
            out.push(tok(if string {
                Tok::Str(n.to_string())
            } else {
                Tok::Num(i64::try_from(n).unwrap_or(i64::MAX))
            }));
            return Ok(());
        };
        let Some(text) = index.checked_sub(1).and_then(|k| args.get(k)) else {
            return Err(ParseError::ArgumentOutOfRange {
                index,
                count: args.len(),
                span: t.span,
            });
        };
        if string {
            out.push(tok(Tok::Str(text.clone())));
            return Ok(());
        }
        let toks = tokenize(text).map_err(|e| ParseError::BadArgument {
            index,
            reason: e.to_string(),
            span: t.span,
        })?;
        if toks.len() == 1 {
            return Err(ParseError::BadArgument {
                index,
                reason: "it is empty".into(),
                span: t.span,
            });
        }
        out.extend(
            toks.into_iter()
                .filter(|x| x.tok != Tok::Eof)
                .map(|x| tok(x.tok)),
        );
        Ok(())
    }

    /// Finds the `%)` closing the `%(` at `open`, with the first `%?` and `%:` at its level.
    fn structure(toks: &[Token], open: usize) -> PResult<(Option<usize>, Option<usize>, usize)> {
        let mut depth = 0usize;
        let (mut question, mut colon) = (None, None);
        for (k, t) in toks.iter().enumerate().skip(open + 1) {
            match &t.tok {
                Tok::Op("%(") => depth += 1,
                Tok::Op("%)") if depth == 0 => return Ok((question, colon, k)),
                Tok::Op("%)") => depth -= 1,
                Tok::Op("%?") if depth == 0 && question.is_none() => question = Some(k),
                Tok::Op("%:") if depth == 0 && question.is_some() && colon.is_none() => {
                    colon = Some(k);
                }
                _ => {}
            }
        }
        Err(ParseError::UnterminatedConditional {
            span: toks[open].span,
        })
    }

    fn conditional(
        &mut self,
        toks: &[Token],
        open: usize,
        params: &HashMap<String, Vec<Token>>,
        out: &mut Vec<Token>,
    ) -> PResult<usize> {
        let at = toks[open].span;
        let (question, colon, close) = Self::structure(toks, open)?;
        let Some(question) = question else {
            return Err(ParseError::Conditional {
                message: "expected '%?' after the condition of '%('".into(),
                span: at,
            });
        };
        let mut cond = Vec::new();
        self.expand(&toks[open + 1..question], params, &mut cond)?;
        let taken = condition::evaluate(&cond, self.inv, at)?;
        let branch = match (taken, colon) {
            (true, Some(c)) => &toks[question + 1..c],
            (true, None) => &toks[question + 1..close],
            (false, Some(c)) => &toks[c + 1..close],
            (false, None) => &[],
        };
        self.expand(branch, params, out)?;
        Ok(close + 1)
    }

    fn macro_error<T>(message: impl Into<String>, span: Span) -> PResult<T> {
        Err(ParseError::Macro {
            message: message.into(),
            span,
        })
    }

    /// `@define NAME[(a, b)] %( BODY %)` at `at`; returns the index after it.
    fn define(&mut self, toks: &[Token], at: usize) -> PResult<usize> {
        let start = toks[at].span;
        let mut i = at + 1;
        let name = match toks.get(i) {
            Some(Token {
                tok: Tok::Ident(n), ..
            }) => n.clone(),
            Some(t) => {
                return Self::macro_error(
                    format!(
                        "expected a macro name after '@define', found {}",
                        t.tok.describe()
                    ),
                    t.span,
                )
            }
            None => return Self::macro_error("expected a macro name after '@define'", start),
        };
        let name_span = toks[i].span;
        i += 1;
        let mut params = None;
        if toks.get(i).is_some_and(|t| is_op(t, "(")) {
            let mut names = Vec::new();
            i += 1;
            loop {
                match toks.get(i) {
                    Some(t) if is_op(t, ")") && names.is_empty() => break,
                    Some(Token {
                        tok: Tok::Ident(p),
                        span,
                    }) => {
                        if names.contains(p) {
                            return Self::macro_error(
                                format!("macro parameter '{p}' is declared twice"),
                                *span,
                            );
                        }
                        names.push(p.clone());
                        i += 1;
                    }
                    Some(t) => {
                        return Self::macro_error(
                            format!(
                                "expected a macro parameter name, found {}",
                                t.tok.describe()
                            ),
                            t.span,
                        )
                    }
                    None => return Self::macro_error("unterminated macro parameter list", start),
                }
                match toks.get(i) {
                    Some(t) if is_op(t, ",") => i += 1,
                    Some(t) if is_op(t, ")") => break,
                    Some(t) => {
                        return Self::macro_error(
                            format!("expected ',' or ')', found {}", t.tok.describe()),
                            t.span,
                        )
                    }
                    None => return Self::macro_error("unterminated macro parameter list", start),
                }
            }
            i += 1;
            params = Some(names);
        }
        match toks.get(i) {
            Some(t) if is_op(t, "%(") => {}
            Some(t) => {
                return Self::macro_error(
                    format!(
                        "expected '%(' to open the body of macro '@{name}', found {}",
                        t.tok.describe()
                    ),
                    t.span,
                )
            }
            None => return Self::macro_error("expected the macro body", start),
        }
        let (_, _, close) = Self::structure(toks, i)?;
        let body = toks[i + 1..close].to_vec();
        if self.macros.contains_key(&name) {
            return Self::macro_error(format!("macro '@{name}' is defined twice"), name_span);
        }
        self.macros.insert(
            name,
            Macro {
                params,
                body,
                library: false,
            },
        );
        Ok(close + 1)
    }

    /// `@NAME` or `@NAME(args)` at `at`; returns the index after it.
    fn invoke(
        &mut self,
        toks: &[Token],
        at: usize,
        params: &HashMap<String, Vec<Token>>,
        out: &mut Vec<Token>,
    ) -> PResult<usize> {
        let t = &toks[at];
        let Tok::At(name) = &t.tok else {
            return Ok(at + 1);
        };
        let name = name[1..].to_string();
        let Some(mut m) = self.macros.get(&name).or(self.library.get(&name)).cloned() else {
            return Ok(at + 1);
        };
        if m.library {
            for b in &mut m.body {
                b.span = t.span;
            }
        }
        let mut next = at + 1;
        let mut bound = HashMap::new();
        if let Some(names) = &m.params {
            if !toks.get(next).is_some_and(|x| is_op(x, "(")) {
                return Self::macro_error(
                    format!(
                        "macro '@{name}' takes {} argument(s) in parentheses",
                        names.len()
                    ),
                    t.span,
                );
            }
            let (args, after) = Self::arguments(toks, next)?;
            next = after;
            if args.len() != names.len() {
                return Self::macro_error(
                    format!(
                        "macro '@{name}' takes {} argument(s), {} given",
                        names.len(),
                        args.len()
                    ),
                    t.span,
                );
            }
            for (p, arg) in names.iter().zip(args) {
                let mut expanded = Vec::new();
                self.expand(arg, params, &mut expanded)?;
                bound.insert(p.clone(), expanded);
            }
        }
        self.expand(&m.body, &bound, out)?;
        Ok(next)
    }

    /// The comma-separated token lists of `( ... )` starting at `open`, and the index after
    /// the `)`.
    fn arguments(toks: &[Token], open: usize) -> PResult<(Vec<&[Token]>, usize)> {
        let mut depth = 0usize;
        let mut args = Vec::new();
        let mut start = open + 1;
        for (k, t) in toks.iter().enumerate().skip(open + 1) {
            match &t.tok {
                Tok::Op("(" | "[" | "{" | "%(") => depth += 1,
                Tok::Op(")") if depth == 0 => {
                    if k > start || !args.is_empty() {
                        args.push(&toks[start..k]);
                    }
                    return Ok((args, k + 1));
                }
                Tok::Op(")" | "]" | "}" | "%)") => depth = depth.saturating_sub(1),
                Tok::Op(",") if depth == 0 => {
                    args.push(&toks[start..k]);
                    start = k + 1;
                }
                Tok::Eof => break,
                _ => {}
            }
        }
        Self::macro_error("unterminated macro argument list", toks[open].span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(src: &str, args: &[&str]) -> PResult<Vec<Tok>> {
        let toks = tokenize(src)?;
        let inv = Invocation::with_args(args.iter().copied());
        Ok(preprocess(&toks, &inv, 100, 10_000)?
            .into_iter()
            .map(|t| t.tok)
            .filter(|t| *t != Tok::Eof)
            .collect())
    }

    fn texts(src: &str) -> Vec<Tok> {
        run(src, &[]).unwrap()
    }

    #[test]
    fn library_macros_load_and_take_the_span_of_their_use() {
        let src = "x = @this2";
        let toks =
            preprocess(&tokenize(src).unwrap(), &Invocation::default(), 100, 10_000).unwrap();
        let use_span = Span::new(4, 10);
        let body: Vec<&Token> = toks.iter().skip(2).filter(|t| t.tok != Tok::Eof).collect();
        assert_eq!(body[0].tok, Tok::Ident("__this_var2".into()));
        assert!(body.iter().all(|t| t.span == use_span));
    }

    #[test]
    fn script_macro_hides_a_library_macro() {
        assert_eq!(texts("@define this1 %( 7 %) @this1"), [Tok::Num(7)]);
    }

    #[test]
    fn dollar_argument_expands_to_its_tokens() {
        assert_eq!(run("x = $1", &["a.b(3)"]).unwrap(), texts("x = a.b(3)"));
    }

    #[test]
    fn at_argument_is_a_string_literal() {
        assert_eq!(run("@1", &["a b"]).unwrap(), vec![Tok::Str("a b".into())]);
    }

    #[test]
    fn argument_count_is_a_number_or_a_string() {
        assert_eq!(
            run("$# @#", &["x", "y"]).unwrap(),
            vec![Tok::Num(2), Tok::Str("2".into())]
        );
    }

    #[test]
    fn adjacent_strings_are_one_literal() {
        assert_eq!(
            run("f(@1 \"@*:*\")", &["vfs_read"]).unwrap(),
            texts("f(\"vfs_read@*:*\")")
        );
    }

    #[test]
    fn missing_argument_is_out_of_range() {
        let err = run("x = $2", &["1"]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "command line argument index 2 out of range [1-1]"
        );
    }

    #[test]
    fn missing_argument_in_an_untaken_branch_is_fine() {
        assert_eq!(
            run("%( $# >= 2 %? @2 %: \"none\" %)", &["1"]).unwrap(),
            vec![Tok::Str("none".into())]
        );
    }

    #[test]
    fn conditional_keeps_the_taken_branch() {
        assert_eq!(texts("%( 1 == 1 %? a %: b %)"), texts("a"));
        assert_eq!(texts("%( 1 == 2 %? a %: b %)"), texts("b"));
        assert_eq!(texts("%( 1 == 2 %? a %) c"), texts("c"));
    }

    #[test]
    fn conditionals_nest() {
        assert_eq!(
            texts("%( 1 == 1 %? %( 2 == 3 %? a %: b %) %: c %)"),
            texts("b")
        );
    }

    #[test]
    fn unterminated_conditional_is_an_error() {
        assert!(matches!(
            run("%( 1 == 1 %? a", &[]),
            Err(ParseError::UnterminatedConditional { .. })
        ));
    }

    #[test]
    fn conditional_without_question_mark_is_an_error() {
        let err = run("%( 1 == 1 a %)", &[]).unwrap_err();
        assert!(err.to_string().contains("expected '%?'"), "{err}");
    }

    #[test]
    fn stray_else_marker_is_an_error() {
        let err = run("a %: b", &[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("outside a preprocessor conditional"),
            "{err}"
        );
    }

    #[test]
    fn macro_with_parameters_substitutes_its_arguments() {
        assert_eq!(
            texts("@define add(a, b) %( (@a + @b) %) x = @add(1, f(2, 3))"),
            texts("x = (1 + f(2, 3))")
        );
    }

    #[test]
    fn macro_without_parameters_expands_bare() {
        assert_eq!(texts("@define N %( 42 %) x = @N"), texts("x = 42"));
    }

    #[test]
    fn macros_expand_inside_macros_and_conditions() {
        assert_eq!(
            texts("@define one %( 1 %) @define two %( @one + @one %) %( @one == 1 %? @two %)"),
            texts("1 + 1")
        );
    }

    #[test]
    fn macro_arity_mismatch_is_an_error() {
        let err = run("@define f(a) %( @a %) @f(1, 2)", &[]).unwrap_err();
        assert!(
            err.to_string().contains("takes 1 argument(s), 2 given"),
            "{err}"
        );
    }

    #[test]
    fn recursive_macro_hits_the_depth_limit() {
        assert!(matches!(
            run("@define r %( @r %) @r", &[]),
            Err(ParseError::TooDeep { .. })
        ));
    }

    #[test]
    fn exponential_macro_expansion_is_cut() {
        let mut src = String::from("@define m0 %( x %) ");
        for k in 1..40 {
            src.push_str(&format!("@define m{k} %( @m{} @m{} %) ", k - 1, k - 1));
        }
        src.push_str("@m39");
        let err = run(&src, &[]).unwrap_err();
        assert!(err.to_string().contains("more than 10000 tokens"), "{err}");
    }

    #[test]
    fn nested_macro_arguments_cannot_grow_without_bound() {
        let src = format!(
            "@define d(x) %( @x @x %) {}a{}",
            "@d(".repeat(40),
            ")".repeat(40)
        );
        let err = run(&src, &[]).unwrap_err();
        assert!(err.to_string().contains("more than 10000 tokens"), "{err}");
    }

    #[test]
    fn deeply_nested_conditionals_hit_the_depth_limit() {
        let src = format!("{}x{}", "%( 1 == 1 %? ".repeat(5000), " %)".repeat(5000));
        assert!(matches!(run(&src, &[]), Err(ParseError::TooDeep { .. })));
    }

    #[test]
    fn macro_defined_twice_is_an_error() {
        let err = run("@define a %( 1 %) @define a %( 2 %)", &[]).unwrap_err();
        assert!(err.to_string().contains("defined twice"), "{err}");
    }
}
