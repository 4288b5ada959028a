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
  * while that is more than `max_loss` below a full re-plan (run first, 70% of the time),
    kept machines are un-pinned in rounds of 1, 2, 4, ... up to half of them (those
    nearest the layer of least capacity first) and searched again, each round from the
    last one's best: losing a machine that was the only holder of some layers, with no
    new one to take them, needs some neighbours to move.

`choose` keeps the incremental placement when it is as good as the full re-plan, or within
`max_loss` of its throughput while moving fewer machines; else the full re-plan. Either way
the changes against `current` are reported (`changes`). The full re-plan's bound holds for
both: the bounds are over every placement within the weight cap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.pinned import fill_gaps
from helixserve.planner.pipeline import Progress
from helixserve.planner.placement import NodeRange, Placement
from helixserve.planner.registry import plan
from helixserve.planner.search import local_search
from helixserve.spec import ClusterSpec, ModelSpec

#: the incremental search's share of --time-limit; the full re-plan (first) gets the rest
INCREMENTAL_SHARE = 0.3


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


def incremental(net: FlowNetwork, current: Placement, deadline_s: float, seed: int = 0,
                partial_inference: bool = True, target: float = 0.0) -> Incremental:
    """The incremental placement described in the module docstring, searched until
    `deadline_s` (planner clock, clock.py). Below `target` tokens/s, it un-pins kept machines in rounds
    (1, 2, 4, ... of them, nearest the layer of least capacity first) until it gets there;
    each round starts from the last one's best."""
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
    new = [n for n in net.names if n not in in_current]
    free = [i for i in range(len(net.names)) if i not in kept and net.max_layers[i] > 0]

    ranges = dict(kept)
    # the strongest free machines first, each where capacity is lowest
    for i in sorted(free, key=lambda j: -net.node_cap(j, int(net.max_layers[j])) *
                    int(net.max_layers[j])):
        k = int(net.max_layers[i])
        s = int(np.argmin(np.convolve(_cover(net, ranges), np.ones(k), mode="valid")))
        ranges[i] = (s, s + k)
    ranges = fill_gaps(net, ranges, set(kept))
    value = net.max_flow(ranges, partial_inference)[0]
    # rounds: 0 (only the free machines move), then 1, 2, 4, ... kept machines un-pinned
    # (at most half of the kept machines, or the one there is: beyond that a full re-plan
    # is the better answer)
    most = max(1, len(kept) // 2) if kept else 0
    sizes = [0]
    while sizes[-1] < most:
        sizes.append(min(most, max(1, 2 * sizes[-1])))
    pinned = set(kept)
    for n, size in enumerate(sizes):
        if n > 0 and value >= target:
            break
        now = clock.now()
        if now >= deadline_s:
            break
        if size > 0:
            pinned = set(kept) - set(_weakest_first(net, ranges, sorted(kept))[:size])
            # un-pinned neighbours grow into layers left without a holder (the local
            # search only accepts moves that keep every layer held)
            filled = fill_gaps(net, ranges, pinned)
            filled_value = net.max_flow(filled, partial_inference)[0]
            if filled_value >= value:
                ranges, value = filled, filled_value
        if len(pinned) < len(ranges):
            share = (deadline_s - now) / (len(sizes) - n)
            found, found_value, _ = local_search(net, [ranges], now + share, seed=seed + n,
                                                 partial_inference=partial_inference,
                                                 fixed=frozenset(pinned))
            if found_value >= value:
                ranges, value = found, found_value
    unchanged = sorted(net.names[i] for i, r in kept.items() if ranges.get(i) == r)
    return Incremental(ranges, float(value), unchanged, freed, gone, new)


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


def replan(cluster: ClusterSpec, model: ModelSpec, cost: CostModel, current: Placement,
           planner: str = "milp", time_limit_s: float = 60.0, seed: int = 0,
           progress: Progress | None = None, partial_inference: bool = True,
           jobs: int | None = None, max_loss: float = 0.05,
           work_limit: float | None = None) -> Replan:
    """A full re-plan (1 - INCREMENTAL_SHARE of the time), then the incremental placement
    (the rest), aiming at `1 - max_loss` of the full one's throughput; the incremental one is
    returned when `choose` says so, else the full one. `work_limit`: units of work on the
    planner's work clock (clock.py) instead of `time_limit_s` seconds."""
    if work_limit is not None:
        with clock.work_clock():
            return _replan(cluster, model, cost, current, planner, work_limit, seed, progress,
                           partial_inference, jobs, max_loss, counted=True)
    return _replan(cluster, model, cost, current, planner, time_limit_s, seed, progress,
                   partial_inference, jobs, max_loss, counted=False)


def _replan(cluster: ClusterSpec, model: ModelSpec, cost: CostModel, current: Placement,
            planner: str, time_limit_s: float, seed: int, progress: Progress | None,
            partial_inference: bool, jobs: int | None, max_loss: float,
            counted: bool) -> Replan:
    if not 0.0 <= max_loss <= 1.0:
        raise UserError(f"--max-loss: bad value {max_loss}; must be a fraction in [0, 1]")
    check_current(current, model.num_layers, "--from")
    started = time.perf_counter()
    clock_start = clock.now()
    full_limit = (1 - INCREMENTAL_SHARE) * time_limit_s
    full = plan(planner, cluster, model, cost, time_limit_s=full_limit, seed=seed,
                progress=progress, partial_inference=partial_inference, jobs=jobs,
                work_limit=full_limit if counted else None)
    full_value = full.throughput_tokens_per_s or 0.0
    net = FlowNetwork(cluster, model, cost)
    inc = incremental(net, current, clock_start + time_limit_s - 0.02 * time_limit_s, seed,
                      partial_inference, target=(1.0 - max_loss) * full_value)
    if progress is not None:
        progress(f"incremental: {inc.throughput_tokens_per_s:,.1f} tokens/s, "
                 f"{len(inc.kept)} of the machines kept as they were")
    value, flows = net.max_flow(inc.ranges, partial_inference, with_flows=True)
    bound = full.upper_bound_tokens_per_s
    inc_placement = Placement(
        model=model.name, cluster=cluster.name, num_layers=model.num_layers,
        planner=f"{planner}-incremental",
        nodes=[NodeRange(net.names[i], s, e) for i, (s, e) in sorted(inc.ranges.items())],
        flows=flows, throughput_tokens_per_s=value,
        upper_bound_tokens_per_s=None if bound is None else max(bound, value),
    )
    keep = choose(full_value, inc.throughput_tokens_per_s, max_loss,
                  changes(current, full).moves, changes(current, inc_placement).moves)
    chosen = inc_placement if keep else full
    chosen.solve_time_s = time.perf_counter() - started
    return Replan(chosen, inc, inc_placement, full, keep)

