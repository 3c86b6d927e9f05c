//! Undoing what an exotap that died left in a guest: the recovery journal in the patch heap,
//! `exotap recover`, and the guardian process that runs recovery when its exotap dies. The binary's
//! `exotap recover` and `exotap guardian` (src/recover.rs) only parse arguments and print.
//!
//! # Why
//! exotap changes a guest in four ways that outlive a killed exotap: `jmp`s spliced into
//! kernel text, return addresses on kernel stacks swapped for trampolines in the patch heap
//! (`time`, compiled `.return` probes, and trap `.return` probes), software breakpoints held
//! by QEMU's gdbstub, and a guest left stopped by the gdbstub when the connection dropped while
//! it was stopped (QEMU does not resume on disconnect; it resumes on `D`). The patch heap
//! itself stays mapped and is never reused while anything points into it.
//!
//! # The journal
//! Before exotap writes a splice it writes, in the patch heap at [`JOURNAL`] (physical
//! offset from the heap's start), a record of what it is about to write and what was there
//! before; before it swaps a return address it records where and what. The journal says who
//! owns the heap (pid and process start time, so a live exotap is never recovered under).
//! Layout of the header page (little-endian u64s):
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic `EXOTAPR1` |
//! | 8 | owner pid (0: none) |
//! | 16 | owner start time (clock ticks since boot, `/proc/PID/stat` field 22) |
//! | 24 | heap virtual address |
//! | 32 | heap size |
//! | 40 | trap-probe return trampoline address (0: none) |
//! | 48 | number of text blocks |
//! | 56 | number of in-flight tables |
//! | 64 | in-flight tables: [`MAX_TABLES`] × (physical address, bytes) |
//! | 256 | text blocks: [`MAX_BLOCKS`] × (physical address, entries) |
//!
//! A text entry ([`TEXT_ENTRY`] bytes) is (physical address, length, original bytes\[8\],
//! written bytes\[8\]); recovery writes the original back where the written bytes still are.
//! An in-flight table is the hash table of swapped return addresses that splice trampolines
//! use (`exotap_probes::compile::site::INFLIGHT`: slots of (stack slot address, original return
//! address)); recovery puts back every return address whose stack slot still points into the
//! heap. Trap `.return` probes keep their swaps at [`RETURNS`] (pairs (stack slot, original),
//! slot 0 = free); a vCPU stopped on their trampoline is moved to the original return address.
//!
//! Order of writes: the journal entry first, then the guest change; at removal the guest
//! change first, then the entry is cleared. A death between the two leaves an entry whose
//! change is absent or already undone: recovery compares the live bytes and skips it.
//!
//! # The guardian
//! The gdbstub takes one client at a time, so the guardian does not sit between exotap and
//! QEMU: it is a child process (its own process group, so a terminal's Ctrl-C does not reach
//! it) that holds a pipe from exotap and waits. exotap sends `clean` when it ends normally;
//! end of file without it means exotap died (SIGKILL, panic, OOM). The guardian then connects
//! to the gdbstub (QEMU accepts it once the dead client's socket is closed), runs the same
//! recovery as `exotap recover`, and detaches, which also removes every breakpoint and lets
//! the guest run. A guest that is gone (QEMU exited) ends the guardian with a message.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use exotap_introspect::paging::{pti_kernel_cr3, AddressSpace};
use exotap_vmm::control::{Machine, RegisterFile};
use exotap_vmm::gdb::GdbMachine;

use super::attach::Attached;
use super::guest_memory::BackendMemory;
use super::kernel_image::KernelImage;

/// Offset of the journal's header page from the patch heap's start.
pub const JOURNAL: u64 = 0x1000;
/// Offset of the trap probes' swapped return addresses.
pub const RETURNS: u64 = 0x2000;
/// Bytes of the trap probes' return journal (it ends below the trap trampoline at 0x8000).
pub const RETURNS_BYTES: u64 = 0x6000;
/// Entries in the trap probes' return journal.
pub const RETURN_SLOTS: usize = (RETURNS_BYTES / 16) as usize;
/// Bytes of one text entry.
pub const TEXT_ENTRY: usize = 32;
/// In-flight tables the header can list.
pub const MAX_TABLES: usize = 8;
/// Text blocks the header can list.
pub const MAX_BLOCKS: usize = 240;

const MAGIC: &[u8; 8] = b"EXOTAPR1";

// The header fits its page, and the return list lies between it and the trap trampoline.
const _: () = {
    assert!(BLOCK_LIST + 16 * MAX_BLOCKS as u64 <= 4096);
    assert!(TABLE_LIST + 16 * MAX_TABLES as u64 <= BLOCK_LIST);
    assert!(RETURNS >= JOURNAL + 4096);
    assert!(RETURNS + RETURNS_BYTES <= 0x8000);
};
const OWNER: u64 = 8;
const HEAP_VA: u64 = 24;
const TRAMPOLINE: u64 = 40;
const BLOCKS: u64 = 48;
const TABLES: u64 = 56;
const TABLE_LIST: u64 = 64;
const BLOCK_LIST: u64 = 256;
/// Passes over the swapped return addresses at most (see [`Journal::recover`]).
const MAX_CHAIN_PASSES: usize = 8;
/// A slot of an in-flight table: (stack slot address, original return address, ...).
const INFLIGHT_SLOT: usize = crate::compile::site::SLOT as usize;

fn word(b: &[u8], o: usize) -> u64 {
    b.get(o..o + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, u64::from_le_bytes)
}

/// This process as the journal names it: pid and start time.
fn me() -> (u64, u64) {
    let pid = std::process::id();
    (u64::from(pid), start_time(pid).unwrap_or(0))
}

/// A process's start time in clock ticks since boot (`/proc/PID/stat` field 22); `None` when
/// it does not exist.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count from the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The recovery journal of one patch heap (see the module doc).
#[derive(Debug, Clone, Copy)]
pub struct Journal {
    /// Physical address of the heap.
    pub heap_phys: u64,
}

/// What an earlier exotap left, and what recovery did about it.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The journal's owner (pid), when there was one.
    pub owner: Option<u64>,
    /// Splices whose original bytes were written back.
    pub splices_removed: usize,
    /// Journal entries whose site already held its original bytes.
    pub already_clean: usize,
    /// Sites that hold neither exotap's bytes nor the original (left alone, named).
    pub foreign: Vec<String>,
    /// Swapped return addresses put back on kernel stacks.
    pub returns_restored: usize,
    /// vCPUs moved off a trap trampoline to their original return address.
    pub vcpus_moved: usize,
}

impl Recovered {
    /// Whether anything was left behind.
    pub fn anything(&self) -> bool {
        self.splices_removed + self.returns_restored + self.vcpus_moved > 0
            || !self.foreign.is_empty()
    }
}

impl std::fmt::Display for Recovered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} splices removed, {} return addresses put back, {} vCPUs moved off a trampoline",
            self.splices_removed, self.returns_restored, self.vcpus_moved
        )?;
        if self.already_clean > 0 {
            write!(f, ", {} journal entries already undone", self.already_clean)?;
        }
        for site in &self.foreign {
            write!(f, "\n  left alone: {site}")?;
        }
        Ok(())
    }
}

impl Journal {
    fn header(&self) -> u64 {
        self.heap_phys + JOURNAL
    }

    fn read_header<M: Machine + ?Sized>(&self, machine: &mut M) -> anyhow::Result<Vec<u8>> {
        let mut h = vec![0u8; 4096];
        machine
            .read_phys(self.header(), &mut h)
            .context("cannot read the recovery journal")?;
        Ok(h)
    }

    fn put<M: Machine + ?Sized>(
        &self,
        machine: &mut M,
        offset: u64,
        value: u64,
    ) -> anyhow::Result<()> {
        machine
            .write_phys(self.header() + offset, &value.to_le_bytes())
            .context("cannot write the recovery journal")
    }

    /// Takes the journal for this process when the heap is mapped (the guest stopped). A
    /// journal an earlier exotap left with work in it is recovered first (saying so); one whose
    /// owner still runs is refused, because both would write the same heap.
    ///
    /// # Errors
    /// Another live exotap owns the heap, or guest memory fails.
    pub fn open<M: Machine + ?Sized>(
        heap_phys: u64,
        heap_va: u64,
        heap_size: u64,
        machine: &mut M,
    ) -> anyhow::Result<Self> {
        let journal = Self { heap_phys };
        let h = journal.read_header(machine)?;
        let (pid, start) = me();
        if h.starts_with(MAGIC) {
            let (owner, owner_start) = (word(&h, 8), word(&h, 16));
            if owner != 0 && owner != pid {
                let alive = u32::try_from(owner)
                    .ok()
                    .and_then(start_time)
                    .is_some_and(|s| s == owner_start);
                if alive {
                    bail!(
                        "exotap (pid {owner}) is using this guest's patch heap at {heap_phys:#x}; \
                         stop it first (two exotaps on one heap would overwrite each other's patches)"
                    );
                }
                let report = journal.recover(machine)?;
                if report.anything() {
                    tracing::warn!(
                        "an earlier exotap (pid {owner}) ended without removing its probes; \
                         recovered first: {report}"
                    );
                }
            } else if owner == pid {
                return Ok(journal);
            }
        }
        let mut fresh = vec![0u8; 4096];
        fresh[..8].copy_from_slice(MAGIC);
        fresh[8..16].copy_from_slice(&pid.to_le_bytes());
        fresh[16..24].copy_from_slice(&start.to_le_bytes());
        fresh[24..32].copy_from_slice(&heap_va.to_le_bytes());
        fresh[32..40].copy_from_slice(&heap_size.to_le_bytes());
        machine.write_phys(journal.header(), &fresh)?;
        machine.write_phys(heap_phys + RETURNS, &vec![0u8; RETURNS_BYTES as usize])?;
        Ok(journal)
    }

    /// Records splices about to be written: `entries` are (physical address, original bytes,
    /// new bytes), at most 8 bytes each; `block` is a heap area of `entries.len() *`
    /// [`TEXT_ENTRY`] bytes at physical `block_phys`.
    ///
    /// # Errors
    /// The header's block list is full, or guest memory fails.
    pub fn record_text<M: Machine + ?Sized>(
        &self,
        machine: &mut M,
        block_phys: u64,
        entries: &[(u64, &[u8], &[u8])],
    ) -> anyhow::Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut buf = vec![0u8; entries.len() * TEXT_ENTRY];
        for (e, (phys, original, new)) in buf.chunks_mut(TEXT_ENTRY).zip(entries) {
            let len = original.len().min(new.len()).min(8);
            e[..8].copy_from_slice(&phys.to_le_bytes());
            e[8..16].copy_from_slice(&(len as u64).to_le_bytes());
            e[16..16 + len].copy_from_slice(&original[..len]);
            e[24..24 + len].copy_from_slice(&new[..len]);
        }
        machine.write_phys(block_phys, &buf)?;
        let h = self.read_header(machine)?;
        let n = word(&h, BLOCKS as usize);
        if n as usize >= MAX_BLOCKS {
            bail!("the recovery journal is full ({MAX_BLOCKS} install batches); remove and install again");
        }
        let at = BLOCK_LIST + 16 * n;
        self.put(machine, at, block_phys)?;
        self.put(machine, at + 8, entries.len() as u64)?;
        self.put(machine, BLOCKS, n + 1)
    }

    /// Forgets every recorded splice (after they were all written back).
    ///
    /// # Errors
    /// Guest memory fails.
    pub fn clear_text<M: Machine + ?Sized>(&self, machine: &mut M) -> anyhow::Result<()> {
        self.put(machine, BLOCKS, 0)
    }

    /// Records an in-flight table of swapped return addresses (physical address, bytes).
    ///
    /// # Errors
    /// The list is full, or guest memory fails.
    pub fn record_table<M: Machine + ?Sized>(
        &self,
        machine: &mut M,
        phys: u64,
        bytes: u64,
    ) -> anyhow::Result<()> {
        let h = self.read_header(machine)?;
        let n = word(&h, TABLES as usize);
        if n as usize >= MAX_TABLES {
            bail!("the recovery journal lists {MAX_TABLES} in-flight tables already");
        }
        let at = TABLE_LIST + 16 * n;
        self.put(machine, at, phys)?;
        self.put(machine, at + 8, bytes)?;
        self.put(machine, TABLES, n + 1)
    }

    /// Forgets the in-flight tables (after their return addresses were put back).
    ///
    /// # Errors
    /// Guest memory fails.
    pub fn clear_tables<M: Machine + ?Sized>(&self, machine: &mut M) -> anyhow::Result<()> {
        self.put(machine, TABLES, 0)
    }

    /// Records the trap probes' return trampoline (0: none).
    ///
    /// # Errors
    /// Guest memory fails.
    pub fn set_trampoline<M: Machine + ?Sized>(
        &self,
        machine: &mut M,
        va: u64,
    ) -> anyhow::Result<()> {
        self.put(machine, TRAMPOLINE, va)
    }

    /// Records (or with `slot` 0, frees) entry `index` of the trap probes' return journal.
    ///
    /// # Errors
    /// `index` out of range, or guest memory fails.
    pub fn set_return<M: Machine + ?Sized>(
        &self,
        machine: &mut M,
        index: usize,
        slot: u64,
        original: u64,
    ) -> anyhow::Result<()> {
        if index >= RETURN_SLOTS {
            bail!("return journal index {index} out of range");
        }
        let mut e = [0u8; 16];
        e[..8].copy_from_slice(&slot.to_le_bytes());
        e[8..].copy_from_slice(&original.to_le_bytes());
        machine
            .write_phys(self.heap_phys + RETURNS + 16 * index as u64, &e)
            .context("cannot write the return journal")
    }

    /// Forgets the trap probes' trampoline and return list (after their swaps were put back).
    ///
    /// # Errors
    /// Guest memory fails.
    pub fn clear_returns<M: Machine + ?Sized>(&self, machine: &mut M) -> anyhow::Result<()> {
        self.put(machine, TRAMPOLINE, 0)?;
        machine
            .write_phys(self.heap_phys + RETURNS, &vec![0u8; RETURNS_BYTES as usize])
            .context("cannot write the return journal")
    }

    /// Whether the journal lists anything to undo (splices, return-address tables, a trap
    /// trampoline); read while the guest runs where the backend allows it.
    ///
    /// # Errors
    /// Guest memory cannot be read.
    pub fn lists_anything<M: Machine + ?Sized>(&self, machine: &mut M) -> anyhow::Result<bool> {
        let h = self.read_header(machine)?;
        Ok(h.starts_with(MAGIC)
            && [BLOCKS, TABLES, TRAMPOLINE]
                .iter()
                .any(|&o| word(&h, o as usize) != 0))
    }

    /// Undoes everything the journal lists (the guest stopped), and empties it.
    ///
    /// # Errors
    /// Guest memory or registers cannot be read or written.
    pub fn recover<M: Machine + ?Sized>(&self, machine: &mut M) -> anyhow::Result<Recovered> {
        let h = self.read_header(machine)?;
        let mut report = Recovered::default();
        if !h.starts_with(MAGIC) {
            return Ok(report);
        }
        report.owner = Some(word(&h, OWNER as usize)).filter(|&p| p != 0);
        let heap_va = word(&h, HEAP_VA as usize);
        let heap_size = word(&h, 32);
        let in_heap = |v: u64| v >= heap_va && v - heap_va < heap_size;
        let trampoline = word(&h, TRAMPOLINE as usize);

        // Trap returns: vCPUs stopped on the trampoline first (their slot was popped already),
        // then every slot still holding the trampoline.
        let mut returns = vec![0u8; RETURNS_BYTES as usize];
        machine.read_phys(self.heap_phys + RETURNS, &mut returns)?;
        let pairs: Vec<(u64, u64)> = returns
            .chunks(16)
            .map(|e| (word(e, 0), word(e, 8)))
            .filter(|&(slot, _)| slot != 0)
            .collect();
        let vcpus = machine.vcpus()?;
        let mut cr3 = None;
        for &vcpu in &vcpus {
            let RegisterFile::X86_64(regs) = machine.registers(vcpu)? else {
                bail!("recovery handles x86-64 guests");
            };
            if cr3.is_none() {
                cr3 = Some((pti_kernel_cr3(regs.cr3), regs.cr4 & (1 << 12) != 0));
            }
            if trampoline != 0 && regs.rip == trampoline {
                let popped = regs.gpr[7].wrapping_sub(8);
                if let Some(&(_, original)) = pairs.iter().find(|p| p.0 == popped) {
                    machine.set_pc(vcpu, original)?;
                    report.vcpus_moved += 1;
                }
            }
        }
        let Some((cr3, la57)) = cr3 else {
            bail!("the guest has no vCPUs");
        };
        let restore = |machine: &mut M,
                       slot: u64,
                       original: u64,
                       ours: &dyn Fn(u64) -> bool|
         -> anyhow::Result<bool> {
            let mut mem = BackendMemory(&mut *machine);
            let mut space = AddressSpace::new(&mut mem, cr3, la57);
            let Ok(now) = space.read_u64(slot) else {
                return Ok(false); // the task and its stack are gone
            };
            if !ours(now) {
                return Ok(false);
            }
            let phys = space.translate(slot)?.phys;
            machine.write_phys(phys, &original.to_le_bytes())?;
            Ok(true)
        };
        let tables = usize::try_from(word(&h, TABLES as usize))?.min(MAX_TABLES);
        let mut in_flight = Vec::new();
        for t in 0..tables {
            let (phys, bytes) = (
                word(&h, TABLE_LIST as usize + 16 * t),
                word(&h, TABLE_LIST as usize + 16 * t + 8),
            );
            let mut table = vec![0u8; usize::try_from(bytes.min(16 << 20))?];
            if machine.read_phys(phys, &mut table).is_err() {
                report.foreign.push(format!(
                    "in-flight table at physical {phys:#x} ({bytes} bytes) cannot be read"
                ));
                continue;
            }
            in_flight.extend(
                table
                    .chunks(INFLIGHT_SLOT)
                    .map(|s| (word(s, 0), word(s, 8)))
                    .filter(|&(slot, _)| slot != 0),
            );
        }
        // A tail call from one probed function into another chains their swaps on one stack
        // slot (the inner call's original is the outer one's trampoline). Within one kind any
        // order ends at the outermost original; across kinds (a host-evaluated probe's call
        // tail-calling a compiled one's, or the reverse) one pass may put back a trampoline
        // of the other kind: passes go on until one finds nothing of exotap's left.
        for _ in 0..MAX_CHAIN_PASSES {
            let mut restored = 0;
            if trampoline != 0 {
                for &(slot, original) in &pairs {
                    if restore(machine, slot, original, &|v| v == trampoline)? {
                        restored += 1;
                    }
                }
            }
            for &(slot, original) in &in_flight {
                if restore(machine, slot, original, &|v| in_heap(v))? {
                    restored += 1;
                }
            }
            report.returns_restored += restored;
            if restored == 0 {
                break;
            }
        }

        // Splices: write back the original bytes where exotap's are still there.
        let blocks = usize::try_from(word(&h, BLOCKS as usize))?.min(MAX_BLOCKS);
        for b in 0..blocks {
            let (phys, n) = (
                word(&h, BLOCK_LIST as usize + 16 * b),
                word(&h, BLOCK_LIST as usize + 16 * b + 8),
            );
            let n = usize::try_from(n.min(1 << 20))?;
            let mut entries = vec![0u8; n * TEXT_ENTRY];
            if machine.read_phys(phys, &mut entries).is_err() {
                report.foreign.push(format!(
                    "journal block at physical {phys:#x} ({n} entries) cannot be read"
                ));
                continue;
            }
            for e in entries.chunks(TEXT_ENTRY) {
                let (at, len) = (word(e, 0), usize::try_from(word(e, 8).min(8))?);
                let (original, new) = (&e[16..16 + len], &e[24..24 + len]);
                let mut now = vec![0u8; len];
                if machine.read_phys(at, &mut now).is_err() {
                    report
                        .foreign
                        .push(format!("physical {at:#x} cannot be read"));
                    continue;
                }
                if now == new {
                    machine.write_phys(at, original)?;
                    report.splices_removed += 1;
                } else if now == original {
                    report.already_clean += 1;
                } else {
                    report.foreign.push(format!(
                        "physical {at:#x}: exotap wrote {}, it holds {}",
                        hex(new),
                        hex(&now)
                    ));
                }
            }
        }
        // The trap trampoline parks a vCPU (`jmp .`) while exotap is attached; with every
        // return address back, a return into it is a bug to be loud about (`ud2`).
        if trampoline != 0 && in_heap(trampoline) {
            machine.write_phys(self.heap_phys + (trampoline - heap_va), &[0x0f, 0x0b])?;
        }
        self.put(machine, BLOCKS, 0)?;
        self.put(machine, TABLES, 0)?;
        self.put(machine, TRAMPOLINE, 0)?;
        self.put(machine, OWNER, 0)?;
        machine.write_phys(self.heap_phys + RETURNS, &vec![0u8; RETURNS_BYTES as usize])?;
        Ok(report)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of the live kernel text (`_stext`..`_etext`), read physically in 1 MiB chunks.
///
/// # Errors
/// When the survey or guest memory fails.
pub fn text_digest(att: &mut Attached, image: &KernelImage) -> anyhow::Result<String> {
    use sha2::{Digest, Sha256};
    let survey = super::attach::survey(att, image)?;
    let (start, end) = survey.layout.text;
    let mut hash = Sha256::new();
    let mut at = start;
    while at < end {
        let len = (end - at).min(1 << 20);
        let mut buf = vec![0u8; usize::try_from(len)?];
        let phys = {
            let mut mem = BackendMemory(&mut att.machine);
            survey.space(&mut mem).translate(at)?.phys
        };
        att.machine.read_phys(phys, &mut buf)?;
        hash.update(&buf);
        at += len;
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

// ---------------------------------------------------------------------------------------
// The guardian
// ---------------------------------------------------------------------------------------

struct Guardian {
    child: Child,
    pipe: ChildStdin,
}

static GUARDIAN: Mutex<Option<Guardian>> = Mutex::new(None);
/// The gdbstub this process attached to last (every attach goes through
/// `crate::attach::attach`, which notes it here).
static TARGET: Mutex<Option<String>> = Mutex::new(None);

/// Notes the gdbstub this process attaches to, for [`guard_noted`].
pub fn note_target(target: &str) {
    *TARGET
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(target.to_owned());
}

/// [`guard`] for the gdbstub this process attached to last.
///
/// # Errors
/// When the guardian cannot be started.
pub fn guard_noted(heap_phys: u64) -> anyhow::Result<()> {
    let target = TARGET
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    match target {
        Some(t) => guard(&t, heap_phys),
        None => Ok(()),
    }
}

/// The program (and its leading arguments) that runs as a guardian: the binary sets it to
/// itself and `guardian` ([`set_guardian_program`]); without it no guardian starts.
static PROGRAM: Mutex<Option<(PathBuf, Vec<String>)>> = Mutex::new(None);

/// Says how to start a guardian: `program ARGS... --target T --heap H --parent PID`, which
/// must wait on its standard input and call [`guardian_main`].
pub fn set_guardian_program(program: PathBuf, args: Vec<String>) {
    *PROGRAM
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((program, args));
}

/// Starts this process's guardian for the guest at `target` whose patch heap is at
/// `heap_phys`, unless one runs already, no guardian program is set, or `EXOTAP_GUARDIAN=0`.
///
/// # Errors
/// When the guardian cannot be started.
pub fn guard(target: &str, heap_phys: u64) -> anyhow::Result<()> {
    if std::env::var_os("EXOTAP_GUARDIAN").is_some_and(|v| v == "0") {
        return Ok(());
    }
    let mut slot = GUARDIAN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if slot.is_some() {
        return Ok(());
    }
    use std::os::unix::process::CommandExt as _;
    let Some((program, args)) = PROGRAM
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
    else {
        return Ok(());
    };
    let mut child = Command::new(program)
        .args(args)
        .args(["--target", target, "--heap"])
        .arg(format!("{heap_phys:#x}"))
        .arg("--parent")
        .arg(std::process::id().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        // Its own process group: the terminal's Ctrl-C goes to exotap, which removes its
        // probes itself; the guardian stays to see that it did.
        .process_group(0)
        .spawn()
        .context("cannot start the guardian process")?;
    let pipe = child.stdin.take().context("the guardian has no pipe")?;
    *slot = Some(Guardian { child, pipe });
    tracing::debug!("guardian started for {target}");
    Ok(())
}

/// Tells the guardian that exotap ended normally (everything it put in is out), and lets it go.
pub fn dismiss() {
    let taken = GUARDIAN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    if let Some(mut g) = taken {
        let _ = g.pipe.write_all(b"clean\n");
        drop(g.pipe);
        let _ = g.child.wait();
    }
}

/// How long the guardian tries to reach the gdbstub after exotap died.
const REACH: Duration = Duration::from_secs(20);

/// What the guardian did.
#[derive(Debug)]
pub enum GuardianEnd {
    /// exotap ended normally.
    Dismissed,
    /// exotap died; the guest was recovered after this long (the report may be empty).
    Recovered(Recovered, Duration),
    /// exotap died and the guest is gone too (nothing listens at the gdbstub).
    GuestGone,
}

/// The guardian's life: wait for `clean` or end of file on `input`; on end of file, connect
/// to `target` and recover the guest whose patch heap is at `heap_phys`, then detach.
///
/// # Errors
/// Recovery or detaching failed.
pub fn guardian_main(
    input: impl std::io::Read,
    target: &str,
    heap_phys: u64,
) -> anyhow::Result<GuardianEnd> {
    for line in BufReader::new(input).lines() {
        match line {
            Ok(l) if l.trim() == "clean" => return Ok(GuardianEnd::Dismissed),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    let started = Instant::now();
    while started.elapsed() < REACH {
        match GdbMachine::connect(target, Duration::from_secs(5)) {
            Ok(mut machine) => {
                let result = Journal { heap_phys }.recover(&mut machine);
                let detached = machine.detach();
                let report = result.with_context(|| format!("recovery of {target} failed"))?;
                detached.with_context(|| {
                    format!("recovered ({report}) but cannot detach from {target}")
                })?;
                return Ok(GuardianEnd::Recovered(report, started.elapsed()));
            }
            Err(e) if is_gone(&e) => return Ok(GuardianEnd::GuestGone),
            Err(e) => {
                tracing::debug!("guardian: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    bail!(
        "the gdbstub at {target} did not answer for {} s",
        REACH.as_secs()
    )
}

/// A connection that cannot be made at all (no socket, refused): the guest is gone.
fn is_gone(e: &exotap_vmm::control::ControlError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            );
        }
        source = s.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use exotap_vmm::control::{ControlError, StopEvent, VcpuId, X86Registers};

    /// Guest RAM and one stopped vCPU.
    struct Ram {
        ram: Vec<u8>,
        regs: X86Registers,
    }

    impl Ram {
        fn range(&self, addr: u64, len: usize) -> Result<std::ops::Range<usize>, ControlError> {
            let start = usize::try_from(addr).unwrap_or(usize::MAX);
            match start.checked_add(len) {
                Some(end) if end <= self.ram.len() => Ok(start..end),
                _ => Err(ControlError::Memory {
                    addr,
                    len,
                    space: "physical",
                }),
            }
        }
    }

    impl Machine for Ram {
        fn vcpus(&mut self) -> Result<Vec<VcpuId>, ControlError> {
            Ok(vec![VcpuId(0)])
        }
        fn read_phys(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
            let r = self.range(addr, buf.len())?;
            buf.copy_from_slice(&self.ram[r]);
            Ok(())
        }
        fn write_phys(&mut self, addr: u64, data: &[u8]) -> Result<(), ControlError> {
            let r = self.range(addr, data.len())?;
            self.ram[r].copy_from_slice(data);
            Ok(())
        }
        fn read_virt(&mut self, _: VcpuId, addr: u64, buf: &mut [u8]) -> Result<(), ControlError> {
            Err(ControlError::Memory {
                addr,
                len: buf.len(),
                space: "virtual",
            })
        }
        fn write_virt(&mut self, _: VcpuId, addr: u64, data: &[u8]) -> Result<(), ControlError> {
            Err(ControlError::Memory {
                addr,
                len: data.len(),
                space: "virtual",
            })
        }
        fn registers(&mut self, _: VcpuId) -> Result<RegisterFile, ControlError> {
            Ok(RegisterFile::X86_64(self.regs))
        }
        fn set_pc(&mut self, _: VcpuId, pc: u64) -> Result<(), ControlError> {
            self.regs.rip = pc;
            Ok(())
        }
        fn pause(&mut self) -> Result<(), ControlError> {
            Ok(())
        }
        fn resume(&mut self) -> Result<(), ControlError> {
            Ok(())
        }
        fn is_paused(&self) -> bool {
            true
        }
        fn set_breakpoint(&mut self, _: u64, _: bool) -> Result<(), ControlError> {
            Ok(())
        }
        fn wait_event(&mut self, _: Duration) -> Result<Option<StopEvent>, ControlError> {
            Ok(None)
        }
        fn step(&mut self, _: VcpuId) -> Result<StopEvent, ControlError> {
            Err(ControlError::Unsupported {
                backend: "test",
                what: "step",
            })
        }
    }

    const HEAP: u64 = 0x10_0000;
    const HEAP_VA: u64 = 0xffff_ffff_a900_0000;
    const TRAMPOLINE_VA: u64 = HEAP_VA + 0x8000;
    const ORIGINAL: [u8; 5] = [0x0f, 0x1f, 0x44, 0x00, 0x00];
    const SPLICE: [u8; 5] = [0xe9, 0x11, 0x22, 0x33, 0x44];

    fn guest() -> Ram {
        Ram {
            ram: vec![0; 0x20_0000],
            regs: X86Registers::default(),
        }
    }

    /// A guest as an exotap left it when it died: one splice in, one journaled but not yet
    /// written, one site someone else changed since, a vCPU stopped on the trap trampoline.
    fn left_behind(m: &mut Ram) -> Journal {
        let journal = Journal::open(HEAP, HEAP_VA, 0x10_0000, m).unwrap();
        m.ram[0x1000..0x1005].copy_from_slice(&ORIGINAL);
        m.ram[0x2000..0x2005].copy_from_slice(&ORIGINAL);
        m.ram[0x3000..0x3005].copy_from_slice(&ORIGINAL);
        let entries: Vec<(u64, &[u8], &[u8])> = [0x1000, 0x2000, 0x3000]
            .iter()
            .map(|&p| (p, &ORIGINAL[..], &SPLICE[..]))
            .collect();
        journal.record_text(m, HEAP + 0x4_0000, &entries).unwrap();
        m.ram[0x1000..0x1005].copy_from_slice(&SPLICE);
        m.ram[0x3000..0x3005].copy_from_slice(&[0xcc; 5]);
        journal.set_trampoline(m, TRAMPOLINE_VA).unwrap();
        journal
            .set_return(m, 7, 0xffff_c900_0001_3f58, 0xffff_ffff_8134_9955)
            .unwrap();
        m.regs.rip = TRAMPOLINE_VA;
        m.regs.gpr[7] = 0xffff_c900_0001_3f60;
        journal
    }

    #[test]
    fn recovery_undoes_what_is_still_there_and_leaves_the_rest_named() {
        let mut m = guest();
        let journal = left_behind(&mut m);

        let report = journal.recover(&mut m).unwrap();

        assert_eq!(&m.ram[0x1000..0x1005], &ORIGINAL);
        assert_eq!(&m.ram[0x2000..0x2005], &ORIGINAL);
        assert_eq!(&m.ram[0x3000..0x3005], &[0xcc; 5]);
        assert_eq!(m.regs.rip, 0xffff_ffff_8134_9955);
        assert_eq!(
            (
                report.splices_removed,
                report.already_clean,
                report.foreign.len(),
                report.vcpus_moved
            ),
            (1, 1, 1, 1),
            "{report}"
        );
        assert!(report.foreign[0].contains("0x3000"), "{report}");
        // The parked trampoline (`jmp .` while exotap was attached) is loud again: `ud2`.
        let at = (HEAP + (TRAMPOLINE_VA - HEAP_VA)) as usize;
        assert_eq!(&m.ram[at..at + 2], &[0x0f, 0x0b]);
        // Emptied: a second recovery finds nothing.
        let again = journal.recover(&mut m).unwrap();
        assert!(!again.anything(), "{again}");
    }

    /// Maps the kernel stack page at `va` to physical `phys` with 4-level page tables at
    /// 0xa000 (cr3), 0xc000, 0xe000 and 0x1_0000.
    fn map_stack(m: &mut Ram, va: u64, phys: u64) {
        let levels = [(0xa000u64, 39), (0xc000, 30), (0xe000, 21), (0x1_0000, 12)];
        for (k, &(table, shift)) in levels.iter().enumerate() {
            let next = levels.get(k + 1).map_or(phys, |l| l.0);
            let at = (table + 8 * ((va >> shift) & 511)) as usize;
            m.ram[at..at + 8].copy_from_slice(&(next | 0x3).to_le_bytes());
        }
        m.regs.cr3 = 0xa000;
    }

    #[test]
    fn a_tail_chain_of_a_host_evaluated_and_a_compiled_swap_goes_back_to_the_real_caller() {
        // A host-evaluated `.return` probe's function swapped the return address at SLOT
        // (journaled: the real caller), then tail-called a function with a compiled `.return`
        // probe, which swapped the host's trampoline for its own (its table keeps the host's
        // trampoline as its original).
        const SLOT: u64 = 0xffff_c900_0001_3f58;
        const STACK_PHYS: u64 = 0x1_2000;
        const CALLER: u64 = 0xffff_ffff_8134_9955;
        let compiled_trampoline = HEAP_VA + 0x9_0000;
        let mut m = guest();
        map_stack(&mut m, SLOT, STACK_PHYS);
        let journal = Journal::open(HEAP, HEAP_VA, 0x10_0000, &mut m).unwrap();
        journal.set_trampoline(&mut m, TRAMPOLINE_VA).unwrap();
        journal.set_return(&mut m, 0, SLOT, CALLER).unwrap();
        let table = HEAP + 0x5_0000;
        let entry = table as usize;
        m.ram[entry..entry + 8].copy_from_slice(&SLOT.to_le_bytes());
        m.ram[entry + 8..entry + 16].copy_from_slice(&TRAMPOLINE_VA.to_le_bytes());
        journal
            .record_table(&mut m, table, INFLIGHT_SLOT as u64)
            .unwrap();
        let at = (STACK_PHYS + (SLOT & 0xfff)) as usize;
        m.ram[at..at + 8].copy_from_slice(&compiled_trampoline.to_le_bytes());

        let report = journal.recover(&mut m).unwrap();

        assert_eq!(
            u64::from_le_bytes(m.ram[at..at + 8].try_into().unwrap()),
            CALLER,
            "{report}"
        );
        assert_eq!(report.returns_restored, 2, "{report}");
    }

    #[test]
    fn a_journal_lists_something_from_its_first_splice_until_removal_or_recovery() {
        let mut m = guest();
        let journal = Journal::open(HEAP, HEAP_VA, 0x10_0000, &mut m).unwrap();
        let fresh = journal.lists_anything(&mut m).unwrap();
        let entries: Vec<(u64, &[u8], &[u8])> = vec![(0x1000, &ORIGINAL[..], &SPLICE[..])];
        journal
            .record_text(&mut m, HEAP + 0x4_0000, &entries)
            .unwrap();
        let spliced = journal.lists_anything(&mut m).unwrap();
        journal.clear_text(&mut m).unwrap();
        let removed = journal.lists_anything(&mut m).unwrap();
        let recovered = left_behind(&mut m).recover(&mut m).map(drop);
        let after_recovery = journal.lists_anything(&mut m).unwrap();

        assert_eq!((fresh, spliced, removed), (false, true, false));
        assert!(recovered.is_ok());
        assert!(!after_recovery);
        assert!(!Journal { heap_phys: 0 }.lists_anything(&mut m).unwrap());
    }

    #[test]
    fn a_journal_left_by_a_dead_exotap_is_recovered_when_the_heap_is_taken_again() {
        let mut m = guest();
        left_behind(&mut m);
        // The owner becomes a process that does not exist.
        m.ram[(HEAP + JOURNAL + OWNER) as usize..][..8].copy_from_slice(&u64::MAX.to_le_bytes());

        Journal::open(HEAP, HEAP_VA, 0x10_0000, &mut m).unwrap();

        assert_eq!(&m.ram[0x1000..0x1005], &ORIGINAL);
        assert_eq!(m.regs.rip, 0xffff_ffff_8134_9955);
    }

    #[test]
    fn a_heap_whose_owner_still_runs_is_refused() {
        let mut m = guest();
        left_behind(&mut m);
        // pid 1 runs, with the start time the journal names.
        let start = start_time(1).unwrap_or(0);
        let h = (HEAP + JOURNAL) as usize;
        m.ram[h + 8..h + 16].copy_from_slice(&1u64.to_le_bytes());
        m.ram[h + 16..h + 24].copy_from_slice(&start.to_le_bytes());

        let err = Journal::open(HEAP, HEAP_VA, 0x10_0000, &mut m).unwrap_err();

        assert!(format!("{err:#}").contains("pid 1"), "{err:#}");
        assert_eq!(
            &m.ram[0x1000..0x1005],
            &SPLICE,
            "nothing may be undone under it"
        );
    }

    #[test]
    fn a_hostile_journal_gives_bounded_work_and_no_panic() {
        let mut m = guest();
        Journal::open(HEAP, HEAP_VA, 0x10_0000, &mut m).unwrap();
        let h = (HEAP + JOURNAL) as usize;
        // Counts and addresses a corrupt guest may hold.
        for (off, v) in [
            (BLOCKS, u64::MAX),
            (TABLES, u64::MAX),
            (BLOCK_LIST, u64::MAX - 4),
            (BLOCK_LIST + 8, u64::MAX),
            (TABLE_LIST, 0x1f_fff0),
            (TABLE_LIST + 8, u64::MAX),
        ] {
            m.ram[h + off as usize..][..8].copy_from_slice(&v.to_le_bytes());
        }
        let report = Journal { heap_phys: HEAP }.recover(&mut m).unwrap();
        assert_eq!(report.foreign.len(), 2, "{report}");
        assert!(
            report.foreign.iter().all(|f| f.contains("cannot be read")),
            "{report}"
        );
    }

    #[test]
    fn start_time_reads_this_process_and_not_a_missing_one() {
        assert!(start_time(std::process::id()).is_some());
        assert_eq!(start_time(u32::MAX), None);
    }
}
