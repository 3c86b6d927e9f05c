//! `exotap boot --backend kvm --control-socket PATH`: the VMM serves its guest's control
//! interface to other exotap processes (`--target vmm:PATH`; the protocol is
//! `exotap_vmm::control_socket`).
//!
//! The socket appears when the guest prints `EXOTAP-READY`: a client that surveyed a kernel
//! still booting would find no KASLR anchors yet (measured nested: a client that connected
//! during boot failed with "cannot find the KASLR slide"). The path is checked before the
//! guest boots.
//!
//! A client changes the guest only through its connection, so when the connection ends with
//! the client's recovery journal still listing splices (the client was killed), the VMM undoes
//! them at once, with the guest paused: the VMM is the client's guardian. With
//! `--await-client` the guest's `attach` wait (before its job) is answered once a client's
//! splices are in and the guest runs again, and its `detach` wait (after the job) once no
//! client is connected, so that a job's whole run falls inside a client's session.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use exotap_probes::live::recover::Journal;
use exotap_vmm::control::Machine;
use exotap_vmm::control_socket::{Client, ControlServer, MakeMachine, OnEnd, ServedGuest};
use exotap_vmm::kvm::{KvmMachine, KvmPhaseHook};
use exotap_vmm::qemu::PatchHeapRange;

/// How often a held wait looks at the client.
const LOOK_EVERY: Duration = Duration::from_millis(20);

/// The control socket as a phase hook of the VMM's run: served from `EXOTAP-READY` on.
pub struct ControlHook {
    path: PathBuf,
    heap: PatchHeapRange,
    await_client: bool,
    /// How long a held wait waits for the client.
    wait_limit: Duration,
    server: Option<ControlServer>,
}

impl ControlHook {
    /// A socket at `path`, checked now (so that a bad path fails before the guest boots)
    /// and bound at `EXOTAP-READY`.
    ///
    /// # Errors
    /// `path` exists, or its directory does not.
    pub fn new(
        path: PathBuf,
        heap: PatchHeapRange,
        await_client: bool,
        wait_limit: Duration,
    ) -> anyhow::Result<Self> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if path.exists() {
            anyhow::bail!(
                "--control-socket {}: it exists (remove a stale socket first)",
                path.display()
            );
        }
        if !dir.is_dir() {
            anyhow::bail!(
                "--control-socket {}: there is no directory {}",
                path.display(),
                dir.display()
            );
        }
        Ok(Self {
            path,
            heap,
            await_client,
            wait_limit,
            server: None,
        })
    }

    fn serve(&mut self, machine: &KvmMachine) -> Result<(), String> {
        if self.server.is_some() {
            return Ok(());
        }
        let listener = ControlServer::bind(&self.path).map_err(|e| {
            format!(
                "--control-socket {}: cannot listen there: {e}",
                self.path.display()
            )
        })?;
        let template = machine.control();
        let make: MakeMachine = Box::new(move || Box::new(template.control()));
        let heap_phys = self.heap.base;
        let on_end: OnEnd = Box::new(move |m, client| undo_left(m, client, heap_phys));
        let guest = ServedGuest {
            patch_heap: Some((self.heap.base, self.heap.size)),
        };
        let server = ControlServer::spawn(listener, self.path.clone(), guest, make, on_end)
            .map_err(|e| format!("cannot serve the control socket: {e}"))?;
        tracing::info!(
            "control socket {}: attach with --target vmm:{}",
            self.path.display(),
            self.path.display()
        );
        self.server = Some(server);
        Ok(())
    }

    /// Holds the guest's wait until `ready` says so, within the limit.
    fn hold(
        &self,
        phase: &str,
        what: &str,
        mut ready: impl FnMut(&ControlServer) -> bool,
    ) -> Result<(), String> {
        let Some(server) = &self.server else {
            return Err("the control socket is not served".into());
        };
        let started = Instant::now();
        tracing::info!("the guest waits at {phase} until {what}");
        while !ready(server) {
            if started.elapsed() > self.wait_limit {
                return Err(format!(
                    "no {what} within {} s (--await-client)",
                    self.wait_limit.as_secs()
                ));
            }
            std::thread::sleep(LOOK_EVERY);
        }
        Ok(())
    }
}

impl KvmPhaseHook for ControlHook {
    fn at_wait(&mut self, phase: &str, machine: &mut KvmMachine) -> Result<(), String> {
        self.serve(machine)?;
        if !self.await_client {
            return Ok(());
        }
        let journal = Journal {
            heap_phys: self.heap.base,
        };
        match phase {
            "attach" => self.hold(
                phase,
                "a control client's splices are in and the guest runs",
                |server| {
                    server.client().is_some()
                        && !machine.is_paused()
                        && journal.lists_anything(machine).unwrap_or(false)
                },
            ),
            "detach" => self.hold(phase, "no control client is connected", |server| {
                server.client().is_none()
            }),
            _ => Ok(()),
        }
    }

    fn ready(&mut self, machine: &mut KvmMachine) -> Result<(), String> {
        self.serve(machine)
    }
}

/// What a client's connection leaves at its end: the splices its journal still lists are
/// undone (the guest paused; the server resumes it after).
fn undo_left(machine: &mut dyn Machine, client: Client, heap_phys: u64) {
    let journal = Journal { heap_phys };
    match journal.lists_anything(machine) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => {
            tracing::warn!(
                "control socket: cannot read client pid {}'s journal: {e:#}",
                client.pid
            );
            return;
        }
    }
    let started = Instant::now();
    let recovered = machine
        .pause()
        .map_err(anyhow::Error::from)
        .and_then(|()| journal.recover(machine));
    match recovered {
        Ok(report) => {
            outln!(
                "HOST-RESULT vmm.recovered.splices={} vmm.recovered.returns={}",
                report.splices_removed,
                report.returns_restored
            );
            eprintln!(
                "exotap VMM: control client pid {} ended with its probes in; recovered in \
                 {:.3} s: {report}",
                client.pid,
                started.elapsed().as_secs_f64()
            );
        }
        Err(e) => tracing::error!(
            "control socket: client pid {} left probes in and recovery failed: {e:#}",
            client.pid
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heap() -> PatchHeapRange {
        PatchHeapRange::place(512 << 20, 16 << 20).unwrap()
    }

    #[test]
    fn a_socket_path_that_exists_is_refused_before_the_guest_boots() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vmm.sock");
        std::fs::write(&path, b"").unwrap();

        let e = ControlHook::new(path.clone(), heap(), false, Duration::from_secs(1))
            .err()
            .unwrap();

        assert_eq!(
            e.to_string(),
            format!(
                "--control-socket {}: it exists (remove a stale socket first)",
                path.display()
            )
        );
    }

    #[test]
    fn a_socket_path_in_a_missing_directory_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("none").join("vmm.sock");

        let e = ControlHook::new(path.clone(), heap(), false, Duration::from_secs(1))
            .err()
            .unwrap();

        assert!(
            e.to_string().ends_with(&format!(
                "there is no directory {}",
                dir.path().join("none").display()
            )),
            "{e}"
        );
    }
}
