#!/usr/bin/env bash
# The nested KVM harness: boots Debian under QEMU TCG with -cpu max,+svm, loads kvm-amd there
# and runs exotap's own KVM VMM on the same kernel with the syscall workload and a counting
# splice of __x64_sys_getpid. ci/test.sh runs it too (see docs/backends.md, "The kvm backend").
#   EXOTAP_NESTED_CPUS=N   inner guest vCPUs (default 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
# The test build's exotap goes into the outer guest with its shared libraries; set
# EXOTAP_STATIC_BIN=target/nested/exotap after ci/nested/build-static.sh for a static release one.
start=$(date +%s)
EXOTAP_NESTED=1 cargo test --test kvm_nested -- --nocapture
echo "nested harness: $(( $(date +%s) - start )) s (build excluded)"
