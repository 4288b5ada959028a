"""Run the rendered pods as local processes: the closest to a cluster CI can get.

No Kubernetes here, so this test plays the kubelet for a two-worker CPU placement of the demo
model: it "mounts" the ConfigMap (its files in a temp dir) and the model volume (the demo
model's parent directory), "resolves" each worker's stable DNS name to 127.0.0.1 and a free
port, "mounts" each pod's items of the TLS Secret (certificates from `helixserve certs create`),
runs every container's `command` exactly as rendered (paths and ports substituted, the
container's env applied), waits on the rendered readiness probes (the exec'd `helixserve
certs check` over mutual TLS on the worker port, HTTP GET on the coordinator's named port),
and sends a chat request through the coordinator. It fails if a rendered flag, path, probe or address does not work with the real
`worker` and `serve` commands. Marked integration: it starts real processes (~20 s on 2 CPUs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_testlib import load_docs, opts, write_cluster, write_placement

from helixserve.deploy import render_k8s
from helixserve.deploy.k8s import CONFIG_DIR, TLS_DIR, model_mount_dir
from helixserve.local.launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

READY_TIMEOUT_S = 120.0


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def _grpc_ready(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_ready(port: int, path: str) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


class Kubelet:
    """Just enough of one: mounts, DNS, container commands, readiness probes, teardown."""

    def __init__(self, root: Path, model_volume: Path) -> None:
        self.root = root
        self.model_volume = model_volume
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []

    def mount(self, value: str, mounts: dict[str, Path]) -> str:
        for inside, outside in mounts.items():
            if value == inside or value.startswith(inside + "/"):
                return str(outside) + value[len(inside):]
        return value

    def run(self, name: str, container: dict[str, Any], mounts: dict[str, Path],
            ports: dict[str, int]) -> None:
        cmd = [self.mount(arg, mounts) for arg in container["command"]]
        for i, arg in enumerate(cmd[:-1]):
            if arg == "--port":
                cmd[i + 1] = str(ports[cmd[i + 1]])
            if arg == "--host":
                cmd[i + 1] = "127.0.0.1"
        if cmd[1] == "worker":
            cmd += ["--num-threads", "1"]
        env = dict(os.environ)
        env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
        log = (self.root / f"{name}.log").open("w")
        exe = [sys.executable, "-m", "helixserve", *cmd[1:]]
        proc = subprocess.Popen(exe, stdout=log, stderr=subprocess.STDOUT, env=env, text=True,
                                start_new_session=True)
        self.procs.append((name, proc))

    def exec_probe(self, command: list[str], mounts: dict[str, Path], ports: dict[str, int]) -> bool:
        """Run an exec probe's command as the kubelet would (inside the pod's mounts)."""
        cmd = [self.mount(arg, mounts) for arg in command]
        for port_in_pod, local in ports.items():
            cmd = [a.replace(f"127.0.0.1:{port_in_pod}", f"127.0.0.1:{local}") for a in cmd]
        assert cmd[0] == "helixserve"
        proc = subprocess.run([sys.executable, "-m", "helixserve", *cmd[1:]],
                              capture_output=True, text=True, timeout=30)
        return proc.returncode == 0

    def wait(self, name: str, check: Any) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        proc = dict(self.procs)[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited {proc.returncode}:\n"
                            + (self.root / f"{name}.log").read_text()[-3000:])
            if check():
                return
            time.sleep(0.3)
        pytest.fail(f"{name} not ready after {READY_TIMEOUT_S} s:\n"
                    + (self.root / f"{name}.log").read_text()[-3000:])

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def demo_model() -> Path:
    engine = pytest.importorskip("helixserve.engine")
    try:
        return Path(engine.prepare_demo_model())
    except Exception as exc:  # no demo GGUF installed: nothing to serve
        pytest.skip(f"demo model unavailable: {exc}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[int]:
    """The rendered deployment running locally; yields the API Service's port."""
    tmp = tmp_path_factory.mktemp("pods")
    num_layers = json.loads((demo_model / "config.json").read_text())["num_hidden_layers"]
    cluster = write_cluster(tmp / "cluster.yaml", "local-cpu",
                            [{"name": "w0", "gpu": "cpu"}, {"name": "w1", "gpu": "cpu"}])
    placement = write_placement(tmp / "placement.json",
                                {"w0": (0, num_layers // 2), "w1": (num_layers // 2, num_layers)},
                                "local-cpu", num_layers=num_layers, model=demo_model.name,
                                flows=[("coordinator", "w0", 10.0), ("w0", "w1", 10.0),
                                       ("w1", "coordinator", 10.0)])
    o = opts(model_path=f"/models/{demo_model.name}", namespace="llm")
    objs = {name: load_docs(text)[0] for name, text in
            render_k8s(cluster, placement, o).files.items() if name != "kustomization.yaml"}

    # DNS: each worker's stable name -> 127.0.0.1:<its own free port>
    worker_ports = {node: free_port() for node in ("w0", "w1")}
    data = dict(objs["configmap.yaml"]["data"])
    seen = yaml.safe_load(data["cluster.yaml"])
    dns = {n["address"]: f"127.0.0.1:{worker_ports[n['name']]}" for n in seen["nodes"]}
    for address, local in dns.items():
        data["cluster.yaml"] = data["cluster.yaml"].replace(address, local)
    config_dir = tmp / "etc"
    config_dir.mkdir()
    for key, value in data.items():
        (config_dir / key).write_text(value)
    mounts = {CONFIG_DIR: config_dir, model_mount_dir(o): demo_model.parent}

    # The Secret, as docs/security.md creates it, and each pod's projection of its items.
    from helixserve.runtime.security import create_dev_credentials

    secret = create_dev_credentials(tmp / "certs", ["w0", "w1"]).directory

    def pod_mounts(obj: dict[str, Any], pod: str) -> dict[str, Path]:
        (vol,) = [v for v in obj["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls"]
        tls_dir = tmp / f"tls-{pod}"
        tls_dir.mkdir()
        for item in vol["secret"]["items"]:
            (tls_dir / item["path"]).write_bytes((secret / item["key"]).read_bytes())
        return {**mounts, TLS_DIR: tls_dir}

    kubelet = Kubelet(tmp, demo_model.parent)
    try:
        worker_mounts = {}
        for node in ("w0", "w1"):
            obj = objs[f"worker-{node}.yaml"]
            worker_mounts[node] = pod_mounts(obj, node)
            kubelet.run(node, _container(obj), worker_mounts[node], {"50051": worker_ports[node]})
        for node in ("w0", "w1"):
            c = _container(objs[f"worker-{node}.yaml"])
            probe = c["readinessProbe"]["exec"]["command"]
            assert f"127.0.0.1:{c['ports'][0]['containerPort']}" in probe
            kubelet.wait(node, lambda n=node, p=probe: kubelet.exec_probe(
                p, worker_mounts[n], {"50051": worker_ports[n]}))
            # the port is TLS only: the plaintext gRPC check a native probe makes is refused
            assert not _grpc_ready(worker_ports[node])
        obj = objs["coordinator-deployment.yaml"]
        c = _container(obj)
        api_port = free_port()
        kubelet.run("coordinator", c, pod_mounts(obj, "coordinator"), {"8000": api_port})
        probe = c["readinessProbe"]["httpGet"]
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert named[probe["port"]] == 8000
        kubelet.wait("coordinator", lambda: _http_ready(api_port, probe["path"]))
        # the Service routes its port to the coordinator's named container port
        svc = objs["coordinator-service.yaml"]["spec"]["ports"][0]
        assert named[svc["targetPort"]] == 8000
        yield api_port
    finally:
        kubelet.stop()


def test_rendered_pods_serve_a_chat_request(stack: int) -> None:
    import httpx

    reply = httpx.post(f"http://127.0.0.1:{stack}/v1/chat/completions", timeout=120.0, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 12, "temperature": 0.0,
    })
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] > 0
