"""`helixserve profile --model DIR --device cpu --out profiles.csv [--engine vllm]`: time one
layer and the last stage's head.

Writes rows `model,gpu,num_gpus,phase,batch_tokens,layer_ms,part` (docs/formats.md; part=head rows
time the final norm + lm_head + sampling, engine/profiler.py) measured on this machine's
device, for the planner to use instead of the analytic cost model.
"""

from __future__ import annotations

import argparse


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list '{text}'; need e.g. 1,2,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bad list '{text}'; need positive ints")
    return values


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile", help="measure one layer's (and the head's) time vs batch tokens (profiles CSV for the "
        "planner)"
    )
    p.add_argument("--model", required=True, help="HF model directory or .gguf file")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 (default: fp32 on cpu, bf16 on cuda)",
    )
    p.add_argument("--out", required=True, help="CSV file to write")
    p.add_argument("--model-name", default=None, help="model column (default: directory name)")
    p.add_argument(
        "--prompt-tokens",
        type=_int_list,
        default=None,
        help="prompt batch_tokens, e.g. 128,256,512,1024",
    )
    p.add_argument(
        "--decode-batches",
        type=_int_list,
        default=None,
        help="decode batch sizes, e.g. 1,2,4,8,16,32",
    )
    p.add_argument("--layers", type=int, default=4, help="layers timed together (default 4)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed steps per point; the fastest is kept (default 3)"
    )
    p.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads, as the worker will use them"
    )
    p.add_argument("--slowdown", type=float, default=1.0, metavar="F",
                   help="time steps stretched to F x their compute time, as `helixserve worker "
                   "--slowdown F` runs them (default 1, off)")
    p.add_argument("--engine", default="auto",
                   help="engine timed: torch | vllm | auto (as `helixserve worker --engine`; "
                   "default auto)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from helixserve.commands.args import Output, check_output, write_outputs
    from helixserve.errors import UserError

    out = check_output("--out", args.out)  # before torch and profiling: fails at once
    from helixserve.engine.registry import resolve_engine

    engine = resolve_engine(args.engine, weights=True)
    if engine == "vllm":
        from helixserve.engine.vllm_stage import configure_vllm_process

        configure_vllm_process(args.threads or None)  # before vLLM starts its thread pools
    from helixserve.engine.profiler import ProfileSettings, profile_model, write_profiles_csv

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    if args.layers < 1 or args.repeats < 1:
        raise UserError(f"--layers/--repeats: bad value {args.layers}/{args.repeats}; need >= 1")
    if not args.slowdown >= 1.0 or args.slowdown == float("inf"):
        raise UserError(f"--slowdown: bad value {args.slowdown}; need a finite number >= 1")
    defaults = ProfileSettings()
    settings = ProfileSettings(
        prompt_batch_tokens=args.prompt_tokens or defaults.prompt_batch_tokens,
        decode_batch_tokens=args.decode_batches or defaults.decode_batch_tokens,
        num_layers=args.layers,
        repeats=args.repeats,
        slowdown=args.slowdown,
    )
    rows = profile_model(Path(args.model), args.device, args.dtype, args.model_name, settings,
                         engine)
    write_outputs([Output("--out", out, lambda path: write_profiles_csv(rows, path))])
    print(f"{'part':<5} {'phase':<7} {'batch_tokens':>12} {'layer_ms':>9}")
    for r in rows:
        print(f"{r.part:<5} {r.phase:<7} {r.batch_tokens:>12} {r.layer_ms:>9.3f}")
    print(f"wrote {len(rows)} rows ({rows[0].model}, {rows[0].gpu}) to {args.out}")
    return 0
