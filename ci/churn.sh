#!/bin/bash
# Churn (issue 20): for SECONDS (default 60), install and remove splices, compiled probes and
# trap probes at random sets of kernel functions, back to back, in a 2-vCPU guest under a
# fork/exec and syscall storm; every count is checked against the guest's own kprobes on the
# same functions, the kernel text must hash the same at the end, and the guest must finish
# its job with no Oops, BUG or WARNING.
#
# usage: ci/churn.sh [SECONDS]
set -u
SECONDS_WANTED=${1:-60}
X=${EXOTAP:-$(cd "$(dirname "$0")/.." && pwd)/target/release/exotap}
[ -x "$X" ] || { echo "build exotap first (cargo build --release), or set EXOTAP" >&2; exit 2; }
W=$(mktemp -d /tmp/exotap-churn.XXXXXX)
SOCK=$W/gdb.sock
T=unix:$SOCK
# Functions the guest arms its own kprobes on (the oracle for every count).
ORACLE=(__do_sys_getpid __do_sys_getppid __x64_sys_close __x64_sys_pread64 ksys_read ksys_write
        vfs_read vfs_write vfs_open rw_verify_area do_sys_openat2 do_filp_open path_openat
        security_file_open alloc_empty_file fd_install close_fd filp_close fput __fput dput
        kernel_clone wake_up_new_task try_to_wake_up)
# Wildcards for the rest of each batch (hundreds of functions each).
GLOBS=('vfs_*' 'ksys_*' '__x64_sys_*' 'do_sys_*' 'security_file_*' 'pipe_*' 'filemap_*'
       '*_getattr' 'path_*' 'mnt_*')
STORM=$(( SECONDS_WANTED + 150 ))
{
  echo 'T=/sys/kernel/tracing'
  i=0; for f in "${ORACLE[@]}"; do echo "echo 'p:exotap/k$i $f' >> \$T/kprobe_events || echo KPROBE-REFUSED $f"; i=$((i+1)); done
  echo 'echo 1 > $T/events/exotap/enable'
  echo "end=\$(( \$(date +%s) + $STORM ))"
  echo '( while [ $(date +%s) -lt $end ]; do mixed 5 >/dev/null || echo STORM-FAIL mixed; done ) &'
  echo '( while [ $(date +%s) -lt $end ]; do syscall-loop 20000 >/dev/null || echo STORM-FAIL loop; done ) &'
  echo 'wait'
  echo 'echo 0 > $T/events/exotap/enable; echo > $T/kprobe_events'
  echo 'exotap_result storm done'
} > "$W/job.sh"
"$X" boot --cpus 2 --timeout $(( STORM + 600 )) --job "$W/job.sh" \
    --gdbstub "unix:$SOCK,server=on,wait=off" > "$W/console.log" 2> "$W/boot.err" &
BOOT=$!
for _ in $(seq 1 180); do grep -q EXOTAP-READY "$W/console.log" && break; sleep 1; done
grep -q EXOTAP-READY "$W/console.log" || { echo "the guest did not boot; see $W" >&2; exit 1; }
sleep 3
BEFORE=$("$X" recover --target "$T" --digest 2>&1 | sed -n 's/^kernel text sha256 //p')
echo "kernel text sha256 before: $BEFORE"

pick() { local n=$1; shift; printf '%s\n' "$@" | shuf -n "$n" | tr '\n' ' '; }
installs=0; removals=0; hits=0; compared=0; mismatches=0; failures=0; runs=0
start=$(date +%s)
while [ $(( $(date +%s) - start )) -lt "$SECONDS_WANTED" ]; do
  runs=$((runs + 1))
  d=$(awk -v r=$RANDOM 'BEGIN { printf "%.1f", 0.5 + r / 32767 * 1.5 }')
  case $(( RANDOM % 4 )) in
    0) kind=count; set -- count --compare-kprobes --duration "$d" $(pick 8 "${ORACLE[@]}") "${GLOBS[$((RANDOM % ${#GLOBS[@]}))]}" "${GLOBS[$((RANDOM % ${#GLOBS[@]}))]}" ;;
    1) kind=time; set -- time --duration "$d" $(pick 6 "${ORACLE[@]}") ;;
    2) kind=compiled; f1=$(pick 1 "${ORACLE[@]}"); f2=$(pick 1 "${ORACLE[@]}")
       set -- run --compile require -e "global c; probe kernel.function(\"${f1% }\").return { c[execname()]++ } probe kernel.function(\"${f2% }\") { c[\"entry\"]++ } probe timer.ms($(( 500 + RANDOM % 1500 ))) { exit() }" ;;
    3) kind=trap; f1=$(pick 1 ksys_read vfs_read do_sys_openat2 vfs_write)
       set -- run --compile never -e "global n; probe kernel.function(\"${f1% }\").return { n++ } probe timer.ms($(( 500 + RANDOM % 1500 ))) { exit() }" ;;
  esac
  EXOTAP_LOG=info "$X" "$@" --target "$T" > "$W/out" 2> "$W/err"
  rc=$?
  n=$(sed -n 's/.* \([0-9]*\) splices installed.*/\1/p; s/.*compiled probes in at \([0-9]*\) sites.*/\1/p; s/.*armed \([0-9]*\) probe sites.*/\1/p' "$W/err" | head -1)
  n=${n:-0}
  installs=$((installs + n))
  if [ "$rc" -ne 0 ] && [ "$kind" != count ]; then
    failures=$((failures + 1)); echo "run $runs ($kind) exit $rc:"; tail -3 "$W/err"
  else
    removals=$((removals + n))
  fi
  if [ "$kind" = count ]; then
    # Rows: ours kprobe-hits kprobe-misses FUNCTION (only functions the guest probes too).
    read -r c m h < <(awk 'NF == 4 && $1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ { c++; if ($1 != $2 + $3) m++ }
                           NF >= 2 && $1 ~ /^[0-9]+$/ { h += $1 } END { print c + 0, m + 0, h + 0 }' "$W/out")
    compared=$((compared + c)); mismatches=$((mismatches + m)); hits=$((hits + h))
    [ "$m" -eq 0 ] || { echo "run $runs: count differs from the guest's kprobes:"; grep -E '^ *[0-9]+ +[0-9]+ +[0-9]+ ' "$W/out"; }
  elif [ "$kind" = time ]; then
    hits=$((hits + $(awk '/calls timed/ { s += $2 } END { print s + 0 }' "$W/out")))
  fi
done
AFTER=$("$X" recover --target "$T" --digest 2>&1)
echo "$AFTER"
echo "waiting for the guest to finish its storm ..."
wait "$BOOT"
done_line=$(grep -a "EXOTAP-DONE" "$W/console.log" | tail -1)
bad=$(grep -a -c -E "Oops|BUG:|WARNING:|general protection|STORM-FAIL|KPROBE-REFUSED" "$W/console.log")
same=no; echo "$AFTER" | grep -q "kernel text sha256 $BEFORE" && same=yes
left=no; echo "$AFTER" | grep -q "nothing to recover" || left=yes
echo "churn ${SECONDS_WANTED} s: $runs runs, $installs installs, $removals removals, $hits hits counted;" \
     "$compared counts compared with the guest's kprobes, $mismatches differ; $failures runs failed;" \
     "text identical: $same; anything left: $left; guest: ${done_line:-no EXOTAP-DONE}, $bad Oops/BUG/WARNING/storm failures"
echo "work files: $W"
[ "$mismatches" -eq 0 ] && [ "$failures" -eq 0 ] && [ "$same" = yes ] && [ "$left" = no ] \
  && [ "$done_line" = "EXOTAP-DONE 0" ] && [ "$bad" -eq 0 ]
