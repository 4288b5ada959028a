"""One `helixserve` command in a rehearsal's child process (`rehearse/child.py`) or in a
worker forked by the fork server (`rehearse/forkserver.py`): `run_command(ARGS)` runs
`helixserve ARGS`.

Profiling: with `HELIXSERVE_PROFILE_DIR=DIR` in the environment (rehearse passes it on), the
command runs under cProfile, every Python thread included (the worker's engine thread as well as
its event loop), and writes `DIR/<command>-<pid>.prof` (pstats format) when it exits normally
(SIGTERM: the worker drains and returns, uvicorn shuts down). Off by default: a profile costs
the runtime CPU and slows what it measures.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: the directory for per-process cProfile dumps (module doc)
PROFILE_DIR_ENV = "HELIXSERVE_PROFILE_DIR"


def _profiled(run: Any, name: str, directory: str) -> int:
    """`run()` under cProfile in every thread it starts; the stats in `directory`."""
    import cProfile
    import pstats
    import signal
    import threading
    import time

    profiles: list[cProfile.Profile] = []
    thread_run = threading.Thread.run

    def run_profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile(time.thread_time)
        profiles.append(prof)
        prof.enable()
        try:
            thread_run(self)
        finally:
            prof.disable()

    threading.Thread.run = run_profiled  # type: ignore[method-assign]
    # SIGTERM ends the run through the `finally` below: uvicorn re-raises the signal it
    # caught once it has shut down, which by default would kill the process before the dump
    on_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main = cProfile.Profile(time.thread_time)
    main.enable()
    try:
        return int(run() or 0)
    finally:
        main.disable()
        threading.Thread.run = thread_run  # type: ignore[method-assign]
        signal.signal(signal.SIGTERM, on_term)
        stats = pstats.Stats(main)
        for prof in list(profiles):
            try:
                stats.add(prof)
            except (TypeError, ValueError):  # a thread still running with nothing recorded
                continue
        os.makedirs(directory, exist_ok=True)
        stats.dump_stats(os.path.join(directory, f"{name}-{os.getpid()}.prof"))


def run_command(args: list[str]) -> int:
    """`helixserve ARGS` (worker, serve), profiled when PROFILE_DIR_ENV is set (module doc);
    also what each worker forked by the fork server runs."""
    from helixserve.cli import main as cli_main

    directory = os.environ.get(PROFILE_DIR_ENV)
    if directory:
        return _profiled(lambda: cli_main(args), args[0] if args else "child", directory)
    return cli_main(args)
