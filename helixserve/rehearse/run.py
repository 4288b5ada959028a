"""One rehearsal: the trace through the real HTTP API, and the simulator on the same
placement and trace, reduced to the same numbers.

Load (`drive`), through the project's bench client (`helixserve.bench.client.send_one`:
streaming completions, `max_tokens` + `ignore_eos`, so every request generates its trace
length):
- online: each trace request (Helix's length filter; arrivals rescaled to `--rate`) is sent at
  its arrival time, x the time scale;
- offline: a closed loop of `concurrency` streams, each sending the trace's next request
  (in order, cycled) when its last one ends: the cluster kept busy.
Order: offline, stream k sends its first request (k + 1) x OFFLINE_RAMP_S wall seconds after
the start, and the simulator's closed feed sends its initial requests OFFLINE_RAMP_S / K
apart: both sides queue the trace's requests in its order. Sent at once, a burst reached the
coordinator's queue in the API server's order (the first 34 of 256 last), and a cold start's
decode tokens/s are the first tokens of the prompts that complete first (docs/rehearse.md,
"Order"); `request_timelines` keeps each request's first token to compare the order.
At `duration_s` (cluster time) the run is cut: requests still streaming are cancelled (the
client closes them; the coordinator releases their KV), so the run takes duration x K.

Both sides are reduced by the same rules, the simulator's (`simulator/metrics.py`), over the
window [warmup_s, duration_s] of cluster time:
- decode tokens/s: output tokens that reached the client in the window / its length;
- prompt tokens/s: prompts whose first token came in the window / its length;
- TTFT, TPOT p50/p95 over the requests that arrived in the window and finished by its end
  (TTFT = first token - arrival, admission wait included; TPOT = (finish - first token) /
  (output - 1)).
The simulator gets the same requests: online the same arrivals; offline its "closed" feed
(the same number of streams, the trace in the same order, cycled). Its engine model is the
`vllm` preset set to what the runtime does (`simulator_fields`): no cap on requests
prefilling, the preemption victim is the requester, prompt chunks as the coordinator sizes
them, and each chunk run whole in one step, never cut again to fill a step's budget (the
workers' rule, runtime/worker.py: a chunk that does not fit what is left of the step waits
for the next step; the torch and vllm engines run the worker's batch as it is).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

from helixserve.bench.client import ClientConfig, RequestResult, send_one
from helixserve.bench.datasets import BenchRequest, make_prompt
from helixserve.bench.report import percentile
from helixserve.rehearse.inputs import RehearsalInputs
from helixserve.simulator.workload import TraceRequest

#: the metric keys of both sides, in the table's order
METRIC_KEYS = ("decode_tokens_per_s", "prompt_tokens_per_s", "ttft_p50_s", "ttft_p95_s",
               "tpot_p50_s", "tpot_p95_s")
#: most streams an offline run keeps in flight (the coordinator queues at most 256 more)
MAX_OFFLINE_STREAMS = 256
#: most streams `--concurrency` may ask for
MAX_CONCURRENCY = 4096
#: seconds of cluster time an offline stream waits after a failed request before its next
FAILED_PAUSE_S = 0.5
#: seconds a client waits for a request before giving up on it (the run's cut comes first)
REQUEST_TIMEOUT_S = 3600.0
#: wall seconds between the offline streams' first requests (module doc, "Order"): the API
#: server takes a burst in its own order (seen: the first 34 of 256 requests sent at once
#: reached the coordinator's queue last), and a cold start's decode depends on which prompts
#: go first; spaced, each is queued before the next is sent, as the simulator assumes. A
#: burst of 256 took the coordinator ~4 ms a request on this loaded 2-core host
OFFLINE_RAMP_S = 0.01


@dataclass
class Sent:
    """One request the client sent; times in seconds of cluster time from the run's start."""

    trace: TraceRequest
    arrival_s: float
    result: RequestResult = field(default_factory=RequestResult)

    def chunk_times_s(self, t0: float, time_scale: float) -> list[float]:
        """When each streamed chunk with text came (cluster time)."""
        r = self.result
        if r.ttft_s <= 0:
            return []
        times = [(r.start_s + r.ttft_s - t0) / time_scale]
        for gap in r.itl_s:
            times.append(times[-1] + gap / time_scale)
        return times

    @property
    def finished(self) -> bool:
        return self.result.success

    @property
    def failed(self) -> bool:
        return bool(self.result.error) and not self.result.success


@dataclass
class Drive:
    """What the client sent and when the run started (perf_counter seconds)."""

    sent: list[Sent]
    t0: float
    wall_s: float


def offline_concurrency(inputs: RehearsalInputs, limit: int = MAX_OFFLINE_STREAMS) -> int:
    """Streams an offline run keeps in flight: the requests the cluster's KV holds at once
    (on the layer whose holders have the least KV together, each request of the trace's
    mean prompt + output), at least 1 and at most `limit`."""
    placement, cost = inputs.placement, inputs.cost
    per_layer = [0] * placement.num_layers
    for r in placement.nodes:
        kv = cost.kv_capacity_tokens(inputs.cluster.node(r.name), r.num_layers)
        for layer in range(r.start_layer, r.end_layer):
            per_layer[layer] += kv
    reqs = inputs.requests
    mean_tokens = sum(q.prompt_tokens + q.output_tokens for q in reqs) / len(reqs)
    return max(1, min(limit, int(min(per_layer) / mean_tokens)))


def unsaturated_note(inputs: RehearsalInputs, streams: int) -> str:
    """"" or a note that `streams` keep fewer requests in flight than the KV holds: the
    default's cap (MAX_OFFLINE_STREAMS) is a lighter load than a saturated cluster, and on
    helix-mix-42 it ranks placements the other way round (docs/benchmarks.md, "The
    rehearsal's 256 streams are a lighter load")."""
    held = offline_concurrency(inputs, limit=MAX_CONCURRENCY)
    if held <= streams:
        return ""
    return (f"; not saturated: the KV holds {held} requests, --concurrency {held} fills it")


def planned_load_note(inputs: RehearsalInputs, streams: int) -> str:
    """"" or a note that the placement was planned for another load than `streams` requests
    in flight (its `served_concurrency`, `plan --serve-concurrency`): a placement ranks
    differently at different loads (docs/planner.md, "Planning for a stated load")."""
    planned = inputs.placement.served_concurrency
    if planned is None or planned == streams:
        return ""
    return (f"; the placement was planned for {planned} requests in flight, --concurrency "
            f"{planned} rehearses that load")


def bench_request(q: TraceRequest, rng: random.Random) -> BenchRequest:
    """The trace request as text: prompt_tokens - 1 one-token words, since the server's count
    includes the BOS token its tokenizer adds (the emulated tokenizer does)."""
    return BenchRequest(make_prompt(max(1, q.prompt_tokens - 1), rng), q.prompt_tokens,
                        q.output_tokens)


async def drive(api_url: str, model_name: str, requests: list[TraceRequest], *, offline: bool,
                duration_s: float, time_scale: float, concurrency: int,
                ramp_s: float = OFFLINE_RAMP_S) -> Drive:
    """Send the load (module doc) and cut it at `duration_s` of cluster time; offline, the
    streams' first requests `ramp_s` wall seconds apart."""
    import httpx

    cfg = ClientConfig(base_url=api_url, model=model_name, timeout_s=REQUEST_TIMEOUT_S)
    width = concurrency if offline else len(requests)
    limits = httpx.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    sent: list[Sent] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0),
                                 limits=limits) as client:
        t0 = time.perf_counter()
        end = t0 + duration_s * time_scale

        def now_s() -> float:
            return (time.perf_counter() - t0) / time_scale

        async def one(i: int) -> Sent:
            s = Sent(requests[i], now_s())
            sent.append(s)
            # the text of trace request i, the same in every run (built when sent: a trace
            # of 19,000 requests of ~1,000 words each is not built up front)
            await send_one(client, cfg, bench_request(requests[i], random.Random(i)), s.result)
            return s

        async def stream(k: int, order: itertools.count[int]) -> None:
            # stream k sends its first request k + 1 ramps after the start, as the
            # simulator's feed does (offline.py `initial_times_s`; module doc, "Order")
            delay = t0 + (k + 1) * ramp_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            while time.perf_counter() < end:
                done = await one(next(order) % len(requests))
                if done.failed:  # refused (e.g. a full queue): no tight loop of refusals
                    await asyncio.sleep(FAILED_PAUSE_S * time_scale)

        async def arrivals() -> None:
            tasks = []
            for i, q in enumerate(requests):
                if q.arrival_s >= duration_s:
                    break
                delay = t0 + q.arrival_s * time_scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)

        order = itertools.count()
        work = ([asyncio.create_task(stream(k, order)) for k in range(concurrency)] if offline
                else [asyncio.create_task(arrivals())])
        _, pending = await asyncio.wait(work, timeout=max(0.0, end - time.perf_counter()))
        for task in pending:
            task.cancel()  # the run's cut: streaming requests are closed
        await asyncio.gather(*work, return_exceptions=True)
        wall_s = time.perf_counter() - t0
    return Drive(sent, t0, wall_s)


def measured_metrics(run: Drive, time_scale: float, warmup_s: float,
                     duration_s: float) -> dict[str, Any]:
    """The run's numbers by the simulator's rules (module doc), in cluster time."""
    window_s = duration_s - warmup_s
    decode = prompt = 0.0
    ttft, tpot = [], []
    for s in run.sent:
        times = s.chunk_times_s(run.t0, time_scale)
        if not times:
            continue
        r = s.result
        # a chunk normally carries one token; the server's count weighs them when it says
        weight = r.output_tokens / len(times) if s.finished and r.output_tokens else 1.0
        decode += weight * sum(1 for t in times if warmup_s <= t <= duration_s)
        if warmup_s <= times[0] <= duration_s:
            prompt += r.prompt_tokens or s.trace.prompt_tokens
        if not s.finished or s.arrival_s < warmup_s:
            continue
        finish_s = (r.start_s + r.e2e_s - run.t0) / time_scale
        if finish_s > duration_s:
            continue
        ttft.append(r.ttft_s / time_scale)
        if r.output_tokens > 1:
            tpot.append((r.e2e_s - r.ttft_s) / time_scale / (r.output_tokens - 1))
    return {
        "decode_tokens_per_s": decode / window_s,
        "prompt_tokens_per_s": prompt / window_s,
        **_latency_keys(ttft, tpot),
        "requests_sent": len(run.sent),
        "requests_finished": len(ttft),
        "requests_failed": sum(1 for s in run.sent if s.failed),
        "output_tokens": round(sum(
            (s.result.output_tokens if s.finished else len(s.chunk_times_s(run.t0, time_scale)))
            for s in run.sent)),
    }


def request_timelines(run: Drive, time_scale: float, warmup_s: float,
                      duration_s: float) -> list[dict[str, Any]]:
    """Per request sent, in the order sent: its prompt tokens, arrival, first token (None:
    none came) and output tokens received in the window [warmup_s, duration_s], in cluster
    time: what a cold start's decode tokens/s is made of (which prompts completed first)."""
    out = []
    for s in run.sent:
        times = s.chunk_times_s(run.t0, time_scale)
        out.append({"prompt_tokens": s.trace.prompt_tokens,
                    "arrival_s": round(s.arrival_s, 4),
                    "first_token_s": round(times[0], 4) if times else None,
                    "tokens_in_window": sum(1 for t in times if warmup_s <= t <= duration_s)})
    return out


def _latency_keys(ttft: list[float], tpot: list[float]) -> dict[str, float | None]:
    """p50/p95 of TTFT and TPOT; None where no request finished in the window."""
    return {"ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "ttft_p95_s": percentile(ttft, 95) if ttft else None,
            "tpot_p50_s": percentile(tpot, 50) if tpot else None,
            "tpot_p95_s": percentile(tpot, 95) if tpot else None}


def errors_of(run: Drive) -> list[str]:
    """Distinct errors of failed requests (not the ones cut at the end)."""
    return sorted({s.result.error for s in run.sent if s.failed})[:10]


def simulator_fields(inputs: RehearsalInputs) -> dict[str, Any]:
    """The simulator's engine model of the runtime (module doc): the `vllm` preset's
    SimConfig fields, set to what the coordinator and the workers do."""
    from helixserve.runtime.transport import prefill_chunk_tokens
    from helixserve.simulator.presets import engine_config
    from helixserve.spec.scheduling import DEFAULT_PREFILL_CHUNK_TOKENS

    fields = engine_config("vllm")
    fields["max_prefilling"] = None  # the coordinator admits without such a cap
    dtype = "float32" if inputs.model.dtype_bytes == 4 else "float16"
    fields["prefill_chunk_tokens"] = prefill_chunk_tokens(
        inputs.model.hidden_size, dtype, DEFAULT_PREFILL_CHUNK_TOKENS)
    # A worker never cuts a chunk again: with the preset's cutting, a step that ends a
    # prompt's last (short) chunk fills its budget from the next chunk, whose rest runs a
    # step later; the workers run that chunk whole in the next step instead. On single-24
    # offline (40 s, 256 streams) the cutting alone made the simulator's decode 9% higher
    # on milp's placement and 7% lower on Helix's than the runtime's rule gives.
    fields["chunked_prefill"] = False
    return fields


def simulate(inputs: RehearsalInputs, *, offline: bool, duration_s: float, warmup_s: float,
             concurrency: int, ramp_s: float = 0.0,
             prefix_caching: bool = True) -> dict[str, Any]:
    """`helixserve simulate`'s code path on the same placement and requests (module doc):
    {"metrics": the METRIC_KEYS and request counts, "summary": the simulator's summary}.
    `ramp_s`: offline, seconds of cluster time between the streams' first requests (the
    client's OFFLINE_RAMP_S / time scale). `prefix_caching`: the simulator's prefix cache
    (it only hits for requests whose token ids the trace gives)."""
    from helixserve.simulator.config import closed_loop
    from helixserve.simulator.metrics import latencies, summarize
    from helixserve.simulator.sim import SimConfig, Simulation
    from helixserve.spec.scheduling import RUNTIME_VICTIM_RULE

    fields = simulator_fields(inputs)
    requests = inputs.requests if offline else [
        q for q in inputs.requests if q.arrival_s < duration_s]
    config = SimConfig(duration_s=duration_s, warmup_s=warmup_s, offline=offline,
                       **closed_loop(max(1, concurrency)),
                       feed_interval_s=ramp_s, scheduler="maxflow",
                       victim_rule=RUNTIME_VICTIM_RULE, prefix_caching=prefix_caching,
                       **fields)
    sim = Simulation(inputs.cluster, inputs.model, inputs.cost, inputs.placement, requests,
                     config)
    result = sim.run()
    summary = summarize(result)
    timeline = _simulated_timelines(sim)
    lat = latencies(result)
    return {
        "metrics": {
            "decode_tokens_per_s": summary["decode_throughput_tokens_per_s"],
            "prompt_tokens_per_s": summary["prompt_throughput_tokens_per_s"],
            **_latency_keys(lat["ttft_s"], lat["tpot_s"]),
            "requests_sent": summary["requests_arrived"],
            "requests_finished": len(lat["ttft_s"]),
            "requests_failed": summary["requests_rejected"],
            "output_tokens": result.decode_tokens,
        },
        "summary": summary,
        "requests": timeline,
        "engine_config": {k: v for k, v in config.__dict__.items()
                          if k in fields or k in ("victim_rule", "offline_feed")},
    }


def _simulated_timelines(sim: Any) -> list[dict[str, Any]]:
    """`request_timelines` of the simulated side: every request admitted (finished or in
    flight at the end), in the order they arrived; `tokens_in_window` is left out (the
    simulator counts tokens, not their times, per request), `generated` is the tokens it had
    by the end instead."""
    reqs = [*sim.finished, *sim.running.values(), *sim.waiting.values()]
    reqs.sort(key=lambda r: (r.arrival_s, int(r.rid.rsplit("-", 1)[-1])
                             if r.rid.rsplit("-", 1)[-1].isdigit() else 0))
    return [{"prompt_tokens": r.prompt - r.replayed, "arrival_s": round(r.arrival_s, 4),
             "first_token_s": None if r.first_s != r.first_s else round(r.first_s, 4),
             "generated": r.generated,
             "route": [n.name for n in r.nodes]} for r in reqs]
