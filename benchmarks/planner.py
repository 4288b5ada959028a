"""Benchmark every placement planner on the shared Helix clusters and synthetic ones.

    python -m benchmarks.planner --time-limit 60 --json planner.json

For each (cluster, model, planner): the max-flow throughput of the placement, the proven
upper bound and gap (milp only), the solve time, and the ratio to the best baseline.
Clusters: examples/clusters/helix-*.yaml, plus synthetic-50 and synthetic-100 (seeded,
four regions, a mix of the machines Helix profiled). On request (`--clusters mix-42` or
`mix-42-geo`): the Helix paper's 42-machine high-heterogeneity GPU mix, in one region or
dealt over three, with links like the 24-machine files' (seeded). Models: llama-2-70b and llama-30b
from examples/models, with the measured profiles.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from helixserve.costmodel import CostModel
from helixserve.planner import PLANNERS, plan
from helixserve.planner.parallel import check_jobs
from helixserve.spec import ClusterSpec, LinkSpec, NodeSpec, load_cluster, load_model, load_profiles

SHARED = Path(__file__).resolve().parents[1] / "examples"  # examples/README.md
MACHINES = [("A100-40GB", 1), ("V100-16GB", 1), ("L4", 1), ("L4", 2), ("T4", 1), ("T4", 2),
            ("T4", 4)]
MACHINE_WEIGHTS = [2, 1, 3, 2, 4, 2, 1]


def synthetic_cluster(num_nodes: int, seed: int = 0, num_regions: int = 4) -> ClusterSpec:
    """Seeded mix of Helix's machine kinds over regions: 8-12 Gbit/s inside a region,
    0.08-0.5 Gbit/s between regions (per directed pair), coordinator in region 0."""
    rng = random.Random(seed)
    nodes = []
    for i in range(num_nodes):
        gpu, n = rng.choices(MACHINES, weights=MACHINE_WEIGHTS)[0]
        nodes.append(NodeSpec(f"n{i}", gpu, n, region=f"r{i % num_regions}"))
    explicit: dict[tuple[str, str], LinkSpec] = {}
    for a in nodes:
        for b in nodes:
            if a is b:
                continue
            if a.region == b.region:
                explicit[(a.name, b.name)] = LinkSpec(rng.uniform(8.0, 12.0), 1.0)
            else:
                explicit[(a.name, b.name)] = LinkSpec(rng.uniform(0.08, 0.5), 40.0)
    return ClusterSpec(f"synthetic-{num_nodes}", nodes, coordinator_region="r0",
                       default_link=LinkSpec(1.0, 10.0), explicit=explicit,
                       source=f"synthetic-{num_nodes}")


#: the Helix paper's 42-machine high-heterogeneity cluster: 4 A100, 6 V100, 8 L4, 4 2xL4,
#: 10 T4, 6 2xT4, 4 4xT4
MIX_42 = ([("A100-40GB", 1)] * 4 + [("V100-16GB", 1)] * 6 + [("L4", 1)] * 8 + [("L4", 2)] * 4
          + [("T4", 1)] * 10 + [("T4", 2)] * 6 + [("T4", 4)] * 4)


def mix42_cluster(geo: bool, seed: int = 0) -> ClusterSpec:
    """MIX_42 in one region (8 Gbit/s links, as helix-single-24) or shuffled over three
    regions of 14 (9-11 Gbit/s inside, 0.08-0.12 Gbit/s and 50 ms between and to the
    coordinator, as helix-geo-24)."""
    rng = random.Random(seed)
    nodes = [NodeSpec(f"n{i}", gpu, n, region=f"region-{i // 14 if geo else 0}", nic_gbps=80.0)
             for i, (gpu, n) in enumerate(MIX_42)]
    if geo:
        rng.shuffle(nodes)
    explicit: dict[tuple[str, str], LinkSpec] = {}
    for a in nodes:
        for pair in (("coordinator", a.name), (a.name, "coordinator")):
            explicit[pair] = LinkSpec(rng.uniform(0.09, 0.12) if geo else 8.0, 50.0)
        for b in nodes:
            if a is not b:
                same = a.region == b.region
                explicit[(a.name, b.name)] = LinkSpec(
                    rng.uniform(9, 11) if same else rng.uniform(0.08, 0.12), 1.0 if same else 50.0)
    name = "mix-42-geo" if geo else "mix-42"
    return ClusterSpec(name, nodes, default_link=LinkSpec(0.0), explicit=explicit, source=name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=60.0, help="milp budget per instance (s)")
    ap.add_argument("--planners", default=",".join(PLANNERS), help="comma-separated")
    ap.add_argument("--models", default="llama-2-70b,llama-30b")
    ap.add_argument("--clusters", default="shared,synthetic-50,synthetic-100",
                    help="'shared' = every examples/clusters/helix-*.yaml; synthetic-N; or paths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes for milp's searches (default: the cores, at most 8)")
    ap.add_argument("--gpu-reserve-gb", type=float, default=None,
                    help="memory per GPU outside weights and KV (default: the cost model's "
                    "1 GiB; 4.5 is what vLLM 0.4.0 kept in Helix's measurements)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    jobs = check_jobs(args.jobs)

    clusters: list[ClusterSpec] = []
    for item in args.clusters.split(","):
        if item == "shared":
            clusters += [load_cluster(p) for p in sorted((SHARED / "clusters").glob("helix-*.yaml"))]
        elif item in ("mix-42", "mix-42-geo"):
            clusters.append(mix42_cluster(item == "mix-42-geo", seed=args.seed))
        elif item.startswith("synthetic-"):
            clusters.append(synthetic_cluster(int(item.split("-")[1]), seed=args.seed))
        else:
            clusters.append(load_cluster(item))
    profiles = load_profiles(SHARED / "profiles" / "helix-measured.csv")
    planners = args.planners.split(",")
    rows = []
    head = (f"{'cluster':<16} {'model':<12} {'planner':<9} {'tokens/s':>10} {'bound':>10} "
            f"{'gap':>6} {'x best base':>11} {'time s':>7}")
    print(head)
    print("-" * len(head))
    for cluster in clusters:
        for model_name in args.models.split(","):
            model = load_model(SHARED / "models" / model_name)
            cost = CostModel(model, profiles, reserved_gb_per_gpu=args.gpu_reserve_gb)
            results = {}
            for name in planners:
                started = time.perf_counter()
                p = plan(name, cluster, model, cost, time_limit_s=args.time_limit, seed=args.seed,
                         jobs=jobs)
                results[name] = (p, time.perf_counter() - started)
            base = max((results[n][0].throughput_tokens_per_s or 0.0 for n in results
                        if n != "milp"), default=0.0)
            for name, (p, wall) in results.items():
                thr = p.throughput_tokens_per_s or 0.0
                bound = p.upper_bound_tokens_per_s
                gap = None if not bound else max(0.0, 1 - thr / bound)
                row = {"cluster": cluster.name, "nodes": len(cluster.nodes), "model": model.name,
                       "planner": name, "throughput_tokens_per_s": thr,
                       "upper_bound_tokens_per_s": bound, "gap": gap,
                       "vs_best_baseline": thr / base if base else None, "solve_time_s": wall,
                       "placement": p.to_dict()["nodes"]}
                rows.append(row)
                print(f"{cluster.name:<16} {model.name:<12} {name:<9} {thr:>10,.1f} "
                      f"{'' if bound is None else f'{bound:,.1f}':>10} "
                      f"{'' if gap is None else f'{gap:.1%}':>6} "
                      f"{row['vs_best_baseline'] or 0:>11.2f} {wall:>7.1f}", flush=True)
    if args.json:
        meta = {"time_limit_s": args.time_limit, "seed": args.seed, "jobs": jobs, "machine": platform.node(),
                "gpu_reserve_gb": args.gpu_reserve_gb,
                "python": platform.python_version(), "processor": platform.processor()}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
