"""A worker's declaration names its message's size on the wire, and that is the size the link
proxy reads for the message (runtime/transport.py `declare_unsent` with `message=`,
rehearse/links.py `Link.debts`): real gRPC over mutual TLS through the proxy, messages as a
worker writes them to its next hop (LLaMA-2-70B, the 64-byte payload), sized around gRPC's
frame and TLS record boundaries.

Why it matters (helix-geo-24, issue 27): the proxy spreads a message's declared bytes over
the wire bytes its declaration names. Named too small (the payloads' size alone, 64 bytes a
token where a decode item is ~180 bytes on the wire), the bytes the proxy reads run ahead of
the names; on a link that never drains each message then carries debts of messages written
after it, and a decode step's message waits for the next prefill chunk's megabytes, which
the simulator (one FIFO transfer per message, its own bytes) never makes it wait for.
Byte counts only, no timing.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from helixserve.engine.emulated import ZeroHidden
from helixserve.planner.placement import NodeRange
from helixserve.rehearse.links import (
    Link,
    LinkProxy,
    LinkShape,
    ProxyConfig,
    ProxyRoute,
    TlsRecordEnds,
    TlsRecords,
)
from helixserve.runtime import security
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc
from helixserve.spec.model import load_model

pytestmark = pytest.mark.integration

MODEL = load_model(Path(__file__).parents[2] / "data/shared/models/llama-2-70b")
ROW = MODEL.activation_bytes_per_token  # what the simulator charges a token on a link
PAYLOAD = 64  # rehearse's default bytes a token on the wire
#: the rehearsal's HTTP/2 stream window with the 64-byte payload (rehearse/cluster.py):
#: fixed, so no BDP probe's PINGs (and their ACKs on this link) cross
STREAM_WINDOW = 128 * 1024
#: the tokens of each message's items: decode batches of 1 and 5 items, prefill chunks of
#: 200-512 tokens (the largest, 512, is 3 frames and 3 records), and sizes just past one
#: frame (16 KiB) and one TLS record (16,284 bytes)
MESSAGES = [[1], [1] * 5, [512], [250], [251], [252], [253], [256], [1] * 5, [300], [511],
            [200, 1, 1], [1]]
#: the stream's HEADERS (path, authority, metadata), read with the first message and named
#: by no declaration; at most one TLS record of this
HEADERS_MAX = 512


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _batch(tokens: list[int], hello: bool) -> tuple[pb.WorkBatch, list[ZeroHidden]]:
    """A worker's message to its next hop, as `peers.GrpcPeer` writes it: prefill chunks as full items
    of a 13-hop route (helix-geo-24), decode tokens (1 token) as continuation items, each with
    its hidden states as the emulated engine makes them."""
    route = tuple(NodeRange(f"n{i}", i * 6, i * 6 + 6) for i in range(13))
    batch = tp.work_batch_pb([], sender="n1" if hello else "")
    hiddens = []
    for k, n in enumerate(tokens):
        request_id = f"cmpl-{uuid.uuid4().hex}-0-{k}#coord-{'f' * 32}.{k}"
        item = (tp.continuation_to_pb(request_id, 7, 1200, [31999]) if n == 1 else
                pb.WorkItem(request_id=request_id, coordinator_id="coord-" + "f" * 32,
                            step_id=1, hop_index=3,
                            route=tp.route_to_pb(route, [f"127.0.0.1:{20000 + i}"
                                                         for i in range(13)]),
                            position=1024, token_ids=[31999] * n, num_prompt_tokens=2048))
        hidden = ZeroHidden("float16", (n, MODEL.hidden_size), n * ROW, n * PAYLOAD)
        tp.forward_item_into(batch.items.add(), item, hidden, 0.1)
        hiddens.append(hidden)
    return batch, hiddens


class _Sink(pb_grpc.HelixWorkerServicer):
    def __init__(self) -> None:
        self.got: asyncio.Queue[int] = asyncio.Queue()

    async def Work(self, request_iterator: Any, context: Any) -> AsyncIterator[pb.ResultBatch]:
        async for batch in request_iterator:
            await self.got.put(batch.ByteSize())
        if False:  # a stream of results, none sent
            yield pb.ResultBatch()


def test_each_message_carries_exactly_the_bytes_its_declaration_names(tmp_path, monkeypatch):
    ledger = f"helixserve-test-{uuid.uuid4().hex}"
    monkeypatch.setenv(tp.LINK_LEDGER_ENV, ledger)
    monkeypatch.setattr(tp, "_ledger", None)
    monkeypatch.setattr(tp, "STREAM_WINDOW_BYTES", STREAM_WINDOW)
    named: list[int] = []  # the wire size each declaration named, as the proxy took it
    declare = Link.declare

    def spy(link: Link, num_bytes: int, wire_bytes: int = 0) -> None:
        named.append(wire_bytes)
        declare(link, num_bytes, wire_bytes)

    monkeypatch.setattr(Link, "declare", spy)
    framing: list[TlsRecordEnds | None] = []  # what the proxy saw of the TLS records
    feed = TlsRecords.feed

    def records_spy(tracker: TlsRecords, data: bytes) -> TlsRecordEnds | None:
        framing.append(feed(tracker, data))
        return framing[-1]

    monkeypatch.setattr(TlsRecords, "feed", records_spy)

    async def main() -> list[tuple[int, ...]]:
        creds = security.create_dev_credentials(tmp_path / "tls", ["n0", "n1"])
        sink = _Sink()
        server = grpc.aio.server(options=tp.server_options())
        pb_grpc.add_HelixWorkerServicer_to_server(sink, server)
        target, listen = _port(), _port()
        security.add_port(server, f"127.0.0.1:{target}", creds.nodes["n0"])
        await server.start()
        # a fast link: the byte counts are the point here, not the times
        config = ProxyConfig([ProxyRoute("n0", listen, target)],
                             {("n1", "n0"): LinkShape(10.0, 0.0)}, {},
                             str(tmp_path / "stats.json"), ledger=ledger)
        proxy = LinkProxy(config, resolve=lambda peer: "n1")
        await proxy.start()
        address = f"127.0.0.1:{listen}"
        channel = security.aio_channel(address, creds.nodes["n1"], tp.channel_options())
        queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        sent: list[tuple[int, int, int]] = []  # (serialized, payload, simulator's bytes)

        async def requests() -> AsyncIterator[pb.WorkBatch]:
            hello = True
            while (tokens := await queue.get()) is not None:
                batch, hiddens = _batch(tokens, hello)
                hello = False
                sent.append((batch.ByteSize(), sum(h.payload_nbytes for h in hiddens),
                             sum(tokens) * ROW))
                tp.declare_unsent("n1", address, hiddens, message=batch)  # as peers.Peer.next_batch does
                yield batch

        try:
            await channel.channel_ready()
            link = proxy.link("n1", "n0")
            call = pb_grpc.HelixWorkerStub(channel).Work(requests())
            reading = asyncio.ensure_future(call.read())
            counts = []  # per message: wire bytes, declared bytes, debts left, their bytes,
            # bytes of the message's last TLS record still to come
            for tokens in MESSAGES:
                wire0, declared0 = link.bytes_sent, link.bytes_declared
                await queue.put(tokens)
                assert await asyncio.wait_for(sink.got.get(), 30) == sent[-1][0]
                # the server has the whole message: the proxy has read all its bytes
                counts.append((link.bytes_sent - wire0, link.bytes_declared - declared0,
                               len(link.debts), sum(d[0] for d in link.debts),
                               link.record_rest))
            await queue.put(None)
            reading.cancel()
            return [(*c, w, *s) for c, w, s in zip(counts, named, sent, strict=True)]
        finally:
            await channel.close()
            await proxy.close()
            await server.stop(0)

    results = asyncio.run(main())
    assert len(results) == len(MESSAGES)
    assert framing and None not in framing  # every chunk's TLS records were followed
    for k, (wire, declared, debts, debt_bytes, record_rest, named, serialized, payload,
            simulated) in enumerate(results):
        tokens = MESSAGES[k]
        # the message's bytes on the wire are exactly what its declaration named; the first
        # one follows the stream's HEADERS, which no declaration names
        assert named == tp._wire_bytes(serialized)
        if k:
            assert wire == named, (k, tokens, wire, named)
        else:
            assert 0 < wire - named <= HEADERS_MAX, (wire, named)
        # every declared byte of this message rode on its own bytes: nothing left for the next
        assert (debts, debt_bytes) == (0, 0), (k, tokens, debts, debt_bytes)
        # and the message ended with a TLS record (links.py `TlsRecords`): its last bytes
        # were delivered with it, none left to the next message
        assert record_rest == 0, (k, tokens, record_rest)
        # what the proxy charged for it = the simulator's bytes for the same tokens + what the
        # runtime's message adds (ids, route, gRPC / HTTP/2 / TLS framing): under 2%
        assert declared == simulated - payload
        overhead = wire + declared - simulated - (wire - named)
        assert 0 < overhead < 0.02 * simulated, (k, tokens, overhead)
