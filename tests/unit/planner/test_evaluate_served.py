"""`helixserve evaluate --served` gives the number `plan` prints for the placement it picks
(the served objective's scorer, same engine models, memory, requests and window)."""

from __future__ import annotations

import json
import re

from helixserve.cli import main


def test_evaluate_served_gives_plan_served_numbers(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--example", "--work-limit", "3", "--serve-duration", "40",
                 "--jobs", "1", "--quiet", "--out", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("served ("))
    m = re.search(r"\): ([\d,.]+) decode tokens/s, helix-prototype engine ([\d,.]+) from", line)
    assert m, line
    planned = [float(g.replace(",", "")) for g in m.groups()]
    assert main(["evaluate", "--example", "--placement", str(out), "--served",
                 "--serve-duration", "40", "--jobs", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["served_engine"] == "vllm" and got["served_also_engine"] == "helix-prototype"
    assert [round(got["served_tokens_per_s"], 1), round(got["served_also_tokens_per_s"], 1)] \
        == planned
    # evaluate's own keys are kept, the max flow with the cost model's default memory
    assert got["throughput_tokens_per_s"] > got["served_tokens_per_s"] and got["flows"]
    assert main(["evaluate", "--example", "--placement", str(out), "--served",
                 "--serve-duration", "40", "--serve-also", "none", "--jobs", "1"]) == 0
    text = capsys.readouterr().out
    assert "served estimate (simulated as plan's served objective scores it: vllm engine, " \
        "offline, 40 s, the first 10 s not counted" in text
    assert f"{planned[0]:,.1f} decode tokens/s;" in text and "max flow (" in text


def test_evaluate_without_served_prints_no_estimate(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--example", "--objective", "flow", "--work-limit", "1", "--jobs",
                 "1", "--quiet", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--example", "--placement", str(out), "--json"]) == 0
    assert "served_tokens_per_s" not in json.loads(capsys.readouterr().out)
    assert main(["evaluate", "--example", "--placement", str(out), "--served",
                 "--serve-duration", "0"]) == 2
    assert "--serve-duration: bad value 0.0" in capsys.readouterr().err
