#!/usr/bin/env bash
# Debug-info bench, side by side in one run (issue 6): the two answers
#   gdb -batch -ex 'info line vfs_read' -ex 'ptype struct file' vmlinux
# against exotap (`exotap lines --brief vfs_read` then `exotap ptype struct file`, two processes,
# as a user types them) cold (no index in the cache: the first command builds it) and warm
# (index cached; median of $RUNS runs). Goals: cold <= 2 s, warm <= 50 ms.
#
# The -dbg vmlinux is read once first so that every contender finds it in the page cache.
# exotap is the release build (what `cargo install` gives a user); set EXOTAP to use another.
# Prints SKIP and exits 0 when gdb or the -dbg vmlinux is absent.
set -euo pipefail
cd "$(dirname "$0")/.."

KERNEL=${KERNEL:-6.1.0-50-cloud-amd64}
RUNS=${RUNS:-10}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/exotap
VMLINUX=$CACHE/kernels/$KERNEL/debug/vmlinux
if ! command -v gdb >/dev/null; then
    echo "SKIP: gdb is not installed (ci/install-deps.sh installs it)"
    exit 0
fi
if [[ ! -f $VMLINUX ]]; then
    echo "SKIP: $VMLINUX is absent (run \`exotap image fetch --debuginfo\`)"
    exit 0
fi
if [[ -z ${EXOTAP:-} ]]; then
    cargo build --release --locked --bin exotap >&2
    EXOTAP=target/release/exotap
fi

# A cache that shares the kernels but has no index: the cold runs build it there.
cold=$(mktemp -d)
trap 'rm -rf "$cold"' EXIT
mkdir -p "$cold/exotap"
ln -s "$CACHE/kernels" "$cold/exotap/kernels"

now() { date +%s%N; }
ms() { awk -v ns="$1" 'BEGIN { printf "%.1f", ns / 1e6 }'; }

cat "$VMLINUX" >/dev/null

t0=$(now)
gdb_out=$(gdb -batch -ex 'info line vfs_read' -ex 'ptype struct file' "$VMLINUX" 2>/dev/null)
t1=$(now)
gdb_ns=$((t1 - t0))

pair() {
    XDG_CACHE_HOME=$cold "$EXOTAP" lines --brief vfs_read
    XDG_CACHE_HOME=$cold "$EXOTAP" ptype struct file
}

t0=$(now)
cold_out=$(pair 2>/dev/null)
t1=$(now)
cold_ns=$((t1 - t0))

warm=()
for _ in $(seq "$RUNS"); do
    t0=$(now)
    warm_out=$(pair 2>/dev/null)
    t1=$(now)
    warm+=($((t1 - t0)))
done
warm_ns=$(printf '%s\n' "${warm[@]}" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')

same=yes
[[ $cold_out == "$gdb_out" && $warm_out == "$gdb_out" ]] || same=NO

echo "debug-info bench ($KERNEL, info line vfs_read + ptype struct file), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
echo "  gdb -batch              $(ms "$gdb_ns") ms"
echo "  exotap cold (no index)  $(ms "$cold_ns") ms   gdb/cold = $(awk -v a="$gdb_ns" -v b="$cold_ns" 'BEGIN { printf "%.1f", a / b }')x   goal <= 2000 ms"
echo "  exotap warm (median/$RUNS)  $(ms "$warm_ns") ms   gdb/warm = $(awk -v a="$gdb_ns" -v b="$warm_ns" 'BEGIN { printf "%.0f", a / b }')x   goal <= 50 ms"
echo "  answers equal gdb's: $same"
[[ $same == yes ]]
