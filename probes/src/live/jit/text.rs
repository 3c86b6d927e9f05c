//! Text that changes under a translation (see the parent module's documentation): the
//! translated functions' text compared with the guest's, and a changed function translated
//! again or sent back to its original code.

use super::*;

impl LiveJit {
    /// Compares the translated functions' text with what the guest holds now (through the
    /// shared RAM, the guest running; at most every 100 ms; nothing without shared RAM) and
    /// invalidates every function whose text changed past its entry instruction (the entry
    /// holds exotap's own splice): it is translated again from the new text and its old
    /// block heads jump to the new translation (see the module documentation), or, past
    /// [`MAX_RETRANSLATIONS`], its block heads become jumps to the original leaders (the
    /// entry block's: the relocated entry instruction, then a jump past it) and its
    /// lookup-table entries map to the original addresses, so every path into the old
    /// translation continues in the kernel's current code. The guest is stopped for the
    /// writes.
    ///
    /// # Errors
    /// When guest memory cannot be read or written, or the guest stopped.
    pub fn watch(&mut self, session: &mut GuestSession) -> anyhow::Result<Vec<Invalidation>> {
        if self
            .watched
            .is_some_and(|t| t.elapsed() < Duration::from_millis(100))
        {
            return Ok(Vec::new());
        }
        self.watched = Some(Instant::now());
        let changed = {
            let (_, splicer) = session.parts()?;
            let Some(shared) = splicer.shared.clone() else {
                return Ok(Vec::new());
            };
            let mut changed = Vec::new();
            for (k, (start, end, bytes, insns)) in self.sources.iter().enumerate() {
                if self.given_up.contains(start) {
                    continue;
                }
                let skip = spliced_len(&splicer.kernel, *start, insns, bytes.len());
                let Some(phys) = splicer.kernel.phys(*start) else {
                    continue;
                };
                let mut now = vec![0u8; usize::try_from(end - start)?];
                if shared.read_phys(phys, &mut now).is_err() {
                    continue;
                }
                if let Some(i) = (skip..bytes.len()).find(|&i| now.get(i) != bytes.get(i)) {
                    let mut text = now.clone();
                    // The entry holds exotap's splice: its original bytes.
                    text[..skip].copy_from_slice(&bytes[..skip]);
                    changed.push((k, i, now[i], text));
                }
            }
            changed
        };
        if changed.is_empty() {
            return Ok(Vec::new());
        }
        session.pause()?;
        let mut done = Vec::new();
        for (k, i, now, text) in changed {
            let (start, _, bytes, insns) = self.sources[k].clone();
            let Some(f) = self.translation.functions.get(&start).copied() else {
                continue;
            };
            let mut inv = Invalidation {
                function: self.names.get(&start).cloned().unwrap_or_default(),
                start,
                at: start + i as u64,
                was: bytes[i],
                now,
                retranslated: false,
            };
            let spliced = {
                let (_, splicer) = session.parts()?;
                spliced_len(&splicer.kernel, start, &insns, bytes.len())
            };
            let entry_insns = bytes.get(..spliced).unwrap_or_default().to_vec();
            match self.invalidate(session, f.start, &entry_insns, &insns, k, &text) {
                Ok(Some(retranslated)) => {
                    self.pending.remove(&start);
                    inv.retranslated = retranslated;
                    tracing::info!(
                        "{} changed at {:#x} ({:02x} -> {:02x}): {}",
                        inv.function,
                        inv.at,
                        inv.was,
                        inv.now,
                        if retranslated {
                            "translated again from its new text"
                        } else {
                            "its translation is given up, it runs its original code"
                        }
                    );
                    self.invalidated.push(inv.clone());
                    done.push(inv);
                }
                Ok(None) => {
                    self.pending.insert(start);
                }
                Err(e) => return Err(e),
            }
        }
        session.resume()?;
        Ok(done)
    }

    /// Sends every way into one function's translation (the `k`th source) to a new
    /// translation of `text` (its current text, entry instruction as before the splice) or,
    /// past [`MAX_RETRANSLATIONS`] or when it cannot be translated, back to its original
    /// code (the guest stopped). `None` when a vCPU or an interrupted context is inside a
    /// block head that would be overwritten; else whether it was translated again.
    fn invalidate(
        &mut self,
        session: &mut GuestSession,
        start: u64,
        entry_insns: &[u8],
        insns: &[u64],
        k: usize,
        text: &[u8],
    ) -> anyhow::Result<Option<bool>> {
        // Every head so far (an earlier translation's included): all go to the new one.
        let heads: Vec<(u64, u64)> = self
            .translation
            .blocks
            .iter()
            .filter(|b| b.function == start)
            .map(|b| (b.cache, b.leader))
            .collect();
        // A vCPU stopped inside the first five bytes of a block head (after its `pushfq`)
        // would resume in the middle of the new jump.
        for vcpu in session.machine.vcpus()? {
            let regs = attach::x86_registers(&mut *session.machine, vcpu)?;
            if heads.iter().any(|&(c, _)| regs.rip > c && regs.rip < c + 5) {
                return Ok(None);
            }
        }
        let retranslated = self.retranslate(session, start, k, text)?;
        let new_code = |leader: u64| -> Option<u64> {
            let tr = self.translator.as_ref()?;
            retranslated.then(|| tr.cache_of(leader)).flatten()
        };
        let mut writes = Vec::new();
        for &(cache, leader) in &heads {
            let mut code = Vec::new();
            let mut at = cache;
            if let Some(to) = new_code(leader) {
                if to == cache {
                    continue; // a head of the new translation itself
                }
                let rel = i32::try_from(to.wrapping_sub(at + 5) as i64)
                    .context("a translation is out of rel32 reach of another")?;
                code.push(0xe9);
                code.extend_from_slice(&rel.to_le_bytes());
                writes.push((cache, code));
                continue;
            }
            if leader == start {
                // The entry's instructions up to the end of the one exotap's splice covers
                // (past an `endbr64` where the splice sits after it), one by one: the jump
                // back lands after the splice, never on it.
                let end = start + entry_insns.len() as u64;
                for (i, &a) in insns.iter().enumerate().take_while(|(_, &a)| a < end) {
                    let next = insns.get(i + 1).copied().unwrap_or(end).min(end);
                    let insn = entry_insns
                        .get((a - start) as usize..(next - start) as usize)
                        .context("the entry's instructions lie outside its bytes")?;
                    let moved = crate::splice::reloc::relocate(
                        insn,
                        a,
                        at,
                        crate::splice::reloc::CallReturn::Patch,
                    )
                    .map_err(|e| anyhow::anyhow!("cannot relocate the entry instruction: {e}"))?;
                    code.extend_from_slice(&moved.bytes);
                    at += moved.bytes.len() as u64;
                }
            }
            let resume = if leader == start {
                start + entry_insns.len() as u64
            } else {
                leader
            };
            let rel = i32::try_from(resume.wrapping_sub(at + 5) as i64)
                .context("the original code is out of rel32 reach of the cache")?;
            code.push(0xe9);
            code.extend_from_slice(&rel.to_le_bytes());
            writes.push((cache, code));
        }
        // Instructions the new translation has are in the table already (its link).
        let keys: BTreeSet<u64> = insns
            .iter()
            .copied()
            .filter(|&a| new_code(a).is_none())
            .collect();
        let mut table = self.translation.table.clone();
        for slot in table.chunks_exact_mut(16) {
            let key = u64::from_le_bytes(slot[..8].try_into().unwrap_or_default());
            if key != 0 && keys.contains(&key) {
                slot[8..].copy_from_slice(&key.to_le_bytes());
            }
        }
        let (machine, splicer) = session.parts()?;
        // The table first: a return into this function then already goes to the original.
        match &splicer.shared {
            Some(shared) => shared.write_heap(self.translation.table_at, &table)?,
            None => splicer.write_heap(machine, self.translation.table_at, &table)?,
        }
        for (at, code) in writes {
            splicer.write_heap(machine, at, &code)?;
        }
        self.translation.table = table;
        if !retranslated {
            self.given_up.insert(start);
        }
        Ok(Some(retranslated))
    }

    /// Translates the `k`th source function again from `text` (its current bytes) and
    /// writes the new translation into the cache, unless it was translated
    /// [`MAX_RETRANSLATIONS`] times already or cannot be (the cache full, text that does
    /// not analyse). Whether it was.
    fn retranslate(
        &mut self,
        session: &mut GuestSession,
        start: u64,
        k: usize,
        text: &[u8],
    ) -> anyhow::Result<bool> {
        let done = self.retranslations.get(&start).copied().unwrap_or(0);
        let Some(translator) = self.translator.as_mut() else {
            return Ok(false);
        };
        if done >= MAX_RETRANSLATIONS {
            return Ok(false);
        }
        let end = start + text.len() as u64;
        let (machine, splicer) = session.parts()?;
        let analysis = exotap_introspect::x86::FunctionAnalysis::analyze(
            text,
            start,
            &splicer.kernel.facts.config,
        );
        let view = exotap_introspect::x86::CodeView::new(start, text)
            .context("the function's new text")?;
        translator.forget(start, end);
        if let Err(e) = translator.translate(view, &analysis) {
            tracing::info!("cannot translate the function at {start:#x} again: {e:#}");
            return Ok(false);
        }
        let link = translator.link()?;
        write_link(machine, splicer, &link)?;
        for &(_, stub) in &link.stubs {
            if self.lazy.on
                && self.lazy.full.is_none()
                && machine.set_breakpoint(stub, true).is_ok()
            {
                self.armed.insert(stub);
            }
        }
        self.apply(&link);
        self.retranslations.insert(start, done + 1);
        if let Some(source) = self.sources.get_mut(k) {
            source.2 = text.to_vec();
            source.3 = analysis.cfg.insns().iter().map(|i| i.addr).collect();
        }
        Ok(true)
    }
}

/// Bytes from a translated function's start to the end of the instruction its entry splice
/// covers ([`crate::live::splicer::LiveKernel::entry`]: the first instruction, or the one after an `endbr64`):
/// the bytes whose change is exotap's own, and what runs before the jump back to the
/// original code when a translation is given up. `len` (the function's) when the
/// instructions do not say.
fn spliced_len(
    kernel: &crate::live::splicer::LiveKernel,
    start: u64,
    insns: &[u64],
    len: usize,
) -> usize {
    // The JIT reads the whole text first (jit.rs), so the entry is known.
    let at = kernel.entry(start).unwrap_or(start);
    insns
        .iter()
        .position(|&a| a == at)
        .and_then(|j| insns.get(j + 1))
        .map_or(len, |&n| usize::try_from(n - start).unwrap_or(len).min(len))
}
