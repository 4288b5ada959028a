"""The worker's messaging, without gRPC or a model: a request's route is kept from its first
item and its continuation items are served from it (and refused once it is released); all
items of one engine step for the same next hop leave in one message, and all results of one
step for one coordinator in one message."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helixserve.planner.placement import NodeRange
from helixserve.request import SamplingParams
from helixserve.runtime import security
from helixserve.runtime import transport as tp
from helixserve.runtime.peers import GrpcPeer, Outgoing, OutQueue
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.worker import Worker, _Job, _Stream

ROUTE = (NodeRange("a", 0, 2), NodeRange("b", 2, 4))
ADDRESSES = ("h:1", "h:2")
CID, TOKEN = security.new_coordinator_identity()


class FakeEngine:
    start_layer, end_layer, num_model_layers, hidden_size, dtype = 0, 2, 4, 8, torch.float32
    eos_token_ids: tuple[int, ...] = ()

    def kv_stats(self) -> dict[str, int]:
        return {"block_size": 16, "total_blocks": 64, "used_blocks": 0, "capacity_tokens": 1024}


def _worker(start: int = 0, end: int = 2) -> Worker:
    engine = FakeEngine()
    engine.start_layer, engine.end_layer = start, end
    return Worker(engine, node="a" if start == 0 else "b", model="m", backend="torch",
                  device="cpu", peers=security.PeerPolicy.parse(["h:*"]))


def _full(rid: str, hop: int = 0, step: int = 1) -> pb.WorkItem:
    item = tp.WireItem(request_id=rid, coordinator_id=CID, step_id=step, hop_index=hop,
                       route=ROUTE, addresses=ADDRESSES, position=0, token_ids=[1, 2, 3],
                       hidden=None if hop == 0 else torch.zeros(3, 8),
                       sampling=SamplingParams(temperature=0.0, prompt_logprobs=1), sample=True)
    return tp.item_to_pb(item)


def _coordinator_stream() -> _Stream:
    return _Stream(coordinator_id=CID, sender="coordinator")


def test_continuation_items_use_the_route_kept_from_the_first_item() -> None:
    w = _worker()
    stream = _coordinator_stream()
    assert w._accept(_full("r"), stream, "items[0]") is not None
    job = w._accept(tp.continuation_to_pb("r", 2, 3, [9]), stream, "items[0]")
    assert job is not None and stream.out.empty()
    assert job.item.route == ROUTE and job.item.addresses == ADDRESSES
    assert job.item.coordinator_id == CID and job.item.hop_index == 0
    assert (job.item.step_id, job.item.position, job.item.token_ids) == (2, 3, [9])
    assert job.item.sampling == SamplingParams(temperature=0.0)  # prompt scored with prefill

    # released: the kept route goes, and a late continuation is told to replay (UNAVAILABLE)
    w.loop = SimpleNamespace(call_soon_threadsafe=lambda f, *a: f(*a))  # type: ignore[assignment]
    w.engine.free = lambda rid: None  # type: ignore[attr-defined]
    w._free([(CID, "r")])
    assert "r" not in w.kept
    assert w._accept(tp.continuation_to_pb("r", 3, 4, [9]), stream, "items[0]") is None
    r = stream.out.get_nowait()
    assert r is not None and (r.request_id, r.step_id) == ("r", 3)
    assert r.status_code == tp.UNAVAILABLE and "keeps no route" in r.error
    # ... and a late full item of a released request is not kept again
    w._accept(_full("r"), stream, "items[0]")
    assert "r" not in w.kept


def test_continuation_of_another_coordinators_request_is_refused() -> None:
    w = _worker()
    w._accept(_full("r"), _coordinator_stream(), "items[0]")
    other_id, _ = security.new_coordinator_identity()
    other = _Stream(coordinator_id=other_id, sender="coordinator")
    assert w._accept(tp.continuation_to_pb("r", 2, 3, [9]), other, "items[0]") is None
    r = other.out.get_nowait()
    assert r is not None and r.status_code == tp.PERMISSION_DENIED


def test_one_message_per_step_to_the_next_hop() -> None:
    async def main() -> None:
        w = _worker()
        w.loop = asyncio.get_running_loop()
        stream = _coordinator_stream()
        # the first hop's step: 16 requests' first items, then their continuation items
        prefill = [w._accept(_full(f"r{i}"), stream, "i") for i in range(16)]
        decode = [w._accept(tp.continuation_to_pb(f"r{i}", 100 + i, 3, [5]), stream, "i")
                  for i in range(16)]
        peer = GrpcPeer.__new__(GrpcPeer)  # the stream to the next hop, not connected
        peer.worker, peer.address, peer.queue = w, "h:2", OutQueue()
        peer.sent, peer._getter, peer.queued_tokens = deque(), None, 0
        peer.task = asyncio.get_running_loop().create_future()  # running
        w.peers["h:2"] = peer
        sent: list[pb.WorkBatch] = []
        for batch in (prefill, decode):
            jobs: list[_Job] = [j for j in batch if j is not None]
            outputs = [SimpleNamespace(hidden=torch.ones(len(j.item.token_ids), 8))
                       for j in jobs]
            w._dispatch(jobs, outputs, 0.01)
            requests = peer._requests(peer.queue.get_nowait())
            sent.append(await requests.__anext__())
            await requests.aclose()
        assert [len(m.items) for m in sent] == [16, 16]
        assert (w.messages_out, w.items_out) == (2, 32)
        assert all(m.route for m in sent[0].items)  # first items: full, for the next hop
        assert all(not m.route and m.HasField("hidden") for m in sent[1].items)
        assert sent[0].items[0].hop_index == 1
        # the next hop keeps the route from the first and serves the continuations
        nxt = _worker(2, 4)
        upstream = _Stream(coordinator_id="", sender="a")
        for m in sent[0].items:
            assert nxt._accept(m, upstream, "i") is not None
        jobs = [nxt._accept(m, upstream, "i") for m in sent[1].items]
        assert all(j is not None and j.item.is_last_hop and j.item.coordinator_id == CID
                   for j in jobs)

    asyncio.run(main())


async def open_coordinator_stream(w: Any) -> tuple[Any, _Stream]:
    """A coordinator's Work stream to `w` (hello, then idle): ((the result iterator, its first
    message's future), the worker's side of the stream)."""
    hello_sent = asyncio.Event()

    async def incoming() -> Any:
        yield tp.work_batch_pb([], coordinator_id=CID, sender="coordinator",
                               coordinator_token=TOKEN)
        hello_sent.set()
        await asyncio.Event().wait()

    results = w.Work(incoming(), context=None)
    first = asyncio.ensure_future(results.__anext__())
    await hello_sent.wait()
    await asyncio.sleep(0)
    return (results, first), w.coordinators[CID]


def test_one_result_message_per_step_to_the_coordinator() -> None:
    async def main() -> None:
        w = _worker(2, 4)
        w.loop = asyncio.get_running_loop()
        (results, first), stream = await open_coordinator_stream(w)
        upstream = _Stream(coordinator_id="", sender="a")
        jobs = [w._accept(_full(f"r{i}", hop=1, step=i), upstream, "i") for i in range(16)]
        w._dispatch([j for j in jobs if j is not None],
                    [SimpleNamespace(token_id=7, logprob=None, top_logprobs=None,
                                     prompt_logprobs=None) for _ in jobs], 0.01)
        batch = await asyncio.wait_for(first, 5)
        assert [r.step_id for r in batch.results] == list(range(16))
        assert (w.messages_out, w.items_out) == (1, 16)
        assert stream.out.empty()
        await results.aclose()

    asyncio.run(main())


def test_a_backlog_for_the_next_hop_is_split_under_the_message_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Items queued behind a slow link go out in as many messages as keep each one under
    gRPC's limit (a stream broke with RESOURCE_EXHAUSTED at 42 emulated workers)."""
    import helixserve.runtime.peers as peers_mod

    monkeypatch.setattr(peers_mod, "BATCH_BYTES", 2_000)

    async def main() -> None:
        w = _worker()
        peer = GrpcPeer.__new__(GrpcPeer)  # the stream to the next hop, not connected
        peer.worker, peer.address, peer.queue = w, "h:2", OutQueue()
        peer.sent, peer._getter, peer.queued_tokens = deque(), None, 0
        item = _full("r0", hop=1)
        for i in range(10):
            msg = _full(f"r{i}", hop=1)
            peer.queue.put_nowait(Outgoing(msg, CID, hidden_bytes=len(msg.hidden.data)))
        requests = peer._requests(peer.queue.get_nowait())
        sent = [await requests.__anext__()]
        while not peer.queue.empty():
            sent.append(await requests.__anext__())
        await requests.aclose()
        assert sum(len(m.items) for m in sent) == 10 and len(sent) > 1
        # each message: under the cap plus at most one item
        assert all(m.ByteSize() <= 2_000 + item.ByteSize() + 64 for m in sent)
        # the size counted is a bound on the encoded one, without encoding it
        out = Outgoing(item, CID, hidden_bytes=len(item.hidden.data))
        assert item.ByteSize() <= out.size_bytes() <= item.ByteSize() + 1024
        assert [m.request_id for b in sent for m in b.items] == [f"r{i}" for i in range(10)]

    asyncio.run(main())


def test_raw_hidden_states_for_the_next_hop_become_bytes_only_when_written() -> None:
    """An emulated engine's activations wait in the next hop's queue as their size; the
    message written has them at full size, and the item as it came is unchanged."""
    from helixserve.engine.emulated import ZeroHidden
    from helixserve.engine.protocol import RawHidden

    came = _full("r", hop=1)
    came.ClearField("hidden")
    out = Outgoing.of(came, ZeroHidden("float16", (3, 8), 48), 0.5, CID)
    assert out.hidden is not None and out.request_id == "r" and out.step_id == 1
    assert out.hidden_bytes == 48
    msg = pb.WorkItem()
    out.write_into(msg)
    assert msg == tp.forward_item_pb(came, RawHidden("float16", (3, 8), bytes(48)), 0.5)
    assert msg.hop_index == 2 and len(msg.hidden.data) == 48 and not came.HasField("hidden")
    # a continuation item stays one (no hop index, no route), as forward_item_pb makes it
    cont = tp.continuation_to_pb("r", 2, 3, [9])
    out = Outgoing.of(cont, RawHidden("float16", (1, 8), bytes(16)), 0.25, CID)
    msg = pb.WorkItem()
    out.write_into(msg)
    assert msg == tp.forward_item_pb(cont, RawHidden("float16", (1, 8), bytes(16)), 0.25)
    # a tensor becomes its bytes at once (a GPU tensor must not wait in a queue) and is
    # written like raw hidden states, into the batch
    t = torch.arange(24, dtype=torch.float32).view(3, 8)
    now = Outgoing.of(came, t, 0.5, CID)
    assert now.hidden is not None and now.hidden_bytes == 3 * 8 * 4
    t.zero_()  # later changes to the engine's tensor do not reach the queued item
    msg = pb.WorkItem()
    now.write_into(msg)
    assert msg == tp.forward_item_pb(came, torch.arange(24, dtype=torch.float32).view(3, 8), 0.5)
    assert list(msg.hidden.shape) == [3, 8] and msg.hidden.dtype == "float32"


def test_a_continuation_item_is_kept_as_its_fields_and_forwarded_as_it_came() -> None:
    """A middle hop keeps of a continuation item (most of a decode hop's items) only the
    fields it forwards, not a protobuf copy, and writes the same next-hop message that
    `forward_item_pb` makes of the item as it arrived."""
    w = _worker(0, 2)
    stream = _coordinator_stream()
    assert w._accept(_full("r"), stream, "items[0]") is not None
    came = tp.continuation_to_pb("r", 2, 3, [9])
    job = w._accept(came, stream, "items[0]")
    assert job is not None and isinstance(job.msg, tp.Continuation)
    hidden = torch.arange(8, dtype=torch.float32).view(1, 8)
    out = Outgoing.of(job.msg, hidden, 0.25, CID)
    assert (out.request_id, out.step_id, out.tokens) == ("r", 2, 1)
    msg = pb.WorkItem()
    out.write_into(msg)
    assert msg == tp.forward_item_pb(came, hidden, 0.25)
    assert not msg.route and msg.hop_index == 0 and list(msg.token_ids) == [9]
