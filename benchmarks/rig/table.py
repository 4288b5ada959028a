"""The rig's printed table and its summary: simulator error and placement rankings."""

from __future__ import annotations

from typing import Any

#: the issue's goals: simulated vs measured
THROUGHPUT_GOAL = 0.15
LATENCY_GOAL = 0.25


def rel_error(sim: float, real: float) -> float:
    return (sim - real) / real if real else float("inf")


def format_table(results: list[dict[str, Any]]) -> str:
    head = (f"{'cluster':<14}{'workload':<15}{'placement':<10}"
            f"{'tok/s real':>11}{'sim':>8}{'err':>7}"
            f"{'TTFT50 real':>12}{'sim':>7}{'err':>7}"
            f"{'TPOT50 real':>12}{'sim':>7}{'err':>7}"
            f"{'TTFT95 err':>11}{'TPOT95 err':>11}{'load':>6}{'probe':>7}{'scaled err':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        m, s, host = r["measured"], r["simulated"], r.get("host", {})
        scaled = r.get("simulated_host_scaled", {})
        lines.append(
            f"{r['cluster']:<14}{r['workload']:<15}{r['placement']:<10}"
            f"{m['decode_tokens_per_s']:>11.1f}{s['decode_tokens_per_s']:>8.1f}"
            f"{rel_error(s['decode_tokens_per_s'], m['decode_tokens_per_s']):>+7.0%}"
            f"{m['ttft_p50_s']:>12.2f}{s['ttft_p50_s']:>7.2f}"
            f"{rel_error(s['ttft_p50_s'], m['ttft_p50_s']):>+7.0%}"
            f"{m['tpot_p50_s']:>12.3f}{s['tpot_p50_s']:>7.3f}"
            f"{rel_error(s['tpot_p50_s'], m['tpot_p50_s']):>+7.0%}"
            f"{rel_error(s['ttft_p95_s'], m['ttft_p95_s']):>+11.0%}"
            f"{rel_error(s['tpot_p95_s'], m['tpot_p95_s']):>+11.0%}"
            f"{host.get('loadavg_before', float('nan')):>6.1f}"
            f"{host.get('probe_ratio', float('nan')):>7.2f}"
            f"{rel_error(scaled.get('decode_tokens_per_s', 0.0), m['decode_tokens_per_s']):>+11.0%}")
    return "\n".join(lines)


def rankings(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (cluster, workload): placements by measured and by simulated throughput, milp's
    ratio to the best measured, and whether the two orders agree."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["cluster"], r["workload"]), []).append(r)
    out = []
    for (cluster, workload), rows in groups.items():
        real = sorted(rows, key=lambda r: -r["measured"]["decode_tokens_per_s"])
        sim = sorted(rows, key=lambda r: -r["simulated"]["decode_tokens_per_s"])
        best = real[0]["measured"]["decode_tokens_per_s"]
        milp = next((r for r in rows if r["placement"] == "milp"), None)
        out.append({
            "cluster": cluster, "workload": workload,
            "measured_order": [r["placement"] for r in real],
            "simulated_order": [r["placement"] for r in sim],
            "same_order": [r["placement"] for r in real] == [r["placement"] for r in sim],
            "milp_vs_best_measured": (milp["measured"]["decode_tokens_per_s"] / best
                                      if milp and best else None),
            # which candidate milp's selection kept for this burst (None: milp-flow only)
            "milp_kept": next((c["source"] for c in (milp or {}).get("selection") or []
                               if c.get("chosen")), None),
            "milp_vs_each_measured": {
                r["placement"]: (milp["measured"]["decode_tokens_per_s"]
                                 / r["measured"]["decode_tokens_per_s"])
                for r in rows if milp and r["measured"]["decode_tokens_per_s"]},
        })
    return out


def format_summary(results: list[dict[str, Any]]) -> str:
    tput = [abs(rel_error(r["simulated"]["decode_tokens_per_s"],
                          r["measured"]["decode_tokens_per_s"])) for r in results]
    lat = [abs(rel_error(r["simulated"][k], r["measured"][k])) for r in results
           for k in ("ttft_p50_s", "tpot_p50_s", "ttft_p95_s", "tpot_p95_s")
           if r["measured"][k] > 0]
    lines = [
        f"throughput within {THROUGHPUT_GOAL:.0%}: {sum(e <= THROUGHPUT_GOAL for e in tput)}"
        f"/{len(tput)} rows; latencies within {LATENCY_GOAL:.0%}: "
        f"{sum(e <= LATENCY_GOAL for e in lat)}/{len(lat)} values",
    ]
    for g in rankings(results):
        ratio = g["milp_vs_best_measured"]
        lines.append(
            f"{g['cluster']:<14}{g['workload']:<15} measured: {' > '.join(g['measured_order'])}"
            f"; simulated: {' > '.join(g['simulated_order'])}"
            f"{' (same)' if g['same_order'] else ''}; milp/best measured "
            f"{ratio:.2f}{f' (milp kept {kept})' if (kept := g['milp_kept']) else ''}"
            if ratio is not None else "")
    return "\n".join(lines)


def format_markdown(results: list[dict[str, Any]]) -> str:
    """The table as markdown, for docs/benchmarks.md."""
    lines = [
        "| cluster | workload | placement | decode tok/s real / sim (err) | TTFT p50 s real / sim "
        "(err) | TPOT p50 s real / sim (err) | TTFT p95 err | TPOT p95 err | load | probe |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        m, s, host = r["measured"], r["simulated"], r.get("host", {})

        def cell(key: str, fmt: str, m: dict[str, Any] = m, s: dict[str, Any] = s) -> str:
            return (f"{m[key]:{fmt}} / {s[key]:{fmt}} ({rel_error(s[key], m[key]):+.0%})")

        runs = [x["decode_tokens_per_s"] for x in r.get("measured_runs") or []]
        spread = f" [{min(runs):.1f}-{max(runs):.1f}]" if len(runs) > 1 else ""
        lines.append(
            f"| {r['cluster']} | {r['workload']} | {r['placement']} "
            f"| {cell('decode_tokens_per_s', '.2f')}{spread} | {cell('ttft_p50_s', '.1f')} "
            f"| {cell('tpot_p50_s', '.2f')} "
            f"| {rel_error(s['ttft_p95_s'], m['ttft_p95_s']):+.0%} "
            f"| {rel_error(s['tpot_p95_s'], m['tpot_p95_s']):+.0%} "
            f"| {host.get('loadavg_before', float('nan')):.1f} "
            f"| {host.get('probe_ratio', float('nan')):.2f} |")
    return "\n".join(lines)
