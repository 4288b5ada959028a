"""The process around a `Worker`: its gRPC server (and, with the `stream` data plane, the
listener in front of it, runtime/dataplane.py), gRPC health, the engine watchdog, and the
drain on shutdown (runtime/worker.py's module doc: Liveness; docs/runtime.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from helixserve.runtime import dataplane, security
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from helixserve.runtime.worker import Worker

log = logging.getLogger("helixserve.worker")

SERVICE_NAME = "helixserve.v1.HelixWorker"
#: Default bound on an engine that makes no progress while work waits (worker.py, Liveness).
ENGINE_STALL_S = 20.0


async def _watch_engine(worker: Worker, health_servicer: Any, stall_timeout_s: float) -> None:
    """Loop thread: health follows the engine's progress (module doc, Liveness)."""
    seen, since = worker.beats, time.monotonic()
    while True:
        await asyncio.sleep(min(1.0, stall_timeout_s / 4))
        now = time.monotonic()
        if worker.beats != seen or not worker.work_waiting():
            seen, since = worker.beats, now
            if worker.stalled_s:
                log.warning("node %s: engine moves again after %.1f s", worker.node,
                            worker.stalled_s)
                worker.stalled_s = 0.0
                if not worker.draining:
                    for name in ("", SERVICE_NAME):
                        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            continue
        if now - since >= stall_timeout_s:
            first = not worker.stalled_s
            worker.stalled_s = now - since
            if first:
                log.error("%s", worker.stall_message())
                print(f"helixserve worker {worker.node}: {worker.stall_message()}", flush=True)
                for name in ("", SERVICE_NAME):
                    await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def serve(
    worker: Worker,
    host: str,
    port: int,
    drain_timeout_s: float = 30.0,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    tls: security.TlsConfig | None = None,
    stall_timeout_s: float = ENGINE_STALL_S,
) -> int:
    """Run the worker's gRPC server until `stop` is set (SIGTERM), then drain and exit.

    Shutdown: health goes NOT_SERVING and new requests are refused; requests already holding KV
    here keep being served until the coordinator releases them or `drain_timeout_s` passes;
    whatever is left then is failed explicitly (UNAVAILABLE to its coordinator) and freed.
    With `tls`, the only port is mutual TLS (a client without a certificate from the CA is
    refused at the handshake). An engine stalled for `stall_timeout_s` with work waiting
    turns health NOT_SERVING until it moves again (module doc). Returns the bound port.
    """
    server = grpc.aio.server(options=tp.SERVER_OPTIONS)
    pb_grpc.add_HelixWorkerServicer_to_server(worker, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls is not None:
        security.check_own_identity(tls, worker.node)
    front: dataplane.Front | None = None
    if worker.dataplane == "stream":
        # gRPC behind the data plane's listener, which splices its clients to it
        grpc_port = security.add_port(server, "127.0.0.1:0", tls)
        front = dataplane.Front(worker, tls, grpc_port)
        bound = await front.start(host, port)
    else:
        bound = security.add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    worker.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    watchdog = asyncio.get_running_loop().create_task(
        _watch_engine(worker, health_servicer, stall_timeout_s))
    info = worker.info()
    print(
        f"helixserve worker {worker.node}: layers [{info.start_layer}, {info.end_layer}) of "
        f"{info.num_model_layers}, {info.backend} on {info.device} ({info.dtype}), "
        f"KV {info.kv_capacity_tokens} tokens, listening on {host}:{bound} "
        f"({'mutual TLS' if tls else 'plaintext, no authentication'}; "
        f"data plane {worker.dataplane}; "
        f"prefix caching {'on' if worker.engine.prefix_caching else 'off'}; "
        f"forwards to: {worker.peer_policy.describe()})",
        flush=True,
    )
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    await stop.wait()
    t_stop = time.monotonic()
    worker.draining = True
    watchdog.cancel()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + drain_timeout_s
    while worker.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    lost = worker.fail_active(f"node {worker.node}: shut down before the request finished")
    if lost:
        log.warning("failed %d requests still active after %.1f s drain", lost, drain_timeout_s)
    if lost:
        await asyncio.sleep(0.1)  # let the error results reach their streams
    await worker.stop()
    await server.stop(grace=1.0)
    if front is not None:
        await front.stop()
    print(f"helixserve worker {worker.node}: stopped ({lost} requests failed at shutdown) "
          f"in {time.monotonic() - t_stop:.2f} s", flush=True)
    return bound
