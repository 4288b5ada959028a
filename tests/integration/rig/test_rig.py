"""The emulated cluster rig's parts, for real: `--slowdown` stretches engine steps, the rig's
cluster YAML loads with the project's loader, and a rig stack (the package's link proxy,
real workers, coordinator + API) serves through the proxy, link by link, and leaves no
process, port or cgroup behind. The proxy's own shaping and caller lookup are tested where it
lives (tests/integration/rehearse/test_link_proxy.py).

Timing checks are ratios of two runs in one test, never an upper wall-clock bound.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.rig.clusters import CLUSTERS, gpu_class, write_catalog, write_cluster_yaml

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.integration


def test_slowdown_stretches_engine_steps() -> None:
    """The same decode steps, plain and slowed 3x, alternating: the time ratio is ~3."""
    import torch

    from helixserve.engine import ShardEngine, WorkItem, prepare_demo_model
    from helixserve.engine.slowdown import SlowedEngine, check_slowdown

    torch.set_num_threads(1)
    engine = ShardEngine.load(prepare_demo_model(), 10, 13, "cpu", kv_cache_bytes=2**24)
    slowed = SlowedEngine(engine, 3.0)
    assert slowed.start_layer == 10 and slowed.factor == 3.0  # delegates the rest
    hidden = torch.randn(16, engine.hidden_size)
    engine.step([WorkItem("r", 10, 13, 0, [0] * 16, hidden, sampling=None, sample=False)])
    # the fastest of 16 steps each: other processes on the host only ever add time, so the
    # minimum is the step's own cost (a sum or mean follows the host's load)
    times: dict[str, float] = {"plain": math.inf, "slowed": math.inf}
    for i in range(16):
        for name, eng in (("plain", engine), ("slowed", slowed)):
            item = WorkItem("r", 10, 13, 16 + 2 * i + (name == "slowed"), [0],
                            torch.randn(1, engine.hidden_size), sampling=None, sample=False)
            t0 = time.perf_counter()
            eng.step([item])
            times[name] = min(times[name], time.perf_counter() - t0)
    ratio = times["slowed"] / times["plain"]
    assert 2.0 < ratio < 4.5, times
    with pytest.raises(ValueError, match="--slowdown: bad value 0.5"):
        check_slowdown(0.5)


def test_worker_and_profile_reject_a_bad_slowdown(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for cmd in (["worker", "--model", str(tmp_path), "--layers", "0:2", "--port", "0"],
                ["profile", "--model", str(tmp_path), "--out", str(tmp_path / "p.csv")]):
        proc = subprocess.run([sys.executable, "-m", "helixserve", *cmd, "--slowdown", "0.5"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "--slowdown: bad value 0.5" in proc.stderr


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_rig_cluster_yaml_loads_with_the_project_loader(name: str, tmp_path: Path) -> None:
    from helixserve.errors import UserError
    from helixserve.spec import load_cluster
    from helixserve.spec.gpus import load_gpu_catalog

    rig = CLUSTERS[name]
    addresses = {m.name: f"127.0.0.{20 + i}:{5000 + i}" for i, m in enumerate(rig.machines)}
    write_cluster_yaml(rig, tmp_path / "cluster.yaml", addresses)
    write_catalog(rig.classes(), tmp_path / "gpus.csv")
    spec = load_cluster(tmp_path / "cluster.yaml", catalog=load_gpu_catalog(tmp_path / "gpus.csv"))
    assert [(n.name, n.gpu, n.memory_gb, n.region, n.address) for n in spec.nodes] == [
        (m.name, gpu_class(m.slowdown), m.memory_gb, m.region, addresses[m.name])
        for m in rig.machines]
    assert spec.coordinator_region == rig.coordinator_region
    for a in rig.machines:
        for b in rig.machines:
            if a is b:
                continue
            want = rig.wan.get((a.region, b.region)) or rig.wan.get((b.region, a.region))
            want = want if a.region != b.region and want else rig.lan
            link = spec.link(a.name, b.name)
            assert link is not None
            assert (link.bandwidth_gbps, link.latency_ms) == (want.bandwidth_gbps, want.latency_ms)
    with pytest.raises(UserError, match=f"unknown GPU '{gpu_class(rig.classes()[0])}'"):
        load_cluster(tmp_path / "cluster.yaml")  # the speed classes live in the rig's catalog


def _rig_pids(tag: str) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if tag.encode() in cmdline:
                out.append(int(pid))
    return out


def test_rig_stack_serves_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """A 2-machine stack (proxy, 2 real workers, coordinator + API, mutual TLS) answers a
    request through the proxy, then stop() leaves no process, no listening port and no
    cgroup."""
    import urllib.request

    from benchmarks.rig.clusters import LAN, Machine, RigCluster
    from benchmarks.rig.run import kv_cache_bytes
    from benchmarks.rig.speed import SpeedControl, cgroup_writable
    from benchmarks.rig.stack import Endpoints, RigStack, write_cluster_files
    from helixserve.costmodel import CostModel
    from helixserve.engine import prepare_demo_model
    from helixserve.planner import plan
    from helixserve.spec import load_cluster, load_model
    from helixserve.spec.gpus import load_gpu_catalog

    rig = RigCluster("tiny", (Machine("p", 1.0, 0.45), Machine("q", 2.0, 0.45)), LAN)
    ends = Endpoints.allocate(rig)
    cluster_path, gpus_path = write_cluster_files(rig, tmp_path, ends)
    catalog = load_gpu_catalog(gpus_path)
    spec = load_cluster(cluster_path, catalog=catalog)
    model_dir = prepare_demo_model()
    model = load_model(model_dir, dtype_bytes=4)
    cost = CostModel(model, None, catalog)
    placement = plan("separate", spec, model, cost, work_limit=1.0, jobs=1)
    placement.save(tmp_path / "placement.json")
    mode = "cgroup" if cgroup_writable() else "slowdown"
    speed = SpeedControl(mode, tag=f"test{os.getpid()}")
    stack = RigStack(rig, cluster_path, gpus_path, tmp_path / "placement.json", model_dir, ends,
                     kv_cache_bytes(spec, model, cost, placement), speed, tmp_path / "logs",
                     max_seconds=300, dtype_bytes=4)  # the server routes with the plan's dtype
    with stack:
        pids = [p.pid for p in stack.procs.values()]
        body = json.dumps({"model": model_dir.name, "prompt": "The capital of France is",
                           "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(stack.api_url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        assert answer["usage"]["completion_tokens"] == 4
        # mutual TLS by default, with dev credentials made for this stack
        assert (tmp_path / "logs" / "tls" / "ca.crt").is_file() and stack.tls
        if mode == "cgroup":
            assert speed.groups and all(g.is_dir() for g in speed.groups)
    # the workers' and the coordinator's traffic went through the proxy, link by link. On a
    # busy host the proxy may not find the coordinator's socket in /proc/net/tcp in time: that
    # connection is then forwarded unshaped and counted apart as "unattributed"
    # (rehearse/links.py), still through the proxy
    from helixserve.rehearse.links import read_unattributed

    unattributed = read_unattributed(stack.stats_path).get("p", {}).get("bytes_in", 0)
    assert stack.proxy_stats.get("coordinator->p", {}).get("bytes", 0) + unattributed > 0
    assert stack.proxy_stats.get("p->q", {}).get("bytes", 0) > 0
    assert stack.proxy_stats.get("q->coordinator", {}).get("bytes", 0) > 0
    # shaped as the cluster YAML says (the rig's LAN), not forwarded as an unlinked pair
    assert stack.proxy_stats["p->q"]["bandwidth_gbps"] == LAN.bandwidth_gbps
    assert stack.proxy_stats["p->q"]["latency_ms"] == LAN.latency_ms
    assert "unlinked" not in stack.proxy_stats["p->q"]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or \
            Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0
    assert not _rig_pids(str(tmp_path))
    for address in [*ends.public.values(), stack.api_url.removeprefix("http://")]:
        host, port = address.rsplit(":", 1)
        with socket.socket() as s:
            assert s.connect_ex((host, int(port))) != 0, f"{address} still listening"
    assert not speed.base.exists()


def test_cluster_profiles_merge_cached_classes_with_and_without_head_rows(tmp_path: Path) -> None:
    """A class profiled before the `part` column existed merges with a new one: its rows stay
    layer rows, the new class keeps its head rows under its pseudo-GPU (no profiling here:
    both classes are in the cache)."""
    from types import SimpleNamespace

    from benchmarks.rig.measure import cluster_profiles
    from helixserve.spec import load_profiles

    rig = next(c for c in CLUSTERS.values() if len(c.classes()) >= 2)
    old, new = rig.classes()[:2]
    speed = SimpleNamespace(mode="slowdown")
    head = "model,gpu,num_gpus,phase,batch_tokens,layer_ms"
    (tmp_path / f"{rig.name}-{gpu_class(old)}-slowdown.csv").write_text(
        f"{head}\nm,{gpu_class(old)},1,decode,1,1.0\nm,{gpu_class(old)},1,prompt,64,5.0\n")
    (tmp_path / f"{rig.name}-{gpu_class(new)}-slowdown.csv").write_text(
        f"{head},part\nm,{gpu_class(new)},1,decode,1,2.0,layer\n"
        f"m,{gpu_class(new)},1,prompt,64,9.0,layer\nm,{gpu_class(new)},1,decode,1,30.0,head\n")
    for s in rig.classes()[2:]:  # any further class: a layer-only cache entry
        (tmp_path / f"{rig.name}-{gpu_class(s)}-slowdown.csv").write_text(
            f"{head}\nm,{gpu_class(s)},1,decode,1,1.0\nm,{gpu_class(s)},1,prompt,64,5.0\n")
    out = cluster_profiles(rig, tmp_path, tmp_path, speed, 1, False, print)  # type: ignore[arg-type]
    table = load_profiles(out)
    assert table.has("m", gpu_class(old), 1) and table.has("m", gpu_class(new), 1)
    assert table.head_curve("m", gpu_class(old), 1, "decode") is None
    curve = table.head_curve("m", gpu_class(new), 1, "decode")
    assert curve is not None and curve.layer_ms == (30.0,)
