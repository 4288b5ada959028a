"""Cases with a known answer: the simulator must reproduce them."""

from __future__ import annotations

import pytest

from helixserve.simulator.metrics import summarize
from helixserve.simulator.sim import SimConfig, Simulation
from tests.unit.simulator.conftest import Machine, fixed_requests, make_setup, with_flows


def run(setup, reqs, **cfg):  # type: ignore[no-untyped-def]
    config = SimConfig(**{"scheduler": "maxflow", **cfg})
    return summarize(
        Simulation(setup.cluster, setup.model, setup.cost, setup.placement, reqs, config).run()
    )


def test_one_node_fixed_batch_throughput_is_batch_over_iteration_time() -> None:
    # 4 layers x 10 ms per iteration, at most 8 sequences: 8 / 0.040 s = 200 tokens/s.
    s = with_flows(make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, max_decode=8)]))
    out = run(
        s, fixed_requests(50, prompt=16, output=1000), offline=True, duration_s=60.0, warmup_s=10.0
    )
    assert out["decode_throughput_tokens_per_s"] == pytest.approx(200.0, rel=0.01)
    assert out["nodes"][0]["mean_decode_batch"] == pytest.approx(8.0, rel=0.01)
    assert out["nodes"][0]["utilization"] == pytest.approx(1.0, abs=0.01)


def test_two_stage_pipeline_is_limited_by_the_slower_stage() -> None:
    # a: 2 layers x 10 ms = 20 ms per batch of 8 (400 tokens/s); b: 2 x 20 ms (200 tokens/s).
    s = with_flows(
        make_setup(
            [
                Machine("a", "T4", 0, 2, decode_ms=10.0),
                Machine("b", "L4", 2, 4, decode_ms=20.0),
            ]
        )
    )
    out = run(
        s, fixed_requests(50, prompt=16, output=1000), offline=True, duration_s=60.0, warmup_s=10.0
    )
    assert out["decode_throughput_tokens_per_s"] == pytest.approx(200.0, rel=0.02)
    util = {n["name"]: n["utilization"] for n in out["nodes"]}
    assert util["b"] == pytest.approx(1.0, abs=0.02)
    # a's time does not depend on its batch, and b's batches of 8 come back split, so a
    # runs a little more than the 50% full batches would need.
    assert 0.45 < util["a"] < 0.75



def test_the_head_runs_on_the_last_stage_only_and_the_flow_leaves_it_out() -> None:
    # a: 2 layers x 10 ms per batch of 8 (400 tokens/s); b: 2 x 10 ms + its head 20 ms per
    # batch (200 tokens/s). The same head on a (not holding layer 3) costs nothing. The
    # planner's flow is per layer (Helix's T(k), the same wherever the layers sit), so it
    # leaves the head out: 400 tokens/s.
    s = with_flows(make_setup([Machine("a", "T4", 0, 2, decode_ms=10.0, head_ms=20.0),
                               Machine("b", "L4", 2, 4, decode_ms=10.0, head_ms=20.0)]))
    assert s.placement.throughput_tokens_per_s == pytest.approx(400.0, rel=0.01)
    out = run(
        s, fixed_requests(50, prompt=16, output=1000), offline=True, duration_s=60.0, warmup_s=10.0
    )
    assert out["decode_throughput_tokens_per_s"] == pytest.approx(200.0, rel=0.02)
    assert {n["name"]: n["utilization"] for n in out["nodes"]}["b"] == pytest.approx(1.0, abs=0.02)


def test_a_prompt_reaches_the_head_once_after_its_last_chunk() -> None:
    # prompt of 100 in chunks of 40, 40, 20 (5 ms a layer whatever the chunk): a runs 3 x 10 ms,
    # b 3 x 10 ms and the head (7 ms) after the last chunk only: the first token at 67 ms
    # (a head after every chunk would give 81 ms)
    s = with_flows(make_setup([Machine("a", "T4", 0, 2, decode_ms=1.0, prompt_ms=5.0),
                               Machine("b", "L4", 2, 4, decode_ms=1.0, prompt_ms=5.0,
                                       head_ms=7.0)]))
    sim = Simulation(s.cluster, s.model, s.cost, s.placement, fixed_requests(1, 100, 1),
                     SimConfig(scheduler="maxflow", duration_s=5.0, chunked_prefill=True,
                               max_prompt_tokens=40))
    sim.run()
    (r,) = sim.finished
    assert r.first_s - r.arrival_s == pytest.approx(0.067, abs=1e-6)  # links: ns

def test_link_limited_pipeline() -> None:
    # Each token crosses a -> b as 1024 x 2 = 2048 bytes; the link carries 204,800 B/s, i.e.
    # 100 token-activations/s. Per request: 16 prompt tokens + 999 decode steps cross it for
    # 1000 output tokens, so the output rate is 100 x 1000 / 1015 tokens/s.
    slow_gbps = 204_800 * 8 / 1e9
    # Little KV (~100 requests), else the offline run admits ~800 requests whose prompts
    # alone keep the slow link busy for the whole run.
    s = make_setup(
        [
            Machine("a", "T4", 0, 2, decode_ms=0.5, memory_gb=0.5),
            Machine("b", "L4", 2, 4, decode_ms=0.5, memory_gb=0.5),
        ],
        links=[{"src": "a", "dst": "b", "bandwidth_gbps": slow_gbps, "latency_ms": 1.0}],
    )
    s = with_flows(s)
    assert s.placement.throughput_tokens_per_s == pytest.approx(100.0, rel=0.01)
    out = run(
        s, fixed_requests(50, prompt=16, output=1000), offline=True, duration_s=60.0, warmup_s=10.0
    )
    assert out["decode_throughput_tokens_per_s"] == pytest.approx(100 * 1000 / 1015, rel=0.02)
    link = {(k["src"], k["dst"]): k["utilization"] for k in out["links"]}
    assert link["a", "b"] == pytest.approx(1.0, abs=0.02)


def test_kv_exhaustion_makes_requests_wait_not_overfill() -> None:
    s = with_flows(
        make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, max_decode=64, memory_gb=0.2)])
    )
    cap = s.cost.kv_capacity_tokens(s.cluster.node("a"), 4)
    per_request = 500 + 500
    fit = cap // per_request
    assert 2 <= fit < 20, cap  # the setup is meant to hold a few requests only
    sim = Simulation(
        s.cluster,
        s.model,
        s.cost,
        s.placement,
        fixed_requests(20, prompt=500, output=500),
        SimConfig(duration_s=5.0),
    )
    out = summarize(sim.run())
    node = out["nodes"][0]
    assert node["kv_peak_usage"] <= 1.0
    assert node["kv_peak_usage"] * cap == fit * per_request
    # The batch never held more than `fit` sequences, and the rest waited.
    assert out["requests_in_flight"] == fit
    assert out["requests_waiting"] == 20 - fit - out["requests_finished"]
    assert out["requests_waiting"] > 0 and out["requests_rejected"] == 0
    # Given time, every request finishes: waiting is admission control, not a drop.
    out = run(s, fixed_requests(20, prompt=500, output=500), duration_s=600.0)
    assert out["requests_finished"] == 20 and out["requests_waiting"] == 0


def test_request_larger_than_any_node_is_rejected_not_blocking() -> None:
    s = with_flows(make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, memory_gb=0.2)]))
    cap = s.cost.kv_capacity_tokens(s.cluster.node("a"), 4)
    reqs = fixed_requests(3, prompt=16, output=16)
    reqs.insert(1, type(reqs[0])("huge", 0.0, cap, 10))
    out = run(s, reqs, duration_s=30.0)
    assert out["requests_rejected"] == 1 and out["requests_finished"] == 3


@pytest.mark.parametrize("scheduler", ["maxflow", "random", "shortest-queue", "swarm"])
def test_saturated_throughput_never_exceeds_max_flow(scheduler: str) -> None:
    # A 2 x 2 mesh of unequal machines (no partial inference: a node running only the tail
    # of its range is faster than the T(k) of its whole range, so the max flow would not
    # bound it; see docs/simulator.md).
    s = with_flows(
        make_setup(
            [
                Machine("a", "T4", 0, 2, decode_ms=10.0, prompt_ms=0.01, memory_gb=1.0),
                Machine("b", "L4", 2, 4, decode_ms=12.0, prompt_ms=0.01, memory_gb=1.0),
                Machine("c", "A10", 0, 2, decode_ms=8.0, prompt_ms=0.01, memory_gb=1.0),
                Machine("d", "A10G", 2, 4, decode_ms=30.0, prompt_ms=0.01, memory_gb=1.0),
            ]
        )
    )
    bound = s.placement.throughput_tokens_per_s
    assert bound is not None and bound > 0
    out = run(
        s,
        fixed_requests(40, prompt=64, output=300),
        offline=True,
        duration_s=40.0,
        warmup_s=5.0,
        scheduler=scheduler,
    )
    # Tolerance 1%: tokens finishing in the window may have started before it.
    assert out["decode_throughput_tokens_per_s"] <= bound * 1.01
    assert out["decode_throughput_tokens_per_s"] > 0.3 * bound
