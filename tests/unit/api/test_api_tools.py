"""Tool calling through the real app and the real `openai` client, over a coordinator that says
a scripted answer: what reaches the coordinator (prompt, grammar) and what the client gets
back (tool_calls, deltas, finish reasons, 400s). Rendering with the demo model's template
and with one that renders tools itself."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from api_testlib import API_KEY, MODEL, FakeCoordinator, ServerThread

from helixserve.api.app import create_app
from helixserve.api.errors import APIError
from helixserve.api.protocol import ChatCompletionRequest
from helixserve.api.tools import HERMES_SYSTEM, chat_template_inputs, enforce, plan_tools
from helixserve.request import SamplingParams, StructuredOutput
from helixserve.runtime import GenerationRequest, TokenEvent

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


class ScriptedCoordinator(FakeCoordinator):
    """Says `script` token by token and stops ("stop"), or is cut at max_tokens ("length")."""

    script = "Hello."

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(req)
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)
        sent = ""
        for i in range(min(len(ids), req.max_tokens)):
            full = self.tokenizer.decode(ids[:i + 1])
            piece = "" if full.endswith("\ufffd") else full[len(sent):]
            sent = sent if full.endswith("\ufffd") else full
            last = i + 1 == min(len(ids), req.max_tokens)
            yield TokenEvent(ids[i], piece, None, [],
                             ("stop" if i + 1 == len(ids) else "length") if last else None)


@pytest.fixture(scope="module")
def scripted(tokenizer: Any) -> ScriptedCoordinator:
    return ScriptedCoordinator(tokenizer, max_model_len=2048)


@pytest.fixture(scope="module")
def server(scripted: ScriptedCoordinator) -> Iterator[ServerThread]:
    with ServerThread(create_app(scripted, None, api_key=API_KEY)) as s:
        yield s


@pytest.fixture()
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def prompt_of(fake: ScriptedCoordinator) -> str:
    return str(fake.tokenizer.decode(fake.requests[-1].prompt_token_ids))


def stream_calls(client: openai.OpenAI, **kw: Any) -> tuple[str, list[dict[str, Any]], str]:
    """Content, calls and finish reason of a streamed answer, deltas put together."""
    content, calls, finish = "", {}, ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.type == "function" and d.id.startswith("call_")
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---- auto: free output parsed ------------------------------------------------------------

HERMES_ANSWER = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_auto_parses_calls_and_offers_the_tools(client, scripted):
    scripted.script = HERMES_ANSWER
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    # the demo model's template shows no tools: the Hermes block in the system message
    prompt = prompt_of(scripted)
    assert "<tools>" in prompt and json.dumps(WEATHER["function"]["parameters"]) in prompt
    assert scripted.requests[-1].sampling.structured is None  # auto: free generation

    content, s_calls, finish = stream_calls(client, messages=ASK, tools=[WEATHER, TIME])
    assert finish == "tool_calls" and content.strip() == ""
    assert [c["name"] for c in s_calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in s_calls] == [{"city": "Paris"}, {}]


def test_auto_without_calls_is_content_and_malformed_calls_too(client, scripted):
    for script in ("It is sunny in Paris.", "<tool_call>\n{broken json\n</tool_call>"):
        scripted.script = script
        resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        assert resp.choices[0].message.content == script
        assert not resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "stop"
        content, calls, finish = stream_calls(client, messages=ASK, tools=[WEATHER])
        assert (content, calls, finish) == (script, [], "stop")


def test_parallel_tool_calls_false_keeps_one_call(client, scripted):
    scripted.script = HERMES_ANSWER
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          parallel_tool_calls=False)
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, _ = stream_calls(client, messages=ASK, tools=[WEATHER, TIME],
                               parallel_tool_calls=False)
    assert [c["name"] for c in calls] == ["get_weather"]
    schema = json.loads(plan_tools(chat_body(tools=[WEATHER], tool_choice="required",
                                             parallel_tool_calls=False), None).structured.spec)
    assert schema["maxItems"] == 1


def test_none_offers_no_tools(client, scripted):
    scripted.script = HERMES_ANSWER
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice="none")
    assert resp.choices[0].message.content == HERMES_ANSWER  # not parsed
    assert not resp.choices[0].message.tool_calls
    assert "<tools>" not in prompt_of(scripted)


def test_tool_messages_in_the_history(client, scripted):
    scripted.script = "It is 18 C and sunny in Paris; the time is 14:05."
    resp = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=[WEATHER, TIME])
    assert resp.choices[0].message.content == scripted.script
    prompt = prompt_of(scripted)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05" in prompt
    # without tools offered, the history renders all the same
    client.chat.completions.create(model=MODEL, messages=HISTORY)
    assert "<tool_response>" in prompt_of(scripted) and "<tools>" not in prompt_of(scripted)


# ---- required and named: held by the grammar --------------------------------------------


def test_named_choice_sets_the_arguments_grammar_and_answers_the_call(client, scripted):
    scripted.script = '{"city": "Paris"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=named)
    structured = scripted.requests[-1].sampling.structured
    assert structured.kind == "json"
    plan = plan_tools(chat_body(tools=[TIME, WEATHER], tool_choice=named), None)
    assert plan.structured_param == "tools.1.function.parameters"
    assert json.loads(structured.spec) == WEATHER["function"]["parameters"]
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert resp.choices[0].finish_reason == "tool_calls"
    content, calls, finish = stream_calls(client, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice=named)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_required_choice_sets_the_calls_grammar_and_answers_the_calls(client, scripted):
    scripted.script = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                       '{"name": "get_time", "arguments": {}}]')
    resp = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                          tool_choice="required")
    schema = json.loads(scripted.requests[-1].sampling.structured.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert [c.function.name for c in resp.choices[0].message.tool_calls] == [
        "get_weather", "get_time"]
    _, calls, finish = stream_calls(client, messages=ASK, tools=[WEATHER, TIME],
                                    tool_choice="required")
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather", "get_time"]


def test_a_forced_call_cut_by_max_tokens_is_content_with_length(client, scripted):
    scripted.script = '{"city": "Paris, the capital of France"}'
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert resp.choices[0].finish_reason == "length"
    assert not resp.choices[0].message.tool_calls and resp.choices[0].message.content


# ---- bad input ----------------------------------------------------------------------------


def check_400(server: ServerThread, patch: dict[str, Any], param: str) -> str:
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], **patch}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(param + ":"), err["message"]
    return str(err["message"])


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "tool_choice", "'get_time', which is not among the tools: get_weather"),
        ({"tool_choice": "always"}, "tool_choice", "unknown value 'always'"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "a named choice is"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                      {"type": "string"}}}]},
         "tools.0.function.parameters", 'type "object", got type \'string\''),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools.0.function.parameters", "dictionary"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name", "pattern"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type",
         "function"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages.1.tool_call_id",
         "required"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]},
         "messages.1.tool_call_id", "'call_9' answers no tool call"),
        ({"messages": [{**HISTORY[1], "role": "user"}]}, "messages.0.tool_calls",
         "only assistant messages"),
        ({"messages": [HISTORY[0], {**HISTORY[1], "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": "{nope"}}]}]},
         "messages.1.tool_calls.0.function.arguments", "not valid JSON"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools.1.function.parameters", "nonsense"),
    ],
)
def test_bad_tool_input_is_400_naming_the_field(server, patch, param, says):
    assert says in check_400(server, patch, param)


def test_forced_choice_and_another_grammar_conflict():
    """A choice whose output another grammar already holds (response_format, guided_*)."""
    other = StructuredOutput("json_object", "")
    batch = SimpleNamespace(choices=[SimpleNamespace(request=SimpleNamespace(
        sampling=SamplingParams(structured=other)))])
    plan = plan_tools(chat_body(tools=[WEATHER], tool_choice="required"), None)
    with pytest.raises(APIError, match="tool_choice: a required or named tool choice"):
        enforce(plan, batch)  # type: ignore[arg-type]
    batch.choices[0].request.sampling = SamplingParams()
    enforce(plan, batch)  # type: ignore[arg-type]
    assert batch.choices[0].request.sampling.structured == plan.structured


# ---- rendering ----------------------------------------------------------------------------


def chat_body(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **kw})


NATIVE = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
          "{% for m in messages %}{{ m.role }}:{{ m.content }}"
          "{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}"
          "{{ c.function.arguments | tojson }}{% endfor %}"
          "{% if m.tool_call_id %}ID:{{ m.tool_call_id }}{% endif %}\n{% endfor %}")


def test_a_template_that_renders_tools_gets_them(tokenizer):
    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER, TIME]})
    messages, tools = chat_template_inputs(body, NATIVE)
    assert tools == [WEATHER, TIME]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=NATIVE,
                                         tokenize=False)
    assert text.startswith('TOOLS:[{"type": "function"')
    assert 'CALL:get_weather{"city": "Paris"}' in text and "ID:call_2" in text


def test_the_fallback_block_joins_the_system_message(tokenizer):
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer", "content": "Be brief."}, *ASK], "tools": [TIME]})
    messages, tools = chat_template_inputs(body, tokenizer.chat_template)
    assert tools is None and [m["role"] for m in messages] == ["system", "user"]
    block = HERMES_SYSTEM.format(tools=json.dumps(TIME))
    assert messages[0]["content"] == "Be brief.\n\n" + block
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>system\nBe brief.\n\n# Tools" in text
    assert "You are a helpful AI assistant named SmolLM" not in text


def test_parser_flag_overrides_the_template(scripted, tokenizer):
    body = chat_body(tools=[WEATHER])
    assert plan_tools(body, tokenizer.chat_template).parser == "hermes"
    assert plan_tools(body, "{{ '[TOOL_CALLS]' }}{{ tools }}").parser == "mistral"
    assert plan_tools(body, tokenizer.chat_template, "llama3").parser == "llama3"
    assert plan_tools(chat_body(tools=[WEATHER], tool_choice="none"), None) is None
    with pytest.raises(ValueError, match="unknown tool call parser 'x'"):
        plan_tools(body, None, "x")
    with ServerThread(create_app(scripted, None, api_key=API_KEY,
                                 tool_call_parser="llama3")) as s:
        scripted.script = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
        resp = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
        call = resp.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Rome"})


def test_tool_parser_flag():
    import argparse

    from helixserve.commands.tool_args import add_tool_arguments, tool_options

    p = argparse.ArgumentParser()
    add_tool_arguments(p)
    assert tool_options(p.parse_args([])) == {"tool_call_parser": "auto"}
    assert tool_options(p.parse_args(["--tool-call-parser", "mistral"])) == {
        "tool_call_parser": "mistral"}
    with pytest.raises(SystemExit):
        p.parse_args(["--tool-call-parser", "qwen"])
