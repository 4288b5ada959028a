"""The coordinator's connection to one worker: a persistent Work stream plus unary calls.

Items for the worker are queued and sent in batches (all items queued since the last write go in
one WorkBatch message: the decode steps the coordinator sends in one event-loop turn travel
together), and so are the ids of finished requests to free there (`release_on_stream`,
WorkBatch.release_ids): a Release call per request and hop cost the worker and the
coordinator about half a millisecond of CPU each (docs/runtime.md, Release). A request's later decode steps go as continuation items (`send_continuation`: request
id, step id, position, token) when the worker speaks wire version 2 (`continuation_ok`).
Results (sampled tokens, prefill acks, per-item errors) arrive on the stream's responses and are
handed to the coordinator's callback with this node's name: which worker sent a result is the
stream it came on, not what the message says. The worker's prefix cache events (a batch's
`cache`) go to `on_cache` the same way, before the batch's results. When the stream breaks the node
is reported down; `revive` reconnects once the worker answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helixserve.prefix import CacheEvents
from helixserve.runtime import security
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

log = logging.getLogger("helixserve.coordinator")

#: seconds between reconnection attempts to a node that went down
REVIVE_INTERVAL_S = 2.0


@dataclass
class NodeFailure:
    """Put in a request's result queue when a node on its route went down."""

    node: str
    reason: str


class NodeClient:
    def __init__(
        self,
        name: str,
        address: str,
        start_layer: int,
        end_layer: int,
        coordinator_id: str,
        on_result: Callable[[str, tp.WireResult], None],
        on_down: Callable[[str, str], None],
        coordinator_token: str = "",
        tls: security.TlsConfig | None = None,
        on_cache: Callable[[str, CacheEvents], None] | None = None,
    ) -> None:
        self.name = name
        self.address = address
        self.start_layer = start_layer
        self.end_layer = end_layer
        self.coordinator_id = coordinator_id
        #: the secret behind coordinator_id (runtime/security.py), sent in hello and Release
        self.coordinator_token = coordinator_token
        self.tls = tls
        self.on_result = on_result
        self.on_down = on_down
        self.on_cache = on_cache
        self.info: tp.WorkerInfo | None = None
        self.alive = False
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.HelixWorkerStub | None = None
        #: items for the stream, and request ids to release on it (str); None ends it
        self._outgoing: asyncio.Queue[pb.WorkItem | str | None] = asyncio.Queue()
        self._stream_task: asyncio.Task[None] | None = None
        self._last_revive = 0.0
        self._route_pb_cache: dict[tuple[object, ...], list[pb.Hop]] = {}
        #: Work messages with items sent on the stream and the items they carried (items per
        #: message; a message of release ids alone is not counted)
        self.messages_out = 0
        self.items_out = 0
        #: an Info call is under way; Info calls in a row that got no answer in time
        self.refreshing = False
        self.missed_answers = 0

    # ---- connection ------------------------------------------------------------------------

    async def connect(self, num_model_layers: int, timeout_s: float,
                      check_range: bool = True) -> None:
        """Wait until the worker is SERVING, check it holds the placement's range (unless
        `check_range` is False: live re-planning takes whatever range it holds), open the
        stream."""
        self._channel = security.aio_channel(self.address, self.tls, tp.CHANNEL_OPTIONS)
        self._stub = pb_grpc.HelixWorkerStub(self._channel)
        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""),
                                           timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise ConnectionError(
                        f"node {self.name}: worker at {self.address} not reachable after "
                        f"{timeout_s:.0f} s: {exc.code().name}"
                    ) from None
            if time.monotonic() > deadline:
                raise ConnectionError(f"node {self.name}: worker at {self.address} not SERVING")
            await asyncio.sleep(0.2)
        await self.refresh_info(raise_errors=True)
        info = self.info
        assert info is not None
        if not check_range:
            self.start_layer, self.end_layer = info.start_layer, info.end_layer
        elif (info.start_layer, info.end_layer) != (self.start_layer, self.end_layer) and not (
            info.start_layer <= self.start_layer and self.end_layer <= info.end_layer
        ):
            raise ConnectionError(
                f"node {self.name}: worker at {self.address} holds layers [{info.start_layer}, "
                f"{info.end_layer}), the placement says [{self.start_layer}, {self.end_layer})"
            )
        if info.num_model_layers != num_model_layers:
            raise ConnectionError(
                f"node {self.name}: worker model has {info.num_model_layers} layers, "
                f"the placement {num_model_layers}"
            )
        self._outgoing = asyncio.Queue()
        self._stream_task = asyncio.get_running_loop().create_task(self._run_stream())
        self.missed_answers = 0
        self.alive = True

    async def close(self) -> None:
        self.alive = False
        self._outgoing.put_nowait(None)
        if self._stream_task is not None:
            self._stream_task.cancel()
            await asyncio.gather(self._stream_task, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    def reconnectable(self) -> bool:
        return time.monotonic() - self._last_revive > REVIVE_INTERVAL_S

    async def revive(self, num_model_layers: int, check_range: bool = True) -> bool:
        self._last_revive = time.monotonic()
        if self._stream_task is not None:  # a hung worker's stream may still be open
            self._stream_task.cancel()
        if self._channel is not None:
            await self._channel.close()
        try:
            await self.connect(num_model_layers, timeout_s=1.0, check_range=check_range)
        except (ConnectionError, grpc.aio.AioRpcError):
            return False
        return True

    # ---- the Work stream -------------------------------------------------------------------

    async def _requests(self) -> AsyncIterator[pb.WorkBatch]:
        yield tp.work_batch_pb([], coordinator_id=self.coordinator_id, sender="coordinator",
                               coordinator_token=self.coordinator_token)
        while True:
            nxt = await self._outgoing.get()
            items: list[pb.WorkItem] = []
            releases: list[str] = []
            while nxt is not None:
                if isinstance(nxt, str):
                    releases.append(nxt)
                else:
                    items.append(nxt)
                if self._outgoing.empty():
                    break
                nxt = self._outgoing.get_nowait()
            if items:
                self.messages_out += 1
                self.items_out += len(items)
            if items or releases:
                yield tp.work_batch_pb(items, release_ids=releases)
            if nxt is None:
                return

    async def _run_stream(self) -> None:
        assert self._stub is not None
        reason = "stream closed by the worker"
        try:
            call = self._stub.Work(self._requests())
            async for batch in call:
                if self.on_cache is not None and batch.HasField("cache"):
                    self._cache_report(batch.cache)
                for r in batch.results:
                    self.on_result(self.name, tp.result_from_pb(r))
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            return
        if self.alive:
            self.alive = False
            self.on_down(self.name, reason)

    def _cache_report(self, msg: pb.CacheEvents) -> None:
        assert self.on_cache is not None
        try:
            events = tp.cache_events_from_pb(msg, f"node {self.name}: cache")
        except tp.WireError as exc:
            # believe nothing of what it holds rather than a part: no reuse until its next
            # reset (a new stream)
            log.warning("%s; its prefix cache is ignored", exc)
            events = CacheEvents(reset=True)
        self.on_cache(self.name, events)

    def send(self, item: tp.WireItem) -> None:
        key = (item.route, item.addresses)
        route_pb = self._route_pb_cache.get(key)
        if route_pb is None:
            if len(self._route_pb_cache) > 1024:
                self._route_pb_cache.clear()
            route_pb = self._route_pb_cache[key] = tp.route_to_pb(item.route, item.addresses)
        self._outgoing.put_nowait(tp.item_to_pb(item, route_pb))

    def send_continuation(self, request_id: str, step_id: int, position: int,
                          token_ids: list[int]) -> None:
        """A decode step of a request whose first item went to this worker before."""
        self._outgoing.put_nowait(tp.continuation_to_pb(request_id, step_id, position, token_ids))

    def release_on_stream(self, request_id: str) -> bool:
        """Free the request's KV on this worker with the stream's next message (wire
        version 3), in order with the items sent before it; False where the stream cannot
        carry it (down, an older worker): then `release` calls Release."""
        if not self.alive or self.info is None or self.info.wire_version < 3:
            return False
        self._outgoing.put_nowait(request_id)
        return True

    @property
    def continuation_ok(self) -> bool:
        """The worker takes continuation items (it reported wire version 2 or later)."""
        return self.info is not None and self.info.wire_version >= 2

    # ---- unary calls -----------------------------------------------------------------------

    async def check_alive(self, timeout_s: float) -> bool:
        """Health check; a node that is not SERVING (dead, draining) or that does not answer
        within `timeout_s` is reported down. The coordinator passes its hang_timeout_s (the
        deadline it gives a live worker's Info call): a 1 s deadline took nodes of a
        saturated host down on one slow answer."""
        if not self.alive or self._channel is None:
            return False
        health = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            reason = "health: not SERVING (draining?)"
        except grpc.aio.AioRpcError as exc:
            ok, reason = False, f"health check failed: {exc.code().name}"
        if not ok and self.alive:
            self.alive = False
            self.on_down(self.name, reason)
        return ok

    async def refresh_info(self, raise_errors: bool = False, timeout_s: float = 5.0) -> None:
        assert self._stub is not None
        self.refreshing = True
        try:
            self.info = tp.info_from_pb(await self._stub.Info(pb.InfoRequest(),
                                                              timeout=timeout_s))
            self.missed_answers = 0
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.missed_answers += 1
            if raise_errors:
                raise
        finally:
            self.refreshing = False

    def check_answering(self, hang_timeout_s: float, max_missed: int = 2) -> None:
        """A live worker that let `max_missed` Info calls in a row pass their deadline
        (`hang_timeout_s` each) is down: hung (a stopped process keeps its sockets open, so
        no stream breaks). Two, so that one slow answer on a starved machine is not a death."""
        if self.alive and self.missed_answers >= max_missed:
            self.alive = False
            self.on_down(self.name, f"no answer to {self.missed_answers} Info calls of "
                                    f"{hang_timeout_s:g} s each (hung?)")

    async def load_range(self, start_layer: int, end_layer: int,
                         timeout_s: float) -> pb.LoadRangeReply:
        """Ask the worker to hold [start_layer, end_layer) (LoadRange); returns once it does."""
        assert self._stub is not None
        reply: pb.LoadRangeReply = await self._stub.LoadRange(
            pb.LoadRangeRequest(start_layer=start_layer, end_layer=end_layer,
                                coordinator_id=self.coordinator_id,
                                coordinator_token=self.coordinator_token), timeout=timeout_s)
        self.start_layer, self.end_layer = reply.start_layer, reply.end_layer
        return reply

    async def release(self, request_ids: list[str]) -> int:
        assert self._stub is not None
        try:
            reply = await self._stub.Release(
                tp.release_pb(request_ids, self.coordinator_id, self.coordinator_token),
                timeout=10.0)
        except grpc.aio.AioRpcError as exc:
            log.warning("release on %s failed: %s", self.name, exc.code().name)
            return 0
        return int(reply.released)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.info.kv_capacity_tokens if self.info else 0

    @property
    def queue_len(self) -> int:
        return self.info.queue_len if self.info else 0

    def __repr__(self) -> str:
        return f"NodeClient({self.name}@{self.address} [{self.start_layer},{self.end_layer}))"


__all__ = ["NodeClient", "NodeFailure"]
