"""A rehearsal's inputs are checked before anything starts (helixserve/rehearse/inputs.py), with
one line naming the file, the field and the value; and the measured side's numbers follow the
simulator's rules (helixserve/rehearse/run.py), here on hand-made request timings."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from helixserve.bench.client import RequestResult
from helixserve.errors import UserError
from helixserve.rehearse.inputs import load_inputs, reserve_ports
from helixserve.rehearse.rehearsal import RehearsalOptions
from helixserve.rehearse.run import (
    Drive,
    Sent,
    measured_metrics,
    offline_concurrency,
    planned_load_note,
    unsaturated_note,
)
from helixserve.simulator.workload import TraceRequest

TESTS = Path(__file__).resolve().parents[2]


def data(*parts: str) -> Path:
    """A file of the shared test data: tests/data/shared, or examples/ where it moved."""
    for root in (TESTS / "data" / "shared", TESTS.parent / "examples"):
        if (root / parts[0]).exists():
            return root.joinpath(*parts)
    raise FileNotFoundError("/".join(parts))


MODEL = data("models", "llama-2-70b")
PROFILES = data("profiles", "helix-measured.csv")
CLUSTER = TESTS / "data" / "rehearse" / "six-nodes.yaml"
PLACEMENT = TESTS / "data" / "rehearse" / "six-nodes.json"
TRACE = TESTS / "data" / "rehearse" / "small-trace.csv"


def load(**paths: Path) -> object:
    args = {"cluster_path": CLUSTER, "model_dir": MODEL, "profiles_path": PROFILES,
            "placement_path": PLACEMENT, "trace_path": TRACE, **paths}
    return load_inputs(**args)


def placement_with(tmp_path: Path, **change: object) -> Path:
    raw = json.loads(PLACEMENT.read_text())
    raw.update(change)
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(raw))
    return path


def test_the_example_loads_with_flows_evaluated():
    inputs = load()
    assert [r.name for r in inputs.placement.nodes] == ["a0", "a1", "t0", "t1", "t2", "t3"]
    assert inputs.placement.flows and inputs.placement.throughput_tokens_per_s > 0
    assert len(inputs.requests) == 40 and inputs.requests[0].arrival_s == 0.0
    # offline streams: what the KV of the layer with the least holds, of mean requests
    assert 1 <= offline_concurrency(inputs) <= 256


def test_fewer_streams_than_the_kv_holds_are_said_not_to_saturate():
    inputs = load()
    held = offline_concurrency(inputs, limit=4096)
    assert unsaturated_note(inputs, held) == ""
    assert unsaturated_note(inputs, held - 1) == (
        f"; not saturated: the KV holds {held} requests, --concurrency {held} fills it")


def test_a_placement_planned_for_another_load_says_which(tmp_path):
    inputs = load()
    assert planned_load_note(inputs, 16) == ""  # planned saturated: nothing to say
    raw = json.loads(PLACEMENT.read_text())
    planned = load(placement_path=placement_with(tmp_path, served_concurrency=32))
    assert planned_load_note(planned, 32) == ""
    assert planned_load_note(planned, 16) == (
        "; the placement was planned for 32 requests in flight, --concurrency 32 rehearses "
        "that load")
    assert raw.get("served_concurrency") is None


def test_node_not_in_the_cluster(tmp_path):
    raw = json.loads(PLACEMENT.read_text())
    raw["nodes"][2]["name"] = "t9"
    with pytest.raises(UserError, match=r"placement.json: nodes\[2\].name: 't9' is not a node of "
                                        r".*six-nodes.yaml"):
        load(placement_path=placement_with(tmp_path, nodes=raw["nodes"]))


def test_ranges_that_leave_layers_uncovered(tmp_path):
    raw = json.loads(PLACEMENT.read_text())
    raw["nodes"] = [n for n in raw["nodes"] if n["name"] != "t1"]
    with pytest.raises(UserError, match=r"placement.json: nodes: layers \[40, 60\) are held by "
                                        r"no node"):
        load(placement_path=placement_with(tmp_path, nodes=raw["nodes"]))


def test_gpu_without_profile_rows(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER.read_text().replace("{name: t3, gpu: T4, num_gpus: 4",
                                                   "{name: t3, gpu: H100-80GB, num_gpus: 1"))
    with pytest.raises(UserError, match=r"helix-measured.csv: gpu: no prompt and decode rows "
                                        r"for 'H100-80GB' x1 \(node 't3' in .*cluster.yaml\)"):
        load(cluster_path=cluster)


def test_trace_without_rows(tmp_path):
    trace = tmp_path / "empty.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(UserError, match=r"--trace: .*empty.csv: no requests"):
        load(trace_path=trace)


def test_port_range_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        base = port - 1
        with pytest.raises(UserError, match=rf"--base-port {base}: port {port} on 127.0.0.1 "
                                            r"\(node b's link proxy\) is in use"):
            reserve_ports(base, ["the API", "node b's link proxy", "node b's worker"])


def test_option_bounds():
    base = {"cluster": CLUSTER, "model": MODEL, "profiles": PROFILES, "placement": PLACEMENT,
            "trace": TRACE}
    for bad, match in (({"duration_s": 0}, "--duration"), ({"warmup_s": 60}, "--warmup"),
                       ({"time_scale": 0}, "--time-scale"), ({"concurrency": 4}, "--offline")):
        with pytest.raises(UserError, match=match):
            RehearsalOptions(**base, **bad).check()


def _sent(arrival_s: float, ttft_s: float, gaps: list[float], out: int, prompt: int,
          finished: bool) -> Sent:
    r = RequestResult(success=finished, prompt_tokens=prompt if finished else 0,
                      output_tokens=out if finished else 0, ttft_s=ttft_s, itl_s=gaps,
                      e2e_s=ttft_s + sum(gaps) if finished else 0.0, start_s=100.0 + arrival_s)
    return Sent(TraceRequest("r", arrival_s, prompt, out), arrival_s, r)


def test_measured_numbers_follow_the_simulators_rules():
    run = Drive([
        _sent(0.0, 1.0, [0.5] * 3, out=4, prompt=100, finished=True),  # tokens at 1, 1.5, 2, 2.5
        _sent(2.0, 1.0, [1.0] * 5, out=9, prompt=50, finished=False),  # cut: tokens at 3..8
        _sent(9.5, 1.0, [], out=2, prompt=70, finished=False),  # first token after the window
    ], t0=100.0, wall_s=10.0)
    m = measured_metrics(run, time_scale=1.0, warmup_s=0.0, duration_s=8.0)
    assert m["decode_tokens_per_s"] == pytest.approx((4 + 6) / 8.0)
    assert m["prompt_tokens_per_s"] == pytest.approx((100 + 50) / 8.0)
    assert m["requests_finished"] == 1 and m["ttft_p50_s"] == pytest.approx(1.0)
    assert m["tpot_p50_s"] == pytest.approx(0.5)
    # at time scale 2 the same wall timings are half as long in cluster time
    half = measured_metrics(run, time_scale=2.0, warmup_s=0.0, duration_s=4.0)
    assert half["decode_tokens_per_s"] == pytest.approx(2 * m["decode_tokens_per_s"])
    assert half["tpot_p50_s"] == pytest.approx(0.25)


def test_report_table_says_emulated_and_shows_missing_numbers_as_dashes():
    from helixserve.rehearse.report import format_report

    sides = {"decode_tokens_per_s": 10.0, "prompt_tokens_per_s": 100.0, "ttft_p50_s": None,
             "ttft_p95_s": None, "tpot_p50_s": None, "tpot_p95_s": None, "requests_sent": 3,
             "requests_finished": 0, "requests_failed": 0, "output_tokens": 40}
    report = {
        "time_scale": 2.0, "mode": "offline", "concurrency": 3, "rate_per_s": None,
        "cluster": "c", "model": "m", "placement": {"planner": "milp",
                                                    "max_flow_tokens_per_s": 50.0},
        "warmup_s": 0.0, "duration_s": 4.0, "measured": sides, "simulated": dict(sides),
        "preemptions": {"measured": None, "simulated": 0},
        "nodes": {"n0": {"gpu": "L4", "num_gpus": 1, "start_layer": 0, "end_layer": 80,
                         "busy_measured": None, "busy_simulated": 0.5, "steps": None,
                         "cpu_s": None, "overrun_s": None}},
        "links": {"n0->x": {"src": "n0", "dst": "x", "bandwidth_gbps": None,
                            "latency_ms": None, "bytes_measured": 10, "bytes_simulated": 0,
                            "unlinked": True}},
        "cpu_s": {"coordinator": 1.0, "workers": 2.0, "links": 0.5, "client": 0.1},
        "runtime_cpu_ms_per_token": 75.0, "errors": ["HTTP 429: queue full"],
        "machine": {"cpus": 2, "loadavg_1m_before": 1.0, "loadavg_1m_after": 2.0},
    }
    text = format_report(report)
    assert text.startswith("helixserve rehearse: EMULATED") and "measured (EMULATED)" in text
    assert "time scale 2: every GPU and link time x 2" in text
    ttft = next(line for line in text.splitlines() if line.startswith("TTFT p50"))
    assert ttft.split()[3:] == ["-", "-", "-"]
    assert "(no link in the cluster file)" in text and "error: HTTP 429: queue full" in text
    assert "75.00 ms a token" in text
    assert "unattributed" not in text  # none lost: no line
    report["unattributed_links"] = {"n0": {"bytes_in": 1000, "bytes_out": 234, "connections": 1}}
    assert "unattributed (caller not found, on no link): 1,234 bytes to n0" in format_report(report)
    assert "runtime CPU: coordinator" in text  # a report without `runtime` (older JSON)
    assert "workers' CPU by thread: not measured" in text  # an older report: no split
    report["cpu_s"]["worker_threads"] = {"event_loop": 1.2, "engine": 0.5, "grpc_core": 0.3,
                                         "other": 0.1}
    assert ("workers' CPU by thread over the run: event loop 1.2 s, engine threads 0.5 s, "
            "gRPC core threads 0.3 s") in format_report(report)
    report["runtime"] = {"dataplane": "stream"}
    assert "runtime CPU (stream data plane): coordinator" in format_report(report)


def test_the_data_plane_is_recorded_and_a_bad_one_refused_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from helixserve.rehearse.rehearsal import runtime_choices
    from helixserve.runtime.dataplane import DATAPLANE_ENV

    monkeypatch.delenv(DATAPLANE_ENV, raising=False)
    assert runtime_choices() == {"dataplane": "grpc"}
    monkeypatch.setenv(DATAPLANE_ENV, "stream")
    assert runtime_choices() == {"dataplane": "stream"}
    monkeypatch.setenv(DATAPLANE_ENV, "tcp")
    with pytest.raises(UserError, match="HELIXSERVE_DATAPLANE: unknown data plane 'tcp'"):
        runtime_choices()


def test_unattributed_traffic_is_counted_between_the_runs_two_reads():
    from helixserve.rehearse.rehearsal import _count_deltas

    before = {"n1": {"bytes_in": 10, "bytes_out": 0, "connections": 1}}
    after = {"n1": {"bytes_in": 10, "bytes_out": 0, "connections": 1},
             "n2": {"bytes_in": 5, "bytes_out": 7, "connections": 2}}
    assert _count_deltas(before, after) == {"n2": {"bytes_in": 5, "bytes_out": 7,
                                                   "connections": 2}}
    assert _count_deltas({}, {}) == {}


def test_ports_the_rehearsal_picks_are_distinct_and_below_the_ephemeral_range() -> None:
    import socket

    from helixserve.rehearse.inputs import LOW_PORT, ephemeral_range, free_ports

    ports = free_ports(90)
    assert len(set(ports)) == 90
    lo, _ = ephemeral_range()
    if lo - LOW_PORT >= 4 * 90:  # else the OS picks them
        assert all(LOW_PORT <= p < lo for p in ports)
    for p in ports[:5]:  # free once returned
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
