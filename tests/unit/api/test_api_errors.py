"""Every error the API returns: its status and the OpenAI error JSON."""

from __future__ import annotations

import json

import httpx
import pytest
from api_testlib import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def check_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(10**9): 1}}, "logit_bias"),  # out of the vocabulary
        # asked-for behaviour we do not have is refused, never silently dropped
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        # structured output is served (docs/structured-output.md); bad specs are still 400s
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}},
         "response_format.json_schema.schema"),
        ({"guided_json": {"type": "no-such-type"}}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
    ],
)
def test_invalid_parameter_is_400_not_422(server, patch, param):
    resp = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **patch}, headers=AUTH)
    err = check_error(resp, 400, param)
    assert err["type"] == "invalid_request_error"


def test_missing_required_field_is_400(server):
    resp = httpx.post(server.url + "/v1/completions", json={"model": MODEL}, headers=AUTH)
    check_error(resp, 400, "prompt")


def test_invalid_json_is_400(server):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={**AUTH, "Content-Type": "application/json"},
    )
    check_error(resp, 400)


def test_prompt_longer_than_context_is_400(server, fake):
    long_prompt = " hello" * (fake.max_model_len + 10)
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1},
        headers=AUTH,
    )
    err = check_error(resp, 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert str(fake.max_model_len) in err["message"]


def test_prompt_plus_max_tokens_over_context_is_400(server, fake):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={**CHAT, "max_tokens": fake.max_model_len},
        headers=AUTH,
    )
    assert check_error(resp, 400, "messages")["code"] == "context_length_exceeded"


def test_best_of_above_one_is_400(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "best_of": 3},
        headers=AUTH,
    )
    assert "best_of" in check_error(resp, 400, "best_of")["message"]


def test_token_id_out_of_vocab_is_400(server):
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": [1, 2, 10**9], "max_tokens": 1},
        headers=AUTH,
    )
    check_error(resp, 400, "prompt")


def test_min_tokens_over_max_tokens_is_400(server):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={**CHAT, "max_tokens": 2, "min_tokens": 5},
        headers=AUTH,
    )
    check_error(resp, 400, "min_tokens")


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
)
def test_bad_api_key_is_401(server, headers):
    resp = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert check_error(resp, 401)["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
    assert (
        httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers=headers).status_code
        == 401
    )


def test_unknown_model_is_404(server):
    resp = httpx.post(
        server.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, headers=AUTH
    )
    err = check_error(resp, 404, "model")
    assert err["code"] == "model_not_found"


def test_unknown_path_is_404_in_openai_shape(server):
    check_error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)


@pytest.mark.parametrize(("word", "code"), [("NOROUTE", "no_route"), ("QUEUEFULL", "queue_full")])
@pytest.mark.parametrize("stream", [False, True])
def test_no_route_and_full_queue_are_503(server, word, code, stream):
    body = {**CHAT, "messages": [{"role": "user", "content": word}], "stream": stream}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert check_error(resp, 503)["code"] == code


def test_stream_options_without_stream_is_400(server):
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={**CHAT, "stream_options": {"include_usage": True}},
        headers=AUTH,
    )
    check_error(resp, 400)


def test_worker_failure_is_500_or_sse_error_event(server):
    body = {**CHAT, "messages": [{"role": "user", "content": "WORKERFAIL"}], "max_tokens": 10}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert check_error(resp, 500)["code"] == "request_failed"
    # streaming: the headers are out already, so the error comes as the last event
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH
    ) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: ") :])["error"]
    assert err["code"] == "request_failed" and "node n2" in err["message"]
    contents = [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in lines[1:-2]]
    assert len(contents) == 2 and all(contents)


def test_health_is_503_while_a_layer_has_no_live_worker(server, fake):
    assert httpx.get(server.url + "/health").status_code == 200
    fake.dead_nodes.add("n2")  # n2 alone holds layers [12, 30)
    try:
        resp = httpx.get(server.url + "/health")
        assert resp.status_code == 503
        body = resp.json()
        # the OpenAI error, and per node what an operator checks first
        check_error(httpx.Response(503, json={"error": body["error"]}), 503)
        assert body["error"]["code"] == "no_route" and "12-29" in body["error"]["message"]
        assert body["nodes"]["n2"]["alive"] is False
        assert body["nodes"]["n1"]["alive"] is True
        # readiness is the process serving HTTP: the one replica stays in its Service, so
        # clients get the wait or a 503 with Retry-After, not a refused connection
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    finally:
        fake.dead_nodes.clear()
    resp = httpx.get(server.url + "/health")
    assert resp.status_code == 200
    assert resp.json()["status"] == "ok" and resp.json()["nodes"]["n2"]["alive"] is True
