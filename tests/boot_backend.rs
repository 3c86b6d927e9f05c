//! `exotap boot --backend`: what this host's /dev/kvm allows. On a host whose /dev/kvm cannot
//! run Linux (kvm_pvm here, or none), `--backend kvm` is refused at once with the one-line
//! explanation `exotap host` prints, and `--backend auto` boots under QEMU. Which machine ran
//! the guest is read from inside the guest: QEMU's `-M pc` has SMBIOS tables naming QEMU as
//! the system vendor; exotap's own VMM has no SMBIOS at all.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::{exotap, have_qemu, result, run};
use exotap_vmm::host;

#[test]
fn backend_kvm_is_refused_with_the_host_explanation_where_kvm_cannot_run_linux() {
    let support = host::detect();
    if support.usable() {
        eprintln!(
            "SKIP: this host has hardware KVM ({}); nothing to refuse",
            support.explain()
        );
        return;
    }
    let (_, explained, _) = run(exotap().arg("host"));
    // An empty image cache: a boot that went ahead would fetch the Debian kernel into it.
    let cache = tempfile::tempdir().unwrap();

    let (code, out, err) = run(exotap()
        .args(["boot", "--backend", "kvm", "--run", "true"])
        .env("XDG_CACHE_HOME", cache.path()));

    assert_eq!(code, 125, "stdout:\n{out}\nstderr:\n{err}");
    // `exotap host`'s line, without what exotap does instead.
    let reason = support.reason().unwrap_or_default();
    assert!(explained.trim().starts_with(&reason), "{explained}");
    assert!(
        err.contains(&format!("--backend kvm refused: {reason}")),
        "the refusal must carry `exotap host`'s reason ({reason}):\n{err}"
    );
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        assert!(err.contains("kvm_pvm"), "{err}");
    }
    assert!(!out.contains("EXOTAP-"), "nothing may boot: {out}");
    let fetched: Vec<_> = walk(cache.path());
    assert!(
        fetched.is_empty(),
        "the refusal must come before anything is fetched: the cache holds {fetched:?}"
    );
}

#[test]
fn backend_auto_boots_under_qemu_where_kvm_cannot_run_linux() {
    let support = host::detect();
    if support.usable() {
        eprintln!(
            "SKIP: this host has hardware KVM ({}); auto picks kvm",
            support.explain()
        );
        return;
    }
    if !have_qemu("backend_auto_boots_under_qemu_where_kvm_cannot_run_linux") {
        return;
    }

    let (code, out, err) = run(exotap().args([
        "boot",
        "--backend",
        "auto",
        "--timeout",
        "300",
        "--run",
        "exotap_result vendor \"$(cat /sys/class/dmi/id/sys_vendor)\"",
    ]));

    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains(&format!("backend qemu: {}", support.explain())),
        "auto must say why it took qemu:\n{err}"
    );
    assert_eq!(result(&out, "vendor"), Some("QEMU"), "{out}");
    assert!(out.contains("EXOTAP-DONE 0"), "{out}");
}

/// Every file under `dir`, recursively.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
