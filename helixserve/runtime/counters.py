"""What the coordinator counts from its start (`CoordinatorCounts`), and the stats snapshot it
makes of them with its live state (`CoordinatorStats`, stats.py), which `/metrics` and
`/health` read. Torch-free and grpc-free, like the coordinator."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from helixserve.runtime.stats import CoordinatorStats, ProcessStats, node_stats

if TYPE_CHECKING:
    from helixserve.planner.placement import Placement
    from helixserve.runtime.node_client import NodeClient


@dataclass
class CoordinatorCounts:
    """The coordinator's counters, since it started."""

    #: tokens sampled, over every request
    tokens_generated: int = 0
    #: requests moved to a new route after a failure
    reroutes: int = 0
    #: nodes declared down (stream broke, hung, drained)
    down_events: int = 0
    #: the last reason each node was declared down for
    down_reasons: dict[str, str] = field(default_factory=dict)
    #: admissions per route (its nodes, in order)
    routes: dict[tuple[str, ...], int] = field(default_factory=dict)
    #: requests run again because a hop no longer held their cached prefix
    prefix_misses: int = 0

    def admitted(self, route: tuple[str, ...]) -> None:
        """A request was admitted on `route` (its prefix-cache lookup is counted by the
        scheduling core, once per request: `SchedulerCore.prefix_totals`)."""
        self.routes[route] = self.routes.get(route, 0) + 1

    def node_down(self, node: str, reason: str) -> None:
        self.down_events += 1
        self.down_reasons[node] = reason

    def snapshot(self, nodes: Mapping[str, NodeClient], placement: Placement,
                 processes: Mapping[str, Mapping[str, Any]],
                 prefix: Mapping[str, tuple[int, int]], prefix_totals: tuple[int, int], *,
                 running: int, waiting: int,
                 preemptions: int, kv_allocation: str, dropped_results: int,
                 recovery: dict[str, Any] | None) -> CoordinatorStats:
        """These counts with the live state: per node its client's view, whether the placement
        has a range on it, its supervisor's `processes` entry and the core's `prefix`
        (queried, hit) tokens; `prefix_totals` the core's (queried, hit) prompt tokens, each
        request counted once as one vLLM server counts; requests running and waiting, and
        the rest as given."""
        per_node = {name: node_stats(n, placement.range_of(name) is not None,
                                     self.down_reasons.get(name, ""),
                                     ProcessStats(**processes[name]) if name in processes
                                     else None,
                                     prefix.get(name, (0, 0)))
                    for name, n in nodes.items()}
        return CoordinatorStats(
            running=running, waiting=waiting, tokens_generated=self.tokens_generated,
            reroutes=self.reroutes, preemptions=preemptions, kv_allocation=kv_allocation,
            nodes=per_node, routes={"->".join(r): c for r, c in self.routes.items()},
            down_events=self.down_events, dropped_results=dropped_results, recovery=recovery,
            prefix_cache_queries=prefix_totals[0], prefix_cache_hits=prefix_totals[1],
            prefix_misses=self.prefix_misses)
