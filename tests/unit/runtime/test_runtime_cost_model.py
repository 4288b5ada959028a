"""The live coordinator routes with the simulator's cost model when it is given the same files.

The simulator's router gets `router_options(..., cost)` from the profiles it simulates with;
the coordinator builds its cost model with `runtime/costs.py` from `serve --profiles --gpus
--dtype-bytes` (the rig's server passes the rig's). Here both read the same files (a GPU
catalog of names the shipped one lacks, measured profiles, fp32 as the rig plans), on a
placement whose ranges overlap (petals-like: a request's route branches at every stage), and
they must give the router the same options and choose the same routes for the same trace.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from helixserve.cli import main
from helixserve.costmodel import CostModel
from helixserve.errors import UserError
from helixserve.planner.flow import evaluate
from helixserve.planner.placement import NodeRange, Placement
from helixserve.runtime.costs import CostInputs, runtime_cost_model
from helixserve.runtime.startup import routing_inputs
from helixserve.scheduler import make_router
from helixserve.scheduler.options import router_options
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import TraceRequest
from helixserve.spec import load_gpu_catalog, load_model, load_profiles, parse_cluster
from tests.unit.runtime.test_loops_agree import _decisions, _drive
from tests.unit.simulator.conftest import TINY

#: (node, gpu, layers, per-layer decode ms, GB): four speeds, overlapping ranges
NODES = (
    ("a", "rig-slow", 0, 2, 20.0, 0.5),
    ("b", "rig-fast", 0, 2, 4.0, 0.5),
    ("c", "rig-mid", 2, 4, 9.0, 0.5),
    ("d", "rig-mid2", 1, 4, 7.0, 0.5),
)
DTYPE_BYTES = 4  # the rig's: its CPU workers run fp32


def _files(tmp: Path) -> dict[str, Path]:
    model_dir = tmp / "tiny"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY))
    gpus = tmp / "gpus.csv"
    gpus.write_text("gpu,memory_gb,memory_bandwidth_gbytes_per_s,bf16_dense_tflops,"
                    "fp16_dense_tflops\n"
                    + "".join(f"{g},1,100,10,10\n" for _, g, *_ in NODES))
    profiles = tmp / "profiles.csv"
    profiles.write_text("model,gpu,num_gpus,phase,batch_tokens,layer_ms\n" + "".join(
        f"tiny,{g},1,decode,1,{ms}\ntiny,{g},1,decode,64,{ms * 1.5}\n"
        f"tiny,{g},1,prompt,1,{ms / 4}\ntiny,{g},1,prompt,4096,{ms * 8}\n"
        for _, g, _, _, ms, _ in NODES))
    return {"model": model_dir, "gpus": gpus, "profiles": profiles}


def _cluster(catalog: Any) -> Any:
    return parse_cluster({
        "name": "overlap",
        "nodes": [{"name": n, "gpu": g, "memory_gb": gb} for n, g, _, _, _, gb in NODES],
        "links": {"default": {"bandwidth_gbps": 1e6, "latency_ms": 0.0}},
    }, source="test-cluster", catalog=catalog)


def _placement() -> Placement:
    return Placement(model="tiny", cluster="overlap", num_layers=4, planner="hand",
                     nodes=[NodeRange(n, s, e) for n, _, s, e, _, _ in NODES])


class _Sim:
    """The simulator's side, built as the rig builds it (benchmarks/rig/run.py)."""

    def __init__(self, files: dict[str, Path]) -> None:
        catalog = load_gpu_catalog(files["gpus"])
        self.cluster = _cluster(catalog)
        self.model = load_model(files["model"], name="tiny", dtype_bytes=DTYPE_BYTES)
        self.cost = CostModel(self.model, load_profiles(files["profiles"]), catalog)
        self.placement = _placement()
        res = evaluate(self.cluster, self.model, self.cost, self.placement)
        self.placement.flows = res.flows
        self.placement.throughput_tokens_per_s = res.throughput_tokens_per_s


def _runtime(files: dict[str, Path]) -> tuple[Any, Any, Placement]:
    """The coordinator's side: `serve --profiles --gpus --dtype-bytes 4`, and a placement
    file without flows (the coordinator evaluates them)."""
    inputs = CostInputs.load(files["profiles"], files["gpus"], DTYPE_BYTES)
    cost = runtime_cost_model(files["model"], "tiny", inputs)
    return _cluster(inputs.catalog), cost, _placement()


def test_coordinators_router_options_are_the_simulators(tmp_path: Path) -> None:
    files = _files(tmp_path)
    sim = _Sim(files)
    cluster, cost, placement = _runtime(files)
    inputs = CostInputs.load(files["profiles"], files["gpus"], DTYPE_BYTES)
    live = routing_inputs(cluster, placement, cost)
    simulated = router_options(sim.cluster, sim.model, sim.placement, sim.cost)
    assert "node_throughput_tokens_per_s" in live
    assert live == simulated
    assert placement.flows == sim.placement.flows
    # the profiles matter: the analytic model (no --profiles) weighs the nodes otherwise,
    # and a 2-byte dtype halves the activations the links' token capacities are in
    analytic = runtime_cost_model(files["model"], "tiny",
                                  CostInputs(catalog=load_gpu_catalog(files["gpus"]),
                                             dtype_bytes=DTYPE_BYTES))
    assert (router_options(cluster, analytic.model, placement, analytic)
            ["node_throughput_tokens_per_s"] != live["node_throughput_tokens_per_s"])
    fp16 = runtime_cost_model(files["model"], "tiny",
                              CostInputs(load_profiles(files["profiles"]), inputs.catalog))
    assert (router_options(cluster, fp16.model, placement, fp16)["edge_capacity_tokens_per_s"]
            != live["edge_capacity_tokens_per_s"])


def _trace() -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.01 * i, 60 + (23 * i) % 90, 40 + (37 * i) % 120)
            for i in range(40)]


def _simulate(sim: _Sim) -> Simulation:
    run = Simulation(sim.cluster, sim.model, sim.cost, sim.placement, _trace(),
                     SimConfig(scheduler="maxflow", kv_allocation="on-demand",
                               victim_rule="requester", duration_s=600.0))
    run.decisions = []
    run.run()
    return run


def _live_routes(sim: _Sim, run: Simulation, router: Any) -> list[tuple[Any, ...]]:
    coord = asyncio.run(_drive(sim, run, router))
    assert coord.core.log is not None
    return _decisions(coord.core.log)


def test_live_router_routes_as_the_simulators_on_branching_routes(tmp_path: Path) -> None:
    files = _files(tmp_path)
    sim = _Sim(files)
    run = _simulate(sim)
    assert run.decisions is not None
    simulated = _decisions(run.decisions)
    routes = {d[2] for d in simulated if d[0] == "admit"}
    assert len(run.finished) == len(_trace())
    assert len(routes) >= 3, f"the trace should use several branches; used {routes}"
    cluster, cost, placement = _runtime(files)
    router = make_router("maxflow", placement, seed=0,
                         **routing_inputs(cluster, placement, cost))
    live = _live_routes(sim, run, router)
    for i, (a, b) in enumerate(zip(simulated, live, strict=False)):
        assert a == b, f"decision {i} differs: simulator {a}, coordinator {b}"
    assert len(live) == len(simulated)
    # before the coordinator had a cost model its router got no node throughputs: on this
    # trace it would have routed otherwise (what the test guards against)
    blind = make_router("maxflow", placement, seed=0,
                        **router_options(cluster, cost.model, placement))
    assert _live_routes(sim, run, blind) != simulated


def _serve(tmp_path: Path, *extra: str) -> list[str]:
    """`helixserve serve` argv; the cost files are read before the cluster and placement."""
    files = _files(tmp_path)
    return ["serve", "--cluster", str(tmp_path / "none.yaml"), "--placement",
            str(tmp_path / "none.json"), "--model", str(files["model"]), *extra]


@pytest.mark.parametrize(("flag", "content", "problem"), [
    ("--profiles", None, "cannot read profiles"),
    ("--profiles", "model,gpu\ntiny,T4\n", "header: missing columns"),
    ("--profiles", "model,gpu,num_gpus,phase,batch_tokens,layer_ms\ntiny,T4,1,decode,1,-1\n",
     "layer_ms: bad value"),
    ("--gpus", None, "cannot read GPU catalog"),
    ("--gpus", "gpu,memory_gb\nX,1\n", "header: missing columns"),
])
def test_serve_bad_cost_files_exit_2_naming_flag_and_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, content: str | None,
        problem: str) -> None:
    bad = tmp_path / "bad.csv"
    if content is not None:
        bad.write_text(content)
    assert main(_serve(tmp_path, flag, str(bad))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{flag}: {bad}" in err[0] and problem in err[0], err[0]


def test_runtime_cost_model_defaults_to_the_analytic_model(tmp_path: Path) -> None:
    files = _files(tmp_path)
    cost = runtime_cost_model(files["model"], None)
    assert cost.model.dtype_bytes == 2 and cost.model.name == "tiny"
    assert not cost.profiles.curves
    with pytest.raises(UserError, match="dtype_bytes: bad value 3"):
        CostInputs(dtype_bytes=3)


def test_serve_hands_the_cost_inputs_to_the_stack(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import helixserve.local.stack

    seen: dict[str, Any] = {}

    async def fake_run_stack(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(helixserve.local.stack, "run_stack", fake_run_stack)
    files = _files(tmp_path)
    argv = _serve(tmp_path, "--host", "127.0.0.1", "--profiles", str(files["profiles"]),
                  "--gpus", str(files["gpus"]), "--dtype-bytes", "4", "--workload", "2000:30")
    assert main(argv) == 0
    cost = seen["cost"]
    assert cost.profiles == load_profiles(files["profiles"])
    assert cost.catalog == load_gpu_catalog(files["gpus"])
    assert cost.dtype_bytes == 4
    assert (cost.workload.prompt_tokens, cost.workload.output_tokens) == (2000.0, 30.0)
