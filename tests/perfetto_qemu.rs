//! `exotap trace --perfetto` decoded by an independent decoder: Python's `protobuf` package
//! with the Perfetto trace protos that Perfetto publishes on PyPI (the `perfetto` package
//! ships them compiled, `perfetto_trace_pb2`), both installed at test time into a temporary
//! directory, never committed. The slices must be the text output's entry/return pairs,
//! with the same timestamps, tasks and pids.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::{exotap, have_qemu, run};

const DECODER: &str = r#"
import sys
sys.path.insert(0, sys.argv[1])
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
trace = pb.Trace()
trace.ParseFromString(open(sys.argv[2], 'rb').read())
tracks = {p.track_descriptor.uuid: p.track_descriptor.name
          for p in trace.packet if p.HasField('track_descriptor')}
for p in trace.packet:
    if not p.HasField('track_event'):
        continue
    e = p.track_event
    ann = {}
    for a in e.debug_annotations:
        ann[a.name] = getattr(a, a.WhichOneof('value'))
    track = tracks[e.track_uuid].replace(' ', '_')
    if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
        print('B', p.timestamp, track, e.name, ann['task'], ann['pid'])
    elif e.type == pb.TrackEvent.TYPE_SLICE_END:
        print('E', p.timestamp, track, ann['return'])
    else:
        print('?', p.timestamp, track, e.type)
"#;

/// Installs `protobuf` and Perfetto's `perfetto` package into `lib`. `Err` (why) only when
/// python3 or its pip is not installed; a pip that runs and fails (the index is reachable on
/// CI) panics with its output: that is a failure of the test, not a skip.
fn install_decoder(lib: &Path) -> Result<(), String> {
    let pip = || {
        let mut cmd = Command::new("python3");
        cmd.args(["-m", "pip", "--disable-pip-version-check"]);
        cmd
    };
    match pip().arg("--version").output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err("python3 is not installed".into());
        }
        Err(e) => panic!("cannot run python3 -m pip: {e}"),
        Ok(out) if !out.status.success() => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            // `python3 -m pip` without pip: "No module named pip".
            if stderr.contains("No module named pip") {
                return Err("pip is not installed for python3".into());
            }
            panic!(
                "python3 -m pip --version failed ({}): {}",
                out.status,
                stderr.trim()
            );
        }
        Ok(_) => {}
    }
    for args in [&["protobuf"][..], &["--no-deps", "perfetto"][..]] {
        let out = pip()
            .args(["install", "--quiet", "--target"])
            .arg(lib)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run python3 -m pip: {e}"));
        assert!(
            out.status.success(),
            "pip install {args:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Nanoseconds of a text time `123.456` (microseconds with three decimals).
fn ns(text: &str) -> u64 {
    let (us, frac) = text.split_once('.').unwrap();
    us.parse::<u64>().unwrap() * 1000 + frac.parse::<u64>().unwrap()
}

/// A traced call as both views show it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Slice {
    begin: u64,
    end: u64,
    track: String,
    function: String,
    task: String,
    pid: u32,
    value: i64,
}

/// The text output's calls: each return line with a duration, paired with its entry line
/// (the entry at `return time - duration`, same function, same task: two vCPUs can enter
/// the same function at the same nanosecond under TCG, 4 runs in 30 did here; a task is in
/// one call of a syscall at a time, and keeps its pid when it moves to another vCPU).
/// Also returns how many entries came at the same time as another task's open entry of
/// the same function.
fn text_slices(out: &str) -> (Vec<Slice>, usize) {
    let mut entries: BTreeMap<(u64, String, u32), (String, String)> = BTreeMap::new();
    let mut slices = Vec::new();
    let mut same_time = 0;
    for line in out.lines().filter(|l| l.contains(" us  cpu")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // [time, "us", cpuN, task[pid], arrow, ...]
        let at = ns(f[0]);
        let cpu = f[2].trim_start_matches("cpu");
        let (task, pid) = f[3].trim_end_matches(']').rsplit_once('[').unwrap();
        let pid: u32 = pid.parse().unwrap();
        match f[4] {
            "->" => {
                let function = f[5].split('(').next().unwrap().to_owned();
                let same = (at, function.clone(), 0)..=(at, function.clone(), u32::MAX);
                if entries.range(same).next().is_some() {
                    same_time += 1;
                }
                entries.insert(
                    (at, function, pid),
                    (format!("vCPU_{cpu}"), task.to_owned()),
                );
            }
            "<-" if line.ends_with("us]") => {
                let function = f[5].to_owned();
                let value: i64 = f[7].parse().unwrap();
                let took = ns(f[8].trim_start_matches('['));
                let begin = at - took;
                let Some((track, task)) = entries.remove(&(begin, function.clone(), pid)) else {
                    panic!("no entry line at {begin} ns for the return line {line:?} in:\n{out}")
                };
                slices.push(Slice {
                    begin,
                    end: at,
                    track,
                    function,
                    task,
                    pid,
                    value,
                });
            }
            _ => {}
        }
    }
    slices.sort();
    (slices, same_time)
}

/// The Perfetto file's slices: per track, each end closes the latest open begin.
fn perfetto_slices(decoded: &str) -> Vec<Slice> {
    let mut open: BTreeMap<String, Vec<(u64, String, String, u32)>> = BTreeMap::new();
    let mut slices = Vec::new();
    for line in decoded.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let ts: u64 = f[1].parse().unwrap();
        match f[0] {
            "B" => open.entry(f[2].to_owned()).or_default().push((
                ts,
                f[3].to_owned(),
                f[4].to_owned(),
                f[5].parse().unwrap(),
            )),
            "E" => {
                let (begin, function, task, pid) = open
                    .get_mut(f[2])
                    .and_then(Vec::pop)
                    .expect("an end with an open slice on its track");
                slices.push(Slice {
                    begin,
                    end: ts,
                    track: f[2].to_owned(),
                    function,
                    task,
                    pid,
                    value: f[3].parse().unwrap(),
                });
            }
            other => panic!("unexpected event {other}: {line}"),
        }
    }
    slices.sort();
    slices
}

#[test]
fn perfetto_slices_are_the_text_outputs_calls_with_the_same_timestamps() {
    if !have_qemu("perfetto_slices_are_the_text_outputs_calls_with_the_same_timestamps") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("pylib");
    // Skips only when python3 or pip is not installed; a failed install panics there.
    if let Err(why) = install_decoder(&lib) {
        eprintln!(
            "SKIP perfetto_slices_are_the_text_outputs_calls_with_the_same_timestamps: no independent decoder: {why}"
        );
        return;
    }
    let trace = dir.path().join("out.pftrace");
    let console = dir.path().join("console.log");

    let (code, out, err) = run(exotap()
        .args([
            "trace",
            "__x64_sys_getppid",
            "__x64_sys_getpid",
            "--run",
            "syscall-loop 150 > /dev/null & syscall-loop 150 > /dev/null; wait",
            "--timeout",
            "300",
            "--perfetto",
        ])
        .arg(&trace)
        .arg("--console")
        .arg(&console));
    let decoded = Command::new("python3")
        .args(["-c", DECODER])
        .arg(&lib)
        .arg(&trace)
        .output()
        .unwrap();

    let ctx = format!(
        "stderr:\n{err}\ndecoder:\n{}",
        String::from_utf8_lossy(&decoded.stderr)
    );
    assert_eq!(code, 0, "{ctx}");
    assert!(decoded.status.success(), "{ctx}");
    let (text, same_time) = text_slices(&out);
    eprintln!("entries at the same nanosecond as another task's open entry: {same_time}");
    let perfetto = perfetto_slices(&String::from_utf8_lossy(&decoded.stdout));
    // 2 workers x 150 calls of each function, all paired.
    assert_eq!(text.len(), 600, "{ctx}");
    assert!(text.iter().all(|s| s.task == "syscall-loop"), "{text:?}");
    assert_eq!(perfetto, text);
}
