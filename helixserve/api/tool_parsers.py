"""Tool calls out of model text: one parser per model family, whole outputs and streams.

A family writes its calls its own way:
- `hermes` (Qwen2, SmolLM, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, text around the blocks is content;
- `llama3` (Llama 3.x JSON tool calling): the whole answer is `{"name": ..., "parameters":
  {...}}`, optionally after `<|python_tag|>`, several calls separated by `;`;
- `mistral`: content, then `[TOOL_CALLS]` and a JSON array of `{"name", "arguments"}`.

Output that does not parse stays content: a malformed `<tool_call>` block is passed through as
text, a llama3 or mistral answer that is not a list of calls is all content. A call is an
object with a string `name` and an object `arguments` (or `parameters`; a JSON string holding
an object is taken too; absent = `{}`).

Streams: `stream()` returns a `ToolStream` fed the text as it is generated. It announces a
call (index, id, name) once its name is complete and then passes its arguments through as the
model writes them, raw JSON chunks that concatenate to the arguments object (a whole output
gives them re-serialized, `json.dumps`: the same object, other whitespace); the incremental
JSON reading behind it is `tool_stream.py`. Text a stream holds back (a prefix of a marker,
an answer that may still turn out to be a call) is released at `finish`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from helixserve.api.tool_stream import (
    ARG_KEYS,
    CallEmitter,
    ParsedOutput,
    StreamStep,
    ToolCall,
    held_prefix,
)

#: values of `--tool-call-parser`: auto = by the chat template (`parser_for_template`)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3", "mistral")


class ToolStream(Protocol):
    def feed(self, text: str) -> StreamStep: ...

    def finish(self) -> StreamStep: ...

    @property
    def num_calls(self) -> int: ...


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedOutput: ...

    def stream(self) -> ToolStream: ...


# ---- whole outputs ----------------------------------------------------------------------


def call_from_json(obj: Any) -> ToolCall | None:
    """A call from a decoded JSON value, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = next((obj[k] for k in ARG_KEYS if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_values(text: str, separators: str) -> list[Any] | None:
    """The JSON values of `text`, one after another, separated by whitespace or any of
    `separators`; None if anything else is there."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def calls_from_values(values: list[Any] | None) -> list[ToolCall] | None:
    if not values:
        return None
    items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    calls = [call_from_json(v) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]

# ---- hermes -----------------------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


class HermesParser:
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = 0
        for m in _HERMES_BLOCK.finditer(text):
            values = json_values(m.group(1), "")
            call = call_from_json(values[0]) if values and len(values) == 1 else None
            kept.append(text[last:m.start()] if call else text[last:m.end()])
            last = m.end()
            if call:
                calls.append(call)
        kept.append(text[last:])
        content = "".join(kept)
        if calls:
            content = content.strip()
        return ParsedOutput(content or None, calls)

    def stream(self) -> ToolStream:
        return _HermesStream()


class _HermesStream:
    def __init__(self) -> None:
        self._buf = ""
        self._block: CallEmitter | None = None
        self._calls = 0
        self._held_space = ""

    @property
    def num_calls(self) -> int:
        return self._calls + (self._block.announced if self._block else 0)

    def _content(self, text: str) -> str:
        # after a call, whitespace between blocks is not content unless text follows it
        if not self._calls:
            return text
        text, self._held_space = self._held_space + text, ""
        if not text.strip():
            self._held_space = text
            return ""
        return text

    def _close_block(self, step: StreamStep) -> None:
        block = self._block
        assert block is not None
        if not block.announced:
            step.content += self._content(_OPEN + block.scanner.text + _CLOSE)
        self._calls += block.announced
        self._block = None

    def feed(self, text: str) -> StreamStep:
        self._buf += text
        step = StreamStep()
        while True:
            if self._block is None:
                i = self._buf.find(_OPEN)
                if i < 0:
                    keep = held_prefix(self._buf, _OPEN)
                    step.content += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return step
                step.content += self._content(self._buf[:i])
                self._buf = self._buf[i + len(_OPEN):]
                self._block = CallEmitter(1, self._calls)
                continue
            j = self._buf.find(_CLOSE)
            if j < 0:
                keep = held_prefix(self._buf, _CLOSE)
                step.calls += self._block.feed(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return step
            step.calls += self._block.feed(self._buf[:j])
            self._buf = self._buf[j + len(_CLOSE):]
            self._close_block(step)

    def finish(self) -> StreamStep:
        step = StreamStep()
        if self._block is None:
            step.content += self._content(self._buf)
        else:
            step.calls += self._block.feed(self._buf)
            block = self._block
            if not block.announced:
                step.content += self._content(_OPEN + block.scanner.text)
            self._calls += block.announced
            self._block = None
        self._buf = ""
        return step


# ---- answers that are all calls (llama3, mistral, forced) ---------------------------------


class CallsOrContentStream:
    """An answer that is either calls or content, decided by how it begins: calls if it opens
    with one of `starts` (after an optional `skip` tag), and (mistral) everything after
    `marker`, wherever it comes. Calls that never name a call are released as content."""

    def __init__(self, marker: str | None, starts: tuple[str, ...], skip: str = "") -> None:
        self._marker, self._starts, self._skip = marker, starts, skip
        self._buf = ""  # text not yet decided
        self._began = False  # content was sent: a start no longer makes calls
        self._emitter: CallEmitter | None = None
        self._pending = ""  # calls text before its first non-space character
        self._held = ""  # all text taken as calls, released if no call came of it
        self._calls_mode = False

    @property
    def num_calls(self) -> int:
        return self._emitter.announced if self._emitter else 0

    def _calls(self, text: str, step: StreamStep) -> None:
        self._held += text
        if self._emitter is None:
            self._pending += text
            body = self._pending.lstrip()
            if not body:
                return
            self._emitter = CallEmitter(2 if body[0] == "[" else 1, 0)
            text = body
        step.calls += self._emitter.feed(text)

    def feed(self, text: str) -> StreamStep:
        step = StreamStep()
        if self._calls_mode:
            self._calls(text, step)
            return step
        self._buf += text
        if self._marker is not None and self._marker in self._buf:
            i = self._buf.index(self._marker)
            step.content += self._buf[:i]
            rest, self._buf = self._buf[i + len(self._marker):], ""
            self._calls_mode = True
            self._held = self._marker
            self._calls(rest, step)
            return step
        if not self._began:
            body = self._buf.lstrip()
            if self._skip and body.startswith(self._skip):
                body = body[len(self._skip):].lstrip()
            elif self._skip.startswith(body):
                return step  # empty so far, or the tag may be arriving
            if not body:
                return step
            if body.startswith(self._starts):
                self._calls_mode = True
                self._held, self._buf = self._buf[:len(self._buf) - len(body)], ""
                self._calls(body, step)
                return step
            if any(s.startswith(body) for s in self._starts):
                return step
            self._began = True
        keep = held_prefix(self._buf, self._marker) if self._marker else 0
        step.content += self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return step

    def finish(self) -> StreamStep:
        step = StreamStep()
        if self._calls_mode and not self.num_calls:
            step.content = self._held
        elif not self._calls_mode:
            step.content = self._buf
        self._buf = ""
        return step


class Llama3Parser:
    name = "llama3"
    _TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG):]
        calls = calls_from_values(json_values(body, ";")) if body.lstrip()[:1] == "{" else None
        return ParsedOutput(None, calls) if calls else ParsedOutput(text or None, [])

    def stream(self) -> ToolStream:
        return CallsOrContentStream(None, ("{",), skip=self._TAG)


class MistralParser:
    name = "mistral"
    _MARK = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedOutput:
        i = text.find(self._MARK)
        head, body = (text[:i], text[i + len(self._MARK):]) if i >= 0 else ("", text)
        if i < 0 and not body.lstrip().startswith("[{"):
            return ParsedOutput(text or None, [])
        calls = calls_from_values(json_values(body, ""))
        if not calls:
            return ParsedOutput(text or None, [])
        return ParsedOutput(head.strip() or None, calls)

    def stream(self) -> ToolStream:
        return CallsOrContentStream(self._MARK, ("[{",))


PARSERS: dict[str, type[HermesParser] | type[Llama3Parser] | type[MistralParser]] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]()


def parser_for_template(template: str | None) -> str:
    """The family a chat template writes tool calls in; hermes when it says nothing (the
    fallback rendering, `tools.render`, asks for hermes blocks)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "ipython" in text):
        return "llama3"
    return "hermes"
