#!/usr/bin/env bash
# The main job: install what is needed, build exotap, fetch the Debian guest kernel, boot it
# under QEMU and run the workloads. Prints the workloads' EXOTAP-RESULT lines and EXOTAP-DONE.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install-deps.sh
cargo build --release --locked
target/release/exotap image fetch
exec target/release/exotap boot "$@"
