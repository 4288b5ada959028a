"""Helpers shared by the engine tests (imported by conftest and test modules)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from helixserve.engine import ShardEngine, WorkItem
from helixserve.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
LOGIT_ATOL = 1e-3
"""Max |logit difference| vs transformers in float32 (observed: ~1e-4 on the demo model)."""


def make_random_model(
    out_dir: Path, model_type: str, max_shard_size: str = "2GB", **overrides
) -> Path:
    """A tiny random-weight HF model dir (safetensors) of the given family."""
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    common.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[model_type]
    torch.manual_seed(0)
    model = cls[1](cls[0](**common)).eval()
    # Random init gives tiny attention logits; widen the weights so attention, RoPE and
    # biases matter for the outputs the tests compare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0 if p.dim() > 1 else 1.0)
                if p.dim() == 1:
                    p.normal_(0, 0.5)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    return out_dir


@dataclass
class GreedyRun:
    tokens: list[int]
    logits: list[torch.Tensor]  # one [vocab] per sampled token


def greedy_run(engine: ShardEngine, rid: str, prompt: list[int], steps: int) -> GreedyRun:
    """Prefill then `steps` decode steps, one request alone; frees it after."""
    n = engine.num_model_layers
    out = engine.step([WorkItem(rid, 0, n, 0, prompt, None, GREEDY)])
    tokens = [out[0].token_id]
    assert engine.last_logits is not None
    logits = [engine.last_logits[0].clone()]
    for i in range(steps):
        out = engine.step([WorkItem(rid, 0, n, len(prompt) + i, [tokens[-1]], None, GREEDY)])
        tokens.append(out[0].token_id)
        logits.append(engine.last_logits[0].clone())
    engine.free(rid)
    return GreedyRun(tokens, logits)  # type: ignore[arg-type]


def hf_logits(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Teacher-forced HF logits at the positions that predict each generated token."""
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = hf_model(input_ids=ids).logits[0]  # [len, vocab]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
