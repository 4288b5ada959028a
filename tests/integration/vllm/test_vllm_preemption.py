"""KV exhaustion on vllm workers: 16 concurrent streams on a route whose middle worker's KV
holds about a third of what they grow to. Workers refuse steps (RESOURCE_EXHAUSTED), the
coordinator preempts and recomputes, and every request still gets the tokens one plain vLLM
process gives it; every block is free afterwards. Also: a model vLLM cannot run is refused
with one line naming its architecture.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_procs import (
    ENV,
    VLLM_MARKS,
    Worker,
    chain_placement,
    infos,
    make_cluster,
    start_worker,
    stop_workers,
    vllm_reference,
    wait_all_free,
    wait_ready,
)

from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(1500)]

GREEDY = SamplingParams(temperature=0.0)
NUM_STREAMS = 16
MAX_TOKENS = 96
BLOCK = 32
#: KV bytes: 10 fp32 layers of the demo model take 15,360 bytes per token, so a 32-token block
#: takes 491,520 bytes; the middle worker holds 20 usable blocks (640 tokens) while the 16
#: requests grow to ~2,000 tokens
KV = {"a": 48 * 491_520, "b": 21 * 491_520, "c": 48 * 491_520}
LAYERS = {"a": (0, 10), "b": (10, 20), "c": (20, 30)}


@pytest.fixture(scope="module")
def small_workers(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    tmp = tmp_path_factory.mktemp("vllm-small-kv")
    procs = [start_worker(demo_model, n, "vllm", *LAYERS[n], tmp,
                          extra=["--kv-cache-bytes", str(KV[n]), "--kv-block-size", str(BLOCK)])
             for n in ("a", "b", "c")]
    try:
        wait_ready(procs)
        yield procs
    finally:
        stop_workers(procs)


def test_kv_exhaustion_preempts_and_every_stream_completes_token_equal(
        small_workers, demo_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    prompts = [tok.encode(f"Story {i}: once upon a time in a land far away, there lived")
               for i in range(NUM_STREAMS)]
    reference = vllm_reference(demo_model, prompts, MAX_TOKENS, tmp_path)

    async def main() -> tuple[list[list[int]], int, dict[str, int]]:
        coord = await Coordinator.create(make_cluster(small_workers),
                                         chain_placement(small_workers), demo_model,
                                         CoordinatorConfig(stats_interval_s=0.1))
        try:
            async def one(i: int, p: list[int]) -> list[int]:
                req = GenerationRequest(f"s{i}", p, GREEDY, max_tokens=MAX_TOKENS,
                                        ignore_eos=True)
                return [ev.token_id async for ev in coord.generate(req)]

            tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            total = {n: i.kv_total_blocks for n, i in (await infos(small_workers)).items()}
            free = await wait_all_free(small_workers)
            assert free == total
            return list(tokens), coord.preemptions, total
        finally:
            await coord.close()

    tokens, preemptions, total = asyncio.run(main())
    assert total["b"] == 20, total  # the premise: b holds a third of what the streams need
    assert preemptions >= 1
    for i, (got, want) in enumerate(zip(tokens, reference, strict=True)):
        assert got == want, f"stream {i}"


def test_unsupported_architecture_is_refused_naming_it(demo_model, tmp_path):
    model = tmp_path / "odd-model"
    model.mkdir()
    config = json.loads((demo_model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "helixserve", "worker", "--engine", "vllm", "--model", str(model),
           "--layers", "0:10", "--port", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **ENV))
    assert res.returncode == 2, res.stdout + res.stderr
    # vLLM may log its own warnings at import; ours is one line, the last
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("helixserve worker: error:")]
    assert len(ours) == 1 and res.stderr.strip().endswith(ours[0]), res.stderr
    assert "NoSuchModelForCausalLM" in ours[0] and "not supported" in ours[0], ours[0]
