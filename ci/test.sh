#!/usr/bin/env bash
# The tests: install what is needed, fetch the guest images, run every test of the workspace
# (unit tests, and end-to-end tests that boot the Debian guest under QEMU TCG).
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install-deps.sh
# Room for the build (about 4 GiB of target/) and the guest images (about 2.5 GiB in the
# cache): a disk that runs out mid-build fails with rustc's "No space left on device" deep in
# the log, so say it first, with the numbers (a warning: the run goes on and may fit).
need_kib=$((8 * 1024 * 1024))
free_kib=$(df -Pk . | awk 'NR == 2 { print $4 }')
if [ "$free_kib" -lt "$need_kib" ]; then
    echo "ci/test.sh: warning: only $((free_kib / 1024)) MiB free on $(df -P . | awk 'NR == 2 { print $6 }'); the build and the guest images need about 8 GiB" >&2
    df -h . >&2 || true
fi
# One build from scratch, as CI makes it: no incremental state to write (it is never reused),
# line tables only as debug info (backtraces keep file:line; the test binaries link in a
# fraction of the time and space). 385 s instead of 606 s on a 2-core machine.
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
# Gates (issue 41), the quick ones first: the code as rustfmt writes it; probes/'s layers (no
# module uses one above it, docs/architecture.md).
cargo fmt --all --check
ci/layers.sh
cargo test --workspace --locked --no-run
# The fuzz targets (issue 41): their instrumented build and each target's 30 s, all eleven at
# once, at the lowest CPU priority beside everything below, so that they take the CPU the
# gates and the tests leave idle (a guest that waits, a test that sleeps: a fifth of the two
# cores in a run without them) rather than minutes of their own (one at a time they ended
# 2.4 min after the tests). Waited for after the tests; a failure fails the run.
fuzz_log=$(mktemp)
# Its own process group (job control for this one command), so that an early exit below ends
# all of it; not its own session: the kernel's autogroups would then give it a fair share of
# the CPU whatever its nice value (seen: clippy 101 s -> 250 s beside it).
set -m
# opt-level 1 for this build: 240 s of CPU instead of 278 s at opt-level 3, for 15% fewer
# runs in each target's 30 s (parse_check 411k against 487k runs in 10 s, module_list 925k
# against 1,071k); by hand, ci/fuzz.sh builds at the release profile's opt-level 3.
CARGO_PROFILE_RELEASE_OPT_LEVEL=1 FUZZ_JOBS=11 nice -n 19 ci/fuzz.sh >"$fuzz_log" 2>&1 &
fuzz_pid=$!
set +m
# The guest images, fetched (downloads, unpacking) while the gates below keep the two cores busy
# compiling: on a fresh machine that is time CI no longer waits for. (Not after a first build of
# exotap alone, before the rest: two cargo runs left a core idle at the end of the first and
# took 72 s more than one.) The kernel matrix (tests/kernel_matrix.rs) runs on the default
# kernel and the newest 6.12 cloud kernel apt knows.
images=$(mktemp -d)
# A gate that fails below ends the fetch too.
trap '[ -z "${images_pid:-}" ] || kill "$images_pid" 2>/dev/null; [ -z "${fuzz_pid:-}" ] || kill -- -"$fuzz_pid" 2>/dev/null; rm -rf "$images"' EXIT
(
    set -euo pipefail
    target/debug/exotap image fetch
    target/debug/exotap image fetch --debuginfo
    kernels=$(target/debug/exotap image list)
    default=$(awk '/\(default\)/ { print $1 }' <<<"$kernels")
    newest_612=$(awk '$1 ~ /^6\.12\..*-cloud-amd64$/ { print $1 }' <<<"$kernels" | sort -V | tail -1)
    if [ -z "$default" ] || [ -z "$newest_612" ]; then
        echo "ci/test.sh: exotap image list names no default kernel or no 6.12 cloud kernel:" >&2
        echo "$kernels" >&2
        exit 1
    fi
    # With its -dbg package: the kernel matrix reads evdev's debug file on every kernel.
    target/debug/exotap image fetch --debuginfo --kernel "$newest_612"
    echo "$default,$newest_612" >"$images/kernels"
    # Then how much of SystemTap's own example suite the front end parses and checks (a
    # measure, not a pass/fail gate), with its page of every example's result
    # (docs/stap-examples.md is this run's output: the end of this script says when the
    # committed one is stale). 38 s of one core: at nice 19, as the fuzz targets, so that it
    # takes the CPU the gates and the tests leave idle; at its default priority it took that
    # time from clippy (59 s alone; 127 s in a CI run beside it and the fuzz build).
    EXOTAP="$PWD/target/debug/exotap" nice -n 19 ci/stap-examples.sh --matrix "$images/matrix" \
        >"$images/stap" 2>&1 || echo "ci/stap-examples.sh failed (exit $?)" >>"$images/stap"
) >"$images/log" 2>&1 &
images_pid=$!
# No clippy warning (the workspace's lints), then documentation that builds without a warning
# (broken intra-doc links included). Not clippy's driver inside the test build: rustdoc reads
# the dependencies' metadata from their check-mode build, which clippy's pass makes (doc then
# takes 14 s); without that pass doc made it itself (82 s), and the driver slowed the build.
cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
# The benches build (they are run by hand: criterion, see docs/), so that they cannot rot:
# in the dev profile of the test build above, whose crates they reuse (the bench profile
# would build the whole workspace and its dependencies again, optimised, for a check that only
# needs their code to compile and link; `cargo bench` by hand builds them optimised).
cargo build --workspace --locked --benches --profile dev
# The documentation's examples (cargo-nextest below does not run doctests), when there are
# any: rustdoc type-checks every library again to look for them (2.5 min for none).
if ci/has-doctests.sh; then
    cargo test --workspace --locked --doc
else
    echo "ci/test.sh: no documentation example to run (ci/has-doctests.sh)"
fi
# The images fetched above, in the background: their output now, and a failure fails here
# (the examples' measure may still run: it is waited for at the end).
while [ ! -s "$images/kernels" ] && kill -0 "$images_pid" 2>/dev/null; do
    sleep 1
done
if [ ! -s "$images/kernels" ]; then
    images_rc=0
    wait "$images_pid" || images_rc=$?
    cat "$images/log"
    echo "ci/test.sh: fetching the guest images failed (exit $images_rc)" >&2
    exit 1
fi
cat "$images/log"
export EXOTAP_KERNELS="$(cat "$images/kernels")"
# The JIT's block counts against the guest's kprobes at every leader (tests/jit_qemu.rs), on
# both kernels too.
export EXOTAP_JIT_KERNELS="$EXOTAP_KERNELS"
# The nested KVM test (tests/kvm_nested/) runs the test build's own exotap (stripped, with its
# loader and libraries) inside a QEMU TCG guest: 4-8 min with its engine runs (docs/backends.md,
# "The kvm backend"). No second build: the static release one it ran before took 6-8 min of CI.
export EXOTAP_NESTED=1
log=$(mktemp)
trap '[ -z "${images_pid:-}" ] || kill "$images_pid" 2>/dev/null; [ -z "${fuzz_pid:-}" ] || kill -- -"$fuzz_pid" 2>/dev/null; rm -f "$log"; rm -rf "$images"' EXIT
set +e
# cargo-nextest, profile `ci` of .config/nextest.toml: every test in its own process, two at a
# time, the slowest first; each test's time as it ends, every test's output at the end (the
# SKIP lines read below), a JUnit report in target/nextest/ci/junit.xml.
cargo nextest run --workspace --locked --profile ci --no-fail-fast "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
# SystemTap's example suite, measured in the background above (ci/stap-examples.sh).
wait "$images_pid" || true
images_pid=
sed -n "/^== SystemTap examples/,/^SystemTap's test suite/p" "$images/stap"
grep -h "ci/stap-examples.sh failed" "$images/stap" || true
if [ -s "$images/matrix" ] && ! diff -q docs/stap-examples.md "$images/matrix" >/dev/null; then
    echo "ci/test.sh: docs/stap-examples.md is stale; what this run found differs:"
    diff -u docs/stap-examples.md "$images/matrix" | head -40 || true
fi
# The fuzz targets, started after the build: each target's last line (its runs in 30 s).
echo
echo "== fuzz targets (ci/fuzz.sh, 30 s each at nice 19 beside the tests) =="
fuzz_rc=0
wait "$fuzz_pid" || fuzz_rc=$?
fuzz_pid=
grep -E '^(== |#[0-9]+ +DONE|Done [0-9]+ runs|ci/fuzz.sh)' "$fuzz_log" || true
if [ "$fuzz_rc" -ne 0 ]; then
    tail -40 "$fuzz_log"
    echo "ci/test.sh: ci/fuzz.sh failed (exit $fuzz_rc)"
    [ "$rc" -ne 0 ] || rc=$fuzz_rc
fi
rm -f "$fuzz_log"
echo
echo "== tests that skipped part of their work, and why =="
grep -h 'SKIP' "$log" | sort -u || echo "(none)"
echo
# A test that ran part of its work again (kvm_nested, for faults put down to QEMU TCG's SVM
# emulation) says so on a RETRY line: listed, so that a pattern shows.
echo "== tests that ran part of their work again, and why =="
grep -h 'RETRY ' "$log" | cut -c1-600 | sort -u || echo "(none)"
# Only an environment's lack may skip (issue 41): a skip for any other reason is listed here
# and fails the run, after the rest of the summary.
skips_rc=0
ci/skips-allowed.sh "$log" || skips_rc=$?
echo
echo "== the ten slowest tests (seconds) =="
# nextest's result lines, `PASS [ 123.456s] (12/1230) binary test::name`, each printed again
# above its output at the end.
sed -nE 's/^ *(PASS|FAIL|SIGSEGV|SIGABRT|TIMEOUT) \[ *([0-9.]+)s\] (\([0-9\/ ]+\) )?/\2 \1 /p' "$log" |
    sort -u | sort -rn | head -10 || true
echo
grep -E '^ *Summary \[' "$log" | tail -1 || true
# Last, so that a CI page showing only the tail of the output still says why: each failing
# test's panic message (its assertion and the lines it printed with it).
if [ "$rc" -ne 0 ] && grep -q "panicked at" "$log"; then
    echo
    echo "== why the failing tests failed =="
    grep -A 15 'panicked at' "$log" | cut -c1-400 | head -150
fi
if [ "$skips_rc" -ne 0 ]; then
    echo
    echo "ci/test.sh: a test skipped for a reason ci/skips-allowed.sh does not allow (listed above)"
    [ "$rc" -ne 0 ] || rc=$skips_rc
fi
exit "$rc"
