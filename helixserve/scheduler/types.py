"""Plain data passed between the router and its callers (the simulator, the coordinator).

A `Route` is the pipeline of one request: hops in order, each running layers
`[start_layer, end_layer)` on one node, together covering `[0, num_layers)` exactly once.
A hop may run only the tail of the node's range (partial inference).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from helixserve.planner.placement import NodeRange


@dataclass(frozen=True)
class Route:
    """A request's pipeline: each hop is the node and the layers it runs for this request
    (a `NodeRange`, the same type as a placement's node: a hop may run fewer layers than its
    node holds, with partial inference)."""

    hops: tuple[NodeRange, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hops)

    def covers(self, num_layers: int) -> bool:
        """True when the hops run layers 0..num_layers-1 in order, each exactly once."""
        layer = 0
        for h in self.hops:
            if h.start_layer != layer or h.end_layer <= h.start_layer:
                return False
            layer = h.end_layer
        return layer == num_layers


@dataclass(frozen=True)
class RequestInfo:
    """What the router needs to know of a request."""

    request_id: str
    prompt_tokens: int
    #: tokens the request may still generate (max_tokens, or an expected output length)
    max_new_tokens: int
    #: KV slots to promise on every node of the route at admission; None: the whole
    #: request, prompt_tokens + max_new_tokens. On-demand KV (vLLM's paged allocation, with
    #: preemption when a node runs out) promises the prompt, and the ledger reports the
    #: slots requests grew into through `NodeState.kv_free_tokens` (scheduler/kv.py)
    kv_tokens: int | None = None

    @property
    def promise_tokens(self) -> int:
        """The KV slots admission promises on every node of the route."""
        return self.prompt_tokens + self.max_new_tokens if self.kv_tokens is None \
            else self.kv_tokens


@dataclass
class NodeState:
    """Live state of one node, as the router sees it (from worker stats or the simulator)."""

    name: str
    #: KV cache tokens (per layer held: a token needs one slot per layer) the router may
    #: still promise here: the core's ledger keeps it (scheduler/kv.py: capacity less the
    #: watermark, less growth not covered by promises, less every promise)
    kv_free_tokens: int
    #: work items waiting in the node's queue
    queue_len: int = 0
    alive: bool = True
    #: requests admitted through this node and not yet released
    active_requests: int = 0


class Router(Protocol):
    """A routing policy: pure ordering over the core's view of the nodes (scheduler/core.py
    keeps the KV ledger and which nodes are up); no clocks, sockets or threads."""

    def route(self, req: RequestInfo, state: Mapping[str, NodeState]) -> Route | None:
        """The request's pipeline, or None when no route can admit it now (it waits)."""
        ...

    def accepts(self, route: Route) -> bool:
        """Whether every hop of `route` runs layers its node holds in this placement."""
        ...
