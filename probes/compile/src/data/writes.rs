//! The host's writes into a compiled script's data: a global encoded whole (the initial
//! bytes, a store as the guest would have built it) or edited in place with only what a host
//! probe changed ([`DataLayout::update_into`], what the host writes back after a pull).

use indexmap::IndexMap;

use exotap_lang::eval::Store;
use exotap_lang::value::{Stats, Value};

use super::*;

impl DataLayout {
    /// Encodes `store` as global `name`'s bytes into `data` (the whole data area), as the
    /// guest would have built it. Returns the byte range written.
    ///
    /// # Errors
    /// When the store does not fit the slot (a different shape, or more entries than the
    /// table can hold).
    pub fn encode_into(
        &self,
        name: &str,
        store: &Store,
        interner: &mut Interner,
        data: &mut [u8],
    ) -> Result<std::ops::Range<usize>, String> {
        let slot = self
            .globals
            .get(name)
            .ok_or_else(|| format!("{name} is not compiled"))?;
        let start = usize::try_from(slot.offset).map_err(|e| e.to_string())?;
        let end = start + usize::try_from(slot.size()).map_err(|e| e.to_string())?;
        self.place_strings(store, interner, data);
        let area = data
            .get_mut(start..end)
            .ok_or("the data area is too small")?;
        area.fill(0);
        match (store, slot.table, slot.value) {
            (Store::Scalar(v), None, kind) => put_value(area, 0, v, kind, interner),
            (Store::Stats(s), None, ValueKind::Stats(layout)) => put_stats(area, 0, s, layout),
            (Store::Array(map), Some((keys, cap)), kind) => {
                for (k, v) in map {
                    let e = place(area, slot, keys, cap, k, interner)?;
                    put_value(area, e + slot.value_offset() as usize, v, kind, interner);
                }
            }
            (Store::StatsArray(map), Some((keys, cap)), ValueKind::Stats(layout)) => {
                for (k, s) in map {
                    let e = place(area, slot, keys, cap, k, interner)?;
                    put_stats(area, e + slot.value_offset() as usize, s, layout);
                }
            }
            _ => return Err(format!("{name} changed shape")),
        }
        Ok(start..end)
    }
}

impl DataLayout {
    /// Long strings of `store` go where the guest would intern the same text, so that a
    /// string the host gives back equals one a probe builds (and the guest can read it).
    fn place_strings(&self, store: &Store, interner: &mut Interner, data: &mut [u8]) {
        let Some(table) = self.strings else {
            return;
        };
        let mut long = Vec::new();
        store_strings(store, &mut |s: &str| {
            if s.len() >= 16 || matches!(s.as_bytes().first(), Some(1 | 2)) {
                long.push(s.to_owned());
            }
        });
        for s in long {
            if let std::collections::hash_map::Entry::Vacant(e) = interner.placed.entry(s) {
                if let Some(index) = table.place(data, e.key()) {
                    e.insert(index);
                }
            }
        }
    }

    /// Edits `data` (the bytes a pull read, the guest stopped) so that global `name` holds
    /// `after` where the pull decoded `before`, touching only what changed: a scalar the
    /// host's probes left alone is not rewritten, an array's elements keep their slots, a
    /// new key takes a slot as the guest's insert would (the first free or deleted one of
    /// its chain) and a removed key's slot is marked deleted. Everything else stays as the
    /// guest left it, above all an element a vCPU stopped in the middle of writing (state
    /// 1: no key yet, or its value not yet zeroed): re-encoding the table whole would wipe
    /// it, and the vCPU would then publish it without its key (a lost element, seen in
    /// check mode as a key absent right after its insert).
    ///
    /// # Errors
    /// When the stores do not fit the slot (a different shape, or no slot left for a key).
    pub fn update_into(
        &self,
        name: &str,
        before: &Store,
        after: &Store,
        interner: &mut Interner,
        data: &mut [u8],
    ) -> Result<(), String> {
        if before == after {
            return Ok(());
        }
        let slot = self
            .globals
            .get(name)
            .ok_or_else(|| format!("{name} is not compiled"))?;
        let Some((keys, cap)) = slot.table else {
            self.encode_into(name, after, interner, data)?;
            return Ok(());
        };
        self.place_strings(after, interner, data);
        let start = usize::try_from(slot.offset).map_err(|e| e.to_string())?;
        let end = start + usize::try_from(slot.size()).map_err(|e| e.to_string())?;
        let area = data
            .get_mut(start..end)
            .ok_or("the data area is too small")?;
        let table = Table {
            slot,
            keys,
            cap,
            area,
        };
        match (before, after, slot.value) {
            (Store::Array(b), Store::Array(a), kind) => {
                table.update(b, a, interner, &mut |area, at, v, interner| {
                    put_value(area, at, v, kind, interner)
                })
            }
            (Store::StatsArray(b), Store::StatsArray(a), ValueKind::Stats(layout)) => {
                table.update(b, a, interner, &mut |area, at, s, _| {
                    put_stats(area, at, s, layout)
                })
            }
            _ => Err(format!("{name} changed shape")),
        }
    }
}

/// Writes one element's value at an offset of a table's bytes.
type PutValue<'f, V> = dyn FnMut(&mut [u8], usize, &V, &mut Interner) + 'f;

/// One array's bytes in the data, as [`DataLayout::update_into`] edits them.
struct Table<'a> {
    slot: &'a GlobalSlot,
    keys: usize,
    cap: u32,
    area: &'a mut [u8],
}

impl Table<'_> {
    fn entry(&self, i: u64) -> usize {
        TABLE_HEADER as usize + i as usize * self.slot.entry_size() as usize
    }

    /// The entry of the published element with key `words`, as the guest's lookup finds it.
    fn find(&self, words: &[u64]) -> Option<usize> {
        let mask = u64::from(self.cap) - 1;
        let mut i = hash_key(words) & mask;
        for _ in 0..MAX_PROBES.min(self.cap) {
            let e = self.entry(i);
            match word(self.area, e as u64) {
                0 => return None,
                2 if words
                    .iter()
                    .enumerate()
                    .all(|(k, w)| word(self.area, e as u64 + ENTRY_KEYS + 8 * k as u64) == *w) =>
                {
                    return Some(e)
                }
                _ => {}
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// A slot for a key known absent: the first free or deleted one of its chain (never
    /// one a vCPU is writing), published with the key and the next insertion number.
    fn claim(&mut self, words: &[u64]) -> Option<usize> {
        let mask = u64::from(self.cap) - 1;
        let mut i = hash_key(words) & mask;
        for _ in 0..MAX_PROBES.min(self.cap) {
            let e = self.entry(i);
            if matches!(word(self.area, e as u64), 0 | 3) {
                let seq = word(self.area, TABLE_SEQUENCE);
                put(self.area, TABLE_SEQUENCE as usize, seq + 1);
                put(self.area, e + 8, seq);
                for (k, w) in words.iter().enumerate() {
                    put(self.area, e + ENTRY_KEYS as usize + 8 * k, *w);
                }
                put(self.area, e, 2);
                let count = word(self.area, TABLE_COUNT);
                put(self.area, TABLE_COUNT as usize, count + 1);
                return Some(e);
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Applies the difference between `before` and `after` element by element.
    fn update<V: PartialEq>(
        mut self,
        before: &IndexMap<Vec<Value>, V>,
        after: &IndexMap<Vec<Value>, V>,
        interner: &mut Interner,
        put_one: &mut PutValue<'_, V>,
    ) -> Result<(), String> {
        let value = self.slot.value_offset() as usize;
        let size = self.slot.value.size() as usize;
        // Removed keys first, so that their slots can take new ones.
        for k in before.keys().filter(|k| !after.contains_key(*k)) {
            let words = key_words(k, interner);
            if let Some(e) = self.find(&words) {
                put(self.area, e, 3);
                let count = word(self.area, TABLE_COUNT);
                put(self.area, TABLE_COUNT as usize, count.saturating_sub(1));
            }
        }
        for (k, v) in after {
            if before.get(k) == Some(v) {
                continue;
            }
            let words = key_words(k, interner);
            if words.len() != self.keys * 2 {
                return Err(format!(
                    "a key of {} values in an array of {}",
                    k.len(),
                    self.keys
                ));
            }
            let e = match self.find(&words) {
                Some(e) => e,
                None => self
                    .claim(&words)
                    .ok_or("the table has no room for the host's entries")?,
            };
            if let Some(v) = self.area.get_mut(e + value..e + value + size) {
                v.fill(0);
            }
            put_one(self.area, e + value, v, interner);
        }
        Ok(())
    }
}

/// Calls `f` on every string in `store` (keys and values).
fn store_strings(store: &Store, f: &mut impl FnMut(&str)) {
    let mut value = |v: &Value| {
        if let Value::Str(s) = v {
            f(s);
        }
    };
    match store {
        Store::Scalar(v) => value(v),
        Store::Array(map) => {
            for (k, v) in map {
                k.iter().for_each(&mut value);
                value(v);
            }
        }
        Store::StatsArray(map) => {
            for k in map.keys() {
                k.iter().for_each(&mut value);
            }
        }
        _ => {}
    }
}

fn put(area: &mut [u8], at: usize, v: u64) {
    if let Some(b) = area.get_mut(at..at + 8) {
        b.copy_from_slice(&v.to_le_bytes());
    }
}

fn put_value(area: &mut [u8], at: usize, v: &Value, kind: ValueKind, interner: &mut Interner) {
    match kind {
        ValueKind::Long => put(area, at, v.as_long() as u64),
        ValueKind::Str => {
            if let Some(b) = area.get_mut(at..at + 16) {
                b.copy_from_slice(&interner.encode(v.as_str()));
            }
        }
        ValueKind::Stats(_) => {}
    }
}

/// Writes a statistics value; an empty one gets the min/max sentinels the guest expects.
fn put_stats(area: &mut [u8], at: usize, s: &Stats, layout: StatsLayout) {
    put(area, at, s.count as u64);
    put(area, at + 8, s.sum as u64);
    let (min, max) = if s.count == 0 {
        (i64::MAX, i64::MIN)
    } else {
        (s.min, s.max)
    };
    put(area, at + 16, min as u64);
    put(area, at + 24, max as u64);
    if layout.log {
        for (b, n) in s.log.iter().enumerate().take(LOG_BUCKETS) {
            put(area, at + layout.log_offset() as usize + b * 8, *n);
        }
    }
    if let (Some((_, _, _, n)), Some((_, buckets))) = (layout.linear, &s.linear) {
        for (b, c) in buckets.iter().enumerate().take(n) {
            put(area, at + layout.linear_offset() as usize + b * 8, *c);
        }
    }
    if layout.variance.is_some() {
        let v = at + layout.variance_offset() as usize;
        put(area, v + 8, s.count as u64);
        put(area, v + 16, s.avg_s as u64);
        put(area, v + 24, s.m2 as u64);
    }
}

/// The key's 16-byte parts as words.
pub fn key_words(key: &[Value], interner: &mut Interner) -> Vec<u64> {
    let mut words = Vec::with_capacity(key.len() * 2);
    for v in key {
        match v {
            Value::Long(n) => {
                words.push(*n as u64);
                words.push(0);
            }
            Value::Str(s) => {
                let raw = interner.encode(s);
                words.push(u64::from_le_bytes(raw[..8].try_into().unwrap_or_default()));
                words.push(u64::from_le_bytes(raw[8..].try_into().unwrap_or_default()));
            }
        }
    }
    words
}

/// Claims the slot the guest would find for `key` in the table at the start of `area`;
/// returns the entry's offset.
fn place(
    area: &mut [u8],
    slot: &GlobalSlot,
    keys: usize,
    cap: u32,
    key: &[Value],
    interner: &mut Interner,
) -> Result<usize, String> {
    let words = key_words(key, interner);
    if words.len() != keys * 2 {
        return Err(format!(
            "a key of {} values in an array of {keys}",
            key.len()
        ));
    }
    let entry = slot.entry_size() as usize;
    let mask = u64::from(cap) - 1;
    let mut i = hash_key(&words) & mask;
    let seq = word(area, TABLE_SEQUENCE);
    for _ in 0..MAX_PROBES.min(cap) {
        let e = TABLE_HEADER as usize + i as usize * entry;
        if word(area, e as u64) == 0 {
            put(area, e, 2);
            put(area, e + 8, seq);
            put(area, TABLE_SEQUENCE as usize, seq + 1);
            put(area, TABLE_COUNT as usize, word(area, TABLE_COUNT) + 1);
            for (k, w) in words.iter().enumerate() {
                put(area, e + ENTRY_KEYS as usize + k * 8, *w);
            }
            return Ok(e);
        }
        i = (i + 1) & mask;
    }
    Err("the table has no room for the host's entries".into())
}

#[cfg(test)]
mod tests {
    use super::super::tests::program;
    use super::*;
    use exotap_lang::Limits;
    #[test]
    fn an_array_encoded_by_the_host_decodes_to_the_same_store_in_insertion_order() {
        let prog =
            program("global a; probe begin { a[\"x\", 3] = 7; a[\"a-very-long-name\", -1] = 9 }");
        let layout = DataLayout::new(&prog, &Limits::default()).expect("lays out");
        let mut interner = Interner::default();
        let mut data = layout.initial(&prog, &mut interner);
        let mut map = IndexMap::new();
        map.insert(vec![Value::Str("x".into()), Value::Long(3)], Value::Long(7));
        map.insert(
            vec![Value::Str("a-very-long-name".into()), Value::Long(-1)],
            Value::Long(9),
        );
        let store = Store::Array(map.clone());

        layout
            .encode_into("a", &store, &mut interner, &mut data)
            .expect("fits");
        let back = layout.decode("a", &data, &interner).expect("decodes");

        let Store::Array(got) = back else {
            panic!("not an array")
        };
        let got: Vec<_> = got.into_iter().collect();
        let want: Vec<_> = map.into_iter().collect();
        assert_eq!(got, want, "same entries, in insertion order");
    }

    #[test]
    fn stats_round_trip_with_log_and_linear_buckets() {
        let prog = program(
            "global s; probe begin { s <<< 5; print(@hist_log(s)); print(@hist_linear(s, 0, 100, 10)) }",
        );
        let layout = DataLayout::new(&prog, &Limits::default()).expect("lays out");
        let mut interner = Interner::default();
        let mut data = layout.initial(&prog, &mut interner);
        let ValueKind::Stats(sl) = layout.globals["s"].value else {
            panic!("not stats")
        };
        let mut s = Stats::new(prog.globals["s"].hist);
        for v in [5, 0, -3, 1000, 42] {
            s.add(v);
        }

        layout
            .encode_into("s", &Store::Stats(s.clone()), &mut interner, &mut data)
            .expect("fits");
        let Some(Store::Stats(back)) = layout.decode("s", &data, &interner) else {
            panic!("no stats")
        };

        // Without @variance the guest keeps no running variance.
        s.avg_s = 0;
        s.m2 = 0;
        assert!(sl.log && sl.linear.is_some());
        assert_eq!(back, s);
    }

    #[test]
    fn a_host_update_changes_only_the_elements_it_changed_and_spares_one_being_written() {
        let prog = program("global a; probe begin { a[1] = 1 }");
        let layout = DataLayout::new(&prog, &Limits::default()).expect("lays out");
        let slot = layout.globals["a"].clone();
        let (_, cap) = slot.table.expect("a table");
        let mut interner = Interner::default();
        let mut data = vec![0u8; layout.size as usize];
        let long = |pairs: &[(i64, i64)]| {
            Store::Array(
                pairs
                    .iter()
                    .map(|(k, v)| (vec![Value::Long(*k)], Value::Long(*v)))
                    .collect(),
            )
        };
        layout
            .encode_into(
                "a",
                &long(&[(1, 10), (2, 20), (3, 30)]),
                &mut interner,
                &mut data,
            )
            .expect("encodes");
        // A vCPU stopped in the middle of inserting key 4: its slot claimed (state 1), the
        // key written, not yet published.
        let home = |k: u64| hash_key(&[k, 0]) & (u64::from(cap) - 1);
        let entry = |i: u64| (slot.offset + TABLE_HEADER + i * slot.entry_size()) as usize;
        let writing = entry(home(4));
        assert_eq!(word(&data, writing as u64), 0, "key 4's home slot is free");
        data[writing..writing + 8].copy_from_slice(&1u64.to_le_bytes());
        data[writing + ENTRY_KEYS as usize..][..8].copy_from_slice(&4u64.to_le_bytes());
        let before = layout.decode("a", &data, &interner).expect("decodes");
        assert_eq!(before, long(&[(1, 10), (2, 20), (3, 30)]));

        // Nothing changed: not a byte.
        let mut same = data.clone();
        layout
            .update_into("a", &before, &before.clone(), &mut interner, &mut same)
            .expect("updates");
        assert!(same == data);

        // a[1] changed, a[2] deleted, a[6] new, a[3] left alone.
        let after = long(&[(1, 11), (3, 30), (6, 60)]);
        let mut fresh = data.clone();
        layout
            .update_into("a", &before, &after, &mut interner, &mut fresh)
            .expect("updates");

        assert_eq!(layout.decode("a", &fresh, &interner), Some(after));
        let size = slot.entry_size() as usize;
        assert_eq!(
            fresh[writing..writing + size],
            data[writing..writing + size],
            "the element being written is left as the vCPU has it"
        );
        let three = entry(home(3));
        assert_eq!(fresh[three..three + size], data[three..three + size]);
        assert_eq!(
            word(&fresh, entry(home(2)) as u64),
            3,
            "a[2]'s slot is marked deleted"
        );
        let count = (slot.offset + TABLE_COUNT) as usize;
        assert_eq!(word(&fresh, count as u64), 3);
        // Re-encoding the table whole (what the host did before) wipes the element being
        // written: the vCPU would then publish it with no key.
        let mut whole = data.clone();
        layout
            .encode_into(
                "a",
                &layout.decode("a", &fresh, &interner).expect("decodes"),
                &mut interner,
                &mut whole,
            )
            .expect("encodes");
        assert_eq!(word(&whole, writing as u64), 0);
    }
}
