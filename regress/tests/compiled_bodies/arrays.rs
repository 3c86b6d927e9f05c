//! Arrays and aggregates over many hits: printd, deletes, keys with side effects, foreach,
//! user functions, try/catch, wrapping arrays, variance.

use super::*;

#[test]
fn printd_and_printdln_match_the_interpreter() {
    let script = r#"
        global n
        probe kernel.function("f") {
          n++
          if (n % 9 == 0) printd(", ", execname(), n, $a, pp())
          if (n % 13 == 0) printdln("|", $b, "x", probefunc())
          if (n % 40 == 0) printdln("--", n)
        }
    "#;

    let header = differential(script, &hits(120));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn deleted_elements_come_back_as_new_ones_in_the_interpreters_order() {
    let script = r#"
        global t, d, seen, gone
        probe kernel.function("f") {
          k = $a % 13
          if (k in t) { d[k % 4] <<< t[k] + $b % 100; delete t[k]; gone++ }
          else t[k] = $b % 1000
          seen[execname()]++
          if ($b % 5 == 0) delete seen[execname()]
        }
    "#;

    let header = differential(script, &hits(500));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn keys_with_side_effects_are_evaluated_once_per_update_both_ways() {
    // `r[++n]++` moves `n` once (SystemTap's rule); the interpreter used to evaluate an
    // updated element's keys twice.
    let script = r#"
        global r, n, s
        probe kernel.function("f") {
          r[++n % 7]++
          r[n++ % 5] += $a % 10
          s[execname(), n--] -= 1
          x = r[++n % 3]--
        }
    "#;

    let header = differential(script, &hits(200));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn foreach_user_functions_and_try_catch_match_the_interpreter_over_many_hits() {
    // Declared sizes keep the tables small: every foreach step scans the whole table.
    let script = r#"
        global counts[64], lat[64], seen, order
        function classify:long (v:long) { if (v < 0) return -1; if (v == 0) return 0; return 1 }
        function depth:long (n:long) { if (n <= 0) return 0; return 1 + depth(n - 1) }
        function tag:string (s:string, v:long) { return v > 0 ? s : "none" }
        function guarded:long (v:long) {
          try { if (v % 5 == 0) error("five") } catch (m) { if (v % 10 == 0) error(m) }
          if (v % 9 == 0) error(tag("nine", v))
          return 1 / (v % 4)
        }
        probe kernel.function("f") {
          counts[execname(), classify($b)]++
          lat[tid()] <<< $a
          n = 0
          foreach ([c, s] in counts- limit 3) { if (s < 0) continue; n += counts[c, s] }
          foreach (t in lat @sum +) { seen += t; if (t > 102) break }
          foreach (v = [c, s] in counts) seen += v * s
          foreach ([c, s-] in counts limit 2) order[c] = s
          foreach (t- in lat) seen -= t
          try { seen += 1000 / ($a % 7) } catch (m) { printf("caught %s %d\n", m, $a) }
          try { if ($b % 3 == 0) error($a > 0 ? "odd" : "even") } catch { seen++ }
          try { seen += depth($b % 14) + 100 / classify($a) } catch (m) { printf("%s\n", m) }
          try { try { seen += guarded($a) } catch (m) { error(m) } } catch (m2) { println(m2) }
          printf("%d %d %s\n", n, depth($a % 12), tag(execname(), $b))
        }
    "#;

    let (header, failed) = differential_with(script, &hits(120));

    assert_eq!(header.errors, failed, "probe errors");
    assert!(header.nesting > 0, "some hits nested past MAXNESTING");
    // Its try blocks around user functions set up catch records, whose handlers the rig
    // checked begin with endbr64.
    let (rig, _) = rig(script, &Limits::default());
    assert!(
        rig.catch_records >= 3,
        "{} catch records",
        rig.catch_records
    );
}

#[test]
fn string_order_deletes_and_defined_match_the_interpreter() {
    let script = r#"
        global by[64], first, hits
        probe kernel.function("f") {
          by[execname(), $a % 4] += 1
          if (first == "" || execname() < first) first = execname()
          if (execname() >= "kworker") hits++
          if ($b % 17 == 0) delete by[*, $a % 4]
          if ($b % 29 == 0) delete by[execname(), *]
          if ($b % 53 == 0) delete by
          foreach ([c+, n] in by limit 2) hits += n
          hits += @defined($a) + 2 * @defined($nosuch) + @choose_defined($nosuch, $b % 3)
          if (@defined($b)) hits += 4
        }
    "#;

    let header = differential(script, &hits(200));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn wrapping_arrays_lose_their_oldest_element_as_in_the_interpreter() {
    let script = r#"
        global recent%[5], lat%[3], n%[4]
        probe kernel.function("f") {
          recent[$a % 11] = $b
          lat[execname(), tid()] <<< $a
          n[$b % 7]++
          if ($a % 13 == 0) delete recent[$a % 11]
        }
    "#;

    let header = differential(script, &hits(200));

    assert_eq!((header.errors, header.dropped), (0, 0));
}

#[test]
fn deleting_many_distinct_keys_leaves_the_small_table_usable() {
    // A 16-slot table sees hundreds of distinct keys inserted and deleted: every slot ends
    // up deleted, and inserts must still find room (the interpreter never drops one).
    let script = r#"
        global t[8], kept[8]
        probe kernel.function("f") {
          t[$a] = $b
          if ($a % 5 != 0) delete t[$a]
          kept[$a % 7] = $a
          if ($b % 3 == 0) delete kept[$a % 7]
        }
    "#;

    let (header, failed) = differential_with(script, &hits(200));

    // Overflows of t (its keys divisible by 5 stay) are errors on both sides, no drops.
    assert_eq!((header.errors, header.dropped), (failed, 0));
}

#[test]
fn variance_of_aggregates_matches_the_interpreter() {
    let script = r#"
        global all, per, v
        probe kernel.function("f") {
          all <<< $a
          per[execname()] <<< $b % 100000
          v = @variance(all) + @variance(per[execname()], 3)
          if (@count(all) % 40 == 0) printf("%d %d\n", @variance(all), v)
        }
    "#;

    let (header, failed) = differential_with(script, &hits(200));

    assert_eq!((header.errors, failed, header.dropped), (0, 0, 0));
}
