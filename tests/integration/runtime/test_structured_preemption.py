"""Structured output survives preemption: the grammar state follows the tokens.

Three real workers whose middle one's KV holds about one long request (as
test_runtime_kv_preemption.py). Four JSON-schema requests admitted at once outgrow it; the
coordinator preempts by recompute and re-prefills each victim with prompt + output so far,
on which the last stage rebuilds the request's matcher from the output tokens. Every output
still validates against the schema, and is token for token what the same request gets when
served alone (reserve mode, no preemption).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
from runtime_procs import SMALL_KV_WORKERS, WorkerProc, make_cluster, make_placement

from helixserve.request import SamplingParams, StructuredOutput
from helixserve.runtime import Coordinator, CoordinatorConfig, GenerationRequest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: the small_kv_workers fixture's workers: b's KV (~160 tokens) is the tight one
WORKERS = SMALL_KV_WORKERS
PROMPTS = [f"List words about topic {i}:" for i in range(4)]
#: long enough output (~60+ tokens) that four requests need ~2x the middle worker's KV
SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "minItems": 12, "maxItems": 12,
                             "items": {"type": "string", "minLength": 3, "maxLength": 8}}},
    "required": ["words"],
    "additionalProperties": False,
}
PARAMS = SamplingParams(temperature=0.0,
                        structured=StructuredOutput("json", json.dumps(SCHEMA)))


async def _serve(workers: list[WorkerProc], model: Path, mode: str
                 ) -> tuple[list[list[int]], int, list[str]]:
    """Tokens of every prompt, the coordinator's preemptions, and the texts."""
    from transformers import AutoTokenizer

    placement = make_placement(
        [(name, a, b) for name, a, b, _ in WORKERS],
        [("coordinator", "a", 1), ("a", "b", 1), ("b", "c", 1), ("c", "coordinator", 1)],
    )
    coord = await Coordinator.create(make_cluster(workers), placement, model,
                                     CoordinatorConfig(kv_allocation=mode, stats_interval_s=0.1))
    tok = AutoTokenizer.from_pretrained(str(model))
    caps = [coord.nodes[name].kv_capacity_tokens for name, *_ in WORKERS]
    prompts = [tok.encode(p) for p in PROMPTS]
    # reserve admits one at a time (each promises more than half the tightest KV)
    max_tokens = min(caps) - max(len(p) for p in prompts) - 16

    async def one(i: int, prompt: list[int]) -> tuple[list[int], str]:
        req = GenerationRequest(f"so{i}", prompt, PARAMS, max_tokens=max_tokens)
        events = [ev async for ev in coord.generate(req)]
        assert events[-1].finish_reason == "stop", events[-1]
        return [ev.token_id for ev in events], "".join(ev.text for ev in events)

    try:
        done = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return [t for t, _ in done], coord.preemptions, [x for _, x in done]
    finally:
        await coord.close()


def test_structured_outputs_valid_and_unchanged_after_preemption(small_kv_workers, demo_model):
    alone, pre_alone, texts_alone = asyncio.run(_serve(small_kv_workers, demo_model, "reserve"))
    assert pre_alone == 0
    for text in texts_alone:
        jsonschema.validate(json.loads(text), SCHEMA)
    crowded, preemptions, texts = asyncio.run(_serve(small_kv_workers, demo_model, "on-demand"))
    assert preemptions >= 1  # the premise: some request was re-prefilled mid-output
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert crowded == alone
