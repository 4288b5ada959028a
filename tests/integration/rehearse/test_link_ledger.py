"""The link proxy charges bytes a sender declares (a smaller activation payload; engine/
emulated.py, rehearse/links.py) as if they had been sent: on a slow link, a small message
declared with K more bytes takes about as long as K bytes sent for real, and far longer than
the small message alone. Ratios of runs in one test, the best of ROUNDS each (a busy host
only adds time), never a wall-clock bound.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from pathlib import Path

import pytest

from helixserve.rehearse.links import LinkProxy, LinkShape, ProxyConfig, ProxyRoute
from helixserve.runtime import transport as tp

pytestmark = pytest.mark.integration

#: 0.004 Gbit/s: 500 kB/s, so 200 kB take 0.4 s on the wire
SLOW_GBPS = 0.004
DECLARED = 200_000
PAYLOAD = 64
ROUNDS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _sink_and_ack() -> tuple[asyncio.AbstractServer, int]:
    """A server that answers every chunk ending in b"!" with one byte (an ack per message)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if data.endswith(b"!"):
                writer.write(b"k")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _message_s(port: int, num_bytes: int, declare: int = 0,
                     ledger: tp.LinkLedger | None = None) -> float:
    """Seconds from declaring `declare` bytes (as a worker does, just before it writes) and
    writing a message of `num_bytes` to its ack."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"?")  # open the link's FIFO for this connection: the proxy knows its source
    await writer.drain()
    await asyncio.sleep(0.2)
    t0 = time.perf_counter()
    if declare:
        assert ledger is not None
        ledger.declare("n1", f"127.0.0.1:{port}", declare)
    writer.write(b"x" * (num_bytes - 1) + b"!")
    await writer.drain()
    await reader.readexactly(1)
    elapsed = time.perf_counter() - t0
    writer.close()
    return elapsed


def test_declared_bytes_take_the_time_of_sent_ones(tmp_path: Path) -> None:
    name = f"helixserve-test-{uuid.uuid4().hex}"

    async def main() -> tuple[float, float, float, LinkProxy]:
        server, target = await _sink_and_ack()
        listen = _port()
        config = ProxyConfig([ProxyRoute("n0", listen, target)],
                             {("n1", "n0"): LinkShape(SLOW_GBPS, 0.0)}, {},
                             str(tmp_path / "stats.json"), ledger=name)
        proxy = LinkProxy(config, resolve=lambda peer: "n1")  # every caller is n1
        await proxy.start()
        ledger = tp.LinkLedger(name)
        try:
            real = declared = small = float("inf")
            for _ in range(ROUNDS):
                real = min(real, await _message_s(listen, DECLARED + PAYLOAD))
                declared = min(declared, await _message_s(listen, PAYLOAD, DECLARED, ledger))
                small = min(small, await _message_s(listen, PAYLOAD))
        finally:
            ledger.sock.close()
            await proxy.close()
            server.close()
        return real, declared, small, proxy

    real, declared, small, proxy = asyncio.run(main())
    assert declared >= DECLARED * 8 / (SLOW_GBPS * 1e9) * 0.95  # cannot beat the bandwidth
    assert 0.8 < declared / real < 1.25, (declared, real)
    assert small < 0.25 * declared, (small, declared)
    link = proxy.links[("n1", "n0")]
    assert link.bytes_declared == ROUNDS * DECLARED and link.pending_bytes == 0
    assert link.bytes_sent == ROUNDS * (DECLARED + 3 * PAYLOAD + 3)
    assert proxy.stats()["n1->n0"]["bytes"] == link.bytes_sent + link.bytes_declared
