"""The scheduling core: one object decides admission, routes, KV held and preemption, for
the simulator and the live coordinator alike (docs/scheduler.md). Both are loops that turn
their events (a simulated event, a network message) into calls of this object and carry out
the typed decisions it returns, as vLLM v1's engine loop drives its `Scheduler`:

    core = SchedulerCore(router, SchedulerPolicy(kv=KvPolicy("on-demand")), capacities)
    core.arrive(CoreRequest("r1", prompt_tokens=120, max_new_tokens=64))
    for d in core.schedule():       # Admission(request_id, route, ...) | Rejection(...)
        ...send the prompt along d.route...
    core.on_token("r1")             # Grown() | Preempted(victims): requeued; replay them
    core.finish("r1")               # KV released; an admission point

What it owns:
- the admission queue (scheduler/queue.py: FIFO, head-of-line, preempted requests first);
- the router (scheduler/__init__.py's policies): pure ordering over the core's view;
- ONE KV ledger (scheduler/kv.py's `KvBook`): what each request holds and is promised on
  every node of its route; the view the router reads is the ledger's;
- which nodes are down, and each request's replay size and re-route count;
- what each node's prefix cache holds (scheduler/prefix.py, from the workers' cache events)
  and the cache-aware choice among routes: an admission says how many leading tokens every
  hop takes from cache (`Admission.cached_tokens`).

Its policy is a `SchedulerPolicy` (scheduler/policy.py); what it is told of a request and
what it answers (`CoreRequest`, `Admission`, `Rejection`, `Grown`, `Preempted`) and the
errors it raises are in scheduler/decisions.py. All are importable from here too.

Admission points. The queue is offered to the router only at an admission point: a request
arriving at an empty queue, a request finishing, nothing running, a node coming back, a
request's first token while the prefill cap is reached, or `wake()` (the coordinator's
periodic retry, when worker reports may have changed capacities). A request preempted while
others run waits for the next one (it must not take back at once the room its preemption
made for a growing request); `schedule()` admits from the head for as long as routes are
found. Everything here is pure and synchronous: no clocks, sockets or threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from helixserve.prefix import BlockHash, CacheEvents
from helixserve.scheduler.decisions import (
    GROWN,
    Admission,
    CoreRequest,
    Grown,
    NeverFitsError,
    Preempted,
    QueueFullError,
    Rejection,
    RerouteLimitError,
)
from helixserve.scheduler.kv import KvBook
from helixserve.scheduler.policy import SchedulerPolicy
from helixserve.scheduler.prefix import PrefixRouting, RouteWeights
from helixserve.scheduler.queue import AdmissionQueue
from helixserve.scheduler.types import NodeState, RequestInfo, Route, Router

__all__ = ["GROWN", "Admission", "CoreRequest", "Grown", "NeverFitsError", "Preempted",
           "QueueFullError", "Rejection", "RerouteLimitError", "SchedulerCore",
           "SchedulerPolicy"]


class SchedulerCore:
    """See the module doc. `router`: a policy from `make_router`; `capacities`: KV tokens per
    node (the simulator's memory model, or the workers' reports)."""

    def __init__(self, router: Router, policy: SchedulerPolicy,
                 capacities: Mapping[str, int] | None = None) -> None:
        self.policy = policy.check()
        self.router = router
        self.kv = KvBook(policy.kv, capacities or {}, strict=policy.exact_capacities)
        self.queue: AdmissionQueue[str] = AdmissionQueue()
        #: every request waiting or running, by id
        self.requests: dict[str, CoreRequest] = {}
        #: nodes taken down by the caller (a broken stream, a failed load)
        self.down: set[str] = set()
        self.prefilling = 0
        self.preemptions = 0
        self._routes: dict[str, Route] = {}
        #: tokens each running request's admission took from cache (when any)
        self._cached: dict[str, int] = {}
        self._wake = False
        #: (version of the capacities and liveness it was computed for, the value)
        self._largest: tuple[int, int] = (-1, 0)
        self._version = 0
        #: new arrivals since the last `schedule()`, checked against the queue bound there
        self._fresh: list[str] = []
        #: what each node's prefix cache holds, request names, recent routes, counters
        self.prefix = PrefixRouting(policy.prefix_recent_routes)
        #: requests whose prefix-cache lookup is counted (once per request, as vLLM counts
        #: only a request's first scheduling in its queries / hits): (route, prompt, cached)
        #: while the admission counted may still be refused by a hop (`prefix_miss` takes it
        #: back and the next admission counts instead), None once it ran
        self._lookups: dict[str, tuple[Route, int, int] | None] = {}
        #: when a list: the decisions in order (the end-to-end check of the two loops):
        #: ("arrive", id, prompt, output), ("wake",) when admission runs, ("admit", id,
        #: route nodes, {node: kv_free_tokens the router saw}, prompt, output left, resumed,
        #: cached tokens),
        #: ("token", id), ("finish", id), ("preempt", victim, node, requester), ("reject", id)
        self.log: list[tuple[Any, ...]] | None = None

    # ---- the view --------------------------------------------------------------------------

    @property
    def view(self) -> dict[str, NodeState]:
        """What the router reads: one NodeState per node, kept up to date by the ledger."""
        return self.kv.states()

    def report(self, node: str, capacity_tokens: int, queue_len: int = 0,
               alive: bool = True) -> None:
        """A worker's report (the coordinator's stats poll): its KV capacity in tokens, its
        queue, whether its stream is up."""
        kv = self.kv.nodes.get(node)
        if kv is None or kv.capacity_tokens != capacity_tokens:
            self._version += 1
        state = self.kv.set_capacity(node, capacity_tokens).state
        state.queue_len = queue_len
        alive = alive and node not in self.down
        if state.alive != alive:
            state.alive = alive
            self._version += 1

    def set_block_size(self, block_size: int) -> None:
        if self.policy.prefix_block_size is None and block_size != self.kv.policy.block_size:
            self.prefix.names.clear()  # names depend on the block size
        self.kv.set_block_size(block_size)

    @property
    def prefix_block_size(self) -> int:
        """Tokens per named block: the policy's, else the KV block size."""
        return self.policy.prefix_block_size or self.kv.policy.block_size

    # ---- prefix caching (scheduler/prefix.py) -----------------------------------------------

    def on_cache_events(self, node: str, events: CacheEvents) -> None:
        """A worker's report of what its prefix cache stored and removed (with its results)."""
        self.prefix.index.apply(node, events)

    def prefix_miss(self, request_id: str, node: str, names: Iterable[BlockHash] = ()) -> None:
        """`node` refused the request's cached prefix (evicted since its last report): forget
        `names` there, or, when the worker listed none, the names of the blocks the
        admission took from cache for the layers the request's hop runs there (kept from
        the admission's decision: nothing is hashed again). Then queue the request again,
        not counted against `max_reroutes` (not a fault); the caller replays it."""
        dropped = list(names)
        route = self._routes.get(request_id)
        cached = self._cached.get(request_id, 0)
        req = self.requests[request_id]
        tokens = req.token_ids()
        if not dropped and route is not None and cached and tokens is not None:
            bs = self.prefix_block_size
            for h in route.hops:
                if h.name == node:
                    dropped = self.prefix.names_of(request_id, tokens, cached // bs, bs,
                                                   h.start_layer, h.end_layer)
        self.prefix.index.drop(node, dropped)
        lookup = self._lookups.get(request_id)
        if lookup is not None:  # the admission never ran: its lookup is not counted
            self.prefix.count(*lookup, sign=-1)
            del self._lookups[request_id]
        self.reroute(request_id, counted=False)

    def prefix_stats(self) -> dict[str, tuple[int, int]]:
        """Per node: (prompt tokens looked up, tokens taken from cache) of the requests
        routed over it, each request counted once (`prefix_totals`)."""
        return {node: (c[0], c[1]) for node, c in self.prefix.stats.items()}

    def prefix_totals(self) -> tuple[int, int]:
        """(prompt tokens looked up, tokens taken from cache) over requests, once each, as
        vLLM's `prefix_cache_queries` / `prefix_cache_hits` count them: at the admission that
        ran, not at one a hop refused (`prefix_miss`: counted at the next), and not again
        when a preempted or re-routed request is admitted again (vLLM counts those apart,
        as `preempted_queries` / `preempted_hits`, in no exported counter)."""
        return self.prefix.total[0], self.prefix.total[1]

    def node_down(self, node: str) -> None:
        self.down.add(node)
        self.prefix.index.forget(node)  # a new process reports a reset; be safe meanwhile
        self._version += 1
        if node in self.kv.nodes:
            self.kv.nodes[node].state.alive = False

    def node_up(self, node: str) -> None:
        """The node is back (its stream reconnected): an admission point."""
        self.down.discard(node)
        self._version += 1
        if node in self.kv.nodes:
            self.kv.nodes[node].state.alive = True
        self._wake = True

    def install(self, router: Router, down: Iterable[str] = ()) -> list[str]:
        """Route over another placement from now on (a re-plan), with `down` the nodes that
        are down now (marks made while the ranges changed are dropped). Running requests
        keep their route and KV; returns those whose route the new placement does not
        hold."""
        self.router = router
        for node in self.down - set(down):
            if node in self.kv.nodes:
                self.kv.nodes[node].state.alive = True
        self.down = set()
        for node in down:
            self.node_down(node)
        self._version += 1
        self._wake = True
        return [rid for rid, hold in self.kv.holds.items()
                if not router.accepts(self._routes[rid])]

    def wake(self) -> None:
        """An admission point the caller knows of (capacities may have changed)."""
        self._wake = True

    # ---- requests --------------------------------------------------------------------------

    def arrive(self, req: CoreRequest, check_fit: bool = True) -> None:
        """A new request waits for admission. Raises NeverFitsError (policy
        `refuse_never_fits`, unless `check_fit` is False: the caller knows capacities are
        about to change) when no route could ever hold it."""
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already known")
        if self.policy.refuse_never_fits and check_fit:
            self._check_fits_alone(req)
        if self.log is not None:
            self.log.append(("arrive", req.request_id, req.prompt_tokens, req.max_new_tokens))
        self.requests[req.request_id] = req
        if not self.queue:
            self._wake = True
        self.queue.arrive(req.request_id)
        self._fresh.append(req.request_id)

    def admit_now(self, req: CoreRequest, now_s: float = 0.0) -> Admission | None:
        """Admit `req` at once if the queue is empty and a route has room, without queueing
        it (the Helix host's feeder, which drops what it cannot place)."""
        if self.queue or req.request_id in self.requests:
            return None
        self.requests[req.request_id] = req
        admission = self._try_admit(req, now_s)
        if admission is None:
            del self.requests[req.request_id]
        return admission

    def schedule(self, now_s: float = 0.0) -> list[Admission | Rejection]:
        """Admit from the head of the queue while routes are found, at an admission point;
        refuse new arrivals beyond the queue bound. `now_s`: the caller's clock (the
        ledger's KV-time integrals)."""
        out: list[Admission | Rejection] = []
        if self._wake or not self.kv.holds:
            self._wake = False
            if self.log is not None:
                self.log.append(("wake",))
            cap = self.policy.max_prefilling
            while self.queue and (cap is None or self.prefilling < cap):
                rid = self.queue[0]
                admission = self._try_admit(self.requests[rid], now_s)
                if admission is None:
                    if not (self.policy.reject_unroutable_when_idle and not self.kv.holds):
                        break
                    out.append(self._drop_head(rid, "no route could hold it on an idle "
                                                    "cluster"))
                    continue
                self.queue.admitted()
                out.append(admission)
        bound = self.policy.max_queue
        if bound is not None:
            for rid in self._fresh:
                if rid in self.requests and rid not in self.kv.holds and len(self.queue) > bound:
                    self.queue.remove(rid)
                    del self.requests[rid]
                    out.append(Rejection(rid, f"waiting queue full ({bound} requests)"))
        self._fresh.clear()
        return out

    def on_token(self, request_id: str, now_s: float = 0.0) -> Grown | Preempted:
        """The request generated a token and goes on: its next step takes one more KV slot on
        every node of its route (on demand). With exact capacities a full node preempts by
        the victim rule first."""
        req = self.requests[request_id]
        req.generated += 1
        if self.log is not None:
            self.log.append(("token", request_id))
        self._first_token(req)
        if not self.kv.policy.on_demand:
            return GROWN
        victims: list[str] = []
        hold = self.kv.holds.get(request_id)
        if self.policy.exact_capacities and hold is not None:
            for n in hold.nodes:
                while n.full:
                    victim = self.kv.victim(n.name, request_id)
                    if self.log is not None:
                        self.log.append(("preempt", victim, n.name, request_id))
                    n.preempted += 1
                    self._preempt(victim, now_s)
                    victims.append(victim)
                    if victim == request_id:
                        return Preempted(tuple(victims))
        self.kv.grow(request_id, now_s)
        return Preempted(tuple(victims)) if victims else GROWN

    def kv_full(self, node: str, requester: str) -> str:
        """A worker had no KV block for `requester`'s next step on `node`: the victim rule's
        choice, preempted (requeued; the caller replays it)."""
        victim = self.kv.victim(node, requester) if node in self.kv.nodes else requester
        if self.log is not None:
            self.log.append(("preempt", victim, node, requester))
        if node in self.kv.nodes:
            self.kv.nodes[node].preempted += 1
        self._preempt(victim)
        return victim

    def finish(self, request_id: str, now_s: float = 0.0) -> None:
        """The request ended (finished, cancelled, failed, or gave up waiting): free what it
        holds, or take it out of the queue. An admission point."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if self.log is not None:
            self.log.append(("finish", request_id))
        if req.prefilling:
            self.prefilling -= 1
        if self.kv.release(request_id, now_s) is None:
            self.queue.remove(request_id)
        self._routes.pop(request_id, None)
        self._cached.pop(request_id, None)
        self._lookups.pop(request_id, None)
        self.prefix.forget_request(request_id)
        self._wake = True

    def reroute(self, request_id: str, counted: bool = True) -> None:
        """The request's route failed (a node down, a step lost): free its KV and queue it
        again ahead of new ones, to replay prompt + tokens so far. An admission point.
        `counted`: against `max_reroutes` (RerouteLimitError past it); a request routed
        before a re-plan is not, its route was stale, not unlucky."""
        req = self.requests[request_id]
        limit = self.policy.max_reroutes
        if counted:
            if limit is not None and req.reroutes >= limit:
                raise RerouteLimitError(f"gave up after {req.reroutes} re-routes")
            req.reroutes += 1
        if request_id in self.kv.holds:
            self._preempt(request_id, count=False)
        self._wake = True

    def may_reroute(self, request_id: str) -> bool:
        """Whether a counted re-route is still within `max_reroutes`."""
        limit = self.policy.max_reroutes
        return limit is None or self.requests[request_id].reroutes < limit

    def rename(self, old: str, new: str) -> None:
        """Go on under another id (the coordinator's fresh id for a replay, so workers drop
        late items of the old one)."""
        req = self.requests.pop(old)
        req.request_id = new
        self.requests[new] = req
        self.prefix.rename(old, new)
        if old in self._lookups:
            self._lookups[new] = self._lookups.pop(old)
        if old in self.queue:
            self.queue[self.queue.index(old)] = new

    # ---- queries ---------------------------------------------------------------------------

    @property
    def at_admission_point(self) -> bool:
        """Whether `schedule()` would offer the queue to the router now."""
        return self._wake or not self.kv.holds

    @property
    def prefill_capped(self) -> bool:
        cap = self.policy.max_prefilling
        return cap is not None and self.prefilling >= cap

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def running(self) -> int:
        return len(self.kv.holds)

    def route_of(self, request_id: str) -> Route | None:
        return self._routes.get(request_id)

    def largest_route_kv_tokens(self) -> int:
        """KV tokens the roomiest route could give one request on an idle cluster: per layer
        the largest capacity among live nodes holding it, the smallest over layers (0 when a
        layer has no live holder)."""
        version, value = self._largest
        if version == self._version:
            return value
        ranges = getattr(self.router, "ranges", {})
        num_layers = getattr(self.router, "num_layers", 0)
        best = [0] * num_layers
        for name, r in ranges.items():
            n = self.kv.nodes.get(name)
            if n is None or not n.state.alive:
                continue
            for layer in range(r.start_layer, r.end_layer):
                best[layer] = max(best[layer], n.capacity_tokens)
        value = min(best, default=0)
        self._largest = (self._version, value)
        return value

    def max_new_tokens(self, prompt_tokens: int) -> int:
        """Most tokens a request of this prompt could generate on the roomiest route (its KV
        holds prompt + output, plus the block slack admission asks for)."""
        return self.largest_route_kv_tokens() - prompt_tokens - (self.kv.policy.block_size - 1)

    # ---- internals -------------------------------------------------------------------------

    def _info(self, req: CoreRequest) -> RequestInfo:
        prompt = req.prompt_tokens + req.generated
        remaining = max(1, req.max_new_tokens - req.generated)
        if self.policy.max_model_len is not None:
            remaining = min(remaining, self.policy.max_model_len - prompt)
        return self.kv.request_info(req.request_id, prompt, remaining)

    def _check_fits_alone(self, req: CoreRequest) -> None:
        info = self._info(req)
        need = info.prompt_tokens + info.max_new_tokens
        fits = self.largest_route_kv_tokens()
        if need > fits and fits > 0:
            raise NeverFitsError(
                f"prompt + max_tokens: {need} tokens of KV cache needed, but no route can hold "
                f"more than {fits}; lower max_tokens")

    def _try_admit(self, req: CoreRequest, now_s: float) -> Admission | None:
        info = self._info(req)
        seen = None if self.log is None else \
            {name: st.kv_free_tokens for name, st in self.view.items()}
        route = self.router.route(info, self.view)
        if route is None:
            return None
        if self.kv.policy.expected_output_tokens is not None and \
                not self.kv.fits(info, route.nodes):
            # promised within the expectation, but the requests there grew past theirs
            return None
        cached = 0
        tokens = req.token_ids() if self.policy.prefix_caching else None
        if tokens is not None:
            chosen = self._prefix_route(req.request_id, tokens, info, route)
            if chosen is None:  # waits for the route holding its prefix
                cancel = getattr(self.router, "cancel", None)
                if cancel is not None:
                    cancel()
                return None
            route, cached = chosen
            if req.request_id not in self._lookups:
                self.prefix.count(route, info.prompt_tokens, cached)
                self._lookups[req.request_id] = (route, info.prompt_tokens, cached)
                if self.policy.cache_aware:
                    self.prefix.admitted(req.request_id, tokens, info, self.prefix_block_size)
        self.kv.admit(info, [(h.name, h.end_layer - h.start_layer) for h in route.hops], now_s)
        self._routes[req.request_id] = route
        if cached:
            self._cached[req.request_id] = cached
        req.prefilling = True
        self.prefilling += 1
        if self.log is not None:
            self.log.append(("admit", req.request_id, route.nodes, seen, info.prompt_tokens,
                             req.max_new_tokens - req.generated, req.resumed, cached))
        return Admission(req.request_id, route, info, req.resumed, cached)

    def _prefix_route(self, request_id: str, tokens: Sequence[int], info: RequestInfo,
                      pick: Route) -> tuple[Route, int] | None:
        """The route to admit on and its cached tokens (scheduler/prefix.py's rule)."""
        p = self.policy
        if not p.cache_aware:
            return pick, self.prefix.cached_tokens(request_id, tokens, info, pick,
                                                   self.prefix_block_size)
        check_fit = self.kv.policy.expected_output_tokens is not None
        return self.prefix.route(
            request_id, tokens, info, pick, self.router, self.view, self.prefix_block_size,
            RouteWeights(p.prefix_prefill_weight, p.prefix_load_weight_tokens,
                         p.prefix_flow_weight, p.prefix_wait_tokens),
            (lambda r: self.kv.fits(info, r.nodes)) if check_fit else None)

    def _drop_head(self, rid: str, reason: str) -> Rejection:
        self.queue.admitted()
        del self.requests[rid]
        if self.log is not None:
            self.log.append(("reject", rid))
        return Rejection(rid, reason)

    def _first_token(self, req: CoreRequest) -> None:
        if req.prefilling:
            req.prefilling = False
            self.prefilling -= 1
            if self.policy.max_prefilling is not None:
                self._wake = True

    def _preempt(self, request_id: str, now_s: float = 0.0, count: bool = True) -> None:
        """Free the request's KV and queue it ahead of new ones; it replays prompt + tokens so
        far. An admission point only when nothing else runs (or by policy)."""
        req = self.requests[request_id]
        if req.prefilling:
            req.prefilling = False
            self.prefilling -= 1
        self.kv.release(request_id, now_s)
        self._routes.pop(request_id, None)
        self._cached.pop(request_id, None)
        if request_id in self._lookups:
            self._lookups[request_id] = None  # it ran: admitted again, it is not counted
        req.resumed = True
        self.queue.requeue_preempted(request_id)
        if count:
            self.preemptions += 1
        if not self.policy.preempted_wait or not self.kv.holds:
            self._wake = True
