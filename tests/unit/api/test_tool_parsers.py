"""Tool call parsers on fixed outputs: the three families, parallel calls, malformed output
staying content, and streams (any chunking) giving what the whole output gives."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helixserve.api.tool_parsers import (
    HermesParser,
    Llama3Parser,
    MistralParser,
    ToolParser,
    get_parser,
    parser_for_template,
)


def streamed(parser: ToolParser, text: str, chunk: int) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls a stream of `text` in pieces of `chunk` characters gives, the call
    deltas put together as a client does (the first delta of each has its id and name)."""
    stream = parser.stream()
    steps = [stream.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)]
    steps.append(stream.finish())
    content = "".join(s.content for s in steps)
    calls: dict[int, dict[str, Any]] = {}
    for d in (d for s in steps for d in s.calls):
        if d.id is not None:
            assert d.index not in calls, "a call announced twice"
            assert d.id.startswith("call_") and d.name
            calls[d.index] = {"name": d.name, "arguments": ""}
        calls[d.index]["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def whole(parser: ToolParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    out = parser.parse(text)
    assert len({c.id for c in out.calls}) == len(out.calls)
    return out.content, [{"name": c.name, "arguments": json.loads(c.arguments)}
                         for c in out.calls]


def check_stream_matches(parser: ToolParser, text: str) -> None:
    content, calls = whole(parser, text)
    for chunk in (1, 2, 5, 13, len(text)):
        s_content, s_calls = streamed(parser, text, chunk)
        assert [c["name"] for c in s_calls] == [c["name"] for c in calls], chunk
        assert [json.loads(c["arguments"]) for c in s_calls] == [c["arguments"] for c in calls]
        assert s_content.strip() == (content or ""), (chunk, s_content)


HERMES_TWO = (
    "Let me look that up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"a": "}]\\"{"}]}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"arguments": {"q": "é"}, "name": "search"}\n</tool_call>\n'
)


def test_hermes_parallel_calls_and_content():
    content, calls = whole(HermesParser(), HERMES_TWO)
    assert content == "Let me look that up."
    assert calls == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"a": '}]"{'}]}},
        {"name": "search", "arguments": {"q": "é"}},
    ]
    check_stream_matches(HermesParser(), HERMES_TWO)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        "I use <tool_ to mean something",
    ],
)
def test_hermes_malformed_output_stays_content(text):
    content, calls = whole(HermesParser(), text)
    assert calls == [] and content == text
    s_content, s_calls = streamed(HermesParser(), text, 3)
    assert s_calls == [] and s_content == text


def test_hermes_keeps_valid_calls_next_to_a_malformed_block():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{oops</tool_call>'
    content, calls = whole(HermesParser(), text)
    assert calls == [{"name": "f", "arguments": {}}]
    assert content == "<tool_call>{oops</tool_call>"


def test_hermes_unclosed_last_block_and_string_arguments():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}'
    assert whole(HermesParser(), text) == (None, [{"name": "f", "arguments": {"x": 2}}])
    check_stream_matches(HermesParser(), text)


def test_hermes_streams_arguments_before_the_call_ends():
    stream = HermesParser().stream()
    first = stream.feed('<tool_call>{"name": "f", "arguments": {"city": "Pa')
    assert [d.name for d in first.calls if d.id] == ["f"]
    assert "".join(d.arguments for d in first.calls) == '{"city": "Pa'
    rest = stream.feed('ris"}}</tool_call>')
    assert "".join(d.arguments for d in rest.calls) == 'ris"}'
    assert stream.num_calls == 1 and stream.finish().content == ""


LLAMA_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
             '{"name": "get_time", "parameters": {}}')


def test_llama3_calls():
    assert whole(Llama3Parser(), LLAMA_TWO) == (
        None,
        [{"name": "get_weather", "arguments": {"city": "Paris"}},
         {"name": "get_time", "arguments": {}}],
    )
    check_stream_matches(Llama3Parser(), LLAMA_TWO)
    one = '{"name": "f", "parameters": {"n": 3}}'
    assert whole(Llama3Parser(), one) == (None, [{"name": "f", "arguments": {"n": 3}}])
    check_stream_matches(Llama3Parser(), one)


@pytest.mark.parametrize(
    "text",
    ["Paris is the capital.", '{"name": 7, "parameters": {}}', '{"name": "f", "parameters": 5}',
     '{"answer": 42}', "{not json}"],
)
def test_llama3_malformed_output_stays_content(text):
    assert whole(Llama3Parser(), text) == (text, [])
    for chunk in (1, 4, len(text)):
        assert streamed(Llama3Parser(), text, chunk) == (text, [])


def test_a_call_cut_short_is_content_whole_but_already_streamed():
    """A stream cannot take back what it sent: a call whose arguments had begun is sent as
    such even if the output then ends early (max_tokens); the whole output is content."""
    text = '{"name": "f", "parameters": {"city": "Pa'
    assert whole(Llama3Parser(), text) == (text, [])
    stream = Llama3Parser().stream()
    deltas = stream.feed(text).calls + stream.finish().calls
    assert deltas[0].name == "f" and "".join(d.arguments for d in deltas) == '{"city": "Pa'


MISTRAL_TWO = ('Checking both.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]')


def test_mistral_calls():
    content, calls = whole(MistralParser(), MISTRAL_TWO)
    assert content == "Checking both."
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                     {"name": "get_time", "arguments": {"tz": "CET"}}]
    check_stream_matches(MistralParser(), MISTRAL_TWO)
    # the marker is a special token a detokenizer may drop: a bare call list is read too
    bare = '[{"name": "f", "arguments": {}}]'
    assert whole(MistralParser(), bare) == (None, [{"name": "f", "arguments": {}}])
    check_stream_matches(MistralParser(), bare)


@pytest.mark.parametrize(
    "text", ["No calls here [1] and [2].", "[TOOL_CALLS] garbage", '[TOOL_CALLS][{"x": 1}]']
)
def test_mistral_malformed_output_stays_content(text):
    assert whole(MistralParser(), text) == (text, [])
    for chunk in (1, 3, len(text)):
        assert streamed(MistralParser(), text, chunk) == (text, [])


def test_parser_chosen_from_the_template():
    assert parser_for_template("{{ '<tool_call>' }}{% for tool in tools %}") == "hermes"
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3"
    assert parser_for_template("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert parser_for_template("<|im_start|>{{ message['content'] }}") == "hermes"
    assert parser_for_template(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'; known: hermes"):
        get_parser("qwen")
