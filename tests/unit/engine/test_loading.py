"""Weight loading: only a range's tensors, sharded checkpoints, GGUF, memory per range."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from helixserve.engine import ShardEngine, WorkItem
from helixserve.engine.demo import demo_gguf_path, is_prepared
from helixserve.engine.loader import load_args, load_range
from helixserve.errors import UserError


def test_middle_range_loads_only_its_layers(demo_dir):
    eng = ShardEngine.load(demo_dir, 10, 12, kv_cache_bytes=1 << 20)
    names = eng.loaded_tensor_names
    assert len(names) == 2 * 9  # 9 tensors per layer, no embedding, norm or head
    assert {n.split(".")[2] for n in names} == {"10", "11"}
    assert eng.embed is None and eng.lm_head is None and not eng.is_first and not eng.is_last


def test_first_and_last_ranges(demo_dir):
    first = ShardEngine.load(demo_dir, 0, 1, kv_cache_bytes=1 << 20)
    assert "model.embed_tokens.weight" in first.loaded_tensor_names and first.lm_head is None
    last = ShardEngine.load(demo_dir, 29, 30, kv_cache_bytes=1 << 20)
    # Tied embeddings: the head is the embedding matrix; no embedding lookup table is kept.
    assert {"model.norm.weight", "model.embed_tokens.weight"} <= set(last.loaded_tensor_names)
    assert last.embed is None and last.lm_head is not None and last.is_last


def test_sharded_checkpoint_range(random_models):
    model_dir = random_models["llama3"]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    whole = load_range(model_dir, 0, 4, torch.float32, torch.device("cpu"))
    part = load_range(model_dir, 2, 3, torch.float32, torch.device("cpu"))
    assert all(".layers.2." in n for n in part.names)
    for n in part.names:
        torch.testing.assert_close(part.tensors[n], whole.tensors[n], rtol=0, atol=0)


def test_bad_range_is_a_user_error(demo_dir):
    with pytest.raises(UserError, match=r"layer range: bad value \[5, 31\); the model has 30"):
        ShardEngine.load(demo_dir, 5, 31)
    with pytest.raises(UserError, match="no such file"):
        ShardEngine.load(demo_dir / "nope", 0, 1)


def test_gguf_unpermute_matches_transformers():
    """q/k rows come out of llama.cpp's layout exactly as transformers' GGUF loader does it."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    path = demo_gguf_path()
    ours = load_range(path, 1, 2, torch.float32, torch.device("cpu"))
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    for gguf_name, hf_name in [
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight"),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ]:
        t = tensors[gguf_name]
        ref = proc.process(dequantize(t.data, t.tensor_type), gguf_name).weights
        torch.testing.assert_close(
            ours.tensors[hf_name], torch.from_numpy(ref.copy()), rtol=0, atol=0
        )


def test_gguf_engine_equals_hf_dir_engine(demo_dir):
    gguf_args, dir_args = load_args(demo_gguf_path()), load_args(demo_dir)
    assert gguf_args.num_layers == dir_args.num_layers == 30
    assert gguf_args.rope_theta == dir_args.rope_theta and gguf_args.tie_word_embeddings
    a = ShardEngine.load(demo_gguf_path(), 27, 29, kv_cache_bytes=1 << 20)
    b = ShardEngine.load(demo_dir, 27, 29, kv_cache_bytes=1 << 20)
    assert a.loaded_tensor_names == b.loaded_tensor_names
    hidden = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    item = WorkItem("g", 27, 29, 0, [1, 2, 3, 4, 5], hidden, None)
    torch.testing.assert_close(a.step([item])[0].hidden, b.step([item])[0].hidden, rtol=0, atol=0)


def test_prepare_demo_is_idempotent_and_complete(demo_dir):
    from helixserve.cli import main

    assert is_prepared(demo_dir)
    tok_cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    mtime = (demo_dir / "model.safetensors").stat().st_mtime
    assert main(["model", "prepare-demo", "--out", str(demo_dir)]) == 0
    assert (demo_dir / "model.safetensors").stat().st_mtime == mtime


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, torch
    from helixserve.engine import ShardEngine, WorkItem
    def rss_kib():  # resident now (ru_maxrss would be the import's transient peak)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    base = rss_kib()
    eng = ShardEngine.load(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), kv_cache_bytes=1 << 20)
    print(json.dumps({"net_kib": rss_kib() - base}))
    """
)


def _net_peak_kib(model_dir, start, end) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(model_dir), str(start), str(end)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["net_kib"]


@pytest.mark.slow
def test_peak_memory_grows_with_the_range(demo_dir):
    """Resident memory of a third of the layers is well under half that of the whole."""
    whole = _net_peak_kib(demo_dir, 0, 30)
    middle = _net_peak_kib(demo_dir, 10, 20)  # 10 of 30 layers, no embedding or head
    assert middle < 0.45 * whole, (middle, whole)
    assert middle > 0.15 * whole, (middle, whole)
