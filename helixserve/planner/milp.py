"""Helix's per-node max-flow MILP (arXiv 2406.01566, section 4), tightened.

This module is the per-node MILP and its large-neighbourhood search; portfolio.py runs it
last in the `milp` planner's portfolio, warm-started from the best placement the other
searches found (docs/planner.md).

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
from collections.abc import Callable

import numpy as np
import pulp

from helixserve.planner import clock
from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.solver import HighsModel, quiet_pulp
from helixserve.spec import group_machines, machine_type

#: links below this fraction of the throughput bound are pruned from the MILP
PRUNE_FRACTION = 0.002
#: above this many nodes each node keeps only its strongest out-links in the MILP
DENSE_NODES = 40
LINKS_PER_NODE = 16


def _identical_groups(net: FlowNetwork) -> list[list[int]]:
    """Nodes interchangeable in every respect: T curve, region, every link capacity."""
    n = len(net.names)

    def key(i: int) -> tuple[object, ...]:
        nd = net.cluster.nodes[i]
        others = [j for j in range(n) if j != i]
        # a node's links to the rest, sorted: identical machines see the same multiset
        return (*machine_type(nd), nd.region, net.source_cap[i], net.sink_cap[i],
                tuple(sorted(net.link_cap[i, others])), tuple(sorted(net.link_cap[others, i])))

    groups = group_machines(net.cluster.nodes, key)
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


def warm_start(net: FlowNetwork, v: dict[str, dict], ranges: Ranges,
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


def extract(net: FlowNetwork, v: dict[str, dict]) -> Ranges:
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
    while clock.now() < deadline_s - 0.3:
        with quiet_pulp():
            warm_start(net, v, ranges, partial_inference)
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
        obj, cols = model.run(min(2.0, deadline_s - clock.now()), start)
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
