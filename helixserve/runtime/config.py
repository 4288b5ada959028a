"""The coordinator's settings, one typed object: `Coordinator.create(cluster, placement,
model_dir, CoordinatorConfig(...))`. Torch-free, like the coordinator."""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.errors import UserError
from helixserve.runtime.costs import CostInputs
from helixserve.runtime.replan import RecoveryConfig
from helixserve.spec.scheduling import (
    DEFAULT_KV_WATERMARK,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    KV_ALLOCATIONS,
)


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator routes, admits and waits. `check()` raises UserError naming the
    field and the bad value."""

    scheduler: str = "maxflow"
    """Routing policy by name (`helixserve.scheduler.ROUTERS`)."""
    max_queue: int = 256
    """Requests that may wait for KV room before new ones are refused (QueueFullError)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None = the model's `max_position_embeddings`
    (2048 when config.json has none)."""
    connect_timeout_s: float = 120.0
    """How long `create` waits for each worker to answer its first Info call."""
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    """Most prompt tokens per prefill item; lowered further so one chunk's hidden states
    stay under half the gRPC message limit."""
    stats_interval_s: float = 0.5
    """Period of the poll of every worker's KV and queue state (and of down-node retries)."""
    max_reroutes: int = 3
    """Times a request may be moved to a new route after failures before it fails."""
    step_timeout_s: float = 300.0
    """A step whose result has not come back in this long counts as its node failing."""
    kv_allocation: str = "on-demand"
    """"on-demand" (admit when the prompt fits; preempt by recompute when KV runs out) or
    "reserve" (admit when prompt + max_tokens fit on every hop; never runs out)."""
    kv_watermark: float = DEFAULT_KV_WATERMARK
    """on-demand: fraction of each worker's KV kept free at admission, 0 <= value < 1."""
    recovery: RecoveryConfig | None = None
    """Live re-planning when layers lose their last live worker (runtime/replan.py); None:
    requests fail with NoRouteError while no route covers the model."""
    cost: CostInputs = field(default_factory=CostInputs)
    """The cost model's inputs (runtime/costs.py: measured profiles, GPU catalog, dtype
    bytes): the router's flow and node throughputs and the re-plan use it. Give the planner's
    and simulator's so the live router routes as the simulated one; default: the analytic
    model."""

    def check(self) -> CoordinatorConfig:
        def bad(name: str, value: object, need: str) -> UserError:
            return UserError(f"coordinator: {name}: bad value {value!r}; {need}")

        if self.kv_allocation not in KV_ALLOCATIONS:
            raise bad("kv_allocation", self.kv_allocation, f"known: {', '.join(KV_ALLOCATIONS)}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise bad("kv_watermark", self.kv_watermark, "need 0 <= value < 1")
        if self.max_queue < 0:
            raise bad("max_queue", self.max_queue, "need >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", self.max_model_len, "need >= 2 or None")
        if self.prefill_chunk_tokens < 1:
            raise bad("prefill_chunk_tokens", self.prefill_chunk_tokens, "need >= 1")
        if self.max_reroutes < 0:
            raise bad("max_reroutes", self.max_reroutes, "need >= 0")
        for name in ("connect_timeout_s", "stats_interval_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, getattr(self, name), "need > 0")
        return self
