"""A frozen engine on the demo: detected and routed around, under 16 streams, lose nothing.

Starts `helixserve demo` as a user does (3 CPU workers of SmolLM2-135M, the MILP placement,
mutual TLS, supervision and live re-planning on, every default: `worker --engine-stall-s`
20 s, `--hang-timeout-s` 10 s), with the test-only `HELIXSERVE_TEST_ENGINE_HANG` set to
`@<workdir>/hang-{node}:<seconds>`: a worker's engine thread sleeps that long before its
first step after its file appears, while its process, sockets, event loop, Info and health
keep going (runtime/worker.py, Liveness). N concurrent streams (the real `openai` client,
greedy chat of a fixed length, each stream sending requests one after the other) run through
the API; after a warm-up the benchmark creates the victim's file. Cases (`--case`):

  alternative  a node every layer of which another live node holds too (the demo's second
               route): the coordinator re-routes the frozen node's requests, no re-plan;
  sole         the node that alone holds some layers: every route passes through it, so the
               coordinator must re-plan the other two workers to cover its layers (LoadRange).

Measured on one clock (unix time), from the freeze (the worker logs the moment its engine
thread stops):
  * health NOT_SERVING: the victim's gRPC health check (polled every 0.2 s with the demo's
    coordinator certificate) no longer says SERVING;
  * node down: the coordinator's /health says the node is not alive (polled every 0.25 s);
  * service back: the last request that was stalled by the freeze (a pause of more than
    `--stall-gap-s` in its token stream overlapping the freeze) gets its next token; for the
    sole holder that is every request;
  * requests: started, completed, errored (an HTTP error or an error event: a clear error),
    lost (unfinished when the run stopped: none expected), and completed outputs that differ
    from the same prompt's output completed before the freeze (or, without one, the text most
    of its completions gave; greedy: none expected; a gap or a duplicate would show here).

    python -m benchmarks.engine_stall_demo --case both --json benchmarks/results/engine_stall_demo.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving_vllm import wait_ready

PROMPTS = [
    "Tell me a short story about a lighthouse keeper.",
    "Explain why the sky is blue.",
    "Write a haiku about autumn rain.",
    "What is the capital of France, and why is it famous?",
]
HANG_ENV = "HELIXSERVE_TEST_ENGINE_HANG"  # runtime/worker.py; read nowhere else


@dataclass
class Request:
    stream: int
    prompt: int
    start_s: float
    token_times_s: list[float] = field(default_factory=list)
    text: str = ""
    end_s: float | None = None
    error: str | None = None


@dataclass
class Run:
    case: str
    victim: str
    victim_layers: tuple[int, int]
    streams: int
    max_tokens: int
    requests: list[Request] = field(default_factory=list)
    stop_at: float = float("inf")
    #: first time each was observed (unix time)
    seen: dict[str, float] = field(default_factory=dict)
    #: the coordinator's reason for marking the victim down
    down_reason: str = ""


def _holders(placement: dict[str, Any]) -> dict[int, list[str]]:
    holders: dict[int, list[str]] = {}
    for n in placement["nodes"]:
        for layer in range(n["start_layer"], n["end_layer"]):
            holders.setdefault(layer, []).append(n["name"])
    return holders


def pick_victim(placement: dict[str, Any], case: str) -> tuple[str, tuple[int, int]]:
    """The node to freeze for `case` and its layer range (RuntimeError when the placement
    has no such node)."""
    holders = _holders(placement)
    ranges = {n["name"]: (n["start_layer"], n["end_layer"]) for n in placement["nodes"]}

    def alone(name: str) -> int:
        return sum(1 for layer in range(*ranges[name]) if holders[layer] == [name])

    if case == "sole":
        sole = [n for n in ranges if alone(n)]
        if not sole:
            raise RuntimeError(f"every layer has two holders in {ranges}: no sole holder")
        name = max(sole, key=alone)
    else:
        covered = [n for n in ranges if not alone(n)]
        if not covered:
            raise RuntimeError(f"every node alone holds some layers in {ranges}: no node with "
                               "an alternative route")
        name = covered[0]
    return name, ranges[name]


async def _stream_loop(client: Any, run: Run, index: int, model: str) -> None:
    import openai

    k = index
    while time.time() < run.stop_at:
        req = Request(index, k % len(PROMPTS), time.time())
        k += 1
        run.requests.append(req)
        try:
            stream = await client.chat.completions.create(
                model=model, stream=True, max_tokens=run.max_tokens, temperature=0,
                messages=[{"role": "user", "content": PROMPTS[req.prompt]}],
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    req.token_times_s.append(time.time())
                    req.text += chunk.choices[0].delta.content
        except openai.APIError as exc:
            req.error = f"{type(exc).__name__}: {exc}"[:300]
        req.end_s = time.time()


async def _watch(run: Run, url: str, address: str, tls: Any, api_key: str | None) -> None:
    """Record when the victim's health leaves SERVING and when the coordinator marks it
    down (and back)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from helixserve.runtime import security

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    channel = security.aio_channel(address, tls)
    health = health_pb2_grpc.HealthStub(channel)
    async with httpx.AsyncClient(timeout=5.0, headers=headers) as http:
        last_api = 0.0
        while True:
            now = time.time()
            with contextlib.suppress(Exception):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    run.seen.setdefault("not_serving", now)
            if now - last_api >= 0.25:
                last_api = now
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    body = (await http.get(url + "/health")).json()
                    node = body["nodes"][run.victim]
                    if not node["alive"]:
                        run.seen.setdefault("down", now)
                        run.down_reason = run.down_reason or node.get("last_down_reason") or ""
                    if body.get("status") == "ok" and "down" in run.seen:
                        run.seen.setdefault("health_ok_again", now)
            await asyncio.sleep(0.2)


def _freeze_time(log_path: Path, after: float, timeout_s: float = 60.0) -> float:
    """The unix time the victim's engine thread stopped (its log line), waiting for it."""
    deadline = time.time() + timeout_s
    pattern = re.compile(r"engine thread hangs for \d+ s now \(unix time ([\d.]+)\)")
    while time.time() < deadline:
        m = pattern.search(log_path.read_text() if log_path.exists() else "")
        if m and float(m.group(1)) >= after - 1.0:
            return float(m.group(1))
        time.sleep(0.1)
    raise RuntimeError(f"the engine of {log_path.name} did not freeze within {timeout_s:.0f} s")


def stalled_resumes(run: Run, freeze: float, down: float, gap_s: float) -> list[float]:
    """For each request the freeze stalled (a pause longer than `gap_s` in its token stream,
    counted from its start, that overlaps [freeze, down]), the time its tokens came again."""
    resumes = []
    for req in run.requests:
        marks = [req.start_s, *req.token_times_s]
        for a, b in zip(marks, marks[1:], strict=False):
            if b - a > gap_s and a <= down and b >= freeze:
                resumes.append(b)
                break
    return resumes


def analyse(run: Run, freeze: float, gap_s: float) -> dict[str, Any]:
    seen = run.seen
    down = seen.get("down", freeze)
    resumes = stalled_resumes(run, freeze, down, gap_s)
    # greedy, ignore_eos, fixed length: every completion of a prompt is the same text; the
    # reference is the text most completions of the prompt gave (one before the freeze when
    # there is one)
    done = [r for r in run.requests if r.end_s is not None and r.error is None]
    reference: dict[int, str] = {}
    for prompt in {r.prompt for r in done}:
        texts = [r.text for r in done if r.prompt == prompt]
        before = [r.text for r in done if r.prompt == prompt and (r.end_s or 0) < freeze]
        reference[prompt] = before[0] if before else max(set(texts), key=texts.count)
    differing = [r for r in done if r.text != reference[r.prompt]]
    short = [r for r in done if len(r.token_times_s) == 0]

    def since(key: str) -> float | None:
        return None if key not in seen else round(seen[key] - freeze, 2)

    return {
        "case": run.case,
        "victim": run.victim,
        "victim_layers": list(run.victim_layers),
        "streams": run.streams,
        "max_tokens": run.max_tokens,
        "freeze_to_not_serving_s": since("not_serving"),
        "freeze_to_node_down_s": since("down"),
        "freeze_to_service_back_s": (round(max(resumes) - freeze, 2) if resumes else None),
        "freeze_to_health_ok_s": since("health_ok_again"),
        "requests_stalled": len(resumes),
        "requests_started": len(run.requests),
        "requests_completed": len(done),
        "requests_errored": sum(1 for r in run.requests if r.error is not None),
        "requests_lost": sum(1 for r in run.requests if r.end_s is None),
        "in_flight_at_freeze": sum(1 for r in run.requests
                                   if r.start_s <= freeze and (r.end_s or 1e18) > freeze),
        "outputs_compared": len(done),
        "outputs_differing": len(differing),
        "completed_without_tokens": len(short),
        "errors": sorted({r.error for r in run.requests if r.error})[:5],
        "down_reason": run.down_reason,
    }


async def drive(run: Run, url: str, model: str, api_key: str | None, address: str, tls: Any,
                warmup_s: float, after_s: float, trigger: Path, log_path: Path,
                gap_s: float) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key or "none",
                                timeout=600.0, max_retries=0)
    watcher = asyncio.create_task(_watch(run, url, address, tls, api_key))
    tasks = [asyncio.create_task(_stream_loop(client, run, i, model))
             for i in range(run.streams)]
    try:
        await asyncio.sleep(warmup_s)
        touched = time.time()
        trigger.touch()
        freeze = await asyncio.to_thread(_freeze_time, log_path, touched)
        print(f"froze {run.victim}'s engine at {freeze:.3f} ({freeze - touched:.2f} s after "
              "the trigger file)", flush=True)
        # run on until the node is down, every stalled request moves again, and `after_s`
        deadline = freeze + 240.0
        while time.time() < deadline:
            await asyncio.sleep(1.0)
            if "down" not in run.seen or time.time() < run.seen["down"] + 2 * gap_s:
                continue
            resumes = stalled_resumes(run, freeze, run.seen["down"], gap_s)
            stuck = [r for r in run.requests if r.end_s is None
                     and (r.token_times_s or [r.start_s])[-1] < time.time() - gap_s]
            if not stuck and time.time() > max(resumes, default=run.seen["down"]) + after_s:
                break
        run.stop_at = time.time()  # each loop ends after its current request
        _, pending = await asyncio.wait(tasks, timeout=300.0)
        for task in pending:  # a request that hangs is counted as lost
            task.cancel()
        return freeze
    finally:
        watcher.cancel()
        await client.close()


def run_case(case: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from helixserve.runtime import security

    url = f"http://127.0.0.1:{args.port}"
    for old in workdir.glob("hang-*"):
        old.unlink()
    log = (workdir / f"demo-{case}.log").open("w")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               **{HANG_ENV: f"@{workdir}/hang-{{node}}:{args.hang_s:g}"})
    cmd = [sys.executable, "-m", "helixserve", "demo", "--port", str(args.port),
           "--workdir", str(workdir)]
    demo = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(demo, args.port, workdir / f"demo-{case}.log", 600, path="/health")
        placement = json.loads((workdir / "placement.json").read_text())
        victim, layers = pick_victim(placement, case)
        from helixserve.spec import load_cluster

        address = load_cluster(workdir / "cluster.yaml").node(victim).address
        assert address is not None
        tls_dir = workdir / "logs" / "tls"
        tls = security.load_tls(tls_dir / "coordinator.crt", tls_dir / "coordinator.key",
                                tls_dir / "ca.crt")
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        ranges = {n["name"]: [n["start_layer"], n["end_layer"]] for n in placement["nodes"]}
        print(f"[{case}] placement {ranges}; freezing {victim}'s engine {layers} after "
              f"{args.warmup_s:.0f} s of {args.streams} streams", flush=True)
        run = Run(case, victim, layers, args.streams, args.max_tokens)
        freeze = asyncio.run(drive(run, url, model, None, address, tls, args.warmup_s,
                                   args.after_s, workdir / f"hang-{victim}",
                                   workdir / "logs" / f"worker-{victim}.log", args.stall_gap_s))
        result = analyse(run, freeze, args.stall_gap_s)
        result["placement"] = ranges
        health = httpx.get(url + "/health", timeout=10).json()
        rec = health.get("recovery") or {}
        result["replans"] = rec.get("replans")
        last = rec.get("last") or {}
        result["last_replan"] = {k: last.get(k) for k in ("reason", "plan_s", "load_s", "total_s")}
        result["placement_after"] = {n: [d.get("start_layer"), d.get("end_layer"), d.get("alive")]
                                     for n, d in health.get("nodes", {}).items()}
        return result
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=90)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
        log.close()


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


ROWS = [
    ("frozen node (layers)", lambda r: f"{r['victim']} {r['victim_layers']}"),
    ("freeze -> health NOT_SERVING (s)", lambda r: _fmt(r["freeze_to_not_serving_s"])),
    ("freeze -> node down at coordinator (s)", lambda r: _fmt(r["freeze_to_node_down_s"])),
    ("freeze -> service back (s)", lambda r: _fmt(r["freeze_to_service_back_s"])),
    ("requests stalled by the freeze", lambda r: r["requests_stalled"]),
    ("re-plans", lambda r: r["replans"]),
    ("requests started", lambda r: r["requests_started"]),
    ("completed", lambda r: r["requests_completed"]),
    ("errored (clear error)", lambda r: r["requests_errored"]),
    ("lost (unfinished)", lambda r: r["requests_lost"]),
    ("outputs differing from pre-freeze", lambda r: f"{r['outputs_differing']} of "
                                                    f"{r['outputs_compared']}"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("alternative", "sole", "both"), default="both")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup-s", type=float, default=15.0)
    ap.add_argument("--after-s", type=float, default=10.0,
                    help="run on this long after the last stalled request moves again")
    ap.add_argument("--hang-s", type=float, default=900.0, help="how long the engine sleeps")
    ap.add_argument("--stall-gap-s", type=float, default=5.0,
                    help="a pause longer than this in a request's tokens counts as stalled")
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="the demo's files (one for all cases: profiled once)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="helix-stall-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cases = ["alternative", "sole"] if args.case == "both" else [args.case]
    results = [run_case(case, args, workdir) for case in cases]
    width = max(len(name) for name, _ in ROWS)
    print(f"{'':<{width}}  " + "  ".join(f"{r['case']:>16}" for r in results))
    for name, get in ROWS:
        print(f"{name:<{width}}  " + "  ".join(f"{get(r)!s:>16}" for r in results))
    for r in results:
        if r["errors"]:
            print(f"{r['case']} errors:", *r["errors"], sep="\n  ")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"load average at the end: {_fmt(load)} on {os.cpu_count()} cores")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": {"cpus": os.cpu_count(), "load_avg_1m": load,
                        "python": platform.python_version()},
            "defaults": {"engine_stall_s": 20.0, "hang_timeout_s": 10.0},
            "results": results}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
