"""Tiling heuristic: stacked rows of equal ranges, chosen by a small configuration MILP.

Balanced placements have a regular shape: the layers split into segments, and each
segment is covered by a few "rows", a row being machines of one type each holding k
layers, tiled end to end over the segment. A segment's throughput is the sum of its rows'
T_t(k). Example (LLaMA-2-70B, helix-single-24): 4 A100 x 10 layers over 40 layers
(7,538/s), two rows of L4 x 5 layers over 20 layers (2 x 3,846/s), and one row of T4 x 4
plus one of T4 x 3 over the last 20 (2,935 + 4,167/s): 7,102 tokens/s, where every
baseline stops at 5,667.

For a target F: a configuration c is a multiset of at most MAX_ROWS rows whose throughputs
sum to >= F and from which no row can be dropped. The MILP picks segment lengths:
    lam_c in Z>=0, sum_c lam_c = L                       (segments tile the model)
    m_cr in Z>=0, k_r m_cr >= lam_c                      (machines to tile row r of c)
    sum_{c, r of type t} m_cr <= N_t                     (machines available)
Feasible => F is reachable when the coverage turns into flow (uniform links: it does).
F is bisected. Machines left over join the weakest window, and machines of a segment are
taken from one region where possible, so only segment boundaries cross slow links.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pulp

from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.bounds import layer_work_bound
from helixserve.planner.coverage import machine_types
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.solver import quiet_pulp, solve
from helixserve.spec import group_machines

MAX_ROWS = 3
#: most configurations kept per target (the smallest machine use per layer first)
MAX_CONFIGS = 1500
#: above this many combinations of MAX_ROWS rows the enumeration may not finish in time
MANY_COMBOS = 200_000

Row = tuple[int, int]  # (machine type, layers per machine)


def _configs(curves: list[list[float]], target: float,
             deadline_s: float = float("inf")) -> list[tuple[Row, ...]]:
    """The configurations for `target`. With hundreds of rows (many layers, machines that
    hold many of them) the triples run to millions: the enumeration stops at `deadline_s`,
    and then goes longest ranges first, since those use the fewest machines per layer."""
    rows: list[tuple[Row, float]] = [((t, k), thr) for t, c in enumerate(curves)
                                     for k, thr in enumerate(c, start=1) if thr > 0]
    # a lone row: only the longest range still reaching the target is worth having
    out: list[tuple[Row, ...]] = []
    for t, c in enumerate(curves):
        ks = [k for k, thr in enumerate(c, start=1) if thr >= target]
        if ks:
            out.append(((t, max(ks)),))
    small = [(r, thr) for r, thr in rows if thr < target]
    if math.comb(len(small) + MAX_ROWS - 1, MAX_ROWS) > MANY_COMBOS:
        small.sort(key=lambda x: -x[0][1])  # may not finish: longest ranges first
    for size in range(2, MAX_ROWS + 1):
        combos = itertools.combinations_with_replacement(small, size)
        for n, combo in enumerate(combos):
            if n % 4096 == 0 and clock.now() > deadline_s:
                break
            total = sum(thr for _, thr in combo)
            if total >= target and total - min(thr for _, thr in combo) < target:
                out.append(tuple(r for r, _ in combo))
    # machines per layer a configuration uses: fewer is better
    out.sort(key=lambda c: sum(1.0 / k for _, k in c))
    return out[:MAX_CONFIGS]


def _feasible(curves: list[list[float]], counts: list[int], L: int, target: float,
              time_limit_s: float) -> list[tuple[tuple[Row, ...], int, list[int]]] | None:
    # half the time to enumerate, the rest to build and solve
    configs = _configs(curves, target, clock.now() + time_limit_s / 2)
    if not configs:
        return None
    with quiet_pulp():
        prob = pulp.LpProblem("tiling", pulp.LpMinimize)
        lam = [pulp.LpVariable(f"lam_{c}", lowBound=0, upBound=L, cat=pulp.LpInteger)
               for c in range(len(configs))]
        m = {(c, r): pulp.LpVariable(f"m_{c}_{r}", lowBound=0, cat=pulp.LpInteger)
             for c, conf in enumerate(configs) for r in range(len(conf))}
        prob += pulp.lpSum(m.values())  # spare machines are extra cover later
        prob += pulp.lpSum(lam) == L, "length"
        for (c, r), var in m.items():
            prob += configs[c][r][1] * var - lam[c] >= 0, f"tile_{c}_{r}"
        for t, n in enumerate(counts):
            prob += pulp.lpSum(var for (c, r), var in m.items() if configs[c][r][0] == t) <= n, \
                f"count_{t}"
    info = solve(prob, time_limit_s, gap_rel=0.05)
    if info.objective is None:
        return None
    out = []
    for c, conf in enumerate(configs):
        length = int(round(lam[c].varValue or 0))
        if length > 0:
            out.append((conf, length, [int(round(m[(c, r)].varValue or 0))
                                       for r in range(len(conf))]))
    return out


def _place(net: FlowNetwork, groups: list[list[int]], curves: list[list[float]],
           plan: list[tuple[tuple[Row, ...], int, list[int]]]) -> Ranges:
    L = net.model.num_layers
    region = {i: net.cluster.nodes[i].region for g in groups for i in g}
    left = [list(g) for g in groups]
    out: Ranges = {}

    def take(t: int, prefer: str | None) -> int:
        pool = left[t]
        if prefer is not None:
            for idx, i in enumerate(pool):
                if region[i] == prefer:
                    return pool.pop(idx)
        # else the region with most of this type left, to keep later segments together
        by_region: dict[str, int] = {}
        for i in pool:
            by_region[region[i]] = by_region.get(region[i], 0) + 1
        best = max(by_region, key=lambda r: by_region[r])
        for idx, i in enumerate(pool):
            if region[i] == best:
                return pool.pop(idx)
        return pool.pop()

    start = 0
    for conf, length, ms in plan:
        prefer: str | None = None
        for (t, k), count in zip(conf, ms, strict=True):
            for j in range(count):
                if not left[t]:
                    break
                s = min(start + j * k, start + length - k)
                s = max(0, min(s, L - k))
                node = take(t, prefer)
                prefer = prefer or region[node]
                out[node] = (s, s + k)
        start += length
    # spare machines: each on the window with the least cover, at its best k thr(k)
    cover = np.zeros(L)
    for i, (s, e) in out.items():
        cover[s:e] += net.node_cap(i, e - s)
    for t, pool in enumerate(left):
        for i in pool:
            curve = curves[t]
            k = max(range(1, len(curve) + 1), key=lambda kk: kk * curve[kk - 1])
            k = min(k, L)
            window = np.convolve(cover, np.ones(k), mode="valid")
            s = int(np.argmin(window))
            out[i] = (s, s + k)
            cover[s:s + k] += curve[k - 1]
    return out


def tiling_search(net: FlowNetwork, lo: float, hi: float, deadline_s: float,
                  partial_inference: bool = True) -> tuple[Ranges, float] | None:
    """Bisect the target F in [lo, hi]; return the best placement by real max flow."""
    groups_map = machine_types(net)
    curves = [list(c) for c in groups_map]
    groups = list(groups_map.values())
    counts = [len(g) for g in groups]
    L = net.model.num_layers
    best: tuple[Ranges, float] | None = None
    while hi - lo > 0.002 * hi:
        left_s = deadline_s - clock.now()
        if left_s <= 0.2:
            break
        mid = (lo + hi) / 2
        plan = _feasible(curves, counts, L, mid, min(left_s, max(1.0, left_s / 4)))
        if plan is None:
            hi = mid
            continue
        ranges = _place(net, groups, curves, plan)
        value = net.max_flow(ranges, partial_inference)[0]
        if best is None or value > best[1]:
            best = (ranges, value)
        lo = mid
    return best


def regional_tiling(net: FlowNetwork, deadline_s: float,
                    partial_inference: bool = True) -> tuple[Ranges, float] | None:
    """Tile every region that can hold the whole model on its own, each as a separate
    cluster, and run them side by side: slow links between regions then carry nothing
    but token ids from and to the coordinator. None when no region holds the model."""
    from helixserve.spec import ClusterSpec

    L = net.model.num_layers
    nodes = net.cluster.nodes
    regions = group_machines(nodes, lambda i: nodes[i].region,
                             [i for i in range(len(nodes)) if net.max_layers[i] > 0])
    able = [members for members in regions.values()
            if sum(int(net.max_layers[i]) for i in members) >= L]
    if len(able) < 2:
        return None  # one region (or none) alone: the plain tiling covers it
    out: Ranges = {}
    for rank, members in enumerate(able):
        left_s = deadline_s - clock.now()
        if left_s <= 0.2:
            break
        cluster = net.cluster
        sub = ClusterSpec(
            name=f"{cluster.name}/{cluster.nodes[members[0]].region}",
            nodes=[cluster.nodes[i] for i in members],
            coordinator_region=cluster.coordinator_region,
            coordinator_nic_gbps=cluster.coordinator_nic_gbps,
            default_link=cluster.default_link, between_regions=cluster.between_regions,
            explicit=cluster.explicit, source=cluster.source)
        sub_net = FlowNetwork(sub, net.model, net.cost)
        found = tiling_search(sub_net, 0.0, layer_work_bound(sub_net),
                              clock.now() + left_s / (len(able) - rank),
                              partial_inference)
        if found is not None:
            for j, rng in found[0].items():
                out[members[j]] = rng
    if not out:
        return None
    return out, net.max_flow(out, partial_inference)[0]
