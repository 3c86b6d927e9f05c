//! The conditions of `%( CONDITION %? ... %)`, evaluated as SystemTap's preprocessor does:
//! comparisons `LEFT OP RIGHT` joined by `&&` (binding tighter) and `||`, where LEFT is one of
//! `kernel_v`, `kernel_vr`, `systemtap_v` (version comparisons, or wildcards with `==`/`!=`),
//! `arch`, `runtime`, `systemtap_privilege` (wildcards with `==`/`!=`), `guru_mode` (a
//! number), `CONFIG_X` (the kernel configuration: a string, a number or another `CONFIG_Y`),
//! or a string or number literal compared with one of its kind. Script arguments (`$#`, `$1`)
//! are already replaced by literals when the condition is evaluated.

use std::cmp::Ordering;

use super::super::ast::Span;
use super::super::facts::compare_versions;
use super::super::invocation::{Invocation, SYSTEMTAP_VERSION};
use super::super::lexer::{Tok, Token};
use super::ParseError;

/// What the runtime is, as `runtime == "kernel"` asks: exotap follows SystemTap's kernel
/// runtime (the language and tapset semantics of a kernel module).
const RUNTIME: &str = "kernel";

const KNOWN: &str = "expected 'kernel_v', 'kernel_vr', 'systemtap_v', 'arch', 'runtime', \
                     'systemtap_privilege', 'guru_mode', 'CONFIG_...', or a comparison of two \
                     strings or two numbers";

/// Evaluates the condition `toks` (the tokens between `%(` and `%?`, expanded); `at` is the
/// `%(` for messages about an empty condition.
pub(super) fn evaluate(toks: &[Token], inv: &Invocation, at: Span) -> Result<bool, ParseError> {
    if toks.is_empty() {
        return Err(error("empty preprocessor condition", at));
    }
    let mut c = Cond { toks, pos: 0, inv };
    let mut result = false;
    loop {
        let mut all = true;
        loop {
            all &= c.comparison()?;
            if !c.eat("&&") {
                break;
            }
        }
        result |= all;
        if !c.eat("||") {
            break;
        }
    }
    match c.toks.get(c.pos) {
        None => Ok(result),
        Some(t) => Err(error(
            format!(
                "expected '&&', '||' or '%?' in a preprocessor condition, found {}",
                t.tok.describe()
            ),
            t.span,
        )),
    }
}

fn error(message: impl Into<String>, span: Span) -> ParseError {
    ParseError::Conditional {
        message: message.into(),
        span,
    }
}

/// One side of a comparison.
enum Operand {
    /// A number literal (or `$#`).
    Num(i64),
    /// A string literal (or `@#`, `@1`).
    Str(String),
    /// A keyword (`arch`) or a `CONFIG_X`.
    Name(String),
}

struct Cond<'a> {
    toks: &'a [Token],
    pos: usize,
    inv: &'a Invocation,
}

impl Cond<'_> {
    fn end_span(&self) -> Span {
        self.toks
            .last()
            .map(|t| Span::new(t.span.end as usize, t.span.end as usize))
            .unwrap_or_default()
    }

    fn eat(&mut self, op: &str) -> bool {
        let hit =
            matches!(self.toks.get(self.pos), Some(Token { tok: Tok::Op(o), .. }) if *o == op);
        if hit {
            self.pos += 1;
        }
        hit
    }

    fn operand(&mut self) -> Result<(Operand, Span), ParseError> {
        let Some(t) = self.toks.get(self.pos) else {
            return Err(error(
                "preprocessor condition ends too early",
                self.end_span(),
            ));
        };
        self.pos += 1;
        let value = match &t.tok {
            Tok::Num(n) => Operand::Num(*n),
            Tok::Str(s) => Operand::Str(s.clone()),
            Tok::Ident(s) => Operand::Name(s.clone()),
            Tok::Op("-") => match self.toks.get(self.pos) {
                Some(Token {
                    tok: Tok::Num(n),
                    span,
                }) => {
                    self.pos += 1;
                    return Ok((Operand::Num(n.wrapping_neg()), t.span.to(*span)));
                }
                _ => return Err(error(KNOWN, t.span)),
            },
            _ => return Err(error(KNOWN, t.span)),
        };
        Ok((value, t.span))
    }

    fn operator(&mut self) -> Result<(&'static str, Span), ParseError> {
        match self.toks.get(self.pos) {
            Some(Token {
                tok: Tok::Op(op @ ("==" | "!=" | "<" | "<=" | ">" | ">=")),
                span,
            }) => {
                self.pos += 1;
                Ok((op, *span))
            }
            Some(t) => Err(error(
                format!("expected a comparison operator, found {}", t.tok.describe()),
                t.span,
            )),
            None => Err(error("expected a comparison operator", self.end_span())),
        }
    }

    fn comparison(&mut self) -> Result<bool, ParseError> {
        let (left, lspan) = self.operand()?;
        let (op, opspan) = self.operator()?;
        let (right, rspan) = self.operand()?;
        let inv = self.inv;
        match left {
            Operand::Name(name) => match name.as_str() {
                "kernel_v" | "kernel_vr" | "systemtap_v" => {
                    let have = match name.as_str() {
                        "kernel_v" => inv.facts.kernel_version(),
                        "kernel_vr" => inv.facts.kernel_release.as_str(),
                        _ => SYSTEMTAP_VERSION,
                    };
                    let Operand::Str(want) = right else {
                        return Err(error("expected a string literal", rspan));
                    };
                    if is_wildcard(&want) {
                        return wildcard(op, opspan, &want, have);
                    }
                    Ok(ordered(op, compare_versions(have, &want)))
                }
                "arch" | "runtime" | "systemtap_privilege" => {
                    let have = match name.as_str() {
                        "arch" => inv.facts.arch.as_str(),
                        "runtime" => RUNTIME,
                        _ => inv.privilege(),
                    };
                    let Operand::Str(want) = right else {
                        return Err(error("expected a string literal", rspan));
                    };
                    wildcard(op, opspan, &want, have)
                }
                "guru_mode" => {
                    let Operand::Num(want) = right else {
                        return Err(error("expected a number literal", rspan));
                    };
                    if !matches!(op, "==" | "!=") {
                        return Err(error("expected '==' or '!='", opspan));
                    }
                    Ok(ordered(op, i64::from(inv.guru).cmp(&want)))
                }
                n if n.starts_with("CONFIG_") => {
                    let have = inv.facts.config.get(n).map_or("", String::as_str);
                    match right {
                        Operand::Str(want) => wildcard(op, opspan, &want, have),
                        Operand::Num(want) => {
                            let have = config_number(have).ok_or_else(|| {
                                error(
                                    format!("the value of {n} ('{have}') is not a number"),
                                    lspan,
                                )
                            })?;
                            Ok(ordered(op, have.cmp(&want)))
                        }
                        Operand::Name(other) if other.starts_with("CONFIG_") => {
                            let theirs = inv.facts.config.get(&other).map_or("", String::as_str);
                            let order = match (config_number(have), config_number(theirs)) {
                                (Some(a), Some(b)) => a.cmp(&b),
                                _ => have.cmp(theirs),
                            };
                            Ok(ordered(op, order))
                        }
                        Operand::Name(_) => Err(error(
                            "expected a string, a number or another CONFIG_... on the right",
                            rspan,
                        )),
                    }
                }
                _ => Err(error(
                    format!("unknown preprocessor condition '{name}'; {KNOWN}"),
                    lspan,
                )),
            },
            Operand::Num(a) => match right {
                Operand::Num(b) => Ok(ordered(op, a.cmp(&b))),
                _ => Err(error("expected a number literal on the right", rspan)),
            },
            Operand::Str(a) => match right {
                Operand::Str(b) => Ok(ordered(op, a.cmp(&b))),
                _ => Err(error("expected a string literal on the right", rspan)),
            },
        }
    }
}

/// A number as the kernel configuration writes it (decimal or 0x hex).
fn config_number(text: &str) -> Option<i64> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => i64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn ordered(op: &str, order: Ordering) -> bool {
    match op {
        "==" => order == Ordering::Equal,
        "!=" => order != Ordering::Equal,
        "<" => order == Ordering::Less,
        "<=" => order != Ordering::Greater,
        ">" => order == Ordering::Greater,
        _ => order != Ordering::Less,
    }
}

fn is_wildcard(pattern: &str) -> bool {
    pattern.contains(['*', '?', '['])
}

/// `==`/`!=` against a shell wildcard pattern.
fn wildcard(op: &str, span: Span, pattern: &str, text: &str) -> Result<bool, ParseError> {
    match op {
        "==" => Ok(glob(pattern.as_bytes(), text.as_bytes())),
        "!=" => Ok(!glob(pattern.as_bytes(), text.as_bytes())),
        _ => Err(error(
            "expected '==' or '!=' (this comparison takes a string or wildcard pattern)",
            span,
        )),
    }
}

/// fnmatch without flags: `*`, `?` and `[...]` classes (`[!...]` negated).
///
/// Iterative, backtracking only to the last `*` (every other token matches exactly one byte,
/// so that is enough): O(pattern x text) at worst. The recursive form this replaced tried every
/// split at every star, exponential in the number of stars; fuzzing the front end found a
/// preprocessor condition that kept it busy for minutes.
pub(super) fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    // The pattern index after the last star, and the text index that star's match ends at.
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if pattern.get(p) == Some(&b'*') {
            p += 1;
            star = Some((p, t));
            continue;
        }
        if let Some(next) = token_matches(pattern, p, text[t]) {
            p = next;
            t += 1;
            continue;
        }
        match star {
            // Let the last star take one more byte, and try the rest again from there.
            Some((after, taken)) => {
                star = Some((after, taken + 1));
                p = after;
                t = taken + 1;
            }
            None => return false,
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|&c| c == b'*')
}

/// Whether the token at `pattern[p]` (not a star) matches byte `c`: the index after the
/// token when it does. An unclosed `[` is a literal.
fn token_matches(pattern: &[u8], p: usize, c: u8) -> Option<usize> {
    match *pattern.get(p)? {
        b'?' => Some(p + 1),
        b'[' => {
            let rest = &pattern[p + 1..];
            let Some(close) = rest.iter().skip(1).position(|&x| x == b']').map(|q| q + 1) else {
                return (c == b'[').then_some(p + 1);
            };
            let (negated, class) = match rest[..close].split_first() {
                Some((b'!', class)) => (true, class),
                _ => (false, &rest[..close]),
            };
            let mut hit = false;
            let mut k = 0;
            while k < class.len() {
                if k + 2 < class.len() && class[k + 1] == b'-' {
                    hit |= (class[k]..=class[k + 2]).contains(&c);
                    k += 3;
                } else {
                    hit |= class[k] == c;
                    k += 1;
                }
            }
            (hit != negated).then_some(p + 1 + close + 1)
        }
        x => (x == c).then_some(p + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::TargetFacts;
    use crate::lexer::tokenize;

    fn eval_with(cond: &str, inv: &Invocation) -> Result<bool, ParseError> {
        let mut toks = tokenize(cond).unwrap();
        toks.pop();
        evaluate(&toks, inv, Span::default())
    }

    fn eval(cond: &str) -> Result<bool, ParseError> {
        let inv = Invocation {
            facts: TargetFacts::from_config(
                "6.1.0-50-cloud-amd64",
                "x86_64",
                "CONFIG_64BIT=y\nCONFIG_HZ=250\nCONFIG_NR_CPUS=64\n",
                "test",
            ),
            ..Invocation::default()
        };
        eval_with(cond, &inv)
    }

    #[test]
    fn kernel_version_compares_as_a_version() {
        assert_eq!(eval(r#"kernel_v > "2.6.24""#), Ok(true));
        assert_eq!(eval(r#"kernel_v < "6.1.10""#), Ok(true));
    }

    #[test]
    fn kernel_release_matches_a_wildcard() {
        assert_eq!(eval(r#"kernel_vr == "6.1.*-cloud-*""#), Ok(true));
    }

    #[test]
    fn arch_compares_by_name() {
        assert_eq!(eval(r#"arch == "x86_64""#), Ok(true));
        assert_eq!(eval(r#"arch != "i?86""#), Ok(true));
    }

    #[test]
    fn config_options_compare_as_strings_and_numbers() {
        assert_eq!(eval(r#"CONFIG_64BIT == "y""#), Ok(true));
        assert_eq!(eval(r#"CONFIG_NOT_THERE == "y""#), Ok(false));
        assert_eq!(eval("CONFIG_HZ >= 100"), Ok(true));
        assert_eq!(eval("CONFIG_NR_CPUS > CONFIG_HZ"), Ok(false));
    }

    #[test]
    fn and_binds_tighter_than_or() {
        assert_eq!(eval(r#"1 == 0 && 1 == 1 || 2 == 2"#), Ok(true));
        assert_eq!(eval(r#"1 == 1 || 2 == 2 && 1 == 0"#), Ok(true));
        assert_eq!(eval(r#"1 == 0 || 2 == 2 && 1 == 0"#), Ok(false));
    }

    #[test]
    fn runtime_privilege_and_guru_mode_are_answered() {
        let inv = Invocation {
            guru: true,
            ..Invocation::default()
        };
        assert_eq!(eval_with(r#"runtime == "kernel""#, &inv), Ok(true));
        assert_eq!(
            eval_with(r#"systemtap_privilege == "stapdev""#, &inv),
            Ok(true)
        );
        assert_eq!(eval_with("guru_mode == 1", &inv), Ok(true));
        assert_eq!(eval_with(r#"systemtap_v >= "2.3""#, &inv), Ok(true));
    }

    #[test]
    fn unknown_keyword_is_an_error_naming_the_known_ones() {
        let err = eval(r#"kernel_version >= "2.6""#).unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown preprocessor condition 'kernel_version'"),
            "{err}"
        );
    }

    #[test]
    fn ordering_a_wildcard_is_an_error() {
        let err = eval(r#"arch < "x86*""#).unwrap_err();
        assert!(err.to_string().contains("expected '==' or '!='"), "{err}");
    }

    #[test]
    fn number_compared_with_string_is_an_error() {
        let err = eval(r#"1 == "1""#).unwrap_err();
        assert!(
            err.to_string().contains("expected a number literal"),
            "{err}"
        );
    }

    #[test]
    fn glob_classes_and_negation_match() {
        assert!(glob(b"[a-c]x", b"bx"));
        assert!(glob(b"[!a-c]x", b"dx"));
        assert!(!glob(b"[!a-c]x", b"ax"));
    }

    /// The recursive matcher `glob` replaced (exponential in stars), as the reference.
    fn reference(pattern: &[u8], text: &[u8]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some((b'*', rest)) => (0..=text.len()).any(|k| reference(rest, &text[k..])),
            Some((b'?', rest)) => !text.is_empty() && reference(rest, &text[1..]),
            Some((b'[', rest)) => {
                let Some(close) = rest.iter().skip(1).position(|&c| c == b']').map(|p| p + 1)
                else {
                    return text.first() == Some(&b'[') && reference(rest, &text[1..]);
                };
                let Some(&c) = text.first() else {
                    return false;
                };
                let (negated, class) = match rest[..close].split_first() {
                    Some((b'!', class)) => (true, class),
                    _ => (false, &rest[..close]),
                };
                let mut hit = false;
                let mut k = 0;
                while k < class.len() {
                    if k + 2 < class.len() && class[k + 1] == b'-' {
                        hit |= (class[k]..=class[k + 2]).contains(&c);
                        k += 3;
                    } else {
                        hit |= class[k] == c;
                        k += 1;
                    }
                }
                hit != negated && reference(&rest[close + 1..], &text[1..])
            }
            Some((&p, rest)) => text.first() == Some(&p) && reference(rest, &text[1..]),
        }
    }

    /// Every short pattern over `*?[]!-ab` against every short text over `ab[-`: the same
    /// answers as the recursive matcher.
    #[test]
    fn glob_answers_as_the_recursive_matcher_on_every_short_input() {
        let pat_alphabet = b"*?[]!-ab";
        let text_alphabet = b"ab[-";
        let strings = |alphabet: &[u8], max: usize| {
            let mut all = vec![Vec::new()];
            let mut last = vec![Vec::new()];
            for _ in 0..max {
                last = last
                    .iter()
                    .flat_map(|s: &Vec<u8>| {
                        alphabet.iter().map(move |&c| {
                            let mut n = s.clone();
                            n.push(c);
                            n
                        })
                    })
                    .collect();
                all.extend(last.iter().cloned());
            }
            all
        };
        let patterns = strings(pat_alphabet, 4);
        let texts = strings(text_alphabet, 4);
        let mut checked = 0;
        for p in &patterns {
            for t in &texts {
                assert_eq!(
                    glob(p, t),
                    reference(p, t),
                    "{:?} against {:?}",
                    String::from_utf8_lossy(p),
                    String::from_utf8_lossy(t)
                );
                checked += 1;
            }
        }
        assert!(checked > 1_000_000, "{checked}");
    }

    /// Many stars against a long text that does not match: answered (the recursive form
    /// would try about 200^30 splits).
    #[test]
    fn glob_with_many_stars_answers() {
        let pattern = [b"*a".repeat(30), b"b".to_vec()].concat();
        let text = b"a".repeat(200);
        assert!(!glob(&pattern, &text));
        assert!(glob(&pattern, &[text.clone(), b"b".to_vec()].concat()));
    }
}
