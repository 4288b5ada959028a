"""The stream data plane's pieces without processes (runtime/dataplane.py): its selection by
environment, its frames, and a sender and a receiver in one loop over a socket pair."""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from types import SimpleNamespace

import pytest

from helixserve.errors import UserError
from helixserve.runtime import dataplane
from helixserve.runtime import transport as tp
from helixserve.runtime.peers import Outgoing, OutQueue
from helixserve.runtime.proto import helix_pb2 as pb


def test_the_data_plane_is_grpc_unless_the_environment_says_stream() -> None:
    assert dataplane.dataplane_kind({}) == "grpc"
    assert dataplane.dataplane_kind({dataplane.DATAPLANE_ENV: ""}) == "grpc"
    assert dataplane.dataplane_kind({dataplane.DATAPLANE_ENV: "stream"}) == "stream"
    with pytest.raises(ValueError, match=r"HELIXSERVE_DATAPLANE: unknown data plane 'tcp'; "
                                         r"known: grpc, stream"):
        dataplane.dataplane_kind({dataplane.DATAPLANE_ENV: "tcp"})


def test_a_bad_data_plane_stops_the_worker_with_one_line(monkeypatch) -> None:
    from helixserve.runtime import worker as worker_mod

    monkeypatch.setenv(dataplane.DATAPLANE_ENV, "udp")
    with pytest.raises(UserError, match="HELIXSERVE_DATAPLANE: unknown data plane 'udp'"):
        worker_mod._dataplane_kind()


def test_magic_is_neither_tls_nor_http2() -> None:
    assert not dataplane.MAGIC.startswith(b"\x16\x03")
    assert not b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".startswith(dataplane.MAGIC)
    assert dataplane.split_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert dataplane.split_address("[::1]:5000") == ("::1", 5000)


def test_frames_round_trip_and_an_oversized_one_is_refused(monkeypatch) -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(dataplane.frame(dataplane.DATA, b"abc") + dataplane.frame(dataplane.PING))
        assert await dataplane.read_frame(reader) == (dataplane.DATA, b"abc")
        assert await dataplane.read_frame(reader) == (dataplane.PING, b"")
        monkeypatch.setattr(tp, "MAX_MESSAGE_BYTES", 10)
        reader.feed_data(dataplane.HEADER.pack(11, dataplane.DATA))
        with pytest.raises(dataplane.DataPlaneError, match="a frame of 11 bytes, limit 10"):
            await dataplane.read_frame(reader)
        reader.feed_data(dataplane.HEADER.pack(3, dataplane.DATA) + b"ab")
        reader.feed_eof()
        with pytest.raises(asyncio.IncompleteReadError):
            await dataplane.read_frame(reader)

    asyncio.run(main())


class FakeWorker:
    """What a StreamPeer asks of its worker: counters, errors, the kept routes."""

    def __init__(self) -> None:
        self.node, self.tls, self.kept = "n0", None, {}
        self.errors: list[tuple[str, int, str]] = []
        self.delivered: list[pb.WorkResult] = []
        self.messages = 0

    def count_sent(self, items: int) -> None:
        self.messages += 1

    def report_error(self, request_id: str, step_id: int, coordinator_id: str, code: int,
                     message: str) -> None:
        self.errors.append((request_id, code, message))

    def deliver(self, result: pb.WorkResult, coordinator_id: str, origin: object) -> None:
        self.delivered.append(result)


@pytest.mark.parametrize("write_now_bytes", [dataplane.WRITE_NOW_BYTES, 0])
def test_a_stream_peer_sends_batches_and_reports_its_items_when_the_next_hop_closes(
        monkeypatch: pytest.MonkeyPatch, write_now_bytes: int) -> None:
    """A next hop (this test, on the other end of a socket) reads two batches, sends one
    error back, then closes: the items it was sent are reported UNAVAILABLE. The second
    batch is written by `notify` itself (the writer is parked, its socket has room), or
    with WRITE_NOW_BYTES 0 (a socket buffer never under it) by the woken writer."""
    monkeypatch.setattr(dataplane, "WRITE_NOW_BYTES", write_now_bytes)

    async def main() -> tuple[list[pb.WorkBatch], FakeWorker]:
        server_sock, client_sock = socket.socketpair()
        worker = FakeWorker()
        received: list[pb.WorkBatch] = []
        got_one, got_two = asyncio.Event(), asyncio.Event()

        async def next_hop() -> None:
            reader, writer = await asyncio.open_connection(sock=server_sock)
            assert await reader.readexactly(len(dataplane.MAGIC)) == dataplane.MAGIC
            while len(received) < 2:
                kind, body = await dataplane.read_frame(reader)
                batch = pb.WorkBatch()
                batch.ParseFromString(body)
                received.append(batch)
                got_one.set()
            got_two.set()
            err = pb.ResultBatch(results=[pb.WorkResult(request_id="r0", status_code=14)])
            writer.write(dataplane.frame(dataplane.DATA, err.SerializeToString()))
            await writer.drain()
            writer.close()

        class Peer(dataplane.StreamPeer):
            async def _connect(self):  # the socket pair instead of a TCP connection
                reader, writer = await asyncio.open_connection(sock=client_sock)
                writer.write(dataplane.MAGIC)
                return reader, writer

        hop = asyncio.ensure_future(next_hop())
        peer = Peer.__new__(Peer)
        peer.worker, peer.address, peer.queue = worker, "127.0.0.1:9", OutQueue()
        peer.sent, peer._getter, peer.queued_tokens = deque(maxlen=100), None, 0
        for i in range(2):  # one engine step's items: one message
            peer.queue.put_nowait(Outgoing(tp.continuation_to_pb(f"r{i}", 7, 3, [5]), "c"))
        task = asyncio.ensure_future(peer._run())
        await asyncio.wait_for(got_one.wait(), 10)
        peer.queue.put_nowait(Outgoing(tp.continuation_to_pb("r2", 7, 3, [5]), "c"))
        peer.notify()  # the worker's, once a step's items are queued
        # written in this very turn, or left to the woken writer (socket buffer "full")
        assert (worker.messages, peer.queue.empty()) == (
            (2, True) if write_now_bytes else (1, False))
        await asyncio.wait_for(got_two.wait(), 10)
        await hop
        for _ in range(100):
            if worker.errors:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        return received, worker

    received, worker = asyncio.run(main())
    assert received[0].hello.sender == "n0"
    assert [len(b.items) for b in received] == [2, 1] and not received[1].HasField("hello")
    assert worker.messages == 2
    assert [r.request_id for r in worker.delivered] == ["r0"]
    assert sorted(e[0] for e in worker.errors) == ["r0", "r1", "r2"]
    assert all(e[1] == tp.UNAVAILABLE and "fate unknown" in e[2] for e in worker.errors)


def test_a_receiver_holding_a_stream_back_still_answers_for_it(monkeypatch) -> None:
    """While a stream's results have no room its items are not read, and neither are its
    PINGs: the receiver sends PONGs every keepalive instead, and reads again once there is
    room."""
    monkeypatch.setattr(tp, "KEEPALIVE_S", 0.02)

    class Writer:
        def __init__(self) -> None:
            self.frames: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.frames.append(data)

    async def main() -> list[bytes]:
        stream = SimpleNamespace(room=asyncio.Event())
        writer = Writer()
        waiting = asyncio.ensure_future(dataplane.wait_for_room(stream, writer))  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        assert not waiting.done()
        stream.room.set()
        await asyncio.wait_for(waiting, 5)
        return writer.frames

    frames = asyncio.run(main())
    assert len(frames) >= 2 and set(frames) == {dataplane.frame(dataplane.PONG)}
