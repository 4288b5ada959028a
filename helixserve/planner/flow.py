"""The flow graph of a placement and its max flow (the cluster's token throughput).

Vertices: the coordinator as source and as sink, and every node that holds layers split
into in/out vertices joined by an edge of capacity T_i(k_i) (`CostModel`); a node whose
range ends at the model's last layer also runs the head (final norm, lm_head, sampling), so
its edge has T_i(k_i) with the head's time per token added (`holds_last_layer`). The MILP
(milp.py) keeps one T_i(k) per size, whatever the position, so it plans without the head;
the local search, `evaluate` and the baselines' scores count it. Edges:
  * coordinator -> i   when start_i = 0            (token ids: TOKEN_ID_BYTES per token)
  * i -> coordinator   when end_i = L              (token ids)
  * i -> j             when end_i = start_j, or with partial inference when
                       start_j <= end_i < end_j (j runs only the tail end_i..end_j)
                                                   (activations: hidden x dtype bytes per token)
A link's capacity in tokens/s is its bandwidth (capped by both NICs) / bytes per token.
With a workload on the cost model (costmodel/workload.py) a unit of flow is one output
token/s of its mix: node capacities are in that unit (`CostModel`), and each output token
moves 1 + r tokens' bytes over an activation link and over the coordinator's link to the
first stage (prompt tokens travel too), one token id back to the coordinator.
Max flow by scipy's Dinic on integer capacities (tokens/s scaled by `_scale`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_flow

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner import clock
from helixserve.planner.placement import Flow, Placement
from helixserve.spec import TOKEN_ID_BYTES, ClusterSpec, ModelSpec
from helixserve.spec.cluster import COORDINATOR


@dataclass
class FlowResult:
    throughput_tokens_per_s: float
    #: per-edge flows, "coordinator" as source and sink; node-internal edges left out
    flows: list[Flow]


class FlowNetwork:
    """Link capacities of a cluster in tokens/s, computed once and reused for many placements."""

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, cost: CostModel) -> None:
        self.cluster = cluster
        self.model = model
        self.cost = cost
        self.names = cluster.node_names()
        self.index = {n: i for i, n in enumerate(self.names)}
        n = len(self.names)
        act = model.activation_bytes_per_token
        # token positions sent per unit of flow: 1 decode-only, 1 + r with a workload
        per_unit = (cost.workload.activation_tokens_per_output_token
                    if cost.workload is not None else 1.0)
        #: node -> node capacity, tokens/s; 0 = no link
        self.link_cap = np.zeros((n, n))
        self.source_cap = np.zeros(n)  # coordinator -> node
        self.sink_cap = np.zeros(n)  # node -> coordinator
        for i, a in enumerate(self.names):
            self.source_cap[i] = (cluster.effective_bandwidth_gbps(COORDINATOR, a) * 1e9 / 8
                                  / (TOKEN_ID_BYTES * per_unit))
            self.sink_cap[i] = (cluster.effective_bandwidth_gbps(a, COORDINATOR) * 1e9 / 8
                                / TOKEN_ID_BYTES)
            for j, b in enumerate(self.names):
                if i != j:
                    self.link_cap[i, j] = (cluster.effective_bandwidth_gbps(a, b) * 1e9 / 8
                                           / (act * per_unit))
        #: most layers a planner gives node i (the weight cap); `loadable` is what it can run
        self.max_layers = np.array([cost.max_layers(nd) for nd in cluster.nodes], dtype=int)
        self.loadable = np.array([cost.loadable_layers(nd) for nd in cluster.nodes], dtype=int)
        #: throughput[i][k] = T_i(k), k = 0..max_layers_i (T_i(0) = 0)
        self.throughput = [
            [0.0] + [cost.node_throughput_tokens_per_s(nd, k) for k in range(1, K + 1)]
            for nd, K in zip(cluster.nodes, self.max_layers, strict=True)
        ]
        #: the same for node i holding the last k layers: the head's time added
        self.throughput_last = [
            [0.0] + [cost.node_throughput_tokens_per_s(nd, k, True) for k in range(1, K + 1)]
            for nd, K in zip(cluster.nodes, self.max_layers, strict=True)
        ]

    def curve(self, i: int) -> tuple[float, ...]:
        """Node i's T(k) for k = 1..max_layers: machines with equal curves are one type to
        the relaxations and the tiling."""
        return tuple(self.node_cap(i, k) for k in range(1, int(self.max_layers[i]) + 1))

    def node_cap(self, i: int, k: int, holds_last_layer: bool = False) -> float:
        """T_i(k); with `holds_last_layer` (the node's k layers end at the model's last) the
        head's time is counted too."""
        if k <= 0 or k > self.loadable[i]:
            return 0.0
        if k > self.max_layers[i]:  # beyond the planners' weight cap (a baseline, a user's file)
            return self.cost.node_throughput_tokens_per_s(self.cluster.nodes[i], k,
                                                          holds_last_layer)
        return (self.throughput_last if holds_last_layer else self.throughput)[i][k]

    def max_flow(
        self,
        ranges: dict[int, tuple[int, int]],
        partial_inference: bool = True,
        with_flows: bool = False,
    ) -> tuple[float, list[Flow]]:
        """Max flow for node index -> [start, end); flows only when `with_flows`."""
        clock.charge_evaluation()
        L = self.model.num_layers
        held = sorted(ranges)
        if not held:
            return 0.0, []
        pos = {i: p for p, i in enumerate(held)}
        src, snk = 0, 1
        rows: list[int] = []
        cols: list[int] = []
        caps: list[float] = []
        node_caps = {i: self.node_cap(i, e - s, e == L) for i, (s, e) in ranges.items()}
        total = sum(node_caps.values())
        if total <= 0:
            return 0.0, []

        def add(u: int, v: int, c: float) -> None:
            if c > 0:
                rows.append(u)
                cols.append(v)
                caps.append(min(c, total))

        for i in held:
            s, e = ranges[i]
            vin, vout = 2 + 2 * pos[i], 3 + 2 * pos[i]
            add(vin, vout, node_caps[i])
            if s == 0:
                add(src, vin, self.source_cap[i])
            if e == L:
                add(vout, snk, self.sink_cap[i])
            for j in held:
                if j == i:
                    continue
                s2, e2 = ranges[j]
                ok = (s2 <= e < e2) if partial_inference else (s2 == e)
                if ok:
                    add(vout, 2 + 2 * pos[j], self.link_cap[i, j])
        if not rows:
            return 0.0, []
        scale = min(1000.0, 2.0e9 / total)
        num_v = 2 + 2 * len(held)
        data = np.floor(np.asarray(caps) * scale).astype(np.int32)
        graph = csr_array((data, (np.asarray(rows), np.asarray(cols))), shape=(num_v, num_v))
        res = maximum_flow(graph, src, snk)
        value = res.flow_value / scale
        if not with_flows:
            return value, []
        flow = res.flow.tocoo()
        names = [COORDINATOR, COORDINATOR]
        for i in held:
            names += [self.names[i], self.names[i]]
        flows: list[Flow] = []
        for u, v, f in zip(flow.row, flow.col, flow.data, strict=True):
            # keep positive flows on real edges; skip node-internal in->out and reverse entries
            if f <= 0 or (u >= 2 and v == u + 1 and u % 2 == 0):
                continue
            if v == src or u == snk:
                continue
            flows.append(Flow(names[u], names[v], float(f) / scale))
        flows.sort(key=lambda fl: (fl.src != COORDINATOR, fl.src, fl.dst))
        return value, flows

    def check_servable(self) -> None:
        """Raise UserError when no placement can serve: no node linked from the coordinator
        or to it, or no chain of linked nodes from the coordinator back to it that can hold
        every layer. A relaxation (a chain may pass a node twice): when it passes, a plan of
        0 tokens/s is still possible, but not a plan of 0 tokens/s the links alone decide."""
        where = f"{self.cluster.source}: links"
        L = self.model.num_layers
        # most layers node i can serve (beyond the weight cap too, as separate's baseline
        # may): T_i(k) falls off as k grows
        cap = np.zeros(len(self.names), dtype=int)
        for i in range(len(cap)):
            k = int(self.loadable[i])
            while k > 0 and self.node_cap(i, k) <= 0:
                k -= 1
            cap[i] = k
        if not np.any((self.source_cap > 0) & (cap > 0)):
            raise UserError(f"{where}: no node that can hold layers has a link from the "
                            f"coordinator (bandwidth 0): no placement can serve")
        if not np.any((self.sink_cap > 0) & (cap > 0)):
            raise UserError(f"{where}: no node that can hold layers has a link to the "
                            f"coordinator (bandwidth 0): no placement can serve")
        # reach[i]: most layers [0, reach) held by a chain from the coordinator ending at i
        reach = np.where((self.source_cap > 0) & (cap > 0), cap, -1)
        linked = (self.link_cap > 0) & (cap[None, :] > 0)
        for _ in range(len(cap) + L + 1):
            via = np.where(linked & (reach[:, None] >= 0), reach[:, None] + cap[None, :], -1)
            new = np.minimum(np.maximum(reach, via.max(axis=0, initial=-1)), L)
            if np.array_equal(new, reach):
                break
            reach = new
        best = int(reach[self.sink_cap > 0].max(initial=0))
        if best < L:
            raise UserError(
                f"{where}: no chain of linked nodes from the coordinator back to it can hold "
                f"all {L} layers (at most {best}, each node as many as its memory loads): no "
                f"placement can serve")

    def node_caps(self, k: np.ndarray) -> np.ndarray:
        """T_i(k_i) for every node (0 where k_i = 0)."""
        return np.array([self.node_cap(i, int(k[i])) for i in range(len(k))])

    def max_flow_value(self, s: np.ndarray, k: np.ndarray, partial_inference: bool = True,
                       caps: np.ndarray | None = None) -> float:
        """Max flow of starts `s` and sizes `k` (k=0: unused), vectorized for local search.
        `caps`: T_i(k_i) of every node (`node_caps`); the nodes ending at the last layer get
        their cap with the head here."""
        clock.charge_evaluation()
        L = self.model.num_layers
        held = np.flatnonzero(k > 0)
        m = len(held)
        if m == 0:
            return 0.0
        node_caps = (caps if caps is not None else self.node_caps(k))[held]
        sh, eh = s[held], s[held] + k[held]
        last = np.flatnonzero(eh == L)
        if len(last):
            node_caps = node_caps.copy()
            node_caps[last] = [self.node_cap(int(held[p]), int(k[held[p]]), True) for p in last]
        total = float(node_caps.sum())
        if total <= 0:
            return 0.0
        if partial_inference:
            valid = (sh[None, :] <= eh[:, None]) & (eh[:, None] < eh[None, :])
        else:
            valid = sh[None, :] == eh[:, None]
        lc = self.link_cap[np.ix_(held, held)]
        valid &= lc > 0
        ii, jj = np.nonzero(valid)
        # vertices: 0 source, 1 sink, 2+p in, 2+m+p out
        src_nodes = np.flatnonzero((sh == 0) & (self.source_cap[held] > 0))
        snk_nodes = np.flatnonzero((eh == L) & (self.sink_cap[held] > 0))
        rows = np.concatenate([2 + np.arange(m), np.zeros(len(src_nodes), dtype=int),
                               2 + m + snk_nodes, 2 + m + ii])
        cols = np.concatenate([2 + m + np.arange(m), 2 + src_nodes,
                               np.ones(len(snk_nodes), dtype=int), 2 + jj])
        caps_all = np.concatenate([node_caps, self.source_cap[held][src_nodes],
                                   self.sink_cap[held][snk_nodes], lc[ii, jj]])
        scale = min(1000.0, 2.0e9 / total)
        data = np.floor(np.minimum(caps_all, total) * scale).astype(np.int32)
        graph = csr_array((data, (rows, cols)), shape=(2 + 2 * m, 2 + 2 * m))
        return maximum_flow(graph, 0, 1).flow_value / scale

    def ranges_of(self, placement: Placement) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for i, r in enumerate(placement.nodes):
            idx = self.index.get(r.name)
            if idx is None:
                more = ", ..." if len(self.names) > 20 else ""
                raise UserError(f"{placement.source}: nodes[{i}].name: node {r.name!r} is not "
                                f"in cluster {self.cluster.name!r}; known: "
                                f"{', '.join(self.names[:20])}{more}")
            out[idx] = (r.start_layer, r.end_layer)
        return out


def evaluate(
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    placement: Placement,
    partial_inference: bool = True,
    network: FlowNetwork | None = None,
) -> FlowResult:
    """Max-flow throughput of `placement` on `cluster`, with the per-edge flows."""
    if placement.num_layers != model.num_layers:
        raise UserError(f"{placement.source}: num_layers: {placement.num_layers} but model "
                        f"{model.name!r} has {model.num_layers}")
    net = network or FlowNetwork(cluster, model, cost)
    ranges = net.ranges_of(placement)
    for k, r in enumerate(placement.nodes):
        i = net.index[r.name]
        if r.num_layers > net.loadable[i]:
            raise UserError(
                f"{placement.source}: nodes[{k}]: node {r.name!r} holds {r.num_layers} layers "
                f"[{r.start_layer}, {r.end_layer}) but its memory fits at most "
                f"{net.loadable[i]} (planners give it at most {net.max_layers[i]}, keeping "
                f"weights within {cost.weight_fraction:.0%} of it)"
            )
    value, flows = net.max_flow(ranges, partial_inference, with_flows=True)
    return FlowResult(value, flows)
