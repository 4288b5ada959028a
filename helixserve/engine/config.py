"""Model architecture read from a Hugging Face `config.json` (Llama family).

One typed `ModelArgs` (as in gpt-fast) covers llama, mistral and qwen2: they differ only in
attention bias (qwen2 has q/k/v bias), rope base/scaling, and tied embeddings. Both the
old (`rope_theta` + `rope_scaling`) and the transformers>=5 (`rope_parameters`) spellings
are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helixserve.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a Llama-family decoder."""

    model_type: str
    """`llama`, `mistral` or `qwen2`."""
    num_layers: int
    """Transformer blocks in the whole model."""
    hidden_size: int
    intermediate_size: int
    """Width of the SiLU-gated MLP."""
    num_heads: int
    num_kv_heads: int
    """Grouped-query attention: each KV head serves num_heads / num_kv_heads query heads."""
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """Empty for plain RoPE; else `rope_type` (`linear`, `llama3`) and its parameters."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (qwen2)."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix."""
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
        model_type = str(cfg.get("model_type", "llama"))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"{source}: model_type: unsupported '{model_type}'; known: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise UserError(f"{source}: {key}: bad value {cfg.get(key)!r}; need a positive int")
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UserError(
                f"{source}: num_key_value_heads: {num_kv_heads} does not divide "
                f"num_attention_heads {num_heads}"
            )
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
        # transformers>=5 moved rope_theta/rope_scaling into one `rope_parameters` dict.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = dict(cfg.get("rope_scaling") or {})
        rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
        scaling = {**rope_params, **rope_scaling}
        scaling.pop("rope_theta", None)
        rope_type = str(scaling.get("rope_type") or scaling.get("type") or "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UserError(
                f"{source}: rope_scaling.rope_type: unsupported '{rope_type}'; known: "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        scaling = {} if rope_type == "default" else {**scaling, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else ((int(eos),) if eos is not None else ())
        )
        # qwen2 always has q/k/v bias; llama exposes it as `attention_bias`.
        attention_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=int(cfg.get("vocab_size") or 32000),
            rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-5),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            attention_bias=attention_bias,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelArgs:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UserError(
                f"{model_dir}: no config.json (expected a Hugging Face model directory)"
            )
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON: {exc}") from exc
        return cls.from_hf_config(cfg, source=str(path))
