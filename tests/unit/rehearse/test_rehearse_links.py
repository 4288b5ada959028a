"""The rehearsal's link emulation (helixserve/rehearse/links.py): the FIFO's arithmetic, the
link table read from a cluster file (NIC caps, regions, time scale), the proxy's byte
counters per directed link on a real loopback connection, and the lookup of the calling
process. No wall-clock bounds: times are the ones the FIFO computes."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from helixserve.rehearse import links as links_mod
from helixserve.rehearse.links import (
    UNATTRIBUTED,
    UNLIMITED,
    Link,
    LinkProxy,
    LinkShape,
    ProxyConfig,
    ProxyRoute,
    SourceResolver,
    link_table,
    pid_holding,
    read_stats,
    read_unattributed,
    socket_inode,
)
from helixserve.spec.cluster import parse_cluster


def test_fifo_serializes_at_the_bandwidth_then_adds_the_latency():
    link = Link(LinkShape(bandwidth_gbps=0.008, latency_ms=10.0))  # 1 MB/s
    # 1000 bytes take 1 ms on the wire, then 10 ms in flight
    assert link.schedule(1000, now_s=0.0) == pytest.approx(0.011)
    # handed over at once behind it: waits for the first to leave the wire
    assert link.schedule(1000, now_s=0.0) == pytest.approx(0.012)
    # handed over after the link is idle again: no wait
    assert link.schedule(500, now_s=1.0) == pytest.approx(1.0 + 0.0005 + 0.010)
    assert link.bytes_sent == 2500 and link.chunks == 3


def test_unlimited_link_delivers_at_once_and_still_counts():
    link = Link(UNLIMITED)
    assert link.schedule(10**9, now_s=5.0) == 5.0
    assert link.bytes_sent == 10**9


CLUSTER = {
    "name": "two-regions",
    "nodes": [
        {"name": "e1", "gpu": "L4", "region": "east", "nic_gbps": 4},
        {"name": "e2", "gpu": "L4", "region": "east"},
        {"name": "w1", "gpu": "T4", "region": "west"},
        {"name": "x1", "gpu": "T4", "region": "far"},
    ],
    "coordinator": {"region": "east"},
    "links": {
        "default": {"bandwidth_gbps": 10, "latency_ms": 1},
        "between_regions": [
            {"a": "east", "b": "west", "bandwidth_gbps": 0.1, "latency_ms": 50},
            {"a": "east", "b": "far", "bandwidth_gbps": 0},
        ],
        "explicit": [{"src": "w1", "dst": "e2", "bandwidth_gbps": 0.2, "latency_ms": 40}],
    },
}


def test_link_table_is_the_cluster_files_links_capped_by_nics_and_time_scaled():
    cluster = parse_cluster(CLUSTER)
    names = ["coordinator", "e1", "e2", "w1", "x1"]
    table = link_table(cluster, names)
    assert table[("e2", "e1")] == LinkShape(4.0, 1.0)  # e1's NIC caps the 10 Gbit/s link
    assert table[("coordinator", "e2")] == LinkShape(10.0, 1.0)
    assert table[("e2", "w1")] == LinkShape(0.1, 50.0)  # between regions
    assert table[("w1", "e2")] == LinkShape(0.2, 40.0)  # explicit, directed
    assert ("e1", "x1") not in table and ("x1", "coordinator") not in table  # no link
    slow = link_table(cluster, names, time_scale=4.0)
    assert slow[("e2", "w1")] == LinkShape(0.025, 200.0)


def test_config_round_trips_through_json(tmp_path):
    config = ProxyConfig([ProxyRoute("n0", 1234, 5678)], {("coordinator", "n0"): LinkShape(1, 2)},
                         {42: "n0"}, str(tmp_path / "s.json"), max_seconds=9.0)
    back = ProxyConfig.from_json(config.to_json())
    assert back == config
    # a route on a machine's own loopback address (the rig's 127.0.0.x)
    config.routes.append(ProxyRoute("n1", 1235, 5679, host="127.0.0.21"))
    back = ProxyConfig.from_json(config.to_json())
    assert back == config and back.routes[1].host == "127.0.0.21"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that sends back what it reads."""
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_proxy_forwards_and_counts_bytes_per_directed_link(tmp_path):
    """An echo server behind the proxy; the caller is told to be `n1`: what it sends counts
    on n1 -> n0, the echo on n0 -> n1; a pair without a link is forwarded, marked unlinked."""

    async def main() -> dict:
        target = await asyncio.start_server(_echo, "127.0.0.1", 0)
        target_port = target.sockets[0].getsockname()[1]
        listen = _free_port()
        config = ProxyConfig([ProxyRoute("n0", listen, target_port)],
                             {("n1", "n0"): LinkShape(10.0, 0.5)}, {},
                             str(tmp_path / "stats.json"))
        proxy = LinkProxy(config, resolve=lambda peer: "n1")
        await proxy.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            payload = os.urandom(300_000)
            writer.write(payload)
            await writer.drain()
            got = await reader.readexactly(len(payload))
            assert got == payload
            writer.close()
            proxy.write_stats()
        finally:
            await proxy.close()
            target.close()
        return read_stats(config.stats_path)[1]

    stats = asyncio.run(main())
    assert stats["n1->n0"]["bytes"] == 300_000 and stats["n1->n0"]["connections"] == 1
    assert stats["n1->n0"]["bandwidth_gbps"] == 10.0 and "unlinked" not in stats["n1->n0"]
    # the reply direction has no link in the table: forwarded without limits, and flagged
    assert stats["n0->n1"]["bytes"] == 300_000 and stats["n0->n1"]["unlinked"] is True


def test_caller_is_found_by_the_process_holding_its_socket():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client = socket.create_connection(server.getsockname())
        conn, peer = server.accept()
        try:
            called = server.getsockname()  # as the proxy asks: the port alone may be reused
            inode = socket_inode(*peer, called)
            assert inode is not None
            assert pid_holding(inode, [os.getpid()]) == os.getpid()
            assert SourceResolver({os.getpid(): "n7"}, "coordinator")(peer, called) == "n7"
            assert SourceResolver({}, "coordinator")(peer, called) == "coordinator"
        finally:
            conn.close()
            client.close()


def test_a_socket_found_nowhere_is_unattributed_not_the_coordinators():
    """Only a caller whose socket is found, and held by none of the workers, is the other
    source (the coordinator); one not found at all (a missed /proc row) is UNATTRIBUTED."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client = socket.create_connection(server.getsockname())
        conn, peer = server.accept()
        try:
            assert SourceResolver({}, "coordinator")(peer) == "coordinator"
        finally:
            conn.close()
            client.close()
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    assert socket_inode("127.0.0.1", port) is None
    assert SourceResolver({os.getpid(): "n7"}, "coordinator")(("127.0.0.1", port)) == UNATTRIBUTED


def _run_proxy(tmp_path, resolve, payload_bytes: int = 50_000) -> tuple[dict, dict]:
    async def main() -> None:
        target = await asyncio.start_server(_echo, "127.0.0.1", 0)
        listen = _free_port()
        config = ProxyConfig([ProxyRoute("n9", listen, target.sockets[0].getsockname()[1])],
                             {("coordinator", "n9"): LinkShape(10.0, 0.0),
                              ("n1", "n9"): LinkShape(10.0, 0.0)}, {},
                             str(tmp_path / "stats.json"))
        proxy = LinkProxy(config, resolve=resolve)
        await proxy.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            writer.write(bytes(payload_bytes))
            await writer.drain()
            await reader.readexactly(payload_bytes)
            writer.close()
            proxy.write_stats()
        finally:
            await proxy.close()
            target.close()

    asyncio.run(main())
    return read_stats(tmp_path / "stats.json")[1], read_unattributed(tmp_path / "stats.json")


@pytest.mark.parametrize(("answers", "credited"), [
    # a worker's socket missed twice, then found: its own link
    ([UNATTRIBUTED, UNATTRIBUTED, "n1"], "n1"),
    # found, but the pid scan missed it once: still the worker's
    (["coordinator", "n1"], "n1"),
    # found and held by no worker every time: the coordinator's
    (["coordinator"] * 20, "coordinator"),
    # never found: counted apart, not on the coordinator's link
    ([UNATTRIBUTED] * 20, UNATTRIBUTED),
])
def test_a_missed_lookup_is_retried_and_never_credited_to_the_coordinator(
        tmp_path, monkeypatch: pytest.MonkeyPatch, answers: list[str], credited: str) -> None:
    monkeypatch.setattr(links_mod, "RESOLVE_RETRY_S", 0.0)
    asked: list[tuple[str, int]] = []

    def resolve(peer: tuple[str, int]) -> str:
        asked.append(peer)
        return answers[min(len(asked), len(answers)) - 1]

    stats, apart = _run_proxy(tmp_path, resolve)
    if credited == UNATTRIBUTED:
        assert set(stats) == set()  # neither coordinator->n9 nor any other link
        assert apart == {"n9": {"bytes_in": 50_000, "bytes_out": 50_000, "connections": 1}}
        assert len(asked) == 1 + links_mod.RESOLVE_RETRIES + links_mod.MISS_RETRIES
    else:
        assert set(stats) == {f"{credited}->n9", f"n9->{credited}"} and apart == {}
        assert stats[f"{credited}->n9"]["bytes"] == 50_000
        assert stats[f"{credited}->n9"]["connections"] == 1
