#!/bin/bash
# Fault trials (issue 20): exotap is killed or interrupted at random moments while its probes
# are in a running guest; the guest must not notice.
#
# usage: ci/fault-trials.sh [TRIALS] [SIGNALS] [STORM_SECONDS]
#   TRIALS   number of trials (default 50)
#   SIGNALS  comma list of signals picked at random per trial (default KILL; e.g. INT,TERM)
#   STORM    seconds of syscall and fork/exec storm the guest runs (default: enough for the trials)
#
# One 2-vCPU guest runs a storm (mixed: fork+exec, file and pipe I/O; syscall-loop) with its
# gdbstub on a unix socket. Each trial starts one of: count, time, trace, a script with trap
# entry and .return probes (--compile never), a compiled script with .return probes, waits a
# random 0.2-10 s (install, hits, drains and removal all fall in that span), and sends the
# signal. For SIGKILL the guardian recovers; for INT/TERM exotap removes its own probes. Then
# `exotap recover --digest` must find nothing left, and the kernel text's SHA-256 must equal the
# one taken before the first trial. At the end the guest must finish its job (EXOTAP-DONE 0)
# with no Oops, BUG or WARNING on its console. Prints one line per trial and a summary; exit 0
# only when every trial held.
set -u
TRIALS=${1:-50}
SIGNALS=${2:-KILL}
X=${EXOTAP:-$(cd "$(dirname "$0")/.." && pwd)/target/release/exotap}
[ -x "$X" ] || { echo "build exotap first (cargo build --release), or set EXOTAP" >&2; exit 2; }
STORM=${3:-$(( TRIALS * 25 + 60 ))}
W=$(mktemp -d /tmp/exotap-trials.XXXXXX)
SOCK=$W/gdb.sock
T=unix:$SOCK
cat > "$W/job.sh" <<JOB
end=\$(( \$(date +%s) + $STORM ))
( while [ \$(date +%s) -lt \$end ]; do mixed 5 >/dev/null || echo STORM-FAIL mixed; done ) &
( while [ \$(date +%s) -lt \$end ]; do syscall-loop 20000 >/dev/null || echo STORM-FAIL loop; done ) &
wait
exotap_result storm done
JOB
"$X" boot --cpus 2 --timeout $(( STORM + 600 )) --job "$W/job.sh" \
    --gdbstub "unix:$SOCK,server=on,wait=off" > "$W/console.log" 2> "$W/boot.err" &
BOOT=$!
for _ in $(seq 1 180); do grep -q EXOTAP-READY "$W/console.log" && break; sleep 1; done
grep -q EXOTAP-READY "$W/console.log" || { echo "the guest did not boot; see $W" >&2; exit 1; }

digest() { "$X" recover --target "$T" --digest 2>&1; }
BEFORE=$(digest | sed -n 's/^kernel text sha256 //p')
[ -n "$BEFORE" ] || { echo "no digest before the trials" >&2; exit 1; }
echo "kernel text sha256 before: $BEFORE"

TRAP='global n, m; probe kernel.function("ksys_read") { n++ } probe kernel.function("ksys_read").return { m++ } probe kernel.function("do_sys_openat2").return { m++ }'
COMPILED='global c; probe kernel.function("vfs_read").return { c[execname()]++ } probe kernel.function("do_sys_openat2").return { c[execname()]++ }'
# tool N: sets the arguments of tool N.
TOOLS=5
tool() {
  case $1 in
    0) ARGS=(count 'vfs_*' 'ksys_*') ;;
    1) ARGS=(time ksys_read vfs_read do_sys_openat2 __x64_sys_getppid) ;;
    2) ARGS=(trace ksys_read __x64_sys_getpid) ;;
    3) ARGS=(run --compile never -e "$TRAP") ;;
    4) ARGS=(run --compile require -e "$COMPILED") ;;
  esac
}
IFS=, read -r -a SIGS <<< "$SIGNALS"
failed=0; longest=0; recovered=0
for i in $(seq 1 "$TRIALS"); do
  tool $(( RANDOM % TOOLS ))
  sig=${SIGS[$(( RANDOM % ${#SIGS[@]} ))]}
  delay=$(awk -v r=$RANDOM 'BEGIN { printf "%.2f", 0.2 + r / 32767 * 9.8 }')
  "$X" "${ARGS[@]}" --target "$T" > "$W/out.$i" 2> "$W/err.$i" &
  P=$!
  sleep "$delay"
  t0=$(date +%s%N)
  kill -"$sig" "$P" 2>/dev/null
  wait "$P"; rc=$?
  while pgrep -f "guardian --target $T" > /dev/null; do sleep 0.02; done
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  [ "$ms" -gt "$longest" ] && longest=$ms
  grep -q "ended without removing its probes" "$W/err.$i" && recovered=$(( recovered + 1 ))
  after=$(digest)
  verdict=ok
  echo "$after" | grep -q "nothing to recover" || verdict="LEFT-OVER"
  echo "$after" | grep -q "kernel text sha256 $BEFORE" || verdict="$verdict TEXT-CHANGED"
  [ "$verdict" = ok ] || failed=$(( failed + 1 ))
  printf 'trial %3d %-4s after %5ss: exit %3d, clean after %5d ms, %s: %s\n' \
    "$i" "$sig" "$delay" "$rc" "$ms" "$verdict" "${ARGS[*]:0:3}"
  [ "$verdict" = ok ] || { tail -3 "$W/err.$i"; echo "$after"; }
done
echo "waiting for the guest to finish its storm ..."
wait "$BOOT"
done_line=$(grep -a "EXOTAP-DONE" "$W/console.log" | tail -1)
bad=$(grep -a -c -E "Oops|BUG:|WARNING:|general protection|STORM-FAIL" "$W/console.log")
echo "trials $TRIALS, signals $SIGNALS: $failed failed; guardian recoveries $recovered;" \
     "longest signal-to-clean $longest ms; guest: ${done_line:-no EXOTAP-DONE}, $bad Oops/BUG/WARNING/storm failures"
echo "work files: $W"
[ "$failed" -eq 0 ] && [ "$done_line" = "EXOTAP-DONE 0" ] && [ "$bad" -eq 0 ]
