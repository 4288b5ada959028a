"""Prefix caching in the runtime, without gRPC or a model (docs/prefix-caching.md): the wire
carries a first item's cached prefix and a worker's cache events and checks both; a worker
sends its engine's events on every coordinator stream before the step's results (a new
stream first gets all it holds, with reset) and answers a PrefixMissError "prefix miss"; the
coordinator starts the prefill at the admission's cached tokens with the prefix on the first
item, and after a prefix miss forgets the blocks and runs the request again, uncounted;
usage and /metrics report it."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from helixserve.engine.errors import PrefixMissError
from helixserve.prefix import CacheEvents, block_hashes
from helixserve.request import GenerationRequest, SamplingParams
from helixserve.runtime import transport as tp
from helixserve.runtime.coordinator import Coordinator
from helixserve.runtime.stats import CoordinatorStats, NodeStats
from helixserve.runtime.worker import Worker, _Stream
from tests.unit.runtime.test_coordinator_decode import FakeNode, _coordinator
from tests.unit.runtime.test_worker_messages import (
    FakeEngine,
    _full,
    open_coordinator_stream,
)

H = [bytes([i]) * 16 for i in range(6)]  # block names: 16 bytes each


# ---- the wire ----------------------------------------------------------------------------


def test_a_first_items_prefix_round_trips_and_must_be_the_tokens_before_its_position() -> None:
    msg = _full("r")
    msg.position, msg.prefix_token_ids[:] = 4, [7, 7, 7, 7]
    expect = tp.ExpectedInput(0, 2, 4, 8, torch.float32)
    assert tp.item_from_pb(msg, expect).prefix_token_ids == [7, 7, 7, 7]
    assert tp.item_from_pb(_full("r"), expect).prefix_token_ids is None
    msg.prefix_token_ids.append(7)
    with pytest.raises(tp.WireError, match=r"items\[r\]\.prefix_token_ids: 5 tokens.*position 4"):
        tp.item_from_pb(msg, expect, "items")
    kept = tp.RequestRoute.of(tp.item_from_pb(_full("r"), expect))
    cont = tp.continuation_to_pb("r", 2, 4, [9])
    cont.prefix_token_ids[:] = [1, 2, 3, 4]
    with pytest.raises(tp.WireError, match="prefix_token_ids: set on a continuation item"):
        tp.continuation_from_pb(cont, kept, expect)


def test_cache_events_round_trip_merge_in_order_and_reject_bad_names() -> None:
    ev = CacheEvents([H[0], H[1]], [H[2]], reset=True)
    assert tp.cache_events_from_pb(tp.cache_events_to_pb("a", ev)) == ev
    with pytest.raises(tp.WireError, match=r"cache\.removed\[0\]: 3 bytes"):
        tp.cache_events_from_pb(tp.pb.CacheEvents(stored=[H[0]], removed=[b"abc"]))
    first = tp.cache_events_to_pb("a", CacheEvents([H[0], H[1]], [H[2]], reset=True))
    then = tp.cache_events_to_pb("a", CacheEvents([H[2]], [H[0], H[3]]))
    merged = tp.cache_events_from_pb(tp.merge_cache_events(first, then))
    assert (set(merged.stored), set(merged.removed), merged.reset) == (
        {H[1], H[2]}, {H[0], H[3]}, True)
    reset = tp.cache_events_to_pb("a", CacheEvents([H[4]], [], reset=True))
    assert tp.merge_cache_events(first, reset) == reset


# ---- the worker --------------------------------------------------------------------------


class CachingEngine(FakeEngine):
    """A last stage whose prefix cache holds H[0] and H[1]; `take_cache_events` hands over
    what the test queued."""

    start_layer, end_layer = 2, 4

    def __init__(self) -> None:
        self.events: list[CacheEvents] = []

    def take_cache_events(self) -> CacheEvents:
        return self.events.pop(0) if self.events else CacheEvents()


def _caching_worker() -> Worker:
    return Worker(CachingEngine(), node="b", model="m", backend="torch", device="cpu")


def test_worker_reports_cache_events_before_results_and_all_it_holds_to_a_new_stream() -> None:
    async def main() -> None:
        w = _caching_worker()
        w.loop = asyncio.get_running_loop()
        w._send_cache(CacheEvents([H[0], H[1], H[2]], [], reset=True))
        (results, first), stream = await open_coordinator_stream(w)
        hello = await asyncio.wait_for(first, 5)
        # a new coordinator stream: everything held, with reset, before anything else
        assert hello.cache.reset and set(hello.cache.stored) == {H[0], H[1], H[2]}
        assert not hello.results and hello.cache.node == "b"
        upstream = _Stream(coordinator_id="", sender="a")
        jobs = [w._accept(_full(f"r{i}", hop=1, step=i), upstream, "i") for i in range(2)]
        outputs: list[Any] = [SimpleNamespace(token_id=7, logprob=None, top_logprobs=None,
                                              prompt_logprobs=None),
                              PrefixMissError("r1", [H[4]])]
        w._dispatch([j for j in jobs if j is not None], outputs, 0.01,
                    CacheEvents([H[3]], [H[0]]))
        batch = await asyncio.wait_for(results.__anext__(), 5)
        # one message: the step's cache events, then its results
        assert (list(batch.cache.stored), list(batch.cache.removed)) == ([H[3]], [H[0]])
        assert not batch.cache.reset and w.cache_held == {H[1], H[2], H[3]}
        ok, miss = (tp.result_from_pb(r) for r in batch.results)
        assert ok.token_id == 7 and ok.ok
        assert miss.status_code == tp.FAILED_PRECONDITION and miss.prefix_miss
        assert miss.error == "prefix miss: node b: request 'r1': 1 prefix block(s) not cached here"
        assert miss.prefix_missing == [H[4]]
        await results.aclose()

    asyncio.run(main())


def test_engine_thread_takes_cache_events_after_each_step() -> None:
    w = _caching_worker()
    sent: list[Any] = []
    w.loop = SimpleNamespace(call_soon_threadsafe=lambda f, *a: sent.append((f, a)))  # type: ignore[assignment]
    engine = w.engine
    engine.events = [CacheEvents([H[5]], [])]
    engine.step = lambda items: [SimpleNamespace() for _ in items]
    upstream = _Stream(coordinator_id="", sender="a")
    job = w._accept(_full("r", hop=1), upstream, "i")
    assert job is not None
    w._run_step([job])
    (fn, args), = sent
    assert fn == w._dispatch and args[3] == CacheEvents([H[5]], [])


# ---- the coordinator ---------------------------------------------------------------------


class PrefixNode(FakeNode):
    """FakeNode recording each full item's (position, token ids, prefix); with `miss`, the
    route's last stage answers the first item carrying a prefix with a prefix miss."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.info = SimpleNamespace(kv_block_size=4)
        self.items: list[tuple[int, list[int], list[int] | None]] = []
        self.miss = False

    def send(self, item: tp.WireItem) -> None:
        self.items.append((item.position, item.token_ids, item.prefix_token_ids))
        if item.prefix_token_ids and self.miss:
            self.miss = False
            r = tp.WireResult(item.request_id, item.step_id, status_code=tp.FAILED_PRECONDITION,
                              error="prefix miss: node b: 2 of 2 blocks not cached", node="a")
            # it comes on b's stream (whatever the message says)
            asyncio.get_running_loop().call_soon(self.coord.inbox.deliver, "b", r)
            return
        super().send(item)


PROMPT = list(range(1, 11))  # 10 tokens: blocks of 4 -> 8 may come from cache


def _prefix_coordinator() -> Coordinator:
    coord = _coordinator()
    coord.nodes.update({name: PrefixNode(coord, name, a, b, True)  # type: ignore[misc]
                        for name, a, b in (("a", 0, 2), ("b", 2, 4))})
    coord._sync_nodes()
    for name, a, b in (("a", 0, 2), ("b", 2, 4)):
        coord.core.on_cache_events(name, CacheEvents(block_hashes(PROMPT, 4, a, b),
                                                     reset=True))
    return coord


def _generate(coord: Coordinator, max_tokens: int = 3) -> list[Any]:
    req = GenerationRequest("r", list(PROMPT), SamplingParams(temperature=0.0),
                            max_tokens=max_tokens, ignore_eos=True)

    async def run() -> list[Any]:
        return [ev async for ev in coord.generate(req)]

    return asyncio.run(run())


def test_prefill_starts_at_the_cached_tokens_with_the_prefix_on_its_first_item() -> None:
    coord = _prefix_coordinator()
    coord.dispatch.chunk_tokens = 1  # one token per chunk: only the first carries the prefix
    events = _generate(coord)
    items = coord.nodes["a"].items  # type: ignore[attr-defined]
    assert items[:2] == [(8, [9], PROMPT[:8]), (9, [10], None)]
    assert events[0].cached_tokens == 8 and all(e.cached_tokens is None for e in events[1:])
    assert coord.core.prefix_totals() == (10, 8) and coord.counts.prefix_misses == 0


def test_no_prefix_caching_prefills_everything() -> None:
    coord = _prefix_coordinator()
    coord.core.policy = dataclasses.replace(coord.core.policy, prefix_caching=False)
    events = _generate(coord)
    assert coord.nodes["a"].items[0] == (0, PROMPT[:4], None)  # type: ignore[attr-defined]
    assert events[0].cached_tokens == 0
    assert coord.core.prefix_totals() == (0, 0)


def test_a_prefix_miss_forgets_the_blocks_and_runs_the_request_again_uncounted() -> None:
    coord = _prefix_coordinator()
    coord.nodes["a"].miss = True  # type: ignore[attr-defined]
    events = _generate(coord)
    items = coord.nodes["a"].items  # type: ignore[attr-defined]
    # first from the cached 8 tokens; after the miss from token 0, nothing cached on b
    assert items[0] == (8, [9, 10], PROMPT[:8])
    assert items[1] == (0, PROMPT[:4], None)
    assert [e.token_id for e in events] == [5, 5, 5] and events[0].cached_tokens == 0
    assert coord.counts.prefix_misses == 1 and coord.counts.reroutes == 0
    assert coord.core.prefix_totals() == (10, 0)  # counted once: the admission that ran
    # the old attempt's KV was released on both hops
    assert all(n.released for n in coord.nodes.values())  # type: ignore[attr-defined]
    # b's blocks of the prefix are forgotten: the next request computes it all again
    before = len(items)
    _generate(coord)
    assert items[before][0] == 0 and coord.counts.prefix_misses == 1


def test_a_node_down_forgets_what_it_held() -> None:
    coord = _prefix_coordinator()
    coord._on_node_down("b", "stream broke")
    coord.core.node_up("b")  # back, but its new stream has not reported yet
    _generate(coord)
    assert coord.nodes["a"].items[0][0] == 0  # type: ignore[attr-defined]


def test_prompt_logprobs_requests_take_nothing_from_cache() -> None:
    coord = _prefix_coordinator()
    req = GenerationRequest("r", list(PROMPT), SamplingParams(temperature=0.0, prompt_logprobs=1),
                            max_tokens=2, ignore_eos=True)

    async def run() -> list[Any]:
        return [ev async for ev in coord.generate(req)]

    events = asyncio.run(run())
    assert coord.nodes["a"].items[0][0] == 0 and events[0].cached_tokens == 0  # type: ignore[attr-defined]


# ---- API ---------------------------------------------------------------------------------


def test_usage_reports_cached_prompt_tokens_once_per_prompt() -> None:
    from helixserve.api.serving import Batch, Choice

    def choice(i: int, prompt_index: int, cached: int) -> Choice:
        c = Choice(i, prompt_index, [1] * 10, "", request=None, token_ids=[5, 5])  # type: ignore[arg-type]
        c.cached_tokens = cached
        return c

    batch = Batch("id", 0, [choice(0, 0, 8), choice(1, 0, 0), choice(2, 1, 4)],
                  [[1] * 10, [2] * 10])
    assert batch.usage() == {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26,
                             "prompt_tokens_details": {"cached_tokens": 12}}


def test_prefix_cache_counters_total_and_per_live_node() -> None:
    from helixserve.api.metrics import ServingMetrics

    stats = CoordinatorStats(
        nodes={"n1": NodeStats(prefix_cache_queries=30, prefix_cache_hits=16),
               "n2": NodeStats(alive=False, prefix_cache_queries=5, prefix_cache_hits=1)},
        prefix_cache_queries=30, prefix_cache_hits=16, prefix_misses=2)
    text = ServingMetrics("m", lambda: stats).render()[0].decode()
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value
         for fam in text_string_to_metric_families(text) for x in fam.samples}
    lm, n1 = (("model_name", "m"),), (("model_name", "m"), ("node", "n1"))
    assert s[("vllm:prefix_cache_queries_total", lm)] == 30
    assert s[("vllm:prefix_cache_hits_total", lm)] == 16
    assert s[("vllm:prefix_cache_queries_total", n1)] == 30
    assert s[("vllm:prefix_cache_hits_total", n1)] == 16
    assert not any(dict(labels).get("node") == "n2" for name, labels in s
                   if name.startswith("vllm:prefix_cache"))
    assert s[("helixserve:prefix_cache_misses_total", lm)] == 2


# ---- flags -------------------------------------------------------------------------------


class _Loaded(Exception):
    """Raised by the patched engine loader with the keyword arguments it got."""


@pytest.mark.parametrize("flag", [[], ["--no-prefix-caching"]])
def test_worker_flag_turns_the_engines_prefix_caching_off(tmp_path, monkeypatch, flag) -> None:
    from helixserve.cli import main
    from helixserve.engine import registry

    def load_checked(*args: Any, **kw: Any) -> Any:
        raise _Loaded(kw)

    monkeypatch.setattr(registry, "load_checked", load_checked)
    with pytest.raises(_Loaded) as got:
        main(["worker", "--model", str(tmp_path), "--layers", "0:2", "--port", "0",
              "--engine", "torch", *flag])
    assert got.value.args[0]["prefix_caching"] is (not flag)


@pytest.mark.parametrize("flags", [[], ["--no-prefix-caching"], ["--no-cache-aware-routing"]])
def test_serve_flags_reach_the_coordinator_config(tmp_path, monkeypatch, flags) -> None:
    from helixserve.cli import main
    from helixserve.local import stack

    got: dict[str, Any] = {}

    async def run_stack(*args: Any, **kw: Any) -> None:
        got.update(kw)

    monkeypatch.setattr(stack, "run_stack", run_stack)
    assert main(["serve", "--cluster", str(tmp_path / "c.yaml"), "--placement",
                 str(tmp_path / "p.json"), "--model", str(tmp_path), "--host", "127.0.0.1",
                 *flags]) == 0
    assert got["prefix_caching"] == ("--no-prefix-caching" not in flags)
    assert got["cache_aware_routing"] == ("--no-cache-aware-routing" not in flags)
