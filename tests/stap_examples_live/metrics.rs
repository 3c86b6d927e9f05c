//! SystemTap's Prometheus examples against the live guest: each runs with `--http`, and
//! `/metrics` is scraped three times while the workload runs. Every scrape must parse with
//! Prometheus's own parser (`common::parse_metrics`) and hold samples; where the example's
//! counts only grow (errno.stp's errors, syscallsbypid.stp's calls per process and syscall),
//! no sample present in two scrapes may shrink between them. topsys.stp empties its table
//! every 5 s, as in SystemTap, so only its format is checked.

use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::common::{exotap, parse_metrics, Sample};
use crate::signal;

/// The examples, and whether their counts only grow.
pub const PROMETHEUS_EXAMPLES: &[(&str, bool)] = &[
    ("profiling/errno.stp", true),
    ("profiling/syscallsbypid.stp", true),
    ("profiling/topsys.stp", false),
];

/// Runs `file` against the guest at `socket` with `--http`, scrapes `/metrics` three times
/// two seconds apart once its probes are in, and checks the scrapes; what it saw, or why not.
pub fn scrape_example(file: &Path, socket: &Path, grows: bool) -> Result<String, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let mut child = exotap()
        .current_dir(file.parent().unwrap_or(Path::new(".")))
        .args(["run", "--http", "127.0.0.1:0", "--procfs-dir"])
        .arg(dir.path().join("files"))
        .arg("--target")
        .arg(format!("unix:{}", socket.display()))
        .arg(file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start exotap: {e}"))?;
    let (out, rx, err) = crate::watch_output(&mut child);
    // Where it serves, then its probes in.
    let deadline = Instant::now() + Duration::from_secs(180);
    let (mut addr, mut installed) = (None, false);
    while !(addr.is_some() && installed) && Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => {
                if let Some(rest) = l.split("HTTP on http://").nth(1) {
                    addr = rest.split('/').next().and_then(|a| a.parse().ok());
                }
                installed |= l.contains("compiled probes in at") || l.contains("probe sites (");
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let mut scrapes: Vec<Vec<Sample>> = Vec::new();
    let mut why = None;
    match (addr, installed) {
        (Some(addr), true) => {
            for _ in 0..3 {
                std::thread::sleep(Duration::from_secs(2));
                match get_metrics(addr) {
                    Ok(body) => scrapes.push(parse_metrics(&body)),
                    Err(e) => {
                        why = Some(e);
                        break;
                    }
                }
            }
        }
        _ => why = Some("exotap never served its files with its probes in".to_owned()),
    }
    signal(&child, "INT");
    let code = child.wait().ok().and_then(|s| s.code());
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let fail = |why: String| Err(format!("{why}\n--- stdout:\n{out}\n--- stderr:\n{err}"));
    if let Some(why) = why {
        return fail(why);
    }
    if code != Some(0) {
        return fail(format!("exit {code:?}"));
    }
    if scrapes.iter().any(Vec::is_empty) {
        return fail(format!("a scrape without samples: {scrapes:?}"));
    }
    if grows {
        for pair in scrapes.windows(2) {
            for (name, labels, before) in &pair[0] {
                let after = pair[1]
                    .iter()
                    .find(|(n, l, _)| n == name && l == labels)
                    .map(|s| s.2);
                if after.is_some_and(|a| a < *before) {
                    return fail(format!(
                        "{name}{labels:?} went down from {before} to {after:?} between scrapes"
                    ));
                }
            }
        }
    }
    Ok(format!(
        "{} scrapes of {}, {}, {} samples",
        scrapes.len(),
        file.display(),
        if grows {
            "no count went down"
        } else {
            "each parsed"
        },
        scrapes.iter().map(Vec::len).sum::<usize>()
    ))
}

/// `GET /metrics` at `addr`: the body of a 200 answer with Prometheus's content type.
fn get_metrics(addr: std::net::SocketAddr) -> Result<String, String> {
    use std::io::Write as _;
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).map_err(|e| e.to_string())?;
    let (head, body) = reply
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("not an HTTP answer: {reply}"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("GET /metrics: {head}\n{body}"));
    }
    if !head
        .to_ascii_lowercase()
        .contains("content-type: text/plain; version=0.0.4")
    {
        return Err(format!("not Prometheus's content type: {head}"));
    }
    Ok(body.to_owned())
}

/// The guest's job for [`errno_metrics_equal_the_guests_own_count_of_the_same_failures`]:
/// its own count of failing `openat`s (a kretprobe event, only `ENOENT` returns traced),
/// armed at boot; held at `exotap_wait probes` until the test has seen exotap's probes go in
/// (`exotap boot --go-on-stdin`), then the trace emptied and a burst of 150
/// opens of missing files by one shell (errno.stp exports its 20 largest counts per process,
/// errno and call: one process keeps the burst in one), then the count of the burst.
const ERRNO_JOB: &str = "T=/sys/kernel/tracing
echo 'r:exotap/openat __x64_sys_openat ret=$retval:s64' >> $T/kprobe_events || echo ERRNO-FAILED
echo 'ret == -2' > $T/events/exotap/openat/filter || echo ERRNO-FAILED
echo 1 > $T/events/exotap/openat/enable || echo ERRNO-FAILED
echo ERRNO-ARMED
exotap_wait probes
echo > $T/trace
echo BURST-START
sh -c 'for i in $(seq 150); do true < /nonexistent-$i; done' 2>/dev/null
echo \"BURST-DONE $(grep -c 'exotap/openat\\|openat:' $T/trace)\"
sleep 120
";

/// errno.stp (SystemTap's, unchanged) with `--http`: at the last of three scrapes of
/// `/metrics`, taken after a burst of failing `openat`s with nothing else running, its
/// count of `openat` failing with `ENOENT` (summed over processes) equals the guest's own
/// count of the same returns (issue 42).
#[test]
fn errno_metrics_equal_the_guests_own_count_of_the_same_failures() {
    if !crate::have_qemu("errno_metrics_equal_the_guests_own_count_of_the_same_failures") {
        return;
    }
    let Some(examples) = crate::examples_dir() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let job = tmp.path().join("job.sh");
    std::fs::write(&job, ERRNO_JOB).unwrap();
    let socket = tmp.path().join("gdb.sock");
    let (mut guest, mut console) = crate::common::boot_with_gdbstub(
        &[
            "--timeout".as_ref(),
            "400".as_ref(),
            "--job".as_ref(),
            job.as_os_str(),
            "--go-on-stdin".as_ref(),
        ],
        &socket,
        "ERRNO-ARMED",
    );
    let mut go = guest.stdin.take();
    let (console_tx, console_rx) = mpsc::channel::<(Instant, String)>();
    std::thread::spawn(move || {
        let mut line = String::new();
        while std::io::BufRead::read_line(&mut console, &mut line).is_ok_and(|n| n > 0) {
            let _ = console_tx.send((Instant::now(), std::mem::take(&mut line)));
        }
    });
    let mut child = exotap()
        .current_dir(examples.join("profiling"))
        .args(["run", "--http", "127.0.0.1:0", "--procfs-dir"])
        .arg(tmp.path().join("files"))
        .arg("--target")
        .arg(format!("unix:{}", socket.display()))
        .arg("errno.stp")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, rx, err) = crate::watch_output(&mut child);
    let deadline = Instant::now() + Duration::from_secs(300);
    let (mut addr, mut installed) = (None::<std::net::SocketAddr>, None::<Instant>);
    let (mut burst_start, mut burst) = (None::<Instant>, None::<u64>);
    let mut transcript = String::new();
    while burst.is_none() && Instant::now() < deadline {
        while let Ok(l) = rx.try_recv() {
            if let Some(rest) = l.split("HTTP on http://").nth(1) {
                addr = rest.split('/').next().and_then(|a| a.parse().ok());
            }
            if installed.is_none() && l.contains("compiled probes in at") {
                installed = Some(Instant::now());
                // The probes are in: the guest's burst may begin.
                if let Some(mut stdin) = go.take() {
                    use std::io::Write as _;
                    let _ = stdin.write_all(b"go\n");
                }
            }
        }
        match console_rx.recv_timeout(Duration::from_millis(100)) {
            Ok((at, l)) => {
                if l.contains("BURST-START") {
                    burst_start = Some(at);
                }
                if let Some(n) = l.trim().strip_prefix("BURST-DONE ") {
                    burst = n.trim().parse().ok();
                }
                transcript.push_str(&l);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let scrapes: Vec<Vec<Sample>> = match addr {
        Some(addr) => (0..3)
            .map(|_| {
                std::thread::sleep(Duration::from_secs(1));
                get_metrics(addr).map(|body| parse_metrics(&body))
            })
            .collect::<Result<_, _>>()
            .unwrap_or_default(),
        None => Vec::new(),
    };
    signal(&child, "INT");
    let code = child.wait().ok().and_then(|s| s.code());
    let _ = guest.kill();
    let _ = guest.wait();
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nconsole:\n{transcript}");
    assert!(
        !transcript.contains("ERRNO-FAILED"),
        "the guest could not arm its count: {ctx}"
    );
    let burst = burst.unwrap_or_else(|| panic!("the guest never ended its burst: {ctx}"));
    assert!(
        burst >= 150,
        "the guest saw {burst} failing openats of 150 opens: {ctx}"
    );
    let (Some(installed), Some(started)) = (installed, burst_start) else {
        panic!("exotap never installed its probes, or the burst never began: {ctx}");
    };
    assert!(
        installed < started,
        "exotap's probes went in after the burst began (the guest waits for them): {ctx}"
    );
    assert_eq!(code, Some(0), "{ctx}");
    assert_eq!(scrapes.len(), 3, "three scrapes of /metrics: {ctx}");
    let enoent = |scrape: &[Sample]| -> f64 {
        scrape
            .iter()
            .filter(|(name, labels, _)| {
                name == "syscall_error_count"
                    && labels.contains(&("name".to_owned(), "openat".to_owned()))
                    && labels.contains(&("errno".to_owned(), "-2".to_owned()))
            })
            .map(|s| s.2)
            .sum()
    };
    let counted: Vec<f64> = scrapes.iter().map(|s| enoent(s)).collect();
    // Nothing ran after the burst: every scrape says the same, the guest's own count.
    assert_eq!(counted, vec![burst as f64; 3], "{ctx}");
}
