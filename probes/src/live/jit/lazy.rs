//! Lazy translation while the guest runs (see the parent module's documentation): the
//! guest's stops at stubs, each served by translating the target and relinking its stub.

use std::time::{Duration, Instant};

use super::*;

impl LiveJit {
    /// Lazy translation while the guest runs: takes the guest's stops at stubs (waiting
    /// `wait` for the first, then briefly for more, at most `budget` in all) and serves
    /// each (`LiveJit::lazy_stop`), then lets the guest run again. Nothing without lazy
    /// translation. Returns the stops served.
    ///
    /// # Errors
    /// When the guest is lost, or cannot be read, written or resumed.
    pub fn serve(
        &mut self,
        session: &mut GuestSession,
        image: &KernelImage,
        wait: Duration,
        budget: Duration,
    ) -> anyhow::Result<u64> {
        if !self.lazy.on || session.machine.is_paused() {
            return Ok(0);
        }
        let started = Instant::now();
        let mut served = 0;
        let mut timeout = wait;
        while started.elapsed() < budget {
            match session.wait(timeout)? {
                None | Some(StopEvent::Exited) => break,
                Some(event) => {
                    served += u64::from(self.on_stop(session, image, &event)?);
                }
            }
            timeout = Duration::from_millis(5);
        }
        Ok(served)
    }

    /// Serves one stop of the guest that someone else waited for: a breakpoint at an
    /// armed stub is a lazy-translation stop (`LiveJit::lazy_stop`). The guest resumes
    /// after any stop but its end; whether it was a lazy-translation stop.
    ///
    /// # Errors
    /// As [`LiveJit::serve`].
    pub fn on_stop(
        &mut self,
        session: &mut GuestSession,
        image: &KernelImage,
        event: &StopEvent,
    ) -> anyhow::Result<bool> {
        let served = match *event {
            StopEvent::Breakpoint { pc, .. } => {
                let stop = Instant::now();
                let ours = self.armed.contains(&pc);
                if ours {
                    if let Err(e) = self.lazy_stop(session, image, pc) {
                        // The stub's `jmp` is whole either way (to the original, or to a
                        // translation written before the failure): the guest goes on.
                        if session.machine.set_breakpoint(pc, false).is_ok() {
                            self.armed.remove(&pc);
                        }
                        session.resume()?;
                        return Err(e);
                    }
                } else {
                    self.lazy.other_stops += 1;
                }
                self.lazy.stopped += stop.elapsed();
                ours
            }
            // A stop nobody asked for (an interrupt the stub answered late): go on.
            StopEvent::Stepped { .. } | StopEvent::Paused | StopEvent::Watchpoint { .. } => false,
            StopEvent::Exited => return Ok(false),
        };
        session.resume()?;
        Ok(served)
    }

    /// One lazy-translation stop (the guest stopped at the stub at `stub`): translates the
    /// stub's target from the session's text, appends it to the cache and writes its
    /// lookup-table slots, arms the stubs it brings, turns the stub into a `jmp` to the
    /// translation, takes the breakpoint out and splices the function's entry. A target
    /// that cannot be translated keeps its stub's `jmp` to the original code; a full cache
    /// takes every breakpoint out (from then on stubs run the original code).
    fn lazy_stop(
        &mut self,
        session: &mut GuestSession,
        image: &KernelImage,
        stub: u64,
    ) -> anyhow::Result<()> {
        self.lazy.stops += 1;
        let slide = session.survey.kaslr.slide;
        let Some(translator) = self.translator.as_mut() else {
            self.lazy.order.push(format!("(no translator) {stub:#x}"));
            return Ok(());
        };
        let Some(target) = translator.stub_target(stub) else {
            self.lazy.order.push(format!("(no stub) {stub:#x}"));
            return Ok(());
        };
        let name = name_of(image, slide, target);
        self.lazy.order.push(name.clone());
        let (machine, splicer) = session.parts()?;
        splicer.kernel.prepare(machine, &[target])?;
        let ctx = splicer.kernel.context();
        let function = ctx
            .analysis
            .function_containing(target)
            .filter(|f| f.cfg.start() == target);
        // The kernel may have changed the function since its text was read (a jump label it
        // flipped): what is there now is translated.
        let made = function.map(|f| {
            let (start, end) = (f.cfg.start(), f.cfg.end());
            let known = ctx.text.range(start, end).unwrap_or_default().to_vec();
            let mut now = vec![0u8; known.len()];
            let read = match (&splicer.shared, splicer.kernel.phys(start)) {
                (Some(shared), Some(phys)) => shared.read_phys(phys, &mut now).is_ok(),
                _ => machine.read_virt(VcpuId(0), start, &mut now).is_ok(),
            };
            if !read || now == known {
                let insns: Vec<u64> = f.cfg.insns().iter().map(|i| i.addr).collect();
                translator
                    .translate(ctx.text, f)
                    .map(|()| (start, end, known, insns))
            } else {
                self.lazy.changed_text += 1;
                let fresh = exotap_introspect::x86::FunctionAnalysis::analyze(
                    &now,
                    start,
                    &splicer.kernel.facts.config,
                );
                let insns: Vec<u64> = fresh.cfg.insns().iter().map(|i| i.addr).collect();
                match exotap_introspect::x86::CodeView::new(start, &now) {
                    Ok(view) => translator
                        .translate(view, &fresh)
                        .map(|()| (start, end, now.clone(), insns)),
                    Err(_) => Err(TranslateError::NoCode { start }),
                }
            }
        });
        let translated = match made {
            None => Err("no analysed function starts there".to_owned()),
            Some(made) => match made {
                Ok((start, end, bytes, insns)) => {
                    self.sources.push((start, end, bytes, insns));
                    self.source_bytes += end - start;
                    Ok(())
                }
                Err(e @ TranslateError::Full { .. }) => {
                    self.lazy.full = Some(format!("{e:#}"));
                    Err(format!("{e:#}"))
                }
                Err(e) => Err(format!("{e:#}")),
            },
        };
        let link = translator.link()?;
        let resolve = translator.resolve(target);
        write_link(machine, splicer, &link)?;
        for &(_, new_stub) in &link.stubs {
            if self.lazy.full.is_none() && machine.set_breakpoint(new_stub, true).is_ok() {
                self.armed.insert(new_stub);
            }
        }
        if let Some((at, jump)) = resolve {
            splicer.write_heap(machine, at, &jump)?;
            let off = usize::try_from(at - self.translation.code_at)?;
            if let Some(code) = self.translation.code.get_mut(off..off + jump.len()) {
                code.copy_from_slice(&jump);
            }
        }
        machine.set_breakpoint(stub, false)?;
        self.armed.remove(&stub);
        if self.lazy.full.is_some() {
            tracing::warn!(
                "the code cache is full: lazy translation stops, untranslated targets run their original code"
            );
            for armed in std::mem::take(&mut self.armed) {
                machine.set_breakpoint(armed, false)?;
            }
        }
        self.apply(&link);
        let entry = match translated {
            Ok(()) => link
                .functions
                .iter()
                .find(|f| f.start == target)
                .map(|f| f.entry),
            Err(why) => {
                tracing::info!("lazy translation of {name} refused: {why}");
                self.refused.push((name.clone(), why));
                None
            }
        };
        let Some(entry) = entry else {
            return Ok(());
        };
        self.lazy.translated += 1;
        tracing::info!(
            "lazy translation {}: {name} at {target:#x} ({} blocks)",
            self.lazy.stops,
            link.blocks.len()
        );
        self.names.insert(target, name.clone());
        // Without its entry splice the function is still entered from translated code.
        match session.install(&[Request {
            name: name.clone(),
            addr: target,
            action: Action::Enter(entry),
        }]) {
            Ok(report) => {
                if report.refused.is_empty() {
                    self.lazy.entries += 1;
                }
                self.entries.refused.extend(report.refused);
            }
            Err(e) => tracing::warn!("no entry splice for {name}, translated lazily: {e:#}"),
        }
        self.entries_installed = session.splicer().map_or(0, |s| s.installed.len());
        Ok(())
    }

    /// Adds a link's code, blocks, functions, exits, stubs and table slots to the host's
    /// copy of the translation.
    pub(super) fn apply(&mut self, link: &Link) {
        let t = &mut self.translation;
        let end = t.code_at + t.code.len() as u64;
        if link.code_at == end {
            t.code.extend_from_slice(&link.code);
        }
        t.blocks.extend_from_slice(&link.blocks);
        for f in &link.functions {
            t.functions.insert(f.start, *f);
        }
        t.exits.extend_from_slice(&link.exits);
        t.counters = link.counters.clone();
        for &(target, stub) in &link.stubs {
            t.stubs.insert(target, stub);
        }
        self.lazy.stubs = t.stubs.len();
        for (at, bytes) in &link.table {
            let off = (at - t.table_at) as usize;
            if let Some(slot) = t.table.get_mut(off..off + 16) {
                slot.copy_from_slice(bytes);
            }
        }
        if let Some(tr) = &self.translator {
            t.table_entries = tr.table_entries();
        }
    }
}
