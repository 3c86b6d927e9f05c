//! The examples run, in order: each one's file, arguments (as its `.meta` test line gives
//! them), window and check.

use super::checks::*;
use super::{Example, Window};

pub(super) const EXAMPLES: &[Example] = &[
    Example {
        file: "process/syscalls_by_proc.stp",
        args: &[],
        window: Window::Rounds(0),
        check: syscalls_by_proc,
    },
    Example {
        file: "process/syscalls_by_pid.stp",
        args: &[],
        window: Window::Rounds(0),
        check: syscalls_by_pid,
    },
    Example {
        file: "lwtools/syscallbypid-nd.stp",
        // Compiled (its syscall_name() compiles), the workload makes more (pid, command,
        // syscall) rows in its window than its end probe prints within the default MAXACTION
        // (rows sorted by count, the large ones last: cut off, as stap would cut them).
        args: &["-D", "MAXACTION=100000"],
        window: Window::Secs(3),
        check: syscallbypid_nd,
    },
    Example {
        file: "process/thread-business.stp",
        args: &[],
        window: Window::Secs(6),
        check: thread_business,
    },
    Example {
        file: "process/sig_by_proc.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sig_by_proc,
    },
    Example {
        file: "process/sig_by_pid.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sig_by_pid,
    },
    Example {
        file: "process/sigkill.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sigkill,
    },
    Example {
        file: "process/forktracker.stp",
        args: &[],
        window: Window::Rounds(0),
        check: forktracker,
    },
    Example {
        // Not one of SystemTap's: exotap's own, for tracepoints with one callback.
        file: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/scripts/tracepoint_exits.stp"
        ),
        args: &[],
        window: Window::Rounds(0),
        check: tracepoint_exits,
    },
    Example {
        file: "process/proc_snoop.stp",
        args: &[],
        window: Window::Rounds(0),
        check: proc_snoop,
    },
    Example {
        file: "process/sleeptime.stp",
        args: &[],
        window: Window::Rounds(0),
        check: sleeptime,
    },
    Example {
        file: "process/pstrace_exec.stp",
        args: &["mixed"],
        window: Window::Rounds(0),
        check: pstrace_exec,
    },
    Example {
        file: "process/spawn_seeker.stp",
        args: &[],
        window: Window::Rounds(0),
        check: spawn_seeker,
    },
    Example {
        file: "process/chng_cpu.stp",
        args: &["mixed"],
        window: Window::Secs(4),
        check: chng_cpu,
    },
    Example {
        file: "lwtools/execsnoop-nd.stp",
        args: &[],
        window: Window::Rounds(0),
        check: execsnoop_nd,
    },
    Example {
        file: "process/sched-latency.stp",
        args: &[],
        window: Window::Secs(6),
        check: sched_latency,
    },
    Example {
        file: "process/cycle_thief.stp",
        args: &[],
        window: Window::Secs(3),
        check: cycle_thief,
    },
    Example {
        file: "profiling/sched_switch.stp",
        args: &[],
        window: Window::Secs(3),
        check: sched_switch,
    },
    Example {
        file: "io/iostats.stp",
        args: &[],
        // Its syscall.open runs on the host, and each host-evaluated hit of a mixed script
        // copies the compiled globals through the gdbstub: rounds take many seconds.
        window: Window::Secs(5),
        check: iostats,
    },
    Example {
        file: "io/traceio.stp",
        args: &[],
        window: Window::Rounds(2),
        check: traceio,
    },
    Example {
        file: "io/iotop.stp",
        args: &[],
        window: Window::Rounds(6),
        check: iotop,
    },
    Example {
        file: "memory/pfaults.stp",
        args: &[],
        window: Window::Rounds(0),
        check: pfaults,
    },
    Example {
        file: "network/netdev.stp",
        args: &[],
        window: Window::Rounds(0),
        check: netdev,
    },
    Example {
        file: "network/nettop.stp",
        args: &[],
        window: Window::Rounds(6),
        check: nettop,
    },
    Example {
        file: "network/tcp_connections.stp",
        args: &[],
        window: Window::Rounds(0),
        check: tcp_connections,
    },
    Example {
        file: "network/dropwatch.stp",
        args: &[],
        window: Window::Rounds(6),
        check: dropwatch,
    },
    Example {
        file: "general/func_time_stats.stp",
        args: &["syscall.read"],
        window: Window::Rounds(0),
        check: func_time_stats,
    },
    Example {
        file: "../../doc/systemtap/examples/tutorial/probe-alias.stp",
        args: &[],
        window: Window::Rounds(0),
        check: probe_alias,
    },
    Example {
        file: "../../doc/systemtap/examples/tutorial/strace-open.stp",
        args: &[],
        window: Window::Rounds(0),
        check: strace_open,
    },
    // `@entry` of expressions, evaluated at the entry by the host for breakpoint probes;
    // short windows (each return probe stops the guest twice per call).
    Example {
        file: "process/wait4time.stp",
        args: &[],
        window: Window::Secs(3),
        check: wait4time,
    },
    Example {
        file: "io/slowvfs.stp",
        // As stap's suite gives it: compiled, an open is timed without the stops that made
        // every one slower than the default 50 us.
        args: &["-G", "sloth=10"],
        window: Window::Secs(3),
        check: slowvfs,
    },
    Example {
        file: "lwtools/rwtime-nd.stp",
        args: &[],
        window: Window::Secs(3),
        check: rwtime_nd,
    },
    Example {
        file: "lwtools/opensnoop-nd.stp",
        args: &[],
        window: Window::Secs(3),
        check: opensnoop_nd,
    },
    Example {
        file: "lwtools/killsnoop-nd.stp",
        args: &[],
        window: Window::Rounds(0),
        check: killsnoop_nd,
    },
    Example {
        file: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/scripts/entry_values.stp"
        ),
        args: &[],
        window: Window::Rounds(0),
        check: entry_values,
    },
];
