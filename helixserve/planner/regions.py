"""Region relaxation: machines aggregated per (region, type), flows between regions per layer.

The layer-coverage relaxation (coverage.py) ignores links, so on geo-distributed clusters,
where every route must cross slow inter-region links, its bound is loose. This one keeps
the regions. Decompose any max flow into routes; on a route every layer l is run by exactly
one node (partial inference: a node runs from where the route reached to its end). Let
    x[r,l]      flow whose layer l runs in region r            (sum_r x[r,0] = F)
    z[r,q,b]    flow whose layer b-1 runs in r and layer b in q != r   (b = 1..L-1)
Then, for ANY placement and its max flow:
    conservation   x[q,b] = x[q,b-1] - sum_{q'!=q} z[q,q',b] + sum_{r!=q} z[r,q,b]
    coverage       x[r,l] <= sum_{i in r holds l} T_i(k_i)
    senders        sum_{q!=r} z[r,q,b] <= sum_{i in r, end_i = b} T_i(k_i)
                   (a hop from i to j across regions leaves i after i's last layer)
    ends           x[r,0] <= sum_{i in r, start_i = 0} min(T_i, c_coord->i);  likewise L-1
    links          sum_b z[r,q,b] <= sum_{i in r, j in q} c_ij       (each hop is one edge)
    pairs          z[r,q,b] <= c_max(r,q) * E[r,b] * H[q,b]
    must cross     sum z >= F  when every region's nodes hold < L layers together
where E[r,b] = #nodes of r ending at b and H[q,b] = #nodes of q holding layer b: a token
crossing at b uses an edge i -> j with end_i = b and start_j <= b < end_j, and each such
edge carries at most c_max(r,q) = max_{i in r, j in q} min(c_ij, T_i, T_j). The product is
made linear exactly: E[r,b] = sum_m u[r,b,m] with u binary, and w[r,q,b,m] = u[r,b,m] H[q,b]
through w <= H, w <= |q| u (an upper bound is all that is needed). Counts are integers
n[(r,t),s,k] per (region, machine type) as in coverage.py. Every constraint holds for the
real placement and its route decomposition, so the MILP's proven bound bounds every
placement's max flow. Its solution, dealt to the (region, type)'s machines, is a start.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulp

from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.solver import SolveInfo, quiet_pulp, solve
from helixserve.spec import group_machines


@dataclass
class RegionResult:
    ranges: Ranges
    info: SolveInfo


def region_types(net: FlowNetwork) -> dict[tuple[str, tuple[float, ...]], list[int]]:
    """Usable nodes grouped by (region, T(k) curve)."""
    nodes = net.cluster.nodes
    return group_machines(nodes, lambda i: (nodes[i].region, net.curve(i)),
                          [i for i in range(len(nodes)) if int(net.max_layers[i]) > 0])


def num_regions(net: FlowNetwork) -> int:
    return len({nd.region for nd in net.cluster.nodes})


def solve_regions(net: FlowNetwork, time_limit_s: float) -> RegionResult:
    with quiet_pulp():
        return _solve_regions(net, time_limit_s)


def _solve_regions(net: FlowNetwork, time_limit_s: float) -> RegionResult:
    L = net.model.num_layers
    groups = region_types(net)
    regions = sorted({r for r, _ in groups})
    members_of = {r: [i for (r2, _), m in groups.items() if r2 == r for i in m] for r in regions}
    Tmax = {i: max(net.node_cap(i, k) for k in range(1, int(net.max_layers[i]) + 1))
            for m in groups.values() for i in m}
    prob = pulp.LpProblem("regions", pulp.LpMaximize)
    slots: dict[tuple[int, int, int], pulp.LpVariable] = {}
    cover: dict[tuple[str, int], list[tuple[pulp.LpVariable, float]]] = {}
    ends: dict[tuple[str, int], list[tuple[pulp.LpVariable, float]]] = {}  # value: T
    held: dict[tuple[str, int], list[pulp.LpVariable]] = {}
    ending: dict[tuple[str, int], list[pulp.LpVariable]] = {}
    firsts: dict[str, list[tuple[pulp.LpVariable, float]]] = {r: [] for r in regions}
    lasts: dict[str, list[tuple[pulp.LpVariable, float]]] = {r: [] for r in regions}
    for t, ((r, curve), members) in enumerate(groups.items()):
        src = max(net.source_cap[i] for i in members)
        snk = max(net.sink_cap[i] for i in members)
        per_type = []
        for k, T in enumerate(curve, start=1):
            if T <= 0:
                continue
            for s in range(0, L - k + 1):
                v = pulp.LpVariable(f"n_{t}_{s}_{k}", lowBound=0, upBound=len(members),
                                    cat=pulp.LpInteger)
                slots[(t, s, k)] = v
                per_type.append(v)
                for layer in range(s, s + k):
                    cover.setdefault((r, layer), []).append((v, T))
                    held.setdefault((r, layer), []).append(v)
                ends.setdefault((r, s + k), []).append((v, T))
                ending.setdefault((r, s + k), []).append(v)
                if s == 0:
                    firsts[r].append((v, min(T, src)))
                if s + k == L:
                    lasts[r].append((v, min(T, snk)))
        prob += pulp.lpSum(per_type) <= len(members), f"count_{t}"

    x = {(r, layer): pulp.LpVariable(f"x_{ri}_{layer}", lowBound=0)
         for ri, r in enumerate(regions) for layer in range(L)}
    F = pulp.lpSum(x[(r, 0)] for r in regions)
    prob += F
    pair_cap: dict[tuple[str, str], float] = {}
    z_of: dict[tuple[str, str, int], pulp.LpVariable] = {}
    for ri, r in enumerate(regions):
        for qi, q in enumerate(regions):
            if r == q:
                continue
            caps = [min(net.link_cap[i, j], Tmax[i], Tmax[j])
                    for i in members_of[r] for j in members_of[q]]
            pair_cap[(r, q)] = max(caps, default=0.0)
            if pair_cap[(r, q)] <= 0:
                continue
            for b in range(1, L):
                z_of[(r, q, b)] = pulp.LpVariable(f"z_{ri}_{qi}_{b}", lowBound=0)
            prob += (pulp.lpSum(z_of[(r, q, b)] for b in range(1, L)) <= sum(caps),
                     f"links_{ri}_{qi}")

    for r in regions:
        prob += (x[(r, 0)] - pulp.LpAffineExpression(firsts[r]) <= 0), f"first_{r}"
        prob += (x[(r, L - 1)] - pulp.LpAffineExpression(lasts[r]) <= 0), f"last_{r}"
        for layer in range(L):
            prob += (x[(r, layer)] - pulp.LpAffineExpression(cover.get((r, layer), [])) <= 0,
                     f"cover_{r}_{layer}")
    for b in range(1, L):
        for q in regions:
            out = [z_of[(q, q2, b)] for q2 in regions if (q, q2, b) in z_of]
            inn = [z_of[(r, q, b)] for r in regions if (r, q, b) in z_of]
            prob += (x[(q, b)] - x[(q, b - 1)] + pulp.lpSum(out) - pulp.lpSum(inn) == 0,
                     f"cons_{q}_{b}")
            if out:
                prob += (pulp.lpSum(out) - pulp.LpAffineExpression(ends.get((q, b), [])) <= 0,
                         f"send_{q}_{b}")
        # pairs: z[r,q,b] <= c_max * E[r,b] * H[q,b], linearised through E = sum_m u_m
        for r in regions:
            targets = [q for q in regions if (r, q, b) in z_of]
            if not targets:
                continue
            E = ending.get((r, b), [])
            if not E:
                for q in targets:
                    prob += z_of[(r, q, b)] <= 0, f"nosend_{r}_{q}_{b}"
                continue
            us = [pulp.LpVariable(f"u_{regions.index(r)}_{b}_{m}", cat=pulp.LpBinary)
                  for m in range(len(members_of[r]))]
            prob += pulp.lpSum(us) - pulp.lpSum(E) == 0, f"ends_{r}_{b}"
            for m in range(1, len(us)):
                prob += us[m] <= us[m - 1], f"uord_{r}_{b}_{m}"
            for q in targets:
                H = pulp.lpSum(held.get((q, b), []))
                ws = []
                for m, u in enumerate(us):
                    w = pulp.LpVariable(f"w_{regions.index(r)}_{regions.index(q)}_{b}_{m}",
                                        lowBound=0)
                    prob += w - H <= 0, f"wh_{r}_{q}_{b}_{m}"
                    prob += w - len(members_of[q]) * u <= 0, f"wu_{r}_{q}_{b}_{m}"
                    ws.append(w)
                prob += (z_of[(r, q, b)] - pair_cap[(r, q)] * pulp.lpSum(ws) <= 0,
                         f"pair_{r}_{q}_{b}")
    # a route's stint in one region is run by distinct nodes of it (ends increase along a
    # route), so it spans at most M_r = sum_{i in r} K_i layers: when no region can hold the
    # whole model, every route hops between regions at least once
    if all(sum(int(net.max_layers[i]) for i in members_of[r]) < L for r in regions):
        prob += pulp.lpSum(z_of.values()) - F >= 0, "must_cross"
    for layer in range(L):  # some whole machine holds every layer (as in coverage.py)
        prob += pulp.lpSum(v for r in regions for v in held.get((r, layer), [])) >= 1, \
            f"held_{layer}"

    info = solve(prob, time_limit_s, warm_start=False)
    ranges: Ranges = {}
    if info.objective is not None:
        groups_list = list(groups.values())
        used = [0] * len(groups_list)
        for (t, s, k), v in sorted(slots.items()):
            for _ in range(int(round(v.varValue or 0))):
                if used[t] < len(groups_list[t]):
                    ranges[groups_list[t][used[t]]] = (s, s + k)
                    used[t] += 1
    return RegionResult(ranges, info)
