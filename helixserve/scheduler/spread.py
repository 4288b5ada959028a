"""Spread a max-flow solution over every equivalent edge, keeping each node's throughput.

Why: a max-flow solver returns *one* optimal flow, often a few disjoint chains (scipy's
Dinic on a cluster of identical links does exactly that). IWRR over such a flow pins every
request to one of a few fixed pipelines; in a pipeline with greedy continuous batching the
micro-batches of a fixed pipeline merge into one wave that keeps most stages idle (seen in
the simulator: 363 vs 576 decode tokens/s for the same placement, see docs/simulator.md).
Any flow with the same per-node throughput and no link over capacity is just as optimal,
so we pick the most mixed one: the maximum-entropy flow with the same marginals.

The rule. Rows are the senders (the coordinator as source, each node), columns the
receivers (each node, the coordinator as sink); row v must send `out(v)` and column j
receive `in(j)`, both read off the given flow. The support is every edge of the given flow
plus every pair (v, j) that is a valid hop (j's range holds v's end layer, or v ends the
model and j is the sink) over an existing link whose capacity is at least the largest flow
the given solution sends into j (so the spread cannot overload a slow link). Iterative
proportional fitting (alternately scale rows and columns to their targets) converges to the
maximum-entropy flow on that support with those marginals; the given flow is feasible, so
the fit exists. Where the marginals force some pairs to zero the fit only converges like
1/iterations, so we stop at a relative column error of `tolerance` (0.1%: these are routing
proportions, not capacities); if even that is not reached after `max_iterations`, the given
flow is returned unchanged.

With node capacities (`node_throughput_tokens_per_s`), the flow through nodes holding the
same range is first shared among them in proportion to capacity (`_share_among_replicas`):
the flow value does not change, but no replica is left idle with its KV cache unused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from helixserve.planner.placement import Placement
from helixserve.spec.cluster import COORDINATOR

_SINK = "\0sink"  # the coordinator as a receiver (it is also the source)


def spread_flows(
    placement: Placement,
    flows: Mapping[tuple[str, str], float],
    edges: Iterable[tuple[str, str]] | None = None,
    edge_capacity_tokens_per_s: Mapping[tuple[str, str], float] | None = None,
    node_throughput_tokens_per_s: Mapping[str, float] | None = None,
    max_iterations: int = 5000,
    tolerance: float = 1e-3,
) -> dict[tuple[str, str], float]:
    """The max-entropy flow with the same per-node in/out flow as `flows` (see module doc)."""
    ranges = {n.name: n for n in placement.nodes}
    L = placement.num_layers
    allowed = set(edges) if edges is not None else None
    row_target: dict[str, float] = {}
    col_target: dict[str, float] = {}
    max_into: dict[str, float] = {}
    support: dict[tuple[str, str], float] = {}
    for (src, dst), f in flows.items():
        if f <= 0:
            continue
        col = _SINK if dst == COORDINATOR else dst
        row_target[src] = row_target.get(src, 0.0) + f
        col_target[col] = col_target.get(col, 0.0) + f
        max_into[col] = max(max_into.get(col, 0.0), f)
        support[src, col] = 1.0
    if node_throughput_tokens_per_s is not None:
        _share_among_replicas(placement, node_throughput_tokens_per_s, row_target, col_target,
                              max_into)  # fmt: skip
    for v in row_target:
        end_v = 0 if v == COORDINATOR else ranges[v].end_layer
        for j in col_target:
            if (v, j) in support or v == j:
                continue
            dst = COORDINATOR if j == _SINK else j
            if j == _SINK:
                if end_v != L:
                    continue
            elif not (ranges[j].start_layer <= end_v < ranges[j].end_layer):
                continue
            if allowed is not None and (v, dst) not in allowed:
                continue
            caps = edge_capacity_tokens_per_s
            if caps is not None and caps.get((v, dst), 0.0) < max_into[j]:
                continue
            support[v, j] = 1.0

    # Vectorised over the support: entry k joins row r[k] and column c[k].
    keys = list(support)
    row_names = sorted({v for v, _ in keys})
    col_names = sorted({j for _, j in keys})
    if any(v not in row_target for v in row_names) or any(j not in col_target for j in col_names):
        return dict(flows)
    row_index = {v: i for i, v in enumerate(row_names)}
    col_index = {j: i for i, j in enumerate(col_names)}
    r = np.array([row_index[v] for v, _ in keys])
    c = np.array([col_index[j] for _, j in keys])
    row_goal = np.array([row_target[v] for v in row_names])
    col_goal = np.array([col_target[j] for j in col_names])
    x = np.ones(len(keys))
    for _ in range(max_iterations):
        x *= (row_goal / np.bincount(r, weights=x, minlength=len(row_names)))[r]
        col_sum = np.bincount(c, weights=x, minlength=len(col_names))
        worst = float(np.max(np.abs(col_sum - col_goal) / col_goal))
        x *= (col_goal / col_sum)[c]
        if worst < tolerance:
            break
    else:
        return dict(flows)
    out = {}
    for (v, j), f in zip(keys, x.tolist(), strict=True):
        out[v, COORDINATOR if j == _SINK else j] = f
    return out


def _share_among_replicas(
    placement: Placement,
    capacity: Mapping[str, float],
    row_target: dict[str, float],
    col_target: dict[str, float],
    max_into: dict[str, float],
) -> None:
    """Nodes holding the same range are interchangeable for the flow value; share the flow
    of each such group in proportion to capacity, so a replica the solver left idle still
    gets requests (and its KV cache is used). Edits the targets in place."""
    groups: dict[tuple[int, int], list[str]] = {}
    for node in placement.nodes:
        groups.setdefault((node.start_layer, node.end_layer), []).append(node.name)
    for names in groups.values():
        total = sum(col_target.get(n, 0.0) for n in names)
        caps = [max(capacity.get(n, 0.0), 0.0) for n in names]
        if len(names) < 2 or total <= 0 or sum(caps) <= 0:
            continue
        biggest = max(max_into.get(n, 0.0) for n in names)
        for n, cap in zip(names, caps, strict=True):
            share = total * cap / sum(caps)
            if share > 0:
                row_target[n] = col_target[n] = share
                max_into[n] = biggest
            else:
                row_target.pop(n, None)
                col_target.pop(n, None)
