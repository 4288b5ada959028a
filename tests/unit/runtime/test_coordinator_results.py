"""The coordinator takes only the results it waits for (runtime/results.py): a token for a step
it did not send, a second answer to a step, a token that does not come from the route's last
stage, a result from a node off the route or for no request in flight are dropped, counted in
`stats().dropped_results` and never reach the client; a worker's error from any hop of the
route is still taken."""

from __future__ import annotations

import asyncio
import logging

import pytest

from helixserve.request import GenerationRequest, SamplingParams
from helixserve.runtime.inflight import InFlight
from helixserve.runtime.results import unexpected
from helixserve.runtime.transport import RESOURCE_EXHAUSTED, UNAVAILABLE, WireResult
from helixserve.scheduler.types import Route
from tests.unit.runtime.test_coordinator_decode import _coordinator, _request, _settle


def _in_flight(pending: set[int]) -> InFlight:
    from helixserve.planner.placement import NodeRange

    req = GenerationRequest("r", [1, 2, 3], SamplingParams(), max_tokens=4)
    fl = InFlight.of(req, "r#c.0", [])
    fl.admitted(Route((NodeRange("a", 0, 2), NodeRange("b", 2, 4))), ("h:1", "h:2"), 0)
    fl.pending |= pending
    return fl


def test_unexpected_names_what_is_not_awaited() -> None:
    fl = _in_flight({7})
    assert unexpected(fl, "b", WireResult("r#c.0", 7, token_id=1)) is None
    assert unexpected(fl, "b", WireResult("r#c.0", 7)) is None  # an ack from the last stage
    assert "not sent" in (unexpected(fl, "b", WireResult("r#c.0", 8, token_id=1)) or "")
    assert "last stage" in (unexpected(fl, "a", WireResult("r#c.0", 7, token_id=1)) or "")
    assert "not on its route" in (unexpected(fl, "z", WireResult("r#c.0", 7, token_id=1)) or "")
    # errors: from any hop of the route, for a step awaited or the whole request (step 0)
    assert unexpected(fl, "a", WireResult("r#c.0", 7, status_code=UNAVAILABLE)) is None
    assert unexpected(fl, "a", WireResult("r#c.0", 0, status_code=RESOURCE_EXHAUSTED)) is None
    assert "answered already" in (
        unexpected(fl, "a", WireResult("r#c.0", 8, status_code=UNAVAILABLE)) or "")
    assert "not on its route" in (
        unexpected(fl, "z", WireResult("r#c.0", 0, status_code=UNAVAILABLE)) or "")


def test_results_not_awaited_are_dropped_counted_and_never_delivered(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        coord = _coordinator()
        a = coord.nodes["a"]
        for n in coord.nodes.values():
            n.auto = False  # type: ignore[attr-defined]
        stream = coord.generate(_request(3))
        nxt = asyncio.ensure_future(stream.__anext__())
        await _settle()
        (internal,) = coord.active
        held = list(a.held)  # type: ignore[attr-defined]
        a.held.clear()  # type: ignore[attr-defined]
        token_step = held[-1].step_id  # the sampled (last) prefill chunk
        forged = [
            ("b", WireResult(internal, 10_000, token_id=42)),  # a step never sent
            ("a", WireResult(internal, token_step, token_id=42)),  # not the last stage
            ("z", WireResult(internal, token_step, token_id=42)),  # not on the route
            ("b", WireResult("someone#else.0", token_step, token_id=42)),  # not in flight
        ]
        for node, r in forged:
            coord.inbox.deliver(node, r)
        for r in held:  # the acks and the token, from the last stage
            coord.inbox.deliver("b", r)
        coord.inbox.deliver("b", WireResult(internal, token_step, token_id=42))  # again
        first = await nxt
        await _settle()
        for r in a.held:  # type: ignore[attr-defined]
            coord.inbox.deliver("b", r)
        a.held.clear()  # type: ignore[attr-defined]
        await _settle()
        for r in a.held:  # type: ignore[attr-defined]
            coord.inbox.deliver("b", r)
        rest = [ev async for ev in stream]
        tokens = [ev.token_id for ev in [first, *rest]]
        assert tokens == [5, 5, 5], tokens  # no 42 reached the client
        assert coord.inbox.dropped == len(forged) + 1
        for n in coord.nodes.values():
            n.info = None  # type: ignore[assignment]  # the fakes answer no Info
        assert coord.stats().dropped_results == len(forged) + 1
        await coord.close()

    with caplog.at_level(logging.DEBUG, logger="helixserve.coordinator"):
        asyncio.run(main())
    dropped = [r.getMessage() for r in caplog.records if "dropped a result" in r.getMessage()]
    assert len(dropped) == 5
    assert any("not from the route's last stage" in m for m in dropped)
    assert any("was not sent on its route" in m for m in dropped)


def test_an_error_from_a_middle_hop_is_still_taken() -> None:
    """A worker out of KV is rarely the last stage: its error is taken from any hop of the
    route (the request is preempted and replayed), and the client gets every token."""

    async def main() -> None:
        coord = _coordinator()
        a = coord.nodes["a"]
        a.auto = False  # type: ignore[attr-defined]
        stream = coord.generate(_request(3))
        nxt = asyncio.ensure_future(stream.__anext__())
        await _settle()
        (internal,) = coord.active
        step = a.held[-1].step_id  # type: ignore[attr-defined]
        a.held.clear()  # type: ignore[attr-defined]
        a.auto = True  # type: ignore[attr-defined]
        coord.inbox.deliver("a", WireResult(internal, step, status_code=RESOURCE_EXHAUSTED,
                                            error="KvExhaustedError", node="a"))
        first = await nxt
        rest = [ev async for ev in stream]
        assert [ev.token_id for ev in [first, *rest]] == [5, 5, 5]
        assert coord.preemptions == 1 and coord.inbox.dropped == 0
        await coord.close()

    asyncio.run(main())
