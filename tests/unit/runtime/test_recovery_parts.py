"""The pure parts of live re-planning (runtime/replan.py) and the local supervisor's restart
rule (helixserve/local/supervisor.py) over real short-lived processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from helixserve.errors import UserError
from helixserve.local.supervisor import Supervisor
from helixserve.planner.placement import NodeRange, Placement
from helixserve.runtime.config import RecoveryConfig
from helixserve.runtime.replan import Recovery, actual_placement, live_cluster
from helixserve.spec import ClusterSpec, LinkSpec, NodeSpec, load_model


def test_live_cluster_drops_dead_nodes_and_their_links():
    fast = LinkSpec(10.0, 0.1)
    cluster = ClusterSpec("c", [NodeSpec("a", "L4"), NodeSpec("b", "L4"), NodeSpec("c", "L4")],
                          explicit={("a", "b"): fast, ("b", "c"): fast, ("coordinator", "c"): fast})
    live = live_cluster(cluster, {"a", "c"})
    assert live.node_names() == ["a", "c"]
    assert set(live.explicit) == {("coordinator", "c")}
    assert cluster.node_names() == ["a", "b", "c"]  # the original is untouched


@dataclass
class _Live:
    name: str
    start_layer: int
    end_layer: int


def test_actual_placement_lists_what_workers_hold_in_layer_order():
    template = Placement("m", "c", 30, "milp", [NodeRange("a", 0, 10), NodeRange("b", 10, 30)])
    got = actual_placement(template, [_Live("c", 10, 30), _Live("b", 0, 15)])
    assert [(n.name, n.start_layer, n.end_layer) for n in got.nodes] == [("b", 0, 15),
                                                                          ("c", 10, 30)]
    assert got.planner == "milp-live" and got.flows == []
    assert actual_placement(got, []).planner == "milp-live"  # not milp-live-live


@pytest.mark.parametrize("name", ["wait_s", "plan_time_limit_s",
                                  "plan_work_limit"])
def test_recovery_config_names_a_bad_value(name):
    with pytest.raises(UserError, match=f"{name}: bad value 0"):
        RecoveryConfig(**{name: 0})


def test_replan_on_a_work_budget_is_the_same_placement_every_time():
    # 8 A100s in a chain of 10 layers each, 4 L4s spare; a0, the sole holder of [0, 10), is
    # lost. On the work clock the coordinator's re-plan does not depend on the load
    model = load_model(Path(__file__).resolve().parents[2] / "data" / "shared" / "models"
                       / "llama-2-70b")
    nodes = [NodeSpec(f"a{i}", "A100-40GB") for i in range(8)]
    cluster = ClusterSpec("c", nodes + [NodeSpec(f"l{i}", "L4") for i in range(4)],
                          default_link=LinkSpec(8.0, 1.0))
    current = Placement(model.name, "c", 80, "milp",
                        [NodeRange(f"a{i}", 10 * i, 10 * i + 10) for i in range(8)])
    # the coordinator's cost model (Coordinator.cost_model: analytic without profiles)
    from helixserve.costmodel import CostModel

    cost = CostModel(model)
    coord = SimpleNamespace(model_spec=model, model_dir=None, cost_model=lambda: cost)
    recovery = Recovery(coord, cluster, RecoveryConfig(plan_work_limit=0.3))
    live = sorted(n.name for n in cluster.nodes if n.name != "a0")
    first, value = recovery._plan_and_value(live, current)
    second, _ = recovery._plan_and_value(live, current)
    assert value is None  # `current` names a0, not in the live cluster: no max flow
    assert first.covers_all_layers() and "a0" not in {r.name for r in first.nodes}
    assert [(r.name, r.start_layer, r.end_layer) for r in first.nodes] == [
        (r.name, r.start_layer, r.end_layer) for r in second.nodes]
    assert first.throughput_tokens_per_s == second.throughput_tokens_per_s > 0


@dataclass
class _Procs:
    """What the supervisor uses of WorkerProcesses, over real processes that exit at once
    (or run `run_s`)."""

    log_dir: Path
    run_s: float = 0.0
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    starts: list[float] = field(default_factory=list)

    @property
    def workers(self) -> list:
        return [type("W", (), {"node": "n1"})()]

    def start_one(self, node: str) -> None:
        self.starts.append(time.monotonic())
        code = f"import time, sys; time.sleep({self.run_s}); sys.exit(3)"
        self.procs[node] = subprocess.Popen([sys.executable, "-c", code])

    def alive(self) -> dict[str, bool]:
        return {n: p.poll() is None for n, p in self.procs.items()}


def test_supervisor_restarts_with_doubling_backoff(tmp_path):
    procs = _Procs(tmp_path)
    procs.start_one("n1")
    said: list[str] = []
    sup = Supervisor(procs, initial_backoff_s=0.2, max_backoff_s=0.4, poll_interval_s=0.02,
                     say=said.append)
    sup.start()
    try:
        deadline = time.monotonic() + 30
        while sup.stats()["n1"]["restarts"] < 3:
            assert time.monotonic() < deadline, said
            time.sleep(0.02)
    finally:
        sup.stop()
    for p in procs.procs.values():
        p.wait(timeout=10)
    gaps = [b - a for a, b in zip(procs.starts, procs.starts[1:], strict=False)]
    # backoff 0.2, then 0.4, then capped at 0.4 (each gap also holds the process's own run)
    assert gaps[0] >= 0.2 and gaps[1] >= 0.4 and gaps[2] >= 0.4
    assert sup.stats()["n1"]["last_exit_code"] == 3
    assert any("exited with code 3" in line for line in said)
    assert any("restarted worker n1 (restart 1)" in line for line in said)


def test_supervisor_does_not_restart_after_stop(tmp_path):
    procs = _Procs(tmp_path)
    procs.start_one("n1")
    sup = Supervisor(procs, initial_backoff_s=0.3, poll_interval_s=0.02, say=lambda _: None)
    sup.start()
    sup.stop()
    procs.procs["n1"].wait(timeout=10)
    sup.check()  # notes the exit, schedules a restart...
    time.sleep(0.4)
    sup.check()  # ...that a stopped supervisor does not make
    assert len(procs.starts) == 1


def test_a_worker_rejoining_that_covers_the_model_ends_uncoverable():
    # layers stayed uncovered after the re-plans; then the lost worker comes back with its
    # range: new requests must be served again without another re-plan
    installed: list[object] = []
    node = SimpleNamespace(name="b", alive=True, start_layer=4, end_layer=8, info=None,
                           refresh_info=_no_info)
    other = SimpleNamespace(name="a", alive=True, start_layer=0, end_layer=4, info=None,
                            refresh_info=_no_info)

    async def install(p: object) -> None:
        installed.append(p)

    coord = SimpleNamespace(nodes={"a": other, "b": node}, covered=lambda: True,
                            placement=Placement("m", "c", 8, "milp", [NodeRange("a", 0, 4),
                                                                     NodeRange("b", 4, 8)]),
                            install_placement=install)
    recovery = Recovery(coord, None, RecoveryConfig(join_min_gain=None))
    recovery.state = "uncoverable"
    asyncio.run(recovery.rejoin(node))
    assert recovery.state == "idle" and not recovery.uncoverable and len(installed) == 1


async def _no_info() -> None:
    return None


def test_replan_time_limit_flag_reaches_the_recovery_config_and_a_bad_value_is_named():
    from helixserve.cli import build_parser
    from helixserve.commands.serve import recovery_config

    for command in ("serve", "demo"):
        base = [command] if command == "demo" else [command, "--cluster", "c.yaml", "--model",
                                                    "m", "--placement", "p.json"]
        args = build_parser().parse_args(base + ["--replan-time-limit-s", "1.5"])
        assert recovery_config(args).plan_time_limit_s == 1.5
        assert recovery_config(build_parser().parse_args(base)).plan_time_limit_s == 5.0
        with pytest.raises(UserError, match="--replan-time-limit-s: bad value 0"):
            recovery_config(build_parser().parse_args(base + ["--replan-time-limit-s", "0"]))
