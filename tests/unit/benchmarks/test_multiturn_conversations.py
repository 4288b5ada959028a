"""The multi-turn benchmark's pure parts: conversations, history growth, statistics, counters."""

from __future__ import annotations

import random

import pytest

from helixserve.bench.conversations import (
    SYSTEM_OPENING,
    Conversation,
    ConversationConfig,
    make_conversations,
    make_system_prompt,
    make_text,
    messages_for_turn,
    parse_turns,
)
from helixserve.bench.multiturn import CacheCounters, TurnResult, parse_counter, summarize
from helixserve.errors import UserError


def test_text_is_deterministic_and_about_its_length_in_words_and_periods() -> None:
    for n in (1, 5, 64, 1000):
        text = make_text(n, random.Random(7))
        assert text == make_text(n, random.Random(7))
        words = len(text.split())
        pieces = words + text.count(".") + text.count("\n\n")
        assert n <= pieces <= n + 2, (n, pieces)
    assert make_text(200, random.Random(1)) != make_text(200, random.Random(2))


def test_system_prompt_is_about_its_tokens_in_the_demo_tokenizer() -> None:
    from transformers import AutoTokenizer

    from helixserve.engine import prepare_demo_model

    tok = AutoTokenizer.from_pretrained(prepare_demo_model())
    prompt = make_system_prompt(1000, 0)
    assert prompt.startswith(SYSTEM_OPENING)
    assert 950 <= len(tok.encode(prompt, add_special_tokens=False)) <= 1060


def test_conversations_are_deterministic_share_the_system_prompt_and_differ() -> None:
    cfg = ConversationConfig(num_conversations=6, min_turns=4, max_turns=8, seed=3)
    convs = make_conversations(cfg)
    assert convs == make_conversations(cfg)
    assert len({c.system_prompt for c in convs}) == 1
    assert all(4 <= c.num_turns <= 8 for c in convs)
    assert len({c.num_turns for c in convs}) > 1  # drawn per conversation
    firsts = [c.user_turns[0] for c in convs]
    assert len(set(firsts)) == len(firsts)
    # a conversation's text does not depend on how many there are
    assert make_conversations(ConversationConfig(num_conversations=2, min_turns=4, max_turns=8,
                                                 seed=3)) == convs[:2]
    other = make_conversations(ConversationConfig(num_conversations=6, min_turns=4, max_turns=8,
                                                  seed=4))
    assert other[0].system_prompt != convs[0].system_prompt
    assert other[0].user_turns != convs[0].user_turns


def test_think_times_are_seeded_exponential_and_leave_the_text_alone() -> None:
    plain = ConversationConfig(num_conversations=40, min_turns=6, max_turns=6, seed=5)
    thinking = ConversationConfig(num_conversations=40, min_turns=6, max_turns=6, seed=5,
                                  think_time_s=2.0)
    convs = make_conversations(thinking)
    assert convs == make_conversations(thinking)
    assert all(c.think_s == () for c in make_conversations(plain))
    assert [c.user_turns for c in convs] == [c.user_turns for c in make_conversations(plain)]
    waits = [w for c in convs for w in c.think_s]
    assert len(waits) == 240 and all(w >= 0 for w in waits)
    assert 1.5 < sum(waits) / len(waits) < 2.6  # mean 2 s: 240 draws, sd of the mean 0.13 s
    assert len({c.think_s for c in convs}) == 40  # each conversation its own stream


def test_history_grows_with_the_actual_replies_and_each_turn_extends_the_last() -> None:
    conv = Conversation(0, "SYS", ("u0", "u1", "u2"))
    replies = ["r0", "r1", "r2"]
    m0 = messages_for_turn(conv, 0, [])
    m2 = messages_for_turn(conv, 2, replies)
    assert m0 == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "u0"}]
    assert [(m["role"], m["content"]) for m in m2] == [
        ("system", "SYS"), ("user", "u0"), ("assistant", "r0"), ("user", "u1"),
        ("assistant", "r1"), ("user", "u2")]  # fmt: skip
    # what caches: every request is the previous one plus its reply plus a new user message
    for k in range(1, 3):
        prev, cur = messages_for_turn(conv, k - 1, replies), messages_for_turn(conv, k, replies)
        assert cur[: len(prev)] == prev
        assert cur[len(prev)] == {"role": "assistant", "content": replies[k - 1]}
    with pytest.raises(ValueError, match="earlier replies"):
        messages_for_turn(conv, 2, ["r0"])
    with pytest.raises(ValueError, match="3 turns"):
        messages_for_turn(conv, 3, replies)


def test_turns_flag_and_config_errors_name_the_flag_and_value() -> None:
    assert parse_turns("4") == (4, 4)
    assert parse_turns("4-8") == (4, 8)
    for bad in ("x", "8-4", "0", "4-"):
        with pytest.raises(UserError, match="--turns"):
            parse_turns(bad)
    for field, value, flag in (("num_conversations", 0, "--conversations"),
                               ("user_tokens", 0, "--user-tokens"),
                               ("user_tokens_range_ratio", 1.0, "--user-tokens-range-ratio"),
                               ("system_prompt_tokens", -1, "--system-tokens"),
                               ("think_time_s", -1.0, "--think-time-s"),
                               ("think_time_s", float("nan"), "--think-time-s")):
        with pytest.raises(UserError, match=f"{flag}: .*{value}"):
            make_conversations(ConversationConfig(**{field: value}))  # type: ignore[arg-type]


def _result(conv: int, turn: int, ttft_s: float, prompt: int = 100, cached: int | None = None,
            ok: bool = True) -> TurnResult:
    return TurnResult(conv, turn, success=ok, error="" if ok else "HTTP 500: boom",
                      ttft_s=ttft_s, e2e_s=ttft_s + 1.0, prompt_tokens=prompt, output_tokens=10,
                      cached_tokens=cached)


def test_summary_percentiles_throughput_and_hit_rate_from_responses() -> None:
    results = [_result(0, 0, 0.1, 100, 0), _result(0, 1, 0.2, 200, 150),
               _result(1, 0, 0.3, 100, 50), _result(1, 1, 0.4, 200, 100),
               _result(2, 0, 9.0, ok=False)]  # fmt: skip
    s = summarize(results, duration_s=2.0, num_conversations=3)
    assert (s.requests, s.completed, s.failed) == (5, 4, 1)
    assert s.output_tokens == 40 and s.output_tokens_per_s == pytest.approx(20.0)
    assert s.requests_per_s == pytest.approx(2.0)
    assert s.ttft_p50_ms == pytest.approx(250.0)
    assert s.ttft_p90_ms == pytest.approx(370.0)
    assert s.ttft_p50_ms_by_turn == pytest.approx([200.0, 300.0])
    assert s.cached_tokens == 300 and s.hit_rate_responses == pytest.approx(300 / 600)
    assert s.hit_rate == s.hit_rate_responses and s.hit_rate_metrics is None
    assert s.errors == ["HTTP 500: boom"]


def test_summary_says_none_when_the_server_reports_no_cached_tokens() -> None:
    s = summarize([_result(0, 0, 0.1), _result(0, 1, 0.2)], 1.0, 1,
                  CacheCounters(queries=400.0, hits=100.0))
    assert s.cached_tokens is None and s.hit_rate_responses is None
    assert s.hit_rate_metrics == pytest.approx(0.25) and s.hit_rate == pytest.approx(0.25)
    empty = summarize([], 1.0, 1)
    assert empty.ttft_p50_ms == 0.0 and empty.ttft_p50_ms_by_turn == []


VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_hits_total_other 5.0
"""
HELIX_METRICS = """\
vllm:prefix_cache_queries_total{model_name="m",node="n1"} 100
vllm:prefix_cache_queries_total{model_name="m",node="n2"} 60
vllm:prefix_cache_queries_total{model_name="m"} 160
vllm:prefix_cache_hits_total{model_name="m",node="n1"} 40
vllm:prefix_cache_hits_total{model_name="m",node="n2"} 20
vllm:prefix_cache_hits_total{model_name="m"} 60
"""


def test_counters_are_read_from_totals_or_summed_over_nodes() -> None:
    assert parse_counter(VLLM_METRICS, "vllm:prefix_cache_queries_total") == 1200.0
    assert parse_counter(VLLM_METRICS, "vllm:prefix_cache_hits_total") == 300.0
    assert parse_counter(HELIX_METRICS, "vllm:prefix_cache_hits_total") == 60.0
    per_node_only = "\n".join(ln for ln in HELIX_METRICS.splitlines() if "node=" in ln)
    assert parse_counter(per_node_only, "vllm:prefix_cache_queries_total") == 160.0
    assert parse_counter("vllm:num_requests_running 3\n", "vllm:prefix_cache_hits_total") is None
    before = CacheCounters.parse(HELIX_METRICS)
    assert before == CacheCounters(160.0, 60.0)
    after = CacheCounters(360.0, 160.0)
    assert after.minus(before) == CacheCounters(200.0, 100.0)
    assert after.minus(before).hit_rate == pytest.approx(0.5)
    assert CacheCounters(0.0, 0.0).hit_rate is None
    assert CacheCounters.parse("") is None
