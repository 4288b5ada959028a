"""Helpers for the runtime integration tests: start real `helixserve worker` processes on
127.0.0.1, and the clusters/placements over them."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from helixserve.local.launch import free_port, spawn_worker, worker_command
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
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def start_worker(model: Path, name: str, start: int, end: int, tmp: Path,
                 extra: list[str] | None = None, placement: Path | None = None,
                 port: int | None = None, log_name: str | None = None,
                 peers: str | None = "127.0.0.1:*",
                 env: dict[str, str] | None = None) -> WorkerProc:
    """With `placement`, the worker finds its range there (`--placement P --node N`, as the
    Kubernetes manifests run it); else `--layers start:end`."""
    port = port or free_port()
    log_path = tmp / f"{log_name or name}.log"
    # Plaintext, and forwarding to any loopback port (the tests route through proxies whose
    # ports appear later): the runtime tests exercise routing and faults; TLS and the peer
    # allowlist are tested in test_abuse.py and through the local stacks (local/launch.py).
    cmd = worker_command(model, name, port, placement_path=placement,
                         layers=None if placement else (start, end), num_threads=1,
                         peers=peers, kv_cache_bytes=KV_CACHE_BYTES, extra_args=extra)
    proc = spawn_worker(cmd, log_path, num_threads=1, env=env)
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


class CuttableProxy:
    """A TCP proxy on 127.0.0.1 in front of a worker, whose connections can be cut.

    `cut(first)` makes every connection accepted so far with index >= `first` a black hole
    (bytes from the client are dropped, so whatever the client sends now is lost), then closes
    them after `close_after_s`: to the client, a stream that swallowed its last items and
    broke, while the worker behind stays up and reachable through newer connections.
    """

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = int(self.listener.getsockname()[1])
        self.conns: list[dict[str, object]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self.conns)

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            conn: dict[str, object] = {"client": client, "upstream": upstream, "hole": False,
                                       "sent": 0, "limit": None}
            with self._lock:
                self.conns.append(conn)
            threading.Thread(target=self._pump, args=(conn, client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(conn, upstream, client, False),
                             daemon=True).start()

    @staticmethod
    def _pump(conn: dict[str, object], src: socket.socket, dst: socket.socket,
              from_client: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_client and conn["hole"]:
                    continue
                if from_client:
                    sent, limit = conn["sent"], conn["limit"]
                    assert isinstance(sent, int)
                    if isinstance(limit, int) and sent + len(data) >= limit:
                        # armed: pass the bytes up to the limit, then swallow the rest
                        data = data[: max(0, limit - sent)]
                        conn["hole"] = True
                        trip = conn["trip"]
                        assert callable(trip)
                        trip()
                    conn["sent"] = sent + len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self, first: int, close_after_s: float = 1.0) -> int:
        with self._lock:
            victims = self.conns[first:]
        for conn in victims:
            conn["hole"] = True
        self._close_later(victims, close_after_s)
        return len(victims)

    def arm(self, index: int, more_bytes: int, close_after_s: float = 1.0) -> None:
        """Connection `index` passes `more_bytes` more bytes from its client, then becomes a
        black hole and is closed `close_after_s` later, as `cut` does: a stream that breaks
        part-way through what the client is sending (say, after a few prefill chunks)."""
        with self._lock:
            conn = self.conns[index]
        conn["trip"] = lambda: self._close_later([conn], close_after_s)
        sent = conn["sent"]
        assert isinstance(sent, int)
        conn["limit"] = sent + more_bytes

    def tripped(self, index: int) -> bool:
        with self._lock:
            return bool(self.conns[index]["hole"])

    @staticmethod
    def _close_later(victims: list[dict[str, object]], close_after_s: float) -> None:
        import threading

        def close() -> None:
            for conn in victims:
                for key in ("client", "upstream"):
                    sock = conn[key]
                    assert isinstance(sock, socket.socket)
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    sock.close()

        threading.Timer(close_after_s, close).start()

    def close(self) -> None:
        self.listener.close()
        self.cut(0, close_after_s=0.0)


#: three workers in a line whose middle one's KV holds about one long request (name, start
#: layer, end layer, KV bytes): ~208 tokens for 10 layers of the demo model (fp32 on CPU), and
#: ~160 on the middle worker, so that it is the one that runs out (the preemption tests)
SMALL_KV_WORKERS = [("a", 0, 10, 3_200_000), ("b", 10, 20, 2_500_000), ("c", 20, 30, 3_200_000)]


def kv_used_blocks(workers: list[WorkerProc]) -> dict[str, int]:
    """Each worker's KV blocks held by requests (its Info)."""
    import grpc

    from helixserve.runtime.proto import helix_pb2 as pb
    from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

    used = {}
    for w in workers:
        with grpc.insecure_channel(w.address) as ch:
            info = pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest(), timeout=10)
            used[w.name] = info.kv_used_blocks
    return used


class SharedWorkers:
    """One set of workers for the consecutive tests that ask for it (started by the first,
    stopped after the last: conftest.py), handed to each test with every worker's KV empty,
    as fresh workers' is: a test cannot see what the one before it left running."""

    def __init__(self, model: Path, tmp: Path, specs: list[tuple[str, int, int, int]]) -> None:
        self.model, self.tmp, self.specs = model, tmp, specs
        self.procs: list[WorkerProc] | None = None
        self.starts = 0

    def get(self) -> list[WorkerProc]:
        if self.procs is not None and any(w.proc.poll() is not None for w in self.procs):
            self.close()  # a worker died: the next test gets a whole set again
        if self.procs is None:
            self.starts += 1
            procs = [start_worker(self.model, name, a, b, self.tmp,
                                  extra=["--kv-cache-bytes", str(kv)],
                                  log_name=f"{name}-{self.starts}")
                     for name, a, b, kv in self.specs]
            try:
                wait_ready(procs)
            except BaseException:
                stop_workers(procs)
                raise
            self.procs = procs
        deadline = time.monotonic() + 10
        while any((used := kv_used_blocks(self.procs)).values()):
            assert time.monotonic() < deadline, f"KV still held after the last test: {used}"
            time.sleep(0.1)
        return self.procs

    def close(self) -> None:
        if self.procs is not None:
            procs, self.procs = self.procs, None
            stop_workers(procs)
