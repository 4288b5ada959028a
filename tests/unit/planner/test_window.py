"""The served objective's scoring window (planner/window.py): derived from the placement's
links, KV and prefill, longer on slow links, and deterministic."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from planner_factories import llama70b, make_cluster, measured_cost  # noqa: F401

from helixserve.planner import evaluate
from helixserve.planner.placement import NodeRange, Placement
from helixserve.planner.window import ScoringWindow, fill_time_s
from helixserve.simulator.presets import engine_config
from helixserve.simulator.selection import (
    SelectionConfig,
    simulate_pressure,
    simulate_scored,
    simulate_windowed,
)
from helixserve.simulator.workload import TraceRequest
from helixserve.spec import ClusterSpec, LinkSpec


def two_stage(cluster: ClusterSpec, cost, model) -> Placement:  # noqa: ANN001
    """10 layers on each of eight A100s, one chain: 9 hops from the coordinator and back."""
    p = Placement(model.name, cluster.name, model.num_layers, "test",
                  [NodeRange(f"a100-{i}", 10 * i, 10 * i + 10) for i in range(8)])
    res = evaluate(cluster, model, cost, p)
    p.flows, p.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s
    return p


def with_link(cluster: ClusterSpec, gbps: float, latency_ms: float) -> ClusterSpec:
    return replace(cluster, default_link=LinkSpec(gbps, latency_ms))


@pytest.fixture
def a100s():
    return make_cluster(a100=8, link_gbps=8.0)


def test_fill_grows_with_slow_bandwidth_and_with_latency(a100s, llama70b, measured_cost):  # noqa: F811
    fast = two_stage(a100s, measured_cost, llama70b)
    base = fill_time_s(a100s, llama70b, measured_cost, fast, 763, 232)
    slow = with_link(a100s, 0.1, 1.0)
    far = with_link(a100s, 8.0, 50.0)
    slow_fill = fill_time_s(slow, llama70b, measured_cost, fast, 763, 232)
    far_fill = fill_time_s(far, llama70b, measured_cost, fast, 763, 232)
    assert base > 0
    # 80x less bandwidth: the prompts' crossing, not the prefill, sets the cold start
    assert slow_fill > 10 * base
    # 49 ms more a hop over 9 hops, 232 tokens: about 100 s more
    assert far_fill >= base + 0.9 * 232 * 9 * 0.049
    # more prompt tokens take longer to cross and prefill
    assert fill_time_s(slow, llama70b, measured_cost, fast, 2 * 763, 232) > slow_fill


def test_fill_counts_the_requests_the_kv_holds(a100s, llama70b, measured_cost):  # noqa: F811
    slow = with_link(a100s, 0.1, 1.0)
    p = two_stage(slow, measured_cost, llama70b)
    # requests twice as long: half as many fit the KV, their prompts of the same length
    # cross in about half the time
    short = fill_time_s(slow, llama70b, measured_cost, p, 763, 232)
    long_ = fill_time_s(slow, llama70b, measured_cost, p, 763, 232 + 995)
    assert long_ < 0.6 * short


def test_window_arithmetic():
    w = ScoringWindow()
    assert w.pilot_s(0.0) == 300.0
    assert w.pilot_s(400.0) == 625.0
    assert w.needed_s(400.0, 500.0) == 1900.0
    assert w.needed_s(1000.0, 2000.0) == w.max_duration_s
    # two whole lifetimes fit after fill + L: the last two are counted
    assert w.counted_from_s(1900.0, 400.0, 500.0) == 900.0
    # three fit: the last three
    assert w.counted_from_s(2500.0, 400.0, 500.0) == 1000.0
    # one fits: everything after fill + L
    assert w.counted_from_s(1500.0, 400.0, 500.0) == 900.0
    # none: the last three quarters
    assert w.counted_from_s(1000.0, 400.0, 500.0) == 250.0


def requests(n: int = 300) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.0, 200 + 37 * (i % 7), 16 + 5 * (i % 5)) for i in range(n)]


def config() -> SelectionConfig:
    return SelectionConfig.from_engine(engine_config("vllm"), window=ScoringWindow())


def test_windowed_score_is_deterministic_and_follows_the_links(a100s, llama70b,  # noqa: F811
                                                               measured_cost):  # noqa: F811
    reqs = requests()
    fast = two_stage(a100s, measured_cost, llama70b)
    one = simulate_windowed(a100s, llama70b, measured_cost, fast, reqs, config())
    assert one.tokens_per_s > 0
    # the scorer's entry point runs the same rule again: the same score, the same events
    assert simulate_scored(a100s, llama70b, measured_cost, fast, reqs, config()) == (
        one.tokens_per_s, one.events)
    slow_cluster = with_link(a100s, 1.0, 10.0)
    slow = two_stage(slow_cluster, measured_cost, llama70b)
    s = simulate_windowed(slow_cluster, llama70b, measured_cost, slow, reqs, config())
    assert s.fill_s > 1.5 * one.fill_s
    assert s.lifetime_s > 2 * one.lifetime_s
    assert s.counted_from_s > one.counted_from_s
    assert s.duration_s > one.duration_s
    # the counted span starts after the cold start and the first wave
    assert s.counted_from_s >= s.fill_s + s.lifetime_s - 1.0


def test_fixed_window_without_a_rule(a100s, llama70b, measured_cost):  # noqa: F811
    p = two_stage(a100s, measured_cost, llama70b)
    fixed = SelectionConfig.from_engine(engine_config("vllm"), duration_s=60.0, warmup_s=15.0)
    value, events = simulate_scored(a100s, llama70b, measured_cost, p, requests(), fixed)
    windowed = simulate_windowed(a100s, llama70b, measured_cost, p, requests(), config())
    assert value > 0
    assert events < windowed.events


def test_cli_default_window_same_placement_whatever_jobs(tmp_path, capsys):
    from helixserve.cli import main

    outs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"p{jobs}.json"
        assert main(["plan", "--example", "--work-limit", "2", "--jobs", jobs, "--quiet",
                     "--out", str(out)]) == 0
        placed = json.loads(out.read_text())
        placed.pop("solve_time_s")
        outs.append(placed)
    text = capsys.readouterr().out
    assert "served (simulated, vllm engine, offline, in its own window" in text
    assert outs[0] == outs[1]


def test_prototype_model_in_its_window_with_each_nodes_pressure(a100s, llama70b,  # noqa: F811
                                                                measured_cost):  # noqa: F811
    """The second engine model runs with all of its options (the KV promise, the feeder, the
    per-layer cost): it scores below the vllm model on the same chain, and each node's
    pressure (busy share or KV use over what admission may fill) is reported."""
    reqs = requests()
    p = two_stage(a100s, measured_cost, llama70b)
    proto = SelectionConfig.from_engine(engine_config("helix-prototype"), window=ScoringWindow())
    assert dict(proto.engine_options)["layer_overhead_s"] > 0
    fast = simulate_pressure(a100s, llama70b, measured_cost, p, reqs, config())
    slow = simulate_pressure(a100s, llama70b, measured_cost, p, reqs, proto)
    assert 0 < slow.tokens_per_s < fast.tokens_per_s
    for run in (fast, slow):
        assert set(run.pressure) == {n.name for n in p.nodes}
        assert all(0 < v <= 1.5 for v in run.pressure.values())
