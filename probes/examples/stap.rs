//! A stand-alone front end for the probe language, for trying scripts without the `exotap`
//! binary: `cargo run -p exotap-probes --example stap -- -e 'probe begin { println("hi") }'`.
//! It takes the same options as `exotap run` (see src/script.rs).

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use exotap_probes::lang::driver::{run_job, run_listing, Job, ScriptSource};
use exotap_probes::lang::output::Format;
use exotap_probes::lang::resolve::NoSymbols;
use exotap_probes::lang::Limits;

fn usage() -> ExitCode {
    eprintln!("usage: stap [FILE | -e SCRIPT | -l PATTERN | -L PATTERN] [-p N] [-o FILE] [--format text|json] [-D NAME=VALUE]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut file, mut script, mut listing, mut pass, mut output) = (None, None, None, None, None);
    let mut format = Format::Text;
    let mut limits = Limits::default();
    while let Some(a) = args.next() {
        match a.as_str() {
            "-e" => script = args.next(),
            "-l" => listing = args.next().map(|p| (p, false)),
            "-L" => listing = args.next().map(|p| (p, true)),
            "-p" => pass = args.next().and_then(|p| p.parse::<u8>().ok()),
            "-o" => output = args.next(),
            "-D" => {
                if let Err(e) = limits.set(&args.next().unwrap_or_default()) {
                    eprintln!("stap: {e}");
                    return ExitCode::from(2);
                }
            }
            "--format" => match args.next().as_deref() {
                Some("json") => format = Format::Json,
                Some("text") => format = Format::Text,
                _ => return usage(),
            },
            s if s.starts_with("-p") && s.len() > 2 => pass = s[2..].parse::<u8>().ok(),
            s if !s.starts_with('-') && file.is_none() => file = Some(s.to_string()),
            _ => return usage(),
        }
    }
    let color = std::io::stderr().is_terminal();
    if let Some((pattern, vars)) = listing {
        let code = run_listing(
            &pattern,
            vars,
            &NoSymbols,
            &mut std::io::stdout(),
            &mut std::io::stderr(),
            color,
        );
        return ExitCode::from(code as u8);
    }
    let source = match (file, script) {
        (_, Some(text)) => ScriptSource {
            name: "<input>".into(),
            text,
        },
        (Some(f), None) => match std::fs::read_to_string(&f) {
            Ok(text) => ScriptSource { name: f, text },
            Err(e) => {
                eprintln!("stap: cannot read {f}: {e}");
                return ExitCode::from(1);
            }
        },
        (None, None) => return usage(),
    };
    let out: Box<dyn Write> = match output {
        Some(path) => match std::fs::File::create(&path) {
            Ok(f) => Box::new(std::io::BufWriter::new(f)),
            Err(e) => {
                eprintln!("stap: cannot create {path}: {e}");
                return ExitCode::from(1);
            }
        },
        None => Box::new(std::io::stdout()),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    if let Err(e) = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)) {
        eprintln!("stap: cannot catch Ctrl-C: {e}");
    }
    let job = Job {
        source,
        last_pass: pass,
        format,
        limits,
        color,
        resolver: &NoSymbols,
        invocation: Default::default(),
    };
    let code = run_job(&job, out, Box::new(std::io::stderr()), &stop);
    ExitCode::from(code as u8)
}
