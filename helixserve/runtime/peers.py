"""A worker's streams to its next hops: items queue per next hop and leave in batches.

Every item an engine step sends to the same next hop waits in that hop's `Peer.queue`
(bounded by the worker: `Worker._dispatch`); the peer's writer takes everything queued, up to
BATCH_BYTES, as one WorkBatch message (`Peer.next_batch`), so a step's items for a hop cross
in one message. Two transports carry the messages (runtime/dataplane.py picks one):
- `GrpcPeer`: the worker's `Work` gRPC stream (the default);
- `dataplane.StreamPeer`: length-prefixed frames on a mutual-TLS connection of their own.

When a stream breaks, the items written to it may or may not have reached the next hop, and
no result will say which. So every item sent on the broken stream (the last SENT_MEMORY of
them) is reported to its coordinator as UNAVAILABLE, like the items still queued. A
coordinator ignores a report for a step it already has the result of, and re-routes a
request whose pending step was on the stream, instead of waiting for its step timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from helixserve.engine.protocol import RawHidden
from helixserve.runtime import security
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from helixserve.runtime.worker import Worker

log = logging.getLogger("helixserve.worker")

#: Items remembered per next-hop stream, to report when the stream breaks (module doc).
SENT_MEMORY = 10_000
#: bytes of items one message to the next hop carries before the rest waits for the next
#: message: with one item of at most MAX_MESSAGE_BYTES / 2 more, a message stays under the limit.
#: Each message exists ~3 times on each side while it crosses (protobuf, serialized, gRPC's
#: buffers), per stream: 4 MiB keeps that small (a 512-token LLaMA-2-70B prefill chunk, 8 MiB,
#: goes alone) and still carries a step's decode items (16 KiB each) in one message
BATCH_BYTES = 4 * 1024 * 1024
#: a bound on what an item carries beside its hidden states, token ids and route (ids,
#: sampling); only BATCH_BYTES uses it, which has room to spare
ITEM_OVERHEAD_BYTES = 512


@dataclass
class Outgoing:
    """An item for a next hop, waiting in its `Peer` queue. Raw hidden states (the emulated
    engine's, which hold only their size until asked for their bytes) become the message
    when it is written, so a backlog behind a slow hop holds no activations; a tensor becomes
    its bytes at once (a GPU tensor must not wait in a queue), written into the batch later."""

    msg: pb.WorkItem | tp.Continuation
    """The message to send; with `hidden`, the item as it came here (without its hidden
    states; a continuation item's fields only), turned into the next hop's by
    `write_into`."""
    coordinator_id: str
    hidden: RawHidden | None = None
    compute_s: float = 0.0
    #: bytes of the hidden states; batching counts these rather than asking protobuf for the
    #: message's size (upb's ByteSize encodes the whole message: a copy of the activations)
    hidden_bytes: int = 0

    @staticmethod
    def of(msg: pb.WorkItem | tp.Continuation, hidden: Any, compute_s: float,
           coordinator_id: str) -> Outgoing:
        if isinstance(hidden, RawHidden):
            size = getattr(hidden, "nbytes", None)
            return Outgoing(msg, coordinator_id, hidden, compute_s,
                            len(hidden.data) if size is None else int(size))
        # hidden: a tensor [num_tokens, hidden_size]
        raw = tp.raw_hidden(hidden)
        return Outgoing(msg, coordinator_id, raw, compute_s, len(raw.data))

    def size_bytes(self) -> int:
        """A bound on the bytes the item adds to a message (hidden states, token ids, route
        hops of at most 128 bytes, the rest), without encoding the message."""
        return (self.hidden_bytes + ITEM_OVERHEAD_BYTES
                + 8 * (len(self.msg.token_ids) + len(self.msg.prefix_token_ids))
                + 128 * len(self.msg.route))

    @property
    def tokens(self) -> int:
        return len(self.msg.token_ids)

    @property
    def request_id(self) -> str:
        return self.msg.request_id

    @property
    def step_id(self) -> int:
        return self.msg.step_id

    def write_into(self, dst: pb.WorkItem) -> None:
        """Write the next hop's message into `dst` (an item of the outgoing batch): the
        hidden states' bytes are copied once, into the batch itself (through a pb.Tensor and
        a standalone item they would be copied three times, and each 512-token prefill chunk
        of LLaMA-2-70B is 8 MiB)."""
        if self.hidden is None and isinstance(self.msg, pb.WorkItem):
            dst.CopyFrom(self.msg)
        else:
            tp.forward_item_into(dst, self.msg, self.hidden, self.compute_s)


class Peer:
    """A persistent stream to one next-hop worker (module doc); `_run` is the transport's."""

    #: bytes on the wire of a message of n serialized bytes, as this transport frames it
    #: (what a declaration names to the rehearsal's link emulation; None: gRPC's)
    framing: Callable[[int], int] | None = None

    def __init__(self, worker: Worker, address: str) -> None:
        self.worker = worker
        self.address = address
        #: items for the next hop with their coordinator's id (a continuation item names none)
        self.queue: asyncio.Queue[Outgoing] = asyncio.Queue()
        #: tokens of the items in `queue` (bounded like the engine's queue: `Worker._dispatch`)
        self.queued_tokens = 0
        #: (request id, step id, coordinator id) of items written to the current stream
        self.sent: deque[tuple[str, int, str]] = deque(maxlen=SENT_MEMORY)
        # The current stream's wait for its next item. A broken stream's writer may be left
        # suspended (gRPC leaves its request iterator so); cancelling this wait keeps it from
        # taking (and losing) an item meant for the next stream.
        self._getter: asyncio.Future[Outgoing] | None = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        raise NotImplementedError

    async def _get(self) -> Outgoing:
        out = await self.queue.get()
        self.queued_tokens -= out.tokens  # at once: no cancellation between the two
        return out

    def _stop_getter(self) -> Outgoing | None:
        """End the current stream's wait; the item it took and never wrote, if any."""
        getter, self._getter = self._getter, None
        if getter is None:
            return None
        if not getter.done():
            getter.cancel()
            return None
        if getter.cancelled() or getter.exception() is not None:
            return None
        return getter.result()

    def next_batch(self, first: Outgoing, hello: bool) -> pb.WorkBatch:
        """`first` and everything queued since the last write (at least one engine step's
        items), up to BATCH_BYTES, as one message: a backlog of prefill chunks behind a slow
        link must not make one message past the message limit (each item is at most half of
        it: prefill chunks are cut so), the rest goes in the next message at once. The items
        count as sent, and the bytes their payload leaves out are declared to the link
        emulation (transport.declare_unsent), as the message is about to be written."""
        batch = tp.work_batch_pb([], sender=self.worker.node if hello else "")
        first.write_into(batch.items.add())
        items = [first]
        size = first.size_bytes()
        while size < BATCH_BYTES and not self.queue.empty():
            item = self.queue.get_nowait()
            self.queued_tokens -= item.tokens
            items.append(item)
            item.write_into(batch.items.add())
            size += item.size_bytes()
        self.sent.extend((o.request_id, o.step_id, o.coordinator_id) for o in items)
        self.worker.count_sent(len(items))
        # an emulated payload's bytes left out, charged by the link emulation (transport)
        tp.declare_unsent(self.worker.node, self.address, [o.hidden for o in items],
                          message=batch, framing=self.framing)
        return batch

    async def next_item(self) -> Outgoing:
        """The next item to write: what queued while the last batch was written is taken at
        once, without a task and a loop turn of its own (the wait is for an idle stream)."""
        if not self.queue.empty():
            first = self.queue.get_nowait()
            self.queued_tokens -= first.tokens
            return first
        getter = self._getter = asyncio.ensure_future(self._get())
        first = await getter
        if self._getter is getter:
            self._getter = None
        return first

    def deliver_back(self, batch: pb.ResultBatch) -> None:
        """Downstream normally reports to the coordinator directly; anything arriving on the
        stream is a per-item error that could not be delivered there."""
        for r in batch.results:
            kept = self.worker.kept.get(r.request_id)
            self.worker.deliver(r, coordinator_id=kept.coordinator_id if kept else "",
                                origin=None)

    def broke(self, message: str) -> None:
        """The stream broke: its written items' fate is unknown, the queued ones wait for
        nothing; both are reported UNAVAILABLE (module doc)."""
        taken = self._stop_getter()
        if taken is not None:
            self.sent.append((taken.request_id, taken.step_id, taken.coordinator_id))
        self._fail_sent(message)
        self._fail_queued(message)

    def ended(self) -> None:
        """The stream ended (normally or not): an item its wait took and never wrote."""
        taken = self._stop_getter()
        if taken is not None:
            self.worker.report_error(taken.request_id, taken.step_id, taken.coordinator_id,
                                     tp.UNAVAILABLE,
                                     f"stream to next hop {self.address} ended")

    def _fail_sent(self, message: str) -> None:
        for request_id, step_id, coordinator_id in self.sent:
            self.worker.report_error(request_id, step_id, coordinator_id, tp.UNAVAILABLE,
                                     f"{message} (item sent, fate unknown)")
        self.sent.clear()

    def _fail_queued(self, message: str) -> None:
        while not self.queue.empty():
            out = self.queue.get_nowait()
            self.queued_tokens -= out.tokens
            self.worker.report_error(out.request_id, out.step_id, out.coordinator_id,
                                     tp.UNAVAILABLE, message)


class GrpcPeer(Peer):
    """The next hop's `Work` gRPC stream (a stream without a coordinator hello: a worker's)."""

    async def _run(self) -> None:
        while True:
            first = await self._get()
            self.sent.clear()
            channel = security.aio_channel(self.address, self.worker.tls, tp.CHANNEL_OPTIONS)
            try:
                call = pb_grpc.HelixWorkerStub(channel).Work(self._requests(first))
                async for batch in call:
                    self.deliver_back(batch)
            except grpc.aio.AioRpcError as exc:
                log.warning("stream to %s broke: %s", self.address, exc.code().name)
                self.broke(f"next hop {self.address} unreachable: {exc.code().name}")
            finally:
                self.ended()
                await channel.close()

    async def _requests(self, first: Outgoing) -> AsyncIterator[pb.WorkBatch]:
        hello = True
        while True:
            batch = self.next_batch(first, hello)
            yield batch
            del batch  # not kept while the stream waits for the next item
            hello = False
            first = await self.next_item()
