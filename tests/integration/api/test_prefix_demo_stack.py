"""Prefix caching on the demo stack (`helixserve demo`: 3 worker processes, coordinator, API)
with the real `openai` client: usage reports the prompt tokens taken from cache, as OpenAI
does (`usage.prompt_tokens_details.cached_tokens`, in the final usage chunk of a stream too),
the greedy answer is the same as when it was computed in full, and vLLM's prefix cache
counters move, in total and per node."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_demo_lib import API_KEY
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM = ("You are the help desk of a small library. Answer in one short sentence. The "
          "library opens at nine and closes at six, Monday to Saturday. Members may borrow "
          "five books for three weeks; a renewal is possible once, online or at the desk. "
          "Late books cost ten cents a day. The reading room is quiet; phones stay silent. ")
BLOCK = 16  # the demo workers' (torch engine) KV block size


def _client(demo) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _model(demo) -> str:
    return httpx.get(demo.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]


def _counters(demo) -> dict[tuple[str, str], float]:
    """(name, node or "") -> value of the vllm:prefix_cache_* samples."""
    text = httpx.get(demo.url + "/metrics").text
    return {(s.name, s.labels.get("node", "")): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("vllm:prefix_cache_")}


def _ask(demo, question: str, stream: bool = False) -> tuple[str, dict]:
    """(the greedy answer, the usage) of a chat sharing the system prompt."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    kw = dict(model=_model(demo), messages=messages, max_tokens=16, temperature=0)
    if not stream:
        resp = _client(demo).chat.completions.create(**kw)
        return resp.choices[0].message.content or "", resp.usage.model_dump()
    chunks = list(_client(demo).chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and not chunks[-1].choices
    return text, chunks[-1].usage.model_dump()


def test_a_shared_system_prompt_is_reused_with_the_same_greedy_answer(demo):
    before = _counters(demo)
    cold, usage = _ask(demo, "When do you open on Saturday?")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    _, usage = _ask(demo, "How many books may I borrow?")
    # the system prompt's whole blocks, on every hop of the route it was served on (or
    # 0 if that route's hops hold none of it; then the next one is)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached % BLOCK == 0 and cached < usage["prompt_tokens"]
    warm, usage = _ask(demo, "When do you open on Saturday?", stream=True)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # the same prompt again: all of it but the last (partial) block comes from cache
    assert cached == (usage["prompt_tokens"] - 1) // BLOCK * BLOCK > 0
    assert warm == cold
    after = _counters(demo)

    def moved(name: str, node: str = "") -> float:
        return after.get((name, node), 0.0) - before.get((name, node), 0.0)

    queried = moved("vllm:prefix_cache_queries_total")
    hits = moved("vllm:prefix_cache_hits_total")
    assert queried >= 3 * usage["prompt_tokens"] - 64  # three prompts of about this size
    assert cached <= hits < queried
    nodes = {node for _, node in after if node}
    assert nodes and sum(moved("vllm:prefix_cache_hits_total", n) for n in nodes) >= hits
