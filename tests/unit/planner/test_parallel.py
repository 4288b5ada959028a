"""--jobs: the annealing searches run one seed per process, the best kept."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from planner_factories import SHARED, make_cluster, tiny_model

from helixserve.cli import main
from helixserve.errors import UserError
from helixserve.planner import FlowNetwork, plan
from helixserve.planner.baselines import BASELINES
from helixserve.planner.parallel import (
    MAX_DEFAULT_JOBS,
    SEED_STRIDE,
    check_jobs,
    default_jobs,
    run_seeds,
)
from helixserve.planner.portfolio import StageReport
from helixserve.planner.search import local_search
from helixserve.spec import load_cluster

#: work budget of the helix-single-24 plans: enough for the annealing stages to run their
#: two seeds (at 1 unit the coverage relaxation is built too: 20 s more)
WORK = 0.5


def _small_net(measured_cost) -> FlowNetwork:
    # at most 8 nodes: the local search stops when it stalls, so a seed's result does not
    # depend on how fast the machine is and can be compared across processes
    net = FlowNetwork(make_cluster(t4=3, l4=2), tiny_model(12), measured_cost)
    net.max_layers = np.array([4, 4, 4, 6, 6])
    return net


def _start(net: FlowNetwork) -> dict[int, tuple[int, int]]:
    return {0: (0, 4), 1: (4, 8), 2: (8, 12), 3: (0, 6), 4: (6, 12)}


def test_workers_run_their_own_seeds_and_the_caller_keeps_its_own(measured_cost):
    net = _small_net(measured_cost)
    kwargs = {"max_stall": 300}
    deadline = time.perf_counter() + 60.0
    results = run_seeds(local_search, (net, [_start(net)]), kwargs, deadline, seed=3, jobs=3)
    assert len(results) == 3
    for w, (ranges, value, _) in enumerate(results):
        alone = local_search(net, [_start(net)], time.perf_counter() + 60.0,
                             seed=3 + SEED_STRIDE * w, max_stall=300)
        assert ranges == alone[0] and value == pytest.approx(alone[1])


def test_a_failed_worker_costs_only_its_seed(measured_cost):
    net = _small_net(measured_cost)

    class Starts(list):  # a local class: it cannot be sent to a worker process
        pass

    said: list[str] = []
    results = run_seeds(local_search, (net, Starts([_start(net)])), {"max_stall": 300},
                        time.perf_counter() + 60.0, seed=0, jobs=2, progress=said.append)
    assert len(results) == 1 and results[0][1] > 0
    assert len(said) == 1 and "search worker 1 (seed 7919) failed" in said[0]


def test_short_searches_and_one_job_stay_in_process(measured_cost):
    net = _small_net(measured_cost)
    for deadline_in, jobs in ((0.5, 4), (60.0, 1)):
        out = run_seeds(local_search, (net, [_start(net)]), {"max_stall": 300},
                        time.perf_counter() + deadline_in, seed=0, jobs=jobs)
        assert len(out) == 1


def test_jobs_values():
    assert 1 <= default_jobs() <= MAX_DEFAULT_JOBS
    assert check_jobs(None) == default_jobs()
    assert check_jobs(3) == 3
    with pytest.raises(UserError, match="--jobs: bad value 0; must be >= 1"):
        check_jobs(0)


def test_cli_rejects_jobs_0_with_one_line(capsys):
    assert main(["plan", "--example", "--quiet", "--jobs", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--jobs: bad value 0" in err[0]


def test_milp_with_two_jobs_keeps_the_best_of_both_seeds(llama70b, measured_cost):
    # a cluster the first steps do not close: the annealing stages run their two seeds on
    # 2 cores (on the work clock: what they find does not depend on the machine's load)
    cluster = load_cluster(SHARED / "clusters" / "helix-single-24.yaml")
    stages: list[StageReport] = []
    placement = plan("milp", cluster, llama70b, measured_cost, work_limit=WORK, jobs=2,
                     stages=stages)
    net = FlowNetwork(cluster, llama70b, measured_cost)
    best_baseline = max(net.max_flow(fn(net))[0] for fn in BASELINES.values())
    assert placement.throughput_tokens_per_s >= best_baseline * (1 - 1e-9)
    covered = {layer for r in placement.nodes for layer in range(r.start_layer, r.end_layer)}
    assert covered == set(range(llama70b.num_layers))
    on_two = [s for s in stages if len(s.seed_values) == 2]
    assert on_two, stages
    # each stage that ran on both cores kept the larger of the two seeds' results
    for s in on_two:
        assert s.best_tokens_per_s is not None
        assert s.best_tokens_per_s >= max(v for v in s.seed_values if v is not None) * (1 - 1e-9)


def test_workers_do_not_rerun_a_script_without_a_main_guard(tmp_path):
    # forkserver/spawn workers import the caller's __main__ unless it is hidden while they
    # start: a user's script calling plan() at top level would run again in every worker
    script = tmp_path / "user_script.py"
    script.write_text(
        "import sys\n"
        "from helixserve.costmodel import CostModel\n"
        "from helixserve.planner import plan\n"
        "from helixserve.spec import ClusterSpec, LinkSpec, NodeSpec, load_model, load_profiles\n"
        f"data = {str(SHARED)!r}\n"
        "print('top level runs', file=sys.stderr, flush=True)\n"
        "model = load_model(data + '/models/llama-2-70b')\n"
        "cost = CostModel(model, load_profiles(data + '/profiles/helix-measured.csv'))\n"
        "gpus = ['A100-40GB'] * 3 + ['L4'] * 4 + ['T4'] * 6\n"
        "cluster = ClusterSpec('user', [NodeSpec(f'n{i}', g) for i, g in enumerate(gpus)],\n"
        "                      default_link=LinkSpec(2.0, 1.0))\n"
        "stages = []\n"
        "said = []\n"
        "plan('milp', cluster, model, cost, work_limit=2.0, jobs=2, stages=stages,\n"
        "     progress=said.append)\n"
        "print(max(len(s.seed_values) for s in stages), [m for m in said if 'could not' in m])\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("top level runs") == 1, out.stderr
    # on the work clock the second seed runs in a worker whatever the load (the planner
    # waits for it): the stages report two seeds, and the workers started
    assert out.stdout.strip() == "2 []", out.stdout


def test_workers_that_cannot_start_leave_the_search_in_process(measured_cost, monkeypatch):
    import helixserve.planner.parallel as parallel

    class NoProcesses:  # as in a sandbox that forbids new processes
        def __init__(self, **_kwargs: object) -> None:
            pass

        def submit(self, *_args: object, **_kwargs: object) -> None:
            raise OSError(11, "Resource temporarily unavailable")

        def shutdown(self, **_kwargs: object) -> None:
            pass

    monkeypatch.setattr(parallel, "ProcessPoolExecutor", NoProcesses)
    net = _small_net(measured_cost)
    said: list[str] = []
    out = run_seeds(local_search, (net, [_start(net)]), {"max_stall": 300},
                    time.perf_counter() + 60.0, seed=0, jobs=3, progress=said.append)
    assert len(out) == 1 and out[0][1] > 0
    assert said == ["search workers could not start ([Errno 11] Resource temporarily "
                    "unavailable); 0 of 2 running"]


def test_python_m_helixserve_plan_runs_once_with_workers(tmp_path):
    # `python -m helixserve`: a worker that imported helixserve.__main__ would run the CLI
    # again (a second plan, or a second demo on the same work dir)
    out = tmp_path / "p.json"
    proc = subprocess.run(
        # the served objective's simulations run on the same workers
        [sys.executable, "-m", "helixserve", "plan", "--work-limit", str(WORK), "--jobs", "2",
         "--serve-duration", "20",
         "--cluster", str(SHARED / "clusters" / "helix-single-24.yaml"),
         "--model", str(SHARED / "models" / "llama-2-70b"),
         "--profiles", str(SHARED / "profiles" / "helix-measured.csv"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("wrote ") == 1, proc.stdout
    assert proc.stderr.count("baselines:") == 1 and "best of 2 seeds" in proc.stderr
