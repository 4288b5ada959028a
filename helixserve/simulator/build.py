"""A simulation's parts, built from its inputs: one `SimNode` per range of the placement, with
what one of its iterations may take and whether routes may enter it mid-range, and the
router `SimConfig.scheduler` names, told the cluster's facts (`router_options`)."""

from __future__ import annotations

from typing import Any

from helixserve.costmodel import CostModel
from helixserve.planner.placement import Placement
from helixserve.scheduler import make_router
from helixserve.scheduler.base import GraphRouter
from helixserve.scheduler.batch import StepBudget
from helixserve.scheduler.options import router_options
from helixserve.simulator.config import SimConfig
from helixserve.simulator.nodes import SimNode
from helixserve.spec import ClusterSpec, ModelSpec


def placement_nodes(cluster: ClusterSpec, placement: Placement, cost: CostModel,
                    config: SimConfig, buckets: int) -> dict[str, SimNode]:
    """A node per placement range, by name, in the placement's order."""
    nodes: dict[str, SimNode] = {}
    for r in placement.nodes:
        nodes[r.name] = SimNode(
            cluster.node(r.name), r.start_layer, r.end_layer, cost, buckets
        )
    for n in nodes.values():
        if config.max_prompt_tokens is not None:
            n.max_prompt = min(n.max_prompt, config.max_prompt_tokens)
        n.budget = StepBudget(n.max_decode, n.max_prompt, config.chunked_prefill)
        n.may_partial = any(n.start < i.end < n.end for i in nodes.values())
    return nodes


def config_router(config: SimConfig, cluster: ClusterSpec, model: ModelSpec,
                  placement: Placement, cost: CostModel) -> GraphRouter:
    """The router of `config.scheduler` over `placement`, seeded by `config.seed`."""
    # the spread, the spill and the share masked are the maxflow policy's knobs; the other
    # policies route without a flow
    knobs: dict[str, Any] = {}
    if config.scheduler == "maxflow":
        knobs = {"spread": config.router_spread, "spill": config.router_spill,
                 "min_flow_share": config.router_min_flow_share}
    return make_router(
        config.scheduler,
        placement,
        seed=config.seed,
        **knobs,
        **router_options(cluster, model, placement, cost),
    )
