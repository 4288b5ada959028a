"""Score a helixserve placement in the Helix authors' own simulator, offline, as they run it.

The Helix ASPLOS'25 artifact (GitHub `Thesys-lab/Helix-ASPLOS25`, Apache-2.0) simulates
each placement with `artifact_evaluation/<setting>/step3_simulation.py`: for Helix's own
placement `simulate_maxflow_offline` loads the cluster `.ini`, the placement
(`ilp_sol.ini`: `compute_node_<i + 2> = [layers]`) and a "simulator cluster" file (the nodes
in use with their KV capacity, and the links a request may take), runs Helix's MaxFlow
scheduler (KV expectation 85%, expected output ratio 1) under its offline feeder (20
requests, then more while the busiest layer is at most 80% promised) for 60 s of warmup and
600 s counted, and returns the decode tokens/s of those 600 s. Its requests are its own
(Azure conversation lengths shipped in the artifact), its per-GPU costs and KV blocks its
own (vLLM 0.4.0 measurements); nothing of helixserve's cost model enters.

This module does the reverse of `benchmarks/helix_artifact.py` for a placement: it writes
our placement JSON as their `ilp_sol.ini` (node `n<i>` is `ComputeNode-i`, i.e.
`compute_node_<i + 2>`; a node without layers gets `[]`, which their loader skips), builds
the simulator cluster file with their own `ILPLayout.generate_simulator_cluster` (the links
whose ends' layer ranges chain; with partial inference, as our planner plans, a hop may
enter a node inside its range), and calls their `simulate_maxflow_offline` unchanged, in a
subprocess whose working directory holds their `config/machine_profiles.ini` (the path
their function reads). Nothing is downloaded: the artifact is a local checkout.

Getting it (outside a test run; their repository has a few large files that a partial
copy may lack, none of them needed here):

    git clone https://github.com/Thesys-lab/Helix-ASPLOS25 /path/to/Helix-ASPLOS25
    pip install gurobipy networkx matplotlib numpy

Their simulator needs no solver: `gurobipy` is imported at module level by the layout
synthesizer (`ilp_layout.py`) that the simulation imports, and the pip wheel imports
without a licence; no Gurobi model is built. Their `requirements.txt` pins networkx 3.2
and matplotlib 3.8; newer versions ran here (networkx 3.6, matplotlib 3.11, numpy 2.4).

    python -m benchmarks.helix_sim score --helix-artifact PATH --cluster helix-single-24 \\
        --placement benchmarks/helix-placements/helix-single-24-llama-2-70b.json

`score --window WARMUP DURATION` runs the same steps in another window than the authors'
60 s + 600 s (`_simulate_offline`). `flow` instead of `score` stops before simulating and prints what their scheduler plans
with: the value of its max flow over their node and link capacities, and the least KV a
layer has over its holders (seconds, little memory). Both take `--python PY`, an
interpreter with their requirements, to keep gurobipy out of this one's environment.

`proxy` stands in for `score` in seconds instead of 20 minutes and ~30 GiB (helix-mix-42):
their scheduler's max flow for the placement (`flow`), then OUR simulator with Helix's
rules (helix-prototype's engine without a per-layer cost, Helix's router: IWRR over the
flow as given, edges under 5% masked, no spill) routing by THEIR flow, once per
`--hash-seeds` seed, averaged. What it gets right and wrong, against `score` on 13
placements of the three clusters: docs/benchmarks.md, "A stand-in for Helix's simulator".

Every run sets their subprocess's PYTHONHASHSEED (`score` and `flow --hash-seed SEED`,
default 0):
their flow graph is built by iterating sets, so how the max flow splits over the links
(not its value), which nodes their router idles and what their simulator serves depend
on it (the authors' helix-geo-24 placement: 109.77 and 100.18 decode tokens/s with seeds 1
and 2); unset, each run drew its own.

A node holding more layers than Helix's model of its GPU holds (their per-GPU cap, e.g. 4
layers on a T4) cannot be scored: their KV table has no entry there (their Separate
Pipelines baseline used hand-written files for that), and `score` says so.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from helixserve.errors import UserError
from helixserve.planner import Placement, load_placement

REPO = Path(__file__).resolve().parents[1]
#: our cluster name -> the artifact's folder whose step3 simulates it, and its cluster file
CLUSTERS = {
    "helix-single-24": ("artifact_evaluation/single_cluster", "config/cluster24.ini"),
    "helix-geo-24": ("artifact_evaluation/distributed_clusters", "config/3cluster24.ini"),
    "helix-mix-42": ("artifact_evaluation/high_heterogeneity", "config/cluster42.ini"),
}
#: the authors' own placement files for each cluster, LLaMA-2-70B (relative to the folder)
AUTHORS_FILES = {
    "helix-single-24": ("layout_llama70b/ilp/ilp_sol.ini", "layout_llama70b/ilp/simulator_cluster.ini"),
    "helix-geo-24": ("layout_llama70b/ilp/ilp_sol.ini", "layout_llama70b/ilp/simulator_cluster.ini"),
    "helix-mix-42": ("layout_llama70b/ilp/ilp_sol.ini", "layout_llama70b/ilp/simulator_cluster.ini"),
}
#: our cluster file and the authors' placement file for each cluster (for `proxy`)
CLUSTER_FILES = {
    "helix-single-24": "examples/clusters/helix-single-24.yaml",
    "helix-geo-24": "examples/clusters/helix-geo-24.yaml",
    "helix-mix-42": "benchmarks/helix-clusters/helix-mix-42.yaml",
}
AUTHORS_PLACEMENTS = {c: f"benchmarks/helix-placements/{c}-llama-2-70b.json" for c in CLUSTERS}
#: `proxy`'s simulator: our engine with Helix's simulator's rules (whole prompts, its
#: admission and feeder, no per-layer cost beyond the profiles) and Helix's router (IWRR
#: over the flow as given, edges under 5% masked, no spill), as in docs/benchmarks.md,
#: "Helix's simulator in its authors' window" and "Helix's router"
PROXY_FLAGS = ["--engine", "helix-prototype", "--layer-overhead-ms", "0", "--helix-router",
               "--model", "examples/models/llama-2-70b",
               "--profiles", "examples/profiles/helix-measured.csv",
               "--trace", "examples/traces/azure-llm-conv-2023.csv", "--offline"]
#: our model name -> Helix's `ModelName` member
MODELS = {"llama-2-70b": "LLaMa70B"}
#: Helix's node index offset (0 and 1 are its source and sink)
NODE_OFFSET = 2
#: what Helix's simulator counts: 60 s warmup, 600 s measured (step3_simulation.py)
WINDOW = {"warmup_s": 60.0, "duration_s": 600.0}
#: Helix's simulator's decode tokens/s for Helix's placement of helix-single-24 (the value
#: the artifact's run gives; benchmarks/calibration.py)
PUBLISHED_SINGLE24 = 252.1


def missing_artifact(path: Path | None) -> str | None:
    """Why `path` is not a usable checkout of the artifact (None: it is)."""
    if path is None:
        return "no --helix-artifact given"
    need = [path / "simulator" / "event_simulator" / "cluster_simulator.py"]
    need += [path / folder / "step3_simulation.py" for folder, _ in CLUSTERS.values()]
    need += [path / folder / ini for folder, ini in CLUSTERS.values()]
    absent = [str(p.relative_to(path)) for p in need if not p.exists()]
    if absent:
        return f"{path}: not a checkout of Thesys-lab/Helix-ASPLOS25 (missing {', '.join(absent)})"
    return None


def _cluster_types(ini: Path) -> list[str]:
    """Machine type of each ComputeNode-i of a Helix cluster file, by index."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ini)
    count = int(cfg["NodeNames"]["total_compute_nodes"])
    return [cfg[f"ComputeNode-{i}"]["type"].strip().strip("'\"") for i in range(count)]


def solution_ini(placement: Placement, num_nodes: int, where: str) -> str:
    """Our placement as Helix's `ilp_sol.ini` (every node listed; unused ones empty)."""
    held: dict[int, list[int]] = {}
    for node in placement.nodes:
        if not (node.name.startswith("n") and node.name[1:].isdigit()):
            raise UserError(f"{where}: node {node.name!r} is not n<i> (a node of a cluster "
                            "converted from Helix's artifact)")
        index = int(node.name[1:])
        if index >= num_nodes:
            raise UserError(f"{where}: node {node.name} is not in the Helix cluster "
                            f"({num_nodes} nodes)")
        held[index] = list(range(node.start_layer, node.end_layer))
    lines = ["[Settings]", f"offset={NODE_OFFSET}", "", "[Solution]"]
    lines += [f"compute_node_{i + NODE_OFFSET}={held.get(i, [])}" for i in range(num_nodes)]
    return "\n".join(lines) + "\n"


def score(artifact: Path, cluster: str, placement: Placement | None, *,
          python: str = sys.executable, partial_inference: bool = True,
          window: tuple[float, float] | None = None, timeout_s: float = 7200.0,
          keep: Path | None = None, flow_only: bool = False,
          hash_seed: int = 0) -> dict[str, Any]:
    """Helix's simulator's decode tokens/s for `placement` on `cluster` (None: the authors'
    own placement with their own simulator cluster file, exactly as published). `window`
    (warmup s, counted s): None or WINDOW runs their `simulate_maxflow_offline` itself; any
    other, `_simulate_offline`, the same steps with that window.

    `flow_only`: no simulation; what their scheduler plans with for the placement
    (`_flow_of`): {"flow_tokens_per_s", "min_layer_kv_tokens", ...}.

    `hash_seed`: their subprocess's PYTHONHASHSEED. Their flow graph is built by iterating
    sets, so the max flow's split over the links (not its value) depends on it, and with
    the split which nodes their router idles and what it serves (up to 9% here): a fixed
    seed makes a run repeatable, other seeds sample the spread.

    Returns {"decode_tokens_per_s", "wall_s", ...}, or {"error": why} when it cannot run."""
    why = missing_artifact(artifact)
    if why:
        return {"error": why}
    if cluster not in CLUSTERS:
        return {"error": f"no Helix cluster file for {cluster!r} (known: {', '.join(CLUSTERS)})"}
    folder, ini = CLUSTERS[cluster]
    base = artifact / folder
    with tempfile.TemporaryDirectory(prefix="helix-sim-") as tmp:
        work = Path(tmp)
        (work / "config").mkdir()
        shutil.copy(base / "config" / "machine_profiles.ini", work / "config")
        job: dict[str, Any] = {
            "step3": str(base / "step3_simulation.py"),
            "cluster_ini": str(base / ini),
            "model": MODELS["llama-2-70b"],
            "window": list(window) if window else [WINDOW["warmup_s"], WINDOW["duration_s"]],
            "flow_only": flow_only,
        }
        if placement is None:
            sol, sim_cluster = AUTHORS_FILES[cluster]
            job |= {"solution": str(base / sol), "simulator_cluster": str(base / sim_cluster)}
        else:
            if placement.model not in MODELS:
                return {"error": f"Helix's simulator has no model {placement.model!r} here "
                                 f"(known: {', '.join(MODELS)})"}
            types = _cluster_types(base / ini)
            (work / "ilp_sol.ini").write_text(
                solution_ini(placement, len(types), placement.source or "placement"))
            job |= {"solution": str(work / "ilp_sol.ini"), "simulator_cluster": None,
                    "partial_inference": partial_inference}
        (work / "job.json").write_text(json.dumps(job))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(artifact), str(REPO)])
        env["PYTHONHASHSEED"] = str(hash_seed)
        started = time.perf_counter()
        try:
            proc = subprocess.run([python, "-m", "benchmarks.helix_sim", "_drive", "job.json"],
                                  cwd=work, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"Helix's simulator ran past {timeout_s:g} s"}
        wall_s = time.perf_counter() - started
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for name in ("ilp_sol.ini", "simulator_cluster.ini"):
                if (work / name).exists():
                    shutil.copy(work / name, keep / name)
            (keep / "log.txt").write_text(proc.stdout + proc.stderr)
        out = work / "result.json"
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"Helix's simulator failed (rc {proc.returncode}): "
                             + " | ".join(tail)}
        result: dict[str, Any] = json.loads(out.read_text())
        if flow_only:
            return result | {"wall_s": round(wall_s, 1), "hash_seed": hash_seed}
        return result | {"wall_s": round(wall_s, 1), "window_s": job["window"],
                         "hash_seed": hash_seed}


def _drive(job_path: Path) -> int:
    """In the subprocess (cwd: the work folder; PYTHONPATH: the artifact, then this repo):
    build the simulator cluster file if needed and run the authors' function.

    Python's cyclic garbage collector is off here: it only ever frees memory, never changes
    what the simulation computes, and their simulator keeps every request's history, so a
    full collection walks the whole heap (helix-mix-42 in 60 s + 600 s: 20+ GiB a process,
    most of it in swap on a 23 GiB host, where each pass stalled the run for minutes)."""
    import gc
    import importlib.util

    gc.disable()
    job = json.loads(job_path.read_text())
    spec = importlib.util.spec_from_file_location("helix_step3", job["step3"])
    assert spec and spec.loader
    step3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step3)  # their module; main() is behind __name__ == "__main__"
    from simulator.event_simulator.cluster_simulator import ModelName

    model_name = getattr(ModelName, job["model"])
    machine_num_dict = dict(Counter(_cluster_types(Path(job["cluster_ini"]))))
    sim_cluster = job["simulator_cluster"]
    note: dict[str, Any] = {}
    if sim_cluster is None:
        sim_cluster = "simulator_cluster.ini"
        note = _write_simulator_cluster(model_name, machine_num_dict, job, Path(sim_cluster))
        if "error" in note:
            Path("result.json").write_text(json.dumps(note))
            return 0
    kwargs = {"model_name": model_name, "solution_file_name": job["solution"],
              "complete_cluster_file_name": job["cluster_ini"],
              "simulator_cluster_file_name": sim_cluster, "machine_num_dict": machine_num_dict}
    if job.get("flow_only"):
        Path("result.json").write_text(json.dumps(_flow_of(**kwargs) | note))
        return 0
    warmup_s, duration_s = job["window"]
    if (warmup_s, duration_s) == (WINDOW["warmup_s"], WINDOW["duration_s"]):
        decode = step3.simulate_maxflow_offline(**kwargs)
    else:
        decode = _simulate_offline(warmup_s=warmup_s, duration_s=duration_s, **kwargs)
    Path("result.json").write_text(json.dumps(
        {"decode_tokens_per_s": round(float(decode), 2), **note}))
    # exit without tearing the heap down object by object: on helix-mix-42's 60 s + 600 s
    # that read ~37 GiB back from swap for half an hour after the result was written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _simulate_offline(model_name: Any, solution_file_name: str, complete_cluster_file_name: str,
                      simulator_cluster_file_name: str, machine_num_dict: dict[str, int],
                      warmup_s: float, duration_s: float) -> float:
    """`simulate_maxflow_offline` of the artifact's step3_simulation.py, step by step, with
    its window (`warm_up, duration = 60, 600` there) as parameters; the latency sums it
    computes and discards are left out."""
    from simulator.event_simulator.cluster_simulator import RequestPhase
    from simulator.trace_generator.simulator_query_feeder import OfflineRequestFeeder

    simulator, finish_model_loading_time = _ready_simulator(
        model_name, solution_file_name, complete_cluster_file_name,
        simulator_cluster_file_name, machine_num_dict)
    feeder = OfflineRequestFeeder(initial_query_count=20, start_time=finish_model_loading_time,
                                  duration=warmup_s + duration_s, stop_at_duration=True,
                                  feed_hwm=0.8, seed=0)
    feeder.auto_simulate(simulator=simulator, watch_items=["all"], watch_interval=200)
    start, end = finish_model_loading_time + warmup_s, finish_model_loading_time + warmup_s + duration_s
    total_tokens = 0
    for at, request in simulator.finished_requests.values():
        if request.phase != RequestPhase.Initialization and start <= at <= end:
            total_tokens += request.token_seq_length
    return total_tokens / duration_s


def _ready_simulator(model_name: Any, solution_file_name: str, complete_cluster_file_name: str,
                     simulator_cluster_file_name: str,
                     machine_num_dict: dict[str, int]) -> tuple[Any, float]:
    """Their simulator with the placement laid out and the MaxFlow scheduler ready, as
    `simulate_maxflow_offline` prepares it; and when the layers finished loading."""
    from simulator.event_simulator.cluster_simulator import ClusterSimulator, SchedulingMethod
    from simulator.initial_layout.layout_synthesizer import LayoutMethod, LayoutSynthesizer
    from simulator.scheduler.global_maxflow.global_maxflow_scheduler import (
        KVParameters,
        SchedulingMode,
    )

    layout_synthesizer = LayoutSynthesizer(
        complete_cluster_file_name=complete_cluster_file_name,
        machine_profile_name="config/machine_profiles.ini", model_name=model_name,
        workspace_path="./tmp", layout_method=LayoutMethod.LoadExisting,
        machine_num_dict=machine_num_dict)
    cluster_file_path = layout_synthesizer.synthesize(args={
        "solution_file_name": solution_file_name,
        "simulator_cluster_file_name": simulator_cluster_file_name})
    simulator = ClusterSimulator(model_name=model_name, machine_num_dict=machine_num_dict)
    simulator.from_ini_file(config_file_name=cluster_file_path)
    simulator.init_scheduler(scheduling_method=SchedulingMethod.MaxFlow, args={
        "kv_param": KVParameters(expected_kv_hwm=0.85, expected_output_length_ratio=1),
        "scheduling_mode": SchedulingMode.Offline})
    simulator.init_query_manager()
    simulator.mark_as_ready()
    finish_model_loading_time = layout_synthesizer.set_layout(simulator=simulator)
    simulator.update_scheduler()
    return simulator, finish_model_loading_time


def _flow_of(**kwargs: Any) -> dict[str, Any]:
    """What their MaxFlow scheduler plans with for the placement, without simulating: the
    value of its max flow (tokens/s, from their node and link capacities) and the KV each
    layer has summed over its holders, as their feeder's `bottleneck_usage` counts it (a
    node's KV spread evenly over its layers), at the layer where it is least."""
    simulator, _ = _ready_simulator(**kwargs)
    core = simulator.scheduler.core
    per_layer = [0.0] * simulator.model_manager.get_num_layers()
    for status in core.kv_expectation.node_uid_to_status.values():
        k = status.end_layer_idx - status.start_layer_idx
        for layer in range(status.start_layer_idx, status.end_layer_idx):
            per_layer[layer] += status.total_kv_capacity / k
    least = min(per_layer)
    graph = core.flow_graph
    nodes: dict[str, dict[str, Any]] = {}
    for uid, node in sorted(simulator.compute_nodes.items()):
        if not node.in_vram_model_layers:
            continue
        edge = (f"{uid}_start", f"{uid}_end")
        nodes[f"n{uid - NODE_OFFSET}"] = {
            "layers": [min(node.in_vram_model_layers), max(node.in_vram_model_layers) + 1],
            "capacity_tokens_per_s": round(float(graph.flow_graph[edge[0]][edge[1]]["capacity"]), 1),
            "flow_tokens_per_s": round(float(graph.flow_dict[edge[0]][edge[1]]), 1)}
    # the flow on each link (their `<uid>_out -> <uid>_in` edges) in our placement's `flows`
    # terms, the coordinator standing for their source and sink nodes: what their router's
    # IWRR weighs, before its masks
    ends = {simulator.source_node.node_uid, simulator.sink_node.node_uid}

    def vertex(v: str) -> str:
        uid = int(v.rsplit("_", 1)[0])
        return "coordinator" if uid in ends else f"n{uid - NODE_OFFSET}"

    edges = [{"src": vertex(u), "dst": vertex(v), "tokens_per_s": round(float(f), 3)}
             for u, out in graph.flow_dict.items() for v, f in out.items()
             if f > 0 and u.endswith("_out") and v.endswith("_in")]
    return {"flow_tokens_per_s": round(float(graph.flow_value), 1),
            "edges": edges,
            "min_layer_kv_tokens": round(least),
            "min_kv_layers": [i for i, v in enumerate(per_layer) if v == least],
            # their router never sends a request along an edge under 5% of its vertex's
            # outflow: a node its max flow leaves at 0 runs nothing and its KV holds nothing
            "idle_nodes": [name for name, n in nodes.items() if n["flow_tokens_per_s"] <= 0],
            "nodes": nodes}


def _write_simulator_cluster(model_name: Any, machine_num_dict: dict[str, int],
                             job: dict[str, Any], path: Path) -> dict[str, Any]:
    """The simulator cluster file of our placement, by Helix's own generator."""
    from simulator.initial_layout.ilp_layout.ilp_layout import ILPLayout
    from simulator.initial_layout.load_existing_layout import LoadExistingLayout
    from simulator.model_manager.model_manager import ModelManager

    manager = ModelManager(model_name=model_name, machine_num_dict=machine_num_dict)
    loaded = LoadExistingLayout(model_manager=manager)
    loaded.from_ini(cluster_file_name=job["cluster_ini"],
                    machine_profile_name="config/machine_profiles.ini")
    loaded.load_solution(solution_file_name=job["solution"])
    used = sorted(loaded.nodes_in_use)
    over = [(i, loaded.nodes[i].machine_type.type_name,
             loaded.nodes[i].end_layer_idx - loaded.nodes[i].start_layer_idx,
             loaded.nodes[i].max_num_layers) for i in used
            if loaded.nodes[i].end_layer_idx - loaded.nodes[i].start_layer_idx
            > loaded.nodes[i].max_num_layers]
    if over:
        i, kind, k, cap = over[0]
        return {"error": f"n{i} ({kind}) holds {k} layers, more than Helix's simulator's "
                         f"model of a {kind} holds ({cap}); {len(over)} such node(s)"}
    layout = ILPLayout(model_manager=manager)
    layout.machine_profiles = loaded.machine_profiles
    layout.model_card = loaded.model_card
    layout.ilp_source, layout.ilp_sink = loaded.source, loaded.sink
    layout.ilp_nodes = {i: loaded.nodes[i] for i in used}
    layout.ilp_links = {k: v for k, v in loaded.links.items()
                        if all(end in ("source", "sink") or end in layout.ilp_nodes for end in k)}
    layout.cluster_loaded = layout.solution_loaded = True
    layout.generate_simulator_cluster(cluster_file_path=str(path),
                                      allow_partial_inference=job["partial_inference"])
    # their generator names the nodes compute_node_<offset + 0..n-1>, right when every node
    # is used (as in their ILP's placements); name the ones in use when some are not
    names = [f"compute_node_{NODE_OFFSET + i}" for i in used]
    text = path.read_text().replace(
        f"names={[f'compute_node_{NODE_OFFSET + i}' for i in range(len(used))]}\n",
        f"names={names}\n", 1)
    path.write_text(text)
    return {"nodes_used": len(used), "partial_inference": job["partial_inference"]}


def with_flows(placement_json: dict[str, Any], flow: dict[str, Any]) -> dict[str, Any]:
    """The placement (its JSON) routed by Helix's max flow (`_flow_of`'s result): its
    `flows` replaced by their links' flows, its throughput by their flow's value."""
    if not flow.get("edges"):
        raise ValueError("Helix's flow has no edges: nothing to route over")
    return placement_json | {"flows": flow["edges"],
                             "throughput_tokens_per_s": flow["flow_tokens_per_s"]}


def simulate_routed(cluster: str, routed: dict[str, Any], window: tuple[float, float], *,
                    keep: Path | None = None, tag: str = "") -> dict[str, Any]:
    """Our simulator with Helix's rules (PROXY_FLAGS) on `routed` (a placement's JSON whose
    flows the router follows), offline, `window` = (warmup s, counted s): its --json
    report, or {"error": why}."""
    warmup_s, duration_s = window
    with tempfile.TemporaryDirectory(prefix="helix-proxy-") as tmp:
        routed_path = Path(tmp) / "placement.json"
        routed_path.write_text(json.dumps(routed))
        out = Path(tmp) / "sim.json"
        cmd = [sys.executable, "-m", "helixserve", "simulate", "--cluster",
               str(REPO / CLUSTER_FILES[cluster]), "--placement", str(routed_path),
               *PROXY_FLAGS, "--warmup", f"{warmup_s:g}", "--duration",
               f"{warmup_s + duration_s:g}", "--quiet", "--json", str(out)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
            return {"error": f"simulate failed (rc {proc.returncode}): " + " | ".join(tail)}
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(routed_path, keep / f"placement-helix-flow-{tag}.json")
            shutil.copy(out, keep / f"simulate-{tag}.json")
        report: dict[str, Any] = json.loads(out.read_text())
        return report


def proxy(artifact: Path, cluster: str, placement_path: Path | None, *,
          python: str = sys.executable,
          window: tuple[float, float] = (WINDOW["warmup_s"], WINDOW["duration_s"]),
          hash_seeds: tuple[int, ...] = (0, 1, 2), keep: Path | None = None) -> dict[str, Any]:
    """Helix's simulator, approximated in seconds: their scheduler's max flow for the
    placement (`flow`, about a second: their code, their node and link capacities), then our
    simulator with Helix's rules (PROXY_FLAGS) routing by that flow, offline, in `window`
    (warmup s, counted s); once for each of `hash_seeds` (their flow's split over the links
    depends on it, see `score`). Returns {"decode_tokens_per_s" (the mean), "runs" (each
    seed's), "helix_flow_tokens_per_s", "wall_s", ...} or {"error": why}. How well it
    tracks their simulator: docs/benchmarks.md, "A stand-in for Helix's simulator"."""
    started = time.perf_counter()
    path = Path(placement_path or REPO / AUTHORS_PLACEMENTS[cluster])
    placement = load_placement(path)
    runs: list[dict[str, Any]] = []
    for seed in hash_seeds:
        flow = score(artifact, cluster, placement, python=python, flow_only=True,
                     hash_seed=seed)
        if "error" in flow:
            return flow
        sim = simulate_routed(cluster, with_flows(json.loads(path.read_text()), flow),
                              window, keep=keep, tag=f"seed{seed}")
        if "error" in sim:
            return sim
        runs.append({"hash_seed": seed,
                     "decode_tokens_per_s": round(float(sim["decode_throughput_tokens_per_s"]), 2),
                     "idle_nodes": flow["idle_nodes"]})
    decodes = [r["decode_tokens_per_s"] for r in runs]
    return {"decode_tokens_per_s": round(sum(decodes) / len(decodes), 2),
            "decode_min_max": [min(decodes), max(decodes)], "runs": runs,
            "helix_flow_tokens_per_s": flow["flow_tokens_per_s"],
            "window_s": list(window),
            "placement": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
            "wall_s": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.helix_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    # what every command takes: the artifact, the cluster, the placement, their interpreter
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--helix-artifact", type=Path, required=True, metavar="PATH")
    common.add_argument("--cluster", choices=list(CLUSTERS), required=True)
    common.add_argument("--placement", type=Path, default=None,
                        help="our placement JSON (default: the authors' placement; `score` "
                        "and `flow`: their own files, as published)")
    common.add_argument("--python", default=sys.executable,
                        help="interpreter with their requirements (gurobipy, networkx, "
                        "matplotlib)")
    window = argparse.ArgumentParser(add_help=False)
    window.add_argument("--window", type=float, nargs=2, default=None,
                        metavar=("WARMUP", "DURATION"),
                        help="simulated warmup and counted seconds (default: the authors' "
                        "60 600)")
    seed_help = "their subprocess's PYTHONHASHSEED (their max flow's split over the links "
    s = sub.add_parser("score", parents=[common, window],
                       help="one placement in Helix's simulator, offline")
    s.add_argument("--no-partial-inference", action="store_true",
                   help="links only where one range ends exactly where the next starts (as the "
                   "authors generated their files)")
    s.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep the generated ilp_sol.ini, simulator_cluster.ini and the log")
    s.add_argument("--hash-seed", type=int, default=0, metavar="SEED",
                   help=seed_help + "depends on it; default 0)")
    f = sub.add_parser("flow", parents=[common], help="Helix's max flow of one placement and "
                       "its least KV a layer, as their scheduler plans with them (no "
                       "simulation; seconds)")
    f.add_argument("--hash-seed", type=int, default=0, metavar="SEED",
                   help=seed_help + "depends on it; default 0)")
    x = sub.add_parser("proxy", parents=[common, window],
                       help="Helix's simulator approximated in seconds: our simulator with "
                       "Helix's rules, routed by Helix's own max flow")
    x.add_argument("--hash-seeds", type=int, nargs="+", default=[0, 1, 2], metavar="SEED",
                   help=seed_help + "depends on it), one run each, averaged (default 0 1 2)")
    x.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="keep the placement routed by Helix's flow and the simulator's JSON")
    d = sub.add_parser("_drive", help=argparse.SUPPRESS)
    d.add_argument("job", type=Path)
    args = ap.parse_args(argv)
    if args.what == "_drive":
        return _drive(args.job)
    try:
        placement = load_placement(args.placement) if args.placement else None
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.what == "proxy":
        result = proxy(args.helix_artifact, args.cluster, args.placement, python=args.python,
                       window=tuple(args.window) if args.window else
                       (WINDOW["warmup_s"], WINDOW["duration_s"]),
                       hash_seeds=tuple(args.hash_seeds), keep=args.keep)
    elif args.what == "flow":
        result = score(args.helix_artifact, args.cluster, placement, python=args.python,
                       flow_only=True, hash_seed=args.hash_seed)
    else:
        result = score(args.helix_artifact, args.cluster, placement, python=args.python,
                       partial_inference=not args.no_partial_inference,
                       window=tuple(args.window) if args.window else None, keep=args.keep,
                       hash_seed=args.hash_seed)
    print(json.dumps(result, indent=1))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
