"""The demo's pure parts: cluster file, route decomposition, flag errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helixserve.errors import UserError
from helixserve.local.launch import WorkerSpec
from helixserve.local.stack import flow_routes, workers_with_layers, write_local_cluster
from helixserve.planner import Flow
from helixserve.planner.placement import NodeRange, Placement
from helixserve.spec import load_cluster


def test_local_cluster_models_a_slow_worker_network(tmp_path):
    workers = [WorkerSpec(f"n{i}", "127.0.0.1", 5000 + i) for i in range(3)]
    path = tmp_path / "c.yaml"
    write_local_cluster(path, "local", workers, (0.1, 0.2, 0.3), worker_link_gbps=0.01)
    cluster = load_cluster(path)
    assert [n.memory_gb for n in cluster.nodes] == [0.1, 0.2, 0.3]
    assert [n.address for n in cluster.nodes] == [w.address for w in workers]
    assert cluster.link("n0", "n1").bandwidth_gbps == 0.01
    assert cluster.link("coordinator", "n2").bandwidth_gbps == 10.0
    assert cluster.link("n1", "coordinator").bandwidth_gbps == 10.0
    write_local_cluster(path, "local", workers, (0.1, 0.2, 0.3))
    assert load_cluster(path).link("n0", "n1").bandwidth_gbps == 10.0


def test_flow_routes_decomposes_two_routes_sharing_a_tail():
    flows = [
        Flow("coordinator", "n2", 400.0),
        Flow("coordinator", "n3", 700.0),
        Flow("n2", "n1", 400.0),
        Flow("n3", "n1", 700.0),
        Flow("n1", "coordinator", 1100.0),
    ]
    assert flow_routes(flows) == [(["n3", "n1"], 700.0), (["n2", "n1"], 400.0)]
    chain = [Flow("coordinator", "a", 5.0), Flow("a", "b", 5.0), Flow("b", "coordinator", 5.0)]
    assert flow_routes(chain) == [(["a", "b"], 5.0)]
    assert flow_routes([]) == []


def test_demo_bad_memory_flag_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "helixserve", "demo", "--memory-gb", "0.1,abc"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--memory-gb" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_missing_model_dir_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "helixserve", "serve", "--cluster", "c.yaml", "--placement",
         "p.json", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "Traceback" not in proc.stderr


def test_the_demo_starts_workers_only_for_nodes_with_layers():
    """A planner may leave a node without layers; its worker would exit ("no node 'n1' holds
    layers") and take the demo down, so it is not started."""
    workers = [WorkerSpec(f"n{i}", "127.0.0.1", 5000 + i) for i in (1, 2, 3)]
    placement = Placement("m", "local-demo", 30, "milp",
                          [NodeRange("n3", 0, 12), NodeRange("n2", 12, 30)])
    start, unplaced = workers_with_layers(workers, placement)
    assert [w.node for w in start] == ["n2", "n3"] and unplaced == ["n1"]
    every = Placement("m", "c", 30, "milp", [NodeRange(f"n{i}", 10 * i - 10, 10 * i)
                                             for i in (1, 2, 3)])
    assert workers_with_layers(workers, every) == (workers, [])
    with pytest.raises(UserError, match="no layers on any of the nodes n1, n2, n3"):
        workers_with_layers(workers, Placement("m", "c", 30, "milp",
                                               [NodeRange("x", 0, 30)]))


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_workers_sharing_a_gpu_start_one_after_another(tmp_path, monkeypatch, one_at_a_time):
    # vllm stages on one CUDA device each size their memory at start: the next one may only
    # start once the one before answers its health check
    from helixserve.local import launch

    events: list[str] = []
    monkeypatch.setattr(launch, "spawn_worker",
                        lambda cmd, log, **kw: events.append(f"start {cmd[cmd.index('--node') + 1]}"))
    monkeypatch.setattr(launch, "wait_grpc_ready",
                        lambda node, *a: events.append(f"ready {node}"))
    workers = [WorkerSpec(f"n{i}", "127.0.0.1", 5000 + i) for i in range(3)]
    procs = launch.WorkerProcesses(tmp_path / "m", tmp_path / "p.json", workers, tmp_path,
                                   insecure=True, one_at_a_time=one_at_a_time)
    procs.start()
    if one_at_a_time:
        assert events == ["start n0", "ready n0", "start n1", "ready n1", "start n2", "ready n2"]
    else:
        assert events == ["start n0", "start n1", "start n2"]
    procs.wait_ready()
    assert events[-3:] == ["ready n0", "ready n1", "ready n2"]


def test_demo_memory_flag_gives_one_worker_per_budget_up_to_six():
    """`--memory-gb` with N budgets plans N workers (more routes for the max flow); the
    default stays the 3 unequal budgets, and 7 budgets or a non-positive one is refused."""
    from helixserve.commands.demo import _memory
    from helixserve.local.stack import DEMO_MEMORY_GB, DEMO_NODES

    assert _memory(None) == DEMO_MEMORY_GB == (0.15, 0.30, 0.50)
    assert DEMO_NODES[: len(DEMO_MEMORY_GB)] == ("n1", "n2", "n3")
    assert _memory("1,1,1,1,1") == (1.0,) * 5
    assert _memory("0.5,1,1,1,1,1") == (0.5, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert len(set(DEMO_NODES)) == len(DEMO_NODES) == 6
    for bad in ("1,1,1,1,1,1,1", "1,0,1", ""):
        with pytest.raises(UserError, match="--memory-gb: bad value"):
            _memory(bad)
