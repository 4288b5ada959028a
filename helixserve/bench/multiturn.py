"""Drive multi-turn conversations at an OpenAI-compatible server and summarize them.

Conversations run concurrently (at most `max_concurrency` at once); the turns of one
conversation run one after another, each turn sending the whole history with the assistant's
actual replies (helixserve.bench.conversations). Requests go through the `openai` client
(`chat.completions.create(stream=True)` with `stream_options.include_usage`), the client
users run, so TTFT is what they see: from sending the request to the first chunk carrying
generated text.

Prefix-cache hits are read two ways: from the responses (`usage.prompt_tokens_details.
cached_tokens` over `usage.prompt_tokens`, as OpenAI reports cached input) and from the
server's Prometheus counters `vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`
(the difference between a scrape before and one after the run). A server that reports neither
gets None, not 0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from helixserve.bench.conversations import Conversation, messages_for_turn
from helixserve.bench.report import percentile

HITS_METRIC = "vllm:prefix_cache_hits_total"
QUERIES_METRIC = "vllm:prefix_cache_queries_total"


@dataclass
class TurnResult:
    """One request: turn `turn` of conversation `conversation` (times in seconds)."""

    conversation: int
    turn: int
    success: bool = False
    error: str = ""
    #: from sending the request to the first chunk with generated text
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    #: usage.prompt_tokens_details.cached_tokens; None when the server did not report it
    cached_tokens: int | None = None
    reply: str = ""


@dataclass(frozen=True)
class ChatConfig:
    base_url: str  # the API root, e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str = "none"
    #: tokens every reply generates (max_tokens; with ignore_eos exactly that many)
    output_tokens: int = 32
    ignore_eos: bool = True
    #: conversations in flight at once; None = all
    max_concurrency: int | None = None
    timeout_s: float = 600.0


async def send_turn(client: Any, cfg: ChatConfig, messages: list[dict[str, str]],
                    result: TurnResult) -> TurnResult:
    """Stream one chat completion, filling `result` (its reply is the generated text)."""
    extra = {"ignore_eos": True} if cfg.ignore_eos else None
    pieces: list[str] = []
    chunks = 0
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=cfg.model, messages=messages, max_tokens=cfg.output_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra,
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.output_tokens = chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                if details is not None and details.cached_tokens is not None:
                    result.cached_tokens = details.cached_tokens
            text = "".join(c.delta.content or "" for c in chunk.choices if c.delta)
            if text:
                if not pieces:
                    result.ttft_s = time.perf_counter() - start
                pieces.append(text)
                chunks += 1
        result.e2e_s = time.perf_counter() - start
        result.reply = "".join(pieces)
        if result.output_tokens == 0:
            result.output_tokens = chunks  # no usage chunk: one chunk per token
        result.success = bool(pieces)
        if not result.success:
            result.error = "no generated text in the stream"
    except Exception as exc:  # a benchmark reports failed requests, it does not stop
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def run_conversation(client: Any, cfg: ChatConfig, conv: Conversation) -> list[TurnResult]:
    """The turns of one conversation in order, each after its think time (if any); a failed
    turn ends it (its history would lack the reply), so the results may be fewer than its
    turns."""
    replies: list[str] = []
    results = []
    for turn in range(conv.num_turns):
        if turn < len(conv.think_s) and conv.think_s[turn] > 0:
            await asyncio.sleep(conv.think_s[turn])
        r = await send_turn(client, cfg, messages_for_turn(conv, turn, replies),
                            TurnResult(conv.index, turn))
        results.append(r)
        if not r.success:
            break
        replies.append(r.reply)
    return results


async def run_conversations(
    cfg: ChatConfig, conversations: list[Conversation], http_client: Any = None
) -> tuple[list[TurnResult], float]:
    """All conversations, at most `cfg.max_concurrency` at once; returns every request's
    result and the wall-clock seconds of the whole run. `http_client`: an httpx.AsyncClient
    for the openai client (tests pass one with a mock transport)."""
    import openai

    limit = cfg.max_concurrency or len(conversations) or 1
    client = openai.AsyncOpenAI(base_url=cfg.base_url, api_key=cfg.api_key, max_retries=0,
                                timeout=cfg.timeout_s, http_client=http_client)
    semaphore = asyncio.Semaphore(limit)

    async def limited(conv: Conversation) -> list[TurnResult]:
        async with semaphore:
            return await run_conversation(client, cfg, conv)

    start = time.perf_counter()
    try:
        per_conv = await asyncio.gather(*(limited(c) for c in conversations))
    finally:
        await client.close()
    duration_s = time.perf_counter() - start
    return [r for rs in per_conv for r in rs], duration_s


def parse_counter(metrics_text: str, name: str) -> float | None:
    """The total of counter `name` in a Prometheus text exposition: the sum of its samples
    without a `node` label (vLLM's series, helixserve's totals), or, when every sample has
    one, the sum over nodes. None when the server has no such series."""
    totals: list[float] = []
    per_node: list[float] = []
    for line in metrics_text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):
            continue  # another metric whose name starts with this one
        labels, _, value = rest.rpartition("}") if rest.startswith("{") else ("", "", rest)
        try:
            number = float(value.split()[0])
        except (IndexError, ValueError):
            continue
        (per_node if 'node="' in labels else totals).append(number)
    if not totals and not per_node:
        return None
    return sum(totals) if totals else sum(per_node)


@dataclass
class CacheCounters:
    """vLLM's prefix-cache counters (prompt tokens), summed over the server's series."""

    queries: float
    hits: float

    @classmethod
    def parse(cls, metrics_text: str) -> CacheCounters | None:
        queries = parse_counter(metrics_text, QUERIES_METRIC)
        hits = parse_counter(metrics_text, HITS_METRIC)
        if queries is None or hits is None:
            return None
        return cls(queries, hits)

    def minus(self, before: CacheCounters | None) -> CacheCounters:
        if before is None:
            return self
        return CacheCounters(self.queries - before.queries, self.hits - before.hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


@dataclass
class MultiTurnSummary:
    conversations: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_mean_ms: float
    #: TTFT p50 of the requests of turn k (index k); turn 0 shares only the system prompt
    ttft_p50_ms_by_turn: list[float]
    e2e_p50_ms: float
    #: cached over prompt tokens of the responses that reported cached_tokens; None: none did
    cached_tokens: int | None
    hit_rate_responses: float | None
    #: from /metrics, the run's difference; None: the server has no such counters
    metrics_queries: float | None = None
    metrics_hits: float | None = None
    hit_rate_metrics: float | None = None
    errors: list[str] = field(default_factory=list)
    #: of the turns after a conversation's first (whose previous turn succeeded and both
    #: reported cached tokens), the share that took at least the previous turn's prompt
    #: from cache, whole blocks of 16 (its history as of its last turn: where a
    #: cache-aware route sends it); None: no such turn
    history_found: float | None = None
    #: per request: [conversation, turn, prompt tokens, cached tokens (-1: not reported),
    #: TTFT ms], in send order within each conversation
    turns: list[list[float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        """The responses' hit rate, else the metrics'."""
        return self.hit_rate_responses if self.hit_rate_responses is not None \
            else self.hit_rate_metrics


def summarize(results: list[TurnResult], duration_s: float, num_conversations: int,
              counters: CacheCounters | None = None) -> MultiTurnSummary:
    ok = [r for r in results if r.success]
    duration = max(duration_s, 1e-9)
    ttft_ms = [r.ttft_s * 1000.0 for r in ok]
    turns = max((r.turn for r in ok), default=-1) + 1
    by_turn = [percentile([r.ttft_s * 1000.0 for r in ok if r.turn == k], 50)
               for k in range(turns)]
    reported = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported) if reported else None
    reported_prompt = sum(r.prompt_tokens for r in reported)
    out = MultiTurnSummary(
        conversations=num_conversations,
        requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        output_tokens=sum(r.output_tokens for r in ok),
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
        requests_per_s=len(ok) / duration,
        ttft_p50_ms=percentile(ttft_ms, 50),
        ttft_p90_ms=percentile(ttft_ms, 90),
        ttft_mean_ms=sum(ttft_ms) / len(ttft_ms) if ttft_ms else 0.0,
        ttft_p50_ms_by_turn=by_turn,
        e2e_p50_ms=percentile([r.e2e_s * 1000.0 for r in ok], 50),
        cached_tokens=cached,
        hit_rate_responses=(cached / reported_prompt
                            if cached is not None and reported_prompt > 0 else None),
        errors=sorted({r.error for r in results if not r.success})[:10],
    )
    by_conv: dict[int, dict[int, TurnResult]] = {}
    for r in ok:
        by_conv.setdefault(r.conversation, {})[r.turn] = r
    found = [r.cached_tokens >= prev.prompt_tokens // 16 * 16
             for turns_of in by_conv.values() for k, r in turns_of.items()
             if (prev := turns_of.get(k - 1)) is not None
             and r.cached_tokens is not None and prev.cached_tokens is not None]
    out.history_found = sum(found) / len(found) if found else None
    out.turns = [[r.conversation, r.turn, r.prompt_tokens,
                  -1 if r.cached_tokens is None else r.cached_tokens, round(r.ttft_s * 1000.0, 1)]
                 for r in sorted(ok, key=lambda r: (r.conversation, r.turn))]
    if counters is not None:
        out.metrics_queries = counters.queries
        out.metrics_hits = counters.hits
        out.hit_rate_metrics = counters.hit_rate
    return out
