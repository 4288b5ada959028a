"""Llama-family decoder layers over a flat batch of tokens with a paged KV cache.

In the spirit of gpt-fast: plain tensors and functions, no nn.Module tree. Every layer
works on `x: [num_tokens, hidden_size]`, the tokens of all requests of a step
concatenated (no padding). Dense ops (norms, fused qkv, fused gate/up MLP) run over all
tokens at once; attention runs per group of requests (see `attention`):
- decode rows (one new token each) in one batched SDPA over their keys gathered from the
  paged cache, padded to the longest context and masked;
- each prefill chunk on its own with a causal SDPA (over the fresh keys when it starts at
  position 0, else over its keys gathered from the cache).

Numerics follow transformers' LlamaForCausalLM (RMSNorm in float32, rotate-half RoPE with
cos/sin computed in float32), so logits agree within float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from helixserve.engine.config import ModelArgs


@dataclass
class LayerWeights:
    """One transformer block; q/k/v and gate/up are fused into single matmuls."""

    input_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    bqkv: torch.Tensor | None  # [q_size + 2 * kv_size] (qwen2) or None
    wo: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    w_down: torch.Tensor  # [hidden, intermediate]

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], i: int, args: ModelArgs) -> LayerWeights:
        p = f"model.layers.{i}."
        wqkv = torch.cat(
            [
                t.pop(p + "self_attn.q_proj.weight"),
                t.pop(p + "self_attn.k_proj.weight"),
                t.pop(p + "self_attn.v_proj.weight"),
            ]
        )
        bqkv = None
        if args.attention_bias:
            bqkv = torch.cat(
                [
                    t.pop(p + "self_attn.q_proj.bias"),
                    t.pop(p + "self_attn.k_proj.bias"),
                    t.pop(p + "self_attn.v_proj.bias"),
                ]
            )
        w_gate_up = torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")])
        return cls(
            input_norm=t.pop(p + "input_layernorm.weight"),
            wqkv=wqkv,
            bqkv=bqkv,
            wo=t.pop(p + "self_attn.o_proj.weight"),
            post_norm=t.pop(p + "post_attention_layernorm.weight"),
            w_gate_up=w_gate_up,
            w_down=t.pop(p + "mlp.down_proj.weight"),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [n, hidden]. Normalizes in float32 and casts back before the weight, like HF."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rope:
    """cos/sin tables of rotary embeddings, grown on demand (never past what is asked for)."""

    def __init__(self, args: ModelArgs, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq = rope_inv_freq(args).to(device)  # [head_dim / 2], float32
        self.dtype = dtype
        self.cos = torch.empty(0, args.head_dim, device=device, dtype=dtype)
        self.sin = torch.empty(0, args.head_dim, device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [num_tokens, head_dim] for the given positions."""
        if max_pos >= self.cos.shape[0]:
            n = max(2 * self.cos.shape[0], 1024, max_pos + 1)
            pos = torch.arange(n, device=self.inv_freq.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]  # [n, head_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return self.cos[positions], self.sin[positions]


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] with linear / llama3 scaling (transformers' math)."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = args.rope_scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv / float(args.rope_scaling["factor"])
    if rope_type != "llama3":
        return inv
    import math

    factor = float(args.rope_scaling["factor"])
    low = float(args.rope_scaling.get("low_freq_factor", 1.0))
    high = float(args.rope_scaling.get("high_freq_factor", 4.0))
    old_ctx = float(args.rope_scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, head_dim]; cos, sin: [n, head_dim]. Rotate-half convention (HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class AttentionPlan:
    """Where the rows of one set of requests live in the step and in the cache.

    Built once per step (per distinct set of active requests) and reused by every layer.
    """

    slots: torch.Tensor  # [n] cache slot of each row's new key/value
    positions: torch.Tensor  # [n] absolute position of each row
    max_pos: int
    # Decode rows: one row each, batched.
    decode_rows: torch.Tensor | None  # [d] row indices into the active rows
    decode_kv_slots: torch.Tensor | None  # [d, max_ctx] cache slots of each context
    decode_mask: torch.Tensor | None  # [d, 1, 1, max_ctx] True = attend
    # Prefill chunks: (first row, num rows, kv slots [ctx] or None when starting at 0).
    prefills: list[tuple[int, int, torch.Tensor | None]]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    args: ModelArgs,
) -> torch.Tensor:
    """q: [n, heads, hd], k/v: [n, kv_heads, hd] (already written to the cache) -> [n, heads*hd].

    k_cache / v_cache: [num_slots, kv_heads, head_dim] of this layer.
    """
    n = q.shape[0]
    gqa = args.num_heads != args.num_kv_heads
    out = torch.empty(n, args.num_heads, args.head_dim, dtype=q.dtype, device=q.device)
    for first, count, ctx_slots in plan.prefills:
        qi = q[first : first + count].transpose(0, 1)[None]  # [1, heads, count, hd]
        if ctx_slots is None:
            ki = k[first : first + count].transpose(0, 1)[None]  # [1, kv_heads, count, hd]
            vi = v[first : first + count].transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=gqa)
        else:
            ctx = ctx_slots.shape[0]
            ki = k_cache[ctx_slots].transpose(0, 1)[None]  # [1, kv_heads, ctx, hd]
            vi = v_cache[ctx_slots].transpose(0, 1)[None]
            # Chunk rows are the last `count` positions of the context: causal, offset.
            q_pos = torch.arange(ctx - count, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [count, ctx]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=gqa)
        out[first : first + count] = oi[0].transpose(0, 1)
    if plan.decode_rows is not None:
        assert plan.decode_kv_slots is not None
        rows = plan.decode_rows
        qd = q[rows][:, :, None, :]  # [d, heads, 1, hd]
        kd = k_cache[plan.decode_kv_slots].transpose(1, 2)  # [d, kv_heads, max_ctx, hd]
        vd = v_cache[plan.decode_kv_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, enable_gqa=gqa)
        out[rows] = od[:, :, 0, :]
    return out.view(n, args.num_heads * args.head_dim)


def layer_forward(
    x: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    cos: torch.Tensor,
    sin: torch.Tensor,
    args: ModelArgs,
) -> torch.Tensor:
    """One transformer block. x: [n, hidden] -> [n, hidden]; writes this step's k/v."""
    n = x.shape[0]
    h = rms_norm(x, w.input_norm, args.rms_norm_eps)
    qkv = F.linear(h, w.wqkv, w.bqkv)  # [n, q_size + 2 * kv_size]
    q, k, v = qkv.split([args.q_size, args.kv_size, args.kv_size], dim=-1)
    q = apply_rope(q.view(n, args.num_heads, args.head_dim), cos, sin)
    k = apply_rope(k.view(n, args.num_kv_heads, args.head_dim), cos, sin)
    v = v.view(n, args.num_kv_heads, args.head_dim)
    k_cache.index_copy_(0, plan.slots, k)
    v_cache.index_copy_(0, plan.slots, v)
    x = x + F.linear(attention(q, k, v, k_cache, v_cache, plan, args), w.wo)
    h = rms_norm(x, w.post_norm, args.rms_norm_eps)
    gate, up = F.linear(h, w.w_gate_up).chunk(2, dim=-1)  # [n, intermediate] each
    return x + F.linear(F.silu(gate) * up, w.w_down)
