"""Grammar-constrained sampling (engine/structured.py) in the batched sampler, on the demo
model's tokenizer: the mask a grammar gives, applied in `sample_rows` before greedy and the
draw; EOS only where the grammar accepts and forced when it is done; the matcher rebuilt from
the generated tokens (a replayed request); and the whole model producing schema-valid JSON."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from helixserve.engine import structured
from helixserve.engine.history import RequestHistory
from helixserve.engine.protocol import WorkItem
from helixserve.engine.sampling import sample_rows
from helixserve.engine.shard import ShardEngine
from helixserve.request import SamplingParams, StructuredOutput

VOCAB = 49152  # SmolLM2
EOS = 2
YES_NO = StructuredOutput("choice", '["yes", "no"]')


@pytest.fixture(scope="module", autouse=True)
def _registered(demo_dir: Path) -> None:
    structured.register_model(demo_dir, VOCAB, [EOS])


def _ids(tokenizer, pieces: list[str]) -> list[int]:
    ids = tokenizer.convert_tokens_to_ids(pieces)
    assert all(isinstance(i, int) and i != tokenizer.unk_token_id for i in ids), ids
    return ids


def test_greedy_picks_the_best_allowed_token(demo_tokenizer):
    """Row 0 free, rows 1-3 constrained to "yes" | "no": greedy takes the argmax over the
    tokens that start one of them (y, ye, yes, n, no), whatever the best token overall."""
    allowed = _ids(demo_tokenizer, ["y", "ye", "yes", "n", "no"])
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen)
    logits[:, 100] = 50.0  # the best token overall, never allowed
    logits[3, allowed] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # "no" best on row 3
    free = SamplingParams(temperature=0.0)
    so = SamplingParams(temperature=0.0, structured=YES_NO)
    hists = [RequestHistory() for _ in range(4)]
    got = [r.token_id for r in sample_rows(logits, [free, so, so, so], hists)]
    assert got[0] == 100
    for row in (1, 2):
        best = max(allowed, key=lambda t: float(logits[row, t]))
        assert got[row] == best
    assert got[3] == allowed[4]


def test_sampled_rows_draw_only_allowed_tokens(demo_tokenizer):
    allowed = set(_ids(demo_tokenizer, ["y", "ye", "yes", "n", "no"]))
    logits = torch.zeros(6, VOCAB)  # uniform: nearly all mass outside the grammar
    params = [SamplingParams(temperature=1.0, seed=s if s % 2 else None, structured=YES_NO)
              for s in range(6)]
    for _ in range(5):
        got = sample_rows(logits, params, [RequestHistory() for _ in params])
        assert {r.token_id for r in got} <= allowed


def test_eos_only_where_the_grammar_accepts_and_forced_when_done(demo_tokenizer):
    [yes] = _ids(demo_tokenizer, ["yes"])
    [ye] = _ids(demo_tokenizer, ["ye"])
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0  # the model wants to stop at once
    params = [SamplingParams(temperature=0.0, structured=YES_NO)]
    hist = RequestHistory()
    assert sample_rows(logits, params, [hist])[0].token_id != EOS  # "" is not "yes" or "no"
    hist.add_tokens([ye], generated=True)  # "ye": EOS still not allowed
    assert sample_rows(logits, params, [hist])[0].token_id != EOS
    logits[0, EOS] = -100.0  # the model would go on: the grammar is done, so EOS anyway
    done = RequestHistory()
    done.add_tokens([yes], generated=True)
    assert sample_rows(logits, params, [done])[0].token_id == EOS
    # min_tokens masks EOS, but nothing else is allowed: the grammar wins
    strict = [SamplingParams(temperature=0.0, structured=YES_NO, min_tokens=5,
                             stop_token_ids=(EOS,))]
    assert sample_rows(logits, strict, [done])[0].token_id == EOS


def test_matcher_rebuilt_from_generated_tokens_gives_the_same_mask(demo_tokenizer):
    """A replayed request's history holds its output at once (prompt + output re-prefilled);
    its fresh matcher reads all of it and allows what the step-by-step one allows."""
    so = StructuredOutput("json", json.dumps({"type": "object", "properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}))
    params = SamplingParams(temperature=0.0, structured=so)
    text_ids = demo_tokenizer.encode('{"n":12,"s":"a', add_special_tokens=False)
    stepwise = RequestHistory()
    for t in text_ids:
        structured.state_of(params, stepwise, VOCAB)
        stepwise.add_tokens([t], generated=True)
    replayed = RequestHistory()
    replayed.add_tokens(text_ids, generated=True)
    masks = [structured.disallowed_mask(structured._fill(
        [structured.state_of(params, h, VOCAB).matcher], VOCAB), VOCAB, torch.device("cpu"))
        for h in (stepwise, replayed)]
    assert torch.equal(masks[0], masks[1])
    assert 0 < int(masks[0].sum()) < VOCAB and masks[0][0, EOS]  # inside a string


def test_greedy_fast_way_agrees_with_the_masked_way():
    """Greedy constrained rows on the CPU are resolved among their top candidates when one is
    allowed (`greedy_constrained_`), else masked; a zero logit_bias forces the masked way. Both
    pick the same tokens through a JSON document, ties included."""
    so = StructuredOutput("json", json.dumps({"type": "object", "properties": {
        "k": {"type": "array", "items": {"type": "integer"}, "maxItems": 5},
        "s": {"type": "string", "maxLength": 10}}, "required": ["k", "s"]}))
    fast = SamplingParams(temperature=0.0, structured=so)
    masked = SamplingParams(temperature=0.0, structured=so, logit_bias=((7, 0.0),))
    hists = [RequestHistory(), RequestHistory()]
    gen = torch.Generator().manual_seed(3)
    resolved = 0
    for step in range(40):
        logits = torch.randn(1, VOCAB, generator=gen)
        banned = structured.disallowed_mask(structured._fill(
            [structured.state_of(masked, hists[1], VOCAB).matcher], VOCAB), VOCAB,
            torch.device("cpu"))[0]
        ok = torch.nonzero(~banned)[:, 0]
        if step % 3:  # an allowed token among the top ones (the fast way), sometimes a tie
            logits[0, ok[step % len(ok)]] = 6.0
            logits[0, ok[-1]] = 6.0 if step % 4 == 0 else 0.0
        both = torch.cat([logits, logits])
        resolved += len(structured.greedy_constrained_(
            both, [fast, masked], hists, torch.zeros(2, dtype=torch.long)))
        a, b = (r.token_id for r in sample_rows(both, [fast, masked], hists))
        assert a == b, step
        assert not banned[a]
        if a == EOS:
            break
        for h in hists:
            h.add_tokens([a], generated=True)
    assert resolved >= 10  # the fast way did run


def test_unpacking_on_any_device_matches_numpy():
    gen = torch.Generator().manual_seed(1)
    words = torch.randint(-(2**31), 2**31 - 1, (3, (VOCAB + 31) // 32), dtype=torch.int32,
                          generator=gen)
    banned = structured.disallowed_mask(words, VOCAB - 7, torch.device("cpu"))
    assert banned.shape == (3, VOCAB - 7)
    assert torch.equal(structured.unpack_words(words, VOCAB - 7), ~banned)
    for token in (0, 31, 32, 12345, VOCAB - 8):
        word, bit = divmod(token, 32)
        assert bool(banned[1, token]) != bool((int(words[1, word]) >> bit) & 1)


def _generate(engine: ShardEngine, rid: str, prompt: list[int], params: SamplingParams,
              max_tokens: int, resume: list[int] | None = None) -> list[int]:
    """Greedy tokens until EOS; `resume`: the output so far, re-prefilled with the prompt
    as a replay does (num_prompt_tokens)."""
    n = engine.num_model_layers
    out_ids = list(resume or [])
    first = WorkItem(rid, 0, n, 0, prompt + out_ids, None, params,
                     num_prompt_tokens=len(prompt))
    out_ids.append(engine.step([first])[0].token_id or 0)
    while out_ids[-1] != EOS and len(out_ids) < max_tokens:
        pos = len(prompt) + len(out_ids) - 1
        out_ids.append(engine.step([WorkItem(rid, 0, n, pos, [out_ids[-1]], None,
                                             params)])[0].token_id or 0)
    engine.free(rid)
    return out_ids


def test_demo_model_json_valid_and_the_same_after_a_replay(demo_engine, demo_tokenizer):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "rivers": {"type": "array", "items": {"type": "string", "maxLength": 12},
                   "minItems": 2, "maxItems": 3}},
        "required": ["city", "population", "rivers"], "additionalProperties": False}
    params = SamplingParams(temperature=0.0, structured=StructuredOutput("json",
                                                                         json.dumps(schema)))
    prompt = demo_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about Paris."}], add_generation_prompt=True)
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
    whole = _generate(demo_engine, "so-whole", prompt, params, 120)
    assert whole[-1] == EOS, demo_tokenizer.decode(whole)
    jsonschema.validate(json.loads(demo_tokenizer.decode(whole[:-1])), schema)
    cut = len(whole) // 2
    again = _generate(demo_engine, "so-replay", prompt, params, 120, resume=whole[:cut])
    assert again == whole
    free = _generate(demo_engine, "so-free", prompt, SamplingParams(temperature=0.0), 60)
    assert free[:5] != whole[:5]  # the model's own answer is prose: the grammar did this
