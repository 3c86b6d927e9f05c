//! Diagnostics: a message, the span it is about, a label and a hint, rendered with the
//! source line and carets (ariadne, ASCII character set).

use codespan_reporting::diagnostic::{self, Label};
use codespan_reporting::files::SimpleFile;
use codespan_reporting::term;
use termcolor::Buffer;

use super::ast::Span;
use super::parser::ParseError;

/// How bad a diagnostic is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// The script is rejected.
    Error,
    /// The script runs, but probably not as meant.
    Warning,
}

/// One message about the script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// Error or warning.
    pub severity: Severity,
    /// The sentence saying what is wrong.
    pub message: String,
    /// Where.
    pub span: Span,
    /// Short text under the carets.
    pub label: Option<String>,
    /// What to do about it.
    pub hint: Option<String>,
}

impl Diagnostic {
    /// An error at `span`.
    pub fn error(message: impl Into<String>, span: Span) -> Self {
        Diagnostic {
            severity: Severity::Error,
            message: message.into(),
            span,
            label: None,
            hint: None,
        }
    }

    /// A warning at `span`.
    pub fn warning(message: impl Into<String>, span: Span) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(message, span)
        }
    }

    /// Adds the label shown under the carets.
    pub fn with_label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Adds a hint.
    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// Renders the diagnostic rustc-style: the message, `--> file:line:col`, the source line
    /// with carets under the span, the label, and the hint.
    pub fn render(&self, file: &str, src: &str, color: bool) -> String {
        // Clamp the span to the source and to character boundaries so a bad span can never
        // make the renderer fail.
        let mut start = (self.span.start as usize).min(src.len());
        while start > 0 && !src.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (self.span.end as usize).clamp(start, src.len());
        while end < src.len() && !src.is_char_boundary(end) {
            end += 1;
        }
        let severity = match self.severity {
            Severity::Error => diagnostic::Severity::Error,
            Severity::Warning => diagnostic::Severity::Warning,
        };
        let label =
            Label::primary((), start..end).with_message(self.label.clone().unwrap_or_default());
        let mut d = diagnostic::Diagnostic::new(severity)
            .with_message(&self.message)
            .with_labels(vec![label]);
        if let Some(hint) = &self.hint {
            d = d.with_notes(vec![format!("hint: {hint}")]);
        }
        let source = SimpleFile::new(file, src);
        let mut buf = if color {
            Buffer::ansi()
        } else {
            Buffer::no_color()
        };
        let config = term::Config {
            chars: term::Chars::ascii(),
            ..term::Config::default()
        };
        match term::emit(&mut buf, &config, &source, &d) {
            Ok(()) => String::from_utf8_lossy(buf.as_slice()).into_owned(),
            Err(_) => format!("{file}: error: {}\n", self.message),
        }
    }
}

impl From<&ParseError> for Diagnostic {
    fn from(e: &ParseError) -> Self {
        let d = Diagnostic::error(format!("parse error: {e}"), e.span());
        let d = match e {
            ParseError::Unexpected { expected, .. } => d.with_label(format!("expected {expected}")),
            _ => d,
        };
        match e.hint() {
            Some(h) => d.with_hint(h),
            None => d,
        }
    }
}

/// 1-based line and column of a byte offset, for runtime error messages.
pub fn line_col(src: &str, offset: u32) -> (usize, usize) {
    let offset = (offset as usize).min(src.len());
    let before = src.as_bytes().get(..offset).unwrap_or_default();
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let col = before.iter().rev().take_while(|&&b| b != b'\n').count() + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_shows_line_carets_and_hint() {
        let src = "probe begin {\n  x = y\n}\n";
        let d = Diagnostic::error("undefined variable 'y'", Span::new(20, 21))
            .with_label("never assigned")
            .with_hint("declare it");
        let text = d.render("t.stp", src, false);
        assert!(text.contains("undefined variable 'y'"));
        assert!(text.contains("x = y"));
        assert!(text.contains('^'));
        assert!(text.contains("declare it"));
    }

    #[test]
    fn render_survives_spans_past_the_end() {
        let d = Diagnostic::error("oops", Span::new(100, 200));
        assert!(d.render("t.stp", "abc", false).contains("oops"));
    }

    #[test]
    fn line_col_counts_from_one() {
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
    }
}
