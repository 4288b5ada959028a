"""What a router should know about the cluster, computed once from the specs.

The policies work from the placement alone, but they route better knowing which links
exist (`edges`), what each carries (`edge_capacity_tokens_per_s`, so the maxflow spread and
spill never move work onto a slow cross-region link) and each node's throughput
(`node_throughput_tokens_per_s`, for swarm's weights and maxflow's sharing among replicas).
The simulator passes these; the live coordinator should too:

    router = make_router(name, placement, seed=0, **router_options(cluster, model, placement, cost))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypedDict

from helixserve.costmodel import CostModel
from helixserve.planner.placement import Placement
from helixserve.spec import TOKEN_ID_BYTES, ClusterSpec, ModelSpec
from helixserve.spec.cluster import COORDINATOR


class RouterOptions(TypedDict, total=False):
    """Every option `make_router` takes; each policy uses the ones its constructor names."""

    edges: Iterable[tuple[str, str]]
    """Directed (src, dst) pairs that have a link; absent: every pair."""
    edge_capacity_tokens_per_s: Mapping[tuple[str, str], float]
    """Tokens/s each link carries (token ids on coordinator links, activations between
    nodes), so maxflow's spread and spill never move work onto a slow link."""
    node_throughput_tokens_per_s: Mapping[str, float]
    """Each node's throughput on its layers (swarm's weights, maxflow's sharing of replicas)."""
    node_region: Mapping[str, str]
    """Each node's region, when the placement routes within regions."""
    min_flow_share: float
    """maxflow: flows below this share of the total are not routed over (default 0.01)."""
    spread: bool
    """maxflow: route over the max-entropy flow with the same node throughputs (default on)."""
    spill: bool
    """maxflow: when KV masks every flow edge out of a node, use valid hops the flow does not
    use (least loaded first) rather than make the request wait (default on)."""


#: the options that describe the cluster rather than tune a policy: any policy may be given
#: them (it uses those it needs), so a caller computes them once whatever the policy
CLUSTER_FACTS = frozenset(
    {"edges", "edge_capacity_tokens_per_s", "node_throughput_tokens_per_s", "node_region"}
)


def router_options(
    cluster: ClusterSpec,
    model: ModelSpec,
    placement: Placement,
    cost: CostModel | None = None,
) -> RouterOptions:
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
    out = RouterOptions(edges=edges, edge_capacity_tokens_per_s=capacity)
    if placement.route_within_regions:
        out["node_region"] = {n.name: cluster.node(n.name).region for n in placement.nodes}
    if cost is not None:
        out["node_throughput_tokens_per_s"] = {
            n.name: cost.node_throughput_tokens_per_s(cluster.node(n.name), n.num_layers,
                                                      n.end_layer == placement.num_layers)
            for n in placement.nodes
        }
    return out
