"""The link proxy's window (rehearse/links.py, module doc "Backpressure"): a link takes no
more from its connections while a window of real bytes (sent + declared) waits to be
serialized, so a sender's flow control pushes back as on a real link, and a control frame
behind the data (a gRPC keepalive PING's ACK) waits behind at most about a window. Without it
a slow link's FIFO took all a sender wrote at once (issue 27: minutes of backlog, keepalive
timeouts, re-routes). Times are the FIFO's own arithmetic or the link's counters, never a
wall-clock bound."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

from helixserve.rehearse import links as links_mod
from helixserve.rehearse.links import (
    CHUNK_BYTES,
    PIECE_GAP_S,
    PIECE_MIN_BYTES,
    UNLIMITED,
    WINDOW_BYTES,
    Link,
    LinkProxy,
    LinkShape,
    ProxyConfig,
    ProxyRoute,
    TlsRecordEnds,
    TlsRecords,
    read_stats,
)
from helixserve.runtime import transport as tp

#: 0.008 Gbit/s = 1 MB/s
MB_PER_S = LinkShape(bandwidth_gbps=0.008, latency_ms=0.0)


def test_a_link_takes_the_next_chunk_once_less_than_a_window_waits():
    link = Link(MB_PER_S, window_bytes=100_000)
    assert link.room_at_s(0.0) == 0.0  # idle: at once
    link.schedule(300_000, now_s=0.0)  # 0.3 s of serialization queued
    # room once 100 kB are left: at 0.2 s
    assert link.room_at_s(0.0) == pytest.approx(0.2)
    assert link.room_at_s(0.25) == 0.25
    assert link.backlog_bytes(0.1) == 200_000 and link.backlog_bytes(0.5) == 0
    # declared bytes count in the backlog, and leave with the next chunk taken
    link.declare(50_000)
    assert link.backlog_bytes(0.3) == 50_000
    assert link.room_at_s(0.3) == 0.3  # they must not block the chunk that carries them
    link.schedule(1_000, now_s=0.3)
    assert link.backlog_bytes(0.3) == 51_000 and link.pending_bytes == 0


def test_unbounded_or_unlimited_links_never_hold_a_chunk_back():
    unbounded = Link(MB_PER_S, window_bytes=None)
    unbounded.schedule(10**7, now_s=0.0)
    assert unbounded.room_at_s(1.0) == 1.0
    free = Link(UNLIMITED, window_bytes=1)
    free.schedule(10**9, now_s=0.0)
    assert free.room_at_s(0.0) == 0.0 and free.backlog_bytes(0.0) == 0


def test_the_default_window_is_a_few_mib_and_round_trips_through_json(tmp_path):
    assert 1 << 20 <= WINDOW_BYTES <= 16 << 20
    config = ProxyConfig([ProxyRoute("n0", 1, 2)], {}, {}, str(tmp_path / "s.json"))
    assert config.window_bytes == WINDOW_BYTES
    assert ProxyConfig.from_json(config.to_json()).window_bytes == WINDOW_BYTES
    config.window_bytes = None
    assert ProxyConfig.from_json(config.to_json()).window_bytes is None


def test_unsized_declared_bytes_are_never_held_back():
    """Held back, the next chunk would gather the debts of every batch declared meanwhile;
    sized ones ride on their own bytes, so the window holds those back."""
    link = Link(MB_PER_S, window_bytes=100_000)
    link.schedule(300_000, now_s=0.0)
    link.declare(50_000, wire_bytes=500)
    assert link.room_at_s(0.0) == pytest.approx(0.2)
    link.declare(50_000)
    assert link.room_at_s(0.0) == 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.read(65536):
        pass
    writer.close()


async def _flood(window_bytes: int | None, total: int, declare_each: int,
                 tmp_path) -> tuple[int, dict]:
    """Write `total` bytes (in messages of CHUNK_BYTES, each declaring `declare_each` more
    before it is written, as a worker does) through a 1 MB/s link, then let the proxy read
    for half a second; the largest backlog a chunk found when the link took it, and the
    stats."""
    target = await asyncio.start_server(_sink, "127.0.0.1", 0)
    listen = _free_port()
    ledger = f"helix-test-window-{os.getpid()}-{window_bytes}"
    config = ProxyConfig([ProxyRoute("n0", listen, target.sockets[0].getsockname()[1])],
                         {("n1", "n0"): LinkShape(0.008, 1.0)}, {},
                         str(tmp_path / "stats.json"), ledger=ledger,
                         window_bytes=window_bytes)
    proxy = LinkProxy(config, resolve=lambda peer: "n1")
    found: list[int] = []
    real_schedule = Link.schedule

    def schedule(link: Link, num_bytes: int, now_s: float, records: Any = None) -> float:
        if link.shape.limited:
            # queued to serialize (declared bytes not yet on a chunk are not queued yet)
            found.append(round(max(0.0, link.free_at_s - now_s) * link.bytes_per_s))
        return real_schedule(link, num_bytes, now_s, records)

    await proxy.start()
    sender = tp.LinkLedger(ledger)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Link, "schedule", schedule)
            _, writer = await asyncio.open_connection("127.0.0.1", listen)
            message = b"x" * CHUNK_BYTES
            for _ in range(total // CHUNK_BYTES):
                if declare_each:  # sized: the message's bytes on the wire as a 4th line
                    sender.sock.sendto(f"n1\n127.0.0.1:{listen}\n{declare_each}\n"
                                       f"{CHUNK_BYTES}".encode(), sender.address)
                writer.write(message)
                await writer.drain()
                await asyncio.sleep(0)  # the proxy, in this loop, takes the datagram
            # the kernel took it all; the proxy reads what the link lets it
            for _ in range(50):
                await asyncio.sleep(0.01)
            proxy.write_stats()
            writer.close()
    finally:
        await proxy.close()
        target.close()
    return max(found), read_stats(config.stats_path)[1]["n1->n0"]


def test_a_flooding_sender_finds_at_most_a_window_queued(tmp_path):
    window = 256 * 1024
    most, stats = asyncio.run(_flood(window, 4 * 1024 * 1024, 0, tmp_path))
    assert most < window + CHUNK_BYTES
    # what it wrote and the link has not yet taken waits in the sockets, not on the link
    assert stats["bytes"] < 4 * 1024 * 1024
    assert stats["backlog_bytes"] <= window + CHUNK_BYTES
    # without the window the proxy reads as fast as the sender writes: the backlog a chunk
    # finds grows with what was written (issue 27's minutes of queue on slow links)
    unbounded, _ = asyncio.run(_flood(None, 4 * 1024 * 1024, 0, tmp_path))
    assert unbounded > 4 * (window + CHUNK_BYTES)


def test_declared_bytes_fill_the_window_too(tmp_path):
    """Messages small on the wire with many declared bytes each (the emulated payload,
    sized declarations): the window counts real bytes, so the link takes few at a time."""
    window = 256 * 1024
    most, stats = asyncio.run(_flood(window, 32 * CHUNK_BYTES, 4 * CHUNK_BYTES, tmp_path))
    # one message's declared bytes may ride on top of the window, never several
    assert most < window + 6 * CHUNK_BYTES
    assert 0 < stats["declared_bytes"] <= 32 * 4 * CHUNK_BYTES
    assert stats["wire_bytes"] < 16 * CHUNK_BYTES  # the rest waits in the sockets
    unbounded, _ = asyncio.run(_flood(None, 32 * CHUNK_BYTES, 4 * CHUNK_BYTES, tmp_path))
    assert unbounded > 4 * (window + 6 * CHUNK_BYTES)
    assert links_mod.WINDOW_BYTES == WINDOW_BYTES


def test_a_long_chunk_arrives_in_pieces_over_its_serialization_the_last_on_time():
    link = Link(MB_PER_S, window_bytes=None)
    data = os.urandom(64 * 1024)
    link.declare(4_000_000)  # 4 s of declared bytes ride on this chunk
    pieces = link.pieces(data, now_s=10.0)
    serialize_s = (len(data) + 4_000_000) / 1e6
    assert b"".join(p for _, p in pieces) == data  # in order, nothing lost
    assert len(pieces) == len(data) // PIECE_MIN_BYTES == 3
    assert all(len(p) >= PIECE_MIN_BYTES for _, p in pieces)
    times = [t for t, _ in pieces]
    assert times[-1] == pytest.approx(10.0 + serialize_s)  # as `schedule` says, undivided
    assert times == sorted(times)
    assert times[0] == pytest.approx(10.0 + serialize_s / 3)  # evenly over the link's time
    # the next chunk queues behind the whole of it
    assert link.schedule(1000, now_s=10.0) == pytest.approx(10.0 + serialize_s + 0.001)


def test_a_short_or_small_chunk_arrives_whole():
    link = Link(MB_PER_S, window_bytes=None)
    quick = os.urandom(int(PIECE_GAP_S * 1e6) // 2)  # half the gap on the wire
    assert len(link.pieces(quick, now_s=0.0)) == 1
    small = b"x" * (PIECE_MIN_BYTES + 10)  # one TLS record's worth: never cut
    link.declare(10_000_000)
    assert len(link.pieces(small, now_s=100.0)) == 1
    assert len(Link(UNLIMITED).pieces(os.urandom(10**6), now_s=0.0)) == 1


def test_a_sized_declaration_rides_on_its_own_messages_bytes_not_the_next_chunk():
    """A sender that ran ahead: three messages of 30 kB on the wire, 2 MB declared each,
    read as one 64 KiB chunk and then the rest. Sized, the first chunk carries the debts of
    the messages it holds (two whole, a part of the third), the rest comes with the rest;
    unsized, all of it rides on the first chunk (issue 27's lumps)."""
    sized = Link(MB_PER_S)
    for _ in range(3):
        sized.declare(2_000_000, wire_bytes=30_000)
    first = 64 * 1024
    part = 2_000_000 * (first - 60_000) // 30_000
    sized.schedule(first, now_s=0.0)
    assert sized.free_at_s == pytest.approx((first + 4_000_000 + part) / 1e6)
    assert sized.backlog_bytes(sized.free_at_s) == 2_000_000 - part  # still due
    sized.schedule(90_000 - first, now_s=sized.free_at_s)
    assert sized.backlog_bytes(0.0) == 90_000 + 6_000_000 and not sized.debts
    lumped = Link(MB_PER_S)
    for _ in range(3):
        lumped.declare(2_000_000)
    lumped.schedule(first, now_s=0.0)
    assert lumped.free_at_s == pytest.approx((first + 6_000_000) / 1e6)
    assert sized.bytes_declared == lumped.bytes_declared == 6_000_000


def test_the_ledger_takes_a_wire_size_as_a_fourth_line(tmp_path):
    config = ProxyConfig([ProxyRoute("n0", 4321, 1)], {("n1", "n0"): MB_PER_S}, {},
                         str(tmp_path / "s.json"))
    proxy = LinkProxy(config, resolve=lambda peer: "n1")
    proxy.declared(b"n1\n127.0.0.1:4321\n1000\n50")
    proxy.declared(b"n1\n127.0.0.1:4321\n700")
    link = proxy.links[("n1", "n0")]
    assert list(link.debts) == [[1000, 50]] and link.pending_bytes == 700
    proxy.declared(b"n1\n127.0.0.1:4321\n1000\n50\n9")
    assert proxy.undeclared == {"malformed": 1} and link.bytes_declared == 1700


def test_a_held_back_connection_takes_its_next_chunk_when_unsized_bytes_are_declared():
    """The pump waits for room or a declaration, whichever comes first."""

    async def main() -> tuple[float, float]:
        link = Link(MB_PER_S, window_bytes=1000)
        link.schedule(1_000_000, now_s=asyncio.get_running_loop().time())  # ~1 s queued
        reader = asyncio.StreamReader()
        reader.feed_data(b"x" * 100)
        reader.feed_eof()

        class Sink:
            def write(self, data: bytes) -> None:
                pass

            async def drain(self) -> None:
                pass

            def write_eof(self) -> None:
                pass

        proxy = LinkProxy(ProxyConfig([], {}, {}, "unused"), resolve=lambda peer: "n1")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        pump = asyncio.ensure_future(proxy._pump(reader, Sink(), link))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert link.chunks == 1  # held back: the link has ~1 s queued
        link.declare(10)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if link.chunks == 2:
                break
        taken_s = loop.time() - t0
        pump.cancel()
        return taken_s, link.free_at_s - t0

    taken_s, queued_s = asyncio.run(main())
    assert taken_s < queued_s / 2  # taken on the declaration, not when the room came


def test_a_slow_caller_lookup_does_not_hold_back_the_other_links(tmp_path):
    """Finding a caller reads /proc (tens of ms on a loaded host, for each of the dozens of
    connections a cold start opens): it runs on a thread, so a connection already open keeps
    delivering meanwhile. On the event loop, every link stalled for each lookup. The lookup
    here waits until the open connection's echo came back (with a deadlock breaker: on the
    event loop the echo cannot come, and the lookup gives up)."""
    import threading

    started, released = threading.Event(), threading.Event()
    outcome: dict[str, bool] = {}
    calls = []

    def resolve(peer):  # type: ignore[no-untyped-def]
        calls.append(peer)
        if len(calls) == 1:
            return "n1"
        started.set()
        outcome["released"] = released.wait(10.0)
        return "n2"

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def main() -> None:
        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            listen = s.getsockname()[1]
        config = ProxyConfig([ProxyRoute("n0", listen, target.sockets[0].getsockname()[1])],
                             {("n1", "n0"): LinkShape(10.0, 0.5)}, {},
                             str(tmp_path / "stats.json"))
        proxy = LinkProxy(config, resolve=resolve)
        await proxy.start()
        try:
            r1, w1 = await asyncio.open_connection("127.0.0.1", listen)
            w1.write(b"a" * 1000)
            assert await r1.readexactly(1000) == b"a" * 1000  # connection A is open
            _, w2 = await asyncio.open_connection("127.0.0.1", listen)  # B: a slow lookup
            await asyncio.to_thread(started.wait, 10.0)
            w1.write(b"b" * 1000)  # A again, while B's caller is being looked up
            assert await r1.readexactly(1000) == b"b" * 1000
            released.set()
            for w in (w1, w2):
                w.close()
        finally:
            released.set()
            await proxy.close()
            target.close()

    asyncio.run(main())
    assert outcome == {"released": True}


def test_a_small_message_read_with_a_large_one_arrives_when_its_own_bytes_have_crossed():
    """A decode step's small message and the next prefill chunk's message, read from the
    socket in one chunk: the small one's bytes arrive once they and their own declared bytes
    are serialized (the simulator's FIFO), the large one's later; the whole chunk arriving
    with its last byte made every decode message on a busy slow link wait for the megabytes
    read with it (helix-geo-24)."""
    link = Link(MB_PER_S)  # 1 MB/s, no latency
    link.declare(100_000, 100)  # a decode message: 100 bytes on the wire, 0.1 MB declared
    link.declare(8_000_000, 40_000)  # a prefill chunk's: 40 kB on the wire, 8 MB declared
    pieces = link.pieces(b"d" * 100 + b"p" * 40_000, now_s=0.0)
    assert pieces[0] == (pytest.approx(0.1001), b"d" * 100)
    assert b"".join(data for _, data in pieces) == b"d" * 100 + b"p" * 40_000
    assert pieces[-1][0] == pytest.approx(8.1401)  # the chunk's last byte: as before
    # the prefill message's bytes arrive over its own serialization, in pieces no smaller
    # than a TLS record
    assert [at for at, _ in pieces[1:]] == pytest.approx([0.1001 + 8.04 / 2, 8.1401])
    assert all(len(data) >= PIECE_MIN_BYTES for _, data in pieces[1:])


def _records(*lengths: int) -> bytes:
    """TLS application-data records with bodies of `lengths` bytes."""
    return b"".join(bytes([23, 3, 3]) + n.to_bytes(2, "big") + b"r" * n for n in lengths)


def test_tls_records_are_followed_across_chunks_and_plain_bytes_are_not_taken_for_them():
    stream = _records(100, 40, 300)  # ends at 105, 150, 455
    tracker = TlsRecords()
    first = tracker.feed(stream[:103])
    assert first == TlsRecordEnds((), 2)  # the first record's last 2 bytes are still to come
    assert tracker.feed(stream[103:152]) == TlsRecordEnds((2, 47), 3)  # and 2 of a header
    assert tracker.feed(stream[152:]) == TlsRecordEnds((303,), 0)
    cut = TlsRecords()
    assert cut.feed(stream[:107]) == TlsRecordEnds((105,), 3)  # 2 of a header: 3 more at least
    plain = TlsRecords()
    assert plain.feed(b"GET / HTTP/1.1\r\n") is None and plain.feed(stream) is None


def test_a_message_ends_with_its_last_tls_record_whatever_its_declaration_left_out():
    """A decode message that flow control split (a frame and a TLS record more, 31 bytes its
    declaration does not name) read in one chunk with the next prefill chunk's message: with
    the chunk's record ends, its last bytes arrive with it; by the named sizes alone they
    would wait for the prefill chunk's declared megabytes, and the receiver cannot use the
    message before its last byte."""
    decode = _records(40, 86)  # split in two records: 136 bytes, declared as 105
    prefill = _records(16_000, 16_000, 8_000)
    for with_records, decode_done_s in ((True, 0.100136), (False, None)):
        link = Link(MB_PER_S)
        link.declare(100_000, 105)
        link.declare(8_000_000, len(prefill))
        data = decode + prefill
        records = TlsRecords().feed(data) if with_records else None
        pieces = link.pieces(data, now_s=0.0, records=records)
        assert b"".join(p for _, p in pieces) == data
        arrived, at_s = 0, 0.0
        for piece_s, piece in pieces:  # when the decode message's last byte arrives
            arrived += len(piece)
            at_s = piece_s
            if arrived >= len(decode):
                break
        if decode_done_s is not None:
            assert at_s == pytest.approx(decode_done_s)  # its own bytes and debt: 0.1 s
        else:
            assert at_s > 1.0  # with part of the prefill chunk's 8 MB
        # either way the link charges the same, and the chunk's last byte is on time
        assert pieces[-1][0] == pytest.approx((len(data) + 8_100_000) / 1e6)
        assert not link.debts


def test_the_rest_of_a_messages_last_record_in_the_next_chunk_is_still_that_messages():
    link = Link(MB_PER_S)
    message = _records(16_000, 500)  # 16,510 bytes, named as 16,400: the last record runs on
    link.declare(1_000_000, 16_400)
    link.declare(2_000_000, 105)
    tracker = TlsRecords()
    link.pieces(message[:16_450], 0.0, tracker.feed(message[:16_450]))
    assert link.record_rest == 60 and len(link.debts) == 1  # the first debt paid
    rest = message[16_450:] + _records(100)
    pieces = link.pieces(rest, 0.0, tracker.feed(rest))
    # the first 60 bytes finish the first message: they carry no declared bytes
    assert pieces[0][1] == rest[:60] and pieces[0][0] < 1.1
    assert pieces[-1][0] == pytest.approx((16_450 + 1_000_000 + 60 + 105 + 2_000_000) / 1e6)
