#!/usr/bin/env bash
# Builds the static exotap that the nested KVM harness (tests/kvm_nested/) runs inside the
# outer QEMU guest: glibc linked statically (-C target-feature=+crt-static), release profile
# (the guest runs it under TCG, where a debug build's kallsyms recovery is slow).
# Output: target/nested/exotap (stripped)
set -euo pipefail
cd "$(dirname "$0")/../.."
# No debug info: the binary is stripped anyway, and it saves build time.
# Without the unicorn feature (`exotap regress`): Unicorn's C library does not link statically.
CARGO_PROFILE_RELEASE_DEBUG=false \
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --locked --release --bin exotap --no-default-features --target x86_64-unknown-linux-gnu
built=target/x86_64-unknown-linux-gnu/release/exotap
if readelf -d "$built" 2>/dev/null | grep -q NEEDED; then
    echo "build-static.sh: $built needs shared libraries" >&2
    exit 1
fi
# Stripped: the outer guest holds it in its initramfs.
mkdir -p target/nested
strip -o target/nested/exotap "$built"
echo "static exotap: target/nested/exotap ($(du -h target/nested/exotap | cut -f1))"
