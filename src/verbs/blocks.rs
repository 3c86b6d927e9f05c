//! `count --blocks` (the JIT): settling the guest at its waits, the guest's kprobe hits at
//! the leaders, line coverage, and the counts, cache and removal checks printed at removal.

use super::*;
use exotap_probes::live::session::Waiter;
use exotap_probes::live::stacks::KernelStacks;

/// `count --blocks` stops the guest at each wait only once the shell running its
/// `exotap_wait` sleeps in its read of the host's go byte ([`GuestSession::settle_at_wait`]:
/// busybox's `read -n 1 -u 9` polls the tty first, so the job's subshell, a fork of the
/// `/init` script and named after it, sleeps in `do_sys_poll`; the init shell itself sleeps
/// in `wait4` meanwhile, and a command the job runs has its own name): every
/// wait's window then starts and ends at the same point of the guest's work, and the
/// oracle's windows and the JIT's hold the same work. (A fixed pause of 2 s before the stop
/// alone was not enough on a loaded CI machine; it stays as a floor, [`SETTLE_FLOOR`].)
const WAITER: Waiter<'static> = Waiter {
    comm: "init",
    function: "do_sys_poll",
};
/// How long the guest runs on after announcing a wait before the reader check: a removed
/// kprobe's text is put back by the kernel's delayed optimizer worker (the block test arms
/// and removes the guest's own kprobe just before `unsplice`); without this floor a CI run
/// stopped the guest before that and found a text page changed.
const SETTLE_FLOOR: Duration = Duration::from_secs(2);
/// How long a wait may take to settle before the count goes on with a warning.
const SETTLE_LIMIT: Duration = Duration::from_secs(60);

impl VerbRun {
    /// `count --blocks`: gives up translations whose text the kernel changed
    /// ([`LiveJit::watch`]). A failure is a warning: the removal still runs.
    pub(super) fn watch_jit(&mut self) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let Live { session, jit, .. } = live;
        let Some(jit) = jit.as_mut() else {
            return;
        };
        // Lazy-translation stops first (the guest may be waiting at one), at most 500 ms a
        // tick so that the console keeps being read.
        if let Err(e) = jit.serve(
            session,
            &self.image,
            Duration::from_millis(1),
            Duration::from_millis(500),
        ) {
            eprintln!("exotap: warning: lazy translation failed: {e:#}");
        }
        if let Err(e) = jit.watch(session) {
            eprintln!(
                "exotap: warning: cannot compare the translated text with the guest's: {e:#}"
            );
        }
    }

    /// `count --blocks` at a `jit-mark` wait: the block counts so far are set aside
    /// ([`LiveJit::mark`]).
    pub(super) fn mark_jit(&mut self) -> anyhow::Result<()> {
        let Some(mut live) = self.live.take() else {
            return Ok(());
        };
        let settled = self.settle(&mut live.session);
        let live = self.live.insert(live);
        settled?;
        let Live { session, jit, .. } = live;
        match jit.as_mut() {
            Some(jit) => jit.mark(session),
            None => Ok(()),
        }
    }

    /// See [`WAITER`]; nothing for the other verbs. The guest is paused afterwards.
    pub(super) fn settle(&self, session: &mut GuestSession) -> anyhow::Result<()> {
        if !self.blocks.as_ref().is_some_and(|b| b.job_waits) {
            return Ok(());
        }
        let btf = self.image.btf()?;
        let layout = TaskLayout::from_btf(btf)?;
        let stacks = KernelStacks::load_with(&self.image, session.survey.kaslr.slide, Some(btf))?;
        // The kernel's own deferred text work (a removed kprobe's unoptimization runs from
        // a delayed worker) gets its time first, as it had before the reader check.
        if session.machine.is_paused() {
            session.resume()?;
        }
        std::thread::sleep(SETTLE_FLOOR);
        if !session.settle_at_wait(&layout, &stacks, &WAITER, SETTLE_LIMIT)? {
            eprintln!(
                "exotap: warning: the guest's wait reader (`{}` asleep in {}) was not seen after {} s: counts read now may hold part of its start",
                WAITER.comm,
                WAITER.function,
                SETTLE_LIMIT.as_secs()
            );
        }
        Ok(())
    }

    /// Reads the guest's kprobe hits per site at a `kprobes-in` or `kprobes-out` wait: attach,
    /// read, detach.
    pub(super) fn read_kprobe_sites(&mut self, target: &Target, at_in: bool) -> anyhow::Result<()> {
        if self.blocks.is_none() {
            return Ok(());
        }
        let mut session = GuestSession::attach(target, &self.image)?;
        self.settle(&mut session)?;
        let Some(blocks) = self.blocks.as_mut() else {
            return Ok(());
        };
        let btf = self.image.btf()?;
        let reader = KprobeReader::new(&session.survey, &self.image, btf)?;
        let hits = reader.read_sites(&mut *session.machine);
        session.detach()?;
        let hits = hits?;
        if at_in {
            blocks.kprobes_in = Some(hits);
        } else {
            blocks.kprobes_out = Some(hits);
        }
        Ok(())
    }

    /// Line coverage of the functions `ranges` (running addresses) from their block counts,
    /// as an lcov tracefile at `path`.
    pub(super) fn write_lcov(
        &mut self,
        path: &std::path::Path,
        slide: u64,
        ranges: &[(u64, u64)],
        counts: &[exotap_probes::live::jit::BlockCount],
    ) -> anyhow::Result<()> {
        let lines = crate::debuginfo::LineLookup::beside(&self.image.path).context(
            "line coverage needs the cached -dbg vmlinux (exotap image fetch --debuginfo)",
        )?;
        let link: Vec<(u64, u64)> = ranges
            .iter()
            .map(|(s, e)| (s.wrapping_sub(slide), e.wrapping_sub(slide)))
            .collect();
        let rows = lines.rows(&link);
        // Leaders per function, sorted: an address's block is the last leader at or below it.
        let mut leaders: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
        for b in counts {
            leaders
                .entry(b.function_addr.wrapping_sub(slide))
                .or_default()
                .push((b.leader.wrapping_sub(slide), b.count));
        }
        for v in leaders.values_mut() {
            v.sort_unstable();
        }
        let hits = |addr: u64| -> u64 {
            let Some((_, blocks)) = leaders.range(..=addr).next_back() else {
                return 0;
            };
            let i = blocks.partition_point(|(l, _)| *l <= addr);
            i.checked_sub(1).map_or(0, |i| blocks[i].1)
        };
        let functions: Vec<(String, String, u32, u64)> = link
            .iter()
            .filter_map(|(low, _)| {
                let (_, file, line) = rows.iter().find(|r| r.0 == *low)?;
                let name = self
                    .image
                    .symbols
                    .lookup_addr(*low)
                    .map(|(s, _)| s.name.clone())?;
                Some((name, file.clone(), *line, hits(*low)))
            })
            .collect();
        let text = crate::debuginfo::lcov(&rows, hits, &functions);
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!(
            "exotap: line coverage of {} functions ({} statement rows) written to {}",
            ranges.len(),
            rows.len(),
            path.display()
        );
        Ok(())
    }

    /// `count --blocks` at removal: counts, text restored, the cache unreachable; prints.
    pub(super) fn remove_blocks(&mut self, live: &mut Live, jit: LiveJit) -> anyhow::Result<()> {
        let slide = live.session.survey.kaslr.slide;
        let stats = JitStats {
            functions: jit.translation.functions.len(),
            requested: jit.requested.len(),
            source_bytes: jit.source_bytes,
            cache_bytes: jit.translation.code.len() as u64,
            blocks: jit.translation.blocks.len(),
            table_entries: jit.translation.table_entries,
            counter_copies: jit.counter_copies.len(),
            table_probes: jit.table_probes,
            translate_ms: jit.translate_time.as_secs_f64() * 1e3,
            entry_splices: jit.entries_installed,
            entries_refused: jit.entries_refused().len(),
            exits: jit
                .exits()
                .into_iter()
                .map(|(k, v)| (format!("{k:?}"), v))
                .collect(),
            refused: jit.refused.clone(),
            lazy: jit.lazy.clone(),
        };
        let invalidated = jit.invalidated.clone();
        let ranges: Vec<(u64, u64)> = jit
            .ranges()
            .into_iter()
            .filter(|(s, _)| jit.requested.contains(s))
            .collect();
        let removal = jit.remove(&mut live.session, &self.image)?;
        // What still points into the cache (nothing, when the removal went right).
        let found: Vec<String> = removal
            .reach
            .found
            .iter()
            .map(|(w, v)| format!("{w}: {v:#x}"))
            .collect();
        if let Some(path) = self.blocks.as_ref().and_then(|b| b.lcov.clone()) {
            self.write_lcov(&path, slide, &ranges, &removal.counts)?;
        }
        let Some(blocks) = self.blocks.clone() else {
            return Ok(());
        };
        let kprobe = |function: &str, offset: u64| -> Option<u64> {
            let (out, inn) = (blocks.kprobes_out.as_ref()?, blocks.kprobes_in.as_ref()?);
            let (h1, m1) = *out.get(&(function.to_owned(), offset))?;
            let (h0, m0) = inn
                .get(&(function.to_owned(), offset))
                .copied()
                .unwrap_or_default();
            Some((h1 + m1).saturating_sub(h0 + m0))
        };
        let shown: Vec<&exotap_probes::live::jit::BlockCount> = removal
            .counts
            .iter()
            .filter(|b| blocks.all || b.requested)
            .collect();
        let mut groups: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for b in &shown {
            groups
                .entry(b.function_addr.wrapping_sub(slide))
                .or_default()
                .push(b.leader.wrapping_sub(slide));
        }
        let groups: Vec<(u64, Vec<u64>)> = groups.into_iter().collect();
        let lines = crate::debuginfo::LineLookup::beside(&self.image.path)
            .map(|l| l.lines(&groups))
            .unwrap_or_default();
        let line_of = |leader: u64| lines.get(&leader.wrapping_sub(slide)).cloned();
        let text_identical =
            removal.text.differing.is_empty() && removal.text.before == removal.text.after;
        match blocks.format {
            BlockFormat::Json => {
                let rows: Vec<serde_json::Value> = shown
                    .iter()
                    .map(|b| {
                        let offset = b.leader - b.function_addr;
                        serde_json::json!({
                            "function": b.function,
                            "offset": offset,
                            "address": format!("{:#x}", b.leader),
                            "link_address": format!("{:#x}", b.leader.wrapping_sub(slide)),
                            "line": line_of(b.leader),
                            "count": b.count,
                            "requested": b.requested,
                            "kprobe": kprobe(&b.function, offset),
                        })
                    })
                    .collect();
                let doc = serde_json::json!({
                    "blocks": rows,
                    "cache": {
                        "functions": stats.functions,
                        "requested": stats.requested,
                        "depth": blocks.depth,
                        "source_bytes": stats.source_bytes,
                        "cache_bytes": stats.cache_bytes,
                        "blocks": stats.blocks,
                        "table_entries": stats.table_entries,
                        "counter_copies": stats.counter_copies,
                        "lookup_probes": {
                            "mean": stats.table_probes.0,
                            "most": stats.table_probes.1,
                            "longest_run": stats.table_probes.2,
                        },
                        "translate_ms": stats.translate_ms,
                        "entry_splices": stats.entry_splices,
                        "entries_refused": stats.entries_refused,
                        "exits": stats.exits,
                        "refused": stats.refused,
                    },
                    "lazy": {
                        "on": stats.lazy.on,
                        "stops": stats.lazy.stops,
                        "stops_at_mark": stats.lazy.stops_at_mark,
                        "stops_after_mark": stats.lazy.stops_at_mark.map(|m| stats.lazy.stops - m),
                        "after_mark": stats.lazy.stops_at_mark.map(|m| {
                            stats.lazy.order.get(usize::try_from(m).unwrap_or(usize::MAX)..).unwrap_or_default()
                        }),
                        "translated": stats.lazy.translated,
                        "entry_splices": stats.lazy.entries,
                        "stubs": stats.lazy.stubs,
                        "stopped_ms": stats.lazy.stopped.as_secs_f64() * 1e3,
                        "full": stats.lazy.full,
                        "other_stops": stats.lazy.other_stops,
                        "changed_text": stats.lazy.changed_text,
                    },
                    "text": {
                        "pages": removal.text.pages,
                        "sha256_before": removal.text.before,
                        "sha256_after": removal.text.after,
                        "identical": text_identical,
                    },
                    "invalidated": invalidated.iter().map(|i| serde_json::json!({
                        "function": i.function,
                        "at": format!("{:#x}", i.at),
                        "offset": i.at - i.start,
                        "was": i.was,
                        "now": i.now,
                        "retranslated": i.retranslated,
                    })).collect::<Vec<_>>(),
                    "cache_unreachable": {
                        "unreachable": removal.reach.unreachable(),
                        "checks": removal.reach.checks,
                        "tasks": removal.reach.tasks,
                        "frames_unwound": removal.reach.frames,
                        "found": found,
                    },
                });
                self.say(&serde_json::to_string_pretty(&doc)?);
            }
            BlockFormat::Text => {
                self.say(&format!(
                    "JIT: {} functions translated ({} asked for, callees to depth {}) in {:.1} ms: {} bytes of text, {} blocks, {} bytes of cache, {} lookup entries, {}; {} entry splices ({} entries take none); cache exits {:?}",
                    stats.functions,
                    stats.requested,
                    blocks.depth,
                    stats.translate_ms,
                    stats.source_bytes,
                    stats.blocks,
                    stats.cache_bytes,
                    stats.table_entries,
                    if stats.counter_copies > 1 {
                        format!("a copy of the counters per CPU ({})", stats.counter_copies)
                    } else {
                        "counters shared by the CPUs".to_owned()
                    },
                    stats.entry_splices,
                    stats.entries_refused,
                    stats.exits
                ));
                if stats.lazy.on {
                    let l = &stats.lazy;
                    self.say(&format!(
                        "lazy translation: {} stops ({} after jit-mark), {} functions translated, {} entry splices, {} stubs, {:.0} ms stopped{}",
                        l.stops,
                        l.stops_at_mark.map_or_else(|| "-".to_owned(), |m| (l.stops - m).to_string()),
                        l.translated,
                        l.entries,
                        l.stubs,
                        l.stopped.as_secs_f64() * 1e3,
                        l.full.as_ref().map_or_else(String::new, |f| format!("; stopped early: {f}"))
                    ));
                }
                for (name, why) in &stats.refused {
                    self.say(&format!("not translated {name}: {why}"));
                }
                for i in &invalidated {
                    self.say(&format!(
                        "invalidated {}: the kernel changed its text at +{:#x} ({:02x} -> {:02x}); {}",
                        i.function,
                        i.at - i.start,
                        i.was,
                        i.now,
                        if i.retranslated {
                            "translated again from the new text"
                        } else {
                            "it ran its original code from then on"
                        }
                    ));
                }
                let with_kprobes = blocks.kprobes_out.is_some();
                self.say(&if with_kprobes {
                    format!(
                        "{:>12}  {:>12}  {:<18}  BLOCK",
                        "COUNT", "KPROBE", "ADDRESS"
                    )
                } else {
                    format!("{:>12}  {:<18}  BLOCK", "COUNT", "ADDRESS")
                });
                for b in &shown {
                    let offset = b.leader - b.function_addr;
                    let line = line_of(b.leader)
                        .map(|l| format!("  {l}"))
                        .unwrap_or_default();
                    let block = format!("{}+{offset:#x}", b.function);
                    if with_kprobes {
                        let k = kprobe(&b.function, offset)
                            .map_or_else(|| "-".to_owned(), |k| k.to_string());
                        self.say(&format!(
                            "{:>12}  {k:>12}  {:#018x}  {block}{line}",
                            b.count, b.leader
                        ));
                    } else {
                        self.say(&format!(
                            "{:>12}  {:#018x}  {block}{line}",
                            b.count, b.leader
                        ));
                    }
                }
                self.say(&format!(
                    "text: {} page{} touched; sha256 before {} after {}: {}",
                    removal.text.pages,
                    if removal.text.pages == 1 { "" } else { "s" },
                    &removal.text.before[..16.min(removal.text.before.len())],
                    &removal.text.after[..16.min(removal.text.after.len())],
                    if text_identical {
                        "identical"
                    } else {
                        "DIFFERENT"
                    }
                ));
                if removal.reach.unreachable() {
                    self.say(&format!(
                        "code cache unreachable: no vCPU RIP and no return address on a kernel stack points into it ({} check{}, {} tasks, {} frames unwound)",
                        removal.reach.checks,
                        if removal.reach.checks == 1 { "" } else { "s" },
                        removal.reach.tasks,
                        removal.reach.frames
                    ));
                } else {
                    self.say(&format!(
                        "code cache STILL REACHABLE after {} checks: {}",
                        removal.reach.checks,
                        found.join(", ")
                    ));
                }
            }
        }
        if !text_identical {
            bail!(
                "{} text pages differ after removal",
                removal.text.differing.len()
            );
        }
        if !removal.reach.unreachable() {
            bail!(
                "the code cache is still reachable ({}); the patch heap must not be reused",
                found.join(", ")
            );
        }
        Ok(())
    }
}

/// What `count --blocks` says about the cache.
#[derive(Debug)]
struct JitStats {
    functions: usize,
    requested: usize,
    source_bytes: u64,
    cache_bytes: u64,
    blocks: usize,
    table_entries: usize,
    /// Copies of the block counters: one per CPU, or 1 (shared, `lock inc`).
    counter_copies: usize,
    /// Lookup probes a hit takes (mean, most) and the longest run of full slots.
    table_probes: (f64, usize, usize),
    translate_ms: f64,
    entry_splices: usize,
    entries_refused: usize,
    exits: BTreeMap<String, usize>,
    refused: Vec<(String, String)>,
    lazy: exotap_probes::live::jit::LazyStats,
}
