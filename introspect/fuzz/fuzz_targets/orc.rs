//! Hostile ORC tables and stacks: the table parser (raw bytes, with or without a header, or
//! rows built sorted so the fuzzer reaches the unwinder), lookups, and unwinding over
//! fuzzer-chosen stack bytes from fuzzer-chosen registers.
//!
//! Input: `control`, `count` (u16), `count` ip slots (4 bytes, or 1-byte deltas when
//! building sorted rows), `count` 6-byte entries, an optional 20-byte header, 6 register
//! words, then the stack bytes.
#![no_main]

use exotap_introspect::orc::{
    encode_tables, format_backtrace, OrcLayout, OrcTable, PtRegs, RawOrcEntry, StackSnapshot,
    UnwindStart, Unwinder,
};
use libfuzzer_sys::fuzz_target;

const TABLE: u64 = 0xffff_ffff_8200_0000;
const TEXT: u64 = 0xffff_ffff_8100_0000;
const STACK: u64 = 0xffff_c900_0000_0000;

fn take<'a>(data: &mut &'a [u8], len: usize) -> Option<&'a [u8]> {
    if data.len() < len {
        return None;
    }
    let (head, tail) = data.split_at(len);
    *data = tail;
    Some(head)
}

fn word(data: &mut &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(take(data, 8)?.try_into().ok()?))
}

fn run(mut data: &[u8]) -> Option<()> {
    let control = *take(&mut data, 1)?.first()?;
    let count = usize::from(u16::from_le_bytes(take(&mut data, 2)?.try_into().ok()?) % 1024);
    let sorted_rows = control & 0x08 != 0;
    let ip_bytes = take(&mut data, if sorted_rows { count } else { count * 4 })?;
    let entry_bytes = take(&mut data, count * 6)?;
    let header = if control & 0x04 != 0 {
        Some(take(&mut data, 20)?)
    } else {
        None
    };
    let layout = [
        None,
        Some(OrcLayout::Linux4_14),
        Some(OrcLayout::Linux6_3),
        Some(OrcLayout::Linux6_4),
    ][usize::from(control & 0x03)];

    let (ips, entries) = if sorted_rows {
        let mut ip = TEXT;
        let rows: Vec<(u64, RawOrcEntry)> = ip_bytes
            .iter()
            .zip(entry_bytes.chunks_exact(6))
            .map(|(&delta, raw)| {
                ip += u64::from(delta);
                (
                    ip,
                    RawOrcEntry::from_bytes(raw.try_into().unwrap_or_default()),
                )
            })
            .collect();
        encode_tables(TABLE, &rows).ok()?
    } else {
        (ip_bytes.to_vec(), entry_bytes.to_vec())
    };
    let table = match layout {
        Some(layout) => OrcTable::parse_with_layout(&ips, TABLE, &entries, layout),
        None => OrcTable::parse(&ips, TABLE, &entries, header),
    }
    .ok()?;

    let [ip, sp, bp, r13, dx, slide] = [(); 6].map(|()| word(&mut data).unwrap_or_default());
    let _ = table.lookup(ip);
    let _ = table.iter().take(64).count();
    let regs = PtRegs {
        ip: TEXT.wrapping_add(ip % 0x1_0000),
        sp: STACK.wrapping_add(sp % 0x2000),
        bp,
        r13,
        dx,
        cs: u64::from(control >> 7) * 3,
        ..PtRegs::default()
    };
    let mut stack = StackSnapshot::new(STACK, data.to_vec());
    let start = match (control >> 4) & 0x3 {
        0 => UnwindStart::from_regs(regs),
        1 => UnwindStart::from_inactive_task(&mut stack, regs.sp, Some(regs.ip)).ok()?,
        _ => UnwindStart {
            ip: regs.ip,
            sp: regs.sp,
            bp,
            regs: None,
            signal: control & 0x20 != 0,
        },
    };
    let slide = slide & 0x3fe0_0000;
    let mut unwinder = Unwinder::new(&table, slide)
        .with_max_frames(32)
        .with_frame_pointer_guess(control & 0x40 != 0);
    if control & 0x80 != 0 {
        unwinder = unwinder.with_stack(STACK..STACK + 0x2000);
    }
    let start = UnwindStart {
        ip: start.ip.wrapping_add(slide),
        ..start
    };
    let backtrace = unwinder.unwind(&start, &mut stack);
    assert!(backtrace.frames.len() <= 32);
    let _ = format_backtrace(&backtrace, |addr| Some(("f", addr & 0xfff)));
    Some(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(data);
});
