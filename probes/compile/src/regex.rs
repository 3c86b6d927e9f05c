//! `s =~ "pattern"` in compiled bodies: a table-driven matcher built on the host, walked in
//! the guest (see [`super::codegen`]'s `regex_match`).
//!
//! The interpreter (probes/lang/src/eval_expr.rs) matches with `regex::Regex::new(pattern)`
//! and `is_match` on the subject as it holds strings: Rust syntax with the crate's defaults
//! (Unicode, case-sensitive, unanchored, `^`/`$` at the text's ends, `.` not `\n`), on text
//! whose invalid UTF-8 was replaced by U+FFFD (`String::from_utf8_lossy`). A compiled
//! string holds raw bytes (`execname()` is `task_struct.comm` as it is), so the table is
//! the product of two automata: `regex-automata`'s dense DFA of the same pattern, and
//! the lossy decoder, which feeds the DFA each valid UTF-8 sequence as it is and each
//! ill-formed one (a maximal subpart, as `Utf8Chunks` cuts it) as EF BF BD. Walking the
//! raw bytes through it answers what the interpreter answers on the replaced text.
//!
//! The table has two absorbing states: 0 (no match can follow: the DFA died) and 1 (a
//! match was seen: the DFA's one-byte match delay is resolved on the host, by checking
//! every DFA state a transition passes through). The walk stops at either; at the end of
//! the text, a per-state flag holds the answer of the DFA's end-of-input transition. States
//! are then minimized (Moore) and bytes grouped into classes with equal columns.
//!
//! Written by hand rather than serializing `regex-automata`'s own DFA: its transitions read
//! `&str`-valid input only as the interpreter sees it, and the guest walk needs a plain
//! table (no premultiplied ids, special-state ranges or acceleration to reimplement).
//!
//! Layout in the data (see [`super::data`]): the 256-byte class map at +0, the end flags
//! (one byte per state) at +256, then from [`Matcher::transitions`] `states × classes`
//! next-state ids as little-endian u16.

use std::collections::HashMap;

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};

/// Most states of one pattern's table.
pub const MAX_STATES: usize = 1024;
/// Most bytes of one pattern's table in the data.
pub const MAX_TABLE_BYTES: usize = 64 << 10;
/// Most bytes `regex-automata` may use while it determinizes one pattern.
const BUILD_LIMIT: usize = 8 << 20;

/// State 0: no match is possible any more.
pub const DEAD: u16 = 0;
/// State 1: a match was found.
pub const MATCH: u16 = 1;

/// A pattern's matcher, as the guest walks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    /// Byte → class.
    pub classes: [u8; 256],
    /// Number of classes (columns).
    pub stride: usize,
    /// Per state: 1 when the text matches if it ends here.
    pub eoi: Vec<u8>,
    /// `states × stride` next states.
    pub next: Vec<u16>,
    /// Where the walk starts.
    pub start: u16,
}

impl Matcher {
    /// States.
    pub fn states(&self) -> usize {
        self.eoi.len()
    }

    /// Byte offset of the transitions in the table.
    pub fn transitions(&self) -> usize {
        (256 + self.states()).div_ceil(16) * 16
    }

    /// Bytes of the table in the data.
    pub fn size(&self) -> usize {
        self.transitions() + 2 * self.next.len()
    }

    /// The table's bytes (see the module's layout).
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.size()];
        out[..256].copy_from_slice(&self.classes);
        out[256..256 + self.states()].copy_from_slice(&self.eoi);
        let at = self.transitions();
        for (i, n) in self.next.iter().enumerate() {
            out[at + 2 * i..at + 2 * i + 2].copy_from_slice(&n.to_le_bytes());
        }
        out
    }

    /// Whether `text` matches, walked as the guest walks it.
    pub fn is_match(&self, text: &[u8]) -> bool {
        let mut s = self.start;
        for b in text {
            if s <= MATCH {
                return s == MATCH;
            }
            let class = usize::from(self.classes[usize::from(*b)]);
            s = self.next[usize::from(s) * self.stride + class];
        }
        if s <= MATCH {
            return s == MATCH;
        }
        self.eoi[usize::from(s)] != 0
    }
}

/// The lossy decoder's state between bytes: which bytes it waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Dec {
    /// At a character boundary.
    Ground,
    /// Waiting for `left` more continuation bytes, the next in `lo..=hi`.
    Want { left: u8, lo: u8, hi: u8 },
}

/// What a byte does to the decoder.
enum Step {
    /// A whole valid sequence ends with it (an ASCII byte, or a last continuation byte).
    Complete,
    /// A valid sequence goes on.
    Pending(Dec),
    /// The pending bytes (if any) are ill-formed and stand for one U+FFFD; the byte itself
    /// is decoded afresh.
    Reject,
    /// An ill-formed lone byte at the boundary: one U+FFFD for itself.
    Invalid,
}

fn step(dec: Dec, b: u8) -> Step {
    match dec {
        Dec::Ground => match b {
            0x00..=0x7f => Step::Complete,
            0xc2..=0xdf => Step::Pending(Dec::Want {
                left: 1,
                lo: 0x80,
                hi: 0xbf,
            }),
            0xe0 => Step::Pending(Dec::Want {
                left: 2,
                lo: 0xa0,
                hi: 0xbf,
            }),
            0xed => Step::Pending(Dec::Want {
                left: 2,
                lo: 0x80,
                hi: 0x9f,
            }),
            0xe1..=0xef => Step::Pending(Dec::Want {
                left: 2,
                lo: 0x80,
                hi: 0xbf,
            }),
            0xf0 => Step::Pending(Dec::Want {
                left: 3,
                lo: 0x90,
                hi: 0xbf,
            }),
            0xf4 => Step::Pending(Dec::Want {
                left: 3,
                lo: 0x80,
                hi: 0x8f,
            }),
            0xf1..=0xf3 => Step::Pending(Dec::Want {
                left: 3,
                lo: 0x80,
                hi: 0xbf,
            }),
            _ => Step::Invalid,
        },
        Dec::Want { left, lo, hi } => {
            if !(lo..=hi).contains(&b) {
                Step::Reject
            } else if left == 1 {
                Step::Complete
            } else {
                Step::Pending(Dec::Want {
                    left: left - 1,
                    lo: 0x80,
                    hi: 0xbf,
                })
            }
        }
    }
}

/// A product state: the DFA's state at the last character boundary, its state after the
/// pending bytes, and the decoder's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum P {
    Dead,
    Match,
    At { before: u32, cur: Cur, dec: Dec },
}

impl P {
    /// At a character boundary, the DFA in `s`.
    fn ground(s: u32) -> P {
        P::At {
            before: s,
            cur: Cur::S(s),
            dec: Dec::Ground,
        }
    }
}

/// The DFA after the pending bytes of a sequence that may still turn out ill-formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Cur {
    /// In this state.
    S(u32),
    /// Dead: if the sequence completes, no match.
    Dead,
    /// Passed a match state: if the sequence completes, a match.
    Matched,
}

/// Builds the matcher of `pattern` with the interpreter's semantics.
///
/// # Errors
/// Why it cannot be compiled: a pattern `regex-automata` cannot build a DFA for (a Unicode
/// word boundary `\b`, whose DFA would have to give up on non-ASCII bytes), or a table over
/// [`MAX_STATES`] states or [`MAX_TABLE_BYTES`] bytes.
pub fn build(pattern: &str) -> Result<Matcher, String> {
    let dfa = dense::Builder::new()
        .configure(
            dense::Config::new()
                .match_kind(MatchKind::All)
                .start_kind(StartKind::Unanchored)
                .minimize(false)
                .dfa_size_limit(Some(BUILD_LIMIT))
                .determinize_size_limit(Some(BUILD_LIMIT)),
        )
        .build(pattern)
        .map_err(|e| format!("no DFA for this regular expression ({e})"))?;
    let too_big = || {
        format!(
            "a regular expression whose matcher passes {MAX_STATES} states or {} KiB",
            MAX_TABLE_BYTES >> 10
        )
    };
    let start = dfa
        .start_state(&start::Config::new().anchored(Anchored::No))
        .map_err(|e| format!("no start state for this regular expression ({e})"))?;
    // DFA state ids as u32 (regex-automata's StateID), and the ids back.
    let mut ids: HashMap<u32, regex_automata::util::primitives::StateID> = HashMap::new();
    let id = |s: regex_automata::util::primitives::StateID,
              ids: &mut HashMap<u32, regex_automata::util::primitives::StateID>| {
        let n = s.as_u32();
        ids.insert(n, s);
        n
    };
    let start = id(start, &mut ids);
    // Feeds `bytes` from DFA state `s`: Dead, Match (some state passed is a match state),
    // or the state reached.
    let feed = |s: u32,
                bytes: &[u8],
                ids: &mut HashMap<u32, regex_automata::util::primitives::StateID>|
     -> Result<u32, bool> {
        let mut st = ids[&s];
        for b in bytes {
            st = dfa.next_state(st, *b);
            if dfa.is_match_state(st) {
                return Err(true);
            }
            if dfa.is_dead_state(st) || dfa.is_quit_state(st) {
                return Err(false);
            }
        }
        Ok(id(st, ids))
    };
    let absorb = |r: Result<u32, bool>| -> Result<u32, P> {
        r.map_err(|matched| if matched { P::Match } else { P::Dead })
    };
    let replacement = "\u{fffd}".as_bytes();
    // The product state after byte `b` in `p`.
    let next_of = |p: P, b: u8, ids: &mut HashMap<u32, _>| -> P {
        let P::At { before, cur, dec } = p else {
            return p;
        };
        // Byte `b` at a character boundary, the DFA in `s`.
        let fresh = |s: u32, b: u8, ids: &mut HashMap<u32, _>| -> P {
            match step(Dec::Ground, b) {
                Step::Complete => match absorb(feed(s, &[b], ids)) {
                    Ok(t) => P::ground(t),
                    Err(p) => p,
                },
                // A match state after the lead byte is a match that ended at the boundary
                // (the byte is non-ASCII, as EF would be): kept. The DFA dying on the lead
                // byte is kept pending: should the sequence be ill-formed, U+FFFD is fed
                // from `s` instead.
                Step::Pending(d) => match absorb(feed(s, &[b], ids)) {
                    Ok(t) => P::At {
                        before: s,
                        cur: Cur::S(t),
                        dec: d,
                    },
                    Err(P::Match) => P::Match,
                    Err(_) => P::At {
                        before: s,
                        cur: Cur::Dead,
                        dec: d,
                    },
                },
                Step::Invalid | Step::Reject => match absorb(feed(s, replacement, ids)) {
                    Ok(t) => P::ground(t),
                    Err(p) => p,
                },
            }
        };
        if dec == Dec::Ground {
            return fresh(before, b, ids);
        }
        match step(dec, b) {
            Step::Complete => match cur {
                Cur::S(c) => match absorb(feed(c, &[b], ids)) {
                    Ok(t) => P::ground(t),
                    Err(p) => p,
                },
                Cur::Dead => P::Dead,
                Cur::Matched => P::Match,
            },
            Step::Pending(d) => P::At {
                before,
                cur: match cur {
                    Cur::S(c) => match absorb(feed(c, &[b], ids)) {
                        Ok(t) => Cur::S(t),
                        Err(P::Match) => Cur::Matched,
                        Err(_) => Cur::Dead,
                    },
                    other => other,
                },
                dec: d,
            },
            Step::Reject | Step::Invalid => match absorb(feed(before, replacement, ids)) {
                Ok(t) => fresh(t, b, ids),
                Err(p) => p,
            },
        }
    };
    // Whether the text matches if it ends in `p`.
    let eoi_of = |p: P, ids: &mut HashMap<u32, _>| -> bool {
        let P::At { before, dec, .. } = p else {
            return p == P::Match;
        };
        let s = if dec == Dec::Ground {
            before
        } else {
            match absorb(feed(before, replacement, ids)) {
                Ok(t) => t,
                Err(p) => return p == P::Match,
            }
        };
        dfa.is_match_state(dfa.next_eoi_state(ids[&s]))
    };
    // Breadth first over the reachable product states.
    let mut states: Vec<P> = vec![P::Dead, P::Match];
    let mut index: HashMap<P, usize> = HashMap::new();
    index.insert(P::Dead, 0);
    index.insert(P::Match, 1);
    let first = P::ground(start);
    index.insert(first, 2);
    states.push(first);
    let mut next: Vec<[u32; 256]> = Vec::new();
    let mut i = 0;
    while i < states.len() {
        let p = states[i];
        let mut row = [0u32; 256];
        for b in 0..=255u8 {
            let q = next_of(p, b, &mut ids);
            let n = match index.get(&q) {
                Some(n) => *n,
                None => {
                    if states.len() >= MAX_STATES * 4 {
                        return Err(too_big());
                    }
                    states.push(q);
                    index.insert(q, states.len() - 1);
                    states.len() - 1
                }
            };
            row[usize::from(b)] = n as u32;
        }
        next.push(row);
        i += 1;
    }
    let eoi: Vec<bool> = states.iter().map(|p| eoi_of(*p, &mut ids)).collect();
    let m = minimize(&next, &eoi, 2);
    if m.states() > MAX_STATES || m.size() > MAX_TABLE_BYTES {
        return Err(too_big());
    }
    Ok(m)
}

/// Moore's minimization of the product (`next[s][b]`, end flags `eoi`, start `start`),
/// keeping 0 and 1 (the absorbing dead and match states) as states 0 and 1, then the
/// byte classes of the minimal table.
fn minimize(next: &[[u32; 256]], eoi: &[bool], start: usize) -> Matcher {
    let n = next.len();
    // Blocks: 0 dead, 1 match, then by end flag.
    let mut block: Vec<u32> = (0..n)
        .map(|s| match s {
            0 => 0,
            1 => 1,
            _ => 2 + u32::from(eoi[s]),
        })
        .collect();
    let mut count = block.iter().collect::<std::collections::HashSet<_>>().len();
    // Each round splits blocks whose states go to different blocks (a refinement: the count
    // never falls); stable when it stops growing.
    loop {
        let mut sig: HashMap<(u32, Vec<u32>), u32> = HashMap::new();
        let mut fresh = vec![0u32; n];
        for s in 0..n {
            let key = (
                block[s],
                next[s].iter().map(|t| block[*t as usize]).collect(),
            );
            let len = sig.len() as u32;
            fresh[s] = *sig.entry(key).or_insert(len);
        }
        let len = sig.len();
        block = fresh;
        if len == count {
            break;
        }
        count = len;
    }
    // Renumber: dead 0, match 1 (they are alone in their blocks), then first seen.
    let mut order: HashMap<u32, u16> = HashMap::new();
    order.insert(block[0], DEAD);
    order.insert(block[1], MATCH);
    let mut reps: Vec<usize> = vec![0, 1];
    for (s, b) in block.iter().enumerate() {
        if let std::collections::hash_map::Entry::Vacant(v) = order.entry(*b) {
            v.insert(reps.len() as u16);
            reps.push(s);
        }
    }
    let id = |s: usize| order[&block[s]];
    // Byte classes: bytes whose columns are equal over the minimal states.
    let mut classes = [0u8; 256];
    let mut columns: HashMap<Vec<u16>, u8> = HashMap::new();
    let mut reps_b: Vec<u8> = Vec::new();
    for b in 0..256usize {
        let col: Vec<u16> = reps.iter().map(|r| id(next[*r][b] as usize)).collect();
        let len = columns.len() as u8;
        let c = *columns.entry(col).or_insert_with(|| {
            reps_b.push(b as u8);
            len
        });
        classes[b] = c;
    }
    let stride = reps_b.len();
    let mut table = Vec::with_capacity(reps.len() * stride);
    for r in &reps {
        for b in &reps_b {
            table.push(id(next[*r][usize::from(*b)] as usize));
        }
    }
    Matcher {
        classes,
        stride,
        eoi: reps.iter().map(|r| u8::from(eoi[*r])).collect(),
        next: table,
        start: id(start),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift), so failures replay.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Subjects built from the pattern's own bytes, ASCII, UTF-8 and invalid bytes.
    fn subject(rng: &mut Rng, pattern: &str, long: bool) -> Vec<u8> {
        let pieces: &[&[u8]] = &[
            b"a",
            b"b",
            b"c",
            b"A",
            b"x",
            b"0",
            b"9",
            b" ",
            b"\n",
            b"-",
            b"_",
            b".",
            "é".as_bytes(),
            "€".as_bytes(),
            "😀".as_bytes(),
            "\u{fffd}".as_bytes(),
            b"\xff",
            b"\xc3",
            b"\xe2\x82",
            b"\xf0\x9f",
            b"\x80",
            b"\xed\xa0\x80",
            b"\xe0\x80",
            b"\xf4\x90",
            b"\xc0\xaf",
            b"foo",
            b"bar",
            b"syscall-loop",
            b"ab",
            b"abc",
        ];
        let most = if long { 600 } else { 12 };
        let n = rng.below(most);
        let mut out = Vec::new();
        let pat = pattern.as_bytes();
        while out.len() < n {
            if !pat.is_empty() && rng.below(3) == 0 {
                let i = rng.below(pat.len());
                let j = (i + 1 + rng.below(4)).min(pat.len());
                out.extend_from_slice(&pat[i..j]);
            } else {
                out.extend_from_slice(pieces[rng.below(pieces.len())]);
            }
        }
        out
    }

    const PATTERNS: &[&str] = &[
        "",
        "a",
        "^a",
        "a$",
        "^$",
        "^abc$",
        "foo|bar",
        "^(foo|bar)+$",
        "a.c",
        "a..c",
        "^.$",
        "^...$",
        "[abc]+x",
        "[^a-z]",
        "^[^a-z]+$",
        "[[:digit:]]{2,3}",
        "[[:alpha:]_][[:alnum:]_]*",
        "(?i)ABC",
        "(?i)é",
        "é|€",
        "\u{fffd}",
        "^\u{fffd}+$",
        "x*",
        "a+b?c*$",
        "(ab|a)(c|bcd)",
        "\\.",
        "^syscall-(loop|other)$",
        "\\d+",
        "\\s",
        "[[:word:]]+-",
        "(?i)syscall",
        "(?-u:\\b)a",
        "a(?-u:\\B)",
        "[0-9a-f]{4}",
        "(a|b)*abb",
        "^.*$",
        "(?s).",
        "😀",
        "^[^é]*$",
        "a{0}",
    ];

    #[test]
    fn matches_as_the_interpreter_on_random_subjects() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for pattern in PATTERNS {
            let m = build(pattern).unwrap_or_else(|e| panic!("{pattern}: {e}"));
            let re = regex::Regex::new(pattern).unwrap();
            eprintln!(
                "{pattern:?}: {} states, {} classes, {} bytes",
                m.states(),
                m.stride,
                m.size()
            );
            for round in 0..3000 {
                let text = subject(&mut rng, pattern, round % 10 == 0);
                let want = re.is_match(&String::from_utf8_lossy(&text));
                assert_eq!(
                    m.is_match(&text),
                    want,
                    "{pattern:?} on {:?} ({} states)",
                    String::from_utf8_lossy(&text),
                    m.states()
                );
            }
        }
    }

    #[test]
    fn every_byte_string_of_up_to_three_bytes_from_a_set() {
        // Exhaustive over bytes that matter to the decoder.
        let bytes = [
            0x00u8, b'a', b'\n', 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xa9, 0xbf, 0xc0, 0xc2, 0xc3,
            0xdf, 0xe0, 0xe2, 0xed, 0xef, 0xf0, 0xf4, 0xf5, 0xff,
        ];
        for pattern in [
            "^.$",
            "^..$",
            "\u{fffd}\u{fffd}",
            "^\u{fffd}$",
            "é",
            "a$",
            "^[^a]*$",
        ] {
            let m = build(pattern).unwrap();
            let re = regex::Regex::new(pattern).unwrap();
            for a in bytes {
                for b in bytes {
                    for c in bytes {
                        for text in [vec![a], vec![a, b], vec![a, b, c]] {
                            let want = re.is_match(&String::from_utf8_lossy(&text));
                            assert_eq!(m.is_match(&text), want, "{pattern:?} on {text:x?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn table_bytes_round_trip() {
        let m = build("^(foo|bar)+$").unwrap();
        let bytes = m.bytes();
        assert_eq!(bytes.len(), m.size());
        assert_eq!(&bytes[..256], &m.classes);
        let at = m.transitions();
        assert_eq!(
            u16::from_le_bytes([bytes[at], bytes[at + 1]]),
            m.next[0],
            "the dead state's first transition"
        );
        assert!(m.states() < 20, "{} states", m.states());
    }

    #[test]
    fn unicode_word_boundaries_and_huge_tables_are_refused_by_name() {
        let e = build("\\bfoo\\b").unwrap_err();
        assert!(e.contains("no DFA"), "{e}");
        let e = build("\\w\\W").unwrap_err();
        assert!(e.contains("states") || e.contains("no DFA"), "{e}");
    }
}
