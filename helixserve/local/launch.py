"""Local processes for `serve`, `demo`, the integration tests and the serving benchmark.

`WorkerProcesses` starts `helixserve worker` subprocesses for the nodes of a placement,
waits until each answers the gRPC health check, and stops them all (SIGTERM, then SIGKILL
after a grace period). Workers run in their own session, so a Ctrl-C at the terminal reaches
only the parent, which shuts down in order (API, coordinator, then workers); on Linux they
also get PR_SET_PDEATHSIG, so even a SIGKILLed parent leaves no orphans.

Worker traffic is mutual TLS by default: unless told `insecure`, `WorkerProcesses` uses the
credentials it is given or generates dev credentials (a CA, one certificate per node and one
for the coordinator; runtime/security.py) in `<log_dir>/tls`, so a client without them is
refused by every worker port. Each worker may forward only to the other workers' addresses.

`serve_app` runs a FastAPI app under uvicorn inside the current event loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.errors import UserError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (the OS picks it; there is a small race until it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: set for a worker started by WorkerProcesses: the pid it must not outlive
PARENT_PID_ENV = "HELIXSERVE_PARENT_PID"


def die_with_parent() -> None:
    """In a worker started by WorkerProcesses: SIGTERM this process when its parent dies
    (PR_SET_PDEATHSIG; Linux only), and at once if it already has. Called by the worker
    itself at start-up, not in a `preexec_fn`: the supervisor restarts workers from a process
    full of gRPC threads, where running Python between fork and exec can crash the child."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # the parent died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def worker_command(
    model_dir: Path,
    node: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    placement_path: Path | None = None,
    layers: tuple[int, int] | None = None,
    engine: str | None = None,
    num_threads: int | None = None,
    peers: str | None = None,
    kv_cache_bytes: int | None = None,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The `helixserve worker` command line of one node: its range from `placement_path`
    (`--placement P --node N`, as the Kubernetes manifests run it) or from `layers`
    (`--layers start:end`); `peers` the addresses it may forward to ("127.0.0.1:*": any
    loopback port)."""
    if placement_path is not None and layers is None:
        where = ["--placement", str(placement_path)]
    elif layers is not None and placement_path is None:
        where = ["--layers", f"{layers[0]}:{layers[1]}"]
    else:
        raise ValueError("worker_command: give exactly one of placement_path and layers")
    cmd = [sys.executable, "-m", "helixserve", "worker",
           *(["--engine", engine] if engine else []),
           "--model", str(model_dir), *where, "--node", node,
           "--host", host, "--port", str(port)]  # fmt: skip
    if num_threads:
        cmd += ["--num-threads", str(num_threads)]
    if peers:
        cmd += ["--peers", peers]
    if kv_cache_bytes is not None:
        cmd += ["--kv-cache-bytes", str(kv_cache_bytes)]
    return cmd + list(extra_args or [])


def spawn_worker(
    cmd: list[str],
    log_path: Path,
    *,
    num_threads: int | None = None,
    env: dict[str, str] | None = None,
    append: bool = False,
) -> subprocess.Popen[bytes]:
    """Start a worker command (`worker_command`) with its output in `log_path` (appended to
    with `append`): in a session of its own, so a Ctrl-C at the terminal reaches only the
    parent, and told the parent's pid so it dies with it (`die_with_parent`).
    `num_threads` also sets OMP_NUM_THREADS, which caps the BLAS pools torch's
    set_num_threads does not."""
    full_env = dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})
    if num_threads:
        full_env["OMP_NUM_THREADS"] = str(num_threads)
    full_env.update(env or {})
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab" if append else "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)


def wait_http_ready(url: str, proc: subprocess.Popen[bytes] | None = None,
                    timeout_s: float = 120.0, log_path: Path | None = None) -> None:
    """Until `url` + "/health" answers 200; fails (with the log's tail) if `proc` exits or
    the timeout passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        tail = ""
        if log_path is not None and log_path.exists():
            tail = "; log tail:\n" + log_path.read_text(errors="replace")[-2000:]
        if proc is not None and proc.poll() is not None:
            raise UserError(f"the server for {url} exited with code {proc.returncode} before it "
                            f"was ready{tail}")
        if time.monotonic() > deadline:
            raise UserError(f"{url} not ready after {timeout_s:.0f} s{tail}")
        time.sleep(0.3)


def wait_grpc_ready(node: str, address: str, proc: subprocess.Popen[bytes], log_path: Path,
                    tls: Any = None, timeout_s: float = 120.0) -> None:
    """Until the worker at `address` says SERVING to a gRPC health check (over `tls`, a
    coordinator's TlsConfig, or plaintext); fails with its log's tail if it exits first or
    the timeout passes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from helixserve.runtime.security import sync_channel

    def tail() -> str:
        try:
            return log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    deadline = time.monotonic() + timeout_s
    channel = sync_channel(address, tls)
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        while True:
            if proc.poll() is not None:
                raise UserError(f"worker {node} exited with code {proc.returncode} before it "
                                f"was ready; log {log_path}:\n{tail()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"worker {node} at {address} not ready after {timeout_s:.0f} s; "
                                f"log tail:\n{tail()}")
            time.sleep(0.2)
    finally:
        channel.close()


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM all (workers drain), then SIGKILL whatever is still alive after `grace_s`."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


@dataclass
class WorkerSpec:
    node: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class WorkerProcesses:
    """`helixserve worker` subprocesses, one per node of a placement."""

    def __init__(
        self,
        model_dir: Path,
        placement_path: Path,
        workers: list[WorkerSpec],
        log_dir: Path,
        num_threads: int | None = None,
        extra_args: list[str] | None = None,
        credentials: Any = None,
        insecure: bool = False,
        one_at_a_time: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model_dir = model_dir
        #: set in each worker's environment (on top of this process's)
        self.env = env or {}
        #: start each worker only once the one before answers its health check: stages that
        #: share one GPU (vllm on CUDA) must not size themselves at the same time (docs/vllm.md)
        self.one_at_a_time = one_at_a_time
        self.placement_path = placement_path
        self.workers = workers
        self.log_dir = log_dir
        self.num_threads = num_threads
        self.extra_args = extra_args or []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = False  # set by stop(): a supervisor must not start workers again
        #: helixserve.runtime.security.DevCredentials, or None for plaintext (`insecure`)
        self.credentials = credentials
        self.insecure = insecure

    def ensure_credentials(self) -> Any:
        """The credentials the workers use (generated on first call unless `insecure`)."""
        if self.insecure:
            return None
        if self.credentials is None:
            from helixserve.runtime.security import create_dev_credentials, dev_credentials_dir

            hosts = sorted({w.host for w in self.workers} - {"127.0.0.1", "localhost"})
            self.credentials = create_dev_credentials(
                dev_credentials_dir(self.log_dir), [w.node for w in self.workers], hosts)
        return self.credentials

    @property
    def coordinator_tls(self) -> Any:
        """The coordinator's TlsConfig for these workers (None: plaintext)."""
        creds = self.ensure_credentials()
        return None if creds is None else creds.coordinator

    def coordinator_tls_flags(self) -> list[str]:
        """--tls-* flags for a `helixserve serve` over these workers ([] when plaintext)."""
        tls = self.coordinator_tls
        return [] if tls is None else tls.flags()

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every worker; with `one_at_a_time`, each after the one before is ready (each
        within `timeout_s`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for w in self.workers:
            (self.log_dir / f"worker-{w.node}.log").unlink(missing_ok=True)
            self.start_one(w.node)
            if self.one_at_a_time:
                self._wait_one(w, timeout_s)

    def start_one(self, node: str) -> None:
        """Start (or start again, same address and flags) the worker of `node`; its log is
        appended to."""
        creds = self.ensure_credentials()
        if self.stopping:
            return
        w = next(w for w in self.workers if w.node == node)
        cmd = worker_command(
            self.model_dir, w.node, w.port, host=w.host, placement_path=self.placement_path,
            num_threads=self.num_threads, peers=",".join(x.address for x in self.workers),
            extra_args=[*(creds.nodes[w.node].flags() if creds is not None else []),
                        *self.extra_args])
        self.procs[w.node] = spawn_worker(cmd, self.log_dir / f"worker-{w.node}.log",
                                          num_threads=self.num_threads, env=self.env,
                                          append=True)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every worker's gRPC health check says SERVING; fails with the worker's log
        tail if one exits or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            self._wait_one(w, max(0.0, deadline - time.monotonic()))

    def _wait_one(self, w: WorkerSpec, timeout_s: float) -> None:
        wait_grpc_ready(w.node, w.address, self.procs[w.node],
                        self.log_dir / f"worker-{w.node}.log", self.coordinator_tls, timeout_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM all (they drain), then SIGKILL whatever is still alive after `grace_s`."""
        self.stopping = True
        stop_processes(list(self.procs.values()), grace_s)

    def alive(self) -> dict[str, bool]:
        return {node: proc.poll() is None for node, proc in self.procs.items()}


async def serve_app(
    app: Any,
    host: str,
    port: int,
    log_level: str = "warning",
    on_started: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> None:
    """Run `app` under uvicorn in this event loop until SIGINT/SIGTERM (uvicorn's handlers).
    `on_shutdown` runs as soon as the shutdown begins (e.g. to end open streams within
    uvicorn's grace period instead of having them cancelled)."""
    import asyncio

    import uvicorn

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    if on_started is not None:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            on_started()

    async def watch_shutdown() -> None:
        while not server.should_exit:
            await asyncio.sleep(0.05)
        if on_shutdown is not None:
            on_shutdown()

    watcher = asyncio.create_task(watch_shutdown())
    try:
        await task
    except SystemExit:  # uvicorn exits when it cannot bind
        server.started = False
    finally:
        watcher.cancel()
    if not server.started:
        raise UserError(f"--port: could not start the API server on {host}:{port} (in use?)")
