"""Offline runs (`SimConfig.offline`): where their requests come from and when they enter.

The trace's requests, cycled (`workload.offline_stream`), enter by `SimConfig.offline_feed`:
- "saturate": whenever the admission queue drains, the next one arrives: the cluster stays
  saturated and the run measures its maximum throughput;
- "kv-feeder", as the Helix artifact's offline feeder and its prototype's host do for their
  maxflow scheduler: `feed_initial_requests` requests `feed_interval_s` apart, then one more
  at each first token and each finish while the KV promised on the busiest layer is at most
  `feed_kv_fraction` of the KV held there (`bottleneck_kv_usage`);
- "closed", as that host does for the other schedulers: the initial requests, then one more
  each time one finishes (a fixed number in flight).
The simulation carries a feed out (`Simulation._feed`): an initial request, and any fed while
others wait, queues like an arrival; one fed on a first token or a finish is dropped when no
route takes it at once, as Helix's host drops it (counted in `dropped`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from helixserve.simulator.config import SimConfig
from helixserve.simulator.nodes import SimNode
from helixserve.simulator.workload import TraceRequest, offline_stream

#: the distinct sets of nodes that hold a layer, each with their KV capacities summed (tokens)
LayerGroups = list[tuple[tuple[SimNode, ...], int]]


class OfflineFeed:
    """An offline run's source of requests and its feeder's rule (module doc)."""

    def __init__(self, config: SimConfig, requests: list[TraceRequest],
                 nodes: Iterable[SimNode], num_layers: int) -> None:
        self.cfg = config
        self.mode = config.offline_feed
        #: (prompt, output) lengths of the next request: the trace's, cycled
        self.stream = offline_stream(requests)
        #: the feeder's per-layer KV usage is over these (`layer_groups`)
        self.layer_groups = layer_groups(nodes, num_layers)
        #: requests fed on a first token or a finish that no route took at once
        self.dropped = 0

    @property
    def saturate(self) -> bool:
        """The queue is kept non-empty (no feeder)."""
        return self.mode == "saturate"

    def next_lengths(self) -> tuple[int, int]:
        return next(self.stream)

    def initial_times_s(self) -> list[float]:
        """When the feeder sends its initial requests."""
        return [(i + 1) * self.cfg.feed_interval_s for i in range(self.cfg.feed_initial_requests)]

    def after_tokens(self, triggers: int, finished: int, feed: Callable[[bool], None]) -> None:
        """The coordinator handled a batch of tokens with `triggers` first tokens and finishes,
        `finished` of them finishes: `feed(initial)` as often as the feeder's rule says."""
        if self.mode == "kv-feeder":
            for _ in range(triggers):
                if bottleneck_kv_usage(self.layer_groups) <= self.cfg.feed_kv_fraction:
                    feed(False)
        elif self.mode == "closed":  # one new request for each one finished
            for _ in range(finished):
                feed(True)


def layer_groups(nodes: Iterable[SimNode], num_layers: int) -> LayerGroups:
    """The distinct sets of nodes that hold a layer, each with their KV capacities summed (in
    tokens): the feeder's per-layer usage, as Helix's KVExpectation.bottleneck_usage counts it."""
    nodes = list(nodes)
    groups = {
        tuple(n for n in nodes if n.start <= layer < n.end)
        for layer in range(num_layers)
    }
    return [(g, sum(n.kv_cap for n in g)) for g in groups if g]


def bottleneck_kv_usage(groups: LayerGroups) -> float:
    """KV promised over KV held, on the layer where that is highest. A node's promises are
    spread evenly over its layers (a request entering mid-range counts the layers it runs),
    as Helix's `KVExpectation.bottleneck_usage` does."""
    return max(
        sum(n.kv.promised_token_layers / (n.end - n.start) for n in g) / total
        if total else 1.0
        for g, total in groups
    )
