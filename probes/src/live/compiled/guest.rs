//! The guest side of a compiled run: the compiled sites the splice engine asks code of,
//! and the heap data, rings and stack tables the host reads and writes.

use std::collections::HashMap;

use anyhow::Context as _;

use crate::compile::data::collect::{Collection, Collections};
use crate::compile::data::{StringTable, STRING_TABLE_HEAD};
use crate::compile::{self, codegen::Env, data::Header, DataLayout, Interner, SiteBodies};
use crate::lang::eval::Store;
use crate::lang::runtime::Session;

use crate::live::session::GuestSession;
use crate::live::splicer::SiteCode;

/// The compiled sites of one install, as the splice engine asks for their code.
pub(super) struct Sites<'a> {
    pub(super) env: Env<'a>,
    pub(super) interner: &'a mut Interner,
    pub(super) bodies: Vec<SiteBodies>,
    /// Each site's address (the first frame of the stacks its bodies snapshot).
    pub(super) addrs: Vec<u64>,
}

impl SiteCode for Sites<'_> {
    fn has_returns(&self, site: u32) -> bool {
        self.bodies
            .get(site as usize)
            .is_some_and(|b| !b.ret.is_empty())
    }

    fn entry(
        &mut self,
        site: u32,
        at: u64,
        returns: Option<crate::compile::site::ReturnSwap>,
    ) -> anyhow::Result<Vec<u8>> {
        let bodies = self.bodies.get(site as usize).context("no such site")?;
        let stacks_before = self.interner.stacks.len();
        let code = compile::entry_code(self.env, self.interner, at, bodies, returns)
            .map_err(|u| anyhow::anyhow!("{u}"))?;
        // The stack records these bodies write start at the probe point.
        let addr = self.addrs.get(site as usize).copied().unwrap_or(0);
        for format in self.interner.stacks.iter_mut().skip(stacks_before) {
            format.pc = addr;
        }
        Ok(code)
    }

    fn trampoline(&mut self, site: u32, at: u64, table: u64) -> anyhow::Result<Vec<u8>> {
        let bodies = self.bodies.get(site as usize).context("no such site")?;
        compile::return_code(self.env, self.interner, at, bodies, table)
            .map_err(|u| anyhow::anyhow!("{u}"))
    }
}

/// The guest side of a compiled run.
pub(super) struct Guest {
    pub(super) session: GuestSession,
    pub(super) layout: DataLayout,
    pub(super) data: u64,
    pub(super) interner: Interner,
    /// Per vCPU: output records taken so far.
    pub(super) taken: Vec<u64>,
    /// Output records lost to ring overruns (or unreadable).
    pub(super) lost: u64,
    /// Sites whose compiled code a breakpoint enters (no splice fits there): site to code.
    pub(super) entered: HashMap<u64, u64>,
    /// The data as the last pull read it (the guest still stopped), and each global as it
    /// decoded it.
    pub(super) pulled: Option<(Vec<u8>, Globals)>,
    /// The kernel's ORC tables and symbols, when the probes take stack snapshots.
    pub(super) stacks: Option<crate::live::stacks::KernelStacks>,
    /// What the string table's collector did.
    pub(super) collections: Collections,
    /// The table helpers' addresses (for the sites of modules loaded later).
    pub(super) helpers: std::collections::HashMap<(String, bool), u64>,
}

/// Stops of the guest one look makes to collect the string table while compiled hits are
/// in progress at each (the guest runs [`BUSY_PAUSE`] in between), where no breakpoint of
/// the run can stop a vCPU meanwhile (a stop the look would take for its own).
pub(super) const COLLECT_TRIES: u32 = 4;
/// How long the guest runs between two such stops.
const BUSY_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

/// Compiled globals by name, as a pull decoded them.
type Globals = Vec<(String, Store)>;

/// What an output record prints: a stack record unwound from its snapshot
/// ([`compile::snapshot`]), any other as the interner renders it; `None` for a record no
/// format knows (a hostile guest), or a stack record without the kernel's ORC tables.
fn printed(
    interner: &Interner,
    stacks: Option<&crate::live::stacks::KernelStacks>,
    rec: &[u8],
) -> Option<compile::data::Printed> {
    let Some(format) = compile::snapshot::stack_format(&interner.stacks, rec) else {
        return interner.printed(rec);
    };
    let stacks = stacks?;
    compile::snapshot::render(format, rec, &|raw| interner.decode(raw), &|snap| {
        crate::live::stacks::snapshot_backtrace(stacks, snap)
    })
    .map(compile::data::Printed::Text)
}

impl Guest {
    pub(super) fn read_data(&mut self) -> anyhow::Result<Vec<u8>> {
        let len = usize::try_from(self.layout.globals_size)?;
        self.session.read_heap(self.data, len)
    }

    /// Takes the output records written since the last drain, in TSC order across vCPUs (the
    /// guest stopped). A record still being written ends its vCPU's take until the next
    /// drain; with `last` it is skipped instead.
    pub(super) fn drain(&mut self, last: bool) -> anyhow::Result<Vec<compile::data::Printed>> {
        use crate::rings::{spans, take, window};
        let Some(rings) = self.layout.ring_set(self.data) else {
            return Ok(Vec::new());
        };
        self.taken.resize(rings.cpus as usize, 0);
        let record = usize::try_from(rings.record)?;
        let mut records = Vec::new();
        if let Some(shared) = self.session.shared_heap().cloned() {
            // The zero-stop path: the vCPUs may be running ([`crate::rings`]).
            for cpu in 0..rings.cpus {
                let Some(taken) = self.taken.get_mut(cpu as usize) else {
                    continue;
                };
                let got = crate::rings::drain_concurrent(&shared, &rings, cpu, taken, last)?;
                self.lost = self.lost.saturating_add(got.lost);
                for rec in got.records.chunks_exact(record) {
                    let tsc = u64::from_le_bytes(rec[..8].try_into().unwrap_or_default());
                    match printed(&self.interner, self.stacks.as_ref(), rec) {
                        Some(text) => records.push((tsc, text)),
                        None => self.lost += 1,
                    }
                }
            }
            records.sort_by_key(|r| r.0);
            return Ok(records.into_iter().map(|r| r.1).collect());
        }
        for cpu in 0..rings.cpus {
            let head = self.session.read_heap(rings.ring(cpu), 8)?;
            let head = u64::from_le_bytes(head.try_into().unwrap_or_default());
            let (from, lost) = window(head, self.taken[cpu as usize], rings.slots);
            self.lost = self.lost.saturating_add(lost);
            let mut bytes = Vec::new();
            for (slot, n) in spans(from, head, rings.slots) {
                let len = usize::try_from(n * rings.record)?;
                bytes.extend(self.session.read_heap(rings.slot(cpu, slot), len)?);
            }
            let (finished, consumed) = take(&bytes, record, last);
            for rec in finished {
                let tsc = u64::from_le_bytes(rec[..8].try_into().unwrap_or_default());
                match printed(&self.interner, self.stacks.as_ref(), rec) {
                    Some(text) => records.push((tsc, text)),
                    None => self.lost += 1,
                }
            }
            if !last {
                for (slot, n) in spans(from, from + consumed, rings.slots) {
                    let zeros = vec![0u8; usize::try_from(n * rings.record)?];
                    self.session.write_heap(rings.slot(cpu, slot), &zeros)?;
                }
            }
            self.taken[cpu as usize] = from + consumed;
        }
        records.sort_by_key(|r| r.0);
        Ok(records.into_iter().map(|r| r.1).collect())
    }

    /// Learns of modules loaded or removed since the module list was last read (their
    /// frames in stack snapshots): one look at the list's head, through the shared RAM while
    /// the guest runs, else through the backend (the guest stopped, or a backend that reads
    /// while it runs).
    fn know_new_modules(&mut self) {
        let Some(stacks) = self.stacks.as_mut() else {
            return;
        };
        let session = &mut self.session;
        match session.shared_heap() {
            Some(shared) => {
                let mut mem = crate::live::shared::SharedPhysical(shared);
                stacks.refresh_modules_if_changed(&mut session.survey.space(&mut mem));
            }
            None => {
                let mut mem = crate::live::guest_memory::BackendMemory(&mut *session.machine);
                stacks.refresh_modules_if_changed(&mut session.survey.space(&mut mem));
            }
        }
    }

    /// Prints what the compiled probes printed since the last look.
    pub(super) fn print(&mut self, session: &mut Session<'_>, last: bool) -> anyhow::Result<()> {
        self.know_new_modules();
        for printed in self.drain(last)? {
            match printed {
                compile::data::Printed::Text(text) => session.text(&text),
                compile::data::Printed::Hist {
                    name,
                    kind,
                    buckets,
                    newline,
                } => {
                    session.hist(
                        &name,
                        &crate::lang::hist::Histogram {
                            kind,
                            buckets: &buckets,
                        },
                    );
                    if newline {
                        session.text("\n");
                    }
                }
            }
        }
        Ok(())
    }

    /// The data's header (error counts, exit), read while the guest runs when its RAM is
    /// shared, else with the guest stopped.
    pub(super) fn header(&mut self) -> anyhow::Result<Header> {
        let len = compile::data::HEADER as usize;
        let bytes = match self.session.shared_heap() {
            Some(shared) => shared.read_heap(self.data, len)?,
            None => self.session.read_heap(self.data, len)?,
        };
        Ok(Header::decode(&bytes))
    }

    /// Collects the compiled probes' string table once it is past a quarter full (see
    /// [`compile::data::collect`]): a look at its count of entries in use (through the shared
    /// RAM while the guest runs where it has it), then, with the guest stopped (here, if it
    /// was not, and let go again after), the counts of hits in progress, and when no vCPU is
    /// in a compiled hit the whole data, collected and written back where it changed. While
    /// hits are in progress it tries again after letting the guest run a moment, up to
    /// `tries` stops, then leaves it to the next look. Returns whether the table wanted
    /// collecting (the next look should come soon: strings are being built fast).
    pub(super) fn collect_strings(&mut self, tries: u32) -> anyhow::Result<bool> {
        let Some(table) = self.layout.strings.filter(|t| t.collectable) else {
            return Ok(false);
        };
        let head = self.data + table.head;
        let in_use = match self.session.shared_heap() {
            Some(shared) => shared.read_heap(head, 8)?,
            None => self.session.read_heap(head, 8)?,
        };
        if !table.wants_collecting(StringTable::in_use(&in_use)) {
            return Ok(false);
        }
        let was_stopped = self.session.machine.is_paused();
        for attempt in 0..tries.max(1) {
            if attempt > 0 {
                self.session.resume()?;
                std::thread::sleep(BUSY_PAUSE);
            }
            self.session.pause()?;
            let hits = self
                .session
                .read_heap(head, usize::try_from(STRING_TABLE_HEAD)?)?;
            let in_progress = StringTable::hits_in_progress(&hits);
            if in_progress != 0 {
                self.collections.count(Collection::Busy(in_progress));
                continue;
            }
            let before = self.read_data()?;
            let mut data = before.clone();
            let Some(done) = self.layout.collect_strings(&mut data, &mut self.interner) else {
                break;
            };
            self.collections.count(done);
            for (at, len) in changed_spans(&before, &data, SPAN_GAP) {
                self.session
                    .write_heap(self.data + at as u64, &data[at..at + len])?;
            }
            tracing::debug!("string table collected: {done:?}");
            break;
        }
        if !was_stopped {
            self.session.resume()?;
        }
        Ok(true)
    }

    /// Brings every compiled global into the session (the guest stopped); keeps what it
    /// read for the [`Guest::push`] that follows.
    pub(super) fn pull(&mut self, session: &mut Session<'_>) -> anyhow::Result<Header> {
        let data = self.read_data()?;
        let stores = self.bring_in(session, &data);
        let header = Header::decode(&data);
        self.pulled = Some((data, stores));
        Ok(header)
    }

    /// Brings every compiled global into the session while the guest runs (through the
    /// shared RAM, or a backend that reads guest memory while it runs), for host probes that
    /// only read them: nothing is written back. Each table entry is one the guest had
    /// published (a slot being written is skipped); an aggregate's fields come from
    /// separate atomic updates, so a hit in flight may show in its count before its sum.
    pub(super) fn pull_running(&mut self, session: &mut Session<'_>) -> anyhow::Result<Header> {
        let len = usize::try_from(self.layout.globals_size)?;
        let data = match self.session.shared_heap() {
            Some(shared) => shared.read_heap(self.data, len)?,
            None => self.session.read_heap(self.data, len)?,
        };
        self.bring_in(session, &data);
        Ok(Header::decode(&data))
    }

    /// Decodes every compiled global of `data` into the session; returns them as decoded.
    fn bring_in(&self, session: &mut Session<'_>, data: &[u8]) -> Globals {
        let mut stores = Vec::with_capacity(self.layout.globals.len());
        for name in self.layout.globals.keys() {
            if let Some(store) = self.layout.decode(name, data, &self.interner) {
                session.set_global(name, store.clone());
                stores.push((name.clone(), store));
            }
        }
        stores
    }

    /// Writes back what the host's probes changed in the compiled globals (the guest
    /// stopped, right after a pull): each global as the session has it now against what the
    /// pull decoded, element by element ([`compile::data::DataLayout::update_into`]), then
    /// only the bytes that differ. Nothing a vCPU stopped in the middle of an update was
    /// writing is touched.
    pub(super) fn push(&mut self, session: &Session<'_>) -> anyhow::Result<()> {
        let (data, stores) = match self.pulled.take() {
            Some(pulled) => pulled,
            None => {
                let data = self.read_data()?;
                let stores = self
                    .layout
                    .globals
                    .keys()
                    .filter_map(|name| {
                        let store = self.layout.decode(name, &data, &self.interner)?;
                        Some((name.clone(), store))
                    })
                    .collect();
                (data, stores)
            }
        };
        let mut fresh = data.clone();
        for (name, before) in &stores {
            let Some(after) = session.global(name) else {
                continue;
            };
            if let Err(e) =
                self.layout
                    .update_into(name, before, after, &mut self.interner, &mut fresh)
            {
                tracing::warn!("cannot give {name} back to the compiled probes: {e}");
            }
        }
        for (at, len) in changed_spans(&data, &fresh, SPAN_GAP) {
            self.session
                .write_heap(self.data + at as u64, &fresh[at..at + len])?;
        }
        Ok(())
    }
}

/// Unchanged bytes between two changed ones that [`changed_spans`] writes anyway rather
/// than start another write.
const SPAN_GAP: usize = 64;

/// The spans (offset, length) where `new` differs from `old` (same length), merged across
/// runs of fewer than `gap` equal bytes.
fn changed_spans(old: &[u8], new: &[u8], gap: usize) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for (i, _) in old.iter().zip(new).enumerate().filter(|(_, (a, b))| a != b) {
        match spans.last_mut() {
            Some((at, len)) if i < *at + *len + gap => *len = i + 1 - *at,
            _ => spans.push((i, 1)),
        }
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_spans_merge_close_changes_and_keep_far_ones_apart() {
        let old = vec![0u8; 300];
        let mut new = old.clone();
        new[3] = 1;
        new[10] = 1;
        new[200] = 1;

        assert_eq!(changed_spans(&old, &new, 64), vec![(3, 8), (200, 1)]);
        assert_eq!(changed_spans(&old, &old, 64), vec![]);
    }
}
