"""Baseline placements, for comparison with the MILP (and as its warm starts).

Each takes the precomputed `FlowNetwork` and returns node index -> [start, end):
  * uniform:  every used node holds the same number of layers (the smallest node's
              capacity), stages of equal size, nodes dealt round-robin over the stages.
  * petals:   nodes join one by one, each takes as many layers as it can hold, placed on
              the window whose weakest layer has the least throughput so far (Petals'
              block selection).
  * swarm:    S equal stages (every S that fits tried), nodes sorted by throughput
              assigned greedily to the stage with the least throughput (SWARM).
  * separate: one or more pipelines per machine type (gpu, num_gpus), no mixing. A type
              that cannot hold the model within the weight cap makes one pipeline of all its
              machines, the layers split evenly, its weights beyond the cap when they still
              load (`loadable_layers`), as the Helix authors' Separate Pipelines baseline for
              llama-2-70b does (20 layers per A100-40GB, 10 per L4, 6-7 per T4). No type
              that can: one mixed greedy pipeline (petals).
"""

from __future__ import annotations

import math

from helixserve.planner.flow import FlowNetwork
from helixserve.spec import group_machines, machine_type

Ranges = dict[int, tuple[int, int]]


def _split(total: int, parts: int) -> list[int]:
    """`total` layers in `parts` near-equal contiguous sizes."""
    base, extra = divmod(total, parts)
    return [base + (1 if p < extra else 0) for p in range(parts)]


def _stages(total: int, parts: int) -> list[tuple[int, int]]:
    out, s = [], 0
    for size in _split(total, parts):
        out.append((s, s + size))
        s += size
    return out


def usable(net: FlowNetwork) -> list[int]:
    return [i for i in range(len(net.names)) if net.max_layers[i] > 0]


def uniform(net: FlowNetwork) -> Ranges:
    nodes = usable(net)
    L = net.model.num_layers
    k = min(int(net.max_layers[i]) for i in nodes)
    num_stages = math.ceil(L / k)
    if num_stages > len(nodes):
        return petals(net)  # too few nodes for equal ranges: fall back to a greedy cover
    stages = _stages(L, num_stages)
    return {i: stages[p % num_stages] for p, i in enumerate(nodes)}


def _best_k(net: FlowNetwork, i: int) -> int:
    return int(net.max_layers[i])


def petals(net: FlowNetwork) -> Ranges:
    L = net.model.num_layers
    cover = [0.0] * L
    out: Ranges = {}
    nodes = usable(net)
    # Petals lets every server join in turn; slow servers last so the fast ones spread first
    nodes.sort(key=lambda i: -net.node_cap(i, _best_k(net, i)) * _best_k(net, i))
    for i in nodes:
        k = _best_k(net, i)
        best_s, best_key = 0, (math.inf, math.inf)
        for s in range(0, L - k + 1):
            window = cover[s:s + k]
            key = (min(window), sum(window))
            if key < best_key:
                best_s, best_key = s, key
        out[i] = (best_s, best_s + k)
        for layer in range(best_s, best_s + k):
            cover[layer] += net.node_cap(i, k)
    return out


def swarm(net: FlowNetwork) -> Ranges:
    L = net.model.num_layers
    nodes = usable(net)
    kmax = max(int(net.max_layers[i]) for i in nodes)
    best: Ranges = {}
    best_value = -1.0
    for num_stages in range(math.ceil(L / kmax), L + 1):
        stages = _stages(L, num_stages)
        size = max(e - s for s, e in stages)
        fits = [i for i in nodes if net.max_layers[i] >= size]
        if len(fits) < num_stages:
            continue
        fits.sort(key=lambda i: -net.node_cap(i, size))
        load = [0.0] * num_stages
        ranges: Ranges = {}
        for i in fits:
            st = min(range(num_stages), key=lambda p: load[p])
            ranges[i] = stages[st]
            load[st] += net.node_cap(i, stages[st][1] - stages[st][0])
        value, _ = net.max_flow(ranges, partial_inference=False)
        if value > best_value:
            best, best_value = ranges, value
        if len(fits) == len(nodes) and num_stages > math.ceil(L / kmax) + 8:
            break  # more stages than this only adds hops
    return best or petals(net)


def separate(net: FlowNetwork) -> Ranges:
    L = net.model.num_layers
    nodes = net.cluster.nodes
    groups = group_machines(nodes, lambda i: machine_type(nodes[i]), usable(net))
    out: Ranges = {}
    for members in groups.values():
        k = int(net.max_layers[members[0]])
        per_pipe = math.ceil(L / k)
        if len(members) < per_pipe:
            # beyond the weight cap: one pipeline of every machine, as little over it as can be
            if math.ceil(L / len(members)) > net.loadable[members[0]]:
                continue  # this machine type cannot hold the whole model on its own
            per_pipe = len(members)
        stages = _stages(L, per_pipe)
        # spare machines of the type join the pipelines as extra replicas of their stages
        for p, i in enumerate(members):
            out[i] = stages[p % per_pipe]
    if not out:
        return petals(net)  # no type can hold the model alone: one mixed greedy pipeline
    return out


BASELINES = {"uniform": uniform, "petals": petals, "swarm": swarm, "separate": separate}
