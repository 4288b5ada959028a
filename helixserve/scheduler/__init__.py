"""The scheduling core (docs/scheduler.md): the request router (which nodes run which layers
of each request; this package's top level), the KV ledger and victim rule (`kv.py`), batch
formation (`batch.py`) and the admission queue (`queue.py`); constants in spec/scheduling.py.

Pure and synchronous (no clocks, sockets or threads): the simulator and the live
coordinator and workers call the same code. Routing policies are chosen by name:

    router = make_router("maxflow", placement, seed=0)
    route = router.route(RequestInfo(...), {name: NodeState(...)})   # None: wait
    ...
    router.on_finish(request_id)
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from helixserve.errors import UserError

if TYPE_CHECKING:  # the real names for type checkers; at run time see __getattr__
    from helixserve.planner.placement import Placement
    from helixserve.scheduler.base import GraphRouter
    from helixserve.scheduler.baselines import RandomRouter, ShortestQueueRouter, SwarmRouter
    from helixserve.scheduler.maxflow import MaxFlowRouter
    from helixserve.scheduler.options import CLUSTER_FACTS, RouterOptions, router_options
    from helixserve.scheduler.types import NodeState, RequestInfo, Route, Router

    ROUTERS: dict[str, Callable[..., GraphRouter]]

#: public name -> submodule that defines it. Loaded when first used, so that importing one
#: submodule (`batch`, `queue`, `kv`: what a worker needs) does not import the routers,
#: numpy (`spread`) or the cost model (`options`).
_EXPORTS = {
    "GraphRouter": "base",
    "RandomRouter": "baselines",
    "ShortestQueueRouter": "baselines",
    "SwarmRouter": "baselines",
    "MaxFlowRouter": "maxflow",
    "CLUSTER_FACTS": "options",
    "RouterOptions": "options",
    "router_options": "options",
    "NodeState": "types",
    "RequestInfo": "types",
    "Route": "types",
    "Router": "types",
}


def _routers() -> dict[str, Callable[..., GraphRouter]]:
    """Routing policies by name; each takes (placement, seed=..., **options)."""
    from helixserve.scheduler.baselines import RandomRouter, ShortestQueueRouter, SwarmRouter
    from helixserve.scheduler.maxflow import MaxFlowRouter

    return {
        "maxflow": MaxFlowRouter,
        "random": RandomRouter,
        "shortest-queue": ShortestQueueRouter,
        "swarm": SwarmRouter,
    }


def __getattr__(name: str) -> Any:
    if name == "ROUTERS":
        value: Any = _routers()
    else:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'helixserve.scheduler' has no attribute {name!r}")
        value = getattr(importlib.import_module(f"helixserve.scheduler.{module}"), name)
    globals()[name] = value
    return value


def make_router(name: str, placement: Placement, seed: int = 0, **options: Any) -> GraphRouter:
    """A router by policy name; unknown names raise UserError listing the known ones.

    Options are the fields of `RouterOptions`. The cluster facts (`CLUSTER_FACTS`: links,
    their capacities, node throughputs and regions, as `router_options` computes them) may be
    passed to any policy, which uses those it needs, so a caller can describe the cluster once
    whatever the policy. A policy's tuning knobs (`min_flow_share`, `spread`, `spill` of
    `maxflow`) are refused by a policy that does not take them, and a name that is no option
    at all is refused: a misspelt option must not be silently dropped.
    """
    from helixserve.scheduler.options import CLUSTER_FACTS, RouterOptions

    # the module's table (once loaded, the same dict: a caller may have added a policy)
    routers: dict[str, Callable[..., GraphRouter]] = (globals().get("ROUTERS")
                                                      or __getattr__("ROUTERS"))
    try:
        cls = routers[name]
    except KeyError:
        raise UserError(
            f"scheduler: unknown routing policy {name!r}; known: {', '.join(routers)}"
        ) from None
    accepted = set(inspect.signature(cls).parameters) - {"placement", "seed"}
    known = set(RouterOptions.__annotations__)
    for key in options:
        if key not in known:
            raise UserError(f"scheduler: unknown router option {key!r}; known: "
                            f"{', '.join(sorted(known))}")
        if key not in accepted and key not in CLUSTER_FACTS:
            raise UserError(f"scheduler: routing policy {name!r} does not take option {key!r}; "
                            f"it takes: {', '.join(sorted(accepted))}")
    kept = {k: v for k, v in options.items() if k in accepted}
    return cls(placement, seed=seed, **kept)


__all__ = [
    "CLUSTER_FACTS",
    "ROUTERS",
    "GraphRouter",
    "MaxFlowRouter",
    "NodeState",
    "RandomRouter",
    "RequestInfo",
    "Route",
    "Router",
    "RouterOptions",
    "ShortestQueueRouter",
    "SwarmRouter",
    "make_router",
    "router_options",
]
