//! The image cache works offline once filled.

mod common;

use std::process::Command;

use common::{exotap, run};

#[test]
fn second_image_fetch_needs_no_network() {
    let (code, out, err) = run(exotap().args(["image", "fetch"]));
    assert_eq!(code, 0, "first fetch failed:\n{out}\n{err}");
    let unshare_works = Command::new("unshare")
        .args(["-n", "true"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !unshare_works {
        eprintln!("SKIP second_image_fetch_needs_no_network: `unshare -n` (a network namespace) is not permitted here");
        return;
    }

    // A fresh network namespace has only a down loopback: any download would fail.
    let (code, out2, err2) = run(Command::new("unshare")
        .arg("-n")
        .arg(env!("CARGO_BIN_EXE_exotap"))
        .args(["image", "fetch"]));

    assert_eq!(code, 0, "offline fetch failed:\n{out2}\n{err2}");
    assert_eq!(
        out, out2,
        "the offline fetch must report the same cached files"
    );
    assert!(!err2.contains("downloading"), "{err2}");
}
