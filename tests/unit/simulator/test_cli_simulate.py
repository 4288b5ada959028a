"""`helixserve simulate` end to end on small inputs (shared cluster, real profiles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helixserve.cli import main

KEYS = ("decode_throughput_tokens_per_s", "prompt_throughput_tokens_per_s", "requests_finished")


def args(shared: Path, *extra: str) -> list[str]:
    return [
        "simulate",
        "--cluster", str(shared / "clusters/helix-single-24.yaml"),
        "--model", str(shared / "models/llama-2-70b"),
        "--profiles", str(shared / "profiles/helix-measured.csv"),
        "--trace", str(shared / "traces/azure-llm-conv-2023.csv"),
        "--quiet",
        *extra,
    ]  # fmt: skip


def test_simulate_plans_and_writes_json_and_plots(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    code = main(
        args(
            shared_data,
            "--placement",
            "separate",
            "--rate",
            "2",
            "--duration",
            "30",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
        )
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "decode throughput" in table
    summary = json.loads(out.read_text())
    for key in KEYS:
        assert summary[key] > 0, key
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < summary[key]["p50"] <= summary[key]["p99"]
    assert len(summary["nodes"]) == 24 and summary["links"]
    for name in ("latency_cdf.png", "throughput.png", "node_utilization.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_simulate_reads_a_placement_file_without_flows(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two pipelines of A100 + L4 + T4 machines, hand-written, flows left out.
    nodes = [
        ("n6", 0, 12),
        ("n9", 12, 24),
        ("n10", 24, 36),
        ("n17", 36, 48),
        ("n0", 48, 55),
        ("n3", 55, 62),
        ("n5", 62, 69),
        ("n11", 69, 76),
        ("n1", 76, 80),
    ]
    placement = {
        "model": "llama-2-70b",
        "cluster": "helix-single-24",
        "num_layers": 80,
        "nodes": [{"name": n, "start_layer": s, "end_layer": e} for n, s, e in nodes],
    }
    path = tmp_path / "p.json"
    path.write_text(json.dumps(placement))
    code = main(
        args(
            shared_data,
            "--placement",
            str(path),
            "--offline",
            "--duration",
            "20",
            "--scheduler",
            "shortest-queue",
            "--json",
        )
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["mode"] == "offline" and summary["max_flow_tokens_per_s"] > 0
    assert summary["decode_throughput_tokens_per_s"] > 0


def test_unknown_scheduler_is_a_one_line_user_error(
    shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        args(shared_data, "--placement", "separate", "--scheduler", "fifo", "--duration", "5")
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown routing policy 'fifo'" in err and "maxflow" in err
