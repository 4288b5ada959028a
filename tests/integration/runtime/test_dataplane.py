"""The `stream` data plane (runtime/dataplane.py) between real emulated workers, mutual TLS.

Three `helixserve worker --engine emulated` processes with HELIXSERVE_DATAPLANE=stream and
their dev certificates, the real Coordinator with its certificate (its streams and RPCs are
gRPC, spliced by each worker's listener): requests get the same tokens as over gRPC's data
plane, the items really crossed the stream (the workers' message counters), a client
without the cluster's certificate is refused at the handshake, a coordinator certificate
cannot open a worker's stream, and a stopped next hop (SIGSTOP: its kernel still takes
bytes) breaks its sender's stream by the keepalive, its items reported to the coordinator.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runtime_procs import WorkerProc, free_port, stop_workers, wait_ready
from test_emulated_cluster import (
    GPU,
    MODEL,
    NO_TORCH,
    NUM_GPUS,
    PROFILES,
    PROMPTS,
    RANGES,
    RESERVE_GB,
    cluster_and_placement,
    config,
    generate,
)

from helixserve.runtime import Coordinator, dataplane, security
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

#: keepalive of the hung-peer test: a stopped next hop is found within 1 + 1 s
KEEPALIVE_S = "1"


def start(name: str, a: int, b: int, tmp: Path, creds: security.DevCredentials,
          kind: str, env: dict[str, str] | None = None) -> WorkerProc:
    port = free_port()
    log_path = tmp / f"{name}-{kind}.log"
    cmd = [sys.executable, "-c", NO_TORCH, "worker", "--engine", "emulated", "--gpu", GPU,
           "--num-gpus", str(NUM_GPUS), "--gpu-reserve-gb", str(RESERVE_GB),
           "--profiles", str(PROFILES), "--model", str(MODEL), "--layers", f"{a}:{b}",
           "--node", name, "--port", str(port), "--peers", "127.0.0.1:*",
           *creds.nodes[name].flags()]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, dataplane.DATAPLANE_ENV: kind, **(env or {})})
    return WorkerProc(name, a, b, port, proc, log_path)


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> security.DevCredentials:
    return security.create_dev_credentials(tmp_path_factory.mktemp("certs"),
                                           [n for n, _, _ in RANGES])


def cluster_of(tmp: Path, creds: security.DevCredentials, kind: str,
               env: dict[str, str] | None = None) -> list[WorkerProc]:
    procs = [start(n, a, b, tmp, creds, kind, env) for n, a, b in RANGES]
    try:
        wait_ready(procs, timeout_s=60)
    except BaseException:
        stop_workers(procs)
        raise
    return procs


@pytest.fixture(scope="module")
def stream_workers(tmp_path_factory: pytest.TempPathFactory,
                   creds: security.DevCredentials) -> Iterator[list[WorkerProc]]:
    procs = cluster_of(tmp_path_factory.mktemp("stream"), creds, "stream")
    try:
        yield procs
    finally:
        stop_workers(procs)


async def run_prompts(workers: list[WorkerProc],
                      creds: security.DevCredentials) -> tuple[list[Any], dict[str, Any]]:
    cluster, placement = cluster_and_placement(workers)
    coord = await Coordinator.create(cluster, placement, MODEL, config(), tls=creds.coordinator)
    try:
        runs = await asyncio.gather(*(generate(coord, f"r{i}", p, 6 + 2 * i)
                                      for i, p in enumerate(PROMPTS)))
        infos = {}
        for w in workers:
            async with security.aio_channel(w.address, creds.coordinator) as ch:
                infos[w.name] = tp.info_from_pb(
                    await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest(), timeout=10))
        return runs, infos
    finally:
        await coord.close()


def test_requests_cross_the_stream_data_plane_as_over_grpc(stream_workers, creds, tmp_path):
    runs, infos = asyncio.run(run_prompts(stream_workers, creds))
    for i, (tokens, _, finish) in enumerate(runs):
        assert len(tokens) == 6 + 2 * i and finish == "length"
    assert "data plane stream" in stream_workers[0].log()
    # n0 and n1 sent their items to their next hops, which are on the data plane only
    assert infos["n0"].work_items_out > 0 and infos["n1"].work_items_out > 0
    grpc_workers = cluster_of(tmp_path, creds, "grpc")
    try:
        over_grpc, _ = asyncio.run(run_prompts(grpc_workers, creds))
        assert "data plane grpc" in grpc_workers[0].log()
    finally:
        stop_workers(grpc_workers)
    assert [r[0] for r in runs] == [r[0] for r in over_grpc]


async def open_stream(address: str, ctx: ssl.SSLContext | None) -> Any:
    host, port = dataplane.split_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(dataplane.MAGIC)
    assert await asyncio.wait_for(reader.readexactly(len(dataplane.READY)), 10) == dataplane.READY
    if ctx is not None:
        await asyncio.wait_for(writer.start_tls(ctx, server_hostname=host), 10)
    return reader, writer


def test_a_client_without_the_cluster_certificate_is_refused(stream_workers, creds, tmp_path):
    address = stream_workers[1].address
    other = security.create_dev_credentials(tmp_path / "other-ca", ["n0"])

    def client_ctx(tls: security.TlsConfig | None, ca: security.TlsConfig) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cadata=ca.ca_pem.decode())
        if tls is not None:
            ctx.load_cert_chain(tls.cert_path, tls.key_path)
        return ctx

    async def refused(ctx: ssl.SSLContext) -> bool:
        try:
            reader, writer = await open_stream(address, ctx)
            # TLS 1.3: the server's refusal of the client's certificate comes after the
            # client's handshake ends; nothing is read, the connection closes
            data = pb.WorkBatch(hello=pb.StreamHello(sender="n0")).SerializeToString()
            writer.write(dataplane.frame(dataplane.DATA, data))
            await asyncio.wait_for(reader.read(), 10)
        except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError):
            return True
        return reader.at_eof()

    # a certificate of another CA, and none at all (the worker's CA trusted by the client)
    assert asyncio.run(refused(client_ctx(other.nodes["n0"], creds.coordinator)))
    assert asyncio.run(refused(client_ctx(None, creds.coordinator)))
    # the same port still serves gRPC to a member of the CA
    assert "data plane stream" in stream_workers[1].log()


def test_a_coordinator_certificate_cannot_open_a_worker_stream(stream_workers, creds):
    address = stream_workers[1].address

    async def main() -> tuple[int, bytes]:
        reader, writer = await open_stream(address, dataplane.ssl_context(creds.coordinator,
                                                                          server=False))
        data = tp.work_batch_pb([], sender="n0").SerializeToString()
        writer.write(dataplane.frame(dataplane.DATA, data))
        kind, body = await asyncio.wait_for(dataplane.read_frame(reader), 10)
        writer.close()
        return kind, body

    kind, body = asyncio.run(main())
    assert kind == dataplane.CLOSE
    assert b"needs a worker certificate" in body


def test_a_stopped_next_hop_breaks_the_stream_and_its_items_are_reported(creds, tmp_path):
    env = {"HELIXSERVE_GRPC_KEEPALIVE_S": KEEPALIVE_S,
           "HELIXSERVE_GRPC_KEEPALIVE_TIMEOUT_S": KEEPALIVE_S}
    procs = cluster_of(tmp_path, creds, "stream", env)

    async def main() -> str:
        cluster, placement = cluster_and_placement(procs)
        coord = await Coordinator.create(cluster, placement, MODEL, config(),
                                         tls=creds.coordinator)
        try:
            await generate(coord, "warm", PROMPTS[1], 2)
            procs[2].proc.send_signal(signal.SIGSTOP)
            try:
                await asyncio.wait_for(generate(coord, "lost", PROMPTS[1], 4), 60)
            except Exception as exc:  # noqa: BLE001 (the request's failure is the point)
                return f"{type(exc).__name__}: {exc}"
            return "finished"
        finally:
            procs[2].proc.send_signal(signal.SIGCONT)
            await coord.close()

    try:
        outcome = asyncio.run(main())
    finally:
        stop_workers(procs)
    # n1 found its next hop silent and reported the items it had sent there
    log = procs[1].log()
    assert "stream to 127.0.0.1:" in log and "keepalive" in log, log[-2000:]
    assert outcome != "finished" or "keepalive" in log
