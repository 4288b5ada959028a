"""Turn a `SimResult` into the JSON summary and a text table.

Throughputs count tokens that reach the coordinator in `[warmup_s, duration_s]`: every
output token (the first comes from the prompt pass) is a decode token; a prompt's tokens
count when its first token arrives. Latencies are over requests that arrived at or after
`warmup_s` and finished: TTFT = first token - arrival (admission wait included), TPOT =
(finish - first token) / (output - 1), E2E = finish - arrival.
"""

from __future__ import annotations

import math
from typing import Any

from helixserve.simulator.sim import SimResult


def percentiles(values: list[float]) -> dict[str, float]:
    """{mean, p50, p90, p99} by linear interpolation; NaN-free (zeros) when empty."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    xs = sorted(values)

    def q(p: float) -> float:
        pos = p * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"mean": sum(xs) / len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def latencies(result: SimResult) -> dict[str, list[float]]:
    warm = result.config.warmup_s
    ttft, tpot, e2e = [], [], []
    for r in result.finished:
        if r.arrival_s < warm:
            continue
        ttft.append(r.first_s - r.arrival_s)
        e2e.append(r.finish_s - r.arrival_s)
        if r.output > 1:
            tpot.append((r.finish_s - r.first_s) / (r.output - 1))
    return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e}


def _node_summary(n: Any, duration_s: float) -> dict[str, Any]:
    return {
        "name": n.name,
        "gpu": n.spec.gpu,
        "num_gpus": n.spec.num_gpus,
        "start_layer": n.start,
        "end_layer": n.end,
        "utilization": n.busy_s / duration_s,
        "iterations": n.iters,
        # over the iterations that had decode (prompt) work
        "mean_decode_batch": n.decode_tokens / n.decode_iters if n.decode_iters else 0.0,
        "mean_prompt_batch_tokens": n.prompt_tokens / n.prompt_iters if n.prompt_iters else 0.0,
        "kv_capacity_tokens": n.kv_cap,
        "kv_mean_usage": n.kv_area / duration_s / n.kv_cap if n.kv_cap else 0.0,
        "kv_peak_usage": n.kv_peak / n.kv_cap if n.kv_cap else 0.0,
        "queue_len_end": len(n.pq) + len(n.dq),
        "preempted": n.preempted,
    }


def prefix_summary(result: SimResult) -> dict[str, Any]:
    """Prompt tokens looked up in the prefix caches and found on every hop, once per
    request (the core's totals, vLLM's prefix_cache_queries / hits: a route of three hops
    weighs no more than one of two)."""
    totals: tuple[int, int] = result.extra.get("prefix_totals") or (0, 0)  # type: ignore[assignment]
    queried, hit = totals
    return {"queried_tokens": queried, "hit_tokens": hit,
            "hit_rate": hit / queried if queried else 0.0}


def summarize(result: SimResult) -> dict[str, Any]:
    cfg = result.config
    window_s = result.end_s - cfg.warmup_s
    duration_s = result.end_s
    lat = latencies(result)
    nodes = [_node_summary(n, duration_s) for n in result.nodes]
    links = [
        {
            "src": k.src,
            "dst": k.dst,
            "utilization": k.busy_s / duration_s,
            "bytes": k.bytes_sent,
        }
        for k in result.links
    ]
    decode_tps = result.decode_tokens / window_s
    out: dict[str, Any] = {
        "format": "helixserve.simulation/v1",
        "model": result.placement.model,
        "cluster": result.placement.cluster,
        "planner": result.placement.planner,
        "scheduler": cfg.scheduler,
        "route_within_regions": result.placement.route_within_regions,
        "mode": "offline" if cfg.offline else "online",
        "seed": cfg.seed,
        "duration_s": duration_s,
        "warmup_s": cfg.warmup_s,
        "decode_throughput_tokens_per_s": decode_tps,
        "prompt_throughput_tokens_per_s": result.prompt_tokens / window_s,
        "max_flow_tokens_per_s": result.max_flow_tokens_per_s,
        "requests_arrived": result.arrived,
        "requests_finished": len(result.finished),
        "requests_in_flight": result.in_flight,
        "requests_waiting": result.waiting,
        "requests_rejected": result.rejected,
        "kv_allocation": cfg.kv_allocation,
        "preemptions": result.extra.get("preemptions", 0),
        # requests an offline feeder could not route and dropped (absent without one)
        **({"feed_dropped": result.extra["feed_dropped"]} if "feed_dropped" in result.extra
           else {}),
        "prefix_cache": prefix_summary(result),
        "ttft_s": percentiles(lat["ttft_s"]),
        "tpot_s": percentiles(lat["tpot_s"]),
        "e2e_s": percentiles(lat["e2e_s"]),
        "nodes": nodes,
        "links": links,
        "timeline": {
            "bucket_s": result.bucket_s,
            "decode_tokens_per_s": [c / result.bucket_s for c in result.token_timeline],
            "node_utilization": {
                n.name: [b / result.bucket_s for b in n.busy_timeline] for n in result.nodes
            },
        },
        "events": result.events,
        "wall_s": result.wall_s,
        "events_per_s": result.events / result.wall_s if result.wall_s > 0 else 0.0,
    }
    if result.max_flow_tokens_per_s:
        out["throughput_over_max_flow"] = decode_tps / result.max_flow_tokens_per_s
    return out


def _engine_row(s: dict[str, Any]) -> str:
    """The engine preset (when the caller recorded one), KV allocation, prefill, preemptions."""
    cfg = s.get("engine_config") or {}
    parts = [f"KV {s['kv_allocation']}"]
    if cfg.get("chunked_prefill"):
        parts.append(f"chunked prefill {cfg.get('max_prompt_tokens')} tokens")
    if cfg.get("max_prefilling"):
        parts.append(f"<= {cfg['max_prefilling']} prefilling")
    parts.append(f"{s['preemptions']} preemptions")
    name = s.get("engine")
    return (f"{name}: " if name else "") + ", ".join(parts)


def format_table(summary: dict[str, Any]) -> str:
    """The human summary the CLI prints."""
    s = summary
    rows = [
        ("placement / scheduler", f"{s['planner']} / {s['scheduler']} ({s['mode']})"),
        ("simulated", f"{s['duration_s']:.0f} s (warmup {s['warmup_s']:.0f} s)"),
        ("engine model", _engine_row(s)),
        ("decode throughput", f"{s['decode_throughput_tokens_per_s']:.1f} tokens/s"),
        ("prompt throughput", f"{s['prompt_throughput_tokens_per_s']:.1f} tokens/s"),
    ]
    if s.get("max_flow_tokens_per_s"):
        rows.append(
            (
                "max-flow bound",
                f"{s['max_flow_tokens_per_s']:.1f} tokens/s "
                f"(decode = {s.get('throughput_over_max_flow', 0):.0%} of it)",
            )
        )
    rows.append(
        (
            "requests",
            f"{s['requests_finished']} finished, {s['requests_in_flight']} in flight, "
            f"{s['requests_waiting']} waiting, {s['requests_rejected']} rejected",
        )
    )
    pc = s.get("prefix_cache") or {}
    if pc.get("queried_tokens"):
        rows.append(("prefix cache", f"{pc['hit_rate']:.1%} of prompt tokens hit "
                                     f"({pc['hit_tokens']} of {pc['queried_tokens']}, per hop)"))
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency")):
        v = s[key]
        rows.append(
            (
                f"{label} (s)",
                f"mean {v['mean']:.3f}  p50 {v['p50']:.3f}  p90 {v['p90']:.3f}  p99 {v['p99']:.3f}",
            )
        )
    util = [n["utilization"] for n in s["nodes"]]
    kv = [n["kv_peak_usage"] for n in s["nodes"]]
    if util:
        rows.append(
            (
                "node utilisation",
                f"mean {sum(util) / len(util):.0%}, min {min(util):.0%}, max {max(util):.0%}",
            )
        )
        rows.append(("KV peak usage", f"max {max(kv):.0%}"))
    if s["links"]:
        busiest = max(s["links"], key=lambda k: k["utilization"])
        rows.append(
            (
                "busiest link",
                f"{busiest['src']} -> {busiest['dst']} {busiest['utilization']:.0%}",
            )
        )
    rows.append(
        ("simulator", f"{s['events']} events in {s['wall_s']:.2f} s ({s['events_per_s']:.0f}/s)")
    )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
