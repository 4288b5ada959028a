"""One emulated cluster serving one placement: link proxy, workers, coordinator + API.

    with RigStack(cluster, placement_path, ...) as stack:   # starts everything, waits ready
        ... send requests to stack.api_url ...
    # stopped: API, workers, proxy (SIGTERM, then SIGKILL), cgroups removed

Every machine has its own loopback address 127.0.0.(20+i). Its worker listens on a private
port there; the link proxy (the package's, helixserve/rehearse/links.py, as `helixserve
rehearse` runs it) listens on the public port (the address in the cluster YAML) and shapes
each (source, destination) link as the YAML says. Children run in their own session with
PR_SET_PDEATHSIG, so a killed rig leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.rig.clusters import RigCluster, machine_host, write_catalog, write_cluster_yaml
from benchmarks.rig.speed import SpeedControl
from helixserve.local.launch import free_port, stop_processes
from helixserve.rehearse.links import ProxyConfig, ProxyRoute, link_table, read_stats
from helixserve.spec.cluster import COORDINATOR

RIG_DIR = Path(__file__).resolve().parent
REPO = RIG_DIR.parents[1]
#: threads per worker: one emulated device is one CPU thread slowed down
WORKER_THREADS = 1


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = str(WORKER_THREADS)
    return env


def _session_and_deathsig(extra: Callable[[], None] | None = None) -> Callable[[], None]:
    def run() -> None:
        os.setsid()
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
        if extra is not None:
            extra()

    return run


@dataclass
class Endpoints:
    """Where each machine is reached (public, through the proxy) and listens (private)."""

    public: dict[str, str]
    private: dict[str, tuple[str, int]]

    @classmethod
    def allocate(cls, cluster: RigCluster) -> Endpoints:
        public, private = {}, {}
        for i, m in enumerate(cluster.machines):
            host = machine_host(i)
            public[m.name] = f"{host}:{free_port(host)}"
            private[m.name] = (host, free_port(host))
        return cls(public, private)


def write_cluster_files(cluster: RigCluster, workdir: Path, ends: Endpoints) -> tuple[Path, Path]:
    """cluster.yaml and gpus.csv of `cluster` in workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    yaml_path, gpus_path = workdir / "cluster.yaml", workdir / "gpus.csv"
    write_cluster_yaml(cluster, yaml_path, ends.public)
    write_catalog(cluster.classes(), gpus_path)
    return yaml_path, gpus_path


def proxy_config(cluster_spec: Any, ends: Endpoints, pids: dict[int, str], stats_path: Path,
                 max_seconds: float) -> ProxyConfig:
    """Routes public -> private per machine, on the machine's own address; every directed
    link of the cluster YAML, read back through the project's loader (coordinator included);
    `pids`: the workers' processes, so their connections are told from the coordinator's."""
    names = [COORDINATOR, *cluster_spec.node_names()]
    routes = []
    for node, address in ends.public.items():
        host, port = address.rsplit(":", 1)
        phost, pport = ends.private[node]
        assert phost == host, (node, address, phost)  # Endpoints.allocate: one host a machine
        routes.append(ProxyRoute(node, int(port), pport, host=host))
    return ProxyConfig(routes, link_table(cluster_spec, names), pids, str(stats_path),
                       other_source=COORDINATOR, max_seconds=max_seconds)


class RigStack:
    def __init__(
        self,
        cluster: RigCluster,
        cluster_path: Path,
        gpus_path: Path,
        placement_path: Path,
        model_dir: Path,
        ends: Endpoints,
        kv_cache_bytes: dict[str, int],
        speed: SpeedControl,
        workdir: Path,
        max_seconds: float = 1800.0,
        tls: bool = True,
        profiles_path: Path | None = None,
        dtype_bytes: int = 2,
    ) -> None:
        self.cluster = cluster
        self.cluster_path = cluster_path
        self.gpus_path = gpus_path
        self.placement_path = placement_path
        self.model_dir = model_dir
        self.ends = ends
        self.kv_cache_bytes = kv_cache_bytes
        self.speed = speed
        self.workdir = workdir
        self.max_seconds = max_seconds
        #: mutual TLS between coordinator and workers with fresh dev credentials (as local
        #: stacks run by default, docs/security.md); False: plaintext gRPC
        self.tls = tls
        #: the cost model the rig plans and simulates with, given to the coordinator so its
        #: router's node throughputs and link capacities are the simulator's
        self.profiles_path = profiles_path
        self.dtype_bytes = dtype_bytes
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stats_path = workdir / "links-stats.json"
        self.api_host = "127.0.0.1"
        self.api_port = free_port(self.api_host)
        self.proxy_stats: dict[str, Any] = {}

    @property
    def api_url(self) -> str:
        return f"http://{self.api_host}:{self.api_port}"

    # ---- start ---------------------------------------------------------------------------

    def __enter__(self) -> RigStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, cmd: list[str], preexec: Callable[[], None] | None = None,
               stdout: Any = None) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            cmd, stdout=stdout or log, stderr=log, env=child_env(), cwd=REPO,
            preexec_fn=_session_and_deathsig(preexec),  # noqa: PLW1509 (before any thread)
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        from helixserve.planner import load_placement
        from helixserve.spec import load_cluster
        from helixserve.spec.gpus import load_gpu_catalog

        self.workdir.mkdir(parents=True, exist_ok=True)
        spec = load_cluster(self.cluster_path, catalog=load_gpu_catalog(self.gpus_path))
        placement = load_placement(self.placement_path)
        by_name = {m.name: m for m in self.cluster.machines}
        node_flags: dict[str, list[str]] = {r.name: [] for r in placement.nodes}
        server_flags: list[str] = []
        if self.tls:
            from helixserve.runtime.security import create_dev_credentials

            hosts = sorted({a.rsplit(":", 1)[0] for a in self.ends.public.values()})
            creds = create_dev_credentials(self.workdir / "tls", list(node_flags), hosts)
            node_flags = {n: creds.nodes[n].flags() for n in node_flags}
            server_flags = creds.coordinator.flags()
        pids: dict[int, str] = {}
        for r in placement.nodes:
            m = by_name[r.name]
            host, port = self.ends.private[m.name]
            cmd = [
                sys.executable, "-m", "helixserve", "worker",
                "--model", str(self.model_dir), "--placement", str(self.placement_path),
                "--node", m.name, "--host", host, "--port", str(port),
                "--num-threads", str(WORKER_THREADS),
                "--kv-cache-bytes", str(self.kv_cache_bytes[m.name]),
                # next hops: the (proxied) addresses the coordinator reads from the cluster
                "--peers", ",".join(str(n.address) for n in spec.nodes if n.address),
                *node_flags[m.name], *self.speed.worker_args(m.slowdown),
            ]  # fmt: skip
            proc = self._spawn(f"worker-{m.name}", cmd, self.speed.preexec(m.name, m.slowdown))
            pids[proc.pid] = m.name
        # after the workers (they connect to their peers only when they forward), before the
        # coordinator: the proxy tells workers' connections from the coordinator's by pid
        config_path = self.workdir / "proxy.json"
        config_path.write_text(
            proxy_config(spec, self.ends, pids, self.stats_path, self.max_seconds).to_json())
        proxy = self._spawn("proxy", [sys.executable, "-m", "helixserve.rehearse.links",
                                      str(config_path)], stdout=subprocess.PIPE)
        assert proxy.stdout is not None
        if proxy.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"rig proxy did not start; log {self.workdir / 'proxy.log'}:\n"
                               f"{self.log_tail('proxy')}")
        server = [
            sys.executable, str(RIG_DIR / "server.py"),
            "--cluster", str(self.cluster_path), "--gpus", str(self.gpus_path),
            "--placement", str(self.placement_path), "--model", str(self.model_dir),
            "--host", self.api_host, "--port", str(self.api_port),
            "--max-seconds", str(self.max_seconds), "--dtype-bytes", str(self.dtype_bytes),
            *(["--profiles", str(self.profiles_path)] if self.profiles_path else []),
            *server_flags,
        ]  # fmt: skip
        self._spawn("server", server)
        self._wait_api(timeout_s=240.0)

    def _wait_api(self, timeout_s: float) -> None:
        """Until the API lists the model (the coordinator has connected to every worker)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"rig: {name} exited with code {proc.returncode}; log "
                                       f"{self.workdir / (name + '.log')}:\n{self.log_tail(name)}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    self.api_url + "/v1/models", timeout=2.0) as resp:
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"rig: API not ready after {timeout_s:.0f} s; server log:\n"
                                   f"{self.log_tail('server')}")
            time.sleep(0.3)

    def log_tail(self, name: str, num_chars: int = 1500) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / f"{name}.log").read_text(errors="replace")[-num_chars:]
        return ""

    # ---- stop ----------------------------------------------------------------------------

    def stop(self, grace_s: float = 10.0) -> None:
        """API first (it releases requests), then the workers and the proxy; SIGKILL after
        `grace_s`; then the cgroups. Safe to call twice."""
        server = [self.procs["server"]] if "server" in self.procs else []
        stop_processes(server, grace_s)
        stop_processes([p for n, p in self.procs.items() if n != "server"], grace_s)
        proxy = self.procs.get("proxy")
        if proxy is not None:
            if proxy.stdout is not None:
                proxy.stdout.close()
            # the proxy writes its per-link counters once more as it stops
            self.proxy_stats = read_stats(self.stats_path)[1]
        self.procs.clear()
        self.speed.close()

