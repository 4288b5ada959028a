"""What every routing policy shares: the hop graph, KV admission and the route search.

A route is built hop by hop from the coordinator at layer 0. From a vertex whose hops so far
end at layer `l`, a candidate next hop is a node `j` with `start_j <= l < end_j` (it runs
only `[l, end_j)`: partial inference), reachable over an allowed edge, alive, and whose KV
cache can hold the request. Once `l == num_layers`, the route returns to the coordinator.
Layers only grow, so a node never appears twice and the state after a hop on `j` is `j`
itself: the search is a depth-first search in the policy's preference order with dead
vertices memoised, O(edges) per request. The policy only orders candidates (`_order`) and
learns which route was taken (`_commit`).

KV bookkeeping: the router promises `prompt_tokens + max_new_tokens` KV slots (per layer it
runs there) on every node of a route, keyed by request id, and releases them in
`on_finish` / `on_cancel`. A node admits a request when

    state[node].kv_free_tokens - promised_total[node] >= prompt_tokens + max_new_tokens

so `NodeState.kv_free_tokens` should be the node's free KV *not counting* requests this
router has routed (the simulator passes the capacity). A caller that passes the live free
KV of a worker that already holds routed requests gets conservative (never over-full)
admission.

On-demand KV (`RequestInfo.kv_tokens`): a caller whose engine allocates KV as tokens are
generated promises only what a request needs at admission (its prompt) and passes
`kv_free_tokens` = capacity less the slots its routed requests have grown into since (less
any watermark it keeps); the check above then admits a request when the prompt fits now.
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
        self.down: set[str] = set()
        self.routes: dict[str, Route] = {}
        self._promised: dict[str, dict[str, int]] = {n: {} for n in self.ranges}
        self._promised_total: dict[str, int] = dict.fromkeys(self.ranges, 0)
        #: requests currently routed through each node
        self.active: dict[str, int] = dict.fromkeys(self.ranges, 0)

    # ---- the Router protocol -------------------------------------------------------------

    def route(self, req: RequestInfo, state: Mapping[str, NodeState]) -> Route | None:
        if req.request_id in self.routes:
            raise ValueError(f"request {req.request_id!r} is already routed")
        need = req.prompt_tokens + req.max_new_tokens if req.kv_tokens is None else req.kv_tokens
        dead: set[str] = set()
        path: list[str] = []

        def admissible(j: str) -> bool:
            if j in self.down or j in dead:
                return False
            s = state.get(j)
            if s is None or not s.alive:
                return False
            return s.kv_free_tokens - self._promised_total[j] >= need

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
        self.routes[req.request_id] = route
        for j in path:
            self._promised[j][req.request_id] = need
            self._promised_total[j] += need
            self.active[j] += 1
        return route

    def adopt(self, request_id: str, route: Route, kv_tokens: int) -> bool:
        """Take over a request another router routed (the coordinator rebuilds its router
        when the placement changes under running requests), with its KV promise; False when
        a hop of `route` is not a range of this placement (the request must be re-routed)."""
        for h in route.hops:
            r = self.ranges.get(h.name)
            if r is None or not r.start_layer <= h.start_layer < h.end_layer <= r.end_layer:
                return False
        self.routes[request_id] = route
        for j in route.nodes:
            self._promised[j][request_id] = kv_tokens
            self._promised_total[j] += kv_tokens
            self.active[j] += 1
        return True

    def on_finish(self, request_id: str) -> None:
        self._release(request_id)

    def on_cancel(self, request_id: str) -> None:
        self._release(request_id)

    def node_down(self, node: str) -> None:
        self.down.add(node)

    def node_up(self, node: str) -> None:
        self.down.discard(node)

    # ---- bookkeeping queries -------------------------------------------------------------

    def promised_kv_tokens(self, node: str) -> int:
        """KV slots (per layer) promised on `node` to requests still running."""
        return self._promised_total.get(node, 0)

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

    def _release(self, request_id: str) -> None:
        route = self.routes.pop(request_id, None)
        if route is None:
            return  # finishing twice, or a request we never routed: nothing to release
        for j in route.nodes:
            need = self._promised[j].pop(request_id, 0)
            self._promised_total[j] -= need
            self.active[j] -= 1
