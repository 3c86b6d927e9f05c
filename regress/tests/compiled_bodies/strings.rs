//! Strings: in keys, values and printf; built in the guest; cut at MAXSTRINGLEN; a full string
//! table, and one the host collects; the string functions (isinstr, strpos, stringat,
//! strtol, str_replace, sprintf).

use exotap_probes::compile::data::collect::{Collection, Collections};
use exotap_probes::compile::data::{StringTable, IN_USE, STRING_ENTRIES};

use super::*;

#[test]
fn strings_in_keys_and_values_and_printf_match_the_interpreter() {
    let script = r#"
        global by, first, n
        probe kernel.function("f") {
          n++
          if (!(execname() in first)) first[execname()] = probefunc()
          s = execname() == "bash" ? "shell" : pp()
          by[s, execname(), $a] += $b % 1000
          if (n % 7 == 0) printf("%s %d %5d|%-4s|%x\n", execname(), n, $a, s == "shell" ? "sh" : "-", $b & 0xffff)
          if (n % 50 == 0) println("n=", n, " ", s)
        }
    "#;

    let header = differential(script, &hits(300));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn strings_built_in_the_guest_match_the_interpreter_over_many_hits() {
    // Short built strings stay inline, long ones (pp() is 21 bytes) go to the guest's
    // string table; both flow through a function's return, keys, values and printf.
    let script = r#"
        global who, last, lens, n, before
        function label(p) { return execname() . ":" . sprint(p) }
        probe kernel.function("f") {
          n++
          k = label(pid())
          who[k]++
          long = k . "/" . pp() . "/" . sprint($a)
          lens[substr(long, 0, 20), strlen(k)] += strlen(long)
          if (strlen(execname()) > 10) last = long
          else last .= "+"
          if (n % 37 == 0) printf("%s %d %s|%s\n", k, strlen(long), substr(long, 3, 12), last)
          if (n % 91 == 0) println(long, " ", long == k . "/" . pp() . "/" . sprint($a))
          if (long < last) before[k]++
          if (k >= "corpus" . sprint($a % 5)) before["ge"]++
        }
    "#;

    let header = differential(script, &hits(400));

    assert_eq!((header.errors, header.strings), (0, 0));
}

#[test]
fn built_strings_are_cut_at_a_small_maxstringlen_as_in_the_interpreter() {
    // MAXSTRINGLEN 8: every built string holds at most 7 bytes, sprint() of a long too.
    let script = r#"
        global keys, last
        probe kernel.function("f") {
          s = execname() . ":" . sprint($b)
          keys[s]++
          last = sprint($b) . substr(s, 2, 30)
          println(s, "|", strlen(last), "|", text_str(s . "\n"), "|", sprint($b))
          if (s < last) keys["lt"]++
        }
    "#;
    let limits = Limits {
        max_string_len: 8,
        ..Limits::default()
    };

    let (header, failed) = differential_limits(script, &hits(120), |_, _| {}, |_, _| {}, limits);

    assert_eq!((header.errors, header.strings, failed), (0, 0, 0));
}

#[test]
fn a_full_string_table_ends_hits_with_counted_probe_errors() {
    // STRING_ENTRIES + 76 distinct strings over 15 bytes; the table holds STRING_ENTRIES
    // (fewer where a probe chain runs out first): the rest end their hit with a counted
    // error, never an overflow of the table.
    let script =
        r#"global c[8192]; probe kernel.function("f") { c[sprint($a) . "-more-than-fifteen"]++ }"#;
    let limits = Limits::default();
    let (mut rig, _prog) = rig(script, &limits);
    let n = i64::from(STRING_ENTRIES) + 76;

    for i in 0..n {
        rig.hit(&Hit {
            comm: "bash",
            pid: 1,
            tgid: 1,
            a: i,
            b: 0,
        });
    }

    let data = rig.data();
    let header = Header::decode(&data);
    let Some(Store::Array(c)) = rig.layout.decode("c", &data, &rig.interner) else {
        panic!("c decodes as an array");
    };
    assert!(header.strings >= 76, "{header:?}");
    assert_eq!(header.errors, header.strings);
    assert_eq!(c.len() as u64 + header.strings, n as u64);
    for (k, v) in &c {
        let [Value::Str(text)] = k.as_slice() else {
            panic!("key {k:?}");
        };
        let a: i64 = text
            .strip_suffix("-more-than-fifteen")
            .unwrap()
            .parse()
            .unwrap();
        assert!((0..n).contains(&a) && *v == Value::Long(1), "{text} {v:?}");
    }
}

#[test]
fn strings_replaced_far_past_the_table_match_the_interpreter_when_the_host_collects() {
    // Two new long strings a hit over 3,000 hits: some 6,000 texts through a table of
    // STRING_ENTRIES (4,096) entries, which the host collects every 100 hits as the live
    // loop does at its looks. Without the collections the table fills within 2,100 hits
    // (the test above).
    let script = r#"
        global last, by, n
        probe kernel.function("f") {
          n++
          last = sprint($a) . ":" . sprint($b) . "-a-long-built-string"
          by[n % 7] = last . "/" . execname()
          if (n % 500 == 0) println(last)
        }
    "#;
    let mut done = Collections::default();

    let (header, _) = differential_between(
        script,
        &hits(3000),
        |_, _| {},
        |_, _| {},
        Limits::default(),
        |rig, i| {
            if i % 100 == 99 {
                done.count(rig.collect_strings());
            }
        },
    );

    assert_eq!(
        (header.errors, header.strings, done.collections, done.busy),
        (0, 0, 30, 0)
    );
    assert!(
        done.freed > u64::from(STRING_ENTRIES),
        "only {} entries freed",
        done.freed
    );
}

#[test]
fn a_collection_keeps_what_globals_hold_and_waits_out_a_hit_in_progress() {
    // The second hit is stopped once its string is in the table, held by a local only:
    // the collection then must free nothing. After the hit a global holds it.
    let script = r#"
        global kept, later
        probe kernel.function("f") {
          s = sprint($a) . "-held-by-a-local-only"
          if ($b == 0) kept = s . "-and-a-global"
          else later = s
        }
    "#;
    let (mut rig, _) = rig(script, &Limits::default());
    let table = rig.layout.strings.expect("a string table");
    let in_use = move |uc: &UnicornMachine| {
        let mut word = [0u8; 8];
        uc.read(DATA + table.head + IN_USE, &mut word).unwrap();
        u64::from_le_bytes(word)
    };
    let hit = |a, b| Hit {
        comm: "bash",
        pid: 1,
        tgid: 1,
        a,
        b,
    };
    rig.hit(&hit(1, 0));
    let before = in_use(&rig.uc);

    let stopped = rig.hit_until(&hit(2, 1), |uc| in_use(uc) > before);
    let in_progress = rig.collect_strings();
    rig.finish_hit();
    let after = rig.collect_strings();

    let data = rig.data();
    let held = |name: &str| {
        let at = rig.layout.globals[name].offset as usize;
        let index = u64::from_le_bytes(data[at + 8..at + 16].try_into().unwrap());
        let entry = (table.offset + index * table.entry_size()) as usize;
        let state = u64::from_le_bytes(data[entry..entry + 8].try_into().unwrap());
        (data[at], state, table.text_of(&data, index).unwrap())
    };
    assert!(stopped);
    assert_eq!(in_progress, Collection::Busy(1));
    // Freed: the first hit's `s` and the long constant, which the guest interns again
    // where it is evaluated.
    assert_eq!(after, Collection::Collected { freed: 2, live: 2 });
    assert_eq!(
        (held("kept"), held("later")),
        (
            (2, 2, "1-held-by-a-local-only-and-a-global".to_string()),
            (2, 2, "2-held-by-a-local-only".to_string())
        )
    );
    let head = &data[table.head as usize..];
    assert_eq!(
        (
            StringTable::in_use(head),
            StringTable::hits_in_progress(head)
        ),
        (2, 0)
    );
}

#[test]
fn isinstr_strpos_and_stringat_match_the_interpreter_over_many_hits() {
    // s is over 15 bytes (in the guest's string table); the needles are empty, missing,
    // longer than the haystack, at the start, the end and in between. A negative or
    // too large index to stringat is a probe error (with the interpreter's message in
    // catch).
    let script = r#"
        global pos, has, at, msgs, n
        probe kernel.function("f") {
          n++
          s = execname() . "/" . sprint($a) . "/" . pp()
          t = sprint($a % 10)
          pos[execname(), strpos(s, t), strpos(s, "\")")]++
          has[isinstr(s, "kworker"), isinstr(execname(), ""), isinstr("", t), isinstr(t, s)]++
          p = strpos(pp(), "\"f\"") + strpos("", "") * 100 + strpos("ab", "abc") * 1000
          try { at[stringat(s, $a % 40)]++ } catch (m) { msgs[m, $a % 40 < 0]++ }
          if (n % 17 == 0) printf("%d %d %d %d\n", p, strpos(s, "/"), stringat(execname(), 0), strpos(execname(), "-"))
          if ($a % 9 == 0) at[stringat(t, 5)]++
        }
    "#;

    // 200 hits: s and the strings it is built from intern about 600 texts over 15 bytes
    // (the table holds STRING_ENTRIES, 4,096).
    let (header, failed) = differential_with(script, &hits(200));

    assert!(
        failed > 10,
        "the hits reach stringat past a string: {failed}"
    );
    assert_eq!(
        (header.errors, header.arguments, header.strings),
        (failed, failed, 0)
    );
}

#[test]
fn strtol_matches_the_interpreter_in_every_base_and_on_bad_input() {
    let script = concat!(
        r#"
        global v, w, x, msgs, n
        probe kernel.function("f") {
          n++
          t = sprint($b)
          v[strtol(t, 10) - $b, strtol(t, 16), strtol(t, 8), strtol(t, 2), strtol(t, 36)]++
          w[strtol("0x" . t, 16), strtol(" \t+" . t, 10), strtol("0X" . substr(t, 1, 5), 16),
            strtol(execname(), 36)]++
          x[strtol("", 10), strtol("-", 10), strtol("12abc", 10), strtol("0x", 16)]++
          x[strtol("zZ", 36), strtol("-0x1F", 16), strtol("0777", 8), strtol("9", 8)]++
"#,
        // White space beyond ASCII, as Rust's trim_start skips it (and bytes it does not).
        "x[strtol(\"\u{a0}\u{2003}\u{3000}-12\", 10), strtol(\"\u{85}5\", 10),\n",
        "  strtol(\"\u{2029}\u{1680}\u{205f}\u{202f}\u{200a}7\", 10), strtol(\"\u{2030} 7\", 10)]++\n",
        "x[strtol(\"\u{2000}\u{2028}+0xff\", 16), strtol(\"\u{a1} 1\", 10),\n",
        "  strtol(\"\u{1680}\u{180e}1\", 10), strtol(\"\u{b}x\", 36)]++\n",
        r#"
          try { msgs["", strtol(t, $a % 40)]++ } catch (m) { msgs[m, 0]++ }
          if (n % 23 == 0) println(strtol(t, 16), " ", strtol(t . "g", 17))
        }
    "#
    );

    let (header, failed) = differential_with(script, &hits(400));

    assert_eq!((header.errors, header.arguments, failed), (0, 0, 0));
}

#[test]
fn strtol_with_a_bad_base_is_a_probe_error() {
    let script = r#"global v; probe kernel.function("f") { v = strtol("12", $a % 3) }"#;

    let (header, failed) = differential_with(script, &hits(60));

    assert!(failed > 10, "bases 0 and 1 come up: {failed}");
    assert_eq!((header.errors, header.arguments), (failed, failed));
}

#[test]
fn str_replace_matches_the_interpreter_up_to_maxstringlen() {
    // Replacements that shrink, grow past 15 bytes into the string table and past
    // MAXSTRINGLEN (cut at 511 bytes, or before a character whose bytes would straddle it).
    let script = r#"
        global r, lens, n
        probe kernel.function("f") {
          n++
          s = execname() . "/" . sprint($a) . "/" . pp()
          r[str_replace(s, "/", "--"), str_replace(execname(), "", "x"), str_replace(execname(), "o", "")]++
          r[str_replace(s, sprint($a % 10), "<digit>"), str_replace("aaaa", "aa", "b"), str_replace("aaa", "aa", "b")]++
          x = "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
          long = str_replace(x, "x", sprint($a % 100000))
          lens[strlen(long), strlen(str_replace(x, "x", "ééééééé")), strlen(str_replace(x, "x", "yyyyyyyyyyyyyy"))]++
          if (n % 31 == 0) println(long, "|", str_replace(s, execname(), ""))
          r[str_replace(long, "0", "zero"), "", ""]++
        }
    "#;

    // 60 hits: each interns about seven strings over 15 bytes, the table holds 4,096.
    let (header, failed) = differential_with(script, &hits(60));

    assert_eq!((header.errors, header.strings, failed), (0, 0, 0));
}

#[test]
fn str_replace_is_cut_at_a_small_maxstringlen_as_in_the_interpreter() {
    let script = r#"
        global keys
        probe kernel.function("f") {
          keys[str_replace(execname(), "a", "AAAA"), str_replace(sprint($b), "-", "é")]++
          println(str_replace(execname() . sprint($b), "", "?"), "|", strpos(execname(), "l"))
        }
    "#;
    let limits = Limits {
        max_string_len: 8,
        ..Limits::default()
    };

    let (header, failed) = differential_limits(script, &hits(120), |_, _| {}, |_, _| {}, limits);

    assert_eq!((header.errors, header.strings, failed), (0, 0, 0));
}

#[test]
fn sprintf_matches_the_interpreter_in_every_conversion_and_flag() {
    // Every conversion with widths, precisions, flags and `*`, over the awkward values
    // (0, -1, i64::MIN, i64::MAX), strings over 15 bytes, characters from 0x80 (two bytes
    // of UTF-8), results over MAXSTRINGLEN.
    let script = r#"
        global f, g, lens, n
        probe kernel.function("f") {
          n++
          s = execname() . "/" . pp()
          f[sprintf("%d|%i|%u|%x|%X|%o|%%", $b, $a, $b, $b, $b, $b)]++
          f[sprintf("[%5d][%-5d][%05d][%+d][% d][%.3d][%08.3d]", $a, $a, $a, $a, $a, $a, $a)]++
          f[sprintf("[%#x][%#X][%#o][%#10x][%-#10o][%010x]", $a, $a, $a, $b, $b, $b)]++
          f[sprintf("[%s][%10s][%-10s][%.3s][%5.2s][%-8.20s]", execname(), execname(), execname(), s, s, s)]++
          f[sprintf("[%c][%3c][%-3c][%c]", 65 + $a % 26, 97 + $b % 26, 48 + $a % 10, 128 + $a % 100)]++
          f[sprintf("[%*d][%-*d][%.*d][%*.*s]", $a % 30, $b, $a % 20, $a, $a % 8, $b, $a % 12, $a % 5, s)]++
          f[sprintf("[%p][%20p][%-20p]", $b, $a, $a)]++
          g[sprintf("%s", ""), sprintf("no conversions"), sprintf("%d", n)]++
          lens[strlen(sprintf("%600d", $a)), strlen(sprintf("%-1000s|", s)), strlen(sprintf("%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s%s", s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s))]++
          if (n % 11 == 0) println(sprintf("%-6s|%6d|%#x|%c", execname(), $a, $b & 0xffff, 200))
        }
    "#;

    let (header, failed) = differential_with(script, &hits(120));

    assert_eq!((header.errors, header.strings, failed), (0, 0, 0));
}

#[test]
fn sprintf_is_cut_at_a_small_maxstringlen_before_a_split_character() {
    let script = r#"
        global keys
        probe kernel.function("f") {
          keys[sprintf("%d:%s", $b, execname()), sprintf("%6c%c", 233, 233), sprintf("%7c", 0xe9)]++
          // 6 blanks and a 2-byte character: the cut at 7 bytes would split it, so it goes.
          println(sprintf("%x", $b), "|", sprintf("%7c", 0xe9), "|", strlen(sprintf("%7c", 0xe9)))
          // The literal is cut to "abcdefg" as well: no conversion is left for $a.
          println(sprintf("abcdefg%d", $a))
        }
    "#;
    let limits = Limits {
        max_string_len: 8,
        ..Limits::default()
    };

    let (header, failed) = differential_limits(script, &hits(120), |_, _| {}, |_, _| {}, limits);

    assert_eq!((header.errors, header.strings, failed), (0, 0, 0));
}

#[test]
fn sprintf_with_a_format_maxstringlen_cuts_into_a_bad_one_is_refused_by_name() {
    // The interpreter holds "abcd%c%c" cut to "abcd%c%" under MAXSTRINGLEN 8: a bad format.
    let limits = Limits {
        max_string_len: 8,
        ..Limits::default()
    };
    let prog = check_script(
        &ScriptSource {
            name: "t.stp".into(),
            text: r#"probe kernel.function("f") { println(sprintf("abcd%c%c", 1, 2)) }"#.into(),
        },
        &limits,
    )
    .unwrap();
    let point = SitePoint {
        probe: 0,
        name: "kernel.function(\"f\")".into(),
        function: "f".into(),
        params: vec!["a".into(), "b".into()],
        is_return: false,
        locals: None,
        guard: None,
    };

    let refused = compile::check(&prog, &limits, &facts(), &[point]);

    assert!(
        refused.len() == 1 && refused[0].construct.contains("MAXSTRINGLEN cuts it"),
        "{refused:?}"
    );
}
