"""The layer-work bound: a closed-form upper bound on any placement's throughput.

The first bound every plan has (the relaxations of coverage.py and regions.py and the
per-node MILP tighten it); the tiling search bisects below it.
"""

from __future__ import annotations

from helixserve.planner.flow import FlowNetwork


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
