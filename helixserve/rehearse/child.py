"""Entry point of a rehearsal's child processes: `python -m helixserve.rehearse.child
COMMAND ARGS...` runs `helixserve COMMAND ARGS...` (worker, serve) after asking the kernel to
SIGTERM it when the rehearsal dies (PR_SET_PDEATHSIG), so even a SIGKILLed rehearsal leaves
no process behind. Done here, in the child, rather than in a `preexec_fn`, by the local
stacks' `die_with_parent` (the rehearsal sets its `PARENT_PID_ENV`). `links CONFIG` runs the
link proxy; `forkserver worker` the fork server the emulated workers are forked from
(helixserve/rehearse/forkserver.py), each of which runs `run_command`.

Profiling: with `HELIXSERVE_PROFILE_DIR=DIR` in the environment (rehearse passes it on), the
child runs under cProfile, every Python thread included (the worker's engine thread as well as
its event loop), and writes `DIR/<command>-<pid>.prof` (pstats format) when it exits normally
(SIGTERM: the worker drains and returns, uvicorn shuts down). Off by default: a profile costs
the runtime CPU and slows what it measures.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from helixserve.local.launch import die_with_parent

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


def main() -> int:
    die_with_parent()
    args = sys.argv[1:]
    if args[:1] == ["links"]:
        import asyncio

        from helixserve.rehearse.links import run_proxy

        asyncio.run(run_proxy(args[1]))
        return 0
    from helixserve.rehearse import forkserver

    if args[:1] == [forkserver.COMMAND]:
        return int(forkserver.main(args[1:]) or 0)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
