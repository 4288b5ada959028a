"""`helixserve rehearse` end to end: inputs checked, the emulated cluster started, the trace
driven through the HTTP API, everything stopped, the simulator run on the same placement and
trace, and one report (the JSON of docs/rehearse.md) of measured next to simulated and of
where the time went.

The order matters for what is measured: CPU counters and link counters are read just before
the load starts and just after it is cut, while every process is up; the simulator runs
after the cluster is stopped, so it takes no CPU from the runtime it is compared with.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helixserve.errors import UserError
from helixserve.rehearse.cluster import (
    DEFAULT_PAYLOAD_BYTES_PER_TOKEN,
    THREADS_KEY,
    EmulatedCluster,
    check_workdir,
)
from helixserve.rehearse.inputs import RehearsalInputs, load_inputs
from helixserve.rehearse.run import (
    MAX_CONCURRENCY,
    OFFLINE_RAMP_S,
    drive,
    errors_of,
    measured_metrics,
    offline_concurrency,
    planned_load_note,
    request_timelines,
    simulate,
    unsaturated_note,
)
from helixserve.runtime.threads import THREAD_KINDS

FORMAT = "helixserve.rehearse/v1"
#: the workers' and `serve`'s flag when the rehearsal runs without prefix caching
NO_PREFIX_CACHING = ("--no-prefix-caching",)


@dataclass(frozen=True)
class RehearsalOptions:
    cluster: Path
    model: Path
    profiles: Path
    placement: Path
    trace: Path
    #: online: the trace's arrivals rescaled to this mean rate (requests/s); None: as written
    rate_per_s: float | None = None
    #: a closed loop of `concurrency` streams instead of the trace's arrivals
    offline: bool = False
    #: seconds of cluster time the load runs (wall: x time_scale)
    duration_s: float = 60.0
    #: seconds at the start left out of the numbers (pipeline fill), both sides
    warmup_s: float = 0.0
    #: every GPU and link time x this; the runtime's own CPU is not scaled
    time_scale: float = 1.0
    #: offline streams; None: what the cluster's KV holds (run.offline_concurrency)
    concurrency: int | None = None
    #: first of the ports the rehearsal takes (API, then a proxy and a worker port per
    #: node); 0: ports the OS picks
    base_port: int = 0
    #: logs, certificates, the cluster copy; None: a temporary directory, removed after
    workdir: Path | None = None
    #: bytes a token the activation messages carry, the rest declared to the link proxy and
    #: charged there (cluster.py); None: the real bytes cross
    payload_bytes_per_token: int | None = DEFAULT_PAYLOAD_BYTES_PER_TOKEN
    #: the workers' prefix caches and the coordinator's cache-aware routes; off: every
    #: worker and `serve` run with --no-prefix-caching, and the simulator without its cache
    prefix_caching: bool = True

    def check(self) -> RehearsalOptions:
        if not 0 < self.duration_s <= 86400:
            raise UserError(f"--duration: bad value {self.duration_s:g}; need 0 < S <= 86400")
        if not 0 <= self.warmup_s < self.duration_s:
            raise UserError(f"--warmup: bad value {self.warmup_s:g}; need 0 <= W < --duration "
                            f"{self.duration_s:g}")
        if not 0 < self.time_scale <= 1000:
            raise UserError(f"--time-scale: bad value {self.time_scale:g}; need 0 < K <= 1000")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise UserError(f"--rate: bad value {self.rate_per_s:g}; need > 0 requests/s")
        if self.concurrency is not None and not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise UserError(f"--concurrency: bad value {self.concurrency}; need "
                            f"1..{MAX_CONCURRENCY}")
        if self.payload_bytes_per_token is not None and self.payload_bytes_per_token < 1:
            raise UserError(f"--emulated-payload-bytes-per-token: bad value "
                            f"{self.payload_bytes_per_token}; need >= 1, or real")
        if self.concurrency is not None and not self.offline:
            raise UserError("--concurrency: only with --offline (online, the trace's arrivals "
                            "decide what is in flight)")
        return self


def run_rehearsal(opts: RehearsalOptions, log: Callable[[str], None]) -> dict[str, Any]:
    """The report (module doc); UserError before anything starts on bad input."""
    opts.check()
    runtime_choices()  # a bad HELIXSERVE_* setting fails here, before anything starts
    inputs = load_inputs(opts.cluster, opts.model, opts.profiles, opts.placement, opts.trace,
                         opts.rate_per_s)
    concurrency = (opts.concurrency or offline_concurrency(inputs)) if opts.offline else 0
    temporary = opts.workdir is None
    workdir = (Path(tempfile.mkdtemp(prefix="helixserve-rehearse-")) if opts.workdir is None
               else check_workdir(opts.workdir))
    load_before = os.getloadavg()[0]
    try:  # the ports are taken here: one in use is a UserError, before anything starts
        cluster = EmulatedCluster(inputs, workdir, time_scale=opts.time_scale,
                                  base_port=opts.base_port,
                                  max_seconds=opts.duration_s * opts.time_scale + 1800.0,
                                  payload_bytes_per_token=opts.payload_bytes_per_token,
                                  worker_args=() if opts.prefix_caching else NO_PREFIX_CACHING,
                                  serve_args=() if opts.prefix_caching else NO_PREFIX_CACHING)
    except BaseException:
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    try:
        log(f"rehearse: EMULATED cluster {inputs.cluster.name!r}: starting "
            f"{len(cluster.nodes)} emulated workers, the link proxy and the coordinator + API "
            f"(logs in {workdir / 'logs'})")
        started = time.perf_counter()
        with cluster:
            start_s = time.perf_counter() - started
            mode = (f"offline, {concurrency} streams{unsaturated_note(inputs, concurrency)}"
                    f"{planned_load_note(inputs, concurrency)}"
                    if opts.offline
                    else f"online, {opts.rate_per_s:g} requests/s" if opts.rate_per_s
                    else "online, the trace's arrivals")
            log(f"rehearse: started in {start_s:.1f} s; driving {opts.trace.name} ({mode}) for "
                f"{opts.duration_s:g} s of cluster time"
                + (f" ({opts.duration_s * opts.time_scale:g} s wall at time scale "
                   f"{opts.time_scale:g})" if opts.time_scale != 1 else ""))
            links_before, cpu_before = cluster.link_stats(), cluster.cpu()
            lost_before = cluster.unattributed()
            client_before = _own_cpu_s()
            at_warmup = _CpuSample(cluster.cpu, opts.warmup_s * opts.time_scale)
            try:
                run = asyncio.run(drive(cluster.api_url, cluster.model_name, inputs.requests,
                                        offline=opts.offline, duration_s=opts.duration_s,
                                        time_scale=opts.time_scale, concurrency=concurrency))
            finally:
                at_warmup.cancel()
            cpu_after, links_after = cluster.cpu(), cluster.link_stats()
            unattributed = _count_deltas(lost_before, cluster.unattributed())
            client_s = _own_cpu_s() - client_before
            coordinator = cluster.coordinator_metrics()
            pids = cluster.pids
        if not cluster.stopped():
            raise RuntimeError("rehearse: a process of the cluster did not stop")
        load_after = os.getloadavg()[0]
        measured = measured_metrics(run, opts.time_scale, opts.warmup_s, opts.duration_s)
        timelines = request_timelines(run, opts.time_scale, opts.warmup_s, opts.duration_s)
        log(f"rehearse: {measured['requests_sent']} requests sent, "
            f"{measured['requests_finished']} finished in the window; simulating the same")
        sim = simulate(inputs, offline=opts.offline, duration_s=opts.duration_s,
                       warmup_s=opts.warmup_s, concurrency=concurrency,
                       ramp_s=OFFLINE_RAMP_S / opts.time_scale,
                       prefix_caching=opts.prefix_caching)
    except BaseException:
        if temporary:
            log(f"rehearse: logs kept in {workdir / 'logs'}")
        raise
    if temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after if name in cpu_before}
    window_cpu = None if at_warmup.value is None else {
        name: cpu_after[name] - at_warmup.value[name] for name in cpu_after
        if name in at_warmup.value}
    return build_report(
        opts, inputs, measured=measured, sim=sim, cpu=cpu, window_cpu=window_cpu,
        client_cpu_s=client_s,
        links=_link_deltas(links_before, links_after), unattributed=unattributed,
        emulated=cluster.emulated,
        pids=pids, concurrency=concurrency, start_s=start_s, wall_s=run.wall_s,
        errors=errors_of(run), load=(load_before, load_after), coordinator=coordinator,
        workdir=None if temporary else workdir, timelines=timelines)


class _CpuSample:
    """The processes' CPU seconds (`read()`) `delay_s` from now, read on a timer thread: the
    run's window starts there (warm-up x time scale), so the CPU of the window alone is
    `cpu_after - value`. `value` stays None when the run ended first or `delay_s` is 0."""

    def __init__(self, read: Callable[[], dict[str, float]], delay_s: float) -> None:
        self.value: dict[str, float] | None = None
        self._read = read
        self._timer = threading.Timer(delay_s, self._take) if delay_s > 0 else None
        if self._timer is not None:
            self._timer.daemon = True
            self._timer.start()

    def _take(self) -> None:
        self.value = self._read()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()


def _runtime_ms_per_token(cpu: dict[str, float] | None, tokens: float) -> float | None:
    """Coordinator + workers' CPU milliseconds per output token (None: nothing to divide)."""
    if cpu is None or not tokens:
        return None
    runtime_s = cpu.get("coordinator", 0.0) + sum(
        v for name, v in cpu.items() if name.startswith("worker-"))
    return runtime_s * 1000.0 / tokens


def _by_thread(cpu: dict[str, float]) -> dict[str, float]:
    """The workers' CPU seconds by kind of thread (runtime/threads.py THREAD_KINDS)."""
    return {kind: round(cpu.get(f"{THREADS_KEY}{kind}", 0.0), 3) for kind in THREAD_KINDS}


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _link_deltas(before: dict[str, dict[str, Any]],
                 after: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for key, now in after.items():
        was = before.get(key, {})
        out[key] = {**now, **{k: now.get(k, 0) - was.get(k, 0) for k in
                              ("bytes", "wire_bytes", "declared_bytes", "connections")}}
        out[key].pop("chunks", None)
    return out


def _count_deltas(before: dict[str, dict[str, int]],
                  after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Per machine, its counters' growth between two reads; machines that did not grow left
    out."""
    out = {}
    for node, now in after.items():
        grew = {k: v - before.get(node, {}).get(k, 0) for k, v in now.items()}
        if any(grew.values()):
            out[node] = grew
    return out


def build_report(opts: RehearsalOptions, inputs: RehearsalInputs, *, measured: dict[str, Any],
                 sim: dict[str, Any], cpu: dict[str, float], client_cpu_s: float,
                 window_cpu: dict[str, float] | None = None,
                 links: dict[str, dict[str, Any]], emulated: dict[str, dict[str, float]],
                 unattributed: dict[str, dict[str, int]] | None = None,
                 pids: dict[str, int], concurrency: int, start_s: float, wall_s: float,
                 errors: list[str], load: tuple[float, float], coordinator: dict[str, Any],
                 workdir: Path | None,
                 timelines: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The JSON report (docs/rehearse.md)."""
    summary = sim["summary"]
    k = opts.time_scale
    window_s = opts.duration_s - opts.warmup_s
    nodes = _node_rows(opts, inputs, summary, emulated, coordinator, cpu)
    link_rows = _link_rows(inputs, summary, links)
    coordinator_s = cpu.get("coordinator", 0.0)
    workers_s = sum(v for name, v in cpu.items() if name.startswith("worker-"))
    runtime_ms = _runtime_ms_per_token(cpu, measured["output_tokens"])
    # the window alone (after the warm-up: the steady state, not the cold start's prefill)
    window_ms = _runtime_ms_per_token(window_cpu, measured["decode_tokens_per_s"] * window_s)
    report = {
        "format": FORMAT,
        "emulated": True,
        "cluster": inputs.cluster.name,
        "model": inputs.model.name,
        "placement": {"file": str(inputs.placement_path), "planner": inputs.placement.planner,
                      "max_flow_tokens_per_s": inputs.placement.throughput_tokens_per_s},
        "trace": str(inputs.trace_path),
        "mode": "offline" if opts.offline else "online",
        "rate_per_s": opts.rate_per_s,
        "concurrency": concurrency or None,
        "duration_s": opts.duration_s,
        "warmup_s": opts.warmup_s,
        "time_scale": k,
        "prefix_caching": opts.prefix_caching,
        # activations' bytes a token on the wire (None: the real size; the rest declared)
        "payload_bytes_per_token": opts.payload_bytes_per_token,
        "measured": measured,
        "simulated": sim["metrics"],
        "simulator_engine": sim["engine_config"],
        "runtime_cpu_ms_per_token": runtime_ms,
        "runtime_cpu_ms_per_token_window": window_ms,
        **({"cpu_s_window": {
            "coordinator": window_cpu.get("coordinator", 0.0),
            "workers": sum(v for n, v in window_cpu.items() if n.startswith("worker-")),
            "links": window_cpu.get("links", 0.0),
            "worker_threads": _by_thread(window_cpu)}} if window_cpu else {}),
        "preemptions": {"measured": coordinator["preemptions"],
                        "simulated": summary["preemptions"]},
        "reroutes": coordinator["reroutes"],
        "cpu_s": {"coordinator": coordinator_s, "workers": workers_s,
                  "links": cpu.get("links", 0.0), "client": client_cpu_s,
                  "worker_threads": _by_thread(cpu),
                  "window_s": window_s, "wall_s": wall_s},
        "nodes": nodes,
        "links": link_rows,
        # per machine: bytes whose caller the proxy could not find, on no link above
        "unattributed_links": unattributed or {},
        # per request, in the order sent (measured) / arrived (simulated): its first token
        # and tokens (`run.request_timelines`): which prompts completed first
        "requests": {"measured": timelines or [], "simulated": sim.get("requests", [])},
        "errors": errors,
        "start_s": start_s,
        "processes": pids,
        "workdir": str(workdir) if workdir else None,
        "command": "helixserve " + _shell_join(sys.argv[1:]),
        "runtime": runtime_choices(),
        "machine": {"hostname": platform.node(), "cpus": os.cpu_count(),
                    "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_1m_before": round(load[0], 2), "loadavg_1m_after": round(load[1], 2)},
    }
    report["host"] = host_check(report)
    return report


#: The host kept up with the emulated cluster (docs/rehearse.md, Output, "host:"):
#: the rehearsal's processes (runtime, link proxy, load client) used under this share of the
#: host's cores, over the run and in the window. Runs that matched the simulator within
#: 0.9-1.05 used 0.03-0.45; the saturated helix-mix-42 run that fell to 0.61x of it with
#: 2,756 requests failed used 0.79 over the run and 0.90 in the window (docs/benchmarks.md).
HOST_CPU_SHARE_MAX = 0.7
#: ... and the emulated GPUs' steps ended late by under this share of their emulated time
#: (those runs: at most 0.008; the starved one 0.033)
OVERRUN_SHARE_MAX = 0.02
#: the share of the cores a suggested time scale aims the rehearsal at
HOST_CPU_SHARE_AIM = 0.4


def host_check(report: dict[str, Any]) -> dict[str, Any]:
    """Whether this host kept up with the emulated cluster, from a report's own numbers: the
    share of the host's cores the rehearsal's processes used (over the run, and in the
    window when it was measured; the load client's CPU is known over the run only), the
    share of the emulated GPU time that steps overran, and, when it did not keep up, the
    time scale that would bring it to HOST_CPU_SHARE_AIM (CPU a token grows on a starved
    host, so take it as a least)."""
    k = report["time_scale"]
    cpus = report["machine"]["cpus"] or 1
    c = report["cpu_s"]
    run_s = c["coordinator"] + c["workers"] + c["links"] + c["client"]
    share = run_s / (cpus * c["wall_s"]) if c["wall_s"] else None
    w = report.get("cpu_s_window")
    window_wall_s = (report["duration_s"] - report["warmup_s"]) * k
    share_window = ((w["coordinator"] + w["workers"] + w["links"]) / (cpus * window_wall_s)
                    if w and window_wall_s > 0 else None)
    emulated_s = sum((n["busy_measured"] or 0.0) * report["duration_s"] * k
                     for n in report["nodes"].values())
    overrun_s = sum(n["overrun_s"] or 0.0 for n in report["nodes"].values())
    overrun = overrun_s / emulated_s if emulated_s else None
    worst = max((x for x in (share, share_window) if x is not None), default=None)
    kept_up = ((worst is None or worst < HOST_CPU_SHARE_MAX)
               and (overrun is None or overrun < OVERRUN_SHARE_MAX))
    hint = None
    if not kept_up:
        hint = math.ceil(k * max(worst or 0.0, HOST_CPU_SHARE_MAX) / HOST_CPU_SHARE_AIM)
        hint = max(hint, math.ceil(k) + 1)
    rnd = (lambda x: None if x is None else round(x, 4))  # noqa: E731
    return {"cpu_share": rnd(share), "cpu_share_window": rnd(share_window),
            "overrun_share": rnd(overrun), "kept_up": kept_up, "time_scale_hint": hint}


def runtime_choices() -> dict[str, str]:
    """The runtime's process-wide choices the children inherit from this environment: the
    worker-to-worker data plane (runtime/dataplane.py, HELIXSERVE_DATAPLANE)."""
    from helixserve.runtime import dataplane

    try:
        return {"dataplane": dataplane.dataplane_kind()}
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _shell_join(argv: list[str]) -> str:
    import shlex

    with contextlib.suppress(Exception):
        return shlex.join(argv)
    return " ".join(argv)


def _node_rows(opts: RehearsalOptions, inputs: RehearsalInputs, summary: dict[str, Any],
               emulated: dict[str, dict[str, float]], coordinator: dict[str, Any],
               cpu: dict[str, float]) -> dict[str, dict[str, Any]]:
    """The report's `nodes`: each placed node, measured beside simulated."""
    k = opts.time_scale
    sim_nodes = {n["name"]: n for n in summary["nodes"]}
    nodes = {}
    for r in inputs.placement.nodes:
        spec = inputs.cluster.node(r.name)
        emu = emulated.get(r.name)
        nodes[r.name] = {
            "gpu": spec.gpu, "num_gpus": spec.num_gpus, "region": spec.region,
            "start_layer": r.start_layer, "end_layer": r.end_layer,
            # the worker's emulated compute (wall seconds, x time scale) over the run's wall
            # time; includes the steps in flight when the run was cut
            "busy_measured": emu["emulated_s"] / (opts.duration_s * k) if emu else None,
            "busy_simulated": sim_nodes[r.name]["utilization"],
            # the coordinator's view at the cut: the worker's busy share over its last 5 s
            "busy_fraction_last_5s": coordinator["busy_fraction"].get(r.name),
            "steps": emu["steps"] if emu else None,
            "overrun_s": emu["overrun_s"] if emu else None,
            "cpu_s": cpu.get(f"worker-{r.name}"),
        }
    return nodes


def _link_rows(inputs: RehearsalInputs, summary: dict[str, Any],
               links: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The report's `links`: each directed link the proxy or the simulator carried bytes on."""
    sim_links = {f"{x['src']}->{x['dst']}": x for x in summary["links"]}
    link_rows: dict[str, dict[str, Any]] = {}
    for key in sorted(set(links) | {k2 for k2, x in sim_links.items() if x["bytes"]}):
        src, dst = key.split("->")
        link = inputs.cluster.link(src, dst)
        m = links.get(key, {})
        link_rows[key] = {
            "src": src, "dst": dst,
            "bandwidth_gbps": inputs.cluster.effective_bandwidth_gbps(src, dst) if link else None,
            "latency_ms": link.latency_ms if link else None,
            # charged: on the wire + declared by the senders (a smaller payload's rest)
            "bytes_measured": m.get("bytes", 0),
            "bytes_wire": m.get("wire_bytes", m.get("bytes", 0)),
            "bytes_declared": m.get("declared_bytes", 0),
            "connections": m.get("connections", 0),
            "bytes_simulated": sim_links.get(key, {}).get("bytes", 0),
            **({"unlinked": True} if m.get("unlinked") else {}),
        }
    return link_rows
