"""What a worker keeps per message is bounded (runtime/worker.py, Flooding), without gRPC or a
model: the engine queue refuses items past its bound and keeps what it admitted; the
released-id and kept-route memories are filled by one coordinator without pushing out
another's; a next hop's backlog is bounded; a stream whose caller does not read is ended."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import torch
from test_worker_messages import CID, _coordinator_stream, _full, _worker

from helixserve.runtime import security
from helixserve.runtime import transport as tp
from helixserve.runtime import worker as worker_mod
from helixserve.runtime.peers import GrpcPeer, OutQueue
from helixserve.runtime.worker import OUT_PAUSE, _Stream


def test_the_engine_queue_refuses_past_its_bound_and_keeps_what_it_admitted() -> None:
    w = _worker()
    stream = _coordinator_stream()
    limit = 30  # 10 items of 3 tokens
    jobs = [w._accept(_full(f"r{i}"), stream, "items[0]", limit) for i in range(15)]
    admitted = [j for j in jobs if j is not None]
    assert len(admitted) == 10 and w.queued_tokens == 30
    refused = [stream.out.get_nowait() for _ in range(5)]
    assert all(r is not None and r.status_code == tp.RESOURCE_EXHAUSTED for r in refused)
    assert all("engine queue full: 30 tokens queued, limit 30" in r.error for r in refused)
    assert w.refused_full == 5
    # the engine takes a step: the queue has room again, and nothing admitted was dropped
    step, rest = w._next_batch(deque(admitted))
    assert [j.item.request_id for j in step] == [f"r{i}" for i in range(10)] and not rest
    assert w.queued_tokens == 0
    assert w._accept(_full("late"), stream, "items[0]", limit) is not None


def test_a_step_takes_its_tokens_and_a_released_requests_off_the_queue() -> None:
    """What is queued stays counted exactly: a step takes its items' tokens, the jobs of a
    released request are dropped with theirs, and the rest stays queued (one item per
    request per step: r0's second item waits)."""
    w = _worker()
    stream = _coordinator_stream()
    jobs = [w._accept(_full(rid), stream, "items[0]", 100) for rid in ("r0", "r0", "r1", "r2")]
    assert all(j is not None for j in jobs) and w.queued_tokens == 12
    w.released.put((CID, "r1"), CID, None)
    step, rest = w._next_batch(deque(j for j in jobs if j is not None))
    assert [j.item.request_id for j in step] == ["r0", "r2"]
    assert [j.item.request_id for j in rest] == ["r0"] and w.queued_tokens == 3


def test_released_ids_of_a_connected_coordinator_survive_a_flood_of_releases() -> None:
    victim, _ = security.new_coordinator_identity()
    connected = {victim}
    mem: security.OwnedMemory[tuple[str, str], None] = security.OwnedMemory(
        1000, lambda c: c in connected)
    for i in range(300):
        mem.put((victim, f"v{i}"), victim, None)
    # an attacker with its own (valid) identities: unconnected ones, then connected ones
    for _ in range(50):
        minted, _ = security.new_coordinator_identity()
        for i in range(100):
            mem.put((minted, f"x{i}"), minted, None)
    assert all((victim, f"v{i}") in mem for i in range(300)) and len(mem) == 1000
    attackers = [security.new_coordinator_identity()[0] for _ in range(3)]
    connected.update(attackers)
    for i in range(5000):
        a = attackers[i % 3]
        mem.put((a, f"y{i}"), a, None)
    # 4 connected owners: the victim keeps (about) 1000 / 4 of its latest, the oldest go
    assert len(mem) == 1000 and mem.owned(victim) >= 249
    assert all((victim, f"v{i}") in mem for i in range(300 - mem.owned(victim), 300))
    assert (victim, "v0") not in mem and mem.evicted == 50 * 100 + 5000 + 300 - 1000


def test_a_next_hops_backlog_is_bounded_and_its_items_replayed() -> None:
    async def main() -> None:
        w = _worker()
        w.loop = asyncio.get_running_loop()
        w._queue_limit = 6  # two items of 3 tokens
        stream = _coordinator_stream()
        w.coordinators[CID] = stream
        jobs = [w._accept(_full(f"r{i}"), stream, "i", 100) for i in range(3)]
        peer = GrpcPeer.__new__(GrpcPeer)  # a next hop that reads nothing
        peer.worker, peer.address, peer.queue = w, "h:2", OutQueue()
        peer.sent, peer._getter, peer.queued_tokens = deque(), None, 0
        peer.task = asyncio.get_running_loop().create_future()  # running
        w.peers["h:2"] = peer
        live = [j for j in jobs if j is not None]
        w._dispatch(live, [SimpleNamespace(hidden=torch.ones(3, 8)) for _ in live], 0.01)
        assert peer.queue.qsize() == 2 and peer.queued_tokens == 6
        r = stream.out.get_nowait()
        assert r is not None and r.request_id == "r2" and r.status_code == tp.UNAVAILABLE
        assert "next hop h:2 backed up: 6 tokens waiting to be sent, limit 6" in r.error
        got = await peer._get()
        assert got.request_id == "r0" and peer.queued_tokens == 3

    asyncio.run(main())


def test_a_stream_whose_caller_does_not_read_is_ended(monkeypatch) -> None:
    monkeypatch.setattr(worker_mod, "OUT_PAUSE", 4)

    async def main() -> None:
        w = _worker()
        w._queue_limit = 6
        task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
        stream = _Stream(coordinator_id=CID, sender="coordinator", task=task)
        result = tp.result_to_pb(tp.WireResult(request_id="r", step_id=1, token_id=5))
        for _ in range(4):
            w._put(stream, result)
        assert stream.room.is_set() and stream.out.qsize() == 4
        w._put(stream, result)  # past OUT_PAUSE: its items are no longer read
        assert not stream.room.is_set() and stream.out.qsize() == 5
        for _ in range(5):
            w._put(stream, result)
        assert stream.out.qsize() == 10  # OUT_PAUSE + the queue bound
        w._put(stream, result)
        # past OUT_PAUSE + the queue bound: ended, and what it held is gone
        assert stream.out.empty() and w.streams_ended_unread == 1
        assert "results not read by the caller, limit 10" in stream.refused
        await asyncio.sleep(0)
        assert task.cancelled()
        w._put(stream, result)  # nothing more is queued for it
        assert stream.out.empty()

    asyncio.run(main())
    assert OUT_PAUSE == 4_096
