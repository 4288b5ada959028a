"""helixserve's `milp` next to the Helix authors' own Gurobi placements, same evaluator.

    python -m benchmarks.helix_compare --time-limit 60 --json benchmarks/results/helix_compare.json

Every case is a cluster, a model and the placement the Helix authors' MILP (Gurobi, 8 to
50 minutes on their machine) produced for it, converted from their artifact by
`benchmarks/helix_artifact.py` (`benchmarks/helix-placements/`, the source in each file):

- helix-single-24 and helix-geo-24 with LLaMA-2-70B (`examples/clusters/`);
- helix-mix-42 with LLaMA-2-70B: the paper's high-heterogeneity cluster (4 A100, 6 V100,
  8 L4, 4 2xL4, 10 T4, 6 2xT4, 4 4xT4, all links 8 Gbit/s), its exact `.ini`
  (`benchmarks/helix-clusters/`);
- helix-mix-10 with LLaMA-30B: the 10-machine cluster (4 L4, 6 T4) of the paper's
  solution-quality ablation.

For each: the Helix placement's max flow (what `helixserve evaluate` prints), `milp`'s
throughput with `--time-limit`, its proven bound and gap, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from helixserve.costmodel import CostModel
from helixserve.planner import evaluate, load_placement, plan
from helixserve.planner.parallel import check_jobs
from helixserve.spec import load_cluster, load_model, load_profiles

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent / "examples"  # the data the docs use (examples/README.md)
#: (cluster file, model)
CASES = [
    (SHARED / "clusters" / "helix-single-24.yaml", "llama-2-70b"),
    (SHARED / "clusters" / "helix-geo-24.yaml", "llama-2-70b"),
    (HERE / "helix-clusters" / "helix-mix-42.yaml", "llama-2-70b"),
    (HERE / "helix-clusters" / "helix-mix-10.yaml", "llama-30b"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=60.0, help="milp budget per case (s)")
    ap.add_argument("--cases", help="comma-separated cluster names (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes for milp's searches (default: the cores, at most 8)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    jobs = check_jobs(args.jobs)

    profiles = load_profiles(SHARED / "profiles" / "helix-measured.csv")
    wanted = set(args.cases.split(",")) if args.cases else None
    head = (f"{'cluster':<16} {'model':<12} {'Helix Gurobi':>12} {'milp':>10} {'bound':>10} "
            f"{'gap':>6} {'milp/Helix':>10} {'time s':>7}")
    print(head)
    print("-" * len(head))
    rows = []
    for cluster_path, model_name in CASES:
        cluster = load_cluster(cluster_path)
        if wanted and cluster.name not in wanted:
            continue
        model = load_model(SHARED / "models" / model_name)
        cost = CostModel(model, profiles)
        helix_path = HERE / "helix-placements" / f"{cluster.name}-{model.name}.json"
        helix = evaluate(cluster, model, cost, load_placement(helix_path)).throughput_tokens_per_s
        started = time.perf_counter()
        ours = plan("milp", cluster, model, cost, time_limit_s=args.time_limit, seed=args.seed,
                    jobs=jobs)
        wall = time.perf_counter() - started
        thr = ours.throughput_tokens_per_s or 0.0
        bound = ours.upper_bound_tokens_per_s
        gap = None if not bound else max(0.0, 1 - thr / bound)
        rows.append({"cluster": cluster.name, "nodes": len(cluster.nodes), "model": model.name,
                     "helix_placement": str(helix_path.relative_to(HERE.parent)),
                     "helix_tokens_per_s": helix, "milp_tokens_per_s": thr,
                     "upper_bound_tokens_per_s": bound, "gap": gap, "ratio": thr / helix,
                     "solve_time_s": wall, "placement": ours.to_dict()["nodes"]})
        print(f"{cluster.name:<16} {model.name:<12} {helix:>12,.1f} {thr:>10,.1f} "
              f"{'' if bound is None else f'{bound:,.1f}':>10} "
              f"{'' if gap is None else f'{gap:.1%}':>6} {thr / helix:>10.2f} {wall:>7.1f}",
              flush=True)
    if args.json:
        meta = {"time_limit_s": args.time_limit, "seed": args.seed, "jobs": jobs, "machine": platform.node(),
                "python": platform.python_version(), "processor": platform.processor(),
                "cpus": os.cpu_count()}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
