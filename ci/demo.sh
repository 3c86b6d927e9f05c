#!/usr/bin/env bash
# The main job: install what is needed, build exotap, fetch the Debian guest kernel, boot it
# under QEMU, run the workloads, and run the example probe script against the live kernel
# (probes/examples/syscalls.stp: who calls vfs_read with what sizes, getppid per CPU). Prints
# the script's output, the workloads' EXOTAP-RESULT lines and EXOTAP-DONE; the kernel's
# console goes to a file. Extra arguments go to `exotap boot`.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install-deps.sh
cargo build --release --locked
target/release/exotap image fetch
console="${TMPDIR:-/tmp}/exotap-demo-console.log"
echo "ci/demo.sh: the guest's console goes to $console"
exec target/release/exotap boot \
  --script probes/examples/syscalls.stp \
  --run 'exotap_phase syscalls; syscall-loop 500; exotap_phase mixed; mixed 5' \
  --console "$console" "$@"
