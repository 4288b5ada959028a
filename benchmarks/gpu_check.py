"""A short check of the engines on one device: what to run first on a GPU machine.

Needs PyTorch, transformers and grpcio (the `serve` install); no vLLM, no network, nothing
downloaded: the model is a small random Llama written to a temporary folder. Steps:

1. **Model.** A random Llama (transformers' LlamaConfig, random init with widened weights so
   greedy tokens are well separated) saved in bfloat16; the torch engine must load it.
2. **Correctness.** Two real `helixserve worker --engine torch` processes on --device (each
   half the layers, started one after another), a coordinator in this process over gRPC;
   greedy tokens of --prompts prompts compared with one `transformers` forward over prompt +
   generated tokens (teacher forcing, so one early difference does not count twice):
   float32 must agree exactly, bfloat16 on >= 90% of the tokens.
3. **Decode speed.** --streams concurrent requests of --decode-tokens tokens (bfloat16 on
   CUDA, float32 on CPU) through the same 2-worker route: output tokens per second.
4. **vLLM**, only when `import vllm` works: the same three with `--engine vllm` workers.

Results: at most three files in --out: `gpu_check.json` (every number), `gpu_check.txt` (what
was printed) and `workers.log` (the workers' logs). Exit 0 when every check passes.

    python -m benchmarks.gpu_check --device cuda --out benchmarks/results/gpu   # < 5 min, H100
    python -m benchmarks.gpu_check --device cpu --out /tmp/gpu-check            # CI, minutes
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The random Llama per device: big enough on a GPU for the kernels that matter (GQA,
#: head_dim 128, a 32k vocabulary), tiny on a CPU (head_dim 64: vLLM's CPU attention takes
#: multiples of 32).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "cuda": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2),
    "cpu": dict(vocab_size=2048, hidden_size=256, intermediate_size=512,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
}
BF16_MIN_AGREEMENT = 0.9
KV_CACHE_BYTES = {"cuda": 4 << 30, "cpu": 128 << 20}
"""Per worker: explicit, since both workers share the device."""


def write_model(out: Path, device: str) -> Path:
    """A random bf16 Llama in `out` (safetensors + config.json); weights widened x4 so that
    attention and RoPE matter and greedy tokens are not near ties."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-6,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                   **MODEL_SIZES["cuda" if device.startswith("cuda") else "cpu"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def check_torch_loads(model: Path, device: str) -> str:
    """The torch engine loads the whole model on `device` (engine/loader.py)."""
    from helixserve.engine import ShardEngine

    eng = ShardEngine.load(model, 0, int(json.loads((model / "config.json").read_text())
                                         ["num_hidden_layers"]), device, "bfloat16",
                           kv_cache_bytes=16 << 20)
    what = f"{eng.num_model_layers} layers, hidden {eng.hidden_size}, vocab {eng.vocab_size}"
    del eng
    return what


@dataclass
class Stage:
    node: str
    start: int
    end: int
    port: int
    proc: subprocess.Popen[bytes]


def start_route(model: Path, engine: str, device: str, dtype: str, logs: Path) -> list[Stage]:
    """Two workers of half the layers each, started one after another (each sees the memory
    the earlier one holds; docs/vllm.md, "Memory")."""
    from helixserve.local.launch import free_port, spawn_worker, wait_grpc_ready, worker_command

    layers = int(json.loads((model / "config.json").read_text())["num_hidden_layers"])
    kv = KV_CACHE_BYTES["cuda" if device.startswith("cuda") else "cpu"]
    stages: list[Stage] = []
    try:
        for node, a, b in (("s0", 0, layers // 2), ("s1", layers // 2, layers)):
            port = free_port()
            cmd = worker_command(model, node, port, layers=(a, b), engine=engine,
                                 num_threads=1 if device == "cpu" else None,
                                 peers="127.0.0.1:*", kv_cache_bytes=kv,
                                 extra_args=["--device", device, "--dtype", dtype])
            log = logs / f"{engine}-{dtype}-{node}.log"
            proc = spawn_worker(cmd, log, env={"OMP_WAIT_POLICY": "PASSIVE"})
            stages.append(Stage(node, a, b, port, proc))
            wait_grpc_ready(node, f"127.0.0.1:{port}", proc, log, timeout_s=300)
    except BaseException:
        stop_route(stages)
        raise
    return stages


def stop_route(stages: list[Stage]) -> None:
    from helixserve.local.launch import stop_processes

    stop_processes([s.proc for s in stages])


def generate(model: Path, stages: list[Stage], prompts: list[list[int]],
             max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt through the route, all at once; (tokens, seconds)."""
    from helixserve.planner.placement import Flow, NodeRange, Placement
    from helixserve.request import SamplingParams
    from helixserve.runtime import Coordinator, GenerationRequest
    from helixserve.spec import ClusterSpec, NodeSpec

    cluster = ClusterSpec(name="gpu-check", nodes=[
        NodeSpec(name=s.node, gpu="H100-80GB", address=f"127.0.0.1:{s.port}") for s in stages])
    placement = Placement(
        model=model.name, cluster="gpu-check", num_layers=stages[-1].end, planner="fixed",
        nodes=[NodeRange(s.node, s.start, s.end) for s in stages],
        flows=[Flow("coordinator", "s0", 1), Flow("s0", "s1", 1), Flow("s1", "coordinator", 1)])
    greedy = SamplingParams(temperature=0.0)

    async def run() -> tuple[list[list[int]], float]:
        coord = await Coordinator.create(cluster, placement, model)
        try:
            async def one(rid: str, p: list[int], n: int) -> list[int]:
                req = GenerationRequest(rid, p, greedy, max_tokens=n, ignore_eos=True)
                return [ev.token_id async for ev in coord.generate(req)]

            await one("warm-up", prompts[0], 2)
            t = time.perf_counter()
            toks = await asyncio.gather(*(one(f"r{i}", p, max_tokens)
                                          for i, p in enumerate(prompts)))
            return list(toks), time.perf_counter() - t
        finally:
            await coord.close()

    return asyncio.run(run())


def hf_agreement(model: Path, device: str, dtype: str, prompts: list[list[int]],
                 outputs: list[list[int]]) -> float:
    """Share of generated tokens equal to transformers' argmax given the same prefix."""
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, dtype)).to(device).eval()
    same = total = 0
    with torch.inference_mode():
        for p, out in zip(prompts, outputs, strict=True):
            ids = torch.tensor([p + out], device=device)
            logits = hf(input_ids=ids).logits[0]  # [len(p) + len(out), vocab]
            want = logits[len(p) - 1 : len(p) - 1 + len(out)].argmax(-1).tolist()
            same += sum(a == b for a, b in zip(out, want, strict=True))
            total += len(out)
    del hf
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return same / max(total, 1)


def check_engine(engine: str, model: Path, args: argparse.Namespace, logs: Path,
                 say: Any) -> dict[str, Any]:
    """Steps 2 and 3 for one engine; the results, with `pass`."""
    import random

    vocab = MODEL_SIZES["cuda" if args.device.startswith("cuda") else "cpu"]["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 48))]
               for _ in range(args.prompts)]
    res: dict[str, Any] = {"engine": engine}
    ok = True
    for dtype, need in (("float32", 1.0), ("bfloat16", BF16_MIN_AGREEMENT)):
        stages = start_route(model, engine, args.device, dtype, logs)
        try:
            toks, _ = generate(model, stages, prompts, args.max_tokens)
        finally:
            stop_route(stages)
        agree = hf_agreement(model, args.device, dtype, prompts, toks)
        passed = agree >= need
        ok &= passed
        res[f"{dtype}_agreement"] = agree
        say(f"{engine} {dtype}: greedy tokens vs transformers {agree:.1%} of "
            f"{args.prompts} x {args.max_tokens} (need {need:.0%}) "
            f"{'PASS' if passed else 'FAIL'}")
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    long = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(args.streams)]
    stages = start_route(model, engine, args.device, dtype, logs)
    try:
        toks, seconds = generate(model, stages, long, args.decode_tokens)
    finally:
        stop_route(stages)
    tps = sum(len(t) for t in toks) / seconds
    res.update(decode_dtype=dtype, streams=args.streams, decode_tokens=args.decode_tokens,
               decode_tokens_per_s=tps, decode_seconds=seconds)
    say(f"{engine} decode ({dtype}, {args.streams} streams x {args.decode_tokens} tokens, "
        f"2 workers): {tps:.1f} tok/s")
    res["pass"] = ok
    return res


def vllm_importable() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True,
                           timeout=300)
    return probe.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the 3 result files")
    ap.add_argument("--prompts", type=int, default=None, help="default 16 cuda, 4 cpu")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 32 cuda, 12 cpu")
    ap.add_argument("--streams", type=int, default=None, help="default 64 cuda, 8 cpu")
    ap.add_argument("--decode-tokens", type=int, default=None, help="default 64 cuda, 8 cpu")
    ap.add_argument("--skip-vllm", action="store_true", help="the torch engine only")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    for name, gpu, cpu in (("prompts", 16, 4), ("max_tokens", 32, 12), ("streams", 64, 8),
                           ("decode_tokens", 64, 8)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    import torch

    if cuda and not torch.cuda.is_available():
        print(f"gpu_check: error: --device {args.device}: torch {torch.__version__} sees no "
              "CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    t0 = time.monotonic()
    where = torch.cuda.get_device_name(args.device) if cuda else "cpu"
    say(f"gpu_check on {args.device} ({where}), torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs = tmp / "logs"
    logs.mkdir()
    results: dict[str, Any] = {"device": args.device, "device_name": where,
                               "torch": torch.__version__,
                               "command": " ".join([Path(sys.executable).name, *sys.argv])}
    try:
        model = write_model(tmp / "random-llama", args.device)
        what = check_torch_loads(model, args.device)
        say(f"model: random Llama, bfloat16, {what}: the torch engine loads it")
        results["model"] = MODEL_SIZES["cuda" if cuda else "cpu"]
        results["torch_engine"] = check_engine("torch", model, args, logs, say)
        ok = results["torch_engine"]["pass"]
        if args.skip_vllm:
            say("vllm engine: skipped (--skip-vllm)")
        elif not vllm_importable():
            say("vllm engine: skipped (import vllm fails or vLLM is not installed)")
        else:
            results["vllm_engine"] = check_engine("vllm", model, args, logs, say)
            ok &= results["vllm_engine"]["pass"]
    except Exception as exc:
        say(f"FAIL: {type(exc).__name__}: {exc}")
        ok = False
    finally:
        with (args.out / "workers.log").open("w") as out:
            for log in sorted(logs.glob("*.log")):
                out.write(f"==> {log.name} <==\n{log.read_text(errors='replace')}\n")
        shutil.rmtree(tmp, ignore_errors=True)
    results["seconds"] = time.monotonic() - t0
    results["pass"] = ok
    say(f"{'ALL PASS' if ok else 'SOME CHECKS FAILED'} in {results['seconds']:.0f} s; results "
        f"in {args.out}")
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import logging

    logging.basicConfig(level=logging.ERROR)  # the coordinator's notes (no tokenizer, ...)
    raise SystemExit(main())
