"""plan --serve-concurrency N: the served objective scores every placement at N requests in
flight (simulator/selection.py SelectionConfig.concurrency), and says so."""

from __future__ import annotations

import json
import re

import pytest

from helixserve.cli import main


def _served_line(text: str) -> str:
    return next(x for x in text.splitlines() if x.startswith("served ("))


def test_the_plan_says_the_load_it_was_scored_at_and_serves_less_at_a_light_one(
        tmp_path, capsys):
    served = {}
    out = tmp_path / "p.json"
    for load in (None, "2"):
        flags = [] if load is None else ["--serve-concurrency", load]
        assert main(["plan", "--example", "--work-limit", "3", "--serve-duration", "40",
                     "--serve-also", "none", "--jobs", "1", "--quiet", "--out", str(out),
                     *flags]) == 0
        line = _served_line(capsys.readouterr().out)
        assert ("2 requests in flight" if load else
                "as many requests in flight as the KV admits") in line, line
        m = re.search(r"\): ([\d,.]+) decode tokens/s", line)
        assert m, line
        served[load] = float(m.group(1).replace(",", ""))
        # the placement says the load it was planned for (docs/formats.md), only when stated
        assert json.loads(out.read_text()).get("served_concurrency") == (load and int(load))
    assert 0 < served["2"] < served[None]
    # evaluate --served scores the placement at the same load: plan's number
    assert main(["evaluate", "--example", "--placement", str(out), "--served",
                 "--serve-duration", "40", "--serve-also", "none", "--serve-concurrency", "2",
                 "--jobs", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert round(got["served_tokens_per_s"], 1) == served["2"]
    assert got["served_window"].endswith(", 2 requests in flight")


@pytest.mark.parametrize(("flags", "needle"), [
    (["--serve-concurrency", "0"], "--serve-concurrency: bad value 0; need an integer >= 1"),
    (["--serve-concurrency", "8", "--serve-mode", "replay"],
     "--serve-concurrency: 8 with --serve-mode replay; a stated load needs --serve-mode "
     "saturate"),
    (["--serve-concurrency", "8", "--objective", "flow"],
     "--serve-concurrency: 8 needs a served score"),
])
def test_a_load_that_cannot_be_planned_for_is_one_line_and_exit_2(flags, needle, capsys):
    assert main(["plan", "--example", "--quiet", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_a_placement_keeps_its_stated_load_and_refuses_a_bad_one(tmp_path):
    from helixserve.errors import UserError
    from helixserve.planner import load_placement
    from helixserve.planner.placement import NodeRange, Placement

    p = Placement("m", "c", 4, "milp", [NodeRange("a", 0, 4)], served_concurrency=256)
    path = tmp_path / "p.json"
    p.save(path)
    assert load_placement(path).served_concurrency == 256
    raw = json.loads(path.read_text())
    for bad in (0, 2.5, "256", True):
        path.write_text(json.dumps({**raw, "served_concurrency": bad}))
        with pytest.raises(UserError, match=rf"{path}: served_concurrency: expected an integer"):
            load_placement(path)
