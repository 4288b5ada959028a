"""The simulator's settings, one typed object (`SimConfig`); `check()` raises UserError naming
the field and the bad value. Presets of these fields per engine: simulator/presets.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from helixserve.errors import UserError
from helixserve.scheduler.core import SchedulerPolicy
from helixserve.scheduler.kv import KvPolicy
from helixserve.scheduler.maxflow import MIN_FLOW_SHARE
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK

#: values of `SimConfig.offline_feed`
OFFLINE_FEEDS = ("saturate", "kv-feeder", "closed")


def closed_loop(in_flight: int) -> dict[str, Any]:
    """The SimConfig fields of a stated load: `in_flight` requests, each finished one
    replaced by the next (the `closed` offline feed), as `plan --serve-concurrency`,
    `simulate --offline --concurrency` and `rehearse --offline --concurrency` run it."""
    return {"offline_feed": "closed", "feed_initial_requests": in_flight}


@dataclass
class SimConfig:
    #: simulated seconds to run
    duration_s: float = 600.0
    #: keep the cluster saturated (ignore arrival times) instead of replaying arrivals
    offline: bool = False
    #: tokens and latencies are counted from this simulated time on (pipeline fill excluded)
    warmup_s: float = 0.0
    #: routing policy name (helixserve.scheduler.ROUTERS)
    scheduler: str = "maxflow"
    seed: int = 0
    #: time buckets of the throughput and utilisation timelines
    timeline_buckets: int = 100
    #: prompt tokens one iteration of a node may prefill (None: the profile's largest batch);
    #: a smaller budget keeps a big prefill batch from stalling every decode step riding in
    #: the same iteration (vLLM's max_num_batched_tokens); a longer prompt still runs alone
    max_prompt_tokens: int | None = None
    #: "reserve": a request holds prompt + output KV slots on its route from admission;
    #: "on-demand": slots are taken as tokens are generated, preempting (recompute) on a full
    #: node, as vLLM allocates its paged KV cache
    kv_allocation: str = "reserve"
    #: on-demand only: a request is admitted when its prompt leaves this fraction of each
    #: node's KV free (vLLM's watermark, 0.01), so decode growth does not preempt at once
    kv_watermark: float = DEFAULT_KV_WATERMARK
    #: split a prompt longer than what is left of an iteration's prompt budget
    #: (`max_prompt_tokens`) over several iterations of the node (vLLM's chunked prefill);
    #: the request moves on once its whole prompt has run on the node
    chunked_prefill: bool = False
    #: the coordinator splits each prompt into chunks of this many tokens, sent to the first
    #: hop at once; a node passes each chunk on as soon as it has run it, so the chunks
    #: pipeline along the route (the live coordinator's `prefill_chunk_tokens`, and how
    #: pipeline-parallel vLLM moves a chunked prefill between stages). None: the prompt
    #: moves as one piece, to the next hop once it has run whole on a node
    prefill_chunk_tokens: int | None = None
    #: admit no request while this many admitted requests are still in their prefill (no
    #: first token yet); None: no limit. Keeps an admission burst of prompts from queueing
    #: on the nodes and links ahead of the decode steps of requests already running
    max_prefilling: int | None = None
    #: on-demand only: admission promises every request prompt + this many tokens on each node
    #: of its route, whatever it will generate, and keeps each node's promises within
    #: `1 - kv_watermark` of its KV: the KV expectation of Helix's scheduler (its average
    #: output, 240 tokens; high-water mark 0.85). The nodes still hold what the requests
    #: really hold. None: promise the prompt, and the watermark counts the slots grown into
    kv_expected_output_tokens: int | None = None
    #: how an offline run feeds requests: "saturate" keeps the admission queue non-empty;
    #: "kv-feeder" is the Helix artifact's offline feeder and prototype host for its maxflow
    #: scheduler: `feed_initial_requests` sent `feed_interval_s` apart, then one more each
    #: time a request finishes its prompt or its last token while the KV promised on the
    #: busiest layer (summed over the nodes holding it) is at most `feed_kv_fraction` of that
    #: layer's KV; a request fed so that finds no route is dropped (counted), as that host
    #: drops it. "closed": its host for the other schedulers: `feed_initial_requests` sent
    #: `feed_interval_s` apart, then one more each time one finishes (a fixed number in flight)
    offline_feed: str = "saturate"
    feed_initial_requests: int = 20
    feed_interval_s: float = 0.1
    feed_kv_fraction: float = 0.8
    #: maxflow router: route over the max-entropy spread of the flow (True) or the solver's
    #: flow as given (False, as Helix's IWRR does); see helixserve/scheduler/maxflow.py.
    #: The other routing policies have no flow to spread and ignore it
    router_spread: bool = True
    #: maxflow router: when KV masks every flow edge out of a vertex, try the valid hops the
    #: flow does not use (True, helixserve's runtime) or make the request wait (False, as
    #: Helix's scheduler does: it never routes outside its flow)
    router_spill: bool = True
    #: maxflow router: flow edges carrying less than this share of their vertex's outflow
    #: are masked (scheduler/maxflow.py; Helix's scheduler masks under HELIX_MIN_FLOW_SHARE)
    router_min_flow_share: float = MIN_FLOW_SHARE
    #: seconds added to every layer an iteration runs, on top of the profile's time: per-layer
    #: costs a real engine pays that a per-layer profile leaves out (e.g. Helix's prototype
    #: schedules each layer in Python, in eager mode; docs/calibration.md fits it)
    layer_overhead_s: float = 0.0
    #: on-demand only: which request a full node preempts (scheduler/kv.py VICTIM_RULES):
    #: "newest" admitted holding KV there (vLLM), or "requester", the one that needs the slot
    #: (what the live coordinator does)
    victim_rule: str = "newest"
    #: model prefix caching (simulator/prefix.py) for requests whose token ids the trace
    #: gives (e.g. workload.multi_turn); other requests are never cached. False: as without
    prefix_caching: bool = True
    #: the core weighs the prefix each candidate route holds against its load
    #: (scheduler/prefix.py); False: the router's pick, reusing what it happens to hold
    cache_aware: bool = True
    #: the cache-aware cost per token of work a route carried beyond its max-flow share
    #: (SchedulerPolicy.prefix_flow_weight, whose default this is; 0: no flow term)
    prefix_flow_weight: float = SchedulerPolicy.prefix_flow_weight
    #: cache-aware: wait for a busy route holding at least this many more of a prompt's
    #: tokens (SchedulerPolicy.prefix_wait_tokens, whose default this is; 0: never wait)
    prefix_wait_tokens: float = SchedulerPolicy.prefix_wait_tokens
    #: tokens per named block of the simulated prefix caches (the engines' KV block size;
    #: the KV ledger still counts single slots)
    prefix_block_size: int = 16

    def check(self) -> SimConfig:
        """Raise UserError naming the bad field; return self."""
        if self.duration_s <= 0:
            raise UserError(f"--duration: must be > 0 s, got {self.duration_s}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise UserError(
                f"--warmup: must be in [0, duration={self.duration_s}), got {self.warmup_s}")
        for name in ("prefill_chunk_tokens", "max_prompt_tokens", "max_prefilling"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name}: must be >= 1, got {value}")
        if self.prefix_block_size < 1:
            raise UserError(f"prefix_block_size: must be >= 1, got {self.prefix_block_size}")
        if self.layer_overhead_s < 0:
            raise UserError(f"layer_overhead_s: must be >= 0, got {self.layer_overhead_s}")
        if self.offline_feed not in OFFLINE_FEEDS:
            raise UserError(f"offline_feed: {self.offline_feed!r}; known: "
                            f"{', '.join(OFFLINE_FEEDS)}")
        # checked whatever the mode, so a bad value fails at once
        if self.feed_initial_requests < 1 or self.feed_interval_s < 0:
            raise UserError(f"feeder: feed_initial_requests must be >= 1 and feed_interval_s "
                            f">= 0, got {self.feed_initial_requests}, {self.feed_interval_s}")
        if not 0 < self.feed_kv_fraction <= 1:
            raise UserError(f"feed_kv_fraction: must be in (0, 1], got {self.feed_kv_fraction}")
        if not 0 <= self.router_min_flow_share < 1:
            raise UserError(f"router_min_flow_share: must be in [0, 1), got "
                            f"{self.router_min_flow_share}")
        self.scheduler_policy()
        return self

    def scheduler_policy(self) -> SchedulerPolicy:
        """The scheduling core's policy for this run. The simulator's capacities are exact, so
        the ledger decides when a node is full; a request no route holds on an idle cluster
        is rejected (counted), since nothing would ever make room for it."""
        kv = KvPolicy(self.kv_allocation, self.kv_watermark, self.kv_expected_output_tokens,
                      victim_rule=self.victim_rule)
        return SchedulerPolicy(kv=kv, exact_capacities=True, max_prefilling=self.max_prefilling,
                               reject_unroutable_when_idle=True,
                               prefix_caching=self.prefix_caching, cache_aware=self.cache_aware,
                               prefix_flow_weight=self.prefix_flow_weight,
                               prefix_wait_tokens=self.prefix_wait_tokens,
                               prefix_block_size=self.prefix_block_size).check()
