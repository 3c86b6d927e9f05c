//! The splicing-safety regression over real functions of the Debian kernel: at least 30
//! library functions of the vmlinux, called in Unicorn with the image mapped at its link
//! address, every accepted point probed.

use exotap_regress::{vmlinux, Options};

#[test]
fn every_accepted_point_of_30_vmlinux_functions_runs_unchanged() {
    let Some(path) = vmlinux::cached_vmlinux() else {
        println!("SKIP: no vmlinux with symbols in the cache (exotap image fetch --debuginfo)");
        return;
    };

    let report = vmlinux::regress(&path, &Options::ci()).unwrap();
    println!("{report}");

    assert!(report.functions >= 30, "{report}");
    assert!(report.skipped.len() <= 3, "{report}");
    assert!(report.divergences.is_empty(), "{report}");
    assert!(report.build_errors.is_empty(), "{report}");
    assert!(report.splice_points + report.trap_points > 500, "{report}");
    assert!(
        report.executed_points * 2 > report.splice_points + report.trap_points,
        "{report}"
    );
}
