//! The host's side of the compiled data's strings and output formats: strings longer than
//! 15 bytes interned by id (the guest stores only the id), the formats of compiled
//! `printf`/`print` calls, and the hash the guest computes for keys.

use super::*;

/// Strings longer than 15 bytes, by id (the guest stores only the id), and the output
/// formats of compiled `printf`/`print` calls.
#[derive(Debug, Clone, Default)]
pub struct Interner {
    pub(super) strings: Vec<String>,
    pub(super) ids: std::collections::HashMap<String, u64>,
    /// Output formats by id: what prints, and how each argument is held.
    pub formats: Vec<(OutputKind, Vec<ArgSlot>)>,
    /// The formats of records that hold a kernel stack snapshot, by id without
    /// [`crate::snapshot::STACK_FORMAT`] (see [`crate::snapshot`]).
    pub stacks: Vec<crate::snapshot::StackFormat>,
    /// Strings the host placed in the guest's string table, by their entry (see
    /// [`DataLayout::encode_into`]): encoded as the guest encodes the same text.
    pub(super) placed: std::collections::HashMap<String, u64>,
    /// Entries of the string table the collector keeps whatever the globals hold (see
    /// [`Interner::pin_placed`]).
    pub(super) pinned: std::collections::HashSet<u64>,
}

impl Interner {
    /// The id of an output format (one per call site).
    pub fn format(&mut self, kind: OutputKind, args: Vec<ArgSlot>) -> u32 {
        self.formats.push((kind, args));
        u32::try_from(self.formats.len() - 1).unwrap_or(u32::MAX)
    }

    /// What an output record prints (`None`: an unknown format id, a hostile guest): a
    /// histogram apart, for JSON output; everything else as [`Self::render`]'s text.
    pub fn printed(&self, record: &[u8]) -> Option<Printed> {
        let id = usize::try_from(word(record, 8) & 0xffff_ffff).ok()?;
        let Some((
            OutputKind::Hist {
                kind,
                layout,
                newline,
                name,
                keys,
            },
            _,
        )) = self.formats.get(id)
        else {
            return self.render(record).map(Printed::Text);
        };
        let stats = decode_stats(record, 16, *layout);
        let buckets = match kind {
            HistKind::Log => stats.log.clone(),
            HistKind::Linear { .. } => stats.linear.map(|l| l.1).unwrap_or_default(),
        };
        let mut name = name.clone();
        if !keys.is_empty() {
            let at = 16 + ValueKind::Stats(*layout).size();
            let shown: Vec<String> = keys
                .iter()
                .enumerate()
                .map(|(i, is_str)| {
                    let here = at + 16 * i as u64;
                    if *is_str {
                        self.decode(bytes_at(record, here, 16))
                    } else {
                        (word(record, here) as i64).to_string()
                    }
                })
                .collect();
            name = format!("{name}[{}]", shown.join(","));
        }
        Some(Printed::Hist {
            name,
            kind: *kind,
            buckets,
            newline: *newline,
        })
    }

    /// The text of an output record (`None`: an unknown format id, a hostile guest).
    pub fn render(&self, record: &[u8]) -> Option<String> {
        let id = usize::try_from(word(record, 8) & 0xffff_ffff).ok()?;
        let (kind, slots) = self.formats.get(id)?;
        if let OutputKind::Hist {
            kind,
            layout,
            newline,
            ..
        } = kind
        {
            // The interpreter's text output of a histogram (JSON output prints it as text).
            let stats = decode_stats(record, 16, *layout);
            let buckets: &[u64] = match kind {
                HistKind::Log => &stats.log,
                HistKind::Linear { .. } => stats.linear.as_ref().map_or(&[], |l| &l.1[..]),
            };
            let mut text = exotap_lang::hist::Histogram {
                kind: *kind,
                buckets,
            }
            .render();
            if *newline {
                text.push('\n');
            }
            return Some(text);
        }
        let mut at = 16u64;
        let args: Vec<Value> = slots
            .iter()
            .map(|slot| {
                let here = at;
                at = at.saturating_add(slot.size());
                match slot {
                    ArgSlot::Str => Value::Str(self.decode(bytes_at(record, here, 16))),
                    ArgSlot::Long => Value::Long(word(record, here) as i64),
                    ArgSlot::Ctime { max_string_len } => Value::Str(truncate(
                        exotap_lang::native::ctime(word(record, here) as i64),
                        *max_string_len as usize,
                    )),
                    ArgSlot::Text {
                        slot,
                        max_string_len,
                    } => {
                        let bytes = bytes_at(record, here, *slot as usize);
                        let text = bytes.split(|b| *b == 0).next().unwrap_or(bytes);
                        Value::Str(truncate(
                            String::from_utf8_lossy(text).into_owned(),
                            *max_string_len as usize,
                        ))
                    }
                }
            })
            .collect();
        Some(match kind {
            OutputKind::Printf(fmt) => {
                let pieces = exotap_lang::format::parse_format(fmt).ok()?;
                exotap_lang::format::render(&pieces, &args)
            }
            OutputKind::Hist { .. } => String::new(),
            OutputKind::Print(ln) => {
                let mut s: String = args.iter().map(ToString::to_string).collect();
                if *ln {
                    s.push('\n');
                }
                s
            }
        })
    }

    /// The 16-byte encoding of `s` (interning it when it is long).
    pub fn encode(&mut self, s: &str) -> [u8; 16] {
        let mut out = [0u8; 16];
        let bytes = s.as_bytes();
        if bytes.len() < 16 && !bytes.contains(&0) && !matches!(bytes.first(), Some(1 | 2)) {
            out[..bytes.len()].copy_from_slice(bytes);
            return out;
        }
        if let Some(index) = self.placed.get(s) {
            out[0] = 2;
            out[8..].copy_from_slice(&index.to_le_bytes());
            return out;
        }
        let next = self.strings.len() as u64;
        let id = *self.ids.entry(s.to_owned()).or_insert(next);
        if id == next {
            self.strings.push(s.to_owned());
        }
        out[0] = 1;
        out[8..].copy_from_slice(&id.to_le_bytes());
        out
    }

    /// The text of an encoded string (an unknown id reads as `<string N>`).
    pub fn decode(&self, raw: &[u8]) -> String {
        if raw.first() == Some(&1) && raw.len() >= 16 {
            let id = u64::from_le_bytes(raw[8..16].try_into().unwrap_or_default());
            return usize::try_from(id)
                .ok()
                .and_then(|i| self.strings.get(i))
                .cloned()
                .unwrap_or_else(|| format!("<string {id}>"));
        }
        let text = raw.split(|b| *b == 0).next().unwrap_or_default();
        String::from_utf8_lossy(&text[..text.len().min(15)]).into_owned()
    }
}

/// The hash of a key (its 16-byte parts as little-endian words), as the guest computes it.
pub fn hash_key(words: &[u64]) -> u64 {
    let mut h = 0u64;
    for w in words {
        h = (h ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    h ^ (h >> 29)
}
