//! Probe points in kernel modules: `module("m").function(...)`, `.statement(...)` and
//! `.field(...)` (and `kprobe.module(...)`), each a [`PointKind::ModuleFunction`] found in the
//! live guest when the script attaches.

use super::{
    parse_lines, split_location, FieldAccess, FunctionSite, MemberAccess, PointError, PointKind,
    SourceLine,
};
use crate::ast::{Literal, ProbePoint};

/// The one non-empty string argument of component `i` of `point`.
fn one_string(point: &ProbePoint, i: usize) -> Option<String> {
    match point.components.get(i).map(|c| c.args.as_slice()) {
        Some([Literal::Str(s)]) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// `module("M").function("F")[.call|.return]` (`first` = index of the `module` component:
/// 1 for `kprobe.module(...)`); `rest` the components after `function`.
pub(super) fn module_function(
    point: &ProbePoint,
    first: usize,
    rest: &[&str],
) -> Result<PointKind, PointError> {
    let family = if first == 0 {
        "module.function"
    } else {
        "kprobe.module.function"
    };
    let bad = |reason: String| PointError::BadArgument {
        family: family.to_string(),
        reason,
        span: point.span,
    };
    let text = |i: usize, what: &str| {
        one_string(point, i)
            .ok_or_else(|| bad(format!("expected one non-empty string, the {what}")))
    };
    let module = text(first, "module's name")?;
    let (pattern, file, line) = split_location(&text(first + 1, "function's name")?);
    if pattern.contains([':', '+']) {
        return Err(PointError::OutOfScope {
            text: point.to_string(),
            reason: "a module function is named alone or with its file (f@FILE, f@FILE:LINE); \
                     for an offset into it write module(\"m\").statement(...) with a source line"
                .to_string(),
            span: point.span,
        });
    }
    if pattern.is_empty() || file.as_deref().is_some_and(str::is_empty) {
        return Err(bad("expected \"f\", \"f@FILE\" or \"f@FILE:LINE\"".into()));
    }
    // `f@FILE:N`: the functions with code of line N of FILE (or lines N-M).
    let line = match line {
        None => None,
        Some(spec) => Some(parse_lines(&spec).ok_or_else(|| {
            bad(format!(
                "'{spec}' is not a line (write N or N-M; every line of a function is \
                 module(\"m\").statement(\"f@FILE:N-M\"))"
            ))
        })?),
    };
    if line.is_some() && file.as_deref().is_some_and(|f| f.contains(['*', '?', '['])) {
        return Err(bad(
            "a source line needs a file name without wildcards".into()
        ));
    }
    let site = match rest {
        [] => FunctionSite::Entry,
        ["call"] => FunctionSite::Call,
        ["return"] => FunctionSite::Return,
        ["return", "maxactive"] => match point.components.get(first + 3).map(|c| c.args.as_slice())
        {
            Some([Literal::Num(n)]) if *n > 0 => FunctionSite::Return,
            _ => return Err(bad("maxactive takes one positive number".into())),
        },
        // From the module's DWARF, when the module is placed.
        ["inline"] if line.is_some() => {
            return Err(PointError::OutOfScope {
                text: point.to_string(),
                reason: "a line does not select inlined instances (write \
                         module(\"m\").statement(\"f@FILE:LINE\") for the code of a line)"
                    .to_string(),
                span: point.span,
            })
        }
        // `f@FILE`: the instances of the functions FILE declares.
        ["inline"] => FunctionSite::Inline,
        _ => {
            return Err(PointError::Unknown {
                text: point.to_string(),
                span: point.span,
            })
        }
    };
    Ok(PointKind::ModuleFunction {
        module,
        pattern,
        file,
        line,
        site,
        statement: None,
        field: None,
        offset: None,
    })
}

/// `module("m").field("struct S", "member").read|.write|.call`: the member's accesses in
/// the module's functions.
pub(super) fn module_field(point: &ProbePoint, access: &str) -> Result<PointKind, PointError> {
    let bad = |reason: &str| PointError::BadArgument {
        family: "module.field".to_string(),
        reason: reason.to_string(),
        span: point.span,
    };
    let module = one_string(point, 0)
        .ok_or_else(|| bad("expected one non-empty string, the module's name"))?;
    let (structure, member) = match point.components.get(1).map(|c| c.args.as_slice()) {
        Some([Literal::Str(s), Literal::Str(m)]) if !s.is_empty() && !m.is_empty() => {
            (s.clone(), m.clone())
        }
        _ => return Err(bad("expected (\"struct S\", \"member\")")),
    };
    let access = FieldAccess::from_suffix(access).ok_or_else(|| PointError::Unknown {
        text: point.to_string(),
        span: point.span,
    })?;
    Ok(PointKind::ModuleFunction {
        module,
        pattern: "*".to_string(),
        file: None,
        line: None,
        site: FunctionSite::Entry,
        statement: None,
        field: Some(MemberAccess {
            structure,
            member,
            access,
        }),
        offset: None,
    })
}

/// `module("m").statement("f@FILE:LINE")` (or `:N-M`): the line's code in the module's
/// functions matching `f`; `module("m").statement("f+OFFSET")`: the instruction at a byte
/// offset into the function f.
pub(super) fn module_statement(point: &ProbePoint) -> Result<PointKind, PointError> {
    let bad = |reason: &str| PointError::BadArgument {
        family: "module.statement".to_string(),
        reason: reason.to_string(),
        span: point.span,
    };
    let module = one_string(point, 0)
        .ok_or_else(|| bad("expected one non-empty string, the module's name"))?;
    let spec =
        one_string(point, 1).ok_or_else(|| bad("expected \"f@FILE:LINE\" or \"f+OFFSET\""))?;
    if !spec.contains('@') {
        if let Some((function, offset)) = crate::kernel_points::function_offset(&spec) {
            if function.contains(['*', '?', '[']) {
                return Err(bad(
                    "an offset is into one function: name it without wildcards",
                ));
            }
            return Ok(PointKind::ModuleFunction {
                module,
                pattern: function.to_owned(),
                file: None,
                line: None,
                site: FunctionSite::Entry,
                statement: None,
                field: None,
                offset: Some(offset),
            });
        }
    }
    let (pattern, file, line) = split_location(&spec);
    let (Some(file), Some(line)) = (file, line) else {
        return Err(bad(
            "expected \"f@FILE:LINE\" or \"f+OFFSET\" (an absolute address in a module is \
             not supported: modules move)",
        ));
    };
    if pattern.is_empty() || file.is_empty() {
        return Err(bad("expected \"f@FILE:LINE\" with a function and a file"));
    }
    if file.contains(['*', '?', '[']) {
        return Err(bad("a source line needs a file name without wildcards"));
    }
    let lines = if line.trim() == "*" {
        None
    } else {
        Some(
            parse_lines(&line)
                .ok_or_else(|| bad(&format!("'{line}' is not a line (write N, N-M or *)")))?,
        )
    };
    Ok(PointKind::ModuleFunction {
        module,
        pattern,
        file: None,
        line: None,
        site: FunctionSite::Entry,
        statement: Some(SourceLine { file, lines }),
        field: None,
        offset: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::kind;
    use super::*;

    #[test]
    fn module_functions_are_points_and_what_needs_a_modules_dwarf_is_refused_with_the_reason() {
        assert_eq!(
            kind(r#"module("ext4").function("ext4_*").return.maxactive(4)"#).unwrap(),
            PointKind::ModuleFunction {
                module: "ext4".into(),
                pattern: "ext4_*".into(),
                file: None,
                line: None,
                site: FunctionSite::Return,
                statement: None,
                field: None,
                offset: None,
            }
        );
        assert_eq!(
            kind(r#"kprobe.module("e*").function("ext4_sync_fs")"#).unwrap(),
            PointKind::ModuleFunction {
                module: "e*".into(),
                pattern: "ext4_sync_fs".into(),
                file: None,
                line: None,
                site: FunctionSite::Entry,
                statement: None,
                field: None,
                offset: None,
            }
        );
        assert_eq!(
            kind(r#"module("ext4").function("ext4_*").inline"#).unwrap(),
            PointKind::ModuleFunction {
                module: "ext4".into(),
                pattern: "ext4_*".into(),
                file: None,
                line: None,
                site: FunctionSite::Inline,
                statement: None,
                field: None,
                offset: None,
            }
        );
        assert_eq!(
            kind(r#"module("evdev").statement("evdev_*@drivers/input/evdev.c:478-480")"#).unwrap(),
            PointKind::ModuleFunction {
                module: "evdev".into(),
                pattern: "evdev_*".into(),
                file: None,
                line: None,
                site: FunctionSite::Entry,
                statement: Some(SourceLine {
                    file: "drivers/input/evdev.c".into(),
                    lines: Some((478, 480)),
                }),
                field: None,
                offset: None,
            }
        );
        assert_eq!(
            kind(r#"module("evdev").field("struct evdev_client", "bufsize").write"#).unwrap(),
            PointKind::ModuleFunction {
                module: "evdev".into(),
                pattern: "*".into(),
                file: None,
                line: None,
                site: FunctionSite::Entry,
                statement: None,
                field: Some(MemberAccess {
                    structure: "struct evdev_client".into(),
                    member: "bufsize".into(),
                    access: FieldAccess::Write,
                }),
                offset: None,
            }
        );
        assert_eq!(
            kind(r#"module("ext4").function("ext4_*@fs/ext4/super.c").return"#).unwrap(),
            PointKind::ModuleFunction {
                module: "ext4".into(),
                pattern: "ext4_*".into(),
                file: Some("fs/ext4/super.c".into()),
                line: None,
                site: FunctionSite::Return,
                statement: None,
                field: None,
                offset: None,
            }
        );
        assert_eq!(
            kind(r#"module("ext4").function("ext4_*@fs/ext4/super.c:12-14").call"#).unwrap(),
            PointKind::ModuleFunction {
                module: "ext4".into(),
                pattern: "ext4_*".into(),
                file: Some("fs/ext4/super.c".into()),
                line: Some((12, 14)),
                site: FunctionSite::Call,
                statement: None,
                field: None,
                offset: None,
            }
        );
        for (point, why) in [
            (
                r#"module("ext4").function("ext4_sync_fs@fs/ext4/super.c:12").inline"#,
                "a line does not select inlined instances",
            ),
            (
                r#"module("ext4").function("ext4_sync_fs@fs/ext4/super.c:*")"#,
                "is not a line",
            ),
            (
                r#"module("ext4").function("ext4_sync_fs@fs/ext4/*.c:3")"#,
                "without wildcards",
            ),
            (
                r#"module("ext4").function("ext4_sync_fs+4")"#,
                "for an offset into it",
            ),
            (r#"module("ext4").function("@fs/ext4/super.c")"#, "expected"),
            (
                r#"module("ext4").statement("ext4_*+4")"#,
                "without wildcards",
            ),
            (
                r#"module("ext4").statement("0xffffffffc0001000")"#,
                "modules move",
            ),
            (
                r#"module("ext4").statement("f@fs/ext4/*.c:3")"#,
                "without wildcards",
            ),
            (
                r#"module("ext4").statement("f@fs/ext4/super.c:9-3")"#,
                "is not a line",
            ),
            (
                r#"module("ext4").statement("f@fs/ext4/super.c:*-3")"#,
                "is not a line",
            ),
            (r#"module("ext4").function("")"#, "non-empty string"),
            (
                r#"module("evdev").field("struct evdev_client").write"#,
                "expected (\"struct S\"",
            ),
            (
                r#"module("evdev").field("struct evdev_client", "bufsize")"#,
                "say .read",
            ),
            (
                r#"module("ext4").function("f").call(3)"#,
                "takes no argument",
            ),
        ] {
            let err = kind(point).unwrap_err();
            assert!(err.to_string().contains(why), "{point}: {err}");
        }
    }
}
