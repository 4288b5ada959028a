"""The model, from a Hugging Face `config.json` (Llama family: llama, mistral, qwen2).

Only sizes matter to the planner: bytes of weights per decoder layer, KV-cache bytes per
token per layer, activation bytes per token sent between pipeline stages, and the
embedding + lm_head bytes the first and last stages also hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.errors import UserError, read_user_file

#: bytes of one token id on a coordinator link (int32): the flow graph's coordinator edges,
#: the router's link capacities and the simulator's transfers all count this
TOKEN_ID_BYTES = 4
#: the float types a worker serves in (and hidden states travel in), with bytes per element
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    #: bytes per weight / activation element when served (bf16 or fp16)
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    #: q/k/v projections carry a bias (qwen2, attention_bias=true)
    qkv_bias: bool = False

    @property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q = self.num_attention_heads * d
        kv = self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        norms = 2 * h
        return attn + mlp + norms

    @property
    def layer_weight_bytes(self) -> int:
        return self.layer_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    @property
    def activation_bytes_per_token(self) -> int:
        """Hidden state of one token, sent between stages: [hidden_size] x dtype."""
        return self.hidden_size * self.dtype_bytes

    @property
    def embedding_weight_bytes(self) -> int:
        """Token embedding + final norm + lm_head (one matrix when tied)."""
        mats = 1 if self.tie_word_embeddings else 2
        return (mats * self.vocab_size * self.hidden_size + self.hidden_size) * self.dtype_bytes

    @property
    def total_weight_bytes(self) -> int:
        return self.num_layers * self.layer_weight_bytes + self.embedding_weight_bytes


def _int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{source}: {key}: bad value {value!r}; expected a positive integer")
    return value


def parse_model(cfg: Any, name: str, source: str = "config.json",
                dtype_bytes: int = 2) -> ModelSpec:
    if not isinstance(cfg, dict):
        raise UserError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    hidden = _int(cfg, "hidden_size", source)
    heads = _int(cfg, "num_attention_heads", source)
    kv_heads = _int(cfg, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise UserError(f"{source}: num_key_value_heads: {kv_heads} does not divide "
                        f"num_attention_heads {heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    return ModelSpec(
        name=name,
        num_layers=_int(cfg, "num_hidden_layers", source),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        intermediate_size=_int(cfg, "intermediate_size", source),
        vocab_size=_int(cfg, "vocab_size", source),
        max_position_embeddings=_int(cfg, "max_position_embeddings", source, default=4096),
        dtype_bytes=dtype_bytes,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
    )


def load_model(path: str | Path, name: str | None = None, dtype_bytes: int = 2) -> ModelSpec:
    """Read a config.json (or a directory holding one); name defaults to the directory name."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    text = read_user_file(cfg_path, "model config")
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{cfg_path}: not valid JSON: {exc.msg} at line {exc.lineno}") from None
    model_name = name or cfg_path.resolve().parent.name
    return parse_model(cfg, model_name, source=str(cfg_path), dtype_bytes=dtype_bytes)
