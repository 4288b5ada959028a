"""On-demand KV in the real runtime: a 3-worker pipeline whose middle worker's KV holds one
long request at a time.

`reserve` admits the requests one after another (each promises prompt + max_tokens). With
`on-demand` (the default) all are admitted at once. They outgrow the middle worker's KV, that
worker refuses a step mid-route (RESOURCE_EXHAUSTED), and the coordinator preempts by
recompute. Every request still gets exactly the tokens it gets when served alone, and every
worker's KV is empty afterwards.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from runtime_procs import SMALL_KV_WORKERS, WorkerProc, make_cluster, make_placement

from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest
from helixserve.runtime import transport as tp
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0)
#: the small_kv_workers fixture's workers: b's KV (~160 tokens) is the tight one
WORKERS = SMALL_KV_WORKERS
PROMPTS = [f"Story {i}: once upon a time in a land far away" for i in range(4)]


async def _kv_used(workers: list[WorkerProc]) -> dict[str, int]:
    used = {}
    for w in workers:
        async with grpc.aio.insecure_channel(w.address) as ch:
            info = tp.info_from_pb(await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest()))
            used[w.name] = info.kv_used_blocks
    return used


async def _serve(workers: list[WorkerProc], model: Path, mode: str
                 ) -> tuple[list[list[int]], int, int, dict[str, int]]:
    """Tokens of every prompt, the most requests running at once, preemptions, capacities."""
    from transformers import AutoTokenizer

    placement = make_placement(
        [(name, a, b) for name, a, b, _ in WORKERS],
        [("coordinator", "a", 1), ("a", "b", 1), ("b", "c", 1), ("c", "coordinator", 1)],
    )
    coord = await Coordinator.create(make_cluster(workers), placement, model,
                                     CoordinatorConfig(kv_allocation=mode, stats_interval_s=0.1))
    tok = AutoTokenizer.from_pretrained(str(model))
    caps = {name: coord.nodes[name].kv_capacity_tokens for name, *_ in WORKERS}
    prompts = [tok.encode(p) for p in PROMPTS]
    # each fits alone on the tightest worker; together they need ~3x its KV
    max_tokens = min(caps.values()) - max(len(p) for p in prompts) - 32
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, coord.stats().running)
            await asyncio.sleep(0.005)

    async def one(i: int, prompt: list[int]) -> list[int]:
        req = GenerationRequest(f"r{i}", prompt, GREEDY, max_tokens=max_tokens, ignore_eos=True)
        return [ev.token_id async for ev in coord.generate(req)]

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        print(f"{mode}: {time.perf_counter() - started:.1f} s, {most} running at most, "
              f"{coord.preemptions} preemptions")  # shown with pytest -s (docs/runtime.md)
        return list(tokens), most, coord.preemptions, caps
    finally:
        watcher.cancel()
        await coord.close()


async def _wait_kv_empty(workers: list[WorkerProc]) -> dict[str, int]:
    used = await _kv_used(workers)
    for _ in range(100):
        if not any(used.values()):
            break
        await asyncio.sleep(0.1)
        used = await _kv_used(workers)
    return used


def test_on_demand_admits_all_preempts_mid_route_and_keeps_the_tokens(small_kv_workers, demo_model):
    reserved, most_r, pre_r, caps = asyncio.run(_serve(small_kv_workers, demo_model, "reserve"))
    assert 120 <= caps["b"] < caps["a"] <= 260, caps  # the premise: b is the tight one
    assert most_r == 1 and pre_r == 0
    on_demand, most_o, pre_o, _ = asyncio.run(_serve(small_kv_workers, demo_model, "on-demand"))
    assert most_o == len(PROMPTS)
    assert pre_o >= 1
    assert on_demand == reserved
    assert asyncio.run(_wait_kv_empty(small_kv_workers)) == dict.fromkeys("abc", 0)
