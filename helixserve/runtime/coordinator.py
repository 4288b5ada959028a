"""The coordinator: the lifecycle of every request across the workers.

    coord = await Coordinator.create(cluster, placement, model_dir, CoordinatorConfig(...))
    async for ev in coord.generate(GenerationRequest(...)): ...   # TokenEvent per token

Every scheduling decision is the scheduling core's (`scheduler/core.py`, the object the
simulator drives too; docs/scheduler.md): this is the loop that feeds it the network's
events (requests, tokens, KV-full results, broken streams, worker reports) and carries out
its admissions on the workers.

One request: admit (ask the scheduler's router for a route, fed with live worker stats; wait
in a bounded FIFO while no route has KV room) -> prefill (prompt split into chunks of at most
`prefill_chunk_tokens`, all sent at once to the first hop; workers run a request's chunks in
order, so chunks pipeline along the route; they carry the route and sampling, which every hop
keeps) -> decode (one continuation item per token along the same route: request id, step,
position, token; the last hop returns the sampled token on this coordinator's stream, and the
request's driver task sends the next step at once, whether or not the caller has read the
token) -> finish (stop token, stop string, max_tokens) -> release KV on every hop. Closing the
generator early (client gone) or cancelling its task takes the same release path.

KV allocation (`kv_allocation`): "reserve" holds prompt + max_tokens on every hop from
admission; "on-demand" (the default, as in vLLM) admits on the prompt and, when a worker has
no block for a request's next step, preempts that request (the core's "requester" rule):
its KV is freed, it waits ahead of new requests and replays prompt + tokens so far.

Faults: one Work stream per worker. When a stream breaks, the node is down in the core and
every request routed through it is replayed over surviving nodes; the client's stream goes
on without a gap or duplicate. A request fails only when no route covers the model; with
`recovery` (runtime/replan.py) a lost layer range is re-planned onto the live workers first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helixserve.errors import UserError
from helixserve.request import GenerationRequest, SamplingParams, TokenEvent
from helixserve.runtime import security
from helixserve.runtime.config import CoordinatorConfig
from helixserve.runtime.costs import runtime_cost_model
from helixserve.runtime.node_client import NodeClient, NodeFailure
from helixserve.runtime.output import OutputProcessor
from helixserve.runtime.replan import Recovery
from helixserve.runtime.startup import (
    check_vllm_versions,
    chunk_tokens,
    client_per_node,
    config_max_len,
    connect_all,
    eos_token_ids,
    load_tokenizer,
    routing_inputs,
)
from helixserve.runtime.stats import CoordinatorStats, NodeStats, ProcessStats
from helixserve.runtime.transport import WireItem, WireResult
from helixserve.scheduler.core import (
    Admission,
    CoreRequest,
    QueueFullError,
    RerouteLimitError,
    SchedulerCore,
    SchedulerPolicy,
)
from helixserve.scheduler.kv import KvBook, KvPolicy
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK, RUNTIME_VICTIM_RULE

if TYPE_CHECKING:
    from helixserve.costmodel import CostModel
    from helixserve.planner.placement import NodeRange, Placement
    from helixserve.spec import ClusterSpec

log = logging.getLogger("helixserve.coordinator")


class NoRouteError(RuntimeError):
    """No route over the live workers covers the whole model (the API answers 503, with
    Retry-After when `retry_after_s` is set)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestFailedError(RuntimeError):
    """A worker reported an error for the request that re-routing cannot fix."""


@dataclass
class _Active:
    """A request being served: what a re-route needs to replay it."""

    req: GenerationRequest
    internal_id: str
    route_hops: tuple[NodeRange, ...] = ()
    #: each hop's worker address (host:port)
    route_addresses: tuple[str, ...] = ()
    results: asyncio.Queue[WireResult | NodeFailure] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    #: step ids sent on the current route whose result (token or ack) has not come back
    pending: set[int] = field(default_factory=set)
    #: the coordinator's placement epoch when the current route was made (replan.py)
    epoch: int = 0
    #: every worker of the current route takes continuation items (decode steps without the
    #: route and sampling, which went with the prefill); set by `_send_prefill`
    continuation: bool = False


class Coordinator:
    """Use `await Coordinator.create(...)`; see the module doc."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    eos_token_ids: list[int]
    prefill_chunk_tokens: int
    step_timeout_s: float

    def __init__(self, placement: Any, model_dir: Path, router: Any, max_queue: int,
                 max_reroutes: int, stats_interval_s: float, kv_allocation: str = "on-demand",
                 kv_watermark: float = DEFAULT_KV_WATERMARK) -> None:
        self.placement = placement
        self.model_dir = Path(model_dir)
        self.stats_interval_s = stats_interval_s
        #: every admission, route, KV and preemption decision: the scheduling core, the one
        #: the simulator drives (scheduler/core.py). Its capacities are the workers' reports
        #: (they may change under running requests), so a worker says when it is out of KV
        #: and the victim is the request whose step failed (RUNTIME_VICTIM_RULE)
        self.core = SchedulerCore(router, SchedulerPolicy(
            kv=KvPolicy(kv_allocation, kv_watermark, victim_rule=RUNTIME_VICTIM_RULE),
            exact_capacities=False, max_queue=max_queue, max_reroutes=max_reroutes))
        #: requests waiting for admission: the core's answer, by internal id
        self._waiters: dict[str, asyncio.Future[Admission]] = {}
        self._pump_due = False
        # the id is derived from a secret only this coordinator knows (runtime/security.py)
        self.coordinator_id, self._coordinator_token = security.new_coordinator_identity()
        self.nodes: dict[str, NodeClient] = {}
        self.active: dict[str, _Active] = {}
        self._ids = itertools.count()
        self._steps = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._releases: set[asyncio.Task[Any]] = set()
        self.hop_counts: dict[tuple[str, ...], int] = {}
        self.tokens_generated = 0
        self.reroutes = 0  # requests moved to a new route after a failure, since start
        self.kv_allocation = kv_allocation
        self.kv_watermark = kv_watermark
        #: bumped when a re-plan starts and when it ends: a re-route of a request routed
        #: before then is not counted against max_reroutes
        self.epoch = 0
        self.recovery: Recovery | None = None
        #: the cost model the router and the re-plan use (runtime/costs.py; `create` sets it)
        self.cost: CostModel | None = None
        self.model_spec: Any = None
        self.cluster: Any = None
        self.scheduler = "maxflow"
        self.down_events = 0  # nodes declared down (stream broke, hung, drained)
        self.down_reasons: dict[str, str] = {}
        #: per node: process_up, restarts, last_exit_code, from a local supervisor if any
        self.process_stats: Callable[[], dict[str, dict[str, Any]]] | None = None

    @property
    def router(self) -> Any:
        return self.core.router

    @property
    def kv(self) -> KvBook:
        """The core's KV ledger."""
        return self.core.kv

    @property
    def waiting(self) -> int:
        return self.core.waiting

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
        from helixserve.scheduler import make_router

        cfg = (config or CoordinatorConfig()).check()
        # the planner's and simulator's cost model (runtime/costs.py): the router's flow and
        # node throughputs, and the live re-plan, come from it
        cost = runtime_cost_model(Path(model_dir), placement.model, cfg.cost)
        log.info("%s", cfg.cost.describe())
        router = make_router(cfg.scheduler, placement, seed=0,
                             **routing_inputs(cluster, placement, cost))
        self = cls(placement, model_dir, router, cfg.max_queue, cfg.max_reroutes,
                   cfg.stats_interval_s, cfg.kv_allocation, cfg.kv_watermark)
        self.cost, self.model_spec = cost, cost.model
        self.model_name = placement.model or self.model_dir.name
        self.cluster, self.scheduler = cluster, cfg.scheduler
        if cfg.recovery is not None:
            self.recovery = Recovery(self, cluster, cfg.recovery)
        self.nodes = client_per_node(cluster, placement, lambda name, address, nr: NodeClient(
            name, address, nr.start_layer, nr.end_layer, self.coordinator_id, self._on_result,
            self._on_node_down, coordinator_token=self._coordinator_token, tls=tls))
        tokenizer_task = asyncio.get_running_loop().run_in_executor(
            None, load_tokenizer, self.model_dir)
        unreachable = await connect_all(self.nodes, placement.num_layers,
                                        cfg.connect_timeout_s)
        for name in unreachable:
            self.core.node_down(name)
        missing = "; ".join(f"{name}: {why}" for name, why in unreachable.items())
        if not self.covered():
            await asyncio.gather(*(n.close() for n in self.nodes.values()), return_exceptions=True)
            raise ConnectionError(f"no route covers the model over the reachable workers; {missing}")
        if missing:
            log.warning("starting without %s", missing)
        if self.recovery is not None:
            # workers restarted with other ranges since the placement file was written
            await self.recovery.install_actual()
        self.step_timeout_s = cfg.step_timeout_s
        self.tokenizer = await tokenizer_task
        any_info = next(n.info for n in self.nodes.values() if n.info is not None)
        assert any_info is not None
        self.prefill_chunk_tokens = chunk_tokens(any_info, cfg.prefill_chunk_tokens)
        self.max_model_len = cfg.max_model_len or config_max_len(self.model_dir) or 2048
        self.core.policy = dataclasses.replace(self.core.policy,
                                               max_model_len=self.max_model_len)
        self.eos_token_ids = eos_token_ids(self.nodes.values(), placement.num_layers,
                                           self.tokenizer)
        self.spawn(self._poll_stats())
        return self

    async def close(self) -> None:
        # Let KV releases already under way reach the workers, then stop everything.
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=5.0)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(n.close() for n in self.nodes.values()), return_exceptions=True)

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- live state -----------------------------------------------------------------------

    async def _poll_stats(self) -> None:
        hang_s = self.recovery.config.hang_timeout_s if self.recovery is not None else None
        while True:
            await asyncio.sleep(self.stats_interval_s)
            if hang_s is None:
                await asyncio.gather(*(n.refresh_info() for n in self.nodes.values() if n.alive),
                                     return_exceptions=True)
            else:
                # one task per node: a hung worker must not hold up the others' stats
                for n in self.nodes.values():
                    if n.alive and not n.refreshing:
                        self.spawn(n.refresh_info(timeout_s=hang_s))
                    n.check_answering(hang_s)
            for n in self.nodes.values():
                if not n.alive and n.reconnectable():
                    self.spawn(self._try_revive(n))

    async def _try_revive(self, node: NodeClient) -> None:
        if await node.revive(self.placement.num_layers,
                             check_range=self.recovery is None):
            try:
                check_vllm_versions({n.name: n.info for n in self.nodes.values()
                                     if n.info and (n.alive or n is node)})
            except UserError as exc:
                log.error("not taking node %s back: %s", node.name, exc)
                await node.close()
                return
            log.info("node %s is back", node.name)
            self.core.node_up(node.name)
            if self.recovery is not None:
                try:
                    await self.recovery.rejoin(node)
                except Exception as exc:  # keep serving over the placement we have
                    log.exception("node %s rejoined, but routing over it failed: %s",
                                  node.name, exc)
            self._pump()

    def cost_model(self) -> CostModel:
        """The cost model the router and the re-plan use (runtime/costs.py): `create` builds
        it from the config; a coordinator made otherwise gets the analytic one, once."""
        if self.cost is None:
            self.cost = runtime_cost_model(self.model_dir, self.placement.model)
            self.model_spec = self.cost.model
        return self.cost

    async def install_placement(self, placement: Any) -> None:
        """Route over `placement` from now on (a re-plan, a worker back with another range).
        Running requests whose route is still valid keep it, with their KV promises."""
        from helixserve.scheduler import make_router

        options = await asyncio.get_running_loop().run_in_executor(
            None, routing_inputs, self.cluster, placement, self.cost_model(), True)
        router = make_router(self.scheduler, placement, seed=self.epoch, **options)
        # running requests keep their routes and KV; one the new ranges do not hold fails
        # its next step on the worker that moved, and is re-routed then
        self.core.install(router, down=[n for n, c in self.nodes.items() if not c.alive])
        self.placement = placement
        log.warning("routing over %s", ", ".join(
            f"{r.name} [{r.start_layer}, {r.end_layer})" for r in placement.nodes))

    def _sync_nodes(self) -> None:
        """Hand the core the workers' latest reports: KV capacity (tokens), queue, liveness,
        block size (the ledger asks the router for block slack, so its promises in tokens
        never add up to more blocks than a worker has)."""
        self.core.set_block_size(self._block_size())
        for name, n in self.nodes.items():
            self.core.report(name, n.kv_capacity_tokens, n.queue_len, n.alive)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """Most tokens a request of this prompt length could generate on the roomiest route
        of the live workers; None while no route covers the model or before the workers
        reported."""
        if not self.covered():
            return None
        self._sync_nodes()
        return self.core.max_new_tokens(prompt_tokens)

    def _block_size(self) -> int:
        return max((n.info.kv_block_size for n in self.nodes.values() if n.info), default=1)

    def covered(self) -> bool:
        """Whether the live workers' ranges cover every layer."""
        from helixserve.planner.placement import layer_gaps

        return not layer_gaps(((n.start_layer, n.end_layer) for n in self.nodes.values()
                               if n.alive), self.placement.num_layers)

    def recovery_state(self) -> dict[str, Any] | None:
        return None if self.recovery is None else self.recovery.snapshot()

    def stats(self) -> CoordinatorStats:
        """Snapshot for /metrics and /health: requests running/waiting, per node, per route."""
        procs = self.process_stats() if self.process_stats is not None else {}
        nodes = {}
        for name, n in self.nodes.items():
            info = n.info
            node = NodeStats(
                start_layer=n.start_layer, end_layer=n.end_layer, alive=n.alive,
                address=n.address, in_placement=self.placement.range_of(name) is not None,
                last_down_reason=self.down_reasons.get(name, ""),
                process=ProcessStats(**procs[name]) if name in procs else None)
            if info is not None:
                node.queue_len, node.batch_size = info.queue_len, info.last_batch_size
                node.kv_used_blocks, node.kv_total_blocks = info.kv_used_blocks, \
                    info.kv_total_blocks
                node.kv_block_size, node.busy_fraction = info.kv_block_size, info.busy_fraction
                node.active_requests, node.steps = info.active_requests, info.steps
                node.items_run, node.step_tokens_sum = info.items_run, info.step_tokens_sum
                node.step_tokens_counts = list(info.step_tokens_counts)
                node.dtype, node.backend = info.dtype, info.backend
            nodes[name] = node
        return CoordinatorStats(
            running=len(self.active), waiting=self.waiting,
            tokens_generated=self.tokens_generated, reroutes=self.reroutes,
            preemptions=self.preemptions, kv_allocation=self.kv_allocation, nodes=nodes,
            routes={"->".join(r): c for r, c in self.hop_counts.items()},
            down_events=self.down_events, recovery=self.recovery_state())

    # ---- results from the node streams --------------------------------------------------

    def _on_result(self, r: WireResult) -> None:
        act = self.active.get(r.request_id)
        if act is not None:
            act.results.put_nowait(r)

    def _on_node_down(self, node: str, reason: str) -> None:
        log.warning("node %s down: %s", node, reason)
        self.down_events += 1
        self.down_reasons[node] = reason
        self.core.node_down(node)
        for act in self.active.values():
            if any(h.name == node for h in act.route_hops):
                act.results.put_nowait(NodeFailure(node, reason))
        if self.recovery is not None and not self.covered():
            self.recovery.trigger(f"node {node} down ({reason}), layers without a live holder")

    # ---- one request ----------------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens; see the module doc for the lifecycle.

        A driver task per request takes each token as it arrives, decides whether the request
        is done (OutputProcessor: stop tokens and strings, max_tokens) and sends the next
        decode step at once; the events wait in the request's own queue until the caller
        reads them, so a slow reader does not slow its request's decode. Closing this
        generator (or cancelling its task) stops the driver and frees the KV on every hop."""
        # A copy: min_tokens and scored prompt logprobs rewrite `sampling` for this run only,
        # so a caller may submit the same request object again.
        req = dataclasses.replace(req)
        if req.checked_for_len != self.max_model_len:
            self._validate(req)  # a direct caller's request; the API's comes checked
        if req.min_tokens > 0:
            # The last hop's sampler masks these until min_tokens are generated.
            stop_ids = set(req.stop_token_ids)
            if not req.ignore_eos:
                stop_ids |= set(self.eos_token_ids)
            req.sampling = dataclasses.replace(
                req.sampling, min_tokens=req.min_tokens, stop_token_ids=tuple(sorted(stop_ids)))
        act = _Active(req=req, internal_id=self._new_internal_id(req))
        out = OutputProcessor(
            tokenizer=self.tokenizer,
            prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.max_tokens,
            min_tokens=req.min_tokens,
            stop=list(req.stop),
            stop_token_ids=list(req.stop_token_ids),
            eos_token_ids=self.eos_token_ids,
            ignore_eos=req.ignore_eos,
            max_model_len=self.max_model_len,
        )
        loop = asyncio.get_running_loop()
        arrived_s = loop.time()
        await self._route(act)
        events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        driver = self.spawn(self._drive(act, out, events, loop.time() - arrived_s))
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
            self._finish(act)

    async def _drive(self, act: _Active, out: OutputProcessor,
                     events: asyncio.Queue[TokenEvent | BaseException],
                     queue_s: float | None) -> None:
        """One request's decode loop (see `generate`): prefill, then per token: account it,
        send the next step unless it finished, queue its event. An error ends the loop and
        is queued for `generate` to raise."""
        req = act.req
        try:
            self._send_prefill(act, req.prompt_token_ids)
            while True:
                r = await self._next_token(act)
                token_id = r.token_id
                assert token_id is not None
                self._on_token(act, token_id)
                step = out.add(token_id)
                if step.finish_reason is None:
                    self._send_decode(act, len(req.prompt_token_ids) + len(act.generated) - 1,
                                      token_id)
                else:
                    self._finish(act)  # KV freed now, not when the caller reads the token
                if r.prompt_logprobs is not None:
                    # scored once: a re-prefill after a fault need not score the prompt again
                    req.sampling = dataclasses.replace(req.sampling, prompt_logprobs=None)
                events.put_nowait(TokenEvent(token_id, step.text, r.logprob, r.top_logprobs,
                                             step.finish_reason, r.compute_s,
                                             len(act.route_hops), r.prompt_logprobs, queue_s))
                queue_s = None
                if step.finish_reason is not None:
                    return
        except Exception as exc:  # NoRouteError, RequestFailedError, ...: the caller's
            events.put_nowait(exc)

    def _on_token(self, act: _Active, token_id: int) -> None:
        act.generated.append(token_id)
        self.core.on_token(act.internal_id)  # on-demand: its next step takes one more slot
        self.tokens_generated += 1

    def _new_internal_id(self, req: GenerationRequest) -> str:
        # Unique across coordinators and restarts: workers remember released ids and drop
        # their late items, so an id must never be reused.
        return f"{req.request_id}#{self.coordinator_id}.{next(self._ids)}"

    def _validate(self, req: GenerationRequest) -> None:
        """A request no API layer checked (a direct caller): the same one check the API runs."""
        if req.sampling is None:
            req.sampling = SamplingParams()
        req.validate(self.max_model_len)  # UserError naming the bad field

    async def _route(self, act: _Active) -> None:
        """Wait until the core admits the request (a new one is queued here; a replayed one
        was requeued by `_replay`), then take its route. While no route covers the model it
        waits for a re-plan or a restart (`_check_recovering`), or fails."""
        if act.internal_id not in self.core.requests:
            switching = self.recovery is not None and self.recovery.state == "loading"
            self._sync_nodes()
            # NeverFitsError (a UserError): a request that must fit alone on the roomiest
            # route, or could never end, unless the ranges are changing under us
            self.core.arrive(CoreRequest(act.internal_id, len(act.req.prompt_token_ids),
                                         act.req.max_tokens),
                             check_fit=self.covered() and not switching)
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future[Admission] = loop.create_future()
        self._waiters[act.internal_id] = admitted
        uncovered_since: float | None = None
        try:
            self._pump()
            while not admitted.done():
                if not self.covered():
                    uncovered_since = uncovered_since or loop.time()
                    self._check_recovering(uncovered_since, replay=bool(act.generated))
                await asyncio.wait({admitted}, timeout=self.stats_interval_s)
                if not admitted.done():
                    self.core.wake()  # worker reports may have made room
                    self._pump()
            d = admitted.result()
        except BaseException:
            # given up (no route, queue full, cancelled): out of the queue, or its KV freed if
            # it was admitted as it gave up; the next head may fit now
            self._waiters.pop(act.internal_id, None)
            self.core.finish(act.internal_id)
            self._pump()
            raise
        act.epoch = self.epoch
        act.route_hops = d.route.hops
        act.route_addresses = tuple(self.nodes[h.name].address for h in d.route.hops)
        key = d.route.nodes
        self.hop_counts[key] = self.hop_counts.get(key, 0) + 1
        self.active[act.internal_id] = act

    def _pump_soon(self) -> None:
        """`_pump` once the results already received have been taken in (a step's tokens
        come together; the simulator too admits after a batch's last token)."""
        if not self._pump_due:
            self._pump_due = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """Carry out the core's decisions: wake the requests it admitted, fail those it
        refused."""
        self._pump_due = False
        self._sync_nodes()
        for d in self.core.schedule():
            waiter = self._waiters.pop(d.request_id, None)
            if waiter is None or waiter.done():
                continue
            if isinstance(d, Admission):
                waiter.set_result(d)
            else:
                waiter.set_exception(QueueFullError(d.reason))

    def _check_recovering(self, uncovered_since: float, replay: bool) -> None:
        """While no route covers the model: raise NoRouteError, unless a re-plan or a restart
        may still cover it within `wait_s` (then the caller waits)."""
        live = ", ".join(n for n, c in self.nodes.items() if c.alive) or "none"
        message = (f"no route covers the model's {self.placement.num_layers} layers over the "
                   f"live workers ({live})")
        rec = self.recovery
        if rec is None:
            raise NoRouteError(message)
        waited_s = asyncio.get_running_loop().time() - uncovered_since
        if waited_s > rec.config.wait_s:
            raise NoRouteError(f"{message}; waited {waited_s:.0f} s for a re-plan or a restart",
                               retry_after_s=rec.config.retry_after_s)
        if rec.uncoverable and not replay:
            # a running request still waits for a restart; a new one is told to come back
            raise NoRouteError(f"{message}, and no placement over them covers it",
                               retry_after_s=rec.config.retry_after_s)
        if not rec.busy and not rec.uncoverable:
            rec.trigger("layers without a live holder")

    def _send_prefill(self, act: _Active, token_ids: list[int]) -> None:
        """Prompt (+ tokens generated so far, on a re-route) in chunks, all sent at once. These
        carry the route and sampling; the route's workers keep them for the decode steps."""
        act.continuation = all(getattr(self.nodes[h.name], "continuation_ok", False)
                               for h in act.route_hops)
        chunk = self.prefill_chunk_tokens
        # On a replay the last hop must know which tokens are generated ones (penalties).
        num_prompt = len(act.req.prompt_token_ids) if act.generated else None
        for start in range(0, len(token_ids), chunk):
            part = token_ids[start : start + chunk]
            self._send(act, position=start, token_ids=part,
                       sample=start + chunk >= len(token_ids), num_prompt_tokens=num_prompt)

    def _send(self, act: _Active, position: int, token_ids: list[int], sample: bool,
              num_prompt_tokens: int | None = None) -> None:
        item = WireItem(
            request_id=act.internal_id,
            coordinator_id=self.coordinator_id,
            step_id=next(self._steps),
            hop_index=0,
            route=act.route_hops,
            addresses=act.route_addresses,
            position=position,
            token_ids=token_ids,
            hidden=None,
            sampling=act.req.sampling,
            sample=sample,
            num_prompt_tokens=num_prompt_tokens,
        )
        act.pending.add(item.step_id)
        self.nodes[act.route_hops[0].name].send(item)

    def _send_decode(self, act: _Active, position: int, token_id: int) -> None:
        """One decode step: a continuation item (request id, step, position, token) when the
        route's workers keep the request's route, else a full item."""
        if not act.continuation:
            self._send(act, position=position, token_ids=[token_id], sample=True)
            return
        step_id = next(self._steps)
        act.pending.add(step_id)
        self.nodes[act.route_hops[0].name].send_continuation(act.internal_id, step_id, position,
                                                             [token_id])

    async def _next_token(self, act: _Active) -> WireResult:
        """Wait for the next sampled token, skipping prefill acks; re-route on node failure."""
        while True:
            try:
                if act.results.empty():
                    # asyncio.timeout, not wait_for: no task per token
                    async with asyncio.timeout(self.step_timeout_s):
                        r = await act.results.get()
                else:
                    r = act.results.get_nowait()
            except TimeoutError:
                # An item lost without any node failing (e.g. a broken worker-to-worker
                # stream): replay on a route of nodes that pass a health check.
                await self._reroute(act, f"no result for {self.step_timeout_s:.0f} s")
                continue
            if isinstance(r, NodeFailure):
                await self._reroute(act, f"node {r.node} failed: {r.reason}")
                continue
            if not r.ok:
                from helixserve.runtime.transport import RESOURCE_EXHAUSTED, UNAVAILABLE

                if r.step_id and r.step_id not in act.pending:
                    # a step already answered, reported again by a worker whose stream to
                    # the next hop broke after sending it (step 0: the whole request)
                    continue
                if r.status_code == UNAVAILABLE:
                    await self._reroute(act, r.error)
                    continue
                if r.status_code == RESOURCE_EXHAUSTED and self.kv_allocation == "on-demand":
                    # the core's victim rule, RUNTIME_VICTIM_RULE: this request's step failed
                    victim = self.core.kv_full(r.node, act.internal_id)
                    assert victim == act.internal_id, (victim, act.internal_id)
                    await self._preempt(act, r.error)
                    continue
                raise RequestFailedError(f"request {act.req.request_id}: {r.error}")
            act.pending.discard(r.step_id)
            if r.token_id is not None:
                return r

    async def _reroute(self, act: _Active, reason: str) -> None:
        # routed before a re-plan, or while one switches workers' ranges: not this request's
        # bad luck, so not counted against max_reroutes
        stale = act.epoch < self.epoch or (self.recovery is not None
                                           and self.recovery.state == "loading")
        if not stale and not self.core.may_reroute(act.internal_id):
            raise RequestFailedError(f"request {act.req.request_id}: {reason} (gave up after "
                                     f"{self.core.requests[act.internal_id].reroutes} re-routes)")
        log.warning("re-routing %s: %s", act.internal_id, reason)
        # Which hop failed? A worker reports an unreachable next hop before this coordinator's
        # own stream to it breaks: ask every hop, so the new route avoids the dead one.
        await asyncio.gather(*(self.nodes[h.name].check_alive() for h in act.route_hops))
        self.reroutes += 1
        try:
            self.core.reroute(act.internal_id, counted=not stale)
        except RerouteLimitError as exc:
            raise RequestFailedError(f"request {act.req.request_id}: {reason} ({exc})") from None
        await self._replay(act)

    async def _preempt(self, act: _Active, reason: str) -> None:
        """On-demand KV: a hop had no block left for this request's next token, and the core
        preempted it (`kv_full`): recompute prompt + tokens so far once it is admitted again,
        ahead of new requests (vLLM's preemption by recompute). Not a fault, so not counted
        against max_reroutes."""
        log.info("preempting %s (%d tokens generated): %s", act.internal_id, len(act.generated),
                 reason)
        await self._replay(act)

    async def _replay(self, act: _Active) -> None:
        """The core has freed the request's KV and queued it again: free the workers' KV, wait
        for admission under a fresh id and prefill prompt + tokens so far."""
        old_id = act.internal_id
        self._release_kv(old_id, act.route_hops)
        self.active.pop(old_id, None)
        # A fresh internal id: workers drop any late item of the old one (released ids).
        act.internal_id = self._new_internal_id(act.req)
        self.core.rename(old_id, act.internal_id)
        act.results = asyncio.Queue()
        act.pending.clear()
        await self._route(act)
        self._send_prefill(act, act.req.prompt_token_ids + act.generated)

    def _finish(self, act: _Active) -> None:
        if self.active.pop(act.internal_id, None) is None:
            return
        self.core.finish(act.internal_id)
        self._release_kv(act.internal_id, act.route_hops)
        self._pump_soon()

    def _release_kv(self, internal_id: str, hops: tuple[NodeRange, ...]) -> None:
        # Also on nodes believed down: if only the stream broke, the worker still holds the KV
        # (a dead one fails the call at once).
        for h in hops:
            task = self.spawn(self.nodes[h.name].release([internal_id]))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def notify_admit(self) -> None:
        """An admission point from outside (a re-plan installed, a worker back)."""
        self.core.wake()
        self._pump()

    def stop_routing_to(self, node: str) -> None:
        """No new work for `node` (the re-plan changes its range) until it is back up."""
        self.core.node_down(node)


__all__ = [
    "Coordinator",
    "CoordinatorConfig",
    "GenerationRequest",
    "NoRouteError",
    "QueueFullError",
    "RequestFailedError",
    "TokenEvent",
]
