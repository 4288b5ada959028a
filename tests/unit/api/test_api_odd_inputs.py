"""Odd request bodies a fuzzer found: each is a 400 naming its parameter, never a 500, and
never silently accepted as something else (a string "2" is not n=2, true is not 1)."""

from __future__ import annotations

import json

import httpx
import pytest
from api_testlib import API_KEY, MODEL
from test_api_errors import check_error

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
LONE_SURROGATE = "\ud800"


def post_raw(server, path: str, text: str, **headers: str) -> httpx.Response:
    """POST a JSON text as written (json= would refuse a lone surrogate)."""
    return httpx.post(
        server.url + path,
        content=text.encode("utf-8"),
        headers={**AUTH, "Content-Type": "application/json", **headers},
    )


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages.0.content"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         "messages.0.content"),
        ("/v1/completions", '{"prompt": "\\udfff", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\ud800"], "max_tokens": 1}', "prompt.1"),
        ("/v1/completions", '{"prompt": "Hi", "stop": ["\\ud800"], "max_tokens": 1}', "stop.0"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ],
)
def test_lone_surrogate_is_400(server, path, body, param):
    err = check_error(post_raw(server, path, body), 400, param)
    assert "UTF-8" in err["message"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"prompt": [1, -5, 3]}, "prompt.1"),
        ({"prompt": [1, 2**40]}, "prompt.1"),
        ({"prompt": [[1, 2], [3, 2**70]]}, "prompt.1.1"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids.0"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        # a JSON true is not 1, a string is not a number, 1 is not true
        ({"max_tokens": True}, "max_tokens"),
        ({"n": "2"}, "n"),
        ({"n": 2.5}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": "yes"}, "echo"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stop": 5}, "stop"),
        ({"prompt": 5}, "prompt"),
    ],
)
def test_completion_odd_values_are_400(server, patch, param):
    resp = httpx.post(server.url + "/v1/completions", json={**COMPLETION, **patch}, headers=AUTH)
    err = check_error(resp, 400, param)
    assert err["code"] == "invalid_parameter"
    assert err["message"].startswith(param + ":"), err["message"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
        ({"response_format": {}}, "response_format.type"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    ],
)
def test_chat_odd_values_are_400(server, patch, param):
    resp = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **patch}, headers=AUTH)
    err = check_error(resp, 400, param)
    assert err["message"].startswith(param + ":"), err["message"]
    # the message quotes the bad value, not the whole request body
    assert "messages" not in err["message"] or param.startswith("messages")


def test_values_at_the_edges_are_served(server):
    for patch in ({"seed": 2**63 - 1, "n": 3}, {"top_k": 2**31 - 1}, {"temperature": 2},
                  {"temperature": 1}, {"stop": ["a"] * 16}, {"tool_choice": "none"},
                  {"response_format": {"type": "text"}}, {"logit_bias": {" 5 ": 1}}):
        resp = httpx.post(
            server.url + "/v1/chat/completions", json={**CHAT, **patch}, headers=AUTH
        )
        assert resp.status_code == 200, (patch, resp.text)


def test_null_means_not_given(server):
    """OpenAI's parameters are nullable: null is the default, not a type error."""
    nulls = dict.fromkeys(("n", "stream", "stream_options", "temperature", "top_p", "stop",
                           "seed", "min_tokens", "ignore_eos", "logit_bias", "user"))
    resp = httpx.post(server.url + "/v1/completions",
                      json={**COMPLETION, **nulls, "echo": None, "logprobs": None},
                      headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 1 and resp.json()["choices"][0]["logprobs"] is None
    resp = httpx.post(server.url + "/v1/chat/completions",
                      json={**CHAT, **nulls, "logprobs": None, "top_logprobs": None,
                            "tools": None, "tool_choice": None, "response_format": None,
                            "add_generation_prompt": None}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    check_error(httpx.post(server.url + "/v1/completions", json={**COMPLETION, "prompt": None},
                           headers=AUTH), 400, "prompt")


@pytest.mark.parametrize(
    ("content", "content_type", "code"),
    [
        (b"", "application/json", "missing_body"),
        (b"prompt=Hi", "application/x-www-form-urlencoded", "invalid_body"),
        (b'{"prompt": "Hi"}', "text/plain", "invalid_body"),
        (b'{"prompt": "\xff\xfe"}', "application/json", "invalid_json"),
        (b"[1, 2]", "application/json", "invalid_body"),
    ],
)
def test_body_that_is_not_a_json_object_is_400(server, content, content_type, code):
    resp = httpx.post(
        server.url + "/v1/completions",
        content=content,
        headers={**AUTH, "Content-Type": content_type},
    )
    err = check_error(resp, 400)
    assert err["code"] == code, err


def test_model_by_id(server):
    resp = httpx.get(server.url + f"/v1/models/{MODEL}", headers=AUTH)
    assert resp.status_code == 200
    assert resp.json()["id"] == MODEL and resp.json()["object"] == "model"
    err = check_error(httpx.get(server.url + "/v1/models/gpt-9", headers=AUTH), 404, "model")
    assert err["code"] == "model_not_found"
    assert httpx.get(server.url + f"/v1/models/{MODEL}").status_code == 401


def test_openai_client_retrieves_the_model(client):
    assert client.models.retrieve(MODEL).id == MODEL


def test_head_health(server):
    resp = httpx.head(server.url + "/health")
    assert resp.status_code == 200 and resp.content == b""


def test_detokenize_odd_ids_are_400(server):
    for tokens in ([2**40], [-1], ["1"], [True]):
        resp = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, headers=AUTH)
        check_error(resp, 400, "tokens.0")


def test_error_message_is_json_safe_and_short(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        json={**COMPLETION, "stop": ["x" * 5000] * 40},
        headers=AUTH,
    )
    err = check_error(resp, 400, "stop")
    assert len(err["message"]) < 400
    json.dumps(err)


# --- sizes: a body or a prompt too large is refused before it is read or tokenized --------

@pytest.fixture(scope="module")
def small_server(fake):
    from api_testlib import ServerThread

    from helixserve.api.app import create_app

    with ServerThread(create_app(fake, None, api_key=API_KEY, max_body_bytes=2000)) as s:
        yield s


def test_body_over_the_limit_is_413(small_server):
    body = {**COMPLETION, "prompt": "x" * 3000}
    resp = httpx.post(small_server.url + "/v1/completions", json=body, headers=AUTH)
    assert check_error(resp, 413)["code"] == "request_too_large"
    # chunked (no Content-Length): counted while read
    chunks = (json.dumps(body).encode()[i:i + 500] for i in range(0, 4000, 500))
    resp = httpx.post(small_server.url + "/v1/completions", content=chunks,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert check_error(resp, 413)["code"] == "request_too_large"


def test_chunked_body_under_the_limit_is_served(small_server):
    raw = json.dumps(COMPLETION).encode()
    chunks = (raw[i:i + 10] for i in range(0, len(raw), 10))
    resp = httpx.post(small_server.url + "/v1/completions", content=chunks,
                      headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"]


def test_prompt_too_long_for_any_tokenization_is_refused_untokenized(server, fake):
    serving = server.server.config.app.state.serving
    limit = fake.max_model_len
    longest = max(len(t) for t in fake.tokenizer.get_vocab())
    text = "a" * (limit * longest + 1)
    calls = []
    original = fake.tokenizer.encode

    def counting_encode(*args, **kwargs):
        calls.append(len(args[0]) if args else 0)
        return original(*args, **kwargs)

    fake.tokenizer.encode = counting_encode
    try:
        resp = httpx.post(server.url + "/v1/completions",
                          json={**COMPLETION, "prompt": text}, headers=AUTH)
        chat = httpx.post(server.url + "/v1/chat/completions",
                          json={**CHAT, "messages": [{"role": "user", "content": text}]},
                          headers=AUTH)
    finally:
        fake.tokenizer.encode = original
    err = check_error(resp, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert check_error(chat, 400, "messages")["code"] == "context_length_exceeded"
    assert not [n for n in calls if n > limit * longest], "the long text was tokenized"
    assert serving.max_token_chars == longest
