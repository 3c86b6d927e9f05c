//! Proof that the SPARC regression can fail: with the SPARC relocator's test-only fault
//! injection (every relocated DCTI loses its delay slot, a `nop` in its place), the same
//! sweep must report divergences. Its own test binary, because the switch is
//! process-wide.

use std::process::Command;

use exotap_guest_images::minikernel::SPARC64_GCC;
use exotap_probes::splice::sparc::fault;
use exotap_regress::{sparc, Options};

#[test]
fn dropping_delay_slots_on_relocation_is_caught_as_divergences() {
    if Command::new(SPARC64_GCC).arg("--version").output().is_err() {
        println!("SKIP: {SPARC64_GCC} is not installed (apt-get install gcc-sparc64-linux-gnu)");
        return;
    }
    let options = Options {
        // A sixth of the points is plenty to show it, and keeps the bisection short.
        stride: 6,
        // Splices only: the out-of-line copies of trap probes would diverge too.
        traps_everywhere: false,
        ..Options::ci()
    };
    fault::set_drop_delay_slot(true);

    let report = sparc::regress_minikernel(&options);
    fault::set_drop_delay_slot(false);
    let report = report.unwrap();
    println!("{report}");

    assert!(report.divergences.len() >= 10, "{report}");
    let named = report
        .divergences
        .iter()
        .filter(|d| d.points.len() == 1)
        .count();
    assert!(named * 10 >= report.divergences.len() * 9, "{report}");
}
