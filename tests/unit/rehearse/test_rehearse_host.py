"""Whether the host kept up with the emulated cluster (rehearsal.host_check), and what the
report says about it: from a report's own numbers, no processes."""

from __future__ import annotations

from typing import Any

from helixserve.rehearse.rehearsal import (
    HOST_CPU_SHARE_AIM,
    HOST_CPU_SHARE_MAX,
    OVERRUN_SHARE_MAX,
    host_check,
)
from helixserve.rehearse.report import _host_lines


def report(*, runtime_s: float, window_runtime_s: float | None, overrun_s: float,
           busy: float = 0.5, k: float = 4.0, cpus: int = 2) -> dict[str, Any]:
    """A rehearsal of 100 s of cluster time (40 s not counted) at time scale `k` on `cpus`
    cores, two nodes each `busy`, the processes' CPU split as a real report splits it."""
    wall = 100.0 * k
    return {
        "time_scale": k, "duration_s": 100.0, "warmup_s": 40.0,
        "machine": {"cpus": cpus},
        "cpu_s": {"coordinator": 0.1 * runtime_s, "workers": 0.7 * runtime_s,
                  "links": 0.15 * runtime_s, "client": 0.05 * runtime_s, "wall_s": wall},
        **({"cpu_s_window": {"coordinator": 0.1 * window_runtime_s,
                             "workers": 0.75 * window_runtime_s,
                             "links": 0.15 * window_runtime_s}}
           if window_runtime_s is not None else {}),
        "nodes": {n: {"busy_measured": busy, "overrun_s": overrun_s / 2} for n in ("a", "b")},
    }


def test_a_host_with_room_kept_up():
    # 0.3 of 2 cores over the run, 0.35 in the window's 240 s of wall time, steps 0.5% late
    r = report(runtime_s=0.3 * 2 * 400, window_runtime_s=0.35 * 2 * 240,
               overrun_s=0.005 * 2 * 0.5 * 400)
    h = host_check(r)
    assert h == {"cpu_share": 0.3, "cpu_share_window": 0.35, "overrun_share": 0.005,
                 "kept_up": True, "time_scale_hint": None}
    lines = _host_lines({**r, "host": h})
    assert lines == ["host: the rehearsal's processes used 30% of the 2 CPUs over the run "
                     "(35% in the window); the emulated GPUs' steps ran late by 0.5% of their "
                     "time"]


def test_a_starved_window_is_not_kept_up_and_a_time_scale_is_suggested():
    # fine over the run, but the window (the steady state) used 0.9 of the cores
    r = report(runtime_s=0.5 * 2 * 400, window_runtime_s=0.9 * 2 * 240, overrun_s=0.0)
    h = host_check(r)
    assert h["cpu_share_window"] == 0.9 > HOST_CPU_SHARE_MAX and not h["kept_up"]
    # to bring 0.9 at time scale 4 to the aim: 4 x 0.9 / aim, rounded up
    assert h["time_scale_hint"] == -(-4 * 0.9 // HOST_CPU_SHARE_AIM) == 9
    lines = _host_lines({**r, "host": h})
    assert lines[1].startswith("WARNING: this host did not keep up")
    assert "--time-scale 9 or more" in lines[1]


def test_late_steps_alone_are_not_kept_up():
    # light CPU, but the emulated GPUs' steps ended late by 3% of their time
    r = report(runtime_s=0.2 * 2 * 400, window_runtime_s=None, overrun_s=0.03 * 2 * 0.5 * 400)
    h = host_check(r)
    assert h["cpu_share_window"] is None and h["overrun_share"] == 0.03 > OVERRUN_SHARE_MAX
    assert not h["kept_up"]
    # the hint never leaves the time scale where it was
    assert h["time_scale_hint"] >= 5
    assert "(" not in _host_lines({**r, "host": h})[0]  # no window share to show


def test_an_older_report_without_the_check_prints_nothing():
    assert _host_lines(report(runtime_s=1.0, window_runtime_s=1.0, overrun_s=0.0)) == []
