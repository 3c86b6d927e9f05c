//! Where a running script's output goes: SystemTap-style text, or one JSON object per line
//! with a bpftrace-like `type` field.

use std::io::{self, Write};

use serde_json::{json, Value as Json};

use super::hist::Histogram;

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// Plain text as SystemTap prints it.
    #[default]
    Text,
    /// JSON lines: `{"type":"printf","data":"..."}`, `{"type":"map",...}`, `{"type":"hist",...}`.
    Json,
}

/// The script's output and error streams.
pub struct Output {
    format: Format,
    out: Box<dyn Write>,
    err: Box<dyn Write>,
    closed: bool,
}

impl std::fmt::Debug for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Output")
            .field("format", &self.format)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl Output {
    /// Output in `format` to `out`, diagnostics and runtime errors to `err`.
    pub fn new(format: Format, out: Box<dyn Write>, err: Box<dyn Write>) -> Self {
        Output {
            format,
            out,
            err,
            closed: false,
        }
    }

    /// Whether the reader of the output stream went away (a broken pipe, as when the
    /// output is piped into `head`). Every later write to it fails at once, without
    /// writing: the session then stops quietly, like a Unix tool killed by `SIGPIPE`.
    pub fn closed(&self) -> bool {
        self.closed
    }

    /// Writes to the output stream, unless it is closed; a broken pipe closes it.
    fn emit(&mut self, bytes: &[u8]) -> io::Result<()> {
        if self.closed {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let result = self.out.write_all(bytes);
        self.note(result)
    }

    /// Remembers a broken pipe on the output stream.
    fn note(&mut self, result: io::Result<()>) -> io::Result<()> {
        if let Err(e) = &result {
            self.closed |= e.kind() == io::ErrorKind::BrokenPipe;
        }
        result
    }

    /// The format.
    pub fn format(&self) -> Format {
        self.format
    }

    fn line(&mut self, v: Json) -> io::Result<()> {
        self.emit(format!("{v}\n").as_bytes())
    }

    /// Text from `print`, `printf`, ... .
    ///
    /// # Errors
    /// When the stream fails.
    pub fn text(&mut self, s: &str) -> io::Result<()> {
        if s.is_empty() {
            return Ok(());
        }
        match self.format {
            Format::Text => self.emit(s.as_bytes()),
            Format::Json => self.line(json!({"type": "printf", "data": s})),
        }
    }

    /// A histogram printed with `print(@hist_log(name))`.
    ///
    /// # Errors
    /// When the stream fails.
    pub fn hist(&mut self, name: &str, h: &Histogram<'_>) -> io::Result<()> {
        match self.format {
            Format::Text => self.emit(h.render().as_bytes()),
            Format::Json => {
                let mut data = serde_json::Map::new();
                data.insert(name.to_string(), Json::Array(h.json_buckets()));
                self.line(json!({"type": "hist", "data": data}))
            }
        }
    }

    /// A global shown at exit (JSON mode): `type` is `map` for values, `stats` for aggregates.
    ///
    /// # Errors
    /// When the stream fails.
    pub fn global(&mut self, kind: &str, name: &str, value: Json) -> io::Result<()> {
        let mut data = serde_json::Map::new();
        data.insert(name.to_string(), value);
        self.line(json!({"type": kind, "data": data}))
    }

    /// A warning or runtime error line on the error stream.
    ///
    /// # Errors
    /// When the stream fails.
    pub fn error_line(&mut self, s: &str) -> io::Result<()> {
        if !self.closed {
            let result = self.out.flush();
            self.note(result)?;
        }
        writeln!(self.err, "{s}")?;
        self.err.flush()
    }

    /// Flushes both streams.
    ///
    /// # Errors
    /// When a stream fails.
    pub fn flush(&mut self) -> io::Result<()> {
        if !self.closed {
            let result = self.out.flush();
            self.note(result)?;
        }
        self.err.flush()
    }
}

/// A `Write` into a shared buffer, for tests and for capturing output.
#[derive(Debug, Clone, Default)]
pub struct SharedBuf(pub std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl SharedBuf {
    /// The bytes written so far, as text.
    pub fn contents(&self) -> String {
        String::from_utf8_lossy(&self.0.borrow()).into_owned()
    }
}

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_text_is_a_printf_object() {
        let buf = SharedBuf::default();
        let mut out = Output::new(Format::Json, Box::new(buf.clone()), Box::new(io::sink()));
        out.text("hi\n").unwrap();
        assert_eq!(buf.contents(), "{\"type\":\"printf\",\"data\":\"hi\\n\"}\n");
    }

    #[test]
    fn text_mode_writes_verbatim() {
        let buf = SharedBuf::default();
        let mut out = Output::new(Format::Text, Box::new(buf.clone()), Box::new(io::sink()));
        out.text("a").unwrap();
        out.text("b\n").unwrap();
        assert_eq!(buf.contents(), "ab\n");
    }
}
