//! The VMM control socket (vmm/src/control_socket/) end to end on a real kernel, on a host
//! without hardware KVM: the test serves a QEMU guest's gdbstub machine on a control socket,
//! as `exotap boot --backend kvm --control-socket` serves its VMM, and a separate exotap runs a
//! compiled script against it with `--target vmm:PATH`: survey, plan, install, drain and removal
//! all cross the socket. The count is checked against the guest's own kprobe on the same
//! function, read at the same stops (`--compare-kprobes`). Then a second
//! exotap is killed with SIGKILL while its splice is in, and the server's end-of-connection
//! recovery (the VMM's, `Journal::recover`) puts the text back: its SHA-256, read through a
//! fresh gdbstub connection, equals the one taken before. tests/kvm_nested/ does the same
//! against the real VMM under nested KVM.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Read as _;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{exotap, have_qemu, run};
use exotap_probes::live::recover::Journal;
use exotap_vmm::control::Machine;
use exotap_vmm::control_socket::{ControlServer, MakeMachine, OnEnd, ServedGuest};
use exotap_vmm::gdb::GdbMachine;

/// `exotap boot`'s patch heap (hidden from the guest with memmap=).
const HEAP: (u64, u64) = (0x3c00_0000, 64 << 20);

/// Serves the gdbstub at `gdb` on a control socket at `path`, each client getting the
/// machine after the last one left; `recovered` collects what the end-of-connection recovery
/// did.
fn serve(gdb: &str, path: &std::path::Path, recovered: Arc<Mutex<Vec<String>>>) -> ControlServer {
    let mut machine = GdbMachine::connect(gdb, Duration::from_secs(10)).unwrap();
    // The gdbstub stopped the guest on connect.
    machine.resume().unwrap();
    let shared = Arc::new(Mutex::new(machine));
    let make: MakeMachine = {
        let shared = Arc::clone(&shared);
        Box::new(move || Box::new(Shared(Arc::clone(&shared))))
    };
    let on_end: OnEnd = Box::new(move |m, client| {
        // A gdbstub reads memory only with the guest stopped (QEMU's stub is all-stop), and a
        // client killed by a signal may leave it running: pause before reading the journal.
        // The server resumes the guest after `on_end`.
        let journal = Journal { heap_phys: HEAP.0 };
        let outcome = m
            .pause()
            .map_err(anyhow::Error::from)
            .and_then(|()| journal.lists_anything(m))
            .and_then(|listed| listed.then(|| journal.recover(m)).transpose());
        let line = match outcome {
            Ok(Some(report)) => format!("pid {}: {report}", client.pid),
            Ok(None) => return,
            Err(e) => format!("pid {}: recovery failed: {e:#}", client.pid),
        };
        recovered.lock().unwrap().push(line);
    });
    let listener = ControlServer::bind(path).unwrap();
    ControlServer::spawn(
        listener,
        path.to_path_buf(),
        ServedGuest {
            patch_heap: Some(HEAP),
        },
        make,
        on_end,
    )
    .unwrap()
}

/// One gdbstub connection shared by the server's clients in turn; `release` only resumes
/// (a gdbstub detach would end the connection the next client needs).
struct Shared(Arc<Mutex<GdbMachine>>);

macro_rules! forward {
    ($($name:ident(&mut self $(, $arg:ident: $ty:ty)*) -> $ret:ty;)*) => {
        $(fn $name(&mut self $(, $arg: $ty)*) -> $ret { self.0.lock().unwrap().$name($($arg),*) })*
    };
}

impl Machine for Shared {
    forward! {
        vcpus(&mut self) -> Result<Vec<exotap_vmm::control::VcpuId>, exotap_vmm::control::ControlError>;
        read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), exotap_vmm::control::ControlError>;
        write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), exotap_vmm::control::ControlError>;
        read_virt(&mut self, vcpu: exotap_vmm::control::VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), exotap_vmm::control::ControlError>;
        write_virt(&mut self, vcpu: exotap_vmm::control::VcpuId, addr: u64, data: &[u8]) -> Result<(), exotap_vmm::control::ControlError>;
        registers(&mut self, vcpu: exotap_vmm::control::VcpuId) -> Result<exotap_vmm::control::RegisterFile, exotap_vmm::control::ControlError>;
        set_pc(&mut self, vcpu: exotap_vmm::control::VcpuId, pc: u64) -> Result<(), exotap_vmm::control::ControlError>;
        pause(&mut self) -> Result<(), exotap_vmm::control::ControlError>;
        resume(&mut self) -> Result<(), exotap_vmm::control::ControlError>;
        set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), exotap_vmm::control::ControlError>;
        wait_event(&mut self, timeout: Duration) -> Result<Option<exotap_vmm::control::StopEvent>, exotap_vmm::control::ControlError>;
        step(&mut self, vcpu: exotap_vmm::control::VcpuId) -> Result<exotap_vmm::control::StopEvent, exotap_vmm::control::ControlError>;
        idt_base(&mut self, vcpu: exotap_vmm::control::VcpuId) -> Result<u64, exotap_vmm::control::ControlError>;
        read_phys_bulk(&mut self, addr: u64, len: usize) -> Option<Vec<u8>>;
    }
    fn is_paused(&self) -> bool {
        self.0.lock().unwrap().is_paused()
    }
    fn backend(&self) -> &'static str {
        "qemu gdbstub (served on a control socket)"
    }
    fn pause_count(&self) -> Option<u64> {
        self.0.lock().unwrap().pause_count()
    }
    fn release(&mut self) -> Result<(), exotap_vmm::control::ControlError> {
        self.resume()
    }
}

/// SHA-256 of the live kernel text through a fresh gdbstub connection (`exotap recover
/// --digest`, which also finds nothing left when all is well).
fn text_digest(gdb: &str) -> String {
    let (code, out, err) = run(exotap().args(["recover", "--digest", "--target", gdb]));
    assert_eq!(code, 0, "{out}\n{err}");
    out.lines()
        .find_map(|l| l.strip_prefix("kernel text sha256 "))
        .unwrap()
        .to_owned()
}

#[test]
fn a_compiled_script_and_a_sigkill_recovery_go_through_the_control_socket() {
    if !have_qemu("a_compiled_script_and_a_sigkill_recovery_go_through_the_control_socket") {
        return;
    }
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let gdb_socket = dir.path().join("gdb.sock");
    let gdb = format!("unix:{}", gdb_socket.display());
    // The guest arms its own kprobe (the oracle; before the first text digest, since it
    // changes the text too) and loops until the test ends it.
    let (mut guest, mut console) = common::boot_with_gdbstub(
        &[
            "--timeout",
            "600",
            "--run",
            "T=/sys/kernel/tracing; \
             echo 'p:exotap/gp __do_sys_getppid' >> $T/kprobe_events; \
             echo 1 > $T/events/exotap/enable; exotap_result armed yes; \
             while :; do syscall-loop 200 > /dev/null; done",
        ],
        &gdb_socket,
        "EXOTAP-RESULT armed=yes",
    );
    let before = text_digest(&gdb);
    // The stacks over the gdbstub itself (one connection at a time: before the server's).
    let (direct_code, direct_out, direct_err) = run(exotap().args(["backtrace", "--target", &gdb]));
    let socket = dir.path().join("vmm.sock");
    let recovered = Arc::new(Mutex::new(Vec::new()));
    let server = serve(&gdb, &socket, Arc::clone(&recovered));
    let target = format!("vmm:{}", socket.display());

    let (code, out, err) = run(exotap()
        .args([
            "run",
            "--compile",
            "require",
            "--compare-kprobes",
            "--target",
            &target,
        ])
        .args([
            "-e",
            r#"global n; probe kernel.function("__do_sys_getppid") { n++ }
               probe timer.s(5) { exit() }
               probe end { printf("n=%d\n", n) }"#,
        ]));
    let first_done = started.elapsed();
    // A fixed verb through the socket says how often the guest was stopped while its splices
    // were in (here a gdbstub behind the socket, which stops to read: any count, but said).
    let (count_code, count_out, count_err) = run(exotap().args([
        "count",
        "__do_sys_getppid",
        "--duration",
        "2",
        "--target",
        &target,
    ]));
    // Stacks through the socket: every task and vCPU, and a profile of the running loop.
    let (bt_code, bt_out, bt_err) = run(exotap().args(["backtrace", "--target", &target]));
    let (prof_code, prof_out, prof_err) = run(exotap().args([
        "profile",
        "--target",
        &target,
        "--duration",
        "2",
        "--hz",
        "20",
        "--format",
        "json",
    ]));
    let mut killed = exotap()
        .args(["run", "--compile", "require", "--target", &target])
        .args([
            "-e",
            r#"global n; probe kernel.function("__x64_sys_getpid") { n++ }"#,
        ])
        .env("EXOTAP_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = String::new();
    let mut stderr = killed.stderr.take().unwrap();
    let mut buf = [0u8; 4096];
    while !said.contains("compiled probes in at") {
        let n = stderr.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "the second client ended before its probes were in:\n{said}"
        );
        said.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    killed.kill().unwrap();
    let status = killed.wait().unwrap();
    let waited = Instant::now();
    while recovered.lock().unwrap().is_empty() && waited.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(server);
    let after = text_digest(&gdb);
    guest.kill().unwrap();
    let _ = guest.wait();
    let mut rest = String::new();
    console.read_to_string(&mut rest).unwrap();
    let ctx = format!("stdout:\n{out}\nstderr:\n{err}\nsecond client:\n{said}\nconsole:\n{rest}");

    let n: Option<u64> = out
        .lines()
        .find_map(|l| l.strip_prefix("n="))
        .and_then(|v| v.parse().ok());
    let kprobe: Option<u64> = err
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("HOST-RESULT kprobe.__do_sys_getppid=")
        })
        .and_then(|v| v.parse().ok());
    assert_eq!(code, 0, "{ctx}");
    assert!(n.is_some_and(|n| n > 0), "{ctx}");
    let count_said = format!("{count_out}{count_err}");
    assert_eq!(count_code, 0, "count through the socket:\n{count_said}");
    assert!(
        count_said
            .lines()
            .any(|l| l.contains("vCPU pauses between install and removal: ")
                && l.ends_with("(exotap's VMM, through its control socket)")),
        "count through the socket did not say its pauses:\n{count_said}"
    );
    assert!(
        count_out.contains("__do_sys_getppid"),
        "count through the socket:\n{count_said}"
    );
    assert_eq!(n, kprobe, "{ctx}");
    // kthreadd sleeps in kthreadd() for the whole run: through the socket its stack is the
    // one the gdbstub path unwinds, down to the end of the stack.
    assert_eq!(
        bt_code, 0,
        "backtrace through the socket:\n{bt_out}\n{bt_err}"
    );
    assert_eq!(
        direct_code, 0,
        "backtrace over the gdbstub:\n{direct_out}\n{direct_err}"
    );
    let kthreadd = |text: &str| -> Vec<String> {
        text.lines()
            .skip_while(|l| !l.starts_with("task 2 (kthreadd)"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .map(str::to_owned)
            .collect()
    };
    let (via_socket, via_gdb) = (kthreadd(&bt_out), kthreadd(&direct_out));
    assert!(
        via_socket.iter().any(|l| l.contains("] kthreadd+"))
            && via_socket
                .last()
                .is_some_and(|l| l.ends_with("-- end of stack")),
        "kthreadd through the socket:\n{bt_out}"
    );
    assert_eq!(via_socket, via_gdb, "kthreadd: socket vs gdbstub");
    let tasks = |text: &str| text.lines().filter(|l| l.starts_with("task ")).count();
    assert!(tasks(&bt_out) >= 20, "{bt_out}");
    // The profile samples the guest's loop: most stacks are syscall-loop's (the job runs
    // nothing else).
    assert_eq!(
        prof_code, 0,
        "profile through the socket:\n{prof_out}\n{prof_err}"
    );
    let prof: serde_json::Value = serde_json::from_str(&prof_out).expect("profile JSON");
    let samples = prof["samples"].as_u64().unwrap_or(0);
    let looping = common::profile_samples_of(&prof, "syscall-loop");
    assert!(samples >= 20, "{prof_out}");
    assert!(looping > 0, "no syscall-loop sample:\n{prof_out}");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9)
    );
    let recovered = recovered.lock().unwrap().clone();
    assert_eq!(recovered.len(), 1, "{recovered:?}\n{ctx}");
    assert!(
        recovered[0].starts_with(&format!("pid {}: 1 splices removed", killed.id())),
        "{recovered:?}\n{ctx}"
    );
    assert_eq!(after, before, "{ctx}");
    for bad in ["Oops", "BUG:", "WARNING:"] {
        assert!(!rest.contains(bad), "{bad}: {ctx}");
    }
    eprintln!(
        "control socket over QEMU's gdbstub: n={} (guest kprobe {}), the first script done after \
         {:.1} s; backtrace {} tasks, kthreadd's {} frames as over the gdbstub; profile {samples} \
         samples, {looping} in syscall-loop; recovered {}; text sha256 {before} before and \
         after; test {:.1} s",
        n.unwrap_or_default(),
        kprobe.unwrap_or_default(),
        first_done.as_secs_f64(),
        tasks(&bt_out),
        via_socket.len(),
        recovered[0],
        started.elapsed().as_secs_f64()
    );
}
