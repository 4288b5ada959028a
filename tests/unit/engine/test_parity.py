"""The whole-range engine reproduces transformers' logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import LOGIT_ATOL, greedy_run, hf_logits

from helixserve.engine import ShardEngine


def test_demo_model_matches_transformers(demo_engine, demo_hf, demo_prompt):
    run = greedy_run(demo_engine, "parity-demo", demo_prompt, steps=20)
    ref = hf_logits(demo_hf, demo_prompt, run.tokens)  # [21, vocab]
    ours = torch.stack(run.logits)
    assert ours.shape == ref.shape == (21, 49152)
    assert (ours - ref).abs().max().item() < LOGIT_ATOL
    # Greedy: every token is HF's argmax given the same prefix, i.e. HF greedy decoding.
    assert run.tokens == ref.argmax(-1).tolist()


def test_demo_model_greedy_equals_hf_generate(demo_engine, demo_hf, demo_prompt):
    run = greedy_run(demo_engine, "parity-generate", demo_prompt, steps=19)
    with torch.inference_mode():
        out = demo_hf.generate(
            torch.tensor([demo_prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False
        )
    assert out[0, len(demo_prompt) :].tolist() == run.tokens


@pytest.mark.parametrize("family", ["qwen2", "llama3", "mistral"])
def test_random_models_match_transformers(random_models, family):
    from transformers import AutoModelForCausalLM

    model_dir = random_models[family]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = ShardEngine.load(model_dir, 0, 4, kv_cache_bytes=4 << 20)
    # Long enough to cross the llama3 config's 64-token original context and several blocks.
    prompt = [
        int(t) for t in torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(1))
    ]
    run = greedy_run(engine, f"parity-{family}", prompt, steps=20)
    ref = hf_logits(hf, prompt, run.tokens)
    assert (torch.stack(run.logits) - ref).abs().max().item() < LOGIT_ATOL
    assert run.tokens == ref.argmax(-1).tolist()
    # Not degenerate: the outputs depend on the context (else the comparison is weak).
    assert (run.logits[0] - run.logits[-1]).abs().max().item() > 0.1


def test_model_args_of_variants(random_models):
    qwen = ShardEngine.load(random_models["qwen2"], 0, 4, kv_cache_bytes=1 << 20)
    assert qwen.args.attention_bias and qwen.layers[0].qkv.bias is not None
    llama3 = ShardEngine.load(random_models["llama3"], 0, 4, kv_cache_bytes=1 << 20)
    assert llama3.args.rope_scaling["rope_type"] == "llama3"
    assert llama3.args.tie_word_embeddings


def test_llama3_rope_frequencies_match_transformers(random_models):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from helixserve.engine.model import rope_inv_freq

    engine = ShardEngine.load(random_models["llama3"], 0, 1, kv_cache_bytes=1 << 20)
    ours = rope_inv_freq(engine.args)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(random_models["llama3"]))
    torch.testing.assert_close(ours, ref)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(ours, plain)  # the scaling changed some frequencies


def test_bfloat16_path_tracks_transformers(random_models):
    """The GPU dtype (run here on CPU): same argmax as transformers in bf16, close logits."""
    from transformers import AutoModelForCausalLM

    model_dir = random_models["qwen2"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    engine = ShardEngine.load(model_dir, 0, 4, dtype="bfloat16", kv_cache_bytes=1 << 20)
    assert engine.dtype == torch.bfloat16 and engine.kv.k.dtype == torch.bfloat16
    prompt = list(range(10, 60))
    run = greedy_run(engine, "bf16", prompt, steps=10)
    ref = hf_logits(hf, prompt, run.tokens).float()
    ours = torch.stack(run.logits).float()
    assert (ours - ref).abs().max().item() < 0.25
    assert (ref.argmax(-1) == torch.tensor(run.tokens)).float().mean().item() >= 0.9
