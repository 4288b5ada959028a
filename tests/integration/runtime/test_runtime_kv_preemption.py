"""On-demand KV in the real runtime: a worker whose KV holds one long request at a time.

`reserve` admits the requests one after another (each promises prompt + max_tokens). With
`on-demand` all are admitted at once, they outgrow the worker's KV, the worker refuses a
step (RESOURCE_EXHAUSTED), and the coordinator preempts by recompute. Every request still
gets exactly the tokens it gets when served alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from runtime_procs import (
    NUM_LAYERS,
    WorkerProc,
    make_cluster,
    make_placement,
    start_worker,
    stop_workers,
    wait_ready,
)

from helixserve.engine import SamplingParams
from helixserve.runtime import Coordinator, GenerationRequest

pytestmark = [pytest.mark.integration]

GREEDY = SamplingParams(temperature=0.0)
#: ~9.4 MB: about 200 tokens of KV for all 30 layers of the demo model (fp32 on CPU)
SMALL_KV_BYTES = 9_400_000
PROMPTS = [
    "The history of the printing press",
    "Write a short poem about the sea",
    "Explain how a bicycle stays upright",
]


@pytest.fixture(scope="module")
def small_worker(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    tmp = tmp_path_factory.mktemp("small-kv")
    w = start_worker(demo_model, "w", 0, NUM_LAYERS, tmp,
                     extra=["--kv-cache-bytes", str(SMALL_KV_BYTES)])
    try:
        wait_ready([w])
        yield w
    finally:
        stop_workers([w])


async def _serve(worker: WorkerProc, model: Path, mode: str) -> tuple[list[list[int]], int, int, int]:
    """Tokens of every prompt, the most requests running at once, preemptions, KV capacity."""
    from transformers import AutoTokenizer

    placement = make_placement([("w", 0, NUM_LAYERS)],
                               [("coordinator", "w", 1.0), ("w", "coordinator", 1.0)])
    coord = await Coordinator.create(make_cluster([worker]), placement, model, kv_allocation=mode,
                                     stats_interval_s=0.1)
    tok = AutoTokenizer.from_pretrained(str(model))
    capacity = coord.nodes["w"].kv_capacity_tokens
    prompts = [tok.encode(p) for p in PROMPTS]
    # each fits alone (reserve admits one at a time); together they need ~2.5x the KV
    max_tokens = capacity - max(len(p) for p in prompts) - 32
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, coord.stats()["running"])
            await asyncio.sleep(0.005)

    async def one(i: int, prompt: list[int]) -> list[int]:
        req = GenerationRequest(f"r{i}", prompt, GREEDY, max_tokens=max_tokens, ignore_eos=True)
        return [ev.token_id async for ev in coord.generate(req)]

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return list(tokens), most, coord.preemptions, capacity
    finally:
        watcher.cancel()
        await coord.close()


def test_on_demand_admits_all_preempts_and_keeps_the_tokens(small_worker, demo_model):
    reserved, most_r, pre_r, capacity = asyncio.run(_serve(small_worker, demo_model, "reserve"))
    assert 150 <= capacity <= 260, capacity  # the premise: one long request fills the KV
    assert most_r == 1 and pre_r == 0
    on_demand, most_o, pre_o, _ = asyncio.run(_serve(small_worker, demo_model, "on-demand"))
    assert most_o == len(PROMPTS)
    assert pre_o >= 1
    assert all(len(t) == len(reserved[0]) for t in on_demand)
    assert on_demand == reserved
