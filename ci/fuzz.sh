#!/usr/bin/env bash
# The fuzz targets of introspect/fuzz, vmm/fuzz and probes/fuzz (cargo-fuzz layout, libFuzzer
# through libfuzzer-sys), built with the machine's stable toolchain (no cargo-fuzz, no nightly:
# the coverage instrumentation is LLVM's sancov pass, which stable rustc runs) and each run for
# a while from an empty corpus. A crash, a leak of a panic or a timeout fails the script and
# leaves the input under target/fuzz-artifacts/TARGET/.
#
#   ci/fuzz.sh                 # every target, 30 s each, one at a time
#   FUZZ_SECONDS=300 ci/fuzz.sh parse_check module_list
#   FUZZ_JOBS=11 ci/fuzz.sh      # all at once
#
# ci/test.sh runs it at nice 19 beside its gates and tests (the instrumented build is a second
# build of most of the workspace, about 4.5 min of CPU on a 2-core machine, and the eleven
# targets run 5.5 min at 30 s each: at the lowest priority they take the CPU the tests leave
# idle). Run it by hand, longer, after changing a reader of guest data or the front end.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-30}
target=x86_64-unknown-linux-gnu
build=${CARGO_TARGET_DIR:-$PWD/target}/fuzz
# What cargo-fuzz passes (its `--sanitizer none`), less the flags only nightly takes.
flags="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table"
flags+=" -Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"

want=("$@")
# Targets run FUZZ_JOBS at a time (default 1); each for $seconds of wall time whatever the
# CPU it gets (ci/test.sh runs them all at once at nice 19, beside its tests).
jobs=${FUZZ_JOBS:-1}
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
run_target() {
    local crate=$1 bin=$2 artifacts=target/fuzz-artifacts/$2 corpus
    mkdir -p "$artifacts"
    corpus=$(mktemp -d)
    if "$build/$target/release/$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
        -artifact_prefix="$artifacts/" "$corpus" 2>"$corpus.log"; then
        { echo "== $crate: $bin for $seconds s"; grep -E '^(#[0-9]+ +DONE|Done [0-9]+ runs)' "$corpus.log" | tail -1; } >"$results/$bin.ok"
    else
        { echo "== $crate: $bin for $seconds s: FAILED"; tail -30 "$corpus.log"; } >"$results/$bin.failed"
    fi
    rm -rf "$corpus" "$corpus.log"
}
targets=()
# One build of the three crates' targets: their workspace is rooted at probes/fuzz, so the
# crates they share (introspect, vmm) are instrumented and compiled once.
# --target: the flags reach the targets, not the build scripts and proc macros.
RUSTFLAGS=$flags CARGO_TARGET_DIR=$build cargo build --manifest-path probes/fuzz/Cargo.toml \
    --workspace --release --bins --target "$target" --locked
for crate in introspect/fuzz vmm/fuzz probes/fuzz; do
    for bin in $(awk -F'"' '/^name = / && seen { print $2 } /^\[\[bin\]\]/ { seen = 1 }' "$crate/Cargo.toml"); do
        if ((${#want[@]})) && [[ " ${want[*]} " != *" $bin "* ]]; then
            continue
        fi
        targets+=("$crate:$bin")
    done
done
running=0
for t in "${targets[@]}"; do
    if ((running >= jobs)); then
        wait -n || true
        running=$((running - 1))
    fi
    run_target "${t%%:*}" "${t#*:}" &
    running=$((running + 1))
done
wait
failed=()
for t in "${targets[@]}"; do
    bin=${t#*:}
    if [ -f "$results/$bin.ok" ]; then
        cat "$results/$bin.ok"
    else
        cat "$results/$bin.failed" 2>/dev/null || echo "== ${t%%:*}: $bin: no result"
        failed+=("$bin")
    fi
done
if ((${#failed[@]})); then
    echo "ci/fuzz.sh: failed: ${failed[*]} (inputs under target/fuzz-artifacts/)" >&2
    exit 1
fi
echo "ci/fuzz.sh: every target ran $seconds s without a failure"
