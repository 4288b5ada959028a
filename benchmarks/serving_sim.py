"""Planners x schedulers on the shared clusters (llama-2-70b, Azure conversation trace).

Offline (saturated) decode throughput for every planner x scheduler pair, online latency for
the headline pairs, the Helix targets (milp + maxflow vs separate + shortest-queue and vs
swarm + swarm; `separate` is one pipeline per GPU type, as the Helix authors built it,
simulated as their artifact does: each type's pipeline a cluster of its own, the results
summed (`separate-joint` rows: the same placement in one cluster, where a hop-by-hop router
also moves requests between the types' pipelines); petals + shortest-queue, the strongest
baseline here, is reported beside them), and the simulator's speed on 10 minutes of the trace at the cluster's
capacity. Placements are cached per (cluster, planner, planner source fingerprint), so a
re-run does not re-solve unless the planner or cost model changed.

Engine model (`--engine`): `vllm` (the default) = on-demand KV allocation with recompute
preemption and chunked prefill of `--max-prompt-tokens` (512) tokens an iteration, as vLLM
serves, and at most 64 admitted requests still prefilling (admission waits beyond that);
`reserve` = every request reserves prompt + output KV on its route at admission and
a node prefills whole prompts up to its profile's largest batch (the simulator's defaults,
this benchmark's model before 2026-12-02). Both apply to every planner and scheduler.
The engine also sets the memory each GPU keeps outside weights and KV, for planning and
simulating alike (`--gpu-reserve-gb` overrides): 4.5 GB for `vllm`, fitted to the KV blocks
vLLM 0.4.0 allocated in Helix's measurements (1 GiB, the cost model's default, before
2026-12-03 and for `reserve`).
`milp-serving` is `helixserve.simulator.selection.select_placement` over the milp placement,
the cluster's best stacked tilings and, with two or more regions, its regional pipelines
(picked by a 1200 s offline simulation with the same engine model; the reported numbers
come from the runs here).

    python -m benchmarks.serving_sim --placements-from benchmarks/results/serving_sim_vllm_memory.json \
        --json benchmarks/results/serving_sim_vllm_memory.json

(docs/benchmarks.md, "Simulator": today's numbers and placements.)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import io
import json
import platform
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

from helixserve.costmodel import CostModel
from helixserve.planner import NodeRange, Placement, evaluate, load_placement, plan
from helixserve.simulator.metrics import summarize
from helixserve.simulator.presets import ENGINES, engine_gpu_reserve_gb
from helixserve.simulator.selection import SelectionConfig, select_placement
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import TraceRequest, load_azure_trace, prepare_trace
from helixserve.spec import ClusterSpec, ModelSpec, load_cluster, load_model, load_profiles
from helixserve.spec.cluster import COORDINATOR

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / "examples"  # the data the docs use (examples/README.md)
#: placement file used per cluster/planner, written into the JSON
USED_PLACEMENTS: dict[str, str] = {}
HEADLINE = [("milp", "maxflow"), ("separate", "shortest-queue"), ("swarm", "swarm"),
            ("petals", "shortest-queue")]
#: the issue's targets (>= 1.8x); petals + shortest-queue, the mixed greedy pipeline that
#: `separate` fell back to before it followed the Helix authors' per-type pipelines, is
#: reported beside them as the strongest baseline, not as a target
TARGET_PAIRS = [("separate", "shortest-queue"), ("swarm", "swarm")]


#: --gpu-reserve-gb of this run (None: the cost model's default); part of the cache key
GPU_RESERVE_GB: float | None = None


def planner_fingerprint() -> str:
    """Hash of the planner and cost-model sources (and a non-default GPU reserve): a changed
    planner or cost model invalidates the cache."""
    h = hashlib.sha256()
    for d in ("planner", "costmodel", "spec"):
        for f in sorted((REPO / "helixserve" / d).glob("*.py")):
            h.update(f.read_bytes())
    if GPU_RESERVE_GB is not None:
        h.update(f"reserve={GPU_RESERVE_GB}".encode())
    return h.hexdigest()[:12]


def cached_plan(
    name: str,
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    cache: Path,
    time_limit_s: float,
    replan: bool,
    reuse: dict[str, str] | None = None,
) -> Placement:
    """The cached placement of this planner source (or the file `reuse` names), else plan."""
    named = (reuse or {}).get(f"{cluster.name}/{name}")
    if named is not None and (cache / named).is_file() and not replan:
        USED_PLACEMENTS[f"{cluster.name}/{name}"] = named
        return load_placement(cache / named)
    path = cache / f"{cluster.name}-{model.name}-{name}-{planner_fingerprint()}.json"
    USED_PLACEMENTS[f"{cluster.name}/{name}"] = path.name
    if path.exists() and not replan:
        return load_placement(path)
    print(f"  planning {cluster.name} with {name} ...", file=sys.stderr)
    placement = plan(name, cluster, model, cost, time_limit_s=time_limit_s)
    cache.mkdir(parents=True, exist_ok=True)
    placement.save(path)
    return placement


def kv_balanced_reference(cluster: ClusterSpec, model: ModelSpec) -> Placement | None:
    """A hand-written placement for 4 A100 + 8 L4 + 12 T4 (helix-single-24): every A100 holds
    8 layers in series (KV for ~730 requests each instead of ~340 at 12 layers), then 4 stages
    of 2 L4 x 6 layers and 6 stages of 2 T4 x 4 layers. It has a lower max flow than the
    planners' placements but more KV on every route; see docs/simulator.md."""
    by_gpu: dict[str, list[str]] = {}
    for n in cluster.nodes:
        by_gpu.setdefault(n.gpu, []).append(n.name)
    shape = {"A100-40GB": (1, 8), "L4": (2, 6), "T4": (2, 4)}  # (nodes per stage, layers)
    nodes: list[NodeRange] = []
    layer = 0
    for gpu, (per_stage, k) in shape.items():
        names = by_gpu.get(gpu, [])
        for i in range(0, len(names) - per_stage + 1, per_stage):
            nodes += [NodeRange(n, layer, layer + k) for n in names[i : i + per_stage]]
            layer += k
    if layer != model.num_layers or len(nodes) != len(cluster.nodes):
        return None
    return Placement(model.name, cluster.name, model.num_layers, "kv-balanced-hand", nodes)


def serving_selection(
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    milp: Placement,
    trace: list[TraceRequest],
    engine: dict[str, Any],
    args: argparse.Namespace,
    out: dict[str, Any],
) -> Placement:
    """milp-serving: the milp placement or a stacked tiling, whichever a 1200 s offline
    simulation (same engine model) serves best; cached like the planners' placements."""
    key = f"{cluster.name}/milp-serving"
    reuse: dict[str, str] = {}
    if args.placements_from is not None:
        reuse = json.loads(args.placements_from.read_text()).get("placements", {})
    name = reuse.get(key)
    if name is None:
        tag = hashlib.sha256(
            json.dumps([milp.to_dict()["nodes"], engine, args.seed], sort_keys=True).encode()
        ).hexdigest()[:8]
        name = f"{cluster.name}-{model.name}-milp-serving-{planner_fingerprint()}-{tag}.json"
    path = args.cache / name
    report_path = path.with_suffix(".selection.json")
    USED_PLACEMENTS[key] = name
    if path.is_file() and not args.replan:
        chosen = load_placement(path)
    else:
        print(f"  serving-aware selection on {cluster.name} ...", file=sys.stderr)
        cfg = SelectionConfig.from_engine(engine, seed=args.seed)
        chosen, report = select_placement(cluster, model, cost, [milp], trace, cfg)
        path.parent.mkdir(parents=True, exist_ok=True)
        chosen.save(path)
        report_path.write_text(json.dumps({"config": vars(cfg), "candidates": report}, indent=1))
    if report_path.is_file():
        out.setdefault("serving_selection", {})[cluster.name] = json.loads(report_path.read_text())
    return chosen


def simulate(
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    placement: Placement,
    reqs: list[TraceRequest],
    config: SimConfig,
    profile: bool = False,
) -> tuple[dict[str, Any], str | None]:
    sim = Simulation(cluster, model, cost, placement, reqs, config)
    if not profile:
        return summarize(sim.run()), None
    prof = cProfile.Profile()
    prof.enable()
    result = sim.run()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return summarize(result), buf.getvalue()


def split_by_type(
    cluster: ClusterSpec, model: ModelSpec, cost: CostModel, placement: Placement
) -> list[tuple[ClusterSpec, Placement]]:
    """The placement's machines grouped by type (gpu, num_gpus, memory), each group that
    holds every layer as a cluster and placement of its own (flows filled); [] when fewer
    than two groups do (nothing to separate)."""
    groups: dict[tuple[str, int, float | None], list[NodeRange]] = {}
    for r in placement.nodes:
        nd = cluster.node(r.name)
        groups.setdefault((nd.gpu, nd.num_gpus, nd.memory_gb), []).append(r)
    out = []
    for (gpu, _, _), ranges in groups.items():
        names = {r.name for r in ranges}
        sub = Placement(placement.model, f"{cluster.name}-{gpu}", placement.num_layers,
                        placement.planner, ranges)
        if not sub.covers_all_layers():
            continue
        ends = names | {COORDINATOR}
        sub_cluster = dataclasses.replace(
            cluster, name=sub.cluster, nodes=[n for n in cluster.nodes if n.name in names],
            explicit={k: v for k, v in cluster.explicit.items() if k[0] in ends and k[1] in ends},
        )
        res = evaluate(sub_cluster, model, cost, sub)
        sub.flows, sub.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s
        out.append((sub_cluster, sub))
    return out if len(out) >= 2 else []


def share_requests(
    reqs: list[TraceRequest], parts: list[tuple[ClusterSpec, Placement]], mode: str
) -> list[list[TraceRequest]]:
    """Offline, every part draws from the whole trace (each is kept saturated); online, the
    arrivals are dealt to the parts in proportion to their max flow (interleaved weighted
    round robin), as the Helix artifact gives each sub-cluster its share of the load."""
    if mode == "offline":
        return [reqs for _ in parts]
    weights = [p.throughput_tokens_per_s or 0.0 for _, p in parts]
    total = sum(weights) or 1.0
    dealt: list[list[TraceRequest]] = [[] for _ in parts]
    credit = [0.0] * len(parts)
    for q in reqs:
        credit = [c + w / total for c, w in zip(credit, weights, strict=True)]
        k = max(range(len(parts)), key=lambda i: credit[i])
        credit[k] -= 1.0
        dealt[k].append(q)
    return dealt


def combine(parts: list[dict[str, Any]], cluster: str, planner: str) -> dict[str, Any]:
    """One row for simulations run side by side: throughputs and counts summed; latency
    percentiles cannot be merged from summaries, so each part's are kept under `parts`."""
    summed = ("decode_throughput_tokens_per_s", "prompt_throughput_tokens_per_s",
              "max_flow_tokens_per_s", "requests_finished", "requests_waiting", "events",
              "wall_s", "preemptions")  # fmt: skip
    out: dict[str, Any] = {k: sum(p[k] or 0 for p in parts) for k in summed}
    out |= {"cluster": cluster, "planner": planner, "scheduler": parts[0]["scheduler"],
            "mode": parts[0]["mode"], "ttft_s": None, "tpot_s": None, "e2e_s": None,
            "events_per_s": out["events"] / out["wall_s"] if out["wall_s"] else 0.0,
            "mean_node_utilization": statistics.fmean(p["mean_node_utilization"] for p in parts),
            "parts": parts, "note": "each machine type's pipeline simulated as its own cluster"}
    return out


def row(summary: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "cluster", "planner", "scheduler", "mode", "decode_throughput_tokens_per_s",
        "prompt_throughput_tokens_per_s", "max_flow_tokens_per_s", "requests_finished",
        "requests_waiting", "ttft_s", "tpot_s", "e2e_s", "events", "wall_s", "events_per_s",
        "preemptions",
    )  # fmt: skip
    out = {k: summary[k] for k in keep}
    out["mean_node_utilization"] = sum(n["utilization"] for n in summary["nodes"]) / len(
        summary["nodes"]
    )
    return out


def print_table(rows: list[dict[str, Any]], header: bool = True) -> None:
    head = (
        f"{'cluster':<16} {'planner':<16} {'scheduler':<14} {'mode':<7} {'decode tok/s':>12} "
        f"{'max flow':>9} {'util':>5} {'TTFT p50':>9} {'TPOT p50':>9} {'E2E p90':>8} "
        f"{'wall s':>7}"
    )
    if header:
        print(head)
        print("-" * len(head))
    for r in rows:
        lat = (
            f"{r['ttft_s']['p50']:>9.2f} {r['tpot_s']['p50']:>9.3f} {r['e2e_s']['p90']:>8.1f}"
            if r["ttft_s"] is not None else f"{'per part':>9} {'in JSON':>9} {'':>8}"
        )
        print(
            f"{r['cluster']:<16} {r['planner']:<16} {r['scheduler']:<14} {r['mode']:<7} "
            f"{r['decode_throughput_tokens_per_s']:>12.1f} {r['max_flow_tokens_per_s'] or 0:>9.0f} "
            f"{r['mean_node_utilization']:>5.0%} {lat} {r['wall_s']:>7.1f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clusters", nargs="+", default=["helix-single-24", "helix-geo-24"])
    ap.add_argument("--model", default="llama-2-70b")
    ap.add_argument("--planners", nargs="+", default=["milp", "separate", "swarm", "petals"])
    ap.add_argument(
        "--schedulers", nargs="+", default=["maxflow", "shortest-queue", "swarm", "random"]
    )
    ap.add_argument(
        "--full-matrix-clusters",
        nargs="*",
        default=["helix-single-24"],
        help="clusters that get every planner x scheduler offline; others only the headline pairs",
    )
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--warmup", type=float, default=60.0)
    ap.add_argument(
        "--online-rate",
        type=float,
        default=1.0,
        help="requests/s of the online runs (the trace rescaled)",
    )
    ap.add_argument("--plan-time-limit", type=float, default=60.0)
    ap.add_argument(
        "--cache", type=Path, default=REPO / "benchmarks" / "results" / "serving_sim_placements"
    )
    ap.add_argument("--replan", action="store_true")
    ap.add_argument(
        "--placements-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="reuse the cached placements an earlier run's JSON names (its 'placements')",
    )
    ap.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    ap.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="prompt tokens one node iteration may prefill (default: 512 with --engine vllm, "
        "the profile's largest with reserve)",
    )
    ap.add_argument(
        "--no-serving-selection",
        action="store_true",
        help="skip the milp-serving placement (serving-aware selection)",
    )
    ap.add_argument(
        "--gpu-reserve-gb",
        type=float,
        default=None,
        help="memory per GPU outside weights and KV, for planning and simulating (default: "
        "the engine's: 4.5 for vllm, fitted to the KV vLLM 0.4.0 allocated in Helix's "
        "measurements; 1 GiB for reserve)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    args = ap.parse_args()

    global GPU_RESERVE_GB
    GPU_RESERVE_GB = engine_gpu_reserve_gb(args.engine, args.gpu_reserve_gb)
    model = load_model(SHARED / "models" / args.model)
    cost = CostModel(model, load_profiles(SHARED / "profiles" / "helix-measured.csv"),
                     reserved_gb_per_gpu=GPU_RESERVE_GB)
    trace = prepare_trace(load_azure_trace(SHARED / "traces" / "azure-llm-conv-2023.csv"))
    online = prepare_trace(trace, lengths=None, rate_per_s=args.online_rate)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}",
        "command": " ".join(["python", *sys.argv]),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "online_rate_per_s": args.online_rate,
        "trace_requests": len(trace),
        "planner_fingerprint": planner_fingerprint(),
        "gpu_reserve_gb": cost.reserved_bytes_per_gpu / 1e9,
        "runs": rows,
    }
    reuse: dict[str, str] = {}
    if args.placements_from is not None:
        reuse = json.loads(args.placements_from.read_text()).get("placements", {})
    engine = dict(ENGINES[args.engine])
    if args.max_prompt_tokens is not None:
        engine["max_prompt_tokens"] = args.max_prompt_tokens
    out["engine"] = args.engine
    out["engine_config"] = engine
    out["max_prompt_tokens"] = engine["max_prompt_tokens"]
    planned: dict[str, dict[str, Placement]] = {}
    for cname in args.clusters:
        cluster = load_cluster(SHARED / "clusters" / f"{cname}.yaml")
        placements = planned[cname] = {
            p: cached_plan(
                p, cluster, model, cost, args.cache, args.plan_time_limit, args.replan, reuse
            )
            for p in args.planners
        }
        # the reference is written for the single-region cluster's mix of machines
        ref = kv_balanced_reference(cluster, model) if cname in args.full_matrix_clusters else None
        if ref is not None:
            res = evaluate(cluster, model, cost, ref)
            ref.flows, ref.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s
            placements["kv-balanced-hand"] = ref
        if "milp" in placements and not args.no_serving_selection:
            placements["milp-serving"] = serving_selection(
                cluster, model, cost, placements["milp"], trace, engine, args, out
            )
        # The Helix authors' own placement (their Gurobi MILP), converted by the planner work.
        authors = REPO / "benchmarks" / "helix-placements" / f"{cname}-{model.name}.json"
        if authors.exists():
            helix = load_placement(authors)
            res = evaluate(cluster, model, cost, helix)
            helix.flows, helix.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s
            placements["helix-authors"] = helix
        if cname in args.full_matrix_clusters:
            pairs = [(p, s) for p in placements for s in args.schedulers]
        else:
            pairs = [pair for pair in HEADLINE if pair[0] in placements]
            pairs += [(p, "maxflow") for p in ("helix-authors", "milp-serving") if p in placements]
        # separate's per-type pipelines, each a cluster of its own (see below)
        separate_parts = (
            split_by_type(cluster, model, cost, placements["separate"])
            if "separate" in placements else []
        )
        for mode in ("offline", "online"):
            online_pairs = [*HEADLINE, ("milp-serving", "maxflow"), ("kv-balanced-hand", "maxflow")]
            for p, s in pairs if mode == "offline" else online_pairs:
                if p not in placements:
                    continue
                cfg = SimConfig(
                    duration_s=args.duration,
                    offline=mode == "offline",
                    warmup_s=args.warmup,
                    scheduler=s,
                    seed=args.seed,
                    **engine,
                )
                reqs = trace if mode == "offline" else online
                parts = separate_parts if p == "separate" else []
                if parts:
                    # Separate Pipelines as the Helix artifact simulates them: each machine
                    # type's pipeline a cluster of its own, the results summed; in the shared
                    # cluster a hop-by-hop router also moves requests between the types'
                    # pipelines (kept as `separate-joint`, for reference)
                    sums = [row(simulate(sub_c, model, cost, sub_p, part_reqs, cfg)[0])
                            for (sub_c, sub_p), part_reqs
                            in zip(parts, share_requests(reqs, parts, mode), strict=True)]
                    rows.append(combine(sums, cluster.name, p))
                    print_table(rows[-1:], header=len(rows) == 1)
                    p_joint = "separate-joint"
                else:
                    p_joint = p
                if p_joint == p or s == "shortest-queue":
                    summary, _ = simulate(cluster, model, cost, placements[p], reqs, cfg)
                    rows.append(row(summary) | {"planner": p_joint})
                    print_table(rows[-1:], header=len(rows) == 1)
                sys.stdout.flush()
    print()
    print_table(rows)

    def offline(cname: str, p: str, s: str) -> float | None:
        for r in rows:
            if (r["cluster"], r["planner"], r["scheduler"], r["mode"]) == (cname, p, s, "offline"):
                return float(r["decode_throughput_tokens_per_s"])
        return None

    targets = {}
    for cname in args.clusters:
        for ours in ("milp", "milp-serving"):
            milp_x = offline(cname, ours, "maxflow")
            for p, s in HEADLINE[1:]:
                base = offline(cname, p, s)
                if milp_x and base:
                    targets[f"{cname}: {ours}+maxflow / {p}+{s}"] = milp_x / base
    out["targets"] = targets
    out["placements"] = USED_PLACEMENTS
    print()
    for k, v in targets.items():
        goal = "target >= 1.8x on helix-single-24" if any(
            f"/ {p}+{s}" in k for p, s in TARGET_PAIRS) else "reference, no target"
        print(f"{k}: {v:.2f}x ({goal})")

    if not args.skip_speed:
        # 10 simulated minutes of the trace arriving at the cluster's offline capacity.
        cname = args.clusters[0]
        cluster = load_cluster(SHARED / "clusters" / f"{cname}.yaml")
        capacity = offline(cname, "milp", "maxflow")
        if capacity:
            mean_output = sum(r.output_tokens for r in trace) / len(trace)
            rate = capacity / mean_output
            reqs = prepare_trace(trace, lengths=None, rate_per_s=rate)
            cfg = SimConfig(duration_s=600.0, scheduler="maxflow", seed=args.seed, **engine)
            placement = planned[cname]["milp"]  # the one measured above
            summary, _ = simulate(cluster, model, cost, placement, reqs, cfg)
            _, profile = simulate(
                cluster,
                model,
                cost,
                placement,
                reqs,
                SimConfig(duration_s=120.0, scheduler="maxflow", **engine),
                profile=True,
            )
            out["speed"] = {
                "cluster": cname,
                "rate_per_s": rate,
                "simulated_s": 600.0,
                "wall_s": summary["wall_s"],
                "events": summary["events"],
                "events_per_s": summary["events_per_s"],
                "decode_throughput_tokens_per_s": summary["decode_throughput_tokens_per_s"],
                "profile_top": profile,
            }
            print(
                f"\nspeed: 600 simulated s of the trace at {rate:.2f} req/s on {cname}: "
                f"{summary['wall_s']:.1f} s wall, {summary['events']} events "
                f"({summary['events_per_s']:.0f} events/s)"
            )
            print(profile)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
