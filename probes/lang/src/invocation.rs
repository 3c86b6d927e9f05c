//! How a script was invoked: its command-line arguments (`$1`, `@1`, `argc`, `argv`), guru
//! mode, the target process (`-x PID`) and the facts about the target kernel. The
//! preprocessor, the checker and the runtime read it; the command line fills it.

use super::ast::{
    Block, Component, Expr, ExprKind, Global, Ident, IndexExpr, Literal, Probe, ProbePoint, Script,
    Span, Stmt, StmtKind,
};
use super::facts::TargetFacts;

/// How many `argv` slots SystemTap's argv tapset fills (with "" beyond the arguments given).
pub const ARGV_SLOTS: usize = 32;

/// The SystemTap version exotap answers `systemtap_v` with: the version of the language and
/// of the example suite it follows.
pub const SYSTEMTAP_VERSION: &str = "4.8";

/// What the command line says about a script's run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Invocation {
    /// Arguments after the script: `$1`/`@1` and `argv[1]` are the first.
    pub args: Vec<String>,
    /// `-g`: guru mode (`guru_mode == 1` in preprocessor conditions).
    pub guru: bool,
    /// `-x PID`: what `target()` returns (0 without).
    pub target_pid: Option<i64>,
    /// The kernel the script will run against.
    pub facts: TargetFacts,
    /// `-I DIR`: directories whose `*.stp` files join the tapset library.
    pub include_dirs: Vec<std::path::PathBuf>,
    /// `-G NAME=VALUE`: initial values of scalar globals, as stap's `-G`.
    pub globals: Vec<(String, String)>,
    /// `-w`: the checker's warnings are not printed, as stap's `-w`.
    pub no_warnings: bool,
    /// `--procfs-dir`, `--http`: where the host serves the script's procfs files.
    pub host_files: exotap_probes_base::procfs::HostFiles,
}

impl Invocation {
    /// An invocation with these arguments and default facts.
    pub fn with_args<S: Into<String>>(args: impl IntoIterator<Item = S>) -> Self {
        Invocation {
            args: args.into_iter().map(Into::into).collect(),
            ..Invocation::default()
        }
    }

    /// SystemTap's `systemtap_privilege`: exotap works from outside the guest with every
    /// right a debugger has, which is SystemTap's `stapdev`.
    pub fn privilege(&self) -> &'static str {
        "stapdev"
    }
}

/// Declares SystemTap's `argc` (the argument count), `argv` (the arguments as strings,
/// `argv[1]` first, ["" up to slot 32](ARGV_SLOTS)) and `argv_1`... (one slot each) for a
/// script that names them without
/// declaring them itself, as SystemTap's argv tapset does: two globals and a `begin` probe,
/// first of all probes, that fills `argv`.
pub fn declare_argv(script: &mut Script, inv: &Invocation, names_used: impl Fn(&str) -> bool) {
    let declared = |script: &Script, name: &str| script.globals.iter().any(|g| g.name.name == name);
    let span = Span::default();
    let ident = |name: &str| Ident {
        name: name.to_string(),
        span,
    };
    if names_used("argc") && !declared(script, "argc") {
        let count = i64::try_from(inv.args.len()).unwrap_or(i64::MAX);
        script.globals.push(Global {
            name: ident("argc"),
            init: Some((Literal::Num(count), span)),
            array_size: None,
            wrap: false,
        });
    }
    // The tapset's per-slot globals: argv_1 ... argv_32, the argument or "".
    for k in 1..=inv.args.len().max(ARGV_SLOTS) {
        let name = format!("argv_{k}");
        if names_used(&name) && !declared(script, &name) {
            let value = inv.args.get(k - 1).cloned().unwrap_or_default();
            script.globals.push(Global {
                name: ident(&name),
                init: Some((Literal::Str(value), span)),
                array_size: None,
                wrap: false,
            });
        }
    }
    if !names_used("argv") || declared(script, "argv") {
        return;
    }
    let slots = inv.args.len().max(ARGV_SLOTS);
    script.globals.push(Global {
        name: ident("argv"),
        init: None,
        array_size: Some(i64::try_from(slots).unwrap_or(i64::MAX)),
        wrap: false,
    });
    let expr = |kind| Expr { kind, span };
    let stmts = (1..=slots)
        .map(|k| {
            let slot = expr(ExprKind::Index(Box::new(IndexExpr {
                array: ident("argv"),
                keys: vec![expr(ExprKind::Num(i64::try_from(k).unwrap_or(i64::MAX)))],
            })));
            let value = expr(ExprKind::Str(
                inv.args.get(k - 1).cloned().unwrap_or_default(),
            ));
            Stmt {
                kind: StmtKind::Expr(expr(ExprKind::Assign(None, Box::new((slot, value))))),
                span,
            }
        })
        .collect();
    let begin = ProbePoint {
        components: vec![Component {
            name: "begin".to_string(),
            args: Vec::new(),
            span,
        }],
        optional: false,
        sufficient: false,
        span,
    };
    script.probes.insert(
        0,
        Probe {
            points: vec![begin],
            condition: None,
            body: Block { stmts, span },
            span,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv_is_declared_and_filled_when_named() {
        let mut script = Script::default();
        declare_argv(&mut script, &Invocation::with_args(["a", "b"]), |n| {
            n == "argv"
        });
        assert_eq!(
            (
                script.globals.len(),
                script.globals[0].array_size,
                script.probes[0].body.stmts.len()
            ),
            (1, Some(32), 32)
        );
    }

    #[test]
    fn argc_is_the_argument_count() {
        let mut script = Script::default();
        declare_argv(&mut script, &Invocation::with_args(["a", "b"]), |n| {
            n == "argc"
        });
        assert_eq!(
            script.globals[0].init.as_ref().map(|i| &i.0),
            Some(&Literal::Num(2))
        );
        assert!(script.probes.is_empty());
    }

    #[test]
    fn argv_slot_globals_hold_one_argument_each() {
        let mut script = Script::default();
        declare_argv(&mut script, &Invocation::with_args(["a"]), |n| {
            n == "argv_1" || n == "argv_2"
        });
        let inits: Vec<Option<Literal>> = script
            .globals
            .iter()
            .map(|g| g.init.as_ref().map(|i| i.0.clone()))
            .collect();
        assert_eq!(
            inits,
            vec![
                Some(Literal::Str("a".into())),
                Some(Literal::Str(String::new()))
            ]
        );
    }

    #[test]
    fn a_script_declaring_argv_keeps_its_own() {
        let mut script = Script::default();
        script.globals.push(Global {
            name: Ident {
                name: "argv".into(),
                span: Span::default(),
            },
            init: None,
            array_size: None,
            wrap: false,
        });
        declare_argv(&mut script, &Invocation::default(), |n| {
            n == "argv" || n == "argc"
        });
        assert_eq!((script.globals.len(), script.probes.len()), (2, 0));
    }
}
