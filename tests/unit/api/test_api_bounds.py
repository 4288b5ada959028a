"""Bounded work per request, over real HTTP (uvicorn on 127.0.0.1) with the real openai client:
caps on prompts, choices, logit_bias entries and /detokenize length are 400s naming the
field; stop_token_ids past the vocabulary are a 400, not a failed step; and the event loop
answers /health while the largest allowed request is tokenized (on its own thread)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest
from api_testlib import API_KEY, MODEL, FakeCoordinator, ServerThread
from test_api_errors import check_error

from helixserve.api.app import create_app
from helixserve.api.protocol import (
    MAX_CHOICES,
    MAX_DETOKENIZE_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_PROMPTS,
)
from helixserve.runtime import GenerationRequest, TokenEvent

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _bad_request(call: Any, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    return str(body["message"])


def test_prompts_and_choices_are_capped(client, fake):
    before = len(fake.requests)
    message = _bad_request(lambda: client.completions.create(
        model=MODEL, prompt=["hi"] * (MAX_PROMPTS + 1),
        max_tokens=1), "prompt")
    assert f"at most {MAX_PROMPTS} prompts" in message and str(MAX_PROMPTS + 1) in message
    many = MAX_CHOICES // 4 + 1
    message = _bad_request(lambda: client.completions.create(
        model=MODEL, prompt=[[1, 2]] * many, n=4, max_tokens=1), "n")
    assert f"{many * 4} choices" in message
    assert len(fake.requests) == before  # refused before any request reached the coordinator
    ok = client.completions.create(model=MODEL, prompt=["hi"] * MAX_PROMPTS,
                                   max_tokens=1)
    assert len(ok.choices) == MAX_CHOICES


def test_logit_bias_is_capped_at_300(client, fake):
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    message = _bad_request(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        logit_bias=bias), "logit_bias")
    assert f"at most {MAX_LOGIT_BIAS} entries, got {MAX_LOGIT_BIAS + 1}" in message
    del bias[str(MAX_LOGIT_BIAS)]
    ok = client.chat.completions.create(model=MODEL, max_tokens=1, logit_bias=bias,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].finish_reason == "length"
    assert len(fake.requests[-1].sampling.logit_bias) == MAX_LOGIT_BIAS


def test_stop_token_ids_are_checked_against_the_vocabulary(client, fake, tokenizer):
    vocab = len(tokenizer)
    for bad in (100_000_000, vocab):
        message = _bad_request(lambda b=bad: client.completions.create(
            model=MODEL, prompt="hi", max_tokens=4,
            extra_body={"stop_token_ids": [1, b], "min_tokens": 2}), "stop_token_ids")
        assert f"token id {bad} out of range [0, {vocab})" in message
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                   extra_body={"stop_token_ids": [vocab - 1], "min_tokens": 2})
    assert ok.choices[0].finish_reason == "length"


def test_detokenize_length_is_capped(server):
    too_long = httpx.post(server.url + "/detokenize", headers=AUTH, timeout=60,
                          json={"tokens": [1] * (MAX_DETOKENIZE_TOKENS + 1)})
    err = check_error(too_long, 400, "tokens")
    assert str(MAX_DETOKENIZE_TOKENS) in err["message"]
    ok = httpx.post(server.url + "/detokenize", headers=AUTH, timeout=60,
                    json={"tokens": [28] * MAX_DETOKENIZE_TOKENS})
    assert ok.status_code == 200 and len(ok.json()["prompt"]) >= MAX_DETOKENIZE_TOKENS // 8


class _PlainFake(FakeCoordinator):
    """One token per request, without the test fake's own decode of every prompt (that is
    the fake's cost on the loop, not the API's)."""

    async def generate(self, req: GenerationRequest) -> Any:
        self.requests.append(req)
        yield TokenEvent(28, "x", None, [], "length")


def test_health_answers_while_the_largest_request_is_tokenized(tokenizer):
    """MAX_PROMPTS prompts of nearly a full context each: tokenizing them takes the
    tokenizing thread a while; /health, polled all along, must keep answering quickly
    relative to it (a ratio within this run, not a wall-clock bound)."""
    fake = _PlainFake(tokenizer, max_model_len=8192)
    words = "The lighthouse keeper counted the ships. " * 900  # ~ 7,200 tokens
    assert len(tokenizer.encode(words)) < 8192 - 1
    latencies: list[float] = []
    done = threading.Event()
    with ServerThread(create_app(fake, None, api_key=API_KEY)) as s:
        def poll() -> None:
            with httpx.Client() as h:
                while not done.is_set():
                    t0 = time.perf_counter()
                    assert h.get(s.url + "/health", timeout=30).status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        t0 = time.perf_counter()
        resp = httpx.post(s.url + "/v1/completions", headers=AUTH, timeout=600, json={
            "model": MODEL, "prompt": [words] * MAX_PROMPTS, "max_tokens": 1})
        elapsed = time.perf_counter() - t0
        done.set()
        poller.join()
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == MAX_PROMPTS
    worst = max(latencies)
    print(f"\n{MAX_PROMPTS} prompts x {len(tokenizer.encode(words))} tokens: request "
          f"{elapsed:.2f} s; /health answered {len(latencies)} times meanwhile, worst "
          f"{worst * 1000:.0f} ms, median {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms")
    assert len(latencies) >= 5
    assert worst < elapsed / 4
