//! The splicing-safety regression over the SPARC v9 mini-kernel: every accepted splice
//! point must leave the kernel's results unchanged and count exactly, with the patch
//! heap near the image and, through springboards, far from it; and so must a trap probe
//! at every point.

use std::process::Command;

use exotap_guest_images::minikernel::SPARC64_GCC;
use exotap_regress::sparc;
use exotap_regress::Options;

fn have_cross_gcc() -> bool {
    Command::new(SPARC64_GCC).arg("--version").output().is_ok()
}

#[test]
fn every_accepted_point_of_the_sparc_minikernel_runs_unchanged() {
    if !have_cross_gcc() {
        println!("SKIP: {SPARC64_GCC} is not installed (apt-get install gcc-sparc64-linux-gnu)");
        return;
    }

    let report = sparc::regress_minikernel(&Options::ci()).unwrap();
    println!("{report}");

    assert!(report.divergences.is_empty(), "{report}");
    assert!(report.build_errors.is_empty(), "{report}");
    assert!(report.points > 1000, "{report}");
    assert!(report.splice_points > 800, "{report}");
    assert!(
        report.executed_points * 2 > report.splice_points,
        "{report}"
    );
    assert_eq!(report.splices_checked, report.splice_points);
    // Traps everywhere but at the delay slots of annulling branches.
    assert!(report.traps_checked > 800, "{report}");
    assert!(report.traps_checked < report.splices_checked, "{report}");
    // The planner's refusals, one case each in entry.S's exotap_edges.
    for reason in [
        "reads %pc",
        "trap instruction (Tcc)",
        "delay-slot instruction is a branch target",
        "delay slot of ba,a/bn,a (never runs)",
    ] {
        assert_eq!(report.refused.get(reason), Some(&1), "{report}");
    }
}

#[test]
fn trap_probes_as_breakpoint_stops_through_the_control_interface() {
    if !have_cross_gcc() {
        println!("SKIP: {SPARC64_GCC} is not installed (apt-get install gcc-sparc64-linux-gnu)");
        return;
    }
    // Every breakpoint hit is a stop, a pc change and a resume through the Machine
    // interface: a tenth of the points keeps it short.
    let options = Options {
        in_emulator_traps: false,
        stride: 10,
        ..Options::ci()
    };

    let report = sparc::regress_minikernel(&options).unwrap();
    println!("{report}");

    assert!(report.divergences.is_empty(), "{report}");
    assert!(report.build_errors.is_empty(), "{report}");
    assert!(report.traps_checked > 80, "{report}");
}

#[test]
fn a_far_patch_heap_is_reached_through_springboards() {
    if !have_cross_gcc() {
        println!("SKIP: {SPARC64_GCC} is not installed (apt-get install gcc-sparc64-linux-gnu)");
        return;
    }
    let kernel = exotap_guest_images::minikernel::ensure_sparc64().unwrap();
    let image = exotap_regress::ElfImage::load(&kernel.elf).unwrap();
    let text = image.text().unwrap().addr;

    // The patch heap 256 MiB away, far beyond ba,a's ±8 MiB: every splice is a ba,a to
    // a springboard next to the image, which long-jumps to the patch.
    let options = Options {
        traps_everywhere: false,
        ..Options::ci()
    };
    let report = sparc::regress(&image, &options, sparc::Placement::Far).unwrap();
    println!("{report}");

    assert!(sparc::FAR_HEAP - text > 8 << 20);
    assert!(report.divergences.is_empty(), "{report}");
    assert!(report.build_errors.is_empty(), "{report}");
    assert!(report.splices_checked > 800, "{report}");
    assert_eq!(report.springboards, report.splices_checked, "{report}");
    let near = sparc::regress(&image, &options, sparc::Placement::Near).unwrap();
    assert_eq!(near.springboards, 0, "{near}");
    assert_eq!(near.checksum, report.checksum);
}
