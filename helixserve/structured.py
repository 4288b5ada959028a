"""Structured output: a `StructuredOutput` (JSON schema, JSON object, regex, choice, Lark
grammar) compiled to llguidance's grammar text, and checked, without torch or a tokenizer.

The API process calls `grammar_of` while it builds a request (off the event loop), so a bad
schema or regex is a 400 naming the field before any work; the last stage of every route calls
it again for the same spec and builds its token matcher from the result
(`engine/structured.py`). Both hit one LRU cache per process, keyed by (kind, spec).

JSON is compact: no whitespace between tokens (llguidance's `whitespace_flexible` off), so a
small model cannot spend its token budget on newlines and indentation inside the object; the
output parses the same. llguidance is imported on first use: processes that never see a
structured request never load it.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from helixserve.errors import UserError
from helixserve.request import STRUCTURED_KINDS, StructuredOutput

#: longest spec (schema, regex, grammar text) accepted; llguidance bounds the work per spec
#: too (grammar size, lexer states), this bounds what a request carries to every hop
MAX_SPEC_CHARS = 100_000
#: compiled grammars kept per process
CACHE_SIZE = 256

#: the field a kind's spec comes from when the caller names none (errors say it)
_DEFAULT_FIELD = {"json": "json_schema", "json_object": "response_format", "regex": "regex",
                  "choice": "choice", "lark": "grammar"}


def grammar_of(so: StructuredOutput, field: str | None = None) -> str:
    """llguidance grammar text of `so`. Raises UserError naming `field` (the request field
    the spec came from; by default the kind's) when the spec is not a valid schema, regex,
    choice list or grammar. Cached per (kind, spec)."""
    name = field or _DEFAULT_FIELD.get(so.kind, "structured")
    if so.kind not in STRUCTURED_KINDS:
        raise UserError(f"{name}: unknown structured output kind {so.kind!r}; known: "
                        f"{', '.join(STRUCTURED_KINDS)}")
    if len(so.spec) > MAX_SPEC_CHARS:
        raise UserError(f"{name}: {len(so.spec):,} characters; at most {MAX_SPEC_CHARS:,}")
    try:
        return _compiled(so.kind, so.spec)
    except _SpecError as exc:
        raise UserError(f"{name}: {exc}") from None


class _SpecError(ValueError):
    """The spec is bad; the message says why (without the field, which the caller adds)."""


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compiled(kind: str, spec: str) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    if kind == "json":
        schema = _json(spec, "the schema")
        if not isinstance(schema, dict):
            raise _SpecError(f"the schema must be a JSON object, got {type(schema).__name__}")
        try:
            grammar = _json_grammar(schema)
        except (ValueError, TypeError) as exc:
            raise _SpecError(f"invalid JSON schema: {exc}") from None
    elif kind == "json_object":
        grammar = _json_grammar({"type": "object"})
    elif kind == "regex":
        if not spec:
            raise _SpecError("the regex is empty")
        grammar = matcher.grammar_from_regex(spec)
    elif kind == "choice":
        choices = _json(spec, "the choices")
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise _SpecError("need a non-empty list of strings")
        grammar = matcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    else:  # lark (or llama.cpp's GBNF, converted the way vLLM's guided_grammar takes it)
        if not spec.strip():
            raise _SpecError("the grammar is empty")
        try:
            grammar = llguidance.grammar_from("grammar", spec)
        except ValueError as exc:
            raise _SpecError(f"invalid grammar: {exc}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        what = {"json": "invalid JSON schema", "regex": "invalid regex"}.get(kind, "invalid grammar")
        raise _SpecError(f"{what}: {error.strip()}")
    return grammar


def _json_grammar(schema: dict[str, Any]) -> str:
    """Compact JSON (module doc): no whitespace between tokens."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})


def _json(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as exc:
        raise _SpecError(f"{what} is not valid JSON: {exc}") from None
