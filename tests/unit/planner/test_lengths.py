"""The served objective's drawn requests: the conversation mix from the Azure trace's held-out
second half (planner/lengths.py), a --workload trace from its own lengths, a "P:O" mix
exponential with its means (commands/served.py, `workload_requests`, `drawn_requests`)."""

from __future__ import annotations

import statistics
from pathlib import Path

from helixserve.commands.served import WORKLOAD_REQUESTS, drawn_requests, workload_requests
from helixserve.costmodel.workload import Workload
from helixserve.planner.lengths import (
    CONVERSATION_LENGTHS,
    HELD_OUT_FROM,
    SAMPLE_SIZE,
    systematic_sample,
)
from helixserve.simulator.workload import load_azure_trace, prepare_trace

TRACE = Path(__file__).resolve().parents[3] / "examples" / "traces" / "azure-llm-conv-2023.csv"


def test_table_is_the_trace_second_half_sampled():
    reqs = prepare_trace(load_azure_trace(TRACE))
    held_out = reqs[int(HELD_OUT_FROM * len(reqs)):]
    pairs = [(r.prompt_tokens, r.output_tokens) for r in held_out]
    assert list(CONVERSATION_LENGTHS) == systematic_sample(pairs, SAMPLE_SIZE)
    # none of the trace's first half's (prompt, output) multiset was used: the table's
    # prompts follow the second half's quantiles, not the first half's
    first = sorted(r.prompt_tokens for r in reqs[: len(reqs) // 2])
    second = sorted(p for p, _ in pairs)
    table = sorted(p for p, _ in CONVERSATION_LENGTHS)
    median = statistics.median
    assert abs(median(table) - median(second)) < abs(median(table) - median(first))


def test_conversation_draw_follows_the_table_not_an_exponential():
    reqs = workload_requests(None, seed=3)
    assert len(reqs) == WORKLOAD_REQUESTS
    table = set(CONVERSATION_LENGTHS)
    assert all((r.prompt_tokens, r.output_tokens) in table for r in reqs)
    assert reqs == workload_requests(Workload.conversation(), seed=3)  # same mix, same draw
    assert reqs != workload_requests(None, seed=4)
    prompts = sorted(r.prompt_tokens for r in reqs)
    # the trace's prompts bunch near 700-1,300 tokens: an exponential's median would be
    # mean * ln 2 (about 505 here)
    assert statistics.median(prompts) > 600
    mean_prompt = statistics.fmean(prompts)
    assert 650 < mean_prompt < 850


def test_pair_mix_draws_exponential_lengths():
    mix = Workload(2000.0, 30.0, "2000:30")
    reqs = workload_requests(mix, seed=0)
    outputs = [r.output_tokens for r in reqs]
    assert 27 < statistics.fmean(outputs) < 33
    # an exponential's median is ln 2 of its mean
    assert 0.6 < statistics.median(outputs) / statistics.fmean(outputs) < 0.8
    _, text = drawn_requests("2000:30", mix, 0)
    assert "exponential lengths" in text


def test_trace_workload_draws_its_own_lengths(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.0,100,10\n2023-11-16 18:15:47.0,300,50\n")
    mix = Workload.from_lengths([100, 300], [10, 50], source="t.csv")
    reqs, text = drawn_requests(str(trace), mix, 0)
    assert {(r.prompt_tokens, r.output_tokens) for r in reqs} == {(100, 10), (300, 50)}
    assert "t.csv's lengths" in text
    _, text = drawn_requests("conversation", Workload.conversation(), 0)
    assert "held-out" in text
