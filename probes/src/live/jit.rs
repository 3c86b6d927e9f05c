//! The JIT against a live guest (issue 18): chosen kernel functions, and the functions
//! they call directly (to a depth), translated from the *live* text into a code cache in
//! the patch heap ([`crate::jit`]), entered through a `jmp` splice at each translated
//! function's entry, counted per basic block while the guest runs, and taken out again.
//!
//! # Install (the guest stopped)
//! The session's live text and its analysis ([`super::splicer::LiveKernel`]) give each
//! function's CFG and liveness; the translator copies the functions block by block into a
//! region of the patch heap (code, block counters, lookup table). Calls to retpoline
//! thunks go through the lookup table like `call *%rax`. The code goes over the backend's
//! write path (QEMU then drops its translated blocks of those addresses), the zeroed
//! counters and the table through the shared RAM where there is one. Then the entry
//! splices go in as one batch of the splicer ([`Action::Enter`]: journaled for recovery,
//! checked against the bytes planned over, restored byte-exact).
//!
//! # What is counted, and what is not
//! A block's counter counts the executions of its translation. Code runs outside the cache
//! after an instruction the kernel finds by address (user accesses with exception-table
//! entries run at their original address), after a return from a function that is not
//! translated (its `ret` pops an ORIGINAL return address, which lands in original text:
//! the stack never holds a cache address), and after a lookup miss of an indirect branch.
//! From there the rest of that execution of the function, and of its callers up the stack,
//! runs uncounted until the next entry splice is hit. Lazy translation and re-entry at such
//! return sites are not built (issue 18).
//!
//! # Remove (the guest stopped)
//! The counters are read; the splicer writes back every entry's original bytes and hashes
//! the touched pages; the lookup table is zeroed, so every return and indirect branch still
//! in the cache continues at its original target; then exotap checks that no vCPU's RIP and
//! no word of a live kernel stack (each vCPU's from its RSP, every other task's from its
//! saved `thread.sp`) points into the cache's code, letting the guest run a little and
//! checking again while one does ([`Reachability`]). Only then is the heap given up.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use exotap_introspect::btf::Btf;
use exotap_introspect::x86::{thunk_register, Flow};
use exotap_vmm::control::{Machine, VcpuId};

use super::attach;
use super::guest_memory::BackendMemory;
use super::kernel_image::KernelImage;
use super::session::GuestSession;
use super::splicer::{Action, InstallReport, NotInstalled, RemoveReport, Request};
use super::stacks::{list_tasks, TaskLayout};
use crate::jit::{CacheLayout, ExitReason, TranslateError, Translation, Translator};

/// What to translate and how much room to give it.
#[derive(Debug, Clone)]
pub struct JitOptions {
    /// Direct callees are translated to this depth (0: only the functions asked for).
    pub depth: u32,
    /// At most this many functions are translated in all.
    pub max_functions: usize,
    /// Bytes of translated code.
    pub code_bytes: u64,
    /// Bytes of block counters (8 a block).
    pub counter_bytes: u64,
    /// Bytes of lookup table (16 a slot; at most half the slots are used).
    pub table_bytes: u64,
}

impl Default for JitOptions {
    fn default() -> Self {
        Self {
            depth: 1,
            max_functions: 4000,
            code_bytes: 8 << 20,
            counter_bytes: 1 << 20,
            table_bytes: 8 << 20,
        }
    }
}

/// One block's count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCount {
    /// The function's name.
    pub function: String,
    /// The function's entry (running kernel).
    pub function_addr: u64,
    /// The block leader (running kernel).
    pub leader: u64,
    /// Executions of the block's translation.
    pub count: u64,
    /// Whether the function was asked for (else it was translated as a callee).
    pub requested: bool,
}

/// Translations in a live guest, between install and removal.
#[derive(Debug)]
pub struct LiveJit {
    /// What was translated.
    pub translation: Translation,
    /// The cache's parts in the patch heap.
    pub layout: CacheLayout,
    /// Function entry → name, for every translated function.
    pub names: BTreeMap<u64, String>,
    /// The entries asked for.
    pub requested: BTreeSet<u64>,
    /// Functions the translator refused, and why.
    pub refused: Vec<(String, String)>,
    /// Time to choose and translate the functions.
    pub translate_time: Duration,
    /// Bytes of original text translated.
    pub source_bytes: u64,
    /// The entry splices' install report (entries refused are reachable only from
    /// translated callers).
    pub entries: InstallReport,
    /// Entry splices in place.
    pub entries_installed: usize,
}

/// What the reachability check at removal found.
#[derive(Debug, Clone, Default)]
pub struct Reachability {
    /// Checks made (each with the guest stopped).
    pub checks: u32,
    /// Words that pointed into the cache at the last check: (where, what).
    pub found: Vec<(String, u64)>,
    /// Stack bytes scanned at the last check.
    pub scanned_bytes: u64,
    /// Tasks whose stacks were scanned.
    pub tasks: usize,
}

impl Reachability {
    /// Whether the cache was unreachable at the last check.
    pub fn unreachable(&self) -> bool {
        self.found.is_empty()
    }
}

/// What a removal found.
#[derive(Debug)]
pub struct JitRemoval {
    /// Block counts read at the stop before the text was restored.
    pub counts: Vec<BlockCount>,
    /// The splicer's removal report (text pages before and after).
    pub text: RemoveReport,
    /// The reachability check.
    pub reach: Reachability,
}

/// The kernel's stack size (`THREAD_SIZE` on x86-64 without KASAN).
const THREAD_SIZE: u64 = 16 << 10;
/// How often the reachability check looks again while something still points into the cache.
const REACH_CHECKS: u32 = 20;

/// Names of translated functions: the image's symbol at each entry.
fn name_of(image: &KernelImage, slide: u64, addr: u64) -> String {
    image
        .symbols
        .lookup_addr(addr.wrapping_sub(slide))
        .map_or_else(
            || format!("{addr:#x}"),
            |(s, o)| {
                if o == 0 {
                    s.name.clone()
                } else {
                    format!("{}+{o:#x}", s.name)
                }
            },
        )
}

impl LiveJit {
    /// Translates `functions` (names and running-kernel entries) and their direct callees
    /// to `options.depth`, writes the cache and splices every translated entry that takes a
    /// splice. The session must be planned ([`GuestSession::plan`]) and the guest stopped.
    ///
    /// # Errors
    /// No room in the heap, a function with no code, the cache too small for the functions
    /// asked for, guest memory that cannot be written.
    pub fn install(
        session: &mut GuestSession,
        image: &KernelImage,
        functions: &[(String, u64)],
        options: &JitOptions,
    ) -> anyhow::Result<Self> {
        let slide = session.survey.kaslr.slide;
        let started = Instant::now();
        let (machine, splicer) = session.parts()?;
        let total = options
            .code_bytes
            .checked_add(options.counter_bytes)
            .and_then(|t| t.checked_add(options.table_bytes))
            .context("the cache size overflows")?;
        let base = splicer.alloc(total, 0x1000)?;
        let layout = CacheLayout {
            code: base..base + options.code_bytes,
            counters: base + options.code_bytes..base + options.code_bytes + options.counter_bytes,
            table: base + options.code_bytes + options.counter_bytes..base + total,
        };
        let thunks: HashMap<u64, iced_x86::Register> = image
            .symbols
            .iter()
            .filter_map(|s| Some((s.addr.wrapping_add(slide), thunk_register(&s.name)?)))
            .collect();
        let kernel = &splicer.kernel;
        let ctx = kernel.context();
        let facts = &kernel.facts;
        let starts: BTreeSet<u64> = facts.starts.iter().copied().collect();
        let special: BTreeSet<u64> = ["__fentry__", "__x86_return_thunk"]
            .iter()
            .filter_map(|n| image.symbols.get(n))
            .map(|s| s.addr.wrapping_add(slide))
            .collect();
        let translatable = |addr: u64| {
            starts.contains(&addr)
                && !thunks.contains_key(&addr)
                && !special.contains(&addr)
                && !facts.forbidden.iter().any(|r| r.contains(&addr))
                && !facts.self_patched.iter().any(|r| r.contains(&addr))
        };
        // The functions asked for, then their direct callees breadth first.
        let mut order: Vec<u64> = Vec::new();
        let mut seen = BTreeSet::new();
        let mut queue: VecDeque<(u64, u32)> = VecDeque::new();
        let mut refused = Vec::new();
        for (name, addr) in functions {
            if !translatable(*addr) {
                anyhow::bail!(
                    "{name} at {addr:#x} cannot be translated: not a function start in the \
                     instrumentable text (entry and noinstr code, thunks and self-patched \
                     code are not)"
                );
            }
            if seen.insert(*addr) {
                queue.push_back((*addr, 0));
            }
        }
        while let Some((addr, depth)) = queue.pop_front() {
            if order.len() >= options.max_functions {
                break;
            }
            let Some(f) = ctx
                .analysis
                .function_containing(addr)
                .filter(|f| f.cfg.start() == addr)
            else {
                refused.push((
                    name_of(image, slide, addr),
                    "no analysed function starts there".to_owned(),
                ));
                continue;
            };
            order.push(addr);
            if depth >= options.depth {
                continue;
            }
            for insn in f.cfg.insns() {
                let target = match insn.flow {
                    Flow::Call { target }
                    | Flow::TailJump { target }
                    | Flow::CondTailJump { target } => target,
                    _ => continue,
                };
                if translatable(target) && seen.insert(target) {
                    queue.push_back((target, depth + 1));
                }
            }
        }
        let mut translator =
            Translator::new(layout.clone(), &facts.address_keyed)?.with_thunks(thunks);
        let mut names = BTreeMap::new();
        let mut source_bytes = 0;
        for &addr in &order {
            let Some(f) = ctx.analysis.function_containing(addr) else {
                continue;
            };
            let name = name_of(image, slide, addr);
            match translator.translate(ctx.text, f) {
                Ok(()) => {
                    source_bytes += f.cfg.end() - f.cfg.start();
                    names.insert(addr, name);
                }
                Err(e @ TranslateError::Full { .. }) => {
                    refused.push((name, format!("{e:#}")));
                    if functions.iter().any(|(_, a)| *a == addr) {
                        return Err(anyhow::Error::new(e)
                            .context("the code cache cannot take the functions asked for"));
                    }
                }
                Err(e) => {
                    refused.push((name, format!("{e}")));
                    if functions.iter().any(|(_, a)| *a == addr) {
                        return Err(anyhow::Error::new(e));
                    }
                }
            }
        }
        let translation = translator.finish()?;
        let translate_time = started.elapsed();
        // Code over the backend's write path; data (zeroed counters, the table) through the
        // shared RAM when there is one.
        splicer.write_heap(machine, translation.code_at, &translation.code)?;
        let zeros = vec![0u8; usize::try_from(layout.counters.end - layout.counters.start)?];
        match &splicer.shared {
            Some(shared) => {
                shared.write_heap(layout.counters.start, &zeros)?;
                shared.write_heap(translation.table_at, &translation.table)?;
            }
            None => {
                splicer.write_heap(machine, layout.counters.start, &zeros)?;
                splicer.write_heap(machine, translation.table_at, &translation.table)?;
            }
        }
        let requests: Vec<Request> = translation
            .functions
            .values()
            .map(|f| Request {
                name: names.get(&f.start).cloned().unwrap_or_default(),
                addr: f.start,
                action: Action::Enter(f.entry),
            })
            .collect();
        let entries = session.install(&requests)?;
        let entries_installed = session.splicer().map_or(0, |s| s.installed.len());
        tracing::info!(
            "JIT: {} functions ({} bytes of text) translated in {:.1} ms into {} bytes of cache; {} entry splices",
            translation.functions.len(),
            source_bytes,
            translate_time.as_secs_f64() * 1e3,
            translation.code.len(),
            entries_installed
        );
        Ok(Self {
            translation,
            layout,
            names,
            requested: functions.iter().map(|(_, a)| *a).collect(),
            refused,
            translate_time,
            source_bytes,
            entries,
            entries_installed,
        })
    }

    /// Entry splices refused by the planner (their functions are entered only from
    /// translated callers).
    pub fn entries_refused(&self) -> &[NotInstalled] {
        &self.entries.refused
    }

    /// Cache exits by reason.
    pub fn exits(&self) -> BTreeMap<ExitReason, usize> {
        let mut out = BTreeMap::new();
        for e in &self.translation.exits {
            *out.entry(e.reason).or_default() += 1;
        }
        out
    }

    /// Reads every block counter (the guest stopped, or running where the RAM is shared).
    ///
    /// # Errors
    /// When the heap cannot be read.
    pub fn counts(&self, session: &mut GuestSession) -> anyhow::Result<Vec<BlockCount>> {
        let range = &self.translation.counters;
        let len = usize::try_from(range.end - range.start)?;
        let (machine, splicer) = session.parts()?;
        let bytes = match &splicer.shared {
            Some(shared) => shared.read_heap(range.start, len)?,
            None => splicer.read_heap(machine, range.start, len)?,
        };
        Ok(self
            .translation
            .blocks
            .iter()
            .zip(self.translation.counts(&bytes))
            .map(|(b, (leader, count))| BlockCount {
                function: self.names.get(&b.function).cloned().unwrap_or_default(),
                function_addr: b.function,
                leader,
                count,
                requested: self.requested.contains(&b.function),
            })
            .collect())
    }

    /// Reads the counters, takes the entry splices out (text byte-identical), zeroes the
    /// lookup table and checks that nothing points into the cache any more (see the module
    /// documentation). Leaves the guest stopped.
    ///
    /// # Errors
    /// When the guest cannot be stopped, read or written, or the task list cannot be read.
    pub fn remove(
        self,
        session: &mut GuestSession,
        image: &KernelImage,
    ) -> anyhow::Result<JitRemoval> {
        session.pause()?;
        let counts = self.counts(session)?;
        let text = session.remove()?;
        let zeros = vec![0u8; self.translation.table.len()];
        {
            let (machine, splicer) = session.parts()?;
            match &splicer.shared {
                Some(shared) => shared.write_heap(self.translation.table_at, &zeros)?,
                None => splicer.write_heap(machine, self.translation.table_at, &zeros)?,
            }
        }
        let code = self.layout.code.start..self.translation.code_at + self.translation.code.len() as u64;
        let btf = Btf::from_elf(image.vmlinux.bytes()).context("the kernel image has no BTF")?;
        let tasks = TaskLayout::from_btf(&btf)?;
        let stack = btf
            .struct_member("task_struct", "stack")
            .ok()
            .and_then(|m| m.byte_offset())
            .context("BTF has no task_struct.stack")?;
        let mut reach = Reachability::default();
        for check in 1..=REACH_CHECKS {
            reach = check_reachability(session, &code, &tasks, stack)?;
            reach.checks = check;
            if reach.unreachable() {
                break;
            }
            tracing::info!(
                "the code cache is still reachable ({} words); letting the guest run 100 ms",
                reach.found.len()
            );
            session.resume()?;
            std::thread::sleep(Duration::from_millis(100));
            session.pause()?;
        }
        Ok(JitRemoval {
            counts,
            text,
            reach,
        })
    }
}

/// One look, with the guest stopped, for RIPs and stack words inside `code`.
fn check_reachability(
    session: &mut GuestSession,
    code: &Range<u64>,
    tasks: &TaskLayout,
    stack_offset: u64,
) -> anyhow::Result<Reachability> {
    let survey = session.survey.clone();
    let machine: &mut dyn Machine = &mut *session.machine;
    let mut reach = Reachability::default();
    let scan = |machine: &mut dyn Machine,
                    reach: &mut Reachability,
                    what: &str,
                    from: u64,
                    to: u64| {
        let from = from & !7;
        if to <= from || to - from > THREAD_SIZE {
            return;
        }
        let mut buf = vec![0u8; (to - from) as usize];
        let mut mem = BackendMemory(machine);
        if survey.space(&mut mem).read(from, &mut buf).is_err() {
            return;
        }
        reach.scanned_bytes += to - from;
        for (i, w) in buf.chunks_exact(8).enumerate() {
            let v = u64::from_le_bytes(w.try_into().unwrap_or_default());
            if code.contains(&v) {
                reach
                    .found
                    .push((format!("{what} stack at {:#x}", from + 8 * i as u64), v));
            }
        }
    };
    let vcpus = machine.vcpus()?;
    for vcpu in vcpus {
        let regs = attach::x86_registers(machine, vcpu)?;
        let VcpuId(n) = vcpu;
        if code.contains(&regs.rip) {
            reach.found.push((format!("vCPU {n} RIP"), regs.rip));
        }
        if regs.in_kernel() {
            let rsp = regs.gpr[7];
            let top = (rsp | (THREAD_SIZE - 1)).wrapping_add(1);
            scan(machine, &mut reach, &format!("vCPU {n}"), rsp, top);
        }
    }
    let mut mem = BackendMemory(&mut *machine);
    let list = list_tasks(
        &mut survey.space(&mut mem),
        survey.layout.init_task,
        tasks,
    )?;
    reach.tasks = list.len();
    for task in list {
        if task.on_cpu {
            continue; // its stack is a vCPU's, scanned above
        }
        let mut mem = BackendMemory(&mut *machine);
        let base = survey.space(&mut mem).read_u64(task.task + stack_offset);
        let Ok(base) = base else { continue };
        let top = base.wrapping_add(THREAD_SIZE);
        if task.thread_sp >= base && task.thread_sp < top {
            scan(
                machine,
                &mut reach,
                &format!("task {} ({})", task.pid, task.comm),
                task.thread_sp,
                top,
            );
        }
    }
    Ok(reach)
}
