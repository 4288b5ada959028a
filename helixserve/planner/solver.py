"""Run a PuLP model on HiGHS in-process (CBC as fallback) and read back what really happened.

PuLP 3.3 maps HiGHS' "time limit reached" to LpStatusOptimal, so the status, the best
bound and the gap are read from the HiGHS object itself. A warm start is handed to HiGHS
with setSolution before the run; progress comes from HiGHS' MIP interrupt callback.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pulp

from helixserve.planner import clock


@dataclass
class SolveInfo:
    solver: str
    #: "optimal", "time_limit", "work_limit" (node limit of the work clock), "infeasible",
    #: "no_solution", ...
    status: str
    #: objective of the best solution in the model's own sense (None: no solution)
    objective: float | None
    #: best proven bound on the objective (None: unknown, e.g. CBC)
    bound: float | None
    solve_time_s: float

    @property
    def gap(self) -> float | None:
        if self.objective is None or self.bound is None or self.bound == 0:
            return None
        return max(0.0, abs(self.bound - self.objective) / abs(self.bound))


@contextmanager
def quiet_pulp() -> Iterator[None]:
    """PuLP 3.3 deprecates the PuLP 2 API that `pulp>=2.8` users still have: keep it quiet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


_banner_silenced = False


def _silence_banner() -> None:
    """HiGHS prints a copyright banner on stdout when the first Highs() is made: swallow it,
    so stdout stays clean for tables and JSON."""
    global _banner_silenced
    if _banner_silenced:
        return
    _banner_silenced = True
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _highs_available() -> bool:
    try:
        return bool(pulp.HiGHS().available())
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return False


def solve(
    prob: pulp.LpProblem,
    time_limit_s: float,
    warm_start: bool = False,
    progress: Callable[[float, float | None, float | None], None] | None = None,
    threads: int | None = None,
    gap_rel: float = 1e-3,
) -> SolveInfo:
    """Solve `prob`; variables with a varValue set are the warm start when `warm_start`.

    `progress(elapsed_s, incumbent, bound)` is called about once a second (objective sense).
    """
    started = time.perf_counter()
    sense = -1.0 if prob.sense == pulp.LpMaximize else 1.0
    # on the work clock (clock.py) the limit is units of work: a node limit, one thread
    # (HiGHS's result then depends on nothing but the model), and the nodes it used are
    # charged
    work_units = time_limit_s if clock.counting() else None
    if work_units is not None:
        threads = _one_thread()
    if not _highs_available():
        with quiet_pulp():  # PULP_CBC_CMD is deprecated in PuLP 3.3 but still bundled
            cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1.0, time_limit_s),
                                    warmStart=warm_start, gapRel=gap_rel)
            prob.solve(cbc)
        status = pulp.LpStatus[prob.status].lower()
        obj = pulp.value(prob.objective) if prob.status == pulp.LpStatusOptimal else None
        return SolveInfo("cbc", status, obj, None, time.perf_counter() - started)

    _silence_banner()
    warm: list[tuple[Any, float]] = []
    if warm_start:
        warm = [(v, float(v.varValue)) for v in prob.variables() if v.varValue is not None]

    last = [0.0]
    nonzeros = [0]  # of the model HiGHS solves, read once it is built
    skipped = [False]  # the work clock's limit is below the model's root (clock.root_units)

    def on_callback(cb_type: int, message: str, out: Any, data_in: Any, user: Any) -> None:
        now = time.perf_counter() - started
        if progress is None or now - last[0] < 1.0:
            return
        last[0] = now
        primal = out.mip_primal_bound
        dual = out.mip_dual_bound
        inc = None if abs(primal) >= 1e30 else sense * primal
        bnd = None if abs(dual) >= 1e30 else sense * dual
        progress(now, inc, bnd)

    class _Highs(pulp.HiGHS):  # type: ignore[misc, valid-type]
        def actualSolve(self, lp: pulp.LpProblem) -> int:  # noqa: N802 - PuLP's name
            import highspy

            self.createAndConfigureSolver(lp)
            self.buildSolverModel(lp)
            h = lp.solverModel
            if work_units is not None:  # a node limit from the model's size (clock.py)
                nonzeros[0] = h.getNumNz()
                if clock.root_units(prob.name, nonzeros[0]) > work_units:
                    # its root node alone would cost more than it was given, and no limit
                    # shortens a root: not run (what is charged does not depend on that)
                    skipped[0] = True
                    lp.assignStatus(pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound)
                    return int(pulp.LpStatusNotSolved)
                h.setOptionValue("mip_max_nodes",
                                 clock.node_limit(work_units, prob.name, nonzeros[0]))
            if warm:
                idx = [v.index for v, _ in warm]
                vals = [x for _, x in warm]
                h.setSolution(len(idx), idx, vals)
            if progress is not None:
                h.setCallback(on_callback, None)
                h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
            self.callSolver(lp)
            try:
                status, sol_status = self.findSolutionValues(lp)
            except KeyError:
                # a node limit (work clock) ends in a status PuLP does not map: read the
                # values back as PuLP does for a time limit
                solution = h.getSolution()
                found = h.getInfo().primal_solution_status == 2
                for var in lp.variables():
                    var.varValue = solution.col_value[var.index] if found else None
                status = pulp.LpStatusOptimal if found else pulp.LpStatusNotSolved
                sol_status = (pulp.LpSolutionIntegerFeasible if found
                              else pulp.LpSolutionNoSolutionFound)
            lp.assignStatus(status, sol_status)
            return int(status)

    options: dict[str, Any] = {}
    solver = _Highs(msg=False, timeLimit=None if work_units is not None else max(0.5, time_limit_s),
                    threads=threads, gapRel=gap_rel, **options)
    with quiet_pulp():
        prob.solve(solver)
    if skipped[0]:
        clock.charge(clock.SOLVE_UNITS)
        return SolveInfo("highs", "work_limit", None, None, time.perf_counter() - started)
    h = prob.solverModel
    model_status = h.modelStatusToString(h.getModelStatus()).lower()
    info = h.getInfo()
    if work_units is not None:
        clock.charge_nodes(info.mip_node_count, prob.name, nonzeros[0])
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    obj = sense * info.objective_function_value if has_sol else None
    is_mip = any(v.cat == pulp.LpInteger for v in prob.variables())
    if is_mip:
        dual = info.mip_dual_bound
        bound = None if abs(dual) >= 1e30 else sense * dual
    else:
        bound = obj if model_status == "optimal" else None
    if "optimal" in model_status:
        status = "optimal"
        if obj is not None and bound is None:
            bound = obj
    elif "time limit" in model_status:
        status = "time_limit"
    elif "limit" in model_status:  # the node limit of the work clock
        status = "work_limit"
    elif "infeasible" in model_status:
        status = "infeasible"
    else:
        status = model_status.replace(" ", "_")
    if obj is None and status != "infeasible":
        status = "no_solution" if status == "optimal" else status
    return SolveInfo("highs", status, obj, bound, time.perf_counter() - started)


def _one_thread() -> int:
    """1, for a HiGHS run on one thread. HiGHS keeps one thread pool per process and fails
    a run whose `threads` differs from it, so the pool is reset first (cheap: the planner
    solves one model at a time)."""
    if _highs_available():
        import highspy

        highspy.Highs.resetGlobalScheduler(True)
    return 1


#: the name a HighsModel's re-solves are charged under (clock.NODE_COSTS): most of the
#: model's integers are fixed, so they cost a fraction of a solve of the whole model
LNS_MODEL = "lns"


class HighsModel:
    """A PuLP model loaded once into HiGHS, re-solved many times with changed column bounds
    (for large-neighbourhood search: fix most of the integer variables, free a few)."""

    def __init__(self, prob: pulp.LpProblem, threads: int | None = None) -> None:
        import highspy

        _silence_banner()
        self.prob = prob
        self.sense = -1.0 if prob.sense == pulp.LpMaximize else 1.0
        if clock.counting():  # one thread: the result depends on nothing but the model
            threads = _one_thread()
        builder = pulp.HiGHS(msg=False, threads=threads)
        with quiet_pulp():
            builder.createAndConfigureSolver(prob)
            builder.buildSolverModel(prob)
        self.h = prob.solverModel
        self.variables = prob.variables()
        self.inf = highspy.kHighsInf

    def set_bounds(self, var: pulp.LpVariable, lo: float, hi: float) -> None:
        self.h.changeColBounds(var.index, lo, hi)

    def run(self, time_limit_s: float, start: list[float] | None = None
            ) -> tuple[float | None, list[float]]:
        """Objective (model sense) and column values; None when no solution was found."""
        counting = clock.counting()
        nonzeros = self.h.getNumNz()
        if counting:  # units of work (clock.py): a node limit; the nodes used are charged
            self.h.setOptionValue("mip_max_nodes",
                                  clock.node_limit(time_limit_s, LNS_MODEL, nonzeros))
        else:
            self.h.setOptionValue("time_limit", max(0.1, time_limit_s))
        if start is not None:
            self.h.setSolution(len(start), list(range(len(start))), start)
        self.h.run()
        info = self.h.getInfo()
        if counting:
            clock.charge_nodes(info.mip_node_count, LNS_MODEL, nonzeros)
        if info.primal_solution_status != 2:
            return None, []
        return self.sense * info.objective_function_value, list(self.h.getSolution().col_value)
