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

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from helixserve.engine.config import ModelArgs
from helixserve.errors import UserError

CPU_MATMUL_MODES = ("both", "onednn", "plain")
ONEDNN_MIN_ROWS = 4


class Linear:
    """y = x @ W.T (+ b) with the weight stored in the fastest layout(s) for the device.

    Measured on the dev CPU (1 thread, 30 layers' weights streamed from DRAM, process
    time): a weight prepacked for oneDNN (mkldnn) multiplies 8 rows 2x faster than
    F.linear and 32 rows 1.35x faster, but 1 row 1.4x slower; the plain transposed layout
    (`x @ w_t`) is the fastest for 1 row. So on CPU in float32 the default
    (HELIXSERVE_CPU_MATMUL=both) keeps both and picks by row count, at twice the weight
    memory; `onednn` or `plain` keep one. On GPU cuBLAS handles the plain layout well.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, single: bool = False
    ) -> None:
        """single: keep one layout even in `both` mode (the lm_head: oneDNN is about as
        fast as F.linear for it at 1 row and 3x faster at 8, not worth 2x its memory)."""
        self.out_features, self.in_features = weight.shape  # weight: [out, in]
        self.bias = bias  # [out] or None
        self.packed: torch.Tensor | None = None  # oneDNN blocked layout
        self.w_t: torch.Tensor | None = None  # [in, out]
        mode = cpu_matmul_mode(weight)
        if single and mode == "both":
            mode = "onednn"
        if mode in ("both", "onednn"):
            # Batch-size hint 8 gave the best few-row and many-row times together.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        if mode in ("both", "plain"):
            self.w_t = weight.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, in] -> [n, out]."""
        if self.packed is not None and (self.w_t is None or x.shape[0] >= ONEDNN_MIN_ROWS):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.w_t is not None
        return x @ self.w_t if self.bias is None else torch.addmm(self.bias, x, self.w_t)

    @property
    def weight_bytes(self) -> int:
        """Bytes held for this weight (both layouts when both are kept)."""
        n = 0
        for w in (self.packed, self.w_t):
            if w is not None:
                n += self.out_features * self.in_features * w.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def cpu_matmul_mode(weight: torch.Tensor) -> str:
    """`plain` off CPU-float32 or without oneDNN; else $HELIXSERVE_CPU_MATMUL (default both)."""
    mode = os.environ.get("HELIXSERVE_CPU_MATMUL", "both")
    if mode not in CPU_MATMUL_MODES:
        raise UserError(
            f"HELIXSERVE_CPU_MATMUL: unknown '{mode}'; known: {', '.join(CPU_MATMUL_MODES)}"
        )
    usable = (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
    return mode if usable else "plain"


@dataclass
class LayerWeights:
    """One transformer block; q/k/v and gate/up are fused into single matmuls."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q_size + 2 * kv_size (with bias for qwen2)
    o: Linear  # q_size -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], i: int, args: ModelArgs) -> LayerWeights:
        """Takes (pops) layer i's HF tensors out of `t`, so each is freed once repacked."""
        p = f"model.layers.{i}."
        attn = [p + f"self_attn.{x}_proj" for x in "qkv"]
        wqkv = torch.cat([t.pop(n + ".weight") for n in attn])
        bqkv = torch.cat([t.pop(n + ".bias") for n in attn]) if args.attention_bias else None
        gate_up = torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")])
        return cls(
            input_norm=t.pop(p + "input_layernorm.weight"),
            qkv=Linear(wqkv, bqkv),
            o=Linear(t.pop(p + "self_attn.o_proj.weight")),
            post_norm=t.pop(p + "post_attention_layernorm.weight"),
            gate_up=Linear(gate_up),
            down=Linear(t.pop(p + "mlp.down_proj.weight")),
        )

    @property
    def weight_bytes(self) -> int:
        norms = self.input_norm.numel() + self.post_norm.numel()
        linears = (self.qkv, self.o, self.gate_up, self.down)
        return norms * self.input_norm.element_size() + sum(x.weight_bytes for x in linears)


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
    # Decode rows (one new token each), attended in one batch.
    decode_rows: torch.Tensor | None  # [d] row indices into the active rows
    decode_ctx_blocks: torch.Tensor | None  # [d * nb] cache blocks of each context, flat
    block_size: int
    decode_max_ctx: int
    decode_mask: torch.Tensor | None  # [d, 1, 1, max_ctx] True = attend; None = all equal
    # Prefill chunks: (first row, num rows, ctx slots [ctx] or None when starting at 0).
    prefills: list[tuple[int, int, torch.Tensor | None]]
    all_decode: bool
    """Every row is a decode row, in order: attention output needs no scatter."""
    dense_pos: torch.Tensor | None = None
    """[d] position of each decode row's token when the step uses dense decode contexts."""


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    args: ModelArgs,
    dense: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q: [n, heads, hd], k/v: [n, kv_heads, hd] (already in the cache) -> [n, heads * hd].

    k_cache / v_cache: [kv_heads, num_slots, head_dim] of this layer: a gather of a set of
    slots comes out as [kv_heads, slots, head_dim], the layout SDPA wants, without a copy.
    """
    n = q.shape[0]
    gqa = args.num_heads != args.num_kv_heads
    if dense is not None:
        # Dense per-step decode contexts kept across steps (see ShardEngine): append this
        # token's k/v and attend over a view, no gather from the paged cache.
        dk, dv = dense  # [d, kv_heads, cap, hd]
        rows = torch.arange(n, device=q.device)
        dk[rows, :, plan.dense_pos] = k
        dv[rows, :, plan.dense_pos] = v
        ctx = plan.decode_max_ctx
        od = F.scaled_dot_product_attention(
            q[:, :, None, :],
            dk[:, :, :ctx],
            dv[:, :, :ctx],
            attn_mask=plan.decode_mask,
            enable_gqa=gqa,
        )  # [d, heads, 1, hd]
        return od.reshape(n, -1)
    if plan.all_decode:
        return _decode_attention(q, k_cache, v_cache, plan, gqa).reshape(n, -1)
    out = torch.empty(n, args.num_heads, args.head_dim, dtype=q.dtype, device=q.device)
    for first, count, ctx_slots in plan.prefills:
        qi = q[first : first + count].transpose(0, 1)[None]  # [1, heads, count, hd]
        if ctx_slots is None:
            ki = k[first : first + count].transpose(0, 1)[None]  # [1, kv_heads, count, hd]
            vi = v[first : first + count].transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=gqa)
        else:
            ctx = ctx_slots.shape[0]
            ki = k_cache.index_select(1, ctx_slots)[None]  # [1, kv_heads, ctx, hd]
            vi = v_cache.index_select(1, ctx_slots)[None]
            # The chunk's rows are the last `count` positions of the context: causal, offset.
            q_pos = torch.arange(ctx - count, ctx, device=q.device)[:, None]
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [count, ctx]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=gqa)
        out[first : first + count] = oi[0].transpose(0, 1)
    if plan.decode_rows is not None:
        out[plan.decode_rows] = _decode_attention(q[plan.decode_rows], k_cache, v_cache, plan, gqa)
    return out.view(n, args.num_heads * args.head_dim)


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan, gqa: bool
) -> torch.Tensor:
    """q: [d, heads, hd] one token per request -> [d, heads, hd], over gathered contexts."""
    assert plan.decode_ctx_blocks is not None
    d, kvh, hd, bs = q.shape[0], k_cache.shape[0], k_cache.shape[-1], plan.block_size
    # Gather whole blocks (rows of block_size * head_dim values), not single slots: the
    # same bytes move, but index_select copies 16x fewer, 16x longer rows (2x faster
    # measured at batch 32 on the dev CPU). Then drop the padding past the longest context.
    nb = plan.decode_ctx_blocks.shape[0] // d
    blocked = (kvh, -1, bs * hd)  # [kv_heads, num_blocks, block_size * hd]
    shape = (kvh, d, nb * bs, hd)
    kd = k_cache.view(blocked).index_select(1, plan.decode_ctx_blocks).view(shape)
    vd = v_cache.view(blocked).index_select(1, plan.decode_ctx_blocks).view(shape)
    kd = kd[:, :, : plan.decode_max_ctx].transpose(0, 1)
    vd = vd[:, :, : plan.decode_max_ctx].transpose(0, 1)
    # kd, vd: [d, kv_heads, max_ctx, hd]
    od = F.scaled_dot_product_attention(
        q[:, :, None, :], kd, vd, attn_mask=plan.decode_mask, enable_gqa=gqa
    )  # [d, heads, 1, hd]
    return od[:, :, 0, :]


def layer_forward(
    x: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    cos: torch.Tensor,
    sin: torch.Tensor,
    args: ModelArgs,
    dense: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One transformer block. x: [n, hidden] -> [n, hidden]; writes this step's k/v.

    k_cache, v_cache: [kv_heads, num_slots, head_dim] of this layer.
    """
    n = x.shape[0]
    h = rms_norm(x, w.input_norm, args.rms_norm_eps)
    qkv = w.qkv(h)  # [n, q_size + 2 * kv_size]
    q, k, v = qkv.split([args.q_size, args.kv_size, args.kv_size], dim=-1)
    q = apply_rope(q.view(n, args.num_heads, args.head_dim), cos, sin)
    k = apply_rope(k.view(n, args.num_kv_heads, args.head_dim), cos, sin)
    v = v.view(n, args.num_kv_heads, args.head_dim)
    k_cache.index_copy_(1, plan.slots, k.transpose(0, 1))
    v_cache.index_copy_(1, plan.slots, v.transpose(0, 1))
    x = x + w.o(attention(q, k, v, k_cache, v_cache, plan, args, dense))
    h = rms_norm(x, w.post_norm, args.rms_norm_eps)
    gate, up = w.gate_up(h).chunk(2, dim=-1)  # [n, intermediate] each
    return x + w.down(F.silu(gate) * up)
