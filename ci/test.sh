#!/usr/bin/env bash
# The tests: install what is needed, fetch the guest images, run every test of the workspace
# (unit tests, and end-to-end tests that boot the Debian guest under QEMU TCG).
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install-deps.sh
cargo build --locked
target/debug/exotap image fetch
cargo test --workspace --locked "$@"
