"""The flow term of cache-aware routes in the simulator: helix-single-24 with and without it.

Multi-turn conversations (`workload.multi_turn`: 200 conversations x 6 turns, a shared
1,000-token system prompt, 100-token user messages and replies, 20 s between turns) on the
Helix authors' placement of helix-single-24 (LLaMA-2-70B), the `vllm` engine model, maxflow
routes, 600 s; per conversation arrival gap and per `prefix_flow_weight` (0: no flow term;
docs/prefix-caching.md, "Routing"): the prefix-cache hit rate, TTFT p50 and end-to-end p50 /
p90 of the requests that finished, and how many did.

    python -m benchmarks.prefix_flow --json benchmarks/results/prefix_flow.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples/clusters/helix-single-24.yaml"
MODEL = ROOT / "examples/models/llama-2-70b"
PROFILES = ROOT / "examples/profiles/helix-measured.csv"
PLACEMENT = ROOT / "benchmarks/helix-placements/helix-single-24-llama-2-70b.json"


def run(weight: float, gap_s: float, duration_s: float,
        wait_tokens: float | None = None) -> dict[str, Any]:
    from helixserve.costmodel import CostModel
    from helixserve.planner import evaluate, load_placement
    from helixserve.simulator.metrics import latencies, percentiles, prefix_summary
    from helixserve.simulator.presets import engine_config, engine_gpu_reserve_gb
    from helixserve.simulator.sim import SimConfig, Simulation
    from helixserve.simulator.workload import multi_turn
    from helixserve.spec import load_cluster, load_model, load_profiles

    cluster = load_cluster(CLUSTER)
    model = load_model(MODEL)
    cost = CostModel(model, load_profiles(PROFILES),
                     reserved_gb_per_gpu=engine_gpu_reserve_gb("vllm"))
    placement = load_placement(PLACEMENT)
    if not placement.flows:
        placement.flows = evaluate(cluster, model, cost, placement).flows
    requests = multi_turn(200, 6, system_prompt_tokens=1000, user_tokens=100,
                          output_tokens=100, conversation_gap_s=gap_s, turn_gap_s=20.0, seed=0)
    wait = {} if wait_tokens is None else {"prefix_wait_tokens": wait_tokens}
    config = SimConfig(duration_s=duration_s, scheduler="maxflow", seed=0,
                       prefix_flow_weight=weight, **wait, **engine_config("vllm"))
    result = Simulation(cluster, model, cost, placement, requests, config).run()
    lat = latencies(result)
    ttft, e2e = percentiles(lat["ttft_s"]), percentiles(lat["e2e_s"])
    return {"prefix_flow_weight": weight, "conversation_gap_s": gap_s,
            "prefix_wait_tokens": config.prefix_wait_tokens,
            "hit_rate": prefix_summary(result)["hit_rate"], "ttft_p50_s": ttft.get("p50"),
            "e2e_p50_s": e2e.get("p50"), "e2e_p90_s": e2e.get("p90"),
            "finished": len(result.finished)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.25])
    ap.add_argument("--gaps", type=float, nargs="+", default=[4.0, 1.0],
                    help="seconds between new conversations (4: sustainable; 1: overloaded)")
    ap.add_argument("--wait-tokens", type=float, nargs="+", default=[None],
                    help="SimConfig.prefix_wait_tokens values to run (default: the core's)")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [run(w, g, args.duration, wt) for g in args.gaps for w in args.weights
            for wt in args.wait_tokens]
    print(f"{'gap s':>6} {'weight':>7} {'wait':>6} {'hit rate':>9} {'TTFT p50 s':>11} "
          f"{'e2e p50 s':>10} {'e2e p90 s':>10} {'finished':>9}")
    for r in rows:
        print(f"{r['conversation_gap_s']:>6g} {r['prefix_flow_weight']:>7g} "
              f"{r['prefix_wait_tokens']:>6g} {r['hit_rate']:>9.3f} "
              f"{r['ttft_p50_s'] or 0:>11.2f} {r['e2e_p50_s'] or 0:>10.1f} "
              f"{r['e2e_p90_s'] or 0:>10.1f} {r['finished']:>9}")
    if args.json is not None:
        args.json.write_text(json.dumps({"command": "python -m benchmarks.prefix_flow",
                                         "duration_s": args.duration, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
