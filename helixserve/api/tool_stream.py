"""Tool calls read out of JSON text as it arrives (the streams of `tool_parsers.py`).

`CallScanner` follows the text character by character (nesting depth, strings and their
escapes) and records, for each call object at a given nesting level (1: objects one after
another; 2: objects inside an array), where its name and its arguments value are. Only the
call objects' own members are read; everything inside a value is skipped by depth.
`CallEmitter` turns what the scanner found into OpenAI-style call deltas: a call is announced
(index, id, name) once its name is read and its arguments have begun as an object (or a
string holding one), and its arguments then follow as raw JSON chunks as the model writes
them, so that a call whose arguments are a list or a number never becomes a call.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

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



@dataclass
class _RawCall:
    name: str | None = None
    #: offsets of the arguments value in the scanned text (end -1 while it is open)
    args_start: int = -1
    args_end: int = -1
    args_is_str: bool = False
    closed: bool = False


class CallScanner:
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


class CallEmitter:
    """Call deltas from a `_CallScanner`, in order: a call is announced once its name is
    read, its arguments follow as they arrive (an arguments string once it is complete)."""

    def __init__(self, level: int, first_index: int) -> None:
        self.scanner = CallScanner(level)
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


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: the marker may be
    arriving)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
