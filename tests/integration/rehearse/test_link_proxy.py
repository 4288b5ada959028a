"""The link proxy (helixserve/rehearse/links.py), for real, as the rehearsal and the rig run it:
it shapes bandwidth and latency per directed link, listens on each machine's own loopback
address when a route names one (the rig's 127.0.0.x), and tells its callers apart by the
process that holds their socket, over IPv4 and dual-stack IPv6 (gRPC's) sockets.

Timing checks are ratios of two runs in one test, or lower bounds the proxy cannot beat
(bytes x 8 / bandwidth, the configured latency), never an upper wall-clock bound.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helixserve.rehearse.links import (
    UNATTRIBUTED,
    LinkProxy,
    LinkShape,
    ProxyConfig,
    ProxyRoute,
    SourceResolver,
)

pytestmark = pytest.mark.integration

#: a machine's own loopback address, as the rig gives them (benchmarks/rig/clusters.py)
MACHINE_HOST = "127.0.0.21"
#: bandwidth of a link that only delays: 1 byte pings take no time on the wire
FAST_GBPS = 10.0


def _port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def _sink_and_ack(host: str) -> tuple[asyncio.AbstractServer, int]:
    """A server that answers every chunk ending in b"!" with one byte (an ack per message)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if data.endswith(b"!"):
                writer.write(b"k")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, host, 0)
    return server, server.sockets[0].getsockname()[1]


async def _bulk_s(host: str, port: int, num_bytes: int) -> float:
    """Seconds to push num_bytes through the proxy and get the ack back."""
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.perf_counter()
    writer.write(b"x" * (num_bytes - 1) + b"!")
    await writer.drain()
    await reader.readexactly(1)
    elapsed = time.perf_counter() - t0
    writer.close()
    return elapsed


async def _ping_s(host: str, port: int, rounds: int) -> float:
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.perf_counter()
    for _ in range(rounds):
        writer.write(b"!")
        await writer.drain()
        await reader.readexactly(1)
    elapsed = time.perf_counter() - t0
    writer.close()
    return elapsed


ROUNDS = 3


def test_proxy_rate_limits_and_delays_each_link_as_configured(tmp_path: Path) -> None:
    async def main() -> None:
        server, target = await _sink_and_ack("127.0.0.1")
        machine_server, machine_target = await _sink_and_ack(MACHINE_HOST)
        ports = {n: _port() for n in ("slow", "fast", "near")}
        far_port = _port(MACHINE_HOST)
        # this test process is in no pid table, so its connections come from "coordinator"
        links = {
            ("coordinator", "slow"): LinkShape(0.008, 0.0),   # 1 MB/s
            ("coordinator", "fast"): LinkShape(0.016, 0.0),   # 2 MB/s
            ("coordinator", "near"): LinkShape(FAST_GBPS, 5.0),
            ("near", "coordinator"): LinkShape(FAST_GBPS, 5.0),
            ("coordinator", "far"): LinkShape(FAST_GBPS, 20.0),
            ("far", "coordinator"): LinkShape(FAST_GBPS, 20.0),
        }
        # "far" is a machine on its own address (as in the rig): listens and forwards there
        routes = [ProxyRoute(n, p, target) for n, p in ports.items()]
        routes.append(ProxyRoute("far", far_port, machine_target, host=MACHINE_HOST))
        proxy = LinkProxy(ProxyConfig(routes, links, {}, str(tmp_path / "stats.json")))
        await proxy.start()
        try:
            size = 300_000
            # the best of ROUNDS: a busy host only adds time, the shaping sets the floor
            slow = fast = near = far = float("inf")
            for _ in range(ROUNDS):
                slow = min(slow, await _bulk_s("127.0.0.1", ports["slow"], size))
                fast = min(fast, await _bulk_s("127.0.0.1", ports["fast"], size))
                near = min(near, await _ping_s("127.0.0.1", ports["near"], 8))
                far = min(far, await _ping_s(MACHINE_HOST, far_port, 8))
        finally:
            await proxy.close()
            server.close()
            machine_server.close()
        assert slow >= size * 8 / 0.008e9 * 0.95  # the proxy cannot beat its bandwidth
        assert far >= 8 * 2 * 0.020 * 0.95  # nor its latency, both ways per round
        assert 1.4 < slow / fast < 2.8, (slow, fast)  # twice the bandwidth, half the time
        assert 2.0 < far / near < 5.0, (far, near)  # 4x the latency
        assert proxy.links[("coordinator", "slow")].bytes_sent == size * ROUNDS
        assert proxy.links[("far", "coordinator")].bytes_sent == 8 * ROUNDS

    asyncio.run(main())


def test_proxy_names_the_calling_process() -> None:
    """Loopback callers cannot be told apart by address: the resolver finds the process."""
    listener = socket.socket()
    listener.bind((MACHINE_HOST, 0))
    listener.listen()
    port = listener.getsockname()[1]
    code = (f"import socket, time\ns = socket.socket(socket.{{}})\n"
            f"s.connect(('{{}}', {port}))\ntime.sleep(5)")
    # gRPC connects with dual-stack IPv6 sockets (/proc/net/tcp6), plain clients with IPv4
    children = [
        subprocess.Popen([sys.executable, "-c", code.format("AF_INET", MACHINE_HOST)]),
        subprocess.Popen([sys.executable, "-c", code.format("AF_INET6", f"::ffff:{MACHINE_HOST}")]),
    ]
    resolver = SourceResolver({children[0].pid: "n4", children[1].pid: "n6"}, "coordinator")
    try:
        names = set()
        for _ in children:
            conn, peer = listener.accept()
            # as the proxy does (LinkProxy._source): a miss is looked up again, since on a
            # busy host /proc may list the socket a moment after the connection is accepted
            for _ in range(40):
                name = resolver(peer, listener.getsockname())
                if name != UNATTRIBUTED:
                    break
                time.sleep(0.05)
            names.add(name)
            conn.close()
        assert names == {"n4", "n6"}
        # no socket of that address at all: not credited to anyone's link
        assert resolver(("127.0.0.1", 1)) == UNATTRIBUTED
    finally:
        for c in children:
            c.kill()
            c.wait()
        listener.close()
