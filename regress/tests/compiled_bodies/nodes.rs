//! The linked nodes and strings in the task's pages that the member-chain and memory-read
//! tests read, and what the interpreter is told of them.

use super::*;

/// The nodes of the member-chain tests: x, next, name, s, inner.c.
pub(super) const NODES: [(i32, Option<usize>, &str, i16, u8); 6] = [
    (7, Some(1), "alpha", -1, 255),
    (-3, Some(2), "", 300, 0),
    (40, None, "fifteen-chars-x", -32768, 1),
    (0, Some(4), "b", 5, 128),
    (123_456, Some(5), "node-four", 0, 9),
    (-2_000_000_000, None, "zz", 77, 200),
];
/// Strings: a short one, one longer than MAXSTRINGLEN, and one that runs into unreadable
/// memory after 5 bytes.
pub(super) const SHORT_STR: u64 = TASK + 0x2100;
pub(super) const LONG_STR: u64 = TASK + 0x2200;
pub(super) const EDGE_STR: u64 = TASK_END - 5;

pub(super) fn node(i: usize) -> u64 {
    TASK + 0x400 + 0x40 * i as u64
}

/// Writes [`NODES`] and the strings into the task's pages.
pub(super) fn write_nodes(uc: &mut UnicornMachine) {
    for (i, (x, next, name, s, c)) in NODES.iter().enumerate() {
        let mut bytes = [0u8; 0x40];
        bytes[..4].copy_from_slice(&x.to_le_bytes());
        bytes[8..16].copy_from_slice(&next.map_or(0, node).to_le_bytes());
        bytes[16..16 + name.len()].copy_from_slice(name.as_bytes());
        bytes[32..34].copy_from_slice(&s.to_le_bytes());
        bytes[40] = *c;
        uc.write(node(i), &bytes).unwrap();
    }
    uc.write(SHORT_STR, b"a forty character string used as b here!\0")
        .unwrap();
    let long: Vec<u8> = (0..600u32)
        .map(|i| b'a' + (i % 26) as u8)
        .chain([0])
        .collect();
    uc.write(LONG_STR, &long).unwrap();
    uc.write(EDGE_STR, b"abcde").unwrap();
}

/// What the interpreter is told of `$a`'s members (it cannot read kernel types): the values
/// [`write_nodes`] put there, and nothing behind a NULL pointer.
pub(super) fn node_members(h: &Hit, ctx: &mut CapturedContext) {
    let Some(i) = (0..NODES.len()).find(|i| node(*i) == h.a as u64) else {
        return;
    };
    let (x, next, _, s, c) = NODES[i];
    let mut put = |path: &str, v: i64| {
        ctx.targets.insert(path.into(), Value::Long(v));
    };
    put("$a->x", i64::from(x));
    put("$a->s", i64::from(s));
    put("$a->inner->c", i64::from(c));
    put("$a->name", (node(i) + 16) as i64);
    if let Some(j) = next {
        put("$a->next->x", i64::from(NODES[j].0));
    }
}

pub(super) fn node_hits() -> Vec<Hit> {
    let targets: Vec<i64> = (0..NODES.len())
        .map(|i| node(i) as i64)
        .chain([0])
        .collect();
    let strings = [SHORT_STR as i64, LONG_STR as i64, EDGE_STR as i64, 0, 1];
    (0..2)
        .flat_map(|_| targets.iter())
        .flat_map(|a| {
            strings.iter().map(|b| Hit {
                comm: "t",
                pid: 1,
                tgid: 1,
                a: *a,
                b: *b,
            })
        })
        .collect()
}
