"""The coordinator's decode loop over fake workers (no gRPC, no model): the next decode step
leaves when the token arrives, not when the caller reads it; decode steps after the prefill
are continuation items; closing the stream early frees the KV on every hop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from helixserve.errors import UserError
from helixserve.request import GenerationRequest, SamplingParams
from helixserve.runtime.coordinator import Coordinator
from helixserve.runtime.transport import WireItem, WireResult
from helixserve.scheduler import make_router
from helixserve.scheduler.options import router_options
from tests.unit.simulator.conftest import Machine, make_setup, with_flows


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeNode:
    """A route in one: the first hop takes the steps and answers, as the route's last stage
    `b` would, every sampled item with token 5 (when `auto`) and the others with an ack; it
    records what it was sent and released."""

    def __init__(self, coord: Coordinator, name: str, start: int, end: int,
                 continuation: bool) -> None:
        self.coord, self.name, self.start_layer, self.end_layer = coord, name, start, end
        self.kv_capacity_tokens, self.alive, self.queue_len = 100_000, True, 0
        self.address = f"fake-{name}:1"
        self.info = SimpleNamespace(kv_block_size=1)
        self.continuation_ok = continuation
        self.auto = True
        self.sent: list[tuple[str, int, bool]] = []  # (kind, step id, sample)
        self.held: list[WireResult] = []
        self.released: list[str] = []

    def _answer(self, request_id: str, step_id: int, sample: bool) -> None:
        r = WireResult(request_id, step_id, token_id=5 if sample else None)
        if self.auto:
            asyncio.get_running_loop().call_soon(self.coord.inbox.deliver, "b", r)
        else:
            self.held.append(r)

    def send(self, item: WireItem) -> None:
        self.sent.append(("full", item.step_id, item.sample))
        self._answer(item.request_id, item.step_id, item.sample)

    def send_continuation(self, request_id: str, step_id: int, position: int,
                          token_ids: list[int]) -> None:
        self.sent.append(("continuation", step_id, True))
        self._answer(request_id, step_id, True)

    async def release(self, ids: list[str]) -> int:
        self.released += ids
        return len(ids)

    def release_on_stream(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True

    async def check_alive(self, timeout_s: float) -> bool:
        return True

    async def close(self) -> None:
        self.alive = False


def _coordinator(continuation: bool = True) -> Coordinator:
    s = with_flows(make_setup([
        Machine("a", "T4", 0, 2, decode_ms=10.0, max_decode=64),
        Machine("b", "L4", 2, 4, decode_ms=8.0, max_decode=64),
    ]))
    router = make_router("maxflow", s.placement, seed=0,
                         **router_options(s.cluster, s.model, s.placement, s.cost))
    coord = Coordinator(s.placement, Path("."), router, max_queue=10, max_reroutes=3,
                        stats_interval_s=3600.0)
    coord.nodes.update({name: FakeNode(coord, name, a, b, continuation)  # type: ignore[misc]
                        for name, a, b in (("a", 0, 2), ("b", 2, 4))})
    coord.tokenizer, coord.eos_token_ids = FakeTokenizer(), []
    coord.max_model_len, coord.dispatch.chunk_tokens, coord.step_timeout_s = 1000, 4, 3600.0
    return coord


def _request(max_tokens: int = 20) -> GenerationRequest:
    return GenerationRequest("r", list(range(1, 11)), SamplingParams(temperature=0.0),
                             max_tokens=max_tokens, ignore_eos=True)


async def _settle() -> None:
    for _ in range(200):
        await asyncio.sleep(0)


def test_decode_is_not_paced_by_a_slow_reader() -> None:
    async def main() -> None:
        coord = _coordinator()
        stream = coord.generate(_request(20))
        first = await stream.__anext__()
        assert first.token_id == 5 and coord.counts.tokens_generated >= 1
        await _settle()  # the reader holds on to its first token
        # every token was generated and the request finished (KV released on both hops)
        # while the reader had read one
        assert coord.counts.tokens_generated == 20 and not coord.active
        assert all(n.released for n in coord.nodes.values())  # type: ignore[attr-defined]
        rest = [ev async for ev in stream]
        assert len(rest) == 19 and rest[-1].finish_reason == "length"
        assert "".join(ev.text for ev in [first, *rest]) == "<5>" * 20
        await coord.close()

    asyncio.run(main())


@pytest.mark.parametrize("continuation", [True, False])
def test_decode_steps_after_the_prefill_are_continuation_items(continuation: bool) -> None:
    async def main() -> None:
        coord = _coordinator(continuation)
        events = [ev async for ev in coord.generate(_request(6))]
        assert len(events) == 6
        sent = coord.nodes["a"].sent  # type: ignore[attr-defined]
        # 10 prompt tokens in chunks of 4: three full items, the last one sampled
        assert sent[:3] == [("full", sent[0][1], False), ("full", sent[1][1], False),
                            ("full", sent[2][1], True)]
        kinds = {k for k, _, _ in sent[3:]}
        assert len(sent) == 3 + 5 and kinds == {"continuation" if continuation else "full"}
        await coord.close()

    asyncio.run(main())


def test_closing_the_stream_mid_decode_frees_kv_and_stops_the_driver() -> None:
    async def main() -> None:
        coord = _coordinator()
        for n in coord.nodes.values():
            n.auto = False  # type: ignore[attr-defined]
        a = coord.nodes["a"]
        stream = coord.generate(_request(20))
        nxt = asyncio.ensure_future(stream.__anext__())
        await _settle()
        for r in a.held:  # type: ignore[attr-defined]
            coord.inbox.deliver("b", r)  # the prefill's acks and first token
        await nxt
        await _settle()
        internal = next(iter(coord.active))
        assert a.sent[-1][0] == "continuation"  # type: ignore[attr-defined]
        await stream.aclose()
        await _settle()
        assert not coord.active
        assert all(n.released == [internal] for n in coord.nodes.values())  # type: ignore[attr-defined]
        sent = len(a.sent)  # type: ignore[attr-defined]
        coord.inbox.deliver("b", WireResult(internal, a.sent[-1][1], token_id=5))  # type: ignore[attr-defined]
        await _settle()
        assert len(a.sent) == sent  # type: ignore[attr-defined]  # nothing more was sent
        await coord.close()

    asyncio.run(main())


def test_a_direct_callers_request_is_checked_once_by_the_coordinator() -> None:
    async def main() -> None:
        coord = _coordinator()
        bad = GenerationRequest("r", [1, 2], SamplingParams(top_p=2.0), max_tokens=3)
        with pytest.raises(UserError, match="top_p"):
            async for _ in coord.generate(bad):
                pass
        long = GenerationRequest("r", [1] * 1000, SamplingParams(), max_tokens=3)
        with pytest.raises(UserError, match="context is 1000"):
            async for _ in coord.generate(long):
                pass
        # a request checked for this context length (the API's) is trusted as it is
        ok = _request(2).validate(coord.max_model_len)
        assert ok.checked_for_len == 1000
        assert len([ev async for ev in coord.generate(ok)]) == 2
        await coord.close()

    asyncio.run(main())


def test_a_reader_cancelled_by_anyio_still_frees_the_kv() -> None:
    """Starlette cancels a gone client's stream through anyio, which cancels again at every
    await: closing the stream must free the KV without awaiting anything first."""
    import anyio

    async def main() -> None:
        coord = _coordinator()
        for n in coord.nodes.values():
            n.auto = False  # type: ignore[attr-defined]
        a = coord.nodes["a"]

        async def read() -> None:
            async for _ in coord.generate(_request(20)):
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await _settle()
            for r in a.held:  # type: ignore[attr-defined]
                coord.inbox.deliver("b", r)
            await _settle()
            internal = next(iter(coord.active))
            tg.cancel_scope.cancel()
        await _settle()
        assert not coord.active
        assert all(n.released == [internal] for n in coord.nodes.values())  # type: ignore[attr-defined]
        await coord.close()

    asyncio.run(main())


def test_a_reroute_health_checks_each_hop_with_the_hang_timeout() -> None:
    """A re-route asks every hop of the failed route whether it is alive, with the deadline a
    live worker's Info gets (CoordinatorConfig.hang_timeout_s, scaled by rehearsals), not 1 s:
    on a saturated host one slow answer took a node down."""
    from helixserve.runtime.config import CoordinatorConfig
    from helixserve.runtime.transport import UNAVAILABLE

    assert Coordinator.hang_timeout_s == CoordinatorConfig().hang_timeout_s

    async def main() -> None:
        coord = _coordinator()
        coord.hang_timeout_s = 37.5  # as `create` sets it from the config
        a = coord.nodes["a"]
        deadlines: list[tuple[str, float]] = []
        failed: list[bool] = []
        answer = a._answer  # type: ignore[attr-defined]

        def fail_first_sampled(request_id: str, step_id: int, sample: bool) -> None:
            if sample and not failed:  # the first token: "the next hop is unreachable"
                failed.append(True)
                r = WireResult(request_id, step_id, status_code=UNAVAILABLE,
                               error="next hop fake-b:1 unreachable: UNAVAILABLE")
                asyncio.get_running_loop().call_soon(coord.inbox.deliver, "a", r)
            else:
                answer(request_id, step_id, sample)

        a._answer = fail_first_sampled  # type: ignore[attr-defined]
        for node in coord.nodes.values():
            async def check_alive(timeout_s: float, name: str = node.name) -> bool:
                deadlines.append((name, timeout_s))
                return True
            node.check_alive = check_alive  # type: ignore[method-assign]
        events = [ev async for ev in coord.generate(_request(3))]
        assert len(events) == 3 and coord.counts.reroutes == 1
        assert sorted(deadlines) == [("a", 37.5), ("b", 37.5)]
        await coord.close()

    asyncio.run(main())
