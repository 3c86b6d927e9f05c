//! `count --trap-script FILE`: a probe script that runs with host-evaluated trap probes (one
//! stop of the guest per hit) for one phase of a booted guest's job, from its `exotap_wait
//! script-in` to its `exotap_wait script-out`.
//!
//! It is the trap-per-block peer of the JIT's bench (issue 18): one job times its workload
//! uninstrumented, under a trap probe at every block leader, and through the JIT's block
//! counters, in the same guest. The phase must not overlap the splices (`splice` ..
//! `unsplice`): the script's session and the verb's are both gdbstub sessions, and QEMU
//! serves one client at a time.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Context;
use exotap_probes::lang::driver::ScriptSource;
use exotap_probes::lang::output::Format;
use exotap_probes::live::attach::Target;
use exotap_probes::live::compiled::{self, CompileMode};
use exotap_probes::live::trap_script::GuestScript;

use crate::kernel_image::KernelImage;

/// The job's wait that starts the script.
pub const START: &str = "script-in";
/// The job's wait that ends it (its `end` probes run, its traps come out).
pub const END: &str = "script-out";

/// The script before its phase, and while it runs.
#[derive(Debug)]
pub struct PhaseScript {
    pending: Option<GuestScript>,
    running: Option<(JoinHandle<i32>, Arc<AtomicBool>)>,
}

impl PhaseScript {
    /// Reads and checks the script at `path` (before anything boots); its output goes to
    /// stdout.
    ///
    /// # Errors
    /// An unreadable file, a script with errors, or one without a kernel probe.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let source = ScriptSource {
            name: path.display().to_string(),
            text: std::fs::read_to_string(path)
                .with_context(|| format!("cannot read script {}", path.display()))?,
        };
        let (prog, limits) = crate::boot::compile_checked(&source, false)?;
        anyhow::ensure!(
            prog.needs_guest(),
            "{}: the script has no kernel probe: nothing to run between the job's `exotap_wait {START}` and `exotap_wait {END}`",
            path.display()
        );
        Ok(Self {
            pending: Some(GuestScript {
                source,
                prog,
                limits,
                format: Format::Text,
                out: Box::new(std::io::stdout()),
                err: Box::new(std::io::stderr()),
                stop: Arc::new(AtomicBool::new(false)),
                compare_kprobes: false,
            }),
            running: None,
        })
    }

    /// At the job's wait `phase`: [`START`] attaches and arms the script (its `begin` probes
    /// run), [`END`] stops it and waits for its end; other waits do nothing.
    ///
    /// # Errors
    /// When the script cannot be armed, or its thread panicked.
    pub fn at_wait(
        &mut self,
        phase: &str,
        target: &Target,
        image: &KernelImage,
        heap: (u64, u64),
    ) -> anyhow::Result<()> {
        match phase {
            START => {
                let Some(script) = self.pending.take() else {
                    anyhow::bail!("a second `exotap_wait {START}`: the script runs once");
                };
                let stop = Arc::clone(&script.stop);
                let thread =
                    compiled::start_script(target, image, heap, script, CompileMode::Never)
                        .context("--trap-script")?;
                self.running = Some((thread, stop));
                Ok(())
            }
            END => self.stop(),
            _ => Ok(()),
        }
    }

    /// Ends the script if it runs (its `end` probes, removal, detach).
    ///
    /// # Errors
    /// When its thread panicked.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        let Some((thread, stop)) = self.running.take() else {
            return Ok(());
        };
        stop.store(true, Ordering::SeqCst);
        let rc = thread
            .join()
            .map_err(|_| anyhow::anyhow!("the --trap-script thread panicked"))?;
        if rc != 0 {
            eprintln!("exotap: warning: the --trap-script script ended with exit code {rc}");
        }
        Ok(())
    }

    /// Whether the job never reached [`START`] (said at the end of the run).
    pub fn never_started(&self) -> bool {
        self.pending.is_some()
    }
}
