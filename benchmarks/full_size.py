"""Helix's clusters at full size on the real runtime (issue 27 item 4): `helixserve rehearse`
per (cluster, placement, setting), measured next to simulated.

Clusters: helix-single-24, helix-geo-24 and helix-mix-42, LLaMA-2-70B with Helix's measured
profiles. Placements: Helix's published ones (`benchmarks/helix-placements/`), and milp, swarm,
separate and petals from `helixserve plan --planner P --work-limit N --gpu-reserve-gb 4.5`
(the work clock: the same placement on any machine; 4.5 GB kept per GPU, the memory model the
rehearsal's coordinator and simulator use), cached under `benchmarks/results/full_size_placements/`
per (cluster, planner, work limit, planner source fingerprint) so a rerun reuses them.
Settings: Helix's offline one (`--offline`: a closed loop of as many streams as the KV holds)
and online, the Azure conversation trace rescaled to `--rate` requests/s.

Every run is one `helixserve rehearse ... --json` subprocess (EMULATED GPUs and links, the real
coordinator, OpenAI API, gRPC and mutual TLS, docs/rehearse.md); this script adds what the
rehearsal does not report: the memory of its processes (PSS and RSS from
/proc/PID/smaps_rollup every 0.5 s, at the end of start-up and at the peak of the workers' +
coordinator's PSS; PSS counts a page shared by n processes 1/n in each, so it sums across the
forked workers honestly) and the wall time. It prints one table per
cluster and the planner's point (milp's measured decode tokens/s over Helix's placement and
over the best of swarm and separate), and writes everything with `--json`.

    python -m benchmarks.full_size --clusters single-24 --settings offline \
        --json benchmarks/results/full_size.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "models" / "llama-2-70b"
PROFILES = REPO / "examples" / "profiles" / "helix-measured.csv"
TRACE = REPO / "examples" / "traces" / "azure-llm-conv-2023.csv"
PLACEMENT_CACHE = REPO / "benchmarks" / "results" / "full_size_placements"
CLUSTERS = {
    "single-24": (REPO / "examples" / "clusters" / "helix-single-24.yaml",
                  REPO / "benchmarks" / "helix-placements" / "helix-single-24-llama-2-70b.json"),
    "geo-24": (REPO / "examples" / "clusters" / "helix-geo-24.yaml",
               REPO / "benchmarks" / "helix-placements" / "helix-geo-24-llama-2-70b.json"),
    "mix-42": (REPO / "benchmarks" / "helix-clusters" / "helix-mix-42.yaml",
               REPO / "benchmarks" / "helix-placements" / "helix-mix-42-llama-2-70b.json"),
}
PLACEMENTS = ["helix", "milp", "swarm", "separate", "petals"]
SETTINGS = ["offline", "online"]
#: the memory each GPU keeps outside weights and KV in the rehearsal (the vllm engine model)
GPU_RESERVE_GB = 4.5
#: Helix's prototype on its placement of helix-single-24 (real GPUs, vLLM 0.4; docs/calibration.md)
HELIX_PROTOTYPE_SINGLE24_DECODE = 223.4


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def planner_fingerprint() -> str:
    """Hash of the planner, cost model and spec sources: a changed planner re-plans."""
    h = hashlib.sha256()
    for d in ("planner", "costmodel", "spec"):
        for f in sorted((REPO / "helixserve" / d).glob("*.py")):
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def placement_file(cluster: str, planner: str, work_limit: float) -> tuple[Path, dict[str, Any]]:
    """Helix's published placement, or ours from `helixserve plan` (cached)."""
    cluster_yaml, helix = CLUSTERS[cluster]
    if planner == "helix":
        return helix, {"source": rel(helix)}
    out = PLACEMENT_CACHE / f"{cluster}-{planner}-wl{work_limit:g}-{planner_fingerprint()}.json"
    cmd = [sys.executable, "-m", "helixserve", "plan", "--cluster", rel(cluster_yaml),
           "--model", rel(MODEL), "--profiles", rel(PROFILES), "--planner", planner,
           # the max-flow planner, as the placements of docs/benchmarks.md's table were planned
           # (plan's default objective simulates serving: benchmarks/planner_served.py)
           "--objective", "flow",
           "--gpu-reserve-gb", f"{GPU_RESERVE_GB:g}", "--work-limit", f"{work_limit:g}",
           "--out", rel(out), "--quiet"]
    meta = {"source": rel(out), "plan_command": shlex.join(["python", *cmd[1:]])}
    if out.exists():
        return out, meta | {"cached": True}
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"planning {cluster} with {planner}: {meta['plan_command']}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"full_size: plan failed ({proc.returncode}): {proc.stderr.strip()}")
    return out, meta | {"cached": False, "plan_wall_s": round(time.perf_counter() - t0, 1)}


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _kind(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "other"
    words = [a.decode(errors="replace") for a in argv]
    if "worker" in words:
        return "workers"
    if "serve" in words:
        return "coordinator"
    if any("links" in w for w in words):
        return "links"
    return "other"


def _memory_bytes(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process from /proc/PID/smaps_rollup; (0, 0) once it is gone. PSS
    counts a page shared by n processes as 1/n in each, so PSS sums to the memory the
    processes take together (RSS counts the shared interpreter and libraries once per
    process)."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return rss, pss


class MemorySampler(threading.Thread):
    """RSS and PSS of a process tree by kind (workers, coordinator, links, the rehearse
    driver): `peak` and `at_start` hold RSS by kind, and the same keys with `_pss` PSS."""

    def __init__(self, root: int, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.period_s = root, period_s
        self.stop = threading.Event()
        self.peak: dict[str, int] = {}
        self.peak_total = 0
        self.at_start: dict[str, int] | None = None
        self.started = threading.Event()  # set when rehearse says it started
        self.processes_at_start = 0

    def sample(self) -> tuple[dict[str, int], int]:
        kids = _children()
        todo, tree = [self.root], []
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(kids.get(pid, []))
        by: dict[str, int] = {}
        for pid in tree:
            kind = "driver" if pid == self.root else _kind(pid)
            rss, pss = _memory_bytes(pid)
            by[kind] = by.get(kind, 0) + rss
            by[f"{kind}_pss"] = by.get(f"{kind}_pss", 0) + pss
        by["runtime"] = by.get("workers", 0) + by.get("coordinator", 0)
        by["runtime_pss"] = by.get("workers_pss", 0) + by.get("coordinator_pss", 0)
        return by, len(tree)

    def run(self) -> None:
        while not self.stop.is_set():
            by, n = self.sample()
            if self.started.is_set() and self.at_start is None:
                self.at_start, self.processes_at_start = by, n
            if by["runtime_pss"] > self.peak.get("runtime_pss", 0):
                self.peak = by
            self.peak_total = max(self.peak_total,
                                  sum(v for k, v in by.items() if k.endswith("_pss")
                                      and k != "runtime_pss"))
            self.stop.wait(self.period_s)


def rehearse(cluster: str, placement: Path, setting: str, args: argparse.Namespace,
             out: Path) -> dict[str, Any]:
    cluster_yaml, _ = CLUSTERS[cluster]
    cmd = [sys.executable, "-m", "helixserve", "rehearse", "--cluster", rel(cluster_yaml),
           "--model", rel(MODEL), "--profiles", rel(PROFILES), "--placement", rel(placement),
           "--trace", rel(TRACE)]
    cmd += ["--offline"] if setting == "offline" else ["--rate", f"{args.rate:g}"]
    if setting == "offline" and args.concurrency:
        cmd += ["--concurrency", str(args.concurrency)]
    cmd += ["--duration", f"{args.duration:g}", "--warmup", f"{args.warmup:g}",
            "--time-scale", f"{args.time_scale:g}"]
    if args.emulated_payload_bytes_per_token is not None:
        cmd += ["--emulated-payload-bytes-per-token", args.emulated_payload_bytes_per_token]
    if args.workdir:
        cmd += ["--workdir", str(args.workdir / out.stem)]
    cmd += ["--json", str(out)]
    shown = shlex.join(["helixserve", *cmd[3:-1], "OUT.json"])
    print(f"\n$ {shown}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    sampler = MemorySampler(proc.pid)
    sampler.start()
    stderr_lines: list[str] = []
    stdout_parts: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.split("\r")[-1]  # the last state of a line redrawn in place
            stderr_lines.append(line)
            if "rehearse: started in" in line:
                sampler.started.set()
            print(f"  | {line.rstrip()}", file=sys.stderr, flush=True)

    def read_stdout() -> None:
        assert proc.stdout is not None
        stdout_parts.append(proc.stdout.read())

    readers = [threading.Thread(target=read_stderr, daemon=True),
               threading.Thread(target=read_stdout, daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=args.duration * args.time_scale + 600)
    except subprocess.TimeoutExpired:
        proc.terminate()  # rehearse stops its whole cluster on SIGTERM
        proc.wait(timeout=60)
    for t in readers:
        t.join(timeout=10)
    stdout = "".join(stdout_parts)
    sampler.stop.set()
    sampler.join()
    wall_s = time.perf_counter() - t0
    row: dict[str, Any] = {"cluster": cluster, "setting": setting, "rc": proc.returncode,
                           "command": shown, "wall_s": round(wall_s, 1)}
    if stdout:
        row["table"] = stdout
    gib = 1024.0 ** 3
    row["memory_gib"] = {
        "at_start": {k: round(v / gib, 3) for k, v in (sampler.at_start or {}).items()},
        "peak_runtime": {k: round(v / gib, 3) for k, v in sampler.peak.items()},
        "peak_all_processes_pss": round(sampler.peak_total / gib, 3),
        "processes": sampler.processes_at_start,
    }
    if out.exists():
        row["report"] = json.loads(out.read_text())
    else:
        row["error"] = "".join(stderr_lines[-20:])
    return row


def summary(row: dict[str, Any]) -> dict[str, Any]:
    rep = row.get("report")
    if not rep:
        return {}
    m, s = rep["measured"], rep["simulated"]
    ratio = (m["decode_tokens_per_s"] / s["decode_tokens_per_s"]
             if s.get("decode_tokens_per_s") else None)
    nodes = rep["nodes"].values()
    mem = row["memory_gib"]
    return {
        "decode_measured": m["decode_tokens_per_s"], "decode_simulated": s["decode_tokens_per_s"],
        "decode_ratio": ratio,
        "prompt_measured": m["prompt_tokens_per_s"], "prompt_simulated": s["prompt_tokens_per_s"],
        "ttft_p50_measured": m["ttft_p50_s"], "ttft_p50_simulated": s["ttft_p50_s"],
        "tpot_p50_measured": m["tpot_p50_s"], "tpot_p50_simulated": s["tpot_p50_s"],
        "runtime_cpu_ms_per_token": rep["runtime_cpu_ms_per_token"],
        # the same over the window alone (after the warm-up; absent in older reports)
        "runtime_cpu_ms_per_token_window": rep.get("runtime_cpu_ms_per_token_window"),
        "cpu_s": rep["cpu_s"],
        "payload_bytes_per_token": rep.get("payload_bytes_per_token"),
        "start_s": rep["start_s"],
        "runtime_rss_gib_at_start": mem["at_start"].get("runtime"),
        "runtime_rss_gib_peak": mem["peak_runtime"].get("runtime"),
        "runtime_pss_gib_at_start": mem["at_start"].get("runtime_pss"),
        "runtime_pss_gib_peak": mem["peak_runtime"].get("runtime_pss"),
        "overrun_s": sum(n["overrun_s"] or 0 for n in nodes),
        "max_flow_tokens_per_s": rep["placement"]["max_flow_tokens_per_s"],
        "concurrency": rep["concurrency"],
        "loadavg_after": rep["machine"]["loadavg_1m_after"],
        "failed": m["requests_failed"],
        # whether this host kept up with the emulated cluster (None: an older report)
        "host_kept_up": (rep.get("host") or {}).get("kept_up"),
    }


def fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(cluster: str, rows: list[dict[str, Any]], time_scale: float) -> None:
    print(f"\nhelix-{cluster}, llama-2-70b: EMULATED GPUs and links, time scale {time_scale:g} "
          "(numbers in cluster time)")
    head = (f"{'placement':<9} {'setting':<8} {'flow':>6} {'decode m':>9} {'decode s':>9} "
            f"{'m/s':>5} {'TTFT50 m':>9} {'TTFT50 s':>9} {'TPOT50 m':>9} {'TPOT50 s':>9} "
            f"{'cpu ms/tok':>10} {'win':>5} {'start s':>7} {'PSS GiB':>11} {'RSS GiB':>11} {'overrun s':>9}")
    print(head)
    for r in rows:
        s = r["summary"]
        if not s:
            print(f"{r['placement']:<9} {r['setting']:<8} failed (rc {r['rc']})")
            continue
        rss = f"{fmt(s['runtime_rss_gib_at_start'], '.2f')}/{fmt(s['runtime_rss_gib_peak'], '.2f')}"
        pss = f"{fmt(s['runtime_pss_gib_at_start'], '.2f')}/{fmt(s['runtime_pss_gib_peak'], '.2f')}"
        print(f"{r['placement']:<9} {r['setting']:<8} {fmt(s['max_flow_tokens_per_s'], '6.0f')} "
              f"{fmt(s['decode_measured'], '9.1f')} {fmt(s['decode_simulated'], '9.1f')} "
              f"{fmt(s['decode_ratio'], '5.2f')} {fmt(s['ttft_p50_measured'], '9.2f')} "
              f"{fmt(s['ttft_p50_simulated'], '9.2f')} {fmt(s['tpot_p50_measured'], '9.3f')} "
              f"{fmt(s['tpot_p50_simulated'], '9.3f')} "
              f"{fmt(s['runtime_cpu_ms_per_token'], '10.2f')} "
              f"{fmt(s.get('runtime_cpu_ms_per_token_window'), '5.2f')} {fmt(s['start_s'], '7.1f')} "
              f"{pss:>11} {rss:>11} {fmt(s['overrun_s'], '9.1f')}"
              + ("  (the host did not keep up: raise --time-scale)"
                 if s.get("host_kept_up") is False else ""))


def planner_point(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """milp over Helix's placement and over the best of swarm and separate, measured and
    simulated, per (cluster, setting)."""
    out: dict[str, dict[str, Any]] = {}
    keys = sorted({(r["cluster"], r["setting"]) for r in rows})
    for cluster, setting in keys:
        got = {r["placement"]: r["summary"] for r in rows
               if (r["cluster"], r["setting"]) == (cluster, setting) and r["summary"]}
        if "milp" not in got:
            continue
        point: dict[str, Any] = {}
        for side in ("measured", "simulated"):
            milp = got["milp"][f"decode_{side}"]
            if "helix" in got and got["helix"][f"decode_{side}"]:
                point[f"milp_over_helix_{side}"] = milp / got["helix"][f"decode_{side}"]
            base = [(got[p][f"decode_{side}"], p) for p in ("swarm", "separate") if p in got]
            if base and max(base)[0]:
                point[f"milp_over_best_baseline_{side}"] = milp / max(base)[0]
                point[f"best_baseline_{side}"] = max(base)[1]
        out[f"{cluster} {setting}"] = point
    return out


def parser() -> argparse.ArgumentParser:
    """This script's options (also what benchmarks/planner_served.py's `--rehearse` passes to
    `rehearse`, so a new option here reaches it with its default)."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.full_size",
        description="helixserve rehearse of Helix's clusters at full size (EMULATED GPUs and "
        "links, the real runtime): measured vs simulated per cluster, placement and setting")
    ap.add_argument("--clusters", nargs="+", choices=list(CLUSTERS), default=list(CLUSTERS))
    ap.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=PLACEMENTS)
    ap.add_argument("--settings", nargs="+", choices=SETTINGS, default=SETTINGS)
    ap.add_argument("--duration", type=float, default=40.0,
                    help="seconds of cluster time each run loads the cluster (default 40)")
    ap.add_argument("--warmup", type=float, default=10.0,
                    help="seconds of cluster time left out of the numbers (default 10)")
    ap.add_argument("--time-scale", type=float, default=4.0,
                    help="every emulated GPU and link time x K (default 4: what lets the "
                    "runtime come near keeping up on a 2-core host; a run takes duration x K)")
    ap.add_argument("--rate", type=float, default=1.0,
                    help="online requests/s (the Azure conversation trace rescaled; default 1)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="offline streams (default: rehearse's, what the KV holds, at most 256)")
    ap.add_argument("--emulated-payload-bytes-per-token", default=None, metavar="N|real",
                    help="rehearse's activation payload a token (default: rehearse's, 64; the "
                    "rest is charged by the link proxy); real: the real bytes cross")
    ap.add_argument("--work-limit", type=float, default=40.0,
                    help="helixserve plan --work-limit for our planners (default 40)")
    ap.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                    help="keep each rehearsal's logs in DIR/<cluster>-<placement>-<setting> "
                    "(default: removed after a good run)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT")
    ap.add_argument("--merge", action="store_true",
                    help="keep OUT's runs of other (cluster, placement, setting) and replace "
                    "those run now")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    command = shlex.join(["python", "-m", "benchmarks.full_size", *sys.argv[1:]])
    prior: list[dict[str, Any]] = []
    if args.merge and args.json and args.json.exists():
        prior = json.loads(args.json.read_text()).get("runs", [])
    rows: list[dict[str, Any]] = []
    placements_meta: dict[str, Any] = {}

    def write() -> None:
        if not args.json:
            return
        done = {(r["cluster"], r["placement"], r["setting"]) for r in rows}
        runs = [r for r in prior if (r["cluster"], r["placement"], r["setting"]) not in done]
        runs += rows
        out = {
            "format": "helixserve.benchmarks.full_size/v1",
            "emulated": True,
            "command": command,
            "commands": sorted({r["benchmark_command"] for r in runs}),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": {"hostname": platform.node(), "cpus": os.cpu_count(),
                        "platform": platform.platform(), "python": platform.python_version()},
            "helix_prototype_single24_decode_tokens_per_s": HELIX_PROTOTYPE_SINGLE24_DECODE,
            "planner_point": planner_point(runs),
            "runs": runs,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="full-size-") as tmp:
        for cluster in args.clusters:
            for placement in args.placements:
                path, meta = placement_file(cluster, placement, args.work_limit)
                placements_meta[f"{cluster}/{placement}"] = meta
                for setting in args.settings:
                    row = rehearse(cluster, path, setting, args,
                                   Path(tmp) / f"{cluster}-{placement}-{setting}.json")
                    row |= {"placement": placement, "placement_meta": meta,
                            "benchmark_command": command, "time_scale": args.time_scale}
                    row["summary"] = summary(row)
                    rows.append(row)
                    write()
                    print_table(cluster, [row], args.time_scale)
                    sys.stdout.flush()

    print("\n=== all runs ===")
    for cluster in args.clusters:
        print_table(cluster, [r for r in rows if r["cluster"] == cluster], args.time_scale)
    print("\nplanner's point (decode tokens/s ratios; measured = the runtime, simulated = "
          "the simulator on the same placement):")
    for key, point in planner_point(rows).items():
        print(f"  {key}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                       for k, v in point.items()))
    helix = [r for r in rows if (r["cluster"], r["placement"], r["setting"])
             == ("single-24", "helix", "offline") and r["summary"]]
    if helix:
        print(f"\nHelix's prototype on its single-24 placement: {HELIX_PROTOTYPE_SINGLE24_DECODE} "
              "decode tokens/s (real GPUs, vLLM 0.4); this EMULATED runtime: "
              f"{helix[0]['summary']['decode_measured']:.1f} (simulated "
              f"{helix[0]['summary']['decode_simulated']:.1f}), time scale {args.time_scale:g}")
    write()
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["rc"] == 0 and r["summary"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
