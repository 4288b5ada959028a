"""Serving benchmark: the demo's 3-worker pipeline vs one worker holding all layers.

Both setups run the same engine and the same API (`helixserve serve` over `helixserve
worker` processes on 127.0.0.1), measured side by side in one run with `helixserve bench`
(16 concurrent streams by default, random prompts, fixed output length with ignore_eos, so
the output-token throughput is the decode throughput). Rounds alternate the two setups, so
slow drift of a shared machine hits both alike; the ratio is taken per round.

    python -m benchmarks.serving --json results/serving.json

Thread budget: each pipeline worker gets --pipeline-threads torch threads (default 1: three
processes on a 2-core machine already oversubscribe it). The single worker runs once per
--single-threads value (default 1 and all cores): with 1 it is the same engine with the same
settings as one pipeline worker; with all cores it may use the whole CPU on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from helixserve.local.launch import WorkerProcesses, WorkerSpec, free_port, wait_http_ready
from helixserve.local.stack import plan_placement, prepare_demo, write_local_cluster


def single_worker_files(
    workdir: Path, model_dir: Path, num_layers: int
) -> tuple[Path, Path, WorkerSpec]:
    spec = WorkerSpec("solo", "127.0.0.1", free_port())
    cluster = workdir / "single-cluster.yaml"
    write_local_cluster(cluster, "local-single", [spec], (4.0,))
    placement = workdir / "single-placement.json"
    # planned like the pipeline (the router needs the flows); one node: all layers
    plan_placement(model_dir, cluster, None, placement)
    if json.loads(placement.read_text())["nodes"] != [
        {"name": "solo", "start_layer": 0, "end_layer": num_layers}
    ]:
        raise RuntimeError(f"{placement}: expected one node holding all {num_layers} layers")
    return cluster, placement, spec


def run_setup(
    name: str,
    model_dir: Path,
    cluster: Path,
    placement: Path,
    workers: list[WorkerSpec],
    threads: int,
    kv_cache_bytes: int,
    workdir: Path,
    bench_args: list[str],
) -> dict[str, Any]:
    """Start workers + `helixserve serve`, run `helixserve bench`, stop everything."""
    procs = WorkerProcesses(
        model_dir, placement, workers, workdir / f"logs-{name}", num_threads=threads,
        extra_args=["--kv-cache-bytes", str(kv_cache_bytes)],
    )  # fmt: skip
    port = free_port()
    serve: subprocess.Popen[bytes] | None = None
    try:
        procs.start()
        procs.wait_ready()
        serve_log = (workdir / f"serve-{name}.log").open("wb")
        serve = subprocess.Popen(
            [sys.executable, "-m", "helixserve", "serve", "--cluster", str(cluster),
             "--placement", str(placement), "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port), *procs.coordinator_tls_flags()],
            stdout=serve_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, serve, 120.0, Path(serve_log.name))
        out = workdir / f"bench-{name}.json"
        cmd = [sys.executable, "-m", "helixserve", "bench", "--url", url,
               "--json", str(out), *bench_args]  # fmt: skip
        print(f"--- {name}: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True)
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    finally:
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=20)
            except subprocess.TimeoutExpired:
                serve.kill()
        procs.stop()


class InstantCoordinator:
    """A coordinator whose tokens cost nothing: it yields each token as soon as the API asks
    (one event-loop turn apart, as the real one waits on a queue), so what a client sees
    between tokens is the API's own cost (request handling, SSE encoding, HTTP) plus the
    client's. Used only by --api-overhead."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_name = model_dir.name
        self.max_model_len = 8192
        self._word = self.tokenizer.encode(" the", add_special_tokens=False)[0]

    async def generate(self, req: Any) -> Any:
        import asyncio

        from helixserve.runtime import TokenEvent

        for i in range(req.max_tokens):
            await asyncio.sleep(0)
            done = "length" if i + 1 == req.max_tokens else None
            yield TokenEvent(self._word, " the", None, [], done)

    def stats(self) -> dict[str, Any]:
        return {"running": 0, "waiting": 0, "nodes": {}, "routes": {}}


def _serve_instant(model_dir: Path, port: int) -> None:
    import asyncio

    from helixserve.api.app import create_app
    from helixserve.local.launch import serve_app

    app = create_app(InstantCoordinator(model_dir))  # type: ignore[arg-type]
    asyncio.run(serve_app(app, "127.0.0.1", port))


def api_overhead(model_dir: Path, workdir: Path) -> dict[str, Any]:
    """Client-side inter-token latency against InstantCoordinator, in its own process."""
    import multiprocessing

    port = free_port()
    server = multiprocessing.get_context("spawn").Process(
        target=_serve_instant, args=(model_dir, port), daemon=True
    )
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("instant API server did not start")
            time.sleep(0.1)
        out: dict[str, Any] = {}
        for conc in (1, 16):
            path = workdir / f"bench-api-overhead-c{conc}.json"
            cmd = [sys.executable, "-m", "helixserve", "bench", "--url", url, "--json", str(path),
                   "--dataset", "random", "--num-prompts", str(max(16, conc * 2)),
                   "--max-concurrency", str(conc), "--random-input-len", "64",
                   "--random-output-len", "256"]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
            out[f"concurrency_{conc}"] = json.loads(path.read_text())
        return out
    finally:
        server.terminate()
        server.join(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pipeline-threads", type=int, default=1)
    ap.add_argument(
        "--single-threads",
        default=f"1,{os.cpu_count() or 1}",
        help="comma-separated torch thread counts of the single worker, one setup each "
        "(default: 1 = same as a pipeline worker, and all cores)",
    )
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument(
        "--api-overhead",
        action="store_true",
        help="instead: per-token cost of the API alone, over a coordinator that costs nothing",
    )
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = ap.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="helix-serving-bench-"))
    if args.api_overhead:
        from helixserve.engine import prepare_demo_model

        res = api_overhead(prepare_demo_model(), workdir)
        print(f"{'concurrency':>11} {'tok/s':>9} {'ITL mean':>9} {'ITL p50':>8} "
              f"{'ITL p90':>8} {'ITL p99':>8}  (ms, API + HTTP + client, backend free)")  # fmt: skip
        for key, b in res.items():
            print(f"{key.split('_')[1]:>11} {b['output_throughput_tokens_per_s']:>9.0f} "
                  f"{b['itl']['mean_ms']:>9.3f} {b['itl']['p50_ms']:>8.3f} "
                  f"{b['itl']['p90_ms']:>8.3f} {b['itl']['p99_ms']:>8.3f}")  # fmt: skip
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "machine": f"{os.cpu_count()} CPU cores, no GPU",
                "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                **res,
            }, indent=2) + "\n")  # fmt: skip
        return 0
    files = prepare_demo(workdir)
    placement = json.loads(files.placement_path.read_text())
    num_layers = int(placement["num_layers"])
    s_cluster, s_placement, s_worker = single_worker_files(workdir, files.model_dir, num_layers)
    bench_args = [
        "--dataset", "random", "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
    ]  # fmt: skip
    kv_bytes = args.kv_cache_mb * 2**20
    single_threads = [int(x) for x in str(args.single_threads).split(",")]
    rounds = []
    for r in range(args.rounds):
        rd: dict[str, Any] = {"round": r}
        rd["pipeline"] = run_setup(
            "pipeline", files.model_dir, files.cluster_path, files.placement_path,
            files.workers, args.pipeline_threads, kv_bytes, workdir, bench_args,
        )  # fmt: skip
        for t in single_threads:
            rd[f"single-{t}t"] = run_setup(
                f"single-{t}t", files.model_dir, s_cluster, s_placement, [s_worker],
                t, kv_bytes, workdir, bench_args,
            )  # fmt: skip
            rd[f"ratio_vs_single-{t}t"] = (
                rd["pipeline"]["output_throughput_tokens_per_s"]
                / rd[f"single-{t}t"]["output_throughput_tokens_per_s"]
            )
        rounds.append(rd)

    setups = ["pipeline"] + [f"single-{t}t" for t in single_threads]
    print()
    print(f"{'round':>5} {'setup':<11} {'out tok/s':>10} {'req/s':>7} {'TTFT p50':>9} "
          f"{'TPOT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'E2E p50':>8}  (ms)")  # fmt: skip
    for rd in rounds:
        for setup in setups:
            b = rd[setup]
            print(f"{rd['round']:>5} {setup:<11} {b['output_throughput_tokens_per_s']:>10.1f} "
                  f"{b['request_throughput_per_s']:>7.2f} {b['ttft']['p50_ms']:>9.0f} "
                  f"{b['tpot']['p50_ms']:>9.1f} {b['itl']['p50_ms']:>8.1f} "
                  f"{b['itl']['p99_ms']:>8.1f} {b['e2e']['p50_ms']:>8.0f}")  # fmt: skip
        for t in single_threads:
            print(f"{rd['round']:>5} decode throughput pipeline / single-{t}t: "
                  f"{rd[f'ratio_vs_single-{t}t']:.3f}")  # fmt: skip
    ratios = {
        f"single-{t}t": [rd[f"ratio_vs_single-{t}t"] for rd in rounds] for t in single_threads
    }
    summary = {
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "placement": placement["nodes"],
        "config": vars(args) | {"workdir": str(workdir), "json": str(args.json)},
        "rounds": rounds,
        "ratio_mean": {k: sum(v) / len(v) for k, v in ratios.items()},
        "ratio_min": {k: min(v) for k, v in ratios.items()},
        "target_ratio": 0.8,
    }
    for k in ratios:
        print(f"pipeline / {k} decode throughput: mean {summary['ratio_mean'][k]:.3f}, "
              f"min {summary['ratio_min'][k]:.3f} over {len(rounds)} rounds (target >= 0.8)")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
