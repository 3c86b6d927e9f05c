//! Probe aliases, expanded after parsing as SystemTap does: a probe on an alias name becomes a
//! probe on the alias's points whose body is the alias's prologue followed by the probe's body
//! (`probe NAME = POINTS { prologue }`), or the body followed by the epilogue
//! (`probe NAME += POINTS { epilogue }`). The two share one scope, so variables the prologue
//! sets are the body's locals. A use may extend the name with more components, which are
//! appended to each of the alias's points (`probe myread.return` with `probe myread =
//! kernel.function("vfs_read")`), and may use `*` to match alias names
//! (`probe syscall.*`). Aliases may be defined anywhere in the script and use other aliases.

use super::super::ast::{
    Block, Component, Expr, ExprKind, Probe, ProbeAlias, ProbePoint, Script, Stmt, StmtKind,
};
use super::super::tapset::Names;
use super::condition::glob;
use super::ParseError;

/// Replaces every probe on an alias by its expansion.
///
/// # Errors
/// [`ParseError::Alias`] when aliases nest deeper than `max_depth` (an alias that uses itself)
/// or make more than 10000 probes.
pub(super) fn expand(script: &mut Script, max_depth: usize) -> Result<(), ParseError> {
    if script.aliases.is_empty() {
        return Ok(());
    }
    let probes = std::mem::take(&mut script.probes);
    for probe in probes {
        expand_probe(probe, &script.aliases, 0, max_depth, &mut script.probes)?;
    }
    Ok(())
}

/// Most probes alias expansion may make (aliases that each use two others grow exponentially).
const MAX_PROBES: usize = 10_000;

fn expand_probe(
    probe: Probe,
    aliases: &[ProbeAlias],
    depth: usize,
    max_depth: usize,
    out: &mut Vec<Probe>,
) -> Result<(), ParseError> {
    if out.len() > MAX_PROBES {
        return Err(ParseError::Alias {
            message: format!("probe aliases expand to more than {MAX_PROBES} probes"),
            span: probe.span,
        });
    }
    let mut plain = Vec::new();
    let mut derived = Vec::new();
    for point in &probe.points {
        let uses = uses_of(point, aliases);
        if uses.is_empty() {
            plain.push(point.clone());
            continue;
        }
        if depth >= max_depth {
            return Err(ParseError::Alias {
                message: format!(
                    "probe alias '{point}' expands more than {max_depth} levels deep (does an alias use itself?)"
                ),
                span: point.span,
            });
        }
        for (alias, suffix) in uses {
            let points = alias
                .points
                .iter()
                .map(|target| {
                    let mut target = target.clone();
                    target.components.extend(suffix.iter().cloned());
                    target.optional |= point.optional;
                    target
                })
                .collect();
            let prologue = if alias.library && !alias.epilogue {
                used_prologue(&alias.body.stmts, &probe)
            } else {
                alias.body.stmts.clone()
            };
            let (first, second) = if alias.epilogue {
                (&probe.body.stmts, &prologue)
            } else {
                (&prologue, &probe.body.stmts)
            };
            let stmts = first.iter().chain(second).cloned().collect();
            derived.push(Probe {
                points,
                condition: probe.condition.clone(),
                body: Block {
                    stmts,
                    span: probe.body.span,
                },
                span: probe.span,
            });
        }
    }
    if !plain.is_empty() {
        out.push(Probe {
            points: plain,
            ..probe
        });
    }
    for d in derived {
        expand_probe(d, aliases, depth + 1, max_depth, out)?;
    }
    Ok(())
}

/// The statements of a library alias's prologue that `probe` needs: an assignment to a local
/// that neither the probe (body and condition) nor a later needed statement names is dropped,
/// as SystemTap elides unused tapset variables (so `probe syscall.read { n++ }` reads no
/// `argstr`, and faults no user string).
fn used_prologue(prologue: &[Stmt], probe: &Probe) -> Vec<Stmt> {
    let mut used = Names::default();
    used.block(&probe.body.stmts);
    if let Some(c) = &probe.condition {
        used.expr(c);
    }
    let mut kept = Vec::new();
    for s in prologue.iter().rev() {
        let assigned = match &s.kind {
            StmtKind::Expr(Expr {
                kind: ExprKind::Assign(None, parts),
                ..
            }) => match &parts.0.kind {
                ExprKind::Var(name) => Some(name),
                _ => None,
            },
            _ => None,
        };
        if assigned.is_some_and(|name| !used.vars.contains(name)) {
            continue;
        }
        used.stmt(s);
        kept.push(s.clone());
    }
    kept.reverse();
    kept
}

/// The aliases `point` uses, with the components it adds after the alias name. An alias
/// named exactly (or matched by a wildcard) wins over one that only names a prefix.
fn uses_of<'a>(
    point: &ProbePoint,
    aliases: &'a [ProbeAlias],
) -> Vec<(&'a ProbeAlias, Vec<Component>)> {
    let mut found: Vec<(&ProbeAlias, Vec<Component>)> = aliases
        .iter()
        .filter_map(|a| {
            a.names
                .iter()
                .filter_map(|name| prefix_match(name, point))
                .min_by_key(Vec::len)
                .map(|suffix| (a, suffix))
        })
        .collect();
    let shortest = found.iter().map(|(_, s)| s.len()).min();
    found.retain(|(_, s)| Some(s.len()) == shortest);
    found
}

/// When `name` matches the first components of `point`: the remaining components.
fn prefix_match(name: &ProbePoint, point: &ProbePoint) -> Option<Vec<Component>> {
    if name.components.len() > point.components.len() {
        return None;
    }
    let same = name.components.iter().zip(&point.components).all(|(n, p)| {
        let named = n.name == p.name
            || (p.name.contains('*') && glob(p.name.as_bytes(), n.name.as_bytes()));
        named && n.args == p.args
    });
    same.then(|| point.components[name.components.len()..].to_vec())
}

#[cfg(test)]
mod tests {
    use crate::ast::{ExprKind, Script, StmtKind};
    use crate::parser::{parse, ParseError};
    use crate::Limits;

    fn parse_ok(src: &str) -> Script {
        parse(src, &Limits::default()).unwrap()
    }

    fn points(script: &Script) -> Vec<String> {
        script
            .probes
            .iter()
            .map(|p| {
                p.points
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .collect()
    }

    fn assigned_names(script: &Script, probe: usize) -> Vec<String> {
        script.probes[probe]
            .body
            .stmts
            .iter()
            .filter_map(|s| match &s.kind {
                StmtKind::Expr(e) => match &e.kind {
                    ExprKind::Assign(_, parts) => match &parts.0.kind {
                        ExprKind::Var(n) => Some(n.clone()),
                        _ => None,
                    },
                    _ => None,
                },
                _ => None,
            })
            .collect()
    }

    #[test]
    fn alias_use_runs_the_prologue_before_the_body() {
        let script = parse_ok(
            "probe myread = kernel.function(\"vfs_read\") { a = 1 }\nprobe myread { b = a }",
        );
        assert_eq!(points(&script), vec!["kernel.function(\"vfs_read\")"]);
        assert_eq!(assigned_names(&script, 0), vec!["a", "b"]);
    }

    #[test]
    fn epilogue_alias_runs_after_the_body() {
        let script = parse_ok("probe t += timer.ms(10) { a = 1 }\nprobe t { b = 2 }");
        assert_eq!(assigned_names(&script, 0), vec!["b", "a"]);
    }

    #[test]
    fn alias_with_several_points_gives_one_probe_on_all_of_them() {
        let script = parse_ok("probe two = begin, end { }\nprobe two { }");
        assert_eq!(points(&script), vec!["begin, end"]);
    }

    #[test]
    fn a_use_next_to_plain_points_is_split_from_them() {
        let script = parse_ok("probe a = end { x = 1 }\nprobe begin, a { }");
        assert_eq!(points(&script), vec!["begin", "end"]);
        assert_eq!(assigned_names(&script, 0), Vec::<String>::new());
        assert_eq!(assigned_names(&script, 1), vec!["x"]);
    }

    #[test]
    fn aliases_may_use_aliases_defined_later() {
        let script = parse_ok("probe outer { }\nprobe outer = inner { }\nprobe inner = begin { }");
        assert_eq!(points(&script), vec!["begin"]);
    }

    #[test]
    fn suffix_after_an_alias_name_extends_its_points() {
        let script =
            parse_ok("probe myread = kernel.function(\"vfs_read\") { }\nprobe myread.return { }");
        assert_eq!(
            points(&script),
            vec!["kernel.function(\"vfs_read\").return"]
        );
    }

    #[test]
    fn wildcard_use_matches_every_alias_name() {
        let script = parse_ok("probe s.a = begin { }\nprobe s.b = end { }\nprobe s.* { }");
        assert_eq!(points(&script), vec!["begin", "end"]);
    }

    #[test]
    fn exponential_alias_expansion_is_cut() {
        let mut src = String::from("probe a0 = begin { }\n");
        for k in 1..30 {
            src.push_str(&format!("probe a{k} = a{}, a{} {{ }}\n", k - 1, k - 1));
        }
        src.push_str("probe a29 { }");
        let err = parse(&src, &Limits::default()).unwrap_err();
        assert!(err.to_string().contains("more than 10000 probes"), "{err}");
    }

    #[test]
    fn alias_that_uses_itself_is_an_error() {
        let err = parse("probe a = a { }\nprobe a { }", &Limits::default()).unwrap_err();
        assert!(matches!(err, ParseError::Alias { .. }), "{err}");
        assert!(
            err.to_string().contains("does an alias use itself"),
            "{err}"
        );
    }
}
