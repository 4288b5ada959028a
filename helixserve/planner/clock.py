"""The planner's clock: wall time, or counted work for plans that do not depend on the
machine (`plan --work-limit N`).

Every search of the planner stops at a deadline read from `now()`, and the annealing
schedules cool by the fraction of their span that has passed. By default `now()` is
`time.perf_counter()`, so where a search ends depends on how fast and how busy the machine
is. Inside `work_clock()` it is a counter instead: each max-flow evaluation (the searches'
unit of work) adds `1 / EVALS_PER_UNIT`, each look at the clock adds `TICK` (so a loop that
only checks the clock still ends), and each MILP solve adds the units it was given, running
to a node limit (`NODES_PER_UNIT` per unit) instead of a time limit, and adds the nodes it
explored (at least one) at that rate. The same inputs then
give the same placement on any machine, under any load and with any `--jobs`.

What a unit buys differs by stage: 400 evaluations of the local searches take about a
second on the project's 2-core machine (helix-single-24), while 20 solver nodes take
milliseconds in the tiling's small MILPs and half a minute in helix-geo-24's region
relaxation; a unit is a count, not a duration.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

#: max-flow evaluations per unit of work
EVALS_PER_UNIT = 400.0
#: units charged by each look at the clock
TICK = 1e-6
#: branch-and-bound nodes per unit of work for a MILP solve in work mode
NODES_PER_UNIT = 20

# The counter of the work clock of this process, or None for the wall clock. A process
# plans one thing at a time (the searches are single-threaded; parallel seeds run in
# processes of their own), so one counter per process is enough.
_work: list[float] | None = None


def now() -> float:
    """Seconds (wall clock) or units of work (work clock) on a monotonic scale."""
    if _work is None:
        return time.perf_counter()
    _work[0] += TICK
    return _work[0]


def counting() -> bool:
    """True inside `work_clock()`."""
    return _work is not None


def charge(units: float) -> None:
    """Add `units` of work (no-op on the wall clock)."""
    if _work is not None:
        _work[0] += units


def charge_nodes(nodes: int) -> None:
    """A MILP solve that explored `nodes` branch-and-bound nodes (at least the root)."""
    if _work is not None:
        _work[0] += max(1, nodes) / NODES_PER_UNIT


def charge_evaluation() -> None:
    """One max-flow evaluation."""
    if _work is not None:
        _work[0] += 1.0 / EVALS_PER_UNIT


@contextmanager
def work_clock(start: float | None = None) -> Iterator[None]:
    """Count work instead of reading the wall clock until the block ends: from `start` on a
    counter of its own, or (None) on the counter already running, else from 0."""
    global _work
    saved = _work
    if start is not None or _work is None:
        _work = [0.0 if start is None else start]
    try:
        yield
    finally:
        _work = saved
