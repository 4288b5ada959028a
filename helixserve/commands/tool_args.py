"""The tool-calling flag of `serve` and `demo`: which model family's format tool calls are
read in (helixserve/api/tool_parsers.py; docs/tool-calls.md).

Standard library only at module level, as every command module (the parser module it names
the choices of is standard library only too).
"""

from __future__ import annotations

import argparse
from typing import Any

from helixserve.api.tool_parsers import TOOL_CALL_PARSERS


def add_tool_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
        help="how tool calls are read from the model's output: hermes (<tool_call> JSON; "
             "Qwen2, SmolLM), llama3 (JSON), mistral ([TOOL_CALLS]); auto (default) picks by "
             "the chat template, hermes when it shows none",
    )


def tool_options(args: argparse.Namespace) -> dict[str, Any]:
    """The API's keyword arguments from the flag (`create_app(..., **tool_options(args))`)."""
    return {"tool_call_parser": args.tool_call_parser}
