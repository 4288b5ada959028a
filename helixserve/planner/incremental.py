"""Re-plan from the placement a cluster runs now, moving as few machines as it can (--from).

A machine whose layer range changes must restart and load its new layers (docs/operations.md,
"Upgrading a placement"): minutes of weight loading for a 70B model, and fewer routes while
it happens. A fresh plan after adding or losing one machine usually changes nearly every
range, because the searches start from scratch and are random. So `plan --from current.json`
also builds the *incremental* placement:

  * kept: every machine of `current` that is still in the cluster and whose range still fits
    its memory (`k <= max_layers`) keeps its range exactly;
  * free: machines new to the cluster, and machines whose range no longer fits;
  * gone: machines of `current` that are not in the cluster any more;
  * the free machines are placed around the kept ones: each on the window of layers
    with the least capacity so far (a lost machine's layers first, since they have none),
    then gaps that remain are filled (pinned.fill_gaps), then the local search moves only
    the free machines (local_search with the kept ones fixed);
  * while that is more than `max_loss` below the full re-plan, kept machines are un-pinned
    in rounds of 1, 2, 4, ... up to half of them (those nearest the layer of least capacity
    first) and searched again, each round from the last one's best: losing a machine that
    was the only holder of some layers, with no new one to take them, needs some neighbours
    to move.

These are stages of the planner's pipeline (portfolio.py), declared by `replan_stages`, run by
`portfolio.run_pipeline` within one `Budget` (seconds, or units of work on the work clock:
`plan --from --work-limit N` gives the same answer on any machine and with any --jobs):

  stage               finds                                             budget (of the limit T)
  full                the full re-plan: the planner by name             70% (1 - INCREMENTAL_SHARE)
                      (milp: portfolio.PORTFOLIO); its bound
  incremental         kept ranges, free machines placed around them     -
  incremental-search  the rounds above, from the incremental placement  the rest, less 2%

`choose` keeps the incremental placement when it is as good as the full re-plan, or within
`max_loss` of its throughput while moving fewer machines; else the full re-plan. Either way
the changes against `current` are reported (`changes`). The full re-plan's bound holds for
both: the bounds are over every placement within the weight cap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.parallel import check_jobs
from helixserve.planner.pinned import fill_gaps
from helixserve.planner.placement import Placement
from helixserve.planner.portfolio import (
    Budget,
    Candidate,
    Incumbent,
    Problem,
    Progress,
    Stage,
    StageReport,
    run_pipeline,
)
from helixserve.planner.registry import plan, to_placement
from helixserve.planner.search import local_search
from helixserve.spec import ClusterSpec, ModelSpec

#: the incremental stages' share of the limit; the full re-plan (first) gets the rest
INCREMENTAL_SHARE = 0.3
#: what the incremental search leaves of the limit, to read the answers back within it
MARGIN_SHARE = 0.02


@dataclass
class Incremental:
    ranges: Ranges
    throughput_tokens_per_s: float
    #: machines of the current placement whose range is the same in this one
    kept: list[str]
    #: in the current placement and the cluster, but their range no longer fits
    freed: list[str]
    #: in the current placement, not in the cluster
    gone: list[str]
    #: in the cluster, not in the current placement
    new: list[str]


@dataclass
class Changes:
    """What applying `new` over `old` changes: machines that restart with other layers,
    machines that start holding layers, machines that stop."""

    moved: list[tuple[str, tuple[int, int], tuple[int, int]]]
    added: list[tuple[str, tuple[int, int]]]
    removed: list[tuple[str, tuple[int, int]]]
    unchanged: int

    @property
    def moves(self) -> int:
        """Machines that (re)load layers: moved or added."""
        return len(self.moved) + len(self.added)

    def summary(self) -> str:
        parts = [f"{self.unchanged} unchanged", f"{len(self.moved)} moved"]
        parts += [f"{len(self.added)} added", f"{len(self.removed)} removed"]
        lines = [", ".join(parts)]
        lines += [f"  moved   {n}: [{a[0]},{a[1]}) -> [{b[0]},{b[1]})" for n, a, b in self.moved]
        lines += [f"  added   {n}: [{r[0]},{r[1]})" for n, r in self.added]
        lines += [f"  removed {n}: was [{r[0]},{r[1]})" for n, r in self.removed]
        return "\n".join(lines)


def check_current(current: Placement, num_layers: int, source: str) -> None:
    if current.num_layers != num_layers:
        raise UserError(f"{source}: num_layers: {current.num_layers}, but the model has "
                        f"{num_layers} layers; --from needs a placement of the same model")


@dataclass
class Split:
    """The running placement against the cluster (module doc): kept, freed, gone, new."""

    kept: Ranges
    freed: list[str]
    gone: list[str]
    new: list[str]


def split(net: FlowNetwork, current: Placement) -> Split:
    check_current(current, net.model.num_layers, "--from")
    kept: Ranges = {}
    freed, gone = [], []
    for r in current.nodes:
        i = net.index.get(r.name)
        if i is None:
            gone.append(r.name)
        elif r.num_layers <= net.max_layers[i]:
            kept[i] = (r.start_layer, r.end_layer)
        else:
            freed.append(r.name)
    in_current = {r.name for r in current.nodes}
    return Split(kept, freed, gone, [n for n in net.names if n not in in_current])


def unpin_sizes(num_kept: int) -> list[int]:
    """Kept machines un-pinned per round: 0 (only the free machines move), then 1, 2, 4, ...
    up to half of them, or the one there is (beyond that a full re-plan is the better
    answer)."""
    most = max(1, num_kept // 2) if num_kept else 0
    sizes = [0]
    while sizes[-1] < most:
        sizes.append(min(most, max(1, 2 * sizes[-1])))
    return sizes


# ---- the stages of `REPLAN` -----------------------------------------------------------------


def full_stage(planner: str, max_loss: float) -> Stage:
    """The full re-plan by planner `planner` (registry.plan: for milp, the whole portfolio)
    in 1 - INCREMENTAL_SHARE of the limit; it sets the incremental search's target."""

    def run(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
        limit = (1 - INCREMENTAL_SHARE) * budget.time_limit_s
        reports: list[StageReport] = []
        net = p.net
        full = plan(planner, net.cluster, net.model, net.cost, time_limit_s=limit, seed=p.seed,
                    progress=say, partial_inference=p.partial_inference, jobs=p.jobs,
                    stages=reports, work_limit=limit if clock.counting() else None)
        value = full.throughput_tokens_per_s or 0.0
        inc.candidates.append(Candidate(value, "full", {
            net.index[r.name]: (r.start_layer, r.end_layer) for r in full.nodes}))
        bound = full.upper_bound_tokens_per_s
        if bound is not None:
            inc.bounds.append(bound)
        inc.reports.extend(reports)  # the portfolio's own stages, before this one's
        inc.target_tokens_per_s = (1.0 - max_loss) * value
        return StageReport("full", True, planner, value, bound)

    return Stage("full", run, always=True)


def _cover(net: FlowNetwork, ranges: Ranges) -> np.ndarray:
    """Per layer, the summed T(k) of the machines holding it."""
    cover = np.zeros(net.model.num_layers)
    for j, (s, e) in ranges.items():
        cover[s:e] += net.node_cap(j, e - s)
    return cover


def _weakest_first(net: FlowNetwork, ranges: Ranges, candidates: list[int]) -> list[int]:
    """`candidates` ordered by how close their range is to the layer of least capacity."""
    weakest = int(np.argmin(_cover(net, ranges)))

    def distance(j: int) -> int:
        s, e = ranges[j]
        return 0 if s <= weakest < e else min(abs(s - weakest), abs(e - 1 - weakest))

    return sorted(candidates, key=lambda j: (distance(j), ranges[j][1] - ranges[j][0], j))


def run_place(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    """The kept ranges, each free machine on the window of least capacity (the strongest
    first), then the gaps filled: the incremental search's start."""
    net, kept = p.net, p.kept
    free = [i for i in range(p.num_nodes) if i not in kept and net.max_layers[i] > 0]
    ranges = dict(kept)
    for i in sorted(free, key=lambda j: -net.node_cap(j, int(net.max_layers[j])) *
                    int(net.max_layers[j])):
        k = int(net.max_layers[i])
        s = int(np.argmin(np.convolve(_cover(net, ranges), np.ones(k), mode="valid")))
        ranges[i] = (s, s + k)
    ranges = fill_gaps(net, ranges, set(kept))
    c = inc.add(p, "incremental", ranges)
    return StageReport("incremental", True, f"{len(free)} free machines placed",
                       c.value_tokens_per_s)


def run_unpin(p: Problem, budget: Budget, inc: Incumbent, say: Progress) -> StageReport:
    """The local search from the incremental placement, the kept machines fixed, then (while
    below the target) rounds with more of them un-pinned; the budget left is shared evenly
    between the rounds left."""
    net, kept = p.net, p.kept
    start = last(inc, "incremental")
    ranges, value = start.ranges, start.value_tokens_per_s
    sizes = unpin_sizes(len(kept))
    deadline = budget.deadline_s - MARGIN_SHARE * budget.time_limit_s
    pinned = set(kept)
    rounds = 0
    for n, size in enumerate(sizes):
        if n > 0 and value >= inc.target_tokens_per_s:
            break
        now = clock.now()
        if now >= deadline:
            break
        rounds += 1
        if size > 0:
            pinned = set(kept) - set(_weakest_first(net, ranges, sorted(kept))[:size])
            # un-pinned neighbours grow into layers left without a holder (the local
            # search only accepts moves that keep every layer held)
            filled = fill_gaps(net, ranges, pinned)
            filled_value = p.value(filled)
            if filled_value >= value:
                ranges, value = filled, filled_value
        if len(pinned) < len(ranges):
            share = (deadline - now) / (len(sizes) - n)
            found, found_value, _ = local_search(net, [ranges], now + share, seed=p.seed + n,
                                                 partial_inference=p.partial_inference,
                                                 fixed=frozenset(pinned))
            if found_value >= value:
                ranges, value = found, found_value
    inc.add(p, "incremental-search", ranges, float(value))
    say(f"incremental: {value:,.1f} tokens/s, "
        f"{sum(1 for i, r in kept.items() if ranges.get(i) == r)} of the machines kept as "
        "they were")
    return StageReport("incremental-search", True, f"{rounds} of {len(sizes)} rounds", value)


#: the incremental placement's stages, after the full re-plan (module doc)
INCREMENTAL: tuple[Stage, ...] = (
    Stage("incremental", run_place, always=True),
    Stage("incremental-search", run_unpin, always=True),
)


def replan_stages(planner: str, max_loss: float) -> tuple[Stage, ...]:
    """`plan --from`'s stages, in order (module doc)."""
    return (full_stage(planner, max_loss), *INCREMENTAL)


def last(inc: Incumbent, source: str) -> Candidate:
    """The last candidate that stage `source` found."""
    return next(c for c in reversed(inc.candidates) if c.source == source)


def incremental(net: FlowNetwork, current: Placement, limit: float, seed: int = 0,
                partial_inference: bool = True, target: float = 0.0) -> Incremental:
    """The incremental placement alone (`INCREMENTAL`), aiming at `target` tokens/s within
    `limit` (seconds, or units inside clock.work_clock)."""
    parts = split(net, current)
    problem = Problem(net, partial_inference, seed, kept=parts.kept)
    inc = run_pipeline(INCREMENTAL, problem, Budget(limit), Incumbent(target_tokens_per_s=target),
                     lambda msg: None)
    return _incremental(net, parts, last(inc, "incremental-search"))


def _incremental(net: FlowNetwork, parts: Split, found: Candidate) -> Incremental:
    unchanged = sorted(net.names[i] for i, r in parts.kept.items() if found.ranges.get(i) == r)
    return Incremental(found.ranges, found.value_tokens_per_s, unchanged, parts.freed,
                       parts.gone, parts.new)


def changes(old: Placement, new: Placement) -> Changes:
    before = {r.name: (r.start_layer, r.end_layer) for r in old.nodes}
    after = {r.name: (r.start_layer, r.end_layer) for r in new.nodes}
    moved = [(n, before[n], after[n]) for n in sorted(after)
             if n in before and before[n] != after[n]]
    added = [(n, after[n]) for n in sorted(after) if n not in before]
    removed = [(n, before[n]) for n in sorted(before) if n not in after]
    unchanged = sum(1 for n in after if before.get(n) == after[n])
    return Changes(moved, added, removed, unchanged)


def choose(full_tokens_per_s: float, incremental_tokens_per_s: float, max_loss: float,
           full_moves: int, incremental_moves: int) -> bool:
    """Whether to keep the incremental placement: as good as the full re-plan, or within
    `max_loss` (a fraction) of its throughput while moving fewer machines."""
    if incremental_tokens_per_s >= full_tokens_per_s:
        return True
    return (incremental_tokens_per_s >= (1.0 - max_loss) * full_tokens_per_s
            and incremental_moves < full_moves)


@dataclass
class Replan:
    #: the one kept: `incremental_placement` or `full`
    placement: Placement
    incremental: Incremental
    incremental_placement: Placement
    full: Placement
    kept_incremental: bool
    #: what each stage did (`REPLAN`; the full re-plan's portfolio stages first)
    stages: list[StageReport] = field(default_factory=list)


def replan(cluster: ClusterSpec, model: ModelSpec, cost: CostModel, current: Placement,
           planner: str = "milp", time_limit_s: float = 60.0, seed: int = 0,
           progress: Progress | None = None, partial_inference: bool = True,
           jobs: int | None = None, max_loss: float = 0.05,
           work_limit: float | None = None) -> Replan:
    """Run `replan_stages` within `time_limit_s` seconds, or `work_limit` units of work on
    the planner's work clock (clock.py: the same inputs then give the same answer on any
    machine and with any `jobs`); the incremental placement is returned when `choose`
    says so, else the full re-plan."""
    if not 0.0 <= max_loss <= 1.0:
        raise UserError(f"--max-loss: bad value {max_loss}; must be a fraction in [0, 1]")
    check_current(current, model.num_layers, "--from")
    if work_limit is None:
        return _replan(cluster, model, cost, current, planner, time_limit_s, seed, progress,
                       partial_inference, jobs, max_loss)
    if not work_limit > 0:
        raise UserError(f"--work-limit: bad value {work_limit}; must be > 0 (units of work)")
    with clock.work_clock():
        return _replan(cluster, model, cost, current, planner, work_limit, seed, progress,
                       partial_inference, jobs, max_loss)


def _replan(cluster: ClusterSpec, model: ModelSpec, cost: CostModel, current: Placement,
            planner: str, limit: float, seed: int, progress: Progress | None,
            partial_inference: bool, jobs: int | None, max_loss: float) -> Replan:
    started = time.perf_counter()
    budget = Budget(limit)  # from here: building the network counts, as in plan()
    cost.check_fits(cluster)
    net = FlowNetwork(cluster, model, cost)
    parts = split(net, current)
    problem = Problem(net, partial_inference, seed, check_jobs(jobs), kept=parts.kept)
    inc = run_pipeline(replan_stages(planner, max_loss), problem, budget, Incumbent(),
                     progress or (lambda msg: None))
    full_found, found = last(inc, "full"), last(inc, "incremental-search")
    bound = min(inc.bounds, default=None)
    full = to_placement(net, planner, full_found.ranges, bound, partial_inference)
    inc_placement = to_placement(net, f"{planner}-incremental", found.ranges, bound,
                                 partial_inference)
    keep = choose(full_found.value_tokens_per_s, found.value_tokens_per_s, max_loss,
                  changes(current, full).moves, changes(current, inc_placement).moves)
    chosen = inc_placement if keep else full
    chosen.solve_time_s = time.perf_counter() - started
    return Replan(chosen, _incremental(net, parts, found), inc_placement, full, keep,
                  inc.reports)
