"""benchmarks/load_sweep.py: placements side by side at several offline loads, in the
rehearsal's simulator."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import load_sweep

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "examples" / "clusters" / "helix-single-24.yaml"
AUTHORS = REPO / "benchmarks" / "helix-placements" / "helix-single-24-llama-2-70b.json"


def test_more_streams_serve_more_and_the_json_has_every_row(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert load_sweep.main(["--cluster", str(CLUSTER), "--placements", str(AUTHORS),
                            "--concurrency", "4", "64", "0", "--window", "40", "10",
                            "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["concurrency"] for r in rows][:2] == [4, 64]
    assert rows[2]["concurrency"] == rows[2]["kv_streams"] > 64  # 0: what the KV holds
    assert 0 < rows[0]["decode_tokens_per_s"] < rows[1]["decode_tokens_per_s"]
    assert "helix-single-24-llama-2-70b.json" in capsys.readouterr().out


def test_a_bad_window_exits_2_naming_the_flag(capsys):
    assert load_sweep.main(["--cluster", str(CLUSTER), "--placements", str(AUTHORS),
                            "--window", "10", "20"]) == 2
    assert "--window: bad value 10 20" in capsys.readouterr().err


def test_placements_of_one_name_are_told_apart_by_their_folders():
    names = load_sweep.short_names(["a/x/p.json", "a/y/p.json", "a/q.json"])
    assert names == {"a/x/p.json": "x/p.json", "a/y/p.json": "y/p.json", "a/q.json": "q.json"}
