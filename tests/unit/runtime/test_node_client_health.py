"""NodeClient.check_alive: the health check's deadline is the caller's, and a node that
misses it, or is not SERVING, is reported down once."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from helixserve.runtime import node_client


class FakeHealth:
    """HealthStub stand-in: records each Check's deadline, answers `status` or raises."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.deadlines: list[float] = []

    async def Check(self, request: Any, timeout: float) -> Any:  # noqa: N802 (gRPC's name)
        self.deadlines.append(timeout)
        if self.status is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "deadline exceeded")
        return health_pb2.HealthCheckResponse(status=self.status)


@pytest.mark.parametrize(("status", "ok", "reason"), [
    (health_pb2.HealthCheckResponse.SERVING, True, None),
    (health_pb2.HealthCheckResponse.NOT_SERVING, False, "health: not SERVING (draining?)"),
    (None, False, "health check failed: DEADLINE_EXCEEDED"),
])
def test_check_alive_uses_the_callers_deadline(monkeypatch: pytest.MonkeyPatch,
                                               status: int | None, ok: bool,
                                               reason: str | None) -> None:
    fake = FakeHealth(status)
    monkeypatch.setattr(node_client.health_pb2_grpc, "HealthStub", lambda channel: fake)
    downs: list[tuple[str, str]] = []
    client = node_client.NodeClient("n3", "127.0.0.1:1", 0, 4, "coord",
                                    lambda *a: None, lambda n, r: downs.append((n, r)))
    client.alive, client._channel = True, object()  # type: ignore[assignment]
    assert asyncio.run(client.check_alive(12.5)) is ok
    assert fake.deadlines == [12.5]
    assert client.alive is ok
    assert downs == ([] if ok else [("n3", reason)])
    # a node already down is not asked again, nor reported twice
    if not ok:
        assert asyncio.run(client.check_alive(12.5)) is False
        assert fake.deadlines == [12.5] and len(downs) == 1
