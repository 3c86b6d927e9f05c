//! Proof that the regression can fail: with the relocator's test-only fault injection
//! (every relocated rel32 branch or RIP-relative displacement one byte off), the same
//! sweep must report divergences. Its own test binary, because the switch is
//! process-wide.

use std::process::Command;

use exotap_probes::splice::reloc::fault;
use exotap_regress::{regress_x86_minikernel, Options};

#[test]
fn off_by_one_rel32_fixup_is_caught_as_divergences() {
    if Command::new("gcc").arg("--version").output().is_err() {
        println!("SKIP: gcc is not installed");
        return;
    }
    let options = Options {
        traps_everywhere: false,
        // A fifth of the points is plenty to show it, and keeps the bisection short.
        stride: 5,
        ..Options::ci()
    };
    fault::set_rel32_off_by_one(true);

    let report = regress_x86_minikernel(&options);
    fault::set_rel32_off_by_one(false);
    let report = report.unwrap();
    println!("{report}");

    let spliced = report
        .divergences
        .iter()
        .filter(|d| d.kind == exotap_regress::ProbeKind::Splice)
        .count();
    let trapped = report.divergences.len() - spliced;
    assert!(spliced >= 10, "{report}");
    assert!(trapped >= 5, "{report}");
    // Divergences name their points (batches were split to find them); with a broken
    // relocator a batch can also fail only as a whole, but that is the exception.
    let named = report
        .divergences
        .iter()
        .filter(|d| d.points.len() == 1)
        .count();
    assert!(named * 10 >= report.divergences.len() * 9, "{report}");
}
