"""Tool calling on the real demo stack (SmolLM2-135M, 3 workers, coordinator, API) with the real
`openai` client. A forced call (named, required) must parse and name the tool, streamed and
not: the demo model's free output would not, so these hold only with the grammar enforced on
the last stage (SamplingParams.structured)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from api_demo_lib import API_KEY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "Local time of a time zone",
                 "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                "required": ["tz"], "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
#: greedy and short: a forced call closes well within it
OPTS: dict[str, Any] = {"temperature": 0, "max_tokens": 80}


def client(demo) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def model(demo) -> str:
    return client(demo).models.list().data[0].id


def check_call(name: str, arguments: str) -> None:
    """A call of one of the tools whose arguments follow its schema."""
    args = json.loads(arguments)
    key = {"get_weather": "city", "get_time": "tz"}[name]
    assert set(args) == {key} and isinstance(args[key], str), arguments


def streamed(demo, **kw: Any) -> tuple[str, list[dict[str, str]], str | None]:
    content, calls, finish = "", {}, None
    stream = client(demo).chat.completions.create(model=model(demo), stream=True, **OPTS, **kw)
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.id.startswith("call_") and d.type == "function"
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_named_tool_choice_parses_and_names_the_tool(demo):
    resp = client(demo).chat.completions.create(
        model=model(demo), messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, **OPTS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)

    content, calls, finish = streamed(demo, messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice=NAMED)
    assert finish == "tool_calls" and content == ""
    assert [c["name"] for c in calls] == ["get_weather"]
    check_call("get_weather", calls[0]["arguments"])


def test_required_tool_choice_parses_and_names_a_tool(demo):
    resp = client(demo).chat.completions.create(
        model=model(demo), messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, **OPTS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)

    content, calls, finish = streamed(demo, messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice="required")
    assert finish == "tool_calls" and content == "" and calls
    for c in calls:
        check_call(c["name"], c["arguments"])


def test_auto_and_tool_messages_in_the_history(demo):
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"},
    ]
    resp = client(demo).chat.completions.create(
        model=model(demo), messages=history, tools=[WEATHER, TIME], **OPTS)
    choice = resp.choices[0]
    # auto: whatever the model said is either content or calls that parse, never both lost
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
    for call in choice.message.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    if not choice.message.tool_calls:
        assert choice.message.content


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                              "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "array", "items": {}}}}]},
         "tools.0.function.parameters"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ],
)
def test_bad_tool_input_is_400(demo, kw, param):
    kw = {"messages": ASK, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client(demo).chat.completions.create(model=model(demo), **OPTS, **kw)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
