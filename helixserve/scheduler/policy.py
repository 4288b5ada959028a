"""Every choice the scheduling core makes by policy, in one place (`SchedulerPolicy`); the
simulator and the live coordinator each fill it (docs/scheduler.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from helixserve.errors import UserError
from helixserve.scheduler.kv import KvPolicy


@dataclass(frozen=True)
class SchedulerPolicy:
    """Every scheduling choice, in one place. `check()` raises UserError naming the field."""

    #: how requests take KV, who is preempted (the victim rule), block slack
    kv: KvPolicy = field(default_factory=KvPolicy)
    #: True: the ledger's capacities are exact and decide when a node is full, the core
    #: preempts by the victim rule as tokens arrive (the simulator). False: they are worker
    #: reports that may change under running requests; a worker says when it is full
    #: (`kv_full`) and the ledger only counts (the coordinator)
    exact_capacities: bool = True
    #: requests that may wait for admission; a new one beyond it is refused (None: no bound)
    max_queue: int | None = None
    #: admit no request while this many admitted ones still prefill (None: no cap)
    max_prefilling: int | None = None
    #: at arrival, refuse a request whose prompt + output could not fit on the roomiest
    #: route even on an idle cluster (it would block the queue forever)
    refuse_never_fits: bool = True
    #: when the head finds no route while nothing is running, reject it instead of waiting
    #: (the simulator: capacities never change; the coordinator waits for worker reports)
    reject_unroutable_when_idle: bool = False
    #: a preempted request waits for the next admission point instead of being offered at
    #: once (vLLM: it goes back to the waiting queue, scheduled at the next step)
    preempted_wait: bool = True
    #: re-routes after faults a request may take before it fails (None: no limit)
    max_reroutes: int | None = None
    #: longest prompt + output in tokens (None: unbounded); caps what a request is promised
    max_model_len: int | None = None
    #: compute, for a request whose tokens are known (`CoreRequest.token_ids`), the leading
    #: tokens every hop of its route holds in its prefix cache (`Admission.cached_tokens`);
    #: False: no prefix caching, every admission computes its whole prompt
    prefix_caching: bool = True
    #: choose among candidate routes by the prefix each would reuse, weighed against load
    #: (scheduler/prefix.py); False: the router's pick, reusing what it happens to hold
    cache_aware: bool = True
    #: cache-aware cost of each prompt token a route would compute (not in its cache)
    prefix_prefill_weight: float = 1.0
    #: cache-aware cost, in prompt tokens, of each request queued or running on the
    #: route's busiest hop: a route with k more requests there must save k times this many
    #: tokens more to be chosen (with the default weights)
    prefix_load_weight_tokens: float = 64.0
    #: cache-aware cost of each token of work (prompt + output) a route would carry beyond
    #: its flow share (maxflow's IWRR credits; routers without flow shares: no term): a
    #: route saving S prompt tokens stays chosen until it is S / this many tokens of work
    #: over its share, then the flow sends requests elsewhere (scheduler/prefix.py)
    prefix_flow_weight: float = 0.25
    #: cache-aware: a request waits at the head of the queue, rather than be admitted on
    #: another route, while a recent route that would take at least this many more of its
    #: prompt tokens from cache is short of KV only because of requests running there (it
    #: is admitted there when one ends); 0: never waits (scheduler/prefix.py "Waiting")
    prefix_wait_tokens: float = 1024.0
    #: distinct recent routes kept as cache-aware candidates besides the router's pick
    prefix_recent_routes: int = 32
    #: tokens per named block (helixserve/prefix.py); None: the engines' KV block size
    #: (`set_block_size`). The simulator, which counts KV in single slots, sets its own
    prefix_block_size: int | None = None

    def check(self) -> SchedulerPolicy:
        self.kv.check()
        for name in ("max_queue", "max_prefilling", "max_reroutes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"scheduler: {name}: must be >= 0 or None, got {value}")
        if self.max_prefilling == 0:
            raise UserError("scheduler: max_prefilling: must be >= 1 or None, got 0")
        for name in ("prefix_prefill_weight", "prefix_load_weight_tokens",
                     "prefix_flow_weight", "prefix_wait_tokens", "prefix_recent_routes"):
            if getattr(self, name) < 0:
                raise UserError(f"scheduler: {name}: must be >= 0, got {getattr(self, name)}")
        if self.prefix_block_size is not None and self.prefix_block_size < 1:
            raise UserError(f"scheduler: prefix_block_size: must be >= 1 or None, got "
                            f"{self.prefix_block_size}")
        return self
