//! Proof that the JIT regression can fail, both ways, on the x86-64 mini-kernel: a
//! relocator that puts RIP-relative displacements one byte off (the splice regression's
//! own fault) makes the translated run compute something else, and a translator that
//! sends taken conditional jumps to the original code (same results, blocks run
//! uncounted outside the cache) makes the counts differ from Unicorn's block hook. Its
//! own test binary, because the switches are process-wide.

use std::process::Command;

use exotap_probes::jit::translate::fault as jit_fault;
use exotap_probes::splice::reloc::fault as reloc_fault;
use exotap_regress::regress_jit_x86_minikernel;

fn have_gcc() -> bool {
    Command::new("gcc").arg("--version").output().is_ok()
}

#[test]
fn broken_relocation_and_unlinked_jumps_are_caught() {
    if !have_gcc() {
        println!("SKIP: gcc is not installed");
        return;
    }

    reloc_fault::set_rel32_off_by_one(true);
    let relocated = regress_jit_x86_minikernel();
    reloc_fault::set_rel32_off_by_one(false);
    jit_fault::set_unlinked_conditional_jumps(true);
    let unlinked = regress_jit_x86_minikernel();
    jit_fault::set_unlinked_conditional_jumps(false);
    let (relocated, unlinked) = (relocated.unwrap(), unlinked.unwrap());
    println!("{relocated}\n{unlinked}");

    assert!(
        relocated
            .divergences
            .iter()
            .any(|d| d.starts_with("run from")),
        "{relocated}"
    );
    assert!(
        !unlinked
            .divergences
            .iter()
            .any(|d| d.starts_with("run from")),
        "{unlinked}"
    );
    assert!(
        unlinked
            .divergences
            .iter()
            .filter(|d| d.starts_with("block at"))
            .count()
            >= 10,
        "{unlinked}"
    );
}
