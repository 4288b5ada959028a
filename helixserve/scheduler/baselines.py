"""Baseline routing policies the Helix paper compares against.

All three choose the next hop among the same candidates as the maxflow router (nodes whose
range holds the current layer, over an existing link, alive, with room in their KV cache),
but ignore the max-flow solution:

- `random`: uniform over the candidates.
- `shortest-queue`: the candidate with the least load: its queue length as the caller
  reports it, then (ties, e.g. many requests routed between two state updates) the number
  of requests this router has routed through it, then a seeded coin.
- `swarm`: SWARM's stochastic stage-wise wiring: the candidate is drawn with probability
  proportional to `throughput / (1 + queue_len + active_requests)`, where throughput is the
  node's tokens/s (option `node_throughput_tokens_per_s`, by default the placement's flow
  into the node, or 1 when there are no flows).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from helixserve.planner.placement import Placement
from helixserve.scheduler.base import GraphRouter
from helixserve.scheduler.types import NodeState, RequestInfo


class RandomRouter(GraphRouter):
    name = "random"

    def _order(
        self,
        vertex: str,
        layer: int,
        cands: Sequence[str],
        req: RequestInfo,
        state: Mapping[str, NodeState],
    ) -> list[str]:
        order = list(cands)
        self.rng.shuffle(order)
        return order


class ShortestQueueRouter(GraphRouter):
    name = "shortest-queue"

    def _order(
        self,
        vertex: str,
        layer: int,
        cands: Sequence[str],
        req: RequestInfo,
        state: Mapping[str, NodeState],
    ) -> list[str]:
        keyed = [(state[j].queue_len, state[j].active_requests, self.rng.random(), j) for j in cands]
        return [k[-1] for k in sorted(keyed)]


class SwarmRouter(GraphRouter):
    name = "swarm"

    def __init__(
        self,
        placement: Placement,
        seed: int = 0,
        edges: Iterable[tuple[str, str]] | None = None,
        node_throughput_tokens_per_s: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(placement, seed=seed, edges=edges)
        if node_throughput_tokens_per_s is None:
            inflow = dict.fromkeys(self.ranges, 0.0)
            for f in placement.flows:
                if f.dst in inflow:
                    inflow[f.dst] += max(f.tokens_per_s, 0.0)
            has_flows = any(v > 0 for v in inflow.values())
            # A node the flow solution leaves idle still gets a small weight: SWARM does not
            # know the flow and would still send it some work.
            floor = 0.01 * max(inflow.values()) if has_flows else 1.0
            node_throughput_tokens_per_s = {n: max(v, floor) for n, v in inflow.items()}
        self.throughput = dict(node_throughput_tokens_per_s)

    def _order(
        self,
        vertex: str,
        layer: int,
        cands: Sequence[str],
        req: RequestInfo,
        state: Mapping[str, NodeState],
    ) -> list[str]:
        # Weighted sampling without replacement (Efraimidis-Spirakis keys u^(1/w), as logs).
        keyed = []
        for j in cands:
            w = self.throughput.get(j, 1.0) / (1.0 + state[j].queue_len + state[j].active_requests)
            u = 1.0 - self.rng.random()  # in (0, 1]
            keyed.append((math.log(u) / w if w > 0 else -math.inf, j))
        keyed.sort(reverse=True)
        return [j for _, j in keyed]
