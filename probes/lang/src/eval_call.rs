//! Built-in functions at run time: printing, strings, context, guest memory.

use std::time::{SystemTime, UNIX_EPOCH};

use super::ast::*;
use super::context::Context;
use super::eval::{fail, output_failed, EResult, Frame, Interp};
use super::format::{escape, parse_format, render};
use super::hist::Histogram;
use super::native;
use super::value::{Stats, Value};

impl Interp<'_> {
    /// The kernel symbol covering `addr`: the probe's context's, else the session's
    /// ([`Interp::kernel_symbols`], e.g. in `end`).
    fn kernel_symbol(
        &self,
        ctx: &dyn Context,
        addr: u64,
    ) -> Result<Option<super::eval::NamedAddress>, super::context::MemoryError> {
        ctx.kernel_symbol(addr)
            .or_else(|e| match &self.kernel_symbols {
                Some(f) => Ok(f(addr)),
                None => Err(e),
            })
    }

    fn args(&mut self, c: &Call, f: &mut Frame, ctx: &dyn Context) -> EResult<Vec<Value>> {
        c.args.iter().map(|a| self.eval(a, f, ctx)).collect()
    }

    fn emit_text(&mut self, s: &str, span: Span) -> EResult<()> {
        match self.out.text(s) {
            Ok(()) => Ok(()),
            Err(e) => output_failed(&e, span),
        }
    }

    /// Prints the histogram of `target`, or returns its text when `to_string`.
    fn print_hist(
        &mut self,
        kind: HistKind,
        target: &Expr,
        span: Span,
        f: &mut Frame,
        ctx: &dyn Context,
        to_string: bool,
    ) -> EResult<Option<String>> {
        let Some(stats) = self.stats_of(target, f, ctx)? else {
            return fail("empty aggregate", span);
        };
        if stats.count == 0 {
            return fail("empty aggregate", span);
        }
        let name = match &target.kind {
            ExprKind::Var(n) => n.clone(),
            ExprKind::Index(ix) => {
                let keys = self.keys(&ix.keys, f, ctx)?;
                let keys: Vec<String> = keys.iter().map(Value::to_string).collect();
                format!("{}[{}]", ix.array.name, keys.join(","))
            }
            _ => String::new(),
        };
        let buckets: &[u64] = match (&kind, &stats) {
            (HistKind::Log, Stats { log, .. }) => log,
            (
                HistKind::Linear { .. },
                Stats {
                    linear: Some((_, b)),
                    ..
                },
            ) => b,
            _ => &[],
        };
        let hist = Histogram { kind, buckets };
        if to_string {
            return Ok(Some(hist.render()));
        }
        let result = self.out.hist(&name, &hist).map(|()| None);
        result.or_else(|e| output_failed(&e, span))
    }

    pub(crate) fn builtin(
        &mut self,
        c: &Call,
        span: Span,
        f: &mut Frame,
        ctx: &dyn Context,
    ) -> EResult<Value> {
        let name = c.name.name.as_str();
        let unit = Value::Long(0);
        match name {
            "print" | "println" | "sprint" | "sprintln" => {
                if let [Expr {
                    kind: ExprKind::Hist(kind, target),
                    span: hspan,
                }] = c.args.as_slice()
                {
                    let to_string = name.starts_with('s');
                    let text = self.print_hist(*kind, target, *hspan, f, ctx, to_string)?;
                    let newline = if name.ends_with("ln") { "\n" } else { "" };
                    if let Some(text) = text {
                        return Ok(self.string(format!("{text}{newline}")));
                    }
                    self.emit_text(newline, span)?;
                    return Ok(unit);
                }
                let mut s = String::new();
                for v in self.args(c, f, ctx)? {
                    s.push_str(&v.to_string());
                }
                if name.ends_with("ln") {
                    s.push('\n');
                }
                if name.starts_with('s') {
                    return Ok(self.string(s));
                }
                self.emit_text(&s, span)?;
                return Ok(unit);
            }
            "printd" | "printdln" => {
                let args = self.args(c, f, ctx)?;
                let delim = args
                    .first()
                    .map(|d| d.as_str().to_string())
                    .unwrap_or_default();
                let parts: Vec<String> = args.iter().skip(1).map(Value::to_string).collect();
                let mut s = parts.join(&delim);
                if name == "printdln" {
                    s.push('\n');
                }
                self.emit_text(&s, span)?;
                return Ok(unit);
            }
            "printf" | "sprintf" => {
                let args = self.args(c, f, ctx)?;
                let fmt = args
                    .first()
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default();
                let pieces = match parse_format(&fmt) {
                    Ok(p) => p,
                    Err(e) => return fail(format!("bad format: {e}"), span),
                };
                let s = render(&pieces, args.get(1..).unwrap_or_default());
                if name == "sprintf" {
                    return Ok(self.string(s));
                }
                self.emit_text(&s, span)?;
                return Ok(unit);
            }
            _ => {}
        }
        let args = self.args(c, f, ctx)?;
        let long = |i: usize| args.get(i).map_or(0, Value::as_long);
        let text = |i: usize| args.get(i).map_or("", Value::as_str);
        let drift = self.clock_drift.as_ref().map_or(0, |d| d());
        let offset = i128::from(self.clock_offset_ns) - i128::from(drift);
        let now = || {
            let host = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos();
            let ns = i128::try_from(host)
                .unwrap_or(i128::MAX)
                .saturating_add(offset);
            std::time::Duration::from_nanos(u64::try_from(ns.max(0)).unwrap_or(u64::MAX))
        };
        let v = match name {
            "set_return" => {
                if let Err(why) = ctx.write_target("$return", long(0)) {
                    return fail(why, span);
                }
                unit
            }
            "exit" => {
                self.exit_requested = true;
                unit
            }
            "error" => return self.raise(text(0).to_string(), span),
            "warn" => {
                let line = format!("WARNING: {}", text(0));
                match self.out.error_line(&line) {
                    Ok(()) => {}
                    Err(e) if self.out.closed() => return output_failed(&e, span),
                    // The error stream's reader is gone: nobody is left to tell.
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                    Err(e) => return output_failed(&e, span),
                }
                unit
            }
            "log" => {
                let s = format!("{}\n", text(0));
                self.emit_text(&s, span)?;
                unit
            }
            // As SystemTap's: no stack (a probe that did not stop the guest) is empty.
            "backtrace" => {
                let frames = ctx.kernel_backtrace().unwrap_or_default();
                let pcs: Vec<String> = frames.iter().map(|(pc, _)| format!("{pc:#x}")).collect();
                self.string(pcs.join(" "))
            }
            "task_backtrace" => {
                let frames = ctx.task_backtrace(long(0) as u64).unwrap_or_default();
                let pcs: Vec<String> = frames.iter().map(|(pc, _)| format!("{pc:#x}")).collect();
                self.string(pcs.join(" "))
            }
            "sprint_stack" => self.string(stack_lines(ctx, self.kernel_symbols.as_ref(), text(0))),
            "print_stack" => {
                let lines = stack_lines(ctx, self.kernel_symbols.as_ref(), text(0));
                if !lines.is_empty() {
                    self.emit_text(&format!("{lines}\n"), span)?;
                }
                unit
            }
            "sprint_backtrace" => self.string(backtrace_lines(ctx)),
            "print_backtrace" => {
                let lines = backtrace_lines(ctx);
                if !lines.is_empty() {
                    self.emit_text(&format!("{lines}\n"), span)?;
                }
                unit
            }
            "strlen" => Value::Long(text(0).len() as i64),
            "substr" => {
                let s = text(0).as_bytes();
                let (start, len) = (long(1), long(2));
                if start < 0 || len <= 0 || start as u64 >= s.len() as u64 {
                    Value::Str(String::new())
                } else {
                    let start = start as usize;
                    let end = start.saturating_add(len as usize).min(s.len());
                    self.string(String::from_utf8_lossy(&s[start..end]).into_owned())
                }
            }
            "isinstr" => Value::Long(i64::from(text(0).contains(text(1)))),
            "strpos" => Value::Long(text(0).find(text(1)).map_or(-1, |p| p as i64)),
            "stringat" => match text(0)
                .as_bytes()
                .get(usize::try_from(long(1)).unwrap_or(usize::MAX))
            {
                Some(b) => Value::Long(i64::from(*b)),
                None => return fail("string index out of range", span),
            },
            "strtol" => Value::Long(strtol(text(0), long(1)).or_else(|m| fail(m, span))?),
            "str_replace" => {
                if text(1).is_empty() {
                    self.string(text(0).to_string())
                } else {
                    self.string(text(0).replace(text(1), text(2)))
                }
            }
            "text_str" => self.string(escape(text(0))),
            "string_quoted" => self.string(format!("\"{}\"", escape(text(0)))),
            "isdigit" => Value::Long(i64::from(
                text(0).bytes().next().is_some_and(|b| b.is_ascii_digit()),
            )),
            "str_upper" => self.string(text(0).to_ascii_uppercase()),
            "str_lower" => self.string(text(0).to_ascii_lowercase()),
            "abs" => Value::Long(long(0).wrapping_abs()),
            "min" => Value::Long(long(0).min(long(1))),
            "max" => Value::Long(long(0).max(long(1))),
            "randint" => {
                let n = long(0);
                if n <= 0 {
                    return fail("randint needs a positive bound", span);
                }
                // xorshift64*: good enough for sampling decisions, no dependency.
                self.rng ^= self.rng >> 12;
                self.rng ^= self.rng << 25;
                self.rng ^= self.rng >> 27;
                let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
                Value::Long((r % n as u64) as i64)
            }
            "pid" => Value::Long(ctx.pid()),
            "tid" => Value::Long(ctx.tid()),
            "ppid" => Value::Long(ctx.ppid()),
            "uid" => Value::Long(ctx.uid()),
            "cpu" => Value::Long(ctx.cpu()),
            "execname" => self.string(ctx.execname()),
            "probefunc" | "ppfunc" => self.string(ctx.probefunc()),
            "pp" => self.string(self.point.clone()),
            "target" => Value::Long(self.prog.target_pid),
            "gettimeofday_s" => Value::Long(now().as_secs() as i64),
            "gettimeofday_ms" => Value::Long(now().as_millis() as i64),
            "gettimeofday_us" => Value::Long(now().as_micros() as i64),
            "gettimeofday_ns" => Value::Long(now().as_nanos() as i64),
            "kernel_string" | "kernel_string_n" | "user_string" | "user_string_n" => {
                // At most MAXSTRINGLEN - 1 bytes (or n, when smaller), read byte by byte up to
                // the first NUL: the bytes past the string are never touched.
                let most = self.limits.max_string_len.saturating_sub(1);
                let most = if name.ends_with("_n") {
                    usize::try_from(long(1).max(0))
                        .unwrap_or(usize::MAX)
                        .min(most)
                } else {
                    most
                };
                let what = if name.starts_with("user") {
                    "user"
                } else {
                    "kernel"
                };
                // The overloads with a fallback string answer it for an unreadable address.
                let fallback = if name.ends_with("_n") {
                    args.get(2)
                } else {
                    args.get(1)
                };
                let mut bytes = Vec::new();
                let base = long(0) as u64;
                while bytes.len() < most {
                    let addr = base.wrapping_add(bytes.len() as u64);
                    match ctx.read_kernel(addr, 1) {
                        Ok(b) if b.first() == Some(&0) => break,
                        Ok(b) => bytes.extend_from_slice(&b),
                        Err(_) if fallback.is_some() => {
                            let text = fallback.map(|v| v.as_str().to_string());
                            return Ok(self.string(text.unwrap_or_default()));
                        }
                        Err(e) => return fail(format!("{what} string copy fault: {e}"), span),
                    }
                }
                self.string(String::from_utf8_lossy(&bytes).into_owned())
            }
            "kernel_long" | "kernel_int" | "kernel_short" | "kernel_char" | "user_char"
            | "user_short" | "user_ushort" | "user_int" | "user_uint" | "user_long" => {
                let (len, signed, user) = native::memory_read(name).unwrap_or((8, true, false));
                let len = usize::from(len);
                let bytes = match ctx.read_kernel(long(0) as u64, len) {
                    Ok(b) if b.len() == len => b,
                    Ok(_) => return fail("short guest memory read", span),
                    Err(e) if user => return fail(format!("user read fault: {e}"), span),
                    Err(e) => return fail(format!("kernel read fault: {e}"), span),
                };
                let mut buf = [0u8; 8];
                buf[..len].copy_from_slice(&bytes);
                let v = i64::from_le_bytes(buf);
                Value::Long(match (len, signed) {
                    (4, true) => i64::from(v as i32),
                    (2, true) => i64::from(v as i16),
                    (1, true) => i64::from(v as i8),
                    _ => v,
                })
            }
            "ctime" if args.is_empty() => self.string(native::ctime(now().as_secs() as i64)),
            "ctime" | "tz_ctime" => self.string(native::ctime(long(0))),
            "ansi_set_color" => {
                let codes: Vec<String> = match args.len() {
                    1 => vec![long(0).to_string()],
                    2 => vec![long(1).to_string(), long(0).to_string()],
                    _ => vec![
                        long(1).to_string(),
                        long(0).to_string(),
                        long(2).to_string(),
                    ],
                };
                self.emit_text(&format!("\x1b[{}m", codes.join(";")), span)?;
                unit
            }
            "errno_str" => self.string(native::errno_str(long(0))),
            "return_str" => self.string(native::return_str(long(0), long(1))),
            "signal_str" => self.string(native::signal_str(long(0))),
            "syscall_name" => self.string(native::syscall_name(long(0))),
            "_sys_open_flag_str" => self.string(native::open_flags(long(0))),
            // The guest's cycle counter is not the host's: host-evaluated probes answer
            // the host's monotonic clock, in nanoseconds, which orders and times events alike.
            "get_cycles" | "local_clock_ns" | "cpu_clock_ns" => {
                Value::Long(self.started.elapsed().as_nanos() as i64)
            }
            "local_clock_us" | "cpu_clock_us" => {
                Value::Long(self.started.elapsed().as_micros() as i64)
            }
            "pn" => self.string(self.point.clone()),
            "returnval" => match ctx.target("$return") {
                Some(v) => v,
                None => {
                    return fail(
                        "returnval(): no return value here (not a .return probe)",
                        span,
                    )
                }
            },
            "system" => {
                // As SystemTap: the command runs on the host, its output goes to the host's.
                let status = std::process::Command::new("/bin/sh")
                    .arg("-c")
                    .arg(text(0))
                    .status();
                if let Err(e) = status {
                    return fail(format!("system: cannot run /bin/sh: {e}"), span);
                }
                unit
            }
            "int_arg" | "uint_arg" | "long_arg" | "ulong_arg" | "pointer_arg" => {
                let Some(raw) = ctx.arg_register(long(0)) else {
                    return fail(
                        format!(
                            "{name}({}): no such argument register here (arguments 1 to 6 of \
                             a kernel probe that stopped the guest)",
                            long(0)
                        ),
                        span,
                    );
                };
                Value::Long(match name {
                    "int_arg" => i64::from(raw as u32 as i32),
                    "uint_arg" => i64::from(raw as u32),
                    _ => raw as i64,
                })
            }
            // As SystemTap where it finds no line for the address: the address in hex.
            // Probes do not look up the -dbg vmlinux's line tables (yet), so that is always
            // the answer; scripts test for it (`strtol(fileline, 16)`, periodic.stp).
            "symfileline" => self.string(format!("{:#x}", long(0) as u64)),
            "symname" | "symdata" => {
                let addr = long(0) as u64;
                match self.kernel_symbol(ctx, addr) {
                    Ok(Some(named)) if name == "symname" => self.string(named.name),
                    Ok(Some(named)) => self.string(named.systemtap()),
                    // As SystemTap: an address no symbol covers prints as itself.
                    Ok(None) => self.string(format!("{addr:#x}")),
                    Err(_) => return fail(no_symbols(name), span),
                }
            }
            "print_syms" => {
                let mut lines = String::new();
                for word in text(0).split_whitespace() {
                    let Some(addr) = word
                        .strip_prefix("0x")
                        .and_then(|h| u64::from_str_radix(h, 16).ok())
                    else {
                        return fail(format!("print_syms: '{word}' is not an address"), span);
                    };
                    match self.kernel_symbol(ctx, addr) {
                        Ok(Some(named)) => {
                            lines.push_str(&format!(" {addr:#018x} : {}\n", named.systemtap()));
                        }
                        Ok(None) => lines.push_str(&format!(" {addr:#018x}\n")),
                        Err(_) => return fail(no_symbols(name), span),
                    }
                }
                self.emit_text(&lines, span)?;
                unit
            }
            "task_current" => {
                match ctx.task_current() {
                    Some(task) => Value::Long(task as i64),
                    None => return fail(
                        "task_current() has no task here: only a kernel probe that stopped the \
                         guest has one",
                        span,
                    ),
                }
            }
            "jiffies" if ctx.jiffies().is_some() => match ctx.jiffies() {
                Some(Ok(j)) => Value::Long(j),
                Some(Err(why)) => return fail(format!("jiffies(): {why}"), span),
                None => unit,
            },
            // SystemTap's `@const("current->utime")`: the task's own counter, nanoseconds
            // since Linux 4.11 (cputime_t went away), as SystemTap returns it there.
            "task_utime" | "task_stime" if args.is_empty() => {
                let Some(task) = ctx.task_current() else {
                    return fail(
                        format!(
                            "{name}() has no task here: only a kernel probe that stopped the \
                             guest has one"
                        ),
                        span,
                    );
                };
                let cast = CastExpr {
                    pointer: Expr {
                        kind: ExprKind::Num(task as i64),
                        span,
                    },
                    type_name: "struct task_struct".into(),
                    module: None,
                    members: vec![name.trim_start_matches("task_").to_owned()],
                    indexes: Vec::new(),
                    like: None,
                };
                match ctx.cast(task, &cast, &[]) {
                    Some(Ok(v)) => v,
                    Some(Err(why)) => return fail(format!("{name}(): {why}"), span),
                    None => {
                        return fail(
                            format!("{name}() needs the kernel's types (BTF), absent here"),
                            span,
                        )
                    }
                }
            }
            "addr" | "user_mode" if ctx.probe_pc().is_some() => {
                let (pc, user) = ctx.probe_pc().unwrap_or_default();
                Value::Long(if name == "addr" {
                    pc as i64
                } else {
                    i64::from(user)
                })
            }
            other => match native::unavailable(other) {
                Some(why) => return fail(format!("{other}() cannot run here: {why}"), span),
                None => return fail(format!("unknown function '{other}'"), span),
            },
        };
        Ok(v)
    }
}

/// C `strtol` on a whole string: optional sign, `0x` prefix for base 16, digits of `base`;
/// parsing stops at the first non-digit.
fn strtol(s: &str, base: i64) -> Result<i64, String> {
    if !(2..=36).contains(&base) {
        return Err(format!("strtol: base {base} is not between 2 and 36"));
    }
    let mut t = s.trim_start();
    let negative = t.starts_with('-');
    if negative || t.starts_with('+') {
        t = &t[1..];
    }
    if base == 16 {
        t = t
            .strip_prefix("0x")
            .or_else(|| t.strip_prefix("0X"))
            .unwrap_or(t);
    }
    let mut v: i64 = 0;
    for ch in t.chars() {
        let Some(d) = ch.to_digit(base as u32) else {
            break;
        };
        v = v.wrapping_mul(base).wrapping_add(i64::from(d));
    }
    Ok(if negative { v.wrapping_neg() } else { v })
}

/// The kernel stack as SystemTap's `sprint_backtrace()` writes it: ` 0xADDR : NAME [kernel]`
/// a frame, lines joined by newlines.
/// Why `name` has no kernel symbols to look in here.
fn no_symbols(name: &str) -> String {
    format!(
        "{name}() has no kernel symbols here: only a kernel probe that stopped the guest has them"
    )
}

/// A frame's `%pB` name as SystemTap prints it: a module's frame already ends in
/// ` [module]`; the kernel's own gets ` [kernel]` (`%pB` prints it bare, and a symbol
/// name has no blank).
pub fn stap_frame_name(name: &str) -> String {
    if name.contains(" [") && name.ends_with(']') {
        name.to_owned()
    } else {
        format!("{name} [kernel]")
    }
}

fn backtrace_lines(ctx: &dyn Context) -> String {
    ctx.kernel_backtrace()
        .unwrap_or_default()
        .iter()
        .map(|(pc, name)| format!(" {pc:#018x} : {}", stap_frame_name(name)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A `backtrace()` string (pcs in hex, blank-separated) as `sprint_backtrace()` writes a
/// stack, each pc named by the context's symbols or else the session's (bare when neither
/// has one or the word is not a number): how a stack kept as a map key is printed.
fn stack_lines(
    ctx: &dyn Context,
    symbols: Option<&super::eval::KernelSymbols>,
    stack: &str,
) -> String {
    stack
        .split_whitespace()
        .map(|word| {
            let pc = u64::from_str_radix(word.trim_start_matches("0x"), 16).ok();
            let name = pc
                .and_then(|pc| {
                    ctx.pc_name(pc)
                        .or_else(|| symbols.and_then(|f| f(pc)).map(|n| n.to_string()))
                })
                .unwrap_or_else(|| word.to_owned());
            let name = stap_frame_name(&name);
            match pc {
                Some(pc) => format!(" {pc:#018x} : {name}"),
                None => format!(" {word} : {name}"),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::strtol;

    #[test]
    fn strtol_parses_hex_with_prefix() {
        assert_eq!(strtol("0x1f", 16), Ok(31));
    }

    #[test]
    fn strtol_stops_at_first_non_digit() {
        assert_eq!(strtol("  -42abc", 10), Ok(-42));
    }

    #[test]
    fn strtol_refuses_base_one() {
        assert!(strtol("1", 1).is_err());
    }
}
