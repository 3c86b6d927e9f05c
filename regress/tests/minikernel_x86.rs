//! The splicing-safety regression over the x86-64 mini-kernel: every accepted point
//! (splice and trap) must leave the kernel's results unchanged and count exactly.

use std::process::Command;

use exotap_regress::{regress_x86_minikernel, Options};

fn have_gcc() -> bool {
    Command::new("gcc").arg("--version").output().is_ok()
}

#[test]
fn every_accepted_point_of_the_x86_minikernel_runs_unchanged() {
    if !have_gcc() {
        println!("SKIP: gcc is not installed");
        return;
    }

    let report = regress_x86_minikernel(&Options::ci()).unwrap();
    println!("{report}");

    assert!(report.divergences.is_empty(), "{report}");
    assert!(report.build_errors.is_empty(), "{report}");
    // The sweep is real: most instructions are probed, and most of those run.
    assert!(report.points > 1000, "{report}");
    assert!(report.splice_points > 300, "{report}");
    assert!(report.trap_points > 300, "{report}");
    assert!(
        report.executed_points * 2 > report.splice_points + report.trap_points,
        "{report}"
    );
    assert_eq!(report.splices_checked, report.splice_points);
    assert_eq!(
        report.traps_checked,
        report.splice_points + report.trap_points
    );
}
