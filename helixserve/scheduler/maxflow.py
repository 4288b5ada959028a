"""Helix's router: per-request pipelines drawn by interleaved weighted round-robin (IWRR)
over the placement's max-flow solution.

The rule. Every vertex `v` of the flow graph (the coordinator and each node) keeps a credit
`c[v, j]` per outgoing flow edge `v -> j`, of weight `w[v, j]` = the edge's flow in tokens/s.
Edges carrying less than `min_flow_share` of `v`'s outflow are masked (rounding noise of the
LP, not capacity). A request of work `W = prompt_tokens + max_new_tokens` (the tokens it will
push through its route: its prompt once, then one per decode step; the route is fixed for
its life, so it is drawn once) is routed hop by hop from the coordinator at layer 0:

    A     = the admissible edges out of v (node alive, its range holds the current layer,
            its KV can hold the request: see `base.py`)
    c'[j] = c[v, j] + W * w[v, j] / sum(w[v, a] for a in A)      for j in A
    choose j = argmax c'[j] (ties: by name); then c[v, ·] = c'; c[v, j] -= W

which is smooth weighted round-robin (nginx) with work-weighted steps: choices interleave
rather than burst, and the work sent down each edge converges to its flow share (the
credits stay bounded). If the chosen hop cannot complete a route (every continuation is
masked), the next-best candidate is tried; credits change only along the route finally
taken, so failed attempts leave no trace. When the caller admits the request on another route
than the one returned (the core's cache-aware choice, scheduler/prefix.py), `take` undoes the
returned route's credit update and credits the route taken instead, and `flow_excess` says
how much work a candidate route's edges have carried beyond their flow shares (the choice's
flow term).

Regions (placements with `route_within_regions`, which the serving selection sets when it
simulates better; `node_region` here). A node whose flow continues inside its own region
keeps only those edges: its requests do not also cross to another region, where every
prompt's activations and every decode step would queue on the slow link; the flow it sent
there goes to its in-region successors in proportion to theirs. Crossings the flow needs
(a node with no in-region successor) stay. Not the default: it depends on the placement
(on helix-geo-24 it cost one milp placement 21% and gave a later one 26%;
docs/benchmarks.md), so the serving selection decides it by simulation.

Which flow. By default (`spread=True`) the weights are not the solver's flow as given but
the maximum-entropy flow with the same per-node throughput (`spread.py`): a solver's flow
is typically a few disjoint chains, and fixed pipelines under greedy batching merge their
micro-batches into waves that idle most stages. When KV masks every flow route, `spill`
tries the valid hops outside the flow (least loaded first) before the request waits; spilled
hops leave the credits alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from helixserve.errors import UserError
from helixserve.planner.placement import Placement
from helixserve.scheduler.base import GraphRouter
from helixserve.scheduler.spread import spread_flows
from helixserve.scheduler.types import NodeState, RequestInfo, Route
from helixserve.spec.cluster import COORDINATOR

#: flow edges under this share of their vertex's outflow are masked: rounding noise of the LP
MIN_FLOW_SHARE = 0.01
#: the share under which Helix's scheduler masks a flow edge (`SchedulerNode.
#: schedule_initialization` of the artifact's global_maxflow/scheduler_core.py: "token
#: throughput <= 0.05 * total used token throughput"), in its simulator and its prototype's host
HELIX_MIN_FLOW_SHARE = 0.05


class MaxFlowRouter(GraphRouter):
    name = "maxflow"

    def __init__(
        self,
        placement: Placement,
        seed: int = 0,
        min_flow_share: float = MIN_FLOW_SHARE,
        spread: bool = True,
        spill: bool = True,
        edges: Iterable[tuple[str, str]] | None = None,
        edge_capacity_tokens_per_s: Mapping[tuple[str, str], float] | None = None,
        node_throughput_tokens_per_s: Mapping[str, float] | None = None,
        node_region: Mapping[str, str] | None = None,
    ) -> None:
        """`spread`: route over the max-entropy flow with the same node throughputs
        (`spread.py`) instead of the solver's flow as given. `spill`: when KV masks every
        flow edge out of a vertex, fall back to valid hops the flow does not use (least
        loaded first) rather than make the request wait. `edges` (existing links) and
        `edge_capacity_tokens_per_s` bound where the spread and the spill may send work;
        `node_throughput_tokens_per_s` lets the spread share a range's flow among all the
        nodes holding it. `node_region` (node -> region; `router_options` passes it for a
        placement with `route_within_regions`): a node whose flow continues inside its
        region does not also send requests to other regions (module doc)."""
        if not placement.flows:
            raise UserError(
                f"{placement.source}: flows: empty; the maxflow router routes over the max-flow "
                "solution (run `helixserve evaluate` to fill the flows)"
            )
        vertices = {COORDINATOR} | {n.name for n in placement.nodes}
        flows: dict[tuple[str, str], float] = {}
        for edge in placement.flows:
            if edge.src not in vertices or edge.dst not in vertices:
                raise UserError(
                    f"{placement.source}: flows: edge {edge.src!r} -> {edge.dst!r} names a node that "
                    f"holds no layers; known: {sorted(vertices)}"
                )
            if edge.tokens_per_s > 0:
                key = (edge.src, edge.dst)
                flows[key] = flows.get(key, 0.0) + edge.tokens_per_s
        if spread:
            flows = spread_flows(
                placement, flows, edges, edge_capacity_tokens_per_s, node_throughput_tokens_per_s
            )
        # Outflow per vertex, to mask edges whose share is negligible.
        outflow: dict[str, float] = {}
        for (src, _), f in flows.items():
            outflow[src] = outflow.get(src, 0.0) + f
        self.weights: dict[str, dict[str, float]] = {}
        for (src, dst), f in flows.items():
            if f >= min_flow_share * outflow[src]:
                self.weights.setdefault(src, {})[dst] = f
        if node_region:
            self._keep_within_regions(node_region)
        self.spill_edges = (
            self._spill_edges(placement, edges, edge_capacity_tokens_per_s) if spill else set()
        )
        super().__init__(
            placement,
            seed=seed,
            edges=[(s, d) for s, out in self.weights.items() for d in out] + [*self.spill_edges],
        )
        self._allow_spill = False
        self.credit: dict[tuple[str, str], float] = {}
        # Candidates seen at each vertex during the current search, for `_commit`.
        self._seen: dict[str, list[str]] = {}
        # (credit key, value before) for each credit the last `_commit` changed, for `take`
        self._undo: list[tuple[tuple[str, str], float | None]] = []

    def _keep_within_regions(self, region: Mapping[str, str]) -> None:
        """Drop a node's cross-region edges where its flow also continues in its region."""
        for src, out in self.weights.items():
            here = region.get(src)
            local = {d: f for d, f in out.items() if region.get(d, here) == here}
            if here is not None and local and len(local) < len(out):
                self.weights[src] = local

    def route(self, req: RequestInfo, state: Mapping[str, NodeState]) -> Route | None:
        # First over the flow alone; spill only when no flow route can admit the request.
        self._seen = {}
        self._allow_spill = False
        found = super().route(req, state)
        if found is None and self.spill_edges:
            self._seen = {}
            self._allow_spill = True
            found = super().route(req, state)
        return found

    def _spill_edges(
        self,
        placement: Placement,
        edges: Iterable[tuple[str, str]] | None,
        capacity: Mapping[tuple[str, str], float] | None,
    ) -> set[tuple[str, str]]:
        """Valid hops outside the flow, over links that could carry the largest edge flow."""
        allowed = set(edges) if edges is not None else None
        biggest = max((f for out in self.weights.values() for f in out.values()), default=0.0)
        ends = {COORDINATOR: 0} | {n.name: n.end_layer for n in placement.nodes}
        out: set[tuple[str, str]] = set()
        for v, end_v in ends.items():
            targets = [n.name for n in placement.nodes if n.start_layer <= end_v < n.end_layer]
            if end_v == placement.num_layers:
                targets.append(COORDINATOR)
            for j in targets:
                if j == v or j in self.weights.get(v, {}):
                    continue
                if allowed is not None and (v, j) not in allowed:
                    continue
                if capacity is not None and capacity.get((v, j), 0.0) < biggest:
                    continue
                out.add((v, j))
        return out

    def _edge_ok(self, src: str, dst: str) -> bool:
        if dst in self.weights.get(src, {}):
            return True
        return self._allow_spill and (src, dst) in self.spill_edges

    def _order(
        self,
        vertex: str,
        layer: int,
        cands: Sequence[str],
        req: RequestInfo,
        state: Mapping[str, NodeState],
    ) -> list[str]:
        w = self.weights.get(vertex, {})
        flow = [j for j in cands if j in w]
        spill = sorted((state[j].active_requests, j) for j in cands if j not in w)
        self._seen[vertex] = flow
        projected = self._projected(vertex, flow, req)
        return sorted(flow, key=lambda j: (-projected[j], j)) + [j for _, j in spill]

    def _commit(self, route: Route, req: RequestInfo, state: Mapping[str, NodeState]) -> None:
        work = float(req.prompt_tokens + req.max_new_tokens)
        undo: list[tuple[tuple[str, str], float | None]] = []
        prev = COORDINATOR
        for j in route.nodes:
            if j in self.weights.get(prev, {}):  # a spilled hop leaves the credits alone
                for c, value in self._projected(prev, self._seen[prev], req).items():
                    undo.append(((prev, c), self.credit.get((prev, c))))
                    self.credit[prev, c] = value
                self.credit[prev, j] -= work
            prev = j
        self._undo = undo

    def take(self, pick: Route, route: Route, req: RequestInfo,
             state: Mapping[str, NodeState]) -> None:
        """Undo the credits `pick` took (the last `_commit`) and credit `route` as if the
        search had chosen it: at each vertex, the admissible flow successors (alive, holding
        the layer, KV room for the request) share the work, the hop taken pays it."""
        self.cancel()
        need = req.promise_tokens
        self._seen = {}
        prev, layer = COORDINATOR, 0
        for h in route.hops:
            self._seen[prev] = [
                j for j in self.weights.get(prev, {})
                if j in self.ranges and self.ranges[j].start_layer <= layer
                < self.ranges[j].end_layer and (s := state.get(j)) is not None and s.alive
                and s.kv_free_tokens >= need
            ]
            if h.name in self.weights.get(prev, {}) and h.name not in self._seen[prev]:
                self._seen[prev].append(h.name)  # taken: it shares the work, whatever the mask
            prev, layer = h.name, h.end_layer
        self._commit(route, req, state)

    def cancel(self) -> None:
        """The route just returned is not taken (the request waits): undo its credits."""
        for key, value in reversed(self._undo):
            if value is None:
                self.credit.pop(key, None)
            else:
                self.credit[key] = value
        self._undo = []

    def flow_excess(self, route: Route) -> float:
        """Work (tokens) that the flow edge of `route` furthest over its flow share has
        already carried beyond that share: max over the route's flow hops of `-credit`, 0
        when none is over (IWRR keeps each credit bounded around 0; a caller that overrode
        the router's picks drives the edges it favoured negative). Read before the last
        `_commit`, the pick of the request being decided, so every candidate is measured
        against the same state; nothing changes. The cache-aware choice weighs it
        (scheduler/prefix.py), so cache stickiness cannot pile work on one route while the
        flow wants it elsewhere."""
        before = dict(self._undo)
        worst = 0.0
        prev = COORDINATOR
        for h in route.hops:
            if h.name in self.weights.get(prev, {}):
                key = (prev, h.name)
                credit = before[key] if key in before else self.credit.get(key)
                worst = max(worst, -(credit or 0.0))
            prev = h.name
        return worst

    def _projected(self, vertex: str, cands: Sequence[str], req: RequestInfo) -> dict[str, float]:
        if not cands:
            return {}
        work = float(req.prompt_tokens + req.max_new_tokens)
        w = self.weights[vertex]
        total = sum(w[c] for c in cands)
        return {c: self.credit.get((vertex, c), 0.0) + work * w[c] / total for c in cands}
