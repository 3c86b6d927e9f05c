#!/usr/bin/env python3
"""Attach bench (issue 44): the memory and start-up of an exotap that attaches to a running
guest, side by side in one run, with the cached analysis cold and warm.

Each case is one `exotap ... --target ADDR --duration 1` process, as a user runs it; the
bench reads
  - peak RSS: the child's ru_maxrss (what `/usr/bin/time -v` calls maximum resident set size);
  - to installed: seconds from the process's start to its line saying the probes are in (the
    image loaded, the guest attached, its text read, the plan made and written);
  - attach to installed: seconds from the "attached" log line to that line.
Cases: `count` of 1 function, of 100 (the first 100 `__x64_sys_*`), of every kernel function
(`count '*'`: 37,000 splices on 6.1, the rest refused and said), and a one-line compiled
script. "cold" removes exotap's cached analysis
(`~/.cache/exotap/analysis`, the branch targets) and unpacked kernels (`unpacked/`) first;
"warm" is the median of RUNS runs after it.

  ci/bench-attach.py                 # boots the default guest (QEMU TCG, 2 vCPUs) and benches
  ci/bench-attach.py --target ADDR   # a guest already running with a gdbstub at ADDR
  EXOTAP=path RUNS=5 ci/bench-attach.py

exotap is the release build (what `cargo install` gives a user); set EXOTAP to use another.
"""

import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = int(os.environ.get("RUNS", "5"))
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "exotap")
# What each verb says once its probes are in: count's stderr line, the compiled script's log.
INSTALLED = re.compile(r"exotap: splices in|compiled probes in at")


def exotap():
    if os.environ.get("EXOTAP"):
        return os.environ["EXOTAP"]
    subprocess.run(["cargo", "build", "--release", "--locked", "--bin", "exotap"], cwd=ROOT, check=True)
    return os.path.join(ROOT, "target", "release", "exotap")


def boot(binary, workdir):
    """Boots the default guest with a workload and a gdbstub; returns (process, target)."""
    sock = os.path.join(workdir, "g.sock")
    job = os.path.join(workdir, "job.sh")
    with open(job, "w") as f:
        f.write("exotap_result ready 1\nwhile :; do syscall-loop 200 >/dev/null; sleep 0.2; done\n")
    log = open(os.path.join(workdir, "console.log"), "w")
    proc = subprocess.Popen(
        [binary, "boot", "--timeout", "3600", "--job", job, "--gdbstub", f"unix:{sock},server=on,wait=off"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    while time.time() < deadline:
        with open(os.path.join(workdir, "console.log")) as f:
            if "ready=1" in f.read():
                return proc, f"unix:{sock}"
        if proc.poll() is not None:
            sys.exit("the guest did not boot; see " + log.name)
        time.sleep(1)
    proc.kill()
    sys.exit("the guest did not reach its job in 600 s")


def one(args):
    """Runs one exotap process; returns (peak RSS MB, to installed s, attach to installed s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, EXOTAP_LOG="debug"))
    installed = attached = None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        now = time.monotonic() - start
        if attached is None and "attached: the guest is stopped" in line:
            attached = now
        if installed is None and INSTALLED.search(line):
            installed = now
    rc = proc.wait()
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # `count '*'` ends 1: kallsyms names text that cannot be spliced (short instructions),
    # each refusal said on stdout; the rest were in.
    refused_only = rc == 1 and "*" in args
    if (rc != 0 and not refused_only) or installed is None:
        sys.exit(f"{' '.join(args)} failed (exit {rc}):\n" + "".join(lines[-20:]))
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: each case runs after smaller
    # ones only when it is measured alone, so the bench reads it per case in a fresh process.
    return max(rss, before) / 1024, installed, installed - (attached or installed)


def measure(args):
    """(peak RSS, to installed, attach to installed) of `args` in a process of its own."""
    out = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stdout + out.stderr)
    rss, total, attach = (float(x) for x in out.stdout.split())
    return rss, total, attach


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        rss, total, attach = one(sys.argv[2:])
        print(f"{rss:.1f} {total:.4f} {attach:.4f}")
        return
    binary = exotap()
    workdir = tempfile.mkdtemp(prefix="exotap-bench-attach-")
    guest = None
    if len(sys.argv) > 2 and sys.argv[1] == "--target":
        target = sys.argv[2]
    else:
        guest, target = boot(binary, workdir)
    syscalls = subprocess.run([binary, "symbols", "__x64_sys_*"], capture_output=True, text=True, check=True)
    hundred = sorted({l.split()[2] for l in syscalls.stdout.splitlines() if len(l.split()) > 2})[:100]
    script = os.path.join(workdir, "one.stp")
    with open(script, "w") as f:
        f.write('global n\nprobe kernel.function("__x64_sys_getppid") { n++ }\n')
    base = [binary]
    cases = [
        ("count, 1 function", base + ["count", "__x64_sys_getpid", "--target", target, "--duration", "1"]),
        ("count, 100 functions", base + ["count", *hundred, "--target", target, "--duration", "1"]),
        ("count, every function", base + ["count", "*", "--target", target, "--duration", "1"]),
        ("compiled script, 1 probe", base + ["run", script, "--target", target, "--compile", "require", "-T", "1"]),
    ]
    print(f"exotap {binary}; {RUNS} warm runs per case (median); target {target}")
    print(f"{'case':<28} {'cache':<5} {'peak RSS MB':>11} {'to installed s':>15} {'attach to installed s':>22}")
    try:
        for name, args in cases:
            for sub in ("analysis", "unpacked"):
                shutil.rmtree(os.path.join(CACHE, sub), ignore_errors=True)
            rss, total, attach = measure(args)
            print(f"{name:<28} {'cold':<5} {rss:>11.1f} {total:>15.3f} {attach:>22.3f}", flush=True)
            warm = [measure(args) for _ in range(RUNS)]
            med = [statistics.median(x[i] for x in warm) for i in range(3)]
            print(f"{name:<28} {'warm':<5} {med[0]:>11.1f} {med[1]:>15.3f} {med[2]:>22.3f}", flush=True)
    finally:
        if guest is not None:
            guest.kill()
            guest.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
