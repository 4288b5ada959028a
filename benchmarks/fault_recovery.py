"""Lose a machine, lose nothing: kill -9 the only holder of a layer range under load.

Starts `helixserve demo` (3 CPU workers of SmolLM2-135M, the MILP placement, supervision and
live re-planning on), drives it with N concurrent streaming chat requests (greedy, fixed
length), and after a warm-up sends SIGKILL to a worker that alone holds some layers. Every
route passes through that worker, so tokens stop until the coordinator has re-planned onto
the other two workers (or the supervisor's restart of the killed one is back).

Measured from the client's side, on one clock:
  * recovery_s: from the kill to the first token after the longest pause in the token stream
    that began after the kill (all streams merged): "time to first token served again";
  * throughput before (the window before the kill) and after (a window from `--settle-s`
    after tokens flow again: the restarted worker has rejoined by then), in generated
    tokens/s over all streams, while every stream keeps sending requests;
  * requests: started, completed, failed (an HTTP error or an error event in the stream), and
    unfinished when the run stopped (0 expected: every accepted request completes or gets a
    clear error).
The coordinator's own view (re-plan record, per-node restarts) comes from `/health`.

    python -m benchmarks.fault_recovery --json benchmarks/results/fault_recovery.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
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


@dataclass
class Run:
    streams: int
    max_tokens: int
    victim: str
    victim_layers: list[int]
    placement_before: list[dict[str, Any]] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    started: int = 0
    completed: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    kill_s: float = 0.0
    #: the stream loops start no request after this (monotonic)
    stop_at: float = float("inf")


def _find_worker_pid(placement_path: Path, node: str) -> int:
    """The pid of the demo's worker process for `node` (its command line names both)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"worker" in args and str(placement_path).encode() in args
                and node.encode() in args):
            return int(proc.name)
    raise RuntimeError(f"no worker process for node {node} of {placement_path}")


def _sole_holder(placement: dict[str, Any]) -> tuple[str, list[int]]:
    """A node that alone holds some layers (the most such layers)."""
    holders: dict[int, list[str]] = {}
    for n in placement["nodes"]:
        for layer in range(n["start_layer"], n["end_layer"]):
            holders.setdefault(layer, []).append(n["name"])
    alone: dict[str, list[int]] = {}
    for layer, names in holders.items():
        if len(names) == 1:
            alone.setdefault(names[0], []).append(layer)
    if not alone:
        raise RuntimeError("every layer has two holders: no sole holder to kill")
    name = max(alone, key=lambda n: len(alone[n]))
    return name, alone[name]


async def _stream_loop(client: httpx.AsyncClient, url: str, run: Run, index: int,
                       model: str) -> None:
    k = index
    while time.monotonic() < run.stop_at:
        body = {"model": model, "stream": True, "max_tokens": run.max_tokens, "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]}
        k += 1
        run.started += 1
        try:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    run.failed += 1
                    run.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                    continue
                failed = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        failed = True
                        run.errors.append(str(data["error"].get("message"))[:200])
                        continue
                    if data["choices"] and data["choices"][0]["delta"].get("content"):
                        run.token_times_s.append(time.monotonic())
                if failed:
                    run.failed += 1
                else:
                    run.completed += 1
        except httpx.HTTPError as exc:
            run.failed += 1
            run.errors.append(f"{type(exc).__name__}: {exc}")


def _rate(times: list[float], start: float, end: float) -> float:
    return sum(1 for t in times if start <= t < end) / (end - start) if end > start else 0.0


def analyse(run: Run, before_s: float, after_s: float, settle_s: float) -> dict[str, Any]:
    times = sorted(run.token_times_s)
    after_kill = [t for t in times if t >= run.kill_s]
    # the longest pause that began after the kill (the last token before the kill counts as
    # its start if nothing came in between)
    prev = max((t for t in times if t < run.kill_s), default=run.kill_s)
    gap, resume = 0.0, None
    for t in after_kill:
        if t - prev > gap:
            gap, resume = t - prev, t
        prev = t
    recovery_s = None if resume is None else resume - run.kill_s
    before = _rate(times, run.kill_s - before_s, run.kill_s)
    after = (None if resume is None
             else _rate(times, resume + settle_s, resume + settle_s + after_s))
    return {
        "recovery_s": recovery_s,
        "longest_pause_s": gap,
        "throughput_before_tokens_per_s": before,
        "throughput_after_tokens_per_s": after,
        "requests_started": run.started,
        "requests_completed": run.completed,
        "requests_failed": run.failed,
        "requests_unfinished": run.started - run.completed - run.failed,
        "errors": run.errors[:10],
    }


async def drive(url: str, run: Run, warmup_s: float, before_s: float, after_s: float,
                settle_s: float, kill: Any, model: str) -> None:
    limits = httpx.Limits(max_connections=run.streams + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits) as client:
        tasks = [asyncio.create_task(_stream_loop(client, url, run, i, model))
                 for i in range(run.streams)]
        await asyncio.sleep(warmup_s + before_s)
        run.kill_s = time.monotonic()
        kill()
        # stop new requests once the after-window has passed after tokens flow again
        deadline = run.kill_s + 180.0
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            flowing = [t for t in run.token_times_s if t > run.kill_s + 1.0]
            if len(flowing) > 50 and time.monotonic() > flowing[0] + settle_s + after_s + 1.0:
                break
        run.stop_at = time.monotonic()  # the loops end after their current request
        _, pending = await asyncio.wait(tasks, timeout=300.0)
        for task in pending:  # a request that hangs: counted as unfinished
            task.cancel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--before-s", type=float, default=20.0)
    ap.add_argument("--after-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=30.0,
                    help="start the after-window this long after tokens flow again")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="helix-fault-"))
    url = f"http://127.0.0.1:{args.port}"
    workdir.mkdir(parents=True, exist_ok=True)
    log = (workdir / "demo.log").open("w")
    demo = subprocess.Popen(
        [sys.executable, "-m", "helixserve", "demo", "--port", str(args.port),
         "--workdir", str(workdir)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_ready(demo, args.port, workdir / "demo.log", 300, path="/health")
        placement_path = workdir / "placement.json"
        placement = json.loads(placement_path.read_text())
        victim, layers = _sole_holder(placement)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        run = Run(args.streams, args.max_tokens, victim, [layers[0], layers[-1] + 1],
                  placement_before=placement["nodes"])
        pid = _find_worker_pid(placement_path, victim)
        print(f"placement: {placement['nodes']}; killing {victim} (pid {pid}), sole holder "
              f"of layers [{layers[0]}, {layers[-1] + 1}), after "
              f"{args.warmup_s + args.before_s:.0f} s of {args.streams} streams", flush=True)
        asyncio.run(drive(url, run, args.warmup_s, args.before_s, args.after_s, args.settle_s,
                          lambda: os.kill(pid, signal.SIGKILL), model))
        result = analyse(run, args.before_s, args.after_s, args.settle_s)
        health = httpx.get(url + "/health", timeout=10)
        result["health_after"] = health.json()
        result["config"] = {k: v for k, v in asdict(run).items()
                            if k not in ("token_times_s", "errors", "started", "completed",
                                         "failed", "kill_s")}
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            demo.kill()
            demo.wait()
        log.close()
    rows = [
        ("streams", args.streams),
        ("killed (sole holder)", f"{victim} layers [{layers[0]}, {layers[-1] + 1})"),
        ("kill -> first token again (s)", _fmt(result["recovery_s"])),
        ("throughput before (tokens/s)", _fmt(result["throughput_before_tokens_per_s"])),
        ("throughput after (tokens/s)", _fmt(result["throughput_after_tokens_per_s"])),
        ("requests started", result["requests_started"]),
        ("requests completed", result["requests_completed"]),
        ("requests failed (lost)", result["requests_failed"]),
        ("requests unfinished", result["requests_unfinished"]),
    ]
    rec = (result["health_after"].get("recovery") or {})
    last = rec.get("last") or {}
    rows += [("re-plans", rec.get("replans")),
             ("last re-plan: plan / load / total (s)",
              f"{_fmt(last.get('plan_s'))} / {_fmt(last.get('load_s'))} / "
              f"{_fmt(last.get('total_s'))}")]
    restarts = {n: d.get("restarts") for n, d in result["health_after"]["nodes"].items()}
    rows.append(("supervisor restarts", restarts))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if result["errors"]:
        print("errors:", *result["errors"], sep="\n  ")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
