#!/usr/bin/env bash
# The tests: install what is needed, fetch the guest images, run every test of the workspace
# (unit tests, and end-to-end tests that boot the Debian guest under QEMU TCG).
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install-deps.sh
cargo build --locked
# Gates (issue 41): the code as rustfmt writes it, no clippy warning (the workspace's lints),
# documentation that builds without a warning (broken intra-doc links included).
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
target/debug/exotap image fetch
target/debug/exotap image fetch --debuginfo
# The kernel matrix (tests/kernel_matrix.rs): the default kernel and the newest 6.12 cloud
# kernel apt knows.
kernels=$(target/debug/exotap image list)
default=$(awk '/\(default\)/ { print $1 }' <<<"$kernels")
newest_612=$(awk '$1 ~ /^6\.12\..*-cloud-amd64$/ { print $1 }' <<<"$kernels" | sort -V | tail -1)
if [ -z "$default" ] || [ -z "$newest_612" ]; then
    echo "ci/test.sh: exotap image list names no default kernel or no 6.12 cloud kernel:" >&2
    echo "$kernels" >&2
    exit 1
fi
target/debug/exotap image fetch --kernel "$newest_612"
export EXOTAP_KERNELS="$default,$newest_612"
# The nested KVM test (tests/kvm_nested.rs) runs a static release exotap inside a QEMU TCG
# guest: ~2.5 min to build from scratch, 4-8 min to run with its nine engine runs (docs/backends.md,
# "The kvm backend").
ci/nested/build-static.sh
export EXOTAP_NESTED=1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --workspace --locked --no-fail-fast "$@" -- --show-output 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
# How much of SystemTap's own example suite the front end parses and checks (a measure, not
# a pass/fail gate).
EXOTAP="$PWD/target/debug/exotap" ci/stap-examples.sh | sed -n '/^== SystemTap examples/,/^-p 2/p'
echo
echo "== tests that skipped part of their work, and why =="
grep -h 'SKIP' "$log" | sort -u || echo "(none)"
# Only an environment's lack may skip (issue 41): a skip for any other reason is listed here
# and fails the run, after the rest of the summary.
skips_rc=0
ci/skips-allowed.sh "$log" || skips_rc=$?
echo
echo "== the ten slowest test binaries (seconds) =="
awk '/^ *Running / { name = ($2 == "unittests") ? $4 : $2 } /^test result:/ { for (i = 1; i <= NF; i++) if ($i == "in") { t = $(i + 1); sub(/s$/, "", t); print t, name } }' "$log" |
    sort -rn | head -10 || true
# One closing line over every test binary (cargo prints one per binary).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "\ntotal: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
# Last, so that a CI page showing only the tail of the output still says why: each failing
# test's panic message (its assertion and the lines it printed with it).
if [ "$rc" -ne 0 ] && grep -q "panicked at" "$log"; then
    echo
    echo "== why the failing tests failed =="
    grep -A 15 'panicked at' "$log" | cut -c1-400 | head -150
fi
if [ "$skips_rc" -ne 0 ]; then
    echo
    echo "ci/test.sh: a test skipped for a reason ci/skips-allowed.sh does not allow (listed above)"
    [ "$rc" -ne 0 ] || rc=$skips_rc
fi
exit "$rc"
