"""Request streams for the simulator: the Azure LLM inference trace, Poisson arrivals, or
multi-turn conversations whose tokens are known (for prefix caching, `multi_turn`).

The Azure trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`, Patel et al., Splitwise,
ISCA 2024) gives each request's arrival time, prompt length and output length. Helix drops
requests with prompt > 2048 or output > 1024 tokens, or either < 4; that is the default
here (`LengthFilter`), `clip` caps the lengths instead.
"""

from __future__ import annotations

import csv
import io
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from helixserve.errors import UserError, read_user_file


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    #: arrival time, seconds from the start of the run
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    #: its prompt then output token ids (prompt_tokens + output_tokens of them), so prefix
    #: caching can name its blocks; None: contents unknown, never cached
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LengthFilter:
    """Which request lengths the run keeps (Helix's filter by default)."""

    #: longest prompt kept, tokens
    max_prompt_tokens: int = 2048
    #: longest output kept, tokens
    max_output_tokens: int = 1024
    #: shortest prompt and output kept, tokens
    min_tokens: int = 4
    #: "drop" requests outside the bounds (Helix), or "clip" their lengths into them
    policy: str = "drop"

    def apply(self, reqs: list[TraceRequest]) -> list[TraceRequest]:
        if self.policy not in ("drop", "clip"):
            raise UserError(f"length filter: policy: unknown {self.policy!r}; known: drop, clip")
        out = []
        for r in reqs:
            p, o = r.prompt_tokens, r.output_tokens
            if self.policy == "drop":
                if not (self.min_tokens <= p <= self.max_prompt_tokens):
                    continue
                if not (self.min_tokens <= o <= self.max_output_tokens):
                    continue
                out.append(r)
            else:
                p = min(max(p, self.min_tokens), self.max_prompt_tokens)
                o = min(max(o, self.min_tokens), self.max_output_tokens)
                same = (p, o) == (r.prompt_tokens, r.output_tokens)
                # clipped lengths no longer match the token ids: contents unknown
                out.append(replace(r, prompt_tokens=p, output_tokens=o,
                                   token_ids=r.token_ids if same else None))
        return out


def load_azure_trace(path: str | Path) -> list[TraceRequest]:
    """All requests of an Azure LLM trace CSV, arrivals relative to the first one."""
    p = Path(path)
    # whole, as UTF-8: a binary or Latin-1 file is one UserError, not a decode traceback
    text = read_user_file(p, "trace").removeprefix("\ufeff")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    missing = [c for c in need if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(
            f"{p}: header: missing column(s) {', '.join(missing)}; expected {', '.join(need)}"
        )
    stamps: list[float] = []
    lengths: list[tuple[int, int]] = []
    for row in reader:
        try:
            # Seven fractional digits ("46.6805900"); datetime takes at most six.
            stamps.append(datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp())
            lengths.append((int(row["ContextTokens"]), int(row["GeneratedTokens"])))
        except (ValueError, TypeError, AttributeError):  # a short row has None fields
            raise UserError(f"{p}: line {reader.line_num}: bad row {row!r}") from None
    if not stamps:
        raise UserError(f"{p}: no requests")
    t0 = min(stamps)
    return [
        TraceRequest(f"req-{i}", t - t0, pr, out)
        for i, (t, (pr, out)) in enumerate(zip(stamps, lengths, strict=True))
    ]


def prepare_trace(
    reqs: list[TraceRequest],
    *,
    lengths: LengthFilter | None = LengthFilter(),
    sample_fraction: float | None = None,
    rate_per_s: float | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Filter lengths, keep a seeded random sample, and rescale arrivals to a mean rate.

    Rescaling multiplies every arrival time by one factor, so the trace keeps its burstiness.
    """
    out = lengths.apply(reqs) if lengths is not None else list(reqs)
    if sample_fraction is not None:
        if not 0 < sample_fraction <= 1:
            raise UserError(f"--sample: must be in (0, 1], got {sample_fraction}")
        rng = random.Random(seed)
        out = [r for r in out if rng.random() < sample_fraction]
    if not out:
        raise UserError("trace: no request left after filtering and sampling")
    out.sort(key=lambda r: r.arrival_s)
    t0 = out[0].arrival_s
    out = [replace(r, arrival_s=r.arrival_s - t0) for r in out]
    if rate_per_s is not None:
        if rate_per_s <= 0:
            raise UserError(f"--rate: must be > 0 requests/s, got {rate_per_s}")
        span_s = out[-1].arrival_s
        if span_s <= 0 or len(out) < 2:
            raise UserError("trace: need at least two distinct arrival times to rescale the rate")
        # n - 1 gaps over the span: the mean rate the trace has.
        factor = ((len(out) - 1) / span_s) / rate_per_s
        out = [replace(r, arrival_s=r.arrival_s * factor) for r in out]
    return out


def poisson_arrivals(
    rate_per_s: float,
    duration_s: float,
    lengths_from: list[TraceRequest] | None = None,
    prompt_tokens: int = 512,
    output_tokens: int = 128,
    seed: int = 0,
) -> list[TraceRequest]:
    """Poisson arrivals at `rate_per_s` over `duration_s`; lengths drawn from `lengths_from`
    (e.g. the filtered trace) or fixed."""
    if rate_per_s <= 0:
        raise UserError(f"--rate: must be > 0 requests/s, got {rate_per_s}")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        if lengths_from:
            src = lengths_from[rng.randrange(len(lengths_from))]
            p, o = src.prompt_tokens, src.output_tokens
        else:
            p, o = prompt_tokens, output_tokens
        out.append(TraceRequest(f"req-{len(out)}", t, p, o))
        t += rng.expovariate(rate_per_s)
    return out


def offline_stream(reqs: list[TraceRequest]) -> Iterator[tuple[int, int]]:
    """(prompt, output) lengths for a saturated run: the trace's requests in order, cycled."""
    if not reqs:
        raise UserError("trace: no requests for the offline run")
    while True:
        for r in reqs:
            yield r.prompt_tokens, r.output_tokens


def multi_turn(
    conversations: int,
    turns: int,
    system_prompt_tokens: int = 1000,
    user_tokens: int = 100,
    output_tokens: int = 100,
    conversation_gap_s: float = 1.0,
    turn_gap_s: float = 30.0,
    vocab_size: int = 32000,
    seed: int = 0,
) -> list[TraceRequest]:
    """Chat conversations with token ids, for prefix caching: every conversation starts with
    the same system prompt of `system_prompt_tokens`; turn k's prompt is turn k-1's prompt,
    its output and new user tokens, so a conversation's history grows turn by turn.

    Conversation c starts at `c * conversation_gap_s`; its turns arrive `turn_gap_s` apart
    (the trace is open loop: a gap shorter than a turn's latency sends the next turn before
    the previous one's output is cached). User and output lengths are drawn uniformly in
    [length/2, 3*length/2] and tokens uniformly from the vocabulary, all from `seed`: the
    same arguments give the same trace."""
    for name, value in (("conversations", conversations), ("turns", turns),
                        ("user_tokens", user_tokens), ("output_tokens", output_tokens),
                        ("vocab_size", vocab_size)):
        if value < 1:
            raise UserError(f"multi-turn workload: {name}: must be >= 1, got {value}")
    if system_prompt_tokens < 0 or conversation_gap_s < 0 or turn_gap_s < 0:
        raise UserError("multi-turn workload: system_prompt_tokens, conversation_gap_s and "
                        f"turn_gap_s must be >= 0, got {system_prompt_tokens}, "
                        f"{conversation_gap_s}, {turn_gap_s}")
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    def length(mean: int) -> int:
        return rng.randint(max(1, mean // 2), max(1, mean + mean // 2))

    system = draw(system_prompt_tokens)
    out: list[TraceRequest] = []
    for c in range(conversations):
        history = list(system)
        for k in range(turns):
            prompt = history + draw(length(user_tokens))
            output = draw(length(output_tokens))
            out.append(TraceRequest(f"conv{c}-turn{k}", c * conversation_gap_s + k * turn_gap_s,
                                    len(prompt), len(output), tuple(prompt + output)))
            history = prompt + output
    out.sort(key=lambda r: r.arrival_s)
    return out
