"""What every routing policy shares: the hop graph, KV admission and the route search.

A route is built hop by hop from the coordinator at layer 0. From a vertex whose hops so far
end at layer `l`, a candidate next hop is a node `j` with `start_j <= l < end_j` (it runs
only `[l, end_j)`: partial inference), reachable over an allowed edge, alive, and whose KV
cache can hold the request. Once `l == num_layers`, the route returns to the coordinator.
Layers only grow, so a node never appears twice and the state after a hop on `j` is `j`
itself: the search is a depth-first search in the policy's preference order with dead
vertices memoised, O(edges) per request. The policy only orders candidates (`_order`) and
learns which route was taken (`_commit`).

The router keeps no ledger: the scheduling core (scheduler/core.py) owns the KV book and
which nodes are up, and passes its view, one `NodeState` per node. A node admits a request
when it is alive and

    state[node].kv_free_tokens >= req.promise_tokens

where `kv_free_tokens` is what may still be promised there (capacity less the watermark,
less growth not covered by promises, less every promise: scheduler/kv.py). Policies order
candidates by the view (queue length, requests routed through the node) and by their own
state (maxflow's IWRR credits, learned in `_commit`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

from helixserve.errors import UserError
from helixserve.planner.placement import NodeRange, Placement
from helixserve.scheduler.types import NodeState, RequestInfo, Route
from helixserve.spec.cluster import COORDINATOR


class GraphRouter:
    """Base class of the routing policies; subclasses implement `_order` (and `_commit`)."""

    name = "base"

    def __init__(
        self,
        placement: Placement,
        seed: int = 0,
        edges: Iterable[tuple[str, str]] | None = None,
    ) -> None:
        if not placement.nodes:
            raise UserError("placement: nodes: empty; a route needs at least one node")
        if not placement.covers_all_layers():
            raise UserError(
                f"placement: node ranges do not cover all {placement.num_layers} layers; "
                "no request could be routed"
            )
        self.placement = placement
        self.num_layers = placement.num_layers
        self.rng = random.Random(seed)
        self.ranges: dict[str, NodeRange] = {n.name: n for n in placement.nodes}
        #: nodes whose range contains each layer, in placement order
        self._at_layer: list[list[str]] = [[] for _ in range(self.num_layers)]
        for n in placement.nodes:
            for layer in range(n.start_layer, n.end_layer):
                self._at_layer[layer].append(n.name)
        #: allowed directed edges (None: every pair; the network is complete)
        self._edges: set[tuple[str, str]] | None = set(edges) if edges is not None else None

    # ---- the Router protocol -------------------------------------------------------------

    def route(self, req: RequestInfo, state: Mapping[str, NodeState]) -> Route | None:
        need = req.promise_tokens
        dead: set[str] = set()
        path: list[str] = []

        def admissible(j: str) -> bool:
            if j in dead:
                return False
            s = state.get(j)
            return s is not None and s.alive and s.kv_free_tokens >= need

        def search(vertex: str, layer: int) -> bool:
            if layer == self.num_layers:
                return self._edge_ok(vertex, COORDINATOR)
            cands = [j for j in self._next_nodes(vertex, layer) if admissible(j)]
            for j in self._order(vertex, layer, cands, req, state):
                path.append(j)
                if search(j, self.ranges[j].end_layer):
                    return True
                path.pop()
                dead.add(j)
            return False

        if not search(COORDINATOR, 0):
            return None
        hops = []
        layer = 0
        for j in path:
            end = self.ranges[j].end_layer
            hops.append(NodeRange(j, layer, end))
            layer = end
        route = Route(tuple(hops))
        self._commit(route, req, state)
        return route

    def accepts(self, route: Route) -> bool:
        """Whether every hop runs layers its node holds here (a route made over another
        placement, kept across a re-plan; partial inference allowed)."""
        for h in route.hops:
            r = self.ranges.get(h.name)
            if r is None or not r.start_layer <= h.start_layer < h.end_layer <= r.end_layer:
                return False
        return True

    def take(self, pick: Route, route: Route, req: RequestInfo,
             state: Mapping[str, NodeState]) -> None:
        """The caller admitted `req` on `route` instead of `pick`, the route this router just
        returned for it (a cache-aware choice, scheduler/prefix.py): undo what choosing
        `pick` taught the policy and learn `route` instead. Default: nothing (the policy
        keeps no state, or keeps the coin it drew)."""

    # ---- for subclasses -------------------------------------------------------------------

    def _order(
        self,
        vertex: str,
        layer: int,
        cands: Sequence[str],
        req: RequestInfo,
        state: Mapping[str, NodeState],
    ) -> list[str]:
        """Candidates in the order the policy prefers them (first = chosen if it completes)."""
        raise NotImplementedError

    def _commit(self, route: Route, req: RequestInfo, state: Mapping[str, NodeState]) -> None:
        """Learn that `route` was taken (e.g. IWRR credits). Default: nothing."""

    def _next_nodes(self, vertex: str, layer: int) -> list[str]:
        return [j for j in self._at_layer[layer] if self._edge_ok(vertex, j)]

    def _edge_ok(self, src: str, dst: str) -> bool:
        return self._edges is None or (src, dst) in self._edges
