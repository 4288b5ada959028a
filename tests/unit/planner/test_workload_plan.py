"""Planning for a workload: the MILP's objective and the evaluator's max flow agree in
output tokens/s of the mix, and a prefill-heavy mix is a different problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planner_factories import tiny_model
from test_milp import brute_force, tiny_cluster

from helixserve.cli import main
from helixserve.costmodel import CostModel, Workload
from helixserve.planner import FlowNetwork, evaluate, plan
from helixserve.planner.bounds import layer_work_bound
from helixserve.planner.milp import build_milp, extract
from helixserve.planner.solver import solve


@pytest.mark.parametrize("mix", [Workload(763.0, 232.0), Workload(2000.0, 30.0)])
def test_milp_objective_is_the_evaluators_max_flow_with_a_workload(mix: Workload) -> None:
    model = tiny_model(num_layers=4)
    cost = CostModel(model, workload=mix)
    net = FlowNetwork(tiny_cluster(), model, cost)
    optimum = brute_force(net, True)
    assert optimum > 0
    prob, variables, pruned = build_milp(net, layer_work_bound(net), True)
    assert pruned == 0.0
    info = solve(prob, 30.0)
    assert info.status == "optimal"
    ranges = extract(net, variables)
    assert info.objective == pytest.approx(optimum, rel=1e-4)
    assert net.max_flow(ranges, True)[0] == pytest.approx(info.objective, rel=1e-4)
    # the placement's throughput, re-evaluated from scratch, is in the same unit
    placement = plan("milp", net.cluster, model, cost, work_limit=1.0)
    again = evaluate(net.cluster, model, CostModel(model, workload=mix), placement)
    assert again.throughput_tokens_per_s == pytest.approx(placement.throughput_tokens_per_s,
                                                          rel=1e-9)


def test_prefill_heavy_mix_costs_more_than_decode_alone() -> None:
    """The same cluster serves fewer output tokens/s when each brings 66 prompt tokens."""
    model = tiny_model(num_layers=4)
    cluster = tiny_cluster()
    decode = plan("milp", cluster, model, CostModel(model), work_limit=1.0)
    heavy = plan("milp", cluster, model, CostModel(model, workload=Workload(2000.0, 30.0)),
                 work_limit=1.0)
    assert 0 < heavy.throughput_tokens_per_s < decode.throughput_tokens_per_s


def test_plan_and_evaluate_report_requests_per_s(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", "--example", "--planner", "petals", "--workload", "2000:40",
                 "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    planned = json.loads(out.read_text())["throughput_tokens_per_s"]
    assert (f"throughput (max flow) {planned:,.1f} decode tokens/s = {planned / 40:,.2f} requests/s of "
            f"2000:40 (prompt 2,000, output 40 tokens; r 50.00)") in text
    assert main(["evaluate", "--example", "--placement", str(out), "--workload", "2000:40",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["throughput_tokens_per_s"] == pytest.approx(planned, abs=1e-3)
    assert result["requests_per_s"] == pytest.approx(planned / 40, abs=1e-4)
    assert result["workload"] == {"source": "2000:40", "prompt_tokens": 2000.0,
                                  "output_tokens": 40.0}
    # decode-only: the same placement serves more decode tokens/s, and no requests/s
    assert main(["evaluate", "--example", "--placement", str(out), "--workload", "decode",
                 "--json"]) == 0
    decode = json.loads(capsys.readouterr().out)
    assert "requests_per_s" not in decode
    assert decode["throughput_tokens_per_s"] > 5 * planned
