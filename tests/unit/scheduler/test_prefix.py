"""Cache-aware routes in the scheduling core (scheduler/prefix.py): the prefix index, the
cached tokens an admission takes, the route choice and what it leaves in the router.

Pure: cores over small placements, fed cache events by hand as workers would send them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

import helixserve.prefix as prefix_mod
from helixserve.errors import UserError
from helixserve.planner.placement import Flow, NodeRange, Placement
from helixserve.prefix import CacheEvents, block_hashes, reusable_tokens
from helixserve.scheduler import make_router
from helixserve.scheduler.core import Admission, CoreRequest, SchedulerCore, SchedulerPolicy
from helixserve.scheduler.kv import KvPolicy
from helixserve.scheduler.prefix import PrefixIndex, RecentRoutes, RequestNames, SharedPrefixes
from helixserve.scheduler.types import NodeState, RequestInfo, Route
from helixserve.spec.cluster import COORDINATOR as C
from tests.unit.scheduler.test_core import placement

BS = 4  # tokens per block in these tests


@dataclass
class Req(CoreRequest):
    """A request whose tokens are known (the runtime's InFlight, the simulator's)."""

    tokens: tuple[int, ...] = ()

    def token_ids(self) -> Sequence[int]:
        return self.tokens[:self.prompt_tokens + self.generated]


def req(rid: str, tokens: Sequence[int], output: int = 4) -> Req:
    return Req(rid, len(tokens), output, tokens=tuple(tokens))


def make_core(ranges: dict[str, tuple[int, int]], capacity: int = 1000,
              router: str = "maxflow", **fields: object) -> SchedulerCore:
    kv = fields.pop("kv", KvPolicy("reserve"))
    c = SchedulerCore(make_router(router, placement(ranges)),
                      SchedulerPolicy(kv=kv, **fields),  # type: ignore[arg-type]
                      dict.fromkeys(ranges, capacity))
    c.set_block_size(BS)
    return c


def holds(c: SchedulerCore, node: str, tokens: Sequence[int], start: int, end: int,
          blocks: int | None = None, reset: bool = False) -> None:
    """`node` reports it holds the first `blocks` blocks of `tokens` for layers [start, end)."""
    c.on_cache_events(node, CacheEvents(block_hashes(tokens, BS, start, end, blocks),
                                        reset=reset))


def admit(c: SchedulerCore, r: CoreRequest) -> Admission:
    c.arrive(r)
    (d,) = c.schedule()
    assert isinstance(d, Admission)
    return d


SYSTEM = list(range(100, 124))  # 24 tokens: 6 blocks


# ---- the index ---------------------------------------------------------------------------

def test_index_applies_events_matches_from_block_zero_and_forgets() -> None:
    names = block_hashes(list(range(40)), BS, 0, 8)  # 10 blocks
    ix = PrefixIndex()
    assert ix.matched_blocks("a", names) == 0
    ix.apply("a", CacheEvents(names[:6], reset=True))
    assert ix.matched_blocks("a", names) == 6 and ix.blocks("a") == 6
    # a hole stops the walk: block 2 gone, 3.. no longer usable
    ix.apply("a", CacheEvents([], [names[2]]))
    assert ix.matched_blocks("a", names) == 2
    ix.drop("a", [names[0]])
    assert ix.matched_blocks("a", names) == 0
    # a reset forgets everything held before its stores
    ix.apply("a", CacheEvents(names[:1], reset=True))
    assert ix.blocks("a") == 1 and ix.matched_blocks("a", names) == 1
    ix.forget("a")
    assert ix.blocks("a") == 0 and ix.matched_blocks("a", names) == 0


def test_request_names_are_hashed_once_per_block(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = prefix_mod.next_hash

    def counting(parent: bytes, block: Sequence[int]) -> bytes:
        calls.append(1)
        return real(parent, block)

    monkeypatch.setattr(prefix_mod, "next_hash", counting)
    tokens = list(range(40))
    names = RequestNames()
    assert names.names(tokens, 5, BS, 0, 4) == block_hashes(tokens, BS, 0, 4, 5)
    n = len(calls)
    assert names.names(tokens, 5, BS, 0, 4) == block_hashes(tokens, BS, 0, 4, 5)
    assert len(calls) == n + 5  # only the reference list above was hashed again
    n = len(calls)
    assert names.names(tokens, 3, BS, 0, 4) == block_hashes(tokens, BS, 0, 4, 3)
    assert len(calls) == n + 3
    n = len(calls)
    grown = names.names(tokens, 8, BS, 0, 4)  # the sequence grew: 3 more blocks hashed
    assert len(calls) == n + 3 and grown == block_hashes(tokens, BS, 0, 4, 8)


def test_matching_hashes_only_as_far_as_it_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = prefix_mod.next_hash

    def counting(parent: bytes, block: Sequence[int]) -> bytes:
        calls.append(1)
        return real(parent, block)

    tokens = list(range(4000))  # 1000 blocks of 4
    held = set(block_hashes(tokens, BS, 0, 4, 3))
    monkeypatch.setattr(prefix_mod, "next_hash", counting)
    names = RequestNames()
    assert names.matched(held, tokens, 999, BS, 0, 4) == 3
    assert len(calls) == 8  # the first 8 blocks: 3 held, the 4th missing
    assert names.matched(held, tokens, 999, BS, 0, 4) == 3 and len(calls) == 8
    assert names.matched(None, tokens, 999, BS, 4, 8) == 0 and len(calls) == 8
    everything = set(block_hashes(tokens, BS, 0, 4))
    calls.clear()
    assert names.matched(everything, tokens, 999, BS, 0, 4) == 999
    assert len(calls) == 999 - 8  # each block hashed once in all


def test_recent_routes_are_distinct_and_bounded() -> None:
    routes = [Route((NodeRange(n, 0, 8),)) for n in "abcd"]
    recent = RecentRoutes(3)
    for r in (routes[0], routes[1], routes[0], routes[2], routes[3]):
        recent.taken(r)
    assert list(recent) == [routes[3], routes[2], routes[0]] and len(recent) == 3


# ---- cached tokens -----------------------------------------------------------------------

def test_cached_tokens_are_whole_blocks_every_hop_holds_never_the_last_token() -> None:
    c = make_core({"a": (0, 4), "b": (4, 8)})
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8]  # 32 tokens, 8 blocks
    holds(c, "a", prompt, 0, 4, reset=True)  # all 8 blocks on the first hop
    holds(c, "b", prompt, 4, 8, blocks=5, reset=True)  # 5 on the second
    d = admit(c, req("r1", prompt))
    assert d.route.nodes == ("a", "b") and d.cached_tokens == 5 * BS
    holds(c, "b", prompt, 4, 8)  # now both hold all 8: the last token is still computed
    d = admit(c, req("r2", prompt))
    assert d.cached_tokens == reusable_tokens(8, 32, BS) == 7 * BS
    # per node: prompt tokens looked up, tokens taken from cache, on every hop
    assert c.prefix_stats() == {"a": (64, 48), "b": (64, 48)}


def test_names_are_per_layer_span() -> None:
    c = make_core({"a": (0, 8)})
    prompt = SYSTEM + [9] * 8
    holds(c, "a", prompt, 0, 4, reset=True)  # computed for other layers: not reusable
    assert admit(c, req("r1", prompt)).cached_tokens == 0
    holds(c, "a", prompt, 0, 8)
    assert admit(c, req("r2", prompt)).cached_tokens == 7 * BS


def test_no_caching_without_tokens_or_with_it_off() -> None:
    prompt = SYSTEM + [9] * 8
    c = make_core({"a": (0, 8)})
    holds(c, "a", prompt, 0, 8, reset=True)
    assert admit(c, CoreRequest("plain", 32, 4)).cached_tokens == 0  # contents unknown
    assert c.prefix_stats() == {}
    off = make_core({"a": (0, 8)}, prefix_caching=False)
    holds(off, "a", prompt, 0, 8, reset=True)
    assert admit(off, req("r1", prompt)).cached_tokens == 0 and off.prefix_stats() == {}


def test_a_resumed_request_reuses_its_own_prompt_and_output() -> None:
    c = make_core({"a": (0, 8)}, kv=KvPolicy("on-demand", watermark=0.0))
    tokens = SYSTEM + list(range(8)) + list(range(50, 58))  # 32 prompt + 8 output
    r = Req("r1", 32, 8, tokens=tuple(tokens))
    assert admit(c, r).cached_tokens == 0
    for _ in range(6):
        c.on_token("r1")
    holds(c, "a", tokens[:36], 0, 8, reset=True)  # its blocks so far (9 of them)
    c.reroute("r1")
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.resumed and d.info.prompt_tokens == 38
    assert d.cached_tokens == 9 * BS  # prompt and generated blocks alike


def test_prefix_miss_drops_the_listed_names_and_requeues_uncounted() -> None:
    c = make_core({"a": (0, 8)}, max_reroutes=0)
    prompt = SYSTEM + [9] * 8
    holds(c, "a", prompt, 0, 8, reset=True)
    names = block_hashes(prompt, BS, 0, 8)
    assert admit(c, req("r1", prompt)).cached_tokens == 7 * BS
    c.prefix_miss("r1", "a", names[3:])
    assert c.running == 0 and c.waiting == 1  # queued again, KV freed
    (d,) = c.schedule()  # max_reroutes=0: a counted re-route would have raised
    assert isinstance(d, Admission) and d.request_id == "r1" and d.cached_tokens == 3 * BS
    assert c.requests["r1"].reroutes == 0
    c.finish("r1")
    c.node_down("a")
    c.node_up("a")
    assert admit(c, req("r2", prompt)).cached_tokens == 0


def test_each_request_is_counted_once_at_the_admission_that_ran() -> None:
    """vLLM's queries / hits: a request counts once. An admission a hop refused (prefix
    miss) is taken back and the next one counts; a preempted or re-routed request admitted
    again is not counted again (vLLM counts those apart, in no exported counter)."""
    c = make_core({"a": (0, 4), "b": (4, 8)}, kv=KvPolicy("on-demand", watermark=0.0))
    prompt = SYSTEM + [9] * 8  # 32 tokens, 8 blocks
    holds(c, "a", prompt, 0, 4, reset=True)
    holds(c, "b", prompt, 4, 8, reset=True)
    assert admit(c, req("r1", prompt)).cached_tokens == 7 * BS
    assert c.prefix_totals() == (32, 28)
    c.prefix_miss("r1", "b", block_hashes(prompt, BS, 4, 8)[2:])
    assert c.prefix_totals() == (0, 0) and c.prefix_stats() == {"a": (0, 0), "b": (0, 0)}
    (d,) = c.schedule()  # admitted again: this one runs, and counts
    assert isinstance(d, Admission) and d.cached_tokens == 2 * BS
    assert c.prefix_totals() == (32, 8) and c.prefix_stats() == {"a": (32, 8), "b": (32, 8)}
    c.on_token("r1")
    c.reroute("r1")  # a fault: replayed from its admission, not counted again
    c.rename("r1", "r1b")  # under the replay's fresh id, which keeps its count
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.resumed and d.info.prompt_tokens == 33
    assert c.prefix_totals() == (32, 8)
    c.prefix_miss("r1b", "b")  # refused again: nothing counted for it to take back
    (d,) = c.schedule()
    assert isinstance(d, Admission) and c.prefix_totals() == (32, 8)
    c.finish("r1b")
    # another request: counted, and after a miss counted at its next admission
    holds(c, "b", prompt, 4, 8, reset=True)
    assert admit(c, req("r2", prompt)).cached_tokens == 7 * BS
    assert c.prefix_totals() == (64, 36)
    c.prefix_miss("r2", "a")
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.cached_tokens == 0
    assert c.prefix_totals() == (64, 8)


def test_prefix_miss_without_names_drops_the_admissions_blocks_on_that_hop_only() -> None:
    c = make_core({"a": (0, 4), "b": (4, 8)})
    prompt = SYSTEM + [9] * 8
    holds(c, "a", prompt, 0, 4, reset=True)
    holds(c, "b", prompt, 4, 8, reset=True)
    holds(c, "b", SYSTEM + [8] * 8, 4, 8)  # another prompt's blocks: kept
    assert admit(c, req("r1", SYSTEM + [9] * 4 + [1] * 5)).cached_tokens == 7 * BS
    c.prefix_miss("r1", "b")
    # b forgot the 7 blocks the admission took (not its 8th, nor the other prompt's); a
    # kept all of its blocks
    assert c.prefix.index.blocks("b") == 8 - 7 + 2
    assert c.prefix.index.matched_blocks("a", block_hashes(prompt, BS, 0, 4)) == 8
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.cached_tokens == 0 and d.resumed
    c.finish("r1")
    assert admit(c, req("r2", SYSTEM + [8] * 9)).cached_tokens == 0  # block 0 is gone on b


def test_prefix_miss_of_a_request_that_took_nothing_from_cache_only_requeues() -> None:
    c = make_core({"a": (0, 8)})
    holds(c, "a", SYSTEM + [9] * 8, 0, 8, reset=True)
    admit(c, req("r1", [5] * 12))  # nothing cached
    c.prefix_miss("r1", "a")
    assert c.prefix.index.blocks("a") == 8 and c.waiting == 1 and c.running == 0


def test_the_log_records_cached_tokens_last() -> None:
    c = make_core({"a": (0, 8)})
    c.log = []
    prompt = SYSTEM + [9] * 8
    holds(c, "a", prompt, 0, 8, reset=True)
    admit(c, req("r1", prompt))
    entry = next(e for e in c.log if e[0] == "admit")
    assert entry[:3] == ("admit", "r1", ("a",)) and entry[-1] == 7 * BS


def test_policy_fields_are_checked() -> None:
    for bad in ({"prefix_load_weight_tokens": -1.0}, {"prefix_prefill_weight": -0.5},
                {"prefix_flow_weight": -0.1},
                {"prefix_recent_routes": -1}, {"prefix_block_size": 0}):
        with pytest.raises(UserError, match=next(iter(bad))):
            SchedulerPolicy(**bad).check()  # type: ignore[arg-type]


def test_prefix_block_size_overrides_the_kv_block_size() -> None:
    c = make_core({"a": (0, 8)}, prefix_block_size=8)
    prompt = SYSTEM + [9] * 8
    c.on_cache_events("a", CacheEvents(block_hashes(prompt, 8, 0, 8), reset=True))
    assert c.prefix_block_size == 8
    assert admit(c, req("r1", prompt)).cached_tokens == 24


# ---- the route choice --------------------------------------------------------------------

TWO = {"x": (0, 8), "y": (0, 8)}


def two_routes(**fields: object) -> tuple[SchedulerCore, list[int]]:
    """Two one-node routes, both used once (so both are recent), and a conversation whose
    history only y holds (the system prompt both)."""
    c = make_core(TWO, **fields)
    seen = {admit(c, req(f"warm{i}", [i] * 8)).route.nodes for i in range(2)}
    assert seen == {("x",), ("y",)}
    for i in range(2):
        c.finish(f"warm{i}")
    history = SYSTEM + list(range(16))  # 40 tokens: 10 blocks
    holds(c, "x", SYSTEM, 0, 8, reset=True)
    holds(c, "y", history, 0, 8, reset=True)
    return c, history


def pick_of(c: SchedulerCore, r: CoreRequest) -> Route:
    """The route the router would pick for `r` now (on a copy of its state)."""
    import copy
    router = copy.deepcopy(c.router)
    route = router.route(c._info(r), c.view)
    assert route is not None
    return route


def test_cache_aware_takes_the_route_holding_the_history() -> None:
    # no flow term: it saves 16 tokens a turn, less than the flow term would charge y by the
    # third override (tests of the flow term below)
    c, history = two_routes(prefix_flow_weight=0.0)
    picks = set()
    for _ in range(3):  # whatever the router picks, the turn goes to y
        r = req("turn", history + [7] * 8)
        picks.add(pick_of(c, r).nodes)
        d = admit(c, r)
        assert d.route.nodes == ("y",) and d.cached_tokens == 40
        c.finish(r.request_id)
    assert ("x",) in picks  # the router's pick was overridden


def test_plain_routes_take_the_routers_pick_and_still_count_its_cache() -> None:
    c, history = two_routes(cache_aware=False)
    got = set()
    for i in range(4):
        r = req(f"t{i}", history + [7] * 8)
        pick = pick_of(c, r)
        d = admit(c, r)
        assert d.route == pick
        assert d.cached_tokens == (40 if pick.nodes == ("y",) else 24)
        got.add(d.route.nodes)
        c.finish(r.request_id)
    assert got == {("x",), ("y",)}


def test_load_outweighs_a_small_saving() -> None:
    # shortest-queue picks the node with fewer requests running: the light one
    for weight, winner in ((64.0, "light"), (0.0, "busy")):
        c, _ = two_routes(router="shortest-queue", prefix_load_weight_tokens=weight)
        admit(c, req("busy", [3] * 8))
        busy_route = c.route_of("busy")
        assert busy_route is not None
        busy = busy_route.nodes[0]
        light = "y" if busy == "x" else "x"
        # the busy node holds one block more (7 vs 6): it saves 4 tokens, carries 1 request
        holds(c, busy, SYSTEM + [5] * 4, 0, 8, reset=True)
        holds(c, light, SYSTEM, 0, 8, reset=True)
        d = admit(c, req("turn", SYSTEM + [5] * 4 + [1] * 8))
        assert d.route.nodes == ((light,) if winner == "light" else (busy,))
        assert d.cached_tokens == (24 if winner == "light" else 28)


def test_a_route_saving_no_whole_block_more_never_overrides_the_pick() -> None:
    c, _ = two_routes(prefix_load_weight_tokens=0.0)
    holds(c, "x", SYSTEM, 0, 8, reset=True)
    holds(c, "y", SYSTEM, 0, 8, reset=True)  # both hold the same
    for i in range(4):
        r = req(f"t{i}", SYSTEM + [i] * 8)
        pick = pick_of(c, r)
        d = admit(c, r)
        assert d.route == pick and d.cached_tokens == 24
        c.finish(r.request_id)


def test_candidates_must_be_alive_accepted_and_have_room() -> None:
    c, history = two_routes()
    turn = history + [7] * 8
    c.node_down("y")
    d = admit(c, req("down", turn))
    assert d.route.nodes == ("x",) and d.cached_tokens == 24
    c.finish("down")
    c.node_up("y")
    holds(c, "y", history, 0, 8, reset=True)  # (a node taken down is forgotten)
    # y's KV cannot hold the request (48 + 4 output + 3 block slack)
    c.report("y", 54)
    d = admit(c, req("full", turn))
    assert d.route.nodes == ("x",)
    c.finish("full")
    c.report("y", 1000)
    # a re-plan whose placement no longer has y: its recent route is not accepted
    c.install(make_router("maxflow", placement({"x": (0, 8)})))
    d = admit(c, req("replanned", turn))
    assert d.route.nodes == ("x",)


def test_taking_another_route_keeps_maxflow_credits_as_if_the_router_had_chosen_it() -> None:
    p = placement({"a": (0, 4), "b": (0, 4), "c": (4, 8), "d": (4, 8)})
    r1, r2 = make_router("maxflow", p), make_router("maxflow", p)
    state = {n: NodeState(n, kv_free_tokens=1000) for n in "abcd"}
    info = RequestInfo("q", 20, 10)
    for i in range(3):  # some history first, the same in both
        for r in (r1, r2):
            r.route(RequestInfo(f"h{i}", 10 + i, 5), state)
    pick = r1.route(info, state)
    assert pick is not None and r2.route(info, state) == pick  # same state, same pick
    alt = Route(tuple(
        type(h)({"a": "b", "b": "a", "c": "d", "d": "c"}[h.name], h.start_layer, h.end_layer)
        for h in pick.hops))
    r1.take(pick, alt, info, state)
    r1.take(alt, pick, info, state)  # and back: exactly the credits of taking the pick
    assert r1.credit == pytest.approx(r2.credit)
    # a caller that took one route for a while: the router then sends the other one its
    # share back, so the work down each flow edge still converges to the flow's shares
    r = make_router("maxflow", placement(TWO))
    state = {n: NodeState(n, kv_free_tokens=1000) for n in TWO}
    forced = Route((NodeRange("x", 0, 8),))
    sent = {"x": 0, "y": 0}
    for i in range(20):
        ri = RequestInfo(f"s{i}", 20, 10)
        got = r.route(ri, state)
        assert got is not None
        if got != forced:
            r.take(got, forced, ri, state)
        sent["x"] += 1
    for i in range(40):
        got = r.route(RequestInfo(f"f{i}", 20, 10), state)
        assert got is not None
        sent[got.nodes[0]] += 1
    assert sent == {"x": 30, "y": 30}


def test_cache_aware_routing_with_iwrr_keeps_routing_both_routes() -> None:
    """Conversations stick to their route while both routes stay in use: the turns of one
    round run together, so load spreads new conversations, and each later turn saves its
    history (80 tokens and more) against a load difference of at most a few requests."""
    c = make_core(TWO, prefix_load_weight_tokens=16.0)
    routes: dict[int, str] = {}
    history: dict[int, list[int]] = {k: SYSTEM + [k] * 80 for k in range(6)}
    for turn in range(4):
        for k in range(6):
            tokens = history[k] + [turn] * 4
            d = admit(c, req(f"c{k}-t{turn}", tokens, output=4))
            node = d.route.nodes[0]
            if turn:
                assert node == routes[k], f"conversation {k} moved at turn {turn}"
                assert d.cached_tokens >= len(history[k]) - BS
            routes[k] = node
            history[k] = tokens + [turn + 50] * 4
            holds(c, node, history[k], 0, 8)  # its blocks stay cached where it ran
        for k in range(6):
            c.finish(f"c{k}-t{turn}")
    assert set(routes.values()) == {"x", "y"}


# ---- the flow term -----------------------------------------------------------------------

def weighted_routes(x: float, y: float, **fields: object) -> SchedulerCore:
    """Two one-node routes whose max-flow shares are x : y."""
    flows = [Flow(C, "x", x), Flow("x", C, x), Flow(C, "y", y), Flow("y", C, y)]
    p = Placement(model="m", cluster="c", num_layers=8, planner="hand",
                  nodes=[NodeRange("x", 0, 8), NodeRange("y", 0, 8)], flows=flows)
    kv = fields.pop("kv", KvPolicy("reserve"))
    c = SchedulerCore(make_router("maxflow", p),
                      SchedulerPolicy(kv=kv, **fields),  # type: ignore[arg-type]
                      dict.fromkeys(TWO, 1000))
    c.set_block_size(BS)
    return c


def one_at_a_time(c: SchedulerCore, n: int) -> dict[str, int]:
    """`n` new conversations, one after another (each ends before the next arrives: no
    load term), all starting with SYSTEM; each leaves its blocks cached where it ran."""
    sent = {"x": 0, "y": 0}
    for i in range(n):
        tokens = SYSTEM + [1000 + i] * 8
        node = admit(c, req(f"c{i}", tokens)).route.nodes[0]
        sent[node] += 1
        holds(c, node, tokens, 0, 8)
        c.finish(f"c{i}")
    return sent


def test_the_flow_term_spreads_a_shared_prompt_over_routes_by_their_flow() -> None:
    # the first conversation warms x, and x saves the second the system prompt (24 tokens)
    # against a cold y; once two prompts have branched after it the system prompt is
    # shared and steers no more ("Shared prefixes do not steer"), so even without the flow
    # term the router's picks run from then on: 2 : 1 in all, x one ahead
    assert one_at_a_time(weighted_routes(2.0, 1.0, prefix_flow_weight=0.0), 30) == \
        {"x": 20, "y": 10}
    # with it, x is taken over y only while its edge is less than 24 / 0.25 = 96 tokens of
    # work (36 a request) beyond its share; y then gets one, holds the prompt too, and the
    # routes share the conversations as the flow does, 2 : 1
    sent = one_at_a_time(weighted_routes(2.0, 1.0), 30)
    assert sent["y"] >= 9 and abs(sent["x"] - 2 * sent["y"]) <= 3, sent
    sent = one_at_a_time(weighted_routes(1.0, 3.0), 40)
    assert sent["x"] >= 8 and abs(3 * sent["x"] - sent["y"]) <= 4, sent


def test_prompts_branch_where_they_differ_and_a_conversation_never_by_itself() -> None:
    turn0 = [b"s0", b"s1", b"a0"]
    shared = SharedPrefixes()
    shared.add(turn0)
    assert shared.shared_blocks(turn0) == 0
    shared.add([*turn0, b"a1", b"a2"])  # its next turn extends it: no branch
    assert shared.shared_blocks([*turn0, b"a1", b"a3"]) == 0
    shared.add([b"s0", b"s1", b"b0"])  # another conversation branches after s1
    assert shared.shared_blocks([b"s0", b"s1", b"c0", b"c1"]) == 2
    assert shared.shared_blocks([*turn0, b"a1"]) == 2
    assert shared.shared_blocks([b"t0", b"s0", b"s1"]) == 0  # from block 0 only
    bounded = SharedPrefixes(kept=3)
    bounded.add([bytes([i]) for i in range(10)])
    assert bounded.shared_blocks([bytes([i]) for i in range(10)]) == 0
    assert len(bounded._next) == 3  # the least recently seen dropped


def test_a_shared_prompt_steers_no_new_conversation_and_histories_keep_their_routes() -> None:
    """New conversations, one at a time (no load term), no flow term: the first warms x and
    the second follows the system prompt there; from then on the prompt is shared, the
    router's picks spread the conversations, and each one's next turn returns to its route
    for its history."""
    c = weighted_routes(1.0, 1.0, prefix_flow_weight=0.0)
    where: dict[int, str] = {}
    first: dict[int, list[int]] = {}
    for i in range(8):
        tokens = SYSTEM + [1000 + i] * 8
        d = admit(c, req(f"c{i}-t0", tokens))
        where[i] = d.route.nodes[0]
        first[i] = tokens + [2000 + i] * 4  # with its reply
        holds(c, where[i], first[i], 0, 8)
        c.finish(f"c{i}-t0")
    assert [where[0], where[1]] == ["x", "x"]
    assert list(where.values()).count("y") == 4  # the router's picks: x owed y two
    for i in range(8):
        tokens = first[i] + [3000 + i] * 8
        d = admit(c, req(f"c{i}-t1", tokens))
        assert d.route.nodes[0] == where[i], f"conversation {i} left its route"
        assert d.cached_tokens == len(first[i])
        c.finish(f"c{i}-t1")


def test_a_conversation_sticks_to_its_route_while_the_flow_allows() -> None:
    """A long conversation on y and one-off requests as long (nothing cached) in turn, two
    routes of equal flow: the turns override half of the router's picks, the one-offs go
    where the flow wants them (x, owed the work y took), and y never goes far enough over
    its share to move the turns."""
    c = weighted_routes(1.0, 1.0)
    admit(c, req("warm-x", [1] * 8))
    admit(c, req("warm-y", [2] * 8))  # both routes recent
    c.finish("warm-x")
    c.finish("warm-y")
    history = SYSTEM + list(range(160))
    holds(c, "y", history, 0, 8, reset=True)
    overridden = 0
    others = {"x": 0, "y": 0}
    for turn in range(12):
        r = req(f"turn{turn}", history + [7] * 8)
        overridden += pick_of(c, r).nodes != ("y",)
        d = admit(c, r)
        assert d.route.nodes == ("y",) and d.cached_tokens == len(history), turn
        history = history + [7] * 8 + [turn] * 8
        holds(c, "y", history, 0, 8)
        c.finish(r.request_id)
        d = admit(c, req(f"other{turn}", [3000 + turn] * len(r.tokens)))
        others[d.route.nodes[0]] += 1
        c.finish(f"other{turn}")
    assert overridden >= 3  # the flow wanted some turns on x
    assert others["x"] >= 10


def test_a_turn_waits_for_its_busy_route_rather_than_compute_its_history_elsewhere() -> None:
    """y holds the conversation's history but has no KV room while another request runs
    there: the turn waits (nobody's credits change) and runs on y once that request ends;
    with `prefix_wait_tokens` 0, or when y's room is short with nothing running there, it
    is admitted on x at once and computes its whole prompt."""
    history = SYSTEM + list(range(40))  # 64 tokens, 16 blocks

    def setup(wait: float, capacity_y: int = 100) -> SchedulerCore:
        flows = [Flow(C, "x", 1.0), Flow("x", C, 1.0), Flow(C, "y", 1.0), Flow("y", C, 1.0)]
        p = Placement(model="m", cluster="c", num_layers=8, planner="hand",
                      nodes=[NodeRange("x", 0, 8), NodeRange("y", 0, 8)], flows=flows)
        c = SchedulerCore(make_router("maxflow", p),
                          SchedulerPolicy(kv=KvPolicy("on-demand", watermark=0.0),
                                          prefix_flow_weight=0.0, prefix_wait_tokens=wait),
                          {"x": 100, "y": capacity_y})
        c.set_block_size(BS)
        admit(c, req("warm-x", [1] * 8))
        admit(c, req("warm-y", [2] * 8))  # both routes recent
        c.finish("warm-x")
        c.finish("warm-y")
        holds(c, "y", history, 0, 8, reset=True)
        return c

    c = setup(wait=16)
    other = admit(c, req("other", history[:40] + [5] * 20))  # 60 tokens, on y for its cache
    assert other.route.nodes == ("y",) and c.view["y"].kv_free_tokens < 72
    credits = dict(c.router.credit)  # type: ignore[attr-defined]
    c.arrive(req("turn", history + [7] * 8))  # 72 tokens: no room on y now
    assert c.schedule() == [] and c.waiting == 1
    assert c.router.credit == credits  # type: ignore[attr-defined]
    c.finish("other")
    (d,) = c.schedule()
    assert isinstance(d, Admission) and d.route.nodes == ("y",) and d.cached_tokens == 64

    c = setup(wait=0)
    assert admit(c, req("other", history[:40] + [5] * 20)).route.nodes == ("y",)
    d = admit(c, req("turn", history + [7] * 8))
    assert d.route.nodes == ("x",) and d.cached_tokens == 0

    c = setup(wait=16, capacity_y=70)  # y could never hold the turn: no wait
    d = admit(c, req("turn", history + [7] * 8))
    assert d.route.nodes == ("x",) and d.cached_tokens == 0


def test_without_prefix_traffic_the_flow_term_changes_nothing() -> None:
    """Requests whose tokens are unknown, or that nothing cached matches: the same
    decisions, whatever the flow weight."""
    logs = []
    for weight in (0.0, 0.5, 100.0):
        c = weighted_routes(2.0, 1.0, prefix_flow_weight=weight, kv=KvPolicy("on-demand"))
        c.log = []
        for i in range(40):
            r: CoreRequest = CoreRequest(f"u{i}", 20 + i % 7, 5) if i % 2 else \
                req(f"u{i}", [5000 + i] * (20 + i % 7), output=5)
            c.arrive(r)
            c.schedule()
            if i % 3 == 0:
                c.on_token(f"u{i}")
            if i % 4 == 3:
                c.finish(f"u{i - 2}")
        logs.append(c.log)
    assert logs[0] == logs[1] == logs[2]
    assert {e[2] for e in logs[0] if e[0] == "admit"} == {("x",), ("y",)}


def test_flow_excess_is_the_work_beyond_the_share_before_the_pick() -> None:
    r = make_router("maxflow", placement(TWO))
    state = {n: NodeState(n, kv_free_tokens=1000) for n in TWO}
    x, y = Route((NodeRange("x", 0, 8),)), Route((NodeRange("y", 0, 8),))
    info = RequestInfo("a", 20, 10)  # 30 tokens of work
    pick = r.route(info, state)
    assert pick == x and r.flow_excess(x) == r.flow_excess(y) == 0.0
    r.take(x, y, info, state)  # y pays 30 for a 15 share
    pick = r.route(RequestInfo("b", 20, 10), state)
    assert pick == x  # the router owes x
    assert r.flow_excess(y) == pytest.approx(15.0) and r.flow_excess(x) == 0.0
    r.take(x, y, RequestInfo("b", 20, 10), state)
    r.route(RequestInfo("c", 20, 10), state)
    assert r.flow_excess(y) == pytest.approx(30.0)
