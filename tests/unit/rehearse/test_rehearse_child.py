"""The rehearsal's child entry point: the coordinator's step timeout reaches the stack, scaled
by the time scale; profiling writes one pstats file per process."""

from __future__ import annotations

import os
import pstats
import threading
from pathlib import Path

import pytest

from helixserve.local import stack
from helixserve.rehearse import child
from helixserve.rehearse.cluster import EmulatedCluster
from helixserve.runtime.config import CoordinatorConfig


def test_the_rehearsals_flags_are_taken_out_and_given_to_the_stack(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_run_stack(*args: object, **kwargs: object) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(stack, "run_stack", fake_run_stack)
    args = child._with_stack_options(["serve", child.STEP_TIMEOUT_FLAG, "1200.0",
                                      child.STATS_INTERVAL_FLAG, "2.0", "--port", "1"])
    assert args == ["serve", "--port", "1"]
    stack.run_stack()
    assert seen == {"step_timeout_s": 1200.0, "stats_interval_s": 2.0}
    # other commands, and serve without the flags, are left alone
    assert child._with_stack_options(["worker", "--port", "1"]) == ["worker", "--port", "1"]
    assert child._with_stack_options(["serve", "--port", "1"]) == ["serve", "--port", "1"]


def test_the_coordinators_timing_grows_with_the_time_scale() -> None:
    cluster = EmulatedCluster.__new__(EmulatedCluster)  # no ports, no processes
    cluster.time_scale = 8.0
    assert cluster.step_timeout_s == CoordinatorConfig().step_timeout_s * 8.0
    assert cluster.stats_interval_s == CoordinatorConfig().stats_interval_s * 8.0


def test_a_profiled_child_writes_its_threads_stats(tmp_path: Path) -> None:
    def busy() -> None:
        sum(i * i for i in range(20_000))

    def run() -> int:
        t = threading.Thread(target=busy, name="engine")
        t.start()
        t.join()
        return 3

    assert child._profiled(run, "worker", str(tmp_path)) == 3
    (dump,) = tmp_path.iterdir()
    assert dump.name == f"worker-{os.getpid()}.prof"
    funcs = {f[2] for f in pstats.Stats(str(dump)).stats}  # type: ignore[attr-defined]
    assert "busy" in funcs  # the thread's work is in the dump, not only the main thread's
