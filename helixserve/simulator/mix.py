"""The `--workload` value of `plan`, `evaluate` and `simulate`: which request mix a unit of
max flow stands for (costmodel/workload.py).

    decode         Helix's decode-only flow: prompts cost nothing (no requests/s); the
                   default, because planning for the conversation mix was measured to serve
                   the conversation trace worse in the simulator (docs/workload.md)
    conversation   the Azure conversation mix (r = 3.28)
    P:O            mean prompt and output tokens, e.g. 2000:30 (prefill-heavy)
    TRACE.csv      an Azure-format trace: the means of its requests after the simulator's
                   default length filter (Helix's), so the plan's mix is the one
                   `simulate --trace TRACE.csv` replays
"""

from __future__ import annotations

import math
from pathlib import Path

from helixserve.costmodel.workload import Workload
from helixserve.errors import UserError
from helixserve.simulator.workload import LengthFilter, load_azure_trace, prepare_trace

#: the names `--workload` knows besides a P:O pair and a file
NAMED = ("decode", "conversation")
DEFAULT_WORKLOAD = "decode"


def parse_workload(text: str, flag: str = "--workload") -> Workload | None:
    """The workload `text` names (None: decode-only). UserError naming the flag and value,
    or the trace file and its bad line."""
    value = text.strip()
    if value == "decode":
        return None
    if value == "conversation":
        return Workload.conversation()
    if ":" in value and not Path(value).exists():
        return _pair(value, flag)
    path = Path(value)
    if not path.exists():
        raise UserError(f"{flag}: bad value {text!r}; need {', '.join(NAMED)}, a pair "
                        f"PROMPT:OUTPUT of mean tokens (e.g. 2000:30) or a trace CSV "
                        f"(no file {value!r})")
    try:
        requests = prepare_trace(load_azure_trace(path), lengths=LengthFilter())
    except UserError as exc:
        raise UserError(f"{flag}: {exc}") from None
    return Workload.from_lengths([r.prompt_tokens for r in requests],
                                 [r.output_tokens for r in requests], source=path.name)


def _pair(value: str, flag: str) -> Workload:
    """'P:O' -> Workload(P, O)."""
    parts = value.split(":")
    numbers: list[float] = []
    for part, field in zip(parts, ("prompt", "output"), strict=False):
        try:
            number = float(part)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise UserError(f"{flag}: bad value {value!r}: {field} tokens {part!r} is not a "
                            f"number; need PROMPT:OUTPUT mean tokens, e.g. 2000:30")
        numbers.append(number)
    if len(parts) != 2:
        raise UserError(f"{flag}: bad value {value!r}; need PROMPT:OUTPUT mean tokens, "
                        f"e.g. 2000:30")
    prompt, output = numbers
    if prompt < 0 or output <= 0:
        raise UserError(f"{flag}: bad value {value!r}; need prompt >= 0 and output > 0 tokens")
    return Workload(prompt, output, f"{value}")
