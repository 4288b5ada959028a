"""Streaming text from sampled tokens: deltas add up to the full decode; stop rules apply."""

from pathlib import Path

import pytest

from helixserve.runtime.output import OutputProcessor


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from helixserve.engine import prepare_demo_model

    return AutoTokenizer.from_pretrained(str(Path(prepare_demo_model())))


def run(proc: OutputProcessor, ids: list[int]) -> tuple[str, str | None, int]:
    text, reason, n = "", None, 0
    for t in ids:
        step = proc.add(t)
        text += step.text
        n += 1
        if step.finish_reason:
            reason = step.finish_reason
            break
    return text, reason, n


SENTENCE = "The capital of France is Paris. Héllo wörld ✓ 日本語 — done!"


def test_deltas_add_up_to_the_full_decode(tok):
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    proc = OutputProcessor(tok, prompt_token_ids=tok.encode("Q:", add_special_tokens=False),
                           max_tokens=len(ids))
    text, reason, n = run(proc, ids)
    assert text == tok.decode(ids) == SENTENCE
    assert (reason, n) == ("length", len(ids))


def test_stop_string_is_removed_and_ends_the_request(tok):
    ids = tok.encode(SENTENCE, add_special_tokens=False)
    proc = OutputProcessor(tok, [1], max_tokens=100, stop=["Paris", "zzz"])
    text, reason, n = run(proc, ids)
    assert text == "The capital of France is "
    assert reason == "stop" and n < len(ids)


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    ids = tok.encode("one two three", add_special_tokens=False)
    proc = OutputProcessor(tok, [1], max_tokens=len(ids), stop=[" three four"])
    deltas = [proc.add(t).text for t in ids]
    # " three" could begin the stop string: held back until the end, then flushed
    assert "three" not in "".join(deltas[:-1])
    assert "".join(deltas) == "one two three"


def test_eos_stops_unless_ignored_or_before_min_tokens(tok):
    eos = tok.eos_token_id
    ids = tok.encode("hi there", add_special_tokens=False)
    proc = OutputProcessor(tok, [1], max_tokens=50, eos_token_ids=[eos])
    assert run(proc, [*ids, eos, *ids]) == ("hi there", "stop", len(ids) + 1)
    proc = OutputProcessor(tok, [1], max_tokens=50, eos_token_ids=[eos], ignore_eos=True)
    assert run(proc, [*ids, eos, *ids])[1:] == (None, 2 * len(ids) + 1)
    proc = OutputProcessor(tok, [1], max_tokens=50, eos_token_ids=[eos], min_tokens=len(ids) + 1)
    assert run(proc, [*ids, eos, *ids, eos])[1:] == ("stop", 2 * len(ids) + 2)


def test_stop_token_ids_and_model_length(tok):
    ids = tok.encode("a b c d e f", add_special_tokens=False)
    proc = OutputProcessor(tok, [1], max_tokens=50, stop_token_ids=[ids[2]])
    assert run(proc, ids)[1:] == ("stop", 3)
    proc = OutputProcessor(tok, [1, 2, 3], max_tokens=50, max_model_len=5)
    assert run(proc, ids)[1:] == ("length", 2)


def test_only_a_tokenizer_without_space_clean_up_is_decoded_by_its_backend(tok):
    """The fast path (the Rust backend, no wrapper) decodes exactly as `tokenizer.decode`
    when no clean-up applies; a tokenizer that cleans up spaces keeps its own decode."""
    calls: list[int] = []

    class Cleaning:
        backend_tokenizer = tok.backend_tokenizer
        clean_up_tokenization_spaces = True

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(len(ids))
            return str(tok.decode(ids, skip_special_tokens=skip_special_tokens))

    ids = tok.encode(SENTENCE, add_special_tokens=False)
    assert tok.clean_up_tokenization_spaces is False
    for t, expect_calls in ((tok, False), (Cleaning(), True)):
        calls.clear()
        proc = OutputProcessor(t, prompt_token_ids=[], max_tokens=len(ids))
        assert run(proc, ids)[0] == SENTENCE
        assert bool(calls) == expect_calls
