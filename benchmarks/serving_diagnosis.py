"""Why simulated throughput is far below max flow: Little's law per placement.

For each placement on a cluster (llama-2-70b, Azure conversation trace, offline/saturated,
maxflow router, the `--engine` model and its memory: `vllm` by default) it prints the max flow, the KV concurrency bound (max flow with every node's
capacity = the requests its KV cache holds), the simulated decode throughput X, the
requests in flight, the mean route depth, R0 (sum over layers of one decode step's per-layer
time at batch 1: the fastest a round trip can be) and the observed round trip R = in flight
/ X (Little's law). `--variants` also plans `milp` under an opt-in cost model (a smaller
weight fraction) and simulates those placements. `--spread-check` also routes each placement
over the solver's flow (`SimConfig.router_spread=False`). `--engine-options` instead measures
the engine model's options one at a time (docs/simulator.md, "Engine-model options,
measured") on the placement + router pairs of docs/benchmarks.md's headline.

    python -m benchmarks.serving_diagnosis --variants --spread-check \
        --json benchmarks/results/serving_diagnosis.json
    python -m benchmarks.serving_diagnosis --engine-options \
        --json benchmarks/results/serving_diagnosis_engine_options.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

import benchmarks.serving_sim as serving_sim
from benchmarks.serving_sim import SHARED, cached_plan, kv_balanced_reference
from helixserve.costmodel import CostModel
from helixserve.planner import Placement, evaluate, load_placement
from helixserve.planner.flow import FlowNetwork
from helixserve.simulator.metrics import summarize
from helixserve.simulator.presets import ENGINES, engine_gpu_reserve_gb
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import load_azure_trace, prepare_trace
from helixserve.spec import load_cluster, load_model, load_profiles

REPO = Path(__file__).resolve().parents[1]


def kv_concurrency(net: FlowNetwork, cost: CostModel, placement: Placement,
                   request_kv_tokens: float) -> float:
    """Most requests the placement holds at once: max flow with node capacity = KV requests."""
    n = len(net.names)
    starts, sizes, caps = np.zeros(n, dtype=int), np.zeros(n, dtype=int), np.zeros(n)
    for i, (s, e) in net.ranges_of(placement).items():
        starts[i], sizes[i] = s, e - s
        caps[i] = cost.kv_capacity_tokens(net.cluster.nodes[i], e - s) / request_kv_tokens
    # link capacities are tokens/s, far above any request count: only the nodes bind
    return net.max_flow_value(starts, sizes, caps=caps)


def min_round_trip_s(net: FlowNetwork, cost: CostModel, placement: Placement) -> float:
    """R0: per layer, the mean over the nodes holding it of a batch-1 decode step's time."""
    ranges = net.ranges_of(placement)
    total_ms = 0.0
    for layer in range(net.model.num_layers):
        times = [cost.layer_time_ms(net.cluster.nodes[i].gpu, net.cluster.nodes[i].num_gpus, 0, 1)
                 for i, (s, e) in ranges.items() if s <= layer < e]
        total_ms += statistics.fmean(times)
    return total_ms / 1000.0


def kv_ceiling_tokens_per_s(cluster: Any, cost: CostModel, model: Any, in_flight: float,
                            prompt_per_output: float) -> float:
    """C: decode tokens/s if every machine ran a decode batch of in_flight / machines all the
    time (a request in flight sits in at most one node's batch at a time), with the trace's
    prompt tokens per output token prefilled alongside in 512-token chunks (their time shared
    pro rata over the iterations) and the layers shared out ideally (each machine's
    layer-steps/s summed, over the model's layers)."""
    b = in_flight / len(cluster.nodes)
    if b <= 0:
        return 0.0
    chunk = 512
    layer_tokens_per_s = 0.0
    for n in cluster.nodes:
        step_ms = (cost.layer_time_ms(n.gpu, n.num_gpus, 0, max(1, round(b)))
                   + prompt_per_output * b / chunk
                   * cost.layer_time_ms(n.gpu, n.num_gpus, chunk, 0))
        layer_tokens_per_s += b * 1000.0 / step_ms
    return float(layer_tokens_per_s / model.num_layers)


#: the engine-model options measured one at a time (docs/simulator.md, "Engine-model
#: options, measured"): name -> SimConfig fields; chunk rows pipeline their chunks too, as
#: the `vllm` preset does with its 512
def engine_option_rows() -> dict[str, dict[str, Any]]:
    reserve, vllm = ENGINES["reserve"], ENGINES["vllm"]
    on_demand = {**reserve, "kv_allocation": "on-demand"}
    rows: dict[str, dict[str, Any]] = {
        "reserve": dict(reserve),
        "on-demand": on_demand,
        "reserve+chunked-512": {**reserve, "chunked_prefill": True, "max_prompt_tokens": 512,
                                "prefill_chunk_tokens": 512},
    }
    for b in (128, 256, 512, 1024, 2048):
        rows[f"on-demand+chunked-{b}"] = {**on_demand, "chunked_prefill": True,
                                          "max_prompt_tokens": b, "prefill_chunk_tokens": b}
    for m in (16, 32, 64, 128):
        rows[f"on-demand+chunked-512+max-prefilling-{m}"] = {
            **rows["on-demand+chunked-512"], "max_prefilling": m}
    assert rows["on-demand+chunked-512+max-prefilling-64"] == dict(vllm)
    # the preset with each chunk's prompt moved on whole once it has run on a node
    rows["vllm-chunks-not-pipelined"] = {**vllm, "prefill_chunk_tokens": None}
    return rows


#: (placement, router) pairs of the engine-options table, as in docs/benchmarks.md's headline
OPTION_PAIRS = [("milp", "maxflow"), ("petals", "shortest-queue"), ("swarm", "swarm"),
                ("kv-balanced-hand", "maxflow")]
#: rows where only the first three pairs run (the hand placement does not change the point)
SHORT_ROWS = ("max-prefilling-16", "max-prefilling-32", "max-prefilling-128")


def run_engine_options(cluster: Any, model: Any, cost: CostModel, trace: Any,
                       placements: dict[str, Placement], args: argparse.Namespace
                       ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for option, fields in engine_option_rows().items():
        if args.options and option not in args.options:
            continue
        cells: dict[str, float] = {}
        ttft: dict[str, float] = {}
        for name, router in OPTION_PAIRS:
            if name not in placements or (name == "kv-balanced-hand"
                                          and option.endswith(SHORT_ROWS)):
                continue
            cfg = SimConfig(duration_s=args.duration, offline=True, warmup_s=args.warmup,
                            scheduler=router, **fields)
            result = Simulation(cluster, model, cost, placements[name], trace, cfg).run()
            summary = summarize(result)
            cells[f"{name}+{router}"] = summary["decode_throughput_tokens_per_s"]
            ttft[f"{name}+{router}"] = summary["ttft_s"]["p50"]
        rows.append({"option": option, "engine_config": fields,
                     "decode_throughput_tokens_per_s": cells, "ttft_p50_s": ttft})
        print(f"{option:<42} " + " ".join(f"{k}={v:.1f}" for k, v in cells.items()))
        sys.stdout.flush()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="helix-single-24")
    ap.add_argument("--model", default="llama-2-70b")
    ap.add_argument("--planners", nargs="+", default=["milp", "petals", "swarm"])
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument("--engine", choices=sorted(ENGINES), default="vllm",
                    help="engine model of the simulation and its memory (docs/simulator.md)")
    ap.add_argument("--gpu-reserve-gb", type=float, default=None,
                    help="memory per GPU outside weights and KV (default: the engine's)")
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="prompt tokens one iteration may prefill (SimConfig.max_prompt_tokens;"
                    " default: the engine's)")
    ap.add_argument("--variants", action="store_true",
                    help="also plan milp under the opt-in cost models and simulate those")
    ap.add_argument("--weight-fractions", type=float, nargs="*", default=[0.4],
                    help="--variants: weight fractions of the cost models")
    ap.add_argument("--spread-check", action="store_true",
                    help="also route each placement over the solver's flow (no spread)")
    ap.add_argument("--engine-options", action="store_true",
                    help="measure the engine model's options one at a time instead")
    ap.add_argument("--options", nargs="+", choices=sorted(engine_option_rows()), default=None,
                    help="--engine-options: only these rows (default: all)")
    ap.add_argument("--plan-time-limit", type=float, default=60.0)
    ap.add_argument("--cache", type=Path,
                    default=REPO / "benchmarks" / "results" / "serving_sim_placements")
    ap.add_argument("--sim-json", type=Path,
                    default=REPO / "benchmarks" / "results" / "serving_sim_vllm_memory.json",
                    help="serving_sim.py's results: which cached placements it measured")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = ap.parse_args()

    model = load_model(SHARED / "models" / args.model)
    profiles = load_profiles(SHARED / "profiles" / "helix-measured.csv")
    reserve_gb = engine_gpu_reserve_gb(args.engine, args.gpu_reserve_gb)
    cost = CostModel(model, profiles, reserved_gb_per_gpu=reserve_gb)
    serving_sim.GPU_RESERVE_GB = reserve_gb  # the placement cache's fingerprint has it
    engine = dict(ENGINES[args.engine])
    if args.max_prompt_tokens is not None:
        engine["max_prompt_tokens"] = args.max_prompt_tokens
    cluster = load_cluster(SHARED / "clusters" / f"{args.cluster}.yaml")
    trace = prepare_trace(load_azure_trace(SHARED / "traces" / "azure-llm-conv-2023.csv"))
    prompts = [r.prompt_tokens for r in trace]
    outputs = [r.output_tokens for r in trace]
    mean_kv = statistics.fmean(p + o for p, o in zip(prompts, outputs, strict=True))
    # a request stays in flight for a time ~ its output, so the requests in flight are
    # length-biased: their mean footprint is the output-weighted mean, not the plain one
    biased_kv = sum((p + o) * o for p, o in zip(prompts, outputs, strict=True)) / sum(outputs)
    net = FlowNetwork(cluster, model, cost)

    # the placements benchmarks/serving_sim.py measured (its JSON names the files), so the
    # numbers line up with docs/benchmarks.md; planned afresh when not there
    used: dict[str, str] = {}
    if args.sim_json.exists():
        used = json.loads(args.sim_json.read_text()).get("placements", {})
    placements: dict[str, Placement] = {}
    planners = list(args.planners)
    if args.engine_options:
        planners = [p for p, _ in OPTION_PAIRS if p != "kv-balanced-hand"]
    for p in planners:
        f = args.cache / used.get(f"{cluster.name}/{p}", "-")
        placements[p] = (load_placement(f) if f.is_file() else
                         cached_plan(p, cluster, model, cost, args.cache, args.plan_time_limit,
                                     False))
    hand = kv_balanced_reference(cluster, model)
    if hand is not None:
        placements["kv-balanced-hand"] = hand
    authors = REPO / "benchmarks" / "helix-placements" / f"{cluster.name}-{model.name}.json"
    if authors.exists() and not args.engine_options:
        placements["helix-authors"] = load_placement(authors)
    if args.variants and not args.engine_options:
        for f in args.weight_fractions:
            name = f"milp-weight-{f:g}"
            vcost = CostModel(model, profiles, weight_fraction=f, reserved_gb_per_gpu=reserve_gb)
            print(f"  planning milp for {name} ...", file=sys.stderr)
            placements[name] = cached_plan("milp", cluster, model, vcost, args.cache / name,
                                           args.plan_time_limit, False)
    for placement in placements.values():
        res = evaluate(cluster, model, cost, placement)
        placement.flows, placement.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s

    out: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                   f"python {platform.python_version()}",
        "command": " ".join(["python -m benchmarks.serving_diagnosis", *sys.argv[1:]]),
        "cluster": cluster.name, "model": model.name, "duration_s": args.duration,
        "warmup_s": args.warmup, "engine": args.engine, "engine_config": engine,
        "gpu_reserve_gb": cost.reserved_bytes_per_gpu / 1e9,
        "mean_request_kv_tokens": mean_kv, "length_biased_request_kv_tokens": biased_kv,
        "max_flow_tokens_per_s": {n: p.throughput_tokens_per_s for n, p in placements.items()},
    }
    if args.engine_options:
        out["rows"] = run_engine_options(cluster, model, cost, trace, placements, args)
    else:
        out["rows"] = diagnose(cluster, model, cost, net, trace, placements, engine, args,
                               mean_kv, biased_kv)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def diagnose(cluster: Any, model: Any, cost: CostModel, net: FlowNetwork, trace: Any,
             placements: dict[str, Placement], engine: dict[str, Any],
             args: argparse.Namespace, mean_kv: float, biased_kv: float
             ) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    prompt_per_output = (sum(r.prompt_tokens for r in trace)
                         / sum(r.output_tokens for r in trace))
    head = (f"{'placement':<18} {'max flow':>8} {'KV reqs':>7} {'decode X':>8} {'in flight':>9} "
            f"{'depth':>5} {'R0 s':>5} {'R s':>5} {'R/R0':>5} {'util':>5} {'batch':>5}")
    print(head)
    print("-" * len(head))
    for name, placement in placements.items():
        cfg = SimConfig(duration_s=args.duration, offline=True, warmup_s=args.warmup,
                        scheduler="maxflow", **engine)
        result = Simulation(cluster, model, cost, placement, trace, cfg).run()
        summary = summarize(result)
        x = summary["decode_throughput_tokens_per_s"]
        depth = statistics.fmean(len(r.nodes) for r in result.finished) if result.finished else 0.0
        r0 = min_round_trip_s(net, cost, placement)
        round_trip = result.in_flight / x if x else float("inf")
        row: dict[str, Any] = {
            "placement": name,
            "max_flow_tokens_per_s": placement.throughput_tokens_per_s,
            "kv_concurrency_requests": kv_concurrency(net, cost, placement, mean_kv),
            "kv_concurrency_biased_requests": kv_concurrency(net, cost, placement, biased_kv),
            "decode_throughput_tokens_per_s": x,
            "in_flight_requests": result.in_flight,
            "preemptions": summary.get("preemptions"),
            "mean_route_depth": depth,
            "min_round_trip_s": r0,
            "round_trip_s": round_trip,
            "mean_node_utilization": statistics.fmean(n["utilization"] for n in summary["nodes"]),
            "mean_decode_batch": statistics.fmean(n["mean_decode_batch"] for n in summary["nodes"]),
            "ranges": [(r.name, r.start_layer, r.end_layer) for r in placement.nodes],
        }
        if args.spread_check:
            solver = SimConfig(duration_s=args.duration, offline=True, warmup_s=args.warmup,
                               scheduler="maxflow", router_spread=False, **engine)
            sres = summarize(Simulation(cluster, model, cost, placement, trace, solver).run())
            row["solver_flow_decode_throughput_tokens_per_s"] = (
                sres["decode_throughput_tokens_per_s"])
            row["solver_flow_mean_node_utilization"] = statistics.fmean(
                n["utilization"] for n in sres["nodes"])
        row["kv_ceiling_tokens_per_s"] = kv_ceiling_tokens_per_s(
            cluster, cost, model, result.in_flight, prompt_per_output)
        rows.append(row)
        print(f"{name:<18} {row['max_flow_tokens_per_s']:>8.0f} "
              f"{row['kv_concurrency_requests']:>7.0f} {x:>8.1f} {result.in_flight:>9d} "
              f"{depth:>5.1f} {r0:>5.2f} {round_trip:>5.2f} {round_trip / r0:>5.2f} "
              f"{row['mean_node_utilization']:>5.0%} {row['mean_decode_batch']:>5.1f}"
              f"  C {row['kv_ceiling_tokens_per_s']:.0f}"
              + (f"  solver flow {row['solver_flow_decode_throughput_tokens_per_s']:.1f}"
                 if args.spread_check else ""))
        sys.stdout.flush()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
