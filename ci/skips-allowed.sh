#!/usr/bin/env bash
# The gate on skipped tests (issue 41): a test may print `SKIP: reason` (or `SKIP name:
# reason`) and return only when its environment lacks something (a tool not installed, an
# image not cached, hardware KVM present where the test checks its absence, a permission the
# container does not give). Every SKIP line of the test log LOG (stdin without one) must match
# one of the allowed reasons below; the others are printed, and the script exits 1.
#
#   ci/skips-allowed.sh LOG
#
# ci/test.sh runs it on its log. A new skip in a test needs its reason here, and only if it is
# an environment's lack; any other failure (a command that ran and failed, a fixture that did
# not build, a cached file that is there and does not load) must fail the test instead.
set -euo pipefail

# Extended regular expressions, matched anywhere in the line.
allowed=(
    # A tool: gcc, gdb, objcopy, xz, GNU cpio, dpkg-deb, qemu-system-x86_64, the SPARC cross
    # tools, the decompressors, python3 or its pip (Perfetto decoder), SystemTap's examples.
    '(is|are) not installed'
    # genhtml (lcov) that cannot be started because it is not there.
    'genhtml cannot run \(No such file or directory'
    # An image of the cache that was not fetched (exotap image fetch [--debuginfo]).
    'not cached'
    'no cached (Debian kernel|kernel|-dbg vmlinux)'
    'no -dbg System\.map cached'
    'no vmlinux with symbols in the cache'
    'needs the cached Debian kernel'
    ' is absent(;| \()'
    'no HOME or XDG_CACHE_HOME to find the kernel cache'
    # A cached kernel of another build than the offsets a test names.
    'the cached kernel is another build of'
    # Hardware KVM where the test checks how exotap refuses a host without it.
    'this host has hardware KVM'
    # What a container may not allow: ptrace (PTRACE_TRACEME: EPERM), `unshare -n`.
    'is not permitted here'
    'this host has no /dev/full'
)
# The nested KVM test runs only with EXOTAP_NESTED (ci/test.sh sets it, so there its skip is
# not allowed).
if [ -z "${EXOTAP_NESTED:-}" ]; then
    allowed+=('the nested KVM harness takes minutes')
fi

log=${1:--}
skips=$(grep -h 'SKIP' "$log" | sort -u || true)
if [ -z "$skips" ]; then
    exit 0
fi
pattern=$(
    IFS='|'
    echo "${allowed[*]}"
)
refused=$(grep -Ev -- "$pattern" <<<"$skips" || true)
if [ -n "$refused" ]; then
    echo "== skips whose reason is not an environment's lack (ci/skips-allowed.sh): fix the test or, for a real lack, its pattern =="
    echo "$refused"
    exit 1
fi
