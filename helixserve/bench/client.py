"""Stream benchmark requests at a server and time every chunk.

Arrivals are a Poisson process at `request_rate` requests/s (seeded), or all at once when the
rate is infinite; `max_concurrency` caps requests in flight (a request that arrives when the
cap is reached waits, and its latency clock starts only when it is sent, as in vLLM's
`bench serve`). Each request streams with `stream_options.include_usage`, so token counts are
the server's exact ones.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from helixserve.bench.datasets import BenchRequest

ENDPOINTS = ("completions", "chat")


@dataclass
class RequestResult:
    """Timings of one request (seconds, from time.perf_counter())."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    #: from sending the request to the first chunk carrying generated text
    ttft_s: float = 0.0
    #: gaps between successive content chunks
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    start_s: float = 0.0


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0
    #: sent as temperature; 0 = greedy, the usual for throughput runs
    temperature: float = 0.0
    #: None: force each request's dataset output length (max_tokens + ignore_eos, as vLLM's
    #: benchmark does); N: send max_tokens N and let generation end at EOS, as chat clients
    #: that ask for more than they use do
    max_tokens: int | None = None


def _api_root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _payload(cfg: ClientConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": req.output_tokens if cfg.max_tokens is None else cfg.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.max_tokens is None:
        body["ignore_eos"] = True  # force the requested output length, as vLLM's benchmark does
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            text += (choice.get("delta") or {}).get("content") or ""
    return text


async def send_one(client: Any, cfg: ClientConfig, req: BenchRequest,
                   result: RequestResult | None = None) -> RequestResult:
    """Send one streaming request and time its chunks. `client` is an httpx.AsyncClient.
    `result`, when given, is filled as chunks arrive: a caller that cancels the request
    (a run cut at its end, `helixserve rehearse`) still has the timings of what came."""
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    url = _api_root(cfg.base_url) + path
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    result = result if result is not None else RequestResult()
    start = time.perf_counter()
    result.start_s = start
    last = start
    content_chunks = 0
    try:
        async with client.stream("POST", url, json=_payload(cfg, req), headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
                    result.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                # a chunk counts when it carries generated text (the chat role chunk does not)
                if _chunk_text(chunk):
                    if content_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    content_chunks += 1
        result.e2e_s = time.perf_counter() - start
        if result.output_tokens == 0:
            # server without include_usage: one chunk per token is the best estimate
            result.output_tokens = content_chunks
        result.success = content_chunks > 0
        if not result.success:
            result.error = "no generated text in the stream"
    except Exception as exc:  # a benchmark reports failed requests, it does not stop
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_requests(
    cfg: ClientConfig, requests: list[BenchRequest]
) -> tuple[list[RequestResult], float]:
    """Send all requests under the arrival process; returns results and wall-clock seconds."""
    import httpx

    rng = random.Random(cfg.seed)
    limit = cfg.max_concurrency or len(requests) or 1
    semaphore = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def limited(req: BenchRequest) -> RequestResult:
            async with semaphore:
                return await send_one(client, cfg, req)

        tasks = []
        start = time.perf_counter()
        for i, req in enumerate(requests):
            if i > 0 and cfg.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
    return list(results), duration_s


async def probe(cfg: ClientConfig) -> RequestResult:
    """One short request before the run, so a wrong URL/model fails fast with its error."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)) as client:
        return await send_one(client, cfg, BenchRequest("Hello", 1, 2))
