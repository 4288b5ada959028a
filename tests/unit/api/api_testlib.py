"""A fake coordinator (scripted tokens, real tokenizer) and uvicorn in a thread, for the API tests.

The fake stands in for `helixserve.runtime.Coordinator` only here, in the API's unit tests;
the integration tests run the real workers and coordinator.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from helixserve.local.launch import free_port
from helixserve.request import PromptLogprob
from helixserve.runtime import (
    GenerationRequest,
    NoRouteError,
    QueueFullError,
    RequestFailedError,
    TokenEvent,
)
from helixserve.runtime.stats import CoordinatorStats, NodeStats

MODEL = "fake-model"
API_KEY = "sk-test-key"
#: what the fake model says, token by token
SCRIPT = " The capital of France is Paris. It is a beautiful city with many museums."
#: said instead when the prompt contains UNICODE: tokens that split UTF-8 characters
UNICODE_SCRIPT = "こんにちは café"


def fake_prompt_logprobs(prompt: list[int], top_n: int) -> list[PromptLogprob]:
    """What the fake scores prompt token k (k >= 1) with: -k/10, and top_n alternatives."""
    return [
        PromptLogprob(t, -k / 10, [(t, -k / 10), (t + 1, -k / 10 - 1)][:top_n])
        for k, t in enumerate(prompt[1:], start=1)
    ]


class FakeCoordinator:
    """Yields SCRIPT's tokens (the first with `fake_prompt_logprobs` when asked). Prompts containing NOROUTE / QUEUEFULL raise like the real one;
    WORKERFAIL fails after 2 tokens; SLOW makes each token take 50 ms (disconnect tests);
    UNICODE says UNICODE_SCRIPT. `kv_room` (None = unlimited) stands for the KV tokens of
    the roomiest route, as `Coordinator.max_new_tokens` reports them."""

    model_name = MODEL

    def __init__(self, tokenizer: Any, max_model_len: int = 256) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.script_ids: list[int] = tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.active: set[str] = set()
        self.closed: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.running = 0
        #: nodes the fake reports as down (stats "alive": False)
        self.dead_nodes: set[str] = set()
        self.kv_room: int | None = None

    def max_new_tokens(self, prompt_tokens: int) -> int | None:
        return None if self.kv_room is None else self.kv_room - prompt_tokens

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        prompt = self.tokenizer.decode(req.prompt_token_ids)
        if "NOROUTE" in prompt:
            raise NoRouteError("nodes n2 down: layers [10, 20) uncovered")
        if "QUEUEFULL" in prompt:
            raise QueueFullError("waiting queue full (0 requests)")
        self.requests.append(req)
        self.active.add(req.request_id)
        self.running += 1
        delay_s = 0.05 if "SLOW" in prompt else 0.0
        script_ids = self.script_ids
        if "UNICODE" in prompt:
            script_ids = self.tokenizer.encode(UNICODE_SCRIPT, add_special_tokens=False)
        emitted = ""
        try:
            for i in range(req.max_tokens):
                await asyncio.sleep(delay_s)
                if i == 2 and "WORKERFAIL" in prompt:
                    raise RequestFailedError(f"request {req.request_id}: node n2: out of memory")
                k = i % len(script_ids)
                tid = script_ids[k]
                # incremental text, holding back an incomplete UTF-8 character as the real
                # coordinator does
                if k == 0:
                    emitted = ""
                full = self.tokenizer.decode(script_ids[: k + 1])
                piece = "" if full.endswith("\ufffd") else full[len(emitted) :]
                emitted = emitted if full.endswith("\ufffd") else full
                done = i + 1 == req.max_tokens
                top = [(tid, -0.1), (tid + 1, -2.5)][: (req.sampling.logprobs or 0)]
                n_prompt = req.sampling.prompt_logprobs
                yield TokenEvent(
                    tid,
                    piece,
                    -0.1 if req.sampling.logprobs is not None else None,
                    top,
                    "length" if done else None,
                    prompt_logprobs=None
                    if i > 0 or n_prompt is None
                    else fake_prompt_logprobs(req.prompt_token_ids, n_prompt),
                )
        finally:
            self.active.discard(req.request_id)
            self.closed.append(req.request_id)
            self.running -= 1

    def stats(self) -> CoordinatorStats:
        return CoordinatorStats(
            running=self.running, waiting=0, reroutes=2, preemptions=5,
            nodes={
                "n1": NodeStats(start_layer=0, end_layer=12, queue_len=1, batch_size=2,
                                kv_used_blocks=3, kv_total_blocks=10, busy_fraction=0.5,
                                alive="n1" not in self.dead_nodes),
                "n2": NodeStats(start_layer=12, end_layer=30, queue_len=0, batch_size=1,
                                kv_used_blocks=1, kv_total_blocks=10, busy_fraction=0.25,
                                alive="n2" not in self.dead_nodes),
            },
            routes={"n1->n2": 3},
        )


class ServerThread:
    """uvicorn serving an app on 127.0.0.1 from a background thread."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
