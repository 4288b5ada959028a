"""The OpenAI-compatible endpoints through the real `openai` client and raw HTTP."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from api_testlib import API_KEY, MODEL, SCRIPT, UNICODE_SCRIPT

AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_non_streaming_exact_usage(client, fake, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    script_ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert choice.message.content == tokenizer.decode(script_ids[:8])
    # prompt tokens: exactly the chat template's tokens
    prompt_ids = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    expected_prompt = len(tokenizer.encode(prompt_ids, add_special_tokens=False))
    assert resp.usage.prompt_tokens == expected_prompt
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == expected_prompt + 8
    assert fake.requests[-1].prompt_token_ids == tokenizer.encode(
        prompt_ids, add_special_tokens=False
    )


def test_chat_streaming_role_first_usage_last(client, tokenizer):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    script_ids = tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert text == tokenizer.decode(script_ids[:6])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    # usage is null on every chunk but the last when include_usage is on
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_completions_n_batch_echo_logprobs(client, fake, tokenizer):
    resp = client.completions.create(
        model=MODEL,
        prompt=["Hello there", "Bonjour"],
        n=2,
        max_tokens=3,
        echo=True,
        logprobs=2,
        seed=7,
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    script = tokenizer.decode(tokenizer.encode(SCRIPT, add_special_tokens=False)[:3])
    assert resp.choices[0].text == "Hello there" + script
    assert resp.choices[3].text == "Bonjour" + script
    lp = resp.choices[0].logprobs
    prompt_ids = tokenizer.encode("Hello there")
    n_prompt = len(prompt_ids)
    assert len(lp.tokens) == n_prompt + 3
    # the prompt's tokens: the first has nothing before it, the others the engine's scores
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n_prompt] == pytest.approx([-k / 10 for k in range(1, n_prompt)])
    assert lp.top_logprobs[1] == {
        tokenizer.decode([prompt_ids[1]]): pytest.approx(-0.1),
        tokenizer.decode([prompt_ids[1] + 1]): pytest.approx(-1.1),
    }
    assert lp.tokens[:n_prompt] == [tokenizer.decode([t]) for t in prompt_ids]
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    assert lp.token_logprobs[n_prompt:] == [-0.1] * 3
    assert len(lp.top_logprobs[-1]) == 2
    assert [r.sampling.prompt_logprobs for r in fake.requests[-4:]] == [2] * 4
    # usage counts each prompt once and every generated token
    n_total_prompt = n_prompt + len(tokenizer.encode("Bonjour"))
    assert resp.usage.prompt_tokens == n_total_prompt
    assert resp.usage.completion_tokens == 12
    # seeds differ per choice so n choices are not copies
    seeds = [r.sampling.seed for r in fake.requests[-4:]]
    assert seeds == [7, 8, 7, 8]


def test_completions_echo_logprobs_streaming(client, fake, tokenizer):
    stream = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=3, echo=True, logprobs=0, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    prompt_ids = tokenizer.encode("Hello there")
    first = chunks[0].logprobs
    assert chunks[0].text.startswith("Hello there")
    # the echoed prompt comes in the first chunk with its scores, then one token per chunk
    assert len(first.tokens) == len(prompt_ids) + 1
    assert first.token_logprobs[: len(prompt_ids)] == pytest.approx(
        [None] + [-k / 10 for k in range(1, len(prompt_ids))]
    )
    # logprobs=0 asks for no alternatives, but each position still names its own token (as
    # vLLM does), for the prompt and for the generated tokens
    assert first.top_logprobs[1] == {tokenizer.decode([prompt_ids[1]]): pytest.approx(-0.1)}
    assert all(len(c.logprobs.tokens) == 1 for c in chunks[1:])
    assert all(c.logprobs.top_logprobs[0] == {c.logprobs.tokens[0]: pytest.approx(-0.1)}
               for c in chunks[1:])
    # without echo the prompt is not scored
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=1, logprobs=1)
    assert fake.requests[-1].sampling.prompt_logprobs is None


def test_completions_token_id_prompt_and_stream(client, tokenizer):
    ids = tokenizer.encode("The capital of France")
    stream = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.completion_tokens == 4
    assert sum(1 for c in chunks if c.choices) == 4


def test_sampling_params_reach_the_coordinator(client, fake):
    client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_completion_tokens=5,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        stop=["Paris", "\n"],
        seed=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "min_tokens": 2,
            "stop_token_ids": [2],
        },
    )
    req = fake.requests[-1]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.7, 0.9, 20, 0.05, 3)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert s.logprobs == 2
    assert req.max_tokens == 5 and req.min_tokens == 2 and req.ignore_eos
    assert req.stop == ["Paris", "\n"] and req.stop_token_ids == [2]


def test_logit_bias_reaches_the_coordinator_and_no_op_options_are_accepted(client, fake):
    client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, logit_bias={"7": -100, "12": 2.5},
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        tool_choice="none", response_format={"type": "text"},
    )
    assert fake.requests[-1].sampling.logit_bias == ((7, -100.0), (12, 2.5))
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=1)
    assert fake.requests[-1].sampling.logit_bias == ()


def test_chat_logprobs_shape(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 2
    assert content[0].logprob == -0.1 and len(content[0].top_logprobs) == 2
    assert content[0].bytes == list(content[0].token.encode())


def test_default_max_tokens_fills_the_context(client, fake):
    client.completions.create(model=MODEL, prompt="Hi")
    req = fake.requests[-1]
    assert req.max_tokens == fake.max_model_len - len(req.prompt_token_ids)


def test_default_max_tokens_is_capped_by_the_kv_of_a_route(client, fake, server):
    fake.kv_room = 100
    try:
        client.completions.create(model=MODEL, prompt="Hi")
        req = fake.requests[-1]
        assert req.max_tokens == 100 - len(req.prompt_token_ids)
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=150)  # asked: as asked
        assert fake.requests[-1].max_tokens == 150
        resp = httpx.post(server.url + "/v1/completions", headers=AUTH,
                          json={"model": MODEL, "prompt": "word " * 120})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    finally:
        fake.kv_room = None


def test_chat_logprob_bytes_rebuild_split_utf8_characters(client, tokenizer):
    ids = tokenizer.encode(UNICODE_SCRIPT, add_special_tokens=False)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "UNICODE"}], max_tokens=len(ids),
        logprobs=True, top_logprobs=1,
    )
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == UNICODE_SCRIPT
    assert any(c.token == "\ufffd" for c in content)  # some tokens hold part of a character
    assert bytes(b for c in content for b in c.bytes).decode() == UNICODE_SCRIPT
    assert all(c.top_logprobs[0].bytes == c.bytes for c in content)


def test_request_id_echoed_and_used(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    resp = httpx.post(
        server.url + "/v1/completions", json=body, headers={**AUTH, "X-Request-Id": "abc-123"}
    )
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "abc-123"
    assert resp.json()["id"] == "abc-123"
    generated = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH)
    assert generated.json()["id"] == "cmpl-" + generated.headers["x-request-id"]


def test_models_tokenize_detokenize_version_health(server, tokenizer):
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == MODEL
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=AUTH)
    assert tok.json()["tokens"] == tokenizer.encode("Hello world")
    assert tok.json()["count"] == len(tok.json()["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": QUESTION}, headers=AUTH).json()
    assert chat["count"] > tok.json()["count"]
    detok = httpx.post(
        server.url + "/detokenize", json={"tokens": tok.json()["tokens"]}, headers=AUTH
    )
    assert detok.json()["prompt"] == "Hello world"
    assert httpx.get(server.url + "/version").json()["version"]
    # probes need no key
    assert httpx.get(server.url + "/health").status_code == 200


def test_openapi_operation_ids_are_unique(server):
    """One id per operation (GET and HEAD /health once shared one: FastAPI's duplicate
    operation id warning, and schema tools that key on the id see one operation)."""
    spec = httpx.get(server.url + "/openapi.json").json()
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)) >= 8, ids


def test_client_disconnect_closes_the_coordinator_generator(server, fake):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "SLOW please"}],
        "max_tokens": 200,
        "stream": True,
    }
    before = len(fake.closed)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any("content" in line for line in got)
        assert fake.running == 1
    # the connection is closed; the generator must be closed long before 200 x 50 ms
    deadline = time.monotonic() + 5
    while len(fake.closed) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(fake.closed) == before + 1
    assert fake.running == 0
    req = next(r for r in fake.requests if r.request_id == fake.closed[-1])
    assert req.max_tokens == 200


def test_non_streaming_disconnect_closes_too(server, fake):
    body = {"model": MODEL, "prompt": "SLOW", "max_tokens": 200}
    before = len(fake.closed)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=0.5)
    deadline = time.monotonic() + 5
    while len(fake.closed) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(fake.closed) == before + 1 and fake.running == 0


def test_openai_client_errors_map_to_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.chat.completions.create(model=MODEL, messages=QUESTION)
    with pytest.raises(openai.InternalServerError) as exc:  # 503
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "NOROUTE"}]
        )
    assert exc.value.status_code == 503


def test_shutdown_ends_open_streams_with_an_error_event(server, fake):
    serving = server.server.config.app.state.serving
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "SLOW"}],
        "max_tokens": 200,
        "stream": True,
    }
    try:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json=body, headers=AUTH
        ) as resp:
            lines = resp.iter_lines()
            assert "content" in next(x for x in lines if x)  # the role chunk
            serving.draining = True  # what serve_app's on_shutdown does
            rest = [x for x in lines if x]
    finally:
        serving.draining = False
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["error"]["code"] == "server_shutting_down"
    assert len(rest) < 10  # ended at the next token, not after 200
    assert fake.running == 0
