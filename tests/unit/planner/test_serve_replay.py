"""plan --serve-trace T --serve-mode replay: candidates serve the trace as recorded.

The assertions hold for any planned placement (the kept candidate is the best simulated
one), so the plan runs on a short deadline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helixserve.cli import main


def _burst(path: Path, n: int) -> Path:
    rows = [f"2023-11-16 18:15:46.0000000,{300 + 40 * i},{20 + 2 * i}" for i in range(n)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


def test_replay_selection_lets_the_baselines_compete_and_keeps_the_best(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    trace = _burst(tmp_path / "burst.csv", 4)
    assert main(["plan", "--example", "--objective", "flow", "--time-limit", "3", "--jobs", "1",
                 "--quiet",
                 "--out", str(out), "--serve-trace", str(trace), "--serve-mode", "replay",
                 "--serve-duration", "600"]) == 0
    text = capsys.readouterr().out
    assert "the trace replayed to its end, decode tokens over its makespan" in text
    planned = json.loads(out.read_text())
    assert planned["planner"] == "milp-serving"
    rows = [line.split() for line in
            text[text.index("serving selection"):text.index("cluster ")].splitlines()[3:]
            if line.strip()]
    sources = {(r[1:] if r[0] == "*" else r)[2] for r in rows}
    assert {"given:milp", "baseline:swarm", "baseline:separate", "baseline:petals"} <= sources
    kept = [r for r in rows if r[0] == "*"]
    served = [float((r[1:] if r[0] == "*" else r)[1].replace(",", "")) for r in rows]
    assert len(kept) == 1 and float(kept[0][2].replace(",", "")) == max(served) > 0


def test_unknown_serve_mode_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--example", "--serve-mode", "fastest"])
    assert exc.value.code == 2
    assert "--serve-mode: invalid choice: 'fastest'" in capsys.readouterr().err
