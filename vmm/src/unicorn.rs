//! The Unicorn backend: a single emulated CPU (x86-64 or SPARC V9) with a flat memory map,
//! driven through the same [`Machine`] interface as the QEMU gdbstub and KVM backends.
//!
//! Memory is mapped by virtual address ([`UnicornMachine::map`]). On x86-64 the backend
//! builds real 4-level page tables (Unicorn's physical address space cannot hold
//! kernel addresses like `0xffffffff81000000`, so paging is what lets a kernel image run
//! at its link address): frames and tables are allocated from low physical memory, CR3
//! points at the tables, and `read_phys`/`read_virt` differ as on hardware. On SPARC the
//! MMU is off and virtual addresses are physical. Runs are synchronous and
//! deterministic: [`Machine::resume`] emulates until a breakpoint, the halt address, an
//! instruction budget or a fault, and [`Machine::wait_event`] hands back why it stopped.
//!
//! Breakpoints are Unicorn "exits" (`uc_ctl_set_exits`): the emulator stops *before* the
//! instruction at an exit address, without writing anything into guest memory, like a
//! debugger's hardware breakpoint. Resuming from the breakpoint it stopped at steps over
//! it first. The instruction budget bounds each resume (Unicorn's own instruction count),
//! so a run that loops forever still ends. The optional per-address execution profile
//! ([`UnicornMachine::start_profile`]) is a code hook over the whole address space: the
//! independent oracle of the splicing regression, installed only while profiling
//! because it slows emulation down.
//!
//! SPARC64 works around two bugs of Unicorn 2.1.5's SPARC translator
//! (`qemu/target/sparc/translate.c`):
//! - any `UC_HOOK_CODE` covering an instruction makes the translator store its
//!   placeholder npc (`DYNAMIC_PC` = 1) into `npc` before that instruction, so a code
//!   hook over the delay slot of a `jmpl`/`retl`/`ret` sends the CPU to address 1 (it
//!   stops with trap 0x22 at pc 5). Unicorn's own instruction count is such a hook. So
//!   on SPARC the per-instruction profile and the instruction budget come from a block
//!   hook instead (translated blocks run straight through, delay slots included; the
//!   budget is checked at block starts, so a run may overshoot it by one block, and a
//!   single step runs one block);
//! - an exit address (`uc_ctl_set_exits`) ends translation without stopping on
//!   SPARC64 (sparc_tr_translate_insn emits no halt there), so the emulator spins. So
//!   on SPARC the halt address and breakpoints are code hooks on their single address
//!   that stop the emulator (safe unless that address is a `jmpl`'s delay slot).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use unicorn_engine::unicorn_const::{Arch, Mode, Prot};
use unicorn_engine::{uc_error, RegisterSPARC, RegisterX86, UcHookId, Unicorn};

use crate::control::{
    ControlError, Machine, RegisterFile, SparcRegisters, StopEvent, VcpuId, X86Registers,
};

const BACKEND: &str = "unicorn";

const PAGE: u64 = 0x1000;
/// Physical frames for x86-64 page tables.
const TABLE_POOL: std::ops::Range<u64> = 0x1000..0x10_0000;
/// Physical frames for mapped memory (below 4 GiB: Unicorn takes CR3 as 32 bits).
const FRAMES_START: u64 = 0x10_0000;
const FRAMES_END: u64 = 0x1_0000_0000;

/// The only vCPU.
pub const VCPU: VcpuId = VcpuId(0);

/// Which CPU to emulate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// x86-64, long mode.
    X86_64,
    /// SPARC V9, 64-bit, big-endian.
    Sparc64,
}

/// Why a run ended, in more detail than [`StopEvent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunEnd {
    /// The pc reached a breakpoint (before executing it).
    Breakpoint(u64),
    /// The pc reached the halt address.
    Halted(u64),
    /// The instruction budget is used up; pc is the next instruction.
    BudgetExhausted(u64),
    /// A trap/interrupt was raised (x86 vector or SPARC trap type) and nothing handled it.
    Interrupt {
        /// The pc after the trapping instruction.
        pc: u64,
        /// The interrupt number.
        number: u32,
    },
    /// Unicorn stopped with an error (unmapped or protected memory, invalid instruction).
    Fault {
        /// The pc when it stopped.
        pc: u64,
        /// Unicorn's reason.
        error: String,
    },
}

/// Data the hooks share with the machine.
#[derive(Debug, Default)]
struct HookState {
    /// Execution count per address, when profiling.
    profile: Option<HashMap<u64, u64>>,
    /// The first unhandled interrupt of the current run.
    interrupt: Option<u32>,
    /// Hits per redirect address.
    redirect_hits: HashMap<u64, u64>,
    /// SPARC: instructions the current run may still start (the block-hook budget).
    budget_left: Option<u64>,
    /// SPARC: the block-hook budget stopped the run.
    budget_hit: bool,
    /// SPARC: the end of the block that started last.
    block_end: u64,
    /// Executions per Unicorn translation block `(start, size in bytes)`, when the
    /// block profile is on.
    blocks: Option<HashMap<(u64, u32), u64>>,
}

/// A Unicorn emulator under exotap's control.
pub struct UnicornMachine {
    uc: Unicorn<'static, HookState>,
    isa: Isa,
    regions: Vec<(u64, u64)>,
    /// Virtual page → physical frame (x86-64 paging).
    pages: BTreeMap<u64, u64>,
    /// Next free page-table frame, and the end of the table pool.
    next_table: u64,
    /// Next free data frame.
    next_frame: u64,
    /// The top-level page table (x86-64).
    pml4: u64,
    breakpoints: BTreeSet<u64>,
    halt: Option<u64>,
    budget: u64,
    /// The breakpoint the machine stopped at, until the pc changes.
    at_breakpoint: Option<u64>,
    profile_hook: Option<UcHookId>,
    block_hook: Option<UcHookId>,
    redirects: Vec<UcHookId>,
    /// SPARC: the code hooks standing in for exits (halt and breakpoints).
    stop_hooks: Vec<UcHookId>,
    /// The exits (breakpoints and halt) Unicorn was last given: setting the same set again
    /// (a harness's `set_halt` at every hit) keeps the translated code, which a change must
    /// drop (the exits are compiled into it). Retranslating every body at every hit was most
    /// of the compiled-bodies regression's time.
    synced_exits: Option<Vec<u64>>,
    pending: Option<StopEvent>,
    last_end: Option<RunEnd>,
}

impl std::fmt::Debug for UnicornMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnicornMachine")
            .field("isa", &self.isa)
            .field("regions", &self.regions)
            .field("breakpoints", &self.breakpoints)
            .field("halt", &self.halt)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

fn backend(e: uc_error) -> ControlError {
    ControlError::Backend {
        backend: BACKEND,
        source: Box::new(e),
    }
}

/// x86 GPRs in [`X86Registers::gpr`] order.
mod paging;

const X86_GPRS: [RegisterX86; 16] = [
    RegisterX86::RAX,
    RegisterX86::RBX,
    RegisterX86::RCX,
    RegisterX86::RDX,
    RegisterX86::RSI,
    RegisterX86::RDI,
    RegisterX86::RBP,
    RegisterX86::RSP,
    RegisterX86::R8,
    RegisterX86::R9,
    RegisterX86::R10,
    RegisterX86::R11,
    RegisterX86::R12,
    RegisterX86::R13,
    RegisterX86::R14,
    RegisterX86::R15,
];

/// SPARC integer registers of the current window, in [`SparcRegisters::r`] order.
const SPARC_REGS: [RegisterSPARC; 32] = [
    RegisterSPARC::G0,
    RegisterSPARC::G1,
    RegisterSPARC::G2,
    RegisterSPARC::G3,
    RegisterSPARC::G4,
    RegisterSPARC::G5,
    RegisterSPARC::G6,
    RegisterSPARC::G7,
    RegisterSPARC::O0,
    RegisterSPARC::O1,
    RegisterSPARC::O2,
    RegisterSPARC::O3,
    RegisterSPARC::O4,
    RegisterSPARC::O5,
    RegisterSPARC::O6,
    RegisterSPARC::O7,
    RegisterSPARC::L0,
    RegisterSPARC::L1,
    RegisterSPARC::L2,
    RegisterSPARC::L3,
    RegisterSPARC::L4,
    RegisterSPARC::L5,
    RegisterSPARC::L6,
    RegisterSPARC::L7,
    RegisterSPARC::I0,
    RegisterSPARC::I1,
    RegisterSPARC::I2,
    RegisterSPARC::I3,
    RegisterSPARC::I4,
    RegisterSPARC::I5,
    RegisterSPARC::I6,
    RegisterSPARC::I7,
];

impl UnicornMachine {
    /// A fresh CPU with no memory, no breakpoints and an unlimited budget.
    ///
    /// # Errors
    /// Unicorn cannot open the architecture.
    pub fn new(isa: Isa) -> Result<Self, ControlError> {
        let (arch, mode) = match isa {
            Isa::X86_64 => (Arch::X86, Mode::MODE_64),
            Isa::Sparc64 => (Arch::SPARC, Mode::SPARC64 | Mode::BIG_ENDIAN),
        };
        let mut uc = Unicorn::new_with_data(arch, mode, HookState::default()).map_err(backend)?;
        uc.add_intr_hook(|uc, number| {
            let data = uc.get_data_mut();
            if data.interrupt.is_none() {
                data.interrupt = Some(number);
            }
            let _ = uc.emu_stop();
        })
        .map_err(backend)?;
        uc.ctl_exits_enable().map_err(backend)?;
        let mut m = Self {
            uc,
            isa,
            regions: Vec::new(),
            pages: BTreeMap::new(),
            next_table: TABLE_POOL.start,
            next_frame: FRAMES_START,
            pml4: 0,
            breakpoints: BTreeSet::new(),
            halt: None,
            budget: u64::MAX,
            at_breakpoint: None,
            profile_hook: None,
            block_hook: None,
            redirects: Vec::new(),
            stop_hooks: Vec::new(),
            synced_exits: None,
            pending: None,
            last_end: None,
        };
        match isa {
            Isa::X86_64 => m.enable_paging()?,
            Isa::Sparc64 => {
                m.uc.add_block_hook(1, 0, |uc, addr, size| {
                    let data = uc.get_data_mut();
                    let n = u64::from(size / 4);
                    data.block_end = addr + 4 * n;
                    if let Some(left) = data.budget_left.as_mut() {
                        if *left == 0 {
                            data.budget_hit = true;
                            let _ = uc.emu_stop();
                            return;
                        }
                        *left = left.saturating_sub(n);
                    }
                    if let Some(profile) = data.profile.as_mut() {
                        for i in 0..n {
                            *profile.entry(addr + 4 * i).or_insert(0) += 1;
                        }
                    }
                })
                .map_err(backend)?;
            }
        }
        Ok(m)
    }

    /// The emulated ISA.
    #[must_use]
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Maps `size` bytes of zeroed RAM at virtual address `addr` (both page-aligned:
    /// 4 KiB on x86-64, 8 KiB on SPARC64), readable, writable and executable.
    ///
    /// # Errors
    /// Unaligned, empty or overlapping ranges; out of frames or page tables.
    pub fn map(&mut self, addr: u64, size: u64) -> Result<(), ControlError> {
        let bad = ControlError::Memory {
            addr,
            len: usize::try_from(size).unwrap_or(usize::MAX),
            space: "virtual",
        };
        if size == 0
            || !addr.is_multiple_of(PAGE)
            || !size.is_multiple_of(PAGE)
            || addr.checked_add(size).is_none()
        {
            return Err(bad);
        }
        if self
            .regions
            .iter()
            .any(|&(a, s)| addr < a + s && a < addr + size)
        {
            return Err(bad);
        }
        match self.isa {
            Isa::X86_64 => {
                let frames = self.next_frame;
                if frames.checked_add(size).is_none_or(|end| end > FRAMES_END) {
                    return Err(bad);
                }
                self.uc.mem_map(frames, size, Prot::ALL).map_err(backend)?;
                self.next_frame += size;
                for page in (0..size).step_by(PAGE as usize) {
                    self.map_page(addr + page, frames + page)?;
                }
                self.uc.ctl_flush_tlb().map_err(backend)?;
            }
            Isa::Sparc64 => self.uc.mem_map(addr, size, Prot::ALL).map_err(backend)?,
        }
        self.regions.push((addr, size));
        Ok(())
    }

    /// The mapped regions, `(start, size)`, in mapping order.
    #[must_use]
    pub fn regions(&self) -> &[(u64, u64)] {
        &self.regions
    }

    /// Where runs end: reaching this pc stops the machine with [`StopEvent::Exited`].
    ///
    /// # Errors
    /// Backend failure.
    pub fn set_halt(&mut self, addr: Option<u64>) -> Result<(), ControlError> {
        self.halt = addr;
        self.sync_exits()
    }

    /// How many instructions one run (one resume) may execute (`u64::MAX`: unlimited);
    /// a run that uses them up stops with [`RunEnd::BudgetExhausted`].
    pub fn set_budget(&mut self, instructions: u64) {
        self.budget = instructions.max(1);
    }

    /// Starts counting executions per instruction address (clears earlier counts).
    ///
    /// # Errors
    /// Backend failure.
    pub fn start_profile(&mut self) -> Result<(), ControlError> {
        self.uc.get_data_mut().profile = Some(HashMap::new());
        // SPARC: the block hook counts (a code hook would break delay slots).
        if self.profile_hook.is_none() && self.isa == Isa::X86_64 {
            let hook = self
                .uc
                .add_code_hook(1, 0, |uc, addr, _size| {
                    if let Some(profile) = uc.get_data_mut().profile.as_mut() {
                        *profile.entry(addr).or_insert(0) += 1;
                    }
                })
                .map_err(backend)?;
            self.profile_hook = Some(hook);
        }
        Ok(())
    }

    /// The execution count per instruction address since [`Self::start_profile`].
    #[must_use]
    pub fn profile(&self) -> Option<&HashMap<u64, u64>> {
        self.uc.get_data().profile.as_ref()
    }

    /// Installs an in-emulator trap handler: whenever the pc reaches `addr`, count a hit
    /// and continue at `to` (without executing the instruction at `addr`). This is what a
    /// breakpoint event handled by the host does ([`Machine::set_breakpoint`], then
    /// [`Machine::set_pc`] and [`Machine::resume`]), without leaving the emulator on
    /// every hit. On SPARC `addr` must not be the delay slot of a `jmpl` (see the module
    /// doc: a code hook there loses the jump's target).
    ///
    /// # Errors
    /// Backend failure.
    pub fn add_redirect(&mut self, addr: u64, to: u64) -> Result<(), ControlError> {
        let isa = self.isa;
        let hook = self
            .uc
            .add_code_hook(addr, addr, move |uc, pc, _size| {
                if pc != addr {
                    return;
                }
                *uc.get_data_mut().redirect_hits.entry(addr).or_insert(0) += 1;
                let _ = match isa {
                    Isa::X86_64 => uc.reg_write(RegisterX86::RIP, to),
                    Isa::Sparc64 => uc.reg_write(RegisterSPARC::PC, to),
                };
            })
            .map_err(backend)?;
        self.redirects.push(hook);
        self.uc.ctl_flush_tb().map_err(backend)
    }

    /// Removes every redirect and returns the hits per address.
    ///
    /// # Errors
    /// Backend failure.
    pub fn take_redirects(&mut self) -> Result<HashMap<u64, u64>, ControlError> {
        for hook in std::mem::take(&mut self.redirects) {
            self.uc.remove_hook(hook).map_err(backend)?;
        }
        self.uc.ctl_flush_tb().map_err(backend)?;
        Ok(std::mem::take(&mut self.uc.get_data_mut().redirect_hits))
    }

    /// Stops profiling and returns the counts.
    pub fn take_profile(&mut self) -> Option<HashMap<u64, u64>> {
        if let Some(hook) = self.profile_hook.take() {
            let _ = self.uc.remove_hook(hook);
        }
        self.uc.get_data_mut().profile.take()
    }

    /// Starts counting executions per Unicorn block (its own `hook_block`: a block is a
    /// straight run of instructions that Unicorn translated together, started once per
    /// entry), clearing earlier counts. An independent oracle for block counters: it
    /// is not derived from exotap's CFG.
    ///
    /// # Errors
    /// Backend failure.
    pub fn start_block_profile(&mut self) -> Result<(), ControlError> {
        self.uc.get_data_mut().blocks = Some(HashMap::new());
        if self.block_hook.is_none() {
            let hook = self
                .uc
                .add_block_hook(1, 0, |uc, addr, size| {
                    if let Some(blocks) = uc.get_data_mut().blocks.as_mut() {
                        *blocks.entry((addr, size)).or_insert(0) += 1;
                    }
                })
                .map_err(backend)?;
            self.block_hook = Some(hook);
            self.uc.ctl_flush_tb().map_err(backend)?;
        }
        Ok(())
    }

    /// Stops the block profile and returns executions per `(block start, size)`.
    pub fn take_block_profile(&mut self) -> Option<HashMap<(u64, u32), u64>> {
        if let Some(hook) = self.block_hook.take() {
            let _ = self.uc.remove_hook(hook);
        }
        self.uc.get_data_mut().blocks.take()
    }

    /// How the last run ended.
    #[must_use]
    pub fn last_end(&self) -> Option<&RunEnd> {
        self.last_end.as_ref()
    }

    /// Writes guest memory at a virtual address, dropping translated code that covered
    /// it (so that code patches take effect).
    ///
    /// # Errors
    /// [`ControlError::Memory`] outside the mapped regions.
    pub fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        let err = || ControlError::Memory {
            addr,
            len: data.len(),
            space: "virtual",
        };
        let pieces = self.pieces(addr, data.len()).ok_or_else(err)?;
        for (pa, off, n) in pieces {
            self.uc
                .mem_write(pa, &data[off..off + n])
                .map_err(|_| err())?;
            // Unicorn looks the range up by virtual address. Where it refuses (SPARC with
            // the MMU off), drop all translated code instead.
            let va = addr + off as u64;
            if self.uc.ctl_remove_cache(va, va + n as u64).is_err() {
                self.uc.ctl_flush_tb().map_err(backend)?;
            }
        }
        Ok(())
    }

    /// Reads guest memory at a virtual address.
    ///
    /// # Errors
    /// [`ControlError::Memory`] outside the mapped regions.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        let len = buf.len();
        let err = || ControlError::Memory {
            addr,
            len,
            space: "virtual",
        };
        for (pa, off, n) in self.pieces(addr, len).ok_or_else(err)? {
            self.uc
                .mem_read(pa, &mut buf[off..off + n])
                .map_err(|_| err())?;
        }
        Ok(())
    }

    /// Sets the x86-64 general-purpose registers, rip and rflags.
    ///
    /// # Errors
    /// Not an x86-64 machine, or backend failure.
    pub fn set_x86_registers(&mut self, regs: &X86Registers) -> Result<(), ControlError> {
        if self.isa != Isa::X86_64 {
            return Err(ControlError::Unsupported {
                backend: BACKEND,
                what: "set x86 registers on a SPARC CPU",
            });
        }
        for (reg, value) in X86_GPRS.iter().zip(regs.gpr) {
            self.uc.reg_write(*reg, value).map_err(backend)?;
        }
        self.uc
            .reg_write(RegisterX86::RFLAGS, regs.rflags)
            .map_err(backend)?;
        self.at_breakpoint = None;
        self.uc
            .reg_write(RegisterX86::RIP, regs.rip)
            .map_err(backend)
    }

    /// Sets the GS base (the kernel's per-CPU base on x86-64).
    ///
    /// # Errors
    /// Not an x86-64 machine, or backend failure.
    pub fn set_gs_base(&mut self, base: u64) -> Result<(), ControlError> {
        if self.isa != Isa::X86_64 {
            return Err(ControlError::Unsupported {
                backend: BACKEND,
                what: "set the GS base on a SPARC CPU",
            });
        }
        self.uc
            .reg_write(RegisterX86::GS_BASE, base)
            .map_err(backend)
    }

    /// Sets one SPARC register of the current window (`%g0`..`%i7` as 0..31).
    ///
    /// # Errors
    /// Not a SPARC machine, bad index, backend failure.
    pub fn set_sparc_reg(&mut self, index: usize, value: u64) -> Result<(), ControlError> {
        let reg = match (self.isa, SPARC_REGS.get(index)) {
            (Isa::Sparc64, Some(reg)) => *reg,
            _ => {
                return Err(ControlError::Unsupported {
                    backend: BACKEND,
                    what: "set this SPARC register",
                })
            }
        };
        self.uc.reg_write(reg, value).map_err(backend)
    }

    fn pc(&self) -> Result<u64, ControlError> {
        match self.isa {
            Isa::X86_64 => self.uc.reg_read(RegisterX86::RIP),
            // The binding's pc_read refuses SPARC64's mode.
            Isa::Sparc64 => self.uc.reg_read(RegisterSPARC::PC),
        }
        .map_err(backend)
    }

    fn sync_exits(&mut self) -> Result<(), ControlError> {
        let mut exits: Vec<u64> = self.breakpoints.iter().copied().collect();
        exits.extend(self.halt);
        exits.sort_unstable();
        exits.dedup();
        if self.synced_exits.as_ref() == Some(&exits) {
            return Ok(());
        }
        // Unknown until the new set is in: a failure below leaves it to be set again.
        self.synced_exits = None;
        if self.isa == Isa::Sparc64 {
            for hook in std::mem::take(&mut self.stop_hooks) {
                self.uc.remove_hook(hook).map_err(backend)?;
            }
            for &addr in &exits {
                let hook = self
                    .uc
                    .add_code_hook(addr, addr, move |uc, pc, _size| {
                        if pc != addr {
                            return;
                        }
                        // The profile counted the whole block: uncount what stays unrun.
                        let data = uc.get_data_mut();
                        let end = data.block_end;
                        if let Some(profile) = data.profile.as_mut() {
                            for a in (pc..end).step_by(4) {
                                if let Some(c) = profile.get_mut(&a) {
                                    *c = c.saturating_sub(1);
                                }
                            }
                            profile.retain(|_, c| *c > 0);
                        }
                        let _ = uc.emu_stop();
                    })
                    .map_err(backend)?;
                self.stop_hooks.push(hook);
            }
        } else {
            self.uc.ctl_set_exits(&exits).map_err(backend)?;
        }
        // Exits (and SPARC's stop hooks) are compiled into translated blocks: drop those
        // made with the old set.
        self.uc.ctl_flush_tb().map_err(backend)?;
        self.synced_exits = Some(exits);
        Ok(())
    }

    fn emulate(&mut self, pc: u64, count: u64) -> Result<(), uc_error> {
        if self.isa == Isa::Sparc64 {
            let data = self.uc.get_data_mut();
            data.budget_left = (count != 0).then_some(count);
            data.budget_hit = false;
            return self.uc.emu_start(pc, 0, 0, 0);
        }
        let count = usize::try_from(count).unwrap_or(usize::MAX);
        self.uc.emu_start(pc, 0, 0, count)
    }

    /// Runs from the current pc until a breakpoint, the halt address, the budget or a
    /// fault. A breakpoint at the starting pc is stepped over first.
    ///
    /// # Errors
    /// Backend failure other than a guest fault (those are [`RunEnd::Fault`]).
    pub fn run(&mut self) -> Result<RunEnd, ControlError> {
        self.uc.get_data_mut().interrupt = None;
        let start = self.pc()?;
        let resuming = self.at_breakpoint.take() == Some(start);
        if !resuming && Some(start) == self.halt {
            return Ok(self.finish(RunEnd::Halted(start)));
        }
        if !resuming && self.breakpoints.contains(&start) {
            // Unicorn cannot start at one of its exits: the stop is due right here.
            return Ok(self.finish(RunEnd::Breakpoint(start)));
        }
        if resuming && self.breakpoints.contains(&start) {
            // Step over the breakpoint under our feet without it as an exit.
            let saved = std::mem::take(&mut self.breakpoints);
            let step = self.sync_exits().and_then(|()| self.step_one());
            self.breakpoints = saved;
            self.sync_exits()?;
            if let Some(end) = step? {
                return Ok(self.finish(end));
            }
        }
        let pc = self.pc()?;
        // Unicorn's count 0 means no limit.
        let count = if self.budget == u64::MAX {
            0
        } else {
            self.budget
        };
        let result = self.emulate(pc, count);
        let end = self.classify(result)?;
        Ok(self.finish(end))
    }

    /// Executes one instruction; `Some(end)` when that already ended the run.
    fn step_one(&mut self) -> Result<Option<RunEnd>, ControlError> {
        let pc = self.pc()?;
        let result = self.emulate(pc, 1);
        match self.classify(result)? {
            RunEnd::BudgetExhausted(_) => Ok(None),
            end @ (RunEnd::Fault { .. } | RunEnd::Interrupt { .. }) => Ok(Some(end)),
            RunEnd::Halted(_) | RunEnd::Breakpoint(_) => Ok(None),
        }
    }

    fn classify(&mut self, result: Result<(), uc_error>) -> Result<RunEnd, ControlError> {
        let pc = self.pc()?;
        if let Err(e) = result {
            return Ok(RunEnd::Fault {
                pc,
                error: e.to_string(),
            });
        }
        if let Some(number) = self.uc.get_data().interrupt {
            if !self.is_spurious_fault_at_exit(number, pc)? {
                return Ok(RunEnd::Interrupt { pc, number });
            }
        }
        if std::mem::take(&mut self.uc.get_data_mut().budget_hit) {
            return Ok(RunEnd::BudgetExhausted(pc));
        }
        if Some(pc) == self.halt {
            return Ok(RunEnd::Halted(pc));
        }
        if self.breakpoints.contains(&pc) {
            return Ok(RunEnd::Breakpoint(pc));
        }
        Ok(RunEnd::BudgetExhausted(pc))
    }

    /// Whether interrupt `number` at `pc` is the page fault Unicorn 2.1.5 raises the first
    /// time execution reaches an exit (the halt address or a breakpoint) at the start of a
    /// page whose preceding page is unmapped: CR2 is the byte before the exit, which
    /// nothing executes. The exit was reached; the run ends there as it does on every
    /// later run.
    fn is_spurious_fault_at_exit(&self, number: u32, pc: u64) -> Result<bool, ControlError> {
        const PAGE_FAULT: u32 = 14;
        let at_exit = Some(pc) == self.halt || self.breakpoints.contains(&pc);
        if self.isa != Isa::X86_64 || number != PAGE_FAULT || !at_exit {
            return Ok(false);
        }
        let cr2 = self.uc.reg_read(RegisterX86::CR2).map_err(backend)?;
        Ok(cr2 == pc.wrapping_sub(1) && self.translate(cr2).is_none())
    }

    fn finish(&mut self, end: RunEnd) -> RunEnd {
        self.at_breakpoint = match end {
            RunEnd::Breakpoint(pc) => Some(pc),
            _ => None,
        };
        self.pending = Some(match end {
            RunEnd::Breakpoint(pc) => StopEvent::Breakpoint { vcpu: VCPU, pc },
            RunEnd::Halted(_) | RunEnd::Fault { .. } | RunEnd::Interrupt { .. } => {
                StopEvent::Exited
            }
            RunEnd::BudgetExhausted(_) => StopEvent::Paused,
        });
        self.last_end = Some(end.clone());
        end
    }

    fn x86_registers(&self) -> Result<X86Registers, ControlError> {
        let mut regs = X86Registers::default();
        for (slot, reg) in regs.gpr.iter_mut().zip(X86_GPRS) {
            *slot = self.uc.reg_read(reg).map_err(backend)?;
        }
        let read = |r: RegisterX86| self.uc.reg_read(r).map_err(backend);
        regs.rip = read(RegisterX86::RIP)?;
        regs.rflags = read(RegisterX86::RFLAGS)?;
        let segs = [
            RegisterX86::CS,
            RegisterX86::SS,
            RegisterX86::DS,
            RegisterX86::ES,
            RegisterX86::FS,
            RegisterX86::GS,
        ];
        for (slot, reg) in regs.segments.iter_mut().zip(segs) {
            *slot = read(reg)? as u16;
        }
        regs.fs_base = read(RegisterX86::FS_BASE)?;
        regs.gs_base = read(RegisterX86::GS_BASE)?;
        regs.cr0 = read(RegisterX86::CR0)?;
        regs.cr2 = read(RegisterX86::CR2)?;
        regs.cr3 = read(RegisterX86::CR3)?;
        regs.cr4 = read(RegisterX86::CR4)?;
        Ok(regs)
    }

    fn sparc_registers(&self) -> Result<SparcRegisters, ControlError> {
        let mut regs = SparcRegisters::default();
        for (slot, reg) in regs.r.iter_mut().zip(SPARC_REGS) {
            *slot = self.uc.reg_read(reg).map_err(backend)?;
        }
        regs.pc = self.uc.reg_read(RegisterSPARC::PC).map_err(backend)?;
        // Unicorn does not expose npc; a resume restarts at pc with npc = pc + 4.
        regs.npc = regs.pc.wrapping_add(4);
        Ok(regs)
    }
}

impl Machine for UnicornMachine {
    fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
        Ok(vec![VCPU])
    }

    fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.uc
            .mem_read(addr, buf)
            .map_err(|_| ControlError::Memory {
                addr,
                len: buf.len(),
                space: "physical",
            })
    }

    fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        self.uc
            .mem_write(addr, data)
            .map_err(|_| ControlError::Memory {
                addr,
                len: data.len(),
                space: "physical",
            })?;
        // Translated code is found by virtual address, and any may map this frame.
        self.uc.ctl_flush_tb().map_err(backend)
    }

    fn read_virt(&mut self, vcpu: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        if vcpu != VCPU {
            return Err(ControlError::NoVcpu(vcpu));
        }
        self.read(addr, buf)
    }

    fn write_virt(&mut self, vcpu: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
        if vcpu != VCPU {
            return Err(ControlError::NoVcpu(vcpu));
        }
        self.write(addr, data)
    }

    fn registers(&mut self, vcpu: VcpuId) -> Result<RegisterFile, ControlError> {
        if vcpu != VCPU {
            return Err(ControlError::NoVcpu(vcpu));
        }
        Ok(match self.isa {
            Isa::X86_64 => RegisterFile::X86_64(self.x86_registers()?),
            Isa::Sparc64 => RegisterFile::Sparc64(self.sparc_registers()?),
        })
    }

    fn set_pc(&mut self, vcpu: VcpuId, pc: u64) -> Result<(), ControlError> {
        if vcpu != VCPU {
            return Err(ControlError::NoVcpu(vcpu));
        }
        self.at_breakpoint = None;
        match self.isa {
            Isa::X86_64 => self.uc.set_pc(pc).map_err(backend),
            // Unicorn sets npc = pc + 4 with it.
            Isa::Sparc64 => self.uc.reg_write(RegisterSPARC::PC, pc).map_err(backend),
        }
    }

    /// The emulator only runs inside [`Machine::resume`], so it is always paused here.
    fn pause(&mut self) -> Result<(), ControlError> {
        Ok(())
    }

    /// Runs synchronously until the next stop; [`Machine::wait_event`] returns it.
    fn resume(&mut self) -> Result<(), ControlError> {
        self.run().map(|_| ())
    }

    fn is_paused(&self) -> bool {
        true
    }

    fn set_breakpoint(&mut self, addr: u64, insert: bool) -> Result<(), ControlError> {
        if insert {
            self.breakpoints.insert(addr);
        } else {
            self.breakpoints.remove(&addr);
        }
        self.sync_exits()
    }

    fn wait_event(&mut self, _timeout: Duration) -> Result<Option<StopEvent>, ControlError> {
        Ok(self.pending.take())
    }

    fn step(&mut self, vcpu: VcpuId) -> Result<StopEvent, ControlError> {
        if vcpu != VCPU {
            return Err(ControlError::NoVcpu(vcpu));
        }
        let saved = std::mem::take(&mut self.breakpoints);
        let step = self.sync_exits().and_then(|()| self.step_one());
        self.breakpoints = saved;
        self.sync_exits()?;
        Ok(match step? {
            Some(end) => {
                self.finish(end);
                self.pending.take().unwrap_or(StopEvent::Exited)
            }
            None => StopEvent::Stepped { vcpu },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: u64 = 0xffff_ffff_8100_0000;

    /// `mov rax, 1; add rax, rax; add rax, rax; hlt-address` as three instructions.
    fn machine_with(code: &[u8]) -> UnicornMachine {
        let mut m = UnicornMachine::new(Isa::X86_64).unwrap();
        m.map(BASE, 0x1000).unwrap();
        m.write(BASE, code).unwrap();
        m.set_pc(VCPU, BASE).unwrap();
        m
    }

    // mov eax, 1 (5) ; add rax, rax (3) ; add rax, rax (3) ; nop (1)
    const CODE: [u8; 12] = [0xb8, 1, 0, 0, 0, 0x48, 0x01, 0xc0, 0x48, 0x01, 0xc0, 0x90];

    fn rax(m: &mut UnicornMachine) -> u64 {
        match m.registers(VCPU).unwrap() {
            RegisterFile::X86_64(r) => r.gpr[0],
            RegisterFile::Sparc64(_) => unreachable!(),
        }
    }

    #[test]
    fn runs_to_halt_at_kernel_addresses() {
        let mut m = machine_with(&CODE);
        m.set_halt(Some(BASE + 11)).unwrap();

        let end = m.run().unwrap();

        assert_eq!(end, RunEnd::Halted(BASE + 11));
        assert_eq!(rax(&mut m), 4);
        assert_eq!(
            m.wait_event(Duration::ZERO).unwrap(),
            Some(StopEvent::Exited)
        );
    }

    #[test]
    fn first_run_halts_at_a_page_start_after_an_unmapped_page() {
        // `ret` to a halt address at the start of its own page, the page before unmapped.
        let halt = BASE + 0x30_0000;
        let stack = BASE - 0x10_0000;
        let mut m = machine_with(&[0xc3]);
        m.map(stack, 0x1000).unwrap();
        m.map(halt, 0x1000).unwrap();
        m.write(stack + 0x800, &halt.to_le_bytes()).unwrap();
        m.set_halt(Some(halt)).unwrap();
        let mut start = X86Registers {
            rip: BASE,
            rflags: 2,
            ..X86Registers::default()
        };
        start.gpr[7] = stack + 0x800;
        m.set_x86_registers(&start).unwrap();

        let end = m.run().unwrap();

        assert_eq!(end, RunEnd::Halted(halt));
    }

    #[test]
    fn breakpoint_stops_before_the_instruction_and_resume_steps_over_it() {
        let mut m = machine_with(&CODE);
        m.set_halt(Some(BASE + 11)).unwrap();
        m.set_breakpoint(BASE + 5, true).unwrap();

        m.resume().unwrap();
        let first = m.wait_event(Duration::ZERO).unwrap();
        let rax_at_bp = rax(&mut m);
        m.resume().unwrap();
        let second = m.wait_event(Duration::ZERO).unwrap();

        assert_eq!(
            first,
            Some(StopEvent::Breakpoint {
                vcpu: VCPU,
                pc: BASE + 5
            })
        );
        assert_eq!(rax_at_bp, 1);
        assert_eq!(second, Some(StopEvent::Exited));
        assert_eq!(rax(&mut m), 4);
    }

    /// The exits are compiled into translated code: setting the same set again keeps that
    /// code, a changed set (a moved halt, a breakpoint added or removed after the code ran)
    /// must still take effect at once.
    #[test]
    fn exits_changed_after_the_code_ran_take_effect_at_the_next_run() {
        let mut m = machine_with(&CODE);
        let from_start = |m: &mut UnicornMachine| m.set_pc(VCPU, BASE).unwrap();
        m.set_halt(Some(BASE + 11)).unwrap();
        assert_eq!(m.run().unwrap(), RunEnd::Halted(BASE + 11));

        from_start(&mut m);
        m.set_halt(Some(BASE + 11)).unwrap();
        assert_eq!(m.run().unwrap(), RunEnd::Halted(BASE + 11));
        assert_eq!(rax(&mut m), 4);

        from_start(&mut m);
        m.set_halt(Some(BASE + 8)).unwrap();
        assert_eq!(m.run().unwrap(), RunEnd::Halted(BASE + 8));
        assert_eq!(rax(&mut m), 2);

        from_start(&mut m);
        m.set_breakpoint(BASE + 5, true).unwrap();
        assert_eq!(m.run().unwrap(), RunEnd::Breakpoint(BASE + 5));
        assert_eq!(rax(&mut m), 1);

        from_start(&mut m);
        m.set_breakpoint(BASE + 5, false).unwrap();
        m.set_halt(Some(BASE + 11)).unwrap();
        assert_eq!(m.run().unwrap(), RunEnd::Halted(BASE + 11));
        assert_eq!(rax(&mut m), 4);
    }

    #[test]
    fn breakpoint_at_the_starting_pc_stops_first() {
        let mut m = machine_with(&CODE);
        m.set_halt(Some(BASE + 11)).unwrap();
        m.set_breakpoint(BASE, true).unwrap();

        let first = m.run().unwrap();
        let second = m.run().unwrap();

        assert_eq!(first, RunEnd::Breakpoint(BASE));
        assert_eq!(second, RunEnd::Halted(BASE + 11));
        assert_eq!(rax(&mut m), 4);
    }

    #[test]
    fn redirect_counts_and_skips_the_instruction() {
        // Redirect the second `add rax, rax` to the nop after it: rax = 2, one hit.
        let mut m = machine_with(&CODE);
        m.set_halt(Some(BASE + 11)).unwrap();
        m.add_redirect(BASE + 8, BASE + 11).unwrap();

        let end = m.run().unwrap();
        let hits = m.take_redirects().unwrap();

        assert_eq!(end, RunEnd::Halted(BASE + 11));
        assert_eq!(rax(&mut m), 2);
        assert_eq!(hits.get(&(BASE + 8)), Some(&1));
    }

    #[test]
    fn budget_stops_a_run_exactly() {
        let mut m = machine_with(&CODE);
        m.set_halt(Some(BASE + 11)).unwrap();
        m.set_budget(2);

        let end = m.run().unwrap();

        assert_eq!(end, RunEnd::BudgetExhausted(BASE + 8));
        assert_eq!(rax(&mut m), 2);
    }

    #[test]
    fn step_executes_one_instruction() {
        let mut m = machine_with(&CODE);

        let ev = m.step(VCPU).unwrap();

        assert_eq!(ev, StopEvent::Stepped { vcpu: VCPU });
        assert_eq!(rax(&mut m), 1);
        assert_eq!(m.pc().unwrap(), BASE + 5);
    }

    #[test]
    fn profile_counts_each_instruction() {
        // mov ecx, 3 ; loop: dec ecx ; jnz loop ; nop
        let code = [0xb9, 3, 0, 0, 0, 0xff, 0xc9, 0x75, 0xfc, 0x90];
        let mut m = machine_with(&code);
        m.set_halt(Some(BASE + 9)).unwrap();
        m.start_profile().unwrap();

        m.run().unwrap();
        let p = m.take_profile().unwrap();

        assert_eq!(p.get(&BASE), Some(&1));
        assert_eq!(p.get(&(BASE + 5)), Some(&3));
        assert_eq!(p.get(&(BASE + 7)), Some(&3));
        assert_eq!(p.get(&(BASE + 9)), None);
    }

    /// `mov 1, %o0; call f; add %o0, 1, %o0; add %o0, 10, %o0; halt: ba,a halt; nop;
    /// f: retl; add %o0, 100, %o0` (from sparc64-linux-gnu-as).
    const SPARC_CALL_RETL: [u32; 8] = [
        0x9010_2001,
        0x4000_0005,
        0x9002_2001,
        0x9002_200a,
        0x3080_0000,
        0x0100_0000,
        0x81c3_e008,
        0x9002_2064,
    ];
    const SPARC_BASE: u64 = 0x100_0000;

    fn sparc_machine() -> UnicornMachine {
        let code: Vec<u8> = SPARC_CALL_RETL
            .iter()
            .flat_map(|w| w.to_be_bytes())
            .collect();
        let mut m = UnicornMachine::new(Isa::Sparc64).unwrap();
        m.map(SPARC_BASE, 0x2000).unwrap();
        m.write(SPARC_BASE, &code).unwrap();
        m.set_pc(VCPU, SPARC_BASE).unwrap();
        m.set_halt(Some(SPARC_BASE + 0x10)).unwrap();
        m
    }

    fn o0(m: &mut UnicornMachine) -> u64 {
        match m.registers(VCPU).unwrap() {
            RegisterFile::Sparc64(r) => r.r[8],
            RegisterFile::X86_64(_) => unreachable!(),
        }
    }

    #[test]
    fn sparc_retl_delay_slot_survives_profile_and_budget_and_halts() {
        // Both Unicorn bugs worked around: a code hook over the retl's delay slot (the
        // profile, Unicorn's own count) and an exit at the halt address (spins).
        let mut m = sparc_machine();
        m.set_budget(1000);
        m.start_profile().unwrap();

        let end = m.run().unwrap();
        let p = m.take_profile().unwrap();

        assert_eq!(end, RunEnd::Halted(SPARC_BASE + 0x10));
        assert_eq!(o0(&mut m), 112);
        for (i, expected) in [1, 1, 1, 1, 0, 0, 1, 1].into_iter().enumerate() {
            let got = p.get(&(SPARC_BASE + 4 * i as u64)).copied().unwrap_or(0);
            assert_eq!(got, expected, "instruction {i}");
        }
    }

    #[test]
    fn sparc_budget_stops_at_a_block_boundary() {
        let mut m = sparc_machine();
        m.set_budget(3);

        let end = m.run().unwrap();

        // mov, call, delay slot: one block; f is the next.
        assert_eq!(end, RunEnd::BudgetExhausted(SPARC_BASE + 0x18));
        assert_eq!(o0(&mut m), 2);
    }

    #[test]
    fn unmapped_access_is_a_fault_and_memory_errors_are_clear() {
        // mov rax, [0]
        let code = [0x48, 0x8b, 0x04, 0x25, 0, 0, 0, 0];
        let mut m = machine_with(&code);

        let end = m.run().unwrap();
        let mut buf = [0u8; 4];
        let err = m.read_virt(VCPU, 0x1000, &mut buf).unwrap_err();

        // A page fault with no IDT: Unicorn reports the resulting #DF (8) or #PF (14).
        assert!(
            matches!(
                end,
                RunEnd::Interrupt {
                    pc: BASE,
                    number: 8 | 14
                }
            ),
            "{end:?}"
        );
        assert!(matches!(err, ControlError::Memory { addr: 0x1000, .. }));
    }
}
