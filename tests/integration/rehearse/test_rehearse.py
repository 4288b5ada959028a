"""`helixserve rehearse` end to end, as a user runs it: a 6-machine LLaMA-2-70B cluster in two
regions (tests/data/rehearse: four stages of 20 layers, links of 10 Gbit/s inside a region and
1 Gbit/s, 10 ms between), six EMULATED workers, the link proxy, the real coordinator and
OpenAI API with mutual TLS, the bench client through HTTP, and the simulator on the same
placement and trace.

The bound, measured decode tokens/s within a factor 2 of the simulator's: the emulated GPUs
time every step as the simulator does (docs/emulated.md), so what can differ is what the
simulator leaves out (the runtime's own CPU, gRPC, TLS, the proxy and the client, on 2 shared
cores where the rehearsal itself competes with the runtime) and the edges of a short run (a
few requests, the pipeline filling and the run's cut). A factor 2 still catches what breaks a
rehearsal: a time scale applied twice or not at all, links not shaped, a stage that never
runs, tokens not counted; the runtime's real overhead is what the benchmarks measure.

Bad input exits 2 with one line and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TESTS = Path(__file__).resolve().parents[2]
REPO = TESTS.parent


def data(*parts: str) -> Path:
    """A file of the shared test data: tests/data/shared, or examples/ where it moved."""
    for root in (TESTS / "data" / "shared", REPO / "examples"):
        if (root / parts[0]).exists():
            return root.joinpath(*parts)
    raise FileNotFoundError("/".join(parts))


MODEL = data("models", "llama-2-70b")
PROFILES = data("profiles", "helix-measured.csv")
CLUSTER = TESTS / "data" / "rehearse" / "six-nodes.yaml"
PLACEMENT = TESTS / "data" / "rehearse" / "six-nodes.json"
TRACE = TESTS / "data" / "rehearse" / "small-trace.csv"
METRICS = ("decode_tokens_per_s", "prompt_tokens_per_s", "ttft_p50_s", "ttft_p95_s",
           "tpot_p50_s", "tpot_p95_s")


def rehearse(workdir: Path, *extra: str, timeout_s: float = 200.0,
             **paths: Path) -> subprocess.CompletedProcess[str]:
    files = {"cluster": CLUSTER, "model": MODEL, "profiles": PROFILES, "placement": PLACEMENT,
             "trace": TRACE, **paths}
    cmd = [sys.executable, "-m", "helixserve", "rehearse",
           *(x for k, v in files.items() for x in (f"--{k}", str(v))),
           "--workdir", str(workdir), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name `text` (the run's workdir)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_six_emulated_machines_measured_next_to_simulated(tmp_path):
    out = tmp_path / "report.json"
    proc = rehearse(tmp_path / "run", "--offline", "--concurrency", "16", "--duration", "12",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EMULATED" in proc.stdout and "measured (EMULATED)" in proc.stdout
    report = json.loads(out.read_text())
    assert report["format"] == "helixserve.rehearse/v1" and report["emulated"] is True
    assert report["prefix_caching"] is True
    for side in ("measured", "simulated"):
        assert all(report[side][k] > 0 for k in METRICS), report[side]
    measured, simulated = report["measured"], report["simulated"]
    ratio = measured["decode_tokens_per_s"] / simulated["decode_tokens_per_s"]
    assert 0.5 <= ratio <= 2.0, (measured, simulated)
    assert measured["requests_failed"] == 0 and report["errors"] == []
    assert report["runtime_cpu_ms_per_token"] > 0
    assert report["cpu_s"]["coordinator"] > 0 and report["cpu_s"]["workers"] > 0
    # the workers' CPU by thread: the named engine threads and the event loops both ran, and
    # the kinds add up to the workers' CPU (each is read at the same moments as the total)
    threads = report["cpu_s"]["worker_threads"]
    assert threads["engine"] > 0 and threads["event_loop"] > 0, threads
    assert abs(sum(threads.values()) - report["cpu_s"]["workers"]) < 0.1, threads
    assert "workers' CPU by thread" in proc.stdout
    # whether the host kept up, from the report's own numbers (rehearsal.host_check)
    host = report["host"]
    assert 0 < host["cpu_share"] <= 1.0 and 0 <= host["overrun_share"] < 1.0, host
    assert isinstance(host["kept_up"], bool), host
    assert "host: the rehearsal's processes used" in proc.stdout
    assert set(report["nodes"]) == {"a0", "a1", "t0", "t1", "t2", "t3"}
    assert all(n["busy_measured"] is not None and n["steps"] > 0
               for n in report["nodes"].values()), (report["nodes"], proc.stderr[-3000:])
    # the only route stage t0 -> t1 crosses regions: the link carries the real activations
    # (16 KiB a token) as the simulator sends them, plus gRPC and TLS framing
    cross = report["links"]["t0->t1"]
    assert cross["bandwidth_gbps"] == 1 and cross["latency_ms"] == 10
    assert 0.7 <= cross["bytes_measured"] / cross["bytes_simulated"] <= 1.5, cross
    assert report["links"]["coordinator->a0"]["bytes_measured"] > 0
    # the workers are forked from one pre-imported process (rehearse/forkserver.py)
    assert set(report["processes"]) == {"coordinator", "links", "forkserver", *(
        f"worker-{n}" for n in report["nodes"])}
    # everything it started is gone
    assert processes_mentioning(str(tmp_path / "run")) == []
    for pid in report["processes"].values():
        # a forked worker's command line is the fork server's, which names no path
        assert not Path(f"/proc/{pid}").exists() or not any(
            mark in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
            for mark in (str(tmp_path), "helixserve.rehearse.child"))
    assert (tmp_path / "run" / "logs" / "worker-t0.log").read_text().count("EMULATED") >= 2


def test_online_arrivals_at_a_rate(tmp_path):
    """The trace's arrivals rescaled to 3 requests/s: the same arrivals on both sides; with
    --no-prefix-caching every worker runs without its prefix cache and the report says so."""
    out = tmp_path / "report.json"
    proc = rehearse(tmp_path / "run", "--rate", "3", "--duration", "8", "--no-prefix-caching",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "online" and report["rate_per_s"] == 3
    assert report["prefix_caching"] is False
    assert "online, 3 requests/s, prefix caching off" in proc.stdout
    logs = sorted((tmp_path / "run" / "logs").glob("worker-*.log"))
    assert len(logs) == 6
    assert all("prefix caching off;" in log.read_text() for log in logs)
    measured, simulated = report["measured"], report["simulated"]
    # arrivals of 8 s at 3/s (the first at 0): the same requests sent on both sides
    assert measured["requests_sent"] == simulated["requests_sent"] > 15
    ratio = measured["decode_tokens_per_s"] / simulated["decode_tokens_per_s"]
    assert 0.5 <= ratio <= 2.0, (measured, simulated)
    assert processes_mentioning(str(tmp_path / "run")) == []


def _bad_placement(tmp_path: Path, **change: object) -> Path:
    raw = json.loads(PLACEMENT.read_text())
    raw.update(change)
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(raw))
    return path


def test_bad_input_exits_2_with_one_line_and_starts_nothing(tmp_path):
    nodes = json.loads(PLACEMENT.read_text())["nodes"]
    stranger = [dict(n, name="zz") if n["name"] == "t1" else n for n in nodes]
    gap = [n for n in nodes if n["name"] != "t1"]
    no_rows = tmp_path / "no-rows.yaml"
    no_rows.write_text(CLUSTER.read_text().replace("{name: t3, gpu: T4, num_gpus: 4",
                                                   "{name: t3, gpu: H100-80GB, num_gpus: 1"))
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cases = [
        ({"placement": _bad_placement(tmp_path / "a", nodes=stranger)},
         "nodes[3].name: 'zz' is not a node of"),
        ({"placement": _bad_placement(tmp_path / "b", nodes=gap)},
         "nodes: layers [40, 60) are held by no node"),
        ({"cluster": no_rows}, "gpu: no prompt and decode rows for 'H100-80GB' x1"),
        ({"trace": empty}, "empty.csv: no requests"),
    ]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cases.append(({}, f"port {port} on 127.0.0.1 (the OpenAI API) is in use"))
        for i, (paths, message) in enumerate(cases):
            extra = ["--base-port", str(port)] if not paths else []
            workdir = tmp_path / f"run{i}"
            proc = rehearse(workdir, *extra, timeout_s=120.0, **paths)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert len(lines) == 1 and message in lines[0], proc.stderr
            assert lines[0].startswith("helixserve rehearse: error: ")
            assert processes_mentioning(str(workdir)) == []
