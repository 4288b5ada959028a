"""milp against the baselines on random clusters nobody tuned for: is it ever worse, or late?

    python -m benchmarks.planner_random --seeds 0-7 --time-limit 10 --json planner_random.json

Each seed draws a cluster: 16-60 machines of seven GPU kinds (A100-40GB/80GB, H100-80GB,
A10, L4, T4, V100-16GB), 1-4 GPUs each, 1-4 regions, 1/10/25 Gbit/s inside a region and
0.05-0.5 Gbit/s between regions, and LLaMA-2-70B or LLaMA-30B with Helix's measured
profiles (the analytic model for the GPUs they lack). Every planner plans it; the table
gives milp's throughput, bound and gap, its ratio to the best baseline, and its wall time
against the limit. Kinds beyond Helix's profiled four exercise the roofline cost model.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from helixserve.costmodel import CostModel
from helixserve.planner import plan
from helixserve.planner.baselines import BASELINES
from helixserve.spec import ClusterSpec, LinkSpec, NodeSpec, load_model, load_profiles

SHARED = Path(__file__).resolve().parents[1] / "examples"  # examples/README.md
GPUS = ["A100-40GB", "L4", "T4", "V100-16GB", "A10", "H100-80GB", "A100-80GB"]
MODELS = ["llama-2-70b", "llama-30b"]


def random_cluster(seed: int) -> tuple[ClusterSpec, str]:
    """(cluster, model name) of one seed."""
    rng = random.Random(seed)
    num_nodes, num_regions = rng.randint(16, 60), rng.randint(1, 4)
    nodes = [NodeSpec(f"n{i}", rng.choice(GPUS), rng.choice([1, 1, 1, 2, 4]),
                      region=f"r{rng.randrange(num_regions)}") for i in range(num_nodes)]
    between = {frozenset((f"r{a}", f"r{b}")): LinkSpec(rng.choice([0.05, 0.1, 0.5]), 50.0)
               for a in range(num_regions) for b in range(a + 1, num_regions)}
    cluster = ClusterSpec(
        f"random-{seed}", nodes, coordinator_region="r0",
        default_link=LinkSpec(rng.choice([1.0, 10.0, 25.0]), 1.0),
        between_regions=between, source=f"random-{seed}")
    return cluster, rng.choice(MODELS)


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0-7", help="e.g. 0-7 or 1,5,9")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--jobs", type=int, default=None, help="milp's processes (default: cores)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    profiles = load_profiles(SHARED / "profiles" / "helix-measured.csv")
    rows = []
    header = (f"{'seed':>4} {'nodes':>5} {'reg':>3} {'model':<12} {'milp tok/s':>11} "
              f"{'bound':>10} {'gap':>6} {'best baseline':>20} {'x':>5} {'wall s':>7}")
    print(header)
    print("-" * len(header))
    for seed in parse_seeds(args.seeds):
        cluster, model_name = random_cluster(seed)
        model = load_model(SHARED / "models" / model_name)
        cost = CostModel(model, profiles)
        base = {}
        for name in BASELINES:
            base[name] = plan(name, cluster, model, cost).throughput_tokens_per_s
        started = time.perf_counter()
        p = plan("milp", cluster, model, cost, time_limit_s=args.time_limit, seed=seed,
                 jobs=args.jobs)
        wall = time.perf_counter() - started
        best_name = max(base, key=lambda n: base[n])
        bound = p.upper_bound_tokens_per_s
        gap = None if not bound else 1 - p.throughput_tokens_per_s / bound
        ratio = p.throughput_tokens_per_s / base[best_name] if base[best_name] else None
        row = {"seed": seed, "nodes": len(cluster.nodes),
               "regions": len({n.region for n in cluster.nodes}), "model": model_name,
               "milp_tokens_per_s": p.throughput_tokens_per_s, "upper_bound_tokens_per_s": bound,
               "gap": gap, "baselines_tokens_per_s": base, "best_baseline": best_name,
               "ratio_to_best_baseline": ratio, "wall_s": wall,
               "time_limit_s": args.time_limit}
        rows.append(row)
        print(f"{seed:>4} {row['nodes']:>5} {row['regions']:>3} {model_name:<12} "
              f"{p.throughput_tokens_per_s:>11,.1f} {bound or 0:>10,.1f} "
              f"{'' if gap is None else f'{gap:.1%}':>6} "
              f"{best_name + ' ' + format(base[best_name], ',.0f'):>20} "
              f"{'' if ratio is None else f'{ratio:.2f}':>5} {wall:>7.1f}", flush=True)
    worse = [r["seed"] for r in rows
             if r["milp_tokens_per_s"] < max(r["baselines_tokens_per_s"].values()) * (1 - 1e-9)]
    late = [r["seed"] for r in rows if r["wall_s"] > args.time_limit + 5]
    print(f"milp below the best baseline: {worse or 'never'}; "
          f"more than 5 s past the limit: {late or 'never'}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "python": platform.python_version()},
            "time_limit_s": args.time_limit, "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
