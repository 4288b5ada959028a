"""The text table of a rehearsal's report (the JSON is built in rehearsal.py)."""

from __future__ import annotations

from typing import Any

#: (key, label, format) of the measured-vs-simulated rows
_ROWS = (
    ("decode_tokens_per_s", "decode tokens/s", "{:.1f}"),
    ("prompt_tokens_per_s", "prompt tokens/s", "{:.1f}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"),
    ("ttft_p95_s", "TTFT p95 (s)", "{:.3f}"),
    ("tpot_p50_s", "TPOT p50 (s)", "{:.4f}"),
    ("tpot_p95_s", "TPOT p95 (s)", "{:.4f}"),
    ("requests_sent", "requests sent", "{:.0f}"),
    ("requests_finished", "finished in window", "{:.0f}"),
    ("requests_failed", "failed", "{:.0f}"),
)
#: links shown in the table (all are in the JSON)
TABLE_LINKS = 12


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b:
        return "-"
    return f"{a / b:.2f}"


def _num(fmt: str, x: float | None) -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def format_report(r: dict[str, Any]) -> str:
    k = r["time_scale"]
    mode = (f"offline, {r['concurrency']} streams" if r["mode"] == "offline"
            else f"online, {r['rate_per_s']:g} requests/s" if r["rate_per_s"]
            else "online, the trace's arrivals")
    lines = [
        "helixserve rehearse: EMULATED GPUs and links (no real GPU ran); real coordinator, "
        "OpenAI API, gRPC and mutual TLS",
        f"cluster {r['cluster']} ({len(r['nodes'])} placed nodes), model {r['model']}, placement "
        f"{r['placement']['planner']} (max flow "
        f"{r['placement']['max_flow_tokens_per_s'] or 0:.0f} tokens/s), {mode}"
        + ("" if r.get("prefix_caching", True) else ", prefix caching off"),
        f"window {r['warmup_s']:g}..{r['duration_s']:g} s of cluster time"
        + (f"; time scale {k:g}: every GPU and link time x {k:g}, measured times / {k:g}"
           if k != 1 else "; time scale 1"),
        "",
        f"{'':<22}{'measured (EMULATED)':>20}{'simulated':>12}{'ratio':>8}",
    ]
    m, s = r["measured"], r["simulated"]
    for key, label, fmt in _ROWS:
        ratio = _ratio(m[key], s[key]) if key.endswith("_s") else ""
        lines.append(f"{label:<22}{_num(fmt, m[key]):>20}{_num(fmt, s[key]):>12}{ratio:>8}")
    pre = r["preemptions"]
    lines.append(f"{'preemptions':<22}{_num('{:.0f}', pre['measured']):>20}"
                 f"{_num('{:.0f}', pre['simulated']):>12}")
    lines += ["", "where the time went",
              f"{'node':<10}{'gpu':<14}{'layers':<10}{'busy meas.':>11}{'busy sim.':>10}"
              f"{'steps':>8}{'CPU s':>8}{'overrun s':>10}"]
    for name, n in r["nodes"].items():
        lines.append(
            f"{name:<10}{n['gpu'] + ' x' + str(n['num_gpus']):<14}"
            f"{str(n['start_layer']) + '-' + str(n['end_layer']):<10}"
            f"{_pct(n['busy_measured']):>11}{_pct(n['busy_simulated']):>10}"
            f"{_num('{:d}', n['steps']):>8}{_num('{:.1f}', n['cpu_s']):>8}"
            f"{_num('{:.2f}', n['overrun_s']):>10}")
    links = sorted(r["links"].values(), key=lambda x: -x["bytes_measured"])
    lines += ["", f"{'link':<26}{'Gbit/s':>8}{'ms':>6}{'bytes meas.':>13}{'bytes sim.':>12}"]
    for x in links[:TABLE_LINKS]:
        bw = "-" if x["bandwidth_gbps"] is None else f"{x['bandwidth_gbps']:g}"
        lat = "-" if x["latency_ms"] is None else f"{x['latency_ms']:g}"
        lines.append(f"{x['src'] + ' -> ' + x['dst']:<26}{bw:>8}{lat:>6}"
                     f"{_bytes(x['bytes_measured']):>13}{_bytes(x['bytes_simulated']):>12}"
                     + ("  (no link in the cluster file)" if x.get("unlinked") else ""))
    if len(links) > TABLE_LINKS:
        lines.append(f"... {len(links) - TABLE_LINKS} more links in the JSON")
    payload = r.get("payload_bytes_per_token")
    declared = sum(x.get("bytes_declared", 0) for x in r["links"].values())
    if payload is not None:
        lines.append(f"activations sent as {payload} bytes a token: {_bytes(declared)} of the "
                     "bytes measured were declared by the workers and charged on their links, "
                     "not sent")
    lost = r.get("unattributed_links") or {}
    if lost:
        total = sum(x.get("bytes_in", 0) + x.get("bytes_out", 0) for x in lost.values())
        lines.append(f"unattributed (caller not found, on no link): {total:,} bytes to "
                     f"{', '.join(sorted(lost))}")
    c = r["cpu_s"]
    per_k = r["runtime_cpu_ms_per_token"]
    lines += [
        "",
        f"runtime CPU{_choices(r)}: coordinator + API {c['coordinator']:.1f} s, workers "
        f"{c['workers']:.1f} s "
        f"for {m['output_tokens']} output tokens: "
        + ("-" if per_k is None else f"{per_k:.2f} s per 1,000 tokens ({per_k:.2f} ms a token)")
        + _window_cpu(r),
        _threads_line(r),
        f"emulation's own CPU (not the runtime's): link proxy {c['links']:.1f} s, load client "
        f"{c['client']:.1f} s; {r['machine']['cpus']} CPUs, load "
        f"{r['machine']['loadavg_1m_before']} -> {r['machine']['loadavg_1m_after']}",
    ]
    lines += _host_lines(r)
    for err in r["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def _host_lines(r: dict[str, Any]) -> list[str]:
    """Whether this host kept up (rehearsal.host_check), and what to do when it did not."""
    h = r.get("host")
    if not h:
        return []
    cpus = r["machine"]["cpus"]
    window = ("" if h["cpu_share_window"] is None
              else f" ({_pct(h['cpu_share_window'])} in the window)")
    over = ("-" if h["overrun_share"] is None else f"{100 * h['overrun_share']:.1f}%")
    lines = [f"host: the rehearsal's processes used {_pct(h['cpu_share'])} of the {cpus} "
             f"CPUs over the run{window}; the emulated GPUs' steps ran late by {over} of "
             "their time"]
    if not h["kept_up"]:
        lines.append(
            "WARNING: this host did not keep up with the emulated cluster: the measured side "
            "understates what the cluster would serve (its own CPU, not the runtime's, is the "
            f"limit); rerun with --time-scale {h['time_scale_hint']} or more, or a lighter load")
    return lines


def _choices(r: dict[str, Any]) -> str:
    """" (stream data plane)": what the runtime ran with, when recorded."""
    run = r.get("runtime")
    if not run:
        return ""
    return f" ({run['dataplane']} data plane)"


def _threads_line(r: dict[str, Any]) -> str:
    """The workers' CPU by kind of thread (runtime/threads.py), over the window when it was
    measured, else over the run."""
    w = r.get("cpu_s_window") or {}
    t, where = (w["worker_threads"], "in the window") if "worker_threads" in w else (
        r["cpu_s"].get("worker_threads"), "over the run")
    if not t:
        return "workers' CPU by thread: not measured"
    return (f"workers' CPU by thread {where}: event loop {t['event_loop']:.1f} s, engine "
            f"threads {t['engine']:.1f} s, gRPC core threads {t['grpc_core']:.1f} s, other "
            f"(gRPC's poller, exited threads) {t['other']:.1f} s")


def _window_cpu(r: dict[str, Any]) -> str:
    """The same over the window only (after the warm-up), when it was measured."""
    per_k = r.get("runtime_cpu_ms_per_token_window")
    w = r.get("cpu_s_window")
    if per_k is None or not w:
        return ""
    return (f"; in the window alone (after the warm-up) {w['coordinator']:.1f} + "
            f"{w['workers']:.1f} s: {per_k:.2f} ms a token")
