"""Tool calling on /v1/chat/completions: what the model is offered, how the prompt shows it,
how the output is held to it, and what the client gets back.

One request's decisions are a `ToolPlan` (`plan_tools`), made once from the body, the chat
template and the server's `--tool-call-parser`:
- `tool_choice` "none" (or no tools): nothing offered, nothing parsed;
- "auto" (the default with tools): tools in the prompt, free generation, then the model
  family's parser (`tool_parsers.py`) splits the output into content and calls;
- "required" and a named function: the grammar holds the output to the call(s), so it always
  parses: a named function's output is its arguments object (the parameters schema), a
  required call's a JSON array of `{"name", "arguments"}` objects, one per call (one at most
  with `parallel_tool_calls` false). The plan's `structured` goes in the request's
  `SamplingParams.structured`; the last stage's sampler enforces it.

Rendering (`chat_template_inputs`): a template that references `tools` renders them itself
(`apply_chat_template(..., tools=...)`, arguments of earlier calls as objects, as HF templates
take them). Any other template (SmolLM2's) gets the standard Hermes fallback: a system block
listing the tools in `<tools>` and asking for `<tool_call>` blocks, earlier calls written as
such blocks in the assistant's text and tool results as a user turn of `<tool_response>`
blocks, so the template sees only the roles it knows.

Answers: `message.tool_calls` with `call_...` ids and finish_reason "tool_calls" (when the
model stopped by itself); streams send OpenAI's `tool_calls` deltas (`ChoiceToolStream`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from helixserve.api.errors import APIError
from helixserve.api.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallsOrContentStream,
    ToolStream,
    calls_from_values,
    get_parser,
    json_values,
    parser_for_template,
)
from helixserve.api.tool_stream import CallDelta, ParsedOutput, StreamStep, ToolCall, new_call_id
from helixserve.request import StructuredOutput

if TYPE_CHECKING:
    from helixserve.api.protocol import ChatCompletionRequest, ChatMessage
    from helixserve.api.serving import Batch

_MENTIONS_TOOLS = re.compile(r"\btools\b")

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_text(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if template is None or isinstance(template, str):
        return template
    return json.dumps(template)  # named templates (a dict): searched as one text


def template_knows_tools(template: str | None) -> bool:
    return bool(template and _MENTIONS_TOOLS.search(template))


# ---- the plan ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "required", "named"]
    #: the tools as OpenAI dicts, as the prompt shows them
    tools: tuple[dict[str, Any], ...]
    #: the parser family of free (auto) output
    parser: str
    named: str | None
    parallel: bool
    #: the grammar of a required or named call; None for auto
    structured: StructuredOutput | None
    #: the field a bad grammar is the fault of (its parameters schema), for the 400
    structured_param: str | None = None

    def parse(self, text: str) -> ParsedOutput:
        if self.mode == "named":
            values = json_values(text, "")
            if values and len(values) == 1 and isinstance(values[0], dict):
                args = json.dumps(values[0], ensure_ascii=False)
                return ParsedOutput(None, [ToolCall(str(self.named), args)])
            return ParsedOutput(text or None, [])
        if self.mode == "required":
            calls = calls_from_values(json_values(text, ""))
            return ParsedOutput(None, calls) if calls else ParsedOutput(text or None, [])
        return get_parser(self.parser).parse(text)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed message of a choice and its finish reason."""
        out = self.parse(text)
        calls = out.calls if self.parallel else out.calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, _finish(finish_reason, bool(calls))

    def stream(self) -> ChoiceToolStream:
        inner: ToolStream
        if self.mode == "named":
            inner = _NamedStream(str(self.named))
        elif self.mode == "required":
            inner = CallsOrContentStream(None, ("[", "{"))
        else:
            inner = get_parser(self.parser).stream()
        return ChoiceToolStream(inner, self.parallel)


def _finish(reason: str | None, has_calls: bool) -> str | None:
    # a model that stopped after its calls: "tool_calls"; cut by max_tokens stays "length"
    return "tool_calls" if has_calls and reason == "stop" else reason


def plan_tools(body: ChatCompletionRequest, template: str | None,
               parser: str = "auto") -> ToolPlan | None:
    """The request's tool plan; None when no tools are offered (none, or no tools)."""
    if not body.tools or body.tool_choice == "none":
        return None
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {parser!r}; known: "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools)
    family = parser_for_template(template) if parser == "auto" else parser
    parallel = body.parallel_tool_calls is not False
    named = body.named_tool()
    if named is not None:
        i = next(i for i, t in enumerate(body.tools) if t.function.name == named)
        schema = _arguments_schema(body.tools[i].function.parameters)
        return ToolPlan("named", tools, family, named, parallel,
                        StructuredOutput("json", json.dumps(schema)),
                        f"tools.{i}.function.parameters")
    if body.tool_choice == "required":
        return ToolPlan("required", tools, family, None, parallel,
                        StructuredOutput("json", json.dumps(calls_schema(body, parallel))),
                        "tools")
    return ToolPlan("auto", tools, family, None, parallel, None)


def _arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


def calls_schema(body: ChatCompletionRequest, parallel: bool) -> dict[str, Any]:
    """JSON Schema of a required answer: an array of calls of the given tools."""
    one_of_each = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": _arguments_schema(t.function.parameters),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in body.tools or []
    ]
    item = one_of_each[0] if len(one_of_each) == 1 else {"anyOf": one_of_each}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def enforce(plan: ToolPlan | None, batch: Batch) -> None:
    """Give every choice of a required or named tool choice the plan's grammar."""
    if plan is None or plan.structured is None:
        return
    for c in batch.choices:
        if getattr(c.request.sampling, "structured", None) is not None:
            raise APIError(400, "tool_choice: a required or named tool choice holds the output "
                           "to the call, so it cannot be combined with response_format or "
                           "guided decoding", param="tool_choice", code="invalid_parameter")
        c.request.sampling = dataclasses.replace(c.request.sampling, structured=plan.structured)


# ---- rendering --------------------------------------------------------------------------


def chat_template_inputs(
    body: ChatCompletionRequest, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the chat template, and the tools to pass it (None: not passed, either
    none are offered or the fallback block in the system message shows them)."""
    offered = body.tools if body.tools and body.tool_choice != "none" else []
    tools = [t.model_dump(exclude_none=True) for t in offered]
    if template_knows_tools(template):
        return [_native_message(m) for m in body.messages], tools or None
    messages = _fallback_messages(body.messages)
    if tools:
        block = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + block}
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages, None


def _role(m: ChatMessage) -> str:
    # chat templates of small open models know system/user/assistant(/tool) only
    return "system" if m.role == "developer" else m.role


def _native_message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(m), "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
            for c in m.tool_calls
        ]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


def _fallback_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block  # results of one turn's calls together
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        text = m.text()
        for c in m.tool_calls or []:
            call = {"name": c.function.name, "arguments": json.loads(c.function.arguments)}
            text += ("\n" if text else "") + f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        out.append({"role": _role(m), "content": text})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


# ---- streaming --------------------------------------------------------------------------


class _NamedStream:
    """A named call's output is its arguments object: announced at the first character."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    @property
    def num_calls(self) -> int:
        return int(self._started)

    def feed(self, text: str) -> StreamStep:
        step = StreamStep()
        if not self._started:
            text = text.lstrip()
            if not text:
                return step
            self._started = True
            step.calls.append(CallDelta(0, new_call_id(), self._name))
        step.calls.append(CallDelta(0, arguments=text))
        return step

    def finish(self) -> StreamStep:
        return StreamStep()


class ChoiceToolStream:
    """One streamed choice: each token's text in, the OpenAI delta and finish reason out."""

    def __init__(self, inner: ToolStream, parallel: bool) -> None:
        self._inner = inner
        self._parallel = parallel

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        step = self._inner.feed(text) if text else StreamStep()
        if finish_reason is not None:
            step += self._inner.finish()
        calls = [d for d in step.calls if self._parallel or d.index == 0]
        out: dict[str, Any] = {}
        if step.content:
            out["content"] = step.content
        if calls:
            out["tool_calls"] = [d.to_openai() for d in calls]
        return out, _finish(finish_reason, self._inner.num_calls > 0)
