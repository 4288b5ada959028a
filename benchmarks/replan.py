"""Re-planning after a cluster changes: `plan --from` against a full re-plan.

For each cluster (examples/clusters/helix-*.yaml by default) and llama-2-70b:
  1. plan it (milp, --time-limit): the placement the cluster "runs";
  2. change the cluster, one scenario at a time:
       lose-<node>   the machine is gone (with its links);
       add-<node>    a new machine, a copy of <node> (same GPU, region and links);
  3. `replan` from the placement of step 1 (helixserve.planner.incremental, as
     `plan --from`): the incremental placement and the full re-plan, each with its
     throughput and the machines whose range changes.
Prints a table and writes JSON (--json).

    python -m benchmarks.replan --time-limit 60 --json benchmarks/results/replan.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import replace
from pathlib import Path

from helixserve.costmodel import CostModel
from helixserve.planner import plan
from helixserve.planner.incremental import changes, replan
from helixserve.planner.parallel import check_jobs
from helixserve.spec import ClusterSpec, NodeSpec, load_cluster, load_model, load_profiles

SHARED = Path(__file__).resolve().parents[1] / "examples"  # examples/README.md


def lose(cluster: ClusterSpec, name: str) -> ClusterSpec:
    return replace(cluster, name=f"{cluster.name}-lose-{name}",
                   nodes=[n for n in cluster.nodes if n.name != name],
                   explicit={k: v for k, v in cluster.explicit.items() if name not in k})


def add_copy(cluster: ClusterSpec, of: str, name: str) -> ClusterSpec:
    """A new machine `name` like `of`: same GPU, region, NIC, and the same links."""
    src = cluster.node(of)
    links = dict(cluster.explicit)
    for (a, b), link in cluster.explicit.items():
        if a == of:
            links[(name, b)] = link
        if b == of:
            links[(a, name)] = link
    if (of, name) not in links and (name, of) not in links:
        # the pair itself: as between `of` and its best-linked peer of the same region
        peers = [v for (a, b), v in cluster.explicit.items()
                 if a == of and b != "coordinator"
                 and cluster.node(b).region == src.region]
        if peers:
            best = max(peers, key=lambda v: v.bandwidth_gbps)
            links[(of, name)] = links[(name, of)] = best
    return replace(cluster, name=f"{cluster.name}-add-{name}",
                   nodes=[*cluster.nodes, NodeSpec(name, src.gpu, src.num_gpus, src.region,
                                                   src.nic_gbps, None, src.memory_gb)],
                   explicit=links)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="per plan (s)")
    ap.add_argument("--clusters", default="helix-single-24,helix-geo-24")
    ap.add_argument("--scenarios", default="lose-n7,lose-n0,add-n4",
                    help="lose-<node> or add-<node> (a copy of <node>), comma-separated")
    ap.add_argument("--max-loss", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    jobs = check_jobs(args.jobs)
    model = load_model(SHARED / "models" / "llama-2-70b")
    cost = CostModel(model, load_profiles(SHARED / "profiles" / "helix-measured.csv"))
    rows = []
    header = (f"{'cluster':<16} {'scenario':<9} {'running':>9} {'incremental':>11} {'moves':>5} "
              f"{'full':>9} {'moves':>5} {'kept':<11}")
    print(header)
    print("-" * len(header))
    for cname in args.clusters.split(","):
        cluster = load_cluster(SHARED / "clusters" / f"{cname}.yaml")
        running = plan("milp", cluster, model, cost, time_limit_s=args.time_limit,
                       seed=args.seed, jobs=jobs)
        for scenario in args.scenarios.split(","):
            kind, node = scenario.split("-", 1)
            changed = (lose(cluster, node) if kind == "lose"
                       else add_copy(cluster, node, f"n{len(cluster.nodes)}"))
            t0 = time.perf_counter()
            out = replan(changed, model, cost, running, "milp", args.time_limit, args.seed,
                         None, True, jobs, args.max_loss)
            wall = time.perf_counter() - t0
            inc_moves = changes(running, out.incremental_placement).moves
            full_moves = changes(running, out.full).moves
            row = {
                "cluster": cname, "scenario": scenario,
                "running_tokens_per_s": running.throughput_tokens_per_s,
                "incremental_tokens_per_s": out.incremental.throughput_tokens_per_s,
                "incremental_moves": inc_moves,
                "full_tokens_per_s": out.full.throughput_tokens_per_s,
                "full_moves": full_moves,
                "kept": "incremental" if out.kept_incremental else "full",
                "wall_s": wall,
            }
            rows.append(row)
            print(f"{cname:<16} {scenario:<9} {row['running_tokens_per_s']:>9,.1f} "
                  f"{row['incremental_tokens_per_s']:>11,.1f} {inc_moves:>5} "
                  f"{row['full_tokens_per_s']:>9,.1f} {full_moves:>5} {row['kept']:<11}",
                  flush=True)
    if args.json:
        meta = {"time_limit_s": args.time_limit, "max_loss": args.max_loss, "seed": args.seed,
                "jobs": jobs, "machine": platform.node(), "when": time.strftime("%F %T %Z")}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
