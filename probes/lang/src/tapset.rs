//! The tapset library: exotap's own probe aliases, functions and globals, written in the
//! probe language for the guest kernel exotap targets (Linux 6.1, x86-64) and built into the
//! binary (`probes/lang/tapset/*.stp`), plus one generated `syscall.NAME` alias pair per x86-64
//! system call.
//!
//! A script is linked against the library after parsing, as SystemTap links its tapsets: the
//! library's aliases join the script's (a script's own alias or function of the same name
//! wins), and after alias expansion only the library functions the script calls (directly or
//! through other library functions) and the library globals that code names are added. A
//! script that uses nothing from the library is left as it was.
//!
//! Why our own files and not Debian's `systemtap-common`: SystemTap's tapsets are half
//! embedded C that reaches into the running kernel (`current`, `task_pid_nr_ns`, ...), and
//! their script half picks among kernel versions with `@defined` chains written for kernels
//! that are not ours. Ours name the 6.1 kernel's functions and parameters directly (checked
//! against its BTF by `-p 3`), and leave to native built-ins only what needs exotap itself.

use std::collections::{HashMap, HashSet};

use super::ast::{Expr, ExprKind, Function, FunctionBody, Global, Script, Stmt, StmtKind};
use super::builtins;
use super::invocation::Invocation;
use super::parser::{parse_library, ParseError};
use super::syscalls::SYSCALLS;
use super::Limits;

/// The library's files: name and text.
pub const FILES: &[(&str, &str)] = &[
    ("syscalls.stp", include_str!("../tapset/syscalls.stp")),
    ("vfs.stp", include_str!("../tapset/vfs.stp")),
    ("scheduler.stp", include_str!("../tapset/scheduler.stp")),
    ("signal.stp", include_str!("../tapset/signal.stp")),
    ("memory.stp", include_str!("../tapset/memory.stp")),
    ("kprocess.stp", include_str!("../tapset/kprocess.stp")),
    ("networking.stp", include_str!("../tapset/networking.stp")),
    ("ioblock.stp", include_str!("../tapset/ioblock.stp")),
    ("task.stp", include_str!("../tapset/task.stp")),
    ("indent.stp", include_str!("../tapset/indent.stp")),
    ("ansi.stp", include_str!("../tapset/ansi.stp")),
    ("conversions.stp", include_str!("../tapset/conversions.stp")),
    ("stopwatch.stp", include_str!("../tapset/stopwatch.stp")),
    ("misc.stp", include_str!("../tapset/misc.stp")),
    ("json.stp", include_str!("../tapset/json.stp")),
    ("queue_stats.stp", include_str!("../tapset/queue_stats.stp")),
    ("nfsd.stp", include_str!("../tapset/nfsd.stp")),
];

/// `nd_syscall.NAME[.return]` for every system call (the same probes: exotap needs no DWARF
/// for either), and `syscall.NAME` and `syscall.NAME.return` for every x86-64 system call
/// that `syscalls.stp` does not define by hand: `name`, `argstr` (the six argument registers in
/// hex), `retstr`, and the raw arguments `arg1`..`arg6`. A call the kernel does not have
/// (`__x64_sys_NAME` missing) is dropped at resolution, as a `?` point is.
pub fn generated_syscalls(hand_written: &HashSet<String>) -> String {
    let mut text = String::new();
    let mut every: Vec<&str> = SYSCALLS.iter().map(|(_, n)| *n).collect();
    every.extend(hand_written.iter().map(String::as_str));
    every.sort_unstable();
    every.dedup();
    for name in every {
        text.push_str(&format!("probe nd_syscall.{name} = syscall.{name} {{ }}\n"));
        // exit(2) and exit_group(2) do not return.
        if !NO_RETURN.contains(&name) {
            text.push_str(&format!(
                "probe nd_syscall.{name}.return = syscall.{name}.return {{ }}\n"
            ));
        }
    }
    for (_, name) in SYSCALLS {
        if hand_written.contains(*name) {
            continue;
        }
        if NO_RETURN.contains(name) {
            text.push_str(&format!(
                "probe syscall.{name} = kernel.function(\"__x64_sys_{name}\") ? {{\n\
                 \tname = \"{name}\"\n\targ1 = ulong_arg(1)\n\targstr = sprintf(\"%d\", arg1)\n}}\n"
            ));
            continue;
        }
        text.push_str(&format!(
            "probe syscall.{name} = kernel.function(\"__x64_sys_{name}\") ? {{\n\
             \tname = \"{name}\"\n\
             \targ1 = ulong_arg(1); arg2 = ulong_arg(2); arg3 = ulong_arg(3)\n\
             \targ4 = ulong_arg(4); arg5 = ulong_arg(5); arg6 = ulong_arg(6)\n\
             \targstr = sprintf(\"%#x, %#x, %#x, %#x, %#x, %#x\", arg1, arg2, arg3, arg4, arg5, arg6)\n\
             }}\n\
             probe syscall.{name}.return = kernel.function(\"__x64_sys_{name}\").return ? {{\n\
             \tname = \"{name}\"\n\
             \tretval = $return\n\
             \tretstr = return_str(1, retval)\n\
             }}\n"
        ));
    }
    text
}

/// The system calls that never return: they have no `.return` probes.
const NO_RETURN: &[&str] = &["exit", "exit_group", "rt_sigreturn"];

/// Why the library could not be linked into a script.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TapsetError {
    /// A library file does not parse (a bug in exotap, or a preprocessor condition that the
    /// invocation's kernel facts make take a branch nobody tried).
    #[error("the tapset file {file} does not parse: {cause}")]
    Library {
        /// The library file.
        file: String,
        /// The parse error.
        cause: Box<ParseError>,
    },
    /// A `-I` directory or one of its files could not be read.
    #[error("cannot read the tapset directory {dir}: {cause}")]
    Include {
        /// The directory.
        dir: String,
        /// The I/O error.
        cause: String,
    },
}

/// The parsed library.
struct Library {
    aliases: Vec<super::ast::ProbeAlias>,
    functions: HashMap<String, Function>,
    globals: HashMap<String, Global>,
}

fn load(inv: &Invocation, limits: &Limits) -> Result<Library, TapsetError> {
    let mut lib = Library {
        aliases: Vec::new(),
        functions: HashMap::new(),
        globals: HashMap::new(),
    };
    let mut hand_written = HashSet::new();
    let add = |file: &str, text: &str, lib: &mut Library| -> Result<(), TapsetError> {
        let script = parse_library(text, limits, inv).map_err(|e| TapsetError::Library {
            file: file.to_string(),
            cause: Box::new(e),
        })?;
        lib.aliases.extend(script.aliases.into_iter().map(|mut a| {
            a.library = true;
            a
        }));
        for f in script.functions {
            lib.functions.insert(f.name.name.clone(), f);
        }
        for g in script.globals {
            lib.globals.insert(g.name.name.clone(), g);
        }
        Ok(())
    };
    for (file, text) in FILES {
        add(file, text, &mut lib)?;
    }
    for dir in &inv.include_dirs {
        let unreadable = |e: std::io::Error| TapsetError::Include {
            dir: dir.display().to_string(),
            cause: e.to_string(),
        };
        let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
            .map_err(unreadable)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "stp"))
            .collect();
        files.sort();
        for path in files {
            let text = std::fs::read_to_string(&path).map_err(unreadable)?;
            add(&path.display().to_string(), &text, &mut lib)?;
        }
    }
    for a in &lib.aliases {
        for n in &a.names {
            if let [root, call, ..] = n.components.as_slice() {
                if root.name == "syscall" {
                    hand_written.insert(call.name.clone());
                }
            }
        }
    }
    let generated = generated_syscalls(&hand_written);
    add("generated syscalls", &generated, &mut lib)?;
    Ok(lib)
}

/// Adds the library's aliases to `script` (before alias expansion): those whose names the
/// script does not define itself.
///
/// # Errors
/// When a library file does not parse.
pub fn link_aliases(
    script: &mut Script,
    inv: &Invocation,
    limits: &Limits,
) -> Result<(), TapsetError> {
    if !uses_library_points(script) {
        return Ok(());
    }
    let lib = load(inv, limits)?;
    let own: HashSet<String> = script
        .aliases
        .iter()
        .flat_map(|a| a.names.iter().map(ToString::to_string))
        .collect();
    script.aliases.extend(
        lib.aliases
            .into_iter()
            .filter(|a| !a.names.iter().any(|n| own.contains(&n.to_string()))),
    );
    Ok(())
}

/// Whether a probe names a point outside exotap's own families (one the library may define).
fn uses_library_points(script: &Script) -> bool {
    const BUILT_IN: &[&str] = &[
        "begin", "end", "error", "never", "timer", "kernel", "kprobe",
    ];
    script
        .probes
        .iter()
        .flat_map(|p| &p.points)
        .chain(script.aliases.iter().flat_map(|a| &a.points))
        .any(|pt| {
            pt.components
                .first()
                .is_some_and(|c| !BUILT_IN.contains(&c.name.as_str()))
        })
}

/// Adds (after alias expansion) the library functions the script calls, transitively, and
/// the library globals the script and those functions name.
///
/// # Errors
/// When a library file does not parse.
pub fn link_functions(
    script: &mut Script,
    inv: &Invocation,
    limits: &Limits,
) -> Result<(), TapsetError> {
    let mut names = Names::default();
    for p in &script.probes {
        names.block(&p.body.stmts);
        if let Some(c) = &p.condition {
            names.expr(c);
        }
    }
    for f in &script.functions {
        if let FunctionBody::Block(b) = &f.body {
            names.block(&b.stmts);
        }
    }
    let defined: HashSet<String> = script
        .functions
        .iter()
        .map(|f| f.name.name.clone())
        .collect();
    let wanted = |n: &String| !defined.contains(n) && !builtins::is_builtin(n);
    let declared: HashSet<String> = script.globals.iter().map(|g| g.name.name.clone()).collect();
    // A library global the script names (VM_FAULT_MAJOR, BIO_READ) is spelled in capitals
    // or starts with '__'; plain lower-case names are the script's own locals.
    let library_global = |v: &String| {
        !declared.contains(v)
            && (v.starts_with("__") || v.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
    };
    if !names.calls.iter().any(wanted) && !names.vars.iter().any(library_global) {
        return Ok(());
    }
    let mut lib = load(inv, limits)?;
    let mut queue: Vec<String> = names.calls.iter().filter(|n| wanted(n)).cloned().collect();
    let mut linked = HashSet::new();
    while let Some(name) = queue.pop() {
        if !linked.insert(name.clone()) {
            continue;
        }
        let Some(f) = lib.functions.remove(&name) else {
            continue;
        };
        let mut inner = Names::default();
        if let FunctionBody::Block(b) = &f.body {
            inner.block(&b.stmts);
        }
        queue.extend(
            inner
                .calls
                .iter()
                .filter(|n| wanted(n) && !linked.contains(*n))
                .cloned(),
        );
        names.vars.extend(inner.vars);
        script.functions.push(f);
    }
    let mut globals: Vec<&String> = names
        .vars
        .iter()
        .filter(|v| !declared.contains(*v))
        .collect();
    globals.sort();
    for v in globals {
        if let Some(g) = lib.globals.remove(v) {
            script.globals.push(g);
        }
    }
    Ok(())
}

/// The functions called and the variables named in some code.
#[derive(Default)]
pub(crate) struct Names {
    /// Functions called.
    pub(crate) calls: HashSet<String>,
    /// Variables (and arrays) named, read or written.
    pub(crate) vars: HashSet<String>,
}

impl Names {
    pub(crate) fn block(&mut self, stmts: &[Stmt]) {
        for s in stmts {
            self.stmt(s);
        }
    }

    pub(crate) fn stmt(&mut self, s: &Stmt) {
        match &s.kind {
            StmtKind::Empty | StmtKind::Next | StmtKind::Break | StmtKind::Continue => {}
            StmtKind::Block(b) => self.block(&b.stmts),
            StmtKind::Expr(e) | StmtKind::Delete(e) | StmtKind::Return(Some(e)) => self.expr(e),
            StmtKind::Return(None) => {}
            StmtKind::If(i) => {
                self.expr(&i.cond);
                self.stmt(&i.then);
                if let Some(e) = &i.els {
                    self.stmt(e);
                }
            }
            StmtKind::While(w) => {
                self.expr(&w.0);
                self.stmt(&w.1);
            }
            StmtKind::For(f) => {
                for e in [&f.init, &f.cond, &f.step].into_iter().flatten() {
                    self.expr(e);
                }
                self.stmt(&f.body);
            }
            StmtKind::Foreach(f) => {
                self.vars.insert(f.array.name.clone());
                for e in f.slice.iter().flatten() {
                    self.expr(e);
                }
                if let Some(l) = &f.limit {
                    self.expr(l);
                }
                self.stmt(&f.body);
            }
            StmtKind::Try(t) => {
                self.block(&t.body.stmts);
                self.block(&t.handler.stmts);
            }
        }
    }

    pub(crate) fn expr(&mut self, e: &Expr) {
        match &e.kind {
            ExprKind::Num(_)
            | ExprKind::Str(_)
            | ExprKind::Target(_)
            | ExprKind::Embedded(_)
            | ExprKind::Wildcard => {}
            ExprKind::Var(v) => {
                self.vars.insert(v.clone());
            }
            ExprKind::Index(ix) => {
                self.vars.insert(ix.array.name.clone());
                ix.keys.iter().for_each(|k| self.expr(k));
            }
            ExprKind::In(i) => {
                self.vars.insert(i.array.name.clone());
                i.keys.iter().for_each(|k| self.expr(k));
            }
            ExprKind::Call(c) => {
                self.calls.insert(c.name.name.clone());
                c.args.iter().for_each(|a| self.expr(a));
            }
            ExprKind::Unary(_, x)
            | ExprKind::Stat(_, x)
            | ExprKind::Hist(_, x)
            | ExprKind::Entry(x)
            | ExprKind::Defined(x)
            | ExprKind::Variance(x, _)
            | ExprKind::AddressOf(x) => self.expr(x),
            ExprKind::Binary(_, p)
            | ExprKind::Assign(_, p)
            | ExprKind::Aggregate(p)
            | ExprKind::RegexMatch(p, _) => {
                self.expr(&p.0);
                self.expr(&p.1);
            }
            ExprKind::Ternary(p) => {
                self.expr(&p.0);
                self.expr(&p.1);
                self.expr(&p.2);
            }
            ExprKind::IncDec(i) => self.expr(&i.target),
            ExprKind::Cast(c) => {
                self.expr(&c.pointer);
                for index in &c.indexes {
                    self.expr(index);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parser::parse;

    fn parsed(src: &str) -> Script {
        parse(src, &Limits::default()).unwrap()
    }

    #[test]
    fn every_library_file_parses() {
        assert!(load(&Invocation::default(), &Limits::default()).is_ok());
    }

    #[test]
    fn a_syscall_alias_expands_to_its_x64_entry_with_its_locals() {
        let script = parsed("probe syscall.read { println(name, fd, count) }");

        assert_eq!(
            script.probes[0].points[0].to_string(),
            "kernel.function(\"__x64_sys_read\")"
        );
    }

    #[test]
    fn unused_tapset_locals_are_not_computed() {
        let script = parsed("global n\nprobe syscall.read { n++ }");

        assert_eq!(script.probes[0].body.stmts.len(), 1);
    }

    #[test]
    fn a_used_tapset_local_keeps_what_it_is_computed_from() {
        let script = parsed("probe nd_syscall.read { println(argstr) }");

        let assigned: Vec<String> = script.probes[0]
            .body
            .stmts
            .iter()
            .filter_map(|s| match &s.kind {
                StmtKind::Expr(Expr {
                    kind: ExprKind::Assign(_, p),
                    ..
                }) => match &p.0.kind {
                    ExprKind::Var(v) => Some(v.clone()),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        assert_eq!(assigned, ["fd", "buf_uaddr", "count", "argstr"]);
    }

    #[test]
    fn a_generated_syscall_alias_names_its_call() {
        let script = parsed("probe syscall.getppid { println(name) }");

        assert_eq!(
            script.probes[0].points[0].to_string(),
            "kernel.function(\"__x64_sys_getppid\")?"
        );
    }

    #[test]
    fn only_called_library_functions_are_linked() {
        let script = parsed("probe begin { println(ansi_new_line()) }");

        let names: Vec<&str> = script
            .functions
            .iter()
            .map(|f| f.name.name.as_str())
            .collect();
        assert_eq!(names, ["ansi_new_line"]);
    }

    #[test]
    fn a_scripts_own_function_wins_over_the_library() {
        let script =
            parsed("function ctime2(x) { return \"mine\" }\nprobe begin { println(ctime2(1)) }");

        assert_eq!(script.functions.len(), 1);
    }

    #[test]
    fn library_functions_pull_in_their_globals() {
        let script = parsed("probe begin { println(thread_indent(1)) }");

        assert!(script
            .globals
            .iter()
            .any(|g| g.name.name.starts_with("__indent")));
    }

    #[test]
    fn an_include_directory_adds_its_functions_and_aliases() {
        let dir = std::env::temp_dir().join(format!("exotap-tapset-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("mine.stp"),
            "probe mine.tick = timer.ms(10) { ticks = 1 }\nfunction twice(x) { return 2 * x }\n",
        )
        .unwrap();
        let inv = Invocation {
            include_dirs: vec![dir.clone()],
            ..Invocation::default()
        };

        let script = crate::parser::parse_with(
            "probe mine.tick { println(twice(ticks)) }",
            &Limits::default(),
            &inv,
        )
        .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();

        assert_eq!(script.probes[0].points[0].to_string(), "timer.ms(10)");
        assert_eq!(script.functions[0].name.name, "twice");
    }

    #[test]
    fn an_unreadable_include_directory_is_an_error_naming_it() {
        let inv = Invocation {
            include_dirs: vec!["/nonexistent/exotap-tapset".into()],
            ..Invocation::default()
        };

        let err = crate::parser::parse_with(
            "probe begin { println(nosuch()) }",
            &Limits::default(),
            &inv,
        )
        .unwrap_err();

        assert!(
            err.to_string().contains("/nonexistent/exotap-tapset"),
            "{err}"
        );
    }

    #[test]
    fn a_script_without_library_names_is_left_alone() {
        let script = parsed("probe begin { println(1) }");

        assert!(script.functions.is_empty() && script.globals.is_empty());
    }
}
