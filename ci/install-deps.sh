#!/usr/bin/env bash
# Installs what exotap needs on a Debian bookworm host, idempotently: nothing is done when
# every package is already there. Needs root (apt-get).
set -euo pipefail

packages=(
  qemu-system-x86   # the qemu backend: boots the guest under TCG (or KVM where it works)
  busybox-static    # queried by apt; exotap itself fetches it with apt-get download
  gcc libc6-dev     # workloads are built with gcc -static -O2
  cpio              # tests read the initramfs back with an independent cpio
  util-linux        # unshare -n: proves a cached image fetch needs no network
  gdb               # debug-info tests compare exotap's line tables and layouts with gdb's
  cmake libclang-dev  # the unicorn-engine crate builds Unicorn's C code (cmake) and its bindings (bindgen)
  gcc-sparc64-linux-gnu  # builds the SPARC v9 mini-kernel of the splicing regression (regress/src/sparc.rs)
  systemtap-doc     # SystemTap's example suite, measured by ci/stap-examples.sh
  lcov              # genhtml renders the coverage tracefiles of exotap coverage (tests/jit_qemu.rs)
  python3-prometheus-client  # tests/procfs.rs parses /metrics with Prometheus's own Python parser
  python3-pip       # tests/perfetto_qemu.rs installs protobuf and Perfetto's published protos (PyPI) at test time
  # introspect/src/bzimage/decompress.rs compresses with each kernel compression's reference
  # tool at test time and checks the payload decompresses back (lzma and xz come from xz-utils)
  gzip bzip2 xz-utils lzop lz4 zstd
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "ci/install-deps.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# apt-cache must know the kernel package: a machine that never ran apt-get update knows nothing.
if ! apt-cache show --no-all-versions busybox-static >/dev/null 2>&1; then
  apt-get update -q
fi
# ci/test.sh runs the tests with cargo-nextest (each test in its own process, two at a time,
# the slowest first: .config/nextest.toml). Built from crates.io where it is not installed.
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "ci/install-deps.sh: installing cargo-nextest (cargo install --locked)"
  cargo install --locked cargo-nextest
fi
