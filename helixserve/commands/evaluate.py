"""`helixserve evaluate`: max-flow throughput of a placement on a cluster."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from helixserve.commands.served import ALSO_CHOICES


def register(subparsers: argparse._SubParsersAction) -> None:
    from helixserve.commands.args import finite_float
    from helixserve.commands.plan import add_input_args

    p = subparsers.add_parser(
        "evaluate",
        help="max-flow throughput of a placement (any planner's, or Helix's own)",
        description="Recompute the flows of a placement through the cluster graph and print "
        "the throughput (decode tokens/s, and requests/s of --workload) with a per-node "
        "table. File formats: docs/formats.md.",
    )
    add_input_args(p, example=True)
    p.add_argument("--placement", required=True, help="placement JSON")
    p.add_argument("--json", action="store_true",
                   help='print {"throughput_tokens_per_s": ..., "flows": [...]} only')
    p.add_argument("--plot", help="write a PNG of the flow graph here")
    p.add_argument("--served", action="store_true",
                   help="also print what the placement serves as `plan`'s served objective "
                   "scores it: simulated offline in its own window with --serve-engine and "
                   "--serve-also, the engine's memory, requests drawn from the --workload mix "
                   "(or --serve-trace), seed --seed; docs/planner.md, 'The served objective'. "
                   "With --json: the keys served_tokens_per_s, served_also_tokens_per_s, "
                   "served_engine, served_also_engine")
    p.add_argument("--serve-engine", default="vllm", choices=("vllm", "reserve"),
                   help="with --served: the engine model (default vllm, as plan's)")
    p.add_argument("--serve-also", default="helix-prototype",
                   choices=ALSO_CHOICES,
                   help="with --served: the second engine model (default helix-prototype, "
                   "as plan's; none: --serve-engine alone)")
    p.add_argument("--serve-trace", metavar="TRACE.csv",
                   help="with --served: the trace simulated (default: requests drawn from "
                   "the --workload mix, as plan's)")
    p.add_argument("--serve-duration", type=finite_float, default=None, metavar="SECONDS",
                   help="with --served: plan's --serve-duration (default: each placement's "
                   "own window, as plan's)")
    p.add_argument("--serve-concurrency", type=int, default=None, metavar="N",
                   help="with --served: plan's --serve-concurrency, N requests in flight "
                   "(default: as many as the placement's KV admits, as plan's)")
    p.add_argument("--seed", type=int, default=0, help="with --served: plan's --seed")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="with --served: processes for the simulations (default: the cores "
                   "this process may use, at most 8)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from helixserve.commands.args import Output, check_image, write_outputs
    from helixserve.commands.plan import load_inputs, throughput_text
    from helixserve.errors import UserError
    from helixserve.planner import evaluate, load_placement
    from helixserve.planner.report import format_table, node_rows, plot_placement

    plot_path = check_image("--plot", args.plot) if args.plot else None
    if args.serve_duration is not None and args.serve_duration <= 0:
        raise UserError(f"--serve-duration: bad value {args.serve_duration!r}; must be > 0")
    if args.serve_concurrency is not None:
        from helixserve.simulator.selection import check_stated_load

        check_stated_load(args.serve_concurrency)
    cluster, model, cost = load_inputs(args)
    placement = load_placement(args.placement)
    result = evaluate(cluster, model, cost, placement,
                      partial_inference=not args.no_partial_inference)
    placement.flows = result.flows
    placement.throughput_tokens_per_s = result.throughput_tokens_per_s
    mix = cost.workload
    estimate = _served(args, placement) if args.served else None
    if args.json:
        print(json.dumps({
            "throughput_tokens_per_s": round(result.throughput_tokens_per_s, 6),
            **({} if mix is None else {
                "requests_per_s": round(mix.requests_per_s(result.throughput_tokens_per_s), 6),
                "workload": {"source": mix.source, "prompt_tokens": round(mix.prompt_tokens, 3),
                             "output_tokens": round(mix.output_tokens, 3)}}),
            "flows": [{"src": f.src, "dst": f.dst, "tokens_per_s": round(f.tokens_per_s, 6)}
                      for f in result.flows],
            **({} if estimate is None else estimate.keys()),
        }, indent=2))
    else:
        held = {r.name for r in placement.nodes}
        unused = [n.name for n in cluster.nodes if n.name not in held]
        print(format_table(node_rows(cluster, cost, placement, result.flows), unused))
        covered = "" if placement.covers_all_layers() else " (layers not all covered!)"
        print(f"throughput {throughput_text(result.throughput_tokens_per_s, mix)}{covered}")
        if estimate is not None:
            print(estimate.text(result.throughput_tokens_per_s))
    if plot_path is not None:
        write_outputs([Output("--plot", plot_path, lambda path: plot_placement(
            cluster, placement, result.flows, path))])
    return 0


@dataclass(frozen=True)
class ServedEstimate:
    """`evaluate --served`: what `plan`'s served objective's scorer gives the placement."""

    engine: str
    tokens_per_s: float
    also: str | None
    also_tokens_per_s: float | None
    reserve_gb_per_gpu: float
    requests: str
    window: str

    def keys(self) -> dict[str, Any]:
        """The --json keys (added to evaluate's, none renamed)."""
        return {"served_tokens_per_s": round(self.tokens_per_s, 6),
                "served_engine": self.engine,
                "served_also_tokens_per_s": (None if self.also_tokens_per_s is None
                                             else round(self.also_tokens_per_s, 6)),
                "served_also_engine": self.also,
                "served_gpu_reserve_gb": self.reserve_gb_per_gpu,
                "served_requests": self.requests,
                "served_window": self.window}

    def text(self, max_flow: float) -> str:
        also = ("" if self.also_tokens_per_s is None else
                f", {self.also} engine {self.also_tokens_per_s:,.1f}")
        return (f"served estimate (simulated as plan's served objective scores it: "
                f"{self.engine} engine, offline, {self.window}, {self.requests}, "
                f"{self.reserve_gb_per_gpu:g} GB a GPU outside weights and KV): "
                f"{self.tokens_per_s:,.1f} decode tokens/s{also}; the throughput above is "
                f"the max flow ({max_flow:,.1f}: every node at the batch its own KV allows), "
                f"an optimistic ceiling, not what the placement serves")


def _served(args: argparse.Namespace, placement: Any) -> ServedEstimate:
    """The served estimate of `placement` with the flags' engine models, memory and
    requests (commands/served.py, `served_estimate`)."""
    from helixserve.commands.plan import _serve_requests, load_inputs
    from helixserve.commands.served import drawn_requests, served_estimate
    from helixserve.simulator.selection import load_text

    cluster, model, cost = load_inputs(args, engine=args.serve_engine)
    if args.serve_trace:
        requests, source = _serve_requests(args.serve_trace), f"the trace {args.serve_trace}"
    else:
        requests, source = drawn_requests(args.workload, cost.workload, args.seed)
    also = None if args.serve_also == "none" else args.serve_also
    served, served_also, _ = served_estimate(
        cluster, model, cost, placement, requests, engine=args.serve_engine, also=also,
        duration_s=args.serve_duration, seed=args.seed, jobs=args.jobs,
        partial=not args.no_partial_inference, concurrency=args.serve_concurrency)
    window = ("in its own window" if args.serve_duration is None else
              f"{args.serve_duration:g} s, the first "
              f"{min(300.0, args.serve_duration / 4):g} s not counted")
    if args.serve_concurrency is not None:
        window += f", {load_text(args.serve_concurrency)}"
    return ServedEstimate(args.serve_engine, served,
                          also if served_also is not None else None, served_also,
                          cost.reserved_bytes_per_gpu / 1e9, source, window)
