"""AdmissionWait: a request waits for KV room at most `timeout_s` while the model is covered."""

from __future__ import annotations

import asyncio

import pytest

from helixserve.runtime.admission import AdmissionWait
from helixserve.scheduler.core import Admission, CoreRequest, QueueFullError, SchedulerCore
from tests.unit.scheduler.test_core import core


def test_a_request_that_never_gets_kv_room_gets_queue_full_after_the_deadline() -> None:
    c: SchedulerCore = core({"a": 100})

    async def run() -> None:
        wait = AdmissionWait(c, lambda: None, retry_s=0.01)
        c.arrive(CoreRequest("big", 60, 20))  # holds 80 of 100 until it finishes
        first = await wait.admit("big", lambda: True, lambda _: None, timeout_s=1.0)
        assert isinstance(first, Admission)
        c.arrive(CoreRequest("next", 30, 10))  # needs 40: waits for "big"
        with pytest.raises(QueueFullError, match="within 0.05 s"):
            await wait.admit("next", lambda: True, lambda _: None, timeout_s=0.05)
        assert "next" not in c.requests  # gave up: out of the queue
        c.finish("big")
        c.arrive(CoreRequest("after", 30, 10))
        ok = await wait.admit("after", lambda: True, lambda _: None, timeout_s=0.05)
        assert ok.request_id == "after"

    asyncio.run(run())


def test_time_without_a_covering_route_is_not_counted_against_the_deadline() -> None:
    c: SchedulerCore = core({"a": 100})
    asked: list[float] = []

    async def run() -> None:
        wait = AdmissionWait(c, lambda: None, retry_s=0.01)
        c.arrive(CoreRequest("big", 60, 20))
        await wait.admit("big", lambda: True, lambda _: None, timeout_s=1.0)
        c.arrive(CoreRequest("next", 30, 10))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        covered = lambda: loop.time() - t0 > 0.5  # noqa: E731  uncovered for the first 0.5 s
        loop.call_later(0.55, c.finish, "big")
        loop.call_later(0.55, wait.pump)
        got = await wait.admit("next", covered, asked.append, timeout_s=0.3)
        # waited 0.5 s uncovered (more than the deadline) and about 0.05 s covered
        assert got.request_id == "next" and asked

    asyncio.run(run())
