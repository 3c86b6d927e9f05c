//! Hostile `.rodata`: the kallsyms table search and decoder. The input is seeded with the
//! digit-token run the search starts from, so the fuzzer reaches the decoder.
#![no_main]

use exotap_introspect::kallsyms::extract_from;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let base = 0xffff_ffff_8200_0000;
    let valid = [(0xffff_ffff_8100_0000, 0xffff_ffff_8400_0000), (0, 0x4_0000)];
    let _ = extract_from(data, base, &valid);
});
