"""Structured output through the real demo stack (3 worker processes, coordinator, API) with
the real `openai` client: the last stage constrains the demo model's tokens, so what comes back
validates against the schema, streamed or not, where the model's free answer does not."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from api_demo_lib import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "Describe the city of Paris."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "enum": ["France", "Italy", "Spain"]},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "minItems": 1, "maxItems": 3},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "landmarks", "capital"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def model_name(demo) -> str:
    return httpx.get(demo.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def client(demo) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo.url + "/v1", api_key=API_KEY, max_retries=0, timeout=180)


def test_json_schema_non_streaming_validates_and_free_text_does_not(demo):
    resp = client(demo).chat.completions.create(
        model=model_name(demo), messages=MESSAGES, max_tokens=150, temperature=0,
        response_format=RESPONSE_FORMAT)  # type: ignore[arg-type]
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    free = client(demo).chat.completions.create(
        model=model_name(demo), messages=MESSAGES, max_tokens=60, temperature=0)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free.choices[0].message.content or ""), SCHEMA)


def test_json_schema_streaming_sampled_validates(demo):
    """Streamed, sampled (temperature 1, seeded), two choices: each choice's deltas join into
    a document valid against the schema."""
    stream = client(demo).chat.completions.create(
        model=model_name(demo), messages=MESSAGES, max_tokens=150, temperature=1.0, seed=7,
        n=2, stream=True, response_format=RESPONSE_FORMAT)  # type: ignore[arg-type]
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}, texts
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_regex_and_choice_on_completions(demo):
    c = client(demo)
    regex = r"[0-9]{3}-[A-Z]{2}"
    resp = c.completions.create(model=model_name(demo), prompt="My code is", max_tokens=20,
                                temperature=0.8, seed=1, extra_body={"guided_regex": regex})
    import re

    assert re.fullmatch(regex, resp.choices[0].text), resp.choices[0].text
    assert resp.choices[0].finish_reason == "stop"
    choices = ["sunny", "rainy", "cloudy with a chance of meatballs"]
    resp = c.chat.completions.create(
        model=model_name(demo), messages=[{"role": "user", "content": "Weather today?"}],
        max_tokens=20, temperature=1.0, n=3, extra_body={"structured_outputs": {"choice": choices}})
    assert all(ch.message.content in choices for ch in resp.choices), resp.choices


def test_invalid_schema_is_400_naming_the_field(demo):
    with pytest.raises(openai.BadRequestError) as err:
        client(demo).chat.completions.create(
            model=model_name(demo), messages=MESSAGES, max_tokens=8,
            response_format={"type": "json_schema",  # type: ignore[arg-type]
                             "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    assert err.value.status_code == 400
    assert err.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    resp = httpx.post(demo.url + "/v1/chat/completions", headers=AUTH, json={
        "model": model_name(demo), "messages": MESSAGES, "guided_json": [1, 2]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_json"
