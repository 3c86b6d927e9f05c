//! Arrays, statistics, arithmetic and context; the tapset's number-to-name functions
//! (signals, syscalls, errnos, open flags) for every number.

use super::*;

#[test]
fn arrays_statistics_arithmetic_and_context_match_the_interpreter() {
    let script = r#"
        global calls, sizes, small, last, tot, who, bits
        probe kernel.function("f") {
          calls[execname(), $a % 3]++
          sizes <<< $b
          if ($b < 0) small++
          last = execname()
          x = 0
          for (i = 0; i < $a % 5; i++) x += i * ($b >> 8)
          if ($a != 0) tot += x / $a - (x % 4) + (x << 2) - (x >> 1)
          who[pid(), tid()] <<< ppid() + uid() + cpu()
          bits[$b & 7] = $a > 0 && $b > 0 ? $a | $b : $a ^ ~$b
        }
        probe end { print(@hist_log(sizes)); print(@hist_linear(sizes, -100, 100, 25)) }
    "#;

    let header = differential(script, &hits(400));

    assert_eq!((header.valid, header.errors, header.dropped), (true, 0, 0));
}

#[test]
fn task_current_target_and_a_printf_of_many_arguments_match_the_interpreter() {
    // As sched_switch.stp: eleven printf arguments (SystemTap allows 32); the task and the
    // target pid as keys.
    let script = r#"
        global tasks
        probe kernel.function("f") {
          tasks[task_current(), target()]++
          printf("%-16s%5d %5d %5d:%5d:%s +   %5d:%5d:%s %-16s %d\n", execname(), cpu(), $a,
                 pid(), tid(), execname(), ppid(), uid(), "x", execname(), $b)
          printf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n",
                 $a, $b, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                 21, 22, 23, 24, 25, 26, 27, 28, 29, task_current() == 0)
        }
    "#;

    let header = differential(script, &hits(60));

    assert_eq!((header.valid, header.errors, header.dropped), (true, 0, 0));
}

#[test]
fn signal_and_syscall_names_and_printed_times_match_the_interpreter_for_every_number() {
    // 0 to 64 from the table (SIGRTMIN+n included), anything else built as SIG<n>.
    let script = r#"
        global names, calls, affinity
        probe kernel.function("f") {
          names[signal_str($a % 70)]++
          if ($a % 7 == 0) println(signal_str($b), " ", signal_str(-$a))
          // Long names interned in the guest, names past the table built, and compared with a
          // built string.
          calls[syscall_name($a % 470 + 200)]++
          if (syscall_name($a % 470 + 200) == "sched_" . "setaffinity") affinity++
          if (syscall_name(203 + $a % 2) == "sched_" . "setaffinity") affinity += 10
          if ($a % 11 == 0) println(syscall_name($b), " ", syscall_name($a + 200))
          // The host renders a printed ctime() from the time in the record.
          if ($a % 5 == 0) printf("%s|%-30s|%d\n", ctime($a * 86400 * 7), tz_ctime($b), $a)
        }
    "#;

    let header = differential(script, &hits(400));

    assert_eq!((header.valid, header.errors, header.dropped), (true, 0, 0));
}

#[test]
fn errno_names_return_strings_and_colors_match_the_interpreter_for_every_number() {
    // errno_str of either sign, the restart codes (512-516) and numbers past the table (""),
    // i64::MIN included; return_str in its three formats of errors, non-errors and negative
    // numbers that name no errno; ansi_set_color's three arities.
    let script = r#"
        global names, n
        probe kernel.function("f") {
          n++
          names[errno_str($a % 600)]++
          e = -($a % 4200)
          f = n % 4
          r = return_str(f, e)
          if (n % 3 == 0) println(errno_str($b), "|", errno_str(-$b % 520), "|", r)
          if (n % 5 == 0) printf("%s %s %s\n", return_str(1, $a), return_str(2, $b), return_str(3, $a))
          if (n % 9 == 0) { ansi_set_color(31); ansi_set_color(32, 41); ansi_set_color(33, 44, 1); println(r) }
        }
    "#;

    let header = differential(script, &hits(400));

    assert_eq!((header.valid, header.errors, header.dropped), (true, 0, 0));
}

#[test]
fn open_flag_strings_match_the_interpreter_for_every_flag_and_stray_bits() {
    // Every access mode, each named bit alone and together, bits the table does not name
    // (written in octal as the interpreter writes them), negative numbers.
    let script = r#"
        global seen, n
        probe kernel.function("f") {
          n++
          bit = 1 << (n % 40)
          f = (n % 4) | bit
          seen[_sys_open_flag_str(f)]++
          if (n % 3 == 0) println(_sys_open_flag_str($a), "|", _sys_open_flag_str($b))
          if (n % 7 == 0) { g = $a & 0xffffff; println(_sys_open_flag_str(g)) }
        }
    "#;

    let header = differential(script, &hits(300));

    assert_eq!((header.valid, header.errors, header.dropped), (true, 0, 0));
}
