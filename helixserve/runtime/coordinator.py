"""The coordinator: a loop around the scheduling core that carries out its decisions on the
workers.

    coord = await Coordinator.create(cluster, placement, model_dir, CoordinatorConfig(...))
    async for ev in coord.generate(GenerationRequest(...)): ...   # TokenEvent per token

Every admission, route, KV and preemption decision is the scheduling core's
(`scheduler/core.py`, which the simulator drives too; docs/scheduler.md). The coordinator turns
the network's events into its calls (a request arrives: `arrive`; a token: `on_token`; a worker
out of KV: `kv_full`; a stream breaks: `node_down`; a request ends: `finish`) and carries out
what it returns, with these parts:

- `inflight.py`: `InFlight`, what it keeps of each request (the core's request itself, plus
  its route, tokens so far and the steps it waits on);
- `admission.py`: the wait for the core's admission, and the pump that wakes the admitted;
- `dispatch.py`: the steps sent to a route's first hop, the KV releases on every hop;
- `results.py`: each result checked at arrival (one not awaited is dropped and counted), and
  what it means for its request: a token, a route to replay, a preemption, a failure;
- `replays.py`: what a failed step's request goes through before it is replayed (re-routed,
  preempted, or run again after a prefix miss);
- `workers.py`, `startup.py`, `counters.py`, `replan.py`: the workers' reports, polling and
  revival; start-up checks; the counters and the stats snapshot; live re-planning.

One request: admit -> prefill -> one decode step per token, sent by its driver task as soon as
the token arrives (whether or not the caller has read it) -> finish (stop token, stop string,
max_tokens) -> release KV on every hop; closing the generator early (client gone) takes the
same release path. A worker out of KV ("on-demand" allocation, as in vLLM) preempts the
request whose step failed: it replays prompt + tokens so far once admitted again. When a
worker's stream breaks, every request routed through it is replayed over surviving nodes and
its client's stream goes on without a gap or duplicate; a request fails only when no route
covers the model (with `recovery`, after a re-plan onto the live workers failed to cover it).

Prefix caching (docs/prefix-caching.md): the workers' cache events (sent on their streams
with each step's results) feed `core.on_cache_events`; an admission says how many tokens
every hop of the route holds already (`cached_tokens`), and the prefill starts there. A hop
that lost them since its report answers "prefix miss": the core forgets those blocks there
and the request runs again (not a fault: not counted against max_reroutes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helixserve.prefix import CacheEvents
from helixserve.request import GenerationRequest, SamplingParams, TokenEvent
from helixserve.runtime import replays, results, security, startup, workers
from helixserve.runtime.admission import AdmissionWait, NoRouteError
from helixserve.runtime.config import CoordinatorConfig
from helixserve.runtime.costs import runtime_cost_model
from helixserve.runtime.counters import CoordinatorCounts
from helixserve.runtime.dispatch import Dispatch
from helixserve.runtime.inflight import InFlight
from helixserve.runtime.node_client import NodeClient
from helixserve.runtime.output import OutputProcessor
from helixserve.runtime.replan import Recovery
from helixserve.runtime.results import RequestFailedError, ResultInbox
from helixserve.runtime.stats import CoordinatorStats
from helixserve.runtime.workers import WorkerWatch
from helixserve.scheduler.core import QueueFullError, SchedulerCore, SchedulerPolicy
from helixserve.scheduler.kv import KvPolicy
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK, RUNTIME_VICTIM_RULE

if TYPE_CHECKING:
    from helixserve.costmodel import CostModel
    from helixserve.planner.placement import Placement
    from helixserve.runtime.transport import WireResult
    from helixserve.spec import ClusterSpec

log = logging.getLogger("helixserve.coordinator")


class Coordinator:
    """Use `await Coordinator.create(...)`; see the module doc."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    eos_token_ids: list[int]
    step_timeout_s: float
    #: CoordinatorConfig's (set by `create`); hang_timeout_s is the re-route health check's too
    admission_timeout_s: float = CoordinatorConfig.admission_timeout_s
    hang_timeout_s: float = CoordinatorConfig.hang_timeout_s

    def __init__(self, placement: Any, model_dir: Path, router: Any, max_queue: int,
                 max_reroutes: int, stats_interval_s: float, kv_allocation: str = "on-demand",
                 kv_watermark: float = DEFAULT_KV_WATERMARK, prefix_caching: bool = True,
                 cache_aware: bool = True) -> None:
        self.placement = placement
        self.model_dir = Path(model_dir)
        self.stats_interval_s = stats_interval_s
        #: every admission, route, KV and preemption decision: the scheduling core, the one
        #: the simulator drives (scheduler/core.py). Its capacities are the workers' reports
        #: (they may change under running requests), so a worker says when it is out of KV
        #: and the victim is the request whose step failed (RUNTIME_VICTIM_RULE)
        self.core = SchedulerCore(router, SchedulerPolicy(
            kv=KvPolicy(kv_allocation, kv_watermark, victim_rule=RUNTIME_VICTIM_RULE),
            exact_capacities=False, max_queue=max_queue, max_reroutes=max_reroutes,
            prefix_caching=prefix_caching, cache_aware=cache_aware))
        # the id is derived from a secret only this coordinator knows (runtime/security.py)
        self.coordinator_id, self._coordinator_token = security.new_coordinator_identity()
        #: the workers' clients by node name: one dict for the coordinator's life
        self.nodes: dict[str, NodeClient] = {}
        #: requests admitted and not ended, by internal id
        self.active: dict[str, InFlight] = {}
        self.admission = AdmissionWait(self.core, self._sync_nodes, stats_interval_s)
        self.dispatch = Dispatch(self.nodes, self.coordinator_id, self.spawn)
        self.inbox = ResultInbox(self.active)
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: tokens, re-routes, nodes down, routes taken, prefix look-ups, since start
        self.counts = CoordinatorCounts()
        self.kv_allocation = kv_allocation
        #: bumped when a re-plan starts and when it ends: a re-route of a request routed
        #: before then is not counted against max_reroutes
        self.epoch = 0
        self.recovery: Recovery | None = None
        #: the cost model the router and the re-plan use (runtime/costs.py; `create` sets it)
        self.cost: CostModel | None = None
        self.cluster: Any = None
        self.scheduler = "maxflow"
        #: per node: process_up, restarts, last_exit_code, from a local supervisor if any
        self.process_stats: Callable[[], dict[str, dict[str, Any]]] | None = None

    @property
    def preemptions(self) -> int:
        """On-demand KV: requests recomputed after a worker ran out of KV."""
        return self.core.preemptions

    @classmethod
    async def create(
        cls,
        cluster: ClusterSpec,
        placement: Placement,
        model_dir: Path,
        config: CoordinatorConfig | None = None,
        *,
        tls: security.TlsConfig | None = None,
    ) -> Coordinator:
        cfg = (config or CoordinatorConfig()).check()
        # the planner's and simulator's cost model (runtime/costs.py): the router's flow and
        # node throughputs, and the live re-plan, come from it
        cost = runtime_cost_model(Path(model_dir), placement.model, cfg.cost)
        log.info("%s", cfg.cost.describe())
        router = startup.make_live_router(cfg.scheduler, cluster, placement, cost)
        self = cls(placement, model_dir, router, cfg.max_queue, cfg.max_reroutes,
                   cfg.stats_interval_s, cfg.kv_allocation, cfg.kv_watermark,
                   cfg.prefix_caching, cfg.cache_aware_routing)
        self.cost = cost
        self.model_name = placement.model or self.model_dir.name
        self.cluster, self.scheduler = cluster, cfg.scheduler
        if cfg.recovery is not None:
            self.recovery = Recovery(self, cluster, cfg.recovery)
        self.nodes.update(startup.client_per_node(cluster, placement, lambda name, addr, nr: (
            NodeClient(name, addr, nr.start_layer, nr.end_layer, self.coordinator_id,
                       self.inbox.deliver, self._on_node_down,
                       coordinator_token=self._coordinator_token, tls=tls,
                       on_cache=self.core.on_cache_events))))
        tokenizer_task = asyncio.get_running_loop().run_in_executor(
            None, startup.load_tokenizer, self.model_dir)
        for name in await workers.open_all(self.nodes, placement.num_layers,
                                           cfg.connect_timeout_s):
            self.core.node_down(name)
        if self.recovery is not None:
            # workers restarted with other ranges since the placement file was written
            await self.recovery.install_actual()
        self.step_timeout_s, self.admission_timeout_s, self.hang_timeout_s = (
            cfg.step_timeout_s, cfg.admission_timeout_s, cfg.hang_timeout_s)
        self.tokenizer = await tokenizer_task
        self.dispatch.chunk_tokens = startup.chunk_tokens(self.nodes.values(),
                                                          cfg.prefill_chunk_tokens)
        self.max_model_len = cfg.max_model_len or startup.config_max_len(self.model_dir) or 2048
        self.core.policy = dataclasses.replace(self.core.policy,
                                               max_model_len=self.max_model_len)
        self.eos_token_ids = startup.eos_token_ids(self.nodes.values(), placement.num_layers,
                                                   self.tokenizer)
        self.spawn(WorkerWatch(self.nodes, placement.num_layers, cfg.stats_interval_s,
                               cfg.hang_timeout_s,
                               self.recovery is None, self.spawn, self._node_back).run())
        return self

    async def close(self) -> None:
        # Let KV releases already under way reach the workers, then stop everything.
        await self.dispatch.settle(timeout_s=5.0)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(n.close() for n in self.nodes.values()), return_exceptions=True)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- the workers ----------------------------------------------------------------------

    async def _node_back(self, node: NodeClient) -> None:
        """A down worker answers again (workers.py): route over it, with the range it holds."""
        self.core.node_up(node.name)
        if self.recovery is not None:
            try:
                await self.recovery.rejoin(node)
            except Exception as exc:  # keep serving over the placement we have
                log.exception("node %s rejoined, but routing over it failed: %s",
                              node.name, exc)
        self.admission.pump()

    def cost_model(self) -> CostModel:
        """The router's and re-plan's cost model (runtime/costs.py): `create` builds it from
        the config; a coordinator made otherwise gets the analytic one."""
        if self.cost is None:
            self.cost = runtime_cost_model(self.model_dir, self.placement.model)
        return self.cost

    async def install_placement(self, placement: Any) -> None:
        """Route over `placement` from now on (a re-plan, a worker back with another range).
        Running requests whose route is still valid keep it, with their KV promises."""
        router = await asyncio.get_running_loop().run_in_executor(
            None, startup.make_live_router, self.scheduler, self.cluster, placement,
            self.cost_model(), self.epoch, True)
        # running requests keep their routes and KV; one the new ranges do not hold fails
        # its next step on the worker that moved, and is re-routed then
        self.core.install(router, down=[n for n, c in self.nodes.items() if not c.alive])
        self.placement = placement
        log.warning("routing over %s", ", ".join(
            f"{r.name} [{r.start_layer}, {r.end_layer})" for r in placement.nodes))

    def _sync_nodes(self) -> None:
        workers.report(self.core, self.nodes)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """Most tokens a request of this prompt length could generate on the roomiest live
        route; None while no route covers the model or before the workers reported."""
        if not self.covered():
            return None
        self._sync_nodes()
        return self.core.max_new_tokens(prompt_tokens)

    def covered(self) -> bool:
        """Whether the live workers' ranges cover every layer."""
        return workers.covered(self.nodes, self.placement.num_layers)

    def stats(self) -> CoordinatorStats:
        """Snapshot for /metrics and /health: requests running/waiting, per node, per route."""
        return self.counts.snapshot(
            self.nodes, self.placement,
            self.process_stats() if self.process_stats is not None else {},
            self.core.prefix_stats(), self.core.prefix_totals(), running=len(self.active),
            waiting=self.core.waiting,
            preemptions=self.preemptions, kv_allocation=self.kv_allocation,
            dropped_results=self.inbox.dropped,
            recovery=None if self.recovery is None else self.recovery.snapshot())

    # ---- what the workers' streams report -------------------------------------------------

    def _on_node_down(self, node: str, reason: str) -> None:
        log.warning("node %s down: %s", node, reason)
        self.counts.node_down(node, reason)
        self.core.node_down(node)
        # what it holds is unknown until its next stream opens (it reports all, with reset)
        self.core.on_cache_events(node, CacheEvents(reset=True))
        self.inbox.node_failed(node, reason)
        if self.recovery is not None and not self.covered():
            self.recovery.trigger(f"node {node} down ({reason}), layers without a live holder")

    # ---- one request ----------------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens; see the module doc for the lifecycle. Closing this
        generator (or cancelling its task) stops the request's driver and frees its KV on
        every hop."""
        if req.checked_for_len != self.max_model_len:
            # a direct caller's request (the API's comes checked): the one check, on a copy
            req = dataclasses.replace(req, sampling=req.sampling or SamplingParams())
            req.validate(self.max_model_len)  # UserError naming the bad field
        fl = InFlight.of(req, self._new_internal_id(req), self.eos_token_ids)
        out = OutputProcessor.for_request(req, self.tokenizer, self.eos_token_ids,
                                          self.max_model_len)
        loop = asyncio.get_running_loop()
        arrived_s = loop.time()
        await self._admit(fl)
        events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        driver = self.spawn(self._drive(fl, out, events, loop.time() - arrived_s))
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            # No await here: a caller cancelled by anyio/Starlette (client gone) is cancelled
            # again at every await, and the KV must still be freed. The driver stops at its
            # next await; wherever that is, `_finish` frees the route the request holds now
            # (a replay in flight holds none until it is admitted, and then it is cancelled).
            driver.cancel()
            self._finish(fl)

    async def _drive(self, fl: InFlight, out: OutputProcessor,
                     events: asyncio.Queue[TokenEvent | BaseException],
                     queue_s: float | None) -> None:
        """One request's decode loop: prefill, then per token: account it, send the next
        step at once unless it finished, queue its event for `generate` (a slow reader does
        not slow the request's decode). An error ends the loop and is queued to be raised."""
        try:
            self.dispatch.prefill(fl)
            while True:
                r = await self._next_token(fl)
                token_id = r.token_id
                assert token_id is not None
                self._on_token(fl, token_id)
                step = out.add(token_id)
                if step.finish_reason is None:
                    self.dispatch.decode(fl)
                else:
                    self._finish(fl)  # KV freed now, not when the caller reads the token
                if r.prompt_logprobs is not None:
                    # scored once: a re-prefill after a fault need not score the prompt again
                    fl.sampling = dataclasses.replace(fl.sampling, prompt_logprobs=None)
                first = len(fl.output_ids) == 1
                events.put_nowait(TokenEvent(
                    token_id, step.text, r.logprob, r.top_logprobs, step.finish_reason,
                    r.compute_s, len(fl.hops), r.prompt_logprobs, queue_s,
                    cached_tokens=min(fl.cached_tokens, fl.prompt_tokens) if first else None))
                queue_s = None
                if step.finish_reason is not None:
                    return
        except Exception as exc:  # NoRouteError, RequestFailedError, ...: the caller's
            events.put_nowait(exc)

    def _on_token(self, fl: InFlight, token_id: int) -> None:
        fl.output_ids.append(token_id)
        self.core.on_token(fl.internal_id)  # on-demand: its next step takes one more slot
        self.counts.tokens_generated += 1

    def _new_internal_id(self, req: GenerationRequest) -> str:
        # Unique across coordinators and restarts: workers remember released ids and drop
        # their late items, so an id must never be reused.
        return f"{req.request_id}#{self.coordinator_id}.{next(self._ids)}"

    async def _admit(self, fl: InFlight) -> None:
        """Wait until the core admits the request (a new one arrives here; a replayed one
        was requeued by the core), then take its route. While no route covers the model it
        waits for a re-plan or a restart (`_check_recovering`), or fails."""
        if fl.internal_id not in self.core.requests:
            switching = self.recovery is not None and self.recovery.state == "loading"
            self._sync_nodes()
            # NeverFitsError (a UserError): a request that must fit alone on the roomiest
            # route, or could never end, unless the ranges are changing under us
            self.core.arrive(fl, check_fit=self.covered() and not switching)
        d = await self.admission.admit(
            fl.internal_id, self.covered,
            lambda since_s: self._check_recovering(since_s, replay=bool(fl.output_ids)),
            self.admission_timeout_s)
        fl.admitted(d.route, tuple(self.nodes[h.name].address for h in d.route.hops),
                    self.epoch, d.cached_tokens)
        self.counts.admitted(d.route.nodes)
        self.active[fl.internal_id] = fl

    def _check_recovering(self, uncovered_since: float, replay: bool) -> None:
        """While no route covers the model: raise NoRouteError, unless a re-plan or a restart
        may still cover it in time (replan.py; then the caller waits)."""
        rec = self.recovery
        waited_s = asyncio.get_running_loop().time() - uncovered_since
        why = "" if rec is None else rec.stop_waiting(waited_s, replay)
        if why is not None:
            live = ", ".join(n for n, c in self.nodes.items() if c.alive) or "none"
            raise NoRouteError(f"no route covers the model's {self.placement.num_layers} "
                               f"layers over the live workers ({live}){why}",
                               retry_after_s=None if rec is None else rec.config.retry_after_s)

    async def _next_token(self, fl: InFlight) -> WireResult:
        """The request's next sampled token (results.py says what each result means): a
        failed step's request is re-routed, preempted or run again (replays.py), and
        replayed; any other failure ends it."""
        on_demand = self.kv_allocation == "on-demand"
        while True:
            got = await results.next_outcome(fl, self.step_timeout_s, on_demand)
            if isinstance(got, results.Token):
                return got.result
            if isinstance(got, results.Replay):
                await replays.reroute(self, fl, got.reason)
            elif isinstance(got, results.KvFull):
                replays.preempt(self, fl, got)
            elif isinstance(got, results.PrefixMiss):
                replays.prefix_missed(self, fl, got)
            else:
                raise RequestFailedError(f"request {fl.req.request_id}: {got.reason}")
            await self._replay(fl)

    async def _replay(self, fl: InFlight) -> None:
        """The core has freed the request's KV and queued it again: free the workers' KV, wait
        for admission under a fresh id and prefill prompt + tokens so far."""
        old_id = fl.internal_id
        self.dispatch.release(old_id, fl.hops)
        self.active.pop(old_id, None)
        # A fresh internal id (the core renames its request, this very object): workers
        # drop any late item of the old one (released ids), and so does the inbox.
        self.core.rename(old_id, self._new_internal_id(fl.req))
        fl.restart()
        await self._admit(fl)
        self.dispatch.prefill(fl)

    def _finish(self, fl: InFlight) -> None:
        if self.active.pop(fl.internal_id, None) is None:
            return
        self.core.finish(fl.internal_id)
        self.dispatch.release(fl.internal_id, fl.hops)
        self.admission.pump_soon()

    async def notify_admit(self) -> None:
        """An admission point from outside (a re-plan installed, a worker back)."""
        self.core.wake()
        self.admission.pump()

    def stop_routing_to(self, node: str) -> None:
        """No new work for `node` (the re-plan changes its range) until it is back up."""
        self.core.node_down(node)


__all__ = ["Coordinator", "CoordinatorConfig", "GenerationRequest", "NoRouteError",
           "QueueFullError", "RequestFailedError", "TokenEvent"]
