"""benchmarks/prefix_kv_limited.py: the demo's placement in the simulator with a KV budget
in MiB. Its KV sizes are the demo workers' (fp32 SmolLM2-135M), and the mechanism it
reports holds: where KV binds, plain routes evict histories that cache-aware ones keep."""

from __future__ import annotations

from typing import Any

from benchmarks.prefix_kv_limited import build, kv_tokens, run


def test_kv_budget_in_tokens_is_the_demo_workers() -> None:
    # what `helixserve worker --kv-cache-bytes 402653184` prints, in whole 16-token blocks
    assert kv_tokens(384, 9) // 16 * 16 == 29120
    assert kv_tokens(384, 21) // 16 * 16 == 12480
    placement = build("demo", 384)[3]
    assert [(n.name, n.start_layer, n.end_layer) for n in placement.nodes] == [
        ("n1", 0, 9), ("n2", 9, 30), ("n3", 9, 30)]
    routes = {f.dst: f.tokens_per_s for f in placement.flows if f.src == "n1"}
    assert abs(routes["n3"] - routes["n2"]) < 1e-6 * routes["n3"]
    skewed = {f.dst: f.tokens_per_s for f in build("demo", 384, 0.64)[3].flows
              if f.src == "n1"}
    assert abs(skewed["n3"] / (skewed["n2"] + skewed["n3"]) - 0.64) < 0.01


def test_where_kv_binds_plain_routes_evict_what_cache_aware_ones_keep() -> None:
    args: dict[str, Any] = dict(topology="demo", kv_mib=384, conversations=4, turns=6, user_tokens=600,
                output_tokens=16, system_tokens=1000, seed=0, turn_gap_s=60.0, jitter_s=30.0)
    plain = run(aware=False, **args)
    aware = run(aware=True, **args)
    assert plain["finished"] == aware["finished"] == plain["requests"] == 24
    assert aware["same_route_as_previous_turn"] == 1.0
    assert plain["same_route_as_previous_turn"] < 0.8
    for n in ("n2", "n3"):
        assert aware["nodes"][n]["evicted_tokens"] == 0
        assert aware["nodes"][n]["peak_cached_tokens"] <= aware["nodes"][n]["kv_tokens"]
    assert sum(plain["nodes"][n]["evicted_tokens"] for n in ("n2", "n3")) > 0
    assert aware["hit_rate"] > plain["hit_rate"]


def test_five_workers_give_four_equal_routes_and_plain_routes_change_route_more() -> None:
    """`--topology five` is `helixserve demo --memory-gb 1,1,1,1,1 --worker-link-fraction
    0.3` as the demo's MILP planned it: n5 [0, 6) -> one of four [6, 30) workers, a quarter
    each. With four routes a plain turn lands on its previous route less often than on two,
    and cache-aware routes keep every conversation where its history is."""
    placement = build("five", 384)[3]
    shares = {f.dst: f.tokens_per_s for f in placement.flows if f.src == "n5"}
    assert sorted(shares) == ["n1", "n2", "n3", "n4"]
    assert max(shares.values()) - min(shares.values()) < 1e-6 * max(shares.values())
    args: dict[str, Any] = dict(topology="five", kv_mib=384, conversations=8, turns=4,
                                user_tokens=500, output_tokens=16, system_tokens=1000, seed=0,
                                turn_gap_s=60.0, jitter_s=30.0)
    plain = run(aware=False, **args)
    aware = run(aware=True, **args)
    assert plain["finished"] == aware["finished"] == plain["requests"] == 32
    assert plain["same_route_as_previous_turn"] < 0.5 < aware["same_route_as_previous_turn"]
    assert aware["hit_rate"] > plain["hit_rate"]
