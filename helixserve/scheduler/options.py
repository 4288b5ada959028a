"""What a router should know about the cluster, computed once from the specs.

The policies work from the placement alone, but they route better knowing which links
exist (`edges`), what each carries (`edge_capacity_tokens_per_s`, so the maxflow spread and
spill never move work onto a slow cross-region link) and each node's throughput
(`node_throughput_tokens_per_s`, for swarm's weights and maxflow's sharing among replicas).
The simulator passes these; the live coordinator should too:

    router = make_router(name, placement, seed=0, **router_options(cluster, model, placement, cost))
"""

from __future__ import annotations

from typing import Any

from helixserve.costmodel import CostModel
from helixserve.planner.placement import COORDINATOR, Placement
from helixserve.spec import ClusterSpec, ModelSpec

#: bytes of one token id on a coordinator link (int32), as in the planner's flow graph
TOKEN_ID_BYTES = 4


def router_options(
    cluster: ClusterSpec,
    model: ModelSpec,
    placement: Placement,
    cost: CostModel | None = None,
) -> dict[str, Any]:
    """`edges`, `edge_capacity_tokens_per_s` and (with a cost model)
    `node_throughput_tokens_per_s` for `make_router`."""
    names = [COORDINATOR, *(n.name for n in placement.nodes)]
    edges = [(a, b) for a in names for b in names if a != b and cluster.link(a, b)]
    # tokens/s a link carries (NICs included): token ids to and from the coordinator,
    # activations between nodes
    capacity = {
        (a, b): cluster.effective_bandwidth_gbps(a, b) * 1e9 / 8
        / (TOKEN_ID_BYTES if COORDINATOR in (a, b) else model.activation_bytes_per_token)
        for a, b in edges
    }  # fmt: skip
    out: dict[str, Any] = {"edges": edges, "edge_capacity_tokens_per_s": capacity}
    if placement.route_within_regions:
        out["node_region"] = {n.name: cluster.node(n.name).region for n in placement.nodes}
    if cost is not None:
        out["node_throughput_tokens_per_s"] = {
            n.name: cost.node_throughput_tokens_per_s(cluster.node(n.name), n.num_layers)
            for n in placement.nodes
        }
    return out
