//! Regular expression matches (`=~`, `!~`) against the interpreter, and the ones the guest
//! cannot match refused by name.

use super::*;

/// Patterns of the regular-expression differential: alternation, classes, anchors,
/// repetition, dots, bracket expressions, case, the empty pattern, non-ASCII.
const PATTERNS: &[&str] = &[
    "",
    "^(bash|syscall-loop)$",
    "kworker|loop/",
    "^-?[0-9]+$",
    "[13579]$",
    "^[a-z]+",
    "[^a-z/0-9-]",
    "[[:digit:]]{3,}",
    "^.{4}$",
    "b.sh",
    "s.*p",
    "^$",
    "(?i)KWORKER",
    "(?i)^[A-Z]+-[a-z]+",
    "/-?[0-9]{1,2}/",
    "0:1/.*/-",
    "(ab|a)(c|sh)",
    "^a-long-name-15c/.*[05]$",
    "(/[0-9]+)+$",
    "x*",
    "é|€",
    "[[:space:]]",
    "\\.",
    "-$",
    "^[^/]{5,12}/",
];

/// The script of the regular-expression tests: each pattern against execname(), a number
/// a string of 16 to ~60 bytes (in the guest's string table), one of up to ~200, and the empty string or non-ASCII text.
fn regex_script() -> String {
    let mut body = String::new();
    for (i, p) in PATTERNS.iter().enumerate() {
        let q = p.replace('\\', "\\\\");
        body.push_str(&format!(
            "  r[{i}, execname() =~ \"{q}\", t =~ \"{q}\", s =~ \"{q}\", u !~ \"{q}\"]++\n  \
             yes[{i}] += (s =~ \"{q}\") + (execname() =~ \"{q}\") + (t =~ \"{q}\") + (v =~ \"{q}\")\n  \
             no[{i}] += (s !~ \"{q}\") + (execname() !~ \"{q}\") + (t !~ \"{q}\") + (v !~ \"{q}\")\n"
        ));
    }
    format!(
        "global r, yes, no\nprobe kernel.function(\"f\") {{\n  t = sprint($a)\n  \
         s = execname() . \"/\" . t . \"/\" . sprint($b)\n  u = s . t . s . s\n  \
         v = $a % 3 == 0 ? \"\" : $a % 3 == 1 ? \"naïve café. €5 -\" : sprint($b)\n{body}  \
         if ($a % 50 == 0) printf(\"%s %d %d\\n\", s, s =~ \"^bash\", s !~ \"[0-9]{{4}}\")\n}}\n"
    )
}

#[test]
fn regular_expression_matches_match_the_interpreter_over_many_hits() {
    let script = regex_script();
    // 100 hits intern about 400 texts over 15 bytes (the string table holds 1,024).
    let hits = hits(100);

    // Each pattern's yes and no counts in the guest's data after the last hit (the rig the
    // differential ran: no second run of the hits).
    let mut counts: Vec<(i64, i64)> = Vec::new();
    let (header, _) = differential_between(
        &script,
        &hits,
        |_, _| {},
        |_, _| {},
        Limits::default(),
        |rig, i| {
            if i + 1 < hits.len() {
                return;
            }
            let data = rig.data();
            let count = |name: &str, i: usize| match rig.layout.decode(name, &data, &rig.interner) {
                Some(Store::Array(m)) => match m.get(&vec![Value::Long(i as i64)]) {
                    Some(Value::Long(n)) => *n,
                    _ => 0,
                },
                other => panic!("{name}: {other:?}"),
            };
            counts = (0..PATTERNS.len())
                .map(|i| (count("yes", i), count("no", i)))
                .collect();
        },
    );

    assert_eq!((header.errors, header.strings), (0, 0));
    // Not vacuous: each pattern matched some subjects and missed others (the differential
    // above showed the interpreter agrees on every one).
    assert_eq!(counts.len(), PATTERNS.len());
    let always = ["", "x*"];
    let mut trivial = Vec::new();
    for (i, p) in PATTERNS.iter().enumerate() {
        let (y, n) = counts[i];
        assert_eq!(y + n, 4 * hits.len() as i64, "{p:?}");
        if y == 0 || (n == 0 && !always.contains(p)) {
            trivial.push((*p, y, n));
        }
    }
    assert!(
        trivial.is_empty(),
        "patterns that always or never matched: {trivial:?}"
    );
}

#[test]
fn regular_expressions_see_invalid_utf8_in_execname_as_the_interpreter_does() {
    // The guest matches comm's raw bytes; the interpreter, the text with invalid UTF-8
    // replaced by U+FFFD (as the live host path reads comm): the answers must agree.
    // (Keyed by a count, not by execname(): the guest keys comm's raw bytes.)
    let script = "global r, n; probe kernel.function(\"f\") { n++; r[n, \
                  execname() =~ \"^a\u{fffd}b$\", execname() =~ \"^a.b$\", \
                  execname() =~ \"é\", execname() =~ \"^a(..)?b$\"]++ }";
    let names: [&[u8]; 9] = [
        b"a\xffb",
        b"a\xc3\xa9b",
        b"a\xe2\x82b",
        b"a\xc3b",
        b"a\xef\xbf\xbdb",
        b"a\xed\xa0\x80b",
        b"a\xf0\x9f\x98b",
        b"\xc3\xa9t\xe9",
        b"ab",
    ];
    let limits = Limits::default();
    let (mut rig, prog) = rig(script, &limits);
    let output = Output::new(
        Format::Text,
        Box::new(SharedBuf::default()),
        Box::new(SharedBuf::default()),
    );
    let mut session = Session::new(&prog, limits.clone(), output, "t.stp", script);
    let h = &hits(1)[0];
    for name in names {
        rig.hit_as(h, name);
        let mut ctx = context(h);
        ctx.execname = String::from_utf8_lossy(name).into_owned();
        assert!(session.fire(0, "kernel.function(\"f\")", &ctx));
    }
    let data = rig.data();
    let compiled = rig.layout.decode("r", &data, &rig.interner).unwrap();
    let interpreted = session.global("r").unwrap().clone();
    assert_eq!(format!("{compiled:?}"), format!("{interpreted:?}"));
    // The replaced texts matched the U+FFFD pattern where the bytes were ill-formed.
    let Store::Array(m) = interpreted else {
        panic!("r: {interpreted:?}")
    };
    let fffd = m.keys().filter(|k| k[1] == Value::Long(1)).count();
    // \xff, \xe2\x82, \xc3, \xf0\x9f\x98 (one U+FFFD each) and U+FFFD itself; not
    // \xed\xa0\x80 (three).
    assert_eq!(fffd, 5, "{m:?}");
}

#[test]
fn regular_expressions_the_guest_cannot_match_are_refused_naming_why() {
    // A Unicode word boundary: no DFA (it would have to give up on non-ASCII bytes).
    let refused =
        refusals(r#"global c; probe kernel.function("f") { if (execname() =~ "\\bba") c++ }"#);
    assert!(
        refused.len() == 1 && refused[0].contains("=~") && refused[0].contains("no DFA"),
        "got {refused:?}"
    );
    // Unicode word classes in sequence: past the table's bound.
    let refused =
        refusals(r#"global c; probe kernel.function("f") { if (execname() =~ "\\w\\W\\w") c++ }"#);
    assert!(
        refused.len() == 1 && refused[0].contains("=~") && refused[0].contains("states"),
        "got {refused:?}"
    );
}
