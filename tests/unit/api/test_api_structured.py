"""Structured output at the API (over the fake coordinator): every way a client asks for it
reaches the coordinator as the same `StructuredOutput`, on both endpoints; bad schemas,
regexes, grammars and choices are 400s in OpenAI's error JSON naming the field. (The tokens
themselves are constrained on the last stage: tests/integration/api/test_structured_output.py
runs the real stack.)"""

from __future__ import annotations

import json

import httpx
import pytest
from api_testlib import API_KEY, MODEL

from helixserve.request import StructuredOutput

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "")),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
         StructuredOutput("json", SCHEMA_TEXT)),
        ({"guided_json": SCHEMA}, StructuredOutput("json", SCHEMA_TEXT)),
        ({"guided_json": SCHEMA_TEXT}, StructuredOutput("json", SCHEMA_TEXT)),
        ({"guided_regex": "[0-9]{3}"}, StructuredOutput("regex", "[0-9]{3}")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]')),
        ({"guided_grammar": 'start: "a"+'}, StructuredOutput("lark", 'start: "a"+')),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", SCHEMA_TEXT)),
        ({"structured_outputs": {"regex": "x+"}}, StructuredOutput("regex", "x+")),
        ({"structured_outputs": {"choice": ["a"]}}, StructuredOutput("choice", '["a"]')),
        ({"structured_outputs": {"grammar": 'root ::= "hi"'}},
         StructuredOutput("lark", 'root ::= "hi"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", "")),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_each_way_of_asking_reaches_the_coordinator(server, fake, endpoint, patch, expected):
    body = CHAT if endpoint.endswith("chat/completions") else COMPLETION
    resp = httpx.post(server.url + endpoint, json={**body, **patch, "n": 2}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    for req in fake.requests[-2:]:
        assert req.sampling.structured == expected


@pytest.mark.parametrize(
    ("patch", "param", "words"),
    [
        ({"guided_json": {"type": "no-such-type"}}, "guided_json", "no-such-type"),
        ({"guided_json": "[1, 2]"}, "guided_json", "JSON object"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "[a-"}}}}, "response_format.json_schema.schema",
         "unclosed character class"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
         "response_format.json_schema.schema", "dictionary"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
         "required"),
        ({"guided_regex": "(ab"}, "guided_regex", "unclosed group"),
        ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex", "regex"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar", "missing_rule"),
        ({"guided_choice": ["a", 3]}, "guided_choice.1", ""),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "only one"),
        ({"structured_outputs": {"structural_tag": {"structures": []}}},
         "structured_outputs.structural_tag", "not supported"),
    ],
)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_bad_specs_are_400_naming_the_field(server, fake, endpoint, patch, param, words):
    body = CHAT if endpoint.endswith("chat/completions") else COMPLETION
    before = len(fake.requests)
    resp = httpx.post(server.url + endpoint, json={**body, **patch}, headers=AUTH)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert words in err["message"], err["message"]
    assert len(fake.requests) == before  # refused before any work


def test_openai_client_sends_json_schema_and_bad_schema_raises(client, fake):
    import openai

    client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=4,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}})
    assert fake.requests[-1].sampling.structured == StructuredOutput("json", SCHEMA_TEXT)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=CHAT["messages"], max_tokens=4,
            extra_body={"guided_json": {"type": "object", "properties": {"a": {"type": 7}}}})
    assert err.value.body["param"] == "guided_json"  # type: ignore[index]
