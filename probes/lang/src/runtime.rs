//! A probe session: begin probes, then timers (on the host's wall clock) or probe hits fed by a
//! kernel backend, then end (or error) probes and the display of write-only globals.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};

use super::ast::{Sort, SortKey, StatOp};
use super::check::Program;
use super::context::{CapturedContext, Context};
use super::diag::line_col;
use super::eval::{sort_rows, stat_value, Interp, ScriptError, Store};
use super::format::escape;
use super::output::{Format, Output};
use super::point::{PointKind, PROCFS_VALUE};
use super::value::{Stats, Value};
use super::Limits;
use exotap_probes_base::procfs::{FileSpec, Op, Request, Server};

/// Why a session could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The script probes the guest kernel and no backend was given.
    #[error("kernel probe points need a guest: {points} (running probe bodies in a guest is not built yet; -p 3 lists where they would go)")]
    NeedsGuest {
        /// The kernel probe points, comma separated.
        points: String,
    },
    /// The script's procfs files cannot be served.
    #[error("{0}")]
    HostFiles(String),
}

/// Exit code of a session whose output's reader went away: 128 + `SIGPIPE`, what a shell
/// shows for a tool that signal killed.
pub const OUTPUT_CLOSED_EXIT: i32 = 141;

/// A running session over a checked program.
pub struct Session<'p> {
    interp: Interp<'p>,
    file: String,
    source: String,
    errors: usize,
    /// The context begin, end and error probes run in ([`host_context`] unless a backend
    /// gave one with [`Session::set_host_context`]).
    host: Option<Box<dyn Context>>,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("file", &self.file)
            .field("errors", &self.errors)
            .finish()
    }
}

impl<'p> Session<'p> {
    /// A session for `prog`, whose source `source` came from `file` (for error positions).
    pub fn new(prog: &'p Program, limits: Limits, out: Output, file: &str, source: &str) -> Self {
        Session {
            interp: Interp::new(prog, limits, out),
            file: file.to_string(),
            source: source.to_string(),
            errors: 0,
            host: None,
        }
    }

    /// The context begin, end and error probes run in from now on: a live backend's knows
    /// the guest kernel's types.
    pub fn set_host_context(&mut self, ctx: Box<dyn Context>) {
        self.host = Some(ctx);
    }

    /// Whether the session should stop (`exit()` was called, an error happened, or the
    /// output's reader went away).
    pub fn stopping(&self) -> bool {
        self.interp.exit_requested || self.errors > 0 || self.interp.out.closed()
    }

    fn points(&self, pick: impl Fn(&PointKind) -> Option<i64>) -> Vec<(i64, usize, String)> {
        let mut out = Vec::new();
        for (i, p) in self.interp.prog.probes.iter().enumerate() {
            for (pt, kind) in &p.points {
                if let Some(seq) = pick(kind) {
                    out.push((seq, i, pt.to_string()));
                }
            }
        }
        out.sort_by_key(|(seq, _, _)| *seq);
        out
    }

    fn report(&mut self, e: &ScriptError) {
        self.errors += 1;
        let (line, col) = line_col(&self.source, e.span.start);
        let near: String = self
            .source
            .get(e.span.range())
            .unwrap_or_default()
            .chars()
            .take(40)
            .collect::<String>()
            .replace('\n', " ");
        let msg = format!(
            "ERROR: {} near '{near}' at {}:{line}:{col}",
            e.message, self.file
        );
        // If stderr itself is gone there is nobody left to tell.
        let _ = self.interp.out.error_line(&msg);
    }

    /// The store of global `name`.
    pub fn global(&self, name: &str) -> Option<&Store> {
        self.interp.globals.get(name)
    }

    /// Replaces global `name`'s store (compiled probes keep theirs in the guest, and the
    /// host brings them here before host probes run).
    pub fn set_global(&mut self, name: &str, store: Store) {
        if let Some(slot) = self.interp.globals.get_mut(name) {
            *slot = store;
        }
    }

    /// Prints text the script produced outside the interpreter (compiled probes' output
    /// records); a closed output makes the session stop.
    pub fn text(&mut self, s: &str) {
        let _ = self.interp.out.text(s);
        let _ = self.interp.out.flush();
    }

    /// Prints a histogram a compiled probe printed (`print(@hist_log(s))`): text, or JSON's
    /// own `hist` object, as the interpreter prints it.
    pub fn hist(&mut self, name: &str, h: &crate::hist::Histogram<'_>) {
        let _ = self.interp.out.hist(name, h);
        let _ = self.interp.out.flush();
    }

    /// Prints a line of the host's own on the error stream (e.g. `HOST-RESULT` measurements),
    /// after the script's output so far.
    pub fn note(&mut self, line: &str) {
        let _ = self.interp.out.error_line(line);
    }

    /// Prints a warning on the error stream (`WARNING: ...`); the session goes on.
    pub fn warn(&mut self, message: &str) {
        let _ = self.interp.out.error_line(&format!("WARNING: {message}"));
    }

    /// Reports a script error found outside the interpreter (e.g. by compiled probes in the
    /// guest): printed like the interpreter's, and the session stops.
    pub fn error(&mut self, message: &str) {
        self.errors += 1;
        let _ = self.interp.out.error_line(&format!("ERROR: {message}"));
    }

    /// The entry-side values of return probe `index`'s `@entry(...)` expressions, evaluated
    /// on `ctx` at the function's entry ([`Interp::entry_values`]).
    pub fn entry_values(
        &mut self,
        index: usize,
        point: &str,
        ctx: &dyn Context,
    ) -> Vec<(usize, Result<Value, String>)> {
        self.interp.entry_values(index, point, ctx)
    }

    /// Fires probe `index` at `point` on `ctx`; returns false after a script error.
    pub fn fire(&mut self, index: usize, point: &str, ctx: &dyn Context) -> bool {
        self.fire_with(index, point, ctx, Vec::new())
    }

    /// [`Session::fire`] with locals the probe starts with (`input.char`'s `char`).
    pub fn fire_with(
        &mut self,
        index: usize,
        point: &str,
        ctx: &dyn Context,
        locals: Vec<(String, Value)>,
    ) -> bool {
        let r = self.interp.run_probe_with(index, point, ctx, locals);
        let _ = self.interp.out.flush();
        match r {
            Ok(()) => true,
            Err(e) => {
                self.report(&e);
                false
            }
        }
    }

    /// Fires procfs probe `index` at `point`: a `.write` probe with `written` in `$value`,
    /// a `.read` probe with `$value` empty. What `$value` holds at the end (for a read, the
    /// file's contents), or `None` after a script error (reported).
    pub fn fire_procfs(
        &mut self,
        index: usize,
        point: &str,
        ctx: &dyn Context,
        written: Option<String>,
    ) -> Option<String> {
        let value = Value::Str(written.unwrap_or_default());
        let locals = vec![(PROCFS_VALUE.to_string(), value)];
        let r = self
            .interp
            .run_probe_keeping(index, point, ctx, locals, Some(PROCFS_VALUE));
        let _ = self.interp.out.flush();
        match r {
            Ok(v) => Some(v.map(|v| v.as_str().to_owned()).unwrap_or_default()),
            Err(e) => {
                self.report(&e);
                None
            }
        }
    }

    /// Answers an access to one of the script's procfs files: a read runs the file's `.read`
    /// probes (the last one's `$value` is the contents, cut to its `.maxsize`), a write its
    /// `.write` probes with the bytes written.
    pub fn answer_procfs(&mut self, request: Request, ctx: &dyn Context) {
        let prog = self.interp.prog;
        let reading = request.op == Op::Read;
        let mut answer = Err(format!(
            "the script has no such procfs file {}",
            request.name
        ));
        for (index, p) in prog.probes.iter().enumerate() {
            for (pt, kind) in &p.points {
                let PointKind::Procfs {
                    name,
                    write,
                    maxsize,
                    ..
                } = kind
                else {
                    continue;
                };
                if *name != request.name || *write == reading {
                    continue;
                }
                let written = match &request.op {
                    Op::Write(w) => Some(w.clone()),
                    Op::Read => None,
                };
                answer = match self.fire_procfs(index, &pt.to_string(), ctx, written) {
                    Some(mut value) if reading => {
                        if let Some(max) = maxsize.map(|m| m as usize) {
                            if value.len() > max {
                                let mut cut = max;
                                while !value.is_char_boundary(cut) {
                                    cut -= 1;
                                }
                                tracing::warn!(
                                    "procfs(\"{name}\").read: {} bytes cut to its maxsize {max}",
                                    value.len()
                                );
                                value.truncate(cut);
                            }
                        }
                        Ok(value)
                    }
                    Some(_) => Ok(String::new()),
                    None => Err(format!("the probe on procfs file {name} failed")),
                };
            }
        }
        request.answer(answer);
    }

    /// Runs the begin probes in order, until `exit()` or an error.
    pub fn begin(&mut self) {
        let host = self.host.take();
        let default;
        let ctx: &dyn Context = match &host {
            Some(h) => h.as_ref(),
            None => {
                default = host_context();
                &default
            }
        };
        for (_, i, pt) in self.points(|k| {
            if let PointKind::Begin(n) = k {
                Some(*n)
            } else {
                None
            }
        }) {
            if self.stopping() {
                break;
            }
            self.fire(i, &pt, ctx);
        }
        self.host = host;
    }

    /// Makes `gettimeofday_*()` read the target's clock: the host's plus `ns`
    /// ([`Interp::clock_offset_ns`]).
    pub fn set_clock_offset(&mut self, ns: i64) {
        self.interp.clock_offset_ns = ns;
    }

    /// Makes the offset of [`Session::set_clock_offset`] fall by what `drift` answers at
    /// each read ([`Interp::clock_drift`]).
    pub fn set_clock_drift(&mut self, drift: crate::eval::ClockDrift) {
        self.interp.clock_drift = Some(drift);
    }

    /// Names kernel addresses for every probe, `end` included ([`Interp::kernel_symbols`]).
    pub fn set_kernel_symbols(&mut self, symbols: crate::eval::KernelSymbols) {
        self.interp.kernel_symbols = Some(symbols);
    }

    /// Ends the session: end probes (or error probes after errors), then the display of
    /// write-only globals. Returns the exit code: 0, or 1 after errors, or
    /// [`OUTPUT_CLOSED_EXIT`] when the output's reader went away (then nothing more runs:
    /// what it would print has nowhere to go).
    pub fn finish(self) -> i32 {
        self.finish_with(None)
    }

    /// [`Session::finish`] with the end (and error) probes in `ctx` where given: a live
    /// backend's, with the guest stopped and its memory readable.
    pub fn finish_with(mut self, with: Option<&dyn Context>) -> i32 {
        if self.interp.out.closed() {
            let _ = self.interp.out.flush();
            return OUTPUT_CLOSED_EXIT;
        }
        let host = self.host.take();
        let default;
        let ctx: &dyn Context = match (with, &host) {
            (Some(c), _) => c,
            (None, Some(h)) => h.as_ref(),
            (None, None) => {
                default = host_context();
                &default
            }
        };
        let failed = self.errors > 0;
        let pick: fn(&PointKind) -> Option<i64> = if failed {
            |k| {
                if let PointKind::Error(n) = k {
                    Some(*n)
                } else {
                    None
                }
            }
        } else {
            |k| {
                if let PointKind::End(n) = k {
                    Some(*n)
                } else {
                    None
                }
            }
        };
        for (_, i, pt) in self.points(pick) {
            self.fire(i, &pt, ctx);
        }
        if self.interp.out.closed() {
            return OUTPUT_CLOSED_EXIT;
        }
        if !failed && self.errors == 0 {
            if let Err(e) = self.display_globals() {
                if self.interp.out.closed() {
                    return OUTPUT_CLOSED_EXIT;
                }
                let _ = self
                    .interp
                    .out
                    .error_line(&format!("ERROR: output failed: {e}"));
                self.errors += 1;
            }
        }
        if self.errors > 0 {
            let _ = self
                .interp
                .out
                .error_line(&format!("WARNING: Number of errors: {}", self.errors));
        }
        let _ = self.interp.out.flush();
        i32::from(self.errors > 0)
    }

    /// Prints globals that were written but never read, as SystemTap does at exit.
    fn display_globals(&mut self) -> std::io::Result<()> {
        let prog = self.interp.prog;
        let json = self.interp.out.format() == Format::Json;
        for (name, _) in prog.displayed_globals() {
            let Some(store) = self.interp.globals.get(name).cloned() else {
                continue;
            };
            match store {
                Store::Scalar(v) => {
                    if json {
                        self.interp.out.global("map", name, value_json(&v))?;
                    } else {
                        self.interp.out.text(&format!("{name}={}\n", quoted(&v)))?;
                    }
                }
                Store::Stats(s) => {
                    if json {
                        self.interp.out.global("stats", name, stats_json(&s))?;
                    } else {
                        self.interp
                            .out
                            .text(&format!("{name}{}\n", stats_text(&s)))?;
                    }
                }
                Store::Array(m) => {
                    let mut rows: Vec<_> = m.into_iter().collect();
                    sort_rows(
                        &mut rows,
                        Sort {
                            key: SortKey::Value,
                            descending: true,
                            stat: None,
                        },
                    );
                    if json {
                        let mut obj = serde_json::Map::new();
                        for (k, v) in &rows {
                            obj.insert(key_json(k), value_json(v));
                        }
                        self.interp.out.global("map", name, Json::Object(obj))?;
                    } else {
                        for (k, v) in &rows {
                            self.interp.out.text(&format!(
                                "{name}[{}]={}\n",
                                key_text(k),
                                quoted(v)
                            ))?;
                        }
                    }
                }
                Store::StatsArray(m) => {
                    let mut rows: Vec<(Vec<Value>, Value, Stats)> = m
                        .into_iter()
                        .map(|(k, s)| {
                            (
                                k,
                                Value::Long(stat_value(&s, StatOp::Count).unwrap_or(0)),
                                s,
                            )
                        })
                        .collect();
                    rows.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                    if json {
                        let mut obj = serde_json::Map::new();
                        for (k, _, s) in &rows {
                            obj.insert(key_json(k), stats_json(s));
                        }
                        self.interp.out.global("stats", name, Json::Object(obj))?;
                    } else {
                        for (k, _, s) in &rows {
                            self.interp.out.text(&format!(
                                "{name}[{}]{}\n",
                                key_text(k),
                                stats_text(s)
                            ))?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

fn quoted(v: &Value) -> String {
    match v {
        Value::Long(n) => n.to_string(),
        Value::Str(s) => format!("\"{}\"", escape(s)),
    }
}

fn key_text(k: &[Value]) -> String {
    k.iter().map(quoted).collect::<Vec<_>>().join(",")
}

fn key_json(k: &[Value]) -> String {
    k.iter().map(Value::to_string).collect::<Vec<_>>().join(",")
}

fn value_json(v: &Value) -> Json {
    match v {
        Value::Long(n) => json!(n),
        Value::Str(s) => json!(s),
    }
}

fn stats_text(s: &Stats) -> String {
    if s.count == 0 {
        return " @count=0".to_string();
    }
    format!(
        " @count={} @min={} @max={} @sum={} @avg={}",
        s.count,
        s.min,
        s.max,
        s.sum,
        s.avg().unwrap_or(0)
    )
}

fn stats_json(s: &Stats) -> Json {
    if s.count == 0 {
        return json!({"count": 0});
    }
    json!({"count": s.count, "min": s.min, "max": s.max, "sum": s.sum, "avg": s.avg().unwrap_or(0)})
}

/// The context of probes that fire on the host (`begin`, `end`, `error`, timers): the exotap
/// process itself, as SystemTap's run in its own user-space driver.
/// The timer probes of `prog` as (probe, point, period, first firing), counted from `start`.
pub fn host_timers(prog: &Program, start: Instant) -> Vec<(usize, String, Duration, Instant)> {
    let mut timers = Vec::new();
    for (i, p) in prog.probes.iter().enumerate() {
        for (pt, kind) in &p.points {
            if let PointKind::Timer { period_ns } = kind {
                let period = Duration::from_nanos(*period_ns);
                timers.push((i, pt.to_string(), period, start + period));
            }
        }
    }
    timers
}

/// The procfs files `prog`'s probes read and write, each once.
pub fn procfs_files(prog: &Program) -> Vec<FileSpec> {
    let mut files: Vec<FileSpec> = Vec::new();
    for p in &prog.probes {
        for (_, kind) in &p.points {
            let PointKind::Procfs {
                name, write, umask, ..
            } = kind
            else {
                continue;
            };
            let i = files
                .iter()
                .position(|f| &f.name == name)
                .unwrap_or_else(|| {
                    files.push(FileSpec {
                        name: name.clone(),
                        readable: false,
                        writable: false,
                        mode: 0o600,
                    });
                    files.len() - 1
                });
            let f = &mut files[i];
            if *write {
                f.writable = true;
            } else {
                f.readable = true;
            }
            // stap's `.umask(M)` takes bits from 0666 (0444 for a file only read); without
            // one the file is its user's alone.
            if let Some(m) = umask {
                f.mode = 0o666 & !m;
            }
        }
    }
    for f in &mut files {
        if !f.writable {
            f.mode &= 0o444;
        }
        if !f.readable {
            f.mode &= 0o222;
        }
    }
    files
}

/// Serves `prog`'s procfs files where its invocation said (`None` when it has none), and
/// says where on stderr.
///
/// # Errors
/// A FIFO or the HTTP address cannot be made ready.
pub fn serve_procfs(prog: &Program) -> Result<Option<Server>, RuntimeError> {
    let files = procfs_files(prog);
    if files.is_empty() {
        if prog.host_files.http.is_some() {
            tracing::warn!("--http: the script has no procfs probe, nothing to serve");
        }
        return Ok(None);
    }
    let server = Server::start(files, &prog.host_files)
        .map_err(|e| RuntimeError::HostFiles(format!("{e:#}")))?;
    tracing::info!("{}", server.describe());
    Ok(Some(server))
}

/// The context host-run probes (begin, end, timers) see.
pub fn host_context() -> CapturedContext {
    let pid = i64::from(std::process::id());
    CapturedContext {
        pid,
        tid: pid,
        execname: "exotap".to_string(),
        ..Default::default()
    }
}

/// Runs a script that needs no guest: begin probes, timers on the wall clock and
/// `input.char`/`input.line` probes on exotap's standard input until `exit()`, an error or
/// `stop` (Ctrl-C), then end probes. A script without timers ends after begin, or, with input
/// probes, at the end of its input.
///
/// # Errors
/// [`RuntimeError::NeedsGuest`] when the script has kernel probe points.
pub fn run_guest_free(
    prog: &Program,
    limits: Limits,
    out: Output,
    file: &str,
    source: &str,
    stop: &Arc<AtomicBool>,
) -> Result<i32, RuntimeError> {
    let stdin = || Box::new(std::io::stdin()) as Box<dyn Read + Send>;
    run_guest_free_with_input(prog, limits, out, file, source, stop, stdin)
}

/// The input probes of `prog`: (probe, point, line rather than byte).
fn input_probes(prog: &Program) -> Vec<(usize, String, bool)> {
    let mut probes = Vec::new();
    for (i, p) in prog.probes.iter().enumerate() {
        for (pt, k) in &p.points {
            match k {
                PointKind::InputChar => probes.push((i, pt.to_string(), false)),
                PointKind::InputLine => probes.push((i, pt.to_string(), true)),
                _ => {}
            }
        }
    }
    probes
}

/// Reads `input` on a thread of its own, a chunk per message; the channel closes at its end
/// (or on a read error). The thread stays blocked in its read if the session ends first.
fn read_input(mut input: Box<dyn Read + Send>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        loop {
            match input.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

/// [`run_guest_free`] with the input probes reading what `input` makes (called only when
/// the script has input probes).
///
/// # Errors
/// [`RuntimeError::NeedsGuest`] when the script has kernel probe points.
pub fn run_guest_free_with_input(
    prog: &Program,
    limits: Limits,
    out: Output,
    file: &str,
    source: &str,
    stop: &Arc<AtomicBool>,
    input: impl FnOnce() -> Box<dyn Read + Send>,
) -> Result<i32, RuntimeError> {
    let kernel: Vec<String> = prog
        .probes
        .iter()
        .flat_map(|p| p.points.iter())
        .filter(|(_, k)| k.needs_guest())
        .map(|(pt, _)| pt.to_string())
        .collect();
    if !kernel.is_empty() {
        return Err(RuntimeError::NeedsGuest {
            points: kernel.join(", "),
        });
    }
    let mut session = Session::new(prog, limits, out, file, source);
    session.begin();
    let mut timers = host_timers(prog, Instant::now());
    let ctx = host_context();
    let inputs = input_probes(prog);
    let mut reader = if inputs.is_empty() || session.stopping() || stop.load(Ordering::SeqCst) {
        None
    } else {
        Some(read_input(input()))
    };
    // `input.line`: the bytes of the line read so far.
    let mut line: Vec<u8> = Vec::new();
    // procfs files keep the session running until Ctrl-C or exit(), as in stap.
    let files = if session.stopping() {
        None
    } else {
        serve_procfs(prog)?
    };
    while (!timers.is_empty() || reader.is_some() || files.is_some())
        && !session.stopping()
        && !stop.load(Ordering::SeqCst)
    {
        if let Some(request) = files.as_ref().and_then(|f| f.next(Duration::ZERO)) {
            session.answer_procfs(request, &ctx);
            continue;
        }
        let now = Instant::now();
        let next = (0..timers.len()).min_by_key(|&t| timers[t].3);
        let due = next.map(|t| timers[t].3);
        if due.is_none_or(|d| d > now) {
            // Sleep (or wait for input) in short slices so Ctrl-C is noticed promptly.
            let wait = due
                .map_or(Duration::from_millis(20), |d| d - now)
                .min(Duration::from_millis(20));
            match reader.as_ref().map(|r| r.recv_timeout(wait)) {
                None => std::thread::sleep(wait),
                Some(Err(mpsc::RecvTimeoutError::Timeout)) => {}
                Some(Err(mpsc::RecvTimeoutError::Disconnected)) => {
                    // The end of the input: a last line without its newline still fires.
                    if !line.is_empty() {
                        fire_line(&mut session, &inputs, &ctx, &mut line);
                    }
                    reader = None;
                }
                Some(Ok(chunk)) => {
                    for &b in &chunk {
                        if session.stopping() || stop.load(Ordering::SeqCst) {
                            break;
                        }
                        let char = String::from_utf8_lossy(&[b]).into_owned();
                        for (i, pt, _) in inputs.iter().filter(|(_, _, l)| !l) {
                            let locals = vec![("char".to_string(), Value::Str(char.clone()))];
                            session.fire_with(*i, pt, &ctx, locals);
                        }
                        line.push(b);
                        if b == b'\n' {
                            fire_line(&mut session, &inputs, &ctx, &mut line);
                        }
                    }
                }
            }
            continue;
        }
        let Some(next) = next else {
            continue;
        };
        let due = timers[next].3;
        let (index, point, period, _) = timers[next].clone();
        session.fire(index, &point, &ctx);
        let mut following = due + period;
        let now = Instant::now();
        if following + period < now {
            following = now + period;
        }
        timers[next].3 = following;
    }
    Ok(session.finish())
}

/// Fires the `input.line` probes with `line` (taken).
fn fire_line(
    session: &mut Session<'_>,
    inputs: &[(usize, String, bool)],
    ctx: &dyn Context,
    line: &mut Vec<u8>,
) {
    let text = String::from_utf8_lossy(&std::mem::take(line)).into_owned();
    for (i, pt, _) in inputs.iter().filter(|(_, _, l)| *l) {
        let locals = vec![("line".to_string(), session.interp.string(text.clone()))];
        session.fire_with(*i, pt, ctx, locals);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::check;
    use crate::output::SharedBuf;
    use crate::parser::parse;

    fn program(src: &str) -> Program {
        check(parse(src, &Limits::default()).unwrap()).unwrap()
    }

    fn run(src: &str, stop: bool) -> (String, String, Result<i32, RuntimeError>) {
        let prog = program(src);
        let (out, err) = (SharedBuf::default(), SharedBuf::default());
        let output = Output::new(Format::Text, Box::new(out.clone()), Box::new(err.clone()));
        let stop = Arc::new(AtomicBool::new(stop));
        let r = run_guest_free(&prog, Limits::default(), output, "t.stp", src, &stop);
        (out.contents(), err.contents(), r)
    }

    fn run_on_input(src: &str, input: &'static [u8]) -> (String, String, i32) {
        let prog = program(src);
        let (out, err) = (SharedBuf::default(), SharedBuf::default());
        let output = Output::new(Format::Text, Box::new(out.clone()), Box::new(err.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let input = || Box::new(std::io::Cursor::new(input)) as Box<dyn Read + Send>;
        let code =
            run_guest_free_with_input(&prog, Limits::default(), output, "t.stp", src, &stop, input)
                .unwrap();
        (out.contents(), err.contents(), code)
    }

    #[test]
    fn input_char_fires_per_byte_and_input_line_per_line_then_the_input_ends_the_session() {
        let src = "global n probe input.char { n++; printf(\"[%s]\", char) } \
                   probe input.line { printf(\"<%s>\", line) } \
                   probe end { printf(\"\\n%d\\n\", n) }";
        let (out, err, code) = run_on_input(src, b"ab\nc");
        assert_eq!((err.as_str(), code), ("", 0));
        assert_eq!(out, "[a][b][\n]<ab\n>[c]<c>\n4\n");
    }

    #[test]
    fn exit_in_an_input_probe_stops_reading() {
        let src = "probe input.line { print(line); if (line == \"stop\\n\") exit() }";
        let (out, _, code) = run_on_input(src, b"one\nstop\nnever\n");
        assert_eq!((out.as_str(), code), ("one\nstop\n", 0));
    }

    #[test]
    fn begin_only_script_runs_end_and_exits() {
        let (out, _, code) = run("probe begin { println(1) } probe end { println(2) }", false);
        assert_eq!((out.as_str(), code.unwrap()), ("1\n2\n", 0));
    }

    #[test]
    fn kernel_points_without_a_backend_need_a_guest() {
        let (_, _, r) = run("probe kernel.function(\"vfs_read\") { }", false);
        let msg = r.unwrap_err().to_string();
        assert!(
            msg.contains("need a guest") && msg.contains("vfs_read"),
            "{msg}"
        );
    }

    #[test]
    fn stop_flag_ends_the_timer_loop_and_runs_end() {
        let (out, _, code) = run(
            "probe timer.s(60) { println(\"tick\") } probe end { println(\"end\") }",
            true,
        );
        assert_eq!((out.as_str(), code.unwrap()), ("end\n", 0));
    }

    #[test]
    fn runtime_error_skips_end_and_runs_error_probes() {
        let (out, err, code) =
            run("probe begin { error(\"bad\") } probe end { println(\"end\") } probe error { println(\"err\") }", false);
        assert_eq!((out.as_str(), code.unwrap()), ("err\n", 1));
        assert!(
            err.contains("ERROR: bad near 'error(\"bad\")' at t.stp:1:15"),
            "{err}"
        );
    }

    #[test]
    fn backend_can_fire_kernel_probes_on_captured_records() {
        let src = "global n\nprobe kernel.syscall(\"read\") { n[execname()]++ }";
        let prog = program(src);
        let out = SharedBuf::default();
        let output = Output::new(
            Format::Text,
            Box::new(out.clone()),
            Box::new(std::io::sink()),
        );
        let mut session = Session::new(&prog, Limits::default(), output, "t.stp", src);
        session.begin();
        let ctx = CapturedContext {
            execname: "cat".into(),
            ..Default::default()
        };
        for _ in 0..3 {
            assert!(session.fire(0, "kernel.syscall(\"read\")", &ctx));
        }
        assert_eq!(session.finish(), 0);
        assert_eq!(out.contents(), "n[\"cat\"]=3\n");
    }

    /// A probe context stopped in the guest, with a two-frame kernel stack.
    struct StackedContext(CapturedContext);

    impl Context for StackedContext {
        fn target(&self, path: &str) -> Option<crate::value::Value> {
            self.0.target(path)
        }
        fn pid(&self) -> i64 {
            self.0.pid
        }
        fn tid(&self) -> i64 {
            self.0.tid
        }
        fn ppid(&self) -> i64 {
            self.0.ppid
        }
        fn uid(&self) -> i64 {
            self.0.uid
        }
        fn execname(&self) -> String {
            self.0.execname.clone()
        }
        fn cpu(&self) -> i64 {
            self.0.cpu
        }
        fn probefunc(&self) -> String {
            self.0.probefunc.clone()
        }
        fn read_kernel(
            &self,
            addr: u64,
            len: usize,
        ) -> Result<Vec<u8>, crate::context::MemoryError> {
            self.0.read_kernel(addr, len)
        }
        fn kernel_backtrace(&self) -> Result<Vec<(u64, String)>, crate::context::MemoryError> {
            Ok(vec![
                (0xffff_ffff_8124_ff10, "vfs_read+0x0/0x1c0".into()),
                (0xffff_ffff_8125_0a01, "ksys_read+0x71/0xf0".into()),
            ])
        }
        fn task_backtrace(
            &self,
            task: u64,
        ) -> Result<Vec<(u64, String)>, crate::context::MemoryError> {
            match task {
                0x1000 => Ok(vec![(0xffff_ffff_8100_0010, "schedule+0x10/0x80".into())]),
                _ => Err(crate::context::MemoryError::NoMemory),
            }
        }
        fn pc_name(&self, addr: u64) -> Option<String> {
            (addr == 0xffff_ffff_8124_ff10).then(|| "vfs_read+0x0/0x1c0".into())
        }
    }

    #[test]
    fn stacks_as_map_keys_count_and_print_with_their_symbols() {
        let src = "global s; probe kernel.function(\"vfs_read\") { s[backtrace()]++; \
                   println(task_backtrace(4096)); println(task_backtrace(8)) } \
                   probe end { foreach (k in s) { printf(\"%d\\n\", s[k]); print_stack(k) } \
                   print_stack(\"0xffffffff81250a01 junk\") }";
        let prog = program(src);
        let out = SharedBuf::default();
        let output = Output::new(
            Format::Text,
            Box::new(out.clone()),
            Box::new(std::io::sink()),
        );
        let mut session = Session::new(&prog, Limits::default(), output, "t.stp", src);
        // The session's symbols know one of the two pcs; `end` has no hit context.
        session.set_kernel_symbols(Box::new(|pc| {
            (pc == 0xffff_ffff_8125_0a01).then(|| crate::eval::NamedAddress {
                name: "ksys_read".to_owned(),
                offset: 0x71,
                size: 0xf0,
                module: None,
            })
        }));
        session.begin();
        let ctx = StackedContext(CapturedContext::default());

        assert!(session.fire(0, "kernel.function(\"vfs_read\")", &ctx));
        assert!(session.fire(0, "kernel.function(\"vfs_read\")", &ctx));
        assert_eq!(session.finish(), 0);

        assert_eq!(
            out.contents(),
            "0xffffffff81000010\n\n0xffffffff81000010\n\n\
             2\n \
             0xffffffff8124ff10 : 0xffffffff8124ff10 [kernel]\n \
             0xffffffff81250a01 : ksys_read+0x71/0xf0 [kernel]\n \
             0xffffffff81250a01 : ksys_read+0x71/0xf0 [kernel]\n \
             junk : junk [kernel]\n"
        );
    }

    #[test]
    fn symname_and_symdata_in_end_use_the_sessions_symbols() {
        let src = "probe end { println(symname(0xffffffff81250a01)); \
                   println(symdata(0xffffffff81250a01)); println(symname(16)) }";
        let prog = program(src);
        let out = SharedBuf::default();
        let output = Output::new(
            Format::Text,
            Box::new(out.clone()),
            Box::new(std::io::sink()),
        );
        let mut session = Session::new(&prog, Limits::default(), output, "t.stp", src);
        session.set_kernel_symbols(Box::new(|pc| {
            (0xffff_ffff_8125_0990..0xffff_ffff_8125_0a80)
                .contains(&pc)
                .then(|| crate::eval::NamedAddress {
                    name: "ksys_read".to_owned(),
                    offset: pc - 0xffff_ffff_8125_0990,
                    size: 0xf0,
                    module: None,
                })
        }));
        session.begin();

        assert_eq!(session.finish(), 0);

        assert_eq!(
            out.contents(),
            "ksys_read\nksys_read+0x71/0xf0 [kernel]\n0x10\n"
        );
    }

    #[test]
    fn addresses_in_a_modules_text_name_the_module_where_systemtap_says_kernel() {
        let src = "probe end { println(symname(0xffffffffc000120c)); \
                   println(symdata(0xffffffffc000120c)); \
                   print_stack(\"0xffffffffc000120c 0xffffffff81250a01\") }";
        let prog = program(src);
        let out = SharedBuf::default();
        let output = Output::new(
            Format::Text,
            Box::new(out.clone()),
            Box::new(std::io::sink()),
        );
        let mut session = Session::new(&prog, Limits::default(), output, "t.stp", src);
        session.set_kernel_symbols(Box::new(|pc| {
            let named = |name: &str, base: u64, module: Option<&str>| crate::eval::NamedAddress {
                name: name.to_owned(),
                offset: pc - base,
                size: 0x2b0,
                module: module.map(str::to_owned),
            };
            match pc {
                0xffff_ffff_c000_1000..0xffff_ffff_c000_12b0 => {
                    Some(named("evdev_read", 0xffff_ffff_c000_1000, Some("evdev")))
                }
                0xffff_ffff_8125_0990..0xffff_ffff_8125_0c40 => {
                    Some(named("ksys_read", 0xffff_ffff_8125_0990, None))
                }
                _ => None,
            }
        }));
        session.begin();

        assert_eq!(session.finish(), 0);

        assert_eq!(
            out.contents(),
            "evdev_read\nevdev_read+0x20c/0x2b0 [evdev]\n \
             0xffffffffc000120c : evdev_read+0x20c/0x2b0 [evdev]\n \
             0xffffffff81250a01 : ksys_read+0x71/0x2b0 [kernel]\n"
        );
    }

    #[test]
    fn backtrace_builtins_print_the_contexts_stack_as_systemtap_does() {
        let src = "probe kernel.function(\"vfs_read\") { print_backtrace(); println(backtrace()); \
                   println(strlen(sprint_backtrace())) }";
        let prog = program(src);
        let out = SharedBuf::default();
        let output = Output::new(
            Format::Text,
            Box::new(out.clone()),
            Box::new(std::io::sink()),
        );
        let mut session = Session::new(&prog, Limits::default(), output, "t.stp", src);
        session.begin();
        let ctx = StackedContext(CapturedContext::default());

        assert!(session.fire(0, "kernel.function(\"vfs_read\")", &ctx));
        assert_eq!(session.finish(), 0);

        assert_eq!(
            out.contents(),
            " 0xffffffff8124ff10 : vfs_read+0x0/0x1c0 [kernel]\n \
             0xffffffff81250a01 : ksys_read+0x71/0xf0 [kernel]\n\
             0xffffffff8124ff10 0xffffffff81250a01\n\
             100\n"
        );
    }

    #[test]
    fn backtrace_of_a_context_without_a_stack_is_empty() {
        let src = "probe begin { printf(\"[%s]\\n\", backtrace()); print_backtrace() }";

        let (out, _err, code) = run(src, false);

        assert_eq!((out.as_str(), code.unwrap()), ("[]\n", 0));
    }

    /// A pipe whose reader goes away after `room` bytes: later writes fail with
    /// `BrokenPipe`, as `write(2)` does once `head` has exited.
    struct ClosingPipe {
        room: usize,
        kept: SharedBuf,
        writes_after_close: std::rc::Rc<std::cell::Cell<usize>>,
    }

    impl std::io::Write for ClosingPipe {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                self.writes_after_close
                    .set(self.writes_after_close.get() + 1);
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            self.kept.write(&buf[..n])
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn run_into_closing_pipe(src: &str, room: usize) -> (String, String, usize, i32) {
        let prog = program(src);
        let (kept, err) = (SharedBuf::default(), SharedBuf::default());
        let attempts = std::rc::Rc::new(std::cell::Cell::new(0));
        let pipe = ClosingPipe {
            room,
            kept: kept.clone(),
            writes_after_close: attempts.clone(),
        };
        let output = Output::new(Format::Text, Box::new(pipe), Box::new(err.clone()));
        let stop = Arc::new(AtomicBool::new(false));
        let code = run_guest_free(&prog, Limits::default(), output, "t.stp", src, &stop).unwrap();
        (kept.contents(), err.contents(), attempts.get(), code)
    }

    #[test]
    fn a_closed_output_pipe_stops_the_session_quietly_with_141() {
        let src = "probe begin { for (i = 0; i < 100; i++) println(i) }\n\
                   probe end { println(\"end\") }";

        let (kept, err, attempts, code) = run_into_closing_pipe(src, 4);

        assert_eq!(code, OUTPUT_CLOSED_EXIT);
        assert_eq!(kept, "0\n1\n");
        assert_eq!(err, "", "a closed pipe is not a script error");
        assert_eq!(
            attempts, 1,
            "nothing more is written once the reader is gone"
        );
    }

    #[test]
    fn try_does_not_catch_a_closed_output_and_timers_stop() {
        let src =
            "probe begin { try { println(\"a\") println(\"b\") } catch { println(\"c\") } }\n\
                   probe timer.ms(1) { println(\"tick\") }\n\
                   probe end { println(\"end\") }";

        let (kept, err, attempts, code) = run_into_closing_pipe(src, 2);

        assert_eq!((kept.as_str(), err.as_str()), ("a\n", ""));
        assert_eq!((attempts, code), (1, OUTPUT_CLOSED_EXIT));
    }

    #[test]
    fn other_output_failures_stay_script_errors() {
        let src = "probe begin { println(1) } probe error { }";
        let prog = program(src);
        let err = SharedBuf::default();
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full");
        let Ok(full) = full else {
            eprintln!("SKIP: this host has no /dev/full to fill");
            return;
        };
        let output = Output::new(Format::Text, Box::new(full), Box::new(err.clone()));
        let stop = Arc::new(AtomicBool::new(false));

        let code = run_guest_free(&prog, Limits::default(), output, "t.stp", src, &stop).unwrap();

        assert_eq!(code, 1);
        assert!(err
            .contents()
            .contains("ERROR: output failed: No space left on device"));
    }
}
