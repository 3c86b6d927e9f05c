//! The kvm backend, verified through nested KVM: this host's `/dev/kvm` is kvm_pvm (no
//! VMX/SVM), so the test boots the Debian guest under QEMU TCG with `-cpu max,+svm`, loads
//! irqbypass, kvm and kvm-amd from the same kernel package in that guest, and runs a static
//! exotap there that boots the same kernel under KVM (exotap's own VMM) with the syscall
//! workload and splices a counter at `__x64_sys_getpid`'s entry (`--count-entry`; no traps).
//! The outer guest prints the inner guest's console with `EXOTAP-` renamed `inner:` so that
//! the outer run's own protocol is not confused.
//!
//! It needs the static exotap and about a minute: `ci/nested/run.sh`, or
//! `EXOTAP_NESTED=1 cargo test --test kvm_nested -- --nocapture` after
//! `ci/nested/build-static.sh` (ci/test.sh does both). Without `EXOTAP_NESTED` it prints
//! `SKIP: <reason>`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use exotap_guest_images::{self as images, init, kernel, workloads, GuestJob};
use exotap_vmm::qemu::{self, GoAtOnce, QemuConfig, Timeouts};

/// getpid calls the inner workload makes while the splice is in.
const CALLS: u32 = 20000;
/// The variable that enables the test.
const ENABLE: &str = "EXOTAP_NESTED";
/// Where ci/nested/build-static.sh leaves the static exotap (override with EXOTAP_STATIC_BIN).
const STATIC_BIN: &str = "target/nested/exotap";

/// The inner guest's job: wait for the splice, run the workload, wait for the unsplice.
fn inner_job() -> GuestJob {
    GuestJob::from_script(format!(
        "set -e\n\
         exotap_result cpus \"$(grep -c ^processor /proc/cpuinfo)\"\n\
         exotap_wait splice\n\
         exotap_phase syscalls\n\
         syscall-loop {CALLS}\n\
         exotap_wait unsplice\n"
    ))
}

/// The outer guest's job: load KVM, run exotap's VMM on the inner guest.
fn outer_job(inner_cpus: u32, log: &str) -> GuestJob {
    GuestJob::from_script(format!(
        r#"set -e
set -o pipefail 2>/dev/null || true
for m in irqbypass kvm kvm-amd; do insmod /kvm/$m.ko; done
test -c /dev/kvm
exotap_result outer.kvm "$(/bin/exotap host)"
export EXOTAP_LOG={log}
t0=$(cut -d' ' -f1 /proc/uptime)
/bin/exotap boot --backend kvm --bzimage /kvm/vmlinuz --initrd /kvm/inner.cpio.gz \
    --memory 512 --cpus {inner_cpus} --heap-size 16 --count-entry __x64_sys_getpid \
    --boot-timeout 300 --timeout 400 2>&1 | sed 's/EXOTAP-/inner:/g'
t1=$(cut -d' ' -f1 /proc/uptime)
exotap_result inner.wall_s "$(awk -v a=$t0 -v b=$t1 'BEGIN {{print b - a}}')"
"#
    ))
}

fn static_exotap() -> PathBuf {
    std::env::var_os("EXOTAP_STATIC_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(STATIC_BIN))
}

/// The value after `prefix` on the first console line that has it.
fn after<'a>(console: &'a str, prefix: &str) -> Option<&'a str> {
    console
        .lines()
        .find_map(|l| l.find(prefix).map(|at| l[at + prefix.len()..].trim_end()))
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

#[test]
fn kvm_backend_boots_and_splices_the_inner_guest_under_nested_kvm() {
    let started = Instant::now();
    if std::env::var_os(ENABLE).is_none() {
        eprintln!(
            "SKIP: the nested KVM harness takes minutes; run ci/nested/run.sh \
             (or set {ENABLE}=1 after ci/nested/build-static.sh)"
        );
        return;
    }
    if !common::have_qemu("kvm_nested") {
        return;
    }
    let exotap = static_exotap();
    assert!(
        exotap.exists(),
        "{} is missing: build it with ci/nested/build-static.sh",
        exotap.display()
    );
    let inner_cpus: u32 = std::env::var("EXOTAP_NESTED_CPUS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    // The inner exotap's log filter (EXOTAP_LOG there).
    let log = std::env::var("EXOTAP_NESTED_LOG").unwrap_or_else(|_| "info".into());
    let kernel = images::ensure_kernel(images::DEFAULT_KERNEL).unwrap();
    let dir = tempfile::tempdir().unwrap();

    let inner = dir.path().join("inner.cpio.gz");
    images::write_initramfs(&inner_job(), &inner).unwrap();
    let busybox = std::fs::read(kernel::ensure_busybox().unwrap()).unwrap();
    let built: Vec<_> = workloads::ensure_workloads()
        .unwrap()
        .into_iter()
        .map(|w| {
            let bytes = std::fs::read(&w.binary).unwrap();
            (w, bytes)
        })
        .collect();
    let mut fs = init::assemble(busybox, &built, &outer_job(inner_cpus, &log)).unwrap();
    for m in ["irqbypass.ko", "kvm.ko", "kvm-amd.ko"] {
        let path = kernel
            .modules
            .iter()
            .find(|p| p.file_name().is_some_and(|n| n == m))
            .unwrap_or_else(|| panic!("{m} is not in the kernel cache"));
        fs.file(&format!("kvm/{m}"), 0o644, std::fs::read(path).unwrap())
            .unwrap();
    }
    fs.file(
        "kvm/vmlinuz",
        0o644,
        std::fs::read(&kernel.bzimage).unwrap(),
    )
    .unwrap();
    fs.file("kvm/inner.cpio.gz", 0o644, std::fs::read(&inner).unwrap())
        .unwrap();
    fs.file("bin/exotap", 0o755, std::fs::read(&exotap).unwrap())
        .unwrap();
    let outer = dir.path().join("outer.cpio.gz");
    fs.write_gz(std::fs::File::create(&outer).unwrap()).unwrap();

    let mut config = QemuConfig::new(kernel.bzimage.clone(), outer).unwrap();
    config.cpu_model = "max,+svm".into();
    config.memory_mib = 2048;
    config.cpus = 2;
    config.patch_heap = qemu::PatchHeapRange::place(2048 << 20, 64 << 20).unwrap();
    let timeouts = Timeouts {
        boot: Duration::from_secs(180),
        total: Duration::from_secs(900),
    };
    let mut transcript = Vec::new();
    let outcome = qemu::run(
        &config,
        dir.path(),
        timeouts,
        &mut transcript,
        &mut GoAtOnce,
    );
    let console = String::from_utf8_lossy(&transcript).into_owned();
    let ctx = format!("outer console tail:\n{}", tail(&console));
    let outcome = outcome.unwrap_or_else(|e| panic!("{e}\n{ctx}"));
    eprintln!("{console}");

    assert_eq!(outcome.rc, 0, "{ctx}");
    // The inner guest followed the protocol exactly as it does under QEMU.
    let markers: Vec<&str> = console
        .lines()
        .filter_map(|l| l.find("inner:").map(|at| &l[at..]))
        .filter(|m| !m.starts_with("inner:RESULT") && !m.starts_with("inner:READY after"))
        .collect();
    assert_eq!(
        markers,
        [
            "inner:READY",
            "inner:WAIT splice",
            "inner:GO splice",
            "inner:PHASE syscalls",
            "inner:WAIT unsplice",
            "inner:GO unsplice",
            "inner:DONE 0"
        ],
        "{ctx}"
    );
    // Every vCPU came up (the MADT), and the guest powered off through ACPI S5.
    assert_eq!(
        after(&console, "inner:RESULT cpus="),
        Some(inner_cpus.to_string().as_str()),
        "{ctx}"
    );
    if ["info", "debug", "trace"].contains(&log.as_str()) {
        assert!(
            console.contains("the VM stopped: vCPU 0 powered the machine off")
                || console.contains("the VM stopped: vCPU 1 powered the machine off"),
            "{ctx}"
        );
    }
    let calls = CALLS.to_string();
    assert_eq!(
        after(&console, "inner:RESULT getpid.calls="),
        Some(calls.as_str()),
        "{ctx}"
    );
    assert_eq!(
        after(&console, "HOST-RESULT counter.__x64_sys_getpid="),
        Some(calls.as_str()),
        "{ctx}"
    );
    assert_eq!(
        after(&console, "HOST-RESULT restored="),
        Some("yes"),
        "{ctx}"
    );
    eprintln!(
        "nested kvm: inner exotap run {} s in the outer guest ({}); whole test {:.1} s",
        after(&console, "EXOTAP-RESULT inner.wall_s=").unwrap_or("?"),
        after(&console, "inner:READY after ")
            .map(|s| format!("inner EXOTAP-READY after {s}"))
            .unwrap_or_default(),
        started.elapsed().as_secs_f64()
    );
}
