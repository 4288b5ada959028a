"""Determinism, workload options and bounds on the real shared inputs (short runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner import evaluate
from helixserve.planner.placement import NodeRange, Placement
from helixserve.simulator.metrics import summarize
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import (
    LengthFilter,
    TraceRequest,
    load_azure_trace,
    poisson_arrivals,
    prepare_trace,
)
from helixserve.spec import load_cluster, load_model, load_profiles

# Two pipelines of the helix-single-24 machines, the second entering the first mid-range.
RANGES = [("n6", 0, 12), ("n9", 12, 24), ("n10", 24, 36), ("n17", 36, 48), ("n0", 48, 55),
          ("n3", 55, 62), ("n5", 62, 69), ("n11", 69, 76), ("n1", 76, 80),
          ("n18", 44, 51), ("n21", 51, 58), ("n23", 58, 65), ("n14", 65, 72), ("n2", 72, 76),
          ("n4", 76, 80)]  # fmt: skip


@pytest.fixture(scope="module")
def real(shared_data: Path) -> dict[str, Any]:
    cluster = load_cluster(shared_data / "clusters/helix-single-24.yaml")
    model = load_model(shared_data / "models/llama-2-70b")
    cost = CostModel(model, load_profiles(shared_data / "profiles/helix-measured.csv"))
    placement = Placement(
        "llama-2-70b", cluster.name, 80, "hand", [NodeRange(n, s, e) for n, s, e in RANGES]
    )
    res = evaluate(cluster, model, cost, placement)
    placement.flows = res.flows
    placement.throughput_tokens_per_s = res.throughput_tokens_per_s
    trace = prepare_trace(load_azure_trace(shared_data / "traces/azure-llm-conv-2023.csv"))
    return {
        "cluster": cluster,
        "model": model,
        "cost": cost,
        "placement": placement,
        "trace": trace,
    }


def simulate(real: dict[str, Any], reqs: list[TraceRequest], **cfg: Any) -> dict[str, Any]:
    sim = Simulation(
        real["cluster"], real["model"], real["cost"], real["placement"], reqs, SimConfig(**cfg)
    )
    out = summarize(sim.run())
    for key in ("wall_s", "events_per_s"):
        out.pop(key)
    return out


def test_trace_filter_matches_helix(real: dict[str, Any]) -> None:
    trace = real["trace"]
    # Helix's filter keeps prompt <= 2048, output <= 1024, both >= 4: mean 763 / 232 tokens.
    assert sum(r.prompt_tokens for r in trace) / len(trace) == pytest.approx(763, abs=1)
    assert sum(r.output_tokens for r in trace) / len(trace) == pytest.approx(232, abs=1)
    clipped = LengthFilter(policy="clip").apply([TraceRequest("x", 0.0, 5000, 2)])
    assert (clipped[0].prompt_tokens, clipped[0].output_tokens) == (2048, 4)


def test_rate_rescaling_and_sampling(real: dict[str, Any]) -> None:
    trace = real["trace"]
    fast = prepare_trace(trace, lengths=None, rate_per_s=10.0)
    assert (len(fast) - 1) / fast[-1].arrival_s == pytest.approx(10.0)
    half = prepare_trace(trace, lengths=None, sample_fraction=0.5, seed=1)
    assert 0.45 < len(half) / len(trace) < 0.55
    assert half == prepare_trace(trace, lengths=None, sample_fraction=0.5, seed=1)
    with pytest.raises(UserError, match="--rate"):
        prepare_trace(trace, rate_per_s=0)
    arrivals = poisson_arrivals(5.0, 200.0, lengths_from=trace, seed=3)
    assert len(arrivals) / 200.0 == pytest.approx(5.0, rel=0.15)


@pytest.mark.parametrize("scheduler", ["random", "swarm"])
def test_same_seed_same_result(real: dict[str, Any], scheduler: str) -> None:
    reqs = prepare_trace(real["trace"][:300], lengths=None, rate_per_s=3.0)
    a = simulate(real, reqs, duration_s=40.0, scheduler=scheduler, seed=5)
    b = simulate(real, reqs, duration_s=40.0, scheduler=scheduler, seed=5)
    c = simulate(real, reqs, duration_s=40.0, scheduler=scheduler, seed=6)
    assert a == b
    assert a["requests_finished"] > 0
    assert a != c  # the seed reaches the routes


@pytest.mark.parametrize("scheduler", ["maxflow", "shortest-queue"])
def test_saturated_real_cluster_stays_under_max_flow(real: dict[str, Any], scheduler: str) -> None:
    out = simulate(
        real, real["trace"], duration_s=60.0, warmup_s=20.0, offline=True, scheduler=scheduler
    )
    bound = real["placement"].throughput_tokens_per_s
    assert 0 < out["decode_throughput_tokens_per_s"] <= bound
    assert all(n["kv_peak_usage"] <= 1.0 for n in out["nodes"])
    # Both pipelines carry requests (the router uses the second one's partial entry).
    used = {n["name"] for n in out["nodes"] if n["iterations"] > 0}
    assert {"n18", "n4", "n6"} <= used


def test_control_plane_imports_no_torch_grpc_fastapi() -> None:
    import subprocess
    import sys

    code = (
        "import sys, helixserve.scheduler, helixserve.simulator, helixserve.commands.simulate; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'grpc', 'fastapi'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_router_options_from_the_cluster(real: dict[str, Any]) -> None:
    from helixserve.scheduler import router_options

    opts = router_options(real["cluster"], real["model"], real["placement"], real["cost"])
    n = len(RANGES) + 1  # nodes + coordinator, every pair linked on helix-single-24
    assert len(opts["edges"]) == n * (n - 1)
    # 8 Gbit/s: 1e9 B/s / 4 B per token id, / 16,384 B of activations per token
    assert opts["edge_capacity_tokens_per_s"]["coordinator", "n6"] == pytest.approx(2.5e8)
    assert opts["edge_capacity_tokens_per_s"]["n6", "n9"] == pytest.approx(1e9 / 16384)
    assert opts["node_throughput_tokens_per_s"]["n6"] > 0
