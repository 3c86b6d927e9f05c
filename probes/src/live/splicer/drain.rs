//! Draining the trace rings: at a stop, or while the guest runs through shared memory.

use exotap_vmm::control::Machine;

use crate::rings::RingSet;

use super::{ring_spans, ring_window, take_records, Rings, Splicer, TraceRecord, TRACE_RECORD};

impl Splicer {
    /// Takes the trace records written since the last drain, oldest first per vCPU (the
    /// guest stopped). A record still being written (TSC 0) ends the take for its vCPU until
    /// the next drain; with `last` (at removal) it is skipped instead. The records taken are
    /// zeroed in the guest unless `last`.
    ///
    /// # Errors
    /// When the rings cannot be read or written.
    pub fn drain_rings(
        &mut self,
        machine: &mut dyn Machine,
        last: bool,
    ) -> anyhow::Result<Vec<(u32, TraceRecord)>> {
        let Some(Rings { set: rings, .. }) = self.rings else {
            return Ok(Vec::new());
        };
        if let Some(shared) = &self.shared {
            let shared = shared.clone();
            if last {
                self.stop_drainer();
                let mut out = std::mem::take(&mut self.pending);
                out.extend(self.drain_shared(&shared, rings, true)?);
                return Ok(out);
            }
            return self.drain_by_thread(shared, rings);
        }
        // Read every ring first: a failed read changes nothing, and removal finds it all.
        let mut taken = Vec::new();
        for cpu in 0..rings.cpus {
            let at = rings.ring(cpu);
            let mut head = [0u8; 8];
            machine.read_phys(self.heap_phys(at), &mut head)?;
            let head = u64::from_le_bytes(head);
            let before = self.ring_taken.get(cpu as usize).copied().unwrap_or(0);
            let (from, lost) = ring_window(head, before, rings.slots);
            let mut bytes = Vec::new();
            for (slot, n) in ring_spans(from, head, rings.slots) {
                let mut buf = vec![0u8; usize::try_from(n * TRACE_RECORD)?];
                let va = rings.slot(cpu, slot);
                machine.read_phys(self.heap_phys(va), &mut buf)?;
                bytes.extend_from_slice(&buf);
            }
            let (records, count) = take_records(&bytes, last);
            taken.push((cpu, from, count, lost, records));
        }
        let mut out = Vec::new();
        for (cpu, from, count, lost, records) in taken {
            if !last {
                for (slot, n) in ring_spans(from, from + count, rings.slots) {
                    let zeros = vec![0u8; usize::try_from(n * TRACE_RECORD)?];
                    let va = rings.slot(cpu, slot);
                    machine.write_phys(self.heap_phys(va), &zeros)?;
                }
            }
            let i = cpu as usize;
            if let (Some(t), Some(l)) = (self.ring_taken.get_mut(i), self.ring_lost.get_mut(i)) {
                *t = from + count;
                *l = l.saturating_add(lost);
            }
            out.extend(records.into_iter().map(|r| (cpu, r)));
        }
        Ok(out)
    }

    /// [`Splicer::drain_rings`] through the shared RAM while the guest runs: the records
    /// the drainer thread took since the last call (starting it on the first call).
    fn drain_by_thread(
        &mut self,
        shared: crate::live::shared::SharedHeap,
        rings: RingSet,
    ) -> anyhow::Result<Vec<(u32, TraceRecord)>> {
        if self.drainer.is_none() && self.drained.is_none() {
            let state = crate::live::drainer::DrainState {
                taken: self.ring_taken.clone(),
                lost: self.ring_lost.clone(),
                ..Default::default()
            };
            self.drainer = Some(crate::live::drainer::Drainer::start(shared, rings, state)?);
        }
        let Some(drainer) = &self.drainer else {
            return Ok(std::mem::take(&mut self.pending));
        };
        let ended = drainer.ended();
        let mut out = std::mem::take(&mut self.pending);
        for batch in drainer.try_batches() {
            let (records, _) = take_records(&batch.records, true);
            out.extend(records.into_iter().map(|r| (batch.cpu, r)));
        }
        if ended {
            self.stop_drainer();
            out.append(&mut self.pending);
            if let Some(e) = self.drained.as_ref().and_then(|d| d.error.clone()) {
                self.pending = out;
                anyhow::bail!("the ring drainer stopped: {e}");
            }
        }
        Ok(out)
    }

    /// Stops the drainer thread (if one runs): its readers' positions and counts come back
    /// here, the records it had not handed out wait for the next drain, and what it drained
    /// is kept for [`Splicer::drain_statistics`]. Streaming drains after it return only
    /// those records.
    pub fn stop_drainer(&mut self) {
        let Some(drainer) = self.drainer.take() else {
            return;
        };
        let (batches, state) = drainer.stop();
        for batch in batches {
            let (records, _) = take_records(&batch.records, true);
            self.pending
                .extend(records.into_iter().map(|r| (batch.cpu, r)));
        }
        for (i, (&t, &l)) in state.taken.iter().zip(&state.lost).enumerate() {
            if let (Some(taken), Some(lost)) =
                (self.ring_taken.get_mut(i), self.ring_lost.get_mut(i))
            {
                *taken = t;
                *lost = l;
            }
        }
        self.drained = Some(state);
    }

    /// What the drainer thread did, once stopped ([`Splicer::stop_drainer`]).
    pub fn drain_statistics(&self) -> Option<&crate::live::drainer::DrainState> {
        self.drained.as_ref()
    }

    /// [`Splicer::drain_rings`] through the shared RAM, the vCPUs running
    /// ([`crate::rings::drain_concurrent`]).
    fn drain_shared(
        &mut self,
        shared: &crate::live::shared::SharedHeap,
        rings: RingSet,
        last: bool,
    ) -> anyhow::Result<Vec<(u32, TraceRecord)>> {
        let mut out = Vec::new();
        for cpu in 0..rings.cpus {
            let i = cpu as usize;
            let (Some(taken), Some(lost)) = (self.ring_taken.get_mut(i), self.ring_lost.get_mut(i))
            else {
                continue;
            };
            let got = crate::rings::drain_concurrent(shared, &rings, cpu, taken, last)?;
            *lost = lost.saturating_add(got.lost);
            let (records, _) = take_records(&got.records, true);
            out.extend(records.into_iter().map(|r| (cpu, r)));
        }
        Ok(out)
    }

    /// Records lost to ring overruns so far, per vCPU.
    pub fn ring_losses(&self) -> &[u64] {
        &self.ring_lost
    }
}
