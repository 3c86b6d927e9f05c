//! JIT mode of the regression on both x86-64 targets: every function translated with
//! block counters runs as the untranslated image does, and every block count equals what
//! Unicorn's own block hook saw on the untranslated run.

use std::process::Command;

use exotap_regress::{regress_jit_x86_minikernel, vmlinux};

fn have_gcc() -> bool {
    Command::new("gcc").arg("--version").output().is_ok()
}

#[test]
fn every_function_of_the_x86_minikernel_runs_translated_and_counts_exactly() {
    if !have_gcc() {
        println!("SKIP: gcc is not installed");
        return;
    }

    let report = regress_jit_x86_minikernel().unwrap();
    println!("{report}");

    assert!(report.divergences.is_empty(), "{report}");
    assert!(report.refused.is_empty(), "{report}");
    assert!(report.oracle_disagreements.is_empty(), "{report}");
    assert!(report.functions >= 20, "{report}");
    assert!(report.blocks_executed * 2 > report.blocks, "{report}");
    assert_eq!(report.counts_checked, report.blocks);
    assert!(report.block_executions > 10_000, "{report}");
}

#[test]
fn every_vmlinux_library_function_runs_translated_and_counts_exactly() {
    let Some(path) = vmlinux::cached_vmlinux(exotap_guest_images::DEFAULT_KERNEL) else {
        println!("SKIP: no vmlinux with symbols in the cache (exotap image fetch --debuginfo)");
        return;
    };

    let report = vmlinux::regress_jit(&path).unwrap();
    println!("{report}");

    assert!(report.divergences.is_empty(), "{report}");
    assert!(report.refused.is_empty(), "{report}");
    assert!(report.oracle_disagreements.is_empty(), "{report}");
    assert!(report.runs >= 30, "{report}");
    assert!(report.skipped.len() <= 3, "{report}");
    // Each call translates its callees' closure too (WARN and printk paths that do not
    // run); the executed part is what the oracle checks.
    assert!(report.functions >= 2 * report.runs, "{report}");
    assert!(report.blocks_executed >= 300, "{report}");
    assert!(report.block_executions >= 4000, "{report}");
    assert_eq!(report.counts_checked, report.blocks);
}
