"""`helixserve evaluate`: max-flow throughput of a placement on a cluster."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from helixserve.commands.args import Output, check_image, write_outputs
    from helixserve.commands.plan import load_inputs, throughput_text
    from helixserve.planner import evaluate, load_placement
    from helixserve.planner.report import format_table, node_rows, plot_placement

    plot_path = check_image("--plot", args.plot) if args.plot else None
    cluster, model, cost = load_inputs(args)
    placement = load_placement(args.placement)
    result = evaluate(cluster, model, cost, placement,
                      partial_inference=not args.no_partial_inference)
    placement.flows = result.flows
    placement.throughput_tokens_per_s = result.throughput_tokens_per_s
    mix = cost.workload
    if args.json:
        print(json.dumps({
            "throughput_tokens_per_s": round(result.throughput_tokens_per_s, 6),
            **({} if mix is None else {
                "requests_per_s": round(mix.requests_per_s(result.throughput_tokens_per_s), 6),
                "workload": {"source": mix.source, "prompt_tokens": round(mix.prompt_tokens, 3),
                             "output_tokens": round(mix.output_tokens, 3)}}),
            "flows": [{"src": f.src, "dst": f.dst, "tokens_per_s": round(f.tokens_per_s, 6)}
                      for f in result.flows],
        }, indent=2))
    else:
        held = {r.name for r in placement.nodes}
        unused = [n.name for n in cluster.nodes if n.name not in held]
        print(format_table(node_rows(cluster, cost, placement, result.flows), unused))
        covered = "" if placement.covers_all_layers() else " (layers not all covered!)"
        print(f"throughput {throughput_text(result.throughput_tokens_per_s, mix)}{covered}")
    if plot_path is not None:
        write_outputs([Output("--plot", plot_path, lambda path: plot_placement(
            cluster, placement, result.flows, path))])
    return 0
