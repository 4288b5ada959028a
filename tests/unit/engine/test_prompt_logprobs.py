"""Prompt logprobs (the API's echo + logprobs): the engine scores each prompt token given the
tokens before it, like transformers' log_softmax over the prompt, whole or in chunks, on the
last stage of a pipeline, and only for the requests that ask."""

from __future__ import annotations

import pytest
import torch

from helixserve.engine import ShardEngine, WorkItem
from helixserve.request import SamplingParams

TOP_N = 3
ASK = SamplingParams(temperature=0.0, prompt_logprobs=TOP_N)
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def hf_prompt_logprobs(demo_hf, demo_prompt) -> torch.Tensor:
    """transformers' log_softmax over the prompt: [len(prompt) - 1, vocab], row i scoring
    prompt token i + 1."""
    with torch.inference_mode():
        logits = demo_hf(input_ids=torch.tensor([demo_prompt])).logits[0]  # [len, vocab]
    return torch.log_softmax(logits.float(), dim=-1)[:-1]


def _check_against_hf(scored, prompt: list[int], ref: torch.Tensor) -> None:
    assert scored is not None and len(scored) == len(prompt) - 1
    assert [p.token_id for p in scored] == prompt[1:]
    targets = torch.tensor(prompt[1:])
    want = ref.gather(1, targets[:, None])[:, 0]
    got = torch.tensor([p.logprob for p in scored])
    assert (got - want).abs().max().item() < LOGPROB_ATOL
    want_top = torch.topk(ref, TOP_N, dim=-1)
    for row, p in enumerate(scored):
        assert [t for t, _ in p.top_logprobs] == want_top.indices[row].tolist()
        got_vals = torch.tensor([lp for _, lp in p.top_logprobs])
        assert (got_vals - want_top.values[row]).abs().max().item() < LOGPROB_ATOL
    # not degenerate: the prompt has likely and unlikely tokens
    assert got.min().item() < -5.0 and got.max().item() > -1.0


def test_whole_prompt_matches_transformers(demo_engine, demo_prompt, hf_prompt_logprobs):
    n = demo_engine.num_model_layers
    (out,) = demo_engine.step([WorkItem("plp-whole", 0, n, 0, demo_prompt, None, ASK)])
    demo_engine.free("plp-whole")
    _check_against_hf(out.prompt_logprobs, demo_prompt, hf_prompt_logprobs)
    assert out.token_id == int(torch.argmax(demo_engine.last_logits[0]))


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prompt_matches_transformers(demo_engine, demo_prompt, hf_prompt_logprobs, chunk):
    """Each chunk's last row scores the next chunk's first token."""
    n, rid = demo_engine.num_model_layers, f"plp-chunk-{chunk}"
    outs = []
    for start in range(0, len(demo_prompt), chunk):
        last = start + chunk >= len(demo_prompt)
        part = demo_prompt[start : start + chunk]
        outs += demo_engine.step([WorkItem(rid, 0, n, start, part, None, ASK, sample=last)])
    demo_engine.free(rid)
    assert all(o.prompt_logprobs is None for o in outs[:-1])  # handed out with the token
    _check_against_hf(outs[-1].prompt_logprobs, demo_prompt, hf_prompt_logprobs)
    # decoding on: no prompt is scored again
    (dec,) = demo_engine.step([WorkItem(rid + "d", 0, n, 0, demo_prompt, None, ASK)])
    (nxt,) = demo_engine.step(
        [WorkItem(rid + "d", 0, n, len(demo_prompt), [dec.token_id], None, ASK)]
    )
    demo_engine.free(rid + "d")
    assert nxt.prompt_logprobs is None


def test_last_stage_of_a_pipeline_and_mixed_batch(
    demo_dir, demo_engine, demo_prompt, hf_prompt_logprobs
):
    """Layers [0, 12) then [12, 30), the prompt beside a request that does not ask."""
    first = ShardEngine.load(demo_dir, 0, 12, kv_cache_bytes=16 << 20)
    last = ShardEngine.load(demo_dir, 12, 30, kv_cache_bytes=16 << 20)
    other = demo_prompt[:9]
    plain = SamplingParams(temperature=0.0)
    h = first.step(
        [
            WorkItem("ask", 0, 12, 0, demo_prompt, None, None, sample=False),
            WorkItem("plain", 0, 12, 0, other, None, None, sample=False),
        ]
    )
    outs = last.step(
        [
            WorkItem("ask", 12, 30, 0, demo_prompt, h[0].hidden, ASK),
            WorkItem("plain", 12, 30, 0, other, h[1].hidden, plain),
        ]
    )
    _check_against_hf(outs[0].prompt_logprobs, demo_prompt, hf_prompt_logprobs)
    assert outs[1].prompt_logprobs is None
    (whole,) = demo_engine.step([WorkItem("plp-plain", 0, 30, 0, other, None, plain)])
    demo_engine.free("plp-plain")
    assert outs[1].token_id == whole.token_id


def test_one_token_prompt_scores_nothing(demo_engine):
    (out,) = demo_engine.step([WorkItem("plp-one", 0, 30, 0, [42], None, ASK)])
    demo_engine.free("plp-one")
    assert out.prompt_logprobs == [] and out.token_id is not None
