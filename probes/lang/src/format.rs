//! printf formats: parsing (so the checker can match arguments to conversions) and rendering
//! with C semantics on 64-bit values.

use super::value::Value;

/// Widest field a format may ask for, so a format cannot make the host allocate gigabytes.
pub const MAX_FIELD_WIDTH: usize = 4096;

/// What a conversion consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// A long (`%d`, `%x`, `%c`, `%p`, `*` widths, ...).
    Long,
    /// A string (`%s`).
    Str,
}

/// Conversion characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conv {
    /// `%d`, `%i`.
    Signed,
    /// `%u`.
    Unsigned,
    /// `%x` / `%X`.
    Hex {
        /// Upper case digits.
        upper: bool,
    },
    /// `%o`.
    Octal,
    /// `%s`.
    Str,
    /// `%c`.
    Char,
    /// `%p`.
    Pointer,
}

/// A field width or precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    /// Written in the format.
    Fixed(usize),
    /// `*`: taken from the next argument.
    Arg,
}

/// One `%...` conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Spec {
    /// `-`
    pub left: bool,
    /// `0`
    pub zero: bool,
    /// `+`
    pub plus: bool,
    /// ` `
    pub space: bool,
    /// `#`
    pub alt: bool,
    /// Field width.
    pub width: Option<Width>,
    /// Precision.
    pub precision: Option<Width>,
    /// The conversion.
    pub conv: Option<Conv>,
}

/// A piece of a parsed format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Text copied as is (`%%` already turned into `%`).
    Lit(String),
    /// A conversion.
    Conv(Spec),
}

/// Why a format string is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// `%` at the end of the format.
    #[error("format ends in the middle of a conversion")]
    Incomplete,
    /// A conversion character the language does not have.
    #[error("invalid format conversion '%{0}'")]
    BadConversion(char),
    /// Width or precision beyond [`MAX_FIELD_WIDTH`].
    #[error("field width or precision above {MAX_FIELD_WIDTH}")]
    TooWide,
}

/// Parses a format string.
///
/// # Errors
/// On an incomplete or unknown conversion, or a too wide field.
pub fn parse_format(fmt: &str) -> Result<Vec<Piece>, FormatError> {
    let mut out = Vec::new();
    let mut lit = String::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            lit.push(c);
            continue;
        }
        if chars.peek() == Some(&'%') {
            chars.next();
            lit.push('%');
            continue;
        }
        let mut spec = Spec::default();
        while let Some(&f) = chars.peek() {
            match f {
                '-' => spec.left = true,
                '0' => spec.zero = true,
                '+' => spec.plus = true,
                ' ' => spec.space = true,
                '#' => spec.alt = true,
                _ => break,
            }
            chars.next();
        }
        let number = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
            if chars.peek() == Some(&'*') {
                chars.next();
                return Ok(Some(Width::Arg));
            }
            let mut n: Option<usize> = None;
            while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                chars.next();
                let v = n.unwrap_or(0).saturating_mul(10).saturating_add(d as usize);
                if v > MAX_FIELD_WIDTH {
                    return Err(FormatError::TooWide);
                }
                n = Some(v);
            }
            Ok(n.map(Width::Fixed))
        };
        spec.width = number(&mut chars)?;
        if chars.peek() == Some(&'.') {
            chars.next();
            spec.precision = Some(number(&mut chars)?.unwrap_or(Width::Fixed(0)));
        }
        while matches!(chars.peek(), Some('l' | 'h' | 'L' | 'z' | 'j' | 't')) {
            chars.next();
        }
        let conv = match chars.next() {
            None => return Err(FormatError::Incomplete),
            Some('d' | 'i') => Conv::Signed,
            Some('u') => Conv::Unsigned,
            Some('x') => Conv::Hex { upper: false },
            Some('X') => Conv::Hex { upper: true },
            Some('o') => Conv::Octal,
            Some('s') => Conv::Str,
            Some('c') => Conv::Char,
            Some('p') => Conv::Pointer,
            Some(other) => return Err(FormatError::BadConversion(other)),
        };
        spec.conv = Some(conv);
        if !lit.is_empty() {
            out.push(Piece::Lit(std::mem::take(&mut lit)));
        }
        out.push(Piece::Conv(spec));
    }
    if !lit.is_empty() {
        out.push(Piece::Lit(lit));
    }
    Ok(out)
}

/// The arguments a parsed format consumes, in order.
pub fn arg_kinds(pieces: &[Piece]) -> Vec<ArgKind> {
    let mut out = Vec::new();
    for p in pieces {
        if let Piece::Conv(spec) = p {
            if spec.width == Some(Width::Arg) {
                out.push(ArgKind::Long);
            }
            if spec.precision == Some(Width::Arg) {
                out.push(ArgKind::Long);
            }
            out.push(if spec.conv == Some(Conv::Str) {
                ArgKind::Str
            } else {
                ArgKind::Long
            });
        }
    }
    out
}

fn pad(body: String, prefix: &str, spec: &Spec, width: usize, numeric: bool) -> String {
    let len = body.chars().count() + prefix.len();
    if len >= width {
        return format!("{prefix}{body}");
    }
    let fill = width - len;
    if spec.left {
        format!("{prefix}{body}{}", " ".repeat(fill))
    } else if spec.zero && numeric {
        format!("{prefix}{}{body}", "0".repeat(fill))
    } else {
        format!("{}{prefix}{body}", " ".repeat(fill))
    }
}

/// Renders `pieces` with `args` (already checked to match [`arg_kinds`]; a missing or
/// mistyped argument renders as 0 or "").
pub fn render(pieces: &[Piece], args: &[Value]) -> String {
    let mut out = String::new();
    let mut next = args.iter();
    let mut take = || next.next().cloned().unwrap_or(Value::Long(0));
    for p in pieces {
        let spec = match p {
            Piece::Lit(s) => {
                out.push_str(s);
                continue;
            }
            Piece::Conv(spec) => spec,
        };
        let mut spec = *spec;
        let width = match spec.width {
            Some(Width::Arg) => {
                let w = take().as_long();
                if w < 0 {
                    spec.left = true;
                }
                (w.unsigned_abs() as usize).min(MAX_FIELD_WIDTH)
            }
            Some(Width::Fixed(w)) => w,
            None => 0,
        };
        let precision = match spec.precision {
            Some(Width::Arg) => Some((take().as_long().max(0) as usize).min(MAX_FIELD_WIDTH)),
            Some(Width::Fixed(p)) => Some(p),
            None => None,
        };
        let arg = take();
        let min_digits = |digits: String| match precision {
            Some(p) if digits.len() < p => format!("{}{digits}", "0".repeat(p - digits.len())),
            _ => digits,
        };
        let text = match spec.conv {
            Some(Conv::Str) => {
                let s = arg.as_str();
                let s: String = match precision {
                    Some(p) => s.chars().take(p).collect(),
                    None => s.to_string(),
                };
                pad(s, "", &spec, width, false)
            }
            Some(Conv::Char) => {
                let c = char::from(arg.as_long() as u8);
                pad(c.to_string(), "", &spec, width, false)
            }
            Some(Conv::Signed) => {
                let n = arg.as_long();
                let sign = if n < 0 {
                    "-"
                } else if spec.plus {
                    "+"
                } else if spec.space {
                    " "
                } else {
                    ""
                };
                pad(
                    min_digits(n.unsigned_abs().to_string()),
                    sign,
                    &spec,
                    width,
                    true,
                )
            }
            Some(Conv::Unsigned) => pad(
                min_digits((arg.as_long() as u64).to_string()),
                "",
                &spec,
                width,
                true,
            ),
            Some(Conv::Hex { upper }) => {
                let v = arg.as_long() as u64;
                let digits = if upper {
                    format!("{v:X}")
                } else {
                    format!("{v:x}")
                };
                let prefix = match (spec.alt, upper) {
                    (false, _) => "",
                    (true, false) => "0x",
                    (true, true) => "0X",
                };
                pad(min_digits(digits), prefix, &spec, width, true)
            }
            Some(Conv::Octal) => {
                let prefix = if spec.alt { "0" } else { "" };
                pad(
                    min_digits(format!("{:o}", arg.as_long() as u64)),
                    prefix,
                    &spec,
                    width,
                    true,
                )
            }
            Some(Conv::Pointer) => {
                let body = format!("0x{:016x}", arg.as_long() as u64);
                pad(body, "", &spec, width, false)
            }
            None => String::new(),
        };
        out.push_str(&text);
    }
    out
}

/// Escapes a string the way `%#s` / `string_quoted` show it: C escapes for quotes,
/// backslashes and control characters.
pub fn escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\{:03o}", c as u32));
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fmt(f: &str, args: &[Value]) -> String {
        render(&parse_format(f).unwrap(), args)
    }

    #[test]
    fn signed_with_width_and_zero_pad() {
        assert_eq!(fmt("[%05d]", &[Value::Long(-42)]), "[-0042]");
    }

    #[test]
    fn left_justified_string() {
        assert_eq!(fmt("[%-5s]", &[Value::Str("ab".into())]), "[ab   ]");
    }

    #[test]
    fn hex_of_negative_is_twos_complement() {
        assert_eq!(fmt("%x", &[Value::Long(-1)]), "ffffffffffffffff");
    }

    #[test]
    fn alternate_hex_has_prefix() {
        assert_eq!(
            fmt("%#x %#o", &[Value::Long(255), Value::Long(8)]),
            "0xff 010"
        );
    }

    #[test]
    fn star_width_takes_an_argument() {
        assert_eq!(fmt("[%*d]", &[Value::Long(4), Value::Long(7)]), "[   7]");
        assert_eq!(
            arg_kinds(&parse_format("%*d").unwrap()),
            vec![ArgKind::Long, ArgKind::Long]
        );
    }

    #[test]
    fn percent_percent_is_literal() {
        assert_eq!(fmt("100%%", &[]), "100%");
    }

    #[test]
    fn pointer_is_zero_padded_hex() {
        assert_eq!(fmt("%p", &[Value::Long(0x1234)]), "0x0000000000001234");
    }

    #[test]
    fn unknown_conversion_is_an_error() {
        assert_eq!(parse_format("%q"), Err(FormatError::BadConversion('q')));
    }

    #[test]
    fn huge_width_is_an_error() {
        assert_eq!(parse_format("%99999999999d"), Err(FormatError::TooWide));
    }

    #[test]
    fn string_precision_truncates() {
        assert_eq!(fmt("%.2s", &[Value::Str("abcdef".into())]), "ab");
    }

    #[test]
    fn escape_quotes_control_characters() {
        assert_eq!(escape("a\"\n\x01"), "a\\\"\\n\\001");
    }
}
