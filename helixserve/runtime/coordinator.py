"""The coordinator: the lifecycle of every request across the workers.

    coord = await Coordinator.create(cluster, placement, model_dir, CoordinatorConfig(...))
    async for ev in coord.generate(GenerationRequest(...)): ...   # TokenEvent per token

The scheduling decisions are the scheduling core's, the same the simulator makes
(docs/scheduler.md): the admission order (`scheduler/queue.py`: FIFO, head-of-line,
preempted requests first), the route (the router), the KV each request is promised and holds
per worker (`scheduler/kv.py`'s ledger, fed with the workers' reported capacities) and the
preemption victim (`RUNTIME_VICTIM_RULE`).

One request: admit (ask the scheduler's router for a route, fed with live worker stats; wait
in a bounded FIFO while no route has KV room) -> prefill (prompt split into chunks of at most
`prefill_chunk_tokens`, all sent at once to the first hop; workers run a request's chunks in
order, so chunks pipeline along the route; they carry the route and sampling, which every hop
keeps) -> decode (one continuation item per token along the same route: request id, step,
position, token; the last hop returns the sampled token on this coordinator's stream, and the
request's driver task sends the next step at once, whether or not the caller has read the
token) -> finish (stop token, stop string, max_tokens) -> release KV on every hop. Closing the
generator early (client gone) or cancelling its task takes the same release path.

KV allocation (`kv_allocation`): "reserve" admits a request when prompt + max_tokens fit on
every hop of a route and holds that much for its life, so a worker never runs out.
"on-demand" (the default, as in vLLM) admits it when its prompt fits (less a watermark kept
free), counts what running requests have generated since against each node, and when a
worker still runs out of KV blocks for a request's next step, preempts that request (the
core's "requester" victim rule: docs/scheduler.md says why): its KV is freed, it waits for
room ahead of new requests, and prompt + tokens so far are prefilled
again (vLLM's preemption by recompute); the client's stream goes on without a gap. Preemptions
are counted in `stats()` and in `vllm:num_preemptions`.

Faults: the coordinator keeps one Work stream per worker. When a stream breaks, the node is
marked down in the router and every request routed through it is re-routed over surviving
nodes and re-prefilled with its prompt + the tokens generated so far; the client's stream
continues without a gap or duplicate. A request fails only when no route covers the model.
With `recovery` (runtime/replan.py) a lost layer range is re-planned onto the live workers and
requests wait for it (bounded) instead of failing; a worker that stops answering is declared
down after `hang_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
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
from helixserve.runtime.transport import WireItem, WireResult
from helixserve.scheduler.kv import KvBook, KvPolicy
from helixserve.scheduler.queue import AdmissionQueue
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK, RUNTIME_VICTIM_RULE

if TYPE_CHECKING:
    from helixserve.costmodel import CostModel
    from helixserve.planner.placement import NodeRange, Placement
    from helixserve.scheduler import RouterOptions
    from helixserve.spec import ClusterSpec

log = logging.getLogger("helixserve.coordinator")


class NoRouteError(RuntimeError):
    """No route over the live workers covers the whole model (the API answers 503, with
    Retry-After when `retry_after_s` is set)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (the API answers 503/429)."""


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
    reroutes: int = 0
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
        self.router = router
        self.max_queue = max_queue
        self.max_reroutes = max_reroutes
        self.stats_interval_s = stats_interval_s
        # the id is derived from a secret only this coordinator knows (runtime/security.py)
        self.coordinator_id, self._coordinator_token = security.new_coordinator_identity()
        self.nodes: dict[str, NodeClient] = {}
        self.active: dict[str, _Active] = {}
        self.waiting = 0
        self._ids = itertools.count()
        self._steps = itertools.count(1)
        self._admit = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._releases: set[asyncio.Task[Any]] = set()
        self.hop_counts: dict[tuple[str, ...], int] = {}
        self.tokens_generated = 0
        self.reroutes = 0  # requests moved to a new route after a failure, since start
        self.kv_allocation = kv_allocation
        self.kv_watermark = kv_watermark
        #: KV held per worker and request, admission sizes and the victim rule: the scheduling
        #: core's ledger (scheduler/kv.py), the same the simulator keeps. Capacities are the
        #: workers' reports (not strict: they may change under running requests)
        self.kv = KvBook(KvPolicy(kv_allocation, kv_watermark, victim_rule=RUNTIME_VICTIM_RULE),
                         {}, strict=False)
        self.preemptions = 0  # on-demand KV: requests recomputed after a worker ran out of KV
        #: internal ids of the requests waiting for admission, in the core's order
        self.queue: AdmissionQueue[str] = AdmissionQueue()
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
                             **_routing_inputs(cluster, placement, cost))
        self = cls(placement, model_dir, router, cfg.max_queue, cfg.max_reroutes,
                   cfg.stats_interval_s, cfg.kv_allocation, cfg.kv_watermark)
        self.cost, self.model_spec = cost, cost.model
        self.model_name = placement.model or self.model_dir.name
        self.cluster, self.scheduler = cluster, cfg.scheduler
        if cfg.recovery is not None:
            self.recovery = Recovery(self, cluster, cfg.recovery)
        addresses = {n.name: getattr(n, "address", None) for n in cluster.nodes}
        for i, nr in enumerate(placement.nodes):
            address = addresses.get(nr.name)
            if nr.name not in addresses:
                raise UserError(f"placement: nodes[{i}].name: node {nr.name!r} not in the cluster; "
                                f"known: {', '.join(sorted(addresses))}")
            if not address:
                raise UserError(f"cluster: node {nr.name!r}: address: missing (host:port of its worker)")
            self.nodes[nr.name] = NodeClient(nr.name, address, nr.start_layer, nr.end_layer,
                                             self.coordinator_id, self._on_result, self._on_node_down,
                                             coordinator_token=self._coordinator_token, tls=tls)
        loop = asyncio.get_running_loop()
        tokenizer_task = loop.run_in_executor(None, _load_tokenizer, self.model_dir)
        results = await asyncio.gather(
            *(n.connect(placement.num_layers, cfg.connect_timeout_s) for n in self.nodes.values()),
            return_exceptions=True,
        )
        # A worker that does not answer is down (retried later); one that answers with the
        # wrong layers or model is a configuration error.
        unreachable = []
        for node, res in zip(self.nodes.values(), results, strict=True):
            if isinstance(res, ConnectionError) and node.info is None:
                unreachable.append(f"{node.name}: {res}")
                self.router.node_down(node.name)
            elif isinstance(res, BaseException):
                await asyncio.gather(*(n.close() for n in self.nodes.values()),
                                     return_exceptions=True)
                raise res
        try:
            check_vllm_versions({n.name: n.info for n in self.nodes.values() if n.info})
        except UserError:
            await asyncio.gather(*(n.close() for n in self.nodes.values()), return_exceptions=True)
            raise
        if not self._covered():
            await asyncio.gather(*(n.close() for n in self.nodes.values()), return_exceptions=True)
            raise ConnectionError("no route covers the model over the reachable workers; "
                                  + "; ".join(unreachable))
        for line in unreachable:
            log.warning("starting without %s", line)
        if self.recovery is not None:
            # workers restarted with other ranges since the placement file was written
            await self.recovery.install_actual()
        self.step_timeout_s = cfg.step_timeout_s
        self.tokenizer = await tokenizer_task
        any_info = next(n.info for n in self.nodes.values() if n.info is not None)
        assert any_info is not None
        self.prefill_chunk_tokens = _chunk_tokens(any_info, cfg.prefill_chunk_tokens)
        self.max_model_len = cfg.max_model_len or _config_max_len(self.model_dir) or 2048
        eos: set[int] = set()
        for n in self.nodes.values():
            if n.info is not None and n.end_layer == placement.num_layers:
                eos |= set(n.info.eos_token_ids)
        if not eos and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = sorted(eos)
        self._spawn(self._poll_stats())
        return self

    async def close(self) -> None:
        # Let KV releases already under way reach the workers, then stop everything.
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=5.0)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(n.close() for n in self.nodes.values()), return_exceptions=True)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
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
                        self._spawn(n.refresh_info(timeout_s=hang_s))
                    n.check_answering(hang_s)
            for n in self.nodes.values():
                if not n.alive and n.reconnectable():
                    self._spawn(self._try_revive(n))

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
            self.router.node_up(node.name)
            if self.recovery is not None:
                try:
                    await self.recovery.rejoin(node)
                except Exception as exc:  # keep serving over the placement we have
                    log.exception("node %s rejoined, but routing over it failed: %s",
                                  node.name, exc)
            async with self._admit:
                self._admit.notify_all()

    def cost_model(self) -> CostModel:
        """The cost model the router and the re-plan use (runtime/costs.py): `create` builds
        it from the config; a coordinator made otherwise gets the analytic one, once."""
        if self.cost is None:
            self.cost = runtime_cost_model(self.model_dir, self.placement.model)
            self.model_spec = self.cost.model
        return self.cost

    async def _install_placement(self, placement: Any) -> None:
        """Route over `placement` from now on (a re-plan, a worker back with another range).
        Running requests whose route is still valid keep it, with their KV promises."""
        from helixserve.scheduler import Route, make_router

        options = await asyncio.get_running_loop().run_in_executor(
            None, _routing_inputs, self.cluster, placement, self.cost_model(), True)
        router = make_router(self.scheduler, placement, seed=self.epoch, **options)
        for name, n in self.nodes.items():
            if not n.alive and placement.range_of(name) is not None:
                router.node_down(name)
        for act in self.active.values():
            hold = self.kv.holds.get(act.internal_id)
            router.adopt(act.internal_id, Route(act.route_hops),
                         hold.promised_tokens if hold is not None else 0)
        self.placement, self.router = placement, router
        log.warning("routing over %s", ", ".join(
            f"{r.name} [{r.start_layer}, {r.end_layer})" for r in placement.nodes))

    def _node_states(self) -> dict[str, Any]:
        from helixserve.scheduler import NodeState

        # The router keeps its own KV promises per routed request (scheduler/base.py), so it
        # gets each node's capacity (as the worker reports it), not its live free count, less
        # what the ledger says it may not promise (on demand: the watermark and the tokens
        # generated since admission).
        states = {}
        for name, n in self.nodes.items():
            kv = self.kv.set_capacity(name, n.kv_capacity_tokens)
            states[name] = NodeState(name, kv_free_tokens=kv.router_free_tokens,
                                     queue_len=n.queue_len, alive=n.alive)
        return states

    def _largest_route_kv_tokens(self) -> int:
        """KV tokens the roomiest route could give one request when idle: for each layer the
        largest capacity among live nodes holding it, minimised over layers."""
        best = [0] * self.placement.num_layers
        for n in self.nodes.values():
            if n.alive:
                for layer in range(n.start_layer, n.end_layer):
                    best[layer] = max(best[layer], n.kv_capacity_tokens)
        return min(best)

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        """Most tokens a request of this prompt length could generate on the roomiest route
        of the live workers (its KV must hold prompt + output, plus the block slack `_route`
        asks for); None while no route covers the model or before the workers reported."""
        if not self._covered():
            return None
        return self._largest_route_kv_tokens() - prompt_tokens - (self._block_size() - 1)

    def _block_size(self) -> int:
        return max((n.info.kv_block_size for n in self.nodes.values() if n.info), default=1)

    def _covered(self) -> bool:
        covered = [False] * self.placement.num_layers
        for n in self.nodes.values():
            if n.alive:
                for layer in range(n.start_layer, n.end_layer):
                    covered[layer] = True
        return all(covered)

    def recovery_state(self) -> dict[str, Any] | None:
        return None if self.recovery is None else self.recovery.snapshot()

    def stats(self) -> dict[str, Any]:
        """Snapshot for metrics: requests running/waiting, per node, per route."""
        nodes = {}
        procs = self.process_stats() if self.process_stats is not None else {}
        for name, n in self.nodes.items():
            info = n.info
            nodes[name] = {
                "address": n.address,
                "alive": n.alive,
                "in_placement": self.placement.range_of(name) is not None,
                "last_down_reason": self.down_reasons.get(name, ""),
                **procs.get(name, {}),
                "start_layer": n.start_layer,
                "end_layer": n.end_layer,
                "layers": n.end_layer - n.start_layer,
                "queue_len": info.queue_len if info else 0,
                "batch_size": info.last_batch_size if info else 0,
                "kv_used_blocks": info.kv_used_blocks if info else 0,
                "kv_total_blocks": info.kv_total_blocks if info else 0,
                "kv_block_size": info.kv_block_size if info else 0,
                "busy_fraction": info.busy_fraction if info else 0.0,
                "active_requests": info.active_requests if info else 0,
                "steps": info.steps if info else 0,
                "items_run": info.items_run if info else 0,
                "step_tokens_counts": list(info.step_tokens_counts) if info else [],
                "step_tokens_sum": info.step_tokens_sum if info else 0,
                "dtype": info.dtype if info else "",
                "backend": info.backend if info else "",
            }
        return {
            "running": len(self.active),
            "waiting": self.waiting,
            "tokens_generated": self.tokens_generated,
            "reroutes": self.reroutes,
            "preemptions": self.preemptions,
            "kv_allocation": self.kv_allocation,
            "nodes": nodes,
            "routes": {"->".join(r): c for r, c in self.hop_counts.items()},
            "down_events": self.down_events,
            "recovery": self.recovery_state(),
        }

    # ---- results from the node streams --------------------------------------------------

    def _on_result(self, r: WireResult) -> None:
        act = self.active.get(r.request_id)
        if act is not None:
            act.results.put_nowait(r)

    def _on_node_down(self, node: str, reason: str) -> None:
        log.warning("node %s down: %s", node, reason)
        self.down_events += 1
        self.down_reasons[node] = reason
        self.router.node_down(node)
        for act in self.active.values():
            if any(h.name == node for h in act.route_hops):
                act.results.put_nowait(NodeFailure(node, reason))
        if self.recovery is not None and not self._covered():
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
        driver = self._spawn(self._drive(act, out, events, loop.time() - arrived_s))
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
        self.kv.grow(act.internal_id)  # on-demand: its next step takes one more slot
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

    async def _route(self, act: _Active, replay_tokens: int = 0, preempted: bool = False) -> None:

        req = act.req
        prompt_tokens = len(req.prompt_token_ids) + replay_tokens
        remaining = max(1, req.max_tokens - len(act.generated))
        # Workers allocate KV in blocks: the ledger asks the router for block slack, so its
        # promises (in tokens) never add up to more blocks than a worker has.
        self.kv.set_block_size(self._block_size())
        info = self.kv.request_info(act.internal_id, prompt_tokens,
                                    min(remaining, self.max_model_len - prompt_tokens))
        # Either way a request must fit alone on the roomiest route, or it could never end.
        need = info.prompt_tokens + info.max_new_tokens
        fits = self._largest_route_kv_tokens()
        switching = self.recovery is not None and self.recovery.state == "loading"
        if need > fits and self._covered() and not switching:
            raise UserError(
                f"prompt + max_tokens: {need} tokens of KV cache needed, but no route can hold "
                f"more than {fits}; lower max_tokens"
            )
        waited = False
        uncovered_since: float | None = None
        # The core's admission order (scheduler/queue.py): only the head of the queue is
        # offered to the router; a replayed request (preempted, or re-routed after a fault)
        # waits ahead of new ones. A preempted one is first offered at the next admission
        # point (a request finishing), as the simulator does, unless nothing is running.
        queued = act.internal_id
        if replay_tokens or preempted:
            self.queue.requeue_preempted(queued)
        else:
            self.queue.arrive(queued)
        hold_off = preempted and bool(self.active)
        try:
            while True:
                if not self._covered():
                    uncovered_since = uncovered_since or asyncio.get_running_loop().time()
                    self._check_recovering(uncovered_since, replay=bool(act.generated))
                route = (self.router.route(info, self._node_states())
                         if self.queue.may_admit(queued) and not hold_off else None)
                hold_off = False
                if route is not None:
                    break
                if not waited:
                    if self.waiting >= self.max_queue and not preempted:
                        raise QueueFullError(f"waiting queue full ({self.max_queue} requests)")
                    self.waiting += 1
                    waited = True
                async with self._admit:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._admit.wait(), self.stats_interval_s)
        finally:
            self.queue.remove(queued)
            if waited:
                self.waiting -= 1
            if self.queue:  # admitted or gone: the next head may fit now
                self._spawn(self._notify_admit())
        self.kv.admit(info, [(h.name, h.end_layer - h.start_layer) for h in route.hops])
        act.epoch = self.epoch
        act.route_hops = route.hops
        act.route_addresses = tuple(self.nodes[h.name].address for h in route.hops)
        key = route.nodes
        self.hop_counts[key] = self.hop_counts.get(key, 0) + 1
        self.active[act.internal_id] = act

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
                    victim = self.kv.victim(r.node, act.internal_id) if r.node in self.kv.nodes \
                        else act.internal_id
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
        if act.reroutes >= self.max_reroutes and not stale:
            raise RequestFailedError(f"request {act.req.request_id}: {reason} "
                                     f"(gave up after {act.reroutes} re-routes)")
        if not stale:
            act.reroutes += 1
        log.warning("re-routing %s: %s", act.internal_id, reason)
        # Which hop failed? A worker reports an unreachable next hop before this coordinator's
        # own stream to it breaks: ask every hop, so the new route avoids the dead one.
        await asyncio.gather(*(self.nodes[h.name].check_alive() for h in act.route_hops))
        self.reroutes += 1
        await self._replay(act)

    async def _preempt(self, act: _Active, reason: str) -> None:
        """On-demand KV: a hop had no block left for this request's next token. Free its KV
        everywhere, wait for room ahead of new requests, and recompute prompt + tokens so far
        (vLLM's preemption by recompute). Not a fault, so not counted against max_reroutes."""
        self.preemptions += 1
        log.info("preempting %s (%d tokens generated): %s", act.internal_id, len(act.generated),
                 reason)
        await self._replay(act, preempted=True)

    async def _replay(self, act: _Active, preempted: bool = False) -> None:
        """Take the request off its route (KV released, router promise cancelled), admit it
        again and prefill prompt + tokens so far. A preempted request's freed KV may let
        waiting ones in, and it is admitted ahead of new requests."""
        old_id = act.internal_id
        self._release_kv(old_id, act.route_hops)
        self.router.on_cancel(old_id)
        self.kv.release(old_id)
        self.active.pop(old_id, None)
        # A fresh internal id: workers drop any late item of the old one (released ids).
        act.internal_id = self._new_internal_id(act.req)
        act.results = asyncio.Queue()
        act.pending.clear()
        if preempted and not self.active:
            self._spawn(self._notify_admit())  # nothing running will finish and wake it
        await self._route(act, replay_tokens=len(act.generated), preempted=preempted)
        self._send_prefill(act, act.req.prompt_token_ids + act.generated)

    def _finish(self, act: _Active) -> None:
        if self.active.pop(act.internal_id, None) is None:
            return
        self.router.on_finish(act.internal_id)
        self.kv.release(act.internal_id)
        self._release_kv(act.internal_id, act.route_hops)
        self._spawn(self._notify_admit())

    def _release_kv(self, internal_id: str, hops: tuple[NodeRange, ...]) -> None:
        # Also on nodes believed down: if only the stream broke, the worker still holds the KV
        # (a dead one fails the call at once).
        for h in hops:
            task = self._spawn(self.nodes[h.name].release([internal_id]))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _notify_admit(self) -> None:
        async with self._admit:
            self._admit.notify_all()


def _load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _config_max_len(model_dir: Path) -> int | None:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = cfg.get("max_position_embeddings")
    return int(value) if value else None


def check_vllm_versions(infos: dict[str, Any]) -> None:
    """Refuse workers of the vllm engine at different vLLM versions: a route through them would
    mix two versions' kernels and numerics (greedy outputs would depend on the route)."""
    versions: dict[str, list[str]] = {}
    for name, info in infos.items():
        if getattr(info, "engine", "") == "vllm":
            versions.setdefault(info.vllm_version or "unknown", []).append(name)
    if len(versions) > 1:
        found = "; ".join(f"{v} on {', '.join(sorted(n))}" for v, n in sorted(versions.items()))
        raise UserError(f"workers run different vLLM versions ({found}); the stages of a "
                        "route must run the same vLLM version: install one version everywhere")


def _chunk_tokens(info: Any, max_tokens: int) -> int:
    from helixserve.runtime.transport import prefill_chunk_tokens

    return prefill_chunk_tokens(info.hidden_size, info.dtype, max_tokens)


__all__ = [
    "Coordinator",
    "CoordinatorConfig",
    "GenerationRequest",
    "NoRouteError",
    "QueueFullError",
    "RequestFailedError",
    "TokenEvent",
]


def _routing_inputs(cluster: ClusterSpec, placement: Placement, cost: CostModel,
                    live: bool = False) -> RouterOptions:
    """What the router knows of the cluster, from the runtime's cost model (runtime/costs.py,
    the simulator's when the operator gives its profiles): the links it may use (so it never
    spreads work over a missing or slow link), each node's throughput, and the flows it
    routes over, evaluated here when the placement file has none (FORMATS.md lets an input
    placement omit them). `live`: ranges workers actually hold, which a memory check must
    not refuse."""
    from helixserve.scheduler.options import router_options

    model = cost.model
    if not placement.flows:
        from helixserve.planner import evaluate

        try:
            result = evaluate(cluster, model, cost, placement)
        except UserError:
            if not live:
                raise
            # a worker holds more layers than the cluster file says its memory fits: it
            # does, so evaluate the flow without the memory check
            cluster = dataclasses.replace(cluster, nodes=[
                dataclasses.replace(n, memory_gb=1e6) for n in cluster.nodes])
            result = evaluate(cluster, model, cost, placement)
        placement.flows = result.flows
        placement.throughput_tokens_per_s = result.throughput_tokens_per_s
    return router_options(cluster, model, placement, cost)
