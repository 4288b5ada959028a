"""Prefix caching through the real runtime (docs/prefix-caching.md): worker processes on
127.0.0.1 with the demo weights, real gRPC, the real coordinator.

A second request sharing a long system prompt takes it from the caches of both hops of its
route (the first item carries the prefix, and the first hop forwards it) and generates the
same greedy tokens as a worker started with --no-prefix-caching, which reuses nothing. A
prefix the coordinator believes cached but a hop does not hold (what eviction after the hop's
last report looks like; forced here by reporting blocks the workers never had) is refused,
and the request runs again from token 0 with the same output, without counting a re-route.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from runtime_procs import (
    WorkerProc,
    make_cluster,
    make_placement,
    start_worker,
    stop_workers,
    wait_ready,
)

from helixserve.prefix import CacheEvents, block_hashes
from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence. "
          "Never invent tracking numbers; if a customer asks about a parcel, ask for its "
          "number. Prices are in euros. Opening hours are nine to five, Monday to Friday. "
          "Parcels within the country arrive in two working days, abroad in five. Returns are "
          "free for thirty days; the customer prints the label from the website. ")
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0)
BLOCK = 16  # the torch engine's KV block size


@pytest.fixture(scope="module")
def procs(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProc]]:
    """p0 [0,12) + p1 [12,30) with prefix caching (a two-hop route); solo [0,30) with
    --no-prefix-caching."""
    tmp = tmp_path_factory.mktemp("prefix")
    ps = [start_worker(demo_model, "p0", 0, 12, tmp), start_worker(demo_model, "p1", 12, 30, tmp),
          start_worker(demo_model, "solo", 0, 30, tmp, extra=["--no-prefix-caching"])]
    try:
        wait_ready(ps)
        yield {w.name: w for w in ps}
    finally:
        stop_workers(ps)


@pytest.fixture(scope="module")
def tokenize(demo_model: Path) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))

    def chat(system: str, question: str) -> list[int]:
        text = tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    return chat


async def _coordinator(procs: dict[str, WorkerProc], names: list[str], model: Path,
                       **config: Any) -> Coordinator:
    ws = [procs[n] for n in names]
    hops = zip(names, names[1:], strict=False)
    flows = [("coordinator", names[0], 1), *((a, b, 1) for a, b in hops),
             (names[-1], "coordinator", 1)]
    placement = make_placement([(w.name, w.start_layer, w.end_layer) for w in ws], flows)
    return await Coordinator.create(make_cluster(ws), placement, model,
                                    CoordinatorConfig(**config))


async def _generate(coord: Coordinator, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """(greedy tokens, the prompt tokens taken from cache)."""
    req = GenerationRequest(rid, prompt, GREEDY, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens, cached = [], None
    async for ev in coord.generate(req):
        tokens.append(ev.token_id)
        if cached is None:
            cached = ev.cached_tokens
    assert cached is not None
    return tokens, cached


def test_a_shared_system_prompt_comes_from_cache_with_the_same_greedy_output(
        procs: dict[str, WorkerProc], tokenize: Any, demo_model: Path) -> None:
    first = tokenize(SYSTEM, "Where is my parcel?")
    second = tokenize(SYSTEM, "When do you open on Monday?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 4 * BLOCK, shared  # a long common prefix

    async def main() -> None:
        solo = await _coordinator(procs, ["solo"], demo_model)
        pipe = await _coordinator(procs, ["p0", "p1"], demo_model)
        try:
            want, _ = await _generate(solo, "ref-2", second)
            got1, cached1 = await _generate(pipe, "pipe-1", first)
            assert cached1 == 0
            got2, cached2 = await _generate(pipe, "pipe-2", second)
            # whole blocks of the shared system prompt, on both hops
            assert cached2 == shared // BLOCK * BLOCK, (cached2, shared)
            assert got2 == want
            stats = pipe.stats()
            assert stats.prefix_cache_queries == len(first) + len(second)
            assert stats.prefix_cache_hits == cached2 and stats.prefix_misses == 0
            for node in ("p0", "p1"):
                assert stats.nodes[node].prefix_cache_hits == cached2
            # the worker started with --no-prefix-caching keeps nothing: the same prompt
            # again, on a coordinator that would reuse it, is computed in full
            again, cached = await _generate(solo, "ref-2-again", second)
            assert cached == 0 and again == want
        finally:
            await pipe.close()
            await solo.close()

    asyncio.run(main())


def test_a_prefix_miss_runs_the_request_again_from_token_0(
        procs: dict[str, WorkerProc], tokenize: Any, demo_model: Path) -> None:
    prompt = tokenize("You answer in French. " * 8, "Name a colour.")

    async def main() -> None:
        solo = await _coordinator(procs, ["solo"], demo_model)
        pipe = await _coordinator(procs, ["p0", "p1"], demo_model)
        try:
            want, _ = await _generate(solo, "ref-miss", prompt)
            # the coordinator believes both hops hold the prompt's blocks; they never had
            # them (as if evicted after their last report)
            for node in ("p0", "p1"):
                w = procs[node]
                pipe.core.on_cache_events(node, CacheEvents(
                    block_hashes(prompt, BLOCK, w.start_layer, w.end_layer)))
            got, cached = await _generate(pipe, "miss", prompt)
            assert got == want and cached == 0  # run again in full
            stats = pipe.stats()
            assert stats.prefix_misses == 1 and stats.reroutes == 0
            # counted once, as vLLM counts: the admission that ran, without the (false) prefix
            assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (len(prompt), 0)
        finally:
            await pipe.close()
            await solo.close()

    asyncio.run(main())
