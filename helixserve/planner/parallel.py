"""Run the planner's annealing searches on several cores at once, one seed per core (--jobs).

The searches of stages.py, pinned.py and search.py are single-threaded simulated annealing
against a deadline, and where they end depends on the seed (on helix-geo-24 by up to ~5%
between seeds of a 60-second plan, docs/planner.md, "A budget of work instead of time").
Independent restarts are the simplest use of more cores and shrink that spread: with `jobs`
cores, seed `seed` runs here, in this process (so `jobs=1` is exactly the serial planner),
and seeds `seed + SEED_STRIDE * w`, w = 1..jobs-1, run at the same time in worker processes,
all against the same deadline; the caller keeps the best result (or all of them).

Worker processes come from a forkserver (a clean, single-threaded parent: the planner's own
process may hold solver or server threads, which `fork` must not copy), with the search
modules preloaded so a worker starts in milliseconds. What goes in (the FlowNetwork, the
start placements) and what comes back (layer ranges and flows) are this program's own
in-memory objects handed to a copy of itself, not a message between components, so
multiprocessing's pickling is used here; nothing of it crosses a machine or a version.

`map_in_workers` runs independent deterministic calls (the simulations of
`plan --serve-trace`'s candidates) on the same kind of workers.

A search worker that fails (out of memory, killed) costs only its seed: its error is reported
through `progress` and the in-process result still stands. Searches shorter than
MIN_PARALLEL_S run in-process only, since starting workers would eat their time.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from helixserve.errors import UserError
from helixserve.planner import clock

R = TypeVar("R")

#: distance between the seeds of the workers (keeps their random streams apart)
SEED_STRIDE = 7919
#: below this many seconds of search, workers are not worth starting
MIN_PARALLEL_S = 2.0
#: workers stop this much (at most 5% of the search) before the deadline: their last step
#: and the transfer of their result back must fit before it
WORKER_MARGIN_S = 1.0
#: how long a search waits for its workers once its own run is over (+5% of its time)
WORKER_WAIT_S = 2.0
#: seeds of each annealing search on the work clock (plan --work-limit), whatever --jobs
WORK_SEEDS = 2
#: --jobs default: the cores this process may use, at most this many
MAX_DEFAULT_JOBS = 8
#: the modules a worker needs, imported once in the forkserver
_PRELOAD = ["helixserve.planner.search", "helixserve.planner.stages",
            "helixserve.planner.pinned", "helixserve.simulator.selection",
            "helixserve.simulator.sim"]


def default_jobs() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's cpuset), at most
    MAX_DEFAULT_JOBS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_JOBS))


def check_jobs(jobs: int | None) -> int:
    """--jobs value, checked; None means default_jobs()."""
    if jobs is None:
        return default_jobs()
    if jobs < 1:
        raise UserError(f"--jobs: bad value {jobs}; must be >= 1 (processes for the search)")
    return jobs


_context: Any = None


def _mp_context() -> Any:
    global _context
    if _context is None:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
            else "spawn"
        _context = multiprocessing.get_context(method)
        if method == "forkserver":
            _context.set_forkserver_preload(_PRELOAD)
    return _context


def warm_up(jobs: int) -> None:
    """Start the forkserver now (with jobs > 1 on a platform that has it), so that it has
    imported the search modules by the time the first search asks it for a worker: that
    first request waits for those imports, which takes seconds on a loaded machine."""
    if jobs <= 1:
        return
    ctx = _mp_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        with _main_module_hidden():
            forkserver.ensure_running()


@contextmanager
def _main_module_hidden() -> Iterator[None]:
    """While workers start: a forkserver or spawn worker first imports the caller's
    `__main__` (by its __spec__ or __file__), which re-runs a script's top level when it has
    no `if __name__ == "__main__":` guard (a `plan()` call in a user's script would plan
    again in every worker). Workers here run only helixserve functions, so they are
    started with `__main__` looking like an interactive session's."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__file__", "__spec__")
                             if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _run_worker(fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any],
                wall_deadline: float) -> R:
    # deadlines are perf_counter values, whose origin is per process: rebase on wall time
    kwargs = dict(kwargs, deadline_s=time.perf_counter() + (wall_deadline - time.time()))
    return fn(*args, **kwargs)


def _run_counted(fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any],
                 start: float, cap: float | None = None) -> tuple[R, float]:
    """`fn` on a work clock from `start` (its deadline is in units of work too), under the
    caller's wall-clock cap `cap` (clock.wall_cap); the result and where the clock ended."""
    with clock.wall_cap(cap), clock.work_clock(start):
        result = fn(*args, **kwargs)
        return result, clock.now()


def _run_seeds_counted(fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any],
                       deadline_s: float, seed: int, jobs: int, seeds: int,
                       progress: Callable[[str], None] | None,
                       worker_kwargs: dict[str, Any] | None) -> list[R]:
    """run_seeds on the work clock: `seeds` seeds, whatever `jobs` (which only says how many
    run side by side), each from the same clock reading with the same work deadline, so the
    results do not depend on the cores or the load. A worker that fails or cannot start is
    run here instead: a lost seed would change the answer."""
    start = clock.now()
    remote = {k: v for k, v in kwargs.items() if k != "on_improve"} | (worker_kwargs or {})
    calls = [dict(remote, deadline_s=deadline_s, seed=seed + SEED_STRIDE * w)
             for w in range(1, seeds)]
    futures: list[Future[tuple[R, float]] | None] = [None] * len(calls)
    executor = None
    if jobs > 1 and calls:
        executor = ProcessPoolExecutor(max_workers=min(jobs - 1, len(calls)),
                                       mp_context=_mp_context())
    try:
        if executor is not None:
            try:
                with _main_module_hidden():  # workers start in submit()
                    for w, call in enumerate(calls):
                        futures[w] = executor.submit(_run_counted, fn, args, call, start,
                                                     clock.cap_epoch())
            except OSError as exc:
                if progress is not None:
                    progress(f"search workers could not start ({exc}); running the seeds "
                             "here, one after another")
        results = [fn(*args, **kwargs, deadline_s=deadline_s, seed=seed)]
        ends = [clock.now()]
        for w, call in enumerate(calls):
            fut = futures[w]
            try:
                if fut is None:
                    raise RuntimeError("not started")
                result, end = fut.result()
            except Exception:  # noqa: BLE001 - the seed runs here instead
                result, end = _run_counted(fn, args, call, start)
            results.append(result)
            ends.append(end)
        clock.charge(max(ends) - clock.now())
        return results
    finally:
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def run_seeds(fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any],
              deadline_s: float, seed: int, jobs: int,
              progress: Callable[[str], None] | None = None,
              worker_kwargs: dict[str, Any] | None = None, seeds: int | None = None) -> list[R]:
    """`fn(*args, **kwargs, deadline_s=..., seed=...)` for `jobs` seeds at once; the result
    of `seed` (run in this process) first, then the workers' in seed order. `fn` must be a
    module-level function; `kwargs` may hold callbacks only for the in-process run, under
    the key "on_improve" (workers get none); `worker_kwargs` go to the workers only.
    On the work clock (clock.py) it runs `seeds` seeds (default WORK_SEEDS) whatever
    `jobs` is, so that the plan does not depend on the cores."""
    if clock.counting():
        return _run_seeds_counted(fn, args, kwargs, deadline_s, seed, jobs,
                                  WORK_SEEDS if seeds is None else seeds, progress,
                                  worker_kwargs)
    left_s = deadline_s - time.perf_counter()
    if jobs <= 1 or left_s < MIN_PARALLEL_S:
        return [fn(*args, **kwargs, deadline_s=deadline_s, seed=seed)]
    # workers stop a little early, so that their results are back by the caller's deadline
    wall_deadline = time.time() + left_s - min(WORKER_MARGIN_S, 0.05 * left_s)
    remote = {k: v for k, v in kwargs.items() if k != "on_improve"} | (worker_kwargs or {})
    executor = ProcessPoolExecutor(max_workers=jobs - 1, mp_context=_mp_context())
    try:
        futures: list[Future[R]] = []
        try:
            with _main_module_hidden():  # workers start in submit()
                for w in range(1, jobs):
                    futures.append(executor.submit(
                        _run_worker, fn, args, dict(remote, seed=seed + SEED_STRIDE * w),
                        wall_deadline))
        except OSError as exc:  # no processes here (sandbox, ulimit): one seed, as --jobs 1
            if progress is not None:
                progress(f"search workers could not start ({exc}); {len(futures)} of "
                         f"{jobs - 1} running")
        results = [fn(*args, **kwargs, deadline_s=deadline_s, seed=seed)]
        for w, fut in enumerate(futures, start=1):
            try:
                # workers stop WORKER_MARGIN_S early; one still busy after this is stuck
                # (an overloaded machine): the caller's later steps need the time
                results.append(fut.result(timeout=WORKER_WAIT_S + 0.05 * left_s))
            except Exception as exc:  # noqa: BLE001 - a lost worker costs only its seed
                if progress is not None:
                    progress(f"search worker {w} (seed {seed + SEED_STRIDE * w}) failed: "
                             f"{type(exc).__name__}: {exc}")
        return results
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def map_in_workers(fn: Callable[..., R], calls: list[tuple[Any, ...]], jobs: int) -> list[R]:
    """`[fn(*args) for args in calls]`, on up to `jobs` processes at once (in this process
    when `jobs` is 1 or there is one call), results in the order of `calls`. For work that
    is deterministic for its arguments (plan --serve-trace's simulations), so the answer
    does not depend on `jobs`; an exception in any call is raised here."""
    if jobs <= 1 or len(calls) <= 1:
        return [fn(*args) for args in calls]
    with ProcessPoolExecutor(max_workers=min(jobs, len(calls)),
                             mp_context=_mp_context()) as executor:
        try:
            with _main_module_hidden():  # workers start in submit()
                futures = [executor.submit(fn, *args) for args in calls]
        except OSError:  # no processes here (sandbox, ulimit): the same answer, serially
            executor.shutdown(wait=True, cancel_futures=True)
            return [fn(*args) for args in calls]
        return [f.result() for f in futures]
