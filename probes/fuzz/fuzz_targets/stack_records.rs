//! A hostile guest's stack records (exotap_probes::compile::snapshot): a compiled probe's
//! output record with a stack snapshot, decoded and unwound with ORC tables, both from the
//! fuzzer's bytes. The record's copied length, stack pointer and registers are anything; the
//! tables hold any entries. The outcome is always text or `None`: no panic, no hang (the
//! unwinder is bounded by its frame limit), no read outside the record.
#![no_main]

use exotap_introspect::orc::{OrcLayout, OrcTable, Unwinder};
use exotap_probes::compile::snapshot::{
    render, snapshot, stack_format, Snapshot, StackArg, StackFormat, StackOutput, Unwound,
    STACK_FORMAT,
};
use exotap_probes::live::stacks::unwind_snapshot;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (head, rest) = data.split_at(8);
    let table_len = usize::from(u16::from_le_bytes([head[0], head[1]])).min(rest.len());
    let (table, record) = rest.split_at(table_len);
    // Entries then ips, the ip table at a fuzzed address.
    let entries = (table.len() / 10) * 6;
    let table = OrcTable::parse_with_layout(
        &table[entries..entries + entries / 6 * 4],
        0xffff_ffff_8100_0000 + u64::from(head[2]) * 0x1000,
        &table[..entries],
        [
            OrcLayout::Linux4_14,
            OrcLayout::Linux6_3,
            OrcLayout::Linux6_4,
        ][usize::from(head[3] % 3)],
    );
    let args = [
        StackArg::Long,
        StackArg::Str,
        StackArg::Pcs,
        StackArg::Lines,
    ];
    let formats = vec![StackFormat {
        output: match head[4] % 3 {
            0 => StackOutput::PrintBacktrace,
            1 => StackOutput::Print(true),
            _ => StackOutput::Printf("%d %s %s %s\n".into()),
        },
        args: if head[4] % 3 == 0 {
            Vec::new()
        } else {
            args.to_vec()
        },
        snapshot_bytes: u64::from(u16::from_le_bytes([head[5], head[6]])),
        pc: 0xffff_ffff_8100_0000 + u64::from(head[7]) * 16,
        max_string_len: 512,
        // A return probe's stack too (its record starts at the return-address slot).
        at_return: head[7] & 0x80 != 0,
    }];
    let mut record = record.to_vec();
    if record.len() >= 12 {
        record[8..12].copy_from_slice(&STACK_FORMAT.to_le_bytes());
    }
    let Some(format) = stack_format(&formats, &record) else {
        return;
    };
    if let Some(snap) = snapshot(format, &record) {
        assert!(snap.stack.len() as u64 <= format.snapshot_bytes);
    }
    let unwind = |snap: &Snapshot<'_>| match &table {
        Ok(table) => {
            let (backtrace, cut) = unwind_snapshot(&Unwinder::new(table, 0), snap);
            Unwound {
                frames: backtrace
                    .frames
                    .iter()
                    .map(|f| (f.pc, String::new()))
                    .collect(),
                cut,
            }
        }
        Err(_) => Unwound::default(),
    };
    let _ = render(
        format,
        &record,
        &|raw| String::from_utf8_lossy(raw).into_owned(),
        &unwind,
    );
});
