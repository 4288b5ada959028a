"""The order in which an offline rehearsal's first requests reach the cluster, on both sides.

A cold start's decode tokens/s depends on which prompts complete first (docs/rehearse.md,
"Order"): the client spaces its offline streams' first requests `ramp_s` apart, in the
trace's order, and the simulator's closed feed sends its initial requests the same ramp
apart (in cluster time); the report keeps every request's first token on both sides."""

from __future__ import annotations

import asyncio
import time

import pytest

from helixserve.bench.client import RequestResult
from helixserve.rehearse import run as rehearse_run
from helixserve.rehearse.inputs import load_inputs
from helixserve.rehearse.run import Drive, Sent, request_timelines, simulate
from helixserve.simulator.workload import TraceRequest
from tests.unit.rehearse.test_rehearse_inputs import TESTS, data


def inputs():  # type: ignore[no-untyped-def]
    return load_inputs(TESTS / "data" / "rehearse" / "six-nodes.yaml", data("models", "llama-2-70b"),
                       data("profiles", "helix-measured.csv"),
                       TESTS / "data" / "rehearse" / "six-nodes.json",
                       TESTS / "data" / "rehearse" / "small-trace.csv")


def test_offline_streams_send_their_first_requests_in_the_traces_order_a_ramp_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[float, int]] = []

    async def held(client, cfg, req, result):  # type: ignore[no-untyped-def]
        # the request's text is prompt_tokens - 1 one-token words (run.bench_request)
        calls.append((time.perf_counter(), len(req.prompt.split()) + 1))
        await asyncio.sleep(3600)  # held until the run's cut
        return result

    monkeypatch.setattr(rehearse_run, "send_one", held)
    reqs = [TraceRequest(f"r{i}", 0.0, 10 + i, 4) for i in range(8)]
    ramp_s = 0.02
    run = asyncio.run(rehearse_run.drive("http://127.0.0.1:9/v1", "m", reqs, offline=True,
                                         duration_s=0.5, time_scale=1.0, concurrency=8,
                                         ramp_s=ramp_s))
    # each stream sent the trace's next request, in the trace's order
    assert [prompt for _, prompt in calls] == [q.prompt_tokens for q in reqs]
    assert [s.trace.request_id for s in run.sent] == [q.request_id for q in reqs]
    # stream k not before k + 1 ramps (the simulator's initial feed times); a lower bound
    # only: a loaded host may send later, never earlier
    for k, (at, _) in enumerate(calls):
        assert at - run.t0 >= (k + 1) * ramp_s - 1e-3


def test_the_simulated_feed_sends_its_initial_requests_the_same_ramp_apart() -> None:
    out = simulate(inputs(), offline=True, duration_s=20.0, warmup_s=0.0, concurrency=4,
                   ramp_s=0.25)
    first = out["requests"][:4]
    assert [r["arrival_s"] for r in first] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # the trace's first four, in its order
    assert [r["prompt_tokens"] for r in first] == [q.prompt_tokens for q in inputs().requests[:4]]
    assert all(r["route"] for r in first)
    assert out["engine_config"]["offline_feed"] == "closed"


def test_request_timelines_keep_each_requests_first_token_and_window_tokens() -> None:
    def sent(arrival_s: float, ttft_s: float, gaps: list[float], prompt: int) -> Sent:
        r = RequestResult(ttft_s=ttft_s, itl_s=gaps, start_s=100.0 + arrival_s)
        return Sent(TraceRequest("r", arrival_s, prompt, 10), arrival_s, r)

    run = Drive([sent(0.0, 2.0, [1.0, 1.0, 1.0], 50),  # tokens at 2, 3, 4, 5
                 sent(0.5, 0.0, [], 70)], t0=100.0, wall_s=10.0)  # no token yet
    rows = request_timelines(run, time_scale=2.0, warmup_s=1.5, duration_s=2.4)
    # cluster time = wall / 2: tokens at 1, 1.5, 2, 2.5; in [1.5, 2.4]: two
    assert rows[0] == {"prompt_tokens": 50, "arrival_s": 0.0, "first_token_s": 1.0,
                       "tokens_in_window": 2}
    assert rows[1]["first_token_s"] is None and rows[1]["tokens_in_window"] == 0
