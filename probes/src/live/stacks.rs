//! Kernel stacks of a live guest, unwound from outside it with the image's ORC tables
//! (`exotap_introspect::orc`): a stopped vCPU's stack from its registers, a sleeping task's
//! from `task->thread.sp`, and the guest's task list to find the tasks. Frames are named as
//! the kernel's `%pB` names them (`func+0xoff/0xsize`).
//!
//! Everything read from the guest is untrusted: a bad pointer ends a list or an unwind with
//! an error, never a panic, and every list walk is bounded.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use exotap_introspect::btf::Btf;
use exotap_introspect::layout::TASK_COMM_LEN;
use exotap_introspect::memory::PhysicalMemory;
use exotap_introspect::orc::{
    undescribed_sites, AltInstrLayout, AltSite, Backtrace, Frame, InactiveTaskFrame, OrcTable,
    PatchedRules, PtRegs, StackEnd, StackMemory, StackSnapshot, UnwindStart, Unwinder, THUNK_ENTRY,
};
use exotap_introspect::paging::{AddressSpace, PagingError};
use exotap_introspect::symbols::SymbolTable;
use exotap_vmm::control::X86Registers;

use super::kernel_image::KernelImage;
use super::modules::{read_modules, GuestModule, ModuleLayout, VirtualMemory};

/// Most tasks a walk of the task list visits before it gives up (a corrupt or cyclic list).
pub const MAX_TASKS: usize = 1 << 16;

/// Where the members the unwinder needs sit inside `task_struct`, from BTF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskLayout {
    /// `tasks` (the list of thread-group leaders, from `init_task`).
    pub tasks: u64,
    /// `thread_group` (the other threads of a group), when the kernel has it.
    pub thread_group: Option<u64>,
    /// `pid` (the thread id).
    pub pid: u64,
    /// `tgid`.
    pub tgid: u64,
    /// `comm`.
    pub comm: u64,
    /// `__state` (or `state` before 5.14).
    pub state: u64,
    /// `on_cpu`.
    pub on_cpu: Option<u64>,
    /// `thread.sp`: the saved stack pointer of a task that is not running.
    pub thread_sp: u64,
}

impl TaskLayout {
    /// Reads the offsets from the image's BTF, and checks that `struct
    /// inactive_task_frame` is laid out as [`InactiveTaskFrame`] reads it.
    ///
    /// # Errors
    /// A member missing from BTF, or a switch frame laid out otherwise.
    pub fn from_btf(btf: &Btf) -> anyhow::Result<Self> {
        let offset = |path: &str| -> Option<u64> {
            btf.struct_member("task_struct", path)
                .ok()
                .and_then(|m| m.byte_offset())
        };
        let need = |path: &str| {
            offset(path).with_context(|| format!("BTF has no byte offset for task_struct.{path}"))
        };
        let layout = Self {
            tasks: need("tasks")?,
            thread_group: offset("thread_group"),
            pid: need("pid")?,
            tgid: need("tgid")?,
            comm: need("comm")?,
            state: offset("__state").map_or_else(|| need("state"), Ok)?,
            on_cpu: offset("on_cpu"),
            thread_sp: need("thread.sp")?,
        };
        check_switch_frame(btf)?;
        Ok(layout)
    }
}

/// Checks BTF's `struct inactive_task_frame` against [`InactiveTaskFrame`]: the unwinder
/// reads the saved `bp` and `ret_addr` at fixed places, so another layout must be refused
/// rather than misread.
fn check_switch_frame(btf: &Btf) -> anyhow::Result<()> {
    let id = btf
        .struct_by_name("inactive_task_frame")
        .context("BTF has no struct inactive_task_frame")?;
    let size = btf.size_of(id);
    let at = |member: &str| btf.member(id, member).ok().and_then(|m| m.byte_offset());
    let found = (size, at("bp"), at("ret_addr"));
    let expected = (Some(InactiveTaskFrame::SIZE), Some(5 * 8), Some(6 * 8));
    if found != expected {
        bail!(
            "struct inactive_task_frame is laid out as (size, bp, ret_addr) = {found:?}, not \
             {expected:?}: this kernel saves its switch frame differently"
        );
    }
    Ok(())
}

/// A task as its `task_struct` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestTask {
    /// Address of the `task_struct`.
    pub task: u64,
    /// Thread id.
    pub pid: i32,
    /// Thread-group id.
    pub tgid: i32,
    /// Command name.
    pub comm: String,
    /// `__state` (0 running or runnable, 1 interruptible, 2 uninterruptible, ...).
    pub state: u32,
    /// `on_cpu`: the task is running on a CPU (its saved stack pointer is stale).
    pub on_cpu: bool,
    /// `thread.sp`.
    pub thread_sp: u64,
}

impl GuestTask {
    /// The state letter `ps` and `/proc/PID/stat` show for the common states.
    pub fn state_letter(&self) -> char {
        match self.state {
            0 => 'R',
            s if s & 0x402 == 0x402 => 'I',
            s if s & 1 != 0 => 'S',
            s if s & 2 != 0 => 'D',
            s if s & 4 != 0 => 'T',
            s if s & 8 != 0 => 't',
            _ => '?',
        }
    }
}

/// Reads one task.
///
/// # Errors
/// When its memory cannot be read.
pub fn read_guest_task<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    task: u64,
    layout: &TaskLayout,
) -> Result<GuestTask, PagingError> {
    let at = |offset: u64| task.wrapping_add(offset);
    let pid = space.read_u32(at(layout.pid))?;
    let tgid = space.read_u32(at(layout.tgid))?;
    let mut comm = [0u8; TASK_COMM_LEN];
    space.read(at(layout.comm), &mut comm)?;
    let comm = comm.split(|b| *b == 0).next().unwrap_or(&comm);
    let state = space.read_u32(at(layout.state))?;
    let on_cpu = match layout.on_cpu {
        Some(offset) => space.read_u32(at(offset))? != 0,
        None => false,
    };
    Ok(GuestTask {
        task,
        pid: pid as i32,
        tgid: tgid as i32,
        comm: String::from_utf8_lossy(comm).into_owned(),
        state,
        on_cpu,
        thread_sp: space.read_u64(at(layout.thread_sp))?,
    })
}

/// Every task: `init_task`, the thread-group leaders on its `tasks` list, and each leader's
/// other threads. A list that does not come back to its head within [`MAX_TASKS`] steps,
/// or that points at an unreadable task, is an error.
///
/// # Errors
/// As said.
pub fn list_tasks<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    init_task: u64,
    layout: &TaskLayout,
) -> anyhow::Result<Vec<GuestTask>> {
    let leaders = walk_list(space, init_task, layout.tasks)
        .context("cannot walk the task list from init_task")?;
    let mut seen = BTreeSet::new();
    let mut tasks = Vec::new();
    for leader in leaders {
        let mut group = vec![leader];
        if let Some(offset) = layout.thread_group {
            group.extend(
                walk_list(space, leader, offset)
                    .with_context(|| format!("cannot walk the threads of task {leader:#x}"))?
                    .into_iter()
                    .skip(1),
            );
        }
        for task in group {
            if !seen.insert(task) {
                continue;
            }
            if tasks.len() >= MAX_TASKS {
                bail!("more than {MAX_TASKS} tasks: the task list looks corrupt");
            }
            let info = read_guest_task(space, task, layout)
                .with_context(|| format!("cannot read the task_struct at {task:#x}"))?;
            tasks.push(info);
        }
    }
    Ok(tasks)
}

/// The structures on a circular `list_head` at `offset` in each, starting with `first`
/// (whose list head is the list's head).
fn walk_list<M: PhysicalMemory + ?Sized>(
    space: &mut AddressSpace<'_, M>,
    first: u64,
    offset: u64,
) -> anyhow::Result<Vec<u64>> {
    let head = first.wrapping_add(offset);
    let mut items = vec![first];
    let mut node = space.read_u64(head)?;
    while node != head {
        if items.len() > MAX_TASKS {
            bail!("the list at {head:#x} does not come back to its head");
        }
        items.push(node.wrapping_sub(offset));
        node = space
            .read_u64(node)
            .with_context(|| format!("cannot follow the list node at {node:#x}"))?;
    }
    Ok(items)
}

/// Guest-virtual memory read a line at a time and kept for one stop, with each page's
/// translation: an unwind reads many words of few lines, and each backend read is a round
/// trip (a page-table walk is four more).
pub struct PageCache<'s, 'm, M: PhysicalMemory + ?Sized> {
    space: &'s mut AddressSpace<'m, M>,
    /// Virtual page → physical page (`None`: not mapped).
    pages: HashMap<u64, Option<u64>>,
    /// Virtual line → its bytes (`None`: unreadable).
    lines: HashMap<u64, Option<[u8; LINE]>>,
}

impl<M: PhysicalMemory + ?Sized> std::fmt::Debug for PageCache<'_, '_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageCache")
            .field("pages", &self.pages.len())
            .finish_non_exhaustive()
    }
}

const PAGE: u64 = 4096;
/// Bytes read at once: a few stack frames, or the head of a `task_struct`.
const LINE: usize = 256;

impl<'s, 'm, M: PhysicalMemory + ?Sized> PageCache<'s, 'm, M> {
    /// An empty cache over `space`; drop it when the guest resumes.
    pub fn new(space: &'s mut AddressSpace<'m, M>) -> Self {
        Self {
            space,
            pages: HashMap::new(),
            lines: HashMap::new(),
        }
    }

    /// The line at `line` (aligned), or `None` when it cannot be read.
    fn line(&mut self, line: u64) -> Option<&[u8; LINE]> {
        if !self.lines.contains_key(&line) {
            let page = line & !(PAGE - 1);
            let space = &mut *self.space;
            let phys_page = *self
                .pages
                .entry(page)
                .or_insert_with(|| space.translate(page).ok().map(|t| t.phys & !(PAGE - 1)));
            let bytes = phys_page.and_then(|phys| {
                let mut bytes = [0u8; LINE];
                let at = phys.checked_add(line - page)?;
                space.mem.read_phys(at, &mut bytes).ok().map(|()| bytes)
            });
            self.lines.insert(line, bytes);
        }
        self.lines.get(&line).and_then(Option::as_ref)
    }
}

/// Reads past the cache (the module list is read once per refresh).
impl<M: PhysicalMemory + ?Sized> VirtualMemory for PageCache<'_, '_, M> {
    fn read_virt(&mut self, va: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        Ok(self.space.read(va, buf)?)
    }
}

impl<M: PhysicalMemory + ?Sized> StackMemory for PageCache<'_, '_, M> {
    type Error = PagingError;

    fn read_u64(&mut self, vaddr: u64) -> Result<u64, PagingError> {
        let line = vaddr & !(LINE as u64 - 1);
        let offset = (vaddr - line) as usize;
        if offset + 8 > LINE {
            // A word across two lines (never on an aligned stack): read it directly.
            return self.space.read_u64(vaddr);
        }
        match self.line(line) {
            Some(bytes) => {
                let mut word = [0u8; 8];
                word.copy_from_slice(&bytes[offset..offset + 8]);
                Ok(u64::from_le_bytes(word))
            }
            // Read again for the error (a line that failed is not cached as bytes).
            None => self.space.read_u64(vaddr),
        }
    }
}

/// The kernel registers of a stopped vCPU as the unwinder's starting `pt_regs`.
pub fn pt_regs_of(regs: &X86Registers) -> PtRegs {
    let g = &regs.gpr;
    PtRegs {
        ax: g[0],
        bx: g[1],
        cx: g[2],
        dx: g[3],
        si: g[4],
        di: g[5],
        bp: g[6],
        sp: g[7],
        r8: g[8],
        r9: g[9],
        r10: g[10],
        r11: g[11],
        r12: g[12],
        r13: g[13],
        r14: g[14],
        r15: g[15],
        orig_ax: u64::MAX,
        ip: regs.rip,
        cs: u64::from(regs.segments[0]),
        flags: regs.rflags,
        ss: u64::from(regs.segments[1]),
    }
}

/// The image's ORC tables and symbols, the loaded modules' (read from the guest), and what
/// the kernel itself leaves out of `/proc/PID/stack`.
pub struct KernelStacks {
    orc: OrcTable,
    slide: u64,
    /// Where the guest's module list is and how `struct module` is laid out; `None` when
    /// the image's BTF or symbols lack it (frames in module text then end an unwind).
    module_list: Option<(u64, ModuleLayout)>,
    /// The modules as last read ([`KernelStacks::refresh_modules`]).
    modules: Arc<Vec<GuestModule>>,
    /// The same list for the namers handed out ([`KernelStacks::symbol_lookup`]), which
    /// outlive a borrow of this and must see modules read after they were made.
    published: Arc<Mutex<Arc<Vec<GuestModule>>>>,
    /// The list head's `next` and `prev` when the list was last read: a module loaded
    /// since is added at the head, and changes them.
    list_ends: Option<[u64; 2]>,
    /// When the module list was last read.
    modules_read: Option<std::time::Instant>,
    /// Text symbols at running addresses.
    symbols: SymbolTable,
    /// `__sched_text_start..__sched_text_end` and `__lock_text_start..__lock_text_end`,
    /// running addresses: `stack_trace_save_tsk` skips these (`in_sched_functions`).
    scheduler: Vec<Range<u64>>,
    ret_from_fork: Option<u64>,
    /// The image's alternatives sites whose variants its table does not all describe.
    alt_sites: Vec<AltSite>,
    /// The retpoline thunks (`__x86_indirect_thunk_*`), whose table rules say nothing.
    thunks: Vec<AltSite>,
    /// Their rules from the running text, once read ([`KernelStacks::refresh_modules`]).
    patched: Option<PatchedRules>,
}

impl std::fmt::Debug for KernelStacks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelStacks")
            .field("orc_entries", &self.orc.len())
            .field("slide", &format_args!("{:#x}", self.slide))
            .field("modules", &self.modules.len())
            .finish_non_exhaustive()
    }
}

impl KernelStacks {
    /// Reads the ORC tables of the image's vmlinux; `slide` is the guest's KASLR slide. No
    /// module is known until [`KernelStacks::refresh_modules`] reads the guest's list.
    ///
    /// # Errors
    /// When the image has no (or an unknown kind of) ORC table.
    pub fn load(image: &KernelImage, slide: u64) -> anyhow::Result<Self> {
        Self::load_with(image, slide, None)
    }

    /// [`KernelStacks::load`] with the image's BTF when the caller has parsed it already
    /// (`struct module`'s layout comes from it; `None`: parsed here).
    ///
    /// # Errors
    /// As [`KernelStacks::load`].
    pub fn load_with(image: &KernelImage, slide: u64, btf: Option<&Btf>) -> anyhow::Result<Self> {
        let orc = OrcTable::from_vmlinux(&image.vmlinux)
            .context("cannot read the ORC unwind tables of the kernel image")?;
        let module_list = (|| {
            let head = image
                .symbols
                .get("modules")
                .context("the image's symbols have no `modules` list")?
                .addr
                .wrapping_add(slide);
            let layout = match btf {
                Some(btf) => ModuleLayout::from_btf(btf)?,
                None => ModuleLayout::from_btf(image.btf()?)?,
            };
            anyhow::Ok((head, layout))
        })();
        let module_list = match module_list {
            Ok(found) => Some(found),
            Err(err) => {
                tracing::warn!("frames in module text will end stacks: {err:#}");
                None
            }
        };
        let symbols = text_symbols(image, slide);
        let range = |start: &str, end: &str| {
            let a = image.symbols.get(start)?.addr.wrapping_add(slide);
            let b = image.symbols.get(end)?.addr.wrapping_add(slide);
            (a < b).then_some(a..b)
        };
        let scheduler = [
            range("__sched_text_start", "__sched_text_end"),
            range("__lock_text_start", "__lock_text_end"),
        ]
        .into_iter()
        .flatten()
        .collect();
        // Where a new task's first `__switch_to` returns: the assembly `ret_from_fork_asm`
        // where the kernel has one (it calls the C `ret_from_fork`), else `ret_from_fork`.
        let ret_from_fork = ["ret_from_fork_asm", "ret_from_fork"]
            .into_iter()
            .find_map(|name| image.symbols.get(name))
            .map(|s| s.addr.wrapping_add(slide));
        let alt_sites = match btf.map_or_else(|| image.btf(), Ok) {
            Ok(btf) => AltInstrLayout::from_btf(btf)
                .and_then(|layout| undescribed_sites(&image.vmlinux, &layout, &orc))
                .map_err(anyhow::Error::from),
            Err(err) => Err(err),
        };
        let alt_sites = alt_sites.unwrap_or_else(|err| {
            tracing::warn!(
                "frames in code the kernel patched at boot may unwind wrong: \
                 the image's alternatives are not readable: {err:#}"
            );
            Vec::new()
        });
        Ok(Self {
            orc,
            slide,
            module_list,
            modules: Arc::default(),
            published: Arc::default(),
            list_ends: None,
            modules_read: None,
            symbols,
            scheduler,
            ret_from_fork,
            alt_sites,
            thunks: retpoline_thunks(&image.symbols),
            patched: None,
        })
    }

    /// [`KernelStacks::load_with`] for a session's guest, whose module list is read at once
    /// (the guest stopped).
    ///
    /// # Errors
    /// As [`KernelStacks::load`].
    pub fn load_for(
        image: &KernelImage,
        guest: &mut super::session::GuestSession,
        btf: Option<&Btf>,
    ) -> anyhow::Result<Self> {
        let mut stacks = Self::load_with(image, guest.survey.kaslr.slide, btf)?;
        let mut mem = super::guest_memory::BackendMemory(&mut *guest.machine);
        stacks.refresh_modules(&mut guest.survey.space(&mut mem));
        Ok(stacks)
    }

    /// An unwinder over the image's table at this slide, the known modules' tables, and the
    /// rules of code the kernel patched at boot, once read; `ret_from_fork` a return address
    /// looked up as is ([`Unwinder::with_entry_return`]).
    pub fn unwinder(&self) -> Unwinder<'_> {
        let unwinder = self
            .modules
            .iter()
            .filter_map(|m| m.orc.as_ref())
            .fold(Unwinder::new(&self.orc, self.slide), |unwinder, table| {
                unwinder.with_table(table, 0)
            });
        let unwinder = match self.ret_from_fork {
            Some(addr) => unwinder.with_entry_return(addr),
            None => unwinder,
        };
        match &self.patched {
            Some(patched) => unwinder.with_patched(patched),
            None => unwinder,
        }
    }

    /// Reads the running text of the image's alternatives sites whose variants its table does
    /// not all describe, and of the retpoline thunks, and derives their rules
    /// ([`PatchedRules`]). Once per guest: the kernel patches them at boot.
    fn read_patched_text<R: VirtualMemory + ?Sized>(&mut self, mem: &mut R) {
        if self.patched.is_some() {
            return;
        }
        let orc = &self.orc;
        let mut patched = PatchedRules::derive(
            &self.alt_sites,
            self.slide,
            |addr| orc.lookup(addr).map(|(_, entry)| entry),
            |at, buf| mem.read_virt(at, buf).is_ok(),
        );
        let alternatives = patched.len();
        patched.extend(PatchedRules::derive(
            &self.thunks,
            self.slide,
            |_| Some(THUNK_ENTRY),
            |at, buf| mem.read_virt(at, buf).is_ok(),
        ));
        tracing::debug!(
            sites = self.alt_sites.len(),
            alternatives,
            thunks = patched.len() - alternatives,
            "ORC rules from the running text of alternatives sites and retpoline thunks"
        );
        self.patched = Some(patched);
    }

    /// Reads the guest's module list again (the guest stopped): the modules' text, ORC
    /// tables and symbols, and the first time, the running text of the kernel's patched
    /// alternatives sites ([`PatchedRules`]). A list that cannot be read keeps the modules
    /// known before, with a warning; a module whose tables cannot be read is kept without
    /// them, with a warning.
    pub fn refresh_modules<R: VirtualMemory + ?Sized>(&mut self, mem: &mut R) {
        self.read_patched_text(mem);
        let Some((head, layout)) = self.module_list else {
            return;
        };
        self.modules_read = Some(std::time::Instant::now());
        self.list_ends = list_ends(mem, head);
        match read_modules(mem, head, &layout, self.orc.layout()) {
            Ok(modules) => {
                for m in modules.iter().filter(|m| m.problem.is_some()) {
                    tracing::warn!(module = %m.name, "{}", m.problem.as_deref().unwrap_or_default());
                }
                tracing::debug!(modules = modules.len(), "read the guest's module list");
                self.modules = Arc::new(modules);
                if let Ok(mut published) = self.published.lock() {
                    *published = Arc::clone(&self.modules);
                }
            }
            Err(err) => tracing::warn!("cannot read the guest's module list: {err:#}"),
        }
    }

    /// [`KernelStacks::refresh_modules`] when the list's ends moved since it was last read
    /// (one 16-byte read otherwise): for a host-evaluated probe's stop, where the script
    /// names kernel code.
    pub fn refresh_modules_if_changed<R: VirtualMemory + ?Sized>(&mut self, mem: &mut R) {
        let Some((head, _)) = self.module_list else {
            return;
        };
        let ends = list_ends(mem, head);
        if ends.is_some() && ends != self.list_ends {
            self.refresh_modules(mem);
        }
    }

    /// Whether `backtrace` ended at a pc in the module area that no known module's text
    /// holds (a module loaded since the list was read), and the list was last read more
    /// than a second ago (BPF programs and trampolines live there too, and must not cost a
    /// read of the list at every stop).
    fn ended_in_unknown_module(&self, backtrace: &Backtrace) -> bool {
        let StackEnd::Error(exotap_introspect::orc::UnwindError::NoEntry { pc }) = backtrace.end
        else {
            return false;
        };
        self.module_list.is_some()
            && MODULE_AREA.contains(&pc)
            && !self.modules.iter().any(|m| m.text.contains(&pc))
            && self
                .modules_read
                .is_none_or(|at| at.elapsed() >= std::time::Duration::from_secs(1))
    }

    /// `unwind(self, mem)`, and when it ends in a module the host does not know yet, the
    /// module list read again and the unwind made again.
    pub fn unwind_knowing_modules<S: StackMemory + VirtualMemory + ?Sized>(
        &mut self,
        mem: &mut S,
        unwind: impl Fn(&Self, &mut S) -> Backtrace,
    ) -> Backtrace {
        let backtrace = unwind(self, mem);
        if !self.ended_in_unknown_module(&backtrace) {
            return backtrace;
        }
        self.refresh_modules(mem);
        unwind(self, mem)
    }

    /// Unwinds a stopped vCPU's stack from its registers (no frames when it runs user code).
    pub fn unwind_vcpu<S: StackMemory + ?Sized>(
        &self,
        regs: &X86Registers,
        mem: &mut S,
    ) -> Backtrace {
        let start = UnwindStart::from_regs(pt_regs_of(regs));
        self.unwinder().unwind(&start, mem)
    }

    /// Unwinds a task that is not running, from its saved `thread.sp`.
    pub fn unwind_task<S: StackMemory + ?Sized>(&self, thread_sp: u64, mem: &mut S) -> Backtrace {
        match UnwindStart::from_inactive_task(mem, thread_sp, self.ret_from_fork) {
            Ok(start) => self.unwinder().unwind(&start, mem),
            Err(err) => Backtrace {
                frames: Vec::new(),
                end: exotap_introspect::orc::StackEnd::Error(err),
            },
        }
    }

    /// The address a frame is named by: a return address belongs to its call, one byte back.
    fn lookup_pc(frame: &Frame) -> u64 {
        frame.pc.wrapping_sub(u64::from(!frame.signal))
    }

    /// The name of the function a frame is in: the kernel's symbol, or a module's with
    /// ` [module]` after it.
    pub fn function_name(&self, frame: &Frame) -> Option<String> {
        let named = name_address(&self.symbols, &self.modules, Self::lookup_pc(frame))?;
        Some(match named.module {
            Some(module) => format!("{} [{module}]", named.name),
            None => named.name,
        })
    }

    /// The frame as the kernel's `%pB` prints it: `func+0xoff/0xsize`, the offset of a
    /// return address as is (looked up one byte back, printed plus one), ` [module]` after
    /// it in a module's text; the bare address when no symbol covers it.
    pub fn describe(&self, frame: &Frame) -> String {
        let back = u64::from(!frame.signal);
        match name_address(&self.symbols, &self.modules, Self::lookup_pc(frame)) {
            Some(named) => {
                let offset = named.offset.wrapping_add(back);
                named.with_offset(offset).to_string()
            }
            None => format!("{:#x}", frame.pc),
        }
    }

    /// `addr` named by the kernel's text symbols or a known module's.
    pub fn name_address(&self, addr: u64) -> Option<crate::lang::eval::NamedAddress> {
        name_address(&self.symbols, &self.modules, addr)
    }

    /// A pc as a backtrace string holds it, named `func+0xoff/0xsize` (` [module]` after it
    /// in a module's text; looked up as is: the string does not say which pcs are return
    /// addresses); `None` outside every symbol.
    pub fn name_pc(&self, pc: u64) -> Option<String> {
        name_address(&self.symbols, &self.modules, pc).map(|named| named.to_string())
    }

    /// A namer of pcs as [`KernelStacks::name_pc`], owning a copy of the symbols and
    /// sharing the module list, refreshed or not (for a script session's `end` probes,
    /// which run without a hit).
    pub fn symbol_lookup(&self) -> crate::lang::eval::KernelSymbols {
        let symbols = self.symbols.clone();
        let published = Arc::clone(&self.published);
        Box::new(move |pc| {
            let modules = published.lock().map(|m| Arc::clone(&m)).unwrap_or_default();
            name_address(&symbols, &modules, pc)
        })
    }

    /// Whether the kernel leaves this frame out of `/proc/PID/stack` and other saved
    /// traces: scheduler and lock functions (`in_sched_functions`).
    pub fn is_scheduler(&self, frame: &Frame) -> bool {
        let pc = frame.pc;
        self.scheduler.iter().any(|r| r.contains(&pc))
    }
}

/// Names kernel addresses with `symbols` (running addresses): the symbol covering one, the
/// offset into it and its size, for a script session ([`crate::lang::eval::KernelSymbols`]).
pub fn symbol_lookup(symbols: SymbolTable) -> crate::lang::eval::KernelSymbols {
    Box::new(move |pc| name_address(&symbols, &[], pc))
}

/// The `next` and `prev` of the list head at `head`; `None` when unreadable.
fn list_ends<R: VirtualMemory + ?Sized>(mem: &mut R, head: u64) -> Option<[u64; 2]> {
    let mut bytes = [0u8; 16];
    mem.read_virt(head, &mut bytes).ok()?;
    let word = |r: std::ops::Range<usize>| bytes.get(r)?.try_into().ok().map(u64::from_le_bytes);
    Some([word(0..8)?, word(8..16)?])
}

/// Where the kernel loads modules (and BPF programs) on x86-64: `MODULES_VADDR` (the kernel
/// image's 1 GiB above `__START_KERNEL_map`) to `MODULES_END`.
const MODULE_AREA: Range<u64> = 0xffff_ffff_a000_0000..0xffff_ffff_ff00_0000;

/// `addr` named by the kernel's text symbols, or else by the module whose text holds it.
fn name_address(
    symbols: &SymbolTable,
    modules: &[GuestModule],
    addr: u64,
) -> Option<crate::lang::eval::NamedAddress> {
    use crate::lang::eval::NamedAddress;
    if let Some((sym, offset)) = symbols.kernel_lookup(addr) {
        return Some(NamedAddress {
            name: sym.name.clone(),
            offset,
            size: sym.size,
            module: None,
        });
    }
    modules.iter().find_map(|m| {
        let (name, offset, size) = m.lookup(addr)?;
        Some(NamedAddress {
            name: name.to_owned(),
            offset,
            size,
            module: Some(m.name.clone()),
        })
    })
}

/// The retpoline thunks of the image (`__x86_indirect_thunk_rax`, ... and 6.12's
/// `__x86_indirect_jump_thunk_*`), link-time addresses, each up to the next symbol (at most
/// 64 bytes: the kernel aligns them to 32).
fn retpoline_thunks(symbols: &SymbolTable) -> Vec<AltSite> {
    let mut starts: Vec<u64> = symbols.iter().map(|s| s.addr).collect();
    starts.sort_unstable();
    starts.dedup();
    let mut thunks: Vec<AltSite> = symbols
        .iter()
        .filter(|s| {
            s.name.starts_with("__x86_indirect_")
                && s.name.contains("thunk_")
                && !s.name.ends_with("_array")
        })
        .filter_map(|s| {
            let next = starts.get(starts.partition_point(|&a| a <= s.addr))?;
            let len = u8::try_from((next - s.addr).min(64)).ok()?;
            Some(AltSite { addr: s.addr, len })
        })
        .collect();
    thunks.sort_by_key(|t| t.addr);
    thunks.dedup_by_key(|t| t.addr);
    thunks
}

/// The image's text symbols at their running addresses (`slide` applied), as
/// [`KernelStacks`] keeps them.
pub fn text_symbols(image: &KernelImage, slide: u64) -> SymbolTable {
    image.symbols.text_only().slid(slide)
}

/// The kernel registers a compiled probe's snapshot holds, as the unwinder's starting
/// `pt_regs`: the site's saved registers, the probed code's stack pointer and the probe
/// point's address as the exact pc (kernel code and stack segments: the probe ran in the
/// kernel).
pub fn pt_regs_of_snapshot(snap: &crate::compile::snapshot::Snapshot<'_>) -> PtRegs {
    // The site's push order (compile::codegen::SAVED): rax rcx rdx rbx rsi rdi rbp r8-r15.
    let r = |i| snap.saved(i);
    PtRegs {
        ax: r(0),
        cx: r(1),
        dx: r(2),
        bx: r(3),
        si: r(4),
        di: r(5),
        bp: r(6),
        r8: r(7),
        r9: r(8),
        r10: r(9),
        r11: r(10),
        r12: r(11),
        r13: r(12),
        r14: r(13),
        r15: r(14),
        orig_ax: u64::MAX,
        ip: snap.pc,
        cs: KERNEL_CS,
        flags: r(15),
        sp: snap.sp,
        ss: KERNEL_DS,
    }
}

/// `__KERNEL_CS` and `__KERNEL_DS` on x86-64.
const KERNEL_CS: u64 = 0x10;
const KERNEL_DS: u64 = 0x18;

/// Unwinds a compiled probe's stack snapshot from its registers, reading only the bytes it
/// holds; says whether the unwind stopped at a word past them (the frames from there on are
/// cut: a deeper stack, or a switch to a stack the snapshot does not hold).
pub fn unwind_snapshot(
    unwinder: &Unwinder<'_>,
    snap: &crate::compile::snapshot::Snapshot<'_>,
) -> (Backtrace, bool) {
    let start = UnwindStart::from_regs(pt_regs_of_snapshot(snap));
    let mut mem = StackSnapshot::new(snap.sp, snap.stack.to_vec());
    let backtrace = unwinder.unwind(&start, &mut mem);
    // Every word of the snapshot reads, so a failed read is one past it.
    let cut = matches!(
        backtrace.end,
        StackEnd::Error(exotap_introspect::orc::UnwindError::StackRead { .. })
    );
    (backtrace, cut)
}

/// [`unwind_snapshot`] with the image's tables, each frame named as [`probe_backtrace`]
/// names a stopped vCPU's.
pub fn snapshot_backtrace(
    stacks: &KernelStacks,
    snap: &crate::compile::snapshot::Snapshot<'_>,
) -> crate::compile::snapshot::Unwound {
    let (backtrace, cut) = unwind_snapshot(&stacks.unwinder(), snap);
    crate::compile::snapshot::Unwound {
        frames: backtrace
            .frames
            .iter()
            .map(|frame| (frame.pc, stacks.describe(frame)))
            .collect(),
        cut,
    }
}

/// The kernel stack of a vCPU stopped at a probe hit, each frame's pc and `%pB` name, as
/// the script built-ins (`backtrace()`, `print_backtrace()`) want it. An unwind that stops
/// early gives the frames found so far.
pub fn probe_backtrace<M: exotap_vmm::control::Machine + ?Sized>(
    stacks: &KernelStacks,
    machine: &mut M,
    survey: &super::attach::Survey,
    regs: &X86Registers,
) -> Vec<(u64, String)> {
    let mut mem = super::guest_memory::BackendMemory(machine);
    let mut space = survey.space(&mut mem);
    let mut cache = PageCache::new(&mut space);
    let backtrace = stacks.unwind_vcpu(regs, &mut cache);
    backtrace
        .frames
        .iter()
        .map(|frame| (frame.pc, stacks.describe(frame)))
        .collect()
}

/// The saved kernel stack of a task that is not running (from `task->thread.sp`), as the
/// kernel's own saved traces (`/proc/PID/stack`) show it: without the scheduler and lock
/// frames. Each frame's pc and `%pB` name; an unwind that stops early gives the frames found
/// so far, an unreadable task none.
pub fn saved_task_backtrace<M: exotap_vmm::control::Machine + ?Sized>(
    stacks: &KernelStacks,
    machine: &mut M,
    survey: &super::attach::Survey,
    layout: &TaskLayout,
    task: u64,
) -> Vec<(u64, String)> {
    let mut mem = super::guest_memory::BackendMemory(machine);
    let mut space = survey.space(&mut mem);
    let mut cache = PageCache::new(&mut space);
    let Ok(sp) = cache.read_u64(task.wrapping_add(layout.thread_sp)) else {
        return Vec::new();
    };
    stacks
        .unwind_task(sp, &mut cache)
        .frames
        .iter()
        .filter(|frame| !stacks.is_scheduler(frame))
        .map(|frame| (frame.pc, stacks.describe(frame)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use exotap_introspect::memory::{MemoryError, SparseMemory};

    /// Guest memory that counts the backend reads.
    struct Counting {
        mem: SparseMemory,
        reads: usize,
    }

    impl PhysicalMemory for Counting {
        fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), MemoryError> {
            self.reads += 1;
            self.mem.read_phys(addr, buf)
        }
    }

    const STACK_VA: u64 = 0xffff_c900_0001_2000;
    const STACK_PA: u64 = 0x10_0000;

    /// Four-level tables at 0x1000.. mapping one 4 KiB page `STACK_VA` → `STACK_PA`, whose
    /// words are their own index times 3.
    fn one_mapped_page() -> Counting {
        let mut mem = SparseMemory::new();
        mem.add_zeroed(0x1000, 0x4000).unwrap();
        let index = |shift: u32| (STACK_VA >> shift) & 0x1ff;
        for (level, (table, next)) in [(0x1000, 0x2003), (0x2000, 0x3003), (0x3000, 0x4003)]
            .into_iter()
            .enumerate()
        {
            let shift = 39 - 9 * level as u32;
            mem.write_phys_u64(table + index(shift) * 8, next).unwrap();
        }
        mem.write_phys_u64(0x4000 + index(12) * 8, STACK_PA | 3)
            .unwrap();
        let words: Vec<u8> = (0..512u64).flat_map(|i| (i * 3).to_le_bytes()).collect();
        mem.add_region(STACK_PA, words).unwrap();
        Counting { mem, reads: 0 }
    }

    #[test]
    fn page_cache_reads_words_through_the_page_tables_and_each_line_once() {
        let mut mem = one_mapped_page();
        let mut space = AddressSpace::new(&mut mem, 0x1000, false);
        let mut cache = PageCache::new(&mut space);

        let first = cache.read_u64(STACK_VA + 8 * 10).unwrap();
        let same_line = cache.read_u64(STACK_VA + 8 * 11).unwrap();
        let other_page_line = cache.read_u64(STACK_VA + 8 * 500).unwrap();
        drop(cache);

        assert_eq!((first, same_line, other_page_line), (30, 33, 1500));
        // One walk (4 table reads) and two line reads.
        assert_eq!(mem.reads, 4 + 2);
    }

    #[test]
    fn page_cache_refuses_unmapped_and_straddling_reads_cleanly() {
        let mut mem = one_mapped_page();
        let mut space = AddressSpace::new(&mut mem, 0x1000, false);
        let mut cache = PageCache::new(&mut space);

        let unmapped = cache.read_u64(STACK_VA + PAGE);
        let straddling = cache.read_u64(STACK_VA + PAGE - 4);

        assert!(unmapped.is_err());
        assert!(straddling.is_err());
    }

    #[test]
    fn vcpu_registers_map_to_pt_regs_by_gdb_order() {
        let mut regs = X86Registers::default();
        for (i, g) in regs.gpr.iter_mut().enumerate() {
            *g = 100 + i as u64;
        }
        regs.rip = 0xffff_ffff_8100_0000;
        regs.segments[0] = 0x10;

        let pt = pt_regs_of(&regs);

        assert_eq!(
            (pt.ax, pt.bx, pt.cx, pt.dx, pt.si, pt.di, pt.bp, pt.sp),
            (100, 101, 102, 103, 104, 105, 106, 107)
        );
        assert_eq!((pt.r8, pt.r10, pt.r13, pt.r15), (108, 110, 113, 115));
        assert_eq!(
            (pt.ip, pt.cs, pt.user_mode()),
            (0xffff_ffff_8100_0000, 0x10, false)
        );
    }

    /// Text of two functions at `TEXT`: `leaf` (0x100.., 16 bytes of frame after its push)
    /// called from `caller` (0x200.., an 8-byte frame), called from `outer` (0x300..),
    /// where the stack ends.
    const TEXT: u64 = 0xffff_ffff_8100_0000;

    fn three_functions() -> OrcTable {
        use exotap_introspect::orc::{encode_tables, OrcLayout, RawOrcEntry};
        // Linux 4.14 layout: sp_reg in bits 0-3 (SP = 5), type in 8-9 (CALL 0), end bit 10.
        let call = |sp_offset| RawOrcEntry {
            sp_offset,
            bp_offset: 0,
            flags: 5,
        };
        let end = RawOrcEntry {
            sp_offset: 0,
            bp_offset: 0,
            flags: 1 << 10,
        };
        let rows = [
            (TEXT + 0x100, call(8)),
            (TEXT + 0x101, call(24)),
            (TEXT + 0x200, call(16)),
            (TEXT + 0x300, end),
            (TEXT + 0x1000, RawOrcEntry::default()),
        ];
        let at = 0xffff_ffff_8200_0000;
        let (ips, entries) = encode_tables(at, &rows).unwrap();
        OrcTable::parse_with_layout(&ips, at, &entries, OrcLayout::Linux4_14).unwrap()
    }

    /// A snapshot at `leaf`'s first byte: its return address into `caller`, then `caller`'s
    /// 8 bytes and its return address into `outer`; `copied` bytes of that.
    fn leaf_snapshot(stack: &[u8]) -> crate::compile::snapshot::Snapshot<'_> {
        crate::compile::snapshot::Snapshot {
            pc: TEXT + 0x100,
            sp: 0xffff_c900_0000_3f00,
            regs: [0; 16],
            stack,
        }
    }

    fn leaf_stack() -> Vec<u8> {
        [TEXT + 0x234, 0xdead, TEXT + 0x345]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    #[test]
    fn a_snapshot_unwinds_from_the_probe_point_through_its_callers() {
        let table = three_functions();
        let stack = leaf_stack();

        let (backtrace, cut) = unwind_snapshot(&Unwinder::new(&table, 0), &leaf_snapshot(&stack));

        let pcs: Vec<u64> = backtrace.pcs().collect();
        assert_eq!(pcs, vec![TEXT + 0x100, TEXT + 0x234, TEXT + 0x345]);
        assert!(backtrace.is_complete() && !cut, "{:?}", backtrace.end);
    }

    #[test]
    fn a_snapshot_too_short_for_the_next_frame_says_the_stack_is_cut() {
        let table = three_functions();
        let stack = leaf_stack();

        let (backtrace, cut) =
            unwind_snapshot(&Unwinder::new(&table, 0), &leaf_snapshot(&stack[..16]));

        let pcs: Vec<u64> = backtrace.pcs().collect();
        assert_eq!(pcs, vec![TEXT + 0x100, TEXT + 0x234]);
        assert!(cut, "{:?}", backtrace.end);
    }

    #[test]
    fn a_snapshots_registers_start_the_unwind_in_kernel_mode_at_the_probe_point() {
        let mut regs = [0u64; 16];
        for (i, r) in regs.iter_mut().enumerate() {
            *r = 1000 + i as u64;
        }
        let snap = crate::compile::snapshot::Snapshot {
            pc: TEXT,
            sp: 0x5000,
            regs,
            stack: &[],
        };

        let pt = pt_regs_of_snapshot(&snap);

        // The copy from r15 holds r15 first, rax at 14, the flags at 15.
        assert_eq!((pt.r15, pt.r14, pt.ax, pt.flags), (1000, 1001, 1014, 1015));
        assert_eq!((pt.bp, pt.di, pt.r10), (1008, 1009, 1005));
        assert_eq!((pt.ip, pt.sp, pt.user_mode()), (TEXT, 0x5000, false));
    }

    #[test]
    fn task_state_letters_follow_proc() {
        let task = |state| GuestTask {
            task: 0,
            pid: 1,
            tgid: 1,
            comm: String::new(),
            state,
            on_cpu: false,
            thread_sp: 0,
        };

        let letters: String = [0, 1, 2, 0x402, 4]
            .map(|s| task(s).state_letter())
            .iter()
            .collect();

        assert_eq!(letters, "RSDIT");
    }
}
