"""helixserve.simulator.selection: rule-generated stacked tilings and selection by simulation."""

from __future__ import annotations

import pytest

from helixserve.errors import UserError
from helixserve.planner.placement import NodeRange, Placement
from helixserve.simulator.selection import (
    SelectionConfig,
    select_placement,
    simulate_candidate,
)
from helixserve.simulator.tilings import stacked_tilings
from tests.unit.simulator.conftest import Machine, fixed_requests, make_setup

# Two fast machines and four slow ones, every machine fits all 4 layers of the tiny model.
MACHINES = [
    Machine("f0", "A100-40GB", 0, 4, decode_ms=10.0, prompt_ms=10.0, max_decode=64, memory_gb=0.2),
    Machine("f1", "A100-40GB", 0, 4, decode_ms=10.0, prompt_ms=10.0, max_decode=64, memory_gb=0.2),
    *(Machine(f"s{i}", "T4", 0, 4, decode_ms=50.0, prompt_ms=50.0, max_decode=64, memory_gb=0.2) for i in range(4)),
]


def test_stacked_tilings_cover_the_model_use_every_machine_and_fit_memory() -> None:
    s = make_setup(MACHINES)
    tilings = stacked_tilings(s.cluster, s.model, s.cost)
    assert tilings
    estimates = [e for e, _ in tilings]
    assert estimates == sorted(estimates, reverse=True)
    shapes = set()
    for _, p in tilings:
        assert p.covers_all_layers()
        assert sorted(n.name for n in p.nodes) == sorted(m.name for m in MACHINES)
        for n in p.nodes:
            assert n.num_layers <= s.cost.max_layers(s.cluster.node(n.name))
        # stages are stacked: each layer range is held by machines of one GPU type, and the
        # fast type (A100: 10 ms a layer) comes first
        first = min(p.nodes, key=lambda n: n.start_layer)
        assert first.name.startswith("f")
        shapes.add(tuple(sorted((n.name, n.start_layer, n.end_layer) for n in p.nodes)))
    assert len(shapes) == len(tilings)  # no duplicates


def test_selection_returns_the_candidate_with_the_best_simulation() -> None:
    s = make_setup(MACHINES)
    # A given placement that leaves the fast machines almost idle: all 4 layers on the slow
    # machines, the fast ones holding one replicated layer each at the front.
    slow = Placement(
        "tiny", "analytic", 4, "given",
        [NodeRange("f0", 0, 1), NodeRange("f1", 0, 1),
         *(NodeRange(f"s{i}", 1, 4) for i in range(4))],
    )  # fmt: skip
    reqs = fixed_requests(40, prompt=300, output=60)
    cfg = SelectionConfig(duration_s=20.0, warmup_s=2.0, tilings=3)
    best, report = select_placement(s.cluster, s.model, s.cost, [slow], reqs, cfg, jobs=1)
    # the four simulations on two processes: each is deterministic, so the same report
    assert select_placement(s.cluster, s.model, s.cost, [slow], reqs, cfg, jobs=2)[1] == report
    assert best.planner == "milp-serving"
    assert len(report) == 4 and sum(r["chosen"] for r in report) == 1
    chosen = next(r for r in report if r["chosen"])
    assert chosen["simulated_tokens_per_s"] == max(r["simulated_tokens_per_s"] for r in report)
    # The returned placement is the chosen candidate's, and simulating it again gives the
    # same number (the simulator is deterministic).
    again = simulate_candidate(s.cluster, s.model, s.cost, best, reqs, cfg)
    assert again == pytest.approx(chosen["simulated_tokens_per_s"])
    assert best.flows and best.covers_all_layers()


def test_selection_needs_requests() -> None:
    s = make_setup(MACHINES)
    with pytest.raises(UserError, match="requests"):
        select_placement(s.cluster, s.model, s.cost, [], [], SelectionConfig(tilings=1))


def test_regional_pipelines_keep_every_route_inside_a_region(shared_data) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from helixserve.costmodel import CostModel
    from helixserve.planner import plan
    from helixserve.simulator.selection import regional_pipelines
    from helixserve.spec import load_cluster, load_model, load_profiles

    model = load_model(shared_data / "models" / "llama-2-70b")
    cost = CostModel(model, load_profiles(shared_data / "profiles" / "helix-measured.csv"))
    geo = load_cluster(shared_data / "clusters" / "helix-geo-24.yaml")
    p = regional_pipelines(geo, model, cost)
    assert p is not None and p.planner == "regional-pipelines"
    by_region: dict[str, list[NodeRange]] = {}
    for n in p.nodes:
        node = geo.node(n.name)
        by_region.setdefault(node.region, []).append(n)
        # no region holds the model within the weight cap, so each goes beyond it, but
        # every machine still loads its layers with KV for a context on each
        assert n.num_layers <= cost.loadable_layers(node)
        assert cost.kv_capacity_tokens(node, n.num_layers) >= cost.context_tokens
    assert len(by_region) == 3
    for nodes in by_region.values():  # one chain per region over all of its machines
        chain = sorted((n.start_layer, n.end_layer) for n in nodes)
        assert chain[0][0] == 0 and chain[-1][1] == 80
        assert all(a[1] == b[0] for a, b in zip(chain, chain[1:], strict=False))
    assert len(p.nodes) == len(geo.nodes)
    # the four A100s of region-0 split the 80 layers evenly: the most KV the slowest keeps
    assert sorted(n.num_layers for n in by_region["region-0"]) == [20] * 4
    # a region that cannot hold the model even beyond the cap is left out
    small = dataclasses.replace(
        geo, nodes=[n for n in geo.nodes if n.region != "region-1" or n.name in ("n4", "n6")])
    q = regional_pipelines(small, model, cost)
    assert q is not None and {small.node(n.name).region for n in q.nodes} == {
        "region-0", "region-2"}
    # one region: nothing to keep apart
    single = load_cluster(shared_data / "clusters" / "helix-single-24.yaml")
    assert regional_pipelines(single, model, cost) is None
    # the selection simulates it next to the given placement and the stacked tilings
    given = plan("petals", geo, model, cost)
    reqs = fixed_requests(60, prompt=300, output=40)
    best, report = select_placement(geo, model, cost, [given], reqs,
                                 SelectionConfig(duration_s=20.0, warmup_s=2.0, tilings=1))
    sources = ["given:petals", "stacked-tiling", "regional-pipelines"]
    assert [r["source"] for r in report] == sources + [f"{x} +within-regions" for x in sources]
    assert all(r["simulated_tokens_per_s"] is not None for r in report)
    chosen = next(r for r in report if r["chosen"])
    assert best.route_within_regions == chosen["source"].endswith("+within-regions")


def test_replay_scores_the_burst_over_its_makespan_and_lets_shallow_baselines_win() -> None:
    """A burst of two requests: a request's tokens/s is bounded by its route's per-token
    latency, so a 4-stage chain serves less than a machine holding every layer."""
    from helixserve.simulator.selection import REPLAY_BASELINES, replay_tokens_per_s
    from helixserve.simulator.sim import SimConfig, Simulation

    s = make_setup(MACHINES)
    chain = Placement(
        "tiny", "analytic", 4, "given",
        [NodeRange("f0", 0, 1), NodeRange("f1", 1, 2), NodeRange("s0", 2, 3),
         *(NodeRange(f"s{i}", 3, 4) for i in (1, 2, 3))],
    )  # fmt: skip
    burst = fixed_requests(2, prompt=50, output=20)
    cfg = SelectionConfig(duration_s=600.0, tilings=2, mode="replay")
    best, report = select_placement(s.cluster, s.model, s.cost, [chain], burst, cfg, jobs=1)
    sources = [r["source"] for r in report]
    assert [f"baseline:{b}" for b in REPLAY_BASELINES if f"baseline:{b}" in sources]
    chosen = next(r for r in report if r["chosen"])
    given = next(r for r in report if r["source"] == "given:given")
    assert chosen["simulated_tokens_per_s"] == max(r["simulated_tokens_per_s"] for r in report)
    assert chosen["simulated_tokens_per_s"] > given["simulated_tokens_per_s"]
    # fewer stages than the chain's 4: some machine holds more than one layer
    assert max(n.num_layers for n in best.nodes) > 1
    # the score is the burst's output tokens over its makespan, from the simulation itself
    sim_cfg = SimConfig(duration_s=600.0, kv_allocation=cfg.kv_allocation,
                        chunked_prefill=cfg.chunked_prefill,
                        max_prompt_tokens=cfg.max_prompt_tokens,
                        max_prefilling=cfg.max_prefilling)
    result = Simulation(s.cluster, s.model, s.cost, best, list(burst), sim_cfg).run()
    assert len(result.finished) == 2
    span_s = max(r.finish_s for r in result.finished) - min(q.arrival_s for q in burst)
    assert replay_tokens_per_s(result, burst) == pytest.approx(40 / span_s)
    assert chosen["simulated_tokens_per_s"] == pytest.approx(40 / span_s)


def test_unknown_selection_mode_is_an_error_naming_the_flag() -> None:
    s = make_setup(MACHINES)
    with pytest.raises(UserError, match="--serve-mode: unknown mode 'bogus'"):
        select_placement(s.cluster, s.model, s.cost, [], fixed_requests(2, 10, 5),
                         SelectionConfig(mode="bogus"))


def test_stacked_tilings_of_a_42_machine_cluster_stop_at_the_caps(shared_data) -> None:  # type: ignore[no-untyped-def]
    """helix-mix-42's 7 machine types give 21 billion (replicas, layers) choices and ~910
    million tilings: the enumeration stops at MAX_TILINGS estimated, within a budget of
    steps, instead of walking the product."""
    from pathlib import Path

    from helixserve.costmodel import CostModel
    from helixserve.simulator.tilings import MAX_TILING_STEPS, MAX_TILINGS, TilingCount
    from helixserve.spec import load_cluster, load_model, load_profiles

    model = load_model(shared_data / "models" / "llama-2-70b")
    cost = CostModel(model, load_profiles(shared_data / "profiles" / "helix-measured.csv"))
    mix = load_cluster(Path(__file__).resolve().parents[3] / "benchmarks" / "helix-clusters"
                       / "helix-mix-42.yaml")
    count = TilingCount()
    tilings = stacked_tilings(mix, model, cost, count=count)
    assert count.capped and count.candidates == MAX_TILINGS
    assert count.steps <= MAX_TILING_STEPS
    assert 0 < len(tilings) <= MAX_TILINGS
    estimates = [e for e, _ in tilings]
    assert estimates == sorted(estimates, reverse=True)
    for _, p in tilings[:50]:
        assert p.covers_all_layers() and len(p.nodes) == len(mix.nodes)
        for n in p.nodes:
            assert n.num_layers <= cost.max_layers(mix.node(n.name))
    # a smaller cap stops sooner, and the step cap alone stops it too
    few = TilingCount()
    assert len(stacked_tilings(mix, model, cost, max_tilings=10, count=few)) <= 10
    assert few.candidates == 10 and few.steps < count.steps
    short = TilingCount()
    stacked_tilings(mix, model, cost, max_steps=100, count=short)
    assert short.capped and short.steps == 100


def test_stacked_tilings_under_the_caps_are_the_full_enumeration(shared_data) -> None:  # type: ignore[no-untyped-def]
    """helix-single-24 has 667 tilings, under the caps: every one is estimated, and with the
    caps lifted the list is the same."""
    from helixserve.costmodel import CostModel
    from helixserve.simulator.tilings import TilingCount
    from helixserve.spec import load_cluster, load_model, load_profiles

    model = load_model(shared_data / "models" / "llama-2-70b")
    cost = CostModel(model, load_profiles(shared_data / "profiles" / "helix-measured.csv"))
    single = load_cluster(shared_data / "clusters" / "helix-single-24.yaml")
    count = TilingCount()
    tilings = stacked_tilings(single, model, cost, count=count)
    assert not count.capped and count.candidates == 667
    unlimited = stacked_tilings(single, model, cost, max_tilings=10**9, max_steps=10**9)
    assert [(e, p.nodes) for e, p in tilings] == [(e, p.nodes) for e, p in unlimited]


def test_a_stated_load_scores_placements_at_that_many_requests_in_flight() -> None:
    """`plan --serve-concurrency N`: a closed loop of N requests. At one request in flight
    two machines holding every layer serve more than a six-machine chain (a request's pace
    is its route's per-token latency); saturated, the chain's KV and stages win."""
    from helixserve.simulator.sim import SimConfig, Simulation

    s = make_setup(MACHINES)
    chain = Placement("tiny", "analytic", 4, "chain", [
        NodeRange("f0", 0, 2), NodeRange("f1", 2, 4),
        *(NodeRange(f"s{i}", i, i + 1) for i in range(4))])
    fat = Placement("tiny", "analytic", 4, "fat", [NodeRange("f0", 0, 4), NodeRange("f1", 0, 4)])
    reqs = fixed_requests(60, prompt=300, output=40)

    def score(p: Placement, concurrency: int | None) -> float:
        cfg = SelectionConfig(duration_s=120.0, warmup_s=20.0, concurrency=concurrency)
        return simulate_candidate(s.cluster, s.model, s.cost, p, reqs, cfg)

    assert score(fat, 1) > 2 * score(chain, 1)
    assert score(chain, None) > 1.5 * score(fat, None)
    assert score(chain, 1) < score(chain, 16) < score(chain, None)
    # the score is the simulator's own closed loop of that many, both engine models alike
    cfg = SelectionConfig(duration_s=120.0, warmup_s=20.0, concurrency=4,
                          engine_options=(("offline_feed", "kv-feeder"),))
    assert cfg.sim_options()["offline_feed"] == "closed"
    result = Simulation(s.cluster, s.model, s.cost, chain, list(reqs), SimConfig(
        duration_s=120.0, warmup_s=20.0, offline=True, offline_feed="closed",
        feed_initial_requests=4)).run()
    from helixserve.simulator.metrics import summarize

    assert score(chain, 4) == pytest.approx(summarize(result)["decode_throughput_tokens_per_s"])


@pytest.mark.parametrize(("concurrency", "mode", "needle"), [
    (0, "saturate", "--serve-concurrency: bad value 0; need an integer >= 1"),
    (8, "replay", "--serve-concurrency: 8 with --serve-mode replay; a stated load needs"),
])
def test_a_stated_load_that_cannot_be_served_is_refused(concurrency: int, mode: str,
                                                       needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        SelectionConfig(concurrency=concurrency, mode=mode).check()
