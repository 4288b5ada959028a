"""The planner's clock: wall time, or counted work for plans that do not depend on the
machine (`plan --work-limit N`).

Every search of the planner stops at a deadline read from `now()`, and the annealing
schedules cool by the fraction of their span that has passed. By default `now()` is
`time.perf_counter()`, so where a search ends depends on how fast and how busy the machine
is. Inside `work_clock()` it is a counter instead, charged for the work done: each max-flow
evaluation adds `EVAL_UNITS`, each look at the clock adds `TICK` (the searches look once or
twice per move they try, and most moves are rejected by cheap checks before any max flow),
and each MILP solve runs to a node limit instead of a time limit and adds `SOLVE_UNITS`,
its root node and its other nodes, each at a cost per model that grows with its constraint
nonzeros (`NODE_COSTS`). The same inputs then give the same placement on any
machine, under any load and with any `--jobs`.

A wall-clock cap (`wall_cap`) may stand behind the work clock as a safety net (`plan`'s
default: 1,000 units of work, capped at 600 s): once the wall clock passes it, every look at
the work clock jumps past any deadline (`CAP_JUMP`), so the searches stop at their next
look, and `capped()` says so (the placement then depends on the machine and its load). A
search whose steps cannot stop halfway (the served objective's batches of simulations, a
minute or more each on helix-mix-42) does not start one that would end past the cap
(`wall_left`, `stop_at_cap`). A search's worker processes get the same cap (parallel.py).

The charges are calibrated so that a unit is about one second of one core of the reference
machine, the project's 2-core VM (process CPU time, measured on the bundled example and on
helix-single-24, helix-geo-24 and helix-mix-42; docs/planner.md, "A budget of work instead of
time"): a max-flow evaluation takes 0.5-0.8 ms there from 6 to 42 machines and a rejected move
45-90 us, and the searches' loops cost about 0.7 of what those add up to; MILP nodes as
`NODE_COSTS` says. Where the charges are off a stage's share can run
over (a MILP always explores its root node), but the placement still does not depend on the
machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

#: units (reference seconds) charged by one max-flow evaluation
EVAL_UNITS = 4.3e-4
#: units charged by each look at the clock
TICK = 2.2e-5
#: units of a branch-and-bound node, and of the root node (presolve, cuts, heuristics, the
#: first LP; no node limit shortens it), of each MILP of the planner by its PuLP name:
#: (node coef, node exponent, root coef, root exponent), cost = coef x nonzeros ** exponent.
#: Fitted on the reference machine; nonzeros alone do not predict a node's cost across
#: models (the bounds of the integers matter), so each model has its own line.
NODE_COSTS: dict[str, tuple[float, float, float, float]] = {
    # the per-node MILP: 5-10 ms a node at 2,524 nonzeros (example), 1.2 s at 18,282
    # (helix-single-24), whose root takes 12.5 s
    "helix_placement": (2.8e-12, 2.77, 1.87e-11, 2.77),
    # its large-neighbourhood re-solves (milp.lns), all but 3-6 machines fixed: about 16 ms
    # a node on helix-single-24
    "lns": (9e-7, 1.0, 9e-7, 1.0),
    # about 1 s a node: 0.6-0.9 s (the example's root, 53,090 nonzeros), 1.1 s
    # (helix-single-24, 18,979)
    "coverage": (1.0, 0.0, 1.0, 0.0),
    # the example's, 178,925 nonzeros: root 20.3 s, then 0.44 s a node
    "regions": (2.5e-6, 1.0, 1.13e-4, 1.0),
}
#: any other MILP (the tiling's, tens of nonzeros)
DEFAULT_NODE_COST = (4e-6, 1.0, 4e-6, 1.0)
#: the least a node costs, however small the MILP
MIN_NODE_UNITS = 1e-3
#: units charged by every MILP solve besides its nodes (PuLP hands the model over, presolve)
SOLVE_UNITS = 0.01

# The counter of the work clock of this process, or None for the wall clock. A process
# plans one thing at a time (the searches are single-threaded; parallel seeds run in
# processes of their own), so one counter per process is enough.
_work: list[float] | None = None
#: the wall-clock cap of the work clock (a `time.time()` epoch, so that worker processes
#: share it), None without one; and whether the cap has stopped a search
_cap: float | None = None
_capped: list[bool] = [False]
#: units added to the work clock once its wall-clock cap has passed: beyond any deadline
CAP_JUMP = 1e12


def now() -> float:
    """Seconds (wall clock) or units of work (work clock) on a monotonic scale."""
    if _work is None:
        return time.perf_counter()
    _work[0] += TICK
    if _cap is not None and not _capped[0] and time.time() >= _cap:
        _capped[0] = True
        _work[0] += CAP_JUMP
    return _work[0]


def capped() -> bool:
    """True once the wall-clock cap in force (`wall_cap`) stopped the work clock's searches;
    False outside a `wall_cap` block."""
    return _cap is not None and _capped[0]


def cap_epoch() -> float | None:
    """The wall-clock cap in force (a `time.time()` epoch), None without one."""
    return _cap


@contextmanager
def wall_cap(epoch: float | None) -> Iterator[None]:
    """Within the block, the work clock stops every search once `time.time()` reaches
    `epoch` (None: no cap); `capped()` reports it within the block."""
    global _cap
    saved = _cap
    _cap = epoch
    _capped[0] = False
    try:
        yield
    finally:
        _cap = saved


def wall_left() -> float:
    """Seconds of wall clock left before the cap in force (`wall_cap`); infinite without one.
    A search whose next step cannot stop halfway (a batch of simulations: planner/served.py)
    asks before it starts one, so that the cap is not overrun by a step's length."""
    return float("inf") if _cap is None else _cap - time.time()


def stop_at_cap() -> None:
    """Stop every search of the work clock now, as the cap passing would, and let `capped()`
    say so: for a search whose next step would end past the cap (`wall_left`). No-op
    outside a `wall_cap` block."""
    if _cap is None or _capped[0]:
        return
    _capped[0] = True
    if _work is not None:
        _work[0] += CAP_JUMP


def counting() -> bool:
    """True inside `work_clock()`."""
    return _work is not None


def charge(units: float) -> None:
    """Add `units` of work (no-op on the wall clock)."""
    if _work is not None:
        _work[0] += units


def node_units(model: str, nonzeros: int) -> float:
    """Units one branch-and-bound node of MILP `model` (its PuLP name) with `nonzeros`
    constraint nonzeros costs."""
    coef, exponent, _, _ = NODE_COSTS.get(model, DEFAULT_NODE_COST)
    return max(MIN_NODE_UNITS, coef * nonzeros**exponent)


def root_units(model: str, nonzeros: int) -> float:
    """Units a solve of MILP `model` costs up to and including its root node."""
    _, _, coef, exponent = NODE_COSTS.get(model, DEFAULT_NODE_COST)
    return SOLVE_UNITS + max(node_units(model, nonzeros), coef * nonzeros**exponent)


def node_limit(units: float, model: str, nonzeros: int) -> int:
    """Branch-and-bound nodes a solve given `units` may explore (at least the root)."""
    extra = (units - root_units(model, nonzeros)) / node_units(model, nonzeros)
    return 1 + max(0, int(extra))


def charge_nodes(nodes: int, model: str, nonzeros: int) -> None:
    """A solve of MILP `model` that explored `nodes` nodes (at least the root)."""
    if _work is not None:
        _work[0] += root_units(model, nonzeros) + max(0, nodes - 1) * node_units(model, nonzeros)


def charge_evaluation() -> None:
    """One max-flow evaluation."""
    if _work is not None:
        _work[0] += EVAL_UNITS


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
