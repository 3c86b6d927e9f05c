//! Sampling a live guest's kernel stacks from outside it: [`LiveStacks`] attaches over any
//! backend's control interface (QEMU's gdbstub, exotap's own VMM in process or through its
//! control socket) and unwinds every vCPU's and every task's kernel stack with the image's
//! ORC tables; [`sample`] and [`Sampler`] stop every vCPU at a rate, unwind and resume,
//! counting folded stacks into a [`Profile`]. `exotap backtrace` and `exotap profile` print
//! what these return.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use exotap_introspect::orc::{Backtrace, StackMemory};
use exotap_vmm::control::{Machine, VcpuId};

use super::attach::{self, Survey, Target};
use super::guest_memory::BackendMemory;
use super::kernel_image::KernelImage;
use super::session::AnyMachine;
use super::stacks::{list_tasks, GuestTask, KernelStacks, PageCache, TaskLayout};

/// One vCPU's kernel stack at a stop.
#[derive(Debug)]
pub struct VcpuStack {
    /// The vCPU.
    pub vcpu: VcpuId,
    /// Whether it was running kernel code.
    pub in_kernel: bool,
    /// Its current task's pid and command name, when readable.
    pub current: Option<(i32, String)>,
    /// Its kernel stack (no frames in user mode).
    pub backtrace: Backtrace,
}

/// A guest attached for stacks: the slide, the layout, the ORC tables, `task_struct`.
pub struct LiveStacks {
    /// The guest: QEMU's gdbstub, exotap's VMM in process or through its control socket.
    pub machine: AnyMachine,
    /// Slide and layout.
    pub survey: Survey,
    /// ORC tables and symbols at the running addresses.
    pub stacks: KernelStacks,
    /// `task_struct` members.
    pub tasks: TaskLayout,
}

impl std::fmt::Debug for LiveStacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveStacks")
            .field("stacks", &self.stacks)
            .finish_non_exhaustive()
    }
}

impl LiveStacks {
    /// Attaches (the guest stops and stays stopped) and learns what unwinding needs:
    /// to a gdbstub, or to a running exotap VMM's control socket (`vmm:PATH`).
    ///
    /// # Errors
    /// When attaching or any step of the survey fails; the guest is detached then.
    pub fn attach(target: &Target, image: &KernelImage) -> anyhow::Result<Self> {
        if let Some(client) = attach::vmm_client(target) {
            return Self::over(Box::new(client?), image);
        }
        let att = attach::attach(target)?;
        Self::over(Box::new(att.machine), image)
    }

    /// Stacks over a machine already reached: pauses it (it stays paused) and learns what
    /// unwinding needs.
    ///
    /// # Errors
    /// When the guest cannot be paused or any step of the survey fails; the machine is
    /// released then.
    pub fn over(mut machine: AnyMachine, image: &KernelImage) -> anyhow::Result<Self> {
        let started = Instant::now();
        let learned = (|| {
            machine.pause().context("cannot pause the guest")?;
            let survey = attach::survey_machine(&mut *machine, started, image)?;
            let btf = image.btf()?;
            let tasks = TaskLayout::from_btf(btf)?;
            let mut stacks = KernelStacks::load_with(image, survey.kaslr.slide, Some(btf))?;
            let mut mem = BackendMemory(&mut *machine);
            stacks.refresh_modules(&mut survey.space(&mut mem));
            anyhow::Ok((survey, stacks, tasks))
        })();
        match learned {
            Ok((survey, stacks, tasks)) => Ok(Self {
                machine,
                survey,
                stacks,
                tasks,
            }),
            Err(err) => {
                let _ = machine.release();
                Err(err)
            }
        }
    }

    /// Lets the guest go: the gdbstub's detach (taken only from a stopped guest), or a
    /// resume.
    ///
    /// # Errors
    /// When the backend refuses.
    pub fn release(mut self) -> anyhow::Result<()> {
        self.machine
            .pause()
            .context("cannot stop the guest to detach")?;
        self.machine.release().context("cannot detach")
    }

    /// Every vCPU's kernel stack; the guest must be stopped.
    ///
    /// # Errors
    /// When the vCPUs or their registers cannot be read.
    pub fn vcpu_stacks(&mut self) -> anyhow::Result<Vec<VcpuStack>> {
        let vcpus = self.machine.vcpus()?;
        let mut regs = Vec::with_capacity(vcpus.len());
        for vcpu in vcpus {
            regs.push((vcpu, self.machine.stack_registers(vcpu)?));
        }
        let mut mem = BackendMemory(&mut *self.machine);
        let mut space = self.survey.space(&mut mem);
        // One cache for the whole stop: the current tasks' and the stacks' pages.
        let mut cache = PageCache::new(&mut space);
        let mut out = Vec::with_capacity(regs.len());
        for (vcpu, r) in regs {
            let current_slot = r
                .kernel_percpu_base()
                .wrapping_add(self.survey.layout.current_task_offset);
            let current = cache
                .read_u64(current_slot)
                .ok()
                .and_then(|task| read_task_name(&mut cache, task, &self.tasks));
            let backtrace = self
                .stacks
                .unwind_knowing_modules(&mut cache, |stacks, mem| stacks.unwind_vcpu(&r, mem));
            out.push(VcpuStack {
                vcpu,
                in_kernel: r.in_kernel(),
                current,
                backtrace,
            });
        }
        Ok(out)
    }

    /// Every task and its kernel stack, unwound from its saved stack pointer (a task
    /// running on a CPU gets no stack here: its saved one is stale; see
    /// [`Self::vcpu_stacks`]). The guest must be stopped.
    ///
    /// # Errors
    /// When the task list cannot be walked.
    pub fn task_stacks(&mut self) -> anyhow::Result<Vec<(GuestTask, Option<Backtrace>)>> {
        let mut mem = BackendMemory(&mut *self.machine);
        let mut space = self.survey.space(&mut mem);
        let tasks = list_tasks(&mut space, self.survey.layout.init_task, &self.tasks)?;
        let mut cache = PageCache::new(&mut space);
        let stacks = &mut self.stacks;
        Ok(tasks
            .into_iter()
            .map(|task| {
                let bt = (!task.on_cpu).then(|| {
                    stacks.unwind_knowing_modules(&mut cache, |stacks, mem| {
                        stacks.unwind_task(task.thread_sp, mem)
                    })
                });
                (task, bt)
            })
            .collect())
    }
}

/// A task's pid and command name, read word by word through `mem`.
fn read_task_name<S: StackMemory + ?Sized>(
    mem: &mut S,
    task: u64,
    layout: &TaskLayout,
) -> Option<(i32, String)> {
    let pid = mem.read_u64(task.wrapping_add(layout.pid)).ok()? as u32 as i32;
    let comm_at = task.wrapping_add(layout.comm);
    let mut comm = [0u8; 16];
    comm[..8].copy_from_slice(&mem.read_u64(comm_at).ok()?.to_le_bytes());
    comm[8..].copy_from_slice(&mem.read_u64(comm_at.wrapping_add(8)).ok()?.to_le_bytes());
    let name = comm.split(|b| *b == 0).next().unwrap_or(&comm);
    Some((pid, String::from_utf8_lossy(name).into_owned()))
}

/// What a sampling run gathered.
#[derive(Debug, Default, Clone)]
pub struct Profile {
    /// Folded stack → samples.
    pub stacks: BTreeMap<String, u64>,
    /// vCPU samples taken.
    pub samples: u64,
    /// Samples whose unwind did not reach the end of the stack or user mode.
    pub incomplete: u64,
    /// Samples in user mode.
    pub user: u64,
    /// Stops made.
    pub stops: u64,
    /// Time the guest spent stopped by the sampler.
    pub stopped: Duration,
    /// Of that, the time from asking for each stop to having it.
    pub stopping: Duration,
    /// Time from the first stop to the end of sampling.
    pub wall: Duration,
    /// Why sampling ended early, if it did.
    pub ended_by: Option<String>,
}

impl Profile {
    /// Fraction of the sampling time the guest was stopped.
    pub fn stop_fraction(&self) -> f64 {
        if self.wall.is_zero() {
            0.0
        } else {
            self.stopped.as_secs_f64() / self.wall.as_secs_f64()
        }
    }

    /// Adds one vCPU's sample.
    pub fn add(&mut self, stacks: &KernelStacks, sample: &VcpuStack) {
        self.samples += 1;
        let comm = sample
            .current
            .as_ref()
            .map_or_else(|| "[unknown]".to_owned(), |(_, comm)| comm.clone());
        let mut parts = vec![sanitize(&comm)];
        if !sample.in_kernel {
            self.user += 1;
            parts.push("[user]".into());
        } else {
            if !sample.backtrace.is_complete() {
                self.incomplete += 1;
                parts.push("[incomplete]".into());
            }
            for frame in sample.backtrace.frames.iter().rev() {
                parts.push(match stacks.function_name(frame) {
                    Some(name) => sanitize(&name),
                    None => format!("{:#x}", frame.pc),
                });
            }
        }
        *self.stacks.entry(parts.join(";")).or_default() += 1;
    }

    /// Folded lines, `stack count`, hottest first.
    pub fn folded_lines(&self) -> Vec<String> {
        let mut lines: Vec<(&String, &u64)> = self.stacks.iter().collect();
        lines.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        lines
            .into_iter()
            .map(|(stack, count)| format!("{stack} {count}"))
            .collect()
    }
}

/// A folded-stack frame name may not hold the separator or whitespace.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c == ';' || c.is_whitespace() {
                '_'
            } else {
                c
            }
        })
        .collect()
}

/// Samples at `hz` until `stop` is set or `deadline` passes; the guest is running when it
/// starts and when it returns (unless it ended).
pub fn sample(
    live: &mut LiveStacks,
    hz: u32,
    stop: &AtomicBool,
    deadline: Option<Instant>,
) -> Profile {
    let period = Duration::from_secs_f64(1.0 / f64::from(hz));
    let mut profile = Profile::default();
    let started = Instant::now();
    let mut next = started;
    while !stop.load(Ordering::SeqCst) && deadline.is_none_or(|d| Instant::now() < d) {
        let stop_began = Instant::now();
        if let Err(err) = live.machine.pause() {
            profile.ended_by = Some(format!(
                "the guest could not be stopped: {:#}",
                anyhow::Error::new(err)
            ));
            break;
        }
        profile.stopping += stop_began.elapsed();
        let result = live.vcpu_stacks();
        let resumed = live.machine.resume();
        profile.stopped += stop_began.elapsed();
        profile.stops += 1;
        match result {
            Ok(samples) => {
                for s in &samples {
                    profile.add(&live.stacks, s);
                }
            }
            Err(err) => {
                profile.ended_by = Some(format!("reading the vCPUs failed: {err:#}"));
                break;
            }
        }
        if let Err(err) = resumed {
            profile.ended_by = Some(format!(
                "the guest could not be resumed: {:#}",
                anyhow::Error::new(err)
            ));
            break;
        }
        next += period;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            // Behind (stops slower than the period): sample again at once, no catch-up burst.
            next = now;
        }
    }
    profile.wall = started.elapsed();
    profile
}

/// A sampler on its own thread, owning the attached guest.
#[derive(Debug)]
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(LiveStacks, Profile)>,
}

impl Sampler {
    /// Resumes the attached guest and samples it until [`Sampler::finish`].
    pub fn start(mut live: LiveStacks, hz: u32, duration: Option<f64>) -> anyhow::Result<Self> {
        live.machine.resume()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let deadline = duration.map(|s| Instant::now() + Duration::from_secs_f64(s));
        let thread = std::thread::Builder::new()
            .name("exotap-sampler".into())
            .spawn(move || {
                let profile = sample(&mut live, hz, &flag, deadline);
                (live, profile)
            })
            .context("cannot start the sampling thread")?;
        Ok(Self { stop, thread })
    }

    /// Stops sampling, detaches, and returns the profile.
    pub fn finish(self) -> anyhow::Result<Profile> {
        self.stop.store(true, Ordering::SeqCst);
        let (live, profile) = self
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("the sampling thread panicked"))?;
        // The stub takes a detach only from a stopped guest (running, it answers nothing
        // but an interrupt); detaching lets the guest run on.
        if let Err(err) = live.release() {
            tracing::warn!("detaching after sampling failed: {err:#}");
        }
        Ok(profile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_names_lose_separators_and_spaces() {
        assert_eq!(sanitize("kworker/0:1 x;y"), "kworker/0:1_x_y");
    }

    #[test]
    fn folded_lines_put_the_hottest_first() {
        let mut profile = Profile::default();
        profile.stacks.insert("a;b".into(), 2);
        profile.stacks.insert("a;c".into(), 5);

        assert_eq!(profile.folded_lines(), ["a;c 5", "a;b 2"]);
    }

    #[test]
    fn stop_fraction_of_no_time_is_zero() {
        assert_eq!(Profile::default().stop_fraction(), 0.0);
    }
}
