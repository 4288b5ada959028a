"""Discrete-event simulation of a placement serving a request stream with a router.

Model (one event heap, `heapq`, ordered by time then insertion). Every scheduling decision
is the scheduling core's (docs/scheduler.md), the code the live coordinator and workers
call: the admission order (`scheduler/queue.py`), the route (`scheduler`'s routers), KV
held, promised and grown and the preemption victim (`scheduler/kv.py`), and each node
iteration's batch (`scheduler/batch.py`); this module only moves time, links and events.
- Admission: an arriving request joins a FIFO queue; the head is routed by the router;
  when no route can admit it, it waits until a request finishes (head-of-line, so nothing
  starves). A request no route could hold even on an idle cluster is rejected and counted.
- KV cache (`SimConfig.kv_allocation`): with "reserve" (the default) every node of the route
  allocates `prompt + output` tokens on admission (one slot per layer it runs; vLLM's block
  table is shared by the layers), freed at finish; the router is told each node's capacity
  and tracks its own promises. With "on-demand" (vLLM's paged allocation) admission needs
  only the prompt's slots (plus a watermark) and every generated token takes one more slot
  on each node of the route; when a node is full, a request holding KV there (the most
  recently admitted: `SimConfig.victim_rule`) is preempted by recompute (its KV freed everywhere, it goes back to the
  head of the admission queue and later prefills its prompt plus the tokens it generated),
  as vLLM's scheduler does. Either way the simulator asserts the allocation never exceeds
  the capacity.
- Nodes run continuous batching: when idle with work queued, an iteration takes the decode
  steps queued (up to `max_decode` sequences) and prompts in FIFO order (up to `max_prompt`
  tokens; one longer prompt runs alone) and lasts the cost model's time for that mixed batch.
  Requests whose route enters the node mid-range (partial inference) run fewer layers, so
  the time is summed over layer segments: segment `[s_k, s_k+1)` runs every request that
  starts at or before `s_k` (the cost model is per-layer additive).
- The head: an iteration of a node whose range ends at the model's last layer also runs the
  final norm, lm_head and sampler once, on one row per sequence sampled (every decode step,
  and each prompt whose last chunk ran), as the worker does (engine/shard.py); its time is
  the cost model's `head_ms` for those rows (docs/calibration.md "The head").
- Links carry a finished batch's requests to their next hop as one transfer: activations
  (`tokens x activation_bytes_per_token`) between nodes, token ids (4 bytes each) to and
  from the coordinator; links and NICs are modelled in `network.py`.
- The coordinator takes no time: it counts the token, finishes the request or sends the
  next decode step to the route's first node.
- Offline mode keeps the admission queue non-empty (the next trace request, cycled, arrives
  whenever the queue drains): the cluster stays saturated and the run measures its maximum
  throughput. With `offline_feed="kv-feeder"` or `"closed"` requests enter as the Helix
  artifact's offline feeders and its prototype's host send them (`SimConfig.feed_*`).
- KV expectation (`kv_expected_output_tokens`, Helix's scheduler): admission promises each
  request prompt + a fixed expected output on every node of its route and keeps the promises
  within `1 - kv_watermark` of each node's KV; the nodes still allocate on demand what the
  requests really hold (preempting when that runs out).
- `layer_overhead_s` adds a fixed time to every layer an iteration runs (costs of a real
  engine that a per-layer profile leaves out). docs/calibration.md says which of these model
  Helix's prototype (`--engine helix-prototype`) and how much each changes.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner.placement import Placement
from helixserve.scheduler import NodeState, make_router
from helixserve.scheduler.batch import StepBudget, plan_step
from helixserve.scheduler.core import (
    Admission,
    CoreRequest,
    NeverFitsError,
    Preempted,
    SchedulerCore,
    SchedulerPolicy,
)
from helixserve.scheduler.kv import KvPolicy, NodeKv
from helixserve.scheduler.options import router_options
from helixserve.simulator.network import Network, SimLink
from helixserve.simulator.workload import TraceRequest, offline_stream
from helixserve.spec import TOKEN_ID_BYTES, ClusterSpec, ModelSpec, NodeSpec
from helixserve.spec.cluster import COORDINATOR
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK

_ARRIVE, _DONE, _DELIVER, _FEED = 0, 1, 2, 3
#: values of `SimConfig.offline_feed`
OFFLINE_FEEDS = ("saturate", "kv-feeder", "closed")


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
    #: seconds added to every layer an iteration runs, on top of the profile's time: per-layer
    #: costs a real engine pays that a per-layer profile leaves out (e.g. Helix's prototype
    #: schedules each layer in Python, in eager mode; docs/calibration.md fits it)
    layer_overhead_s: float = 0.0
    #: on-demand only: which request a full node preempts (scheduler/kv.py VICTIM_RULES):
    #: "newest" admitted holding KV there (vLLM), or "requester", the one that needs the slot
    #: (what the live coordinator does)
    victim_rule: str = "newest"


class SimRequest:
    __slots__ = (
        "rid", "arrival_s", "prompt", "output", "nodes", "starts", "hop", "in_prompt",
        "generated", "admit_s", "first_s", "finish_s", "dead", "resumed", "left", "chunk", "replayed",
    )  # fmt: skip

    def __init__(self, rid: str, arrival_s: float, prompt: int, output: int) -> None:
        self.rid = rid
        self.arrival_s = arrival_s
        self.prompt = prompt
        self.output = output
        self.nodes: tuple[SimNode, ...] = ()
        self.starts: tuple[int, ...] = ()  # first layer each hop runs
        self.hop = 0
        self.in_prompt = True
        self.generated = 0
        self.admit_s = math.nan
        self.first_s = math.nan
        self.finish_s = math.nan
        self.dead = False  # preempted: its pending events are dropped
        self.resumed = False  # re-admitted after a preemption: `prompt` includes its output
        self.left = 0  # prompt tokens still to prefill on the current hop
        self.replayed = 0  # generated tokens included in `prompt` (a resumed request)
        self.chunk = 0  # prompt tokens of the current hop in the running iteration


class _Chunk:
    """One piece of a request's prompt moving along its route on its own
    (`SimConfig.prefill_chunk_tokens`): queued, run and sent on like a prompt of `prompt`
    tokens; the last one, back at the coordinator, is the request's first token."""

    __slots__ = ("req", "prompt", "left", "chunk", "hop", "last")

    def __init__(self, req: SimRequest, tokens: int, last: bool) -> None:
        self.req = req
        self.prompt = tokens
        self.left = tokens
        self.chunk = 0
        self.hop = 0
        self.last = last

    @property
    def dead(self) -> bool:
        return self.req.dead

    @property
    def nodes(self) -> tuple[SimNode, ...]:
        return self.req.nodes

    @property
    def starts(self) -> tuple[int, ...]:
        return self.req.starts


def _chunks(r: SimRequest, size: int) -> list[_Chunk]:
    return [_Chunk(r, min(size, r.prompt - at), at + size >= r.prompt)
            for at in range(0, r.prompt, size)]


def _prompt_left(r: SimRequest) -> int:
    return r.left


def _dead(r: SimRequest) -> bool:
    return r.dead


class SimNode:
    __slots__ = (
        "name", "spec", "start", "end", "may_partial", "pq", "dq", "busy", "max_prompt",
        "max_decode", "kv_cap", "busy_s", "iters", "decode_iters", "prompt_iters",
        "prompt_tokens", "decode_tokens", "busy_timeline", "kv", "budget", "has_head",
    )  # fmt: skip

    def __init__(self, spec: NodeSpec, start: int, end: int, cost: CostModel, buckets: int):
        self.name = spec.name
        self.spec = spec
        self.start, self.end = start, end
        self.may_partial = False  # some route may enter mid-range
        #: the range ends at the model's last layer: every iteration runs the head too
        self.has_head = end == cost.model.num_layers
        self.pq: deque[SimRequest] = deque()  # prompts waiting
        self.dq: list[SimRequest] = []  # decode steps waiting
        self.busy = False
        self.max_prompt, self.max_decode = cost.batch_limits(spec)
        self.kv_cap = cost.kv_capacity_tokens(spec, end - start)
        #: what one iteration may take (scheduler/batch.py), set by Simulation
        self.budget: StepBudget
        #: this node's account in the run's KvBook (scheduler/kv.py), set by Simulation
        self.kv: NodeKv
        self.busy_s = 0.0
        self.iters = self.decode_iters = self.prompt_iters = 0
        self.prompt_tokens = self.decode_tokens = 0
        self.busy_timeline = [0.0] * buckets

    # read-only views of the node's KV account (metrics, tests)
    @property
    def kv_used(self) -> int:
        return self.kv.used_tokens

    @property
    def kv_peak(self) -> int:
        return self.kv.peak_tokens

    @property
    def kv_area(self) -> float:
        return self.kv.area_token_s

    @property
    def kv_grown(self) -> int:
        return self.kv.grown_tokens

    @property
    def preempted(self) -> int:
        return self.kv.preempted

    @property
    def kv_promised(self) -> int:
        return self.kv.promised_tokens

    @property
    def kv_promised_layers(self) -> int:
        return self.kv.promised_token_layers

    @property
    def kv_mark(self) -> int:
        return self.kv.watermark_tokens

    @property
    def state(self) -> NodeState:
        """The router's view of this node."""
        return self.kv.state


@dataclass
class SimResult:
    """Raw outcome of a run; `helixserve.simulator.metrics.summarize` turns it into JSON."""

    config: SimConfig
    placement: Placement
    nodes: list[SimNode]
    links: list[SimLink]
    finished: list[SimRequest]
    in_flight: int
    waiting: int
    rejected: int
    arrived: int
    decode_tokens: int
    prompt_tokens: int
    #: decode tokens per timeline bucket
    token_timeline: list[int]
    bucket_s: float
    end_s: float
    events: int
    wall_s: float
    max_flow_tokens_per_s: float | None = None
    extra: dict[str, object] = field(default_factory=dict)


class Simulation:
    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        cost: CostModel,
        placement: Placement,
        requests: list[TraceRequest],
        config: SimConfig,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if config.duration_s <= 0:
            raise UserError(f"--duration: must be > 0 s, got {config.duration_s}")
        if not 0 <= config.warmup_s < config.duration_s:
            raise UserError(
                f"--warmup: must be in [0, duration={config.duration_s}), got {config.warmup_s}"
            )
        if placement.num_layers != model.num_layers:
            raise UserError(
                f"{placement.source}: num_layers: {placement.num_layers} but model {model.name!r} "
                f"has {model.num_layers}"
            )
        self.cluster, self.model, self.cost, self.cfg = cluster, model, cost, config
        self.placement = placement
        self.progress = progress
        self.buckets = max(1, config.timeline_buckets)
        self.bucket_s = config.duration_s / self.buckets
        self.nodes: dict[str, SimNode] = {}
        for r in placement.nodes:
            self.nodes[r.name] = SimNode(
                cluster.node(r.name), r.start_layer, r.end_layer, cost, self.buckets
            )
        kv_policy = KvPolicy(config.kv_allocation, config.kv_watermark,
                             config.kv_expected_output_tokens,
                             victim_rule=config.victim_rule).check()
        self.on_demand = kv_policy.on_demand
        if config.prefill_chunk_tokens is not None and config.prefill_chunk_tokens < 1:
            raise UserError(f"prefill_chunk_tokens: must be >= 1, got "
                            f"{config.prefill_chunk_tokens}")
        if config.max_prompt_tokens is not None:
            if config.max_prompt_tokens < 1:
                raise UserError(f"max_prompt_tokens: must be >= 1, got "
                                f"{config.max_prompt_tokens}")
            for n in self.nodes.values():
                n.max_prompt = min(n.max_prompt, config.max_prompt_tokens)
        for n in self.nodes.values():
            n.budget = StepBudget(n.max_decode, n.max_prompt, config.chunked_prefill)
        for j in self.nodes.values():
            j.may_partial = any(j.start < i.end < j.end for i in self.nodes.values())
        if config.layer_overhead_s < 0:
            raise UserError(f"layer_overhead_s: must be >= 0, got {config.layer_overhead_s}")
        if config.offline_feed not in OFFLINE_FEEDS:
            raise UserError(f"offline_feed: {config.offline_feed!r}; known: "
                            f"{', '.join(OFFLINE_FEEDS)}")
        self.feeder = config.offline and config.offline_feed != "saturate"
        self.kv_feeder = config.offline and config.offline_feed == "kv-feeder"
        # checked whatever the mode, so a bad value fails at once
        if config.feed_initial_requests < 1 or config.feed_interval_s < 0:
            raise UserError(f"feeder: feed_initial_requests must be >= 1 and feed_interval_s "
                            f">= 0, got {config.feed_initial_requests}, {config.feed_interval_s}")
        if not 0 < config.feed_kv_fraction <= 1:
            raise UserError(f"feed_kv_fraction: must be in (0, 1], got {config.feed_kv_fraction}")
        #: the distinct sets of nodes that hold a layer, with their KV summed (the feeder's
        #: per-layer usage, as Helix's KVExpectation.bottleneck_usage computes it)
        groups = {
            tuple(n for n in self.nodes.values() if n.start <= layer < n.end)
            for layer in range(placement.num_layers)
        }
        self.layer_groups = [(g, sum(n.kv_cap for n in g)) for g in groups if g]
        self.feed_dropped = 0
        names = [COORDINATOR, *self.nodes]
        # the spread is the maxflow policy's knob; the other policies route without a flow
        knobs = {"spread": config.router_spread} if config.scheduler == "maxflow" else {}
        router = make_router(
            config.scheduler,
            placement,
            seed=config.seed,
            **knobs,
            **router_options(cluster, model, placement, cost),
        )
        if config.max_prefilling is not None and config.max_prefilling < 1:
            raise UserError(f"max_prefilling: must be >= 1, got {config.max_prefilling}")
        #: every scheduling decision (admission, route, KV, preemption): the core the live
        #: coordinator drives too. The simulator's capacities are exact, so the ledger decides
        #: when a node is full; a request no route holds on an idle cluster is rejected
        self.core = SchedulerCore(
            router,
            SchedulerPolicy(kv=kv_policy, exact_capacities=True,
                            max_prefilling=config.max_prefilling,
                            reject_unroutable_when_idle=True),
            {n.name: n.kv_cap for n in self.nodes.values()},
        )
        self.kv = self.core.kv
        self.router = router
        for n in self.nodes.values():
            n.kv = self.kv.nodes[n.name]
        self.net = Network(cluster, names)
        self.act_bytes = model.activation_bytes_per_token
        self.requests = sorted(requests, key=lambda q: q.arrival_s)
        self.stream: Iterator[tuple[int, int]] | None = (
            offline_stream(self.requests) if config.offline else None
        )
        self.heap: list[tuple[float, int, int, object, object]] = []
        self.seq = 0
        self.now = 0.0
        #: requests waiting for admission in the core's queue, by id
        self.waiting: dict[str, SimRequest] = {}
        self.finished: list[SimRequest] = []
        self.in_flight = self.rejected = self.arrived = 0
        #: requests admitted and not finished, by id
        self.running: dict[str, SimRequest] = {}
        self.decode_tokens = self.prompt_tokens = 0
        self.token_timeline = [0] * self.buckets
        self.next_arrival = 0
        #: (node, layers, prompt tokens, decode sequences) -> seconds; batches repeat a lot
        self._batch_time: dict[tuple[str, int, int, int], float] = {}

    # ---- event plumbing --------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: object, b: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        end = self.cfg.duration_s
        if self.feeder:
            for i in range(self.cfg.feed_initial_requests):
                self._push((i + 1) * self.cfg.feed_interval_s, _FEED, None, None)
        elif self.cfg.offline:
            self._admit()
        elif self.requests:
            self._push(self.requests[0].arrival_s, _ARRIVE, None, None)
        heap, pop = self.heap, heapq.heappop
        events = 0
        next_report = 0
        while heap:
            t, _, kind, a, b = pop(heap)
            if t > end:
                break
            self.now = t
            events += 1
            if kind == _DELIVER:
                if a is None:
                    self._at_coordinator(b)  # type: ignore[arg-type]
                else:
                    self._enqueue(a, b)  # type: ignore[arg-type]
            elif kind == _DONE:
                self._done(a, b)  # type: ignore[arg-type]
            elif kind == _FEED:
                self._feed(initial=True)
            else:
                self._arrive()
            if self.progress is not None and events >= next_report:
                next_report = events + 2048
                self.progress(t / end)
        self.now = end
        for n in self.nodes.values():
            n.kv.advance(end)
        if self.progress is not None:
            self.progress(1.0)
        return SimResult(
            config=self.cfg,
            placement=self.placement,
            nodes=list(self.nodes.values()),
            links=sorted(self.net.links.values(), key=lambda k: (k.src, k.dst)),
            finished=self.finished,
            in_flight=self.in_flight,
            waiting=len(self.waiting),
            rejected=self.rejected,
            arrived=self.arrived,
            decode_tokens=self.decode_tokens,
            prompt_tokens=self.prompt_tokens,
            token_timeline=self.token_timeline,
            bucket_s=self.bucket_s,
            end_s=end,
            events=events,
            wall_s=time.perf_counter() - wall0,
            max_flow_tokens_per_s=self.placement.throughput_tokens_per_s,
            extra={"kv_allocation": self.cfg.kv_allocation, "preemptions": self.core.preemptions,
                   **({"feed_dropped": self.feed_dropped} if self.feeder else {})},
        )

    # ---- admission -------------------------------------------------------------------------

    @property
    def decisions(self) -> list[tuple[Any, ...]] | None:
        """The core's decision log (scheduler/core.py `SchedulerCore.log`); set to [] to keep
        one."""
        return self.core.log

    @decisions.setter
    def decisions(self, log: list[tuple[Any, ...]] | None) -> None:
        self.core.log = log

    def _arrive(self) -> None:
        q = self.requests[self.next_arrival]
        self.next_arrival += 1
        if self.next_arrival < len(self.requests):
            self._push(self.requests[self.next_arrival].arrival_s, _ARRIVE, None, None)
        self.arrived += 1
        self._queue(SimRequest(q.request_id, q.arrival_s, q.prompt_tokens, q.output_tokens))
        self._admit()

    def _queue(self, r: SimRequest) -> None:
        """`r` waits in the core's queue (or is rejected at once: it could never fit)."""
        try:
            self.core.arrive(CoreRequest(r.rid, r.prompt, r.output))
        except NeverFitsError:
            self.rejected += 1
            return
        self.waiting[r.rid] = r

    def _admit(self) -> None:
        """Carry out the core's admissions at an admission point; offline, keep the queue
        non-empty from the trace (cycled) while routes are found."""
        core = self.core
        while core.at_admission_point:
            for d in core.schedule(self.now):
                r = self.waiting.pop(d.request_id)
                if type(d) is Admission:
                    self._launch(r, d)
                else:
                    self.rejected += 1
            if self.stream is None or self.feeder or core.queue or core.prefill_capped:
                return
            prompt, output = next(self.stream)
            self.arrived += 1
            self._queue(SimRequest(f"req-{self.arrived}", self.now, prompt, output))

    def _launch(self, r: SimRequest, d: Admission) -> None:
        """Send `r`'s prompt along the route the core admitted it on."""
        self.in_flight += 1
        r.nodes = tuple(self.nodes[h.name] for h in d.route.hops)
        r.starts = tuple(h.start_layer for h in d.route.hops)
        r.admit_s = self.now
        self.running[r.rid] = r
        size = self.cfg.prefill_chunk_tokens
        pieces: list[Any] = [r] if size is None or r.prompt <= size else _chunks(r, size)
        self._send(COORDINATOR, r.nodes[0], r.prompt * TOKEN_ID_BYTES, pieces)

    # ---- the offline feeders (SimConfig.offline_feed) ---------------------------------------

    def _bottleneck_kv_usage(self) -> float:
        """KV promised over KV held, on the layer where that is highest. A node's promises are
        spread evenly over its layers (a request entering mid-range counts the layers it runs),
        as Helix's `KVExpectation.bottleneck_usage` does."""
        return max(
            sum(n.kv.promised_token_layers / (n.end - n.start) for n in g) / total
            if total else 1.0
            for g, total in self.layer_groups
        )

    def _feed(self, initial: bool) -> None:
        """One more request from the trace (cycled). An initial one (and any while requests
        wait, e.g. preempted ones) queues for a route like an arrival; one fed on a prompt's or
        a request's end is dropped when no route takes it at once, as Helix's host drops it."""
        if self.now > self.cfg.duration_s:
            return
        assert self.stream is not None
        prompt, output = next(self.stream)
        r = SimRequest(f"req-{self.arrived + 1}", self.now, prompt, output)
        if initial or self.core.queue:
            self.arrived += 1
            self._queue(r)
            self._admit()
            return
        d = self.core.admit_now(CoreRequest(r.rid, r.prompt, r.output), self.now)
        if d is None:
            self.feed_dropped += 1
        else:
            self.arrived += 1
            self._launch(r, d)

    def _finish(self, r: SimRequest) -> None:
        r.finish_s = self.now
        self.core.finish(r.rid, self.now)
        del self.running[r.rid]
        self.in_flight -= 1
        self.finished.append(r)

    def _grow(self, r: SimRequest) -> bool:
        """On-demand KV: one more slot on every node of `r`'s route for its next decode step;
        the core preempts on a full node by its victim rule. False: `r` itself was
        preempted."""
        out = self.core.on_token(r.rid, self.now)
        if type(out) is not Preempted:
            return True
        for rid in out.victims:
            self._preempted(self.running[rid])
        return r.rid not in out.victims

    def _preempted(self, r: SimRequest) -> None:
        """The core preempted `r` by recompute (KV freed, requeued at the head): its pending
        events are dropped; re-admitted, it prefills its prompt and the tokens it generated."""
        r.dead = True
        del self.running[r.rid]
        self.in_flight -= 1
        # its prompt plus every token generated so far (a request preempted twice must not
        # count the tokens of its first recompute again)
        q = SimRequest(r.rid, r.arrival_s, r.prompt - r.replayed + r.generated, r.output)
        q.generated, q.first_s, q.resumed, q.replayed = r.generated, r.first_s, True, r.generated
        self.waiting[r.rid] = q

    # ---- nodes -----------------------------------------------------------------------------

    def _enqueue(self, node: SimNode, reqs: list[SimRequest]) -> None:
        for r in reqs:
            if r.dead:
                continue
            if type(r) is _Chunk or r.in_prompt:
                r.left = r.prompt
                node.pq.append(r)
            else:
                node.dq.append(r)
        node.state.queue_len = len(node.pq) + len(node.dq)
        if not node.busy:
            self._start(node)

    def _start(self, node: SimNode) -> None:
        pq = node.pq
        if self.on_demand:  # drop requests preempted while queued here (prompts: at the head)
            node.dq = [r for r in node.dq if not r.dead]
            while pq and pq[0].dead:
                pq.popleft()
        plan = plan_step(node.dq, pq, node.budget, _prompt_left, _dead)
        decode, node.dq = plan.decode, node.dq[len(plan.decode) :]
        for _ in range(plan.prompts_popped):
            pq.popleft()
        prompts: list[SimRequest] = []
        for r, take in plan.prompts:
            r.chunk = take
            r.left -= take
            prompts.append(r)
        prompt_tokens = plan.prompt_tokens
        if not decode and not prompts:
            return
        node.state.queue_len = len(pq) + len(node.dq)
        if node.may_partial:
            dt = self._partial_batch_time(node, prompts, decode)
        else:
            dt = self._time(node, node.end - node.start, prompt_tokens, len(decode))
        if node.has_head:
            dt += self._head_time(node, sum(1 for r in prompts if not r.left), len(decode))
        node.busy = True
        node.iters += 1
        if prompts:
            node.prompt_iters += 1
            node.prompt_tokens += prompt_tokens
        if decode:
            node.decode_iters += 1
            node.decode_tokens += len(decode)
        self._account_busy(node, self.now, dt)
        self._push(self.now + dt, _DONE, node, (prompts, decode))

    def _partial_batch_time(
        self, node: SimNode, prompts: list[SimRequest], decode: list[SimRequest]
    ) -> float:
        # start layer -> [prompt tokens, decode sequences] entering there
        by_start: dict[int, list[int]] = {}
        for r in prompts:
            by_start.setdefault(r.starts[r.hop], [0, 0])[0] += r.chunk
        for r in decode:
            by_start.setdefault(r.starts[r.hop], [0, 0])[1] += 1
        starts = sorted(by_start)
        total_s, p, d = 0.0, 0, 0
        for k, s in enumerate(starts):
            p += by_start[s][0]
            d += by_start[s][1]
            seg_end = starts[k + 1] if k + 1 < len(starts) else node.end
            total_s += self._time(node, seg_end - s, p, d)
        return total_s

    def _time(self, node: SimNode, layers: int, prompt_tokens: int, decode: int) -> float:
        key = (node.name, layers, prompt_tokens, decode)
        t = self._batch_time.get(key)
        if t is None:
            t = self.cost.batch_time_s(node.spec, layers, prompt_tokens, decode)
            t += self.cfg.layer_overhead_s * layers
            self._batch_time[key] = t
        return t

    def _head_time(self, node: SimNode, prompts_done: int, decode: int) -> float:
        """The head over one row per sequence sampled: the decode sequences and the prompts
        whose last chunk ran (a chunk before it samples nothing). One call for all rows, as
        the worker runs it; timed by the decode curve when decode rows are in it."""
        rows = prompts_done + decode
        if rows == 0:
            return 0.0
        key = (node.name, -1, prompts_done, decode)  # layers -1: not a layer time
        t = self._batch_time.get(key)
        if t is None:
            t = self.cost.head_time_s(node.spec, "decode" if decode else "prompt", rows)
            self._batch_time[key] = t
        return t

    def _account_busy(self, node: SimNode, t0: float, dt: float) -> None:
        end = self.cfg.duration_s
        t1 = min(t0 + dt, end)
        node.busy_s += max(0.0, t1 - t0)
        b = int(t0 / self.bucket_s)
        while t0 < t1 and b < self.buckets:
            edge = min((b + 1) * self.bucket_s, t1)
            node.busy_timeline[b] += edge - t0
            t0 = edge
            b += 1

    def _done(self, node: SimNode, batch: tuple[list[SimRequest], list[SimRequest]]) -> None:
        node.busy = False
        # next hop (None: the coordinator) -> [requests, token activations carried]
        out: dict[SimNode | None, list[Any]] = {}
        prompts, decode = batch
        for r in prompts:
            if r.dead or r.left:  # preempted, or more of its prompt to prefill here
                continue
            h = r.hop + 1
            r.hop = h
            nxt = r.nodes[h] if h < len(r.nodes) else None
            if nxt is None and type(r) is _Chunk:
                # the last node ran a chunk: only the last one samples the first token
                if not r.last:
                    continue
                r = r.req
            group = out.get(nxt)
            if group is None:
                out[nxt] = [[r], r.prompt]
            else:
                group[0].append(r)
                group[1] += r.prompt
        for r in decode:
            if r.dead:
                continue
            h = r.hop + 1
            r.hop = h
            nxt = r.nodes[h] if h < len(r.nodes) else None
            group = out.get(nxt)
            if group is None:
                out[nxt] = [[r], 1]
            else:
                group[0].append(r)
                group[1] += 1
        for nxt, (reqs, tokens) in out.items():
            # to the coordinator: the sampled token id of each request; else activations
            nbytes = TOKEN_ID_BYTES * len(reqs) if nxt is None else tokens * self.act_bytes
            self._send(node.name, nxt, nbytes, reqs)
        if node.pq or node.dq:
            self._start(node)

    # ---- coordinator -----------------------------------------------------------------------

    def _at_coordinator(self, reqs: list[SimRequest]) -> None:
        now = self.now
        counted = now >= self.cfg.warmup_s
        b = min(int(now / self.bucket_s), self.buckets - 1)
        out: dict[SimNode, list[SimRequest]] = {}
        finished = 0
        on_demand = self.on_demand
        feeds = 0  # the feeder's triggers: a first prompt done, a request finished
        for r in reqs:
            if r.dead:
                continue
            if r.in_prompt:
                r.in_prompt = False
                if r.first_s != r.first_s:  # NaN: the first token (not a resumed request's)
                    r.first_s = now
                    feeds += 1
                    if counted:
                        self.prompt_tokens += r.prompt
            r.generated += 1
            if counted:
                self.decode_tokens += 1
            self.token_timeline[b] += 1
            if r.generated >= r.output:
                self._finish(r)
                finished += 1
                feeds += 1
            elif self._grow(r):
                r.hop = 0
                out.setdefault(r.nodes[0], []).append(r)
        for first, group in out.items():
            if on_demand:  # a later request's growth may have preempted an earlier one
                group = [r for r in group if not r.dead]
                if not group:
                    continue
            self._send(COORDINATOR, first, TOKEN_ID_BYTES * len(group), group)
        self._admit()  # at an admission point only (a finish, a first token under the cap...)
        if self.kv_feeder:
            for _ in range(feeds):
                if self._bottleneck_kv_usage() <= self.cfg.feed_kv_fraction:
                    self._feed(initial=False)
        elif self.feeder:  # closed: one new request for each one finished
            for _ in range(finished):
                self._feed(initial=True)

    # ---- network ---------------------------------------------------------------------------

    def _send(self, src: str, dst: SimNode | None, nbytes: int, reqs: list[SimRequest]) -> None:
        arrive = self.net.send(self.now, src, COORDINATOR if dst is None else dst.name, nbytes)
        self._push(arrive, _DELIVER, dst, reqs)
