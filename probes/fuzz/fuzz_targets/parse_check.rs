//! Arbitrary bytes through the parser and the checker with tight limits; scripts that check
//! are also run guest-free with tiny MAXACTION/MAXMAPENTRIES/MAXSTRINGLEN, and timers are
//! stopped before they start so a run cannot hang. Diagnostics are rendered too, since the
//! renderer slices the source by spans.
#![no_main]

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use exotap_probes::lang::check::check;
use exotap_probes::lang::diag::Diagnostic;
use exotap_probes::lang::output::{Format, Output};
use exotap_probes::lang::parser::parse;
use exotap_probes::lang::runtime::run_guest_free;
use exotap_probes::lang::Limits;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(src) = std::str::from_utf8(data) else { return };
    let limits = Limits {
        max_action: 200,
        max_action_interruptible: Some(400),
        max_map_entries: 16,
        max_string_len: 64,
        max_nesting: 6,
        max_parse_depth: 64,
        max_source_len: 64 << 10,
    };
    let script = match parse(src, &limits) {
        Ok(s) => s,
        Err(e) => {
            let _ = Diagnostic::from(&e).render("fuzz.stp", src, false);
            return;
        }
    };
    let prog = match check(script) {
        Ok(p) => p,
        Err(diags) => {
            for d in diags {
                let _ = d.render("fuzz.stp", src, false);
            }
            return;
        }
    };
    // Stopped from the start: begin and end probes run, the timer loop does not.
    let stop = Arc::new(AtomicBool::new(true));
    let out = Output::new(Format::Json, Box::new(std::io::sink()), Box::new(std::io::sink()));
    let _ = run_guest_free(&prog, limits, out, "fuzz.stp", src, &stop);
});
