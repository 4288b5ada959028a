"""Calibration against Helix: why the simulator serves ~2x what Helix's prototype measured
on Helix's own single-24 placement, one factor at a time (docs/calibration.md).

    python -m benchmarks.calibration --json benchmarks/results/calibration.json

Prints and writes:
- `attribution`: the `vllm` engine model on Helix's Gurobi placement of LLaMA-2-70B on
  helix-single-24 (offline, 600 s, 60 s warmup: the benchmark's 451.3 decode tokens/s), then
  each difference to what Helix's prototype runs applied alone ("alone") and one after the
  other ("cumulative"); the last cumulative row is `--engine helix-prototype` over the
  prototype's 300 s run (measured: 223.4);
- `fit`: the per-layer cost of the prototype's engine beyond the profiles
  (`HELIX_PROTOTYPE_LAYER_OVERHEAD_S`), fitted to the prototype's online run replayed (the same
  423 requests at the same times, `benchmarks/helix-runs/`; measured 139.3);
- `validation`: the Swarm placement the authors ran, swarm routing, 180 requests in flight
  (measured 111.4), and the offline run itself (223.4), with and without that cost;
- `ratios`: milp's placement over the Helix authors' on helix-single-24 and helix-mix-42
  (`benchmarks/results/helix_compare.json`'s placements) in the `vllm` and the
  `helix-prototype` models, and the latter without its per-layer cost over Helix's
  simulator's 660 s run (its policies as Helix's simulator runs them), next to our
  evaluator's max-flow ratio and Helix's simulator's.
Everything is simulated (deterministic for the seed); nothing here reads a clock but `wall_s`.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from helixserve.costmodel import CostModel
from helixserve.planner import NodeRange, Placement, evaluate, load_placement
from helixserve.simulator.metrics import summarize
from helixserve.simulator.presets import ENGINES, HELIX_PROTOTYPE_LAYER_OVERHEAD_S
from helixserve.simulator.sim import SimConfig, Simulation
from helixserve.simulator.workload import TraceRequest, load_azure_trace, prepare_trace
from helixserve.spec import ClusterSpec, load_cluster, load_model, load_profiles

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO / "examples"  # the data the docs use (examples/README.md)
PLACEMENTS = REPO / "benchmarks" / "helix-placements"
#: what the Helix artifact reports or its logs give (benchmarks/helix-runs/README.md)
MEASURED = {
    "helix_offline_decode_tokens_per_s": 223.4,
    "helix_offline_decode_latency_s": 1.750,
    "helix_online_decode_tokens_per_s": 139.3,
    "helix_online_decode_latency_s": 1.675,
    "swarm_offline_decode_tokens_per_s": 111.4,
    "helix_simulator_decode_tokens_per_s": 252.1,
}
#: milp / Helix placement as the issue reports them: our evaluator (max flow) and Helix's
#: own simulator (issue 20)
REPORTED_RATIOS = {
    "helix-single-24": {"evaluator": 1.73, "helix_simulator": 0.98},
    "helix-mix-42": {"evaluator": 1.45, "helix_simulator": 0.84},
}
#: the prototype's runs: 300 s, the first 60 s not counted (step7_parse_results.py)
PROTO_WINDOW = {"duration_s": 300.0, "warmup_s": 60.0}
#: the simulator benchmark's offline window (benchmarks/serving_sim.py)
BENCH_WINDOW = {"duration_s": 600.0, "warmup_s": 60.0}

#: the differences, in the order the cumulative rows apply them: (key, what, SimConfig fields)
FACTORS: list[tuple[str, str, dict[str, Any]]] = [
    ("window", "the prototype's run: 300 s, 60 s warmup (was 600 s)", PROTO_WINDOW),
    ("whole-prompts", "whole prompts, <= 4096 tokens an iteration, each sent on whole (vLLM "
     "0.4.0; was chunks of 512 pipelined along the route, <= 64 prefilling)",
     {"chunked_prefill": False, "prefill_chunk_tokens": None, "max_prompt_tokens": 4096,
      "max_prefilling": None}),
    ("kv-expectation", "admit on prompt + 240 tokens promised, <= 85% of a node's KV (was: the "
     "prompt, 99%)", {"kv_expected_output_tokens": 240, "kv_watermark": 0.15}),
    ("kv-feeder", "offline feeder: 20 requests, then one per prompt or request done while the "
     "busiest layer is <= 80% promised (was: queue never empty)",
     {"offline_feed": "kv-feeder", "feed_initial_requests": 20, "feed_interval_s": 0.1,
      "feed_kv_fraction": 0.8}),
    ("no-spread", "IWRR over the solver's flow (was: the max-entropy spread of it)",
     {"router_spread": False}),
    ("layer-overhead", f"{HELIX_PROTOTYPE_LAYER_OVERHEAD_S * 1e3:g} ms a layer and iteration "
     "beyond the profiles (the prototype's engine; fitted below)",
     {"layer_overhead_s": HELIX_PROTOTYPE_LAYER_OVERHEAD_S}),
]
#: Helix's simulator's run (step3_simulation.py: 60 s warmup + 600 s) of the prototype's
#: policies, without the per-layer cost its simulator does not have either
HELIX_SIM_LIKE = {"duration_s": 660.0, "warmup_s": 60.0, "layer_overhead_s": 0.0}


class Bench:
    def __init__(self) -> None:
        self.model = load_model(SHARED / "models" / "llama-2-70b")
        # every engine model here keeps vLLM 0.4.0's measured memory (4.5 GB a GPU)
        self.cost = CostModel(self.model, load_profiles(SHARED / "profiles" / "helix-measured.csv"),
                              reserved_gb_per_gpu=4.5)
        self.trace = prepare_trace(load_azure_trace(SHARED / "traces" / "azure-llm-conv-2023.csv"))
        self.clusters: dict[str, ClusterSpec] = {}

    def cluster(self, name: str) -> ClusterSpec:
        if name not in self.clusters:
            path = SHARED / "clusters" / f"{name}.yaml"
            if not path.exists():
                path = REPO / "benchmarks" / "helix-clusters" / f"{name}.yaml"
            self.clusters[name] = load_cluster(path)
        return self.clusters[name]

    def with_flows(self, cluster: ClusterSpec, placement: Placement) -> Placement:
        res = evaluate(cluster, self.model, self.cost, placement)
        placement.flows, placement.throughput_tokens_per_s = res.flows, res.throughput_tokens_per_s
        return placement

    def simulate(self, cluster: str, placement: Placement, fields: dict[str, Any], *,
                 offline: bool = True, scheduler: str = "maxflow",
                 requests: list[TraceRequest] | None = None) -> dict[str, Any]:
        config = SimConfig(offline=offline, scheduler=scheduler, seed=0, **fields)
        sim = Simulation(self.cluster(cluster), self.model, self.cost, placement,
                         requests if requests is not None else self.trace, config)
        s = summarize(sim.run())
        return {
            "decode_tokens_per_s": round(s["decode_throughput_tokens_per_s"], 1),
            "tpot_mean_s": round(s["tpot_s"]["mean"], 3),
            "ttft_mean_s": round(s["ttft_s"]["mean"], 3),
            "in_flight_end": s["requests_in_flight"],
            "wall_s": round(s["wall_s"], 2),
        }


def vllm_fields() -> dict[str, Any]:
    return {**ENGINES["vllm"], **BENCH_WINDOW}


def prototype_fields(**overrides: Any) -> dict[str, Any]:
    return {**ENGINES["helix-prototype"], **PROTO_WINDOW, **overrides}


def load_online_requests() -> list[TraceRequest]:
    path = REPO / "benchmarks" / "helix-runs" / "helix-single-24-online-requests.csv"
    with path.open() as f:
        return [TraceRequest(f"q{row['query_id']}", float(row["arrival_s"]),
                             int(row["prompt_tokens"]), int(row["output_tokens"]))
                for row in csv.DictReader(f)]


def attribution(b: Bench, helix: Placement) -> dict[str, Any]:
    base = b.simulate("helix-single-24", helix, vllm_fields())
    alone, cumulative = [], []
    fields = vllm_fields()
    for key, what, change in FACTORS:
        one = b.simulate("helix-single-24", helix, {**vllm_fields(), **change})
        alone.append({"factor": key, "what": what, **one})
        fields = {**fields, **change}
        cumulative.append({"factor": key, "what": what, **b.simulate("helix-single-24", helix,
                                                                     fields)})
    assert fields == prototype_fields(), "the cumulative rows must end at --engine helix-prototype"
    return {"baseline": base, "alone": alone, "cumulative": cumulative}


def fit_overhead(b: Bench, helix: Placement, grid_ms: list[float]) -> dict[str, Any]:
    """The per-layer cost that makes the online replay serve what the prototype measured."""
    reqs = load_online_requests()
    # the online run: arrivals over 300 s, the host ran 30 s more (step5: duration + 30)
    window = {"duration_s": max(r.arrival_s for r in reqs) + 30.0, "warmup_s": 60.0}
    rows = []
    for ms in grid_ms:
        out = b.simulate("helix-single-24", helix,
                         prototype_fields(layer_overhead_s=ms / 1e3, **window),
                         offline=False, requests=reqs)
        rows.append({"layer_overhead_ms": ms, **out})
    target = MEASURED["helix_online_decode_tokens_per_s"]
    best = min(rows, key=lambda r: abs(r["decode_tokens_per_s"] - target))
    return {"measured_decode_tokens_per_s": target, "grid": rows,
            "best_layer_overhead_ms": best["layer_overhead_ms"],
            "preset_layer_overhead_ms": HELIX_PROTOTYPE_LAYER_OVERHEAD_S * 1e3}


def validation(b: Bench, helix: Placement, swarm: Placement) -> list[dict[str, Any]]:
    rows = []
    for label, ms in (("helix-prototype", None), ("helix-prototype, no per-layer cost", 0.0)):
        extra = {} if ms is None else {"layer_overhead_s": ms}
        rows.append({"run": "helix_offline", "model": label,
                     "measured": MEASURED["helix_offline_decode_tokens_per_s"],
                     **b.simulate("helix-single-24", helix, prototype_fields(**extra))})
        # the prototype's host for swarm: 180 requests in flight (step5_start_host.py)
        closed = prototype_fields(offline_feed="closed", feed_initial_requests=180, **extra)
        rows.append({"run": "swarm_offline", "model": label,
                     "measured": MEASURED["swarm_offline_decode_tokens_per_s"],
                     **b.simulate("helix-single-24", swarm, closed, scheduler="swarm")})
    for r in rows:
        r["error"] = round(r["decode_tokens_per_s"] / r["measured"] - 1, 3)
    return rows


def ratios(b: Bench) -> list[dict[str, Any]]:
    compare = json.loads((REPO / "benchmarks" / "results" / "helix_compare.json").read_text())
    out = []
    for case in compare["results"]:
        name = case["cluster"]
        if name not in REPORTED_RATIOS:
            continue
        cluster = b.cluster(name)
        helix = b.with_flows(cluster, load_placement(PLACEMENTS / f"{name}-llama-2-70b.json"))
        milp = b.with_flows(cluster, Placement(
            model="llama-2-70b", cluster=name, num_layers=b.model.num_layers,
            nodes=[NodeRange(n["name"], n["start_layer"], n["end_layer"])
                   for n in case["placement"]],
            planner="milp", source="benchmarks/results/helix_compare.json"))
        row: dict[str, Any] = {"cluster": name, **REPORTED_RATIOS[name]}
        # our evaluator (max flow) with the 4.5 GB of vLLM's memory, decode-only T(k)
        flow = [evaluate(cluster, b.model, b.cost, p).throughput_tokens_per_s
                for p in (milp, helix)]
        row["evaluator_4.5gb"] = round(flow[0] / flow[1], 3)
        models = (("vllm", vllm_fields()), ("helix_prototype", prototype_fields()),
                  ("helix_prototype_no_cost_660s", prototype_fields(**HELIX_SIM_LIKE)))
        for label, fields in models:
            m = b.simulate(name, milp, fields)["decode_tokens_per_s"]
            h = b.simulate(name, helix, fields)["decode_tokens_per_s"]
            row[label] = {"milp": m, "helix": h, "ratio": round(m / h, 3) if h else None}
        out.append(row)
    return out


def print_report(report: dict[str, Any]) -> None:
    att = report["attribution"]
    base = att["baseline"]["decode_tokens_per_s"]
    print(f"Helix's placement on helix-single-24, decode tokens/s (measured on the prototype: "
          f"{MEASURED['helix_offline_decode_tokens_per_s']}; Helix's simulator: "
          f"{MEASURED['helix_simulator_decode_tokens_per_s']})")
    print(f"{'factor':<16} {'alone':>8} {'x':>6} {'cumul.':>8} {'TPOT s':>7} {'in flight':>9}  what")
    print(f"{'vllm (600 s)':<16} {base:>8.1f} {'':>6} {base:>8.1f} "
          f"{att['baseline']['tpot_mean_s']:>7.2f} {att['baseline']['in_flight_end']:>9}")
    for one, cum in zip(att["alone"], att["cumulative"], strict=True):
        print(f"{one['factor']:<16} {one['decode_tokens_per_s']:>8.1f} "
              f"{one['decode_tokens_per_s'] / base:>6.2f} {cum['decode_tokens_per_s']:>8.1f} "
              f"{cum['tpot_mean_s']:>7.2f} {cum['in_flight_end']:>9}  {one['what']}")
    fit = report.get("fit")
    if fit:
        print(f"\nper-layer cost fitted to the online replay (measured "
              f"{fit['measured_decode_tokens_per_s']}): best {fit['best_layer_overhead_ms']} ms "
              f"(preset {fit['preset_layer_overhead_ms']:g} ms)")
        for r in fit["grid"]:
            print(f"  {r['layer_overhead_ms']:>4} ms  {r['decode_tokens_per_s']:>7.1f} tokens/s  "
                  f"TPOT {r['tpot_mean_s']:.2f} s")
    if report.get("validation"):
        print("\nvalidation (prototype runs)")
        for r in report["validation"]:
            print(f"  {r['run']:<14} {r['model']:<36} {r['decode_tokens_per_s']:>7.1f} vs "
                  f"{r['measured']:>6.1f} measured ({r['error']:+.0%})")
    if report.get("ratios"):
        print("\nmilp / Helix placement")
        print(f"  {'cluster':<16} {'evaluator':>9} {'eval 4.5':>8} "
              f"{'Helix sim':>9} {'vllm':>16} {'helix-prototype':>18} {'no cost, 660 s':>18}")
        for r in report["ratios"]:
            cells = " ".join(
                f"{m['ratio']:>6.2f} ({m['milp']:.0f}/{m['helix']:.0f})".rjust(18)
                for m in (r["vllm"], r["helix_prototype"], r["helix_prototype_no_cost_660s"]))
            print(f"  {r['cluster']:<16} {r['evaluator']:>9.2f} {r['evaluator_4.5gb']:>8.2f} "
                  f"{r['helix_simulator']:>9.2f} {cells}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    ap.add_argument("--skip-fit", action="store_true", help="no per-layer cost fit")
    ap.add_argument("--skip-ratios", action="store_true", help="no milp / Helix ratios")
    ap.add_argument("--fit-grid-ms", type=float, nargs="+",
                    default=[0.0, 1.0, 2.0, 3.0, 3.5, 4.0, 5.0])
    args = ap.parse_args()
    started = time.perf_counter()
    b = Bench()
    single = b.cluster("helix-single-24")
    helix = b.with_flows(single, load_placement(PLACEMENTS / "helix-single-24-llama-2-70b.json"))
    swarm = b.with_flows(single, load_placement(
        PLACEMENTS / "helix-single-24-llama-2-70b-swarm.json"))
    report: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": f"{platform.node()} python {platform.python_version()}",
        "measured": MEASURED,
        "engine_helix_prototype": ENGINES["helix-prototype"],
        "attribution": attribution(b, helix),
    }
    if not args.skip_fit:
        report["fit"] = fit_overhead(b, helix, args.fit_grid_ms)
    report["validation"] = validation(b, helix, swarm)
    if not args.skip_ratios:
        report["ratios"] = ratios(b)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    print_report(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
