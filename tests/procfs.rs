//! procfs probes served by the host (`probes/base/src/procfs.rs`): a script's `procfs("NAME")`
//! files as FIFOs in a directory and over HTTP, and the prometheus tapset's `/metrics`,
//! checked with Prometheus's own parser of its text format (the `prometheus_client` Python
//! package, Debian's python3-prometheus-client). No guest: the scripts' probes run on the
//! host; tests/stap_examples_live checks the metrics of SystemTap's examples on a live guest.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers outside #[test] fns

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{exotap, parse_metrics, Sample};

/// exotap running `script` with its files in `dir` and HTTP on a port of its choosing;
/// returns the child, the HTTP address it printed, and its stderr so far.
fn serve(script: &str, dir: &Path) -> (Child, SocketAddr, mpsc::Receiver<String>) {
    let mut child = exotap()
        .args(["run", "--http", "127.0.0.1:0", "--procfs-dir"])
        .arg(dir)
        .args(["-e", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start exotap run");
    let (tx, rx) = mpsc::channel();
    let stderr = BufReader::new(child.stderr.take().expect("piped"));
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut said = Vec::new();
    let addr = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("exotap never said where it serves; it said:\n{said:?}"));
        if let Some(rest) = line.split("HTTP on http://").nth(1) {
            let addr = rest.split('/').next().unwrap_or_default();
            break addr.parse().expect("an address");
        }
        said.push(line);
    };
    (child, addr, rx)
}

/// Ends `child` as Ctrl-C does; its stdout and exit code.
fn interrupt(mut child: Child) -> (String, Option<i32>) {
    let pid = child.id().to_string();
    let _ = Command::new("kill").args(["-INT", &pid]).status();
    let mut out = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    let code = child.wait().ok().and_then(|s| s.code());
    (out, code)
}

/// One HTTP/1.1 exchange: (status, headers lowercased, body).
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("cannot connect");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("cannot send");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("cannot read the reply");
    let (head, body) = reply.split_once("\r\n\r\n").expect("a reply with headers");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status");
    (status, head.to_ascii_lowercase(), body.to_owned())
}

#[test]
fn a_procfs_value_round_trips_through_the_host_file_and_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("files");
    let script = r#"global saved = "nothing yet", reads
        probe procfs("x").write { saved = $value; printf("wrote [%s]\n", saved) }
        probe procfs("x").read { reads++; $value = sprintf("%s (read %d)\n", saved, reads) }
        probe procfs("big").read.maxsize(100) {
            for (i = 0; i < 50; i++) $value .= sprintf("line %d\n", i)
        }"#;
    let (child, addr, _err) = serve(script, &files);
    let x = files.join("x");

    assert_eq!(
        std::fs::read_to_string(&x).unwrap(),
        "nothing yet (read 1)\n"
    );
    std::fs::write(&x, "from the file").unwrap();
    assert_eq!(
        std::fs::read_to_string(&x).unwrap(),
        "from the file (read 2)\n"
    );
    let (status, _, _) = http(addr, "PUT", "/procfs/x", "over http");
    assert_eq!(status, 204);
    let (status, _, body) = http(addr, "GET", "/procfs/x", "");
    assert_eq!((status, body.as_str()), (200, "over http (read 3)\n"));
    // Written over HTTP, read through the file, and the other way round.
    let (status, _, _) = http(addr, "POST", "/procfs/x", "posted");
    assert_eq!(status, 204);
    assert_eq!(std::fs::read_to_string(&x).unwrap(), "posted (read 4)\n");
    // $value grows past MAXSTRINGLEN's 512 bytes only up to the read's maxsize.
    let (status, _, body) = http(addr, "GET", "/procfs/big", "");
    assert_eq!(status, 200);
    assert_eq!(body.len(), 100, "{body}");
    assert!(body.starts_with("line 0\nline 1\n"), "{body}");
    // Refusals: a write to a file with no .write probe, an unknown file, /metrics without
    // the prometheus probe.
    assert_eq!(http(addr, "PUT", "/procfs/big", "z").0, 405);
    assert_eq!(http(addr, "GET", "/procfs/nope", "").0, 404);
    assert_eq!(http(addr, "GET", "/metrics", "").0, 404);

    let (out, code) = interrupt(child);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(
        out,
        "wrote [from the file]\nwrote [over http]\nwrote [posted]\n"
    );
    // The FIFOs and the directory exotap made go with it.
    assert!(!files.exists(), "{} is left behind", files.display());
}

#[test]
fn prometheus_metrics_are_served_in_prometheus_text_format() {
    let dir = tempfile::tempdir().unwrap();
    // SystemTap's prometheus tapset, as errno.stp and syscallsbypid.stp use it: counts
    // that grow between scrapes, labels that need escaping.
    let script = r#"global calls, prom
        probe begin { calls["read", "a \"quoted\" name"] = 0; calls["write", "b"] = 0 }
        probe timer.ms(20) { calls["read", "a \"quoted\" name"] += 2; calls["write", "b"]++ }
        probe prometheus {
            foreach ([op, who] in calls) prom[op, who] = calls[op, who]
            @prometheus_dump_array2(prom, "exotap_test_calls", "op", "who")
            delete prom
        }"#;
    let (child, addr, _err) = serve(script, &dir.path().join("files"));
    let mut scrapes = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        let (status, head, body) = http(addr, "GET", "/metrics", "");
        assert_eq!(status, 200, "{body}");
        assert!(
            head.contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        scrapes.push(parse_metrics(&body));
    }
    let (_, code) = interrupt(child);
    assert_eq!(code, Some(0));
    for s in &scrapes {
        assert_eq!(s.len(), 2, "{scrapes:?}");
    }
    let value = |s: &Vec<Sample>, op: &str| {
        s.iter()
            .find(|(name, labels, _)| {
                name == "exotap_test_calls" && labels.iter().any(|(k, v)| k == "op" && v == op)
            })
            .map(|(_, _, v)| *v)
            .expect("the sample")
    };
    for pair in scrapes.windows(2) {
        assert!(
            value(&pair[1], "read") > value(&pair[0], "read"),
            "{scrapes:?}"
        );
        assert!(
            value(&pair[1], "write") >= value(&pair[0], "write"),
            "{scrapes:?}"
        );
    }
    // The quotes came back through the label escaping.
    let last = scrapes.last().unwrap();
    assert!(
        last.iter()
            .any(|(_, labels, _)| labels.contains(&("who".into(), "a \"quoted\" name".into()))),
        "{last:?}"
    );
}

#[test]
fn the_json_tapset_serves_its_data_and_metadata_as_json_documents() {
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("files");
    // The json tapset as net_xmit_json.stp uses it, with every kind of metric, and strings
    // that need JSON's escapes.
    let script = r#"global reads, devs
        probe begin {
            json_set_prefix("demo")
            json_add_numeric_metric("reads", "data documents read", "count")
            json_add_string_metric("who", "a \"quoted\" description")
            json_add_array("dev", "per device")
            json_add_array_numeric_metric("dev", "packets", "packets sent", "count")
            json_add_array_string_metric("dev", "label", "the device's label")
            devs["eth0"] = 3; devs["lo"] = 1
        }
        probe json_data {
            reads++
            @json_output_data_start
            @json_output_numeric_value("reads", reads)
            @json_output_string_value("who", "back\\slash \"quote\"\ttab")
            foreach (d in devs) {
                @json_output_array_numeric_value("dev", d, "packets", devs[d] * reads)
                @json_output_array_string_value("dev", d, "label", "L-" . d)
            }
            @json_output_data_end
        }"#;
    let (child, addr, _err) = serve(script, &files);
    let parse = |text: &str| -> serde_json::Value {
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}):\n{text}"))
    };

    let first = parse(&std::fs::read_to_string(files.join("data")).unwrap());
    let meta = parse(&std::fs::read_to_string(files.join("metadata")).unwrap());
    let (status, _, body) = http(addr, "GET", "/procfs/data", "");
    assert_eq!(status, 200);
    let second = parse(&body);
    let (_, code) = interrupt(child);
    assert_eq!(code, Some(0));

    assert_eq!(first["generation"], 1, "{first}");
    assert_eq!(first["data"]["reads"], 1, "{first}");
    assert_eq!(
        first["data"]["who"], "back\\slash \"quote\"\ttab",
        "{first}"
    );
    let devs = first["data"]["dev"].as_array().expect("an array");
    let ids: Vec<&str> = devs.iter().map(|d| d["__id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["eth0", "lo"], "{first}");
    assert_eq!(devs[0]["packets"], 3);
    assert_eq!(devs[0]["label"], "L-eth0");
    assert_eq!(devs[1]["packets"], 1);
    // Reading the metadata ran none of the script's json_data probe: the next document is
    // the second.
    assert_eq!(second["generation"], 2, "{second}");
    assert_eq!(second["data"]["reads"], 2, "{second}");
    assert_eq!(second["data"]["dev"][0]["packets"], 6, "{second}");

    assert_eq!(meta["prefix"], "demo", "{meta}");
    let metrics = meta["metrics"].as_array().expect("metrics");
    let by_name = |name: &str| {
        metrics
            .iter()
            .find(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("no metric {name} in {meta}"))
    };
    assert_eq!(by_name("reads")["pointer"], "/data/reads");
    assert_eq!(by_name("reads")["type"], "integer");
    assert_eq!(by_name("reads")["units"], "count");
    assert_eq!(by_name("who")["type"], "string");
    assert_eq!(by_name("who")["description"], "a \"quoted\" description");
    let dev = by_name("dev");
    assert_eq!(
        (&dev["type"], &dev["index"]),
        (&"array".into(), &"/__id".into())
    );
    let inner: Vec<(&str, &str)> = dev["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["pointer"].as_str().unwrap(), m["type"].as_str().unwrap()))
        .collect();
    assert_eq!(
        inner,
        [("/label", "string"), ("/packets", "integer")],
        "{meta}"
    );
}
