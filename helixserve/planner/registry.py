"""The planners by name, and `plan()`: run one, evaluate it, fill flows and throughput."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner import clock
from helixserve.planner.baselines import BASELINES, Ranges
from helixserve.planner.bounds import layer_work_bound
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.parallel import check_jobs
from helixserve.planner.placement import NodeRange, Placement
from helixserve.planner.portfolio import (
    Candidate,
    PlanOutcome,
    Progress,
    StageReport,
    run_portfolio,
)
from helixserve.spec import ClusterSpec, ModelSpec


class Planner(Protocol):
    def __call__(self, net: FlowNetwork, time_limit_s: float, seed: int,
                 progress: Progress | None, jobs: int,
                 partial_inference: bool) -> PlanOutcome: ...


def _baseline(fn: Callable[[FlowNetwork], Ranges]) -> Planner:
    def run(net: FlowNetwork, time_limit_s: float, seed: int,
            progress: Progress | None, jobs: int, partial_inference: bool) -> PlanOutcome:
        ranges = fn(net)
        # the layer-work bound holds for every placement within the weight cap: the gap of a
        # baseline is stated like milp's (none for a baseline beyond the cap)
        within = all(e - s <= net.max_layers[i] for i, (s, e) in ranges.items())
        return PlanOutcome(ranges, layer_work_bound(net) if within else None)

    run.__name__ = fn.__name__
    return run


def _milp(net: FlowNetwork, time_limit_s: float, seed: int,
          progress: Progress | None, jobs: int, partial_inference: bool) -> PlanOutcome:
    # the searches and the MILP's edges follow the graph the placement is evaluated on
    return run_portfolio(net, time_limit_s=time_limit_s, seed=seed, progress=progress,
                         partial_inference=partial_inference, jobs=jobs)


PLANNERS: dict[str, Planner] = {"milp": _milp} | {
    name: _baseline(fn) for name, fn in BASELINES.items()
}


def plan(
    name: str,
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    time_limit_s: float = 60.0,
    seed: int = 0,
    progress: Progress | None = None,
    partial_inference: bool = True,
    jobs: int | None = None,
    stages: list[StageReport] | None = None,
    work_limit: float | None = None,
    candidates: list[Candidate] | None = None,
) -> Placement:
    """Run planner `name`; the Placement comes back with flows and throughput filled.
    `jobs`: processes for milp's searches, one seed each (parallel.py); None: the cores
    this process may use (at most 8). `stages`: when given, what each stage of milp's
    portfolio did (portfolio.StageReport) is appended to it. `work_limit`: plan on the work
    clock (clock.py) with this many units instead of `time_limit_s` seconds: the same
    inputs then give the same placement on any machine and with any `jobs`. `candidates`:
    when given, every placement milp's portfolio valued is appended to it (none for a
    baseline); the served objective starts from them (served.py)."""
    planner = PLANNERS.get(name)
    if planner is None:
        raise UserError(f"--planner: unknown planner {name!r}; known: {', '.join(PLANNERS)}")
    cost.check_fits(cluster)
    started = time.perf_counter()
    net = FlowNetwork(cluster, model, cost)
    net.check_servable()  # an error naming the links, not a plan of 0 tokens/s
    if work_limit is not None:
        if not work_limit > 0:
            raise UserError(f"--work-limit: bad value {work_limit}; must be > 0 (units of work)")
        with clock.work_clock():
            outcome = planner(net, work_limit, seed, progress, check_jobs(jobs),
                              partial_inference)
    else:
        # the time limit covers building the flow network too (about 1 s on 100 machines)
        outcome = planner(net, max(0.5, time_limit_s - (time.perf_counter() - started)), seed,
                          progress, check_jobs(jobs), partial_inference)
    if stages is not None:
        stages.extend(outcome.stages)
    if candidates is not None:
        candidates.extend(outcome.candidates)
    placement = to_placement(net, name, outcome.ranges, outcome.upper_bound_tokens_per_s,
                             partial_inference)
    bound = outcome.upper_bound_tokens_per_s
    if (placement.throughput_tokens_per_s or 0.0) <= 0 and bound is not None and bound < 1e-6:
        # check_servable is a relaxation; a proven bound of 0 (to the solver's tolerance)
        # is the exact answer
        raise UserError(
            f"{cluster.source}: links: no placement can serve: the {name} planner proved "
            f"that no route through linked nodes, each node used once and holding at most its "
            f"weight cap of layers, covers all {model.num_layers} layers")
    placement.solve_time_s = time.perf_counter() - started
    return placement


def to_placement(net: FlowNetwork, planner: str, ranges: Ranges, bound: float | None,
                 partial_inference: bool = True) -> Placement:
    """`ranges` as a Placement named `planner`, with its flows and throughput by the max-flow
    evaluator; the bound, when given, is at least that throughput."""
    nodes = [NodeRange(net.names[i], s, e) for i, (s, e) in sorted(ranges.items())]
    value, flows = net.max_flow(ranges, partial_inference, with_flows=True)
    return Placement(
        model=net.model.name,
        cluster=net.cluster.name,
        num_layers=net.model.num_layers,
        planner=planner,
        nodes=nodes,
        flows=flows,
        throughput_tokens_per_s=value,
        upper_bound_tokens_per_s=None if bound is None else max(bound, value),
    )
