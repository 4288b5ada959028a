"""What the coordinator reports of itself and its workers, typed: `Coordinator.stats()`
returns a `CoordinatorStats`, which `/metrics` (api/metrics.py), `/health` and `/v1/models`
(api/app.py) read. Torch-free and grpc-free, like the API's view of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from helixserve.runtime.node_client import NodeClient


@dataclass
class ProcessStats:
    """A worker process as a local supervisor (demo, serve) sees it."""

    process_up: bool = False
    restarts: int = 0
    last_exit_code: int | None = None


@dataclass
class NodeStats:
    """One worker as the coordinator last saw it (its last Info, or zeros before one)."""

    start_layer: int = 0
    end_layer: int = 0
    #: the coordinator's stream to it is up
    alive: bool = True
    address: str = ""
    #: the placement the coordinator routes over has a range on it
    in_placement: bool = True
    last_down_reason: str = ""
    #: work items waiting in its queue
    queue_len: int = 0
    #: items in its last engine step
    batch_size: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    kv_block_size: int = 0
    #: share of recent wall time spent in engine steps
    busy_fraction: float = 0.0
    #: requests holding KV there
    active_requests: int = 0
    steps: int = 0
    items_run: int = 0
    #: the histogram of tokens per engine step (transport.STEP_TOKEN_BUCKETS, then +Inf)
    step_tokens_counts: list[int] = field(default_factory=list)
    step_tokens_sum: int = 0
    dtype: str = ""
    #: the engine: torch, vllm or emulated
    backend: str = ""
    #: from a local supervisor; None without one
    process: ProcessStats | None = None
    #: prompt tokens of requests routed over it looked up in its prefix cache, and those
    #: found there (the scheduling core's count at admission)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def layers(self) -> int:
        return self.end_layer - self.start_layer


@dataclass
class CoordinatorStats:
    """Requests running and waiting, the workers, the routes taken, faults and re-plans."""

    running: int = 0
    waiting: int = 0
    tokens_generated: int = 0
    #: requests moved to a new route after a failure, since start
    reroutes: int = 0
    #: requests recomputed after a worker ran out of KV (on-demand KV)
    preemptions: int = 0
    kv_allocation: str = ""
    nodes: dict[str, NodeStats] = field(default_factory=dict)
    #: requests admitted per route, its nodes joined by '->'
    routes: dict[str, int] = field(default_factory=dict)
    #: nodes declared down (stream broke, hung, drained)
    down_events: int = 0
    #: the live re-plan's state (runtime/replan.py `Recovery.snapshot()`); None: off
    recovery: dict[str, Any] | None = None
    #: results dropped at arrival, since start: for no request in flight, from a node off
    #: the request's route, a token not from its last stage, a step not awaited
    #: (runtime/results.py)
    dropped_results: int = 0
    #: prompt tokens of admitted requests looked up in the prefix caches, and those taken
    #: from the caches of every hop of their route (once per request, as vLLM counts)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: requests run again because a hop no longer held their cached prefix
    prefix_misses: int = 0


def node_stats(n: NodeClient, in_placement: bool, last_down_reason: str,
               process: ProcessStats | None,
               prefix_cache: tuple[int, int] = (0, 0)) -> NodeStats:
    """One worker's line: what its client knows, and its last Info when it answered one;
    `prefix_cache`: (queried, hit) prompt tokens (SchedulerCore.prefix_stats)."""
    node = NodeStats(start_layer=n.start_layer, end_layer=n.end_layer, alive=n.alive,
                     address=n.address, in_placement=in_placement,
                     last_down_reason=last_down_reason, process=process,
                     prefix_cache_queries=prefix_cache[0], prefix_cache_hits=prefix_cache[1])
    info = n.info
    if info is not None:
        node.queue_len, node.batch_size = info.queue_len, info.last_batch_size
        node.kv_used_blocks, node.kv_total_blocks = info.kv_used_blocks, info.kv_total_blocks
        node.kv_block_size, node.busy_fraction = info.kv_block_size, info.busy_fraction
        node.active_requests, node.steps = info.active_requests, info.steps
        node.items_run, node.step_tokens_sum = info.items_run, info.step_tokens_sum
        node.step_tokens_counts = list(info.step_tokens_counts)
        node.dtype, node.backend = info.dtype, info.backend
    return node
