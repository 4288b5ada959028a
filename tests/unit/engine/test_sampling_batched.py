"""The batched sampler against the per-row one it replaced (sampling_reference.py).

Seeded rows must choose the same tokens, with the same logprobs, step after step (histories
fed back); unseeded rows draw from the engine's generator, so they are checked for what they
may draw (the reference's support) and how often (its probabilities)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from sampling_reference import filter_support, reference_sample_rows

from helixserve.engine import sampling
from helixserve.engine.history import RequestHistory
from helixserve.engine.sampling import sample_rows
from helixserve.request import SamplingParams


def _mixes(rng: random.Random, vocab: int, n: int) -> list[SamplingParams]:
    """n parameter sets mixing every knob, greedy and sampled, most of them seeded."""
    out = []
    for i in range(n):
        greedy = rng.random() < 0.2
        out.append(SamplingParams(
            temperature=0.0 if greedy else rng.choice([0.3, 0.8, 1.0, 1.7, 1e-45]),
            top_k=rng.choice([-1, -1, 1, 5, 40, vocab, vocab + 3]),
            top_p=rng.choice([1.0, 1.0, 0.95, 0.5, 0.1, 5e-324]),
            min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
            seed=None if greedy and rng.random() < 0.5 else 1000 + i,
            repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.7, 0.0]),
            presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
            frequency_penalty=rng.choice([0.0, 0.0, 0.3, -0.5]),
            logprobs=rng.choice([None, None, 0, 3]),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=rng.choice([(), (2,), (2, 7)]),
            logit_bias=rng.choice([(), ((5, 100.0),), ((3, -100.0), (9, 2.5))]),
        ))
    return out


def _logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    # Heavy-tailed like a model's: a few large logits over a broad base.
    base = torch.randn(rows, vocab, generator=gen) * 2
    return base + 6 * (torch.rand(rows, vocab, generator=gen) < 0.01)


@pytest.mark.parametrize(
    ("vocab", "rows", "seed", "plain"),
    [(64, 40, 0, False), (1000, 48, 1, False), (4099, 24, 2, False), (300, 12, 3, True)],
)
def test_seeded_rows_match_the_per_row_sampler(vocab, rows, seed, plain):
    """plain: sampled rows only, none with a penalty, bias or min_tokens (another path)."""
    rng = random.Random(seed)
    params = [p for p in _mixes(rng, vocab, rows * 4) if p.seed is not None or p.is_greedy]
    if plain:
        params = [SamplingParams(temperature=p.temperature or 1.0, top_k=p.top_k, top_p=p.top_p,
                                 min_p=p.min_p, seed=i, logprobs=p.logprobs)
                  for i, p in enumerate(params)]
    params = params[:rows]
    gen = torch.Generator().manual_seed(seed)
    old_h = [RequestHistory(prompt_ids={1, 2, 3, i % vocab}) for i in range(len(params))]
    new_h = [RequestHistory(prompt_ids={1, 2, 3, i % vocab}) for i in range(len(params))]
    for _step in range(6):
        logits = _logits(gen, len(params), vocab)
        if _step == 3:  # non-finite logits as a broken model (or penalty) would give
            logits[::3, :5] = float("inf")
            logits[1::3, 4:9] = float("nan")
            logits[2::3, 2:6] = float("-inf")
        old = reference_sample_rows(logits.clone(), params, old_h)
        new = sample_rows(logits.clone(), params, new_h)
        assert [r.token_id for r in new] == [r.token_id for r in old]
        # repr: exact floats, and nan equal to nan (the step with non-finite logits)
        assert repr([r.logprob for r in new]) == repr([r.logprob for r in old])
        assert repr([r.top_logprobs for r in new]) == repr([r.top_logprobs for r in old])
        for h_old, h_new, r in zip(old_h, new_h, old, strict=True):
            h_old.add_tokens([r.token_id], generated=True)
            h_new.add_tokens([r.token_id], generated=True)


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    row = filter_support((logits - logits.max()) / params.temperature, params)
    return torch.softmax(row, dim=-1)


@pytest.mark.parametrize("candidates", [4096, 3])  # 3: most rows take the whole-row fallback
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=4),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=0.7, top_k=6, top_p=0.6, min_p=0.1),
        SamplingParams(temperature=1.0),
    ],
)
def test_unseeded_rows_draw_the_reference_distribution(monkeypatch, params, candidates):
    monkeypatch.setattr(sampling, "CPU_CANDIDATES", candidates)
    # distinct values: where tied tokens straddle a cut, which of them stay is arbitrary
    logits = torch.tensor([3.0, 2.5, 2.4, 1.0, 0.9, 0.5, 0.0, -1.0, -3.0, -8.0])
    logits = torch.cat([logits, logits - 0.05, logits - 0.11])
    draws = 3000
    gen = torch.Generator().manual_seed(7)
    rows = logits[None].repeat(draws, 1)
    got = Counter(r.token_id for r in sample_rows(
        rows, [params] * draws, [RequestHistory() for _ in range(draws)], generator=gen))
    want = _reference_probs(logits, params)
    assert set(got) <= set(torch.nonzero(want).flatten().tolist())
    for token, p in enumerate(want.tolist()):
        # binomial: 5 standard deviations
        assert abs(got[token] / draws - p) <= 5 * (p * (1 - p) / draws) ** 0.5 + 1e-9, token


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(top_k=4, min_p=0.1),
     SamplingParams(temperature=0.7, top_k=6, top_p=0.6, min_p=0.1)],
)
def test_the_sorted_draw_cuda_takes_draws_the_reference_distribution(params):
    """The CUDA path (one sort of the rows), run here on CPU tensors."""
    logits = torch.tensor([3.0, 2.5, 2.4, 1.0, 0.9, 0.5, 0.0, -1.0, -3.0, -8.0, 1.7, 0.2])
    draws = 3000
    x = ((logits - logits.max()) / params.temperature)[None].repeat(draws, 1)
    u = torch.rand(draws, generator=torch.Generator().manual_seed(2))
    got = Counter(sampling._draw_filtered_sorted(torch.softmax(x, -1), [params] * draws,
                                                 u).tolist())
    want = _reference_probs(logits, params)
    assert set(got) <= set(torch.nonzero(want).flatten().tolist())
    for token, p in enumerate(want.tolist()):
        assert abs(got[token] / draws - p) <= 5 * (p * (1 - p) / draws) ** 0.5 + 1e-9, token


def test_unseeded_rows_of_a_large_vocabulary_stay_in_the_nucleus():
    vocab, n = 49152, 16
    gen = torch.Generator().manual_seed(3)
    logits = _logits(gen, n, vocab) * 1.5
    params = [SamplingParams(temperature=0.8, top_p=0.95)] * n
    out = sample_rows(logits, params, [RequestHistory() for _ in range(n)], generator=gen)
    for i, r in enumerate(out):
        assert _reference_probs(logits[i], params[i])[r.token_id] > 0


def test_same_generator_state_same_unseeded_tokens():
    logits = _logits(torch.Generator().manual_seed(5), 8, 500)
    params = [SamplingParams(temperature=0.9, top_p=0.9)] * 8
    a, b = (sample_rows(logits, params, [RequestHistory() for _ in range(8)],
                        generator=torch.Generator().manual_seed(11)) for _ in range(2))
    assert [r.token_id for r in a] == [r.token_id for r in b]


@pytest.mark.parametrize("seed", [None, 4])
def test_ids_beyond_the_vocabulary_are_skipped(seed):
    vocab = 10
    logits = torch.linspace(0, 1, vocab)[None]
    params = SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, min_tokens=2,
                            stop_token_ids=(vocab - 1, vocab, vocab + 40),
                            logit_bias=((vocab + 1, 100.0), (0, 100.0)))
    hist = RequestHistory(prompt_ids={vocab + 5})
    (r,) = sample_rows(logits, [params], [hist])
    assert r.token_id == 0  # the in-range bias applies; the rest is skipped, not an error


def test_one_copy_to_the_host_per_step(monkeypatch):
    calls = []
    real = sampling.to_host
    monkeypatch.setattr(sampling, "to_host", lambda t: calls.append(t) or real(t))
    params = _mixes(random.Random(9), 100, 30)
    sample_rows(_logits(torch.Generator().manual_seed(9), 30, 100), params,
                [RequestHistory() for _ in params])
    assert len(calls) == 1
