"""Cache-aware routes: what each node's prefix cache holds, and which route reuses most of a
request's prefix for its load (docs/prefix-caching.md "Routing").

The index. Per node, the set of block names (helixserve/prefix.py) its engine holds, kept
from the `CacheEvents` its worker reports with each step's results (`PrefixIndex.apply`; a
reset empties the node first). A node taken down is forgotten (its next process reports a
reset anyway); a hop that refused a prefix (`PrefixMissError`) has those names dropped.
Matching walks a request's names from block 0 and stops at the first miss: a block is
usable only after every block before it.

What a route reuses. A request whose tokens the core knows (`CoreRequest.token_ids()`:
prompt + tokens generated so far, so a resumed request's re-prefill counts too) is named per
hop of a route, over the layers `[start_layer, end_layer)` that hop runs:

    matched(route) = min over hops h of matched_blocks(h.node, names(tokens, h.span))
    cached(route)  = reusable_tokens(matched(route), len(tokens), block_size)

(whole blocks, never the last prompt token). Names are kept per (request, span), hashed
only as far as a match walks (a few blocks past the first miss) and extended as the request
grows (`RequestNames`), so a request waiting at the head of the queue is not hashed again
at every admission point; within one decision, a hop shared by several candidates is
walked once.

The rule (`SchedulerPolicy.cache_aware`). Like Dynamo's KV router, which weighs each
worker's prefill blocks (what its cache does not hold) against its decode blocks (its load)
and takes the lowest, the core scores each candidate route by

    cost(route) = prefix_prefill_weight * (prompt_tokens - cached(route))
                + prefix_load_weight_tokens * max over hops h (queue_len(h) + active_requests(h))
                + prefix_flow_weight * flow_excess(route)

and admits the request on the cheapest. `flow_excess` is the router's (maxflow:
`MaxFlowRouter.flow_excess`): the work, in tokens of prompt + output, that the route's flow
edge furthest over its max-flow share has already carried beyond that share (minus its IWRR
credit, before the request's pick; 0 for an edge at or under its share, and for routers
without flow shares). The candidates are the router's own pick and the
routes recently taken (`RecentRoutes`, the `prefix_recent_routes` distinct routes admitted
last) that the current router accepts (a re-plan drops stale ones), whose nodes are all up
and whose KV can hold the request on every hop (the router's own mask: `kv_free_tokens >=
promise_tokens`). A conversation's previous turn left its history cached on the route it
took, which is therefore a candidate: turns stick to one route while it is up, its load
does not outweigh the prefix it saves, and the flow lets it. The router's pick wins ties
and is kept unless another candidate reuses at least one more whole block than it does, so
neither load nor flow alone ever overrides the router (its flow shares and balance stay its
own), and traffic with no cached prefix routes exactly as without the rule. With
`cache_aware` False the pick is taken as is, and `cached` is still computed for it.

The weights (SchedulerPolicy: 1.0 per token to compute, 64 tokens per request, 0.25
per token of work over the share): a route with one more request queued or running on its
busiest hop must save four more blocks of 16 tokens. Under light load this keeps
conversations (and their shared system prompt) on the routes already warm, and a cold route
gets a request only once the warm ones carry `saved tokens / prefix_load_weight_tokens`
more requests; under load it spreads them. The load term alone lets sequential traffic (one
request at a time, no load difference) stay on the one warm route forever, the others
idle: the flow term bounds that. A route saving S tokens is taken over the router's pick
only while its edges are less than `S / prefix_flow_weight` tokens of work over their
shares; beyond, the router's pick runs (and caches the prefix there too), and the work
down each edge converges to the flow's shares. Balanced traffic keeps every edge within
about one request of its share, so a conversation whose cached history saves more than
`prefix_flow_weight` times a request's work (a quarter, by default) keeps its route.

Measured (docs/prefix-caching.md "Routing"): on the simulator's multi-turn tests
(tests/unit/simulator/test_prefix_cache.py, maxflow) the flow term leaves the two one-node
routes' hit rate at 0.854 (plain routes 0.722) and on four two-stage routes lowers it from
0.836 to 0.813 while TTFT p50 drops from 0.030 s to 0.025 s (sticky conversations no longer
queue on the routes they warmed first). It trades prefix hits for balance; of 0.25, 0.5
and 1.0, 0.25 lost the fewest hits there and on helix-single-24.

Waiting (`prefix_wait_tokens`, default 1024). A candidate must have KV room for the
request now; a conversation whose route is full while another turn runs there (two
prefills of a few thousand tokens at once, on a small KV) would go to another route,
compute its whole history there and evict that route's conversations to hold it, which
then move in turn. So with cache-aware routes a request waits at the head of the queue
(the queue's rule: nobody behind it is admitted meanwhile) while a recent route that would
take at least `prefix_wait_tokens` more of its prompt from cache than the chosen route is
short of KV only because of requests running there (alive, accepted, and every hop short
of room has requests running); it is offered again when one ends. The router's pick is
undone (`cancel`: maxflow's credits). In the simulator on the demo's equal placement (4
conversations x 8 turns, 800-token user messages, 384 MiB, prefill 8 ms a token as on the
loaded demo) waiting raised the cache-aware hit rate from 0.57-0.71 to 0.77-0.80 and
lowered TTFT p90 from 38-72 s to 14-30 s; where no route was short, nothing changed
(docs/prefix-caching.md "Routing").

Shared prefixes do not steer. A prefix that several conversations share (a system prompt, a
tool's instructions) soon sits on every route that serves them: the first request a route
gets computes it once. Counted as a saving, it would send every new conversation to the
routes already warm, where the load term sees only the requests in flight, not the
conversations thinking between turns, so new conversations pile onto the first warm route;
their growing histories then overflow its KV or its flow share and are pushed off one by one,
each losing its history (on the demo's four routes with users who think between turns,
five of the first six conversations started on one route). So the rule treats the request's shared prefix
as cached on every candidate: `effective(route) = max(cached(route), shared)`, in the cost,
the one-more-block floor and the wait. A block is shared when two different blocks have
followed it in admitted prompts (`SharedPrefixes`: it is where two prompts branch; a
conversation's next turn only extends its last one, so its history never branches by
itself), and a request's shared prefix runs to the last such block of its prompt. New
conversations then take the router's pick (the flow's shares spread them), and only what is
their own, their history, keeps them on a route. The admission's cached tokens stay what its
route really holds.

Router state. Asking the router for its pick advances its policy (maxflow's IWRR credits;
the random and swarm coins). When another candidate is taken, `GraphRouter.take` tells the
router: maxflow undoes the pick's credit update and credits the route taken instead, so the
work sent down each flow edge still converges to the flow's shares; the coins of random and
swarm stay drawn (their order stays seeded and deterministic).

Pure and cheap: a set per node, a list of names per (request, span), no clocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from helixserve.prefix import (
    BlockHash,
    CacheEvents,
    block_hashes,
    extend_hashes,
    reusable_tokens,
)
from helixserve.scheduler.types import NodeState, RequestInfo, Route, Router


class PrefixIndex:
    """Per node, the block names its prefix cache holds (as its worker last reported)."""

    def __init__(self) -> None:
        self._held: dict[str, set[BlockHash]] = {}

    def apply(self, node: str, events: CacheEvents) -> None:
        """A node's report: a reset forgets what it held first, then removals and stores
        (a name is in at most one list, so their order does not matter)."""
        held = self._held.get(node)
        if held is None or events.reset:
            held = self._held[node] = set()
        held.difference_update(events.removed)
        held.update(events.stored)

    def forget(self, node: str) -> None:
        """Nothing is known of `node` any more (down, or its layers changed)."""
        self._held.pop(node, None)

    def drop(self, node: str, names: Iterable[BlockHash]) -> None:
        """`node` does not hold these (it refused them: evicted since its last report)."""
        held = self._held.get(node)
        if held:
            held.difference_update(names)

    def matched_blocks(self, node: str, names: Sequence[BlockHash]) -> int:
        """How many of `names`, consecutive from block 0, the node holds."""
        held = self._held.get(node)
        if not held:
            return 0
        for i, h in enumerate(names):
            if h not in held:
                return i
        return len(names)

    def blocks(self, node: str) -> int:
        """Names held by `node`."""
        return len(self._held.get(node, ()))

    def held(self, node: str) -> set[BlockHash] | None:
        """The names `node` holds (None: nothing known); read-only."""
        return self._held.get(node)


class RequestNames:
    """One request's block names per layer span, extended as its tokens grow."""

    __slots__ = ("by_span",)

    def __init__(self) -> None:
        self.by_span: dict[tuple[int, int], list[BlockHash]] = {}

    def names(self, tokens: Sequence[int], blocks: int, block_size: int, start_layer: int,
              end_layer: int) -> list[BlockHash]:
        """The names of the first `blocks` blocks of `tokens` computed on layers
        `[start_layer, end_layer)`; hashed once per block whatever the calls."""
        have = self.by_span.get((start_layer, end_layer))
        if have is None:
            have = self.by_span[start_layer, end_layer] = block_hashes(
                tokens, block_size, start_layer, end_layer, max_blocks=blocks)
        elif len(have) < blocks:
            extend_hashes(have, tokens[:blocks * block_size], block_size, start_layer,
                          end_layer)
        return have if len(have) <= blocks else have[:blocks]

    def matched(self, held: set[BlockHash] | None, tokens: Sequence[int], blocks: int,
                block_size: int, start_layer: int, end_layer: int) -> int:
        """How many of the first `blocks` names on layers `[start_layer, end_layer)`,
        consecutive from block 0, are in `held`. Names are hashed only as far as the walk
        goes (a few blocks past the first miss), and kept."""
        if not held or blocks <= 0:
            return 0
        have = self.by_span.get((start_layer, end_layer))
        if have is None:
            have = self.by_span[start_layer, end_layer] = []
        i = 0
        while i < blocks:
            if i == len(have):  # hash on, doubling: O(blocks) in all
                target = min(blocks, max(8, 2 * len(have)))
                extend_hashes(have, tokens[:target * block_size], block_size, start_layer,
                              end_layer)
            if have[i] not in held:
                return i
            i += 1
        return blocks


class RecentRoutes:
    """The last `size` distinct routes admitted, most recent last (the candidates besides
    the router's pick)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._routes: OrderedDict[Route, None] = OrderedDict()

    def taken(self, route: Route) -> None:
        if self.size <= 0:
            return
        self._routes[route] = None
        self._routes.move_to_end(route)
        while len(self._routes) > self.size:
            self._routes.popitem(last=False)

    def __iter__(self) -> Iterator[Route]:
        return reversed(self._routes)  # most recent first

    def __len__(self) -> int:
        return len(self._routes)


@dataclass(frozen=True)
class RouteWeights:
    """The cache-aware rule's weights (SchedulerPolicy's `prefix_*_weight*` fields, whose
    docs give the defaults)."""

    #: cost of each prompt token a route would compute (not in its cache)
    prefill: float
    #: cost, in prompt tokens, of each request queued or running on the busiest hop
    load_tokens: float
    #: cost of each token of work the route's edges carried beyond their flow shares
    flow: float
    #: wait for a recent route short of KV that would reuse at least this many more
    #: tokens than the chosen one (0: never wait)
    wait_tokens: float = 0.0


def _prefill(tokens: Sequence[int], info: RequestInfo) -> Sequence[int]:
    """The tokens its prefill runs (a caller's list may run ahead of the core's count)."""
    return tokens[:info.prompt_tokens] if len(tokens) > info.prompt_tokens else tokens


def route_load(route: Route, state: Mapping[str, NodeState]) -> int:
    """The load term: work queued or running on the route's busiest hop."""
    load = 0
    for h in route.hops:
        s = state.get(h.name)
        if s is not None:
            load = max(load, s.queue_len + s.active_requests)
    return load


#: the blocks `SharedPrefixes` remembers (least recently seen dropped first): 65,536 blocks,
#: about a million prompt tokens at 16 a block, some 10 MB
SHARED_BLOCKS_KEPT = 1 << 16
#: the span its names are taken over: the token chain alone, whatever the layers
_CHAIN_SPAN = (0, 0)
#: a block two different blocks have followed
_BRANCH = b""


class SharedPrefixes:
    """Where admitted prompts branch: per block of a prompt's token chain, the block that
    followed it, or `_BRANCH` once two different ones have (module doc, "Shared prefixes")."""

    def __init__(self, kept: int = SHARED_BLOCKS_KEPT) -> None:
        self.kept = kept
        self._next: OrderedDict[BlockHash, BlockHash] = OrderedDict()

    def add(self, chain: Sequence[BlockHash]) -> None:
        """An admitted prompt's block names, in order."""
        nxt = self._next
        for parent, child in zip(chain, chain[1:], strict=False):
            seen = nxt.get(parent)
            if seen is None:
                nxt[parent] = child
            else:
                if seen != child and seen != _BRANCH:
                    nxt[parent] = _BRANCH
                nxt.move_to_end(parent)
        while len(nxt) > self.kept:
            nxt.popitem(last=False)

    def shared_blocks(self, chain: Sequence[BlockHash]) -> int:
        """Blocks of `chain` from block 0 through the last one where prompts branched."""
        nxt = self._next
        shared = 0
        for i, h in enumerate(chain):
            seen = nxt.get(h)
            if seen is None:
                break
            if seen == _BRANCH:
                shared = i + 1
        return shared


class PrefixRouting:
    """The core's prefix state: the index, each request's names, the recent routes and the
    counters, per node (`stats`: node -> [prompt tokens queried, tokens hit]) and per
    admission (`total`: the same, once per request whatever its hops)."""

    def __init__(self, recent_routes: int) -> None:
        self.index = PrefixIndex()
        self.names: dict[str, RequestNames] = {}
        self.recent = RecentRoutes(recent_routes)
        self.shared = SharedPrefixes()
        self.stats: dict[str, list[int]] = {}
        self.total = [0, 0]

    def matched(self, request_id: str, tokens: Sequence[int], route: Route,
                block_size: int,
                memo: dict[tuple[str, int, int], int] | None = None) -> int:
        """Whole blocks of `tokens` every hop of `route` holds (only blocks a prefill could
        take from cache: never the one with the last token). `memo`: per (node, span) the
        blocks matched, shared by the candidates of one decision (routes share hops)."""
        cap = max(0, len(tokens) - 1) // block_size
        if cap == 0:
            return 0
        names = self.names.get(request_id)
        if names is None:
            names = self.names[request_id] = RequestNames()
        blocks = cap
        for h in route.hops:
            key = (h.name, h.start_layer, h.end_layer)
            m = None if memo is None else memo.get(key)
            if m is None:
                # memoised: the whole walk, for any route; else only as far as it matters
                m = names.matched(self.index.held(h.name), tokens,
                                  cap if memo is not None else blocks, block_size,
                                  h.start_layer, h.end_layer)
                if memo is not None:
                    memo[key] = m
            blocks = min(blocks, m)
            if blocks == 0:
                break
        return blocks

    def count(self, route: Route, prompt_tokens: int, cached_tokens: int,
              sign: int = 1) -> None:
        """An admission's lookup, counted on every hop and once in the total (vLLM's
        queries / hits counters); `sign` -1 takes back one that never ran."""
        for h in route.hops:
            c = self.stats.get(h.name)
            if c is None:
                c = self.stats[h.name] = [0, 0]
            c[0] += sign * prompt_tokens
            c[1] += sign * cached_tokens
        self.total[0] += sign * prompt_tokens
        self.total[1] += sign * cached_tokens

    def _chain(self, request_id: str, tokens: Sequence[int], block_size: int) -> list[BlockHash]:
        names = self.names.get(request_id)
        if names is None:
            names = self.names[request_id] = RequestNames()
        return names.names(tokens, len(tokens) // block_size, block_size, *_CHAIN_SPAN)

    def admitted(self, request_id: str, tokens: Sequence[int], info: RequestInfo,
                 block_size: int) -> None:
        """A request's first admission: its prompt joins the shared prefixes' record."""
        self.shared.add(self._chain(request_id, _prefill(tokens, info), block_size))

    def shared_tokens(self, request_id: str, tokens: Sequence[int], block_size: int) -> int:
        """Tokens of the prefill `tokens` that are a prefix other prompts share."""
        if not tokens:
            return 0
        chain = self._chain(request_id, tokens, block_size)
        return reusable_tokens(self.shared.shared_blocks(chain), len(tokens), block_size)

    def cached_tokens(self, request_id: str, tokens: Sequence[int], info: RequestInfo,
                      route: Route, block_size: int) -> int:
        """Tokens of the request's prefill that every hop of `route` holds."""
        tokens = _prefill(tokens, info)
        return reusable_tokens(self.matched(request_id, tokens, route, block_size),
                               len(tokens), block_size)

    def route(self, request_id: str, tokens: Sequence[int], info: RequestInfo, pick: Route,
              router: Router, view: Mapping[str, NodeState], block_size: int,
              weights: RouteWeights,
              fits: Callable[[Route], bool] | None = None) -> tuple[Route, int] | None:
        """The cache-aware choice (module doc) and its cached tokens, or None: wait for a
        busy route holding more of the prompt ("Waiting"; the caller undoes the router's
        pick). `pick`: the router's route for `info`; `fits`: the KV ledger's extra check,
        when it makes one. The router is told when another route is taken (`take`), and the
        route joins the recent ones."""
        tokens = _prefill(tokens, info)
        need = info.promise_tokens

        def usable(route: Route) -> bool:
            for h in route.hops:
                s = view.get(h.name)
                if s is None or not s.alive or s.kv_free_tokens < need:
                    return False
            return router.accepts(route) and (fits is None or fits(route))

        # the flow term: routers with flow shares say how far over its share a route would
        # be (MaxFlowRouter.flow_excess); a Router without them adds nothing
        flow_excess = getattr(router, "flow_excess", None)
        excess: Callable[[Route], float] | None = None
        if flow_excess is not None and weights.flow > 0:
            def excess(route: Route) -> float:
                return float(flow_excess(route))
        shared = self.shared_tokens(request_id, tokens, block_size)
        route, cached = self.choose(request_id, tokens, pick, usable, view, block_size,
                                    weights, excess, shared)
        if weights.wait_tokens > 0:
            def busy(route: Route) -> bool:
                """Alive and accepted, and short of KV for the request only on hops where
                requests run (whose end frees it)."""
                short = False
                for h in route.hops:
                    s = view.get(h.name)
                    if s is None or not s.alive:
                        return False
                    if s.kv_free_tokens < need:
                        if s.active_requests == 0:
                            return False
                        short = True
                return short and router.accepts(route)

            for other in self.recent:
                if other == route or not busy(other):
                    continue
                saved = reusable_tokens(self.matched(request_id, tokens, other, block_size),
                                        len(tokens), block_size)
                if max(saved, shared) - max(cached, shared) >= weights.wait_tokens:
                    return None
        if route != pick:
            # the router advanced its policy for `pick`; routers with state (maxflow's
            # credits) take that back (GraphRouter.take; a Router without it keeps it)
            take = getattr(router, "take", None)
            if take is not None:
                take(pick, route, info, view)
        self.recent.taken(route)
        return route, cached

    def choose(self, request_id: str, tokens: Sequence[int], pick: Route,
               usable: Callable[[Route], bool], state: Mapping[str, NodeState],
               block_size: int, weights: RouteWeights,
               excess: Callable[[Route], float] | None = None,
               shared: int = 0) -> tuple[Route, int]:
        """The cheapest candidate by the module's rule and its cached tokens: `pick` (the
        router's), or a recent route `usable` accepts that reuses a block more than it.
        `excess`: work beyond its flow share a route would carry (the flow term; None: 0).
        `shared`: tokens of the prompt other prompts share, counted as cached on every
        candidate ("Shared prefixes do not steer"); the cached tokens returned are the
        route's own."""
        prompt = len(tokens)

        def cost(route: Route, cached: int) -> float:
            c = weights.prefill * (prompt - max(cached, shared)) + \
                weights.load_tokens * route_load(route, state)
            return c if excess is None else c + weights.flow * excess(route)

        memo: dict[tuple[str, int, int], int] = {}
        best = pick
        best_cached = reusable_tokens(self.matched(request_id, tokens, pick, block_size, memo),
                                      prompt, block_size)
        best_cost: float | None = None  # the pick's, computed once another route qualifies
        floor = max(best_cached, shared) + block_size
        for route in self.recent:
            if route == pick or not usable(route):
                continue
            cached = reusable_tokens(
                self.matched(request_id, tokens, route, block_size, memo), prompt, block_size)
            if cached < floor:
                continue
            if best_cost is None:
                best_cost = cost(pick, best_cached)
            c = cost(route, cached)
            if c < best_cost:
                best, best_cached, best_cost = route, cached, c
        return best, best_cached

    def names_of(self, request_id: str, tokens: Sequence[int], blocks: int, block_size: int,
                 start_layer: int, end_layer: int) -> list[BlockHash]:
        """The request's names of its first `blocks` blocks on layers `[start_layer,
        end_layer)`: those its admission matched (kept), hashed only if never walked."""
        names = self.names.get(request_id)
        if names is None:
            names = self.names[request_id] = RequestNames()
        return list(names.names(tokens, blocks, block_size, start_layer, end_layer))

    def forget_request(self, request_id: str) -> None:
        self.names.pop(request_id, None)

    def rename(self, old: str, new: str) -> None:
        names = self.names.pop(old, None)
        if names is not None:
            self.names[new] = names
