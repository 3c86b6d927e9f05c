//! The splicing-safety regression over real functions of the Debian kernel: at least 30
//! library functions of the vmlinux, called in Unicorn with the image mapped at its link
//! address, every accepted point probed.

use exotap_regress::{vmlinux, Options, ProbeKind};

#[test]
fn every_accepted_point_of_30_vmlinux_functions_runs_unchanged() {
    let Some(path) = vmlinux::cached_vmlinux(exotap_guest_images::DEFAULT_KERNEL) else {
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
    // The entry patches of time, trace, nullify and replace at every function entry the
    // planner splices (the ftrace sites of lib/math and kernel/time), each under its oracle.
    for kind in [
        ProbeKind::Time,
        ProbeKind::Trace,
        ProbeKind::Nullify,
        ProbeKind::Replace,
    ] {
        let checked = report.entries_checked.get(&kind).copied().unwrap_or(0);
        assert!(checked >= 15, "{kind}: {checked} entries checked\n{report}");
    }
    assert!(
        report.executed_points * 2 > report.splice_points + report.trap_points,
        "{report}"
    );
}

#[test]
fn listed_functions_are_swept_and_unknown_ones_refused_by_name() {
    let Some(path) = vmlinux::cached_vmlinux(exotap_guest_images::DEFAULT_KERNEL) else {
        println!("SKIP: no vmlinux with symbols in the cache (exotap image fetch --debuginfo)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("functions.txt");
    // Two built-in functions and one with generic arguments (strchrnul of an empty string
    // returns at once, whatever the character).
    std::fs::write(&list, "# a list\nstrlen\n\ngcd  # numbers\nstrchrnul\n").unwrap();
    let names = vmlinux::read_function_list(&list).unwrap();

    let report = vmlinux::regress_functions(&path, &names, &Options::ci()).unwrap();
    let refused = vmlinux::regress_functions(
        &path,
        &["strlen", "exotap_no_such_function", "jiffies_64"],
        &Options::ci(),
    )
    .unwrap_err()
    .to_string();
    println!("{report}\n{refused}");

    assert_eq!(report.functions, 3, "{report}");
    assert!(report.image.contains("generic arguments"), "{report}");
    assert!(report.divergences.is_empty(), "{report}");
    assert!(
        refused.contains("exotap_no_such_function (no symbol"),
        "{refused}"
    );
    assert!(refused.contains("jiffies_64 (a data symbol"), "{refused}");
    assert!(!refused.contains("strlen"), "{refused}");
}
