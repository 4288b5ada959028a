"""Profiles, placements, workloads, and the two numbers of each row: measured and simulated.

Both sides get the same requests (prompt and output lengths; all arriving at t = 0, a
bounded burst) and the same placement, and their metrics are computed by one function
(`metrics`) from per-request times: decode tokens/s = output tokens / (last finish - first
arrival), TTFT and TPOT p50/p95 over requests (TPOT = (e2e - TTFT) / (output - 1)).
The prompt lengths the simulator gets are the ones the server counted (`usage`).
"""

from __future__ import annotations

import asyncio
import csv
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.rig.clusters import RigCluster, gpu_class
from benchmarks.rig.speed import SpeedControl
from benchmarks.rig.stack import child_env

#: `helixserve profile` points: prompt batches up to what a worker step batches in a burst
PROFILE_PROMPT_TOKENS = "64,256,512,1024,2048"
PROFILE_DECODE_BATCHES = "1,4,8,16,32"
#: the simulator's engine models the rig compares (helixserve/simulator/presets.py presets,
#: plus `runtime`: see runtime_engine); the first is the row's "simulated"
SIM_ENGINES = ("runtime", "vllm", "reserve")
METRIC_KEYS = ("decode_tokens_per_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s")


@dataclass(frozen=True)
class Workload:
    name: str
    #: (prompt tokens, output tokens) per request, all arriving at t = 0
    requests: tuple[tuple[int, int], ...]


def conversation(num: int, max_prompt: int, max_output: int) -> Workload:
    """The first `num` requests of the Azure conversation trace, lengths scaled to fit."""
    from helixserve.bench.datasets import default_trace_path, load_azure_conv

    reqs = load_azure_conv(default_trace_path(), num, 0, max_prompt, max_output)
    return Workload("conversation", tuple((r.prompt_tokens, r.output_tokens) for r in reqs))


def prefill_heavy(num: int, prompt: int, output: int) -> Workload:
    """Long prompts, short answers (RAG, summarisation): `prompt` +-10%, `output` tokens."""
    import random

    rng = random.Random(0)
    return Workload("prefill-heavy", tuple(
        (round(prompt * rng.uniform(0.9, 1.1)), output) for _ in range(num)))


# ---- profiles ------------------------------------------------------------------------------


def profile_class(model_dir: Path, slowdown: float, out: Path, speed: SpeedControl,
                  repeats: int) -> Path:
    """`helixserve profile` of one speed class (through its slowdown or cgroup), gpu column
    relabelled to the class's pseudo-GPU on every row (layer and head rows alike)."""
    raw = out.with_suffix(".raw.csv")
    cmd = [
        sys.executable, "-m", "helixserve", "profile", "--model", str(model_dir),
        "--out", str(raw), "--threads", "1", "--layers", "1", "--repeats", str(repeats),
        "--prompt-tokens", PROFILE_PROMPT_TOKENS, "--decode-batches", PROFILE_DECODE_BATCHES,
        *speed.worker_args(slowdown),
    ]  # fmt: skip
    preexec = speed.preexec(f"profile-{gpu_class(slowdown)}", slowdown)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(),
                          preexec_fn=preexec, timeout=900)  # noqa: PLW1509
    if proc.returncode != 0:
        raise RuntimeError(f"helixserve profile failed: {proc.stderr.strip()[-800:]}")
    with raw.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["gpu"] = gpu_class(slowdown)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    raw.unlink()
    return out


def cluster_profiles(cluster: RigCluster, model_dir: Path, cache: Path, speed: SpeedControl,
                     repeats: int, reprofile: bool, log: Any) -> Path:
    """One profiles CSV for the cluster's classes, measured just before the cluster runs
    (the host's other load drifts; a profile from another time mispredicts every row)."""
    cache.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, str]] = []
    columns: list[str] = []
    for s in cluster.classes():
        path = cache / f"{cluster.name}-{gpu_class(s)}-{speed.mode}.csv"
        if reprofile or not path.is_file():
            log(f"  profiling {gpu_class(s)} ({speed.mode})")
            profile_class(model_dir, s, path, speed, repeats)
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            columns += [c for c in reader.fieldnames or [] if c not in columns]
            rows += list(reader)
    # a class cached before the profiles had a `part` column (its rows are all layer rows)
    # merges with newer ones: a missing column is written empty, which reads as its default
    out = cache / f"profiles-{cluster.name}-{speed.mode}.csv"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, restval="")
        w.writeheader()
        w.writerows(rows)
    return out


def probe_ms(model_dir: Path) -> float:
    """A host-load probe: `helixserve profile`'s prompt step of 512 tokens and decode step
    of batch 8 on 2 layers, 1 thread, no slowdown; the geometric mean of the two (ms per
    layer). Its ratio to the same probe taken at profiling time says how much slower the
    host was when a row was measured (other load on the shared cores)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.csv"
        cmd = [sys.executable, "-m", "helixserve", "profile", "--model", str(model_dir),
               "--out", str(out), "--threads", "1", "--layers", "2", "--repeats", "5",
               "--prompt-tokens", "512", "--decode-batches", "8"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)
        if proc.returncode != 0:
            return float("nan")
        with out.open(newline="") as f:
            # layer rows only: the probe is per-layer time (head rows come with them since
            # `profile` times the head too)
            times = [float(r["layer_ms"]) for r in csv.DictReader(f)
                     if (r.get("part") or "layer") == "layer"]
        return math.prod(times) ** (1 / len(times))


def scaled_profiles(path: Path, factor: float, out: Path) -> Path:
    """The profiles CSV with every layer_ms x factor (the host's speed at another time; head
    rows too, they ran on the same host)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["layer_ms"] = f"{float(r['layer_ms']) * factor:.4f}"
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out


# ---- metrics -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestTimes:
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    first_s: float
    finish_s: float


def metrics(times: list[RequestTimes]) -> dict[str, float]:
    from helixserve.bench.report import percentile

    if not times:
        return dict.fromkeys(METRIC_KEYS, 0.0)
    span = max(t.finish_s for t in times) - min(t.arrival_s for t in times)
    ttft = [t.first_s - t.arrival_s for t in times]
    tpot = [(t.finish_s - t.first_s) / (t.output_tokens - 1) for t in times if t.output_tokens > 1]
    return {
        "decode_tokens_per_s": sum(t.output_tokens for t in times) / span if span > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p95_s": percentile(tpot, 95),
        "requests": float(len(times)),
        "makespan_s": span,
    }


# ---- measured ------------------------------------------------------------------------------


def measure(api_url: str, model_name: str, workload: Workload,
            timeout_s: float) -> tuple[dict[str, float], list[RequestTimes], list[str]]:
    """Send the workload's burst through the bench client; metrics, times, errors."""
    import random

    from helixserve.bench.client import ClientConfig, run_requests
    from helixserve.bench.datasets import BenchRequest, make_prompt

    rng = random.Random(0)
    reqs = [BenchRequest(make_prompt(p, rng), p, o) for p, o in workload.requests]
    cfg = ClientConfig(base_url=api_url, model=model_name, timeout_s=timeout_s)
    results, _ = asyncio.run(run_requests(cfg, reqs))
    t0 = min(r.start_s for r in results)
    times = [RequestTimes(r.prompt_tokens, r.output_tokens, r.start_s - t0,
                          r.start_s - t0 + r.ttft_s, r.start_s - t0 + r.e2e_s)
             for r in results if r.success]
    errors = [r.error for r in results if not r.success]
    return metrics(times), times, errors


def median_metrics(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per metric, the median over repeated bursts (each metric on its own)."""
    import statistics

    return {k: float(statistics.median(r[k] for r in runs)) for k in runs[0]}


# ---- simulated -----------------------------------------------------------------------------


def runtime_engine() -> dict[str, Any]:
    """SimConfig engine fields of what the runtime does: on-demand KV with the
    coordinator's watermark; prompts travel in chunks of the coordinator's prefill chunk,
    and a worker step runs prompt chunks oldest first up to the worker's per-step prompt
    budget (`--step-prompt-tokens`, the scheduling core's `plan_step`); the coordinator has
    no cap on requests prefilling at once."""
    from helixserve.runtime.config import CoordinatorConfig
    from helixserve.simulator.presets import engine_config
    from helixserve.spec.scheduling import DEFAULT_STEP_PROMPT_TOKENS

    runtime = CoordinatorConfig()
    return engine_config("vllm", chunked_prefill=True, kv_allocation=runtime.kv_allocation,
                         kv_watermark=runtime.kv_watermark,
                         max_prompt_tokens=DEFAULT_STEP_PROMPT_TOKENS,
                         max_prefilling=10**9)


def simulate(cluster_spec: Any, model: Any, cost: Any, placement: Any,
             lengths: list[tuple[int, int]], engine: str = SIM_ENGINES[0]) -> dict[str, float]:
    """`helixserve simulate`'s code path (Simulation, maxflow routing, an engine model)
    on the same requests, all arriving at t = 0."""
    from helixserve.simulator.presets import engine_config
    from helixserve.simulator.sim import SimConfig, Simulation
    from helixserve.simulator.workload import TraceRequest

    requests = [TraceRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate(lengths)]
    fields = runtime_engine() if engine == "runtime" else engine_config(engine)
    config = SimConfig(duration_s=7200.0, scheduler="maxflow", **fields)
    result = Simulation(cluster_spec, model, cost, placement, requests, config).run()
    times = [RequestTimes(r.prompt, r.output, r.arrival_s, r.first_s, r.finish_s)
             for r in result.finished]
    out = metrics(times)
    out["unfinished"] = float(len(requests) - len(result.finished))
    return out
