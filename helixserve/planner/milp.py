"""The `milp` planner: Helix's max-flow MILP (arXiv 2406.01566, section 4), tightened.

Pipeline within the time limit T (docs/planner.md has the full write-up):
  1. the four baselines, evaluated; the best is the floor of the answer. Every step below
     and every bound keeps k_i <= max_layers (the weight cap); a baseline beyond it
     (separate's pipeline of a type that fits no other way) is never searched from, only
     compared at the end: if it is the best, it is the answer, with no bound;
  2. the tiling heuristic (tiling.py, <= 15% of T, and <= 10% per region): stacked rows of
     equal ranges chosen by a small configuration MILP, the target throughput bisected;
  3. the layer-coverage relaxation (coverage.py, ~10% of T): an upper bound, and a start
     (skipped on clusters of at most SMALL_NODES machines, where the MILP is small); with
     two or more regions (and at most DENSE_NODES machines) the region relaxation too
     (regions.py, ~10% of T): coverage per region plus the inter-region hops and links;
     either is skipped when its size says it cannot be built within its share;
  4. stage-structured annealing (stages.py; 10% of T, 25% above DENSE_NODES machines):
     re-cuts pipeline stages with all their replicas at once, from the stage-shaped
     candidates (the baselines);
  5. pinned search (pinned.py; 10% of T, 55% with 2+ regions and at most DENSE_NODES
     machines): the strongest machines re-sized together by one layer, the rest searched
     around them;
  6. local search on the real max flow from all of the above (search.py, ~55% of T);
  7. with at least 8% of T left, the per-node MILP below: first as a large-neighbourhood
     search (all nodes fixed but 3-6 close in layer position, re-solved exactly; half of
     what is left), then whole, warm-started from the best placement so far (the rest of T);
  8. every candidate is re-evaluated by the max-flow evaluator and the best is returned,
     with the tightest of the proven bounds.

Per-node MILP. Data: L layers; per node i, K_i = max layers, T_i(k) node throughput,
link capacities c_ij = bandwidth / bytes per token (activations between nodes, token ids
on coordinator links), cut to min(c_ij, max_k T_i, max_k T_j) (the tightest big-M).
Variables:
    y_ik in {0,1}   node i holds k layers (sum_k y_ik <= 1; none: the node is unused)
    s_i  in Z       first layer held;  e_i = s_i + sum_k k y_ik <= L
    d_ij in {0,1}   edge i -> j usable; f_ij >= 0 its flow (tokens/s)
    a_i, b_i        coordinator -> i and i -> coordinator edges; g_i, h_i their flows
    w_ik >= 0       flow through i when it holds k layers
Constraints:
    partial inference  d_ij = 1  =>  s_j <= e_i <= e_j - 1   (big-M L+1)
    (without it        d_ij = 1  =>  s_j = e_i)
    a_i = 1 => s_i = 0;   b_i = 1 => e_i = L
    f_ij <= c_ij d_ij;  g_i <= c_si a_i;  h_i <= c_it b_i
    g_i + sum_j f_ji = h_i + sum_j f_ij = sum_k w_ik;   w_ik <= T_i(k) y_ik
    L * F <= sum_ik k w_ik        (layer work: every token runs all L layers; a cut Helix lacks)
    sum_k w_ik <= F                (routes are paths: a node carries at most all the flow)
    s_i <= s_i'                    for consecutive identical machines (symmetry breaking)
Objective: maximise F = sum_i g_i. Links weaker than PRUNE_FRACTION of the best bound are
left out, and their capacity added back to the MILP's bound so it stays an upper bound.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pulp

from helixserve.planner.baselines import BASELINES, Ranges
from helixserve.planner.coverage import (
    SECONDS_PER_NONZERO,
    machine_types,
    slot_nonzeros,
    solve_coverage,
)
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.parallel import run_seeds, warm_up
from helixserve.planner.pinned import pinned_search
from helixserve.planner.regions import num_regions, region_types, solve_regions
from helixserve.planner.registry import PlanOutcome, Progress
from helixserve.planner.search import local_search
from helixserve.planner.solver import HighsModel, SolveInfo, quiet_pulp, solve
from helixserve.planner.stages import stage_search
from helixserve.planner.tiling import regional_tiling, tiling_search

#: up to this many nodes the per-node MILP is small: skip the coverage relaxation
SMALL_NODES = 8
#: links below this fraction of the throughput bound are pruned from the MILP
PRUNE_FRACTION = 0.002
#: above this many nodes each node keeps only its strongest out-links in the MILP
DENSE_NODES = 40
LINKS_PER_NODE = 16
#: share of the time limit for the stage annealing, and above DENSE_NODES machines
STAGE_SHARE = 0.1
STAGE_SHARE_DENSE = 0.25
#: share of the time limit for re-sizing the strongest machines (pinned.py), and on
#: clusters of two or more regions (where it found better placements; docs/planner.md)
PINNED_SHARE = 0.1
PINNED_SHARE_REGIONS = 0.55
#: the per-node MILP (LNS, then whole) runs only with at least this share of the limit left
MILP_MIN_SHARE = 0.08
#: up to this many machines the coverage relaxation is solved a second time with every
#: T(k) capped just above the best placement so far (coverage.py): on helix-mix-10 it proves
#: in ~5 s a bound the plain relaxation does not reach in a minute; on the 24- and
#: 42-machine clusters it did not finish in 10 s, so it is not tried there
CAPPED_COVER_NODES = 16
CAP_MARGIN = 0.005


def whole_replicas(net: FlowNetwork) -> Ranges:
    """Every machine that loads the whole model holds all of it, beyond the weight cap or
    not: what serves when the links chain no machines (none between them, or too slow)."""
    L = net.model.num_layers
    return {i: (0, L) for i in range(len(net.names))
            if net.loadable[i] >= L and net.node_cap(i, L) > 0}


#: candidates besides the baselines, compared like them (searched from only within the cap)
EXTRA_CANDIDATES: dict[str, Callable[[FlowNetwork], Ranges]] = {"replicas": whole_replicas}


@dataclass
class MilpStats:
    """What each stage achieved (for the benchmark and the CLI summary)."""

    best_baseline: str
    best_baseline_tokens_per_s: float
    coverage: SolveInfo | None
    search_tokens_per_s: float
    milp: SolveInfo | None
    milp_tokens_per_s: float
    source: str


def layer_work_bound(net: FlowNetwork) -> float:
    """Largest F with L F <= phi(F) = sum_i max_k k min(T_i(k), F).

    Every token runs all L layers, and node i passes at most min(T_i(k_i), F) of the F
    tokens/s through each of its k_i layers. phi is piecewise linear with breaks at the
    T_i(k); between two breaks each term is a max of linear functions (convex), so
    phi(F) - L F has one root there: scan the breaks from the top, bisect the segment.
    """
    L = net.model.num_layers
    curves = [[net.node_cap(i, k) for k in range(1, int(net.max_layers[i]) + 1)]
              for i in range(len(net.names))]

    def slack(F: float) -> float:
        return sum(max((k * min(T, F) for k, T in enumerate(c, start=1)), default=0.0)
                   for c in curves) - L * F

    breaks = sorted({0.0} | {T for c in curves for T in c if T > 0})
    top = breaks[-1] * 2 + 1.0  # slack < 0 here: every min() is saturated
    lo, hi = 0.0, top
    for b in reversed(breaks):
        if slack(b) >= 0:
            lo = b
            break
        hi = b
    for _ in range(60):
        mid = (lo + hi) / 2
        if slack(mid) >= 0:
            lo = mid
        else:
            hi = mid
    return hi


def _identical_groups(net: FlowNetwork) -> list[list[int]]:
    """Nodes interchangeable in every respect: T curve, region, every link capacity."""
    groups: dict[tuple[object, ...], list[int]] = {}
    n = len(net.names)
    for i in range(n):
        nd = net.cluster.nodes[i]
        others = [j for j in range(n) if j != i]
        # a node's links to the rest, sorted: identical machines see the same multiset
        key = (nd.gpu, nd.num_gpus, nd.memory_gb, nd.region, net.source_cap[i],
               net.sink_cap[i], tuple(sorted(net.link_cap[i, others])),
               tuple(sorted(net.link_cap[others, i])))
        groups.setdefault(key, []).append(i)
    exact: list[list[int]] = []
    for members in groups.values():
        # keep the members whose link rows agree entry by entry (after swapping the pair)
        base = members[0]
        same = [base]
        for j in members[1:]:
            rest = [x for x in range(n) if x not in (base, j)]
            if (np.array_equal(net.link_cap[base, rest], net.link_cap[j, rest])
                    and np.array_equal(net.link_cap[rest, base], net.link_cap[rest, j])):
                same.append(j)
        if len(same) > 1:
            exact.append(same)
    return exact


def build_milp(net: FlowNetwork, bound_hint: float, partial_inference: bool = True,
               keep_edges: set[tuple[int, int]] | None = None
               ) -> tuple[pulp.LpProblem, dict[str, dict], float]:
    with quiet_pulp():
        return _build_milp(net, bound_hint, partial_inference, keep_edges)


def _build_milp(net: FlowNetwork, bound_hint: float, partial_inference: bool,
                keep_edges: set[tuple[int, int]] | None
                ) -> tuple[pulp.LpProblem, dict[str, dict], float]:
    L = net.model.num_layers
    n = len(net.names)
    Tmax = [max((net.node_cap(i, k) for k in range(1, int(net.max_layers[i]) + 1)), default=0.0)
            for i in range(n)]
    nodes = [i for i in range(n) if Tmax[i] > 0]
    prob = pulp.LpProblem("helix_placement", pulp.LpMaximize)
    y = {(i, k): pulp.LpVariable(f"y_{i}_{k}", cat=pulp.LpBinary)
         for i in nodes for k in range(1, int(net.max_layers[i]) + 1) if net.node_cap(i, k) > 0}
    s = {i: pulp.LpVariable(f"s_{i}", lowBound=0, upBound=L - 1, cat=pulp.LpInteger)
         for i in nodes}
    size = {i: pulp.lpSum(k * y[(i, k)] for (j, k) in y if j == i) for i in nodes}
    end = {i: s[i] + size[i] for i in nodes}
    w = {key: pulp.LpVariable(f"w_{key[0]}_{key[1]}", lowBound=0) for key in y}

    # edges, pruned: weak links, and beyond DENSE_NODES all but each node's strongest
    pruned_cap = 0.0
    edges: list[tuple[int, int, float]] = []
    threshold = PRUNE_FRACTION * bound_hint
    for i in nodes:
        cand = [(j, min(net.link_cap[i, j], Tmax[i], Tmax[j])) for j in nodes if j != i]
        cand = [(j, c) for j, c in cand if c > 0]
        cand.sort(key=lambda jc: -jc[1])
        for rank, (j, c) in enumerate(cand):
            dense_cut = len(nodes) > DENSE_NODES and rank >= LINKS_PER_NODE
            if (c < threshold or dense_cut) and not (keep_edges and (i, j) in keep_edges):
                pruned_cap += c
                continue
            edges.append((i, j, c))
    d = {(i, j): pulp.LpVariable(f"d_{i}_{j}", cat=pulp.LpBinary) for i, j, _ in edges}
    f = {(i, j): pulp.LpVariable(f"f_{i}_{j}", lowBound=0) for i, j, _ in edges}
    a = {i: pulp.LpVariable(f"a_{i}", cat=pulp.LpBinary) for i in nodes if net.source_cap[i] > 0}
    b = {i: pulp.LpVariable(f"b_{i}", cat=pulp.LpBinary) for i in nodes if net.sink_cap[i] > 0}
    g = {i: pulp.LpVariable(f"g_{i}", lowBound=0) for i in a}
    h = {i: pulp.LpVariable(f"h_{i}", lowBound=0) for i in b}
    F = pulp.lpSum(g.values())
    prob += F

    for i in nodes:
        ks = [k for (j, k) in y if j == i]
        prob += pulp.lpSum(y[(i, k)] for k in ks) <= 1, f"one_size_{i}"
        prob += end[i] <= L, f"end_{i}"
        inflow = pulp.lpSum([g[i]] if i in g else []) + pulp.lpSum(
            f[(j, i2)] for (j, i2) in f if i2 == i)
        outflow = pulp.lpSum([h[i]] if i in h else []) + pulp.lpSum(
            f[(i2, j)] for (i2, j) in f if i2 == i)
        through = pulp.lpSum(w[(i, k)] for k in ks)
        prob += inflow - through == 0, f"in_{i}"
        prob += outflow - through == 0, f"out_{i}"
        for k in ks:
            prob += w[(i, k)] <= net.node_cap(i, k) * y[(i, k)], f"cap_{i}_{k}"
        if i in a:
            prob += s[i] <= (L - 1) * (1 - a[i]), f"src_{i}"
            prob += g[i] <= min(net.source_cap[i], Tmax[i]) * a[i], f"srcflow_{i}"
        if i in b:
            prob += end[i] >= L * b[i], f"snk_{i}"
            prob += h[i] <= min(net.sink_cap[i], Tmax[i]) * b[i], f"snkflow_{i}"
    big_m = L + 1
    for i, j, c in edges:
        prob += f[(i, j)] <= c * d[(i, j)], f"flow_{i}_{j}"
        if partial_inference:
            prob += s[j] - end[i] <= big_m * (1 - d[(i, j)]), f"pi_lo_{i}_{j}"
            prob += end[i] - end[j] + 1 <= big_m * (1 - d[(i, j)]), f"pi_hi_{i}_{j}"
        else:
            prob += s[j] - end[i] <= big_m * (1 - d[(i, j)]), f"seq_lo_{i}_{j}"
            prob += end[i] - s[j] <= big_m * (1 - d[(i, j)]), f"seq_hi_{i}_{j}"
    prob += pulp.lpSum(k * w[(i, k)] for (i, k) in w) >= L * F, "layer_work"
    for i in nodes:  # a token passes a node at most once: no node carries more than F
        prob += pulp.lpSum(w[(i, k)] for (j, k) in w if j == i) <= F, f"through_{i}"
    for members in _identical_groups(net):
        members = [i for i in members if i in s]
        for p in range(len(members) - 1):
            prob += s[members[p]] <= s[members[p + 1]], f"sym_{members[p]}"
    variables: dict[str, dict] = {"y": y, "s": s, "d": d, "f": f, "a": a, "b": b, "g": g,
                                  "h": h, "w": w}
    return prob, variables, pruned_cap


def _warm_start(net: FlowNetwork, v: dict[str, dict], ranges: Ranges,
                partial_inference: bool) -> None:
    """Set every variable of the MILP to the values of `ranges` and its max flow."""
    L = net.model.num_layers
    value, flows = net.max_flow(ranges, partial_inference, with_flows=True)
    flow_of = {(fl.src, fl.dst): fl.tokens_per_s for fl in flows}
    names = net.names
    for (i, k), var in v["y"].items():
        held = ranges.get(i)
        var.setInitialValue(1 if held and held[1] - held[0] == k else 0)
    for i, var in v["s"].items():
        var.setInitialValue(ranges[i][0] if i in ranges else 0)
    for (i, j), var in v["d"].items():
        ok = False
        if i in ranges and j in ranges:
            (_s1, e1), (s2, e2) = ranges[i], ranges[j]
            ok = (s2 <= e1 < e2) if partial_inference else (s2 == e1)
        var.setInitialValue(1 if ok else 0)
        v["f"][(i, j)].setInitialValue(flow_of.get((names[i], names[j]), 0.0) if ok else 0.0)
    for i, var in v["a"].items():
        ok = i in ranges and ranges[i][0] == 0
        var.setInitialValue(1 if ok else 0)
        v["g"][i].setInitialValue(flow_of.get(("coordinator", names[i]), 0.0) if ok else 0.0)
    for i, var in v["b"].items():
        ok = i in ranges and ranges[i][1] == L
        var.setInitialValue(1 if ok else 0)
        v["h"][i].setInitialValue(flow_of.get((names[i], "coordinator"), 0.0) if ok else 0.0)
    through: dict[int, float] = {}
    for fl in flows:
        if fl.dst != "coordinator":
            j = net.index[fl.dst]
            through[j] = through.get(j, 0.0) + fl.tokens_per_s
    for (i, k), var in v["w"].items():
        held = ranges.get(i)
        var.setInitialValue(through.get(i, 0.0) if held and held[1] - held[0] == k else 0.0)


def _extract(net: FlowNetwork, v: dict[str, dict]) -> Ranges:
    ranges: Ranges = {}
    for (i, k), var in v["y"].items():
        if (var.varValue or 0) > 0.5:
            start = int(round(v["s"][i].varValue or 0))
            ranges[i] = (start, start + k)
    return ranges


def lns(net: FlowNetwork, prob: pulp.LpProblem, v: dict[str, dict], ranges: Ranges,
        deadline_s: float, seed: int, partial_inference: bool,
        on_improve: Callable[[float], None] | None = None) -> tuple[Ranges, float]:
    """Large-neighbourhood search with the per-node MILP: fix every node's (start, size)
    but NEIGHBOURHOOD ones, re-solve exactly for those, keep improvements."""
    rng = random.Random(seed)
    model = HighsModel(prob)
    best_value = net.max_flow(ranges, partial_inference)[0]
    nodes = sorted(v["s"])
    L = net.model.num_layers
    order = {var.name: idx for idx, var in enumerate(model.variables)}
    while time.perf_counter() < deadline_s - 0.3:
        with quiet_pulp():
            _warm_start(net, v, ranges, partial_inference)
        start = [float(var.varValue or 0.0) for var in model.variables]
        size = min(len(nodes), rng.choice((2, 3, 3, 4)))
        # a neighbourhood of nodes close in layer position: they trade layers best
        anchor = rng.choice(nodes)
        centre = sum(ranges.get(anchor, (0, 0))) / 2
        free = set(sorted(nodes, key=lambda i: abs(sum(ranges.get(i, (L, L))) / 2 - centre)
                          + rng.random() * L / 4)[:size])
        for i in nodes:
            if i in free:
                model.set_bounds(v["s"][i], 0, L - 1)
            else:
                value = float(ranges[i][0]) if i in ranges else 0.0
                model.set_bounds(v["s"][i], value, value)
            for (j, k), var in v["y"].items():
                if j != i:
                    continue
                if i in free:
                    model.set_bounds(var, 0, 1)
                else:
                    held = i in ranges and ranges[i][1] - ranges[i][0] == k
                    model.set_bounds(var, float(held), float(held))
        obj, cols = model.run(min(2.0, deadline_s - time.perf_counter()), start)
        if obj is None or obj <= best_value * (1 + 1e-6):
            continue
        new: Ranges = {}
        for (i, k), var in v["y"].items():
            if cols[order[var.name]] > 0.5:
                s0 = int(round(cols[order[v["s"][i].name]]))
                new[i] = (s0, s0 + k)
        value = net.max_flow(new, partial_inference)[0] if new else 0.0
        if value > best_value:
            ranges, best_value = new, value
            if on_improve is not None:
                on_improve(value)
    return ranges, best_value


def over_seeds(results: list[tuple[Ranges, float] | None]) -> str:
    """' (best of 2 seeds: 5,914.3 / 5,666.7)' when a search ran on several cores."""
    if len(results) <= 1:
        return ""
    values = " / ".join(f"{r[1]:,.1f}" if r is not None else "-" for r in results)
    return f" (best of {len(results)} seeds: {values})"


def solve_milp(net: FlowNetwork, time_limit_s: float, seed: int,
               progress: Progress | None, partial_inference: bool = True,
               jobs: int = 1) -> PlanOutcome:
    started = time.perf_counter()
    deadline = started + time_limit_s
    say = progress or (lambda msg: None)
    # on a few machines the per-node MILP is solved exactly and the searches stall in
    # moments: extra processes would only cost their start
    jobs = 1 if len(net.names) <= SMALL_NODES else jobs
    warm_up(jobs)

    def remaining() -> float:
        return max(0.0, deadline - time.perf_counter())

    def value_of(r: Ranges) -> float:
        return net.max_flow(r, partial_inference)[0] if r else 0.0

    candidates: list[tuple[float, str, Ranges]] = []
    #: baselines beyond the weight cap (separate's pipeline of a type that fits no other
    #: way): compared at the end, never searched from
    beyond_cap: list[tuple[float, str, Ranges]] = []
    for name, fn in {**BASELINES, **EXTRA_CANDIDATES}.items():
        r = fn(net)
        if not r and name in EXTRA_CANDIDATES:
            continue  # e.g. no machine loads the whole model
        within = all(e - s <= net.max_layers[i] for i, (s, e) in r.items())
        (candidates if within else beyond_cap).append((value_of(r), name, r))
    base_value, base_name, _ = max(candidates + beyond_cap, key=lambda c: c[0])
    bounds = [layer_work_bound(net)]
    say(f"baselines: best {base_name} {base_value:,.1f} tokens/s; "
        f"layer-work bound {bounds[0]:,.1f}")

    def closed() -> bool:
        return max(c[0] for c in candidates) >= min(bounds) * (1 - 1e-6)

    if not closed():
        tiled = tiling_search(net, base_value, min(bounds),
                              time.perf_counter() + 0.15 * time_limit_s, partial_inference)
        if tiled is not None:
            candidates.append((tiled[1], "tiling", tiled[0]))
            say(f"tiling: {tiled[1]:,.1f} tokens/s")
        regional = regional_tiling(net, time.perf_counter() + 0.1 * time_limit_s,
                                   partial_inference)
        if regional is not None:
            candidates.append((regional[1], "tiling-regions", regional[0]))
            say(f"tiling per region: {regional[1]:,.1f} tokens/s")

    L = net.model.num_layers
    relax_s = 0.1 * time_limit_s

    def buildable(what: str, curves: list[tuple[float, ...]]) -> bool:
        # the solver's limit does not bound building the model, nor HiGHS's presolve
        nonzeros = slot_nonzeros(curves, L)
        if nonzeros * SECONDS_PER_NONZERO <= relax_s:
            return True
        say(f"{what} skipped: {nonzeros:,} nonzeros would take about "
            f"{nonzeros * SECONDS_PER_NONZERO:.0f}s of its {relax_s:.1f}s")
        return False

    cover_ok = not closed() and buildable("coverage relaxation", list(machine_types(net)))
    if len(net.names) > SMALL_NODES and cover_ok:
        cov = solve_coverage(net, relax_s,
                             hint=max(candidates, key=lambda c: c[0])[2])
        if cov.info.bound is not None:
            bounds.append(cov.info.bound)
        if cov.ranges:
            candidates.append((value_of(cov.ranges), "coverage", cov.ranges))
        say(f"coverage relaxation [{cov.info.status}]: placement {candidates[-1][0]:,.1f}, "
            f"bound {min(bounds):,.1f} tokens/s")

    # (a cap of 0, when nothing found serves yet, would prove nothing)
    if (len(net.names) <= CAPPED_COVER_NODES and cover_ok and not closed()
            and max(c[0] for c in candidates) > 0):
        best_so_far_value, _, hint = max(candidates, key=lambda c: c[0])
        cap = best_so_far_value * (1 + CAP_MARGIN)
        capped = solve_coverage(net, relax_s, hint=hint, cap=cap)
        if capped.info.bound is not None and capped.info.bound < cap * (1 - 1e-9):
            bounds.append(capped.info.bound)  # valid: see coverage.py, "Capped"
        if capped.ranges:
            candidates.append((value_of(capped.ranges), "coverage-capped", capped.ranges))
        say(f"coverage capped at {cap:,.1f} [{capped.info.status}]: "
            f"bound {min(bounds):,.1f} tokens/s")

    if (num_regions(net) >= 2 and len(net.names) <= DENSE_NODES and not closed()
            and buildable("region relaxation", [c for _, c in region_types(net)])):
        reg = solve_regions(net, relax_s)
        if reg.info.bound is not None:
            bounds.append(reg.info.bound)
        if reg.ranges:
            candidates.append((value_of(reg.ranges), "regions", reg.ranges))
        say(f"region relaxation [{reg.info.status}]: bound {min(bounds):,.1f} tokens/s")

    if not closed():
        share = STAGE_SHARE_DENSE if len(net.names) > DENSE_NODES else STAGE_SHARE
        staged_all = run_seeds(stage_search, (net, [c[2] for c in candidates]),
                               {"partial_inference": partial_inference},
                               time.perf_counter() + share * time_limit_s, seed, jobs, say)
        staged = max((r for r in staged_all if r is not None), key=lambda r: r[1],
                     default=None)
        if staged is not None:
            candidates.append((value_of(staged[0]), "stages", staged[0]))
            say(f"stage annealing: {candidates[-1][0]:,.1f} tokens/s{over_seeds(staged_all)}")

    if not closed():
        multi = num_regions(net) >= 2 and len(net.names) <= DENSE_NODES
        share = PINNED_SHARE_REGIONS if multi else PINNED_SHARE
        best_so_far = max(candidates, key=lambda c: c[0])[2]
        for found in run_seeds(pinned_search, (net, best_so_far),
                               {"partial_inference": partial_inference},
                               time.perf_counter() + share * time_limit_s, seed, jobs, say,
                               worker_kwargs={"heaviest_only": True}):
            for r, _ in found:
                candidates.append((value_of(r), "pinned", r))
                say(f"pinned search: {candidates[-1][0]:,.1f} tokens/s")

    def on_improve(v: float) -> None:
        say(f"search: {v:,.1f} tokens/s ({time.perf_counter() - started:.0f}s)")

    if not closed():
        starts = [c[2] for c in sorted(candidates, key=lambda c: -c[0])]
        searched = run_seeds(local_search, (net, starts),
                             {"partial_inference": partial_inference, "on_improve": on_improve,
                              "max_stall": 200 * len(net.names)},
                             time.perf_counter() + min(0.55 * time_limit_s, remaining() * 0.7),
                             seed, jobs, say)
        ls_ranges = max(searched, key=lambda r: r[1])[0]
        candidates.append((value_of(ls_ranges), "search", ls_ranges))
        if len(searched) > 1:
            say(f"search: {candidates[-1][0]:,.1f} tokens/s"
                f"{over_seeds([(r, v) for r, v, _ in searched])}")
    best_value, best_name, best_ranges = max(candidates, key=lambda c: c[0])

    milp_info: SolveInfo | None = None
    # building the per-node MILP takes seconds on large clusters: only with time to use it
    if remaining() > MILP_MIN_SHARE * time_limit_s and not closed():
        prob, v, pruned = build_milp(net, min(bounds), partial_inference)
        if len(net.names) > SMALL_NODES:
            say(f"lns: re-solving {len(v['s'])}-node MILP neighbourhoods of 3-6 nodes")
            best_ranges, best_value = lns(
                net, prob, v, best_ranges, time.perf_counter() + 0.5 * remaining(), seed,
                partial_inference,
                on_improve=lambda x: say(f"lns: {x:,.1f} tokens/s "
                                         f"({time.perf_counter() - started:.0f}s)"))
            candidates.append((best_value, "lns", best_ranges))
        with quiet_pulp():
            _warm_start(net, v, best_ranges, partial_inference)
        say(f"milp: {len(prob.variables())} variables, {prob.numConstraints()} constraints, "
            f"warm start {best_value:,.1f} tokens/s")

        def on_progress(t: float, inc: float | None, bnd: float | None) -> None:
            gap = "" if inc is None or not bnd else f" gap {max(0.0, 1 - inc / bnd):.1%}"
            say(f"milp {t:.0f}s: incumbent {inc or 0:,.1f} bound "
                f"{(bnd or 0) + pruned:,.1f}{gap}")

        # leave time to read the solution back and evaluate it within the limit
        budget = remaining() - 0.02 * time_limit_s - 0.2
        if budget >= 0.3:
            milp_info = solve(prob, budget, warm_start=True, progress=on_progress)
            if milp_info.bound is not None:
                bounds.append(milp_info.bound + pruned)
            if milp_info.objective is not None:
                r = _extract(net, v)
                if r:
                    candidates.append((value_of(r), "milp", r))
            say(f"milp [{milp_info.status}]: {candidates[-1][0]:,.1f} tokens/s")
    best_value, best_name, best_ranges = max(candidates, key=lambda c: c[0])
    outside = max(beyond_cap, key=lambda c: c[0], default=None)
    if outside is not None and outside[0] > best_value:
        # the bounds are over placements within the cap: none holds for this one
        say(f"best: {outside[0]:,.1f} tokens/s from {outside[1]}, beyond the weight cap "
            f"(within it: {best_value:,.1f}, bound {min(bounds):,.1f})")
        return PlanOutcome(outside[2], upper_bound_tokens_per_s=None)
    bound = max(min(bounds), best_value)
    say(f"best: {best_value:,.1f} tokens/s from {best_name}; bound {bound:,.1f} "
        f"(gap {1 - best_value / bound if bound else 0:.1%})")
    return PlanOutcome(best_ranges, upper_bound_tokens_per_s=bound)
