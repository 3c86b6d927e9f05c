//! `--backend kvm` on every live command. Where this host's `/dev/kvm` cannot run Linux
//! (kvm_pvm here, or no /dev/kvm), each command must refuse at once, before loading an image
//! or booting anything, naming why; the reason is checked against what the host shows
//! (`/sys/module/kvm_pvm`, `/dev/kvm`). Where hardware KVM works the commands would run for
//! real: these tests print SKIP there (tests/kvm_nested/ runs them under nested KVM).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;

use exotap_vmm::host;

/// The reason the host gives, or None (with SKIP printed) where hardware KVM works.
fn refusal_expected(test: &str) -> Option<String> {
    let support = host::detect();
    match support.reason() {
        Some(reason) => Some(reason),
        None => {
            eprintln!(
                "SKIP {test}: this host has hardware KVM ({}), so --backend kvm would run; \
                 tests/kvm_nested/ covers the real runs",
                support.explain()
            );
            None
        }
    }
}

/// Runs `exotap ARGS --backend kvm` and checks the refusal.
fn assert_refused(test: &str, args: &[&str]) {
    let Some(reason) = refusal_expected(test) else {
        return;
    };
    let (code, stdout, stderr) =
        common::run(common::exotap().args(args).args(["--backend", "kvm"]));

    assert_ne!(code, 0, "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!("--backend kvm refused: {reason}")),
        "{stderr}"
    );
    // The host's own facts, outside exotap: the module or the missing device.
    if Path::new("/sys/module/kvm_pvm").exists() {
        assert!(stderr.contains("kvm_pvm"), "{stderr}");
        assert!(
            stderr.contains("cannot run an unmodified Linux kernel"),
            "{stderr}"
        );
    } else if !Path::new("/dev/kvm").exists() {
        assert!(stderr.contains("there is no /dev/kvm"), "{stderr}");
    }
    // Refused before anything booted.
    assert!(
        !stdout.contains("EXOTAP-") && !stderr.contains("EXOTAP-"),
        "{stderr}"
    );
}

#[test]
fn count_refuses_kvm_naming_the_host_reason() {
    assert_refused("count", &["count", "__x64_sys_getpid"]);
}

#[test]
fn time_refuses_kvm_naming_the_host_reason() {
    assert_refused("time", &["time", "vfs_read"]);
}

#[test]
fn trace_refuses_kvm_naming_the_host_reason() {
    assert_refused("trace", &["trace", "vfs_read"]);
}

#[test]
fn nullify_refuses_kvm_naming_the_host_reason() {
    assert_refused("nullify", &["nullify", "__x64_sys_getppid", "4242"]);
}

#[test]
fn replace_refuses_kvm_naming_the_host_reason() {
    assert_refused(
        "replace",
        &["replace", "__x64_sys_getppid", "__x64_sys_getpid"],
    );
}

#[test]
fn splice_report_refuses_kvm_naming_the_host_reason() {
    assert_refused("splice-report", &["splice-report"]);
}

#[test]
fn profile_refuses_kvm_naming_the_host_reason() {
    assert_refused("profile", &["profile", "--run", "syscall-loop 100"]);
}

#[test]
fn backtrace_refuses_kvm_naming_the_host_reason() {
    assert_refused("backtrace", &["backtrace"]);
}

#[test]
fn boot_script_refuses_kvm_naming_the_host_reason() {
    assert_refused(
        "boot --script",
        &[
            "boot",
            "--script-text",
            "global n\nprobe kernel.function(\"__x64_sys_getpid\") { n++ }\nprobe end { println(n) }",
        ],
    );
}

#[test]
fn kvm_with_target_is_refused() {
    let (code, _, stderr) = common::run(common::exotap().args([
        "count",
        "--target",
        "tcp:127.0.0.1:1",
        "--backend",
        "kvm",
        "__x64_sys_getpid",
    ]));

    assert_ne!(code, 0);
    // The host's reason where it has no usable KVM, else the gdbstub's.
    let expected = host::detect().reason().unwrap_or_else(|| {
        "--target (attaching to a running guest's gdbstub) needs the qemu backend".into()
    });
    assert!(stderr.contains(&expected), "{stderr}");
}

#[test]
fn boot_control_socket_refuses_kvm_naming_the_host_reason_and_binds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vmm.sock");

    assert_refused(
        "boot --control-socket",
        &["boot", "--control-socket", socket.to_str().unwrap()],
    );

    assert!(!socket.exists());
}

#[test]
fn control_socket_with_the_qemu_backend_is_refused_naming_gdbstub() {
    let (code, _, stderr) = common::run(common::exotap().args([
        "boot",
        "--backend",
        "qemu",
        "--control-socket",
        "/nonexistent/vmm.sock",
    ]));

    assert_ne!(code, 0);
    assert!(
        stderr.contains("--control-socket is exotap's VMM's (--backend kvm); QEMU's is --gdbstub"),
        "{stderr}"
    );
}

#[test]
fn a_vmm_target_nothing_listens_on_is_named_with_the_connect_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let target = format!("vmm:{}", socket.display());

    let (code, _, stderr) =
        common::run(common::exotap().args(["count", "--target", &target, "__x64_sys_getpid"]));

    assert_ne!(code, 0);
    assert!(
        stderr.contains(&format!("cannot attach to {target}")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("cannot connect to {}", socket.display())),
        "{stderr}"
    );
}

#[test]
fn commands_that_need_a_gdbstub_refuse_a_vmm_target_saying_what_it_serves() {
    let (code, _, stderr) =
        common::run(common::exotap().args(["recover", "--target", "vmm:/nonexistent/vmm.sock"]));

    assert_ne!(code, 0);
    assert!(
        stderr.contains("vmm:/nonexistent/vmm.sock is an exotap VMM's control socket"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the VMM undoes a dead client's probes itself"),
        "{stderr}"
    );
}
