"""benchmarks/planner_served.py (issue 34 item 3) on a tiny setting, its ranking
disagreements, and benchmarks/helix_sim.py's placement conversion."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import helix_sim, planner_served
from helixserve.errors import UserError
from helixserve.planner import NodeRange, Placement


def test_a_tiny_run_writes_every_score_and_skips_helix_with_a_note(tmp_path, capsys) -> None:
    out = tmp_path / "served.json"
    rc = planner_served.main([
        "--clusters", "single-24", "--plans", "authors", "swarm",
        "--scorers", "evaluator", "vllm", "helix-sim", "--vllm-window", "20", "5",
        "--save-placements", str(tmp_path / "placements"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["format"] == planner_served.FORMAT
    assert report["scorers"] == ["evaluator", "vllm", "helix-sim"]
    assert report["windows_s"]["vllm"] == [20.0, 5.0]
    assert any("helix-sim skipped" in n for n in report["notes"])
    case = report["clusters"]["helix-single-24"]
    assert set(case["placements"]) == {"authors", "swarm"}
    assert case["placements"]["swarm"]["plan_command"].startswith("helixserve plan")
    for scorer in ("evaluator", "vllm"):
        assert all(v > 0 for v in case["scores"][scorer].values())
        assert sorted(case["rankings"][scorer]) == ["authors", "swarm"]
        assert set(case["ratios"][scorer]) == {"milp_over_authors", "milp_over_best_baseline",
                                               "best_baseline"}
    assert case["scores"]["helix-sim"] == {"authors": None, "swarm": None}
    assert "no --helix-artifact" in case["skipped"]["helix-sim"]
    assert "helix-sim" not in case["rankings"]
    assert isinstance(case["disagreements"], list)
    assert (tmp_path / "placements" / "helix-single-24-swarm.json").exists()
    printed = capsys.readouterr().out
    assert "evaluator" in printed and "authors" in printed


def test_an_injected_ranking_disagreement_is_reported(capsys) -> None:
    case = {
        "placements": {"milp": {}, "authors": {}, "swarm": {}},
        "scores": {"evaluator": {"milp": 7000.0, "authors": 4000.0, "swarm": 3000.0},
                   "vllm": {"milp": 400.0, "authors": 450.0, "swarm": 300.0},
                   "helix-sim": {"milp": None, "authors": None, "swarm": None}},
        "skipped": {"helix-sim": "no --helix-artifact given"},
    }
    planner_served.analyse(case, tie=0.0)
    assert case["disagreements"] == [{
        "pair": ["milp", "authors"], "ahead": {"milp": ["evaluator"], "authors": ["vllm"]},
        "scores": {"evaluator": [7000.0, 4000.0], "vllm": [400.0, 450.0]}}]
    assert case["rankings"] == {"evaluator": ["milp", "authors", "swarm"],
                                "vllm": ["authors", "milp", "swarm"]}
    assert case["ratios"]["vllm"] == {"milp_over_authors": 0.889,
                                      "milp_over_best_baseline": 1.333, "best_baseline": "swarm"}
    planner_served.print_case("helix-single-24", case)
    assert "DISAGREE milp vs authors: milp ahead in evaluator; authors ahead in vllm" \
        in capsys.readouterr().out
    # within the tie band the same scores are no disagreement
    planner_served.analyse(case, tie=0.2)
    assert case["disagreements"] == []


def test_placement_becomes_helix_ilp_sol_ini() -> None:
    p = Placement(model="llama-2-70b", cluster="c", num_layers=80, planner="milp",
                  nodes=[NodeRange("n0", 0, 40), NodeRange("n2", 40, 80)])
    text = helix_sim.solution_ini(p, 3, "p.json")
    assert text.splitlines() == [
        "[Settings]", "offset=2", "", "[Solution]",
        f"compute_node_2={list(range(40))}", "compute_node_3=[]",
        f"compute_node_4={list(range(40, 80))}"]
    with pytest.raises(UserError, match="n2 is not in the Helix cluster"):
        helix_sim.solution_ini(p, 2, "p.json")
    bad = Placement(model="llama-2-70b", cluster="c", num_layers=80, planner="milp",
                    nodes=[NodeRange("gpu-a", 0, 80)])
    with pytest.raises(UserError, match="'gpu-a' is not n<i>"):
        helix_sim.solution_ini(bad, 3, "p.json")


def test_a_missing_artifact_is_named(tmp_path) -> None:
    assert helix_sim.missing_artifact(None) == "no --helix-artifact given"
    why = helix_sim.missing_artifact(tmp_path)
    assert why is not None and "not a checkout of Thesys-lab/Helix-ASPLOS25" in why
    assert helix_sim.score(tmp_path, "helix-single-24", None)["error"] == why


def test_merge_keeps_an_earlier_runs_columns_and_rows() -> None:
    old = {"placements": {"milp": {"source": "a"}, "authors": {}},
           "scores": {"evaluator": {"milp": 1.0, "authors": 2.0},
                      "helix-sim": {"milp": 3.0, "authors": 4.0}},
           "details": {"evaluator": {}, "helix-sim": {"authors_published_files": {"x": 1}}},
           "skipped": {}}
    case = {"placements": {"milp": {"source": "b"}},
            "scores": {"evaluator": {"milp": 5.0}, "helix-sim": {"milp": None}},
            "details": {"evaluator": {"milp": {}}, "helix-sim": {"milp": {}}},
            "skipped": {"helix-sim": "no --helix-artifact given"}}
    planner_served.merge(old, case, ran=["evaluator"])
    assert case["placements"]["milp"] == {"source": "b"}  # this run's wins
    assert case["scores"]["evaluator"] == {"milp": 5.0, "authors": 2.0}
    assert case["scores"]["helix-sim"] == {"milp": 3.0, "authors": 4.0}
    assert case["skipped"] == {}
    assert case["details"]["helix-sim"]["authors_published_files"] == {"x": 1}


def test_the_served_estimate_predicts_milp_over_authors_against_the_simulation(capsys) -> None:
    case = {
        "placements": {"milp": {}, "authors": {}},
        "scores": {"evaluator": {"milp": 7000.0, "authors": 4000.0},
                   "estimate-vllm": {"milp": 440.0, "authors": 400.0},
                   "estimate-helix-prototype": {"milp": 200.0, "authors": 200.0},
                   "vllm": {"milp": 420.0, "authors": 400.0},
                   "helix-prototype": {"milp": 210.0, "authors": 200.0}},
        "skipped": {},
    }
    planner_served.analyse(case, tie=0.0)
    p = case["predictions"]
    assert p["estimate-vllm vs vllm"] == {"predicted": 1.1, "simulated": 1.05, "off_by": 0.048}
    assert p["evaluator vs vllm"] == {"predicted": 1.75, "simulated": 1.05, "off_by": 0.667}
    assert p["estimate-helix-prototype vs helix-prototype"]["off_by"] == -0.048
    planner_served.print_case("helix-single-24", case)
    printed = capsys.readouterr().out
    assert "milp/authors predicted by estimate-vllm, simulated in vllm: 1.10 against 1.05 (+5%)" \
        in printed


def test_rehearse_passes_full_size_every_option_it_reads(tmp_path, monkeypatch) -> None:
    """`--rehearse` hands benchmarks/full_size.py a namespace of all its options (a new
    option there once made it fail before starting anything)."""
    from benchmarks import full_size

    started: list[list[str]] = []

    class Started(Exception):
        pass

    def popen(cmd: list[str], **_: object) -> None:
        started.append(cmd)
        raise Started

    monkeypatch.setattr(full_size.subprocess, "Popen", popen)
    placement = Placement(model="llama-2-70b", cluster="c", num_layers=80, planner="milp",
                          nodes=[NodeRange("n0", 0, 80)])
    for load in (None, 256):
        args = argparse.Namespace(rehearse_duration=30.0, rehearse_warmup=10.0,
                                  rehearse_time_scale=4.0, serve_concurrency=load)
        with pytest.raises(Started):
            planner_served.rehearse("single-24", "milp", placement, args, tmp_path)
    saturated, stated = (" ".join(cmd) for cmd in started)
    for cmd in (saturated, stated):
        assert "rehearse" in cmd and "--offline" in cmd
        assert "--duration 30 --warmup 10 --time-scale 4" in cmd
    assert "--concurrency" not in saturated and "--concurrency 256" in stated


def test_a_stated_load_runs_the_simulated_scorers_at_that_many_in_flight(tmp_path, capsys) -> None:
    """--serve-concurrency N: the simulator scorer runs `helixserve simulate --offline
    --concurrency N` (the same number), lighter than saturated, and the report says the load;
    runs at two loads are not merged into one table."""
    from helixserve.cli import main as cli

    runs = {}
    for load in (None, 8):
        out = tmp_path / f"served-{load}.json"
        extra = [] if load is None else ["--serve-concurrency", str(load)]
        assert planner_served.main([
            "--clusters", "single-24", "--plans", "authors", "--scorers", "vllm",
            "--vllm-window", "60", "10", *extra, "--json", str(out)]) == 0
        runs[load] = json.loads(out.read_text())
    assert "8 requests in flight in the simulated scorers" in capsys.readouterr().out
    assert runs[8]["serve_concurrency"] == 8 and runs[None]["serve_concurrency"] is None
    light = runs[8]["clusters"]["helix-single-24"]["scores"]["vllm"]["authors"]
    assert 0 < light < runs[None]["clusters"]["helix-single-24"]["scores"]["vllm"]["authors"]
    sim = tmp_path / "sim.json"
    repo = planner_served.full_size.REPO
    assert cli(["simulate", "--cluster", str(repo / "examples/clusters/helix-single-24.yaml"),
                "--model", str(planner_served.full_size.MODEL),
                "--profiles", str(planner_served.full_size.PROFILES),
                "--trace", str(planner_served.full_size.TRACE),
                "--placement", str(repo / "benchmarks/helix-placements/"
                                   "helix-single-24-llama-2-70b.json"),
                "--offline", "--concurrency", "8", "--duration", "60", "--warmup", "10",
                "--quiet", "--json", str(sim)]) == 0
    assert round(json.loads(sim.read_text())["decode_throughput_tokens_per_s"], 1) == light
    with pytest.raises(SystemExit) as exc:
        planner_served.main(["--clusters", "single-24", "--plans", "authors", "--scorers",
                             "vllm", "--serve-concurrency", "16", "--merge-from",
                             str(tmp_path / "served-8.json")])
    assert exc.value.code == 2
    assert "scores at two loads are not one table" in capsys.readouterr().err


def test_trace_start_runs_the_simulated_scorers_on_the_trace_from_that_point(tmp_path,
                                                                             capsys) -> None:
    """--trace-start F: the simulator scorer runs only the trace's requests from that fraction
    of them on: what `helixserve simulate` gives on the trace file cut there, and not what
    the whole trace gives. Runs on two parts of the trace do not merge; a fraction outside
    [0, 1) exits 2."""
    from helixserve.cli import main as cli
    from helixserve.simulator.workload import load_azure_trace, prepare_trace

    scores = {}
    for start in ("0", "0.5"):
        out = tmp_path / f"start-{start}.json"
        assert planner_served.main([
            "--clusters", "single-24", "--plans", "authors", "--scorers", "vllm",
            "--vllm-window", "60", "10", "--trace-start", start, "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["trace_start"] == float(start)
        scores[start] = report["clusters"]["helix-single-24"]["scores"]["vllm"]["authors"]
    half = scores["0.5"]
    assert half != scores["0"]  # other requests, another score
    # the request the run starts at, as a row of the trace file (request ids count its rows)
    kept = prepare_trace(load_azure_trace(planner_served.full_size.TRACE))
    row = int(kept[len(kept) // 2].request_id.removeprefix("req-"))
    header, *rows = planner_served.full_size.TRACE.read_text().splitlines()
    assert row > 0 and len(rows) > row
    cut = tmp_path / "cut.csv"
    cut.write_text("\n".join([header, *rows[row:]]) + "\n")
    repo = planner_served.full_size.REPO
    sim = tmp_path / "sim.json"
    assert cli(["simulate", "--cluster", str(repo / "examples/clusters/helix-single-24.yaml"),
                "--model", str(planner_served.full_size.MODEL),
                "--profiles", str(planner_served.full_size.PROFILES), "--trace", str(cut),
                "--placement", str(repo / "benchmarks/helix-placements/"
                                   "helix-single-24-llama-2-70b.json"),
                "--offline", "--duration", "60", "--warmup", "10", "--quiet",
                "--json", str(sim)]) == 0
    assert round(json.loads(sim.read_text())["decode_throughput_tokens_per_s"], 1) == half
    for argv in (["--merge-from", str(out)], ["--trace-start", "1"]):
        with pytest.raises(SystemExit) as exc:
            planner_served.main(["--clusters", "single-24", "--plans", "authors",
                                 "--scorers", "vllm", *argv])
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "scores on two parts of the trace are not one table" in err
    assert "--trace-start: bad value 1" in err
