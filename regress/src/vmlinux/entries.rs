//! The patches `exotap time`, `exotap trace`, `exotap nullify` and `exotap replace` splice in
//! at a function's entry, run under the regression's oracles (issue 41): the same builders
//! the live splicer calls ([`timed_entry_patch`], [`diverting_patch`]), at the entry of each
//! function the vmlinux sweep calls (past an `endbr64` or its seal, as the splicer places a
//! function probe), after its counting and trap sweep.
//!
//! Each kind's run must do what the unprobed call did, and its own effect is checked:
//! - **time**: the same end, registers, scratch memory and live stack as the reference; the
//!   histogram holds one sample per call of the function; no call missed the table of calls
//!   in flight, and every slot of it is free again (each return went through its trampoline).
//! - **trace**: the same as the reference too; the ring holds two finished records per call,
//!   the entry's with the first argument and the return's with the reference's return value,
//!   each with the function's id.
//! - **nullify**: the function's code never runs: it returns the value asked for, every other
//!   register is as the caller left it, the stack pointer is past the return address, the
//!   scratch memory is untouched, and the patch counted the call.
//! - **replace**: the call goes to a stand-in that returns a known value, with the same
//!   checks as nullify.
//!
//! The trace records read the vCPU number `gs:`-relative at the kernel's own `cpu_number`,
//! as in the guest: the harness runs with GS base 0 over the per-CPU segment mapped at 0,
//! where it reads 0.

use std::collections::HashMap;

use exotap_probes::compile::site::{ReturnSwap, INFLIGHT_BYTES, SLOT};
use exotap_probes::live::splicer::{
    diverting_patch, endbr_or_seal, jmp_rel32, timed_entry_patch, Action, Rings, BUCKETS,
    TRACE_RECORD,
};
use exotap_probes::rings::RingSet;
use exotap_probes::splice::{plan, SpliceContext, SpliceDecision};

use crate::x86::{compare, Harness, Outcome};
use crate::{Divergence, ProbeKind, RegressError, Report};

/// The data the entry patches use (table of calls in flight, miss counter, histogram, ring,
/// the vCPU number), past the scratch area and within rel32 reach of the patch heap.
pub(super) const DATA: u64 = super::SCRATCH + 0x10_0000;
/// Its size.
pub(super) const DATA_SIZE: usize = 0x20_0000;
const TABLE: u64 = DATA;
const MISSES: u64 = DATA + INFLIGHT_BYTES;
const HISTOGRAM: u64 = MISSES + 64;
const RING: u64 = HISTOGRAM + BUCKETS as u64 * 8;
/// Records in the trace ring (more than any checked function's calls make).
const RING_SLOTS: u32 = 256;
/// The trace id the records must carry.
const TRACE_ID: u32 = 0x7ace;
/// What nullify returns, and what the replacing stand-in returns.
const NULLIFIED: u64 = 0x4242_4242;
const REPLACED: u32 = 0x5eed;

/// The entry kinds, in the order they run.
const KINDS: [ProbeKind; 4] = [
    ProbeKind::Time,
    ProbeKind::Trace,
    ProbeKind::Nullify,
    ProbeKind::Replace,
];

/// Checks every entry kind at `entry` (the function `name`, called as `h.start` says):
/// adds a checked point per kind to `report`, a divergence per failed check, and a refusal
/// when the planner does not splice the entry. `return_thunk`: the image's
/// `__x86_return_thunk`, as the splicer uses it; `cpu_number`: the per-CPU offset of the
/// kernel's `cpu_number` (no trace check without it).
///
/// # Errors
/// Emulator failure.
pub(super) fn check_entry_kinds(
    h: &mut Harness,
    ctx: &SpliceContext<'_>,
    entry: u64,
    name: &str,
    return_thunk: Option<u64>,
    cpu_number: Option<u64>,
    report: &mut Report,
) -> Result<(), RegressError> {
    // Past an `endbr64` or its seal (IBT kernels, 6.12): where the splicer puts a function
    // probe (`LiveKernel::entry`), the ftrace site.
    let start = entry;
    let entry = if ctx.text.range(start, start + 4).is_some_and(endbr_or_seal) {
        start + 4
    } else {
        start
    };
    let counter = h.heap_base();
    let stand_in = h.heap_base() + 0x800;
    let patch = h.heap_base() + 0x1000;
    let site = match plan(ctx, entry, patch) {
        SpliceDecision::Splice(site) => site,
        other => {
            report.entries_refused.push(format!(
                "{name}: {}",
                match other {
                    SpliceDecision::Refuse(r) => format!("refused: {r:?}"),
                    SpliceDecision::Trap { reason, .. } => format!(
                        "a trap point ({reason:?}): the entry patches need a splice, the live \
                         verbs refuse them there too"
                    ),
                    SpliceDecision::Splice(_) => String::new(),
                }
            ));
            return Ok(());
        }
    };
    // The reference, with the entry's execution count.
    h.reset()?;
    h.m.start_profile()?;
    let reference = h.run(&HashMap::new())?;
    let calls =
        h.m.take_profile()
            .unwrap_or_default()
            .get(&entry)
            .copied()
            .unwrap_or(0);
    let swap = ReturnSwap {
        table: TABLE,
        misses: MISSES,
        trampoline: patch,
        heap: (h.heap_base(), h.heap_end()),
    };
    let rings = Rings {
        set: RingSet {
            base: RING,
            cpus: 1,
            slots: RING_SLOTS,
            record: TRACE_RECORD,
        },
        cpu_number: cpu_number.unwrap_or_default(),
        task: None,
    };
    for kind in KINDS {
        let built = match kind {
            ProbeKind::Time => timed_entry_patch(&site, &swap, HISTOGRAM, None)
                .map(|p| (p.code, p.splice, Vec::new())),
            ProbeKind::Trace if cpu_number.is_none() => Err(anyhow::anyhow!(
                "the vmlinux has no cpu_number symbol for the records' vCPU number"
            )),
            ProbeKind::Trace => timed_entry_patch(&site, &swap, 0, Some((&rings, TRACE_ID)))
                .map(|p| (p.code, p.splice, Vec::new())),
            ProbeKind::Nullify | ProbeKind::Replace => {
                let (action, stub) = if kind == ProbeKind::Nullify {
                    (Action::Nullify(NULLIFIED), Vec::new())
                } else {
                    // mov eax, REPLACED; ret
                    let mut stub = vec![0xb8];
                    stub.extend_from_slice(&REPLACED.to_le_bytes());
                    stub.push(0xc3);
                    (Action::Replace(stand_in), stub)
                };
                diverting_patch(patch, counter, action, return_thunk)
                    .and_then(|code| Ok((code, jmp_rel32(entry, patch)?, stub)))
            }
            ProbeKind::Splice | ProbeKind::Trap => continue,
        };
        let (code, splice, stub) = match built {
            Ok(b) => b,
            Err(e) => {
                report
                    .build_errors
                    .push((entry, format!("{kind} patch: {e:#}")));
                continue;
            }
        };
        h.reset()?;
        h.m.write(DATA, &vec![0u8; DATA_SIZE])?;
        h.m.write(patch, &code)?;
        if !stub.is_empty() {
            h.m.write(stand_in, &stub)?;
        }
        let scratch_before = read_scratch(h)?;
        h.m.write(entry, &splice)?;
        let outcome = h.run(&HashMap::new());
        h.m.write(entry, &site.bytes[..5])?;
        let mut outcome = outcome?;
        outcome.unsplice(entry, &site.bytes);
        let what = match kind {
            ProbeKind::Time | ProbeKind::Trace => compare(&reference, &outcome)
                .map_or_else(|| own_effect(h, kind, calls, &reference), |w| Ok(Some(w)))?,
            _ => diverted(h, kind, &outcome, &scratch_before, counter)?,
        };
        *report.entries_checked.entry(kind).or_default() += 1;
        if let Some(what) = what {
            report.divergences.push(Divergence {
                points: vec![entry],
                function: format!("{name}+{:#x}", entry - start),
                kind,
                what,
            });
        }
    }
    Ok(())
}

/// The scratch area as it is now (the arguments the call gets).
fn read_scratch(h: &mut Harness) -> Result<Vec<u8>, RegressError> {
    let mut buf = vec![0u8; super::SCRATCH_SIZE];
    h.m.read(super::SCRATCH, &mut buf)?;
    Ok(buf)
}

fn read_u64(h: &mut Harness, at: u64) -> Result<u64, RegressError> {
    let mut b = [0u8; 8];
    h.m.read(at, &mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// What a timed or traced run left in its data that it should not have (`None` when all is
/// as it should be): `calls` entries of the function in the run.
fn own_effect(
    h: &mut Harness,
    kind: ProbeKind,
    calls: u64,
    reference: &Outcome,
) -> Result<Option<String>, RegressError> {
    let misses = read_u64(h, MISSES)?;
    if misses != 0 {
        return Ok(Some(format!(
            "{misses} calls missed the table of calls in flight"
        )));
    }
    let mut table = vec![0u8; INFLIGHT_BYTES as usize];
    h.m.read(TABLE, &mut table)?;
    let busy = table
        .chunks_exact(SLOT as usize)
        .filter(|s| s[..8] != [0; 8])
        .count();
    if busy != 0 {
        return Ok(Some(format!(
            "{busy} slots of the table of calls in flight still held after every return"
        )));
    }
    if kind == ProbeKind::Time {
        let mut hist = vec![0u8; BUCKETS * 8];
        h.m.read(HISTOGRAM, &mut hist)?;
        let samples: u64 = hist
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
            .sum();
        return Ok((samples != calls)
            .then(|| format!("the histogram holds {samples} samples for {calls} calls")));
    }
    let head = read_u64(h, RING)?;
    if head != 2 * calls {
        return Ok(Some(format!(
            "the ring holds {head} records for {calls} calls"
        )));
    }
    let first_arg = h.start.gpr[5];
    let returned = reference.gpr[0];
    let mut ring = vec![0u8; (u64::from(RING_SLOTS) * TRACE_RECORD) as usize];
    h.m.read(RING + exotap_probes::rings::HEADER, &mut ring)?;
    let word =
        |r: &[u8], at: usize| u64::from_le_bytes(r[at..at + 8].try_into().unwrap_or_default());
    let half =
        |r: &[u8], at: usize| u32::from_le_bytes(r[at..at + 4].try_into().unwrap_or_default());
    let (mut entries, mut returns) = (0, 0);
    for r in ring.chunks_exact(TRACE_RECORD as usize).take(head as usize) {
        if !exotap_probes::rings::is_finished(word(r, 0)) {
            return Ok(Some("a record is not finished".to_owned()));
        }
        if half(r, 16) != TRACE_ID {
            return Ok(Some(format!("a record has id {:#x}", half(r, 16))));
        }
        match half(r, 20) {
            1 => entries += 1,
            2 => returns += 1,
            k => return Ok(Some(format!("a record of kind {k}"))),
        }
        // With one call, its values are known; recursion's inner calls have their own.
        if calls == 1 {
            let (want, what) = if half(r, 20) == 1 {
                (first_arg, "the entry's first argument")
            } else {
                (returned, "the return value")
            };
            if word(r, 8) != want {
                return Ok(Some(format!(
                    "the record holds {:#x} as {what}, the call had {want:#x}",
                    word(r, 8)
                )));
            }
        }
    }
    Ok((entries != calls || returns != calls)
        .then(|| format!("{entries} entry and {returns} return records for {calls} calls")))
}

/// What a nullified or replaced call did that it should not have (`None` when it returned
/// the value asked for and changed nothing else).
fn diverted(
    h: &mut Harness,
    kind: ProbeKind,
    outcome: &Outcome,
    scratch_before: &[u8],
    counter: u64,
) -> Result<Option<String>, RegressError> {
    let want = if kind == ProbeKind::Nullify {
        NULLIFIED
    } else {
        u64::from(REPLACED)
    };
    if outcome.end != exotap_vmm::unicorn::RunEnd::Halted(h.halt) {
        return Ok(Some(format!("ended with {:?}", outcome.end)));
    }
    if outcome.gpr[0] != want {
        return Ok(Some(format!(
            "returned {:#x} instead of {want:#x}",
            outcome.gpr[0]
        )));
    }
    for (i, (now, before)) in outcome.gpr.iter().zip(&h.start.gpr).enumerate() {
        let expected = if i == 7 { before + 8 } else { *before };
        if i != 0 && *now != expected {
            let name = exotap_vmm::control::X86_GPR_NAMES[i];
            return Ok(Some(format!(
                "{name} is {now:#x}, the caller had {expected:#x}"
            )));
        }
    }
    if read_scratch(h)? != scratch_before {
        return Ok(Some("the function's arguments' memory changed".to_owned()));
    }
    let counted = read_u64(h, counter)?;
    Ok((counted != 1).then(|| format!("the patch counted {counted} calls for 1")))
}
