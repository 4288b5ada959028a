"""schemathesis hooks for benchmarks/api_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

A request without max_tokens (or with null) is served up to the context length, minutes on
the demo's CPU workers; the fuzzer gives such requests max_tokens = 8 so runs finish. Only
the fuzzer's requests change: the API's own defaults stay."""

from __future__ import annotations

from typing import Any

import schemathesis

FUZZ_MAX_TOKENS = 8


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    for body in (kwargs.get("json"), case.body):
        if (isinstance(body, dict) and body.get("max_tokens") is None
                and body.get("max_completion_tokens") is None):
            body["max_tokens"] = FUZZ_MAX_TOKENS
