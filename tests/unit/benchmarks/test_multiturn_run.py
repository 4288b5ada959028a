"""benchmarks/multiturn.py and its client against a fake OpenAI chat server (in process, and on
127.0.0.1 for the script), plus the script's setup and target logic."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from benchmarks import multiturn
from helixserve.bench.conversations import ConversationConfig, make_conversations
from helixserve.bench.multiturn import ChatConfig, MultiTurnSummary, run_conversations
from tests.unit.api.api_testlib import ServerThread


class FakeChat:
    """A chat server whose cache is perfect: every request's prompt is its messages' words,
    the cached part all but the last user message's. It replies "reply <k>" (k: the k-th
    request), one word a chunk; a user message containing FAIL gets HTTP 500."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.queries = 0
        self.hits = 0

    def app(self) -> Any:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> Any:
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        @app.get("/metrics")
        async def metrics() -> Any:
            return PlainTextResponse(
                f'vllm:prefix_cache_queries_total{{model_name="fake",node="n1"}} {self.queries}\n'
                f'vllm:prefix_cache_hits_total{{model_name="fake",node="n1"}} {self.hits}\n')

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            self.requests.append(body)
            msgs = body["messages"]
            if "FAIL" in msgs[-1]["content"]:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            prompt = sum(len(m["content"].split()) for m in msgs)
            cached = prompt - len(msgs[-1]["content"].split())
            self.queries += prompt
            self.hits += cached
            words = ["reply", str(len(self.requests))]

            def sse(obj: dict[str, Any]) -> str:
                return "data: " + json.dumps(obj) + "\n\n"

            def chunks() -> Iterator[str]:
                base = {"id": "c1", "object": "chat.completion.chunk", "created": 0,
                        "model": "fake"}
                yield sse(base | {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                for i, w in enumerate(words):
                    text = w if i == 0 else " " + w
                    yield sse(base | {"choices": [{"index": 0, "delta": {"content": text}}]})
                yield sse(base | {"choices": [], "usage": {
                    "prompt_tokens": prompt, "completion_tokens": len(words),
                    "total_tokens": prompt + len(words),
                    "prompt_tokens_details": {"cached_tokens": cached}}})
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        return app


def _run_in_process(fake: FakeChat, convs: list[Any], **cfg: Any) -> Any:
    import httpx

    async def go() -> Any:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake.app()))
        return await run_conversations(ChatConfig("http://fake/v1", "fake", **cfg), convs, http)

    return asyncio.run(go())


def test_every_turn_resends_the_history_with_the_servers_replies() -> None:
    fake = FakeChat()
    convs = make_conversations(ConversationConfig(num_conversations=3, min_turns=2, max_turns=4,
                                                  system_prompt_tokens=40, user_tokens=8))
    results, duration_s = _run_in_process(fake, convs, output_tokens=7)
    assert duration_s > 0
    assert len(results) == sum(c.num_turns for c in convs) == len(fake.requests)
    assert all(r.success and r.ttft_s > 0 and r.e2e_s >= r.ttft_s for r in results)
    for body in fake.requests:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 7 and body["ignore_eos"] is True
        assert body["temperature"] == 0.0
    for conv in convs:
        mine = [r for r in results if r.conversation == conv.index]
        assert [r.turn for r in mine] == list(range(conv.num_turns))
        sent = [b["messages"] for b in fake.requests
                if b["messages"][1]["content"] == conv.user_turns[0]]
        assert len(sent) == conv.num_turns
        for k, msgs in enumerate(sent):
            assert len(msgs) == 2 * k + 2
            # the assistant messages are what the server answered to the earlier turns
            assert [m["content"] for m in msgs if m["role"] == "assistant"] == \
                [r.reply for r in mine[:k]]
            assert all(r.reply.startswith("reply ") for r in mine)
    for r in results:
        assert r.cached_tokens is not None and 0 < r.cached_tokens < r.prompt_tokens
        assert r.output_tokens == 2


def test_each_turn_waits_its_think_time_before_it_is_sent(monkeypatch) -> None:
    from helixserve.bench import multiturn as chat

    fake = FakeChat()
    waited: list[tuple[float, int]] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waited.append((seconds, len(fake.requests)))  # the requests sent before the wait
        await real_sleep(0)

    monkeypatch.setattr(chat.asyncio, "sleep", sleep)
    conv = make_conversations(ConversationConfig(num_conversations=1, min_turns=3, max_turns=3,
                                                 system_prompt_tokens=20, user_tokens=4))[0]
    conv = type(conv)(conv.index, conv.system_prompt, conv.user_turns, (0.5, 0.0, 1.25))
    results, _ = _run_in_process(fake, [conv])
    assert [r.turn for r in results if r.success] == [0, 1, 2]
    assert waited == [(0.5, 0), (1.25, 2)]  # before turn 0 and turn 2; turn 1's is 0


def test_a_failed_turn_ends_its_conversation_and_is_reported() -> None:
    fake = FakeChat()
    convs = make_conversations(ConversationConfig(num_conversations=2, system_prompt_tokens=20,
                                                  user_tokens=4))
    bad = convs[1]
    convs[1] = type(bad)(bad.index, bad.system_prompt,
                         (bad.user_turns[0], "FAIL " + bad.user_turns[1], *bad.user_turns[2:]))
    results, _ = _run_in_process(fake, convs, max_concurrency=1)
    failed = [r for r in results if not r.success]
    assert [(r.conversation, r.turn) for r in failed] == [(1, 1)]
    assert "500" in failed[0].error
    assert len([r for r in results if r.conversation == 1]) == 2  # turns 2, 3 not sent
    assert len([r for r in results if r.conversation == 0]) == convs[0].num_turns


def test_the_script_measures_running_servers_and_judges_the_targets(tmp_path, capsys) -> None:
    """Two fake servers named aware and plain: the same perfect cache, so the hit-rate target
    (aware >= 1.5x plain) fails, and off's rows are missing, so its targets are n/a."""
    out = tmp_path / "mt.json"
    with ServerThread(FakeChat().app()) as a, ServerThread(FakeChat().app()) as b:
        rc = multiturn.main([
            "--url", f"aware=http://127.0.0.1:{a.port}",
            "--url", f"plain=http://127.0.0.1:{b.port}/v1",
            "--conversations", "3", "--turns", "2-3", "--system-tokens", "30",
            "--user-tokens", "6", "--output-tokens", "4", "--json", str(out)])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["setups"]) == {"aware", "plain"}
    for name in ("aware", "plain"):
        s = report["setups"][name]["summary"]
        assert report["setups"][name]["status"] == "ok"
        assert s["completed"] == s["requests"] >= 6 and s["failed"] == 0
        assert 0 < s["hit_rate_responses"] < 1
        # /metrics agrees with the responses (the warm-up is outside the run's difference)
        assert s["hit_rate_metrics"] == pytest.approx(s["hit_rate_responses"])
    t = report["targets"]
    assert t["hit_rate_aware_over_plain"]["ratio"] == pytest.approx(1.0)
    assert t["hit_rate_aware_over_plain"]["pass"] is False
    assert t["ttft_p50_off_over_aware"]["pass"] is None
    assert report["workload"]["num_conversations"] == 3
    text = capsys.readouterr().out
    assert "prefix-cache hit rate, aware / plain: 1.00x (target >= 1.5x)  FAIL" in text
    assert "n/a (a row is missing)" in text


def test_bad_flags_exit_2_with_one_line(capsys) -> None:
    for argv, what in ((["--turns", "5-2"], "--turns"),
                       (["--conversations", "0"], "--conversations"),
                       (["--output-tokens", "0"], "--output-tokens"),
                       (["--url", "fast=http://x"], "--url")):  # fmt: skip
        assert multiturn.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: " + what) and "\n" not in err


def test_setups_without_their_flag_are_not_available_and_off_runs_the_plain_demo() -> None:
    none: set[str] = set()
    both = {multiturn.NO_CACHING, multiturn.NO_AWARE}
    assert multiturn.plan_setup("off", both, False)[:2] == (["--no-prefix-caching"], "ok")
    extra, status, note = multiturn.plan_setup("off", none, False)
    assert (extra, status) == ([], "ok") and "caching not yet on" in note
    for setup in ("plain", "aware"):
        assert multiturn.plan_setup(setup, none, True)[:2] == (None, "not available in this build")
    assert multiturn.plan_setup("plain", {multiturn.NO_CACHING}, True)[1] == \
        "not available in this build"
    assert multiturn.plan_setup("plain", both, True)[:2] == (["--no-cache-aware-routing"], "ok")
    assert multiturn.plan_setup("aware", both, True) == ([], "ok", "")
    assert multiturn.plan_setup("vllm", both, False)[:2] == (None, "skipped")
    assert multiturn.plan_setup("vllm", none, True)[:2] == ([], "ok")


def _summary(ttft_ms: float, tok_s: float, hit: float | None) -> MultiTurnSummary:
    return MultiTurnSummary(
        conversations=1, requests=4, completed=4, failed=0, duration_s=1.0, prompt_tokens=1,
        output_tokens=1, output_tokens_per_s=tok_s, requests_per_s=1.0, ttft_p50_ms=ttft_ms,
        ttft_p90_ms=ttft_ms, ttft_mean_ms=ttft_ms, ttft_p50_ms_by_turn=[ttft_ms], e2e_p50_ms=1.0,
        cached_tokens=None, hit_rate_responses=hit)


def test_targets_pass_and_fail_on_their_thresholds() -> None:
    def runs(**s: MultiTurnSummary) -> dict[str, multiturn.SetupRun]:
        return {k: multiturn.SetupRun(k, "ok", "", summary=v) for k, v in s.items()}

    t = multiturn.compare(runs(off=_summary(3000, 10, 0.0), plain=_summary(900, 14, 0.4),
                               aware=_summary(1000, 15, 0.61), vllm=_summary(500, 30, 0.7)))
    assert t["ttft_p50_off_over_aware"]["ratio"] == pytest.approx(3.0)
    assert t["ttft_p50_off_over_aware"]["pass"] is True
    assert t["throughput_aware_over_off"]["pass"] is True
    assert t["hit_rate_aware_over_plain"]["pass"] is True
    assert t["ttft_p50_vllm_over_aware"]["ratio"] == pytest.approx(0.5)
    assert t["throughput_aware_over_vllm"]["pass"] is None  # reported, no target
    assert t["throughput_off_over_vllm"]["ratio"] == pytest.approx(1 / 3)
    assert t["ttft_p50_vllm_over_off"]["ratio"] == pytest.approx(500 / 3000)
    t = multiturn.compare(runs(off=_summary(2000, 11, 0.0), plain=_summary(900, 14, 0.5),
                               aware=_summary(1000, 16, 0.6)))
    assert t["ttft_p50_off_over_aware"]["pass"] is False
    assert t["throughput_aware_over_off"]["pass"] is False
    assert t["hit_rate_aware_over_plain"]["pass"] is False
    assert t["ttft_p50_vllm_over_aware"]["ratio"] is None
    # plain caught nothing, aware did: an infinite ratio passes
    t = multiturn.compare(runs(plain=_summary(900, 14, 0.0), aware=_summary(1000, 16, 0.2)))
    assert t["hit_rate_aware_over_plain"]["ratio"] == float("inf")
    assert t["hit_rate_aware_over_plain"]["pass"] is True
    text = multiturn.format_table(runs(aware=_summary(1000, 16, 0.2)), t)
    assert "aware  ok" in text and "20.0%" in text


def test_the_vllm_context_holds_the_longest_conversation() -> None:
    cfg = ConversationConfig(min_turns=4, max_turns=8, system_prompt_tokens=1000, user_tokens=64)
    n = multiturn.max_model_len(cfg, 32)
    assert n % 1024 == 0 and 2048 <= n <= 8192
    assert n >= 1000 + 8 * (96 + 32)
    assert multiturn.max_model_len(ConversationConfig(system_prompt_tokens=20000), 16) == 8192


def test_history_found_counts_later_turns_that_took_the_previous_prompt_from_cache() -> None:
    from helixserve.bench.multiturn import TurnResult, summarize

    def turn(conv: int, k: int, prompt: int, cached: int | None, ok: bool = True) -> TurnResult:
        return TurnResult(conv, k, success=ok, ttft_s=0.5, prompt_tokens=prompt,
                          output_tokens=4, cached_tokens=cached)

    results = [
        turn(0, 0, 100, 0), turn(0, 1, 200, 96),  # 96 = 100 in whole blocks of 16: found
        turn(0, 2, 300, 80),  # less than turn 1's 200 (192 in blocks): lost
        turn(1, 0, 100, 0), turn(1, 1, 200, None),  # not reported: not counted
        turn(1, 2, 300, 300),  # its previous turn reported nothing: not counted
        turn(2, 0, 100, 0, ok=False), turn(2, 1, 200, 112),  # previous turn failed
    ]
    s = summarize(results, 10.0, 3)
    assert s.history_found == 0.5
    assert s.turns[:3] == [[0, 0, 100, 0, 500.0], [0, 1, 200, 96, 500.0], [0, 2, 300, 80, 500.0]]
    assert [t[3] for t in s.turns if t[0] == 1] == [0, -1, 300]
    assert summarize(results[:1], 10.0, 1).history_found is None
