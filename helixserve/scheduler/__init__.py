"""The request router: which nodes run which layers of each request.

Pure and synchronous (no clocks, sockets or threads): the simulator and the live
coordinator call the same code. Policies are chosen by name:

    router = make_router("maxflow", placement, seed=0)
    route = router.route(RequestInfo(...), {name: NodeState(...)})   # None: wait
    ...
    router.on_finish(request_id)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from helixserve.errors import UserError
from helixserve.planner.placement import Placement
from helixserve.scheduler.base import GraphRouter
from helixserve.scheduler.baselines import RandomRouter, ShortestQueueRouter, SwarmRouter
from helixserve.scheduler.maxflow import MaxFlowRouter
from helixserve.scheduler.options import router_options
from helixserve.scheduler.types import Hop, NodeState, RequestInfo, Route, Router

#: routing policies by name; each takes (placement, seed=..., **options)
ROUTERS: dict[str, Callable[..., GraphRouter]] = {
    "maxflow": MaxFlowRouter,
    "random": RandomRouter,
    "shortest-queue": ShortestQueueRouter,
    "swarm": SwarmRouter,
}


def make_router(name: str, placement: Placement, seed: int = 0, **options: Any) -> GraphRouter:
    """A router by policy name; unknown names raise UserError listing the known ones.

    Options: `maxflow` takes `min_flow_share` (default 0.01); the baselines take `edges`
    (the directed (src, dst) pairs that have a link; default: every pair); `swarm` also
    takes `node_throughput_tokens_per_s`. Options a policy does not take are ignored, so a
    caller can pass one set of options to any policy.
    """
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise UserError(
            f"scheduler: unknown routing policy {name!r}; known: {', '.join(ROUTERS)}"
        ) from None
    accepted = inspect.signature(cls).parameters
    kept = {k: v for k, v in options.items() if k in accepted}
    return cls(placement, seed=seed, **kept)


__all__ = [
    "ROUTERS",
    "GraphRouter",
    "Hop",
    "MaxFlowRouter",
    "NodeState",
    "RandomRouter",
    "RequestInfo",
    "Route",
    "Router",
    "ShortestQueueRouter",
    "SwarmRouter",
    "make_router",
    "router_options",
]
