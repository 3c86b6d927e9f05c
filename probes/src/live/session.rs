//! One session of the engine with a live guest: attach → plan → install → run and drain →
//! remove → detach (the phases are documented in [`super`]).

use std::time::Duration;

use anyhow::Context as _;
use exotap_vmm::control::{Machine, StopEvent};

use super::attach::{self, Survey, Target};
use super::guest_memory::BackendMemory;
use super::kernel_image::KernelImage;
use super::shared::{SharedHeap, FAST_PATH_HINT};
use super::splicer::{InstallReport, RemoveReport, Request, SiteCode, Splicer, TraceRecord};

/// The control interface of any backend, as a session holds it: QEMU's gdbstub
/// ([`exotap_vmm::gdb::GdbMachine`]) or exotap's own KVM VMM ([`exotap_vmm::kvm::KvmMachine`]).
pub type AnyMachine = Box<dyn Machine + Send>;

/// An attached guest, surveyed, and what the engine put into it.
///
/// The guest is paused from [`GuestSession::attach`] until the first [`GuestSession::resume`].
/// Dropping a session that was not [detached](GuestSession::detach) (an error, a panic
/// unwinding, a caller that returned early) still pauses the guest, removes every splice
/// and detaches, so the guest runs on with its original text.
pub struct GuestSession {
    /// The guest's control interface. Pause it before writing its text, and before reading
    /// its memory unless [`Machine::reads_while_running`].
    pub machine: AnyMachine,
    /// The KASLR slide and the kernel layout found at attach.
    pub survey: Survey,
    splicer: Option<Splicer>,
    /// The guest's RAM shared with exotap, checked against the gdbstub at attach: the
    /// zero-stop data path. `None`: rings and counters are read with the guest stopped.
    shared: Option<SharedHeap>,
    /// Set once the session has detached: dropping it then does nothing.
    detached: bool,
}

impl std::fmt::Debug for GuestSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestSession")
            .field("slide", &format_args!("{:#x}", self.survey.kaslr.slide))
            .field("splicer", &self.splicer)
            .field("detached", &self.detached)
            .finish_non_exhaustive()
    }
}

impl GuestSession {
    /// Attaches to the gdbstub at `target` (the guest stops) and surveys the running kernel:
    /// the KASLR slide and the layout of `image`'s kernel.
    ///
    /// # Errors
    /// When the gdbstub cannot be reached or the survey fails; the guest is detached then.
    /// With [`Target::shm`], the RAM file is mapped and compared with the gdbstub's view of
    /// the kernel's page-table root; a file that cannot be used gives a warning and the
    /// stop-and-read path.
    pub fn attach(target: &Target, image: &KernelImage) -> anyhow::Result<Self> {
        if let Some(client) = attach::vmm_client(target) {
            // No shared-RAM file to map: the client maps the VMM's memfd itself.
            return Self::over(Box::new(client?), image);
        }
        let mut att = attach::attach(target)?;
        match attach::survey(&mut att, image) {
            Ok(survey) => {
                tracing::debug!("attached: the guest is stopped and surveyed");
                let shared = target.shm.as_deref().and_then(|path| {
                    let heap = SharedHeap::open(path)
                        .and_then(|h| h.verify(&mut att.machine, survey.cr3 & !0xfff).map(|()| h));
                    match heap {
                        Ok(h) => Some(h),
                        Err(e) => {
                            tracing::warn!(
                                "{:#}; reading with the guest stopped instead ({FAST_PATH_HINT})",
                                anyhow::Error::from(e)
                            );
                            None
                        }
                    }
                });
                Ok(Self {
                    machine: Box::new(att.machine),
                    survey,
                    splicer: None,
                    shared,
                    detached: false,
                })
            }
            Err(e) => {
                let _ = att.machine.detach();
                Err(e)
            }
        }
    }

    /// A session over a machine this process already holds (exotap's own KVM VMM): pauses
    /// every vCPU and surveys the running kernel as [`GuestSession::attach`] does.
    ///
    /// # Errors
    /// When the guest cannot be paused or the survey fails; the guest runs on then.
    pub fn over(mut machine: AnyMachine, image: &KernelImage) -> anyhow::Result<Self> {
        let started = std::time::Instant::now();
        machine.pause().context("cannot pause the guest")?;
        match attach::survey_machine(&mut *machine, started, image) {
            Ok(survey) => {
                tracing::debug!("attached: the guest is stopped and surveyed");
                Ok(Self {
                    machine,
                    survey,
                    splicer: None,
                    shared: None,
                    detached: false,
                })
            }
            Err(e) => {
                let _ = machine.release();
                Err(e)
            }
        }
    }

    /// The plan phase: maps the patch heap (the hidden physical range `heap`, GPA and size)
    /// into kernel space and reads and analyses the live kernel text, so that sites can be
    /// planned ([`Splicer::kernel`]) and installed. Done once; later calls return the same
    /// splicer. The guest must be paused.
    ///
    /// # Errors
    /// When the heap cannot be mapped or the text read.
    pub fn plan(&mut self, image: &KernelImage, heap: (u64, u64)) -> anyhow::Result<&mut Splicer> {
        if self.splicer.is_none() {
            // A backend that knows the range it kept out of the guest's RAM says so (a VMM
            // over its control socket); the caller's range is the default for a gdbstub.
            let heap = match self.machine.patch_heap() {
                Some(known) if known != heap => {
                    tracing::debug!(
                        "patch heap {:#x}:{:#x}, as the {} backend says",
                        known.0,
                        known.1,
                        self.machine.backend()
                    );
                    known
                }
                _ => heap,
            };
            let mut splicer = Splicer::new(&mut *self.machine, &self.survey, image, heap)?;
            if let Some(shared) = self.shared.as_mut() {
                let (va, phys, size) = splicer.heap_range();
                shared.set_heap(va, phys, size);
                splicer.shared = Some(shared.clone());
            }
            self.splicer = Some(splicer);
        }
        self.splicer
            .as_mut()
            .context("the splicer is missing right after it was made")
    }

    /// Whether rings, counters and data are read through shared RAM, without stopping the
    /// guest.
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// The shared patch heap (after [`GuestSession::plan`]), for readers that run while the
    /// guest does.
    pub fn shared_heap(&self) -> Option<&SharedHeap> {
        self.splicer.as_ref().and(self.shared.as_ref())
    }

    /// How many times the guest was stopped since attaching (see
    /// [`exotap_vmm::gdb::GdbMachine::stops`]).
    pub fn stops(&self) -> u64 {
        self.machine.pause_count().unwrap_or(0)
    }

    /// The splicer of the plan phase, if [`GuestSession::plan`] ran.
    pub fn splicer(&self) -> Option<&Splicer> {
        self.splicer.as_ref()
    }

    /// The guest's control interface and the splicer together (for reads and writes of the
    /// patch heap while the guest is paused).
    ///
    /// # Errors
    /// When [`GuestSession::plan`] has not run.
    pub fn parts(&mut self) -> anyhow::Result<(&mut dyn Machine, &mut Splicer)> {
        let splicer = self
            .splicer
            .as_mut()
            .context("the session has no splicer: plan first")?;
        Ok((&mut *self.machine, splicer))
    }

    /// Patch-heap memory for a compiled script's data and helpers.
    ///
    /// # Errors
    /// When [`GuestSession::plan`] has not run, or the heap is full.
    pub fn alloc(&mut self, size: u64, align: u64) -> anyhow::Result<u64> {
        self.parts()?.1.alloc(size, align)
    }

    /// Writes `bytes` at patch-heap address `va` (the guest paused).
    ///
    /// # Errors
    /// When [`GuestSession::plan`] has not run, or guest memory cannot be written.
    pub fn write_heap(&mut self, va: u64, bytes: &[u8]) -> anyhow::Result<()> {
        let (machine, splicer) = self.parts()?;
        splicer.write_heap(machine, va, bytes)
    }

    /// Reads `len` bytes at patch-heap address `va` (the guest paused).
    ///
    /// # Errors
    /// When [`GuestSession::plan`] has not run, or guest memory cannot be read.
    pub fn read_heap(&mut self, va: u64, len: usize) -> anyhow::Result<Vec<u8>> {
        let (machine, splicer) = self.parts()?;
        splicer.read_heap(machine, va, len)
    }

    /// The install phase for the fixed operations (count, time, trace, nullify, replace):
    /// plans, generates and writes every request in one batch (the guest paused).
    ///
    /// # Errors
    /// When [`GuestSession::plan`] has not run, or generating or writing fails (what went in
    /// is taken out again then).
    pub fn install(&mut self, requests: &[Request]) -> anyhow::Result<InstallReport> {
        let (machine, splicer) = self.parts()?;
        splicer.install(machine, requests)
    }

    /// The install phase for compiled probes: as [`GuestSession::install`], with `code`
    /// generating each site's bodies.
    ///
    /// # Errors
    /// As [`GuestSession::install`].
    pub fn install_compiled(
        &mut self,
        requests: &[Request],
        code: &mut dyn SiteCode,
    ) -> anyhow::Result<InstallReport> {
        let (machine, splicer) = self.parts()?;
        splicer.install_compiled(machine, requests, code)
    }

    /// Lets the guest run.
    ///
    /// # Errors
    /// When the gdbstub refuses.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        self.machine.resume().context("cannot resume the guest")
    }

    /// Stops every vCPU (nothing when already stopped).
    ///
    /// # Errors
    /// When the gdbstub refuses.
    pub fn pause(&mut self) -> anyhow::Result<()> {
        if !self.machine.is_paused() {
            self.machine.pause().context("cannot pause the guest")?;
        }
        Ok(())
    }

    /// Stops the guest for a read of its data, unless the backend reads guest memory while it
    /// runs (exotap's own VMM maps it: no stop at all). Returns whether it stopped the guest;
    /// pass that to [`GuestSession::resume_after_read`].
    ///
    /// # Errors
    /// When the guest cannot be paused.
    pub fn pause_for_read(&mut self) -> anyhow::Result<bool> {
        if self.machine.reads_while_running() || self.machine.is_paused() {
            return Ok(false);
        }
        self.pause()?;
        Ok(true)
    }

    /// Lets the guest run again after [`GuestSession::pause_for_read`] stopped it.
    ///
    /// # Errors
    /// When the backend refuses.
    pub fn resume_after_read(&mut self, paused: bool) -> anyhow::Result<()> {
        if paused {
            self.resume()?;
        }
        Ok(())
    }

    /// How many times the vCPUs were paused so far, where the backend counts them.
    pub fn pause_count(&self) -> Option<u64> {
        self.machine.pause_count()
    }

    /// Waits up to `timeout` for the running guest to stop (a breakpoint, the guest's end).
    ///
    /// # Errors
    /// When the connection to the gdbstub is lost.
    pub fn wait(&mut self, timeout: Duration) -> anyhow::Result<Option<StopEvent>> {
        self.machine.wait_event(timeout).context("lost the guest")
    }

    /// The drain phase: the trace records written since the last drain (the guest paused,
    /// or running when its RAM is shared); nothing when no trace splices are in.
    ///
    /// # Errors
    /// When the rings cannot be read.
    pub fn drain(&mut self, last: bool) -> anyhow::Result<Vec<(u32, TraceRecord)>> {
        match self.splicer.as_mut() {
            Some(splicer) => splicer.drain_rings(&mut *self.machine, last),
            None => Ok(Vec::new()),
        }
    }

    /// Stops the thread that drains the rings through shared RAM, if one runs; what it
    /// drained ([`Splicer::drain_statistics`]).
    pub fn stop_drainer(&mut self) -> Option<super::drainer::DrainState> {
        let splicer = self.splicer.as_mut()?;
        splicer.stop_drainer();
        splicer.drain_statistics().cloned()
    }

    /// The remove phase: pauses the guest, reads the counters, histograms and last records,
    /// and writes back every original instruction; after it nothing of the session is left in
    /// the kernel text (its report hashes the touched pages before and after). The patch heap
    /// stays mapped: threads preempted inside a patch can still return through it.
    ///
    /// # Errors
    /// When the guest cannot be paused or its memory read or written.
    pub fn remove(&mut self) -> anyhow::Result<RemoveReport> {
        self.pause()?;
        match self.splicer.as_mut() {
            Some(splicer) if !splicer.installed.is_empty() => splicer.remove(&mut *self.machine),
            _ => Ok(RemoveReport::default()),
        }
    }

    /// Ends the session: removes whatever is still installed, then detaches (QEMU drops its
    /// breakpoints and the guest runs on; exotap's own VMM resumes its vCPUs).
    ///
    /// # Errors
    /// When the removal or the detach fails; the detach is tried either way.
    pub fn detach(mut self) -> anyhow::Result<()> {
        let removed = if self.installed() {
            self.remove().map(drop)
        } else {
            Ok(())
        };
        self.detached = true;
        let detached = self
            .machine
            .release()
            .context("cannot detach from the guest");
        removed.and(detached)
    }

    /// Ends the session without removing anything: for a guest that has ended (its splices
    /// went with it).
    pub fn abandon(mut self) {
        self.detached = true;
    }

    /// How far the guest's wall clock (CLOCK_REALTIME as of its last timekeeping update:
    /// `shadow_timekeeper`'s `xtime_sec` and `tkr_mono.xtime_nsec >> tkr_mono.shift`, a
    /// tick old at most) is ahead of this host's, in ns; the guest paused. Probes run on
    /// the host add it to the host's time, so that they read the clock compiled probes
    /// read in the guest (`ktime_get_real_fast_ns`): a TCG guest's clock is seconds to
    /// minutes off the host's.
    ///
    /// # Errors
    /// When the image lacks the symbol or the BTF members, or the guest cannot be read.
    pub fn clock_offset_ns(&mut self, image: &KernelImage) -> anyhow::Result<i64> {
        let btf = image.btf()?;
        let member = |s: &str, m: &str| -> anyhow::Result<u64> {
            btf.struct_member(s, m)
                .ok()
                .and_then(|m| m.byte_offset())
                .with_context(|| format!("BTF has no byte offset for {s}.{m}"))
        };
        let tk = image
            .address("shadow_timekeeper")?
            .wrapping_add(self.survey.kaslr.slide);
        let tkr = tk.wrapping_add(member("timekeeper", "tkr_mono")?);
        let fields = [
            (tk.wrapping_add(member("timekeeper", "xtime_sec")?), 8),
            (tkr.wrapping_add(member("tk_read_base", "xtime_nsec")?), 8),
            (tkr.wrapping_add(member("tk_read_base", "shift")?), 4),
        ];
        let mut mem = BackendMemory(&mut *self.machine);
        let mut space = self.survey.space(&mut mem);
        let mut words = [0u64; 3];
        for (w, (at, len)) in words.iter_mut().zip(fields) {
            let mut b = [0u8; 8];
            space
                .read(at, &mut b[..len])
                .context("cannot read the guest's timekeeper")?;
            *w = u64::from_le_bytes(b);
        }
        let host = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let [sec, nsec, shift] = words;
        let guest = i128::from(sec) * 1_000_000_000 + i128::from(nsec >> (shift & 63));
        i64::try_from(guest - i128::try_from(host)?).context("the guest's clock is out of range")
    }

    /// The guest kernel's TSC rate (`tsc_khz`, at least 1), to turn recorded TSC values into
    /// time; the guest paused.
    ///
    /// # Errors
    /// When `image` has no `tsc_khz` or the guest's copy cannot be read.
    pub fn tsc_khz(&mut self, image: &KernelImage) -> anyhow::Result<u32> {
        let at = image
            .address("tsc_khz")?
            .wrapping_add(self.survey.kaslr.slide);
        let mut b = [0u8; 4];
        let mut mem = BackendMemory(&mut *self.machine);
        self.survey
            .space(&mut mem)
            .read(at, &mut b)
            .context("cannot read the guest's tsc_khz")?;
        Ok(u32::from_le_bytes(b).max(1))
    }

    /// Waits until `waiter` sleeps: a task named `waiter.comm`, asleep interruptibly off
    /// its CPU, whose saved kernel stack passes through `waiter.function`; leaves the guest
    /// paused there. Gives up after `limit` (returns `false`, the guest paused). The guest's
    /// `exotap_wait` prints its wait line, then blocks in its shell's own read of the host's
    /// go byte: pausing once that read sleeps stops every wait at the same point of the
    /// guest's work, whatever the host's load (what the shell does between the line and the
    /// read is then behind it). A count read there, and one read at a later wait, bound the
    /// same work as the guest's own counters read at two such waits. The comm alone does not
    /// tell the waiting shell from the others (the init shell waits for the job's subshell
    /// under the same name), hence the stack.
    ///
    /// # Errors
    /// When the guest cannot be paused or resumed, or its task list cannot be read.
    pub fn settle_at_wait(
        &mut self,
        layout: &super::stacks::TaskLayout,
        stacks: &super::stacks::KernelStacks,
        waiter: &Waiter<'_>,
        limit: Duration,
    ) -> anyhow::Result<bool> {
        let started = std::time::Instant::now();
        loop {
            self.pause()?;
            let mut mem = BackendMemory(&mut *self.machine);
            let mut space = self.survey.space(&mut mem);
            let tasks =
                super::stacks::list_tasks(&mut space, self.survey.layout.init_task, layout)?;
            let mut cache = super::stacks::PageCache::new(&mut space);
            let asleep = tasks
                .iter()
                .filter(|t| t.comm == waiter.comm && t.state_letter() == 'S' && !t.on_cpu)
                .any(|t| {
                    stacks
                        .unwind_task(t.thread_sp, &mut cache)
                        .frames
                        .iter()
                        .any(|frame| {
                            stacks.function_name(frame).as_deref() == Some(waiter.function)
                        })
                });
            if asleep {
                return Ok(true);
            }
            if started.elapsed() >= limit {
                return Ok(false);
            }
            self.resume()?;
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether splices are in the guest.
    pub fn installed(&self) -> bool {
        self.splicer
            .as_ref()
            .is_some_and(|s| !s.installed.is_empty())
    }
}

/// A guest task [`GuestSession::settle_at_wait`] waits for: its command name, and a function
/// its saved kernel stack passes through while it sleeps.
#[derive(Debug, Clone, Copy)]
pub struct Waiter<'a> {
    /// `task->comm`.
    pub comm: &'a str,
    /// A kernel function's name, as the symbol table has it.
    pub function: &'a str,
}

impl Drop for GuestSession {
    fn drop(&mut self) {
        if self.detached {
            return;
        }
        if self.installed() {
            tracing::warn!("a live session ends without its removal phase: removing its splices");
            if let Err(e) = self.remove() {
                tracing::error!("removing the splices failed: {e:#}");
            }
        }
        if let Err(e) = self.machine.release() {
            tracing::warn!("detaching failed: {e}");
        }
    }
}
