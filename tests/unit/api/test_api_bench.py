"""`helixserve bench`: datasets, percentiles, and a real run against the fake-backed API."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from api_testlib import API_KEY, MODEL

from helixserve.bench.client import RequestResult
from helixserve.bench.datasets import (
    _scale_to_fit,
    load_azure_conv,
    make_prompt,
    make_random,
)
from helixserve.bench.report import percentile, summarize
from helixserve.errors import UserError

TRACE = Path(__file__).resolve().parents[2] / "data" / "shared" / "traces" / "azure-llm-conv-2023.csv"


def test_percentile_matches_numpy_linear():
    import numpy as np

    xs = [random.Random(1).random() for _ in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_prompt_words_are_single_tokens(tokenizer):
    prompt = make_prompt(200, random.Random(0))
    assert len(tokenizer.encode(prompt, add_special_tokens=False)) == 200


def test_scale_to_fit_keeps_shape():
    assert _scale_to_fit([10, 50, 100], 20) == [2, 10, 20]
    assert _scale_to_fit([10, 50], None) == [10, 50]
    assert _scale_to_fit([10, 50], 64) == [10, 50]


def test_azure_conv_reads_trace_in_order_and_scales():
    reqs = load_azure_conv(TRACE, 5, seed=0)
    # first rows of the trace: 374/44 and 396/109
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs[:2]] == [(374, 44), (396, 109)]
    scaled = load_azure_conv(TRACE, 50, seed=0, max_input_len=100,
                             max_output_len=32)  # fmt: skip
    assert max(r.prompt_tokens for r in scaled) == 100
    assert max(r.output_tokens for r in scaled) <= 32


def test_bad_inputs_raise_user_error(tmp_path):
    with pytest.raises(UserError, match="random-range-ratio"):
        make_random(3, 10, 10, 1.5, 0)
    bad = tmp_path / "trace.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nx,abc,3\n")
    with pytest.raises(UserError, match="row 2"):
        load_azure_conv(bad, 3, 0)


def test_summarize_definitions():
    a = RequestResult(True, "", 10, 5, ttft_s=0.1, itl_s=[0.02] * 4, e2e_s=0.18)
    b = RequestResult(True, "", 20, 3, ttft_s=0.3, itl_s=[0.05] * 2, e2e_s=0.4)
    failed = RequestResult(False, "HTTP 500: boom")
    rep = summarize([a, b, failed], duration_s=2.0)
    assert (rep.completed, rep.failed) == (2, 1)
    assert rep.output_throughput_tokens_per_s == pytest.approx(4.0)
    assert rep.total_input_tokens == 30
    assert rep.tpot.mean_ms == pytest.approx((20.0 + 50.0) / 2)
    assert rep.ttft.p50_ms == pytest.approx(200.0)
    assert rep.itl.mean_ms == pytest.approx((0.02 * 4 + 0.05 * 2) / 6 * 1000)
    assert rep.errors == ["HTTP 500: boom"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_cli_against_the_api(server, tmp_path: Path, endpoint):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "helixserve", "bench", "--url", server.url, "--model", MODEL,
        "--api-key", API_KEY, "--endpoint", endpoint, "--dataset", "random",
        "--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "16",
        "--random-output-len", "5", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Output token throughput" in proc.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 40  # usage counts, 5 per request
    assert result["ttft"]["p99_ms"] >= result["ttft"]["p50_ms"] > 0
    assert result["e2e"]["mean_ms"] >= result["ttft"]["mean_ms"]


def test_bench_max_tokens_lets_outputs_end_at_eos(server, fake):
    cmd = [
        sys.executable, "-m", "helixserve", "bench", "--url", server.url, "--model", MODEL,
        "--api-key", API_KEY, "--dataset", "random", "--num-prompts", "3",
        "--random-input-len", "8", "--random-output-len", "5", "--max-tokens", "7",
    ]  # fmt: skip
    before = len(fake.requests)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sent = fake.requests[before:][-3:]  # the first one is the CLI's probe request
    assert all(r.max_tokens == 7 and not r.ignore_eos for r in sent)
    bad = subprocess.run([*cmd[:-2], "--max-tokens", "0"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--max-tokens" in bad.stderr


def test_bench_cli_wrong_model_fails_fast(server):
    cmd = [
        sys.executable, "-m", "helixserve", "bench", "--url", server.url, "--model", "nope",
        "--api-key", API_KEY, "--num-prompts", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "404" in proc.stderr and "Traceback" not in proc.stderr
