"""The rig's benchmark: every (cluster, workload, placement) measured and simulated.

Per cluster: write cluster.yaml + gpus.csv, profile its speed classes, plan each placement
(milp and the baselines, with the same cost model), then per placement start the stack once
and run each workload's burst on it, and simulate the same burst on the same placement.

`milp` is what `helixserve plan --objective flow --serve-trace BURST --serve-mode replay` gives for the
workload: the max-flow MILP's placement, stacked tilings and the baselines' placements each
serve the burst in the simulator and the fastest is kept (simulator/selection.py), so its
placement can differ per workload (then each gets a stack of its own). `milp-flow` (not in
the default set) is the max-flow MILP's placement alone, planned for a saturated cluster.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.rig.clusters import CLUSTERS, RigCluster
from benchmarks.rig.measure import (
    SIM_ENGINES,
    Workload,
    cluster_profiles,
    conversation,
    measure,
    median_metrics,
    prefill_heavy,
    probe_ms,
    runtime_engine,
    scaled_profiles,
    simulate,
)
from benchmarks.rig.speed import SpeedControl
from benchmarks.rig.stack import Endpoints, RigStack, write_cluster_files

PLACEMENTS = ("milp", "swarm", "separate", "petals")
#: every placement --placements accepts
ALL_PLACEMENTS = (*PLACEMENTS, "milp-flow")
#: the runtime's dtype on CPU: the planner and simulator count fp32 bytes like the workers
DTYPE_BYTES = 4


@dataclass
class RigOptions:
    workdir: Path
    clusters: tuple[str, ...] = tuple(CLUSTERS)
    placements: tuple[str, ...] = PLACEMENTS
    workloads: tuple[Workload, ...] = ()
    speed: str = "slowdown"
    plan_time_limit_s: float = 20.0
    #: bursts per (placement, workload) on one stack; the row reports their median
    repeats: int = 1
    #: the planners' work budget (plan --work-limit): the same placements on a busy host
    plan_work_limit: float | None = 40.0
    profile_repeats: int = 3
    reprofile: bool = False
    request_timeout_s: float = 300.0
    #: every process the rig starts stops by itself after this long
    max_seconds: float = 3600.0
    log: Callable[[str], None] = print
    sim_engines: tuple[str, ...] = SIM_ENGINES
    #: mutual TLS between coordinator and workers (the runtime's default for local stacks)
    tls: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def quick_workloads(num: int | None = None) -> tuple[Workload, ...]:
    """Small bursts: the whole --quick run (24 rows) fits 15 minutes on a quiet 2-core host.
    The prefill-heavy prompts are half the issue's ~2000 tokens, with outputs cut alike.
    `num`: requests per burst instead of 6 and 3."""
    return (conversation(num or 6, 256, 24), prefill_heavy(num or 3, 1000, 16))


def full_workloads(num: int | None = None) -> tuple[Workload, ...]:
    return (conversation(num or 16, 512, 64), prefill_heavy(num or 8, 2000, 30))


def kv_cache_bytes(cluster_spec: Any, model: Any, cost: Any, placement: Any) -> dict[str, int]:
    """Each worker's KV budget: the KV the cost model gives the node for its layers, in the
    worker's bytes, so the runtime admits what the simulator admits."""
    out = {}
    for r in placement.nodes:
        node = cluster_spec.node(r.name)
        tokens = cost.kv_capacity_tokens(node, r.num_layers)
        out[r.name] = max(1, tokens) * r.num_layers * model.kv_bytes_per_token_per_layer
    return out


def run_cluster(name: str, opts: RigOptions, speed: SpeedControl) -> list[dict[str, Any]]:
    from helixserve.costmodel import CostModel
    from helixserve.engine import prepare_demo_model
    from helixserve.spec import load_cluster, load_model, load_profiles
    from helixserve.spec.gpus import load_gpu_catalog

    cluster: RigCluster = CLUSTERS[name]
    work = opts.workdir / name
    model_dir = prepare_demo_model()
    ends = Endpoints.allocate(cluster)
    cluster_path, gpus_path = write_cluster_files(cluster, work, ends)
    opts.log(f"{name}: {cluster.description}")
    probe_at_profile = probe_ms(model_dir)
    profiles_path = cluster_profiles(cluster, model_dir, opts.workdir / "profiles", speed,
                                     opts.profile_repeats, opts.reprofile, opts.log)
    catalog = load_gpu_catalog(gpus_path)
    spec = load_cluster(cluster_path, catalog=catalog)
    model = load_model(model_dir, dtype_bytes=DTYPE_BYTES)
    cost = CostModel(model, load_profiles(profiles_path), catalog)
    rows = []
    for pname, placement, workloads, selection in _placements(spec, model, cost, opts):
        tag = pname if len(workloads) == len(opts.workloads) else f"{pname}-{workloads[0].name}"
        placement_path = work / f"placement-{tag}.json"
        placement.save(placement_path)
        layout = ", ".join(f"{r.name}[{r.start_layer},{r.end_layer})" for r in placement.nodes)
        opts.log(f"  {tag}: {layout}; max flow {placement.throughput_tokens_per_s:.1f} tok/s")
        stack = RigStack(cluster, cluster_path, gpus_path, placement_path, model_dir, ends,
                         kv_cache_bytes(spec, model, cost, placement), speed,
                         work / f"logs-{tag}", opts.max_seconds, tls=opts.tls,
                         profiles_path=profiles_path, dtype_bytes=DTYPE_BYTES)
        probe = probe_ms(model_dir)
        host_ratio = probe / probe_at_profile if probe == probe and probe_at_profile else 1.0
        cost_now = CostModel(model, load_profiles(scaled_profiles(
            profiles_path, host_ratio, work / f"profiles-now-{tag}.csv")), catalog)
        t0 = time.monotonic()
        with stack:
            opts.log(f"    stack up in {time.monotonic() - t0:.1f} s")
            for wl in workloads:
                t1 = time.monotonic()
                load_before = os.getloadavg()[0]
                # the same burst `repeats` times on this stack: one burst of a few requests
                # varies by +-25% from run to run on this host, so the row holds the median
                runs = [measure(stack.api_url, model_dir.name, wl, opts.request_timeout_s)
                        for _ in range(opts.repeats)]
                measured = median_metrics([m for m, _, _ in runs])
                times = runs[0][1]
                errors = [e for _, _, errs in runs for e in errs]
                load_after = os.getloadavg()[0]
                lengths = [(t.prompt_tokens, t.output_tokens) for t in times] or list(wl.requests)
                simulated = {eng: simulate(spec, model, cost, placement, lengths, eng)
                             for eng in opts.sim_engines}
                # the same, with the profile re-timed by the host-load probe: how much of
                # the error is other load on the shared host
                sim_now = simulate(spec, model, cost_now, placement, lengths, opts.sim_engines[0])
                row = {
                    "cluster": name, "workload": wl.name, "placement": pname,
                    "requests": len(wl.requests),
                    "max_flow_tokens_per_s": placement.throughput_tokens_per_s,
                    "layers": {r.name: [r.start_layer, r.end_layer] for r in placement.nodes},
                    "simulated": simulated[opts.sim_engines[0]],
                    "simulated_by_engine": simulated,
                    "simulated_host_scaled": sim_now,
                    "measured": measured,
                    # every repeat's metrics ("measured" is their per-key median)
                    "measured_runs": [m for m, _, _ in runs],
                    "errors": errors[:5], "failed": len(errors),
                    # (prompt, output) tokens of each request as served: the simulated burst
                    "lengths": lengths,
                    # milp: every candidate's simulated score on this burst, and the kept one
                    "selection": selection.get(wl.name),
                    "wall_s": round(time.monotonic() - t1, 1),
                    # other load on the shared host: 1-minute load average around the
                    # burst, and the probe's step time before the stack vs at profiling
                    "host": {"loadavg_before": load_before, "loadavg_after": load_after,
                             "probe_ratio": round(host_ratio, 3)},
                }
                rows.append(row)
                opts.log(f"    {wl.name}: measured {measured['decode_tokens_per_s']:.1f} tok/s, "
                         f"simulated {row['simulated']['decode_tokens_per_s']:.1f} tok/s "
                         f"({row['wall_s']} s{f', {len(errors)} failed' if errors else ''})")
        rows[-1]["proxy_links"] = stack.proxy_stats
    return rows


def _placements(spec: Any, model: Any, cost: Any, opts: RigOptions
                ) -> list[tuple[str, Any, tuple[Workload, ...], dict[str, Any]]]:
    """(name, placement, the workloads served on it, milp's selection report per workload).
    A baseline serves every workload on one placement; milp plans per workload and serves
    workloads whose plans coincide on one stack."""
    from helixserve.planner import plan
    from helixserve.simulator.selection import SelectionConfig, select_placement
    from helixserve.simulator.workload import TraceRequest

    out: list[tuple[str, Any, tuple[Workload, ...], dict[str, Any]]] = []
    for pname in opts.placements:
        planner = "milp" if pname == "milp-flow" else pname
        planned = plan(planner, spec, model, cost, time_limit_s=opts.plan_time_limit_s,
                       jobs=1, work_limit=opts.plan_work_limit)
        if pname != "milp":
            out.append((pname, planned, opts.workloads, {}))
            continue
        chosen: dict[tuple[tuple[str, int, int], ...], tuple[Any, list[Workload]]] = {}
        reports: dict[str, Any] = {}
        for wl in opts.workloads:
            burst = [TraceRequest(f"r{i}", 0.0, p, o) for i, (p, o) in enumerate(wl.requests)]
            config = SelectionConfig.from_engine(runtime_engine(), mode="replay",
                                                 duration_s=7200.0)
            best, report = select_placement(spec, model, cost, [planned], burst, config,
                                            name="milp", jobs=1)
            reports[wl.name] = report
            key = tuple((r.name, r.start_layer, r.end_layer) for r in best.nodes)
            chosen.setdefault(key, (best, []))[1].append(wl)
            kept = next(r for r in report if r["chosen"])
            opts.log(f"  milp for {wl.name}: kept {kept['source']} ({kept['stages']}), "
                     f"simulated {kept['simulated_tokens_per_s']:.2f} tok/s")
        for best, wls in chosen.values():
            out.append(("milp", best, tuple(wls), reports))
    return out


def run_rig(opts: RigOptions) -> dict[str, Any]:
    speed = SpeedControl(opts.speed, tag=str(int(time.time())))
    results: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for name in opts.clusters:
            results += run_cluster(name, opts, speed)
    finally:
        left = speed.close()
        if left:
            opts.log(f"rig: could not remove cgroups {left}")
    return {
        "format": "helixserve.rig/v1",
        "speed": opts.speed,
        "tls": opts.tls,
        "sim_engine": opts.sim_engines[0],
        "wall_s": round(time.monotonic() - t0, 1),
        "results": results,
    }


def save(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
