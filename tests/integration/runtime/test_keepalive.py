"""Idle streams stay open: the worker's server accepts the keepalive pings its clients send.

The bug: clients pinged every 20 s on idle streams, the server kept gRPC's default (a ping
without data at most every 5 minutes, GOAWAY `too_many_pings` after 2 early ones), so an idle
worker-to-worker stream died after ~1 minute. Time is scaled here: with 1 s pings (env
HELIXSERVE_GRPC_KEEPALIVE_S, or `channel_options(1.0)`), the old server config fails within
~3 s, the same way; 20 s of idling at 1 s pings is as many pings as ~7 minutes at 20 s.
`test_idle_route_survives_5_minutes_at_default_settings` does it at real time (opt-in:
HELIXSERVE_LONG_TESTS=1).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from runtime_procs import make_cluster, make_placement, start_worker, stop_workers, wait_ready

from helixserve.runtime import Coordinator, GenerationRequest
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration]


class _IdleWorker(pb_grpc.HelixWorkerServicer):
    """A Work stream that says nothing until the client hangs up."""

    async def Work(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        async for _ in request_iterator:
            pass
        if False:  # an async generator that yields nothing
            yield pb.ResultBatch()


async def _idle_stream_survives(server_options: list[tuple[str, Any]], idle_s: float) -> str:
    """Open one Work stream with 1 s client pings, idle `idle_s`; '' if still open, else
    the status it died with."""
    server = grpc.aio.server(options=server_options)
    pb_grpc.add_HelixWorkerServicer_to_server(_IdleWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    outgoing: asyncio.Queue[pb.WorkBatch | None] = asyncio.Queue()

    async def requests() -> Any:
        while (m := await outgoing.get()) is not None:
            yield m

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=tp.channel_options(1.0)) as ch:
            call = pb_grpc.HelixWorkerStub(ch).Work(requests())
            outgoing.put_nowait(tp.work_batch_pb([], sender="keepalive-test"))
            reader = asyncio.ensure_future(call.__aiter__().__anext__())
            done, _ = await asyncio.wait({reader}, timeout=idle_s)
            if reader in done:
                exc = reader.exception()
                if isinstance(exc, grpc.aio.AioRpcError):
                    return f"{exc.code().name}: {exc.details()}"
                return f"ended: {exc!r}"
            reader.cancel()
            call.cancel()
            return ""
    finally:
        await server.stop(grace=0)


def test_server_accepts_client_keepalive_pings():
    """The old server options (the clients' options, without a ping policy) get the idle
    stream killed with too_many_pings; `server_options` keep it open."""
    old_server = tp.channel_options(1.0)  # what the worker's server used to run with
    died = asyncio.run(_idle_stream_survives(old_server, idle_s=8.0))
    assert "UNAVAILABLE" in died, died  # GOAWAY too_many_pings: the bug, reproduced
    assert asyncio.run(_idle_stream_survives(tp.server_options(1.0), idle_s=8.0)) == ""


def _idle_route(demo_model: Path, tmp: Path, keepalive_s: float, idle_s: float) -> None:
    """Two real workers, a request over n0 -> n1, `idle_s` of silence, another request: the
    n0 -> n1 stream must not have broken in between."""
    env = {"HELIXSERVE_GRPC_KEEPALIVE_S": str(keepalive_s)}
    procs = [start_worker(demo_model, "n0", 0, 15, tmp, env=env),
             start_worker(demo_model, "n1", 15, 30, tmp, env=env)]
    placement = make_placement([("n0", 0, 15), ("n1", 15, 30)],
                               [("coordinator", "n0", 1), ("n0", "n1", 1),
                                ("n1", "coordinator", 1)])

    async def main() -> list[list[int]]:
        coord = await Coordinator.create(make_cluster(procs), placement, demo_model)
        outs = []
        try:
            from helixserve.request import SamplingParams

            for i in range(2):
                req = GenerationRequest(f"k{i}", [1, 2, 3, 4], SamplingParams(temperature=0.0),
                                        max_tokens=4, ignore_eos=True)
                outs.append([ev.token_id async for ev in coord.generate(req)])
                if i == 0:
                    t0 = time.monotonic()
                    await asyncio.sleep(idle_s)
                    assert time.monotonic() - t0 >= idle_s
        finally:
            await coord.close()
        return outs

    try:
        wait_ready(procs)
        first, second = asyncio.run(main())
        assert first == second and len(first) == 4
        log = procs[0].log()
        assert "broke" not in log and "too_many_pings" not in log, log
    finally:
        stop_workers(procs)


def test_idle_worker_route_stays_open(demo_model, tmp_path):
    """1 s pings, 20 s idle (the pings of ~7 minutes at the default 20 s)."""
    _idle_route(demo_model, tmp_path, keepalive_s=1.0, idle_s=20.0)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(os.environ.get("HELIXSERVE_LONG_TESTS") != "1",
                    reason="5.5 minutes idle; set HELIXSERVE_LONG_TESTS=1")
def test_idle_route_survives_5_minutes_at_default_settings(demo_model, tmp_path):
    _idle_route(demo_model, tmp_path, keepalive_s=tp.KEEPALIVE_S, idle_s=330.0)
