"""`helixserve worker`: serve one layer range of the model over gRPC.

    helixserve worker --model DIR --layers 10:20 --port 50051
    helixserve worker --model DIR --placement placement.json --node n3 --port 50051

The Kubernetes manifests render exactly these flags. SIGTERM/SIGINT drain and stop the worker
(see helixserve/runtime/worker.py: serve).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from helixserve.commands.args import finite_float
from helixserve.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "worker",
        help="serve one layer range of the model over gRPC",
        description="Load layers [start, end) of the model and serve them over gRPC.",
    )
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--layers", help="half-open layer range START:END, e.g. 10:20")
    where.add_argument("--placement", type=Path, help="placement JSON; needs --node")
    p.add_argument("--node", help="this worker's node name (required with --placement)")
    p.add_argument("--port", type=int, required=True, help="gRPC port (0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda:0")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="weights and activations dtype")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache budget in bytes")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op CPU threads")
    p.add_argument("--slowdown", type=finite_float, default=1.0, metavar="F",
                   help="emulate a slower device: stretch each engine step to F x its compute "
                   "time by sleeping (benchmarks/rig; default 1, off)")
    p.add_argument("--drain-timeout-s", type=finite_float, default=30.0,
                   help="on SIGTERM, serve active requests this long before failing them")
    p.set_defaults(func=run)


def parse_layers(text: str) -> tuple[int, int]:
    try:
        start_s, end_s = text.split(":")
        start, end = int(start_s), int(end_s)
    except ValueError:
        raise UserError(f"--layers: bad value {text!r}; expected START:END, e.g. 10:20") from None
    if not 0 <= start < end:
        raise UserError(f"--layers: bad range {text!r}; need 0 <= START < END")
    return start, end


def resolve_range(args: argparse.Namespace) -> tuple[str, int, int]:
    """(node name, start layer, end layer) from --layers or --placement/--node."""
    if args.layers is not None:
        start, end = parse_layers(args.layers)
        return args.node or f"layers-{start}-{end}", start, end
    from helixserve.planner import load_placement

    if not args.node:
        raise UserError("--placement needs --node NAME")
    placement = load_placement(args.placement)
    r = placement.range_of(args.node)
    if r is None:
        known = ", ".join(n.name for n in placement.nodes) or "none"
        raise UserError(f"{args.placement}: no node {args.node!r} holds layers; known: {known}")
    return args.node, r.start_layer, r.end_layer


def run(args: argparse.Namespace) -> int:
    from helixserve.launch import die_with_parent

    die_with_parent()  # started by a local stack: never outlive it
    node, start, end = resolve_range(args)
    if not args.model.is_dir():
        raise UserError(f"--model: {args.model} is not a directory")
    if not 0 < args.port < 65536 and args.port != 0:
        raise UserError(f"--port: bad value {args.port}")
    if args.slowdown < 1.0:
        raise UserError(f"--slowdown: bad value {args.slowdown}; need >= 1")
    import asyncio
    import signal

    import torch

    from helixserve.engine import ShardEngine
    from helixserve.engine.slowdown import slowed
    from helixserve.runtime.worker import Worker, serve

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    engine = ShardEngine.load(
        args.model, start, end, device=args.device, dtype=dtype, kv_cache_bytes=args.kv_cache_bytes
    )
    if end > engine.num_model_layers:
        raise UserError(
            f"--layers: range [{start}, {end}) is outside the model's {engine.num_model_layers} layers"
        )

    def reload(old: Any, start: int, end: int) -> tuple[Any, int]:
        new, layers_read = ShardEngine.load_beside(old, args.model, start, end)
        return slowed(new, args.slowdown), layers_read

    worker = Worker(slowed(engine, args.slowdown), node=node, model=args.model.name,
                    backend="torch", device=args.device, reload=reload,
                    kv_cache_bytes=args.kv_cache_bytes)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(worker, args.host, args.port, drain_timeout_s=args.drain_timeout_s, stop=stop)

    asyncio.run(main())
    return 0
