"""The rehearsal's child entry point: the coordinator's step timeout reaches the stack, scaled
by the time scale; profiling writes one pstats file per process."""

from __future__ import annotations

import os
import pstats
import threading
from pathlib import Path

import pytest

from helixserve.rehearse import command
from helixserve.rehearse.cluster import EmulatedCluster
from helixserve.runtime.config import CoordinatorConfig


def test_serves_timing_flags_are_the_coordinators_fields() -> None:
    # the rehearsal passes its scaled timing as serve's own flags
    from helixserve.cli import build_parser
    from helixserve.commands.serve import timing_options
    from helixserve.errors import UserError

    parser = build_parser()
    base = ["serve", "--cluster", "c.yaml", "--placement", "p.json", "--model", "m"]
    args = parser.parse_args([*base, "--step-timeout-s", "1200", "--stats-interval-s", "2",
                              "--hang-timeout-s", "80", "--admission-timeout-s", "480"])
    options = timing_options(args)
    assert options == {"step_timeout_s": 1200.0, "stats_interval_s": 2.0, "hang_timeout_s": 80.0,
                       "admission_timeout_s": 480.0}
    CoordinatorConfig(**options).check()  # every name is a field
    assert timing_options(parser.parse_args(base)) == {}
    with pytest.raises(UserError, match="--admission-timeout-s: bad value 0"):
        timing_options(parser.parse_args([*base, "--admission-timeout-s", "0"]))


def test_the_coordinators_timing_grows_with_the_time_scale() -> None:
    cluster = EmulatedCluster.__new__(EmulatedCluster)  # no ports, no processes
    cluster.time_scale = 8.0
    assert cluster.step_timeout_s == CoordinatorConfig().step_timeout_s * 8.0
    assert cluster.stats_interval_s == CoordinatorConfig().stats_interval_s * 8.0
    assert cluster.hang_timeout_s == CoordinatorConfig().hang_timeout_s * 8.0
    assert cluster.admission_timeout_s == CoordinatorConfig().admission_timeout_s * 8.0


def test_a_profiled_child_writes_its_threads_stats(tmp_path: Path) -> None:
    def busy() -> None:
        sum(i * i for i in range(20_000))

    def run() -> int:
        t = threading.Thread(target=busy, name="engine")
        t.start()
        t.join()
        return 3

    assert command._profiled(run, "worker", str(tmp_path)) == 3
    (dump,) = tmp_path.iterdir()
    assert dump.name == f"worker-{os.getpid()}.prof"
    funcs = {f[2] for f in pstats.Stats(str(dump)).stats}  # type: ignore[attr-defined]
    assert "busy" in funcs  # the thread's work is in the dump, not only the main thread's
