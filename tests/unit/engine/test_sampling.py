"""Sampler: validation, seeded reproducibility, support filters, penalties, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from engine_testlib import GREEDY

from helixserve.engine import ShardEngine, WorkItem
from helixserve.engine.sampling import (
    RequestHistory,
    adjust_logits,
    exact_support_,
    sample_rows,
)
from helixserve.errors import UserError
from helixserve.request import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
        ("seed", -1), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0), ("logprobs", 21), ("prompt_logprobs", -1),
        ("prompt_logprobs", 21),
    ],
)  # fmt: skip
def test_validate_names_field_and_value(field, value):
    with pytest.raises(UserError, match=rf"{field}: bad value {value!r}"):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize(("bias", "shown"), [(((3, 100.5),), "100.5"), (((-1, 1.0),), "-1")])
def test_validate_logit_bias(bias, shown):
    with pytest.raises(UserError, match=rf"logit_bias: bad value {shown}"):
        SamplingParams(logit_bias=bias).validate()


def test_defaults_are_valid():
    assert SamplingParams().validate() == SamplingParams()


# Probabilities 0.5, 0.3, 0.15, 0.05 and the rest (~0) of an 8-token vocabulary.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05, 1e-9, 1e-9, 1e-9, 1e-9])
LOGITS = PROBS.log()


def _support(params: SamplingParams, draws: int = 400) -> Counter[int]:
    hist = RequestHistory()
    rows = LOGITS[None].repeat(draws, 1)
    return Counter(r.token_id for r in sample_rows(rows, [params] * draws, [hist] * draws))


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(seed=1), {0, 1, 2, 3}),
        (SamplingParams(seed=1, top_k=2), {0, 1}),
        (SamplingParams(seed=1, top_k=3), {0, 1, 2}),
        (SamplingParams(seed=1, top_p=0.7), {0, 1}),
        (SamplingParams(seed=1, top_p=0.85), {0, 1, 2}),
        (SamplingParams(seed=1, min_p=0.5), {0, 1}),  # keeps p >= 0.25
        (SamplingParams(seed=1, min_p=0.2), {0, 1, 2}),  # keeps p >= 0.1
        (SamplingParams(temperature=0.0), {0}),
    ],
)
def test_filters_restrict_support(params, support):
    seen = _support(params)
    assert set(seen) == support
    if len(support) > 1:  # the draw follows the distribution: the top token most often
        assert seen.most_common(1)[0][0] == 0


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 0.0])
def test_tiny_top_p_keeps_the_top_token(top_p):
    """top_p 5e-324 (the API's smallest float > 0) is 0 once it crossed the wire as float32;
    the top token must stay, not leave softmax all NaN (the API answered 500)."""
    params = SamplingParams(seed=3, temperature=1.0, top_p=top_p)
    assert set(_support(params, draws=50)) == {0}
    row = exact_support_(LOGITS.clone()[None], [params])[0]
    assert torch.isfinite(row[0]) and torch.isinf(row[1:]).all()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(seed=3, repetition_penalty=0.0),  # 5e-324 after the float32 wire
        SamplingParams(seed=3, repetition_penalty=1e-45),
        SamplingParams(seed=3, temperature=1e-45),
        SamplingParams(seed=3, repetition_penalty=0.0, top_p=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=0.0),
    ],
)
def test_underflowed_parameters_still_sample(params):
    """Values the API takes as > 0 that arrive as 0 or denormal make the logits +inf or NaN;
    the sampler must still draw a token (the top one here), not raise (the API said 500)."""
    hist = RequestHistory(prompt_ids={0, 1})
    rows = (LOGITS + 10)[None].repeat(20, 1)  # positive logits: the penalty divides them
    results = sample_rows(rows, [params] * 20, [hist] * 20)
    assert {r.token_id for r in results} <= {0, 1}


def test_temperature_sharpens():
    cold = _support(SamplingParams(seed=3, temperature=0.3))
    hot = _support(SamplingParams(seed=3, temperature=2.0))
    assert cold[0] > hot[0]


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    hist = RequestHistory()
    hist.add_tokens([0, 1], generated=False)  # prompt
    hist.add_tokens([3, 3, 2], generated=True)  # output
    rep = logits.clone()[None]
    adjust_logits(rep, [SamplingParams(repetition_penalty=2.0)], [hist])
    # Every seen id (prompt or output): positive / 2, negative * 2; id 4 untouched.
    assert rep[0].tolist() == [1.0, -2.0, 0.25, 1.5, -2.0]
    pf = logits.clone()[None]
    adjust_logits(pf, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [hist])
    # Only generated ids: minus presence once plus frequency per occurrence; prompt ids untouched.
    assert pf[0].tolist() == [2.0, -1.0, 0.5 - 0.75, 3.0 - 1.0, -2.0]


def test_penalty_turns_greedy_choice():
    hist = RequestHistory()
    hist.add_tokens([0], generated=True)
    base = torch.tensor([[1.0, 0.9, 0.0]])
    (r,) = sample_rows(base, [SamplingParams(temperature=0.0)], [hist])
    (p,) = sample_rows(base, [SamplingParams(temperature=0.0, presence_penalty=0.5)], [hist])
    assert (r.token_id, p.token_id) == (0, 1)


def test_logit_bias_bans_and_forces_tokens_and_keeps_logprobs_unbiased():
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    ban = SamplingParams(temperature=0.0, logprobs=1, logit_bias=((0, -100.0),))
    force = SamplingParams(temperature=0.0, logprobs=1, logit_bias=((5, 100.0),))
    rows = LOGITS[None].repeat(3, 1)  # one batch: the plain row takes the batched argmax
    plain, banned, forced = sample_rows(rows, [greedy, ban, force], [RequestHistory()] * 3)
    assert (plain.token_id, banned.token_id, forced.token_id) == (0, 1, 5)
    # logprobs are the model's own: the banned row's choice keeps its unbiased 0.3
    assert banned.logprob == pytest.approx(math.log(0.3), abs=1e-5)
    assert forced.top_logprobs[0][0] == 0
    sampled = _support(SamplingParams(temperature=1.0, logit_bias=((0, -100.0), (1, -100.0))))
    assert 0 not in sampled and 1 not in sampled and sampled[2] > sampled[3]


def test_logprobs_of_chosen_and_top_n():
    (res,) = sample_rows(
        LOGITS[None], [SamplingParams(temperature=0.0, logprobs=3)], [RequestHistory()]
    )
    assert res.token_id == 0
    assert res.logprob == pytest.approx(math.log(0.5), abs=1e-5)
    assert [t for t, _ in res.top_logprobs] == [0, 1, 2]
    assert [lp for _, lp in res.top_logprobs] == pytest.approx(
        [math.log(p) for p in (0.5, 0.3, 0.15)], abs=1e-5
    )
    (none,) = sample_rows(LOGITS[None], [SamplingParams(temperature=0.0)], [RequestHistory()])
    assert none.logprob is None and none.top_logprobs == []


@pytest.fixture(scope="module")
def tiny(random_models):
    return ShardEngine.load(random_models["qwen2"], 0, 4, kv_cache_bytes=4 << 20)


def _sample_run(engine, rid, prompt, params, steps, others=()):
    """Sample `steps` tokens for rid; `others` are extra requests batched alongside."""
    n = engine.num_model_layers
    batch_others = [
        WorkItem(o, 0, n, 0, [7 + i] * (5 + 3 * i), None, GREEDY) for i, o in enumerate(others)
    ]
    outs = engine.step([WorkItem(rid, 0, n, 0, prompt, None, params), *batch_others])
    tokens = [outs[0].token_id]
    pos = {o: 5 + 3 * i for i, o in enumerate(others)}
    other_tok = {o: outs[1 + i].token_id for i, o in enumerate(others)}
    for s in range(steps - 1):
        items = [WorkItem(rid, 0, n, len(prompt) + s, [tokens[-1]], None, params)]
        items += [WorkItem(o, 0, n, pos[o] + s, [other_tok[o]], None, GREEDY) for o in others]
        outs = engine.step(items)
        tokens.append(outs[0].token_id)
        other_tok = {o: outs[1 + i].token_id for i, o in enumerate(others)}
    for r in (rid, *others):
        engine.free(r)
    return tokens


def test_seeded_sampling_reproducible_regardless_of_batch(tiny):
    params = SamplingParams(temperature=1.0, seed=1234)
    prompt = [5, 9, 200, 31, 77]
    alone = _sample_run(tiny, "seeded", prompt, params, 12)
    batched = _sample_run(tiny, "seeded", prompt, params, 12, others=("x", "y", "z"))
    assert alone == batched
    other_seed = _sample_run(tiny, "seeded", prompt, SamplingParams(temperature=1.0, seed=99), 12)
    assert other_seed != alone


def test_history_tracks_prompt_and_generated(tiny):
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    (o,) = tiny.step([WorkItem("h", 0, 4, 0, [10, 11, 12], None, p)])
    tiny.step([WorkItem("h", 0, 4, 3, [o.token_id], None, p)])
    hist = tiny._history["h"]
    assert hist.prompt_ids == {10, 11, 12} and hist.output_counts == Counter({o.token_id: 1})
    tiny.free("h")
    assert "h" not in tiny._history
    # A re-prefill of prompt + output after a failover says where the prompt ends.
    tiny.step([WorkItem("h2", 0, 4, 0, [10, 11, 12, 40, 40], None, p, num_prompt_tokens=3)])
    assert tiny._history["h2"].output_counts == Counter({40: 2})
    tiny.free("h2")


def test_min_tokens_masks_stop_ids_until_reached():
    # token 2 (the "EOS") is the most likely; below min_tokens it must not be chosen
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    hist = RequestHistory()
    assert sample_rows(logits, [params], [hist])[0].token_id == 1
    hist.add_tokens([1], generated=True)
    assert sample_rows(logits, [params], [hist])[0].token_id == 1
    hist.add_tokens([1], generated=True)  # two generated: EOS allowed again
    assert sample_rows(logits, [params], [hist])[0].token_id == 2
    # sampled rows are masked too, whatever the generator draws
    hot = SamplingParams(temperature=1.0, seed=0, min_tokens=5, stop_token_ids=(2,))
    draws = {sample_rows(logits, [hot], [RequestHistory()])[0].token_id for _ in range(50)}
    assert 2 not in draws
