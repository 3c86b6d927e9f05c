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
mkdir -p "$cold/exotap"
ln -s "$CACHE/kernels" "$cold/exotap/kernels"

tmp=$(mktemp -d)
trap 'rm -rf "$cold" "$tmp"' EXIT
# measure NAME CMD...: runs CMD with its stdout in $tmp/NAME; sets WALL and CPU (user + sys of
# the command and its children) in ms. CPU time barely moves with the load of a shared machine;
# wall time does.
measure() {
    local name=$1 t r u s
    shift
    TIMEFORMAT='%R %U %S'
    t=$({ time "$@" >"$tmp/$name" 2>/dev/null; } 2>&1)
    read -r r u s <<<"$t"
    WALL=$(awk -v r="$r" 'BEGIN { printf "%.1f", r * 1000 }')
    CPU=$(awk -v u="$u" -v s="$s" 'BEGIN { printf "%.1f", (u + s) * 1000 }')
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf (a / b < 100 ? "%.1f" : "%.0f"), a / b }'; }

pair() {
    XDG_CACHE_HOME=$cold "$EXOTAP" lines --brief vfs_read
    XDG_CACHE_HOME=$cold "$EXOTAP" ptype struct file
}

cat "$VMLINUX" >/dev/null

measure gdb gdb -batch -ex 'info line vfs_read' -ex 'ptype struct file' "$VMLINUX"
gdb_wall=$WALL gdb_cpu=$CPU
measure cold pair
cold_wall=$WALL cold_cpu=$CPU
walls=() cpus=()
for _ in $(seq "$RUNS"); do
    measure warm pair
    walls+=("$WALL") cpus+=("$CPU")
done
median() { printf '%s\n' "$@" | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
warm_wall=$(median "${walls[@]}") warm_cpu=$(median "${cpus[@]}")

same=yes
cmp -s "$tmp/gdb" "$tmp/cold" && cmp -s "$tmp/gdb" "$tmp/warm" || same=NO

echo "debug-info bench ($KERNEL: info line vfs_read + ptype struct file), exotap = $EXOTAP"
echo "  $(nproc) CPUs, load average $(cut -d' ' -f1 /proc/loadavg) (wall times grow with it; CPU times hardly)"
printf '  %-26s %10s %10s   %s\n' "" "wall ms" "CPU ms" "gdb/this (wall, CPU)"
printf '  %-26s %10s %10s\n' "gdb -batch" "$gdb_wall" "$gdb_cpu"
printf '  %-26s %10s %10s   %sx, %sx   goal: wall <= 2000 ms\n' "exotap cold (no index)" "$cold_wall" "$cold_cpu" \
    "$(ratio "$gdb_wall" "$cold_wall")" "$(ratio "$gdb_cpu" "$cold_cpu")"
printf '  %-26s %10s %10s   %sx, %sx   goal: wall <= 50 ms\n' "exotap warm (median of $RUNS)" "$warm_wall" "$warm_cpu" \
    "$(ratio "$gdb_wall" "$warm_wall")" "$(ratio "$gdb_cpu" "$warm_cpu")"
echo "  answers equal gdb's: $same"
[[ $same == yes ]]
