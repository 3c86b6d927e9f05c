//! Tokenizer: source text to tokens with spans. Comments are `#`, `//` and `/* */`.

use super::ast::Span;

/// Token kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tok {
    /// Identifier or keyword (`probe`, `if`, ...): the parser decides.
    Ident(String),
    /// `$name` or `$$name`; also `$1`, `$2`, ... and `$#` (script arguments, replaced by the
    /// preprocessor).
    Target(String),
    /// `@name` (`@count`, `@hist_log`, ...); also `@1`, ... and `@#` (script arguments as strings)
    /// and macro invocations.
    At(String),
    /// Integer literal.
    Num(i64),
    /// String literal, escapes decoded.
    Str(String),
    /// `%{ ... %}` embedded C; the text between the markers.
    Embedded(String),
    /// Operator or punctuation.
    Op(&'static str),
    /// End of input.
    Eof,
}

impl Tok {
    /// How the token reads in a message.
    pub fn describe(&self) -> String {
        match self {
            Tok::Ident(s) => format!("identifier '{s}'"),
            Tok::Target(s) => format!("target variable '{s}'"),
            Tok::At(s) => format!("'{s}'"),
            Tok::Num(n) => format!("number {n}"),
            Tok::Str(s) => format!("string \"{}\"", s.escape_default()),
            Tok::Embedded(_) => "embedded C code".to_string(),
            Tok::Op(o) => format!("'{o}'"),
            Tok::Eof => "end of input".to_string(),
        }
    }
}

/// A token with its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    /// Kind and payload.
    pub tok: Tok,
    /// Where it is written.
    pub span: Span,
}

/// Why the source could not be tokenized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LexError {
    /// A character that starts no token.
    #[error("unexpected character '{ch}'")]
    UnexpectedChar {
        /// The character.
        ch: char,
        /// Where.
        span: Span,
    },
    /// A string literal without its closing quote.
    #[error("unterminated string literal")]
    UnterminatedString {
        /// From the opening quote.
        span: Span,
    },
    /// A `/*` comment without `*/`.
    #[error("unterminated comment")]
    UnterminatedComment {
        /// From the opening marker.
        span: Span,
    },
    /// `%{` without `%}`.
    #[error("unterminated embedded code block")]
    UnterminatedEmbedded {
        /// From the opening marker.
        span: Span,
    },
    /// An integer that does not fit in 64 bits.
    #[error("number does not fit in 64 bits")]
    NumberTooLarge {
        /// The literal.
        span: Span,
    },
    /// A malformed number such as `0x` or `12ab`.
    #[error("malformed number")]
    BadNumber {
        /// The literal.
        span: Span,
    },
    /// A backslash escape the language does not know.
    #[error("unknown escape sequence '\\{ch}'")]
    BadEscape {
        /// The character after the backslash.
        ch: char,
        /// The escape.
        span: Span,
    },
}

impl LexError {
    /// Where the error is.
    pub fn span(&self) -> Span {
        match self {
            LexError::UnexpectedChar { span, .. }
            | LexError::UnterminatedString { span }
            | LexError::UnterminatedComment { span }
            | LexError::UnterminatedEmbedded { span }
            | LexError::NumberTooLarge { span }
            | LexError::BadNumber { span }
            | LexError::BadEscape { span, .. } => *span,
        }
    }
}

/// Operators, longest first so that the first prefix match is the longest one.
const OPERATORS: &[&str] = &[
    "<<<", "<<=", ">>=", "%(", "%?", "%:", "%)", "<<", ">>", "<=", ">=", "==", "!=", "=~", "!~",
    "&&", "||", "++", "--", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", ".=", "->", "+", "-",
    "*", "/", "%", "<", ">", "=", "!", "~", "&", "|", "^", ".", ",", ";", ":", "?", "(", ")", "{",
    "}", "[", "]",
];

/// Splits `src` into tokens, ending with [`Tok::Eof`].
///
/// # Errors
/// The first lexical error found.
pub fn tokenize(src: &str) -> Result<Vec<Token>, LexError> {
    let bytes = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let start = i;
        if c == b'#' || (c == b'/' && bytes.get(i + 1) == Some(&b'/')) {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && bytes.get(i + 1) == Some(&b'*') {
            match src[i + 2..].find("*/") {
                Some(end) => i = i + 2 + end + 2,
                None => {
                    return Err(LexError::UnterminatedComment {
                        span: Span::new(i, i + 2),
                    })
                }
            }
            continue;
        }
        if c == b'%' && bytes.get(i + 1) == Some(&b'{') {
            match src[i + 2..].find("%}") {
                Some(end) => {
                    let text = src[i + 2..i + 2 + end].to_string();
                    i = i + 2 + end + 2;
                    out.push(Token {
                        tok: Tok::Embedded(text),
                        span: Span::new(start, i),
                    });
                }
                None => {
                    return Err(LexError::UnterminatedEmbedded {
                        span: Span::new(i, i + 2),
                    })
                }
            }
            continue;
        }
        let tok = if c.is_ascii_alphabetic() || c == b'_' {
            i = scan_word(bytes, i);
            Tok::Ident(src[start..i].to_string())
        } else if c == b'$' || c == b'@' {
            let mut j = i + 1;
            if c == b'$' && bytes.get(j) == Some(&b'$') {
                j += 1;
            }
            // `$#` and `@#`: the number of script arguments (the preprocessor replaces them).
            let mut end = if bytes.get(j) == Some(&b'#') && j == i + 1 {
                j + 1
            } else {
                scan_word(bytes, j)
            };
            // `$var$`, `$$parms$$`: the pretty-printing suffix is part of the name.
            if c == b'$' && end > j && bytes.get(end) == Some(&b'$') {
                end += 1;
                if bytes.get(end) == Some(&b'$') {
                    end += 1;
                }
            }
            // `->member$` and `->member$$` after a word: a pretty-printing suffix of its own.
            let after_word =
                i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
            if end == j && !(c == b'$' && after_word) {
                return Err(LexError::UnexpectedChar {
                    ch: char::from(c),
                    span: Span::new(i, j),
                });
            }
            i = end;
            let text = src[start..i].to_string();
            if c == b'$' {
                Tok::Target(text)
            } else {
                Tok::At(text)
            }
        } else if c.is_ascii_digit() {
            let (n, end) = scan_number(src, i)?;
            i = end;
            Tok::Num(n)
        } else if c == b'"' {
            let (s, end) = scan_string(src, i)?;
            i = end;
            Tok::Str(s)
        } else if let Some(op) = OPERATORS.iter().find(|op| src[i..].starts_with(**op)) {
            i += op.len();
            Tok::Op(op)
        } else {
            let ch = src[i..].chars().next().unwrap_or('\u{fffd}');
            return Err(LexError::UnexpectedChar {
                ch,
                span: Span::new(i, i + ch.len_utf8()),
            });
        };
        out.push(Token {
            tok,
            span: Span::new(start, i),
        });
    }
    out.push(Token {
        tok: Tok::Eof,
        span: Span::new(src.len(), src.len()),
    });
    Ok(out)
}

fn scan_word(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
        i += 1;
    }
    i
}

fn scan_number(src: &str, start: usize) -> Result<(i64, usize), LexError> {
    let bytes = src.as_bytes();
    let end = scan_word(bytes, start);
    let text = &src[start..end];
    let span = Span::new(start, end);
    let (digits, radix) =
        if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
            (hex, 16)
        } else if text.len() > 1 && text.starts_with('0') {
            (&text[1..], 8)
        } else {
            (text, 10)
        };
    if digits.is_empty() || !digits.chars().all(|d| d.is_digit(radix)) {
        return Err(LexError::BadNumber { span });
    }
    // Every literal may use all 64 bits and wraps past a signed long, as in SystemTap
    // (0xffffffffffffffff and 18446744073709551615 are -1); past 64 bits is an error.
    let value = if radix == 10 {
        let v: u64 = digits
            .parse()
            .map_err(|_| LexError::NumberTooLarge { span })?;
        v as i64
    } else {
        let v =
            u64::from_str_radix(digits, radix).map_err(|_| LexError::NumberTooLarge { span })?;
        v as i64
    };
    Ok((value, end))
}

fn scan_string(src: &str, start: usize) -> Result<(String, usize), LexError> {
    let mut out = String::new();
    let mut chars = src[start + 1..].char_indices();
    while let Some((off, ch)) = chars.next() {
        let at = start + 1 + off;
        match ch {
            '"' => return Ok((out, at + 1)),
            '\\' => {
                let Some((_, esc)) = chars.next() else { break };
                let decoded = match esc {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    'a' => '\u{7}',
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'v' => '\u{b}',
                    // C's octal escapes, up to three digits (`\033` is ESC).
                    d @ '0'..='7' => {
                        let mut v = d.to_digit(8).unwrap_or(0);
                        for _ in 0..2 {
                            match chars.clone().next() {
                                Some((_, c @ '0'..='7')) => {
                                    v = v * 8 + c.to_digit(8).unwrap_or(0);
                                    chars.next();
                                }
                                _ => break,
                            }
                        }
                        char::from_u32(v & 0xff).unwrap_or('\0')
                    }
                    '\\' => '\\',
                    '"' => '"',
                    '\'' => '\'',
                    '\n' => continue,
                    other => {
                        return Err(LexError::BadEscape {
                            ch: other,
                            span: Span::new(at, at + 1 + other.len_utf8()),
                        })
                    }
                };
                out.push(decoded);
            }
            other => out.push(other),
        }
    }
    Err(LexError::UnterminatedString {
        span: Span::new(start, start + 1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str) -> Vec<Tok> {
        tokenize(src).unwrap().into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn aggregate_operator_is_one_token() {
        assert_eq!(
            kinds("s <<< 1"),
            vec![
                Tok::Ident("s".into()),
                Tok::Op("<<<"),
                Tok::Num(1),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn comments_of_all_three_kinds_are_skipped() {
        assert_eq!(
            kinds("# a\n// b\n/* c */ x"),
            vec![Tok::Ident("x".into()), Tok::Eof]
        );
    }

    #[test]
    fn hex_literal_may_use_the_sign_bit() {
        assert_eq!(kinds("0xffffffffffffffff"), vec![Tok::Num(-1), Tok::Eof]);
    }

    #[test]
    fn octal_escape_in_a_string_is_one_character() {
        assert_eq!(
            kinds(r#""\033[0m\0""#),
            vec![Tok::Str("\u{1b}[0m\0".into()), Tok::Eof]
        );
    }

    #[test]
    fn octal_literal_is_octal() {
        assert_eq!(kinds("010"), vec![Tok::Num(8), Tok::Eof]);
    }

    #[test]
    fn decimal_above_a_long_wraps_as_in_systemtap() {
        assert_eq!(kinds("18446744073709551615"), vec![Tok::Num(-1), Tok::Eof]);
    }

    #[test]
    fn decimal_past_64_bits_is_an_error() {
        assert!(matches!(
            tokenize("18446744073709551616"),
            Err(LexError::NumberTooLarge { .. })
        ));
    }

    #[test]
    fn pretty_printing_suffixes_stay_with_their_names() {
        assert_eq!(
            kinds("$$parms$$ $x$ a->b$$"),
            vec![
                Tok::Target("$$parms$$".into()),
                Tok::Target("$x$".into()),
                Tok::Ident("a".into()),
                Tok::Op("->"),
                Tok::Ident("b".into()),
                Tok::Target("$$".into()),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn regex_match_operators_are_tokens() {
        assert_eq!(
            kinds("a =~ b !~ c"),
            vec![
                Tok::Ident("a".into()),
                Tok::Op("=~"),
                Tok::Ident("b".into()),
                Tok::Op("!~"),
                Tok::Ident("c".into()),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn string_escapes_are_decoded() {
        assert_eq!(
            kinds(r#""a\n\"b""#),
            vec![Tok::Str("a\n\"b".into()), Tok::Eof]
        );
    }

    #[test]
    fn unterminated_string_is_an_error() {
        assert!(matches!(
            tokenize("\"abc"),
            Err(LexError::UnterminatedString { .. })
        ));
    }

    #[test]
    fn target_and_stat_names_keep_their_sigils() {
        assert_eq!(
            kinds("$$parms $x @count"),
            vec![
                Tok::Target("$$parms".into()),
                Tok::Target("$x".into()),
                Tok::At("@count".into()),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn argument_count_sigils_are_tokens() {
        assert_eq!(
            kinds("$# @# $1"),
            vec![
                Tok::Target("$#".into()),
                Tok::At("@#".into()),
                Tok::Target("$1".into()),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn lone_dollar_is_an_error() {
        assert!(matches!(
            tokenize("$ x"),
            Err(LexError::UnexpectedChar { ch: '$', .. })
        ));
    }

    #[test]
    fn embedded_code_is_one_token() {
        assert_eq!(
            kinds("%{ int x; %}"),
            vec![Tok::Embedded(" int x; ".into()), Tok::Eof]
        );
    }

    #[test]
    fn spans_cover_the_token_text() {
        let toks = tokenize("  abc").unwrap();
        assert_eq!(toks[0].span, Span::new(2, 5));
    }

    #[test]
    fn non_ascii_character_is_reported_whole() {
        assert!(matches!(
            tokenize("é"),
            Err(LexError::UnexpectedChar { ch: 'é', .. })
        ));
    }
}
