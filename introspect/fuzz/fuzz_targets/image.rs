//! Hostile kernel images: the bzImage setup header, the compressed payload (every format the
//! kernel's build makes) and the ELF parse.
#![no_main]

use exotap_introspect::bzimage::{decompress, SetupHeader, Vmlinux};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = SetupHeader::parse(data) {
        let _ = header.payload(data);
    }
    let _ = decompress(data);
    if let Ok(vmlinux) = Vmlinux::parse(data.to_vec()) {
        let _ = vmlinux.text_range();
        let _ = vmlinux.read_at(0xffff_ffff_8100_0000, 64);
    }
});
