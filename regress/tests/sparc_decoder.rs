//! The hand-written SPARC v9 decoder against binutils: every instruction of the SPARC
//! mini-kernel is classified (DCTI or not) and its PC-relative target computed the same
//! way `sparc64-linux-gnu-objdump -d` does.

use std::process::Command;

use exotap_probes::splice::sparc::decode;

const OBJDUMP: &str = "sparc64-linux-gnu-objdump";

/// objdump's mnemonics of delayed control transfers: branches (b*, fb*, br*), call,
/// jmp/jmpl, ret/retl, return. `btst`, `bset`, `bclr`, `btog` are synthetic ALU ops.
fn objdump_is_dcti(mnemonic: &str) -> bool {
    let m = mnemonic.split(',').next().unwrap_or("");
    matches!(m, "call" | "jmp" | "jmpl" | "ret" | "retl" | "return")
        || (m.starts_with('b') && !matches!(m, "btst" | "bset" | "bclr" | "btog"))
        || m.starts_with("fb")
}

#[test]
fn decoder_agrees_with_objdump_on_the_sparc_minikernel() {
    if Command::new(OBJDUMP).arg("--version").output().is_err() {
        println!("SKIP: {OBJDUMP} is not installed (apt-get install gcc-sparc64-linux-gnu)");
        return;
    }
    let kernel = exotap_guest_images::minikernel::ensure_sparc64().unwrap();
    let out = Command::new(OBJDUMP)
        .args(["-d", "-j", ".text"])
        .arg(&kernel.elf)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);

    let (mut checked, mut dctis, mut targets) = (0, 0, 0);
    for line in text.lines() {
        // "  1000a4c:\t7f ff ff fa \tcall  1000a34 <fib>"
        let mut cols = line.split('\t');
        let (Some(addr), Some(bytes), Some(asm)) = (cols.next(), cols.next(), cols.next()) else {
            continue;
        };
        let Ok(addr) = u64::from_str_radix(addr.trim().trim_end_matches(':'), 16) else {
            continue;
        };
        let hex: String = bytes.split_whitespace().collect();
        let Ok(word) = u32::from_str_radix(&hex, 16) else {
            continue;
        };
        let mnemonic = asm.split_whitespace().next().unwrap_or("");
        let insn = decode(addr, word);
        checked += 1;

        assert_eq!(insn.is_dcti(), objdump_is_dcti(mnemonic), "{line}");
        if insn.is_dcti() {
            dctis += 1;
        }
        if let Some(target) = insn.direct_target() {
            // objdump prints the target as the last hex number before "<symbol>".
            let before = asm.split('<').next().unwrap_or("");
            let shown = before
                .split([' ', ','])
                .filter_map(|t| u64::from_str_radix(t.trim(), 16).ok())
                .next_back();
            assert_eq!(shown, Some(target), "{line}");
            targets += 1;
        }
    }
    println!("{checked} instructions, {dctis} DCTIs, {targets} direct targets agree with objdump");
    assert!(checked > 1500 && dctis > 250 && targets > 200);
}
