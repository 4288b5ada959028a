"""`helixserve serve`: the coordinator and the OpenAI-compatible API over running workers.

    helixserve serve --cluster cluster.yaml --placement placement.json --model DIR --port 8000

The workers must already run at the cluster's `address`es (`helixserve worker ...`); the
Kubernetes manifests render exactly these flags. With --tls-* the coordinator speaks mutual TLS
to the workers (docs/security.md). On an address other than loopback, the API needs an API
key or an explicit --allow-unauthenticated.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from helixserve.commands.args import finite_float
from helixserve.commands.certs import add_tls_arguments, tls_from_args
from helixserve.commands.tool_args import add_tool_arguments, tool_options
from helixserve.spec.scheduling import DEFAULT_KV_WATERMARK, KV_ALLOCATIONS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible API + coordinator over running workers",
        description="Serve the OpenAI-compatible API, routing each request through the "
        "workers listed (with addresses) in the cluster file.",
    )
    p.add_argument("--cluster", required=True, type=Path, help="cluster YAML with addresses")
    p.add_argument("--placement", required=True, type=Path, help="placement JSON")
    p.add_argument("--model", required=True, type=Path, help="model dir (tokenizer, config)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("HELIXSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default $HELIXSERVE_API_KEY; none = open)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve without an API key on a non-loopback --host (anyone who reaches the port "
        "can use the model); refused without this flag",
    )
    p.add_argument("--scheduler", default="maxflow", help="routing policy (default maxflow)")
    p.add_argument("--served-model-name", default=None, help="model name clients use")
    add_kv_arguments(p)
    add_prefix_arguments(p)
    add_cost_arguments(p)
    add_recovery_arguments(p)
    add_timing_arguments(p)
    add_tool_arguments(p)
    add_tls_arguments(p)
    p.add_argument("--log-level", default="warning", help="uvicorn log level")
    p.set_defaults(func=run)


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: may resolve to anything


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> str | None:
    """Refuse an open API on a reachable address; the warning to print when allowed."""
    from helixserve.errors import UserError

    if api_key or is_loopback(host):
        return None
    if not allow_unauthenticated:
        raise UserError(
            f"--host {host}: serving without an API key on a non-loopback address lets anyone "
            "who reaches the port use the model; set --api-key (or $HELIXSERVE_API_KEY), bind "
            "127.0.0.1, or pass --allow-unauthenticated"
        )
    return (f"WARNING: the API on {host} has no API key (--allow-unauthenticated): anyone who "
            "reaches the port can use the model")


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """The coordinator's KV accounting flags (serve and demo); see `check_kv_arguments`."""
    p.add_argument(
        "--kv-allocation",
        choices=KV_ALLOCATIONS,
        default="on-demand",
        help="on-demand (default): admit a request when its prompt fits, let requests grow "
        "into free KV and preempt (recompute) when a worker runs out, as vLLM does; "
        "reserve: admit when prompt + max_tokens fit on every hop and never preempt",
    )
    p.add_argument(
        "--kv-watermark",
        type=finite_float,
        default=DEFAULT_KV_WATERMARK,
        help="on-demand: fraction of each worker's KV kept free at admission "
        f"(default {DEFAULT_KV_WATERMARK})",
    )


def add_prefix_arguments(p: argparse.ArgumentParser, workers: bool = False) -> None:
    """Prefix caching flags (serve and demo; docs/prefix-caching.md)."""
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt in full: reuse no cached prefix"
        + (" (the workers keep none either)" if workers else
           " (workers started with --no-prefix-caching keep none either)"),
    )
    p.add_argument(
        "--no-cache-aware-routing",
        action="store_true",
        help="route by load and flow alone, not by where a prompt's prefix is cached (a "
        "route that happens to hold it is still reused)",
    )


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    """The cost model the router and the live re-plan use (runtime/costs.py): give the files
    the placement was planned (and simulated) with, so the live router routes as the
    simulated one."""
    from helixserve.commands.costs import add_cost_args
    from helixserve.runtime.costs import DEFAULT_DTYPE_BYTES, DTYPE_BYTES

    # the files, mix, reserve and weight cap the plan was made with: they shape each node's T(k)
    add_cost_args(
        p,
        profiles_help="measured per-layer times (`helixserve profile`), the ones `plan` and "
        "`simulate` were given: the router's node throughputs, the flow it routes over when "
        "the placement has none, and the live re-plan use them (default: the analytic model "
        "from the GPU catalog)",
        gpus_help="GPU catalog CSV, when the cluster's gpu names are not in the shipped one "
        "(as `plan --gpus`)")
    p.add_argument("--dtype-bytes", type=int, choices=DTYPE_BYTES, default=DEFAULT_DTYPE_BYTES,
                   help="bytes per weight/activation element the plan counted (default "
                   f"{DEFAULT_DTYPE_BYTES}; 4 for a plan of fp32 workers)")


def cost_inputs(args: argparse.Namespace) -> Any:
    """The runtime's CostInputs of the cost flags (commands/costs.py) and --dtype-bytes, files
    read now (UserError naming the flag, the file and the problem). Profiles without a row of
    the placement's model are an error here, as in `plan`: the coordinator would route and
    re-plan on the analytic model without a word."""
    from helixserve.commands.costs import check_profiles_model, read_cost_flags
    from helixserve.errors import UserError
    from helixserve.planner import load_placement
    from helixserve.runtime.costs import CostInputs

    flags = read_cost_flags(args)
    placement_path = getattr(args, "placement", None)
    if flags.profiles is not None and placement_path is not None:
        try:
            model_name = load_placement(placement_path).model
        except UserError:
            model_name = None  # the stack reports an unreadable placement, naming it
        if model_name is not None:
            check_profiles_model(flags.profiles, model_name,
                                 named_by=f"the model field of {placement_path}")
    return CostInputs(flags.profiles, flags.catalog, args.dtype_bytes, workload=flags.workload,
                      reserved_gb_per_gpu=flags.reserved_gb_per_gpu,
                      weight_fraction=flags.weight_fraction)


def add_recovery_arguments(p: argparse.ArgumentParser) -> None:
    """Live re-planning flags (serve and demo); see helixserve/runtime/replan.py."""
    p.add_argument(
        "--no-replan",
        action="store_true",
        help="do not re-plan when layers lose their last live worker (requests then fail "
        "with 503 until a worker comes back)",
    )
    p.add_argument(
        "--recovery-wait-s",
        type=finite_float,
        default=60.0,
        help="longest a request waits for a re-plan or a restarted worker (default 60)",
    )
    p.add_argument(
        "--replan-time-limit-s",
        type=finite_float,
        default=5.0,
        help="search time of a live re-plan, full and incremental together (default 5; "
        "lower it where the cluster is small and the host busy: the re-plan's planning is "
        "part of the outage)",
    )


def add_timing_arguments(p: argparse.ArgumentParser) -> None:
    """The coordinator's timeouts and poll (serve and demo); CoordinatorConfig's fields of
    the same names (helixserve/runtime/config.py) say what each means. Unset: its defaults."""
    for flag, default, what in (
        ("--step-timeout-s", 300, "a step whose result has not come back in this long "
         "counts as its worker failing"),
        ("--stats-interval-s", 0.5, "period of the poll of every worker's KV and queue"),
        ("--hang-timeout-s", 10, "declare a worker down (hung) when two Info calls in a row, "
         "this long each, get no answer"),
        ("--admission-timeout-s", 120, "longest a request waits for KV room while the model "
         "is covered (then 503 with Retry-After)"),
    ):
        p.add_argument(flag, type=finite_float, default=None,
                       help=f"{what} (default {default})")


def timing_options(args: argparse.Namespace) -> dict[str, float]:
    """The CoordinatorConfig fields set by add_timing_arguments' flags."""
    from helixserve.errors import UserError

    names = ("step_timeout_s", "stats_interval_s", "hang_timeout_s", "admission_timeout_s")
    options = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    for name, value in options.items():
        if not value > 0:
            raise UserError(f"--{name.replace('_', '-')}: bad value {value:g}; need > 0")
    return options


def recovery_config(args: argparse.Namespace) -> Any:
    """The coordinator's RecoveryConfig from the flags; None with --no-replan. The re-plan's
    cost model is the coordinator's (`cost_inputs`)."""
    if args.no_replan:
        return None
    from helixserve.errors import UserError
    from helixserve.runtime.config import RecoveryConfig

    if not args.replan_time_limit_s > 0:
        raise UserError(f"--replan-time-limit-s: bad value {args.replan_time_limit_s:g}; "
                        "need > 0")
    return RecoveryConfig(wait_s=args.recovery_wait_s,
                          plan_time_limit_s=args.replan_time_limit_s)


def check_kv_arguments(args: argparse.Namespace) -> None:
    from helixserve.errors import UserError

    if not 0.0 <= args.kv_watermark < 1.0:
        raise UserError(f"--kv-watermark: bad value {args.kv_watermark}; need 0 <= value < 1")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from helixserve.errors import UserError

    if not 0 <= args.port < 65536:
        raise UserError(f"--port: bad value {args.port}")
    check_kv_arguments(args)
    if not args.model.is_dir():
        raise UserError(f"--model: {args.model} is not a directory")
    cost = cost_inputs(args)
    warning = check_exposure(args.host, args.api_key or None, args.allow_unauthenticated)
    tls = tls_from_args(args)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if tls is None:
        print("WARNING: worker traffic is plaintext and unauthenticated (no --tls-cert/--tls-key/"
              "--tls-ca); see docs/security.md", file=sys.stderr, flush=True)
    from helixserve.local.stack import describe_placement, run_stack

    def started(cluster: object, placement: object) -> None:
        print(describe_placement(placement, cluster))
        print(f"serving on http://{args.host}:{args.port}/v1", flush=True)

    asyncio.run(
        run_stack(
            args.cluster,
            args.placement,
            args.model,
            args.host,
            args.port,
            api_key=args.api_key or None,
            served_model_name=args.served_model_name,
            scheduler=args.scheduler,
            on_started=started,
            log_level=args.log_level,
            kv_allocation=args.kv_allocation,
            kv_watermark=args.kv_watermark,
            recovery=recovery_config(args),
            timing=timing_options(args),
            **tool_options(args),
            tls=tls,
            cost=cost,
            prefix_caching=not args.no_prefix_caching,
            cache_aware_routing=not args.no_cache_aware_routing,
        )
    )
    return 0
