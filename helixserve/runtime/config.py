"""The coordinator's settings, typed objects (`CoordinatorConfig`, and `RecoveryConfig` for live
re-planning): `Coordinator.create(cluster, placement,
model_dir, CoordinatorConfig(...))`. Torch-free, like the coordinator."""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.errors import UserError
from helixserve.runtime.costs import CostInputs
from helixserve.spec.scheduling import (
    DEFAULT_KV_WATERMARK,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    KV_ALLOCATIONS,
)


@dataclass
class RecoveryConfig:
    """How the coordinator recovers from losing workers (runtime/replan.py)."""

    #: planner for the re-plan (a name of planner/registry.py)
    planner: str = "milp"
    #: the re-plan's search time (full re-plan and incremental placement together)
    plan_time_limit_s: float = 5.0
    #: units of work instead (planner/clock.py, `plan --work-limit`): the re-plan is then
    #: the same whatever the machine's load, and `plan_time_limit_s` does not apply; None:
    #: the time limit
    plan_work_limit: float | None = None
    #: one worker's LoadRange (reading its new layers and switching)
    load_timeout_s: float = 600.0
    #: longest a request waits for the model to be covered again (re-plan or restart)
    wait_s: float = 60.0
    #: Retry-After of the 503 a new request gets while no plan can cover the model
    retry_after_s: int = 10
    #: re-plans in a row while layers stay uncovered, before giving up until a worker returns
    max_attempts: int = 3
    #: a worker that comes back or joins while the model is covered: re-plan when that
    #: raises the max flow (the cost model's tokens/s) by at least this share; None: never
    join_min_gain: float | None = 0.25

    def __post_init__(self) -> None:
        if self.join_min_gain is not None and not self.join_min_gain >= 0:
            raise UserError(f"recovery: join_min_gain: bad value {self.join_min_gain}; "
                            "must be >= 0 or None")
        for name in ("plan_time_limit_s", "load_timeout_s", "wait_s"):
            value = getattr(self, name)
            if not value > 0:
                raise UserError(f"recovery: {name}: bad value {value}; must be > 0")
        if self.plan_work_limit is not None and not self.plan_work_limit > 0:
            raise UserError(f"recovery: plan_work_limit: bad value {self.plan_work_limit}; "
                            "must be > 0 or None")


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
    hang_timeout_s: float = 10.0
    """A live worker that lets two Info calls in a row (this long each) pass unanswered is
    declared down (hung), with or without live re-planning; a worker whose engine made no
    progress while work waited answers Info with DEADLINE_EXCEEDED (worker --engine-stall-s)."""
    admission_timeout_s: float = 120.0
    """Longest a request waits for KV room while the model is covered, before it gets
    QueueFullError (the API's 503 with Retry-After)."""
    kv_allocation: str = "on-demand"
    """"on-demand" (admit when the prompt fits; preempt by recompute when KV runs out) or
    "reserve" (admit when prompt + max_tokens fit on every hop; never runs out)."""
    kv_watermark: float = DEFAULT_KV_WATERMARK
    """on-demand: fraction of each worker's KV kept free at admission, 0 <= value < 1."""
    recovery: RecoveryConfig | None = None
    """Live re-planning when layers lose their last live worker (runtime/replan.py); None:
    requests fail with NoRouteError while no route covers the model."""
    prefix_caching: bool = True
    """Reuse the workers' cached prefixes: an admitted request's first tokens that every hop
    of its route holds are not computed again (docs/prefix-caching.md). The workers cache
    either way unless started with --no-prefix-caching."""
    cache_aware_routing: bool = True
    """The router weighs the prefix each route holds against load; False: the plain router's
    pick (still reusing what that route happens to hold)."""
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
        for name in ("connect_timeout_s", "stats_interval_s", "step_timeout_s", "hang_timeout_s",
                     "admission_timeout_s"):
            if not getattr(self, name) > 0:
                raise bad(name, getattr(self, name), "need > 0")
        return self
