"""What the coordinator reports of itself and its workers, typed: `Coordinator.stats()`
returns a `CoordinatorStats`, which `/metrics` (api/metrics.py), `/health` and `/v1/models`
(api/app.py) read. Torch-free and grpc-free, like the API's view of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
