#!/usr/bin/env bash
# The tests: install what is needed, fetch the guest images, run every test of the workspace
# (unit tests, and end-to-end tests that boot the Debian guest under QEMU TCG).
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install-deps.sh
cargo build --locked
target/debug/exotap image fetch
target/debug/exotap image fetch --debuginfo
# The nested KVM test (tests/kvm_nested.rs) runs a static release exotap inside a QEMU TCG
# guest: ~2.5 min to build from scratch, 4-8 min to run with its nine engine runs (README.md,
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
echo
echo "== the ten slowest test binaries (seconds) =="
awk '/^ *Running / { name = ($2 == "unittests") ? $4 : $2 } /^test result:/ { for (i = 1; i <= NF; i++) if ($i == "in") { t = $(i + 1); sub(/s$/, "", t); print t, name } }' "$log" |
    sort -rn | head -10 || true
# One closing line over every test binary (cargo prints one per binary).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "\ntotal: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
exit "$rc"
