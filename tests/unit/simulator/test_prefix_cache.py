"""Prefix caching in the simulator (simulator/prefix.py): each node's cache of named blocks,
the events it sends the core, prefill of only the uncached tokens, the multi-turn workload,
and cache-aware against plain routes on a two-route placement."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from helixserve.errors import UserError
from helixserve.prefix import block_hashes
from helixserve.simulator.metrics import format_table, summarize
from helixserve.simulator.prefix import NodeCache
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import LengthFilter, TraceRequest, multi_turn
from helixserve.spec import Curve
from tests.unit.simulator.conftest import Machine, Setup, make_setup, with_flows


def two_routes(memory_gb: float = 0.3) -> Setup:
    """Two machines holding the whole model: two one-hop routes."""
    return with_flows(make_setup([
        Machine("x", "T4", 0, 4, decode_ms=10.0, prompt_ms=20.0, max_decode=64,
                memory_gb=memory_gb),
        Machine("y", "L4", 0, 4, decode_ms=10.0, prompt_ms=20.0, max_decode=64,
                memory_gb=memory_gb),
    ]))


def pipelines() -> Setup:
    """Two stages, two nodes each: four routes, hops running half the layers. A prompt
    takes 0.02 ms per token per layer (linear: what caching saves shows in the TTFT)."""
    gpus = {"a1": "T4", "a2": "L4", "b1": "A10", "b2": "A10G"}
    s = with_flows(make_setup([
        Machine(n, gpu, 0 if n[0] == "a" else 2, 2 if n[0] == "a" else 4, decode_ms=10.0,
                max_decode=64)
        for n, gpu in gpus.items()]))
    for gpu in gpus.values():
        s.cost.profiles.curves["tiny", gpu, 1, "prompt"] = Curve((1, 100_000), (0.02, 2000.0))
    return s


def conversations(n: int = 15, gap_s: float = 0.37) -> list[TraceRequest]:
    return multi_turn(n, 5, system_prompt_tokens=200, user_tokens=40, output_tokens=30,
                      conversation_gap_s=gap_s, turn_gap_s=5.0, seed=3)


def run(s: Setup, reqs: list[TraceRequest], **cfg: Any) -> tuple[Simulation, dict[str, Any]]:
    fields: dict[str, Any] = {"duration_s": 200.0, "kv_allocation": "on-demand"} | cfg
    sim = Simulation(s.cluster, s.model, s.cost, s.placement, reqs, SimConfig(**fields))
    return sim, summarize(sim.run())


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("wall_s", "events_per_s")}


# ---- a node's cache ----------------------------------------------------------------------

def test_node_cache_keeps_blocks_in_use_and_evicts_unused_lru() -> None:
    names = block_hashes(list(range(40)), 4, 0, 4)  # 10 blocks
    c = NodeCache()
    c.use(names[:4])  # request 1 computed 4 blocks
    c.use(names[:2])  # request 2 attached the first 2
    assert len(c) == 4 and c.matched(names) == 4
    ev = c.log.take()
    assert ev.reset and ev.stored == names[:4] and not ev.removed
    c.trim(0)  # nothing unused: nothing evicted, whatever the room
    assert len(c) == 4
    c.release(names[:4])  # request 1 ends: blocks 2, 3 unused, 0, 1 still used by 2
    c.use(names[4:6])
    c.release(names[4:6])  # unused, more recently than 2, 3
    c.trim(2)
    assert c.matched(names) == 2 and names[4] in c and names[5] in c
    ev = c.log.take()
    assert not ev.reset and sorted(ev.removed) == sorted(names[2:4])
    assert sorted(ev.stored) == sorted(names[4:6])
    c.release(names[:2])
    c.trim(0)
    assert len(c) == 0


# ---- the workload ------------------------------------------------------------------------

def test_multi_turn_conversations_grow_from_a_shared_system_prompt() -> None:
    reqs = multi_turn(3, 4, system_prompt_tokens=50, user_tokens=10, output_tokens=8,
                      conversation_gap_s=1.0, turn_gap_s=10.0, seed=7)
    assert reqs == multi_turn(3, 4, system_prompt_tokens=50, user_tokens=10,
                              output_tokens=8, conversation_gap_s=1.0, turn_gap_s=10.0,
                              seed=7)
    assert reqs != multi_turn(3, 4, system_prompt_tokens=50, user_tokens=10,
                              output_tokens=8, seed=8)
    assert len(reqs) == 12 and [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_id = {r.request_id: r for r in reqs}
    system = by_id["conv0-turn0"].token_ids[:50]  # type: ignore[index]
    for c in range(3):
        assert by_id[f"conv{c}-turn0"].arrival_s == c * 1.0
        for k in range(4):
            r = by_id[f"conv{c}-turn{k}"]
            assert r.token_ids is not None
            assert len(r.token_ids) == r.prompt_tokens + r.output_tokens
            assert r.token_ids[:50] == system
            assert 4 <= r.output_tokens <= 12 and r.arrival_s == c + 10.0 * k
            if k:
                prev = by_id[f"conv{c}-turn{k - 1}"]
                assert prev.token_ids is not None
                # this prompt = the previous prompt + its output + new user tokens
                assert r.token_ids[:len(prev.token_ids)] == prev.token_ids
                assert 5 <= r.prompt_tokens - len(prev.token_ids) <= 15
    with pytest.raises(UserError, match="turns"):
        multi_turn(1, 0)
    # clipped lengths no longer match the token ids: they are dropped
    clipped = LengthFilter(max_prompt_tokens=60, policy="clip").apply(reqs)
    assert all(r.token_ids is None for r in clipped if r.prompt_tokens == 60)
    assert clipped[0].token_ids == reqs[0].token_ids


# ---- the simulation ----------------------------------------------------------------------

def test_caching_off_or_unknown_tokens_changes_nothing() -> None:
    s = two_routes()
    reqs = conversations()
    blind = [replace(r, token_ids=None) for r in reqs]
    _, off = run(s, reqs, prefix_caching=False)
    _, unknown = run(s, blind)
    _, blind_off = run(s, blind, prefix_caching=False)
    assert off["prefix_cache"] == {"queried_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0}
    assert comparable(off) == comparable(unknown) == comparable(blind_off)
    assert "prefix cache" not in format_table(off)
    _, on = run(s, reqs)
    assert on["prefix_cache"]["hit_tokens"] > 0
    assert "prefix cache" in format_table(on)


@pytest.mark.parametrize("router", ["maxflow", "random", "shortest-queue"])
def test_cache_aware_routes_hit_more_than_plain_ones(router: str) -> None:
    s = two_routes()
    reqs = conversations()
    plain_sim, plain = run(s, reqs, scheduler=router, cache_aware=False)
    aware_sim, aware = run(s, reqs, scheduler=router)
    assert plain["requests_finished"] == aware["requests_finished"] == len(reqs)
    p, a = plain["prefix_cache"], aware["prefix_cache"]
    assert p["queried_tokens"] == a["queried_tokens"] == sum(r.prompt_tokens for r in reqs)
    # the system prompt is cached on both routes either way; the history only where the
    # conversation ran, which cache-aware routes go back to
    assert a["hit_rate"] > p["hit_rate"] > 0.5
    # fewer prompt tokens computed on the nodes
    computed = [sum(n.prompt_tokens for n in sim.nodes.values())
                for sim in (plain_sim, aware_sim)]
    assert computed[1] < computed[0]


def test_prefill_computes_only_uncached_tokens_and_the_index_is_exact() -> None:
    s = pipelines()
    reqs = conversations(8, 0.5)
    # plain routes: the router's IWRR spreads over all four routes (cache-aware ones would
    # keep this light load on the warm one)
    sim, summary = run(s, reqs, kv_allocation="reserve", cache_aware=False)
    stats = sim.core.prefix_stats()
    assert summary["requests_finished"] == len(reqs)
    for n in sim.nodes.values():
        queried, hit = stats[n.name]
        assert n.prompt_tokens == queried - hit  # every hop computed just the rest
        assert 0 < hit < queried
        # the core's index holds exactly what each node's cache holds (reported each step)
        held = set(n.cache.refs) | set(n.cache.free)
        index = sim.core.prefix.index
        assert index.blocks(n.name) == len(held)
        assert all(index.matched_blocks(n.name, [h]) == 1 for h in held)
    # ...and the first stage's TTFT is shorter than without caching
    _, off = run(s, reqs, kv_allocation="reserve", cache_aware=False, prefix_caching=False)
    assert summary["ttft_s"]["mean"] < 0.9 * off["ttft_s"]["mean"]


def test_small_caches_evict_and_stay_within_kv() -> None:
    s = two_routes(memory_gb=0.13)  # about 2,000 tokens of KV per node
    reqs = conversations(10, 0.3)
    sim, summary = run(s, reqs)
    for n in sim.nodes.values():
        assert len(n.cache) <= n.kv_cap // sim.block_size
        assert sim.core.prefix.index.blocks(n.name) == len(n.cache)
    _, big = run(two_routes(), reqs)
    assert summary["prefix_cache"]["hit_rate"] < big["prefix_cache"]["hit_rate"]


def test_preempted_requests_reuse_their_own_blocks() -> None:
    # a small KV with on-demand growth preempts; the re-prefill finds its own blocks
    s = two_routes(memory_gb=0.13)
    reqs = multi_turn(12, 2, system_prompt_tokens=100, user_tokens=200, output_tokens=300,
                      conversation_gap_s=0.01, turn_gap_s=5.0, seed=1)
    sim = Simulation(s.cluster, s.model, s.cost, s.placement, reqs,
                     SimConfig(duration_s=200.0, kv_allocation="on-demand"))
    sim.decisions = []
    summary = summarize(sim.run())
    assert summary["preemptions"] > 0 and summary["requests_finished"] == len(reqs)
    assert sim.decisions is not None
    # ("admit", id, route, seen, prompt, output left, resumed, cached tokens)
    resumed = [e for e in sim.decisions if e[0] == "admit" and e[6]]
    assert resumed and any(e[7] > 100 for e in resumed)
