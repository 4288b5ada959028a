"""The planner's objectives against the Helix authors' placements, served (issue 34).

For each cluster: `helixserve plan`'s served objective (`commands.served.plan_served`, on the
work clock: `--work-limit`), whose budget includes the max-flow portfolio's answer (what
`--objective flow` returns in the same share); then the served placement, the max-flow
answer and the Helix authors' Gurobi placement (benchmarks/helix-placements/) are each
simulated as `helixserve simulate --offline` does, in every engine model asked for
(default `vllm` and `helix-prototype`; the max-flow answer in the first only). Printed and written: max flows, what the planner
predicted each serves (its own scorer's run), what each serves simulated, and the ratios
milp / authors by the max-flow evaluator, by the planner's prediction and simulated.

    python -m benchmarks.planner_objective --work-limit 100 \\
        --json benchmarks/results/planner_objective.json

Everything is simulated and deterministic for the work limit and the seed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from helixserve.commands.served import plan_served
from helixserve.costmodel import CostModel
from helixserve.planner import evaluate, load_placement
from helixserve.planner.placement import Placement
from helixserve.simulator import SimConfig, Simulation, engine_config, summarize
from helixserve.simulator.presets import engine_gpu_reserve_gb
from helixserve.simulator.workload import load_azure_trace, prepare_trace
from helixserve.spec import load_cluster, load_model, load_profiles

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = {
    "helix-single-24": ROOT / "examples/clusters/helix-single-24.yaml",
    "helix-geo-24": ROOT / "examples/clusters/helix-geo-24.yaml",
    "helix-mix-42": ROOT / "benchmarks/helix-clusters/helix-mix-42.yaml",
}
MODEL = ROOT / "examples/models/llama-2-70b"
PROFILES = ROOT / "examples/profiles/helix-measured.csv"
TRACE = ROOT / "examples/traces/azure-llm-conv-2023.csv"


def simulate(cluster: Any, model: Any, cost: Any, placement: Placement, requests: list[Any],
             engine: str, duration_s: float, warmup_s: float) -> float:
    """Decode tokens/s as `helixserve simulate --offline --engine ENGINE` gives them."""
    if not placement.flows:
        placement.flows = evaluate(cluster, model, cost, placement).flows
    config = SimConfig(duration_s=duration_s, offline=True, warmup_s=warmup_s,
                       scheduler="maxflow", seed=0, **engine_config(engine))
    result = Simulation(cluster, model, cost, placement, requests, config).run()
    return float(summarize(result)["decode_throughput_tokens_per_s"])


def run_cluster(name: str, args: argparse.Namespace, requests: list[Any]) -> dict[str, Any]:
    cluster = load_cluster(CLUSTERS[name])
    model = load_model(MODEL)
    profiles = load_profiles(PROFILES)
    cost = CostModel(model, profiles, reserved_gb_per_gpu=engine_gpu_reserve_gb("vllm"))
    started = time.perf_counter()
    cpu = time.process_time()
    planned = plan_served(cluster, model, cost, requests, engine="vllm",
                          duration_s=args.serve_duration, work_limit=args.work_limit,
                          seed=args.seed, jobs=args.jobs,
                          progress=lambda m: print(f"  [{name}] {m}", flush=True))
    plan_s = time.perf_counter() - started
    authors = load_placement(ROOT / f"benchmarks/helix-placements/{name}-llama-2-70b.json")
    placements = {"milp": planned.placement, "max-flow answer": planned.flow,
                  "authors": authors}
    out: dict[str, Any] = {
        "cluster": name, "work_limit": args.work_limit, "plan_wall_s": round(plan_s, 1),
        "plan_process_cpu_s": round(time.process_time() - cpu, 1),
        "serve_duration_s": "auto" if args.serve_duration is None else args.serve_duration,
        "served_evaluations": planned.outcome.evaluations,
        "served_also": planned.also,
        "also_evaluations": planned.outcome.also_evaluations,
        "chosen_from": planned.outcome.best.source,
        "route_within_regions": planned.placement.route_within_regions,
        "starts": [{"source": s.source, "served_tokens_per_s": round(s.served_tokens_per_s, 1),
                    "also_tokens_per_s": (None if s.also_tokens_per_s is None
                                          else round(s.also_tokens_per_s, 1)),
                    "value": round(s.value, 4)}
                   for s in planned.outcome.starts],
        "climb": [round(s.served_tokens_per_s, 1) for s in planned.outcome.steps],
        "placements": {}}
    for label, p in placements.items():
        flow = evaluate(cluster, model, cost, p).throughput_tokens_per_s
        row: dict[str, Any] = {"max_flow_tokens_per_s": round(flow, 1),
                               "nodes": [[r.name, r.start_layer, r.end_layer] for r in p.nodes]}
        for engine in args.engines if label != "max-flow answer" else args.engines[:1]:
            engine_cost = CostModel(model, profiles,
                                    reserved_gb_per_gpu=engine_gpu_reserve_gb(engine))
            row[engine] = round(simulate(cluster, model, engine_cost, p, requests, engine,
                                         args.duration, args.warmup), 1)
            print(f"  [{name}] {label}: {engine} {row[engine]:,.1f} decode tokens/s", flush=True)
        out["placements"][label] = row
    # what the planner predicted: its scorer's number for milp, and the authors' placement
    # scored the same way (the scorer's window), for the ratio
    scorer_cfg = planned.config
    pred = {"milp": planned.served_tokens_per_s,
            "authors": simulate(cluster, model, cost, authors, requests, "vllm",
                                scorer_cfg.duration_s, scorer_cfg.warmup_s)}
    rows = out["placements"]
    out["ratios_milp_over_authors"] = {
        "max_flow": round(rows["milp"]["max_flow_tokens_per_s"]
                          / rows["authors"]["max_flow_tokens_per_s"], 3),
        "predicted_served": round(pred["milp"] / pred["authors"], 3),
        **{engine: round(rows["milp"][engine] / rows["authors"][engine], 3)
           for engine in args.engines},
        f"max-flow answer {args.engines[0]}": round(
            rows["max-flow answer"][args.engines[0]] / rows["authors"][args.engines[0]], 3),
    }
    out["predicted_served_tokens_per_s"] = {k: round(v, 1) for k, v in pred.items()}
    print(f"  [{name}] ratios milp / authors: {out['ratios_milp_over_authors']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    ap.add_argument("--work-limit", type=float, default=100.0,
                    help="plan --work-limit of the served objective (default 100)")
    ap.add_argument("--serve-duration", type=float, default=None,
                    help="the served objective's simulated seconds per placement (default: "
                         "each placement's own window, docs/planner.md, 'The scoring window')")
    ap.add_argument("--engines", nargs="+", default=["vllm", "helix-prototype"])
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    requests = prepare_trace(load_azure_trace(TRACE))
    results = []
    for name in args.clusters:
        results.append(run_cluster(name, args, requests))
        if args.json:  # after each cluster: a long run keeps what it measured
            Path(args.json).write_text(json.dumps(
                {"args": vars(args), "clusters": results}, indent=1) + "\n")
    for r in results:
        print(r["cluster"], r["ratios_milp_over_authors"])


if __name__ == "__main__":
    main()
