"""OS names of the runtime's own threads, and the CPU of a process's threads by kind.

Python's thread names stay inside Python; the kernel's (`comm`, 15 bytes) is what `top -H`,
`ps -L`, py-spy and `/proc/PID/task/TID/stat` show. A worker names its engine thread
ENGINE_THREAD, so its CPU can be told from the event loop's (the main thread) and gRPC's
core threads without a profiler (`thread_cpu_seconds`; the rehearsal reports the split,
docs/rehearse.md).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: the OS name of a worker's engine thread (runtime/worker.py)
ENGINE_THREAD = "hx-engine"
#: OS names of gRPC core's own threads (C++; no Python runs there)
GRPC_CORE_THREADS = ("event_engine", "grpc_global_tim", "lifeguard", "resolver-execut",
                     "default-executo", "grpcpp_sync_ser")
#: the kinds `thread_cpu_seconds` sums into
THREAD_KINDS = ("event_loop", "engine", "grpc_core", "other")

_PR_SET_NAME = 15


def name_os_thread(name: str) -> bool:
    """Give the calling thread the OS name `name` (Linux prctl; at most 15 bytes kept).
    False where the platform has no such call: nothing else depends on it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _ticks(stat: str) -> int:
    """utime + stime, in clock ticks, of a /proc `stat` line."""
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return int(fields[11]) + int(fields[12])


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process, all its threads, from /proc/PID/stat (None once it
    is gone, or without /proc)."""
    try:
        return _ticks(Path(f"/proc/{pid}/stat").read_text()) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def thread_cpu_seconds(pid: int) -> dict[str, float] | None:
    """CPU seconds (user + system) of process `pid` by kind of thread (THREAD_KINDS): its
    main thread (a worker's event loop), threads named ENGINE_THREAD, gRPC core's threads,
    and the rest (Python threads such as gRPC's poller, and threads that already exited:
    the process's total less the three, so the kinds add up to `process_cpu_seconds`). None
    once the process is gone (or without /proc)."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        total = _ticks(Path(f"/proc/{pid}/stat").read_text())
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, ValueError):
        return None
    out = dict.fromkeys(THREAD_KINDS, 0.0)
    known = 0
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            kind = ("event_loop" if int(tid) == pid else "engine" if comm == ENGINE_THREAD
                    else "grpc_core" if comm in GRPC_CORE_THREADS else None)
            if kind is not None:
                ticks = _ticks(stat)
                out[kind] += ticks / hz
                known += ticks
    out["other"] = max(0, total - known) / hz
    return out
