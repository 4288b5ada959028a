"""Layer-coverage relaxation: identical machines aggregated, links ignored.

Every route runs each layer l on exactly one node that holds l, so for ANY placement
    max flow <= cover_l = sum_{i holds l} T_i(k_i)        for every layer l.
Maximising min_l cover_l is therefore a relaxation of the max-flow placement problem, and
its proven bound is an upper bound on every placement's throughput. Machines with the
same T(k) curve (same gpu, num_gpus, memory) are interchangeable here, so the model has
one integer per (machine type t, start s, size k):
    n[t,s,k] in {0..N_t}      machines of type t holding [s, s+k)
    sum_{s,k} n[t,s,k] <= N_t
    sum_{t,s,k : s <= l < s+k} T_t(k) n[t,s,k] >= F      for l = 0..L-1
    sum_{t,s,k : s <= l < s+k} n[t,s,k] >= 1             (a cut: some machine holds l)
    maximise F
With uniform links and partial inference its optimum is (nearly) achievable, so its
solution is also a strong starting placement: slots are dealt to the type's machines.

Capped (`cap=c`): every T(k) is replaced by min(T(k), c) and F <= c. For the coverage
optimum F* of any placement, min(F*, c) is still feasible: a layer whose cover has a term
with T >= c keeps a capped term >= c, and every other layer's cover is unchanged. So a
proven bound B < c of the capped model means F* <= B for every placement. The capped LP
is much tighter near c (a fraction of a short, fast range no longer covers a layer at
several times F), which lets HiGHS prove bounds just above the best placement that the
plain model does not reach (helix-mix-10, LLaMA-30B: 824.0 in ~5 s at c = 825, against
911 after 40 s uncapped). When the capped optimum reaches c nothing is proven.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pulp

from helixserve.planner.baselines import Ranges
from helixserve.planner.flow import FlowNetwork
from helixserve.planner.solver import SolveInfo, quiet_pulp, solve
from helixserve.spec import group_machines


@dataclass
class CoverageResult:
    ranges: Ranges
    info: SolveInfo


def machine_types(net: FlowNetwork) -> dict[tuple[float, ...], list[int]]:
    """Usable nodes grouped by their T(k) curve (exactly equal floats)."""
    return group_machines(net.cluster.nodes, net.curve,
                          [i for i in range(len(net.names)) if int(net.max_layers[i]) > 0])


#: seconds per constraint nonzero to build a relaxation in PuLP, hand it to HiGHS and presolve
#: it on the 2-core machine (measured: coverage ~4 us, regions ~9 us; 120 layers, 7 types)
SECONDS_PER_NONZERO = 1e-5


def slot_nonzeros(curves: Iterable[tuple[float, ...]], num_layers: int) -> int:
    """Nonzeros of the cover rows of a relaxation with one count per (curve, start, size):
    a range of k layers appears in k rows at each of its L - k + 1 starts. What building it
    costs grows with this, so milp skips a relaxation it cannot build within its share."""
    return sum(k * (num_layers - k + 1)
               for curve in curves for k, T in enumerate(curve, start=1) if T > 0)


def solve_coverage(net: FlowNetwork, time_limit_s: float,
                   hint: Ranges | None = None, cap: float | None = None) -> CoverageResult:
    with quiet_pulp():
        return _solve_coverage(net, time_limit_s, hint, cap)


def _solve_coverage(net: FlowNetwork, time_limit_s: float, hint: Ranges | None,
                    cap: float | None = None) -> CoverageResult:
    L = net.model.num_layers
    groups = machine_types(net)
    prob = pulp.LpProblem("coverage", pulp.LpMaximize)
    F = pulp.LpVariable("F", lowBound=0, upBound=cap)
    prob += F
    cover: list[list[tuple[pulp.LpVariable, float]]] = [[] for _ in range(L)]
    slots: dict[tuple[int, int, int], pulp.LpVariable] = {}
    for t, (curve, members) in enumerate(groups.items()):
        per_type = []
        for k, T in enumerate(curve, start=1):
            if T <= 0:
                continue
            if cap is not None:
                T = min(T, cap)
            for s in range(0, L - k + 1):
                v = pulp.LpVariable(f"n_{t}_{s}_{k}", lowBound=0, upBound=len(members),
                                    cat=pulp.LpInteger)
                slots[(t, s, k)] = v
                per_type.append(v)
                for layer in range(s, s + k):
                    cover[layer].append((v, T))
        prob += pulp.lpSum(per_type) <= len(members), f"count_{t}"
    for layer in range(L):
        prob += pulp.LpAffineExpression(cover[layer]) - F >= 0, f"cover_{layer}"
        # valid because n is integer: some whole machine holds the layer. Without it the LP
        # spreads fractions of the most efficient small ranges over every layer.
        prob += pulp.lpSum(v for v, _ in cover[layer]) >= 1, f"held_{layer}"

    warm = False
    if hint:
        type_of = {i: t for t, members in enumerate(groups.values()) for i in members}
        counts: dict[tuple[int, int, int], int] = {}
        for i, (s, e) in hint.items():
            if i in type_of:
                key = (type_of[i], s, e - s)
                counts[key] = counts.get(key, 0) + 1
        if all(key in slots for key in counts):
            for key, v in slots.items():
                v.setInitialValue(counts.get(key, 0))
            cov = [sum(T * (v.varValue or 0) for v, T in cover[layer]) for layer in range(L)]
            # the hint's cover can be above the cap where links, not layers, bind its flow
            F.setInitialValue(min(cov) if cap is None else min(min(cov), cap))
            warm = True
    info = solve(prob, time_limit_s, warm_start=warm)
    ranges: Ranges = {}
    if info.objective is not None:
        members_of = list(groups.values())
        used = [0] * len(members_of)
        for (t, s, k), v in sorted(slots.items()):
            count = int(round(v.varValue or 0))
            for _ in range(count):
                if used[t] < len(members_of[t]):
                    ranges[members_of[t][used[t]]] = (s, s + k)
                    used[t] += 1
    return CoverageResult(ranges, info)
