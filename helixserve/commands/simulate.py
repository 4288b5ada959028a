"""`helixserve simulate`: replay a request trace on a placement with a routing policy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helixserve.commands.args import finite_float

#: the engine model `simulate` uses by default: the one the runtime serves with (its
#: coordinator's on-demand KV and 512-token prefill chunks: runtime/config.py), the same as
#: benchmarks/serving_sim.py's default
DEFAULT_ENGINE = "vllm"


def register(subparsers: argparse._SubParsersAction) -> None:
    from helixserve.commands.costs import add_cost_args

    p = subparsers.add_parser(
        "simulate",
        help="simulate serving a request trace on a placement (throughput, latency)",
        description="Discrete-event simulation of the cluster serving a request stream: "
        "continuous batching per node, links and NICs, KV-cache admission, the same router "
        "the coordinator runs. Prints a summary table; --json and --plot write the details. "
        "File formats (cluster YAML, profiles CSV, placement JSON, trace CSV): docs/formats.md.",
    )
    p.add_argument("--cluster", required=True, help="cluster YAML")
    p.add_argument("--model", required=True, help="model directory or config.json")
    p.add_argument(
        "--model-name",
        default=None,
        help="model name in the profiles table (default: the directory name)",
    )
    add_cost_args(p)
    p.add_argument(
        "--placement",
        required=True,
        help="placement JSON, or a planner name (milp, petals, swarm, separate, "
        "uniform) to plan first (for --workload's mix)",
    )
    p.add_argument(
        "--plan-time-limit",
        type=finite_float,
        default=60.0,
        metavar="S",
        help="time limit of the planner when --placement names one (default 60)",
    )
    p.add_argument(
        "--plan-work-limit",
        type=finite_float,
        default=None,
        metavar="UNITS",
        help="plan to this budget of work instead of --plan-time-limit (as `plan "
        "--work-limit`): the same placement on any machine, so the same simulation",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--rate",
        type=finite_float,
        default=None,
        metavar="R",
        help="online: rescale arrivals to R requests/s (default: as recorded)",
    )
    mode.add_argument(
        "--offline",
        action="store_true",
        help="keep the cluster saturated to measure its maximum throughput",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="with --offline: keep N requests in flight (a closed loop: each finished "
        "request replaced by the trace's next), the load `plan --serve-concurrency N` "
        "plans for and `rehearse --offline --concurrency N` drives; default: the engine "
        "model's own offline feed (saturated)",
    )
    p.add_argument(
        "--poisson",
        action="store_true",
        help="Poisson arrivals at --rate instead of the trace's times (lengths "
        "from the trace, or --prompt-tokens/--output-tokens without one)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=512,
        help="prompt length of synthetic requests without a trace (default 512)",
    )
    p.add_argument(
        "--output-tokens",
        type=int,
        default=128,
        help="output length of synthetic requests without a trace (default 128)",
    )
    p.add_argument(
        "--duration",
        type=finite_float,
        default=600.0,
        metavar="S",
        help="simulated seconds (default 600)",
    )
    p.add_argument(
        "--warmup",
        type=finite_float,
        default=0.0,
        metavar="S",
        help="do not count tokens and latencies before this time (default 0)",
    )
    p.add_argument(
        "--scheduler",
        default="maxflow",
        help="routing policy: maxflow (default), random, shortest-queue, swarm",
    )
    p.add_argument(
        "--route-within-regions",
        action="store_true",
        help="maxflow keeps a request inside its region wherever the flow continues there "
        "(as a placement with \"route_within_regions\": true; `helixserve plan "
        "--serve-trace` sets it when that serves better)",
    )
    engine = p.add_argument_group(
        "engine model",
        "how each node's engine allocates KV cache and batches prompts: a preset "
        "(--engine); the other flags here override its options",
    )
    engine.add_argument(
        "--engine",
        default=DEFAULT_ENGINE,
        metavar="NAME",
        help=f"vllm (the default, as the runtime's coordinator serves and the benchmarks "
        "simulate): on-demand KV with recompute preemption, chunked prefill of 512 prompt "
        "tokens an iteration, at most 64 requests prefilling, 4.5 GB per GPU outside weights "
        "and KV; reserve (the simulator's own, simpler model): a "
        "request reserves prompt + output KV on its route at admission, a node prefills "
        "whole prompts up to its profile's largest batch, 1 GiB per GPU; helix-prototype: "
        "what the Helix authors' prototype runs, with its offline feeder under --offline "
        f"(docs/calibration.md). Default {DEFAULT_ENGINE}",
    )
    engine.add_argument(
        "--kv-allocation",
        default=None,
        metavar="MODE",
        help="reserve (prompt + output KV at admission) or on-demand (as tokens are "
        "generated, preempting on a full node)",
    )
    engine.add_argument(
        "--chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split prompts over iterations to fit --max-batched-prompt-tokens",
    )
    engine.add_argument(
        "--max-batched-prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help="prompt tokens one node iteration may prefill (vLLM's max_num_batched_tokens; "
        "not --max-prompt-tokens, the request length filter)",
    )
    engine.add_argument(
        "--max-prefilling",
        type=int,
        default=None,
        metavar="N",
        help="admission waits while N admitted requests have no first token yet",
    )
    engine.add_argument(
        "--kv-watermark",
        type=finite_float,
        default=None,
        metavar="FRACTION",
        help="fraction of each node's KV cache kept free at admission for running requests "
        "to grow into (on-demand allocation; default 0.01, as vLLM)",
    )
    engine.add_argument(
        "--layer-overhead-ms",
        type=finite_float,
        default=None,
        metavar="MS",
        help="milliseconds every layer of an iteration costs beyond the per-layer profiles "
        "(helix-prototype: 3.5, fitted to the prototype's run; the others and Helix's own "
        "simulator: 0; docs/calibration.md)",
    )
    p.add_argument(
        "--helix-router",
        action="store_true",
        help="maxflow: route as Helix's scheduler (its simulator and its prototype's host) "
        "does: over the solver's flow as given, flow edges under 5%% of their vertex's "
        "outflow masked, never outside the flow (a request KV keeps off every flow edge "
        "waits); the default spreads the flow and spills past full nodes, as helixserve's "
        "coordinator does",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sample",
        type=finite_float,
        default=None,
        metavar="FRACTION",
        help="keep a seeded random fraction of the trace's requests",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=2048, metavar="N",
                   help="trace requests with a longer prompt are dropped or clipped (--lengths; "
                   "default 2048, Helix's filter)")
    p.add_argument("--max-output-tokens", type=int, default=1024, metavar="N",
                   help="the same for the output (default 1024)")
    p.add_argument("--min-tokens", type=int, default=4, metavar="N",
                   help="the same for prompts and outputs shorter than N (default 4)")
    p.add_argument(
        "--lengths",
        choices=("drop", "clip"),
        default="drop",
        help="requests outside the length bounds: drop them (Helix) or clip them",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="OUT",
        help="write the JSON summary to OUT (stdout without OUT)",
    )
    p.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def finished_requests_per_s(result: Any) -> float:
    """Requests that finished after the warmup, per second of the counted window."""
    warmup_s = result.config.warmup_s
    window_s = result.end_s - warmup_s
    done = sum(1 for r in result.finished if r.finish_s >= warmup_s)
    return done / window_s if window_s > 0 else 0.0


def _progress_bar() -> Callable[[float], None]:
    last = [-1]

    def show(frac: float) -> None:
        pct = int(frac * 100)
        if pct == last[0]:
            return
        last[0] = pct
        filled = pct // 4
        sys.stderr.write(f"\rsimulating [{'#' * filled}{'.' * (25 - filled)}] {pct:3d}%")
        if pct >= 100:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """The SimConfig engine fields: the --engine preset with the flags given over it."""
    from helixserve.errors import UserError
    from helixserve.simulator.presets import ENGINES, HELIX_ROUTER, engine_config
    from helixserve.spec.scheduling import KV_ALLOCATIONS

    if args.engine not in ENGINES:
        raise UserError(
            f"--engine: unknown engine model {args.engine!r}; known: {', '.join(sorted(ENGINES))}"
        )
    if args.kv_allocation is not None and args.kv_allocation not in KV_ALLOCATIONS:
        raise UserError(
            f"--kv-allocation: unknown mode {args.kv_allocation!r}; known: "
            f"{', '.join(KV_ALLOCATIONS)}"
        )
    for flag, value in (
        ("--max-batched-prompt-tokens", args.max_batched_prompt_tokens),
        ("--max-prefilling", args.max_prefilling),
    ):
        if value is not None and value < 1:
            raise UserError(f"{flag}: must be >= 1, got {value}")
    if args.kv_watermark is not None and not 0 <= args.kv_watermark < 1:
        raise UserError(f"--kv-watermark: must be in [0, 1), got {args.kv_watermark}")
    if args.layer_overhead_ms is not None and args.layer_overhead_ms < 0:
        raise UserError(f"--layer-overhead-ms: must be >= 0, got {args.layer_overhead_ms}")
    config = engine_config(
        args.engine,
        kv_allocation=args.kv_allocation,
        chunked_prefill=args.chunked_prefill,
        max_prompt_tokens=args.max_batched_prompt_tokens,
        max_prefilling=args.max_prefilling,
        kv_watermark=args.kv_watermark,
    )
    if args.layer_overhead_ms is not None:
        config["layer_overhead_s"] = args.layer_overhead_ms / 1000.0
    if args.helix_router:
        if args.scheduler != "maxflow":
            raise UserError(f"--helix-router: routes over the max flow; --scheduler is "
                            f"{args.scheduler!r}, not maxflow")
        config |= HELIX_ROUTER
    return config


def _check_flags(args: argparse.Namespace) -> None:
    """The number and name flags, checked before any file is read (UserError naming the flag
    and the value)."""
    from helixserve.errors import UserError
    from helixserve.scheduler import ROUTERS

    if args.scheduler not in ROUTERS:
        raise UserError(f"--scheduler: unknown routing policy {args.scheduler!r}; known: "
                        f"{', '.join(ROUTERS)}")
    for flag, value, least in (
        ("--prompt-tokens", args.prompt_tokens, 1),
        ("--output-tokens", args.output_tokens, 1),
        ("--max-prompt-tokens", args.max_prompt_tokens, 1),
        ("--max-output-tokens", args.max_output_tokens, 1),
        ("--min-tokens", args.min_tokens, 0),
    ):
        if value < least:
            raise UserError(f"{flag}: bad value {value}; must be >= {least} (tokens)")
    for flag, bound in (("--max-prompt-tokens", args.max_prompt_tokens),
                        ("--max-output-tokens", args.max_output_tokens)):
        if args.min_tokens > bound:
            raise UserError(f"--min-tokens: bad value {args.min_tokens}; above {flag} {bound}, "
                            "so no request could be kept")
    for flag, value in (("--plan-time-limit", args.plan_time_limit),
                        ("--plan-work-limit", args.plan_work_limit),
                        ("--duration", args.duration)):
        if value is not None and value <= 0:
            raise UserError(f"{flag}: bad value {value:g}; must be > 0")
    if args.warmup < 0:
        raise UserError(f"--warmup: bad value {args.warmup:g}; must be >= 0 (seconds)")
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise UserError(f"--concurrency: bad value {args.concurrency}; need an integer "
                            ">= 1 (requests in flight)")
        if not args.offline:
            raise UserError(f"--concurrency: {args.concurrency} needs --offline (online, "
                            "the trace's arrivals set the load)")


def run(args: argparse.Namespace) -> int:
    import json

    from helixserve.commands.args import Output, check_output, write_outputs
    from helixserve.commands.costs import build_cost_model, read_cost_flags
    from helixserve.commands.plan import check_model_path
    from helixserve.errors import UserError
    from helixserve.planner import PLANNERS, evaluate, load_placement, plan
    from helixserve.simulator.config import closed_loop
    from helixserve.simulator.metrics import format_table, latencies, summarize
    from helixserve.simulator.presets import engine_gpu_reserve_gb
    from helixserve.simulator.selection import load_text
    from helixserve.simulator.sim import SimConfig, Simulation
    from helixserve.simulator.workload import (
        LengthFilter,
        load_azure_trace,
        poisson_arrivals,
        prepare_trace,
    )
    from helixserve.spec import load_cluster, load_model

    _check_flags(args)
    engine = _engine_config(args)  # before loading and planning: a bad flag fails at once
    if args.concurrency is not None:
        engine.update(closed_loop(args.concurrency))
    flags = read_cost_flags(args)
    json_path = check_output("--json", args.json) if args.json not in (None, "-") else None
    plot_dir = check_output("--plot", args.plot, directory=True) if args.plot else None
    cluster = load_cluster(args.cluster, catalog=flags.catalog)
    check_model_path(args.model)
    model = load_model(args.model, name=args.model_name)
    # the engine's memory unless --gpu-reserve-gb: the simulation and its max-flow bound
    # below are both under it
    cost = build_cost_model(flags, model, cluster, reserved_gb_per_gpu=engine_gpu_reserve_gb(
        args.engine, flags.reserved_gb_per_gpu))

    if args.placement in PLANNERS:
        print(f"planning with {args.placement} ...", file=sys.stderr)
        placement = plan(args.placement, cluster, model, cost, time_limit_s=args.plan_time_limit,
                         work_limit=args.plan_work_limit)
    elif Path(args.placement).exists() or args.placement.endswith(".json"):
        placement = load_placement(args.placement)
        # the bound printed next to the simulation is this cost model's max flow, not the
        # one the file records (planned perhaps under another memory setting); the file's
        # flows, when it has them, stay the router's weights, as the coordinator's
        res = evaluate(cluster, model, cost, placement)
        if not placement.flows:
            placement.flows = res.flows
        placement.throughput_tokens_per_s = res.throughput_tokens_per_s
    else:
        raise UserError(
            f"--placement: {args.placement!r} is neither a file nor a planner; "
            f"known planners: {', '.join(PLANNERS)}"
        )

    if not placement.flows:  # evaluated above: nothing reaches the coordinator back
        raise UserError(
            f"{placement.source}: serves 0 tokens/s on cluster {cluster.name!r} (no chain of "
            f"linked nodes from the coordinator back to it holds every layer): nothing to "
            f"simulate")
    if args.route_within_regions:
        placement.route_within_regions = True

    lengths = LengthFilter(
        args.max_prompt_tokens, args.max_output_tokens, args.min_tokens, args.lengths
    )
    trace = None
    if args.trace:
        recorded = load_azure_trace(args.trace)
        if not lengths.apply(recorded):
            raise UserError(
                f"--trace {args.trace}: none of its {len(recorded)} requests has a prompt of "
                f"{args.min_tokens}..{args.max_prompt_tokens} and an output of "
                f"{args.min_tokens}..{args.max_output_tokens} tokens (--min-tokens, "
                f"--max-prompt-tokens, --max-output-tokens; or --lengths clip)")
        trace = prepare_trace(
            recorded,
            lengths=lengths,
            sample_fraction=args.sample,
            seed=args.seed,
        )
    if args.poisson:
        if args.rate is None:
            raise UserError("--poisson: needs --rate R (requests/s)")
        requests = poisson_arrivals(
            args.rate,
            args.duration,
            lengths_from=trace,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
        )
    elif trace is not None:
        requests = trace
        if args.rate is not None:
            requests = prepare_trace(trace, lengths=None, rate_per_s=args.rate)
    elif args.offline:
        from helixserve.simulator.workload import TraceRequest

        requests = [TraceRequest("synthetic", 0.0, args.prompt_tokens, args.output_tokens)]
    else:
        raise UserError("--trace: needed (or --poisson --rate R, or --offline) for requests")

    config = SimConfig(
        duration_s=args.duration,
        offline=args.offline,
        warmup_s=args.warmup,
        scheduler=args.scheduler,
        seed=args.seed,
        **engine,
    )
    progress = None if args.quiet else _progress_bar()
    sim = Simulation(cluster, model, cost, placement, requests, config, progress=progress)
    result = sim.run()
    summary = summarize(result)
    summary["requests_per_s"] = finished_requests_per_s(result)
    summary["workload"] = args.workload
    summary["engine"] = args.engine
    summary["gpu_reserve_gb"] = round(cost.reserved_bytes_per_gpu / 1e9, 6)
    summary["engine_config"] = engine
    summary["offline_concurrency"] = args.concurrency
    if args.json == "-":
        print(json.dumps(summary, indent=1))
    else:
        print(format_table(summary))
        print(f"{'finished requests':<21}  {summary['requests_per_s']:.3f} requests/s after "
              f"the warmup (planned for --workload {args.workload})")
        if args.concurrency is not None:
            print(f"{'load':<21}  {load_text(args.concurrency)} (a closed loop)")
    outputs = []
    if json_path is not None:
        text = json.dumps(summary, indent=1) + "\n"
        outputs.append(Output("--json", json_path, lambda path: path.write_text(text)))
    if plot_dir is not None:
        from helixserve.simulator.plots import write_plots

        outputs.append(Output("--plot", plot_dir, lambda path: write_plots(
            summary, latencies(result), path), directory=True))
    for path in write_outputs(outputs):
        print(f"wrote {path}", file=sys.stderr)
    return 0
