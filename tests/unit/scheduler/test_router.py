"""The routing policies over small hand-written placements."""

from __future__ import annotations

import random

import pytest

from helixserve.errors import UserError
from helixserve.planner.placement import Flow, NodeRange, Placement
from helixserve.scheduler import ROUTERS, NodeState, RequestInfo, make_router
from helixserve.spec.cluster import COORDINATOR


def placement(
    ranges: dict[str, tuple[int, int]], flows: list[tuple[str, str, float]], num_layers: int = 8
) -> Placement:
    return Placement(
        model="m",
        cluster="c",
        num_layers=num_layers,
        planner="hand",
        nodes=[NodeRange(n, s, e) for n, (s, e) in ranges.items()],
        flows=[Flow(s, d, f) for s, d, f in flows],
    )


def states(kv: dict[str, int], queue: dict[str, int] | None = None) -> dict[str, NodeState]:
    return {
        n: NodeState(n, kv_free_tokens=v, queue_len=(queue or {}).get(n, 0)) for n, v in kv.items()
    }


C = COORDINATOR


def req(i: int, prompt: int = 10, new: int = 10) -> RequestInfo:
    return RequestInfo(f"r{i}", prompt_tokens=prompt, max_new_tokens=new)


def test_unknown_policy_lists_known_names() -> None:
    p = placement({"a": (0, 8)}, [(C, "a", 1.0), ("a", C, 1.0)])
    with pytest.raises(UserError, match="known: maxflow, random, shortest-queue, swarm"):
        make_router("fastest", p)


def test_maxflow_requires_flows() -> None:
    with pytest.raises(UserError, match="flows"):
        make_router("maxflow", placement({"a": (0, 8)}, []))


def test_partial_inference_route_covers_all_layers() -> None:
    # a holds [0,4); b holds [2,8) so a hop from a runs only b's tail [4,8).
    p = placement({"a": (0, 4), "b": (2, 8)}, [(C, "a", 1.0), ("a", "b", 1.0), ("b", C, 1.0)])
    for name in ROUTERS:
        r = make_router(name, p).route(req(0), states({"a": 100, "b": 100}))
        assert r is not None and r.covers(8), name
        assert [(h.name, h.start_layer, h.end_layer) for h in r.hops] == [("a", 0, 4), ("b", 4, 8)]


def test_iwrr_work_converges_to_flow_weights_and_interleaves() -> None:
    flows = [
        (C, "a", 300.0),
        (C, "b", 100.0),
        (C, "c", 0.5),  # c: negligible share, masked
        ("a", C, 300.0),
        ("b", C, 100.0),
        ("c", C, 0.5),
    ]
    p = placement({"a": (0, 8), "b": (0, 8), "c": (0, 8)}, flows)
    router = make_router("maxflow", p)
    st = states({"a": 10**9, "b": 10**9, "c": 10**9})
    rng = random.Random(1)
    work = {"a": 0, "b": 0, "c": 0}
    first_hops = []
    for i in range(2000):
        r_info = req(i, prompt=rng.randint(4, 2048), new=rng.randint(4, 1024))
        route = router.route(r_info, st)
        assert route is not None
        work[route.nodes[0]] += r_info.prompt_tokens + r_info.max_new_tokens
        first_hops.append(route.nodes[0])
    total = sum(work.values())
    assert work["c"] == 0
    assert work["a"] / total == pytest.approx(0.75, abs=0.005)
    # Interleaved, not bursty: b is never starved for long.
    longest_a_run = max(len(run) for run in "".join(first_hops).split("b"))
    assert longest_a_run <= 12


def test_kv_mask_skips_nodes_without_room() -> None:
    p = placement(
        {"a": (0, 8), "b": (0, 8)}, [(C, "a", 2.0), (C, "b", 1.0), ("a", C, 2.0), ("b", C, 1.0)]
    )
    for name in ROUTERS:
        router = make_router(name, p)
        r1 = router.route(req(1, 20, 20), states({"a": 50, "b": 30}))  # 40 tokens: only a
        assert r1 is not None and r1.nodes == ("a",), name
        r2 = router.route(req(2, 10, 10), states({"a": 10, "b": 30}))  # 20: only b
        assert r2 is not None and r2.nodes == ("b",), name
        assert router.route(req(3, 10, 10), states({"a": 10, "b": 10})) is None, name


def test_dead_end_backtracks_to_next_candidate() -> None:
    # The IWRR's first choice a1 can only continue to b1, whose KV is full; a2 -> b2 works.
    p = placement(
        {"a1": (0, 4), "a2": (0, 4), "b1": (4, 8), "b2": (4, 8)},
        [
            (C, "a1", 9.0),
            (C, "a2", 1.0),
            ("a1", "b1", 9.0),
            ("a2", "b2", 1.0),
            ("b1", C, 9.0),
            ("b2", C, 1.0),
        ],
    )
    router = make_router("maxflow", p, spread=False)  # the flow as given: a1 only feeds b1
    route = router.route(req(0), states({"a1": 100, "a2": 100, "b1": 0, "b2": 100}))
    assert route is not None and route.nodes == ("a2", "b2")
    # The failed attempt through a1 left no credit behind: the next request (b1 free) goes
    # a1 as its 9:1 weight says.
    route = router.route(req(1), states({"a1": 100, "a2": 100, "b1": 100, "b2": 100}))
    assert route is not None and route.nodes == ("a1", "b1")


def test_dead_nodes_are_skipped() -> None:
    p = placement(
        {"a": (0, 8), "b": (0, 8)}, [(C, "a", 1.0), (C, "b", 1.0), ("a", C, 1.0), ("b", C, 1.0)]
    )
    router = make_router("random", p, seed=3)
    st = states({"a": 10**6, "b": 10**6})
    st["a"].alive = False
    assert all(router.route(req(i), st).nodes == ("b",) for i in range(20))  # type: ignore[union-attr]
    st["b"].alive = False
    assert router.route(req(99), st) is None


def test_shortest_queue_picks_least_loaded() -> None:
    p = placement({"a": (0, 8), "b": (0, 8), "c": (0, 8)}, [])
    router = make_router("shortest-queue", p)
    st = states({"a": 100, "b": 100, "c": 100}, queue={"a": 5, "b": 1, "c": 3})
    assert router.route(req(0), st).nodes == ("b",)  # type: ignore[union-attr]


def test_edges_restrict_baselines_to_existing_links() -> None:
    p = placement({"a": (0, 4), "b": (4, 8), "c": (4, 8)}, [])
    edges = [(C, "a"), ("a", "c"), ("b", C), ("c", C)]  # no a -> b link
    for name in ("random", "shortest-queue", "swarm"):
        for seed in range(5):
            r = make_router(name, p, seed=seed, edges=edges).route(
                req(0), states({"a": 100, "b": 100, "c": 100})
            )
            assert r is not None and r.nodes == ("a", "c")


@pytest.mark.parametrize("name", ["random", "swarm", "shortest-queue", "maxflow"])
def test_same_seed_same_routes(name: str) -> None:
    p = placement(
        {"a": (0, 4), "b": (0, 4), "c": (4, 8), "d": (2, 8)},
        [
            (C, "a", 2.0),
            (C, "b", 1.0),
            ("a", "c", 1.0),
            ("a", "d", 1.0),
            ("b", "d", 1.0),
            ("c", C, 1.0),
            ("d", C, 2.0),
        ],
    )
    st = states({"a": 10**6, "b": 10**6, "c": 10**6, "d": 10**6})

    def draw(seed: int) -> list[tuple[str, ...]]:
        router = make_router(name, p, seed=seed)
        return [router.route(req(i, 5 + i, 3), st).nodes for i in range(60)]  # type: ignore[union-attr]

    assert draw(7) == draw(7)
    if name in ("random", "swarm"):
        assert draw(7) != draw(8)


def test_spread_mixes_chains_keeping_node_throughputs() -> None:
    from helixserve.scheduler.spread import spread_flows

    # Two disjoint chains a1 -> b1 and a2 -> b2, as a max-flow solver returns them.
    p = placement(
        {"a1": (0, 4), "a2": (0, 4), "b1": (4, 8), "b2": (4, 8)},
        [(C, "a1", 3.0), (C, "a2", 1.0), ("a1", "b1", 3.0), ("a2", "b2", 1.0),
         ("b1", C, 3.0), ("b2", C, 1.0)],
    )  # fmt: skip
    given = {(f.src, f.dst): f.tokens_per_s for f in p.flows}
    spread = spread_flows(p, given)
    assert spread["a1", "b2"] > 0 and spread["a2", "b1"] > 0
    for node in ("a1", "a2", "b1", "b2"):
        inflow = sum(f for (s, d), f in spread.items() if d == node)
        outflow = sum(f for (s, d), f in spread.items() if s == node)
        assert (
            inflow
            == pytest.approx(given[C, node] if node[0] == "a" else given["a" + node[1], node])
            == pytest.approx(outflow)
        )
    # Max entropy with these marginals: each a splits like the b's (3:1).
    assert spread["a1", "b1"] / spread["a1", "b2"] == pytest.approx(3.0, rel=1e-3)
    # A link slower than the flow it might get is not used.
    slow = spread_flows(
        p,
        given,
        edge_capacity_tokens_per_s={
            ("a1", "b1"): 10.0,
            ("a2", "b2"): 10.0,
            ("a2", "b1"): 10.0,
            ("a1", "b2"): 0.5,
            (C, "a1"): 10.0,
            (C, "a2"): 10.0,
            ("b1", C): 10.0,
            ("b2", C): 10.0,
        },
    )
    assert ("a1", "b2") not in slow
    # ...which leaves b2 fed by a2 alone, so the given flow is the only one (up to the
    # fit's 0.1% tolerance: a2 -> b1 fades towards zero).
    assert {k: slow[k] for k in given} == pytest.approx(given, rel=0.01)
    assert slow.get(("a2", "b1"), 0.0) < 0.01
    # The router draws mixed routes from it.
    router = make_router("maxflow", p)
    st = states({n: 10**9 for n in ("a1", "a2", "b1", "b2")})
    seen = {router.route(req(i), st).nodes for i in range(200)}  # type: ignore[union-attr]
    assert ("a1", "b2") in seen and ("a2", "b1") in seen


def test_spread_still_mixes_when_some_pairs_are_forced_to_zero() -> None:
    from helixserve.scheduler.spread import spread_flows

    # b2 can only be fed by a2 (no a1 -> b2 link), which forces a2 -> b1 to zero: the fit
    # converges slowly there, yet the b -> c stage must still be mixed.
    p = placement(
        {"a1": (0, 4), "a2": (0, 4), "b1": (4, 8), "b2": (4, 8), "c1": (8, 12), "c2": (8, 12)},
        [(C, "a1", 3.0), (C, "a2", 1.0), ("a1", "b1", 3.0), ("a2", "b2", 1.0),
         ("b1", "c1", 3.0), ("b2", "c2", 1.0), ("c1", C, 3.0), ("c2", C, 1.0)],
        num_layers=12,
    )  # fmt: skip
    given = {(f.src, f.dst): f.tokens_per_s for f in p.flows}
    names = [C, "a1", "a2", "b1", "b2", "c1", "c2"]
    edges = [(s, d) for s in names for d in names if s != d and (s, d) != ("a1", "b2")]
    spread = spread_flows(p, given, edges=edges)
    assert ("a1", "b2") not in spread
    assert spread["b1", "c2"] > 0.5 and spread["b2", "c1"] > 0.5


def test_spread_shares_a_range_among_replicas_the_flow_left_idle() -> None:
    from helixserve.scheduler.spread import spread_flows

    # b2 holds the same range as b1 but the solver sent it nothing (c alone caps the flow).
    p = placement(
        {"a": (0, 4), "b1": (4, 8), "b2": (4, 8), "c": (8, 12)},
        [(C, "a", 4.0), ("a", "b1", 4.0), ("b1", "c", 4.0), ("c", C, 4.0)],
        num_layers=12,
    )  # fmt: skip
    given = {(f.src, f.dst): f.tokens_per_s for f in p.flows}
    assert spread_flows(p, given).get(("a", "b2"), 0.0) == 0.0  # without capacities: as given
    caps = {"a": 4.0, "b1": 6.0, "b2": 2.0, "c": 4.0}
    shared = spread_flows(p, given, node_throughput_tokens_per_s=caps)
    assert shared["a", "b1"] == pytest.approx(3.0, rel=0.01)
    assert shared["a", "b2"] == pytest.approx(1.0, rel=0.01)
    assert shared["b2", "c"] == pytest.approx(1.0, rel=0.01)
    router = make_router("maxflow", p, node_throughput_tokens_per_s=caps)
    st = states({n: 10**9 for n in ("a", "b1", "b2", "c")})
    second = [router.route(req(i), st).nodes[1] for i in range(40)]  # type: ignore[union-attr]
    assert second.count("b2") == 10


def test_routes_stay_in_their_region_where_the_flow_continues_there() -> None:
    # a (east) hands layer 4 to b (east) or x (west); y (west) has only a cross-region
    # successor, c (east). With node_region, a keeps only b; y's crossing stays.
    p = placement(
        {"a": (0, 4), "b": (4, 8), "x": (4, 8), "y": (0, 4), "c": (4, 8)},
        [(C, "a", 2.0), (C, "y", 1.0), ("a", "b", 1.0), ("a", "x", 1.0), ("y", "c", 1.0),
         ("b", C, 1.0), ("x", C, 1.0), ("c", C, 1.0)],
    )
    region = {"a": "east", "b": "east", "c": "east", "x": "west", "y": "west"}
    kv = states({n: 10**6 for n in region})
    plain = make_router("maxflow", p, spread=False, spill=False)
    kept = make_router("maxflow", p, spread=False, spill=False, node_region=region)
    assert plain.weights["a"] == {"b": 1.0, "x": 1.0}
    assert kept.weights["a"] == {"b": 1.0} and kept.weights["y"] == {"c": 1.0}
    assert kept.weights[C] == plain.weights[C]  # the coordinator's first hops are free
    seconds = {r.hops[1].name for r in (kept.route(req(i), kv) for i in range(20)) if r}
    assert seconds == {"b", "c"}  # never a -> x
    # router_options passes the regions only for a placement that asks for it
    from helixserve.scheduler.options import router_options
    from helixserve.spec import ClusterSpec, NodeSpec

    cluster = ClusterSpec("c", [NodeSpec(n, "L4", region=r) for n, r in region.items()])
    assert "node_region" not in router_options(cluster, _model(), p)
    p.route_within_regions = True
    assert router_options(cluster, _model(), p)["node_region"] == region


def _model():  # type: ignore[no-untyped-def]
    from helixserve.spec import ModelSpec

    return ModelSpec(name="m", num_layers=8, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=16, intermediate_size=128,
                     vocab_size=100, max_position_embeddings=256)


def test_unknown_router_option_is_an_error() -> None:
    p = placement({"a": (0, 8)}, [(C, "a", 1.0), ("a", C, 1.0)])
    with pytest.raises(UserError, match="unknown router option 'min_flow_shares'"):
        make_router("maxflow", p, min_flow_shares=0.1)
    # a policy's own knob given to a policy that does not take it
    with pytest.raises(UserError, match="'random' does not take option 'spread'"):
        make_router("random", p, spread=False)
    # cluster facts go to any policy (each uses those it needs)
    make_router("random", p, edges=[(C, "a"), ("a", C)], node_region={"a": "r"})
