"""Routes through `helixserve worker --engine vllm` processes: greedy outputs token-equal to one
plain vLLM process; a mixed torch/vllm route token-equal to the torch-only route (the wire's
residual-stream conversion); a vllm worker running part of its range (partial inference);
Info reporting the engine; Release returning every KV block after a cancel; a JSON schema
held by the grammar on a vllm last stage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_procs import (
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

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
    "Why is the sky blue? Answer in detail, with an explanation of Rayleigh scattering.",
    "Say hello.",
    "What is 2 + 2?",
    "Name a famous scientist and what they discovered.",
    "Translate 'good morning' into French and Spanish.",
]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0)
#: name, engine, layers: vllm v0-v1-v2, torch t0-t1-t2, and vm, a vllm worker holding [0, 25)
#: that the partial route enters at layer 10
WORKERS = [("v0", "vllm", 0, 10), ("v1", "vllm", 10, 20), ("v2", "vllm", 20, 30),
           ("t0", "torch", 0, 10), ("t1", "torch", 10, 20), ("t2", "torch", 20, 30),
           ("vm", "vllm", 0, 25)]


@pytest.fixture(scope="module")
def workers(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    tmp = tmp_path_factory.mktemp("vllm-workers")
    procs = [start_worker(demo_model, n, e, a, b, tmp) for n, e, a, b in WORKERS]
    try:
        wait_ready(procs)
        yield {w.name: w for w in procs}
    finally:
        stop_workers(procs)


@pytest.fixture(scope="module")
def prompts(demo_model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def reference(demo_model: Path, prompts: list[list[int]],
              tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    return vllm_reference(demo_model, prompts, MAX_TOKENS, tmp_path_factory.mktemp("ref"))


def serve(route: list[Worker], demo_model: Path, prompts: list[list[int]],
          placement: Any = None, **coordinator_kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens of every prompt at once through `route`; the coordinator's stats."""

    async def main() -> tuple[list[list[int]], dict[str, Any]]:
        coord = await Coordinator.create(make_cluster(route), placement or chain_placement(route),
                                         demo_model, CoordinatorConfig(**coordinator_kw))
        try:
            async def one(i: int, p: list[int]) -> list[int]:
                req = GenerationRequest(f"req-{i}", p, GREEDY, max_tokens=MAX_TOKENS,
                                        ignore_eos=True)
                return [ev.token_id async for ev in coord.generate(req)]

            tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return list(tokens), coord.stats()
        finally:
            await coord.close()

    return asyncio.run(main())


def test_vllm_route_matches_one_vllm_process(workers, demo_model, prompts, reference):
    route = [workers[n] for n in ("v0", "v1", "v2")]
    tokens, stats = serve(route, demo_model, prompts)
    assert stats.routes == {"v0->v1->v2": len(prompts)}
    for i, (got, want) in enumerate(zip(tokens, reference, strict=True)):
        assert got == want, f"prompt {i}: {QUESTIONS[i]!r}"


def test_mixed_route_matches_torch_route(workers, demo_model, prompts):
    torch_only, _ = serve([workers[n] for n in ("t0", "t1", "t2")], demo_model, prompts)
    mixed, stats = serve([workers[n] for n in ("t0", "v1", "t2")], demo_model, prompts)
    assert stats.routes == {"t0->v1->t2": len(prompts)}
    assert mixed == torch_only


def test_partial_range_on_a_vllm_worker(workers, demo_model, prompts, reference):
    """t0 [0,10) -> vm runs [10,25) of its [0,25) -> v2 runs [25,30) of its [20,30); small
    prefill chunks, so prompts pipeline through in pieces."""
    from helixserve.planner.placement import Flow, NodeRange, Placement

    route = [workers[n] for n in ("t0", "vm", "v2")]
    placement = Placement(
        model="smollm2-135m-instruct", cluster="test-vllm", num_layers=30, planner="test",
        nodes=[NodeRange("t0", 0, 10), NodeRange("vm", 0, 25), NodeRange("v2", 20, 30)],
        flows=[Flow("coordinator", "t0", 1), Flow("t0", "vm", 1), Flow("vm", "v2", 1),
               Flow("v2", "coordinator", 1)],
    )
    tokens, stats = serve(route, demo_model, prompts, placement, prefill_chunk_tokens=16)
    assert stats.routes == {"t0->vm->v2": len(prompts)}
    assert tokens == reference


def test_info_reports_engine_and_vllm_version(workers):
    from helixserve.engine.vllm_build import vllm_version

    got = asyncio.run(infos([workers["v0"], workers["t0"]]))
    assert (got["v0"].engine, got["v0"].vllm_version) == ("vllm", vllm_version())
    assert (got["t0"].engine, got["t0"].vllm_version) == ("torch", "")
    assert got["v0"].backend == "vllm"


def test_release_after_cancel_returns_every_block(workers, demo_model, prompts):
    route = [workers[n] for n in ("v0", "v1", "v2")]

    async def main() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        total = {n: i.kv_total_blocks for n, i in (await infos(route)).items()}
        coord = await Coordinator.create(make_cluster(route), chain_placement(route), demo_model)
        try:
            gens = [coord.generate(GenerationRequest(f"cancel-{i}", p, GREEDY, max_tokens=500,
                                                     ignore_eos=True))
                    for i, p in enumerate(prompts[:4])]
            for g in gens:
                for _ in range(3):
                    await g.__anext__()
            during = {n: i.kv_total_blocks - i.kv_used_blocks
                      for n, i in (await infos(route)).items()}
            for g in gens:
                await g.aclose()  # what the API does when the client disconnects
            return total, during, await wait_all_free(route)
        finally:
            await coord.close()

    total, during, after = asyncio.run(main())
    assert all(during[n] < total[n] for n in total), (during, total)
    assert after == total


def test_structured_output_on_a_vllm_last_stage(workers, demo_model, prompts):
    """A JSON schema held by the grammar on a vllm last stage (helixserve's sampler with the
    tokenizer the stage registered): the answer parses and validates, and the unconstrained
    answer to the same prompt does not (the grammar did the work)."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from helixserve.request import StructuredOutput

    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
        "capital": {"type": "boolean"}},
        "required": ["city", "country", "capital"], "additionalProperties": False}
    structured = SamplingParams(temperature=0.0,
                                structured=StructuredOutput("json", json.dumps(schema)))
    route = [workers[n] for n in ("v0", "v1", "v2")]

    async def main() -> list[int]:
        coord = await Coordinator.create(make_cluster(route), chain_placement(route),
                                         demo_model, CoordinatorConfig())
        try:
            req = GenerationRequest("json-0", prompts[0], structured, max_tokens=64)
            return [ev.token_id async for ev in coord.generate(req)]
        finally:
            await coord.close()

    tok = AutoTokenizer.from_pretrained(str(demo_model))
    text = tok.decode(asyncio.run(main()), skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    free, _ = serve(route, demo_model, prompts[:1])
    with pytest.raises(ValueError):
        json.loads(tok.decode(free[0], skip_special_tokens=True))
