"""A worker's streams to its next hops: items queue per next hop and leave in batches.

Every item an engine step sends to the same next hop waits in that hop's `Peer.queue`
(bounded by the worker: `Worker._dispatch`); the peer's writer takes everything queued, up to
BATCH_BYTES, as one WorkBatch message (`Peer.next_batch`), so a step's items for a hop cross
in one message. The writer is woken once per step, not per item (`Peer.notify`, after the
step's items are queued), and waits on a plain future rather than a task of its own: a
message costs its loop one turn, not three (docs/benchmarks.md, "Where the CPU goes"). Two
transports carry the messages (runtime/dataplane.py picks one):
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


class OutQueue:
    """A next hop's items, oldest first: filled by the loop (`Worker._dispatch`), emptied by
    the peer's writer. It wakes nobody: the worker calls `Peer.notify` once a step's items
    are all queued (module doc)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: deque[Outgoing] = deque()

    def put_nowait(self, out: Outgoing) -> None:
        self._items.append(out)

    def get_nowait(self) -> Outgoing:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class Peer:
    """A persistent stream to one next-hop worker (module doc); `_run` is the transport's."""

    #: bytes on the wire of a message of n serialized bytes, as this transport frames it
    #: (what a declaration names to the rehearsal's link emulation; None: gRPC's)
    framing: Callable[[int], int] | None = None
    # The current stream's wait for items: a plain future that `notify` completes. A broken
    # stream's writer may be left suspended (gRPC leaves its request iterator so);
    # cancelling its wait (`_stop_getter`) keeps it from ever taking an item meant for the
    # next stream. The wait itself takes nothing: the writer takes items once woken.
    _getter: asyncio.Future[None] | None = None

    def __init__(self, worker: Worker, address: str) -> None:
        self.worker = worker
        self.address = address
        #: items for the next hop with their coordinator's id (a continuation item names none)
        self.queue = OutQueue()
        #: tokens of the items in `queue` (bounded like the engine's queue: `Worker._dispatch`)
        self.queued_tokens = 0
        #: (request id, step id, coordinator id) of items written to the current stream
        self.sent: deque[tuple[str, int, str]] = deque(maxlen=SENT_MEMORY)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        raise NotImplementedError

    def notify(self) -> None:
        """Items were queued (all of one engine step's for this hop): wake the writer."""
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)

    async def _wait(self) -> None:
        """Until `notify` (or a spurious wake-up: callers check the queue again)."""
        getter = self._getter = asyncio.get_running_loop().create_future()
        try:
            await getter
        finally:
            if self._getter is getter:
                self._getter = None

    def _take(self) -> Outgoing:
        """The oldest queued item, its tokens no longer counted as queued (the queue must
        not be empty)."""
        out = self.queue.get_nowait()
        self.queued_tokens -= out.tokens
        return out

    async def _get(self) -> Outgoing:
        """The next item to write: at once when one is queued (what queued while the last
        batch was written), else after `notify` (the wait is for an idle stream)."""
        while self.queue.empty():
            await self._wait()
        return self._take()

    def _stop_getter(self) -> None:
        """End the current stream's wait for items (module doc); it holds none."""
        getter, self._getter = self._getter, None
        if getter is not None and not getter.done():
            getter.cancel()

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
            item = self._take()
            items.append(item)
            item.write_into(batch.items.add())
            size += item.size_bytes()
        self.sent.extend((o.request_id, o.step_id, o.coordinator_id) for o in items)
        self.worker.count_sent(len(items))
        # an emulated payload's bytes left out, charged by the link emulation (transport)
        tp.declare_unsent(self.worker.node, self.address, [o.hidden for o in items],
                          message=batch, framing=self.framing)
        return batch

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
        self._stop_getter()
        self._fail_sent(message)
        self._fail_queued(message)

    def ended(self) -> None:
        """The stream ended (normally or not): its writer's wait, if any, ends with it."""
        self._stop_getter()

    def _fail_sent(self, message: str) -> None:
        for request_id, step_id, coordinator_id in self.sent:
            self.worker.report_error(request_id, step_id, coordinator_id, tp.UNAVAILABLE,
                                     f"{message} (item sent, fate unknown)")
        self.sent.clear()

    def _fail_queued(self, message: str) -> None:
        while not self.queue.empty():
            out = self._take()
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
            first = await self._get()
