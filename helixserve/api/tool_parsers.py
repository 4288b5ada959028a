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
gives them re-serialized, `json.dumps`: the same object, other whitespace). `_CallScanner` is
the incremental JSON reader behind it: it follows nesting and strings character by character
and records where each call's name and arguments are in the text. Text it holds back (a
prefix of a marker, an answer that may still turn out to be a call) is released at `finish`.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

#: values of `--tool-call-parser`: auto = by the chat template (`parser_for_template`)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3", "mistral")
#: keys of a call's arguments object, as the families name it
ARG_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    """An id in OpenAI's form: `call_` and 24 letters and digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    #: a JSON object as text (OpenAI's `function.arguments`)
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    """A whole output split into content (None if there is none) and tool calls."""

    content: str | None
    calls: list[ToolCall]


@dataclass
class CallDelta:
    """A piece of a streamed call: the first of each call has its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass
class StreamStep:
    """What one piece of generated text adds: content and call deltas."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: StreamStep) -> StreamStep:
        self.content += other.content
        self.calls.extend(other.calls)
        return self


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


# ---- the incremental reader -------------------------------------------------------------


@dataclass
class _RawCall:
    name: str | None = None
    #: offsets of the arguments value in the scanned text (end -1 while it is open)
    args_start: int = -1
    args_end: int = -1
    args_is_str: bool = False
    closed: bool = False


class _CallScanner:
    """Reads JSON text as it arrives and records the call objects at nesting `level`
    (1: objects one after another; 2: objects inside an array): where each one's name and
    arguments are. Only the members of the call objects are read; values are skipped by
    nesting depth, strings by their quotes and escapes."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.text = ""
        self.calls: list[_RawCall] = []
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._str_start = 0
        self._str_role = ""  # "key" | "value" | "" (inside a skipped value)
        self._key = ""
        #: at the call level: "key", "colon", "value", "in-value", "comma"
        self._expect = "key"
        self._value_start = -1
        self._value_kind = ""  # "str" | "nested" | "prim"
        self._value_key = ""

    def _in_call(self) -> bool:
        return self._depth == self.level and bool(self.calls) and not self.calls[-1].closed

    def feed(self, text: str) -> None:
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._step(i, self.text[i])

    def _start_value(self, i: int, kind: str) -> None:
        self._value_start, self._value_kind, self._value_key = i, kind, self._key
        self._expect = "in-value"
        call = self.calls[-1]
        if self._key in ARG_KEYS and call.args_start < 0:
            call.args_start, call.args_is_str = i, kind == "str"

    def _end_value(self, end: int) -> None:
        call = self.calls[-1]
        raw = self.text[self._value_start:end].rstrip()
        if self._value_key == "name" and self._value_kind == "str" and call.name is None:
            with contextlib.suppress(ValueError):
                call.name = json.loads(raw)
        if self._value_key in ARG_KEYS and call.args_start == self._value_start:
            call.args_end = self._value_start + len(raw)
        self._expect, self._value_kind = "comma", ""

    def _step(self, i: int, c: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._str_role == "key":
                    try:
                        self._key = json.loads(self.text[self._str_start:i + 1])
                    except ValueError:
                        self._key = ""
                    self._expect = "colon"
                elif self._str_role == "value":
                    self._end_value(i + 1)
            return
        if c == '"':
            self._in_str, self._str_start, self._str_role = True, i, ""
            if self._in_call():
                if self._expect == "key":
                    self._str_role = "key"
                elif self._expect == "value":
                    self._str_role = "value"
                    self._start_value(i, "str")
            return
        if c in "{[":
            if self._in_call() and self._expect == "value":
                self._start_value(i, "nested")
            self._depth += 1
            if self._depth == self.level and c == "{":
                self.calls.append(_RawCall())
                self._expect = "key"
            return
        if c in "}]":
            if self._in_call() and self._value_kind == "prim":
                self._end_value(i)
            in_call = self._in_call()
            self._depth = max(0, self._depth - 1)
            if in_call and c == "}":
                self.calls[-1].closed = True
            elif self._in_call() and self._value_kind == "nested":
                self._end_value(i + 1)
            return
        if not self._in_call():
            return
        if c == ":" and self._expect == "colon":
            self._expect = "value"
        elif c == ",":
            if self._value_kind == "prim":
                self._end_value(i)
            self._expect = "key"
        elif not c.isspace() and self._expect == "value":
            self._start_value(i, "prim")


class _CallEmitter:
    """Call deltas from a `_CallScanner`, in order: a call is announced once its name is
    read, its arguments follow as they arrive (an arguments string once it is complete)."""

    def __init__(self, level: int, first_index: int) -> None:
        self.scanner = _CallScanner(level)
        self.first_index = first_index
        self._sent: list[int] = []  # characters of arguments sent, per announced call

    @property
    def announced(self) -> int:
        return len(self._sent)

    def feed(self, text: str) -> list[CallDelta]:
        self.scanner.feed(text)
        return self._deltas()

    def _deltas(self) -> list[CallDelta]:
        out: list[CallDelta] = []
        text = self.scanner.text
        for k, call in enumerate(self.scanner.calls):
            if k == len(self._sent):
                # announced once its name is read and its arguments begin as an object (or a
                # string holding one), or it ended without them: not before, so that a call
                # whose arguments are a list or a number stays content
                if call.name is None:
                    break
                if call.args_start >= 0 and text[call.args_start] not in '{"':
                    break
                if call.args_start < 0 and not call.closed:
                    break
                self._sent.append(0)
                out.append(CallDelta(self.first_index + k, new_call_id(), call.name))
            piece = ""
            if call.args_start >= 0 and call.args_is_str:
                if call.args_end >= 0 and self._sent[k] == 0:
                    try:
                        decoded = json.loads(text[call.args_start:call.args_end])
                    except ValueError:
                        decoded = None
                    piece = decoded if isinstance(decoded, str) else ""
                    self._sent[k] = max(1, len(piece))
            elif call.args_start >= 0:
                end = call.args_end if call.args_end >= 0 else len(text)
                piece = text[call.args_start + self._sent[k]:end]
                self._sent[k] += len(piece)
            elif call.closed and self._sent[k] == 0:
                piece, self._sent[k] = "{}", 2
            if piece:
                out.append(CallDelta(self.first_index + k, arguments=piece))
        return out


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: the marker may be
    arriving)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


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
        self._block: _CallEmitter | None = None
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
                    keep = _held_prefix(self._buf, _OPEN)
                    step.content += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return step
                step.content += self._content(self._buf[:i])
                self._buf = self._buf[i + len(_OPEN):]
                self._block = _CallEmitter(1, self._calls)
                continue
            j = self._buf.find(_CLOSE)
            if j < 0:
                keep = _held_prefix(self._buf, _CLOSE)
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
        self._emitter: _CallEmitter | None = None
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
            self._emitter = _CallEmitter(2 if body[0] == "[" else 1, 0)
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
        keep = _held_prefix(self._buf, self._marker) if self._marker else 0
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
