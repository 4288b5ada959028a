"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Bounds live on the fields, so a bad value is rejected before any work with a 400 naming the
parameter (the app maps pydantic's errors to the OpenAI error JSON, not FastAPI's 422).
Unknown fields are ignored, as OpenAI's and vLLM's servers do, except the ones that would
change what comes back if we honoured them (legacy functions, best_of): those are
rejected with a 400 naming the field, never silently dropped. Structured output
(docs/structured-output.md) is asked for in any one of OpenAI's and vLLM's ways:
`response_format` (json_object, json_schema), vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, or its newer `structured_outputs` object; more than one
is a 400 naming the second. Tool calls: docs/tool-calls.md. Types are strict, as OpenAI's
are: `"n": "2"` or `"max_tokens": true` is a 400, not 2 or 1. Text must be valid UTF-8 (JSON
can spell a lone surrogate, `"\\ud800"`, which no tokenizer takes), token ids fit the
int32 the workers' protocol carries, seeds an int64. A check across fields raises
`ParamError`, which names the parameter it is about. Field names and meanings are
OpenAI's; `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens` and
`stop_token_ids` are vLLM's extensions with vLLM's meanings.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from helixserve.request import MAX_LOGPROBS, StructuredOutput

#: most choices per request (n), as vLLM's default
MAX_N = 16
#: bounded work per request (each is checked before any tokenizing): prompts in one
#: completion request, choices in all (prompts x n; every choice is a request the coordinator
#: queues, at most `max_queue`), logit_bias entries (OpenAI's limit; the bias travels with
#: every item of the request on every hop), and token ids one /detokenize decodes
MAX_PROMPTS = 128
MAX_CHOICES = 128
MAX_LOGIT_BIAS = 300
MAX_DETOKENIZE_TOKENS = 65_536
#: most choices in guided_choice / structured_outputs.choice
MAX_GUIDED_CHOICES = 1024
#: most tools per request (OpenAI's limit); the values tool_choice takes as a string
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")
#: most stop strings per request (OpenAI allows 4, vLLM any number; each costs a check per token)
MAX_STOP = 16
#: token ids and top_k travel as int32 to the workers, seeds as int64
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_TOKEN_ID_KEY = re.compile(r"\s*[0-9]+\s*")


class ParamError(ValueError):
    """A bad value found by a check across fields: `param` is the field the client must fix."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(
            f"not valid UTF-8 text: lone surrogate U+{ord(bad):04X} at character {exc.start}"
        ) from None
    return text


#: a string that can be encoded (and so tokenized)
Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def _reject(what: str, hint: str) -> ValueError:
    return ValueError(f"{what} is not supported by this server; {hint}")


_CONFIG = ConfigDict(extra="ignore", strict=True)


class _Body(BaseModel):
    """A request object: JSON null for any field means "not given", as OpenAI takes it
    (`"n": null` is n = 1, `"stream": null` is no streaming)."""

    model_config = _CONFIG

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`."""

    #: OpenAI requires a name; it names nothing here, so it may be left out
    name: Text = ""
    description: Text | None = None
    #: the schema (`schema` in JSON; pydantic's BaseModel has a `schema` method of its own)
    json_schema: dict[str, Any] = Field(alias="schema")
    #: OpenAI's strict mode: the output always follows the schema; here it always does
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ParamError("response_format.json_schema",
                             'required when type is "json_schema"')
        return self


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (its newer name for the guided_* fields): one of them."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    #: vLLM's tag-triggered grammars: not supported, refused rather than dropped
    structural_tag: Any = None

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, v: Any) -> Any:
        if v is not None:
            raise _reject("structural_tag", "use json, regex, choice or grammar")
        return v


def _json_text(value: dict[str, Any] | list[str] | str) -> str:
    """A schema or choice list as the text a StructuredOutput carries (given text as is)."""
    return value if isinstance(value, str) else json.dumps(value)


class SamplingFields(_Body):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    #: -1 or 0 disables top-k (vLLM's convention)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    #: choice k of n draws with seed + k (mod 2**63)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    #: token id (a string key in JSON) -> value added to its logit before sampling
    logit_bias: dict[str, float] | None = None
    #: structured output (module doc): at most one of these
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1,
                                               max_length=MAX_GUIDED_CHOICES)] | None = None
    guided_grammar: Text | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        for key, value in (v or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > INT32_MAX:
                raise ValueError(f"key {key!r} is not a token id")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias {value} for token {key} is outside -100..100")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_structured_output(self) -> SamplingFields:
        self.structured_output()
        return self

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The constraint asked for and the field it came from (errors name it); None = free
        text. Raises ParamError naming the second field when more than one is given."""
        rf, so = self.response_format, self.structured_outputs
        schema = rf.json_schema if rf is not None and rf.type == "json_schema" else None
        # (kind, whether asked, the spec, the field), in the order a conflict names them
        ways: list[tuple[str, bool, Any, str]] = [
            ("json_object", rf is not None and rf.type == "json_object", "", "response_format"),
            ("json", schema is not None, None if schema is None else schema.json_schema,
             "response_format.json_schema.schema"),
            ("json", self.guided_json is not None, self.guided_json, "guided_json"),
            ("regex", self.guided_regex is not None, self.guided_regex, "guided_regex"),
            ("choice", self.guided_choice is not None, self.guided_choice, "guided_choice"),
            ("lark", self.guided_grammar is not None, self.guided_grammar, "guided_grammar"),
        ]
        if so is not None:
            ways += [
                ("json", so.json_ is not None, so.json_, "structured_outputs.json"),
                ("regex", so.regex is not None, so.regex, "structured_outputs.regex"),
                ("choice", so.choice is not None, so.choice, "structured_outputs.choice"),
                ("lark", so.grammar is not None, so.grammar, "structured_outputs.grammar"),
                ("json_object", bool(so.json_object), "", "structured_outputs.json_object"),
            ]
        found = [(StructuredOutput(kind, _json_text(spec) if kind in ("json", "choice") else spec),
                  name) for kind, asked, spec, name in ways if asked]
        if len(found) > 1:
            raise ParamError(found[1][1], f"only one structured output per request; "
                             f"{found[0][1]} is given too")
        return found[0] if found else None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))


class CompletionRequest(SamplingFields):
    #: text, token ids, or a batch of either (each prompt gets n choices), at most MAX_PROMPTS
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    #: number of top logprobs per token (0 = only the sampled token's)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v > 1:
            raise _reject("best_of > 1", "ask for n choices and rank them by their logprobs")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 0:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and any(isinstance(p, list) and len(p) == 0 for p in v):
            raise ValueError("prompt must not contain an empty token list")
        if isinstance(v, list) and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    def num_prompts(self) -> int:
        p = self.prompt
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return 1
        return len(p)

    @model_validator(mode="after")
    def _choices_bounded(self) -> CompletionRequest:
        total = self.num_prompts() * self.n
        if total > MAX_CHOICES:
            raise ParamError("n", f"{self.num_prompts()} prompts x n={self.n} is {total} "
                             f"choices; at most {MAX_CHOICES} per request")
        return self


# ---- tool calling (the logic is helixserve/api/tools.py) ---------------------------------

#: a function name as OpenAI allows it
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    #: JSON Schema of the arguments: an object schema; absent or {} = no arguments
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (v or {}).get("type", "object")
        if kind != "object":
            raise ValueError(f'must be a JSON Schema of type "object", got type {kind!r}')
        props = (v or {}).get("properties", {})
        if not isinstance(props, dict):
            raise ValueError("properties must be an object mapping names to schemas")
        return v


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(_Body):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    #: the arguments as a JSON object in text, as the model wrote them
    arguments: Text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            value = json.loads(v)
        except ValueError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object, got {type(value).__name__}")
        return v


class AssistantToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    #: a string, or OpenAI content parts (only `text` parts are supported)
    content: Text | Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    name: Text | None = None
    #: calls an assistant message made (history)
    tool_calls: list[AssistantToolCall] | None = None
    #: which call a `tool` message answers
    tool_call_id: Text | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else []:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"unsupported content part type {part.get('type')!r}; known: text")
            _utf8(part["text"])
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    #: OpenAI's newer name for max_tokens; wins when both are given
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    #: the functions the model may call (helixserve/api/tools.py)
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    #: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}};
    #: unset = "auto" with tools, "none" without
    tool_choice: str | dict[str, Any] | None = None
    #: whether the model may make several calls in one answer (default true)
    parallel_tool_calls: bool | None = None
    #: the legacy function calling is not supported: rejected, never ignored
    functions: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, v: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
        seen: set[str] = set()
        for tool in v or []:
            if tool.function.name in seen:
                raise ValueError(f"function name {tool.function.name!r} is given twice")
            seen.add(tool.function.name)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_form(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(v, str) and v not in TOOL_CHOICES:
            raise ValueError(f"unknown value {v!r}; known: {', '.join(TOOL_CHOICES)}, or "
                             '{"type": "function", "function": {"name": ...}}')
        if isinstance(v, dict):
            function = v.get("function")
            if (v.get("type") != "function" or not isinstance(function, dict)
                    or not isinstance(function.get("name"), str)):
                raise ValueError('a named choice is {"type": "function", "function": '
                                 f'{{"name": ...}}}}, got {json.dumps(v)[:120]}')
        return v

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice", "only allowed when tools are given")
        named = self.named_tool()
        names = [t.function.name for t in self.tools or []]
        if named is not None and named not in names:
            raise ParamError("tool_choice", f"names function {named!r}, which is not among "
                             f"the tools: {', '.join(names)}")
        return self

    @model_validator(mode="after")
    def _tool_messages_answer_calls(self) -> ChatCompletionRequest:
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise ParamError(f"messages.{i}.tool_calls",
                                 f"only assistant messages carry tool calls, not {m.role!r}")
            called.update(c.id for c in m.tool_calls or [])
            if m.role == "tool" and not m.tool_call_id:
                raise ParamError(f"messages.{i}.tool_call_id", "required in a message with "
                                 "role 'tool' (the id of the call it answers)")
            if m.role == "tool" and m.tool_call_id not in called:
                raise ParamError(f"messages.{i}.tool_call_id",
                                 f"{m.tool_call_id!r} answers no tool call of an earlier "
                                 "assistant message")
        return self

    def named_tool(self) -> str | None:
        """The function `tool_choice` names, if it names one."""
        if isinstance(self.tool_choice, dict):
            return str(self.tool_choice["function"]["name"])
        return None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise _reject("function calling", "leave functions out")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "requires logprobs to be true")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return _template_messages(self.messages)


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    # chat templates of small open models know system/user/assistant only
    return [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]


class TokenizeRequest(_Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    def template_messages(self) -> list[dict[str, str]]:
        return _template_messages(self.messages or [])

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]
