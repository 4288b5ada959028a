"""Faults: a link between two workers broken mid-request, the first hop's link cut before a
prompt_logprobs request's first token, the last hop's link broken part-way through such a
request's chunked prefill, a worker killed mid-request (and brought back), and a worker
drained by SIGTERM.

Own workers (this module kills them): n0 [0,10) n1 [10,20) n2 [20,30) and m [0,25), m started
with `--placement P --node m`. The placement's flows send almost everything along n0-n1-n2,
with m-n2 as the spare route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_procs import (
    NUM_LAYERS,
    CuttableProxy,
    WorkerProc,
    make_cluster,
    make_placement,
    start_worker,
    stop_workers,
    wait_ready,
)

from helixserve.engine import ShardEngine, WorkItem
from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest, NoRouteError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 24
#: requests after n1's revival within which its route must serve again (the flow term's
#: bound with cache-aware routes, test_killed_worker_request_continues_on_another_route)
AGAIN_MAX = 5
PROMPT = "Tell me a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def fault_workers(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    tmp = tmp_path_factory.mktemp("fault-workers")
    placement_path = tmp / "placement.json"
    placement().save(placement_path)
    specs = [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30), ("m", 0, 25)]
    # m finds its range in the placement file, as under Kubernetes
    procs = [start_worker(demo_model, n, a, b, tmp, extra=["--drain-timeout-s", "20"],
                          placement=placement_path if n == "m" else None)
             for n, a, b in specs]
    try:
        wait_ready(procs)
        yield {w.name: w for w in procs}
    finally:
        stop_workers(procs)


def placement():
    return make_placement(
        [("n0", 0, 10), ("n1", 10, 20), ("n2", 20, 30), ("m", 0, 25)],
        [("coordinator", "n0", 100), ("coordinator", "m", 3), ("n0", "n1", 100),
         ("n1", "n2", 100), ("m", "n2", 3), ("n2", "coordinator", 103)],
    )


@pytest.fixture(scope="module")
def prompt_and_reference(demo_model: Path) -> tuple[list[int], list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = ShardEngine.load(demo_model, 0, NUM_LAYERS, kv_cache_bytes=32 * 1024 * 1024)
    rid = uuid.uuid4().hex
    tokens = [engine.step([WorkItem(rid, 0, NUM_LAYERS, 0, prompt, None, GREEDY)])[0].token_id]
    while len(tokens) < MAX_TOKENS:
        pos = len(prompt) + len(tokens) - 1
        tokens.append(engine.step([WorkItem(rid, 0, NUM_LAYERS, pos, [tokens[-1]], None, GREEDY)])[0].token_id)
    torch.set_num_threads(threads)
    return prompt, tokens


def test_broken_link_between_workers_reroutes_at_once(fault_workers, demo_model,
                                                      prompt_and_reference, caplog):
    """n0's stream to n1 swallows an item and breaks while n1 stays up: n0 reports the items
    it had sent on that stream, and the coordinator replays the request at once instead of
    waiting for its step timeout (set longer than this test may run)."""
    prompt, reference = prompt_and_reference
    proxy = CuttableProxy(fault_workers["n1"].port)
    workers = [dataclasses.replace(w, port=proxy.port) if w.name == "n1" else w
               for w in fault_workers.values()]

    async def main() -> tuple[list[int], dict, int]:
        coord = await Coordinator.create(make_cluster(workers), placement(), demo_model,
                                         CoordinatorConfig(step_timeout_s=600.0))
        own = proxy.num_connections  # the coordinator's connection(s) to n1
        cut = 0
        try:
            ids: list[int] = []
            req = GenerationRequest("link", prompt, GREEDY, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for ev in coord.generate(req):
                ids.append(ev.token_id)
                if len(ids) == 5:
                    assert coord.stats().routes == {"n0->n1->n2": 1}
                    cut = proxy.cut(own)  # n0 -> n1 only
            return ids, coord.stats(), cut
        finally:
            await coord.close()

    try:
        with caplog.at_level(logging.WARNING, logger="helixserve.coordinator"):
            ids, stats, cut = asyncio.run(main())
    finally:
        proxy.close()
    assert cut >= 1
    assert ids == reference
    assert stats.reroutes >= 1
    reasons = [r.getMessage() for r in caplog.records if "re-routing" in r.getMessage()]
    assert reasons and all("fate unknown" in m for m in reasons), reasons
    assert all(n.alive for n in stats.nodes.values()), stats.nodes


async def _generate(coord: Coordinator, request_id: str, prompt: list[int],
                    sampling: SamplingParams) -> tuple[GenerationRequest, list]:
    req = GenerationRequest(request_id, prompt, sampling, max_tokens=4, ignore_eos=True)
    return req, [ev async for ev in coord.generate(req)]


def _assert_prompt_scored_once(healthy: list, faulty: list, prompt: list[int]) -> None:
    """Same tokens as the healthy run; every prompt position scored once, with the first
    token, within 2e-3 of the healthy run's scores."""
    assert [ev.token_id for ev in faulty] == [ev.token_id for ev in healthy]
    for events in (healthy, faulty):
        first = events[0].prompt_logprobs
        assert first is not None and [p.token_id for p in first] == prompt[1:]
        assert all(ev.prompt_logprobs is None for ev in events[1:])  # once
    ref, got = healthy[0].prompt_logprobs, faulty[0].prompt_logprobs
    assert [p.logprob for p in got] == pytest.approx([p.logprob for p in ref], abs=2e-3)


def test_prompt_logprobs_come_once_from_the_route_that_served(fault_workers, demo_model,
                                                             prompt_and_reference, caplog):
    """The first route fails before the first token: the re-routed request scores the prompt
    on its new route, and the scores come once, with the first token, as on a healthy stack.

    The coordinator's link to n0 (the first hop) is cut right before the request is admitted:
    n0 never sees the request, so no token can come back from that route. The coordinator
    learns of the cut only when it next awaits, after it has routed the request over n0."""
    prompt, _ = prompt_and_reference
    ask = dataclasses.replace(GREEDY, prompt_logprobs=2)
    proxy = CuttableProxy(fault_workers["n0"].port)
    workers = [dataclasses.replace(w, port=proxy.port) if w.name == "n0" else w
               for w in fault_workers.values()]

    async def run(coord: Coordinator, request_id: str) -> list:
        req, events = await _generate(coord, request_id, prompt, ask)
        assert req.sampling is ask  # the caller's request is left as it was: reusable
        return events

    async def main() -> tuple[list, list, dict, dict, int]:
        coord = await Coordinator.create(make_cluster(workers), placement(), demo_model)
        try:
            healthy = await run(coord, "healthy")
            before = coord.stats()
            # only the coordinator talks to n0; no await between the cut and the routing
            cut = proxy.cut(0)
            faulty = await run(coord, "cut")
            return healthy, faulty, before, coord.stats(), cut
        finally:
            await coord.close()

    try:
        with caplog.at_level(logging.WARNING, logger="helixserve.coordinator"):
            healthy, faulty, before, after, cut = asyncio.run(main())
    finally:
        proxy.close()
    assert before.routes == {"n0->n1->n2": 1} and before.reroutes == 0
    assert cut >= 1
    assert after.reroutes == 1, after
    # the first two routes, then the re-route: m->n2, or n0->n1->n2 if n0 came back first
    assert after.routes.get("n0->n1->n2", 0) >= 2, after.routes
    assert sum(after.routes.values()) == 3, after.routes
    reasons = [r.getMessage() for r in caplog.records if "re-routing" in r.getMessage()]
    assert len(reasons) == 1 and "node n0 failed" in reasons[0], reasons
    _assert_prompt_scored_once(healthy, faulty, prompt)
    ref, got = healthy[0].prompt_logprobs, faulty[0].prompt_logprobs
    assert [p.top_logprobs[0][1] for p in got] == pytest.approx(
        [p.top_logprobs[0][1] for p in ref], abs=2e-3)


def test_prompt_logprobs_after_a_break_mid_prefill(fault_workers, demo_model):
    """The last stage has scored part of a chunked prompt when its stream from n1 breaks:
    the re-routed request scores the whole prompt again under a fresh id, and its first
    token carries every prompt position's score exactly once, as on a healthy run.

    Chunks of 8 tokens; n1's connection to n2 (through a proxy) passes 2.5 fp32 chunks'
    worth of bytes of the faulty request, then swallows the rest and breaks: n2 has received
    (and scored) the first chunks but not the rest."""
    import json

    from transformers import AutoTokenizer

    chunk = 8
    tok = AutoTokenizer.from_pretrained(str(demo_model))
    text = tok.apply_chat_template([{"role": "user", "content": " ".join([PROMPT] * 8)}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    hidden = json.loads((demo_model / "config.json").read_text())["hidden_size"]
    fp32_chunk_bytes = chunk * hidden * 4
    # a partial prefill whatever the wire dtype (2 or 4 bytes): >= 2 chunks through, and
    # fewer than all of them
    assert len(prompt) // chunk * chunk * hidden * 2 > 2.5 * fp32_chunk_bytes
    ask = dataclasses.replace(GREEDY, prompt_logprobs=1)
    proxy = CuttableProxy(fault_workers["n2"].port)
    workers = [dataclasses.replace(w, port=proxy.port) if w.name == "n2" else w
               for w in fault_workers.values()]

    async def main() -> tuple[list, list, dict, dict]:
        coord = await Coordinator.create(make_cluster(workers), placement(), demo_model,
                                         CoordinatorConfig(prefill_chunk_tokens=chunk,
                                                           step_timeout_s=600.0))
        try:
            own = proxy.num_connections  # the coordinator's connection(s) to n2
            _, healthy = await _generate(coord, "healthy", prompt, ask)
            assert proxy.num_connections == own + 1  # n1's stream to n2
            before = coord.stats()
            proxy.arm(own, int(2.5 * fp32_chunk_bytes))
            _, faulty = await _generate(coord, "mid-prefill", prompt, ask)
            assert proxy.tripped(own)
            return healthy, faulty, before, coord.stats()
        finally:
            await coord.close()

    try:
        healthy, faulty, before, after = asyncio.run(main())
    finally:
        proxy.close()
    assert len(prompt) > 10 * chunk
    assert before.routes == {"n0->n1->n2": 1}
    assert after.reroutes - before.reroutes == 1, after
    # every position once: nothing left over from the first attempt's partial scoring
    _assert_prompt_scored_once(healthy, faulty, prompt)


def test_killed_worker_request_continues_on_another_route(fault_workers, demo_model,
                                                          prompt_and_reference):
    """...and when n1 comes back (a new process on the same address, as a restarted pod),
    the coordinator notices, and n1's route serves again.

    What the design promises, whatever the timing (how many tries the dead route got before
    n1 was declared down is not part of it): every request completes with the single
    engine's tokens; once n1 is down no request is routed through it; once it is back it
    serves again."""
    prompt, reference = prompt_and_reference
    old_n1 = fault_workers["n1"]

    async def generate(coord: Coordinator, request_id: str) -> list[int]:
        req = GenerationRequest(request_id, prompt, GREEDY, max_tokens=MAX_TOKENS,
                                ignore_eos=True)
        return [ev.token_id async for ev in coord.generate(req)]

    def through_n1(stats: Any) -> int:
        return sum(n for route, n in stats.routes.items() if "n1" in route.split("->"))

    async def main() -> tuple[list[int], Any, list[int], Any, list[list[int]], Any]:
        # cache-aware routes (the default): once n1 is back, m->n2 holds the prompt (it ran
        # there while n1 was down) and the revived n1 holds nothing
        coord = await Coordinator.create(make_cluster(list(fault_workers.values())), placement(),
                                         demo_model)
        revived = None
        try:
            ids: list[int] = []
            req = GenerationRequest("ft", prompt, GREEDY, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for ev in coord.generate(req):
                ids.append(ev.token_id)
                if len(ids) == 5:
                    assert coord.stats().routes == {"n0->n1->n2": 1}
                    old_n1.proc.send_signal(signal.SIGKILL)
            after_kill = coord.stats()
            old_n1.proc.wait(timeout=30)
            # n1 is down: a new request is served without it
            down = await generate(coord, "ft-down")
            while_down = coord.stats()

            revived = start_worker(demo_model, "n1", 10, 20, old_n1.log_path.parent,
                                   port=old_n1.port, log_name="n1-revived")
            await asyncio.to_thread(wait_ready, [revived])
            for _ in range(300):  # the coordinator retries a down node every 2 s
                if coord.stats().nodes["n1"].alive:
                    break
                await asyncio.sleep(0.1)
            # m->n2 saves the whole prompt, but its flow share is 3 of 103 and the requests
            # it served while n1 was down put it about one request's work over that share
            # each: the flow term (prefix_flow_weight, docs/prefix-caching.md "Routing")
            # lets it keep the prompt only while it is less than prompt / 0.25 tokens of
            # work over its share, so within a few requests n1's route serves again
            again: list[list[int]] = []
            while len(again) < AGAIN_MAX:
                again.append(await generate(coord, f"ft-again-{len(again)}"))
                if through_n1(coord.stats()) > through_n1(while_down):
                    break
            return ids, after_kill, down, while_down, again, coord.stats()
        finally:
            await coord.close()
            if revived is not None:
                stop_workers([revived])

    ids, after_kill, down, while_down, again, final = asyncio.run(main())
    # no gap, no duplicate: the greedy continuation is exactly the single engine's
    assert ids == reference
    assert after_kill.nodes["n1"].alive is False
    assert "m->n2" in after_kill.routes, after_kill.routes
    # down: the new request completes, and no route through n1 was handed out for it
    assert down == reference
    assert through_n1(while_down) == through_n1(after_kill), (after_kill, while_down)
    # back: alive, and routes through n1 are handed out again
    assert final.nodes["n1"].alive is True
    assert again == [reference] * len(again)
    assert through_n1(final) > through_n1(while_down), final.routes


def test_sigterm_drains_active_requests_then_refuses(fault_workers, demo_model,
                                                     prompt_and_reference):
    prompt, reference = prompt_and_reference
    n2 = fault_workers["n2"]

    async def main() -> list[int]:
        alive = [w for w in fault_workers.values() if w.proc.poll() is None]
        live_placement = make_placement(
            [("n2", 20, 30), ("m", 0, 25)],
            [("coordinator", "m", 1), ("m", "n2", 1), ("n2", "coordinator", 1)],
        )
        coord = await Coordinator.create(make_cluster(alive), live_placement, demo_model)
        try:
            ids: list[int] = []
            req = GenerationRequest("drain", prompt, GREEDY, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for ev in coord.generate(req):
                ids.append(ev.token_id)
                if len(ids) == 3:
                    n2.proc.send_signal(signal.SIGTERM)
            # n2 drained our request; now it refuses new work and no route is left
            with pytest.raises(NoRouteError):
                async for _ in coord.generate(GenerationRequest("late", prompt, GREEDY, 4)):
                    pass
            return ids
        finally:
            await coord.close()

    ids = asyncio.run(main())
    assert ids == reference
    assert n2.proc.wait(timeout=30) == 0
    assert "stopped (0 requests failed at shutdown)" in n2.log()
