//! The code cache translator over hostile kernel text (the live text is read from the
//! guest): any bytes, any function start, any cache size, with some bytes marked as
//! exception-table entries. It must give a translation or an error, never a panic, and a
//! translation's branches and counters must stay inside the cache it was given.

#![no_main]

use exotap_introspect::x86::{AnalysisConfig, CodeView, FunctionAnalysis};
use exotap_probes::jit::{CacheLayout, Translator};
use libfuzzer_sys::fuzz_target;

const TEXT: u64 = 0xffff_ffff_8100_0000;
const HEAP: u64 = 0xffff_ffff_8200_0000;

fuzz_target!(|data: &[u8]| {
    let Some((&knobs, text)) = data.split_first() else {
        return;
    };
    let Ok(view) = CodeView::new(TEXT, text) else {
        return;
    };
    // A cache from 1 to 64 pages of code: small ones exercise "cache full".
    let code = 0x1000 * (1 + u64::from(knobs & 0x3f));
    let layout = CacheLayout {
        code: HEAP..HEAP + code,
        counters: HEAP + 0x10_0000..HEAP + 0x10_0000 + 0x400,
        table: HEAP + 0x20_0000..HEAP + 0x20_0000 + 0x1000,
    };
    let keyed: Vec<u64> = text
        .iter()
        .enumerate()
        .filter(|(_, &b)| b == 0xaa)
        .map(|(i, _)| TEXT + i as u64)
        .collect();
    let Ok(mut translator) = Translator::new(layout.clone(), &keyed) else {
        return;
    };
    let config = AnalysisConfig::new();
    // Functions at every 64-byte boundary.
    for start in (0..text.len()).step_by(64) {
        let end = (start + 64).min(text.len());
        let f = FunctionAnalysis::analyze(&text[start..end], TEXT + start as u64, &config);
        let _ = translator.translate(view, &f);
    }
    if let Ok(t) = translator.finish() {
        assert!(t.code.len() as u64 <= code);
        assert!(t.counters.end <= layout.counters.end);
        assert!(t.blocks.iter().all(|b| layout.counters.contains(&b.counter)));
    }
});
