//! Proof that the entry patches' checks can fail (issue 41): with the relocator's test-only
//! fault injection (every relocated rel32 branch one byte off), the `time` and `trace` entry
//! patches, whose relocated entry instruction is the ftrace site's `call __fentry__`, must
//! diverge at the vmlinux functions' entries; `nullify` and `replace` relocate nothing and
//! must not. Its own test binary, because the switch is process-wide.

use exotap_probes::splice::reloc::fault;
use exotap_regress::{vmlinux, Options, ProbeKind};

#[test]
fn an_entry_patch_with_an_off_by_one_relocation_diverges() {
    let Some(path) = vmlinux::cached_vmlinux(exotap_guest_images::DEFAULT_KERNEL) else {
        println!("SKIP: no vmlinux with symbols in the cache (exotap image fetch --debuginfo)");
        return;
    };
    let functions = ["gcd", "int_pow", "jiffies_to_msecs", "mktime64"];
    let options = Options {
        traps_everywhere: false,
        ..Options::ci()
    };
    fault::set_rel32_off_by_one(true);
    let report = vmlinux::regress_functions(&path, &functions, &options);
    fault::set_rel32_off_by_one(false);
    let report = report.unwrap();
    println!("{report}");

    let at_entries = |kind: ProbeKind| {
        report
            .divergences
            .iter()
            .filter(|d| d.kind == kind && d.function.ends_with("+0x0"))
            .count()
    };
    assert_eq!(at_entries(ProbeKind::Time), functions.len(), "{report}");
    assert_eq!(at_entries(ProbeKind::Trace), functions.len(), "{report}");
    assert_eq!(at_entries(ProbeKind::Nullify), 0, "{report}");
    assert_eq!(at_entries(ProbeKind::Replace), 0, "{report}");
}
