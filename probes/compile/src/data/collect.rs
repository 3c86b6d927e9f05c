//! The host's collector of the string table: frees the entries no global holds any more, so
//! a script that keeps replacing built strings (`trace[tid()] = argstr` at every system call,
//! `delete trace[tid()]` at its return: SystemTap's errsnoop.stp) runs for as long as it
//! likes instead of filling the table's [`STRING_ENTRIES`] within seconds.
//!
//! The guest never frees an entry: it cannot know when the last copy of an encoding goes (a
//! 16-byte string is copied freely, into locals, keys and values). The host can, at a
//! moment when every encoding is in the globals: with the guest stopped and no compiled hit
//! in progress on any vCPU. Every compiled body (and every `@entry(...)` computation) counts
//! itself in its CPU's word of the table's head at its start and out at its end, on every
//! way out (a probe error, MAXACTION, `next` all leave through the body's end); a count, as
//! a body may interrupt another on its CPU (a probe on a function an interrupt handler
//! runs). The body keeps the word's address in its catch record, so it counts itself out
//! of the word it counted itself into even if its task moved to another CPU in between.
//!
//! A collection then marks every entry a global holds (a string scalar, a string key or
//! value of an array element that is published or being written; a deleted element's key
//! and value are garbage: an insert of the same key rewrites both) and every entry the host
//! pinned ([`Interner::pin_placed`]: the long constants code generation placed, which the
//! code itself holds), and frees the rest: state 3, a tombstone, so the open-addressing
//! chains of the entries after it stay whole (as deleted array elements do). The guest's
//! `intern` passes tombstones when it looks a text up and takes the chain's first one for a
//! text it did not find (`lock cmpxchg` 3 → 1, as for a free entry 0 → 1; a vCPU that loses
//! the race looks again from the chain's start); a tombstone just before a free entry is
//! freed outright, since a lookup would stop there anyway. The head's count of entries in
//! use, which the guest raises at each claim, is set to what is left.
//!
//! What else could hold a table index, and why it needs nothing: output records get the
//! text, never the index; the host's own copies of the globals hold texts; strings the host
//! writes back are placed afresh ([`DataLayout::update_into`]), their entries forgotten here
//! once freed. One thing does: an `@entry(...)` string value, which the call's slot in the
//! table of calls in flight keeps from the entry to the return, outside any hit and any
//! global. A script with such values keeps its table uncollected ([`StringTable::collectable`]
//! is false), and fills it as before.

use std::collections::HashSet;

use super::*;

/// What one collection did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collection {
    /// Compiled hits were in progress (this many, over all CPUs): one may hold an index
    /// in a register or on its stack, so nothing was freed.
    Busy(u64),
    /// The entries freed, and those left in use.
    Collected {
        /// Entries freed.
        freed: u64,
        /// Entries still in use.
        live: u64,
    },
}

/// What the collector did over a run, for the run's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collections {
    /// Collections that freed what no global held.
    pub collections: u64,
    /// Entries they freed.
    pub freed: u64,
    /// Attempts given up because a vCPU was in a compiled hit.
    pub busy: u64,
}

impl Collections {
    /// Counts one attempt.
    pub fn count(&mut self, c: Collection) {
        match c {
            Collection::Busy(_) => self.busy += 1,
            Collection::Collected { freed, .. } => {
                self.collections += 1;
                self.freed += freed;
            }
        }
    }
}

impl StringTable {
    /// The entries in use, from the table's head (its bytes from [`StringTable::head`]).
    pub fn in_use(head: &[u8]) -> u64 {
        word(head, IN_USE)
    }

    /// The compiled hits in progress over all CPUs, from the table's head (as
    /// [`StringTable::in_use`]); each CPU's count wraps as the guest's `lock dec` does.
    pub fn hits_in_progress(head: &[u8]) -> u64 {
        (0..u64::from(HIT_CPUS))
            .map(|cpu| word(head, HITS + cpu * HIT_STRIDE))
            .fold(0u64, u64::wrapping_add)
    }

    /// Whether a table with `in_use` entries in use is worth collecting: past a quarter
    /// full, so that chains stay short and a burst of new strings finds room until the next
    /// look (errsnoop.stp, a new string at every system call, filled the other half of a
    /// table collected past half full between two looks 250 ms apart).
    pub fn wants_collecting(&self, in_use: u64) -> bool {
        self.collectable && in_use.saturating_mul(4) > u64::from(self.entries)
    }

    fn state(&self, data: &[u8], index: u64) -> u64 {
        word(data, self.offset + index * self.entry_size())
    }

    fn set_state(&self, data: &mut [u8], index: u64, state: u64) {
        put_word(data, self.offset + index * self.entry_size(), state);
    }
}

impl DataLayout {
    /// Collects the string table in `data` (the data's bytes from its start, at least
    /// `globals_size`, read with the guest stopped), in place: `None` when there is no
    /// collectable table. The caller writes back what changed before the guest resumes.
    pub fn collect_strings(&self, data: &mut [u8], interner: &mut Interner) -> Option<Collection> {
        let table = self.strings.filter(|t| t.collectable)?;
        let head = bytes_at(data, table.head, STRING_TABLE_HEAD as usize);
        let hits = StringTable::hits_in_progress(head);
        if hits != 0 {
            return Some(Collection::Busy(hits));
        }
        let entries = u64::from(table.entries);
        let mut held = vec![false; table.entries as usize];
        let mut hold = |raw: &[u8]| {
            if raw.first() == Some(&2) {
                let index = word(raw, 8);
                if let Some(h) = usize::try_from(index).ok().and_then(|i| held.get_mut(i)) {
                    *h = true;
                }
            }
        };
        for slot in self.globals.values() {
            self.global_strings(slot, data, &mut hold);
        }
        for index in interner.pinned.iter() {
            hold(&string_encoding(*index));
        }
        let mut freed = HashSet::new();
        for index in 0..entries {
            if table.state(data, index) == 2 && !held[index as usize] {
                table.set_state(data, index, 3);
                freed.insert(index);
            }
        }
        // A tombstone before a free entry ends its chain as the free entry would: freed
        // outright, from the last of a run back.
        let mask = entries - 1;
        let mut changed = true;
        while changed {
            changed = false;
            for index in 0..entries {
                if table.state(data, index) == 3 && table.state(data, (index + 1) & mask) == 0 {
                    table.set_state(data, index, 0);
                    changed = true;
                }
            }
        }
        let live = (0..entries)
            .filter(|i| matches!(table.state(data, *i), 1 | 2))
            .count() as u64;
        put_word(data, table.head + IN_USE, live);
        interner.placed.retain(|_, index| !freed.contains(index));
        Some(Collection::Collected {
            freed: freed.len() as u64,
            live,
        })
    }

    /// Calls `hold` with every 16-byte string encoding global `slot` holds in `data`.
    fn global_strings(&self, slot: &GlobalSlot, data: &[u8], hold: &mut dyn FnMut(&[u8])) {
        let Some((keys, cap)) = slot.table else {
            if slot.value == ValueKind::Str {
                hold(bytes_at(data, slot.offset, 16));
            }
            return;
        };
        for i in 0..u64::from(cap) {
            let e = slot.offset + TABLE_HEADER + i * slot.entry_size();
            if !matches!(word(data, e), 1 | 2) {
                continue;
            }
            for (k, is_str) in slot.key_is_str.iter().enumerate().take(keys) {
                if *is_str {
                    hold(bytes_at(data, e + ENTRY_KEYS + k as u64 * KEY, 16));
                }
            }
            if slot.value == ValueKind::Str {
                hold(bytes_at(data, e + slot.value_offset(), 16));
            }
        }
    }
}

/// The encoding of a string in entry `index` of the table.
fn string_encoding(index: u64) -> [u8; 16] {
    let mut raw = [0u8; 16];
    raw[0] = 2;
    raw[8..].copy_from_slice(&index.to_le_bytes());
    raw
}

fn put_word(data: &mut [u8], at: u64, value: u64) {
    if let Some(to) = usize::try_from(at)
        .ok()
        .and_then(|at| data.get_mut(at..at.checked_add(8)?))
    {
        to.copy_from_slice(&value.to_le_bytes());
    }
}

impl Interner {
    /// Pins every entry the host placed in the string table so far: code generated since
    /// may hold their encodings (a long constant whose text a global's initial value placed),
    /// which no global shows the collector. Called once the sites' code is generated.
    pub fn pin_placed(&mut self) {
        self.pinned.extend(self.placed.values().copied());
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{program, tiny_table};
    use super::*;

    /// A layout with a string scalar `s` and an array `a` of strings by string, its table's
    /// entries 0..n in use with distinct texts, `s` holding entry 1 and `a["k"]` entry 2.
    fn collected(hits: u64) -> (DataLayout, Vec<u8>, Option<Collection>) {
        let prog = program(
            r#"global s, a; probe kernel.function("f") { s = execname() . "-a-long-string"; a[s] = s . "x" }"#,
        );
        let layout = DataLayout::new(&prog, &Limits::default()).expect("lays out");
        let t = layout.strings.expect("a string table");
        let mut data = vec![0u8; layout.globals_size as usize];
        for i in 0..8u64 {
            let text = format!("text-number-{i}-over-fifteen");
            // Placed where its hash says: the index is whatever place() picked.
            t.place(&mut data, &text).expect("room");
        }
        let index_of = |data: &[u8], text: &str| {
            (0..u64::from(t.entries))
                .find(|i| t.state(data, *i) == 2 && t.text_of(data, *i).as_deref() == Some(text))
                .expect("placed")
        };
        let one = index_of(&data, "text-number-1-over-fifteen");
        let two = index_of(&data, "text-number-2-over-fifteen");
        let s = layout.globals["s"].offset;
        data[s as usize..s as usize + 16].copy_from_slice(&string_encoding(one));
        let a = &layout.globals["a"];
        let e = (a.offset + TABLE_HEADER) as usize;
        put_word(&mut data, e as u64, 2);
        data[e + ENTRY_KEYS as usize..][..16].copy_from_slice(b"k\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
        data[e + a.value_offset() as usize..][..16].copy_from_slice(&string_encoding(two));
        put_word(&mut data, t.head + HITS + 5 * HIT_STRIDE, hits);
        let got = layout.collect_strings(&mut data, &mut Interner::default());
        (layout, data, got)
    }

    #[test]
    fn entries_no_global_holds_are_freed_and_held_ones_kept() {
        let (layout, data, got) = collected(0);
        let t = layout.strings.unwrap();

        let texts: Vec<String> = (0..u64::from(t.entries))
            .filter(|i| t.state(&data, *i) == 2)
            .filter_map(|i| t.text_of(&data, i))
            .collect();

        assert_eq!(got, Some(Collection::Collected { freed: 6, live: 2 }));
        assert_eq!(
            texts.iter().map(String::as_str).collect::<HashSet<_>>(),
            HashSet::from(["text-number-1-over-fifteen", "text-number-2-over-fifteen"])
        );
        let head = bytes_at(&data, t.head, STRING_TABLE_HEAD as usize);
        assert_eq!(StringTable::in_use(head), 2);
    }

    #[test]
    fn nothing_is_freed_while_a_cpu_is_in_a_hit() {
        let (layout, data, got) = collected(1);
        let t = layout.strings.unwrap();

        let ready = (0..u64::from(t.entries))
            .filter(|i| t.state(&data, *i) == 2)
            .count();

        assert_eq!((got, ready), (Some(Collection::Busy(1)), 8));
    }

    #[test]
    fn a_freed_entry_is_a_tombstone_that_keeps_its_chain_and_is_reused() {
        let (t, mut data) = tiny_table();
        // Three texts on one chain: entries 0, 1 and 2 (the index is the hash's low bits).
        let same_chain: Vec<String> = (0..)
            .map(|i| format!("chained-text-{i:04}-long"))
            .filter(|s| StringTable::hash(s.as_bytes()) & 3 == 0)
            .take(4)
            .collect();
        for s in &same_chain[..3] {
            t.place(&mut data, s).unwrap();
        }
        t.set_state(&mut data, 1, 3);

        let third = t.place(&mut data, &same_chain[2]);
        let fourth = t.place(&mut data, &same_chain[3]);

        // The third is found past the tombstone; the fourth takes it.
        assert_eq!((third, fourth), (Some(2), Some(1)));
    }
}
