"""`plan --work-limit`: the searches count work instead of reading the clock, so the same
inputs give the same placement whatever --jobs and however busy the machine is."""

from __future__ import annotations

import json

from planner_factories import make_cluster

from helixserve.planner import FlowNetwork, plan
from helixserve.planner.baselines import BASELINES
from helixserve.planner.portfolio import StageReport


def test_same_placement_whatever_jobs_and_run(llama70b, measured_cost):
    # 13 machines: above SMALL_NODES, so the annealing stages run WORK_SEEDS seeds
    cluster = make_cluster(a100=3, l4=4, t4=6, link_gbps=2.0)
    runs = []
    for jobs in (1, 2, 1):
        stages: list[StageReport] = []
        p = plan("milp", cluster, llama70b, measured_cost, work_limit=2.0, jobs=jobs,
                 stages=stages)
        runs.append((p.nodes, p.throughput_tokens_per_s, p.upper_bound_tokens_per_s))
        # the annealing stages ran two seeds each, on one core or two
        assert all(len(s.seed_values) == 2 for s in stages
                   if s.ran and s.stage in ("stages", "search")), stages
    assert runs[0] == runs[1] == runs[2]
    net = FlowNetwork(cluster, llama70b, measured_cost)
    best_baseline = max(net.max_flow(fn(net))[0] for fn in BASELINES.values())
    assert runs[0][1] >= best_baseline * (1 - 1e-9)


def test_cli_work_limit(tmp_path, capsys):
    from helixserve.cli import main

    outs = []
    for jobs in ("1", "2"):
        out = tmp_path / f"p{jobs}.json"
        assert main(["plan", "--example", "--work-limit", "1", "--jobs", jobs, "--quiet",
                     "--out", str(out)]) == 0
        placed = json.loads(out.read_text())
        placed.pop("solve_time_s")  # wall clock: the one field that may differ
        outs.append(placed)
    assert "proven upper bound" in capsys.readouterr().out
    assert outs[0] == outs[1]
    assert main(["plan", "--example", "--work-limit", "0", "--quiet"]) == 2

