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
