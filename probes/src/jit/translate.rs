//! Translation: kernel functions copied block by block into the code cache, with a
//! counter incremented at every block leader.
//!
//! Per instruction of a block:
//! - ordinary instructions are relocated ([`crate::splice::reloc`]: RIP-relative operands
//!   re-aimed);
//! - direct jumps and conditional jumps become their rel32 forms, linked to the target's
//!   translation when it has one, else to the original address (`jrcxz`/`loop` get a
//!   rel8 hop over a `jmp rel32`);
//! - a direct call becomes `push <original return address>; jmp <callee>`, the callee
//!   being its translation when it is in the translated set, else the original; a direct
//!   call to a *native leaf* (a callee that is not translated and calls nothing, such as
//!   `__memset` in a kernel that keeps it in its `noinstr` text) stays a plain `call`, so
//!   that it returns into the cache ([`Translator::with_native_leaves`]);
//! - an indirect call becomes `push <original return address>; push <operand>; jmp
//!   dispatch`, an indirect jump `push <operand>; jmp dispatch`, and a return (`ret`, or
//!   `jmp __x86_return_thunk`) `jmp dispatch` ([`super::lookup`]).
//!
//! **Why original return addresses.** Every return address a translated call (but a call to
//! a native leaf) pushes is
//! the one the untranslated call would have pushed, so the stack holds exactly the words
//! it holds without the JIT: the kernel's ORC unwinder (`/proc/PID/stack`, WARN
//! backtraces, perf), `__builtin_return_address` users (`_RET_IP_`, lockdep, kmalloc
//! caller tracking), stack-protector and ftrace's return-address logic all see kernel
//! text. The price is a lookup per return: the translated `ret` finds the caller's
//! translation through the table (every translated instruction is in it, so jump tables
//! and returns land on their translation); a return to code that is not translated simply
//! lands there. What the stack cannot show: a vCPU interrupted while in the cache has a
//! cache address in its interrupt frame until it returns there (see the module note on
//! detaching in [`super`]).
//!
//! **Where translated code leaves the cache** ([`ExitReason`]): instructions the kernel
//! finds by address (exception-table entries, i.e. user accesses; `ud2`/`int3` of
//! BUG/WARN and the kernel's own kprobes) jump back to their original address and run
//! there, as does anything the translator cannot reproduce (far or special branches,
//! `iret`/`sysret`/`ret imm16`, undecodable bytes, an operand the relocator refuses, an
//! indirect call through `rsp`). From there the kernel runs its own code; the next entry
//! into a translated function (its entry splice, a translated return) comes back.
//!
//! **Counters** ([`CounterMode`]). By default one counter a block, shared by every CPU:
//! `lock inc qword [rip+counter]`. In a live guest, one copy of the counters per CPU
//! instead, reached through the kernel's own per-CPU base: `inc qword gs:[counter+delta]`,
//! as the kernel's `this_cpu_inc` does. One instruction, so neither an interrupt nor a
//! migration splits it, and no other CPU writes that copy: exact without a `lock`. Under
//! QEMU TCG every atomic read-modify-write is an out-of-line helper call, and a profile of
//! the JIT bench showed that helper (and its TLB lookup) taking about a fifth of the time
//! the guest spent in the cache; the plain `inc` is an inline load and store.
//!
//! **Flags.** The counter's `inc` stands alone where liveness says no status flag but CF
//! (which `inc` keeps) is live at the leader; elsewhere the status flags are kept in `rax`
//! around it (`push rax; lahf; seto al; inc; add al, 0x7f; sahf; pop rax`), never with
//! `pushfq`/`popfq` (`popfq` ends QEMU's translated block, and is the slower of the two on
//! hardware). This needs LAHF/SAHF in 64-bit mode (CPUID `LAHF_LM`), which every x86-64 CPU
//! but the first steppings of 2003-2005 has; the live JIT checks the guest's CPU for it.
//! The dispatch routine writes no flag at all ([`super::lookup`]).
//!
//! **Cache full.** A function whose code, counters or table entries do not fit is not
//! translated at all; the translator says so ([`CacheError`]) and refuses every later
//! function; what was translated stays consistent (calls to the untranslated function
//! go to its original code).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};

use exotap_introspect::x86::{CodeView, Flow, FunctionAnalysis, Insn, StatusFlags};
use iced_x86::{Code, Encoder, FlowControl, Instruction, Register};

use super::cache::{Bump, CacheError, CacheLayout};
use super::lookup::{dispatch_routine, LookupError, LookupTable};
use crate::splice::reloc::{decode_one, relocate, CallReturn};

/// Test-only fault injection into the translator, to prove that the JIT regression
/// (`exotap regress --jit`) detects translated code that silently leaves the cache. Only
/// built with the `fault-injection` feature, which only the regression's own tests enable.
#[cfg(feature = "fault-injection")]
pub mod fault {
    use std::sync::atomic::{AtomicBool, Ordering};

    static UNLINKED_CONDITIONAL_JUMPS: AtomicBool = AtomicBool::new(false);

    /// Makes every later translation send taken conditional jumps to their original
    /// target instead of its translation (process-wide), or stops doing so: the kernel
    /// computes the same, but blocks run outside the cache uncounted.
    pub fn set_unlinked_conditional_jumps(on: bool) {
        UNLINKED_CONDITIONAL_JUMPS.store(on, Ordering::SeqCst);
    }

    pub(crate) fn unlinked_conditional_jumps() -> bool {
        UNLINKED_CONDITIONAL_JUMPS.load(Ordering::SeqCst)
    }
}

/// Errors of translation.
#[derive(Debug, thiserror::Error)]
pub enum TranslateError {
    /// The cache (code, counters or table) is full: nothing more is translated.
    #[error("the code cache cannot take the function at {start:#x}")]
    Full {
        /// The function refused.
        start: u64,
        /// Which part ran out.
        #[source]
        source: CacheError,
    },
    /// The layout is unusable.
    #[error("the code cache layout is unusable")]
    Layout(#[source] CacheError),
    /// The lookup table or dispatch routine cannot be built.
    #[error("the lookup table cannot be built")]
    Lookup(#[from] LookupError),
    /// The function is more than 2 GiB away from the cache.
    #[error("the function at {start:#x} is out of rel32 reach of the code cache")]
    OutOfReach {
        /// The function.
        start: u64,
    },
    /// The function has no decoded instruction, or its bytes are not in the view.
    #[error("the function at {start:#x} has no instructions in the given text")]
    NoCode {
        /// The function.
        start: u64,
    },
    /// A per-CPU counter's `gs` displacement does not fit a signed 32-bit displacement.
    #[error("the per-CPU counter at {counter:#x} is out of reach of a gs displacement")]
    CounterOutOfReach {
        /// The counter (its first CPU's copy, in the cache's address space).
        counter: u64,
    },
    /// A link target is out of rel32 reach of the branch that needs it.
    #[error("the link from {from:#x} to {to:#x} does not fit a rel32")]
    LinkOutOfReach {
        /// The branch's end.
        from: u64,
        /// The target.
        to: u64,
    },
}

/// Why translated code leaves the cache at an instruction (it runs at its original
/// address instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExitReason {
    /// The instruction has an exception-table entry (a user access): its fixup is found
    /// by address.
    ExceptionTable,
    /// A trapping instruction (`ud2`, `int3`, `int n`): BUG/WARN and kprobes find it by
    /// address.
    Trap,
    /// A branch without a translation: far, `xbegin`, an indirect call through `rsp`.
    SpecialBranch,
    /// `iret`, `sysret`, `ret imm16`.
    SpecialReturn,
    /// Bytes that do not decode.
    Undecodable,
    /// An operand the relocator refuses.
    Unrelocatable,
}

/// A place where translated code jumps back to original code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheExit {
    /// The original instruction that runs in place.
    pub addr: u64,
    /// Why.
    pub reason: ExitReason,
}

/// How each block's counter is incremented (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CounterMode {
    /// One counter for every CPU: `lock inc qword [rip+counter]`.
    #[default]
    Shared,
    /// One copy of the counters per CPU: `inc qword gs:[counter + gs_delta]` (wrapping), so
    /// that CPU `n`'s copy of a counter is at `counter + gs_delta + gs_base(n)` in the
    /// guest's address space. The caller puts the copies there and sums them.
    PerCpu {
        /// Added to a counter's address (in the cache's layout) to make its displacement.
        gs_delta: u64,
    },
}

/// One counted block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountedBlock {
    /// The function's original entry.
    pub function: u64,
    /// The block leader's original address.
    pub leader: u64,
    /// The counter's guest address (a `u64`).
    pub counter: u64,
    /// Where the block's translation starts (its counter increment).
    pub cache: u64,
    /// Whether the counter keeps the status flags around its `inc` (`lahf`/`sahf`).
    pub saves_flags: bool,
}

/// One translated function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TranslatedFunction {
    /// Original range.
    pub start: u64,
    /// Original end.
    pub end: u64,
    /// The translation's entry.
    pub entry: u64,
    /// Bytes of translated code.
    pub bytes: u64,
    /// Blocks counted.
    pub blocks: usize,
}

/// Everything to write into the guest, and what it means.
#[derive(Debug, Clone)]
pub struct Translation {
    /// Where `code` goes.
    pub code_at: u64,
    /// The dispatch routine, then every translation.
    pub code: Vec<u8>,
    /// Where `table` goes.
    pub table_at: u64,
    /// The lookup table.
    pub table: Vec<u8>,
    /// Entries in the lookup table.
    pub table_entries: usize,
    /// The counters in use (zero them before entering the cache).
    pub counters: std::ops::Range<u64>,
    /// Every counted block, in translation order.
    pub blocks: Vec<CountedBlock>,
    /// Translated functions by original entry.
    pub functions: BTreeMap<u64, TranslatedFunction>,
    /// Where translated code leaves the cache.
    pub exits: Vec<CacheExit>,
    /// Why translation stopped early, if it did.
    pub full: Option<CacheError>,
    /// Lazy-translation stubs: untranslated target → stub address ([`Translator::with_lazy`]).
    pub stubs: BTreeMap<u64, u64>,
}

/// What one [`Translator::link`] adds to a cache whose earlier code is already in the
/// guest: everything translated since the previous link, linked.
#[derive(Debug, Clone, Default)]
pub struct Link {
    /// Where `code` goes (right after the code handed out before).
    pub code_at: u64,
    /// The new translations and stubs.
    pub code: Vec<u8>,
    /// Lookup-table slots written: (guest address, the slot's 16 bytes).
    pub table: Vec<(u64, [u8; 16])>,
    /// New lazy-translation stubs: (untranslated target, stub address).
    pub stubs: Vec<(u64, u64)>,
    /// Blocks translated since the previous link.
    pub blocks: Vec<CountedBlock>,
    /// Functions translated since the previous link.
    pub functions: Vec<TranslatedFunction>,
    /// Cache exits of those functions.
    pub exits: Vec<CacheExit>,
    /// The counters in use now (from the area's start).
    pub counters: std::ops::Range<u64>,
}

/// Bytes of a lazy-translation stub: `jmp rel32` and three `int3`, 8-byte aligned so that
/// the `jmp` lies inside one aligned quadword.
pub const STUB_BYTES: u64 = 8;

/// The 5-byte `jmp rel32` at `stub` that sends a lazy-translation stub to `to` (the
/// target's translation once it has one, the original target before).
#[must_use]
pub fn stub_jump(stub: u64, to: u64) -> Option<[u8; 5]> {
    entry_splice(stub, to)
}

impl Translation {
    /// The translation entry of the function starting at `start`.
    #[must_use]
    pub fn entry(&self, start: u64) -> Option<u64> {
        self.functions.get(&start).map(|f| f.entry)
    }

    /// Block counts from the bytes of the counter area (as read from the guest):
    /// `(leader, count)`, 0 for counters the bytes do not cover.
    #[must_use]
    pub fn counts(&self, counter_bytes: &[u8]) -> Vec<(u64, u64)> {
        self.blocks
            .iter()
            .map(|b| {
                let off = b.counter.wrapping_sub(self.counters.start) as usize;
                let count = counter_bytes
                    .get(off..off.saturating_add(8))
                    .and_then(|s| <[u8; 8]>::try_from(s).ok())
                    .map_or(0, u64::from_le_bytes);
                (b.leader, count)
            })
            .collect()
    }
}

/// The 5-byte splice that sends a function's entry into its translation
/// (`jmp rel32`), or `None` when out of reach.
#[must_use]
pub fn entry_splice(entry: u64, translation: u64) -> Option<[u8; 5]> {
    let rel = i32::try_from(translation.wrapping_sub(entry.wrapping_add(5)) as i64).ok()?;
    let mut b = [0xe9, 0, 0, 0, 0];
    b[1..].copy_from_slice(&rel.to_le_bytes());
    Some(b)
}

/// A rel32 to fill in when every translation is known.
#[derive(Debug, Clone, Copy)]
struct Fixup {
    /// Offset of the rel32 field in the code.
    at: usize,
    /// The original target.
    target: u64,
    /// Go to the target's translation if it has one (else: always the original).
    link: bool,
}

/// One function's translation before it is committed.
#[derive(Debug, Default)]
struct Pending {
    base: u64,
    bytes: Vec<u8>,
    fixups: Vec<Fixup>,
    map: Vec<(u64, u64)>,
    dispatch_targets: Vec<u64>,
    blocks: Vec<CountedBlock>,
    exits: Vec<CacheExit>,
}

impl Pending {
    fn here(&self) -> u64 {
        self.base + self.bytes.len() as u64
    }

    fn rel32_to(&mut self, target: u64, link: bool) {
        self.fixups.push(Fixup {
            at: self.bytes.len(),
            target,
            link,
        });
        self.bytes.extend_from_slice(&[0; 4]);
    }

    fn jmp(&mut self, target: u64, link: bool) {
        self.bytes.push(0xe9);
        self.rel32_to(target, link);
    }

    /// `jmp` to a known cache address (the dispatch routine).
    fn jmp_known(&mut self, to: u64) -> Result<(), TranslateError> {
        let from = self.here() + 5;
        let rel = i32::try_from(to.wrapping_sub(from) as i64)
            .map_err(|_| TranslateError::LinkOutOfReach { from, to })?;
        self.bytes.push(0xe9);
        self.bytes.extend_from_slice(&rel.to_le_bytes());
        Ok(())
    }

    /// Leaves the cache: the instruction at `addr` runs at its own address. The block's
    /// later instructions are still translated (the stub never falls into them, but a
    /// jump table or a return may enter them: `jmp *%rax; int3; <case>`).
    fn leave(&mut self, addr: u64, reason: ExitReason) -> bool {
        self.exits.push(CacheExit { addr, reason });
        self.jmp(addr, false);
        true
    }

    /// `push imm32` of a return address (and a fix of its high half when it does not
    /// sign-extend from 32 bits). No flags change.
    fn push_u64(&mut self, value: u64) {
        let low = value as u32;
        self.bytes.push(0x68);
        self.bytes.extend_from_slice(&low.to_le_bytes());
        if i64::from(low as i32) as u64 != value {
            self.bytes.extend_from_slice(&[0xc7, 0x44, 0x24, 0x04]);
            self.bytes
                .extend_from_slice(&((value >> 32) as u32).to_le_bytes());
        }
    }

    /// `lock inc qword [rip+counter]`, or `inc qword gs:[disp32]` for per-CPU counters;
    /// when flags are live, with the status flags kept in `rax` around it (`push rax;
    /// lahf; seto al` ... `add al, 0x7f; sahf; pop rax`: `inc` changes only status flags,
    /// and `popfq` would end QEMU's translated block and costs more on hardware too).
    fn count(
        &mut self,
        counter: u64,
        save_flags: bool,
        mode: CounterMode,
    ) -> Result<(), TranslateError> {
        if save_flags {
            self.bytes.extend_from_slice(&SAVE_STATUS_FLAGS);
        }
        match mode {
            CounterMode::Shared => {
                let end = self.here() + 8;
                let disp = i32::try_from(counter.wrapping_sub(end) as i64).map_err(|_| {
                    TranslateError::LinkOutOfReach {
                        from: end,
                        to: counter,
                    }
                })?;
                self.bytes.extend_from_slice(&[0xf0, 0x48, 0xff, 0x05]);
                self.bytes.extend_from_slice(&disp.to_le_bytes());
            }
            CounterMode::PerCpu { gs_delta } => {
                let disp = gs_displacement(counter, gs_delta)?;
                // gs, REX.W, inc r/m64 (ff /0), ModRM 00 000 100 (SIB), SIB: no index, no
                // base (disp32).
                self.bytes
                    .extend_from_slice(&[0x65, 0x48, 0xff, 0x04, 0x25]);
                self.bytes.extend_from_slice(&disp.to_le_bytes());
            }
        }
        if save_flags {
            self.bytes.extend_from_slice(&RESTORE_STATUS_FLAGS);
        }
        Ok(())
    }
}

/// The `gs` displacement of a per-CPU counter.
fn gs_displacement(counter: u64, gs_delta: u64) -> Result<i32, TranslateError> {
    i32::try_from(counter.wrapping_add(gs_delta) as i64)
        .map_err(|_| TranslateError::CounterOutOfReach { counter })
}

/// `push rax; lahf; seto al`: the status flags into `ah` (SF ZF AF PF CF) and `al` (OF).
const SAVE_STATUS_FLAGS: [u8; 5] = [0x50, 0x9f, 0x0f, 0x90, 0xc0];

/// `add al, 0x7f; sahf; pop rax`: OF back from `al` (0x7f + 1 overflows, 0x7f + 0 does not),
/// the others from `ah`, then `rax`.
const RESTORE_STATUS_FLAGS: [u8; 4] = [0x04, 0x7f, 0x9e, 0x58];

/// Translates functions into one code cache; [`Translator::finish`] links them.
#[derive(Debug)]
pub struct Translator<'k> {
    layout: CacheLayout,
    counter_mode: CounterMode,
    code: Vec<u8>,
    counters: Bump,
    table: LookupTable,
    dispatch: u64,
    address_keyed: Cow<'k, [u64]>,
    map: HashMap<u64, u64>,
    dispatch_targets: Vec<u64>,
    fixups: Vec<Fixup>,
    blocks: Vec<CountedBlock>,
    functions: BTreeMap<u64, TranslatedFunction>,
    exits: Vec<CacheExit>,
    full: Option<CacheError>,
    /// Retpoline thunks (`__x86_indirect_thunk_rax`, ...) by address, with the register
    /// each jumps through: a call or jump to one is an indirect call or jump through the
    /// lookup table, so a translated callee is entered in the cache.
    thunks: HashMap<u64, Register>,
    /// Functions that are not translated and call nothing ([`Translator::with_native_leaves`]):
    /// a direct call to one pushes the cache's return address.
    native_leaves: HashSet<u64>,
    /// Function starts a direct call or jump may reach before they are translated: such a
    /// branch goes to a stub ([`Translator::with_lazy`]).
    lazy: HashSet<u64>,
    /// Stub per lazily reachable target not translated when a branch to it was linked.
    stubs: BTreeMap<u64, u64>,
    /// Stubs made since the last link.
    new_stubs: Vec<(u64, u64)>,
    /// Code bytes, blocks and exits handed out by earlier links.
    linked: (usize, usize, usize),
    /// Functions translated since the last link.
    new_functions: Vec<u64>,
}

/// `push r64`.
fn push_register(p: &mut Pending, reg: Register) -> bool {
    let n = reg.number();
    if !reg.is_gpr64() {
        return false;
    }
    if n >= 8 {
        p.bytes.push(0x41);
    }
    p.bytes.push(0x50 + (n as u8 & 7));
    true
}

fn fits_rel32(a: u64, b: u64) -> bool {
    i32::try_from(b.wrapping_sub(a) as i64).is_ok()
}

fn uses_rsp(instr: &Instruction) -> bool {
    instr.memory_base() == Register::RSP
        || instr.memory_index() == Register::RSP
        || (instr.op_count() > 0
            && instr.op0_kind() == iced_x86::OpKind::Register
            && instr.op0_register() == Register::RSP)
}

impl<'k> Translator<'k> {
    /// A translator over `layout`; `address_keyed` (sorted) lists instructions the kernel
    /// finds by address (exception and bug tables), which run in place.
    ///
    /// # Errors
    /// An unusable layout; a table region under two slots.
    pub fn new(layout: CacheLayout, address_keyed: &'k [u64]) -> Result<Self, TranslateError> {
        Self::with_keyed(layout, Cow::Borrowed(address_keyed))
    }

    /// As [`Translator::new`], owning the list (a translator that lives on with the cache,
    /// for lazy translation).
    ///
    /// # Errors
    /// As [`Translator::new`].
    pub fn new_owned(
        layout: CacheLayout,
        address_keyed: Vec<u64>,
    ) -> Result<Translator<'static>, TranslateError> {
        Translator::with_keyed(layout, Cow::Owned(address_keyed))
    }

    fn with_keyed(
        layout: CacheLayout,
        address_keyed: Cow<'k, [u64]>,
    ) -> Result<Self, TranslateError> {
        layout.check().map_err(TranslateError::Layout)?;
        let table = LookupTable::new(layout.table.start, layout.table.end - layout.table.start)?;
        let dispatch = layout.code.start;
        let code = dispatch_routine(dispatch, &table)?;
        if code.len() as u64 > layout.code.end - layout.code.start {
            return Err(TranslateError::Layout(CacheError::CodeFull {
                needed: code.len() as u64,
                left: layout.code.end - layout.code.start,
            }));
        }
        Ok(Self {
            counters: Bump::new(layout.counters.clone()),
            layout,
            counter_mode: CounterMode::Shared,
            code,
            table,
            dispatch,
            address_keyed,
            map: HashMap::new(),
            dispatch_targets: Vec::new(),
            fixups: Vec::new(),
            blocks: Vec::new(),
            functions: BTreeMap::new(),
            exits: Vec::new(),
            full: None,
            thunks: HashMap::new(),
            native_leaves: HashSet::new(),
            lazy: HashSet::new(),
            stubs: BTreeMap::new(),
            new_stubs: Vec::new(),
            linked: (0, 0, 0),
            new_functions: Vec::new(),
        })
    }

    /// Lazy translation: a direct call or jump to one of `starts` (function entries) that
    /// has no translation when it is linked goes to a stub in the cache, a `jmp` to the
    /// original target, 8-byte aligned ([`STUB_BYTES`]). The host stops the guest at a
    /// stub (a breakpoint), translates the target, links ([`Translator::link`]) and turns
    /// the stub into a `jmp` to the translation ([`Translator::resolve`]). A stub no one
    /// stops at runs the original code: correct, uncounted.
    #[must_use]
    pub fn with_lazy(mut self, starts: HashSet<u64>) -> Self {
        self.lazy = starts;
        self
    }

    /// Per-CPU counters ([`CounterMode::PerCpu`]) from the first function translated on.
    ///
    /// # Errors
    /// [`TranslateError::CounterOutOfReach`] when a counter of the layout's counter area
    /// would not have a 32-bit displacement.
    pub fn with_per_cpu_counters(mut self, gs_delta: u64) -> Result<Self, TranslateError> {
        let area = &self.layout.counters;
        for counter in [area.start, area.end.saturating_sub(8).max(area.start)] {
            gs_displacement(counter, gs_delta)?;
        }
        self.counter_mode = CounterMode::PerCpu { gs_delta };
        Ok(self)
    }

    /// How counters are incremented.
    #[must_use]
    pub fn counter_mode(&self) -> CounterMode {
        self.counter_mode
    }

    /// The stub of a lazily reachable target, if one was made.
    #[must_use]
    pub fn stub(&self, target: u64) -> Option<u64> {
        self.stubs.get(&target).copied()
    }

    /// The target whose stub is at `stub`.
    #[must_use]
    pub fn stub_target(&self, stub: u64) -> Option<u64> {
        self.stubs
            .iter()
            .find(|&(_, &s)| s == stub)
            .map(|(&t, _)| t)
    }

    /// The jump that makes `target`'s stub enter its translation: (stub, bytes), when the
    /// target has both.
    #[must_use]
    pub fn resolve(&self, target: u64) -> Option<(u64, [u8; 5])> {
        let stub = self.stub(target)?;
        let entry = self.functions.get(&target)?.entry;
        Some((stub, stub_jump(stub, entry)?))
    }

    /// Whether `start` has a translation.
    #[must_use]
    pub fn translated(&self, start: u64) -> bool {
        self.functions.contains_key(&start)
    }

    /// Forgets the translation of the function at `start` (`end` its original end), so
    /// that [`Translator::translate`] makes a new one (its text changed). The old code
    /// stays where it is; the host sends it to the new translation or the original code.
    pub fn forget(&mut self, start: u64, end: u64) {
        self.functions.remove(&start);
        self.map.retain(|&orig, _| !(start..end).contains(&orig));
    }

    /// The translation entry of a block leader (or any translated instruction).
    #[must_use]
    pub fn cache_of(&self, original: u64) -> Option<u64> {
        self.map.get(&original).copied()
    }

    /// Links everything translated since the last link (the first link: since the start,
    /// the dispatch routine included) and hands it out: code to append in the guest,
    /// table slots to write, new stubs to stop at.
    ///
    /// # Errors
    /// A link out of rel32 reach; a table that overflows (not expected).
    pub fn link(&mut self) -> Result<Link, TranslateError> {
        self.link_pending()?;
        let (code, blocks, exits) = self.linked;
        let link = Link {
            code_at: self.layout.code.start + code as u64,
            code: self.code[code..].to_vec(),
            table: self.table.take_changed(),
            stubs: std::mem::take(&mut self.new_stubs),
            blocks: self.blocks[blocks..].to_vec(),
            functions: std::mem::take(&mut self.new_functions)
                .into_iter()
                .filter_map(|f| self.functions.get(&f).copied())
                .collect(),
            exits: self.exits[exits..].to_vec(),
            counters: self.layout.counters.start..self.counters.here(),
        };
        self.linked = (self.code.len(), self.blocks.len(), self.exits.len());
        Ok(link)
    }

    /// Entries in the lookup table.
    #[must_use]
    pub fn table_entries(&self) -> usize {
        self.table.len()
    }

    /// The stub for `target`, made now if it is lazily reachable and the code area has
    /// room; else `target` itself.
    fn stub_for(&mut self, target: u64) -> u64 {
        if let Some(&stub) = self.stubs.get(&target) {
            return stub;
        }
        if !self.lazy.contains(&target) || self.full.is_some() {
            return target;
        }
        let here = self.layout.code.start + self.code.len() as u64;
        let at = here.next_multiple_of(STUB_BYTES);
        let Some(jump) = stub_jump(at, target) else {
            return target;
        };
        if at + STUB_BYTES > self.layout.code.end {
            return target;
        }
        self.code
            .resize(self.code.len() + (at - here) as usize, 0xcc);
        self.code.extend_from_slice(&jump);
        self.code
            .extend_from_slice(&[0xcc; (STUB_BYTES - 5) as usize]);
        self.stubs.insert(target, at);
        self.new_stubs.push((target, at));
        at
    }

    /// Treats a call or jump to one of `thunks` (retpoline thunks by address, with the
    /// register each jumps through) as an indirect call or jump through that register:
    /// it goes through the lookup table like `call *%rax`, so a translated target is
    /// entered in the cache rather than run from its original code.
    #[must_use]
    pub fn with_thunks(mut self, thunks: HashMap<u64, Register>) -> Self {
        self.thunks = thunks;
        self
    }

    /// Direct calls to these functions (not translated, and calling nothing: `__memset`,
    /// which a kernel may keep in its `noinstr` text) are made from the cache with a plain
    /// `call`, so that they return into the cache: with the original return address pushed,
    /// the callee's own `ret` would land in the caller's original code, and the rest of the
    /// caller (and of every translated caller above it) would run uncounted. The one place
    /// where a stack then holds a cache address: inside such a leaf, which neither calls nor
    /// sleeps; a task interrupted there is the case of a task interrupted in the cache
    /// (see [`super`]). The caller decides what is a leaf (the live JIT: no call, no
    /// indirect jump, no self-patched byte, tail jumps only to such leaves).
    #[must_use]
    pub fn with_native_leaves(mut self, leaves: HashSet<u64>) -> Self {
        self.native_leaves = leaves;
        self
    }

    /// The dispatch routine's address.
    #[must_use]
    pub fn dispatch(&self) -> u64 {
        self.dispatch
    }

    /// Why the cache stopped taking functions, if it did.
    #[must_use]
    pub fn full(&self) -> Option<&CacheError> {
        self.full.as_ref()
    }

    /// Translates one function (bytes from `text`). A function already translated is
    /// left as it is.
    ///
    /// # Errors
    /// [`TranslateError::Full`] (now and for every later call), out of reach, no code.
    pub fn translate(
        &mut self,
        text: CodeView<'_>,
        function: &FunctionAnalysis,
    ) -> Result<(), TranslateError> {
        let cfg = &function.cfg;
        let start = cfg.start();
        if let Some(full) = &self.full {
            return Err(TranslateError::Full {
                start,
                source: full.clone(),
            });
        }
        if self.functions.contains_key(&start) {
            return Ok(());
        }
        if cfg.blocks().is_empty() {
            return Err(TranslateError::NoCode { start });
        }
        let code_area = &self.layout.code;
        if ![code_area.start, code_area.end]
            .iter()
            .all(|&c| fits_rel32(c, start) && fits_rel32(c, cfg.end()))
        {
            return Err(TranslateError::OutOfReach { start });
        }
        let mut p = Pending {
            base: code_area.start + self.code.len() as u64,
            ..Pending::default()
        };
        let counter_base = self.counters.here();
        let blocks = cfg.blocks();
        for (b, block) in blocks.iter().enumerate() {
            let insns = cfg.block_insns(block);
            let Some(first) = insns.first() else {
                continue;
            };
            let live = function.liveness.block_entry(b).flags;
            let save_flags = !live.minus(StatusFlags::CF).is_empty();
            let counter = counter_base + 8 * p.blocks.len() as u64;
            let cache = p.here();
            p.map.push((first.addr, cache));
            p.blocks.push(CountedBlock {
                function: start,
                leader: first.addr,
                counter,
                cache,
                saves_flags: save_flags,
            });
            p.count(counter, save_flags, self.counter_mode)?;
            let mut goes_on = true;
            for (i, insn) in insns.iter().enumerate() {
                goes_on = self.insn(&mut p, text, insn, i == 0)?;
                if !goes_on {
                    break;
                }
            }
            let last_end = insns.last().map_or(first.addr, Insn::end);
            let next_leader = blocks
                .get(b + 1)
                .and_then(|n| cfg.insns().get(n.first as usize))
                .map(|i| i.addr);
            if goes_on && next_leader != Some(last_end) {
                p.jmp(last_end, true);
            }
        }
        self.commit(start, cfg.end(), p)
    }

    /// Translates one instruction; whether the block goes on after it.
    fn insn(
        &self,
        p: &mut Pending,
        text: CodeView<'_>,
        insn: &Insn,
        leader: bool,
    ) -> Result<bool, TranslateError> {
        let addr = insn.addr;
        if !leader {
            p.map.push((addr, p.here()));
        }
        if self.address_keyed.binary_search(&addr).is_ok() {
            return Ok(p.leave(addr, ExitReason::ExceptionTable));
        }
        let Some(bytes) = text.range(addr, insn.end()) else {
            return Ok(p.leave(addr, ExitReason::Undecodable));
        };
        let Ok(instr) = decode_one(bytes, addr) else {
            return Ok(p.leave(addr, ExitReason::Undecodable));
        };
        let next = insn.end();
        let code = instr.code();
        Ok(match insn.flow {
            Flow::Next => {
                if matches!(
                    instr.flow_control(),
                    FlowControl::Interrupt | FlowControl::Exception
                ) {
                    return Ok(p.leave(addr, ExitReason::Trap));
                }
                if instr.flow_control() == FlowControl::XbeginXabortXend {
                    return Ok(p.leave(addr, ExitReason::SpecialBranch));
                }
                match relocate(bytes, addr, p.here(), CallReturn::Patch) {
                    Ok(r) => {
                        p.bytes.extend_from_slice(&r.bytes);
                        #[cfg(feature = "fault-injection")]
                        {
                            let at = p.bytes.len() - r.bytes.len();
                            crate::splice::reloc::fault::apply(
                                &mut p.bytes,
                                at,
                                r.bytes.len(),
                                r.new_ip,
                            );
                        }
                        true
                    }
                    Err(_) => p.leave(addr, ExitReason::Unrelocatable),
                }
            }
            Flow::Call { target } if code == Code::Call_rel32_64 => {
                if let Some(&reg) = self.thunks.get(&target) {
                    p.push_u64(next);
                    if !push_register(p, reg) {
                        return Ok(p.leave(addr, ExitReason::Unrelocatable));
                    }
                    p.jmp_known(self.dispatch)?;
                    p.dispatch_targets.push(next);
                    return Ok(true);
                }
                if self.native_leaves.contains(&target) {
                    // `call` the original: its `ret` comes back here, to the translation
                    // of `next` that follows.
                    p.bytes.push(0xe8);
                    p.rel32_to(target, false);
                    p.dispatch_targets.push(next);
                    return Ok(true);
                }
                p.push_u64(next);
                p.jmp(target, true);
                p.dispatch_targets.push(next);
                true
            }
            Flow::IndirectCall if code == Code::Call_rm64 && !uses_rsp(&instr) => {
                p.push_u64(next);
                if !self.push_operand(p, &instr) {
                    return Ok(p.leave(addr, ExitReason::Unrelocatable));
                }
                p.jmp_known(self.dispatch)?;
                p.dispatch_targets.push(next);
                true
            }
            Flow::TailJump { target }
                if matches!(code, Code::Jmp_rel8_64 | Code::Jmp_rel32_64)
                    && self.thunks.contains_key(&target) =>
            {
                let Some(&reg) = self.thunks.get(&target) else {
                    return Ok(p.leave(addr, ExitReason::SpecialBranch));
                };
                if !push_register(p, reg) {
                    return Ok(p.leave(addr, ExitReason::Unrelocatable));
                }
                p.jmp_known(self.dispatch)?;
                false
            }
            Flow::Jump { target } | Flow::TailJump { target }
                if matches!(code, Code::Jmp_rel8_64 | Code::Jmp_rel32_64) =>
            {
                p.jmp(target, true);
                false
            }
            Flow::CondJump { target } | Flow::CondTailJump { target } => {
                if instr.is_jcc_short_or_near() {
                    let cc = (instr.condition_code() as u8).wrapping_sub(1) & 0xf;
                    p.bytes.extend_from_slice(&[0x0f, 0x80 | cc]);
                    #[cfg(feature = "fault-injection")]
                    let link = !fault::unlinked_conditional_jumps();
                    #[cfg(not(feature = "fault-injection"))]
                    let link = true;
                    p.rel32_to(target, link);
                    true
                } else if instr.is_jcx_short() || instr.is_loop() || instr.is_loopcc() {
                    // `jrcxz/loop +2; jmp short +5; jmp rel32 target`.
                    let (opcode, _) = bytes.split_at(bytes.len() - 1);
                    p.bytes.extend_from_slice(opcode);
                    p.bytes.extend_from_slice(&[0x02, 0xeb, 0x05]);
                    p.jmp(target, true);
                    true
                } else {
                    p.leave(addr, ExitReason::SpecialBranch)
                }
            }
            Flow::IndirectJump if code == Code::Jmp_rm64 => {
                if !self.push_operand(p, &instr) {
                    return Ok(p.leave(addr, ExitReason::Unrelocatable));
                }
                p.jmp_known(self.dispatch)?;
                false
            }
            Flow::Return
                if matches!(code, Code::Retnq | Code::Jmp_rel8_64 | Code::Jmp_rel32_64) =>
            {
                p.jmp_known(self.dispatch)?;
                false
            }
            Flow::Return => p.leave(addr, ExitReason::SpecialReturn),
            Flow::Invalid => p.leave(addr, ExitReason::Undecodable),
            _ => p.leave(addr, ExitReason::SpecialBranch),
        })
    }

    /// `push <the operand of an indirect call or jump>` at the pending end. For a memory
    /// operand through `rsp` the address is taken before the push moves `rsp`, as the
    /// jump would have taken it.
    fn push_operand(&self, p: &mut Pending, instr: &Instruction) -> bool {
        let mut push = *instr;
        push.set_code(Code::Push_rm64);
        let mut encoder = Encoder::new(64);
        match encoder.encode(&push, p.here()) {
            Ok(_) => {
                p.bytes.extend_from_slice(&encoder.take_buffer());
                true
            }
            Err(_) => false,
        }
    }

    fn commit(&mut self, start: u64, end: u64, mut p: Pending) -> Result<(), TranslateError> {
        let code_left = self.layout.code.end - p.base;
        let full = if p.bytes.len() as u64 > code_left {
            Some(CacheError::CodeFull {
                needed: p.bytes.len() as u64,
                left: code_left,
            })
        } else if (p.blocks.len() as u64) * 8 > self.counters.left() {
            Some(CacheError::CountersFull {
                needed: p.blocks.len() as u64,
                left: self.counters.left() / 8,
            })
        } else {
            let left = (self.table.slots() / 2)
                .saturating_sub(self.table.len() + self.dispatch_targets.len());
            let needed = p.dispatch_targets.len() + p.map.len();
            (needed > left).then_some(CacheError::TableFull { needed, left })
        };
        if let Some(source) = full {
            tracing::warn!("the code cache is full ({source}); no more functions are translated");
            self.full = Some(source.clone());
            return Err(TranslateError::Full { start, source });
        }
        let _ = self.counters.take(p.blocks.len() as u64 * 8);
        // Every translated instruction is a dispatch target: jump tables land on
        // instructions that are not CFG leaders.
        p.dispatch_targets
            .extend(p.map.iter().map(|&(orig, _)| orig));
        let offset = self.code.len();
        self.new_functions.push(start);
        self.functions.insert(
            start,
            TranslatedFunction {
                start,
                end,
                entry: p.base,
                bytes: p.bytes.len() as u64,
                blocks: p.blocks.len(),
            },
        );
        self.code.extend_from_slice(&p.bytes);
        self.fixups.extend(p.fixups.into_iter().map(|f| Fixup {
            at: f.at + offset,
            ..f
        }));
        self.map.extend(p.map);
        self.dispatch_targets.extend(p.dispatch_targets);
        self.blocks.extend(p.blocks);
        self.exits.extend(p.exits);
        Ok(())
    }

    /// Links every branch to its target's translation (or original) and fills the
    /// lookup table.
    ///
    /// # Errors
    /// A link out of rel32 reach; a table that overflows (not expected: checked per
    /// function).
    pub fn finish(mut self) -> Result<Translation, TranslateError> {
        self.link_pending()?;
        Ok(self.snapshot())
    }

    /// Everything translated and linked so far, as [`Translator::finish`] gives it, with the
    /// translator kept for more (call [`Translator::link`] first).
    #[must_use]
    pub fn snapshot(&self) -> Translation {
        Translation {
            code_at: self.layout.code.start,
            code: self.code.clone(),
            table_at: self.table.addr(),
            table_entries: self.table.len(),
            table: self.table.to_bytes(),
            counters: self.layout.counters.start..self.counters.here(),
            blocks: self.blocks.clone(),
            functions: self.functions.clone(),
            exits: self.exits.clone(),
            full: self.full.clone(),
            stubs: self.stubs.clone(),
        }
    }

    /// Fills in the rel32 of every branch translated since the last link (its target's
    /// translation, a stub, or the original) and enters the new dispatch targets in the
    /// lookup table.
    fn link_pending(&mut self) -> Result<(), TranslateError> {
        let code_at = self.layout.code.start;
        for f in std::mem::take(&mut self.fixups) {
            let to = if !f.link {
                f.target
            } else if let Some(&cache) = self.map.get(&f.target) {
                cache
            } else {
                self.stub_for(f.target)
            };
            let from = code_at + f.at as u64 + 4;
            let rel = i32::try_from(to.wrapping_sub(from) as i64)
                .map_err(|_| TranslateError::LinkOutOfReach { from, to })?;
            if let Some(field) = self.code.get_mut(f.at..f.at + 4) {
                field.copy_from_slice(&rel.to_le_bytes());
            }
        }
        let mut targets = std::mem::take(&mut self.dispatch_targets);
        targets.sort_unstable();
        targets.dedup();
        for target in &targets {
            if let Some(&cache) = self.map.get(target) {
                self.table.insert(*target, cache)?;
            }
        }
        Ok(())
    }

    /// The lookup table's hash and its probe lengths ([`LookupTable::probe_lengths`]).
    #[must_use]
    pub fn table_probe_lengths(&self) -> (super::lookup::Hash, (f64, usize, usize)) {
        (self.table.hash(), self.table.probe_lengths())
    }

    /// Bytes of code used so far (the dispatch routine included).
    #[must_use]
    pub fn code_used(&self) -> u64 {
        self.code.len() as u64
    }

    /// Bytes of counters used so far.
    #[must_use]
    pub fn counters_used(&self) -> u64 {
        self.counters.used()
    }
}

#[cfg(test)]
mod tests;
