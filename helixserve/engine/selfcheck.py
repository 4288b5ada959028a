"""A worker's self-check before it reports healthy: one tiny prefill and decode on its own
layer range, through the real engine, compared with a second path.

Two comparisons, each on fixed inputs (token ids from a formula; hidden states, when the
range starts after layer 0, from a seeded generator):
1. **Incremental vs one shot** (every engine with tensors): request A runs a prefill of
   `PROMPT_TOKENS` tokens and then `DECODE_STEPS` single-token steps; request B runs the same
   tokens as one prefill. The paged-KV decode path must give what the prefill path gives:
   the same hidden rows (a stage that ends before the last layer), or the same next token
   (the last stage; a near tie may differ, see `_tokens_agree`). This catches wrong block
   tables, positions or stale KV, which a GPU code path that never ran could have.
2. **Against the reference path** where one exists: for the vllm engine, helixserve's torch
   engine loaded for the range's first layer only (small: one layer, plus the embedding or
   head it needs) on the same device and dtype, fed the same incremental steps; the vllm
   engine runs only that layer (partial inference). The torch engine is the reference itself.

Tolerances are relative to what the layers added (`_rel_diff`): float32 tight, 16-bit loose
(kernels and reduction orders differ). A failure raises `SelfCheckError`, a `UserError`, so
`helixserve worker` prints one line naming the engine, the device and the fix and exits 2.
Every request is freed afterwards: the engine's KV returns to what it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from helixserve.engine.protocol import Engine, ItemOutput, WorkItem
from helixserve.errors import UserError
from helixserve.request import SamplingParams

PROMPT_TOKENS = 8
DECODE_STEPS = 2
TOP_N = 5
"""Top logprobs compared on the last stage."""
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 0.15
"""16-bit dtypes: relative difference of what the layers added, and logprob gap of a tie."""
FIX = {"vllm": "start the worker with --engine torch (helixserve's own engine)",
       "torch": "check the checkpoint and --dtype, or try --device cpu"}


class SelfCheckError(UserError):
    """The engine gave wrong results on its own range at start; one line for the CLI."""

    def __init__(self, engine: str, device: str, detail: str) -> None:
        self.engine, self.device, self.detail = engine, device, detail
        fix = FIX.get(engine, "start the worker with --engine torch")
        super().__init__(f"self-check failed: engine {engine} on {device}: {detail}; {fix}")


@dataclass(frozen=True)
class SelfCheckReport:
    engine: str
    device: str
    max_rel_diff: float
    """Incremental vs one shot: relative difference of hidden rows (0 on the last stage)."""
    reference: str | None
    """What the engine was compared with, or None."""
    reference_rel_diff: float | None

    def line(self) -> str:
        ref = ("" if self.reference is None
               else f"; vs {self.reference}: {self.reference_rel_diff:.1e}")
        return (f"self-check passed: engine {self.engine} on {self.device}, prefill "
                f"{PROMPT_TOKENS} + decode {DECODE_STEPS}: incremental vs one shot "
                f"{self.max_rel_diff:.1e}{ref}")


def _tolerance(dtype: Any) -> float:
    return TOLERANCE.get(dtype, HALF_TOLERANCE)


def _tokens(engine: Engine, n: int) -> list[int]:
    """n fixed token ids spread over the vocabulary, none of them 0."""
    return [1 + (17 + 7919 * i) % (engine.vocab_size - 1) for i in range(n)]


def _hidden(engine: Engine, n: int) -> torch.Tensor:
    """Fixed hidden states entering the range: [n, hidden_size], float32 on the CPU."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(n, engine.hidden_size, generator=gen)


def _run(engine: Engine, rid: str, layers: tuple[int, int], tokens: list[int],
         hidden: torch.Tensor | None, chunks: list[int]) -> list[ItemOutput]:
    """Feed `tokens` in chunks of the given sizes (one step each) over `layers`."""
    is_last = layers[1] == engine.num_model_layers
    sampling = SamplingParams(temperature=0.0, logprobs=TOP_N) if is_last else None
    outs, pos = [], 0
    for n in chunks:
        h = None
        if hidden is not None:
            h = hidden[pos : pos + n].to(engine.dtype)  # [n, hidden_size]
        item = WorkItem(rid, layers[0], layers[1], pos, tokens[pos : pos + n], h, sampling)
        outs.append(engine.step([item])[0])
        pos += n
    return outs


def _rel_diff(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor | None) -> float:
    """||a - b|| / ||b - base|| per row, max over rows: the difference relative to what the
    layers added to the incoming stream `base` (or to b itself when the stream is unknown,
    i.e. embedded inside the engine). a, b, base: [rows, hidden_size]."""
    a, b = a.float().cpu(), b.float().cpu()
    ref = b if base is None else b - base.float().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    num = (a - b).norm(dim=-1)
    den = ref.norm(dim=-1).clamp_min(1e-6)
    return float((num / den).max())


def _tokens_agree(a: ItemOutput, b: ItemOutput, tol: float) -> str | None:
    """None if two last-stage outputs agree: the same greedy token with logprobs within
    `tol`, or a near tie (each token in the other's top-N, logprobs within `tol`)."""
    if a.token_id is None or b.token_id is None or a.logprob is None or b.logprob is None:
        return "no token sampled"
    if not (abs(a.logprob) < float("inf") and abs(b.logprob) < float("inf")):
        return f"logprob not finite ({a.logprob}, {b.logprob})"
    if a.token_id == b.token_id:
        if abs(a.logprob - b.logprob) <= tol:
            return None
        return f"token {a.token_id}: logprob {a.logprob:.4f} vs {b.logprob:.4f}"
    top_a, top_b = dict(a.top_logprobs), dict(b.top_logprobs)
    if (b.token_id in top_a and a.token_id in top_b
            and abs(top_a[b.token_id] - b.logprob) <= tol
            and abs(top_b[a.token_id] - a.logprob) <= tol):
        return None
    return f"greedy token {a.token_id} (logprob {a.logprob:.4f}) vs {b.token_id} " \
           f"(logprob {b.logprob:.4f})"


def _compare(engine: Engine, layers: tuple[int, int], a: list[ItemOutput],
             b: list[ItemOutput], hidden: torch.Tensor | None) -> tuple[float, str | None]:
    """(relative difference, problem or None) of two output lists of the same tokens,
    a incremental (prefill + decode steps), b the same steps or one prefill."""
    tol = _tolerance(engine.dtype)
    if layers[1] == engine.num_model_layers:
        problem = _tokens_agree(a[-1], b[-1], tol)
        return 0.0, problem
    rows_a = torch.cat([o.hidden for o in a])  # [tokens, hidden_size]
    rows_b = torch.cat([o.hidden for o in b])
    diff = _rel_diff(rows_a, rows_b, hidden)
    return diff, None if diff <= tol else f"hidden states differ by {diff:.2e} (tolerance {tol})"


def self_check(engine: Engine, device: str, reference: Engine | None = None) -> SelfCheckReport:
    """Run the self-check (module doc) on `engine`'s range; SelfCheckError on a failure.
    `reference`: an engine for layers [engine.start_layer, engine.start_layer + 1) on the
    same device and dtype (`load_reference`), or None."""
    name = str(getattr(engine, "engine_name", type(engine).__name__))
    n = PROMPT_TOKENS + DECODE_STEPS
    tokens = _tokens(engine, n)
    start = engine.start_layer
    hidden = _hidden(engine, n) if start > 0 else None
    full = (start, engine.end_layer)
    steps = [PROMPT_TOKENS] + [1] * DECODE_STEPS
    ids = ["helix-selfcheck-a", "helix-selfcheck-b", "helix-selfcheck-c", "helix-selfcheck-r"]
    try:
        try:
            inc = _run(engine, ids[0], full, tokens, hidden, steps)
            one = _run(engine, ids[1], full, tokens, hidden, [n])
        except Exception as exc:  # the engine's own failure is the finding
            raise SelfCheckError(name, device, f"a prefill/decode step raised "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                                 ) from exc
        # hidden rows: [n, hidden_size] either way; last stage: the token after all n
        diff, problem = _compare(engine, full, inc, one, hidden)
        if problem:
            raise SelfCheckError(name, device, f"prefill + {DECODE_STEPS} decode steps vs one "
                                 f"prefill of layers [{full[0]}, {full[1]}): {problem}")
        ref_name, ref_diff = None, None
        if reference is not None:
            layers = (reference.start_layer, reference.end_layer)
            try:
                got = _run(engine, ids[2], layers, tokens, hidden, steps)
            except Exception as exc:
                raise SelfCheckError(name, device, f"a step of layers [{layers[0]}, "
                                     f"{layers[1]}) raised {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:200]}") from exc
            want = _run(reference, ids[3], layers, tokens, hidden, steps)
            ref_diff, problem = _compare(engine, layers, got, want, hidden)
            ref_name = f"engine torch on layers [{layers[0]}, {layers[1]})"
            if problem:
                raise SelfCheckError(name, device, f"layers [{layers[0]}, {layers[1]}) vs "
                                     f"helixserve's torch engine: {problem}")
        return SelfCheckReport(name, device, diff, ref_name, ref_diff)
    finally:
        for rid in ids[:3]:
            engine.free(rid)
        if reference is not None:
            reference.free(ids[3])


def load_reference(engine_name: str, model_dir: str | Path, start_layer: int, device: str,
                   dtype: Any) -> Engine | None:
    """The reference for `engine_name`'s self-check: the torch engine on the range's first
    layer (None for the torch engine, which is the reference, and for emulated)."""
    if engine_name != "vllm":
        return None
    from helixserve.engine.shard import ShardEngine

    return ShardEngine.load(model_dir, start_layer, start_layer + 1, device=device,
                            dtype=dtype, kv_cache_bytes=64 << 20)
