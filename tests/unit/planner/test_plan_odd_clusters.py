"""`plan`, `evaluate` and `simulate` on valid but unusual clusters: no links between the
machines, none to the coordinator, a reserve that leaves KV for only a few layers, one
machine, a one-layer model, no partial inference. Each either plans (milp at least as good
as every baseline) or is one line on stderr with exit 2, naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planner_factories import SHARED

from helixserve.cli import main

LLAMA30 = SHARED / "models" / "llama-30b"
BASELINES = ("petals", "swarm", "separate", "uniform")
#: --work-limit of the plans whose placements are asserted: the same plan on a busy machine
WORK = "1"


def write_cluster(tmp_path: Path, nodes: list[str], links: str = "") -> str:
    path = tmp_path / "odd.yaml"
    path.write_text("name: odd\nnodes:\n" + "".join(f"  - {n}\n" for n in nodes) + links)
    return str(path)


def coordinator_links_only(names: list[str]) -> str:
    """No links between the nodes; both ways between each node and the coordinator."""
    out = "links:\n  default: {bandwidth_gbps: 0}\n  explicit:\n"
    for n in names:
        out += (f"    - {{src: coordinator, dst: {n}, bandwidth_gbps: 10}}\n"
                f"    - {{src: {n}, dst: coordinator, bandwidth_gbps: 10}}\n")
    return out


def model_with_layers(tmp_path: Path, num_layers: int) -> str:
    config = json.loads((LLAMA30 / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    path = tmp_path / f"llama-30b-{num_layers}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def plan_value(tmp_path: Path, argv: list[str], planner: str,
               capsys: pytest.CaptureFixture[str]) -> float:
    """Plan with `planner` on the max-flow objective (what these tests compare), then the
    throughput `evaluate --json` gives the placement."""
    out = tmp_path / f"{planner}.json"
    assert main(["plan", *argv, "--planner", planner, "--objective", "flow", "--jobs", "1",
                 "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    # the rest (--no-partial-inference too) carries over
    cut = next(i for i, a in enumerate(argv) if a in ("--work-limit", "--time-limit"))
    assert main(["evaluate", *argv[:cut], *argv[cut + 2:], "--placement", str(out),
                 "--json"]) == 0
    return float(json.loads(capsys.readouterr().out)["throughput_tokens_per_s"])


# --- --no-partial-inference reaches the milp planner ------------------------------------------

def test_milp_plans_for_the_graph_without_partial_inference(tmp_path, monkeypatch) -> None:
    """It used to search with partial inference and be evaluated without: on a mixed
    cluster with slow links that lost to the swarm baseline (0 tokens/s against 1,775)."""
    import helixserve.planner.registry as registry

    seen: list[bool] = []
    real = registry.run_portfolio

    def spy(*args, **kwargs):
        seen.append(kwargs["partial_inference"])
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "run_portfolio", spy)
    cluster = write_cluster(tmp_path, [
        "{name: n0, gpu: V100-32GB}", "{name: n1, gpu: H100-80GB}",
        "{name: n2, gpu: A100-40GB, num_gpus: 2}", "{name: n3, gpu: A100-40GB}",
        "{name: n4, gpu: A10}", "{name: n5, gpu: V100-32GB, num_gpus: 2}",
    ], "links:\n  default: {bandwidth_gbps: 0.1, latency_ms: 1}\n")
    for flag in ([], ["--no-partial-inference"]):
        assert main(["plan", "--cluster", cluster, "--model", str(LLAMA30), "--time-limit",
                     "1", "--jobs", "1", "--quiet", *flag]) == 0
    assert seen == [True, False]


def test_milp_without_partial_inference_beats_the_baselines(tmp_path, capsys) -> None:
    cluster = write_cluster(tmp_path, [
        "{name: a, gpu: A100-80GB}", "{name: b, gpu: A100-40GB}", "{name: c, gpu: L4}",
        "{name: d, gpu: T4, num_gpus: 2}", "{name: e, gpu: V100-32GB}",
    ])
    argv = ["--cluster", cluster, "--model", str(LLAMA30), "--no-partial-inference",
            "--work-limit", WORK]
    milp = plan_value(tmp_path, argv, "milp", capsys)
    assert milp > 0
    for name in BASELINES:
        assert milp >= plan_value(tmp_path, argv, name, capsys) * (1 - 1e-9), name


# --- links that let nothing serve ---------------------------------------------------------------

def test_no_links_between_machines_that_each_hold_part_is_an_error(tmp_path, capsys) -> None:
    names = ["a", "b", "c", "d"]  # an A100-40GB loads at most 34 of llama-30b's 60 layers
    cluster = write_cluster(tmp_path, [f"{{name: {n}, gpu: A100-40GB}}" for n in names],
                            coordinator_links_only(names))
    for planner in ("milp", "petals"):
        line = one_line_error(["plan", "--cluster", cluster, "--model", str(LLAMA30),
                               "--planner", planner, "--time-limit", "2", "--jobs", "1"],
                              capsys)
        assert "odd.yaml: links: no chain of linked nodes" in line
        assert "no placement can serve" in line


@pytest.mark.parametrize("direction, src, dst", [("from", "coordinator", "{n}"),
                                                 ("to", "{n}", "coordinator")])
def test_no_coordinator_link_is_an_error(tmp_path, capsys, direction, src, dst) -> None:
    names = ["a", "b"]
    links = "links:\n  default: {bandwidth_gbps: 10}\n  explicit:\n" + "".join(
        f"    - {{src: {src.format(n=n)}, dst: {dst.format(n=n)}, bandwidth_gbps: 0}}\n"
        for n in names)
    cluster = write_cluster(tmp_path, [f"{{name: {n}, gpu: A100-80GB}}" for n in names], links)
    line = one_line_error(["plan", "--cluster", cluster, "--model", str(LLAMA30),
                           "--time-limit", "2", "--jobs", "1"], capsys)
    assert f"odd.yaml: links: no node that can hold layers has a link {direction} the " \
           "coordinator" in line


def test_no_links_between_machines_that_each_load_the_model(tmp_path, capsys) -> None:
    """Three A100-80GB each load all of llama-30b (beyond the 50% weight cap) but no two are
    linked: within the cap nothing serves; the planner keeps three whole replicas."""
    names = ["a", "b", "c"]
    cluster = write_cluster(tmp_path, [f"{{name: {n}, gpu: A100-80GB}}" for n in names],
                            coordinator_links_only(names))
    argv = ["--cluster", cluster, "--model", str(LLAMA30), "--work-limit", WORK]
    milp = plan_value(tmp_path, argv, "milp", capsys)
    assert milp > 0
    for name in BASELINES:
        assert milp >= plan_value(tmp_path, argv, name, capsys) * (1 - 1e-9), name
    data = json.loads((tmp_path / "milp.json").read_text())
    assert [(n["start_layer"], n["end_layer"]) for n in data["nodes"]] == [(0, 60)] * 3


# --- a reserve that leaves KV for fewer layers than the weight cap ------------------------------

def test_reserve_that_leaves_kv_for_too_few_layers_is_an_error(tmp_path, capsys) -> None:
    """Every A100-40GB keeps some KV with 30 GB reserved, but only with 10 of its 19 layers:
    4 x 10 < 60. It used to plan 0 tokens/s, every node's T(k) 0."""
    cluster = write_cluster(tmp_path, [f"{{name: n{i}, gpu: A100-40GB}}" for i in range(4)])
    argv = ["plan", "--cluster", cluster, "--model", str(LLAMA30), "--work-limit", WORK,
            "--jobs", "1"]
    capsys.readouterr()
    assert main([*argv, "--gpu-reserve-gb", "20", "--quiet"]) == 0
    assert "throughput (max flow) 0.0" not in capsys.readouterr().out
    line = one_line_error([*argv, "--gpu-reserve-gb", "30"], capsys)
    assert "odd.yaml: with 30 GB kept per GPU (--gpu-reserve-gb)" in line
    assert "at most 40 of the 60 layers" in line


# --- tiny shapes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_layers", [1, 2])
def test_one_machine_and_few_layers(tmp_path, capsys, num_layers) -> None:
    model = model_with_layers(tmp_path, num_layers)
    for nodes in (["{name: n0, gpu: L4}"],
                  ["{name: n0, gpu: L4}", "{name: n1, gpu: T4, num_gpus: 2}"]):
        cluster = write_cluster(tmp_path, nodes)
        argv = ["--cluster", cluster, "--model", model, "--work-limit", WORK]
        milp = plan_value(tmp_path, argv, "milp", capsys)
        assert milp > 0
        for name in BASELINES:
            assert milp >= plan_value(tmp_path, argv, name, capsys) * (1 - 1e-9)


# --- simulate names the placement file -----------------------------------------------------------

def test_simulate_a_placement_that_serves_nothing_names_the_file(tmp_path, capsys) -> None:
    cluster = write_cluster(tmp_path, [f"{{name: n{i}, gpu: A100-80GB}}" for i in range(2)])
    gapped = tmp_path / "gapped.json"
    gapped.write_text(json.dumps({
        "format": "helixserve.placement/v1", "model": "llama-30b", "cluster": "odd",
        "num_layers": 60, "nodes": [{"name": "n0", "start_layer": 0, "end_layer": 20},
                                    {"name": "n1", "start_layer": 30, "end_layer": 60}]}))
    argv = ["simulate", "--cluster", cluster, "--model", str(LLAMA30), "--poisson",
            "--rate", "1", "--duration", "10", "--quiet"]
    line = one_line_error([*argv, "--placement", str(gapped)], capsys)
    assert line.startswith("helixserve simulate: error: ")
    assert f"{gapped}: serves 0 tokens/s on cluster 'odd'" in line
    # a placement with its flows is not evaluated again: the simulator's own check
    with_flows = tmp_path / "with-flows.json"
    with_flows.write_text(json.dumps({
        "format": "helixserve.placement/v1", "model": "llama-30b", "cluster": "odd",
        "num_layers": 60, "nodes": [{"name": "n0", "start_layer": 0, "end_layer": 30},
                                    {"name": "n1", "start_layer": 30, "end_layer": 60}],
        "flows": [{"src": "coordinator", "dst": "n0", "tokens_per_s": 1.0},
                  {"src": "n0", "dst": "n1", "tokens_per_s": 1.0},
                  {"src": "n1", "dst": "coordinator", "tokens_per_s": 1.0}],
        "throughput_tokens_per_s": 1.0}))
    other = model_with_layers(tmp_path, 2)
    line = one_line_error(["simulate", "--cluster", cluster, "--model", other, "--poisson",
                           "--rate", "1", "--duration", "10", "--quiet", "--placement",
                           str(with_flows)], capsys)
    assert f"{with_flows}: num_layers: 60 but model" in line


def test_serving_selection_skips_candidates_that_serve_nothing(tmp_path, capsys) -> None:
    """The stacked tiling of three unlinked A100-80GB chains no stage to the next: its max
    flow is 0 and it has no flows for the router. It used to stop the selection with
    'placement: flows: empty'; now it scores 0 and the planned replicas are kept."""
    names = ["a", "b", "c"]
    cluster = write_cluster(tmp_path, [f"{{name: {n}, gpu: A100-80GB}}" for n in names],
                            coordinator_links_only(names))
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i:02d}.0000000,{300 + 10 * i},{40 + i}\n" for i in range(10)))
    out = tmp_path / "chosen.json"
    assert main(["plan", "--cluster", cluster, "--model", str(LLAMA30), "--work-limit", WORK,
                 "--jobs", "1", "--quiet", "--objective", "flow", "--serve-trace", str(trace),
                 "--serve-duration",
                 "20", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "stacked-tiling" in printed
    data = json.loads(out.read_text())
    assert data["throughput_tokens_per_s"] > 0
    assert [(n["start_layer"], n["end_layer"]) for n in data["nodes"]] == [(0, 60)] * 3


def test_served_objective_scores_unlinked_candidates_zero(tmp_path, capsys) -> None:
    """The served objective on the same unlinked cluster: candidates whose max flow is 0
    score 0 without a simulation, and the whole-model replicas are kept."""
    names = ["a", "b", "c"]
    cluster = write_cluster(tmp_path, [f"{{name: {n}, gpu: A100-80GB}}" for n in names],
                            coordinator_links_only(names))
    out = tmp_path / "chosen.json"
    assert main(["plan", "--cluster", cluster, "--model", str(LLAMA30), "--work-limit", WORK,
                 "--jobs", "1", "--quiet", "--serve-duration", "20", "--out", str(out)]) == 0
    assert "served (simulated, vllm engine, 20 s offline" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(n["start_layer"], n["end_layer"]) for n in data["nodes"]] == [(0, 60)] * 3


# --- the capped coverage relaxation, warm-started from a link-bound placement --------------------

def test_capped_coverage_takes_a_hint_covered_above_the_cap(tmp_path) -> None:
    """A placement whose flow the links bind covers its layers well above its flow, so above
    the cap (best flow x 1.005) too: warm-starting F there crashed pulp ('initial value
    ... is greater than upBound') on a 10-region cluster with slow links between regions."""
    from helixserve.costmodel import CostModel
    from helixserve.planner.coverage import solve_coverage
    from helixserve.planner.flow import FlowNetwork
    from helixserve.spec import ClusterSpec, LinkSpec, NodeSpec, load_model

    model = load_model(model_with_layers(tmp_path, 2))
    cluster = ClusterSpec("regs", [NodeSpec(f"n{i}", "L4", region=f"r{i}") for i in range(10)],
                          default_link=LinkSpec(0.05, 30.0))
    net = FlowNetwork(cluster, model, CostModel(model))
    hint = {i: (0, 1) if i < 5 else (1, 2) for i in range(10)}  # 25 slow links between
    flow = net.max_flow(hint)[0]
    cap = flow * 1.005
    assert 0 < cap < 2 * net.node_cap(0, 1)  # each layer is covered by 5 nodes: above cap
    capped = solve_coverage(net, 1.0, hint=hint, cap=cap)
    bound = capped.info.bound
    if bound is not None and bound < cap * (1 - 1e-9):  # a proven bound is still a bound
        assert bound >= flow * (1 - 1e-6)


# --- many layers on machines that hold many: relaxations too big for the time limit -------

def test_relaxations_too_big_to_build_in_their_share_are_skipped(tmp_path, capsys) -> None:
    """A 120-layer model on 8-GPU nodes that hold it whole: the coverage and region models
    have ~10^6 nonzeros, which PuLP and HiGHS's presolve took 5-12 s each to build and read,
    whatever the solver's time limit (plan --time-limit 2 ran 16-26 s). They are skipped,
    saying why, and milp still returns a placement at least as good as every baseline."""
    nodes = ["{name: a, gpu: A100-80GB, num_gpus: 8, region: r1}",
             "{name: b, gpu: A10, num_gpus: 8, region: r1}",
             "{name: c, gpu: T4, num_gpus: 8, region: r2}",
             "{name: d, gpu: H100-80GB, num_gpus: 1, region: r2}",
             "{name: e, gpu: L4, num_gpus: 2, region: r2}",
             "{name: f, gpu: T4, num_gpus: 1, region: r2}",
             "{name: g, gpu: V100-32GB, num_gpus: 2, region: r1}"]
    links = ("links:\n  default: {bandwidth_gbps: 1, latency_ms: 1}\n  between_regions:\n"
             "    - {a: r1, b: r2, bandwidth_gbps: 0.5}\n")
    argv = ["--cluster", write_cluster(tmp_path, nodes, links),
            "--model", model_with_layers(tmp_path, 120)]
    out = tmp_path / "p.json"
    # the point is the time limit: 10% of 2 s is too short to build either relaxation
    assert main(["plan", *argv, "--objective", "flow", "--time-limit", "2", "--planner", "milp",
                 "--jobs", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "coverage relaxation skipped" in err and "region relaxation skipped" in err, err
    # and on the work clock (units of work in place of seconds: the same shares)
    argv += ["--work-limit", WORK]
    milp = plan_value(tmp_path, argv, "milp", capsys)
    assert milp > 0
    for name in BASELINES:
        assert milp >= plan_value(tmp_path, argv, name, capsys) * (1 - 1e-9), name


def test_tiling_configurations_stop_at_their_deadline() -> None:
    """Hundreds of rows give millions of triples; past the deadline only the lone rows and
    the pairs and triples enumerated so far are returned, longest ranges first."""
    from helixserve.planner.tiling import _configs

    curves = [[1000.0 / k for k in range(1, 121)] for _ in range(6)]
    full_pairs = [c for c in _configs(curves[:1], 30.0) if len(c) <= 2]
    assert full_pairs  # a small case still enumerates everything
    cut = _configs(curves, 30.0, deadline_s=0.0)
    assert all(len(c) == 1 for c in cut)
    assert len(cut) == len(curves)  # one lone row per type: the longest reaching 30/s


def test_links_that_let_no_route_cover_the_model_are_an_error(tmp_path, capsys) -> None:
    """Two small machines linked both ways pass the cheap link check (its chains may go
    round a cycle), while the one machine that holds the model is cut off: milp proves
    0 tokens/s, and that is an error naming the links, not a plan that serves nothing."""
    nodes = ["{name: a, gpu: L4, region: r1}", "{name: b, gpu: T4, region: r1}",
             "{name: c, gpu: A100-80GB, num_gpus: 8, region: r2}"]
    links = ("links:\n  default: {bandwidth_gbps: 10}\n  between_regions:\n"
             "    - {a: r1, b: r2, bandwidth_gbps: 0}\ncoordinator: {region: r1}\n")
    cluster = write_cluster(tmp_path, nodes, links)
    line = one_line_error(["plan", "--cluster", cluster, "--model", str(LLAMA30),
                           "--planner", "milp", "--work-limit", "60", "--jobs", "1", "--quiet",
                           "--out", str(tmp_path / "p.json")], capsys)
    assert "odd.yaml: links: no placement can serve" in line
    assert not (tmp_path / "p.json").exists()


# --- --weight-fraction: one big machine holds the whole model beyond Helix's 50% ----------

def test_weight_fraction_lets_one_machine_hold_the_model(tmp_path, capsys) -> None:
    """LLaMA-30B (65 GB) on one A100-80GB is beyond the 50% weight cap: the error says
    which --weight-fraction loads it, and with that flag plan, evaluate and simulate run."""
    cluster = write_cluster(tmp_path, ["{name: a, gpu: A100-80GB}"])
    base = ["--cluster", cluster, "--model", str(LLAMA30)]
    out = tmp_path / "p.json"
    line = one_line_error(["plan", *base, "--time-limit", "2", "--out", str(out)], capsys)
    assert "does not fit" in line and "with --weight-fraction 0.8 it loads" in line
    # the max-flow objective plans with evaluate's memory (the served one with the engine's)
    assert main(["plan", *base, "--objective", "flow", "--work-limit", WORK, "--quiet",
                 "--jobs", "1", "--weight-fraction", "0.8", "--out", str(out)]) == 0
    capsys.readouterr()
    placement = json.loads(out.read_text())
    assert placement["nodes"] == [{"name": "a", "start_layer": 0, "end_layer": 60}]
    assert placement["throughput_tokens_per_s"] > 0
    # a higher cap means less KV: the same placement no faster than at 0.8 (evaluate reads
    # the placement's ranges, the flag only moves the cap, not the memory model)
    assert main(["evaluate", *base, "--placement", str(out), "--json",
                 "--weight-fraction", "0.8"]) == 0
    evaluated = json.loads(capsys.readouterr().out)["throughput_tokens_per_s"]
    assert evaluated == pytest.approx(placement["throughput_tokens_per_s"], rel=1e-6)


@pytest.mark.parametrize("value", ["0", "-0.5", "0.95", "1.5"])
def test_weight_fraction_out_of_range_is_one_line(tmp_path, capsys, value) -> None:
    line = one_line_error(["plan", "--example", "--weight-fraction", value,
                           "--out", str(tmp_path / "p.json")], capsys)
    assert "--weight-fraction" in line and value.lstrip("-") in line
    assert not (tmp_path / "p.json").exists()


def test_output_into_a_closed_pipe_stops_quietly(tmp_path) -> None:
    """`helixserve evaluate --json | head -c 10`: no BrokenPipeError traceback, exit 141
    (128 + SIGPIPE, what a shell reports for a command killed by a closed pipe)."""
    import subprocess
    import sys

    cluster = write_cluster(tmp_path, ["{name: a, gpu: A100-80GB, num_gpus: 2}"])
    placement = tmp_path / "p.json"
    placement.write_text(json.dumps({
        "format": "helixserve.placement/v1", "model": "llama-30b", "cluster": "odd",
        "num_layers": 60, "planner": "hand",
        "nodes": [{"name": "a", "start_layer": 0, "end_layer": 60}]}))
    # the reader is gone before the command writes (it first loads and evaluates)
    proc = subprocess.Popen(
        [sys.executable, "-m", "helixserve", "evaluate", "--cluster", cluster, "--model",
         str(LLAMA30), "--placement", str(placement), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
