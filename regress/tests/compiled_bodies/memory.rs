//! Reads from memory: member chains and `@defined`, member addresses, user and kernel reads of
//! every width, strings read from memory.

use super::nodes::*;
use super::*;

#[test]
fn defined_of_member_chains_is_known_from_the_types_not_the_values() {
    // SystemTap decides `@defined($a->m)` when it compiles: from [`NodeTypes`] (written by
    // hand above), `->x`, `->next->next->x` and `->inner->c` lay out; `->nosuch`, `->inner`
    // (a struct, not a value) and `$b->x` (`b` is a long) do not. The NULL node and the nodes
    // without a next change nothing: no pointer is read.
    let script = r#"
        global n
        probe kernel.function("f") {
          n++
          printf("%d %d%d%d %d%d%d\n", n, @defined($a->x), @defined($a->next->next->x),
                 @defined($a->inner->c), @defined($a->nosuch), @defined($a->inner),
                 @defined($b->x))
          if (@defined($a->nosuch)) println($a->nosuch)
          else if (@defined($b->x)) println($b->x)
          else println(@defined($a->x) ? "x laid out" : "no x")
        }
    "#;
    let known = |_: &Hit, ctx: &mut CapturedContext| {
        for (path, yes) in [
            ("$a->x", 1),
            ("$a->next->next->x", 1),
            ("$a->inner->c", 1),
            ("$a->nosuch", 0),
            ("$a->inner", 0),
            ("$b->x", 0),
        ] {
            ctx.targets
                .insert(format!("@defined({path})"), Value::Long(yes));
        }
    };
    let hits = node_hits();

    let (header, failed) = differential_in(script, &hits, |uc, _| write_nodes(uc), known);

    assert_eq!((header.errors, failed), (0, 0));
}

#[test]
fn addresses_of_members_match_the_interpreter_with_no_read_of_the_last_member() {
    // `&` reads the pointers on the way but not the last member: `&$a->x` of the NULL node
    // is 0 with no fault, `&$a->next->x` of a node without a next is 0, and of the NULL node
    // a fault (reading its next).
    let script = r#"
        global at, n
        probe kernel.function("f") {
          n++
          printf("%d %x %x %x\n", n, &$a->x, &$a->name - &$a->x, &$a->inner->c - $a)
          at[&$a->next->x == 0] += &$a->s - &$a->x
          # A @cast without members is its pointer, under & too (SystemTap's @container_of).
          at[&@cast($a + 8, "struct node") - $a] += @cast($b, "struct node") == $b
        }
    "#;
    let hits = node_hits();
    let addresses = |h: &Hit, ctx: &mut CapturedContext| {
        let a = h.a;
        let mut put = |path: &str, v: i64| {
            ctx.targets.insert(path.into(), Value::Long(v));
        };
        put("&$a->x", a);
        put("&$a->name", a + 16);
        put("&$a->s", a + 32);
        put("&$a->inner->c", a + 40);
        if a != 0 {
            let next = (0..NODES.len())
                .find(|i| node(*i) == a as u64)
                .and_then(|i| NODES[i].1)
                .map_or(0, node);
            put("&$a->next->x", next as i64);
        }
        put("$a", a);
    };

    let (header, failed) = differential_in(script, &hits, |uc, _| write_nodes(uc), addresses);

    // Only the NULL node's `&$a->next->x` faults: 10 of its hits.
    assert_eq!(failed, 10);
    assert_eq!((header.errors, header.faults), (10, 10));
}

#[test]
fn user_integer_reads_match_the_interpreter_in_size_sign_and_faults() {
    // The strings' bytes and the nodes' fields read as 1, 2, 4 and 8-byte integers, signed
    // and not; addresses 0 and 1 fault (the rig's copy routine faults below 64 KiB; it has
    // no end of memory, so no read runs past the task's pages).
    let script = r#"
        global n, sum
        probe kernel.function("f") {
          n++
          printf("%d %d %d %d\n", n, user_char($b), user_short($b + 1), user_ushort($b + 1))
          printf("%d %d %d\n", user_int($a), user_uint($a), user_int($b))
          printf("%d %d %d\n", user_short($a + 32), user_ushort($a + 32), user_char($a + 40))
          sum += user_long($b & -8)
        }
    "#;
    let hits = node_hits();

    let (header, failed) = differential_in(script, &hits, |uc, _| write_nodes(uc), |_, _| {});

    // Faults: $b at 0 and 1 (user_char), then the NULL node's user_int($a).
    assert!(
        failed > 10 && failed + 10 < hits.len() as u64,
        "{failed} errors"
    );
    assert_eq!((header.errors, header.faults), (failed, failed));
}

#[test]
fn member_chains_and_strings_read_from_memory_match_the_interpreter() {
    let script = r#"
        global xs, n
        probe kernel.function("f") {
          n++
          printf("%d %d %s|%s\n", n, $a->x, kernel_string($a->name), kernel_string_n($b, $a->x % 50))
          xs[$a->next->x] += $a->s + $a->inner->c
          if (n % 3 == 0) println(user_string($b))
          if (n % 4 == 0) print(user_string_n($b, 9), "\n")
        }
    "#;
    let hits = node_hits();

    let (header, failed) = differential_in(script, &hits, |uc, _| write_nodes(uc), node_members);

    // Errors: the NULL node, the nodes without a next, the unreadable strings; and at least
    // 10 hits ran to their end.
    assert!(
        failed > 20 && failed + 10 < hits.len() as u64,
        "{failed} errors"
    );
    assert_eq!((header.errors, header.faults), (failed, failed));
}

#[test]
fn kernel_reads_of_every_width_sign_extend_as_the_interpreter() {
    let script = r#"
        global v, w
        probe kernel.function("f") {
          v += kernel_char($a) + kernel_short($a) * 3 + kernel_int($a) * 5
          w[$a - $b] = kernel_long($b)
        }
    "#;
    // Nodes' bytes: x is an i32, s an i16, inner.c a byte over 127 (negative as a char).
    let hits: Vec<Hit> = (0..NODES.len())
        .flat_map(|i| {
            [node(i), node(i) + 32, node(i) + 40]
                .into_iter()
                .map(move |a| Hit {
                    comm: "t",
                    pid: 1,
                    tgid: 1,
                    a: a as i64,
                    b: node((i + 1) % NODES.len()) as i64,
                })
        })
        .chain([Hit {
            comm: "t",
            pid: 1,
            tgid: 1,
            a: 0,
            b: 0,
        }])
        .collect();

    let (header, failed) = differential_in(script, &hits, |uc, _| write_nodes(uc), |_, _| {});

    assert_eq!(failed, 1, "the NULL read");
    assert_eq!((header.errors, header.faults), (1, 1));
}

#[test]
fn locals_holding_strings_read_from_memory_print_as_the_interpreters() {
    let script = r#"
        global n
        probe kernel.function("f") {
          n++
          name = kernel_string($a->name)
          if (n % 2) s = user_string_n($b, 20)
          printf("%d [%s] [%s]\n", n, name, s)
          if (n % 5 == 0) { name = kernel_string($b); println(name, s, n) }
        }
    "#;
    let hits = node_hits();

    let (header, failed) = differential_in(script, &hits, |uc, _| write_nodes(uc), node_members);

    assert!(
        failed > 10 && failed + 10 < hits.len() as u64,
        "{failed} errors"
    );
    assert_eq!((header.errors, header.faults), (failed, failed));
}

#[test]
fn strings_read_from_memory_as_values_match_the_interpreter() {
    // As keys (short, 15-byte, 40-byte and MAXSTRINGLEN-cut texts), compared, concatenated,
    // measured and returned by a user function; faults end the hit. The arrays are compared
    // element by element with the interpreter's.
    let script = r#"
        global names, seen, n
        function name_of(p) { return kernel_string(p) }
        probe kernel.function("f") {
          n++
          s = kernel_string($a->name)
          names[s, kernel_string_n($b, $a->x % 50)]++
          if (s == "alpha" || s < "c") seen++
          if (n % 3 == 0)
            printf("%d %s %s %d\n", n, user_string($b) . "!", name_of($a->name), strlen(s))
        }
    "#;
    let hits = node_hits();

    let (header, failed) = differential_in(script, &hits, |uc, _| write_nodes(uc), node_members);

    assert!(
        failed > 10 && failed + 10 < hits.len() as u64,
        "{failed} errors"
    );
    assert_eq!(header.faults, header.errors);
}
