"""Weight loading for one layer range: HF safetensors (single or sharded) or GGUF.

Only the tensors the range needs are read: the embedding on the first stage, layers
[start, end), the final norm and lm_head on the last stage (the embedding again there
when embeddings are tied). safetensors are opened lazily (`safe_open`, one tensor at a
time) and GGUF through `gguf.GGUFReader`'s memory map, so peak memory grows with the
range held, not with the model.

GGUF: quantized tensors are dequantized to float32. llama.cpp stores the q/k projections
of `llama` models with the rows of each head permuted (interleaved rotary halves); they
are un-permuted here exactly as transformers' GGUF loader does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from helixserve.engine.config import ModelArgs
from helixserve.engine.structured import register_model
from helixserve.errors import UserError

# Per-layer tensor suffixes in HF naming; `bias` ones exist only with attention_bias.
LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
LAYER_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")

GGUF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class RangeWeights:
    """Tensors of one layer range, by HF name, already in the serving dtype and device."""

    args: ModelArgs
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return sorted(self.tensors)


def wanted_names(args: ModelArgs, start: int, end: int) -> list[str]:
    """HF tensor names a shard holding layers [start, end) needs."""
    names: list[str] = []
    is_last = end == args.num_layers
    if start == 0 or (is_last and args.tie_word_embeddings):
        names.append("model.embed_tokens.weight")
    suffixes = LAYER_WEIGHTS + (LAYER_BIASES if args.attention_bias else ())
    for i in range(start, end):
        names += [f"model.layers.{i}.{s}" for s in suffixes]
    if is_last:
        names.append("model.norm.weight")
        if not args.tie_word_embeddings:
            names.append("lm_head.weight")
    return names


def _wanted(args: ModelArgs, start: int, end: int, skip_layers: frozenset[int]) -> list[str]:
    skip = tuple(f"model.layers.{i}." for i in skip_layers)
    return [n for n in wanted_names(args, start, end) if not n.startswith(skip)]


def find_gguf(model_path: Path) -> Path | None:
    if model_path.is_file() and model_path.suffix == ".gguf":
        return model_path
    if model_path.is_dir() and not (model_path / "config.json").exists():
        found = sorted(model_path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    return None


def load_args(model_path: Path) -> ModelArgs:
    gguf_path = find_gguf(model_path)
    if gguf_path is not None:
        return _gguf_args(_gguf_reader(gguf_path), str(gguf_path))
    return ModelArgs.from_dir(model_path)


def load_range(
    model_path: Path, start: int, end: int, dtype: torch.dtype, device: torch.device,
    skip_layers: frozenset[int] = frozenset(),
) -> RangeWeights:
    """Read the tensors of layers [start, end) (+ embedding / head as the range needs).
    `skip_layers`: layers not to read (a worker changing its range keeps those it has)."""
    model_path = Path(model_path)
    if not model_path.exists():
        raise UserError(f"--model: no such file or directory '{model_path}'")
    gguf_path = find_gguf(model_path)
    if gguf_path is not None:
        reader = _gguf_reader(gguf_path)
        args = _gguf_args(reader, str(gguf_path))
        source = _gguf_tensors(reader, args, set(_wanted(args, start, end, skip_layers)))
    else:
        args = ModelArgs.from_dir(model_path)
        source = _safetensors(model_path, _wanted(args, start, end, skip_layers))
    _check_range(args, start, end)
    out = RangeWeights(args)
    for name, tensor in source:
        # copy=True: safetensors hands out views of one memory map of the whole file; a
        # kept view would pin every page of the file that was read (2x the range's RSS).
        out.tensors[name] = tensor.to(device=device, dtype=dtype, copy=True)
    if end == args.num_layers and args.tie_word_embeddings:
        out.tensors["lm_head.weight"] = out.tensors["model.embed_tokens.weight"]
    if end == args.num_layers:  # the sampler constrains structured requests with its tokenizer
        register_model(model_path, args.vocab_size, args.eos_token_ids)
    return out


def _check_range(args: ModelArgs, start: int, end: int) -> None:
    if not 0 <= start < end <= args.num_layers:
        raise UserError(
            f"layer range: bad value [{start}, {end}); the model has {args.num_layers} layers, "
            f"need 0 <= start < end <= {args.num_layers}"
        )


# ---- safetensors ---------------------------------------------------------------------------
def _safetensors(model_dir: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    else:
        single = model_dir / "model.safetensors"
        if not single.is_file():
            raise UserError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        with safe_open(str(single), framework="pt") as f:
            weight_map = {k: single.name for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    missing = [n for n in names if n not in weight_map and n != "lm_head.weight"]
    if "lm_head.weight" in names and "lm_head.weight" not in weight_map:
        # Some checkpoints tie embeddings without saying so; fall back to the embedding.
        names = [n for n in names if n != "lm_head.weight"]
        missing += [] if "model.embed_tokens.weight" in weight_map else ["lm_head.weight"]
        tie_fallback = True
    else:
        tie_fallback = False
    if missing:
        raise UserError(f"{model_dir}: checkpoint lacks tensors {missing[:5]} (and maybe more)")
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(weight_map[n], []).append(n)
    for file_name, file_names in by_file.items():
        with safe_open(str(model_dir / file_name), framework="pt") as f:
            for n in file_names:
                yield n, f.get_tensor(n)
    if tie_fallback:
        with safe_open(
            str(model_dir / weight_map["model.embed_tokens.weight"]), framework="pt"
        ) as f:
            yield "lm_head.weight", f.get_tensor("model.embed_tokens.weight")


# ---- GGUF ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path) -> Any:
    """Parsing the header takes seconds; the reader only memory-maps the file, so keep it."""
    from gguf import GGUFReader

    return GGUFReader(str(path))


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _gguf_args(reader: Any, source: str) -> ModelArgs:
    arch = _gguf_field(reader, "general.architecture", "llama")
    if arch not in ("llama", "qwen2", "mistral"):
        raise UserError(
            f"{source}: general.architecture: unsupported '{arch}'; known: llama, qwen2"
        )
    tensor_names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    num_heads = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    cfg: dict[str, Any] = {
        "model_type": "llama" if arch == "mistral" else arch,
        "num_hidden_layers": int(_gguf_field(reader, f"{arch}.block_count")),
        "hidden_size": int(_gguf_field(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(_gguf_field(reader, f"{arch}.feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(
            _gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)
        ),
        "rms_norm_eps": float(
            _gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
        ),
        "rope_theta": float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_gguf_field(reader, f"{arch}.context_length", 4096)),
        "vocab_size": int(embd.shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
    }
    return ModelArgs.from_hf_config(cfg, source=source)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of q/k (transformers' _reverse_permute_weights)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _gguf_tensors(
    reader: Any, args: ModelArgs, wanted: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name in GGUF_GLOBAL_NAMES:
            name = GGUF_GLOBAL_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            if rest not in GGUF_LAYER_NAMES:
                continue
            name = f"model.layers.{idx}.{GGUF_LAYER_NAMES[rest]}"
        else:
            continue
        if name not in wanted:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        if args.model_type == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute(w, args.num_heads)
        elif args.model_type == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute(w, args.num_kv_heads)
        yield name, w
