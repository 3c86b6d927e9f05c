//! Hostile BTF blobs: header, type and string sections, and lookups on what parsed.
#![no_main]

use exotap_introspect::btf::Btf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(btf) = Btf::parse(data) {
        for (id, _) in btf.iter().take(256) {
            let _ = btf.name(id);
        }
        let _ = btf.struct_member("task_struct", "comm");
        let _ = btf.func_signature("vfs_read");
    }
});
