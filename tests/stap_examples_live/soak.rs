//! Issue 40's soak: SystemTap's examples (those in scope that pass `-p 2` with their `.meta`
//! arguments) run live back to back against ONE booted 2-vCPU guest under the mixed workload
//! (plus reads of /proc, where the probed code of `para-callgraph.stp` and `callgraph.stp`
//! runs, and a process named `bash` that migrates, [`BASH_LOOP`]), each ended by SIGINT a
//! few seconds after its install, with `--compile auto` and with `--compile never`. After each
//! run, the guest must be unhurt:
//! - `exotap recover --digest` finds nothing exotap left (no splice, no swapped return
//!   address, no breakpoint) and the kernel text hashes to what it did before the first run;
//! - the console has no oops, BUG, WARNING or invalid opcode, and the guest still runs.
//!
//! An example that ends with an error of its own (a probe point that does not resolve, a
//! script error) is listed, not failed: the soak is about the guest, the examples' own
//! results are checked by the main test.
//!
//! In scope: no embedded C (`%{`), no user-space (`process`) and no `module(...)` probe points.
//!
//! Bounded in CI: the two examples that crashed the guest (`para-callgraph.stp` and
//! `callgraph.stp`, over `*@fs/proc*.c`) and [`ROTATING`] more, which rotate with the day.
//! `EXOTAP_SOAK=all` runs every example in scope; `EXOTAP_SOAK=a,b` those whose path contains
//! a or b; `EXOTAP_SOAK_REPEAT=N` runs each N times; `EXOTAP_STRESS_SEED=N` replays the
//! moments at which a stress run ended (each run prints its seed); `EXOTAP_SOAK_EVENTS=none`
//! leaves every tracepoint of the guest off (the main test's guest turns some on);
//! `EXOTAP_SOAK_WINDOW=S` lets each run last S seconds after its install (3 by default).
//!
//! Running is measured too (issue 42): an example *runs live* when both of its runs (compiled
//! and host-evaluated) end with exit 0, no error, and print what its `.meta` file's `output:`
//! line promises ([`promise_kept`]). `EXOTAP_SOAK_RESULTS=FILE` writes each example's result
//! there, one line each, keeping the lines of examples the run did not run
//! (`docs/stap-examples-live.tsv` is the whole soak's, which `ci/stap-examples.sh --matrix`
//! shows on the examples' page).

use super::*;

/// Examples the bounded soak always runs: the ones that crashed the guest (issue 40).
const ALWAYS: &[&str] = &["general/para-callgraph.stp", "general/callgraph.stp"];
/// How many more the bounded soak takes, rotating with the day.
const ROTATING: usize = 2;
/// Seconds each run lasts after its install, unless `EXOTAP_SOAK_WINDOW` says otherwise.
const WINDOW: u64 = 3;
/// What a hurt kernel prints.
const HURT: &[&str] = &[
    "Oops",
    "BUG:",
    "WARNING:",
    "invalid opcode",
    "general protection",
    "Call Trace",
    "Kernel panic",
];

/// Reads of /proc in each round of the workload: `dd` reads a seq_file show through `read`,
/// so through `vfs_read` (what `para-callgraph.stp` watches; busybox's `cat` reads with
/// `sendfile`), `cat` more of them, `ls` reads the directory (`proc_root_readdir`, which
/// tail-calls `proc_pid_readdir`).
const PROC_READS: &str = "  dd if=/proc/meminfo of=/dev/null 2>/dev/null\n  \
                          cat /proc/meminfo /proc/self/stat /proc/sys/vm/* >/dev/null 2>&1\n  \
                          ls /proc >/dev/null\n";

/// A process named `bash` (the syscall loop under that name: comm is the executable's name),
/// the argument SystemTap's test suite gives `migrate.stp`, `chng_cpu.stp` and
/// `pstrace_exec.stp`: exec'd in a loop (what `pstrace_exec.stp` watches), once pinned to
/// the second vCPU (a context switch onto it, `chng_cpu.stp`'s), once moved between the vCPUs
/// while it runs (`sched_migrate_task`, `migrate.stp`'s). Apart from the workload's rounds,
/// as [`PROC_READER`]: with a trap probe on every context switch a round outlasts a window.
const BASH_LOOP: &str = "cp /bin/syscall-loop /tmp/bash\n\
                         ( while :; do\n  \
                         taskset 2 /tmp/bash 200 >/dev/null\n  \
                         /tmp/bash 2000 >/dev/null & b=$!\n  \
                         taskset -p 1 $b >/dev/null 2>&1; taskset -p 2 $b >/dev/null 2>&1\n  \
                         wait $b; sleep 1\n\
                         done ) &\n";
/// A read of /proc through `read` twice a second, apart from the rounds: a round under
/// hundreds of trap probes can outlast a run's window (`para-callgraph.stp` over
/// `*@fs/proc*.c` inside `vfs_read` printed nothing in 6 s).
const PROC_READER: &str =
    "( while :; do dd if=/proc/meminfo of=/dev/null 2>/dev/null; sleep 0.5; done ) &\n";

/// An example in scope: its path, stap's options (`-g`, `-D X`, `-I X`) and its arguments,
/// from its `.meta` file's `test_check:` line.
#[derive(Debug, Clone)]
struct InScope {
    path: PathBuf,
    words: Vec<String>,
    /// Its `.meta` file's `output:` line ("" when it has none).
    output: String,
}

impl InScope {
    fn name(&self, dir: &Path) -> String {
        self.path
            .strip_prefix(dir)
            .unwrap_or(&self.path)
            .display()
            .to_string()
    }
}

/// Whether `text` (a script) is in the soak's scope.
fn in_scope(text: &str) -> bool {
    let code: String = text
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with('#') || t.starts_with("//") || t.starts_with('*'))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let user_space = code.match_indices("process").any(|(at, _)| {
        let before = code[..at].chars().next_back();
        let after = code[at + "process".len()..].chars().next();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.')
            && matches!(after, Some('(' | '.'))
    });
    !code.contains("%{") && !code.contains("module(") && !user_space
}

/// The options and arguments of `meta`'s `test_check: stap ...` line that exotap takes: `-g`,
/// `-D X`, `-I X` and the script's arguments (the script's own name, `-p N` and options that
/// run or place the module left out).
fn meta_words(meta: &str, script: &str) -> Vec<String> {
    let Some(line) = meta
        .lines()
        .find_map(|l| l.strip_prefix("test_check:"))
        .map(str::trim)
    else {
        return Vec::new();
    };
    let words = shlex::split(line).unwrap_or_default();
    let mut out = Vec::new();
    let mut it = words.into_iter().skip(1); // stap
    while let Some(w) = it.next() {
        match w.as_str() {
            "-p" | "-c" | "-x" | "-r" | "-m" | "-B" | "-S" | "-d" | "-G" | "--remote" => {
                it.next();
            }
            "-g" => out.push(w),
            "-D" | "-I" => {
                out.push(w);
                out.extend(it.next());
            }
            _ if w.starts_with("-D") || w.starts_with("-I") => {
                out.push(w[..2].to_owned());
                out.push(w[2..].to_owned());
            }
            _ if w.starts_with('-') && w.len() > 1 => {
                // -gp4, -wp4: only the g matters.
                if !w.starts_with("--") && w[1..].contains('g') {
                    out.push("-g".to_owned());
                }
            }
            _ if w == script => {}
            _ => out.push(w),
        }
    }
    out
}

/// The words of `meta`'s `output:` line (`trace`, `sorted-list on-exit`, ...), "" when none.
fn meta_output(meta: &str) -> String {
    meta.lines()
        .find_map(|l| l.strip_prefix("output:"))
        .map(|o| o.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Whether a run kept what its example promises: it installed, ended with exit 0 and no
/// error, and printed on standard output, unless its `.meta` `output:` promises nothing
/// there (`none`; `proc`: files the host serves; `file`; `user-controlled`) or it has no
/// `.meta`. The reason when not, one line.
fn promise_kept(output: &str, run: &Soaked) -> Result<(), String> {
    if !run.installed {
        return Err(format!(
            "not installed: {}",
            first_error(&run.err).chars().take(160).collect::<String>()
        ));
    }
    let error = first_error(&run.err);
    if run.code != Some(0) || !error.is_empty() {
        return Err(format!(
            "exit {}: {}",
            run.code
                .map_or_else(|| "by signal".to_owned(), |c| c.to_string()),
            error.chars().take(160).collect::<String>()
        ));
    }
    let silent = output.is_empty()
        || output
            .split_whitespace()
            .any(|w| matches!(w, "none" | "proc" | "file" | "user-controlled"));
    if !silent && run.out.trim().is_empty() {
        return Err(format!(
            "printed nothing (its .meta promises output: {output})"
        ));
    }
    Ok(())
}

/// Every example in scope under `dir`, sorted by path (not yet checked with `-p 2`).
fn examples_in_scope(dir: &Path) -> Vec<InScope> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().map(Result::unwrap) {
            let path = e.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "stp") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                if !in_scope(&text) {
                    continue;
                }
                let meta = std::fs::read_to_string(path.with_extension("meta")).unwrap_or_default();
                let script = path.file_name().unwrap().to_string_lossy().into_owned();
                found.push(InScope {
                    words: meta_words(&meta, &script),
                    output: meta_output(&meta),
                    path,
                });
            }
        }
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    found
}

/// Whether exotap takes `ex` through pass 2 (elaborate and check), as stap's test suite's
/// `-p4` is read here.
fn passes_p2(ex: &InScope) -> bool {
    exotap()
        .current_dir(ex.path.parent().unwrap())
        .args(["run", "-p", "2"])
        .arg(&ex.path)
        .args(&ex.words)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Which examples this run soaks, from `EXOTAP_SOAK` (see the module doc), each passing `-p 2`.
fn chosen_for_soak(dir: &Path) -> Vec<InScope> {
    let all = examples_in_scope(dir);
    let want = std::env::var("EXOTAP_SOAK").unwrap_or_default();
    let picked: Vec<InScope> = if want == "all" {
        all
    } else if !want.is_empty() {
        let names: Vec<&str> = want.split(',').filter(|s| !s.is_empty()).collect();
        all.into_iter()
            .filter(|e| names.iter().any(|n| e.name(dir).contains(n)))
            .collect()
    } else {
        let day = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() / 86_400) as usize;
        let (always, rest): (Vec<InScope>, Vec<InScope>) = all
            .into_iter()
            .partition(|e| ALWAYS.contains(&e.name(dir).as_str()));
        assert_eq!(
            always.len(),
            ALWAYS.len(),
            "the examples that crashed the guest are not in this systemtap-doc, or left scope"
        );
        let mut picked = always;
        let start = (day * ROTATING) % rest.len().max(1);
        // The next ones that pass -p 2, from today's start on.
        let mut taken = 0;
        for k in 0..rest.len() {
            if taken == ROTATING {
                break;
            }
            let ex = &rest[(start + k) % rest.len()];
            if passes_p2(ex) {
                picked.push(ex.clone());
                taken += 1;
            }
        }
        return picked;
    };
    picked.into_iter().filter(passes_p2).collect()
}

/// One run's end: how it ended, and its diagnostics.
struct Soaked {
    installed: bool,
    out: String,
    code: Option<i32>,
    err: String,
    secs: f64,
}

/// Runs `ex` against the guest at `socket` for `window` after its install, then SIGINT
/// (SIGKILL after 60 s more, which leaves the guardian to recover).
fn soak_one(ex: &InScope, socket: &Path, compile: &str, window: Duration) -> Soaked {
    let started = Instant::now();
    let mut child = exotap()
        .current_dir(ex.path.parent().unwrap())
        .args(["run", "--compile", compile, "--target"])
        .arg(format!("unix:{}", socket.display()))
        .arg(&ex.path)
        .args(&ex.words)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start exotap run");
    let (out, rx, err) = crate::watch_output(&mut child);
    let deadline = started + Duration::from_secs(180);
    let mut installed = false;
    while !installed && Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => installed = l.contains("compiled probes in at") || l.contains("probe sites ("),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    if installed {
        let end = Instant::now() + window;
        while Instant::now() < end && child.try_wait().ok().flatten().is_none() {
            std::thread::sleep(Duration::from_millis(100));
        }
        signal(&child, "INT");
    }
    let end = Instant::now() + Duration::from_secs(60);
    while child.try_wait().ok().flatten().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
    }
    let killed = child.try_wait().ok().flatten().is_none();
    if killed {
        let _ = child.kill();
    }
    let code = child.wait().ok().and_then(|s| s.code());
    if killed {
        // The guardian recovers once exotap is gone: give it time before the checks.
        std::thread::sleep(Duration::from_secs(5));
    }
    Soaked {
        installed,
        out: out.join().unwrap_or_default(),
        code,
        err: err.join().unwrap_or_default(),
        secs: started.elapsed().as_secs_f64(),
    }
}

/// `exotap recover --digest` against the guest: (whether it found anything left, the text
/// hash, its output), or why it failed.
fn recover_digest(socket: &Path) -> Result<(bool, String, String), String> {
    let (code, out, err) = common::run(exotap().args([
        "recover",
        "--digest",
        "--target",
        &format!("unix:{}", socket.display()),
    ]));
    if code != 0 {
        return Err(format!(
            "exotap recover failed (exit {code}):\n{out}\n{err}"
        ));
    }
    let digest = out
        .lines()
        .find_map(|l| l.strip_prefix("kernel text sha256 "))
        .map(str::to_owned)
        .ok_or_else(|| format!("no digest in:\n{out}"))?;
    Ok((!out.contains("nothing to recover"), digest, out))
}

/// The first line of the console that shows a hurt kernel, after byte `from`.
fn hurt_since(log: &Mutex<String>, from: usize) -> Option<String> {
    let log = log.lock().unwrap();
    let new = log.get(from..).unwrap_or_default();
    let at = HURT.iter().filter_map(|h| new.find(h)).min()?;
    let start = new[..at].rfind('\n').map_or(0, |n| n + 1);
    Some(new[start..].lines().take(30).collect::<Vec<_>>().join("\n"))
}

#[test]
fn every_example_in_scope_run_live_back_to_back_leaves_the_guest_unhurt_and_its_text_as_it_was() {
    if !have_qemu(
        "every_example_in_scope_run_live_back_to_back_leaves_the_guest_unhurt_and_its_text_as_it_was",
    ) {
        return;
    }
    let Some(dir) = examples_dir() else {
        return;
    };
    let examples = chosen_for_soak(&dir);
    assert!(
        !examples.is_empty(),
        "no example in scope passes -p 2 (EXOTAP_SOAK={:?})",
        std::env::var("EXOTAP_SOAK").unwrap_or_default()
    );
    let repeat: usize = std::env::var("EXOTAP_SOAK_REPEAT")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    eprintln!(
        "soak: {} examples x {repeat}, compiled (auto) and host-evaluated (never): {}",
        examples.len(),
        examples
            .iter()
            .map(|e| e.name(&dir))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let began = Instant::now();
    // The guest boots `quiet` (its console prints errors only): a WARNING, and the kernel's
    // notes that it changes its own text, are warnings.
    let job = format!(
        "echo 5 > /proc/sys/kernel/printk\n{BASH_LOOP}{PROC_READER}{}",
        job_with(PROC_READS)
    );
    let mut live = LiveGuest::boot_with(began, &job);
    // The reference: the text once the workload has run two rounds (the job armed its
    // kprobes and tracepoints before it said so, and the kernel flips some static keys of its
    // own the first time a round's work runs: the text changed across the first round in one
    // of the first runs of this test, and never again in 100 rounds without exotap).
    let ready = Instant::now() + Duration::from_secs(300);
    while live.rounds.load(Ordering::SeqCst) < 2 {
        assert!(
            Instant::now() < ready,
            "the workload did not finish two rounds in 300 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (left, mut reference, _) = recover_digest(&live.socket).unwrap_or_else(|e| panic!("{e}"));
    assert!(!left, "exotap's work in a guest no exotap touched");

    let window: u64 = std::env::var("EXOTAP_SOAK_WINDOW")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(WINDOW);
    let mut ended_with_errors = Vec::new();
    let mut hurt = Vec::new();
    let mut runs = 0;
    // Per example, the first of its runs that did not keep its promise (or none).
    let mut live_results: std::collections::BTreeMap<String, Option<String>> =
        std::collections::BTreeMap::new();
    'soak: for round in 0..repeat {
        for ex in &examples {
            for compile in ["auto", "never"] {
                let name = ex.name(&dir);
                let from = live.log.lock().unwrap().len();
                let run = soak_one(ex, &live.socket, compile, Duration::from_secs(window));
                runs += 1;
                let kept = promise_kept(&ex.output, &run);
                let entry = live_results.entry(name.clone()).or_default();
                if let (None, Err(why)) = (&entry, &kept) {
                    *entry = Some(format!("{compile}: {why}"));
                }
                let first_error = first_error(&run.err);
                eprintln!(
                    "SOAK {round}/{compile} {name}: exit {:?}, installed {}, {:.1} s, {} lines out{}",
                    run.code,
                    run.installed,
                    run.secs,
                    run.out.lines().count(),
                    if first_error.is_empty() {
                        String::new()
                    } else {
                        format!(": {first_error}")
                    }
                );
                if run.code != Some(0) || !first_error.is_empty() {
                    ended_with_errors.push(format!(
                        "{name} ({compile}): exit {:?}: {first_error}",
                        run.code
                    ));
                }
                let why = unhurt(&mut live, &mut reference, from);
                if !why.is_empty() {
                    eprintln!(
                        "HURT {name} ({compile}): {}\n--- stderr:\n{}",
                        why.join("\n"),
                        run.err
                    );
                    hurt.push(format!("{name} ({compile}): {}", why.join("; ")));
                    // A hurt guest says nothing about the runs after it.
                    break 'soak;
                }
            }
        }
    }
    if hurt.is_empty() {
        hurt.extend(stress_nested_returns(&mut live, &mut reference));
    }
    let rounds = live.rounds.load(Ordering::SeqCst);
    live.end();
    eprintln!(
        "soak: {runs} runs in {:.0} s ({rounds} rounds of the workload), {} hurt the guest, \
         {} ended with an error of their own:\n{}",
        began.elapsed().as_secs_f64(),
        hurt.len(),
        ended_with_errors.len(),
        ended_with_errors.join("\n")
    );
    let running = live_results.values().filter(|r| r.is_none()).count();
    eprintln!(
        "soak: {running} of {} examples run live (both modes exit 0, no error, and print what \
         their .meta output: promises)",
        live_results.len()
    );
    if let Some(path) = std::env::var_os("EXOTAP_SOAK_RESULTS") {
        // The examples this run ran replace their lines; the others' stay (a run of a few
        // examples after a change updates the whole soak's file in place).
        let mut lines: BTreeMap<String, String> = std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .map(|(name, r)| (name.to_owned(), r.to_owned()))
            .collect();
        for (name, r) in &live_results {
            let r = r.as_deref().unwrap_or("runs").replace(['\t', '\n'], " ");
            lines.insert(name.clone(), r);
        }
        let text: String = lines
            .iter()
            .map(|(name, r)| format!("{name}\t{r}\n"))
            .collect();
        std::fs::write(&path, text).expect("cannot write EXOTAP_SOAK_RESULTS");
    }
    assert!(hurt.is_empty(), "hurt the guest:\n{}", hurt.join("\n"));
}

/// The first error line of a run's stderr ("" when none).
fn first_error(err: &str) -> String {
    err.lines()
        .find(|l| l.contains("ERROR") || l.starts_with("error") || l.contains("error:"))
        .unwrap_or("")
        .to_owned()
}

/// Kernel messages that announce a change of the kernel's own text: under a loaded TCG host
/// the clocksource watchdog can find the TSC skewed, mark it unstable and turn the
/// `__sched_clock_stable` static key off, which rewrites jumps in the text.
const GUEST_TEXT_CHANGES: &[&str] = &["clocksource", "sched_clock"];

/// Why the guest is not as it was before the runs (nothing when it is): exotap's work left
/// in it, its text changed from `reference`, its console past byte `from` shows a hurt
/// kernel, or it is gone. A text hash that differs is read again (a static key the kernel is
/// flipping at that moment holds an `int3` for a while); a change the kernel announced on
/// its console ([`GUEST_TEXT_CHANGES`]) becomes the new reference, said on stderr.
fn unhurt(live: &mut LiveGuest, reference: &mut String, from: usize) -> Vec<String> {
    // A guest that is gone (QEMU ended: a panic, a triple fault) is the first thing to say,
    // with what its console said since the run began; `recover` could only fail to connect.
    if !live.guest_runs() {
        return vec![gone(live, from, "")];
    }
    let (left, mut digest, out) = match recover_digest(&live.socket) {
        Ok(r) => r,
        // QEMU may end between the check above and the attach: say why, with its console.
        Err(e) => return vec![gone(live, from, &e)],
    };
    for _ in 0..3 {
        if digest == *reference {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
        match recover_digest(&live.socket) {
            Ok(r) => digest = r.1,
            Err(e) => return vec![gone(live, from, &e)],
        }
    }
    let mut why = Vec::new();
    if left {
        why.push(format!("exotap left work in the guest:\n{out}"));
    }
    if digest != *reference {
        let said: Vec<String> = {
            let log = live.log.lock().unwrap();
            log.get(from..)
                .unwrap_or_default()
                .lines()
                .filter(|l| !l.contains("EXOTAP-RESULT round="))
                .map(str::to_owned)
                .collect()
        };
        let announced = said
            .iter()
            .any(|l| GUEST_TEXT_CHANGES.iter().any(|c| l.contains(c)));
        if announced {
            eprintln!(
                "the guest changed its own text ({reference} -> {digest}); its console:\n{}",
                said.join("\n")
            );
            *reference = digest;
        } else {
            why.push(format!(
                "the kernel text hash changed: {reference} -> {digest}; the console since \
                 the run began:\n{}",
                said.join("\n")
            ));
        }
    }
    if let Some(c) = hurt_since(&live.log, from) {
        why.push(format!("the console:\n{c}"));
    }
    if !live.guest_runs() {
        why.push("the guest is gone".to_owned());
    }
    why
}

/// What a guest that `recover` cannot reach (`failure`), or that is gone, said: whether its
/// QEMU still runs, its console since byte `from` and the tail of `exotap boot`'s log.
fn gone(live: &mut LiveGuest, from: usize, failure: &str) -> String {
    // The console thread may still be copying QEMU's last lines.
    std::thread::sleep(Duration::from_secs(2));
    let state = if live.guest_runs() {
        "the guest still runs but exotap recover cannot attach"
    } else {
        "the guest is gone (its QEMU ended)"
    };
    let log = live.log.lock().unwrap();
    let said = log.get(from..).unwrap_or_default();
    let tail: Vec<&str> = said
        .lines()
        .filter(|l| !l.contains("EXOTAP-RESULT round="))
        .collect();
    let boot_log = std::fs::read_to_string(common::boot_log(&live.socket)).unwrap_or_default();
    let boot_tail: Vec<&str> = boot_log.lines().collect();
    format!(
        "{state}{}; its console since the run began:\n{}\nexotap boot's log:\n{}",
        if failure.is_empty() {
            String::new()
        } else {
            format!(" ({failure})")
        },
        tail[tail.len().saturating_sub(80)..].join("\n"),
        boot_tail[boot_tail.len().saturating_sub(30)..].join("\n")
    )
}

/// Return probes over 238 functions that nest (timer interrupts inside any of them),
/// tail-call each other (fs/proc: `proc_root_readdir` into `proc_pid_readdir`) and sleep
/// (`hrtimer_nanosleep`, the workload's `sleep`), on two vCPUs. Every point compiles (the
/// `*@fs/proc/*.c` of `callgraph.stp` has three that do not: weak functions' copies).
const STRESS: &str = r#"global entries, returns
probe kernel.function("*@fs/proc/base.c"), kernel.function("*@fs/proc/root.c"),
      kernel.function("*@fs/proc/generic.c"), kernel.function("*@fs/proc/inode.c"),
      kernel.function("*@fs/proc/array.c"), kernel.function("*@kernel/time/hrtimer.c") { entries++ }
probe kernel.function("*@fs/proc/base.c").return, kernel.function("*@fs/proc/root.c").return,
      kernel.function("*@fs/proc/generic.c").return, kernel.function("*@fs/proc/inode.c").return,
      kernel.function("*@fs/proc/array.c").return, kernel.function("*@kernel/time/hrtimer.c").return { returns++ }
probe end { printf("entries %d returns %d\n", entries, returns) }
"#;

/// Ends of the stress run per mode, each at a random moment.
const STRESS_ENDS: usize = 3;

/// [`STRESS`] compiled and host-evaluated, each ended [`STRESS_ENDS`] times at a random
/// moment 0.2 to 6 s after its install: every return address must be accounted for (no
/// "no record" or "no swapped return address" error, nothing left in the guest, the text as
/// it was, no oops). Returns what hurt the guest.
fn stress_nested_returns(live: &mut LiveGuest, reference: &mut String) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested-returns.stp");
    std::fs::write(&path, STRESS).unwrap();
    let stress = InScope {
        path,
        words: Vec::new(),
        output: String::new(),
    };
    // EXOTAP_STRESS_SEED replays the moments of a run that failed (its seed is printed).
    let mut seed = std::env::var("EXOTAP_STRESS_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
        | 1;
    eprintln!("stress: seed {seed}");
    let mut hurt = Vec::new();
    for compile in ["require", "never"] {
        for end in 0..STRESS_ENDS {
            // xorshift64: the moments differ from run to run; the seed above replays them.
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let window = Duration::from_millis(200 + seed % 5800);
            let from = live.log.lock().unwrap().len();
            let run = soak_one(&stress, &live.socket, compile, window);
            let sites = run
                .err
                .lines()
                .find(|l| l.contains("compiled probes in at") || l.contains("probe sites ("))
                .unwrap_or("")
                .to_owned();
            eprintln!(
                "STRESS {compile} #{end} ended after {:.1} s: exit {:?}, {}, {sites}",
                window.as_secs_f64(),
                run.code,
                run.out.trim()
            );
            let mut why = unhurt(live, reference, from);
            if !run.installed || run.code != Some(0) {
                why.push(format!("the run failed (exit {:?})", run.code));
            }
            // Each return probe ran for a call whose entry it saw: as many, less the calls in
            // flight at the removal (tasks asleep in hrtimer_nanosleep, a few per task).
            let counted: Vec<u64> = run
                .out
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            match counted[..] {
                [entries, returns] if returns <= entries && entries - returns <= 100 => {}
                _ => why.push(format!("entries and returns do not pair: {:?}", run.out)),
            }
            for lost in [
                "no record",
                "no swapped return address",
                "will fault",
                "not put back",
            ] {
                if run.err.contains(lost) {
                    why.push(format!("a return address was not accounted for ({lost})"));
                }
            }
            if !why.is_empty() {
                eprintln!(
                    "HURT stress ({compile} #{end}): {}\n--- stderr:\n{}",
                    why.join("\n"),
                    run.err
                );
                hurt.push(format!("stress ({compile} #{end}): {}", why.join("; ")));
                return hurt;
            }
        }
    }
    hurt
}

#[test]
fn the_soak_scope_and_meta_words_follow_stap_test_suite() {
    // Scope: embedded C, user-space and module probes are out.
    assert!(in_scope("probe kernel.function(\"vfs_read\") { }"));
    assert!(!in_scope("%{ #include <linux/fs.h> %}\nprobe begin { }"));
    assert!(!in_scope(
        "probe process(\"/bin/ls\").function(\"main\") { }"
    ));
    assert!(!in_scope("probe module(\"ext4\").function(\"*\") { }"));
    assert!(in_scope("# probe process(\"x\").begin\nprobe begin { }"));
    assert!(in_scope("probe kprocess.exec { }"));

    let words = meta_words(
        "title: x\ntest_check: stap -p4 para-callgraph.stp 'kernel.function(\"*@fs/proc*.c\")' 'kernel.function(\"vfs_read\")'\ntest_installcheck: stap para-callgraph.stp -c true\n",
        "para-callgraph.stp",
    );
    let options = meta_words(
        "test_check: stap -gp4 -DMAXACTION=100 -c 'sleep 1' x.stp 5\n",
        "x.stp",
    );

    assert_eq!(
        words,
        [
            "kernel.function(\"*@fs/proc*.c\")",
            "kernel.function(\"vfs_read\")"
        ]
    );
    assert_eq!(options, ["-g", "-D", "MAXACTION=100", "5"]);
}

#[test]
fn a_run_keeps_its_promise_only_with_exit_0_no_error_and_the_output_its_meta_names() {
    let run = |installed, code, out: &str, err: &str| Soaked {
        installed,
        out: out.to_owned(),
        code,
        err: err.to_owned(),
        secs: 1.0,
    };
    assert_eq!(
        meta_output("title: x\noutput: sorted-list  on-exit\nscope: system-wide\n"),
        "sorted-list on-exit"
    );
    assert_eq!(meta_output("title: x\n"), "");
    assert!(promise_kept("trace", &run(true, Some(0), "a line\n", "")).is_ok());
    let silent = promise_kept("trace", &run(true, Some(0), " \n", "")).unwrap_err();
    assert!(silent.contains("printed nothing"), "{silent}");
    // procfs output is the host's files, not standard output.
    assert!(promise_kept("proc", &run(true, Some(0), "", "")).is_ok());
    let failed = promise_kept(
        "trace",
        &run(true, Some(1), "x", "exotap: error: no such probe point\n"),
    )
    .unwrap_err();
    assert!(
        failed.starts_with("exit 1: ") && failed.contains("no such probe point"),
        "{failed}"
    );
    // Exit 0 with an error printed (an error in a probe handler) is no kept promise.
    assert!(promise_kept("trace", &run(true, Some(0), "x", "ERROR: division by 0\n")).is_err());
    assert!(promise_kept("none", &run(false, None, "", ""))
        .unwrap_err()
        .starts_with("not installed"));
}
