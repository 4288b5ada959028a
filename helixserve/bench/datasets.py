"""Benchmark requests from a dataset: the Azure LLM conversation trace, or random lengths.

The client sends text, not token ids (any OpenAI-compatible server takes text), so a prompt of
n tokens is built from n words that are single tokens in common BPE vocabularies (" the",
" cat", ...). The real prompt length is what the server reports in `usage`, and the report
uses those counts, not the requested ones. Output lengths are forced with `max_tokens` and
`ignore_eos`, as vLLM's benchmark does, so every request generates exactly its length.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

from helixserve.errors import UserError

DATASETS = ("azure-conv", "random")

# Short, frequent English words: one token each in GPT-2/Llama/SmolLM-style BPE vocabularies
# when preceded by a space.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her this had not are but "
    "they have one which you were all we she there been their has when who will more no if "
    "out so said what up its about into than them can only other new some time could these "
    "two may then do first any my now such like our over man me even most made after also "
    "did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    """One request of a benchmark run."""

    prompt: str
    #: tokens the prompt was built to have (the server's count is authoritative)
    prompt_tokens: int
    #: tokens the request must generate (sent as max_tokens with ignore_eos)
    output_tokens: int


def default_trace_path() -> Path:
    """examples/traces/azure-llm-conv-2023.csv of the repository (a clone: `pip install -e`)."""
    return Path(__file__).resolve().parents[2] / "examples" / "traces" / "azure-llm-conv-2023.csv"


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    """A prompt of about `num_tokens` tokens: random single-token words."""
    return "".join(" " + rng.choice(_WORDS) for _ in range(max(1, num_tokens))).lstrip()


def _scale_to_fit(lengths: list[int], max_len: int | None) -> list[int]:
    """Scale lengths proportionally so the longest fits `max_len` (keeps the distribution's
    shape, unlike clipping, which piles the long tail onto one value)."""
    if max_len is None or not lengths or max(lengths) <= max_len:
        return lengths
    factor = max_len / max(lengths)
    return [max(1, min(max_len, round(n * factor))) for n in lengths]


def load_azure_conv(
    path: Path,
    num_prompts: int,
    seed: int,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
) -> list[BenchRequest]:
    """The first `num_prompts` requests of the Azure conversation trace (its arrival order),
    lengths scaled down to fit `max_input_len` / `max_output_len` when given."""
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            rows: list[tuple[int, int]] = []
            for i, row in enumerate(reader):
                if len(rows) >= num_prompts:
                    break
                try:
                    rows.append((int(row["ContextTokens"]), int(row["GeneratedTokens"])))
                except (KeyError, TypeError, ValueError):
                    raise UserError(
                        f"{path}: row {i + 2}: expected integer columns ContextTokens and "
                        f"GeneratedTokens, got {dict(row)!r}"
                    ) from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the trace: {exc.strerror}") from None
    if not rows:
        raise UserError(f"{path}: no requests in the trace")
    inputs = _scale_to_fit([max(1, r[0]) for r in rows], max_input_len)
    outputs = _scale_to_fit([max(1, r[1]) for r in rows], max_output_len)
    rng = random.Random(seed)
    return [
        BenchRequest(make_prompt(n_in, rng), n_in, n_out)
        for n_in, n_out in zip(inputs, outputs, strict=True)
    ]


def make_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[BenchRequest]:
    """Lengths drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if input_len < 1 or output_len < 1:
        raise UserError(
            f"--random-input-len/--random-output-len: must be >= 1, got {input_len}/{output_len}"
        )
    if not 0.0 <= range_ratio < 1.0:
        raise UserError(f"--random-range-ratio: must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = max(
            1, round(rng.uniform(input_len * (1 - range_ratio), input_len * (1 + range_ratio)))
        )
        n_out = max(
            1, round(rng.uniform(output_len * (1 - range_ratio), output_len * (1 + range_ratio)))
        )
        out.append(BenchRequest(make_prompt(n_in, rng), n_in, n_out))
    return out
