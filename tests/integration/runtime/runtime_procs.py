"""Helpers for the runtime integration tests: start real `helixserve worker` processes on
127.0.0.1, and the clusters/placements over them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from helixserve.planner.placement import Flow, NodeRange, Placement

# Small KV budget: enough for the tests, and KV usage is easy to read.
KV_CACHE_BYTES = 64 * 1024 * 1024
NUM_LAYERS = 30  # SmolLM2-135M


@dataclass
class WorkerProc:
    name: str
    start_layer: int
    end_layer: int
    port: int
    proc: subprocess.Popen[str]
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(model: Path, name: str, start: int, end: int, tmp: Path,
                 extra: list[str] | None = None, placement: Path | None = None) -> WorkerProc:
    """With `placement`, the worker finds its range there (`--placement P --node N`, as the
    Kubernetes manifests run it); else `--layers start:end`."""
    port = free_port()
    log_path = tmp / f"{name}.log"
    where = ["--placement", str(placement)] if placement else ["--layers", f"{start}:{end}"]
    cmd = [sys.executable, "-m", "helixserve", "worker", "--model", str(model),
           *where, "--node", name, "--port", str(port),
           "--kv-cache-bytes", str(KV_CACHE_BYTES), "--num-threads", "1", *(extra or [])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    return WorkerProc(name, start, end, port, proc, log_path)


def wait_ready(workers: list[WorkerProc], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    for w in workers:
        while "listening on" not in w.log():
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.name} exited {w.proc.returncode}:\n{w.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {w.name} not ready:\n{w.log()}")
            time.sleep(0.1)


def stop_workers(workers: list[WorkerProc]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def make_cluster(workers: list[WorkerProc]):  # -> ClusterSpec
    from helixserve.spec import ClusterSpec, NodeSpec

    return ClusterSpec(
        name="test-local",
        nodes=[NodeSpec(name=w.name, gpu="L4", address=w.address) for w in workers],
    )


def make_placement(ranges: list[tuple[str, int, int]], flows: list[tuple[str, str, float]]) -> Placement:
    return Placement(
        model="smollm2-135m-instruct",
        cluster="test-local",
        num_layers=NUM_LAYERS,
        planner="test",
        nodes=[NodeRange(n, a, b) for n, a, b in ranges],
        flows=[Flow(s, d, f) for s, d, f in flows],
    )


def even_placement() -> Placement:
    """Three workers in a line: one route."""
    return make_placement(
        [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30)],
        [("coordinator", "n0", 1), ("n0", "n1", 1), ("n1", "n2", 1), ("n2", "coordinator", 1)],
    )


def uneven_placement() -> Placement:
    """n0 [0,10) n1 [10,20) n2 [20,30) m [0,25): three routes, two with partial inference:
    n0-n1-n2, n0-m[10,25)-n2[25,30), m[0,25)-n2[25,30)."""
    return make_placement(
        [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30), ("m", 0, 25)],
        [("coordinator", "n0", 2), ("coordinator", "m", 1), ("n0", "n1", 1), ("n0", "m", 1),
         ("n1", "n2", 1), ("m", "n2", 2), ("n2", "coordinator", 3)],
    )
