"""Faults: a worker killed mid-request, and a worker drained by SIGTERM.

Own workers (this module kills them): n0 [0,10) n1 [10,20) n2 [20,30) and m [0,25), m started
with `--placement P --node m`. The placement's flows send almost everything along n0-n1-n2,
with m-n2 as the spare route.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from runtime_procs import (
    NUM_LAYERS,
    WorkerProc,
    make_cluster,
    make_placement,
    start_worker,
    stop_workers,
    wait_ready,
)

from helixserve.engine import SamplingParams, ShardEngine, WorkItem
from helixserve.runtime import Coordinator, GenerationRequest, NoRouteError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 24
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


def test_killed_worker_request_continues_on_another_route(fault_workers, demo_model,
                                                          prompt_and_reference):
    prompt, reference = prompt_and_reference

    async def main() -> tuple[list[int], dict]:
        coord = await Coordinator.create(make_cluster(list(fault_workers.values())), placement(),
                                         demo_model)
        try:
            ids: list[int] = []
            req = GenerationRequest("ft", prompt, GREEDY, max_tokens=MAX_TOKENS, ignore_eos=True)
            async for ev in coord.generate(req):
                ids.append(ev.token_id)
                if len(ids) == 5:
                    assert coord.stats()["routes"] == {"n0->n1->n2": 1}
                    fault_workers["n1"].proc.send_signal(signal.SIGKILL)
            return ids, coord.stats()
        finally:
            await coord.close()

    ids, stats = asyncio.run(main())
    # no gap, no duplicate: the greedy continuation is exactly the single engine's
    assert ids == reference
    assert stats["nodes"]["n1"]["alive"] is False
    assert "m->n2" in stats["routes"], stats["routes"]


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
