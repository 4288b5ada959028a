"""Workload-aware plans against the baselines, each simulated on the same trace.

For each cluster (default helix-single-24 and helix-geo-24, llama-2-70b, Helix's measured
profiles) and one request mix (default `prefill`: a seeded synthetic trace of prompts of
1900-2048 tokens and outputs of 16-48; or `conversation`, the Azure conversation trace; or
a trace CSV), the placements
  * milp          planned for the mix (`plan --workload TRACE`: the trace's mean lengths),
  * milp-decode   planned decode-only (`plan --workload decode`, Helix's flow),
  * swarm, separate, petals   the baselines (planned with the mix's cost model too),
are simulated offline (saturated) on that trace with the vllm engine model (on-demand KV,
512-token prefill chunks; `simulate`'s default, as the runtime serves), milp + maxflow,
milp-decode + maxflow, swarm + swarm, separate + shortest-queue (each machine type's
pipeline its own cluster, results summed, as Helix's artifact simulates it;
benchmarks/serving_sim.py) and petals + shortest-queue. Every placement's flows (the
maxflow router's weights) are re-evaluated under the mix's cost model before it is
simulated, so placements differ only in where the layers are. Reported: the max flow in
output tokens/s of the mix, and simulated decode tokens/s and finished requests/s after
the warmup. The milp planners run on the work clock (`--work-limit`), so the placements,
and hence the table, are the same on any machine.

    python -m benchmarks.workload_plans --json benchmarks/results/workload_plans.json
    python -m benchmarks.workload_plans --mix conversation --planners milp milp-decode
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from helixserve.costmodel import CostModel, Workload
from helixserve.planner import Placement, evaluate, plan
from helixserve.simulator.mix import parse_workload
from helixserve.simulator.presets import ENGINES, engine_gpu_reserve_gb
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import TraceRequest, load_azure_trace, prepare_trace
from helixserve.spec import ClusterSpec, ModelSpec, load_cluster, load_model, load_profiles

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / "examples"  # the data the docs use (examples/README.md)
#: (placement, router) pairs, as benchmarks/serving_sim.py's headline
ROUTER = {"milp": "maxflow", "milp-decode": "maxflow", "swarm": "swarm",
          "separate": "shortest-queue", "petals": "shortest-queue"}
ENGINE = "vllm"


def prefill_trace(path: Path, requests: int, seed: int) -> Path:
    """A seeded Azure-format trace of long prompts and short outputs (RAG, summarisation,
    code completion): prompts uniform in 1900..2048 tokens (within Helix's length filter),
    outputs in 16..48, one arrival every 0.1 s (offline runs ignore the times)."""
    rng = random.Random(seed)
    t0 = datetime(2026, 1, 1)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for i in range(requests):
            stamp = (t0 + timedelta(seconds=0.1 * i)).isoformat(sep=" ")
            out.writerow([stamp, rng.randint(1900, 2048), rng.randint(16, 48)])
    return path


def simulate(cluster: ClusterSpec, model: ModelSpec, cost: CostModel, placement: Placement,
             reqs: list[TraceRequest], config: SimConfig) -> dict[str, float]:
    result = Simulation(cluster, model, cost, placement, reqs, config).run()
    window_s = result.end_s - config.warmup_s
    done = sum(1 for r in result.finished if r.finish_s >= config.warmup_s)
    return {"decode_tokens_per_s": result.decode_tokens / window_s,
            "prompt_tokens_per_s": result.prompt_tokens / window_s,
            "requests_per_s": done / window_s, "wall_s": result.wall_s}


def run_cluster(name: str, model: ModelSpec, profiles: Any, mix: Workload,
                trace: list[TraceRequest], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Plan and simulate every placement of `args.planners` on cluster `name`."""
    cluster = load_cluster(SHARED / "clusters" / f"{name}.yaml")
    reserve = engine_gpu_reserve_gb(ENGINE)
    cost = CostModel(model, profiles, reserved_gb_per_gpu=reserve, workload=mix)
    decode_cost = CostModel(model, profiles, reserved_gb_per_gpu=reserve)
    config = SimConfig(duration_s=args.duration, offline=True, warmup_s=args.warmup,
                       seed=args.seed, **ENGINES[ENGINE])
    from benchmarks import serving_sim  # separate's per-type split
    rows: list[dict[str, Any]] = []
    for planner in args.planners:
        started = time.perf_counter()
        base = "milp" if planner == "milp-decode" else planner
        placement = plan(base, cluster, model, decode_cost if planner == "milp-decode" else cost,
                         seed=args.seed, work_limit=args.work_limit, jobs=1)
        plan_s = time.perf_counter() - started
        res = evaluate(cluster, model, cost, placement)  # in the mix's unit, for every planner
        placement.flows, placement.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s
        config.scheduler = ROUTER[planner]
        parts = (serving_sim.split_by_type(cluster, model, cost, placement)
                 if planner == "separate" else [])
        sims = ([simulate(c, model, cost, p, trace, config) for c, p in parts] if parts
                else [simulate(cluster, model, cost, placement, trace, config)])
        row: dict[str, Any] = {
            "cluster": name, "placement": planner, "scheduler": config.scheduler,
            "max_flow_tokens_per_s": res.throughput_tokens_per_s,
            "max_flow_requests_per_s": mix.requests_per_s(res.throughput_tokens_per_s),
            **{k: sum(s[k] for s in sims) for k in sims[0]},
            "plan_s": plan_s,
            "nodes": [[r.name, r.start_layer, r.end_layer] for r in placement.nodes],
        }
        if parts:
            row["note"] = "each machine type's pipeline simulated as its own cluster, summed"
        rows.append(row)
        print_rows([row], header=len(rows) == 1 and name == args.clusters[0])
        sys.stdout.flush()
    return rows


def print_rows(rows: list[dict[str, Any]], header: bool = True) -> None:
    head = (f"{'cluster':<16} {'placement':<12} {'router':<14} {'max flow tok/s':>14} "
            f"{'decode tok/s':>12} {'requests/s':>10} {'vs milp':>8}")
    if header:
        print(head)
        print("-" * len(head))
    for r in rows:
        ratio = r.get("milp_over_this")
        print(f"{r['cluster']:<16} {r['placement']:<12} {r['scheduler']:<14} "
              f"{r['max_flow_tokens_per_s']:>14,.1f} {r['decode_tokens_per_s']:>12.1f} "
              f"{r['requests_per_s']:>10.3f} "
              f"{(f'{ratio:.2f}x' if ratio else ''):>8}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", nargs="+", default=["helix-single-24", "helix-geo-24"])
    ap.add_argument("--model", default="llama-2-70b")
    ap.add_argument("--planners", nargs="+", default=list(ROUTER), choices=list(ROUTER))
    ap.add_argument("--mix", default="prefill",
                    help="prefill (synthetic, ~2000:30), conversation (the Azure trace) or a "
                    "trace CSV (default prefill)")
    ap.add_argument("--work-limit", type=float, default=40.0,
                    help="work units of each milp plan (default 40; `plan --work-limit`)")
    ap.add_argument("--duration", type=float, default=400.0, help="simulated s (default 400)")
    ap.add_argument("--warmup", type=float, default=100.0, help="not counted (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = ap.parse_args()

    if args.mix == "prefill":
        trace_path = prefill_trace(Path("/tmp") / f"helixserve-prefill-{args.seed}.csv",
                                   2000, args.seed)
    elif args.mix == "conversation":
        trace_path = SHARED / "traces" / "azure-llm-conv-2023.csv"
    else:
        trace_path = Path(args.mix)
    mix = parse_workload(str(trace_path))
    assert mix is not None
    trace = prepare_trace(load_azure_trace(trace_path))
    model = load_model(SHARED / "models" / args.model)
    profiles = load_profiles(SHARED / "profiles" / "helix-measured.csv")
    print(f"mix: {args.mix}: {mix.describe()}; engine {ENGINE}; offline {args.duration:.0f} s "
          f"simulated, first {args.warmup:.0f} s not counted; milp --work-limit "
          f"{args.work_limit:g}")
    rows: list[dict[str, Any]] = []
    for name in args.clusters:
        rows += run_cluster(name, model, profiles, mix, trace, args)
    by = {(r["cluster"], r["placement"]): r for r in rows}
    for r in rows:
        ours = by.get((r["cluster"], "milp"))
        if ours is not None and r["placement"] != "milp" and r["decode_tokens_per_s"] > 0:
            r["milp_over_this"] = ours["decode_tokens_per_s"] / r["decode_tokens_per_s"]
    print()
    print_rows(rows)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
            f"python {platform.python_version()}",
            "command": " ".join(["python", *sys.argv]),
            "mix": {"name": args.mix, "prompt_tokens": mix.prompt_tokens,
                    "output_tokens": mix.output_tokens,
                    "trace_requests": len(trace),
                    "mean_trace_prompt": statistics.fmean(q.prompt_tokens for q in trace)},
            "engine": ENGINE, "work_limit": args.work_limit, "duration_s": args.duration,
            "warmup_s": args.warmup, "results": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
