"""The options that model Helix's prototype (`--engine helix-prototype`, docs/calibration.md):
KV expectation admission, the offline feeders, routing over the solver's flow, the per-layer
cost; and the calibration itself on Helix's single-24 placement (benchmarks/calibration.py)."""

from __future__ import annotations

import math

import pytest

from helixserve.errors import UserError
from helixserve.simulator.metrics import summarize
from helixserve.simulator.offline import bottleneck_kv_usage, layer_groups
from helixserve.simulator.presets import ENGINES, engine_config, engine_gpu_reserve_gb
from helixserve.simulator.sim import SimConfig, Simulation
from tests.unit.simulator.conftest import Machine, fixed_requests, make_setup, with_flows

#: Helix's prototype on its own placement, offline (artifact ae_readme.md); the issue's target
#: is the helix-prototype model within 20% of it
PROTOTYPE_DECODE_TOKENS_PER_S = 223.4


def simulate(setup, reqs, **cfg):  # type: ignore[no-untyped-def]
    sim = Simulation(
        setup.cluster, setup.model, setup.cost, setup.placement, reqs,
        SimConfig(**{"scheduler": "maxflow", **cfg}),
    )  # fmt: skip
    return sim, summarize(sim.run())


def one_node(memory_gb: float = 16.0):  # type: ignore[no-untyped-def]
    """4 layers x 10 ms a decode iteration, x 5 ms a prompt batch."""
    return with_flows(make_setup(
        [Machine("a", "T4", 0, 4, decode_ms=10.0, prompt_ms=5.0, max_decode=64,
                 memory_gb=memory_gb)]))


def test_layer_overhead_is_added_to_every_layer_of_every_iteration() -> None:
    # 4 layers x (10 ms + 2.5 ms) per iteration of at most 8 sequences: 8 / 0.050 = 160/s,
    # where the profile alone gives 8 / 0.040 = 200/s (test_analytic.py)
    s = with_flows(make_setup([Machine("a", "T4", 0, 4, decode_ms=10.0, max_decode=8)]))
    reqs = fixed_requests(50, prompt=16, output=1000)
    _, plain = simulate(s, reqs, offline=True, duration_s=60.0, warmup_s=10.0)
    _, slow = simulate(s, reqs, offline=True, duration_s=60.0, warmup_s=10.0,
                       layer_overhead_s=0.0025)
    assert plain["decode_throughput_tokens_per_s"] == pytest.approx(200.0, rel=0.01)
    assert slow["decode_throughput_tokens_per_s"] == pytest.approx(160.0, rel=0.01)


def test_layer_overhead_counts_only_the_layers_a_partial_batch_runs() -> None:
    # b holds [1, 4) but every route enters it at layer 2 (after a's [0, 2)): 2 layers a batch
    s = with_flows(make_setup([Machine("a", "T4", 0, 2, decode_ms=1.0, max_decode=64),
                               Machine("b", "L4", 1, 4, decode_ms=1.0, max_decode=64)]))
    sim = Simulation(s.cluster, s.model, s.cost, s.placement, fixed_requests(1, 16, 4),
                     SimConfig(layer_overhead_s=0.01))
    r = sim.requests[0]
    b = sim.nodes["b"]
    assert b.may_partial
    assert math.isclose(sim.steps._partial_batch_time(b, [], [_at_hop(sim, r, b)]),
                        2 * (0.001 + 0.01))


def _at_hop(sim, req, node):  # type: ignore[no-untyped-def]
    """A SimRequest decoding on `node`, entering where a route from the coordinator does."""
    from helixserve.simulator.nodes import SimRequest

    r = SimRequest(req.request_id, 0.0, req.prompt_tokens, req.output_tokens)
    r.nodes = (sim.nodes["a"], node)
    r.starts = (0, 2)
    r.hop = 1
    return r


def test_kv_expectation_admits_on_prompt_plus_expected_output_within_the_watermark() -> None:
    s = one_node(memory_gb=0.2)
    cap = s.cost.kv_capacity_tokens(s.cluster.node("a"), 4)
    prompt, expected = 300, 200
    sim = Simulation(s.cluster, s.model, s.cost, s.placement,
                     fixed_requests(100, prompt=prompt, output=50),
                     SimConfig(scheduler="maxflow", kv_allocation="on-demand", kv_watermark=0.15,
                               kv_expected_output_tokens=expected, duration_s=0.001))
    sim.run()
    # promises of prompt + 200 stay within 85% of the KV, whatever the requests generate
    fit = (cap - int(0.15 * cap)) // (prompt + expected)
    assert sim.in_flight == fit
    assert sim.kv.nodes["a"].promised_tokens == fit * (prompt + expected)
    node = sim.nodes["a"]
    assert node.kv_used == fit * prompt  # the node holds only what the requests hold
    assert node.kv_promised == fit * (prompt + expected)


def test_kv_expectation_growth_beyond_the_promise_preempts_and_every_request_finishes() -> None:
    # outputs (900) far past the expectation (100): the nodes fill and preempt, never overfill
    s = one_node(memory_gb=0.2)
    sim, out = simulate(s, fixed_requests(25, prompt=200, output=900), kv_allocation="on-demand",
                        kv_watermark=0.15, kv_expected_output_tokens=100, duration_s=3000.0)
    node = sim.nodes["a"]
    assert out["preemptions"] > 0
    assert out["requests_finished"] == 25
    assert node.kv_peak <= node.kv_cap
    assert node.kv_used == node.kv_promised == node.kv_promised_layers == 0
    # the router's view is the promise, not the growth: it is whole again once all finished
    assert node.state.kv_free_tokens == node.kv_cap - node.kv_mark


def test_kv_expectation_needs_on_demand_allocation() -> None:
    s = one_node()
    with pytest.raises(UserError, match="kv_expected_output_tokens"):
        Simulation(s.cluster, s.model, s.cost, s.placement, fixed_requests(1, 16, 4),
                   SimConfig(kv_allocation="reserve", kv_expected_output_tokens=240))


@pytest.mark.parametrize("bad", [{"offline_feed": "trickle"}, {"feed_kv_fraction": 0.0},
                                 {"feed_initial_requests": 0}, {"layer_overhead_s": -1.0}])
def test_bad_feeder_options_are_user_errors(bad: dict[str, object]) -> None:
    s = one_node()
    with pytest.raises(UserError):
        Simulation(s.cluster, s.model, s.cost, s.placement, fixed_requests(1, 16, 4),
                   SimConfig(offline=True, **bad))  # type: ignore[arg-type]


def test_kv_feeder_sends_its_initial_requests_apart_then_feeds_while_kv_allows() -> None:
    s = one_node(memory_gb=0.2)
    cap = s.cost.kv_capacity_tokens(s.cluster.node("a"), 4)
    prompt, expected = 300, 200
    sim, out = simulate(
        s, fixed_requests(1, prompt=prompt, output=400), offline=True, duration_s=120.0,
        kv_allocation="on-demand", kv_watermark=0.15, kv_expected_output_tokens=expected,
        offline_feed="kv-feeder", feed_initial_requests=3, feed_interval_s=0.5,
        feed_kv_fraction=0.5)
    arrivals = sorted(r.arrival_s for r in [*sim.finished, *sim.running.values()])
    # the three initial ones 0.5 s apart; the first prompt done (20 ms later) fed one more
    assert {0.5, 1.0, 1.5} <= {round(t, 9) for t in arrivals}
    assert arrivals[:2] == pytest.approx([0.5, 0.52])
    # a request is fed only while the promises are at most half the KV: at most one past it
    most = math.floor(0.5 * cap / (prompt + expected)) + 1
    assert 0 < sim.in_flight <= most
    assert out["requests_finished"] > 3  # it kept feeding as requests finished
    assert bottleneck_kv_usage(sim.offline.layer_groups) <= 0.5 + (prompt + expected) / cap
    assert out["feed_dropped"] == 0


def test_kv_feeder_drops_a_request_no_route_takes() -> None:
    # the feeder stops at 100% promised, the router already at 85%: fed requests find no route
    s = one_node(memory_gb=0.2)
    sim, out = simulate(
        s, fixed_requests(1, prompt=300, output=400), offline=True, duration_s=60.0,
        kv_allocation="on-demand", kv_watermark=0.15, kv_expected_output_tokens=200,
        offline_feed="kv-feeder", feed_initial_requests=2, feed_kv_fraction=1.0)
    assert out["feed_dropped"] > 0
    assert sim.arrived + out["feed_dropped"] > out["requests_finished"] + sim.in_flight


@pytest.mark.parametrize("scheduler", ["maxflow", "swarm"])
def test_closed_feeder_keeps_a_fixed_number_in_flight(scheduler: str) -> None:
    s = one_node()
    # router_spread is maxflow's knob: another policy (Helix's swarm host) ignores it
    sim, out = simulate(s, fixed_requests(1, prompt=100, output=50), offline=True,
                        duration_s=60.0, offline_feed="closed", feed_initial_requests=5,
                        scheduler=scheduler, router_spread=False)
    assert out["requests_finished"] > 20
    assert sim.in_flight + len(sim.waiting) == 5
    assert sim.arrived == out["requests_finished"] + 5


def test_partial_hops_count_their_own_layers_in_the_feeder_usage() -> None:
    # a [0, 2) then b [1, 4) entered at 2: b is promised 2 of its 3 layers per request
    s = with_flows(make_setup([Machine("a", "T4", 0, 2, decode_ms=1.0, max_decode=64),
                               Machine("b", "L4", 1, 4, decode_ms=1.0, max_decode=64)]))
    sim = Simulation(s.cluster, s.model, s.cost, s.placement, fixed_requests(1, 100, 1000),
                     SimConfig(kv_allocation="on-demand", kv_expected_output_tokens=50,
                               duration_s=0.0001))
    sim.run()
    a, b = sim.nodes["a"], sim.nodes["b"]
    assert sim.in_flight == 1
    assert (a.kv_promised, b.kv_promised) == (150, 150)
    assert (a.kv_promised_layers, b.kv_promised_layers) == (300, 300)
    # layer 1 is held by a and b: a's 150 a layer plus b's 300 / 3 layers, over both KVs
    usage_layer1 = (150 + 100) / (a.kv_cap + b.kv_cap)
    assert bottleneck_kv_usage(layer_groups(sim.nodes.values(), 4)) == pytest.approx(
        max(150 / a.kv_cap, usage_layer1, 100 / b.kv_cap))


def test_router_spread_false_routes_over_the_solvers_flow() -> None:
    s = with_flows(make_setup([Machine("a", "T4", 0, 2, decode_ms=1.0),
                               Machine("b", "L4", 0, 2, decode_ms=2.0),
                               Machine("c", "A100-40GB", 2, 4, decode_ms=1.0)]))
    flows = {(f.src, f.dst): f.tokens_per_s for f in s.placement.flows if f.tokens_per_s > 0}
    sim = Simulation(s.cluster, s.model, s.cost, s.placement, fixed_requests(1, 16, 4),
                     SimConfig(router_spread=False))
    weights = {(src, dst): w for src, out in sim.router.weights.items() for dst, w in out.items()}
    assert weights == pytest.approx(flows)


def test_helix_router_masks_edges_under_5_percent_and_never_spills() -> None:
    # Helix's scheduler (scheduler_core.py): edges under 5% of the vertex's outflow are masked
    # and nothing goes outside the flow; helixserve's router keeps a 3% edge and may spill
    from helixserve.planner.placement import Flow
    from helixserve.simulator.presets import HELIX_ROUTER

    s = make_setup([Machine("a", "T4", 0, 2, decode_ms=1.0, max_decode=64),
                    Machine("b", "L4", 0, 2, decode_ms=1.0, max_decode=64),
                    Machine("c", "A100-40GB", 2, 4, decode_ms=1.0, max_decode=64)])
    s.placement.flows = [Flow("coordinator", "a", 97.0), Flow("coordinator", "b", 3.0),
                         Flow("a", "c", 97.0), Flow("b", "c", 3.0), Flow("c", "coordinator", 100.0)]
    reqs = fixed_requests(40, prompt=16, output=8, gap_s=0.01)
    ours = Simulation(s.cluster, s.model, s.cost, s.placement, reqs,
                      SimConfig(router_spread=False))
    assert set(ours.router.weights["coordinator"]) == {"a", "b"}
    helix = Simulation(s.cluster, s.model, s.cost, s.placement, reqs, SimConfig(**HELIX_ROUTER))
    assert helix.router.weights["coordinator"] == {"a": 97.0}
    assert helix.router.spill_edges == set()
    helix.run()
    assert helix.nodes["b"].iters == 0 and helix.nodes["a"].iters > 0
    assert len(helix.finished) == 40


def test_helix_prototype_engine_preset() -> None:
    config = engine_config("helix-prototype", max_prefilling=8)
    assert config["max_prefilling"] == 8
    assert config["chunked_prefill"] is False and config["max_prompt_tokens"] == 4096
    assert config["kv_expected_output_tokens"] == 240 and config["offline_feed"] == "kv-feeder"
    assert engine_gpu_reserve_gb("helix-prototype") == 4.5
    SimConfig(**config)  # every key is a SimConfig field
    # the presets the CLI and the benchmarks default to are unchanged
    assert set(ENGINES["vllm"]) == set(ENGINES["reserve"]) == {
        "kv_allocation", "chunked_prefill", "prefill_chunk_tokens", "max_prompt_tokens",
        "max_prefilling", "kv_watermark"}


# ---- the calibration on Helix's own placement (shared data; docs/calibration.md) ----------


def _helix_single_24(shared_data):  # type: ignore[no-untyped-def]
    from pathlib import Path

    from helixserve.costmodel import CostModel
    from helixserve.planner import evaluate, load_placement
    from helixserve.simulator.workload import load_azure_trace, prepare_trace
    from helixserve.spec import load_cluster, load_model, load_profiles

    repo = Path(__file__).resolve().parents[3]
    model = load_model(shared_data / "models" / "llama-2-70b")
    cost = CostModel(model, load_profiles(shared_data / "profiles" / "helix-measured.csv"),
                     reserved_gb_per_gpu=engine_gpu_reserve_gb("helix-prototype"))
    cluster = load_cluster(shared_data / "clusters" / "helix-single-24.yaml")
    placement = load_placement(
        repo / "benchmarks" / "helix-placements" / "helix-single-24-llama-2-70b.json")
    res = evaluate(cluster, model, cost, placement)
    placement.flows, placement.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s
    trace = prepare_trace(load_azure_trace(shared_data / "traces" / "azure-llm-conv-2023.csv"))

    def run(engine: str, **fields: object) -> float:
        config = SimConfig(offline=True, scheduler="maxflow", seed=0,
                           **{**ENGINES[engine], **fields})  # type: ignore[arg-type]
        out = summarize(Simulation(cluster, model, cost, placement, trace, config).run())
        return float(out["decode_throughput_tokens_per_s"])

    return run


def test_helix_prototype_model_lands_within_20_percent_of_the_prototype(shared_data) -> None:  # type: ignore[no-untyped-def]
    run = _helix_single_24(shared_data)
    # the prototype's run: 300 s, the first 60 s not counted
    modelled = run("helix-prototype", duration_s=300.0, warmup_s=60.0)
    assert abs(modelled / PROTOTYPE_DECODE_TOKENS_PER_S - 1) <= 0.20
    # 220.5 before the last stage's head was counted (docs/calibration.md "The head"); this
    # mode's kv-feeder makes it move either way by a few % with any change of step times
    assert modelled == pytest.approx(229.6, abs=0.5)
    # without the per-layer cost fitted to the prototype's online run, 26% too high (27%
    # before the head was counted)
    unfitted = run("helix-prototype", duration_s=300.0, warmup_s=60.0, layer_overhead_s=0.0)
    assert unfitted == pytest.approx(281.2, abs=0.5)
    assert unfitted / PROTOTYPE_DECODE_TOKENS_PER_S - 1 > 0.15


def test_the_vllm_model_on_helix_placement_is_unchanged(shared_data) -> None:  # type: ignore[no-untyped-def]
    # docs/calibration.md: 453.6 decode tokens/s, 600 s offline, 60 s warmup: the prompt
    # chunks pipeline along the route as the runtime sends them, and the last stage runs the
    # head (448.5 with neither; a request preempted twice re-prefills prompt + its tokens,
    # not its first recompute's again); 451.3 before a NIC stopped waiting for a link's
    # queue (simulator/network.py)
    assert _helix_single_24(shared_data)("vllm", duration_s=600.0, warmup_s=60.0) == \
        pytest.approx(453.58, abs=0.1)
