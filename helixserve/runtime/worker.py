"""The gRPC worker: one engine (one layer range) behind the `HelixWorker` service.

Threads and loops:
- the asyncio loop (main thread) runs the gRPC server, the outgoing streams to next hops and the
  per-stream result writers; it only converts messages and moves them between queues;
- ONE engine thread runs the continuous-batching loop: take everything queued, run it as one
  `engine.step`, hand the outputs back to the loop. Releases (KV frees) are executed by the same
  thread, ordered with the work, because the engine is not thread-safe.

Per step, a request contributes at most one item (its prefill chunks or a decode token arrive in
order and must run in order: an item's KV writes must land before the next item reads them);
later items of the same request wait for the next step, which also pipelines chunked prefills.
Among those first items, the step is formed by the scheduling core's `plan_step`
(helixserve/scheduler/batch.py) within the worker's `StepBudget`: every decode item (one token),
and prompt chunks oldest first up to `step_prompt_tokens` (the first always runs); a chunk the
coordinator cut is never split again. The rest waits, in order, for the next step.

Batching (`batch_wait`, HELIXSERVE_BATCH_WAIT; off by default): before a step, the engine
thread may wait, up to `batch_wait` x its recent step time, while a request on the route of a
pending item that ran here in one of the last BATCH_WAIT_STEPS steps has no item queued yet:
the rest of that request group's tokens, on their way back through the pipeline. Where
workers share CPU cores (the demo's 3 single-thread workers on a 2-core machine) a step's
cost is mostly reading the layer weights, whatever the batch, and without the wait a
pipeline frays into ever smaller steps (n1 ran ~3.7 items a step under 16 streams instead
of ~8); with it each stage steps once per route's group and the CPU per output token fell
~30% (docs/benchmarks.md, "The vllm engine"). Where each worker has its own device, a
pipeline deeper than its request groups would lose overlap by waiting, so it stays off
there (`helixserve demo` turns it on for its CPU workers, torch or vllm, when their threads
outnumber the cores).

What travels: a request's first item on a route (its prefill chunks) carries its route, its
coordinator and its sampling; the worker keeps them (`kept`, per request, until the request is
released) and the request's later decode items are continuation items that carry only request
id, step id, position, token ids and hidden states (proto/helix.proto, WorkItem). All items one
engine step sends to the same next hop go in one message (up to BATCH_BYTES, then the next
at once), all results of one step for one coordinator in one message.

Where results go: an item names the coordinator that sent it; the coordinator keeps a Work stream
open to every worker, so the last hop writes the sampled token straight onto that stream (one
message, not relayed back along the route). Per-item errors (validation, KV full, next hop
unreachable) go the same way, to the coordinator, which fails or re-routes the request.

Liveness that means progress: the engine thread counts a heartbeat (`beats`) whenever it takes
new work and after every step. A watchdog on the loop (`_watch_engine`) declares the engine
stalled when work waits (queued, or a step running) and no beat came for `stall_timeout_s`
(a deadlocked engine, a stuck CUDA call): gRPC health turns NOT_SERVING (the Kubernetes
liveness probe checks it) and `Info` fails with DEADLINE_EXCEEDED naming the stall, which is
exactly what the coordinator counts as a missed answer of a hung worker (two in a row: node
down, its requests replayed elsewhere, a re-plan if layers lost their last holder). When beats
resume, health is SERVING again and the coordinator takes the node back as it would a restarted
one. `HELIXSERVE_TEST_ENGINE_HANG=STEPS:SECONDS` (tests only; unset by default) makes the
engine thread sleep SECONDS before its step STEPS+1, to prove this with real processes;
`@PATH:SECONDS` before its first step after the file PATH appears (`{node}` in PATH: the
worker's node; benchmarks/engine_stall_demo.py freezes one demo worker so).

Prefix caching (docs/prefix-caching.md): after every engine step (and after releases or a
range switch) the engine thread takes the engine's cache events (`take_cache_events`), and
the loop sends them on every coordinator stream, in the ResultBatch of that step's results or
alone, before those results. The loop keeps the set of block names the engine holds, so a
coordinator stream that opens (a new coordinator, a reconnect) first gets all of them with
`reset`. A request's first item may carry `prefix_token_ids` (its cached prefix), which every
hop forwards; an engine that no longer holds it raises PrefixMissError, answered
FAILED_PRECONDITION "prefix miss" with the missing names.

Released request ids are remembered (bounded) so that an item still in flight when its request
was released is dropped instead of allocating KV that nobody would free.

Flooding (docs/security.md): nothing a caller sends is kept without a bound, and a refusal
never drops what was admitted before it.
- The engine queue holds items of at most `queue_limit_tokens()` tokens (QUEUE_KV_FACTOR x the
  KV capacity, at least QUEUE_MIN_TOKENS); an item past it is answered RESOURCE_EXHAUSTED
  "engine queue full" at once. A message may carry at most that many items (else the stream
  is refused).
- A next hop's backlog (`peers.Peer.queue`) is bounded the same way; an output past it is answered
  UNAVAILABLE (its coordinator replays the request), as for an unreachable next hop.
- A stream's results wait in its `out` queue: past OUT_PAUSE the worker stops reading that
  stream's items (its sender is held back by gRPC flow control), and a caller that lets
  OUT_PAUSE + the queue bound pile up is not reading at all: its stream is ended (what it
  held here is freed, as when a coordinator leaves).
- At most MAX_STREAMS incoming streams, MAX_COORDINATOR_STREAMS of them coordinators'.
- Released ids and kept routes are `security.OwnedMemory`s: one coordinator identity filling
  them (say, Release of random ids under identities minted for it) pushes out its own entries
  and those of coordinators without a stream here first, never more than its share of a
  connected coordinator's.

Trust (runtime/security.py): with TLS the server has only a mutual-TLS port, and what a caller
may do follows from the role in its certificate, never from what its messages claim:
`LoadRange`, `Release` and a coordinator stream (and so first-hop items) only from a
coordinator certificate; a stream without a coordinator hello only from a worker certificate,
whose node name (from the certificate) is the stream's sender; an item at hop >= 1 only from
the worker that is its route's previous hop. Info and health answer any member of the CA.
Without TLS (`--insecure`, loopback only, development) the same checks run on what the
caller declares: a coordinator's hello must carry the secret its id is derived from, and a
worker's hello names its node. Either way, items on a coordinator stream must name that
coordinator, Release frees only requests of the coordinator that proves its id (and release
ids on a Work stream only that stream's coordinator's; a worker's stream sending any is
refused), and an item
whose request holds KV here for another coordinator is refused. An item is forwarded only
to an address of the worker's peer policy (its placement's nodes): a forged next hop gets a
per-item PERMISSION_DENIED and nothing is connected.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from helixserve.engine.errors import EngineError, KvExhaustedError, PrefixMissError
from helixserve.errors import UserError
from helixserve.planner.placement import NodeRange
from helixserve.prefix import BlockHash, CacheEvents
from helixserve.runtime import dataplane, security
from helixserve.runtime import transport as tp
from helixserve.runtime.peers import (  # noqa: F401 (tests and benchmarks import them here)
    BATCH_BYTES,
    SENT_MEMORY,
    GrpcPeer,
    Outgoing,
    Peer,
)
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc
from helixserve.runtime.threads import ENGINE_THREAD, name_os_thread

# the process around a Worker (gRPC server, health, drain): importable from here too
from helixserve.runtime.worker_server import ENGINE_STALL_S, SERVICE_NAME, serve  # noqa: F401
from helixserve.scheduler.batch import StepBudget, plan_step
from helixserve.spec.scheduling import DEFAULT_STEP_PROMPT_TOKENS

log = logging.getLogger("helixserve.worker")

#: Remember this many released request ids, all coordinators together (module doc, Flooding).
RELEASED_MEMORY = 100_000
#: Window of the busy-fraction estimate reported by Info.
BUSY_WINDOW_S = 5.0
#: Requests' kept routes at most (see Worker.kept); past it one goes (module doc, Flooding),
#: and its next continuation item is answered UNAVAILABLE (its coordinator replays it)
KEPT_MEMORY = 100_000
#: Tokens of the items queued for the engine at most, as a multiple of its KV capacity: a
#: coordinator sends a worker only items of requests it reserved KV for there (their prompt
#: chunks, one decode token each), so its traffic stays under 1x; 2x leaves room for a second
#: coordinator and for replays. Past it an item is refused (module doc, Flooding).
QUEUE_KV_FACTOR = 2
#: ... and at least this many (a small KV cache still queues a few full prefill steps)
QUEUE_MIN_TOKENS = 16_384
#: Results waiting on one stream (its caller reads them too slowly) before the worker stops
#: reading that stream's items; past this plus the queue bound the stream is ended.
OUT_PAUSE = 4_096
#: Incoming Work streams at once: a coordinator's, and one from each previous hop.
MAX_STREAMS = 256
#: ... of which coordinator streams (one per coordinator; a restarted one briefly has two).
MAX_COORDINATOR_STREAMS = 8
#: Weight of the last step in the moving average of the step time.
STEP_EMA_WEIGHT = 0.2
#: Default `Worker.batch_wait` (module doc, Batching): off.
BATCH_WAIT = 0.0
BATCH_WAIT_ENV = "HELIXSERVE_BATCH_WAIT"
#: ... waiting only for requests that ran in one of this many last steps (a request that
#: stopped sending, say its coordinator holds it back, is not waited for again and again)
BATCH_WAIT_STEPS = 2
#: Test-only hang injection (module doc); never set in deployments.
HANG_ENV = "HELIXSERVE_TEST_ENGINE_HANG"


def _dataplane_kind() -> str:
    try:
        return dataplane.dataplane_kind()
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _batch_wait_default() -> float:
    import os

    text = os.environ.get(BATCH_WAIT_ENV, "")
    if not text:
        return BATCH_WAIT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 10.0:
        from helixserve.errors import UserError

        raise UserError(f"{BATCH_WAIT_ENV}: bad value {text!r}; need a number in [0, 10]")
    return value


@dataclass(frozen=True)
class _Hang:
    """A test-only engine hang (HANG_ENV): before step `steps` + 1, or, with `trigger`,
    before the first step after that file appears."""

    steps: int
    seconds: float
    trigger: str = ""

    def due(self, steps_done: int) -> bool:
        import os

        if self.trigger:
            return os.path.exists(self.trigger)
        return steps_done == self.steps


def _test_hang(node: str) -> _Hang | None:
    """HANG_ENV's hang for worker `node`, or None (the default). `STEPS:SECONDS` hangs before
    step STEPS+1; `@PATH:SECONDS` before the first step after PATH exists, where `{node}` in
    PATH is this worker's node (a local stack gives every worker the same environment, and
    a benchmark freezes one of them by creating its file)."""
    import os

    raw = os.environ.get(HANG_ENV, "")
    if not raw:
        return None
    when, _, seconds = raw.rpartition(":")
    try:
        if when.startswith("@") and len(when) > 1:
            return _Hang(0, float(seconds), when[1:].replace("{node}", node))
        return _Hang(int(when), float(seconds))
    except ValueError:
        raise ValueError(f"{HANG_ENV}={raw!r}: expected STEPS:SECONDS or @PATH:SECONDS") from None


def engine_error_status(exc: BaseException) -> int:
    """The wire status of a failed engine step: each engine/errors.py class names its own
    (a full KV cache: RESOURCE_EXHAUSTED, so the coordinator preempts; an item the engine
    refuses: INVALID_ARGUMENT; a prefix no longer cached: FAILED_PRECONDITION, so the
    coordinator runs the request again); anything else is INTERNAL."""
    if isinstance(exc, EngineError):
        return int(getattr(tp, exc.status, tp.INTERNAL))
    return tp.INTERNAL


@dataclass(eq=False)
class _Stream:
    """One incoming Work stream: results for its sender are queued here and written in batches."""

    coordinator_id: str
    sender: str
    #: the caller's certificate identity (None: plaintext port)
    peer: security.PeerIdentity | None = None
    #: results, and cache events for a coordinator's stream (module doc); None ends it
    out: asyncio.Queue[pb.WorkResult | pb.CacheEvents | None] = field(
        default_factory=asyncio.Queue)
    #: why the worker refused the stream (the handler aborts it with `refused_code`)
    refused: str = ""
    refused_code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED
    #: set while `out` has room (under OUT_PAUSE): the stream's items are read meanwhile
    room: asyncio.Event = field(default_factory=asyncio.Event)
    #: the handler's task, cancelled when the caller leaves `out` past its bound
    task: asyncio.Task[Any] | None = None
    #: ended for not reading (`Worker._end_unread`): nothing more is queued for it
    ended: bool = False

    def __post_init__(self) -> None:
        self.room.set()


@dataclass
class _Job:
    item: tp.WireItem
    #: what the item is forwarded from (`Worker._own_input`)
    msg: pb.WorkItem | tp.Continuation
    origin: _Stream


def _job_tokens(job: _Job) -> int:
    return len(job.item.token_ids)


@dataclass
class _Release:
    #: (coordinator id, request id): a request's KV is freed only for the coordinator owning it
    requests: list[tuple[str, str]]
    done: Future[int]


@dataclass
class _Switch:
    """Engine thread: serve `engine` (a new layer range) from now on; `done` gets
    (requests moved off the old range, seconds the switch took)."""

    engine: Any
    done: Future[tuple[int, float]]


class Worker(pb_grpc.HelixWorkerServicer):
    """Serve one engine's layer range; see the module doc for threads and message flow."""

    def __init__(self, engine: Any, node: str, model: str, backend: str, device: str,
                 tls: security.TlsConfig | None = None,
                 peers: security.PeerPolicy | None = None,
                 reload: Callable[[Any, int, int], tuple[Any, int]] | None = None,
                 kv_cache_bytes: int | None = None,
                 step_prompt_tokens: int | None = DEFAULT_STEP_PROMPT_TOKENS,
                 batch_wait: float | None = None) -> None:
        self.engine = engine
        #: how long a step waits for the items of requests holding KV here, in units of the
        #: recent step time (module doc, Batching); 0: never waits
        self.batch_wait = _batch_wait_default() if batch_wait is None else batch_wait
        #: what one engine step may take (module doc); None: every first item, as before
        self.budget = StepBudget(max_prompt_tokens=step_prompt_tokens).check()
        #: credentials for the streams to next hops (None: plaintext)
        self.tls = tls
        #: what carries items to next hops: "grpc" or "stream" (runtime/dataplane.py)
        self.dataplane = _dataplane_kind()
        #: where items may be forwarded; None or empty: nowhere (module doc)
        self.peer_policy = peers or security.PeerPolicy()
        #: (engine, start, end) -> (engine of [start, end) loaded beside it, layers read);
        #: None: this engine cannot change its range live (LoadRange is refused)
        self._reload = reload
        self.kv_cache_bytes = kv_cache_bytes
        self._loading = False
        #: ranges held before the current one (LoadRange): a stale route is UNAVAILABLE, not
        #: a bad argument, so its coordinator replays the request on a fresh route
        self.range_changes = 0
        self._kv_frozen: dict[str, int] | None = None
        self.node = node
        self.model = model
        self.backend = backend
        self.device = device
        self.expect = tp.ExpectedInput(
            start_layer=engine.start_layer,
            end_layer=engine.end_layer,
            num_model_layers=engine.num_model_layers,
            hidden_size=engine.hidden_size,
            dtype=engine.dtype,
        )
        self._init_messaging()
        self._init_counters()
        self._hang = _test_hang(node)
        if self._hang is not None:
            log.warning("%s set: the engine thread will hang %.0f s before %s (tests only)",
                        HANG_ENV, self._hang.seconds,
                        f"its first step after {self._hang.trigger} exists" if self._hang.trigger
                        else f"step {self._hang.steps + 1}")
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)

    def _init_messaging(self) -> None:
        """The queues, streams and memories between the loop and the engine thread."""
        self.loop: asyncio.AbstractEventLoop | None = None
        # Work arrives as one list per incoming message, so that the engine thread never wakes
        # up to run a fragment of a batch that arrived together.
        self.inbox: queue.SimpleQueue[list[_Job] | _Release | _Switch | None] = queue.SimpleQueue()
        self.coordinators: dict[str, _Stream] = {}
        self.streams: set[_Stream] = set()  # every open incoming Work stream
        self.peers: dict[str, Peer] = {}
        self.draining = False
        # Engine-thread state (read approximately by Info from the loop thread).
        self.active: dict[str, str] = {}  # request id -> coordinator id, holding KV here
        #: engine thread: request id -> (the step it last ran in, `steps` then; its route),
        #: while it holds KV here (module doc, Batching)
        self._ran: dict[str, tuple[int, tuple[NodeRange, ...]]] = {}
        #: loop thread: route, coordinator and sampling of each request from its first item,
        #: for its continuation items (module doc); dropped when the request is released
        self.kept: security.OwnedMemory[str, tp.RequestRoute] = security.OwnedMemory(
            KEPT_MEMORY, self.connected)
        #: engine thread: (coordinator id, request id) of released requests (module doc)
        self.released: security.OwnedMemory[tuple[str, str], None] = security.OwnedMemory(
            RELEASED_MEMORY, self.connected)
        #: loop thread: the prefix block names the engine holds, from its cache events (a
        #: coordinator stream that opens gets them all first; module doc)
        self.cache_held: set[BlockHash] = set()

    def _init_counters(self) -> None:
        """Counters of the bounds, the steps and the messages (Info reports them)."""
        #: Work and result messages sent, and the items and results they carried
        self.messages_out = 0
        self.items_out = 0
        #: tokens of the items admitted to the engine's queue (loop thread) and taken off it
        #: (run, dropped or moved; engine thread): the difference is what is queued, each
        #: counter written by one thread only
        self.admitted_tokens = 0
        self.taken_tokens = 0
        #: items, streams and forwards refused by the bounds (module doc, Flooding), since start
        self.refused_full = 0
        self.streams_ended_unread = 0
        #: queue_limit_tokens(), refreshed at start and with every incoming message
        self._queue_limit = QUEUE_MIN_TOKENS
        self._kv_tokens = 0
        self.queue_len = 0
        self.last_batch_size = 0
        self.steps = 0
        self.items_run = 0
        self._busy: deque[tuple[float, float]] = deque()  # (end time, step seconds)
        #: moving average of the engine's step time (batch_wait's unit)
        self._step_ema_s = 0.0
        #: engine steps per bucket of tokens in the step (tp.STEP_TOKEN_BUCKETS, + larger)
        self.step_tokens_counts = [0] * (len(tp.STEP_TOKEN_BUCKETS) + 1)
        self.step_tokens_sum = 0
        #: engine-thread heartbeat: +1 whenever it takes work and after every step
        self.beats = 0
        #: the engine thread is inside a step
        self.stepping = False
        #: seconds the engine has been stalled (module doc); 0.0 while it makes progress
        self.stalled_s = 0.0

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._queue_limit = self.queue_limit_tokens()
        self._thread.start()

    async def stop(self) -> None:
        self.inbox.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        for peer in self.peers.values():
            peer.task.cancel()
        # End every incoming stream ourselves, so the server's grace period has nothing to wait for.
        for stream in list(self.streams):
            stream.out.put_nowait(None)

    def fail_active(self, message: str) -> int:
        """Tell every coordinator that its requests here are lost (shutdown after drain)."""
        fut: Future[int] = Future()
        ids = list(self.active.items())
        for rid, cid in ids:
            self.report_error(rid, 0, cid, tp.UNAVAILABLE, message)
        self.inbox.put(_Release([(cid, rid) for rid, cid in ids], fut))
        return len(ids)

    def connected(self, coordinator_id: str) -> bool:
        """The coordinator has a stream open here (read from either thread)."""
        return coordinator_id in self.coordinators

    def queue_limit_tokens(self) -> int:
        """The bound on tokens queued for the engine, and for each next hop (module doc,
        Flooding): QUEUE_KV_FACTOR x the engine's KV capacity, at least QUEUE_MIN_TOKENS."""
        kv = self._kv_frozen or self.engine.kv_stats()
        self._kv_tokens = int(kv["capacity_tokens"])
        return max(QUEUE_MIN_TOKENS, QUEUE_KV_FACTOR * self._kv_tokens)

    @property
    def queued_tokens(self) -> int:
        return self.admitted_tokens - self.taken_tokens

    # ---- engine thread -----------------------------------------------------------------

    def _engine_loop(self) -> None:
        name_os_thread(ENGINE_THREAD)  # its CPU apart from the loop's (runtime/threads.py)
        pending: deque[_Job] = deque()
        while True:
            drained = self._take_inbox(pending)
            if drained is None:
                return
            self.beats += 1
            pending = drained
            cache = self._take_cache_events()  # releases and a range switch change it too
            if cache:
                assert self.loop is not None
                self.loop.call_soon_threadsafe(self._send_cache, cache)
            batch, pending = self._next_batch(pending)
            self.queue_len = len(pending)
            if batch:
                self.stepping = True
                if self._hang is not None and self._hang.due(self.steps):
                    hang_s, self._hang = self._hang.seconds, None
                    log.warning("%s: engine thread hangs for %.0f s now (unix time %.3f)",
                                HANG_ENV, hang_s, time.time())
                    time.sleep(hang_s)
                self._run_step(batch)
                self.stepping = False
                self.beats += 1

    def work_waiting(self) -> bool:
        """Work is queued for the engine or a step runs (read from the loop thread)."""
        return self.stepping or self.queue_len > 0 or self.inbox.qsize() > 0

    def _take_inbox(self, pending: deque[_Job]) -> deque[_Job] | None:
        """Engine thread: what arrived (waiting for it when nothing is pending): new jobs
        join `pending`, releases and range switches are done now; then, while some request
        holding KV here has no item pending, up to `batch_wait` x the recent step time for
        its item (module doc, Batching). None: stop."""
        msgs: list[list[_Job] | _Release | _Switch | None] = []
        if not pending:
            msgs.append(self.inbox.get())
        got = self._absorb(self._drain(msgs), pending)
        wait_s = self.batch_wait * self._step_ema_s
        if got is None or not got or wait_s <= 0:
            return got
        deadline = time.perf_counter() + wait_s
        while self._missing(got):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                first = self.inbox.get(timeout=remaining)
            except queue.Empty:
                break
            got = self._absorb(self._drain([first]), got)
            if got is None:
                return None
        return got

    def _drain(
        self, msgs: list[list[_Job] | _Release | _Switch | None]
    ) -> list[list[_Job] | _Release | _Switch | None]:
        while True:
            try:
                msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _missing(self, pending: deque[_Job]) -> bool:
        """Engine thread: a request on the route of a pending item that ran here in one of
        the last BATCH_WAIT_STEPS steps (and holds KV here) has no item in `pending`."""
        recent = self.steps - BATCH_WAIT_STEPS
        here = {j.item.request_id for j in pending}
        routes = {j.item.route for j in pending}
        return any(step >= recent and route in routes and rid not in here
                   for rid, (step, route) in self._ran.items())

    def _absorb(self, msgs: list[list[_Job] | _Release | _Switch | None],
                pending: deque[_Job]) -> deque[_Job] | None:
        """Engine thread: `msgs` applied in order; the pending jobs after them, None: stop."""
        for m in msgs:
            if m is None:
                return None
            if isinstance(m, _Release):
                freed = self._free(m.requests)
                if not m.done.cancelled():  # the caller may have gone away
                    m.done.set_result(freed)
            elif isinstance(m, _Switch):
                self._switch(m, pending)
                pending = deque()
            else:
                pending.extend(m)
        return pending

    def _next_batch(self, pending: deque[_Job]) -> tuple[list[_Job], deque[_Job]]:
        """One item per request per step, FIFO, within the step budget (module doc): the
        step's jobs, and what stays pending (released requests' jobs dropped, and jobs for
        a range this worker no longer holds told UNAVAILABLE: `_outdated`)."""
        heads: list[_Job] = []
        seen: set[str] = set()
        live: list[_Job] = []
        # tokens leaving the queue: the dropped jobs' here, the step's below (a backlog's
        # tokens are not summed at every step: it may hold thousands of jobs)
        taken = 0
        released = self.released
        for job in pending:
            item = job.item
            rid = item.request_id
            if (item.coordinator_id, rid) in released:
                taken += len(item.token_ids)
                continue
            if self.range_changes and self._outdated(job):
                taken += len(item.token_ids)
                continue
            live.append(job)
            if rid not in seen:
                seen.add(rid)
                heads.append(job)
        plan = plan_step([j for j in heads if len(j.item.token_ids) == 1],
                         [j for j in heads if len(j.item.token_ids) > 1],
                         self.budget, _job_tokens)
        chosen = {id(j) for j in plan.decode}
        chosen.update(id(j) for j, _ in plan.prompts)
        batch = [j for j in heads if id(j) in chosen]
        rest = deque(j for j in live if id(j) not in chosen) if len(batch) < len(live) else deque()
        self.taken_tokens += taken + sum(map(_job_tokens, batch))
        return batch, rest

    def _outdated(self, job: _Job) -> bool:
        """Engine thread: whether `job` is for layers this worker no longer holds; if so its
        request is told to replay (`_replay`), as `_switch` tells the requests it finds.
        Such a job was accepted against the range held before a switch and reached the
        engine thread after it (the loop thread checks items against `expect`, which the
        switch changes on this thread): run, the new engine would refuse it as invalid work
        and the request would fail instead of being replayed."""
        item = job.item
        if self._holds(item.hop.start_layer, item.hop.end_layer):
            return False
        self._replay(item.request_id, item.coordinator_id, item.step_id)
        return True

    def _replay(self, rid: str, cid: str, step_id: int) -> None:
        """Engine thread, after a switch: request `rid` of coordinator `cid` is dropped here
        (its late items too) and told UNAVAILABLE, so that its coordinator replays it."""
        self.released.put((cid, rid), cid, None)
        message = (f"node {self.node}: re-planned to layers [{self.expect.start_layer}, "
                   f"{self.expect.end_layer}); replay the request")
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._forget, cid, rid)
        self.loop.call_soon_threadsafe(self.report_error, rid, step_id, cid, tp.UNAVAILABLE,
                                       message)

    def _run_step(self, batch: list[_Job]) -> None:
        """Engine thread: one engine step over `batch`; its outputs go to the event loop."""
        from helixserve.engine.protocol import WorkItem

        items = [
            WorkItem(
                request_id=j.item.request_id,
                start_layer=j.item.hop.start_layer,
                end_layer=j.item.hop.end_layer,
                position=j.item.position,
                token_ids=j.item.token_ids,
                hidden=j.item.hidden,
                sampling=j.item.sampling,
                sample=j.item.sample,
                num_prompt_tokens=j.item.num_prompt_tokens,
                prefix_token_ids=j.item.prefix_token_ids,
            )
            for j in batch
        ]
        for j in batch:
            self.active[j.item.request_id] = j.item.coordinator_id
            self._ran[j.item.request_id] = (self.steps, j.item.route)
        t0 = time.perf_counter()
        outputs: list[Any]
        try:
            outputs = self.engine.step(items)
        except Exception as exc:
            if not isinstance(exc, KvExhaustedError | PrefixMissError):
                log.warning("engine step of %d items failed: %s", len(items), exc)
            outputs = self._step_apart(items, exc)
        step_s = time.perf_counter() - t0
        self._record_step(step_s, len(items), sum(len(it.token_ids) for it in items))
        cache = self._take_cache_events()
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._dispatch, batch, outputs, step_s, cache)

    def _step_apart(self, items: list[Any], exc: Exception) -> list[Any]:
        """Engine thread: the outputs of a step the engine refused with `exc` (an exception
        in place of an item's output fails that item). Out of KV, with an engine that says
        what fits (`kv_fits`): the items that fit, taken in the batch's order, run as one
        step and the others fail with KvExhaustedError, so their requests are preempted, as
        the simulator preempts a request that cannot grow. Otherwise (an item the wire
        validation let through that the engine refuses, a prefix miss) one by one, so that
        only the offending requests fail; a step of one item takes about a step's time, so
        out of KV that would stall the node for a step per item."""
        fits = getattr(self.engine, "kv_fits", None)
        if isinstance(exc, KvExhaustedError) and fits is not None:
            keep: list[Any] = []
            for it in items:
                if fits([*keep, it]):
                    keep.append(it)
            if len(keep) < len(items):
                try:
                    ran = iter(self.engine.step(keep) if keep else [])
                except Exception:
                    pass  # refused for another reason as well: one by one
                else:
                    kept = {id(it) for it in keep}
                    why = (f"{exc} (the step ran the {len(keep)} of its {len(items)} items "
                           "that fit)")
                    return [next(ran) if id(it) in kept else KvExhaustedError(why)
                            for it in items]
        outputs: list[Any] = []
        for it in items:
            try:
                outputs.extend(self.engine.step([it]))
            except Exception as one_exc:
                outputs.append(one_exc)
        return outputs

    def _take_cache_events(self) -> CacheEvents | None:
        """Engine thread: the engine's cache events since the last call (None: none, or an
        engine without prefix caching)."""
        take = getattr(self.engine, "take_cache_events", None)
        if take is None:
            return None
        events: CacheEvents = take()
        return events if events else None

    def _switch(self, m: _Switch, pending: deque[_Job]) -> None:
        """Engine thread: every request of the old range (holding KV, or queued) is told
        UNAVAILABLE and forgotten; the old engine's KV and unshared weights are freed before
        the new one allocates its KV cache, so the two caches never coexist."""
        t0 = time.perf_counter()
        new = m.engine
        # Info (loop thread) reports this until the new KV cache exists: between the two,
        # either engine's cache is a one-block placeholder, not a capacity to route by
        self._kv_frozen = self.engine.kv_stats()
        moved = dict(self.active)
        moved.update((j.item.request_id, j.item.coordinator_id) for j in pending)
        self.taken_tokens += sum(map(_job_tokens, pending))
        self.active.clear()
        self._ran.clear()
        self.engine.release_memory()
        new.allocate_kv(self.kv_cache_bytes)
        self.engine = new
        self._kv_frozen = None
        self.expect = tp.ExpectedInput(
            start_layer=new.start_layer, end_layer=new.end_layer,
            num_model_layers=new.num_model_layers, hidden_size=new.hidden_size, dtype=new.dtype)
        self.range_changes += 1
        for rid, cid in moved.items():
            self._replay(rid, cid, 0)
        m.done.set_result((len(moved), time.perf_counter() - t0))

    def _free(self, requests: list[tuple[str, str]]) -> int:
        freed = 0
        for cid, rid in requests:
            self.released.put((cid, rid), cid, None)
            owner = self.active.get(rid)
            if owner is None or owner != cid:
                if self.loop is not None:
                    self.loop.call_soon_threadsafe(self._forget, cid, rid)
                continue  # not here, or another coordinator's request: left alone
            del self.active[rid]
            self._ran.pop(rid, None)
            freed += 1
            self.engine.free(rid)
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._forget, cid, rid)
        return freed

    def _forget(self, coordinator_id: str, request_id: str) -> None:
        """Loop thread: a released request's kept route goes (only its own coordinator's)."""
        kept = self.kept.get(request_id)
        if kept is not None and kept.coordinator_id == coordinator_id:
            self.kept.pop(request_id)

    def _new_peer(self, address: str) -> Peer:
        return dataplane.new_peer(self, address)

    def count_sent(self, items: int) -> None:
        self.messages_out += 1
        self.items_out += items

    def _record_step(self, step_s: float, batch_size: int, num_tokens: int) -> None:
        self.step_tokens_counts[bisect.bisect_left(tp.STEP_TOKEN_BUCKETS, num_tokens)] += 1
        self.step_tokens_sum += num_tokens
        now = time.monotonic()
        self._busy.append((now, step_s))
        if self._step_ema_s:
            self._step_ema_s += STEP_EMA_WEIGHT * (step_s - self._step_ema_s)
        else:
            self._step_ema_s = step_s
        while self._busy and self._busy[0][0] < now - BUSY_WINDOW_S:
            self._busy.popleft()
        self.last_batch_size = batch_size
        self.steps += 1
        self.items_run += batch_size

    def busy_fraction(self) -> float:
        now = time.monotonic()
        busy = sum(s for t, s in list(self._busy) if t >= now - BUSY_WINDOW_S)
        return min(1.0, busy / BUSY_WINDOW_S)

    # ---- loop thread: after a step ------------------------------------------------------

    def _send_cache(self, events: CacheEvents) -> None:
        """Loop thread: the engine's cache events to every coordinator stream (module doc)."""
        if events.reset:
            self.cache_held.clear()
        self.cache_held.difference_update(events.removed)
        self.cache_held.update(events.stored)
        msg = tp.cache_events_to_pb(self.node, events)
        for stream in list(self.coordinators.values()):
            self._put(stream, msg)

    def _dispatch(self, batch: list[_Job], outputs: list[Any], step_s: float,
                  cache: CacheEvents | None = None) -> None:
        if cache:
            self._send_cache(cache)  # before the results: a finished request frees nothing yet
        touched: list[Peer] = []  # next hops given items: woken once, after the loop
        for job, out in zip(batch, outputs, strict=True):
            item = job.item
            compute_s = item.compute_s + step_s
            if isinstance(out, PrefixMissError):
                why = str(out).removeprefix(tp.PREFIX_MISS).lstrip(": ")
                r = tp.WireResult(request_id=item.request_id, step_id=item.step_id,
                                  status_code=tp.FAILED_PRECONDITION,
                                  error=f"{tp.PREFIX_MISS}: node {self.node}: {why}",
                                  node=self.node, prefix_missing=list(out.missing))
                self.deliver(tp.result_to_pb(r), item.coordinator_id, job.origin)
                continue
            if isinstance(out, Exception):
                code = engine_error_status(out)
                self.report_error(item.request_id, item.step_id, item.coordinator_id, code,
                                  f"node {self.node}: {type(out).__name__}: {out}", job.origin)
                continue
            if item.is_last_hop:
                result = tp.WireResult(
                    request_id=item.request_id,
                    step_id=item.step_id,
                    token_id=out.token_id,
                    logprob=out.logprob,
                    top_logprobs=list(out.top_logprobs or []),
                    prompt_logprobs=out.prompt_logprobs,
                    node=self.node,
                    compute_s=compute_s,
                )
                self.deliver(tp.result_to_pb(result), item.coordinator_id, job.origin)
            else:
                nxt = item.addresses[item.hop_index + 1]
                # hidden: [num_tokens, hidden_size] leaves for the next hop
                peer = self.peers.get(nxt)
                if peer is None or peer.task.done():
                    peer = self.peers[nxt] = self._new_peer(nxt)
                limit = self._queue_limit
                if peer.queued_tokens + len(item.token_ids) > limit:
                    # a next hop that does not keep up (or is stopped): its backlog stays
                    # bounded; the request is replayed, as for an unreachable next hop
                    self.refused_full += 1
                    self.report_error(item.request_id, item.step_id, item.coordinator_id,
                                      tp.UNAVAILABLE,
                                      f"node {self.node}: next hop {nxt} backed up: "
                                      f"{peer.queued_tokens} tokens waiting to be sent, limit "
                                      f"{limit}; replay the request", job.origin)
                    continue
                peer.queued_tokens += len(item.token_ids)
                peer.queue.put_nowait(Outgoing.of(job.msg, out.hidden, compute_s,
                                                   item.coordinator_id))
                if peer not in touched:
                    touched.append(peer)
        for peer in touched:
            peer.notify()

    def deliver(self, result: pb.WorkResult, coordinator_id: str, origin: _Stream | None) -> None:
        stream = self.coordinators.get(coordinator_id) or origin
        if stream is None:
            log.warning("no stream for result of %s: %s", result.request_id, result.error)
            return
        self._put(stream, result)

    def _put(self, stream: _Stream, msg: pb.WorkResult | pb.CacheEvents) -> None:
        """Queue `msg` for `stream`'s caller. Past OUT_PAUSE waiting the stream's items are
        no longer read (`_read_stream`), so what still comes is its admitted items' results
        (at most the queue bound) and cache events; a caller that lets OUT_PAUSE + the queue
        bound pile up does not read at all: its stream is ended, and with it what it held
        here (module doc, Flooding)."""
        if stream.ended:
            return
        waiting = stream.out.qsize()
        if waiting >= OUT_PAUSE:
            stream.room.clear()
            limit = OUT_PAUSE + self._queue_limit
            if waiting >= limit:
                self._end_unread(stream, waiting, limit)
                return
        stream.out.put_nowait(msg)

    def _end_unread(self, stream: _Stream, waiting: int, limit: int) -> None:
        why = (f"node {self.node}: {waiting} results not read by the caller, limit {limit}; "
               "stream ended")
        log.warning("%s (%s)", why, stream.peer.describe() if stream.peer else stream.sender)
        self.streams_ended_unread += 1
        stream.ended = True
        stream.refused, stream.refused_code = why, grpc.StatusCode.RESOURCE_EXHAUSTED
        while not stream.out.empty():  # its memory goes now, not when the caller leaves
            stream.out.get_nowait()
        if stream.task is not None:
            stream.task.cancel()

    def report_error(self, request_id: str, step_id: int, coordinator_id: str, code: int,
                     message: str, origin: _Stream | None = None) -> None:
        r = tp.WireResult(request_id=request_id, step_id=step_id, status_code=code,
                          error=message, node=self.node)
        self.deliver(tp.result_to_pb(r), coordinator_id, origin)

    # ---- gRPC methods --------------------------------------------------------------------

    async def Work(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.WorkBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ResultBatch]:
        peer = self._peer(context)
        refusal = self.stream_refusal()
        if refusal:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        stream = self.open_stream(peer.node if peer is not None else "", peer)
        reader = asyncio.create_task(self._read_stream(request_iterator, stream))
        try:
            async for batch in self.result_batches(stream):
                yield batch
            if stream.refused:
                await context.abort(stream.refused_code, stream.refused)
        finally:
            reader.cancel()
            self.close_stream(stream)

    def stream_refusal(self) -> str:
        """Why a new incoming stream is refused ("" when it is not): MAX_STREAMS."""
        if len(self.streams) < MAX_STREAMS:
            return ""
        self.refused_full += 1
        log.warning("refused a stream: %d open, limit %d", len(self.streams), MAX_STREAMS)
        return (f"node {self.node}: {len(self.streams)} Work streams open, "
                f"limit {MAX_STREAMS}; stream refused")

    def open_stream(self, sender: str, peer: security.PeerIdentity | None) -> _Stream:
        """An incoming stream (gRPC's Work, or the data plane's), from `sender` (the node
        of the caller's certificate; "" on a plaintext port until its hello says)."""
        stream = _Stream(coordinator_id="", sender=sender, peer=peer,
                         task=asyncio.current_task())
        self.streams.add(stream)
        return stream

    async def result_batches(self, stream: _Stream) -> AsyncIterator[pb.ResultBatch]:
        """The stream's results, everything queued at once in one message, until it ends."""
        while True:
            first = await stream.out.get()
            if first is None:
                return
            results: list[pb.WorkResult] = []
            cache: pb.CacheEvents | None = None
            nxt: pb.WorkResult | pb.CacheEvents | None = first
            while nxt is not None:
                if isinstance(nxt, pb.CacheEvents):
                    cache = nxt if cache is None else tp.merge_cache_events(cache, nxt)
                else:
                    results.append(nxt)
                if stream.out.empty():
                    break
                nxt = stream.out.get_nowait()
                if nxt is None:
                    stream.out.put_nowait(None)
            self.count_sent(len(results))
            yield tp.result_batch_pb(results, cache)
            if stream.out.qsize() < OUT_PAUSE:
                stream.room.set()

    def close_stream(self, stream: _Stream) -> None:
        self.streams.discard(stream)
        if stream.coordinator_id and self.coordinators.get(stream.coordinator_id) is stream:
            del self.coordinators[stream.coordinator_id]
            # The coordinator is gone (crashed, or it re-routed our requests when its stream
            # broke): nobody will release its requests here, so free them now.
            orphans = [(cid, rid) for rid, cid in list(self.active.items())
                       if cid == stream.coordinator_id]
            for rid in self.kept.keys_of(stream.coordinator_id):
                self.kept.pop(rid)
            if orphans:
                log.warning("coordinator %s left; freeing %d requests",
                            stream.coordinator_id, len(orphans))
                self.inbox.put(_Release(orphans, Future()))

    async def _read_stream(self, request_iterator: AsyncIterator[pb.WorkBatch],
                           stream: _Stream) -> None:
        try:
            async for batch in request_iterator:
                # a caller that does not read its results gets no more of its items read
                await stream.room.wait()
                if not self.receive(batch, stream):
                    return
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            stream.out.put_nowait(None)

    def receive(self, batch: pb.WorkBatch, stream: _Stream) -> bool:
        """One incoming message: its hello checked, its items admitted to the engine's
        queue. False when the stream is refused (`stream.refused` says why)."""
        self._queue_limit = limit = self.queue_limit_tokens()
        for what, count in (("items", len(batch.items)), ("release ids", len(batch.release_ids))):
            if count > limit:
                return self._refuse_stream(stream, f"{count} {what} in one message, limit {limit}",
                                           grpc.StatusCode.RESOURCE_EXHAUSTED)
        hello = tp.hello_of(batch)
        if hello is not None:
            cid, claimed = hello
            refusal = self._hello_refusal(cid, tp.hello_token(batch), stream)
            if refusal:
                return self._refuse_stream(stream, refusal)
            if cid and cid not in self.coordinators and len(
                    self.coordinators) >= MAX_COORDINATOR_STREAMS:
                return self._refuse_stream(
                    stream, f"{len(self.coordinators)} coordinator streams open, limit "
                            f"{MAX_COORDINATOR_STREAMS}", grpc.StatusCode.RESOURCE_EXHAUSTED)
            if stream.peer is None:  # plaintext: the sender is what it declares
                stream.sender = claimed
            stream.coordinator_id = cid
            if cid:
                self.coordinators[cid] = stream
                if hasattr(self.engine, "take_cache_events"):
                    # everything the cache holds, first (module doc)
                    self._put(stream, tp.cache_events_to_pb(
                        self.node, CacheEvents(list(self.cache_held), [], reset=True)))
        if batch.release_ids:
            # a coordinator's releases (WorkBatch.release_ids): freed as Release frees them,
            # before the message's items, for the coordinator whose hello (id and token, its
            # certificate with TLS) opened the stream
            cid = stream.coordinator_id
            if not cid:
                return self._refuse_stream(
                    stream, f"{len(batch.release_ids)} release ids on a stream without a "
                            "coordinator hello (only a coordinator frees requests)")
            self.inbox.put(_Release([(cid, rid) for rid in batch.release_ids], Future()))
        jobs = [job for i, msg in enumerate(batch.items)
                if (job := self._accept(msg, stream, f"items[{i}]", limit)) is not None]
        if jobs:
            self.inbox.put(jobs)
        return True

    def _refuse_stream(self, stream: _Stream, why: str,
                       code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED) -> bool:
        """Refuse `stream` for `why` (its handler aborts it with `code`; a bound past,
        RESOURCE_EXHAUSTED, is counted in `refused_full`): False, for `receive` to return."""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.refused_full += 1
        stream.refused_code = code
        stream.refused = f"node {self.node}: {why}; stream refused"
        log.warning("refused a stream: %s", stream.refused)
        return False

    def _peer(self, context: grpc.aio.ServicerContext) -> security.PeerIdentity | None:
        """The caller's certificate identity; None on a plaintext worker. With TLS a caller
        always has a certificate (the port requires one); none is treated as no role."""
        if self.tls is None:
            return None
        return security.peer_identity(context) or security.PeerIdentity(
            "", problem="no certificate")

    def _hello_refusal(self, cid: str, token: str, stream: _Stream) -> str:
        """Why a stream's hello is refused ("" when it is not): module doc, Trust."""
        if cid and not security.coordinator_token_ok(cid, token):
            # someone claims a coordinator id without its secret: taking over that
            # coordinator's results is exactly what this refuses
            return f"coordinator id {cid!r} does not match its token"
        if stream.peer is None:
            return ""
        if cid and not stream.peer.is_coordinator:
            return (f"a coordinator stream needs a coordinator certificate; the caller has "
                    f"{stream.peer.describe()}")
        if not cid and stream.peer.role != security.ROLE_WORKER:
            return (f"a stream without a coordinator hello needs a worker certificate; the "
                    f"caller has {stream.peer.describe()}")
        return ""

    async def _require_coordinator(self, context: grpc.aio.ServicerContext, what: str) -> None:
        """Abort PERMISSION_DENIED unless the caller has a coordinator certificate (TLS)."""
        peer = self._peer(context)
        if peer is not None and not peer.is_coordinator:
            log.warning("refused %s from %s", what, peer.describe())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"node {self.node}: {what} needs a coordinator certificate; the "
                                f"caller has {peer.describe()}; nothing changed")

    def _accept(self, msg: pb.WorkItem, stream: _Stream, where: str,
                limit: int | None = None) -> _Job | None:
        full = bool(msg.route)
        kept = None if full else self.kept.get(msg.request_id)
        try:
            if kept is not None:
                item = tp.continuation_from_pb(msg, kept, self.expect, where)
            else:
                item = tp.item_from_pb(msg, self.expect, where)
        except tp.WireError as exc:
            stale = isinstance(exc, tp.StaleRouteError) or self._stale_route(msg)
            code = tp.UNAVAILABLE if stale else tp.INVALID_ARGUMENT
            if not full and kept is None and msg.request_id:
                # a continuation of a request this worker keeps nothing of: released (a late
                # item), or this worker restarted or changed its range since its first item
                code = tp.UNAVAILABLE
                exc = tp.WireError(f"{where}[{msg.request_id}]: a continuation item of a "
                                   "request this worker keeps no route of; replay it")
            cid = kept.coordinator_id if kept is not None else msg.coordinator_id
            self.report_error(msg.request_id, msg.step_id, cid,
                              code, f"node {self.node}: {exc}", stream)
            return None
        refusal = self._refusal(item, stream, where)
        if refusal:
            log.warning("refused %s: %s", where, refusal)
            # to the sender only: a refused item's coordinator id is not trusted
            r = tp.WireResult(request_id=item.request_id, step_id=item.step_id,
                              status_code=tp.PERMISSION_DENIED, error=f"node {self.node}: {refusal}",
                              node=self.node)
            self._put(stream, tp.result_to_pb(r))
            return None
        if self.draining and item.request_id not in self.active:
            self.report_error(item.request_id, item.step_id, item.coordinator_id, tp.UNAVAILABLE,
                              f"node {self.node}: draining for shutdown, not accepting new requests",
                              stream)
            return None
        tokens = len(item.token_ids)
        queued = self.queued_tokens
        limit = self._queue_limit if limit is None else limit
        if queued + tokens > limit:
            # what is queued stays queued: the refused item's coordinator fails or (with
            # on-demand KV) preempts its request; a coordinator never sends this much itself
            self.refused_full += 1
            self.report_error(item.request_id, item.step_id, item.coordinator_id,
                              tp.RESOURCE_EXHAUSTED,
                              f"node {self.node}: engine queue full: {queued} tokens queued, "
                              f"limit {limit} (max({QUEUE_MIN_TOKENS}, {QUEUE_KV_FACTOR} x KV "
                              f"capacity {self._kv_tokens})); item refused, nothing queued dropped", stream)
            return None
        self.admitted_tokens += tokens
        if full and (item.coordinator_id, item.request_id) not in self.released:
            self.kept.put(item.request_id, item.coordinator_id, tp.RequestRoute.of(item))
        return _Job(item, self._own_input(msg, item), stream)

    def _own_input(self, msg: pb.WorkItem, item: tp.WireItem) -> pb.WorkItem | tp.Continuation:
        """What a job keeps to forward its item, without hidden states (the item holds them):
        an item of a received batch shares the batch's arena, so keeping it would keep every
        item's activations of the batch alive until its last job ran. A full item's message
        is copied; of a continuation item (a decode step: most items) only its few fields are
        kept, as plain Python. The emulated engine keeps only the size of its input
        (`compact_input`): its outputs are zeros anyway."""
        compact = getattr(self.engine, "compact_input", None)
        if compact is not None and item.hidden is not None:
            item.hidden = compact(item.hidden)
        if not msg.route:
            return tp.Continuation(item)
        if not msg.HasField("hidden"):
            return msg
        msg.ClearField("hidden")
        own = pb.WorkItem()
        own.CopyFrom(msg)
        return own

    def _stale_route(self, msg: pb.WorkItem) -> bool:
        """An item routed here for layers this worker held before a LoadRange."""
        if not self.range_changes or msg.hop_index >= len(msg.route):
            return False
        hop = msg.route[msg.hop_index]
        return not self._holds(hop.start_layer, hop.end_layer)

    def _holds(self, start_layer: int, end_layer: int) -> bool:
        """Whether layers [start_layer, end_layer) lie in the range this worker holds now."""
        return self.expect.start_layer <= start_layer and end_layer <= self.expect.end_layer

    async def LoadRange(  # noqa: N802
        self, request: pb.LoadRangeRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadRangeReply:
        start, end = request.start_layer, request.end_layer
        n = self.engine.num_model_layers
        await self._require_coordinator(context, f"LoadRange [{start}, {end})")
        if not security.coordinator_token_ok(request.coordinator_id, request.coordinator_token):
            log.warning("refused LoadRange [%d, %d) for coordinator %r: bad token", start, end,
                        request.coordinator_id)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"node {self.node}: LoadRange needs a coordinator's id and token; "
                                "range unchanged")
        reload = self._reload
        if reload is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"node {self.node}: the {self.backend} engine cannot change its "
                                "layer range while serving; restart the worker with the new range")
        assert reload is not None  # abort raised
        if not 0 <= start < end <= n:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"node {self.node}: layers [{start}, {end}): need 0 <= start < "
                                f"end <= {n}")
        if (start, end) == (self.engine.start_layer, self.engine.end_layer):
            return pb.LoadRangeReply(start_layer=start, end_layer=end)
        if self._loading or self.draining:
            await context.abort(grpc.StatusCode.ABORTED,
                                f"node {self.node}: busy ({'draining' if self.draining else 'loading another range'})")
        self._loading = True
        try:
            t0 = time.perf_counter()
            new, layers_read = await asyncio.get_running_loop().run_in_executor(
                None, reload, self.engine, start, end)
            load_s = time.perf_counter() - t0
            done: Future[tuple[int, float]] = Future()
            self.inbox.put(_Switch(new, done))
            moved, switch_s = await asyncio.wrap_future(done)
        except Exception as exc:  # out of memory, unreadable files: the old range still serves
            log.warning("LoadRange [%d, %d) failed: %s", start, end, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED
                                if isinstance(exc, MemoryError) else grpc.StatusCode.INTERNAL,
                                f"node {self.node}: loading layers [{start}, {end}) failed: "
                                f"{type(exc).__name__}: {exc}")
        finally:
            self._loading = False
        print(f"helixserve worker {self.node}: now layers [{start}, {end}) "
              f"(for {request.coordinator_id or 'a coordinator'}): {layers_read} layers read in "
              f"{load_s:.2f} s, switched in {switch_s * 1000:.0f} ms, {moved} requests moved",
              flush=True)
        return pb.LoadRangeReply(start_layer=start, end_layer=end, load_s=load_s,
                                 switch_s=switch_s, requests_moved=moved,
                                 layers_loaded=layers_read)

    def _refusal(self, item: tp.WireItem, stream: _Stream, where: str) -> str:
        """Why an item may not run here ("" when it may): see the module doc, Trust."""
        if stream.coordinator_id and item.coordinator_id != stream.coordinator_id:
            return (f"{where}.coordinator_id: {item.coordinator_id!r} on the stream of "
                    f"coordinator {stream.coordinator_id!r}")
        if not stream.coordinator_id and item.hop_index == 0:
            return f"{where}.hop_index: 0 (first hop) from a stream that is not a coordinator's"
        if item.hop_index > 0:
            prev = item.route[item.hop_index - 1].name
            if stream.coordinator_id or stream.sender != prev:
                who = (stream.peer.describe() if stream.peer is not None
                       else f"a stream {'of a coordinator' if stream.coordinator_id else 'naming itself ' + repr(stream.sender)}")
                return (f"{where}.hop_index: {item.hop_index} from {who}, not from the route's "
                        f"previous hop {prev!r}")
        owner = self.active.get(item.request_id)
        if owner is not None and owner != item.coordinator_id:
            return f"{where}.request_id: {item.request_id!r} belongs to another coordinator"
        if not item.is_last_hop:
            nxt = item.addresses[item.hop_index + 1]
            if not self.peer_policy.allows(nxt):
                return (f"{where}.route[{item.hop_index + 1}].address: {nxt!r} is not a "
                        f"peer of this worker (peers: {self.peer_policy.describe()}); refused, "
                        "nothing connected")
        return ""

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseReply:
        cid = request.coordinator_id
        await self._require_coordinator(context, f"Release of {len(request.request_ids)} requests")
        if not security.coordinator_token_ok(cid, request.coordinator_token):
            log.warning("refused Release of %d requests for coordinator %r: bad token",
                        len(request.request_ids), cid)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"node {self.node}: Release needs the coordinator's id and token; "
                                "nothing freed")
        fut: Future[int] = Future()
        self.inbox.put(_Release([(cid, rid) for rid in request.request_ids], fut))
        if self.stalled_s:  # queued for when the engine moves again; nothing freed yet
            return pb.ReleaseReply(released=0)
        freed = await asyncio.wrap_future(fut)
        return pb.ReleaseReply(released=freed)

    async def Info(  # noqa: N802
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoReply:
        if self.stalled_s:
            # what the coordinator counts as a missed answer of a hung worker (module doc)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self.stall_message())
        return tp.info_to_pb(self.info())

    def stall_message(self) -> str:
        return (f"node {self.node}: engine made no progress for {self.stalled_s:.1f} s with "
                f"work waiting ({self.queue_len + self.inbox.qsize()} items queued, "
                f"{'a step running' if self.stepping else 'no step running'}); health NOT_SERVING")

    def info(self) -> tp.WorkerInfo:
        kv = self._kv_frozen or self.engine.kv_stats()
        return tp.WorkerInfo(
            node=self.node,
            model=self.model,
            num_model_layers=self.engine.num_model_layers,
            start_layer=self.engine.start_layer,
            end_layer=self.engine.end_layer,
            backend=self.backend,
            device=self.device,
            dtype=tp.dtype_name(self.engine.dtype),
            hidden_size=self.engine.hidden_size,
            kv_block_size=int(kv["block_size"]),
            kv_total_blocks=int(kv["total_blocks"]),
            kv_used_blocks=int(kv["used_blocks"]),
            kv_capacity_tokens=int(kv["capacity_tokens"]),
            queue_len=self.queue_len + self.inbox.qsize(),
            last_batch_size=self.last_batch_size,
            busy_fraction=self.busy_fraction(),
            steps=self.steps,
            items_run=self.items_run,
            active_requests=len(self.active),
            draining=self.draining,
            eos_token_ids=tuple(int(t) for t in (self.engine.eos_token_ids or ())),
            step_tokens_counts=tuple(self.step_tokens_counts),
            step_tokens_sum=self.step_tokens_sum,
            engine=getattr(self.engine, "engine_name", "torch"),
            vllm_version=getattr(self.engine, "vllm_version", ""),
            wire_version=tp.WIRE_VERSION,
            work_messages_out=self.messages_out,
            work_items_out=self.items_out,
        )
