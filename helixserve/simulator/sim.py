"""Discrete-event simulation of a placement serving a request stream: the event loop around
the scheduling core.

One event heap (`heapq`, ordered by time then insertion) moves time, links and events; every
scheduling decision is the core's (scheduler/core.py, docs/scheduler.md), the object the live
coordinator drives too: admission order and points, routes, KV held, promised and grown
(`SimConfig.kv_allocation`: "reserve", or vLLM's "on-demand" with preemption by recompute),
the preemption victim (`SimConfig.victim_rule`) and Helix's KV expectation
(`kv_expected_output_tokens`). Its capacities are exact, so the ledger decides when a node is
full and asserts it never overflows; a request no route could hold on an idle cluster is
rejected and counted.
- Nodes: continuous batching, partial inference and the head, timed by the cost model plus
  `layer_overhead_s` per layer run (`nodes.py`; docs/calibration.md).
- Prefix caching (`SimConfig.prefix_caching`, for requests whose token ids the trace gives,
  e.g. `workload.multi_turn`): each node caches named blocks as the engines do and reports
  them to the core after each step; a request's prefill computes only what its route does
  not hold (`prefix.py`).
- The coordinator takes no time: it counts the token, finishes the request or sends the
  next decode step to the route's first node.
- Offline mode keeps the admission queue non-empty (the next trace request, cycled, arrives
  whenever the queue drains): the cluster stays saturated and the run measures its maximum
  throughput. With `offline_feed="kv-feeder"` or `"closed"` requests enter as the Helix
  artifact's offline feeders and its prototype's host send them (`SimConfig.feed_*`;
  `offline.py`).
- Built by `build.py`: a node per placement range, and the router the config names.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner.placement import Placement
from helixserve.scheduler.core import (
    Admission,
    CoreRequest,
    NeverFitsError,
    Preempted,
    SchedulerCore,
)
from helixserve.simulator import prefix
from helixserve.simulator.build import config_router, placement_nodes
from helixserve.simulator.config import SimConfig
from helixserve.simulator.network import Network, SimLink
from helixserve.simulator.nodes import Batch, Chunk, NodeSteps, SimNode, SimRequest, chunks
from helixserve.simulator.offline import OfflineFeed
from helixserve.simulator.workload import TraceRequest
from helixserve.spec import TOKEN_ID_BYTES, ClusterSpec, ModelSpec
from helixserve.spec.cluster import COORDINATOR

_ARRIVE, _DONE, _DELIVER, _FEED = 0, 1, 2, 3


@dataclass
class SimCoreRequest(CoreRequest):
    """A request whose tokens the trace gives: the core names its prefix blocks."""

    #: its prompt then output token ids (TraceRequest.token_ids)
    script: tuple[int, ...] = ()

    def token_ids(self) -> Sequence[int]:
        return self.script[:self.prompt_tokens + self.generated]


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
        config.check()
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
        self.nodes = placement_nodes(cluster, placement, cost, config, self.buckets)
        router = config_router(config, cluster, model, placement, cost)
        #: every scheduling decision (admission, route, KV, preemption): the core the live
        #: coordinator drives too (SimConfig.scheduler_policy)
        self.core = SchedulerCore(router, config.scheduler_policy(),
                                  {n.name: n.kv_cap for n in self.nodes.values()})
        self.kv = self.core.kv
        self.router = router
        for n in self.nodes.values():
            n.kv = self.kv.nodes[n.name]
        #: prefix caching is modelled (prefix.py): on, and some request's tokens are known
        self.prefix_on = config.prefix_caching and any(q.token_ids is not None
                                                       for q in requests)
        self.block_size = config.prefix_block_size
        if self.prefix_on:
            for n in self.nodes.values():
                n.cache = prefix.NodeCache()
        self.on_demand = self.kv.policy.on_demand
        self.net = Network(cluster, [COORDINATOR, *self.nodes])
        self.steps = NodeSteps(cost, config, self.buckets, self.bucket_s,
                               model.activation_bytes_per_token, self.on_demand)
        self.requests = sorted(requests, key=lambda q: q.arrival_s)
        #: an offline run's source of requests and its feeder (offline.py); None: online
        self.offline = (OfflineFeed(config, self.requests, self.nodes.values(),
                                    placement.num_layers) if config.offline else None)
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

    # ---- event plumbing --------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: object, b: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        end = self.cfg.duration_s
        if self.offline is None:
            if self.requests:
                self._push(self.requests[0].arrival_s, _ARRIVE, None, None)
        elif self.offline.saturate:
            self._admit()
        else:
            for t in self.offline.initial_times_s():
                self._push(t, _FEED, None, None)
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
                   "prefix_stats": self.core.prefix_stats(),
                   "prefix_totals": self.core.prefix_totals(),
                   **({"feed_dropped": self.offline.dropped}
                      if self.offline is not None and not self.offline.saturate else {})},
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
        r = SimRequest(q.request_id, q.arrival_s, q.prompt_tokens, q.output_tokens)
        if self.prefix_on and q.token_ids is not None:
            r.script = tuple(q.token_ids)
        self._queue(r)
        self._admit()

    def _queue(self, r: SimRequest) -> None:
        """`r` waits in the core's queue (or is rejected at once: it could never fit)."""
        req = CoreRequest(r.rid, r.prompt, r.output) if r.script is None else \
            SimCoreRequest(r.rid, r.prompt, r.output, script=r.script)
        try:
            self.core.arrive(req)
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
            off = self.offline
            if off is None or not off.saturate or core.queue or core.prefill_capped:
                return
            prompt, output = off.next_lengths()
            self.arrived += 1
            self._queue(SimRequest(f"req-{self.arrived}", self.now, prompt, output))

    def _launch(self, r: SimRequest, d: Admission) -> None:
        """Send `r`'s prompt along the route the core admitted it on."""
        self.in_flight += 1
        r.nodes = tuple(self.nodes[h.name] for h in d.route.hops)
        r.starts = tuple(h.start_layer for h in d.route.hops)
        r.admit_s = self.now
        self.running[r.rid] = r
        if r.script is not None:  # take the cached prefix on every hop; prefill the rest
            r.fill = r.prompt - prefix.attach(r, d.cached_tokens, self.block_size)
        size = self.cfg.prefill_chunk_tokens
        pieces: list[Any] = [r] if size is None or r.fill <= size else chunks(r, size)
        self._send(COORDINATOR, r.nodes[0], r.prompt * TOKEN_ID_BYTES, pieces)

    # ---- the offline feeders (SimConfig.offline_feed, offline.py) ---------------------------

    def _feed(self, initial: bool) -> None:
        """One more request from the trace (cycled). An initial one (and any while requests
        wait, e.g. preempted ones) queues for a route like an arrival; one fed on a prompt's or
        a request's end is dropped when no route takes it at once, as Helix's host drops it."""
        if self.now > self.cfg.duration_s:
            return
        assert self.offline is not None
        prompt, output = self.offline.next_lengths()
        r = SimRequest(f"req-{self.arrived + 1}", self.now, prompt, output)
        if initial or self.core.queue:
            self.arrived += 1
            self._queue(r)
            self._admit()
            return
        d = self.core.admit_now(CoreRequest(r.rid, r.prompt, r.output), self.now)
        if d is None:
            self.offline.dropped += 1
        else:
            self.arrived += 1
            self._launch(r, d)

    def _finish(self, r: SimRequest) -> None:
        r.finish_s = self.now
        if r.script is not None:
            prefix.release(r, self.block_size)
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
        if r.script is not None:
            prefix.release(r, self.block_size)
        # its prompt plus every token generated so far (a request preempted twice must not
        # count the tokens of its first recompute again)
        q = SimRequest(r.rid, r.arrival_s, r.prompt - r.replayed + r.generated, r.output)
        q.generated, q.first_s, q.resumed, q.replayed = r.generated, r.first_s, True, r.generated
        q.script, q.names = r.script, r.names
        self.waiting[r.rid] = q

    # ---- nodes -----------------------------------------------------------------------------

    def _enqueue(self, node: SimNode, reqs: list[SimRequest]) -> None:
        self.steps.enqueue(node, reqs)
        if not node.busy:
            self._start(node)

    def _start(self, node: SimNode) -> None:
        step = self.steps.start(node, self.now)
        if step is not None:
            self._push(self.now + step[0], _DONE, node, step[1])

    def _done(self, node: SimNode, batch: Batch) -> None:
        if self.prefix_on:
            self._cache_step(node, batch)
        for nxt, nbytes, reqs in self.steps.done(node, batch):
            self._send(node.name, nxt, nbytes, reqs)
        if node.pq or node.dq:
            self._start(node)

    def _cache_step(self, node: SimNode, batch: Batch) -> None:
        """The step's full blocks go into the node's cache; unused ones beyond its free KV
        are evicted; the events go to the core, as a worker reports its engine's."""
        bs = self.block_size
        prompts, decode = batch
        for r in prompts:
            if r.dead or r.left:
                continue
            if type(r) is Chunk:
                if not r.last:
                    continue
                req = r.req
            else:
                req = r
            if req.script is not None:  # its whole prompt has run here
                prefix.computed(req, r.hop, req.prompt, bs)
        for r in decode:
            if not r.dead and r.script is not None:  # KV holds prompt + tokens generated
                prefix.computed(r, r.hop, r.prompt - r.replayed + r.generated, bs)
        prefix.end_of_step(node, bs)
        events = node.cache.log.take()
        if events:
            self.core.on_cache_events(node.name, events)

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
        if self.offline is not None:
            self.offline.after_tokens(feeds, finished, self._feed)

    # ---- network ---------------------------------------------------------------------------

    def _send(self, src: str, dst: SimNode | None, nbytes: int, reqs: list[SimRequest]) -> None:
        arrive = self.net.send(self.now, src, COORDINATOR if dst is None else dst.name, nbytes)
        self._push(arrive, _DELIVER, dst, reqs)
