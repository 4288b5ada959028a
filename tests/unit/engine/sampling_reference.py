"""The per-row sampler this project had before sampling was batched (engine/sampling.py at
0968d7f), kept as the reference the batched sampler is compared with: seeded rows must
choose the same tokens, with the same logprobs. Its RequestHistory is the engine's own."""

from __future__ import annotations

import torch

from helixserve.engine.history import RequestHistory
from helixserve.engine.sampling import SampleResult
from helixserve.request import SamplingParams


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> None:
    """In place on one row. logits: [vocab_size] float32."""
    if not params.logit_bias:
        return
    ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=logits.device)
    values = torch.tensor([v for _, v in params.logit_bias], dtype=logits.dtype,
                          device=logits.device)
    logits[ids] += values


def apply_penalties(logits: torch.Tensor, params: SamplingParams, hist: RequestHistory) -> None:
    """In place on one row. logits: [vocab_size] float32."""
    device = logits.device
    if params.repetition_penalty != 1.0:
        seen = hist.prompt_ids | set(hist.output_counts)
        if seen:
            ids = torch.tensor(sorted(seen), dtype=torch.long, device=device)
            sel = logits[ids]
            rp = params.repetition_penalty
            logits[ids] = torch.where(sel > 0, sel / rp, sel * rp)
    if (params.presence_penalty or params.frequency_penalty) and hist.output_counts:
        ids_list = list(hist.output_counts)
        ids = torch.tensor(ids_list, dtype=torch.long, device=device)
        counts = torch.tensor(
            [hist.output_counts[i] for i in ids_list], dtype=logits.dtype, device=device
        )
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts


def suppresses_stop(params: SamplingParams, hist: RequestHistory) -> bool:
    """True while the request is below min_tokens and must not sample a stop token."""
    return bool(params.stop_token_ids) and hist.num_generated < params.min_tokens


def filter_support(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p / min-p. logits: [vocab_size], scaled."""
    neg_inf = float("-inf")
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, neg_inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p. The top one
        # always stays, set explicitly: for it the sum is 0, and a top_p that underflows to
        # 0 (5e-324 is 0 as the wire's float32) dropped it too, leaving softmax all NaN.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, neg_inf)
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), neg_inf)
    return logits


def _finite(row: torch.Tensor) -> torch.Tensor:
    """Logits softmax can take: +inf -> the largest float, NaN -> -inf (never drawn).

    Parameters the API accepts as > 0 can reach here as 0 or denormal: the wire carries them
    as float32, where 5e-324 is 0. A repetition_penalty of 0 divides by zero (+inf), and
    +inf - +inf is NaN in softmax: the draw fails."""
    if bool(torch.isfinite(row).all()):
        return row
    return torch.nan_to_num(row, nan=float("-inf"), posinf=torch.finfo(row.dtype).max)


def reference_sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], hists: list[RequestHistory]
) -> list[SampleResult]:
    """Pick one token per row. logits: [num_rows, vocab_size] (any float dtype)."""
    logits = logits.float()
    num_rows = logits.shape[0]
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

    # Fast path for the common case: greedy rows without penalties, one batched argmax.
    plain_greedy = [
        p.is_greedy and not p.changes_logits and not suppresses_stop(p, h)
        for p, h in zip(params, hists, strict=True)
    ]
    chosen: list[int] = [0] * num_rows
    if any(plain_greedy):
        argmax = logits.argmax(dim=-1).tolist()
        for i, g in enumerate(plain_greedy):
            if g:
                chosen[i] = int(argmax[i])
    for i in range(num_rows):
        if plain_greedy[i]:
            continue
        p, hist = params[i], hists[i]
        row = logits[i].clone()
        apply_logit_bias(row, p)
        apply_penalties(row, p, hist)
        if suppresses_stop(p, hist):
            ids = torch.tensor(p.stop_token_ids, dtype=torch.long, device=row.device)
            row[ids] = float("-inf")
        row = _finite(row)
        if p.is_greedy:
            chosen[i] = int(row.argmax())
            continue
        # Subtract the max first: a tiny temperature then sends the rest to -inf instead of
        # the top to +inf (softmax is shift-invariant).
        row = _finite(filter_support((row - row.max()) / p.temperature, p))
        probs = torch.softmax(row, dim=-1)
        gen = hist.get_generator(p, row.device)
        chosen[i] = int(torch.multinomial(probs, 1, generator=gen))

    results = []
    for i in range(num_rows):
        n = params[i].logprobs
        if n is None or raw_logprobs is None:
            results.append(SampleResult(chosen[i], None, []))
            continue
        lp = raw_logprobs[i]
        top: list[tuple[int, float]] = []
        if n > 0:
            vals, ids = torch.topk(lp, n)
            top = [(int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        results.append(SampleResult(chosen[i], float(lp[chosen[i]]), top))
    return results
