"""A rehearsal's building block on the real runtime: emulated workers of LLaMA-2-70B (a
config.json only: no weights, no tokenizer) as real `helixserve worker --engine emulated`
processes, started with torch blocked (they must not need it), real gRPC on 127.0.0.1, and
the real Coordinator with its emulated tokenizer.

Tokens come back for every request, max_tokens and stop strings end them (the coordinator
applies them to the emulated ids), the same prompt gives the same tokens, the workers say
they are emulated, KV is empty afterwards; and when a worker's KV runs out mid-route the
coordinator preempts and every request still gets the tokens it gets alone.

This tests the emulated engine inside the runtime; it is no stand-in for a real engine in
any test of the runtime's correctness (those run real weights).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from runtime_procs import WorkerProc, free_port, stop_workers, wait_ready

from helixserve.planner.placement import Flow, NodeRange, Placement
from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest
from helixserve.runtime import transport as tp
from helixserve.runtime.costs import CostInputs
from helixserve.runtime.proto import helix_pb2 as pb
from helixserve.runtime.proto import helix_pb2_grpc as pb_grpc
from helixserve.spec import ClusterSpec, NodeSpec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SHARED = Path(__file__).resolve().parents[2] / "data" / "shared"
MODEL = SHARED / "models" / "llama-2-70b"
PROFILES = SHARED / "profiles" / "helix-measured.csv"
#: 4 x T4 machines with 1 GB kept per GPU: room for 27 layers of LLaMA-2-70B and KV
GPU, NUM_GPUS, RESERVE_GB = "T4", 4, 1.0
RANGES = [("n0", 0, 27), ("n1", 27, 54), ("n2", 54, 80)]
#: KV of the middle worker in the preemption test: 4 blocks of 16 tokens (27 layers x 4 KiB
#: a token a layer), so three requests of 13 + 24 tokens outgrow it and each fits alone
SMALL_KV_BYTES = 4 * 16 * 27 * 4096
#: `helixserve worker` in an interpreter where importing torch fails
NO_TORCH = (
    "import importlib.abc, sys\n"
    "class Block(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'vllm'):\n"
    "            raise ImportError(f'blocked by the test: {name}')\n"
    "sys.meta_path.insert(0, Block())\n"
    "from helixserve.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
PROMPTS = ["the quick brown fox jumps over the lazy dog " * 2,
           "a rehearsal of a cluster at full size",
           "one two three four five six seven eight nine ten eleven twelve",
           "the quick brown fox jumps over the lazy dog " * 2]
GREEDY = SamplingParams(temperature=0.0)


def start_emulated(name: str, start: int, end: int, tmp: Path,
                   kv_cache_bytes: int | None = None, time_scale: float = 1.0) -> WorkerProc:
    port = free_port()
    log_path = tmp / f"{name}.log"
    cmd = [sys.executable, "-c", NO_TORCH, "worker", "--engine", "emulated", "--gpu", GPU,
           "--num-gpus", str(NUM_GPUS), "--gpu-reserve-gb", str(RESERVE_GB),
           "--profiles", str(PROFILES), "--model", str(MODEL), "--layers", f"{start}:{end}",
           "--node", name, "--port", str(port), "--peers", "127.0.0.1:*",
           "--time-scale", str(time_scale),
           *(["--kv-cache-bytes", str(kv_cache_bytes)] if kv_cache_bytes else [])]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, text=True)
    return WorkerProc(name, start, end, port, proc, log_path)


def cluster_and_placement(workers: list[WorkerProc]) -> tuple[ClusterSpec, Placement]:
    cluster = ClusterSpec(name="emulated", nodes=[
        NodeSpec(w.name, GPU, num_gpus=NUM_GPUS, address=w.address) for w in workers])
    names = [w.name for w in workers]
    hops = ["coordinator", *names, "coordinator"]
    placement = Placement(model="llama-2-70b", cluster="emulated", num_layers=80,
                          planner="test", nodes=[NodeRange(*r) for r in RANGES],
                          flows=[Flow(a, b, 1.0) for a, b in zip(hops, hops[1:], strict=False)])
    return cluster, placement


def config() -> CoordinatorConfig:
    return CoordinatorConfig(cost=CostInputs.load(PROFILES, reserved_gb_per_gpu=RESERVE_GB))


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    tmp = tmp_path_factory.mktemp("emulated")
    procs = [start_emulated(n, a, b, tmp) for n, a, b in RANGES]
    try:
        wait_ready(procs, timeout_s=60)
        yield procs
    finally:
        stop_workers(procs)


async def infos(workers: list[WorkerProc]) -> dict[str, tp.WorkerInfo]:
    out = {}
    for w in workers:
        async with grpc.aio.insecure_channel(w.address) as ch:
            out[w.name] = tp.info_from_pb(await pb_grpc.HelixWorkerStub(ch).Info(pb.InfoRequest()))
    return out


async def generate(coord: Coordinator, rid: str, prompt: str, max_tokens: int,
                   **kw: Any) -> tuple[list[int], str, str | None]:
    ids = coord.tokenizer.encode(prompt)
    req = GenerationRequest(rid, ids, GREEDY, max_tokens=max_tokens, **kw)
    tokens, text, finish = [], "", None
    async for ev in coord.generate(req):
        tokens.append(ev.token_id)
        text += ev.text
        finish = ev.finish_reason
    return tokens, text, finish


def test_requests_through_emulated_workers(workers):
    async def main() -> tuple[list[Any], Any, Any, dict[str, tp.WorkerInfo], Any]:
        cluster, placement = cluster_and_placement(workers)
        coord = await Coordinator.create(cluster, placement, MODEL, config())
        try:
            runs = await asyncio.gather(*(generate(coord, f"r{i}", p, 6 + 2 * i)
                                          for i, p in enumerate(PROMPTS)))
            # a stop string cuts the output where the third token's text begins
            first = runs[1][0]
            stop = coord.tokenizer.decode([first[2]])
            stopped = await generate(coord, "s", PROMPTS[1], 10, stop=[stop])
            during = await infos(workers)
            http = await through_the_api(coord)
            return runs, stopped, coord.tokenizer, during, http
        finally:
            await coord.close()

    runs, stopped, tokenizer, during, (models, metrics, completion) = asyncio.run(main())
    for i, (tokens, text, finish) in enumerate(runs):
        assert len(tokens) == 6 + 2 * i and finish == "length"
        assert all(0 <= t < 32000 and t != 2 for t in tokens)
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert runs[3][0][:6] == runs[0][0]  # the same prompt, the same tokens
    assert runs[1][0] != runs[0][0][: len(runs[1][0])]
    tokens, text, finish = stopped
    assert finish == "stop" and tokens[:2] == runs[1][0][:2]
    assert text == tokenizer.decode(runs[1][0][:2])
    assert getattr(tokenizer, "is_emulated", False)
    for name, info in during.items():
        assert info.engine == "emulated" and info.backend == "emulated", name
        assert info.device == "T4 x4 (emulated)" and info.hidden_size == 8192
        assert info.dtype == "float16" and info.kv_block_size == 16
        assert info.steps > 0
    assert during["n2"].eos_token_ids == (2,)
    assert asyncio.run(wait_kv_empty(workers)) == {"n0": 0, "n1": 0, "n2": 0}
    assert "EMULATED engine: no weights, times from" in workers[0].log()
    # the OpenAI API over them: labelled emulated, text in and out through the emulated tokenizer
    card = models["data"][0]
    assert card["emulated"] is True and card["engines"] == ["emulated"]
    assert metrics.count('backend="emulated"') == 3
    assert completion["usage"]["completion_tokens"] == 5
    assert completion["choices"][0]["finish_reason"] == "length"
    assert completion["choices"][0]["text"].startswith(" tok")


async def through_the_api(coord: Coordinator) -> tuple[Any, str, Any]:
    """GET /v1/models, GET /metrics and POST /v1/completions on the API app over `coord`."""
    import httpx

    from helixserve.api.app import create_app

    app = create_app(coord, "llama-2-70b")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://api") as client:
        models = (await client.get("/v1/models")).json()
        metrics = (await client.get("/metrics")).text
        body = {"model": "llama-2-70b", "prompt": "hello emulated world", "max_tokens": 5}
        completion = (await client.post("/v1/completions", json=body)).json()
    return models, metrics, completion


async def wait_kv_empty(workers: list[WorkerProc]) -> dict[str, int]:
    used: dict[str, int] = {}
    for _ in range(100):
        used = {n: i.kv_used_blocks for n, i in (await infos(workers)).items()}
        if not any(used.values()):
            break
        await asyncio.sleep(0.1)
    return used


def test_kv_exhaustion_preempts_and_every_request_gets_its_tokens(workers, tmp_path):
    # at half the emulated times: the preempted requests run one after another
    small = [start_emulated(f"s{i}", a, b, tmp_path, time_scale=0.5,
                            kv_cache_bytes=SMALL_KV_BYTES if i == 1 else None)
             for i, (_, a, b) in enumerate(RANGES)]
    prompts = [f"story {i}: once upon a time in a land far away there lived" for i in range(3)]

    async def run(procs: list[WorkerProc]) -> tuple[list[list[int]], int]:
        cluster, placement = cluster_and_placement(procs)
        placement.nodes = [NodeRange(w.name, w.start_layer, w.end_layer) for w in procs]
        names = [w.name for w in procs]
        hops = ["coordinator", *names, "coordinator"]
        placement.flows = [Flow(a, b, 1.0) for a, b in zip(hops, hops[1:], strict=False)]
        coord = await Coordinator.create(cluster, placement, MODEL, config())
        try:
            runs = await asyncio.gather(*(generate(coord, f"p{i}", p, 24, ignore_eos=True)
                                          for i, p in enumerate(prompts)))
            return [r[0] for r in runs], coord.preemptions
        finally:
            await coord.close()

    try:
        wait_ready(small, timeout_s=60)
        alone, roomy_preemptions = asyncio.run(run(workers))
        squeezed, preemptions = asyncio.run(run(small))
        kv = asyncio.run(wait_kv_empty(small))
    finally:
        stop_workers(small)
    # at shutdown each worker says what it emulated
    assert "EMULATED engine emulated" in small[1].log(), small[1].log()
    assert roomy_preemptions == 0
    assert preemptions > 0
    assert squeezed == alone and all(len(t) == 24 for t in squeezed)
    assert kv == {"s0": 0, "s1": 0, "s2": 0}
