"""Cache-aware against plain routes when KV binds, in the simulator: the demo's placement.

The demo (`helixserve demo`) places SmolLM2-135M (30 layers) as n1 [0, 9) -> n2 or n3
[9, 30): two routes that share their first hop. Each worker gets the same KV budget in MiB
(`--worker-kv-cache-mb`), which holds, at fp32 (2 x 3 KV heads x 64 x 4 bytes per token per
layer), about 76 tokens per MiB on n1's 9 layers and 32.5 on the 21 layers of n2 and n3.
This script builds that topology in the simulator (the same scheduling core and
cache-aware rule as the live coordinator; simulator/prefix.py models each node's cache, LRU,
a request's tail evicted before its head), runs `workload.multi_turn` conversations with
plain routes (`cache_aware=False`) and with cache-aware ones, and reports per setting and
seed the hit rate of each, and the mechanism: how often a conversation's turn ran on the
route of its previous turn, the most blocks each node's cache held, and how many it evicted.
`--topology three` gives each of three nodes the whole model (three one-hop routes);
`--topology equal` is `helixserve demo --memory-gb 1,1,1` (n3 [0, 10) -> n1 or n2 [10, 30),
half and half); `--topology five` is `helixserve demo --memory-gb 1,1,1,1,1
--worker-link-fraction 0.3` (n5 [0, 6) -> n1, n2, n3 or n4 [6, 30), a quarter each),
`five-mid` the same five workers at the default fraction 0.5 (n1 [0, 6) -> n3, n4 or n5
[6, 24) -> n2 [24, 30)) and `six` six workers (three disjoint two-stage pipelines), as the
demo's MILP planned them with a profile of the 2-core VM.

Timing is a stand-in for the 2-core VM (prefill 1 ms a token, a decode step 100 ms, for
the whole model; split by layers): the hit rates depend on it only through the order of
events, which `--prompt-ms-per-token` changes (slower prefills overlap more: two turns on
one route at once, as on the loaded demo, leave a route short of KV). Conversations start together (`--conversation-gap-s` staggers them); their later
turns arrive `--turn-gap-s` apart plus a uniform jitter of up to `--jitter-s` (so turns
interleave as in the closed-loop benchmark, not in lock step with the router's rotation).

    python -m benchmarks.prefix_kv_limited --json benchmarks/results/prefix_kv_limited.json
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

#: SmolLM2-135M-Instruct's shape (the demo's model)
SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}
#: fp32 KV bytes per token per layer: K and V, 3 KV heads of 64
KV_BYTES_PER_TOKEN_PER_LAYER = 2 * 3 * 64 * 4
#: (node, profile GPU type, start layer, end layer); a GPU type per node, as profiles are
TOPOLOGIES = {
    "demo": [("n1", "T4", 0, 9), ("n2", "L4", 9, 30), ("n3", "A10", 9, 30)],
    "three": [("n1", "T4", 0, 30), ("n2", "L4", 0, 30), ("n3", "A10", 0, 30)],
    # `helixserve demo --memory-gb 1,1,1`: three equal workers, which the demo's MILP
    # plans as n3 [0, 10) -> n1 or n2 [10, 30), 50% / 50%
    "equal": [("n3", "T4", 0, 10), ("n1", "L4", 10, 30), ("n2", "A10", 10, 30)],
    # `helixserve demo --memory-gb 1,1,1,1,1 --worker-link-fraction 0.3`: five equal
    # workers, which the demo's MILP plans as n5 [0, 6) -> n1, n2, n3 or n4 [6, 30), 25% each
    "five": [("n5", "T4", 0, 6), ("n1", "T4", 6, 30), ("n2", "T4", 6, 30),
             ("n3", "T4", 6, 30), ("n4", "T4", 6, 30)],
    # `helixserve demo --memory-gb 1,1,1,1,1` (link fraction 0.5): n1 [0, 6) -> n3, n4 or
    # n5 [6, 24) -> n2 [24, 30), a third each
    "five-mid": [("n1", "T4", 0, 6), ("n3", "T4", 6, 24), ("n4", "T4", 6, 24),
                 ("n5", "T4", 6, 24), ("n2", "T4", 24, 30)],
    # `helixserve demo --memory-gb 1,1,1,1,1,1`: three disjoint two-stage pipelines
    "six": [("n1", "T4", 0, 15), ("n2", "T4", 15, 30), ("n3", "T4", 0, 15),
            ("n4", "T4", 15, 30), ("n5", "T4", 0, 15), ("n6", "T4", 15, 30)],
}
PROMPT_MS_PER_TOKEN = 1.0
DECODE_MS_PER_STEP = 100.0


def kv_tokens(kv_mib: float, layers: int) -> int:
    """Tokens of fp32 KV a worker budget of `kv_mib` holds on `layers` layers."""
    return int(kv_mib * 2**20 // (layers * KV_BYTES_PER_TOKEN_PER_LAYER))


def build(topology: str, kv_mib: float, n3_share: float = 0.5,
          prompt_ms_per_token: float = PROMPT_MS_PER_TOKEN) -> tuple[Any, Any, Any, Any]:
    """(cluster, model, cost model, placement with flows) of the topology, each node's
    memory chosen so that the cost model's KV capacity is `kv_tokens(kv_mib, layers)`.
    `n3_share` (demo only): the max flow's share of route n1 -> n3 (the demo's MILP plans
    its three unequal memory budgets to about 0.64; 0.5: equal nodes), by making n2
    that much slower than n3 (the maxflow router takes its shares from the nodes'
    throughput)."""
    from helixserve.costmodel import CostModel
    from helixserve.planner.flow import evaluate
    from helixserve.planner.placement import NodeRange, Placement
    from helixserve.spec import Curve, ProfileTable, parse_cluster, parse_model

    nodes = TOPOLOGIES[topology]
    model = parse_model(SMOLLM2, "smollm2")
    curves, heads = {}, {}
    for node, gpu, _, _ in nodes:
        slow = n3_share / (1 - n3_share) if node == "n2" and topology == "demo" else 1.0
        per_layer = slow * prompt_ms_per_token / 30
        curves["smollm2", gpu, 1, "prompt"] = Curve((1, 100_000), (per_layer, per_layer * 1e5))
        step = slow * DECODE_MS_PER_STEP / 30
        curves["smollm2", gpu, 1, "decode"] = Curve((1, 64), (step, step))
        for phase in ("prompt", "decode"):
            heads["smollm2", gpu, 1, phase] = Curve((1, 100_000), (0.0, 0.0))
    cost = CostModel(model, ProfileTable(curves, source="prefix_kv_limited", head_curves=heads))

    def cluster(memory_gb: dict[str, float]) -> Any:
        return parse_cluster({
            "name": "demo", "nodes": [{"name": n, "gpu": g, "memory_gb": memory_gb[n]}
                                      for n, g, _, _ in nodes],
            "links": {"default": {"bandwidth_gbps": 1e6, "latency_ms": 0.0}, "explicit": []},
        }, source="prefix_kv_limited")

    memory = {n: 1.0 for n, _, _, _ in nodes}
    for n, _, start, end in nodes:  # KV capacity is monotone in memory: bisect
        target, lo, hi = kv_tokens(kv_mib, end - start), 0.0, 64.0
        for _ in range(60):
            mid = (lo + hi) / 2
            spec = next(x for x in cluster(memory | {n: mid}).nodes if x.name == n)
            lo, hi = (mid, hi) if cost.kv_capacity_tokens(spec, end - start) < target else (lo, mid)
        memory[n] = hi
    spec = cluster(memory)
    placement = Placement(model="smollm2", cluster="demo", num_layers=30, planner="hand",
                          nodes=[NodeRange(n, s, e) for n, _, s, e in nodes])
    placement.flows = evaluate(spec, model, cost, placement).flows
    return spec, model, cost, placement


def run(topology: str, kv_mib: float, conversations: int, turns: int, user_tokens: int,
        output_tokens: int, system_tokens: int, seed: int, aware: bool, turn_gap_s: float,
        jitter_s: float, n3_share: float = 0.5, conversation_gap_s: float = 0.0,
        flow_weight: float | None = None, wait_tokens: float | None = None,
        prompt_ms_per_token: float = PROMPT_MS_PER_TOKEN) -> dict[str, Any]:
    from helixserve.simulator.metrics import latencies, percentiles, prefix_summary
    from helixserve.simulator.sim import SimConfig, Simulation
    from helixserve.simulator.workload import multi_turn

    cluster, model, cost, placement = build(topology, kv_mib, n3_share, prompt_ms_per_token)
    reqs = multi_turn(conversations, turns, system_prompt_tokens=system_tokens,
                      user_tokens=user_tokens, output_tokens=output_tokens,
                      conversation_gap_s=conversation_gap_s, turn_gap_s=turn_gap_s,
                      seed=seed)
    rng = random.Random(seed + 1)
    reqs = sorted((replace(r, arrival_s=r.arrival_s + (0.0 if r.request_id.endswith("-turn0")
                                                        else rng.uniform(0, jitter_s)))
                   for r in reqs), key=lambda r: r.arrival_s)
    flow: dict[str, float] = {} if flow_weight is None else {"prefix_flow_weight": flow_weight}
    if wait_tokens is not None:
        flow["prefix_wait_tokens"] = wait_tokens
    config = SimConfig(duration_s=conversations * conversation_gap_s + turns * turn_gap_s
                       + jitter_s + 600.0, scheduler="maxflow", seed=seed,
                       kv_allocation="on-demand", cache_aware=aware, **flow)
    sim = Simulation(cluster, model, cost, placement, reqs, config)
    sim.decisions = []
    result = sim.run()
    # ("admit", id, route nodes, seen, prompt, output left, resumed, cached tokens)
    routes: dict[str, list[tuple[str, ...]]] = {}
    for e in sim.decisions or ():
        if e[0] == "admit" and not e[6]:
            routes.setdefault(e[1].rsplit("-turn", 1)[0], []).append(tuple(e[2]))
    pairs = [(a, b) for rs in routes.values() for a, b in zip(rs, rs[1:], strict=False)]
    ttft = percentiles(latencies(result)["ttft_s"])
    return {
        "setup": "aware" if aware else "plain", "seed": seed,
        "hit_rate": prefix_summary(result)["hit_rate"],
        "same_route_as_previous_turn": sum(a == b for a, b in pairs) / max(1, len(pairs)),
        "finished": len(result.finished), "requests": len(reqs),
        "ttft_p50_s": ttft.get("p50"), "ttft_p90_s": ttft.get("p90"),
        "nodes": {n.name: {"kv_tokens": n.kv_cap,
                           "peak_cached_tokens": n.cache.peak_blocks * sim.block_size,
                           "evicted_tokens": n.cache.evicted * sim.block_size,
                           "prompt_tokens_computed": n.prompt_tokens}
                  for n in sim.nodes.values()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", choices=sorted(TOPOLOGIES), default="demo")
    ap.add_argument("--kv-mib", type=float, nargs="+", default=[128.0, 384.0, 1024.0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=600)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--turn-gap-s", type=float, default=60.0)
    ap.add_argument("--jitter-s", type=float, default=30.0)
    ap.add_argument("--n3-share", type=float, nargs="+", default=[0.5, 0.64],
                    help="demo: the flow's shares of route n1 -> n3 to run (0.5: equal "
                    "nodes; the demo's MILP plans about 0.64)")
    ap.add_argument("--conversation-gap-s", type=float, default=0.0,
                    help="seconds between conversations' first turns (0: all start together)")
    ap.add_argument("--flow-weight", type=float, default=None,
                    help="SimConfig.prefix_flow_weight (default: the core's, 0.25)")
    ap.add_argument("--wait-tokens", type=float, default=None,
                    help="SimConfig.prefix_wait_tokens (default: the core's, 1024; 0: a "
                    "request never waits for the route holding its history)")
    ap.add_argument("--prompt-ms-per-token", type=float, default=PROMPT_MS_PER_TOKEN,
                    help="prefill time per token of the whole model (default 1; the demo "
                    "on the loaded 2-core VM is several times slower: 8 puts two "
                    "conversations' prefills on one route at once, as there)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'n3 share':>8} {'KV MiB':>7} {'seed':>4} {'plain':>6} {'aware':>6} {'ratio':>6} "
          f"{'same route p/a':>15}  evicted tokens plain / aware (per node)")
    shares = args.n3_share if args.topology == "demo" else [0.5]
    for share, kv, seed in ((sh, kv, sd) for sh in shares for kv in args.kv_mib
                            for sd in args.seeds):
        p, a = (run(args.topology, kv, args.conversations, args.turns, args.user_tokens,
                    args.output_tokens, args.system_tokens, seed, aware, args.turn_gap_s,
                    args.jitter_s, share, args.conversation_gap_s, args.flow_weight,
                    args.wait_tokens, args.prompt_ms_per_token)
                for aware in (False, True))
        ratio = a["hit_rate"] / p["hit_rate"] if p["hit_rate"] else 0.0
        rows.append({"n3_share": share, "kv_mib": kv, "seed": seed, "ratio": ratio,
                     "plain": p, "aware": a})
        ev = " ".join(f"{n}:{p['nodes'][n]['evicted_tokens']}/{a['nodes'][n]['evicted_tokens']}"
                      for n in p["nodes"])
        print(f"{share:>8g} {kv:>7g} {seed:>4} {p['hit_rate']:>6.3f} {a['hit_rate']:>6.3f} "
              f"{ratio:>6.2f} {p['same_route_as_previous_turn']:>7.2f}/"
              f"{a['same_route_as_previous_turn']:.2f}  {ev}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": "python -m benchmarks.prefix_kv_limited", "args": vars(args) | {
                "json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
