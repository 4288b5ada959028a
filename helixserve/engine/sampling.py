"""Token sampling on the last stage, vectorised over the step's rows.

Order (as in vLLM): `logit_bias`, then penalties on the raw logits, then greedy (temperature 0)
or temperature scaling, then the support filters top-k, top-p, min-p, then one draw. Every
stage is a few tensor ops over all the rows that need it (no loop over rows with a host sync
each); the step's chosen tokens and logprobs leave the device in one copy at the end
(`host_copy.to_host`): one host sync per step.

Draws:
- a request with a `seed` draws from its own `torch.Generator`, exactly as the per-row
  sampler before it did: the support filters replay its float operations row for row, and the
  draw is `torch.multinomial`'s own for one sample (argmax of probs / q, q ~ Exp(1) drawn from
  the request's generator over the whole vocabulary). So a seeded request samples the same
  tokens whatever else is in the batch, and the same tokens as before this sampler was batched.
  The Exp(1) draw over the vocabulary (~1 ms a row on the dev CPU) is the price of that.
- a request without a seed has no tokens to reproduce: its rows draw once each from the
  engine's generator by inverse CDF (one uniform a row), over the kept tokens only. On CPU
  its top-k / top-p / min-p cut is found among the CPU_CANDIDATES most likely tokens
  (numpy's partition and SIMD sort), falling back to the whole sorted row when the cut
  lies beyond them; on CUDA over one sort of the rows.

Penalties use the request's token history as seen by the last stage:
- repetition_penalty (HF / vLLM semantics): every id in prompt or output has its logit
  divided by the penalty if positive, multiplied if negative;
- presence_penalty / frequency_penalty (OpenAI semantics): over generated tokens only,
  `logit -= presence * [count > 0] + frequency * count`.

Logprobs are those of the model's own distribution (log_softmax of the raw logits, before
penalties and filters), for the chosen token and the top-n alternatives, like vLLM's default.
Prompt logprobs (`prompt_logprobs`, for the API's `echo`) are the same quantity for each prompt
token given the tokens before it: the engine scores the prompt rows of a request that asks.
`logit_bias` (OpenAI semantics) adds a per-token value to the logits before the penalties and
everything after them; -100 / +100 in practice ban / force a token. Logprobs stay the model's
own, unbiased, like the penalties.
A request with a grammar (`structured`, engine/structured.py) has every token its grammar does
not allow next set to -inf after the adjustments above and before greedy or the draw, so
greedy picks the best allowed token; its logprobs stay the model's own too.
Stop tokens and max_tokens are the coordinator's business: the sampler only samples, except
for `min_tokens`: while fewer than `min_tokens` tokens have been generated, the ids in
`stop_token_ids` (EOS included, unless the client asked to ignore it) are masked out, so the
request cannot end early (vLLM's semantics). Token ids outside the vocabulary (in
`logit_bias`, `stop_token_ids` or the history) are skipped, never an error.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from helixserve.engine.history import RequestHistory, suppresses_stop
from helixserve.engine.host_copy import to_device, to_host
from helixserve.engine.structured import constrain_, greedy_constrained_
from helixserve.request import PromptLogprob, SamplingParams

NEG_INF = float("-inf")
CPU_CANDIDATES = 4096
"""Unseeded filtered rows on CPU: the cut is looked for among this many most likely tokens
first (a partition, then a sort of these); rows whose cut lies beyond sort their whole row."""


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]


def score_tokens(logprobs: torch.Tensor, token_ids: list[int], n: int) -> list[PromptLogprob]:
    """logprobs: [len(token_ids), vocab] (log_softmax rows); row i scores token_ids[i]."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if n > 0:
        vals, top_ids = torch.topk(logprobs, n, dim=-1)
        tops = [
            [(int(t), float(v)) for t, v in zip(ti, tv, strict=True)]
            for ti, tv in zip(top_ids.tolist(), vals.tolist(), strict=True)
        ]
    return [
        PromptLogprob(t, float(lp), top) for t, lp, top in zip(token_ids, chosen, tops, strict=True)
    ]


def _index(rows: list[int], ids: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return to_device(rows, device), to_device(ids, device)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  hists: list[RequestHistory]) -> None:
    """In place, row i for params[i]: logit_bias, repetition penalty, presence / frequency
    penalties, then the min_tokens mask of stop ids. logits: [rows, vocab] float32.

    Each is one indexed update over all rows (the same float ops per element as one row at
    a time). Ids outside [0, vocab) are skipped."""
    vocab, dev, dt = logits.shape[-1], logits.device, logits.dtype
    rows: list[int] = []
    ids: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for t, v in p.logit_bias:
            if 0 <= t < vocab:
                rows.append(i)
                ids.append(t)
                vals.append(v)
    if rows:
        at = _index(rows, ids, dev)
        logits[at] += to_device(vals, dev, dt)
    rows, ids, vals = [], [], []
    for i, (p, h) in enumerate(zip(params, hists, strict=True)):
        if p.repetition_penalty != 1.0:
            seen = [t for t in h.prompt_ids | set(h.output_counts) if 0 <= t < vocab]
            rows += [i] * len(seen)
            ids += seen
            vals += [p.repetition_penalty] * len(seen)
    if rows:
        at = _index(rows, ids, dev)
        sel, rp = logits[at], to_device(vals, dev, dt)
        logits[at] = torch.where(sel > 0, sel / rp, sel * rp)
    rows, ids = [], []
    presence: list[float] = []
    frequency: list[float] = []
    counts: list[int] = []
    for i, (p, h) in enumerate(zip(params, hists, strict=True)):
        if p.presence_penalty or p.frequency_penalty:
            for t, c in h.output_counts.items():
                if 0 <= t < vocab:
                    rows.append(i)
                    ids.append(t)
                    presence.append(p.presence_penalty)
                    frequency.append(p.frequency_penalty)
                    counts.append(c)
    if rows:
        at = _index(rows, ids, dev)
        pres, freq, cnt = (to_device(v, dev, dt) for v in (presence, frequency, counts))
        logits[at] -= pres + freq * cnt
    rows, ids = [], []
    for i, (p, h) in enumerate(zip(params, hists, strict=True)):
        if suppresses_stop(p, h):
            stops = [t for t in p.stop_token_ids if 0 <= t < vocab]
            rows += [i] * len(stops)
            ids += stops
    if rows:
        logits[_index(rows, ids, dev)] = NEG_INF


def make_finite_(logits: torch.Tensor) -> torch.Tensor:
    """In place: +inf -> the largest float, NaN -> -inf (never drawn), -inf -> the lowest
    float (nan_to_num's default; the per-row sampler did the same to a row with any
    non-finite value, and nothing to an all-finite one, which this leaves as it is too).

    Parameters the API accepts as > 0 can reach here as 0 or denormal: the wire carries them
    as float32, where 5e-324 is 0. A repetition_penalty of 0 divides by zero (+inf), and
    +inf - +inf is NaN in softmax: the draw would fail."""
    return torch.nan_to_num_(logits, nan=NEG_INF, posinf=torch.finfo(logits.dtype).max)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax [rows] (first of equal maxima). numpy's SIMD argmax on CPU: ~10x
    torch's for [rows, vocab] float32."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.contiguous().numpy(), axis=-1).astype(np.int64))
    return x.argmax(dim=-1)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """[rows, 1] tensor of per-row values, in `like`'s dtype and device."""
    return to_device(values, like.device, like.dtype)[:, None]


def _take(x: torch.Tensor, rows: list[int], at: torch.Tensor) -> torch.Tensor:
    """Rows `at` of x: x itself when that is all of them (no copy), else a copy."""
    return x if len(rows) == x.shape[0] else x[at]


def _put(x: torch.Tensor, at: torch.Tensor, sub: torch.Tensor) -> None:
    """Write back what `_take` gave, unless it was x itself (changed in place)."""
    if sub is not x:
        x[at] = sub


# ---- seeded rows: the per-row sampler's float operations, on all such rows at once ------


def exact_support_(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p / min-p, row i by params[i].
    x: [rows, vocab], scaled logits. Element for element what a loop over rows did."""
    vocab = x.shape[-1]
    k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if k_rows:
        at = to_device(k_rows, x.device)
        ks = [params[i].top_k for i in k_rows]
        sub = _take(x, k_rows, at)
        kth = torch.topk(sub, max(ks)).values.gather(1, to_device(ks, x.device)[:, None] - 1)
        _put(x, at, sub.masked_fill_(sub < kth, NEG_INF))
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        at = to_device(p_rows, x.device)
        sub = _take(x, p_rows, at)
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p. The top one
        # always stays, set explicitly: for it the sum is 0, and a top_p that underflows to
        # 0 (5e-324 is 0 as the wire's float32) dropped it too, leaving softmax all NaN.
        top_p = _column([params[i].top_p for i in p_rows], probs)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        _put(x, at, sub.masked_fill_(drop, NEG_INF))
    m_rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if m_rows:
        at = to_device(m_rows, x.device)
        sub = _take(x, m_rows, at)
        probs = torch.softmax(sub, dim=-1)
        min_p = _column([params[i].min_p for i in m_rows], probs)
        _put(x, at, sub.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF))
    return x


def _draw_seeded(x: torch.Tensor, params: list[SamplingParams],
                 hists: list[RequestHistory]) -> torch.Tensor:
    """x: [rows, vocab] scaled logits of seeded rows -> [rows] token ids.

    torch.multinomial(probs, 1, generator) is argmax(probs / q) with q = Exp(1) over the
    vocabulary from the generator; here q is drawn row by row from each request's own
    generator (the same stream) and the division and argmax run on all rows at once."""
    probs = torch.softmax(make_finite_(exact_support_(x, params)), dim=-1)
    q = torch.empty_like(probs)
    for j, (p, h) in enumerate(zip(params, hists, strict=True)):
        q[j].exponential_(1.0, generator=h.get_generator(p, probs.device))
    return (probs / q).argmax(dim=-1)


# ---- unseeded rows: inverse CDF over the kept tokens, one uniform a row ------------------


def _cut_and_draw(vals: torch.Tensor, params: list[SamplingParams], u: torch.Tensor,
                  vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vals: [rows, k] each row's k largest probabilities, descending (k = vocab: all);
    u: [rows] uniforms in [0, 1). -> (position drawn in vals [rows], unresolved [rows]).

    The kept tokens are a prefix of each row: top-k keeps those >= the k-th largest (its
    ties too), top-p then the ones whose more likely tokens (within the top-k set) hold less
    than top_p of that set's mass (the first always), min-p then those >= min_p times the
    top. A row whose prefix reaches the end of a partial `vals` is unresolved: its cut may
    lie beyond (the caller redraws it over its whole row)."""
    rows, k = vals.shape
    dev = vals.device
    mass = vals.double().cumsum(dim=-1)  # [rows, k] inclusive
    before = torch.cat([torch.zeros(rows, 1, dtype=mass.dtype, device=dev), mass[:, :-1]], 1)
    top_k = to_device([p.top_k if 0 < p.top_k < vocab else k for p in params], dev)
    kth = vals.gather(1, (top_k.clamp(max=k) - 1)[:, None])
    keep = (vals >= kth).sum(dim=-1)
    kept_mass = mass.gather(1, (keep - 1)[:, None])
    top_p = to_device([p.top_p for p in params], dev, mass.dtype)[:, None]
    keep = torch.minimum(keep, (before < top_p * kept_mass).sum(dim=-1).clamp(min=1))
    min_p = to_device([p.min_p for p in params], dev, vals.dtype)[:, None]
    keep = torch.minimum(keep, (vals >= min_p * vals[:, :1]).sum(dim=-1).clamp(min=1))
    unresolved = (keep >= k) & (k < vocab) | (top_k > k)
    total = mass.gather(1, (keep - 1)[:, None])
    # u < 1, but u * total can round up to total: keep the target below it
    target = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, total * 0))
    pos = torch.searchsorted(mass, target, right=True)[:, 0]
    return torch.minimum(pos, keep - 1), unresolved


def _draw_filtered_cpu(probs: torch.Tensor, params: list[SamplingParams],
                       u: torch.Tensor) -> torch.Tensor:
    """probs: [rows, vocab] on CPU -> [rows] token ids, top-k / top-p / min-p applied."""
    a = probs.numpy()
    rows, vocab = a.shape
    k = min(vocab, CPU_CANDIDATES)
    part = np.partition(a, vocab - k, axis=-1)[:, vocab - k:] if k < vocab else a
    vals = np.ascontiguousarray(np.sort(part, axis=-1)[:, ::-1])  # [rows, k] descending
    pos_t, unresolved_t = _cut_and_draw(torch.from_numpy(vals), params, u, vocab)
    pos, unresolved = pos_t.numpy(), unresolved_t.numpy()
    redo = np.flatnonzero(unresolved)
    full: dict[int, tuple[np.ndarray, int]] = {}
    if redo.size:
        whole = np.ascontiguousarray(np.sort(a[redo], axis=-1)[:, ::-1])
        again, _ = _cut_and_draw(torch.from_numpy(whole), [params[i] for i in redo],
                                 u[torch.from_numpy(redo)], vocab)
        full = {int(r): (whole[j], int(again[j])) for j, r in enumerate(redo)}
    out = np.empty(rows, dtype=np.int64)
    for r in range(rows):
        row_vals, at = full.get(r, (vals[r], int(pos[r])))
        v = row_vals[at]
        # The drawn value's token: of the tokens holding exactly v, the one as far into
        # them as `at` is past the first v of the sorted values.
        nth = at - int(np.searchsorted(-row_vals, -v, side="left"))
        out[r] = np.flatnonzero(a[r] == v)[nth]
    return torch.from_numpy(out)


def _draw_unseeded(x: torch.Tensor, params: list[SamplingParams],
                   generator: torch.Generator) -> torch.Tensor:
    """x: [rows, vocab] scaled logits (finite or -inf, each row's max 0) -> [rows] token
    ids, one uniform per row."""
    probs = torch.softmax(x, dim=-1)
    rows, vocab = probs.shape
    u = torch.rand(rows, generator=generator, device=probs.device)
    out = torch.empty(rows, dtype=torch.long, device=probs.device)
    filtered = [0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    plain = [i for i, f in enumerate(filtered) if not f]
    if plain:
        at = to_device(plain, probs.device)
        out[at] = _draw_plain(_take(probs, plain, at), u[at])
    cut = [i for i, f in enumerate(filtered) if f]
    if cut:
        at = to_device(cut, probs.device)
        sub, sub_params = _take(probs, cut, at), [params[i] for i in cut]
        draw = _draw_filtered_cpu if probs.device.type == "cpu" else _draw_filtered_sorted
        out[at] = draw(sub, sub_params, u[at])
    return out


def _draw_filtered_sorted(probs: torch.Tensor, params: list[SamplingParams],
                          u: torch.Tensor) -> torch.Tensor:
    """probs: [rows, vocab] (on CUDA) -> [rows] token ids, over one sort of the rows (no
    partial candidates, so no data-dependent fallback and no host sync)."""
    vals, order = torch.sort(probs, dim=-1, descending=True)
    pos, _ = _cut_and_draw(vals, params, u, probs.shape[1])
    return order.gather(1, pos[:, None])[:, 0]


def _draw_plain(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """No filter: inverse CDF over each row in vocabulary order. probs: [rows, vocab],
    u: [rows] -> [rows] token ids (a token of probability 0 is never drawn: the mass does
    not grow there)."""
    mass = probs.cumsum(dim=-1)
    total = mass[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, total * 0))
    return torch.searchsorted(mass, target, right=True)[:, 0].clamp(max=probs.shape[1] - 1)


# ---- the step ----------------------------------------------------------------------------


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    hists: list[RequestHistory],
    generator: torch.Generator | None = None,
) -> list[SampleResult]:
    """Pick one token per row. logits: [num_rows, vocab_size] (any float dtype).
    generator: the unseeded rows' (on logits' device); None = a fresh randomly seeded one."""
    logits = logits.float()
    num_rows, vocab = logits.shape
    dev = logits.device
    plain_greedy = [
        p.is_greedy and not p.changes_logits and not suppresses_stop(p, h)
        for p, h in zip(params, hists, strict=True)
    ]
    chosen = torch.zeros(num_rows, dtype=torch.long, device=dev)
    if all(plain_greedy):
        return _results(logits, params, _argmax(logits).to(dev))
    if any(plain_greedy):
        at = to_device([i for i, g in enumerate(plain_greedy) if g], dev)
        chosen[at] = _argmax(logits[at]).to(dev)
    # greedy rows whose only change is a grammar: their best allowed token, mostly found
    # among their top candidates without masking the whole row (engine/structured.py)
    picked = greedy_constrained_(logits, params, hists, chosen)
    others = [i for i, g in enumerate(plain_greedy) if not g and i not in picked]
    if others:
        _sample_others(logits, others, params, hists, chosen, generator)
    return _results(logits, params, chosen)


def _sample_others(logits: torch.Tensor, others: list[int], params: list[SamplingParams],
                   hists: list[RequestHistory], chosen: torch.Tensor,
                   generator: torch.Generator | None) -> None:
    """Rows `others` of logits [rows, vocab] (all but the plain greedy ones): adjusted,
    constrained, then greedy or drawn; their tokens written into chosen [rows]."""
    num_rows, dev = logits.shape[0], logits.device
    o_params = [params[i] for i in others]
    o_hists = [hists[i] for i in others]
    o_at = to_device(others, dev)
    # work: [others, vocab], the sampler's own copy, adjusted, then made finite (once:
    # a second pass would turn the -inf a NaN became into the lowest float)
    adjust = any(p.changes_logits or suppresses_stop(p, h)
                 for p, h in zip(o_params, o_hists, strict=True))
    if len(others) < num_rows or adjust:
        work = logits[o_at] if len(others) < num_rows else logits.clone()
        adjust_logits(work, o_params, o_hists)
        make_finite_(work)
        constrain_(work, o_params, o_hists)
    else:  # nothing to adjust: the copy and the finite pass in one
        work = torch.nan_to_num(logits, nan=NEG_INF, posinf=torch.finfo(logits.dtype).max)
    greedy = [j for j, p in enumerate(o_params) if p.is_greedy]
    if greedy:
        g_at = to_device(greedy, dev)
        chosen[o_at[g_at]] = _argmax(work[g_at]).to(dev)
    sampled = [j for j, p in enumerate(o_params) if not p.is_greedy]
    if sampled:
        # Subtract the max first: a tiny temperature then sends the rest to -inf instead
        # of the top to +inf (softmax is shift-invariant).
        x = _take(work, sampled, to_device(sampled, dev))
        x.sub_(x.amax(dim=-1, keepdim=True))
        x.div_(_column([o_params[j].temperature for j in sampled], x))
        seeded = [n for n, j in enumerate(sampled) if o_params[j].seed is not None]
        unseeded = [n for n, j in enumerate(sampled) if o_params[j].seed is None]
        if seeded:
            rows = [others[sampled[n]] for n in seeded]
            chosen[to_device(rows, dev)] = _draw_seeded(
                _take(x, seeded, to_device(seeded, dev)), [params[r] for r in rows],
                [hists[r] for r in rows])
        if unseeded:
            rows = [others[sampled[n]] for n in unseeded]
            if generator is None:
                generator = torch.Generator(device=dev)
                generator.manual_seed(random.SystemRandom().getrandbits(62))
            chosen[to_device(rows, dev)] = _draw_unseeded(
                _take(x, unseeded, to_device(unseeded, dev)), [params[r] for r in rows],
                generator)


def _results(logits: torch.Tensor, params: list[SamplingParams],
             chosen: torch.Tensor) -> list[SampleResult]:
    """Chosen tokens with their logprobs, all off the device in one copy."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    parts = [chosen.double()]
    top_n = max((params[i].logprobs or 0 for i in want), default=0)
    if want:
        at = to_device(want, logits.device)
        logprobs = torch.log_softmax(logits[at], dim=-1)  # [want, vocab], the model's own
        parts.append(logprobs.gather(1, chosen[at][:, None])[:, 0].double())
        if top_n > 0:
            vals, ids = torch.topk(logprobs, top_n, dim=-1)
            parts += [vals.double().reshape(-1), ids.double().reshape(-1)]
    host = to_host(torch.cat(parts)).tolist()
    n, w = len(params), len(want)
    tokens = [int(t) for t in host[:n]]
    results = [SampleResult(t, None, []) for t in tokens]
    top_vals = host[n + w : n + w + w * top_n]
    top_ids = host[n + w + w * top_n :]
    for j, i in enumerate(want):
        k = params[i].logprobs or 0
        base = j * top_n
        top = [(int(top_ids[base + c]), float(top_vals[base + c])) for c in range(k)]
        results[i] = SampleResult(tokens[i], float(host[n + j]), top)
    return results
