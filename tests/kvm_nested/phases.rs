//! Reading the outer guest's console: the phases a run finished (kept when a frozen run is
//! tried again) and the lines of one tagged engine run (of its last try).

use super::jobs::RETRY_INNER;

/// The phases a run of the outer job finished, in order, each with its lines: from its
/// `phase.start` result to its `phase.done` (the outer guest's heartbeat among them).
pub(super) fn finished_phases(console: &str) -> Vec<(String, String)> {
    let marker = |line: &str, key: &str| {
        let prefix = format!("EXOTAP-RESULT phase.{key}=");
        line.find(&prefix)
            .map(|at| line[at + prefix.len()..].trim_end().to_owned())
    };
    let mut finished = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in console.lines() {
        if let Some(tag) = marker(line, "start") {
            open = Some((tag, String::new()));
        }
        if let Some((tag, lines)) = open.as_mut() {
            lines.push_str(line);
            lines.push('\n');
            if marker(line, "done").as_ref() == Some(tag) {
                finished.extend(open.take());
            }
        }
    }
    finished
}

#[test]
pub(super) fn a_retry_keeps_the_lines_of_the_phases_the_frozen_run_finished() {
    let console = "EXOTAP-RESULT inner.wall_s=9\n\
                   EXOTAP-RESULT phase.start=count\n\
                   count| 10000 __x64_sys_getpid\n\
                   outer: alive at 40 s\n\
                   EXOTAP-RESULT count.rc=0\n\
                   EXOTAP-RESULT phase.done=count\n\
                   EXOTAP-RESULT phase.start=nullify\n\
                   nullify| inner:READY\n\
                   [  212.9] watchdog: BUG: soft lockup - CPU#1 stuck for 26s!\n";
    let finished = finished_phases(console);
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].0, "count");
    assert_eq!(
        finished[0].1,
        "EXOTAP-RESULT phase.start=count\ncount| 10000 __x64_sys_getpid\n\
         outer: alive at 40 s\nEXOTAP-RESULT count.rc=0\nEXOTAP-RESULT phase.done=count\n"
    );
}

/// The lines of one tagged run, tag removed: of its last try, when the outer job ran it
/// again (after its `RETRY-INNER TAG:` line), so that no value of an abandoned try is read
/// with one of the try that counts (a CI run read `after.getppid.value` of a stuck first try
/// and `parent.pid` of the second).
pub(super) fn tagged<'a>(console: &'a str, tag: &str) -> Vec<&'a str> {
    let prefix = format!("{tag}| ");
    let retry = format!("{RETRY_INNER} {tag}:");
    let lines: Vec<&str> = console.lines().collect();
    let from = lines
        .iter()
        .rposition(|l| l.contains(&retry))
        .map_or(0, |at| at + 1);
    lines[from..]
        .iter()
        .filter_map(|l| l.find(&prefix).map(|at| l[at + prefix.len()..].trim_end()))
        .collect()
}

#[test]
pub(super) fn a_tagged_run_that_was_tried_again_is_read_from_its_last_try() {
    let console = format!(
        "nullify| inner:RESULT after.getppid.value=93\n\
         {RETRY_INNER} nullify: the inner guest stopped making progress; running it again\n\
         count| 10000 __x64_sys_getpid\n\
         nullify| inner:RESULT after.getppid.value=92\n\
         nullify| inner:RESULT parent.pid=92\n"
    );
    assert_eq!(
        tagged(&console, "nullify"),
        [
            "inner:RESULT after.getppid.value=92",
            "inner:RESULT parent.pid=92"
        ]
    );
    assert_eq!(tagged(&console, "count"), ["10000 __x64_sys_getpid"]);
}
