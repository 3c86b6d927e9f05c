//! The passes as the command line runs them: parse (1), elaborate and check (2), resolve
//! probe points (3), run (5). Shared by the `exotap` binary and the `stap` example.

use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::check::{check_guru, Program, Shape, Ty};
use super::diag::Diagnostic;
use super::invocation::Invocation;
use super::output::{Format, Output};
use super::parser::parse_with;
use super::resolve::{list, resolve_program, ListError, ProbePointResolver};
use super::runtime::run_guest_free;
use super::Limits;

/// A script and where it came from.
#[derive(Debug, Clone)]
pub struct ScriptSource {
    /// File name, or `<command line>` for `-e`.
    pub name: String,
    /// The text.
    pub text: String,
}

/// Parses and checks a script run without arguments against the default kernel facts.
///
/// # Errors
/// The diagnostics (errors first by position, with any warnings).
pub fn compile(src: &ScriptSource, limits: &Limits) -> Result<Program, Vec<Diagnostic>> {
    compile_with(src, limits, &Invocation::default())
}

/// Parses and checks a script as `inv` invokes it (arguments, facts, `-x PID`).
///
/// # Errors
/// The diagnostics (errors first by position, with any warnings).
pub fn compile_with(
    src: &ScriptSource,
    limits: &Limits,
    inv: &Invocation,
) -> Result<Program, Vec<Diagnostic>> {
    let script = parse_with(&src.text, limits, inv).map_err(|e| vec![Diagnostic::from(&e)])?;
    let mut prog = check_guru(script, inv.guru)?;
    prog.target_pid = inv.target_pid.unwrap_or(0);
    prog.host_files = inv.host_files.clone();
    set_globals(&mut prog, &inv.globals).map_err(|e| vec![e])?;
    Ok(prog)
}

/// `-G NAME=VALUE`: the initial value of scalar global NAME (a number for a global that
/// holds numbers, in decimal or 0x hex; the text for one that holds strings), as stap's.
fn set_globals(
    prog: &mut crate::check::Program,
    globals: &[(String, String)],
) -> Result<(), Diagnostic> {
    use crate::ast::Literal;
    use crate::check::{Shape, Ty};
    let error = |m: String| Diagnostic::error(m, crate::ast::Span::default());
    for (name, value) in globals {
        let Some(g) = prog.globals.get_mut(name) else {
            return Err(error(format!(
                "-G {name}={value}: the script has no global {name}"
            )));
        };
        if g.shape == Shape::Array || g.value == Ty::Stats {
            return Err(error(format!(
                "-G {name}={value}: {name} is an array or an aggregate, not a scalar"
            )));
        }
        let span = g.span;
        g.init = Some(if g.value == Ty::Str {
            Literal::Str(value.clone())
        } else {
            let n = match value.strip_prefix("0x") {
                Some(hex) => i64::from_str_radix(hex, 16).ok(),
                None => value.parse::<i64>().ok(),
            };
            Literal::Num(n.ok_or_else(|| {
                Diagnostic::error(
                    format!("-G {name}={value}: {name} holds numbers and {value:?} is not one"),
                    span,
                )
            })?)
        });
    }
    Ok(())
}

/// What to do with a script.
pub struct Job<'a> {
    /// The script.
    pub source: ScriptSource,
    /// Stop after this pass (1 parse, 2 check, 3-4 resolve); None or 5 runs it.
    pub last_pass: Option<u8>,
    /// Output format.
    pub format: Format,
    /// Limits.
    pub limits: Limits,
    /// Colored diagnostics.
    pub color: bool,
    /// Probe point resolver (symbols).
    pub resolver: &'a dyn ProbePointResolver,
    /// Arguments, guru mode, target process and kernel facts.
    pub invocation: Invocation,
}

impl std::fmt::Debug for Job<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("source", &self.source.name)
            .field("last_pass", &self.last_pass)
            .finish_non_exhaustive()
    }
}

fn ty_name(t: Ty) -> &'static str {
    match t {
        Ty::Long => "long",
        Ty::Str => "string",
        Ty::Stats => "stats",
        Ty::Unknown => "unknown",
        Ty::Void => "void",
    }
}

/// The elaborated program as `-p 2` prints it.
pub fn summary(prog: &Program) -> String {
    let mut s = String::from("# globals\n");
    for (name, g) in &prog.globals {
        let keys = if g.shape == Shape::Array {
            let k: Vec<&str> = g.keys.iter().map(|t| ty_name(*t)).collect();
            format!(" [{}]", k.join(", "))
        } else {
            String::new()
        };
        s.push_str(&format!("{name}:{}{keys}\n", ty_name(g.value)));
    }
    s.push_str("# functions\n");
    for (i, f) in prog.script.functions.iter().enumerate() {
        let params: Vec<String> = f
            .params
            .iter()
            .map(|p| {
                let t = prog.locals[prog.script.probes.len() + i].get(&p.name.name);
                // A parameter renamed because it hides a global (parser/shadow.rs) is listed
                // by the name the script gives it.
                format!(
                    "{}:{}",
                    p.name.name.trim_end_matches('\''),
                    ty_name(t.copied().unwrap_or(Ty::Unknown))
                )
            })
            .collect();
        s.push_str(&format!(
            "{}:{} ({})\n",
            f.name.name,
            ty_name(prog.function_ret[i]),
            params.join(", ")
        ));
    }
    s.push_str("# probes\n");
    for p in &prog.probes {
        for (pt, kind) in &p.points {
            s.push_str(&format!("{pt} /* {} */\n", kind.family()));
        }
    }
    s
}

fn print_diags(err: &mut dyn Write, diags: &[Diagnostic], src: &ScriptSource, color: bool) {
    for d in diags {
        let _ = write!(err, "{}", d.render(&src.name, &src.text, color));
    }
}

/// Runs `job`, writing script output to `out` and diagnostics to `err`; returns the exit code
/// (0 success, 1 script or runtime errors).
pub fn run_job(
    job: &Job<'_>,
    out: Box<dyn Write>,
    mut err: Box<dyn Write>,
    stop: &Arc<AtomicBool>,
) -> i32 {
    let src = &job.source;
    let mut out = out;
    if job.last_pass == Some(1) {
        return match parse_with(&src.text, &job.limits, &job.invocation) {
            Ok(script) => {
                let mut text = String::new();
                for p in &script.probes {
                    let pts: Vec<String> = p.points.iter().map(ToString::to_string).collect();
                    text.push_str(&format!("probe {}\n", pts.join(", ")));
                }
                for f in &script.functions {
                    text.push_str(&format!("function {}\n", f.name.name));
                }
                let _ = out.write_all(text.as_bytes());
                0
            }
            Err(e) => {
                print_diags(&mut *err, &[Diagnostic::from(&e)], src, job.color);
                1
            }
        };
    }
    let prog = match compile_with(src, &job.limits, &job.invocation) {
        Ok(p) => p,
        Err(diags) => {
            print_diags(&mut *err, &diags, src, job.color);
            return 1;
        }
    };
    if !job.invocation.no_warnings {
        print_diags(&mut *err, &prog.warnings, src, job.color);
    }
    if job.last_pass == Some(2) {
        let _ = out.write_all(summary(&prog).as_bytes());
        return 0;
    }
    // Pass 4 (SystemTap's build) has nothing to do here; pass 5 is the run itself.
    if job.last_pass.is_some_and(|p| (3..5).contains(&p)) {
        return match resolve_program(&prog, job.resolver) {
            Ok(found) => {
                for (_, r) in found {
                    let _ = writeln!(out, "{}", r.name);
                }
                0
            }
            Err(e) => {
                let _ = writeln!(err, "exotap: error: {e}");
                1
            }
        };
    }
    if prog.needs_guest() {
        let points: Vec<String> = prog
            .probes
            .iter()
            .flat_map(|p| p.points.iter())
            .filter(|(_, k)| k.needs_guest())
            .map(|(pt, _)| pt.to_string())
            .collect();
        let e = super::runtime::RuntimeError::NeedsGuest {
            points: points.join(", "),
        };
        let _ = writeln!(err, "exotap: error: {e}");
        return 1;
    }
    let output = Output::new(job.format, out, err);
    match run_guest_free(
        &prog,
        job.limits.clone(),
        output,
        &src.name,
        &src.text,
        stop,
    ) {
        Ok(code) => code,
        Err(e) => {
            // The Output took the error stream; report through a fresh stderr handle.
            let _ = writeln!(std::io::stderr(), "exotap: error: {e}");
            1
        }
    }
}

/// Runs `-l PATTERN` / `-L PATTERN`: prints each match (with its variables for `-L`).
/// Returns the exit code: 1 when nothing could be listed.
pub fn run_listing(
    pattern: &str,
    with_vars: bool,
    resolver: &dyn ProbePointResolver,
    out: &mut dyn Write,
    err: &mut dyn Write,
    color: bool,
) -> i32 {
    match list(pattern, resolver) {
        Ok(found) => {
            for r in found {
                let vars = if with_vars && !r.variables.is_empty() {
                    format!(" {}", r.variables.join(" "))
                } else {
                    String::new()
                };
                let _ = writeln!(out, "{}{vars}", r.name);
            }
            0
        }
        Err(ListError::BadPattern {
            text, diagnostics, ..
        }) => {
            let src = ScriptSource {
                name: "<pattern>".into(),
                text,
            };
            print_diags(err, &diagnostics, &src, color);
            1
        }
        Err(ListError::Resolve(e)) => {
            let _ = writeln!(err, "exotap: {e}");
            1
        }
    }
}

/// The process's stop flag, set by Ctrl-C, SIGTERM or SIGHUP (the session then removes its
/// probes, runs its end probes and exits). The first call installs the handler; later calls
/// return the same flag, so a caller that installs it early (before attaching) sees a signal
/// that came during the attach or the install.
///
/// # Errors
/// When another handler is installed or signals cannot be set up.
pub fn stop_on_ctrl_c() -> Result<Arc<AtomicBool>, ctrlc::Error> {
    static STOP: std::sync::Mutex<Option<Arc<AtomicBool>>> = std::sync::Mutex::new(None);
    let mut slot = STOP
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(stop) = slot.as_ref() {
        return Ok(stop.clone());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    ctrlc::set_handler(move || flag.store(true, std::sync::atomic::Ordering::SeqCst))?;
    *slot = Some(stop.clone());
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::SharedBuf;
    use crate::resolve::NoSymbols;

    fn job(text: &str, last_pass: Option<u8>) -> (i32, String, String) {
        job_with_args(text, last_pass, &[])
    }

    fn job_with_args(text: &str, last_pass: Option<u8>, args: &[&str]) -> (i32, String, String) {
        let source = ScriptSource {
            name: "t.stp".into(),
            text: text.into(),
        };
        let job = Job {
            source,
            last_pass,
            format: Format::Text,
            limits: Limits::default(),
            color: false,
            resolver: &NoSymbols,
            invocation: Invocation::with_args(args.iter().copied()),
        };
        let (out, err) = (SharedBuf::default(), SharedBuf::default());
        let stop = Arc::new(AtomicBool::new(false));
        let code = run_job(&job, Box::new(out.clone()), Box::new(err.clone()), &stop);
        (code, out.contents(), err.contents())
    }

    #[test]
    fn pass_two_prints_inferred_types_even_for_kernel_probes() {
        let (code, out, _) = job(
            "global a\nprobe kernel.function(\"f\") { a[execname()] = $x }",
            Some(2),
        );
        assert_eq!(code, 0);
        assert!(out.contains("a:long [string]"), "{out}");
        assert!(
            out.contains("kernel.function(\"f\") /* kernel.function */"),
            "{out}"
        );
    }

    #[test]
    fn running_kernel_probes_without_a_guest_fails_clearly() {
        let (code, _, err) = job("probe kernel.function(\"f\") { }", None);
        assert_eq!(code, 1);
        assert!(err.contains("kernel probe points need a guest"), "{err}");
    }

    #[test]
    fn check_errors_are_rendered_with_the_file_name() {
        let (code, _, err) = job("probe begin { x = y }", None);
        assert_eq!(code, 1);
        assert!(
            err.contains("t.stp:1:19") && err.contains("undefined variable 'y'"),
            "{err}"
        );
    }

    #[test]
    fn arguments_reach_the_script_as_tokens_strings_and_argv() {
        let (code, out, err) = job_with_args(
            "probe begin { printf(\"%d %s %s %d\\n\", $1 + 1, @2, argv[2], argc) }",
            None,
            &["41", "two"],
        );
        assert_eq!((code, out.as_str()), (0, "42 two two 2\n"), "{err}");
    }

    #[test]
    fn missing_argument_fails_at_pass_one_with_the_index() {
        let (code, _, err) = job("probe begin { println(@1) }", Some(1));
        assert_eq!(code, 1);
        assert!(
            err.contains("command line argument index 1 out of range [1-0]"),
            "{err}"
        );
    }

    #[test]
    fn target_returns_the_pid_of_the_invocation() {
        let source = ScriptSource {
            name: "t.stp".into(),
            text: "probe begin { println(target()) }".into(),
        };
        let inv = Invocation {
            target_pid: Some(1234),
            ..Invocation::default()
        };
        let prog = compile_with(&source, &Limits::default(), &inv).unwrap();
        assert_eq!(prog.target_pid, 1234);
    }

    #[test]
    fn dash_g_sets_scalar_globals_and_names_what_it_cannot_set() {
        let source = ScriptSource {
            name: "t.stp".into(),
            text: "global sloth = 50, who = \"x\", hits\n\
                   probe begin { hits[1]++; printf(\"%d %s\\n\", sloth, who) }"
                .into(),
        };
        let with = |globals: &[(&str, &str)]| {
            let inv = Invocation {
                globals: globals
                    .iter()
                    .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                    .collect(),
                ..Invocation::default()
            };
            compile_with(&source, &Limits::default(), &inv)
        };
        let init = |prog: &crate::check::Program, name: &str| prog.globals[name].init.clone();

        let prog = with(&[("sloth", "10"), ("who", "y z")]).unwrap();
        let hex = with(&[("sloth", "0x10")]).unwrap();
        let errors: Vec<String> = [("sloth", "ten"), ("nope", "1"), ("hits", "1")]
            .iter()
            .map(|g| with(&[*g]).unwrap_err()[0].message.clone())
            .collect();

        assert_eq!(init(&prog, "sloth"), Some(crate::ast::Literal::Num(10)));
        assert_eq!(
            init(&prog, "who"),
            Some(crate::ast::Literal::Str("y z".into()))
        );
        assert_eq!(init(&hex, "sloth"), Some(crate::ast::Literal::Num(16)));
        assert!(errors[0].contains("sloth holds numbers"), "{errors:?}");
        assert!(errors[1].contains("no global nope"), "{errors:?}");
        assert!(errors[2].contains("not a scalar"), "{errors:?}");
    }

    #[test]
    fn listing_a_timer_prints_it() {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run_listing("timer.ms(5)", false, &NoSymbols, &mut out, &mut err, false);
        assert_eq!(
            (code, String::from_utf8_lossy(&out).into_owned()),
            (0, "timer.ms(5)\n".to_string())
        );
    }
}
